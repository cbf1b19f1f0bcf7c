"""Rules F1-F5: the FP8 and INT4 forms, run by [`onnx_qat.check`][onnx_qat.check.check] after C1-C14.

Each rule reads the same per-graph index as the INT8 rules (the ``graphs``
[`onnx_qat.check`][onnx_qat.check.check] builds) and yields `Finding` records. The INT8 rules leave FP8 and
INT4 Q/DQ to these: C4 skips their zero points (`other_format`), C6 skips blockwise scales
(`blocked`), C9 accepts a weight-only INT4 weight without an activation Q/DQ
(`weight_only`).

Sources:

* [TRT-QS] TensorRT Developer Guide, "Quantization Schemes": FP8 is E4M3 with
  ``castToFp8(clip(x / s, -448, 448))``; INT4 is signed ``clip(x / s, -8, 7)``, weight-only,
  with per-block scales, block sizes 64 and 128, the block dimension one of the last two.
* [ONNX-Q] ONNX operators QuantizeLinear/DequantizeLinear: float8 types from opset 19; int4,
  uint4 and ``block_size`` from opset 21; the zero point has the quantized type and the scale's shape.
"""
from __future__ import annotations

from itertools import compress, repeat
from operator import eq, is_, itemgetter, or_
from typing import Dict, Iterator, Optional

from .report import ERROR, MODEL_NODE, WARNING, Finding

_FLOAT, _INT8, _UINT8 = 1, 3, 2
#: ONNX element types: the float8 family and the 4-bit integers.
FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ = 17, 18, 19, 20
UINT4, INT4 = 21, 22
FLOAT8_TYPES = frozenset({FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ})
FOUR_BIT_TYPES = frozenset({UINT4, INT4})
#: The quantized types rules F1-F5 judge (not C4).
OTHER_TYPES = FLOAT8_TYPES | FOUR_BIT_TYPES
_NAMES = {FLOAT8E4M3FN: "float8e4m3fn", FLOAT8E4M3FNUZ: "float8e4m3fnuz", FLOAT8E5M2: "float8e5m2",
          FLOAT8E5M2FNUZ: "float8e5m2fnuz", UINT4: "uint4", INT4: "int4"}
#: Block sizes [TRT-QS] lists for INT4 block quantization.
TENSORRT_BLOCK_SIZES = (64, 128)


# -- what the INT8 rules ask ------------------------------------------------------------------------
def quantized_type(g, node) -> Optional[int]:
    """The element type a Q/DQ node's quantized side has: its zero point's type, else a Q's
    ``output_dtype``, else a DQ's data type (None when unknown). Read once per node of ``g.qdq``
    (rules C4, F1, F2 and F4 all ask: on a 10^5-node model each pass cost ~0.1 s)."""
    if g.qdq_at.get(node.pos) is not node:  # not one of the graph's own records: read it
        return _read_quantized_type(g, node)
    return quantized_types(g)[node.pos]


def quantized_types(g) -> Dict[int, Optional[int]]:
    """`quantized_type` of every Q/DQ node of ``g``, by node position (read once per graph)."""
    types = g._memo.get(_TYPES_KEY)
    if types is None:
        types = g._memo[_TYPES_KEY] = dict(zip(g.column("pos"), quantized_type_column(g)))
    return types


def quantized_type_column(g) -> list:
    """`quantized_type` of every Q/DQ node of ``g``, in the order of ``g.qdq`` (read once per graph): a zero
    point read already (rule C4's batch, an edit's values) gives its type, a column at a time; the other
    nodes are read one by one."""
    column = g._memo.get(_COLUMN_KEY)
    if column is None:
        column = list(map(itemgetter(0), g.stored_column("zp")))  # None: no zero point, or none stored
        qdq = g.qdq
        for k in compress(range(len(column)), map(is_, column, repeat(None))):
            column[k] = _read_quantized_type(g, qdq[k])
        g._memo[_COLUMN_KEY] = column
    return column


def block_sizes(g) -> Dict[int, int]:
    """The ``block_size`` attribute of the Q/DQ nodes of ``g`` that have a non-zero one, by node position
    in graph order (read once per graph: rules C6, F2 and F3 ask; most nodes have no attribute at all)."""
    sizes = g._memo.get(_BLOCKS_KEY)
    if sizes is None:
        attrs = g.column("attrs")  # judged once per attributes' tuple (an edit's nodes of a form share one)
        distinct = dict(zip(map(id, attrs), attrs))
        known = {key: _int_attr(found, "block_size") for key, found in distinct.items()}
        blocked = {key for key, size in known.items() if size}
        sizes = g._memo[_BLOCKS_KEY] = {} if not blocked else {
            pos: known[key] for pos, key in zip(g.column("pos"), map(id, attrs)) if key in blocked}
    return sizes


_TYPES_KEY, _COLUMN_KEY, _BLOCKS_KEY = "quantized_type", "quantized_type_column", "block_size"
_UNKNOWN = (None,)  # a zero point whose type is not stored


