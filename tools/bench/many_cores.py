"""many_cores: the CPU target and the worker pool on a many-core server, in one bounded run.

``python -m tools.bench.many_cores --out DIR [--workdir W] [--threads 16 4] [--batches 1 8] [--workers 1 16 4]
[--models resnet50 mobilenet_v2 ...] [--onnx LABEL=PATH ...] [--detector ONNX --detector-data NPZ]
[--budget SECONDS]``

Where `cpu_models` and `workers` measure on the 2-core development machine, this run gives their
figures on a many-core server (the machine class of issue 29's first table: AVX-512 VNNI and AMX,
16 cores) within a fixed time budget, writing ``results.md``/``results.json`` after every step so
that a run cut short still leaves what it measured.

Models:

* the torchvision architectures of that table (``resnet50``, ``mobilenet_v2``, ``efficientnet_b0``,
  ``convnext_tiny``, ``vit_b_16``; ``weights=None``, torchvision's own random initialization, seed 0;
  exported with ``torch.onnx.export`` at opset 17, or the dynamo exporter at 18 where the other
  is gone, with a symbolic batch) when torch is importable;
  inputs: uniform images normalized with ImageNet's mean and deviation, 16 to calibrate, 8 to test;
* any ONNX model given with ``--onnx LABEL=PATH`` (first input; random normalized images of its
  shape);
* the real PP-OCRv4 text detector with ``--detector`` and its inputs in ``--detector-data`` (an
  ``.npz`` with ``calib`` and ``eval`` arrays, NCHW, as `tools.bench.sensitivity` makes them).

Per model, thread count (``--threads``, in that order) and batch (1 and 8): our ``ort-cpu`` form placed
for that deployment (``onnx_qat.quantize(target="ort-cpu", method="max",
latency=LatencyOptions(threads=T, batch=B))``, as ``--latency-threads T --latency-batch B`` place it;
the profile is kept per thread count in the work directory, so its first-run cost is in the row, with
the product's own whole-model verdict), onnxruntime's ``quantize_static`` uint8 form (made once per
model) and FP32, timed at that batch in rounds with the order rotated (`interleaved_rounds`, at least
`MIN_ROUNDS`); each ratio is the median of per-round ratios with its 95% interval (a goal row whose
interval holds 1.0 is a ``TIE``). The error of both quantized forms against FP32 (mean absolute
difference over the test inputs as a fraction of FP32's output range) is given once per model.

Worker pool (``--workers``, needs the detector): ``onnx_qat.sensitivity`` on the detector with each
worker count in turn, wall and CPU time, the speed-up over one worker, whether the figures are
identical, and the workers' peak resident memory (`workers.WorkerMemory`).

Order: the detector, then the other models in the order given, at the first thread count; then the
worker pool; then the other thread counts. A step that would start after ``--budget`` seconds is a
SKIP row saying so.
"""
from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .measure import interleaved_rounds, median_interval, paired_ratio
from .table import Goal, Row, ratio, skip, write_results

NAME = "many_cores"
TORCHVISION = ("resnet50", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "vit_b_16")
BATCHES = (1, 8)
CALIB_SAMPLES, TEST_SAMPLES = 16, 8
MIN_ROUNDS, MAX_ROUNDS, ROUND_SECONDS = 5, 15, 12.0
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1)
logger = logging.getLogger(__name__)


def torchvision_onnx(name: str, path: Path) -> Path:
    """Export ``torchvision.models.<name>(weights=None)`` (seed 0, eval mode) to ``path`` at opset 17."""
    if path.exists():
        return path
    import torch
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    model.train(False)  # inference mode: batch normalization from its running statistics
    example = torch.zeros(1, 3, 224, 224)
    tmp = path.with_suffix(".tmp.onnx")
    names = dict(input_names=["input"], output_names=["logits"])
    with torch.no_grad():
        try:  # the TorchScript exporter, where this torch still has it
            torch.onnx.export(model, (example,), str(tmp), opset_version=17, dynamo=False,
                              dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}}, **names)
        except Exception:  # noqa: BLE001 - then the dynamo exporter (opset 18, its lowest), batch symbolic
            logger.warning("torch.onnx.export(dynamo=False) failed for %s; trying dynamo=True", name,
                           exc_info=True)
            batch = torch.export.Dim("N", max=64)  # an example batch of 2: 1 would be specialized
            torch.onnx.export(model, (torch.zeros(2, 3, 224, 224),), str(tmp), opset_version=18, dynamo=True,
                              external_data=False, dynamic_shapes=({0: batch},), **names)
    tmp.replace(path)
    return path


def normalized_images(num: int, shape: Sequence[int], seed: int) -> np.ndarray:
    """``num`` uniform images of ``shape`` (C, H, W), normalized with ImageNet's statistics when C is 3."""
    data = np.random.default_rng(seed).uniform(0, 1, (num, *shape)).astype(np.float32)
    if shape[0] == 3:
        data = (data - IMAGENET_MEAN) / IMAGENET_STD
    return data.astype(np.float32)


