"""C10-C12 and C14: the fusions TensorRT makes (residual Add into the Conv, Pad into
the Conv, Conv -> BatchNormalization -> activation).

Part of [`onnx_qat.check`][onnx_qat.check.check], which registers the rules in its one table,
`onnx_qat.check.RULES`; sources are cited as in its docstring."""
from __future__ import annotations

from itertools import compress
from operator import and_, not_, or_
from typing import Iterator, List

from ..placement.residual import fused_addend
from .report import ERROR, Finding, WARNING
from .index import (
    WEIGHTED_OPS, _DEQUANTIZE, _Graph, _QDQ, _QUANTIZE, _fed_by_dq, _fed_by_dq_all, _input, _inputs_at,
    _qdq_nodes, _weight_input, _weighted_producer,
)


def _is_quantized_op(g: _Graph, idx: int) -> bool:
    act = 0 if g.ops[idx] in ("Conv", "ConvTranspose") else 1 - _weight_input(g, idx)
    return _fed_by_dq(g, _input(g.node_inputs[idx], act), through_movement=True)


def rule_c10_residual_float_skip(model, graphs) -> Iterator[Finding]:
    """C10 (warning): a residual Add fed by a quantized weighted op should get a quantized skip input.

    TensorRT fuses ``Conv + Add`` into one INT8 kernel when the other (skip)
    input comes through Q/DQ; with both inputs float the Add runs separately in
    float and the Conv writes float output. A Sum is checked on its first two inputs
    (the first link of the chain of sums TensorRT builds for it). Not reported: an Add
    whose other input is computed from the weighted op's own output (``y + f(y)``, e.g.
    squeeze-excitation ``y + y*gate``), which no fusion can serve.
    Source: [TRT-PL] "Q/DQ placement for residual (element-wise addition) fusion".
    """
    for g in graphs:
        for i in _joins(g, quantized=False):
            inputs = g.node_inputs[i][:2]  # the two addends (of a Sum: the first link of its chain)
            convs = [_weighted_producer(g, t) for t in inputs]
            convs = [c for c in convs if c is not None and _is_quantized_op(g, c)]
            if len(convs) == 1 and _reads_output_of(g, inputs, convs[0]):
                continue  # y + f(y): no fusion possible, the other addend needs the op's own output
            if convs:
                fused = fused_addend([_weighted_producer(g, t) in convs for t in inputs])
                skip, conv = inputs[1 - fused], _weighted_producer(g, inputs[fused])
                yield Finding("C10", WARNING, g.name(i), f"both inputs are float; quantize the skip input "
                              f"{skip!r} so TensorRT can fuse the Add into {g.ops[conv]} {g.name(conv)!r}")


def _joins(g: _Graph, quantized: bool) -> List[int]:
    """The residual joins (`_Graph.residual_adds`) whose two addends are both DequantizeLinear outputs
    (``quantized``), or neither is: the addends looked up a column at a time."""
    joins = g.residual_adds()
    first = _fed_by_dq_all(g, _inputs_at(g, joins, 0))
    second = _fed_by_dq_all(g, _inputs_at(g, joins, 1))
    both = map(and_, first, second) if quantized else map(not_, map(or_, first, second))
    return list(compress(joins, both))


def _reads_output_of(g, inputs, conv: int, limit: int = 64) -> bool:
    """True when the addend of ``inputs`` not produced by weighted op ``conv`` (directly or through
    one BatchNormalization) is computed from that op's output, within a bounded backward walk."""
    made = {tensor for tensor, idx in g.producer.items() if idx == conv}
    made.update(t for t in inputs if _weighted_producer(g, t) == conv)
    others = [t for t in inputs if t not in made]
    if len(others) != 1:
        return False
    frontier, seen = [others[0]], {others[0]}
    for _ in range(limit):
        if not frontier:
            return False
        tensor = frontier.pop()
        if tensor in made:
            return True
        idx = g.producer.get(tensor)
        if idx is None:
            continue
        for following in g.node_inputs[idx]:
            if following and following not in seen and not g.is_constant(following):
                seen.add(following)
                frontier.append(following)
    return False


