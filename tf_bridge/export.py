"""export_onnx: a trained Keras QAT model -> TensorRT-ready Q/DQ ONNX with the learned scales.

Steps (each checked; nothing is written unless all pass):

1. the float twin (:func:`tf_bridge.twin.float_twin`: same layers, trained weights,
   inference mode, no quantizers) is converted with tf2onnx at a pinned opset, each
   BatchNormalization kept as a Mul/Add beside its Conv (as Keras computes it);
2. every Keras quantizer is mapped to its ONNX tensor by structure (:mod:`tf_bridge.mapping`:
   layer scopes of the tf2onnx node names and the topology of both graphs; weight values with
   the BatchNorm fold factor confirm each weight);
3. :func:`onnx_qat.quantize` inserts exactly those Q/DQ pairs with those ranges (no
   recalibration). A target that needs ranges no Keras quantizer observes (``ort-cpu``:
   Conv outputs requantized for onnxruntime's integer kernels, typically before a residual
   Add) gets them from ``sample_data`` when the caller gives it (max |x|, as
   :func:`onnx_qat.calibrate` computes it); generated samples are never used as ranges;
4. parity: the Q/DQ model runs in onnxruntime against the Keras QAT model (run in
   TensorFlow); its difference must be at most 10% of the float ONNX model's
   difference from the Keras QAT model, with top-1 agreement >= 99%. A failure names
   the layers where the two models part. TensorFlow and onnxruntime add a convolution's
   products in different orders; their sums differ in the last bit, a value lying on a
   quantizer's rounding boundary then moves by a whole step in one engine and not the
   other, and deeper layers carry that on until the output moves about as much as
   quantization itself moves it. So when the 10% target is missed, the Keras QAT model's
   own graph (fake quantization included) is converted by tf2onnx and run in onnxruntime
   (:func:`keras_qat_in_onnxruntime`): the Q/DQ model must meet the 10% bound against
   that run, which shares its arithmetic, and the two runs of the Keras model may differ
   by at most ``SENSITIVITY_FACTOR`` times the **rounding sensitivity** of the Q/DQ model
   (the same model with every convolution output changed by two units in the last place:
   the size of the cascade a last-bit difference starts), with top-1 agreement against
   both (:func:`split_parity`). If that graph cannot be converted, the rounding bound
   alone decides (the fallback). A target other than ``tensorrt`` (``ort-cpu``) is
   checked as deployed against the tensorrt form of the same scales
   (:func:`deployed_parity`). Whatever the relative bound says, every output must also be
   **absolutely** close: the Q/DQ model may differ from the Keras QAT model (both its runs) by at
   most ``ABS_LIMIT`` (2%) of the Keras output's range over the samples, so a float twin whose own
   output explodes cannot make a large difference pass. A failure the rounding sensitivity
   explains is reported as a ``"rounding cascade"`` (a chaotic, typically untrained network),
   never as PASSED;
5. the Q/DQ model, its ScaleTable JSON (and optionally the float ONNX model) are
   written atomically, and :func:`onnx_qat.check` gives the TensorRT verdict.
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx

from onnx_qat.errors import ExportError, brief
from onnx_qat.fileio import check_output_path
from onnx_qat.scales import ScaleTable

from .mapping import KerasOnnxMapping, MappingEntry, map_quantizers
from .onnx_values import run_with_tensors, value_error

logger = logging.getLogger(__name__)

#: Parity criterion: |Q/DQ - Keras QAT| <= RATIO_LIMIT * |float ONNX - Keras QAT| (max abs, per output).
RATIO_LIMIT = 0.10
#: Parity criterion, absolute: |Q/DQ - Keras QAT| (both the reference run and the run in TensorFlow)
#: <= ABS_LIMIT * the range (max - min) of the Keras QAT model's output over the samples.
ABS_LIMIT = 0.02
#: Parity criterion: top-1 agreement of the Q/DQ model with the Keras QAT model.
TOP1_LIMIT = 0.99
#: ``OutputParity.cause`` of a failure the rounding sensitivity explains (a chaotic network).
ROUNDING_CASCADE = "rounding cascade"
#: |Keras QAT in onnxruntime - in TensorFlow| (the fallback: |Q/DQ - Keras QAT|)
#: <= SENSITIVITY_FACTOR * the rounding sensitivity of the Q/DQ model.
SENSITIVITY_FACTOR = 3.0
#: Other targets (``ort-cpu``), run as deployed:
#: |target - tensorrt form| <= DEPLOYED_FACTOR * |tensorrt form - float ONNX|.
DEPLOYED_FACTOR = 2.0
GENERATED_SAMPLES = 8
_FAKE_QUANT_OPS = ("QuantizeLinear", "DequantizeLinear", "QuantizeAndDequantizeV4", "FakeQuantWithMinMaxVars")


@dataclass(frozen=True)
class OutputParity:
    """Parity of one model output: max abs differences from the Keras QAT model and top-1 agreement.

    ``reference`` says which run of the Keras QAT model ``max_abs_qdq``, ``max_abs_float`` and
    ``ratio`` were measured against: ``"tensorflow"`` (the model called in TensorFlow) or
    ``"onnxruntime"`` (the Keras QAT model's own graph, fake quantization included, converted by
    tf2onnx and run in onnxruntime, whose convolutions round their sums as the Q/DQ model's do).
    ``max_abs_tf`` is the Q/DQ model's difference from the model run in TensorFlow, and
    ``max_abs_engine`` (``"onnxruntime"`` reference only) the difference between the two runs of
    the Keras QAT model. ``bound`` is ``"float"`` (the 10% bound held), ``"rounding"`` (only the
    rounding-sensitivity fallback held) or ``""``: the bound relative to quantization error.
    ``output_range`` is the range (max - min) of the Keras QAT output over the samples; every
    output must also stay within ``ABS_LIMIT`` of it (:attr:`abs_error`), so that a float twin
    whose own output explodes cannot make any difference look small. ``cause`` explains a
    failure: ``"rounding cascade"`` when the difference is within ``SENSITIVITY_FACTOR`` times
    the rounding sensitivity (the network itself turns last-bit differences into large ones:
    typical of an untrained, chaotic network), otherwise ``""``.
    """

    name: str
    max_abs_qdq: float
    max_abs_float: float
    ratio: float
    top1: Optional[float]
    passed: bool
    sensitivity: float = float("nan")
    bound: str = ""
    reference: str = "tensorflow"
    max_abs_tf: float = float("nan")
    max_abs_engine: float = float("nan")
    output_range: float = float("nan")
    cause: str = ""

    @property
    def abs_error(self) -> float:
        """The largest of the Q/DQ model's differences (reference run, run in TensorFlow) as a
        fraction of the output range (nan when the range is unknown)."""
        worst = max(d for d in (self.max_abs_qdq, self.max_abs_tf) if not np.isnan(d))
        return _ratio(worst, self.output_range) if np.isfinite(self.output_range) else float("nan")

    def __str__(self) -> str:
        top1 = "" if self.top1 is None else f" | top-1 {100 * self.top1:.1f}%"
        where = " (its graph in onnxruntime)" if self.reference == "onnxruntime" else ""
        verdict = "PASSED" if self.passed else (f"FAILED ({self.cause})" if self.cause else "FAILED")
        head = (f"{verdict} | output '{self.name}' | Q/DQ vs Keras QAT{where} "
                f"max abs {self.max_abs_qdq:.3g} = {100 * self.ratio:.3g}% of float vs Keras QAT "
                f"{self.max_abs_float:.3g} "
                f"(limit {100 * RATIO_LIMIT:.0f}%)")
        if self.reference == "onnxruntime":
            op = "<=" if self.passed or np.isnan(self.sensitivity) or (
                self.max_abs_engine <= SENSITIVITY_FACTOR * self.sensitivity) else ">"
            head += (f"; vs Keras QAT in TensorFlow {self.max_abs_tf:.3g} (the two runs of the Keras model "
                     f"differ by {self.max_abs_engine:.3g} {op} {SENSITIVITY_FACTOR:g} x rounding "
                     f"sensitivity {self.sensitivity:.3g})")
        elif self.bound != "float" and np.isfinite(self.sensitivity):
            op = "<=" if self.bound == "rounding" else ">"
            head += (f"; deep model: {self.max_abs_qdq:.3g} {op} {SENSITIVITY_FACTOR:g} x "
                     "rounding sensitivity "
                     f"{self.sensitivity:.3g}")
        if np.isfinite(self.output_range):
            op = "<=" if self.abs_error <= ABS_LIMIT else ">"
            head += (f"; {100 * self.abs_error:.3g}% of the output range {self.output_range:.3g} "
                     f"{op} {100 * ABS_LIMIT:g}%")
        if self.cause == ROUNDING_CASCADE:
            head += ("; the network turns last-bit differences into differences this large (untrained or "
                     "chaotic: train it, or settle its BatchNorm statistics, before export)")
        return head + top1


@dataclass(frozen=True)
class LayerDiff:
    """How far one quantized tensor of the Q/DQ model is from the Keras QAT model's."""

    quantizer: str
    onnx_tensor: str
    rel_error: float

    def __str__(self) -> str:
        return f"{self.quantizer} (ONNX '{self.onnx_tensor}'): relative max diff {self.rel_error:.3g}"


@dataclass(frozen=True)
class DeployedParity:
    """A target other than ``tensorrt`` (``ort-cpu``), run as deployed, for one output.

    onnxruntime runs such a model with its integer kernels (graph optimisations on), whose
    arithmetic differs from Q/DQ's by design (requantized convolution outputs, integer sums,
    rounded biases). The reference is the TensorRT form of the same mapping and scales, which
    passed the export's own parity, run with optimisations off (Q/DQ by definition):
    ``max_abs_deployed`` (target vs that form) must stay within ``DEPLOYED_FACTOR`` times
    ``max_abs_quant`` (that form vs the float model, the size of quantization itself), and the
    target's top-1 agreement with the Keras QAT model (run in TensorFlow) must be >= ``TOP1_LIMIT``.
    """

    name: str
    target: str
    max_abs_deployed: float
    max_abs_quant: float
    ratio: float
    top1: Optional[float]
    passed: bool

    def __str__(self) -> str:
        top1 = "" if self.top1 is None else f" | top-1 vs Keras QAT {100 * self.top1:.1f}%"
        return (f"{'PASSED' if self.passed else 'FAILED'} | output '{self.name}' | {self.target} as deployed "
                f"vs the tensorrt form max abs {self.max_abs_deployed:.3g} = {self.ratio:.3g} x the tensorrt "
                f"form's quantization error {self.max_abs_quant:.3g} (limit {DEPLOYED_FACTOR:g} x)" + top1)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"name": self.name, "target": self.target, "max_abs_deployed": self.max_abs_deployed,
                "max_abs_quant": self.max_abs_quant, "ratio": self.ratio, "top1": self.top1,
                "passed": self.passed}


