"""tf_bridge.export_onnx on small models: mapping, parity, files, CLI reproduction, refusals."""
import json
import os

import numpy as np
import onnx
import pytest

keras = pytest.importorskip("keras")

import tf_bridge  # noqa: E402
from onnx_qat import check  # noqa: E402
from onnx_qat.errors import ExportError  # noqa: E402
from tests import builders as B  # noqa: E402
from tests.tf_bridge.models import blobs, mixed_cnn, randomize_bn  # noqa: E402

os.environ.setdefault("TF_BRIDGE_QUIET", "1")
L = keras.layers


def _qat(model, x, cases=None):
    q = tf_bridge.quantize_model(model, custom_qdq_cases=cases)
    tf_bridge.calibrate(q, x, progress=False)
    return q


def _assert_parity(report):
    for out in report.parity.outputs:
        assert out.ratio <= 0.10, str(report)
        assert out.max_abs_qdq < out.max_abs_float
        assert out.top1 is None or out.top1 >= 0.99
    assert report.parity.passed and report.check.passed, str(report)


def _skip_inputs(model):
    """(Add node, quantized input indices) for every Add of two activations in a Q/DQ model."""
    pairs = B.qdq_pairs(model)
    read = {c: t for t, cs in pairs.items() for c in cs}
    inits = {i.name for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type == "Add" and not any(t in inits for t in node.input):
            found[node.name] = tuple(i for i in range(len(node.input)) if (node.name, i) in read)
    return found


@pytest.fixture(scope="module")
def residual_export(tmp_path_factory):
    keras.utils.set_random_seed(7)
    x, _ = blobs(16, (32, 32, 3))
    model = randomize_bn(mixed_cnn())
    q = _qat(model, x, [tf_bridge.custom_qdq_cases.ResidualConnectionQDQCase()])
    out = tmp_path_factory.mktemp("export") / "mixed.onnx"
    report = tf_bridge.export_onnx(q, out, sample_data=x[:8], save_float=True)
    return q, report, x


def test_mixed_cnn_parity_check_and_mapping(residual_export):
    q, report, _ = residual_export
    _assert_parity(report)
    records = tf_bridge.quantizer_records(q)
    assert {e.quantizer for e in report.mapping} == {r.path for r in records}
    by_name = {e.quantizer: e for e in report.mapping}
    stem = by_name["stem_conv"]  # Conv -> BatchNorm: the BatchNorm stays a Mul/Add after the Conv
    assert "BatchNorm folded" not in stem.note and stem.fold_factor == (1.0, 1.0)
    assert by_name["up"].onnx_nodes and by_name["logits"].fold_factor == (1.0, 1.0)
    # SeparableConv2D: the depthwise output is quantized, so the pointwise Conv runs in INT8 too
    assert "baked" not in by_name["sep"].note and not report.baked
    inner = by_name["sep_depthwise_quant"]
    assert inner.keras == "sep:depthwise -> sep (pointwise)" and len(inner.onnx_tensors) == 1
    assert inner.onnx_tensors[0].endswith("depthwise:0"), inner


def test_conv_before_batchnorm_keeps_the_keras_weight_amax(residual_export):
    q, report, _ = residual_export
    from onnx_qat.scales import ScaleTable
    table = ScaleTable.load(report.scales_path)
    float_model = onnx.load(report.float_path)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in float_model.graph.initializer}
    entry = next(e for e in report.mapping if e.quantizer == "stem_conv")
    w = inits[entry.onnx_tensors[0]]
    rng = table.weights[entry.onnx_tensors[0]]
    assert rng.axis == 0
    np.testing.assert_allclose(rng.amax, np.abs(w).reshape(w.shape[0], -1).max(1), rtol=1e-6)
    keras_amax = q.get_layer("stem_conv").weight_amax()["kernel"]
    np.testing.assert_array_equal(rng.amax, keras_amax)  # no BatchNorm fold: the Keras ranges as such
    producers = {o: n for n in float_model.graph.node for o in n.output}
    conv = next(n for n in float_model.graph.node if n.name == entry.onnx_nodes[0])
    consumer = next(n for n in float_model.graph.node if conv.output[0] in n.input)
    assert consumer.op_type == "Mul" and any(i in inits for i in consumer.input), consumer
    assert producers[consumer.input[0]] is conv or producers[consumer.input[1]] is conv


def test_qdq_weight_integers_are_the_keras_integers(residual_export):
    """The int8 initializer holds exactly the integers the Keras QAT model computes with."""
    q, report, _ = residual_export
    qdq = onnx.load(report.path)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in qdq.graph.initializer}
    entry = next(e for e in report.mapping if e.quantizer == "pw")
    assert "BatchNorm folded" not in entry.note
    conv_inputs = {i for m in qdq.graph.node if m.name == entry.onnx_nodes[0] for i in m.input}
    dq = next(n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.output[0] in conv_inputs
              and n.input[0] in inits)
    onnx_int = inits[dq.input[0]].astype(np.int32)
    kernel = q.get_layer("pw").layer.kernel.numpy()  # [1, 1, in, out]
    amax = q.get_layer("pw").weight_amax()["kernel"]
    keras_int = np.clip(np.round(kernel / (amax / np.float32(127))), -127, 127).transpose(3, 2, 0, 1)
    assert np.array_equal(onnx_int, keras_int.astype(np.int32))


