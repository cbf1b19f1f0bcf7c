"""optimize="accuracy": cross-layer equalization, activation smoothing, the recipe."""
import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.accuracy.equalize import equalize, find_pairs
from onnx_qat.accuracy.ranges import START_TABLES
from onnx_qat.errors import ConfigError
from onnx_qat.graph.index import GraphIndex
from onnx_qat.scales import ScaleTable
from tests.builders import GraphBuilder, assert_check_clean, cosine, run


def spread_pair_model(seed: int = 0, spread: float = 1000.0, activation: str = "Relu", channels: int = 16,
                      size: int = 12) -> onnx.ModelProto:
    """conv1 (1x1, 4 -> C) -> activation -> depthwise conv2 (3x3, group C) -> conv3 (1x1, C -> 8).

    conv1's output channels are scaled by factors spread log-uniformly over [1, ``spread``] and conv2's
    matching channels by the inverse: the same function as the unscaled network, with channel ranges
    ``spread`` apart in the tensor between conv1 and conv2 (one INT8 activation scale)."""
    b = GraphBuilder("spread", seed)
    x = b.input("input", ["N", 4, size, size])
    factors = np.logspace(0, np.log10(spread), channels).astype(np.float32)
    b.rng.shuffle(factors)
    w1 = (b.rng.standard_normal((channels, 4, 1, 1)) * 0.5).astype(np.float32) * factors[:, None, None, None]
    b1 = (np.abs(b.rng.standard_normal(channels)) * 0.1).astype(np.float32) * factors
    w2 = (b.rng.standard_normal((channels, 1, 3, 3)) * 0.3).astype(np.float32) / factors[:, None, None, None]
    y = b.node("Conv", [x, b.const("conv1.weight", w1), b.const("conv1.bias", b1)], name="conv1",
               kernel_shape=[1, 1])
    if activation == "Relu":
        y = b.node("Relu", [y], name="act")
    elif activation == "ReLU6":
        y = b.node("Clip", [y, b.const("zero", np.float32(0)), b.const("six", np.float32(6.0 * spread))],
                   name="act")
    zeros = np.zeros(channels, np.float32)
    y = b.node("Conv", [y, b.const("conv2.weight", w2), b.const("conv2.bias", zeros)],
               name="conv2", kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=channels)
    y = b.node("Relu", [y], name="act2")
    b.conv(y, channels, 8, "conv3", k=1)
    b.node("Identity", ["conv3_out"], "output", name="out")
    b.output("output")
    return b.build()