@dataclass(frozen=True)
class Parity:
    """The parity verdict: one :class:`OutputParity` per output, the worst layers on failure, and
    for a target other than ``tensorrt`` one :class:`DeployedParity` per output (``deployed``)."""

    outputs: Tuple[OutputParity, ...]
    samples: int
    generated_inputs: bool
    worst_layers: Tuple[LayerDiff, ...] = ()
    deployed: Tuple[DeployedParity, ...] = ()

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs) and all(d.passed for d in self.deployed)

    def __bool__(self) -> bool:
        return self.passed

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"passed": self.passed, "samples": self.samples, "generated_inputs": self.generated_inputs,
                "ratio_limit": RATIO_LIMIT, "abs_limit": ABS_LIMIT, "top1_limit": TOP1_LIMIT,
                "outputs": [{"name": o.name, "max_abs_qdq": o.max_abs_qdq, "max_abs_float": o.max_abs_float,
                             "ratio": o.ratio, "top1": o.top1, "reference": o.reference,
                             "max_abs_tf": o.max_abs_tf, "max_abs_engine": o.max_abs_engine,
                             "sensitivity": o.sensitivity, "bound": o.bound,
                             "output_range": o.output_range, "abs_error": o.abs_error, "cause": o.cause,
                             "passed": o.passed}
                            for o in self.outputs],
                "deployed": [d.to_dict() for d in self.deployed],
                "worst_layers": [{"quantizer": w.quantizer, "onnx_tensor": w.onnx_tensor,
                                  "rel_error": w.rel_error} for w in self.worst_layers]}


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export_onnx` wrote and proved.

    Attributes:
        path: the Q/DQ ONNX model.
        scales_path: its ScaleTable JSON (None with ``save_scales=False``).
        float_path: the float ONNX model (None unless ``save_float=True``).
        opset, target: as requested.
        mapping: one :class:`~tf_bridge.mapping.MappingEntry` per Keras quantizer.
        parity: the :class:`Parity` verdict against the Keras QAT model.
        check: the :class:`onnx_qat.check.CheckReport` of the Q/DQ model under the rules of
            its ``target`` (``onnx_qat.check(model, target=...)``).
        summary: counts from :func:`onnx_qat.quantize`.
        cli_reproducible: True when ``onnx-qat quantize <float> --scales <json>`` (the default
            placement) gives this very model; False when the Keras placement differs from the
            default one (the Q/DQ model then comes from the Keras placement).
        baked: weights stored fake-quantized in float (their inputs are not quantized).
        requantization: for a target other than ``tensorrt``, the records of the points it adds
            (:attr:`onnx_qat.quantize.QuantizeResult.requantization`: tensor, Conv, amax, its
            source, ``status``); a ``not requantized`` Conv keeps a float output.
    """

    path: Path
    scales_path: Optional[Path]
    float_path: Optional[Path]
    opset: int
    target: str
    mapping: Tuple[MappingEntry, ...]
    parity: Parity
    check: object = field(repr=False)
    summary: Mapping[str, int] = field(default_factory=dict)
    cli_reproducible: bool = False
    baked: Tuple[str, ...] = ()
    requantization: Tuple[dict, ...] = field(default=(), repr=False)

    @property
    def passed(self) -> bool:
        """Parity passed and the check of the target's rules found no error."""
        return self.parity.passed and (self.check is None or bool(self.check))

    def mapping_table(self) -> str:
        """The mapping as text: quantizer, what it quantizes, ONNX tensor(s), fold factor, note."""
        rows = [("quantizer", "keras", "onnx", "fold |factor|", "note")]
        for e in self.mapping:
            fold = "" if e.fold_factor is None else (
                "1" if e.fold_factor == (1.0, 1.0) else f"{e.fold_factor[0]:.3g}..{e.fold_factor[1]:.3g}")
            rows.append((e.quantizer, e.keras, ", ".join(e.onnx_tensors), fold, e.note))
        widths = [min(max(len(r[i]) for r in rows), 48) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)

    def __str__(self) -> str:
        causes = sorted({o.cause for o in self.parity.outputs if o.cause and not o.passed})
        verdict = "PASSED" if self.passed else "FAILED" + (f" ({', '.join(causes)})" if causes else "")
        lines = [f"export_onnx: {verdict} | {self.path}",
                 f"  {len(self.mapping)} quantizer(s) mapped; {self.summary.get('activations', 0)} "
                 f"activation Q/DQ pair(s), {self.summary.get('weights', 0)} weight(s); opset {self.opset}, "
                 f"target {self.target}"]
        lines += [f"  parity: {o}" for o in self.parity.outputs]
        lines += [f"  deployed: {d}" for d in self.parity.deployed]
        lines += [f"  worst layer: {w}" for w in self.parity.worst_layers]
        if self.requantization:
            lines.append(f"  requantization ({self.target}): {self._requantization_summary()}")
        label = "check" if self.target == "tensorrt" else f"check ({self.target} rules)"
        lines.append(f"  {label}: {self.check.summary()}" if self.check is not None else
                     f"  {label}: not run")
        if self.scales_path is not None:
            lines.append(f"  scales: {self.scales_path}" + (
                " (onnx-qat quantize <float model> --scales reproduces the model)"
                if self.cli_reproducible else
                " (the Keras placement differs from onnx-qat's default one)"))
        if self.float_path is not None:
            lines.append(f"  float model: {self.float_path}")
        if self.baked:
            lines.append(f"  baked weights (input not quantized): {', '.join(self.baked)}")
        return "\n".join(lines)

    def _requantization_summary(self) -> str:
        statuses = [r.get("status", "") for r in self.requantization]
        counts = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
        floats = [r["tensor"] for r in self.requantization if r.get("status") == "not requantized"]
        if not floats:
            return counts
        hint = "give sample_data" if self.parity.generated_inputs else "no range"
        return f"{counts} (float output, {hint}: {', '.join(floats)})"

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"path": str(self.path),
                "scales_path": None if self.scales_path is None else str(self.scales_path),
                "float_path": None if self.float_path is None else str(self.float_path), "opset": self.opset,
                "target": self.target, "passed": self.passed, "mapping": [e.to_dict() for e in self.mapping],
                "parity": self.parity.to_dict(),
                "check": None if self.check is None else self.check.to_dict(), "summary": dict(self.summary),
                "cli_reproducible": self.cli_reproducible, "baked": list(self.baked),
                "requantization": [dict(r) for r in self.requantization]}


# --------------------------------------------------------------------------- inputs
def check_exportable(model, where: str = "model") -> None:
    """Raise ExportError unless ``model`` (and every nested model) is Functional or Sequential."""
    import keras
    from keras.src.models.functional import Functional

    if not isinstance(model, keras.Model):
        raise ExportError(f"export_onnx: {where} must be a keras.Model, got {type(model).__name__}")
    if not isinstance(model, (keras.Sequential, Functional)):
        raise ExportError(f"export_onnx: {where} '{model.name}' is a subclassed model "
                          f"({type(model).__name__}); "
                          "rebuild it as a Functional or Sequential model, quantize that with "
                          "tf_bridge.quantize_model, train it and export it")
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            check_exportable(layer, "nested model")


def _input_arrays(q_model, sample_data) -> Tuple[List[np.ndarray], bool]:
    """Sample inputs as float32 arrays, one per model input (generated when None)."""
    specs = list(q_model.inputs)
    if sample_data is None:
        rng = np.random.default_rng(0)
        arrays = []
        for t in specs:
            shape = tuple(t.shape[1:])
            if any(d is None for d in shape):
                raise ExportError(f"export_onnx: input '{t.name}' has an unknown dimension {tuple(t.shape)}; "
                                  "give sample_data")
            arrays.append(rng.normal(0.0, 1.0, (GENERATED_SAMPLES, *shape)).astype(np.float32))
        return arrays, True
    arrays = list(sample_data) if isinstance(sample_data, (list, tuple)) else [sample_data]
    arrays = [np.asarray(a) for a in arrays]
    if len(arrays) != len(specs) or any(a.ndim != len(t.shape) for a, t in zip(arrays, specs)):
        raise ExportError(f"export_onnx: sample_data must be {len(specs)} array(s) shaped like the model "
                          f"input(s) {[tuple(t.shape) for t in specs]} with a batch axis")
    return [a.astype(np.float32) if a.dtype == np.float64 else a for a in arrays], False


def _paths(path, save_scales: bool, save_float: bool):
    out = check_output_path(path, what="output model")
    stem = out.name[:-5] if out.name.endswith(".onnx") else out.name
    scales = check_output_path(out.with_name(stem + ".scales.json"), inputs=(out,), what="scales") \
        if save_scales else None
    float_path = check_output_path(out.with_name(stem + ".float.onnx"), inputs=(out,), what="float model") \
        if save_float else None
    return out, scales, float_path


# --------------------------------------------------------------------------- tf2onnx
def convert_float_twin(twin, opset: int) -> onnx.ModelProto:
    """tf2onnx conversion of the float twin at ``opset`` (inference mode, dynamic batch).

    Raises:
        ExportError: ``opset`` below 13; tf2onnx fails, leaves TensorFlow ops unconverted or
            makes a graph the ONNX checker refuses (one line: tf2onnx's message shortened, the
            ops and their layers, what to try); or the graph holds fake-quantization ops.
    """
    import tensorflow as tf

    if int(opset) < 13:
        raise ExportError(f"export_onnx: opset {opset} is below 13, the first with per-channel "
                          f"QuantizeLinear; use opset=13..{_tf2onnx_max_opset()}")
    specs = [tf.TensorSpec((None, *t.shape[1:]), t.dtype, name=t.name.split(":")[0]) for t in twin.inputs]

    @tf.function(input_signature=specs)
    def forward(*xs):
        return twin(list(xs) if len(xs) > 1 else xs[0], training=False)

    with Tf2onnxLog() as log:
        try:
            concrete = forward.get_concrete_function(*specs)
            captured = _captured_constants(concrete)
            proto = _tf2onnx_without_conv_folding(concrete, [s.name for s in specs], int(opset))
        except Exception as exc:  # tf2onnx raises many types
            failed = f" (it could not convert {_describe_ops(log.failures, twin, log.ops)})" \
                if log.failures else ""
            raise ExportError(f"export_onnx: tf2onnx {_tf2onnx_version()} could not convert model "
                              f"'{twin.name}' at opset {opset}: "
                              f"{brief(exc).replace('make_sure failure: ', '')}{failed}; "
                              f"{_what_to_try(bool(failed))}") from None
        _inline_captured(proto, captured, {s.name for s in specs})
        found = sorted({n.op_type for n in proto.graph.node if n.op_type in _FAKE_QUANT_OPS})
        if found:
            raise ExportError(f"export_onnx: the float graph of '{twin.name}' holds {', '.join(found)}; "
                              "export the model returned by tf_bridge.quantize_model, "
                              "not a model with its own fake-quant")
        check_converted(proto, twin, int(opset), log.failures)
    return proto


class Tf2onnxLog(logging.Handler):
    """tf2onnx's warnings and errors during one conversion, held back (``with Tf2onnxLog() as log``).

    tf2onnx logs each op it cannot convert (with a traceback when an op handler fails) and
    goes on. The records are replayed unchanged when the block ends normally, and only logged
    at debug level when it raises (the conversion is refused in one line). ``failures`` maps
    each TensorFlow node tf2onnx could not convert to its reason ("" when it has no handler),
    ``ops`` the nodes it names with their op types.
    """

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: List[logging.LogRecord] = []
        self.failures: dict = {}
        self.ops: dict = {}
        self._logger = logging.getLogger("tf2onnx")
        self._propagate = True

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        message, args = (record.msg if isinstance(record.msg, str) else ""), record.args or ()
        if message.startswith("Failed to convert node") and args:
            reason = brief(record.exc_info[1], 160, first_line=True) if record.exc_info else ""
            self.failures[str(args[0])] = reason.replace("make_sure failure: ", "")
        elif message.startswith("Tensorflow op [") and len(args) == 2:
            self.failures.setdefault(str(args[0]), "")
            self.ops[str(args[0])] = str(args[1])

    def __enter__(self) -> "Tf2onnxLog":
        self._propagate = self._logger.propagate
        self._logger.addHandler(self)
        self._logger.propagate = False
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate
        for record in self.records:
            if exc_type is None:
                logging.getLogger(record.name).handle(record)
            else:
                logger.debug("tf2onnx: %s", record.getMessage())


def check_converted(proto: onnx.ModelProto, twin, opset: int, failures: Optional[Mapping[str, str]] = None
                    ) -> None:
    """Refuse a tf2onnx result that still holds TensorFlow ops or that ``onnx.checker`` refuses.

    tf2onnx keeps an op it cannot convert as a node of its TensorFlow type (``Lgamma``,
    ``FFT``...) and returns the graph. Every node, subgraphs included, must be a standard ONNX
    op (domain ``""``, ``ai.onnx`` or ``ai.onnx.ml``) with a schema at the model's opset.
    ``failures``: tf2onnx's reasons by node name (:class:`Tf2onnxLog`).

    Raises:
        ExportError: one line naming the ops, their Keras layers and tf2onnx's reasons.
    """
    versions = {("" if o.domain in ("", "ai.onnx") else o.domain): o.version for o in proto.opset_import}
    bad = {n.name: n.op_type for n in _all_nodes(proto.graph) if not _is_standard(n, versions)}
    if bad:
        reasons = {name: (failures or {}).get(name, "") for name in bad}
        raise ExportError(f"export_onnx: tf2onnx {_tf2onnx_version()} left TensorFlow op(s) of model "
                          f"'{twin.name}' unconverted at opset {opset}: {_describe_ops(reasons, twin, bad)}; "
                          f"{_what_to_try()}")
    if proto.ByteSize() < onnx.checker.MAXIMUM_PROTOBUF:
        try:
            onnx.checker.check_model(proto)
        except Exception as exc:  # onnx raises ValidationError and others
            raise ExportError(f"export_onnx: tf2onnx {_tf2onnx_version()} made an invalid ONNX model of "
                              f"'{twin.name}' at opset {opset}: {brief(exc, 160, first_line=True)}; "
                              f"{_what_to_try()}") from None


def _all_nodes(graph):
    """Every node of ``graph`` and of its subgraphs (If/Loop/Scan bodies), in order."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _all_nodes(sub)


def _is_standard(node, versions: Mapping[str, int]) -> bool:
    """A node of a standard ONNX domain with a schema at the model's opset for that domain."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    if domain not in ("", "ai.onnx.ml") or domain not in versions:
        return False
    try:
        onnx.defs.get_schema(node.op_type, versions[domain], domain)
    except onnx.defs.SchemaError:
        return False
    return True


def _describe_ops(reasons: Mapping[str, str], twin, op_types: Optional[Mapping[str, str]] = None) -> str:
    """``Lgamma in layer 'special'; FFT in layer 'spectrum' (reason)``: sorted, at most three."""
    import re

    layers = _layer_names(twin)
    parts = []
    for name in sorted(reasons):
        op = (op_types or {}).get(name) or name.rsplit("/", 1)[-1]
        scopes = [re.sub(r"_\d+$", "", c) if c not in layers else c for c in name.split("/")[:-1]]
        layer = next((c for c in reversed(scopes) if c in layers), None)
        text = op + (f" in layer '{layer}'" if layer else f" (node '{name}')")
        text += f" ({reasons[name]})" if reasons[name] else ""
        if text not in parts:
            parts.append(text)
    return "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more" if len(parts) > 3 else "")


def _layer_names(model) -> set:
    """The names of every layer of ``model`` and of its nested models."""
    names = set()
    for layer in getattr(model, "layers", ()):
        names.add(layer.name)
        names |= _layer_names(layer)
    return names


def _tf2onnx_version() -> str:
    import tf2onnx

    return tf2onnx.__version__


def _tf2onnx_max_opset() -> int:
    from tf2onnx import constants

    return max(constants.OPSET_TO_IR_VERSION)


def _what_to_try(layer: bool = True) -> str:
    replace = "replace that layer with built-in Keras layers, " if layer else ""
    return (f"nothing was written; try another opset (13..{_tf2onnx_max_opset()}), {replace}or export the "
            "float model to ONNX another way and quantize it with `onnx-qat quantize`")


#: Grappler passes the frozen graph gets: ``tf2onnx.tf_loader.tf_optimize`` minus ``constfold``, whose
#: Mul/Conv push-down folds a BatchNorm's per-channel Mul into the convolution weights. Keras computes
#: ``conv(x, q(w)) * f``, the folded graph ``conv(x, q(w) * f)``: equal up to the last float bit, enough to
#: move values lying on a quantizer's rounding boundary by a whole step. Constants are still folded by
#: tf2onnx (with TensorFlow, op by op) and by its ONNX optimizers; :func:`_pin_conv_bias` keeps those
#: from folding the Mul in their turn.
GRAPPLER_PASSES = ("function", "dependency")


def _tf2onnx_without_conv_folding(concrete, input_names: List[str], opset: int,
                                  optimizers=None) -> onnx.ModelProto:
    """``tf2onnx.convert.from_function`` for ``concrete``, except that the BatchNorm Mul/Add stay
    separate from the convolutions (:data:`GRAPPLER_PASSES`); ``input_names`` name the ONNX inputs.

    tf2onnx's ONNX optimizers (``optimizers``: its own table when None) run first without its
    per-pass recovery, which copies the whole graph, weights included, before every pass (half the
    conversion time of a ResNet50). Where a pass fails, the graph is converted again and optimized
    with that recovery, as ``tf2onnx.convert`` does: the failing pass is skipped and logged."""
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    from tensorflow.python.grappler import tf_optimizer
    from tf2onnx import optimizer, tfonnx

    frozen = convert_variables_to_constants_v2(concrete, lower_control_flow=False, aggressive_inlining=True)
    tf_inputs = [t.name for t in frozen.inputs if t.dtype != tf.resource]
    tf_outputs = [t.name for t in frozen.outputs if t.dtype != tf.resource]
    config = config_pb2.ConfigProto()
    config.graph_options.infer_shapes = True
    config.graph_options.rewrite_options.optimizers[:] = list(GRAPPLER_PASSES)
    with tf.Graph().as_default():
        meta = tf.compat.v1.train.export_meta_graph(graph_def=frozen.graph.as_graph_def(add_shapes=True))
    fetch = meta_graph_pb2.CollectionDef()
    fetch.node_list.value.extend(tf_inputs + tf_outputs)
    meta.collection_def["train_op"].CopyFrom(fetch)
    graph_def = tf_optimizer.OptimizeGraph(config, meta)
    with tf.device("/cpu:0"), tf.Graph().as_default() as tf_graph:
        tf.import_graph_def(graph_def, name="")

        def convert():
            graph = tfonnx.process_tf_graph(tf_graph, continue_on_error=True, opset=opset,
                                            input_names=tf_inputs, output_names=tf_outputs,
                                            tensors_to_rename=dict(zip(tf_inputs, input_names)))
            _pin_conv_bias(graph)
            return graph

        try:
            graph = optimizer.optimize_graph(convert(), catch_errors=False, optimizers=optimizers)
        except Exception as exc:  # an optimizer pass failed: convert again, skip that pass
            logger.debug("tf2onnx optimizer pass failed (%s); converting again with per-pass recovery",
                         brief(exc))
            graph = optimizer.optimize_graph(convert(), catch_errors=True, optimizers=optimizers)
        return graph.make_model(f"converted from {concrete.name}")


def _pin_conv_bias(graph) -> None:
    """Give every bias-less Conv of a tf2onnx ``graph`` an explicit zero bias: tf2onnx's transpose
    optimizer folds a following per-channel Mul into the weights of a Conv without bias (and an
    Add into its bias), a Conv with a bias keeps them as separate nodes. Adding zero is exact."""
    from tf2onnx import utils

    for node in graph.get_nodes():
        shape = graph.get_shape(node.output[0]) if node.type == "Conv" and len(node.input) == 2 else None
        if not shape or len(shape) < 2 or shape[1] is None or shape[1] <= 0:
            continue
        dtype = utils.map_onnx_to_numpy_type(graph.get_dtype(node.output[0]))
        bias = graph.make_const(node.name + "/zero_bias", np.zeros(shape[1], dtype))
        graph.replace_inputs(node, [*node.input, bias.output[0]])


def _captured_constants(concrete) -> dict:
    """Tensors (not variables) a traced function captured, by the name of their placeholder
    (e.g. the mean of a built ``Normalization`` layer): tf2onnx leaves them as graph inputs."""
    import tensorflow as tf

    found = {}
    for external, internal in zip(concrete.captured_inputs, concrete.graph.internal_captures):
        if external.dtype != tf.resource and hasattr(external, "numpy"):
            found[internal.name] = np.asarray(external.numpy())
    return found


def _inline_captured(proto: onnx.ModelProto, captured: dict, input_names: set) -> None:
    """Turn graph inputs that hold captured constants into initializers (in place)."""
    extra = [i for i in proto.graph.input if i.name not in input_names and i.name in captured]
    for inp in extra:
        proto.graph.input.remove(inp)
        proto.graph.initializer.append(onnx.numpy_helper.from_array(captured[inp.name], inp.name))
    unknown = [i.name for i in proto.graph.input if i.name not in input_names]
    if unknown:
        raise ExportError(f"export_onnx: the converted graph needs inputs the model does not have: "
                          f"{', '.join(unknown[:3])}; rebuild the layer that holds them with "
                          "constant weights")


# --------------------------------------------------------------------------- parity
def _top1(a: np.ndarray, b: np.ndarray) -> Optional[float]:
    if a.ndim < 2 or a.shape[-1] < 2:
        return None
    return float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))


def output_parity(names: Sequence[str], keras_qat: Sequence[np.ndarray], qdq: Sequence[np.ndarray],
                  float_onnx: Sequence[np.ndarray], sensitivity: Optional[Sequence[float]] = None
                  ) -> Tuple[OutputParity, ...]:
    """One :class:`OutputParity` per output against the Keras QAT model run in TensorFlow (the
    criterion of the module docstring: the 10% bound, ``ABS_LIMIT`` of the output range, top-1);
    with ``sensitivity`` (one value per output) the rounding bound is tried where the 10% one
    fails, and a failure within it is reported as a rounding cascade."""
    result = []
    sensitivity = [float("nan")] * len(names) if sensitivity is None else list(sensitivity)
    for name, k, q, f, sens in zip(names, keras_qat, qdq, float_onnx, sensitivity):
        k, q, f = (np.asarray(v, np.float64).reshape(np.shape(k)) for v in (k, q, f))
        d_q, d_f = float(np.max(np.abs(q - k))), float(np.max(np.abs(f - k)))
        ratio = _ratio(d_q, d_f)
        top1 = _top1(q, k)
        cascade = sens > 0 and d_q <= SENSITIVITY_FACTOR * sens
        bound = "float" if ratio <= RATIO_LIMIT else ("rounding" if cascade else "")
        span = _output_range(k)
        absolute = _ratio(d_q, span) <= ABS_LIMIT
        passed = bool(bound) and absolute and (top1 is None or top1 >= TOP1_LIMIT)
        cause = ROUNDING_CASCADE if not passed and cascade else ""
        result.append(OutputParity(name, d_q, d_f, ratio, top1, passed, sens, bound, max_abs_tf=d_q,
                                   output_range=span, cause=cause))
    return tuple(result)


def _output_range(k: np.ndarray) -> float:
    """max - min of an output over the samples (max |k| for a constant output)."""
    span = float(np.max(k) - np.min(k)) if k.size else 0.0
    return span if span > 0 else float(np.max(np.abs(k), initial=0.0))


def split_parity(names: Sequence[str], keras_tf: Sequence[np.ndarray], keras_ort: Sequence[np.ndarray],
                 qdq: Sequence[np.ndarray], float_onnx: Sequence[np.ndarray],
                 sensitivity: Sequence[float]) -> Tuple[OutputParity, ...]:
    """Parity in two parts, for when the comparison with the model run in TensorFlow misses the
    10% bound (see :func:`keras_qat_in_onnxruntime`):

    * the export: the Q/DQ model against the Keras QAT model's own graph run in onnxruntime
      (``keras_ort``), the 10% bound and top-1 agreement, on equal arithmetic;
    * the engines: that run against the run in TensorFlow (``keras_tf``) within the 10% bound or
      ``SENSITIVITY_FACTOR`` times the rounding sensitivity, and the Q/DQ model's top-1
      agreement with the run in TensorFlow;
    * absolutely: the Q/DQ model within ``ABS_LIMIT`` of the output range of both runs (a
      failure the rounding bound explains is a rounding cascade).
    """
    result = []
    for name, k, r, q, f, sens in zip(names, keras_tf, keras_ort, qdq, float_onnx, sensitivity):
        k, r, q, f = (np.asarray(v, np.float64).reshape(np.shape(k)) for v in (k, r, q, f))
        d_q, d_f = float(np.max(np.abs(q - r))), float(np.max(np.abs(f - r)))
        d_tf, d_e = float(np.max(np.abs(q - k))), float(np.max(np.abs(r - k)))
        ratio = _ratio(d_q, d_f)
        agreements = [a for a in (_top1(q, r), _top1(q, k)) if a is not None]
        top1 = min(agreements) if agreements else None
        cascade = sens > 0 and d_e <= SENSITIVITY_FACTOR * sens
        engines = _ratio(d_e, float(np.max(np.abs(f - k)))) <= RATIO_LIMIT or cascade
        span = _output_range(k)
        absolute = _ratio(max(d_q, d_tf), span) <= ABS_LIMIT
        relative = ratio <= RATIO_LIMIT and engines
        passed = relative and absolute and (top1 is None or top1 >= TOP1_LIMIT)
        cause = ROUNDING_CASCADE if not passed and ratio <= RATIO_LIMIT and cascade else ""
        result.append(OutputParity(name, d_q, d_f, ratio, top1, passed, sens,
                                   "float" if relative else "", "onnxruntime", d_tf, d_e, span, cause))
    return tuple(result)


def _ratio(d_q: float, d_f: float) -> float:
    return d_q / d_f if d_f > 0 else (0.0 if d_q == 0 else float("inf"))


def deployed_parity(target: str, model: onnx.ModelProto, tensorrt_form: onnx.ModelProto, feeds,
                    names: Sequence[str], keras_tf: Sequence[np.ndarray],
                    float_out: Sequence[np.ndarray]) -> Tuple[DeployedParity, ...]:
    """:class:`DeployedParity` of ``model`` (the ``target`` form) run by onnxruntime as deployed
    (default graph optimisations, its integer kernels) against ``tensorrt_form`` run with
    optimisations off; it reads no detail of how the target form was made."""
    from onnx_qat.errors import QatError
    from onnx_qat.runtime import make_session

    reference = run_with_tensors(tensorrt_form, feeds)
    try:
        session = make_session(model, optimize=True)
    except QatError as exc:
        raise ExportError(f"export_onnx: the {target} model: {exc}") from None
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, dict(feeds))))
    result = []
    for name, k, f in zip(names, keras_tf, float_out):
        t, r = (np.asarray(v[name], np.float64).reshape(np.shape(k)) for v in (values, reference))
        d_t = float(np.max(np.abs(t - r)))
        d_quant = float(np.max(np.abs(r - np.asarray(f, np.float64).reshape(np.shape(k)))))
        ratio = _ratio(d_t, d_quant)
        top1 = _top1(t, np.asarray(k, np.float64))
        passed = ratio <= DEPLOYED_FACTOR and (top1 is None or top1 >= TOP1_LIMIT)
        result.append(DeployedParity(name, target, d_t, d_quant, ratio, top1, passed))
    return tuple(result)


def keras_qat_in_onnxruntime(q_model, opset: int, inputs: Sequence[np.ndarray]) -> Optional[List[np.ndarray]]:
    """The Keras QAT model's outputs computed by onnxruntime: its whole graph, fake quantization
    included (``Div``, ``Round``, ``Clip``, ``Mul``: :mod:`tf_bridge.fake_quant` op for op),
    converted by tf2onnx like the float twin. None (logged) when tf2onnx cannot convert it.

    TensorFlow and onnxruntime add the products of a convolution in different orders; their sums
    differ in the last bit (most outputs of any convolution wider than 1x1), and where such a sum
    feeds a quantizer at a rounding boundary the two runs pick neighbouring integers, which deeper
    layers carry on. Run in onnxruntime, the Keras model and the Q/DQ model share that arithmetic,
    so any difference between them is the export's own.
    """
    from onnx_qat.model_io import load_model

    try:
        proto = load_model(convert_float_twin(q_model, opset))
    except ExportError as exc:
        logger.warning("export_onnx: the Keras QAT graph could not be run in onnxruntime (%s); "
                       "parity is measured against TensorFlow only", exc)
        return None
    feeds = {i.name: a for i, a in zip(proto.graph.input, inputs)}
    values = run_with_tensors(proto, feeds)
    return [values[o.name] for o in proto.graph.output]


def rounding_sensitivity(qdq_model: onnx.ModelProto, feeds, names: Sequence[str],
                         base: Sequence[np.ndarray]) -> Tuple[float, ...]:
    """How far the Q/DQ model's outputs move when the output of every Conv, ConvTranspose,
    Gemm and MatMul changes by about two units in the last place (a random sign per output
    channel, fixed seed) - the size of difference a BatchNorm fold or another engine's
    summation order makes - i.e. the rounding-boundary cascade this model amplifies such
    differences into."""
    copy = onnx.ModelProto()
    copy.CopyFrom(qdq_model)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in copy.graph.initializer}
    producers = {o: n for n in copy.graph.node for o in n.output}
    rng = np.random.default_rng(0)
    nodes = []
    for node in copy.graph.node:
        nodes.append(node)
        channels = _output_channels(node, inits, producers)
        if channels is None:
            continue
        out = node.output[0]
        spatial = 0 if node.op_type in ("MatMul", "Gemm") else _spatial_rank(node)
        shape = (channels,) + (1,) * spatial
        factor = (1.0 + rng.choice([-1.0, 1.0], channels) * 2.0 ** -22).astype(np.float32).reshape(shape)
        copy.graph.initializer.append(onnx.numpy_helper.from_array(factor, out + "_rounding_nudge"))
        node.output[0] = out + "_before_nudge"
        nodes.append(onnx.helper.make_node("Mul", [node.output[0], out + "_rounding_nudge"], [out]))
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    values = run_with_tensors(copy, feeds)
    return tuple(float(np.max(np.abs(values[n].astype(np.float64) - np.asarray(b, np.float64).reshape(
        values[n].shape)))) for n, b in zip(names, base))


def _output_channels(node, inits, producers) -> Optional[int]:
    """Output channels of a weighted node whose weight comes from a DequantizeLinear of an initializer."""
    if node.op_type not in ("Conv", "ConvTranspose", "MatMul", "Gemm") or len(node.input) < 2:
        return None
    dq = producers.get(node.input[1])
    if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
        return None
    shape = inits[dq.input[0]].shape
    if node.op_type == "Conv":
        return int(shape[0])
    if node.op_type == "ConvTranspose":
        return int(shape[1]) * int(next((a.i for a in node.attribute if a.name == "group"), 1))
    if node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute):
        return int(shape[0])
    return int(shape[-1])


def _spatial_rank(node) -> int:
    kernel = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), None)
    return len(kernel) if kernel else 2


def worst_layers(q_model, mapping: KerasOnnxMapping, qdq_model: onnx.ModelProto, inserted, feeds,
                 inputs, limit: int = 5) -> Tuple[LayerDiff, ...]:
    """The quantized tensors where the Q/DQ model departs most from the Keras QAT model."""
    from .trace import trace_layers

    calls, _ = trace_layers(q_model, inputs)
    dq_out = {}
    for node in qdq_model.graph.node:
        if node.op_type == "DequantizeLinear":
            dq_out[node.name] = node.output[0]
    tensors = {r["tensor"]: dq_out.get(r["dequantize_node"])
               for r in inserted if r.get("kind") == "activation"}
    values = run_with_tensors(qdq_model, feeds, [t for t in tensors.values() if t])
    diffs = []
    for entry in mapping.entries:
        if entry.kind != "activation" or entry.quantizer not in calls:
            continue
        keras_value = calls[entry.quantizer][0].outputs[0]
        for tensor in entry.onnx_tensors:
            onnx_value = values.get(tensors.get(tensor) or "")
            error = np.inf if onnx_value is None else value_error(keras_value, onnx_value)
            if np.isfinite(error):
                diffs.append(LayerDiff(entry.quantizer, tensor, error))
    diffs.sort(key=lambda d: -d.rel_error)
    return tuple(diffs[:limit])


# --------------------------------------------------------------------------- the export
def export_onnx(q_model, path, *, opset: int = 17, target: str = "tensorrt", sample_data=None,
                save_scales: bool = True, save_float: bool = False, strict: bool = True,
                progress: bool = True) -> ExportReport:
    """Export a (trained, calibrated) Keras QAT model to a Q/DQ ONNX model with its learned scales.

    Args:
        q_model: a model returned by :func:`tf_bridge.quantize_model` (Functional or
            Sequential, nested models allowed), calibrated and/or trained.
        path: the Q/DQ ``.onnx`` file to write.
        opset: the ONNX opset tf2onnx converts to (>= 13).
        target: the :func:`onnx_qat.quantize` deployment target.
        sample_data: inputs for mapping and parity (an array, or a list with one array per
            model input); None generates 8 standard-normal samples. With a target that
            requantizes tensors no quantizer observes (``ort-cpu``), given data also supplies
            their ranges (max |x|); generated samples do not (those Convs keep a float output).
        save_scales: also write the ScaleTable JSON as ``<name>.scales.json`` beside ``path``
            (the learned ranges plus, for ``ort-cpu`` with ``sample_data``, the ranges of its
            requantization points, so ``onnx-qat quantize --scales`` gets the same model).
        save_float: also write the float ONNX model as ``<name>.float.onnx`` (its quantized
            weights snapped to the Keras int8 grid, so ``onnx-qat quantize`` with the scales
            reproduces the Q/DQ model).
        strict: raise when parity fails (nothing written); False writes the files and
            returns a failing report.
        progress: show progress on stderr.

    Returns:
        An :class:`ExportReport` (paths, mapping table, parity, check verdict).

    Raises:
        ExportError: subclassed model, uncalibrated or unmappable quantizer (named),
            tf2onnx failure, or (``strict``) failed parity.
        OutputError: an output path cannot be written.
    """
    from onnx_qat.check import check
    from onnx_qat.model_io import load_model, save_model
    from onnx_qat.quantize import quantize

    from .describe import iter_quantizer_layers
    from .wrap import float_model as float_twin

    check_exportable(q_model)
    if not any(True for _ in iter_quantizer_layers(q_model)):
        raise ExportError(f"export_onnx: model '{q_model.name}' has no tf_bridge quantizers; "
                          "quantize it with tf_bridge.quantize_model first")
    out, scales_path, float_path = _paths(path, save_scales, save_float)
    inputs, generated = _input_arrays(q_model, sample_data)
    step = _Steps(progress)
    step("float twin -> tf2onnx")
    twin = float_twin(q_model)
    float_model = load_model(convert_float_twin(twin, opset))
    feeds = {i.name: a for i, a in zip(float_model.graph.input, inputs)}
    step("map quantizers")
    float_values = run_with_tensors(float_model, feeds)
    mapping = map_quantizers(q_model, float_model)
    table = mapping.scales if generated else _with_target_ranges(mapping, target, feeds)
    step("insert Q/DQ")
    result, reproducible = _quantize(quantize, float_model, mapping, target, table)
    step("parity in onnxruntime")
    keras_out = q_model(inputs if len(inputs) > 1 else inputs[0], training=False)
    keras_tf = [np.asarray(v) for v in _outputs(keras_out)]
    reference = result if result.target == "tensorrt" else _quantize(quantize, float_model, mapping,
                                                                      "tensorrt", mapping.scales)[0]
    parity = _parity(q_model, mapping, reference, float_model, float_values, feeds, inputs, keras_tf, opset,
                     generated)
    if reference is not result:
        names = [o.name for o in float_model.graph.output]
        parity = replace(parity, deployed=deployed_parity(
            result.target, result.model, reference.model, feeds, names, keras_tf,
            [float_values[n] for n in names]))
    if not parity.passed:
        _fail_loudly(parity, strict)
    step("write")
    if float_path is not None:
        save_model(mapping.model, float_path, inputs=(out,))
    if scales_path is not None:
        table.save(scales_path)
    save_model(result.model, out)
    verdict = check(result.model, target=result.target)
    step.done()
    report = ExportReport(out, scales_path, float_path, int(opset), result.target, mapping.entries, parity,
                          verdict, MappingProxyType(dict(result.summary)),
                          reproducible and not mapping.baked, mapping.baked, tuple(result.requantization))
    logger.info("%s", report)
    return report


def _outputs(value) -> list:
    import keras

    return list(keras.tree.flatten(value))


def _parity(q_model, mapping: KerasOnnxMapping, result, float_model, float_values, feeds, inputs,
            keras_tf: List[np.ndarray], opset: int, generated: bool) -> Parity:
    """The parity verdict of a TensorRT-form ``result`` (see the module docstring): against the
    Keras QAT model run in TensorFlow; when that misses the 10% bound, against its own graph run in
    onnxruntime (:func:`split_parity`), or, when that graph cannot be converted, on the rounding
    bound alone. The worst layers are named on failure."""
    qdq_values = run_with_tensors(result.model, feeds)
    names = [o.name for o in float_model.graph.output]
    qdq_out, float_out = [qdq_values[n] for n in names], [float_values[n] for n in names]
    outputs = output_parity(names, keras_tf, qdq_out, float_out)
    if not all(o.passed for o in outputs):
        sensitivity = rounding_sensitivity(result.model, feeds, names, qdq_out)
        keras_ort = keras_qat_in_onnxruntime(q_model, opset, inputs)
        outputs = (output_parity(names, keras_tf, qdq_out, float_out, sensitivity) if keras_ort is None
                   else split_parity(names, keras_tf, keras_ort, qdq_out, float_out, sensitivity))
    worst = () if all(o.passed for o in outputs) else worst_layers(
        q_model, mapping, result.model, result.inserted, feeds, inputs)
    return Parity(outputs, int(inputs[0].shape[0]), generated, worst)


def _with_target_ranges(mapping: KerasOnnxMapping, target: str, feeds) -> ScaleTable:
    """The learned ScaleTable plus the max |x| over ``feeds`` (the caller's sample data) of each
    tensor ``target``'s form needs a range for and no quantizer observes (ort-cpu: the output of
    a Conv requantized for ``QLinearConv`` that reaches no quantized tensor through exactly
    commuting ops). The learned ranges are kept as they are."""
    from onnx_qat.calibration import calibrate
    from onnx_qat.errors import QatError
    from onnx_qat.placement.graph_index import GraphIndex
    from onnx_qat.targets import get_target

    form = get_target(target).make_form()
    needed = () if form is None else tuple(
        t for t in form.calibration_tensors(GraphIndex(mapping.model), mapping.placement)
        if t not in mapping.scales.activations)
    if not needed:
        return mapping.scales
    try:
        measured = calibrate(mapping.model, feeds, method="max", tensors=needed, progress=False)
    except QatError as exc:
        raise ExportError(f"export_onnx: ranges of the {target} requantization points from sample_data: "
                          f"{brief(exc)}") from None
    samples = len(next(iter(feeds.values())))
    logger.info("%s: %d requantization point(s) take their range from sample_data (max |x|, %d samples)",
                target, len(needed), samples)
    return mapping.scales.merged(ScaleTable(
        measured.activations, producer=mapping.scales.producer,
        metadata={f"{target}_ranges": f"max |x| over {samples} sample_data samples for {len(needed)} "
                  "requantization point(s) no quantizer observes"}))


def _quantize(quantize, float_model, mapping: KerasOnnxMapping, target: str, table):
    """Quantize with the Keras placement and ``table``; use the default placement when it is the
    same one, so that ``onnx-qat quantize --scales`` reproduces the model byte for byte."""
    from onnx_qat.placement.policy import place

    default = place(mapping.model, target=target)
    same = not mapping.baked and _marks(default) == _marks(mapping.placement)
    if same:
        return quantize(mapping.model, scales=table, target=target, progress=False), True
    return quantize(mapping.model, scales=table, target=target, placement=mapping.placement,
                    progress=False), False


def _marks(placement) -> tuple:
    acts = sorted((m.tensor, tuple(sorted(m.consumers)), m.scale_group) for m in placement.activations)
    weights = sorted((w.tensor, w.node, w.input_index, -1 if w.axis is None else w.axis)
                     for w in placement.weights)
    return tuple(acts), tuple(weights)


def _fail_loudly(parity: Parity, strict: bool) -> None:
    failed = "; ".join(str(o) for o in (*parity.outputs, *parity.deployed) if not o.passed)
    worst = "; ".join(str(w) for w in parity.worst_layers[:3])
    message = (f"export_onnx: parity with the Keras QAT model failed: {failed}; "
               f"worst layers: {worst or 'none'}")
    if strict:
        raise ExportError(message + "; nothing was written (strict=False writes the files anyway)")
    logger.error("%s", message)


class _Steps:
    """Progress lines on stderr (one per step)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and os.environ.get("TF_BRIDGE_QUIET") is None
        self.count = 0

    def __call__(self, what: str) -> None:
        self.count += 1
        logger.info("export_onnx: %s", what)
        if self.enabled:
            print(f"export_onnx [{self.count}/5] {what}", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled:
            print("export_onnx: done", file=sys.stderr, flush=True)