def test_residual_adds_quantized_on_skip_only(residual_export):
    _, report, _ = residual_export
    qdq = onnx.load(report.path)
    adds = _skip_inputs(qdq)
    assert len(adds) == 2 and all(len(idx) == 1 for idx in adds.values()), adds
    producers = {o: n for n in qdq.graph.node for o in n.output}
    inits = {t.name for t in qdq.graph.initializer}
    for name, (i,) in adds.items():
        add = next(n for n in qdq.graph.node if n.name == name)
        branch = producers[add.input[1 - i]]
        while branch.op_type in ("Mul", "Add") and any(t in inits for t in branch.input):
            branch = producers[next(t for t in branch.input if t not in inits)]  # BatchNorm Mul/Add
        assert branch.op_type == "Conv"  # the conv branch stays float


def test_onnx_qat_cli_reproduces_model_from_scales(tmp_path):
    keras.utils.set_random_seed(3)
    inp = keras.Input((16, 16, 3), name="x")
    y = L.ReLU()(L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(inp)))
    z = L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(y))
    y = L.ReLU()(L.Add()([y, z]))
    out = L.Dense(10)(L.GlobalAveragePooling2D()(y))
    model = randomize_bn(keras.Model(inp, out), seed=3)
    x = np.random.default_rng(0).normal(size=(8, 16, 16, 3)).astype("f")
    q = _qat(model, x, [tf_bridge.custom_qdq_cases.ResidualConnectionQDQCase()])
    report = tf_bridge.export_onnx(q, tmp_path / "m.onnx", sample_data=x, save_float=True)
    _assert_parity(report)
    assert report.cli_reproducible
    from onnx_qat.cli import main
    again = tmp_path / "again.onnx"
    assert main(["quantize", str(report.float_path), "--scales", str(report.scales_path), "-o", str(again),
                 "--quiet"]) == 0
    assert again.read_bytes() == report.path.read_bytes()


def test_nested_models_conv1d_and_transpose(tmp_path):
    keras.utils.set_random_seed(5)
    seq_in = keras.Input((32, 4), name="seq")
    s = L.Conv1D(16, 3, padding="same", activation="relu")(seq_in)
    s = L.Conv1D(16, 3, padding="same")(s)
    branch = keras.Model(seq_in, L.GlobalAveragePooling1D()(s), name="branch")
    inner = keras.Sequential([keras.Input((8, 8, 16)), L.Conv2D(16, 3, padding="same", name="inner_conv"),
                              L.BatchNormalization(name="inner_bn"), L.ReLU()], name="inner")
    img = keras.Input((8, 8, 3), name="img")
    y = L.SeparableConv2D(16, 3, padding="same", name="sep")(img)
    y = inner(y)
    y = L.Conv2DTranspose(16, 3, strides=2, padding="same", name="up")(y)
    y = L.GlobalAveragePooling2D()(y)
    seq = keras.Input((32, 4), name="s")
    out = L.Dense(6, name="head")(L.Concatenate()([y, branch(seq)]))
    model = randomize_bn(keras.Model([img, seq], out), seed=5)
    rng = np.random.default_rng(1)
    x = [rng.normal(size=(8, 8, 8, 3)).astype("f"), rng.normal(size=(8, 32, 4)).astype("f")]
    q = _qat(model, x)
    report = tf_bridge.export_onnx(q, tmp_path / "nested.onnx", sample_data=x)
    _assert_parity(report)
    quantizers = {e.quantizer for e in report.mapping}
    assert {"inner/inner_conv", "branch/conv1d", "up", "head"} <= quantizers
    assert any(e.quantizer.startswith("inner/") and e.kind == "activation" for e in report.mapping)


def test_report_text_and_dict(residual_export):
    _, report, _ = residual_export
    text = str(report)
    assert text.startswith("export_onnx: PASSED") and "parity: PASSED" in text and "check: PASSED" in text
    assert "stem_conv.kernel" in report.mapping_table()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] and len(data["mapping"]) == len(report.mapping)
    assert data["parity"]["outputs"][0]["ratio"] <= 0.1
    assert check(str(report.path)).passed


def test_generated_inputs_when_no_sample_data(tmp_path):
    keras.utils.set_random_seed(2)
    inp = keras.Input((8, 8, 3))
    out = L.Dense(4)(L.Flatten()(L.Conv2D(16, 3, activation="relu")(inp)))
    q = _qat(keras.Model(inp, out), np.random.default_rng(0).normal(size=(8, 8, 8, 3)).astype("f"))
    report = tf_bridge.export_onnx(q, tmp_path / "g.onnx", save_scales=False)
    assert report.parity.generated_inputs and report.parity.samples == 8
    assert report.scales_path is None and not (tmp_path / "g.scales.json").exists()
    _assert_parity(report)


# --------------------------------------------------------------------------- refusals
def _tiny_qat(calibrate=True):
    inp = keras.Input((8, 8, 3))
    q = tf_bridge.quantize_model(keras.Model(inp, L.Conv2D(16, 3)(inp)))
    if calibrate:
        tf_bridge.calibrate(q, np.ones((2, 8, 8, 3), "f"), progress=False)
    return q


