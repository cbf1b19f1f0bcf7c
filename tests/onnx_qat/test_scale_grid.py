"""Calibrated activation scales on the FP16 grid (``onnx_qat.formats.scale_grid``): the FP32 Q/DQ
model holds the scales its FP16 float parts hold, user-given scales are written as given, and the
FP16 form tracks the FP32 form."""

import numpy as np
import pytest
from onnx import numpy_helper

import onnx_qat
from onnx_qat.formats.float_parts import activation_scales, cast_float_parts, emulate_in_fp32, get_low_type
from onnx_qat.formats.scale_grid import on_fp16_grid
from onnx_qat.scales import ScaleTable
from tests.builders import (
    amax_table_each,
    assert_check_clean,
    cosine,
    mobilenet_v2_model,
    random_inputs,
    residual_block_model,
    run,
)

FP16 = get_low_type("fp16")


def _scales(model):
    """{initializer name: float32 values} of every activation Q/DQ scale of ``model``."""
    acts = activation_scales(model)
    return {t.name: onnx_qat.io.models.tensor_array(t).astype(np.float32)
            for t in model.graph.initializer if t.name in acts}


def _quantize_scales(model):
    """{activation tensor: its QuantizeLinear's scale (float32)} of a Q/DQ ``model``."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return {n.input[0]: np.float32(inits[n.input[1]])
            for n in model.graph.node if n.op_type == "QuantizeLinear"}


def _run_each(model, feeds):
    count = len(next(iter(feeds.values())))
    return np.concatenate([run(model, {k: v[i:i + 1] for k, v in feeds.items()})[0] for i in range(count)])


@pytest.mark.parametrize("qmax", [127.0, 448.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_range_is_raised_by_less_than_one_fp16_step_to_a_scale_fp16_holds(qmax, seed):
    amax = np.exp(np.random.default_rng(seed).uniform(-2.0, 13.0, 20000))
    got = np.array([on_fp16_grid(a, qmax) for a in amax])
    scale = (got / qmax).astype(np.float32)
    assert np.array_equal(scale.astype(np.float16).astype(np.float32), scale)  # FP16 values, exactly
    assert np.all(got >= amax) and np.all(got - amax < 2.0 ** -10 * amax)
    # the smallest such range: one FP16 step down covers less than the calibrated range
    below = np.nextafter(scale.astype(np.float16), np.float16(0)).astype(np.float64) * qmax
    assert np.all(below < amax)
    # a range already on the grid stays exactly where it is
    assert all(on_fp16_grid(g, qmax) == g for g in got[:500])


@pytest.mark.parametrize("amax", [1e-6, 127 * 1.0001e-6, 127 * 70000.0, 3.0e9])
def test_a_scale_fp16_cannot_hold_is_left_as_calibrated(amax):
    assert on_fp16_grid(amax, 127.0) == amax


@pytest.mark.parametrize("seed", [0, 1])
def test_the_grid_takes_exactly_the_scales_the_conversion_stores_in_fp16(seed):
    """A scale the grid leaves alone is one the FP16 conversion keeps FP32 (`scale_fits`), and one it
    raises is stored in FP16 unchanged: either way converting moves no activation scale."""
    from onnx_qat.formats.float_parts import scale_fits

    scales = np.exp(np.random.default_rng(seed).uniform(np.log(1e-8), np.log(1e5), 20000)).astype(np.float32)
    for s in scales:
        moved = on_fp16_grid(float(s) * 127.0, 127.0)
        s_new = np.float32(moved / 127.0)
        if scale_fits(np.asarray(s), FP16, up=True):
            assert np.float16(s_new) == s_new and s_new >= s and float(s_new - s) <= 2.0 ** -10 * float(s)
            assert scale_fits(np.asarray(s_new), FP16, up=True)
        else:
            assert moved == float(s) * 127.0


@pytest.mark.parametrize("method", ["max", "auto"])
@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_the_fp32_forms_calibrated_activation_scales_are_fp16_values(method, scale):
    model = residual_block_model(projection=True, seed=2)
    data = {k: v * scale for k, v in random_inputs(model, num=16, seed=2).items()}
    result = onnx_qat.quantize(model, data=data, method=method, progress=False)
    scales = _scales(result.model)
    assert len(scales) >= 3
    for name, values in scales.items():
        assert values.dtype == np.float32 and np.all(values >= 2.0 ** -14)  # in FP16's normal range here
        assert np.array_equal(values.astype(np.float16).astype(np.float32), values), name
    # the table says so, and its ranges give exactly the scales written
    assert result.scales.metadata["scale_grid"] == "fp16 (amax / 127)"
    written = _quantize_scales(result.model)
    raw = amax_table_each(model, data, tensors=list(written)).activations if method == "max" else {}
    for tensor, s in written.items():
        assert s == np.float32(result.scales.activations[tensor] / 127.0)
        if tensor in raw:  # max: the calibrated max, raised by less than one FP16 step, never lowered
            assert raw[tensor] * (1 - 1e-6) <= s * 127.0 < raw[tensor] * (1 + 2.0 ** -10)


def test_fp8_takes_the_same_ranges_and_ort_cpu_the_plain_ones():
    """One table serves every precision: FP8 calibrates the INT8 grid's ranges (its scales amax/448 are
    rounded by the FP16 conversion); the ort-cpu form (FP32 only) keeps the collectors' ranges."""
    model = residual_block_model(projection=True, seed=5)
    data = random_inputs(model, num=16, seed=5)
    int8 = onnx_qat.quantize(model, data=data, method="max", progress=False).scales
    fp8 = onnx_qat.quantize(model, data=data, method="max", precision="fp8", progress=False).scales
    assert fp8.activations == {k: v for k, v in int8.activations.items() if k in fp8.activations}
    cpu = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False).scales
    raw = amax_table_each(model, data, tensors=["input", "relu1_out"]).activations
    assert "scale_grid" not in cpu.metadata
    assert all(cpu.activations[k] == pytest.approx(raw[k], rel=1e-6) for k in raw)  # the plain maxima
    assert any(np.float16(np.float32(v / 127.0)) != np.float32(v / 127.0) for v in cpu.activations.values())
    table = onnx_qat.calibrate(model, data, method="max", target="ort-cpu", progress=False)
    assert "scale_grid" not in table.metadata
    assert all(table.activations[k] == pytest.approx(raw[k], rel=1e-6) for k in raw)


