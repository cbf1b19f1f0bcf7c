#!/usr/bin/env python3
"""The main job (``make demo``): train, quantize (PTQ and QAT), export and report on real data.

    python tools/demo.py [--out demo_report] [--epochs 20] [--qat-epochs 3] [--quick]

Steps, each printed as a stage line with its time:

1. data     — scikit-learn's bundled digits (1797 8x8 images, no download), a fixed,
   stratified train / validation / test split.
2. float    — a small Keras CNN with a residual block (Conv2D+BatchNormalization+ReLU,
   a residual Add, max pooling, global average pooling, Dense) trained from fixed seeds.
3. PTQ      — [`tf_bridge.quantize_model`][] + [`tf_bridge.calibrate`][tf_bridge.calibrate.calibrate] only.
4. QAT      — the same, then a short fine-tune with ``fit``.
5. export   — [`tf_bridge.export_onnx`][] for both (Q/DQ ONNX, ScaleTable JSON, float ONNX).
6. measure  — accuracy of the float, PTQ and QAT models in onnxruntime on the test split,
   onnxruntime CPU latency FP32 vs INT8 (median of interleaved runs), per-layer
   quantization error (SQNR of each weighted op's output against the float twin).
7. report   — ``<out>/report.md`` with PNG plots, ``<out>/results.json`` and the models.

The summary ends with PASS/FAIL lines for what the demo promises (QAT INT8 accuracy
within 1 point of float, both Q/DQ models pass ``onnx_qat.check``, export parity, run
time under 5 minutes). Exit codes: 0 all promises kept; 1 a promise missed; 2 bad
option or input; 3 internal error; 130 interrupted. With ``--quick`` (short training,
used by the tests) the accuracy and run-time lines are shown but do not set the exit code.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

from onnx_qat.errors import ConfigError, QatError  # noqa: E402
from tools import demo_report as report  # noqa: E402

PROG = "demo.py"
EXIT_OK, EXIT_PROMISE_MISSED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
CLASSES = 10
MAX_ACCURACY_DROP_POINTS = 1.0
TIME_BUDGET_S = 300.0

logger = logging.getLogger("tools.demo")


# =========================================================================== options
@dataclass(frozen=True)
class DemoOptions:
    """Every command-line option, validated (see `get_parser` for their meaning)."""

    out: Path = Path("demo_report")
    epochs: int = 20
    qat_epochs: int = 3
    batch_size: int = 32
    learning_rate: float = 2e-3
    qat_learning_rate: float = 1e-4
    seed: int = 0
    latency_rounds: int = 30
    latency_batches: Tuple[int, ...] = (1, 64)
    threads: Optional[int] = 1
    quick: bool = False
    progress: bool = True

    def __post_init__(self):
        for name in ("epochs", "qat_epochs", "batch_size", "latency_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}")
        for name in ("learning_rate", "qat_learning_rate"):
            if not 0.0 < float(getattr(self, name)) < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be in (0, 1), "
                                  f"got {getattr(self, name)!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be a whole number >= 0, got {self.threads!r}")
        if not self.latency_batches or any(b < 1 for b in self.latency_batches):
            raise ConfigError("--latency-batches must be whole numbers >= 1, "
                              f"got {list(self.latency_batches)}")
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} is a file; give a directory for the report")


def get_parser() -> argparse.ArgumentParser:
    """The command-line parser (every option is a field of `DemoOptions`)."""
    d = DemoOptions()
    p = argparse.ArgumentParser(
        prog=PROG, description="Train a CNN on scikit-learn's bundled digits, quantize it (PTQ and QAT), "
        "export both to TensorRT-ready Q/DQ ONNX and write a report with accuracy, latency, check and "
        "parity figures.")
    p.add_argument("--out", type=Path, default=d.out, help=f"report folder (default: {d.out}/)")
    p.add_argument("--epochs", type=int, default=d.epochs,
                   help=f"float training epochs (default: {d.epochs})")
    p.add_argument("--qat-epochs", type=int, default=d.qat_epochs,
                   help=f"QAT fine-tune epochs (default: {d.qat_epochs})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"training batch size (default: {d.batch_size})")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate,
                   help=f"Adam learning rate for float training (default: {d.learning_rate})")
    p.add_argument("--qat-learning-rate", type=float, default=d.qat_learning_rate,
                   help=f"Adam learning rate for the QAT fine-tune (default: {d.qat_learning_rate})")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed for the split, weights and shuffling (default: {d.seed})")
    p.add_argument("--latency-rounds", type=int, default=d.latency_rounds,
                   help=f"interleaved timing rounds per model and batch size (default: {d.latency_rounds})")
    p.add_argument("--latency-batches", type=int, nargs="+", default=list(d.latency_batches),
                   help="batch sizes timed in onnxruntime (default: 1 64)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help=f"onnxruntime intra-op threads for timing (default: {d.threads}; "
                   "0: onnxruntime's choice)")
    p.add_argument("--quick", action="store_true",
                   help="short run for tests: 4 epochs, 1 QAT epoch, 5 timing rounds; accuracy and time "
                   "promises are reported but do not fail the run")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no per-epoch lines or progress bars")
    return p


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Build `DemoOptions` from parsed arguments (``--quick`` shortens the run)."""
    fields = {f.name for f in dataclasses.fields(DemoOptions)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["latency_batches"] = tuple(values["latency_batches"])
    if values["threads"] == 0:
        values["threads"] = None
    if values["quick"]:
        values.update(epochs=min(values["epochs"], 4), qat_epochs=1,
                      latency_rounds=min(values["latency_rounds"], 5))
    return DemoOptions(**values)


# =========================================================================== progress
class Stages:
    """Prints ``[k/n] what ...`` when a stage starts and its time when it ends; keeps the timings."""

    def __init__(self, total: int):
        self.total = total
        self.index = 0
        self.start = time.perf_counter()
        self.timings: Dict[str, float] = {}

    def run(self, name: str, what: str, fn, *args, **kwargs):
        """Run ``fn(*args, **kwargs)`` as the next stage and return its result."""
        self.index += 1
        print(f"[{self.index}/{self.total}] {what} ...", flush=True)
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        self.timings[name] = time.perf_counter() - t0
        print(f"      {name} done in {self.timings[name]:.1f} s (total {self.elapsed():.1f} s)", flush=True)
        return result

    def elapsed(self) -> float:
        """Seconds since the demo started."""
        return time.perf_counter() - self.start


# =========================================================================== data and model
@dataclass(frozen=True)
class Splits:
    """The digits images (N, 8, 8, 1) in [0, 1] and their labels, split three ways."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    def sizes(self) -> Dict[str, int]:
        """Samples per split."""
        return {"train": len(self.y_train), "validation": len(self.y_val), "test": len(self.y_test)}


def load_splits(seed: int) -> Splits:
    """Bundled digits, scaled to [0, 1]; stratified 64 / 16 / 20 % train / validation / test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int64)
    x_rest, x_test, y_rest, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    x_train, x_val, y_train, y_val = train_test_split(x_rest, y_rest, test_size=0.2, stratify=y_rest,
                                                      random_state=seed)
    return Splits(x_train, y_train, x_val, y_val, x_test, y_test)


