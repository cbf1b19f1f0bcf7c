"""onnx_qat.sensitivity: sites from placement, the gated session, ranking, report, chart and CLI."""
from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.accuracy import sites_of
from onnx_qat.accuracy.gated import GATE_PREFIX, GatedRunner, gate_model
from onnx_qat.cli import EXIT_OK, main
from onnx_qat.graph.index import assign_node_names
from tests.builders import (
    concat_model, cosine, outlier_channel_model, residual_block_model, run,
)


def _inputs(n: int, seed: int, scale: str, size: int = 8, channels: int = 16) -> dict:
    rng = np.random.default_rng(seed)
    if scale == "normal":
        x = rng.standard_normal((n, channels, size, size))
    else:  # image-like: uniform 0..255
        x = rng.uniform(0.0, 255.0, (n, channels, size, size))
    return {"input": x.astype(np.float32)}


@pytest.mark.parametrize("hot,seed,scale", [("conv2", 0, "normal"), ("conv3", 1, "uniform255"),
                                            ("conv4", 2, "normal")])
def test_the_layer_made_sensitive_ranks_first(hot, seed, scale):
    model = outlier_channel_model(hot, seed=seed)
    result = onnx_qat.sensitivity(model, _inputs(32, seed, scale), progress=False)
    assert result.sites[0].name == hot, result.table()
    first, rest = result.sites[0], result.sites[1:]
    assert first.only.cosine < 0.99 and first.all_but.cosine > 0.999, result.table()
    assert all(s.only.cosine > 0.999 for s in rest), result.table()
    assert [s.rank for s in result.sites] == list(range(1, len(result.sites) + 1))
    assert result.all_int8.cosine < 0.99
    # 6 sites: 4 Convs, the Gemm, the GlobalAveragePool input; one all-INT8 run + 2 per site
    assert {s.site.kind for s in result.sites} == {"weighted", "pooling"} and len(result) == 6
    assert result.runs == 2 * len(result) + 1
    assert result.num_eval_samples == 8  # a quarter of 32 held out


# conv17 with seed 2: with seed 3 the other 25 sites' joint INT8 noise moves by 0.0014 of cosine when the
# activation scales move by less than 2^-11 (the FP16 grid of calibrated ranges moved it from 0.99823 to
# 0.99685), too close to a single hot layer for the case to mean "one layer dominates"
@pytest.mark.parametrize("hot,seed", [("conv5", 0), ("conv17", 2)])
def test_group_bisection_finds_the_sensitive_layer_in_fewer_runs(hot, seed):
    model = outlier_channel_model(hot, convs=24, seed=seed)
    data = _inputs(16, seed, "normal")
    result = onnx_qat.sensitivity(model, data, progress=False)
    n = len(result)
    assert n == 26 and result.runs < 0.7 * (2 * n + 1), result.table()
    first = result.sites[0]
    assert first.name == hot and first.only_group == 1 and first.all_but_group == 1, result.table()
    full = onnx_qat.sensitivity(model, data, exhaustive=True, progress=False)
    assert full.runs == 2 * n + 1 and full.sites[0].name == hot
    assert first.only.cosine == pytest.approx(full.sites[0].only.cosine, abs=1e-9)
    exact = {s.name: s for s in full.sites}
    hot_loss = 1.0 - first.only.cosine
    for s in result.sites:  # the sites left in a group do not matter on their own
        if s.only_group > 1:
            assert 1.0 - exact[s.name].only.cosine < 0.05 * hot_loss, (s.name, full.table())


