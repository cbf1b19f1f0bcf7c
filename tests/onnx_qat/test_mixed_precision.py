"""quantize(min_cosine=...): the fewest float sites, check-clean results, the budget failure path,
and the default output unchanged."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.accuracy.sites import site_exclusions, sites_of, tensors_to_calibrate, with_partners
from onnx_qat.graph.index import GraphIndex
from onnx_qat.cli import EXIT_OK, EXIT_USAGE, main
from tests.builders import (
    assert_float_input, assert_weight_quantized, concat_model, conv_bn_relu_model, outlier_channel_model,
    random_inputs, residual_block_model,
)


def _inputs(n: int, seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {"input": (rng.standard_normal((n, 16, 8, 8)) * scale).astype(np.float32)}


@pytest.mark.parametrize("hot,seed", [("conv2", 0), ("conv3", 7)])
def test_leaves_exactly_the_sensitive_site_float(hot, seed):
    model = outlier_channel_model(hot, seed=seed, factor=1000.0)
    result = onnx_qat.quantize(model, data=_inputs(32, seed), min_cosine=0.99, progress=False)
    info = result.accuracy
    assert [s["name"] for s in info["float_sites"]] == [hot]
    assert info["cosine_before"] < 0.99 <= info["cosine_after"]
    assert info["cosine_estimate"] == pytest.approx(info["cosine_after"], abs=1e-4)
    assert (info["int8_weighted_ops"], info["weighted_ops"]) == (4, 5)
    assert_float_input(result.model, hot, 0)
    for other in {"conv1", "conv2", "conv3", "conv4"} - {hot}:
        assert_weight_quantized(result.model, other)
    report = onnx_qat.check(result.model)
    assert report.summary().startswith("PASSED") and not report.findings, report
    assert result.to_report()["mixed_precision"]["float_sites"][0]["name"] == hot


def test_many_sites_through_group_bisection_leave_exactly_the_sensitive_site_float():
    model = outlier_channel_model("conv13", convs=24, seed=2, factor=1000.0)
    result = onnx_qat.quantize(model, data=_inputs(24, 2), min_cosine=0.99, method="max", progress=False)
    info = result.accuracy
    assert [s["name"] for s in info["float_sites"]] == ["conv13"] and info["sites"] == 26
    assert info["runs"] < 26, info  # fewer runs than one per site
    assert info["cosine_after"] >= 0.99 > info["cosine_before"]
    assert onnx_qat.check(result.model).findings == ()


def test_given_eval_data_is_what_the_cosine_is_measured_on():
    model = outlier_channel_model("conv2", seed=1, factor=1000.0)
    result = onnx_qat.quantize(model, data=_inputs(8, 1), eval_data=_inputs(5, 2), min_cosine=0.99,
                               progress=False)
    assert result.accuracy["eval_samples"] == 5
    assert [s["name"] for s in result.accuracy["float_sites"]] == ["conv2"]


@pytest.mark.parametrize("build", [lambda: residual_block_model(projection=False, seed=2),
                                   lambda: residual_block_model(projection=True, seed=3),
                                   lambda: concat_model(seed=4), lambda: conv_bn_relu_model(maxpool=True)],
                         ids=["residual", "projection", "concat", "conv_bn_relu"])
def test_every_site_left_float_gives_a_check_clean_model(build):
    """A float site must not leave a half-quantized neighbour: each site excluded in turn (and all but
    one) through the same placement; check finds nothing."""
    model = build()
    feeds = random_inputs(model, 1, seed=0)
    placement, index = onnx_qat.place(model), GraphIndex(model)
    sites = sites_of(placement, index)
    table = onnx_qat.calibrate(model, feeds, tensors=tensors_to_calibrate(placement, sites, index),
                               progress=False)
    assert sites
    settings = [[k] for k in range(len(sites))] + [[i for i in range(len(sites)) if i != k]
                                                    for k in range(len(sites))]
    for chosen in settings:
        names = [sites[k].name for k in with_partners(sites, chosen)]
        if onnx_qat.place(model, exclude_nodes=site_exclusions(names)).empty:
            continue  # every site float: the float model itself
        result = onnx_qat.quantize(model, scales=table, exclude_nodes=site_exclusions(names), progress=False)
        report = onnx_qat.check(result.model)
        assert report and not report.findings, f"{names}: {report}"


def test_budget_failure_writes_nothing(tmp_path):
    model = outlier_channel_model("conv2", factor=1000.0)
    out, rep = tmp_path / "q.onnx", tmp_path / "r.json"
    with pytest.raises(onnx_qat.AccuracyError,
                       match=r"at most 0 of 6 sites left float.*best reached is 0\.\d+"):
        onnx_qat.quantize(model, out, data=_inputs(16, 0), min_cosine=0.99, max_float_sites=0, report=rep,
                          progress=False)
    assert not out.exists() and not rep.exists()
    with pytest.raises(onnx_qat.AccuracyError, match="every site in float"):
        onnx_qat.quantize(model, out, data=_inputs(16, 0), min_cosine=1.0, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_cli_min_cosine_summary_report_and_budget_exit(tmp_path, capsys):
    model = outlier_channel_model("conv3", seed=3, factor=1000.0)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **_inputs(16, 3))
    base = ["quantize", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--no-progress"]
    code = main(base + ["-o", str(tmp_path / "q.onnx"), "--min-cosine", "0.99",
                        "--report", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "mixed precision: 1 of 6 sites left float (conv3)" in out and "0 errors, 0 warnings" in out
    saved = json.loads((tmp_path / "r.json").read_text())["mixed_precision"]
    assert saved["cosine_after"] >= 0.99 > saved["cosine_before"]
    code = main(base + ["-o", str(tmp_path / "q2.onnx"), "--min-cosine", "0.99", "--max-float-sites", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and len(err) == 1 and "best reached is" in err[0]
    assert not (tmp_path / "q2.onnx").exists()
    assert main(base + ["-o", str(tmp_path / "q3.onnx"), "--max-float-sites", "2"]) == EXIT_USAGE


def test_options_are_validated():
    model = conv_bn_relu_model()
    data = random_inputs(model, 1)
    for kw, match in (({"max_float_sites": 1}, "min_cosine"), ({"min_cosine": 1.5}, "min_cosine"),
                      ({"min_cosine": 0.9, "max_float_sites": -1}, "max_float_sites"),
                      ({"eval_data": data}, "eval_data")):
        with pytest.raises(onnx_qat.ConfigError, match=match):
            onnx_qat.quantize(model, data=data, progress=False, **kw)


def test_reached_without_float_sites_is_the_default_model_byte_for_byte():
    """With nothing left float the result is exactly what quantize gives with the same method on the
    calibration split (``max``; with ``auto``'s range search, the whole table it starts from)."""
    model = outlier_channel_model("conv2", seed=5, factor=2.0)
    data = _inputs(16, 5)
    mixed = onnx_qat.quantize(model, data=data, min_cosine=0.5, method="max", progress=False)
    assert mixed.accuracy["float_sites"] == []
    default = onnx_qat.quantize(model, data={"input": data["input"][:12]}, method="max", progress=False)
    assert mixed.model.SerializeToString() == default.model.SerializeToString()
    assert default.accuracy is None and "mixed_precision" not in default.to_report()


def test_default_quantize_does_not_touch_the_accuracy_tools(tmp_path):
    """Without the new options quantize runs the code it ran before: the accuracy package is not even
    imported, and the written bytes equal a run whose options are None."""
    model = residual_block_model(seed=6)
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **random_inputs(model, 1, seed=1))
    code = ("import sys, onnx_qat; "
            "onnx_qat.quantize(sys.argv[1], sys.argv[2], data=sys.argv[3], progress=False); "
            "print('onnx_qat.accuracy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.onnx"), str(tmp_path / "a.onnx"),
                           str(tmp_path / "d.npz")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    onnx_qat.quantize(tmp_path / "m.onnx", tmp_path / "b.onnx", data=tmp_path / "d.npz", min_cosine=None,
                      max_float_sites=None, eval_data=None, progress=False)
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
