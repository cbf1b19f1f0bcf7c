"""Calibrating once for the ``ort-cpu`` form: ``calibrate(..., target="ort-cpu")``.

``quantize(model, data=..., target="ort-cpu")`` calibrates more than the TensorRT placement's tensors: the
Conv outputs it requantizes with their own range (rule CPU1), and it treats its ranges as calibrated (the
whole uint8 grid for non-negative tensors, graph inputs >= 0 on the data, the CPU's weight width). A table
from ``calibrate(..., target="ort-cpu")`` carries all of that, so ``quantize(model, scales=table,
target="ort-cpu")`` gives the same requantization records and the same model, Conv biases apart (rule CPU7
needs the data itself and is not in the table)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import onnx_qat
from onnx_qat.errors import ConfigError
from onnx_qat.scales import CALIBRATION_TARGET_KEY
from tests import builders as B
from tests.onnx_qat.test_cli import run_cli


def _data(seed: int, scale: str, channels: int = 16, size: int = 16, num: int = 16) -> np.ndarray:
    """Image-like samples: 0..255 (``"x255"``) or normalized per channel (``"normalized"``, either sign)."""
    rng = np.random.default_rng(seed)
    images = rng.random((num, channels, size, size)).astype(np.float32) * 255
    if scale == "x255":
        return images
    mean = images.mean(axis=(0, 2, 3), keepdims=True)
    std = images.std(axis=(0, 2, 3), keepdims=True)
    return ((images - mean) / std).astype(np.float32)


def _records(result) -> list:
    return [(r["tensor"], r["rule"], r["status"], r.get("amax")) for r in result.requantization]


def _initializers(model) -> dict:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def _conv_biases(model) -> dict:
    """``{Conv name: its bias initializer name}``."""
    return {n.name: n.input[2] for n in model.graph.node if n.op_type == "Conv" and len(n.input) > 2}


def _with_biases_of(model, other):
    """A copy of ``model`` whose Conv biases hold ``other``'s values (same Conv names)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    values, theirs = _initializers(other), _conv_biases(other)
    inits = {i.name: i for i in copy.graph.initializer}
    for conv, bias in _conv_biases(copy).items():
        inits[bias].CopyFrom(numpy_helper.from_array(values[theirs[conv]], bias))
    return copy


def _error(model, float_model, feeds) -> float:
    reference = B.run_optimized(float_model, feeds)
    got = B.run_optimized(model, feeds)
    return float(np.abs(got - reference).mean() / (reference.max() - reference.min()))


@pytest.mark.parametrize("method", ["max", "percentile", "auto"])
@pytest.mark.parametrize("seed,scale,projection", [(0, "x255", False), (1, "normalized", True),
                                                    (2, "x255", True), (3, "normalized", False)])
def test_a_table_calibrated_for_ort_cpu_gives_the_form_quantize_data_gives(method, seed, scale, projection,
                                                                          tmp_path):
    model = B.residual_block_model(projection=projection, channels=16, size=16, seed=seed)
    data = {"input": _data(seed, scale)}
    direct = onnx_qat.quantize(model, data=data, method=method, target="ort-cpu", progress=False)
    table = onnx_qat.calibrate(model, data, method=method, target="ort-cpu", progress=False)
    assert table.metadata[CALIBRATION_TARGET_KEY] == "ort-cpu"
    # the ranges quantize calibrates for the form (and the points' ranges taken from another tensor)
    assert {k: direct.scales.activations[k] for k in table.activations} == dict(table.activations)
    assert {k: v for k, v in direct.scales.bounds.items() if k in table.activations} == dict(table.bounds)
    given = onnx_qat.quantize(model, scales=table, target="ort-cpu", progress=False)

    # the same requantization records: every Conv requantized, with the same statuses and amax
    assert _records(given) == _records(direct)
    statuses = {r["status"] for r in given.requantization if r["rule"] == "CPU1"}
    assert "not requantized" not in statuses and "added" in statuses
    # the same zero points, the same weight width
    assert [(r["tensor"], r.get("scale"), r.get("zero_point")) for r in given.inserted] == \
        [(r["tensor"], r.get("scale"), r.get("zero_point")) for r in direct.inserted]
    assert given.ort_cpu["weight_bits"] == direct.ort_cpu["weight_bits"]
    assert "bias_correction" not in given.ort_cpu
    assert any("rule CPU7" in note and "needs the data itself" in note for note in given.placement.notes)

    # the same model but for the Conv biases rule CPU7 corrected with the data
    corrected = set(direct.ort_cpu["bias_correction"]["nodes"]) \
        if direct.ort_cpu["bias_correction"]["guard"]["kept"] else set()
    assert [n.op_type for n in given.model.graph.node] == [n.op_type for n in direct.model.graph.node]
    mine, theirs = _initializers(given.model), _initializers(direct.model)
    biases = {b for conv, b in _conv_biases(direct.model).items() if conv in corrected} | \
        {b for conv, b in _conv_biases(given.model).items() if conv in corrected}
    assert set(mine) ^ set(theirs) <= biases
    assert [k for k in mine if k in theirs and not np.array_equal(mine[k], theirs[k])] == []
    B.assert_check_clean(given.model, target="ort-cpu")
    ops = B.optimized_ops(given.model, tmp_path)  # every Conv on onnxruntime's integer kernel
    assert ops.count("QLinearConv") == (4 if projection else 3) and "Conv" not in ops, ops

    # as deployed (onnxruntime, all optimizations): with the same biases, the very same numbers
    feeds = {"input": _data(seed + 100, scale, num=1)}
    same = B.run_optimized(_with_biases_of(direct.model, given.model), feeds)
    np.testing.assert_array_equal(B.run_optimized(given.model, feeds), same)
    # and without them, close to the form with the data's bias correction
    assert _error(given.model, model, feeds) <= 2.0 * _error(direct.model, model, feeds) + 1e-4


