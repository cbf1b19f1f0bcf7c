"""Placement: where Q/DQ goes, decided before anything is inserted.

* [`place`][onnx_qat.placement.place] — run the target's policy on a model and return a
  [`Placement`][onnx_qat.placement.Placement].
* `marks` — the records handlers produce (ActivationMark, WeightMark, Decision, Placement).
* `handlers` — the numbered TensorRT rules, one documented unit each.
* `policy` — the op type -> handler table and rule 10 (one Q/DQ per tensor).
* `format_marks` — which marks each numeric format keeps (INT4: weight marks only).
* `refusals` — the models placement refuses (already quantized; a quantized weight holding NaN or
  an infinity), for ``quantize`` and ``calibrate`` alike.

Owns: the placement rules (one home for each, the residual-Add rule included) and their marks.
May import: io, graph (the graph model: index, ``WEIGHTED_OPS``), formats, config, the targets
(data); never the inserter, calibration or check.
"""
from __future__ import annotations

from .marks import ActivationMark, Decision, Placement, SubgraphPlacement, WeightMark
from .policy import TensorRTPolicy, place

__all__ = ["place", "Placement", "SubgraphPlacement", "ActivationMark", "WeightMark", "Decision",
           "TensorRTPolicy"]
