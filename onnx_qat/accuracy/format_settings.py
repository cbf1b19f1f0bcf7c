"""The accuracy tools in the non-INT8 formats (``fp8``, ``int4``): what differs from INT8.

Sensitivity and automatic mixed precision run the same loop for every format
(`onnx_qat.accuracy.prepared`, `onnx_qat.accuracy.mixed`); a site is what placement
quantizes together in that format (`onnx_qat.accuracy.sites`), and a site left "float" keeps
its float tensors (the higher precision). Two things depend on the format:

* **the inserter's format** (`insertion_config`): the gated model and every model built are
  written in ``config.precision`` (FP8 E4M3FN Q/DQ, INT4 blockwise weights), with the same
  ``block_size`` and attention choice (FP8's fixed Softmax range included);
* **where the ranges come from** (`weight_only_ranges`): INT8 and FP8 calibrate activation
  ranges; INT4 is weight-only, so it has no activation range to calibrate. With calibration data,
  the activation-aware scale search (`onnx_qat.formats.awq.apply_awq`) runs once, on a private copy of
  the float model: its edits (weight rows times ``s``, ``1 / s`` folded or put in a ``Mul``) keep the
  float function (exact up to float rounding), so that rescaled float model is the base every
  setting is built from, and its clipped block ranges are the ScaleTable. A weight left float then
  keeps its rescaled float values. With ``int4_method="gptq"`` the rounded weights (and GPTQ's block
  ranges) are kept apart (`WeightOnly`) and put in place only for the weights quantized.
  Without calibration data (or with ``int4_method="rtn"``), round to nearest.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Tuple

import numpy as np
import onnx
from onnx import numpy_helper

from ..formats.numeric import get_format
from ..scales import ScaleTable


def insertion_config(config):
    """The [`QuantizeConfig`][onnx_qat.config.QuantizeConfig] the one inserter gets for an accuracy run: the
    format fields of ``config`` (the placement is given, so the placement options do not apply)."""
    from ..config import QuantizeConfig

    return QuantizeConfig(precision=config.precision, block_size=config.block_size,
                          include_attention=config.include_attention)


@dataclass(frozen=True)
class WeightOnly:
    """The INT4 state of an accuracy run: the float model every setting starts from (after the AWQ
    edits, float-exact), the block ranges, the records of the scale search and of GPTQ, and the
    GPTQ-rounded weights by tensor name (GPTQ replaces a weight by its rounded values, so a weight left
    float must keep the base model's)."""

    base: onnx.ModelProto
    table: ScaleTable
    awq: Tuple[dict, ...] = ()
    gptq: Tuple[dict, ...] = ()
    rounded: Mapping[str, np.ndarray] = field(default_factory=dict)

    def model(self, float_weights: Iterable[str] = ()) -> onnx.ModelProto:
        """The model the inserter gets: the base model with the rounded weights, except
        ``float_weights`` (the base model itself when nothing was rounded)."""
        keep = set(float_weights)
        swap = {name: values for name, values in self.rounded.items() if name not in keep}
        if not swap:
            return self.base
        from onnx import numpy_helper

        from ..graph.index import GraphIndex

        model = onnx.ModelProto()
        model.CopyFrom(self.base)
        index = GraphIndex(model)
        for name, values in swap.items():
            proto = index.constant_proto(name)
            proto.CopyFrom(numpy_helper.from_array(values, proto.name))
        return model


def weight_only_ranges(float_model, placement, calibration, config, *, progress: bool = True,
                       batch_size: Optional[int] = None) -> WeightOnly:
    """The `WeightOnly` state of a weight-only format.

    With ``calibration`` data (the calibration part of the data, see
    `split_data`): the rounding ``config.int4_method`` names
    (default AWQ) on a copy of ``float_model``: AWQ's edits make the base model, its block ranges
    the table; GPTQ then rounds the weights of a second copy. Without it, or with
    ``int4_method="rtn"``: round to nearest (an empty table: weights take their own block max) on
    ``float_model`` itself.
    """
    from ..formats.awq import apply_awq
    from ..graph.index import GraphIndex

    rounding = config.rounding(calibration is not None)
    if rounding == "rtn":
        return WeightOnly(float_model, ScaleTable(producer="weights"))
    base = onnx.ModelProto()
    base.CopyFrom(float_model)
    awq, ranges = apply_awq(base, GraphIndex(base), placement, calibration, config.block_size,
                            progress=progress, batch_size=batch_size)
    gptq, rounded = (), {}
    if rounding == "gptq":
        from ..formats.gptq import apply_gptq

        copy = onnx.ModelProto()
        copy.CopyFrom(base)
        gptq, ranges = apply_gptq(copy, placement, calibration, config.block_size, progress=progress,
                                  batch_size=batch_size)
        index = GraphIndex(copy)
        rounded = {r["weight"]: numpy_helper.to_array(index.constant_proto(r["weight"])) for r in gptq}
    table = ScaleTable(weights=ranges, producer=rounding if ranges else "weights")
    return WeightOnly(base, table, tuple(awq), tuple(gptq), rounded)


def precision_name(config) -> str:
    """How reports and messages name the quantized form of a site: ``INT8``, ``FP8``, ``INT4``."""
    return get_format(getattr(config, "precision", None)).name.upper()


__all__ = ["insertion_config", "weight_only_ranges", "WeightOnly", "precision_name"]
