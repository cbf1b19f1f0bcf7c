"""cpu_models: the ``ort-cpu`` form against FP32 and onnxruntime's own static quantization, per model.

Models (224 x 224 images, random weights as ``weights=None`` gives them, logits out): Keras
``ResNet50``, ``MobileNetV2``, ``EfficientNetB0`` and ``ConvNeXtTiny`` (exported with tf2onnx in a child
process, so TensorFlow never loads here; ConvNeXtTiny through the project's own converter,
`PROJECT_CONVERTER`; skipped with the reason when TensorFlow is missing), a ViT-style
encoder built in code at ViT-B/16's sizes (`vit_encoder`: 16 x 16 patches, 12 layers, width 768,
12 heads, MLP 3072, 197 tokens), and the real PP-OCRv4 text detector when
``tools/real_models.py`` has cached it (320 x 320 pages and photos).

Per model, three forms, all calibrated on the same 16 samples: FP32; ours
(``onnx_qat.quantize(target="ort-cpu", method="max", latency=...)``: latency-aware placement with a
profile kept in the work directory, so the whole-model check of `onnx_qat.placement.cpu_latency` runs;
the default ``cpu_vnni="auto"``: 8-bit weights on a CPU with VNNI or AMX, `wide_dot_products`, where
the error of the 7-bit-weight form, ``cpu_vnni=False``, follows in a row of its own; when it writes
nothing, no quantized form being faster than FP32 here, the speed rows read 1.0: the FP32 model is what
the user keeps); onnxruntime's
``quantize_static`` in its fast x86 form (QDQ, uint8 activations, int8 weights, MinMax). Each is timed
at batch 1 and 8, 2 intra-op threads, sessions without thread spinning, the three run in rounds with the
order rotated (A B C, B C A, ...), `MIN_ROUNDS` and more until the goal ratios settle; each ratio is the
median of the per-round ratios with its 95% interval, and a goal row whose interval holds 1.0 is a
``TIE`` (`_speed_rows`). Errors: mean absolute difference from FP32 over 8 further
samples, as a fraction of FP32's output range (both quantized forms on the same samples).

The machine's load (``os.getloadavg``) is in each row's detail: on a shared machine the ratios are what
to read, not the times.

``cpu_models_avx2`` (`run_avx2`, `run_isa`; ``python -m tools.bench.cpu_models --isa avx2 --workdir W``)
measures the same rows on onnxruntime's AVX2 kernels of this machine: a child process whose CPUID
instruction reports no AVX-512, VNNI or AMX (`tools.bench.isa`, `cpuid_mask.c`).
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from .measure import interleaved_rounds, median_interval, paired_ratio
from .table import Goal, Row, ratio, skip

NAME = "cpu_models"
KERAS_MODELS = ("ResNet50", "MobileNetV2", "EfficientNetB0", "ConvNeXtTiny")
#: Exported with the project's own converter (`tf_bridge.convert`): plain tf2onnx 1.17 leaves Keras 3
#: ConvNeXt's grouped (depthwise) convolutions as ``StatefulPartitionedCall`` and its exact GELU as
#: ``Erfc``, which that converter turns into a grouped ``Conv`` and ``1 - Erf`` (docs/round-trip.md).
PROJECT_CONVERTER = ("ConvNeXtTiny",)
BATCHES = (1, 8)
THREADS = 2
CALIB_SAMPLES, TEST_SAMPLES = 16, 8
logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- models
def keras_model(name: str, path: Path, size: int = 224) -> Path:
    """Export ``keras.applications.<name>(weights=None)`` (logits) to ``path`` in a child process."""
    from .measure import python_module, run_process

    if not path.exists():
        run_process(python_module("tools.bench.cpu_models", name, "--size", str(size), "--out", str(path)))
    return path


def _export_keras(name: str, size: int, out: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf
    import tf2onnx

    from onnx_qat.io.models import save_model

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=1000,
                                              classifier_activation=None)
    if name in PROJECT_CONVERTER:
        proto = _convert_with_tf_bridge(model)
    else:
        spec = (tf.TensorSpec((None, size, size, 3), tf.float32, name="input"),)
        proto, _ = tf2onnx.convert.from_keras(model, input_signature=spec, opset=17)
    left = sorted({n.op_type for n in proto.graph.node if n.op_type in ("StatefulPartitionedCall", "Erfc")})
    if left:
        raise RuntimeError(f"tf2onnx {tf2onnx.__version__} leaves {', '.join(left)} unconverted in "
                           f"keras.applications.{name}; no ONNX model to measure")
    save_model(proto, out)


def _convert_with_tf_bridge(model):
    """``model`` converted by the project's own Keras export path (`tf_bridge.convert.convert_float_twin`,
    opset 17), its one graph input renamed ``input``."""
    from tf_bridge.convert import convert_float_twin

    proto = convert_float_twin(model, 17)
    old = proto.graph.input[0].name
    proto.graph.input[0].name = "input"
    for node in proto.graph.node:
        for position, tensor in enumerate(node.input):
            if tensor == old:
                node.input[position] = "input"
    return proto


def vit_encoder(*, size: int = 224, patch: int = 16, layers: int = 12, width: int = 768, heads: int = 12,
                mlp: int = 3072, classes: int = 1000, seed: int = 0):
    """A ViT encoder as ONNX (opset 17): patch Conv, class token and position embedding, ``layers``
    pre-norm blocks (LayerNormalization, Q/K/V MatMul + bias, scaled-dot-product attention over
    ``heads``, output projection, residual Add; LayerNormalization, MLP with Gelu (Erf form), residual),
    final LayerNormalization, the class token through a MatMul head. Weights normal(0, 0.02) as ViT
    initializes them; input ``input`` [N, 3, size, size]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    tokens, dh = (size // patch) ** 2 + 1, width // heads

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(name, shape, std=0.02):
        return const(name, (rng.standard_normal(shape) * std).astype(np.float32))

    def node(op, inputs, name, **attrs):
        nodes.append(helper.make_node(op, inputs, [f"{name}_out"], name=name, **attrs))
        return f"{name}_out"

    def linear(x, din, dout, name):
        y = node("MatMul", [x, weight(f"{name}.weight", [din, dout])], name)
        return node("Add", [y, const(f"{name}.bias", np.zeros(dout, np.float32))], f"{name}_bias")

    def layer_norm(x, name):
        return node("LayerNormalization", [x, const(f"{name}.gamma", np.ones(width, np.float32)),
                                           const(f"{name}.beta", np.zeros(width, np.float32))],
                    name, axis=-1, epsilon=1e-6)

    one = const("one", np.array(1.0, np.float32))
    half = const("half", np.array(0.5, np.float32))
    sqrt2 = const("sqrt2", np.array(np.sqrt(2.0), np.float32))
    heads_shape = const("heads_shape", np.array([0, tokens, heads, dh], np.int64))
    merge_shape = const("merge_shape", np.array([0, tokens, width], np.int64))
    x = node("Conv", ["input", weight("patch.weight", [width, 3, patch, patch]),
                      const("patch.bias", np.zeros(width, np.float32))], "patch",
             kernel_shape=[patch, patch], strides=[patch, patch])
    patch_shape = const("patch_shape", np.array([0, width, tokens - 1], np.int64))
    x = node("Reshape", [x, patch_shape], "patch_reshape")
    x = node("Transpose", [x], "patch_tokens", perm=[0, 2, 1])
    cls = node("Expand", [weight("cls_token", [1, 1, width]),
                          node("Concat", [node("Slice", [node("Shape", [x], "shape"),
                                                         const("s0", np.array([0], np.int64)),
                                                         const("s1", np.array([1], np.int64))], "batch"),
                                          const("cls_rest", np.array([1, width], np.int64))], "cls_shape",
                               axis=0)], "cls")
    x = node("Concat", [cls, x], "tokens", axis=1)
    x = node("Add", [x, weight("pos_embed", [1, tokens, width])], "pos")
    scale = const("attn_scale", np.array(1.0 / np.sqrt(dh), np.float32))
    for i in range(layers):
        h = layer_norm(x, f"l{i}_ln1")
        q, k, v = (node("Transpose", [node("Reshape", [linear(h, width, width, f"l{i}_{t}"), heads_shape],
                                           f"l{i}_{t}_heads")], f"l{i}_{t}_t",
                        perm=[0, 2, 3, 1] if t == "k" else [0, 2, 1, 3]) for t in "qkv")
        scores = node("Mul", [node("MatMul", [q, k], f"l{i}_scores"), scale], f"l{i}_scale")
        ctx = node("MatMul", [node("Softmax", [scores], f"l{i}_softmax", axis=-1), v], f"l{i}_context")
        ctx = node("Reshape", [node("Transpose", [ctx], f"l{i}_merge_t", perm=[0, 2, 1, 3]), merge_shape],
                   f"l{i}_merge")
        x = node("Add", [x, linear(ctx, width, width, f"l{i}_proj")], f"l{i}_res1")
        h = linear(layer_norm(x, f"l{i}_ln2"), width, mlp, f"l{i}_fc1")
        erf = node("Erf", [node("Div", [h, sqrt2], f"l{i}_gelu_div")], f"l{i}_gelu_erf")
        gelu = node("Mul", [node("Mul", [h, half], f"l{i}_gelu_half"),
                            node("Add", [erf, one], f"l{i}_gelu_add")], f"l{i}_gelu")
        x = node("Add", [x, linear(gelu, mlp, width, f"l{i}_fc2")], f"l{i}_res2")
    x = layer_norm(x, "final_ln")
    cls_out = node("Gather", [x, const("cls_index", np.array(0, np.int64))], "cls_out", axis=1)
    logits = linear(cls_out, width, classes, "head")
    graph = helper.make_graph(nodes, "vit", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                          ["N", 3, size, size])],
                              [helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["N", classes])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tools.bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _tiny_cnn_model():
    from . import models

    return models.tiny_cnn()


