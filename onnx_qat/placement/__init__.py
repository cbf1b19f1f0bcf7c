"""Placement: where Q/DQ goes, decided before anything is inserted.

* [`place`][onnx_qat.placement.place] — run the target's policy on a model and return a
  [`Placement`][onnx_qat.placement.Placement].
* `marks` — the records handlers produce (ActivationMark, WeightMark, Decision, Placement).
* `handlers` — the numbered TensorRT rules, one documented unit each.
* `policy` — the op type -> handler table and rule 10 (one Q/DQ per tensor).
* `graph_index` — producer/consumer maps built once per graph.
"""
from __future__ import annotations

from .marks import ActivationMark, Decision, Placement, SubgraphPlacement, WeightMark
from .policy import TensorRTPolicy, place

__all__ = ["place", "Placement", "SubgraphPlacement", "ActivationMark", "WeightMark", "Decision",
           "TensorRTPolicy"]
