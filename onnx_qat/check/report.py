"""What [`onnx_qat.check`][onnx_qat.check.check] returns: [`CheckReport`][onnx_qat.check.report.CheckReport]
(and its findings).

Part of [`onnx_qat.check`][onnx_qat.check.check], which registers the rules in its one table,
`onnx_qat.check.RULES`; sources are cited as in its docstring."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple


ERROR = "error"
WARNING = "warning"
#: A fact worth knowing that asks for no change (`CheckReport.notes`; never counted as a warning).
NOTE = "note"
MODEL_NODE = "(model)"


# -- results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    """One problem found by one rule.

    Attributes:
        rule: rule id, ``"C1"`` ... (see `RULES` and docs/check-rules.md).
        severity: ``"error"`` (TensorRT refuses it or computes something else),
            ``"warning"`` (it builds, but slower or less accurately than it could) or ``"note"`` (a
            fact worth knowing, no change asked; kept in `CheckReport.notes`, not in ``findings``).
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


@dataclass(frozen=True)
class CheckReport:
    """What [`check`][onnx_qat.check.check] found. ``bool(report)`` is True when there is no error.

    Attributes:
        findings: every finding, ordered by rule id then node order in the graph.
        num_q: number of QuantizeLinear nodes (all graphs, subgraphs included).
        num_dq: number of DequantizeLinear nodes.
        model: the model's path when given one, else ``""``.
        opset: the default-domain opset version (None when the model imports none).
        precision_map: the [`PrecisionMap`][onnx_qat.check.precision.PrecisionMap] (a property): each
            compute node's precision under a strongly typed TensorRT build and the Q/DQ nodes left
            unfused, built on first access (None for reports not made by [`check`][onnx_qat.check.check]).
        notes: findings of severity ``"note"`` (e.g. rule C15 on a model whose float parts are FP32 on
            purpose): printed and in the JSON, never errors or warnings.
    """

    findings: Tuple[Finding, ...] = ()
    num_q: int = 0
    num_dq: int = 0
    model: str = ""
    opset: Optional[int] = None
    #: the PrecisionMap, or a function building it on first access (see
    #: [`precision_map`][onnx_qat.check.report.CheckReport.precision_map])
    precision_source: Optional[object] = field(default=None, compare=False, repr=False)
    notes: Tuple[Finding, ...] = ()

    @property
    def precision_map(self):
        """The [`PrecisionMap`][onnx_qat.check.precision.PrecisionMap], built on first access (then kept)."""
        source = self.precision_source
        if callable(source):
            source = source()
            object.__setattr__(self, "precision_source", source)
        return source

    @property
    def errors(self) -> Tuple[Finding, ...]:
        """Findings of severity ``"error"``."""
        return tuple(f for f in self.findings if f.severity == ERROR)

    @property
    def warnings(self) -> Tuple[Finding, ...]:
        """Findings of severity ``"warning"``."""
        return tuple(f for f in self.findings if f.severity == WARNING)

    @property
    def passed(self) -> bool:
        """True when there is no error (warnings allowed)."""
        return not self.errors

    def __bool__(self) -> bool:
        return self.passed

    @property
    def quantized(self) -> bool:
        """True when the model has at least one QuantizeLinear or DequantizeLinear node (rule C13)."""
        return bool(self.num_q or self.num_dq)

    def rules(self) -> Tuple[str, ...]:
        """The ids of the rules that found something (sorted, unique)."""
        return tuple(sorted({f.rule for f in self.findings}, key=_rule_key))

    def summary(self) -> str:
        """One line: verdict, counts of errors/warnings, counts of Q and DQ nodes. The verdict is
        ``PASSED``, ``FAILED`` (an error), or ``NOT QUANTIZED`` for a model without any Q/DQ node
        and no error (exit code 0 like ``PASSED``: rule C13 is a warning)."""
        verdict = "FAILED" if not self.passed else "PASSED" if self.quantized else "NOT QUANTIZED"
        where = f" | {self.model}" if self.model else ""
        n_err, n_warn = len(self.errors), len(self.warnings)
        return (f"{verdict}{where} | {n_err} error{'s' if n_err != 1 else ''}, "
                f"{n_warn} warning{'s' if n_warn != 1 else ''} | "
                f"{self.num_q} QuantizeLinear, {self.num_dq} DequantizeLinear")

    def __str__(self) -> str:
        return "\n".join([str(f) for f in self.findings + self.notes] + [self.summary()])

    def to_dict(self) -> dict:
        """JSON-ready form (what ``onnx-qat check --json`` prints)."""
        return {
            "passed": self.passed,
            "model": self.model,
            "opset": self.opset,
            "num_q": self.num_q,
            "num_dq": self.num_dq,
            "quantized": self.quantized,
            "num_errors": len(self.errors),
            "num_warnings": len(self.warnings),
            "findings": [f.to_dict() for f in self.findings],
            "notes": [f.to_dict() for f in self.notes],
        }


def _rule_key(rule: str):
    return (len(rule), rule)
