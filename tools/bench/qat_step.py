"""qat_step: Keras training-step time of the QAT model against the float model, and ``export_onnx`` time.

Runs in a child process (``python -m tools.bench.qat_step --worker``) so TensorFlow never loads into the
benchmark's own process. The CNN is ResNet-style (a stem, residual blocks with batch normalization,
global pooling, a Dense head); both models are compiled alike (SGD, ``jit_compile=False``) and their
``train_on_batch`` steps run interleaved after warm-up (alternating which goes first); the figure is
the median of the per-round ratios, with both medians shown. Export is timed on the
QAT version of the benchmark ResNet50 (calibrated on 8 samples), ``export_onnx`` end to end.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List

from .measure import python_module, run_process
from .table import Goal, Row, ratio

NAME = "qat_step"


def _resnet_cnn(keras, size: int, width: int, blocks: int):
    layers = keras.layers
    inputs = keras.Input((size, size, 3))
    x = layers.Conv2D(width, 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for i in range(blocks):
        y = layers.Conv2D(width, 3, padding="same", use_bias=False)(x)
        y = layers.ReLU()(layers.BatchNormalization()(y))
        y = layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        x = layers.ReLU()(layers.Add()([x, y]))
        if i % 2 == 1:
            x = layers.MaxPooling2D()(x)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(10)(x)
    return keras.Model(inputs, outputs)


def _step_times(keras, float_model, qat_model, x, y, repeats: int):
    for model in (float_model, qat_model):
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)
        for _ in range(3):
            model.train_on_batch(x, y)
    times = {"float": [], "qat": []}
    for i in range(repeats):  # interleaved, alternating which model goes first
        order = (("float", float_model), ("qat", qat_model))
        for name, model in (order if i % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            model.train_on_batch(x, y)
            times[name].append(time.perf_counter() - start)
    result = {k: statistics.median(v) for k, v in times.items()}
    # each round's two steps ran back to back: the median of their ratios cancels slower phases of
    # a shared machine that the ratio of the two medians keeps
    result["paired"] = statistics.median(q / f for q, f in zip(times["qat"], times["float"]))
    return result


def _worker(quick: bool, workdir: str) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    import tf_bridge

    keras.utils.set_random_seed(0)
    size, width, blocks, batch = (16, 16, 2, 8) if quick else (32, 32, 4, 32)
    float_model = _resnet_cnn(keras, size, width, blocks)
    qat = tf_bridge.quantize_model(float_model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, size, size, 3)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    tf_bridge.calibrate(qat, x, progress=False)
    medians = _step_times(keras, float_model, qat, x, y, 3 if quick else 25)
    result = {"float": medians["float"], "qat": medians["qat"], "paired": medians["paired"], "size": size,
              "batch": batch, "blocks": blocks}
    result.update(_export(keras, tf_bridge, quick, workdir, qat, x))
    print(json.dumps(result))
    return 0


def _export(keras, tf_bridge, quick: bool, workdir: str, small_qat, small_x) -> dict:
    try:
        export_onnx = tf_bridge.export_onnx
    except AttributeError:
        return {"export": None, "export_model": "export_onnx is not available"}
    if quick:
        qat, x, what = small_qat, small_x, "the step CNN"
    else:
        from .models import build_keras_resnet50, images

        qat = tf_bridge.quantize_model(build_keras_resnet50(96))
        x = images(8, 96, seed=5)
        tf_bridge.calibrate(qat, x, progress=False)
        what = "ResNet50 96x96 QAT"
    out = Path(tempfile.mkdtemp(dir=workdir)) / "qat.onnx"
    start = time.perf_counter()
    export_onnx(qat, out, sample_data=x, strict=False, progress=False)
    return {"export": time.perf_counter() - start, "export_model": what}


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the qat_step rows."""
    args = python_module("tools.bench.qat_step", "--worker", str(workdir)) + (["--quick"] if quick else [])
    result = json.loads(run_process(args, timeout=1500).stdout.strip().splitlines()[-1])
    what = (f"ResNet-style CNN {result['size']}x{result['size']}, {result['blocks']} residual blocks, "
            f"batch {result['batch']}")
    rows = [Row(NAME, "QAT train step / float train step", result["paired"], Goal("<=", 1.3),
                f"{what}; median of the per-round ratios (the two steps of a round run back to back, "
                f"interleaved); medians {result['qat'] * 1e3:.0f} ms vs {result['float'] * 1e3:.0f} ms "
                f"({ratio(result['qat'], result['float']):.2f}x)")]
    if result.get("export") is None:
        rows.append(Row(NAME, "export_onnx time", None, None, f"skipped: {result.get('export_model')}",
                        unit="s"))
    else:
        rows.append(Row(NAME, f"export_onnx time, {result['export_model']}", result["export"],
                        None if quick else Goal("<=", 60.0),
                        "end to end: float twin, tf2onnx, mapping, Q/DQ, parity", unit="s"))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(_worker("--quick" in sys.argv[3:], sys.argv[2]))
    sys.exit("usage: python -m tools.bench.qat_step --worker WORKDIR [--quick]")
