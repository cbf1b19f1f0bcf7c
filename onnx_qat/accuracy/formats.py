"""The accuracy tools in the non-INT8 formats (``fp8``, ``int4``): what differs from INT8.

Sensitivity and automatic mixed precision run the same loop for every format
(:mod:`onnx_qat.accuracy.prepared`, :mod:`onnx_qat.accuracy.mixed`); a site is what placement
quantizes together in that format (:mod:`onnx_qat.accuracy.sites`), and a site left "float" keeps
its float tensors (the higher precision). Two things depend on the format:

* **the inserter's format** (:func:`insertion_config`): the gated model and every model built are
  written in ``config.precision`` (FP8 E4M3FN Q/DQ, INT4 blockwise weights), with the same
  ``block_size`` and attention choice (FP8's fixed Softmax range included);
* **where the ranges come from** (:func:`weight_only_ranges`): INT8 and FP8 calibrate activation
  ranges; INT4 is weight-only, so it has no activation range to calibrate. With calibration data,
  the activation-aware scale search (:func:`onnx_qat.awq.apply_awq`) runs once, on a private copy of
  the float model: its edits (weight rows times ``s``, ``1 / s`` folded or put in a ``Mul``) keep the
  float function (exact up to float rounding), so that rescaled float model is the base every
  setting is built from, and its clipped block ranges are the ScaleTable. A weight left float then
  keeps its rescaled float values. Without calibration data, round to nearest.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..formats import get_format
from ..scales import ScaleTable


def insertion_config(config):
    """The :class:`~onnx_qat.config.QuantizeConfig` the one inserter gets for an accuracy run: the
    format fields of ``config`` (the placement is given, so the placement options do not apply)."""
    from ..config import QuantizeConfig

    return QuantizeConfig(precision=config.precision, block_size=config.block_size,
                          include_attention=config.include_attention)


def weight_only_ranges(float_model, placement, data, eval_data, config, *, progress: bool = True,
                       batch_size: Optional[int] = None) -> Tuple[object, object, object, ScaleTable, tuple]:
    """``(calibration, evaluation, base_model, table, awq_records)`` for a weight-only format.

    With ``data``: the calibration part of ``data`` (see
    :func:`~onnx_qat.accuracy.prepared.split_data`) feeds the activation-aware scale search on a copy
    of ``float_model`` (the base model), whose block ranges make the table. Without it: round to
    nearest (an empty table: weights take their own block max) on ``float_model`` itself, measured on
    ``eval_data``.
    """
    import onnx

    from ..awq import apply_awq
    from ..data import load_data
    from ..placement.graph_index import GraphIndex
    from .prepared import split_data

    if data is None:
        evaluation = load_data(eval_data, float_model, what="evaluation data")
        return None, evaluation, float_model, ScaleTable(producer="weights"), ()
    calibration, evaluation = split_data(data, eval_data, float_model)
    base = onnx.ModelProto()
    base.CopyFrom(float_model)
    records, ranges = apply_awq(base, GraphIndex(base), placement, calibration, config.block_size,
                                progress=progress, batch_size=batch_size)
    table = ScaleTable(weights=ranges, producer="awq" if ranges else "weights")
    return calibration, evaluation, base, table, tuple(records)


def precision_name(config) -> str:
    """How reports and messages name the quantized form of a site: ``INT8``, ``FP8``, ``INT4``."""
    return get_format(getattr(config, "precision", None)).name.upper()


__all__ = ["insertion_config", "weight_only_ranges", "precision_name"]
