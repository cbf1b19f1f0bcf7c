"""Rule TRT1: in the ``tensorrt`` form a per-channel constant Mul/Add after a quantized Conv or ConvTranspose
(an unfolded batch normalization, as the Keras export writes it) is folded into the convolution's float
weight and bias before calibration and quantization (`onnx_qat.graph.scale_folds`)."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnx_qat
from onnx_qat.graph.index import GraphIndex
from onnx_qat.graph.scale_folds import find_scale_folds, fold_scale_ops
from onnx_qat.scales import ScaleTable
from tests import builders as B

C = 16
#: The scale ops every fold of `bn_chain_net` removes.
SCALE_OPS = {"mul1", "add1", "mul2", "add2", "tmul", "add3", "k2_const"}


def _factors(rng, channels, scale=1.0):
    k = (rng.uniform(0.3, 1.7, channels) * scale).astype(np.float32)
    k[1], k[4] = -0.6 * scale, -1.4 * scale  # negative factors flip the weight's sign
    return k


def bn_chain_net(seed: int = 0, scale: float = 1.0) -> onnx.ModelProto:
    """input [2,8,12,12] -> c1 (bias) -> mul1 (k [1,C,1,1]) -> add1 (b first) -> r1 -> c2 (no bias) ->
    mul2 (k [C,1,1] from a Constant, k first) -> add2 -> r2 -> ct (ConvTranspose, group 2, stride 2) ->
    tmul (a scalar) -> r3 -> c3 (bias) -> add3 (an Add alone) -> gap -> flat -> fc -> output.
    ``scale``: the factors' size (an input scale users vary: BatchNorm factors from tiny to large)."""
    b = B.GraphBuilder("bn_chain", seed)
    x = b.input("input", [2, 8, 12, 12])
    y = b.conv(x, 8, C, "c1", bias=True)
    y = b.node("Mul", [y, b.const("k1", _factors(b.rng, C, scale).reshape(1, C, 1, 1))], name="mul1")
    y = b.node("Add", [b.const("b1", (b.rng.standard_normal((1, C, 1, 1)) * 0.1).astype(np.float32)), y],
               name="add1")
    y = b.relu(y, "r1")
    y = b.conv(y, C, C, "c2", bias=False)
    k2 = b.node("Constant", [], ["k2"], name="k2_const",
                value=numpy_helper.from_array(_factors(b.rng, C, scale).reshape(C, 1, 1), "k2"))
    y = b.node("Mul", [k2, y], name="mul2")
    y = b.node("Add", [y, b.const("b2", (b.rng.standard_normal((C, 1, 1)) * 0.1).astype(np.float32))],
               name="add2")
    y = b.relu(y, "r2")
    w = b.weight("ct.weight", [C, C // 2, 2, 2])  # [C_in, C_out / group, kH, kW], group 2: C_out = C
    y = b.node("ConvTranspose", [y, w, b.const("ct.bias", np.full(C, 0.05, np.float32))], name="ct",
               strides=[2, 2], group=2)
    y = b.node("Mul", [y, b.const("tk", np.array(0.75 * scale, np.float32))], name="tmul")
    y = b.relu(y, "r3")
    y = b.conv(y, C, C, "c3", bias=True)
    y = b.node("Add", [y, b.const("b3", (b.rng.standard_normal((1, C, 1, 1)) * 0.1).astype(np.float32))],
               name="add3")
    y = b.node("GlobalAveragePool", [y], name="gap")
    y = b.node("Flatten", [y], name="flat")
    y = b.linear(y, C, 10, "fc")
    b.nodes[-1].output[0] = "output"
    b.output("output")
    return b.build()


def _folded_float(model: onnx.ModelProto, convs=("c1", "c2", "ct", "c3")) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    index = GraphIndex(copy)
    fold_scale_ops(copy, index, find_scale_folds(index, convs))
    onnx.checker.check_model(copy)
    return copy


def _feeds(model, seed, num=4):
    return B.random_inputs(model, num=num, seed=seed)


def _run_each(model, feeds):
    """The output on each 2-row slice of ``feeds`` (the model's batch is 2), stacked."""
    x = feeds["input"]
    return np.concatenate([B.run(model, {"input": x[i:i + 2]})[0] for i in range(0, len(x), 2)])


@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0])
@pytest.mark.parametrize("seed", [0, 3])
def test_folded_float_model_computes_the_same_function(seed, scale):
    """The graph with its scale ops folded (not quantized) against the original, in onnxruntime: equal up to
    float32 rounding, for factors from 1e-3 to 40, with negative factors, a Constant factor, a
    ConvTranspose of 2 groups, a scalar factor and an Add alone."""
    model = bn_chain_net(seed, scale)
    folded = _folded_float(model)
    assert not SCALE_OPS & {n.name for n in folded.graph.node}
    assert [o.name for o in folded.graph.output] == ["output"]
    feeds = _feeds(model, seed + 1)
    ref, got = _run_each(model, feeds), _run_each(folded, feeds)
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()
    assert {n.output[0] for n in folded.graph.node if n.name in ("c1", "c2", "ct", "c3")} == \
        {"add1_out", "add2_out", "tmul_out", "add3_out"}  # the last folded op's output names


