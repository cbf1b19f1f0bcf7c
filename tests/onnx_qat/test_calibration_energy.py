"""``auto``'s per-sample output errors on outputs without a scale of their own: a constant-zero output
(zero energy) and an output the float model overflows (infinite reference values).

`onnx_qat.calibration.choice.output_energy` gives a zero-energy output the largest energy of the other
outputs (1.0 when all are zero) and leaves non-finite reference values out; `sample_errors` then
counts nothing where the reference is not finite. Every test runs with warnings turned into errors.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_qat
from onnx_qat.calibration import choice
from onnx_qat.calibration.choice import output_energy, sample_errors, worst_cosine
from tests import builders

pytestmark = pytest.mark.filterwarnings("error")


def test_a_zero_energy_output_counts_against_the_largest_energy():
    reference = {"y": np.array([1.0, 2.0, 3.0, 4.0], np.float32), "z": np.zeros(4, np.float32)}
    energy = output_energy(reference)
    assert energy == {"y": 30.0, "z": 30.0}
    same = {"y": [np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)], "z": [np.zeros((2, 2), np.float32)]}
    np.testing.assert_allclose(sample_errors(reference, same, energy), [0.0, 1.0 / 30.0])
    moved = {"y": same["y"], "z": [np.array([[0.0, 0.5], [2.0, 0.0]], np.float32)]}
    np.testing.assert_allclose(sample_errors(reference, moved, energy), [0.25 / 30.0, (1.0 + 4.0) / 30.0])
    # every output zero: squared errors as they are
    zeros = {"a": np.zeros(3), "b": np.zeros(2)}
    assert output_energy(zeros) == {"a": 1.0, "b": 1.0}
    got = {"a": [np.array([0.0, 0.0, 3.0])], "b": [np.array([0.0, 0.0])]}
    np.testing.assert_allclose(sample_errors(zeros, got, output_energy(zeros)), [9.0])


def test_non_finite_reference_values_are_left_out_of_energy_and_errors():
    reference = {"y": np.array([1.0, np.inf, 2.0, -np.inf, np.nan, 3.0], np.float32)}
    energy = output_energy(reference)
    assert energy == {"y": 14.0}
    got = {"y": [np.array([[1.0, 7.0], [2.0, np.inf], [5.0, 4.0]], np.float32)]}
    np.testing.assert_allclose(sample_errors(reference, got, energy), [0.0, 0.0, 1.0 / 14.0])
    assert worst_cosine(reference, {"y": got["y"][0].ravel()}) == pytest.approx(
        (1 + 4 + 12) / np.sqrt(14.0 * 21.0))
    # no finite value at all: zero energy, no error
    energy = output_energy({"y": np.array([np.inf, np.nan]), "z": np.array([2.0, 0.0])})
    assert energy == {"y": 4.0, "z": 4.0}
    # the finite outputs' energies are the sums of squares, unchanged
    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32).astype(np.float64)
    assert output_energy({"v": values})["v"] == float(np.dot(values, values))


def _conv_with_zero_output(seed: int) -> onnx.ModelProto:
    """x [N,8,6,6] -> Conv -> Relu -> Conv -> y; z = Relu(-|Conv(x)|), constant zero (both graph outputs)."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 8, 3, 3)).astype(np.float32) * 0.2, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 16, 3, 3)).astype(np.float32) * 0.2, "w2")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Abs", ["c1"], ["a1"], name="abs"),
             helper.make_node("Neg", ["a1"], ["n1"], name="neg"),
             helper.make_node("Relu", ["n1"], ["z"], name="relu_zero")]
    graph = helper.make_graph(nodes, "zero_output",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 6, 6]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 16, 6, 6])],
                              [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _recorded_errors(monkeypatch):
    """Every per-sample error array ``choose`` computes (the real function, its results kept)."""
    seen = []
    real = choice.sample_errors

    def recording(*args, **kwargs):
        errors = real(*args, **kwargs)
        seen.append((args[2], errors))
        return errors

    monkeypatch.setattr(choice, "sample_errors", recording)
    return seen


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 100.0), (2, 1e-3)])
def test_auto_calibration_of_a_model_with_a_constant_zero_output(monkeypatch, seed, scale):
    model = _conv_with_zero_output(seed)
    data = {"x": np.random.default_rng(seed).standard_normal((16, 8, 6, 6)).astype(np.float32) * scale}
    seen = _recorded_errors(monkeypatch)
    result = onnx_qat.quantize(model, data=data, method="auto", progress=False)
    assert len(seen) == 2  # max and the per-tensor table, both judged
    for energy, errors in seen:
        assert energy["z"] == energy["y"] > 0.0
        assert errors.shape == (16,) and np.all(np.isfinite(errors)) and np.all(errors >= 0.0)
        assert 0.0 < errors.mean() < 0.05, errors
    report = onnx_qat.check(result.model)
    assert not report.errors and not report.warnings, [str(i) for i in report.errors + report.warnings]
    import onnxruntime as ort

    session = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = session.run(["y", "z"], data)
    assert not np.any(z)
    float_session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (ref,) = float_session.run(["y"], data)
    cosine = float(np.dot(ref.ravel(), y.ravel()) / np.linalg.norm(ref) / np.linalg.norm(y))
    assert cosine > 0.99, cosine


def test_auto_calibration_of_an_overflowing_residual_chain(monkeypatch):
    """40 residual blocks of all-ones 1x1 convolutions: the float output is infinite on some values."""
    model = builders.residual_chain_model(40)
    data = builders.random_inputs(model, num=12, seed=7)
    seen = _recorded_errors(monkeypatch)
    onnx_qat.quantize(model, data=data, method="auto", progress=False)
    assert seen
    for energy, errors in seen:
        assert all(np.isfinite(e) and e > 0.0 for e in energy.values()), energy
        assert np.all(np.isfinite(errors)), errors
