"""Step 3 of [`tf_bridge.export_onnx`][]: Q/DQ insertion with the mapped placement and ranges.

[`onnx_qat.quantize`][onnx_qat.quantize.quantize] inserts exactly the Keras quantizers' Q/DQ pairs (no
recalibration); a target that needs ranges no quantizer observes (``ort-cpu``) takes them from the caller's
sample data.
"""
from __future__ import annotations

import logging

from onnx_qat.errors import ExportError, brief
from onnx_qat.scales import ScaleTable

from .mapping import KerasOnnxMapping

logger = logging.getLogger(__name__)


def _with_target_ranges(mapping: KerasOnnxMapping, target: str, feeds) -> ScaleTable:
    """The learned ScaleTable plus the max |x| over ``feeds`` (the caller's sample data) of each
    tensor ``target``'s form needs a range for and no quantizer observes (ort-cpu: the output of
    a Conv requantized for ``QLinearConv`` that reaches no quantized tensor through exactly
    commuting ops), with the ``[min, max]`` measured beside it (the ScaleTable's ``bounds``): the
    ort-cpu form stores such a tensor of unknown sign over an asymmetric uint8 range from them, as
    ``quantize(..., data=...)`` does for the same tensor. The learned ranges are kept as they are,
    without bounds: the QAT model was trained on their symmetric grid (``amax / 127``), which a range
    from the data's extremes would replace (docs/performance.md, "Calibrating once for the CPU
    target"). The table is not marked as calibrated for the form (its other ranges were learned)."""
    from onnx_qat.calibration import calibrate
    from onnx_qat.errors import QatError
    from onnx_qat.graph.index import GraphIndex
    from onnx_qat.insertion.adapters import make_adapter

    adapter = make_adapter(target)
    needed = () if adapter is None else tuple(
        t for t in adapter.calibration_tensors(GraphIndex(mapping.model), mapping.placement)
        if t not in mapping.scales.activations)
    if not needed:
        return mapping.scales
    try:
        measured = calibrate(mapping.model, feeds, method="max", tensors=needed, progress=False,
                             target=target)  # ort-cpu: the collectors' ranges, off the FP16 grid
    except QatError as exc:
        raise ExportError(f"export_onnx: ranges of the {target} requantization points from sample_data: "
                          f"{brief(exc)}") from None
    samples = len(next(iter(feeds.values())))
    logger.info("%s: %d requantization point(s) take their range from sample_data (max |x|, %d samples)",
                target, len(needed), samples)
    return mapping.scales.merged(ScaleTable(
        measured.activations, producer=mapping.scales.producer,
        metadata={f"{target}_ranges": f"max |x| over {samples} sample_data samples for {len(needed)} "
                  "requantization point(s) no quantizer observes"},
        bounds=measured.bounds))


def _quantize(quantize, float_model, mapping: KerasOnnxMapping, target: str, table,
              precision: str = "int8"):
    """Quantize with the Keras placement and ``table``; use the default placement when it is the
    same one, so that ``onnx-qat quantize --scales`` reproduces the model byte for byte. FP8 starts
    from the float weights (not snapped to the Keras int8 grid, which FP8 would round again)."""
    from onnx_qat.placement.policy import place

    source = mapping.model if precision == "int8" else float_model
    default = place(source, target=target, precision=precision)
    same = not mapping.baked and _marks(default) == _marks(mapping.placement)
    if same:
        return quantize(source, scales=table, target=target, progress=False, precision=precision), True
    return quantize(source, scales=table, target=target, placement=mapping.placement,
                    progress=False, precision=precision), False


def _marks(placement) -> tuple:
    acts = sorted((m.tensor, tuple(sorted(m.consumers)), m.scale_group) for m in placement.activations)
    weights = sorted((w.tensor, w.node, w.input_index, -1 if w.axis is None else w.axis)
                     for w in placement.weights)
    return tuple(acts), tuple(weights)
