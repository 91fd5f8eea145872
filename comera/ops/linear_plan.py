"""The TT linear planner (``comera::tt_linear_plan``): which path a call
takes and the cost model behind it (docs/design.md section 5)."""
from typing import List

import torch

from comera import _C  # noqa: F401  (registers the operators)

PATHS = {"auto": 0, "merge": 1, "sequential": 2}
PATH_NAMES = {v: k for k, v in PATHS.items()}


def tt_linear_plan(in_modes: List[int], out_modes: List[int], ranks: List[int],
                   in_features: int, out_features: int, batch: int) -> dict:
    """The C planner's costs for ``batch`` rows, as a dict.

    Example:
        >>> from comera.ops import tt_linear_plan
        >>> tt_linear_plan([8, 8, 12], [12, 16, 16], [1, 30, 30, 30, 30, 30, 1], 768, 3072, 4096)["path"]
        'merge'
    """
    try:
        v = torch.ops.comera.tt_linear_plan(list(in_modes), list(out_modes), list(ranks),
                                            in_features, out_features, batch).tolist()
    except ValueError as err:
        # the native planner reports overflowing sizes as ValueError; name the arguments
        raise ValueError(f"tt_linear_plan: in_modes {list(in_modes)}, out_modes "
                         f"{list(out_modes)}, ranks {list(ranks)} and batch {batch} give sizes "
                         f"that overflow int64 ({str(err).splitlines()[0]})") from None
    return {
        "path": PATH_NAMES[int(v[0])],
        "batch": batch,
        "merge": {"flops": v[1], "bytes": v[2], "seconds": v[3]},
        "sequential": {"flops": v[4], "bytes": v[5], "seconds": v[6]},
    }
