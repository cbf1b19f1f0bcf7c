"""sensitivity: ``onnx_qat.sensitivity`` and ``quantize(min_cosine=...)`` on a 63-Conv detector.

The model is :func:`tools.bench.models.detector` (YOLOv8n-shaped, 320x320, Conv outputs normalised
on images as trained batch norms leave them), calibrated on 16 images and judged on 16 others. The
goals: sensitivity within 60 s on 2 cores; ``--min-cosine`` within twice the sensitivity time.
Both run in this process, each once (they take minutes; the machine's load shows in the detail).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List



from . import models
from .table import Goal, Row, ratio

NAME = "sensitivity"
MIN_COSINE = 0.99


def _setup(workdir: Path, quick: bool):
    import onnx

    if quick:  # the tiny CNN: checks the rows, not the goals
        path, size, samples, name, channels = workdir / "tiny_cnn.onnx", 16, 8, "input", 16
        onnx.save(models.tiny_cnn(), str(path))
    else:
        path, size, samples, name, channels = workdir / "detector_320.onnx", 320, 16, "images", 3
        if not path.exists():
            norm = models.images(2, size, seed=1, channels_last=False)
            onnx.save(models.detector(size, calib=norm), str(path))
    calib = {name: models.images(samples, size, seed=2, channels_last=False, channels=channels)}
    evaluation = {name: models.images(samples, size, seed=3, channels_last=False, channels=channels)}
    return path, calib, evaluation, size, samples


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the sensitivity rows."""
    import onnx_qat

    path, calib, evaluation, size, samples = _setup(Path(workdir), quick)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    result = onnx_qat.sensitivity(str(path), calib, eval_data=evaluation, progress=False)
    t_sens = time.perf_counter() - start
    start = time.perf_counter()
    try:
        mixed = onnx_qat.quantize(str(path), data=calib, eval_data=evaluation, min_cosine=MIN_COSINE,
                                  progress=False)
        how = (f"{len(mixed.accuracy['float_sites'])} of {mixed.accuracy['sites']} sites float, cosine "
               f"{mixed.accuracy['cosine_before']:.4f} -> {mixed.accuracy['cosine_after']:.4f}, "
               f"{mixed.accuracy['runs']} runs")
    except onnx_qat.AccuracyError as exc:
        how = f"not reached: {exc}"
    t_mixed = time.perf_counter() - start
    what = (f"{'tiny CNN' if quick else 'detector'} {size}x{size}, {len(result)} sites, {samples} eval "
            "samples")
    return [
        Row(NAME, f"sensitivity time, {what}", t_sens, None if quick else Goal("<=", 60.0),
            f"{result.runs} runs (all-INT8 cosine {result.all_int8.cosine:.4f}); load average {load:.1f} "
            f"on {os.cpu_count()} CPUs", unit="s"),
        Row(NAME, "min-cosine time / sensitivity time", ratio(t_mixed, t_sens),
            None if quick else Goal("<=", 2.0), f"{t_mixed:.0f} s vs {t_sens:.0f} s; {how}"),
    ]


__all__ = ["run"]

