"""Deploy a Q/DQ ONNX model with TensorRT: gate, validate, build, time, verify.

    python tools/deploy_tensorrt.py MODEL.onnx --engine OUT.engine [options]

Steps (each a small function below, each recorded in the JSON report):

1. gate      — [`onnx_qat.check`][onnx_qat.check.check] (TensorRT-readiness rules); refuse unless ``--force``.
The
   check's precision map (each compute node's precision under a strongly typed build) goes into
   the report. With ``--fp16`` on TensorRT >= 11 (strongly typed only, no FP16 builder flag) the
   model's float parts are converted to FP16 first ([`onnx_qat.formats.float_parts.cast_float_parts`][],
   measured on ``--data`` when given; nodes FP16 cannot serve stay FP32, with their reason), and
   every later step uses the converted model.
2. validate  — run the model in onnxruntime on ``--data`` (or generated inputs) and
   report the outputs' health (NaN/Inf, constant outputs, value ranges) and the
   accuracy against ``--labels``; refuse an unhealthy model unless ``--force``.
3. build     — TensorRT >= 10: strongly typed network from the ONNX parser (explicit
   quantization, no calibrator, no INT8 flag); TensorRT 8.6/9: flag-based build. FP8 and INT4
   (weight-only) Q/DQ models (``onnx-qat quantize --precision fp8|int4``) build strongly typed
   only, so they need TensorRT >= 10 and no ``--fp16``. The onnxruntime run of step 2 uses graph
   optimisations off for TensorRT-form Q/DQ models (exact Q/DQ arithmetic, as TensorRT computes it,
   not onnxruntime's fused integer CPU kernels; onnxruntime 1.31's QDQ fusion also refuses FP8 MatMuls).
   Engine and timing cache are written atomically.
4. measure   — GPU latency (mean, median, p90, p99) and throughput with CUDA events.
5. verify    — engine outputs vs onnxruntime (max abs/rel difference, top-1
   agreement), accuracy vs labels, per-layer precision from the engine inspector
   and the Q/DQ nodes TensorRT did not fuse; the precision map beside the inspector's layers,
   node by node (`onnx_qat.deploy.backend.compare_precisions`).

Without TensorRT or a GPU, steps 1-2 run, the report is written, and the script
stops with one line naming what is missing (exit code 2).

Exit codes: 0 success; 1 the engine was built but verification failed (parity
below ``--min-top1``/above ``--max-abs``); 2 refused, bad input or usage, or
TensorRT/GPU missing; 3 internal error; 130 interrupted.

All TensorRT and CUDA code lives in `onnx_qat.deploy.backend`, imported lazily.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np  # noqa: E402

from .options import (  # noqa: F401  (re-exported: the options are part of this command's interface)
    PROG, DeployOptions, UsageError, get_parser, options_from_args, parse_shape_spec,
)
from onnx_qat.io.files import json_safe  # noqa: E402
from onnx_qat.errors import ConfigError, DataError, OutputError, QatError, TensorRTUnavailable  # noqa: E402

REPORT_VERSION = 2  # 2: float_parts and precision (the precision map, then beside the engine's layers)
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

logger = logging.getLogger("onnx_qat.deploy.command")


# =========================================================================== typed results
@dataclass(frozen=True)
class OutputHealth:
    """Health of one model output over every sample run in onnxruntime."""

    name: str
    shape: Tuple[int, ...]
    dtype: str
    min: float
    max: float
    mean: float
    std: float
    num_nan: int
    num_inf: int
    constant: bool
    same_for_all_samples: bool
    problems: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return json_safe(dataclasses.asdict(self))

    def __str__(self) -> str:
        verdict = "UNHEALTHY" if self.problems else "ok"
        text = (f"{verdict} | output {self.name!r} {self.dtype}{list(self.shape)} | range [{self.min:.4g}, "
                f"{self.max:.4g}] | mean {self.mean:.4g} | std {self.std:.4g}")
        return text + (f" | {'; '.join(self.problems)}" if self.problems else "")


@dataclass(frozen=True)
class Validation:
    """The onnxruntime run before the build."""

    source: str
    num_samples: int
    batch_size: int
    seconds: float
    outputs: Tuple[OutputHealth, ...]
    accuracy: Optional[float] = None

    @property
    def problems(self) -> Tuple[str, ...]:
        """Every health problem of every output."""
        return tuple(f"output {o.name!r}: {p}" for o in self.outputs for p in o.problems)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"source": self.source, "num_samples": self.num_samples, "batch_size": self.batch_size,
                "seconds": round(self.seconds, 3), "healthy": not self.problems,
                "outputs": [o.to_dict() for o in self.outputs], "accuracy": self.accuracy,
                "problems": list(self.problems)}


@dataclass(frozen=True)
class Latency:
    """GPU latency of one batch (milliseconds) and the throughput it implies."""

    batch_size: int
    iterations: int
    warmup: int
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    throughput: float

    def to_dict(self) -> dict:
        """JSON-ready form (``throughput`` in samples per second)."""
        return json_safe(dataclasses.asdict(self))

    def __str__(self) -> str:
        return (f"latency (batch {self.batch_size}, {self.iterations} runs after {self.warmup} warm-up): "
                f"mean {self.mean_ms:.3f} ms | median {self.median_ms:.3f} | p90 {self.p90_ms:.3f} | "
                f"p99 {self.p99_ms:.3f} | throughput {self.throughput:.1f} samples/s")


@dataclass(frozen=True)
class OutputParity:
    """Engine output vs onnxruntime output on the same inputs. ``left_out``: values left out of the
    figures because onnxruntime's output is NaN or infinite there; ``nonfinite``: the engine's NaN or
    infinite values where onnxruntime's are finite (full errors; the output fails)
    (`onnx_qat.runtime.compare.output_figures`)."""

    name: str
    max_abs: float
    max_rel: float
    mean_abs: float
    top1: Optional[float]
    passed: bool
    reason: str = ""
    cosine: Optional[float] = None
    left_out: int = 0
    nonfinite: int = 0

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return json_safe(dataclasses.asdict(self))

    def __str__(self) -> str:
        top1 = f" | top-1 {100 * self.top1:.1f}%" if self.top1 is not None else ""
        cosine = f" | cosine {self.cosine:.5f}" if self.cosine is not None else ""
        tail = f" | {self.reason}" if self.reason else ""
        left = f" | {self.left_out} value(s) left out (onnxruntime's NaN/Inf)" if self.left_out else ""
        return (f"{'PASSED' if self.passed else 'FAILED'} | output {self.name!r} | "
                f"max abs {self.max_abs:.3e} | max rel {self.max_rel:.3e}{cosine}{top1}{left}{tail}")


@dataclass(frozen=True)
class DeployReport:
    """What the script did, step by step; written as JSON with ``--report``.

    ``status`` is the last stage reached: ``refused`` (gate or health), ``validated``
    (stopped before the build), ``tensorrt-unavailable``, ``failed``, ``built``,
    ``verified`` or ``verification-failed``.
    """

    model: str
    engine: str
    options: dict
    status: str = "started"
    exit_code: Optional[int] = None
    message: str = ""
    check: Optional[dict] = None
    validation: Optional[dict] = None
    build: Optional[dict] = None
    latency: Optional[dict] = None
    parity: Optional[list] = None
    accuracy: Optional[dict] = None
    layers: Optional[dict] = None
    float_parts: Optional[dict] = None
    precision: Optional[dict] = None
    version: int = REPORT_VERSION

    def to_dict(self) -> dict:
        """JSON-ready form (non-finite floats become the strings ``"nan"``, ``"inf"``, ``"-inf"``)."""
        return json_safe(dataclasses.asdict(self))

    def write(self, path: Optional[Path]) -> None:
        """Write the report atomically to ``path`` (nothing when ``path`` is None)."""
        if path is None:
            return
        from onnx_qat.io.files import write_json

        write_json(path, self.to_dict())


# =========================================================================== numbers (pure NumPy)
def output_health(name: str, array: np.ndarray) -> OutputHealth:
    """Figures and problems of one output over all samples (first axis = samples)."""
    values = np.asarray(array)
    as_float = values.astype(np.float64, copy=False) if values.dtype.kind in "fiub" else None
    if as_float is None or as_float.size == 0:
        return OutputHealth(name, tuple(values.shape), str(values.dtype), math.nan, math.nan, math.nan,
                            math.nan, 0, 0, False, False,
                            ("not numeric or empty",) if as_float is None or not values.size else ())
    num_nan = int(np.isnan(as_float).sum())
    num_inf = int(np.isinf(as_float).sum())
    finite = as_float[np.isfinite(as_float)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (math.nan, math.nan)
    mean, std = (float(finite.mean()), float(finite.std())) if finite.size else (math.nan, math.nan)
    constant = bool(finite.size == as_float.size and low == high)
    same = bool(values.shape[0] > 1 and not constant and np.array_equal(
        as_float, np.broadcast_to(as_float[:1], as_float.shape), equal_nan=True))
    problems = []
    if num_nan:
        problems.append(f"{num_nan} NaN value{'s' if num_nan > 1 else ''}")
    if num_inf:
        problems.append(f"{num_inf} infinite value{'s' if num_inf > 1 else ''}")
    if constant:
        problems.append(f"every value is {low:.6g} (a constant output)")
    if same:
        problems.append(f"identical for all {values.shape[0]} samples (the output ignores its input)")
    return OutputHealth(name, tuple(values.shape), str(values.dtype), low, high, mean, std, num_nan, num_inf,
                        constant, same, tuple(problems))


def has_class_axis(array: np.ndarray) -> bool:
    """An output with a class axis: rank >= 2 and a last dimension > 1."""
    return array.ndim >= 2 and array.shape[-1] > 1


def compare_outputs(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], *,
                    min_top1: float = 0.99, max_abs: Optional[float] = None, min_cosine: float = 0.99,
                    class_outputs=None) -> Tuple[OutputParity, ...]:
    """Compare every output of ``reference`` (onnxruntime) with ``candidate`` (the engine).

    The figures are `onnx_qat.runtime.compare.output_figures`' (the one comparator: ``max_rel``
    relative to ``|a|`` floored at ``REL_FLOOR`` times the largest ``|a|``). ``top1``, the fraction of
    rows whose argmax over the last axis agrees, is reported and judged only for outputs that hold
    class scores: those named in ``class_outputs`` (`onnx_qat.runtime.compare.class_score_outputs`
    of the model) and any rank-2 ``[samples, classes]`` output; on a detector's ``[N, 22, 2100]`` the
    argmax of the last axis is no class. An output passes when its cosine is at least ``min_cosine``,
    its top-1 agreement (class outputs) at least ``min_top1`` and, when given, its max abs difference
    at most ``max_abs``.
    """
    from onnx_qat.runtime.compare import output_figures

    results = []
    for name in reference:
        ref = np.asarray(reference[name], dtype=np.float64)
        if name not in candidate:
            results.append(OutputParity(name, math.inf, math.inf, math.inf, None, False,
                                        "missing from the engine"))
            continue
        got = np.asarray(candidate[name], dtype=np.float64)
        if got.shape != ref.shape:
            results.append(OutputParity(name, math.inf, math.inf, math.inf, None, False,
                                        f"shape {list(got.shape)} differs from onnxruntime's "
                                        f"{list(ref.shape)}"))
            continue
        figures = output_figures(ref, got)
        scores = ref.ndim == 2 or name in (class_outputs or ())
        agree = figures["top1"] if ref.size and scores else None
        reasons = []
        if ref.size and not figures["cosine"] >= min_cosine:
            reasons.append(f"cosine {figures['cosine']:.5f} < {min_cosine}")
        if agree is not None and agree < min_top1:
            reasons.append(f"top-1 agreement {100 * agree:.1f}% < {100 * min_top1:.1f}%")
        if max_abs is not None and not figures["max_abs"] <= max_abs:
            reasons.append(f"max abs {figures['max_abs']:.3e} > {max_abs:.3e}")
        if figures["nonfinite"]:
            reasons.append(f"{figures['nonfinite']} NaN or Inf value(s) where onnxruntime's are finite")
        results.append(OutputParity(name, figures["max_abs"], figures["max_rel"], figures["mean_abs"], agree,
                                    not reasons, "; ".join(reasons), figures["cosine"], figures["left_out"],
                                    figures["nonfinite"]))
    return tuple(results)


def accuracy(outputs: Mapping[str, np.ndarray], labels: np.ndarray) -> Optional[float]:
    """Top-1 accuracy of the first output with a class axis against integer ``labels``."""
    for array in outputs.values():
        array = np.asarray(array)
        if has_class_axis(array) and array.shape[0] == len(labels):
            predicted = array.reshape(len(labels), -1, array.shape[-1]).argmax(-1)[:, 0]
            return float(np.mean(predicted == labels))
    return None


def summarize_latency(times_ms: Sequence[float], batch_size: int, warmup: int) -> Latency:
    """Mean/median/p90/p99 of per-batch GPU times and throughput in samples per second."""
    t = np.asarray(times_ms, dtype=np.float64)
    if t.size == 0:
        raise QatError("no timed runs to summarize")
    mean = float(t.mean())
    return Latency(batch_size=batch_size, iterations=int(t.size), warmup=warmup, mean_ms=mean,
                   median_ms=float(np.median(t)), p90_ms=float(np.percentile(t, 90)),
                   p99_ms=float(np.percentile(t, 99)), min_ms=float(t.min()), max_ms=float(t.max()),
                   throughput=(batch_size * 1000.0 / mean) if mean > 0 else math.inf)


# =========================================================================== inputs, shapes, data
def check_paths(opts: DeployOptions) -> None:
    """Validate every output path before any work (engine, report, timing cache)."""
    from onnx_qat.io.files import check_output_path

    inputs = tuple(p for p in (opts.model, opts.data, _labels_path(opts)) if p is not None)
    check_output_path(opts.engine, inputs=inputs, what="--engine")
    if opts.report is not None:
        check_output_path(opts.report, inputs=inputs + (opts.engine,), what="--report")
    if opts.timing_cache is not None:
        check_output_path(opts.timing_cache,
                          inputs=inputs + (opts.engine,) + ((opts.report,) if opts.report else ()),
                          what="--timing-cache")


def _labels_path(opts: DeployOptions) -> Optional[Path]:
    if opts.labels is None:
        return None
    path = Path(opts.labels)
    return path if path.exists() or opts.data is None or path.suffix in (".npy", ".npz") else None


def resolve_profiles(specs, shapes: Sequence, batch: Optional[int],
                     data_shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> Tuple[Tuple, int]:
    """Optimization profiles for the model's inputs and the batch size runs use.

    Inputs named in ``shapes`` use those; inputs whose only dynamic dimension is the
    first get min 1, opt/max ``batch`` (default 1); inputs with other dynamic dimensions
    take them from ``data_shapes`` (one sample's shape per input, from ``--data``), else
    they are an error naming the dimensions.
    """
    from onnx_qat.deploy.backend import ShapeProfile

    by_name = {s.name: s for s in specs}
    for profile in shapes:
        _check_profile_fits(profile, by_name)
    given = {p.name: p for p in shapes}
    profiles, run_batch = [], None
    for spec in specs:
        profile = given.get(spec.name)
        dims = spec.shape
        if profile is None and dims is not None and any(d is None for d in dims):
            rest = tuple(dims[1:])
            if any(d is None for d in rest):
                rest = _rest_from_data(spec, (data_shapes or {}).get(spec.name))
            n = batch or 1
            profile = ShapeProfile(spec.name, (1,) + rest, (n,) + rest, (n,) + rest)
        elif profile is None and dims is not None and batch is not None and dims and dims[0] != batch:
            raise ConfigError(f"model input {spec.describe()} has a fixed batch of {dims[0]}; "
                              f"--batch {batch} cannot change it (export the model with a dynamic batch "
                              f"dimension)")
        if profile is not None:
            profiles.append(profile)
            run_batch = run_batch or profile.opt[0]
        elif dims:
            run_batch = run_batch or dims[0]
    return tuple(profiles), int(run_batch or 1)


def _rest_from_data(spec, sample: Optional[Tuple[int, ...]]) -> Tuple[int, ...]:
    """The non-batch dimensions of ``spec`` fixed by one data sample's shape, or a ConfigError
    naming the dynamic dimensions (by their symbolic names) when there is no data for them."""
    dynamic = ", ".join(spec.dynamic_names(1))
    if sample is None:
        raise ConfigError(f"model input {spec.describe()} has dynamic dimensions other than the batch "
                          f"({dynamic}); give --data, whose arrays fix them, or their sizes with --shapes "
                          f"{spec.name}:MIN,OPT,MAX (dims joined by 'x')")
    return tuple(int(d) for d in sample)


def sample_shapes(dataset) -> Dict[str, Tuple[int, ...]]:
    """One sample's shape per input of ``dataset`` (the batch axis left out)."""
    first = next(iter(dataset.batches(1)), {})
    return {name: tuple(np.shape(array))[1:] for name, array in first.items()}


def _check_profile_fits(profile, by_name) -> None:
    spec = by_name.get(profile.name)
    if spec is None:
        raise ConfigError(f"--shapes names {profile.name!r}, which is not a model input "
                          f"(inputs: {', '.join(by_name) or 'none'})")
    if spec.shape is None:
        return
    if len(spec.shape) != len(profile.opt):
        raise ConfigError(f"--shapes {profile.name}: rank {len(profile.opt)} differs from the model's "
                          f"{spec.describe()}")
    for axis, dim in enumerate(spec.shape):
        if dim is not None and not profile.min[axis] == profile.opt[axis] == profile.max[axis] == dim:
            raise ConfigError(f"--shapes {profile.name}: dimension {axis} is fixed to {dim} in the model "
                              f"({spec.describe()})")


def load_inputs(opts: DeployOptions, model, specs, profiles) -> Tuple[object, Optional[np.ndarray], str]:
    """The dataset to run (``--data`` or generated), the labels (or None) and its source name."""
    from ..io import data as data_mod

    if opts.data is None:
        dataset = data_mod.generate_data(_generation_specs(specs, profiles), opts.num_samples, opts.seed)
        labels = _load_labels_file(Path(opts.labels)) if opts.labels else None
        return dataset, _check_labels(labels, dataset.num_samples, opts.labels), "generated"
    labels = None
    if opts.labels is not None and _labels_path(opts) is None:
        arrays = _read_npz(opts.data)
        if opts.labels not in arrays:
            raise DataError(f"--labels {opts.labels}: no such file, and {opts.data} has no array named "
                            f"{opts.labels!r} (arrays: {', '.join(sorted(arrays))})")
        labels = arrays.pop(opts.labels)
        dataset = data_mod.load_data(arrays, model, what=str(opts.data))
    else:
        dataset = data_mod.load_data(opts.data, model)
        if opts.labels is not None:
            labels = _load_labels_file(Path(opts.labels))
    return dataset, _check_labels(labels, dataset.num_samples, opts.labels), str(opts.data)


def _generation_specs(specs, profiles):
    """Input specs whose dynamic dimensions take the profile's OPT values (batch stays free)."""
    from onnx_qat.io.models import InputSpec

    by_name = {p.name: p for p in profiles}
    out = []
    for spec in specs:
        profile = by_name.get(spec.name)
        if profile is not None:
            spec = InputSpec(spec.name, spec.dtype, (None,) + tuple(profile.opt[1:]))
        out.append(spec)
    return tuple(out)


def _read_npz(path: Path) -> Dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except FileNotFoundError:
        raise DataError(f"--data {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise DataError(
            f"--data {path} is not a readable .npz file ({str(exc).splitlines()[0][:160]})") from None


def _load_labels_file(path: Path) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"--labels {path} does not exist")
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                if len(npz.files) != 1:
                    raise DataError(f"--labels {path} holds {len(npz.files)} arrays; "
                                    f"give a .npy or a one-array .npz")
                return npz[npz.files[0]]
        return np.load(path, allow_pickle=False)
    except DataError:  # a ValueError too: keep its own message
        raise
    except (OSError, ValueError) as exc:
        raise DataError(
            f"--labels {path} is not a readable NumPy file ({str(exc).splitlines()[0][:160]})") from None


