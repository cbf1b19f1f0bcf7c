"""Float parts in FP16/BF16 (``onnx_qat.formats.float_parts``): each keep rule, the typed rewrite,
quantize/CLI integration, the numbers against the FP32 float parts."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

import onnx_qat
from onnx_qat.errors import ConfigError, ModelError
from onnx_qat.formats.float_parts import (
    FLOAT_DTYPE_KEY,
    KEEP_FP32_KEY,
    cast_float_parts,
    emulate_in_fp32,
    kept_fp32_nodes,
)
from tests.builders import (
    GraphBuilder,
    amax_table_each,
    assert_check_clean,
    conv_bn_relu_model,
    cosine,
    mobilenet_v2_model,
    random_inputs,
    residual_block_model,
    run,
    transformer_block_model,
)

LOW = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
WEIGHTED = ("Conv", "ConvTranspose", "MatMul", "Gemm")


def float_types(model):
    """{tensor: element type} of every initializer and every node output shape inference types."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {
        i.name: i.type.tensor_type.elem_type
        for i in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input)
    }
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


def fp32_compute(model, kept=()):
    """Weighted nodes whose output is FP32, less the names in ``kept``."""
    types = float_types(model)
    return [
        n.name
        for n in model.graph.node
        if n.op_type in WEIGHTED and types.get(n.output[0]) == TensorProto.FLOAT and n.name not in kept
    ]


def run_each(model, feeds):
    """The first output over every sample of ``feeds`` (one run per sample: the builders' models take
    batch 1)."""
    count = len(next(iter(feeds.values())))
    return np.concatenate([run(model, {k: v[i : i + 1] for k, v in feeds.items()})[0] for i in range(count)])


def run_low(model, feeds, dtype="fp16"):
    return run(model if dtype == "fp16" else emulate_in_fp32(model, dtype), feeds)


def file_bytes(model):
    return sum(len(t.raw_data) for t in model.graph.initializer if t.data_type in (1, 10, 16))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("seed", [0, 3])
def test_float_model_every_float_part_takes_the_type(dtype, seed):
    model = residual_block_model(projection=True, seed=seed)
    before = model.SerializeToString()
    feeds = random_inputs(model, seed=seed)
    result = cast_float_parts(model, dtype)
    assert model.SerializeToString() == before  # the caller's model is never changed
    out = result.model
    assert result.kept == ()
    assert all(t.data_type == LOW[dtype] for t in out.graph.initializer if t.data_type != TensorProto.INT64)
    assert fp32_compute(out) == []
    # the graph keeps its FP32 input and output, with a Cast at each end
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert [n.op_type for n in out.graph.node].count("Cast") == 2
    assert file_bytes(out) == file_bytes(model) // 2
    ref = run(model, feeds)[0]
    got = run_low(out, feeds, dtype)[0]
    assert got.dtype == np.float32
    assert cosine(ref, got) > (0.9999 if dtype == "fp16" else 0.999)
    assert {p.key: p.value for p in out.metadata_props}[FLOAT_DTYPE_KEY] == dtype


def test_keep_io_types_false_gives_low_inputs_and_outputs():
    model = conv_bn_relu_model()
    out = cast_float_parts(model, "fp16", keep_io_types=False).model
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert "Cast" not in [n.op_type for n in out.graph.node]
    feeds = {k: v.astype(np.float16) for k, v in random_inputs(model).items()}
    got = run(out, feeds)[0]
    assert got.dtype == np.float16
    assert cosine(run(model, {k: v.astype(np.float32) for k, v in feeds.items()})[0], got) > 0.9999


@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_quantize_fp16_checks_clean_and_keeps_the_cosine(precision, scale):
    model = residual_block_model(projection=True)
    feeds = {k: v * scale for k, v in random_inputs(model, num=8, seed=1).items()}
    data = {k: np.concatenate([v] * 2) for k, v in feeds.items()}
    fp32 = onnx_qat.quantize(model, data=data, precision=precision, progress=False)
    fp16 = onnx_qat.quantize(model, data=data, precision=precision, float_dtype="fp16", progress=False)
    assert_check_clean(fp16.model)
    assert fp16.float_parts is not None and fp16.float_parts.float_dtype == "fp16"
    assert onnx_qat.io.models.default_opset(fp16.model) >= 19
    # the graph input's QuantizeLinear reads it in FP32 (rule boundary): every other scale is FP16
    boundary = [n for n in fp16.model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "input"]
    assert len(boundary) == 1
    scales = [
        n.input[1] for n in fp16.model.graph.node
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n not in boundary
    ]
    inits = {t.name: t for t in fp16.model.graph.initializer}
    assert scales and all(inits[s].data_type == TensorProto.FLOAT16 for s in scales)
    assert inits[boundary[0].input[1]].data_type == TensorProto.FLOAT
    assert fp32_compute(fp16.model) == []
    ref = run_each(model, feeds)
    c32, c16 = cosine(ref, run_each(fp32.model, feeds)), cosine(ref, run_each(fp16.model, feeds))
    assert c16 >= c32 - 0.002
    assert file_bytes(fp16.model) < 0.55 * file_bytes(fp32.model) + 64
    report = fp16.to_report()["float_parts"]
    assert report["float_dtype"] == "fp16"
    assert [(k["node"], k["rule"]) for k in report["kept_fp32"]] == [(boundary[0].name, "boundary")]
    assert (
        report["measurement"]["outputs"]["output"]["cosine"]
        >= report["measurement"]["outputs"]["output"]["cosine_fp32"] - 0.002
    )


