"""``cast_float_parts``: the float parts of a model (float or Q/DQ) in FP16 or BF16.

TensorRT 11 builds strongly typed networks only: every layer runs in the type the ONNX model gives
it, so float parts left FP32 run in FP32 (TensorRT Developer Guide, "Strongly Typed Networks").
This module gives every float initializer and every float tensor between ops the chosen type,
Q/DQ scales included (opset 19, where QuantizeLinear/DequantizeLinear take FP16/BF16 scales: a
QuantizeLinear's input and scale share one type, ``T1``, in opsets 19-22; opset 23 lets them
differ, but onnxruntime 1.31's CPU kernels fail on an FP32 scale with an FP16 input,
onnxruntime#32719). An activation's scale (`activation_scales`: a QuantizeLinear's, and its
DequantizeLinear's) is rounded up to the type (`low_scale`), so the range it quantizes never
shrinks below the calibrated one; a weight's DequantizeLinear scale is rounded to the nearest
value. With data, the activation scales rounded to the nearest value are measured too, and the
rounding whose output cosine stays closer to the FP32 float parts' is kept (a change of less than
one FP16 step in every activation scale moves an INT8 model's cosine by about the budget, in either
direction). Activation scales this project calibrates are FP16 values already
(`onnx_qat.formats.scale_grid`): both roundings leave them as they are, the FP16 form quantizes on
the FP32 form's grid, and the second measurement is skipped; the rounding matters for scales a user
gave, and for BF16. It keeps FP32 what must stay FP32, each with its reason
([`KeptNode`][onnx_qat.formats.float_parts.KeptNode]):

========== ===============================================================================
rule       a node stays FP32 when
========== ===============================================================================
excluded   the caller named it (``exclude_nodes``, regular expressions)
tensorrt   TensorRT does not run its op in the type: with BF16, ``DeformConv``, ``GridSample``,
           ``Mish``, ``NonMaxSuppression``, ``NonZero``, ``RoiAlign`` (onnx-tensorrt
           ``docs/operators.md``, TensorRT 10: FP32 and FP16 only)
schema     its ONNX schema (at the model's opset) takes no such type, it holds If/Loop/Scan
           bodies (it keeps its inputs and outputs; the bodies are converted inside), it is an op
           of another domain (types unknown), or its tensors' types are unknown
weight     a constant it reads holds values beyond the type's largest finite value
range      a tensor it reads or writes has a calibrated or measured range beyond the type's
           largest value / `RANGE_HEADROOM` (FP16: 32752), or all of whose values are
           subnormal in it (below FP16's 2^-14)
scale      its Q/DQ scale cannot be held in the type within its precision (it would round to
           zero, or move by more than the type's epsilon of the largest scale), or it reads a
           DequantizeLinear kept for that reason
measured   on ``data``, the model's output cosine lost more than ``max_cosine_drop`` and more than
           its rounding noise (confirmed beyond the budget on `CONFIRM_FACTOR` x ``num_samples``
           where ``data`` holds them) and this node added the largest relative error (or the first
           non-finite value) of those left; or, when
           no single node lowers the drop, it belongs to the group kept FP32 together that does
           (found by shrinking the group of all converted compute nodes, `MAX_GROUP_TRIALS`)
fusion     a DequantizeLinear feeding only kept nodes stays with them, so that TensorRT still fuses
           DQ into its consumer (a DQ -> Cast -> Conv chain would not fuse)
boundary   it is a QuantizeLinear reading a tensor that is FP32 anyway (a graph input that keeps its
           type; in an If/Loop/Scan body its inputs and the enclosing graphs' tensors it reads; or a
           kept node's output), or a data-movement op (`BOUNDARY_MOVES`) between the two:
           the QuantizeLinear's output is INT8/FP8 in either type, and in the low type a Cast before
           it would round every value once more just before quantizing it (flipping codes: the
           whole FP16 drop of a Keras MobileNetV2 on 8 images, docs/formats.md); its scale's FP32
           value is the one its DequantizeLinear stores in the low type
========== ===============================================================================

Every kept node carries its reason in its own ``metadata_props`` (key `KEEP_FP32_KEY`,
``onnx_qat.keep_fp32``; node metadata since onnx 1.16, IR 10), and the model says its float type
under `FLOAT_DTYPE_KEY`: ``onnx-qat check`` reads them to tell FP32 compute kept on purpose
from FP32 compute forgotten ([`kept_fp32_nodes`][onnx_qat.formats.float_parts.kept_fp32_nodes]).

Graph inputs and outputs keep their types by default (a Cast at the boundary); with
``keep_io_types=False`` they take the low type (outputs an FP32-kept node produces stay FP32).

If/Loop/Scan bodies, nested ones too, are converted by the same rules; each keeps the types of its
inputs and outputs (Casts inside it), so an If's branches and outputs, and a Loop's carried state in
and out, keep one type; a tensor of an enclosing graph bodies read is rounded once, where it is
made (their low slots read its low version; its FP32 copy under its own name stays only while an
FP32 slot reads it). A node holding bodies has no arithmetic of its own: it keeps the types of its
inputs and outputs and is not listed as kept. Nodes inside a body are named
``parent/attribute/node`` (as ``onnx-qat check`` names them) in the kept list and in ``exclude_nodes``.

onnxruntime 1.31 runs FP16 models on CPU: ops without an FP16 CPU kernel run in FP32 between Casts
its session inserts (its ``InsertCastTransformer``), which it drops between consecutive such ops, so
runs of them see no FP16 rounding in between. It has no BF16 Conv or MatMul on CPU. The measurement
therefore runs, for both types, the emulation
[`emulate_in_fp32`][onnx_qat.formats.float_parts.emulate_in_fp32]: the same graph in FP32 with every FP16/BF16
tensor TensorRT stores rounded to its type where it is produced (FP16/BF16 storage, FP32 arithmetic,
as TensorRT's reduced-precision kernels accumulate); the tensors inside a fused INT8/FP8 kernel
(DQ outputs, accumulator, fused epilogue up to the requantizing QuantizeLinear) are never stored and
stay unrounded (``onnx_qat.check.precision.fused_tensors``).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..config import FLOAT_DTYPES
from ..errors import ConfigError, ModelError
from ..graph.edit import fresh_name
from ..graph.index import subgraphs_of
from .numeric import FLOAT_DTYPE_KEY, KEEP_FP32_KEY, float_dtype_of, kept_fp32_reason
from .float_cast import BF16, FP16, CastStats, LowType, all_graphs, body_prefix, cast_graph, has_subgraph, \
    prefixed_graphs, read_in_subgraphs, schema_of, slot_admits, tensor_types

logger = logging.getLogger(__name__)

LOW_TYPES: Mapping[str, LowType] = MappingProxyType({"fp16": FP16, "bf16": BF16})
#: A tensor whose range exceeds the type's largest value divided by this stays FP32 (headroom for
#: inputs beyond the calibration data).
RANGE_HEADROOM = 2.0
#: Default of ``max_cosine_drop``: the output cosine may fall by at most this much (measured on
#: ``data``) against the FP32 float parts.
MAX_COSINE_DROP = 0.002
#: Samples of ``data`` the measurement runs on (spread evenly over its first 16 x this many:
#: `onnx_qat.io.data.Dataset.spread`).
MEASURE_SAMPLES = 4
#: Where ``num_samples`` show a drop beyond the budget and the rounding noise, the drop is measured
#: again on this many times as many samples (where ``data`` holds more, and the model is not
#: stateful) before any node is kept; where those show no drop beyond the budget, nothing is kept
#: (the measurement reports them), else the search runs on ``num_samples`` as before: on 4 samples
#: a drop of a few hundredths can be noise alone (the orientation classifier: +0.037 on 4
#: calibration samples, -0.0031 on 16; docs/formats.md, "Where the orientation classifier's drop
#: comes from").
CONFIRM_FACTOR = 4
#: A stateful model (its state fed back) is measured on its first this many x ``num_samples`` steps.
STATEFUL_WINDOW = 16
#: Rounds of the measured search (one node tried per round).
MAX_ROUNDS = 12
#: The measured search stops after this many rounds in a row whose node did not lower the drop.
MAX_MISSES = 3
#: Measured conversions of the group search that follows when no single node lowers the drop.
MAX_GROUP_TRIALS = 12
#: Ops TensorRT runs in FP32 and FP16 but not BF16 (onnx-tensorrt ``docs/operators.md``, TensorRT
#: 10: "Supported Types" FP32, FP16).
TENSORRT_NO_BF16 = frozenset({"DeformConv", "GridSample", "Mish", "NonMaxSuppression", "NonZero", "RoiAlign"})
#: Data-movement ops the ``boundary`` rule follows from an FP32 tensor to the QuantizeLinear reading it.
BOUNDARY_MOVES = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
#: Opset where QuantizeLinear/DequantizeLinear take FP16/BF16 scales (ONNX operator docs).
QDQ_LOW_OPSET = 19
#: Opset where Conv, ConvTranspose, pooling and most activations take BF16 (ONNX operator docs).
BF16_OPSET = 22
_QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class KeptNode:
    """A node left in FP32, and why (``rule``: see the module's table)."""

    node: str
    op_type: str
    rule: str
    reason: str

    def to_dict(self) -> dict:
        return {"node": self.node, "op_type": self.op_type, "rule": self.rule, "reason": self.reason}

    def __str__(self) -> str:
        return f"{self.node} ({self.op_type}): {self.reason}"


@dataclass(frozen=True)
class FloatPartsResult:
    """What [`cast_float_parts`][onnx_qat.formats.float_parts.cast_float_parts] produced.

    Attributes:
        model: the converted ``onnx.ModelProto``.
        float_dtype: ``fp32`` (nothing changed), ``fp16`` or ``bf16``.
        kept: the nodes left FP32 with their reasons.
        summary: counts (nodes, low nodes, low initializers, Casts added, ...).
        measurement: with ``data``: samples, and per output the cosine of the FP32 float parts and of
            the converted model against the reference, the rounds of the search, the activation
            scales' rounding (``scale_rounding``: ``chosen``, ``drop_up``, ``drop_nearest``); None
            without data.
        notes: anything else worth knowing (FP32 slots the ONNX schemas require, opset raised...).
    """

    model: onnx.ModelProto = field(repr=False)
    float_dtype: str
    kept: Tuple[KeptNode, ...] = ()
    summary: Mapping[str, int] = field(default_factory=dict)
    measurement: Optional[Mapping] = field(default=None, repr=False)
    notes: Tuple[str, ...] = ()

    def kept_compute(self, ops: Sequence[str] = ("Conv", "ConvTranspose", "MatMul", "Gemm")
                     ) -> Tuple[KeptNode, ...]:
        """The kept nodes of op types ``ops`` (FP32 compute TensorRT will run)."""
        return tuple(k for k in self.kept if k.op_type in ops)

    def to_dict(self) -> dict:
        return {"float_dtype": self.float_dtype, "summary": dict(self.summary),
                "kept_fp32": [k.to_dict() for k in self.kept], "notes": list(self.notes),
                **({} if self.measurement is None else {"measurement": _plain(self.measurement)})}

    def __str__(self) -> str:
        s = self.summary
        text = (f"float parts {self.float_dtype}: {s.get('low_nodes', 0)} of {s.get('nodes', 0)} nodes, "
                f"{s.get('low_initializers', 0)} initializers, {s.get('casts', 0)} Casts, "
                f"{len(self.kept)} nodes kept FP32")
        return text + "".join(f"\n  kept FP32: {k}" for k in self.kept[:20]) + \
            (f"\n  ... {len(self.kept) - 20} more" if len(self.kept) > 20 else "")


def _plain(value):
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def get_low_type(float_dtype) -> Optional[LowType]:
    """The `LowType` named ``float_dtype``; None for ``fp32``."""
    if float_dtype in (None, "fp32"):
        return None
    if isinstance(float_dtype, LowType):
        return float_dtype
    found = LOW_TYPES.get(float_dtype)
    if found is None:
        raise ConfigError(f"float_dtype must be one of {', '.join(FLOAT_DTYPES)}; got {float_dtype!r}")
    return found


def check_float_dtype(float_dtype) -> str:
    """``float_dtype`` validated (None is ``fp32``)."""
    get_low_type(float_dtype)
    return "fp32" if float_dtype is None else float_dtype


# --------------------------------------------------------------------------- public entry point
def cast_float_parts(model, float_dtype, *, scales=None, keep_io_types: bool = True, data=None,
                     reference=None, exclude_nodes: Iterable[str] = (),
                     max_cosine_drop: float = MAX_COSINE_DROP, num_samples: int = MEASURE_SAMPLES,
                     progress: bool = False) -> FloatPartsResult:
    """The model with its float parts in ``float_dtype`` (``fp16``, ``bf16``; ``fp32`` changes nothing).

    Args:
        model: a float or Q/DQ model: path, ``onnx.ModelProto`` (never modified) or
            ``onnx_graphsurgeon.Graph``.
        float_dtype: ``"fp16"``, ``"bf16"`` or ``"fp32"``.
        scales: a [`ScaleTable`][onnx_qat.scales.ScaleTable] (or its JSON path): its activation ranges
            keep FP32 the tensors whose range the type cannot hold. The scales of the model's
            QuantizeLinear nodes are read as ranges too.
        keep_io_types: graph inputs and outputs keep their types, with a Cast at the boundary
            (default); False: they take ``float_dtype`` too.
        data: inputs to measure on (anything [`onnx_qat.load_data`][onnx_qat.io.data.load_data] accepts;
            ``num_samples`` of them spread evenly over its first 16 x ``num_samples``,
            ``onnx_qat.io.data.Dataset.spread``; for a stateful model, its state fed back, its first
            `STATEFUL_WINDOW` x ``num_samples`` steps in order): the ranges of every float tensor,
            and the output cosine. While the
            converted model's cosine against ``reference`` is more than ``max_cosine_drop`` below the
            FP32 float parts' and more than the model's own rounding noise (with the activation scales
            rounded up or to the nearest value, whichever measures closer: ``measurement["scale_rounding"]``),
            it is measured again on `CONFIRM_FACTOR` x ``num_samples`` samples where ``data`` holds them
            (not for a stateful model; ``measurement["confirmation"]``); where the drop holds there,
            the node adding the most
            error is kept FP32 (up to `MAX_ROUNDS` nodes), or, when no single node lowers the drop, a
            group of nodes found by shrinking (`MAX_GROUP_TRIALS` measured conversions); a note says
            when the budget is not met. Without data only the static rules and the given ranges apply.
        reference: the model the cosines are measured against (e.g. the FP32 float model before
            quantization); None: ``model`` itself (then the converted model's cosine against it must
            stay >= 1 - ``max_cosine_drop``).
        exclude_nodes: regular expressions (``re.fullmatch``) of node names to keep FP32 (a node inside
            an If/Loop/Scan body matches by its own name or by ``parent/attribute/node``).
        max_cosine_drop: see ``data``.
        num_samples: samples of ``data`` measured on.
        progress: progress bars on stderr.

    Returns:
        A [`FloatPartsResult`][onnx_qat.formats.float_parts.FloatPartsResult]: the model and every node kept
        FP32 with its reason.

    Raises:
        ConfigError: a bad option. ModelError: the model cannot be read, already holds FP16/BF16
            float parts, or its opset cannot be raised to the one FP16/BF16 Q/DQ scales (19) or BF16
            convolutions (22) need.
    """
    from ..io.models import load_model

    low = get_low_type(float_dtype)
    patterns = _patterns(exclude_nodes)
    if isinstance(max_cosine_drop, bool) or not isinstance(max_cosine_drop, (int, float)) \
            or not 0.0 <= max_cosine_drop < 1.0:
        raise ConfigError(f"max_cosine_drop must be a number in [0, 1), got {max_cosine_drop!r}")
    proto = load_model(model)
    if low is None:
        return FloatPartsResult(proto, "fp32", summary=MappingProxyType({"nodes": len(proto.graph.node)}))
    return _cast_loaded(proto, low, scales=scales, keep_io_types=keep_io_types, data=data,
                        reference=None if reference is None or data is None else load_model(reference),
                        patterns=patterns, max_cosine_drop=max_cosine_drop, num_samples=num_samples,
                        progress=progress)


def _cast_loaded(proto: onnx.ModelProto, low: LowType, *, scales, keep_io_types: bool, data, reference,
                 patterns, max_cosine_drop: float, num_samples: int, progress: bool) -> FloatPartsResult:
    """`cast_float_parts` on a loaded and validated ``proto`` the caller owns (``reference``: a loaded
    model or None)."""
    _refuse_converted(proto)
    proto, notes = _raise_opset(proto, low)
    _name_body_nodes(proto)
    table = _load_table(scales)
    types = tensor_types(proto)
    kept = _static_keeps(proto, low, types, patterns)
    ranges = _given_ranges(proto, table)
    for prefix, body in _bodies(proto):
        ranges.update({t: r for t, r in _given_ranges(body, None).items() if t not in ranges})
    measure = None
    if data is not None:
        measure = _Measure(proto, types, data, reference, num_samples, progress)
        ranges.update({t: r for t, r in measure.ranges.items() if t not in ranges})
    for prefix, graph in [("", proto.graph), *_bodies(proto)]:
        _add(kept, _qualified(_scale_keeps(graph, low), prefix))
        _add(kept, _qualified(_range_keeps(graph, low, ranges, types), prefix))
    measurement = None
    converted, stats, kept = _convert(proto, low, kept, types, keep_io_types)
    if measure is not None:
        def widen() -> Optional[_Measure]:
            more_samples = CONFIRM_FACTOR * num_samples
            if measure.dataset.state or measure.available <= measure.dataset.num_samples:
                return None
            return _Measure(proto, types, data, reference, more_samples, progress, ranges=False)

        converted, stats, kept, measurement, more = _search(measure, proto, low, kept, types, keep_io_types,
                                                           max_cosine_drop, converted, stats, widen)
        notes += more
    notes += tuple(f"{node} {slot}: {why}" for node, slot, why in stats.fp32_slots[:20])
    missing = ort_cpu_missing_kernels(converted, low, stats.low_names)
    if missing:
        how = "it runs them in FP32 between Casts it inserts" if low is FP16 else "it cannot run the model"
        notes += (f"onnxruntime's CPU provider has no {low.name.upper()} kernel for "
                  f"{', '.join(missing)} ({how}): "
                  "numbers are validated on emulate_in_fp32(model), FP16/BF16 storage with FP32 arithmetic, "
                  "which the measurement runs",)
    _write_metadata(converted, low, kept)
    summary = {"nodes": sum(len(g.node) for g in all_graphs(proto)), "low_nodes": stats.low_nodes,
               "low_initializers": stats.low_initializers, "low_copies": stats.low_copies,
               "casts": stats.casts, "kept_fp32": len(kept)}
    result = FloatPartsResult(converted, low.name, tuple(kept.values()), MappingProxyType(summary),
                              measurement, tuple(notes))
    logger.info("%s", result)
    return result


def quantize_with_float_parts(quantize_fp32, model, output, report, *, data, float_dtype: str,
                              keep_io_types: bool, inputs: tuple, progress: bool):
    """[`onnx_qat.quantize`][onnx_qat.quantize.quantize] with ``float_dtype`` ``fp16``/``bf16``: the Q/DQ
    model ``quantize_fp32()`` returns (FP32 float parts, nothing written), converted by
    [`cast_float_parts`][onnx_qat.formats.float_parts.cast_float_parts] with its ScaleTable, measured on
    ``data`` against the float ``model``; then written to ``output`` and ``report`` (both checked before any
    work)."""
    import dataclasses
    import os

    from ..io.files import check_output_and_report
    from ..io.models import load_model, write_outputs

    paths = tuple(p for p in inputs if isinstance(p, (str, os.PathLike)))
    out_path, _ = check_output_and_report(output, report, inputs=paths)
    result = quantize_fp32()
    # the Q/DQ model is quantize's own, and the float model was validated when quantize loaded it: neither
    # is copied or checked again
    reference = None if data is None else load_model(model, check=False)
    parts = _cast_loaded(result.model, get_low_type(float_dtype), scales=result.scales,
                         keep_io_types=keep_io_types, data=data, reference=reference, patterns=(),
                         max_cosine_drop=MAX_COSINE_DROP, num_samples=MEASURE_SAMPLES, progress=progress)
    result = dataclasses.replace(result, model=parts.model, output=out_path, float_parts=parts)
    write_outputs(parts.model, out_path, report, result.to_report, inputs=paths)
    return result


# --------------------------------------------------------------------------- steps
def _patterns(exclude_nodes) -> Tuple["re.Pattern", ...]:
    if isinstance(exclude_nodes, str):
        exclude_nodes = (exclude_nodes,)
    out = []
    for p in exclude_nodes or ():
        if not isinstance(p, str) or not p:
            raise ConfigError(f"exclude_nodes must hold non-empty strings, got {p!r}")
        try:
            out.append(re.compile(p))
        except re.error as exc:
            raise ConfigError(f"exclude_nodes: {p!r} is not a regular expression: {exc}") from None
    return tuple(out)


def _refuse_converted(model: onnx.ModelProto) -> None:
    if float_dtype_of(model) not in (None, "fp32") or any(
            t.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16)
            for g in all_graphs(model) for t in g.initializer):
        raise ModelError("the model already holds FP16/BF16 float parts; give the FP32 model")


