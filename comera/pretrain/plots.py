"""PNG plots of a pre-training run (matplotlib's object API with the Agg
canvas, so no display and no global pyplot state are involved)."""
import os
from typing import Dict, List, Optional

from comera.storage import write_figure

COLORS = {"dense": "#1f77b4", "comera": "#d62728"}


def _figure(width=7.0, height=4.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def short_name(name: str) -> str:
    """A layer name short enough for a plot label.

    Example:
        >>> short_name("roberta.encoder.layer.3.attention.self.query")
        'L3.attn.query'
    """
    for a, b in (("roberta.encoder.layer.", "L"), ("roberta.embeddings.", "emb."),
                 ("attention.self.", "attn."), ("attention.output.", "attn.out."),
                 ("intermediate.dense", "ffn.in"), ("output.dense", "ffn.out")):
        name = name.replace(a, b)
    return name


def _finish(fig, ax, path: str, ylabel: str, title: str) -> str:
    """Labels a line plot over steps (legend when there are lines) and writes it."""
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    write_figure(path, fig)
    return path


def plot_valid_loss(results: Dict[str, dict], path: str) -> str:
    fig = _figure()
    ax = fig.add_subplot()
    for method, r in results.items():
        pts = r["history"]["valid"]
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", ms=3,
                    color=COLORS.get(method), label=method)
    return _finish(fig, ax, path, "validation MLM loss (nats/token)", "Validation loss")


def _smooth(values: List[float], window: int) -> List[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_train_loss(results: Dict[str, dict], path: str) -> str:
    fig = _figure()
    ax = fig.add_subplot()
    for method, r in results.items():
        h = r["history"]
        if h["loss"]:
            window = max(1, len(h["loss"]) // 50)
            ax.plot(h["step"], _smooth(h["loss"], window), color=COLORS.get(method), label=method)
    return _finish(fig, ax, path, "training MLM loss (moving average)", "Training loss")


def plot_compression(results: Dict[str, dict], path: str, target: Optional[float] = None) -> str:
    fig = _figure()
    ax = fig.add_subplot()
    for method, r in results.items():
        h = r["history"]
        if h["whole_compression"]:
            ax.plot([s for s, _ in h["whole_compression"]], [c for _, c in h["whole_compression"]],
                    color=COLORS.get(method), label=f"{method}: whole model")
        if method != "dense" and h["compression"]:
            ax.plot([s for s, _ in h["compression"]], [c for _, c in h["compression"]],
                    color=COLORS.get(method), ls="--", label=f"{method}: converted layers")
    if target:
        ax.axhline(target, color="gray", ls=":", label=f"target {target:g}x (converted layers)")
    ax.set_yscale("log")
    return _finish(fig, ax, path, "compression (dense params / params)", "Compression")


def plot_rank_heatmap(result: dict, path: str) -> Optional[str]:
    """One row per bond of every TT layer, one column per logged step; the
    colour is the live rank as a fraction of the bond's rank at the start."""
    ranks = result["history"]["ranks"]
    steps, layers = ranks["step"], ranks["layers"]
    if not steps or not layers:
        return None
    import numpy as np
    rows, labels, ticks, bounds = [], [], [], []
    for name, series in layers.items():
        n_bonds = len(series[0])
        ticks.append(len(rows))
        labels.append(short_name(name))
        for k in range(n_bonds):
            first = max(1, series[0][k])
            rows.append([s[k] / first if k < len(s) else 0.0 for s in series])
        bounds.append(len(rows))
    grid = np.array(rows, dtype=float)
    fig = _figure(8.0, max(3.0, min(0.06 * len(rows) + 1.5, 24.0)))
    ax = fig.add_subplot()
    # Cell edges halfway between logged steps, so each column sits on its step.
    xs = [float(x) for x in steps]
    if len(xs) == 1:
        edges = [xs[0] - 0.5, xs[0] + 0.5]
    else:
        mids = [(a + b) / 2 for a, b in zip(xs, xs[1:])]
        edges = [2 * xs[0] - mids[0]] + mids + [2 * xs[-1] - mids[-1]]
    im = ax.pcolormesh(edges, range(len(rows) + 1), grid, cmap="viridis", vmin=0.0, vmax=1.0,
                       shading="flat")
    ax.invert_yaxis()
    for b in bounds[:-1]:
        ax.axhline(b, color="white", lw=0.4)
    ax.set_yticks([t + 0.5 for t in ticks])
    ax.set_yticklabels(labels, fontsize=6)
    ax.set_xlabel("step")
    ax.set_title("Live TT ranks (each row a bond, each band a layer)")
    cbar = fig.colorbar(im, ax=ax)
    cbar.set_label("live rank / initial rank")
    fig.tight_layout()
    write_figure(path, fig)
    return path


def write_plots(run_dir: str, results: Dict[str, dict], target: Optional[float] = None) -> Dict[str, str]:
    """Writes every plot that the results allow; returns ``{kind: file name}``."""
    out = {}
    if not results:
        return out
    out["valid_loss"] = os.path.basename(plot_valid_loss(results, os.path.join(run_dir, "valid_loss.png")))
    out["train_loss"] = os.path.basename(plot_train_loss(results, os.path.join(run_dir, "train_loss.png")))
    out["compression"] = os.path.basename(
        plot_compression(results, os.path.join(run_dir, "compression.png"), target))
    for method, r in results.items():
        if r["history"]["ranks"]["layers"]:
            p = plot_rank_heatmap(r, os.path.join(run_dir, f"ranks_{method}.png"))
            if p:
                out[f"ranks_{method}"] = os.path.basename(p)
    return out
