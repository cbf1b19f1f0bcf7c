"""``auto``'s judgement computes the constant weight DequantizeLinear of its Q/DQ model once
(`onnx_qat.calibration.choice._fold_dequantize_edits`; `fold_constant_dequantize` here runs it on a
committed model): the folded weights are onnxruntime's
DequantizeLinear outputs bit for bit, and the judged cosines those of the model with every
DequantizeLinear left in to about 1e-10 (a constant weight lets onnxruntime pre-pack it for its
convolution kernels, which sum in another order), with the same table kept, across targets, formats
and models."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.calibration import choice
from onnx_qat.runtime.sessions import make_session
from tests import builders


def fold_constant_dequantize(model: onnx.ModelProto) -> None:
    """`choice._fold_dequantize_edits` on ``model``'s main graph, in place (the folded nodes, integer
    weights, scales and zero points nothing else reads are left out)."""
    from onnx_qat.graph.edit import GraphEdit

    edit = GraphEdit(model)
    choice._fold_dequantize_edits(edit, edit.live_nodes())
    model.CopyFrom(edit.commit())


def _judged(monkeypatch, model, data, fold: bool, **options):
    seen = []
    real_choose = choice.choose

    def recording(*args, **kwargs):
        seen.append(real_choose(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(choice, "choose", recording)
    if not fold:  # every weight's DequantizeLinear left in the judged model
        monkeypatch.setattr(choice, "_fold_dequantize_edits", lambda edit, nodes: None)
        monkeypatch.setattr(choice, "_dequantized_weights", lambda *args: {})
    onnx_qat.quantize(model, data=data, method="auto", progress=False, **options)
    monkeypatch.undo()
    assert len(seen) == 1
    return seen[0]


CASES = [
    ("residual", lambda: builders.residual_block_model(projection=True), {}),
    ("mobilenet", lambda: builders.mobilenet_v2_model(size=16, batch=1), {}),
    ("mobilenet-cpu", lambda: builders.mobilenet_v2_model(size=16, batch=1), {"target": "ort-cpu"}),
    ("mlp", lambda: builders.mlp_model(), {}),
    ("transformer", lambda: builders.transformer_block_model(), {}),
    ("conv-fp8", lambda: builders.conv_bn_relu_model(), {"precision": "fp8"}),
    ("residual-chain", lambda: builders.residual_chain_model(40), {}),
]


@pytest.mark.parametrize("name,build,options", CASES, ids=[c[0] for c in CASES])
def test_folded_weights_judge_the_same_numbers(monkeypatch, name, build, options):
    model = build()
    data = builders.random_inputs(model, num=12, seed=3)
    best, cosines, note = _judged(monkeypatch, model, data, True, **options)
    expected_best, expected, _ = _judged(monkeypatch, model, data, False, **options)
    assert cosines.keys() == expected.keys()
    for table, cosine in cosines.items():
        assert cosine == pytest.approx(expected[table], abs=1e-8)
    assert best == expected_best
    assert set(cosines) == {"max", "tensor"} and note == ""  # 12 samples: the paired rule decides


def test_folding_computes_dequantize_as_onnxruntime_does():
    """Per-tensor and per-axis int8 and uint8 weights with zero points: the folded initializer is
    onnxruntime's DequantizeLinear output bit for bit."""
    rng = np.random.default_rng(0)
    h = onnx.helper
    weights = [
        ("w0", rng.integers(-127, 128, (8, 4, 3, 3)).astype(np.int8), np.float32(0.0123), np.int8(0), 0),
        ("w1", rng.integers(-127, 128, (8, 4, 3, 3)).astype(np.int8),
         rng.uniform(1e-4, 1e-1, 8).astype(np.float32), np.zeros(8, np.int8), 0),
        ("w2", rng.integers(0, 256, (16, 5)).astype(np.uint8), rng.uniform(1e-3, 1, 5).astype(np.float32),
         rng.integers(0, 256, 5).astype(np.uint8), 1),
    ]
    nodes, inits, outputs = [], [], []
    for name, values, scale, zero, axis in weights:
        array = onnx.numpy_helper.from_array
        inits += [array(values, name), array(scale, name + "_s"), array(zero, name + "_z")]
        nodes.append(h.make_node("DequantizeLinear", [name, name + "_s", name + "_z"], [name + "_dq"],
                                 axis=axis, name=name + "_node"))
        nodes.append(h.make_node("Identity", [name + "_dq"], [name + "_out"]))
        outputs.append(h.make_tensor_value_info(name + "_out", onnx.TensorProto.FLOAT, None))
    model = h.make_model(h.make_graph(nodes, "g", [], outputs, inits), opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    expected = make_session(model, optimize=False).run(None, {})
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    fold_constant_dequantize(folded)
    assert [n.op_type for n in folded.graph.node] == ["Identity"] * 3
    got = make_session(folded, optimize=False).run(None, {})
    for want, have in zip(expected, got):
        assert have.dtype == np.float32
        np.testing.assert_array_equal(have, want)


@pytest.mark.parametrize("tensor", [
    onnx.helper.make_tensor("s", onnx.TensorProto.FLOAT, [], [0.1234567]),
    onnx.helper.make_tensor("v", onnx.TensorProto.FLOAT, [3], [1e-30, 2.5, -3.0]),
    onnx.helper.make_tensor("i8", onnx.TensorProto.INT8, [2], [-128, 127]),
    onnx.helper.make_tensor("u8", onnx.TensorProto.UINT8, [], [200]),
    onnx.numpy_helper.from_array(np.arange(-3, 3, dtype=np.int8).reshape(2, 3), "raw"),
], ids=["float-scalar", "float-vector", "int8-field", "uint8-scalar", "int8-raw"])
def test_initializer_values_read_as_onnx_reads_them(tensor):
    """The folding reads scales and zero points with `tensor_array`, from their float/int32 fields
    directly: the values, dtype and shape of onnx.numpy_helper."""
    from onnx_qat.io.models import tensor_array

    got, expected = tensor_array(tensor), onnx.numpy_helper.to_array(tensor)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
