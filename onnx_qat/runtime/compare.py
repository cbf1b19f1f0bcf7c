"""compare(reference, candidate, data) -> Comparison: numerics of two models in onnxruntime.

Both models run on the same inputs; every output is matched by name and summarised:

* ``max abs``  — max |r - c|
* ``max rel``  — max |r - c| / max(|r|, 1e-6 · max|r|) (the floor keeps near-zero
  reference values from dominating)
* ``mean abs`` — mean |r - c|
* ``cosine``   — r·c / (‖r‖ ‖c‖) over the whole output (1.0 when both are zero)
* ``SQNR``     — 10 log10(Σ r² / Σ (r - c)²) in dB (``inf`` when identical)
* ``top-1``    — share of rows whose argmax over the last axis agrees, for outputs
  with a class axis (rank >= 2 and last dimension > 1), else None

An output passes when every threshold that is set holds: ``max_abs`` (upper
bound), ``min_cosine`` (default 0.99), ``min_sqnr_db``, ``min_top1`` (a fraction).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import numpy as np

from ..errors import ConfigError, ModelError

#: Floor of the relative-error denominator, relative to the largest |reference| value.
REL_FLOOR = 1e-6


@dataclass(frozen=True)
class OutputComparison:
    """The figures for one output; true when it passed.

    Attributes beyond the contract fields: ``shape`` of the compared output and the
    thresholds that were applied (None when not set).
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

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        parts = ["PASSED" if self.passed else "FAILED", f"output {self.name!r}",
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
        return " | ".join(parts)

    def to_dict(self) -> dict:
        """Plain JSON-ready values (``inf`` SQNR stays a float; the CLI writes it as a string)."""
        return {
            "name": self.name, "shape": list(self.shape), "passed": self.passed, "reason": self.reason,
            "max_abs": self.max_abs, "max_rel": self.max_rel, "mean_abs": self.mean_abs,
            "cosine": self.cosine, "sqnr_db": self.sqnr_db, "top1": self.top1,
            "thresholds": {"max_abs": self.max_abs_limit, "min_cosine": self.min_cosine,
                           "min_sqnr_db": self.min_sqnr_db, "min_top1": self.min_top1},
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
    """All outputs' figures; true when every output passed."""

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
    """max_abs, max_rel, mean_abs, cosine, sqnr_db and top1 for two arrays of one shape."""
    r = np.asarray(reference, dtype=np.float64).ravel()
    c = np.asarray(candidate, dtype=np.float64).ravel()
    if r.size == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "mean_abs": 0.0, "cosine": 1.0, "sqnr_db": math.inf,
                "top1": None}
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
    return {"max_abs": float(diff.max()), "max_rel": float(np.max(diff / np.maximum(ref_abs, floor))),
            "mean_abs": float(diff.mean()), "cosine": cosine, "sqnr_db": sqnr,
            "top1": top1_agreement(reference, candidate)}


def top1_agreement(reference: np.ndarray, candidate: np.ndarray) -> Optional[float]:
    """Share of rows whose argmax over the last axis agrees; None without a class axis."""
    reference, candidate = np.asarray(reference), np.asarray(candidate)
    if reference.ndim < 2 or reference.shape[-1] < 2 or reference.dtype.kind not in "fc":
        return None
    agree = np.argmax(reference, axis=-1) == np.argmax(candidate, axis=-1)
    return float(np.mean(agree))


def judge(name: str, reference: np.ndarray, candidate: np.ndarray, *, max_abs=None, min_cosine=0.99,
          min_sqnr_db=None, min_top1=None) -> OutputComparison:
    """Compare one output and apply the thresholds."""
    figures = output_figures(reference, candidate)
    reason = ""
    if not np.all(np.isfinite(np.asarray(candidate, dtype=np.float64))) and \
            np.all(np.isfinite(np.asarray(reference, dtype=np.float64))):
        reason = "candidate output has NaN or Inf values"
    elif max_abs is not None and not figures["max_abs"] <= max_abs:
        reason = f"max abs {figures['max_abs']:.3g} > {max_abs:g}"
    elif min_cosine is not None and not figures["cosine"] >= min_cosine:
        reason = f"cosine {figures['cosine']:.5f} < {min_cosine:g}"
    elif min_sqnr_db is not None and not figures["sqnr_db"] >= min_sqnr_db:
        reason = f"SQNR {figures['sqnr_db']:.1f} dB < {min_sqnr_db:g} dB"
    elif min_top1 is not None and figures["top1"] is not None and not figures["top1"] >= min_top1:
        reason = f"top-1 agreement {figures['top1']:.1%} < {min_top1:.1%}"
    return OutputComparison(name=name, passed=not reason, reason=reason, shape=tuple(np.shape(reference)),
                            max_abs_limit=max_abs, min_cosine=min_cosine, min_sqnr_db=min_sqnr_db,
                            min_top1=min_top1, **figures)


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


def _check_thresholds(max_abs, min_cosine, min_sqnr_db, min_top1) -> None:
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


# --------------------------------------------------------------------------- driver
def compare(reference, candidate, data=None, *, batch_size: int = 16, max_abs: Optional[float] = None,
            min_cosine: Optional[float] = 0.99, min_sqnr_db: Optional[float] = None,
            min_top1: Optional[float] = None, num_samples: Optional[int] = None,
            progress: bool = False) -> Comparison:
    """Run two models in onnxruntime on the same inputs and compare every output by name.

    Args:
        reference, candidate: ``ModelProto`` (not modified) or paths.
        data: inputs as :func:`onnx_qat.load_data` accepts; ``None`` generates
            ``num_samples`` (default 8) random samples with a fixed seed.
        batch_size: samples per onnxruntime run.
        max_abs, min_cosine, min_sqnr_db, min_top1: thresholds (None disables one);
            ``min_top1`` is a fraction (0.99 = 99 %).
        num_samples: use only the first ``num_samples`` samples of ``data``.
        progress: tqdm progress bars on stderr.

    Raises:
        ModelError: the models' inputs or output names differ, or an output's shape differs.
        DataError: the data does not fit the reference model.
    """
    from ..io.data import generate_data, load_data
    from ..io.models import load_model, model_input_specs
    from .sessions import make_session, run_model

    _check_thresholds(max_abs, min_cosine, min_sqnr_db, min_top1)
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
    ref_values = run_model(make_session(ref_model), dataset, batch_size=batch_size, progress=progress)
    cand_values = run_model(make_session(cand_model), dataset, batch_size=batch_size, progress=progress)
    results = []
    for name in ref_out:
        r, c = ref_values[name], cand_values[name]
        if r.shape != c.shape:
            raise ModelError(f"output {name!r} has shape {list(r.shape)} in {ref_label} and {list(c.shape)} "
                             f"in {cand_label}")
        results.append(judge(name, r, c, max_abs=max_abs, min_cosine=min_cosine, min_sqnr_db=min_sqnr_db,
                             min_top1=min_top1))
    return Comparison(tuple(results), dataset.num_samples, ref_label, cand_label)


def _label(source, default: str) -> str:
    return default if not isinstance(source, (str, bytes)) and not hasattr(source, "__fspath__") \
        else f"{default} {source}"


__all__ = ["compare", "Comparison", "OutputComparison", "output_figures", "top1_agreement", "judge"]
