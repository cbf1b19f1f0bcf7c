"""onnx-graphsurgeon as an interface: ``quantize``, ``place`` and ``check`` take a ``gs.Graph`` (never
changed), and ``QuantizeResult.to_graph()`` gives the Q/DQ model back as one."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.errors import ModelError
from tests.builders import GraphBuilder, cosine, count_ops, run

gs = pytest.importorskip("onnx_graphsurgeon")


def _model_to_edit(seed: int = 0) -> onnx.ModelProto:
    """A residual block with a leftover debugging Identity after the stem and a Relu at the end that
    the deployment wants as a ReLU6 (Clip 0..6): the two edits graphsurgeon users make below."""
    b = GraphBuilder("to_edit", seed)
    x = b.input("input", [1, 16, 8, 8])
    stem = b.relu(b.conv(x, 16, 16, "stem_conv"), "stem_relu")
    probe = b.node("Identity", [stem], name="debug_probe")
    y = b.relu(b.bn(b.conv(probe, 16, 16, "conv1"), 16, "bn1"), "relu1")
    y = b.bn(b.conv(y, 16, 16, "conv2"), 16, "bn2")
    y = b.node("Add", [y, stem], name="add")
    b.node("Relu", [y], "output", name="relu_out")
    b.output("output")
    return b.build()


def _surgery(graph) -> None:
    """Fold the Identity away and replace the last Relu with Clip(0, 6), as a TensorRT user would."""
    probe = next(n for n in graph.nodes if n.name == "debug_probe")
    source, probed = probe.inputs[0], probe.outputs[0]
    for consumer in list(probed.outputs):
        consumer.inputs[consumer.inputs.index(probed)] = source
    probe.outputs.clear()
    relu = next(n for n in graph.nodes if n.name == "relu_out")
    low = gs.Constant("relu6_min", np.array(0.0, np.float32))
    high = gs.Constant("relu6_max", np.array(6.0, np.float32))
    graph.nodes.append(gs.Node("Clip", "relu6", inputs=[relu.inputs[0], low, high],
                               outputs=list(relu.outputs)))
    relu.outputs.clear()
    graph.cleanup().toposort()


def _snapshot(graph) -> tuple:
    """What a caller could notice changing: the exported bytes and the identity of every object."""
    exported = gs.export_onnx(graph).SerializeToString(deterministic=True)
    tensors = graph.tensors()
    return exported, [id(n) for n in graph.nodes], {name: id(t) for name, t in tensors.items()}


@pytest.fixture
def edited():
    graph = gs.import_onnx(_model_to_edit())
    _surgery(graph)
    ops = [n.op for n in graph.nodes]
    assert "Identity" not in ops and "Clip" in ops and ops.count("Relu") == 2  # the surgery took
    return graph


@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 255.0)], ids=["normal", "uniform-x255"])
def test_quantize_from_a_graph_matches_the_path_byte_for_byte_and_leaves_the_graph(edited, tmp_path, seed,
                                                                                   scale):
    rng = np.random.default_rng(seed)
    if scale == 1.0:
        data = {"input": rng.standard_normal((8, 16, 8, 8)).astype(np.float32)}
    else:
        data = {"input": (rng.uniform(0, 1, (8, 16, 8, 8)) * scale).astype(np.float32)}
    before = _snapshot(edited)
    path = tmp_path / "edited.onnx"
    onnx.save(gs.export_onnx(edited), path)

    from_graph = onnx_qat.quantize(edited, tmp_path / "from_graph.onnx", data=data, progress=False)
    from_path = onnx_qat.quantize(path, tmp_path / "from_path.onnx", data=data, progress=False)

    assert _snapshot(edited) == before  # the caller's Graph is not changed
    assert (tmp_path / "from_graph.onnx").read_bytes() == (tmp_path / "from_path.onnx").read_bytes()
    assert from_graph.model.SerializeToString(deterministic=True) == \
        from_path.model.SerializeToString(deterministic=True)
    assert from_graph.scales.to_dict() == from_path.scales.to_dict()
    report = onnx_qat.check(from_graph.model)
    assert (len(report.errors), len(report.warnings)) == (0, 0), str(report)
    ops = count_ops(from_graph.model)
    assert ops["QuantizeLinear"] >= 3 and ops["Clip"] == 1 and ops["Identity"] == 0
    # the Q/DQ model computes what the edited float model computes, within int8 error
    float_out = run(gs.export_onnx(edited), {"input": data["input"][:1]})[0]
    qdq_out = run(from_graph.model, {"input": data["input"][:1]})[0]
    assert cosine(qdq_out, float_out) >= 0.98


def test_place_and_check_take_a_graph_and_leave_it(edited, tmp_path):
    before = _snapshot(edited)
    proto = gs.export_onnx(edited)
    assert onnx_qat.place(edited) == onnx_qat.place(proto)
    result = onnx_qat.quantize(edited, data={"input": np.ones((2, 16, 8, 8), np.float32)}, progress=False)
    qdq_graph = result.to_graph()
    assert str(onnx_qat.check(qdq_graph)) == str(onnx_qat.check(result.model))
    assert not onnx_qat.check(qdq_graph).errors and not onnx_qat.check(qdq_graph).warnings
    assert onnx_qat.check(edited).passed  # a float model: nothing to refuse
    assert _snapshot(edited) == before


def test_to_graph_gives_the_qdq_model_for_more_surgery(edited):
    data = {"input": np.random.default_rng(3).standard_normal((4, 16, 8, 8)).astype(np.float32)}
    result = onnx_qat.quantize(edited, data=data, progress=False)
    graph = result.to_graph()
    assert isinstance(graph, gs.Graph)
    ops = [n.op for n in graph.nodes]
    assert ops.count("QuantizeLinear") == count_ops(result.model)["QuantizeLinear"]
    assert ops.count("DequantizeLinear") == count_ops(result.model)["DequantizeLinear"]
    # the graph exports back to the same computation, and passes the check cleanly
    exported = gs.export_onnx(graph)
    np.testing.assert_array_equal(run(exported, {"input": data["input"][:1]})[0],
                                  run(result.model, {"input": data["input"][:1]})[0])
    report = onnx_qat.check(exported)
    assert (len(report.errors), len(report.warnings)) == (0, 0), str(report)
    # each call gives a new Graph; editing it leaves the result's model alone
    model_bytes = result.model.SerializeToString(deterministic=True)
    graph.nodes.clear()
    graph.cleanup()
    assert result.to_graph() is not graph and len(result.to_graph().nodes) == len(ops)
    assert result.model.SerializeToString(deterministic=True) == model_bytes


@pytest.mark.parametrize("bad", [42, {"graph": "g"}, b"\x08\x07", None], ids=["int", "dict", "bytes", "none"])
def test_an_object_of_another_kind_is_one_line(bad):
    data = {"input": np.ones((2, 16, 8, 8), np.float32)}
    for call in (lambda: onnx_qat.quantize(bad, data=data, progress=False), lambda: onnx_qat.place(bad),
                 lambda: onnx_qat.check(bad), lambda: onnx_qat.load_model(bad)):
        with pytest.raises(ModelError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and type(bad).__name__ in message
        assert "onnx_graphsurgeon.Graph" in message and isinstance(info.value, ValueError)


def test_a_graph_graphsurgeon_cannot_export_is_one_line():
    x, y = gs.Variable("x", np.float32, [1]), gs.Variable("y", np.float32, [1])
    graph = gs.Graph(nodes=[gs.Node("Relu", "r", attrs={"note": object()}, inputs=[x], outputs=[y])],
                     inputs=[x], outputs=[y], opset=17)  # an attribute ONNX cannot hold
    for call in (lambda: onnx_qat.quantize(graph, data={"x": np.ones((1,), np.float32)}, progress=False),
                 lambda: onnx_qat.check(graph)):
        with pytest.raises(ModelError, match="^onnx_graphsurgeon.Graph cannot be exported to ONNX: ") as info:
            call()
        assert "\n" not in str(info.value)


def test_the_path_and_proto_routes_do_not_import_graphsurgeon(tmp_path):
    """Accepting a Graph costs ``import onnx_qat`` nothing: graphsurgeon is imported only when the
    caller has imported it (a Graph in hand) or asks for one (``to_graph``)."""
    onnx.save(_model_to_edit(), tmp_path / "m.onnx")
    code = (
        "import sys, numpy as np, onnx_qat\n"
        f"r = onnx_qat.quantize({str(tmp_path / 'm.onnx')!r},\n"
        "                      data={'input': np.ones((2, 16, 8, 8), 'float32')}, progress=False)\n"
        "onnx_qat.check(r.model); onnx_qat.place(r.model)\n"
        "assert 'onnx_graphsurgeon' not in sys.modules, 'imported'\n"
        "g = r.to_graph()\n"
        "assert 'onnx_graphsurgeon' in sys.modules and len(g.nodes) > 10\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
