"""Determinism: the same model, data and options give byte-identical output models, reports
and ScaleTables in separate processes with different hash seeds (issue 8, item 5)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.builders import concat_model, random_inputs, transformer_block_model
from tests.reliability import support

SEEDS = ("1", "4242")


def _run_twice(tmp_path, model, feeds, args):
    """Run ``onnx-qat ARGS`` in two fresh directories holding the same inputs, each in its own
    process with a different PYTHONHASHSEED; return ``{file name: [hash run 1, hash run 2]}``
    of every file the runs wrote."""
    hashes = {}
    for seed in SEEDS:
        directory = tmp_path / f"run_{seed}"
        directory.mkdir()
        support.save(model, directory / "model.onnx")
        np.savez(directory / "calib.npz", **feeds)
        before = set(support.snapshot(directory))
        proc = support.run_cli(*args, cwd=directory, env=support.cli_env(PYTHONHASHSEED=seed))
        assert proc.returncode == 0, proc.stderr
        for name, digest in support.snapshot(directory).items():
            if name not in before:
                hashes.setdefault(name, []).append(digest)
    return hashes


def _assert_identical(hashes, expected):
    assert sorted(hashes) == sorted(expected), f"runs wrote {sorted(hashes)}"
    different = [name for name, pair in hashes.items() if len(pair) != 2 or pair[0] != pair[1]]
    assert not different, f"not byte-identical across processes: {different}"


def test_quantize_with_data_is_byte_identical_across_processes(tmp_path):
    model = concat_model()
    feeds = random_inputs(model, num=6, seed=3)
    args = ["quantize", "model.onnx", "-o", "q.onnx", "--data", "calib.npz", "--method", "entropy",
            "--report", "report.json"]
    hashes = _run_twice(tmp_path, model, feeds, args)
    _assert_identical(hashes, ["q.onnx", "report.json"])


@pytest.mark.parametrize("method", ["max", "percentile", "mse"])
def test_calibrate_is_byte_identical_across_processes(tmp_path, method):
    model = transformer_block_model()
    feeds = random_inputs(model, num=4, seed=5)
    hashes = _run_twice(tmp_path, model, feeds, ["calibrate", "model.onnx", "-o", "scales.json", "--data",
                                                 "calib.npz", "--method", method, "--include-attention"])
    _assert_identical(hashes, ["scales.json"])
    table = json.loads((tmp_path / f"run_{SEEDS[0]}" / "scales.json").read_text())
    assert table["activations"], "the ScaleTable should hold ranges"


def test_scales_round_trip_gives_the_same_model_as_calibrating(tmp_path):
    """calibrate -> quantize --scales writes the same bytes as quantize --data (one pipeline)."""
    model = concat_model()
    support.save(model, tmp_path / "model.onnx")
    np.savez(tmp_path / "calib.npz", **random_inputs(model, num=4, seed=9))
    for args in (["calibrate", "model.onnx", "-o", "s.json", "--data", "calib.npz"],
                 ["quantize", "model.onnx", "-o", "a.onnx", "--scales", "s.json"],
                 ["quantize", "model.onnx", "-o", "b.onnx", "--data", "calib.npz"]):
        proc = support.run_cli(*args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    assert support.sha256(tmp_path / "a.onnx") == support.sha256(tmp_path / "b.onnx")
