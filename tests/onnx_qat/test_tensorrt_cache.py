"""TensorRT calibration caches: reading, writing, round trips, matching to a model, bad input."""
from __future__ import annotations

import struct

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.cli import EXIT_OK, EXIT_USAGE, main
from onnx_qat.errors import ScalesError
from onnx_qat.scales import ScaleTable
from onnx_qat.io.tensorrt_cache import (
    hex_to_scale, parse_tensorrt_cache, scale_to_hex, tensorrt_version_number,
)
from tests.builders import conv_bn_relu_model, random_inputs, residual_block_model


def _hex(scale: float) -> str:
    """What TensorRT writes: the float32 bits as one 32-bit integer in hex (most significant first)."""
    return format(struct.unpack("<I", struct.pack("<f", scale))[0], "x")


def _model_and_data(tmp_path, seed=0, scale=1.0):
    model = residual_block_model(seed=seed)
    data = {k: v * scale for k, v in random_inputs(model, num=8, seed=seed).items()}
    path, npz = tmp_path / "float.onnx", tmp_path / "data.npz"
    onnx.save(model, str(path))
    np.savez(npz, **data)
    return model, path, npz


def _cache_for(model, data, tmp_path, extra=(), header="TRT-8601-EntropyCalibration2"):
    """A cache as TensorRT would write it for ``model``: every activation tensor's max |x| / 127,
    plus ``extra`` names TensorRT made itself."""
    table = onnx_qat.calibrate(model, data, method="max", progress=False)
    lines = [header] + [f"{name}: {_hex(amax / 127)}" for name, amax in table.activations.items()]
    lines += [f"{name}: {_hex(0.5)}" for name in extra]
    path = tmp_path / "calib.cache"
    path.write_text("\n".join(lines) + "\n")
    return path, table


# -- the format -------------------------------------------------------------------------------------
def test_hex_is_the_big_endian_float32_bits_of_the_scale():
    # 1/127 -> 0x3c010204 (TensorRT caches of inputs in [0, 1]); leading zeros are dropped by TensorRT
    assert scale_to_hex(1 / 127) == "3c010204" == _hex(1 / 127)
    assert hex_to_scale("3c010204") == np.float32(1 / 127)
    assert hex_to_scale("1") == struct.unpack(">f", b"\x00\x00\x00\x01")[0]  # 1 digit = low bits
    header, ranges = parse_tensorrt_cache("TRT-8601-EntropyCalibration2\ninput: 3c010204\n")
    assert header == "TRT-8601-EntropyCalibration2"
    assert ranges["input"] == float(np.float32(1 / 127)) * 127 and abs(ranges["input"] - 1.0) < 1e-8


@pytest.mark.parametrize("header", ["TRT-8601-EntropyCalibration2", "TRT-100100-EntropyCalibration2",
                                    "TRT-7103-EntropyCalibration", "TRT-8203-MinMaxCalibration",
                                    "TRT-100300-LegacyCalibration"])
def test_every_calibrator_header_is_read(header, tmp_path):
    path = tmp_path / "c.cache"
    path.write_text(f"{header}\na: {_hex(0.25)}\n(Unnamed Layer* 3) [Constant]_output: 3f800000\n")
    table = ScaleTable.from_tensorrt_cache(path)
    assert table.activations == {"a": 0.25 * 127, "(Unnamed Layer* 3) [Constant]_output": 127.0}
    assert table.metadata["tensorrt_cache_header"] == header


@pytest.mark.parametrize("version, number", [("8.6.1", 8601), ("10.1.0", 100100), ("7.1.3", 7103),
                                             ("10.13.2.6", 101302), ("11.4", 110400)])
def test_header_version_numbers(version, number):
    assert tensorrt_version_number(version) == number


