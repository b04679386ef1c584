"""The scores of a kvrun ruler run as an image: a task x config heat map (matplotlib)."""

from __future__ import annotations

from ..errors import KvrunError
from .needle_plot import require_matplotlib


def plot_scores(path: str, rows: list[dict], configs, tasks: list[str], title: str) -> None:
    """Score per (config, task) and the average, red (0) to green (100)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    cols = tasks + ["average"]
    grid = [[r["tasks"].get(t, float("nan")) for t in tasks] + [r["average"] or float("nan")]
            for r in rows]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 + 0.75 * len(cols)), 1.2 + 0.45 * len(rows)),
                           constrained_layout=True)  # fmt: skip
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if v == v:  # not NaN
                color = "white" if v < 15 or v > 85 else "black"  # dark ends of RdYlGn
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right")
    ax.set_yticks(range(len(rows)), [c.label for c in configs])
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8, label="score")
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise KvrunError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
