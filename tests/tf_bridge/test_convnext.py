"""A ConvNeXt block through the whole round trip (quantize, calibrate, fit, export, check).

ConvNeXt's block: a 7x7 depthwise convolution written as ``Conv2D(groups=channels)`` (Keras 3 runs
it on CPU inside an XLA-compiled function, which tf2onnx alone leaves unconverted), LayerNormalization,
two Dense layers as pointwise MatMuls around an exact GELU (TensorFlow's ``Erfc``, which tf2onnx 1.17
has no handler for), the layer-scale multiply and the residual join written ``x + y`` (a Keras
operation, not a layer: its TensorFlow op carries no layer scope).
"""
import os

import numpy as np
import onnx
import pytest

keras = pytest.importorskip("keras")

import tf_bridge  # noqa: E402

os.environ.setdefault("TF_BRIDGE_QUIET", "1")
L = keras.layers


def _convnext_like(channels=16, seed=0):
    from keras.src.applications.convnext import LayerScale

    keras.utils.set_random_seed(seed)
    inp = keras.Input((16, 16, 3))
    stem = L.Conv2D(channels, 4, strides=4, name="stem")(inp)
    stem = L.LayerNormalization(epsilon=1e-6, name="stem_ln")(stem)
    x = L.Conv2D(channels, 7, padding="same", groups=channels, name="block_depthwise_conv")(stem)
    x = L.LayerNormalization(epsilon=1e-6, name="block_layernorm")(x)
    x = L.Dense(4 * channels, name="block_pointwise_conv_1")(x)
    x = L.Activation("gelu", name="block_gelu")(x)
    x = L.Dense(channels, name="block_pointwise_conv_2")(x)
    x = LayerScale(0.1, channels, name="block_layer_scale")(x)
    x = stem + x  # a Keras operation, not a layer, as in keras.applications' ConvNeXt
    x = L.LayerNormalization(epsilon=1e-6, name="head_ln")(L.GlobalAveragePooling2D()(x))
    return keras.Model(inp, L.Dense(4, name="head")(x))


@pytest.mark.parametrize("kind", ["normal", "uniform255"])
def test_convnext_block_round_trip(kind, tmp_path):
    rng = np.random.default_rng(0)
    shape = (48, 16, 16, 3)
    x = (rng.normal(0, 1, shape) if kind == "normal" else rng.uniform(0, 255, shape)).astype("float32")
    y = rng.integers(0, 4, 48)
    q = tf_bridge.quantize_model(_convnext_like())
    tf_bridge.calibrate(q, x[:16], progress=False)
    q.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    q.fit(x, y, epochs=1, batch_size=16, verbose=0)
    report = tf_bridge.export_onnx(q, tmp_path / "block.onnx", sample_data=x[:16])

    assert report.passed and str(report).startswith("export_onnx: PASSED |"), str(report)
    assert not report.check.errors and not report.check.warnings, report.check.summary()
    for out in report.parity.outputs:
        assert out.max_abs_float > 0 and out.ratio <= 0.10 and out.abs_error <= 0.02, str(out)
    assert {e.quantizer for e in report.mapping} == {r.path for r in tf_bridge.quantizer_records(q)}
    model = onnx.load(report.path)
    types = {n.op_type for n in model.graph.node}
    assert "Erf" in types and "Erfc" not in types and "StatefulPartitionedCall" not in types
    grouped = [n for n in model.graph.node if n.op_type == "Conv"
               and any(a.name == "group" and a.i == 16 for a in n.attribute)]
    assert len(grouped) == 1, "the depthwise convolution is one grouped Conv"
    dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    weighted = [n for n in model.graph.node if n.op_type in ("Conv", "MatMul", "Gemm")]
    assert len(weighted) == 5 and all(n.input[0] in dq and n.input[1] in dq for n in weighted), \
        [n.name for n in weighted if not (n.input[0] in dq and n.input[1] in dq)]
    # the Keras model's own numbers, run in onnxruntime from the float model: the GELU as 1 - Erf
    # and the grouped Conv compute what TensorFlow computes to float32 rounding
    from tf_bridge.convert import convert_float_twin
    from tf_bridge.onnx_values import run_with_tensors
    twin = tf_bridge.float_model(q)
    proto = convert_float_twin(twin, 17)
    got = run_with_tensors(proto, {proto.graph.input[0].name: x[:8]})[proto.graph.output[0].name]
    want = np.asarray(twin(x[:8], training=False))
    assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, float(np.max(np.abs(want))))