def test_calibrate_gives_the_same_grid_as_quantize():
    model = residual_block_model(projection=True, seed=4)
    data = {k: v * 255.0 for k, v in random_inputs(model, num=16, seed=4).items()}
    table = onnx_qat.calibrate(model, data, method="max", progress=False)
    result = onnx_qat.quantize(model, data=data, method="max", progress=False)
    assert table.activations == result.scales.activations
    for amax in table.activations.values():
        s = np.float32(amax / 127.0)
        assert np.float16(s) == s


@pytest.mark.parametrize("seed", [0, 1])
def test_a_user_given_scale_table_is_written_unchanged(tmp_path, seed):
    """Ranges a user gives (a ScaleTable, its JSON file, a TensorRT cache) are not moved to the grid:
    every scale is exactly float32(amax / 127)."""
    model = residual_block_model(projection=True, seed=seed)
    data = random_inputs(model, num=8, seed=seed)
    raw = amax_table_each(model, data)
    rng = np.random.default_rng(seed)
    given = ScaleTable({k: v * float(rng.uniform(1.0, 1.001)) for k, v in raw.activations.items()},
                       producer="user")
    path = tmp_path / "given.json"
    given.save(path)
    cache = tmp_path / "given.cache"
    given.save_tensorrt_cache(cache, tensorrt_version="10.1.0")
    off_grid = 0
    for scales in (given, str(path)):
        written = _quantize_scales(onnx_qat.quantize(model, scales=scales, progress=False).model)
        assert written
        for tensor, s in written.items():
            assert s == np.float32(given.activations[tensor] / 127.0), tensor
            off_grid += int(np.float16(s) != s)
    assert off_grid > 0  # the check means something: the given scales are off the FP16 grid
    from_cache = _quantize_scales(onnx_qat.quantize(model, scales=str(cache), progress=False).model)
    for tensor, s in from_cache.items():  # the cache holds float32 scales: bit for bit
        assert s == np.float32(given.activations[tensor] / 127.0), tensor


