"""GraphEdit (edits of a model's protobuf) and the batched weight paths of the rewrite."""
import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_qat
from onnx_qat.graph.edit import GraphEdit, make_node
from onnx_qat.formats.encoding import quantize_weight, weight_amax
from onnx_qat.insertion.inserter import SMALL_WEIGHT, quantize_small_weights
from onnx_qat.scales import ScaleTable
from tests import builders as B


def _two_convs(weight_as_constant_node: bool = False):
    """x -> Conv(w) -> Relu -> Conv(w2) -> y, with an unused initializer ``spare`` and metadata."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), "w")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "w2")
    spare = numpy_helper.from_array(np.ones(3, np.float32), "spare")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2")]
    inits = [w2, spare]
    if weight_as_constant_node:
        nodes = [helper.make_node("Constant", [], ["w_c"], name="const", value=w),
                 helper.make_node("Identity", ["w_c"], ["w"], name="ident")] + nodes
    else:
        inits.append(w)
    graph = helper.make_graph(nodes, "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 2, 2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="maker",
                              doc_string="doc")
    model.ir_version = 8
    helper.set_model_props(model, {"key": "value"})
    return model


def _replace_weight(edit: GraphEdit, tensor: str, reader: str):
    """What the inserter does for one weight: an int8 copy + DequantizeLinear, the float one released."""
    values, proto, chain = edit.constant(tensor)
    q, scale = quantize_weight(values, 0)
    q_name = edit.add_initializer(f"{tensor}_quantized", q)
    s_name = edit.add_initializer(f"{tensor}_scale", scale)
    z_name = edit.add_initializer(f"{tensor}_zero_point", np.zeros_like(q, shape=scale.shape))
    dq = make_node("DequantizeLinear", edit.fresh(f"{tensor}_DequantizeLinear"), [q_name, s_name, z_name],
                   [edit.fresh(f"{tensor}_dq")], axis=0)
    node = edit.node(reader)
    node.input[1] = dq.output[0]
    edit.insert([dq], [node])
    sources = [proto.name] if not chain else [t for t in chain[-1].input if edit.initializer(t) is not None]
    edit.release_if_unread(initializers=sources, nodes=chain)
    return dq


def test_commit_keeps_every_model_field_and_places_new_nodes_before_their_reader():
    model = _two_convs()
    before = model.SerializeToString(deterministic=True)
    edit = GraphEdit(model)
    dq = _replace_weight(edit, "w2", "conv2")
    out = edit.commit()
    assert [n.name for n in out.graph.node] == ["conv", "relu", dq.name, "conv2"]
    assert out.producer_name == "maker" and out.doc_string == "doc"
    assert {p.key: p.value for p in out.metadata_props} == {"key": "value"}
    assert [o.version for o in out.opset_import] == [17] and out.ir_version == 8
    assert [i.name for i in out.graph.input] == ["x"] and [o.name for o in out.graph.output] == ["y"]
    names = {t.name for t in out.graph.initializer}
    assert "w2" not in names and {"w", "spare", "w2_quantized", "w2_scale", "w2_zero_point"} <= names
    onnx.checker.check_model(out, full_check=True)
    assert model.SerializeToString(deterministic=True) != before  # nodes of the owned model are rewired
    x = np.random.default_rng(1).standard_normal((1, 3, 2, 2)).astype(np.float32)
    float_y = B.run(_two_convs(), {"x": x})[0]
    np.testing.assert_allclose(B.run(out, {"x": x})[0], float_y, atol=0.05 * np.abs(float_y).max())


def test_a_replaced_weight_another_node_still_reads_is_kept():
    model = _two_convs()
    model.graph.node.append(helper.make_node("Identity", ["w2"], ["w2_copy"], name="keep"))
    model.graph.output.append(helper.make_tensor_value_info("w2_copy", TensorProto.FLOAT, None))
    edit = GraphEdit(model)
    _replace_weight(edit, "w2", "conv2")
    out = edit.commit()
    assert "w2" in {t.name for t in out.graph.initializer}
    assert "w2_quantized" in {t.name for t in out.graph.initializer}


def test_a_constant_node_chain_goes_with_the_float_weight():
    edit = GraphEdit(_two_convs(weight_as_constant_node=True))
    _replace_weight(edit, "w", "conv")
    out = edit.commit()
    names = [n.name for n in out.graph.node]
    assert "const" not in names and "ident" not in names
    assert B.count_ops(out)["DequantizeLinear"] == 1
    onnx.checker.check_model(out, full_check=True)


def test_a_weight_read_inside_a_subgraph_is_kept():
    """An If branch reading the float weight by its outer-scope name keeps it alive."""
    model = _two_convs()
    branch = helper.make_graph([helper.make_node("Identity", ["w2"], ["inner"], name="inner_id")], "then", [],
                               [helper.make_tensor_value_info("inner", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["w"], ["inner2"], name="inner_id2")], "else", [],
                              [helper.make_tensor_value_info("inner2", TensorProto.FLOAT, None)])
    model.graph.input.append(helper.make_tensor_value_info("cond", TensorProto.BOOL, []))
    model.graph.node.append(helper.make_node("If", ["cond"], ["picked"], name="if", then_branch=branch,
                                             else_branch=other))
    model.graph.output.append(helper.make_tensor_value_info("picked", TensorProto.FLOAT, None))
    edit = GraphEdit(model)
    _replace_weight(edit, "w2", "conv2")
    assert "w2" in {t.name for t in edit.commit().graph.initializer}


def test_a_replaced_weight_also_listed_as_a_graph_input_is_kept():
    """An initializer listed among the graph inputs (old exporters do this) may be fed at run time:
    dropping it would turn it into a required input."""
    model = _two_convs()
    model.graph.input.append(helper.make_tensor_value_info("w2", TensorProto.FLOAT, [4, 4, 1, 1]))
    edit = GraphEdit(model)
    _replace_weight(edit, "w2", "conv2")
    assert "w2" in {t.name for t in edit.commit().graph.initializer}


def test_value_info_of_a_tensor_no_node_makes_any_more_is_left_out():
    model = _two_convs()
    model.graph.value_info.extend([helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 4, 2, 2]),
                                   helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 4, 2, 2])])
    edit = GraphEdit(model)
    edit.node("conv2").input[0] = "c"
    edit.remove(edit.node("relu"))
    out = edit.commit()
    assert [vi.name for vi in out.graph.value_info] == ["c"]
    assert [n.name for n in out.graph.node] == ["conv", "conv2"]
    onnx.checker.check_model(out, full_check=True)


def test_fresh_names_avoid_every_name_in_the_model_and_its_subgraphs():
    model = _two_convs()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "w2_scale"))
    edit = GraphEdit(model)
    assert edit.fresh("w2_scale") == "w2_scale_1"
    assert edit.fresh("w2_scale") == "w2_scale_2"
    assert edit.fresh("relu") == "relu_1"  # a node name
    with pytest.raises(ValueError, match="does not have"):
        edit.node("missing")


@pytest.mark.parametrize("bases, expected", [
    (["p", "q", "s"], ["p", "q", "s"]),  # none taken: the bases themselves, in one step
    (["p", "q", "p"], ["p", "q", "p_1"]),  # none taken, one repeated: one by one
    (["p", "relu", "q", "relu", "relu_1", "w2_scale"],  # taken, repeated, and a name a later one takes
     ["p", "relu_1", "q", "relu_2", "relu_1_1", "w2_scale_1"]),
])
def test_fresh_names_equal_one_fresh_call_per_name(bases, expected):
    def made(batch):
        model = _two_convs()
        model.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "w2_scale"))
        edit = GraphEdit(model)
        names = edit.fresh_names(bases) if batch else [edit.fresh(b) for b in bases]
        return names, edit.fresh("p")  # and the names stay taken

    assert made(True) == made(False) == (expected, "p_2" if bases.count("p") > 1 else "p_1")


def test_added_initializers_equal_those_made_one_by_one():
    scale = np.array([0.5, 0.25], np.float32)
    one = GraphEdit(_two_convs())
    one.add_raw_initializer("q", np.int8, b"\x01\xff", (2,))
    one.add_initializer("s", scale)
    one.add_raw_initializer("z", np.int8, b"\x00")
    one.add_initializer("d", np.array([1.5], np.float64))
    batch = GraphEdit(_two_convs())
    names = batch.fresh_names(["q", "s", "z", "d"])
    batch.add_initializers(names[:2], [(np.dtype(np.int8), b"\x01\xff", (2,)),
                                       (np.dtype(np.float32), scale.tobytes(), scale.shape)])
    batch.add_scalar_initializers(names[2:3], [TensorProto.INT8], [b"\x00"])
    batch.add_initializers(names[3:], [np.array([1.5], np.float64)])
    assert batch.commit() == one.commit()


@pytest.mark.parametrize("axis", [0, 1, None])
def test_batched_small_weights_equal_one_by_one_quantization(axis):
    """quantize_small_weights gives the very integers, scales and ranges of quantize_weight per weight,
    zero-range channels included; large weights, ScaleTable ranges and non-float weights are left out."""
    rng = np.random.default_rng(3)
    inits = []
    for i in range(40):
        w = rng.standard_normal((8, 6, 3, 3)).astype(np.float32) * rng.uniform(0.01, 10)
        if i % 7 == 0:
            w[2] = 0.0  # a zero channel: scale ZERO_CHANNEL_SCALE, as one by one
        if i % 11 == 0:
            w[1, 0, 0, 0] = 0.5 * (np.abs(w).max() / 127.0) * 3  # a half-way value (x.5 steps)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
    big = rng.standard_normal((SMALL_WEIGHT + 1,)).astype(np.float32)
    inits += [numpy_helper.from_array(big.reshape(1, -1), "big"),
              numpy_helper.from_array(np.ones((8, 6, 3, 3), np.float32), "ranged"),
              numpy_helper.from_array(np.ones((8, 6, 3, 3), np.float64), "double")]
    graph = helper.make_graph([], "g", [], [], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    table = ScaleTable({}, {"ranged": {"axis": None, "amax": [2.0]}})
    keys = [(t.name, axis) for t in inits]
    ready = quantize_small_weights(GraphEdit(model), keys, table)
    assert set(ready) == {(f"w{i}", axis) for i in range(40)}
    for i in range(40):
        values = numpy_helper.to_array(inits[i])
        amax = weight_amax(values, axis)
        q, scale = quantize_weight(values, axis, amax)
        got_q, got_scale, got_amax = ready[(f"w{i}", axis)]
        np.testing.assert_array_equal(got_q, q)
        np.testing.assert_array_equal(got_scale, scale)
        np.testing.assert_array_equal(got_amax, amax)
        assert got_q.dtype == np.int8 and got_scale.dtype == np.float32


def _many_weights(blocks: int = 30, channels: int = 16):
    """Conv -> Relu blocks, each Conv with a weight of its own (small: batched)."""
    rng = np.random.default_rng(5)
    nodes, inits, x = [], [], "input"
    for i in range(blocks):
        inits.append(numpy_helper.from_array(
            rng.standard_normal((channels, channels, 1, 1)).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    shape = [1, channels, 2, 2]
    graph = helper.make_graph(nodes, "many",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_non_finite_weight_is_named_among_many_small_ones():
    """The batched finiteness check still names the one weight holding a NaN."""
    model = _many_weights()
    bad = model.graph.initializer[17]
    values = numpy_helper.to_array(bad).copy()
    values.reshape(-1)[5] = np.nan
    bad.CopyFrom(numpy_helper.from_array(values, bad.name))
    table = ScaleTable({t: 1.0 for t in onnx_qat.place(model).activation_tensors()})
    with pytest.raises(onnx_qat.ModelError, match=f"weight '{bad.name}' holds 1 NaN or infinite"):
        onnx_qat.quantize(model, scales=table, progress=False)


def test_zero_range_channels_are_logged_in_the_batched_path(caplog):
    model = _many_weights(4)
    for t in model.graph.initializer:
        if len(t.dims) == 4:
            values = numpy_helper.to_array(t).copy()
            values[0] = 0.0
            t.CopyFrom(numpy_helper.from_array(values, t.name))
    table = ScaleTable({t: 1.0 for t in onnx_qat.place(model).activation_tensors()})
    with caplog.at_level(logging.INFO, logger="onnx_qat.formats.encoding"):
        result = onnx_qat.quantize(model, scales=table, progress=False)
    weights = [r for r in result.inserted if r["kind"] == "weight"]
    assert weights and all(r["zero_channels"] == 1 for r in weights)
    assert "channel(s) with zero range" in caplog.text


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("axis", [0, 1, None])
def test_fp16_grid_batch_equals_the_grid_choice_then_quantization(seed, axis):
    """The batch path of the TensorRT form's weights (`_fp16_grid_batch`: the FP16 neighbour chosen per
    channel, the chosen candidate's codes kept) gives the very scales and integers of
    `fp16_weight_scales` followed by `to_grid`, over weights of several magnitudes; a batch whose scales
    FP16 cannot hold takes the long way (None)."""
    from onnx_qat.formats.encoding import INT8_QRANGE, int8_dequantized, to_grid
    from onnx_qat.formats.scale_grid import fp16_weight_scales
    from onnx_qat.insertion.inserter import _fp16_grid_batch

    rng = np.random.default_rng(seed)
    magnitudes = rng.uniform(1e-3, 30, (24, 1, 1, 1, 1))
    stack = (rng.standard_normal((24, 8, 6, 3, 3)) * magnitudes).astype(np.float32)
    stack[3, 2] = 0.0  # a zero channel
    count = stack.shape[0]
    if axis is None:
        rows, shape = stack.reshape(count, 1, -1), (count, 1, 1, 1, 1)
    else:
        rows = np.moveaxis(stack, axis + 1, 1).reshape(count, stack.shape[axis + 1], -1)
        shape = [count, 1, 1, 1, 1]
        shape[axis + 1] = -1
    amax = np.maximum(rows.max(axis=2), -rows.min(axis=2)).astype(np.float32)
    scale = (amax.astype(np.float64) / 127.0).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0))
    found = _fp16_grid_batch(stack, scale, shape, INT8_QRANGE)
    expected = fp16_weight_scales(stack, scale, shape, int8_dequantized(INT8_QRANGE), batched=True)
    assert found is not None
    np.testing.assert_array_equal(found[0], expected)
    np.testing.assert_array_equal(found[1], to_grid(stack, expected.reshape(shape), INT8_QRANGE))
    assert found[1].dtype == np.int8 and found[0].dtype == np.float32
    assert _fp16_grid_batch(stack * np.float32(1e7), scale * np.float32(1e7), shape, INT8_QRANGE) is None


def test_insert_many_queues_as_insert_does():
    """GraphEdit.insert_many gives the committed model of insert called node by node: new nodes before
    their first reader, two batches before one reader in order, a batch read by several nodes."""
    def edited(many: bool):
        model = _two_convs()
        edit = GraphEdit(model)
        conv, relu, conv2 = edit.node("conv"), edit.node("relu"), edit.node("conv2")
        items = [((make_node("Identity", "a", ["x"], ["xa"]),), [conv], ("xa",)),
                 ((make_node("Identity", "b", ["xa"], ["xb"]), make_node("Identity", "c", ["xb"], ["xc"])),
                  [conv], ("xb", "xc")),
                 ((make_node("Identity", "d", ["r"], ["rd"]),), [conv2, relu], ("rd",))]
        if many:
            edit.insert_many(items)
        else:
            for nodes, readers, outputs in items:
                edit.insert(nodes, readers, outputs)
        assert edit.producer["xc"].name == "c"
        return edit.commit()

    committed = edited(True)
    assert committed == edited(False)
    assert [n.name for n in committed.graph.node][:4] == ["a", "b", "c", "conv"]


@pytest.mark.parametrize("encoded", [False, True])
def test_a_removed_queued_node_is_left_out(encoded):
    """`GraphEdit.remove` of a queued new node (a NodeProto, or an `EncodedNode` of an edit holding new
    nodes as bytes) leaves it out of `live_nodes` and of the result, its queue's other nodes kept in order;
    removing an original node as well changes nothing else."""
    from onnx_qat.graph.wire import encode_node

    model = _two_convs()
    edit = GraphEdit(model, encoded=encoded)
    conv, relu = edit.node("conv"), edit.node("relu")
    make = encode_node if encoded else make_node
    kept, dropped, last = (make("Identity", n, [i], [o]) for n, i, o in
                           (("a", "x", "xa"), ("b", "xa", "xb"), ("c", "r", "rc")))
    edit.insert([kept, dropped], [conv], ("xa", "xb"))
    edit.insert([last], [])
    conv.input[0] = "xa"
    assert [n.name for n in edit.live_nodes()] == ["a", "b", "conv", "relu", "conv2", "c"]
    edit.remove(dropped)
    edit.remove(last)
    assert [n.name for n in edit.live_nodes()] == ["a", "conv", "relu", "conv2"]
    edit.remove(relu)
    edit.node("conv2").input[0] = "c"
    out = edit.commit()
    assert [n.name for n in out.graph.node] == ["a", "conv", "conv2"]
    assert "xb" not in edit.producer and "rc" not in edit.producer


def test_raw_initializer_of_an_encoded_edit_is_written():
    """`GraphEdit.add_raw_initializer` on an edit holding new initializers as bytes: the initializer is in the
    result as the bytes give it (it once fell through to a name not set on that path)."""
    model = B.residual_block_model()
    edit = GraphEdit(model, encoded=True)
    raw = np.arange(6, dtype=np.float32).tobytes()
    name = edit.add_raw_initializer("extra", np.float32, raw, (2, 3))
    edit.insert([onnx.helper.make_node("Identity", [name], ["extra_out"], name="extra_id")], [])
    out = edit.commit()
    found = next(t for t in out.graph.initializer if t.name == name)
    assert list(found.dims) == [2, 3] and found.raw_data == raw


@pytest.mark.parametrize("join_most", [1 << 24, 3000, 1])
@pytest.mark.parametrize("bad_value", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_is_named_across_joined_buffers(monkeypatch, join_most, bad_value):
    """The weights are checked a joined buffer at a time (`GraphIndex.decode_initializers`, buffers of one
    weight up to all of them); the weight holding the bad value is named, the first by name of two, and a
    model without one passes."""
    from onnx_qat.graph import index as index_module

    monkeypatch.setattr(index_module, "JOIN_MOST", join_most)
    table = ScaleTable({t: 1.0 for t in onnx_qat.place(_many_weights()).activation_tensors()})
    assert onnx_qat.quantize(_many_weights(), scales=table, progress=False).summary["weights"] == 30
    model = _many_weights()
    for position, count in ((23, 2), (8, 1)):
        bad = model.graph.initializer[position]
        values = numpy_helper.to_array(bad).copy()
        values.reshape(-1)[3:3 + count] = bad_value
        bad.CopyFrom(numpy_helper.from_array(values, bad.name))
    with pytest.raises(onnx_qat.ModelError, match="weight 'w23' holds 2 NaN or infinite"):
        onnx_qat.quantize(model, scales=table, progress=False)


@pytest.mark.parametrize("with_index", [False, True])
@pytest.mark.parametrize("weight_as_constant_node", [False, True])
def test_released_lookups_commit_the_same_model(with_index, weight_as_constant_node):
    """`GraphEdit.release_lookups` (and `GraphIndex.release` of the index it was given) before the commit: the
    same result, with a weight released and a Constant chain read; the edit then refuses to read or insert,
    and the released index describes an empty graph."""
    from onnx_qat.graph.index import GraphIndex

    def edited(release: bool):
        model = _two_convs(weight_as_constant_node)
        index = GraphIndex(model) if with_index else None
        edit = GraphEdit(model, index=index)
        _replace_weight(edit, "w", "conv")
        _replace_weight(edit, "w2", "conv2")
        if release:
            edit.release_lookups()
            if index is not None:
                index.release()
                assert index.nodes == () and not index.producer and not index.initializers
                assert not index.is_constant("w2") and index.constant_shapes() == {}
                assert index.all_tensor_names() == () and not index.has_tensor("x")
            with pytest.raises(RuntimeError, match="release_lookups"):
                edit.fresh("another")
            with pytest.raises(RuntimeError, match="release_lookups"):
                edit.node("conv")
        return edit.commit().SerializeToString(deterministic=True)

    assert edited(True) == edited(False)
