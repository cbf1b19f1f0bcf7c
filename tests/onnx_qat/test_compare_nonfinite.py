"""compare() where the float reference overflows: non-finite reference values are left out and
counted, a non-finite candidate value where the reference is finite is a full error, no NaN figure."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat.runtime.compare import compare, judge, output_figures

pytestmark = pytest.mark.filterwarnings("error")

#: Scale of the overflowing output: |x @ w| above 340 overflows float32 (3.4e38).
BIG = np.float32(1e36)
W = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
#: A masking constant: column 0 of 'scores' is -inf whatever the input.
MASK = np.array([-np.inf, 0, 0, 0, 0], np.float32)


def _model(w: np.ndarray, clip: bool = False) -> onnx.ModelProto:
    """x[N,6] -> MatMul(w) -> h; y = h * 1e36 (inf where |h| > 340; clipped to ±3e38 with ``clip``,
    as a saturating quantized output would be); scores = h + MASK."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Mul", ["h", "big"], ["y_raw" if clip else "y"]),
             helper.make_node("Add", ["h", "mask"], ["scores"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(BIG), "big"),
             numpy_helper.from_array(MASK, "mask")]
    if clip:
        nodes.append(helper.make_node("Clip", ["y_raw", "lo", "hi"], ["y"]))
        inits += [numpy_helper.from_array(np.array(-3e38, np.float32), "lo"),
                  numpy_helper.from_array(np.array(3e38, np.float32), "hi")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5]),
                               helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 5])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _inputs(seed: int, n: int = 32) -> np.ndarray:
    """Standardized normal inputs times 255 (images on the 0..255 scale)."""
    x = np.random.default_rng(seed).standard_normal((n, 6))
    return ((x - x.mean()) / x.std() * 255).astype(np.float32)


def _nan_figure(text: str) -> bool:
    """Whether ``text`` shows a NaN number (Python and NumPy print it ``nan``; the report's words
    say ``NaN``)."""
    return re.search(r"\bnan\b", text) is not None


def _run(model: onnx.ModelProto, x: np.ndarray) -> dict:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(["y", "scores"], session.run(["y", "scores"], {"x": x})))


def _expected(r: np.ndarray, c: np.ndarray) -> dict:
    """The figures over the finite reference values, computed here with NumPy."""
    keep = np.isfinite(r)
    r, c = r[keep].astype(np.float64), c[keep].astype(np.float64)
    cosine = float(r @ c / (np.linalg.norm(r) * np.linalg.norm(c)))
    sqnr = 10 * math.log10(float(r @ r) / float((r - c) @ (r - c)))
    return {"left_out": int((~keep).sum()), "max_abs": float(np.abs(r - c).max()),
            "mean_abs": float(np.abs(r - c).mean()), "cosine": cosine, "sqnr_db": sqnr}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overflowing_reference_is_left_out_and_counted(seed):
    x = _inputs(seed)
    noise = np.random.default_rng(10 + seed).standard_normal(W.shape).astype(np.float32) * 0.01
    reference, candidate = _model(W), _model(W + noise, clip=True)
    ref, cand = _run(reference, x), _run(candidate, x)
    assert 0 < int(np.isinf(ref["y"]).sum()) < ref["y"].size  # some samples overflow, not all
    assert np.isfinite(cand["y"]).all()
    result = compare(reference, candidate, {"x": x}, min_cosine=0.99)
    by_name = {o.name: o for o in result.outputs}
    for name in ("y", "scores"):
        out, want = by_name[name], _expected(ref[name], cand[name])
        assert out.left_out == want["left_out"] and out.nonfinite == 0
        assert out.max_abs == pytest.approx(want["max_abs"], rel=1e-6)
        assert out.mean_abs == pytest.approx(want["mean_abs"], rel=1e-6)
        assert out.cosine == pytest.approx(want["cosine"], rel=1e-9)
        assert out.sqnr_db == pytest.approx(want["sqnr_db"], rel=1e-9)
        figures = (out.max_abs, out.max_rel, out.mean_abs, out.cosine, out.sqnr_db)
        assert all(math.isfinite(v) for v in figures)
    assert by_name["scores"].left_out == x.shape[0]  # the mask column, one value per sample
    # -inf in the masked column never wins the argmax: top-1 is measured over the whole rows
    want_top1 = float(np.mean(ref["scores"].argmax(1) == cand["scores"].argmax(1)))
    assert by_name["scores"].top1 == pytest.approx(want_top1)
    assert result.passed, str(result)
    text = str(result)
    assert not _nan_figure(text)
    assert f"output 'y': {by_name['y'].left_out} of {ref['y'].size} values left out of the figures" in text
    assert f"output 'scores': {x.shape[0]} of {ref['scores'].size} values left out" in text


