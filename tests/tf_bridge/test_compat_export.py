"""tf_bridge.compat's converters: the toolkit's documented workflow gives a Q/DQ ONNX model, never a
silent float one (behaviour 14 on docs/migration.md), and a layer class of your own goes end to end
(behaviour 18)."""
import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import onnx  # noqa: E402

import tf_bridge  # noqa: E402
from onnx_qat import check  # noqa: E402
from onnx_qat.errors import ExportError  # noqa: E402
from tf_bridge.compat import quantize_model, utils  # noqa: E402
from tf_bridge.compat.quantize_wrapper_base import BaseQuantizeWrapper  # noqa: E402
from tf_bridge.custom_layers import unregister_layer_quantization  # noqa: E402

from ..builders import count_ops, run  # noqa: E402


def _ops(path) -> dict:
    return count_ops(onnx.load(str(path)))


def _assert_clean_qdq(report, path, q_model, x):
    """A Q/DQ model that passes check with 0 errors and 0 warnings and computes what the Keras model does."""
    model = onnx.load(str(path))
    verdict = check(model)
    assert verdict.errors == () and verdict.warnings == (), verdict.summary()
    assert report.passed and report.parity.passed
    ops = count_ops(model)
    assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > ops["QuantizeLinear"]  # weights too
    got = run(model, {model.graph.input[0].name: x})[0]
    want = np.asarray(q_model(x, training=False))
    float_gap = np.max(np.abs(want - np.asarray(tf_bridge.float_model(q_model)(x, training=False))))
    assert np.max(np.abs(got - want)) <= 0.1 * float_gap + 1e-5


def test_b14_seed_basics_example_gives_an_int8_qdq_onnx_that_passes_check(tmp_path, monkeypatch):
    """The Basics page of the toolkit's docs, with model.export(dir) for tf.keras.models.save_model."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    train_images = rng.random((128, 28, 28, 1)).astype("float32")
    train_labels = rng.integers(0, 10, 128)

    assets = utils.CreateAssetsFolders("toolkit_basics")
    assets.add_folder("example")

    input_img = tf.keras.layers.Input(shape=(28, 28, 1))
    x = tf.keras.layers.Conv2D(filters=2, kernel_size=(3, 3))(input_img)
    x = tf.keras.layers.ReLU()(x)
    x = tf.keras.layers.Flatten()(x)
    x = tf.keras.layers.Dense(10)(x)
    model = tf.keras.Model(input_img, x)
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(train_images, train_labels, batch_size=32, epochs=1, validation_split=0.1, verbose=0)

    model.export(assets.example.fp32_saved_model, verbose=False)
    with pytest.warns(utils.FloatModelWarning, match="no tf_bridge quantizers"):
        assert utils.convert_saved_model_to_onnx(assets.example.fp32_saved_model,
                                                 assets.example.fp32_onnx_model) is None
    assert _ops(assets.example.fp32_onnx_model)["QuantizeLinear"] == 0

    q_model = quantize_model(model)
    q_model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    q_model.fit(train_images, train_labels, batch_size=32, epochs=1, validation_split=0.1, verbose=0)

    q_model.export(assets.example.int8_saved_model, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", utils.FloatModelWarning)
        report = utils.convert_saved_model_to_onnx(assets.example.int8_saved_model,
                                                   assets.example.int8_onnx_model)
    ops = _ops(assets.example.int8_onnx_model)
    assert (ops["QuantizeLinear"], ops["DequantizeLinear"]) == (2, 4)  # Conv and MatMul: input + weight
    _assert_clean_qdq(report, assets.example.int8_onnx_model, q_model, train_images[:8])


def _small_qat_model(seed=0):
    inp = keras.Input((8, 8, 3), name="image")
    x = keras.layers.Conv2D(16, 3, name="conv")(inp)
    x = keras.layers.BatchNormalization(name="bn")(x)
    x = keras.layers.ReLU(name="relu")(x)
    x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
    model = keras.Model(inp, keras.layers.Dense(4, name="head")(x), name="small")
    return model, quantize_model(model)


def test_b14_keras_file_in_memory_and_savedmodel_give_the_same_qdq_model(tmp_path):
    _, q_model = _small_qat_model()
    x = np.random.default_rng(1).uniform(0, 255, (16, 8, 8, 3)).astype("float32")  # uniform x255 inputs
    tf_bridge.calibrate(q_model, x, progress=False)
    q_model.save(tmp_path / "q.keras")
    q_model.export(str(tmp_path / "sm"), verbose=False)
    reports = {"memory": utils.convert_keras_model_to_onnx(q_model, tmp_path / "memory.onnx", sample_data=x),
               "keras": utils.convert_saved_model_to_onnx(tmp_path / "q.keras", tmp_path / "keras.onnx",
                                                          sample_data=x),
               "saved": utils.convert_saved_model_to_onnx(tmp_path / "sm", tmp_path / "saved.onnx",
                                                          sample_data=x)}
    outputs = {}
    for name, report in reports.items():
        _assert_clean_qdq(report, tmp_path / f"{name}.onnx", q_model, x)
        model = onnx.load(str(tmp_path / f"{name}.onnx"))
        outputs[name] = run(model, {model.graph.input[0].name: x})[0]
    np.testing.assert_array_equal(outputs["memory"], outputs["keras"])
    np.testing.assert_array_equal(outputs["memory"], outputs["saved"])


def test_b14_plain_tf2onnx_on_a_qat_savedmodel_is_float_and_a_record_less_one_is_refused(tmp_path):
    """Why the docs send users to the converters: tf2onnx itself writes no Q/DQ for a QAT SavedModel."""
    from tf2onnx import convert, tf_loader

    _, q_model = _small_qat_model()
    tf_bridge.calibrate(q_model, np.random.default_rng(2).normal(size=(8, 8, 8, 3)).astype("float32"),
                        progress=False)
    q_model.export(str(tmp_path / "sm"), verbose=False)
    graph_def, inputs, outputs = tf_loader.from_saved_model(str(tmp_path / "sm"), None, None, tag="serve",
                                                            signatures=["serving_default"])
    proto, _ = convert.from_graph_def(graph_def, input_names=inputs, output_names=outputs, opset=13)
    assert count_ops(proto)["QuantizeLinear"] == 0 and count_ops(proto)["Round"] > 0

    delattr(q_model, "_tf_bridge_rebuild_record")  # as a model exported without the record
    q_model.export(str(tmp_path / "bare"), verbose=False)
    with pytest.raises(ExportError) as err:
        utils.convert_saved_model_to_onnx(tmp_path / "bare", tmp_path / "bare.onnx")
    assert "\n" not in str(err.value) and "tf_bridge.export_onnx(q_model" in str(err.value)
    assert not (tmp_path / "bare.onnx").exists()


def test_b14_an_uncalibrated_qat_model_converts_like_the_toolkit_or_is_refused(tmp_path):
    _, q_model = _small_qat_model()
    with pytest.warns(utils.UncalibratedExportWarning, match="neither calibrated nor trained"):
        report = utils.convert_keras_model_to_onnx(q_model, tmp_path / "m.onnx")
    assert report.passed and _ops(tmp_path / "m.onnx")["QuantizeLinear"] == 3  # conv, gap, head inputs
    assert all(r.amax is None for r in tf_bridge.quantizer_records(q_model) if r.kind == "activation")
    with pytest.raises(ExportError, match="no range"):
        utils.convert_keras_model_to_onnx(q_model, tmp_path / "r.onnx", uncalibrated="raise")


@keras.saving.register_keras_serializable(package="test_compat_export")
class TiedDense(keras.layers.Layer):
    """A layer of our own: ``x @ w.T + b`` with ``w`` stored [units, features] (output channels on axis 0)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, shape):
        self.w = self.add_weight(shape=(self.units, shape[-1]), initializer="glorot_uniform", name="w")
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", name="b")

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.w)) + self.b

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@pytest.mark.parametrize("seed, scale", [(0, 1.0), pytest.param(3, 255.0, marks=pytest.mark.slow)],
                         ids=["normal", "uniform255"])
