"""``metrics.json`` and ``report.md`` of a pre-training run."""
import os
from typing import Dict, List

from comera.pretrain.plots import write_plots
from comera.storage import write_json, write_text

# What every method's entry in metrics.json carries (tests check for them).
METRIC_KEYS = ("parameters", "compression_whole", "compression_converted", "valid_loss",
               "valid_perplexity", "tokens_per_s", "peak_memory_bytes", "peak_memory_kind",
               "peak_memory_growth_bytes",
               "wall_time_s", "train_time_s", "steps_done", "stopped")


def compare(results: Dict[str, dict]) -> dict:
    """CoMERA against dense, when both ran.

    Example:
        >>> r = {"valid_loss": 2.0, "tokens_per_s": 100.0, "peak_memory_bytes": 4, "steps_done": 5}
        >>> c = dict(r, valid_loss=2.1, tokens_per_s=150.0, compression_whole=4.5)
        >>> out = compare({"dense": r, "comera": c})
        >>> out["speedup_tokens_per_s"], round(out["valid_loss_relative_difference"], 3)
        (1.5, 0.05)
    """
    if "dense" not in results or "comera" not in results:
        return {}
    d, c = results["dense"], results["comera"]
    if not d["tokens_per_s"] or not d["valid_loss"]:
        return {}
    return {
        "compression_whole": c["compression_whole"],
        "speedup_tokens_per_s": c["tokens_per_s"] / d["tokens_per_s"],
        "valid_loss_relative_difference": (c["valid_loss"] - d["valid_loss"]) / d["valid_loss"],
        "peak_memory_ratio": (d["peak_memory_bytes"] / c["peak_memory_bytes"]
                              if c["peak_memory_bytes"] else None),
        # What each method itself allocated (model, optimizer, activations),
        # without the process's common baseline (libraries, data).
        "peak_memory_growth_ratio": (d.get("peak_memory_growth_bytes", 0) / c["peak_memory_growth_bytes"]
                                     if c.get("peak_memory_growth_bytes") else None),
        "same_steps": d["steps_done"] == c["steps_done"],
    }


def _mb(n) -> str:
    return f"{n / 2**20:,.1f} MiB" if n else "-"


def _table(results: Dict[str, dict]) -> List[str]:
    methods = list(results)
    rows = [
        ("steps done / planned", lambda r: f"{r['steps_done']} / {r['steps_planned']}"),
        ("stopped because", lambda r: r["stopped"]),
        ("parameters (total, live)", lambda r: f"{r['parameters']['total_live']:,}"),
        ("converted layers", lambda r: str(r["parameters"]["converted_layers"])),
        ("converted layers: dense -> TT params",
         lambda r: (f"{r['parameters']['converted_dense']:,} -> {r['parameters']['converted_tt']:,}"
                    if r["parameters"]["converted_layers"] else "-")),
        ("compression, whole model", lambda r: f"{r['compression_whole']:.2f}x"),
        ("compression, converted layers", lambda r: f"{r['compression_converted']:.2f}x"),
        ("validation MLM loss", lambda r: f"{r['valid_loss']:.4f}"),
        ("validation perplexity", lambda r: f"{r['valid_perplexity']:.2f}"),
        ("training tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
        ("peak memory", lambda r: f"{_mb(r['peak_memory_bytes'])} ({r['peak_memory_kind']})"),
        ("peak memory above the start of the method",
         lambda r: _mb(r.get("peak_memory_growth_bytes", 0))),
        ("wall time", lambda r: f"{r['wall_time_s']:.1f} s"),
        ("training time", lambda r: f"{r['train_time_s']:.1f} s"),
    ]
    out = ["| | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for label, fn in rows:
        out.append(f"| {label} | " + " | ".join(fn(results[m]) for m in methods) + " |")
    return out


def write_report(run_dir: str, *, config: dict, corpus: dict, tokenizer: dict, data: dict,
                 results: Dict[str, dict], requested: List[str], env: dict) -> dict:
    """Writes metrics.json, report.md and the plots; returns the metrics."""
    p = config["preset"]
    plots = write_plots(run_dir, results, p.get("target_compression"))
    tok_public = {k: v for k, v in tokenizer.items() if k != "fingerprint"}
    metrics = {"config": config, "environment": env, "corpus": corpus, "tokenizer": tok_public,
               "data": data, "methods": results, "comparison": compare(results), "plots": plots,
               "not_run": [m for m in requested if m not in results]}
    write_json(os.path.join(run_dir, "metrics.json"), metrics)

    lines = ["# comera pretrain report", "",
             f"Preset `{config['preset_name']}`: {p['layers']} encoders, hidden {p['hidden']}, "
             f"FFN {p['ffn']}, {p['heads']} heads, sequence {p['seq_len']}, batch {p['batch_size']}, "
             f"{p['steps']} steps, peak lr {p['lr']}"
             + (f" (CoMERA {p['lr_comera']})" if p.get("lr_comera") else "")
             + f", seed {config['seed']}.", "",
             f"Corpus: `{corpus['root']}`: {corpus['train_files']} training documents "
             f"({corpus['train_bytes'] / 1e6:.1f} MB), {corpus['valid_files']} validation documents "
             f"({corpus['valid_bytes'] / 1e6:.1f} MB); skipped {sum(corpus['skipped'].values())}"
             + (f" ({', '.join(f'{k}: {v}' for k, v in corpus['skipped'].items())})" if corpus["skipped"] else "")
             + ".",
             f"Tokenizer: byte-level BPE, {tokenizer['vocab_size']} tokens, trained on "
             f"{tokenizer['tokenizer_files']} training documents; {tokenizer['train_tokens']:,} training tokens "
             f"({data['train_blocks']:,} blocks), {data['valid_blocks']} validation blocks "
             f"({data['valid_masked_tokens']:,} masked tokens, the same masks for every evaluation).", "",
             f"Environment: torch {env['torch']}, device {env['device']}, {env['threads']} threads, "
             f"Python {env['python']}; {env.get('processes', 1)} process(es), {env.get('precision', 'fp32')}, "
             f"--grad-accum {env.get('grad_accum', 1)}{', compiled' if env.get('compile') else ''}.", ""]
    if results:
        lines += ["## Results", ""] + _table(results) + [""]
    if metrics["not_run"]:
        lines += [f"Not run (stopped before they started): {', '.join(metrics['not_run'])}.", ""]
    cmp_ = metrics["comparison"]
    if cmp_:
        lines += ["## CoMERA against dense", "",
                  f"- whole-model compression: {cmp_['compression_whole']:.2f}x",
                  f"- training speed: {cmp_['speedup_tokens_per_s']:.2f}x the dense tokens/s",
                  f"- validation loss: {100 * cmp_['valid_loss_relative_difference']:+.2f}% relative to dense",
                  (f"- peak memory: dense / CoMERA = {cmp_['peak_memory_ratio']:.2f}"
                   if cmp_["peak_memory_ratio"] else "- peak memory: -"),
                  (f"- memory the method itself needed (peak above its start): dense / CoMERA = "
                   f"{cmp_['peak_memory_growth_ratio']:.2f}" if cmp_.get("peak_memory_growth_ratio") else ""),
                  "" if cmp_["same_steps"] else "- note: the two methods ran different numbers of steps", ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()] + [""]
    for method, r in results.items():
        if r.get("summary"):
            lines += [f"## {method} layers", "", "```", r["summary"].rstrip(), "```", ""]
    write_text(os.path.join(run_dir, "report.md"), "\n".join(lines))
    return metrics
