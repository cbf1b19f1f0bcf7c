"""Data as feeds (onnx_qat.io.feeds) and stateful models (state fed back, onnx_qat.runtime.stateful).

A small recurrent cell stands in for a VAD or an RNN: ``h = tanh(x Wx + h_in Wh)``, ``prob =
sigmoid(gain * mean(h Wo))``, with a 0-d ``gain`` given once. Calibration, compare and sensitivity
must run its feeds in order with ``h`` fed back, whatever the source of the feeds.
"""
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_qat
from onnx_qat.errors import ConfigError, DataError
from onnx_qat.io.data import load_data
from onnx_qat.io.feeds import KEPT_FEEDS, FeedStream
from tests.builders import assert_check_clean, run

STATE = {"h": "h_in"}


def rnn_model(features=16, hidden=32, seed=0, batch="N") -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32),
                                     name)
             for name, shape in (("Wx", (features, hidden)), ("Wh", (hidden, hidden)), ("Wo", (hidden, 16)))]
    nodes = [helper.make_node("MatMul", ["x", "Wx"], ["a"], name="mm_x"),
             helper.make_node("MatMul", ["h_in", "Wh"], ["b"], name="mm_h"),
             helper.make_node("Add", ["a", "b"], ["s"], name="add"),
             helper.make_node("Tanh", ["s"], ["h"], name="tanh"),
             helper.make_node("MatMul", ["h", "Wo"], ["o"], name="mm_o"),
             helper.make_node("ReduceMean", ["o"], ["m"], name="mean", axes=[1], keepdims=1),
             helper.make_node("Mul", ["m", "gain"], ["g"], name="gain_mul"),
             helper.make_node("Sigmoid", ["g"], ["prob"], name="sigmoid")]
    graph = helper.make_graph(
        nodes, "rnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, features]),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [batch, hidden]),
         helper.make_tensor_value_info("gain", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, [batch, 1]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, [batch, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def stream(steps=24, seed=1, batch=1, features=16, hidden=32, scale=1.0):
    """Feeds of the cell: the first gives the initial state and the gain, later ones only ``x``."""
    rng = np.random.default_rng(seed)
    feeds = [{"x": (scale * rng.standard_normal((batch, features))).astype(np.float32)} for _ in range(steps)]
    feeds[0].update(h_in=np.zeros((batch, hidden), np.float32), gain=np.array(4.0, np.float32))
    return feeds


def unrolled(model, feeds):
    """The same feeds with every state and the gain given explicitly (a loop written by hand) and the
    probabilities per step."""
    h, gain, explicit, probs = feeds[0]["h_in"], feeds[0]["gain"], [], []
    for feed in feeds:
        full = {"x": feed["x"], "h_in": feed.get("h_in", h), "gain": gain}
        prob, h = run(model, full)
        explicit.append(full)
        probs.append(prob)
    return explicit, np.concatenate(probs)


def save_dir(path, feeds):
    path.mkdir()
    for i, feed in enumerate(feeds):
        np.savez(path / f"step_{i}.npz", **feed)
    return path


class Reader:
    """onnxruntime's CalibrationDataReader protocol: get_next() until None."""

    def __init__(self, feeds):
        self.feeds = iter(feeds)

    def get_next(self):
        return next(self.feeds, None)


# --------------------------------------------------------------------------- sources
@pytest.mark.parametrize("seed", [1, 7])
def test_every_source_of_feeds_calibrates_like_the_explicit_loop(tmp_path, seed):
    """max ranges are exact: a list, an iterator, a get_next() reader, a directory and a list of files,
    all with the state fed back, give the table of the hand-written loop (every state explicit)."""
    model, feeds = rnn_model(seed=seed), stream(seed=seed, scale=1 + seed / 4)
    explicit, _ = unrolled(model, feeds)
    want = onnx_qat.calibrate(model, explicit, method="max", progress=False).activations
    folder = save_dir(tmp_path / "feeds", feeds)
    files = sorted(folder.iterdir(), key=lambda p: int(p.stem.split("_")[1]))
    sources = {"list": feeds, "iterator": iter(feeds), "generator": (f for f in feeds),
               "reader": Reader(feeds), "directory": folder, "files": [str(p) for p in files]}
    for name, source in sources.items():
        got = onnx_qat.calibrate(model, source, method="max", state=STATE, progress=False)
        assert got.activations == want, name
        assert got.metadata["calibration_samples"] == str(len(feeds)), name
    # without the state fed back the ranges differ: the loop is what is calibrated
    first = {"h_in": feeds[0]["h_in"], "gain": feeds[0]["gain"]}
    alone = onnx_qat.calibrate(model, [{**f, **first} for f in feeds], method="max", progress=False)
    assert alone.activations != want


def test_directory_is_read_in_natural_order(tmp_path):
    model, feeds = rnn_model(), stream(steps=12)
    folder = save_dir(tmp_path / "feeds", feeds)
    data = load_data(folder, model, state=STATE)
    got = [f["x"] for f in data.batches()]
    # step_10 comes after step_9, not after step_1
    assert len(got) == 12 and all(np.array_equal(a, f["x"]) for a, f in zip(got, feeds))


def test_scalar_given_once_is_fed_every_time_and_samples_npz_takes_a_0d_scalar(tmp_path):
    model = rnn_model()
    feeds = [{"x": np.ones((2, 16), np.float32), "h_in": np.zeros((2, 32), np.float32),
              "gain": np.float32(2)},
             {"x": np.ones((2, 16), np.float32), "h_in": np.zeros((2, 32), np.float32)}]
    out = [f["gain"] for f in load_data(feeds, model).batches()]
    assert [float(g) for g in out] == [2.0, 2.0] and out[1].shape == ()
    np.savez(tmp_path / "calib.npz", x=np.ones((5, 16), np.float32), h_in=np.zeros((5, 32), np.float32),
             gain=np.float32(3))  # 0-d: given once, not a sample axis
    data = load_data(tmp_path / "calib.npz", model)
    batches = list(data.batches(2))
    assert data.num_samples == 5 and [b["x"].shape[0] for b in batches] == [2, 2, 1]
    assert all(b["gain"].shape == () and float(b["gain"]) == 3.0 for b in batches)


def test_declared_batch_axis_slices_that_axis(tmp_path):
    """silero-vad's state is [2, N, 128]: with batch_axis the samples are taken on axis 1."""
    x = np.arange(5 * 4, dtype=np.float32).reshape(5, 4)
    state = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
    nodes = [helper.make_node("Identity", ["x"], ["y"]), helper.make_node("Identity", ["s"], ["t"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                    helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, "N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]),
                               helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, "N", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    np.savez(tmp_path / "d.npz", x=x, s=state)
    with pytest.raises(DataError, match="different sample counts"):
        load_data(tmp_path / "d.npz", model)  # axis 0 of s is 2, not 5
    data = load_data(tmp_path / "d.npz", model, batch_axis={"s": 1})
    batches = list(data.batches(2))
    assert data.num_samples == 5 and [b["s"].shape for b in batches] == [(2, 2, 3), (2, 2, 3), (2, 1, 3)]
    np.testing.assert_array_equal(np.concatenate([b["s"] for b in batches], axis=1), state)
    out = onnx_qat.runtime.sessions.run_model(model, data, batch_size=2)
    np.testing.assert_array_equal(out["y"], x)


def test_an_iterator_keeps_only_its_first_feeds_and_says_when_read_again():
    model = rnn_model()
    feeds = [{"x": np.full((1, 16), i, np.float32), "h_in": np.zeros((1, 32), np.float32),
              "gain": np.float32(1)} for i in range(3 * KEPT_FEEDS)]
    data = load_data(iter(feeds), model)
    assert isinstance(data, FeedStream) and data.num_samples is None
    assert sum(1 for _ in data.batches()) == 3 * KEPT_FEEDS and data.num_samples == 3 * KEPT_FEEDS
    assert len(data._once.head) == KEPT_FEEDS  # memory bounded: the rest was not kept
    assert [float(f["x"][0, 0]) for f in data.take(5).batches()] == [0, 1, 2, 3, 4]
    with pytest.raises(DataError, match="read once"):
        list(data.batches())


def test_auto_calibration_runs_on_a_one_shot_stateful_iterator():
    model, feeds = rnn_model(), stream(steps=80)
    table = onnx_qat.calibrate(model, (f for f in feeds), state=STATE, progress=False)
    assert table.metadata["auto_table"] in ("max", "tensor", "entropy") and len(table.activations) >= 3
    result = onnx_qat.quantize(model, data=iter(feeds), state=STATE, progress=False)
    assert_check_clean(result.model)


# --------------------------------------------------------------------------- compare and sensitivity
def test_compare_reports_the_sequence_and_the_decisions(tmp_path):
    model, feeds = rnn_model(), stream(steps=40, seed=3)
    result = onnx_qat.quantize(model, data=stream(steps=40, seed=2), state=STATE, progress=False)
    comparison = onnx_qat.compare(model, result.model, feeds, state=STATE, min_decisions=0.9)
    prob, state = comparison.outputs
    assert prob.name == "prob" and prob.steps == 40 and prob.shape == (40, 1)
    _, ref = unrolled(model, feeds)
    _, got = unrolled(result.model, feeds)
    agree = float(np.mean((ref > 0.5) == (got > 0.5)))
    assert prob.decisions == pytest.approx(agree) and 0.0 < np.mean(ref > 0.5) < 1.0
    assert prob.cosine > 0.99 and prob.decisions >= 0.9 and comparison.passed
    assert state.state and state.decisions is None and state.min_cosine is None and "not judged" in str(state)
    assert "decisions" in str(prob) and "40 steps" in str(prob)
    if agree < 1.0:  # the threshold can fail
        strict = onnx_qat.compare(model, result.model, feeds, state=STATE, min_decisions=1.0)
        assert not strict and "decisions agree on" in strict.outputs[0].reason


def test_sensitivity_holds_out_the_last_feeds_and_starts_them_from_the_initial_state():
    model, feeds = rnn_model(), stream(steps=20)
    result = onnx_qat.sensitivity(model, feeds, state=STATE, progress=False)
    assert result.num_eval_samples == 5 and len(result.sites) >= 3
    assert all(np.isfinite(s.only.cosine) for s in result.sites)


# --------------------------------------------------------------------------- bad input
def test_bad_feeds_are_one_line_errors():
    model = rnn_model()
    feeds = stream(steps=6)
    with pytest.raises(DataError, match="the iterator yielded nothing"):
        load_data(iter([]), model, state=STATE)
    with pytest.raises(DataError, match=r"get_next\(\) returned None at once"):
        load_data(Reader([]), model, state=STATE)
    missing = [dict(f) for f in feeds]
    del missing[3]["x"]
    with pytest.raises(DataError, match="feed 3: model input 'x' is missing"):
        load_data(missing, model, state=STATE)
    first = [dict(f) for f in feeds]
    del first[0]["h_in"]
    with pytest.raises(DataError, match=r"state input 'h_in' is missing: the first feed gives the initial "
                                        r"state \(e.g. zeros of shape \[1, 32\]\)"):
        load_data(first, model, state=STATE)
    with pytest.raises(DataError, match=r"feed 1: model input 'h_in' is missing \(keys: x\) \(only scalar "
                                        r"and fixed-shape inputs may be given once\)"):
        load_data(feeds, model)  # not stateful: h_in in every feed
    with pytest.raises(ConfigError, match="'hidden' is not an output of the model"):
        load_data(feeds, model, state={"hidden": "h_in"})
    with pytest.raises(ConfigError, match="'h_out' is not an input of the model"):
        load_data(feeds, model, state={"h": "h_out"})
    wide = [dict(f) for f in feeds]
    wide[2]["x"] = np.zeros((1, 17), np.float32)
    with pytest.raises(DataError, match=r"feed 2: key 'x' has shape \[1, 17\], the model input 'x' "
                                        r"needs \[N,16\]"):
        load_data(wide, model, state=STATE)
    batch = [dict(f) for f in feeds]
    batch[4]["x"] = np.zeros((2, 16), np.float32)
    with pytest.raises(DataError, match="feed 4: key 'x' has 2 on its batch axis 0, feed 0 had 1"):
        load_data(batch, model, state=STATE)
    for error in (DataError, ConfigError):
        assert issubclass(error, onnx_qat.QatError)


def _cli(*args, cwd=None):
    done = subprocess.run([sys.executable, "-m", "onnx_qat", "--no-progress", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    return done.returncode, done.stdout, done.stderr


def test_cli_quantizes_a_directory_of_feeds_with_the_state_fed_back(tmp_path):
    model = rnn_model()
    onnx.save(model, tmp_path / "rnn.onnx")
    folder = save_dir(tmp_path / "feeds", stream(steps=30))
    evaluation = save_dir(tmp_path / "eval", stream(steps=30, seed=5))
    out = tmp_path / "q.onnx"
    code, stdout, stderr = _cli("quantize", tmp_path / "rnn.onnx", "--data", folder, "--state", "h=h_in",
                                "-o", out)
    assert code == 0, stderr
    assert "0 errors, 0 warnings" in stdout and out.exists()
    code, stdout, stderr = _cli("compare", tmp_path / "rnn.onnx", out, "--data", evaluation,
                                "--state", "h=h_in", "--min-decisions", "0.9")
    assert code == 0, stdout + stderr
    assert "30 steps" in stdout and "decisions" in stdout and "not judged" in stdout
    files = sorted(folder.iterdir(), key=lambda p: int(p.stem.split("_")[1]))
    code, stdout, stderr = _cli("calibrate", tmp_path / "rnn.onnx", "--data", *files, "--state", "h=h_in",
                                "--method", "max", "-o", tmp_path / "s.json")
    assert code == 0, stderr
    want = onnx_qat.calibrate(model, folder, state=STATE, method="max", progress=False)
    assert onnx_qat.ScaleTable.load(tmp_path / "s.json").activations == want.activations
    code, stdout, stderr = _cli("sensitivity", tmp_path / "rnn.onnx", "--data", folder,
                                "--eval-data", evaluation, "--state", "h=h_in", "-o", tmp_path / "sens.json")
    assert code == 0, stderr
    assert "mm_h" in stdout and (tmp_path / "sens.json").exists()


@pytest.mark.parametrize("case, args, message", [
    ("missing input", ("--state", "h=h_in"), "step_3.npz: model input 'x' is missing (keys: gain)"),
    ("not an output", ("--state", "hidden=h_in"),
     "state hidden=h_in: 'hidden' is not an output of the model"),
    ("not an input", ("--state", "h=h_out"), "state h=h_out: 'h_out' is not an input of the model"),
    ("shape change", ("--state", "h=h_in"),
     "step_2.npz: key 'x' has shape [1, 8], the model input 'x' needs [N,16]"),
    ("batch change", ("--state", "h=h_in"), "step_4.npz: key 'x' has 3 on its batch axis 0, feed 0 had 1"),
    ("no feeds", ("--state", "h=h_in"), "holds no .npz files"),
    ("bad pair", ("--state", "h"), "expected OUTPUT=INPUT"),
])
def test_cli_bad_input_is_one_line_exit_2_nothing_written(tmp_path, case, args, message):
    onnx.save(rnn_model(), tmp_path / "rnn.onnx")
    feeds = stream(steps=6)
    if case == "missing input":
        feeds[3] = {"gain": np.array(2.0, np.float32)}  # a new gain, but no x
    elif case == "shape change":
        feeds[2]["x"] = np.zeros((1, 8), np.float32)
    elif case == "batch change":
        feeds[4]["x"] = np.zeros((3, 16), np.float32)
    folder = save_dir(tmp_path / "feeds", [] if case == "no feeds" else feeds)
    out = tmp_path / "q.onnx"
    for command in ("quantize", "calibrate"):
        code, stdout, stderr = _cli(command, tmp_path / "rnn.onnx", "-o", out, "--data", folder, *args)
        assert code == 2, (case, stdout, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("onnx-qat: error: ") and message in lines[0], lines
        assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["feeds", "rnn.onnx"]


def test_min_cosine_searches_a_stateful_model_on_its_held_out_feeds():
    model = rnn_model()
    result = onnx_qat.quantize(model, data=stream(steps=40), state=STATE, min_cosine=0.999, progress=False)
    info = result.accuracy
    assert info["eval_samples"] == 10 and info["cosine_after"] >= 0.999
    assert_check_clean(result.model)
    with pytest.raises(ConfigError, match="does not run stateful models"):
        onnx_qat.quantize(model, data=stream(steps=8), state=STATE, precision="int4", progress=False)


def test_cli_data_before_the_model_says_why_the_model_is_missing(tmp_path, capsys):
    from onnx_qat.cli import main

    onnx.save(rnn_model(), tmp_path / "rnn.onnx")
    folder = save_dir(tmp_path / "feeds", stream(steps=3))
    model, out = str(tmp_path / "rnn.onnx"), str(tmp_path / "s.json")
    assert main(["calibrate", "--data", str(folder), model, "-o", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "required: MODEL" in err[0] and "give the model(s) before them" in err[0]
    assert main(["calibrate", model, "--data", str(folder), model, "-o", out]) == 2
    assert "is an ONNX model, not data" in capsys.readouterr().err
    assert not (tmp_path / "s.json").exists()


def test_an_onnxruntime_calibration_data_reader_is_a_source_of_feeds():
    """onnxruntime's own CalibrationDataReader (get_next() until None) feeds calibrate as it is."""
    from onnxruntime.quantization import CalibrationDataReader

    class Steps(CalibrationDataReader):
        def __init__(self, feeds):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)

    model, feeds = rnn_model(), stream(steps=16, seed=4)
    want = onnx_qat.calibrate(model, feeds, method="max", state=STATE, progress=False).activations
    got = onnx_qat.calibrate(model, Steps(feeds), method="max", state=STATE, progress=False)
    assert got.activations == want and got.metadata["calibration_samples"] == "16"


def test_fp16_float_parts_measure_on_the_first_feeds_of_a_stream(tmp_path):
    """A stream is measured on its first feeds, in order (spread over it would break the state)."""
    from onnx_qat.formats.float_parts import cast_float_parts

    model, feeds = rnn_model(seed=3), stream(seed=3)
    explicit, _ = unrolled(model, feeds)  # every input in every feed
    folder = save_dir(tmp_path / "feeds", explicit)
    result = cast_float_parts(model, "fp16", data=folder)
    assert result.measurement["samples"] == min(4, len(feeds))
    out = result.measurement["outputs"]
    assert out and all(v["cosine"] >= v["cosine_fp32"] - 0.002 for v in out.values())
