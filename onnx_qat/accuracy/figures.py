"""How far a model's outputs are from the float model's: `OutputError` (the worst cosine, SQNR and max
abs over the outputs) and `output_error`, which every accuracy tool and every worker computes the same
way."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np


@dataclass(frozen=True)
class OutputError:
    """How far a model's outputs are from the float model's, over the evaluation data.

    The worst output counts: the smallest cosine, the smallest SQNR (dB), the largest max abs.
    """

    cosine: float
    sqnr_db: float
    max_abs: float

    def value(self, metric: str) -> float:
        """The figure ``metric`` names (``cosine``, ``sqnr`` or ``max_abs``)."""
        return {"cosine": self.cosine, "sqnr": self.sqnr_db, "max_abs": self.max_abs}[metric]

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"cosine": self.cosine, "sqnr_db": self.sqnr_db, "max_abs": self.max_abs}

    def __str__(self) -> str:
        return f"cosine {self.cosine:.5f}, SQNR {self.sqnr_db:.1f} dB, max abs {self.max_abs:.3g}"


def output_error(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]) -> OutputError:
    """The worst cosine, SQNR and max abs over the float outputs of two runs (flattened arrays)."""
    cos, sqnr, mabs = 1.0, math.inf, 0.0
    for name, ref in reference.items():
        r = ref.astype(np.float64, copy=False)
        c = np.array(candidate[name], dtype=np.float64)  # a copy of our own: the difference goes in place
        signal, cc, rc = float(r @ r), float(c @ c), float(r @ c)
        diff = np.subtract(r, c, out=c)
        noise = float(diff @ diff)
        norms = math.sqrt(signal * cc)
        cos = min(cos, rc / norms if norms else (1.0 if noise == 0 else 0.0))
        sqnr = min(sqnr, math.inf if noise == 0 else (-math.inf if signal == 0
                                                          else 10 * math.log10(signal / noise)))
        mabs = max(mabs, max(float(diff.max()), -float(diff.min())) if diff.size else 0.0)
    return OutputError(cos, sqnr, mabs)


__all__ = ["OutputError", "output_error"]
