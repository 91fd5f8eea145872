"""PNG plots for the benchmark results (matplotlib, imported lazily, Agg
backend so no display is needed).

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "t.png")
    >>> line_plot(path, {"a": ([1, 8], [1.0, 2.0])}, "batch", "s", "demo")
    True
"""
import os


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def line_plot(path, series, xlabel, ylabel, title, *, logx=False, logy=False, annotate=None):
    """One line per entry of `series` ({label: (xs, ys)}); None values are
    skipped.  `annotate` is an optional {label: [text per point]}.  Returns
    True when the file was written."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for label, (xs, ys) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for (x, y), text in zip(pts, (annotate or {}).get(label, [])):
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return os.path.exists(path)


def grouped_bars(path, groups, series, ylabel, title, *, logy=False):
    """Grouped bar chart: `groups` are the x tick labels, `series` is
    {label: [value per group]} (None leaves a gap)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.2), dpi=110)
    n = max(1, len(series))
    width = 0.8 / n
    for i, (label, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        pts = [(x, v) for x, v in zip(xs, values) if v is not None]
        ax.bar([p[0] for p in pts], [p[1] for p in pts], width=width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=7, rotation=30, ha="right")
    if logy:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return os.path.exists(path)
