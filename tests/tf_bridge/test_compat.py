"""tf_bridge.compat: the user-facing behaviours of NVIDIA's tensorflow_quantization, on Keras 3.

Each test names the behaviour it covers with its number on the migration page (docs/migration.md,
"Results of NVIDIA's test files"). These tests read the Keras QAT model (which inputs and weights
carry quantizers); tests/tf_bridge/test_compat_export.py checks the ONNX side.
"""
import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

from onnx_qat.errors import ConfigError, ModelError  # noqa: E402
from tf_bridge import compat, quantizer_records  # noqa: E402
from tf_bridge.compat import custom_qdq_cases, utils  # noqa: E402
from tf_bridge.compat.quantize import LayerConfig, UnknownLayerNameWarning  # noqa: E402
from tf_bridge.custom_layers import BaseQuantizeWrapper, unregister_layer_quantization  # noqa: E402

L = keras.layers
MIGRATION = "see docs/migration.md"


# --------------------------------------------------------------------------- tiny networks
def vgg_like():
    """Reshape -> Conv2D x2 -> MaxPool -> Flatten -> Dense x2 (named layers)."""
    inp = keras.Input((12, 12), name="image")
    x = L.Reshape((12, 12, 1), name="reshape")(inp)
    x = L.Conv2D(4, 3, name="conv_0")(x)
    x = L.ReLU(name="relu_0")(x)
    x = L.Conv2D(4, 3, name="conv_1")(x)
    x = L.ReLU(name="relu_1")(x)
    x = L.MaxPooling2D(2, name="pool")(x)
    x = L.Flatten(name="flat")(x)
    x = L.Dense(8, name="dense_0")(x)
    x = L.ReLU(name="relu_2")(x)
    return keras.Model(inp, L.Dense(3, name="dense_1")(x), name="vgg_like")


def depthwise_net():
    inp = keras.Input((12, 12, 2), name="image")
    x = L.DepthwiseConv2D(3, name="dconv_0")(inp)
    x = L.ReLU(name="relu_0")(x)
    x = L.DepthwiseConv2D(3, name="dconv_1")(x)
    return keras.Model(inp, L.Flatten(name="flat")(x), name="depthwise_net")


def residual_net():
    """Conv-BN-ReLU stem, an identity block and a projection block (BN on every Conv), MaxPool, Dense."""
    inp = keras.Input((16, 16, 3), name="image")
    x = L.ReLU(name="stem_relu")(L.BatchNormalization(name="stem_bn")(L.Conv2D(8, 3, name="stem")(inp)))
    y = L.ReLU(name="b1_relu")(L.BatchNormalization(name="b1_bn1")(L.Conv2D(8, 3, padding="same",
                                                                            name="b1_conv1")(x)))
    y = L.BatchNormalization(name="b1_bn2")(L.Conv2D(8, 3, padding="same", name="b1_conv2")(y))
    x = L.ReLU(name="b1_out")(L.Add(name="add")([y, x]))
    y = L.ReLU(name="b2_relu")(L.BatchNormalization(name="b2_bn1")(L.Conv2D(8, 3, padding="same",
                                                                            name="b2_conv1")(x)))
    y = L.BatchNormalization(name="b2_bn2")(L.Conv2D(16, 3, strides=2, padding="same", name="b2_conv2")(y))
    s = L.BatchNormalization(name="b2_bn_s")(L.Conv2D(16, 3, strides=2, padding="same", name="b2_short")(x))
    x = L.ReLU(name="b2_out")(L.Add(name="add_1")([y, s]))
    x = L.Flatten(name="flat")(L.MaxPooling2D(2, name="pool")(x))
    return keras.Model(inp, L.Dense(3, name="dense")(x), name="residual_net")


def concat_net():
    inp = keras.Input((12, 12, 3), name="image")
    a = L.BatchNormalization(name="bn_a")(L.Conv2D(4, 1, name="conv_a")(inp))
    b = L.BatchNormalization(name="bn_b")(L.Conv2D(4, 3, padding="same", name="conv_b")(inp))
    x = L.Concatenate(name="concat")([L.ReLU(name="relu_a")(a), L.ReLU(name="relu_b")(b)])
    x = L.Flatten(name="flat")(L.MaxPooling2D(2, name="pool")(x))
    return keras.Model(inp, L.Dense(3, name="dense")(x), name="concat_net")


