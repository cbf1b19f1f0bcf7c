"""Weight scales on the FP16 grid (``onnx_qat.formats.scale_grid.fp16_weight_scales``): the TensorRT
form's weight scales are FP16 values, each the FP16 neighbour of ``amax / qmax`` that reconstructs its
channel (or block) best, the weight quantized with exactly that scale; FP16 float parts store them
unchanged; the ort-cpu form and user-given weight ranges are written as before."""

import numpy as np
import pytest
from onnx import numpy_helper

import onnx_qat
from onnx_qat.formats.blockwise import dequantize_blocks, quantize_blocks, unpack_int4
from onnx_qat.formats.encoding import INT8_QRANGE, int8_dequantized, quantize_weight, to_grid
from onnx_qat.formats.float_parts import cast_float_parts, get_low_type, scale_fits
from onnx_qat.formats.scale_grid import FP16_TINY, fp16_neighbours, fp16_weight_scales
from onnx_qat.insertion.targets import get_target
from onnx_qat.scales import ScaleTable, WeightRange
from tests.builders import (
    assert_check_clean,
    depthwise_model,
    mlp_model,
    random_inputs,
    residual_block_model,
    mobilenet_v2_model,
    weight_dqs,
)

FP16 = get_low_type("fp16")


def _is_fp16(values) -> bool:
    values = np.asarray(values, np.float32)
    return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def _sse(values, scale, shape):
    diff = int8_dequantized()(values, scale.reshape(shape)) - values
    return np.sum(np.square(diff, dtype=np.float64), axis=tuple(i for i, n in enumerate(shape) if n == 1))


def _weight_scales(model):
    """{weight DequantizeLinear's scale initializer: float32 values} (a DQ reading an initializer)."""
    inits = {t.name: t for t in model.graph.initializer}
    return {n.input[1]: numpy_helper.to_array(inits[n.input[1]]).astype(np.float32)
            for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}


# --------------------------------------------------------------------------- the choice
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("magnitude", [1e-3, 0.1, 30.0])
def test_each_scale_is_the_fp16_neighbour_that_reconstructs_its_channel_best(seed, magnitude):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((64, 24, 3, 3)) * magnitude).astype(np.float32)
    scale = (np.abs(values).reshape(64, -1).max(axis=1) / 127.0).astype(np.float32)
    shape = (-1, 1, 1, 1)
    got = fp16_weight_scales(values, scale, shape, int8_dequantized())
    down, up = fp16_neighbours(scale)
    assert _is_fp16(got) and np.all((got == down) | (got == up))
    # within one FP16 step of amax / 127 (2^-24 in FP16's subnormal range, below 2^-14: magnitude 1e-3)
    assert np.all(np.abs(got - scale) <= np.maximum(2.0 ** -10 * scale, 2.0 ** -24))
    errors = [_sse(values, c, shape) for c in (down, up)]
    best = np.minimum(*errors)
    assert np.all(_sse(values, got, shape) == best)
    # both neighbours occur (the choice is per channel, not a fixed direction) ...
    assert np.any((got == down) & (down != up)) and np.any((got == up) & (down != up))
    # ... and the chosen grid reconstructs the weight no worse than the plain float32 scales here
    assert _sse(values, got, shape).sum() <= _sse(values, scale, shape).sum() * 1.05


def test_a_scale_already_fp16_stays_and_a_tie_takes_the_upper_neighbour():
    values = np.array([[1.0, -0.5], [127.0 * 2.0 ** -20, 0.0]], np.float32)
    got = fp16_weight_scales(values, np.float32([0.0625, 2.0 ** -20]), (-1, 1), int8_dequantized())
    assert got.tolist() == [0.0625, 2.0 ** -20]  # 2^-20: an FP16 subnormal, held exactly
    # a channel of zeros: both neighbours reconstruct it exactly -> the upper one
    tie = fp16_weight_scales(np.zeros((1, 4), np.float32), np.float32([1.0 / 127.0]), (-1, 1),
                             int8_dequantized())
    down, up = fp16_neighbours(np.float32([1.0 / 127.0]))
    assert down[0] < up[0] and tie[0] == up[0]


