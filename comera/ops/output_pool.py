"""The cache of large CPU output blocks (csrc/common/outpool.c).

Outputs of 4 MB or more that comera's CPU kernels return (TTLinear's y and
dx, TTEmbedding's rows) come from a pool of reused blocks: a tensor's block
goes back to the pool when the tensor dies and the next call of the same
size writes it again, already mapped, instead of a fresh mapping whose every
page faults and is zeroed (docs/design.md section 5).  Environment:
``COMERA_OUTPUT_POOL=0`` turns the pool off (outputs from torch's allocator),
``COMERA_OUTPUT_POOL_MB`` caps the idle blocks kept (default 1024); both are
read at each large output.
"""
import torch

from comera import _C  # noqa: F401  (registers comera::output_pool)


def output_pool(release: bool = False) -> dict:
    """Bytes the output pool holds: ``idle`` (kept for reuse), ``in_use``
    (blocks of live tensors) and ``released`` (freed by this call: with
    ``release=True`` every idle block is handed back to the system, as
    ``torch.cuda.empty_cache()`` does for CUDA's cache).

    Example:
        >>> import torch, comera
        >>> layer = comera.TTLinear(768, 3072, rank=8)
        >>> y = layer(torch.randn(1024, 768))   # 12 MB: a pooled block
        >>> comera.output_pool()["in_use"] >= y.numel() * 4
        True
        >>> del y
        >>> stats = comera.output_pool(release=True)
        >>> stats["idle"], stats["released"] >= 1024 * 3072 * 4
        (0, True)
    """
    if not isinstance(release, bool):
        raise TypeError(f"output_pool: release must be a bool, got {type(release).__name__}")
    idle, in_use, released = torch.ops.comera.output_pool(release)
    return {"idle": idle, "in_use": in_use, "released": released}
