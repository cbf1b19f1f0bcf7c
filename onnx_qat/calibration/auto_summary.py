"""One line saying how a ScaleTable's ranges were chosen, read from its metadata.

``calibrate`` records its method in the table's metadata (``calibration_method``, ``percentile``)
and, for ``auto``, which candidate table it kept (``auto_table``), the output cosine of each
candidate on the calibration data (``auto_output_cosine``) and the per-tensor picks
(``auto_choices``). The command line prints this line after ``calibrate`` and ``quantize``, so
the choice ``auto`` made is visible without ``--verbose``.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Mapping

#: How the summary names each of auto's candidate tables (``entropy``: a table of releases before
#: 2026-11-27, still named when a table file of theirs is read).
AUTO_TABLES = {"max": "max everywhere", "entropy": "entropy everywhere",
               "tensor": "the least-error range per tensor"}

_CANDIDATE = {"tensor": "per-tensor"}


def describe_method(metadata: Mapping[str, str]) -> str:
    """``ranges: max``, ``ranges: percentile 99.99`` or, for ``auto``, ``ranges: auto kept the
    least-error range per tensor (mse 84, max 1) | output cosine on the calibration data:
    per-tensor 0.99994, max 0.99992``. Empty when the metadata names no method (a table
    read from a file another tool wrote)."""
    method = metadata.get("calibration_method", "")
    if not method:
        return ""
    if method == "percentile" and metadata.get("percentile"):
        return f"ranges: percentile {metadata['percentile']}"
    if method != "auto" or "auto_table" not in metadata:
        return f"ranges: {method}"
    kept = metadata["auto_table"]
    text = f"ranges: auto kept {AUTO_TABLES.get(kept, kept)}"
    if kept == "tensor":
        picks = Counter(_json(metadata.get("auto_choices")).values())
        if picks:
            text += " (" + ", ".join(f"{name} {n}" for name, n in picks.most_common()) + ")"
    cosines = _json(metadata.get("auto_output_cosine"))
    if cosines:
        ranked = sorted(cosines.items(), key=lambda item: -float(item[1]))
        text += " | output cosine on the calibration data: " + ", ".join(
            f"{_CANDIDATE.get(name, name)} {float(value):.5f}" for name, value in ranked)
    return text


def _json(text) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


__all__ = ["describe_method", "AUTO_TABLES"]
