"""Group bisection: find the sites that matter in a few runs, measure only those one by one.

Sites are taken in graph order. A group is measured as a whole (``only``: the group in INT8,
everything else float; ``all_but``: the group float, everything else INT8). A group whose effect on
the output cosine is below the threshold is not split: each of its sites gets the group's figures
(quantization errors of sites roughly add up, so one site of a harmless group is harmless; they can
also cancel, so the group's figures are an estimate, not a strict bound). A group
above the threshold is split in two, down to single sites, which are then measured exactly.

With ``s`` sites that matter out of ``n`` this takes about ``2 s log2(n / s)`` runs instead of ``n``.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Tuple

from .prepared import OutputError

#: A group whose effect is below this share of the all-INT8 cosine loss is not split further.
SCREEN_SHARE = 0.01
#: ... and never below this absolute cosine loss.
SCREEN_FLOOR = 1e-5
#: With this many sites or fewer, measuring each alone costs no more runs than bisecting.
MIN_SITES = 16

FLOAT = OutputError(1.0, math.inf, 0.0)


def threshold(all_int8: OutputError, share: float = SCREEN_SHARE) -> float:
    """The cosine effect below which a group is not split (see the module docstring)."""
    return max(SCREEN_FLOOR, share * (1.0 - all_int8.cosine))


def bisect(n: int, measure: Callable[[List[Tuple[int, ...]]], List[OutputError]],
           effect: Callable[[OutputError], float], whole: OutputError, limit: float,
           on_run=None) -> Dict[int, Tuple[OutputError, int]]:
    """``{site index: (error, group size)}`` for sites ``0..n-1`` (size 1: measured exactly).

    ``measure(groups)`` runs one setting per group of site indices and returns their errors in order;
    ``effect(error)`` is a group's cosine effect; ``whole`` is the already known error of the group of
    every site. The groups are split level by level and each level's halves are measured together (on
    several workers at once when there are: `onnx_qat.accuracy.parallel`); whether a group is split
    depends only on its own error, so the groups measured and the answer are those of splitting one
    group at a time. ``on_run()`` is called after each run.
    """
    out: Dict[int, Tuple[OutputError, int]] = {}
    level = [(tuple(range(n)), whole)]
    while level:
        halves: List[Tuple[int, ...]] = []
        for group, error in level:
            if len(group) == 1:
                out[group[0]] = (error, 1)
            elif effect(error) < limit:
                for k in group:
                    out[k] = (error, len(group))
            else:
                mid = len(group) // 2
                halves += [group[:mid], group[mid:]]
        level = list(zip(halves, measure(halves, on_run))) if halves else []
    return out


def screen(prepared, all_int8: OutputError, which: str, share: float = SCREEN_SHARE,
           on_run=None) -> Dict[int, Tuple[OutputError, int]]:
    """`bisect` over ``prepared.sites`` for ``which`` = ``only`` or ``all_but``."""
    n = len(prepared.sites)
    everything = frozenset(range(n))
    limit = threshold(all_int8, share)
    if which == "only":
        return bisect(n, prepared.errors, lambda e: 1.0 - e.cosine, all_int8, limit, on_run)
    return bisect(n, lambda groups, done: prepared.errors([everything - set(g) for g in groups], done),
                  lambda e: e.cosine - all_int8.cosine, FLOAT, limit, on_run)


def exhaustive(prepared, which: str, on_run=None) -> Dict[int, Tuple[OutputError, int]]:
    """One exact run per site for ``which`` = ``only`` or ``all_but`` (all settings at once, on
    several workers when there are)."""
    n = len(prepared.sites)
    settings = [(k,) if which == "only" else tuple(i for i in range(n) if i != k) for k in range(n)]
    return {k: (error, 1) for k, error in enumerate(prepared.errors(settings, on_run))}


__all__ = ["bisect", "screen", "exhaustive", "threshold", "SCREEN_SHARE", "FLOAT", "MIN_SITES"]
