"""onnx_qat.quantize end to end: every builder model, files, refusals, immutability, determinism."""
import hashlib
import json

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.scales import ScaleTable
from tests import builders as B

MODELS = {
    "conv_bn_relu": B.conv_bn_relu_model,
    "residual": B.residual_block_model,
    "residual_projection": lambda: B.residual_block_model(projection=True),
    "mlp": B.mlp_model,
    "concat": B.concat_model,
    "depthwise": B.depthwise_model,
    "transformer_erf_mask": B.transformer_block_model,
    "transformer_gelu_inf_mask": lambda: B.transformer_block_model(gelu="op", mask="-inf"),
    "transformer_tanh_gelu": lambda: B.transformer_block_model(gelu="tanh"),
    "opset9": B.opset9_model,
}


def _table(model):
    return B.amax_table(model, B.random_inputs(model, seed=0))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_quantize_builder_models_with_scale_table(name):
    model = MODELS[name]()
    result = onnx_qat.quantize(model, scales=_table(model), progress=False)
    B.assert_check_clean(result.model)
    ops = B.count_ops(result.model)
    assert ops["QuantizeLinear"] == result.summary["quantize_linear"] == len(result.placement.activations)
    assert ops["DequantizeLinear"] == result.summary["dequantize_linear"]
    assert result.target == "tensorrt" and result.output is None
    feeds = B.random_inputs(model, seed=11)
    ref, got = B.run(model, feeds), B.run(result.model, feeds)
    assert [g.shape for g in got] == [r.shape for r in ref]
    for r, g in zip(ref, got):
        assert B.cosine(r, g) > 0.99, name


def test_files_scales_json_output_and_report(tmp_path):
    model = B.residual_block_model(projection=True)
    src = tmp_path / "float.onnx"
    onnx.save(model, src)
    scales_path = tmp_path / "scales.json"
    _table(model).save(scales_path)
    out, rep = tmp_path / "qdq.onnx", tmp_path / "report.json"
    result = onnx_qat.quantize(src, out, scales=scales_path, report=rep, progress=False)
    assert result.output == out
    saved = onnx.load(out)
    assert B.count_ops(saved)["QuantizeLinear"] == 4
    assert saved.ir_version <= 10
    data = json.loads(rep.read_text())
    assert data["format"] == "onnx-qat-quantize-report" and data["target"]["name"] == "tensorrt"
    kinds = {(r["kind"], r["tensor"]) for r in data["inserted"]}
    assert ("activation", "proj_bn_out") in kinds and ("weight", "conv1.weight") in kinds
    assert all(r["rule"] and r["reason"] for r in data["inserted"])
    assert data["summary"]["activations"] == 4
    again = tmp_path / "again.onnx"
    result.save(again)
    assert again.read_bytes() == out.read_bytes()


def test_already_quantized_model_is_refused():
    model = B.conv_bn_relu_model()
    qdq = onnx_qat.quantize(model, scales=_table(model), progress=False).model
    with pytest.raises(onnx_qat.PlacementError, match="already quantized.*QuantizeLinear"):
        onnx_qat.quantize(qdq, scales=_table(model), progress=False)


def test_nothing_to_quantize_says_what_was_found():
    b = B.GraphBuilder("relu_only")
    x = b.input("input", [1, 4])
    b.node("Relu", [x], "output", name="relu")
    b.output("output")
    with pytest.raises(onnx_qat.PlacementError, match="nothing to quantize.*1 Relu"):
        onnx_qat.quantize(b.build(), scales=ScaleTable({"input": 1.0}), progress=False)
    model = B.mlp_model()
    with pytest.raises(onnx_qat.PlacementError, match="3 node.*skipped.*exclude_op_types"):
        onnx_qat.quantize(model, scales=_table(model), exclude_op_types=["Gemm", "MatMul"], progress=False)


def test_scale_table_problems_are_named():
    model = B.residual_block_model()
    with pytest.raises(onnx_qat.ScalesError, match="no range for 2 tensor.*relu1_out"):
        onnx_qat.quantize(model, scales=ScaleTable({"input": 1.0}), progress=False)
    with pytest.raises(onnx_qat.ScalesError, match="does not have"):
        unknown = _table(model).merged(ScaleTable({"no_such_tensor": 1.0}))
        onnx_qat.quantize(model, scales=unknown, progress=False)
    with pytest.raises(onnx_qat.ScalesError, match="channels"):
        bad = ScaleTable(weights={"conv1.weight": {"axis": 0, "amax": [1.0] * 3}})
        onnx_qat.quantize(model, scales=_table(model).merged(bad), progress=False)


