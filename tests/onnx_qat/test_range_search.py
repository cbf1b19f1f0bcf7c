"""--min-cosine's search over each tensor's range as well as the float sites (onnx_qat.accuracy.ranges),
and the gated session's scale inputs it runs on (onnx_qat.accuracy.gated.lift_scales)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnx_qat
from onnx_qat.accuracy.prepared import output_error, prepare
from onnx_qat.accuracy.ranges import candidates, whole_table
from tests.builders import assert_check_clean, concat_model, rare_outlier_model, residual_block_model


def _inputs(n: int, seed: int, scale: float = 1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {"input": (rng.standard_normal((n, 16, 8, 8)) * scale).astype(np.float32)}


@pytest.mark.parametrize("seed", [0, 3])
def test_the_range_of_an_outlier_tensor_is_chosen_instead_of_leaving_its_site_float(seed):
    calib, search, unseen = _inputs(32, seed + 1), _inputs(16, seed + 2), _inputs(16, seed + 9)
    model = rare_outlier_model("conv3", calib, seed=seed)
    plain = onnx_qat.quantize(model, data=calib, eval_data=search, min_cosine=0.99, method="max",
                              progress=False)
    assert [s["name"] for s in plain.accuracy["float_sites"]] == ["conv3"]
    result = onnx_qat.quantize(model, data=calib, eval_data=search, min_cosine=0.99, progress=False)
    info = result.accuracy
    assert info["method"] == "auto"
    assert len(info["float_sites"]) < len(plain.accuracy["float_sites"])
    assert info["cosine_before"] < 0.99 <= info["cosine_after"]
    assert info["cosine_estimate"] == pytest.approx(info["cosine_after"], abs=1e-4)
    assert (info["int8_weighted_ops"], info["weighted_ops"]) == (7, 7)
    ranges = info["ranges"]
    # the start: the best whole table (the per-tensor one on seed 3 since its candidates are scored on
    # the num_bins histogram, 2026-11-27), still short of the minimum
    assert ranges["start"] in ("max", "mse", "tensor") and ranges["whole_tables"][ranges["start"]] < 0.99
    assert [(c["site"], c["tensors"]) for c in ranges["changes"]] == [("conv3", ["relu2_out"])]
    assert ranges["changes"][0]["to"].startswith("percentile")
    assert ranges["sites"]["conv3"] == {"relu2_out": ranges["changes"][0]["to"]}
    assert "relu2_out" in result.to_report()["mixed_precision"]["ranges"]["sites"]["conv3"]
    assert_check_clean(result.model)
    # the range carries over to inputs neither calibration nor the search saw
    assert onnx_qat.compare(model, result.model, unseen, min_cosine=0.99).passed


def test_whole_table_that_reaches_the_minimum_leaves_nothing_float_and_is_named():
    calib = _inputs(32, 1)
    model = rare_outlier_model("conv3", calib, seed=0, factor=1e4, tail=3.0)
    result = onnx_qat.quantize(model, data=calib, eval_data=_inputs(16, 2), min_cosine=0.99, progress=False)
    info = result.accuracy
    assert info["float_sites"] == [] and info["cosine_after"] >= 0.99
    tables = info["ranges"]["whole_tables"]
    assert tables["max"] < 0.9 < tables[info["ranges"]["start"]]
    assert "changes" not in info["ranges"]
    assert_check_clean(result.model)


def _built_error(prepared, amax, float_sites):
    from onnx_qat.accuracy.gated import join_flat
    from onnx_qat.accuracy.sites import site_exclusions

    built = onnx_qat.quantize(prepared.float_model, scales=dict(amax), progress=False,
                              exclude_nodes=list(site_exclusions(float_sites))).model
    session = ort.InferenceSession(built.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = list(prepared.reference)
    parts = [session.run(outputs, feed) for feed in prepared.feeds]
    return output_error(prepared.reference,
                        {o: join_flat([p[i] for p in parts]) for i, o in enumerate(outputs)})


@pytest.mark.parametrize("model", [residual_block_model(), concat_model()], ids=["residual", "concat"])
def test_scale_inputs_give_the_figures_of_models_built_with_those_ranges(model):
    """A setting of the gated session with other ranges fed (every site quantized, or one float),
    run from the cuts, is the model the inserter builds with those ranges; also after the runner's
    reference moved to another setting."""
    data = _inputs(24, 4, scale=2.0)
    prepared, _ = prepare(model, data, method="auto", range_candidates=True, progress=False)
    assert prepared.scale_inputs and set(prepared.scale_inputs) <= set(prepared.options)
    n = len(prepared.sites)
    every = set(range(n))
    partners = {p for s in prepared.sites for p in s.partners}  # their fallback re-decides a residual Add
    weighted = [k for k, s in enumerate(prepared.sites) if s.kind == "weighted" and s.name not in partners]
    for reference in ("start", "moved"):
        if reference == "moved":
            amax, _ = whole_table(prepared, "percentile(99.9)")
            prepared.runner.set_reference(every - {weighted[-1]}, prepared.scale_feeds(amax))
        for name in ("max", "entropy", "percentile(99.9)"):
            amax, _ = whole_table(prepared, name)
            for floats in ((), (weighted[0],)):
                gated = prepared.error(every - set(floats), amax)
                built = _built_error(prepared, amax, [prepared.sites[k].name for k in floats])
                assert gated.cosine == pytest.approx(built.cosine, abs=1e-6), (reference, name, floats)


def test_candidates_leave_out_ranges_that_repeat():
    found = candidates({"max": 10.0, "percentile(99.999)": 9.95, "percentile(99.99)": 8.0,
                        "percentile(99.9)": 4.0, "mse": 4.02, "entropy": 6.0})
    assert found == [("max", 10.0), ("percentile(99.99)", 8.0), ("percentile(99.9)", 4.0), ("entropy", 6.0)]


def test_cli_names_the_start_table_and_the_ranges_changed(tmp_path, capsys):
    import json

    import onnx

    from onnx_qat.cli import EXIT_OK, main

    calib = _inputs(32, 4)
    onnx.save(rare_outlier_model("conv3", calib, seed=3), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", **calib)
    np.savez(tmp_path / "e.npz", **_inputs(16, 5))
    code = main(["quantize", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "--eval-data",
                 str(tmp_path / "e.npz"), "-o", str(tmp_path / "q.onnx"), "--min-cosine", "0.99",
                 "--report", str(tmp_path / "r.json"), "--no-progress"])
    out = capsys.readouterr().out
    assert code == EXIT_OK and "0 errors, 0 warnings" in out
    saved = json.loads((tmp_path / "r.json").read_text())["mixed_precision"]
    assert saved["float_sites"] == [] and saved["cosine_after"] >= 0.99
    change = saved["ranges"]["changes"][0]
    assert "mixed precision: 0 of 8 sites left float" in out
    assert f"ranges: {saved['ranges']['start']} table, 1 tensor changed ({change['to']} 1)" in out
    judged = saved["judged"]
    assert (judged["evaluation_samples"], judged["calibration_samples"]) == (16, 32)
    assert judged["bound"] >= 0.99 and judged["bound"] < judged["cosine"]
    assert (f"judged on 16 eval + 32 calibration samples: cosine {judged['cosine']:.5f}, "
            f"bound {judged['bound']:.5f}") in out


@pytest.mark.parametrize("seed", [0, 3])
def test_tune_table_chooses_the_outlier_tensors_range(seed):
    """``--optimize accuracy``'s ranges step on its own: every site INT8, the outlier tensor's range
    chosen by the output, the other tensors left as the best whole table has them."""
    from onnx_qat.accuracy.ranges import tune_table
    from onnx_qat.config import QuantizeConfig

    calib, search = _inputs(32, seed + 1), _inputs(16, seed + 2)
    model = rare_outlier_model("conv3", calib, seed=seed)
    table, records = tune_table(model, calib, search, config=QuantizeConfig())
    assert [c["tensors"] for c in records["changes"]] == [["relu2_out"]]
    assert records["changes"][0]["to"].startswith("percentile") and records["tuned"] >= 0.99
    assert records["whole_tables"][records["start"]] < 0.99
    built = onnx_qat.quantize(model, scales=table, progress=False)
    assert_check_clean(built.model)
    default = onnx_qat.quantize(model, data=calib, progress=False)
    unseen = _inputs(16, seed + 9)
    assert onnx_qat.compare(model, built.model, unseen, min_cosine=0.99).passed
    assert not onnx_qat.compare(model, default.model, unseen, min_cosine=0.99).passed


def test_optimize_accuracy_runs_the_ranges_step_and_reports_it():
    calib = _inputs(32, 1)
    model = rare_outlier_model("conv3", calib, seed=0)
    result = onnx_qat.quantize(model, data=calib, eval_data=_inputs(16, 2), optimize="accuracy",
                               progress=False)
    steps = {s["step"]: s for s in result.accuracy["steps"]}
    assert list(steps)[3] == "ranges" and steps["ranges"]["kept"] == (steps["ranges"]["gain"] > 0)
    assert steps["ranges"]["start"] in ("tensor", "max", "entropy", "mse", "percentile(99.99)")
    assert result.accuracy["cosine_after"] >= 0.99
    assert_check_clean(result.model)


def test_a_gain_most_samples_do_not_share_is_not_kept():
    from onnx_qat.accuracy.prepared import OutputError
    from onnx_qat.accuracy.ranges import better

    now, now_samples = OutputError(0.95, 10.0, 1.0), np.array([0.95, 0.95, 0.95, 0.95])
    gain = OutputError(0.96, 11.0, 1.0)
    assert better(gain, np.array([0.96, 0.96, 0.94, 0.99]), now, now_samples)  # 3 of 4 samples
    assert not better(gain, np.array([0.99, 0.99, 0.94, 0.94]), now, now_samples)  # 2 of 4: two samples' gain
    assert not better(OutputError(0.95001, 10.0, 1.0), None, now, None)  # below the least gain
    assert better(gain, None, now, None)


def test_sample_cosines_are_each_samples_own_figure():
    from onnx_qat.accuracy.prepared import output_error
    from onnx_qat.accuracy.ranges import sample_cosines

    model = residual_block_model()
    data = _inputs(24, 4, scale=2.0)
    prepared, _ = prepare(model, data, method="auto", range_candidates=True, progress=False)
    outputs = prepared.runner.run(range(len(prepared.sites)))
    per_sample = sample_cosines(prepared, outputs)
    samples = prepared.evaluation.num_samples
    assert per_sample.shape == (samples,)
    for i in (0, samples - 1):
        one = {k: v.reshape(samples, -1)[i] for k, v in outputs.items()}
        ref = {k: v.reshape(samples, -1)[i] for k, v in prepared.reference.items()}
        assert per_sample[i] == pytest.approx(output_error(ref, one).cosine, abs=1e-9)


def _gated(model):
    """``model`` with its output multiplied by a second input ``gate`` [N,1,1,1] (not quantized): a
    sample whose gate is 0 has an empty output."""
    from onnx import TensorProto, helper

    out = model.graph.output[0].name
    producer = next(n for n in model.graph.node if out in n.output)
    producer.output[list(producer.output).index(out)] = "ungated"
    model.graph.node.append(helper.make_node("Mul", ["ungated", "gate"], [out], name="gate_mul"))
    model.graph.input.append(helper.make_tensor_value_info("gate", TensorProto.FLOAT, ["N", 1, 1, 1]))
    return model


def _gates(*values) -> np.ndarray:
    return np.asarray(values, np.float32).reshape(-1, 1, 1, 1)


def test_empty_samples_do_not_vote():
    from onnx_qat.accuracy.prepared import OutputError
    from onnx_qat.accuracy.ranges import better, empty_samples

    now, gain = OutputError(0.95, 10.0, 1.0), OutputError(0.96, 11.0, 1.0)
    nan = float("nan")
    now_samples = np.array([0.95, 0.95, 0.95, 0.95, 0.95, 0.95])
    # 3 of the 6 samples gain: short of 2/3 of 6, but 3 of the 4 that vote
    assert not better(gain, np.array([0.96, 0.96, 0.96, 0.94, 0.94, 0.94]), now, now_samples)
    assert better(gain, np.array([0.96, 0.96, 0.96, 0.94, nan, nan]), now, now_samples)
    assert not better(gain, np.array([0.96, 0.96, 0.94, 0.94, nan, nan]), now, now_samples)  # 2 of 4
    assert better(gain, np.full(6, nan), now, now_samples)  # none votes: the gain decides
    assert not better(OutputError(0.95001, 10.0, 1.0), np.full(6, nan), now, now_samples)
    # empty: at most EMPTY_SHARE (1e-3) of the median energy, or zero
    assert empty_samples(np.array([2.0, 2.0, 3.0, 2.0, 2e-3, 2.02e-3, 0.0])).tolist() == \
        [False, False, False, False, True, False, True]  # the median is 2.0
    assert empty_samples(np.zeros(3)).tolist() == [True, True, True]


def test_sample_cosines_leave_out_empty_samples():
    from onnx_qat.accuracy.ranges import sample_cosines

    data = _inputs(32, 1)
    model = _gated(rare_outlier_model("conv3", data, seed=0))
    calib = {**data, "gate": _gates(*[1.0] * 32)}
    gates = _gates(1.0, 0.0, 1.0, 1e-2, 0.1, 1.0, 0.0, 1.0)  # energies 1, 0, 1, 1e-4, 1e-2, ...
    evaluation = {**_inputs(8, 2), "gate": gates}
    prepared, _ = prepare(model, calib, eval_data=evaluation, method="auto", range_candidates=True,
                          progress=False)
    outputs = prepared.runner.run(range(len(prepared.sites)))
    per_sample = sample_cosines(prepared, outputs)
    assert np.isnan(per_sample).tolist() == [False, True, False, True, False, False, True, False]
    ungated = prepared.reference["output"].reshape(8, -1)
    for i in (0, 4):  # a sample at 1/10 of the output is not empty: its own cosine
        r, c = ungated[i], np.asarray(outputs["output"], np.float64).reshape(8, -1)[i]
        assert per_sample[i] == pytest.approx(r @ c / np.sqrt((r @ r) * (c @ c)), abs=1e-9)
        assert 0.5 < per_sample[i] < 0.9999


@pytest.mark.parametrize("seed", [0, 3])
def test_empty_samples_would_otherwise_veto_a_range_change(monkeypatch, seed):
    """Half the evaluation samples empty (their gate 0): the range change the first test makes (conv3's
    input to a percentile) still raises the cosine of every other sample and is kept; counted as votes,
    the empty samples (never raised) make 2/3 of the samples out of reach and conv3 goes float."""
    import onnx_qat.accuracy.ranges as ranges

    calib = _inputs(32, seed + 1)
    model = _gated(rare_outlier_model("conv3", calib, seed=seed))
    calib["gate"] = _gates(*[1.0] * 32)
    evaluation = {"input": np.concatenate([_inputs(16, seed + 2)["input"], _inputs(16, seed + 7)["input"]]),
                  "gate": _gates(*[1.0] * 16 + [0.0] * 16)}
    result = onnx_qat.quantize(model, data=calib, eval_data=evaluation, min_cosine=0.99, progress=False)
    info = result.accuracy
    assert info["float_sites"] == [] and info["cosine_after"] >= 0.99
    assert [c["site"] for c in info["ranges"]["changes"]] == ["conv3"]
    assert info["ranges"]["changes"][0]["to"].startswith("percentile")
    assert_check_clean(result.model)
    monkeypatch.setattr(ranges, "empty_samples", lambda energy: np.zeros(len(energy), bool))
    voting = onnx_qat.quantize(model, data=calib, eval_data=evaluation, min_cosine=0.99,
                               progress=False).accuracy
    assert [s["name"] for s in voting["float_sites"]] == ["conv3"] and not voting["ranges"]["changes"]


@pytest.mark.parametrize("build", ["if_cnn_model", "loop_cnn_model"])
def test_models_with_bodies_search_their_main_graph_ranges_and_stay_check_clean(build):
    """If/Loop bodies keep their scale initializers (they may read outer ones): the search changes the
    main graph's ranges, every setting runs whole (no cuts), and the result passes check."""
    import tests.builders as builders

    model = getattr(builders, build)()
    result = onnx_qat.quantize(model, data=builders.random_inputs(model, 24, seed=1), min_cosine=0.999,
                               progress=False)
    assert result.accuracy["cosine_after"] >= 0.999 and "ranges" in result.accuracy
    assert_check_clean(result.model)


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_confirmation_measures_the_calibration_samples_as_a_built_model(scale):
    """The samples a range change must also gain on: the first calibration samples, figures as the
    model built with those ranges gives them there (every site float: the float model itself)."""
    from onnx_qat.accuracy.gated import join_flat
    from onnx_qat.accuracy.ranges import CONFIRM_SAMPLES, Confirmation

    model = residual_block_model()
    prepared, _ = prepare(model, _inputs(24, 5, scale=scale), method="auto", range_candidates=True,
                          progress=False)
    confirm = Confirmation(prepared)
    assert confirm.usable and prepared.calibration.num_samples <= CONFIRM_SAMPLES
    n = len(prepared.sites)
    assert confirm.cosine(range(n), prepared.table.activations) == pytest.approx(1.0, abs=1e-12)
    amax, _ = whole_table(prepared, "max")
    built = onnx_qat.quantize(model, scales=dict(amax), progress=False).model
    outputs = list(prepared.reference)
    runs = {}
    for name, m in (("float", model), ("built", built)):
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        parts = [session.run(outputs, feed) for feed in confirm.feeds]
        runs[name] = {o: join_flat([p[i] for p in parts]) for i, o in enumerate(outputs)}
    expected = output_error({k: v.astype(np.float64) for k, v in runs["float"].items()}, runs["built"]).cosine
    assert expected < 0.99999
    assert confirm.cosine((), amax) == pytest.approx(expected, abs=1e-6)
    assert confirm.runs == 2


