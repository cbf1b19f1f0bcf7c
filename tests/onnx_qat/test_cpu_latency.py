"""Latency-aware placement for ``ort-cpu`` (rule CPU3, :mod:`onnx_qat.placement.cpu_latency`).

The decisions are tested with latency profiles written here (given times, so nothing depends on this
machine's speed); one test measures for real and checks only what the profile holds, never a time."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.cli import main
from onnx_qat.errors import ConfigError, PlacementError
from onnx_qat.graph.index import GraphIndex
from onnx_qat.placement import cpu_latency as L
from tests import builders as B


def _net(seed: int = 0) -> onnx.ModelProto:
    """input [1,16,12,12] -> ``c1`` (3x3) -> ``r1`` -> ``dw`` (3x3 depthwise) -> ``r2`` -> ``c2`` (1x1)
    -> ``r3`` -> GlobalAveragePool -> Flatten -> ``fc`` (MatMul + ``fc_bias`` Add) -> output."""
    b = B.GraphBuilder("latency_net", seed)
    x = b.input("input", [1, 16, 12, 12])
    y = b.relu(b.conv(x, 16, 32, "c1"), "r1")
    y = b.relu(b.conv(y, 32, 32, "dw", group=32), "r2")
    y = b.relu(b.conv(y, 32, 32, "c2", k=1), "r3")
    y = b.node("Flatten", [b.node("GlobalAveragePool", [y], name="gap")], name="flat")
    y = b.linear(y, 32, 10, "fc")
    b.nodes[-1].output[0] = "output"
    b.output("output")
    return b.build()


def _data(seed: int = 1):
    return {"input": np.random.default_rng(seed).uniform(0, 4, (4, 16, 12, 12)).astype(np.float32)}


def _profile(model, path, slow=(), threads: int = 0, machine=None, factor: float = 2.0):
    """A profile file with every site kind of ``model``: the kinds of the nodes in ``slow`` take
    ``factor`` x longer in integer than in float, the others half as long."""
    index = GraphIndex(model)
    placement = onnx_qat.place(model, target="ort-cpu")
    sites = L.sites_of(index, placement, L.input_shapes(model, 1))
    entries = {}
    for site in sites:
        entries[site.kind] = ({"float_us": 100.0, "int_us": 100.0 * factor} if site.node in slow
                              else {"float_us": 100.0, "int_us": 50.0})
    path.write_text(json.dumps({"format": L.PROFILE_FORMAT, "version": L.PROFILE_VERSION,
                                "machine": machine or L.machine_key(threads), "sites": entries}))
    return {s.node for s in sites}


def test_sites_are_the_quantized_weighted_ops_with_their_shapes():
    model = _net()
    sites = L.sites_of(GraphIndex(model), onnx_qat.place(model, target="ort-cpu"), L.input_shapes(model, 1))
    assert [s.node for s in sites] == ["c1", "dw", "c2", "fc"]
    dw = next(s for s in sites if s.node == "dw")
    assert dw.spec["x"] == [1, 32, 12, 12] and dw.spec["w"] == [32, 1, 3, 3]
    assert dw.spec["attrs"]["group"] == 32
    assert L.input_shapes(model, 8)["input"] == (1, 16, 12, 12)  # a fixed batch stays as declared


def test_a_site_slower_in_integer_stays_float_with_both_times_in_the_report(tmp_path):
    model = _net()
    profile = tmp_path / "profile.json"
    _profile(model, profile, slow={"dw"})
    result = onnx_qat.quantize(model, data=_data(), method="max", target="ort-cpu", progress=False,
                               latency=str(profile))
    latency = result.latency
    assert latency["kinds_measured"] == 0  # every kind came from the profile
    by_node = {r["node"]: r for r in latency["sites"]}
    assert by_node["dw"]["decision"] == "float" and by_node["dw"]["gain"] == 0.5
    assert {n for n, r in by_node.items() if r["decision"] == "integer"} == {"c1", "c2", "fc"}
    whole = latency["whole_model"]
    assert whole["timed"] and whole["chosen"] in ("latency placement", "every site integer")
    assert whole["fp32_ms"] > 0 and whole["quantized_ms"] > 0
    # at least the options' 3 rounds; a model this small gets more within WHOLE_MODEL_SECONDS, up to 5x
    assert 3 < whole["rounds"] <= 3 * L.MAX_ROUNDS_FACTOR
    weights = {r["nodes"][0].split(":")[0] for r in result.inserted if r["kind"] == "weight"}
    if whole["chosen"] == "latency placement":
        assert latency["kept_float"] == ["dw"] and weights == {"c1", "c2", "fc"}
        skip = next(d for d in result.placement.decisions if d.node == "dw")
        assert skip.rule == "CPU3" and "integer 200 us vs float 100 us" in skip.reason
        assert any("kept float for speed" in n for n in result.to_report()["notes"])
    else:  # the whole model ran faster with dw integer too: that model is written, and said so
        assert latency["kept_float"] == [] and latency["kept_float_per_site"] == ["dw"]
        assert weights == {"c1", "dw", "c2", "fc"}
    B.assert_check_clean(result.model, target="ort-cpu")
    report = json.loads(json.dumps(result.to_report()))
    assert report["latency"]["rule"] == "CPU3" and report["latency"]["profile"] == str(profile)


def test_time_models_runs_its_rounds_then_more_while_time_allows():
    model = _net()
    feeds = {"input": _data()["input"][:1]}
    medians, rounds = L._interleaved({"a": model, "b": model}, feeds, 1, 2, 0.0)
    assert rounds == 2 and set(medians) == {"a", "b"} and all(v > 0 for v in medians.values())
    assert L._interleaved({"a": model}, feeds, 1, 2, 60.0)[1] == 2 * L.MAX_ROUNDS_FACTOR


def test_within_the_margin_a_site_stays_integer(tmp_path):
    model = _net()
    profile = tmp_path / "profile.json"
    _profile(model, profile, slow={"dw", "c2"}, factor=1.05)  # 5% slower: within noise (FLOAT_MARGIN 1.1)
    decision = L.decide(model, GraphIndex(model), onnx_qat.place(model, target="ort-cpu"), profile=profile)
    assert decision.kept_float == () and decision.measured_kinds == 0


def test_every_site_slower_is_refused_with_nothing_written(tmp_path):
    model = _net()
    profile = tmp_path / "profile.json"
    _profile(model, profile, slow={"c1", "dw", "c2", "fc"})
    out = tmp_path / "out.onnx"
    with pytest.raises(PlacementError, match="faster in float"):
        onnx_qat.quantize(model, out, data=_data(), method="max", target="ort-cpu", progress=False,
                          latency=str(profile))
    assert not out.exists()


def test_profile_of_another_machine_is_used_with_a_note(tmp_path):
    model = _net()
    profile = tmp_path / "profile.json"
    other = {"cpu": "Some Server CPU", "flags": ["avx2", "avx512_vnni", "avx512f"], "onnxruntime": "9.9",
             "threads": 16}
    _profile(model, profile, slow={"dw"}, machine=other)
    decision = L.decide(model, GraphIndex(model), onnx_qat.place(model, target="ort-cpu"), profile=profile)
    assert decision.kept_float == ("dw",)
    assert any("another machine" in n and "avx512_vnni" in n for n in decision.notes)


def test_measuring_fills_the_profile_once(tmp_path, monkeypatch):
    """Real measurement on this machine: the profile gets one entry per kind (4 here) with positive
    times and this machine's key; a second run measures nothing. No time is asserted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = _net()
    index, placement = GraphIndex(model), onnx_qat.place(model, target="ort-cpu")
    first = L.decide(model, index, placement)
    path = L.default_profile_path(0)
    assert first.profile_path == str(path)
    assert path.is_relative_to(tmp_path / "cache" / "onnx-qat" / "latency")
    saved = json.loads(path.read_text())
    assert saved["format"] == L.PROFILE_FORMAT and len(saved["sites"]) == first.measured_kinds == 4
    assert all(v["float_us"] > 0 and v["int_us"] > 0 for v in saved["sites"].values())
    assert saved["machine"] == L.machine_key(0)
    assert set(saved["machine"]["flags"]) <= set(L.KERNEL_FLAGS)
    second = L.decide(model, index, placement)
    assert second.measured_kinds == 0 and second.kept_float == first.kept_float