@pytest.mark.parametrize("seed", [0, 1])
def test_candidate_overflow_where_reference_is_finite_is_a_full_error(seed):
    x = _inputs(seed)
    reference, candidate = _model(W), _model(W * np.float32(1.2))
    ref, cand = _run(reference, x), _run(candidate, x)
    bad = int((np.isfinite(ref["y"]) & ~np.isfinite(cand["y"])).sum())
    assert bad > 0
    result = compare(reference, candidate, {"x": x})
    out = {o.name: o for o in result.outputs}["y"]
    assert out.nonfinite == bad and out.left_out == int((~np.isfinite(ref["y"])).sum())
    assert out.cosine == 0.0 and out.sqnr_db == -math.inf and out.max_abs == math.inf
    assert out.mean_abs == math.inf and out.max_rel == math.inf
    assert not out.passed and out.reason == (f"candidate output has {bad} NaN or Inf value(s) where the "
                                             f"reference is finite")
    text = str(out)
    assert not _nan_figure(text) and f"{bad} NaN/Inf where the reference is finite (full errors)" in text
    assert not result


def test_output_figures_counts_and_no_nan():
    ref = np.array([1.0, np.inf, 2.0, np.nan, -3.0, -np.inf])
    figures = output_figures(ref, np.array([1.0, 5.0, 2.0, 7.0, -3.0, np.nan]))
    assert figures["left_out"] == 3 and figures["nonfinite"] == 0
    assert figures["cosine"] == pytest.approx(1.0) and figures["sqnr_db"] == math.inf
    assert figures["max_abs"] == 0.0
    figures = output_figures(ref, np.array([1.0, 5.0, np.nan, 7.0, -3.0, 0.0]))
    assert figures["left_out"] == 3 and figures["nonfinite"] == 1 and figures["cosine"] == 0.0
    # no finite reference value at all: nothing to compare, every value counted
    figures = output_figures(np.full(4, np.inf), np.zeros(4))
    assert figures["left_out"] == 4 and figures["cosine"] == 1.0 and figures["max_abs"] == 0.0
    # a state output gets figures only, but a non-finite candidate is still said
    assert "NaN or Inf" in judge("s", ref, np.full_like(ref, np.nan), state=True).reason


@pytest.mark.parametrize("magnitude", [1e-200, 1.0, 1e200])
def test_float64_figures_neither_overflow_nor_underflow(magnitude):
    ref = np.array([1.0, -2.0, 3.0, 0.5]) * magnitude
    figures = output_figures(ref, ref * 1.01)
    assert figures["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert figures["sqnr_db"] == pytest.approx(40.0, abs=1e-6)
    assert figures["max_abs"] == pytest.approx(0.03 * magnitude, rel=1e-9)
    assert figures["mean_abs"] == pytest.approx(0.01 * 6.5 / 4 * magnitude, rel=1e-9)
    assert figures["max_rel"] == pytest.approx(0.01, rel=1e-9)
    assert output_figures(np.array([1e308, 2.0]), np.array([-1e308, 2.0]))["max_abs"] == math.inf


def test_cli_prints_no_nan_and_the_left_out_line(tmp_path, capsys):
    from onnx_qat.cli import main

    x = _inputs(3)
    noise = np.random.default_rng(3).standard_normal(W.shape).astype(np.float32) * 0.01
    paths = [tmp_path / "f.onnx", tmp_path / "q.onnx"]
    onnx.save(_model(W), paths[0])
    onnx.save(_model(W + noise, clip=True), paths[1])
    np.savez(tmp_path / "d.npz", x=x)
    argv = ["compare", *map(str, paths), "--data", str(tmp_path / "d.npz")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    left = int(np.isinf(_run(_model(W), x)["y"]).sum())
    assert not _nan_figure(out) and f"output 'y': {left} of {x.size // 6 * 5} values left out" in out
    assert main(argv + ["--json"]) == 0
    data = {o["name"]: o for o in json.loads(capsys.readouterr().out)["outputs"]}
    assert data["y"]["left_out"] == left and data["y"]["nonfinite"] == 0
    assert data["scores"]["left_out"] == x.shape[0]
    onnx.save(_model(W * np.float32(1.2)), paths[1])
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert not _nan_figure(out) and "NaN/Inf where the reference is finite (full errors)" in out
    assert "cosine 0.00000 < 0.99" in out and "SQNR -inf dB" in out
    assert all(isinstance(data[n]["cosine"], float) and math.isfinite(data[n]["cosine"]) for n in data)