def _input_of(path: Path) -> Tuple[str, Tuple[int, ...]]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    first = model.graph.input[0]
    dims = [d.dim_value if d.dim_value > 0 else 224 for d in first.type.tensor_type.shape.dim][1:]
    return first.name, tuple(dims)


def _speed_rows(label: str, threads: int, batch: int, sessions: Dict[str, object], feed: dict,
                load: str) -> List[Row]:
    runs = {k: (lambda s=s: s.run(None, feed)) for k, s in sessions.items()}
    times = interleaved_rounds(runs, min_rounds=MIN_ROUNDS, max_rounds=MAX_ROUNDS, seconds=ROUND_SECONDS,
                               warmup=1)
    ms = {k: 1e3 * median_interval(v)[0] for k, v in times.items()}
    pairs = (("fp32", "ours"), ("ours", "ort"), ("fp32", "ort"))
    found = {pair: paired_ratio(times, *pair) for pair in pairs}
    detail = (f"{threads} threads, batch {batch}, {len(times['fp32'])} rounds (order rotated), medians: "
              f"FP32 {ms['fp32']:.2f} ms, ort-cpu {ms['ours']:.2f} ms, onnxruntime uint8 {ms['ort']:.2f} ms; "
              f"{load}")
    what = {("fp32", "ours"): ("ort-cpu speed-up over FP32", Goal(">=", 1.0)),
            ("ours", "ort"): ("ort-cpu time / onnxruntime uint8 form", Goal("<=", 1.0)),
            ("fp32", "ort"): ("onnxruntime uint8 form speed-up over FP32", None)}
    return [Row(NAME, f"{label}: {what[key][0]}, {threads} threads, batch {batch}", mid, what[key][1], detail,
                interval=(low, high)) for key, (mid, low, high) in found.items()]