@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 255.0)])
def test_converting_the_fp32_form_leaves_every_activation_scale_unchanged(seed, scale):
    model = residual_block_model(projection=True, seed=seed)
    data = {k: v * scale for k, v in random_inputs(model, num=16, seed=seed).items()}
    fp32 = onnx_qat.quantize(model, data=data, method="max", progress=False)
    before = _scales(fp32.model)
    for kw in ({}, {"data": data}):  # without data, and with the measurement
        parts = cast_float_parts(fp32.model, "fp16", scales=fp32.scales, **kw)
        after = _scales(parts.model)
        # a scale read in both types (rule boundary: the input's QuantizeLinear stays FP32) keeps its
        # FP32 initializer and gains a low copy; each holds the value it held before
        copies = {name: name.rsplit("/", 1)[0] for name in set(after) - set(before)}
        assert set(after) == set(before) | set(copies)
        assert all(name.endswith("/fp16") and base in before for name, base in copies.items()), copies
        for name, values in before.items():
            assert np.array_equal(after[name], values), name
        for name, base in copies.items():
            assert np.array_equal(after[name], before[base]), name
        if kw:  # nothing to choose between: both roundings are the identity
            rounding = parts.measurement["scale_rounding"]
            assert rounding["drop_up"] == rounding["drop_nearest"] and rounding["chosen"] == "up"


@pytest.mark.parametrize("build, seed", [(lambda s: residual_block_model(projection=True, seed=s), 0),
                                         (lambda s: residual_block_model(projection=True, seed=s), 3),
                                         (lambda s: mobilenet_v2_model(size=16, batch=1, seed=s), 1)])
@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_the_fp16_form_tracks_the_fp32_form(build, seed, scale):
    """The FP16 model's outputs stay with the FP32 model's: same grid, only FP16 storage between."""
    model = build(seed)
    data = {k: v * scale for k, v in random_inputs(model, num=16, seed=seed).items()}
    evaluation = {k: v * scale for k, v in random_inputs(model, num=8, seed=seed + 100).items()}
    fp32 = onnx_qat.quantize(model, data=data, progress=False)
    fp16 = onnx_qat.quantize(model, data=data, float_dtype="fp16", progress=False)
    assert_check_clean(fp16.model)
    s32, s16 = _scales(fp32.model), _scales(fp16.model)
    assert s16 and all(np.array_equal(s16[n], s32[n]) for n in s16 if n in s32)
    ref = _run_each(model, evaluation)
    out32 = _run_each(fp32.model, evaluation)
    out16 = _run_each(emulate_in_fp32(fp16.model), evaluation)
    c32, c16 = cosine(ref, out32), cosine(ref, out16)
    assert c16 >= c32 - 0.002  # the budget against the float model
    # FP16 storage moves the INT8 model's outputs by no more than INT8 moves the float model's
    assert cosine(out32, out16) >= c32 - 0.002 and cosine(out32, out16) > 0.995
    rounding = fp16.float_parts.measurement["scale_rounding"]
    assert rounding["drop_up"] == rounding["drop_nearest"]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_grids_round_up_is_the_conversions(seed):
    """The grid's FP16 round-up (the one the conversion's `LowType.round_up` calls for FP16) gives the
    smallest FP16 value not below each float32 (from a table of every finite FP16 value; inf above
    65504), and every scale the grid moves is that round-up of the float32 scale, itself rounded up
    from ``amax / 127``; the others are left as given (beyond FP16, deep in its subnormals, or FP16
    values already)."""
    from onnx_qat.formats.scale_grid import fp16_grid_values, fp16_round_up

    floats = np.exp(np.random.default_rng(seed).uniform(np.log(1e-9), np.log(1e6), 5000)).astype(np.float32)
    floats[:5] = [0.0, 2.0 ** -24, 65504.0, 65504.5, 2.0 ** -26]  # zero, the ends of FP16, between them
    table = np.arange(1 << 15, dtype=np.uint16).view(np.float16).astype(np.float32)  # every value >= 0
    table = table[np.isfinite(table)]
    at = np.searchsorted(table, floats, side="left")
    want = np.where(at < len(table), table[np.minimum(at, len(table) - 1)], np.float32(np.inf))
    assert np.array_equal(fp16_round_up(floats), want) and np.array_equal(FP16.round_up(floats), want)
    assert fp16_round_up(floats[:5]).tolist() == [0.0, 2.0 ** -24, 65504.0, np.inf, 2.0 ** -24]
    values = np.exp(np.random.default_rng(seed).uniform(np.log(1e-9), np.log(1e6), 5000)) * 127.0
    got = np.asarray(fp16_grid_values(values.tolist(), 127.0))
    scale = (values / 127.0).astype(np.float32)
    down = scale.astype(np.float64) < values / 127.0
    scale = np.where(down, np.nextafter(scale, np.float32(np.inf)), scale)
    up = FP16.round_up(scale).astype(np.float64)
    moved = got != values
    assert moved.sum() > 3000 and np.array_equal(got[moved], 127.0 * up[moved])
    assert np.all((up[~moved] > 65504) | (up[~moved] - scale[~moved] > 2.0 ** -10 * scale[~moved])
                  | (up[~moved] == scale[~moved]))