@pytest.mark.parametrize("seed, scale", [(0, 1.0), (1, 1e-3), (2, 300.0)])
def test_round_trips_bit_for_bit(seed, scale, tmp_path):
    """cache -> table -> cache is the same bytes; table -> cache -> table is the same table when its
    ranges came from a cache, and the Q/DQ scales are bit-identical either way."""
    model, _, npz = _model_and_data(tmp_path, seed, scale)
    calibrated = onnx_qat.calibrate(model, str(npz), method="max", progress=False)
    calibrated.save_tensorrt_cache(tmp_path / "a.cache", tensorrt_version="10.3.0")
    table = ScaleTable.from_tensorrt_cache(tmp_path / "a.cache")
    table.save_tensorrt_cache(tmp_path / "b.cache", tensorrt_version="10.3.0")
    assert (tmp_path / "b.cache").read_bytes() == (tmp_path / "a.cache").read_bytes()
    back = ScaleTable.from_tensorrt_cache(tmp_path / "b.cache")
    assert back == table and back.activations == table.activations  # bit for bit: == on floats
    # calibrated (float64) ranges come back within float32 rounding
    for name, amax in calibrated.activations.items():
        assert abs(table.activations[name] - amax) <= 6e-8 * amax
    # the Q/DQ models quantized from the calibrated table and from the round-tripped one are identical
    weights = ScaleTable(weights=calibrated.weights)
    a = onnx_qat.quantize(model, scales=ScaleTable(calibrated.activations).merged(weights), progress=False)
    b = onnx_qat.quantize(model, scales=table.merged(weights), progress=False)
    assert a.model.SerializeToString() == b.model.SerializeToString()


def test_weight_ranges_are_left_out_of_a_cache(caplog):
    table = ScaleTable({"x": 2.0}, {"w": {"axis": 0, "amax": [1.0, 2.0]}})
    with caplog.at_level("INFO", logger="onnx_qat"):
        text = table.to_tensorrt_cache(tensorrt_version="8.6.1", algorithm="MinMaxCalibration")
    assert text == f"TRT-8601-MinMaxCalibration\nx: {_hex(2.0 / 127)}\n"
    assert "1 weight range(s) left out" in caplog.text


# -- quantize from a cache ----------------------------------------------------------------------------
def test_quantize_from_a_cache_warns_once_for_tensorrt_names(tmp_path, caplog):
    model, path, npz = _model_and_data(tmp_path)
    extra = [f"(Unnamed Layer* {i}) [Shuffle]_output" for i in range(25)]
    cache, table = _cache_for(model, str(npz), tmp_path, extra=extra)
    with caplog.at_level("WARNING", logger="onnx_qat"):
        result = onnx_qat.quantize(str(path), scales=str(cache), progress=False)
    warnings = [r for r in caplog.records if "not in the model" in r.getMessage()]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "25 of" in message and "(Unnamed Layer* 0) [Shuffle]_output" in message and "+5 more" in message
    assert onnx_qat.check(result.model).findings == ()
    # the scales in the model are the cache's, exactly
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in result.model.graph.initializer}
    q = {n.input[0]: inits[n.input[1]] for n in result.model.graph.node if n.op_type == "QuantizeLinear"
         and n.input[0] in table.activations}
    assert q and all(v == np.float32(table.activations[k] / 127) for k, v in q.items())


def test_cli_quantize_scales_cache_and_calibrate_writes_one(tmp_path):
    model, path, npz = _model_and_data(tmp_path)
    cache, out = tmp_path / "written.cache", tmp_path / "q.onnx"
    assert main(["calibrate", str(path), "--data", str(npz), "-o", str(cache), "--format", "tensorrt-cache",
                 "--tensorrt-version", "8.6.1", "--method", "max", "--no-progress"]) == EXIT_OK
    text = cache.read_text()
    assert text.startswith("TRT-8601-EntropyCalibration2\n")
    assert ScaleTable.from_tensorrt_cache(cache).activations == parse_tensorrt_cache(text)[1]
    assert main(["quantize", str(path), "--scales", str(cache), "-o", str(out), "--no-progress"]) == EXIT_OK
    from_json = onnx_qat.quantize(str(path), data=str(npz), method="max", progress=False)
    assert onnx.load(str(out)).SerializeToString() == from_json.model.SerializeToString()


