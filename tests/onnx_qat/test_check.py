"""onnx_qat.check: one test per TensorRT-readiness rule (C1-C13) on tiny Q/DQ graphs built here."""
from __future__ import annotations

import dataclasses
import importlib
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat import ModelError
from onnx_qat.check import RULES, CheckReport, Finding, check

RNG = np.random.default_rng(0)


class Builder:
    """A tiny ONNX graph under construction: nodes, initializers, Q/DQ helpers."""

    def __init__(self, x_shape=(1, 4, 8, 8), x_type=TensorProto.FLOAT):
        self.nodes, self.inits = [], []
        self.inputs = [helper.make_tensor_value_info("x", x_type, list(x_shape))]
        self.outputs = []

    def init(self, name, array):
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def add(self, op, inputs, name, n_out=1, **attrs):
        outs = [f"{name}_out"] if n_out == 1 else [f"{name}_out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=name, **attrs))
        return outs[0]

    def q(self, tensor, name, **kw):
        return self._linear("QuantizeLinear", tensor, name, **kw)

    def dq(self, tensor, name, **kw):
        return self._linear("DequantizeLinear", tensor, name, **kw)

    def _linear(self, op, tensor, name, scale=0.05, zp=0, zp_dtype=np.int8, axis=None, with_zp=True):
        scale = np.asarray(scale, dtype=np.float32)
        ins = [tensor, self.init(f"{name}_scale", scale)]
        if with_zp:
            ins.append(self.init(f"{name}_zp", np.full(scale.shape, zp, dtype=zp_dtype)))
        attrs = {} if axis is None else {"axis": axis}
        return self.add(op, ins, name, **attrs)

    def qdq(self, tensor, name, **kw):
        return self.dq(self.q(tensor, f"{name}_q", **kw), f"{name}_dq", **{k: v for k, v in kw.items()
                                                                             if k != "with_zp"})

    def weight(self, name, cout=8, cin=4, k=3, quantize=True, scale=None, axis=0):
        w = self.init(name, RNG.normal(0, 0.2, (cout, cin, k, k)).astype(np.float32))
        if not quantize:
            return w
        scale = np.full(cout, 0.01, np.float32) if scale is None else scale
        return self.qdq(w, name, scale=scale, axis=axis)

    def output(self, tensor, shape=None):
        self.outputs.append(helper.make_tensor_value_info(tensor, TensorProto.FLOAT, shape))

    def model(self, opset=17):
        graph = helper.make_graph(self.nodes, "g", self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        return model


def good_block():
    """x -> QDQ -> Conv -> Relu = r; r -> QDQ (shared) -> Conv2; Add(Conv2, QDQ(r)) -> Relu -> GAP."""
    b = Builder()
    xq = b.qdq("x", "x")
    r = b.add("Relu", [b.add("Conv", [xq, b.weight("w1"), b.init("b1", np.zeros(8, np.float32))], "conv1",
                              pads=[1, 1, 1, 1])], "relu1")
    rq = b.qdq(r, "relu1")
    c2 = b.add("Conv", [rq, b.weight("w2", cin=8), b.init("b2", np.zeros(8, np.float32))], "conv2",
               pads=[1, 1, 1, 1])
    y = b.add("GlobalAveragePool", [b.add("Relu", [b.add("Add", [c2, rq], "add")], "relu2")], "gap")
    b.output(y, [1, 8, 1, 1])
    return b


def rules_of(report, severity=None):
    return [(f.rule, f.node) for f in report.findings if severity is None or f.severity == severity]


def assert_found(report, rule, node, severity="error"):
    hits = [f for f in report.findings if f.rule == rule and f.node == node and f.severity == severity]
    assert hits, f"expected {severity} {rule} on {node!r}; got:\n{report}"
    return hits[0]


# -- the clean model and the report type ---------------------------------------------------------
def test_good_model_passes_with_no_findings_and_runs_in_onnxruntime():
    model = good_block().model()
    onnx.checker.check_model(model, full_check=True)
    report = check(model)
    assert report.findings == (), str(report)
    assert bool(report) and report.passed
    assert (report.num_q, report.num_dq) == (4, 4)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"x": RNG.normal(size=(1, 4, 8, 8)).astype(np.float32)})[0]
    assert out.shape == (1, 8, 1, 1) and np.isfinite(out).all()


