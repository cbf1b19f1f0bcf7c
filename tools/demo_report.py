"""The demo's results, its PNG plots (matplotlib, Agg backend) and its Markdown report.

No TensorFlow here: `DemoResults` holds plain numbers, so the report can be
written (and tested) from any figures. `write_report` writes ``report.md``,
``results.json`` and the PNGs into one folder, each file atomically.
"""
from __future__ import annotations

import io
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from onnx_qat.io.files import atomic_write_bytes, atomic_write_text, write_json

#: Display names of the three models, in report order.
MODEL_LABELS = {"float": "float (FP32)", "ptq": "PTQ INT8", "qat": "QAT INT8",
                "qat_cpu": "QAT INT8 ort-cpu"}
COLORS = {"float": "#4c72b0", "ptq": "#dd8452", "qat": "#55a868", "qat_cpu": "#8172b2"}
PLOTS = {
    "accuracy": "accuracy.png",
    "latency": "latency.png",
    "layer_error": "layer_error.png",
    "activation_ranges": "activation_ranges.png",
    "confusion": "confusion_qat.png",
    "training": "training.png",
}
#: The sensitivity chart (written when the results hold a sensitivity analysis).
SENSITIVITY_PLOT = "sensitivity.png"


# =========================================================================== results
@dataclass(frozen=True)
class LatencyResult:
    """onnxruntime CPU latency of one model at one batch size.

    Attributes:
        model: ``"float"``, ``"ptq"``, ``"qat"`` or ``"qat_cpu"`` (the QAT model in the ort-cpu form).
        batch: samples per run.
        median_ms / p10_ms / p90_ms: per-run latency over the interleaved rounds.
        rounds: interleaved rounds; runs_per_round: runs averaged within one round.
        threads: intra-op threads (None: onnxruntime's default).
    """

    model: str
    batch: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    rounds: int
    runs_per_round: int
    threads: Optional[int] = None


@dataclass(frozen=True)
class Criterion:
    """One promise of the demo, checked: ``PASS``/``FAIL`` (``INFO`` when not gating)."""

    name: str
    measured: str
    target: str
    passed: bool
    gating: bool = True

    @property
    def verdict(self) -> str:
        """``PASS``, ``FAIL`` or ``INFO`` (a non-gating line that missed its target)."""
        if self.passed:
            return "PASS"
        return "FAIL" if self.gating else "INFO"

    def __str__(self) -> str:
        return f"{self.verdict:4}  {self.name}: {self.measured} (target: {self.target})"


@dataclass(frozen=True)
class DemoResults:
    """Everything the report shows. Accuracies are percentages on the test split.

    Attributes:
        meta: date, machine, versions, options, stage timings.
        dataset: split sizes, image shape, classes.
        onnx_accuracy: ``{"float"|"ptq"|"qat"|"qat_cpu": %}`` measured in onnxruntime on the exported
            models (``qat_cpu``: the QAT export in the ort-cpu form).
        keras_accuracy: the same models in Keras (float, fake-quantized PTQ and QAT).
        latency: one `LatencyResult` per model and batch size.
        checks: ``{"ptq"|"qat": onnx_qat.check report as dict, plus "summary"}``.
        parity: ``{"ptq"|"qat": figures from the export report, plus "summary" and "passed"}``.
        layer_error: ``{"ptq"|"qat": ((layer, SQNR dB), ...)}`` against each model's float twin.
        activation_amax: ``{"ptq"|"qat": ((quantizer, amax), ...)}``.
        confusion: QAT INT8 confusion matrix (rows: true class, columns: predicted), onnxruntime.
        history: ``{"float"|"qat": {"accuracy": [...], "val_accuracy": [...], ...}}``.
        criteria: the promises, checked.
        files: ``{what: path relative to the report folder}``.
        notes: extra sentences for the report (e.g. why an INT8 model is slow on CPU).
        sensitivity: [`onnx_qat.sensitivity`][onnx_qat.accuracy.sensitivity.sensitivity] of the float model (a
            ``SensitivityResult``), or None.
    """

    meta: Mapping[str, object]
    dataset: Mapping[str, object]
    onnx_accuracy: Mapping[str, float]
    keras_accuracy: Mapping[str, float]
    latency: Tuple[LatencyResult, ...]
    checks: Mapping[str, Mapping]
    parity: Mapping[str, Mapping]
    layer_error: Mapping[str, Tuple[Tuple[str, float], ...]]
    activation_amax: Mapping[str, Tuple[Tuple[str, float], ...]]
    confusion: np.ndarray = field(repr=False)
    history: Mapping[str, Mapping[str, Sequence[float]]]
    criteria: Tuple[Criterion, ...]
    files: Mapping[str, str]
    notes: Tuple[str, ...] = ()
    sensitivity: Optional[object] = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        """True when every gating criterion passed."""
        return all(c.passed for c in self.criteria if c.gating)

    def to_dict(self) -> dict:
        """JSON-ready form (what ``results.json`` holds)."""
        return {
            "meta": _jsonable(self.meta), "dataset": _jsonable(self.dataset),
            "onnx_accuracy": dict(self.onnx_accuracy), "keras_accuracy": dict(self.keras_accuracy),
            "latency": [asdict(r) for r in self.latency], "checks": _jsonable(self.checks),
            "parity": _jsonable(self.parity),
            "layer_error": _jsonable(self.layer_error), "activation_amax": _jsonable(self.activation_amax),
            "confusion_qat": self.confusion.tolist(), "history": _jsonable(self.history),
            "criteria": [dict(asdict(c), verdict=c.verdict) for c in self.criteria],
            "passed": self.passed, "files": dict(self.files), "notes": list(self.notes),
            **({} if self.sensitivity is None else {"sensitivity": _jsonable(self.sensitivity.to_dict())}),
        }


