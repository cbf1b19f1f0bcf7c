"""FP16 float parts inside If branches and Loop bodies: weights, Constant nodes and tensors there take
FP16, a tensor of the enclosing graph read inside is rounded once where it is made (its low version read
by every low slot of every body; an initializer all of whose readers are low stored once in FP16), each
body keeps the types of its inputs and outputs (an If's two branches and its outputs, a Loop's carried
state in and out), the If/Loop node itself is never listed as kept FP32 (it has no arithmetic), and the
result runs in onnxruntime and passes ``check`` with no finding."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_qat
from onnx_qat.formats.numeric import kept_fp32_reason
from onnx_qat.formats.float_cast import all_graphs
from onnx_qat.formats.float_parts import cast_float_parts, emulate_in_fp32, kept_fp32_nodes

F = TensorProto.FLOAT


def _init(rng, name, shape, scale=0.3):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def if_model(seed: int) -> onnx.ModelProto:
    """x -> Conv -> Relu (outer) -> If(cond): then MatMul(Conv(body weight)) + outer bias, else Conv(body
    weight) * a Constant node; both branches read the outer tensor ``h`` and the outer initializer."""
    rng = np.random.default_rng(seed)
    then_g = helper.make_graph(
        [helper.make_node("Conv", ["h", "w_then"], ["t1"], pads=[1, 1, 1, 1], name="then_conv"),
         helper.make_node("MatMul", ["t1", "w_mm"], ["t2"], name="then_matmul"),
         helper.make_node("Add", ["t2", "bias_outer"], ["y_then"], name="then_add")],
        "then", [], [helper.make_tensor_value_info("y_then", F, [1, 4, 8, 8])],
        [_init(rng, "w_then", [4, 4, 3, 3]), _init(rng, "w_mm", [8, 8])])
    else_g = helper.make_graph(
        [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.float32(0.5))),
         helper.make_node("Conv", ["h", "w_else"], ["e1"], pads=[1, 1, 1, 1], name="else_conv"),
         helper.make_node("Mul", ["e1", "k"], ["e2"], name="else_mul"),
         helper.make_node("Add", ["e2", "bias_outer"], ["y_else"], name="else_add")],
        "else", [], [helper.make_tensor_value_info("y_else", F, [1, 4, 8, 8])],
        [_init(rng, "w_else", [4, 4, 3, 3])])
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], name="conv0"),
         helper.make_node("Relu", ["c0"], ["h"], name="relu0"),
         helper.make_node("If", ["cond"], ["y_if"], then_branch=then_g, else_branch=else_g, name="branch"),
         helper.make_node("Sigmoid", ["y_if"], ["y"], name="out")],
        "if_model",
        [helper.make_tensor_value_info("x", F, [1, 3, 8, 8]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", F, [1, 4, 8, 8])],
        [_init(rng, "w0", [4, 3, 3, 3]), _init(rng, "bias_outer", [1, 4, 1, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def loop_model(seed: int) -> onnx.ModelProto:
    """x -> MatMul (outer) -> Loop(3): v <- Tanh(MatMul(v, body weight) + outer bias), each iteration's v
    also a scan output."""
    rng = np.random.default_rng(seed)
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("MatMul", ["v_in", "w_body"], ["m"], name="body_matmul"),
         helper.make_node("Add", ["m", "b_outer"], ["a"], name="body_add"),
         helper.make_node("Tanh", ["a"], ["v_out"], name="body_tanh"),
         helper.make_node("Identity", ["v_out"], ["scan"], name="body_scan")],
        "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", F, [2, 16])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", F, [2, 16]),
         helper.make_tensor_value_info("scan", F, [2, 16])],
        [_init(rng, "w_body", [16, 16])])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w0"], ["v0"], name="matmul0"),
         helper.make_node("Loop", ["trips", "keep_going", "v0"], ["v_last", "v_all"], body=body,
                          name="loop")],
        "loop_model", [helper.make_tensor_value_info("x", F, [2, 8])],
        [helper.make_tensor_value_info("v_last", F, [2, 16]),
         helper.make_tensor_value_info("v_all", F, [3, 2, 16])],
        [_init(rng, "w0", [8, 16]), _init(rng, "b_outer", [16], 0.1),
         numpy_helper.from_array(np.array(3, np.int64), "trips"),
         numpy_helper.from_array(np.array(True), "keep_going")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def run(model, feed):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def body_floats(model):
    """Element types of the float initializers and Constant values inside bodies."""
    found = []
    for g in all_graphs(model)[1:]:
        found += [t.data_type for t in g.initializer if t.data_type in (F, TensorProto.FLOAT16)]
        found += [a.t.data_type for n in g.node if n.op_type == "Constant" for a in n.attribute
                  if a.name == "value" and a.t.data_type in (F, TensorProto.FLOAT16)]
    return found


def assert_clean(model):
    """``check`` finds nothing but C13 (a float model: "not quantized", said of the FP32 model too)."""
    report = onnx_qat.check(model)
    found = [str(f) for f in list(report.errors) + list(report.warnings) if f.rule != "C13"]
    assert not found, found


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale", [1.0, 20.0])
def test_if_branches_are_converted_and_run(seed, scale):
    model = if_model(seed)
    result = cast_float_parts(model, "fp16")
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    assert body_floats(out) and set(body_floats(out)) == {TensorProto.FLOAT16}
    # the outer initializer both branches read in FP16 is stored once, in FP16; the outer tensor h both
    # branches' Convs read is Relu's FP16 output itself: no Cast of either inside the branches
    outer = {t.name: t.data_type for t in out.graph.initializer}
    assert outer == {"w0": TensorProto.FLOAT16, "bias_outer/fp16": TensorProto.FLOAT16}
    branches = all_graphs(out)[1:]
    assert {i for g in branches for n in g.node for i in n.input} >= {"h/fp16", "bias_outer/fp16"}
    assert not {"h", "bias_outer"} & {i for g in all_graphs(out) for n in g.node for i in n.input}
    assert result.kept == ()  # the If has no arithmetic of its own
    assert result.summary["low_initializers"] == 5  # w0, bias_outer and the three branch weights
    # the If's output is FP16, its branches returning their FP16 sums (no Cast to FP32 and back): the
    # only Casts are x in and y out
    casts = [(n.input[0], n.output[0]) for g in all_graphs(out) for n in g.node if n.op_type == "Cast"]
    assert result.summary["casts"] == len(casts) == 2 and {c[0] for c in casts} == {"x", "y/fp16"}, casts
    assert [o.type.tensor_type.elem_type for g in branches for o in g.output] == [TensorProto.FLOAT16] * 2
    sigmoid = next(n for n in out.graph.node if n.name == "out")
    assert list(sigmoid.input) == ["y_if"]
    rng = np.random.default_rng(10 + seed)
    x = (rng.standard_normal((1, 3, 8, 8)) * scale).astype(np.float32)
    for cond in (True, False):
        feed = {"x": x, "cond": np.array(cond)}
        (ref,), (got,), (emu,) = run(model, feed), run(out, feed), run(emulate_in_fp32(out), feed)
        assert got.dtype == np.float32
        # sigmoid outputs of logits up to ~100 (scale 20), each rounded to FP16 (2^-11 relative) on the way
        for value in (got, emu):
            np.testing.assert_allclose(value, ref, atol=1e-2, rtol=0)
            assert np.abs(value - ref).mean() < 1e-3
        assert np.abs(got - ref).max() > 0  # the branches did compute in FP16
    # the emulation holds the branch weights as FP32 values and rounds the branch tensors to FP16
    emulated = emulate_in_fp32(out)
    assert set(body_floats(emulated)) == {F}
    assert sum(n.op_type == "Cast" for g in all_graphs(emulated)[1:] for n in g.node) >= 4
    assert_clean(out)


def test_if_branch_nodes_are_kept_by_their_qualified_names():
    result = cast_float_parts(if_model(0), "fp16", exclude_nodes=["branch/else_branch/else_conv"])
    kept = {k.node: k.rule for k in result.kept}
    assert kept == {"branch/else_branch/else_conv": "excluded"}
    assert kept_fp32_nodes(result.model).keys() == kept.keys()
    else_branch = next(a.g for n in result.model.graph.node if n.op_type == "If" for a in n.attribute
                       if a.name == "else_branch")
    conv = next(n for n in else_branch.node if n.name == "else_conv")
    weight = next(t for t in else_branch.initializer if t.name == conv.input[1])
    assert weight.data_type == F  # the kept Conv reads its weight in FP32
    report = onnx_qat.check(result.model)
    assert not report.errors
    # its only warning names the kept FP32 Conv, with the reason
    assert all("else_conv" in str(w) for w in report.warnings if w.rule != "C13"), \
        [str(w) for w in report.warnings]


@pytest.mark.parametrize("seed", [0, 3])
def test_loop_carried_state_keeps_one_type_and_runs(seed):
    model = loop_model(seed)
    result = cast_float_parts(model, "fp16")
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    assert set(body_floats(out)) == {TensorProto.FLOAT16}
    loop = next(n for n in out.graph.node if n.op_type == "Loop")
    body = loop.attribute[0].g
    types = {v.name: v.type.tensor_type.elem_type for v in list(body.input) + list(body.output)}
    assert types["v_in"] == types["v_out"] == F and types["scan"] == F  # carried in and out alike
    x = np.random.default_rng(seed).standard_normal((2, 8)).astype(np.float32)
    ref, got = run(model, {"x": x}), run(out, {"x": x})
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, atol=5e-3, rtol=0)
    assert_clean(out)


@pytest.mark.parametrize("kind", ["if", "loop"])
def test_quantized_model_with_fp16_float_parts_in_its_bodies_passes_check(kind, tmp_path):
    """quantize places Q/DQ inside the bodies; float_dtype="fp16" then converts what is float there."""
    model = if_model(0) if kind == "if" else loop_model(0)
    path = tmp_path / f"{kind}.onnx"
    onnx.save(model, path)
    rng = np.random.default_rng(5)
    data = {"x": rng.standard_normal((16, 3, 8, 8) if kind == "if" else (16, 2, 8)).astype(np.float32)}
    if kind == "if":
        data["cond"] = np.array(True)
    np.savez(tmp_path / "calib.npz", **data)
    q32 = onnx_qat.quantize(str(path), data=str(tmp_path / "calib.npz"), progress=False)
    q = onnx_qat.quantize(str(path), data=str(tmp_path / "calib.npz"), float_dtype="fp16", progress=False)
    assert sum(n.op_type == "QuantizeLinear" for g in all_graphs(q.model)[1:] for n in g.node) >= 1
    # the body's QuantizeLinear of the outer input reads it in FP32, with an FP32 scale (rule boundary);
    # every other float constant of the bodies is FP16
    assert {k.rule for k in q.float_parts.kept} == {"boundary"}  # not the If/Loop node
    boundary = {n.input[1] for g in all_graphs(q.model)[1:] for n in g.node
                if n.op_type == "QuantizeLinear" and kept_fp32_reason(n) is not None}
    assert boundary
    rest = [t.data_type for g in all_graphs(q.model)[1:] for t in g.initializer
            if t.data_type in (F, TensorProto.FLOAT16) and t.name not in boundary]
    assert rest and set(rest) == {TensorProto.FLOAT16}
    report = onnx_qat.check(q.model)
    assert not report.errors and not report.warnings, [str(f) for f in report.findings]
    counts = report.precision_map.counts()
    assert counts.get("int8", 0) >= 3 and counts.get("fp16", 0) >= 1, counts
    x = rng.standard_normal(data["x"].shape).astype(np.float32)[:4]  # held out
    feeds = [{"x": x[i:i + 1] if kind == "if" else x[i], **({"cond": np.array(True)} if kind == "if" else {})}
             for i in range(4)]
    ref, got32, got = (np.concatenate([np.ravel(v) for f in feeds for v in run(m, f)])
                       for m in (model, q32.model, q.model))

    def cosine(a, b):
        return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))

    assert cosine(ref, got) > 0.99 and abs(cosine(ref, got32) - cosine(ref, got)) <= 0.002


def test_unnamed_body_nodes_get_names_and_the_given_model_is_untouched():
    model = if_model(2)
    branch = next(n for n in model.graph.node if n.op_type == "If")
    else_g = next(a.g for a in branch.attribute if a.name == "else_branch")
    conv = next(n for n in else_g.node if n.op_type == "Conv")
    conv.name = ""
    before = model.SerializeToString()
    result = cast_float_parts(model, "fp16", exclude_nodes=["branch/else_branch/Conv_.*"])
    assert model.SerializeToString() == before
    kept = {k.node: k.rule for k in result.kept if k.rule == "excluded"}
    assert len(kept) == 1 and next(iter(kept)).startswith("branch/else_branch/Conv_")
    report = onnx_qat.check(result.model)
    assert [w.node for w in report.warnings if w.rule != "C13"] == list(kept)


def nested_if_model(seed: int) -> onnx.ModelProto:
    """As silero-vad's LSTM: an outer If whose then branch holds a Constant node ``W`` and computes ``a``;
    an inner If there whose two branches both read ``W`` and ``a`` (and the main graph's initializer
    ``b_main``) in a MatMul."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((8, 8)) * 0.4).astype(np.float32)
    w = helper.make_node("Constant", [], ["W"], name="W_const", value=numpy_helper.from_array(weight))
    inner_then = helper.make_graph(
        [helper.make_node("MatMul", ["a", "W"], ["p"], name="in_then_mm"),
         helper.make_node("Add", ["p", "b_main"], ["y_in_then"], name="in_then_add")],
        "inner_then", [], [helper.make_tensor_value_info("y_in_then", F, [1, 8])])
    inner_else = helper.make_graph(
        [helper.make_node("MatMul", ["a", "W"], ["q"], name="in_else_mm"),
         helper.make_node("Tanh", ["q"], ["y_in_else"], name="in_else_tanh")],
        "inner_else", [], [helper.make_tensor_value_info("y_in_else", F, [1, 8])])
    outer_then = helper.make_graph(
        [w, helper.make_node("MatMul", ["x", "W"], ["m"], name="out_then_mm"),
         helper.make_node("Relu", ["m"], ["a"], name="out_then_relu"),
         helper.make_node("If", ["cond2"], ["y_inner"], then_branch=inner_then, else_branch=inner_else,
                          name="inner")],
        "outer_then", [], [helper.make_tensor_value_info("y_inner", F, [1, 8])])
    outer_else = helper.make_graph(
        [helper.make_node("Mul", ["x", "b_main"], ["y_else"], name="out_else_mul")],
        "outer_else", [], [helper.make_tensor_value_info("y_else", F, [1, 8])])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond1"], ["y_if"], then_branch=outer_then, else_branch=outer_else,
                          name="outer"),
         helper.make_node("Sigmoid", ["y_if"], ["y"], name="out")],
        "nested_if",
        [helper.make_tensor_value_info("x", F, [1, 8]),
         helper.make_tensor_value_info("cond1", TensorProto.BOOL, []),
         helper.make_tensor_value_info("cond2", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", F, [1, 8])], [_init(rng, "b_main", [1, 8], 0.5)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _recast_in_each_body(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` where every body reads each FP16 tensor of an enclosing graph through a Cast
    to FP32 and back, made inside that body: what each body read before such tensors were shared
    (the FP32 copy of the tensor, cast again in every body that reads it)."""
    from onnx_qat.formats.float_cast import tensor_types

    out = onnx.ModelProto()
    out.CopyFrom(model)
    types = tensor_types(out)
    for g in all_graphs(out)[1:]:
        own = {t for n in g.node for t in n.output} | {t.name for t in g.initializer}
        outer = sorted({t for n in g.node for t in n.input if t and t not in own
                        and types.get(t) == TensorProto.FLOAT16})
        casts = []
        for t in outer:
            casts += [helper.make_node("Cast", [t], [f"{t}/again32"], to=F),
                      helper.make_node("Cast", [f"{t}/again32"], [f"{t}/again16"], to=TensorProto.FLOAT16)]
        for n in g.node:
            n.input[:] = [f"{t}/again16" if t in outer else t for t in n.input]
        nodes = casts + list(g.node)
        del g.node[:]
        g.node.extend(nodes)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_constant_read_across_nested_if_bodies_is_stored_once_in_fp16_and_never_cast(seed):
    model = nested_if_model(seed)
    result = cast_float_parts(model, "fp16")
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    assert result.kept == ()
    graphs = all_graphs(out)
    const = next(n for g in graphs for n in g.node if n.name == "W_const")
    assert const.attribute[0].t.data_type == TensorProto.FLOAT16
    w16 = const.output[0]
    readers = [n for g in graphs for n in g.node if w16 in n.input]
    assert sorted(n.name for n in readers) == ["in_else_mm", "in_then_mm", "out_then_mm"]
    casts = [n for g in graphs for n in g.node if n.op_type == "Cast"]
    # no Cast of W, a or b_main anywhere: each is rounded once where it is made (b_main stored in FP16)
    assert not [n for n in casts if n.input[0].split("/")[0] in ("W", "a", "b_main")], \
        [(n.input[0], n.output[0]) for n in casts]
    assert {t.name: t.data_type for t in out.graph.initializer} == {"b_main/fp16": TensorProto.FLOAT16}
    # x in each outer branch (2) and y back to FP32 (1): the inner and the outer If's outputs are FP16
    # together (7 before: the three computing branches' outputs to FP32, the outer If's output to FP16)
    assert len(casts) == result.summary["casts"] == 3
    before = _recast_in_each_body(out)
    assert sum(n.op_type == "Cast" for g in all_graphs(before) for n in g.node) > len(casts)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    rng = np.random.default_rng(100 + seed)
    for cond1 in (True, False):
        for cond2 in (True, False):
            feed = {"x": rng.standard_normal((1, 8)).astype(np.float32) * 3, "cond1": np.array(cond1),
                    "cond2": np.array(cond2)}
            got, again, ref = (ort.InferenceSession(m.SerializeToString(), options,
                                                    providers=["CPUExecutionProvider"]).run(None, feed)[0]
                               for m in (out, before, model))
            np.testing.assert_array_equal(got, again)  # the numbers of a Cast in each body, bit for bit
            np.testing.assert_allclose(got, ref, atol=5e-3, rtol=0)
    assert_clean(out)


def _fp32_if_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` where every FP16 If output is FP32 again: each branch casts what it returns to
    FP32 (an inner If's output, FP32 again itself, returned as it is) and a Cast to FP16 after the If
    feeds its readers, unless its graph returns it (an enclosing If's branch). The form before nested If
    outputs took FP16 together."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graphs = all_graphs(out)
    after: dict = {}  # If output -> its FP32 name
    for g in graphs:
        returned = {o.name for o in g.output}
        for node in g.node:
            if node.op_type != "If":
                continue
            branches = [a.g for a in node.attribute if a.name in ("then_branch", "else_branch")]
            for k, name in enumerate(node.output):
                if branches[0].output[k].type.tensor_type.elem_type != TensorProto.FLOAT16:
                    continue
                for b in branches:
                    end = b.output[k]
                    if not any(n.op_type == "If" and end.name in n.output for n in b.node):
                        b.node.append(helper.make_node("Cast", [end.name], [f"{end.name}/to32"], to=F))
                        end.name = f"{end.name}/to32"
                    end.type.tensor_type.elem_type = F
                if name not in returned:
                    after[name] = f"{name}/as32"
                    node.output[k] = after[name]
    for g in reversed(graphs):  # innermost first: rebuilding a node list copies the bodies its nodes hold
        nodes = []
        for n in g.node:
            nodes.append(n)
            nodes += [helper.make_node("Cast", [t], [o], to=TensorProto.FLOAT16)
                      for o, t in after.items() if t in n.output]
        del g.node[:]
        g.node.extend(nodes)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nested_if_outputs_take_fp16_together_with_the_numbers_of_fp32_if_outputs(seed):
    """The inner If's output is what the outer If's then branch returns: both outputs FP16 together, no
    Cast on either side. As TensorRT stores the numbers (`emulate_in_fp32`) the outputs are bit for bit
    those of the FP32 If outputs with their Casts. onnxruntime's own FP16 session differs slightly: with
    the Casts it computes a branch's last ops (Add, Tanh: no FP16 CPU kernel) in FP32 and drops the pair
    of Casts to FP16 and back (``InsertCastTransformer``), so the FP16 rounding of the branch's result the
    model asks for is skipped there; without them that rounding is made."""
    model = nested_if_model(seed)
    result = cast_float_parts(model, "fp16")
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    graphs = all_graphs(out)
    assert {o.name: o.type.tensor_type.elem_type for g in graphs[1:] for o in g.output} == {
        "y_in_then/fp16": TensorProto.FLOAT16, "y_in_else/fp16": TensorProto.FLOAT16,
        "y_inner": TensorProto.FLOAT16, "y_else/fp16": TensorProto.FLOAT16}
    sigmoid = next(n for n in graphs[0].node if n.name == "out")
    assert sigmoid.input[0] == "y_if"  # the outer If's output itself, no Cast
    casts = sorted(n.input[0] for g in graphs for n in g.node if n.op_type == "Cast")
    assert casts == ["x", "x", "y/fp16"] and result.summary["casts"] == 3
    before = _fp32_if_outputs(out)
    onnx.checker.check_model(before, full_check=True)
    assert sum(n.op_type == "Cast" for g in all_graphs(before) for n in g.node) == 7
    forms = (emulate_in_fp32(out, "fp16"), emulate_in_fp32(before, "fp16"), out, before, model)
    rng = np.random.default_rng(200 + seed)
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        sessions = [ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                    for m in forms]
        for cond1 in (True, False):
            for cond2 in (True, False):
                feed = {"x": rng.standard_normal((1, 8)).astype(np.float32) * 3, "cond1": np.array(cond1),
                        "cond2": np.array(cond2)}
                got, again, direct, direct_before, ref = (s.run(None, feed)[0] for s in sessions)
                np.testing.assert_array_equal(got, again)
                np.testing.assert_allclose(direct, direct_before, atol=1e-4, rtol=0)
                np.testing.assert_allclose(got, ref, atol=5e-3, rtol=0)
    assert_clean(out)


@pytest.mark.parametrize("seed", [0, 1])
def test_nested_if_outputs_an_fp32_node_reads_keep_fp32_together(seed):
    """The outer If's reader kept FP32: its output stays FP32, and so does the inner If's output that its
    then branch returns; each computing branch casts its FP16 result."""
    result = cast_float_parts(nested_if_model(seed), "fp16", exclude_nodes=["out"])
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    graphs = all_graphs(out)
    assert [o.type.tensor_type.elem_type for g in graphs[1:] for o in g.output] == [F, F, F, F]
    casts = sorted(n.input[0] for g in graphs for n in g.node if n.op_type == "Cast")
    assert casts == ["x", "x", "y_else/fp16", "y_in_else/fp16", "y_in_then/fp16"]
    assert result.summary["casts"] == 5
    rng = np.random.default_rng(30 + seed)
    for cond1 in (True, False):
        for cond2 in (True, False):
            feed = {"x": rng.standard_normal((1, 8)).astype(np.float32) * 3, "cond1": np.array(cond1),
                    "cond2": np.array(cond2)}
            (ref,), (got,) = run(nested_if_model(seed), feed), run(out, feed)
            np.testing.assert_allclose(got, ref, atol=5e-3, rtol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_an_if_output_an_fp32_node_reads_keeps_fp32(seed):
    """The If's reader kept FP32 (excluded): the branches return FP32, each casting its FP16 sum."""
    model = if_model(seed)
    result = cast_float_parts(model, "fp16", exclude_nodes=["out"])
    out = result.model
    onnx.checker.check_model(out, full_check=True)
    branches = all_graphs(out)[1:]
    assert [o.type.tensor_type.elem_type for g in branches for o in g.output] == [F, F]
    casts = sorted(n.input[0] for g in all_graphs(out) for n in g.node if n.op_type == "Cast")
    assert casts == ["x", "y_else/fp16", "y_then/fp16"] and result.summary["casts"] == 3
    rng = np.random.default_rng(20 + seed)
    for cond in (True, False):
        feed = {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32), "cond": np.array(cond)}
        (ref,), (got,) = run(model, feed), run(out, feed)
        np.testing.assert_allclose(got, ref, atol=2e-3, rtol=0)


def _quantized_with_data(kind: str, tmp_path):
    """The float model, its INT8 Q/DQ form (Q/DQ inside the bodies too) and held-out feeds."""
    model = if_model(0) if kind == "if" else loop_model(0)
    rng = np.random.default_rng(5)
    shape = (16, 3, 8, 8) if kind == "if" else (16, 2, 8)
    data = {"x": rng.standard_normal(shape).astype(np.float32)}
    if kind == "if":
        data["cond"] = np.array(True)
    np.savez(tmp_path / "calib.npz", **data)
    q32 = onnx_qat.quantize(model, data=str(tmp_path / "calib.npz"), progress=False).model
    x = rng.standard_normal(shape).astype(np.float32)[:4]  # held out
    feeds = [{"x": x[i:i + 1] if kind == "if" else x[i], **({"cond": np.array(True)} if kind == "if" else {})}
             for i in range(4)]
    return model, q32, feeds


def _outputs(model, feeds) -> np.ndarray:
    return np.concatenate([np.ravel(v) for f in feeds for v in run(model, f)]).astype(np.float64)


def _cosine(a, b) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.parametrize("kind", ["if", "loop"])
def test_jittered_runs_at_the_bf16_opset_with_quantize_inputs_in_bodies(kind, tmp_path):
    """BF16 float parts raise the opset to 22, where onnxruntime 1.31 has no RandomUniformLike kernel
    (ONNX versioned its random operators again at 22): the jittered model, QuantizeLinear nodes in the
    If/Loop bodies included, still loads and runs, each QuantizeLinear input moved by at most half a
    BF16 step, the same for the same seed and not for another."""
    from onnx_qat.formats.float_parts import BF16_OPSET, jittered

    _, q32, feeds = _quantized_with_data(kind, tmp_path)
    q22 = onnx.version_converter.convert_version(q32, BF16_OPSET)
    assert sum(n.op_type == "QuantizeLinear" for g in all_graphs(q22)[1:] for n in g.node) >= 1
    size = 2.0**-9  # half of BF16's eps 2^-8
    moved = jittered(q22, size, seed=1)
    assert not [n for g in all_graphs(moved) for n in g.node if n.op_type.startswith("Random")]
    onnx.checker.check_model(moved, full_check=True)
    exact, first, again = _outputs(q22, feeds), _outputs(moved, feeds), _outputs(moved, feeds)
    np.testing.assert_array_equal(first, again)
    other = _outputs(jittered(q22, size, seed=2), feeds)
    assert not np.array_equal(first, other) and not np.array_equal(first, exact)
    # a move within half a step crosses a few INT8 rounding boundaries, no more
    assert 0.999 < _cosine(first, exact) < 1.0 and 0.999 < _cosine(other, exact)
    # each QuantizeLinear input itself (main graph), exposed: x * (1 + u), |u| <= size, spread over ± size
    pairs = list(zip(*[[n.input[0] for n in m.graph.node if n.op_type == "QuantizeLinear"]
                       for m in (q22, moved)]))
    assert pairs and all(m.endswith("/jittered") for _, m in pairs)
    before = run(_with_outputs(q22, [t for t, _ in pairs]), feeds[0])[-len(pairs):]
    after = run(_with_outputs(moved, [m for _, m in pairs]), feeds[0])[-len(pairs):]
    ratios = np.concatenate([(b.astype(np.float64) / a)[a != 0].ravel() for a, b in zip(before, after)]) - 1
    assert np.abs(ratios).max() <= size * (1 + 1e-5) and ratios.min() < -size / 2 < size / 2 < ratios.max()
    assert abs(ratios.mean()) < size / 4


def _with_outputs(model, names, dtype=F):
    """A copy of ``model`` that also outputs the main-graph tensors ``names`` (of type ``dtype``)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.output.extend(helper.make_tensor_value_info(t, dtype, None) for t in names)
    return out


def test_bf16_float_parts_measured_against_the_rounding_noise_track_the_fp32_float_parts(tmp_path):
    """BF16 float parts of a Q/DQ model with Q/DQ inside If branches, measured on data: its drop (the
    Loop model's BF16 form shows none, so nothing to set against the noise) is set against the model's
    own BF16 rounding noise (``max_cosine_drop`` 0), which runs at opset 22;
    the result's outputs against the float model's stay within 0.002 of the FP32 float parts' cosine
    (the budget the search keeps by default: BF16 rounds each value by at most 2^-9, relative, and
    these few layers do not amplify that past it)."""
    model, q32, feeds = _quantized_with_data("if", tmp_path)
    result = cast_float_parts(q32, "bf16", data=str(tmp_path / "calib.npz"), reference=model,
                              max_cosine_drop=0.0)
    noise = result.measurement["rounding_noise"]
    assert set(noise) == {o.name for o in model.graph.output}
    assert all(np.isfinite(v) and 0 <= v < 0.01 for v in noise.values()), noise
    bodies = all_graphs(result.model)[1:]
    assert any(t.data_type == TensorProto.BFLOAT16 for g in bodies for t in g.initializer)
    ref, got32 = _outputs(model, feeds), _outputs(q32, feeds)
    got = _outputs(emulate_in_fp32(result.model), feeds)  # BF16 storage, FP32 arithmetic
    assert abs(_cosine(ref, got32) - _cosine(ref, got)) <= 0.002, (_cosine(ref, got32), _cosine(ref, got))


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_jittered_at_opset_22_keeps_non_finite_values_and_moves_fp16_inputs_through_fp32(dtype):
    """The hash `jittered` uses from opset 22 takes the log of |x|: zeros stay zero, infinities stay
    infinite (their factor is 1, not NaN), and an FP16 input is moved in FP32 and cast back."""
    from onnx_qat.formats.float_parts import jittered

    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
         helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
        "qdq", [helper.make_tensor_value_info("x", dtype, [None])],
        [helper.make_tensor_value_info("y", dtype, [None])],
        [numpy_helper.from_array(np.array(0.05, np_type), "s"), numpy_helper.from_array(np.int8(0), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)
    size = 2.0**-9
    moved = jittered(model, size, seed=4)
    name = next(n.input[0] for n in moved.graph.node if n.op_type == "QuantizeLinear")
    x = np.concatenate([[0.0, np.inf, -np.inf], np.random.default_rng(0).uniform(-6, 6, 997)]).astype(np_type)
    got = run(_with_outputs(moved, [name], dtype), {"x": x})[-1]
    assert got.dtype == np_type and np.array_equal(got[:3], x[:3])
    ratio = got[3:].astype(np.float64) / x[3:] - 1
    step = 2.0**-11 if dtype == TensorProto.FLOAT16 else 2.0**-23  # the product rounded to the type
    assert np.abs(ratio).max() <= size + step and np.std(ratio) > size / 3


def if_only_model(seed: int) -> onnx.ModelProto:
    """The whole network inside an If, as silero-vad's: each branch Conv -> Relu -> Conv on the outer
    input ``x``; the main graph holds the If alone, so every Q/DQ scale quantize writes sits in a branch."""
    rng = np.random.default_rng(seed)

    def branch(tag: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node("Conv", ["x", f"w1_{tag}"], [f"c1_{tag}"], pads=[1, 1, 1, 1],
                              name=f"{tag}_conv1"),
             helper.make_node("Relu", [f"c1_{tag}"], [f"r1_{tag}"], name=f"{tag}_relu"),
             helper.make_node("Conv", [f"r1_{tag}", f"w2_{tag}"], [f"y_{tag}"], pads=[1, 1, 1, 1],
                              name=f"{tag}_conv2")],
            tag, [], [helper.make_tensor_value_info(f"y_{tag}", F, [1, 4, 8, 8])],
            [_init(rng, f"w1_{tag}", [16, 3, 3, 3]), _init(rng, f"w2_{tag}", [4, 16, 3, 3])])

    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=branch("then"), else_branch=branch("else"),
                          name="branch")],
        "if_only", [helper.make_tensor_value_info("x", F, [1, 3, 8, 8]),
                    helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", F, [1, 4, 8, 8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_activation_scales_held_only_in_bodies_are_measured_rounded_both_ways(seed, tmp_path):
    """A model whose Q/DQ scales all sit in If branches (silero-vad's form): with BF16, whose grid the
    calibrated (FP16-grid) scales are not on, both roundings of the activation scales are measured and
    the better one is stored in the branches. Until 2026-11-27 only the main graph's scales were looked
    at: none there, so the second measurement was skipped and ``drop_nearest`` repeated ``drop_up``."""
    from onnx_qat.formats.float_parts import BF16, activation_scales

    model = if_only_model(seed)
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((16, 3, 8, 8)).astype(np.float32),
             cond=np.array(True))
    q32 = onnx_qat.quantize(model, data=str(tmp_path / "calib.npz"), progress=False).model
    assert not activation_scales(q32) and any(activation_scales(g) for g in all_graphs(q32)[1:])
    result = cast_float_parts(q32, "bf16", data=str(tmp_path / "calib.npz"), reference=model)
    rounding = result.measurement["scale_rounding"]
    assert rounding["drop_up"] != rounding["drop_nearest"], rounding  # both measured
    assert rounding["chosen"] == ("nearest" if rounding["drop_nearest"] < rounding["drop_up"] else "up")
    stored = {t.name.rsplit("/bf16", 1)[0]: numpy_helper.to_array(t) if t.data_type == F else
              onnx_qat.io.models.tensor_array(t) for g in all_graphs(result.model) for t in g.initializer}
    checked = 0
    for g in all_graphs(q32)[1:]:
        for t in g.initializer:
            if t.name in activation_scales(g):
                s32 = numpy_helper.to_array(t).astype(np.float32)
                want = BF16.round_up(s32) if rounding["chosen"] == "up" else BF16.round(s32)
                np.testing.assert_array_equal(np.asarray(stored[t.name], np.float32), want, err_msg=t.name)
                checked += 1
    assert checked >= 2