def test_the_gated_session_reproduces_the_quantized_and_the_float_model():
    model = residual_block_model(projection=True, seed=3)
    assign_node_names(model)
    feeds = _inputs(1, 0, "normal")
    placement = onnx_qat.place(model)
    sites = sites_of(placement)
    table = onnx_qat.calibrate(model, feeds, progress=False)
    qdq = onnx_qat.quantize(model, scales=table, progress=False).model
    gated = gate_model(qdq, model, sites)
    assert sum(i.name.startswith(GATE_PREFIX) for i in gated.graph.input) == len(sites)
    out = model.graph.output[0].name
    runner = GatedRunner(gated, len(sites), [feeds], [out])
    all_on, all_off = runner.run(range(len(sites)))[out], runner.run(())[out]
    np.testing.assert_allclose(all_on, run(qdq, feeds)[0].ravel(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(all_off, run(model, feeds)[0].ravel(), rtol=0, atol=1e-5)
    assert cosine(all_on, all_off) < 1.0  # quantization does change the output


def test_weights_held_in_constant_nodes():
    """Exporters such as paddle2onnx write weights as Constant nodes; the gates find them."""
    model = outlier_channel_model("conv2", seed=6)
    constants = [onnx.helper.make_node("Constant", [], [t.name], name=f"const_{t.name}", value=t)
                 for t in model.graph.initializer]
    nodes = constants + list(model.graph.node)
    del model.graph.initializer[:]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    result = onnx_qat.sensitivity(model, _inputs(16, 6, "normal"), progress=False)
    assert result.sites[0].name == "conv2" and len(result) == 6
    assert [t.kind for t in result.sites[0].tensors] == ["activation", "weight"]


def test_sites_cover_every_mark_once():
    model = concat_model(seed=1)
    placement = onnx_qat.place(model)
    sites = sites_of(placement)
    edges = [e for s in sites for e in s.edges]
    assert len(edges) == len(set(edges))
    marked = {c for m in placement.activations for c in m.consumers} | \
        {(w.node, w.input_index) for w in placement.weights}
    assert set(edges) == marked
    assert "concat" in {s.kind for s in sites}


def test_tensor_statistics_on_the_calibration_data_itself():
    model = outlier_channel_model("conv2")
    data = _inputs(16, 0, "normal")
    result = onnx_qat.sensitivity(model, data, eval_data=data, progress=False)
    site = next(s for s in result.sites if s.name == "conv2")
    acts = [t for t in site.tensors if t.kind == "activation"]
    weights = [t for t in site.tensors if t.kind == "weight"]
    assert [t.tensor for t in acts] == ["relu1_out"] and [t.tensor for t in weights] == ["conv2.weight"]
    assert acts[0].clipped == 0.0  # max calibration on the same data clips nothing
    assert acts[0].amax > 100  # the outlier channel sets the range
    assert 0 < acts[0].sqnr_db < 80 and math.isfinite(weights[0].sqnr_db)
    result_pct = onnx_qat.sensitivity(model, data, eval_data=data, method="percentile",
                                      calibration_options={"percentile": 99.0}, progress=False)
    clipped = next(t for s in result_pct.sites if s.name == "conv2"
                   for t in s.tensors if t.kind == "activation")
    assert 0.0 < clipped.clipped <= 0.02 and clipped.amax < acts[0].amax


def test_metric_choice_ranks_and_bad_metric_is_a_config_error():
    model = outlier_channel_model("conv3", seed=4)
    data = _inputs(16, 4, "normal")
    for metric in ("sqnr", "max_abs"):
        assert onnx_qat.sensitivity(model, data, metric=metric, progress=False).sites[0].name == "conv3"
    with pytest.raises(onnx_qat.ConfigError, match="metric"):
        onnx_qat.sensitivity(model, data, metric="psnr", progress=False)
    with pytest.raises(onnx_qat.DataError, match="eval_data"):
        onnx_qat.sensitivity(model, _inputs(1, 0, "normal"), progress=False)


def test_report_json_text_and_chart(tmp_path):
    model = outlier_channel_model("conv2")
    result = onnx_qat.sensitivity(model, _inputs(16, 0, "normal"), progress=False)
    path = tmp_path / "r.json"
    result.save(path)
    saved = json.loads(path.read_text())
    assert saved["format"] == "onnx-qat-sensitivity" and saved["sites"][0]["name"] == "conv2"
    assert saved["sites"][0]["only"]["cosine"] == pytest.approx(result.sites[0].only.cosine)
    text = str(result)
    lines = text.splitlines()  # the all-sites line, the note on the method, the heading, dashes, rows
    assert "ranges calibrated with max" in lines[0] and lines[1].startswith("note: quantize's default")
    assert lines[4].split()[:2] == ["1", "conv2"]
    png = tmp_path / "c.png"
    result.plot(png, top=3)
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
    assert width > 600 and height > 200


def test_the_table_shows_where_long_names_differ():
    """Exporters' hierarchical names share long prefixes (Magika's three sites all began
    'jax2tf_get_logits_/pjit_get_logits_/Magi', the 40 characters the table showed): the table keeps
    the end of a long name, after an ellipsis, so every row is told apart."""
    model = outlier_channel_model("conv2")
    prefix = "exported_model/pjit_forward/encoder_stack/"
    renamed = {n.name: prefix + n.name + "/Conv2D" for n in model.graph.node if n.op_type == "Conv"}
    for node in model.graph.node:
        node.name = renamed.get(node.name, node.name)
    result = onnx_qat.sensitivity(model, _inputs(16, 0, "normal"), progress=False)
    rows = [line.split()[1] for line in result.table().splitlines()[4:] if line[:4].strip().isdigit()]
    assert len(rows) == len(result.sites) and len(set(rows)) == len(rows), rows
    assert rows[0] == "\u2026" + (prefix + "conv2/Conv2D")[-39:]
    assert all(len(r) <= 40 for r in rows)


def test_cli_sensitivity_writes_report_and_chart(tmp_path, capsys):
    model = outlier_channel_model("conv3", seed=5)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **_inputs(16, 5, "uniform255"))
    code = main(["sensitivity", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "-o",
                 str(tmp_path / "r.json"), "--plot", str(tmp_path / "c.png"), "--top", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert out.splitlines()[4].split()[:2] == ["1", "conv3"]
    assert "... 4 more sites (--top shows more; the JSON report holds every site)" in out
    assert json.loads((tmp_path / "r.json").read_text())["sites"][0]["name"] == "conv3"
    assert (tmp_path / "c.png").stat().st_size > 5000