def test_quantize_bf16_raises_the_opset_and_is_validated_by_emulation():
    model = residual_block_model()
    feeds = random_inputs(model, num=8, seed=2)
    fp32 = onnx_qat.quantize(model, data=feeds, progress=False)
    bf16 = onnx_qat.quantize(model, data=feeds, float_dtype="bf16", progress=False)
    assert onnx_qat.io.models.default_opset(bf16.model) >= 22
    assert_check_clean(bf16.model)
    ref = run_each(model, feeds)
    c32, c16 = (
        cosine(ref, run_each(fp32.model, feeds)),
        cosine(ref, run_each(emulate_in_fp32(bf16.model), feeds)),
    )
    assert c16 >= c32 - 0.002
    measured = bf16.float_parts.measurement["outputs"]["output"]
    first = {k: v[:4] for k, v in feeds.items()}  # the measurement runs on the first 4 samples
    assert bf16.float_parts.measurement["samples"] == 4
    assert measured["cosine"] == pytest.approx(
        cosine(run_each(model, first), run_each(emulate_in_fp32(bf16.model), first)), abs=1e-6)


def test_attention_mask_beyond_fp16_keeps_its_add_and_softmax_fp32_with_reasons():
    model = transformer_block_model()
    feeds = random_inputs(model, num=4, seed=0)
    result = onnx_qat.quantize(model, data=feeds, float_dtype="fp16", progress=False)
    kept = {k.node: k for k in result.float_parts.kept}
    assert kept["mask_add"].rule == "weight" and "65504" in kept["mask_add"].reason
    assert kept["softmax"].rule == "range"
    marks = kept_fp32_nodes(result.model)
    assert set(marks) == set(kept) and marks["mask_add"] == kept["mask_add"].reason
    node = next(n for n in result.model.graph.node if n.name == "mask_add")
    assert [p.key for p in node.metadata_props] == [KEEP_FP32_KEY]
    assert fp32_compute(result.model) == []
    assert_check_clean(result.model)
    ref = run_each(model, feeds)
    fp32 = onnx_qat.quantize(model, data=feeds, progress=False)
    assert cosine(ref, run_each(result.model, feeds)) >= cosine(ref, run_each(fp32.model, feeds)) - 0.002


def test_a_range_from_the_scale_table_beyond_fp16_keeps_producer_and_consumers():
    model = residual_block_model()
    result = cast_float_parts(model, "fp16", scales={"stem_relu_out": 1e5})
    kept = {k.node: k.rule for k in result.kept}
    assert kept == {"stem_relu": "range", "conv1": "range", "add": "range"}
    assert sorted(fp32_compute(result.model)) == ["conv1"]
    assert fp32_compute(result.model, kept) == []


def test_a_scale_fp16_cannot_hold_keeps_its_qdq_and_consumer():
    model = conv_bn_relu_model()
    weight = next(t for t in model.graph.initializer if t.name == "conv.weight")
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * np.float32(1e-6), weight.name))
    feeds = random_inputs(model, num=4)
    result = onnx_qat.quantize(model, data=feeds, float_dtype="fp16", progress=False)
    kept = {k.node: k for k in result.float_parts.kept}
    weight_dq = next(
        n.name
        for n in result.model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0].startswith("conv.weight")
    )
    assert kept[weight_dq].rule == "scale" and "does not fit FP16" in kept[weight_dq].reason
    assert "conv" in kept
    report = onnx_qat.check(result.model)
    assert not report.errors
    inits = {t.name: t for t in result.model.graph.initializer}
    for node in result.model.graph.node:
        if node.op_type == "DequantizeLinear" and node.name in kept:
            assert inits[node.input[1]].data_type == TensorProto.FLOAT
    ref = run_each(model, feeds)
    fp32 = onnx_qat.quantize(model, data=feeds, progress=False)
    assert cosine(ref, run_each(result.model, feeds)) >= cosine(ref, run_each(fp32.model, feeds)) - 0.002


def _cancellation_model(batch=4):
    """y = ((x + 1000) - 1000) @ W: in FP16 the shift leaves x a step of 0.5."""
    b = GraphBuilder("cancel", 0)
    x = b.input("x", [batch, 16])
    s = b.node("Add", [x, b.const("shift", np.float32(1000.0))], name="shift")
    u = b.node("Sub", [s, b.const("unshift", np.float32(1000.0))], name="unshift")
    b.node("MatMul", [u, b.weight("w", [16, 8])], "y", name="proj")
    b.output("y")
    return b.build()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_site_costing_cosine_in_fp16_is_measured_and_kept_fp32(seed):
    model = _cancellation_model()
    feeds = {"x": np.random.default_rng(seed).uniform(0, 1, (4, 16)).astype(np.float32)}
    blind = cast_float_parts(model, "fp16")
    assert cosine(run(model, feeds)[0], run(emulate_in_fp32(blind.model), feeds)[0]) < 0.99  # FP16 storage
    result = cast_float_parts(model, "fp16", data=feeds)
    kept = {k.node: k for k in result.kept}
    # the cancelling Sub, and with it the Add it reads: its input must not be rounded
    assert kept["unshift"].rule == "measured" and "cosine fell" in kept["unshift"].reason
    assert kept["shift"].rule == "measured" and "must not be rounded" in kept["shift"].reason
    assert "proj" not in kept  # the MatMul stays FP16
    m = result.measurement["outputs"]["y"]
    assert m["cosine"] >= m["cosine_fp32"] - 0.002 and result.measurement["rounds"] == 1
    assert cosine(run(model, feeds)[0], run(emulate_in_fp32(result.model), feeds)[0]) >= 0.998


