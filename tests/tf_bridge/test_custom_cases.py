"""Built-in CustomQDQInsertionCases on the matching keras.applications models (weights=None, small inputs)."""
import numpy as np
import pytest

keras = pytest.importorskip("keras")

import tf_bridge  # noqa: E402
from tf_bridge import ActivationQuantizer, QuantizeWrapper  # noqa: E402
from tf_bridge import custom_qdq_cases as cases  # noqa: E402

pytestmark = pytest.mark.tf
A = keras.applications


def _quantized_inputs(q_model):
    """{layer name: sorted quantized input indices} and {layer name: [quantizer]}."""
    inputs, by_consumer = {}, {}
    for layer in q_model.layers:
        if isinstance(layer, ActivationQuantizer):
            for name, idx in layer.consumers:
                inputs.setdefault(name, []).append(idx)
                by_consumer.setdefault(name, []).append(layer)
    return {k: sorted(v) for k, v in inputs.items()}, by_consumer


def _quantize(model, case):
    q = tf_bridge.quantize_model(model, custom_qdq_cases=[case])
    inputs, by_consumer = _quantized_inputs(q)
    return q, inputs, by_consumer


def _adds(model):
    return [layer.name for layer in model.layers if isinstance(layer, keras.layers.Add)]


def test_resnet50_v1_skip_quantized_conv_branch_float():
    model = A.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    q, inputs, by_consumer = _quantize(model, cases.ResNetV1QDQCase())
    adds = _adds(model)
    assert len(adds) == 16
    for name in adds:  # keras ResNet v1: Add([shortcut, conv-bn branch])
        assert inputs[name] == [0], name
    # the identity skip shares its quantizer with the next block's first conv
    skip_q = by_consumer["conv2_block2_add"][0]
    assert skip_q.producer == "conv2_block1_out"
    assert ["conv2_block2_1_conv", 0] in skip_q.consumers
    # without the case no Add is quantized
    plain, _ = _quantized_inputs(tf_bridge.quantize_model(model))
    assert not set(adds) & set(plain)


def test_resnet50_v2_skip_quantized():
    model = A.ResNet50V2(weights=None, input_shape=(32, 32, 3), classes=10)
    q, inputs, by_consumer = _quantize(model, cases.ResNetV2QDQCase())
    adds = _adds(model)
    assert len(adds) == 16 and all(inputs[name] == [0] for name in adds)
    # the three shortcut kinds: projection conv, identity, max pool
    assert by_consumer["conv2_block1_out"][0].producer == "conv2_block1_0_conv"
    assert by_consumer["conv2_block2_out"][0].producer == "conv2_block1_out"
    pool = by_consumer["conv2_block3_out"][0].producer
    assert isinstance(q.get_layer(pool), keras.layers.MaxPooling2D)
    # the conv branch (input 1) is left float in every block
    assert all(1 not in inputs[name] for name in adds)


def test_mobilenet_v2_block_input_quantized():
    model = A.MobileNetV2(weights=None, input_shape=(32, 32, 3), alpha=0.35, classes=10)
    q, inputs, by_consumer = _quantize(model, cases.MobileNetQDQCase())
    adds = _adds(model)
    assert len(adds) == 10
    for name in adds:  # Add([block input, project_BN])
        assert inputs[name] == [0], name
    assert by_consumer["block_2_add"][0].producer == "block_1_project_BN"


@pytest.mark.filterwarnings("ignore::tf_bridge.calibrate.UntrainedBatchNormWarning")
def test_efficientnet_b0_residual_and_squeeze_excite():
    model = A.EfficientNetB0(weights=None, input_shape=(32, 32, 3), classes=10)
    q, inputs, by_consumer = _quantize(model, cases.EfficientNetQDQCase())
    adds = _adds(model)
    assert adds and all(inputs[name] == [1] for name in adds)  # add([dropout(project_bn), inputs])
    assert by_consumer["block2b_add"][0].producer == "block2a_project_bn"
    excites = [layer.name for layer in model.layers if layer.name.endswith("se_excite")]
    assert len(excites) == 16 and all(inputs[name] == [0] for name in excites)
    # the excite's feature input shares the squeeze (GlobalAveragePooling) quantizer
    feature_q = by_consumer["block2b_se_excite"][0]
    assert ["block2b_se_squeeze", 0] in feature_q.consumers
    # preprocessing layers are copied, not quantized, and the model runs
    # (looked up by type: Keras names it "normalization_<k>" after k others built in this process)
    norm = next(layer.name for layer in model.layers if isinstance(layer, keras.layers.Normalization))
    assert not isinstance(q.get_layer(norm), QuantizeWrapper)
    x = np.random.default_rng(0).uniform(0, 255, (2, 32, 32, 3)).astype("float32")
    tf_bridge.calibrate(q, x, progress=False)
    got, ref = q.predict(x, verbose=0), model.predict(x, verbose=0)
    assert got.shape == (2, 10) and np.all(np.isfinite(got))
    assert np.abs(got - ref).max() < 0.5


