"""compare(reference, candidate, data) -> Comparison: numerics of two models in onnxruntime.

Both models run on the same inputs; every output is matched by name and summarised:

* ``max abs``  — max |r - c|
* ``max rel``  — max |r - c| / max(|r|, 1e-6 · max|r|) (the floor keeps near-zero
  reference values from dominating)
* ``mean abs`` — mean |r - c|
* ``cosine``   — r·c / (‖r‖ ‖c‖) over the whole output (1.0 when both are zero)
* ``SQNR``     — 10 log10(Σ r² / Σ (r - c)²) in dB (``inf`` when identical)
* ``top-1``    — share of rows whose argmax over the last axis agrees, for class-score
  outputs only: rank 2 (``[samples, classes]``, classes > 1) or written by a Softmax or
  LogSoftmax; for any output with a last dimension > 1 when ``min_top1`` is set. Else None
  (on a detector's ``[N, 84, 8400]`` or a segmentation map the argmax of the last axis is no
  class decision, and the figure would mean nothing)

For a stateful model (data with ``state``, run in order with the state fed back) the figures are
those of the per-step output sequence (each step's outputs joined in order), and for a probability
output (float, every reference value in [0, 1], not a state output) also

* ``decisions`` — share of values on the same side of `DECISION_THRESHOLD` (0.5, silero-vad's
  default speech threshold): the steps whose yes/no decision (speech / non-speech) agrees.

A state output (fed back to the next step) is reported but not judged: it is the model's memory,
and its error shows in the outputs that are.

An output passes when every threshold that is set holds: ``max_abs`` (upper
bound), ``min_cosine`` (default 0.99), ``min_sqnr_db``, ``min_top1`` (a fraction), ``min_decisions``
(a fraction, stateful models).

Non-finite values count as `auto` calibration counts them
(`onnx_qat.calibration.choice.sample_errors`): a position where the reference is NaN or infinite (the
float model overflowed, or a masking constant) is left out of every figure but top-1 and counted
(``left_out``; the printed report says how many on a line of its own); a NaN or infinite candidate
value where the reference is finite is a full error (``nonfinite``): max abs, max rel and mean abs
``inf``, cosine 0.0 (the limit as the error grows without bound), SQNR ``-inf``, and the output fails.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from ..errors import ConfigError, ModelError

#: Floor of the relative-error denominator, relative to the largest |reference| value.
REL_FLOOR = 1e-6
#: Largest |value| range `output_figures` computes in as is; beyond it (float64 outputs) both arrays
#: are divided by their peak first, so sums of squares neither overflow nor underflow.
SAFE_RANGE = (1e-100, 1e100)
#: A probability output's yes/no decision: above this value (silero-vad's default threshold).
DECISION_THRESHOLD = 0.5


@dataclass(frozen=True)
class OutputComparison:
    """The figures for one output; true when it passed.

    Attributes beyond the contract fields: ``shape`` of the compared output and the
    thresholds that were applied (None when not set); ``left_out``: the values left out of the
    figures because the reference is NaN or infinite there; ``nonfinite``: the candidate's NaN or
    infinite values where the reference is finite (each a full error, see the module docstring).
    """

    name: str
    max_abs: float
    max_rel: float
    mean_abs: float
    cosine: float
    sqnr_db: float
    top1: Optional[float]
    passed: bool
    reason: str
    shape: Tuple[int, ...] = ()
    max_abs_limit: Optional[float] = None
    min_cosine: Optional[float] = None
    min_sqnr_db: Optional[float] = None
    min_top1: Optional[float] = None
    steps: Optional[int] = None
    decisions: Optional[float] = None
    min_decisions: Optional[float] = None
    state: bool = False
    left_out: int = 0
    nonfinite: int = 0

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        verdict = "STATE " if self.state else ("PASSED" if self.passed else "FAILED")
        parts = [verdict, f"output {self.name!r}" + (" (fed back, not judged)" if self.state else ""),
                 "max abs " + _bound(f"{self.max_abs:.1e}", self.max_abs, self.max_abs_limit, upper=True,
                                     fmt="{:.1e}"),
                 "cosine " + _bound(f"{self.cosine:.5f}", self.cosine, self.min_cosine, upper=False,
                                    fmt="{:g}"),
                 "SQNR " + _bound(_db(self.sqnr_db), self.sqnr_db, self.min_sqnr_db, upper=False,
                                  fmt="{:.1f} dB")]
        if self.top1 is not None:
            limit = None if self.min_top1 is None else self.min_top1
            parts.append("top-1 " + _bound(f"{100 * self.top1:.1f}%", self.top1, limit, upper=False,
                                           fmt="{:.1%}"))
        if self.decisions is not None:
            agree = _bound(f"{100 * self.decisions:.1f}%", self.decisions, self.min_decisions, upper=False,
                           fmt="{:.1%}")
            parts.append(f"decisions {agree} agree")
        if self.steps is not None:
            parts.append(f"{self.steps} steps")
        if self.nonfinite:
            parts.append(f"{self.nonfinite} NaN/Inf where the reference is finite (full errors)")
        line = " | ".join(parts)
        if self.left_out:
            total = math.prod(self.shape) if self.shape else self.left_out
            line += (f"\n  output {self.name!r}: {self.left_out} of {total} values left out of the figures "
                     f"(the reference is NaN or infinite there)")
        return line

    def to_dict(self) -> dict:
        """Plain JSON-ready values (``inf`` SQNR stays a float; the CLI writes it as a string)."""
        return {
            "name": self.name, "shape": list(self.shape), "passed": self.passed, "reason": self.reason,
            "max_abs": self.max_abs, "max_rel": self.max_rel, "mean_abs": self.mean_abs,
            "cosine": self.cosine, "sqnr_db": self.sqnr_db, "top1": self.top1,
            "steps": self.steps, "decisions": self.decisions, "state": self.state,
            "left_out": self.left_out, "nonfinite": self.nonfinite,
            "thresholds": {"max_abs": self.max_abs_limit, "min_cosine": self.min_cosine,
                           "min_sqnr_db": self.min_sqnr_db, "min_top1": self.min_top1,
                           "min_decisions": self.min_decisions},
        }


def _db(value: float) -> str:
    return "inf dB" if math.isinf(value) and value > 0 else f"{value:.1f} dB"


def _bound(text: str, value: float, limit: Optional[float], *, upper: bool, fmt: str) -> str:
    if limit is None:
        return text
    ok = value <= limit if upper else value >= limit
    sign = ("≤" if ok else ">") if upper else ("≥" if ok else "<")
    return f"{text} {sign} {fmt.format(limit)}"


@dataclass(frozen=True)
class Comparison:
    """All outputs' figures; true when every output passed.

    Attributes:
        outputs: one `OutputComparison` per output.
        num_samples: the samples both models ran on.
        reference, candidate: the models' file paths (``"reference"`` / ``"candidate"`` for
            models given in memory).
    """

    outputs: Tuple[OutputComparison, ...]
    num_samples: int
    reference: str = field(default="reference")
    candidate: str = field(default="candidate")

    def __bool__(self) -> bool:
        return bool(self.outputs) and all(self.outputs)

    @property
    def passed(self) -> bool:
        """Every output compared and within its limits (``bool(comparison)``)."""
        return bool(self)

    def __str__(self) -> str:
        return "\n".join(str(o) for o in self.outputs)

    def to_dict(self) -> dict:
        """JSON-ready values: verdict, sample count, the two models' labels and one record per output."""
        return {"passed": bool(self), "num_samples": self.num_samples, "reference": self.reference,
                "candidate": self.candidate, "outputs": [o.to_dict() for o in self.outputs]}