@pytest.mark.parametrize("seed", [0, 1])
def test_a_drop_on_the_first_samples_is_confirmed_on_four_times_as_many_before_a_node_is_kept(seed):
    """With more data than ``num_samples``, a drop beyond the budget and the noise is measured again on
    CONFIRM_FACTOR x as many samples; a systematic cost holds there, and the search keeps its node."""
    from onnx_qat.formats.float_parts import CONFIRM_FACTOR, MEASURE_SAMPLES

    model = _cancellation_model(batch="N")
    rng = np.random.default_rng(seed)
    many = {"x": rng.uniform(0, 1, (64, 16)).astype(np.float32)}
    result = cast_float_parts(model, "fp16", data=many)
    m = result.measurement
    assert m["confirmation"]["samples"] == CONFIRM_FACTOR * MEASURE_SAMPLES
    assert m["samples"] == MEASURE_SAMPLES
    assert m["confirmation"]["drop_first"]["y"] > m["rounding_noise"]["y"]
    assert m["confirmation"]["drop"]["y"] > 0.002 and m["confirmation"]["drop_first"]["y"] > 0.002
    kept = {k.node: k for k in result.kept}
    assert kept["unshift"].rule == "measured" and kept["shift"].rule == "measured" and "proj" not in kept
    assert m["outputs"]["y"]["cosine"] >= m["outputs"]["y"]["cosine_fp32"] - 0.002
    # as many samples as measured: nothing more to confirm on, the same search and keeps
    few = cast_float_parts(model, "fp16", data={"x": many["x"][:MEASURE_SAMPLES]})
    assert "confirmation" not in few.measurement and few.measurement["samples"] == MEASURE_SAMPLES
    assert {k.node for k in few.kept if k.rule == "measured"} == {"shift", "unshift"}


def test_a_drop_of_a_few_samples_that_more_samples_do_not_show_keeps_nothing():
    """Four samples where FP16 cancels badly among sixty where it does not: the drop on the four is
    not confirmed on sixteen, nothing is kept, nothing warned; with only the four it is searched."""
    from onnx_qat.formats.float_parts import CONFIRM_FACTOR, MEASURE_SAMPLES

    model = _cancellation_model(batch="N")
    rng = np.random.default_rng(3)
    # whole numbers up to 20: x + 1000 is exact in FP16 (its step there is 0.5), and their outputs
    # outweigh those of the four samples in [0, 1)
    x = rng.integers(0, 21, (64, 16)).astype(np.float32)
    picked = np.unique(np.linspace(0, 63, MEASURE_SAMPLES).round().astype(int))  # Dataset.spread's samples
    x[picked] = rng.uniform(0, 1, (len(picked), 16)).astype(np.float32)
    result = cast_float_parts(model, "fp16", data={"x": x})
    m = result.measurement
    assert m["confirmation"]["samples"] == CONFIRM_FACTOR * MEASURE_SAMPLES == m["samples"]
    assert m["confirmation"]["drop_first"]["y"] > 0.002 >= m["confirmation"]["drop"]["y"]
    assert m["rounds"] == 0 and not [k for k in result.kept if k.rule == "measured"]
    assert not [n for n in result.notes if "stays more than" in n]
    few = cast_float_parts(model, "fp16", data={"x": x[picked]})
    assert few.measurement["rounds"] >= 1 and "unshift" in {k.node for k in few.kept}


def test_a_drop_within_the_noise_is_confirmed_too_before_anything_is_noted(monkeypatch):
    """A drop beyond the budget but within the rounding noise on the first samples is measured again on
    more samples as well: where those show none, nothing is noted (the orientation classifier's 4
    calibration samples showed +0.013 within a noise of 0.017, its 16 -0.0047)."""
    from onnx_qat.formats import float_parts
    from onnx_qat.formats.float_parts import CONFIRM_FACTOR, MEASURE_SAMPLES

    model = _cancellation_model(batch="N")
    rng = np.random.default_rng(3)
    x = rng.integers(0, 21, (64, 16)).astype(np.float32)
    picked = np.unique(np.linspace(0, 63, MEASURE_SAMPLES).round().astype(int))
    x[picked] = rng.uniform(0, 1, (len(picked), 16)).astype(np.float32)
    monkeypatch.setattr(float_parts._Measure, "noise", lambda self, low: {o: 1.0 for o in self.outputs})
    result = cast_float_parts(model, "fp16", data={"x": x})
    m = result.measurement
    assert m["confirmation"]["samples"] == CONFIRM_FACTOR * MEASURE_SAMPLES == m["samples"]
    assert m["confirmation"]["drop_first"]["y"] > 0.002 >= m["confirmation"]["drop"]["y"]
    assert not [n for n in result.notes if "stays more than" in n] and not result.kept
    few = cast_float_parts(model, "fp16", data={"x": x[picked]})  # nothing to confirm on: noted
    assert [n for n in few.notes if "within the INT8 model's own rounding noise" in n]


def test_no_drop_on_the_first_samples_measures_nothing_more():
    """A conversion within the budget on its samples is not measured again (no ``first``)."""
    b = GraphBuilder("plain", 0)
    x = b.input("x", ["N", 16])
    b.node("MatMul", [b.node("Relu", [x], name="relu"), b.weight("w", [16, 8])], "y", name="proj")
    b.output("y")
    data = {"x": np.random.default_rng(0).uniform(-1, 1, (64, 16)).astype(np.float32)}
    result = cast_float_parts(b.build(), "fp16", data=data)
    assert "confirmation" not in result.measurement and result.measurement["samples"] == 4
    assert result.measurement["rounds"] == 0 and not [k for k in result.kept if k.rule == "measured"]


def test_bf16_keeps_ops_tensorrt_does_not_run_in_bf16():
    b = GraphBuilder("mish", 0)
    x = b.input("x", [1, 16, 4, 4])
    y = b.node("Mish", [b.conv(x, 16, 16, "conv")], name="mish")
    b.node("Relu", [y], "y", name="relu")
    b.output("y")
    model = b.build(opset=18)
    bf16 = {k.node: k for k in cast_float_parts(model, "bf16").kept}
    assert (
        list(bf16) == ["mish"] and bf16["mish"].rule == "tensorrt" and "onnx-tensorrt" in bf16["mish"].reason
    )
    assert cast_float_parts(model, "fp16").kept == ()


