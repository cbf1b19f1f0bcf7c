"""The residual-Add rule's "computed from the weighted branch" check (rule 6): the fast answer
(no walk when every source is made after the start tensor) equals the plain bounded walk."""
import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.config import QuantizeConfig
from onnx_qat.graph.index import GraphIndex
from onnx_qat.placement.handlers import PlacementContext, _computed_from, _computed_from_walk, _made_after
from tests.builders import GraphBuilder


def _nested_model() -> onnx.ModelProto:
    """Shared skips (``input`` and ``y`` feed two Adds each), a residual nested inside another,
    and a GELU-like ``g + 0.04 * g**3`` whose "skip" is computed from the weighted branch."""
    b = GraphBuilder("nested_residual", seed=5)
    x = b.input("input", [1, 8, 4, 4])
    r1 = b.node("Add", [b.conv(x, 8, 8, "c1"), x], name="r1")
    r2 = b.node("Add", [b.conv(r1, 8, 8, "c2"), x], name="r2")           # second Add sharing skip 'input'
    y = b.node("Relu", [r2], name="y")
    c3 = b.conv(y, 8, 8, "c3")
    inner = b.node("Add", [b.conv(c3, 8, 8, "c4"), c3], name="inner")    # nested residual
    outer = b.node("Add", [b.conv(inner, 8, 8, "c5"), y], name="outer")
    again = b.node("Add", [b.conv(outer, 8, 8, "c6"), y], name="again")  # shared skip 'y'
    g = b.conv(again, 8, 8, "c7")
    cube = b.node("Mul", [b.node("Mul", [g, g], name="sq"), g], name="cube")
    scaled = b.node("Mul", [cube, b.const("k", np.float32(0.04))], name="scaled")
    b.node("Add", [g, scaled], "output", name="gelu_like")
    b.output("output")
    return b.build()


def _reversed(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with its nodes listed backwards (not topologically sorted)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    nodes = list(copy.graph.node)[::-1]
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    return copy


def _contexts(index: GraphIndex):
    convs = {n.name for n in index.nodes if n.op_type == "Conv"}
    for quantized in (set(), convs, {"c1", "c4", "c7"}):
        yield PlacementContext(index, QuantizeConfig(), quantized_weighted=set(quantized))


@pytest.mark.parametrize("order", ["sorted", "reversed"])
def test_fast_check_equals_plain_walk_on_shared_and_nested_residuals(order):
    model = _nested_model() if order == "sorted" else _reversed(_nested_model())
    index = GraphIndex(model)
    assert index.is_topologically_sorted() == (order == "sorted")
    tensors = [t for t in index.all_tensor_names() if not index.is_constant(t)]
    made = [t for t in tensors if t in index.producer]
    source_sets = [{s} for s in made] + [set(made[i:i + 3]) for i in range(len(made))]
    answers = []
    for ctx in _contexts(index):
        for tensor in tensors:
            for sources in source_sets:
                fast = _computed_from(tensor, sources, ctx)
                assert fast == _computed_from_walk(tensor, sources, ctx), (tensor, sorted(sources))
                answers.append(fast)
    assert any(answers) and not all(answers)


def test_walk_is_skipped_only_when_sources_come_later():
    index = GraphIndex(_nested_model())
    assert _made_after({"c2_out"}, "r1_out", index)              # shortcut made before its branch
    assert _made_after({"c4_out"}, "c3_out", index)              # nested residual
    assert not _made_after({"c7_out"}, "scaled_out", index)       # GELU-like: branch made first
    assert not _made_after({"c1_out"}, "c1_out", index)
    assert not _made_after(set(), "y_out", index)
    assert not _made_after({"c1_out"}, "input", index)           # a graph input: no producer
    assert not _made_after({"c2_out"}, "r1_out", GraphIndex(_reversed(_nested_model())))


def test_placement_decisions_identical_for_sorted_and_reversed_node_order():
    sorted_run = onnx_qat.place(_nested_model())
    reversed_run = onnx_qat.place(_reversed(_nested_model()))
    def key(placement):
        return sorted((d.node, d.action, d.rule, d.reason) for d in placement.decisions)

    def tensors(placement):
        return sorted(m.tensor for m in placement.activations)

    assert key(sorted_run) == key(reversed_run)
    assert tensors(sorted_run) == tensors(reversed_run)
    gelu = sorted_run.decision_for("gelu_like")
    assert gelu.action == "none" and "computed from the weighted branch" in gelu.reason
    for add, skip in (("r1", "input"), ("r2", "input"), ("inner", "c3_out"), ("outer", "y_out"),
                      ("again", "y_out")):
        assert sorted_run.decision_for(add).action == "quantize"
        assert any(m.tensor == skip and (add, 1) in m.consumers for m in sorted_run.activations), add
