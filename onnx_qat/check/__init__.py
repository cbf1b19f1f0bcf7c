"""check(model) -> CheckReport: TensorRT-readiness linter for Q/DQ models from any tool.

The rules read a model exported by any tool (this project, onnxruntime's
``quantize_static``, PyTorch quantization toolkits...) and report what TensorRT's
explicit-quantization INT8 path will refuse (``error``) or run slower than it
could (``warning``). Each rule is one small function ``rule_cN_...`` with its
source in the docstring, in a module per rule family (``rules_*.py``, over the
per-graph index of ``index.py``); `RULES` below is the one table of rules
that [`check`][onnx_qat.check.check] runs, where every rule is registered.

Sources cited by the rules:

* [TRT-EQ] TensorRT Developer Guide, "Explicit Quantization" (Q/DQ layers,
  symmetric signed INT8, constant scales, per-tensor activations and per-channel
  weights).
* [TRT-PL] TensorRT Developer Guide, "Q/DQ Layer-Placement Recommendations"
  (quantize the inputs of weighted ops, residual Add fusion, commuting ops).
* [TRT-ST] TensorRT 11 Developer Guide, "Precision Control", "Strongly Typed Networks" (rule C15
  and the precision map, `onnx_qat.check.precision`).
* [ONNX-TRT] onnx-tensorrt ``docs/operators.md`` (QuantizeLinear/DequantizeLinear
  need opset >= 13 for per-axis scales, zero point 0; QLinear* and *Integer ops are
  not supported).

The checker only reads the model: a ``ModelProto`` given by the caller is never
modified (shape inference runs on a copy).

Owns: the check rules, their one table, the per-graph index they read and the report.
May import: io, graph, formats, the targets (data), rule 6's choice (``placement.residual``); it
reads any tool's output, so never the rest of placement, insertion or calibration.
"""
from __future__ import annotations

import logging
from typing import Callable, Dict, Optional, Tuple

from ..errors import ModelError
from .report import CheckReport, ERROR, NOTE, WARNING
from .index import _all_graphs, same_index
from .rules_ops import rule_c13_not_quantized, rule_c1_opset, rule_c2_forbidden_ops, rule_c3_int32_bias
from .rules_values import (
    rule_c4_ort_cpu_zero_points, rule_c4_zero_points, rule_c5_scales, rule_c6_per_channel,
)
from . import rules_formats
from .rules_pairs import (rule_c7_q_without_dq, rule_c8_dq_source, rule_c9_ort_cpu_weighted_ops,
                          rule_c9_weighted_ops)
from .rules_fusion import (
    rule_c10_residual_float_skip, rule_c11_residual_conv_branch_quantized, rule_c12_pad_conv,
    rule_c14_qdq_inside_fusion,
)
from .precision import PrecisionMap, lazy_precision_map
from .rules_precision import rule_c15_fp32_weighted_ops
from .report import MODEL_NODE, Finding  # noqa: F401  (re-exported)
from .index import WEIGHTED_OPS  # noqa: F401  (re-exported)
from .rules_ops import FORBIDDEN_OPS  # noqa: F401  (re-exported)


logger = logging.getLogger(__name__)


#: Rules the ``ort-cpu`` target replaces (rule function) or leaves out (None), with the reason.
ORT_CPU_RULES: Dict[str, Tuple[Optional[Callable], str]] = {
    "C4": (rule_c4_ort_cpu_zero_points, "uint8 activations with zero point 128, 0 or an asymmetric range's"),
    "C10": (None, "onnxruntime has no Add-into-Conv/MatMul fusion (its QDQ transformer runs an Add on "
                  "integers only as QLinearAdd, every input from a DequantizeLinear): a join with both "
                  "addends float runs in float and a Q/DQ on its skip alone would only round it (CPU6)"),
    "C11": (None, "the Conv output feeding a residual Add is a requantization point (CPU1): "
                  "onnxruntime forms QLinearConv only with a QuantizeLinear on the Conv output"),
    "C14": (None, "a Q/DQ between Conv and Relu is a requantization point (CPU1), for QLinearConv"),
    "C15": (None, "a TensorRT strongly typed build's precision; onnxruntime picks its own kernels"),
    "C9": (rule_c9_ort_cpu_weighted_ops, "a weighted op kept float for speed (CPU3) may read a requantized "
                                         "(CPU1) activation"),
}