# --------------------------------------------------------------------------- figures
def output_figures(reference: np.ndarray, candidate: np.ndarray) -> Dict[str, Optional[float]]:
    """max_abs, max_rel, mean_abs, cosine, sqnr_db and top1 for two arrays of one shape, with
    ``left_out`` and ``nonfinite`` (counts).

    The figures but top-1 are measured where the reference is finite: its NaN or infinite values
    (the float model has no number there to be close to) are left out and counted in ``left_out``,
    as `onnx_qat.calibration.choice.sample_errors` leaves them out of `auto`'s errors. A NaN or
    infinite candidate value where the reference is finite is counted in ``nonfinite`` and makes
    the error unbounded: max_abs, max_rel and mean_abs ``inf``, cosine 0.0, sqnr_db ``-inf``. With
    no finite reference value at all the figures are those of two empty arrays (no error, cosine 1.0).
    """
    r = np.asarray(reference, dtype=np.float64).ravel()
    c = np.asarray(candidate, dtype=np.float64).ravel()
    top1 = top1_agreement(reference, candidate) if r.size else None
    usable = np.isfinite(r)
    left_out = int(r.size - np.count_nonzero(usable))
    if left_out:
        r, c = r[usable], c[usable]
    nonfinite = int(c.size - np.count_nonzero(np.isfinite(c)))
    counts = {"left_out": left_out, "nonfinite": nonfinite}
    if r.size == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "mean_abs": 0.0, "cosine": 1.0, "sqnr_db": math.inf,
                "top1": top1, **counts}
    if nonfinite:
        return {"max_abs": math.inf, "max_rel": math.inf, "mean_abs": math.inf, "cosine": 0.0,
                "sqnr_db": -math.inf, "top1": top1, **counts}
    peak = max(float(np.max(np.abs(r))), float(np.max(np.abs(c))))
    unit = peak if peak > 0.0 and not SAFE_RANGE[0] <= peak <= SAFE_RANGE[1] else 1.0
    if unit != 1.0:  # float64 values whose squares would overflow (or underflow): scale both alike
        r, c = r / unit, c / unit
    diff = np.abs(r - c)
    ref_abs = np.abs(r)
    floor = max(REL_FLOOR * float(ref_abs.max()), np.finfo(np.float64).tiny)
    noise = float(np.sum((r - c) ** 2))
    signal = float(np.sum(r * r))
    norms = math.sqrt(signal) * math.sqrt(float(np.sum(c * c)))
    if norms == 0.0:
        cosine = 1.0 if signal == 0.0 and noise == 0.0 else 0.0
    else:
        cosine = float(np.dot(r, c) / norms)
    if noise == 0.0:
        sqnr = math.inf
    elif signal == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 10.0 * math.log10(signal / noise)
    return {"max_abs": float(diff.max()) * unit,  # a Python float: inf past float64's range, no warning
            "max_rel": float(np.max(diff / np.maximum(ref_abs, floor))),
            "mean_abs": float(diff.mean()) * unit, "cosine": cosine, "sqnr_db": sqnr, "top1": top1, **counts}


