"""C1-C3 and C13: opsets, the op types TensorRT imports, quantized biases, Q/DQ at all.

Part of [`onnx_qat.check`][onnx_qat.check.check], which registers the rules in its one table,
`onnx_qat.check.RULES`; sources are cited as in its docstring."""
from __future__ import annotations

from itertools import compress, repeat
from operator import eq, not_
from typing import Iterator

from .report import ERROR, Finding, MODEL_NODE, WARNING
from .index import _DEFAULT_DOMAINS, _DEQUANTIZE, _QUANTIZE, _qdq_nodes


#: Ops that TensorRT's ONNX parser does not import, or that mean a non-Q/DQ integer format.
FORBIDDEN_OPS = frozenset({
    "ConvInteger", "MatMulInteger", "DynamicQuantizeLinear", "MatMulIntegerToFloat",
    "DynamicQuantizeMatMul", "DynamicQuantizeLSTM", "QGemm", "QAttention",
})


# -- the rules ----------------------------------------------------------------------------------------
def rule_c1_opset(model, graphs) -> Iterator[Finding]:
    """C1 (error): the default-domain opset must be >= 13.

    Per-axis QuantizeLinear/DequantizeLinear (the ``axis`` attribute) exist from
    opset 13; TensorRT's ONNX parser imports Q/DQ only from there.
    Source: [ONNX-TRT] operator support for QuantizeLinear/DequantizeLinear; [TRT-EQ].
    """
    opset = graphs[0].opset
    if opset is None:
        yield Finding("C1", ERROR, MODEL_NODE, "the model imports no default-domain opset")
    elif opset < 13:
        yield Finding("C1", ERROR, MODEL_NODE,
                      f"opset {opset} is below 13; upgrade it (onnx.version_converter) before quantizing")


def _is_forbidden(op: str) -> bool:
    return op.startswith("QLinear") or op in FORBIDDEN_OPS


def rule_c2_forbidden_ops(model, graphs) -> Iterator[Finding]:
    """C2 (error): no QLinear*, ConvInteger, MatMulInteger, DynamicQuantizeLinear (or kin).

    These are onnxruntime's integer-operator formats; TensorRT imports only
    default-domain QuantizeLinear/DequantizeLinear pairs around float ops (not the
    ``com.microsoft`` Q/DQ contrib ops).
    Source: [TRT-EQ] "ONNX Support"; [ONNX-TRT] operator support list.
    """
    for g in graphs:
        if any(_is_forbidden(op) for op in set(g.ops)):
            visits = [(i, op, g.qdq_at.get(i)) for i, op in enumerate(g.ops)]
        else:  # only a Q/DQ node outside the default domain can be reported
            visits = [(node.pos, _QUANTIZE if node.is_q else _DEQUANTIZE, node) for node in g.qdq
                      if node.domain not in _DEFAULT_DOMAINS]
        for i, op, node in visits:
            if _is_forbidden(op):
                yield Finding("C2", ERROR, g.name(i),
                              f"{op} is not supported by TensorRT; export QuantizeLinear/"
                              "DequantizeLinear (QDQ format) instead")
            elif node is not None and node.domain not in _DEFAULT_DOMAINS:
                yield Finding("C2", ERROR, g.name(i),
                              f"{op} of domain {node.domain!r} is not the ONNX operator TensorRT "
                              "imports; use the default-domain op")


def rule_c3_int32_bias(model, graphs) -> Iterator[Finding]:
    """C3 (error): no DequantizeLinear of an int32 tensor (quantized bias).

    TensorRT quantizes only activations and weights to INT8 and keeps biases in
    float; an int32 bias DQ is onnxruntime's QDQ bias form.
    Source: [TRT-EQ] (INT8 Q/DQ only); [ONNX-TRT] DequantizeLinear input types.
    """
    int32 = 6  # onnx.TensorProto.INT32
    for g in graphs:
        dequantizes = list(map(not_, g.column("is_q")))
        dequantize = list(compress(_qdq_nodes(g), dequantizes))
        types = g.elem_types(list(compress(g.column("data"), dequantizes)))  # a weight's, a bias's: stored
        for node in compress(dequantize, map(eq, types, repeat(int32))):
            yield Finding("C3", ERROR, g.name(node.pos),
                              f"dequantizes int32 tensor {node.data!r} (a quantized bias); "
                              "keep biases in float for TensorRT")


def rule_c13_not_quantized(model, graphs) -> Iterator[Finding]:
    """C13 (warning): a model without any QuantizeLinear/DequantizeLinear is not quantized.

    TensorRT builds it in float (or implicit INT8 with a calibrator), not with explicit quantization.
    Source: [TRT-EQ] "When TensorRT detects Q/DQ layers in a network, it builds an
    engine using explicit quantization".
    """
    if not any(g.qdq for g in graphs):
        yield Finding("C13", WARNING, MODEL_NODE, "not quantized: the model has no QuantizeLinear/"
                      "DequantizeLinear nodes, so TensorRT builds it in float; quantize it first "
                      "('onnx-qat quantize')")