def test_subclassed_model_is_refused(tmp_path):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.conv = L.Conv2D(4, 3)

        def call(self, x):
            return self.conv(x)

    net = Net()
    net(np.zeros((1, 8, 8, 3), "f"))
    with pytest.raises(ExportError, match="subclassed"):
        tf_bridge.export_onnx(net, tmp_path / "s.onnx")
    assert not list(tmp_path.iterdir())


def test_uncalibrated_quantizer_is_named_and_nothing_written(tmp_path):
    with pytest.raises(ExportError, match="no range.*calibrate"):
        tf_bridge.export_onnx(_tiny_qat(calibrate=False), tmp_path / "u.onnx")
    assert not list(tmp_path.iterdir())


def test_batchnorm_input_quantized_by_spec_maps_to_the_conv_output(tmp_path):
    """A BatchNormalization input quantized by spec: the BN stays a Mul/Add after the Conv, so
    its input is the Conv output, found by the layer scopes; the Q/DQ model equals Keras."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((8, 8, 3))
    y = L.BatchNormalization(name="bn")(L.Conv2D(16, 3, use_bias=False, name="conv")(inp))
    model = randomize_bn(keras.Model(inp, L.ReLU()(y)), seed=4)
    spec = tf_bridge.QuantizationSpec().add("bn", quantize_input=True, quantize_weight=False)
    q = tf_bridge.quantize_model(model, quantization_spec=spec)
    tf_bridge.calibrate(q, np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype("f"), progress=False)
    report = tf_bridge.export_onnx(q, tmp_path / "x.onnx")
    entry = next(e for e in report.mapping if e.quantizer == "conv_quant")
    assert len(entry.onnx_nodes) == 1 and "/bn" in entry.onnx_nodes[0], entry
    assert entry.onnx_tensors[0].endswith("/convolution:0"), entry
    assert report.parity.outputs[0].max_abs_qdq <= 1e-6 * report.parity.outputs[0].max_abs_float + 1e-7


def test_unmappable_quantizer_is_named_and_nothing_written(tmp_path):
    """An Identity's input quantized by spec, the Identity being the model output: tf2onnx leaves no
    node that reads it, so the quantizer and the layer are named in one line."""
    keras.utils.set_random_seed(4)
    inp = keras.Input((8, 8, 3))
    out = L.Identity(name="idn")(L.Conv2D(16, 3, name="conv")(inp))
    spec = tf_bridge.QuantizationSpec().add("idn", quantize_input=True, quantize_weight=False)
    q = tf_bridge.quantize_model(keras.Model(inp, out), quantization_spec=spec)
    tf_bridge.calibrate(q, np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype("f"), progress=False)
    with pytest.raises(ExportError, match=r"could not be mapped.*conv_quant.*Identity layer 'idn'") as err:
        tf_bridge.export_onnx(q, tmp_path / "x.onnx")
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


def test_model_without_quantizers_and_bad_sample_data(tmp_path):
    inp = keras.Input((4,))
    with pytest.raises(ExportError, match="no tf_bridge quantizers"):
        tf_bridge.export_onnx(keras.Model(inp, L.ReLU()(inp)), tmp_path / "n.onnx")
    with pytest.raises(ExportError, match="sample_data"):
        tf_bridge.export_onnx(_tiny_qat(), tmp_path / "b.onnx", sample_data=np.zeros((8, 8, 3), "f"))
    assert not list(tmp_path.iterdir())


def _resnet_style(input_shape=(16, 16, 3), classes=4, blocks=3):
    inp = keras.Input(input_shape, name="image")
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(inp)))
    for b in range(blocks):
        stride = 2 if b == 1 else 1
        y = L.ReLU()(L.BatchNormalization()(L.Conv2D(16 * (1 + (b > 0)), 3, strides=stride, padding="same",
                                                     use_bias=False)(x)))
        y = L.BatchNormalization()(L.Conv2D(16 * (1 + (b > 0)), 3, padding="same", use_bias=False)(y))
        if stride != 1 or x.shape[-1] != y.shape[-1]:
            x = L.BatchNormalization()(L.Conv2D(y.shape[-1], 1, strides=stride, use_bias=False)(x))
        x = L.ReLU()(L.Add()([x, y]))
    out = L.Dense(classes)(L.GlobalAveragePooling2D()(x))
    return keras.Model(inp, out, name="resnet_style")


def test_new_user_resnet_trained_with_qat_exports_with_parity(tmp_path):
    """A Keras 3 ResNet-style model, fine-tuned with QAT, exports to a Q/DQ model that matches it,
    with every residual Add quantized on its skip branch only."""
    keras.utils.set_random_seed(11)
    x, y = blobs(192, (16, 16, 3))
    model = _resnet_style()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=1, batch_size=32, verbose=0)
    q = _qat(model, x[:64], [tf_bridge.custom_qdq_cases.ResNetV1QDQCase()])
    q.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = q.fit(x, y, epochs=2, batch_size=32, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]
    report = tf_bridge.export_onnx(q, tmp_path / "resnet.onnx", sample_data=x[:32])
    _assert_parity(report)
    assert all(o.bound == "float" for o in report.parity.outputs)  # shallow: the strict 10% bound holds
    adds = _skip_inputs(onnx.load(report.path))
    assert len(adds) == 3 and all(len(idx) == 1 for idx in adds.values()), adds
    assert not report.check.warnings or all(f.rule not in ("C10", "C11") for f in report.check.findings)


def test_output_parity_bounds():
    from tf_bridge.export import output_parity
    k = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    f = k + 1.0
    ok = output_parity(["y"], [k], [k + 0.05], [f])[0]
    assert ok.passed and ok.bound == "float" and abs(ok.ratio - 0.05) < 1e-12 and ok.top1 == 1.0
    far = output_parity(["y"], [k], [k + 0.5], [f])[0]
    assert not far.passed and "FAILED" in str(far)
    deep = output_parity(["y"], [k * 100], [k * 100 + 0.5], [k * 100 + 1.0], sensitivity=[0.2])[0]
    assert deep.passed and deep.bound == "rounding" and "rounding sensitivity" in str(deep)
    assert not output_parity(["y"], [k], [k + 0.5], [f], sensitivity=[0.1])[0].passed
    # within the rounding bound but 17% of the output range: a rounding cascade, never PASSED
    cascade = output_parity(["y"], [k], [k + 0.5], [f], sensitivity=[0.2])[0]
    assert not cascade.passed and cascade.cause == "rounding cascade" and cascade.bound == "rounding"
    assert str(cascade).startswith("FAILED (rounding cascade)") and "PASSED" not in str(cascade)
    assert abs(cascade.abs_error - 0.5 / 3.0) < 1e-12 and cascade.output_range == 3.0
    # the float twin exploded: 5% of its error passes the relative bound, not the absolute one
    exploded = output_parity(["y"], [k], [k + 0.5], [k + 10.0])[0]
    assert exploded.bound == "float" and not exploded.passed and exploded.cause == ""
    assert "> 2%" in str(exploded)
    flipped = output_parity(["y"], [k], [np.roll(k, 1, axis=1)], [f], sensitivity=[10.0])[0]
    assert flipped.top1 == 0.0 and not flipped.passed


def test_rounding_sensitivity_is_small_for_a_shallow_model(residual_export):
    from tf_bridge.export import rounding_sensitivity
    _, report, x = residual_export
    qdq = onnx.load(report.path)
    feeds = {qdq.graph.input[0].name: x[:8]}
    from tf_bridge.onnx_values import run_with_tensors
    name = qdq.graph.output[0].name
    base = run_with_tensors(qdq, feeds)[name]
    (sens,) = rounding_sensitivity(qdq, feeds, [name], [base])
    assert 0.0 <= sens < report.parity.outputs[0].max_abs_float


def test_split_parity_separates_the_export_from_the_engines():
    """Measured against the Keras QAT graph run in onnxruntime, the export must meet the 10% bound,
    2% of the output range and top-1; the two runs of the Keras model must agree (10% of the float
    difference and 2% of the range) or stay within 3 x the rounding sensitivity."""
    from tf_bridge.export import split_parity
    k = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])  # output range 3
    f = k + 1.0
    engine = k + 0.03  # the Keras QAT model run in onnxruntime: 1% of the range from TensorFlow
    ok = split_parity(["y"], [k], [engine], [engine + 1e-6], [f], [0.02])[0]
    assert ok.passed and ok.bound == "float" and ok.engines == "float" and ok.reference == "onnxruntime"
    assert ok.ratio < 1e-5 and abs(ok.max_abs_tf - 0.03) < 1e-5 and abs(ok.max_abs_engine - 0.03) < 1e-12
    assert not ok.engines_cascade and abs(ok.engines_abs_error - 0.01) < 1e-12
    assert str(ok).startswith("PASSED") and "matches the Keras QAT graph in onnxruntime" in str(ok)
    assert "TensorFlow and onnxruntime agree on the Keras model (1% of the output range)" in str(ok)
    engine = k + 0.3
    assert not split_parity(["y"], [k], [engine], [engine + 0.5], [f], [0.2])[0].passed  # the export's own
    flipped = split_parity(["y"], [k], [engine], [np.roll(engine, 1, axis=1)], [f], [10.0])[0]
    assert flipped.top1 == 0.0 and not flipped.passed


def test_split_parity_passes_a_rounding_cascade_of_the_engines_and_names_it():
    """The Q/DQ model equals the Keras graph in onnxruntime; TensorFlow computes the Keras model 10% of
    the output range away (beyond 10% of the float difference and 2% of the range), within 3 x the
    rounding sensitivity: PASSED, and the text says plainly that the engines differ by a cascade."""
    from tf_bridge.export import split_parity
    k = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    engine = k + 0.3
    out = split_parity(["y"], [k], [engine], [engine + 1e-6], [k + 1.0], [0.2])[0]
    assert out.passed and out.engines == "rounding" and out.engines_cascade and out.cause == ""
    assert out.abs_error < 1e-6 and abs(out.engines_abs_error - 0.1) < 1e-12 and out.top1_tf == 1.0
    text = str(out)
    assert text.startswith("PASSED | output 'y' | matches the Keras QAT graph in onnxruntime"), text
    assert ("TensorFlow and onnxruntime differ by a rounding cascade (10% of the output range, within "
            "3 x the rounding sensitivity 0.2)") in text, text


def test_split_parity_fails_an_export_error_even_when_the_engines_agree():
    """The engines agree to 0.3% of the range; the Q/DQ model is 2.3% of the range from the Keras graph
    in onnxruntime (7% of the float difference): the export's own error, FAILED."""
    from tf_bridge.export import split_parity
    k = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    engine = k + 0.01
    out = split_parity(["y"], [k], [engine], [engine + 0.07], [k + 1.0], [1.0])[0]
    assert out.engines == "float" and out.ratio <= 0.10 and out.abs_error > 0.02
    assert not out.passed and str(out).startswith("FAILED | output 'y' | does NOT match"), str(out)


