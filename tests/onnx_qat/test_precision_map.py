"""The precision map (CheckReport.precision_map, check --precision-map) and rule C15."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_qat
from onnx_qat.check import check
from onnx_qat.check.precision import PrecisionMap
from onnx_qat.formats.numeric import KEEP_FP32_KEY
from onnx_qat.cli import EXIT_OK, EXIT_USAGE, main
from tests.builders import (
    if_cnn_model, mlp_model, random_inputs, residual_block_model, transformer_block_model,
)
from tests.onnx_qat.test_check import good_block


def _quantized(model, seed=0, **kw):
    return onnx_qat.quantize(model, data=random_inputs(model, num=4, seed=seed), progress=False, **kw).model


def _by_node(pmap: PrecisionMap):
    return {e.node: e for e in pmap.nodes}


@pytest.mark.parametrize("seed", [0, 1])
def test_resnet_block_runs_int8_with_its_fusions(seed):
    report = check(_quantized(residual_block_model(seed=seed), seed=seed))
    pmap = report.precision_map
    nodes = _by_node(pmap)
    assert pmap.counts() == {"int8": 9}
    assert nodes["conv2"].reason.startswith("activation and weight")
    assert nodes["add"].reason == "fused into 'conv2'" and nodes["bn1"].reason == "fused into 'conv1'"
    assert [(u.node, u.rule) for u in pmap.unfused] == [("input_QuantizeLinear", "U1")]
    assert report.findings == ()  # C15 has nothing to say about an all-INT8 model


def test_transformer_names_its_fp32_attention_products():
    report = check(_quantized(transformer_block_model()))
    pmap = report.precision_map
    fp32 = [e.node for e in pmap.fp32_compute(weighted_only=True)]
    assert fp32 == ["scores", "context"]  # attention products: two activations, not quantized by default
    assert _by_node(pmap)["q_bias"].reason == "fused into 'q'"  # the bias Add runs in the MatMul
    assert pmap.counts()["int8"] == 14 and pmap.counts()["fp32"] == 20
    assert "FP32 Conv/Gemm/MatMul: 2 (scores, context)" in pmap.summary()
    assert report.findings == ()  # float parts FP32 on purpose (quantize says so): a note, no warning
    (note,) = report.notes
    assert note.rule == "C15" and note.severity == "note" and note.node == "(model)"
    assert note.message.startswith("2 Conv/ConvTranspose/Gemm/MatMul (scores, context) run in FP32")
    assert "onnx_qat.float_dtype=fp32" in note.message and "--float-dtype fp16" in note.message
    assert str(note) in str(report) and report.to_dict()["notes"][0]["rule"] == "C15"
    assert report.to_dict()["num_warnings"] == 0


def _without_float_dtype(model):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    keep = [p for p in out.metadata_props if p.key != "onnx_qat.float_dtype"]
    del out.metadata_props[:]
    out.metadata_props.extend(keep)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_c15_warns_about_fp32_matmuls_of_a_quantized_model_that_does_not_say_why(seed):
    """Another tool's INT8 model (or a hand-edited one) with FP32 attention products: TensorRT 11 runs
    them in FP32, and nothing says that is meant: one warning each."""
    quantized = _quantized(transformer_block_model(seed=seed), seed=seed)
    assert {p.key: p.value for p in quantized.metadata_props}["onnx_qat.float_dtype"] == "fp32"
    report = check(_without_float_dtype(quantized))
    c15 = [f for f in report.findings if f.rule == "C15"]
    assert [(f.node, f.severity) for f in c15] == [("scores", "warning"), ("context", "warning")]
    assert all("does not say its float parts are FP32 on purpose" in f.message for f in c15)
    assert report.notes == () and report.passed


def test_c15_says_nothing_about_an_all_int8_model_or_a_float_one():
    """No FP32 weighted op beside quantized compute (every Conv INT8), or no quantized compute at all
    (a float model, which C13 reports): C15 is silent, with or without the record."""
    int8 = _without_float_dtype(_quantized(residual_block_model()))
    assert not [f for f in check(int8).findings + check(int8).notes if f.rule == "C15"]
    floats = check(transformer_block_model())
    assert not [f for f in floats.findings + floats.notes if f.rule == "C15"]


def test_fp16_float_parts_replace_the_fp32_record():
    model = transformer_block_model()
    data = random_inputs(model, num=4, seed=0)
    fp16 = onnx_qat.quantize(model, data=data, float_dtype="fp16", progress=False).model
    assert {p.key: p.value for p in fp16.metadata_props}["onnx_qat.float_dtype"] == "fp16"
    assert [p.key for p in fp16.metadata_props].count("onnx_qat.float_dtype") == 1


def test_fp8_and_int4_forms():
    fp8 = check(_quantized(mlp_model(features=64, hidden=64, classes=16), precision="fp8")).precision_map
    assert fp8.counts().get("fp8", 0) >= 2 and "int8" not in fp8.counts()
    int4 = check(_quantized(mlp_model(features=128, hidden=128, classes=16), precision="int4")).precision_map
    weighted = [e for e in int4.nodes if e.op_type in ("MatMul", "Gemm")]
    assert weighted and all(e.precision == "int4" and "weight-only" in e.reason for e in weighted)


def test_dq_read_by_a_float_op_is_unfused_by_rule_u2():
    b = good_block()
    soft = b.add("Softmax", [b.dq(b.q("gap_out", "gq"), "gdq")], "soft", axis=1)
    b.outputs = []
    b.output(soft, [1, 8, 1, 1])
    pmap = check(b.model()).precision_map
    unfused = {u.node: u for u in pmap.unfused}
    assert unfused["gdq"].rule == "U2" and "Softmax 'soft'" in unfused["gdq"].reason
    assert unfused["x_q"].rule == "U1"
    assert _by_node(pmap)["soft"].precision == "fp32"


def _fp16_mlp(keep_reason=None) -> onnx.ModelProto:
    """x (fp32) -> Cast fp16 -> MatMul w1 (fp16) -> Relu -> Cast fp32 -> MatMul w2 (fp32) -> y."""
    rng = np.random.default_rng(5)
    w1 = numpy_helper.from_array(rng.normal(0, 0.1, (16, 32)).astype(np.float16), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.1, (32, 8)).astype(np.float32), "w2")
    nodes = [helper.make_node("Cast", ["x"], ["x16"], name="to16", to=TensorProto.FLOAT16),
             helper.make_node("MatMul", ["x16", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Cast", ["r"], ["r32"], name="to32", to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["r32", "w2"], ["y"], name="fc2")]
    if keep_reason is not None:
        entry = nodes[-1].metadata_props.add()
        entry.key, entry.value = KEEP_FP32_KEY, keep_reason
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    graph = helper.make_graph(nodes, "fp16_mlp", [x], [y], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_c15_warns_about_an_fp32_matmul_among_fp16_compute():
    report = check(_fp16_mlp())
    assert _by_node(report.precision_map)["fc1"].precision == "fp16"
    assert _by_node(report.precision_map)["relu"].precision == "fp16"
    (c15,) = [f for f in report.findings if f.rule == "C15"]
    assert c15.severity == "warning" and c15.node == "fc2"
    assert "runs in FP32 under a strongly typed build" in c15.message and "kept" not in c15.message


def test_c15_names_the_conversions_reason():
    report = check(_fp16_mlp("range 1.2e5 exceeds FP16 max 65504"))
    (c15,) = [f for f in report.findings if f.rule == "C15"]
    assert c15.message.endswith("kept FP32 by the conversion: range 1.2e5 exceeds FP16 max 65504")
    assert _by_node(report.precision_map)["fc2"].reason.startswith("kept FP32 by the conversion")
    assert not [f for f in check(_fp16_mlp(), target="ort-cpu").findings if f.rule == "C15"]


def test_subgraph_nodes_are_named_inside_their_parent():
    pmap = check(_quantized(if_cnn_model())).precision_map
    inner = [e.node for e in pmap.nodes if "/" in e.node]
    assert inner and all(e.count("/") >= 2 for e in inner)


def test_cli_writes_the_map_and_prints_its_summary(tmp_path, capsys):
    path, out = tmp_path / "q.onnx", tmp_path / "map.json"
    onnx.save(_quantized(transformer_block_model()), str(path))
    assert main(["check", str(path), "--precision-map", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    assert "precision (strongly typed build): 14 INT8, 20 FP32" in printed and f"wrote {out}" in printed
    assert "NOTE    C15  (model): 2 Conv/ConvTranspose/Gemm/MatMul (scores, context) run in FP32" in printed
    assert "0 errors, 0 warnings" in printed
    data = json.loads(out.read_text())
    assert data["format"] == "onnx-qat-precision-map" and data["counts"] == {"int8": 14, "fp32": 20}
    assert {n["node"] for n in data["nodes"] if n["precision"] == "fp32" and n["op_type"] == "MatMul"} == \
        {"scores", "context"}
    assert data["unfused_qdq"] == [{
        "node": "input_QuantizeLinear", "op_type": "QuantizeLinear", "rule": "U1",
        "reason": "quantizes graph input 'input': no layer before it to fuse into"}]


def test_cli_refuses_a_map_path_equal_to_the_model(tmp_path, capsys):
    path = tmp_path / "q.onnx"
    onnx.save(_quantized(residual_block_model()), str(path))
    before = path.read_bytes()
    assert main(["check", str(path), "--precision-map", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--precision-map" in err and path.read_bytes() == before
