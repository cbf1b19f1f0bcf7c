"""Rule CPU7 of the ``ort-cpu`` form: each quantized Conv's bias absorbs the mean error of its rounded
weight.

Rounding a weight to its INT8 grid changes the Conv's output by ``(W_q - W) * x``. Over the data that
error has a mean, ``sum_i (W_q - W)[c, i] * E[x_i]`` per output channel ``c`` (the kernel's taps
summed, ``E[x_i]`` the mean of input channel ``i``), which does not average out from layer to layer:
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

Applies to ``target="ort-cpu"`` with calibration data (`onnx_qat.quantize` with ``data``), INT8, to
every quantized Conv whose weight and activation input are both quantized; a Conv without a bias
gets one. Not covered: Gemm and MatMul (their bias is a separate Add, rule CPU4), and the border
of a padded Conv (the mean of the zero padding is not subtracted: the correction uses the input's
mean over all positions). A ScaleTable given without data (e.g. learned in QAT) gets no correction,
and the TensorRT form never does.
"""
from __future__ import annotations

import logging
from typing import Dict, Mapping, Tuple

import numpy as np

from ..formats.encoding import INT8_QRANGE, quantize_weight
from ..graph.index import GraphIndex
from ..placement.marks import Placement

logger = logging.getLogger(__name__)

RULE = "CPU7"


def conv_inputs(index: GraphIndex, placement: Placement) -> Dict[str, str]:
    """``{Conv node: its activation input tensor}`` for the quantized Convs rule CPU7 corrects: a
    constant 3-D-or-more float weight marked at input 1, the activation input marked too, directly
    or before a ``Pad`` (whose input's mean then stands for the padded tensor's)."""
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
        if source not in marked or proto is None or proto.data_type != 1 or len(proto.dims) < 3:
            continue
        found[mark.node] = source
    return found


def correct_conv_biases(model, index: GraphIndex, placement: Placement, table,
                        means: Mapping[str, np.ndarray], narrow=(),
                        qrange: Tuple[int, int] = INT8_QRANGE, narrow_range: Tuple[int, int] = (-63, 63)
                        ) -> Tuple[dict, ...]:
    """Subtract each Conv's mean weight-rounding error from its bias, as edits of ``model`` (the float
    ModelProto ``index`` indexes, before Q/DQ insertion; the weights are rounded here exactly as the
    inserter will round them: per channel, ``amax`` from ``table`` when it holds the weight, else
    max |w|; ``narrow`` weights on ``narrow_range``). ``means``: ``{activation input: per-channel
    mean}`` on the calibration data (`onnx_qat.calibration.means.channel_means`).

    Returns one record per corrected Conv: ``node``, ``rule`` (CPU7), ``bias`` (the new bias
    initializer), ``largest_shift`` (the largest absolute correction subtracted)."""
    from onnx import numpy_helper

    inputs = conv_inputs(index, placement)
    by_node = {m.node: m for m in placement.weights if m.input_index == 1}
    taken = {i.name for i in model.graph.initializer} | {o for n in model.graph.node for o in n.output}
    readers: Dict[str, int] = {}
    for node in model.graph.node:
        for tensor in node.input:
            readers[tensor] = readers.get(tensor, 0) + 1
    records = []
    for name, x in inputs.items():
        mean = means.get(x)
        mark, node = by_node[name], index.by_name[name]
        if mean is None or mark.axis != 0:
            continue
        weight = numpy_helper.to_array(index.constant_proto(mark.tensor)).astype(np.float32)
        if mean.shape != (weight.shape[1] * _group(node),):
            continue
        rng = table.weights.get(mark.tensor)
        amax = None if rng is None or rng.axis != 0 else rng.amax
        q, scale = quantize_weight(weight, 0, amax, narrow_range if mark.tensor in narrow else qrange,
                                   name=mark.tensor)
        error = (q.astype(np.float64) * scale.astype(np.float64).reshape((-1,) + (1,) * (weight.ndim - 1))
                 - weight.astype(np.float64))
        shift = _shift(error.reshape(error.shape[0], error.shape[1], -1).sum(axis=2), mean, _group(node))
        old = _bias(index, node, weight.shape[0])
        new = (old - shift).astype(np.float32)
        bias_name = _fresh(f"{name}_corrected_bias", taken)
        model.graph.initializer.append(numpy_helper.from_array(new, bias_name))
        _replace_bias(model, node.proto, bias_name, readers)
        records.append({"node": name, "rule": RULE, "bias": bias_name,
                        "largest_shift": float(np.max(np.abs(shift))) if shift.size else 0.0})
    if records:
        logger.info("ort-cpu: %d Conv bias(es) corrected for the mean weight-rounding error (rule %s)",
                    len(records), RULE)
    return tuple(records)


def _group(node) -> int:
    for attribute in node.proto.attribute:
        if attribute.name == "group":
            return max(1, int(attribute.i))
    return 1


def _shift(error: np.ndarray, mean: np.ndarray, group: int) -> np.ndarray:
    """Per output channel: ``sum_i error[c, i] * mean[i]`` over the input channels of ``c``'s group
    (``error``: [C_out, C_in / group], the kernel's taps summed)."""
    out_channels, per_group = error.shape
    per_out = out_channels // group
    means = mean.astype(np.float64).reshape(group, per_group)
    return np.einsum("gci,gi->gc", error.reshape(group, per_out, per_group), means).reshape(out_channels)


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


def _fresh(base: str, taken: set) -> str:
    name, count = base, 1
    while name in taken:
        name, count = f"{base}_{count}", count + 1
    taken.add(name)
    return name


__all__ = ["RULE", "conv_inputs", "correct_conv_biases"]