def test_split_parity_fails_engines_beyond_the_rounding_sensitivity():
    """The export is exact, but the two runs of the Keras model differ by 0.3 > 3 x sensitivity 0.05."""
    from tf_bridge.export import split_parity
    k = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    out = split_parity(["y"], [k], [k + 0.3], [k + 0.3], [k + 1.0], [0.05])[0]
    assert not out.passed and out.engines == "" and out.cause == "" and out.abs_error == 0.0
    assert str(out).startswith("FAILED |") and "beyond 3 x the rounding sensitivity 0.05" in str(out)


def test_split_parity_with_an_exploding_float_twin_cannot_pass():
    """A float twin 1e6 away makes every ratio tiny: the absolute bounds still decide."""
    from tf_bridge.export import split_parity
    k = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    f = k + 1e6
    engines_apart = split_parity(["y"], [k], [k + 0.3], [k + 0.3], [f], [0.01])[0]
    assert engines_apart.ratio == 0.0 and engines_apart.engines == "" and not engines_apart.passed
    export_off = split_parity(["y"], [k], [k], [k + 0.3], [f], [1.0])[0]
    assert export_off.ratio < 1e-6 and export_off.engines == "float" and not export_off.passed
    assert abs(export_off.abs_error - 0.1) < 1e-12


