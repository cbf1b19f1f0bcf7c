"""Accuracy tools built on the same stages as [`onnx_qat.quantize`][onnx_qat.quantize.quantize].

* `sites` — the *sites* placement quantizes together, read from a Placement's marks.
* `gated` — one onnxruntime session of the Q/DQ model in which every site can be switched
  between INT8 and float per run (the one inserter's output, each dequantized input behind a gate).
* `cuts` — runs of the gated model that start at a cut, on the tensors the float and the
  all-INT8 runs kept there: a setting runs only the part of the graph it changes.
* [`sensitivity`][onnx_qat.accuracy.sensitivity.sensitivity] —
  [`sensitivity`][onnx_qat.accuracy.sensitivity.sensitivity]: per-site output error, ranked, as a typed
  result.
* `mixed` — automatic mixed precision: the fewest float sites reaching a minimum cosine.
* `parallel` — the settings run in this process or on worker processes / Ray actors (``workers=``,
  ``ray=``), the same figures either way; `figures` — `OutputError`, how far outputs are from the
  float model's.

Owns: the loops over the stages that measure and trade accuracy; no second inserter or graph index.
May import: every stage below the public ``quantize`` (io, graph, formats and roundings, config,
scales, runtime, placement, insertion, calibration, the rewrite); never ``check`` or ``deploy``.
"""
from __future__ import annotations

from .sensitivity import SensitivityResult, SiteSensitivity, TensorStats, sensitivity
from .sites import Site, site_exclusions, sites_of

__all__ = ["sensitivity", "SensitivityResult", "SiteSensitivity", "TensorStats", "Site", "sites_of",
           "site_exclusions"]