def test_confirmation_is_off_with_given_scales():
    from onnx_qat.accuracy.ranges import Confirmation

    model = residual_block_model()
    data = _inputs(16, 6)
    table = onnx_qat.calibrate(model, data, progress=False)
    prepared, _ = prepare(model, None, scales=table, eval_data=data, progress=False)
    assert not Confirmation(prepared).usable


@pytest.mark.parametrize("seed", [0, 3])
def test_a_change_the_calibration_samples_do_not_confirm_is_not_kept(seed):
    """The outlier tensor's range change (kept above) with a confirmation that sees it lower the
    cosine: recorded as unconfirmed, the table left as it was; with one that sees it gain: kept."""
    from onnx_qat.accuracy.ranges import RangeSearch, start, tune

    class Confirming:  # the calibration samples' cosine: the start table 0.9, anything else ``after``
        usable = True

        def __init__(self, after):
            self.after, self.runs, self.start = after, 0, None

        def cosine(self, float_sites, amax):
            self.runs += 1
            self.start = self.start or dict(amax)
            return 0.9 if dict(amax) == self.start else self.after

    calib, search = _inputs(32, seed + 1), _inputs(16, seed + 2)
    model = rare_outlier_model("conv3", calib, seed=seed)
    for after, kept in ((0.8, False), (0.95, True)):
        prepared, _ = prepare(model, calib, method="auto", eval_data=search, range_candidates=True,
                              progress=False)
        state = RangeSearch(prepared, dict(prepared.table.activations), {}, confirm=Confirming(after))
        current = start(state)
        table = dict(state.amax)
        tuned = tune(state, range(len(prepared.sites)), current, 1.1)
        changes, unconfirmed = state.records.get("changes", []), state.records.get("unconfirmed", [])
        if kept:
            assert [c["tensors"] for c in changes] == [["relu2_out"]]
            assert tuned.cosine > current.cosine and state.amax != table
        else:  # every change is refused, the outlier tensor's first
            assert changes == [] and unconfirmed[0]["tensors"] == ["relu2_out"]
            assert unconfirmed[0]["confirm_after"] == 0.8 < unconfirmed[0]["confirm_before"] == 0.9
            assert tuned == current and state.amax == table
        assert state.records["confirm_runs"] == state.confirm.runs >= 2