def test_schema_fp32_slots_stay_fp32_and_the_model_runs():
    b = GraphBuilder("resize", 0)
    x = b.input("x", [1, 16, 4, 4])
    y = b.node(
        "Resize",
        [b.conv(x, 16, 16, "conv"), "", b.const("scales", np.array([1, 1, 2, 2], np.float32))],
        name="resize",
        mode="nearest",
    )
    b.node("Relu", [y], "y", name="relu")
    b.output("y")
    model = b.build(opset=13)
    result = cast_float_parts(model, "fp16")
    inits = {t.name: t.data_type for t in result.model.graph.initializer}
    assert inits["scales"] == TensorProto.FLOAT and inits["conv.weight"] == TensorProto.FLOAT16
    feeds = random_inputs(model)
    assert cosine(run(model, feeds)[0], run(result.model, feeds)[0]) > 0.9999


def test_bad_options_and_converted_models_are_refused():
    model = conv_bn_relu_model()
    with pytest.raises(ConfigError, match="float_dtype"):
        cast_float_parts(model, "fp8")
    with pytest.raises(ConfigError, match="float_dtype"):
        onnx_qat.quantize(model, data=random_inputs(model), float_dtype="half", progress=False)
    with pytest.raises(ConfigError, match="TensorRT form"):
        onnx_qat.quantize(
            model, data=random_inputs(model), float_dtype="fp16", target="ort-cpu", progress=False
        )
    with pytest.raises(ConfigError, match="max_cosine_drop"):
        cast_float_parts(model, "fp16", max_cosine_drop=2)
    with pytest.raises(ModelError, match="already holds"):
        cast_float_parts(cast_float_parts(model, "fp16").model, "fp16")
    assert cast_float_parts(model, "fp32").model.graph == model.graph


def test_cli_quantize_float_dtype_prints_the_kept_list(tmp_path, capsys):
    from onnx_qat.cli import main

    model = transformer_block_model()
    src, data, out, rep = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx", tmp_path / "r.json"
    onnx.save(model, src)
    np.savez(data, **random_inputs(model, num=4))
    code = main(
        [
            "quantize",
            str(src),
            "--data",
            str(data),
            "-o",
            str(out),
            "--float-dtype",
            "fp16",
            "--report",
            str(rep),
            "--no-progress",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    assert (
        "float parts fp16" in text and "kept FP32: mask_add (Add)" in text and "0 errors, 0 warnings" in text
    )
    rounding = json.loads(rep.read_text())["float_parts"]["measurement"]["scale_rounding"]
    assert f"activation scales rounded {rounding['chosen']} (worst cosine drop: up" in text
    saved = onnx.load(out)
    assert kept_fp32_nodes(saved)["mask_add"].startswith("constant 'attn_mask'")
    assert json.loads(rep.read_text())["float_parts"]["kept_fp32"][0]["node"] in ("mask_add", "softmax")
    bad = tmp_path / "bad.onnx"
    assert main(["quantize", str(src), "--data", str(data), "-o", str(bad), "--float-io"]) == 2
    assert not bad.exists()


def test_mobilenet_v2_shaped_model_fp16_within_the_budget():
    model = mobilenet_v2_model(size=32, width=0.25)
    x = np.random.default_rng(0).uniform(0, 255, (8, 3, 32, 32)).astype(np.float32)
    fp32 = onnx_qat.quantize(model, data={"input": x}, progress=False)
    fp16 = onnx_qat.quantize(model, data={"input": x}, float_dtype="fp16", progress=False)
    assert not onnx_qat.check(fp16.model).errors
    kept = {k.node for k in fp16.float_parts.kept}
    assert fp32_compute(fp16.model, kept) == []
    feeds = {"input": x}
    ref = run_each(model, feeds)
    assert cosine(ref, run_each(fp16.model, feeds)) >= cosine(ref, run_each(fp32.model, feeds)) - 0.002


def test_graph_outputs_read_inside_if_bodies_keep_their_type():
    from tests.builders import if_cnn_model

    model = if_cnn_model()
    result = cast_float_parts(model, "fp16")
    feeds = random_inputs(model)
    assert all(k.rule == "schema" for k in result.kept)
    assert cosine(run(model, feeds)[0], run(result.model, feeds)[0]) > 0.999


def test_initializer_values_round_to_the_type():
    model = conv_bn_relu_model()
    out = cast_float_parts(model, "fp16").model
    w32 = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "conv.weight"))
    w16 = numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == "conv.weight"))
    assert w16.dtype == np.float16 and np.array_equal(w16, w32.astype(np.float16))


def test_a_constant_node_beyond_fp16_keeps_its_reader_fp32():
    b = GraphBuilder("mask", 0)
    x = b.input("x", [2, 8])
    mask = b.node(
        "Constant",
        [],
        "mask",
        name="mask_const",
        value=numpy_helper.from_array(np.array([0.0, -1e9] * 4, np.float32)),
    )
    y = b.node("Add", [b.linear(x, 8, 8, "proj", bias=False), mask], name="masked")
    b.node("Softmax", [y], "y", name="softmax", axis=-1)
    b.output("y")
    model = b.build()
    result = cast_float_parts(model, "fp16")
    kept = {k.node: k.rule for k in result.kept}
    assert kept["masked"] == "weight" and "mask_const" in kept
    feeds = random_inputs(model)
    got = run(emulate_in_fp32(result.model), feeds)[0]
    assert np.all(np.isfinite(got)) and cosine(run(model, feeds)[0], got) > 0.999


def test_the_notes_name_the_ops_onnxruntime_has_no_fp16_cpu_kernel_for():
    from onnx_qat.formats.float_cast import FP16
    from onnx_qat.formats.float_parts import ort_cpu_missing_kernels

    result = cast_float_parts(conv_bn_relu_model(), "fp16")
    missing = ort_cpu_missing_kernels(result.model, FP16, [n.name for n in result.model.graph.node])
    assert "Cast" not in missing
    if missing:  # this onnxruntime build lacks some FP16 CPU kernels: the result says which
        assert any(", ".join(missing) in note for note in result.notes)


