"""Deploy a Q/DQ ONNX model with TensorRT: gate, validate, build, time, verify.

    python tools/deploy_tensorrt.py MODEL.onnx --engine OUT.engine [options]

Steps (each a small function below, each recorded in the JSON report):

1. gate      — :func:`onnx_qat.check` (TensorRT-readiness rules); refuse unless ``--force``.
2. validate  — run the model in onnxruntime on ``--data`` (or generated inputs) and
   report the outputs' health (NaN/Inf, constant outputs, value ranges) and the
   accuracy against ``--labels``; refuse an unhealthy model unless ``--force``.
3. build     — TensorRT >= 10: strongly typed network from the ONNX parser (explicit
   quantization, no calibrator, no INT8 flag); TensorRT 8.6/9: flag-based build. FP8 and INT4
   (weight-only) Q/DQ models (``onnx-qat quantize --precision fp8|int4``) build strongly typed
   only, so they need TensorRT >= 10 and no ``--fp16``. The onnxruntime run of step 2 uses graph
   optimisations off for FP8 models (onnxruntime 1.31's QDQ fusion refuses FP8 MatMuls).
   Engine and timing cache are written atomically.
4. measure   — GPU latency (mean, median, p90, p99) and throughput with CUDA events.
5. verify    — engine outputs vs onnxruntime (max abs/rel difference, top-1
   agreement), accuracy vs labels, per-layer precision from the engine inspector
   and the Q/DQ nodes TensorRT did not fuse.

Without TensorRT or a GPU, steps 1-2 run, the report is written, and the script
stops with one line naming what is missing (exit code 2).

Exit codes: 0 success; 1 the engine was built but verification failed (parity
below ``--min-top1``/above ``--max-abs``); 2 refused, bad input or usage, or
TensorRT/GPU missing; 3 internal error; 130 interrupted.

All TensorRT and CUDA code lives in :mod:`onnx_qat.deploy.backend`, imported lazily.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np  # noqa: E402

from onnx_qat.argtypes import number_in, positive_number, whole_number  # noqa: E402
from onnx_qat.io.files import json_safe  # noqa: E402
from onnx_qat.errors import ConfigError, DataError, OutputError, QatError, TensorRTUnavailable  # noqa: E402

PROG = "deploy_tensorrt.py"
REPORT_VERSION = 1
EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

logger = logging.getLogger("onnx_qat.deploy.command")


# =========================================================================== options
@dataclass(frozen=True)
class DeployOptions:
    """Every command-line option, validated (see :func:`get_parser` for their meaning)."""

    model: Path
    engine: Path
    report: Optional[Path] = None
    data: Optional[Path] = None
    labels: Optional[str] = None
    num_samples: int = 16
    seed: int = 0
    shapes: Tuple = ()
    batch: Optional[int] = None
    fp16: bool = False
    workspace_mib: Optional[int] = None
    timing_cache: Optional[Path] = None
    iterations: int = 100
    warmup: int = 10
    min_top1: float = 0.99
    max_abs: Optional[float] = None
    skip_validation: bool = False
    force: bool = False
    progress: bool = True
    verbose: bool = False

    def to_dict(self) -> dict:
        """JSON-ready form for the report."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = str(value)
            elif f.name == "shapes":
                value = [p.to_dict() for p in value]
            out[f.name] = value
        return out