@pytest.mark.parametrize("seed", [0, 3])
def test_tune_table_keeps_the_given_ranges_unless_the_calibration_samples_confirm(seed):
    from onnx_qat.accuracy.ranges import tune_table
    from onnx_qat.config import QuantizeConfig

    calib, search = _inputs(32, seed + 1), _inputs(16, seed + 2)
    model = rare_outlier_model("conv3", calib, seed=seed)
    given = onnx_qat.calibrate(model, calib, method="max", progress=False)
    table, records = tune_table(model, calib, search, config=QuantizeConfig(), weights=given)
    assert records["confirmed"] and records["confirm_after"] > records["confirm_before"]
    assert table.activations["relu2_out"] < 0.5 * given.activations["relu2_out"]  # the outlier clipped
    again, records = tune_table(model, calib, search, config=QuantizeConfig(), weights=table)
    # nothing better than the tuned ranges on the calibration samples: they come back as given
    assert not records["confirmed"] and records["confirm_after"] <= records["confirm_before"]
    assert dict(again.activations) == dict(table.activations)


def _whole_table_models():
    from tests.onnx_qat.test_accuracy_optimize import saturating_model

    return {"residual": residual_block_model(projection=True), "saturating": saturating_model(0)}


#: (model, calibration samples, seed, input scale) where the whole-table choice with the paired rule
#: on any number of samples (before `MIN_PAIRED_SAMPLES` applied to it) changed when the inputs moved
#: by 0.1% (measured 2026-11-27: 8 of 48 conditions on these two models, 2-4 samples, 4 seeds)
WHOLE_TABLE_FLIPPED = (("residual", 2, 2, "norm"), ("saturating", 2, 1, "norm"),
                       ("saturating", 2, 3, "x255"), ("residual", 4, 0, "norm"))


