"""calibration: our ``max``/``percentile``/``entropy``/``mse`` against onnxruntime's MinMax/Percentile/Entropy
calibrators on the same model and data (time and peak RSS), and our peak RSS at 64 vs 256 samples.

Each calibration runs alone in a child process (``python -m tools.bench.calibration --worker ...``): the
child reports the seconds spent calibrating (model load and data read included, interpreter start not),
the parent reads the child's own peak RSS. The two sides of each ratio run in turn (A B A B), and the
least disturbed of 2 runs of each counts. Both sides use batches
of 8 and their default settings (onnxruntime's calibrators observe every float tensor, as
``quantize_static`` has them do; ours observe the tensors placement quantizes).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List

import numpy as np

from . import models
from .measure import python_module, run_process
from .table import Goal, Row, ratio

NAME = "calibration"
PAIRS = (("max", "MinMax"), ("percentile", "Percentile"), ("entropy", "Entropy"), ("mse", None))
BATCH = 8


def _ours(model: str, data: str, method: str) -> None:
    import onnx_qat

    onnx_qat.calibrate(model, data, method=method, batch_size=BATCH, progress=False)


def _ort(model: str, data: str, method: str, workdir: str) -> None:
    from onnxruntime.quantization.calibrate import CalibrationDataReader, CalibrationMethod, create_calibrator

    with np.load(data, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    n = len(next(iter(arrays.values())))

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{k: v[i:i + BATCH] for k, v in arrays.items()} for i in range(0, n, BATCH)])

        def get_next(self):
            return next(self.batches, None)

    augmented = str(Path(workdir) / f"augmented_{method}.onnx")
    calibrator = create_calibrator(model, augmented_model_path=augmented,
                                   calibrate_method=getattr(CalibrationMethod, method))
    calibrator.collect_data(Reader())
    calibrator.compute_data()


def _worker(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.calibration --worker")
    parser.add_argument("tool", choices=["ours", "ort"])
    parser.add_argument("method")
    parser.add_argument("model")
    parser.add_argument("data")
    parser.add_argument("workdir")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.tool == "ours":
        _ours(args.model, args.data, args.method)
    else:
        _ort(args.model, args.data, args.method, args.workdir)
    print(json.dumps({"seconds": time.perf_counter() - start}))
    return 0


def _data(workdir: Path, name: str, num: int, size: int, quick: bool) -> Path:
    path = workdir / f"calib_{num}.npz"
    if quick:
        arr = models.images(num, size, seed=11, channels_last=False, channels=16) / 64.0
    else:
        arr = models.images(num, size, seed=11)
    np.savez(path, **{name: arr.astype(np.float32)})
    return path


def _one(workdir: Path, tool: str, method: str, model: Path, data: Path):
    """Seconds and peak RSS (MiB) of one calibration in its own child process."""
    run = run_process(python_module("tools.bench.calibration", "--worker", tool, method, str(model),
                                    str(data), str(workdir)))
    return json.loads(run.stdout.strip().splitlines()[-1])["seconds"], run.peak_rss_mib


def _pair(workdir: Path, first, second, model: Path, data: Path, repeats: int):
    """Two calibrations ``(tool, method)`` run in turn (A B A B ...), so load on the machine hits both
    alike; for each, the least disturbed run: (seconds, MiB) of ``first``, then of ``second``."""
    runs = {0: [], 1: []}
    for _ in range(repeats):
        for index, (tool, method) in enumerate((first, second)):
            runs[index].append(_one(workdir, tool, method, model, data))
    return tuple((min(r[0] for r in runs[i]), min(r[1] for r in runs[i])) for i in (0, 1))


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the calibration rows."""
    import onnx

    workdir = Path(workdir)
    if quick:
        model, size, name = workdir / "tiny_cnn.onnx", 16, "input"
        onnx.save(models.tiny_cnn(), str(model))
        counts = (16, 64)
    else:
        size, name = 96, models.RESNET_INPUT
        model = models.resnet50(workdir / f"resnet50_{size}.onnx", size)
        counts = (64, 256)
    small = _data(workdir, name, counts[0], size, quick)
    repeats = 1 if quick else 2
    what = (f"{'tiny CNN' if quick else f'ResNet50 {size}x{size}'}, {counts[0]} samples, batch {BATCH}, "
            f"best of {repeats}")
    rows = []
    for ours_method, ort_method in PAIRS:
        if ort_method is None:
            (t_ours, _), (t_ref, _) = _pair(workdir, ("ours", ours_method), ("ours", "max"), model, small,
                                            repeats)
            rows.append(Row(NAME, f"{ours_method} time / our max time", ratio(t_ours, t_ref), None,
                            f"{what}; onnxruntime has no MSE calibrator; {t_ours:.1f} s vs {t_ref:.1f} s"))
            continue
        (t_ours, rss_ours), (t_ort, rss_ort) = _pair(workdir, ("ours", ours_method), ("ort", ort_method),
                                                     model, small, repeats)
        rows.append(Row(NAME, f"{ours_method} time / onnxruntime {ort_method}", ratio(t_ours, t_ort),
                        Goal("<=", 1.0), f"{what}; {t_ours:.1f} s vs {t_ort:.1f} s"))
        rows.append(Row(NAME, f"{ours_method} peak RSS / onnxruntime {ort_method}", ratio(rss_ours, rss_ort),
                        None, f"{rss_ours:.0f} MiB vs {rss_ort:.0f} MiB"))
    large = _data(workdir, name, counts[1], size, quick)
    extra_mib = (counts[1] - counts[0]) * size * size * (16 if quick else 3) * 4 / 2 ** 20
    for method in ("max", "entropy"):
        _, rss_small = _one(workdir, "ours", method, model, small)
        _, rss_large = _one(workdir, "ours", method, model, large)
        rows.append(Row(NAME, f"{method}: peak RSS at {counts[1]} / at {counts[0]} samples",
                        ratio(rss_large, rss_small), Goal("<=", 1.1),
                        f"{rss_large:.0f} MiB vs {rss_small:.0f} MiB "
                        f"(the data alone: {extra_mib:.0f} MiB more)"))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2:]))
    sys.exit("usage: python -m tools.bench.calibration --worker ours|ort METHOD MODEL DATA WORKDIR")