def test_quantize_with_scales_converts_without_measuring_and_writes_nothing_on_bad_paths(tmp_path):
    model = residual_block_model()
    table = onnx_qat.calibrate(model, random_inputs(model, num=4), method="max", progress=False)
    result = onnx_qat.quantize(model, tmp_path / "q.onnx", scales=table, float_dtype="fp16", progress=False)
    assert result.float_parts.measurement is None and (tmp_path / "q.onnx").exists()
    assert_check_clean(onnx.load(tmp_path / "q.onnx"))
    with pytest.raises(onnx_qat.OutputError):
        onnx_qat.quantize(model, tmp_path / "missing" / "q.onnx", scales=table, float_dtype="fp16")
    with pytest.raises(ConfigError, match="keep_io_types"):
        onnx_qat.quantize(model, scales=table, float_dtype="fp16", keep_io_types="no")


@pytest.mark.parametrize("seed", [0, 1])
def test_emulation_leaves_unrounded_only_what_a_fused_int8_kernel_never_stores(seed):
    """The tensors inside a fused INT8 Conv kernel (its input and weight DQ outputs, the Conv output
    and its fused Relu/residual Add up to the QuantizeLinear) are not rounded to FP16; every tensor
    a float op reads or a graph output is."""
    from onnx_qat.check.precision import QUANTIZED, build_precision_map, fused_tensors
    from onnx_qat.check.index import _all_graphs
    from onnx_qat.io.models import default_opset

    model = residual_block_model(projection=True, seed=seed)
    x = random_inputs(model, num=8, seed=seed)
    fp16 = onnx_qat.quantize(model, data=x, float_dtype="fp16", progress=False).model
    fused = fused_tensors(fp16)
    pmap = build_precision_map(fp16, _all_graphs(fp16, default_opset(fp16), None))
    precision = {e.node: e.precision for e in pmap.nodes}
    producer = {t: n for n in fp16.graph.node for t in n.output}
    readers = {}
    for n in fp16.graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    quantized = [n for n in fp16.graph.node if precision.get(n.name) == "int8" and n.op_type == "Conv"]
    assert len(quantized) == 4  # stem, two in the block, the projection
    for conv in quantized:  # its DQ inputs (activation and weight) are never stored in FP16
        assert all(t in fused for t in conv.input[:2])
    for t in fused:
        assert producer[t].op_type == "DequantizeLinear" or precision[producer[t].name] in QUANTIZED
        assert all(r.op_type == "QuantizeLinear" or precision.get(r.name) in QUANTIZED for r in readers[t])
    assert not fused & {o.name for o in fp16.graph.output}
    assert any(producer[t].op_type == "Conv" for t in fused)  # a Conv requantized in its epilogue
    rounded = [n for n in emulate_in_fp32(fp16).graph.node if n.op_type == "Cast"]
    strict = [n for n in emulate_in_fp32(fp16, fusions=False).graph.node if n.op_type == "Cast"]
    assert len(strict) - len(rounded) == 2 * len(fused)  # one Cast pair less per fused tensor
    ref, q32 = run_each(model, x), onnx_qat.quantize(model, data=x, progress=False).model
    c32 = cosine(ref, run_each(q32, x))
    assert cosine(ref, run_each(emulate_in_fp32(fp16), x)) >= c32 - 0.002


def _deep_cancellation_model():
    """y = (((x + 1000) * 1 * 1 * 1 * 1) - 1000) @ W, and a second output z = relu(x @ W2) @ W3: keeping
    the Sub and the Mul feeding it FP32 leaves the other Muls rounding at 1000 (a step of 0.5), so no
    single node (with its producers) lowers the drop; the six nodes of the chain together do."""
    b = GraphBuilder("deep_cancel", 0)
    x = b.input("x", [4, 16])
    t = b.node("Add", [x, b.const("shift", np.float32(1000.0))], name="shift")
    for i in range(4):
        t = b.node("Mul", [t, b.const(f"one{i}", np.float32(1.0))], name=f"same{i}")
    u = b.node("Sub", [t, b.const("unshift", np.float32(1000.0))], name="unshift")
    b.node("MatMul", [u, b.weight("w", [16, 8])], "y", name="proj")
    h = b.node("Relu", [b.node("MatMul", [x, b.weight("w2", [16, 16])], name="fc1")], name="relu")
    b.node("MatMul", [h, b.weight("w3", [16, 8])], "z", name="fc2")
    b.output("y")
    b.output("z")
    return b.build()


@pytest.mark.parametrize("seed", [0, 1])
def test_when_no_single_node_helps_a_group_is_kept_fp32(seed):
    model = _deep_cancellation_model()
    feeds = {"x": np.random.default_rng(seed).uniform(0, 1, (4, 16)).astype(np.float32)}
    result = cast_float_parts(model, "fp16", data=feeds)
    measured = {k.node: k for k in result.kept if k.rule == "measured"}
    assert set(measured) == {"shift", "same0", "same1", "same2", "same3", "unshift"}
    assert all("no single node lowered it; with these 6 nodes kept FP32 together" in k.reason
               for k in measured.values())
    assert measured["shift"].reason.startswith("output 'y' cosine fell by")
    assert "proj" not in measured and "fc1" not in measured and "fc2" not in measured
    m = result.measurement
    assert 0 < m["group_trials"] <= 12 and m["rounds"] >= 3
    assert all(v["cosine"] >= v["cosine_fp32"] - 0.002 for v in m["outputs"].values())
    y, z = run(model, feeds)
    y16, z16 = run(emulate_in_fp32(result.model), feeds)
    assert cosine(y, y16) >= 0.998 and cosine(z, z16) >= 0.998
    assert not result.notes or "stays more than" not in " ".join(result.notes)


