"""fp8_method="gptq": error-compensating rounding of FP8 MatMul/Gemm weights on each output channel's
E4M3 grid. The rounded weights are stored bit for bit (they lie on the E4M3 grid of the scales the
inserter writes), a diagonal Hessian gives round to nearest, correlated inputs get a lower output
error than round to nearest, and the model passes check with 0 errors and 0 warnings."""
from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_qat
from onnx_qat.formats.blockwise import FP8_MAX, from_fp8, to_fp8
from onnx_qat.cli import EXIT_USAGE, main
from onnx_qat.formats.gptq import apply_gptq_fp8, gptq_round_fp8, output_error
from onnx_qat.runtime.sessions import run_model
from tests.builders import assert_check_clean, cosine, random_inputs, transformer_block_model
from tests.onnx_qat.test_gptq import _correlated


def _nearest(w: np.ndarray, amax: np.ndarray) -> np.ndarray:
    scale = (amax.astype(np.float64) / FP8_MAX).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0))  # an all-zero channel: any scale keeps it zero
    return from_fp8(to_fp8(w, scale)) * scale


def _stored_fp8_weights(model: onnx.ModelProto) -> dict:
    """``{float weight read by a MatMul/Gemm: dequantized FP8 initializer}`` of a written model."""
    inits = {t.name: t for t in model.graph.initializer}
    dqs = {n.output[0]: n for n in model.graph.node if n.op_type == "DequantizeLinear"}
    out = {}
    for node in model.graph.node:
        dq = dqs.get(node.input[1]) if node.op_type in ("MatMul", "Gemm") and len(node.input) > 1 else None
        if dq is None or dq.input[0] not in inits:
            continue
        proto = inits[dq.input[0]]
        assert proto.data_type == onnx.TensorProto.FLOAT8E4M3FN
        raw = np.frombuffer(proto.raw_data, np.uint8).reshape(tuple(proto.dims))
        scale = numpy_helper.to_array(inits[dq.input[1]])
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        shape = [1, 1]
        shape[axis] = -1
        out[node.name] = from_fp8(raw) * scale.reshape(shape)
    return out


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 255.0), (2, 1e-3)])
def test_rounded_weights_lie_exactly_on_the_e4m3_grid_of_their_scales(seed, scale):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((192, 48)) * scale).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero output channel stays zero
    x = _correlated(192, 1024, seed)
    amax = np.max(np.abs(w), axis=0)
    rounded = gptq_round_fp8(w, x.T.astype(np.float64) @ x, amax)
    assert rounded.dtype == np.float32 and not np.array_equal(rounded, _nearest(w, amax))
    assert np.array_equal(_nearest(rounded, amax), rounded)  # casting to E4M3 again changes nothing
    assert np.all(rounded[:, 3] == 0)


def test_a_diagonal_hessian_spreads_no_error_round_to_nearest_exactly():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((128, 32)).astype(np.float32)
    amax = np.max(np.abs(w), axis=0)
    rounded = gptq_round_fp8(w, np.diag(rng.uniform(0.5, 2.0, 128)), amax)
    assert np.array_equal(rounded, _nearest(w, amax))


@pytest.mark.parametrize("seed", [0, 4])
def test_correlated_inputs_get_a_lower_output_error_than_rounding_to_nearest(seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    amax = np.max(np.abs(w), axis=0)
    mix = np.random.default_rng(seed + 100).standard_normal((256, 256)) * 0.3 + np.eye(256)
    x = np.random.default_rng(seed + 200).standard_normal((2048, 256)) @ mix
    h = x.T @ x
    nearest, rounded = _nearest(w, amax), gptq_round_fp8(w, h, amax)
    assert output_error(w, rounded, h) < 0.6 * output_error(w, nearest, h)
    other = np.random.default_rng(seed + 300).standard_normal((2048, 256)) @ mix  # unseen rows
    ho = other.T @ other
    assert output_error(w, rounded, ho) < output_error(w, nearest, ho)


def test_quantize_stores_the_rounding_bit_for_bit_passes_check_and_beats_nearest_on_unseen_data():
    model = transformer_block_model(seq=8, dim=128, heads=2, seed=0)
    calib, test = random_inputs(model, 256, seed=1), random_inputs(model, 16, seed=2)
    ref = run_model(model, test)["output"]
    results = {m: onnx_qat.quantize(model, data=calib, precision="fp8", fp8_method=m, progress=False)
               for m in ("rtn", "gptq")}
    gptq = results["gptq"]
    assert_check_clean(gptq.model)
    assert len(gptq.gptq) == 6 and all(r["gptq_error"] < r["rtn_error"] for r in gptq.gptq), gptq.gptq
    assert not results["rtn"].gptq
    # the rounding's own output, on a copy of the float model, is what the FP8 initializers hold
    own = copy.deepcopy(model)
    records, ranges = apply_gptq_fp8(own, onnx_qat.place(model, precision="fp8"), calib)
    assert [r["weight"] for r in records] == [r["weight"] for r in gptq.gptq]
    floats = {n.name: n.input[1] for n in own.graph.node if n.op_type in ("MatMul", "Gemm")}
    inits = {t.name: numpy_helper.to_array(t) for t in own.graph.initializer}
    stored = _stored_fp8_weights(gptq.model)
    assert {floats[n] for n in stored} >= set(ranges)
    for node, values in stored.items():
        if floats[node] in ranges:
            assert np.array_equal(values, inits[floats[node]]), node
            assert gptq.scales.weights[floats[node]].amax == ranges[floats[node]].amax
    cos = {m: cosine(ref, run_model(r.model, test)["output"]) for m, r in results.items()}
    assert cos["gptq"] > cos["rtn"] > 0.99, cos


def test_fp8_method_is_validated(tmp_path, capsys):
    model = transformer_block_model(seq=8, dim=128, heads=2, seed=0)
    data = random_inputs(model, 4, seed=1)
    with pytest.raises(onnx_qat.ConfigError, match="fp8_method must be one of rtn, gptq"):
        onnx_qat.QuantizeConfig(precision="fp8", fp8_method="awq")
    with pytest.raises(onnx_qat.ConfigError, match="applies to precision fp8"):
        onnx_qat.quantize(model, data=data, fp8_method="gptq", progress=False)
    with pytest.raises(onnx_qat.ConfigError, match="does not combine with min_cosine"):
        onnx_qat.quantize(model, data=data, precision="fp8", fp8_method="gptq", min_cosine=0.99,
                          progress=False)
    rtn = onnx_qat.quantize(model, data=data, precision="fp8", fp8_method="rtn", progress=False)
    plain = onnx_qat.quantize(model, data=data, precision="fp8", progress=False)
    assert rtn.model.SerializeToString() == plain.model.SerializeToString()
    onnx.save(model, tmp_path / "m.onnx")
    scales = tmp_path / "s.json"
    plain.scales.save(scales)
    code = main(["quantize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx"), "--precision", "fp8",
                 "--scales", str(scales), "--fp8-method", "gptq"])
    assert code == EXIT_USAGE and "needs calibration data" in capsys.readouterr().err
    assert not (tmp_path / "q.onnx").exists()
    np.savez(tmp_path / "calib.npz", **random_inputs(model, 64, seed=1))
    code = main(["quantize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx"), "--precision", "fp8",
                 "--data", str(tmp_path / "calib.npz"), "--fp8-method", "gptq"])
    assert code == 0
    assert_check_clean(onnx.load(str(tmp_path / "q.onnx")))
