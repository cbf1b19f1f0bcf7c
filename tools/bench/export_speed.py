"""export_speed: ``tf_bridge.export_onnx`` time per step and peak memory on keras.applications networks.

Each network runs in a child process (``python -m tools.bench.export_speed --worker``), so TensorFlow
never loads into the benchmark's own process and each peak is the network's own. The worker builds the
network (``weights=None``, 10 classes), quantizes it (``tf_bridge.quantize_model``), calibrates it on 8
uniform x255 samples and exports it with those samples (``strict=False``: the time is the same whatever
the verdict). Figures: the export's seconds (the steps of `tf_bridge.ExportReport.timings`
in the detail) and the peak resident memory while it ran (sampled every 20 ms, in GiB, and the rise
over the memory the process held before the export). Full run: ResNet50 at 224x224 (the memory goal
is 6 GiB) and EfficientNetB0 at 64x64; ``--quick``: a small residual CNN at 16x16.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List

from .measure import python_module, run_process
from .table import Goal, Row

NAME = "export_speed"
#: (network, input size): the full run's cases.
CASES = (("ResNet50", 224), ("EfficientNetB0", 64))
QUICK_CASES = (("small residual CNN", 16),)
#: Export peak resident memory goal for ResNet50 at 224x224 (GiB).
PEAK_GOAL_GIB = 6.0


def _rss_gib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30


class _PeakSampler:
    """The largest resident memory of this process while the block runs (sampled every 20 ms)."""

    def __enter__(self):
        self.peak = self.before = _rss_gib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_gib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_gib())


def _small_cnn(keras, size: int):
    layers = keras.layers

    def conv_bn(t):
        return layers.BatchNormalization()(layers.Conv2D(16, 3, padding="same", use_bias=False)(t))

    inputs = keras.Input((size, size, 3))
    x = layers.ReLU()(conv_bn(inputs))
    for _ in range(2):
        y = conv_bn(layers.ReLU()(conv_bn(x)))
        x = layers.ReLU()(layers.Add()([x, y]))
    return keras.Model(inputs, layers.Dense(10)(layers.GlobalAveragePooling2D()(x)))


def _worker(network: str, size: int, workdir: str) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import tf_bridge

    keras.utils.set_random_seed(0)
    if network in dict(QUICK_CASES):
        model = _small_cnn(keras, size)
    else:
        model = getattr(keras.applications, network)(weights=None, input_shape=(size, size, 3), classes=10)
    qat = tf_bridge.quantize_model(model)
    x = np.random.default_rng(0).uniform(0.0, 255.0, (8, size, size, 3)).astype(np.float32)
    tf_bridge.calibrate(qat, x, progress=False)
    out = Path(tempfile.mkdtemp(dir=workdir)) / "model.onnx"
    start = time.perf_counter()
    with _PeakSampler() as memory:
        report = tf_bridge.export_onnx(qat, out, sample_data=x, strict=False, progress=False)
    print(json.dumps({"network": network, "size": size, "seconds": time.perf_counter() - start,
                      "peak_gib": memory.peak, "before_gib": memory.before, "passed": report.passed,
                      "timings": [list(t) for t in report.timings]}))
    return 0


def _steps(timings) -> str:
    """``step 1.2 s (part 0.4 s, ...)`` for each step, its timed parts in brackets."""
    parts = {}
    for name, seconds in timings:
        if ": " in name:
            step, part = name.split(": ", 1)
            parts.setdefault(step, []).append(f"{part} {seconds:.1f} s")
    return ", ".join(f"{name} {seconds:.1f} s" + (f" ({', '.join(parts[name])})" if name in parts else "")
                     for name, seconds in timings if ": " not in name)


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the export_speed rows."""
    rows = []
    for network, size in (QUICK_CASES if quick else CASES):
        args = python_module("tools.bench.export_speed", "--worker", network, str(size), str(workdir))
        result = json.loads(run_process(args, timeout=1800).stdout.strip().splitlines()[-1])
        what = f"{network} {size}x{size}"
        rows.append(Row(NAME, f"export_onnx time, {what}", result["seconds"], None,
                        f"QAT, calibrated on 8 samples, exported with them (parity "
                        f"{'PASSED' if result['passed'] else 'not passed'}); {_steps(result['timings'])}",
                        unit="s"))
        goal = Goal("<=", PEAK_GOAL_GIB) if (network, size) == ("ResNet50", 224) else None
        rows.append(Row(NAME, f"export_onnx peak memory, {what}", result["peak_gib"], goal,
                        f"resident memory while exporting (sampled every 20 ms); "
                        f"{result['peak_gib'] - result['before_gib']:.2f} GiB over the "
                        f"{result['before_gib']:.2f} GiB held before", unit="GiB"))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.exit(_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
    sys.exit("usage: python -m tools.bench.export_speed --worker NETWORK SIZE WORKDIR")
