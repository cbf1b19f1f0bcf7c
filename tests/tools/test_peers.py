"""tools/peers.py and tools/real_models.py's peer table: the parts that need no peer venv (the 'not
installed' path, a peer process failing or overrunning, result parsing, the tables) and onnxruntime's
``quantize_static`` adapter on a MobileNetV2-style model built here."""
import sys

import numpy as np
import onnx
import pytest

from tests.builders import mobilenet_v2_model, random_inputs, run
from tools import peers
from tools.peers import NOT_INSTALLED, PeerRun


def _cosine(a, b) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _fake_venv(root, name: str, installed: bool = True):
    """A peer venv whose python is this interpreter (so the peer's own package is missing)."""
    bin_dir = root / name / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").symlink_to(sys.executable)
    if installed:
        (root / name / ".installed").touch()


def test_missing_venv_is_not_installed(tmp_path):
    assert peers.venv_python("modelopt", tmp_path) is None
    _fake_venv(tmp_path, "quark", installed=False)  # a half-made venv (make peers stopped) counts as absent
    assert peers.venv_python("quark", tmp_path) is None
    assert peers.venv_python("ort", tmp_path) == __import__("pathlib").Path(sys.executable)
    onnx.save(mobilenet_v2_model(size=16, batch="N"), str(tmp_path / "m.onnx"))
    runs = peers.run_peers(tmp_path / "m.onnx", {"x": np.zeros((2, 3), np.float32)}, tmp_path / "w",
                           peers=("modelopt", "quark", "aimet"), peers_dir=tmp_path)
    assert [(r.peer, r.error) for r in runs] == [("modelopt", NOT_INSTALLED), ("quark", NOT_INSTALLED),
                                                 ("aimet", NOT_INSTALLED)]
    assert peers.cell(runs, "quark") == NOT_INSTALLED == "not installed (make peers)"
    assert peers.best(runs) is None


def test_failing_peer_gives_its_one_line_error(tmp_path):
    _fake_venv(tmp_path, "modelopt")
    model = tmp_path / "m.onnx"
    onnx.save(mobilenet_v2_model(size=16, batch="N"), str(model))
    np.savez(tmp_path / "c.npz", input=np.zeros((2, 3, 16, 16), np.float32))
    run_ = peers.run_subprocess("modelopt", "entropy", model, tmp_path / "c.npz", tmp_path / "q.onnx", 120,
                                tmp_path)
    assert run_.model is None and run_.seconds > 0
    assert run_.error == "failed: ModuleNotFoundError: No module named 'modelopt'"


def test_overrunning_peer_is_stopped(tmp_path):
    _fake_venv(tmp_path, "aimet")
    np.savez(tmp_path / "c.npz", input=np.zeros((2, 3), np.float32))
    run_ = peers.run_subprocess("aimet", "default", tmp_path / "m.onnx", tmp_path / "c.npz",
                                tmp_path / "q.onnx", 0.05, tmp_path)
    assert run_.error == "stopped after 0.05 s" and run_.model is None
    assert 0.05 <= run_.seconds < 10


def test_one_line_and_parse_result():
    trace = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in <module>\n    f()\n"
             "ValueError: shapes (3,) and (4,) not aligned\nWARNING: something after it\n")
    assert peers.one_line(trace) == "ValueError: shapes (3,) and (4,) not aligned"
    assert peers.one_line("x" * 300, limit=20) == "x" * 17 + "..."
    assert peers.one_line("") == "no output"
    out = 'progress 10%\nPEER_RESULT {"seconds": 1.5}\nPEER_RESULT {"seconds": 2.5, "version": "0.47"}\n'
    assert peers.parse_result(out) == {"seconds": 2.5, "version": "0.47"}
    assert peers.parse_result("PEER_RESULT {not json") is None