def _raise_opset(model: onnx.ModelProto, low: LowType):
    """``model`` at the opset Q/DQ with FP16/BF16 scales (`QDQ_LOW_OPSET`) and BF16 operators
    (`BF16_OPSET`) need, with a note; unchanged when already there.

    onnx's version converter writes the value_info its shape inference finds into every graph, bodies
    included: an upgraded model comes back with them (silero-vad's BF16 float parts, raised from 16 to
    22, hold over 600, its FP16 ones, left at 16, none). They stay right: `cast_graph` retypes
    (`_retype_infos`) the value_info of every tensor it converts and `_drop_unread` drops those of
    tensors no node produces any more (tests/onnx_qat/test_stateful_vad.py checks each against a fresh
    inference)."""
    from ..io.models import _upgrade, default_opset

    has_qdq = any(n.op_type in _QDQ for g in all_graphs(model) for n in g.node)
    need = max(QDQ_LOW_OPSET if has_qdq else 0, BF16_OPSET if low is BF16 else 0)
    current = default_opset(model)
    if current >= need:
        return model, ()
    upgraded = _upgrade(model, need, "model")  # raises ModelError when onnx's converter cannot
    why = "BF16 operators" if need == BF16_OPSET else "FP16/BF16 Q/DQ scales"
    return upgraded, (f"opset raised from {current} to {need} ({why})",)


