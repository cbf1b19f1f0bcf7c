"""The fast evaluation path of the accuracy tools (cuts, onnx_qat.accuracy.cuts) against a
straightforward one: the gated model run whole in a plain onnxruntime session for every setting."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnx_qat
from onnx_qat.accuracy import cuts, sites_of
from onnx_qat.accuracy.gated import GATE_PREFIX, GatedRunner, gate_model
from onnx_qat.accuracy.prepared import output_error
from onnx_qat.graph.index import assign_node_names
from tests.builders import concat_model, outlier_channel_model, residual_block_model


def _with_early_output(model: onnx.ModelProto, tensor: str) -> onnx.ModelProto:
    """``model`` that also outputs an intermediate tensor (made before most cuts)."""
    value = onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, ["N", 16, 8, 8])
    model.graph.output.append(value)
    return model


def _gated(model, feeds):
    assign_node_names(model)
    sites = sites_of(onnx_qat.place(model))
    table = onnx_qat.calibrate(model, feeds, progress=False)
    qdq = onnx_qat.quantize(model, scales=table, progress=False).model
    return gate_model(qdq, model, sites), len(sites)


def _plain(gated, n, feeds, outputs, on):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(gated.SerializeToString(), options, providers=["CPUExecutionProvider"])
    gates = {f"{GATE_PREFIX}{k}": np.array(k in on) for k in range(n)}
    parts = [session.run(outputs, {**feed, **gates}) for feed in feeds]
    return {name: np.concatenate([p[i].ravel() for p in parts]) for i, name in enumerate(outputs)}


@pytest.mark.parametrize("build,seed,scale", [
    (lambda: outlier_channel_model("conv5", convs=12, seed=1), 1, 1.0),
    (lambda: _with_early_output(outlier_channel_model("conv3", convs=8, seed=2), "relu2_out"), 2, 255.0),
    (lambda: residual_block_model(projection=True, seed=3), 3, 1.0),
    (lambda: concat_model(seed=4), 4, 255.0),
])
def test_runs_from_cuts_equal_whole_graph_runs(build, seed, scale):
    model = build()
    rng = np.random.default_rng(seed)
    dims = [d.dim_value or 3 for d in model.graph.input[0].type.tensor_type.shape.dim]  # fixed or 3
    feeds = [{model.graph.input[0].name: (rng.standard_normal(dims) * scale).astype(np.float32)}
             for _ in range(2)]
    gated, n = _gated(model, feeds[0])
    outputs = [o.name for o in model.graph.output]
    plain_model = onnx.ModelProto()
    plain_model.CopyFrom(gated)
    runner = GatedRunner(gated, n, feeds, outputs)
    assert runner.cuts, "the fast path must cut somewhere on these models"
    settings = [(), tuple(range(n))] + [(k,) for k in range(n)] + \
        [tuple(i for i in range(n) if i != k) for k in range(n)] + \
        [tuple(np.flatnonzero(rng.random(n) < 0.5)) for _ in range(6)]
    for on in settings:
        fast, slow = runner.run(on), _plain(plain_model, n, feeds, outputs, set(on))
        for name in outputs:
            np.testing.assert_allclose(fast[name], slow[name], rtol=1e-5,
                                       atol=1e-5 * np.abs(slow[name]).max(), err_msg=f"setting {on}, {name}")
        a, b = output_error(slow, fast), output_error(slow, slow)
        assert a.cosine == pytest.approx(b.cosine, abs=1e-9)
    assert runner.suffix_runs > n  # most single-site settings started at a cut


@pytest.mark.parametrize("exhaustive,precision,factor", [(True, "int8", 300.0), (False, "int8", 300.0),
                                                         (False, "fp8", 1e6)])
def test_sensitivity_reports_the_same_with_and_without_cuts(exhaustive, precision, factor, monkeypatch):
    model = outlier_channel_model("conv9", convs=20, seed=5, factor=factor)
    rng = np.random.default_rng(5)
    data = {"input": rng.standard_normal((24, 16, 8, 8)).astype(np.float32)}
    fast = onnx_qat.sensitivity(model, data, exhaustive=exhaustive, precision=precision, progress=False)
    monkeypatch.setattr(cuts, "CUT_CACHE_BYTES", 0)
    slow = onnx_qat.sensitivity(model, data, exhaustive=exhaustive, precision=precision, progress=False)
    assert [s.name for s in fast.sites] == [s.name for s in slow.sites]
    assert fast.runs == slow.runs and fast.sites[0].name == "conv9"
    for f, s in zip(fast.sites, slow.sites):
        assert (f.only_group, f.all_but_group) == (s.only_group, s.all_but_group)
        for a, b in ((f.only, s.only), (f.all_but, s.all_but)):
            assert a.cosine == pytest.approx(b.cosine, abs=1e-7)
            assert a.sqnr_db == pytest.approx(b.sqnr_db, rel=1e-5)
            assert a.max_abs == pytest.approx(b.max_abs, rel=1e-4, abs=1e-6)
        assert f.tensors == s.tensors


def test_min_cosine_chooses_the_same_sites_with_and_without_cuts(monkeypatch):
    model = outlier_channel_model("conv6", convs=20, seed=6)
    rng = np.random.default_rng(6)
    data = {"input": rng.standard_normal((24, 16, 8, 8)).astype(np.float32)}
    fast = onnx_qat.quantize(model, data=data, min_cosine=0.995, progress=False).accuracy
    monkeypatch.setattr(cuts, "CUT_CACHE_BYTES", 0)
    slow = onnx_qat.quantize(model, data=data, min_cosine=0.995, progress=False).accuracy
    assert [s["name"] for s in fast["float_sites"]] == [s["name"] for s in slow["float_sites"]] == ["conv6"]
    assert fast["cosine_after"] == pytest.approx(slow["cosine_after"], abs=1e-9)
    assert fast["runs"] == slow["runs"]


def test_cuts_fit_the_memory_budget():
    model = outlier_channel_model("conv5", convs=16, seed=7)
    feeds = [{"input": np.random.default_rng(7).standard_normal((4, 16, 8, 8)).astype(np.float32)}]
    gated, n = _gated(model, feeds[0])
    plan = cuts.CutPlan(gated, [f"{GATE_PREFIX}{k}" for k in range(n)], ["output"])
    nbytes = {t: 4 * 16 * 8 * 8 * 4 for t in plan.candidate_tensors()}  # every tensor [4, 16, 8, 8] float
    every = plan.choose(nbytes, 1 << 40)
    assert every == plan.candidates
    total = 2 * sum(nbytes.values())
    sizes = []
    for budget in (total, total // 2, total // 4, total // 8, 1_000):
        chosen = plan.choose(nbytes, budget)
        kept = {t for c in chosen for t in plan.crossing(c)}
        assert 2 * sum(nbytes[t] for t in kept) <= budget
        assert set(chosen) <= set(every)
        sizes.append(len(chosen))
    assert sizes[0] == len(every) and sizes[-1] == 0 and any(0 < k < len(every) for k in sizes), sizes
    assert sizes == sorted(sizes, reverse=True)