@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 255.0)])
def test_every_range_auto_and_the_range_search_choose_from_is_on_the_grid(seed, scale):
    """auto's candidate tables and every candidate range kept for --min-cosine / --optimize accuracy
    are on the grid too: whatever they choose is the grid that is written."""
    from onnx_qat.calibration.runner import collect
    from onnx_qat.io.data import load_data

    model = residual_block_model(projection=True, seed=seed)
    data = {k: v * scale for k, v in random_inputs(model, num=16, seed=seed).items()}
    tensors = onnx_qat.place(model).activation_tensors()
    found = collect(model, load_data(data, model), tensors, method="auto", progress=False)
    values = [v for table in found.candidates.values() for v in table.values()]
    values += [v for options in found.options.values() for v in options.values()]
    assert len(values) > 3 * len(tensors)
    for amax in values:
        s = np.float32(amax / 127.0)
        assert np.float16(s) == s and on_fp16_grid(amax, 127.0) == amax
    plain = collect(model, load_data(data, model), tensors, method="auto", progress=False, fp16_grid=False)
    assert plain.ranges.keys() == found.ranges.keys()
    for name, amax in plain.ranges.items():
        assert found.ranges[name] == on_fp16_grid(amax, 127.0) and "scale_grid" not in plain.metadata


@pytest.mark.parametrize("method, candidates", [("max", False), ("auto", True)])
def test_the_accuracy_searches_give_the_ort_cpu_form_the_plain_ranges(method, candidates):
    """--min-cosine and --optimize accuracy calibrate through `onnx_qat.accuracy.prepared.prepare`:
    for the ort-cpu form (FP32 only) it keeps the collectors' ranges, off the grid, as quantize does."""
    from onnx_qat.accuracy.prepared import prepare
    from onnx_qat.config import QuantizeConfig

    model = residual_block_model(projection=True, seed=6)
    data = {k: v * 255.0 for k, v in random_inputs(model, num=16, seed=6).items()}
    tables = {}
    for target in ("tensorrt", "ort-cpu"):
        prepared, _ = prepare(model, data, method=method, config=QuantizeConfig(target=target),
                              progress=False, range_candidates=candidates)
        with prepared:
            tables[target] = dict(prepared.table.activations)
    assert tables["tensorrt"].keys() == tables["ort-cpu"].keys()
    for name, amax in tables["ort-cpu"].items():
        assert tables["tensorrt"][name] == on_fp16_grid(amax, 127.0)
    assert any(np.float16(np.float32(v / 127.0)) != np.float32(v / 127.0) for v in tables["ort-cpu"].values())
