"""Heat maps of a needle run as an image: one panel per KV method and budget (matplotlib)."""

from __future__ import annotations

from ..errors import KvrunError
from . import needle as nd


def require_matplotlib() -> None:
    """A one-line error when the optional plotting dependency is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KvrunError("--plot needs matplotlib: pip install matplotlib") from None


def pyplot():
    """matplotlib's pyplot on the file-only backend (one line where matplotlib is missing)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def heat(ax, grid: list[list[float]], top: float, fmt: str):
    """grid red (0) to green (top) on ax, each cell's value written in it (NaN: left blank)."""
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=top, aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:  # not NaN
                color = "white" if v < 0.15 * top or v > 0.85 * top else "black"  # dark ends
                ax.text(j, i, format(v, fmt), ha="center", va="center", fontsize=8, color=color)
    return image


def save(fig, path: str) -> None:
    """The figure into path (a one-line error where it cannot be written), then closed."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise KvrunError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)


def plot_heatmaps(path: str, records: list[dict], configs, lengths, depths) -> None:
    """Accuracy per (depth, length) cell, red (0) to green (1), one panel per config."""
    plt = pyplot()
    n = len(configs)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(1.2 + 0.9 * len(lengths) * cols, 0.8 + 0.55 * len(depths) * rows),
        squeeze=False,
        constrained_layout=True,
    )
    image = None
    for ax, cfg in zip(axes.flat, configs, strict=False):
        cells = nd.heat(records, cfg)
        grid = [
            [
                cells[(d, L)][0] / cells[(d, L)][1] if (d, L) in cells else float("nan")
                for L in lengths
            ]
            for d in depths
        ]
        image = heat(ax, grid, 1, ".0%")
        ax.set_title(cfg.label, fontsize=10)
        ax.set_xticks(range(len(lengths)), [nd.fmt_length(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [nd.fmt_depth(d) for d in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("needle depth")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy")
    save(fig, path)
