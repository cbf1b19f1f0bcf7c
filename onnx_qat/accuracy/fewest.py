"""Steps 3 and 4 of automatic mixed precision (`onnx_qat.accuracy.mixed`), shared with the search over
ranges (`onnx_qat.accuracy.ranges`): sites ordered by harm, the fewest leading ones whose fallback to
float reaches the minimum, pruned."""
from __future__ import annotations

from typing import Tuple

from .sites import with_partners


def harm_order(sites, found) -> Tuple[int, ...]:
    """Site indices by harm: sites measured alone first, the lowest cosine with only them quantized
    first (``found``: `onnx_qat.accuracy.bisect` figures)."""
    return tuple(sorted(range(len(sites)),
                        key=lambda k: (found[k][1] > 1, found[k][0].cosine, sites[k].name)))


def fewest_float(sites, order, losses, with_float, min_cosine: float, budget: int, all_int8, reaches=None):
    """Steps 3 and 4 of the search: ``(chosen, error)``, the fewest leading sites of ``order`` whose
    fallback reaches ``min_cosine`` (``with_float(indices)`` measures one setting), pruned (None, and
    the best error reached, when the budget cannot reach it). ``reaches(indices)``: whether a setting
    reaches the minimum (default: its ``with_float`` cosine does; the range search also judges the
    calibration samples, `onnx_qat.accuracy.judged`)."""
    if reaches is None:
        def reaches(indices) -> bool:
            return with_float(indices).cosine >= min_cosine
    n = len(sites)
    limit = 0
    while limit < n and len(with_partners(sites, order[:limit + 1])) <= min(budget, n - 1):
        limit += 1
    if limit == 0 or not reaches(order[:limit]):
        best = max((with_float(order[:k]) for k in range(1, limit + 1)), key=lambda e: e.cosine,
                   default=all_int8)
        return None, best
    low, high = 1, limit  # with_float(order[:high]) reaches the minimum
    while low < high:
        mid = (low + high) // 2
        if reaches(order[:mid]):
            high = mid
        else:
            low = mid + 1
    chosen = list(order[:high])
    for k in sorted(chosen, key=lambda k: -losses[k].cosine):  # the least harmful first
        rest = [i for i in chosen if i != k]
        if rest and reaches(rest):
            chosen = rest
    chosen = with_partners(sites, chosen)
    return chosen, with_float(chosen)


__all__ = ["harm_order", "fewest_float"]
