"""FP16 float parts on real and held-out models: the figures of docs/formats.md.

``python tools/float_parts_models.py [--workdir DIR] [--only NAME] [--size S] [--method M] [--eval-large]
[--draws K] [--json OUT]``
quantizes each model twice on its calibration inputs (``--method``, default ``max``), with FP32 and
with FP16 float parts
(``--float-dtype fp16``), and measures on its evaluation inputs (never calibrated on):

* the INT8 model's own rounding noise: the largest move of its cosine (4 seeds) when the input of
  every QuantizeLinear moves by an FP16-sized rounding error (uniform in +-2^-12, relative);
* the same with every weight's DequantizeLinear scale moved too, each value by its own FP16-sized
  factor (``jittered(..., weight_scales=True)``): FP16 float parts round those scales, and on some
  models that alone moves the cosine more than the activations' rounding (docs/formats.md, "Where
  the orientation classifier's drop comes from");
* the output cosine of each against the FP32 float model (FP16 through
  [`onnx_qat.formats.float_parts.emulate_in_fp32`][], FP16 storage with FP32 arithmetic, and through
  onnxruntime's own FP16 session);
* the *expected* drop (``--draws K``, default 16; 0 skips it): the mean over K rounding draws of the
  paired difference of output cosines, FP32 float parts minus FP16 float parts, each draw
  ``jittered(model, 2^-12, seed)`` applied to both forms with the same seed (the FP16 form through
  ``emulate_in_fp32``), with its standard error (the draws' standard deviation / sqrt(K)). A single
  drop is one draw of which INT8 codes FP16's roundings flip, as large as the rounding noise on a
  few inputs; averaging over draws leaves what FP16 costs whatever the codes' draw
  (docs/formats.md, "The expected drop");
* ``check``'s errors and warnings on the FP16 model;
* the FP32 Conv/ConvTranspose/MatMul/Gemm nodes outside the reported keep-list (must be none);
* the bytes of the float initializers, FP16 against FP32;
* the nodes kept FP32, by rule.

Models: the real pretrained ones of `tools.real_models` (from its download cache; a model not
there is reported as skipped) and ``keras.applications`` ResNet50, MobileNetV2, EfficientNetB0 and
ConvNeXtTiny (``weights=None``, batch normalization set from one batch of 0..255 images; exported
with TensorFlow in a child process once, into the workdir; inputs 0..255).

``--eval-large`` measures on more evaluation inputs where more can be made: 256 text lines for the
PP-OCR angle classifier (random phrases of the evaluation vocabulary, both angles, seeded;
``--angle-lines`` sets the count) instead of its 16, the PP-OCRv4 recognizer's 16 evaluation lines and
128 more random phrases of its evaluation vocabulary (``--recognizer-lines``), the PP-OCR detector's 8
evaluation inputs
and 32 more rendered pages of 6 random phrases each (``--detector-pages``), the document
orientation classifier's 16 and 64 more rendered pages of 4 random phrases each, turned by 0, 90,
180 and 270 degrees in turn (``--orientation-pages``), and 64 images instead of 8 for the Keras
models. A drop of 0.002 in the output cosine is below what 8 or 16 samples
resolve on some models (see the rounding-noise column); the larger set tells a real FP16 cost from
a few samples near a decision boundary. The line above the table gives the machine (CPU model,
cores) and the load average at the start and end of the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Dict

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REAL = ("ocr-det", "ocr-rec", "ocr-cls", "orientation", "magika")
#: silero-vad (``silero_vad/data/silero_vad.onnx`` of the ``silero-vad`` 6.2.3 wheel, as the tests cache
#: it): stateful, its whole network inside an If; calibrated on ``tests/data/speech/calibration.wav`` and
#: measured on ``evaluation.wav`` (77 chunks of 512 samples), its state fed back step by step.
VAD = "silero-vad"
VAD_MODEL = Path.home() / ".cache" / "onnx-qat-test-models" / "silero-vad-6.2.3" / "silero_vad.onnx"
WEIGHTED = ("Conv", "ConvTranspose", "MatMul", "Gemm")


#: size of the rounding draws of the noise columns and of the expected drop: uniform in +-2^-12, relative
JITTER = 2.0**-12


def expected_drop(cosine, q32, q16_emulated, draws: int) -> dict:
    """The expected drop of the output cosine from FP32 to FP16 float parts over ``draws`` rounding
    draws: for each seed ``k`` the paired difference ``cosine(jittered(q32, JITTER, k)) -
    cosine(jittered(q16_emulated, JITTER, k))`` (the same seed moves the same QuantizeLinear inputs
    by the same factors in both forms), and the mean of those differences with its standard error.

    ``cosine`` maps a model to its output cosine against the FP32 float model on the evaluation
    inputs; ``q16_emulated`` is the FP16 form through ``emulate_in_fp32``. Returns ``{"draws",
    "mean", "se", "diffs", "fp32", "fp16"}`` (``fp32`` / ``fp16``: the mean cosine of each form over
    the draws), or ``{}`` when ``draws`` is 0."""
    from onnx_qat.formats.float_parts import jittered

    if draws <= 0:
        return {}
    a = np.array([cosine(jittered(q32, JITTER, k)) for k in range(draws)])
    b = np.array([cosine(jittered(q16_emulated, JITTER, k)) for k in range(draws)])
    diffs = a - b
    se = float(diffs.std(ddof=1) / np.sqrt(draws)) if draws > 1 else float("nan")
    return {"draws": draws, "mean": float(diffs.mean()), "se": se, "diffs": diffs.tolist(),
            "fp32": float(a.mean()), "fp16": float(b.mean()), "fp32_draws": a.tolist()}


def _noise(cos32: float, cosine, model, expected: dict) -> float:
    """The noise column: the largest move of ``cos32`` over the draws of seeds 0-3 (those of
    ``expected``'s FP32 form where it made them: the same models)."""
    from onnx_qat.formats.float_parts import jittered

    draws = expected.get("fp32_draws", [])[:4]
    draws += [cosine(jittered(model, JITTER, seed)) for seed in range(len(draws), 4)]
    return max(abs(cos32 - c) for c in draws)


def _keras_inputs(path: Path, size: int, split: str, large: bool = False) -> Dict[str, np.ndarray]:
    import onnx

    from tools.bench.models import images

    name = onnx.load(str(path), load_external_data=False).graph.input[0].name
    count = 16 if split == "calib" else (64 if large else 8)
    return {name: images(count, size, seed=1 if split == "calib" else 2)}


def _eval_phrases(count: int, seed: int):
    """``count`` random phrases of 2-6 words of the evaluation vocabulary (seeded), none a calibration
    line."""
    import random

    from tools import real_models

    rng = random.Random(seed)
    vocab = " ".join(real_models.EVAL_WORDS).split()
    texts = []
    while len(texts) < count:
        text = " ".join(rng.choice(vocab) for _ in range(rng.randint(2, 6)))
        if text not in real_models.CALIB_WORDS:
            texts.append(text)
    return texts


def _angle_lines(count: int = 256, seed: int = 0) -> Dict[str, np.ndarray]:
    """``count`` text lines for the PP-OCR angle classifier, none of them a calibration line: random
    phrases of 2-6 words of the evaluation vocabulary, every other one turned by 180 degrees."""

    from tools import real_models

    texts = _eval_phrases(count, seed)
    images = [real_models._text_image(t, 48, 192, angle=180 * (i % 2)) for i, t in enumerate(texts)]
    return {"x": real_models._normalise(images, (0.5,) * 3, (0.5,) * 3)}


def _recognizer_lines(count: int = 128, seed: int = 0) -> Dict[str, np.ndarray]:
    """The PP-OCRv4 recognizer's 16 evaluation lines and ``count`` more: random phrases of 2-6 words of
    the evaluation vocabulary (seeded, none a calibration line), rendered and normalized as its inputs."""

    from tools import real_models

    texts = _eval_phrases(count, seed)
    images = [real_models._text_image(t, 48, 320) for t in texts]
    more = real_models._normalise(images, (0.5,) * 3, (0.5,) * 3)
    return {"x": np.concatenate([real_models.inputs("ocr-rec", "eval")["x"], more])}


def _detector_pages(count: int = 32, seed: int = 0) -> Dict[str, np.ndarray]:
    """The PP-OCR detector's evaluation inputs and ``count`` more 320 x 320 pages of 6 lines of 2-5
    random words of the evaluation vocabulary each (seeded), normalized as its inputs are."""
    import random

    from tools import real_models

    rng = random.Random(seed)
    vocab = " ".join(real_models.EVAL_WORDS).split()
    def phrase() -> str:
        return " ".join(rng.choice(vocab) for _ in range(rng.randint(2, 5)))

    pages = [real_models._page([phrase() for _ in range(6)], 320) for _ in range(count)]
    more = real_models._normalise(pages, *real_models.IMAGENET, bgr=True)
    return {"x": np.concatenate([real_models.inputs("ocr-det", "eval")["x"], more])}


def _orientation_pages(count: int = 64, seed: int = 0) -> Dict[str, np.ndarray]:
    """The document orientation classifier's 16 evaluation inputs and ``count`` more 224 x 224 pages of
    4 lines of 2-5 random words of the evaluation vocabulary each (seeded), turned by 0, 90, 180 and
    270 degrees in turn, normalized as its inputs are."""
    import random

    from tools import real_models

    rng = random.Random(seed)
    vocab = " ".join(real_models.EVAL_WORDS).split()

    def phrase() -> str:
        return " ".join(rng.choice(vocab) for _ in range(rng.randint(2, 5)))

    pages = [np.ascontiguousarray(np.rot90(real_models._page([phrase() for _ in range(4)], 224), k=i % 4))
             for i in range(count)]
    more = real_models._normalise(pages, *real_models.IMAGENET)
    return {"x": np.concatenate([real_models.inputs("orientation", "eval")["x"], more])}


def _outputs(model, feeds, exact: bool = True) -> np.ndarray:
    from onnx_qat.runtime.sessions import make_session

    session = make_session(model, optimize=False if exact else True)
    count = len(next(iter(feeds.values())))
    fixed = any(isinstance(d, int) and d == 1 for d in (session.get_inputs()[0].shape or [])[:1])
    step = 1 if fixed else count
    parts = [session.run(None, {k: v[i : i + step] for k, v in feeds.items()}) for i in range(0, count, step)]
    return np.concatenate(
        [
            np.concatenate(
                [
                    np.asarray(p[j], np.float64).reshape(len(p[j]) if np.ndim(p[j]) else 1, -1)
                    for j in range(len(p))
                ],
                axis=1,
            )
            for p in parts
        ]
    )


def _fp32_weighted(model, kept) -> list:
    from onnx_qat.formats.float_cast import tensor_types

    types = tensor_types(model)
    return [
        n.name
        for n in model.graph.node
        if n.op_type in WEIGHTED and types.get(n.output[0]) == 1 and n.name not in kept
    ]


def _float_bytes(model, everywhere: bool = False) -> int:
    """Bytes of the float initializers of the main graph (``everywhere``: also of If/Loop/Scan bodies,
    and Constant values)."""
    from onnx_qat.formats.float_cast import all_graphs

    sizes = {1: 4, 10: 2, 16: 2}
    graphs = all_graphs(model) if everywhere else [model.graph]
    tensors = [t for g in graphs for t in g.initializer]
    if everywhere:
        tensors += [a.t for g in graphs for n in g.node if n.op_type == "Constant" for a in n.attribute
                    if a.name == "value"]
    return sum(
        int(np.prod(t.dims, dtype=np.int64)) * sizes[t.data_type] for t in tensors if t.data_type in sizes
    )


def _vad_probs(model, signal) -> np.ndarray:
    """silero-vad's speech probability per 512-sample chunk of ``signal``, its state fed back."""
    from onnx_qat.runtime.sessions import make_session
    from tests.onnx_qat.test_stateful_vad import RATE, chunks

    session = make_session(model, optimize=False)
    state, probs = np.zeros((2, 1, 128), np.float32), []
    for x in chunks(signal):
        feed = {"input": x, "state": state, "sr": np.array(RATE, np.int64)}
        prob, state = session.run(["output", "stateN"], feed)
        probs.append(float(np.ravel(prob)[0]))
    return np.array(probs, np.float64)


def measure_vad(path: Path, workdir: Path, method: str = "max", draws: int = 0) -> dict:
    """`measure` for silero-vad: the probability sequences of the evaluation clip, state fed back."""
    import onnx_qat
    from onnx_qat.formats.float_parts import emulate_in_fp32, jittered, kept_fp32_nodes
    from tests.onnx_qat.test_stateful_vad import feeds, speech

    steps = feeds(speech("calibration.wav"))
    calib = workdir / "silero_vad_calib.npz"
    np.savez(calib, input=np.concatenate([f["input"] for f in steps]), state=steps[0]["state"],
             sr=steps[0]["sr"])
    options = dict(data=str(calib), state={"stateN": "state"}, method=method, progress=False)
    q32 = onnx_qat.quantize(str(path), **options)
    q16 = onnx_qat.quantize(str(path), float_dtype="fp16", **options)
    signal = speech("evaluation.wav")
    ref = _vad_probs(onnx_qat.io.models.load_model(str(path)), signal)

    def cosine(model) -> float:
        got = _vad_probs(model, signal)
        return float(ref @ got / np.linalg.norm(ref) / np.linalg.norm(got))

    cos32 = cosine(q32.model)
    expected = expected_drop(cosine, q32.model, emulate_in_fp32(q16.model, "fp16"), draws)
    noise = _noise(cos32, cosine, q32.model, expected)
    noise_weights = max(abs(cos32 - cosine(jittered(q32.model, JITTER, seed, weight_scales=True)))
                        for seed in range(4))
    cos16 = cosine(emulate_in_fp32(q16.model, "fp16"))
    report = onnx_qat.check(q16.model)
    kept = {k.node: k for k in q16.float_parts.kept}
    marked = kept_fp32_nodes(q16.model)
    outside = [n.node for n in report.precision_map.fp32_compute(weighted_only=True) if n.node not in marked]
    p32, p16 = _vad_probs(q32.model, signal), _vad_probs(emulate_in_fp32(q16.model, "fp16"), signal)
    return {
        "model": VAD,
        "cosine_fp32_parts": cos32,
        "cosine_fp16_parts": cos16,
        "cosine_fp16_ort": cosine(q16.model),
        "drop": cos32 - cos16,
        "rounding_noise": noise,
        "rounding_noise_weight_scales": noise_weights,
        "expected_drop": expected,
        "decisions_agree": float(np.mean((p32 > 0.5) == (p16 > 0.5))),
        "measured_on_data": dict(q16.float_parts.measurement or {}),
        "check_errors": len(report.errors),
        "check_warnings": len(report.warnings),
        "fp32_weighted_outside_keep_list": outside,
        "float_bytes_ratio": _float_bytes(q16.model, True) / max(_float_bytes(q32.model, True), 1),
        "kept": len(kept),
        "kept_by_rule": dict(Counter(k.rule for k in kept.values())),
        "kept_weighted": sorted(k.node for k in kept.values() if k.op_type in WEIGHTED),
        "eval_samples": len(ref),
    }


def measure(name: str, path: Path, calib, evaluation, method: str = "max", draws: int = 0) -> dict:
    import onnx_qat
    from onnx_qat.formats.float_parts import emulate_in_fp32, jittered
    from onnx_qat.runtime.compare import output_figures

    q32 = onnx_qat.quantize(str(path), data=calib, method=method, progress=False)
    q16 = onnx_qat.quantize(str(path), data=calib, method=method, float_dtype="fp16", progress=False)
    ref = _outputs(onnx_qat.io.models.load_model(str(path)), evaluation)

    def cosine(model) -> float:
        return output_figures(ref, _outputs(model, evaluation))["cosine"]

    cos32 = cosine(q32.model)
    expected = expected_drop(cosine, q32.model, emulate_in_fp32(q16.model, "fp16"), draws)
    # the INT8 model's own rounding noise on these inputs: the largest move of its cosine when every
    # QuantizeLinear input moves by FP16-sized rounding errors (uniform in +-2^-12 relative, 4 seeds)
    noise = _noise(cos32, cosine, q32.model, expected)
    noise_weights = max(abs(cos32 - cosine(jittered(q32.model, JITTER, seed, weight_scales=True)))
                        for seed in range(4))
    cos16 = cosine(emulate_in_fp32(q16.model, "fp16"))
    native = cosine(q16.model)
    report = onnx_qat.check(q16.model)
    kept = {k.node: k for k in q16.float_parts.kept}
    return {
        "model": name,
        "cosine_fp32_parts": cos32,
        "cosine_fp16_parts": cos16,
        "cosine_fp16_ort": native,
        "drop": cos32 - cos16,
        "rounding_noise": noise,
        "rounding_noise_weight_scales": noise_weights,
        "expected_drop": expected,
        "measured_on_data": dict(q16.float_parts.measurement or {}),
        "check_errors": len(report.errors),
        "check_warnings": len(report.warnings),
        "fp32_weighted_outside_keep_list": _fp32_weighted(q16.model, kept),
        "float_bytes_ratio": _float_bytes(q16.model) / max(_float_bytes(q32.model), 1),
        "kept": len(kept),
        "kept_by_rule": dict(Counter(k.rule for k in kept.values())),
        "kept_weighted": sorted(k.node for k in kept.values() if k.op_type in WEIGHTED),
        "eval_samples": len(next(iter(evaluation.values()))),
    }


def machine() -> str:
    """The CPU model, the cores and the load average (1, 5, 15 minutes) of this machine."""
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return f"{model}, {os.cpu_count()} cores, load average {load}"


def table(rows) -> str:
    lines = [
        "| model | cosine FP32 parts | cosine FP16 parts | drop | expected drop +- s.e. (draws) | "
        "INT8 rounding noise | with weight scales | check errors / warnings | "
        "FP32 weighted ops outside keep-list | float bytes FP16/FP32 | kept FP32 (by rule) | eval inputs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['model']} | skipped: {r['skipped']} | | | | | | | | | | |")
            continue
        rules = ", ".join(f"{k} {v}" for k, v in sorted(r["kept_by_rule"].items())) or "none"
        e = r.get("expected_drop") or {}
        expected = f"{e['mean']:+.1e} +- {e['se']:.1e} ({e['draws']})" if e else "-"
        lines.append(
            f"| {r['model']} | {r['cosine_fp32_parts']:.5f} | {r['cosine_fp16_parts']:.5f} | "
            f"{r['drop']:+.1e} | {expected} | {r['rounding_noise']:.1e} | "
            f"{r['rounding_noise_weight_scales']:.1e} | "
            f"{r['check_errors']} / {r['check_warnings']} | "
            f"{len(r['fp32_weighted_outside_keep_list'])} | {r['float_bytes_ratio']:.2f} | "
            f"{r['kept']} ({rules}) | {r['eval_samples']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    from tools import real_models
    from tools.bench.models import KERAS_APPS, keras_app

    parser = argparse.ArgumentParser(
        prog="python tools/float_parts_models.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--workdir", default=str(Path.home() / ".cache" / "onnx-qat-real-models"))
    parser.add_argument(
        "--only", action="append", default=None, choices=list(REAL) + [VAD] + list(KERAS_APPS)
    )
    parser.add_argument("--size", type=int, default=160, help="input size of the Keras models")
    parser.add_argument("--method", default="max", help="calibration method (default max: fast)")
    parser.add_argument("--eval-large", action="store_true",
                        help="more evaluation inputs where they can be made (angle classifier, Keras models)")
    parser.add_argument("--angle-lines", type=int, default=256,
                        help="with --eval-large: text lines for the angle classifier (default 256)")
    parser.add_argument("--recognizer-lines", type=int, default=128,
                        help="with --eval-large: text lines added to the recognizer's 16 (default 128)")
    parser.add_argument("--detector-pages", type=int, default=32,
                        help="with --eval-large: pages added to the detector's 8 inputs (default 32)")
    parser.add_argument("--orientation-pages", type=int, default=64,
                        help="with --eval-large: pages added to the orientation classifier's 16 inputs "
                             "(default 64)")
    parser.add_argument("--draws", type=int, default=16,
                        help="rounding draws of the expected drop (default 16; 0 skips it)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    start = machine()
    workdir = Path(args.workdir)
    rows = []
    for name in args.only or list(REAL) + [VAD] + list(KERAS_APPS):
        print(f"[float-parts] {name} ...", file=sys.stderr, flush=True)
        try:
            if name == VAD:
                if not VAD_MODEL.exists():
                    rows.append({"model": name, "skipped": f"{VAD_MODEL} missing (run tests/onnx_qat/"
                                                          "test_stateful_vad.py online once)"})
                else:
                    rows.append(measure_vad(VAD_MODEL, workdir, args.method, args.draws))
                print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
                continue
            if name in REAL:
                path = workdir / "models" / f"{name}.onnx"
                if not path.exists():
                    rows.append(
                        {"model": name, "skipped": f"{path} missing (run tools/real_models.py online)"}
                    )
                    continue
                calib, evaluation = real_models.inputs(name, "calib"), real_models.inputs(name, "eval")
                if args.eval_large and name == "ocr-cls":
                    evaluation = _angle_lines(args.angle_lines)
                elif args.eval_large and name == "ocr-rec":
                    evaluation = _recognizer_lines(args.recognizer_lines)
                elif args.eval_large and name == "ocr-det":
                    evaluation = _detector_pages(args.detector_pages)
                elif args.eval_large and name == "orientation":
                    evaluation = _orientation_pages(args.orientation_pages)
            else:
                path = keras_app(name, workdir / f"keras_{name}_{args.size}.onnx", args.size)
                calib, evaluation = (
                    _keras_inputs(path, args.size, "calib"),
                    _keras_inputs(path, args.size, "eval", args.eval_large),
                )
            rows.append(measure(name, path, calib, evaluation, args.method, args.draws))
        except Exception as exc:  # noqa: BLE001 - one model failing must not hide the others
            rows.append({"model": name, "skipped": f"failed: {type(exc).__name__}: {exc}"[:200]})
        print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
    print(f"machine: {start}; at the end: load average {machine().rsplit('load average ', 1)[1]}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": start, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
