"""``onnx_qat.runtime.chunked.ChunkedSession``: a model run piece by piece gives the whole model's values."""
from __future__ import annotations

import numpy as np
import pytest

from onnx_qat.runtime.chunked import ChunkedSession
from onnx_qat.runtime.sessions import make_session
from tests import builders


def _whole(model, feed, outputs=None):
    session = make_session(model, optimize=False, extra_outputs=outputs or ())
    names = outputs or [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, feed)))


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
@pytest.mark.parametrize("seed", [0, 1])
def test_pieces_give_the_whole_models_outputs_bit_for_bit(chunk, seed):
    model = builders.residual_block_model(seed=seed)
    feed = builders.random_inputs(model, seed=seed)
    expected = _whole(model, feed)
    session = ChunkedSession(model, chunk_nodes=chunk)
    assert len(session.pieces) == -(-len(model.graph.node) // chunk)
    got = dict(zip(expected, session.run(None, feed)))
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value)


def test_skip_connections_across_pieces_and_intermediate_outputs():
    model = builders.residual_chain_model(12)
    feed = {"input": np.random.default_rng(3).standard_normal((1, 16, 1, 1)).astype(np.float32) * 1e-3}
    wanted = ["o0", "r5", "o11"]
    expected = _whole(model, feed, wanted)
    session = ChunkedSession(model, wanted, chunk_nodes=5)
    for name, value in zip(wanted, session.run(wanted, feed)):
        np.testing.assert_array_equal(value, expected[name])
    # a tensor read by no later piece is not kept alive past its piece
    assert all("c0" not in dead for dead in session.dead[1:])


def test_if_branches_read_outer_names_across_pieces():
    model = builders.if_cnn_model()
    feed = builders.random_inputs(model, num=2, seed=4)
    for flip in (1.0, -1.0):  # both branches
        feed = {k: v * flip for k, v in feed.items()}
        expected = _whole(model, feed)
        got = ChunkedSession(model, chunk_nodes=2).run(None, feed)
        for value, want in zip(got, expected.values()):
            np.testing.assert_array_equal(value, want)


def test_a_smaller_last_batch_reuses_the_session_of_symbolic_batch():
    model = builders.if_cnn_model()  # symbolic batch
    session = ChunkedSession(model, chunk_nodes=2)
    for batch in (4, 4, 1):
        feed = builders.random_inputs(model, num=batch, seed=batch)
        expected = _whole(model, feed)
        for value, want in zip(session.run(None, feed), expected.values()):
            np.testing.assert_array_equal(value, want)
    assert max(len(p.sessions) for p in session.pieces) == 1  # the batch axis is declared symbolic


