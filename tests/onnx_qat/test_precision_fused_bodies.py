"""`fused_tensors` in If/Loop/Scan bodies: the tensors a fused INT8 kernel inside a body never stores are
found there, named ``parent/attribute/tensor`` (an If's two branches may use the same names), with the
rules of the main graph applied inside each body (a body tensor a float op reads, or the body returns, is
stored; a tensor of an enclosing graph a body reads is stored for it), and `emulate_in_fp32` leaves them
unrounded. The precision map applies the same rule: a Relu is not fused into a Conv whose output a branch
reads, and a DequantizeLinear a branch reads is left standalone (U2)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat.check import check
from onnx_qat.check.precision import fused_tensors
from onnx_qat.formats.float_cast import all_graphs
from onnx_qat.formats.float_parts import cast_float_parts, emulate_in_fp32

F = TensorProto.FLOAT


def _qdq(nodes, inits, tensor, scale, name):
    """Q/DQ of activation ``tensor`` (int8, zero point 0); returns the DQ output ``<name>d``."""
    inits += [numpy_helper.from_array(np.float32(scale), f"{name}_s"),
              numpy_helper.from_array(np.int8(0), f"{name}_z")]
    nodes += [helper.make_node("QuantizeLinear", [tensor, f"{name}_s", f"{name}_z"], [f"{name}q"],
                               name=f"{name}_q"),
              helper.make_node("DequantizeLinear", [f"{name}q", f"{name}_s", f"{name}_z"], [f"{name}d"],
                               name=f"{name}_dq")]
    return f"{name}d"


def _weight(nodes, inits, rng, name, shape):
    """An int8 per-channel weight and its DQ; returns the DQ output ``<name>d``."""
    w = rng.standard_normal(shape).astype(np.float32) * 0.3
    scale = np.abs(w).reshape(shape[0], -1).max(axis=1) / 127
    q = np.clip(np.round(w / scale[:, None, None, None]), -127, 127).astype(np.int8)
    inits += [numpy_helper.from_array(q, f"{name}q"),
              numpy_helper.from_array(scale.astype(np.float32), f"{name}_s"),
              numpy_helper.from_array(np.zeros(shape[0], np.int8), f"{name}_z")]
    nodes.append(helper.make_node("DequantizeLinear", [f"{name}q", f"{name}_s", f"{name}_z"], [f"{name}d"],
                                  name=f"{name}_dq", axis=0))
    return f"{name}d"


def _conv_relu_qdq(nodes, inits, rng, source: str, prefix: str):
    """``source`` -> Q/DQ (``prefix``) -> Conv w1 -> ``c`` -> Relu -> ``r`` -> Q/DQ: ``(r's DQ output, a
    second weight w2's DQ output)`` for the Conv that follows."""
    sd = _qdq(nodes, inits, source, 0.02, prefix)
    w1 = _weight(nodes, inits, rng, "w1", [4, 4, 3, 3])
    nodes += [helper.make_node("Conv", [sd, w1], ["c"], pads=[1, 1, 1, 1], name="conv1"),
              helper.make_node("Relu", ["c"], ["r"], name="relu1")]
    return _qdq(nodes, inits, "r", 0.03, "r"), _weight(nodes, inits, rng, "w2", [4, 4, 3, 3])


def _branch(rng, stored_relu: bool, outer: str = "m") -> onnx.GraphProto:
    """Relu(md) -> Q/DQ -> Conv w1 -> Relu -> Q/DQ -> Conv w2 -> output; with ``stored_relu`` the inner Relu
    output ``r`` is also read by a Sigmoid (a float op), added to ``outer`` (the main graph's Conv output
    ``m`` by default). Both branches name their tensors alike."""
    nodes, inits = [], []
    nodes.append(helper.make_node("Relu", ["md"], ["h"], name="pre"))
    rd, w2 = _conv_relu_qdq(nodes, inits, rng, "h", "h")
    if not stored_relu:
        nodes.append(helper.make_node("Conv", [rd, w2], ["y_b"], pads=[1, 1, 1, 1], name="conv2"))
    else:
        nodes += [helper.make_node("Conv", [rd, w2], ["e"], pads=[1, 1, 1, 1], name="conv2"),
                  helper.make_node("Sigmoid", ["r"], ["s"], name="gate"),
                  helper.make_node("Add", ["s", outer], ["s2"], name="outer_add"),
                  helper.make_node("Add", ["e", "s2"], ["y_b"], name="join")]
    return helper.make_graph(nodes, "branch", [], [helper.make_tensor_value_info("y_b", F, [1, 4, 8, 8])],
                             inits)


def if_qdq_model(seed: int, outer: str = "m") -> onnx.ModelProto:
    """x -> Q/DQ -> Conv w0 (int8) -> m -> Q/DQ -> md -> If(cond): both branches quantize and run two INT8
    Convs of their own; the else branch also reads its Relu output ``r`` in a Sigmoid and ``outer`` in an
    Add."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    xd = _qdq(nodes, inits, "x", 0.02, "x")
    w0 = _weight(nodes, inits, rng, "w0", [4, 3, 3, 3])
    nodes.append(helper.make_node("Conv", [xd, w0], ["m"], pads=[1, 1, 1, 1], name="conv0"))
    _qdq(nodes, inits, "m", 0.05, "m")
    nodes.append(helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=_branch(rng, False),
                                  else_branch=_branch(rng, True, outer)))
    graph = helper.make_graph(nodes, "if_qdq", [helper.make_tensor_value_info("x", F, [1, 3, 8, 8]),
                                                helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", F, [1, 4, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


THEN, ELSE = "branch/then_branch/", "branch/else_branch/"


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_tensors_of_an_if_branch_are_found_under_their_branch(seed):
    """Inside each branch: the DQ outputs both Convs read, the first Conv's output and its fused Relu up
    to the QuantizeLinear (then branch only: the else branch's Sigmoid reads the Relu output, so it is
    stored); never a branch output, a tensor a float op reads, or ``m``, which the else branch reads."""
    fused = fused_tensors(if_qdq_model(seed))
    inner = {"hd", "w1d", "c", "rd", "w2d"}
    assert fused == {"xd", "w0d"} | {THEN + t for t in inner | {"r"}} | {ELSE + t for t in inner}
    # read from the main graph by the else branch: stored, although its only reader there is a Q
    assert "m" not in fused and "md" not in fused
    # the else branch adding its own Sigmoid output instead: m is fused, its Q the only reader
    assert fused_tensors(if_qdq_model(seed, outer="s")) == fused | {"m"}


def test_fused_tensors_in_a_loop_body_see_its_carried_state_as_stored():
    """A Loop body of Q/DQ -> Conv -> Relu -> Q/DQ -> Conv: the Relu output is fused, the carried state
    (the body's output) is not."""
    rng = np.random.default_rng(3)
    nodes, inits = [helper.make_node("Identity", ["go"], ["go_out"], name="keep")], []
    rd, w2 = _conv_relu_qdq(nodes, inits, rng, "v_in", "v")
    nodes.append(helper.make_node("Conv", [rd, w2], ["v_out"], pads=[1, 1, 1, 1], name="conv2"))
    vi = [helper.make_tensor_value_info(n, t, s) for n, t, s in
          (("i", TensorProto.INT64, []), ("go", TensorProto.BOOL, []), ("v_in", F, [1, 4, 8, 8]))]
    outs = [helper.make_tensor_value_info("go_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", F, [1, 4, 8, 8])]
    body = helper.make_graph(nodes, "body", vi, outs, inits)
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], body=body, name="loop")], "loop_qdq",
        [helper.make_tensor_value_info("x", F, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", F, [1, 4, 8, 8])],
        [numpy_helper.from_array(np.int64(2), "n")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    assert fused_tensors(model) == {"loop/body/" + t for t in ("vd", "w1d", "c", "r", "rd", "w2d")}


def _rounded(model) -> dict:
    """``"main"``, ``"then_branch"``, ``"else_branch"`` -> the tensors an emulation of an `if_qdq_model`
    rounds there (each ``t`` made as ``Cast(Cast(exact, to=FLOAT16), to=FLOAT)``)."""
    graphs = {"main": model.graph}
    graphs.update((a.name, a.g) for a in model.graph.node[-1].attribute)
    found = {}
    for key, g in graphs.items():
        to_low = {n.output[0] for n in g.node
                  if n.op_type == "Cast" and n.attribute[0].i == TensorProto.FLOAT16}
        found[key] = {n.output[0] for n in g.node if n.op_type == "Cast" and n.input[0] in to_low}
    return found


@pytest.mark.parametrize("seed", [0, 1])
def test_emulation_leaves_the_fused_tensors_of_each_branch_unrounded(seed):
    """FP16 float parts of the model: the emulation rounds, in each branch, every FP16 tensor but the
    branch's fused ones (``r`` rounded in the else branch only, where the Sigmoid reads it), one Cast pair
    less per fused tensor than the strict emulation; its outputs are no farther from the FP32 Q/DQ model's
    (measured: equal in three of the four cases, 0.0895 against 0.0934 max abs in the fourth)."""
    fp16 = cast_float_parts(if_qdq_model(seed), "fp16").model
    fused = fused_tensors(fp16)
    assert {t for t in fused if t.startswith(THEN)} and {t for t in fused if t.startswith(ELSE)}
    loose, strict = emulate_in_fp32(fp16), emulate_in_fp32(fp16, fusions=False)
    casts = [sum(n.op_type == "Cast" for g in all_graphs(m) for n in g.node) for m in (loose, strict)]
    assert casts[1] - casts[0] == 2 * len(fused)
    rounded, every = _rounded(loose), _rounded(strict)
    assert "r" in rounded["else_branch"] and "r" in every["then_branch"] and "r" not in rounded["then_branch"]
    for branch in ("then_branch", "else_branch"):
        prefix = f"branch/{branch}/"
        assert rounded[branch] == every[branch] - {t[len(prefix):] for t in fused if t.startswith(prefix)}
        assert "c" in every[branch] and "c" not in rounded[branch] and "h" in rounded[branch]
    assert "m/fp16" in rounded["main"]  # read by the else branch: stored
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    for cond in (True, False):
        feed = {"x": x, "cond": np.array(cond)}
        ref, got_loose, got_strict = (
            ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
            for m in (if_qdq_model(seed), loose, strict))
        assert np.abs(got_loose - ref).max() <= np.abs(got_strict - ref).max() < 0.05 * np.abs(ref).max()



def _read_in_branch(tensors, moved: bool = False) -> onnx.ModelProto:
    """x -> Q/DQ -> Conv w0 (int8) -> c -> Relu -> r -> Q/DQ -> Conv w1 -> y, a second Q/DQ of x -> vd that
    no main-graph node but (with ``moved``) a Flatten -> vf reads, and an If whose then branch returns
    the total of Sigmoid of the sum of the main-graph ``tensors`` (the else branch returns a constant)."""
    rng = np.random.default_rng(5)
    nodes, inits = [], []
    xd = _qdq(nodes, inits, "x", 0.02, "x")
    w0 = _weight(nodes, inits, rng, "w0", [4, 3, 3, 3])
    nodes += [helper.make_node("Conv", [xd, w0], ["c"], pads=[1, 1, 1, 1], name="conv0"),
              helper.make_node("Relu", ["c"], ["r"], name="relu0")]
    rd = _qdq(nodes, inits, "r", 0.03, "r")
    w1 = _weight(nodes, inits, rng, "w1", [4, 4, 3, 3])
    nodes.append(helper.make_node("Conv", [rd, w1], ["y"], pads=[1, 1, 1, 1], name="conv1"))
    _qdq(nodes, inits, "x", 0.05, "v")
    if moved:
        nodes.append(helper.make_node("Flatten", ["vd"], ["vf"], name="move"))
    inits.append(numpy_helper.from_array(np.float32(0), "b0"))
    then_nodes = [helper.make_node("Sum", list(tensors), ["t"], name="sum"),
                  helper.make_node("Sigmoid", ["t"], ["g"], name="gate"),
                  helper.make_node("ReduceSum", ["g"], ["b"], keepdims=0, name="total")]
    out = [helper.make_tensor_value_info("b", F, [])]
    then_branch = helper.make_graph(then_nodes, "then", [], out)
    else_branch = helper.make_graph([helper.make_node("Identity", ["b0"], ["b"], name="keep")], "else", [],
                                    out)
    nodes.append(helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=then_branch,
                                  else_branch=else_branch))
    graph = helper.make_graph(nodes, "read_in_branch",
                              [helper.make_tensor_value_info("x", F, [1, 3, 8, 8]),
                               helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                              [helper.make_tensor_value_info("y", F, [1, 4, 8, 8]),
                               helper.make_tensor_value_info("z", F, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _map(model):
    return {e.node: (e.precision, e.reason) for e in check(model).precision_map.nodes}


def test_a_relu_is_not_fused_into_a_conv_whose_output_a_branch_reads():
    """The Conv output ``c`` a branch reads is stored for it, as a graph output is: the Relu reading it runs
    in FP32 in the map and ``c`` is in no fused kernel; when the branch reads the Relu output ``r``
    instead, the Relu stays fused (the kernel writes ``r``) and ``c`` is fused again, ``r`` still not."""
    read_c, read_r = _read_in_branch(["c"]), _read_in_branch(["r"])
    assert _map(read_c)["relu0"] == ("fp32", "float inputs")
    assert _map(read_r)["relu0"] == ("int8", "fused into 'conv0'")
    for model in (read_c, read_r):
        assert _map(model)["conv0"][0] == _map(model)["conv1"][0] == "int8"
        assert _map(model)["branch/then_branch/gate"][0] == "fp32"
    assert fused_tensors(read_c) == {"xd", "w0d", "rd", "w1d"}
    assert fused_tensors(read_r) == {"xd", "w0d", "rd", "w1d", "c"}


@pytest.mark.parametrize("moved", [False, True])
def test_a_dequantize_read_only_by_a_branch_is_left_standalone_by_u2(moved):
    """``vd`` is read only by the branch (directly, or through a Flatten that runs on the quantized data):
    its DequantizeLinear runs as its own layer for it, rule U2, and ``vd`` is in no fused kernel; the
    DequantizeLinear the INT8 Convs read are not reported (the two QuantizeLinear of the graph input are,
    by U1); the check finds nothing."""
    model = _read_in_branch(["vf" if moved else "vd"], moved)
    report = check(model)
    u1, u2 = [u for u in report.precision_map.unfused if u.rule == "U1"], \
        [u for u in report.precision_map.unfused if u.rule != "U1"]
    assert [u.node for u in u1] == ["x_q", "v_q"]  # quantizing the graph input x
    (u2,) = u2
    assert (u2.node, u2.op_type, u2.rule) == ("v_dq", "DequantizeLinear", "U2")
    assert u2.reason == f"output {'vf' if moved else 'vd'!r} is read by a nested If/Loop/Scan body " \
                        "(dequantized for it)"
    assert "Q/DQ left unfused: 2 by U1, 1 by U2" in report.precision_map.summary()
    assert "vd" not in fused_tensors(model) and {"xd", "rd", "c"} <= fused_tensors(model)
    if moved:
        assert _map(model)["move"][0] == "int8"
    assert len(report.errors) == len(report.warnings) == 0, report.summary()