def test_b18_a_layer_class_of_your_own_goes_end_to_end(tmp_path, seed, scale):
    class TiedDenseQuantizeWrapper(BaseQuantizeWrapper):
        weights = {"w": 0}

    try:
        rng = np.random.default_rng(seed)
        inp = keras.Input((8, 8, 3), name="image")
        x = keras.layers.ReLU(name="relu")(keras.layers.Conv2D(16, 3, name="conv")(inp))
        x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
        x = keras.layers.ReLU(name="tied_relu")(TiedDense(32, name="tied")(x))
        model = keras.Model(inp, keras.layers.Dense(4, name="head")(x))
        q_model = quantize_model(model)
        data = (rng.normal(size=(64, 8, 8, 3)) if scale == 1.0 else rng.uniform(0, scale, (64, 8, 8, 3)))
        data = data.astype("float32")
        tf_bridge.calibrate(q_model, data, progress=False)
        records = {(r.layer, r.tensor): r for r in tf_bridge.quantizer_records(q_model) if r.kind == "weight"}
        assert records[("tied", "w")].channel_axes == (0,) and records[("tied", "w")].amax.shape == (32,)
        assert "tied.w" in tf_bridge.describe(q_model, print_fn=None)
        q_model.compile("adam", "mse")
        q_model.fit(data, rng.normal(size=(64, 4)).astype("float32"), epochs=1, batch_size=16, verbose=0)
        report = tf_bridge.export_onnx(q_model, tmp_path / "m.onnx", sample_data=data[:16], progress=False)
        _assert_clean_qdq(report, tmp_path / "m.onnx", q_model, data[:16])
        entry = next(e for e in report.mapping if e.quantizer == "tied")
        assert entry.kind == "weight" and "baked" not in entry.note
        assert _ops(tmp_path / "m.onnx")["DequantizeLinear"] == 7  # 4 activations + conv, tied, head weights
    finally:
        unregister_layer_quantization(TiedDense)