def test_the_tensorrt_table_is_unchanged_and_leaves_convs_float_with_a_note_naming_the_cpu_table(tmp_path):
    model = B.residual_block_model(channels=16, size=16, seed=0)
    data = {"input": _data(0, "x255")}
    default = onnx_qat.calibrate(model, data, method="max", progress=False)
    tensorrt = onnx_qat.calibrate(model, data, method="max", target="tensorrt", progress=False)
    assert default.to_dict() == tensorrt.to_dict()
    assert CALIBRATION_TARGET_KEY not in default.metadata
    assert set(default.activations) == set(onnx_qat.place(model).activation_tensors())

    result = onnx_qat.quantize(model, scales=default, target="ort-cpu", progress=False)
    lost = [r for r in result.requantization if r["status"] == "not requantized"]
    assert {r["tensor"] for r in lost} == {"conv1_out", "conv2_out"}
    assert B.optimized_ops(result.model, tmp_path).count("Conv") == 2  # float: the gap this closes
    notes = [n for n in result.placement.notes if "keeps a float output" in n]
    assert len(notes) == 2 and all("onnx-qat calibrate --target ort-cpu" in n for n in notes)
    assert not any("rule CPU7" in n for n in result.placement.notes)


@pytest.mark.parametrize("vnni", [True, False])
def test_cpu_vnni_applies_to_a_table_calibrated_for_ort_cpu(vnni):
    model = B.residual_block_model(projection=True, channels=16, size=16, seed=4)
    data = {"input": _data(4, "normalized")}
    table = onnx_qat.calibrate(model, data, method="max", target="ort-cpu", progress=False)
    given = onnx_qat.quantize(model, scales=table, target="ort-cpu", cpu_vnni=vnni, progress=False)
    direct = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", cpu_vnni=vnni,
                               progress=False)
    assert given.ort_cpu["weight_bits"] == direct.ort_cpu["weight_bits"] == (8 if vnni else 7)
    assert given.ort_cpu["chosen_by"] == "option"
    mine, theirs = _initializers(given.model), _initializers(direct.model)
    weights = [r["initializer"] for r in direct.inserted if r["kind"] == "weight"]
    assert weights and all(np.array_equal(mine[w], theirs[w]) for w in weights)
    peak = max(int(np.abs(mine[w].astype(np.int32)).max()) for w in weights)
    assert peak == 127 if vnni else peak == 63


def test_cpu_vnni_is_refused_with_ranges_not_calibrated_for_ort_cpu(tmp_path):
    model = B.residual_block_model(channels=16, size=16, seed=0)
    table = onnx_qat.calibrate(model, {"input": _data(0, "x255")}, method="max", progress=False)
    out = tmp_path / "q.onnx"
    with pytest.raises(ConfigError, match="cpu_vnni applies to calibrated ranges"):
        onnx_qat.quantize(model, out, scales=table, target="ort-cpu", cpu_vnni=True, progress=False)
    assert not out.exists()


def test_cli_calibrate_target_ort_cpu_then_quantize_scales(tmp_path):
    model = B.residual_block_model(projection=True, channels=16, size=16, seed=5)
    path, data, scales = tmp_path / "m.onnx", tmp_path / "calib.npz", tmp_path / "scales.json"
    onnx.save(model, str(path))
    np.savez(data, input=_data(5, "x255"))
    done = run_cli("calibrate", path, "--data", data, "-o", scales, "--method", "max", "--target", "ort-cpu",
                   "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "for --target ort-cpu" in done.stdout and "rule CPU7" in done.stdout
    written = json.loads(scales.read_text())
    assert written["metadata"][CALIBRATION_TARGET_KEY] == "ort-cpu"
    assert {"conv1_out", "conv2_out", "proj_conv_out"} <= set(written["activations"])
    out, report = tmp_path / "q.onnx", tmp_path / "r.json"
    done = run_cli("quantize", path, "--scales", scales, "--target", "ort-cpu", "-o", out, "--report", report,
                   "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "check (ort-cpu rules): PASSED" in done.stdout
    records = json.loads(report.read_text())["requantization"]
    assert not [r for r in records if r["status"] == "not requantized"]


def test_cli_refuses_a_tensorrt_cache_for_the_cpu_form(tmp_path):
    model = B.residual_block_model(channels=16, size=16, seed=0)
    path, data, out = tmp_path / "m.onnx", tmp_path / "calib.npz", tmp_path / "calib.cache"
    onnx.save(model, str(path))
    np.savez(data, input=_data(0, "x255", num=2))
    done = run_cli("calibrate", path, "--data", data, "-o", out, "--target", "ort-cpu", "--format",
                   "tensorrt-cache", "--tensorrt-version", "10.3.0")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--format tensorrt-cache" in lines[0] and "ort-cpu" in lines[0]
    assert not out.exists()
