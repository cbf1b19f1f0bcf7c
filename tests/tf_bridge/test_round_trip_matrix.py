"""The round trip as a new user runs it, over keras.applications architectures and conditions.

README's workflow: ``quantize_model`` -> (``calibrate``) -> one epoch of ``fit`` -> ``export_onnx``
(strict parity), on untrained networks (``weights=None``) at 64-75 px, with inputs standard-normal
or uniform x255, calibrated or not, two seeds. Each case either exports with parity PASSED and a
check of 0 errors and 0 warnings, or, only where the float model trained the same way diverges
itself, fails with one line (an :class:`onnx_qat.errors.QatError`).

The whole matrix is ``slow``; a representative part (small architectures, one condition) runs in
``make test``. ``ROUND_TRIP_MATRIX_LOG=<file>`` appends one JSON line per case (result, seconds).
"""
import json
import os
import time

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import tf_bridge  # noqa: E402
from onnx_qat.errors import QatError  # noqa: E402
from tf_bridge import custom_qdq_cases as C  # noqa: E402

os.environ.setdefault("TF_BRIDGE_QUIET", "1")
A = keras.applications
pytestmark = pytest.mark.filterwarnings("ignore:tf_bridge.calibrate.*BatchNormalization",
                                        "ignore::UserWarning")

@pytest.fixture(autouse=True)
def _fresh_keras_session():
    """Each case's models, traced functions and graphs freed after it: without this, one process
    running the whole matrix grows past 10 GB (measured) and is killed for memory."""
    yield
    import gc

    keras.backend.clear_session()
    gc.collect()


#: name: (builder, custom QDQ cases, input size)
ARCHITECTURES = {
    "resnet50": (lambda **k: A.ResNet50(**k), lambda: [C.ResNetV1QDQCase()], 64),
    "resnet50v2": (lambda **k: A.ResNet50V2(**k), lambda: [C.ResNetV2QDQCase()], 64),
    "mobilenetv2": (lambda **k: A.MobileNetV2(**k), lambda: [C.MobileNetQDQCase()], 64),
    "mobilenetv3small": (lambda **k: A.MobileNetV3Small(**k), lambda: [C.MobileNetQDQCase()], 64),
    "efficientnetb0": (lambda **k: A.EfficientNetB0(**k), lambda: [C.EfficientNetQDQCase()], 64),
    "inceptionv3": (lambda **k: A.InceptionV3(**k), lambda: [C.InceptionQDQCase()], 75),
    "densenet121": (lambda **k: A.DenseNet121(**k), lambda: None, 64),
    "xception": (lambda **k: A.Xception(**k), lambda: None, 71),
    "convnexttiny": (lambda **k: A.ConvNeXtTiny(**k), lambda: None, 64),
}
INPUTS = ("normal", "uniform255")
SAMPLES = 16
BATCH = 8
#: The representative part that runs in ``make test`` (the smallest architecture; the mapping's
#: structural hazards have their own fast tests in ``test_mapping.py``).
FAST = [("mobilenetv3small", "normal", True, 0)]


def _data(kind: str, size: int, seed: int):
    rng = np.random.default_rng(seed)
    shape = (SAMPLES, size, size, 3)
    x = rng.normal(0.0, 1.0, shape) if kind == "normal" else rng.uniform(0.0, 255.0, shape)
    return x.astype("float32"), rng.integers(0, 10, SAMPLES).astype("int64")


def _build(name: str, seed: int):
    build, _, size = ARCHITECTURES[name]
    keras.utils.set_random_seed(seed)
    return build(weights=None, input_shape=(size, size, 3), classes=10)


def _fit(model, x, y):
    """README's compile and one epoch of fit (two steps); True when loss and weights stay finite."""
    model.compile("adam", "sparse_categorical_crossentropy")
    history = model.fit(x, y, epochs=1, batch_size=BATCH, verbose=0, shuffle=False)
    finite_loss = all(np.isfinite(v) for v in history.history["loss"])
    finite_weights = all(np.all(np.isfinite(w)) for w in model.get_weights())
    return finite_loss and finite_weights and bool(np.all(np.isfinite(model.predict(x, verbose=0))))


def float_diverges(name: str, kind: str, seed: int) -> bool:
    """Whether the float model, trained exactly as the QAT model is, goes non-finite."""
    x, y = _data(kind, ARCHITECTURES[name][2], seed)
    return not _fit(_build(name, seed), x, y)


