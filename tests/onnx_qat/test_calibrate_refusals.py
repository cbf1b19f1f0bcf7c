"""`calibrate` refuses the models `quantize` refuses, in the same words, before any run: a weight
placement quantizes that holds NaN or an infinity, and a model that is already quantized. No table is
written for a model that cannot be quantized afterwards."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_qat
from onnx_qat.cli import main
from tests.builders import mlp_model


def _with_bad_weight(name: str, value: float, index: int) -> onnx.ModelProto:
    model = mlp_model(features=16, hidden=32, classes=8, batch=1)
    for i, init in enumerate(model.graph.initializer):
        if init.name == name:
            array = numpy_helper.to_array(init).copy()
            array.reshape(-1)[index] = value
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(array, name))
    return model


def _data(tmp_path, samples: int = 4, scale: float = 1.0):
    path = tmp_path / "calib.npz"
    np.savez(path, input=(scale * np.random.default_rng(1).standard_normal((samples, 16))).astype(np.float32))
    return path


@pytest.mark.parametrize("name,value,index", [("fc2.weight", np.nan, 0), ("fc3.weight", np.inf, 17),
                                              ("fc1.weight", -np.inf, 511)])
@pytest.mark.parametrize("method", ["max", "auto"])
def test_calibrate_refuses_non_finite_weights_as_quantize_does(tmp_path, capsys, name, value, index, method):
    model_path = tmp_path / "bad.onnx"
    onnx.save(_with_bad_weight(name, value, index), str(model_path))
    before = model_path.read_bytes()
    data = _data(tmp_path, scale=255.0)
    with pytest.raises(onnx_qat.ModelError) as calibrated:
        onnx_qat.calibrate(str(model_path), str(data), method=method, progress=False)
    with pytest.raises(onnx_qat.ModelError) as quantized:
        onnx_qat.quantize(str(model_path), str(tmp_path / "q.onnx"), data=str(data), method=method,
                          progress=False)
    assert str(calibrated.value) == str(quantized.value)
    assert f"weight '{name}' holds 1 NaN or infinite value(s)" in str(calibrated.value)
    out = tmp_path / "scales.json"
    code = main(["calibrate", str(model_path), "--data", str(data), "-o", str(out), "--method", method,
                 "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("onnx-qat: error: model ")
    assert not out.exists() and not (tmp_path / "q.onnx").exists()
    assert model_path.read_bytes() == before


def test_calibrate_refuses_an_already_quantized_model(tmp_path):
    float_path, qdq_path = tmp_path / "mlp.onnx", tmp_path / "mlp.qdq.onnx"
    onnx.save(mlp_model(features=16, hidden=32, classes=8, batch=1), str(float_path))
    data = _data(tmp_path)
    onnx_qat.quantize(str(float_path), str(qdq_path), data=str(data), method="max", progress=False)
    words = "already quantized .*QuantizeLinear.*give the float model"
    with pytest.raises(onnx_qat.PlacementError, match=words):
        onnx_qat.calibrate(str(qdq_path), str(data), method="max", progress=False)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_finite_model_calibrates_as_before(tmp_path, seed):
    """The refusals read the weights only: a finite model's table is the one `quantize` uses."""
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(features=16, hidden=32, classes=8, batch=1, seed=seed), str(path))
    data = _data(tmp_path, samples=8)
    table = onnx_qat.calibrate(str(path), str(data), method="max", progress=False)
    result = onnx_qat.quantize(str(path), str(tmp_path / "q.onnx"), data=str(data), method="max",
                               progress=False)
    assert set(table.activations) == {"input", "relu1_out", "relu2_out"}
    assert result.scales.activations == table.activations
    assert all(np.isfinite(v) and v > 0 for v in table.activations.values())
