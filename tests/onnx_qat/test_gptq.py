"""int4_method="gptq": error-compensating INT4 rounding after AWQ's scales. The rounded weights lie
exactly on the grid their block ranges define, a diagonal Hessian gives round to nearest, correlated
inputs get a lower output error, the model passes check, and a weight mixed precision leaves float
keeps its float values."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_qat
from onnx_qat.formats.awq import search_clip
from onnx_qat.formats.blockwise import block_scale, dequantize_blocks, quantize_blocks
from onnx_qat.cli import EXIT_USAGE, main
from onnx_qat.formats.gptq import gptq_round, output_error
from onnx_qat.runtime.sessions import run_model
from tests.builders import assert_check_clean, cosine, random_inputs, transformer_block_model, weight_dqs
from tests.onnx_qat.test_mixed_formats import _grid_mlp, _mlp_inputs


def _correlated(k: int, rows: int, seed: int, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((k, k)) * 0.3 + np.eye(k)
    return (rng.standard_normal((rows, k)) @ mix * scale).astype(np.float32)


@pytest.mark.parametrize("block_size,seed,scale", [(64, 0, 1.0), (128, 1, 255.0), (64, 2, 1e-3)])
def test_rounded_weights_lie_exactly_on_the_int4_grid_of_their_ranges(block_size, seed, scale):
    """What the one inserter computes from the rounded weights and the ranges (quantize_blocks) gives
    the rounded weights back bit for bit, so the stored INT4 values are GPTQ's."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((256, 48)) * scale).astype(np.float32)
    x = _correlated(256, 1024, seed)
    rounded, amax = gptq_round(w, x.T.astype(np.float64) @ x, block_size)
    assert rounded.dtype == np.float32 and amax.shape == (256 // block_size, 48)
    q, s = quantize_blocks(rounded, 0, block_size, amax)
    assert np.array_equal(dequantize_blocks(q, s, 0, block_size), rounded)
    assert q.min() >= -8 and q.max() <= 7


def test_a_diagonal_hessian_spreads_no_error_round_to_nearest_exactly():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((128, 32)).astype(np.float32)
    h = np.diag(rng.uniform(0.5, 2.0, 128))
    rounded, amax = gptq_round(w, h, 64)
    q, s = quantize_blocks(w, 0, 64, amax)  # round to nearest of the original weights, same ranges
    assert np.array_equal(dequantize_blocks(q, s, 0, 64), rounded)


@pytest.mark.parametrize("seed", [0, 4])
def test_correlated_inputs_get_a_lower_output_error_than_rounding_to_nearest_and_clipping(seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    x = _correlated(256, 2048, seed)
    h = x.T.astype(np.float64) @ x
    q, s = quantize_blocks(w, 0, 64)
    rtn = output_error(w, dequantize_blocks(q, s, 0, 64), h)
    amax = search_clip(w, x, 64)
    q, s = quantize_blocks(w, 0, 64, amax)
    clipped = output_error(w, dequantize_blocks(q, s, 0, 64), h)
    rounded, _ = gptq_round(w, h, 64)
    gptq = output_error(w, rounded, h)
    assert gptq < 0.7 * clipped < 0.7 * rtn, (rtn, clipped, gptq)
    # on other rows of the same distribution it holds too (enough rows: 8 per input channel)
    other = _correlated(256, 2048, seed)[::-1] @ np.eye(256, dtype=np.float32)
    ho = other.T.astype(np.float64) @ other
    assert output_error(w, rounded, ho) < output_error(w, dequantize_blocks(q, s, 0, 64), ho)


def test_quantize_with_gptq_stores_its_rounding_passes_check_and_beats_awq_on_unseen_data():
    model = transformer_block_model(seq=8, dim=128, heads=2, seed=0)
    calib, test = random_inputs(model, 256, seed=1), random_inputs(model, 16, seed=2)
    ref = run_model(model, test)["output"]
    results = {m: onnx_qat.quantize(model, data=calib, precision="int4", block_size=64, int4_method=m,
                                    progress=False) for m in ("awq", "gptq")}
    gptq = results["gptq"]
    assert_check_clean(gptq.model)
    assert len(gptq.gptq) == 6 and all(r["gptq_error"] < r["rtn_error"] for r in gptq.gptq)
    assert gptq.awq and gptq.scales.producer == "gptq"
    report = gptq.to_report()
    assert [r["weight"] for r in report["gptq"]] == [r["weight"] for r in gptq.gptq]
    cos = {m: cosine(ref, run_model(r.model, test)["output"]) for m, r in results.items()}
    assert cos["gptq"] > cos["awq"] > 0.98, cos
    # every INT4 weight's scale is exactly the one of GPTQ's block ranges (the grid it rounded to)
    for (node, _), dq in weight_dqs(gptq.model).items():
        weight = next(n for n in model.graph.node if n.name == node).input[1]
        amax = np.asarray(gptq.scales.weights[weight].amax, np.float32).reshape(dq["scale"].shape)
        assert np.array_equal(block_scale(amax), dq["scale"]), node


def test_mixed_precision_with_gptq_leaves_the_outlier_weight_with_its_float_values():
    model = _grid_mlp()
    data = _mlp_inputs(64, 1)
    mixed = onnx_qat.quantize(model, data=data, precision="int4", block_size=64, int4_method="gptq",
                              min_cosine=0.995, progress=False)
    info = mixed.accuracy
    assert [s["name"] for s in info["float_sites"]] == ["lin3"] and info["weight_ranges"] == "gptq"
    assert info["cosine_after"] >= 0.995 and mixed.gptq
    assert_check_clean(mixed.model)
    # lin3 keeps its float weight as AWQ rescaled it (rows times s, 1/s in the Mul before it), not GPTQ's
    # rounded values: undoing the scale gives the original weight back up to float rounding
    inits = {t.name: numpy_helper.to_array(t) for t in mixed.model.graph.initializer}
    kept, original = inits["lin3.weight"], numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == "lin3.weight"))
    record = next(r for r in mixed.awq if r["weights"] == ["lin3.weight"])
    assert record["alpha"] > 0
    inverse = inits[f"{record['activation']}_awq_inv_scale"]
    assert np.allclose(kept * inverse[:, None], original, rtol=1e-5, atol=0)
    q, s = quantize_blocks(kept, 0, 64)
    assert not np.array_equal(dequantize_blocks(q, s, 0, 64), kept)  # not on an INT4 grid