def _read_quantized_type(g, node) -> Optional[int]:
    """`quantized_type` read from the node (no memo)."""
    zp = node.zp
    if zp:
        info = g._stored.get(zp)  # read by rule C4's batch already, in the usual case
        if info is not None:
            return info[0]
        if g.is_constant(zp):
            return g.elem_type(zp)
    if node.is_q:
        return _int_attr(node.attrs, "output_dtype")
    return g.elem_type(node.data)


def other_format(g, node) -> bool:
    """The node quantizes to a float8 or 4-bit type (rules F1-F5 judge it, not C4)."""
    return quantized_type(g, node) in OTHER_TYPES


def blocked(node) -> bool:
    """The node has a non-zero ``block_size`` attribute (blockwise scales, rule F3)."""
    return bool(_int_attr(node.attrs, "block_size"))


def weight_only(g, tensor: str) -> bool:
    """``tensor`` is the output of a DequantizeLinear of a constant 4-bit weight (weight-only INT4)."""
    node = g.qdq_at.get(g.producer.get(tensor, -1))
    return node is not None and not node.is_q and g.is_constant(node.data) and \
        g.elem_type(node.data) in FOUR_BIT_TYPES


def _quantizing_to(graphs, types) -> Iterator[tuple]:
    """(graph, Q/DQ node, its quantized type, its name) for every Q/DQ node whose type is in ``types``."""
    for g in graphs:  # a column at a time: most models have none
        found = quantized_type_column(g)
        for node, dtype in compress(zip(g.qdq, found), map(types.__contains__, found)):
            yield g, node, dtype, g.name(node.pos)


# -- the rules ---------------------------------------------------------------------------------------
def rule_f1_fp8_zero_points(model, graphs) -> Iterator[Finding]:
    """F1 (error): FP8 Q/DQ are E4M3FN with a constant zero point of type float8e4m3fn, all zero.

    TensorRT's FP8 is E4M3 (finite, no unsigned zero shift); E5M2 and the FNUZ variants are not
    imported, and a non-zero FP8 zero point has no TensorRT meaning.
    Source: [TRT-QS] FP8 quantization scheme; [ONNX-Q] QuantizeLinear (float8 zero point must be 0).
    """
    for g, node, dtype, name in _quantizing_to(graphs, FLOAT8_TYPES):
        if dtype != FLOAT8E4M3FN:
            yield Finding("F1", ERROR, name, f"quantizes to {_NAMES[dtype]}; TensorRT's FP8 is "
                          "float8e4m3fn (E4M3)")
            continue
        if not node.zp:
            if node.is_q:
                yield Finding("F1", ERROR, name, "FP8 QuantizeLinear without a zero point; give a "
                              "float8e4m3fn zero point of 0")
            continue
        if not g.is_constant(node.zp):
            yield Finding("F1", ERROR, name, f"zero point {node.zp!r} is not a constant")
            continue
        values = g.array(node.zp)
        if values is not None and (values.astype("float32") != 0).any():
            yield Finding("F1", ERROR, name, f"FP8 zero point {node.zp!r} is not all zero; "
                          "TensorRT needs 0")


def rule_f2_opset_of_form(model, graphs) -> Iterator[Finding]:
    """F2 (error): FP8 Q/DQ need opset >= 19; INT4/UINT4 types and ``block_size`` need opset >= 21.

    Source: [ONNX-Q] QuantizeLinear-19 (float8 types), QuantizeLinear-21 (int4, uint4, block_size).
    """
    opset = graphs[0].opset if graphs else None
    if opset is None:
        return
    need = {}
    for g in graphs:
        found = set(quantized_type_column(g))
        if not found.isdisjoint(FLOAT8_TYPES):
            need.setdefault(19, "float8 Q/DQ")
        if not found.isdisjoint(FOUR_BIT_TYPES) or block_sizes(g):
            need.setdefault(21, "int4 or blockwise Q/DQ")
    for version, what in sorted(need.items()):
        if opset < version:
            yield Finding("F2", ERROR, MODEL_NODE, f"{what} need opset >= {version}; the model imports "
                          f"opset {opset}")