def test_cell_and_best():
    runs = [PeerRun("ort", "minmax", 2.0, "a", cosine_calib=0.97, cosine_unseen=0.95),
            PeerRun("ort", "entropy", 3.0, "b", cosine_calib=0.99, cosine_unseen=0.93),
            PeerRun("ort", "percentile", 1.0, error="failed: ValueError: x"),
            PeerRun("quark", "adaround", 300.0, error="stopped after 300 s")]
    assert peers.cell(runs, "ort") == ("minmax 0.9500 (2 s); entropy **0.9300** (3 s); "
                                       "percentile: failed: ValueError: x")
    assert peers.cell(runs, "quark") == "adaround: stopped after 300 s"
    assert peers.cell(runs, "aimet") == "not measured"
    assert peers.best(runs).recipe == "minmax" and peers.best(runs, "cosine_calib").recipe == "entropy"
    assert peers.from_dicts([r.to_dict() for r in runs]) == runs


def _row(model: str, optimize: float, peer_runs) -> dict:
    return {"model": model, "unseen_samples": 8, "auto": {"cosine_unseen": 0.9601},
            "mixed": {"cosine": 0.9902, "int8": (40, 51)}, "optimize": {"cosine": optimize, "int8": (51, 51)},
            "peers": [r.to_dict() for r in peer_runs]}


def test_peers_table_names_the_best_peer_and_the_margin():
    from tools.real_models import peers_table

    runs = [PeerRun("ort", "minmax", 2.0, "a", cosine_calib=0.97, cosine_unseen=0.95),
            PeerRun("modelopt", "entropy", 9.0, error=NOT_INSTALLED),
            PeerRun("quark", "cle", 4.0, "c", cosine_calib=0.98, cosine_unseen=0.991)]
    text = peers_table([_row("ocr-rec", 0.9871, runs), _row("magika", 0.9999, runs[:2]),
                        {"model": "ocr-det", "skipped": "cannot download"}])
    lines = text.splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 12
    assert lines[2].startswith("| ocr-rec | 8 | 0.9601 | 0.9902 (40/51) | 0.9871 (51/51) | "
                               "minmax **0.9500** (2 s) | not installed (make peers) | "
                               "cle **0.9910** (4 s) | not measured |")
    assert lines[2].endswith("| 0.9910 (Quark 0.13 cle) | -0.0039 |")
    assert lines[3].endswith("| 0.9500 (onnxruntime quantize_static minmax) | +0.0499 |")
    assert lines[4].startswith("| ocr-det | skipped: cannot download |")
    no_peer = {k: v for k, v in _row("ocr-cls", 0.999, []).items() if k != "peers"}
    assert "not measured (--no-peer)" in peers_table([no_peer])