def test_report_is_frozen_readable_and_serializable():
    b = good_block()
    idx = [i.name for i in b.inits].index("x_q_zp")
    b.inits[idx] = numpy_helper.from_array(np.array(3, np.uint8), "x_q_zp")
    report = check(b.model())
    assert not report
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.num_q = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.findings[0].rule = "C0"
    lines = str(report).splitlines()
    assert len(lines) == len(report.findings) + 1
    assert lines[-1].startswith("FAILED") and "4 QuantizeLinear, 4 DequantizeLinear" in lines[-1]
    assert any(line.startswith("ERROR") and "C4" in line and "x_q" in line for line in lines)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] is False and data["num_errors"] == len(report.errors) >= 1
    assert {"rule", "severity", "node", "message"} == set(data["findings"][0])


def test_check_does_not_modify_the_callers_model():
    model = good_block().model()
    before = model.SerializeToString()
    check(model)
    assert model.SerializeToString() == before


def test_every_rule_is_documented_with_a_source():
    ids = [r[0] for r in RULES]
    int8 = [i for i in ids if i.startswith("C")]
    assert int8 == [f"C{i}" for i in range(1, len(int8) + 1)]
    assert ids[len(int8):] == [f"F{i}" for i in range(1, len(ids) - len(int8) + 1)]  # check_formats
    for rule_id, severity, what, fn in RULES:
        assert severity in ("error", "warning") and what
        assert fn.__doc__.startswith(rule_id) and "Source:" in fn.__doc__


def test_onnx_qat_check_is_callable_after_importing_the_submodule():
    import importlib

    import onnx_qat

    module = importlib.import_module("onnx_qat.check")
    report = onnx_qat.check(good_block().model())
    assert isinstance(report, CheckReport) and report.passed
    assert onnx_qat.check is module.check is check