def _preact_net():
    """A two-block ResNet v2 (pre-activation): projection and max-pool shortcuts, BN after each Add."""
    L = keras.layers

    def bn_relu(x, name):
        return L.ReLU(name=f"{name}_relu")(L.BatchNormalization(name=f"{name}_bn")(x))

    inp = keras.Input((16, 16, 3), name="image")
    x = L.MaxPooling2D(3, strides=2, padding="same", name="pool1_pool")(
        L.Conv2D(16, 3, padding="same", name="conv1_conv")(inp))
    p = bn_relu(x, "b1_preact")
    y = bn_relu(L.Conv2D(16, 1, use_bias=False, name="b1_1_conv")(p), "b1_1")
    y = L.Conv2D(32, 1, name="b1_3_conv")(y)
    x = L.Add(name="b1_out")([L.Conv2D(32, 1, name="b1_0_conv")(p), y])
    p = bn_relu(x, "b2_preact")
    y = bn_relu(L.Conv2D(16, 1, use_bias=False, name="b2_1_conv")(p), "b2_1")
    y = L.ZeroPadding2D(1, name="b2_pad")(y)
    y = bn_relu(L.Conv2D(16, 3, strides=2, use_bias=False, name="b2_2_conv")(y), "b2_2")
    s = L.MaxPooling2D(1, strides=2, name="b2_pool")(x)
    x = L.Add(name="b2_out")([s, L.Conv2D(32, 1, name="b2_3_conv")(y)])
    x = L.GlobalAveragePooling2D(name="avg_pool")(bn_relu(x, "post"))
    return keras.Model(inp, L.Dense(4, name="predictions")(x), name="preact")


@pytest.mark.slow  # unmarked: test_export_architectures exports Keras's ResNet50V2 with this case
def test_b13_resnet_v2_case_entries_export_cleanly(tmp_path):
    """The toolkit's ResNet v2 entries (pre-activation BNs, MaxPools) pass TensorRT's rules in check."""
    from tf_bridge.compat.custom_qdq_cases import ResNetV2QDQCase

    rng = np.random.default_rng(4)
    data = rng.normal(size=(32, 16, 16, 3)).astype("float32")
    model = _preact_net()
    model.compile("adam", "mse")
    model.fit(data, rng.normal(size=(32, 4)).astype("float32"), epochs=1, verbose=0)  # BN statistics move
    q_model = quantize_model(model, custom_qdq_cases=[ResNetV2QDQCase()])
    records = tf_bridge.quantizer_records(q_model)
    consumers = {c for r in records if r.kind == "activation" for c in r.consumers}
    assert {"b1_preact_bn[0]", "b2_preact_bn[0]", "post_bn[0]", "pool1_pool[0]", "b2_pool[0]"} <= consumers
    assert {"b1_out[0]", "b2_out[0]"} <= consumers and not {"b1_out[1]", "b2_out[1]"} & consumers
    tf_bridge.calibrate(q_model, data, progress=False)
    report = utils.convert_keras_model_to_onnx(q_model, tmp_path / "v2.onnx", sample_data=data[:16])
    _assert_clean_qdq(report, tmp_path / "v2.onnx", q_model, data[:16])


def test_b7_weight_only_is_refused_and_input_only_is_written_with_a_check_warning(tmp_path):
    """The toolkit puts a Q/DQ on the weight (or the input) alone; TensorRT runs the layer in INT8 only with
    both quantized (check rule C9): a model with only a weight quantized has no INT8 model to write, and an
    input-only Conv is written with the check's error in a warning."""
    from tf_bridge.compat import QuantizationSpec

    model, _ = _small_qat_model()
    spec = QuantizationSpec()
    spec.add(name="conv", quantize_input=False)
    q_model = quantize_model(model, "partial", spec)
    with pytest.raises(ExportError, match=r"no Q/DQ pair to write.*conv\.kernel.*quantize_input=True") as err:
        utils.convert_keras_model_to_onnx(q_model, tmp_path / "w.onnx")
    assert "\n" not in str(err.value) and not (tmp_path / "w.onnx").exists()
    spec = QuantizationSpec()
    spec.add(name="conv", quantize_weight=False)
    q_model = quantize_model(model, "partial", spec)
    tf_bridge.calibrate(q_model, np.random.default_rng(5).normal(size=(8, 8, 8, 3)).astype("float32"),
                        progress=False)
    with pytest.warns(utils.CheckFailedWarning, match="C9"):
        report = utils.convert_keras_model_to_onnx(q_model, tmp_path / "i.onnx")
    assert report.parity.passed and not report.passed and _ops(tmp_path / "i.onnx")["QuantizeLinear"] == 1
