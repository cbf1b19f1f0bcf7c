"""New nodes and initializers as wire bytes (`onnx_qat.graph.wire`): the same bytes as protobuf's, and the
same committed model as the NodeProto path of `GraphEdit`, byte for byte."""
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnx_qat
from onnx_qat.graph import wire
from onnx_qat.graph.edit import GraphEdit
from onnx_qat.graph.index import GraphIndex, assign_node_names
from onnx_qat.insertion.inserter import insert_qdq_pairs
from onnx_qat.placement.policy import TensorRTPolicy
from tests import builders as B

#: Names of one byte's length, non-ASCII names, and names whose length takes two and three varint bytes.
PREFIXES = ("", "é_", "n" * 130, "m" * 20000)


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("attributes", [(), (("axis", 0),), (("axis", -1), ("block_size", 128)),
                                        (("axis", 2 ** 40),)])
def test_node_bytes_are_protobufs(prefix, attributes):
    inputs = [prefix + "x", "", prefix + "s", "z"]
    node = onnx.NodeProto(op_type="DequantizeLinear", name=prefix + "dq", input=inputs, output=[prefix + "y"])
    for name, value in attributes:
        node.attribute.append(onnx.AttributeProto(name=name, type=onnx.AttributeProto.INT, i=value))
    encoded = wire.node("DequantizeLinear", prefix + "dq", inputs, [prefix + "y"],
                        [wire.int_attribute(n, v) for n, v in attributes])
    assert encoded == node.SerializeToString()
    node.domain = "com.example"
    encoded_attributes = [wire.int_attribute(n, v) for n, v in attributes]
    assert wire.node("DequantizeLinear", prefix + "dq", inputs, [prefix + "y"], encoded_attributes,
                     "com.example") == node.SerializeToString()
    assert wire.encode_node("DequantizeLinear", prefix + "dq", inputs, [prefix + "y"],
                            encoded_attributes).proto().input == inputs


def test_node_bytes_with_an_empty_name_set_it_as_protobuf_does():
    node = onnx.NodeProto(op_type="Relu", name="", input=["a"], output=["b"])
    assert wire.node("Relu", "", ["a"], ["b"]) == node.SerializeToString()
    assert node.HasField("name")


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("dims", [(), (3,), (0,), (16, 3, 3, 3), (200,), (1, 70000), (127, 128)])
@pytest.mark.parametrize("data_type", [TensorProto.FLOAT, TensorProto.INT8, TensorProto.UINT8,
                                       TensorProto.FLOAT8E4M3FN, TensorProto.INT4])
def test_tensor_bytes_are_protobufs(prefix, dims, data_type):
    count = int(np.prod(dims)) if dims else 1
    raw = np.random.default_rng(len(dims)).integers(0, 256, count, dtype=np.uint8).tobytes()
    for value in (raw, b""):
        kwargs = {"dims": dims} if dims else {}
        proto = onnx.TensorProto(name=prefix + "t", data_type=data_type, raw_data=value, **kwargs)
        assert wire.tensor(prefix + "t", data_type, value, dims) == proto.SerializeToString()
    assert wire.encode_tensor(prefix + "t", data_type, raw, dims).proto().dims == list(dims)


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16383, 16384, 2 ** 35, -1, -(2 ** 40)])
def test_varint(value):
    attr = onnx.AttributeProto(i=value)
    assert wire.varint(value) == attr.SerializeToString()[1:]


def test_framed_is_a_repeated_field_as_protobuf_writes_it():
    graph = onnx.GraphProto()
    for size in (0, 1, 127, 128, 300, 16383, 16384, 70000, 300):
        graph.node.add(op_type="Relu", name="n" * size)
    nodes = [n.SerializeToString() for n in graph.node]
    assert wire.framed(wire.GRAPH_NODE, nodes) == graph.SerializeToString()
    assert wire.framed(wire.GRAPH_NODE, nodes) == graph.SerializeToString()  # lengths met before, cached