#: (rule id, severity it can report, one-line description, function) in the order they run.
RULES: Tuple[Tuple[str, str, str, Callable], ...] = (
    ("C1", ERROR, "default-domain opset >= 13", rule_c1_opset),
    ("C2", ERROR, "no QLinear*, ConvInteger, MatMulInteger, DynamicQuantizeLinear", rule_c2_forbidden_ops),
    ("C3", ERROR, "no int32 (bias) DequantizeLinear", rule_c3_int32_bias),
    ("C4", ERROR, "zero points constant, int8 and all zero", rule_c4_zero_points),
    ("C5", ERROR, "scales constant, finite and > 0", rule_c5_scales),
    ("C6", ERROR, "per-channel axis in range, one scale per channel (activations per tensor: warning)",
     rule_c6_per_channel),
    ("C7", ERROR, "QuantizeLinear output read only by DequantizeLinear", rule_c7_q_without_dq),
    ("C8", WARNING, "DequantizeLinear fed by QuantizeLinear or an int8 constant", rule_c8_dq_source),
    ("C9", ERROR, "weighted ops quantize both activation and weight, or neither", rule_c9_weighted_ops),
    ("C10", WARNING, "residual Add after a quantized weighted op has a quantized skip input",
     rule_c10_residual_float_skip),
    ("C11", WARNING, "residual Add: the branch straight from the weighted op stays float",
     rule_c11_residual_conv_branch_quantized),
    ("C12", ERROR, "no Q/DQ between Pad and Conv", rule_c12_pad_conv),
    ("C13", WARNING, "the model has Q/DQ nodes at all", rule_c13_not_quantized),
    ("C14", WARNING, "no Q/DQ inside a weighted op -> BatchNormalization/activation fusion",
     rule_c14_qdq_inside_fusion),
    ("C15", WARNING, "no FP32 Conv/ConvTranspose/Gemm/MatMul among FP16/BF16 or quantized compute (strongly "
                     "typed build; a note when the model says its float parts are FP32 on purpose)",
     rule_c15_fp32_weighted_ops),
) + rules_formats.RULES  # F1-F5: the FP8 and INT4 forms


# -- entry point --------------------------------------------------------------------------------
def _load(model):
    """The ModelProto to read (never a caller's object modified) and its path label."""
    import os
    if isinstance(model, (str, os.PathLike)):
        from ..io.models import load_model
        return load_model(model, upgrade_opset=False), str(model)
    import onnx

    from ..io.models import from_graph, is_graph
    if is_graph(model):
        return from_graph(model), ""
    if not isinstance(model, onnx.ModelProto):
        raise ModelError(f"check() needs a model path, an onnx.ModelProto or an onnx_graphsurgeon.Graph, "
                         f"got {type(model).__name__}")
    return model, ""


def _default_opset(model) -> Optional[int]:
    versions = [imp.version for imp in model.opset_import if imp.domain in ("", "ai.onnx")]
    return max(versions) if versions else None


def _inferred_value_info(model):
    """Value infos from shape inference on a copy; empty when inference fails (big or odd models)."""
    import onnx
    try:
        return list(onnx.shape_inference.infer_shapes(model, strict_mode=False).graph.value_info)
    except Exception as exc:  # shape inference is best effort: rules fall back to declared types
        logger.debug("shape inference failed (%s); checking with declared shapes only", exc)
        return []


def _lazy_inference(model) -> Callable[[], list]:
    """`_inferred_value_info` of ``model``, run the first time it is called (if ever)."""
    done: list = []

    def infer() -> list:
        if not done:
            done.append(_inferred_value_info(model))
        return done[0]

    return infer


def _compare_indexes() -> bool:
    """Whether a check given an edit's evidence also indexes the model from its protobuf and compares the two
    (``ONNX_QAT_FULL_CHECK=both``, `onnx_qat.io.models.FULL_CHECK_ENV`: the test suite's setting)."""
    from ..io.models import full_check_mode

    return full_check_mode() == "both"


def _rules_for(target) -> Tuple[Callable, ...]:
    """The rule functions [`check`][onnx_qat.check.check] runs for ``target`` (a target name, or None for
    tensorrt)."""
    from ..insertion.targets import get_target

    name = get_target(target).name
    replaced = ORT_CPU_RULES if name == "ort-cpu" else {}
    rules = (replaced[rule_id][0] if rule_id in replaced else rule for rule_id, _, _, rule in RULES)
    return tuple(rule for rule in rules if rule is not None)