def test_the_note_of_a_search_that_misses_the_budget_says_what_ran():
    """The note names the single-node rounds (and why there were none: no node of the main graph to
    try, as on a model whose network sits in If branches) and the group trials, with the cosines of the
    first, every converted compute node FP32, when even that misses the budget (it said "after 0 rounds"
    alone, though a group trial had run)."""
    from onnx_qat.formats.float_parts import _search_ran, get_low_type

    bf16 = get_low_type("bf16")
    base = {"output": 0.99169, "stateN": 0.93475}
    text = _search_ran(0, True, 1, (242, {"output": 0.98532, "stateN": 0.85612}), base, bf16)
    assert text.startswith(" after 0 single-node rounds (no node of the main graph to try"), text
    assert "and 1 group trial: with all 242 converted compute nodes kept FP32 together" in text
    assert "Constants and Casts stay BF16" in text
    assert text.endswith("it still measures output 0.99169 -> 0.98532, stateN 0.93475 -> 0.85612")
    assert _search_ran(3, False, 0, None, base, bf16) == " after 3 single-node rounds"
    assert _search_ran(1, True, 12, None, base, bf16) == " after 1 single-node round and 12 group trials"


@pytest.mark.parametrize("seed", [0, 3])
def test_jittered_moves_every_quantize_input_by_at_most_its_size_the_same_way_each_time(seed):
    from onnx_qat.formats.float_parts import jittered

    model = residual_block_model(projection=True, seed=seed)
    x = random_inputs(model, num=4, seed=seed)
    q = onnx_qat.quantize(model, data=x, progress=False).model
    moved = jittered(q, 2.0**-11, seed=seed)
    assert sum(n.op_type == "RandomUniformLike" for n in moved.graph.node) == sum(
        n.op_type == "QuantizeLinear" for n in q.graph.node)
    feeds = {"input": x["input"][:1]}
    first, again, exact = run(moved, feeds)[0], run(moved, feeds)[0], run(q, feeds)[0]
    np.testing.assert_array_equal(first, again)  # seeded
    assert 0.999 < cosine(first, exact) < 1.0  # a few values cross a rounding boundary, no more
    assert len(q.graph.node) == len(onnx_qat.quantize(model, data=x, progress=False).model.graph.node)