# -- bad input ---------------------------------------------------------------------------------------
BAD_CACHES = {
    "json": ('{"format": "onnx-qat-scales"}', None),
    "no header": ("input: 3c010204\n", "is not a TensorRT calibration cache"),
    "unknown calibrator": ("TRT-8601-Percentile\ninput: 3c010204\n", "unknown calibration algorithm"),
    "non-hex": ("TRT-8601-EntropyCalibration2\ninput: 3c01z204\n", "line 2"),
    "too many digits": ("TRT-8601-EntropyCalibration2\ninput: 3c0102041\n", "1 to 8 hex digits"),
    "no colon": ("TRT-8601-EntropyCalibration2\ninput 3c010204\n", "is not 'tensor_name: hex scale'"),
    "NaN": ("TRT-8601-EntropyCalibration2\ninput: 7fc00000\n", "finite and > 0"),
    "inf": ("TRT-8601-EntropyCalibration2\ninput: 7f800000\n", "finite and > 0"),
    "zero": ("TRT-8601-EntropyCalibration2\ninput: 0\n", "finite and > 0"),
    "negative": ("TRT-8601-EntropyCalibration2\ninput: bc010204\n", "finite and > 0"),
    "twice": ("TRT-8601-EntropyCalibration2\ninput: 3c010204\ninput: 3c010204\n", "given twice"),
    "empty": ("TRT-8601-EntropyCalibration2\n", "holds no tensor scales"),
    "names nothing": ("TRT-8601-EntropyCalibration2\nother_model_input: 3c010204\n", "matches no tensor"),
}


@pytest.mark.parametrize("case", sorted(BAD_CACHES))
def test_bad_caches_are_one_line_exit_2_nothing_written(case, tmp_path, capsys):
    text, words = BAD_CACHES[case]
    model, path, _ = _model_and_data(tmp_path)
    cache, out = tmp_path / "bad.cache", tmp_path / "q.onnx"
    cache.write_text(text)
    before = path.read_bytes()
    code = main(["quantize", str(path), "--scales", str(cache), "-o", str(out), "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_USAGE and len(lines) == 1 and lines[0].startswith("onnx-qat: error: "), err
    if words is not None:
        assert words in lines[0] and str(cache) in lines[0]
    assert not out.exists() and path.read_bytes() == before and cache.read_text() == text
    if words is not None and case != "names nothing":
        with pytest.raises(ScalesError, match=words.replace("(", r"\(").replace(")", r"\)")):
            ScaleTable.from_tensorrt_cache(cache)


def test_binary_and_missing_caches(tmp_path):
    binary = tmp_path / "bin.cache"
    binary.write_bytes(b"TRT-8601-EntropyCalibration2\n\xff\xfe: 00\n")
    with pytest.raises(ScalesError, match="is not text"):
        ScaleTable.from_tensorrt_cache(binary)
    with pytest.raises(ScalesError, match="does not exist"):
        ScaleTable.from_tensorrt_cache(tmp_path / "missing.cache")


@pytest.mark.parametrize("argv, words", [
    (["--format", "tensorrt-cache"], "needs --tensorrt-version"),
    (["--format", "tensorrt-cache", "--tensorrt-version", "eight"], "is not MAJOR.MINOR.PATCH"),
    (["--tensorrt-version", "8.6.1"], "apply only with --format tensorrt-cache"),
])
def test_calibrate_cache_options_refused_before_work(argv, words, tmp_path, capsys):
    _, path, npz = _model_and_data(tmp_path)
    out = tmp_path / "c.cache"
    code = main(["calibrate", str(path), "--data", str(npz), "-o", str(out), "--no-progress"] + argv)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and words in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_conv_model_cache_with_extra_graph_names(tmp_path):
    """A cache that covers the model but also names a renamed tensor: the quantized model still checks
    clean, and its scales come from the cache."""
    model = conv_bn_relu_model(seed=3)
    data = random_inputs(model, num=4, seed=3)
    cache, _ = _cache_for(model, data, tmp_path, extra=["renamed_since"])
    result = onnx_qat.quantize(model, scales=str(cache), progress=False)
    assert not onnx_qat.check(result.model).findings


def test_names_holding_colons_and_spaces_round_trip(tmp_path):
    """tf2onnx names tensors ``layer/BiasAdd:0``; TensorRT names its own ``(Unnamed Layer* 3) [...]``."""
    names = {"model/conv1/BiasAdd:0": 2.5, "(Unnamed Layer* 3) [Constant]_output": 0.75, "a: b": 1.0}
    path = tmp_path / "c.cache"
    ScaleTable(names).save_tensorrt_cache(path, tensorrt_version="10.3.0")
    assert "model/conv1/BiasAdd:0: " in path.read_text()
    back = ScaleTable.from_tensorrt_cache(path)
    assert set(back.activations) == set(names)
    assert all(abs(back.activations[n] - v) <= 6e-8 * v for n, v in names.items())
