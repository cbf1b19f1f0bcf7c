"""Tiny float ONNX models built in code, and graph assertions for Q/DQ tests.

Every builder returns a fresh, checked ``onnx.ModelProto`` (float32, seeded
weights) so tests never share state. Node and tensor names are stable and
documented in each builder; tests may rely on them.

Assertion helpers (``assert_qdq_on``, ``assert_weight_quantized`` ...) print the
neighbourhood of the offending tensor or node when they fail, so a broken rule
shows the subgraph that breaks it.
"""
from __future__ import annotations

import math
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DEFAULT_OPSET = 17


# --------------------------------------------------------------------------- builder
class GraphBuilder:
    """A small helper to write ONNX graphs by hand with readable names.

    ``node()`` returns the output name(s); ``weight()`` adds a seeded float32
    initializer; ``build()`` returns a checked ModelProto.
    """

    def __init__(self, name: str = "graph", seed: int = 0):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: List[onnx.NodeProto] = []
        self.initializers: List[onnx.TensorProto] = []
        self.inputs: List[onnx.ValueInfoProto] = []
        self.outputs: List[onnx.ValueInfoProto] = []

    # -- tensors
    def input(self, name: str, shape: Sequence, dtype=TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def output(self, name: str, shape: Optional[Sequence] = None, dtype=TensorProto.FLOAT) -> str:
        dims = None if shape is None else list(shape)
        self.outputs.append(helper.make_tensor_value_info(name, dtype, dims))
        return name

    def const(self, name: str, array) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, name: str, shape: Sequence[int], std: Optional[float] = None) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
        std = std if std is not None else math.sqrt(2.0 / max(fan_in, 1))
        return self.const(name, (self.rng.standard_normal(shape) * std).astype(np.float32))

    def node(self, op_type: str, inputs: Sequence[str], outputs=None, name: Optional[str] = None,
             domain: str = "", **attrs):
        name = name or f"{op_type.lower()}_{len(self.nodes)}"
        if outputs is None:
            outputs = [f"{name}_out"]
        elif isinstance(outputs, str):
            outputs = [outputs]
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs), name=name,
                                           domain=domain or None, **attrs))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    # -- layers
    def conv(self, x: str, cin: int, cout: int, name: str, k: int = 3, stride: int = 1, group: int = 1,
             pad: Optional[int] = None, bias: bool = True) -> str:
        pad = k // 2 if pad is None else pad
        w = self.weight(f"{name}.weight", [cout, cin // group, k, k])
        ins = [x, w]
        if bias:
            ins.append(self.const(f"{name}.bias", (self.rng.standard_normal(cout) * 0.1).astype(np.float32)))
        return self.node("Conv", ins, name=name, kernel_shape=[k, k], strides=[stride, stride],
                         pads=[pad] * 4, group=group)

    def bn(self, x: str, channels: int, name: str) -> str:
        r = self.rng
        params = [
            (f"{name}.scale", r.uniform(0.5, 1.5, channels)),
            (f"{name}.bias", r.standard_normal(channels) * 0.1),
            (f"{name}.mean", r.standard_normal(channels) * 0.1),
            (f"{name}.var", r.uniform(0.5, 1.5, channels)),
        ]
        ins = [x] + [self.const(n, v.astype(np.float32)) for n, v in params]
        return self.node("BatchNormalization", ins, name=name, epsilon=1e-5)

    def relu(self, x: str, name: str) -> str:
        return self.node("Relu", [x], name=name)

    def linear(self, x: str, din: int, dout: int, name: str, bias: bool = True) -> str:
        """MatMul with a constant [din, dout] weight (+ Add of a constant bias)."""
        w = self.weight(f"{name}.weight", [din, dout])
        y = self.node("MatMul", [x, w], name=name)
        if bias:
            b = self.const(f"{name}.bias", (self.rng.standard_normal(dout) * 0.1).astype(np.float32))
            y = self.node("Add", [y, b], name=f"{name}_bias")
        return y

    def build(self, opset: int = DEFAULT_OPSET, ir_version: Optional[int] = None,
              check: bool = True) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  producer_name="onnx-qat-tests")
        if ir_version is None:
            ir_version = min(model.ir_version, 8 if opset <= 17 else 9)
        model.ir_version = ir_version
        _fill_output_shapes(model)
        if check:
            onnx.checker.check_model(model)
        return model


def _fill_output_shapes(model: onnx.ModelProto) -> None:
    """Give graph outputs declared without a shape their inferred type (the checker wants one)."""
    if all(o.type.tensor_type.HasField("shape") for o in model.graph.output):
        return
    inferred = onnx.shape_inference.infer_shapes(model)
    known = {o.name: o for o in inferred.graph.output}
    for out in model.graph.output:
        if not out.type.tensor_type.HasField("shape") and known[out.name].type.tensor_type.HasField("shape"):
            out.CopyFrom(known[out.name])


# --------------------------------------------------------------------------- models
def conv_bn_relu_model(channels: int = 16, size: int = 8, maxpool: bool = False,
                       seed: int = 0) -> onnx.ModelProto:
    """input [1,C,S,S] -> Conv ``conv`` -> BatchNormalization ``bn`` -> Relu ``relu``
    (-> MaxPool ``pool``) -> output."""
    b = GraphBuilder("conv_bn_relu", seed)
    x = b.input("input", [1, channels, size, size])
    y = b.relu(b.bn(b.conv(x, channels, channels, "conv"), channels, "bn"), "relu")
    if maxpool:
        y = b.node("MaxPool", [y], name="pool", kernel_shape=[2, 2], strides=[2, 2])
    b.nodes[-1].output[0] = "output"
    b.output("output")
    return b.build()


def residual_block_model(projection: bool = False, channels: int = 16, size: int = 8,
                         seed: int = 0) -> onnx.ModelProto:
    """A ResNet basic block after a stem.

    input -> ``stem_conv`` -> ``stem_relu`` (tensor ``stem_relu_out``) -> ``conv1``/``bn1``/``relu1`` ->
    ``conv2``/``bn2`` -> Add ``add`` (input 0 ``bn2_out``, input 1 the shortcut) -> ``relu_out`` -> output.
    The shortcut is ``stem_relu_out`` (identity) or, with ``projection``, ``proj_conv``/``proj_bn``
    (1x1, stride 2, channels doubled; the main branch then also uses stride 2).
    """
    b = GraphBuilder("residual_block", seed)
    x = b.input("input", [1, channels, size, size])
    stem = b.relu(b.conv(x, channels, channels, "stem_conv"), "stem_relu")
    cout = channels * 2 if projection else channels
    stride = 2 if projection else 1
    y = b.relu(b.bn(b.conv(stem, channels, cout, "conv1", stride=stride), cout, "bn1"), "relu1")
    y = b.bn(b.conv(y, cout, cout, "conv2"), cout, "bn2")
    skip = stem
    if projection:
        skip = b.bn(b.conv(stem, channels, cout, "proj_conv", k=1, stride=2), cout, "proj_bn")
    y = b.node("Add", [y, skip], name="add")
    b.node("Relu", [y], "output", name="relu_out")
    b.output("output")
    return b.build()


def mlp_model(features: int = 32, hidden: int = 64, classes: int = 16, batch: int = 2,
              seed: int = 0) -> onnx.ModelProto:
    """input [N,F] -> Gemm ``fc1`` (transB=1, weight ``fc1.weight`` [H,F]) -> Relu ``relu1`` ->
    MatMul ``fc2`` (weight ``fc2.weight`` [H,H]) -> Add ``fc2_bias`` -> Relu ``relu2`` ->
    Gemm ``fc3`` (transB=0, weight ``fc3.weight`` [H,C]) -> output."""
    b = GraphBuilder("mlp", seed)
    x = b.input("input", [batch, features])
    w1 = b.weight("fc1.weight", [hidden, features])
    b1 = b.const("fc1.bias", np.zeros(hidden, np.float32) + 0.01)
    y = b.node("Gemm", [x, w1, b1], name="fc1", transB=1)
    y = b.relu(y, "relu1")
    y = b.relu(b.linear(y, hidden, hidden, "fc2"), "relu2")
    w3 = b.weight("fc3.weight", [hidden, classes])
    b3 = b.const("fc3.bias", np.zeros(classes, np.float32))
    b.node("Gemm", [y, w3, b3], "output", name="fc3", transB=0)
    b.output("output")
    return b.build()


def concat_model(channels: int = 16, size: int = 8, seed: int = 0) -> onnx.ModelProto:
    """An Inception-style block: ``stem_conv``/``stem_relu`` -> three branches
    (``b1_conv``/``b1_relu`` 1x1; ``b2_conv``/``b2_relu`` 3x3; ``b3_pool`` MaxPool -> ``b3_conv``/``b3_relu``)
    -> Concat ``concat`` (axis 1) -> ``head_conv`` -> ``head_relu`` -> output."""
    b = GraphBuilder("concat", seed)
    x = b.input("input", [1, channels, size, size])
    stem = b.relu(b.conv(x, channels, channels, "stem_conv"), "stem_relu")
    y1 = b.relu(b.conv(stem, channels, channels, "b1_conv", k=1), "b1_relu")
    y2 = b.relu(b.conv(stem, channels, channels, "b2_conv"), "b2_relu")
    p = b.node("MaxPool", [stem], name="b3_pool", kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1])
    y3 = b.relu(b.conv(p, channels, channels, "b3_conv", k=1), "b3_relu")
    cat = b.node("Concat", [y1, y2, y3], name="concat", axis=1)
    y = b.conv(cat, 3 * channels, channels, "head_conv")
    b.node("Relu", [y], "output", name="head_relu")
    b.output("output")
    return b.build()


