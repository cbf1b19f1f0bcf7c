"""What --min-cosine's range search judges its target on (onnx_qat.accuracy.judged): the evaluation
cosine and a lower bound of the cosine over the evaluation and calibration samples together."""
from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import numpy_helper

import onnx_qat
from onnx_qat.accuracy.figures import output_error
from onnx_qat.accuracy.judged import EVIDENCE, Judge, judge_sums, sample_sums
from onnx_qat.runtime.sessions import run_model
from tests.builders import assert_check_clean, outlier_channel_model


def _sums(reference, candidate):
    return sample_sums({"y": reference.ravel()}, {"y": candidate.ravel()}, len(reference))


def test_the_judged_cosine_is_the_pooled_one_less_jackknife_standard_errors():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((7, 50))
    got = ref + rng.standard_normal((7, 50)) * np.linspace(0.01, 0.3, 7)[:, None]
    eval_part, calib_part = _sums(ref[:3], got[:3]), _sums(ref[3:], got[3:])
    judged = judge_sums([eval_part, calib_part])
    pooled = output_error({"y": ref.ravel()}, {"y": got.ravel()}).cosine
    assert judged.cosine == pytest.approx(pooled, abs=1e-12) and judged.samples == 7
    left = np.array([output_error({"y": np.delete(ref, i, 0).ravel()},
                                  {"y": np.delete(got, i, 0).ravel()}).cosine for i in range(7)])
    se = math.sqrt(6 / 7 * np.sum((left - left.mean()) ** 2))
    assert judged.standard_error == pytest.approx(se, rel=1e-9) and se > 1e-3
    assert judged.bound == pytest.approx(pooled - EVIDENCE * se * math.sqrt(2.0), abs=1e-12)
    assert judge_sums([eval_part, calib_part], new_samples=3).bound == pytest.approx(
        pooled - EVIDENCE * se * math.sqrt(1 + 7 / 3), abs=1e-12)


def test_an_empty_sample_changes_nothing_and_a_far_one_widens_the_bound():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((6, 40))
    got = ref + 0.05 * rng.standard_normal((6, 40))
    base = judge_sums([_sums(ref, got)])
    empty = judge_sums([_sums(np.vstack([ref, np.zeros((1, 40))]), np.vstack([got, np.zeros((1, 40))]))])
    assert (empty.cosine, empty.samples) == (pytest.approx(base.cosine, abs=1e-12), 7)
    assert empty.bound == pytest.approx(base.bound, abs=2e-3)
    far = judge_sums([_sums(np.vstack([ref, ref[:1]]), np.vstack([got, -ref[:1]]))])
    assert far.standard_error > 5 * base.standard_error and far.bound < base.bound - 0.1
    # the worst output counts
    two = judge_sums([{"a": _sums(ref, got)["y"], "b": _sums(ref, got + 0.1 * ref[::-1])["y"]}])
    assert two.bound == pytest.approx(min(judge_sums([_sums(ref, got)]).bound,
                                          judge_sums([_sums(ref, got + 0.1 * ref[::-1])]).bound), abs=1e-12)


def _graded_outliers(seed: int, factor: float = 60.0):
    """Six Conv-Relu layers, each Conv's input dominated by one outlier channel (``factor`` x 0.8 .. 1.2,
    the float function unchanged): every site costs some accuracy."""
    model = outlier_channel_model("conv2", convs=6, factor=1.0, seed=seed)
    inits = {t.name: t for t in model.graph.initializer}
    for k in range(2, 7):
        names = (f"conv{k - 1}.weight", f"conv{k - 1}.bias", f"conv{k}.weight")
        arrays = {n: numpy_helper.to_array(inits[n]).copy() for n in names}
        f = factor * (0.6 + 0.1 * k)
        arrays[names[0]][0] *= f
        arrays[names[1]][0] *= f
        arrays[names[2]][:, 0] /= f
        for name, array in arrays.items():
            inits[name].CopyFrom(numpy_helper.from_array(array.astype(np.float32), name))
    return model


def _kinds(bright: int, dim: int, seed: int) -> dict:
    """``bright`` inputs of unit scale, then ``dim`` ones at a tenth of it (the two kinds of input)."""
    x = np.random.default_rng(seed).standard_normal((bright + dim, 16, 8, 8)).astype(np.float32)
    x[bright:] *= 0.1
    return {"input": x}


def _cosine(model, candidate, data) -> float:
    ref, got = run_model(model, data), run_model(candidate, data)
    return output_error({k: v.ravel().astype(np.float64) for k, v in ref.items()},
                        {k: v.ravel() for k, v in got.items()}).cosine


@pytest.mark.parametrize("seed", [0, 2])
def test_the_target_holds_on_unseen_inputs_where_the_evaluation_cosine_alone_did_not(seed, monkeypatch):
    """The evaluation data holds only bright inputs, calibration and the unseen inputs both kinds. The
    evaluation cosine alone (the rule before) stops with every site INT8 above 0.99 there, and the
    unseen inputs fall below it; judged with the calibration samples too, the search leaves sites float
    and the minimum holds on the unseen inputs."""
    model = _graded_outliers(seed)
    calib, search, unseen = _kinds(16, 16, seed + 1), _kinds(8, 0, seed + 2), _kinds(8, 8, seed + 3)
    result = onnx_qat.quantize(model, data=calib, eval_data=search, min_cosine=0.99, progress=False)
    info = result.accuracy
    judged = info["judged"]
    assert (judged["evaluation_samples"], judged["calibration_samples"], judged["samples"]) == (8, 32, 40)
    assert judged["bound"] >= 0.99 and judged["bound"] == pytest.approx(
        judged["cosine"] - EVIDENCE * judged["standard_error"] * math.sqrt(1 + 40 / 8), abs=1e-12)
    assert judged["new_samples"] == 8
    assert info["cosine_after"] >= 0.99 and info["float_sites"]
    new = _cosine(model, result.model, unseen)
    assert new >= 0.99
    assert_check_clean(result.model)

    monkeypatch.setattr(Judge, "usable", property(lambda self: False))  # the evaluation cosine alone
    before = onnx_qat.quantize(model, data=calib, eval_data=search, min_cosine=0.99, progress=False)
    assert before.accuracy["float_sites"] == [] and "judged" not in before.accuracy
    assert before.accuracy["cosine_after"] >= 0.99
    old = _cosine(model, before.model, unseen)
    assert old < 0.99 < new
    assert (old, new) == (pytest.approx({0: 0.9894, 2: 0.9752}[seed], abs=2e-3),
                          pytest.approx({0: 0.9936, 2: 0.9955}[seed], abs=2e-3))
    assert (info["int8_weighted_ops"], before.accuracy["int8_weighted_ops"]) == \
        {0: (6, 7), 2: (4, 7)}[seed]


def test_the_bound_unreached_names_it_and_writes_nothing(tmp_path):
    model = _graded_outliers(2)
    calib, search = _kinds(16, 16, 3), _kinds(8, 0, 4)
    out = tmp_path / "m.onnx"
    with pytest.raises(onnx_qat.AccuracyError, match=r"at most 0 of .*bound over 40 evaluation and "
                                                     r"calibration samples.*nothing was written"):
        onnx_qat.quantize(model, out, data=calib, eval_data=search, min_cosine=0.99, max_float_sites=0,
                          progress=False)
    assert not out.exists()