def test_scales_fp16_cannot_hold_are_left_as_they_are_by_the_conversions_criterion():
    """All scales in FP16's subnormal range (or beyond 65504): unchanged, and the conversion keeps
    that weight FP32 (`scale_fits` fails); a dead channel beside normal ones takes FP16's smallest value."""
    shape = (-1, 1)
    for scale in (np.float32([3e-7, 5e-7]), np.float32([1e5, 2.0])):
        values = (scale[:, None] * np.float32([[127.0, -3.0]])).astype(np.float32)
        got = fp16_weight_scales(values, scale, shape, int8_dequantized())
        assert np.array_equal(got, scale) and not scale_fits(scale, FP16)
    scale = np.float32([1e-8, 0.01])  # a zero channel's scale (ZERO_CHANNEL_SCALE) beside a normal one
    values = np.float32([[0.0, 0.0], [1.27, -0.3]])
    got = fp16_weight_scales(values, scale, shape, int8_dequantized())
    assert got[0] == np.float32(FP16_TINY) and _is_fp16(got) and scale_fits(got, FP16)


@pytest.mark.parametrize("seed", [0, 3])
def test_the_batched_small_weights_get_the_same_numbers_as_one_by_one(seed):
    """`quantize_small_weights` (one NumPy call per batch of equal shapes) gives exactly what
    `quantize_weight` gives weight by weight, grid included."""
    from onnx_qat.graph.edit import GraphEdit
    from onnx_qat.insertion.inserter import quantize_small_weights

    model = mobilenet_v2_model(size=16, batch=1, seed=seed)
    edit = GraphEdit(model)
    keys = [(w.tensor, w.axis) for w in onnx_qat.place(model).weights]
    batched = quantize_small_weights(edit, keys, ScaleTable({}), fp16_grid=True)
    assert len(batched) >= 4
    for (tensor, axis), (q, scale, _) in batched.items():
        values = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == tensor))
        want_q, want_scale = quantize_weight(values, axis, fp16_grid=True)
        assert np.array_equal(q, want_q) and np.array_equal(scale, want_scale) and _is_fp16(scale)


# --------------------------------------------------------------------------- in quantize
def _check_requantized(model, quantized, dequantize=None):
    """Every weight DQ of ``quantized``: FP16 scales, and its codes are the original weight quantized
    with exactly the written scale."""
    originals = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    dqs = weight_dqs(quantized)
    assert dqs
    for (node, index), dq in dqs.items():
        assert _is_fp16(dq["scale"]), node
        name = next(n for n in model.graph.node if n.name == node).input[index]
        shape = [1] * originals[name].ndim
        if dq["axis"] is not None:
            shape[dq["axis"]] = -1
        want = to_grid(originals[name], dq["scale"].reshape(shape), INT8_QRANGE)
        assert np.array_equal(dq["values"], want), node


@pytest.mark.parametrize("build, seed", [
    (lambda s: residual_block_model(projection=True, channels=32, seed=s), 0),
    (lambda s: depthwise_model(channels=16, seed=s), 1),
    (lambda s: mlp_model(features=128, hidden=64, seed=s), 2)])
@pytest.mark.parametrize("input_scale", [1.0, 255.0])
def test_the_tensorrt_forms_weight_scales_are_fp16_and_the_weights_requantized(build, seed, input_scale):
    model = build(seed)
    data = {k: v * input_scale for k, v in random_inputs(model, num=8, seed=seed).items()}
    result = onnx_qat.quantize(model, data=data, progress=False)
    _check_requantized(model, result.model)
    assert_check_clean(result.model)
    # a weight above the batched path's size (4096 values) goes through the same grid
    sizes = [dq["values"].size for dq in weight_dqs(result.model).values()]
    if build(seed).graph.name.startswith("residual"):
        assert max(sizes) > 4096


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fp16_conversion_stores_every_weight_scale_unchanged(seed):
    model = residual_block_model(projection=True, channels=32, seed=seed)
    data = random_inputs(model, num=16, seed=seed)
    fp32 = onnx_qat.quantize(model, data=data, method="max", progress=False)
    before = _weight_scales(fp32.model)
    fp16 = onnx_qat.quantize(model, data=data, method="max", float_dtype="fp16", progress=False).model
    for parts in (cast_float_parts(fp32.model, "fp16", scales=fp32.scales).model, fp16):
        after = _weight_scales(parts)
        assert set(after) == set(before)
        for name, values in before.items():
            stored = next(t for t in parts.graph.initializer if t.name == name)
            assert stored.data_type == FP16.onnx_type, name
            assert np.array_equal(after[name], values), name


