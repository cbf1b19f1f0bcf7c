"""cpu_latency: onnxruntime CPU latency and numerics of the same network in five forms.

FP32; our ``tensorrt`` target run in onnxruntime; our ``ort-cpu`` target; onnxruntime's own
``quantize_static`` with its defaults, with asymmetric uint8 activations (its fastest x86 form) and with
symmetric int8 settings. One ScaleTable (``max`` calibration) feeds both of our targets. Every session
uses 2 intra-op threads; runs are interleaved (A B C ... A B C) and medians compared. For latency the
ResNet50 takes its standard 224 x 224 input (`SIZE`); the numerics rows use the same network at
96 x 96 (`NUMERICS_SIZE`), whose random-weight logits are less tied (see `_numerics` for
how top-1 agreement is judged).

One more row reads onnxruntime's own profile of FP32 and ort-cpu runs: the time of the convolution
kernels alone (``QLinearConv`` against float ``Conv``). That ratio is what this CPU's integer kernels
give; a model whose time is nearly all convolution runs about that much faster, not more.

Each session has its own intra-op thread pool, and onnxruntime's pool threads spin for a while after a
run before they sleep. Interleaved, the threads of the session that just ran would spin on the cores the
next one needs (on 2 cores: a third of ResNet50's FP32 time and of the ort-cpu time), so the measured
sessions are made with ``session.intra_op.allow_spinning = 0`` (`NO_SPIN`), every form alike. One
more row checks that this flatters no form: the same speed-up with each model run alone, back to back,
with onnxruntime's default spinning.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, List

import numpy as np

from . import models
from .measure import back_to_back_medians, interleaved_medians
from .table import Goal, Row, ratio

NAME = "cpu_latency"
#: Input size of the ResNet50 for latency (its standard one).
SIZE = 224
#: Input size for the numerics rows: with random weights, the 224 x 224 network's logits are nearly tied
#: (FP32 and the tensorrt form agree on top-1 for only ~84% of inputs), so top-1 agreement there measures
#: ties, not the target; at 96 x 96 the conditioned network ties less often (about 96% agreement), and the
#: top-1 goal is judged on the inputs FP32 decides (`_numerics`).
NUMERICS_SIZE = 96
#: Samples for the numerics rows (at `NUMERICS_SIZE`).
NUMERICS_SAMPLES = 256
#: Session settings of every measured session: no spinning of idle intra-op threads (see the module doc).
NO_SPIN = {"session.intra_op.allow_spinning": "0"}
logger = logging.getLogger(__name__)


class _Reader:
    """An onnxruntime CalibrationDataReader over fixed batches."""

    def __init__(self, name: str, data: np.ndarray, batch: int):
        self.batches = iter([{name: data[i:i + batch]} for i in range(0, len(data), batch)])

    def get_next(self):
        return next(self.batches, None)


def _ort_static(float_path: Path, out: Path, name: str, calib: np.ndarray, **settings) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, quantize_static

    reader = type("Reader", (_Reader, CalibrationDataReader), {})(name, calib, 8)
    quantize_static(str(float_path), str(out), reader, **settings)
    return out


def _session(model, threads: int = 2, optimize: bool = True, config=None):
    """An onnxruntime CPU session of ``model`` (path or proto); ``config``: session config entries
    (default `NO_SPIN`; ``{}`` keeps onnxruntime's defaults)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    for key, value in (NO_SPIN if config is None else config).items():
        opts.add_session_config_entry(key, value)
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def _setup(workdir: Path, quick: bool, size: int = SIZE):
    import onnx

    if quick:
        model, size = models.tiny_cnn(), 16
        path = workdir / "tiny_cnn.onnx"
        onnx.save(model, str(path))
        def make(num, seed):
            return models.images(num, size, seed=seed, channels_last=False, channels=16) / 64.0

        return path, "input", make(16, 1), make(8, 2), make(16, 3)
    path = models.resnet50(workdir / f"resnet50_{size}.onnx", size)
    tests = NUMERICS_SAMPLES if size == NUMERICS_SIZE else 8  # the 224 x 224 run measures time only
    return (path, models.RESNET_INPUT, models.images(32, size, seed=1), models.images(8, size, seed=2),
            models.images(tests, size, seed=3))


def _build(path: Path, name: str, calib: np.ndarray, workdir: Path,
           only_uint8: bool = False) -> Dict[str, object]:
    """The six models: float path, our two targets (protos) and onnxruntime's three (paths; only its
    uint8 asymmetric one with ``only_uint8``)."""
    from onnxruntime.quantization import QuantType

    import onnx_qat
    from onnx_qat.insertion.ort_cpu import OrtCpuAdapter
    from onnx_qat.graph.index import GraphIndex

    proto = onnx_qat.load_model(path)
    placement = onnx_qat.place(proto)
    extra = OrtCpuAdapter().calibration_tensors(GraphIndex(proto), placement)
    table = onnx_qat.calibrate(proto, {name: calib}, method="max", batch_size=8, progress=False,
                               tensors=placement.activation_tensors() + extra)
    forms: Dict[str, object] = {"fp32": path}
    forms["ours tensorrt"] = onnx_qat.quantize(proto, scales=table, target="tensorrt", progress=False).model
    cpu = onnx_qat.quantize(proto, scales=table, target="ort-cpu", progress=False)
    forms["ours ort-cpu"] = cpu.model
    stem = path.stem
    forms["ort uint8 asym"] = _ort_static(path, workdir / f"{stem}_ort_u8.onnx", name, calib,
                                          activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    if only_uint8:
        forms["_requant"] = 0
        return forms
    forms["ort default"] = _ort_static(path, workdir / "ort_default.onnx", name, calib)
    forms["ort int8 sym"] = _ort_static(path, workdir / "ort_s8_sym.onnx", name, calib,
                                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                                        per_channel=True,
                                        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True})
    forms["_requant"] = len([r for r in cpu.requantization if r["status"] == "added"])
    return forms


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the cpu_latency rows."""
    path, name, calib, batch, test = _setup(Path(workdir), quick)
    forms = _build(path, name, calib, Path(workdir))
    requant = forms.pop("_requant")
    sessions = {k: _session(v) for k, v in forms.items()}
    feeds = {name: batch}
    medians = interleaved_medians({k: (lambda s=s: s.run(None, feeds)) for k, s in sessions.items()},
                                  repeats=3 if quick else 12, warmup=1 if quick else 2)
    fp32, cpu, u8 = medians["fp32"], medians["ours ort-cpu"], medians["ort uint8 asym"]
    what = "tiny CNN" if quick else f"Keras ResNet50 {SIZE}x{SIZE}"
    rows = [
        Row(NAME, "ort-cpu target speed-up over FP32", ratio(fp32, cpu), Goal(">=", 3.0, 2.0),
            f"{what}, batch {len(batch)}, 2 threads, median of interleaved runs; "
            f"{requant} requantization points"),
        Row(NAME, "ort-cpu target time / onnxruntime uint8 asymmetric", ratio(cpu, u8), Goal("<=", 1.0, 1.25),
            "quantize_static(activation_type=QUInt8), QDQ, MinMax"),
        Row(NAME, "tensorrt target in onnxruntime: speed-up over FP32", ratio(fp32, medians["ours tensorrt"]),
            None, "symmetric int8 activations: onnxruntime runs them on float kernels"),
        Row(NAME, "onnxruntime default quantize_static: speed-up over FP32",
            ratio(fp32, medians["ort default"]), None,
            "defaults of onnxruntime's quantize_static: QDQ, asymmetric int8 activations, MinMax"),
        Row(NAME, "onnxruntime uint8 asymmetric: speed-up over FP32", ratio(fp32, u8), None, ""),
        Row(NAME, "onnxruntime int8 symmetric: speed-up over FP32", ratio(fp32, medians["ort int8 sym"]),
            None, "ActivationSymmetric, WeightSymmetric, per channel"),
    ]
    rows.append(_alone_row(forms, feeds, what, repeats=3 if quick else 8))
    rows.append(_kernel_row(forms, feeds, Path(workdir), runs=2 if quick else 5))
    if not quick:  # the numerics on the network whose classes are separated (see NUMERICS_SIZE)
        del sessions, forms
        path, name, calib, batch, test = _setup(Path(workdir), quick, NUMERICS_SIZE)
        forms = _build(path, name, calib, Path(workdir), only_uint8=True)
        forms.pop("_requant")
        sessions = {k: _session(v) for k, v in forms.items()}
    what = "tiny CNN" if quick else f"ResNet50 {NUMERICS_SIZE}x{NUMERICS_SIZE}"
    return rows + _numerics(sessions, forms, name, test, what)


def _alone_row(forms, feeds, what: str, repeats: int) -> Row:
    """The ort-cpu speed-up over FP32 with each model run alone, back to back, in a session with
    onnxruntime's default settings (idle threads spin): a check on the interleaved, non-spinning figure."""
    sessions = {k: _session(forms[k], config={}) for k in ("fp32", "ours ort-cpu")}
    medians = back_to_back_medians({k: (lambda s=s: s.run(None, feeds)) for k, s in sessions.items()},
                                   repeats=repeats, warmup=2)
    return Row(NAME, "ort-cpu target speed-up over FP32, each model alone with default spinning",
               ratio(medians["fp32"], medians["ours ort-cpu"]), None,
               f"{what}, batch {len(next(iter(feeds.values())))}, 2 threads, {repeats} runs of each model "
               "in a row, medians; the same figure as the interleaved one when neither form is flattered")


def _kernel_row(forms, feeds, workdir: Path, runs: int) -> Row:
    """Float ``Conv`` kernel time / ``QLinearConv`` kernel time, from onnxruntime's profiler (same runs,
    same threads): the integer convolution's own speed-up on this CPU."""
    conv = {k: _op_time(forms[k], feeds, workdir / k.replace(" ", "_"), runs)
            for k in ("fp32", "ours ort-cpu")}
    fp32, cpu = conv["fp32"].get("Conv", 0.0), conv["ours ort-cpu"].get("QLinearConv", 0.0)
    share = cpu / max(sum(conv["ours ort-cpu"].values()), 1e-12)
    return Row(NAME, "integer Conv kernels alone: float Conv / QLinearConv kernel time",
               ratio(fp32, cpu) if cpu else None, None,
               f"onnxruntime profile, {runs} runs each; QLinearConv is {100 * share:.0f}% of the ort-cpu "
               "kernel time, so the whole model's speed-up over FP32 stays near this ratio on this CPU")


def _op_time(model, feeds, prefix: Path, runs: int) -> Dict[str, float]:
    """Kernel time per op type (microseconds, summed over ``runs`` runs after one warm-up run)."""
    import json

    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = 2, 1, 3
    opts.enable_profiling = True
    opts.profile_file_prefix = str(prefix)
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    for _ in range(runs + 1):  # the first run (allocations, caches) is left out below
        session.run(None, feeds)
    profile = Path(session.end_profiling())
    events = json.loads(profile.read_text())
    run_events = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])
    warm_end = run_events[0]["ts"] + run_events[0]["dur"] if run_events else 0
    times: Dict[str, float] = {}
    for event in events:
        args = event.get("args", {})
        if (event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time")
                and "op_name" in args and event.get("ts", 0) >= warm_end):
            times[args["op_name"]] = times.get(args["op_name"], 0.0) + float(event.get("dur", 0))
    profile.unlink(missing_ok=True)
    return times