def build_model():
    """Conv-BN-ReLU stem, one residual block (two Conv-BN, Add, ReLU), max pool, Conv-BN-ReLU, GAP, Dense."""
    import keras

    layers = keras.layers

    def conv_bn(x, filters: int, name: str, relu: bool = True):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv")(x)
        x = layers.BatchNormalization(momentum=0.9, name=f"{name}_bn")(x)
        return layers.ReLU(name=f"{name}_relu")(x) if relu else x

    inputs = keras.Input((8, 8, 1), name="image")
    x = conv_bn(inputs, 32, "stem")
    branch = conv_bn(x, 32, "block_a")
    branch = conv_bn(branch, 32, "block_b", relu=False)
    x = layers.Add(name="residual_add")([x, branch])
    x = layers.ReLU(name="residual_relu")(x)
    x = layers.MaxPooling2D(2, name="pool")(x)
    x = conv_bn(x, 64, "head")
    x = layers.GlobalAveragePooling2D(name="gap")(x)
    outputs = layers.Dense(CLASSES, name="logits")(x)
    return keras.Model(inputs, outputs, name="digits_resnet")


def _compile(model, learning_rate: float) -> None:
    import keras

    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


def _fit(model, data: Splits, epochs: int, opts: DemoOptions) -> Dict[str, List[float]]:
    history = model.fit(data.x_train, data.y_train, validation_data=(data.x_val, data.y_val), epochs=epochs,
                        batch_size=opts.batch_size, shuffle=True, verbose=2 if opts.progress else 0)
    return {k: [float(v) for v in vals] for k, vals in history.history.items()}