def placement(q_model) -> dict:
    """``{layer: (sorted quantized input indices, weights quantized)}`` read from the quantizer records."""
    inputs, weights = {}, set()
    for r in quantizer_records(q_model):
        if r.kind == "weight":
            weights.add(r.layer)
            continue
        if r.shared_with:  # a Concatenate whose inputs all share the quantizer on its output
            inputs.setdefault(r.layer, set()).update(range(len(r.shared_with)))
        for consumer in r.consumers:
            name, index = consumer[:-1].rsplit("[", 1)
            if r.layer != name:
                inputs.setdefault(name, set()).add(int(index))
    return {n: (tuple(sorted(inputs.get(n, ()))), n in weights) for n in set(inputs) | weights}


# --------------------------------------------------------------------------- 1-3, 11: the spec
def test_b1_weights_are_copied_into_the_quantized_model():
    model = vgg_like()
    q_model = compat.quantize_model(model)
    for name in ("conv_0", "conv_1", "dense_0", "dense_1"):
        for got, want in zip(q_model.get_layer(name).get_weights(), model.get_layer(name).get_weights()):
            np.testing.assert_array_equal(got, want)


def test_b2_b11_spec_add_one_name_at_a_time_and_layers_is_the_toolkit_list():
    spec = compat.QuantizationSpec()
    spec.add(name="conv_1")
    spec.add(name="Dense", is_keras_class=True)
    assert isinstance(spec.layers, list) and len(spec.layers) == 2
    assert isinstance(spec.layers[0], compat.quantize.LayerConfig)
    assert list(spec.entries) == spec.layers
    assert (spec.layers[1].name, spec.layers[1].is_keras_class) == ("Dense", True)
    spec.layers.extend([LayerConfig(name="conv_0", quantization_index=[0])])  # as toolkit cases do
    assert spec.entries[-1].quantization_index == (0,)
    assert len(spec.copy().layers) == 3 and spec.copy().layers is not spec.layers


def test_b3_spec_add_a_list_of_names_with_per_name_values():
    spec = compat.QuantizationSpec()
    spec.add(name=["conv_0", "conv_1", "dense_0", "dense_1"], quantize_input=[True, False, True, False],
             quantization_index=[None, [0], None, None])
    assert [e.name for e in spec.layers] == ["conv_0", "conv_1", "dense_0", "dense_1"]
    assert [e.quantize_input for e in spec.layers] == [True, False, True, False]
    assert spec.layers[1].quantization_index == (0,)
    with pytest.raises(ConfigError):
        compat.QuantizationSpec().add(name=["a", "b"], quantize_input=[True])


# --------------------------------------------------------------------------- 4-8: modes and entries
def test_b4_full_mode_quantizes_inputs_and_weights_of_conv_and_dense_only():
    got = placement(compat.quantize_model(vgg_like()))
    assert got == {n: ((0,), True) for n in ("conv_0", "conv_1", "dense_0", "dense_1")}
    got = placement(compat.quantize_model(depthwise_net()))
    assert got == {n: ((0,), True) for n in ("dconv_0", "dconv_1")}


def test_b5_partial_mode_quantizes_only_the_named_layers():
    spec = compat.QuantizationSpec()
    spec.add(name="conv_1")
    spec.add(name="dense_0")
    got = placement(compat.quantize_model(vgg_like(), quantization_mode="partial", quantization_spec=spec))
    assert got == {"conv_1": ((0,), True), "dense_0": ((0,), True)}


def test_b6_class_entries_in_partial_and_full_mode():
    spec = compat.QuantizationSpec()
    spec.add(name="Conv2D", is_keras_class=True)
    got = placement(compat.quantize_model(residual_net(), "partial", spec))
    convs = ("stem", "b1_conv1", "b1_conv2", "b2_conv1", "b2_conv2", "b2_short")
    assert got == {n: ((0,), True) for n in convs}
    spec = compat.QuantizationSpec()
    spec.add(name="MaxPooling2D", is_keras_class=True)
    spec.add(name="Add", is_keras_class=True)
    got = placement(compat.quantize_model(residual_net(), quantization_spec=spec))
    assert got["pool"] == ((0,), False) and got["add"] == ((0, 1), False) and got["add_1"] == ((0, 1), False)
    assert got["dense"] == ((0,), True)


@pytest.mark.parametrize("build, name",
                         [(vgg_like, "conv_0"), (depthwise_net, "dconv_1"), (vgg_like, "dense_1")],
                         ids=["Conv2D", "DepthwiseConv2D", "Dense"])
