"""The arguments of :class:`comera.RankAdaptive`, checked and normalised
(its docstring says what each means)."""
import math
from typing import Dict

STAGE2_RULES = ("saliency", "magnitude")
# The settings a checkpoint records (RankAdaptive.state_dict()["config"]).
SAVED = ("gamma", "threshold", "stage1_steps", "stage2_steps", "target_compression",
         "prune_every", "min_rank", "stage2_rule")


def check_number(name: str, value, low: float, *, strict: bool = False) -> float:
    """``value`` as a float, if it is a finite number >= ``low`` (> with ``strict``).

    Example:
        >>> check_number("gamma", 1, 0.0)
        1.0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < low or (strict and value == low):
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {low:g}, "
                         f"got {value}")
    return value


def check_int(name: str, value, low: int) -> int:
    """``value``, if it is an int >= ``low`` (not a bool).

    Example:
        >>> check_int("min_rank", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: min_rank must be >= 1, got 0
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def check_settings(*, gamma, threshold, stage1_steps, stage2_steps, target_compression,
                   prune_every, min_rank, stage2_rule, balance, sync_free) -> Dict[str, object]:
    """The arguments of :class:`comera.RankAdaptive` by name, checked (a
    TypeError or ValueError names the argument) and normalised.

    Example:
        >>> s = check_settings(gamma=1, threshold=0, stage1_steps=5, stage2_steps=5,
        ...                    target_compression=None, prune_every=None, min_rank=1,
        ...                    stage2_rule="saliency", balance=1, sync_free=None)
        >>> s["gamma"], s["threshold"], s["balance"]
        (1.0, 0.0, True)
    """
    out = {"gamma": check_number("gamma", gamma, 0.0),
           "threshold": check_number("threshold", threshold, 0.0),
           "stage1_steps": check_int("stage1_steps", stage1_steps, 0),
           "stage2_steps": check_int("stage2_steps", stage2_steps, 0),
           "target_compression": None}
    if target_compression is not None:
        out["target_compression"] = check_number("target_compression", target_compression, 1.0,
                                                 strict=True)
        if stage2_steps < 1:
            raise ValueError("stage2_steps must be >= 1 when target_compression is set "
                             f"(stage 2 is where the target is reached), got {stage2_steps}")
    out["prune_every"] = None if prune_every is None else check_int("prune_every", prune_every, 1)
    out["min_rank"] = check_int("min_rank", min_rank, 1)
    if sync_free not in (None, True, False):
        raise TypeError(f"sync_free must be None, True or False, got {sync_free!r}")
    if stage2_rule not in STAGE2_RULES:
        raise ValueError(f"stage2_rule must be one of {STAGE2_RULES}, got {stage2_rule!r}")
    return dict(out, stage2_rule=stage2_rule, balance=bool(balance), sync_free=sync_free)