class UsageError(Exception):
    """A command-line usage problem; printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line (no usage dump)."""

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def parse_shape_spec(text: str):
    """``NAME:MIN[,OPT,MAX]`` with dims joined by ``x`` -> :class:`onnx_qat.deploy.backend.ShapeProfile`.

    One shape gives a static profile (min = opt = max). Dimensions must be whole
    numbers > 0 with min <= opt <= max in every dimension.
    """
    from onnx_qat.deploy.backend import ShapeProfile

    name, sep, dims_text = str(text).rpartition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME:MIN,OPT,MAX "
                                         f"(e.g. input:1x3x224x224,8x3x224x224,32x3x224x224)")
    parts = dims_text.split(",")
    if len(parts) not in (1, 3):
        raise argparse.ArgumentTypeError(f"{text!r}: give one shape or three (min,opt,max), not {len(parts)}")
    shapes = []
    for part in parts:
        if not re.fullmatch(r"\d+(x\d+)*", part.strip()):
            raise argparse.ArgumentTypeError(f"{text!r}: shape {part!r} is not dimensions joined by 'x' "
                                             f"(e.g. 8x3x224x224)")
        dims = tuple(int(d) for d in part.strip().split("x"))
        if any(d <= 0 for d in dims):
            raise argparse.ArgumentTypeError(f"{text!r}: dimensions must be > 0")
        shapes.append(dims)
    low, opt, high = (shapes * 3)[:3] if len(shapes) == 1 else shapes
    if not len(low) == len(opt) == len(high):
        raise argparse.ArgumentTypeError(f"{text!r}: min, opt and max shapes have different ranks")
    if any(not a <= b <= c for a, b, c in zip(low, opt, high)):
        raise argparse.ArgumentTypeError(f"{text!r}: need min <= opt <= max in every dimension")
    return ShapeProfile(name, low, opt, high)