def _check_labels(labels: Optional[np.ndarray], num_samples: int, what) -> Optional[np.ndarray]:
    """Integer class labels, one per sample (one-hot rows are turned into indices)."""
    if labels is None:
        return None
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] > 1:
        labels = labels.argmax(axis=1)
    labels = labels.reshape(-1) if labels.ndim == 2 and labels.shape[1] == 1 else labels
    if labels.ndim != 1 or labels.dtype.kind not in "iub":
        raise DataError(f"--labels {what}: expected integer class labels of shape [N], got "
                        f"{labels.dtype}{list(labels.shape)}")
    if len(labels) != num_samples:
        raise DataError(f"--labels {what}: {len(labels)} labels for {num_samples} samples")
    return labels.astype(np.int64)


# =========================================================================== steps
def gate(opts: DeployOptions):
    """Step 1: [`onnx_qat.check`][onnx_qat.check.check] on the model file; returns the CheckReport."""
    from onnx_qat.check import check

    return check(str(opts.model))


def run_onnxruntime(model, dataset, batch_size: int, progress: bool) -> Dict[str, np.ndarray]:
    """All outputs of ``model`` on ``dataset`` in onnxruntime (batches of ``batch_size``)."""
    from onnx_qat.runtime.sessions import run_model

    return run_model(model, dataset, batch_size=batch_size, progress=progress)


