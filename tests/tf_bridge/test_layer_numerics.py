"""After calibrate(method="max") a quantized layer equals a NumPy reference of the contract."""
import numpy as np
import pytest

keras = pytest.importorskip("keras")

import tf_bridge  # noqa: E402
from tf_bridge.fake_quant import fake_quant_reference  # noqa: E402

from .models import single_layer_model  # noqa: E402

pytestmark = pytest.mark.tf
RNG = np.random.default_rng(7)


def _fq_weight(w, channel_axes):
    keep = {a % w.ndim for a in channel_axes}
    amax = np.max(np.abs(w), axis=tuple(a for a in range(w.ndim) if a not in keep), keepdims=True)
    return fake_quant_reference(w, amax, narrow_range=True)


def _fq_input(x):
    return fake_quant_reference(x, np.max(np.abs(x)), narrow_range=False)


def _quantized_output(layer, x):
    model = single_layer_model(layer, x.shape[1:])
    q_model = tf_bridge.quantize_model(model)
    tf_bridge.calibrate(q_model, x, method="max", batch_size=len(x), progress=False)
    return q_model.predict(x, verbose=0), model


def _conv_valid(x, k):  # x [n,h,w,c], k [kh,kw,c,o]
    win = np.lib.stride_tricks.sliding_window_view(x.astype(np.float64), k.shape[:2], axis=(1, 2))
    return np.einsum("nhwcab,abco->nhwo", win, k.astype(np.float64))


def _check(got, want):
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_dense_matches_numpy():
    x = RNG.normal(0, 1.5, (16, 20)).astype(np.float32)
    got, model = _quantized_output(keras.layers.Dense(7, name="fc"), x)
    k, b = model.get_layer("fc").get_weights()
    want = _fq_input(x).astype(np.float64) @ _fq_weight(k, (-1,)) + b
    _check(got, want)
    # and differs from float (quantization is really applied)
    assert np.abs(got - model.predict(x, verbose=0)).max() > 1e-4


def test_conv2d_matches_numpy():
    x = RNG.normal(0, 1, (4, 12, 12, 3)).astype(np.float32)
    got, model = _quantized_output(keras.layers.Conv2D(5, 3, name="conv", bias_initializer="ones"), x)
    k, b = model.get_layer("conv").get_weights()
    _check(got, _conv_valid(_fq_input(x), _fq_weight(k, (-1,))) + b)


def test_depthwise_conv2d_matches_numpy():
    x = RNG.normal(0, 1, (3, 10, 10, 4)).astype(np.float32)
    got, model = _quantized_output(keras.layers.DepthwiseConv2D(3, depth_multiplier=2, name="dw"), x)
    k, b = model.get_layer("dw").get_weights()  # [3, 3, 4, 2]
    kq, xq = _fq_weight(k, (-2, -1)), _fq_input(x)
    win = np.lib.stride_tricks.sliding_window_view(xq.astype(np.float64), (3, 3), axis=(1, 2))
    want = np.einsum("nhwcab,abcm->nhwcm", win, kq.astype(np.float64)).reshape(3, 8, 8, 8) + b
    _check(got, want)


def test_conv2d_transpose_matches_numpy():
    x = RNG.normal(0, 1, (2, 5, 5, 3)).astype(np.float32)
    got, model = _quantized_output(keras.layers.Conv2DTranspose(4, 3, strides=2, name="up"), x)
    k, b = model.get_layer("up").get_weights()  # [3, 3, out=4, in=3]
    kq, xq = _fq_weight(k, (-2,)).astype(np.float64), _fq_input(x).astype(np.float64)
    want = np.zeros((2, 11, 11, 4))
    for i in range(5):
        for j in range(5):
            want[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3, :] += np.einsum("nc,aboc->nabo", xq[:, i, j], kq)
    _check(got, want + b)


def test_separable_conv2d_quantizes_both_kernels_and_the_depthwise_output():
    """Both convolutions of a SeparableConv2D run on int8 inputs: the depthwise output is
    fake-quantized (its own calibrated amax) before the pointwise convolution."""
    x = RNG.normal(0, 1, (2, 9, 9, 3)).astype(np.float32)
    got, model = _quantized_output(keras.layers.SeparableConv2D(4, 3, name="sep"), x)
    dk, pk, b = model.get_layer("sep").get_weights()
    dq, pq, xq = _fq_weight(dk, (-2, -1)), _fq_weight(pk, (-1,)), _fq_input(x)
    win = np.lib.stride_tricks.sliding_window_view(xq.astype(np.float64), (3, 3), axis=(1, 2))
    mid = np.einsum("nhwcab,abcm->nhwcm", win, dq.astype(np.float64)).reshape(2, 7, 7, 3)
    # calibration sees every tensor unquantized: the depthwise amax is measured on float inputs
    win_x = np.lib.stride_tricks.sliding_window_view(x.astype(np.float64), (3, 3), axis=(1, 2))
    amax = np.abs(np.einsum("nhwcab,abcm->nhwcm", win_x, dq.astype(np.float64))).max()
    want = fake_quant_reference(mid, amax, narrow_range=False) @ pq[0, 0].astype(np.float64) + b
    _check(got, want)
    unquantized_mid = mid @ pq[0, 0].astype(np.float64) + b
    assert np.abs(got - unquantized_mid).max() > 1e-3  # the depthwise output's quantization shows


def test_weight_amax_is_recomputed_every_step():
    x = RNG.normal(0, 1, (8, 6)).astype(np.float32)
    q_model = tf_bridge.quantize_model(single_layer_model(keras.layers.Dense(3, name="fc"), (6,)))
    tf_bridge.calibrate(q_model, x, progress=False)
    wrapper = q_model.get_layer("fc")
    kernel = wrapper.layer.kernel
    kernel.assign(kernel.numpy() * 3.0)
    np.testing.assert_allclose(wrapper.weight_amax()["kernel"], np.abs(kernel.numpy()).max(axis=0))
    want = _fq_input(x).astype(np.float64) @ _fq_weight(kernel.numpy(), (-1,)) + wrapper.layer.bias.numpy()
    _check(q_model.predict(x, verbose=0), want)


def test_separable_conv2d_depthwise_range_is_saved_and_loaded(tmp_path):
    """The depthwise output's quantizer lives in the wrapper: describe lists it, a .keras file
    keeps its range, and the loaded model computes the same numbers."""
    x = RNG.normal(0, 1, (4, 9, 9, 3)).astype(np.float32)
    q_model = tf_bridge.quantize_model(single_layer_model(keras.layers.SeparableConv2D(4, 3, name="sep"),
                                                          x.shape[1:]))
    tf_bridge.calibrate(q_model, x, progress=False)
    records = {r.path: r for r in tf_bridge.quantizer_records(q_model)}
    inner = records["sep_depthwise_quant"]
    assert inner.kind == "activation" and inner.inside == "sep" and float(inner.amax) > 0
    assert "sep:depthwise -> sep (pointwise)" in tf_bridge.describe(q_model, print_fn=None)
    q_model.save(tmp_path / "sep.keras")
    loaded = tf_bridge.load_model(tmp_path / "sep.keras")
    again = {r.path: r for r in tf_bridge.quantizer_records(loaded)}["sep_depthwise_quant"]
    assert float(again.amax) == float(inner.amax)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), q_model.predict(x, verbose=0))