def test_bad_arguments_raise_model_error(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        check(tmp_path / "missing.onnx")
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\xffnot a model" * 10)
    with pytest.raises(ModelError):
        check(garbage)
    with pytest.raises(ModelError):
        check(42)


# -- one test per rule ---------------------------------------------------------------------------
def test_c1_old_opset_is_reported_not_upgraded(tmp_path):
    b = Builder()
    y = b.add("Relu", [b.qdq("x", "x")], "relu")
    b.output(y, [1, 4, 8, 8])
    path = tmp_path / "old.onnx"
    onnx.save(b.model(opset=11), str(path))
    report = check(path)
    assert report.opset == 11
    assert_found(report, "C1", "(model)")
    assert report.model == str(path)


def test_c2_forbidden_integer_ops():
    b = Builder(x_shape=(2, 4), x_type=TensorProto.UINT8)
    y = b.add("MatMulInteger", ["x", b.init("w", np.ones((4, 3), np.uint8))], "mmi")
    b.output(y)
    b.outputs[0].type.tensor_type.elem_type = TensorProto.INT32
    report = check(b.model())
    assert_found(report, "C2", "mmi")
    b2 = Builder()
    b2.nodes.append(helper.make_node("QLinearConv", ["x"] * 8, ["y"], name="qlc"))
    b2.nodes.append(helper.make_node("DynamicQuantizeLinear", ["x"], ["a", "b", "c"], name="dql"))
    assert [f.node for f in check(b2.model()).findings if f.rule == "C2"] == ["qlc", "dql"]


def test_c2_contrib_domain_qdq():
    b = Builder()
    q = b.q("x", "x_q")
    b.nodes[-1].domain = "com.microsoft"
    b.output(b.dq(q, "x_dq"))
    report = check(b.model())
    assert "domain 'com.microsoft'" in assert_found(report, "C2", "x_q").message
    assert not [f for f in report.findings if f.node == "x_dq"]


def test_c2_looks_inside_subgraphs():
    b = Builder()
    sub = helper.make_graph([helper.make_node("ConvInteger", ["x", "x"], ["t"], name="inner")], "then",
                            [], [helper.make_tensor_value_info("t", TensorProto.INT32, None)])
    b.nodes.append(helper.make_node("If", [b.init("cond", np.array(True))], ["y"], name="if0",
                                    then_branch=sub, else_branch=sub))
    report = check(b.model())
    assert_found(report, "C2", "if0/then_branch/inner")
    assert_found(report, "C2", "if0/else_branch/inner")


def test_c3_int32_bias_dequantize():
    b = good_block()
    bias = b.dq(b.init("b1_q", np.zeros(8, np.int32)), "b1_dq", scale=0.001, zp_dtype=np.int32)
    conv = next(n for n in b.nodes if n.name == "conv1")
    conv.input[2] = bias
    report = check(b.model())
    assert_found(report, "C3", "b1_dq")
    assert [f.rule for f in report.errors] == ["C3"]  # reported once, not again for its int32 zero point


@pytest.mark.parametrize("kind", ["uint8", "nonzero", "missing"])
def test_c4_zero_point_must_be_int8_zero(kind):
    b = Builder()
    if kind == "uint8":
        t = b.qdq("x", "x", zp=128, zp_dtype=np.uint8)
    elif kind == "nonzero":
        t = b.qdq("x", "x", zp=5)
    else:
        t = b.dq(b.q("x", "x_q", with_zp=False), "x_dq", with_zp=False)
    b.output(b.add("Relu", [t], "relu"))
    report = check(b.model())
    assert_found(report, "C4", "x_q")
    assert not report
    if kind != "nonzero":
        assert_found(report, "C4", "x_dq")  # the DQ sees a uint8 input too


@pytest.mark.parametrize("scale,words", [(np.inf, "infinite"), (np.nan, "NaN"), (0.0, "<= 0"),
                                         (-1.0, "<= 0")])
def test_c5_scale_must_be_finite_and_positive(scale, words):
    b = Builder()
    b.output(b.add("Relu", [b.qdq("x", "x", scale=scale)], "relu"))
    finding = assert_found(check(b.model()), "C5", "x_q")
    assert words in finding.message


def test_c5_scale_must_be_constant():
    b = Builder()
    b.inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, []))
    q = b.add("QuantizeLinear", ["x", "s", b.init("zp", np.array(0, np.int8))], "x_q")
    b.output(b.add("DequantizeLinear", [q, b.init("s2", np.array(0.1, np.float32)), "zp"], "x_dq"))
    report = check(b.model())
    assert "not a constant" in assert_found(report, "C5", "x_q").message
    assert not [f for f in report.findings if f.node == "x_dq"]


def test_c5_accepts_constant_node_scales():
    b = Builder()
    b.nodes.append(helper.make_node("Constant", [], ["s"], name="const_s",
                                    value=numpy_helper.from_array(np.array(0.1, np.float32))))
    q = b.add("QuantizeLinear", ["x", "s", b.init("zp", np.array(0, np.int8))], "x_q")
    b.output(b.add("Relu", [b.add("DequantizeLinear", [q, "s", "zp"], "x_dq")], "relu"))
    assert check(b.model()).findings == ()


@pytest.mark.parametrize("raw", [True, False])
def test_c6_per_channel_length_must_match_channels(raw):
    """Scales stored as raw bytes (sizes read from dims) or as float_data (read as arrays) alike."""
    b = good_block()
    for name in ("w2_q", "w2_dq"):
        idx = [i.name for i in b.inits].index(f"{name}_scale")
        b.inits[idx] = (numpy_helper.from_array(np.full(4, 0.01, np.float32), f"{name}_scale") if raw else
                        helper.make_tensor(f"{name}_scale", TensorProto.FLOAT, [4], [0.01] * 4))
        b.inits[idx + 1] = numpy_helper.from_array(np.zeros(4, np.int8), f"{name}_zp")
    report = check(b.model())
    assert "4 scales for 8 channels" in assert_found(report, "C6", "w2_q").message
    assert_found(report, "C6", "w2_dq")


