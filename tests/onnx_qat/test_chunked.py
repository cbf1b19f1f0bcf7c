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