def top1_agreement(reference: np.ndarray, candidate: np.ndarray) -> Optional[float]:
    """Share of rows whose argmax over the last axis agrees; None without a class axis."""
    reference, candidate = np.asarray(reference), np.asarray(candidate)
    if reference.ndim < 2 or reference.shape[-1] < 2 or reference.dtype.kind not in "fc":
        return None
    agree = np.argmax(reference, axis=-1) == np.argmax(candidate, axis=-1)
    return float(np.mean(agree))


def decision_agreement(reference: np.ndarray, candidate: np.ndarray) -> Optional[float]:
    """Share of values on the same side of `DECISION_THRESHOLD`; None unless ``reference`` is a
    float probability (every value in [0, 1])."""
    r, c = np.asarray(reference), np.asarray(candidate)
    if r.dtype.kind != "f" or r.size == 0 or not (np.all(r >= 0.0) and np.all(r <= 1.0)):
        return None
    return float(np.mean((r > DECISION_THRESHOLD) == (c > DECISION_THRESHOLD)))


def judge(name: str, reference: np.ndarray, candidate: np.ndarray, *, max_abs=None, min_cosine=0.99,
          min_sqnr_db=None, min_top1=None, steps: Optional[int] = None, decisions: bool = False,
          min_decisions=None, state: bool = False, top1: bool = True) -> OutputComparison:
    """Compare one output and apply the thresholds; ``steps`` (a stateful model's sequence length) and
    ``decisions`` (judge a probability output's yes/no decisions) for sequences; a ``state`` output
    gets its figures only (no thresholds, no top-1); ``top1=False`` leaves the top-1 figure out
    (None) for an output that holds no class scores, unless ``min_top1`` asks for it."""
    if state:
        max_abs = min_cosine = min_sqnr_db = min_top1 = min_decisions = None
    figures = output_figures(reference, candidate)
    if state or (not top1 and min_top1 is None):
        figures["top1"] = None
    agree = decision_agreement(reference, candidate) if decisions else None
    reason = ""
    if figures["nonfinite"]:
        reason = (f"candidate output has {figures['nonfinite']} NaN or Inf value(s) where the reference "
                  f"is finite")
    elif max_abs is not None and not figures["max_abs"] <= max_abs:
        reason = f"max abs {figures['max_abs']:.3g} > {max_abs:g}"
    elif min_cosine is not None and not figures["cosine"] >= min_cosine:
        reason = f"cosine {figures['cosine']:.5f} < {min_cosine:g}"
    elif min_sqnr_db is not None and not figures["sqnr_db"] >= min_sqnr_db:
        reason = f"SQNR {figures['sqnr_db']:.1f} dB < {min_sqnr_db:g} dB"
    elif min_top1 is not None and figures["top1"] is not None and not figures["top1"] >= min_top1:
        reason = f"top-1 agreement {figures['top1']:.1%} < {min_top1:.1%}"
    elif min_decisions is not None and agree is not None and not agree >= min_decisions:
        reason = f"decisions agree on {agree:.1%} of values < {min_decisions:.1%}"
    return OutputComparison(name=name, passed=not reason, reason=reason, shape=tuple(np.shape(reference)),
                            max_abs_limit=max_abs, min_cosine=min_cosine, min_sqnr_db=min_sqnr_db,
                            min_top1=min_top1, steps=steps, decisions=agree,
                            min_decisions=min_decisions if agree is not None else None, state=state,
                            **figures)