def test_b7_input_only_and_weight_only(build, name):
    for kwargs, want in (({"quantize_weight": False}, ((0,), False)),
                         ({"quantize_input": False}, ((), True))):
        spec = compat.QuantizationSpec()
        spec.add(name=name, **kwargs)
        got = placement(compat.quantize_model(build(), quantization_mode="partial", quantization_spec=spec))
        assert got == {name: want}, kwargs


def test_b8_input_indices_on_add_and_concatenate():
    spec = compat.QuantizationSpec()
    spec.add(name="add", quantize_input=True, quantize_weight=False, quantization_index=[1])
    got = placement(compat.quantize_model(residual_net(), "partial", spec))
    assert got == {"add": ((1,), False)}
    for index, want in (([0], (0,)), ([0, 1], (0, 1))):
        spec = compat.QuantizationSpec()
        spec.add(name="concat", quantize_weight=False, quantization_index=index)
        got = placement(compat.quantize_model(concat_net(), "partial", spec))
        assert got == {"concat": (want, False)}, index


# --------------------------------------------------------------------------- 9, 10, 13: cases
def test_b9_custom_cases_are_applied_in_full_mode():
    cases = [custom_qdq_cases.ResNetV1QDQCase()]
    got = placement(compat.quantize_model(residual_net(), custom_qdq_cases=cases))
    assert got["add"] == ((1,), False)  # the identity skip; the Conv-BN branch (input 0) stays float
    assert got["add_1"] == ((1,), False)  # one Conv-BN branch stays float, the other is quantized
    assert got["b1_conv1"] == ((0,), True)


@pytest.fixture(scope="module")
def resnet50():
    return keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3))


def test_b10_resnet_v1_case_entries_on_keras_resnet50(resnet50):
    model = resnet50
    entries = {e.name: e for e in custom_qdq_cases.ResNetV1QDQCase().case(model, compat.QuantizationSpec())}
    adds = {layer.name for layer in model.layers if isinstance(layer, L.Add)}
    assert set(entries) == adds and len(adds) == 16
    for name in adds:
        block = name.rsplit("_", 1)[0]
        identity = not block.endswith("block1")
        if identity:  # input 0 is the identity shortcut, input 1 the Conv-BN branch (left float)
            assert entries[name].quantization_index == (0,), name
        assert not entries[name].quantize_weight


def test_b13_resnet_v2_case_places_residual_batchnorm_and_maxpool_entries():
    model = keras.applications.ResNet50V2(weights=None, input_shape=(32, 32, 3))
    entries = {e.name: e for e in custom_qdq_cases.ResNetV2QDQCase().case(model, compat.QuantizationSpec())}
    stages = {"conv2": 3, "conv3": 4, "conv4": 6, "conv5": 3}
    outs = {f"{s}_block{i}_out" for s, n in stages.items() for i in range(1, n + 1)}
    bns = {f"{s}_block{i}_preact_bn" for s, n in stages.items() for i in range(1, n + 1)} | {"post_bn"}
    pools = {layer.name for layer in model.layers if isinstance(layer, L.MaxPooling2D)}
    assert len(pools) == 4 and "pool1_pool" in pools
    assert set(entries) == outs | bns | pools
    for name in bns | pools:
        assert entries[name].quantize_input and not entries[name].quantize_weight
        assert entries[name].quantization_index is None
    for name in outs:
        assert entries[name].quantization_index == (0,), name  # the shortcut; the Conv branch stays float


# --------------------------------------------------------------------------- 12: unknown names
def test_b12_unknown_layer_name_warns_and_goes_on_or_raises_on_request():
    spec = compat.QuantizationSpec()
    spec.add(name="add", quantize_weight=False, quantization_index=[1])
    spec.add(name="wrong_layer")
    with pytest.warns(UnknownLayerNameWarning, match="wrong_layer"):
        q_model = compat.quantize_model(residual_net(), quantization_mode="partial", quantization_spec=spec)
    assert placement(q_model) == {"add": ((1,), False)}
    assert len(spec.layers) == 2  # the caller's spec is not modified
    with pytest.raises(ConfigError, match="wrong_layer"):
        compat.quantize_model(residual_net(), quantization_mode="partial", quantization_spec=spec,
                              unknown_names="raise")
    from tf_bridge import quantize_model

    with pytest.raises(ConfigError, match="wrong_layer"):
        quantize_model(residual_net(), quantization_mode="partial", quantization_spec=spec)
    with pytest.raises(ConfigError, match="give quantization_spec"):
        compat.quantize_model(residual_net(), quantization_mode="partial")