def test_prepare_makes_constant_weights_initializers(tmp_path):
    """The recognizer holds its weights in Constant nodes; the peers get initializers, same function."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    ones = numpy_helper.from_array(np.ones(2, np.float32))
    nodes = [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(weight, "w")),
             helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Constant", [], ["out2"], value=ones)]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])
    graph = helper.make_graph(nodes, "g", [x_info],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("out2", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    prepared = peers.prepare(tmp_path / "m.onnx", tmp_path / "p.onnx")
    assert prepared == tmp_path / "p.onnx"
    proto = onnx.load(str(prepared))
    assert [n.op_type for n in proto.graph.node] == ["Conv", "Constant"]  # a graph output stays a node
    assert [i.name for i in proto.graph.initializer] == ["w"]
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", 13)]
    x = {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32)}
    np.testing.assert_array_equal(run(model, x)[0], run(proto, x)[0])
    assert onnx.load(str(tmp_path / "m.onnx")).graph.node[0].op_type == "Constant"  # input untouched
    assert peers.prepare(prepared, tmp_path / "again.onnx") == prepared  # nothing to do: the model itself


def test_render_merges_runs_of_single_models(tmp_path):
    import json

    from tools.real_models import rendered

    (tmp_path / "a.json").write_text(json.dumps([{"model": "magika", "v": 1}, {"model": "ocr-rec", "v": 1}]))
    (tmp_path / "b.json").write_text(json.dumps([{"model": "ocr-rec", "v": 2}, {"model": "ocr-det", "v": 2}]))
    rows = rendered([tmp_path / "a.json", tmp_path / "b.json"])
    assert [(r["model"], r["v"]) for r in rows] == [("ocr-det", 2), ("ocr-rec", 2), ("magika", 1)]
    # a --peers-only row replaces only the peers of a full row
    (tmp_path / "c.json").write_text(json.dumps([{"model": "magika", "auto": {}, "v": 3, "peers": [1]}]))
    (tmp_path / "d.json").write_text(json.dumps([{"model": "magika", "peers": [2]}]))
    assert rendered([tmp_path / "c.json", tmp_path / "d.json"]) == [
        {"model": "magika", "auto": {}, "v": 3, "peers": [2]}]


@pytest.mark.parametrize("recipe", ["minmax", "entropy", "percentile", "entropy-all-ops"])
def test_ort_quantize_static_adapter(tmp_path, recipe):
    """onnxruntime's quantize_static through the adapter on a MobileNetV2-style model: per-channel symmetric
    int8 weights, symmetric int8 activations, and (but for entropy-all-ops) only weighted ops' inputs."""
    model = mobilenet_v2_model(size=32, batch="N", seed=3)
    path = tmp_path / "mnv2.onnx"
    onnx.save(model, str(path))
    calib, test = random_inputs(model, 16, seed=1), random_inputs(model, 8, seed=2)
    result = peers.ort_quantize(path, calib, tmp_path / "q.onnx", recipe)
    assert result.error == "" and result.model == str(tmp_path / "q.onnx") and result.seconds > 0
    quantized = onnx.load(result.model)
    cosine = _cosine(run(model, test)[0], run(quantized, test)[0])
    assert 0.995 <= cosine < 0.9995, cosine  # measured 0.9975-0.9981 with onnxruntime 1.31
    # onnxruntime 1.31 (constraints.txt) quantizes the inputs and outputs of the Convs it is given, and 3
    # more tensors (residual Adds' inputs and output) with its default op types
    quantizers = sum(n.op_type == "QuantizeLinear" for n in quantized.graph.node)
    assert quantizers == (102 if recipe == "entropy-all-ops" else 99)
    zero_points = [i for i in quantized.graph.initializer if "zero_point" in i.name]
    values = [onnx.numpy_helper.to_array(z) for z in zero_points]  # (biases: int32, zero point 0)
    assert values and all(v.dtype in (np.int8, np.int32) and not v.any() for v in values)  # symmetric


def test_halves_by_kind_give_each_half_the_same_mix():
    """tools/real_models.py's evaluation halves: by kind (the default), each half takes the first or the
    second half of every kind of input (the orientation classifier's 8 photos, then 8 pages); in order,
    the first and the second half as built."""
    from tools.real_models import EVAL_KINDS, _halves, halves

    data = {"x": np.arange(16)}
    judged, unseen = halves("orientation", data)
    assert EVAL_KINDS["orientation"] == (8, 8)
    assert judged["x"].tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert unseen["x"].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    judged, unseen = halves("orientation", data, "order")
    assert judged["x"].tolist() == list(range(8)) and unseen["x"].tolist() == list(range(8, 16))
    judged, unseen = halves("ocr-cls", data)  # one kind: as built
    assert judged["x"].tolist() == list(range(8))
    judged, unseen = halves("ocr-det", {"x": np.arange(8)})
    assert judged["x"].tolist() == [0, 1, 4, 5] and unseen["x"].tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="add up"):
        _halves(data, (4, 4))


def test_rescored_peers_are_scored_from_their_stored_models(tmp_path):
    """``--rescore-peers``: the Q/DQ models an earlier run stored under peers/ are scored on the given
    inputs, never run again; a recipe without a stored model says so; the cell shows no time."""
    from tools.real_models import score_peers, stored_peers

    model = mobilenet_v2_model(size=16, batch="N")
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    (tmp_path / "peers").mkdir()
    onnx.save(model, str(tmp_path / "peers" / "m.ort-minmax.onnx"))  # a stored "Q/DQ" model: the float one
    feeds = random_inputs(model, num=2, seed=0)
    runs = score_peers(path, stored_peers(path, ("ort",)), feeds, feeds)
    assert [r.recipe for r in runs] == list(peers.PEERS["ort"][2])
    assert runs[0].cosine_unseen == pytest.approx(1.0) and runs[0].cosine_calib == pytest.approx(1.0)
    assert all(r.error == "no stored model" and r.cosine_unseen is None for r in runs[1:])
    assert peers.cell(runs, "ort").startswith("minmax **1.0000** (rescored); entropy: no stored model")
