"""C15: FP32 weighted ops among FP16/BF16 compute, read from the precision map
(`onnx_qat.check.precision`, where the strongly typed precision rules and their sources are).

Part of [`onnx_qat.check`][onnx_qat.check.check], which registers the rules in its one table,
`onnx_qat.check.RULES`; sources are cited as in its docstring and in
`onnx_qat.check.precision` ([TRT-ST])."""
from __future__ import annotations

from typing import Iterator

from .precision import computes_in_reduced_float, precision_map_of
from .report import WARNING, Finding


def rule_c15_fp32_weighted_ops(model, graphs) -> Iterator[Finding]:
    """C15 (warning): an FP32 Conv/ConvTranspose/Gemm/MatMul in a model that also computes in FP16 or
    BF16 runs in FP32 under a strongly typed build (TensorRT 11 builds no other kind).

    With FP16/BF16 float parts the model has chosen reduced float precision; an FP32 weighted op
    among them is either kept on purpose by the conversion (node metadata `KEEP_FP32_KEY`,
    whose reason the warning names) or an oversight that costs speed. A model whose float parts are
    all FP32 is consistent and is not warned about: its precision map (``onnx-qat check
    --precision-map``) names those nodes, and converting the float parts to FP16 is the remedy.
    Source: [TRT-ST] "Strongly Typed Networks" (no FP16 builder flag; types come from the model).
    """
    if not computes_in_reduced_float(graphs):
        return
    pmap = precision_map_of(model, graphs)
    if not any(e.precision in ("fp16", "bf16") for e in pmap.nodes):
        return
    for entry in pmap.fp32_compute(weighted_only=True):
        if entry.reason.startswith("kept FP32 by the conversion"):
            message = f"runs in FP32 under a strongly typed build; {entry.reason}"
        else:
            message = ("runs in FP32 under a strongly typed build while the model computes in FP16/BF16 "
                       "elsewhere; give it FP16 inputs (convert the float parts) or mark why it stays FP32")
        yield Finding("C15", WARNING, entry.node, f"{entry.op_type} {message}")