def measure_model(label: str, path: Path, name: str, calib: np.ndarray, test: np.ndarray, threads: int,
                  workdir: Path, errors: bool, batches: Sequence[int] = BATCHES) -> List[Row]:
    """The rows of one model at one thread count: per batch, our form placed for that batch
    (``LatencyOptions(batch=B)``, as ``--latency-batch B`` places it for a deployment at batch B) and
    timed against FP32 and onnxruntime's form at that batch; and (``errors``) the error rows, of the
    form placed for the first batch."""
    import onnx_qat
    from onnx_qat.errors import PlacementError
    from onnx_qat.placement.cpu_latency import LatencyOptions

    from .cpu_models import _ort_uint8, _outputs, _session

    theirs = _ort_uint8(path, workdir / f"{path.stem}_ort_u8.onnx", name, calib)
    fp32, ort_form = _session(path, threads), _session(theirs, threads)
    rows: List[Row] = []
    first = None
    for batch in batches:
        options = LatencyOptions(profile=str(workdir / f"latency_profile_{threads}.json"), threads=threads,
                                 batch=batch)
        start = time.perf_counter()
        try:
            ours = onnx_qat.quantize(str(path), data={name: calib}, method="max", target="ort-cpu",
                                     progress=False, latency=options)
        except PlacementError as exc:  # every site faster in float: the FP32 model is the CPU form
            rows.append(Row(NAME, f"{label}: ort-cpu speed-up over FP32, {threads} threads, batch {batch}",
                            1.0, Goal(">=", 1.0), f"nothing quantized, the FP32 model kept: {exc}"))
            continue
        quantize_s = time.perf_counter() - start
        sessions = {"fp32": fp32, "ours": _session(ours.model, threads), "ort": ort_form}
        first = first or sessions["ours"]
        load = "load {:.1f}/{:.1f}/{:.1f}".format(*os.getloadavg())
        latency = ours.latency or {}
        whole = latency.get("whole_model", {})
        verdict = (f"its own timing: {whole.get('speedup', '-')}x FP32, {whole.get('verdict', '-')}"
                   if whole.get("timed") else "not timed")
        kept, sites = len(latency.get("kept_float", [])), len(latency.get("sites", []))
        rows.append(Row(NAME, f"{label}: quantize placed for batch {batch}, {threads} threads", quantize_s,
                        None, f"{kept} of {sites} sites kept float for speed; whole model: "
                        f"{whole.get('chosen', '-')} ({whole.get('source', '-')}; {verdict}); "
                        f"cpu_vnni {ours.ort_cpu['cpu_vnni']}", unit="s"))
        feed = {name: np.concatenate([test] * (1 + batch // len(test)))[:batch]}
        rows += _speed_rows(label, threads, batch, sessions, feed, load)
    if errors and first is not None:
        ref = _outputs(fp32, name, test)
        spread = float(ref.max() - ref.min()) or 1.0
        err_ours = float(np.abs(_outputs(first, name, test) - ref).mean()) / spread
        err_ort = float(np.abs(_outputs(ort_form, name, test) - ref).mean()) / spread
        rows.append(Row(NAME, f"{label}: ort-cpu error / onnxruntime uint8 form error",
                        ratio(err_ours, err_ort) if err_ort > 0 else float("nan"), Goal("<=", 1.0),
                        f"mean |output - FP32| / FP32 output range over {len(test)} samples: "
                        f"ort-cpu {err_ours:.4g}, onnxruntime {err_ort:.4g}"
                        + (" (the FP32 outputs do not vary: no error to compare)" if spread == 1.0 and
                           float(ref.max() - ref.min()) == 0 else "")))
    return rows


def worker_rows(path: Path, calib: dict, evaluation: dict, counts: Sequence[int],
                deadline: float) -> List[Row]:
    """``onnx_qat.sensitivity`` on ``path`` with each worker count in ``counts`` (the first is the base)."""
    import onnx_qat

    from .workers import WorkerMemory

    rows: List[Row] = []
    base = None
    for count in counts:
        if time.perf_counter() > deadline:
            rows.append(skip(NAME, f"sensitivity with {count} workers", "over the run's --budget"))
            continue
        before = os.getloadavg()[0]
        cpu, wall = _children_cpu(), time.perf_counter()
        with WorkerMemory() as memory:
            result = onnx_qat.sensitivity(str(path), calib, eval_data=evaluation, progress=False,
                                          workers=count)
        wall = time.perf_counter() - wall
        cpu = _children_cpu() - cpu
        figures = [s.only.cosine for s in result.sites]
        if base is None:
            base = (count, wall, figures)
        same = figures == base[2]
        rows.append(Row(NAME, f"sensitivity, detector, {count} workers: speed-up over {base[0]} worker(s)",
                        ratio(base[1], wall), None,
                        f"wall {wall:.1f} s, CPU {cpu:.1f} s (this process and its workers), "
                        f"{len(result)} sites, {result.runs} runs; figures identical to {base[0]} worker(s): "
                        f"{'yes' if same else 'NO'}; {memory.summary()}; load {before:.1f}->"
                        f"{os.getloadavg()[0]:.1f}"))
    return rows


def _children_cpu() -> float:
    """CPU seconds of this process and of its children waited for (the pool's workers, once closed)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def get_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.many_cores",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for results.md and results.json")
    parser.add_argument("--workdir", default="many_cores_work", help="models, quantized forms, profiles")
    parser.add_argument("--threads", type=int, nargs="+", default=[16, 4],
                        help="onnxruntime intra-op threads")
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 16, 4],
                        help="worker counts (first: base)")
    parser.add_argument("--models", nargs="*", default=list(TORCHVISION), choices=TORCHVISION,
                        help="torchvision architectures (needs torch)")
    parser.add_argument("--onnx", action="append", default=[], metavar="LABEL=PATH",
                        help="a further ONNX model")
    parser.add_argument("--detector", default=None, help="the PP-OCRv4 detector (.onnx)")
    parser.add_argument("--detector-data", default=None, help=".npz with 'calib' and 'eval' (NCHW)")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="batch sizes")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds after which no step starts")
    return parser


def main(argv=None) -> int:
    args = get_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    start = time.perf_counter()
    deadline = start + args.budget
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    command = "python -m tools.bench.many_cores " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    rows: List[Row] = []

    def flush():
        write_results(rows, args.out, command=command, quick=False, seconds=time.perf_counter() - start)

    cases: List[Tuple[str, object]] = []
    for model in args.models:
        cases.append((f"torchvision {model}",
                      lambda m=model: (torchvision_onnx(m, workdir / f"tv_{m}.onnx"), None)))
    for item in args.onnx:
        label, _, path = item.partition("=")
        cases.append((label, lambda p=path: (Path(p), None)))
    detector: Optional[Tuple[Path, dict, dict]] = None
    if args.detector and args.detector_data:
        with np.load(args.detector_data, allow_pickle=False) as data:
            calib, evaluation = data["calib"].astype(np.float32), data["eval"].astype(np.float32)
        detector = (Path(args.detector), {"x": calib}, {"x": evaluation})
        given = (calib, evaluation[:TEST_SAMPLES])
        cases.insert(0, ("PP-OCRv4 detector (real)", lambda: (Path(args.detector), given)))

    def models_at(threads: int, errors: bool):
        for label, make in cases:
            if time.perf_counter() > deadline:
                rows.append(skip(NAME, f"{label}: {threads} threads", "over the run's --budget"))
                continue
            t0 = time.perf_counter()
            try:
                path, given = make()
                name, shape = _input_of(path)
                calib, test = given or (normalized_images(CALIB_SAMPLES, shape, 1),
                                        normalized_images(TEST_SAMPLES, shape, 2))
                rows.extend(measure_model(label, path, name, calib, test, threads, workdir, errors,
                                          batches=args.batches))
            except Exception as exc:  # noqa: BLE001 - one model failing gives a SKIP row; the others run
                logger.warning("%s: %s failed", NAME, label, exc_info=True)
                rows.append(skip(NAME, f"{label}: {threads} threads", f"{type(exc).__name__}: {exc}"[:200]))
            print(f"[many_cores] {label}, {threads} threads: {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
            flush()

    models_at(args.threads[0], errors=True)
    if detector is not None and args.workers:
        t0 = time.perf_counter()
        rows.extend(worker_rows(detector[0], detector[1], detector[2], args.workers, deadline))
        print(f"[many_cores] workers: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        flush()
    for threads in args.threads[1:]:
        models_at(threads, errors=False)
    flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
