"""Rule CPU7 of the ``ort-cpu`` form: each quantized Conv's bias absorbs the mean error of its rounded
weight.

Rounding a weight to its INT8 grid changes the Conv's output by ``(W_q - W) * x``. Over the data that
error has a mean, ``sum_i (W_q - W)[c, i] * E[x_i]`` per output channel ``c`` (the kernel's taps
summed, ``E[x_i]`` the mean of input channel ``i``; exactly, each tap's mean input over the output
positions, zero padding included, `tap_means`), which does not average out from layer to layer:
the inputs of most Convs have a non-zero mean (Relu, swish and Sigmoid outputs, images). Subtracting
it from the bias removes that part of the weight error at no cost at inference (the "bias correction"
of Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction", ICCV 2019,
section 4.2, here with the input means measured on the calibration data instead of derived from
batch-norm statistics). The weights, their scales and every activation range stay as they were.

Measured on Keras EfficientNetB0 (random weights, 224 x 224, the same 16 calibration images as
onnxruntime's ``quantize_static`` form, ``method="max"``, its mean output error over six sets of 8
test images): weight rounding alone (activations left float) gave 0.0036 of the output range,
activation rounding alone (weights left float) 0.0028; the correction took the form from 1.00x to
0.67x onnxruntime's form's error.

`onnx_qat.quantize` keeps the correction only where it lowers the output error on the first calibration
samples (a guard: on the real PP-OCRv4 detector it doubled the error, whose mean part there comes from
the rounded activations). Applies to ``target="ort-cpu"`` with calibration data (`onnx_qat.quantize`
with ``data``), INT8, to every quantized Conv whose weight and activation input are both quantized; a
Conv without a bias gets one. Not covered: Gemm and MatMul (their bias is a separate Add, rule CPU4),
Convs other than 2-D, and ``auto_pad`` ``SAME_*`` (explicit ``pads`` are). A ScaleTable given without
data (e.g. learned in QAT) gets no correction, and the TensorRT form never does.
"""
from __future__ import annotations

import logging
from typing import Dict, Mapping, Tuple

import numpy as np

from ..formats.encoding import INT8_QRANGE, quantize_weight
from ..graph.edit import fresh_name
from ..graph.index import GraphIndex
from ..placement.marks import Placement

logger = logging.getLogger(__name__)

RULE = "CPU7"


def conv_inputs(index: GraphIndex, placement: Placement) -> Dict[str, str]:
    """``{Conv node: its activation input tensor}`` for the quantized Convs rule CPU7 corrects: a
    constant 4-D float weight marked at input 1, the activation input marked too, directly or before
    a ``Pad`` (the Conv's own input, the Pad's output, is what the correction averages)."""
    marked = set(placement.activation_tensors())
    found = {}
    for mark in placement.weights:
        node = index.by_name.get(mark.node)
        if node is None or node.op_type != "Conv" or mark.input_index != 1 or not node.inputs:
            continue
        source = node.inputs[0]
        pad = index.producer.get(source) if source not in marked else None
        if pad is not None and pad.op_type == "Pad" and pad.inputs and pad.inputs[0] in marked:
            source = pad.inputs[0]
        proto = index.constant_proto(mark.tensor)
        if source not in marked or proto is None or proto.data_type != 1 or len(proto.dims) != 4:
            continue
        found[mark.node] = node.inputs[0]
    return found


#: A channel's correction is kept only where it exceeds this many standard errors of its estimate
#: (the spread of the per-sample corrections over the square root of the sample count): below that,
#: subtracting it adds about as much error as it removes. Measured on a 32 x 32 MobileNetV2 calibrated
#: on 16 samples, correcting every channel raised the output error 1.15x on one seed of three.
MIN_STANDARD_ERRORS = 2.0