def test_conv_transpose_groups_scale_their_own_columns():
    """ConvTranspose with 2 groups: output channel c is column c mod 8 of group c div 8 of the weight."""
    model = bn_chain_net()
    index = GraphIndex(model)
    fold = {f.node: f for f in find_scale_folds(index, ["ct"])}["ct"]
    assert fold.op_types == ("Mul",) and np.allclose(fold.k, 0.75) and fold.k.size == C
    k = np.arange(1, C + 1, dtype=np.float32)
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    index = GraphIndex(copy)
    fold_scale_ops(copy, index, [type(fold)(fold.node, fold.op_type, fold.weight, fold.ops, fold.op_types,
                                            fold.removed, fold.output, k, np.zeros(C, np.float32))])
    before = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "ct.weight"))
    after = numpy_helper.to_array(next(i for i in copy.graph.initializer if i.name == "ct.weight"))
    for c in range(C):
        group, column = divmod(c, C // 2)
        rows = slice(group * (C // 2), (group + 1) * (C // 2))
        assert np.allclose(after[rows, column], before[rows, column] * k[c])


@pytest.fixture(scope="module")
def quantized():
    model = bn_chain_net()
    original = model.SerializeToString()
    feeds = _feeds(model, 1)
    result = onnx_qat.quantize(model, data=feeds, progress=False)
    assert model.SerializeToString() == original  # the caller's model is never changed
    return model, feeds, result


def test_each_fold_is_reported(quantized):
    _, _, result = quantized
    folds = {r["node"]: r for r in result.scale_folds}
    assert sorted(folds) == ["c1", "c2", "c3", "ct"]
    assert folds["c1"]["folded"] == ["mul1", "add1"] and folds["c1"]["output"] == "add1_out"
    assert folds["c2"]["negative_k"] == 2 and folds["ct"]["op_type"] == "ConvTranspose"
    assert folds["c3"]["folded_op_types"] == ["Add"]
    assert all(r["rule"] == "TRT1" for r in result.scale_folds)
    report = result.to_report()
    assert [r["node"] for r in report["scale_folds"]] == ["c1", "c2", "ct", "c3"]
    assert any("rule TRT1" in n for n in report["notes"])
    assert "4 Conv scale folds" in str(result)
    assert not SCALE_OPS & {n.name for n in result.model.graph.node}
    assert result.summary["nodes"] == len(quantized[0].graph.node) - len(SCALE_OPS)


def test_end_to_end_output_and_check(quantized):
    """The folded Q/DQ model passes check with 0 errors and 0 warnings, keeps the float model's output
    names, and is as close to the float model as the Q/DQ model of the unfolded graph."""
    model, feeds, result = quantized
    B.assert_check_clean(result.model)
    evaluation = _feeds(model, 7)
    ref = _run_each(model, evaluation)
    folded_cos = B.cosine(ref, _run_each(result.model, evaluation))
    plain = B.quantize_tensorrt_without_folds(model, data=feeds, progress=False)
    assert plain.scale_folds == () and {"mul1", "add3"} <= {n.name for n in plain.model.graph.node}
    plain_cos = B.cosine(ref, _run_each(plain.model, evaluation))
    assert folded_cos > 0.999 and abs(folded_cos - plain_cos) < 0.002, (folded_cos, plain_cos)


def test_weight_scales_hold_the_factor(quantized):
    """The folded Conv's weight DequantizeLinear reconstructs ``k[c] * w[c]``: the scale absorbs |k| (on
    the FP16 grid) and the integers take the sign of k."""
    model, _, result = quantized
    w = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "c1.weight"))
    k = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "k1")).reshape(-1)
    found = B.weight_dqs(result.model)[("c1", 1)]
    q, scale = found["values"], found["scale"]
    assert found["axis"] == 0 and np.all(scale.astype(np.float16).astype(np.float32) == scale)  # FP16 values
    target = w.astype(np.float64) * k.reshape(-1, 1, 1, 1)
    step = scale.astype(np.float64).reshape(-1, 1, 1, 1)
    assert np.all(np.abs(q * step - target) <= 0.51 * step)
    assert np.array_equal(np.abs(target).reshape(C, -1).max(1) > 126 * step.ravel(), np.ones(C, bool))
    large = np.abs(w[1]) * abs(k[1]) > scale[1]
    assert k[1] < 0 and np.all(np.sign(q[1][large]) == -np.sign(w[1][large]))


