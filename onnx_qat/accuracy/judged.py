"""What the range search of ``min_cosine`` judges its target on: the evaluation data's output cosine,
and a lower confidence bound of the cosine over the evaluation samples and the calibration samples
together.

**Why.** The search stops at the fewest float sites whose output cosine reaches ``min_cosine`` on the
evaluation data, one cosine pooled over all its samples: the samples with the most output energy
decide it, and the search lands just above the minimum on them. With few samples that figure does not
carry over to other inputs of the same kinds. On the PP-OCRv4 text detector searched on 2 photos and
2 pages, the photos' probability maps are empty (no text: a share of the output energy below 1e-3),
so the two pages alone decided: the search stopped at 0.9903 there, and on 2 other photos and 2 other
pages (one photo with text) the model gave 0.9625, below ``auto``'s all-INT8 model (0.9698) it started
from. Its calibration samples, which no trial was chosen by, showed the gap: 0.9850.

**The rule.** A setting reaches ``min_cosine`` when

1. its output cosine on the evaluation data reaches it (the rule before), and
2. a lower bound of the output cosine that a *new* set of inputs of the same kinds, as many as the
   evaluation data holds, would give reaches it too (`Judged.bound`): the cosine pooled over the
   evaluation samples and the first `onnx_qat.accuracy.ranges.CONFIRM_SAMPLES` calibration samples,
   less `EVIDENCE` standard errors of the difference between it and a new set's.

The standard error is the jackknife's over the ``n`` judged samples: with per-sample sums
``a_i = r_i . c_i``, ``b_i = |r_i|^2`` and ``d_i = |c_i|^2`` of one output (reference ``r``, candidate
``c``), the pooled cosine is ``A / sqrt(B D)`` and each leave-one-out cosine ``(A - a_i) / sqrt((B - b_i)
(D - d_i))``; their spread gives ``se = sqrt((n - 1) / n * sum((cos_-i - mean)^2))``, the standard error
of the pooled cosine over ``n`` samples. A new set of ``m`` samples (the evaluation data's count) scatters
``se * sqrt(n / m)`` around the same mean, so the difference has standard error
``se * sqrt(1 + n / m)`` and the bound is ``cosine - EVIDENCE * se * sqrt(1 + n / m)`` (a prediction
bound rather than a confidence bound on the mean: the target is a promise about other inputs). A
sample whose outputs are empty adds nothing to the sums (its cosine alone would be noise), and a
sample far from the others widens the bound. The worst output counts, as everywhere
(`onnx_qat.accuracy.figures`). `EVIDENCE` is ``auto``'s: the standard errors a table's lead must
exceed to be kept (`onnx_qat.calibration.choice.EVIDENCE`).

The calibration samples count because their outputs chose nothing in the search (the candidate ranges
come from their statistics; a range change they do not confirm is not kept). Where the samples cannot
be told apart (a stateful model, unbatched inputs, outputs whose size the sample count does not
divide) that set is left out; with neither set split, the rule is the evaluation cosine alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence

import numpy as np

from ..calibration.choice import EVIDENCE
from .figures import OutputError


@dataclass(frozen=True)
class Judged:
    """The judged figure of one setting (see the module docstring).

    Attributes:
        cosine: the output cosine pooled over every judged sample (worst output).
        bound: ``cosine`` less `EVIDENCE` jackknife standard errors (worst output).
        standard_error: the jackknife standard error of the output whose bound is the lowest.
        samples: the judged samples (evaluation and calibration), ``n``.
        new_samples: the size ``m`` of the new set of inputs the bound is for (the evaluation data's).
    """

    cosine: float
    bound: float
    standard_error: float
    samples: int
    new_samples: int

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"cosine": self.cosine, "bound": self.bound, "standard_error": self.standard_error,
                "samples": self.samples, "new_samples": self.new_samples, "evidence": EVIDENCE}


def sample_sums(reference: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray], samples: int
                ) -> Optional[Dict[str, np.ndarray]]:
    """``{output: [n, 3] array}``: per sample the dot product of reference and candidate and their
    sums of squares (float64), from outputs flattened and joined over ``samples`` samples; None when
    an output's size is not a multiple of ``samples``."""
    if samples <= 0:
        return None
    out = {}
    for name, ref in reference.items():
        if ref.size % samples:
            return None
        r = np.asarray(ref, dtype=np.float64).reshape(samples, -1)
        c = np.asarray(outputs[name], dtype=np.float64).reshape(samples, -1)
        out[name] = np.stack([np.einsum("ij,ij->i", r, c), np.einsum("ij,ij->i", r, r),
                              np.einsum("ij,ij->i", c, c)], axis=1)
    return out


def _cosine(a: np.ndarray, b: np.ndarray, d: np.ndarray) -> np.ndarray:
    norms = np.sqrt(b * d)
    return np.where(norms > 0, a / np.where(norms > 0, norms, 1.0), np.where(b == d, 1.0, 0.0))


def judge_sums(parts: Sequence[Mapping[str, np.ndarray]], new_samples: Optional[int] = None) -> Judged:
    """`Judged` of the per-sample sums ``parts`` (`sample_sums` of each set, the same outputs): the bound
    holds for a new set of ``new_samples`` samples (default: as many as judged)."""
    figures = []
    for name in parts[0]:
        rows = np.concatenate([p[name] for p in parts])
        n = len(rows)
        total = rows.sum(axis=0)
        pooled = float(_cosine(*total))
        se = 0.0
        if n > 1:
            left = _cosine(*(total[None, :] - rows).T)
            se = math.sqrt((n - 1) / n * float(np.sum((left - left.mean()) ** 2)))
        m = new_samples or n
        figures.append(Judged(pooled, pooled - EVIDENCE * se * math.sqrt(1.0 + n / m), se, n, m))
    lowest = min(figures, key=lambda f: f.bound)
    return Judged(min(f.cosine for f in figures), lowest.bound, lowest.standard_error, lowest.samples,
                  lowest.new_samples)


class Judge:
    """The rule of the module docstring for one search: ``confirm`` is the search's
    `onnx_qat.accuracy.ranges.Confirmation` (its calibration samples and its whole runs of the gated
    session)."""

    def __init__(self, prepared, confirm):
        data = prepared.evaluation
        self.prepared, self.confirm = prepared, confirm
        samples = getattr(data, "num_samples", 0)
        self.eval_samples = samples if splittable(data) and all(
            r.size % samples == 0 for r in prepared.reference.values()) else 0
        self.calib_samples = 0
        self._calib = None
        if confirm is not None and confirm.usable and splittable(confirm.data):
            n = confirm.data.num_samples
            if all(r.size % n == 0 for r in confirm.reference.values()):
                self.calib_samples = n
        self.runs = 0
        self.last: Optional[Judged] = None

    @property
    def usable(self) -> bool:
        """Whether any judged sample can be told apart (else the rule is the evaluation cosine)."""
        return self.eval_samples + self.calib_samples > 0

    def judged(self, eval_outputs: Mapping[str, np.ndarray], calib_outputs: Optional[Mapping] = None,
               float_sites: Sequence[int] = (), amax: Optional[Mapping[str, float]] = None) -> Judged:
        """`Judged` of one setting: ``eval_outputs`` on the evaluation data (flattened and joined) and,
        unless ``calib_outputs`` gives them, the calibration samples run with ``float_sites`` float
        under ``amax`` (one whole run of the gated session)."""
        parts = []
        if self.eval_samples:
            parts.append(sample_sums(self.prepared.reference, eval_outputs, self.eval_samples))
        if self.calib_samples:
            if calib_outputs is None:
                from .gated import join_flat

                self.runs += 1
                batches = self.confirm.batch_outputs(float_sites, amax)
                calib_outputs = {name: join_flat(v) for name, v in batches.items()}
            parts.append(sample_sums(self.confirm.reference, calib_outputs, self.calib_samples))
        self.last = judge_sums(parts, self.eval_samples or None)
        return self.last

    def reaches(self, min_cosine: float, error: OutputError, eval_outputs, float_sites=(), amax=None,
                calib_outputs=None) -> bool:
        """Whether a setting reaches ``min_cosine`` by the rule of the module docstring (the calibration
        samples are run only when the evaluation cosine reaches it)."""
        if error.cosine < min_cosine:
            return False
        if not self.usable:
            return True
        return self.judged(eval_outputs, calib_outputs, float_sites, amax).bound >= min_cosine

    def model_outputs(self, session) -> Optional[Dict[str, np.ndarray]]:
        """A built model's outputs on the calibration samples (``session``: its onnxruntime session),
        flattened and joined; None when they are not judged."""
        if not self.calib_samples:
            return None
        from .gated import run_joined

        return run_joined(session, list(self.confirm.reference), self.confirm.feeds)


def splittable(data) -> bool:
    """Whether ``data``'s outputs can be split by sample: batched inputs, no carried state."""
    return bool(getattr(data, "num_samples", 0)) and not getattr(data, "state", None) \
        and not getattr(data, "unbatched", True)


__all__ = ["Judge", "Judged", "judge_sums", "sample_sums", "splittable", "EVIDENCE"]