def test_c6_axis_out_of_range():
    b = good_block()
    for node in b.nodes:
        if node.name in ("w1_q", "w1_dq"):
            node.attribute[0].i = 4
    assert "axis 4 is out of range" in assert_found(check(b.model()), "C6", "w1_q").message


def test_c6_per_channel_activation_is_a_warning():
    b = Builder()
    b.output(b.add("Relu", [b.qdq("x", "x", scale=np.full(4, 0.1, np.float32), axis=1)], "relu"))
    report = check(b.model())
    assert report.passed
    assert_found(report, "C6", "x_q", "warning")


def test_c7_quantize_output_must_go_to_dequantize():
    b = Builder()
    q = b.q("x", "x_q")
    b.output(b.add("Cast", [q], "cast", to=TensorProto.FLOAT))
    report = check(b.model())
    assert "feeds cast" in assert_found(report, "C7", "x_q").message


def test_c8_dequantize_of_a_non_constant_is_a_warning():
    b = Builder(x_type=TensorProto.INT8)
    b.output(b.add("Relu", [b.dq("x", "x_dq")], "relu"))
    report = check(b.model())
    assert report.passed
    assert_found(report, "C8", "x_dq", "warning")


def test_c9_conv_with_only_activation_quantized():
    b = Builder()
    b.output(b.add("Conv", [b.qdq("x", "x"), b.weight("w", quantize=False)], "conv"))
    finding = assert_found(check(b.model()), "C9", "conv")
    assert "only its activation" in finding.message and "'w'" in finding.message


def test_c9_matmul_with_only_weight_quantized():
    b = Builder(x_shape=(2, 16))
    w = b.qdq(b.init("w", RNG.normal(size=(16, 8)).astype(np.float32)), "w",
              scale=np.full(8, 0.01, np.float32), axis=1)
    b.output(b.add("MatMul", ["x", w], "fc"))
    report = check(b.model())
    assert "only its weight" in assert_found(report, "C9", "fc").message
    assert not [f for f in report.findings if f.rule == "C6"]


def test_c9_activation_matmul_is_not_a_weighted_op():
    b = Builder(x_shape=(2, 16))
    b.inputs.append(helper.make_tensor_value_info("k", TensorProto.FLOAT, [16, 2]))
    b.output(b.add("MatMul", [b.qdq("x", "x"), "k"], "scores"))
    assert check(b.model()).findings == ()


