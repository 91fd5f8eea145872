"""The comera::gate_step_ operator: a whole rank-adaptation step on the gates
in one call (docs/design.md section 4).

Native files: ``csrc/gate_prox/step_rule.h`` (the step on one gate, shared
by both kernels), ``csrc/gate_prox/cpu_impl.h`` (the C kernel, float32 and
float64), ``csrc/gate_prox/step.cu`` (the CUDA kernel: one launch, one
thread per gate, for up to 512 gates; also bfloat16 and float16) and
``csrc/gate_prox/op.cpp`` (torch glue); the schema is in
``csrc/registration.cpp``.

The operator does what :meth:`comera.adapt.step.GateStep.run` does with
tensor operations before the controller's review, bit for bit: the NaN
check, the saliency average, the decoupled L1 shrink with its ``min_rank``
rescue and the proximal rule of :func:`comera.ops.gate_prox_`.  It takes
gates of one dtype on one device; :class:`~comera.adapt.step.GateStep`
keeps its tensor code for everything else.
"""
from typing import List, Optional, Sequence

import torch

from comera import _C  # noqa: F401  (registers the operators)



@torch.library.register_fake("comera::gate_step_")
def _gate_step_fake(gates, signs, grads, saliency, amount, frozen, nan_seen, nan_gates,
                    threshold, min_live, kill):
    device = gates[0].device if len(gates) else torch.device("cpu")
    return torch.empty(len(gates), dtype=torch.int64, device=device)


def has_gate_step_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this build has a comera::gate_step_ kernel for gates of
    ``dtype`` on ``device`` (the C kernel: float32 and float64; the CUDA
    kernel, in a CUDA build: also bfloat16 and float16).

    Example:
        >>> import torch
        >>> has_gate_step_kernel(torch.device("cpu"), torch.float32)
        True
        >>> has_gate_step_kernel(torch.device("cpu"), torch.bfloat16)
        False
    """
    if device.type == "cpu":
        return dtype in (torch.float32, torch.float64)
    return device.type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key(
        "comera::gate_step_", "CUDA")


def gate_step_(gates: Sequence[torch.Tensor], signs: Sequence[torch.Tensor],
               grads: Sequence[Optional[torch.Tensor]], saliency: Sequence[torch.Tensor],
               amount: Optional[torch.Tensor] = None, *, threshold: float,
               min_live: int = 1, kill: bool = True, frozen: Optional[torch.Tensor] = None,
               nan_seen: Optional[torch.Tensor] = None,
               nan_gates: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One rank-adaptation step on many gates, in place, in one call.

    ``gates``: 1-D tensors of one dtype on one device; ``signs``: their
    int8 signs (0: dead), as for :func:`comera.ops.gate_prox_`.  For each
    gate with a gradient (``grads[k]`` not None) ``saliency[k]`` (float64)
    becomes ``0.9 saliency + 0.1 |g grad|``.  With ``amount`` (one value per
    gate, the gates' dtype) and unless ``frozen`` (a 0-d bool tensor) is
    set, every live entry shrinks to ``sign(g) max(|g| - amount, 0)``, a gate
    left below ``min(min_live, its non-zero entries)`` keeping its largest
    entries unshrunk; then :func:`comera.ops.gate_prox_`'s rule runs.  A NaN
    in any gate changes nothing, marks the gates holding one with -1 in the
    result, and, when ``nan_seen`` (0-d bool) is given and not yet set,
    records them in ``nan_gates`` and sets it.  Returns the live count per
    gate (int64, on the gates' device).  On CUDA it is one kernel launch
    for up to 512 gates and never waits for the device.

    Example:
        >>> import torch, comera
        >>> g = torch.tensor([0.5, 0.02, -0.2])
        >>> s = torch.tensor([1, 1, -1], dtype=torch.int8)
        >>> sal = torch.zeros(3, dtype=torch.float64)
        >>> live = comera.ops.gate_step_([g], [s], [torch.ones(3)], [sal],
        ...                              torch.tensor([0.05]), threshold=1e-3)
        >>> live.tolist(), g.tolist(), s.tolist()   # entry 1 shrank past 0: dead
        ([2], [0.44999998807907104, 0.0, -0.15000000596046448], [1, 0, -1])
        >>> [round(v, 4) for v in sal.tolist()]     # 0.1 |g grad|, before the shrink
        [0.05, 0.002, 0.02]
    """
    gates, signs, grads, saliency = list(gates), list(signs), list(grads), list(saliency)
    if not gates:
        return torch.empty(0, dtype=torch.int64)
    if any(gr is None for gr in grads):
        none = gates[0].new_empty(0)
        grads = [none if gr is None else gr for gr in grads]
    with torch.no_grad():
        return torch.ops.comera.gate_step_(gates, signs, grads, saliency, amount, frozen,
                                           nan_seen, nan_gates, float(threshold),
                                           int(min_live), bool(kill))


__all__: List[str] = ["gate_step_", "has_gate_step_kernel"]