def _load_table(scales):
    if scales is None:
        return None
    from ..scales import ScaleTable

    if isinstance(scales, ScaleTable):
        return scales
    if isinstance(scales, Mapping):
        return ScaleTable(scales)
    return ScaleTable.load(scales)


def _add(kept: Dict[str, KeptNode], more: Mapping[str, KeptNode]) -> None:
    for name, k in more.items():
        kept.setdefault(name, k)


def _graph(model) -> onnx.GraphProto:
    return model.graph if isinstance(model, onnx.ModelProto) else model


def _bodies(model, prefix: str = "") -> List[Tuple[str, onnx.GraphProto]]:
    """``(prefix, body)`` of every If/Loop/Scan body of ``model`` (a ModelProto or GraphProto), nested
    ones too, depth first; ``prefix``: how ``onnx-qat check`` and the kept list name the body's nodes
    (``parent/attribute/``, `body_prefix`)."""
    found = []
    for i, node in enumerate(_graph(model).node):
        for attr, _, body in subgraphs_of(node):
            inner = body_prefix(prefix, node, i, attr)
            found.append((inner, body))
            found.extend(_bodies(body, inner))
    return found


def _qualified(kept: Mapping[str, KeptNode], prefix: str) -> Dict[str, KeptNode]:
    """``kept`` (keyed by node names of one body) keyed and named by their names in the model."""
    if not prefix:
        return dict(kept)
    return {prefix + name: KeptNode(prefix + name, k.op_type, k.rule, k.reason) for name, k in kept.items()}


def _name_body_nodes(model: onnx.ModelProto) -> None:
    """Give a name to every unnamed node holding a body and every unnamed node inside a body
    (``<op>_<n>``, unique in the model), so that the kept list and ``check`` name them the same way
    before and after Casts are inserted. Edits ``model`` (the caller's own copy)."""
    from ..graph.subgraphs import model_names

    graphs = all_graphs(model)
    if not any((not n.name and (g is not model.graph or has_subgraph(n))) for g in graphs for n in g.node):
        return
    used = model_names(model)
    for g in graphs:
        for n in g.node:
            if not n.name and (g is not model.graph or has_subgraph(n)):
                n.name = fresh_name(f"{n.op_type}_{len(used)}", used)


def _static_keeps(model, low: LowType, types, patterns) -> Dict[str, KeptNode]:
    """Nodes kept by the ``excluded``, ``tensorrt``, ``schema`` and ``weight`` rules, in the main graph
    and in every If/Loop/Scan body (named ``parent/attribute/node`` there)."""
    from ..io.models import default_opset

    kept: Dict[str, KeptNode] = {}
    _static_keeps_in(model.graph, "", {}, default_opset(model), low, types, patterns, kept)
    return kept


def _static_keeps_in(graph, prefix, outer, opset, low, types, patterns, kept) -> None:
    """`_static_keeps` of ``graph`` (its nodes named ``prefix`` + name; ``outer``: the constants of the
    enclosing graphs), then of its bodies."""
    from ..io.models import tensor_array

    constants = dict(outer)
    constants.update((t.name, t) for t in graph.initializer)
    for node in graph.node:  # Constant nodes' values count as constants too
        if node.op_type == "Constant" and node.output:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                constants.setdefault(node.output[0], value)
    for index, node in enumerate(graph.node):
        for attr, _, body in subgraphs_of(node):
            _static_keeps_in(body, body_prefix(prefix, node, index, attr), constants, opset, low, types,
                             patterns, kept)
        floats = [t for t in list(node.input) + list(node.output) if t and types.get(t) == TensorProto.FLOAT]
        if not floats:
            continue
        name = prefix + node.name
        why = None
        if any(p.fullmatch(name) or p.fullmatch(node.name) for p in patterns):
            why = ("excluded", "excluded by the caller (exclude_nodes)")
        elif low is BF16 and node.op_type in TENSORRT_NO_BF16:
            why = ("tensorrt", f"TensorRT runs {node.op_type} in FP32/FP16 only (onnx-tensorrt operators.md)")
        elif has_subgraph(node):  # no float arithmetic of its own: never listed (`cast_graph` leaves its
            continue              # inputs and outputs their types; its bodies are converted inside)
        elif node.domain not in ("", "ai.onnx"):
            why = ("schema", f"op of domain {node.domain!r}: its type constraints are unknown here")
        elif schema_of(node, opset) is None:
            why = ("schema", f"no ONNX schema for {node.op_type} at opset {opset}")
        elif any(t and not types.get(t) for t in list(node.input) + list(node.output)):
            why = ("schema", "the type of one of its tensors is unknown to shape inference")
        elif not _any_low_slot(node, schema_of(node, opset), types, low):
            continue
        else:
            reads = list(node.output) if node.op_type == "Constant" else list(node.input)
            for t in reads:
                if t in constants and constants[t].data_type == TensorProto.FLOAT:
                    values = tensor_array(constants[t])
                    peak = float(np.max(np.abs(values))) if values.size else 0.0
                    if peak > low.max:
                        why = ("weight", f"constant {t!r} holds {peak:.4g}, beyond {low.name.upper()}'s "
                                         f"{low.max:.6g}")
                        break
        if why is not None:
            kept[name] = KeptNode(name, node.op_type, *why)


def _any_low_slot(node, schema, types, low) -> bool:
    if node.op_type in ("Cast", "Constant", "ConstantOfShape"):
        return True
    return any(types.get(t) == TensorProto.FLOAT and slot_admits(schema, out, i, low.type_str)
               for out, names in ((False, node.input), (True, node.output)) for i, t in enumerate(names) if t)


def _given_ranges(model, table) -> Dict[str, float]:
    """Tensor -> amax from the ScaleTable and from the model's QuantizeLinear scales."""
    from ..io.models import tensor_array

    ranges = dict(table.activations) if table is not None else {}
    constants = {t.name: t for t in _graph(model).initializer}
    for node in _graph(model).node:
        if node.op_type == "QuantizeLinear" and len(node.input) > 1 and node.input[1] in constants:
            qmax = _qmax(node, constants)
            scale = tensor_array(constants[node.input[1]])
            if scale.size == 1 and node.input[0] not in ranges:
                ranges[node.input[0]] = float(np.abs(scale).max()) * qmax
        elif node.op_type == "DequantizeLinear" and len(node.input) > 1 and node.input[1] in constants \
                and node.output and node.output[0] not in ranges:
            ranges[node.output[0]] = _dq_range(node, constants)
    return ranges


def _dq_range(node, constants) -> float:
    """The largest |value| a DequantizeLinear outputs: from its constant codes, zero points and scales
    (per channel along its axis) when it has them, else the largest code of its type times its
    largest scale."""
    from ..io.models import tensor_array

    scale = np.abs(tensor_array(constants[node.input[1]]).astype(np.float64))
    data = constants.get(node.input[0])
    if data is None or not scale.size:
        return _qmax(node, constants) * float(scale.max(initial=0.0))
    codes = tensor_array(data).astype(np.float64)
    zp = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    zero = np.zeros(1) if zp is None else tensor_array(zp).astype(np.float64)
    if scale.size == 1 and zero.size == 1:
        return float(np.abs(codes - zero.reshape(-1)[0]).max(initial=0.0) * scale.reshape(-1)[0])
    axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
    blocked = any(a.name == "block_size" and a.i for a in node.attribute)
    if blocked or codes.ndim == 0 or codes.shape[axis % codes.ndim] != scale.size \
            or zero.size not in (1, scale.size):
        return float((np.abs(codes).max(initial=0.0) + np.abs(zero).max()) * scale.max())
    shape = [1] * codes.ndim
    shape[axis % codes.ndim] = -1
    shifted = codes - (zero.reshape(-1)[0] if zero.size == 1 else zero.reshape(shape))
    return float((np.abs(shifted) * scale.reshape(shape)).max(initial=0.0))


def _qmax(node, constants) -> float:
    zp = constants.get(node.input[2]) if len(node.input) > 2 else None
    dtype = zp.data_type if zp is not None else TensorProto.UINT8
    return {TensorProto.FLOAT8E4M3FN: 448.0, TensorProto.INT4: 7.0, TensorProto.UINT8: 255.0,
            TensorProto.INT16: 32767.0, TensorProto.UINT16: 65535.0}.get(dtype, 127.0)


def _links(graph: onnx.GraphProto) -> Tuple[Dict[str, onnx.NodeProto], Dict[str, List[onnx.NodeProto]]]:
    """``(producer, readers)`` of ``graph``'s tensors: the node writing each, and the nodes reading each
    (in graph order, a node once per input it reads the tensor at)."""
    producer = {t: n for n in graph.node for t in n.output}
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for n in graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    return producer, readers


def _range_keeps(model, low: LowType, ranges: Mapping[str, float], types) -> Dict[str, KeptNode]:
    """Producers and float consumers of tensors whose range the type cannot hold."""
    limit, floor = low.max / RANGE_HEADROOM, low.normal_min
    producer, consumers = _links(_graph(model))
    kept: Dict[str, KeptNode] = {}
    for tensor, amax in ranges.items():
        if types.get(tensor) != TensorProto.FLOAT or not np.isfinite(amax):
            continue
        if getattr(producer.get(tensor), "op_type", None) == "Constant":
            continue  # a constant: the weight rule judges its values (tiny ones round by < 2^-25)
        if amax > limit:
            reason = (f"tensor {tensor!r} reaches {amax:.4g}, beyond {low.name.upper()}'s {low.max:.6g} / "
                      f"{RANGE_HEADROOM:g}")
        elif 0.0 < amax < floor:
            reason = f"tensor {tensor!r} stays below {amax:.3g}: subnormal in {low.name.upper()}"
        else:
            continue
        for node in [producer.get(tensor)] + consumers.get(tensor, []):
            if node is not None:
                kept.setdefault(node.name, KeptNode(node.name, node.op_type, "range", reason))
    return kept


def _scale_keeps(model, low: LowType) -> Dict[str, KeptNode]:
    """Q/DQ nodes whose scale the type cannot hold, and the nodes reading a kept DQ."""
    from ..io.models import tensor_array

    constants = {t.name: t for t in _graph(model).initializer}
    consumers = _links(_graph(model))[1]
    kept: Dict[str, KeptNode] = {}
    activations = activation_scales(model)
    for node in _graph(model).node:
        if node.op_type not in _QDQ or len(node.input) < 2 or node.input[1] not in constants:
            continue
        scale = tensor_array(constants[node.input[1]])
        if scale.dtype != np.float32 or not scale.size:
            continue
        if scale_fits(scale, low, up=node.input[1] in activations):
            continue
        reason = (f"scale {node.input[1]!r} (down to {float(np.min(scale)):.3g}) does not fit "
                  f"{low.name.upper()} within its precision")
        kept[node.name] = KeptNode(node.name, node.op_type, "scale", reason)
        dqs = [node] if node.op_type == "DequantizeLinear" else \
            [c for c in consumers.get(node.output[0], []) if c.op_type == "DequantizeLinear"]
        for dq in dqs:
            kept.setdefault(dq.name, KeptNode(dq.name, dq.op_type, "scale", reason))
            for c in consumers.get(dq.output[0], []):
                kept.setdefault(c.name, KeptNode(c.name, c.op_type, "scale",
                                                 f"reads DequantizeLinear {dq.name!r} kept FP32 ({reason})"))
    return kept


