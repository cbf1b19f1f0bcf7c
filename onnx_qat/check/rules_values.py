"""C4-C6: zero points, scales and per-channel axes of every Q/DQ node.

Part of [`onnx_qat.check`][onnx_qat.check.check], which registers the rules in its one table,
`onnx_qat.check.RULES`; sources are cited as in its docstring."""
from __future__ import annotations

import math
from itertools import compress, repeat
from operator import and_, is_not, itemgetter, not_, or_
from typing import Iterator, Optional

from . import rules_formats
from .report import ERROR, Finding, WARNING
from .index import (_Graph, _QDQ, _QUANTIZE, _constant_sources, _input, _int_attr, _itemsizes, _qdq_nodes,
                    _type_name)


def rule_c4_zero_points(model, graphs) -> Iterator[Finding]:
    """C4 (error): zero points must be constant int8 zeros (symmetric signed INT8).

    A QuantizeLinear without a zero point (and no ``output_dtype``) produces uint8.
    Source: [TRT-EQ] "TensorRT supports only symmetric ... signed INT8", zero point 0;
    [ONNX-TRT] QuantizeLinear/DequantizeLinear: "zero point must be 0".
    """
    from onnx import TensorProto
    for g in graphs:
        # A constant int8 all-zero zero point is fine whatever else the node is: judged in one batch.
        good = g.prejudge(g.stored_column("zp"), TensorProto.INT8, "i1", _is_zero)
        types, other = rules_formats.quantized_type_column(g), rules_formats.OTHER_TYPES
        # FP8 and INT4 Q/DQ (other_format) are left out too: their zero points are rules F1 and F5
        for node in compress(_qdq_nodes(g), map(not_, map(or_, good, map(other.__contains__, types)))):
            zp = node.zp
            name = g.name(node.pos)
            if not node.is_q and g.elem_type(node.data) == TensorProto.INT32:
                continue  # a quantized bias: rule C3 reports it
            if not zp:
                dtype = (_int_attr(node.attrs, "output_dtype", 0) or TensorProto.UINT8) if node.is_q \
                    else g.elem_type(node.data)
                if dtype not in (None, TensorProto.INT8):
                    yield Finding("C4", ERROR, name, f"has no zero point, so its integer type is "
                                  f"{_type_name(dtype)}; TensorRT needs an int8 zero point of 0")
                continue
            if not g.is_constant(zp):
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is not a constant")
                continue
            dtype = g.elem_type(zp)
            if dtype != TensorProto.INT8:
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is {_type_name(dtype)}; "
                              "TensorRT needs int8 (symmetric quantization, zero point 0)")
                continue
            nonzero = g.memo("C4", zp, _first_nonzero)
            if nonzero is not None:
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is not all zero (e.g. {nonzero}); "
                              "TensorRT needs symmetric quantization")


def _is_zero(values):
    return values == 0


def _finite_positive(values):
    import numpy as np
    return np.isfinite(values) & (values > 0)


def _first_nonzero(values) -> Optional[int]:
    """The first non-zero value of a zero-point array, or None (also for an unreadable one)."""
    if values is None or not values.size:
        return None
    flat = values.reshape(-1)
    if flat.size == 1:
        value = int(flat[0])
        return value if value else None
    nonzero = flat != 0
    return int(flat[nonzero.argmax()]) if nonzero.any() else None


def rule_c4_ort_cpu_zero_points(model, graphs) -> Iterator[Finding]:
    """C4 for the ``ort-cpu`` target (error): zero points constant, int8 zeros or uint8 (any value).

    The ort-cpu form (`onnx_qat.insertion.ort_cpu`) stores activations as uint8 with zero point 128 (0
    where they are non-negative, the zero point of an asymmetric range where calibration gave the
    tensor's extremes) and some weights as uint8 ``q + 128``; int8 tensors (weights) stay symmetric.
    An int8 zero point other than 0 is not a form that target writes.
    """
    import numpy as np
    from onnx import TensorProto
    for g in graphs:
        zero_points = g.stored_column("zp")
        good = map(or_, g.prejudge(zero_points, TensorProto.INT8, "i1", _is_zero),
                   g.prejudge(zero_points, TensorProto.UINT8, "u1", _any_value))
        # a constant of an allowed type and values: no finding, whatever the node
        for node in compress(_qdq_nodes(g), map(not_, good)):
            zp = node.zp
            name = g.name(node.pos)
            if (not node.is_q and g.elem_type(node.data) == TensorProto.INT32) or not zp:
                continue  # C3 reports a quantized bias; no zero point means uint8 zero point 0
            if not g.is_constant(zp):
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is not a constant")
                continue
            allowed = _ORT_CPU_ZERO_POINTS.get(g.elem_type(zp))
            if allowed is None or g.memo("C4-ort-cpu", zp, lambda values: values is not None
                                         and not np.isin(values, allowed).all()):
                yield Finding("C4", ERROR, name, f"zero point {zp!r} is not int8 0 or uint8, "
                              "the zero points of the ort-cpu form")


#: Element type -> the zero-point values the ort-cpu form writes (int8 0; uint8 any: 0 for non-negative
#: tensors, 128 for symmetric ones, another value for an asymmetric calibrated range).
_ORT_CPU_ZERO_POINTS = {3: (0,), 2: tuple(range(256))}


def _any_value(values):
    import numpy as np

    return np.ones(values.shape, bool)