def test_inception_v3_concat_inputs_share_one_scale():
    model = A.InceptionV3(weights=None, input_shape=(75, 75, 3), classes=10)
    q, inputs, _ = _quantize(model, cases.InceptionQDQCase())
    cats = [layer for layer in model.layers if isinstance(layer, keras.layers.Concatenate)]
    assert len(cats) == 15
    records = {r.path: r for r in tf_bridge.quantizer_records(q) if r.kind == "activation"}
    for cat in cats:
        assert cat.name not in inputs  # no per-input quantizers: one shared scale on the output
        record = records[f"{cat.name}_quant"]
        n = len(cat._inbound_nodes[0].input_tensors)
        assert record.tensor == f"{cat.name}:0" and len(record.shared_with) == n
    # layer names depend on what Keras built earlier in the process: look them up
    mixed0 = model.get_layer("mixed0")
    first_input = mixed0._inbound_nodes[0].input_tensors[0]._keras_history.operation.name
    assert records["mixed0_quant"].shared_with[0] == f"{first_input}:0"
    pools = [layer.name for layer in model.layers if isinstance(layer, keras.layers.AveragePooling2D)]
    assert pools and pools[0] in inputs  # default policy: AveragePooling2D input
    # the next block's convs read the shared quantizer, not a second one
    readers = [layer.name for layer in model.layers if isinstance(layer, keras.layers.Conv2D)
               and any(t is mixed0.output for node in layer._inbound_nodes for t in node.input_tensors)]
    assert readers
    consumers = q.get_layer("mixed0_quant").consumers
    assert all([name, 0] in consumers for name in readers)


def test_shared_scale_concat_equals_quantized_inputs():
    inp = keras.Input((6,), name="x")
    a = keras.layers.Dense(3, name="a")(inp)
    b = keras.layers.Dense(5, name="b")(inp)
    cat = keras.layers.Concatenate(name="cat")([a, b])
    model = keras.Model(inp, keras.layers.Dense(2, name="fc")(cat))
    spec = tf_bridge.QuantizationSpec().add("cat")
    q = tf_bridge.quantize_model(model, "partial", spec)
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    tf_bridge.calibrate(q, x, progress=False)
    ya, yb = model.get_layer("a")(x).numpy(), model.get_layer("b")(x).numpy()
    amax = max(np.abs(ya).max(), np.abs(yb).max())
    assert float(q.get_layer("cat_quant").amax_value()) == amax
    inner = keras.Model(q.input, q.get_layer("cat_quant").output)
    fq = tf_bridge.fake_quant_reference
    want = np.concatenate([fq(ya, amax), fq(yb, amax)], 1)
    np.testing.assert_array_equal(inner.predict(x, verbose=0), want)


def test_residual_case_on_any_add():
    inp = keras.Input((8, 8, 4), name="x")
    a = keras.layers.Conv2D(4, 1, name="c1")(inp)
    b = keras.layers.ReLU(name="r")(inp)
    s = keras.layers.Add(name="no_conv")([b, keras.layers.ReLU(name="r2")(inp)])
    t = keras.layers.Add(name="with_conv")([a, s])
    q, inputs, _ = _quantize(keras.Model(inp, t), cases.ResidualConnectionQDQCase())
    assert inputs["no_conv"] == [0, 1] and inputs["with_conv"] == [1]
    assert cases.ResidualConnectionQDQCase().info().startswith("Residual Adds")