def validate(model, dataset, labels, source: str, batch_size: int, progress: bool):
    """Step 2: run the model in onnxruntime; return (`Validation`, outputs)."""
    start = time.perf_counter()
    outputs = run_onnxruntime(model, dataset, batch_size, progress)
    seconds = time.perf_counter() - start
    health = tuple(output_health(name, array) for name, array in outputs.items())
    acc = accuracy(outputs, labels) if labels is not None else None
    return Validation(source, int(dataset.num_samples), batch_size, seconds, health, acc), outputs


def build(model, opts: DeployOptions, profiles, converted: bool = False):
    """Step 3: build the engine (TensorRT imported here); write engine and timing cache atomically.
    ``converted``: ``model`` is no longer the file's (its float parts were converted)."""
    from onnx_qat.io.files import atomic_write_bytes
    from . import backend as trt_backend

    cache = opts.timing_cache.read_bytes() if opts.timing_cache and opts.timing_cache.is_file() else None
    settings = trt_backend.BuildSettings(
        precision=trt_backend.model_precision(model), fp16=opts.fp16,
        workspace_bytes=(opts.workspace_mib << 20) if opts.workspace_mib else None,
        profiles=tuple(profiles), timing_cache=cache, verbose=opts.verbose)
    from onnx_qat.io.models import EXTERNAL_DATA_THRESHOLD

    model_bytes = model.SerializeToString() if model.ByteSize() < EXTERNAL_DATA_THRESHOLD else None
    if model_bytes is None and converted:
        raise ConfigError(f"{opts.model} is over 2 GB: its FP16 float parts cannot be handed to TensorRT "
                          "in memory; write them first (onnx-qat quantize --float-dtype fp16) and deploy "
                          "that model without --fp16")
    result = trt_backend.build_engine(model_bytes, str(opts.model), settings)
    atomic_write_bytes(opts.engine, result.engine)
    if opts.timing_cache is not None and result.timing_cache:
        atomic_write_bytes(opts.timing_cache, result.timing_cache)
    return result


