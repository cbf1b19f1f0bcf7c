"""The ``ort-cpu`` form of the real PP-OCRv4 text detector against onnxruntime's own ``quantize_static``
uint8 form, on the inputs ``tools.bench.sensitivity`` uses (8 photos, then 8 rendered text pages, for
calibration and for evaluation; docs/performance.md, "The detector's error on photos").

The model comes from the ``rapidocr-onnxruntime`` wheel (``pip download``, cached); the test skips with
the reason when it cannot be fetched or scikit-image/Pillow (the inputs) are missing."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import onnx_qat
from tests.builders import assert_check_clean


def _error(reference: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Mean |output - FP32| per input, as a fraction of FP32's output range over the same inputs."""
    spread = float(reference.max() - reference.min())
    return np.abs(output - reference).reshape(len(reference), -1).mean(axis=1) / spread


def _outputs(model, data: np.ndarray) -> np.ndarray:
    """The first output on each input (one at a time), onnxruntime CPU with all optimizations, as deployed."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 2
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"x": data[i:i + 1]})[0] for i in range(len(data))])


def _ort_uint8(path: Path, out: Path, calib: np.ndarray) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{"x": calib[i:i + 1]} for i in range(len(calib))])

        def get_next(self):
            return next(self.feeds, None)

    quantize_static(str(path), str(out), Reader(), activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)
    return out


def test_detector_guard_judges_photos_and_pages_and_the_form_is_within_onnxruntime_s(tmp_path):
    """Calibrated with ``method="max"`` on 8 photos then 8 pages: rule CPU7's guard now judges all 16 and
    leaves the correction out (measured 0.0235 with it, 0.0175 without; judged on the first 8, photos
    only, it was kept at 0.00608 against 0.00617 and made the error on the evaluation pages 1.33x
    larger). Against onnxruntime's uint8 form on the 16 evaluation inputs: 0.45x its error (0.0177
    against 0.0395), 0.37x on the pages. On the 8 photos the form's error is 2.6x onnxruntime's
    (0.0075 against 0.0029), all of it from one photo (the clock) whose text region (5,000 pixels) the
    form drops and onnxruntime's form keeps (3.3x its error there); on the other 7 photos the two
    errors are equal (0 on six, 0.011258 on the moon, a region both forms drop). The docs give the
    diagnosis (a bistable output: on 136 views of the evaluation photos the two forms' mean errors are
    0.001693 and 0.001686)."""
    pytest.importorskip("skimage")
    pytest.importorskip("PIL")
    from tests.onnx_qat.test_real_models import wheel_member
    from tools.bench.sensitivity import _detector_inputs

    path = wheel_member("rapidocr-onnxruntime==1.4.4",
                        "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx")
    calib = _detector_inputs("calib")["x"].astype(np.float32)
    test = _detector_inputs("eval")["x"].astype(np.float32)
    result = onnx_qat.quantize(str(path), data={"x": calib}, method="max", target="ort-cpu", progress=False,
                               cpu_vnni=True)
    guard = result.ort_cpu["bias_correction"]["guard"]
    assert guard["samples"] == 16 and not guard["kept"]
    assert guard["error_corrected"] > 1.2 * guard["error_plain"]
    assert_check_clean(result.model, target="ort-cpu")

    theirs = _ort_uint8(path, tmp_path / "det_u8.onnx", calib)
    photos, pages = slice(0, 8), slice(8, 16)
    outputs = {name: _outputs(model, test) for name, model in
               (("fp32", str(path)), ("ours", result.model), ("ort", str(theirs)))}
    ref = outputs["fp32"]
    ours, ort = (_error(ref, outputs[k]).mean() for k in ("ours", "ort"))
    assert ours < 0.6 * ort  # measured 0.45x
    ours_pages, ort_pages = (_error(ref[pages], outputs[k][pages]).mean() for k in ("ours", "ort"))
    assert ours_pages < 0.5 * ort_pages  # measured 0.37x
    per_ours, per_ort = (_error(ref[photos], outputs[k][photos]) for k in ("ours", "ort"))
    clock = 2  # EVAL_PHOTOS: cat, camera, clock, ...
    assert per_ours[clock] > 3 * per_ort[clock]  # the text region dropped (measured 3.3x)
    others = [i for i in range(8) if i != clock]
    assert np.abs(per_ours[others] - per_ort[others]).max() < 1e-4