def scale_fits(scale: np.ndarray, low: LowType, up: bool = False) -> bool:
    """Whether Q/DQ scales ``scale`` can be stored in ``low``: rounded to it (toward +inf with
    ``up``), and a scale that would round to zero raised to its smallest positive value
    (`low_scale`), no scale moves by more than the type's epsilon of the largest one (a per-channel
    weight's dead channels, scales ~1e-30, then dequantize to values that small against the
    tensor's largest: below FP16's own precision)."""
    scale = np.asarray(scale, dtype=np.float32)
    stored = low_scale(scale, low, up)
    return bool(np.all(np.isfinite(stored)) and
                float(np.max(np.abs(stored - scale))) <= low.eps * float(np.max(np.abs(scale))))


def low_scale(scale: np.ndarray, low: LowType, up: bool = False) -> np.ndarray:
    """``scale`` rounded to ``low`` (as float32), none below the type's smallest positive value:
    to the nearest value, or with ``up`` (an activation's scale, `activation_scales`) to the
    nearest not below it, so that the range the QuantizeLinear covers (127 x scale for INT8)
    never shrinks below the calibrated one."""
    rounded = low.round_up(scale) if up else low.round(scale)
    return np.maximum(rounded, np.float32(low.tiny))


def activation_scales(model: onnx.ModelProto) -> set:
    """Names of the scales of ``model``'s QuantizeLinear nodes and of the DequantizeLinear nodes
    they feed: the scales whose rounding to a low type moves an activation's quantization grid
    (a weight's DequantizeLinear only rescales fixed codes)."""
    produced = {t: n for n in _graph(model).node for t in n.output}
    names = set()
    for node in _graph(model).node:
        if len(node.input) < 2:
            continue
        if node.op_type == "QuantizeLinear" or (
                node.op_type == "DequantizeLinear"
                and getattr(produced.get(node.input[0]), "op_type", None) == "QuantizeLinear"):
            names.add(node.input[1])
    return names


def _boundary_keeps(graph: onnx.GraphProto, kept: Mapping[str, KeptNode], types, keep_io_types: bool,
                    body: bool = False) -> Dict[str, KeptNode]:
    """QuantizeLinear nodes reading a tensor that is FP32 anyway, and the data-movement ops
    (`BOUNDARY_MOVES`, each read by the next alone) between it and them: a graph input that keeps
    its type (``keep_io_types``; a ``body``'s inputs always do, and so do the tensors of enclosing
    graphs it reads) or the output of a node in ``kept``. The QuantizeLinear's output is
    INT8/FP8 in either type; converted, it would read a Cast to the low type, one more rounding of
    every value just before it is quantized, and one more layer. Kept FP32, it quantizes the exact
    values (its scale's FP32 value is the one its DequantizeLinear stores, `_store_low_scales`)."""
    producer, readers = _links(graph)
    fp32_inputs = {i.name for i in graph.input} if keep_io_types else set()
    if body:
        own = set(producer) | {t.name for t in graph.initializer}
        fp32_inputs |= {t for t in readers if t and t not in own}
    fp32_inputs = {t for t in fp32_inputs if types.get(t) == TensorProto.FLOAT}
    found: Dict[str, KeptNode] = {}
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or not node.input or node.name in kept \
                or types.get(node.input[0]) != TensorProto.FLOAT:
            continue
        chain, t = [], node.input[0]
        while t not in fp32_inputs:
            p = producer.get(t)
            if p is None or (_stays_fp32(p, kept) and p.op_type != "Constant"):
                break
            if p.op_type not in BOUNDARY_MOVES or not p.input or len(readers.get(t, [])) != 1:
                t = None
                break
            chain.append(p)
            t = p.input[0]
        if t is None or (t not in fp32_inputs and producer.get(t) is None) \
                or not all(n.name for n in [node, *chain]):  # kept by name: an unnamed node cannot be
            continue
        source = f"{'input' if body else 'graph input'} {t!r}" if t in fp32_inputs else \
            f"{t!r}, the output of {producer[t].name!r} ({_fp32_why(producer[t])})"
        why = (f"quantizes {source}, FP32 anyway: its output is quantized in either type, and a Cast to "
               "the low type before it would only round every value once more")
        for n in [node, *chain]:
            found[n.name] = KeptNode(n.name, n.op_type, "boundary", why)
    return found


def _stays_fp32(node: onnx.NodeProto, kept: Mapping[str, KeptNode]) -> bool:
    """Whether ``node`` reads and writes FP32 whatever the conversion: kept, or holding If/Loop/Scan
    bodies (its inputs and outputs keep their types)."""
    return node.name in kept or has_subgraph(node)


def _fp32_why(node: onnx.NodeProto) -> str:
    if has_subgraph(node):
        return f"an {node.op_type}, whose inputs and outputs keep their types"
    return "kept FP32"


def _fusion_keeps(model, kept: Dict[str, KeptNode]) -> onnx.ModelProto:
    """Keep with their consumers the DequantizeLinear nodes feeding kept nodes: a DQ whose readers
    are all kept is kept; one also read by converted nodes is duplicated, the copy (kept) feeding
    the kept readers. Edits ``model`` in place and adds to ``kept``."""
    g = model.graph
    producer, readers = _links(g)
    used = {n.name for n in g.node} | {t for n in g.node for t in list(n.input) + list(n.output)}
    copies: List[Tuple[onnx.NodeProto, onnx.NodeProto]] = []
    for node in list(g.node):
        if not _stays_fp32(node, kept) or node.op_type in _QDQ:
            continue
        for i, t in enumerate(node.input):
            dq = producer.get(t)
            if dq is None or dq.op_type != "DequantizeLinear" or dq.name in kept:
                continue
            why = (f"feeds {node.name!r}, {_fp32_why(node)}: TensorRT fuses a DQ into its consumer only "
                   "without a Cast")
            if all(_stays_fp32(r, kept) for r in readers.get(t, [])):
                kept[dq.name] = KeptNode(dq.name, dq.op_type, "fusion", why)
                continue
            copy = onnx.NodeProto()
            copy.CopyFrom(dq)
            copy.name, copy.output[0] = fresh_name(f"{dq.name}/fp32", used), fresh_name(f"{t}/fp32", used)
            node.input[i] = copy.output[0]
            kept[copy.name] = KeptNode(copy.name, dq.op_type, "fusion", why)
            copies.append((dq, copy))
    if copies:
        order = []
        after = {}
        for dq, copy in copies:
            after.setdefault(id(dq), []).append(copy)
        for n in g.node:
            order.append(n)
            order.extend(after.get(id(n), []))
        del g.node[:]
        g.node.extend(order)
    return model


def _with_copies(types, graph: onnx.GraphProto) -> dict:
    """``types`` with FLOAT for the outputs of the DequantizeLinear copies `_fusion_keeps` added."""
    found = dict(types)
    for n in graph.node:
        for t in n.output:
            if t not in found and t.endswith("/fp32"):
                found[t] = TensorProto.FLOAT
    return found


def _qdq_scales(graph: onnx.GraphProto) -> set:
    """The scale tensors of ``graph``'s QuantizeLinear and DequantizeLinear nodes."""
    return {n.input[1] for n in graph.node if n.op_type in _QDQ and len(n.input) > 1}


def _convert(proto, low, kept, types, keep_io_types, up: bool = True):
    """A converted copy of ``proto`` with ``kept`` nodes FP32: (model, CastStats, kept); ``up``: the
    activation scales rounded up (else to the nearest value, `low_scale`)."""
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    kept = dict(kept)
    _add(kept, _boundary_keeps(model.graph, kept, types, keep_io_types))
    _fusion_keeps(model, kept)
    local_types = _with_copies(types, model.graph)
    scales = _qdq_scales(proto.graph)
    stats = cast_graph(model, low, kept, local_types, keep_io_types=keep_io_types,
                       pinned=read_in_subgraphs(model.graph))
    _store_low_scales(model, proto, low, scales, activation_scales(proto) if up else set())
    if any(has_subgraph(n) for n in model.graph.node):
        stats = _low_if_outputs(model, low, _drop_unread(model, _convert_bodies(model, low, kept, local_types,
                                                                                 stats, up)))
    return model, stats, kept


def _convert_bodies(model: onnx.ModelProto, low: LowType, kept: Dict[str, KeptNode], types, stats: CastStats,
                    up: bool) -> CastStats:
    """Convert every If/Loop/Scan body of ``model`` (its main graph converted already), nested ones too,
    with the rules of the main graph and ``kept`` (names ``parent/attribute/node``; DQ copies for
    kept nodes added to it). Each body's inputs and outputs keep their types (Casts inside it), so an
    If's two branches and its outputs, and a Loop's carried state in and out, keep one type; a tensor
    of an enclosing graph a body reads stays FP32 under its own name there (``pinned``), and a low
    reader inside the body reads its low version where the enclosing graph has one (a tensor produced
    low, an initializer's low copy: ``outer_low``), else a Cast inside the body. Returns ``stats`` with
    the bodies' counts added (their ``low_names`` qualified); `_drop_unread` then drops the copies
    nothing reads."""
    from ..graph.subgraphs import model_names

    reserved = model_names(model)
    keys = ("low_nodes", "low_outputs", "low_initializers", "low_copies", "casts")
    totals = {key: getattr(stats, key) for key in keys}
    slots, low_names, low_tensors = list(stats.fp32_slots), list(stats.low_names), set(stats.low_tensors)
    aliases = dict(stats.low_aliases)  # every graph's names are unique in the model: one map serves all
    cast_backs, alias_copies = list(stats.cast_backs), list(stats.alias_copies)

    def walk(graph: onnx.GraphProto, prefix: str) -> None:
        for index, node in enumerate(graph.node):
            for attr, _, body in subgraphs_of(node):
                inner = body_prefix(prefix, node, index, attr)
                view = onnx.ModelProto()
                view.ir_version = model.ir_version
                view.opset_import.extend(model.opset_import)
                view.graph.CopyFrom(body)
                original = onnx.ModelProto()
                original.CopyFrom(view)
                local = {n.name: kept[inner + n.name] for n in body.node if inner + n.name in kept}
                before = set(local)
                _add(local, _boundary_keeps(view.graph, local, types, True, body=True))
                _fusion_keeps(view, local)
                kept.update(_qualified({k: v for k, v in local.items() if k not in before}, inner))
                local_types = _with_copies(types, view.graph)
                scales = _qdq_scales(original.graph)
                done = cast_graph(view, low, local, local_types, keep_io_types=True,
                                  pinned=read_in_subgraphs(view.graph), reserved=reserved, outer_low=aliases)
                aliases.update(done.low_aliases)
                cast_backs.extend(done.cast_backs)
                alias_copies.extend(done.alias_copies)
                _store_low_scales(view, original, low, scales, activation_scales(original) if up else set())
                for key in totals:
                    totals[key] += getattr(done, key)
                slots.extend((inner + n, slot, why) for n, slot, why in done.fp32_slots)
                low_names.extend(inner + n for n in done.low_names)
                low_tensors.update(done.low_tensors)
                body.CopyFrom(view.graph)
                reserved.update(model_names(view))
                walk(body, inner)

    walk(model.graph, "")
    return CastStats(*(totals[key] for key in keys), tuple(slots), tuple(low_names), frozenset(low_tensors),
                     tuple(aliases.items()), tuple(cast_backs), tuple(alias_copies))


