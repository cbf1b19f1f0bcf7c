"""Step 4 of [`tf_bridge.export_onnx`][]: parity of the Q/DQ model with the Keras QAT model.

The criterion (see `tf_bridge.export`), per output: against the Keras QAT model run in
TensorFlow, within ``RATIO_LIMIT`` of the float model's difference, within ``ABS_LIMIT`` of the
output range and with top-1 agreement >= ``TOP1_LIMIT``. When that misses, in two parts
(`split_parity`): **the export** - the Q/DQ model against the Keras QAT graph itself run in
onnxruntime (equal arithmetic), by the same three limits - and **the engines** - that run against
the run in TensorFlow, within ``RATIO_LIMIT`` of the float difference and ``ABS_LIMIT`` of the
range, or within ``SENSITIVITY_FACTOR`` times the rounding sensitivity measured on the Q/DQ
model. The second way passes, named in the text as a rounding cascade and logged as a warning:
the export is proven on equal arithmetic, and what remains is the Keras model's own
non-reproducibility across engines, measured, not assumed. Where the Keras graph cannot run in
onnxruntime, a difference only the rounding sensitivity explains stays FAILED (rounding
cascade). Typed results: `OutputParity`, `DeployedParity`, `Parity`.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import onnx

from onnx_qat.errors import ExportError
from onnx_qat.runtime.compare import top1_agreement

from .convert import convert_float_twin
from .mapping import KerasOnnxMapping
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


@dataclass(frozen=True)
class OutputParity:
    """Parity of one model output: max abs differences from the Keras QAT model and top-1 agreement.

    ``reference`` says which run of the Keras QAT model ``max_abs_qdq``, ``max_abs_float``,
    ``ratio`` and ``top1`` were measured against: ``"tensorflow"`` (the model called in
    TensorFlow) or ``"onnxruntime"`` (the Keras QAT model's own graph, fake quantization included,
    converted by tf2onnx and run in onnxruntime, whose convolutions round their sums as the Q/DQ
    model's do: the verdict on the export, on equal arithmetic). ``bound`` is ``"float"`` (the 10%
    bound held), ``"rounding"`` (``"tensorflow"`` reference only: only the rounding-sensitivity
    fallback held) or ``""``. ``output_range`` is the range (max - min) of the Keras QAT output
    (run in TensorFlow) over the samples; the Q/DQ model must stay within ``ABS_LIMIT`` of it
    (`abs_error`), so that a float twin whose own output explodes cannot make any difference
    look small.

    With the ``"onnxruntime"`` reference, the **engines** part compares the two runs of the Keras
    QAT model: ``max_abs_engine`` (their max abs difference; ``engines_abs_error`` as a fraction
    of the output range), ``max_abs_tf`` (the Q/DQ model against the run in TensorFlow),
    ``top1_tf`` (top-1 agreement with it) and ``engines``: ``"float"`` (within 10% of the float
    model's difference from the run in TensorFlow and ``ABS_LIMIT`` of the range: the engines
    agree), ``"rounding"`` (within ``SENSITIVITY_FACTOR`` times the rounding sensitivity
    ``sensitivity``: a rounding cascade, named in the text and logged as a warning by
    [`tf_bridge.export_onnx`][], the verdict still PASSED when the export part holds) or ``""``
    (beyond both: FAILED). ``cause`` explains a failure: ``"rounding cascade"`` when the
    difference is within ``SENSITIVITY_FACTOR`` times the rounding sensitivity where no
    onnxruntime run of the Keras graph exists (the network itself turns last-bit differences into
    large ones: typical of an untrained, chaotic network), otherwise ``""``.
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
    engines: str = ""
    top1_tf: Optional[float] = None

    @property
    def abs_error(self) -> float:
        """The Q/DQ model's difference from its reference run (``max_abs_qdq``) as a fraction of
        the output range (nan when the range is unknown)."""
        return _ratio(self.max_abs_qdq, self.output_range) if np.isfinite(self.output_range) else float("nan")

    @property
    def engines_abs_error(self) -> float:
        """The two runs of the Keras QAT model's difference (``max_abs_engine``) as a fraction of
        the output range (nan without an onnxruntime run)."""
        if np.isnan(self.max_abs_engine) or not np.isfinite(self.output_range):
            return float("nan")
        return _ratio(self.max_abs_engine, self.output_range)

    @property
    def engines_cascade(self) -> bool:
        """The two runs of the Keras QAT model agree only within the rounding sensitivity: the
        export is exact on equal arithmetic, the Keras model itself is not reproducible across
        TensorFlow and onnxruntime (an untrained or chaotic network)."""
        return self.reference == "onnxruntime" and self.engines == "rounding"

    def __str__(self) -> str:
        if self.reference == "onnxruntime":
            return self._split_text()
        top1 = "" if self.top1 is None else f" | top-1 {100 * self.top1:.1f}%"
        verdict = "PASSED" if self.passed else (f"FAILED ({self.cause})" if self.cause else "FAILED")
        head = (f"{verdict} | output '{self.name}' | Q/DQ vs Keras QAT "
                f"max abs {self.max_abs_qdq:.3g} = {100 * self.ratio:.3g}% of float vs Keras QAT "
                f"{self.max_abs_float:.3g} "
                f"(limit {100 * RATIO_LIMIT:.0f}%)")
        if self.bound != "float" and np.isfinite(self.sensitivity):
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

    def _split_text(self) -> str:
        """The two parts of a verdict against the Keras QAT graph run in onnxruntime."""
        exact = self.bound == "float" and self.abs_error <= ABS_LIMIT and (
            self.top1 is None or self.top1 >= TOP1_LIMIT)
        verdict = "PASSED" if self.passed else (f"FAILED ({self.cause})" if self.cause else "FAILED")
        op = "<=" if self.ratio <= RATIO_LIMIT else ">"
        op_abs = "<=" if self.abs_error <= ABS_LIMIT else ">"
        top1 = "" if self.top1 is None else f"; top-1 {100 * self.top1:.1f}%"
        export = (f"{'matches' if exact else 'does NOT match'} the Keras QAT graph in onnxruntime "
                  f"(max abs {self.max_abs_qdq:.3g} = {100 * self.ratio:.3g}% of float vs Keras QAT "
                  f"{self.max_abs_float:.3g} {op} {100 * RATIO_LIMIT:.0f}%; "
                  f"{100 * self.abs_error:.3g}% of the output range {self.output_range:.3g} {op_abs} "
                  f"{100 * ABS_LIMIT:g}%{top1})")
        engine = f"{100 * self.engines_abs_error:.3g}% of the output range"
        sens = f"{SENSITIVITY_FACTOR:g} x the rounding sensitivity {self.sensitivity:.3g}"
        if self.engines == "float":
            engines = f"TensorFlow and onnxruntime agree on the Keras model ({engine})"
        elif self.engines == "rounding":
            engines = f"TensorFlow and onnxruntime differ by a rounding cascade ({engine}, within {sens})"
        else:
            engines = (f"TensorFlow and onnxruntime differ on the Keras model by {engine}, beyond 10% of "
                       f"float vs Keras QAT and beyond {sens}")
        top1_tf = "" if self.top1_tf is None else f" | top-1 vs TensorFlow {100 * self.top1_tf:.1f}%"
        return f"{verdict} | output '{self.name}' | {export}; {engines}{top1_tf}"


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
    """The parity verdict: one `OutputParity` per output, the worst layers on failure, and
    for a target other than ``tensorrt`` one `DeployedParity` per output (``deployed``)."""

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
                             "engines": o.engines, "engines_abs_error": o.engines_abs_error,
                             "top1_tf": o.top1_tf, "passed": o.passed}
                            for o in self.outputs],
                "deployed": [d.to_dict() for d in self.deployed],
                "worst_layers": [{"quantizer": w.quantizer, "onnx_tensor": w.onnx_tensor,
                                  "rel_error": w.rel_error} for w in self.worst_layers]}


