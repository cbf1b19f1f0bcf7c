"""float_parts: what ``--float-dtype fp16`` adds to ``onnx-qat quantize --data`` on ResNet50.

Each pair of commands runs as whole processes on the same model and calibration data, in turn, the
least disturbed run of each counting: with the default calibration (``auto``; the goal, one run each)
and with ``--method max`` (the fastest calibration, where the conversion's share is largest; two
runs each, no goal). The FP16 run converts the Q/DQ model
([`onnx_qat.formats.float_parts.cast_float_parts`][]) and measures it on 4 samples spread over the data
(ranges of every float tensor, the output cosine of the float model, of the FP32 and of the FP16
float parts). Its report gives the cosines and the nodes kept FP32; the float bytes are the written
models' float initializers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import numpy as np

from . import models
from .measure import python_module, run_process
from .table import Goal, Row, ratio

NAME = "float_parts"
SIZE = 224
SAMPLES = 32


def _prepare(workdir: Path, quick: bool):
    import onnx

    if quick:
        path = workdir / "tiny_cnn.onnx"
        onnx.save(models.tiny_cnn(), str(path))
        data = {"input": np.random.default_rng(1).standard_normal((16, 16, 16, 16)).astype(np.float32)}
    else:
        path = models.resnet50(workdir / f"resnet50_{SIZE}.onnx", SIZE)
        data = {models.RESNET_INPUT: models.images(SAMPLES, SIZE, seed=1)}
    npz = workdir / f"{path.stem}_calib.npz"
    np.savez(npz, **data)
    return path, npz


def _pair(workdir: Path, path: Path, npz: Path, method: Optional[str], repeats: int):
    """Best seconds of the FP32 and FP16 commands, and the two output paths."""
    tag = method or "default"
    outputs, commands = {}, {}
    for dtype in ("fp32", "fp16"):
        outputs[dtype] = workdir / f"{path.stem}_{tag}_{dtype}"
        args = ["quantize", str(path), "--data", str(npz), "-o", f"{outputs[dtype]}.onnx", "--float-dtype",
                dtype, "--report", f"{outputs[dtype]}.json", "--no-progress", "-q"]
        commands[dtype] = python_module("onnx_qat", *args, *(["--method", method] if method else []))
    runs = {k: [] for k in commands}
    for _ in range(repeats):
        for dtype, cmd in commands.items():
            runs[dtype].append(run_process(cmd))
    return {k: min(r.seconds for r in v) for k, v in runs.items()}, outputs


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the float_parts rows."""
    workdir = Path(workdir)
    path, npz = _prepare(workdir, quick)
    label = "tiny CNN" if quick else f"ResNet50 {SIZE}x{SIZE}"
    samples = 16 if quick else SAMPLES
    default, outputs = _pair(workdir, path, npz, None, 1)
    fast, _ = _pair(workdir, path, npz, "max", 1 if quick else 2)
    report = json.loads(outputs["fp16"].with_suffix(".json").read_text())["float_parts"]
    measured = next(iter(report["measurement"]["outputs"].values()))
    sizes = {k: _float_bytes(v.with_suffix(".onnx")) for k, v in outputs.items()}
    return [
        Row(NAME, f"quantize --float-dtype fp16 / fp32, time, {label}",
            ratio(default["fp16"], default["fp32"]), Goal("<=", 1.2),
            f"whole process, default calibration (auto), {samples} samples: "
            f"{default['fp16']:.1f} s vs {default['fp32']:.1f} s"),
        Row(NAME, f"the same with --method max, {label} (no goal)", ratio(fast["fp16"], fast["fp32"]), None,
            f"best of {1 if quick else 2}: {fast['fp16']:.1f} s vs {fast['fp32']:.1f} s"),
        Row(NAME, f"float parts' bytes fp16 / fp32, {label}", ratio(sizes["fp16"], sizes["fp32"]),
            Goal("<=", 0.55), f"float initializers {sizes['fp16'] / 2**10:.0f} KiB vs "
                              f"{sizes['fp32'] / 2**10:.0f} KiB (the INT8 weights are the same in both)"),
        Row(NAME, f"output cosine drop fp16 vs fp32 float parts, {label}",
            measured["cosine_fp32"] - measured["cosine"], Goal("<=", 0.002),
            f"cosine against the float model {measured['cosine']:.5f} vs {measured['cosine_fp32']:.5f} "
            f"({report['measurement']['samples']} samples); {len(report['kept_fp32'])} nodes kept FP32",
            unit=""),
    ]


def _float_bytes(path: Path) -> int:
    """Bytes of the float (FP32, FP16, BF16) initializers of the model at ``path``."""
    import onnx

    model = onnx.load(str(path))
    sizes = {1: 4, 10: 2, 16: 2}
    return sum(int(np.prod(t.dims, dtype=np.int64)) * sizes[t.data_type] for t in model.graph.initializer
               if t.data_type in sizes)
