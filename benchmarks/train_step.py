"""One training step of the encoder classifier (encoder.py) under three
methods, timed and with its whole-process peak memory:

    "dense AdamW"   the dense model, torch.optim.AdamW
    "GaLore AdamW"  the dense model, galore-torch's GaLoreAdamW: every encoder
                    linear's weight gets a rank-128 gradient projection
                    (update_proj_gap 200, scale 0.25, the GaLore paper's
                    recipe); the other parameters plain AdamW
    "comera"        every encoder linear and the word embedding in TT format
                    (rank 30), torch.optim.AdamW, plus comera's rank-adaptive
                    gate penalty and proximal step when comera has RankAdaptive

A step is: zero grads, forward, cross-entropy (+ penalty), backward,
optimizer step.  Inputs are random token ids (the cost does not depend on
them).

Two measurements, kept apart because they need different processes:

* ``run_case`` (memory, one method per fresh process): the peak RSS during
  the steps minus the RSS before the model was built (after one warm-up step
  of a tiny model of the same method, so that code and modules loaded once
  per process are not counted): weights, gradients, optimizer state,
  activations and workspace (GaLore's SVDs included: its first step computes
  them).
* ``time_methods`` (time, every method in one process): wall-clock medians
  of interleaved steps (benchmarks/timing.py).  GaLore recomputes its
  projections (one SVD per projected weight) every ``update_proj_gap``
  steps; a third variant with the gap set to 1 is timed alongside, and
  GaLore's amortised step = steady step + (SVD step - steady step) / gap.

Example:
    >>> res = run_case({"method": "comera", "preset": "tiny", "batch": 2, "rank": 4,
    ...                 "reps": 1})
    >>> res["method"], res["batch"], res["steps_run"]
    ('comera', 2, 2)
"""
import os

import torch
import torch.nn.functional as F

import comera
from common import peak_rss_bytes, release_freed_memory, reset_peak_rss, rss_bytes
from timing import interleaved
from encoder import PRESETS, build_model, encoder_linear_names

METHODS = ["dense AdamW", "GaLore AdamW", "comera"]
GALORE = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
LR = 1e-4


# Timed only (never a row of its own): GaLore with its projections recomputed
# at every step, to measure what the periodic SVDs cost.
GALORE_SVD = "GaLore AdamW (SVD every step)"


def make_optimizer(method, model):
    if method in ("GaLore AdamW", GALORE_SVD):
        from galore_torch import GaLoreAdamW  # benchmark-only dependency
        low_rank = [model.get_submodule(n).weight for n in encoder_linear_names(model)]
        ids = {id(p) for p in low_rank}
        rest = [p for p in model.parameters() if id(p) not in ids]
        group = dict(GALORE, update_proj_gap=1) if method == GALORE_SVD else GALORE
        return GaLoreAdamW([{"params": rest}, dict(params=low_rank, **group)], lr=LR,
                           no_deprecation_warning=True)
    return torch.optim.AdamW(model.parameters(), lr=LR)


def make_rank_adaptive(model):
    """comera's stage-1 controller (gate L1 penalty + proximal step), or None
    while comera has no RankAdaptive."""
    if not hasattr(comera, "RankAdaptive"):
        return None
    return comera.RankAdaptive(model, gamma=1e-4, threshold=1e-3, stage1_steps=10 ** 6,
                               stage2_steps=1)


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def optimizer_state_bytes(opt):
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
            elif hasattr(v, "ortho_matrix") and torch.is_tensor(v.ortho_matrix):  # GaLore projector
                total += v.ortho_matrix.numel() * v.ortho_matrix.element_size()
    return total


