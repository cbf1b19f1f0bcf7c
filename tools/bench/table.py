"""Benchmark rows: one measured ratio next to its goal, and the results files (Markdown + JSON).

Every figure is a ratio of two measurements taken in the same run on the same machine, so
shared, noisy machines still give comparable numbers. A row's status is ``PASS`` (goal met),
``BAR`` (the minimum bar met, the goal not), ``MISS`` (neither), ``INFO`` (no goal) or
``SKIP`` (not measured, with the reason in its detail). A row that carries the confidence interval of
its value (``interval``, e.g. of the median of paired per-round ratios) is ``PASS`` only when the
whole interval meets the goal, ``TIE`` when the interval holds the goal's target (within the noise
measured in the same run: the run cannot tell the two sides apart), and ``BAR``/``MISS`` by its value
otherwise.
"""
from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Tuple

RESULTS_FORMAT = "onnx-qat-bench"
RESULTS_VERSION = 1


@dataclass(frozen=True)
class Goal:
    """``value <op> target`` is the goal, ``value <op> bar`` the minimum bar (``op`` is ``<=`` or ``>=``)."""

    op: str
    target: float
    bar: Optional[float] = None

    def met(self, value: float, limit: float) -> bool:
        return value <= limit if self.op == "<=" else value >= limit

    def status(self, value: float) -> str:
        if self.met(value, self.target):
            return "PASS"
        if self.bar is not None and self.met(value, self.bar):
            return "BAR"
        return "MISS"

    def __str__(self) -> str:
        bar = "" if self.bar is None else f" (bar {self.op} {self.bar:g})"
        return f"{self.op} {self.target:g}{bar}"


@dataclass(frozen=True)
class Row:
    """One figure: ``value`` (a ratio unless ``unit`` says otherwise), its goal, how it was measured."""

    bench: str
    figure: str
    value: Optional[float]
    goal: Optional[Goal] = None
    detail: str = ""
    unit: str = "x"
    #: ``(low, high)``: the value's confidence interval measured in the same run, or None.
    interval: Optional[Tuple[float, float]] = None

    @property
    def status(self) -> str:
        if self.value is None or not math.isfinite(self.value):
            return "SKIP"
        if self.goal is None:
            return "INFO"
        if self.interval is not None:
            low, high = self.interval
            if low <= self.goal.target <= high and low < high:
                return "TIE"
        return self.goal.status(self.value)

    def measured(self) -> str:
        if self.value is None:
            return "-"
        joiner = "" if self.unit in ("x", "s", "%") else " "
        return f"{self.value:.3g}{joiner}{self.unit}"

    def to_dict(self) -> dict:
        value = self.value if self.value is not None and math.isfinite(self.value) else None
        return {"bench": self.bench, "figure": self.figure, "value": value, "unit": self.unit,
                "goal": None if self.goal is None else {"op": self.goal.op, "target": self.goal.target,
                                                        "bar": self.goal.bar},
                "status": self.status, "detail": self.detail,
                **({} if self.interval is None else {"interval": [float(v) for v in self.interval]})}


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN when the denominator is not positive (a SKIP row)."""
    return numerator / denominator if denominator > 0 else float("nan")


def skip(bench: str, figure: str, why: str) -> Row:
    """A row that could not be measured, saying why."""
    return Row(bench, figure, None, None, why)


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table of ``rows``: benchmark, figure, measured, goal, status, detail."""
    lines = ["| benchmark | figure | measured | goal | status | detail |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        goal = "-" if r.goal is None else str(r.goal)
        detail = r.detail.replace("|", "/")
        lines.append(f"| {r.bench} | {r.figure} | {r.measured()} | {goal} | {r.status} | {detail} |")
    return "\n".join(lines)


def machine() -> dict:
    """The machine the figures were measured on."""
    import os

    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as handle:
            text = handle.read()
        names = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")]
        info["cpu"] = names[0] if names else "?"
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
        info["int8_dot_product"] = "vnni" if "vnni" in flags else ("avx2" if "avx2" in flags else "none")
    except OSError:
        pass
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return info


def write_results(rows: Iterable[Row], out_dir, *, command: str, quick: bool, seconds: float) -> Path:
    """Write ``results.md`` and ``results.json`` under ``out_dir`` atomically; returns the Markdown path."""
    from onnx_qat.io.files import atomic_write_text, write_json

    rows = list(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    doc = {"format": RESULTS_FORMAT, "version": RESULTS_VERSION, "command": command, "quick": quick,
           "seconds": round(seconds, 1), "machine": info, "rows": [r.to_dict() for r in rows]}
    write_json(out / "results.json", json.loads(json.dumps(doc)))
    head = [f"# onnx-qat benchmarks{' (quick)' if quick else ''}", "",
            f"Command: `{command}` ({seconds:.0f} s). Machine: {info.get('cpus')} CPUs, "
            f"{info.get('cpu', '?')}, int8 dot product: {info.get('int8_dot_product', '?')}; "
            f"onnxruntime {info.get('onnxruntime', '?')}.", "",
            "Every figure is a ratio of two measurements from the same run.", ""]
    return atomic_write_text(out / "results.md", "\n".join(head) + "\n" + format_table(rows) + "\n")