def _jsonable(obj):
    """Mappings, sequences, NumPy scalars and paths as plain JSON values (non-finite floats as None)."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, (np.floating, float)):
        return float(obj) if math.isfinite(float(obj)) else None
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    return str(obj)


# =========================================================================== plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    return buf.getvalue()


def plot_accuracy(results: DemoResults) -> bytes:
    """Bars: test accuracy of float / PTQ / QAT in onnxruntime, Keras figures as markers."""
    plt = _pyplot()
    keys = [k for k in MODEL_LABELS if k in results.onnx_accuracy]
    values = [results.onnx_accuracy[k] for k in keys]
    low = max(0.0, math.floor(min(values + [results.keras_accuracy.get(k, 100.0) for k in keys]) - 3.0))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    bars = ax.bar([MODEL_LABELS[k] for k in keys], values, color=[COLORS[k] for k in keys], width=0.6,
                  label="onnxruntime (exported ONNX)")
    for bar, value in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, value + 0.1, f"{value:.2f}%", ha="center", va="bottom",
                fontsize=11, fontweight="bold")
    kx = [i for i, k in enumerate(keys) if k in results.keras_accuracy]
    ax.plot(kx, [results.keras_accuracy[keys[i]] for i in kx], "k_", markersize=40, markeredgewidth=2)
    from matplotlib.lines import Line2D

    handles = [bars, Line2D([], [], color="k", linewidth=2, label="Keras (same model, before export)")]
    ax.set_ylim(low, 100.0 + (100.0 - low) * 0.05)
    ax.set_ylabel(f"test accuracy, % (axis starts at {low:.0f}%)")
    ax.set_title(f"Digits test accuracy ({results.dataset.get('test', '?')} images)")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2, fontsize=9,
              frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def plot_latency(results: DemoResults) -> bytes:
    """Grouped bars: median onnxruntime CPU latency per batch size, with p10-p90 whiskers."""
    plt = _pyplot()
    batches = sorted({r.batch for r in results.latency})
    keys = [k for k in MODEL_LABELS if any(r.model == k for r in results.latency)]
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.8), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = {r.model: r for r in results.latency if r.batch == batch}
        med = [rows[k].median_ms for k in keys]
        err = [[rows[k].median_ms - rows[k].p10_ms for k in keys],
               [rows[k].p90_ms - rows[k].median_ms for k in keys]]
        bars = ax.bar([MODEL_LABELS[k] for k in keys], med, yerr=err, capsize=4,
                      color=[COLORS[k] for k in keys], error_kw={"elinewidth": 1, "ecolor": "0.35"})
        for bar, value in zip(bars, med):
            ax.text(bar.get_x() + bar.get_width() / 2, value / 2, f"{value:.3g}\nms", ha="center",
                    va="center", fontsize=10, fontweight="bold", color="white")
        ax.set_title(f"batch {batch}")
        ax.set_ylabel("median latency per run, ms")
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=9)
    fig.suptitle("onnxruntime CPU latency (whiskers: p10-p90). "
                 "INT8 = TensorRT Q/DQ form, not a CPU-tuned format", fontsize=10)
    fig.tight_layout()
    return _png(fig)


def _paired_barh(ax, series: Mapping[str, Sequence[Tuple[str, float]]], xlabel: str, fmt: str) -> None:
    names: List[str] = []
    for pairs in series.values():
        names.extend(n for n, _ in pairs if n not in names)
    y = np.arange(len(names))
    height = 0.8 / max(1, len(series))
    for i, (key, pairs) in enumerate(series.items()):
        lookup = dict(pairs)
        vals = [lookup.get(n, np.nan) for n in names]
        pos = y - 0.4 + height * (i + 0.5)
        ax.barh(pos, [v if np.isfinite(v) else 0.0 for v in vals], height=height, color=COLORS[key],
                label=MODEL_LABELS[key])
        for p, v in zip(pos, vals):
            if np.isfinite(v):
                ax.text(v, p, " " + format(v, fmt), va="center", fontsize=8)
            elif v == np.inf:
                ax.text(0, p, " identical (no error)", va="center", fontsize=8)
    ax.set_yticks(y, names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=9, loc="lower right")
    ax.grid(axis="x", alpha=0.3)


def plot_layer_error(results: DemoResults) -> bytes:
    """Horizontal bars: SQNR (dB) of each weighted op's output, Q/DQ model vs its float twin."""
    plt = _pyplot()
    n = max((len(v) for v in results.layer_error.values()), default=1)
    fig, ax = plt.subplots(figsize=(7.0, 1.2 + 0.55 * n))
    _paired_barh(ax, results.layer_error, "SQNR of the layer output vs float twin, dB (higher is better)",
                 ".1f")
    ax.set_xlim(0, max((v for pairs in results.layer_error.values() for _, v in pairs if np.isfinite(v)),
                       default=1.0) * 1.18)
    ax.set_title("Per-layer quantization error in onnxruntime (test split)")
    return _png(fig)


