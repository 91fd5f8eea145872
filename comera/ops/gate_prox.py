"""The comera::gate_prox_ operator: the fused proximal step on TT gates.

Native files: ``csrc/gate_prox/cpu_impl.h`` (the C kernel, which states the
rule; compiled once per dtype as ``cpu_f32.c`` and ``cpu_f64.c``), ``csrc/gate_prox/op.cpp`` (torch glue), ``csrc/gate_prox/cuda.cu``
(the CUDA kernel); the schema is in ``csrc/registration.cpp``.

The rule exists once per device: the C kernel serves CPU tensors and, in a
CUDA build, the CUDA kernel serves CUDA tensors.  Gates anywhere else (a
CUDA tensor in a CPU-only build, another device type) are copied to the
CPU, stepped by the C kernel and copied back: gates hold one entry per
rank, so the copies cost little.  bfloat16/float16 gates (a model cast to
half precision) take the same route through float32 copies on the CPU,
whose kernel takes float32/float64; the CUDA kernel takes them as they are.

Synchronisation: on CUDA the kernel gets the gate pointers as launch
parameters and leaves the live counts on the device, so one call (one
dtype, one device) never waits for the GPU and can be captured in a CUDA
graph.  Gates of several dtypes in one call look for NaN first (the rule
"a NaN anywhere changes nothing" spans the groups), which reads the device.
"""
from typing import List, Sequence

import torch

from comera import _C  # noqa: F401  (registers the operators)

_HALF = (torch.bfloat16, torch.float16)


@torch.library.register_fake("comera::gate_prox_")
def _gate_prox_fake(gates, signs, threshold, min_live, kill):
    # the live counts stay on the gates' device (CPU for an empty list)
    device = gates[0].device if len(gates) else torch.device("cpu")
    return torch.empty(len(gates), dtype=torch.int64, device=device)


def _has_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build registered a comera::gate_prox_ kernel for gates of
    ``dtype`` on ``device`` (the CPU kernel: float32/float64 only)."""
    if device.type == "cpu":
        return dtype not in _HALF
    return device.type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key(
        "comera::gate_prox_", "CUDA")


@torch.no_grad()
def _via_cpu(gates: List[torch.Tensor], signs: List[torch.Tensor], *args) -> torch.Tensor:
    """Runs the C kernel on CPU (float32 for half-precision gates) copies of
    the group and writes the result back."""
    g_cpu = [(g.float() if g.dtype in _HALF else g).cpu().contiguous() for g in gates]
    s_cpu = [s.cpu().contiguous() for s in signs]
    live = torch.ops.comera.gate_prox_(g_cpu, s_cpu, *args)
    if not bool((live < 0).any()):  # on a NaN the kernel changed nothing
        for dst, src in zip(gates + signs, g_cpu + s_cpu):
            dst.copy_(src)
    return live


def gate_prox_(gates: Sequence[torch.Tensor], signs: Sequence[torch.Tensor], threshold: float,
               min_live: int = 1, kill: bool = True) -> torch.Tensor:
    """One fused proximal step over many gate vectors, in place.

    ``signs[k]`` (int8, like ``gates[k]``) holds each entry's sign after the
    previous step, 0 for a dead entry.  Dead entries are set back to 0; with
    ``kill``, live entries with ``|g| <= threshold`` or whose sign changed
    (the L1 pull carried them across zero) die, keeping at least ``min_live``
    per gate.  Returns the live count per gate (int64, on the gates' device
    when they share one, else on the CPU); -1 marks a gate holding a NaN,
    and then no gate is modified.  On CUDA one call with gates of one dtype
    does not wait for the device (module doc).

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
    devices = {g.device for g in gates}
    home = devices.pop() if len(devices) == 1 else torch.device("cpu")
    if len(groups) > 1:
        # a NaN anywhere must leave every gate unchanged, so look before any group runs
        bad = [bool(torch.isnan(g).any()) for g in gates]
        if any(bad):
            return torch.tensor([-1 if b else 0 for b in bad], dtype=torch.int64).to(home)
    args = (float(threshold), int(min_live), bool(kill))
    outs = []
    for (device, dtype), idx in groups.items():
        gs, ss = [gates[i] for i in idx], [signs[i] for i in idx]
        if _has_kernel(device, dtype):
            with torch.no_grad():
                outs.append(torch.ops.comera.gate_prox_(gs, ss, *args))
        else:
            outs.append(_via_cpu(gs, ss, *args))
    if len(outs) == 1:  # one group: no gathering, no copy (the sync-free case)
        return outs[0] if outs[0].device == home else outs[0].to(home)
    live = torch.empty(len(gates), dtype=torch.int64)
    for idx, out in zip(groups.values(), outs):
        live[idx] = out.cpu()
    return live.to(home)


__all__: List[str] = ["gate_prox_"]
