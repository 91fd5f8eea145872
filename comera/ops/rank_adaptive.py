"""The comera::gate_prox_ operator: the fused proximal step on TT gates.

See csrc/include/comera/rank_adaptive.h for the exact rule.  The C kernel
serves CPU tensors and, in a CUDA build, a CUDA kernel serves CUDA tensors;
gates elsewhere go through the same rule written with torch ops below, so
RankAdaptive works wherever the model lives.  Gates are short (one entry per
rank), so that path costs little.
"""
from typing import List, Sequence

import torch

from comera import _C  # noqa: F401  (registers the operators)


@torch.library.register_fake("comera::gate_prox_")
def _gate_prox_fake(gates, signs, threshold, min_live, kill):
    return torch.empty(len(gates), dtype=torch.int64, device="cpu")


def _gate_prox_torch(gates: Sequence[torch.Tensor], signs: Sequence[torch.Tensor],
                     threshold: float, min_live: int, kill: bool) -> torch.Tensor:
    """The same rule as the C kernel, in torch ops (for non-CPU gates)."""
    bad = [bool(torch.isnan(g).any()) for g in gates]
    if any(bad):
        return torch.tensor([-1 if b else 0 for b in bad], dtype=torch.int64)
    live = []
    with torch.no_grad():
        for g, s in zip(gates, signs):
            now = torch.sign(g).to(torch.int8)
            alive = s != 0
            if not kill:
                s.copy_(torch.where(alive & (now != 0), now, s))
                g.masked_fill_(~alive, 0)
                live.append(int(alive.sum()))
                continue
            doomed = alive & ((g.abs() <= threshold) | (now != s))
            survivors = int((alive & ~doomed).sum())
            if survivors < min_live:
                cand = torch.where(doomed & (g != 0), g.abs(), torch.zeros_like(g))
                need = min(min_live - survivors, int((cand > 0).sum()))
                if need > 0:
                    doomed[torch.topk(cand, need).indices] = False
            keep = alive & ~doomed
            g.masked_fill_(~keep, 0)
            s.copy_(torch.where(keep, now, torch.zeros_like(s)))
            live.append(int(keep.sum()))
    return torch.tensor(live, dtype=torch.int64)


def _has_cuda_kernel() -> bool:
    """Whether this build registered the CUDA kernel of comera::gate_prox_."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("comera::gate_prox_", "CUDA")


def gate_prox_(gates: Sequence[torch.Tensor], signs: Sequence[torch.Tensor], threshold: float,
               min_live: int = 1, kill: bool = True) -> torch.Tensor:
    """One fused proximal step over many gate vectors, in place.

    ``signs[k]`` (int8, like ``gates[k]``) holds each entry's sign after the
    previous step, 0 for a dead entry.  Dead entries are set back to 0; with
    ``kill``, live entries with ``|g| <= threshold`` or whose sign changed
    (the L1 pull carried them across zero) die, keeping at least ``min_live``
    per gate.  Returns the live count per gate (int64, CPU); -1 marks a gate
    holding a NaN, and then no gate is modified.

    Example:
        >>> import torch, comera
        >>> g = torch.tensor([0.5, 1e-4, -0.2, 0.3])
        >>> s = torch.tensor([1, 1, 1, 0], dtype=torch.int8)  # entry 3 is dead
        >>> comera.ops.gate_prox_([g], [s], threshold=1e-3).tolist()  # entry 1 dies, 2 crossed 0
        [1]
        >>> g.tolist(), s.tolist()
        ([0.5, 0.0, 0.0, 0.0], [1, 0, 0, 0])
    """
    gates, signs = list(gates), list(signs)
    if len(gates) != len(signs):
        raise ValueError(f"gate_prox_: got {len(gates)} gates but {len(signs)} sign vectors")
    if not gates:
        return torch.empty(0, dtype=torch.int64)
    # one fused call per (device, dtype): a model may mix float32 and float64 layers
    groups = {}
    for i, g in enumerate(gates):
        groups.setdefault((g.device, g.dtype), []).append(i)
    if len(groups) > 1:
        # a NaN anywhere must leave every gate unchanged, so look before any group runs
        bad = [bool(torch.isnan(g).any()) for g in gates]
        if any(bad):
            return torch.tensor([-1 if b else 0 for b in bad], dtype=torch.int64)
    live = torch.empty(len(gates), dtype=torch.int64)
    for (device, _), idx in groups.items():
        gs, ss = [gates[i] for i in idx], [signs[i] for i in idx]
        if device.type == "cpu" or (device.type == "cuda" and _has_cuda_kernel()):
            with torch.no_grad():
                out = torch.ops.comera.gate_prox_(gs, ss, float(threshold), int(min_live),
                                                  bool(kill))
        else:
            out = _gate_prox_torch(gs, ss, float(threshold), int(min_live), bool(kill))
        live[idx] = out.cpu()
    return live


__all__: List[str] = ["gate_prox_"]
