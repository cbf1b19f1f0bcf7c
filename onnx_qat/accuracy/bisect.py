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
from typing import Callable, Dict, Tuple

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


def bisect(n: int, measure: Callable[[Tuple[int, ...]], OutputError], effect: Callable[[OutputError], float],
           whole: OutputError, limit: float, on_run=None) -> Dict[int, Tuple[OutputError, int]]:
    """``{site index: (error, group size)}`` for sites ``0..n-1`` (size 1: measured exactly).

    ``measure(group)`` runs one setting for a group of site indices; ``effect(error)`` is the group's
    cosine effect; ``whole`` is the already known error of the group of every site.
    """
    out: Dict[int, Tuple[OutputError, int]] = {}
    stack = [(tuple(range(n)), whole)]
    while stack:
        group, error = stack.pop()
        if len(group) == 1:
            out[group[0]] = (error, 1)
            continue
        if effect(error) < limit:
            for k in group:
                out[k] = (error, len(group))
            continue
        mid = len(group) // 2
        for half in (group[mid:], group[:mid]):
            stack.append((half, measure(half)))
            if on_run is not None:
                on_run()
    return out


def screen(prepared, all_int8: OutputError, which: str, share: float = SCREEN_SHARE,
           on_run=None) -> Dict[int, Tuple[OutputError, int]]:
    """`bisect` over ``prepared.sites`` for ``which`` = ``only`` or ``all_but``."""
    n = len(prepared.sites)
    everything = frozenset(range(n))
    limit = threshold(all_int8, share)
    if which == "only":
        return bisect(n, lambda g: prepared.error(g), lambda e: 1.0 - e.cosine, all_int8, limit, on_run)
    return bisect(n, lambda g: prepared.error(everything - set(g)), lambda e: e.cosine - all_int8.cosine,
                  FLOAT, limit, on_run)


def exhaustive(prepared, which: str, on_run=None) -> Dict[int, Tuple[OutputError, int]]:
    """One exact run per site for ``which`` = ``only`` or ``all_but``."""
    n = len(prepared.sites)
    out = {}
    for k in range(n):
        out[k] = (prepared.error((k,) if which == "only" else (i for i in range(n) if i != k)), 1)
        if on_run is not None:
            on_run()
    return out


__all__ = ["bisect", "screen", "exhaustive", "threshold", "SCREEN_SHARE", "FLOAT", "MIN_SITES"]