def _numerics(sessions, forms, name: str, test: np.ndarray, what: str) -> List[Row]:
    """ort-cpu (onnxruntime, all optimizations) vs the tensorrt target in reference Q/DQ arithmetic
    (onnxruntime with graph optimizations off: what TensorRT computes, up to rounding) vs FP32.

    Further rows split the difference: the ort-cpu model in reference arithmetic against the
    tensorrt target (the form alone: requantization points, zero-point-0 clamps) and the ort-cpu
    model on onnxruntime's integer kernels against itself in reference arithmetic (the kernels alone:
    the same integers rounded by another arithmetic, then carried through the network). The floor row
    runs the tensorrt target against itself with every input value moved up by one float32 ulp: how far
    the network's outputs move when one rounding somewhere goes the other way, which any second
    implementation of the same integers (onnxruntime's kernels, TensorRT's own) cannot get under.

    Top-1 agreement is judged on the inputs FP32 decides: its top-2 logit margin exceeds twice the
    tensorrt target's largest logit error, so that no quantized form within that error has a tie to
    break. The agreement on all inputs is in the row's detail.
    """
    def outputs(session, data=test):
        return np.concatenate([session.run(None, {name: data[i:i + 8]})[0] for i in range(0, len(data), 8)])

    ref, cpu = outputs(sessions["fp32"]), outputs(sessions["ours ort-cpu"])
    trt_session = _session(forms["ours tensorrt"], optimize=False)
    trt = outputs(trt_session)
    ulp_up = np.nextafter(test, np.float32(np.inf))
    trt_ulp, ref_ulp = outputs(trt_session, ulp_up), outputs(sessions["fp32"], ulp_up)
    cpu_ref = outputs(_session(forms["ours ort-cpu"], optimize=False))
    u8 = outputs(sessions["ort uint8 asym"])
    trt_err, trt_mean = float(np.abs(trt - ref).max()), float(np.abs(trt - ref).mean())
    n = len(test)

    def max_ratio(a, b):
        return ratio(float(np.abs(a - b).max()), trt_err)

    def agree(a, b, where=slice(None)):
        return 100.0 * float((a.argmax(-1) == b.argmax(-1))[where].mean())

    top2 = np.sort(ref, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 2.0 * trt_err
    top1 = agree(cpu, trt, decided) if decided.any() else None
    return [
        Row(NAME, "ort-cpu vs tensorrt target: max diff / tensorrt target error", max_ratio(cpu, trt),
            Goal("<=", 0.25),
            f"{what}, {n} samples; tensorrt target (reference Q/DQ arithmetic) max abs error vs FP32 "
            f"{trt_err:.3g}; see the floor row below"),
        Row(NAME, "floor: tensorrt target vs itself with each input one float32 ulp up, max diff / "
                  "tensorrt error", max_ratio(trt_ulp, trt), None,
            f"{what}, {n} samples; FP32 moves {max_ratio(ref_ulp, ref):.2g}x; mean abs diff "
            f"{ratio(float(np.abs(trt_ulp - trt).mean()), trt_mean):.2g}x the tensorrt mean error; "
            f"top-1 kept on {agree(trt_ulp, trt):.1f}%"),
        Row(NAME, "ort-cpu vs tensorrt target: top-1 agreement on inputs FP32 decides", top1,
            Goal(">=", 99.0),
            f"{what}: {int(decided.sum())} of {n} inputs have an FP32 top-2 margin over 2x the tensorrt "
            f"target's max error; on all {n}: {agree(cpu, trt):.1f}% (FP32 vs tensorrt target "
            f"{agree(ref, trt):.1f}%, tensorrt target vs itself one ulp up {agree(trt_ulp, trt):.1f}%)",
            unit="%"),
        Row(NAME, "ort-cpu form alone (reference arithmetic) vs tensorrt target: max diff / tensorrt error",
            max_ratio(cpu_ref, trt), None, "both in reference Q/DQ arithmetic"),
        Row(NAME, "onnxruntime integer kernels alone: ort-cpu vs itself in reference arithmetic, "
                  "max diff / tensorrt error", max_ratio(cpu, cpu_ref), None,
            "the same model and integers; a floor for any integer-kernel run against reference arithmetic"),
        Row(NAME, "ort-cpu vs tensorrt target: mean abs diff / tensorrt target mean abs error",
            ratio(float(np.abs(cpu - trt).mean()), trt_mean), None,
            "about 1.41 when the two errors are independent and equally large"),
        Row(NAME, "ort-cpu error / tensorrt target error (vs FP32)", max_ratio(cpu, ref), None,
            f"max abs; mean abs: {ratio(float(np.abs(cpu - ref).mean()), trt_mean):.3g}x"),
        Row(NAME, "onnxruntime uint8 asymmetric error / tensorrt target error (vs FP32)", max_ratio(u8, ref),
            None, f"max abs; mean abs: {ratio(float(np.abs(u8 - ref).mean()), trt_mean):.3g}x"),
    ]