def test_without_an_onnxruntime_run_a_cascade_still_fails():
    """No split (the Keras graph could not run in onnxruntime): a difference from the run in TensorFlow
    that only the rounding sensitivity explains is FAILED (rounding cascade)."""
    from tf_bridge.export import output_parity
    k = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    out = output_parity(["y"], [k], [k + 0.3], [k + 1.0], sensitivity=[0.2])[0]
    assert not out.passed and out.cause == "rounding cascade" and out.reference == "tensorflow"
    assert str(out).startswith("FAILED (rounding cascade)")


def test_a_pass_through_an_engines_cascade_is_named_in_the_report_and_logged(caplog, tmp_path):
    from tf_bridge.export import Parity, split_parity
    from tf_bridge.parity import _warn_engines_cascade
    from tf_bridge.report import ExportReport
    k = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    outputs = split_parity(["y"], [k], [k + 0.3], [k + 0.3], [k + 1.0], [0.2])
    report = ExportReport(tmp_path / "m.onnx", None, None, 17, "tensorrt", (), Parity(outputs, 2, False),
                          None)
    first = str(report).splitlines()[0]
    assert first.startswith("export_onnx: PASSED (TensorFlow and onnxruntime differ on the Keras model by a "
                            "rounding cascade)"), first
    entry = report.to_dict()["parity"]["outputs"][0]
    assert entry["engines"] == "rounding" and abs(entry["engines_abs_error"] - 0.1) < 1e-12
    with caplog.at_level("WARNING", logger="tf_bridge.parity"):
        _warn_engines_cascade(outputs)
    assert len(caplog.records) == 1 and "train the model" in caplog.text
    assert "10% of the output range apart" in caplog.text


def _trained_conv_relu_net(seed=5):
    """Conv-ReLU layers without BatchNorm (each Conv output reaches a quantizer through commuting
    ops only, so the ort-cpu form requantizes it) trained on blobs; returns the QAT model and data."""
    keras.utils.set_random_seed(seed)
    x, y = blobs(256, (12, 12, 3))
    inp = keras.Input((12, 12, 3))
    h = L.Conv2D(16, 3, padding="same", activation="relu")(inp)
    h = L.Conv2D(16, 3, padding="same", activation="relu")(h)
    h = L.Conv2D(32, 3, padding="same", activation="relu")(L.MaxPooling2D()(h))
    model = keras.Model(inp, L.Dense(4)(L.GlobalAveragePooling2D()(h)))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    return _qat(model, x[:64]), x[64:128]


def test_ort_cpu_target_is_checked_as_deployed_against_the_tensorrt_form(tmp_path):
    from tf_bridge.export import DEPLOYED_FACTOR
    q, x = _trained_conv_relu_net()
    report = tf_bridge.export_onnx(q, tmp_path / "cpu.onnx", target="ort-cpu", sample_data=x)
    assert report.target == "ort-cpu" and report.passed, str(report)
    assert report.check is not None and bool(report.check)  # the rules that apply to the CPU form
    (strict,) = report.parity.outputs  # the tensorrt form of the same mapping, against Keras
    assert strict.bound == "float" and strict.ratio <= 0.10
    (deployed,) = report.parity.deployed
    assert deployed.target == "ort-cpu" and deployed.passed and deployed.top1 >= 0.99
    assert deployed.max_abs_quant > 0 and deployed.ratio <= DEPLOYED_FACTOR
    assert "check (ort-cpu rules): PASSED" in str(report) and "ort-cpu as deployed" in str(report)
    data = report.to_dict()
    assert data["check"]["passed"] and data["parity"]["deployed"][0]["target"] == "ort-cpu"
    ort_model = onnx.load(report.path)
    assert any(n.op_type == "QuantizeLinear" for n in ort_model.graph.node)