def _check_same_inputs(ref_specs, cand_specs, ref_label: str, cand_label: str) -> None:
    """Both models must take the same inputs: names, element types, ranks and fixed sizes."""
    ref_names, cand_names = [s.name for s in ref_specs], [s.name for s in cand_specs]
    if sorted(ref_names) != sorted(cand_names):
        raise ModelError(f"input names differ: {ref_label} has {ref_names}, {cand_label} has {cand_names}")
    cand_by_name = {s.name: s for s in cand_specs}
    for ref in ref_specs:
        cand = cand_by_name[ref.name]
        if not _specs_compatible(ref, cand):
            raise ModelError(f"input {ref.name!r} is {ref.describe()} in {ref_label} "
                             f"but {cand.describe()} in {cand_label}")


def _specs_compatible(a, b) -> bool:
    if np.dtype(a.dtype) != np.dtype(b.dtype):
        return False
    if a.shape is None or b.shape is None:
        return True
    return len(a.shape) == len(b.shape) and all(
        x is None or y is None or x == y for x, y in zip(a.shape, b.shape))


def _check_thresholds(max_abs, min_cosine, min_sqnr_db, min_top1, min_decisions=None) -> None:
    def number(value, name):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or math.isnan(value)):
            raise ConfigError(f"{name} must be a number, got {value!r}")

    for value, name in ((max_abs, "max_abs"), (min_cosine, "min_cosine"), (min_sqnr_db, "min_sqnr_db"),
                        (min_top1, "min_top1")):
        number(value, name)
    if max_abs is not None and max_abs < 0:
        raise ConfigError(f"max_abs must be >= 0, got {max_abs}")
    if min_cosine is not None and not -1.0 <= min_cosine <= 1.0:
        raise ConfigError(f"min_cosine must be in [-1, 1], got {min_cosine}")
    if min_top1 is not None and not 0.0 <= min_top1 <= 1.0:
        raise ConfigError(f"min_top1 is a fraction in [0, 1], got {min_top1}")
    number(min_decisions, "min_decisions")
    if min_decisions is not None and not 0.0 <= min_decisions <= 1.0:
        raise ConfigError(f"min_decisions is a fraction in [0, 1], got {min_decisions}")


