"""Model I/O: loading, validation, opset upgrade, IR version, atomic and external-data saving."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat.errors import ModelError
from onnx_qat.io.models import (
    MAX_IR_VERSION, default_opset, from_graph, load_model, save_model,
    to_graph,
)

ROOT = Path(__file__).resolve().parents[2]


def _conv_model(opset: int = 13, ir_version: int = 8, init_as_input: bool = False,
                channels: int = 4) -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv -> BatchNormalization -> Relu -> Reshape -> Gemm -> y[N,5]."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((channels, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "mean"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), "var"),
        numpy_helper.from_array(np.array([0, -1], np.int64), "shape"),
        numpy_helper.from_array(rng.standard_normal((5, channels * 36)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["flat"], name="reshape"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["y"], name="fc", transB=1),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])]
    if init_as_input:
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(nodes, "tiny", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="tests")
    model.ir_version = ir_version
    return model


def _run(model_or_path, x: np.ndarray) -> np.ndarray:
    is_proto = isinstance(model_or_path, onnx.ModelProto)
    src = model_or_path.SerializeToString() if is_proto else str(model_or_path)
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


X = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)


# --------------------------------------------------------------------------- loading
def test_load_from_path_and_proto_returns_copy(tmp_path):
    model = _conv_model()
    before = model.SerializeToString()
    loaded = load_model(model)
    assert loaded is not model
    loaded.graph.node[0].name = "changed"
    assert model.SerializeToString() == before
    path = tmp_path / "m.onnx"
    path.write_bytes(before)
    from_path = load_model(path)
    np.testing.assert_allclose(_run(from_path, X), _run(model, X), rtol=1e-6, atol=1e-6)


def test_ir_version_lowered_so_onnxruntime_loads():
    model = _conv_model()  # onnx >= 1.23 writes a recent IR version by default
    model.ir_version = 14
    loaded = load_model(model)
    assert loaded.ir_version == helper.find_min_ir_version_for(list(loaded.opset_import), True) == 7
    assert _run(loaded, X).shape == (2, 5)


def test_opset9_model_with_initializer_inputs_upgraded_same_outputs(tmp_path):
    old = _conv_model(opset=9, ir_version=3, init_as_input=True)
    onnx.checker.check_model(old)
    expected = _run(old, X)
    path = tmp_path / "old.onnx"
    path.write_bytes(old.SerializeToString())
    model = load_model(path)
    assert default_opset(model) == 13
    assert 4 <= model.ir_version <= MAX_IR_VERSION
    assert [i.name for i in model.graph.input] == ["x"]
    np.testing.assert_allclose(_run(model, X), expected, rtol=1e-5, atol=1e-5)
    out = save_model(model, tmp_path / "new.onnx", inputs=[path])
    np.testing.assert_allclose(_run(out, X), expected, rtol=1e-5, atol=1e-5)


def test_opset_upgrade_can_be_disabled():
    model = load_model(_conv_model(opset=11), upgrade_opset=False)
    assert default_opset(model) == 11


def test_custom_domain_ops_and_functions_kept(tmp_path):
    fn = helper.make_function("com.example", "Twice", ["a"], ["b"],
                              [helper.make_node("Add", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 13)])
    nodes = [helper.make_node("Twice", ["x"], ["t"], domain="com.example", name="twice"),
             helper.make_node("Relu", ["t"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 13),
                                                                   helper.make_opsetid("com.example", 1)])
    model.ir_version = 14
    loaded = load_model(model)
    assert loaded.graph.node[0].domain == "com.example"
    assert [f.name for f in loaded.functions] == ["Twice"]
    assert loaded.ir_version >= 8  # model-local functions need IR 8
    sess = ort.InferenceSession(loaded.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": np.array([-1, 2], np.float32)})[0], [0, 4])
    again = from_graph(to_graph(loaded))
    assert {(o.domain, o.version) for o in again.opset_import} == {("", 13), ("com.example", 1)}
    assert [f.name for f in again.functions] == ["Twice"]


def test_graph_round_trip_keeps_the_computation_and_the_graph():
    model = load_model(_conv_model())
    graph = to_graph(model)
    nodes = [id(n) for n in graph.nodes]
    out = from_graph(graph)
    assert [id(n) for n in graph.nodes] == nodes  # read, not changed
    assert out.ir_version == model.ir_version
    assert [(o.domain, o.version) for o in out.opset_import] == [("", 13)]
    np.testing.assert_allclose(_run(out, X), _run(model, X), rtol=1e-6)
    # load_model takes the Graph itself: exported, validated, the same model
    again = load_model(graph)
    assert again.graph.SerializeToString(deterministic=True) == \
        out.graph.SerializeToString(deterministic=True)


def test_validate_model_names_the_model_in_one_line():
    from onnx_qat.io.models import validate_model

    model = load_model(_conv_model())
    validate_model(model, "output model q.onnx")
    model.graph.node[0].input[0] = "nowhere"
    with pytest.raises(ModelError, match=r"^output model q.onnx is not a valid ONNX model: ") as info:
        validate_model(model, "output model q.onnx")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64,
                                   np.float16, np.float64, np.uint32, np.uint64, bool])
def test_tensor_array_equals_numpy_helper_for_raw_and_typed_fields(dtype):
    from onnx_qat.io.models import tensor_array

    values = (np.random.default_rng(3).standard_normal((3, 4)) * 50).astype(dtype)
    raw = numpy_helper.from_array(values, "t")
    typed = helper.make_tensor("t", helper.np_dtype_to_tensor_dtype(values.dtype), values.shape,
                               values.reshape(-1).tolist())
    for tensor in (raw, typed):
        got = tensor_array(tensor)
        assert got.dtype == values.dtype and got.shape == values.shape
        np.testing.assert_array_equal(got, numpy_helper.to_array(tensor))
        np.testing.assert_array_equal(got, values)
    scalar = numpy_helper.from_array(np.array(0.25, np.float32), "s")
    assert tensor_array(scalar).shape == () and float(tensor_array(scalar)) == 0.25


@pytest.mark.parametrize("ir_version", [8, 14])
def test_save_threshold_splits_by_the_size_of_the_bytes_written(tmp_path, ir_version):
    """At most ``external_data_threshold`` bytes (counted as written, IR version lowered first):
    one file equal to protobuf's own serialization; one byte less: the weights go to a ``.data``
    file beside it, and both load to the same nodes and weights."""
    model = _conv_model(ir_version=ir_version)
    one, split = tmp_path / "one.onnx", tmp_path / "split.onnx"
    save_model(model, one, ir_version=8)
    size = one.stat().st_size
    save_model(model, one, ir_version=8, external_data_threshold=size)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.ir_version = 8
    assert one.read_bytes() == copy.SerializeToString()
    assert not (tmp_path / "one.onnx.data").exists()
    save_model(model, split, ir_version=8, external_data_threshold=size - 1)
    assert (tmp_path / "split.onnx.data").exists() and split.stat().st_size < size
    loaded, whole = onnx.load(str(split)), onnx.load(str(one))
    assert list(loaded.graph.node) == list(whole.graph.node)
    arrays = {t.name: numpy_helper.to_array(t) for t in whole.graph.initializer}
    assert {t.name for t in loaded.graph.initializer} == set(arrays)
    for tensor in loaded.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), arrays[tensor.name])