def test_ort_cpu_export_of_a_batchnorm_net_runs_every_conv_as_qlinearconv(tmp_path):
    """The export keeps each BatchNormalization as Mul/Add (parity with Keras); the ort-cpu form folds
    them into the Conv (rule CPU2) so onnxruntime still runs every Conv on its integer kernel."""
    keras.utils.set_random_seed(7)
    x, y = blobs(256, (12, 12, 3))
    inp = keras.Input((12, 12, 3))
    h = inp
    for filters in (16, 16, 32):
        h = L.ReLU()(L.BatchNormalization()(L.Conv2D(filters, 3, padding="same", use_bias=False)(h)))
    model = keras.Model(inp, L.Dense(4)(L.GlobalAveragePooling2D()(h)))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    q = _qat(model, x[:64])
    report = tf_bridge.export_onnx(q, tmp_path / "cpu.onnx", target="ort-cpu", sample_data=x[64:128])
    assert report.passed and bool(report.check), str(report)
    (deployed,) = report.parity.deployed
    assert deployed.passed and deployed.top1 >= 0.99
    ops = B.optimized_ops(report.path, tmp_path)
    assert ops.count("QLinearConv") == 3 and "Conv" not in ops, ops
    assert "Mul" not in [n.op_type for n in onnx.load(report.path).graph.node]


def _trained_residual_net(seed=11):
    """A Conv-BN-ReLU stem and one residual block (Conv-BN-ReLU, Conv-BN, Add with the stem, ReLU):
    the second Conv's output reaches a quantizer only through the Add, so no Keras quantizer
    observes it; returns the QAT model and held-out data."""
    keras.utils.set_random_seed(seed)
    x, y = blobs(256, (12, 12, 3))
    inp = keras.Input((12, 12, 3))
    stem = L.ReLU()(L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(inp)))
    h = L.ReLU()(L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(stem)))
    h = L.BatchNormalization()(L.Conv2D(16, 3, padding="same", use_bias=False)(h))
    h = L.ReLU()(L.Add()([stem, h]))
    model = keras.Model(inp, L.Dense(4)(L.GlobalAveragePooling2D()(h)))
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, epochs=2, batch_size=32, verbose=0)
    return _qat(model, x[:64], [tf_bridge.custom_qdq_cases.ResidualConnectionQDQCase()]), x[64:128]


def test_ort_cpu_export_requantizes_a_residual_branch_with_ranges_from_sample_data(tmp_path):
    """The residual branch's last Conv needs a range no quantizer learned: with sample_data it is
    the max |x| of that Conv's output over the data, every Conv runs as QLinearConv, the scales
    JSON holds the range and the CLI reproduces the model from it."""
    from onnx_qat.cli import main
    from tf_bridge.onnx_values import run_with_tensors

    q, x = _trained_residual_net()
    report = tf_bridge.export_onnx(q, tmp_path / "cpu.onnx", target="ort-cpu", sample_data=x, save_float=True)
    assert report.passed, str(report)
    (deployed,) = report.parity.deployed
    assert deployed.passed and deployed.top1 >= 0.99
    ops = B.optimized_ops(report.path, tmp_path)
    assert ops.count("QLinearConv") == 3 and not {"Conv", "FusedConv"} & set(ops), " ".join(ops)
    learned = {t for entry in report.mapping for t in entry.onnx_tensors}
    table = json.loads(report.scales_path.read_text())
    extra = {t: a for t, a in table["activations"].items() if t not in learned}
    assert len(extra) == 1, extra
    ((tensor, amax),) = extra.items()
    float_model = onnx.load(report.float_path)
    values = run_with_tensors(float_model, {float_model.graph.input[0].name: x}, [tensor])
    assert amax == pytest.approx(float(np.abs(values[tensor]).max()), rel=1e-6)
    assert "ort-cpu_ranges" in table["metadata"] and "calibration_target" not in table["metadata"]
    # its measured extremes too (the learned ranges get none: their grid was trained), so the point is
    # stored over the asymmetric uint8 range quantize --data gives it
    assert set(table["bounds"]) == {tensor}
    low, high = float(values[tensor].min()), float(values[tensor].max())
    assert table["bounds"][tensor] == pytest.approx([low, high], rel=1e-6) and low < 0 < high
    from onnx_qat.insertion.ort_cpu import asymmetric_range
    scale, zero = asymmetric_range(amax, low, high)
    model = onnx.load(report.path)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    (qnode,) = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor]
    assert float(inits[qnode.input[1]]) == pytest.approx(scale, rel=1e-6) and scale < amax / 127
    assert int(inits[qnode.input[2]]) == zero and zero != 128
    (point,) = [r for r in report.requantization if r["tensor"] == tensor and r["rule"] == "CPU1"]
    assert point["status"] == "added" and point["amax"] == pytest.approx(amax)
    assert "not requantized" not in str(report) and "requantization (ort-cpu)" in str(report)
    again = tmp_path / "again.onnx"
    assert main(["quantize", str(report.float_path), "--scales", str(report.scales_path),
                 "--target", "ort-cpu", "-o", str(again)]) == 0
    assert report.cli_reproducible and again.read_bytes() == report.path.read_bytes()