# --------------------------------------------------------------------------- driver
def compare(reference, candidate, data=None, *, batch_size: int = 16, max_abs: Optional[float] = None,
            min_cosine: Optional[float] = 0.99, min_sqnr_db: Optional[float] = None,
            min_top1: Optional[float] = None, num_samples: Optional[int] = None,
            progress: bool = False, state: Optional[Mapping[str, str]] = None,
            batch_axis: Optional[Mapping[str, int]] = None,
            min_decisions: Optional[float] = None, exact_qdq: Optional[bool] = None) -> Comparison:
    """Run two models in onnxruntime on the same inputs and compare every output by name.

    Args:
        reference, candidate: ``ModelProto`` (not modified) or paths.
        data: inputs as [`onnx_qat.load_data`][onnx_qat.io.data.load_data] accepts (samples or a stream of
            feeds); ``None`` generates ``num_samples`` (default 8) random samples with a fixed seed.
        batch_size: samples per onnxruntime run (a stream of feeds runs one feed per run).
        max_abs, min_cosine, min_sqnr_db, min_top1: thresholds (None disables one);
            ``min_top1`` is a fraction (0.99 = 99 %).
        num_samples: use only the first ``num_samples`` samples (feeds) of ``data``.
        progress: tqdm progress bars on stderr.
        state: ``{output: input}`` of a stateful model: the data runs in order, each model fed its
            own state; the figures are then those of the per-step output sequence, with the
            decision agreement of probability outputs (see the module docstring).
        batch_axis: ``{input: axis}`` for inputs whose batch axis is not the first.
        min_decisions: with ``state``: the smallest share of steps whose decisions must agree.
        exact_qdq: how onnxruntime runs each model. None (the default): by its form
            (`needs_exact_qdq`): a TensorRT-form Q/DQ model (and any
            FP8 model) with graph optimisations off, so every Q/DQ computes its definition as TensorRT
            does, never through onnxruntime's fused integer CPU kernels; a float model and the
            ``ort-cpu`` form as onnxruntime deploys them (optimisations on). True: both models exact;
            False: both optimised.

    Raises:
        ModelError: the models' inputs or output names differ, or an output's shape differs.
        DataError: the data does not fit the reference model.
    """
    from ..io.data import generate_data, load_data
    from ..io.layout import with_layout
    from ..io.models import load_model, model_input_specs

    _check_thresholds(max_abs, min_cosine, min_sqnr_db, min_top1, min_decisions)
    data = with_layout(data, state=state, batch_axis=batch_axis)
    ref_model, cand_model = load_model(reference), load_model(candidate)
    ref_label, cand_label = _label(reference, "reference"), _label(candidate, "candidate")
    ref_out = [o.name for o in ref_model.graph.output]
    cand_out = [o.name for o in cand_model.graph.output]
    if sorted(ref_out) != sorted(cand_out):
        raise ModelError(f"output names differ: {ref_label} has {ref_out}, {cand_label} has {cand_out}")
    _check_same_inputs(model_input_specs(ref_model), model_input_specs(cand_model), ref_label, cand_label)
    if data is None:
        dataset = generate_data(ref_model, num_samples=num_samples or 8, seed=0)
    else:
        dataset = load_data(data, ref_model)
        if num_samples is not None:
            dataset = dataset.take(num_samples)
    if exact_qdq is not None and not isinstance(exact_qdq, bool):
        raise ConfigError(f"exact_qdq must be True, False or None, got {exact_qdq!r}")
    optimize = None if exact_qdq is None else not exact_qdq
    warn_input_ranges(cand_model, dataset, batch_size)
    ref_values, cand_values, steps = _run_both(ref_model, cand_model, dataset, ref_out, batch_size, progress,
                                               optimize)
    sequence = bool(dataset.state)
    results, scores = [], class_score_outputs(ref_model)
    for name in ref_out:
        r, c = ref_values[name], cand_values[name]
        if r.shape != c.shape:
            raise ModelError(f"output {name!r} has shape {list(r.shape)} in {ref_label} and {list(c.shape)} "
                             f"in {cand_label}")
        results.append(judge(name, r, c, max_abs=max_abs, min_cosine=min_cosine, min_sqnr_db=min_sqnr_db,
                             min_top1=min_top1, steps=steps if sequence else None,
                             decisions=sequence and name not in dataset.state, min_decisions=min_decisions,
                             state=name in dataset.state, top1=name in scores or r.ndim == 2))
    return Comparison(tuple(results), dataset.num_samples, _path(reference, "reference"),
                      _path(candidate, "candidate"))


def _run_both(ref_model, cand_model, dataset, names, batch_size: int, progress: bool, optimize=None):
    """Both models' outputs ``names`` over ``dataset``, read once: each feed runs in the reference and
    then in the candidate (each carrying its own state), each session made with ``optimize`` (None: by
    the model's form, see `onnx_qat.runtime.sessions.make_session`). Returns the joined outputs and
    the run count."""
    from ..errors import QatError, brief
    from .sessions import feeds_with_progress, join_outputs, make_session
    from .stateful import carry_state

    sessions = [carry_state(make_session(m, optimize=optimize), dataset) for m in (ref_model, cand_model)]
    parts = [{n: [] for n in names}, {n: [] for n in names}]
    runs = 0
    for index, feed in enumerate(feeds_with_progress(dataset, batch_size, progress, "compare")):
        for session, got in zip(sessions, parts):
            try:
                values = session.run(names, feed)
            except QatError:
                raise
            except Exception as exc:
                raise ModelError(f"onnxruntime failed on batch {index} of {dataset.source}: "
                                 f"{brief(exc, 300)}") from None
            for name, value in zip(names, values):
                got[name].append(np.asarray(value))
        runs += 1
    joined = [{n: join_outputs(n, v, dataset) for n, v in got.items()} for got in parts]
    return joined[0], joined[1], runs