def test_c9_accepts_quantized_input_through_pad():
    b = Builder()
    pads = b.init("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))
    padded = b.add("Pad", [b.qdq("x", "x"), pads], "pad")
    b.output(b.add("Conv", [padded, b.weight("w")], "conv"))
    assert check(b.model()).findings == ()


def test_c10_residual_add_with_float_skip():
    b = good_block()
    add = next(n for n in b.nodes if n.name == "add")
    add.input[1] = "relu1_out"
    report = check(b.model())
    assert report.passed
    finding = assert_found(report, "C10", "add", "warning")
    assert "'relu1_out'" in finding.message and "'conv2'" in finding.message


@pytest.mark.parametrize("extra", [0, 1])
def test_c10_sum_join_is_checked_on_its_first_two_inputs(extra):
    b = good_block()
    add = next(n for n in b.nodes if n.name == "add")
    add.op_type = "Sum"
    add.input.extend(["relu1_out"] * extra)  # a later link of the sum chain: never asked about
    assert check(b.model()).findings == ()
    add.input[1] = "relu1_out"
    assert "'relu1_out'" in assert_found(check(b.model()), "C10", "add", "warning").message


def test_c10_not_reported_for_an_add_of_a_conv_output_and_its_own_scaling():
    """``y + y * gate(y)`` (residual squeeze-excitation): no fusion can serve it, nothing to report."""
    b = good_block()
    add = next(n for n in b.nodes if n.name == "add")
    gate = b.add("Sigmoid", [b.add("GlobalAveragePool", ["conv2_out"], "se_gap")], "se_gate")
    add.input[1] = b.add("Mul", ["conv2_out", gate], "se_mul")
    assert check(b.model()).findings == ()


def test_c11_residual_add_with_conv_branch_quantized():
    b = good_block()
    add = next(n for n in b.nodes if n.name == "add")
    add.input[0] = b.qdq("conv2_out", "conv2_out")
    report = check(b.model())
    assert "'conv2'" in assert_found(report, "C11", "add", "warning").message
    assert rules_of(report) == [("C11", "add")]


def test_c12_qdq_between_pad_and_conv():
    b = Builder()
    padded = b.add("Pad", ["x", b.init("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))], "pad")
    b.output(b.add("Conv", [b.qdq(padded, "pad_out"), b.weight("w")], "conv"))
    finding = assert_found(check(b.model()), "C12", "pad_out_q")
    assert "'pad'" in finding.message


def test_c13_float_model_is_not_quantized():
    b = Builder()
    b.output(b.add("Conv", ["x", b.weight("w", quantize=False)], "conv"))
    report = check(b.model())
    assert report.passed and (report.num_q, report.num_dq) == (0, 0)
    assert rules_of(report, "warning") == [("C13", "(model)")]
    assert "not quantized" in str(report)


def test_c14_qdq_inside_conv_bn_relu_chain():
    b = Builder()
    conv = b.add("Conv", [b.qdq("x", "x"), b.weight("w")], "conv")
    params = [b.init(f"bn_{k}", np.full(8, v, np.float32))
              for k, v in (("s", 1), ("b", 0), ("m", 0), ("v", 1))]
    bn = b.add("BatchNormalization", [b.qdq(conv, "conv_out")] + params, "bn")
    y = b.add("Relu", [b.qdq(bn, "bn_out")], "relu")
    b.output(b.add("Conv", [b.qdq(y, "relu_out"), b.weight("w2", cin=8)], "conv2"))
    report = check(b.model())
    assert report.passed
    assert rules_of(report) == [("C14", "conv_out_q"), ("C14", "bn_out_q")]
    assert "'conv'" in report.findings[0].message and "BatchNormalization" in report.findings[0].message


# -- a model from another tool ------------------------------------------------------------------
def test_onnxruntime_quantize_static_uint8_model_is_flagged(tmp_path):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    b = Builder()
    bias = b.init("b", np.full(8, 0.1, np.float32))
    y = b.add("Relu", [b.add("Conv", ["x", b.weight("w", quantize=False), bias], "conv", pads=[1, 1, 1, 1])],
              "relu")
    b.output(y, [1, 8, 8, 8])
    float_path, q_path = tmp_path / "float.onnx", tmp_path / "ort_q.onnx"
    onnx.save(b.model(opset=13), str(float_path))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": RNG.normal(size=(1, 4, 8, 8)).astype(np.float32)} for _ in range(2)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(float_path), str(q_path), Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    q_model = onnx.load(str(q_path))
    report = check(q_path)
    assert not report
    assert "C4" in report.rules() and "C3" in report.rules()
    uint8_q = [n.name for n in q_model.graph.node if n.op_type == "QuantizeLinear"]
    assert uint8_q and all(any(f.rule == "C4" and f.node == name for f in report.errors) for name in uint8_q)
    assert all(isinstance(f, Finding) and f.node for f in report.findings)
    assert isinstance(report, CheckReport) and report.num_q == len(uint8_q)


# -- robustness -------------------------------------------------------------------------------------
def _mutate(model, rng):
    """Structural damage a hand-edited or buggy exporter can produce (the proto still parses)."""
    for _ in range(rng.integers(1, 5)):
        node = model.graph.node[int(rng.integers(len(model.graph.node)))]
        kind = int(rng.integers(6))
        if kind == 0 and len(node.input):
            del node.input[int(rng.integers(len(node.input)))]
        elif kind == 1:
            del node.output[:]
        elif kind == 2:
            node.input.append(str(rng.choice(["", "x", "unknown"])))
        elif kind == 3:
            node.op_type = str(rng.choice(["Pad", "Identity", "QuantizeLinear", "DequantizeLinear", "Conv",
                                           "Add", "MatMul", "BatchNormalization"]))
        elif kind == 4:
            init = model.graph.initializer[int(rng.integers(len(model.graph.initializer)))]
            init.data_type = int(rng.choice([1, 2, 3, 6, 8, 9, 14, 0, 99]))
        else:
            del node.attribute[:]
            node.attribute.append(helper.make_attribute(str(rng.choice(["axis", "output_dtype"])),
                                                        [1, 2] if rng.integers(2) else "text"))


def test_damaged_graphs_never_crash_the_checker():
    base = good_block().model()
    rng = np.random.default_rng(7)
    for _ in range(300):
        model = onnx.ModelProto()
        model.CopyFrom(base)
        _mutate(model, rng)
        try:
            report = check(model)
        except ModelError:
            continue
        assert isinstance(report, CheckReport) and str(report)


# -- cost: shape inference only when needed; the label of an in-memory model ---------------------------
def _declare_every_tensor(model):
    """Declare the type (and shape, where inference knows it) of every intermediate tensor."""
    inferred = onnx.shape_inference.infer_shapes(model)
    model.graph.value_info.extend(inferred.graph.value_info)
    return model


def test_shape_inference_runs_only_when_a_rule_needs_an_undeclared_type(monkeypatch):
    check_module = importlib.import_module("onnx_qat.check")  # the module, not the function
    calls = []
    real = check_module._inferred_value_info
    monkeypatch.setattr(check_module, "_inferred_value_info", lambda m: calls.append(1) or real(m))
    declared = _declare_every_tensor(good_block().model())
    assert check(declared).findings == () and calls == []
    b = Builder()  # a Q without zero point writes uint8: read from the Q node, no inference needed
    b.output(b.add("Relu", [b.dq(b.q("x", "x_q", with_zp=False), "x_dq", with_zp=False)], "relu"))
    report = check(b.model())
    assert calls == []
    assert "uint8" in assert_found(report, "C4", "x_dq").message
    b = Builder()  # a DQ reading a Cast's output: its integer type is only known from inference
    b.output(b.add("Relu", [b.dq(b.add("Cast", ["x"], "x_u8", to=TensorProto.UINT8), "x_dq", with_zp=False)],
                   "relu"))
    report = check(b.model())
    assert calls == [1]
    assert "uint8" in assert_found(report, "C4", "x_dq").message


def test_declared_and_inferred_types_give_the_same_findings():
    b = good_block()
    zp = [i.name for i in b.inits].index("x_q_zp")
    b.inits[zp] = numpy_helper.from_array(np.array(3, np.uint8), "x_q_zp")
    bare = b.model()
    assert check(_declare_every_tensor(b.model())).findings == check(bare).findings != ()


def test_path_names_the_file_of_an_in_memory_model():
    report = check(good_block().model(), path="out/q.onnx")
    assert report.model == "out/q.onnx" and "| out/q.onnx |" in report.summary()
    assert check(good_block().model()).model == ""


def test_many_scales_and_zero_points_each_judged_right():
    """C4/C5 judge all the model's scalar and per-channel constants in one pass: the findings
    name exactly the bad ones, wherever they sit among good ones (one has malformed bytes)."""
    rng = np.random.default_rng(5)
    b = Builder()
    bad_scale, bad_zp, t = {}, {}, "x"
    for i in range(60):
        per_channel = i % 3 == 0
        scale = np.full(4, 0.1, np.float32) if per_channel else np.float32(0.1)
        zp = 0
        if rng.random() < 0.2:
            value = rng.choice([0.0, -1.0, np.nan, np.inf])
            if per_channel:
                scale = scale.copy()
                scale[rng.integers(4)] = value
            else:
                scale = np.float32(value)
            bad_scale[f"p{i}_q"] = "infinite" if not np.isnan(value) and np.isinf(value) else \
                "NaN" if np.isnan(value) else "<= 0"
        elif rng.random() < 0.2:
            zp, bad_zp[f"p{i}_q"] = 3, True
        t = b.qdq(t, f"p{i}", scale=scale, zp=zp, axis=1 if per_channel else None)
    b.output(b.add("Relu", [t], "relu"))
    model = b.model()
    broken = next(i for i in model.graph.initializer if i.name == "p1_q_scale")
    broken.raw_data = broken.raw_data[:2]  # malformed: 2 bytes for one float32
    report = check(model)
    c5 = {f.node: f.message for f in report.findings if f.rule == "C5"}
    assert set(c5) == {n for n in bad_scale} | {n.replace("_q", "_dq") for n in bad_scale}
    for node, words in bad_scale.items():
        assert words in c5[node], (node, c5[node])
    c4 = {f.node for f in report.findings if f.rule == "C4"}
    assert c4 == set(bad_zp) | {n.replace("_q", "_dq") for n in bad_zp}
    assert bad_scale and bad_zp and "p1_q" not in c5  # unreadable values: no C5 finding, as before


def _typed(tensor):
    """The same constant stored in its typed field (float_data, int32_data) instead of raw bytes."""
    value = numpy_helper.to_array(tensor)
    return helper.make_tensor(tensor.name, tensor.data_type, list(value.shape), value.reshape(-1).tolist())


@pytest.mark.parametrize("target", [None, "ort-cpu"])
def test_batched_and_per_tensor_judgements_give_the_same_findings(target):
    """Scales and zero points stored as raw bytes are judged in one batch; stored in their typed
    fields they are judged one by one. Both give the same findings, bad constants among good ones."""
    rng = np.random.default_rng(11)
    b, t, bad = Builder(), "x", set()
    for i in range(40):
        per_channel = i % 4 == 0
        scale = np.full(4, 0.1, np.float32) if per_channel else np.float32(0.1)
        zp, zp_dtype = (128, np.uint8) if target and i % 3 == 0 else (0, np.int8)
        roll = rng.random()
        if roll < 0.15:
            scale = np.array(scale)
            scale.reshape(-1)[rng.integers(scale.size)] = rng.choice([-2.0, 0.0, np.nan])
            bad.add(f"p{i}_q")
        elif roll < 0.3:
            zp = int(rng.choice([1, 7, 100]))
            bad.add(f"p{i}_q")
        t = b.qdq(t, f"p{i}", scale=scale, zp=zp, zp_dtype=zp_dtype, axis=1 if per_channel else None)
    b.output(b.add("Relu", [t], "relu"))
    raw = b.model()
    typed = onnx.ModelProto()
    typed.CopyFrom(raw)
    for k, init in enumerate(typed.graph.initializer):
        typed.graph.initializer[k].CopyFrom(_typed(init))
    assert not any(i.HasField("raw_data") for i in typed.graph.initializer)
    batched, one_by_one = check(raw, target=target), check(typed, target=target)
    assert batched.findings == one_by_one.findings
    assert {f.node for f in batched.errors} == bad | {n.replace("_q", "_dq") for n in bad}


def test_raw_bytes_that_disagree_with_the_dims_are_unreadable_whatever_they_hold():
    """A scale or zero point whose raw bytes do not fill its dims cannot be read: no C4, C5 or C6
    finding about its values, whether its bytes look good or bad (and however they are batched)."""
    b = Builder()
    t = "x"
    cases = {  # name: (raw bytes, dims) of the scale, or of the zero point
        "a": ("scale", np.float32(0.1).tobytes(), [4]),             # one float, four declared
        "b": ("scale", np.float32(-1.0).tobytes(), [4]),
        "c": ("scale", np.full(4, 0.1, np.float32).tobytes(), []),   # four floats, one declared
        "d": ("scale", np.array([0.1, -1, 0.1, 0.1], np.float32).tobytes(), [1]),
        "e": ("zp", np.zeros(2, np.int8).tobytes(), []),
        "f": ("zp", np.array([0, 9], np.int8).tobytes(), [1]),
    }
    for name in cases:
        t = b.qdq(t, name)
    t = b.qdq(t, "bad", zp=3)  # a readable bad zero point still found among them
    b.output(b.add("Relu", [t], "relu"))
    model = b.model()
    inits = {i.name: i for i in model.graph.initializer}
    for name, (which, raw, dims) in cases.items():
        for node in (f"{name}_q", f"{name}_dq"):
            tensor = inits[f"{node}_{which}"]
            tensor.raw_data = raw
            del tensor.dims[:]
            tensor.dims.extend(dims)
    report = check(model)
    assert {(f.rule, f.node) for f in report.findings} == {("C4", "bad_q"), ("C4", "bad_dq")}


def test_unnamed_nodes_are_named_by_op_and_position_also_inside_subgraphs():
    b = Builder()
    body = Builder()
    q = body.q("x", "", zp=2)
    body.dq(q, "inner_dq", zp=2)
    sub = helper.make_graph(body.nodes, "body", [], [helper.make_tensor_value_info("inner_dq_out",
                                                                                TensorProto.FLOAT, None)],
                            body.inits)
    b.nodes.append(helper.make_node("If", [b.init("cond", np.array(True))], ["y"], then_branch=sub,
                                    else_branch=sub))
    q = b.q("y", "outer_q", zp=4)
    b.nodes[-1].name = ""
    b.output(b.add("Relu", [b.dq(q, "outer_dq")], "relu"))
    report = check(b.model())
    c4 = [f.node for f in report.findings if f.rule == "C4"]
    assert c4 == ["<QuantizeLinear #1>",  # the main graph first, then each body in attribute order
                  "<If #0>/else_branch/<QuantizeLinear #0>", "<If #0>/else_branch/inner_dq",
                  "<If #0>/then_branch/<QuantizeLinear #0>", "<If #0>/then_branch/inner_dq"]
    assert report.num_q == 3 and report.num_dq == 3


def test_quantized_types_are_the_same_from_c4s_stored_facts_and_from_the_nodes():
    """Each Q/DQ node's quantized type is read from the zero point's stored facts once rule C4's batch has
    read them, and from the protobuf otherwise: the same types either way (int8, uint8, a zero point made
    by an Identity of an initializer, a QuantizeLinear without one)."""
    from onnx_qat.check import rules_formats, rules_values
    from onnx_qat.check.index import _all_graphs

    b = Builder()
    a = b.qdq("x", "int8")
    u = b.qdq(a, "uint8", zp=128, zp_dtype=np.uint8)
    n = b.qdq(u, "none", with_zp=False)
    zp = b.add("Identity", [b.init("z0", np.int8(0))], "zp_identity")
    q = b.add("QuantizeLinear", [n, b.init("s0", np.float32(0.1)), zp], "via_identity_q")
    y = b.add("DequantizeLinear", [q, "s0", zp], "via_identity_dq")
    b.output(y)
    model = b.model()

    def types(after_c4: bool):
        graphs = _all_graphs(model, 17, None)
        if after_c4:
            list(rules_values.rule_c4_zero_points(model, graphs))
            assert graphs[0]._stored, "rule C4 read the zero points' facts"
        found = rules_formats.quantized_types(graphs[0])
        return {graphs[0].name(pos): t for pos, t in found.items()}

    # none_dq has an int8 zero point (Builder.qdq gives the DQ one); a zero point through an Identity has no
    # type the check can read without shape inference (None), read either way
    expected = {"int8_q": 3, "int8_dq": 3, "uint8_q": 2, "uint8_dq": 2, "none_q": None, "none_dq": 3,
                "via_identity_q": None, "via_identity_dq": None}
    assert types(after_c4=False) == expected
    assert types(after_c4=True) == expected