def test_exactly_one_source_of_ranges():
    model = B.conv_bn_relu_model()
    with pytest.raises(onnx_qat.ConfigError, match="exactly one"):
        onnx_qat.quantize(model, progress=False)
    with pytest.raises(onnx_qat.ConfigError, match="exactly one"):
        onnx_qat.quantize(model, scales=_table(model), data=B.random_inputs(model), progress=False)
    with pytest.raises(onnx_qat.ConfigError, match="only with data"):
        onnx_qat.quantize(model, scales=_table(model), method="entropy", progress=False)


def test_scales_as_a_mapping_of_amax_equal_the_scale_table_and_other_types_are_refused():
    """A plain {activation tensor: amax} mapping gives the same model bytes as the ScaleTable of those
    ranges; a list or a number is a one-line ConfigError."""
    model = B.residual_block_model()
    table = _table(model)
    amaxes = {t: table.activations[t] for t in onnx_qat.place(model).activation_tensors()}
    from_table = onnx_qat.quantize(model, scales=ScaleTable(amaxes), progress=False)
    from_dict = onnx_qat.quantize(model, scales=dict(amaxes), progress=False)
    assert from_dict.model.SerializeToString() == from_table.model.SerializeToString()
    assert dict(from_dict.scales.activations) == amaxes
    with pytest.raises(onnx_qat.ScalesError, match="amax"):
        onnx_qat.quantize(model, scales={**amaxes, next(iter(amaxes)): -1.0}, progress=False)
    for bad in ([1.0], 3.0):
        with pytest.raises(onnx_qat.ConfigError,
                           match=rf"^scales must be a ScaleTable.*not {type(bad).__name__}$"):
            onnx_qat.quantize(model, scales=bad, progress=False)