@pytest.mark.parametrize("seed", [0, 1])
def test_the_ort_cpu_form_keeps_the_plain_float32_weight_scales(seed):
    model = residual_block_model(projection=True, channels=32, seed=seed)
    data = random_inputs(model, num=8, seed=seed)
    cpu = onnx_qat.quantize(model, data=data, target="ort-cpu", progress=False).model
    trt = onnx_qat.quantize(model, data=data, progress=False).model
    originals = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    off_grid = 0
    for (node, index), dq in weight_dqs(cpu).items():
        name = next(n for n in model.graph.node if n.name == node).input[index]
        w = originals[name]
        if dq["axis"] is None or dq["scale"].size != w.shape[dq["axis"]]:
            continue  # a folded or narrowed ort-cpu weight: its own rule (test_ort_cpu_*)
        amax = np.abs(np.moveaxis(w, dq["axis"], 0).reshape(w.shape[dq["axis"]], -1)).max(axis=1)
        step = dq["scale"] * 127.0 / amax
        if np.allclose(step, 1.0, rtol=1e-6):  # the plain amax / 127 scale
            off_grid += int(not _is_fp16(dq["scale"]))
    assert off_grid > 0
    assert all(_is_fp16(dq["scale"]) for dq in weight_dqs(trt).values())
    assert get_target("ort-cpu").weight_scale_grid is None
    assert get_target("tensorrt").weight_scale_grid == "fp16"


def test_a_given_weight_range_is_written_exactly_as_given():
    """A ScaleTable's weight range (a user's, the Keras round trip's trained one) gives the scale
    float32(amax / 127) exactly, off the grid: only ranges taken from the weights move."""
    model = residual_block_model(projection=True, channels=32, seed=4)
    data = random_inputs(model, num=8, seed=4)
    table = onnx_qat.calibrate(model, data, method="max", progress=False)
    weight = next(w for w in onnx_qat.place(model).weights)
    values = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == weight.tensor))
    amax = np.abs(np.moveaxis(values, weight.axis, 0).reshape(values.shape[weight.axis], -1)).max(axis=1)
    amax = amax * np.float32(1.0003)
    ranges = {weight.tensor: WeightRange(weight.axis, tuple(map(float, amax)))}
    given = table.merged(ScaleTable(weights=ranges))
    out = onnx_qat.quantize(model, scales=given, progress=False).model
    scales = weight_dqs(out)[(weight.node, weight.input_index)]["scale"]
    assert np.array_equal(scales, (amax.astype(np.float64) / 127.0).astype(np.float32))
    assert not _is_fp16(scales)


# --------------------------------------------------------------------------- FP8 and INT4
def test_fp8_weight_scales_are_fp16_values_within_one_step_of_amax_over_448():
    from onnx_qat.formats.blockwise import from_fp8

    model = mlp_model(features=128, hidden=64, seed=3)
    data = random_inputs(model, num=8, seed=3)
    result = onnx_qat.quantize(model, data=data, precision="fp8", progress=False)
    inits = {t.name: t for t in result.model.graph.initializer}
    originals = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    seen = 0
    for record in (r for r in result.inserted if r["kind"] == "weight"):
        dq = next(n for n in result.model.graph.node if n.name == record["dequantize_node"])
        scale = numpy_helper.to_array(inits[dq.input[1]])
        w = originals[record["tensor"]]
        amax = np.abs(w).max(axis=1 - record["axis"]) if w.ndim == 2 else None
        assert _is_fp16(scale) and np.all(np.abs(scale - amax / 448.0) <= 2.0 ** -10 * amax / 448.0)
        shape = [1, 1]
        shape[record["axis"]] = -1
        codes = np.frombuffer(inits[dq.input[0]].raw_data, np.uint8).reshape(w.shape)
        from onnx_qat.formats.blockwise import to_fp8
        assert np.array_equal(codes, to_fp8(w, scale.reshape(shape)))  # quantized with that scale
        assert np.abs(from_fp8(codes) * scale.reshape(shape) - w).max() <= np.abs(w).max() * 2 ** -4
        seen += 1
    assert seen >= 2
    parts = cast_float_parts(result.model, "fp16", scales=result.scales).model
    for name, values in _weight_scales(result.model).items():
        assert np.array_equal(_weight_scales(parts)[name], values)