def _feeds(seed: int, n: int = 8, size: int = 12, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    return {"input": (rng.standard_normal((n, 4, size, size)) * scale).astype(np.float32)}


def _quantized_cosine(model, calib, evaluation) -> float:
    result = onnx_qat.quantize(model, data=calib, method="max", progress=False)
    assert_check_clean(result.model)
    return cosine(run(model, evaluation)[0], run(result.model, evaluation)[0])


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` for a step to edit in place (the original stays the reference)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _assert_same_function(model, changed, feeds, atol: float = 1e-5) -> None:
    """``changed`` computes ``model``'s function on ``feeds``: within float rounding (relative 1e-4,
    absolute ``atol`` times the output's largest magnitude)."""
    ref, got = run(model, feeds)[0], run(changed, feeds)[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=atol * float(np.abs(ref).max()))


# ------------------------------------------------------------------ cross-layer equalization
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("activation", ["Relu", "none"])
def test_equalization_recovers_a_depthwise_pair_with_channels_1000x_apart(seed, activation):
    model = spread_pair_model(seed, activation=activation)
    calib, evaluation = _feeds(seed), _feeds(seed + 100)
    before = _quantized_cosine(model, calib, evaluation)
    equalized = _copy(model)
    records = equalize(equalized)
    pair = next(r for r in records if r["first"] == "conv1")
    assert pair["second"] == "conv2" and pair["depthwise"]
    assert pair["activation"] == ("Relu" if activation == "Relu" else "none")
    assert pair["gain_db"] > 0.0
    after = _quantized_cosine(equalized, calib, evaluation)
    assert before < 0.97, before  # the small channels are lost in the shared activation scale
    assert after > 0.995 and after - before > 0.03, (before, after)


@pytest.mark.parametrize("activation", ["Relu", "ReLU6", "none"])
@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
def test_equalization_keeps_the_float_function(activation, scale):
    model = spread_pair_model(3, activation=activation)
    original = _copy(model)
    equalized = _copy(model)
    assert equalize(equalized)
    assert model == original  # the caller's model is untouched
    feeds = _feeds(7, scale=scale)
    _assert_same_function(model, equalized, feeds)
    onnx.checker.check_model(equalized)


def test_equalization_rewrites_relu6_as_relu_and_a_per_channel_bound():
    model = spread_pair_model(0, activation="ReLU6")
    equalize(model)
    ops = [n.op_type for n in model.graph.node]
    assert "Clip" not in ops and "Min" in ops
    result = onnx_qat.quantize(model, data=_feeds(0), method="max", progress=False)
    assert_check_clean(result.model)


def test_equalization_skips_a_tensor_with_two_readers():
    b = GraphBuilder("fork", 0)
    x = b.input("input", [1, 4, 8, 8])
    y = b.conv(x, 4, 8, "conv1", k=1)
    b.conv(y, 8, 8, "conv2", k=1)
    b.node("Add", ["conv2_out", y], "output", name="add")
    b.output("output")
    assert find_pairs(GraphIndex(b.build())) == []


# ------------------------------------------------------------------ the recipe
def test_optimize_accuracy_gives_the_same_bytes_twice():
    """Every step is bounded by counts of work, never by time: two runs give byte-identical models."""
    model = spread_pair_model(0)
    data = {"input": np.concatenate([_feeds(0)["input"], _feeds(1)["input"]])}
    first = onnx_qat.quantize(model, data=data, optimize="accuracy", progress=False)
    second = onnx_qat.quantize(model, data=data, optimize="accuracy", progress=False)
    assert first.model.SerializeToString() == second.model.SerializeToString()
    assert [(s["step"], s["cosine"], s["kept"]) for s in first.accuracy["steps"]] == \
        [(s["step"], s["cosine"], s["kept"]) for s in second.accuracy["steps"]]


def test_optimize_accuracy_keeps_the_steps_that_help_and_reports_each():
    model = spread_pair_model(0)
    data = {"input": np.concatenate([_feeds(0)["input"], _feeds(1)["input"]])}
    plain = onnx_qat.quantize(model, data=data, progress=False)
    result = onnx_qat.quantize(model, data=data, optimize="accuracy", progress=False)
    assert_check_clean(result.model)
    info = result.accuracy
    steps = {s["step"]: s for s in info["steps"]}
    assert list(steps) == ["calibrate", "equalize", "smooth", "ranges", "reconstruct", "bias"]
    if steps["reconstruct"]["kept"]:  # its biases are corrected already: the bias step is not run
        assert not steps["bias"]["kept"] and "kept" in steps["bias"]["note"]
    assert steps["equalize"]["kept"] and steps["equalize"]["gain"] > 0.02
    assert info["cosine_after"] >= info["cosine_before"] + 0.02
    assert all(s["kept"] == (s["gain"] is None or s["gain"] > 0) for s in info["steps"])
    # 4 evaluation samples: 2 per half, too few to choose ranges on one half and confirm on the other;
    # the step chooses one whole table on the calibration samples instead
    ranges = steps["ranges"]
    assert ranges["mode"] == "whole table" and ranges["calibration_samples"] == 12
    assert ranges["start"] in ("given",) + START_TABLES
    assert ranges["kept"] == (ranges["start"] != "given" and ranges["gain"] > 0)
    evaluation = _feeds(50)
    ref = run(model, evaluation)[0]
    assert cosine(run(result.model, evaluation)[0], ref) > cosine(run(plain.model, evaluation)[0], ref) + 0.02
    assert result.to_report()["mixed_precision"]["optimize"] == "accuracy"


def test_optimize_accuracy_undoes_ranges_that_lose_on_the_held_out_samples(monkeypatch):
    """The ranges step chooses on the first half of the evaluation samples; ranges that lower the
    cosine on the second half are undone even when the first half would keep them."""
    import onnx_qat.accuracy.ranges as ranges_module

    model = spread_pair_model(0)
    data = _feeds(0, n=16)
    seen = {}

    def narrowed(float_model, calib, choose, *, weights, **kw):
        seen["samples"] = choose.num_samples
        amax = {t: (a / 50 if i == 0 else a) for i, (t, a) in enumerate(weights.activations.items())}
        return ScaleTable(amax, dict(weights.weights)), {"start": "tensor"}

    monkeypatch.setattr(ranges_module, "tune_table", narrowed)
    result = onnx_qat.quantize(model, data=data, eval_data=_feeds(1, n=16), optimize="accuracy",
                               progress=False)
    step = {s["step"]: s for s in result.accuracy["steps"]}["ranges"]
    assert seen["samples"] == 8 and step["held_out_samples"] == 8
    assert step["held_out_after"] < step["held_out_before"] and not step["kept"]
    assert "held-out" in step["note"]
    assert_check_clean(result.model)


@pytest.mark.parametrize("seed", [0, 1])
def test_optimize_accuracy_corrects_biases_where_the_reconstruction_is_undone(seed):
    """A classifier's head whose pooled input loses a shift every input shares: the weight fits of
    ``reconstruct`` do not raise the evaluation cosine and are undone; the ``bias`` step then corrects
    each bias alone, keeps every integer the inserter gives, and is kept; on unseen inputs the output
    error falls by a quarter or more. The same inputs give the same bytes."""
    from tests.onnx_qat.test_reconstruct import _head_feeds, _int8, head_model

    model = head_model(seed)
    calib, evaluation, unseen = _head_feeds(seed), _head_feeds(seed + 50, n=8), _head_feeds(seed + 100, n=64)
    result = onnx_qat.quantize(model, data=calib, eval_data=evaluation, optimize="accuracy", progress=False)
    assert_check_clean(result.model)
    steps = {s["step"]: s for s in result.accuracy["steps"]}
    assert not steps["reconstruct"]["kept"] and steps["bias"]["kept"] and steps["bias"]["gain"] > 0
    assert {r["node"]: r["method"] for r in steps["bias"]["layers"]} == {"conv": "bias", "head": "bias"}
    plain = onnx_qat.quantize(model, data=calib, progress=False)
    assert _int8(result.model) == _int8(plain.model)
    ref = run(model, unseen)[0]
    before, after = cosine(run(plain.model, unseen)[0], ref), cosine(run(result.model, unseen)[0], ref)
    assert 1 - after < 0.75 * (1 - before), (before, after)
    again = onnx_qat.quantize(model, data=calib, eval_data=evaluation, optimize="accuracy", progress=False)
    assert again.model.SerializeToString() == result.model.SerializeToString()


def saturating_model(seed: int = 0, channels: int = 16):
    """input [N, C, 16, 16] -> Conv ``conv1`` -> Clip(0, 1) -> Conv ``conv2`` -> ``output``: the Clip
    saturates whatever a rare large input value makes of ``conv1``'s output."""
    b = GraphBuilder("saturating", seed)
    y = b.conv(b.input("input", ["N", channels, 16, 16]), channels, channels, "conv1")
    y = b.node("Clip", [y, b.const("lo", np.array(0, np.float32)), b.const("hi", np.array(1, np.float32))],
               name="clip1")
    b.node("Identity", [b.conv(y, channels, channels, "conv2")], "output", name="out")
    b.output("output")
    return b.build()


def _spiky(seed: int, n: int, channels: int = 16, height: float = 100.0):
    """Normal inputs with one value of +-``height`` per sample: ``max`` ranges the model's input by the
    spikes (every other value then rounds to a few levels), while the Clip after ``conv1`` saturates
    whatever the spikes become, so clipping them costs the output almost nothing."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, channels, 16, 16)).astype(np.float32)
    for i in range(n):
        x[i, rng.integers(channels), rng.integers(16), rng.integers(16)] = height * rng.choice([-1.0, 1.0])
    return {"input": x}


@pytest.mark.parametrize("seed", [0, 1])
def test_optimize_accuracy_chooses_a_whole_table_on_the_calibration_samples(seed, monkeypatch):
    """With too few evaluation samples to choose ranges on one half and confirm on the other, the ranges
    step still chooses one whole table among auto's candidates, on the calibration samples alone (the
    paired rule auto uses), and keeps it only where the evaluation cosine rises. Here the per-tensor
    table keeps ``max`` on the spiky input (clipping the spikes costs that tensor more error than
    rounding), but a percentile table everywhere wins on every calibration sample: on 64 unseen samples
    the recipe gains over the one without that choice."""
    import onnx_qat.accuracy.ranges as ranges_module

    model = saturating_model(seed)
    calib, evaluation, unseen = _spiky(seed, 32), _spiky(seed + 100, 4), _spiky(seed + 200, 64)
    result = onnx_qat.quantize(model, data=calib, eval_data=evaluation, optimize="accuracy", progress=False)
    assert_check_clean(result.model)
    step = {s["step"]: s for s in result.accuracy["steps"]}["ranges"]
    assert step["kept"] and step["start"].startswith("percentile") and step["gain"] > 0.005, step
    cosines = step["calibration_cosines"]
    assert cosines[step["start"]] > cosines["given"] + 0.01
    ref = run(model, unseen)[0]
    monkeypatch.setattr(ranges_module, "choose_table",
                        lambda *a, weights, **kw: (weights, {"start": "given"}))
    without = onnx_qat.quantize(model, data=calib, eval_data=evaluation, optimize="accuracy", progress=False)
    assert not {s["step"]: s for s in without.accuracy["steps"]}["ranges"]["kept"]
    gained = cosine(run(result.model, unseen)[0], ref) - cosine(run(without.model, unseen)[0], ref)
    assert gained > 0.005, gained


@pytest.mark.parametrize("kw, message", [
    ({"optimize": "speed"}, "optimize must be one of accuracy"),
    ({"optimize": "accuracy", "min_cosine": 0.99}, "does not combine"),
])
def test_optimize_refuses_bad_options(kw, message):
    model = spread_pair_model(0)
    with pytest.raises(ConfigError, match=message):
        onnx_qat.quantize(model, data=_feeds(0), progress=False, **kw)


def test_optimize_refuses_given_scales():
    model = spread_pair_model(0)
    table = onnx_qat.calibrate(model, _feeds(0), method="max", progress=False)
    with pytest.raises(ConfigError):
        onnx_qat.quantize(model, scales=table, optimize="accuracy", progress=False)


def test_cli_optimize_accuracy(tmp_path, capsys):
    from onnx_qat.cli import main

    model = spread_pair_model(0)
    path, data, out = tmp_path / "m.onnx", tmp_path / "d.npz", tmp_path / "q.onnx"
    onnx.save(model, path)
    np.savez(data, input=np.concatenate([_feeds(0)["input"], _feeds(1)["input"]]))
    assert main(["quantize", str(path), "--data", str(data), "--optimize", "accuracy", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "optimize accuracy: output cosine" in said and "equalize" in said
    assert "0 errors, 0 warnings" in said
    assert main(["quantize", str(path), "--data", str(data), "--optimize", "accuracy", "--min-cosine", "0.9",
                 "-o", str(tmp_path / "q2.onnx")]) == 2
    assert not (tmp_path / "q2.onnx").exists()


def test_optimize_accuracy_in_fp8_equalizes_and_passes_check():
    model = spread_pair_model(0)
    data = {"input": np.concatenate([_feeds(0)["input"], _feeds(1)["input"]])}
    result = onnx_qat.quantize(model, data=data, optimize="accuracy", precision="fp8", progress=False)
    assert result.precision == "fp8"
    assert [s["step"] for s in result.accuracy["steps"]] == ["calibrate", "equalize", "smooth", "ranges"]
    assert_check_clean(result.model)


def test_optimize_accuracy_refuses_int4():
    with pytest.raises(ConfigError, match="weight-only"):
        onnx_qat.quantize(spread_pair_model(0), data=_feeds(0), optimize="accuracy", precision="int4",
                          progress=False)


# ------------------------------------------------------------------ activation smoothing
def outlier_layernorm_model(seed: int = 0, dim: int = 32, factor: float = 200.0,
                            decomposed: bool = False, residual: bool = False):
    """input [N, 8, dim] -> LayerNormalization (or its Mul/Add tail) whose scale makes channel 0 an
    outlier ``factor`` times the others -> MatMul ``fc`` (its weight row 0 divided by ``factor``: the
    outlier is what the activation carries, not what the output needs) -> Relu -> MatMul ``out``.
    ``residual``: the LayerNorm output is also added to the Relu's output (a post-LN transformer's
    shortcut), and ``out`` reads the sum with its row 0 divided by ``factor``."""
    from onnx import TensorProto

    b = GraphBuilder("outlier_ln", seed)
    x = b.input("input", ["N", 8, dim])
    gamma = b.rng.uniform(0.5, 1.5, dim).astype(np.float32)
    gamma[0] *= factor
    beta = (b.rng.standard_normal(dim) * 0.1).astype(np.float32)
    if decomposed:
        mean = b.node("ReduceMean", [x], name="mean", axes=[-1], keepdims=1)
        centred = b.node("Sub", [x, mean], name="centre")
        var = b.node("ReduceMean", [b.node("Mul", [centred, centred], name="square")], name="var",
                     axes=[-1], keepdims=1)
        std = b.node("Sqrt", [b.node("Add", [var, b.const("eps", np.float32(1e-5))], name="add_eps")],
                     name="sqrt")
        normed = b.node("Div", [centred, std], name="div")
        scaled = b.node("Mul", [normed, b.const("gamma", gamma)], name="scale")
        y = b.node("Add", [scaled, b.const("beta", beta)], name="shift")
    else:
        y = b.node("LayerNormalization", [x, b.const("gamma", gamma), b.const("beta", beta)], name="ln",
                   axis=-1, epsilon=1e-5)
    w = (b.rng.standard_normal((dim, dim)) * 0.3).astype(np.float32)
    w[0] /= factor
    h = b.node("Relu", [b.node("MatMul", [y, b.const("fc.weight", w)], name="fc")], name="relu")
    w_out = (b.rng.standard_normal((dim, 16)) * 0.3).astype(np.float32)
    if residual:
        h = b.node("Add", [y, h], name="shortcut")
        w_out[0] /= factor
    b.node("MatMul", [h, b.const("out.weight", w_out)], "output", name="out")
    b.outputs.append(onnx.helper.make_tensor_value_info("output", TensorProto.FLOAT, None))
    return b.build(opset=17) if not decomposed else b.build(opset=13)


def _ln_feeds(seed: int, n: int = 16, dim: int = 32):
    return {"input": np.random.default_rng(seed).standard_normal((n, 8, dim)).astype(np.float32)}


@pytest.mark.parametrize("decomposed", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_smoothing_recovers_an_outlier_activation_channel(decomposed, seed):
    from onnx_qat.accuracy.smooth import smooth

    model = outlier_layernorm_model(seed, decomposed=decomposed)
    calib, evaluation = _ln_feeds(seed), _ln_feeds(seed + 100)
    before = _quantized_cosine(model, calib, evaluation)
    smoothed = _copy(model)
    records = smooth(smoothed, calib)
    fc = next(r for r in records if r["readers"] == ["fc"])
    assert fc["spread_before"] > 50 and fc["spread_after"] < 0.2 * fc["spread_before"], fc
    after = _quantized_cosine(smoothed, calib, evaluation)
    assert after > before + 0.01 and after > 0.99, (before, after)


@pytest.mark.parametrize("decomposed", [False, True])
@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
def test_smoothing_keeps_the_float_function(decomposed, scale):
    from onnx_qat.accuracy.smooth import smooth

    model = outlier_layernorm_model(2, decomposed=decomposed)
    smoothed = _copy(model)
    assert smooth(smoothed, _ln_feeds(2))
    feeds = {"input": _ln_feeds(9)["input"] * scale}
    _assert_same_function(model, smoothed, feeds)


def test_smoothing_leaves_even_channels_alone():
    from onnx_qat.accuracy.smooth import smooth

    model = outlier_layernorm_model(0, factor=1.0)
    assert smooth(model, _ln_feeds(0)) == ()


def test_optimize_accuracy_keeps_smoothing_on_an_outlier_channel():
    model = outlier_layernorm_model(0)
    data = {"input": np.concatenate([_ln_feeds(0)["input"], _ln_feeds(1)["input"]])}
    result = onnx_qat.quantize(model, data=data, optimize="accuracy", progress=False)
    steps = {s["step"]: s for s in result.accuracy["steps"]}
    assert steps["smooth"]["kept"] and steps["smooth"]["gain"] > 0.005, steps["smooth"]
    assert_check_clean(result.model)


def test_optimize_accuracy_for_the_ort_cpu_target_passes_its_check():
    model = spread_pair_model(1)
    data = {"input": np.concatenate([_feeds(0)["input"], _feeds(1)["input"]])}
    result = onnx_qat.quantize(model, data=data, optimize="accuracy", target="ort-cpu", progress=False)
    assert result.target == "ort-cpu" and result.accuracy["cosine_after"] > 0.99
    assert_check_clean(result.model, target="ort-cpu")


# ------------------------------------------------------------------ smoothing through a GELU: an inserted Mul
def outlier_gelu_model(seed: int = 0, dim: int = 32, ffn: int = 64, factor: float = 100.0,
                       gelu: str = "Gelu", row_factor: float = 0.0, bias: bool = False,
                       massive: float = 0.0) -> onnx.ModelProto:
    """input [N, 8, dim] -> MatMul ``fc1`` (+ bias; its column 0 times ``factor``) -> GELU -> MatMul
    ``fc2`` (its row 0 divided by ``factor``, or times ``row_factor`` when given) -> output: GELU
    output channel 0 is an outlier ``factor`` times the others. ``gelu``: ``"Gelu"`` (one node, opset
    20) or ``"erf"`` (``(x * 0.5) * (1 + erf(x / sqrt 2))``, opset 17: its last Mul has no constant to
    fold into). ``bias``: an Add of a constant bias after ``fc2`` (then an Identity to the output, or
    a LayerNormalization with ``massive``).
    ``massive``: instead of ``factor``, channel 0 is ``massive`` at token 0 and near 0 elsewhere (fc1's
    bias is per token), as trained transformers' "massive activations" are."""
    from onnx import TensorProto

    b = GraphBuilder("outlier_gelu", seed)
    x = b.input("input", ["N", 8, dim])
    w1 = (b.rng.standard_normal((dim, ffn)) / np.sqrt(dim)).astype(np.float32)
    b1 = (b.rng.standard_normal(ffn) * 0.1).astype(np.float32)
    if massive:  # channel 0 dormant (GELU of about -4) except on token 0
        b1 = np.tile(b1, (8, 1))
        b1[:, 0], b1[0, 0] = -4.0, massive
        w1[:, 0] *= 0.1
    else:
        w1[:, 0] *= factor
    h = b.node("Add", [b.node("MatMul", [x, b.const("fc1.weight", w1)], name="fc1"), b.const("fc1.bias", b1)],
               name="fc1_bias")
    if gelu == "Gelu":
        g = b.node("Gelu", [h], name="gelu")
    else:
        half = b.node("Mul", [h, b.const("half", np.float32(0.5))], name="gelu_half")
        erf = b.node("Erf", [b.node("Div", [h, b.const("sqrt2", np.float32(np.sqrt(2)))], name="gelu_div")],
                     name="gelu_erf")
        g = b.node("Mul", [half, b.node("Add", [erf, b.const("one", np.float32(1))], name="gelu_add")],
                   name="gelu")
    w2 = (b.rng.standard_normal((ffn, dim)) / np.sqrt(ffn)).astype(np.float32)
    w2[0] = w2[0] * row_factor if row_factor else w2[0] / factor
    if bias:
        y = b.node("MatMul", [g, b.const("fc2.weight", w2)], name="fc2")
        bias_values = (b.rng.standard_normal(dim) * 0.1).astype(np.float32)
        y = b.node("Add", [y, b.const("fc2.bias", bias_values)], name="fc2_bias")
        if massive:  # each token's output normalized, as the LayerNorm after a transformer's FFN does
            b.node("LayerNormalization", [y, b.const("ln.gamma", np.ones(dim, np.float32)),
                                          b.const("ln.beta", np.zeros(dim, np.float32))], "output", name="ln",
                   axis=-1, epsilon=1e-5)
        else:
            b.node("Identity", [y], "output", name="out")
    else:
        b.node("MatMul", [g, b.const("fc2.weight", w2)], "output", name="fc2")
    b.outputs.append(onnx.helper.make_tensor_value_info("output", TensorProto.FLOAT, None))
    return b.build(opset=20 if gelu == "Gelu" else 17)


@pytest.mark.parametrize("gelu", ["Gelu", "erf"])
@pytest.mark.parametrize("seed", [0, 1])
def test_smoothing_through_a_gelu_inserts_a_mul_and_recovers_the_outlier(gelu, seed):
    from onnx_qat.accuracy.smooth import smooth

    model = outlier_gelu_model(seed, gelu=gelu)
    calib, evaluation = _ln_feeds(seed), _ln_feeds(seed + 100)
    before = _quantized_cosine(model, calib, evaluation)
    smoothed = _copy(model)
    records = smooth(smoothed, calib)
    fc2 = next(r for r in records if r["readers"] == ["fc2"])
    assert fc2["how"] == "mul" and fc2["producer"] == ("Gelu" if gelu == "Gelu" else "Mul"), fc2
    assert fc2["spread_before"] > 30 and fc2["spread_after"] < 0.2 * fc2["spread_before"], fc2
    mul = next(n for n in smoothed.graph.node if n.op_type == "Mul" and n.input[0] == fc2["tensor"])
    assert len(smoothed.graph.node) == len(model.graph.node) + 1
    result = onnx_qat.quantize(smoothed, data=calib, method="max", progress=False)
    assert_check_clean(result.model)
    # the Q/DQ pair fc2 reads sits after the Mul, on the tensor fc2 reads
    nodes = {n.name: n for n in result.model.graph.node}
    dq = next(n for n in result.model.graph.node if n.output[0] == nodes["fc2"].input[0])
    q = next(n for n in result.model.graph.node if n.output[0] == dq.input[0])
    assert (dq.op_type, q.op_type, q.input[0]) == ("DequantizeLinear", "QuantizeLinear", mul.output[0])
    after = cosine(run(smoothed, evaluation)[0], run(result.model, evaluation)[0])
    assert before < 0.95 and after > 0.999, (before, after)  # measured: 0.83-0.85 -> 0.9998


@pytest.mark.parametrize("gelu", ["Gelu", "erf"])
@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
def test_smoothing_through_a_gelu_keeps_the_float_function(gelu, scale):
    from onnx_qat.accuracy.smooth import smooth

    model = outlier_gelu_model(3, gelu=gelu)
    smoothed = _copy(model)
    assert [r["how"] for r in smooth(smoothed, _ln_feeds(3))] == ["mul"]
    onnx.checker.check_model(smoothed)
    feeds = {"input": _ln_feeds(9)["input"] * scale}
    _assert_same_function(model, smoothed, feeds)


def test_smoothing_without_insert_mul_leaves_a_gelu_alone():
    from onnx_qat.accuracy.smooth import smooth

    model = outlier_gelu_model(0)
    original = _copy(model)
    assert smooth(model, _ln_feeds(0), insert_mul=False) == () and model == original


def test_optimize_accuracy_keeps_smoothing_through_a_gelu():
    model = outlier_gelu_model(0, gelu="erf")
    data = {"input": np.concatenate([_ln_feeds(0)["input"], _ln_feeds(1)["input"]])}
    result = onnx_qat.quantize(model, data=data, optimize="accuracy", progress=False)
    steps = {s["step"]: s for s in result.accuracy["steps"]}
    assert steps["smooth"]["kept"] and steps["smooth"]["gain"] > 0.002, steps["smooth"]
    assert steps["smooth"]["tensors"][0]["how"] == "mul"
    assert_check_clean(result.model)


@pytest.mark.parametrize("seed", [0, 1])
def test_smoothing_a_layernorm_output_that_feeds_a_shortcut_too(seed):
    from onnx_qat.accuracy.smooth import smooth

    model = outlier_layernorm_model(seed, residual=True)
    calib, evaluation = _ln_feeds(seed), _ln_feeds(seed + 100)
    before = _quantized_cosine(model, calib, evaluation)
    smoothed = _copy(model)
    records = smooth(smoothed, calib)
    fc = next(r for r in records if r["readers"] == ["fc"])
    assert (fc["how"], fc["shared"], fc["producer"]) == ("mul", True, "LayerNormalization"), fc
    index = GraphIndex(smoothed)
    # the shortcut still reads the LayerNorm output itself; fc reads the Mul
    assert "shortcut" in {n.name for n, _ in index.consumers(fc["tensor"])}
    assert index.producer[index.nodes[[n.name for n in index.nodes].index("fc")].inputs[0]].op_type == "Mul"
    feeds = {"input": _ln_feeds(9)["input"] * 3.0}
    _assert_same_function(model, smoothed, feeds)
    after = _quantized_cosine(smoothed, calib, evaluation)  # check clean inside
    assert before < 0.8 and after > 0.999, (before, after)  # measured: 0.45-0.65 -> 0.9996-0.9999


def test_smoothing_leaves_an_outlier_that_its_weight_row_shares_alone():
    """Channel 0 is 100x the others and so is its weight row (x 1000): dividing it by s_j would make the
    channel spread worse, not better; the tensor is left alone."""
    from onnx_qat.accuracy.smooth import smooth

    model = outlier_gelu_model(0, row_factor=1000.0, bias=True)
    original = _copy(model)
    assert smooth(model, _ln_feeds(0), split=False) == () and model == original


@pytest.mark.parametrize("seed", [0, 1])
def test_smoothing_splits_out_a_massive_channel_whose_weight_row_is_an_outlier_too(seed):
    """Channel 0 is 100 at token 0 and near 0 elsewhere, and its weight row is 10x the others: an
    outlier product that smoothing hardly helps. Split out into a MatMul of its own (INT8, its own
    activation scale), exact in float, the cosine recovers."""
    from onnx_qat.accuracy.smooth import smooth

    model = outlier_gelu_model(seed, row_factor=10.0, bias=True, massive=100.0)
    calib, evaluation = _ln_feeds(seed), _ln_feeds(seed + 100)
    before = _quantized_cosine(model, calib, evaluation)
    smoothed_only = _copy(model)
    assert smooth(smoothed_only, calib, split=False)[0]["how"] == "mul"
    without_split = _quantized_cosine(smoothed_only, calib, evaluation)
    split = _copy(model)
    records = smooth(split, calib)
    fc2 = next(r for r in records if r["readers"] == ["fc2"])
    assert fc2["how"] == "split" and [j for j, _ in fc2["split"]] == [0] and fc2["split"][0][1] > 300, fc2
    ops = [n.op_type for n in split.graph.node]
    assert (ops.count("Gather"), ops.count("MatMul"), len(ops)) == (1, 3, len(model.graph.node) + 4), ops
    feeds = {"input": _ln_feeds(9)["input"] * 2.0}
    _assert_same_function(model, split, feeds, atol=1e-4)
    result = onnx_qat.quantize(split, data=calib, method="max", progress=False)
    assert_check_clean(result.model)
    produced = {o: n for n in result.model.graph.node for o in n.output}
    matmuls = [n for n in result.model.graph.node if n.op_type == "MatMul"]
    assert all(produced[n.input[1]].op_type == "DequantizeLinear" for n in matmuls)  # every one INT8
    after = cosine(run(split, evaluation)[0], run(result.model, evaluation)[0])
    # measured: 0.965-0.966 plain, 0.983-0.985 smoothed only, 0.9998-0.9999 split
    assert before < 0.97 and without_split < 0.99 and after > 0.999, (before, without_split, after)


def test_splitting_a_tensor_read_by_two_matmuls():
    """The massive GELU channel read by two MatMuls (outputs added, then a LayerNorm): one Gather,
    one split MatMul and one Add per reader; exact in float, check clean, the cosine recovers."""
    from onnx import TensorProto

    from onnx_qat.accuracy.smooth import smooth

    b = GraphBuilder("two_readers", 0)
    x = b.input("input", ["N", 8, 32])
    w1 = (b.rng.standard_normal((32, 64)) / np.sqrt(32)).astype(np.float32)
    w1[:, 0] *= 0.1
    b1 = np.tile((b.rng.standard_normal(64) * 0.1).astype(np.float32), (8, 1))
    b1[:, 0], b1[0, 0] = -4.0, 100.0  # channel 0: dormant except on token 0
    h = b.node("Add", [b.node("MatMul", [x, b.const("fc1.weight", w1)], name="fc1"), b.const("fc1.bias", b1)],
               name="fc1_bias")
    g = b.node("Gelu", [h], name="gelu")
    outs = []
    for k in ("a", "b"):
        w2 = (b.rng.standard_normal((64, 32)) / 8).astype(np.float32)
        w2[0] *= 10.0
        outs.append(b.node("MatMul", [g, b.const(f"fc2{k}.weight", w2)], name=f"fc2{k}"))
    y = b.node("Add", outs, name="sum")
    b.node("LayerNormalization", [y, b.const("gamma", np.ones(32, np.float32)),
                                  b.const("beta", np.zeros(32, np.float32))], "output", name="ln", axis=-1)
    b.outputs.append(onnx.helper.make_tensor_value_info("output", TensorProto.FLOAT, None))
    model = b.build(opset=20)
    calib, evaluation = _ln_feeds(0), _ln_feeds(100)
    before = _quantized_cosine(model, calib, evaluation)
    split = _copy(model)
    (record,) = smooth(split, calib)
    assert record["how"] == "split" and record["readers"] == ["fc2a", "fc2b"], record
    assert [j for j, _ in record["split"]] == [0], record
    ops = [n.op_type for n in split.graph.node]
    assert (ops.count("Gather"), ops.count("MatMul"), ops.count("Add")) == (1, 5, 4), ops
    np.testing.assert_allclose(run(split, evaluation)[0], run(model, evaluation)[0], atol=1e-5)
    after = _quantized_cosine(split, calib, evaluation)
    assert before < 0.85 and after > 0.999, (before, after)  # measured: 0.81 -> 0.9998


def test_a_split_output_read_by_the_next_matmul_keeps_the_float_function():
    """fc2 (split, no bias) feeds fc3 directly, and fc2's output has an outlier channel of its own:
    smoothing it would divide fc2's weight columns but not the split MatMul's, so it is left alone."""
    from onnx import TensorProto

    from onnx_qat.accuracy.smooth import smooth

    b = GraphBuilder("chain", 0)
    x = b.input("input", ["N", 8, 32])
    w1 = (b.rng.standard_normal((32, 64)) / np.sqrt(32)).astype(np.float32)
    w1[:, 0] *= 0.1
    b1 = np.tile((b.rng.standard_normal(64) * 0.1).astype(np.float32), (8, 1))
    b1[:, 0], b1[0, 0] = -4.0, 100.0
    h = b.node("Add", [b.node("MatMul", [x, b.const("fc1.weight", w1)], name="fc1"), b.const("fc1.bias", b1)],
               name="fc1_bias")
    w2 = (b.rng.standard_normal((64, 32)) / 8).astype(np.float32)
    w2[0] *= 10.0
    w2[:, 3] *= 30.0  # output channel 3 of fc2: an outlier for fc3
    y = b.node("MatMul", [b.node("Gelu", [h], name="gelu"), b.const("fc2.weight", w2)], name="fc2")
    w3 = (b.rng.standard_normal((32, 32)) / np.sqrt(32)).astype(np.float32)
    w3[3] /= 30.0
    b.node("MatMul", [y, b.const("fc3.weight", w3)], "output", name="fc3")
    b.outputs.append(onnx.helper.make_tensor_value_info("output", TensorProto.FLOAT, None))
    model = b.build(opset=20)
    edited = _copy(model)
    records = smooth(edited, _ln_feeds(0))
    assert [(r["readers"], r["how"]) for r in records] == [(["fc2"], "split")], records
    feeds = _ln_feeds(5)
    _assert_same_function(model, edited, feeds)

