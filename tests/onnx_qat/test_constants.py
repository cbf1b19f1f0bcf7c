"""One meaning of "constant" (onnx_qat.graph.constants): an initializer or a Constant's value, possibly
through Identity, Transpose, Reshape, Squeeze, Unsqueeze, Cast or Flatten; placement, the inserter
and the checker agree, and a weight arriving through such a chain is quantized on its folded value."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_qat
from onnx_qat.check.index import _all_graphs
from onnx_qat.graph.constants import fold
from onnx_qat.graph.index import GraphIndex
from tests.builders import GraphBuilder, assert_check_clean, run


def _node(op, n_inputs=1, **attrs):
    return helper.make_node(op, [f"i{k}" for k in range(n_inputs)], ["o"], **attrs)


@pytest.mark.parametrize("seed", [0, 1])
def test_fold_computes_each_op_as_numpy_does(seed):
    x = np.random.default_rng(seed).standard_normal((2, 3, 4)).astype(np.float32)
    assert np.array_equal(fold(_node("Transpose", perm=[2, 0, 1]), x, []), x.transpose(2, 0, 1))
    assert np.array_equal(fold(_node("Transpose"), x, []), x.transpose())
    assert fold(_node("Reshape", 2), x, [np.array([0, -1], np.int64)]).shape == (2, 12)
    assert fold(_node("Reshape", 2, allowzero=1), np.zeros((0, 3), np.float32),
                [np.array([3, 0], np.int64)]).shape == (3, 0)
    assert fold(_node("Unsqueeze", 2), x, [np.array([0, -1], np.int64)]).shape == (1, 2, 3, 4, 1)
    assert fold(_node("Squeeze", 2), x[None], [np.array([0], np.int64)]).shape == (2, 3, 4)
    assert fold(_node("Squeeze", axes=[0]), x[None], []).shape == (2, 3, 4)
    assert fold(_node("Cast", to=TensorProto.FLOAT16), x, []).dtype == np.float16
    assert fold(_node("Flatten", axis=2), x, []).shape == (6, 4)
    with pytest.raises(ValueError):
        fold(_node("Relu"), x, [])


def _transposed_weight_model(seed=0, through="Transpose"):
    """x [N, 64] -> MatMul(x, Transpose(W [16, 64])) -> Relu -> MatMul(., W2 [16, 8]) -> y."""
    b = GraphBuilder("folded", seed)
    x = b.input("x", ["N", 64])
    stored = (b.rng.standard_normal((16, 64)) * 0.2).astype(np.float32)
    if through == "Transpose":
        w = b.node("Transpose", [b.const("w_stored", stored)], name="w_t", perm=[1, 0])
    else:  # Reshape of a flat weight, then Transpose: a chain of two
        flat = b.const("w_stored", stored.reshape(-1))
        shaped = b.node("Reshape", [flat, b.const("w_shape", np.array([16, 64], np.int64))], name="w_r")
        w = b.node("Transpose", [shaped], name="w_t", perm=[1, 0])
    h = b.node("Relu", [b.node("MatMul", [x, w], name="fc1")], name="act")
    b.node("MatMul", [h, b.weight("w2", [16, 8])], "y", name="fc2")
    b.output("y")
    return b.build(), stored


@pytest.mark.parametrize("through", ["Transpose", "Reshape+Transpose"])
def test_graph_index_and_checker_agree_on_what_is_constant(through):
    model, _ = _transposed_weight_model(through=through)
    index = GraphIndex(model)
    graphs = _all_graphs(model, 17, False)
    assert index.is_constant("w_t_out") and graphs[0].is_constant("w_t_out")
    assert not index.is_stored_constant("w_t_out") and index.is_stored_constant("w2")
    assert index.constant_shape("w_t_out") == (64, 16)
    assert not index.is_constant("x") and not graphs[0].is_constant("x")


@pytest.mark.parametrize("through", ["Transpose", "Reshape+Transpose"])
@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_a_weight_through_a_transpose_is_quantized_on_its_folded_value(through, scale):
    model, stored = _transposed_weight_model(through=through)
    x = (np.random.default_rng(3).standard_normal((32, 64)) * scale).astype(np.float32)
    result = onnx_qat.quantize(model, data={"x": x}, method="max", progress=False)
    q = result.model
    assert_check_clean(q)
    weights = {r["tensor"]: r for r in result.inserted if r["kind"] == "weight"}
    assert weights["w_t_out"]["axis"] == 1 and weights["w_t_out"]["channels"] == 16
    ops = [n.op_type for n in q.graph.node]
    assert "Transpose" not in ops and "Reshape" not in ops  # the chain went with its last reader
    assert {t.name for t in q.graph.initializer}.isdisjoint({"w_stored", "w_shape"})
    fc1 = next(m for m in q.graph.node if m.name == "fc1")
    dq = next(n for n in q.graph.node if n.op_type == "DequantizeLinear" and n.output[0] == fc1.input[1])
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    deq = inits[dq.input[0]].astype(np.float32) * inits[dq.input[1]]
    np.testing.assert_allclose(deq, stored.T, atol=float(np.abs(stored).max()) / 127 / 2 + 1e-7)
    ref, got = run(model, {"x": x})[0], run(q, {"x": x})[0]
    cosine = float(np.dot(ref.ravel(), got.ravel()) / np.linalg.norm(ref) / np.linalg.norm(got))
    assert cosine > 0.999


def test_a_chain_another_node_also_reads_stays_for_it():
    model, _ = _transposed_weight_model()
    graph = model.graph
    graph.node.append(helper.make_node("Identity", ["w_t_out"], ["w_copy"], name="keep"))
    graph.output.append(helper.make_tensor_value_info("w_copy", TensorProto.FLOAT, [64, 16]))
    onnx.checker.check_model(model)
    q = onnx_qat.quantize(model, data={"x": np.ones((4, 64), np.float32)}, method="max",
                          progress=False).model
    assert "Transpose" in [n.op_type for n in q.graph.node]
    assert "w_stored" in {t.name for t in q.graph.initializer}


def test_int4_weight_roundings_leave_a_folded_weight_to_round_to_nearest():
    """AWQ and GPTQ edit weights in place; a folded weight is computed, so they leave it alone (round
    to nearest) and the model stays a function of its stored weights."""
    model, stored = _transposed_weight_model()
    x = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)
    for method in ("awq", "gptq"):
        result = onnx_qat.quantize(model, data={"x": x}, precision="int4", block_size=64, int4_method=method,
                                   progress=False)
        assert_check_clean(result.model)
        assert all(r.get("weight") != "w_t_out" for r in (result.gptq or ()))
        ref, got = run(model, {"x": x})[0], run(result.model, {"x": x})[0]
        cosine = float(np.dot(ref.ravel(), got.ravel()) / np.linalg.norm(ref) / np.linalg.norm(got))
        assert cosine > 0.99, (method, cosine)