@pytest.mark.parametrize("name, samples, seed, scale", WHOLE_TABLE_FLIPPED)
def test_whole_table_choice_keeps_the_given_table_on_few_calibration_samples(monkeypatch, name, samples,
                                                                             seed, scale):
    """`choose_table` follows auto's minimum of per-sample errors: on 2-4 calibration samples the
    given table (auto's) is kept whatever the cosines, stable under a 0.1% perturbation of the inputs
    that changed the choice before, every table's cosine still recorded and the reason given."""
    from onnx_qat.accuracy.ranges import START_TABLES, choose_table
    from onnx_qat.calibration import choice
    from onnx_qat.config import QuantizeConfig
    from tests.onnx_qat.test_calibration_auto import _few

    model = _whole_table_models()[name]
    evaluation = _few(model, 4, seed + 50, scale, 0.0)
    before = []
    for eps in (0.0, 1e-3):
        data = _few(model, samples, seed, scale, eps)
        given = onnx_qat.calibrate(model, data, progress=False)
        table, records = choose_table(model, data, evaluation, config=QuantizeConfig(), weights=given)
        assert table is given and records["start"] == "given"
        assert records["calibration_samples"] == samples
        assert records["paired_note"] == f"{samples} samples judged, fewer than the 8 the paired rule needs"
        assert set(records["calibration_cosines"]) == {"given", *START_TABLES}
        with monkeypatch.context() as patched:  # the paired rule on any number of samples
            patched.setattr(choice, "MIN_PAIRED_SAMPLES", 1)
            _, records = choose_table(model, data, evaluation, config=QuantizeConfig(), weights=given)
            assert "paired_note" not in records
            before.append(records["start"])
    assert before[0] != before[1], before  # that rule's choice moved with the inputs


