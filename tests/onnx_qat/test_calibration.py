"""calibrate(): the onnxruntime runner end to end on tiny models."""
from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat.calibration import calibrate
from onnx_qat.errors import ConfigError, DataError, ModelError, OutputError
from onnx_qat.formats.scale_grid import on_fp16_grid
from onnx_qat.placement import place
from onnx_qat.scales import ScaleTable
from tests import builders


def _conv_model() -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv ``conv`` (16 ch) -> Relu -> GlobalAveragePool -> Flatten -> Gemm ``fc`` -> y."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((10, 16)).astype(np.float32), "fc_w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc_w"], ["y"], name="fc", transB=1)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])
    graph = helper.make_graph(nodes, "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _data(n=12, seed=1):
    return {"x": np.random.default_rng(seed).standard_normal((n, 3, 8, 8)).astype(np.float32)}


def test_default_tensors_are_placement_activations():
    model = _conv_model()
    table = calibrate(model, _data(), progress=False)
    assert tuple(sorted(table.activations)) == place(model).activation_tensors()
    assert table.producer == "onnx_qat.calibrate(method=auto)"  # the default
    assert table.metadata["calibration_samples"] == "12"


@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_max_matches_onnxruntime_reference(batch_size):
    model = _conv_model()
    data = _data()
    names = ("x", "c", "r", "f")
    table = calibrate(model, data, tensors=names, batch_size=batch_size, method="max", progress=False)
    reference = builders.amax_table(model, data, tensors=names)
    for name in names:
        # the max, raised so that its scale amax / 127 is an FP16 value (onnx_qat.formats.scale_grid)
        assert table.activations[name] == pytest.approx(on_fp16_grid(reference.activations[name], 127.0),
                                                        rel=1e-6), name
        assert table.activations[name] >= reference.activations[name]


@pytest.mark.parametrize("method", ["percentile", "entropy", "mse"])
def test_histogram_methods_bounded_by_max_and_independent_of_batch(method):
    model = _conv_model()
    data = _data(24)
    maxes = calibrate(model, data, tensors=("c", "f"), method="max", progress=False)
    runs = [calibrate(model, data, method=method, tensors=("c", "f"), batch_size=b, progress=False)
            for b in (3, 24)]
    for name in ("c", "f"):
        values = [t.activations[name] for t in runs]
        assert all(0 < v <= maxes.activations[name] * (1 + 1e-6) for v in values)
        assert max(values) / min(values) < 1.1, (name, values)
    assert runs[0].producer.startswith(f"onnx_qat.calibrate(method={method}")


def test_percentile_matches_numpy_on_activations():
    model = _conv_model()
    data = _data(32)
    table = calibrate(model, data, method="percentile", percentile=99.0, tensors=("c",), batch_size=4,
                      progress=False)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.ValueInfoProto(name="c"))
    c = builders.run(probe, data)[1]
    expected = float(np.percentile(np.abs(c), 99.0))
    assert table.activations["c"] == pytest.approx(expected, abs=3 * float(np.abs(c).max()) / 2048)


def test_output_written_atomically_and_model_untouched(tmp_path):
    model = _conv_model()
    before = model.SerializeToString()
    out = tmp_path / "scales.json"
    table = calibrate(model, _data(), method="entropy", output=out, progress=False)
    assert model.SerializeToString() == before
    assert ScaleTable.load(out) == table
    assert json.loads(out.read_text())["producer"] == "onnx_qat.calibrate(method=entropy)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scales.json"]


def test_output_path_checked_before_work(tmp_path):
    model_path = tmp_path / "m.onnx"
    model_path.write_bytes(_conv_model().SerializeToString())
    with pytest.raises(OutputError):
        calibrate(model_path, _data(), output=model_path, progress=False)
    with pytest.raises(OutputError):
        calibrate(model_path, _data(), output=tmp_path / "missing" / "s.json", progress=False)