def get_parser() -> argparse.ArgumentParser:
    """The command-line parser (no heavy imports)."""
    p = _Parser(prog=PROG, description=(
        "Gate, validate, build, time and verify a TensorRT INT8 engine from a Q/DQ ONNX model "
        "(explicit quantization). Without TensorRT or a GPU the check and onnxruntime validation "
        "still run and the report is written; the script then stops with exit code 2."),
        epilog="exit codes: 0 success, 1 engine built but verification failed, 2 refused / bad input / "
               "TensorRT or GPU missing, 3 internal error, 130 interrupted")
    p.add_argument("model", type=Path, help="the Q/DQ ONNX model (e.g. written by 'onnx-qat quantize')")
    p.add_argument("--engine", type=Path, required=True, metavar="OUT.engine",
                   help="where to write the serialized TensorRT engine (written atomically)")
    p.add_argument("--report", type=Path, metavar="REPORT.json",
                   help="write a JSON report of every step done (also when the script stops early)")
    g = p.add_argument_group("data")
    g.add_argument("--data", type=Path, metavar="DATA.npz",
                   help="inputs for validation, verification and timing: an .npz whose keys are the model's "
                        "input names, first axis = samples (default: generated random inputs)")
    g.add_argument("--labels", metavar="LABELS",
                   help="class labels for accuracy: a .npy file of integer labels (or one-hot rows), or the "
                        "name of an array inside DATA.npz")
    g.add_argument("--num-samples", type=whole_number(1), default=16, metavar="N",
                   help="number of generated input samples when no --data is given (default 16)")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0)")
    b = p.add_argument_group("build")
    b.add_argument("--shapes", type=parse_shape_spec, action="append", default=[],
                   metavar="NAME:MIN,OPT,MAX",
                   help="optimization-profile shapes of an input with dynamic dimensions, dims joined by "
                        "'x', e.g. input:1x3x224x224,8x3x224x224,32x3x224x224 (one shape = static); "
                        "repeat per input. Runs use the OPT shape's batch")
    b.add_argument("--batch", type=whole_number(1), metavar="N",
                   help="batch size when only the first dimension is dynamic: profile min 1, opt N, max N "
                        "(default: 1, or the model's fixed batch)")
    b.add_argument("--fp16", action="store_true",
                   help="let layers left unquantized run in FP16 (TensorRT >= 10: weakly typed build with "
                        "the INT8+FP16 flags instead of the strongly typed one)")
    b.add_argument("--workspace", type=whole_number(1), dest="workspace_mib", metavar="MIB",
                   help="builder workspace memory-pool limit in MiB (default: TensorRT's, the GPU's memory)")
    b.add_argument("--timing-cache", type=Path, metavar="CACHE",
                   help="timing cache file: read when it exists, written (atomically) after the build")
    m = p.add_argument_group("measure and verify")
    m.add_argument("--iterations", type=whole_number(1), default=100,
                   help="timed runs after warm-up (default 100)")
    m.add_argument("--warmup", type=whole_number(0), default=10, help="untimed warm-up runs (default 10)")
    m.add_argument("--min-top1", type=number_in(0.0, 1.0), default=0.99,
                   help="least top-1 agreement between engine and onnxruntime outputs (default 0.99)")
    m.add_argument("--max-abs", type=positive_number,
                   help="largest allowed max-abs difference between engine and onnxruntime "
                        "(default: no limit)")
    s = p.add_argument_group("control")
    s.add_argument("--skip-validation", action="store_true",
                   help="skip the onnxruntime run before the build and the engine-vs-onnxruntime comparison "
                        "(the check still runs; accuracy vs --labels is still measured on the engine)")
    s.add_argument("--force", action="store_true",
                   help="build even when the check finds errors or the onnxruntime outputs are unhealthy")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging (TensorRT's verbose log included) and tracebacks on errors")
    return p


def options_from_args(args: argparse.Namespace) -> DeployOptions:
    """Turn parsed arguments into a validated :class:`DeployOptions`."""
    names = [p.name for p in args.shapes]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise UsageError(f"argument --shapes: input {duplicated[0]!r} is given more than once")
    if args.shapes and args.batch is not None:
        raise UsageError("arguments --shapes and --batch: give the batch inside --shapes, not both")
    return DeployOptions(
        model=args.model, engine=args.engine, report=args.report, data=args.data, labels=args.labels,
        num_samples=args.num_samples, seed=args.seed, shapes=tuple(args.shapes), batch=args.batch,
        fp16=args.fp16, workspace_mib=args.workspace_mib, timing_cache=args.timing_cache,
        iterations=args.iterations, warmup=args.warmup, min_top1=args.min_top1, max_abs=args.max_abs,
        skip_validation=args.skip_validation, force=args.force, progress=not args.no_progress,
        verbose=args.verbose)


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
    """Engine output vs onnxruntime output on the same inputs."""

    name: str
    max_abs: float
    max_rel: float
    mean_abs: float
    top1: Optional[float]
    passed: bool
    reason: str = ""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return json_safe(dataclasses.asdict(self))

    def __str__(self) -> str:
        top1 = f" | top-1 {100 * self.top1:.1f}%" if self.top1 is not None else ""
        tail = f" | {self.reason}" if self.reason else ""
        return (f"{'PASSED' if self.passed else 'FAILED'} | output {self.name!r} | "
                f"max abs {self.max_abs:.3e} | max rel {self.max_rel:.3e}{top1}{tail}")


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
    version: int = REPORT_VERSION

    def to_dict(self) -> dict:
        """JSON-ready form (non-finite floats become the strings ``"NaN"``, ``"Infinity"``...)."""
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
                    min_top1: float = 0.99, max_abs: Optional[float] = None) -> Tuple[OutputParity, ...]:
    """Compare every output of ``reference`` (onnxruntime) with ``candidate`` (the engine).

    The figures are :func:`onnx_qat.runtime.compare.output_figures`' (the one comparator: ``max_rel``
    relative to ``|a|`` floored at ``REL_FLOOR`` times the largest ``|a|``; ``top1`` the fraction of
    rows whose argmax over the last axis agrees, outputs with a class axis only). An output passes
    when its top-1 agreement is at least ``min_top1`` and, when given, its max abs
    difference is at most ``max_abs``.
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
        agree = figures["top1"] if ref.size else None
        reasons = []
        if agree is not None and agree < min_top1:
            reasons.append(f"top-1 agreement {100 * agree:.1f}% < {100 * min_top1:.1f}%")
        if max_abs is not None and not figures["max_abs"] <= max_abs:
            reasons.append(f"max abs {figures['max_abs']:.3e} > {max_abs:.3e}")
        results.append(OutputParity(name, figures["max_abs"], figures["max_rel"], figures["mean_abs"], agree,
                                    not reasons, "; ".join(reasons)))
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


def resolve_profiles(specs, shapes: Sequence, batch: Optional[int]) -> Tuple[Tuple, int]:
    """Optimization profiles for the model's inputs and the batch size runs use.

    Inputs named in ``shapes`` use those; inputs whose only dynamic dimension is the
    first get min 1, opt/max ``batch`` (default 1); other dynamic inputs are an error.
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
            if any(d is None for d in dims[1:]):
                raise ConfigError(f"model input {spec.describe()} has dynamic dimensions other than the "
                                  f"batch; give its shapes with --shapes {spec.name}:MIN,OPT,MAX")
            n = batch or 1
            profile = ShapeProfile(spec.name, (1,) + tuple(dims[1:]), (n,) + tuple(dims[1:]),
                                   (n,) + tuple(dims[1:]))
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
    """Step 1: :func:`onnx_qat.check` on the model file; returns the CheckReport."""
    from onnx_qat.check import check

    return check(str(opts.model))