def rule_c11_residual_conv_branch_quantized(model, graphs) -> Iterator[Finding]:
    """C11 (warning): a residual Add with both inputs quantized, one straight from a weighted op.

    The Q/DQ on the branch coming from the Conv stops TensorRT from fusing the
    Add into that Conv; leave that branch float and quantize only the skip input.
    Source: [TRT-PL] residual-add fusion ("do not quantize the output of the
    convolution that feeds the element-wise addition").
    """
    for g in graphs:
        for i in _joins(g, quantized=True):
            inputs = g.node_inputs[i][:2]
            for t in inputs:
                dq = g.producer[t]  # a DequantizeLinear: every input is fed by one
                q = g.producer.get(_input(g.node_inputs[dq], 0))
                source = _input(g.node_inputs[q], 0) if q is not None and g.ops[q] == _QUANTIZE else None
                conv = _weighted_producer(g, source) if source else None
                if conv is not None:
                    yield Finding("C11", WARNING, g.name(i), f"both inputs are quantized and {t!r} comes "
                                  f"straight from {g.ops[conv]} {g.name(conv)!r}; leave that input float "
                                  "so TensorRT can fuse the Add into it")
                    break


def _dq_readers(g: _Graph, tensor: str) -> List[_QDQ]:
    """The DequantizeLinear nodes reading Q/DQ output ``tensor`` (once per reading input)."""
    return [g.qdq_at[i] for i in g.readers(tensor) if g.ops[i] == _DEQUANTIZE]


def rule_c12_pad_conv(model, graphs) -> Iterator[Finding]:
    """C12 (error): no Q/DQ between Pad and Conv.

    TensorRT fuses Pad into the following Conv; a Q/DQ pair in between blocks the
    fusion and pads in float. Quantize the Pad's input instead (Q/DQ commute with Pad).
    Source: [TRT-PL] commuting layers; DESIGN rule 8.
    """
    for g in graphs:
        pads = g.made_by("Pad")
        for node in _quantizing(g, pads):
            if not node.out:
                continue
            for dq in _dq_readers(g, node.out):
                if dq.out and any(g.ops[c] in ("Conv", "ConvTranspose") for c in g.readers(dq.out)):
                    yield Finding("C12", ERROR, g.name(node.pos), f"quantizes the output of Pad "
                                  f"{g.name_of_producer(node.data)!r} feeding a Conv; put the Q/DQ "
                                  "before the Pad")
                    break


def _quantizing(g: _Graph, tensors: frozenset) -> List[_QDQ]:
    """The QuantizeLinear nodes of ``g`` whose data input is one of ``tensors``, in graph order (looked up
    a column at a time)."""
    if not tensors:
        return []
    quantize = g.column("is_q")
    return list(compress(compress(_qdq_nodes(g), quantize),
                         map(tensors.__contains__, compress(g.column("data"), quantize))))


_FUSIBLE_AFTER_WEIGHTED = frozenset({
    "BatchNormalization", "Relu", "LeakyRelu", "PRelu", "Clip", "Sigmoid", "Tanh", "Elu", "Selu",
    "HardSigmoid", "HardSwish",
})
_WEIGHTED_OR_BN = frozenset(WEIGHTED_OPS + ("BatchNormalization",))


def rule_c14_qdq_inside_fusion(model, graphs) -> Iterator[Finding]:
    """C14 (warning): no Q/DQ between a weighted op (or its BatchNormalization) and the
    BatchNormalization/activation that TensorRT fuses into it.

    TensorRT fuses Conv -> BatchNormalization -> Relu (and other pointwise
    activations) into one kernel; a Q/DQ pair inside the chain splits it and adds a
    rounding step the float model never had. Quantize weighted ops' inputs, not
    their outputs.
    Source: [TRT-PL] "quantize the inputs of weighted operations, not their outputs"
    and layer fusion; DESIGN rules 4 and 5.
    """
    for g in graphs:
        ops = g.ops
        for node in _quantizing(g, g.made_by(_WEIGHTED_OR_BN)):
            source = g.producer[node.data]
            if ops[source] != "BatchNormalization" and _weight_input(g, source) is None:
                continue
            dqs = _dq_readers(g, node.out) if node.out else []
            fused = sorted({ops[c] for dq in dqs if dq.out for c in g.readers(dq.out)
                            if ops[c] in _FUSIBLE_AFTER_WEIGHTED})
            if fused:
                yield Finding("C14", WARNING, g.name(node.pos), f"sits between {ops[source]} "
                              f"{g.name(source)!r} and {'/'.join(fused)}, which TensorRT fuses into it; "
                              "remove this Q/DQ")