def depthwise_model(channels: int = 16, expand: int = 2, size: int = 8, seed: int = 0) -> onnx.ModelProto:
    """A MobileNetV2 inverted-residual block: ``expand_conv`` 1x1/``expand_bn``/``expand_relu`` ->
    depthwise ``dw_conv`` (group = channels*expand)/``dw_bn``/``dw_relu`` ->
    ``project_conv`` 1x1/``project_bn``
    -> Add ``add`` (input 0 ``project_bn_out``, input 1 the graph input) -> output."""
    b = GraphBuilder("depthwise", seed)
    x = b.input("input", [1, channels, size, size])
    mid = channels * expand
    y = b.relu(b.bn(b.conv(x, channels, mid, "expand_conv", k=1), mid, "expand_bn"), "expand_relu")
    y = b.relu(b.bn(b.conv(y, mid, mid, "dw_conv", group=mid), mid, "dw_bn"), "dw_relu")
    y = b.bn(b.conv(y, mid, channels, "project_conv", k=1), channels, "project_bn")
    b.node("Add", [y, x], "output", name="add")
    b.output("output")
    return b.build()


def mobilenet_v2_model(size: int = 32, batch="N", width: float = 1.0, seed: int = 0) -> onnx.ModelProto:
    """A MobileNetV2 (Sandler et al. 2018: 17 inverted-residual blocks) initialised as
    ``keras.applications.MobileNetV2(weights=None)`` exports through tf2onnx: Glorot-uniform kernels
    (a depthwise kernel's fan-in counts its channels, as Keras computes it), batch normalization at its
    initial statistics folded into each Conv (weights x 1/sqrt(1 + 1e-3), zero bias), ReLU6 as
    ``Clip(0, 6)``. Fed images in 0..255, its activations shrink block by block to ~1e-10 at the head.

    input ``input`` [batch,3,size,size] -> ``stem`` (3x3/2) -> blocks ``b{i}_expand`` (1x1),
    ``b{i}_dw`` (3x3 depthwise), ``b{i}_project`` (1x1, no activation), ``b{i}_add`` where the
    shape allows -> ``last`` (1x1, 1280) -> ``gap`` -> ``flat`` -> ``fc`` (MatMul) -> ``fc_bias`` ->
    output ``output`` (logits, 1000 classes). Each activated Conv is followed by ``<conv>_relu6``."""
    b = GraphBuilder("mobilenet_v2", seed)
    rng, fold = b.rng, np.float32(1.0 / math.sqrt(1.0 + 1e-3))

    def glorot(shape, fan_in, fan_out):
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return rng.uniform(-limit, limit, shape).astype(np.float32)

    def conv(x, cin, cout, name, k=1, stride=1, group=1, act=True):
        fan_out = k * k * (cout if group == 1 else 1)
        w = glorot([cout, cin // group, k, k], k * k * cin, fan_out) * fold
        ins = [x, b.const(f"{name}.weight", w), b.const(f"{name}.bias", np.zeros(cout, np.float32))]
        y = b.node("Conv", ins, name=name, kernel_shape=[k, k], strides=[stride, stride],
                   pads=[(k - 1) // 2] * 4, group=group)
        if act:
            lo = b.const(f"{name}.clip_min", np.array(0, np.float32))
            hi = b.const(f"{name}.clip_max", np.array(6, np.float32))
            y = b.node("Clip", [y, lo, hi], name=f"{name}_relu6")
        return y

    def channels(c):
        return max(8, int(c * width + 4) // 8 * 8)

    x = b.input("input", [batch, 3, size, size])
    cin = channels(32)
    y = conv(x, 3, cin, "stem", k=3, stride=2)
    blocks = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
              (6, 320, 1, 1)]
    i = 0
    for expand, c, repeat, first_stride in blocks:
        for j in range(repeat):
            stride, cout, mid, h = (first_stride if j == 0 else 1), channels(c), cin * expand, y
            if expand != 1:
                h = conv(h, cin, mid, f"b{i}_expand")
            h = conv(h, mid, mid, f"b{i}_dw", k=3, stride=stride, group=mid)
            h = conv(h, mid, cout, f"b{i}_project", act=False)
            y = b.node("Add", [y, h], name=f"b{i}_add") if stride == 1 and cin == cout else h
            cin, i = cout, i + 1
    y = conv(y, cin, 1280, "last")
    y = b.node("Flatten", [b.node("GlobalAveragePool", [y], name="gap")], name="flat")
    y = b.node("MatMul", [y, b.const("fc.weight", glorot([1280, 1000], 1280, 1000))], name="fc")
    b.node("Add", [y, b.const("fc.bias", np.zeros(1000, np.float32))], "output", name="fc_bias")
    b.output("output")
    return b.build()


def transformer_block_model(seq: int = 8, dim: int = 32, heads: int = 2, gelu: str = "erf",
                            mask: str = "-1e9", seed: int = 0) -> onnx.ModelProto:
    """A pre-norm transformer encoder block, input ``input`` [1,S,D] -> output ``output`` [1,S,D].

    ``ln1`` (LayerNormalization) -> ``q``/``k``/``v`` (MatMul with constant weights + ``*_bias`` Add) ->
    heads (Reshape/Transpose) -> ``scores`` MatMul (Q·Kᵀ, both inputs activations) -> ``scale`` Mul ->
    ``mask_add`` Add (a causal additive mask constant ``attn_mask`` of -1e9 or -inf) -> ``softmax`` ->
    ``context`` MatMul (probs·V) -> merge heads -> ``out_proj`` -> residual Add ``res1``
    (input 0 ``input``) ->
    ``ln2`` -> ``ffn1`` -> GELU (``gelu="erf"``: Div/Erf/Add/Mul/Mul named ``gelu_*``; ``gelu="op"``: one
    ``Gelu`` node ``gelu``, opset 20; ``gelu="tanh"``: the tanh approximation,
    Pow/Mul/Add/Mul/Tanh/Add/Mul/Mul named ``gelu_*``) -> ``ffn2`` -> residual Add ``res2``
    (input 0 ``res1_out``).
    """
    if gelu not in ("erf", "op", "tanh") or mask not in ("-1e9", "-inf"):
        raise ValueError("gelu must be 'erf', 'op' or 'tanh'; mask '-1e9' or '-inf'")
    b = GraphBuilder("transformer_block", seed)
    dh = dim // heads
    x = b.input("input", [1, seq, dim])

    def layer_norm(t, name):
        g = b.const(f"{name}.gamma", b.rng.uniform(0.8, 1.2, dim).astype(np.float32))
        be = b.const(f"{name}.beta", (b.rng.standard_normal(dim) * 0.05).astype(np.float32))
        return b.node("LayerNormalization", [t, g, be], name=name, axis=-1, epsilon=1e-5)

    split_shape = b.const("split_heads_shape", np.array([1, seq, heads, dh], np.int64))
    merge_shape = b.const("merge_heads_shape", np.array([1, seq, dim], np.int64))

    def to_heads(t, name, perm):
        r = b.node("Reshape", [t, split_shape], name=f"{name}_reshape")
        return b.node("Transpose", [r], name=f"{name}_transpose", perm=perm)

    h = layer_norm(x, "ln1")
    q = to_heads(b.linear(h, dim, dim, "q"), "q", [0, 2, 1, 3])
    k = to_heads(b.linear(h, dim, dim, "k"), "k", [0, 2, 3, 1])
    v = to_heads(b.linear(h, dim, dim, "v"), "v", [0, 2, 1, 3])
    s = b.node("MatMul", [q, k], name="scores")
    s = b.node("Mul", [s, b.const("attn_scale", np.array(1.0 / math.sqrt(dh), np.float32))], name="scale")
    fill = -1e9 if mask == "-1e9" else -np.inf
    causal = np.triu(np.full((seq, seq), fill, np.float32), k=1)[None, None]
    s = b.node("Add", [s, b.const("attn_mask", causal.astype(np.float32))], name="mask_add")
    p = b.node("Softmax", [s], name="softmax", axis=-1)
    c = b.node("MatMul", [p, v], name="context")
    c = b.node("Transpose", [c], name="merge_transpose", perm=[0, 2, 1, 3])
    c = b.node("Reshape", [c, merge_shape], name="merge_reshape")
    r1 = b.node("Add", [x, b.linear(c, dim, dim, "out_proj")], name="res1")
    h2 = layer_norm(r1, "ln2")
    f = b.linear(h2, dim, 4 * dim, "ffn1")
    if gelu == "op":
        f = b.node("Gelu", [f], name="gelu")
    elif gelu == "tanh":
        f = _tanh_gelu(b, f)
    else:
        d = b.node("Div", [f, b.const("gelu_sqrt2", np.array(math.sqrt(2.0), np.float32))], name="gelu_div")
        e = b.node("Erf", [d], name="gelu_erf")
        a = b.node("Add", [e, b.const("gelu_one", np.array(1.0, np.float32))], name="gelu_add")
        m = b.node("Mul", [f, a], name="gelu_mul")
        f = b.node("Mul", [m, b.const("gelu_half", np.array(0.5, np.float32))], name="gelu_mul_half")
    f = b.linear(f, 4 * dim, dim, "ffn2")
    b.node("Add", [r1, f], "output", name="res2")
    b.output("output")
    return b.build(opset=20 if gelu == "op" else DEFAULT_OPSET)


def _tanh_gelu(b: GraphBuilder, x: str) -> str:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), nodes named ``gelu_*``."""
    def c(name, value):
        return b.const(name, np.array(value, np.float32))

    cube = b.node("Pow", [x, c("gelu_three", 3.0)], name="gelu_pow")
    scaled = b.node("Mul", [cube, c("gelu_k", 0.044715)], name="gelu_mul_k")
    inner = b.node("Add", [x, scaled], name="gelu_inner")
    t = b.node("Tanh", [b.node("Mul", [inner, c("gelu_s", math.sqrt(2 / math.pi))], name="gelu_mul_s")],
               name="gelu_tanh")
    y = b.node("Mul", [x, b.node("Add", [t, c("gelu_one", 1.0)], name="gelu_add")], name="gelu_mul")
    return b.node("Mul", [y, c("gelu_half", 0.5)], name="gelu_mul_half")


def opset9_model(channels: int = 16, size: int = 8, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """An old-style model: opset 9, IR version 4, every initializer also listed as a graph input.

    input -> ``conv``/``bn``/``relu`` -> ``gap`` GlobalAveragePool -> ``flatten`` ->
    ``fc`` Gemm (transB=1) -> output.
    """
    b = GraphBuilder("opset9", seed)
    x = b.input("input", [1, channels, size, size])
    y = b.relu(b.bn(b.conv(x, channels, channels, "conv"), channels, "bn"), "relu")
    y = b.node("GlobalAveragePool", [y], name="gap")
    y = b.node("Flatten", [y], name="flatten", axis=1)
    w = b.weight("fc.weight", [classes, channels])
    bias = b.const("fc.bias", np.zeros(classes, np.float32))
    b.node("Gemm", [y, w, bias], "output", name="fc", transB=1)
    b.output("output")
    for init in b.initializers:
        b.inputs.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return b.build(opset=9, ir_version=4)


def lines_executed(fn: Callable[[], object], package: str = "onnx_qat") -> Tuple[object, int]:
    """``(fn(), number of Python lines executed in the files of ``package`` while it ran)``.

    A deterministic measure of work for scaling tests (``sys.settrace``; no clock involved): a
    per-node Python loop over the whole graph shows as lines growing with the square of the graph
    size. Work done inside C functions (``list.index``, ``x in some_list``) is not counted.
    """
    import importlib

    root = str(Path(importlib.import_module(package).__file__).parent)
    count = 0

    def in_package(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return in_package

    def calls(frame, event, arg):
        return in_package if frame.f_code.co_filename.startswith(root) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        result = fn()
    finally:
        sys.settrace(previous)
    return result, count


def residual_chain_model(blocks: int, channels: int = 16) -> onnx.ModelProto:
    """A long, cheap graph for scaling tests: ``blocks`` x (Conv ``conv{i}`` -> Relu ``relu{i}`` ->
    Conv ``conv{i}b`` -> Add ``add{i}`` with the block input), 4 nodes per block, one shared 1x1 weight
    ``w``; input ``input`` [1, C, 1, 1]. Not checked with onnx.checker (fast to build at 50k nodes)."""
    w = numpy_helper.from_array(np.ones((channels, channels, 1, 1), np.float32), "w")
    nodes, x = [], "input"
    for i in range(blocks):
        nodes += [helper.make_node("Conv", [x, "w"], [f"c{i}"], name=f"conv{i}"),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}"),
                  helper.make_node("Conv", [f"r{i}", "w"], [f"d{i}"], name=f"conv{i}b"),
                  helper.make_node("Add", [f"d{i}", x], [f"o{i}"], name=f"add{i}")]
        x = f"o{i}"
    shape = [1, channels, 1, 1]
    graph = helper.make_graph(nodes, "residual_chain",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)], ir_version=8)


def if_cnn_model(channels: int = 16, size: int = 8, seed: int = 0) -> onnx.ModelProto:
    """A small CNN in each branch of an If chosen by the data.

    input [N,3,S,S] -> ``stem_conv`` -> ``stem_relu`` (tensor ``stem``); ``cond`` = ReduceMean(input) > 0.
    If ``choose``:
      then: ``a_conv1`` -> ``a_relu1`` -> ``a_conv2`` -> Add ``a_add`` (skip: the outer ``stem``) ->
            ``a_relu2`` (branch initializers ``a_conv*.weight``);
      else: ``b_conv1`` (weight ``b_w1`` from a Constant node inside the branch) -> ``b_bn1`` ->
            ``b_relu1`` -> ``b_conv2`` (weight ``shared_w``, an initializer of the main graph) ->
            ``b_relu2``.
    -> ``head_conv`` (1x1) -> output [N,C,S,S].
    """
    c = channels
    b = GraphBuilder("if_cnn", seed)
    x = b.input("input", ["N", 3, size, size])
    stem = b.relu(b.conv(x, 3, c, "stem_conv"), "stem_relu")
    mean = b.node("ReduceMean", [x], name="mean", keepdims=0)
    cond = b.node("Greater", [mean, b.const("zero", np.float32(0))], name="cond")
    shared = b.weight("shared_w", [c, c, 3, 3])

    then = GraphBuilder("then", seed + 1)
    y = then.relu(then.conv(stem, c, c, "a_conv1"), "a_relu1")
    y = then.node("Add", [then.conv(y, c, c, "a_conv2"), stem], name="a_add")
    then.node("Relu", [y], "then_out", name="a_relu2")

    other = GraphBuilder("else", seed + 2)
    w1 = (other.rng.standard_normal([c, c, 3, 3]) * math.sqrt(2.0 / (9 * c))).astype(np.float32)
    other.node("Constant", [], "b_w1", name="b_w1_const", value=numpy_helper.from_array(w1, "b_w1_value"))
    y = other.node("Conv", [stem, "b_w1"], name="b_conv1", kernel_shape=[3, 3], pads=[1] * 4)
    y = other.relu(other.bn(y, c, "b_bn1"), "b_relu1")
    y = other.node("Conv", [y, shared], name="b_conv2", kernel_shape=[3, 3], pads=[1] * 4)
    other.node("Relu", [y], "else_out", name="b_relu2")

    def branch(g: GraphBuilder, out: str) -> onnx.GraphProto:
        info = helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", c, size, size])
        return helper.make_graph(g.nodes, g.name, [], [info], g.initializers)

    chosen = b.node("If", [cond], "chosen", name="choose", then_branch=branch(then, "then_out"),
                    else_branch=branch(other, "else_out"))
    b.node("Conv", [chosen, b.weight("head.weight", [c, c, 1, 1])], "output", name="head_conv",
           kernel_shape=[1, 1])
    b.output("output", ["N", c, size, size])
    return b.build()


def loop_cnn_model(channels: int = 16, size: int = 8, trips: int = 3, seed: int = 0,
                   trips_input: bool = False) -> onnx.ModelProto:
    """A Loop whose body is a small CNN refining a carried image.

    input [N,3,S,S] -> ``stem_conv`` -> ``stem_relu`` (tensor ``stem``) -> Loop ``refine`` (``trips``
    iterations: a constant ``trips``, or with ``trips_input`` a model input ``trips`` of shape []):
      body(i, cond, x): ``l_conv1`` (weight: a body initializer) -> ``l_relu1`` -> ``l_conv2``
      (weight ``loop_w2``: an initializer of the main graph) -> Add ``l_add`` (skip: the carried
      ``x``) -> ``l_relu2`` -> carried ``x_next``; also a scan output ``l_mean`` (per-iteration mean).
    -> ``head_conv`` (1x1) -> output [N,C,S,S]; the scan output -> output ``means`` [T].
    """
    c = channels
    b = GraphBuilder("loop_cnn", seed)
    x = b.input("input", ["N", 3, size, size])
    stem = b.relu(b.conv(x, 3, c, "stem_conv"), "stem_relu")
    if trips_input:
        b.input("trips", [], TensorProto.INT64)
    else:
        b.const("trips", np.array(trips, np.int64))
    shared = b.weight("loop_w2", [c, c, 3, 3], std=0.5 * math.sqrt(2.0 / (9 * c)))

    body = GraphBuilder("refine_body", seed + 1)
    y = body.relu(body.conv("x", c, c, "l_conv1"), "l_relu1")
    y = body.node("Conv", [y, shared], name="l_conv2", kernel_shape=[3, 3], pads=[1] * 4)
    y = body.node("Add", [y, "x"], name="l_add")
    body.node("Relu", [y], "x_next", name="l_relu2")
    body.node("Identity", ["cond"], "cond_out", name="l_cond")
    body.node("ReduceMean", ["x_next"], "l_mean", name="l_mean", keepdims=0)
    graph = helper.make_graph(
        body.nodes, "refine_body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, size, size])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x_next", TensorProto.FLOAT, ["N", c, size, size]),
         helper.make_tensor_value_info("l_mean", TensorProto.FLOAT, [])], body.initializers)
    refined, means = b.node("Loop", ["trips", "", stem], ["refined", "means"], name="refine", body=graph)
    b.node("Conv", [refined, b.weight("head.weight", [c, c, 1, 1])], "output", name="head_conv",
           kernel_shape=[1, 1])
    b.output("output", ["N", c, size, size])
    b.output(means, ["T"])
    return b.build()


def scan_rnn_model(features: int = 16, hidden: int = 32, classes: int = 16, seed: int = 0) -> onnx.ModelProto:
    """A Scan over a sequence whose body is an RNN cell: h <- tanh(x_t W + h U + b).

    input [N,T,F] -> ``to_time`` (Transpose to [T,N,F]); ``h0`` = tanh(``init`` MatMul of the mean over
    time) -> Scan ``rnn`` (state ``h``, scan input ``x_t``): ``r_in`` = MatMul(x_t, ``rnn.W``),
    ``r_rec`` = MatMul(h, ``rnn.U``), Add ``r_sum``, Add ``r_bias``, Tanh ``r_tanh`` -> state ``h_next``
    and scan output ``y_t`` -> ``to_batch`` (Transpose to [N,T,H]) -> ``head`` MatMul -> output [N,T,K].
    """
    b = GraphBuilder("scan_rnn", seed)
    x = b.input("input", ["N", "T", features])
    seq = b.node("Transpose", [x], "seq", name="to_time", perm=[1, 0, 2])
    mean = b.node("ReduceMean", [x], "seq_mean", name="seq_mean", axes=[1], keepdims=0)
    h0 = b.node("Tanh", [b.linear(mean, features, hidden, "init", bias=False)], "h0", name="init_tanh")
    cell = GraphBuilder("rnn_body", seed + 1)
    a = cell.node("MatMul", ["x_t", cell.weight("rnn.W", [features, hidden])], name="r_in")
    r = cell.node("MatMul", ["h", cell.weight("rnn.U", [hidden, hidden], std=0.5 / math.sqrt(hidden))],
                  name="r_rec")
    s = cell.node("Add", [a, r], name="r_sum")
    bias = cell.const("rnn.b", (cell.rng.standard_normal(hidden) * 0.1).astype(np.float32))
    s = cell.node("Add", [s, bias], name="r_bias")
    cell.node("Tanh", [s], "h_next", name="r_tanh")
    cell.node("Identity", ["h_next"], "y_t", name="r_out")
    graph = helper.make_graph(
        cell.nodes, "rnn_body",
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", hidden]),
         helper.make_tensor_value_info("x_t", TensorProto.FLOAT, ["N", features])],
        [helper.make_tensor_value_info("h_next", TensorProto.FLOAT, ["N", hidden]),
         helper.make_tensor_value_info("y_t", TensorProto.FLOAT, ["N", hidden])], cell.initializers)
    _, ys = b.node("Scan", [h0, seq], ["h_last", "ys"], name="rnn", body=graph, num_scan_inputs=1)
    out = b.node("Transpose", [ys], "ys_batch", name="to_batch", perm=[1, 0, 2])
    b.node("MatMul", [out, b.weight("head.weight", [hidden, classes])], "output", name="head")
    b.output("output", ["N", "T", classes])
    return b.build()


def growing_loop_model(dim: int = 16, trips: int = 3, seed: int = 0) -> onnx.ModelProto:
    """A Loop whose carried tensor grows by one step per iteration (a decoder-like body), beside a
    quantizable main graph.

    input [N,4,D] -> ``proj`` MatMul -> Loop ``grow``: body(i, cond, h [N,t,D]): ``g_mm`` MatMul(h,
    ``grow.W``) -> ReduceMean over steps ``g_mean`` [N,1,D] -> Concat ``g_cat`` (h, mean) -> h_next
    [N,t+1,D] -> ``out_proj`` MatMul -> output [N,4+trips,D].
    """
    b = GraphBuilder("growing_loop", seed)
    x = b.input("input", ["N", 4, dim])
    h = b.linear(x, dim, dim, "proj", bias=False)
    b.const("trips", np.array(trips, np.int64))
    body = GraphBuilder("grow_body", seed + 1)
    y = body.node("MatMul", ["h", body.weight("grow.W", [dim, dim])], name="g_mm")
    m = body.node("ReduceMean", [y], name="g_mean", axes=[1], keepdims=1)
    body.node("Concat", ["h", m], "h_next", name="g_cat", axis=1)
    body.node("Identity", ["cond"], "cond_out", name="g_cond")
    graph = helper.make_graph(
        body.nodes, "grow_body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", None, dim])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_next", TensorProto.FLOAT, ["N", None, dim])], body.initializers)
    grown = b.node("Loop", ["trips", "", h], ["grown"], name="grow", body=graph)
    b.node("MatMul", [grown, b.weight("out_proj.weight", [dim, dim])], "output", name="out_proj")
    b.output("output", ["N", None, dim])
    return b.build()


# --------------------------------------------------------------------------- running
def random_inputs(model: onnx.ModelProto, num: int = 1, seed: int = 0) -> Dict[str, np.ndarray]:
    """Seeded float32 feeds for the model's real inputs (initializer-backed inputs are left out).

    Symbolic dimensions become 1; the first axis is multiplied by ``num``.
    """
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        dims = [d.dim_value if d.dim_value > 0 else 1 for d in inp.type.tensor_type.shape.dim]
        if dims:
            dims[0] *= num
        feeds[inp.name] = rng.standard_normal(dims).astype(np.float32)
    return feeds


def run(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> List[np.ndarray]:
    """Run ``model`` in onnxruntime (CPU, all graph optimizations off) and return its outputs."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_optimized(model: onnx.ModelProto, feeds: Dict[str, np.ndarray]) -> np.ndarray:
    """First output of ``model`` run as deployed: onnxruntime CPU, all graph optimizations on, 1 thread."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def optimized_ops(model, tmp_path) -> List[str]:
    """Op types of the graph onnxruntime's CPU provider actually runs (all optimizations on) for
    ``model`` (a ModelProto or a path), read from ``SessionOptions.optimized_model_filepath``."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node]


def assert_deployed_close(model: onnx.ModelProto, tensorrt_model: onnx.ModelProto, cpu_model: onnx.ModelProto,
                          feeds: Dict[str, np.ndarray], bound: float) -> None:
    """The ort-cpu model run as deployed (:func:`run_optimized`) differs from the tensorrt-form model
    in reference Q/DQ arithmetic (:func:`run`) by at most ``bound`` x that model's own max error versus
    the float ``model``, and agrees with it on top-1 for >= 99% of rows."""
    ref, got_trt = run(model, feeds)[0], run(tensorrt_model, feeds)[0]
    got_cpu = run_optimized(cpu_model, feeds)
    trt_error = np.abs(got_trt - ref).max()
    assert trt_error > 0
    assert np.abs(got_cpu - got_trt).max() <= bound * trt_error
    assert (got_cpu.argmax(1) == got_trt.argmax(1)).mean() >= 0.99


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two arrays, flattened."""
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def amax_table(model: onnx.ModelProto, feeds: Dict[str, np.ndarray], tensors: Optional[Iterable[str]] = None):
    """A max-calibrated ScaleTable: max |value| of every float tensor (or of ``tensors``) on ``feeds``.

    Computed with onnxruntime directly (independent of ``onnx_qat.calibrate``); non-finite values are
    ignored, and an all-zero tensor gets amax 1.0.
    """
    from onnx_qat.scales import ScaleTable

    inferred = onnx.shape_inference.infer_shapes(model)
    infos = list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in infos}
    inits = {i.name for i in model.graph.initializer}
    if tensors is None:
        names = [o for n in model.graph.node if n.op_type != "Constant" for o in n.output]
        names = [i.name for i in model.graph.input if i.name not in inits] + names
    else:
        names = list(tensors)
    names = [n for n in dict.fromkeys(names) if types.get(n) == TensorProto.FLOAT and n not in inits]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for n in names:
        if n not in existing:
            probe.graph.output.append(helper.make_tensor_value_info(n, TensorProto.FLOAT, None))
    outs = run(probe, feeds)
    by_name = dict(zip([o.name for o in probe.graph.output], outs))
    table = {}
    for n in names:
        vals = np.abs(by_name[n][np.isfinite(by_name[n])]) if n in by_name else np.zeros(0)
        table[n] = float(vals.max()) if vals.size and vals.max() > 0 else 1.0
    return ScaleTable(table, producer="tests.builders.amax_table")


def amax_table_each(model: onnx.ModelProto, feeds: Dict[str, np.ndarray],
                    tensors: Optional[Iterable[str]] = None):
    """`amax_table` of a model that takes batch 1: one run per sample, the largest amax of each tensor."""
    from onnx_qat.scales import ScaleTable

    count = len(next(iter(feeds.values())))
    tables = [amax_table(model, {k: v[i:i + 1] for k, v in feeds.items()}, tensors).activations
              for i in range(count)]
    return ScaleTable({n: max(t[n] for t in tables) for n in tables[0]}, producer="tests.builders.amax_table")


# --------------------------------------------------------------------------- graph queries
def _producers(model) -> Dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def _consumers(model) -> Dict[str, List[Tuple[onnx.NodeProto, int]]]:
    out = defaultdict(list)
    for n in model.graph.node:
        for i, t in enumerate(n.input):
            out[t].append((n, i))
    return out


def count_ops(model: onnx.ModelProto) -> Counter:
    """Op type -> number of nodes."""
    return Counter(n.op_type for n in model.graph.node)


def qdq_pairs(model: onnx.ModelProto) -> Dict[str, Tuple[Tuple[str, int], ...]]:
    """Activation Q/DQ pairs: quantized tensor -> sorted ``(consumer node, input index)`` pairs
    reading its DQ output.

    Only QuantizeLinear -> DequantizeLinear pairs count (weight DequantizeLinear nodes fed by int8
    initializers are reported by :func:`weight_dqs`).
    """
    prod = _producers(model)
    cons = _consumers(model)
    pairs: Dict[str, List[Tuple[str, int]]] = {}
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear":
            continue
        q = prod.get(n.input[0])
        if q is None or q.op_type != "QuantizeLinear":
            continue
        pairs.setdefault(q.input[0], []).extend((c.name, i) for c, i in cons.get(n.output[0], []))
    return {k: tuple(sorted(v)) for k, v in sorted(pairs.items())}


def weight_dqs(model: onnx.ModelProto) -> Dict[Tuple[str, int], dict]:
    """``(node, input index)`` -> ``{"initializer", "axis", "scale", "values"}`` for inputs fed by a
    DequantizeLinear of an int8 initializer."""
    inits = {i.name: i for i in model.graph.initializer}
    prod = _producers(model)
    out = {}
    for n in model.graph.node:
        for idx, t in enumerate(n.input):
            dq = prod.get(t)
            if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
            out[(n.name, idx)] = {
                "initializer": dq.input[0],
                "axis": attrs.get("axis", 1) if len(inits[dq.input[1]].dims) else None,
                "scale": numpy_helper.to_array(inits[dq.input[1]]),
                "values": numpy_helper.to_array(inits[dq.input[0]]),
            }
    return out


def describe(model: onnx.ModelProto, around: Iterable[str] = (), depth: int = 2) -> str:
    """A readable listing of the nodes within ``depth`` hops of the named tensors/nodes
    (all nodes if none)."""
    nodes = list(model.graph.node)
    around = set(around)
    if around:
        keep = set()
        frontier = set(around)
        for _ in range(depth + 1):
            hit = [n for n in nodes
                   if n.name in frontier or frontier & set(n.input) or frontier & set(n.output)]
            keep.update(id(n) for n in hit)
            frontier = {t for n in hit for t in list(n.input) + list(n.output)} | {n.name for n in hit}
        nodes = [n for n in nodes if id(n) in keep]
    lines = [f"  {n.name or '<unnamed>'} [{n.op_type}]: ({', '.join(n.input)}) -> ({', '.join(n.output)})"
             for n in nodes]
    return "subgraph:\n" + "\n".join(lines)


def _node(model, name: str) -> onnx.NodeProto:
    for n in model.graph.node:
        if n.name == name:
            return n
    raise AssertionError(f"no node named {name!r}\n{describe(model)}")


def _reads_dq_of(model, consumer: str, index: int) -> Optional[str]:
    """The tensor that reaches ``consumer`` input ``index`` through Q->DQ, or None."""
    prod = _producers(model)
    dq = prod.get(_node(model, consumer).input[index])
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    q = prod.get(dq.input[0])
    if q is not None and q.op_type == "QuantizeLinear":
        return q.input[0]
    return dq.input[0]


def assert_qdq_on(model: onnx.ModelProto, tensor: str, consumer: str, index: Optional[int] = None) -> None:
    """Assert ``consumer`` reads ``tensor`` through QuantizeLinear -> DequantizeLinear
    (at input ``index``, or at any input when None)."""
    node = _node(model, consumer)
    indexes = [index] if index is not None else range(len(node.input))
    if not any(_reads_dq_of(model, consumer, i) == tensor for i in indexes):
        raise AssertionError(f"expected Q/DQ on {tensor!r} feeding {consumer!r}\n"
                             f"{describe(model, [tensor, consumer])}")


def assert_no_qdq_on(model: onnx.ModelProto, tensor: str) -> None:
    """Assert no QuantizeLinear reads ``tensor``."""
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] == tensor:
            raise AssertionError(f"unexpected QuantizeLinear {n.name!r} on {tensor!r}\n"
                                 f"{describe(model, [tensor])}")


def assert_float_input(model: onnx.ModelProto, consumer: str, index: int) -> None:
    """Assert input ``index`` of ``consumer`` does not come from a DequantizeLinear."""
    if _reads_dq_of(model, consumer, index) is not None:
        raise AssertionError(f"input {index} of {consumer!r} is quantized but should stay float\n"
                             f"{describe(model, [consumer])}")


def assert_weight_quantized(model: onnx.ModelProto, node: str, index: int = 1,
                            axis: Optional[int] = 0) -> dict:
    """Assert ``node`` input ``index`` comes from DequantizeLinear(int8 initializer) with ``axis``
    (None = per-tensor); return the :func:`weight_dqs` entry."""
    info = weight_dqs(model).get((node, index))
    if info is None:
        raise AssertionError(f"weight input {index} of {node!r} is not an int8 DequantizeLinear\n"
                             f"{describe(model, [node])}")
    if info["values"].dtype != np.int8 or info["axis"] != axis:
        raise AssertionError(f"weight of {node!r}: dtype {info['values'].dtype}, axis {info['axis']} "
                             f"(expected int8, axis {axis})\n{describe(model, [node])}")
    return info


def assert_no_qdq(model: onnx.ModelProto) -> None:
    """Assert the model holds no QuantizeLinear/DequantizeLinear at all."""
    ops = count_ops(model)
    if ops["QuantizeLinear"] or ops["DequantizeLinear"]:
        raise AssertionError(f"model holds Q/DQ nodes\n{describe(model)}")


def outlier_channel_model(hot: str = "conv2", convs: int = 4, channels: int = 16, size: int = 8,
                          factor: float = 300.0, seed: int = 0) -> onnx.ModelProto:
    """A chain input [N, C, S, S] -> ``convs`` x (Conv ``conv{i}`` -> Relu ``relu{i}``) -> GlobalAveragePool
    ``gap`` -> Flatten ``flat`` -> Gemm ``fc`` -> ``output`` [N, 10], where one layer is made sensitive on
    purpose: channel 0 of the Conv before ``hot`` is scaled up by ``factor`` and ``hot``'s weights on that
    input channel down by it. The float function is unchanged (Relu commutes with a positive scale), but
    ``hot``'s per-tensor activation range is dominated by one outlier channel, so quantizing ``hot``'s
    input (and its weight, whose input-channel-0 entries become tiny) loses most of the others.
    ``hot`` is ``conv2`` .. ``conv{convs}``."""
    b = GraphBuilder("outlier_channel", seed)
    y = b.input("input", ["N", channels, size, size])
    for i in range(1, convs + 1):
        y = b.relu(b.conv(y, channels, channels, f"conv{i}"), f"relu{i}")
    y = b.node("Flatten", [b.node("GlobalAveragePool", [y], name="gap")], name="flat")
    w = b.const("fc.weight", (b.rng.standard_normal((channels, 10)) * 0.3).astype(np.float32))
    b.node("Gemm", [y, w], "output", name="fc")
    b.output("output")
    model = b.build()
    k = int(hot[len("conv"):])
    if not 2 <= k <= convs:
        raise ValueError(f"hot must be conv2..conv{convs}, got {hot!r}")
    inits = {t.name: t for t in model.graph.initializer}
    arrays = {n: numpy_helper.to_array(inits[n]).copy() for n in
              (f"conv{k - 1}.weight", f"conv{k - 1}.bias", f"{hot}.weight")}
    arrays[f"conv{k - 1}.weight"][0] *= factor
    arrays[f"conv{k - 1}.bias"][0] *= factor
    arrays[f"{hot}.weight"][:, 0] /= factor
    for name, array in arrays.items():
        inits[name].CopyFrom(numpy_helper.from_array(array.astype(np.float32), name))
    return model


def rare_outlier_model(hot: str = "conv3", data: Optional[Dict[str, np.ndarray]] = None, convs: int = 6,
                       factor: float = 1e4, tail: float = 2.5, seed: int = 3) -> onnx.ModelProto:
    """`outlier_channel_model` (``convs`` Conv-Relu layers) whose input to ``hot`` has *rare* outliers:
    channel 0 of the Conv before ``hot`` gets its bias lowered by its mean plus ``tail`` standard
    deviations on ``data`` (so that after the Relu it is zero but for about 1% of its values), then
    that channel is scaled up by ``factor`` and ``hot``'s weights on it down by it (the float function
    is unchanged). ``hot``'s ``max`` range is then set by a few values ``factor`` times larger than all
    others, which quantize to zero; clipping the rare ones (``percentile(99.9)``) loses little of the
    output, leaving ``hot`` in float loses nothing."""
    import onnxruntime as ort

    model = outlier_channel_model(hot, convs=convs, seed=seed, factor=1.0)
    k = int(hot[len("conv"):])
    before = f"conv{k - 1}"
    node = next(n for n in model.graph.node if n.name == before)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    pre = session.run([node.output[0]], data)[0][:, 0]
    inits = {t.name: t for t in model.graph.initializer}
    arrays = {n: numpy_helper.to_array(inits[n]).copy() for n in
              (f"{before}.weight", f"{before}.bias", f"{hot}.weight")}
    arrays[f"{before}.bias"][0] -= pre.mean() + tail * pre.std()
    arrays[f"{before}.weight"][0] *= factor
    arrays[f"{before}.bias"][0] *= factor
    arrays[f"{hot}.weight"][:, 0] /= factor
    for name, array in arrays.items():
        inits[name].CopyFrom(numpy_helper.from_array(array.astype(np.float32), name))
    return model


def assert_check_clean(model: onnx.ModelProto, target: Optional[str] = None) -> None:
    """Assert ``onnx_qat.check`` finds 0 errors AND 0 warnings in ``model`` (the rewriter's own
    output must pass its own check cleanly); on failure, print every finding and the subgraph
    around the nodes they name."""
    import onnx_qat

    report = onnx_qat.check(model, target=target)
    if report.errors or report.warnings:
        around = [f.node for f in report.findings if f.node]
        raise AssertionError(f"check is not clean: {report.summary()}\n{report}\n{describe(model, around)}")


def quantize_tensorrt_float32_weights(model, **kw):
    """``onnx_qat.quantize(model, target="tensorrt", **kw)`` with the weight scales the ``ort-cpu`` form
    uses, float32 ``amax / 127`` (the tensorrt target's own are FP16 values,
    `onnx_qat.formats.scale_grid.fp16_weight_scales`): for tests that compare the two forms weight for
    weight."""
    import dataclasses

    import pytest

    import onnx_qat
    from onnx_qat.insertion import targets

    plain = dataclasses.replace(targets.TENSORRT, weight_scale_grid=None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(targets._TARGETS, "tensorrt", plain)
        return onnx_qat.quantize(model, target="tensorrt", **kw)


def quantize_tensorrt_without_folds(model, **kw):
    """``onnx_qat.quantize(model, target="tensorrt", **kw)`` with the graph's per-channel Mul/Add after
    quantized convolutions kept (the tensorrt target folds them, rule TRT1,
    `onnx_qat.graph.scale_folds`): the form before that rule, for tests that compare the two."""
    import dataclasses

    import pytest

    import onnx_qat
    from onnx_qat.insertion import targets

    plain = dataclasses.replace(targets.TENSORRT, fold_scale_ops=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(targets._TARGETS, "tensorrt", plain)
        return onnx_qat.quantize(model, target="tensorrt", **kw)