@pytest.mark.parametrize("seed", [0, 1])
def test_int4_block_scales_are_fp16_values_and_the_blocks_requantized(seed):
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((256, 48)) * 0.05).astype(np.float32)
    q, scale = quantize_blocks(values, 0, 64, fp16_grid=True)
    plain_q, plain = quantize_blocks(values, 0, 64)
    assert scale.shape == plain.shape == (4, 48) and _is_fp16(scale)
    assert np.all(np.abs(scale - plain) <= 2.0 ** -10 * plain)
    assert np.array_equal(q, np.clip(np.rint(values / np.repeat(scale, 64, axis=0)), -8, 7))
    err = np.square(dequantize_blocks(q, scale, 0, 64) - values).reshape(4, 64, 48).sum(axis=1)
    down, up = fp16_neighbours(plain)
    for other in (down, up):
        oq = np.clip(np.rint(values / np.repeat(other, 64, axis=0)), -8, 7)
        other_err = np.square(oq * np.repeat(other, 64, axis=0) - values).reshape(4, 64, 48).sum(axis=1)
        assert np.all(err <= other_err + 1e-12)


def test_int4_in_quantize_writes_fp16_block_scales():
    model = mlp_model(features=128, hidden=128, seed=5)
    result = onnx_qat.quantize(model, precision="int4", block_size=64, progress=False)
    inits = {t.name: t for t in result.model.graph.initializer}
    originals = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    records = [r for r in result.inserted if r["kind"] == "weight"]
    assert records
    for record in records:
        dq = next(n for n in result.model.graph.node if n.name == record["dequantize_node"])
        scale = numpy_helper.to_array(inits[dq.input[1]])
        w = originals[record["tensor"]]
        want_q, want_scale = quantize_blocks(w, record["axis"], 64, fp16_grid=True)
        stored = inits[dq.input[0]]
        assert _is_fp16(scale) and np.array_equal(scale, want_scale)
        assert np.array_equal(unpack_int4(stored.raw_data, tuple(stored.dims)), want_q)


def test_optimize_accuracy_writes_fp16_weight_scales():
    """--optimize accuracy's steps quantize through the same inserter; its reconstructed weights keep
    the scales of the model they were fitted in (FP16 values already), so its output is on the grid."""
    from tests.onnx_qat.test_accuracy_optimize import _feeds, spread_pair_model

    model = spread_pair_model(0)
    data = {"input": np.concatenate([_feeds(0)["input"], _feeds(1)["input"]])}
    result = onnx_qat.quantize(model, data=data, optimize="accuracy", progress=False)
    steps = {s["step"]: s for s in result.accuracy["steps"]}
    assert steps["reconstruct"]["kept"]  # the weights written are the reconstructed ones (table ranges)
    assert {r["amax_source"] for r in result.inserted if r["kind"] == "weight"} == {"scale table"}
    scales = _weight_scales(result.model)
    assert len(scales) == 3 and all(_is_fp16(v) for v in scales.values())
    parts = cast_float_parts(result.model, "fp16", scales=result.scales).model
    assert all(np.array_equal(_weight_scales(parts)[k], v) for k, v in scales.items())


@pytest.mark.parametrize("options", [dict(precision="int4", block_size=64),  # AWQ's clipped block ranges
                                     dict(precision="int4", block_size=64, int4_method="gptq"),
                                     dict(precision="fp8", fp8_method="gptq")])
def test_searched_weight_ranges_awq_and_gptq_give_fp16_scales(options):
    """The ranges AWQ's clipping and GPTQ choose go to the inserter through the ScaleTable (written as
    given): they are put on the FP16 grid where they are chosen, so the model holds FP16 scales and
    the INT4 / FP8 values those searches chose, which the FP16 conversion keeps."""
    model = mlp_model(features=128, hidden=128, batch=32, seed=6)
    data = random_inputs(model, num=16, seed=6)
    result = onnx_qat.quantize(model, data=data, progress=False, **options)
    scales = _weight_scales(result.model)
    assert scales and all(_is_fp16(v) for v in scales.values())
    assert {r["amax_source"] for r in result.inserted if r["kind"] == "weight"} == {"scale table"}
    assert (result.awq or result.gptq)
    parts = cast_float_parts(result.model, "fp16", scales=result.scales).model
    assert all(np.array_equal(_weight_scales(parts)[k], v) for k, v in scales.items())


