"""onnxruntime sessions and batched runs."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat.io.data import load_data
from onnx_qat.errors import ConfigError, ModelError
from onnx_qat.runtime.sessions import make_session, run_model, session_input_specs, with_outputs


def _mlp(ir_version: int = 14) -> onnx.ModelProto:
    """x[N,4] -> MatMul ``mm`` -> Relu -> y[N,3]; IR 14 by default (what onnx 1.23 writes)."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3) / 10 - 0.5, "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = ir_version
    return model


X = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)


def _expected(x):
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10 - 0.5
    return np.maximum(x @ w, 0)


def test_session_loads_recent_ir_and_keeps_model():
    model = _mlp()
    before = model.SerializeToString()
    session = make_session(model, threads=1)
    assert model.SerializeToString() == before
    np.testing.assert_allclose(session.run(None, {"x": X})[0], _expected(X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch_size", [1, 3, 10, 64])
def test_run_model_joins_batches(batch_size):
    out = run_model(_mlp(), {"x": X}, batch_size=batch_size)
    assert list(out) == ["y"]
    np.testing.assert_allclose(out["y"], _expected(X), rtol=1e-5, atol=1e-6)


def test_extra_outputs_and_selected_outputs(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(_mlp(ir_version=8).SerializeToString())
    session = make_session(path, extra_outputs=["h", "x"])
    assert [o.name for o in session.get_outputs()] == ["y", "h", "x"]
    out = run_model(session, {"x": X}, batch_size=4, outputs=["h"])
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 10 - 0.5
    np.testing.assert_allclose(out["h"], X @ w, rtol=1e-5, atol=1e-6)


def test_unknown_names_are_model_errors():
    with pytest.raises(ModelError, match="'nope'"):
        with_outputs(_mlp(), ["nope"])
    with pytest.raises(ModelError, match="no output 'h'"):
        run_model(_mlp(), {"x": X}, outputs=["h"])
    with pytest.raises(ConfigError):
        make_session(_mlp(), threads=0)


def test_session_input_specs_and_progress(capsys):
    session = make_session(_mlp())
    specs = session_input_specs(session)
    assert specs[0].name == "x" and specs[0].shape == (None, 4) and specs[0].dtype == np.float32
    run_model(session, load_data({"x": X}, specs), batch_size=2, progress=True)
    assert "onnxruntime" in capsys.readouterr().err


def test_run_model_deterministic():
    first = run_model(_mlp(), {"x": X}, batch_size=3)["y"]
    second = run_model(_mlp(), {"x": X}, batch_size=3)["y"]
    assert first.tobytes() == second.tobytes()


def test_optimize_false_turns_graph_optimisations_off():
    import onnxruntime as ort

    level = lambda s: s.get_session_options().graph_optimization_level  # noqa: E731
    assert level(make_session(_mlp())) == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    plain = make_session(_mlp(), optimize=False)
    assert level(plain) == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    out = run_model(plain, {"x": x}, progress=False)
    np.testing.assert_allclose(next(iter(out.values())), _expected(x), rtol=1e-5, atol=1e-6)


def test_spin_false_turns_intra_op_spinning_off_and_keeps_the_outputs():
    key = "session.intra_op.allow_spinning"
    entry = lambda s: s.get_session_options().get_session_config_entry(key)  # noqa: E731
    quiet = make_session(_mlp(), spin=False)
    assert entry(quiet) == "0"
    with pytest.raises(RuntimeError):  # the default: onnxruntime's own setting, no entry
        entry(make_session(_mlp()))
    np.testing.assert_allclose(quiet.run(None, {"x": X})[0], _expected(X), rtol=1e-5, atol=1e-6)


def test_large_initializers_no_node_reads_or_only_a_subgraph_reads_do_not_break_the_session():
    """onnxruntime drops unread initializers and hands those a subgraph reads down to it; neither can
    then be given as an in-memory weight: both stay serialized, and the outputs are right."""
    from tests.builders import conv_bn_relu_model, if_cnn_model, random_inputs, run

    model = conv_bn_relu_model()
    model.graph.initializer.append(numpy_helper.from_array(np.ones((64, 64), np.float32), "unused_w"))
    feeds = random_inputs(model)
    np.testing.assert_allclose(make_session(model).run(None, feeds)[0], run(model, feeds)[0], rtol=1e-5,
                               atol=1e-5)
    model = if_cnn_model()  # 'shared_w' (2.3 KiB) is read only inside the else_branch
    feeds = {"input": -np.abs(random_inputs(model)["input"]) - 1}
    np.testing.assert_allclose(make_session(model).run(None, feeds)[0], run(model, feeds)[0], rtol=1e-4,
                               atol=1e-4)


def test_small_weights_stay_serialized_within_the_budget_with_the_same_outputs(monkeypatch):
    """Weights from IN_MEMORY_WEIGHT_BYTES up to SERIALIZED_WEIGHT_BYTES stay serialized while their bytes
    fit the budget; past it, and above that size, they reach onnxruntime as arrays; the outputs are the
    same bit for bit."""
    from onnx_qat.runtime import sessions
    from tests.builders import mobilenet_v2_model, random_inputs

    model = mobilenet_v2_model(size=16, batch=1)
    feeds = random_inputs(model)
    sized = [len(t.raw_data) for t in model.graph.initializer
             if len(t.raw_data) >= sessions.IN_MEMORY_WEIGHT_BYTES]
    small = [size for size in sized if size <= sessions.SERIALIZED_WEIGHT_BYTES]
    assert len(small) > 1 and len(sized) > len(small)
    serialized = make_session(model)
    monkeypatch.setattr(sessions, "SERIALIZED_WEIGHT_BUDGET", small[0])  # the first fits, no other
    some = make_session(model)
    monkeypatch.setattr(sessions, "SERIALIZED_WEIGHT_BYTES", 0)
    arrays = make_session(model)
    assert len(serialized._onnx_qat_weights) == len(sized) - len(small)
    assert len(some._onnx_qat_weights) == len(sized) - 1
    assert len(arrays._onnx_qat_weights) == len(sized)
    want = serialized.run(None, feeds)
    for session in (some, arrays):
        for got, expected in zip(session.run(None, feeds), want):
            np.testing.assert_array_equal(got, expected)