def test_ort_cpu_export_with_generated_data_leaves_the_residual_branch_in_float(tmp_path):
    """Generated samples are never taken as ranges: the same residual Conv keeps a float output."""
    q, _ = _trained_residual_net()
    report = tf_bridge.export_onnx(q, tmp_path / "cpu.onnx", target="ort-cpu")
    assert report.parity.generated_inputs and bool(report.check), str(report)
    ops = B.optimized_ops(report.path, tmp_path)
    assert ops.count("QLinearConv") == 2 and {"Conv", "FusedConv"} & set(ops), " ".join(ops)
    table = json.loads(report.scales_path.read_text())
    assert "ort-cpu_ranges" not in table.get("metadata", {})
    (floating,) = [r for r in report.requantization if r["status"] == "not requantized"]
    assert floating["op_type"] == "Conv" and floating["amax"] is None
    assert f"float output, give sample_data: {floating['tensor']}" in str(report)
    assert report.to_dict()["requantization"][0]["status"] in ("added", "folded", "not requantized")


def test_deployed_parity_fails_for_a_wrong_scale(tmp_path):
    """The deployed check can fail: the ort-cpu model with one dequantization scale 25% off."""
    from onnx_qat.quantize import quantize
    from tf_bridge.export import deployed_parity
    from tf_bridge.onnx_values import run_with_tensors
    q, x = _trained_conv_relu_net()
    report = tf_bridge.export_onnx(q, tmp_path / "cpu.onnx", target="ort-cpu", sample_data=x, save_float=True)
    reference = quantize(onnx.load(report.float_path), scales=str(report.scales_path), target="tensorrt",
                         progress=False).model
    bad = onnx.load(report.path)
    first_dq = next(n for n in bad.graph.node if n.op_type == "DequantizeLinear"
                    and n.input[0] in {m.output[0] for m in bad.graph.node if m.op_type == "QuantizeLinear"})
    scale = next(t for t in bad.graph.initializer if t.name == first_dq.input[1])
    bad.graph.initializer.append(onnx.numpy_helper.from_array(
        onnx.numpy_helper.to_array(scale) * np.float32(1.25), "wrong_scale"))
    first_dq.input[1] = "wrong_scale"
    feeds = {bad.graph.input[0].name: x}
    names = [o.name for o in bad.graph.output]
    float_out = [run_with_tensors(onnx.load(report.float_path), feeds)[n] for n in names]
    keras_out = [np.asarray(q(x, training=False))]
    good = deployed_parity("ort-cpu", onnx.load(report.path), reference, feeds, names, keras_out, float_out)
    wrong = deployed_parity("ort-cpu", bad, reference, feeds, names, keras_out, float_out)
    assert good[0].passed and not wrong[0].passed and wrong[0].ratio > good[0].ratio, (good, wrong)
    assert "FAILED" in str(wrong[0])