@pytest.mark.parametrize("float_dtype", ["fp32", "fp16"])
def test_one_form_for_every_float_dtype(float_dtype, quantized):
    model, feeds, fp32 = quantized
    result = fp32 if float_dtype == "fp32" else onnx_qat.quantize(model, data=feeds, progress=False,
                                                                   float_dtype=float_dtype)
    assert [r["node"] for r in result.scale_folds] == ["c1", "c2", "ct", "c3"]
    B.assert_check_clean(result.model)


def test_ort_cpu_form_folds_its_own_way(quantized):
    model, feeds, _ = quantized
    cpu = onnx_qat.quantize(model, data=feeds, target="ort-cpu", progress=False)
    assert cpu.scale_folds == ()
    assert {r["node"] for r in cpu.requantization if r["rule"] == "CPU2"} == {"c1", "c2"}


def test_given_placement_from_place_gives_the_same_model(quantized):
    model, feeds, result = quantized
    again = onnx_qat.quantize(model, data=feeds, placement=onnx_qat.place(model), progress=False)
    assert again.model.SerializeToString() == result.model.SerializeToString()


def test_a_given_weight_range_keeps_that_conv_unfolded(quantized, caplog):
    """A ScaleTable range for a weight (a Keras QAT model's trained range) describes the weight as it is:
    that Conv keeps its Mul/Add (the Keras model computes conv(x, q(w)) * k), the others fold."""
    model, feeds, _ = quantized
    table = onnx_qat.calibrate(model, feeds, progress=False)
    w = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "c2.weight"))
    amax = np.abs(w).reshape(C, -1).max(1)
    given = table.merged(ScaleTable(weights={"c2.weight": {"axis": 0, "amax": amax.tolist()}}))
    with caplog.at_level(logging.WARNING, logger="onnx_qat"):
        result = onnx_qat.quantize(model, scales=given, progress=False)
    assert not caplog.records
    assert sorted(r["node"] for r in result.scale_folds) == ["c1", "c3", "ct"]
    assert {"mul2", "add2"} <= {n.name for n in result.model.graph.node}
    scale = B.weight_dqs(result.model)[("c2", 1)]["scale"]
    assert np.allclose(scale, amax / 127, rtol=2 ** -10)  # the given range, not the folded weight's
    B.assert_check_clean(result.model)


