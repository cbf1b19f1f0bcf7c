"""Seeded random CNNs composed from building blocks: the rules must hold in every combination."""
import numpy as np
import pytest

import onnx_qat
from tests.builders import (
    GraphBuilder, amax_table, assert_check_clean, cosine, count_ops, describe, random_inputs, run,
)

C = 16


def _conv_bn_relu(b, t, i):
    return b.relu(b.bn(b.conv(t, C, C, f"cbr{i}_conv"), C, f"cbr{i}_bn"), f"cbr{i}_relu")


def _residual(b, t, i):
    y = b.relu(b.bn(b.conv(t, C, C, f"res{i}_conv1"), C, f"res{i}_bn1"), f"res{i}_relu1")
    y = b.bn(b.conv(y, C, C, f"res{i}_conv2"), C, f"res{i}_bn2")
    return b.relu(b.node("Add", [y, t], name=f"res{i}_add"), f"res{i}_relu")


def _projection(b, t, i):
    y = b.relu(b.conv(t, C, C, f"proj{i}_conv1"), f"proj{i}_relu1")
    y = b.conv(y, C, C, f"proj{i}_conv2")
    s = b.conv(t, C, C, f"proj{i}_short", k=1)
    return b.relu(b.node("Add", [s, y], name=f"proj{i}_add"), f"proj{i}_relu")


def _concat(b, t, i):
    a = b.relu(b.conv(t, C, C // 2, f"cat{i}_a", k=1), f"cat{i}_a_relu")
    p = b.node("MaxPool", [t], name=f"cat{i}_pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    p = b.conv(p, C, C // 2, f"cat{i}_b", k=1)
    c = b.node("Concat", [a, p], name=f"cat{i}_concat", axis=1)
    return b.relu(b.conv(c, C, C, f"cat{i}_mix", k=1), f"cat{i}_mix_relu")


def _pad_conv(b, t, i):
    pads = b.const(f"pad{i}_pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    p = b.node("Pad", [t, pads], name=f"pad{i}_pad")
    return b.relu(b.conv(p, C, C, f"pad{i}_conv", pad=0), f"pad{i}_relu")


def _avgpool(b, t, i):
    return b.node("AveragePool", [t], name=f"avg{i}_pool", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                  count_include_pad=1)


def _silu(b, t, i):
    y = b.conv(t, C, C, f"silu{i}_conv")
    return b.node("Mul", [y, b.node("Sigmoid", [y], name=f"silu{i}_sigmoid")], name=f"silu{i}_mul")


def _depthwise(b, t, i):
    return b.relu(b.bn(b.conv(t, C, C, f"dw{i}_conv", group=C), C, f"dw{i}_bn"), f"dw{i}_relu")


BLOCKS = [_conv_bn_relu, _residual, _projection, _concat, _pad_conv, _avgpool, _silu, _depthwise]


def random_cnn(seed: int):
    rng = np.random.default_rng(seed)
    b = GraphBuilder(f"random_{seed}", seed=seed)
    t = b.relu(b.conv(b.input("input", [1, C, 8, 8]), C, C, "stem"), "stem_relu")
    for i, k in enumerate(rng.integers(0, len(BLOCKS), size=5)):
        t = BLOCKS[k](b, t, i)
    t = b.node("GlobalAveragePool", [t], name="gap")
    t = b.node("Flatten", [t], name="flatten", axis=1)
    b.node("Gemm", [t, b.weight("fc.weight", [10, C])], "output", name="fc", transB=1)
    b.output("output")
    return b.build()


def _invariants(model):
    prod = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name for i in model.graph.initializer}

    def from_dq(tensor):
        node = prod.get(tensor)
        return node is not None and node.op_type == "DequantizeLinear"

    for n in model.graph.node:
        if n.op_type in ("Conv", "Gemm"):
            act = n.input[0]
            if prod.get(act) is not None and prod[act].op_type == "Pad":  # rule 8: Q/DQ before the Pad
                act = prod[act].input[0]
                assert from_dq(act), describe(model, [n.name])
            else:
                assert from_dq(act), describe(model, [n.name])
            assert from_dq(n.input[1]) and prod[n.input[1]].input[0] in inits, describe(model, [n.name])
        if n.op_type == "Add":
            assert sum(from_dq(t) for t in n.input) == 1, describe(model, [n.name])  # rule 6
        if n.op_type in ("BatchNormalization", "Relu", "Sigmoid", "MaxPool", "Pad"):
            assert not from_dq(n.input[0]) or n.op_type == "Pad", describe(model, [n.name])  # rules 5, 8
    q_inputs = [n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert len(q_inputs) == len(set(q_inputs))  # rule 10


@pytest.mark.parametrize("seed", range(8))
def test_random_cnn_keeps_every_rule(seed):
    model = random_cnn(seed)
    table = amax_table(model, random_inputs(model, seed=seed))
    result = onnx_qat.quantize(model, scales=table, progress=False)
    assert_check_clean(result.model)
    _invariants(result.model)
    assert count_ops(result.model)["QuantizeLinear"] == len(result.placement.activations)
    feeds = random_inputs(model, seed=seed + 100)
    assert cosine(run(model, feeds)[0], run(result.model, feeds)[0]) > 0.98