def test_fp16_block_amax_gives_the_block_scale_back_exactly():
    from onnx_qat.formats.blockwise import block_scale, fp16_block_amax, fp16_fp8_amax

    rng = np.random.default_rng(7)
    values = (rng.standard_normal((128, 16)) * 0.02).astype(np.float32)
    values[:64, 3] = 0.0  # a zero block keeps its zero range
    amax = np.abs(values).reshape(2, 64, 16).max(axis=1) * np.float32(0.9)  # a clipped range
    moved = fp16_block_amax(values, amax, 0, 64)
    assert moved[0, 3] == 0 and _is_fp16(block_scale(moved))
    live = moved > 0
    assert np.array_equal(block_scale(moved)[live], (moved.astype(np.float64) / 7)[live])  # exact
    assert np.all(np.abs(moved - amax) <= 2.0 ** -10 * amax)
    fp8 = fp16_fp8_amax(values, np.abs(values).max(axis=0), 1)
    assert _is_fp16((fp8.astype(np.float64) / 448).astype(np.float32)) and fp8[3] > 0


def test_a_per_tensor_scale_and_a_batch_of_weights_take_the_same_grid_as_one_weight():
    rng = np.random.default_rng(9)
    stack = (rng.standard_normal((5, 8, 4, 3, 3)) * np.float32([[1.0], [1e-3], [30.0], [2e-6], [0.2]]
                                                               ).reshape(5, 1, 1, 1, 1)).astype(np.float32)
    scale = (np.abs(stack).reshape(5, 8, -1).max(axis=2) / 127.0).astype(np.float32)
    together = fp16_weight_scales(stack, scale, (5, -1, 1, 1, 1), int8_dequantized(), batched=True)
    for i in range(5):  # item 3's scales (~2e-8) FP16 cannot hold: left as they are, in both ways
        alone = fp16_weight_scales(stack[i], scale[i], (-1, 1, 1, 1), int8_dequantized())
        assert np.array_equal(together[i], alone), i
    assert np.array_equal(together[3], scale[3]) and _is_fp16(together[[0, 2, 4]])
    q, one = quantize_weight(stack[0], None, fp16_grid=True)  # per tensor: one scale, on the grid
    assert one.shape == (1,) and _is_fp16(one)
    assert np.array_equal(q, to_grid(stack[0], one.reshape(()), INT8_QRANGE))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", ["conv_axis0", "matmul_axis1", "per_tensor", "batched"])
def test_a_weight_judged_in_slices_gets_the_scales_of_one_pass(monkeypatch, seed, case):
    """A weight above `ERROR_CHUNK` values is judged a slice of its first axis at a time (bounded
    temporaries for weights of hundreds of MB): the errors of both neighbours match one pass over the
    whole weight to float64 rounding and the scales chosen are the same, whether the first axis is the
    channel axis, the summed one, per tensor or a batch of weights; slices of one row to several."""
    from onnx_qat.formats import scale_grid

    rng = np.random.default_rng(seed)
    values, shape, batched = {
        "conv_axis0": (rng.standard_normal((24, 8, 3, 3)), (-1, 1, 1, 1), False),
        "matmul_axis1": (rng.standard_normal((96, 40)) * 30, (1, -1), False),
        "per_tensor": (rng.standard_normal((50, 7)), (), False),
        "batched": (rng.standard_normal((12, 16, 5)), (12, -1, 1), True),
    }[case]
    values = values.astype(np.float32)
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and values.shape[i] != 1) if shape else \
        tuple(range(values.ndim))
    if case == "batched":
        axes = (2,)
    amax = np.max(np.abs(values), axis=axes) if shape else np.max(np.abs(values))
    scale = (np.asarray(amax, np.float64) / 127).astype(np.float32)
    whole = fp16_weight_scales(values, scale, shape, int8_dequantized(), batched=batched)
    down, up = scale_grid.fp16_scale_candidates(scale)
    broadcast = np.where(np.isfinite(down), down, np.float32(1.0)).reshape(shape)
    one_pass = scale_grid._squared_errors(values, broadcast, int8_dequantized(), axes)
    for chunk in (values[0].size, 3 * values[0].size + 1, values.size - 1):
        monkeypatch.setattr(scale_grid, "ERROR_CHUNK", chunk)
        sliced = scale_grid._squared_errors(values, broadcast, int8_dequantized(), axes)
        assert sliced.shape == one_pass.shape
        np.testing.assert_allclose(sliced, one_pass, rtol=1e-12, atol=0)
        np.testing.assert_array_equal(fp16_weight_scales(values, scale, shape, int8_dequantized(),
                                                         batched=batched), whole)