def test_whole_table_choice_on_enough_calibration_samples_is_unchanged(monkeypatch):
    """From `MIN_PAIRED_SAMPLES` (8) calibration samples on, `choose_table` decides as the paired rule
    on any number of samples did: the same table and records, no note (tables other than the given one
    are chosen here)."""
    from onnx_qat.accuracy.ranges import choose_table
    from onnx_qat.calibration import choice
    from onnx_qat.config import QuantizeConfig
    from tests.onnx_qat.test_calibration_auto import _few

    models = _whole_table_models()
    chosen = []
    for name, samples in (("residual", 8), ("saturating", 16)):
        model = models[name]
        for seed in range(3):
            data, evaluation = _few(model, samples, seed, "x255", 0.0), _few(model, 4, seed + 50, "x255", 0.0)
            given = onnx_qat.calibrate(model, data, progress=False)
            table, records = choose_table(model, data, evaluation, config=QuantizeConfig(), weights=given)
            monkeypatch.setattr(choice, "MIN_PAIRED_SAMPLES", 1)
            old_table, old = choose_table(model, data, evaluation, config=QuantizeConfig(), weights=given)
            monkeypatch.undo()
            assert "paired_note" not in records and records["calibration_samples"] == samples
            records.pop("runs"), old.pop("runs")
            assert records == old
            assert dict(table.activations) == dict(old_table.activations)
            chosen.append(records["start"])
    assert chosen == ["given", "percentile(99.99)", "mse"] * 2, chosen


def test_optimize_accuracy_names_the_few_calibration_samples_in_its_ranges_step():
    """``optimize="accuracy"`` on 3 calibration samples: the whole-table choice keeps auto's table and
    the ranges step says why."""
    from tests.onnx_qat.test_calibration_auto import _few

    model = residual_block_model(projection=True)
    data, evaluation = _few(model, 3, 0, "norm", 0.0), _few(model, 4, 50, "norm", 0.0)
    result = onnx_qat.quantize(model, data=data, eval_data=evaluation, optimize="accuracy", progress=False)
    assert_check_clean(result.model)
    step = {s["step"]: s for s in result.accuracy["steps"]}["ranges"]
    assert step["mode"] == "whole table" and step["start"] == "given" and not step["kept"]
    assert step["paired_note"] == "3 samples judged, fewer than the 8 the paired rule needs"
    assert step["note"] == ("4 evaluation samples, fewer than 8 in each half to choose ranges on: 3 samples "
                            "judged, fewer than the 8 the paired rule needs")
