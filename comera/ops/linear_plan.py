"""The TT linear planner (``comera::tt_linear_plan``): which path a call
takes, which kernel variant runs it, and the cost model behind it
(docs/design.md section 5)."""
from typing import List, Optional

import torch

from comera import _C  # noqa: F401  (registers the operators)

PATHS = {"auto": 0, "merge": 1, "sequential": 2}
PATH_NAMES = {v: k for k, v in PATHS.items()}
# COMERA_DT_* (comera/dtype.h) and COMERA_KERNEL_* (comera/tt_linear.h)
DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
KERNELS = ("generic", "avx2", "avx512", "amx", "avx512bf16")


def tt_linear_plan(in_modes: List[int], out_modes: List[int], ranks: List[int],
                   in_features: int, out_features: int, batch: int,
                   dtype: torch.dtype = torch.float32, threads: Optional[int] = None) -> dict:
    """The C planner's costs for ``batch`` rows of ``dtype`` on ``threads``
    threads (default: torch's), as a dict: the path, the CPU kernel variant
    that runs it in this process (``generic``, ``avx2``, ``avx512``, ``amx``,
    ``avx512bf16``),
    and for each path its FLOPs, bytes and predicted seconds on that kernel.

    Example:
        >>> from comera.ops import tt_linear_plan
        >>> tt_linear_plan([8, 8, 12], [12, 16, 16], [1, 30, 30, 30, 30, 30, 1], 768, 3072, 4096)["path"]
        'merge'
    """
    if dtype not in DTYPE_CODES:
        raise TypeError(f"tt_linear_plan: dtype must be float32, float64, bfloat16 or float16, "
                        f"got {dtype}")
    threads = torch.get_num_threads() if threads is None else threads
    try:
        v = torch.ops.comera.tt_linear_plan(list(in_modes), list(out_modes), list(ranks),
                                            in_features, out_features, batch,
                                            DTYPE_CODES[dtype], threads).tolist()
    except ValueError as err:
        # the native planner reports overflowing sizes as ValueError; name the arguments
        raise ValueError(f"tt_linear_plan: in_modes {list(in_modes)}, out_modes "
                         f"{list(out_modes)}, ranks {list(ranks)} and batch {batch} give sizes "
                         f"that overflow int64 ({str(err).splitlines()[0]})") from None
    path = PATH_NAMES[int(v[0])]
    return {
        "path": path,
        "batch": batch,
        "dtype": str(dtype).replace("torch.", ""),
        "threads": int(v[9]),
        "kernel": KERNELS[int(v[7])],
        "seconds": v[3] if path == "merge" else v[6],
        "merge": {"flops": v[1], "bytes": v[2], "seconds": v[3]},
        "sequential": {"flops": v[4], "bytes": v[5], "seconds": v[6]},
    }
