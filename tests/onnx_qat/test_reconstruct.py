"""Sequential reconstruction (`onnx_qat.accuracy.reconstruct`) and the smoothing of depthwise Conv inputs
(`onnx_qat.accuracy.smooth`), on graphs built in code."""
import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.errors import ConfigError
from onnx_qat.accuracy.reconstruct import changed, reconstruct
from onnx_qat.accuracy.smooth import smooth
from onnx_qat.scales import ScaleTable
from tests.builders import GraphBuilder, assert_check_clean, cosine, run
from tests.onnx_qat.test_accuracy_optimize import _assert_same_function, _copy, _feeds, spread_pair_model


def _quantized(model, calib, method="max"):
    table = onnx_qat.calibrate(model, calib, method=method, progress=False)
    return table, onnx_qat.quantize(model, scales=table, progress=False)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reconstruction_lowers_the_error_on_unseen_inputs_and_stays_on_the_grid(seed):
    """conv1 -> Relu -> depthwise conv2 -> Relu -> conv3 with channel ranges 30x apart: each op fitted
    on the Q/DQ model's own input beats round to nearest on inputs it was not fitted on, and the
    inserter stores exactly the integers chosen."""
    model = spread_pair_model(seed, spread=30.0)
    calib, unseen = _feeds(seed, n=32), _feeds(100 + seed, n=16)
    table, plain = _quantized(model, calib)
    fitted = _copy(model)
    qdq = _copy(plain.model)
    records, ranges = reconstruct(fitted, qdq, plain.placement, calib)
    assert {r["node"] for r in records} == {"conv1", "conv2", "conv3"}
    done = [r for r in records if r["method"] == "reconstructed"]
    assert len(done) >= 2 and all(r["error"] < r["rtn_error"] for r in done), records
    rebuilt = onnx_qat.quantize(fitted, scales=table.merged(ScaleTable(weights=ranges)), progress=False)
    assert_check_clean(rebuilt.model)
    ints = {t.name: t for t in qdq.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    again = {t.name: t for t in rebuilt.model.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert ints.keys() == again.keys() and all(ints[k] == again[k] for k in ints)
    ref = run(model, unseen)[0]
    before, after = cosine(run(plain.model, unseen)[0], ref), cosine(run(rebuilt.model, unseen)[0], ref)
    assert after > before and 1 - after < 0.95 * (1 - before), (before, after)


def test_reconstruction_keeps_round_to_nearest_with_too_few_rows():
    model = spread_pair_model(0, spread=30.0, size=2)
    calib = _feeds(0, n=1, size=2)  # 4 positions: conv1 needs 4 x 4 rows, conv2 4 x 9, conv3 4 x 16
    _, plain = _quantized(model, calib)
    fitted, qdq = _copy(model), _copy(plain.model)
    records, ranges = reconstruct(fitted, qdq, plain.placement, calib)
    assert not ranges and all(r["method"] == "rtn" and "rows" in r["reason"] for r in records), records
    assert _int8(qdq) == _int8(plain.model) and fitted == model


def linear_model(seed: int = 0, dim: int = 64, out: int = 32, spread: float = 100.0) -> onnx.ModelProto:
    """input [N, 16, dim] -> fc1 (MatMul + Add) -> Relu -> fc2 (MatMul + Add) -> output. The first
    reduction row of each weight is ``spread`` times the others, so each output channel's INT8 scale
    leaves the other weights a few levels and their rounding error is most of the output error."""
    b = GraphBuilder("linear", seed)
    x = b.input("input", ["N", 16, dim])
    w1 = (b.rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)
    w1[0] *= spread
    y = b.node("MatMul", [x, b.const("fc1.weight", w1)], name="fc1")
    y = b.node("Add", [y, b.const("fc1.bias", (b.rng.standard_normal(dim) * 0.1).astype(np.float32))],
               name="fc1_bias")
    y = b.node("Relu", [y], name="act")
    w2 = (b.rng.standard_normal((dim, out)) / np.sqrt(dim)).astype(np.float32)
    w2[0] *= spread
    y = b.node("MatMul", [y, b.const("fc2.weight", w2)], name="fc2")
    b.node("Add", [y, b.const("fc2.bias", np.zeros(out, np.float32))], "output", name="fc2_bias")
    b.output("output")
    return b.build()


def _correlated_feeds(seed: int, n: int, dim: int = 64):
    """Inputs whose channels are mixtures of a few strong directions (a LayerNorm output's kind)."""
    mix = np.random.default_rng(1234).standard_normal((dim, dim)) * (0.8 ** np.arange(dim))[:, None]
    z = np.random.default_rng(seed).standard_normal((n, 16, dim))
    return {"input": (z @ mix).astype(np.float32)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_error_compensated_rounding_beats_rounding_the_fit_to_nearest(seed):
    """``rounding="gptq"`` (the default) puts each op's least-squares weights on the INT8 grid row by
    row, spreading each row's error over the rows after it; on correlated inputs and coarse weight
    grids it lowers every op's output error on the calibration rows and the output error on unseen
    inputs by a quarter or more against rounding the same fit to nearest (which some ops then do not
    keep: it does not beat round to nearest there); the inserter stores the
    integers chosen and check passes."""
    model = linear_model(seed)
    calib, unseen = _correlated_feeds(seed, 32), _correlated_feeds(100 + seed, 16)
    table, plain = _quantized(model, calib)
    ref = run(model, unseen)[0]
    found = {}
    for rounding in ("nearest", "gptq"):
        fitted, qdq = _copy(model), _copy(plain.model)
        records, ranges = reconstruct(fitted, qdq, plain.placement, calib, rounding=rounding)
        if rounding == "gptq":
            assert [r["method"] for r in records] == ["reconstructed"] * 2, records
        rebuilt = onnx_qat.quantize(fitted, scales=table.merged(ScaleTable(weights=ranges)), progress=False)
        assert_check_clean(rebuilt.model)
        assert _int8(rebuilt.model) == _int8(qdq)
        found[rounding] = [r["error"] for r in records], cosine(run(rebuilt.model, unseen)[0], ref)
    (near_errors, near), (errors, after) = found["nearest"], found["gptq"]
    assert all(e < n for e, n in zip(errors, near_errors)), found
    assert 1 - after < 0.75 * (1 - near), found


def test_reconstruction_refuses_an_unknown_rounding():
    model = linear_model(0)
    calib = _correlated_feeds(0, 4)
    _, plain = _quantized(model, calib)
    with pytest.raises(ConfigError, match="rounding must be one of gptq, nearest"):
        reconstruct(_copy(model), _copy(plain.model), plain.placement, calib, rounding="adaround")


def _int8(model) -> dict:
    return {t.name: t.SerializeToString() for t in model.graph.initializer
            if t.data_type == onnx.TensorProto.INT8}


def head_model(seed: int = 0, channels: int = 32, classes: int = 16, size: int = 8,
               spread: float = 300.0) -> onnx.ModelProto:
    """A classifier's head: conv (3x3, 4 -> C, bias) -> Relu -> GlobalAveragePool -> Flatten -> head
    (MatMul C -> classes) -> Add (bias) -> output. conv's first output channel is ``spread`` times the
    others, so the pooling input's one INT8 scale rounds the other channels to a few levels and the
    pooled values lose a shift that every input shares; the head has one row per sample, too few for a
    weight fit (the full pass leaves it at round to nearest)."""
    b = GraphBuilder("head", seed)
    x = b.input("input", ["N", 4, size, size])
    w1 = (b.rng.standard_normal((channels, 4, 3, 3)) * 0.3).astype(np.float32)
    w1[0] *= spread
    b1 = (np.abs(b.rng.standard_normal(channels)) * 0.2).astype(np.float32)
    y = b.node("Conv", [x, b.const("conv.weight", w1), b.const("conv.bias", b1)], name="conv",
               kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    y = b.node("Relu", [y], name="act")
    y = b.node("GlobalAveragePool", [y], name="pool")
    y = b.node("Flatten", [y], name="flatten")
    w2 = (b.rng.standard_normal((channels, classes)) * 0.5).astype(np.float32)
    y = b.node("MatMul", [y, b.const("head.weight", w2)], name="head")
    b.node("Add", [y, b.const("head.bias", np.zeros(classes, np.float32))], "output", name="head_bias")
    b.output("output")
    return b.build()


def _head_feeds(seed: int, n: int = 16, size: int = 8):
    return {"input": np.random.default_rng(seed).standard_normal((n, 4, size, size)).astype(np.float32)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bias_correction_alone_removes_the_shift_a_head_is_left_with(seed):
    """``weights=False``: every op keeps its round-to-nearest integers (the inserter stores the same
    bytes) and takes the mean shift of its output on the Q/DQ model's input into its bias; the head
    (16 rows for 32 reduction rows, left at round to nearest by the full pass) loses the shift of its
    pooled input, and the output error on unseen inputs falls by a quarter or more; check passes."""
    model = head_model(seed)
    calib, unseen = _head_feeds(seed), _head_feeds(100 + seed)
    table, plain = _quantized(model, calib)
    full, _ = reconstruct(_copy(model), _copy(plain.model), plain.placement, calib)
    assert {r["node"]: r["method"] for r in full} == {"conv": "reconstructed", "head": "rtn"}, full
    fitted, qdq = _copy(model), _copy(plain.model)
    records, ranges = reconstruct(fitted, qdq, plain.placement, calib, weights=False)
    assert {r["node"]: r["method"] for r in records} == {"conv": "bias", "head": "bias"}, records
    assert changed(records) == 2 and not ranges
    rebuilt = onnx_qat.quantize(fitted, scales=table, progress=False)
    assert_check_clean(rebuilt.model)
    assert _int8(rebuilt.model) == _int8(plain.model)
    ref = run(model, unseen)[0]
    before, after = cosine(run(plain.model, unseen)[0], ref), cosine(run(rebuilt.model, unseen)[0], ref)
    assert 1 - after < 0.75 * (1 - before), (before, after)


def test_bias_correction_alone_is_deterministic():
    model = head_model(1)
    calib = _head_feeds(1)
    _, plain = _quantized(model, calib)
    out = []
    for _ in range(2):
        fitted = _copy(model)
        reconstruct(fitted, _copy(plain.model), plain.placement, calib, weights=False)
        out.append(fitted.SerializeToString())
    assert out[0] == out[1]


def test_reconstruction_is_deterministic():
    model = spread_pair_model(1, spread=30.0)
    calib = _feeds(1, n=16)
    _, plain = _quantized(model, calib)
    out = []
    for _ in range(2):
        fitted = _copy(model)
        reconstruct(fitted, _copy(plain.model), plain.placement, calib)
        out.append(fitted.SerializeToString())
    assert out[0] == out[1]


@pytest.mark.parametrize("activation", ["Relu", "none"])
@pytest.mark.parametrize("seed", [0, 1])
def test_smoothing_a_depthwise_input_flattens_its_channels_and_keeps_the_function(activation, seed):
    """A tensor only a depthwise Conv reads, channels 300x apart: its per-output-channel weight scales
    take each channel's range whole (alpha 1), the function is unchanged and INT8 recovers."""
    model = spread_pair_model(seed, spread=300.0, activation=activation)
    calib, unseen = _feeds(seed, n=16), _feeds(50 + seed, n=16)
    smoothed = _copy(model)
    records = smooth(smoothed, calib)
    depthwise = [r for r in records if r["readers"] == ["conv2"]]
    assert len(depthwise) == 1 and depthwise[0]["spread_before"] > 10 and depthwise[0]["spread_after"] < 1.5
    _assert_same_function(model, smoothed, unseen)
    ref = run(model, unseen)[0]
    _, plain = _quantized(model, calib)
    _, better = _quantized(smoothed, calib)
    assert_check_clean(better.model)
    assert cosine(run(better.model, unseen)[0], ref) > cosine(run(plain.model, unseen)[0], ref) + 0.01


def test_smoothing_leaves_a_depthwise_input_with_even_channels_alone():
    model = spread_pair_model(0, spread=1.0)
    assert not [r for r in smooth(_copy(model), _feeds(0, n=16)) if r["readers"] == ["conv2"]]


def test_reconstruction_leaves_a_graph_it_cannot_cut_alone():
    model = spread_pair_model(0, spread=30.0)
    calib = _feeds(0, n=8)
    _, plain = _quantized(model, calib)
    unsorted = _copy(plain.model)
    nodes = list(unsorted.graph.node)[::-1]
    del unsorted.graph.node[:]
    unsorted.graph.node.extend(nodes)
    fitted = _copy(model)
    records, ranges = reconstruct(fitted, unsorted, plain.placement, calib)
    assert not ranges and "pieces" in records[0]["reason"]
    assert fitted.SerializeToString() == model.SerializeToString()


def _conv_nd(dims: int):
    """A 1-D or 3-D Conv (the reconstruction's patches are a 2-D Conv's) before a 2-D MatMul."""
    from tests.builders import GraphBuilder

    b = GraphBuilder("conv_nd", dims)
    x = b.input("input", ["N", 16, *[12] * dims])
    h = b.node("Conv", [x, b.weight("c.weight", [16, 16, *[3] * dims])], name="c", pads=[1] * (2 * dims))
    h = b.node("Relu", [h], name="relu")
    b.node("MatMul", [h, b.weight("fc.weight", [12, 24])], "output", name="fc")
    b.output("output")
    return b.build()


def _batched_matmul(_):
    """A MatMul whose constant weight is 3-D (one matrix per batch slice: fitting it as one matrix
    would mix the slices' rows) before a 2-D MatMul."""
    from tests.builders import GraphBuilder

    b = GraphBuilder("batched_weight", 0)
    x = b.input("input", ["N", 2, 8, 32])
    h = b.node("MatMul", [x, b.weight("c.weight", [2, 32, 32])], name="c")
    h = b.node("Relu", [h], name="relu")
    b.node("MatMul", [h, b.weight("fc.weight", [32, 24])], "output", name="fc")
    b.output("output")
    return b.build()


@pytest.mark.parametrize("build, dims, reason", [(_conv_nd, 1, "not a 2-D Conv"),
                                                 (_conv_nd, 3, "not a 2-D Conv"),
                                                 (_batched_matmul, 0, "a 3-D MatMul weight")])
def test_optimize_accuracy_keeps_round_to_nearest_for_a_layout_it_does_not_handle(build, dims, reason):
    """A 1-D or 3-D Conv (an IndexError before) or a MatMul with a 3-D weight keeps round to nearest,
    with its reason; the MatMul after it is still fitted and the model passes check."""
    from tests.builders import random_inputs

    model = build(dims)
    data = {k: v * np.float32(3.0) for k, v in random_inputs(model, num=24, seed=dims).items()}
    result = onnx_qat.quantize(model, data=data, optimize="accuracy", progress=False)
    step = next(s for s in result.accuracy["steps"] if s["step"] == "reconstruct")
    layers = {r["node"]: r for r in step["layers"]}
    assert layers["c"] == {"node": "c", "method": "rtn", "reason": reason}
    assert layers["fc"]["rows"] > 0 and "rtn_error" in layers["fc"], layers["fc"]
    assert_check_clean(result.model)


def test_error_compensated_rounding_falls_back_to_nearest_on_a_singular_gram_matrix():
    """A Gram matrix that is not positive definite (ridge 0, an input channel never used) cannot
    spread errors: the integers are the target's rounded to nearest, clipped to the INT8 range."""
    from onnx_qat.accuracy.reconstruct import _compensated

    target = np.array([[[0.26, -3.0], [0.74, 0.49]]])  # [g=1, K=2, N=2]
    hessian = np.array([[[1.0, 0.0], [0.0, 0.0]]])
    ints = _compensated(target, hessian, np.array([[0.5, 0.01]]))
    np.testing.assert_array_equal(ints, [[[1.0, -127.0], [1.0, 49.0]]])


def _direct_errors(op, weight, bias, xq, xf, ints, scale):
    """The relative output errors ``(round to nearest, ints)`` of an op on rows ``xq``/``xf``, computed
    from the residuals in float64 (rows centered when there is a bias; round to nearest keeps its
    own bias, so its error includes the mean shift)."""
    xq, xf = xq.astype(np.float64), xf.astype(np.float64)
    mats = op.matrices(weight).astype(np.float64)
    nearest = np.clip(np.rint(mats / scale[:, None, :]), -127, 127) * scale[:, None, :]
    shift = 0.0
    if bias is not None:
        mean_q, mean_f = xq.mean(axis=1), xf.mean(axis=1)
        shift = xq.shape[1] * float(np.sum(np.square(np.einsum("gk,gkn->gn", mean_q, nearest) -
                                                     np.einsum("gk,gkn->gn", mean_f, mats))))
        xq, xf = xq - mean_q[:, None, :], xf - mean_f[:, None, :]
    y = np.matmul(xf, mats)
    signal = float(np.sum(y * y))
    rtn = float(np.sum(np.square(np.matmul(xq, nearest) - y))) + shift
    new = float(np.sum(np.square(np.matmul(xq, op.matrices(ints) * scale[:, None, :]) - y)))
    return rtn / signal, new / signal


def _expanded_error(op, weight, bias, xq, xf, ints, scale):
    """``ints``' relative error as the expanded square of float32 Gram matrices gives it (how `_fit`
    computed it before): ``‖y‖² − 2 vᵀx̃ᵀy + vᵀx̃ᵀx̃v``, centered by subtracting ``rows · mean meanᵀ``."""
    rows = xq.shape[1]
    mats = op.matrices(weight).astype(np.float64)
    h = np.matmul(xq.transpose(0, 2, 1), xq).astype(np.float64)
    hqf = np.matmul(xq.transpose(0, 2, 1), xf).astype(np.float64)
    hff = np.matmul(xf.transpose(0, 2, 1), xf).astype(np.float64)
    if bias is not None:
        mq, mf = xq.astype(np.float64).mean(axis=1), xf.astype(np.float64).mean(axis=1)
        h -= rows * mq[:, :, None] * mq[:, None, :]
        hqf -= rows * mq[:, :, None] * mf[:, None, :]
        hff -= rows * mf[:, :, None] * mf[:, None, :]
    v = op.matrices(ints) * scale[:, None, :]
    signal = float(np.sum(mats * np.matmul(hff, mats)))
    cross, quadratic = float(np.sum(v * np.matmul(hqf, mats))), float(np.sum(v * np.matmul(h, v)))
    return (signal - 2.0 * cross + quadratic) / signal


def _near_grid_op(seed: int, mean: float, off: float, with_bias: bool, k: int = 64, n: int = 32,
                  rows: int = 2048):
    """A MatMul op (``fc2`` of `linear_model`) whose float weights lie within ``off`` grid steps of
    their INT8 grid, on rows of mean ``mean`` (a Relu output's kind) and its Q/DQ input 1e-4 apart:
    output errors of 1e-8 to 1e-4 of the signal."""
    from onnx_qat.accuracy.reconstruct import _Op
    from onnx_qat.graph.index import GraphIndex

    node = GraphIndex(linear_model(0, dim=k, out=n)).by_name["fc2"]
    rng = np.random.default_rng(seed)
    ints = rng.integers(-127, 128, (k, n)).astype(np.float64)
    ints[0] = 127
    scale = (rng.uniform(0.5, 1.5, n) / 1270).astype(np.float32)
    weight = (ints * scale + rng.standard_normal((k, n)) * scale * off).astype(np.float32)
    xf = (mean + rng.standard_normal((1, rows, k))).astype(np.float32)
    xq = (xf + rng.standard_normal(xf.shape) * 1e-4).astype(np.float32)
    op = _Op(node, 0, "w", scale, 1, "x", "b" if with_bias else None)
    return op, weight, np.zeros(n, np.float32) if with_bias else None, xq, xf, scale


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_output_errors_are_the_residuals_of_the_sampled_rows(seed, monkeypatch):
    """The output errors that decide whether a fitted op is kept are its residuals on the sampled rows:
    on ops whose error is 1e-8 to 1e-4 of the signal they match the float64 residuals to 1e-9, where
    the expanded square of float32 Gram matrices (how they were computed before) is off by more than
    its own size on a large input mean (negative, or many times too large), and every keep or undo
    decision is the one the residuals give (both kinds occur)."""
    import onnx_qat.accuracy.reconstruct as module

    fitted = {}
    real = module._compensated
    monkeypatch.setattr(module, "_compensated", lambda *a: fitted.setdefault("ints", real(*a)))
    decisions, expanded_off = set(), 0
    for mean in (0.0, 5.0, 30.0):
        for off, with_bias in ((0.0, False), (0.01, False), (0.3, False), (0.01, True), (0.3, True)):
            op, weight, bias, xq, xf, scale = _near_grid_op(seed, mean, off, with_bias)
            record = {}
            fitted.clear()
            result = module._fit(op, weight, bias, xq, xf, 1.0, record)
            ints = op.from_matrices(fitted["ints"], weight.shape)
            scale2 = scale.astype(np.float64)[None]
            rtn, new = _direct_errors(op, weight, bias, xq, xf, ints, scale2)
            assert record["rtn_error"] == pytest.approx(rtn, rel=1e-9, abs=1e-15), (mean, off, with_bias)
            assert record["error"] == pytest.approx(new, rel=1e-9, abs=1e-15), (mean, off, with_bias)
            assert 0 < new < 1e-4 and 0 < rtn
            assert (result is not None) == (new < rtn), (mean, off, with_bias, rtn, new)
            decisions.add(result is not None)
            if mean == 30.0 and with_bias:
                old = _expanded_error(op, weight, bias, xq, xf, ints, scale2)
                expanded_off += abs(old - new) > new
    assert decisions == {True, False}
    assert expanded_off == 2  # the cancellation this test guards against happens on these rows