def tap_reducers(index: GraphIndex, placement: Placement):
    """``{Conv node: (input tensor, reduce)}`` for `onnx_qat.calibration.means.per_sample`: ``reduce``
    turns one sample of the Conv's input into its `tap_means`."""
    weights = {m.node: m.tensor for m in placement.weights if m.input_index == 1}
    found = {}
    for name, tensor in conv_inputs(index, placement).items():
        node, shape = index.by_name[name], tuple(index.constant_proto(weights[name]).dims)
        found[name] = (tensor, lambda sample, node=node, shape=shape: tap_means(sample, node, shape))
    return found


def correct_conv_biases(model, index: GraphIndex, placement: Placement, table,
                        taps: Mapping[str, np.ndarray], narrow=(),
                        qrange: Tuple[int, int] = INT8_QRANGE, narrow_range: Tuple[int, int] = (-63, 63)
                        ) -> Tuple[dict, ...]:
    """Subtract each Conv's mean weight-rounding error from its bias, as edits of ``model`` (the float
    ModelProto ``index`` indexes, before Q/DQ insertion; the weights are rounded here exactly as the
    inserter will round them: per channel, ``amax`` from ``table`` when it holds the weight, else
    max |w|; ``narrow`` weights on ``narrow_range``). ``taps``: ``{Conv node: its `tap_means` for each
    calibration sample, stacked}`` (`tap_reducers` with `onnx_qat.calibration.means.per_sample`).
    A channel whose mean correction is within `MIN_STANDARD_ERRORS` standard errors of 0 keeps its bias.

    Returns one record per corrected Conv: ``node``, ``rule`` (CPU7), ``bias`` (the new bias
    initializer), ``channels`` corrected of ``of``, ``largest_shift`` (the largest absolute correction
    subtracted)."""
    from onnx import numpy_helper

    inputs = conv_inputs(index, placement)
    by_node = {m.node: m for m in placement.weights if m.input_index == 1}
    taken = {i.name for i in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
    readers: Dict[str, int] = {}
    for node in model.graph.node:
        for tensor in node.input:
            readers[tensor] = readers.get(tensor, 0) + 1
    records = []
    for name in inputs:
        mark, node = by_node[name], index.by_name[name]
        samples = taps.get(name)
        if samples is None or mark.axis != 0 or len(samples) < 2:
            continue
        weight = numpy_helper.to_array(index.constant_proto(mark.tensor)).astype(np.float32)
        rng = table.weights.get(mark.tensor)
        amax = None if rng is None or rng.axis != 0 else rng.amax
        q, scale = quantize_weight(weight, 0, amax, narrow_range if mark.tensor in narrow else qrange,
                                   name=mark.tensor)
        error = (q.astype(np.float64) * scale.astype(np.float64).reshape((-1,) + (1,) * (weight.ndim - 1))
                 - weight.astype(np.float64))
        each = np.stack([_shift(error, s, _group(node)) for s in samples])  # [samples, C_out]
        shift = each.mean(axis=0)
        standard_error = each.std(axis=0, ddof=1) / np.sqrt(len(each))
        keep = np.abs(shift) > MIN_STANDARD_ERRORS * standard_error
        if not keep.any():
            continue
        shift = np.where(keep, shift, 0.0)
        old = _bias(index, node, weight.shape[0])
        new = (old - shift).astype(np.float32)
        bias_name = fresh_name(f"{name}_corrected_bias", taken)
        model.graph.initializer.append(numpy_helper.from_array(new, bias_name))
        _replace_bias(model, node.proto, bias_name, readers)
        records.append({"node": name, "rule": RULE, "bias": bias_name, "channels": int(keep.sum()),
                        "of": int(keep.size), "largest_shift": float(np.max(np.abs(shift)))})
    if records:
        logger.info("ort-cpu: %d Conv bias(es) corrected for the mean weight-rounding error (rule %s)",
                    len(records), RULE)
    return tuple(records)


def _group(node) -> int:
    for attribute in node.proto.attribute:
        if attribute.name == "group":
            return max(1, int(attribute.i))
    return 1


def tap_means(mean: np.ndarray, node, weight_shape) -> "np.ndarray | None":
    """``[C_in, kH, kW]``: for each input channel and kernel tap, the mean over the Conv's output
    positions of the input value that tap reads, zero padding included, from ``mean`` (the input's
    mean over the samples, ``[C_in, H, W]``); None for attributes this does not cover (``auto_pad``
    ``SAME_*``, a mean of another shape). The Conv's mean output error is then
    ``sum (W_q - W)[c, i, kh, kw] * taps[i, kh, kw]`` exactly, by linearity."""
    attrs = {a.name: a for a in node.proto.attribute}
    if mean.ndim != 3 or mean.shape[0] != weight_shape[1] * _group(node):
        return None
    auto_pad = attrs["auto_pad"].s.decode() if "auto_pad" in attrs else "NOTSET"
    if auto_pad not in ("NOTSET", "VALID"):
        return None
    kernel = tuple(weight_shape[2:])
    strides = tuple(attrs["strides"].ints) if "strides" in attrs else (1, 1)
    dilations = tuple(attrs["dilations"].ints) if "dilations" in attrs else (1, 1)
    pads = tuple(attrs["pads"].ints) if "pads" in attrs and auto_pad == "NOTSET" else (0, 0, 0, 0)
    padded = np.pad(mean, ((0, 0), (pads[0], pads[2]), (pads[1], pads[3])))
    out = [(padded.shape[1 + a] - dilations[a] * (kernel[a] - 1) - 1) // strides[a] + 1 for a in (0, 1)]
    if min(out) < 1:
        return None
    taps = np.empty((mean.shape[0],) + kernel, np.float64)
    for kh in range(kernel[0]):
        for kw in range(kernel[1]):
            h0, w0 = kh * dilations[0], kw * dilations[1]
            window = padded[:, h0:h0 + (out[0] - 1) * strides[0] + 1:strides[0],
                            w0:w0 + (out[1] - 1) * strides[1] + 1:strides[1]]
            taps[:, kh, kw] = window.mean(axis=(1, 2))
    return taps


def _shift(error: np.ndarray, taps: np.ndarray, group: int) -> np.ndarray:
    """Per output channel: ``sum error[c, i, kh, kw] * taps[i, kh, kw]`` over the input channels of
    ``c``'s group (``error``: [C_out, C_in / group, kH, kW], ``taps``: `tap_means`)."""
    out_channels, per_group = error.shape[:2]
    per_out = out_channels // group
    grouped = taps.reshape((group, per_group) + taps.shape[1:])
    return np.einsum("gcikl,gikl->gc", error.reshape((group, per_out) + error.shape[1:]),
                     grouped).reshape(out_channels)


def _bias(index: GraphIndex, node, channels: int) -> np.ndarray:
    from onnx import numpy_helper

    if len(node.inputs) > 2 and node.inputs[2]:
        proto = index.constant_proto(node.inputs[2])
        if proto is not None:
            return numpy_helper.to_array(proto).astype(np.float64).reshape(channels)
    return np.zeros(channels, np.float64)


def _replace_bias(model, proto, bias_name: str, readers: Dict[str, int]) -> None:
    """Point the Conv ``proto`` at ``bias_name``; an old bias initializer nothing else reads goes."""
    if len(proto.input) > 2 and proto.input[2]:
        old = proto.input[2]
        proto.input[2] = bias_name
        readers[old] -= 1
        outputs = {o.name for o in model.graph.output}
        if readers[old] == 0 and old not in outputs:
            for position, init in enumerate(model.graph.initializer):
                if init.name == old:
                    del model.graph.initializer[position]
                    break
            else:  # a Constant node nothing else reads
                for position, node in enumerate(model.graph.node):
                    if node.op_type == "Constant" and list(node.output) == [old]:
                        del model.graph.node[position]
                        break
    else:
        while len(proto.input) < 2:
            proto.input.append("")
        proto.input.append(bias_name)
    readers[bias_name] = 1


__all__ = ["RULE", "MIN_STANDARD_ERRORS", "conv_inputs", "correct_conv_biases", "tap_means", "tap_reducers"]