def _setup(cfg, method, batch, rank, state_path=None):
    """Model, optimizer and controller of `method`; returns the step function
    and the objects it trains."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    labels = torch.randint(0, cfg.classes, (batch,), generator=g)
    model = build_model(cfg, "comera" if method == "comera" else "dense", rank=rank)
    if state_path:  # a pruned comera model: load its (smaller) ranks and weights
        comera.load_state_dict(model, torch.load(state_path))
    model.train()
    opt = make_optimizer(method, model)
    ra = make_rank_adaptive(model) if method == "comera" else None

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(ids), labels)
        if ra is not None:
            loss = loss + ra.penalty()
        loss.backward()
        opt.step()
        if ra is not None:
            ra.step(opt)

    return step, model, opt, ra


def warm_up_process(method):
    """One step of the tiny preset's model under `method`.  The first step of
    a process imports and touches code that stays resident whatever the model
    (torch.optim alone pulls in torch._dynamo, about 70 MB); that is a cost of
    the process, not of training this model, so every method pays it before
    its baseline is taken."""
    step, *_ = _setup(PRESETS["tiny"], method, 2, 4)
    step()


def run_case(case):
    """Memory of case["method"]: builds its model and optimizer in this
    process, runs one warm-up step and case["reps"] more (default 1), and
    returns the peak RSS growth, sizes and optimizer state as a dict.  Time
    is measured by :func:`time_methods`, not here."""
    cfg = PRESETS[case["preset"]]
    batch, method = case["batch"], case["method"]
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    warm_up_process(method)
    release_freed_memory()
    base = rss_bytes()
    step, model, opt, ra = _setup(cfg, method, batch, case.get("rank", 30), case.get("state_path"))

    # Construction transients (the dense model a conversion starts from) are
    # not part of training: return them to the OS and restart the peak.
    release_freed_memory()
    peak_reset = reset_peak_rss()
    steps = 1 + case.get("reps", 1)
    for _ in range(steps):
        step()
    peak = peak_rss_bytes() - base
    params = list(model.parameters())
    return {
        "method": method, "preset": case["preset"], "batch": batch, "seq": cfg.seq,
        "steps_run": steps, "threads": torch.get_num_threads(),
        "peak_bytes": peak, "peak_reset_ok": peak_reset,
        "param_count": sum(p.numel() for p in params), "param_bytes": tensor_bytes(params),
        "optimizer_state_bytes": optimizer_state_bytes(opt),
        "rank_adaptive": ra is not None,
        "pruned_from": os.path.basename(case["state_path"]) if case.get("state_path") else None,
    }


def time_methods(case):
    """Wall-clock time of one training step of every method in
    case["methods"] (a list of [label, method, state_path or None]), built in
    this process and timed interleaved (timing.interleaved: one warm-up step
    each, then rounds in shuffled order, case["reps"] rounds or until
    case["budget_s"] seconds).  With GaLore among them, GaLore with the
    projection recomputed every step is timed too and GaLore's row gets
    ``amortised_wall_s`` = steady + (SVD step - steady) / update_proj_gap.

    Returns {"threads", "methods": {label: {"wall": spread, "cpu": spread}}}
    (seconds; spread = median, min, max, iqr, reps)."""
    cfg = PRESETS[case["preset"]]
    entries = [tuple(e) for e in case["methods"]]
    if any(m == "GaLore AdamW" for _, m, _ in entries):
        entries.append((GALORE_SVD, GALORE_SVD, None))
    steps = {}
    for label, method, state in entries:
        steps[label] = _setup(cfg, method, case["batch"], case.get("rank", 30), state)[0]
    res = interleaved(steps, reps=case.get("reps", 5), warmup=1, budget_s=case.get("budget_s"))
    if GALORE_SVD in res:
        svd = res.pop(GALORE_SVD)
        for label, method, _ in entries:
            if method == "GaLore AdamW":
                steady = res[label]["wall"]["median"]
                res[label]["svd_step_wall_s"] = svd["wall"]["median"]
                res[label]["amortised_wall_s"] = steady + max(
                    0.0, svd["wall"]["median"] - steady) / GALORE["update_proj_gap"]
    return {"threads": torch.get_num_threads(), "batch": case["batch"], "methods": res}