def _renamed(model: onnx.ModelProto, prefix: str) -> onnx.ModelProto:
    """``model`` with ``prefix`` before every tensor and node name."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph

    def new(name):
        return prefix + name if name else name

    for node in graph.node:
        node.name = new(node.name)
        node.input[:] = [new(t) for t in node.input]
        node.output[:] = [new(t) for t in node.output]
    for part in (graph.input, graph.output, graph.value_info, graph.initializer):
        for item in part:
            item.name = new(item.name)
    return out


@pytest.mark.parametrize("shape, axis", [((37, 37, 1, 1), 0), ((16, 3, 3, 3), 0), ((300,), None),
                                         ((64, 37), 1), ((2, 2), None)])
def test_weight_templates_write_the_tensor_bytes(shape, axis):
    """The inserter's per-form templates of a weight (stored initializer, scale, zero point) and of a
    scalar give `wire.tensor`'s bytes, with dims and lengths whose varint holds a ``%`` byte (37)."""
    from onnx_qat.insertion.inserter import _SCALE_TEMPLATE, _scalar_template, _weight_templates

    channels = shape[axis] if axis is not None else 1
    q_tpl, scale_tpl, zp_tpl, attributes, scale_dims, form = _weight_templates(shape, axis, channels)
    raw = np.random.default_rng(1).integers(0, 256, int(np.prod(shape)), dtype=np.uint8).tobytes()
    scale = np.random.default_rng(2).random(channels).astype(np.float32).tobytes()
    for name in ("w%s", "a_37%"):
        data = name.encode()
        assert q_tpl % (len(data), data, raw) == wire.tensor(name, TensorProto.INT8, raw, shape)
        assert scale_tpl % (len(data), data, scale) == wire.tensor(name, TensorProto.FLOAT, scale, scale_dims)
        assert zp_tpl % (len(data), data) == wire.tensor(name, TensorProto.INT8, bytes(channels), scale_dims)
        four = scale[:4]
        assert _SCALE_TEMPLATE % (len(data), data, four) == wire.tensor(name, TensorProto.FLOAT, four)
        for data_type, value in ((TensorProto.UINT8, b"\x80"), (TensorProto.INT8, b"%"),
                                 (TensorProto.FLOAT8E4M3FN, b"\x00")):
            scalar = _scalar_template(data_type, value) % (len(data), data)
            assert scalar == wire.tensor(name, data_type, value)
    axis_bytes = b"" if axis is None else wire.field(wire.NODE_ATTRIBUTE, wire.int_attribute("axis", axis))
    assert attributes == axis_bytes
    assert scale_dims == (() if axis is None else (channels,)) and form[4] == axis


def _many_convs(channels: int = 37, blocks: int = 12, seed: int = 0) -> onnx.ModelProto:
    """Conv -> Relu -> Add blocks whose 1x1 weights share one shape (the inserter's batches), with
    37 channels (a dimension whose varint is the byte ``%``)."""
    b = B.GraphBuilder("many_convs", seed=seed)
    x = b.input("input", [1, channels, 4, 4])
    for i in range(blocks):
        y = b.node("Conv", [x, b.weight(f"w{i}", [channels, channels, 1, 1])], name=f"conv{i}")
        y = b.node("Relu", [y], name=f"relu{i}")
        y = b.node("Conv", [y, b.weight(f"v{i}", [channels, channels, 1, 1])], name=f"convb{i}")
        x = b.node("Add", [y, x], name=f"add{i}")
    b.output(x)
    return b.build()


@pytest.mark.parametrize("seed", range(3))
def test_insertion_in_batches_commits_the_same_model(seed):
    """Many small weights of one shape (quantized in one batch, written a column at a time) and activation
    pairs: the same model and records as the NodeProto path, byte for byte."""
    model = _many_convs(seed=seed)
    (objects, records_o), (encoded, records_e) = _both(model, _table(model))
    assert objects == encoded and records_o == records_e
    assert len(records_e.weights) == 24 and len(records_e.activations) >= 24


def _both(model, table, precision="int8", **storage):
    """The committed model of `insert_qdq_pairs` with new nodes as NodeProtos and as bytes, serialized
    (the latter also with the edit's lookups taken from the placement's index: all three the same)."""
    config = onnx_qat.QuantizeConfig(precision=precision)
    found = []
    for encoded, from_index in ((False, False), (True, False), (True, True)):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        assign_node_names(copy)
        index = GraphIndex(copy)
        placement = TensorRTPolicy().place(index, config)
        if placement.subgraphs:  # the main graph's edit only (the branches have their own)
            placement = replace(placement, subgraphs=())
        edit = GraphEdit(copy, encoded=encoded, index=index if from_index else None)
        result = insert_qdq_pairs(edit, placement, table, precision=precision, **storage)
        found.append((edit.commit().SerializeToString(), result))
    assert found[2] == found[1]
    return found[:2]