def rule_c5_scales(model, graphs) -> Iterator[Finding]:
    """C5 (error): scales must be constants (initializer or Constant), finite and > 0.

    Source: [TRT-EQ] "the scale must be a build-time constant"; [ONNX-TRT]
    QuantizeLinear/DequantizeLinear: scale must be an initializer or constant.
    """
    from onnx import TensorProto
    for g in graphs:
        good = g.prejudge(g.stored_column("scale"), TensorProto.FLOAT, "<f4", _finite_positive)
        for node in compress(_qdq_nodes(g), map(not_, good)):  # not known to be finite and > 0
            scale = node.scale
            if not scale or not g.is_constant(scale):
                yield Finding("C5", ERROR, g.name(node.pos), f"scale {scale!r} is not a constant "
                              "(initializer or Constant node); TensorRT needs build-time scales")
                continue
            problem = g.memo("C5", scale, _scale_problem)
            if problem:
                yield Finding("C5", ERROR, g.name(node.pos), f"scale {scale!r} {problem}")


def _scale_problem(values) -> str:
    """What is wrong with a scale array (``""`` when it is finite and > 0, or unreadable)."""
    import numpy as np
    if values is None:
        return ""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 1:
        value = float(values.reshape(-1)[0])
        if math.isfinite(value) and value > 0:
            return ""
    if not np.isfinite(values).all():
        return "holds a NaN or infinite value"
    if (values <= 0).any():
        return f"holds a value <= 0 (min {values.min():.3g}); scales must be > 0"
    return ""


def _quantized_source(g: _Graph, node: _QDQ) -> str:
    """The float tensor a Q/DQ node stands for (the Q input for a DQ fed by a Q)."""
    if not node.is_q:
        idx = g.producer.get(node.data)
        if idx is not None and g.ops[idx] == _QUANTIZE:
            return _input(g.node_inputs[idx], 0)
    return node.data


def rule_c6_per_channel(model, graphs) -> Iterator[Finding]:
    """C6 (error): per-channel scales need an axis in range and one scale per channel.

    Also warns about per-channel quantization of an activation: TensorRT quantizes
    activations per tensor and weights per channel.
    Source: [TRT-EQ] "per-tensor quantization for activations, per-channel for weights";
    [ONNX-TRT] QuantizeLinear/DequantizeLinear ``axis``.
    """
    for g in graphs:
        # Per-tensor scales (one element, as their stored bytes tell) need no further look.
        sizes = _itemsizes()
        kept = [raw is None or len(raw) != sizes.get(data_type)
                for data_type, raw in g.stored_column("scale")]
        scales = list(compress(g.column("scale"), kept))
        scale_shapes = g.multi_element_shapes(dict.fromkeys(scales))  # judged once per scale
        per_channel = list(map(scale_shapes.__contains__, scales))
        blocks = rules_formats.block_sizes(g)
        if blocks:  # per block: rule F3
            per_channel = list(map(and_, per_channel, map(not_, map(blocks.__contains__,
                                                                    compress(g.column("pos"), kept)))))
        nodes, scales, datas, zps, attrs = (list(compress(compress(column, kept), per_channel)) for column in
                                            (_qdq_nodes(g), *map(g.column, ("scale", "data", "zp", "attrs"))))
        # A node's findings follow from its facts (the key below): one node judges those sharing them.
        dims = g._dims  # a constant's dims, when known: its shape
        zp_shapes = list(map(dims.get, zps, repeat(_UNKNOWN)))
        for k in compress(range(len(zps)), map(not_, zps)):  # no zero point
            zp_shapes[k] = None
        keys = list(zip(map(scale_shapes.__getitem__, scales), map(dims.get, datas), zp_shapes,
                        map(id, attrs), _constant_sources(g, datas)))
        verdicts = {key: next(_c6_findings(g, node, key[0], key[4]), None) is not None
                    for key, node in dict(zip(keys, nodes)).items()}
        judged = list(map(and_, map(bool, map(itemgetter(1), keys)),  # shape and zero point's shape known
                          map(is_not, zp_shapes, repeat(_UNKNOWN))))
        if all(judged) and not any(verdicts.values()):
            continue  # every node judged by one sharing its facts: no findings
        flagged = map(or_, map(not_, judged), map(verdicts.__getitem__, keys))  # or left to each node
        for node, key in compress(zip(nodes, keys), flagged):
            yield from _c6_findings(g, node, key[0], key[4])


_UNKNOWN = object()  # a zero point whose shape `_Graph._dims` does not hold


def _c6_findings(g: _Graph, node: _QDQ, scale_shape, constant: bool) -> Iterator[Finding]:
    """Rule C6's findings for one Q/DQ node with per-channel scales of shape ``scale_shape`` (``constant``:
    whether its data is a constant source, `_Graph.is_constant_source`)."""
    scale_size = math.prod(scale_shape)
    data = node.data
    shape = g.shape(data) or g.shape(_quantized_source(g, node))
    attrs = node.attrs
    axis = _int_attr(attrs, "axis", 1)
    if axis is None:
        yield Finding("C6", ERROR, g.name(node.pos), "its axis attribute is not an integer")
        return
    zp = node.zp
    zp_shape = g.shape(zp) if zp else None
    if zp_shape is not None and tuple(zp_shape) != scale_shape:
        yield Finding("C6", ERROR, g.name(node.pos), f"zero point shape {list(zp_shape)} differs "
                      f"from scale shape {list(scale_shape)}")
    if shape is not None:
        rank = len(shape)
        if not -rank <= axis < rank:
            yield Finding("C6", ERROR, g.name(node.pos),
                          f"axis {axis} is out of range for {data!r} of rank {rank}")
            return
        channels = shape[axis]
        if channels is not None and channels != scale_size:
            yield Finding("C6", ERROR, g.name(node.pos), f"{scale_size} scales for {channels} "
                          f"channels of {data!r} on axis {axis}")
    if not constant:
        yield Finding("C6", WARNING, g.name(node.pos), f"activation {data!r} is quantized per "
                      f"channel ({scale_size} scales); TensorRT quantizes activations per tensor")
