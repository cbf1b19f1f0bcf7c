"""Models that compute in FP16 (or BF16, double) in whole or in part: the index types the tensors no
declaration types by onnx type inference, so that no Q/DQ pair lands on a tensor that is not float32
(at opset 13 such a model is invalid), and a model with nothing left to quantize says why in one line."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

import onnx_qat
from onnx_qat.cli import main
from onnx_qat.errors import PlacementError
from onnx_qat.graph.index import GraphIndex
from tests import builders as B


def _in_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every float32 initializer, graph input and output in FP16 (value_info left
    undeclared, as converters often leave it)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for t in model.graph.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    for v in list(model.graph.input) + list(model.graph.output):
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    del model.graph.value_info[:]
    return model


def _cnn() -> onnx.ModelProto:
    b = B.GraphBuilder("cnn", 0)
    x = b.input("input", ["N", 16, 8, 8])
    y = b.relu(b.conv(x, 16, 32, "c1"), "r1")
    y = b.relu(b.conv(y, 32, 32, "c2"), "r2")
    y = b.node("Flatten", [b.node("GlobalAveragePool", [y], name="gap")], name="flat")
    b.linear(y, 32, 10, "fc")
    b.nodes[-1].output[0] = "output"
    b.output("output")
    return b.build()


def _mixed() -> onnx.ModelProto:
    """FP32 input -> ``c1`` -> ``r1`` -> Cast to FP16 -> ``c2`` (FP16 weight) -> ``r2`` -> AveragePool (FP16)
    -> Cast to FP32 -> GlobalAveragePool -> Flatten -> ``fc`` -> output: FP32 around an FP16 middle, no
    value_info (as mixed-precision converters write it)."""
    b = B.GraphBuilder("mixed", 1)
    x = b.input("input", ["N", 16, 8, 8])
    y = b.relu(b.conv(x, 16, 32, "c1"), "r1")
    y = b.node("Cast", [y], name="to_half", to=TensorProto.FLOAT16)
    w = numpy_helper.from_array((np.random.default_rng(2).standard_normal((32, 32, 3, 3)) * 0.08)
                                .astype(np.float16), "c2.weight")
    b.initializers.append(w)
    y = b.relu(b.node("Conv", [y, "c2.weight"], name="c2", pads=[1, 1, 1, 1], kernel_shape=[3, 3]), "r2")
    y = b.node("AveragePool", [y], name="pool", kernel_shape=[2, 2], strides=[2, 2])
    y = b.node("Cast", [y], name="to_float", to=TensorProto.FLOAT)
    y = b.node("Flatten", [b.node("GlobalAveragePool", [y], name="gap")], name="flat")
    b.linear(y, 32, 10, "fc")
    b.nodes[-1].output[0] = "output"
    b.output("output")
    model = b.build()
    del model.graph.value_info[:]
    return model


def _data(seed: int, dtype=np.float32, scale: float = 1.0):
    return {"input": (np.random.default_rng(seed).standard_normal((8, 16, 8, 8)) * scale).astype(dtype)}


def test_undeclared_tensors_of_an_fp16_model_are_typed_by_inference():
    model = _in_fp16(_cnn())
    index = GraphIndex(model)
    assert index.declared_dtypes["r1_out"] == TensorProto.FLOAT16
    assert not index.is_float_or_unknown("r1_out")
    plain = GraphIndex(_cnn())  # float32 models: declarations only, no inference run
    assert "r1_out" not in plain.declared_dtypes and plain.is_float_or_unknown("r1_out")


@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_a_mixed_model_quantizes_its_fp32_part_only(tmp_path, scale):
    """Before: the FP16 middle's tensors had no declared type, so rules that quantize an input (here the
    AveragePool's, behind the FP16 Conv) put a Q/DQ pair on an FP16 tensor: onnxruntime refused the
    model ("Type 'tensor(float16)' ... of operator (QuantizeLinear) is invalid"). Now only the FP32
    ops are quantized, and the result runs, passes its own check and tracks the float model."""
    model = _mixed()
    data = _data(3, scale=scale)
    result = onnx_qat.quantize(model, data=data, method="max", progress=False)
    weights = {w.node for w in result.placement.weights}
    assert weights == {"c1", "fc"}
    decisions = {d.node: d for d in result.placement.decisions}
    assert decisions["c2"].action == "skip" and "not float32" in decisions["c2"].reason
    producer = {o: n for n in result.model.graph.node for o in n.output}
    for node in result.model.graph.node:
        if node.op_type == "QuantizeLinear":
            made = producer.get(node.input[0])
            assert made is None or made.op_type not in ("Relu", "AveragePool") or made.name == "r1", made.name
    B.assert_check_clean(result.model)
    feeds = {"input": data["input"][:4]}
    assert B.cosine(B.run(model, feeds)[0], B.run(result.model, feeds)[0]) > 0.99


def test_a_model_all_in_fp16_is_refused_in_one_line(tmp_path, capsys):
    model = _in_fp16(_cnn())
    with pytest.raises(PlacementError, match="another float type than float32.*quantizes float32 models: "
                                             "give the model's FP32 form"):
        onnx_qat.quantize(model, data=_data(4, np.float16), method="max", progress=False)
    src, data, out = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(model, str(src))
    np.savez(data, **_data(4, np.float16))
    assert main(["quantize", str(src), "--data", str(data), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--float-dtype fp16" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