# --------------------------------------------------------------------------- one model
def _session(model, threads: int = THREADS, optimize: bool = True):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = threads, 1, 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = str(model) if isinstance(model, (str, Path)) else model.SerializeToString()
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def _ort_uint8(path: Path, out: Path, name: str, calib: np.ndarray) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{name: calib[i:i + 1]} for i in range(len(calib))])

        def get_next(self):
            return next(self.batches, None)

    if not out.exists():
        quantize_static(str(path), str(out), Reader(), activation_type=QuantType.QUInt8,
                        weight_type=QuantType.QInt8)
    return out


def _outputs(session, name: str, data: np.ndarray) -> np.ndarray:
    return np.concatenate([session.run(None, {name: data[i:i + 1]})[0] for i in range(len(data))])


def measure_model(label: str, path: Path, name: str, calib: np.ndarray, test: np.ndarray, workdir: Path,
                  batches=BATCHES, rounds: Optional[int] = None, latency: bool = True,
                  bench: str = NAME, speed_goal: Optional[Goal] = None, where: str = "",
                  cpu_probe: Optional[dict] = None) -> List[Row]:
    """The rows of one model (see the module docstring); ``latency=False`` quantizes every site (the
    quick run: a tiny model's sites may all time slower in integer, and then nothing is written).
    ``bench``: the rows' benchmark name; ``speed_goal``: the goal of the ort-cpu speed-up over FP32
    (default ``>= 1.0``); ``where``: a note on the code path (`isa.describe`) for every row's detail;
    ``cpu_probe``: a dict that receives the three forms' files and their CPU time per run at batch 1
    (`cpu_times`; ours written to ``workdir``), for `run_isa`'s comparison with the native kernels."""
    import onnx_qat
    from onnx_qat.errors import PlacementError
    from onnx_qat.placement.cpu_latency import LatencyOptions

    profile = workdir / "latency_profile.json"
    options = LatencyOptions(profile=str(profile), threads=THREADS) if latency else None
    try:
        ours = onnx_qat.quantize(str(path), data={name: calib}, method="max", target="ort-cpu",
                                 progress=False, latency=options)  # cpu_vnni "auto": the width this CPU gives
    except PlacementError as exc:  # no quantized form faster than FP32 here: the FP32 model is the CPU form
        if options is None:
            raise
        return [Row(bench, f"{label}: ort-cpu speed-up over FP32, batch {batch}", 1.0,
                    speed_goal or Goal(">=", 1.0), f"nothing written, the FP32 model kept: {exc}{where}")
                for batch in batches]
    vnni = bool(ours.ort_cpu["cpu_vnni"])
    # the other weight width, every site integer: 7 bits where auto gave 8, 8 bits (--cpu-vnni) where it
    # gave 7 (there: the error of a form whose pair sums this CPU's kernels may saturate)
    other = onnx_qat.quantize(str(path), data={name: calib}, method="max", target="ort-cpu",
                              progress=False, cpu_vnni=not vnni)
    theirs = _ort_uint8(path, workdir / f"{path.stem}_ort_u8.onnx", name, calib)
    forms = {"fp32": path, "ours": ours.model, "ort": theirs}
    sessions = {k: _session(v) for k, v in forms.items()}
    load = "load {:.1f}/{:.1f}/{:.1f}".format(*os.getloadavg())
    rows = []
    for batch in batches:
        feed = {name: np.concatenate([test] * (1 + batch // len(test)))[:batch]}
        rows += _speed_rows(label, batch, sessions, feed, rounds, load + where, bench, speed_goal)
    if cpu_probe is not None:
        mine = workdir / f"{path.stem}_ours.onnx"
        mine.write_bytes(ours.model.SerializeToString())
        sample = workdir / f"{path.stem}_probe_input.npy"
        np.save(sample, test[:1])
        cpu_probe.update(files={"fp32": str(path), "ours": str(mine), "ort": str(theirs)}, input=name,
                         sample=str(sample), ms=cpu_times(sessions, {name: test[:1]}))
    ref = _outputs(sessions["fp32"], name, test)
    spread = float(ref.max() - ref.min()) or 1.0
    err_ours = float(np.abs(_outputs(sessions["ours"], name, test) - ref).mean()) / spread
    err_ort = float(np.abs(_outputs(sessions["ort"], name, test) - ref).mean()) / spread
    err_other = float(np.abs(_outputs(_session(other.model), name, test) - ref).mean()) / spread
    latency = ours.latency or {}
    whole = latency.get("whole_model", {})
    rows.append(Row(bench, f"{label}: ort-cpu error / onnxruntime uint8 form error", ratio(err_ours, err_ort),
                    Goal("<=", 1.0),
                    f"mean |output - FP32| / FP32 output range over {len(test)} samples: "
                    f"ort-cpu {err_ours:.4g}, onnxruntime {err_ort:.4g}; latency placement: "
                    f"{len(latency.get('kept_float', []))} of "
                    f"{len(latency.get('sites', []))} sites kept float, {whole.get('chosen', '-')} "
                    f"(whole-model timing {whole.get('source', '-')}); "
                    f"{_WIDTHS[vnni]} ({ours.ort_cpu['reason']}){where}"))
    if vnni:
        rows.append(Row(bench, f"{label}: 7-bit-weight form (any x86 CPU) error / onnxruntime form error",
                        ratio(err_other, err_ort), None,
                        f"the --no-cpu-vnni form, exact on CPUs without VNNI (every site integer): "
                        f"{err_other:.4g}{where}"))
    else:
        rows.append(Row(bench, f"{label}: 8-bit-weight form (--cpu-vnni) error / onnxruntime form error",
                        ratio(err_other, err_ort), None,
                        f"the --cpu-vnni form run on this CPU's kernels, whose 16-bit pair sums it may "
                        f"saturate (every site integer): {err_other:.4g}{where}"))
    return rows


def cpu_times(sessions, feed, runs: int = 7) -> dict:
    """Median CPU time (``time.process_time``, all threads of this process) per run of each session,
    in milliseconds, the sessions interleaved after one warm-up run each."""
    import time

    times = {k: [] for k in sessions}
    for session in sessions.values():
        session.run(None, feed)
    for _ in range(runs):
        for key, session in sessions.items():
            start = time.process_time()
            session.run(None, feed)
            times[key].append(time.process_time() - start)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


#: Speed rounds per batch: at least `MIN_ROUNDS`; then more while under `ROUND_SECONDS` and some
#: goal ratio's 95% interval is still wider than `SETTLED_WIDTH` of its median and holds 1.0, up to
#: `MAX_ROUNDS`.
MIN_ROUNDS, MAX_ROUNDS, ROUND_SECONDS, SETTLED_WIDTH = 7, 21, 40.0, 0.1
_SPEED = (("fp32", "ours", "ort-cpu speed-up over FP32", Goal(">=", 1.0)),
          ("ours", "ort", "ort-cpu time / onnxruntime uint8 form", Goal("<=", 1.0)),
          ("fp32", "ort", "onnxruntime uint8 form speed-up over FP32", None))


def _speed_rows(label: str, batch: int, sessions, feed, rounds: Optional[int], load: str, bench: str = NAME,
                speed_goal: Optional[Goal] = None) -> List[Row]:
    """The three speed rows of one batch: FP32, ours and onnxruntime's form run in rounds with the
    order rotated (`interleaved_rounds`), each ratio the median of its per-round ratios with a 95%
    interval (`paired_ratio`); a goal row whose interval holds 1.0 is a ``TIE`` (within noise).
    ``rounds``: exactly that many rounds (the quick run), or None for `MIN_ROUNDS` and more as above."""
    def settled(times):
        if len(times["fp32"]) < MIN_ROUNDS:
            return False
        for num, den, _, goal in _SPEED:
            mid, low, high = paired_ratio(times, num, den)
            if goal is not None and low <= 1.0 <= high and high - low > SETTLED_WIDTH * mid:
                return False
        return True

    quick = rounds is not None
    times = interleaved_rounds({k: (lambda s=s: s.run(None, feed)) for k, s in sessions.items()},
                               min_rounds=rounds if quick else MIN_ROUNDS,
                               max_rounds=rounds if quick else MAX_ROUNDS,
                               seconds=0.0 if quick else ROUND_SECONDS, warmup=1, settled=settled)
    n = len(times["fp32"])
    ms = {k: 1e3 * median_interval(v)[0] for k, v in times.items()}
    found = {(num, den): paired_ratio(times, num, den) for num, den, _, _ in _SPEED}
    spread = "; ".join(f"{num}/{den} {mid:.3f}x [{low:.3f}-{high:.3f}]" for (num, den), (mid, low, high)
                       in found.items())
    detail = (f"batch {batch}, {THREADS} threads, {n} rounds (order rotated), medians: "
              f"FP32 {ms['fp32']:.1f} ms, ort-cpu {ms['ours']:.1f} ms, onnxruntime uint8 {ms['ort']:.1f} ms; "
              f"median per-round ratios [95% interval]: {spread}; {load}")
    rows = []
    for num, den, what, goal in _SPEED:
        mid, low, high = found[(num, den)]
        if speed_goal is not None and (num, den) == ("fp32", "ours"):
            goal = speed_goal
        rows.append(Row(bench, f"{label}: {what}, batch {batch}", mid, goal, detail, interval=(low, high)))
    return rows


_WIDTHS = {True: "8-bit weights (cpu_vnni auto: this CPU sums int8 products in 32 bits)",
           False: "7-bit Conv/Gemm/MatMul weights"}
def wide_dot_products() -> bool:
    """True when ``cpu_vnni="auto"`` gives 8-bit weights on this CPU
    (`onnx_qat.placement.cpu_latency.wide_dot_products`): the benchmark's main form then has them,
    as onnxruntime's form does, and a further row gives the 7-bit form's error."""
    import platform

    from onnx_qat.placement.cpu_latency import machine_key, wide_dot_products as wide

    return wide(machine_key(THREADS)["flags"], platform.machine())[0]


# --------------------------------------------------------------------------- the benchmark
def _images(num: int, size: int, seed: int, channels_last: bool) -> np.ndarray:
    shape = (num, size, size, 3) if channels_last else (num, 3, size, size)
    return np.random.default_rng(seed).uniform(0, 255, shape).astype(np.float32)


def _cases(workdir: Path, quick: bool) -> List[Tuple[str, object]]:
    """``(label, builder)`` pairs; a builder returns ``(path, input name, calib, test)`` or raises."""
    import onnx

    def code_model(label, build, size, channels_last=False):
        def make():
            path = workdir / (re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + ".onnx")
            if not path.exists():
                onnx.save(build(), str(path))
            return (path, "input", _images(CALIB_SAMPLES, size, 1, channels_last),
                    _images(TEST_SAMPLES, size, 2, channels_last))
        return label, make

    if quick:
        return [code_model("tiny ViT", lambda: vit_encoder(size=32, patch=8, layers=2, width=64, heads=4,
                                                            mlp=128, classes=10), 32)]
    cases = []
    for name in KERAS_MODELS:
        def make(name=name):
            path = keras_model(name, workdir / f"keras_{name}.onnx")
            return path, "input", _images(CALIB_SAMPLES, 224, 1, True), _images(TEST_SAMPLES, 224, 2, True)
        cases.append((f"Keras {name}", make))
    cases.append(code_model("ViT-B/16-size encoder", vit_encoder, 224))
    cases.append(("PP-OCRv4 detector (real)", _detector))
    return cases


def _detector():
    from tools import real_models

    path = Path.home() / ".cache" / "onnx-qat-real-models" / "models" / "ocr-det.onnx"  # real_models' default
    if not path.exists():
        raise FileNotFoundError(f"{path} not cached (make real-models)")
    calib, test = real_models.inputs("ocr-det", "calib")["x"], real_models.inputs("ocr-det", "eval")["x"]
    return path, "x", calib, test


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the cpu_models rows (one SKIP row per model that cannot be built)."""
    return _run_cases(Path(workdir), Path(workdir), quick)


def _run_cases(models: Path, workdir: Path, quick: bool, *, bench: str = NAME, prefix: str = "",
               where: str = "", goals=None, only=None, probe: Optional[dict] = None) -> List[Row]:
    """The rows of every case (`_cases` in ``models``; quantized forms and the latency profile in
    ``workdir``); ``goals``: ``label -> Goal`` of the speed-up over FP32 where not ``>= 1.0``;
    ``only``: labels to measure (None: all); ``probe``: filled by the first model measured (the
    ``cpu_probe`` of `measure_model`, with its ``label``)."""
    rows: List[Row] = []
    for label, make in _cases(models, quick):
        if only and label not in only:
            continue
        try:
            path, name, calib, test = make()
            first = probe is not None and "label" not in probe
            rows += measure_model(prefix + label, path, name, calib, test, workdir,
                                  batches=(1, 2) if quick else BATCHES, rounds=2 if quick else None,
                                  latency=not quick, bench=bench, speed_goal=(goals or {}).get(label),
                                  where=where, cpu_probe=probe if first else None)
            if first:
                probe["label"] = prefix + label
        except Exception as exc:  # noqa: BLE001 - one model failing (no TensorFlow, no cache, an export
            # tf2onnx cannot convert) gives one SKIP row with the reason; the other models still run
            logger.warning("%s: %s skipped", bench, label, exc_info=True)
            why = f"{type(exc).__name__}: {exc}"[:200]
            rows.append(skip(bench, f"{prefix}{label}: ort-cpu speed-up over FP32", why))
    return rows


# --------------------------------------------------------------------------- the AVX2 code path
#: Benchmark name of the rows measured under a CPUID mask (`tools.bench.isa`).
ISA_NAME = "cpu_models_avx2"
#: The speed-up goal on the AVX2 path where it is not ``>= 1.0``: issue 29's "ResNet50 stays >= 2x on
#: AVX2" (bar: faster than FP32 at all).
ISA_GOALS = {"Keras ResNet50": Goal(">=", 2.0, 1.0)}
#: Seconds one masked child may run (every model, both batches, three forms each).
ISA_TIMEOUT = 4 * 3600


def run_avx2(workdir: Path, *, quick: bool = False) -> List[Row]:
    """The ``cpu_models_avx2`` rows: every model measured as `run` does, on onnxruntime's AVX2 kernels
    (`run_isa` with the ``avx2`` mask)."""
    return run_isa(Path(workdir), "avx2", quick=quick)


def run_isa(workdir: Path, mask: str = "avx2", *, quick: bool = False, only=None) -> List[Row]:
    """Measure the models in a child process whose CPUID reports ``mask``'s CPU (`tools.bench.isa`), so
    that onnxruntime runs that CPU's kernels on this one. The Keras exports are made here first (they do
    not depend on the kernels) and shared with `run`; onnxruntime's form, our forms and the latency
    profile are made inside the child, in ``workdir/isa_<mask>``, as they would be on such a CPU.
    One SKIP row, with the reason, where the mask cannot be set up (not Linux x86-64, no
    ``cpuid_fault`` CPU flag, no C compiler) or the child fails."""
    import json
    import tempfile

    from . import isa
    from .measure import python_module, run_process

    figure = f"{isa.MASKS[mask]} path: ort-cpu speed-up over FP32"
    try:
        library = isa.build_shim(workdir)
    except isa.Unavailable as exc:
        return [skip(ISA_NAME, figure, str(exc))]
    for label, make in _cases(workdir, quick):
        if label.startswith("Keras ") and (not only or label in only):
            try:  # the export alone, unmasked (TensorFlow's own kernels are not what is measured)
                keras_model(label.split(" ", 1)[1], workdir / f"keras_{label.split(' ', 1)[1]}.onnx")
            except Exception:  # noqa: BLE001 - the child then gives this model's SKIP row
                logger.warning("%s: export of %s failed", ISA_NAME, label, exc_info=True)
    with tempfile.TemporaryDirectory(prefix="onnx-qat-isa-") as tmp:
        out = Path(tmp) / "rows.json"
        args = python_module("tools.bench.cpu_models", "--isa", mask, "--workdir", str(workdir),
                             "--json", str(out), *(["--quick"] if quick else []),
                             *(a for label in (only or ()) for a in ("--model", label)))
        try:
            run_process(args, env=isa.masked_env(library, mask), timeout=ISA_TIMEOUT,
                        cwd=Path(__file__).resolve().parents[2])
        except RuntimeError as exc:
            return [skip(ISA_NAME, figure, f"the masked child failed: {exc}"[:300])]
        found = json.loads(out.read_text())
    return [_row(d) for d in found["rows"]] + _native_rows(found.get("probe") or {})


def _native_rows(probe: dict) -> List[Row]:
    """INFO rows: the first model's CPU time per run at batch 1 in the masked child against this
    (unmasked) process, each form: what the mask changed."""
    if not probe.get("ms"):
        return []
    sessions = {k: _session(v) for k, v in probe["files"].items()}
    native = cpu_times(sessions, {probe["input"]: np.load(probe["sample"], allow_pickle=False)})
    load = "load {:.1f}/{:.1f}/{:.1f}".format(*os.getloadavg())
    names = {"fp32": "FP32", "ours": "ort-cpu form", "ort": "onnxruntime uint8 form"}
    return [Row(ISA_NAME, f"{probe['label']}: {names[k]} CPU time per run, this path / native kernels, "
                          "batch 1", ratio(probe["ms"][k], native[k]), None,
                f"time.process_time per run, medians of 7 interleaved: {probe['ms'][k]:.1f} ms in the "
                f"masked process, {native[k]:.1f} ms in this unmasked one afterwards ({load}); the same "
                "model files and input")
            for k in ("fp32", "ours", "ort")]



def _row(data: dict) -> Row:
    goal = data.get("goal")
    return Row(data["bench"], data["figure"], data["value"], None if goal is None else Goal(**goal),
               data.get("detail", ""), data.get("unit", "x"),
               None if data.get("interval") is None else tuple(data["interval"]))


def _measure_masked(mask: str, workdir: Path, quick: bool, only, probe: Optional[dict] = None) -> List[Row]:
    """Inside the masked child: check the mask (`isa.check_masked`), then measure (``probe``: see
    `_run_cases`)."""
    from . import isa

    seen = isa.check_masked(mask)
    short = {"avx2": "AVX2 path", "avx2-vnni": "AVX2+AVX-VNNI path"}[mask]
    forms = workdir / f"isa_{mask}"
    forms.mkdir(parents=True, exist_ok=True)
    rows = _run_cases(workdir, forms, quick, bench=ISA_NAME, prefix=f"{short}: ",
                      where=f"; {isa.describe(seen)}", goals=ISA_GOALS, only=only, probe=probe)
    return rows


def main(argv=None) -> int:
    """``python -m tools.bench.cpu_models NAME --size S --out P``: export one Keras application.

    ``python -m tools.bench.cpu_models --isa avx2 --workdir W [--model LABEL ...] [--quick]``: the
    models measured on onnxruntime's AVX2 kernels (`run_isa`; ``--isa avx2-vnni``: with AVX-VNNI),
    the table printed. With ``--json FILE`` (as `run_isa` runs it, under the mask) the rows are
    measured in this process and written to FILE."""
    import argparse
    import json

    from .table import format_table

    parser = argparse.ArgumentParser(prog="python -m tools.bench.cpu_models")
    parser.add_argument("which", nargs="?", choices=KERAS_MODELS)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--out")
    parser.add_argument("--isa", choices=("avx2", "avx2-vnni"))
    parser.add_argument("--workdir")
    parser.add_argument("--model", action="append", help="a model's label ('Keras ResNet50'); repeatable")
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.which:
        if not args.out:
            parser.error("--out is required with a model name")
        _export_keras(args.which, args.size, Path(args.out))
        return 0
    if not (args.isa and args.workdir):
        parser.error("give a Keras model name, or --isa and --workdir")
    logging.basicConfig(level=logging.WARNING)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.json:
        probe: dict = {}
        rows = _measure_masked(args.isa, workdir, args.quick, args.model, probe)
        Path(args.json).write_text(json.dumps({"rows": [r.to_dict() for r in rows], "probe": probe}))
        return 0
    rows = run_isa(workdir, args.isa, quick=args.quick, only=args.model)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