def _fixed_batches(dataset, batch_size: int, min_batch: int):
    """Feeds of ``batch_size`` samples; a short last batch is padded to ``min_batch`` by repeating
    its last sample. Yields (feed, number of real samples)."""
    for feed in dataset.batches(batch_size):
        n = len(next(iter(feed.values())))
        if n < min_batch:
            feed = {k: np.concatenate([v, np.repeat(v[-1:], min_batch - n, axis=0)]) for k, v in feed.items()}
        yield feed, n


def run_engine(runner, dataset, batch_size: int, min_batch: int,
               progress: bool = False) -> Dict[str, np.ndarray]:
    """Every engine output on ``dataset``, concatenated over batches in sample order."""
    from tqdm import tqdm

    parts: Dict[str, List[np.ndarray]] = {}
    batches = tqdm(_fixed_batches(dataset, batch_size, min_batch), total=dataset.num_batches(batch_size),
                   desc="tensorrt", unit="batch", disable=not progress, leave=False, file=sys.stderr)
    for feed, n in batches:
        for name, array in runner.infer(feed).items():
            parts.setdefault(name, []).append(array[:n])
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}


def timing_feed(dataset, batch_size: int) -> Dict[str, np.ndarray]:
    """One batch of exactly ``batch_size`` samples (samples repeated when there are fewer)."""
    first = next(iter(dataset.batches(batch_size)))
    n = len(next(iter(first.values())))
    reps = -(-batch_size // n)
    return {k: np.concatenate([v] * reps)[:batch_size] for k, v in first.items()}


def measure(runner, dataset, batch_size: int, opts: DeployOptions) -> Latency:
    """Step 4: GPU latency and throughput at the run batch size."""
    times = runner.time(timing_feed(dataset, batch_size), opts.iterations, opts.warmup)
    return summarize_latency(times, batch_size, opts.warmup)


def qdq_node_names(model) -> Tuple[str, ...]:
    """Names of the model's QuantizeLinear/DequantizeLinear nodes (main graph)."""
    return tuple(n.name for n in model.graph.node
                 if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.name)


# =========================================================================== orchestration
def _print_check(report) -> None:
    for finding in report.findings:
        stream = sys.stderr if finding.severity == "error" else sys.stdout
        print(f"  {finding}", file=stream)
    print(f"check: {report.summary()}")


def _stop(report: DeployReport, opts: DeployOptions, status: str, code: int, message: str) -> int:
    report = dataclasses.replace(report, status=status, exit_code=code, message=message)
    report.write(opts.report)
    prefix = "error: " if code == EXIT_USAGE and status != "tensorrt-unavailable" else ""
    print(f"{opts.prog}: {prefix}{message}", file=sys.stderr if code else sys.stdout)
    return code


def run(opts: DeployOptions) -> int:
    """Run every step with ``opts``; return the exit code (see the module docstring)."""
    from onnx_qat.io.models import load_model, model_input_specs

    check_paths(opts)
    report = DeployReport(model=str(opts.model), engine=str(opts.engine), options=opts.to_dict())
    checked = gate(opts)
    report = dataclasses.replace(report, check=checked.to_dict())
    _print_check(checked)
    if not checked.passed and not opts.force:
        rules = ", ".join(sorted({f.rule for f in checked.errors}, key=lambda r: (len(r), r)))
        return _stop(report, opts, "refused", EXIT_USAGE,
                     f"{opts.model} is not TensorRT-ready (check rules {rules}); fix the findings above or "
                     f"pass --force to build anyway")
    if not checked.quantized and not opts.allow_float:
        return _stop(report, opts, "refused", EXIT_USAGE,
                     f"{opts.model} has no Q/DQ nodes (check rule C13), so TensorRT would build a float "
                     f"engine; quantize it first ('onnx-qat quantize') or pass --allow-float")
    state = _Progress(report)
    try:
        model = load_model(opts.model)
        return _run_after_gate(opts, state, model, model_input_specs(model), checked.precision_map)
    except TensorRTUnavailable as exc:
        done = "check done" if opts.skip_validation else "check and onnxruntime validation done"
        return _stop(state.report, opts, "tensorrt-unavailable", EXIT_USAGE,
                     f"stopped before the build "
                     f"({done}{', report ' + str(opts.report) if opts.report else ''}): {exc}")
    except QatError as exc:
        _stop(state.report, opts, "failed", EXIT_USAGE, str(exc))
        raise _AlreadyReported() from exc
    except Exception as exc:  # a bug: keep what was done in the report, then let main() print one line
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        state.update(status="failed", exit_code=EXIT_INTERNAL,
                     message=f"internal error: {type(exc).__name__}: {first}").write(opts.report)
        raise


class _AlreadyReported(Exception):
    """The error was printed and written to the report already."""


class _Progress:
    """The report as far as the run got (updated after every step, read when a step fails)."""

    def __init__(self, report: DeployReport):
        self.report = report

    def update(self, **changes) -> DeployReport:
        """Replace fields of the report and return it."""
        self.report = dataclasses.replace(self.report, **changes)
        return self.report


def convert_float_parts(model, opts: DeployOptions, tensorrt_version: str):
    """``--fp16`` on TensorRT >= 11: the model with its float parts in FP16
    ([`onnx_qat.formats.float_parts.cast_float_parts`][], measured on ``--data`` when given); returns
    ``(model, FloatPartsResult)``."""
    from ..formats.float_parts import cast_float_parts

    result = cast_float_parts(model, "fp16", data=str(opts.data) if opts.data is not None else None,
                              progress=opts.progress)
    kept = ", ".join(str(k) for k in result.kept[:5]) + (" ..." if len(result.kept) > 5 else "")
    print(f"float parts: converted to FP16 for TensorRT {tensorrt_version}'s strongly typed build; "
          f"{len(result.kept)} node(s) kept FP32" + (f" ({kept})" if kept else ""))
    return result.model, result


def precision_of(model):
    """The precision map of ``model`` (`onnx_qat.check.CheckReport.precision_map`)."""
    from onnx_qat.check import check

    return check(model).precision_map


def _precision_dict(pmap) -> dict:
    """The report's ``precision`` entry before the build: counts, FP32 weighted ops, unfused Q/DQ."""
    return {"counts": pmap.counts(), "fp32_weighted": [e.to_dict() for e in pmap.fp32_compute(True)],
            "unfused_qdq": [u.to_dict() for u in pmap.unfused]}


def _run_after_gate(opts: DeployOptions, state: _Progress, model, specs, pmap) -> int:
    from . import backend as trt_backend

    version = trt_backend.installed_tensorrt_version() if opts.fp16 else None
    if trt_backend.converts_float_parts(version, opts.fp16):
        model, converted = convert_float_parts(model, opts, version)
        pmap = precision_of(model)
        state.update(float_parts=converted.to_dict())
    state.update(precision=_precision_dict(pmap))
    print(pmap.summary())
    fp32 = pmap.counts().get("fp32", 0)
    if fp32 and not opts.fp16:  # the principal cost of a Q/DQ model under TensorRT 11: say the remedy
        print(f"note: {fp32} compute node(s) run in FP32 under a strongly typed build (TensorRT 11 builds no "
              "other kind); --fp16 runs those FP16 can serve in FP16 (TensorRT >= 11: the float parts "
              "converted before the build; 8.6-10: the FP16 builder flag), as quantizing with --float-dtype "
              "fp16 does")
    if opts.data is not None:  # the data's arrays fix the dimensions --shapes does not give
        dataset, labels, source = load_inputs(opts, model, specs, ())
        profiles, batch_size = resolve_profiles(specs, opts.shapes, opts.batch, sample_shapes(dataset))
    else:
        profiles, batch_size = resolve_profiles(specs, opts.shapes, opts.batch)
        dataset, labels, source = load_inputs(opts, model, specs, profiles)
    reference = None
    if not opts.skip_validation:
        validation, reference = validate(model, dataset, labels, source, batch_size, opts.progress)
        report = state.update(validation=validation.to_dict())
        for health in validation.outputs:
            print(f"onnxruntime: {health}")
        if validation.accuracy is not None:
            print(f"onnxruntime: accuracy {100 * validation.accuracy:.2f}% "
                  f"on {validation.num_samples} samples")
        if validation.problems and not opts.force:
            return _stop(report, opts, "refused", EXIT_USAGE,
                         f"onnxruntime outputs of {opts.model} are unhealthy ({validation.problems[0]}); "
                         f"pass --force to build anyway")
    state.update(status="validated").write(opts.report)
    result = build(model, opts, profiles, converted=state.report.float_parts is not None)
    state.update(status="built", build=result.to_dict())
    print(f"build: {result.mode} {result.precision} engine with TensorRT {result.tensorrt_version} "
          f"on {result.device} in "
          f"{result.seconds:.1f} s -> {opts.engine}")
    return _measure_and_verify(opts, state, model, dataset, labels, reference, profiles, batch_size, pmap)


def _measure_and_verify(opts, state: _Progress, model, dataset, labels, reference, profiles,
                        batch_size, pmap) -> int:
    from . import backend as trt_backend

    min_batch = min((p.min[0] for p in profiles), default=batch_size)
    with trt_backend.EngineRunner(opts.engine.read_bytes(), verbose=opts.verbose) as runner:
        latency = measure(runner, dataset, batch_size, opts)
        print(latency)
        outputs = run_engine(runner, dataset, batch_size, max(min_batch, 1), opts.progress)
        info = runner.layer_information()
        layers = trt_backend.analyse_layers(info, qdq_node_names(model))
        beside = trt_backend.compare_precisions(pmap, info)
    from onnx_qat.runtime.compare import class_score_outputs

    parity = () if reference is None else compare_outputs(reference, outputs, min_top1=opts.min_top1,
                                                          max_abs=opts.max_abs, min_cosine=opts.min_cosine,
                                                          class_outputs=class_score_outputs(model))
    for line in parity:
        print(f"parity: {line}")
    acc = {"tensorrt": accuracy(outputs, labels),
           "onnxruntime": (state.report.validation or {}).get("accuracy"),
           "num_samples": int(len(labels))} if labels is not None else None
    fp8 = f"{layers.fp8} FP8, " if layers.fp8 else ""
    print(f"layers: {layers.int8} INT8, {fp8}{layers.higher} higher precision, {layers.other} other of "
          f"{layers.total}; Q/DQ not fused: {', '.join(layers.unfused_qdq) or 'none'}")
    print(beside.summary())
    report = state.update(latency=latency.to_dict(), parity=[p.to_dict() for p in parity], accuracy=acc,
                          layers=layers.to_dict(),
                          precision={**(state.report.precision or {}), "engine": beside.to_dict()})
    if reference is None:
        return _stop(report, opts, "built", EXIT_OK,
                     f"engine {opts.engine} built; not compared with onnxruntime (--skip-validation)")
    if all(p.passed for p in parity):
        return _stop(report, opts, "verified", EXIT_OK, f"engine {opts.engine} built and verified")
    failed = next(p for p in parity if not p.passed)
    return _stop(report, opts, "verification-failed", EXIT_PROBLEMS,
                 f"engine {opts.engine} differs from onnxruntime: output {failed.name!r} {failed.reason}")


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")


def run_reported(opts: DeployOptions) -> int:
    """`run`, with an error it already printed and reported turned into exit code 2 (what
    ``onnx-qat deploy`` calls; other errors propagate to the caller's handler)."""
    try:
        return run(opts)
    except _AlreadyReported as exc:
        if opts.verbose:
            traceback.print_exception(exc.__cause__)
        return EXIT_USAGE


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: parse ``argv`` (default ``sys.argv[1:]``), run, return the exit code."""
    parser = get_parser()
    verbose = False
    try:
        args = parser.parse_args(argv)
        verbose = args.verbose
        opts = options_from_args(args)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _configure_logging(verbose)
    try:
        return run(opts)
    except _AlreadyReported as exc:
        if verbose:
            traceback.print_exception(exc.__cause__)
        return EXIT_USAGE
    except (QatError, OutputError) as exc:
        if verbose:
            traceback.print_exc()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; no partial output was left", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug: one line unless --verbose
        if verbose:
            traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(f"{PROG}: internal error: {type(exc).__name__}: {first[:300]} (re-run with --verbose for the "
              f"traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