def plot_activation_ranges(results: DemoResults) -> bytes:
    """Horizontal bars: activation amax per quantizer after calibration (PTQ) and after QAT."""
    plt = _pyplot()
    n = max((len(v) for v in results.activation_amax.values()), default=1)
    fig, ax = plt.subplots(figsize=(7.0, 1.2 + 0.55 * n))
    _paired_barh(ax, results.activation_amax, "amax (INT8 scale = amax / 127)", ".3g")
    top = max((v for pairs in results.activation_amax.values() for _, v in pairs), default=1.0)
    ax.set_xlim(0, top * 1.2)
    ax.set_title("Activation ranges: calibrated (PTQ) and after QAT fine-tune")
    return _png(fig)


def plot_confusion(results: DemoResults) -> bytes:
    """The QAT INT8 confusion matrix (onnxruntime, test split) with counts in the cells."""
    plt = _pyplot()
    cm = np.asarray(results.confusion)
    fig, ax = plt.subplots(figsize=(5.6, 5.0))
    ax.imshow(cm, cmap="Blues")
    top = cm.max() if cm.size else 1
    for (i, j), v in np.ndenumerate(cm):
        if v:
            ax.text(j, i, str(v), ha="center", va="center", fontsize=9,
                    color="white" if v > top / 2 else "black")
    ticks = np.arange(cm.shape[0])
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set_xlabel("predicted digit")
    ax.set_ylabel("true digit")
    ax.set_title(f"QAT INT8 in onnxruntime: {int(np.trace(cm))}/{int(cm.sum())} correct")
    return _png(fig)


