"""tools/float_parts_models.py's expected drop: paired rounding draws of both forms, mean and standard
error, on a MobileNetV2-style model built here."""
import numpy as np
import onnx
import pytest
from onnx import helper

import onnx_qat
from onnx_qat.formats.float_parts import emulate_in_fp32, jittered
from tests.builders import cosine, mobilenet_v2_model, random_inputs, run
from tools.float_parts_models import JITTER, _noise, expected_drop


@pytest.fixture(scope="module")
def forms():
    model = mobilenet_v2_model(size=32, batch="N", seed=3)
    calib, evaluation = random_inputs(model, 16, seed=1), random_inputs(model, 8, seed=2)
    q32 = onnx_qat.quantize(model, data=calib, method="max", progress=False).model
    q16 = onnx_qat.quantize(model, data=calib, method="max", float_dtype="fp16", progress=False).model
    ref = run(model, evaluation)[0]

    def cos(m) -> float:
        return cosine(ref, run(m, evaluation)[0])

    return q32, emulate_in_fp32(q16, "fp16"), cos


def _output_perturbed(model: onnx.ModelProto, size: float, seed: int = 0) -> onnx.ModelProto:
    """``model`` with its output multiplied by a fixed ``1 + size * n`` per element (``n`` standard
    normal, seeded): one perturbation that lowers the output cosine whatever the rounding draw."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    name = out.graph.output[0].name
    producer = next(n for n in out.graph.node if name in n.output)
    producer.output[list(producer.output).index(name)] = name + "/before"
    shape = [d.dim_value or 1 for d in out.graph.output[0].type.tensor_type.shape.dim]
    factor = 1 + size * np.random.default_rng(seed).standard_normal(shape[1:]).astype(np.float32)
    out.graph.initializer.append(onnx.numpy_helper.from_array(factor, name + "/factor"))
    out.graph.node.append(helper.make_node("Mul", [name + "/before", name + "/factor"], [name]))
    return out


def test_same_model_draws_pair_exactly(forms):
    """The same seed moves the same QuantizeLinear inputs by the same factors in both forms: the
    paired differences of a model with itself are all exactly 0, while the draws themselves move."""
    q32, _, cos = forms
    e = expected_drop(cos, q32, q32, 6)
    assert e["diffs"] == [0.0] * 6 and e["mean"] == 0.0 and e["se"] == 0.0
    assert len(set(e["fp32_draws"])) > 1, e["fp32_draws"]  # each seed a different rounding draw
    assert expected_drop(cos, q32, q32, 0) == {}


def test_mean_and_standard_error(forms):
    """mean = the mean of the paired differences = the difference of the two forms' mean cosines;
    s.e. = their standard deviation / sqrt(K); the noise column reuses the first 4 FP32 draws."""
    q32, q16, cos = forms
    e = expected_drop(cos, q32, q16, 8)
    a = np.array([cos(jittered(q32, JITTER, k)) for k in range(8)])
    b = np.array([cos(jittered(q16, JITTER, k)) for k in range(8)])
    assert np.allclose(e["diffs"], a - b, rtol=0, atol=1e-12)
    assert e["mean"] == pytest.approx(e["fp32"] - e["fp16"], abs=1e-12)
    assert e["se"] == pytest.approx(np.std(a - b, ddof=1) / np.sqrt(8), rel=1e-9)
    cos32 = cos(q32)
    assert _noise(cos32, cos, q32, e) == pytest.approx(np.max(np.abs(cos32 - a[:4])), abs=1e-12)
    # FP16 float parts of this model: no systematic cost beyond the budget
    assert abs(e["mean"]) < 0.002, e


def test_a_systematic_cost_stands_out(forms):
    """A fixed perturbation that costs whatever the draw (the output times 1 + 0.05 n) gives an
    expected drop beyond 2 standard errors, of the size of its single-draw drop; the same model
    against itself gives none."""
    q32, _, cos = forms
    worse = _output_perturbed(q32, 0.05)
    e = expected_drop(cos, q32, worse, 8)
    single = cos(q32) - cos(worse)
    assert single > 0.0005
    assert e["mean"] > 2 * e["se"] and e["mean"] == pytest.approx(single, rel=0.3), (e, single)