def output_parity(names: Sequence[str], keras_qat: Sequence[np.ndarray], qdq: Sequence[np.ndarray],
                  float_onnx: Sequence[np.ndarray], sensitivity: Optional[Sequence[float]] = None
                  ) -> Tuple[OutputParity, ...]:
    """One `OutputParity` per output against the Keras QAT model run in TensorFlow (the
    criterion of the module docstring: the 10% bound, ``ABS_LIMIT`` of the output range, top-1);
    with ``sensitivity`` (one value per output) the rounding bound is tried where the 10% one
    fails, and a failure within it is reported as a rounding cascade."""
    result = []
    sensitivity = [float("nan")] * len(names) if sensitivity is None else list(sensitivity)
    for name, k, q, f, sens in zip(names, keras_qat, qdq, float_onnx, sensitivity):
        k, q, f = (np.asarray(v, np.float64).reshape(np.shape(k)) for v in (k, q, f))
        d_q, d_f = float(np.max(np.abs(q - k))), float(np.max(np.abs(f - k)))
        ratio = _ratio(d_q, d_f)
        top1 = top1_agreement(q, k)
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
    10% bound (see `keras_qat_in_onnxruntime`); an output passes when both hold:

    * **the export**: the Q/DQ model against the Keras QAT model's own graph run in onnxruntime
      (``keras_ort``), on equal arithmetic: within ``RATIO_LIMIT`` of the float model's
      difference from that run, within ``ABS_LIMIT`` of the output range, top-1 agreement
      >= ``TOP1_LIMIT``;
    * **the engines**: that run against the run in TensorFlow (``keras_tf``), within
      ``RATIO_LIMIT`` of the float model's difference from the run in TensorFlow and
      ``ABS_LIMIT`` of the output range (``engines == "float"``), or within
      ``SENSITIVITY_FACTOR`` times the rounding sensitivity measured on the Q/DQ model
      (``engines == "rounding"``: a rounding cascade of the Keras model itself, named in the
      verdict's text).
    """
    result = []
    for name, k, r, q, f, sens in zip(names, keras_tf, keras_ort, qdq, float_onnx, sensitivity):
        k, r, q, f = (np.asarray(v, np.float64).reshape(np.shape(k)) for v in (k, r, q, f))
        d_q, d_f = float(np.max(np.abs(q - r))), float(np.max(np.abs(f - r)))
        d_tf, d_e = float(np.max(np.abs(q - k))), float(np.max(np.abs(r - k)))
        ratio, span = _ratio(d_q, d_f), _output_range(k)
        top1 = top1_agreement(q, r)
        export = (ratio <= RATIO_LIMIT and _ratio(d_q, span) <= ABS_LIMIT
                  and (top1 is None or top1 >= TOP1_LIMIT))
        if _ratio(d_e, float(np.max(np.abs(f - k)))) <= RATIO_LIMIT and _ratio(d_e, span) <= ABS_LIMIT:
            engines = "float"
        elif sens > 0 and d_e <= SENSITIVITY_FACTOR * sens:
            engines = "rounding"
        else:
            engines = ""
        result.append(OutputParity(name, d_q, d_f, ratio, top1, export and bool(engines), sens,
                                   "float" if ratio <= RATIO_LIMIT else "", "onnxruntime", d_tf, d_e, span,
                                   engines=engines, top1_tf=top1_agreement(q, k)))
    return tuple(result)


def _ratio(d_q: float, d_f: float) -> float:
    return d_q / d_f if d_f > 0 else (0.0 if d_q == 0 else float("inf"))


def deployed_parity(target: str, model: onnx.ModelProto, tensorrt_form: onnx.ModelProto, feeds,
                    names: Sequence[str], keras_tf: Sequence[np.ndarray],
                    float_out: Sequence[np.ndarray]) -> Tuple[DeployedParity, ...]:
    """`DeployedParity` of ``model`` (the ``target`` form) run by onnxruntime as deployed
    (default graph optimisations, its integer kernels) against ``tensorrt_form`` run with
    optimisations off; it reads no detail of how the target form was made."""
    from onnx_qat.errors import QatError
    from onnx_qat.runtime.sessions import make_session

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
        top1 = top1_agreement(t, np.asarray(k, np.float64))
        passed = ratio <= DEPLOYED_FACTOR and (top1 is None or top1 >= TOP1_LIMIT)
        result.append(DeployedParity(name, target, d_t, d_quant, ratio, top1, passed))
    return tuple(result)


def keras_qat_in_onnxruntime(q_model, opset: int, inputs: Sequence[np.ndarray]) -> Optional[List[np.ndarray]]:
    """The Keras QAT model's outputs computed by onnxruntime: its whole graph, fake quantization
    included (``Div``, ``Round``, ``Clip``, ``Mul``: [`tf_bridge.fake_quant`][tf_bridge.fake_quant.fake_quant]
    op for op), converted by tf2onnx like the float twin. None (logged) when tf2onnx cannot convert it.

    TensorFlow and onnxruntime add the products of a convolution in different orders; their sums
    differ in the last bit (most outputs of any convolution wider than 1x1), and where such a sum
    feeds a quantizer at a rounding boundary the two runs pick neighbouring integers, which deeper
    layers carry on. Run in onnxruntime, the Keras model and the Q/DQ model share that arithmetic,
    so any difference between them is the export's own.
    """
    from onnx_qat.io.models import load_model

    from .fake_quant import forward_only

    try:
        with forward_only():  # the same ops without the gradient wrappers and run-time range checks
            proto = load_model(convert_float_twin(q_model, opset))
    except ExportError as exc:
        logger.warning("export_onnx: the Keras QAT graph could not be run in onnxruntime (%s); "
                       "parity is measured against TensorFlow only", exc)
        return None
    feeds = {i.name: a for i, a in zip(proto.graph.input, inputs)}
    values = run_with_tensors(proto, feeds)
    return [values[o.name] for o in proto.graph.output]


#: The relative change `rounding_sensitivity` makes: 2**-22, two units in the last place of a
#: float32 in [1, 2) (four in [0.5, 1)).
_NUDGE = 2.0 ** -22


#: How many random draws of the nudges' signs `rounding_sensitivity` makes; it reports the
#: largest cascade. Which values a nudge pushes across a rounding boundary depends on the signs, and
#: the size of the cascade with it (measured on ConvNeXtTiny: 1.3e-6 to 1.4e-5 over ten draws).
SENSITIVITY_DRAWS = 3


def rounding_sensitivity(qdq_model: onnx.ModelProto, feeds, names: Sequence[str],
                         base: Sequence[np.ndarray], draws: int = SENSITIVITY_DRAWS) -> Tuple[float, ...]:
    """How far the Q/DQ model's outputs move when the output of every Conv, ConvTranspose,
    Gemm and MatMul changes by two units in the last place of the sum of its terms' magnitudes
    (``2**-22`` times the same op on ``|x|`` and ``|W|``: a sum's rounding differs between engines
    by about that much, however far its terms cancel; a random sign per output channel), the
    output of every reduction (ReduceMean, ReduceSum, GlobalAveragePool, AveragePool: a
    LayerNormalization's mean and variance, a pooled feature) by two units in the last place of the
    same reduction of ``|x|`` (a random sign per tensor), and every computed tensor a QuantizeLinear
    reads by two units in its own last place (a random sign per tensor; not the model's inputs,
    which every engine reads alike) - the size of difference a BatchNorm fold or another engine's
    arithmetic makes (its summation order in a convolution, its reductions in a
    LayerNormalization, its GELU) - i.e. the rounding-boundary cascade this model amplifies such
    differences into. The largest of ``draws`` draws of the signs (fixed seeds), per output."""
    worst = [0.0] * len(names)
    for draw in range(draws):
        values = run_with_tensors(_nudged(qdq_model, draw), feeds)
        for k, (n, b) in enumerate(zip(names, base)):
            moved = np.abs(values[n].astype(np.float64) - np.asarray(b, np.float64).reshape(values[n].shape))
            worst[k] = max(worst[k], float(np.max(moved)))
    return tuple(worst)


def _nudged(qdq_model: onnx.ModelProto, draw: int) -> onnx.ModelProto:
    """A copy of ``qdq_model`` with the nudges of `rounding_sensitivity`, signs from draw
    ``draw`` (seeds ``3 * draw``, ``+1``, ``+2``)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(qdq_model)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in copy.graph.initializer}
    producers = {o: n for n in copy.graph.node for o in n.output}
    rng, rng_q, rng_r = (np.random.default_rng(3 * draw + k) for k in range(3))
    nodes = []
    for i, node in enumerate(copy.graph.node):
        if node.op_type == "QuantizeLinear" and _computed(node.input[0], producers):
            nudge = f"{node.input[0]}_rounding_nudge_{i}"
            factor = np.float32(1.0 + rng_q.choice([-1.0, 1.0]) * _NUDGE)
            copy.graph.initializer.append(onnx.numpy_helper.from_array(np.array(factor), nudge))
            nodes.append(onnx.helper.make_node("Mul", [node.input[0], nudge], [nudge + "d"]))
            node.input[0] = nudge + "d"
        nodes.append(node)
        if node.op_type in _REDUCTIONS and _computed(node.input[0], producers):
            signed = np.float32(rng_r.choice([-1.0, 1.0]) * _NUDGE)  # a random sign per tensor
            nodes.extend(_terms_nudge(node, signed, copy.graph.initializer, magnitudes=1,
                                      inputs=len(node.input)))
            continue
        channels = _output_channels(node, inits, producers)
        if channels is None:
            continue
        spatial = 0 if node.op_type in ("MatMul", "Gemm") else _spatial_rank(node)
        shape = (channels,) + (1,) * spatial
        # a random sign per output channel; the terms are x and W (no bias)
        signed = (rng.choice([-1.0, 1.0], channels) * _NUDGE).astype(np.float32).reshape(shape)
        nodes.extend(_terms_nudge(node, signed, copy.graph.initializer, magnitudes=2, inputs=2))
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    return copy


#: Ops that sum many terms in an order each engine picks: their results differ between engines by
#: about a last bit of the sum of the terms' magnitudes (the same op on ``|x|``).
_REDUCTIONS = ("ReduceMean", "ReduceSum", "GlobalAveragePool", "AveragePool")


def _terms_nudge(node, signed, initializers, magnitudes: int, inputs: int) -> List[onnx.NodeProto]:
    """Nodes that move ``node``'s output by ``signed`` times the same op on its terms' magnitudes:
    its first ``inputs`` inputs, the first ``magnitudes`` of them as their absolute values (a
    Conv/Gemm/MatMul on ``|x|`` and ``|W|`` without its bias; a reduction on ``|x|`` with its
    axes). The size of a sum's rounding difference between engines is set by its terms, not by its
    result, which may cancel to a small value (a LayerNormalization's mean, from which each value is
    then subtracted). ``node`` is renamed to write ``<out>_before_nudge``; the nodes returned write
    ``<out>``."""
    out = node.output[0]
    nudge = onnx.numpy_helper.from_array(np.asarray(signed, np.float32), out + "_rounding_nudge")
    initializers.append(nudge)
    node.output[0] = out + "_before_nudge"
    absolute = [f"{out}_abs_{k}" for k in range(magnitudes)]
    terms = onnx.helper.make_node(node.op_type, absolute + list(node.input[magnitudes:inputs]),
                                  [out + "_terms"], name=(node.name or out) + "_terms")
    terms.attribute.extend(a for a in node.attribute if a.name != "beta")  # Gemm's beta scales the bias
    shift = onnx.helper.make_node("Mul", [out + "_terms", nudge.name], [out + "_shift"])
    return ([onnx.helper.make_node("Abs", [node.input[k]], [name]) for k, name in enumerate(absolute)]
            + [terms, shift, onnx.helper.make_node("Add", [node.output[0], out + "_shift"], [out])])


#: Ops that move data without arithmetic: a tensor reached from a model input through them only
#: is the same in every engine.
_DATA_MOVES = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Cast")


def _computed(tensor: str, producers) -> bool:
    """A tensor some arithmetic computed: not a model input or constant, nor one only moved
    (`_DATA_MOVES`) from one."""
    seen = 0
    while tensor in producers and seen < 64:
        node = producers[tensor]
        if node.op_type not in _DATA_MOVES:
            return node.op_type not in ("Constant",)
        tensor, seen = node.input[0] if node.input else "", seen + 1
    return False


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

    quantizers = {e.quantizer for e in mapping.entries if e.kind == "activation"}
    calls, _ = trace_layers(q_model, inputs, only=quantizers)  # their outputs, not every tensor
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


def _parity(q_model, mapping: KerasOnnxMapping, result, float_model, float_values, feeds, inputs,
            keras_tf: List[np.ndarray], opset: int, generated: bool, part=None) -> Parity:
    """The parity verdict of a TensorRT-form ``result`` (see the module docstring): against the
    Keras QAT model run in TensorFlow; when that fails, in two parts against its own graph run in
    onnxruntime (`split_parity`), or, when that graph cannot be converted, against TensorFlow
    with the rounding bound tried (a difference only it explains fails as a rounding cascade).
    The worst layers are named on failure; a pass through a rounding cascade of the engines is
    logged as a warning. ``part(name)``, when given, is a context manager timing each run
    (`tf_bridge.ExportReport.timings`)."""
    part = part or (lambda name: contextlib.nullcontext())
    with part("Q/DQ model in onnxruntime"):
        qdq_values = run_with_tensors(result.model, feeds)
    names = [o.name for o in float_model.graph.output]
    qdq_out, float_out = [qdq_values[n] for n in names], [float_values[n] for n in names]
    outputs = output_parity(names, keras_tf, qdq_out, float_out)
    if not all(o.passed for o in outputs):
        with part("rounding sensitivity"):
            sensitivity = rounding_sensitivity(result.model, feeds, names, qdq_out)
        with part("Keras QAT graph in onnxruntime"):
            keras_ort = keras_qat_in_onnxruntime(q_model, opset, inputs)
        outputs = (output_parity(names, keras_tf, qdq_out, float_out, sensitivity) if keras_ort is None
                   else split_parity(names, keras_tf, keras_ort, qdq_out, float_out, sensitivity))
    worst = ()
    if not all(o.passed for o in outputs):
        with part("worst layers"):
            worst = worst_layers(q_model, mapping, result.model, result.inserted, feeds, inputs)
    _warn_engines_cascade(outputs)
    return Parity(outputs, int(inputs[0].shape[0]), generated, worst)


def _warn_engines_cascade(outputs: Sequence[OutputParity]) -> None:
    """A warning for each passed output whose Keras model TensorFlow and onnxruntime compute only a
    rounding cascade apart: what it means and what to do."""
    for o in outputs:
        if o.passed and o.engines_cascade:
            logger.warning(
                "export_onnx: output '%s': the Q/DQ model matches the Keras QAT graph run in "
                "onnxruntime (%.3g%% of the output range), but TensorFlow and onnxruntime compute the Keras "
                "QAT model itself %.3g%% of the output range apart (within %g x its rounding sensitivity "
                "%.3g): last-bit differences of convolution sums flip quantizer roundings and this "
                "network amplifies them, as untrained or chaotic networks do. The exported model is as "
                "close to the Keras model as the Keras model is to itself on another engine; train the "
                "model (or settle its BatchNorm statistics on real data) before export to make the two "
                "agree, and check accuracy on real data", o.name, 100 * o.abs_error,
                100 * o.engines_abs_error, SENSITIVITY_FACTOR, o.sensitivity)


def _fail_loudly(parity: Parity, strict: bool) -> None:
    failed = "; ".join(str(o) for o in (*parity.outputs, *parity.deployed) if not o.passed)
    worst = "; ".join(str(w) for w in parity.worst_layers[:3])
    message = (f"export_onnx: parity with the Keras QAT model failed: {failed}; "
               f"worst layers: {worst or 'none'}")
    if strict:
        raise ExportError(message + "; nothing was written (strict=False writes the files anyway)")
    logger.error("%s", message)