def plot_training(results: DemoResults) -> bytes:
    """Validation accuracy per epoch: float training, then the QAT fine-tune."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    start = 1
    for key in ("float", "qat"):
        if key == "qat" and start > 1:
            ax.axvline(start - 0.5, color="0.5", linestyle=":", linewidth=1)
            ax.text(start - 0.7, 0.5, "QAT fine-tune", transform=ax.get_xaxis_transform(), fontsize=8,
                    color="0.3", rotation=90, ha="right", va="center")
        hist = results.history.get(key, {})
        name = MODEL_LABELS[key] if key == "qat" else "float"
        for metric, style in (("accuracy", "--"), ("val_accuracy", "-")):
            vals = [100.0 * v for v in hist.get(metric, [])]
            if vals:
                ax.plot(range(start, start + len(vals)), vals, style, marker="o", markersize=3,
                        color=COLORS[key], label=f"{name} {metric.replace('_', ' ')}")
        start += len(hist.get("val_accuracy", []))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch (float training, then QAT fine-tune)")
    ax.set_ylabel("accuracy, %")
    ax.set_title("Training (train: dashed, validation: solid)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower center")
    return _png(fig)


PLOTTERS = {
    "accuracy": plot_accuracy, "latency": plot_latency, "layer_error": plot_layer_error,
    "activation_ranges": plot_activation_ranges, "confusion": plot_confusion, "training": plot_training,
}


# =========================================================================== markdown
def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _fmt_pct(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}%"


def _fmt_num(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _times100(value: Optional[float]) -> Optional[float]:
    return None if value is None else 100.0 * float(value)


def _section_header(results: DemoResults) -> List[str]:
    m = results.meta
    d = results.dataset
    return [
        "# onnx-qat demo: PTQ and QAT on the digits data set, exported to TensorRT-ready Q/DQ ONNX", "",
        f"- Date: {m.get('date', '?')} | run time {m.get('total_s', float('nan')):.0f} s"
        f"{' | quick mode (short training)' if m.get('quick') else ''}",
        f"- Machine: {m.get('machine', '?')}",
        f"- Stack: {m.get('versions', '?')}",
        f"- Data: scikit-learn's bundled digits, {d.get('shape', '?')} images, "
        f"{d.get('classes', '?')} classes; "
        f"stratified split train {d.get('train', '?')} / validation {d.get('validation', '?')} / "
        f"test {d.get('test', '?')} (seed {m.get('seed', '?')})",
        f"- Model: {m.get('model', '?')}",
        f"- Training: float {m.get('epochs', '?')} epochs; PTQ = `quantize_model` + `calibrate` (max) on the "
        f"training split; QAT = the same + {m.get('qat_epochs', '?')} fine-tune epoch(s) at learning rate "
        f"{m.get('qat_learning_rate', '?')}", "",
    ]


def _section_summary(results: DemoResults) -> List[str]:
    verdict = "all promises kept" if results.passed else "a promise was MISSED"
    lines = ["## Summary", "", f"**{verdict}**", "", "```"]
    lines += [str(c) for c in results.criteria]
    return lines + ["```", ""]


def _section_accuracy(results: DemoResults) -> List[str]:
    rows = []
    for key, label in MODEL_LABELS.items():
        if key in results.onnx_accuracy:
            path = results.files.get(key + "_onnx", "?")
            rows.append((label, _fmt_pct(results.onnx_accuracy[key]),
                         _fmt_pct(results.keras_accuracy.get(key)), f"`{path}`"))
    return ["## Accuracy (test split)", "",
            "Measured in onnxruntime on the exported ONNX files; the Keras column is the same model before "
            "export (fake-quantized for PTQ and QAT).", "",
            *_table(("model", "onnxruntime", "Keras", "ONNX file"), rows), "",
            f"![Test accuracy]({PLOTS['accuracy']})", ""]


def _section_check(results: DemoResults) -> List[str]:
    lines = ["## TensorRT readiness (`onnx_qat.check`)", ""]
    for key in ("ptq", "qat", "qat_cpu"):
        rep = results.checks.get(key)
        if rep is None:
            continue
        rules = (" (the rules of the ort-cpu form: `check(model, target=\"ort-cpu\")`)"
                 if key == "qat_cpu" else "")
        lines.append(f"- **{MODEL_LABELS[key]}**{rules}: `{rep.get('summary', '')}`")
        for f in rep.get("findings", []):
            lines.append(f"  - {f.get('severity', '').upper()} {f.get('rule', '')} {f.get('node', '')}: "
                         f"{f.get('message', '')}")
    return lines + [""]


def _section_parity(results: DemoResults) -> List[str]:
    lines = ["## Export parity (onnxruntime Q/DQ model vs the Keras QAT model)", "",
             "Reported by `tf_bridge.export_onnx` on the validation split: the exported Q/DQ model must be "
             "much closer to the Keras model it came from than to the float model.", ""]
    rows = []
    with_tf = any("max_abs_tf" in o and o["max_abs_tf"] != o.get("max_abs_qdq")
                  for p in results.parity.values() for o in p.get("outputs", []))
    for key in ("ptq", "qat"):
        par = results.parity.get(key)
        if par is None:
            continue
        for o in par.get("outputs", []):
            tf_col = (_fmt_num(o.get("max_abs_tf")),) if with_tf else ()
            rows.append((MODEL_LABELS[key], o.get("name"), _fmt_num(o.get("max_abs_qdq")),
                         _fmt_num(o.get("max_abs_float")), _fmt_pct(_times100(o.get("ratio"))), *tf_col,
                         _fmt_pct(_times100(o.get("top1"))), "PASSED" if o.get("passed") else "FAILED"))
        if not par.get("outputs"):
            lines.append(f"- **{MODEL_LABELS[key]}**: `{par.get('summary', '')}`")
            lines += [f"  - {name}: {value}" for name, value in par.get("figures", {}).items()]
    if rows:
        figs = next(iter(results.parity.values())).get("figures", {})
        tf_head = ("max abs Q/DQ vs Keras in TensorFlow",) if with_tf else ()
        lines += _table(("model", "output", "max abs Q/DQ vs Keras", "max abs float vs Keras", "ratio",
                         *tf_head, "top-1 agreement", "verdict"), rows)
        if with_tf:
            lines += ["", "Where the two Keras columns differ, the export compared against the Keras QAT "
                      "model run in onnxruntime (its own converted graph, so both sides round convolution "
                      "sums alike) after the comparison with the model run in TensorFlow missed the limit: "
                      "a value on a rounding boundary in one engine and not the other moves by one "
                      "quantization step (see `tf_bridge.export_onnx`)."]
        lines += ["", "The export's own verdict lines:", ""]
        lines += [f"- {MODEL_LABELS[k]}: `{p.get('summary', '')}`" for k, p in results.parity.items()
                  if k in MODEL_LABELS]
        lines += ["", f"Samples: {figs.get('samples', '?')} (validation split); limits: ratio <= "
                  f"{_fmt_pct(_times100(figs.get('ratio_limit')))}, top-1 agreement >= "
                  f"{_fmt_pct(_times100(figs.get('top1_limit')))}."]
    mapping = results.parity.get("qat", {}).get("mapping", "")
    if mapping:
        lines += ["", "How the export mapped each Keras quantizer to its ONNX tensor (QAT model; the fold "
                  "factor is the BatchNormalization scale |gamma / sqrt(var + eps)| that multiplies the "
                  "per-channel weight amax):", "", "```", *mapping.splitlines(), "```"]
    return lines + [""]


def _section_latency(results: DemoResults) -> List[str]:
    rows = []
    base = {r.batch: r.median_ms for r in results.latency if r.model == "float"}
    for r in results.latency:
        rel = f"{r.median_ms / base[r.batch]:.2f}x" if r.batch in base and base[r.batch] > 0 else "n/a"
        rows.append((MODEL_LABELS.get(r.model, r.model), r.batch, f"{r.median_ms:.3f}", f"{r.p10_ms:.3f}",
                     f"{r.p90_ms:.3f}", rel, f"{r.rounds} x {r.runs_per_round}"))
    threads = results.latency[0].threads if results.latency else None
    return ["## onnxruntime CPU latency", "",
            f"Median per run over interleaved rounds (every round times each model in turn), CPU execution "
            f"provider, intra-op threads: {'onnxruntime default' if threads is None else threads}. "
            "The p10-p90 spread shows how steady the machine was during the run.", "",
            *_table(("model", "batch", "median ms", "p10 ms", "p90 ms", "vs FP32", "rounds x runs"), rows),
            "",
            *[f"> {note}" for note in results.notes], "" if results.notes else "",
            f"![Latency]({PLOTS['latency']})", ""]


def _section_layers(results: DemoResults) -> List[str]:
    return ["## Per-layer quantization error", "",
            "SQNR (signal-to-quantization-noise ratio, dB) of each weighted op's output in the Q/DQ model "
            "against the same tensor in that model's float twin, on the test split. Errors accumulate with "
            "depth; every 6 dB is one bit.", "",
            f"![Per-layer error]({PLOTS['layer_error']})", "",
            "Activation ranges (amax) of each activation quantizer: after calibration (PTQ) and after the "
            "QAT fine-tune (moving-average updates during training).", "",
            f"![Activation ranges]({PLOTS['activation_ranges']})", ""]


def _section_sensitivity(results: DemoResults) -> List[str]:
    sens = results.sensitivity
    if sens is None:
        return []
    rows = [(s.rank, f"`{s.name}`", s.site.op_type, s.site.kind, f"{s.only.cosine:.5f}",
             f"{s.all_but.cosine:.5f}") for s in sens.top(5)]
    return ["## Quantization sensitivity (float model, `onnx_qat.sensitivity`)", "",
            f"Every site placement quantizes, measured on {sens.num_eval_samples} validation samples: the "
            f"output cosine against FP32 with only that site in INT8, and with every site but it in INT8 "
            f"(all sites INT8: cosine {sens.all_int8.cosine:.5f}; {sens.runs} runs, {sens.seconds:.1f} s). "
            "The most sensitive sites are the first to leave in float "
            "(`onnx-qat quantize --min-cosine`).", "",
            *_table(("rank", "site", "op", "kind", "only this site INT8", "all but this site INT8"), rows),
            "", f"![Sensitivity]({SENSITIVITY_PLOT})", ""]


def _section_rest(results: DemoResults) -> List[str]:
    timings = results.meta.get("timings", {})
    files = [f"- {what}: `{path}`" for what, path in results.files.items()]
    return ["## Confusion matrix (QAT INT8, onnxruntime)", "",
            f"![Confusion matrix]({PLOTS['confusion']})", "",
            "## Training", "", f"![Training curves]({PLOTS['training']})", "",
            "## Stage timings", "",
            *_table(("stage", "seconds"), [(k, f"{v:.1f}") for k, v in timings.items()]), "",
            "## Files", "", *files, "",
            "Reproduce: `make demo` (or `.venv/bin/python tools/demo.py --help` for the options).",
            *_cli_sentence(results), ""]


def _cli_sentence(results: DemoResults) -> List[str]:
    """Whether ``onnx-qat quantize <float> --scales <json>`` re-makes the QAT model (the export says)."""
    flag = results.parity.get("qat", {}).get("cli_reproducible")
    if flag is None:
        return []
    if flag:
        twin = results.files.get("qat_float_twin_onnx", "<float.onnx>")
        scales = results.files.get("qat_scales", "<scales.json>")
        return [f"`onnx-qat quantize {twin} --scales {scales}` re-makes the QAT Q/DQ model from its float "
                "twin and its ScaleTable."]
    return ["The export used the Keras placement, which differs from `onnx-qat quantize`'s default one, so "
            "the ScaleTable alone does not re-make the Q/DQ model with the CLI."]


def render_markdown(results: DemoResults) -> str:
    """The whole ``report.md`` text."""
    parts = (_section_header, _section_summary, _section_accuracy, _section_check, _section_parity,
             _section_latency, _section_layers, _section_sensitivity, _section_rest)
    return "\n".join(line for part in parts for line in part(results))


def write_report(out_dir, results: DemoResults) -> Dict[str, Path]:
    """Write the PNG plots, ``report.md`` and ``results.json`` into ``out_dir`` (atomically, file by file).

    Returns ``{"report": path, "results": path, <plot name>: path, ...}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: Dict[str, Path] = {}
    for name, plotter in PLOTTERS.items():
        written[name] = atomic_write_bytes(out / PLOTS[name], plotter(results))
    if results.sensitivity is not None:
        results.sensitivity.plot(out / SENSITIVITY_PLOT, top=12)
        written["sensitivity"] = out / SENSITIVITY_PLOT
    written["results"] = write_json(out / "results.json", results.to_dict())
    written["report"] = atomic_write_text(out / "report.md", render_markdown(results))
    return written
