"""C15: FP32 weighted ops a strongly typed build runs in FP32 beside reduced-precision or quantized
compute, read from the precision map (`onnx_qat.check.precision`, where the strongly typed
precision rules and their sources are).

Part of [`onnx_qat.check`][onnx_qat.check.check], which registers the rules in its one table,
`onnx_qat.check.RULES`; sources are cited as in its docstring and in
`onnx_qat.check.precision` ([TRT-ST])."""
from __future__ import annotations

from itertools import filterfalse
from typing import Iterator

from ..formats.numeric import FLOAT_DTYPE_KEY, float_dtype_of
from .index import WEIGHTED_OPS, _DEQUANTIZE, _input, weighted_ops
from .precision import _dq_source, computes_in_reduced_float, precision_map_of
from .report import MODEL_NODE, NOTE, WARNING, Finding

#: How many FP32 weighted ops the note names.
NAMED = 5


def rule_c15_fp32_weighted_ops(model, graphs) -> Iterator[Finding]:
    """C15: an FP32 Conv/ConvTranspose/Gemm/MatMul in a model that also computes in FP16/BF16 or
    quantized runs in FP32 under a strongly typed build (TensorRT 11 builds no other kind) [TRT-ST].

    * The model computes in FP16/BF16 (its float parts were converted): a warning per FP32 weighted
      op, naming the reason when the conversion kept it on purpose (node metadata `KEEP_FP32_KEY`).
    * The model computes quantized and its float parts are FP32: a warning per FP32 weighted op,
      unless the model records that its float parts are FP32 on purpose (model metadata
      `FLOAT_DTYPE_KEY` = ``fp32``, which ``onnx-qat quantize`` writes with ``--float-dtype fp32``,
      its default: such a model is meant for TensorRT 8.6-10 weakly typed builds, where the builder's
      FP16 flag picks FP16 for them). Then one note (not a warning) says how many run in FP32 under
      a strongly typed build and that ``--float-dtype fp16`` is the form for TensorRT 11.

    Source: [TRT-ST] "Strongly Typed Networks" (TensorRT 11 supports only strongly typed networks: the
    model gives every tensor's type, there is no FP16 builder flag); TensorRT 11 migration guide
    ("Strongly Typed Networks Are Now Required"); TensorRT 10 Developer Guide, "Reduced Precision"
    (a weakly typed build with ``BuilderFlag.FP16`` may run FP32 layers in FP16).
    """
    reduced = computes_in_reduced_float(graphs)
    if not reduced and not _float_weighted_beside_quantized(graphs):
        return  # cheap test first: the map costs about half a check on large models
    pmap = precision_map_of(model, graphs)
    precisions = {e.precision for e in pmap.nodes}
    fp32 = pmap.fp32_compute(weighted_only=True)
    if not fp32:
        return
    if reduced and precisions & {"fp16", "bf16"}:
        for entry in fp32:
            if entry.reason.startswith("kept FP32 by the conversion"):
                message = f"runs in FP32 under a strongly typed build; {entry.reason}"
            else:
                message = ("runs in FP32 under a strongly typed build while the model computes in FP16/BF16 "
                           "elsewhere; give it FP16 inputs (convert the float parts) or mark why it stays "
                           "FP32")
            yield Finding("C15", WARNING, entry.node, f"{entry.op_type} {message}")
        return
    if not precisions & {"int8", "fp8", "int4"}:
        return
    if float_dtype_of(model) == "fp32":
        names = ", ".join(e.node for e in fp32[:NAMED])
        more = f" ... (+{len(fp32) - NAMED})" if len(fp32) > NAMED else ""
        yield Finding("C15", NOTE, MODEL_NODE,
                      f"{len(fp32)} Conv/ConvTranspose/Gemm/MatMul ({names}{more}) run in FP32 under a "
                      f"strongly typed build: the float parts are FP32 on purpose ({FLOAT_DTYPE_KEY}=fp32), "
                      "as TensorRT 8.6-10 weakly typed builds with the FP16 flag want; for TensorRT 11 "
                      "(strongly typed only) quantize with --float-dtype fp16")
        return
    for entry in fp32:
        yield Finding("C15", WARNING, entry.node,
                      f"{entry.op_type} runs in FP32 under a strongly typed build (TensorRT 11 builds no "
                      "other kind) while the model computes quantized elsewhere, and the model does not say "
                      "its float parts are FP32 on purpose; convert them (onnx-qat quantize --float-dtype "
                      f"fp16) or, for a weakly typed build, record it (metadata {FLOAT_DTYPE_KEY}=fp32)")


def _float_weighted_beside_quantized(graphs) -> bool:
    """Whether some graph holds Q/DQ nodes and a weighted op whose activation input is not dequantized
    (read from the index, without the precision map): a column of activation inputs at a time, those a
    DequantizeLinear writes looked up at once, the others followed through data-movement ops one by one."""
    if not any(g.qdq for g in graphs):
        return False
    for g in graphs:
        found = weighted_ops(g)
        dequantized = g.made_by(_DEQUANTIZE)
        acts = found.activations
        if any(t and _dq_source(g, t) is None for t in filterfalse(dequantized.__contains__, acts)):
            return True
        weightless = (i for i in g.indices_of(tuple(WEIGHTED_OPS)) if found.weights[i] is None)
        for i in weightless:
            if any(t and _dq_source(g, t) is None for t in (_input(g.node_inputs[i], k) for k in range(2))):
                return True
    return False
