"""FP8 and INT4 forms: placement per format, the inserted numbers, packing, AWQ, the F rules, the CLI."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_qat
from onnx_qat.formats.blockwise import (dequantize_blocks, from_fp8, pack_int4, quantize_blocks, to_fp8,
                                         unpack_int4)
from onnx_qat.cli import main
from onnx_qat.errors import ConfigError
from onnx_qat.formats.scale_grid import fp16_neighbours
from tests.builders import (
    GraphBuilder, cosine, mlp_model, random_inputs, residual_block_model, transformer_block_model,
)


def _bert(dim: int = 128, seed: int = 0):
    return transformer_block_model(seq=8, dim=dim, heads=2, seed=seed)


def _data(model, num: int, seed: int, scale: float = 1.0):
    return {k: (v * scale).astype(np.float32) for k, v in random_inputs(model, num=num, seed=seed).items()}


def _out(model, data):
    """The first output over every sample (batched as the model allows; FP8 with optimisations off)."""
    from onnx_qat.runtime.sessions import run_model

    values = run_model(model, data)
    return values[model.graph.output[0].name]


def _init(model, name):
    return next(t for t in model.graph.initializer if t.name == name)


def _node(model, name):
    return next(n for n in model.graph.node if n.name == name)


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _opset(model):
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


# --------------------------------------------------------------------------- int8 stays as it was
@pytest.mark.parametrize("build", [_bert, residual_block_model])
def test_int8_default_output_is_byte_identical_to_explicit_int8(build):
    model = build()
    data = _data(model, 4, 3)
    default = onnx_qat.quantize(model, data=data, progress=False).model.SerializeToString()
    explicit = onnx_qat.quantize(model, data=data, progress=False, precision="int8").model.SerializeToString()
    config = onnx_qat.quantize(model, data=data, progress=False,
                               config=onnx_qat.QuantizeConfig(precision="int8")).model.SerializeToString()
    assert default == explicit == config


def test_precision_and_target_are_validated():
    with pytest.raises(ConfigError, match="precision must be one of int8, fp8, int4"):
        onnx_qat.QuantizeConfig(precision="fp4")
    with pytest.raises(ConfigError, match="TensorRT form"):
        onnx_qat.QuantizeConfig(precision="fp8", target="ort-cpu")
    with pytest.raises(ConfigError, match="block_size"):
        onnx_qat.QuantizeConfig(precision="int4", block_size=0)


# --------------------------------------------------------------------------- placement per format
def test_fp8_placement_adds_attention_products_and_softmax_output_which_int8_skips():
    model = _bert()
    int8 = onnx_qat.place(model)
    fp8 = onnx_qat.place(model, precision="fp8")
    fp8_off = onnx_qat.place(model, precision="fp8", include_attention=False)
    attention = {"q_transpose_out", "k_transpose_out", "softmax_out", "v_transpose_out"}
    assert attention <= set(fp8.activation_tensors())
    assert not attention & set(int8.activation_tensors())
    assert fp8_off.activation_tensors() == int8.activation_tensors()
    assert fp8.weight_tensors() == int8.weight_tensors()


def test_int4_placement_is_weight_only_on_matmul_and_gemm_along_the_reduction_axis():
    b = GraphBuilder("int4_place", 0)
    x = b.input("x", [2, 3, 8, 8])
    c = b.node("Conv", [x, b.const("conv.w", np.ones((64, 3, 3, 3), np.float32) * 0.1)], name="conv",
               pads=[1, 1, 1, 1])
    f = b.node("Flatten", [b.node("GlobalAveragePool", [c], name="gap")], name="flat")
    g = b.node("Gemm", [f, b.const("gemm.w", np.ones((256, 64), np.float32) * 0.1)], name="gemm", transB=1)
    m = b.node("MatMul", [g, b.const("mm.w", np.ones((256, 128), np.float32) * 0.1)], name="mm")
    o = b.node("MatMul", [m, b.const("odd.w", np.ones((128, 96), np.float32) * 0.1)], name="odd")
    b.node("MatMul", [o, b.const("k96.w", np.ones((96, 32), np.float32) * 0.1)], "y", name="k96")
    b.output("y")
    model = b.build()
    placement = onnx_qat.place(model, precision="int4", block_size=128)
    assert placement.activations == ()
    axes = {w.node: w.axis for w in placement.weights}
    # Gemm transB=1: B [N, K] -> axis 1 holds K=64, which 128 does not divide: float, and the reason says
    # which documented block size would divide it; K=96 is divided by neither
    assert axes == {"mm": 0, "odd": 0}
    assert placement.decision_for("conv").action != "quantize"
    assert placement.decision_for("gemm").reason.endswith("left float (--block-size 64 divides it)")
    assert placement.decision_for("k96").reason.endswith("is not a multiple of block_size 128: left float")
    assert {w.node: w.axis for w in onnx_qat.place(model, precision="int4", block_size=64).weights} == \
        {"gemm": 1, "mm": 0, "odd": 0}


# --------------------------------------------------------------------------- FP8 numbers
@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_fp8_qdq_zero_points_scales_and_weights(scale):
    model = _bert()
    data = _data(model, 8, 1, scale)
    result = onnx_qat.quantize(model, data=data, progress=False, precision="fp8")
    out = result.model
    assert _opset(out) >= 19
    pairs = [r for r in result.inserted if r["kind"] == "activation"]
    assert pairs and all(r["scale"] == pytest.approx(r["amax"] / 448, rel=1e-6) for r in pairs)
    softmax = next(r for r in pairs if r["tensor"] == "softmax_out")
    assert softmax["amax"] == 1.0  # Softmax output range is fixed, not calibrated
    for node in out.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            zp = _init(out, node.input[2])
            assert zp.data_type == TensorProto.FLOAT8E4M3FN
            assert not numpy_helper.to_array(zp).astype(np.float32).any()
    w = _init(out, "q.weight_quantized")
    assert w.data_type == TensorProto.FLOAT8E4M3FN
    w_scale = numpy_helper.to_array(_init(out, "q.weight_scale"))
    original = numpy_helper.to_array(_init(model, "q.weight"))
    # per output column: amax / 448 moved to the FP16 neighbour that reconstructs the column best
    # (the TensorRT form's weight scales are FP16 values, onnx_qat.formats.scale_grid), the column
    # quantized with exactly that scale
    down, up = fp16_neighbours((np.abs(original).max(axis=0).astype(np.float64) / 448).astype(np.float32))
    assert np.all((w_scale == down) | (w_scale == up))
    assert np.float16(w_scale).astype(np.float32).tolist() == w_scale.tolist()
    codes = np.frombuffer(w.raw_data, np.uint8).reshape(original.shape)
    assert np.array_equal(codes, to_fp8(original, w_scale))
    back = from_fp8(np.frombuffer(w.raw_data, np.uint8).reshape(original.shape)) * w_scale
    assert np.abs(back - original).max() <= np.abs(original).max() * 2 ** -4  # 3 mantissa bits
    report = onnx_qat.check(out)
    assert report.passed and not report.warnings, str(report)
    test = _data(model, 4, 99, scale)
    got = onnx_qat.compare(model, out, test, progress=False)  # graph optimisations off for FP8
    assert got.passed and cosine(_out(model, test), _out(out, test)) > 0.99


def test_fp8_softmax_range_of_a_given_scale_table_is_kept():
    """Calibrated: the Softmax output gets the fixed amax 1.0. A ScaleTable the caller gives keeps
    its own value for it."""
    model = _bert()
    data = _data(model, 8, 1)
    calibrated = onnx_qat.quantize(model, data=data, progress=False, precision="fp8")
    table = onnx_qat.calibrate(model, data, progress=False, method="max", precision="fp8")
    given = dict(table.activations, softmax_out=0.5)
    kept = onnx_qat.quantize(model, scales=given, progress=False, precision="fp8")
    for result, amax in ((calibrated, 1.0), (kept, 0.5)):
        softmax = next(r for r in result.inserted if r.get("tensor") == "softmax_out")
        assert softmax["amax"] == amax and softmax["scale"] == pytest.approx(amax / 448, rel=1e-6)


def test_fp8_resnet_block_passes_check_and_keeps_int8_placement():
    model = residual_block_model(projection=True, channels=32)
    data = _data(model, 4, 2)
    int8 = onnx_qat.quantize(model, data=data, progress=False)
    fp8 = onnx_qat.quantize(model, data=data, progress=False, precision="fp8")
    assert fp8.placement.activation_tensors() == int8.placement.activation_tensors()
    report = onnx_qat.check(fp8.model)
    assert report.passed and not report.warnings, str(report)
    test = _data(model, 4, 7)
    assert cosine(_out(model, test), _out(fp8.model, test)) > 0.995


def test_to_fp8_rounds_to_nearest_even_and_clips_at_448():
    values = np.array([0.0, 1.0, 1.0625, 1.1875, 500.0, -1000.0, 0.001953125], np.float32)
    got = from_fp8(to_fp8(values, np.float32(1.0)))
    assert got.tolist() == [0.0, 1.0, 1.0, 1.25, 448.0, -448.0, 0.001953125]


# --------------------------------------------------------------------------- INT4 numbers
@pytest.mark.parametrize("count", [1, 2, 15, 16, 1001])
def test_int4_packing_round_trips_exactly_and_matches_onnx(count):
    values = np.random.default_rng(count).integers(-8, 8, count).astype(np.int8)
    raw = pack_int4(values)
    assert len(raw) == (count + 1) // 2
    assert np.array_equal(unpack_int4(raw, (count,)), values)
    tensor = onnx.TensorProto(name="t", data_type=TensorProto.INT4, dims=[count], raw_data=raw)
    assert np.array_equal(numpy_helper.to_array(tensor).astype(np.int8), values)  # onnx's own reader
    every = np.arange(-8, 8, dtype=np.int8)
    assert np.array_equal(unpack_int4(pack_int4(every), (16,)), every)
    with pytest.raises(ValueError):
        pack_int4(np.array([8]))


def test_int4_weights_are_blockwise_and_runs_as_the_numpy_dequantization():
    model = _bert()
    result = onnx_qat.quantize(model, progress=False, precision="int4", block_size=64)
    out = result.model
    assert _opset(out) == 21 and not [n for n in out.graph.node if n.op_type == "QuantizeLinear"]
    dq = _node(out, "ffn2.weight_DequantizeLinear")
    assert _attrs(dq) == {"axis": 0, "block_size": 64}
    original = numpy_helper.to_array(_init(model, "ffn2.weight"))  # [512, 128]
    stored = _init(out, dq.input[0])
    q = unpack_int4(stored.raw_data, tuple(stored.dims))
    scale = numpy_helper.to_array(_init(out, dq.input[1]))
    assert scale.shape == (512 // 64, 128)
    want_q, want_scale = quantize_blocks(original, 0, 64, fp16_grid=True)  # FP16 block scales (scale_grid)
    assert np.array_equal(q, want_q) and np.array_equal(scale, want_scale)
    plain = quantize_blocks(original, 0, 64)[1]
    assert np.all(np.abs(scale - plain) <= 2.0 ** -10 * plain) and not np.array_equal(scale, plain)
    assert np.abs(dequantize_blocks(q, scale, 0, 64) - original).max() <= scale.max() / 2 + 1e-7
    report = onnx_qat.check(out)
    assert report.passed and not report.warnings, str(report)
    test = _data(model, 2, 5)
    assert cosine(_out(model, test), _out(out, test)) > 0.95
    sizes = [len(m.SerializeToString()) for m in (model, out)]
    assert sizes[1] < 0.35 * sizes[0]


def test_awq_lowers_the_output_error_of_a_weight_with_an_outlier_input_channel():
    rng = np.random.default_rng(0)
    k, n = 256, 64
    weight = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    b = GraphBuilder("awq", 0)
    x = b.input("x", [1, 16, k])
    h = b.node("LayerNormalization", [x, b.const("ln.g", np.ones(k, np.float32)),
                                      b.const("ln.b", np.zeros(k, np.float32))], name="ln", axis=-1)
    b.node("MatMul", [h, b.const("w", weight)], "y", name="mm")
    b.output("y")
    model = b.build()

    def inputs(num, seed):  # channel 7 of the activation is 30x larger than the others
        values = rng.standard_normal((num, 16, k)).astype(np.float32)
        values[..., 7] *= 30.0
        return {"x": values}
    # the LayerNorm would normalise the outlier away: scale its gamma to keep one in the activation
    gamma = np.ones(k, np.float32)
    gamma[7] = 30.0
    _init(model, "ln.g").CopyFrom(numpy_helper.from_array(gamma, "ln.g"))
    calib, test = inputs(8, 1), inputs(8, 2)
    ref = _out(model, test)
    rtn = onnx_qat.quantize(model, progress=False, precision="int4")
    awq = onnx_qat.quantize(model, data=calib, progress=False, precision="int4")
    err_rtn = float(np.mean((_out(rtn.model, test) - ref) ** 2))
    err_awq = float(np.mean((_out(awq.model, test) - ref) ** 2))
    record = awq.awq[0]
    assert record["fold"] == "layernorm" and record["alpha"] > 0
    assert err_awq < 0.7 * err_rtn, (err_awq, err_rtn)
    assert onnx_qat.check(awq.model).passed


# --------------------------------------------------------------------------- the F rules
def _qdq_model(opset: int, zp_type: int, zp_value, q_type_data=None):
    """x -> Q -> DQ -> Relu, the zero point of ``zp_type`` holding ``zp_value`` (raw bytes)."""
    inits = [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
             onnx.TensorProto(name="zp", data_type=zp_type, dims=[], raw_data=bytes([zp_value]))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"], name="q"),
             helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xd"], name="dq"),
             helper.make_node("Relu", ["xd"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _rules(report, severity="error"):
    return sorted({f.rule for f in report.findings if f.severity == severity})


def test_check_flags_wrong_fp8_zero_points_types_and_opset():
    assert _rules(onnx_qat.check(_qdq_model(19, TensorProto.FLOAT8E4M3FN, 0))) == []
    nonzero = onnx_qat.check(_qdq_model(19, TensorProto.FLOAT8E4M3FN, 0x38))  # 1.0
    assert _rules(nonzero) == ["F1"] and "not all zero" in str(nonzero)
    assert _rules(onnx_qat.check(_qdq_model(19, TensorProto.FLOAT8E5M2, 0))) == ["F1"]
    assert _rules(onnx_qat.check(_qdq_model(18, TensorProto.FLOAT8E4M3FN, 0))) == ["F2"]


def _blocked_model(block_size: int, rows: int = 256, scale_rows=None, activation_int4: bool = False):
    w = np.zeros((rows, 8), np.int8)
    scale_rows = scale_rows or max(rows // block_size, 1)
    inits = [onnx.TensorProto(name="w", data_type=TensorProto.INT4, dims=[rows, 8], raw_data=pack_int4(w)),
             numpy_helper.from_array(np.ones((scale_rows, 8), np.float32), "ws"),
             onnx.TensorProto(name="wz", data_type=TensorProto.INT4, dims=[scale_rows, 8],
                              raw_data=bytes((scale_rows * 8 + 1) // 2))]
    nodes = [helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], name="wdq", axis=0,
                              block_size=block_size),
             helper.make_node("MatMul", ["x", "wd"], ["y"], name="mm")]
    if activation_int4:
        inits += [numpy_helper.from_array(np.array(0.1, np.float32), "s"),
                  onnx.TensorProto(name="z4", data_type=TensorProto.INT4, dims=[], raw_data=b"\x00")]
        nodes = [helper.make_node("QuantizeLinear", ["x0", "s", "z4"], ["xq"], name="xq"),
                 helper.make_node("DequantizeLinear", ["xq", "s", "z4"], ["x"], name="xdq")] + nodes
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x0" if activation_int4 else "x",
                                                                         TensorProto.FLOAT, [2, rows])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_check_flags_wrong_block_sizes_and_int4_on_activations():
    good = onnx_qat.check(_blocked_model(128))
    assert good.passed and not good.warnings, str(good)
    assert _rules(onnx_qat.check(_blocked_model(96, rows=256, scale_rows=3))) == ["F3"]  # 96 does not divide
    assert _rules(onnx_qat.check(_blocked_model(128, scale_rows=4))) == ["F3"]  # scale grid is 2 x 8
    assert _rules(onnx_qat.check(_blocked_model(32)), "warning") == ["F3"]  # not a TensorRT block size
    act = onnx_qat.check(_blocked_model(128, activation_int4=True))
    assert "F4" in _rules(act) and "activation 'x0'" in str(act)


# --------------------------------------------------------------------------- as a new user types it
@pytest.mark.parametrize("precision", ["fp8", "int4"])
def test_cli_quantize_check_compare_for_each_precision(tmp_path, capsys, precision):
    model = _bert()
    onnx.save(model, str(tmp_path / "bert.onnx"))
    np.savez(tmp_path / "calib.npz", **_data(model, 8, 1))
    np.savez(tmp_path / "test.npz", **_data(model, 8, 2))
    out = tmp_path / f"bert_{precision}.onnx"
    assert main(["quantize", str(tmp_path / "bert.onnx"), "--precision", precision, "--data",
                 str(tmp_path / "calib.npz"), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"precision {precision}" in said and "0 errors, 0 warnings" in said
    assert main(["check", str(out)]) == 0
    assert "0 errors, 0 warnings" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "bert.onnx"), str(out), "--data", str(tmp_path / "test.npz"),
                 "--min-cosine", "0.95"]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_cli_int4_needs_no_data_and_other_precisions_do(tmp_path, capsys):
    model = mlp_model(features=128, hidden=256, classes=16)
    onnx.save(model, str(tmp_path / "m.onnx"))
    src = str(tmp_path / "m.onnx")
    assert main(["quantize", src, "--precision", "int4", "-o", str(tmp_path / "o.onnx")]) == 0
    assert main(["quantize", src, "--precision", "fp8", "-o", str(tmp_path / "p.onnx")]) == 2
    assert "--data --scales is required" in capsys.readouterr().err


def test_calibrate_int4_says_the_format_is_weight_only(tmp_path, capsys):
    model = mlp_model(features=128, hidden=256, classes=16)
    onnx.save(model, str(tmp_path / "m.onnx"))
    np.savez(tmp_path / "calib.npz", **_data(model, 4, 1))
    assert main(["calibrate", str(tmp_path / "m.onnx"), "--precision", "int4", "--data",
                 str(tmp_path / "calib.npz"), "-o", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "int4 is weight-only" in err[0]
    assert not (tmp_path / "s.json").exists()


# --------------------------------------------------------------------------- ScaleTable
def test_scale_table_block_ranges_round_trip_as_version_2_and_version_1_stays(tmp_path):
    from onnx_qat.scales import ScaleTable, block_ranges

    model = _bert()
    weight = numpy_helper.to_array(_init(model, "ffn2.weight"))  # [512, 128]
    table = block_ranges({"ffn2.weight": weight * 0.5}, axis=0, block_size=128)  # half the true ranges
    table.save(tmp_path / "t.json")
    loaded = ScaleTable.load(tmp_path / "t.json")
    assert loaded == table and loaded.to_dict()["version"] == 2
    ffn2 = loaded.weights["ffn2.weight"]
    assert ffn2.block_size == 128 and len(ffn2.amax) == 4 * 128
    assert ScaleTable({"x": 1.0}).to_dict()["version"] == 1  # tables without blocks: as before
    out = onnx_qat.quantize(model, scales=table, progress=False, precision="int4").model
    scale = numpy_helper.to_array(_init(out, "ffn2.weight_scale"))
    assert np.allclose(scale, np.abs(weight.reshape(4, 128, 128)).max(axis=1) * 0.5 / 7)
    with pytest.raises(onnx_qat.ScalesError, match="block_size 96 does not divide"):
        onnx_qat.quantize(model, scales=block_ranges({"ffn2.weight": weight[:480]}, 0, 96), progress=False,
                          precision="int4")
    with pytest.raises(onnx_qat.ScalesError, match="only precision int4"):
        ranges = dict.fromkeys(onnx_qat.place(model).activation_tensors(), 1.0)
        onnx_qat.quantize(model, scales=table.merged(ScaleTable(ranges)), progress=False)


def test_awq_clipping_search_never_raises_the_block_output_error_and_reaches_the_model():
    from onnx_qat.formats.awq import search_clip

    rng = np.random.default_rng(3)
    weight = rng.standard_normal((256, 32)).astype(np.float32)
    weight[5, 3] = 12.0  # one large weight: its block's best range is below its max
    rows = rng.standard_normal((512, 256)).astype(np.float32) * rng.uniform(0.5, 2.0, 256).astype(np.float32)

    def block_error(amax):  # output error of each block on the rows
        q, scale = quantize_blocks(weight, 0, 128, amax)
        e = (dequantize_blocks(q, scale, 0, 128) - weight).reshape(2, 128, 32)
        x = rows.reshape(512, 2, 128)
        return np.stack([((x[:, g] @ e[g]) ** 2).mean(axis=0) for g in range(2)])

    top = np.abs(weight.reshape(2, 128, 32)).max(axis=1)
    clipped = search_clip(weight, rows, 128)
    assert clipped.shape == (2, 32) and (clipped <= top).all() and (clipped < top).any()
    assert (block_error(clipped) <= block_error(top) * (1 + 1e-4) + 1e-9).all()
    model = _bert()
    result = onnx_qat.quantize(model, data=_data(model, 4, 1), progress=False, precision="int4")
    ranges = result.scales.weights
    assert ranges and all(r.block_size == 128 for r in ranges.values())
    assert all(rec["clip_error"] <= rec["awq_error"] * 1.05 for rec in result.awq)  # diagonal proxy
    scale = numpy_helper.to_array(_init(result.model, "ffn1.weight_scale"))
    assert np.allclose(scale.reshape(-1), np.asarray(ranges["ffn1.weight"].amax) / 7)


def test_awq_edits_keep_the_float_function_of_a_transformer_block():
    """AWQ's per-input-channel scales multiply weight rows and divide the activation (LayerNorm fold or
    an inserted Mul): before INT4 rounding the edited float model computes the same outputs."""
    from onnx_qat.formats.awq import apply_awq
    from onnx_qat.config import QuantizeConfig
    from onnx_qat.rewrite import _load_and_place
    from onnx_qat.insertion.targets import get_target

    model = _bert(dim=128, seed=3)
    config = QuantizeConfig(precision="int4", block_size=64)
    edited, index, placement, _ = _load_and_place(model, None, get_target(config.target), config)
    calib, test = _data(model, 8, 1, scale=3.0), _data(model, 4, 2, scale=3.0)
    records, ranges = apply_awq(edited, index, placement, calib, 64)
    assert any(r["alpha"] > 0 for r in records), records  # scales were applied, so the test tests a fold
    assert ranges and all(r.block_size == 64 for r in ranges.values())
    ref, out = _out(model, test), _out(edited, test)
    assert np.linalg.norm(out - ref) <= 1e-5 * np.linalg.norm(ref), np.abs(out - ref).max()