def _table(model, prefix=""):
    table = B.amax_table(model, B.random_inputs(model, num=1, seed=3))
    return onnx_qat.ScaleTable({prefix + k: v for k, v in table.activations.items()})


@pytest.mark.parametrize("prefix", PREFIXES[:3])
@pytest.mark.parametrize("build, precision", [
    (lambda: B.residual_block_model(projection=True), "int8"),
    (lambda: B.mobilenet_v2_model(size=16, width=0.5), "int8"),
    (lambda: B.transformer_block_model(), "int8"),
    (lambda: B.residual_block_model(projection=True, seed=4), "fp8"),
    (lambda: B.transformer_block_model(seed=2), "int4"),
    (lambda: B.mlp_model(), "fp8"),
    (lambda: B.if_cnn_model(), "int8"),
])
def test_insertion_as_bytes_commits_the_same_model(build, precision, prefix):
    float_model = build()
    table = _table(float_model, prefix)
    model = _renamed(float_model, prefix)
    (objects, records_o), (encoded, records_e) = _both(model, table, precision)
    assert objects == encoded
    assert records_o == records_e
    out = onnx.ModelProto.FromString(encoded)
    dqs = [n for n in out.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == len(records_e.weights) + len(records_e.activations) >= 1  # something was inserted
    if precision == "int4":  # a blocked weight: its DequantizeLinear's two attributes came from bytes too
        assert [a.name for a in dqs[0].attribute] == ["axis", "block_size"]
    else:
        assert len(records_e.weights) >= 2 and len(records_e.activations) >= 1


def test_insertion_as_bytes_with_the_cpu_forms_storage():
    model = B.residual_block_model(projection=True, seed=7)
    table = _table(model)
    index = GraphIndex(model)
    weights = [w.tensor for w in TensorRTPolicy().place(index, onnx_qat.QuantizeConfig()).weights]
    tensors = list(table.activations)
    storage = {"zero_points": {t: 128 for t in tensors[::2]}, "unsigned_weights": weights[:1],
               "full_range": tensors[1::3], "narrow_weights": weights[1:2]}
    (objects, _), (encoded, _) = _both(model, table, **storage)
    assert objects == encoded


def test_commit_from_bytes_keeps_fields_drops_released_nodes_and_value_info():
    """A weight made by Constant -> Identity: both go once the DequantizeLinear replaces it, with their
    value_info; the model-level fields, graph inputs and outputs are kept."""
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), "w")
    nodes = [helper.make_node("Constant", [], ["w_c"], name="const", value=w),
             helper.make_node("Identity", ["w_c"], ["w"], name="ident"),
             helper.make_node("Conv", ["x", "w"], ["y"], name="conv")]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "g", [info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
                              [info("y", TensorProto.FLOAT, [1, 4, 2, 2])],
                              value_info=[info("w", TensorProto.FLOAT, [4, 3, 1, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="maker")
    helper.set_model_props(model, {"key": "value"})
    table = onnx_qat.ScaleTable({"x": 1.0})
    (objects, _), (encoded, _) = _both(model, table)
    assert objects == encoded
    out = onnx.ModelProto.FromString(encoded)
    assert [n.op_type for n in out.graph.node] == ["QuantizeLinear", "DequantizeLinear", "DequantizeLinear",
                                                   "Conv"]
    assert not out.graph.value_info and out.metadata_props[0].key == "key" and out.producer_name == "maker"
    onnx.checker.check_model(out)


@pytest.mark.parametrize("chunk", [1, 300, 5000])
def test_commit_from_bytes_in_parts_is_the_same_model(monkeypatch, chunk):
    """A result over protobuf's 2 GB is parsed in parts of at most PARSE_CHUNK bytes, an item larger than
    that copied as a message (and a new initializer of that size made as a TensorProto): here with small
    parts, so every path runs on a small model."""
    from onnx_qat.graph import edit as edit_module

    model = B.residual_block_model(projection=True, seed=5)
    table = _table(model)
    whole = _both(model, table)[1][0]
    monkeypatch.setattr(edit_module, "PARSE_CHUNK", chunk)
    (objects, _), (encoded, _) = _both(model, table)
    assert objects == encoded == whole