def test_ranges_of_removed_tensors_are_accepted_silently(quantized, caplog):
    """A ScaleTable (or TensorRT cache) made on the float model may name the tensors a fold removes (every
    Conv output here): they are neither refused nor reported as unmatched, and not used."""
    model, feeds, result = quantized
    removed = ["c1_out", "mul1_out", "c2_out", "mul2_out", "ct_out", "c3_out"]
    tensors = onnx_qat.place(model).activation_tensors() + tuple(removed)
    table = onnx_qat.calibrate(model, feeds, progress=False, tensors=tensors)
    assert set(removed) <= set(table.activations)
    with caplog.at_level(logging.WARNING, logger="onnx_qat"):
        from_table = onnx_qat.quantize(model, scales=table, progress=False)
    assert not caplog.records
    assert not set(removed) & set(from_table.scales.activations)
    assert len(from_table.scale_folds) == 4
    B.assert_check_clean(from_table.model)


def test_ranges_of_removed_tensors_in_a_tensorrt_cache(quantized, tmp_path, caplog):
    model, feeds, _ = quantized
    tensors = onnx_qat.place(model).activation_tensors() + ("c1_out", "mul1_out")
    table = onnx_qat.calibrate(model, feeds, progress=False, tensors=tensors)
    cache = tmp_path / "calib.cache"
    table.save_tensorrt_cache(cache, tensorrt_version="10.1.0")
    with caplog.at_level(logging.WARNING, logger="onnx_qat"):
        result = onnx_qat.quantize(model, scales=str(cache), progress=False)
    assert not [r for r in caplog.records if "not in the model" in r.getMessage()], caplog.text
    assert len(result.scale_folds) == 4


def _chain(variant: str) -> onnx.ModelProto:
    """input -> c1 -> Mul -> Add -> Relu -> c2 -> output, with one thing that rules the fold out."""
    b = B.GraphBuilder("no_fold", 0)
    x = b.input("input", [1, 8, 6, C])
    y = b.conv(x, 8, C, "c1")
    k = b.rng.uniform(0.5, 1.5, C).astype(np.float32)
    factor = b.const("k", k.reshape(1, C, 1, 1))
    if variant == "activation":
        factor = b.node("Sigmoid", [y], name="gate")
    elif variant == "last-axis":
        factor = b.const("k_last", k)
    elif variant == "zero":
        factor = b.const("k_zero", np.where(np.arange(C) == 3, 0, k).astype(np.float32).reshape(1, C, 1, 1))
    elif variant == "two-readers":
        b.output(b.node("Relu", [y], name="tap"))
    elif variant == "graph-output":
        b.output(y)
    y = b.node("Mul", [y, factor], name="mul")
    y = b.node("Add", [y, b.const("b", np.zeros((1, C, 1, 1), np.float32))], name="add")
    y = b.relu(y, "r")
    b.conv(y, C, 8, "c2")
    b.nodes[-1].output[0] = "output"
    b.output("output")
    return b.build()


@pytest.mark.parametrize("variant", ["activation", "last-axis", "zero", "two-readers", "graph-output"])
def test_no_fold_where_something_else_sees_the_tensors(variant):
    """A gate (Mul by an activation), a ``[C]`` vector (ONNX broadcasting puts it on the last axis), a zero
    factor, a Conv output read twice or a graph output: nothing folds, the graph keeps its Mul/Add."""
    model = _chain(variant)
    feeds = B.random_inputs(model, num=2, seed=1)
    result = onnx_qat.quantize(model, data=feeds, progress=False)
    assert result.scale_folds == ()
    assert {"mul", "add"} <= {n.name for n in result.model.graph.node}
    B.assert_check_clean(result.model)


def test_excluded_conv_is_not_folded():
    """Only convolutions the placement quantizes fold: an excluded Conv keeps its Mul/Add (float there,
    the graph is left as exported)."""
    model = bn_chain_net()
    feeds = _feeds(model, 1)
    result = onnx_qat.quantize(model, data=feeds, exclude_nodes=["c1"], progress=False)
    assert "c1" not in {r["node"] for r in result.scale_folds}
    assert {"mul1", "add1"} <= {n.name for n in result.model.graph.node}
    B.assert_check_clean(result.model)


