"""The options of ``onnx-qat deploy`` (and of the old ``tools/deploy_tensorrt.py`` command line):
the argument definitions, their validation and `DeployOptions`.

Kept apart from `onnx_qat.deploy.command` so that ``onnx-qat --help`` builds the ``deploy``
subcommand's parser without importing NumPy, onnx or TensorRT.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple

from ..argtypes import number_in, positive_number, whole_number

PROG = "deploy_tensorrt.py"
DESCRIPTION = (
    "Gate, validate, build, time and verify a TensorRT engine from a Q/DQ ONNX model (explicit "
    "quantization; TensorRT 11 builds strongly typed only). Without TensorRT or a GPU the check, the "
    "precision map and the onnxruntime validation still run and the report is written; the command then "
    "stops with exit code 2.")
EPILOG = ("exit codes: 0 success, 1 engine built but verification failed, 2 refused / bad input / "
          "TensorRT or GPU missing, 3 internal error, 130 interrupted")


@dataclass(frozen=True)
class DeployOptions:
    """Every command-line option, validated (see `get_parser` for their meaning)."""

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
    min_cosine: float = 0.99
    max_abs: Optional[float] = None
    skip_validation: bool = False
    force: bool = False
    allow_float: bool = False
    progress: bool = True
    verbose: bool = False
    #: the program name messages start with (``onnx-qat`` for ``onnx-qat deploy``); not an option
    prog: str = field(default=PROG, compare=False)

    def to_dict(self) -> dict:
        """JSON-ready form for the report."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "prog":
                continue
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
    """``NAME:MIN[,OPT,MAX]`` with dims joined by ``x`` -> `onnx_qat.deploy.backend.ShapeProfile`
    (the backend, and NumPy with it, is imported only when ``--shapes`` is given).

    One shape gives a static profile (min = opt = max). Dimensions must be whole
    numbers > 0 with min <= opt <= max in every dimension.
    """
    from .backend import ShapeProfile

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
    """The parser of the old ``tools/deploy_tensorrt.py`` command line (no heavy imports)."""
    p = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG)
    add_arguments(p)
    s = p.add_argument_group("output")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging (TensorRT's verbose log included) and tracebacks on errors")
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every deploy option but ``-v``/``--no-progress`` (the ``onnx-qat`` command line has its own
    global ones) on ``p``: the standalone parser and the ``onnx-qat deploy`` subcommand share them."""
    p.add_argument("model", type=Path, metavar="MODEL",
                   help="the Q/DQ ONNX model (e.g. written by 'onnx-qat quantize')")
    p.add_argument("--engine", type=Path, required=True, metavar="OUT.engine",
                   help="where to write the serialized TensorRT engine (written atomically)")
    p.add_argument("--report", type=Path, metavar="REPORT.json",
                   help="write a JSON report of every step done (also when the command stops early)")
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
                   help="run the layers left unquantized in FP16: TensorRT >= 11 (strongly typed only) "
                        "converts the model's float parts to FP16 first (nodes FP16 cannot serve stay FP32, "
                        "named in the report); TensorRT 10: weakly typed build with the INT8+FP16 flags; "
                        "8.6/9: the FP16 flag")
    b.add_argument("--workspace", type=whole_number(1), dest="workspace_mib", metavar="MIB",
                   help="builder workspace memory-pool limit in MiB (default: TensorRT's, the GPU's memory)")
    b.add_argument("--timing-cache", type=Path, metavar="CACHE",
                   help="timing cache file: read when it exists, written (atomically) after the build")
    m = p.add_argument_group("measure and verify")
    m.add_argument("--iterations", type=whole_number(1), default=100,
                   help="timed runs after warm-up (default 100)")
    m.add_argument("--warmup", type=whole_number(0), default=10, help="untimed warm-up runs (default 10)")
    m.add_argument("--min-top1", type=number_in(0.0, 1.0), default=0.99,
                   help="least top-1 agreement between engine and onnxruntime, outputs holding class "
                        "scores only (rank 2, or written by a Softmax; default 0.99)")
    m.add_argument("--min-cosine", type=number_in(-1.0, 1.0), default=0.99,
                   help="least cosine between engine and onnxruntime outputs, every output (default 0.99)")
    m.add_argument("--max-abs", type=positive_number,
                   help="largest allowed max-abs difference between engine and onnxruntime "
                        "(default: no limit)")
    s = p.add_argument_group("control")
    s.add_argument("--skip-validation", action="store_true",
                   help="skip the onnxruntime run before the build and the engine-vs-onnxruntime comparison "
                        "(the check still runs; accuracy vs --labels is still measured on the engine)")
    s.add_argument("--force", action="store_true",
                   help="build even when the check finds errors or the onnxruntime outputs are unhealthy")
    s.add_argument("--allow-float", action="store_true",
                   help="build a model that has no Q/DQ nodes at all (check rule C13) as a float engine "
                        "instead of stopping")


def options_from_args(args: argparse.Namespace, *, prog: str = PROG) -> DeployOptions:
    """Turn parsed arguments into a validated `DeployOptions` (``prog``: the program name its
    messages start with). ``-v`` may be a flag or a count; ``-q`` (``onnx-qat``) turns progress bars off."""
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
        min_cosine=args.min_cosine,
        skip_validation=args.skip_validation, force=args.force, allow_float=args.allow_float,
        progress=not (args.no_progress or getattr(args, "quiet", False)), verbose=bool(args.verbose),
        prog=prog)