def test_int4_method_is_validated(tmp_path, capsys):
    model = transformer_block_model(seq=8, dim=128, heads=2, seed=0)
    data = random_inputs(model, 4, seed=1)
    with pytest.raises(onnx_qat.ConfigError, match="int4_method must be one of rtn, awq, gptq"):
        onnx_qat.QuantizeConfig(precision="int4", int4_method="hqq")
    with pytest.raises(onnx_qat.ConfigError, match="applies to precision int4"):
        onnx_qat.quantize(model, data=data, int4_method="gptq", progress=False)
    with pytest.raises(onnx_qat.ConfigError, match="needs calibration data"):
        onnx_qat.quantize(model, precision="int4", int4_method="gptq", progress=False)
    rtn = onnx_qat.quantize(model, data=data, precision="int4", int4_method="rtn", progress=False)
    plain = onnx_qat.quantize(model, precision="int4", progress=False)
    assert rtn.model.SerializeToString() == plain.model.SerializeToString() and not rtn.awq
    onnx.save(model, tmp_path / "m.onnx")
    code = main(["quantize", str(tmp_path / "m.onnx"), "-o", str(tmp_path / "q.onnx"), "--precision", "int4",
                 "--int4-method", "gptq"])
    assert code == EXIT_USAGE and "needs calibration data" in capsys.readouterr().err
    assert not (tmp_path / "q.onnx").exists()