def test_machine_key_separates_threads_and_files(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = L.machine_key(4)
    assert key["threads"] == 4 and key["onnxruntime"] == __import__("onnxruntime").__version__
    assert L.default_profile_path(4) != L.default_profile_path(1)


@pytest.mark.parametrize("content,match", [("{", "not readable JSON"), ('{"format": "x"}', "not an"),
                                           (json.dumps({"format": L.PROFILE_FORMAT, "version": 1,
                                                        "sites": {"k": {"float_us": -1, "int_us": 2}}}),
                                            "positive")])
def test_a_bad_profile_is_a_config_error(tmp_path, content, match):
    profile = tmp_path / "bad.json"
    profile.write_text(content)
    with pytest.raises(ConfigError, match=match):
        L.LatencyProfile.load(profile, 0)


def test_latency_needs_the_ort_cpu_target_and_int8():
    model = _net()
    with pytest.raises(ConfigError, match="ort-cpu"):
        onnx_qat.quantize(model, data=_data(), target="tensorrt", progress=False, latency="measure")
    with pytest.raises(ConfigError, match="latency must be"):
        onnx_qat.quantize(model, data=_data(), target="ort-cpu", progress=False, latency=3)


def test_cli_latency_profile(tmp_path, capsys):
    model = _net()
    src, out, data, profile = (tmp_path / n for n in ("m.onnx", "q.onnx", "d.npz", "p.json"))
    onnx.save(model, str(src))
    np.savez(data, **_data())
    _profile(model, profile, slow={"dw"})
    code = main(["quantize", str(src), "-o", str(out), "--data", str(data), "--method", "max",
                 "--target", "ort-cpu", "--latency-profile", str(profile)])
    shown = capsys.readouterr().out
    assert code == 0 and out.exists()
    assert "latency placement (CPU3)" in shown and "whole model, batch 1" in shown
    assert "check (ort-cpu rules): PASSED" in shown
    assert main(["quantize", str(src), "-o", str(tmp_path / "x.onnx"), "--data", str(data),
                 "--latency-threads", "2"]) == 2
    assert not (tmp_path / "x.onnx").exists()