def test_a_failing_tf2onnx_optimizer_pass_is_skipped_as_tf2onnx_does():
    """The conversion runs tf2onnx's optimizers without their per-pass graph copies; a pass that
    raises makes it convert again with tf2onnx's recovery, which skips that pass. Both conversions
    compute what Keras computes."""
    import onnxruntime as ort
    import tensorflow as tf
    from tf2onnx import optimizer
    from tf2onnx.optimizer.optimizer_base import GraphOptimizerBase

    from tf_bridge.export import _tf2onnx_without_conv_folding

    model = randomize_bn(mixed_cnn((16, 16, 3)))
    spec = tf.TensorSpec((None, 16, 16, 3), tf.float32, name="image")

    @tf.function(input_signature=[spec])
    def forward(x):
        return model(x, training=False)

    calls = []

    class FailingPass(GraphOptimizerBase):
        def _optimize(self, graph):
            calls.append(1)
            raise RuntimeError("this pass always fails")

    concrete = forward.get_concrete_function(spec)
    table = dict(optimizer._get_optimizers())
    plain = _tf2onnx_without_conv_folding(concrete, ["image"], 17)
    recovered = _tf2onnx_without_conv_folding(concrete, ["image"], 17,
                                              optimizers={"failing_pass": FailingPass, **table})
    assert len(calls) >= 2, "the failing pass ran once without recovery, then again with it"
    assert sorted(n.op_type for n in plain.graph.node) == sorted(n.op_type for n in recovered.graph.node)
    x = blobs(8, (16, 16, 3))[0]
    expected = model(x, training=False).numpy()
    for proto in (plain, recovered):
        got = ort.InferenceSession(proto.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"image": x})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _qdq_after(op: str):
    """x -> (op with 0) -> QuantizeLinear(scale 1) -> DequantizeLinear -> y; op None: Q reads x."""
    from onnx import TensorProto, helper, numpy_helper
    nodes, q_in = [], "x"
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int8), "z")]
    if op:
        inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "c"))
        nodes.append(helper.make_node(op, ["x", "c"], ["h"]))
        q_in = "h"
    nodes += [helper.make_node("QuantizeLinear", [q_in, "s", "z"], ["q"]),
              helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_rounding_sensitivity_nudges_every_computed_quantizer_input():
    """Values on rounding boundaries (2.5, 3.5: round half to even) computed by an Add (as a
    LayerNormalization or GELU computes them, differently in each engine): a last-bit nudge of
    the quantizer's input moves one of them a whole step, whichever its sign. The model's own
    input is the same in every engine and is not nudged."""
    from tf_bridge.export import rounding_sensitivity
    from tf_bridge.onnx_values import run_with_tensors
    x = np.array([2.5, 3.5], np.float32)
    for op, expected in (("Add", 1.0), (None, 0.0)):
        model = _qdq_after(op)
        base = run_with_tensors(model, {"x": x})["y"]
        assert list(base) == [2.0, 4.0]
        assert rounding_sensitivity(model, {"x": x}, ["y"], [base]) == (expected,)


def test_rounding_sensitivity_scales_with_a_sums_terms_not_its_result():
    """A MatMul whose terms (1000 and -997.5) cancel to just below a rounding boundary (2.4999):
    two last-bit units of the result (6e-7) cannot move it across 2.5, but another engine's sum
    of the same terms differs by about two units of their magnitudes (5e-4), which can; the
    sensitivity counts the latter (8 output channels, random signs: some move a whole step)."""
    from onnx import TensorProto, helper, numpy_helper

    from tf_bridge.export import rounding_sensitivity
    from tf_bridge.onnx_values import run_with_tensors
    inits = [numpy_helper.from_array(np.ones((2, 8), np.int8), "w_q"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0, np.int8), "zero")]
    nodes = [helper.make_node("DequantizeLinear", ["w_q", "one", "zero"], ["w"]),
             helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("QuantizeLinear", ["m", "one", "zero"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "one", "zero"], ["y"])]
    graph = helper.make_graph(nodes, "cancel",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    x = np.array([[1000.0, -997.5001]], np.float32)
    base = run_with_tensors(model, {"x": x})["y"]
    assert np.all(base == 2.0)
    assert rounding_sensitivity(model, {"x": x}, ["y"], [base]) == (1.0,)


def test_rounding_sensitivity_nudges_a_reductions_terms():
    """A LayerNormalization's mean (ReduceMean) of terms that cancel (1000 and about -995), just
    below 2.5 and just above 3.5: another engine's sum of the same terms differs by about two
    units of their magnitudes (2.4e-4), enough to move one of the two means a whole quantization
    step, whichever the sign of the nudge; two units of the quantizer input's own value (6e-7) are
    not."""
    from onnx import TensorProto, helper, numpy_helper

    from tf_bridge.export import rounding_sensitivity
    from tf_bridge.onnx_values import run_with_tensors
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0, np.int8), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    nodes = [helper.make_node("Mul", ["x", "one"], ["computed"]),  # the model's input is not nudged
             helper.make_node("ReduceMean", ["computed", "axes"], ["m"], keepdims=1),
             helper.make_node("QuantizeLinear", ["m", "one", "zero"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "one", "zero"], ["y"])]
    graph = helper.make_graph(nodes, "mean",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    x = np.array([[1000.0, -995.0001], [1000.0, -992.9999]], np.float32)
    base = run_with_tensors(model, {"x": x})["y"]
    assert base.ravel().tolist() == [2.0, 4.0]
    for draws in (1, 2, 3):
        assert rounding_sensitivity(model, {"x": x}, ["y"], [base], draws=draws) == (1.0,)


@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_a_mixed_precision_model_exports_as_its_float32_computation(tmp_path, scale):
    """A model built under ``mixed_float16`` (float32 variables, float16 compute) failed to export:
    its float twin converted to float16 ONNX weights, so no quantizer could be mapped ("no ONNX weight
    holds these values"); and the parity would have compared a float16 computation with a float32 one.
    Now the twin and the parity run compute in float32, the model exports with exact parity against
    that computation, and the model's own policies (and outputs) are as they were."""
    keras.utils.set_random_seed(11)
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = blobs(32, (16, 16, 3))
        x = x * scale
        inp = keras.Input((16, 16, 3))
        h = L.Conv2D(8, 3, padding="same", name="first_conv")(inp)
        h = L.ReLU()(L.BatchNormalization()(h))
        h = L.Add()([L.Conv2D(8, 3, padding="same", activation="relu")(h), h])
        h = L.GlobalAveragePooling2D()(h)
        model = keras.Model(inp, L.Dense(4, dtype="float32")(h))
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y % 4, epochs=1, verbose=0)  # trained: batch norm not settled
        q = _qat(model, x)
        q_out = np.asarray(q(x[:8], training=False))
        report = tf_bridge.export_onnx(q, tmp_path / "mp.onnx", sample_data=x[:8])
    finally:
        keras.mixed_precision.set_global_policy(before)
    _assert_parity(report)
    assert report.float32_layers and "mixed precision" in str(report)
    assert all(out.max_abs_qdq == 0.0 for out in report.parity.outputs), str(report)
    written = onnx.load(str(tmp_path / "mp.onnx"))
    assert onnx.TensorProto.FLOAT16 not in {t.data_type for t in written.graph.initializer}
    assert q.get_layer("first_conv").dtype_policy.name == "mixed_float16"  # restored
    assert np.array_equal(np.asarray(q(x[:8], training=False)), q_out)