def _label(source, default: str) -> str:
    """``reference model.onnx`` for messages (``reference`` for an in-memory model)."""
    path = _path(source, "")
    return f"{default} {path}" if path else default


def _path(source, default: str) -> str:
    """The file a model came from, or ``default`` for an in-memory model."""
    if isinstance(source, bytes):
        return source.decode(errors="replace")
    return str(source) if isinstance(source, str) or hasattr(source, "__fspath__") else default


#: Ops whose output holds class scores along the last axis (top-1 means something there).
CLASS_SCORE_OPS = ("Softmax", "LogSoftmax")


def class_score_outputs(model) -> frozenset:
    """Names of the graph outputs written by a Softmax or LogSoftmax (through Identity/Reshape/Flatten)."""
    producer = {out: node for node in model.graph.node for out in node.output}
    found = set()
    for output in model.graph.output:
        node = producer.get(output.name)
        while node is not None and node.op_type in ("Identity", "Reshape", "Flatten", "Squeeze") \
                and node.input:
            node = producer.get(node.input[0])
        if node is not None and node.op_type in CLASS_SCORE_OPS:
            found.add(output.name)
    return frozenset(found)


#: Data this many times beyond the range the candidate's input quantizer holds earns a warning.
RANGE_WARNING_FACTOR = 4.0
#: Samples `warn_input_ranges` reads at most.
RANGE_CHECK_SAMPLES = 64


def warn_input_ranges(candidate, dataset, batch_size: int) -> None:
    """One warning per graph input whose values reach far beyond the range of the candidate's
    QuantizeLinear reading it (its scale times the largest code): the data is then likely on
    another scale than the calibration data was (uint8 0..255 fed to a model calibrated on 0..1).
    Only the first `RANGE_CHECK_SAMPLES` samples are read: a scale mismatch shows in any of them,
    and a large data file is not read twice."""
    ranges = input_quantizer_ranges(candidate)
    if not ranges:
        return
    peak = {name: 0.0 for name in ranges}
    for batch in dataset.take(RANGE_CHECK_SAMPLES).batches(batch_size):
        for name in peak:
            if name not in batch:  # a stateful model's state: in the first feed only
                continue
            values = np.asarray(batch[name])
            if values.size and values.dtype.kind in "fiu":
                peak[name] = max(peak[name], float(np.max(np.abs(values.astype(np.float64)))))
    import logging

    for name, amax in ranges.items():
        if peak[name] > RANGE_WARNING_FACTOR * amax:
            logging.getLogger(__name__).warning(
                "%s: input %r reaches |x| = %.4g, %.0fx the range its QuantizeLinear in the candidate "
                "holds (|x| <= %.4g): the data is likely on another scale than the calibration data "
                "(e.g. 0..255 where calibration saw 0..1)", dataset.source, name, peak[name],
                peak[name] / amax, amax)


def input_quantizer_ranges(model) -> Dict[str, float]:
    """``{graph input: largest |x| its QuantizeLinear represents}`` for inputs read by a
    QuantizeLinear with a constant scalar scale (INT8, UINT8 or FP8 E4M3)."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    inputs = {i.name for i in model.graph.input} - set(inits)
    found: Dict[str, float] = {}
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] not in inputs or len(node.input) < 2 \
                or node.input[1] not in inits:
            continue
        scale = numpy_helper.to_array(inits[node.input[1]])
        zero = inits.get(node.input[2]) if len(node.input) > 2 else None
        kind = zero.data_type if zero is not None else TensorProto.UINT8
        point = float(np.asarray(numpy_helper.to_array(zero), dtype=np.float64).ravel()[0]) \
            if zero is not None and kind in (TensorProto.INT8, TensorProto.UINT8) else 0.0
        codes = {TensorProto.INT8: 127.0 + abs(point), TensorProto.UINT8: max(255.0 - point, point),
                 TensorProto.FLOAT8E4M3FN: 448.0}.get(kind)
        if scale.size == 1 and codes and float(scale.ravel()[0]) > 0:
            found[node.input[0]] = max(found.get(node.input[0], 0.0), codes * float(scale.ravel()[0]))
    return found


__all__ = ["compare", "Comparison", "OutputComparison", "output_figures", "top1_agreement", "judge",
           "decision_agreement", "DECISION_THRESHOLD", "class_score_outputs", "input_quantizer_ranges",
           "warn_input_ranges"]