def check(model, *, target: Optional[str] = None, path=None) -> CheckReport:
    """Check a Q/DQ ONNX model for TensorRT explicit-quantization readiness.

    Args:
        model: a path (loaded without opset upgrade, so an old opset is reported),
            an ``onnx.ModelProto`` (read only, never modified) or an ``onnx_graphsurgeon.Graph``
            (exported with ``gs.export_onnx``, never modified).
        target: ``None``/``"tensorrt"`` (every rule), or ``"ort-cpu"``: the rules that apply to
            that form, with `ORT_CPU_RULES` replacing C4 and C9 and leaving out C10, C11 and C14.
        path: the file an in-memory ``model`` was read from or written to, named in the
            report (`CheckReport.model`); default: ``model`` itself when it is a path.

    Returns:
        A [`CheckReport`][onnx_qat.check.CheckReport]; ``bool(report)`` is True when no rule found an
        error. The rules (C1-C15, F1-F5) are listed in `RULES` and docs/check-rules.md.
        ``report.precision_map`` ([`PrecisionMap`][onnx_qat.check.precision.PrecisionMap]) tells the
        precision TensorRT runs each compute node in under a strongly typed build and the Q/DQ
        nodes left unfused; it is built on first access (the report keeps the model until then).

    Raises:
        ModelError: the model cannot be read.
    """
    rules = _rules_for(target)
    proto, label = _load(model)
    return _check(proto, str(path) if path is not None else label, rules, None)


def check_written(model, evidence, *, target: Optional[str] = None, path=None) -> CheckReport:
    """[`check`][onnx_qat.check.check] of the very ``onnx.ModelProto`` an edit just committed, unchanged since
    (how ``onnx-qat quantize`` checks its result): with the edit's ``evidence``
    (`onnx_qat.graph.delta.EditEvidence`, `QuantizeResult.evidence`) the rules read the main graph's nodes,
    and the new initializers' types, raw bytes and dims, from the values the edit made them from
    (`onnx_qat.graph.delta.ResultNodes`) instead of reading every node's fields from the protobuf again:
    the same index, so the same findings (under ``ONNX_QAT_FULL_CHECK=both``, the test suite's setting, both
    indexes are built and compared). ``evidence`` None, or one that does not describe ``model``
    (`EditEvidence.nodes_of`: another ModelProto, other node or initializer counts), and the model is read
    as `check` reads it. A model changed after the edit in other ways (an initializer's bytes, a node's
    inputs) must go to `check`. ``target`` and ``path`` as for `check`."""
    nodes = evidence.nodes_of(model) if evidence is not None else None
    if nodes is None:
        return check(model, target=target, path=path)
    return _check(model, "" if path is None else str(path), _rules_for(target), nodes)


def _check(proto, label: str, rules, nodes) -> CheckReport:
    """`check` of the ModelProto ``proto`` by the rule functions ``rules`` (``nodes``: see
    `check_written`)."""
    from ..io.models import cyclic_gc_paused

    opset = _default_opset(proto)
    findings = []
    with cyclic_gc_paused():  # the index of a large model is ~10^6 live objects, none of them garbage
        infer = _lazy_inference(proto)
        graphs = _all_graphs(proto, opset, infer, nodes)
        if nodes is not None and _compare_indexes():  # the test suite's setting: both ways, compared
            differs = same_index(graphs[0], _all_graphs(proto, opset, infer)[0])
            if differs is not None:
                raise RuntimeError(f"the index built from the edit's nodes differs from the model's: "
                                   f"{differs}")
        for rule in rules:
            findings.extend(rule(proto, graphs))
        num_q = sum(sum(g.column("is_q")) for g in graphs)
        num_dq = sum(len(g.qdq) for g in graphs) - num_q
        built = graphs[0]._memo.get("precision_map", {}).get("map") if graphs else None  # by rule C15
        del graphs  # freed by reference counting while the collector is paused
    for finding in findings:
        logger.debug("check %s", finding)
    precision = built or lazy_precision_map(proto, opset)
    notes = tuple(f for f in findings if f.severity == NOTE)
    return CheckReport(tuple(f for f in findings if f.severity != NOTE), num_q, num_dq, label, opset,
                       precision, notes=notes)


__all__ = ["check", "check_written", "CheckReport", "Finding", "PrecisionMap", "RULES", "ORT_CPU_RULES",
           "ERROR", "WARNING", "NOTE"]