@pytest.mark.parametrize("seed", [0, 5])
def test_jittered_weight_scales_moves_every_weight_scale_within_its_size_and_no_activation_scale(seed):
    from onnx_qat.formats.float_parts import activation_scales, jittered

    model = residual_block_model(projection=True, seed=seed)
    x = random_inputs(model, num=4, seed=seed)
    q = onnx_qat.quantize(model, data=x, progress=False).model
    size = 2.0**-11
    moved = jittered(q, size, seed=seed, weight_scales=True)
    before = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in moved.graph.initializer}
    inits = set(before)
    weight = {n.input[1] for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    assert len(weight) >= 3 and not weight & activation_scales(q)
    for name in weight:
        ratio = after[name].astype(np.float64) / before[name]
        assert np.all(np.abs(ratio - 1) <= size * (1 + 1e-6)) and np.any(ratio != 1)
    for name in inits - weight:
        np.testing.assert_array_equal(after[name], before[name])
    again = jittered(q, size, seed=seed, weight_scales=True)
    assert all(np.array_equal(numpy_helper.to_array(t), after[t.name]) for t in again.graph.initializer)
    other = jittered(q, size, seed=seed + 1, weight_scales=True)
    assert any(not np.array_equal(numpy_helper.to_array(t), after[t.name]) for t in other.graph.initializer
               if t.name in weight)
    # without the option the weight scales stay exact
    plain = jittered(q, size, seed=seed)
    assert all(np.array_equal(numpy_helper.to_array(t), before[t.name]) for t in plain.graph.initializer
               if t.name in before)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_dequantize_ranges_come_from_codes_and_scales_without_running(precision):
    """A weight DQ's range is its largest dequantized value exactly; an activation DQ's is bounded by
    its largest code times its scale, never below what it outputs."""
    from onnx_qat.formats.float_parts import _given_ranges
    from onnx_qat.runtime.sessions import make_session

    model = residual_block_model(projection=True, seed=2)
    x = random_inputs(model, num=4, seed=2)
    q = onnx_qat.quantize(model, data=x, precision=precision, progress=False).model
    ranges = _given_ranges(q, None)
    inits = {t.name for t in q.graph.initializer}
    dqs = [n for n in q.graph.node if n.op_type == "DequantizeLinear"]
    names = [n.output[0] for n in dqs]
    session = make_session(q, extra_outputs=names, optimize=False)
    values = dict(zip(names, session.run(names, {"input": x["input"][:1]})))
    for node in dqs:
        actual = float(np.abs(values[node.output[0]]).max())
        if node.input[0] in inits:  # a weight: exact
            assert ranges[node.output[0]] == pytest.approx(actual, rel=1e-6), node.name
        else:
            assert ranges[node.output[0]] >= actual, node.name


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("seed", [0, 5])
def test_round_up_gives_the_smallest_value_of_the_type_not_below(dtype, seed):
    from onnx_qat.formats.float_parts import get_low_type

    low = get_low_type(dtype)
    rng = np.random.default_rng(seed)
    values = (10.0 ** rng.uniform(-6, 3, 2000)).astype(np.float32)
    values[:4] = [1.0, 0.5, 3.0, 2.0**-10]  # exactly representable: unchanged
    up = low.round_up(values)
    assert np.all(up >= values) and np.array_equal(low.round(up), up)
    assert np.array_equal(up[:4], values[:4])
    moved = up > values
    assert 0.3 < moved.mean() < 1.0  # most random values are not representable
    # the next value of the type below each rounded one is below its value: nothing smaller fits
    below = (np.nextafter(up.astype(np.float16), np.float16(0)).astype(np.float32) if dtype == "fp16"
             else (up.view(np.uint32) - np.uint32(1 << 16)).view(np.float32))
    assert np.all(below[moved] < values[moved])
    normal = values >= low.normal_min  # within one step of the type: eps relative where it is normal
    assert np.all((up - values)[normal] <= low.eps * values[normal])


def _stored_scales(fp32_model, low_model, low):
    """{scale name: (FP32 value, value stored in the low type)} of every Q/DQ scale (a scale read in
    FP32 too, by the graph input's QuantizeLinear, is stored in the low type as a copy ``name/fp16``)."""
    s32 = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in fp32_model.graph.initializer}
    found = {}
    for t in low_model.graph.initializer:
        base = t.name if t.name in s32 else t.name.rsplit(f"/{low.name}", 1)[0]
        if t.data_type == low.onnx_type and base in s32:
            found[base] = (s32[base], onnx_qat.io.models.tensor_array(t).astype(np.float32))
    return found


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("seed, scale", [(1, 1.0), (2, 30.0)])
def test_activation_scales_round_up_weight_scales_to_nearest(dtype, seed, scale):
    """Without data: an activation's Q/DQ scale is stored in the low type rounded up, so 127 x scale
    still covers the given amax (no value the calibration saw is clipped); a weight's
    DequantizeLinear scale is stored to the nearest value. The ranges are given (the table of the
    plain maxima): calibration's own scales are FP16 values already (test_scale_grid.py)."""
    from onnx_qat.formats.float_parts import activation_scales, get_low_type

    low = get_low_type(dtype)
    model = residual_block_model(projection=True, seed=seed)
    data = {k: v * scale for k, v in random_inputs(model, num=8, seed=seed).items()}
    fp32 = onnx_qat.quantize(model, scales=amax_table_each(model, data), progress=False)
    low_model = cast_float_parts(fp32.model, dtype, scales=fp32.scales).model
    assert_check_clean(low_model)
    stored = _stored_scales(fp32.model, low_model, low)
    acts = activation_scales(fp32.model)
    quantized = {n.input[0]: n.input[1] for n in fp32.model.graph.node if n.op_type == "QuantizeLinear"}
    assert acts == set(quantized.values())
    moved = 0
    for name in acts:
        s32, s_low = stored[name]
        assert np.all(s_low >= s32) and np.all(s_low - s32 <= low.eps * s32)
        moved += int(np.any(s_low > low.round(s32)))
    assert moved >= 1  # some scale rounded up where nearest would have gone down
    covered = [(127.0 * float(np.max(stored[name][1])), fp32.scales.activations[tensor])
               for tensor, name in quantized.items() if tensor in fp32.scales.activations]
    assert covered and all(r >= amax * (1 - 1e-6) for r, amax in covered)  # 127 x scale >= amax
    weights = {n.input[1] for n in fp32.model.graph.node if n.op_type == "DequantizeLinear"} - acts
    assert weights
    for name in weights:
        s32, s_low = stored[name]
        assert np.array_equal(s_low, np.maximum(low.round(s32), np.float32(low.tiny)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_data_the_measured_better_scale_rounding_is_kept_and_reported(seed):
    """With data, both roundings of the activation scales are measured and the one whose output
    cosine stays closer to the FP32 float parts' is kept; the report says which, with both drops.
    The ranges are given (the plain maxima, off the FP16 grid): calibration's own scales are FP16
    values already, with nothing to choose (test_scale_grid.py)."""
    from onnx_qat.formats.float_parts import activation_scales, get_low_type

    low = get_low_type("fp16")
    model = residual_block_model(projection=True, seed=seed)
    data = random_inputs(model, num=16, seed=seed)
    given = amax_table_each(model, data)
    fp32 = onnx_qat.quantize(model, scales=given, progress=False)
    result = cast_float_parts(fp32.model, "fp16", scales=given, data=data, reference=model)
    assert_check_clean(result.model)
    rounding = result.measurement["scale_rounding"]
    assert rounding["drop_up"] != rounding["drop_nearest"]  # given scales off the grid: two roundings
    assert rounding["chosen"] in ("up", "nearest")
    assert rounding["chosen"] == ("nearest" if rounding["drop_nearest"] < rounding["drop_up"] else "up")
    stored = _stored_scales(fp32.model, result.model, low)
    for name in activation_scales(fp32.model):
        s32, s_low = stored[name]
        want = low.round_up(s32) if rounding["chosen"] == "up" else low.round(s32)
        assert np.array_equal(s_low, np.maximum(want, np.float32(low.tiny))), name
    outputs = result.measurement["outputs"]["output"]
    assert outputs["cosine_fp32"] - outputs["cosine"] == pytest.approx(
        min(rounding["drop_up"], rounding["drop_nearest"]), abs=1e-9)


def test_activation_scales_are_those_of_quantize_nodes_and_the_dequantize_nodes_they_feed():
    from onnx import helper

    from onnx_qat.formats.float_parts import activation_scales

    inits = [numpy_helper.from_array(np.float32(v), n) for n, v in (("s_q", 0.1), ("s_dq", 0.1))]
    inits += [numpy_helper.from_array(np.full(4, 0.01, np.float32), "s_w"),
              numpy_helper.from_array(np.ones((4, 4, 1, 1), np.int8), "w_q"),
              numpy_helper.from_array(np.int8(0), "zp")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_q", "zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s_dq", "zp"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_q", "s_w"], ["w"], axis=0),
             helper.make_node("Conv", ["xd", "w"], ["y"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, 2, 2]) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "g", io[:1], io[1:], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert activation_scales(model) == {"s_q", "s_dq"}


def _nhwc_image_model(seed=0):
    """input [1, 16, 16, 3] (an NHWC image, as Keras exports it) -> Transpose ``to_nchw`` -> Conv ``conv``
    (16 channels) -> Relu -> output."""
    b = GraphBuilder("nhwc_image", seed)
    x = b.input("input", [1, 16, 16, 3])
    y = b.node("Transpose", [x], name="to_nchw", perm=[0, 3, 1, 2])
    b.node("Relu", [b.conv(y, 3, 16, "conv")], "output", name="relu")
    b.output("output")
    return b.build()


def _codes(model, feeds, tensor):
    """The quantized codes of the QuantizeLinear reading ``tensor`` (exposed as an extra output)."""
    from onnx_qat.runtime.sessions import make_session

    q = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor)
    session = make_session(model, extra_outputs=[q.output[0]], optimize=False)
    count = len(next(iter(feeds.values())))
    return np.concatenate([session.run([q.output[0]], {k: v[i : i + 1] for k, v in feeds.items()})[0]
                           for i in range(count)])