def round_trip(name: str, kind: str, calibrate: bool, seed: int, path):
    """README's workflow on one case; returns ``(report or None, one-line error or None)``."""
    x, y = _data(kind, ARCHITECTURES[name][2], seed)
    model = _build(name, seed)
    try:
        q = tf_bridge.quantize_model(model, custom_qdq_cases=ARCHITECTURES[name][1]())
        if calibrate:
            tf_bridge.calibrate(q, x[:BATCH], progress=False)
        _fit(q, x, y)
        return tf_bridge.export_onnx(q, path, sample_data=x[:BATCH], progress=False), None
    except QatError as exc:
        return None, str(exc)


def int8_share(path) -> float:
    """The fraction of weighted ops (Conv, ConvTranspose, MatMul, Gemm) whose activation input and
    weight both come from a DequantizeLinear: the ops TensorRT runs in INT8. An activation read
    through a Pad counts (placement rule R8 puts the Q/DQ before a Pad that feeds a convolution, and
    TensorRT fuses the Pad into it: ZeroPadding2D before a strided depthwise convolution)."""
    import onnx

    model = onnx.load(str(path))
    dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    dq |= {n.output[0] for n in model.graph.node if n.op_type == "Pad" and n.input[0] in dq}
    weighted = [n for n in model.graph.node if n.op_type in ("Conv", "ConvTranspose", "MatMul", "Gemm")]
    int8 = [n for n in weighted if len(n.input) > 1 and n.input[0] in dq and n.input[1] in dq]
    return len(int8) / max(len(weighted), 1)


def _log(case: dict) -> None:
    target = os.environ.get("ROUND_TRIP_MATRIX_LOG")
    if target:
        with open(target, "a") as f:
            f.write(json.dumps(case) + "\n")


def _run_case(name, kind, calibrate, seed, tmp_path):
    start = time.perf_counter()
    report, error = round_trip(name, kind, calibrate, seed, tmp_path / f"{name}.onnx")
    case = {"arch": name, "input": kind, "calibrate": calibrate, "seed": seed,
            "seconds": round(time.perf_counter() - start, 1)}
    if report is not None:
        case.update(result="PASSED" if report.passed else "FAILED",
                    abs_error=max(o.abs_error for o in report.parity.outputs),
                    reference=report.parity.outputs[0].reference,
                    engines=",".join(o.engines for o in report.parity.outputs),
                    engines_abs_error=max(o.engines_abs_error for o in report.parity.outputs),
                    errors=len(report.check.errors), warnings=len(report.check.warnings),
                    int8_share=round(int8_share(report.path), 3))
        _log(case)
        assert report.passed, str(report)
        assert not report.check.errors and not report.check.warnings, report.check.summary()
        assert all(o.abs_error <= 0.02 and o.max_abs_float > 0 for o in report.parity.outputs), str(report)
        assert case["int8_share"] == 1.0, "a weighted op stays float"  # every one runs INT8 here
        return
    diverges = float_diverges(name, kind, seed)
    cause = "rounding cascade" if "FAILED (rounding cascade)" in error else "FAILED"
    case.update(result="float diverges" if diverges else cause, error=error)
    _log(case)
    assert "\n" not in error, error
    assert diverges, f"the float model trains finite, yet the QAT export failed: {error}"


@pytest.mark.parametrize("name,kind,calibrate,seed", FAST)
def test_round_trip_representative(name, kind, calibrate, seed, tmp_path):
    _run_case(name, kind, calibrate, seed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("calibrate", [True, False], ids=["calibrated", "uncalibrated"])
@pytest.mark.parametrize("kind", INPUTS)
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_round_trip_matrix(name, kind, calibrate, seed, tmp_path):
    if (name, kind, calibrate, seed) in FAST:
        pytest.skip("runs in test_round_trip_representative")
    _run_case(name, kind, calibrate, seed, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_readme_quickstart(name, tmp_path):
    """README's Keras quickstart, as written (calibrate, compile, fit, export), on random data."""
    x_train, y_train = _data("uniform255", ARCHITECTURES[name][2], 0)
    x_val = x_train[:8]
    model = _build(name, 0)
    q_model = tf_bridge.quantize_model(model, custom_qdq_cases=ARCHITECTURES[name][1]())
    tf_bridge.calibrate(q_model, x_train[:512])
    q_model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    q_model.fit(x_train, y_train, epochs=2, verbose=0)
    report = tf_bridge.export_onnx(q_model, tmp_path / "model.qdq.onnx", sample_data=x_val[:64])
    text = str(report)
    assert report.passed and text.startswith("export_onnx: PASSED"), text
    assert not report.check.errors and not report.check.warnings, report.check.summary()
