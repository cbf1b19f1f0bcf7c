"""sensitivity: ``onnx_qat.sensitivity`` and ``quantize(min_cosine=...)`` on a 62-Conv text detector.

The model is the PP-OCRv4 DB text detector from the ``rapidocr-onnxruntime`` wheel (what
``tools/real_models.py`` measures as ``ocr-det``), at 320x320 on real inputs: 8 of scikit-image's sample
photos and 8 pages of text rendered with Pillow's font, for calibration and (other photos, other texts)
for evaluation, 16 samples each. Without the wheel (offline) its rows are SKIPs with the reason. The
goals: sensitivity within 60 s on 2 cores; ``--min-cosine 0.99`` (its default search over each
activation's range and the float sites) within 120 s and twice the sensitivity time. Both run once in
this process; the machine is shared, so every row gives the wall time, this process's CPU time
(onnxruntime's threads included) and the load average over the run. ``--quick`` runs a tiny CNN: it
checks the rows, not the goals.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, List, Tuple

from . import models
from .table import Goal, Row, ratio, skip

NAME = "sensitivity"
MIN_COSINE = 0.99
SIZE = 320
WHEEL = "rapidocr-onnxruntime==1.4.4"
INNER = "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx"
#: Where the test suite keeps the same model (used when present: no download).
TEST_CACHE = Path.home() / ".cache" / "onnx-qat-test-models" / "rapidocr-onnxruntime-1.4.4" / \
    "ch_PP-OCRv4_det_infer.onnx"


def _detector(workdir: Path) -> Tuple[object, str]:
    """``(path of the PP-OCRv4 detector, "")`` or ``(None, why it is missing)``."""
    import zipfile

    from tools import real_models

    if TEST_CACHE.exists():
        return TEST_CACHE, ""
    target = workdir / "ocr-det.onnx"
    if target.exists():
        return target, ""
    wheels = workdir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    why = real_models._download(WHEEL, wheels)
    if why:
        return None, why
    wheel = next(iter(sorted(wheels.glob("rapidocr_onnxruntime-*.whl"))), None)
    if wheel is None:
        return None, f"no wheel for {WHEEL}"
    with zipfile.ZipFile(wheel) as archive:
        target.write_bytes(archive.read(INNER))
    return target, ""


def _detector_inputs(split: str) -> dict:
    """16 NCHW images for the detector: 8 sample photos and 8 rendered text pages of ``split``."""
    from tools import real_models as R

    photos = R.CALIB_PHOTOS if split == "calib" else R.EVAL_PHOTOS
    words = R.CALIB_WORDS if split == "calib" else R.EVAL_WORDS
    images = [R._resize(p, SIZE, SIZE) for p in R._photos(photos)]
    images += [R._page([words[(i + j) % len(words)] for j in range(6)], SIZE) for i in range(0, 16, 2)]
    return {"x": R._normalise(images, *R.IMAGENET, bgr=True)}


def _timed(fn: Callable[[], object]):
    """``(result, wall s, CPU s of this process, load average over the call)``."""
    before = os.getloadavg()[0]
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return out, wall, cpu, (before + os.getloadavg()[0]) / 2


def _machine() -> str:
    from .table import machine

    info = machine()
    return f"{info.get('cpus')} CPUs ({info.get('cpu', '?')})"


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the sensitivity rows."""
    import onnx

    import onnx_qat

    workdir = Path(workdir)
    if quick:
        path, samples = workdir / "tiny_cnn.onnx", 8
        onnx.save(models.tiny_cnn(), str(path))
        calib = {"input": models.images(samples, 16, seed=2, channels_last=False, channels=16)}
        evaluation = {"input": models.images(samples, 16, seed=3, channels_last=False, channels=16)}
        what = "tiny CNN 16x16"
    else:
        path, why = _detector(workdir)
        if path is None:
            return [skip(NAME, "sensitivity time, PP-OCRv4 detector", why),
                    skip(NAME, "min-cosine time / sensitivity time", why)]
        calib, evaluation = _detector_inputs("calib"), _detector_inputs("eval")
        what = f"PP-OCRv4 detector {SIZE}x{SIZE}"
    samples = len(next(iter(evaluation.values())))
    result, t_sens, c_sens, l_sens = _timed(
        lambda: onnx_qat.sensitivity(str(path), calib, eval_data=evaluation, progress=False))

    def mixed():
        try:
            out = onnx_qat.quantize(str(path), data=calib, eval_data=evaluation, min_cosine=MIN_COSINE,
                                    progress=False)
        except onnx_qat.AccuracyError as exc:
            return f"not reached: {exc}"
        a = out.accuracy
        ranges = a.get("ranges")
        chosen = f", ranges from the {ranges['start']} table" if ranges else ""
        return (f"{len(a['float_sites'])} of {a['sites']} sites float, cosine {a['cosine_before']:.4f} -> "
                f"{a['cosine_after']:.4f}, {a['runs']} runs{chosen}")

    how, t_mixed, c_mixed, l_mixed = _timed(mixed)
    what += f", {len(result)} sites, {samples} eval samples"
    machine = _machine()
    return [
        Row(NAME, f"sensitivity time, {what}", t_sens, None if quick else Goal("<=", 60.0),
            f"wall; CPU {c_sens:.1f} s; load average {l_sens:.1f} on {machine}; {result.runs} runs, all-INT8 "
            f"cosine {result.all_int8.cosine:.4f}", unit="s"),
        Row(NAME, "sensitivity CPU time (this process, onnxruntime threads included)", c_sens, None,
            f"{c_sens / t_sens:.2f} CPU s per wall s", unit="s"),
        Row(NAME, "min-cosine time (ranges and float sites)", t_mixed, None if quick else Goal("<=", 120.0),
            f"wall; CPU {c_mixed:.1f} s; load average {l_mixed:.1f}", unit="s"),
        Row(NAME, "min-cosine time / sensitivity time", ratio(t_mixed, t_sens),
            None if quick else Goal("<=", 2.0),
            f"wall {t_mixed:.1f} s vs {t_sens:.1f} s (load {l_mixed:.1f} vs {l_sens:.1f}); "
            f"CPU {c_mixed:.1f} s vs {c_sens:.1f} s = {ratio(c_mixed, c_sens):.2f}x; {how}"),
    ]


__all__ = ["run"]