@pytest.mark.parametrize("seed", [0, 1])
def test_rule_boundary_the_graph_inputs_quantize_reads_it_in_fp32_and_flips_no_code(seed):
    """Rule ``boundary``: the QuantizeLinear of an FP32 graph input (through the Transpose of an NHWC
    image) stays FP32, so its INT8 codes are those of the FP32 float parts, every one; converted, a
    Cast to FP16 before it would round the 0..255 image (steps of 1/8 above 128) and flip codes."""
    model = _nhwc_image_model(seed)
    rng = np.random.default_rng(seed)
    data = {"input": rng.uniform(0, 255, (16, 16, 16, 3)).astype(np.float32)}
    fp32 = onnx_qat.quantize(model, data=data, progress=False)
    fp16 = onnx_qat.quantize(model, data=data, float_dtype="fp16", progress=False)
    assert_check_clean(fp16.model)
    kept = {k.node: k.rule for k in fp16.float_parts.kept}
    q = next(n for n in fp16.model.graph.node
             if n.op_type == "QuantizeLinear" and n.input[0] == "to_nchw_out")
    assert kept == {q.name: "boundary", "to_nchw": "boundary"}
    assert not any(n.op_type == "Cast" and n.input[0] == "input" for n in fp16.model.graph.node)
    assert fp32_compute(fp16.model) == []  # the Conv computes in FP16
    feeds = {"input": data["input"][:4]}
    emulated = emulate_in_fp32(fp16.model, "fp16")
    c32, c16 = _codes(fp32.model, feeds, "to_nchw_out"), _codes(emulated, feeds, "to_nchw_out")
    assert c32.size == 4 * 3 * 16 * 16 and np.array_equal(c32, c16)
    # what the Cast would have done: the same scale, the image rounded to FP16 first
    scale = float(numpy_helper.to_array(next(t for t in fp32.model.graph.initializer
                                             if t.name == q.input[1])))
    nchw = feeds["input"].transpose(0, 3, 1, 2)
    flipped = np.mean(np.round(nchw.astype(np.float16).astype(np.float32) / scale) != np.round(nchw / scale))
    assert flipped > 0.005
    # the output: the FP16 form is the FP32 one up to FP16's rounding of the Conv (bias, output)
    out32, out16 = run_each(fp32.model, feeds), run_each(emulated, feeds)
    assert np.max(np.abs(out16 - out32)) <= 2e-3 * np.max(np.abs(out32))


def test_rule_boundary_not_with_low_io_types():
    """With ``keep_io_types=False`` the graph input is FP16 itself: nothing is kept."""
    model = _nhwc_image_model()
    data = {"input": np.random.default_rng(0).uniform(0, 255, (8, 16, 16, 3)).astype(np.float32)}
    fp32 = onnx_qat.quantize(model, data=data, progress=False)
    result = cast_float_parts(fp32.model, "fp16", scales=fp32.scales, keep_io_types=False)
    assert result.kept == ()
    assert result.model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16


@pytest.mark.parametrize("seed", [1, 2])
def test_rule_boundary_after_a_kept_node_and_one_scale_per_qdq_pair(seed):
    """A QuantizeLinear reading the output of a node kept FP32 reads it without a Cast (rule
    ``boundary``); its FP32 scale holds the value its DequantizeLinear stores in FP16 (a given range,
    off the FP16 grid, rounded up in both), so the pair quantizes and dequantizes with one scale."""
    model = residual_block_model(projection=True, seed=seed)
    data = random_inputs(model, num=8, seed=seed)
    fp32 = onnx_qat.quantize(model, scales=amax_table_each(model, data), progress=False)
    result = cast_float_parts(fp32.model, "fp16", scales=fp32.scales, exclude_nodes=["stem_relu"])
    assert_check_clean(result.model)
    kept = {k.node: k for k in result.kept}
    q = next(n for n in result.model.graph.node
             if n.op_type == "QuantizeLinear" and n.input[0] == "stem_relu_out")
    assert kept["stem_relu"].rule == "excluded" and kept[q.name].rule == "boundary"
    assert "stem_relu" in kept[q.name].reason
    inits = {t.name: t for t in result.model.graph.initializer}
    dqs = [n for n in result.model.graph.node
           if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]]
    assert dqs and inits[q.input[1]].data_type == TensorProto.FLOAT
    q_scale = onnx_qat.io.models.tensor_array(inits[q.input[1]])
    given = numpy_helper.to_array(next(t for t in fp32.model.graph.initializer if t.name == q.input[1]))
    assert q_scale >= given and q_scale == np.float16(q_scale)  # on the FP16 grid, rounded up
    for dq in dqs:
        assert inits[dq.input[1]].data_type == TensorProto.FLOAT16
        assert onnx_qat.io.models.tensor_array(inits[dq.input[1]]).astype(np.float32) == q_scale