def run_onnxruntime(model, dataset, batch_size: int, progress: bool) -> Dict[str, np.ndarray]:
    """All outputs of ``model`` on ``dataset`` in onnxruntime (batches of ``batch_size``)."""
    from onnx_qat.runtime.sessions import run_model

    return run_model(model, dataset, batch_size=batch_size, progress=progress)


def validate(model, dataset, labels, source: str, batch_size: int, progress: bool):
    """Step 2: run the model in onnxruntime; return (:class:`Validation`, outputs)."""
    start = time.perf_counter()
    outputs = run_onnxruntime(model, dataset, batch_size, progress)
    seconds = time.perf_counter() - start
    health = tuple(output_health(name, array) for name, array in outputs.items())
    acc = accuracy(outputs, labels) if labels is not None else None
    return Validation(source, int(dataset.num_samples), batch_size, seconds, health, acc), outputs


def build(model, opts: DeployOptions, profiles):
    """Step 3: build the engine (TensorRT imported here); write engine and timing cache atomically."""
    from onnx_qat.io.files import atomic_write_bytes
    from . import backend as trt_backend

    cache = opts.timing_cache.read_bytes() if opts.timing_cache and opts.timing_cache.is_file() else None
    settings = trt_backend.BuildSettings(
        precision=trt_backend.model_precision(model), fp16=opts.fp16,
        workspace_bytes=(opts.workspace_mib << 20) if opts.workspace_mib else None,
        profiles=tuple(profiles), timing_cache=cache, verbose=opts.verbose)
    from onnx_qat.io.models import EXTERNAL_DATA_THRESHOLD

    model_bytes = model.SerializeToString() if model.ByteSize() < EXTERNAL_DATA_THRESHOLD else None
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
    print(f"{PROG}: {prefix}{message}", file=sys.stderr if code else sys.stdout)
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
    state = _Progress(report)
    try:
        model = load_model(opts.model)
        return _run_after_gate(opts, state, model, model_input_specs(model))
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


def _run_after_gate(opts: DeployOptions, state: _Progress, model, specs) -> int:
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
    result = build(model, opts, profiles)
    state.update(status="built", build=result.to_dict())
    print(f"build: {result.mode} {result.precision} engine with TensorRT {result.tensorrt_version} "
          f"on {result.device} in "
          f"{result.seconds:.1f} s -> {opts.engine}")
    return _measure_and_verify(opts, state, model, dataset, labels, reference, profiles, batch_size)


def _measure_and_verify(opts, state: _Progress, model, dataset, labels, reference, profiles,
                        batch_size) -> int:
    from . import backend as trt_backend

    min_batch = min((p.min[0] for p in profiles), default=batch_size)
    with trt_backend.EngineRunner(opts.engine.read_bytes(), verbose=opts.verbose) as runner:
        latency = measure(runner, dataset, batch_size, opts)
        print(latency)
        outputs = run_engine(runner, dataset, batch_size, max(min_batch, 1), opts.progress)
        layers = trt_backend.analyse_layers(runner.layer_information(), qdq_node_names(model))
    parity = () if reference is None else compare_outputs(reference, outputs, min_top1=opts.min_top1,
                                                          max_abs=opts.max_abs)
    for line in parity:
        print(f"parity: {line}")
    acc = {"tensorrt": accuracy(outputs, labels),
           "onnxruntime": (state.report.validation or {}).get("accuracy"),
           "num_samples": int(len(labels))} if labels is not None else None
    fp8 = f"{layers.fp8} FP8, " if layers.fp8 else ""
    print(f"layers: {layers.int8} INT8, {fp8}{layers.higher} higher precision, {layers.other} other of "
          f"{layers.total}; Q/DQ not fused: {', '.join(layers.unfused_qdq) or 'none'}")
    report = state.update(latency=latency.to_dict(), parity=[p.to_dict() for p in parity], accuracy=acc,
                          layers=layers.to_dict())
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