def test_output_paths_checked_before_any_work(tmp_path):
    model = B.conv_bn_relu_model()
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    bad_scales = ScaleTable({"nope": 1.0})  # would fail later; the path check must come first
    with pytest.raises(onnx_qat.OutputError, match="input"):
        onnx_qat.quantize(src, src, scales=bad_scales, progress=False)
    with pytest.raises(onnx_qat.OutputError, match="does not exist"):
        onnx_qat.quantize(src, tmp_path / "missing" / "o.onnx", scales=bad_scales, progress=False)
    with pytest.raises(onnx_qat.OutputError):
        onnx_qat.quantize(src, tmp_path / "o.onnx", scales=bad_scales, report=tmp_path, progress=False)
    with pytest.raises(onnx_qat.ConfigError, match="same file"):
        onnx_qat.quantize(src, tmp_path / "o.onnx", scales=_table(model), report=tmp_path / "o.onnx",
                          progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_input_model_and_file_are_never_changed(tmp_path):
    model = B.opset9_model()
    before = _sha(model.SerializeToString(deterministic=True))
    src = tmp_path / "old.onnx"
    onnx.save(model, src)
    file_before = _sha(src.read_bytes())
    table = _table(model)
    onnx_qat.quantize(model, scales=table, progress=False)
    onnx_qat.quantize(src, tmp_path / "out.onnx", scales=table, progress=False)
    assert _sha(model.SerializeToString(deterministic=True)) == before
    assert _sha(src.read_bytes()) == file_before


def test_two_runs_are_byte_identical(tmp_path):
    model = B.concat_model()
    table = _table(model)
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    ra = onnx_qat.quantize(model, a, scales=table, report=tmp_path / "a.json", progress=False)
    rb = onnx_qat.quantize(B.concat_model(), b, scales=table, report=tmp_path / "b.json", progress=False)
    assert a.read_bytes() == b.read_bytes()
    assert ra.to_report()["inserted"] == rb.to_report()["inserted"]
    report_a = (tmp_path / "a.json").read_text().replace("a.onnx", "")
    assert report_a == (tmp_path / "b.json").read_text().replace("b.onnx", "")


def test_options_reach_placement():
    model = B.residual_block_model()
    result = onnx_qat.quantize(model, scales=_table(model), exclude_nodes=["stem_.*"], progress=False)
    B.assert_float_input(result.model, "stem_conv", 0)
    B.assert_float_input(result.model, "stem_conv", 1)
    assert {d["node"] for d in result.to_report()["skipped"]} == {"stem_conv", "stem_relu"}
    config = onnx_qat.QuantizeConfig(include_attention=True)
    model = B.transformer_block_model()
    result = onnx_qat.quantize(model, scales=_table(model), config=config, progress=False)
    B.assert_qdq_on(result.model, "softmax_out", "context", 0)


def test_quantize_from_calibration_data():
    calibration = pytest.importorskip("onnx_qat.calibration")
    if not hasattr(calibration, "calibrate"):
        pytest.skip("onnx_qat.calibration.calibrate is not available yet")
    model = B.residual_block_model()
    rng = np.random.default_rng(0)
    data = {"input": rng.standard_normal((8, 16, 8, 8)).astype(np.float32)}
    result = onnx_qat.quantize(model, data=data, progress=False)
    assert set(result.placement.activation_tensors()) <= set(result.scales.activations)
    feeds = B.random_inputs(model, seed=5)
    assert B.cosine(B.run(model, feeds)[0], B.run(result.model, feeds)[0]) > 0.99


def test_quantize_from_npz_file_with_entropy(tmp_path):
    calibration = pytest.importorskip("onnx_qat.calibration")
    if not hasattr(calibration, "calibrate"):
        pytest.skip("onnx_qat.calibration.calibrate is not available yet")
    model = B.mlp_model()
    path = tmp_path / "calib.npz"
    np.savez(path, input=np.random.default_rng(3).standard_normal((16, 2, 32)).astype(np.float32))
    result = onnx_qat.quantize(model, data=path, method="entropy", progress=False)
    assert "entropy" in result.scales.producer
    assert set(result.scales.activations) == set(result.placement.activation_tensors())
    B.assert_check_clean(result.model)


def test_unknown_target_is_refused():
    model = B.conv_bn_relu_model()
    with pytest.raises(onnx_qat.ConfigError, match="target"):
        onnx_qat.quantize(model, scales=_table(model), target="gpu", progress=False)


def test_public_functions_stay_functions_after_importing_their_modules():
    import subprocess
    import sys

    code = (
        "import importlib, types, onnx_qat\n"
        "for name, where in (('quantize', 'quantize'), ('check', 'check'), ('compare', 'runtime.compare')):\n"
        "    module = importlib.import_module('onnx_qat.' + where)\n"
        "    value = getattr(onnx_qat, name)\n"
        "    assert isinstance(value, types.FunctionType), (name, value)\n"
        "    assert value is getattr(module, name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_garbage_collector_state_is_restored_after_quantize_and_after_errors():
    import gc

    from onnx_qat.io.models import cyclic_gc_paused

    model = B.residual_block_model()
    enabled = gc.isenabled()
    try:
        gc.enable()
        onnx_qat.quantize(model, scales=_table(model), progress=False)
        assert gc.isenabled()
        with pytest.raises(RuntimeError), cyclic_gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("stop")
        assert gc.isenabled()
        gc.disable()  # a caller who turned it off keeps it off
        onnx_qat.quantize(model, scales=_table(model), progress=False)
        assert not gc.isenabled()
    finally:
        (gc.enable if enabled else gc.disable)()


def test_a_rewrite_that_fails_leaves_the_callers_model_as_it_was():
    """An error inside insertion (a weight range on the wrong axis, found after other Q/DQ pairs were
    inserted) is a ScalesError, and the caller's ModelProto is byte-identical afterwards: the edits
    are made on a private copy."""
    model = B.conv_bn_relu_model()
    before = model.SerializeToString(deterministic=True)
    table = _table(model)
    weight = next(i for i in model.graph.initializer if len(i.dims) == 4)
    bad = ScaleTable(dict(table.activations), {weight.name: {"axis": 1, "amax": [1.0] * weight.dims[1]}})
    with pytest.raises(onnx_qat.ScalesError, match="does not match the quantization axis"):
        onnx_qat.quantize(model, scales=bad, progress=False)
    assert model.SerializeToString(deterministic=True) == before
