"""C7-C9: how Q/DQ nodes pair up, what feeds a DequantizeLinear, weighted ops quantized
on both inputs or neither.

Part of [`onnx_qat.check`][onnx_qat.check.check], which registers the rules in its one table,
`onnx_qat.check.RULES`; sources are cited as in its docstring."""
from __future__ import annotations

from itertools import compress
from operator import ne, not_
from typing import Iterator

from . import rules_formats
from .report import ERROR, Finding, WARNING
from .index import _DEQUANTIZE, _QUANTIZE, _fed_by_dq_all, _qdq_nodes, weighted_ops


def rule_c7_q_without_dq(model, graphs) -> Iterator[Finding]:
    """C7 (error): every QuantizeLinear output must be read by DequantizeLinear only.

    An int8 tensor reaching a float op or a graph output is not the explicit
    Q -> DQ pair TensorRT fuses; the network would compute on int8 values.
    Source: [TRT-EQ] "Q/DQ layers are processed in pairs" and Q/DQ propagation.
    """
    for g in graphs:
        ops = g.ops
        quantize = list(compress(_qdq_nodes(g), g.column("is_q")))
        read, dequantized_only = g.quantized_reads()
        if read and dequantized_only:  # then only a node without an output or writing a graph output has one
            outputs = g.outputs
            quantize = [node for node in quantize if not node.out or node.out in outputs]
        for node in quantize:
            out = node.out
            if not out:
                continue
            readers = g.readers(out)
            others = [i for i in readers if ops[i] != _DEQUANTIZE]
            if out in g.outputs:
                yield Finding("C7", ERROR, g.name(node.pos),
                              f"its int8 output {out!r} is a graph output; add a DequantizeLinear")
            if others:
                others = sorted({g.name(i) for i in others})
                yield Finding("C7", ERROR, g.name(node.pos), f"its int8 output {out!r} feeds "
                              f"{', '.join(others)} without a DequantizeLinear")
            if not readers and out not in g.outputs:
                yield Finding("C7", WARNING, g.name(node.pos), f"its output {out!r} is never used")


def rule_c8_dq_source(model, graphs) -> Iterator[Finding]:
    """C8 (warning): a DequantizeLinear should be fed by a QuantizeLinear or an int8 constant.

    A DQ of another tensor (an int8 graph input, the output of another op) is
    accepted by TensorRT only for int8 network inputs; everywhere else it means a
    broken pair. Warning, not error, because int8 inputs are legitimate.
    Source: [TRT-EQ] Q/DQ pairs and quantized weights ("an IDequantizeLayer is
    required between the weights and the linear operator").
    """
    for g in graphs:
        dequantizes = list(map(not_, g.column("is_q")))
        datas = list(compress(g.column("data"), dequantizes))
        # a constant (the usual case: an initializer), a QuantizeLinear output: a column at a time
        rest = list(map(not_, g.constant_flags(datas)))
        datas, rest_nodes = list(compress(datas, rest)), compress(compress(_qdq_nodes(g), dequantizes), rest)
        rest = list(map(not_, map(g.made_by(_QUANTIZE).__contains__, datas)))
        datas, rest_nodes = list(compress(datas, rest)), compress(rest_nodes, rest)
        for node in compress(rest_nodes, map(not_, g.are_constant(datas))):
            data = node.data
            idx = g.producer.get(data)
            origin = f"node {g.name(idx)!r}" if idx is not None else "a graph input"
            yield Finding("C8", WARNING, g.name(node.pos), f"dequantizes {data!r} from {origin}, not from a "
                          "QuantizeLinear or an int8 constant")


def rule_c9_weighted_ops(model, graphs) -> Iterator[Finding]:
    """C9 (error): Conv, ConvTranspose, Gemm, MatMul (constant weight): both or neither input quantized.

    TensorRT runs a weighted op in INT8 only when its activation and weight both
    come through Q/DQ; with one side alone it falls back to float around a useless
    Q/DQ (and some versions refuse the network).
    Source: [TRT-PL] "quantize all inputs of weighted operations (Convolution,
    Transposed Convolution and GEMM)".
    """
    yield from _c9_findings(graphs, activation_only_ok=False)


def rule_c9_ort_cpu_weighted_ops(model, graphs) -> Iterator[Finding]:
    """C9 for the ``ort-cpu`` target (error): a weighted op with a constant weight must not have its
    weight quantized alone (onnxruntime would dequantize the weight at every run and compute in float).
    Its activation alone may be quantized: a float Conv reading the requantization point (CPU1) of the
    Conv before it, kept float because its integer kernel is not faster on the CPU (rule CPU3,
    `onnx_qat.placement.cpu_latency`), dequantizes that input and runs the float kernel.
    """
    yield from _c9_findings(graphs, activation_only_ok=True)


def _c9_findings(graphs, activation_only_ok: bool) -> Iterator[Finding]:
    for g in graphs:  # whether each input is quantized, a column of weighted ops at a time
        found = weighted_ops(g)
        act_q = _fed_by_dq_all(g, found.activations, through_movement=True)
        w_q = _fed_by_dq_all(g, found.weight_tensors, through_movement=True)
        for k in compress(range(len(act_q)), map(ne, act_q, w_q)):
            i, act, weight = found.with_weight[k], found.activations[k], found.weight_tensors[k]
            if activation_only_ok and act_q[k]:
                continue
            if not (w_q[k] and rules_formats.weight_only(g, weight)):
                which, other = ("weight", "activation") if w_q[k] else ("activation", "weight")
                tensor = act if w_q[k] else weight
                yield Finding("C9", ERROR, g.name(i), f"only its {which} is quantized; quantize the "
                              f"{other} {tensor!r} too, or neither")