def _scaled_model():
    """``y = relu(x * s) + x`` with ``x`` of symbolic batch [N, 5] and ``s`` a scalar input."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Mul", ["x", "s"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Add", ["r", "x"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5]),
              helper.make_tensor_value_info("s", TensorProto.FLOAT, [])]
    graph = helper.make_graph(nodes, "scaled", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_bound_inputs_with_batches_of_several_sizes():
    """Inputs held by `bind` give the outputs of feeding them with every run, across batches of
    different sizes through one session of symbolic batch, and a later `bind` replaces them."""
    model = _scaled_model()
    bound, fed = ChunkedSession(model, chunk_nodes=1), ChunkedSession(model, chunk_nodes=1)
    rng = np.random.default_rng(0)
    for scale in (0.5, -2.0):
        s = np.array(scale, np.float32)
        bound.bind({"s": s})
        for batch in (4, 4, 3, 2):  # one session (symbolic batch), outputs of three sizes
            x = rng.standard_normal((batch, 5)).astype(np.float32)
            got, want = bound.run(None, {"x": x})[0], fed.run(None, {"x": x, "s": s})[0]
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got, np.maximum(x * s, 0) + x)
    assert bound.pieces[0].bound == ("s",) and not fed.pieces[0].bound
    assert [len(p.sessions) for p in bound.pieces] == [1, 1, 1]


def _fixed_dim_model(features: int = 4):
    """``x`` [N, features, 6] -> MatMul [6, features] -> Relu -> Transpose -> Add [features, features]
    -> Reshape [-1, features * features] (a batch onnxruntime's shape inference cannot follow) -> y:
    fixed dimensions of ``features``, equal to the batch size when the batch holds ``features``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.standard_normal((6, features)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((features, features)).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([-1, features * features], np.int64), "shape")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Add", ["t", "b"], ["a"]), helper.make_node("Reshape", ["a", "shape"], ["f"]),
             helper.make_node("Neg", ["f"], ["y"])]
    graph = helper.make_graph(nodes, "fixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             ["N", features, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_a_fixed_dimension_equal_to_the_batch_stays_fixed(seed, scale):
    """Only the batch axis is declared symbolic: a fixed dimension of 4 fed in batches of 4 stays 4,
    so the batches of 4 and the last batch of 2 share one session per piece (6 sessions; 11 when every
    dimension equal to the batch size was taken for the batch, measured 2026-11-27); the values are the
    whole model's."""
    model = _fixed_dim_model(4)
    session = ChunkedSession(model, chunk_nodes=1)
    rng = np.random.default_rng(seed)
    for batch in (4, 4, 2, 4):
        feed = {"x": (rng.standard_normal((batch, 4, 6)) * scale).astype(np.float32)}
        expected = _whole(model, feed)
        got = session.run(None, feed)
        np.testing.assert_array_equal(got[0], expected["y"])
        assert got[0].shape == (batch, 16)
    assert [len(p.sessions) for p in session.pieces] == [1] * 6
    declared = [next(iter(p.sessions.values())).get_inputs()[0].shape for p in session.pieces]
    # x, m, r: batch first; t (transposed): batch first, 4 x 4 fixed; f after the Reshape: the batch
    # axis onnxruntime lost, symbolic since it equals the batch size
    assert declared == [["N", 4, 6], ["N", 4, 4], ["N", 4, 4], ["N", 4, 4], ["N", 4, 4], ["N", 16]]


def _state_model():
    """``y = x + sum(s, axis 0)``, ``s_out = s * 0.5``: ``x`` [N, 3] and a state ``s`` [2, N, 3] whose
    batch axis is the second (as silero-vad's state)."""
    from onnx import TensorProto, helper

    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    half = helper.make_tensor("half", TensorProto.FLOAT, [], [0.5])
    nodes = [helper.make_node("ReduceSum", ["s", "axes"], ["summed"], keepdims=0),
             helper.make_node("Add", ["x", "summed"], ["y"]),
             helper.make_node("Mul", ["s", "half"], ["s_out"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
              helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, "N", 3])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
               helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [2, "N", 3])]
    graph = helper.make_graph(nodes, "state", inputs, outputs, [axes, half])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_the_declared_batch_axis_of_an_input_is_the_symbolic_one():
    """A state input of batch axis 1 (``batch_axis={"s": 1}``, as ``--batch-axis s=1``) in batches
    of 2 and 1: its fixed first dimension 2 (equal to the first batch size) stays fixed and its
    batch axis is symbolic, one session per piece; without the declaration the state's batch axis
    is taken fixed (the first axis is the model's fixed 2), a session per batch size."""
    model = _state_model()
    declared, undeclared = ChunkedSession(model, chunk_nodes=1, batch_axis={"s": 1}), \
        ChunkedSession(model, chunk_nodes=1)
    rng = np.random.default_rng(7)
    for batch in (2, 2, 1):
        feed = {"x": rng.standard_normal((batch, 3)).astype(np.float32),
                "s": rng.standard_normal((2, batch, 3)).astype(np.float32)}
        expected = _whole(model, feed)
        for session in (declared, undeclared):
            for value, want in zip(session.run(None, feed), expected.values()):
                np.testing.assert_array_equal(value, want)
    assert [len(p.sessions) for p in declared.pieces] == [1, 1, 1]
    shapes = [[i.shape for i in next(iter(p.sessions.values())).get_inputs()] for p in declared.pieces]
    assert shapes == [[[2, "N", 3]], [["N", 3], ["N", 3]], [[2, "N", 3]]]
    assert [len(p.sessions) for p in undeclared.pieces] == [2, 2, 2]


def test_calibration_hands_the_data_batch_axis_to_the_pieces(monkeypatch):
    """Calibration of a graph run piece by piece passes the data's declared batch axes
    (``batch_axis``, ``--batch-axis``) to `ChunkedSession`, and ``auto``'s `Calibration` keeps them for
    the judgement's pieces: the same ranges as the whole model, batches of 4 and 2 (the state's
    fixed 2)."""
    import onnx_qat
    from onnx_qat.calibration import branches, calibrate, collect

    model = _state_model()
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((6, 3)).astype(np.float32),
            "s": rng.standard_normal((2, 6, 3)).astype(np.float32)}
    dataset = onnx_qat.load_data(data, model, batch_axis={"s": 1})
    assert dict(dataset.batch_axis) == {"s": 1}
    names = ["x", "s", "summed", "y"]
    whole = calibrate(model, data, batch_axis={"s": 1}, tensors=names, method="max", batch_size=4,
                      progress=False, workers=1)
    monkeypatch.setattr(branches, "CHUNKED_NODES", 0)
    monkeypatch.setattr("onnx_qat.runtime.chunked.CHUNK_NODES", 1)
    runner = branches.make_runner(model, names, batch_axis=dataset.batch_axis)
    assert isinstance(runner, ChunkedSession) and runner.batch_axis == {"s": 1}
    for feed in dataset.batches(4):
        runner.run(names, feed)
    assert [len(p.sessions) for p in runner.pieces] == [1, 1, 1]
    pieces = calibrate(model, data, batch_axis={"s": 1}, tensors=names, method="max", batch_size=4,
                       progress=False, workers=1)
    assert pieces.activations == whole.activations
    result = collect(model, dataset, names, method="auto", batch_size=4, progress=False)
    assert result.batch_axis == {"s": 1}