def test_progress_bar_on_stderr_and_silenced(capsys):
    calibrate(_conv_model(), _data(), batch_size=4, method="max", progress=True)
    captured = capsys.readouterr()
    assert "calibrate (max)" in captured.err and captured.out == ""
    calibrate(_conv_model(), _data(), batch_size=4, method="max", progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("method", ["max", "entropy"])
def test_transformer_with_attention_calibrates_finite(method):
    model = builders.transformer_block_model(mask="-inf")
    data = builders.random_inputs(model, num=3)
    table = calibrate(model, data, method=method, include_attention=True, progress=False)
    assert len(table.activations) >= 4
    assert all(np.isfinite(v) and 0 < v < 1e3 for v in table.activations.values())


def _output_of(model, node_name: str) -> str:
    return next(n.output[0] for n in model.graph.node if n.name == node_name)


@pytest.mark.parametrize("mask", ["-1e9", "-inf"])
@pytest.mark.parametrize("method", ["max", "percentile", "entropy", "mse"])
def test_mask_tensor_observed_is_guarded(mask, method, caplog):
    model = builders.transformer_block_model(mask=mask)
    masked = _output_of(model, "mask_add")
    data = builders.random_inputs(model, num=2)
    with caplog.at_level(logging.WARNING, logger="onnx_qat.calibration.runner"):
        table = calibrate(model, data, method=method, tensors=(masked,), progress=False)
    assert 0 < table.activations[masked] < 1e3
    assert any(repr(masked) in r.getMessage() and "NaN, Inf" in r.getMessage() for r in caplog.records)


def test_all_zero_activation_gets_positive_amax(caplog):
    model = _conv_model()
    data = {"x": np.zeros((4, 3, 8, 8), np.float32)}
    with caplog.at_level(logging.WARNING):
        table = calibrate(model, data, tensors=("c", "r"), method="max", progress=False)
    assert table.activations["c"] > 0 and table.activations["r"] > 0
    assert any("'c'" in r.getMessage() for r in caplog.records)


def test_bad_options_and_names():
    model = _conv_model()
    with pytest.raises(ConfigError, match="unknown calibration method"):
        calibrate(model, _data(), method="minmax", progress=False)
    with pytest.raises(ConfigError, match="percentile"):
        calibrate(model, _data(), method="percentile", percentile=0, progress=False)
    with pytest.raises(ConfigError, match="num_bins"):
        calibrate(model, _data(), method="entropy", num_bins=1000, progress=False)
    with pytest.raises(ModelError, match="'nope'"):
        calibrate(model, _data(), tensors=("nope",), progress=False)
    with pytest.raises(DataError, match="'other' is not a model input"):
        calibrate(model, {"x": np.ones((2, 3, 8, 8), np.float32), "other": np.ones(2)}, progress=False)
    with pytest.raises(DataError, match="NaN"):
        calibrate(model, {"x": np.full((2, 3, 8, 8), np.nan, np.float32)}, progress=False)


def test_opset9_model_with_initializer_inputs_calibrates():
    model = builders.opset9_model()
    data = builders.random_inputs(model, num=4)
    table = calibrate(model, data, method="mse", progress=False)
    assert len(table.activations) >= 1
    assert all(np.isfinite(v) and v > 0 for v in table.activations.values())


def test_same_inputs_give_identical_tables():
    model, data = _conv_model(), _data(16)
    first = calibrate(model, data, method="entropy", batch_size=5, progress=False)
    second = calibrate(model, data, method="entropy", batch_size=5, progress=False)
    assert first.to_dict() == second.to_dict()


_INTERRUPT_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from onnx import TensorProto, helper, numpy_helper
from onnx_qat.calibration import calibrate
rng = np.random.default_rng(0)
inits, nodes, x = [], [], "x"
for i in range(6):
    inits.append(numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32) / 16, f"w{{i}}"))
    nodes.append(helper.make_node("MatMul", [x, f"w{{i}}"], [f"h{{i}}"], name=f"mm{{i}}"))
    x = f"h{{i}}"
graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 256])], inits)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
model.ir_version = 8
data = {{"x": rng.standard_normal((20000, 256)).astype(np.float32)}}
calibrate(model, data, method="entropy", batch_size=1, output={out!r}, progress=True)
"""


def test_interrupted_calibration_leaves_no_output(tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    out = tmp_path / "scales.json"
    script = _INTERRUPT_SCRIPT.format(root=str(Path(__file__).resolve().parents[2]), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while proc.stderr.read(1) == b"" and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "calibration ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert list(tmp_path.iterdir()) == []


def test_int64_and_bool_inputs_feed_calibration():
    nodes = [helper.make_node("Cast", ["mask"], ["mask_f"], to=TensorProto.FLOAT),
             helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
             helper.make_node("Unsqueeze", ["mask_f", "axes"], ["mask_e"]),
             helper.make_node("Mul", ["emb", "mask_e"], ["y"], name="apply_mask")]
    table = np.arange(40, dtype=np.float32).reshape(10, 4) - 20
    graph = helper.make_graph(nodes, "g", [
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 3]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 4])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array([2], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    ids = np.array([[0, 1, 2], [9, 9, 9]], np.int64)
    mask = np.array([[True, True, False], [True, False, False]])
    table_out = calibrate(model, {"ids": ids, "mask": mask}, tensors=("emb", "y"), method="max",
                          progress=False)
    assert table_out.activations["emb"] == on_fp16_grid(20.0, 127.0)  # row 0 holds -20
    assert table_out.activations["y"] == pytest.approx(
        on_fp16_grid(float(np.abs(table[ids] * mask[..., None]).max()), 127.0))


@pytest.mark.parametrize("method", ["max", "entropy"])
def test_npz_file_streamed_gives_the_table_of_the_arrays(tmp_path, method):
    data = _data(20, seed=4)
    path = tmp_path / "calib.npz"
    np.savez_compressed(path, **data)
    from_file = calibrate(_conv_model(), str(path), method=method, batch_size=6, progress=False)
    from_arrays = calibrate(_conv_model(), data, method=method, batch_size=6, progress=False)
    assert from_file.activations == from_arrays.activations
    assert from_file.metadata["calibration_samples"] == "20"


def test_nan_in_npz_refused_before_onnxruntime_runs(tmp_path):
    data = _data(10)
    data["x"][6, 1, 2, 3] = np.nan
    path = tmp_path / "calib.npz"
    np.savez(path, **data)
    with pytest.raises(DataError, match=r"'x' has 1 NaN value\(s\) in sample 6") as info:
        calibrate(_conv_model(), str(path), progress=False)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


# ----------------------------------------------------------------------------------- large graphs
def test_a_large_graph_is_observed_piece_by_piece_with_the_same_ranges(monkeypatch, tmp_path):
    """Above `CHUNKED_NODES` main-graph nodes calibration runs the float model piece by piece
    (onnxruntime's build of one session with thousands of extra outputs grows much faster than the
    graph): the same ranges bit for bit, and the same ``auto`` choice and Q/DQ model byte for byte."""
    import onnx_qat
    from onnx_qat.calibration import branches
    from onnx_qat.runtime.chunked import ChunkedSession
    from tools.bench.models import residual_net

    model, _ = residual_net(600, weight_std=0.04)
    data = {"input": np.random.default_rng(3).standard_normal((12, 16, 4, 4)).astype(np.float32)}
    tensors = place(model).activation_tensors()
    assert not isinstance(branches.make_runner(model, tensors), ChunkedSession)
    whole = {m: calibrate(model, data, method=m, batch_size=4, progress=False, workers=1)
             for m in ("max", "entropy")}
    onnx_qat.quantize(model, str(tmp_path / "whole.onnx"), data=data, method="auto", progress=False,
                      workers=1)
    monkeypatch.setattr(branches, "CHUNKED_NODES", 100)
    runner = branches.make_runner(model, tensors)
    assert isinstance(runner, ChunkedSession) and len(runner.pieces) == 1  # 600 nodes, pieces of 2,000
    monkeypatch.setattr("onnx_qat.runtime.chunked.CHUNK_NODES", 150)
    runner = branches.make_runner(model, tensors)
    assert len(runner.pieces) == 4 and runner.build_seconds == 0.0
    runner.run(tensors, {"input": data["input"][:4]})
    built = runner.build_seconds  # the pieces' sessions, built on the first run (timed apart from it
    runner.run(tensors, {"input": data["input"][4:8]})  # for the worker-count estimate)
    assert built > 0 and runner.build_seconds == built
    for method, table in whole.items():
        pieces = calibrate(model, data, method=method, batch_size=4, progress=False, workers=1)
        assert pieces.activations == table.activations, method
    onnx_qat.quantize(model, str(tmp_path / "pieces.onnx"), data=data, method="auto", progress=False,
                      workers=1)
    assert (tmp_path / "pieces.onnx").read_bytes() == (tmp_path / "whole.onnx").read_bytes()