def rule_f3_blocks(model, graphs) -> Iterator[Finding]:
    """F3 (error): a blockwise DequantizeLinear quantizes a 2-D constant along one of its axes, its
    ``block_size`` divides that dimension, and its scale (and zero point) hold one value per block;
    (warning) a block size other than 64 or 128.

    Source: [TRT-QS] block quantization (block sizes 64/128, block dimension one of the last two,
    weight-only); [ONNX-Q] DequantizeLinear ``block_size`` (scale shape: the data's shape with
    ``ceil(dim / block_size)`` on the block axis).
    """
    for g in graphs:
        for pos, size in block_sizes(g).items():
            node = g.qdq_at[pos]
            name = g.name(pos)
            if size < 0:
                yield Finding("F3", ERROR, name, f"block_size {size} is negative")
                continue
            shape = g.shape(node.data)
            axis = _int_attr(node.attrs, "axis", 1)
            if shape is None or axis is None:
                continue
            rank = len(shape)
            if rank != 2:
                yield Finding("F3", ERROR, name, f"blockwise quantization of a rank-{rank} tensor; TensorRT "
                              "blocks 2-D weights along one of their two axes")
                continue
            if not -rank <= axis < rank:
                yield Finding("F3", ERROR, name, f"axis {axis} is out of range for rank {rank}")
                continue
            dim = shape[axis]
            if dim is not None and dim % size:
                yield Finding("F3", ERROR, name, f"block_size {size} does not divide dimension {dim} "
                              f"(axis {axis}) of {node.data!r}")
                continue
            want = list(shape)
            want[axis] = None if dim is None else dim // size
            for role, tensor in (("scale", node.scale), ("zero point", node.zp)):
                got = g.shape(tensor) if tensor else None
                if got is not None and None not in want and list(got) != want:
                    yield Finding("F3", ERROR, name, f"{role} shape {list(got)} is not the block grid {want} "
                                  f"(block_size {size} on axis {axis})")
            if size not in TENSORRT_BLOCK_SIZES:
                yield Finding("F3", WARNING, name, f"block_size {size}; TensorRT documents INT4 block sizes "
                              f"{' and '.join(map(str, TENSORRT_BLOCK_SIZES))}")


def rule_f4_int4_weights_only(model, graphs) -> Iterator[Finding]:
    """F4 (error): INT4 quantizes constant weights only, as signed int4 read by a DequantizeLinear.

    A QuantizeLinear to a 4-bit type quantizes an activation; TensorRT supports INT4 for weights
    only. UINT4 is not a TensorRT type.
    Source: [TRT-QS] "INT4 ... weight-only quantization"; signed INT4 range [-8, 7].
    """
    for g, node, dtype, name in _quantizing_to(graphs, FOUR_BIT_TYPES):
        if dtype == UINT4:
            yield Finding("F4", ERROR, name,
                          "quantizes to uint4; TensorRT's 4-bit integer is signed int4")
        elif node.is_q:
            yield Finding("F4", ERROR, name, f"quantizes activation {node.data!r} to int4; TensorRT "
                          "takes int4 for constant weights only (weight-only quantization)")
        elif not g.is_constant(node.data):
            yield Finding("F4", ERROR, name, f"dequantizes int4 {node.data!r}, which is not a constant "
                          "weight; TensorRT takes int4 for weights only")


def rule_f5_int4_zero_points(model, graphs) -> Iterator[Finding]:
    """F5 (error): an INT4 zero point, when given, is a constant int4 tensor of zeros.

    Source: [TRT-QS] symmetric INT4 (``x = x_q * s``, no offset).
    """
    for g in graphs:
        # a zero point read already: its type, in short (a column at a time); the others asked one by one
        types = list(map(itemgetter(0), g.stored_column("zp")))
        for node in compress(g.qdq, map(or_, map(is_, types, repeat(None)), map(eq, types, repeat(INT4)))):
            zp = node.zp
            if not zp or g.elem_type(zp) != INT4:
                continue
            values = g.array(node.zp) if g.is_constant(node.zp) else None
            if not g.is_constant(node.zp):
                yield Finding("F5", ERROR, g.name(node.pos), f"zero point {node.zp!r} is not a constant")
            elif values is not None and (values.astype("int8") != 0).any():
                yield Finding("F5", ERROR, g.name(node.pos), f"int4 zero point {node.zp!r} is not all zero; "
                              "TensorRT needs symmetric quantization")


#: (rule id, severity it can report, one-line description, function), appended to
#: `onnx_qat.check.RULES`.
RULES = (
    ("F1", ERROR, "FP8 Q/DQ: float8e4m3fn with a constant zero point of 0", rule_f1_fp8_zero_points),
    ("F2", ERROR, "opset >= 19 for FP8 Q/DQ, >= 21 for INT4 and blockwise Q/DQ", rule_f2_opset_of_form),
    ("F3", ERROR, "blockwise DQ: 2-D weight, block_size divides the block axis, one scale per block "
                  "(block size not 64/128: warning)", rule_f3_blocks),
    ("F4", ERROR, "INT4 only on constant weights, signed", rule_f4_int4_weights_only),
    ("F5", ERROR, "INT4 zero points constant and all zero", rule_f5_int4_zero_points),
)


def _int_attr(attrs, name: str, default=None):
    """An integer attribute among ``attrs`` (AttributeProto messages), ``default`` when absent."""
    for attr in attrs or ():
        if attr.name == name:
            return int(attr.i) if attr.type == 2 else None  # AttributeProto.INT
    return default


__all__ = ["RULES", "OTHER_TYPES", "other_format", "blocked", "block_sizes", "weight_only", "quantized_type",
           "quantized_types"]