def _drop_unread(model: onnx.ModelProto, stats: CastStats) -> CastStats:
    """Drop what the conversion of ``model``'s bodies left unread (``model`` edited in place): the FP32
    copy (a Cast back) of a tensor produced low whose every reader in the bodies reads its low version,
    and of an initializer read in bodies either its low copy (no low slot reads it) or its FP32 original
    (every reader is low: the initializer is then stored low, once). Returns ``stats`` with its counts
    of Casts, low initializers and low copies updated."""
    graphs = all_graphs(model)
    read = {t for g in graphs for n in g.node for t in n.input} | {o.name for g in graphs for o in g.output}
    backs = set(stats.cast_backs) - read
    low_inits, copies = stats.low_initializers, stats.low_copies
    unread = set()
    for original, copy, counted in stats.alias_copies:
        if original not in read:
            unread.add(original)
            low_inits, copies = low_inits + 1, copies - counted
        elif copy not in read:
            unread.add(copy)
        elif not counted:
            copies += 1
    gone = backs | unread
    if gone:
        for g in graphs:
            _drop_named(g.initializer, gone)
            _drop_named(g.value_info, gone)
    dropped = _drop_casts(graphs, backs)  # last: it copies the bodies ``graphs`` holds
    return replace(stats, casts=stats.casts - dropped, low_initializers=low_inits, low_copies=copies)


def _drop_casts(graphs: Sequence[onnx.GraphProto], outputs, renames: Mapping[str, str] = MappingProxyType({})
                ) -> int:
    """Drop from ``graphs`` (`all_graphs` of one model) every Cast whose output is in ``outputs``, and have
    every node left read ``renames[t]`` where it read a tensor ``t`` that ``renames`` maps; returns how
    many Casts went. The graphs are edited innermost first: rebuilding a node list copies the bodies its
    nodes hold, so a body's edits are made before the graph holding it copies it. An edit made through
    ``graphs`` afterwards to a body of a graph whose Casts went is lost (that body is a copy now): edit
    the graphs' other fields before."""
    dropped = 0
    for g in reversed(graphs):
        if renames:
            for n in g.node:
                for i, t in enumerate(n.input):
                    if t in renames:
                        n.input[i] = renames[t]
        nodes = [n for n in g.node if not (n.op_type == "Cast" and n.output[0] in outputs)]
        if len(nodes) < len(g.node):
            dropped += len(g.node) - len(nodes)
            del g.node[:]
            g.node.extend(nodes)
    return dropped


def _drop_named(field, names) -> None:
    """Drop from ``field`` (a graph's initializers or value_info, edited in place) the entries named in
    ``names``."""
    kept = [t for t in field if t.name not in names]
    if len(kept) < len(field):
        del field[:]
        field.extend(kept)


def _low_if_outputs(model: onnx.ModelProto, low: LowType, stats: CastStats) -> CastStats:
    """Give If outputs the low type where nothing needs them in FP32 (``model`` edited in place). An If
    output becomes low when every branch makes it low and every reader takes it low:

    - a branch makes it low when it returns a Cast to FP32 of a low tensor, a Cast read by nothing
      else and returned once, or the output of an If of its own that becomes low by this same rule;
    - its readers, in its graph or in a body there, are Casts to the low type (whose output no graph
      returns), and where its graph returns it, that graph is a branch of an If whose output there
      becomes low by this same rule (nested Ifs, as silero-vad's around its LSTM, take it together).

    The outputs are found together, as the largest set that meets both conditions (every If output a
    candidate at first; one that fails is dropped, until none does). The branches then return their low
    tensors and the Casts on both sides go: one value, rounded once, as before (a low value cast to
    FP32 and back is the same value). Returns ``stats`` with the Casts counted again and the If outputs
    among ``low_tensors``."""
    graphs = all_graphs(model)  # nodes and graphs are told apart by tensor names (protobuf wrappers are not
    producer = {t: n for g in graphs for n in g.node for t in n.output}  # stable objects)
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for g in graphs:
        for n in g.node:
            for t in set(n.input):
                readers.setdefault(t, []).append(n)
    main_outputs = {o.name for o in model.graph.output}
    returned = {o.name for g in graphs for o in g.output}
    low_tensors = set(stats.low_tensors)

    def is_cast(node, to) -> bool:
        return node.op_type == "Cast" and next((a.i for a in node.attribute if a.name == "to"), None) == to

    # every If output, with what each branch returns for it and where its own graph returns it
    ifs: Dict[str, Tuple[onnx.GraphProto, int, List[Tuple[onnx.GraphProto, str]]]] = {}
    returns: Dict[str, List[Tuple[str, int]]] = {}  # branch output -> (If output, index) it ends
    for g in graphs:
        for node in g.node:
            if node.op_type != "If":
                continue
            branches = [a.g for a in node.attribute if a.name in ("then_branch", "else_branch")]
            for k, out in enumerate(node.output):
                for b in branches:  # every If's: one left FP32 ("": unused) keeps what its branches return
                    returns.setdefault(b.output[k].name, []).append((out, k))
                if not out or out in main_outputs or len(branches) != 2:
                    continue
                ifs[out] = (g, k, [(b, b.output[k].name) for b in branches])
    other_returns = {o.name for g in graphs for n in g.node if n.op_type != "If"  # Loop/Scan bodies' outputs
                     for _, _, body in subgraphs_of(n) for o in body.output}

    def own_cast(b: onnx.GraphProto, name: str) -> Optional[onnx.NodeProto]:
        """The Cast to FP32 of a low tensor that branch ``b`` returns as ``name``, read by nothing else."""
        made = producer.get(name)
        if made is None or name not in {t for n in b.node for t in n.output} \
                or not is_cast(made, TensorProto.FLOAT) or made.input[0] not in low_tensors \
                or readers.get(name) or sum(o.name == name for o in b.output) != 1 or name in other_returns:
            return None
        return made

    # what does not depend on the other outputs, once: each branch's Cast (None: an inner If's output,
    # low only if that output is; False: neither), whether the readers outside are Casts to the low type
    casts: Dict[str, list] = {}
    read_low: Dict[str, bool] = {}
    for out, (_, _, ends) in ifs.items():
        casts[out] = []
        for b, name in ends:
            cast = own_cast(b, name)
            inner = cast is None and name in ifs and name in {t for n in b.node for t in n.output}
            casts[out].append(cast if cast is not None else (None if inner else False))
        users = readers.get(out, [])
        read_low[out] = all(is_cast(r, low.onnx_type) and r.output[0] not in returned for r in users) and (
            bool(returns.get(out)) and out not in other_returns if out in returned else bool(users))
    candidates = {out for out in ifs if read_low[out] and False not in casts[out]}
    changed = True
    while changed:  # drop an output whose inner or enclosing If's output is no longer a candidate
        changed = False
        for out in sorted(candidates):
            inner_ok = all(cast is not None or name in candidates
                           for cast, (_, name) in zip(casts[out], ifs[out][2]))
            if not inner_ok or not all(parent in candidates for parent, _ in returns.get(out, [])
                                       if out in returned):
                candidates.discard(out)
                changed = True
    if not candidates:
        return stats
    dropped: set = set()  # the outputs of the Cast nodes to drop
    renames: Dict[str, str] = {}
    for out in candidates:
        g, k, ends = ifs[out]
        for cast, (b, _) in zip(casts[out], ends):
            if cast is not None:
                dropped.add(cast.output[0])
                b.output[k].name = cast.input[0]
            b.output[k].type.tensor_type.elem_type = low.onnx_type
        for r in readers.get(out, []):
            dropped.add(r.output[0])
            renames[r.output[0]] = out
        low_tensors.add(out)
        for info in g.value_info:
            if info.name == out:
                info.type.tensor_type.elem_type = low.onnx_type
    for g in graphs:
        _drop_named(g.value_info, renames)
    gone = _drop_casts(graphs, dropped, renames)
    return replace(stats, casts=stats.casts - gone, low_tensors=frozenset(low_tensors))


def _store_low_scales(model, proto, low: LowType, scales, activations) -> None:
    """Store every Q/DQ scale ``model`` holds in ``low`` (or a low copy of) from its FP32 value in
    ``proto`` through `low_scale`: none rounds to zero, and the ``activations`` scales round up."""
    from ..io.models import tensor_array

    originals = {t.name: t for t in proto.graph.initializer if t.name in scales}
    low_copies = {t.name.rsplit(f"/{low.name}", 1)[0] for t in model.graph.initializer
                  if t.data_type == low.onnx_type}
    for tensor in model.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT and tensor.name in originals and tensor.name in low_copies:
            # read in FP32 too (a QuantizeLinear kept by the boundary rule, a DequantizeLinear kept with
            # its consumer): the FP32 value is the one the low copy stores, so that a Q/DQ pair of two
            # types quantizes and dequantizes with one scale
            values = tensor_array(originals[tensor.name])
            up = tensor.name in activations
            if scale_fits(values, low, up):
                tensor.CopyFrom(onnx.numpy_helper.from_array(low_scale(values, low, up).astype(np.float32),
                                                             tensor.name))
            continue
        if tensor.data_type != low.onnx_type:
            continue
        base = tensor.name if tensor.name in originals else tensor.name.rsplit(f"/{low.name}", 1)[0]
        if base in originals:
            values = tensor_array(originals[base])
            stored = low_scale(values, low, up=base in activations)
            if np.any(stored != low.round(values)):
                tensor.CopyFrom(low.tensor(tensor.name, stored))