def test_shared_bias_gets_a_bias_of_its_own():
    """Two Convs reading one bias initializer: the folded one gets ``<conv>_folded_bias``, the other keeps
    the shared values."""
    model = bn_chain_net()
    c3 = next(n for n in model.graph.node if n.name == "c3")
    c1 = next(n for n in model.graph.node if n.name == "c1")
    shared = c1.input[2]
    c3.input[2] = shared
    model.graph.initializer.remove(next(i for i in model.graph.initializer if i.name == "c3.bias"))
    folded = _folded_float(model, convs=("c1",))
    names = {i.name: numpy_helper.to_array(i) for i in folded.graph.initializer}
    assert next(n for n in folded.graph.node if n.name == "c1").input[2] == "c1_folded_bias"
    assert np.array_equal(names[shared], numpy_helper.to_array(
        next(i for i in model.graph.initializer if i.name == shared)))
    feeds = _feeds(model, 2)
    ref, got = _run_each(model, feeds), _run_each(folded, feeds)
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()


def test_fold_keeps_helper_names_unique():
    """A name ``<conv>_folded_bias`` the model already has is not reused."""
    model = bn_chain_net()
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(1, np.float32), "c2_folded_bias"))
    model.graph.node.append(helper.make_node("Identity", ["c2_folded_bias"], ["unused"], name="keep"))
    folded = _folded_float(model, convs=("c2",))
    assert next(n for n in folded.graph.node if n.name == "c2").input[2] == "c2_folded_bias_1"


def test_command_line_says_what_was_folded(tmp_path, capsys):
    """``onnx-qat quantize`` prints one line for the folds, and ``--report`` lists each of them."""
    import json

    from onnx_qat.cli import main

    model = bn_chain_net()
    path, data, out, report = (tmp_path / "bn.onnx", tmp_path / "calib.npz", tmp_path / "q.onnx",
                               tmp_path / "report.json")
    onnx.save(model, str(path))
    np.savez(data, **_feeds(model, 1, num=1))
    assert main(["quantize", str(path), "-o", str(out), "--data", str(data), "--method", "max",
                 "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "folded 6 per-channel Mul/Add nodes into the weights and biases of 4 convolutions" in printed
    assert "| 0 errors, 0 warnings |" in printed and "check: PASSED" in printed, printed
    folds = json.loads(report.read_text())["scale_folds"]
    assert [f["node"] for f in folds] == ["c1", "c2", "ct", "c3"]
    assert not SCALE_OPS & {n.name for n in onnx.load(str(out)).graph.node}


def test_no_fold_that_would_put_the_weight_scales_below_fp16():
    """A factor of 1e-6 (a batch normalization over huge activations: the first Conv of an untrained Keras
    ResNet50 fed 0..255) would make every weight scale of c1 about 1e-8, below FP16's precision, so FP16
    float parts would keep c1 FP32: that fold is left out, with a note; the others fold; FP16 parts keep
    nothing FP32."""
    model = bn_chain_net()
    k1 = next(i for i in model.graph.initializer if i.name == "k1")
    k1.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(k1) * np.float32(1e-6), "k1"))
    feeds = _feeds(model, 1)
    result = onnx_qat.quantize(model, data=feeds, progress=False)
    assert sorted(r["node"] for r in result.scale_folds) == ["c2", "c3", "ct"]
    assert any("keep their per-channel Mul/Add (e.g. 'c1')" in n for n in result.placement.notes)
    assert {"mul1", "add1"} <= {n.name for n in result.model.graph.node}
    fp16 = onnx_qat.quantize(model, data=feeds, progress=False, float_dtype="fp16")
    assert not [k for k in fp16.float_parts.kept if k.node == "c1"]
    B.assert_check_clean(fp16.model)