def keras_accuracy(model, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy (%) of a Keras model in inference mode."""
    logits = np.asarray(model(x, training=False))
    return float(np.mean(np.argmax(logits, axis=-1) == y) * 100.0)


def train_float(data: Splits, opts: DemoOptions):
    """Seeded float training; returns the model and its history."""
    import keras

    keras.utils.set_random_seed(opts.seed)
    model = build_model()
    _compile(model, opts.learning_rate)
    return model, _fit(model, data, opts.epochs, opts)


def quantize_ptq(float_model, data: Splits, opts: DemoOptions):
    """Post-training quantization: quantizers inserted (TensorRT placement, residual case), calibrated,
    no training."""
    import tf_bridge
    from tf_bridge.custom_qdq_cases import ResNetV1QDQCase

    q_model = tf_bridge.quantize_model(float_model, custom_qdq_cases=[ResNetV1QDQCase()])
    tf_bridge.calibrate(q_model, data.x_train, method="max", batch_size=128, progress=opts.progress)
    return q_model


def quantize_qat(float_model, data: Splits, opts: DemoOptions):
    """Quantization-aware training: PTQ's starting point, then a short fine-tune at a low learning rate."""
    import keras

    keras.utils.set_random_seed(opts.seed + 1)
    q_model = quantize_ptq(float_model, data, opts)
    _compile(q_model, opts.qat_learning_rate)
    return q_model, _fit(q_model, data, opts.qat_epochs, opts)


# =========================================================================== export
@dataclass(frozen=True)
class Exported:
    """One exported model: the Q/DQ ONNX, its float twin ONNX, its ScaleTable and the export report."""

    qdq: Path
    float_onnx: Path
    scales: Optional[Path]
    report: object


def export_model(q_model, models_dir: Path, name: str, data: Splits, progress: bool = True) -> Exported:
    """[`tf_bridge.export_onnx`][] with the float ONNX and the ScaleTable; parity on the validation split.

    ``strict=False``: a parity failure still writes the files, and the demo reports it as a FAIL line.
    """
    import tf_bridge

    path = models_dir / f"{name}.onnx"
    print(f"      {name} -> {path}", flush=True)
    rep = tf_bridge.export_onnx(q_model, path, opset=17, target="tensorrt", sample_data=data.x_val,
                                save_scales=True, save_float=True, strict=False, progress=progress)
    if rep.float_path is None:
        raise QatError(f"export of {name}: the export report names no float ONNX file")
    return Exported(qdq=path, float_onnx=Path(rep.float_path),
                    scales=None if rep.scales_path is None else Path(rep.scales_path), report=rep)


def export_cpu_form(q_model, models_dir: Path, data: Splits, progress: bool = True):
    """The QAT model exported again in the ``ort-cpu`` form (uint8 activations, requantization
    points, BatchNorm scales folded into the Convs) that onnxruntime's CPU provider runs on its integer
    kernels; the export checks it as deployed against the TensorRT form. Returns ``(path, report)``."""
    import tf_bridge

    path = models_dir / "qat_cpu.onnx"
    print(f"      qat (ort-cpu form) -> {path}", flush=True)
    rep = tf_bridge.export_onnx(q_model, path, opset=17, target="ort-cpu", sample_data=data.x_val,
                                save_scales=False, save_float=False, strict=False, progress=progress)
    return path, rep


def export_all(ptq, qat, float_model, models_dir: Path, data: Splits, progress: bool):
    """PTQ and QAT exports (TensorRT form), the QAT model in the ort-cpu form, and the FP32 baseline."""
    exported = {k: export_model(m, models_dir, k, data, progress) for k, m in (("ptq", ptq), ("qat", qat))}
    cpu = export_cpu_form(qat, models_dir, data, progress)
    return exported, cpu, export_float(float_model, models_dir)


def export_float(float_model, models_dir: Path) -> Path:
    """The trained float Keras model itself, converted with the same tf2onnx path as the exports.

    This is the FP32 baseline. (An export's ``<name>.float.onnx`` is the float twin of a QAT
    model, whose weights sit on the Keras int8 grid; it is not the float baseline.)
    """
    from onnx_qat.io.models import save_model
    from tf_bridge.export import convert_float_twin

    path = models_dir / "float.onnx"
    print(f"      float -> {path}", flush=True)
    save_model(convert_float_twin(float_model, 17), path)
    return path


# =========================================================================== measurements
def onnx_predictions(path: Path, x: np.ndarray) -> np.ndarray:
    """Class predictions of an ONNX model in onnxruntime (CPU)."""
    from onnx_qat.runtime.sessions import run_model

    outputs = run_model(path, x, batch_size=256)
    logits = next(iter(outputs.values()))
    return np.argmax(logits.reshape(len(x), -1), axis=-1)


def confusion_matrix(y_true: np.ndarray, y_pred: np.ndarray, classes: int = CLASSES) -> np.ndarray:
    """Counts: rows are true classes, columns predicted classes."""
    return np.bincount(y_true * classes + y_pred, minlength=classes * classes).reshape(classes, classes)


def _layer_label(node, index: int, keras_names: Sequence[str]) -> str:
    """The Keras layer a weighted ONNX node came from: the longest Keras layer name found in the node's
    name, output or weight input (tf2onnx keeps them there); else ``"<op type> #<index>"``."""
    texts = [node.name, *node.output, *node.input[1:2]]
    hits = [k for k in keras_names if any(k in t for t in texts)]
    return max(hits, key=len) if hits else f"{node.op_type} #{index}"


def layer_errors(float_path: Path, qdq_path: Path, x: np.ndarray,
                 keras_names: Sequence[str]) -> Tuple[Tuple[str, float], ...]:
    """SQNR (dB) of each weighted op's output (Conv, ConvTranspose, Gemm, MatMul) in the Q/DQ model against
    the same tensor of the float model, in graph order. Tensors the Q/DQ model does not have are left out."""
    from onnx_qat.io.models import load_model
    from onnx_qat.runtime.sessions import make_session

    float_proto, qdq_proto = load_model(float_path), load_model(qdq_path)
    qdq_tensors = {o for n in qdq_proto.graph.node for o in n.output}
    weighted = [n for n in float_proto.graph.node if n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul")]
    wanted = [(n.output[0], _layer_label(n, k, keras_names)) for k, n in enumerate(weighted)
              if n.output[0] in qdq_tensors]
    if not wanted:
        return ()
    names = [t for t, _ in wanted]
    ref = make_session(float_proto, extra_outputs=names)
    cand = make_session(qdq_proto, extra_outputs=names)
    feed = {ref.get_inputs()[0].name: x}
    ref_out = dict(zip(names, ref.run(names, feed)))
    cand_out = dict(zip(names, cand.run(names, {cand.get_inputs()[0].name: x})))
    result = []
    for tensor, label in wanted:
        signal = float(np.sum(np.square(ref_out[tensor], dtype=np.float64)))
        noise = float(np.sum(np.square(ref_out[tensor] - cand_out[tensor], dtype=np.float64)))
        sqnr = 10.0 * math.log10(signal / noise) if noise > 0 and signal > 0 else float("inf")
        result.append((label, round(sqnr, 2)))
    return tuple(result)


def activation_amax(q_model) -> Tuple[Tuple[str, float], ...]:
    """``(quantizer, amax)`` for every activation quantizer of a QAT model."""
    from tf_bridge import quantizer_records

    return tuple((r.path, float(r.amax)) for r in quantizer_records(q_model)
                 if r.kind == "activation" and r.amax is not None)


def _timed_round(session, feed, runs: int) -> float:
    t0 = time.perf_counter()
    for _ in range(runs):
        session.run(None, feed)
    return (time.perf_counter() - t0) / runs


def measure_latency(paths: Dict[str, Path], x: np.ndarray, batches: Sequence[int], rounds: int,
                    threads: Optional[int]) -> Tuple["report.LatencyResult", ...]:
    """Median onnxruntime CPU latency per model and batch size, from interleaved rounds.

    Every round runs each model in turn (the starting model rotates), so slow drifts of the machine
    affect all models alike; small batches are run several times per round and averaged.
    """
    from onnx_qat.runtime.sessions import make_session

    # latency of each model as onnxruntime deploys it (graph optimisations on, every form)
    sessions = {name: make_session(p, threads=threads, optimize=True) for name, p in paths.items()}
    results = []
    for batch in batches:
        xb = np.resize(x, (batch, *x.shape[1:])).astype(np.float32)
        feeds = {name: {s.get_inputs()[0].name: xb} for name, s in sessions.items()}
        runs = max(1, 64 // batch)
        for name, s in sessions.items():  # warm-up
            _timed_round(s, feeds[name], 3)
        times: Dict[str, List[float]] = {name: [] for name in sessions}
        order = list(sessions)
        for r in range(rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                times[name].append(_timed_round(sessions[name], feeds[name], runs) * 1e3)
        for name in sessions:
            t = np.asarray(times[name])
            results.append(report.LatencyResult(
                model=name, batch=batch, median_ms=round(float(np.median(t)), 4),
                p10_ms=round(float(np.percentile(t, 10)), 4), p90_ms=round(float(np.percentile(t, 90)), 4),
                rounds=rounds, runs_per_round=runs, threads=threads))
    return tuple(results)


def _numbers(obj, prefix: str = "") -> Dict[str, object]:
    """Flatten the numeric and short text figures of a report-like object (for the parity section)."""
    if hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if not isinstance(obj, dict):
        return {}
    flat: Dict[str, object] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, (bool, int, float, np.floating, np.integer)):
            flat[name] = round(float(value), 6) if isinstance(value, (float, np.floating)) else value
        elif isinstance(value, dict) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
            flat.update(_numbers(value, name + "."))
    return flat


def parity_of(rep) -> Dict[str, object]:
    """``{"summary", "passed", "figures", "outputs", "mapping"}`` from an export report.

    The verdict is the report's parity verdict (``rep.parity``) when it has one, else its own
    ``passed``; a report with neither never counts as a pass. ``"deployed"``: the verdict lines of a
    target other than tensorrt run as deployed (empty for the tensorrt form).
    """
    verdict = getattr(rep, "parity", rep)
    if hasattr(verdict, "passed"):
        passed = bool(verdict.passed)
    elif getattr(type(verdict), "__bool__", None) is not None:
        passed = bool(verdict)
    else:
        passed = False
    outputs = getattr(verdict, "outputs", None)
    lines = [str(o) for o in outputs] if outputs else str(verdict).splitlines()
    data = verdict.to_dict() if callable(getattr(verdict, "to_dict", None)) else None
    if isinstance(data, dict) and isinstance(data.get("outputs"), list):
        keep = ("samples", "generated_inputs", "ratio_limit", "top1_limit")
        figures = {k: data[k] for k in keep if k in data}
        wanted = ("name", "max_abs_qdq", "max_abs_float", "ratio", "top1", "max_abs_tf", "passed")
        rows = [{k: o[k] for k in wanted if k in o} for o in data["outputs"]]
    else:
        figures, rows = _numbers(verdict), []
    mapping_table = getattr(rep, "mapping_table", None)
    result = {"summary": lines[0] if lines else "", "passed": passed, "figures": figures, "outputs": rows,
              "mapping": mapping_table() if callable(mapping_table) else ""}
    if hasattr(rep, "cli_reproducible"):
        result["cli_reproducible"] = bool(rep.cli_reproducible)
    result["deployed"] = "; ".join(str(d) for d in getattr(verdict, "deployed", ()) or ())
    return result


@dataclass(frozen=True)
class Evaluation:
    """Accuracies (%), predictions, per-layer errors and check reports of the exported models."""

    onnx_accuracy: Dict[str, float]
    keras_accuracy: Dict[str, float]
    confusion: np.ndarray
    layer_error: Dict[str, Tuple[Tuple[str, float], ...]]
    checks: Dict[str, dict]


def evaluate(models: Dict[str, object], exported: Dict[str, Exported], float_path: Path,
             data: Splits, cpu_path: Optional[Path] = None) -> Evaluation:
    """Test accuracy in onnxruntime (the float model, PTQ and QAT Q/DQ, and the QAT model's ort-cpu
    form when ``cpu_path`` is given) and in Keras; check (the ort-cpu form by its own rules);
    per-layer SQNR (each Q/DQ model against its own float twin)."""
    from onnx_qat.check import check

    paths = {"float": float_path, "ptq": exported["ptq"].qdq, "qat": exported["qat"].qdq}
    if cpu_path is not None:
        paths["qat_cpu"] = cpu_path
    predictions = {k: onnx_predictions(p, data.x_test) for k, p in paths.items()}
    onnx_acc = {k: round(float(np.mean(v == data.y_test) * 100.0), 3) for k, v in predictions.items()}
    keras_acc = {k: round(keras_accuracy(m, data.x_test, data.y_test), 3) for k, m in models.items()}
    keras_names = [layer.name for layer in models["float"].layers]
    errors = {k: layer_errors(exported[k].float_onnx, exported[k].qdq, data.x_test, keras_names)
              for k in ("ptq", "qat")}
    checks = {}
    for key in ("ptq", "qat"):
        rep = check(exported[key].qdq)
        checks[key] = dict(rep.to_dict(), summary=rep.summary())
    if cpu_path is not None:
        rep = check(cpu_path, target="ort-cpu")
        checks["qat_cpu"] = dict(rep.to_dict(), summary=rep.summary())
    return Evaluation(onnx_acc, keras_acc, confusion_matrix(data.y_test, predictions["qat"]), errors, checks)


# =========================================================================== promises
def criteria(ev: Evaluation, parity: Dict[str, dict], total_s: float,
             quick: bool) -> Tuple["report.Criterion", ...]:
    """The demo's promises, checked. In quick mode accuracy and time are shown but do not gate."""
    drop = ev.onnx_accuracy["float"] - ev.onnx_accuracy["qat"]
    result = [report.Criterion(
        "QAT INT8 accuracy within 1 point of float (onnxruntime, test split)",
        f"QAT {ev.onnx_accuracy['qat']:.2f}% vs float {ev.onnx_accuracy['float']:.2f}% "
        f"(drop {drop:+.2f} points)",
        f"drop <= {MAX_ACCURACY_DROP_POINTS:.1f} point", drop <= MAX_ACCURACY_DROP_POINTS, gating=not quick)]
    for key in ("ptq", "qat"):
        chk = ev.checks[key]
        result.append(report.Criterion(
            f"{report.MODEL_LABELS[key]} Q/DQ model passes onnx_qat.check",
            f"{chk['num_errors']} error(s), {chk['num_warnings']} warning(s), {chk['num_q']} QuantizeLinear",
            "0 errors", bool(chk["passed"])))
    for key in ("ptq", "qat"):
        result.append(report.Criterion(
            f"{report.MODEL_LABELS[key]} export parity vs the Keras model",
            parity[key]["summary"] or "no summary", "export report passes", bool(parity[key]["passed"])))
    if "qat_cpu" in parity and "qat_cpu" in ev.checks:
        chk, par = ev.checks["qat_cpu"], parity["qat_cpu"]
        result.append(report.Criterion(
            "QAT INT8 ort-cpu form: check by its rules and parity as deployed",
            f"check {chk['num_errors']} error(s); {par['deployed'] or par['summary'] or 'no summary'}",
            "0 errors, export report passes", bool(chk["passed"]) and bool(par["passed"])))
    result.append(report.Criterion(
        "whole demo under 5 minutes", f"{total_s:.0f} s", f"< {TIME_BUDGET_S:.0f} s", total_s < TIME_BUDGET_S,
        gating=not quick))
    return tuple(result)


# =========================================================================== run
def machine_description() -> str:
    """CPU model and count, OS, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{os.cpu_count()} CPU core(s), {cpu}, no GPU used; {platform.system()} {platform.release()}; " \
           f"Python {platform.python_version()}"


def stack_versions() -> str:
    """Versions of the libraries the demo runs on."""
    import importlib.metadata as md

    parts = []
    for dist in ("tensorflow-cpu", "keras", "tf2onnx", "onnx", "onnxruntime", "numpy", "scikit-learn"):
        try:
            parts.append(f"{dist} {md.version(dist)}")
        except md.PackageNotFoundError:
            continue
    return ", ".join(parts)


LATENCY_NOTE = ("PTQ INT8 and QAT INT8 are in TensorRT's explicit-quantization form (signed INT8 "
                "activations, QuantizeLinear/DequantizeLinear around each weighted op): onnxruntime's CPU "
                "provider runs that form on float kernels with extra quantize/dequantize work, so it is "
                "slower than FP32 here; TensorRT runs it on a GPU (tools/deploy_tensorrt.py). QAT INT8 "
                "ort-cpu is the same QAT model exported with target=\"ort-cpu\" (unsigned INT8 activations, "
                "Conv outputs requantized, BatchNorm scales folded into the Convs), which onnxruntime runs "
                "on its integer kernels. On a network this small (8x8 inputs) per-node overhead weighs "
                "about as much as arithmetic, most of all at batch 1, so the figures say little about "
                "larger models; see docs/performance.md for a ResNet50.")


def _meta(opts: DemoOptions, stages: Stages) -> Dict[str, object]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(), "versions": stack_versions(), "seed": opts.seed,
        "epochs": opts.epochs, "qat_epochs": opts.qat_epochs, "qat_learning_rate": opts.qat_learning_rate,
        "learning_rate": opts.learning_rate, "batch_size": opts.batch_size, "quick": opts.quick,
        "model": "Conv-BN-ReLU(32) stem, residual block [Conv-BN-ReLU(32), Conv-BN(32), Add, ReLU], "
                 "MaxPool 2x2, Conv-BN-ReLU(64), GlobalAveragePooling, Dense(10)",
        "timings": {k: round(v, 2) for k, v in stages.timings.items()}, "total_s": round(stages.elapsed(), 1),
    }


def _files(out: Path, exported: Dict[str, Exported], float_path: Path, cpu_path: Path) -> Dict[str, str]:
    files = {"float_onnx": float_path, "ptq_onnx": exported["ptq"].qdq, "qat_onnx": exported["qat"].qdq,
             "qat_cpu_onnx": cpu_path,
             "ptq_float_twin_onnx": exported["ptq"].float_onnx,
             "qat_float_twin_onnx": exported["qat"].float_onnx}
    for key in ("ptq", "qat"):
        if exported[key].scales is not None:
            files[f"{key}_scales"] = exported[key].scales
    return {k: os.path.relpath(v, out) for k, v in files.items()}


def run_demo(opts: DemoOptions) -> Tuple[report.DemoResults, Dict[str, Path]]:
    """Run every stage; return the results and the files of the report."""
    stages = Stages(9)
    models_dir = opts.out / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    data = stages.run("data", "loading scikit-learn's bundled digits (no download)", load_splits, opts.seed)
    print(f"      split: {data.sizes()}", flush=True)
    float_model, float_hist = stages.run(
        "float", f"training the float CNN ({opts.epochs} epochs, TensorFlow CPU)", train_float, data, opts)
    ptq = stages.run("ptq", "PTQ: quantize_model + calibrate (no training)", quantize_ptq, float_model, data,
                     opts)
    qat, qat_hist = stages.run(
        "qat", f"QAT: quantize_model + calibrate + {opts.qat_epochs}-epoch fine-tune", quantize_qat,
        float_model, data, opts)
    exported, (cpu_path, cpu_report), float_path = stages.run(
        "export", "exporting the float model, PTQ and QAT (and QAT in the ort-cpu form) with "
        "tf_bridge.export_onnx", export_all, ptq, qat, float_model, models_dir, data, opts.progress)
    ev = stages.run("evaluate", "accuracy, per-layer error and onnx_qat.check in onnxruntime", evaluate,
                    {"float": float_model, "ptq": ptq, "qat": qat}, exported, float_path, data, cpu_path)
    paths = {"float": float_path, "ptq": exported["ptq"].qdq, "qat": exported["qat"].qdq, "qat_cpu": cpu_path}
    latency = stages.run("latency", f"onnxruntime CPU latency, {opts.latency_rounds} interleaved rounds",
                         measure_latency, paths, data.x_test, opts.latency_batches, opts.latency_rounds,
                         opts.threads)
    sensitivity = stages.run("sensitivity", "onnx_qat.sensitivity of the float model (which sites cost "
                             "accuracy in INT8)", sensitivity_of, float_path, data, opts.progress)
    parity = {k: parity_of(e.report) for k, e in exported.items()}
    parity["qat_cpu"] = parity_of(cpu_report)
    results = report.DemoResults(
        meta=_meta(opts, stages), onnx_accuracy=ev.onnx_accuracy, keras_accuracy=ev.keras_accuracy,
        dataset=dict(data.sizes(), shape="8x8x1", classes=CLASSES), latency=latency, checks=ev.checks,
        parity=parity, layer_error=ev.layer_error,
        activation_amax={"ptq": activation_amax(ptq), "qat": activation_amax(qat)}, confusion=ev.confusion,
        history={"float": float_hist, "qat": qat_hist},
        criteria=criteria(ev, parity, stages.elapsed(), opts.quick),
        files=_files(opts.out, exported, float_path, cpu_path),
        notes=(LATENCY_NOTE,), sensitivity=sensitivity)
    written = stages.run("report", f"writing the report to {opts.out}/", report.write_report, opts.out,
                         results)
    return results, written


def sensitivity_of(float_path: Path, data: Splits, progress: bool = True):
    """[`onnx_qat.sensitivity`][onnx_qat.accuracy.sensitivity.sensitivity] of the float ONNX model: calibrated
    on the training split, judged on the validation split."""
    import onnx_qat

    return onnx_qat.sensitivity(str(float_path), data.x_train[:512], eval_data=data.x_val,
                                progress=progress)


def print_summary(results: report.DemoResults, written: Dict[str, Path]) -> None:
    """Accuracy, latency and the PASS/FAIL lines, then where the report is."""
    acc = results.onnx_accuracy
    print("\n== summary (test accuracy in onnxruntime) ==")
    print("  " + " | ".join(f"{report.MODEL_LABELS[k]} {acc[k]:.2f}%"
                            for k in report.MODEL_LABELS if k in acc))
    for r in results.latency:
        print(f"  latency batch {r.batch:<3} {report.MODEL_LABELS[r.model]:<16} median {r.median_ms:.3f} ms")
    for c in results.criteria:
        print(f"  {c}")
    print(f"\nreport: {Path(written['report']).resolve()}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the exit code."""
    args = get_parser().parse_args(argv)
    try:
        opts = options_from_args(args)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        results, written = run_demo(opts)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except QatError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception:  # report the bug with its trace, distinct from a missed promise
        traceback.print_exc()
        print(f"{PROG}: internal error (trace above)", file=sys.stderr)
        return EXIT_INTERNAL
    print_summary(results, written)
    return EXIT_OK if results.passed else EXIT_PROMISE_MISSED


if __name__ == "__main__":
    sys.exit(main())