# --------------------------------------------------------------------------- 15-17: utils
def test_b15_create_assets_folders_paths_and_cleaning(tmp_path):
    assets = utils.CreateAssetsFolders(tmp_path / "base")
    assets.add_folder("exp")
    folder = assets.exp
    assert folder.fp32_saved_model == str(tmp_path / "base/exp/fp32/saved_model")
    assert folder.int8_onnx_model == str(tmp_path / "base/exp/int8/quantized.onnx")
    keep = tmp_path / "base/exp/int8/notes.txt"
    keep.write_text("mine")
    (tmp_path / "base/exp/int8/quantized.onnx").write_bytes(b"old")
    assets.add_folder("exp")  # a second run: the old artifact goes, other files stay
    assert not (tmp_path / "base/exp/int8/quantized.onnx").exists() and keep.read_text() == "mine"


def test_b16_keras_model_traveller_lists_layers_of_nested_models():
    inner = vgg_like()
    inp = keras.Input((12, 12), name="outer_in")
    outer = keras.Model(inp, L.Dense(2, name="head")(inner(inp)), name="outer")
    names = utils.KerasModelTraveller().get_layer_names(outer)
    assert names == ["outer_in"] + [layer.name for layer in inner.layers] + ["head"]
    dense = utils.KerasModelTraveller().get_layer_names(outer, filter_by_class=[L.Dense])
    assert dense == ["dense_0", "dense_1", "head"]
    with pytest.raises(ModelError):
        utils.KerasModelTraveller().get_layer_names(L.Dense(2))


def test_b17_find_my_predecessors_and_successors_on_resnet50(resnet50):
    model = resnet50
    pred = utils.find_my_predecessors(model, "conv2_block1_add")
    assert [(p["class"], p["name"]) for p in pred] == [("BatchNormalization", "conv2_block1_0_bn"),
                                                        ("BatchNormalization", "conv2_block1_3_bn")]
    succ = utils.find_my_successors(model, "pool1_pool")
    assert sorted((s["class"], s["name"]) for s in succ) == [("Conv2D", "conv2_block1_0_conv"),
                                                             ("Conv2D", "conv2_block1_1_conv")]
    assert utils.find_my_predecessors(model, "no_such_layer") is None
    with pytest.raises(ModelError):
        utils.find_my_successors(model, 3)


# --------------------------------------------------------------------------- 18: new layer support
@keras.saving.register_keras_serializable(package="test_compat")
class Scale(L.Layer):
    """A layer of our own: per-channel scale ``x * s`` (weight ``s``, one value per channel)."""

    def build(self, shape):
        self.s = self.add_weight(shape=(shape[-1],), initializer="ones", name="s")

    def call(self, x):
        return x * self.s


def test_b18_base_quantize_wrapper_declares_a_layer_class_of_your_own():
    try:
        class ScaleQuantizeWrapper(BaseQuantizeWrapper):  # the toolkit's naming convention
            weights = {}
            quantize_by_default = True

        inp = keras.Input((6, 6, 4), name="image")
        x = Scale(name="scale")(L.Conv2D(4, 3, name="conv")(inp))
        q_model = compat.quantize_model(keras.Model(inp, x))
        assert placement(q_model) == {"conv": ((0,), True), "scale": ((0,), False)}
        with pytest.raises(TypeError, match="declaration"):
            ScaleQuantizeWrapper(None)
        base = type("SharedBase", (BaseQuantizeWrapper,), {"weights": {"s": -1}})  # declares nothing
        assert not hasattr(base, "declaration")
        assert type("ScaleQuantizeWrapper", (base,), {}).declaration.weights == (("s", (-1,)),)
    finally:
        unregister_layer_quantization("Scale")
    assert placement(compat.quantize_model(keras.Model(inp, x))) == {"conv": ((0,), True)}


# --------------------------------------------------------------------------- 19: by design
def test_b19_quantized_layers_keep_their_names():
    """The toolkit renames a wrapped layer 'quant_<name>'; tf_bridge keeps the layer name, so the
    toolkit's ONNX scope checks (which look for 'quant_<name>') do not apply (docs/migration.md,
    behaviour 19)."""
    model = vgg_like()
    quantized = compat.quantize_model(model)
    names = {layer.name for layer in quantized.layers}
    assert {"conv_0", "conv_1", "dense_0", "dense_1"} <= names
    assert not [name for name in names if name.startswith("quant_")]


def test_no_warning_for_known_names():
    spec = compat.QuantizationSpec()
    spec.add(name="conv_0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownLayerNameWarning)
        compat.quantize_model(vgg_like(), quantization_mode="partial", quantization_spec=spec)
