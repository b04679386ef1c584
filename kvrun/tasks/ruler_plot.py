"""The scores of a kvrun ruler run as an image: a task x config heat map (matplotlib)."""

from __future__ import annotations

from .needle_plot import heat, pyplot, save


def plot_scores(path: str, rows: list[dict], configs, tasks: list[str], title: str) -> None:
    """Score per (config, task) and the average, red (0) to green (100)."""
    plt = pyplot()
    cols = tasks + ["average"]
    grid = [[r["tasks"].get(t, float("nan")) for t in tasks] + [r["average"] or float("nan")]
            for r in rows]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(4.5, 1.5 + 0.75 * len(cols)), 1.2 + 0.45 * len(rows)),
                           constrained_layout=True)  # fmt: skip
    image = heat(ax, grid, 100, ".0f")
    ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right")
    ax.set_yticks(range(len(rows)), [c.label for c in configs])
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, shrink=0.8, label="score")
    save(fig, path)