def _write_metadata(model: onnx.ModelProto, low: LowType, kept: Mapping[str, KeptNode]) -> None:
    """Mark every kept node (``NodeProto.metadata_props`` `KEEP_FP32_KEY` = its reason) and
    the model (``metadata_props`` `FLOAT_DTYPE_KEY` = the type)."""
    props = [p for p in model.metadata_props if p.key != FLOAT_DTYPE_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    model.metadata_props.add(key=FLOAT_DTYPE_KEY, value=low.name)
    for node, name in _named_nodes(model):
        k = kept.get(name)
        if k is not None:
            mine = [p for p in node.metadata_props if p.key != KEEP_FP32_KEY]
            del node.metadata_props[:]
            node.metadata_props.extend(mine)
            node.metadata_props.add(key=KEEP_FP32_KEY, value=k.reason)


def kept_fp32_nodes(model: onnx.ModelProto) -> Dict[str, str]:
    """``{node name: reason}`` of the nodes a float-parts conversion kept FP32 on purpose (their
    ``metadata_props`` entry `KEEP_FP32_KEY`), in the main graph and in If/Loop/Scan bodies (named
    ``parent/attribute/node`` there, as ``onnx-qat check`` names them)."""
    found = {name: kept_fp32_reason(n) for n, name in _named_nodes(model)}
    return {name: reason for name, reason in found.items() if reason is not None}


def _named_nodes(model: onnx.ModelProto) -> List[Tuple[onnx.NodeProto, str]]:
    """``(node, name)`` of every node of the main graph (its own name) and of every body
    (``parent/attribute/node``)."""
    found = [(n, n.name) for n in model.graph.node]
    for prefix, body in _bodies(model):
        found.extend((n, prefix + (n.name or f"<{n.op_type} #{i}>")) for i, n in enumerate(body.node))
    return found


# --------------------------------------------------------------------------- measurement
class _Measure:
    """Runs on a few samples: the FP32 float parts with every float tensor exposed (ranges, values),
    the reference's outputs, and any converted model's."""

    def __init__(self, proto, types, data, reference, num_samples: int, progress: bool, ranges: bool = True):
        """``ranges``: also run every float tensor for its range (False: the outputs only, as a
        confirmation on more samples needs)."""
        from ..io.data import load_data

        dataset = load_data(data, proto)
        # a stateful model's samples are one stream in order: its first steps (often silence, a warm-up)
        # say little, so it runs on the first STATEFUL_WINDOW x num_samples of them
        self.dataset = dataset.take(min(dataset.num_samples, STATEFUL_WINDOW * num_samples)) \
            if dataset.state else dataset.spread(num_samples)
        self.available = dataset.num_samples  # samples ``data`` holds
        self.progress = progress
        self.outputs = [o.name for o in proto.graph.output]
        # every float tensor but the DequantizeLinear outputs, whose ranges their codes and scales
        # give (`_dq_range`): exposing them copies every dequantized weight on each run
        self.floats = [t for n in proto.graph.node if n.op_type != "DequantizeLinear" for t in n.output
                       if t and types.get(t) == TensorProto.FLOAT and t not in self.outputs]
        self.proto = proto
        self._values32: Optional[Dict[str, np.ndarray]] = None
        self.ranges: Dict[str, float] = {}
        ref = reference
        if ref is not None:
            missing = [o for o in self.outputs if o not in self.outputs_of(ref)]
            if missing:
                raise ModelError(f"the reference model has no output {missing[0]!r}: give the float model "
                                 "of the same graph (or reference=None)")
            self.reference = self._run(ref, self.outputs, optimize=None)  # a float model, as deployed
        # every float tensor's range from the exact run (optimisations off: exposing them costs little)
        self.outputs32 = self._run(proto, self.outputs + (self.floats if ranges else []), ranges=self.ranges)
        if ref is None:
            self.reference = dict(self.outputs32)

    @property
    def values32(self) -> Dict[str, np.ndarray]:
        """Every float tensor of the FP32 float parts (run again only when the search needs them)."""
        if self._values32 is None:
            self._values32 = self._run(self.proto, self.outputs + self.floats, keep=True)
        return self._values32

    def _run(self, model, names, ranges=None, keep=False, optimize=False) -> Dict[str, np.ndarray]:
        """The graph outputs (and with ``keep`` every tensor of ``names``) over the samples, flattened;
        ``ranges`` collects every tensor's max |value| (finite ones only)."""
        from ..runtime.sessions import make_session, run_batches

        session = make_session(model, extra_outputs=[n for n in names if n not in self.outputs_of(model)],
                               optimize=optimize, spin=False)
        parts: Dict[str, list] = {}
        for batch in run_batches(session, self.dataset, batch_size=4, outputs=names, progress=self.progress,
                                 desc="float parts"):
            for name, value in batch.items():
                value = np.asarray(value, dtype=np.float32)
                if ranges is not None and value.size:
                    peak = max(float(value.max()), -float(value.min()))  # NaN or inf: not finite
                    if np.isfinite(peak):
                        ranges[name] = max(ranges.get(name, 0.0), peak)
                if keep or name in self.outputs:
                    parts.setdefault(name, []).append(value.reshape(-1))
        return {name: np.concatenate(v) for name, v in parts.items()}

    def noise(self, low: LowType) -> Dict[str, float]:
        """Per output, how much the FP32 float parts' cosine against the reference moves when every
        float input, and every QuantizeLinear's input, moves by a rounding error of ``low`` (times
        1 + u, u uniform in ± eps/2, seeded): the model's own rounding noise, which an INT8 model
        whose values sit near rounding boundaries amplifies (an input quantized at once, from an
        8-bit image, barely moves: the QuantizeLinear inputs inside the network do)."""
        from ..runtime.sessions import make_session
        from ..runtime.stateful import carry_state

        session = carry_state(make_session(jittered(self.proto, low.eps / 2), optimize=False, spin=False),
                              self.dataset)  # a stateful model: in order, its state fed back
        rng = np.random.default_rng(0)
        parts: Dict[str, list] = {}
        for feed in self.dataset.batches(4):
            moved = {k: (v * (1 + rng.uniform(-low.eps / 2, low.eps / 2, size=np.shape(v)))).astype(v.dtype)
                     if np.asarray(v).dtype.kind == "f" else v for k, v in feed.items()}
            for name, value in zip(self.outputs, session.run(self.outputs, moved)):
                parts.setdefault(name, []).append(np.asarray(value, np.float32).reshape(-1))
        moved_cos = self.cosines({k: np.concatenate(v) for k, v in parts.items()})
        base = self.cosines(self.outputs32)
        return {o: abs(base[o] - moved_cos[o]) for o in self.outputs}

    @staticmethod
    def outputs_of(model) -> set:
        return {o.name for o in model.graph.output}

    def run_low(self, model, low: LowType, names, keep=False, low_tensors=None) -> Dict[str, np.ndarray]:
        return self._run(_emulate(model, low, low_tensors), names, keep=keep)

    def cosines(self, values) -> Dict[str, float]:
        from ..runtime.compare import output_figures

        return {o: output_figures(self.reference[o], values[o])["cosine"] for o in self.outputs}


def _search(measure: _Measure, proto, low, kept, types, keep_io_types, max_drop, converted, stats,
            widen=None):
    """Keep FP32 the node adding the most error while an output's cosine falls more than ``max_drop``
    below the FP32 float parts' and more than the model's own rounding noise (`_Measure.noise`);
    a drop beyond ``max_drop`` is first measured again by ``widen()`` (when given and not None: the
    measurement on more samples, `CONFIRM_FACTOR`), within the noise or not: where it shows no drop
    beyond ``max_drop`` nothing is kept or noted and it is reported, else the search goes on with
    ``measure``;
    after `MAX_MISSES` rounds in a row that did not lower the worst drop by a quarter of
    ``max_drop`` the search stops, and the nodes kept since the last round that did are undone. A
    node is kept with the nodes computing its FP32 inputs: an ill-conditioned node (``x - mean``,
    a cancellation) needs them unrounded."""
    base = measure.cosines(measure.outputs32)
    names = measure.outputs + list(measure.floats)
    cos = measure.cosines(measure.run_low(converted, low, measure.outputs, low_tensors=stats.low_tensors))
    converted, stats, kept, cos, up, rounding = _choose_scale_rounding(measure, proto, low, kept, types,
                                                                        keep_io_types, base,
                                                                        (converted, stats, kept, cos))
    noise: Optional[Dict[str, float]] = None
    rounds = misses = 0
    exhausted = False  # no node of the main graph left to try (`_worst_node`)
    tried: set = set()
    confirmation: Optional[dict] = None
    best = (max(base[o] - cos[o] for o in measure.outputs), converted, stats, kept, cos)
    while True:
        short = {o: base[o] - cos[o] for o in measure.outputs if not cos[o] >= base[o] - max_drop}
        if not short or rounds >= MAX_ROUNDS or misses >= MAX_MISSES:
            break
        if confirmation is None and widen is not None:  # confirm on more samples before keeping anything
            wider = widen()
            confirmation = {}
            if wider is not None:
                wide_base = wider.cosines(wider.outputs32)
                wide_cos = wider.cosines(wider.run_low(converted, low, wider.outputs,
                                                       low_tensors=stats.low_tensors))
                confirmation = {"samples": wider.dataset.num_samples, "drop_first": dict(short),
                                "drop": {o: wide_base[o] - wide_cos[o] for o in wider.outputs}}
                if all(wide_cos[o] >= wide_base[o] - max_drop for o in wider.outputs):  # not confirmed
                    measure, base, cos, noise = wider, wide_base, wide_cos, None
                    best = (max(base[o] - cos[o] for o in measure.outputs), converted, stats, kept, cos)
                    continue
        noise = measure.noise(low) if noise is None else noise
        if all(short[o] <= noise[o] for o in short):
            break
        values = measure.run_low(converted, low, [n for n in names if _has_tensor(converted, n)], keep=True,
                                 low_tensors=stats.low_tensors)
        culprit = _worst_node(proto, measure, values, set(kept) | tried)
        if culprit is None:
            exhausted = True
            break
        rounds += 1
        node, err = culprit
        tried.add(node.name)
        worst = max(short, key=short.get)
        trial = dict(kept)
        trial[node.name] = KeptNode(node.name, node.op_type, "measured",
                                    f"output {worst!r} cosine fell by {short[worst]:.2g} in "
                                    f"{low.name.upper()} (> {max_drop:g}); this node added relative error "
                                    f"{err:.2g}")
        for feeder in _float_producers(proto, node, types):  # its inputs unrounded: an ill-conditioned
            trial.setdefault(feeder.name, KeptNode(  # node (x - mean, cancellation) needs them so
                feeder.name, feeder.op_type, "measured",
                f"feeds {node.name!r}, kept FP32 by measurement: its input must not be rounded"))
        converted, stats, kept = _convert(proto, low, trial, types, keep_io_types, up)
        cos = measure.cosines(measure.run_low(converted, low, measure.outputs, low_tensors=stats.low_tensors))
        if max(base[o] - cos[o] for o in measure.outputs) < best[0] - max_drop / 4:  # a real gain
            best, misses = (max(base[o] - cos[o] for o in measure.outputs), converted, stats, kept, cos), 0
        else:
            misses += 1
    if misses:  # the nodes kept since the last improvement did not help: undone
        converted, stats, kept, cos = best[1:]
    short = {o: base[o] - cos[o] for o in measure.outputs if not cos[o] >= base[o] - max_drop}
    group_trials, whole = 0, None
    if short and noise is not None and not all(short[o] <= noise[o] for o in short):
        found, group_trials, whole = _group_search(measure, proto, low, kept, types, keep_io_types, max_drop,
                                                   base, short, up)
        if found is not None:
            converted, stats, kept, cos = found
            short = {}
    notes: Tuple[str, ...] = ()
    if short:
        within = noise is not None and all(short[o] <= noise[o] for o in short)
        moved = ", ".join(f"{o} {base[o]:.5f} -> {cos[o]:.5f}" for o in short)
        sizes = ", ".join(f"{noise[o]:.2g}" for o in short) if within else ""
        why = (f", within the INT8 model's own rounding noise ({sizes}: its output cosine moves that much "
               f"when its inputs and every QuantizeLinear input move by a {low.name.upper()} rounding error)"
               if within
               else _search_ran(rounds, exhausted, group_trials, whole, base, low))
        notes = (f"the output cosine stays more than {max_drop:g} below the FP32 float parts' "
                 f"({moved}){why}",)
        logger.warning("%s", notes[0])
    measurement = {"samples": measure.dataset.num_samples, "rounds": rounds, "group_trials": group_trials,
                   "max_cosine_drop": max_drop, "scale_rounding": rounding,
                   "outputs": {o: {"cosine_fp32": base[o], "cosine": cos[o]} for o in measure.outputs},
                   **({} if noise is None else {"rounding_noise": dict(noise)}),
                   **({"confirmation": confirmation} if confirmation else {})}
    return converted, stats, kept, measurement, notes


def _search_ran(rounds: int, exhausted: bool, group_trials: int, whole, base, low: LowType) -> str:
    """What the search ran before giving up, for its note: the single-node rounds (and why there were
    none, when no node was left to try) and the group trials (with the cosines of the first, every
    converted compute node kept FP32, when no group met the budget: ``whole``, ``(nodes, cosines)``)."""
    text = f" after {rounds} single-node round{'s' if rounds != 1 else ''}"
    if exhausted and rounds == 0:
        text += " (no node of the main graph to try: the search's single nodes are the main graph's)"
    if group_trials:
        text += f" and {group_trials} group trial{'s' if group_trials != 1 else ''}"
    if whole is not None:
        size, cos = whole
        moved = ", ".join(f"{o} {base[o]:.5f} -> {cos[o]:.5f}" for o in cos)
        text += (f": with all {size} converted compute nodes kept FP32 together (If/Loop/Scan bodies "
                 f"included; Q/DQ nodes, Constants and Casts stay {low.name.upper()}) "
                 f"it still measures {moved}")
    return text


def _choose_scale_rounding(measure: _Measure, proto, low, kept, types, keep_io_types, base, rounded_up):
    """The activation scales rounded up (``rounded_up``: converted, stats, kept, cosines) or to the
    nearest value, whichever brings the worst output cosine closer to the FP32 float parts' on the
    measured samples (up when they tie, or when no scale differs). Both are within one step of the
    type; which one an INT8 model's rounding boundaries favour is measured, not assumed.
    Returns ``(converted, stats, kept, cosines, up, {"chosen", "drop_up", "drop_nearest"})``."""
    converted, stats, kept, cos = rounded_up
    drop_up = max(base[o] - cos[o] for o in measure.outputs)
    from ..io.models import tensor_array

    # every graph's: a model whose network sits in If/Loop/Scan bodies holds its scales there
    values = [tensor_array(t) for g in all_graphs(proto) for acts in (activation_scales(g),)
              for t in g.initializer if t.name in acts]
    if not any(not np.array_equal(low.round_up(v), low.round(v)) for v in values):
        return converted, stats, kept, cos, True, {"chosen": "up", "drop_up": drop_up,
                                                   "drop_nearest": drop_up}
    near = _convert(proto, low, kept, types, keep_io_types, up=False)
    near_cos = measure.cosines(measure.run_low(near[0], low, measure.outputs,
                                               low_tensors=near[1].low_tensors))
    drop_near = max(base[o] - near_cos[o] for o in measure.outputs)
    rounding = {"chosen": "nearest" if drop_near < drop_up else "up", "drop_up": drop_up,
                "drop_nearest": drop_near}
    if drop_near < drop_up:
        return (*near, near_cos, False, rounding)
    return converted, stats, kept, cos, True, rounding


def _group_search(measure: _Measure, proto, low, kept, types, keep_io_types, max_drop, base, short,
                  up: bool = True):
    """When no single node lowers the drop enough: keep FP32 a group of the converted compute nodes
    that brings every output within ``max_drop`` of the FP32 float parts, found by shrinking the
    group of all of them (delta debugging: convert back halves, then quarters... of the group, in
    graph order, while the budget still holds), at most `MAX_GROUP_TRIALS` measured conversions.
    Returns ``((converted, stats, kept, cosines) or None, trials, whole)``: ``whole`` is ``(nodes,
    cosines)`` of the first trial, every converted compute node kept FP32, when even that misses the
    budget (else None)."""
    skip = (*_QDQ, "Cast", "Constant")
    group = [(name, n) for n, name in _named_nodes(proto)
             if n.name and name not in kept and n.op_type not in skip and not has_subgraph(n)
             and any(types.get(t) == TensorProto.FLOAT for t in list(n.input) + list(n.output) if t)]
    trials = 0

    def attempt(nodes):
        nonlocal trials
        trials += 1
        trial = dict(kept)
        for name, n in nodes:
            trial[name] = KeptNode(name, n.op_type, "measured", "")
        converted, stats, trial = _convert(proto, low, trial, types, keep_io_types, up)
        cos = measure.cosines(measure.run_low(converted, low, measure.outputs, low_tensors=stats.low_tensors))
        within = all(cos[o] >= base[o] - max_drop for o in measure.outputs)
        return within, (converted, stats, trial, cos)

    if not group:
        return None, trials, None
    within, found = attempt(group)
    if not within:
        return None, trials, (len(group), found[3])
    parts = 2
    while trials < MAX_GROUP_TRIALS and len(group) > 1 and parts <= len(group):
        size = -(-len(group) // parts)
        shrunk = False
        for start in range(0, len(group), size):
            if trials >= MAX_GROUP_TRIALS:
                break
            rest = group[:start] + group[start + size:]
            if not rest:
                continue
            ok, result = attempt(rest)
            if ok:
                group, found, shrunk = rest, result, True
                break
        if not shrunk:
            parts *= 2
        else:
            parts = max(2, parts - 1)
    converted, stats, trial, cos = found
    worst = max(short, key=short.get)
    reason = (f"output {worst!r} cosine fell by {short[worst]:.2g} in {low.name.upper()} (> {max_drop:g}) "
              f"and no single node lowered it; with these {len(group)} nodes kept FP32 together it falls by "
              f"{max(base[worst] - cos[worst], 0.0):.2g} (group found by shrinking in {trials} measured "
              "conversions)")
    names = {name for name, _ in group}
    trial = {k: KeptNode(v.node, v.op_type, "measured", reason) if k in names else v
             for k, v in trial.items()}
    return (converted, stats, trial, cos), trials, None


def jittered(model: onnx.ModelProto, size: float, seed: int = 0, *, weight_scales: bool = False
             ) -> onnx.ModelProto:
    """A copy of ``model`` whose every QuantizeLinear input (in the main graph and in If/Loop/Scan bodies)
    is multiplied by ``1 + u``, ``u`` uniform in ± ``size``, one seed per node: rounding errors of a float
    type before every quantization, in random directions.

    Up to opset 21 ``u`` comes from onnxruntime's seeded ``RandomUniformLike``. ONNX gave its random
    operators new versions in opset 22 (BF16 types) and onnxruntime 1.31 has no kernel for those
    (``RandomUniformLike(22)``, in the main graph and in bodies alike), while BF16 float parts need
    opset 22 (`BF16_OPSET`); from opset 22 on, ``u`` is a seeded hash of the value computed in FP32
    by operators onnxruntime runs at every opset (`_hashed_factor`): a pseudo-random function of
    ``log |x|``, uniform in ± ``size`` whatever the value's scale, as the rounding error of a float
    type is a function of the value. A QuantizeLinear input of another float type is moved in FP32
    and cast back.

    With ``weight_scales`` every weight's DequantizeLinear scale (a DequantizeLinear reading a
    constant: an initializer or a ``Constant`` node's value) is multiplied too, each value by its own
    ``1 + u`` (NumPy's generator seeded with ``seed``): what storing those scales in FP16 does to them
    (`low_scale` rounds each to the nearest value, within half a step), in random directions. On
    the document orientation classifier those roundings alone move the output cosine as much as
    everything else FP16 changes (docs/formats.md, "Where the orientation classifier's drop comes
    from")."""
    from ..graph.subgraphs import model_names
    from ..io.models import default_opset

    out = onnx.ModelProto()
    out.CopyFrom(model)
    if weight_scales:
        _jitter_weight_scales(out, size, seed)
    used = model_names(out)
    hashed = default_opset(out) > RANDOM_OPSET
    types = tensor_types(out) if hashed else {}
    consts: Dict[Tuple[str, float], str] = {}  # main-graph initializers, read from the bodies too

    def const(base: str, value) -> str:
        key = (base, float(np.float32(value)))
        if key not in consts:
            consts[key] = fresh_name(f"jitter/{base}", used)
        return consts[key]

    one = const("one", 1.0)
    count = 0
    # innermost bodies first: rebuilding a graph's node list copies its nodes, bodies included
    for g in reversed(all_graphs(out)):
        nodes = []
        for node in g.node:
            if node.op_type == "QuantizeLinear" and node.input and node.input[0]:
                t = node.input[0]
                node_seed = seed * 100003 + count
                moved = fresh_name(f"{t}/jittered", used)
                if not hashed:
                    noise, factor = (fresh_name(f"{t}/{s}", used) for s in ("jitter", "jitter_factor"))
                    nodes += [helper.make_node("RandomUniformLike", [t], [noise], low=-float(size),
                                               high=float(size), seed=float(node_seed)),
                              helper.make_node("Add", [noise, one], [factor]),
                              helper.make_node("Mul", [t, factor], [moved])]
                else:
                    nodes += _hashed_jitter(t, moved, types.get(t, TensorProto.FLOAT), size, node_seed, one,
                                            const, used)
                node.input[0] = moved
                count += 1
            nodes.append(node)
        if len(nodes) > len(g.node):
            del g.node[:]
            g.node.extend(nodes)
    if count:
        out.graph.initializer.extend(onnx.numpy_helper.from_array(np.float32(value), name)
                                     for (_, value), name in consts.items())
    return out


#: The last opset whose random operators (``RandomUniformLike``...) onnxruntime 1.31 runs: `jittered`
#: hashes from the next one on.
RANDOM_OPSET = 21
#: `_hashed_factor`'s constants: two rounds of ``fract(sin(v * a + phase) * b)``, the common shader hash
_HASH_A, _HASH_A2, _HASH_B = 12.9898, 78.233, 43758.5453
#: The golden ratio's fractional part: each node's phase, ``seed * 0.618...`` (its own seed per node)
_PHASE_STEP = 0.6180339887


def _hashed_jitter(t: str, moved: str, dtype: int, size: float, node_seed: int, one: str, const, used
                   ) -> List[onnx.NodeProto]:
    """Nodes computing ``moved = t * (1 + u)`` (`jittered` from opset 22), ``u`` in ± ``size`` a seeded
    hash of ``log |t|`` (`_hashed_factor`), in FP32: a ``t`` of another float type is cast to FP32 and
    the product back to ``dtype``."""
    nodes: List[onnx.NodeProto] = []
    x = t
    if dtype != TensorProto.FLOAT:
        x = fresh_name(f"{t}/jitter_fp32", used)
        nodes.append(helper.make_node("Cast", [t], [x], to=TensorProto.FLOAT))
    factor = fresh_name(f"{t}/jitter_factor", used)
    nodes += _hashed_factor(x, factor, size, node_seed, one, const, used)
    if dtype == TensorProto.FLOAT:
        return nodes + [helper.make_node("Mul", [x, factor], [moved])]
    product = fresh_name(f"{t}/jittered_fp32", used)
    return nodes + [helper.make_node("Mul", [x, factor], [product]),
                    helper.make_node("Cast", [product], [moved], to=dtype)]


def _hashed_factor(x: str, factor: str, size: float, node_seed: int, one: str, const, used
                   ) -> List[onnx.NodeProto]:
    """Nodes computing ``factor = 1 + u`` for the FP32 tensor ``x``: ``l = log max(|x|, tiny)``,
    ``f = fract(sin(fract(sin(l * a + p) * b) * a2 + p) * b)`` (``p`` the node's phase), ``u = (2f - 1)
    * size``; where ``x`` is not finite the factor is 1. ``f`` is close to uniform on [0, 1) (the
    second round decorrelates values within a relative 1e-5 of each other), equal values get equal
    factors and scaling a tensor by a power of 2 gives different ones."""
    steps = [("Abs", [x]), ("Max", [None, const("tiny", np.finfo(np.float32).tiny)]), ("Log", [None])]
    phase = const("phase", (node_seed * _PHASE_STEP) % 1.0 * 2 * np.pi)
    for a in (_HASH_A, _HASH_A2):
        steps += [("Mul", [None, const("a", a)]), ("Add", [None, phase]), ("Sin", [None]),
                  ("Mul", [None, const("b", _HASH_B)])]
        steps += [("Floor", [None]), ("Sub", ["-2", None])]  # fract: h - floor(h)
    steps += [("Mul", [None, const("width", 2 * size)]), ("Add", [None, const("low", 1 - size)])]
    nodes: List[onnx.NodeProto] = []
    for op, inputs in steps:
        ins = [nodes[-1].output[0] if i is None else nodes[-2].output[0] if i == "-2" else i for i in inputs]
        nodes.append(helper.make_node(op, ins, [fresh_name(f"{x}/jitter_hash", used)]))
    raw = nodes[-1].output[0]
    nan = fresh_name(f"{x}/jitter_nan", used)
    return nodes + [helper.make_node("IsNaN", [raw], [nan]),
                    helper.make_node("Where", [nan, one, raw], [factor])]


def _jitter_weight_scales(model: onnx.ModelProto, size: float, seed: int) -> int:
    """`jittered`'s ``weight_scales``: multiply, in place, the scale of every DequantizeLinear reading a
    constant by ``1 + u`` per value (``u`` uniform in ± ``size``, seeded); returns how many scales moved."""
    from ..io.models import tensor_array

    graphs = all_graphs(model)
    constants = {t.name: t for g in graphs for t in g.initializer}
    constants.update({n.output[0]: a.t for g in graphs for n in g.node if n.op_type == "Constant"
                      for a in n.attribute if a.name == "value"})
    names = []
    for g in graphs:
        for n in g.node:
            if n.op_type == "DequantizeLinear" and len(n.input) > 1 and n.input[0] in constants \
                    and n.input[1] in constants and n.input[1] not in names:
                names.append(n.input[1])
    rng = np.random.default_rng(seed)
    for name in names:
        tensor = constants[name]
        if tensor.data_type != TensorProto.FLOAT:
            continue
        values = np.asarray(tensor_array(tensor), np.float64)
        moved = values * (1 + rng.uniform(-size, size, values.shape))
        tensor.CopyFrom(onnx.numpy_helper.from_array(moved.astype(np.float32), tensor.name))
    return len(names)


def _float_producers(model, node, types) -> List[onnx.NodeProto]:
    """The nodes computing ``node``'s FP32 inputs (not Constant nodes, not DequantizeLinear: their
    values are exact; not If/Loop/Scan nodes: their outputs keep FP32)."""
    producer = {t: n for n in model.graph.node for t in n.output}
    found = []
    for t in node.input:
        p = producer.get(t)
        if p is not None and types.get(t) == TensorProto.FLOAT and p.op_type not in ("Constant", *_QDQ) \
                and not has_subgraph(p):
            found.append(p)
    return found


def _has_tensor(model, name) -> bool:
    return any(name in n.output for n in model.graph.node) or any(i.name == name for i in model.graph.input)


def _worst_node(proto, measure: _Measure, values, kept):
    """The converted compute node adding the most relative error (a node making a finite tensor
    non-finite first of all; never one holding If/Loop/Scan bodies), with that error; None when none
    is left."""
    ref = measure.values32
    err: Dict[str, float] = {}
    for t, v in values.items():
        r = ref.get(t)
        if r is None or r.shape != v.shape:
            continue
        if not np.all(np.isfinite(v)) and np.all(np.isfinite(r)):
            err[t] = float("inf")
            continue
        norm = float(np.linalg.norm(r))
        err[t] = float(np.linalg.norm(v.astype(np.float64) - r)) / norm if norm > 0 else 0.0
    producer = {t: n for n in proto.graph.node for t in n.output}
    best, best_err = None, 0.0
    for node in proto.graph.node:
        if node.name in kept or node.op_type in _QDQ or node.op_type == "Cast" or has_subgraph(node):
            continue
        out = max((err.get(t, 0.0) for t in node.output), default=0.0)
        inputs = []
        for t in node.input:
            p = producer.get(t)
            if p is not None and p.op_type == "DequantizeLinear":  # through the Q/DQ pair
                q = producer.get(p.input[0])
                t = q.input[0] if q is not None and q.op_type == "QuantizeLinear" else t
            inputs.append(err.get(t, 0.0))
        local = out - max(inputs, default=0.0) if np.isfinite(out) else (
            float("inf") if all(np.isfinite(inputs)) else 0.0)
        if local > best_err:
            best, best_err = node, local
    return None if best is None else (best, best_err)


def ort_cpu_missing_kernels(model: onnx.ModelProto, low: LowType, nodes: Iterable[str]) -> Tuple[str, ...]:
    """Op types of ``model``'s ``nodes`` (names; ``parent/attribute/node`` in bodies) that onnxruntime's
    CPU provider (the installed build) has no kernel for in ``low``, read from its kernel registry
    (empty when the registry cannot be read)."""
    try:
        from onnxruntime.capi import _pybind_state

        defs = _pybind_state.get_all_opkernel_def()
    except Exception:  # noqa: BLE001 - an onnxruntime without the registry: nothing to say
        return ()
    with_low = {k.op_name for k in defs
                if k.provider == "CPUExecutionProvider" and k.domain in ("", "ai.onnx")
                and any(low.type_str in types for types in k.type_constraints.values())}
    names = set(nodes)
    used = dict.fromkeys(n.op_type for n, name in _named_nodes(model)
                         if name in names and n.op_type != "Cast")
    return tuple(op for op in used if op not in with_low)


# --------------------------------------------------------------------------- emulation
def emulate_in_fp32(model: onnx.ModelProto, float_dtype=None, *, fusions: bool = True) -> onnx.ModelProto:
    """A copy of ``model`` (FP16 or BF16 float parts) onnxruntime's CPU provider runs as TensorRT
    stores the numbers: every FP16/BF16 tensor TensorRT stores computed in FP32 and rounded to its
    type where it is produced (a Cast to the type and back), initializers as their exact FP32
    values, FP16/BF16 graph inputs and outputs as FP32. ``float_dtype``: ``fp16`` or ``bf16`` (None:
    the model's `FLOAT_DTYPE_KEY`).

    With ``fusions`` (the default) the tensors TensorRT computes inside a fused INT8/FP8 kernel and
    never stores are not rounded
    (``onnx_qat.check.precision.fused_tensors``: the DequantizeLinear outputs a
    quantized Conv/Gemm/MatMul reads, its accumulator and the fused BatchNormalization, activation
    and residual Add results up to the QuantizeLinear that requantizes them, in the main graph and in
    every If/Loop/Scan body); ``fusions=False``
    rounds every FP16/BF16 tensor, stricter than TensorRT.

    This is what the measurement of [`cast_float_parts`][onnx_qat.formats.float_parts.cast_float_parts] runs,
    for both types: onnxruntime has no BF16 Conv or MatMul on CPU, and its FP16 session computes
    consecutive ops without an FP16 CPU kernel in FP32 with no rounding between them (its
    ``InsertCastTransformer`` drops the Cast pairs between them) but rounds the tensors inside the
    fused kernels, so it neither matches TensorRT nor bounds it.
    """
    if float_dtype is None:
        float_dtype = {p.key: p.value for p in model.metadata_props}.get(FLOAT_DTYPE_KEY)
        if float_dtype is None:
            raise ConfigError("emulate_in_fp32: give float_dtype ('fp16' or 'bf16'); the model does not say")
    low = get_low_type(float_dtype)
    if low is None:
        raise ConfigError("emulate_in_fp32: float_dtype must be 'fp16' or 'bf16'")
    return _emulate(model, low, fusions=fusions)


def _emulate(model: onnx.ModelProto, low: LowType, low_tensors=None, fusions: bool = True) -> onnx.ModelProto:
    """[`emulate_in_fp32`][onnx_qat.formats.float_parts.emulate_in_fp32]; ``low_tensors``: the node outputs of
    type ``low`` when known (else shape inference tells)."""
    from ..check.precision import fused_tensors
    from ..graph.subgraphs import model_names

    if low_tensors is None:
        types = tensor_types(model)
        low_tensors = {t for t, ty in types.items() if ty == low.onnx_type}
    fused = fused_tensors(model) if fusions else frozenset()  # body tensors as parent/attribute/tensor

    out = onnx.ModelProto()
    out.CopyFrom(model)
    used = model_names(out)
    # innermost bodies first: rebuilding a graph's node list copies its nodes, bodies included
    for prefix, g in reversed(prefixed_graphs(out)):
        _emulate_graph(g, low, low_tensors, used, fused, prefix)
    return out


def _emulate_graph(g: onnx.GraphProto, low: LowType, low_tensors, used: set, fused=frozenset(),
                   prefix: str = "") -> None:
    """`_emulate` of one graph (its bodies are visited on their own); ``fused``: the tensors left unrounded,
    named as `fused_tensors` names them (``prefix``: the graph's, ``""`` for the main graph)."""
    from ..io.models import tensor_array

    for t in g.initializer:
        if t.data_type == low.onnx_type:
            t.CopyFrom(onnx.numpy_helper.from_array(np.asarray(tensor_array(t), np.float32), t.name))
    for info in list(g.value_info) + list(g.input) + list(g.output):
        if info.type.tensor_type.elem_type == low.onnx_type:
            info.type.tensor_type.elem_type = TensorProto.FLOAT
    nodes = []
    for node in g.node:
        for attr in node.attribute:
            if attr.name in ("to", "dtype") and attr.i == low.onnx_type:
                attr.i = TensorProto.FLOAT
            if attr.name == "value" and attr.t.data_type == low.onnx_type:
                attr.t.CopyFrom(onnx.numpy_helper.from_array(np.asarray(tensor_array(attr.t), np.float32)))
        nodes.append(node)
        for i, t in enumerate(node.output):
            if t and t in low_tensors and prefix + t not in fused:
                raw = fresh_name(f"{t}/exact", used)
                node.output[i] = raw
                mid = fresh_name(f"{t}/rounded", used)
                nodes.append(helper.make_node("Cast", [raw], [mid], to=low.onnx_type))
                nodes.append(helper.make_node("Cast", [mid], [t], to=TensorProto.FLOAT))
    del g.node[:]
    g.node.extend(nodes)


__all__ = ["cast_float_parts", "quantize_with_float_parts", "FloatPartsResult", "KeptNode", "FLOAT_DTYPES",
           "KEEP_FP32_KEY", "FLOAT_DTYPE_KEY", "kept_fp32_nodes", "emulate_in_fp32", "jittered",
           "get_low_type", "check_float_dtype", "TENSORRT_NO_BF16", "activation_scales", "low_scale",
           "scale_fits"]
