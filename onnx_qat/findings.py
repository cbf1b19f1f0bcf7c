"""What a check rule reports: :class:`Finding` and its severities.

Shared by the rule modules (:mod:`onnx_qat.check`, :mod:`onnx_qat.check_formats`), which import it
and never each other's rules back.
"""
from __future__ import annotations

from dataclasses import dataclass

ERROR = "error"
WARNING = "warning"
MODEL_NODE = "(model)"


@dataclass(frozen=True)
class Finding:
    """One problem found by one rule.

    Attributes:
        rule: rule id, ``"C1"`` ... (see :data:`onnx_qat.check.RULES` and the rule table).
        severity: ``"error"`` (TensorRT refuses it or computes something else) or
            ``"warning"`` (it builds, but slower or less accurately than it could).
        node: name of the offending node (``"(model)"`` for model-level findings).
        message: one sentence saying what is wrong and what to do.
    """

    rule: str
    severity: str
    node: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity.upper():7} {self.rule:<4} {self.node}: {self.message}"

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"rule": self.rule, "severity": self.severity, "node": self.node, "message": self.message}


__all__ = ["Finding", "ERROR", "WARNING", "MODEL_NODE"]
