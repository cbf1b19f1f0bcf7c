"""The ``onnx-qat`` command line: a thin layer over the public API.

Every option is a keyword of a documented function
([`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate],
[`onnx_qat.quantize`][onnx_qat.quantize.quantize], [`onnx_qat.check`][onnx_qat.check.check],
[`onnx_qat.compare`][onnx_qat.runtime.compare.compare], [`onnx_qat.place`][onnx_qat.placement.policy.place],
fields of [`onnx_qat.config.QuantizeConfig`][]). Building
the parser imports nothing heavy (no numpy, onnx, onnxruntime): ``onnx-qat --help``
answers at once; each command imports the API it needs when it runs.

Exit codes:
    0   success
    1   ``check`` found an error, ``compare`` failed, ``quantize`` wrote a model ``check`` refuses, or
        the engine ``deploy`` built differs from onnxruntime
    2   bad input or usage: one line ``onnx-qat: error: ...`` on stderr; ``deploy`` also when it refuses
        the model or TensorRT/a GPU is missing (after writing its report)
    3   internal error (a bug): one line plus "re-run with --verbose for the traceback"
    130 interrupted (Ctrl-C, SIGINT); 143 terminated (SIGTERM). Either way atomic writers remove
        their temporary files, so no partial output is left.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import traceback
from typing import List, Optional, Sequence

from . import __version__
from .config import FLOAT_DTYPES, TARGETS
from .formats.numeric import FP8_METHODS, INT4_METHODS, PRECISIONS
from .argtypes import any_number, number_in, positive_number, whole_number
from .errors import QatError

PROG = "onnx-qat"
METHODS = ("max", "percentile", "entropy", "mse", "auto")
#: ``calibrate --format``: the ScaleTable JSON or a TensorRT calibration cache.
SCALE_FORMATS = ("scales-json", "tensorrt-cache")
#: Calibrators a TensorRT cache header names (onnx_qat.io.tensorrt_cache.ALGORITHMS, without importing it).
CACHE_ALGORITHMS = ("EntropyCalibration2", "EntropyCalibration", "MinMaxCalibration", "LegacyCalibration")

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + 15  # SIGTERM

logger = logging.getLogger(__name__)


class Terminated(BaseException):
    """SIGTERM arrived. Unwinds like KeyboardInterrupt, so atomic writers clean up."""


def _on_sigterm(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def _sigterm_unwinds():
    """While running a command, turn SIGTERM into `Terminated` (main thread only)."""
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signal handling alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class UsageError(Exception):
    """A command-line usage problem (bad option value, missing or conflicting options)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors become one line (no usage dump) and exit code 2."""

    def error(self, message):  # argparse calls this for every usage problem
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- option value types (raise ArgumentTypeError: argparse names the option) ---------------------------
def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"invalid regular expression {text!r}: {exc}") from None
    return text


def _pair(text: str):
    """``OUTPUT=INPUT`` (``--state``) as a tuple of two names."""
    left, sep, right = text.partition("=")
    if not sep or not left or not right or "=" in right:
        raise argparse.ArgumentTypeError(f"expected OUTPUT=INPUT, got {text!r}")
    return left, right


def _axis_pair(text: str):
    """``INPUT=AXIS`` (``--batch-axis``) as ``(name, axis)``."""
    name, sep, axis = text.rpartition("=")
    try:
        return (name, int(axis)) if sep and name else _no_axis(text)
    except ValueError:
        return _no_axis(text)


def _no_axis(text: str):
    raise argparse.ArgumentTypeError(f"expected INPUT=AXIS with a whole-number axis, got {text!r}")


def _shape_pair(text: str):
    """``INPUT=DIMS`` (``--latency-shape``, dims joined by ``x``) as ``(name, dims)``."""
    name, sep, dims = text.rpartition("=")
    if not sep or not name or not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)*", dims):
        raise argparse.ArgumentTypeError(f"expected INPUT=DIMS with whole-number dims >= 1 joined by 'x' "
                                         f"(e.g. x=1x3x640x640), got {text!r}")
    return name, tuple(int(d) for d in dims.split("x"))


#: What ``--data`` takes (and ``--eval-data``).
DATA_HELP = ("an .npz file (keys are graph input names, first axis is samples), or a directory or list of "
             ".npz files, one feed (one run) each, in natural name order / the order given")


def _layout_options(parser: argparse.ArgumentParser) -> None:
    """Keywords state and batch_axis of the data loaders (onnx_qat.load_data)."""
    group = parser.add_argument_group("data layout (onnx_qat.load_data)")
    group.add_argument("--state", metavar="OUTPUT=INPUT", nargs="+", action="extend", type=_pair, default=[],
                       help="stateful model: run the data in order, feeding each run's OUTPUT to the next "
                            "run as INPUT; the first feed gives the initial state, later feeds omit it "
                            "(silero-vad: --state stateN=state)")
    group.add_argument("--batch-axis", metavar="INPUT=AXIS", nargs="+", action="extend", type=_axis_pair,
                       default=[], help="an input whose batch axis is not the first (silero-vad: state=1)")


# -- the parser ---------------------------------------------------------------------------------------
def _global_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """-v/--verbose, -q/--quiet, --no-progress: accepted before or after the command name."""
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS if suppress else 0,
                        help="more log output and tracebacks on errors (-v: info, -vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        default=argparse.SUPPRESS if suppress else False,
                        help="print only errors; the exit code carries the result (--json output and "
                             "'inspect' tables are still printed)")
    parser.add_argument("--no-progress", action="store_true",
                        default=argparse.SUPPRESS if suppress else False, help="no progress bars")


def _placement_options(parser: argparse.ArgumentParser) -> None:
    """QuantizeConfig fields (placement): exclude_nodes, exclude_op_types, min_channels, include_attention,
    precision, block_size, int4_method, fp8_method."""
    group = parser.add_argument_group("placement options (QuantizeConfig)")
    group.add_argument("--exclude-nodes", metavar="REGEX", nargs="+", action="extend", type=_regex,
                       default=[],
                       help="leave nodes whose name fully matches a regular expression in float")
    group.add_argument("--exclude-op-types", metavar="OP", nargs="+", action="extend", default=[],
                       help="leave these ONNX op types in float (e.g. MatMul Gemm)")
    group.add_argument("--min-channels", metavar="N", type=whole_number(0), default=None,
                       help="leave weighted ops with fewer input or output channels than N in float "
                            "(default: the library default)")
    group.add_argument("--include-attention", action=argparse.BooleanOptionalAction, default=None,
                       help="also quantize attention-score MatMuls and the Softmax output they read "
                            "(default: off for int8, on for fp8; --no-include-attention keeps them float)")
    group.add_argument("--precision", choices=PRECISIONS, default=None,
                       help="numeric format: int8 (default), fp8 (E4M3 Q/DQ, opset 19) or int4 "
                            "(weight-only blockwise MatMul/Gemm weights, opset 21)")
    group.add_argument("--block-size", metavar="N", type=whole_number(2), default=None,
                       help="values per INT4 weight scale along the reduction axis (default 128; "
                            "TensorRT documents 64 and 128)")
    group.add_argument("--int4-method", choices=INT4_METHODS, default=None,
                       help="INT4 weight rounding: rtn (round to nearest), awq (activation-aware scales "
                            "and clipping) or gptq (AWQ, then error-compensating rounding); awq and gptq "
                            "need --data (default: awq with --data, rtn without)")
    group.add_argument("--fp8-method", choices=FP8_METHODS, default=None,
                       help="FP8 MatMul/Gemm weight rounding: rtn (round to nearest, default) or gptq "
                            "(error-compensating rounding on each output channel's E4M3 grid; needs --data)")


def _calibration_options(parser: argparse.ArgumentParser) -> None:
    """Keywords of onnx_qat.calibrate: method, percentile, batch_size."""
    group = parser.add_argument_group("calibration options (onnx_qat.calibrate)")
    group.add_argument("--method", choices=METHODS, default=None,
                       help="how activation ranges are chosen from the data (default: auto; for "
                            "sensitivity: max; with --min-cosine, auto searches each tensor's range "
                            "with the float sites, another method only the float sites; auto: of max "
                            "everywhere and the least-error range per tensor, the table whose output "
                            "is closest to the float model's on the calibration data, leaving max "
                            "only where the samples agree)")
    group.add_argument("--percentile", metavar="P", type=number_in(0.0, 100.0, low_open=True), default=None,
                       help="percentile of |x| kept by --method percentile, in (0, 100] (default 99.99)")
    group.add_argument("--batch-size", metavar="N", type=whole_number(1), default=None,
                       help="samples per onnxruntime run (default: the library default)")


def _worker_options(parser: argparse.ArgumentParser, what: str) -> None:
    """The ``workers`` and ``ray`` keywords: --workers, --ray."""
    group = parser.add_argument_group("work spread over processes and machines (workers=, ray=)")
    group.add_argument("--workers", metavar="N", type=whole_number(1), default=None,
                       help=f"worker processes {what} run on, each with its own onnxruntime sessions and "
                            "cores/N threads; results are identical for any N; 1: in this process "
                            "(default: one per core within memory, one for short runs)")
    group.add_argument("--ray", metavar="ADDRESS", nargs="?", const=True, default=None,
                       help=f"run {what} as Ray actors: on the cluster at ADDRESS (auto, HOST:6379, "
                            "ray://HOST:10001), or without ADDRESS on the one RAY_ADDRESS names or a new "
                            "local one; --workers N actors (default: one per CPU of the cluster); needs "
                            "pip install 'onnx-qat[ray]'")


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate",
                       help="run the float model on data; write activation ranges (ScaleTable JSON)",
                       description="Run MODEL in onnxruntime on the samples in --data and write the "
                                   "ranges of "
                                   "the tensors placement will quantize as a ScaleTable JSON file. "
                                   "With --target ort-cpu, also the tensors the CPU form adds, for "
                                   "'quantize --scales SCALES.json --target ort-cpu'.")
    p.add_argument("model", metavar="MODEL", help="float ONNX model")
    p.add_argument("--target", choices=TARGETS, default=None,
                   help="the deployment form the table is for: tensorrt (default) or ort-cpu (also observes "
                        "the Conv outputs the CPU form requantizes with their own range, keeps the ranges "
                        "off the FP16 grid and marks the table calibrated for ort-cpu, so 'quantize --scales "
                        "--target ort-cpu' builds what 'quantize --data --target ort-cpu' builds, except "
                        "the Conv bias correction, which needs --data)")
    p.add_argument("--data", metavar="NPZ", nargs="+", required=True, help="calibration data: " + DATA_HELP)
    p.add_argument("-o", "--output", metavar="SCALES.json", required=True,
                   help="file to write: a ScaleTable JSON, or with --format tensorrt-cache a TensorRT "
                        "calibration cache")
    cache = p.add_argument_group("output format (ScaleTable.save_tensorrt_cache)")
    cache.add_argument("--format", choices=SCALE_FORMATS, default="scales-json",
                       help="scales-json (default): the ScaleTable; tensorrt-cache: TensorRT's calibration "
                            "cache text (activation ranges as float32 scales amax/127), for TensorRT 8-10 "
                            "implicit INT8 builds")
    cache.add_argument("--tensorrt-version", metavar="X.Y.Z", default=None,
                       help="with --format tensorrt-cache (required there): the TensorRT that will read the "
                            "cache, written into its header (e.g. 8.6.1 -> TRT-8601-...)")
    cache.add_argument("--calibrator", choices=CACHE_ALGORITHMS, default=None,
                       help="with --format tensorrt-cache: the calibrator named in the header "
                            "(default EntropyCalibration2; use the one that will read the cache)")
    _calibration_options(p)
    _worker_options(p, "calibration's batches")
    _layout_options(p)
    _placement_options(p)
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_calibrate)


def _add_quantize(sub) -> None:
    p = sub.add_parser("quantize", help="insert Q/DQ pairs (TensorRT placement) from data or a ScaleTable",
                       description="Write a Q/DQ copy of MODEL to --output, with ranges calibrated from "
                                   "--data "
                                   "or read from --scales; then run 'check' on the result.")
    p.add_argument("model", metavar="MODEL", help="float ONNX model")
    p.add_argument("-o", "--output", metavar="OUT.onnx", required=True, help="Q/DQ model to write")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--data", metavar="NPZ", nargs="+",
                        help="calibration data: " + DATA_HELP + "; with --precision int4, data for the "
                             "activation-aware weight scales (optional)")
    source.add_argument("--scales", metavar="JSON|CACHE",
                        help="ScaleTable JSON (from 'calibrate' or your own tool), or a TensorRT calibration "
                             "cache (a file starting 'TRT-'; its names not in the model are listed in one "
                             "warning and ignored)")
    p.add_argument("--target", choices=TARGETS, default=None,
                   help="deployment form: tensorrt (default) or ort-cpu (fast onnxruntime CPU kernels)")
    p.add_argument("--report", metavar="R.json", default=None,
                   help="also write a JSON report: placement decisions and the check result")
    p.add_argument("--float-dtype", choices=FLOAT_DTYPES, default=None,
                   help="type of everything Q/DQ leaves in float: fp32 (default), fp16 or bf16 "
                        "(TensorRT 11 runs FP32 float parts in FP32); nodes that must stay FP32 are "
                        "kept, each with its reason (see docs/formats.md)")
    p.add_argument("--float-io", action="store_true",
                   help="with --float-dtype fp16/bf16: graph inputs and outputs take that type too "
                        "(default: they keep FP32, with a Cast at the boundary)")
    _calibration_options(p)
    _layout_options(p)
    _placement_options(p)
    _mixed_precision_options(p)
    _worker_options(p, "calibration's batches and --min-cosine's settings")
    _latency_options(p)
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_quantize)


def _latency_options(parser: argparse.ArgumentParser) -> None:
    """The ``latency`` keyword of onnx_qat.quantize (ort-cpu): --latency, --latency-profile,
    --latency-threads, --latency-batch, --latency-shape, --latency-retime, --latency-allow-slower."""
    group = parser.add_argument_group("latency-aware placement, --target ort-cpu "
                                      "(onnx_qat.quantize latency=)")
    group.add_argument("--latency", action="store_true",
                       help="quantize a Conv/Gemm/MatMul only where onnxruntime's integer kernel is faster "
                            "than float on this CPU (each kind timed once per machine, cached under "
                            "~/.cache/onnx-qat/latency); the result is then timed against FP32")
    group.add_argument("--latency-profile", metavar="FILE", default=None,
                       help="like --latency, reading and extending this latency profile (e.g. one measured "
                            "on the deployment machine) instead of this machine's cache file")
    group.add_argument("--latency-threads", metavar="N", type=whole_number(0), default=None,
                       help="onnxruntime intra-op threads the model will run with (default 0: its default)")
    group.add_argument("--latency-batch", metavar="N", type=whole_number(1), default=None,
                       help="batch size the model will run at, for symbolic batch dimensions (default 1)")
    group.add_argument("--latency-shape", metavar="INPUT=DIMS", nargs="+", action="extend", type=_shape_pair,
                       default=None,
                       help="one sample's shape of an input with symbolic dimensions other than the batch, "
                            "dims joined by 'x' (e.g. x=1x3x640x640): the size its sites and the whole model "
                            "are timed at (default: one sample of --data, else the shapes a ScaleTable from "
                            "'calibrate --target ort-cpu' recorded, else 1, with a warning)")
    group.add_argument("--latency-retime", action="store_true",
                       help="time the whole model against FP32 again even when the latency profile holds a "
                            "timing of the very same models (kept there by an earlier run)")
    group.add_argument("--latency-allow-slower", action="store_true",
                       help="write the fastest quantized model even when it still runs slower than FP32 "
                            "after the whole-model guard (by default nothing is written then: the FP32 "
                            "model is the fast form on this CPU)")
    group.add_argument("--cpu-vnni", dest="cpu_vnni", action="store_const", const="on", default="auto",
                       help="--target ort-cpu with --data (or --scales from 'calibrate --target ort-cpu'): "
                            "keep 8-bit Conv/Gemm/MatMul weights: the model runs on CPUs whose int8 dot "
                            "products sum in 32 bits (AVX-512 VNNI, AVX-VNNI, AMX, ARM64); more accurate, "
                            "may overflow on AVX2-only CPUs. "
                            "Default (neither flag): 8 bits when this CPU is such a CPU, else 7")
    group.add_argument("--no-cpu-vnni", dest="cpu_vnni", action="store_const", const="off",
                       help="--target ort-cpu with --data (or --scales from 'calibrate --target ort-cpu'): "
                            "7-bit Conv/Gemm/MatMul weights (depthwise excepted), exact on every CPU")


def _mixed_precision_options(parser: argparse.ArgumentParser) -> None:
    """Keywords of onnx_qat.quantize for automatic mixed precision: min_cosine, max_float_sites, eval_data."""
    group = parser.add_argument_group("automatic mixed precision (onnx_qat.quantize)")
    group.add_argument("--min-cosine", metavar="C", type=number_in(0.0, 1.0, low_open=True), default=None,
                       help="leave the fewest sites in float so the output cosine against the float model "
                            "reaches C on the evaluation data, choosing each activation's range among "
                            "auto's candidates first (with --method auto, the default; in any "
                            "--precision; an int4 site is one weight); with auto, C must also hold for a "
                            "lower bound over the evaluation and calibration samples of what as many new "
                            "inputs would give (the pooled cosine less 2 jackknife standard errors); exit 2 "
                            "and write nothing when it cannot")
    group.add_argument("--max-float-sites", metavar="N", type=whole_number(0), default=None,
                       help="with --min-cosine: at most N sites in float (default: no limit)")
    group.add_argument("--eval-data", metavar="NPZ", nargs="+", default=None,
                       help="with --min-cosine or --optimize: data the cosine is measured on, as --data "
                            "(default: the last quarter of --data, which calibration then does not see)")
    group.add_argument("--optimize", choices=("accuracy",), default=None,
                       help="accuracy: also run cross-layer equalization, activation smoothing, a "
                            "range per activation among auto's candidates and a reconstruction of each "
                            "INT8 weighted op's integers and bias on the quantized model's own inputs "
                            "(where it is undone: each bias alone corrected), each kept only "
                            "where it raises the output cosine on the evaluation data (slower than the "
                            "default; needs --data)")


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="TensorRT-readiness rules for any Q/DQ model (exit 1 on errors)",
                       description="Check a Q/DQ model from any tool against TensorRT's "
                                   "explicit-quantization "
                                   "rules (C1-C14). Exit 1 when a rule finds an error.")
    p.add_argument("model", metavar="MODEL", help="Q/DQ ONNX model")
    p.add_argument("--target", choices=TARGETS, default=None,
                   help="the form to check: tensorrt (default: every rule) or ort-cpu (the rules that "
                        "apply to the CPU form)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--precision-map", metavar="MAP.json", default=None,
                   help="write the precision map (CheckReport.precision_map): each compute node's precision "
                        "under a TensorRT strongly typed build (int8, fp8, int4, fp16, bf16, fp32) and the "
                        "Q/DQ nodes left unfused, with their rule; prints its summary")
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_check)


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="numerics of two models on the same data (exit 1 when it fails)",
                       description="Run REFERENCE and CANDIDATE in onnxruntime on --data and compare every "
                                   "output. Exit 1 when an output misses a threshold.")
    p.add_argument("reference", metavar="REFERENCE", help="reference ONNX model (e.g. the float model)")
    p.add_argument("candidate", metavar="CANDIDATE", help="candidate ONNX model (e.g. the Q/DQ model)")
    p.add_argument("--data", metavar="NPZ", nargs="+", required=True, help=DATA_HELP)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    group = p.add_argument_group("thresholds (onnx_qat.compare)")
    group.add_argument("--max-abs", metavar="X", type=positive_number, default=None,
                       help="largest allowed absolute difference (default: not checked)")
    group.add_argument("--min-cosine", metavar="C", type=number_in(-1.0, 1.0), default=None,
                       help="smallest allowed cosine similarity (default 0.99)")
    group.add_argument("--min-sqnr", metavar="DB", type=any_number, default=None,
                       help="smallest allowed SQNR in dB (default: not checked)")
    group.add_argument("--min-top1", metavar="F", type=number_in(0.0, 1.0), default=None,
                       help="smallest allowed top-1 agreement, a fraction in [0, 1] (default: not checked)")
    group.add_argument("--batch-size", metavar="N", type=whole_number(1), default=None,
                       help="samples per onnxruntime run")
    group.add_argument("--num-samples", metavar="N", type=whole_number(1), default=None,
                       help="use only the first N samples (feeds)")
    group.add_argument("--min-decisions", metavar="F", type=number_in(0.0, 1.0), default=None,
                       help="with --state: smallest share of steps whose yes/no decision (a probability "
                            "output above 0.5) agrees, a fraction in [0, 1] (default: not checked)")
    p.add_argument("--exact-qdq", action=argparse.BooleanOptionalAction, default=None,
                   help="run both models with onnxruntime's graph optimisations off (exact Q/DQ "
                        "arithmetic) or, --no-exact-qdq, on (default: by form: a TensorRT-form Q/DQ model "
                        "exact, as TensorRT computes it; float models and the ort-cpu form as deployed)")
    _layout_options(p)
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_compare)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="show every placement decision with its rule and reason",
                       description="Decide placement for MODEL (nothing is written) and print, per node, "
                                   "what will be quantized or skipped, by which rule and why.")
    p.add_argument("model", metavar="MODEL", help="float ONNX model")
    p.add_argument("--json", action="store_true", help="print the placement as JSON")
    _placement_options(p)
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_inspect)


def _add_sensitivity(sub) -> None:
    p = sub.add_parser("sensitivity", help="rank the quantized sites by the output error each one costs",
                       description="Calibrate MODEL once on --data (method max unless --method is given). "
                                   "Then, for every site that placement quantizes, measure the output "
                                   "error against the float model twice: with only that site quantized "
                                   "(INT8, or --precision) and with every site but that one. The errors "
                                   "are measured on --eval-data (default: the last quarter of --data, "
                                   "held out from calibration). Prints the sites ranked, most sensitive "
                                   "first; see docs/sensitivity.md.")
    p.add_argument("model", metavar="MODEL", help="float ONNX model")
    p.add_argument("--data", metavar="NPZ", nargs="+", required=True, help="calibration data: " + DATA_HELP)
    p.add_argument("--eval-data", metavar="NPZ", nargs="+", default=None,
                   help="evaluation data, as --data (default: the last quarter of --data, not calibrated on)")
    p.add_argument("-o", "--output", metavar="REPORT.json", default=None, help="write the result as JSON")
    p.add_argument("--plot", metavar="CHART.png", default=None,
                   help="write a ranked bar chart of the most sensitive sites (needs matplotlib)")
    p.add_argument("--top", metavar="N", type=whole_number(1), default=20,
                   help="sites shown in the table and the chart (default 20)")
    p.add_argument("--metric", choices=("cosine", "sqnr", "max_abs"), default="cosine",
                   help="what ranks the sites (default cosine; all three are reported)")
    _calibration_options(p)
    _layout_options(p)
    _placement_options(p)
    _worker_options(p, "the settings")
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_sensitivity)


def _add_deploy(sub) -> None:
    from .deploy.options import DESCRIPTION, EPILOG, add_arguments  # argparse only

    p = sub.add_parser("deploy", help="TensorRT engine: gate, validate, build, time and verify (the build "
                                      "needs TensorRT and a GPU; the rest runs anywhere)",
                       description=DESCRIPTION + " See docs/tensorrt.md.", epilog=EPILOG)
    add_arguments(p)
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_deploy)


def get_parser() -> argparse.ArgumentParser:
    """The ``onnx-qat`` argument parser (cheap: imports nothing heavy)."""
    parser = _Parser(prog=PROG, description="Place INT8 QuantizeLinear/DequantizeLinear pairs in ONNX models "
                     "the way TensorRT wants them; check and compare Q/DQ models.",
                     epilog="exit codes: 0 success, 1 check/compare found problems, 2 bad input or usage, "
                            "3 internal error, 130 interrupted, 143 terminated")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    _global_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for add in (_add_calibrate, _add_quantize, _add_check, _add_compare, _add_inspect, _add_sensitivity,
                _add_deploy):
        add(sub)
    return parser


# -- shared helpers of the commands ------------------------------------------------------------------
def _placement_keywords(args) -> dict:
    """QuantizeConfig keywords given on the command line (library defaults for the rest)."""
    kw = {}
    if getattr(args, "exclude_nodes", None):
        kw["exclude_nodes"] = tuple(args.exclude_nodes)
    if getattr(args, "exclude_op_types", None):
        kw["exclude_op_types"] = tuple(args.exclude_op_types)
    if getattr(args, "min_channels", None) is not None:
        kw["min_channels"] = args.min_channels
    if getattr(args, "include_attention", None) is not None:
        kw["include_attention"] = args.include_attention
    if getattr(args, "precision", None) is not None:
        kw["precision"] = args.precision
    if getattr(args, "block_size", None) is not None:
        kw["block_size"] = args.block_size
    if getattr(args, "int4_method", None) is not None:
        kw["int4_method"] = args.int4_method
    if getattr(args, "fp8_method", None) is not None:
        kw["fp8_method"] = args.fp8_method
    if getattr(args, "float_dtype", None) is not None:
        kw["float_dtype"] = args.float_dtype
    if getattr(args, "target", None) is not None:
        kw["target"] = args.target
    return kw


def _calibration_keywords(args) -> dict:
    """onnx_qat.calibrate keywords given on the command line."""
    if args.percentile is not None and args.method not in (None, "percentile"):
        raise UsageError(f"--percentile applies only with --method percentile, not --method {args.method}")
    kw = {}
    if args.method is not None:
        kw["method"] = args.method
    if args.percentile is not None:
        kw["method"] = "percentile"
        kw["percentile"] = args.percentile
    if args.batch_size is not None:
        kw["batch_size"] = args.batch_size
    return kw


def _progress(args) -> bool:
    return not (args.no_progress or args.quiet)


def _say(args, text: str) -> None:
    """A human-readable summary line on stdout (silenced by --quiet)."""
    if not args.quiet:
        print(text)


def _print_json(obj) -> None:
    """Stable JSON on stdout (sorted keys; NaN/inf written as strings, see ``json_safe``)."""
    import json

    from .io.files import json_safe
    print(json.dumps(json_safe(obj), indent=2, sort_keys=True, allow_nan=False, default=_json_default))


def _json_default(value):
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def _same_path(a, b) -> bool:
    from pathlib import Path
    return Path(a).resolve() == Path(b).resolve()


#: What each input option expects, named in "is a directory" messages (by the error class it raises).
_FILE_KINDS = {"ModelError": "the .onnx file", "DataError": "the .npz file",
               "ScalesError": "the ScaleTable .json file"}


def _check_inputs(*inputs) -> None:
    """Refuse missing input files before importing anything heavy (one line, exit 2).

    ``inputs`` are ``(what, path, error class name)``; the API checks contents later.
    """
    from pathlib import Path
    from . import errors
    for what, path, error in inputs:
        if path is None:
            continue
        p = Path(path)
        if not p.exists():
            raise getattr(errors, error)(f"{what} {p} does not exist")
        if p.is_dir():
            raise getattr(errors, error)(f"{what} {p} is a directory; give {_FILE_KINDS[error]}")
        if not p.is_file():
            raise getattr(errors, error)(f"{what} {p} is not a regular file; give {_FILE_KINDS[error]}")


def _data_source(option: str, paths):
    """``--data``/``--eval-data``: None, one path (an .npz file or a directory of feeds) or a list of
    .npz files (one feed each). Missing paths are refused here (DataError, exit 2)."""
    from pathlib import Path
    from .errors import DataError
    if paths is None:
        return None
    model = next((Path(p) for p in paths if Path(p).suffix.lower() == ".onnx"), None)
    if model is not None:
        raise DataError(f"{option} {model} is an ONNX model, not data; {option} takes one or more paths, so "
                        f"give the model before {option}")
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise DataError(f"{option} {p} does not exist")
        if len(paths) > 1 and not p.is_file():
            raise DataError(f"{option} {p} is not a file (several paths are .npz files, one feed each)")
    return paths[0] if len(paths) == 1 else list(paths)


def _layout_keywords(args) -> dict:
    """state and batch_axis from --state and --batch-axis (a name given twice is a usage error)."""
    kw = {}
    options = (("--state", args.state, "state"), ("--batch-axis", args.batch_axis, "batch_axis"))
    for option, pairs, key in options:
        names = [name for name, _ in pairs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise UsageError(f"{option} names {twice[0]!r} twice")
        if pairs:
            kw[key] = dict(pairs)
    if "state" in kw and len(set(kw["state"].values())) < len(kw["state"]):
        raise UsageError("--state feeds one input from two outputs")
    return kw


def _data_paths(*sources) -> list:
    """The paths among data sources (for the output-path checks)."""
    out = []
    for source in sources:
        out.extend(source if isinstance(source, list) else [] if source is None else [source])
    return out


def _check_outputs(outputs, inputs) -> None:
    """Refuse bad output paths before any work (OutputError, exit 2)."""
    from .io.files import check_output_path
    for option, path in outputs:
        if path is not None:
            check_output_path(path, inputs=tuple(inputs), what=option)


# -- the commands -------------------------------------------------------------------------------------
def cmd_calibrate(args) -> int:
    """``onnx-qat calibrate``: [`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate] with ``output``
    (the ScaleTable JSON)."""
    kw = {**_calibration_keywords(args), **_placement_keywords(args), **_layout_keywords(args)}
    cache = args.format == "tensorrt-cache"
    if not cache and (args.tensorrt_version is not None or args.calibrator is not None):
        raise UsageError("--tensorrt-version and --calibrator apply only with --format tensorrt-cache")
    if cache and args.target not in (None, "tensorrt"):
        raise UsageError(f"--format tensorrt-cache is a TensorRT table; it does not apply with --target "
                         f"{args.target} (write the ScaleTable JSON)")
    if cache and args.tensorrt_version is None:
        raise UsageError("--format tensorrt-cache needs --tensorrt-version X.Y.Z (the TensorRT that will "
                         "read the cache; it goes into the header)")
    if cache:
        from .io.tensorrt_cache import tensorrt_version_number
        tensorrt_version_number(args.tensorrt_version)  # a bad version is refused before calibrating
    _check_inputs(("model", args.model, "ModelError"))
    data = _data_source("--data", args.data)
    _check_outputs([("--output", args.output)], [args.model, *_data_paths(data)])
    from .calibration import DEFAULT_METHOD, calibrate
    from .scales import CALIBRATION_TARGET_KEY
    table = calibrate(args.model, data, output=None if cache else args.output, progress=_progress(args),
                      workers=args.workers, ray=args.ray, **kw)
    method = _method_summary(table) or f"ranges: {kw.get('method', DEFAULT_METHOD)}"
    if cache:
        table.save_tensorrt_cache(args.output, tensorrt_version=args.tensorrt_version,
                                  algorithm=args.calibrator or "EntropyCalibration2")
        _say(args, f"wrote {args.output}: TensorRT calibration cache of "
                   f"{_count(len(table.activations), 'activation range')} | {method}")
        return EXIT_OK
    form = table.metadata.get(CALIBRATION_TARGET_KEY)
    for_form = "" if form is None else (
        f" | for --target {form} (quantize --scales {args.output} --target {form}; its Conv bias "
        "correction, rule CPU7, needs --data and is not in the table)")
    _say(args, f"wrote {args.output}: {_count(len(table.activations), 'activation range')}, "
               f"{_count(len(table.weights), 'weight range')} | {method}{for_form}")
    _say_low_cosine(args, table, "calibrate")
    return EXIT_OK


#: Below this output cosine on the calibration data (that of the table ``auto`` kept), ``quantize`` and
#: ``calibrate`` add a note on what recovers accuracy (the ``--min-cosine`` default target).
LOW_COSINE = 0.99


def _say_low_cosine(args, table, command: str) -> None:
    """A ``note:`` line when the ranges ``auto`` kept leave the output below `LOW_COSINE` of the float
    model's on the calibration data (`onnx_qat.scales.kept_output_cosine`), naming what can recover it;
    nothing for other methods, whose ranges were not judged."""
    from .scales import kept_output_cosine

    cosine = kept_output_cosine(getattr(table, "metadata", None) or {})
    if cosine is None or cosine >= LOW_COSINE:
        return
    where = ("--optimize accuracy (smoothing, range search, reconstruction) or --min-cosine 0.99 (the "
             "fewest layers left in float)" if command == "quantize" else
             "onnx-qat quantize --optimize accuracy or --min-cosine 0.99")
    _say(args, f"note: the output keeps cosine {cosine:.5f} of the float model's on the calibration data, "
               f"below {LOW_COSINE:g}: {where} may recover it; onnx-qat sensitivity shows which layers cost "
               "it (docs/sensitivity.md)")


def cmd_quantize(args) -> int:
    """``onnx-qat quantize``: [`onnx_qat.quantize`][onnx_qat.quantize.quantize], then
    [`onnx_qat.check`][onnx_qat.check.check] on the result."""
    if args.scales is not None:
        given = [opt for opt, val in (("--method", args.method), ("--percentile", args.percentile),
                                      ("--batch-size", args.batch_size)) if val is not None]
        if given:
            raise UsageError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only with --data, "
                             "not with --scales")
    calib = _calibration_keywords(args) if args.data is not None else {}
    layout = _layout_keywords(args)
    if layout and args.data is None:
        raise UsageError("--state and --batch-axis apply only with --data")
    _check_inputs(("model", args.model, "ModelError"), ("--scales", args.scales, "ScalesError"))
    data, eval_data = _data_source("--data", args.data), _data_source("--eval-data", args.eval_data)
    _check_outputs([("--output", args.output), ("--report", args.report)],
                   [args.model, args.scales, *_data_paths(data, eval_data)])
    if args.report is not None and _same_path(args.report, args.output):
        raise UsageError("--report and --output name the same file")
    if args.data is None and args.scales is None and getattr(args, "precision", None) != "int4":
        raise UsageError("one of the arguments --data --scales is required")
    mixed = {k: v for k, v in (("min_cosine", args.min_cosine), ("max_float_sites", args.max_float_sites),
                               ("eval_data", eval_data)) if v is not None}
    optimize = getattr(args, "optimize", None)
    if optimize is not None and (args.min_cosine is not None or args.max_float_sites is not None
                                 or args.data is None):
        raise UsageError("--optimize needs --data and does not combine with --scales, --min-cosine or "
                         "--max-float-sites")
    if mixed and args.min_cosine is None and not (optimize and set(mixed) == {"eval_data"}):
        raise UsageError("--max-float-sites and --eval-data apply only with --min-cosine (--eval-data also "
                         "with --optimize)")
    if optimize is not None:
        mixed["optimize"] = optimize
    if args.float_io and args.float_dtype in (None, "fp32"):
        raise UsageError("--float-io applies only with --float-dtype fp16 or bf16")
    latency = _latency_keyword(args)
    latency["cpu_vnni"] = {"on": True, "off": False}.get(args.cpu_vnni, "auto")
    if data is None and not latency.get("latency"):  # a rewrite from scales alone: Python objects only
        from .io.models import cyclic_gc_paused

        with cyclic_gc_paused():  # until the check of the result is done (see _quantize_and_check)
            return _quantize_and_check(args, data, calib, mixed, layout, latency)
    return _quantize_and_check(args, data, calib, mixed, layout, latency)


def _quantize_and_check(args, data, calib: dict, mixed: dict, layout: dict, latency: dict) -> int:
    """`cmd_quantize` once its options are checked: quantize, print, check the result, write the report.

    A rewrite from scales alone runs this with the cyclic garbage collector paused: its ~10^6 objects
    (index, placement, edits, the check's index) are freed by reference counting, and a collection
    while they live rescans all of them (on the 50,000-node benchmark graph 0.2-0.6 s)."""
    from .quantize import quantize
    result = quantize(args.model, output=args.output, scales=args.scales, data=data,
                      progress=_progress(args), keep_io_types=not args.float_io, **calib,
                      **_placement_keywords(args), **mixed, **layout, **latency, workers=args.workers,
                      ray=args.ray)
    _say(args, _quantize_summary(args, result))
    if result.accuracy is None:
        _say_low_cosine(args, getattr(result, "scales", None), "quantize")
    if result.accuracy is not None:
        _say(args, _optimize_summary(result.accuracy) if "steps" in result.accuracy
             else _mixed_summary(result.accuracy))
    folds = getattr(result, "scale_folds", ())
    if folds:
        _say(args, _scale_folds_summary(folds))
    if result.float_parts is not None:
        _say(args, _float_parts_summary(result.float_parts))
    ort_cpu = getattr(result, "ort_cpu", None)
    if ort_cpu is not None:
        _say(args, f"ort-cpu Conv/Gemm/MatMul weights: {ort_cpu['weight_bits']} bits "
                   f"(as {'--cpu-vnni' if ort_cpu['cpu_vnni'] else '--no-cpu-vnni'}, {ort_cpu['chosen_by']}: "
                   f"{ort_cpu['reason']})")
    if result.latency is not None:
        _say(args, _latency_summary(result.latency))
    report = _check_written(result.model, args.output, result.target, getattr(result, "evidence", None))
    if not args.quiet:
        for finding in report.findings:
            print(f"  {finding}")
        print(f"check: {report.summary()}" if result.target == "tensorrt"
              else f"check ({result.target} rules): {report.summary()}")
    if args.report is not None:
        from .io.files import write_json
        write_json(args.report, {**result.to_report(), "check": report.to_dict()})
        _say(args, f"wrote {args.report}")
    return EXIT_OK if report else EXIT_PROBLEMS


def _latency_keyword(args) -> dict:
    """``{"latency": LatencyOptions}`` from --latency/--latency-profile/--latency-threads/--latency-batch/
    --latency-shape/--latency-retime/--latency-allow-slower, or ``{}`` when none is given."""
    tuning = [o for o, v in (("--latency-threads", args.latency_threads),
                             ("--latency-batch", args.latency_batch),
                             ("--latency-shape", args.latency_shape),
                             ("--latency-retime", args.latency_retime or None),
                             ("--latency-allow-slower", args.latency_allow_slower or None)) if v is not None]
    if not args.latency and args.latency_profile is None:
        if tuning:
            raise UsageError(f"{', '.join(tuning)} appl{'ies' if len(tuning) == 1 else 'y'} only with "
                             "--latency or --latency-profile")
        return {}
    from .placement.cpu_latency import LatencyOptions

    shapes = dict(args.latency_shape or ())
    if len(shapes) != len(args.latency_shape or ()):
        raise UsageError("--latency-shape names an input twice")
    return {"latency": LatencyOptions(profile=args.latency_profile, threads=args.latency_threads or 0,
                                      batch=args.latency_batch or 1, retime=args.latency_retime,
                                      shapes=shapes or None, allow_slower=args.latency_allow_slower)}


def _latency_summary(latency) -> str:
    """Lines for the latency placement: sites kept float, and the whole model against FP32."""
    sites = latency["sites"]
    kept = latency["kept_float"]
    lines = [f"latency placement ({latency['rule']}): {len(kept)} of {len(sites)} timed site(s) kept float "
             f"for speed; {latency['kinds_measured']} kind(s) measured in {latency['seconds']:.1f} s, "
             f"profile {latency['profile']}"]
    by_node = {s["node"]: s for s in sites}
    lines += [f"  float  {n}: integer {by_node[n]['int_us']:.0f} us, float {by_node[n]['float_us']:.0f} us "
              f"({by_node[n]['kind']})" for n in kept[:20]]
    whole = latency.get("whole_model") or {}
    if whole.get("timed"):
        if "every_site_integer_ms" in whole:
            lines.append(f"whole model: latency placement {whole['latency_placement_ms']:.2f} ms, every site "
                         f"integer {whole['every_site_integer_ms']:.2f} ms: kept {whole['chosen']}")
        fallback = latency.get("fallback")
        if fallback:
            kept = "kept the fallback" if fallback["chosen"] == "fallback" else "kept the model as it was"
            tried = fallback.get("rounds_tried") or [fallback]
            first = whole["first"]["speedup"]
            if len(tried) == 1:
                lines.append(f"whole-model guard: first timing {first:.2f}x FP32, so "
                             f"{len(fallback['kept_float'])} least-gaining site(s) kept float too and timed "
                             f"again: {fallback['fallback_ms']:.2f} ms against "
                             f"{fallback['before_ms']:.2f} ms: {kept}")
            else:
                steps = "; ".join(f"round {i}: {len(r['kept_float'])} more site(s) float, "
                                  f"{r['fallback_ms']:.2f} ms against {r['before_ms']:.2f} ms"
                                  for i, r in enumerate(tried, 1))
                guarded = len(fallback["kept_float"]) if fallback["chosen"] == "fallback" else 0
                lines.append(f"whole-model guard: first timing {first:.2f}x FP32, so the least-gaining half "
                             f"of the integer sites was kept float, {len(tried)} rounds ({steps}): {kept} "
                             f"({guarded} site(s) float by the guard)")
        origin = (f" (timing from the latency profile, measured {whole.get('timed_at') or 'earlier'}; "
                  "--latency-retime times it again)" if whole.get("source") == "latency profile" else "")
        shapes = whole.get("input_shapes") or {}
        fed = ("; inputs " + ", ".join(f"{k}={'x'.join(map(str, v)) or 'scalar'}" for k, v in shapes.items())
               if shapes else "")
        lines.append(f"whole model, batch {whole['batch']}: {whole['quantized_ms']:.2f} ms against FP32 "
                     f"{whole['fp32_ms']:.2f} ms ({whole['speedup']:.2f}x): {whole['verdict']}{origin}{fed}")
    else:
        lines.append(f"whole model not timed: {whole.get('reason', 'unknown')}")
    return "\n".join(lines)


def _check_written(model, output, target, evidence=None):
    """``check`` of the model ``quantize`` just wrote to ``output`` (after it was validated: ``onnx.checker``
    on the bytes written, or the edit's evidence, `onnx_qat.graph.delta`): the very ModelProto it serialized
    there, checked by the rules of its
    ``target``, without reading the file back (which would parse it and hold a second copy); with the edit's
    ``evidence`` (`QuantizeResult.evidence`) its nodes are read from the values the edit made them from."""
    from .check import check_written

    return check_written(model, evidence, target=target, path=output)


def _quantize_summary(args, result) -> str:
    """One line: what was written and how much was quantized."""
    s = dict(getattr(result, "summary", {}) or {})
    precision = getattr(result, "precision", "int8")
    method = _method_summary(getattr(result, "scales", None))
    return (f"wrote {args.output} | target {result.target}"
            f"{'' if precision == 'int8' else ' | precision ' + precision} | "
            f"{_count(s.get('activations'), 'activation')} and "
            f"{_count(s.get('weights'), 'weight')} quantized, "
            f"{_count(s.get('skipped_nodes'), 'node')} skipped | "
            f"{s.get('quantize_linear', '?')} QuantizeLinear, "
            f"{s.get('dequantize_linear', '?')} DequantizeLinear" + (f" | {method}" if method else ""))


def _scale_folds_summary(folds) -> str:
    """One line for the tensorrt form's rule TRT1: how many per-channel Mul/Add nodes went into how many
    convolutions (each named in the report's ``scale_folds``)."""
    ops = sum(len(f["folded"]) for f in folds)
    return (f"folded {_count(ops, 'per-channel Mul/Add node')} into the weights and biases of "
            f"{_count(len(folds), 'convolution')} before quantization (rule TRT1, as TensorRT fuses them; "
            "listed under scale_folds in --report)")


def _count(n, noun: str) -> str:
    """``1 node``, ``2 nodes``, ``? nodes`` (unknown)."""
    return f"{n} {noun}" if n == 1 else f"{'?' if n is None else n} {noun}s"


def _method_summary(table) -> str:
    """How the ranges were chosen, from a ScaleTable's metadata: ``ranges: max`` or, for ``auto``,
    which table it kept and the output cosines that decided it (empty for a given table)."""
    from .scales import describe_method

    return describe_method(getattr(table, "metadata", None) or {})


def _float_parts_summary(parts) -> str:
    """Lines for --float-dtype: what was converted, the measured cosines, every node kept FP32."""
    lines = [str(parts).splitlines()[0]]
    if parts.measurement is not None:
        for name, m in parts.measurement["outputs"].items():
            lines[0] += (f" | output {name!r} cosine {m['cosine']:.5f} "
                         f"(FP32 float parts {m['cosine_fp32']:.5f}, {parts.measurement['samples']} samples)")
        rounding = parts.measurement.get("scale_rounding")
        if rounding:
            lines.append(f"  activation scales rounded {rounding['chosen']} (worst cosine drop: up "
                         f"{rounding['drop_up']:+.2g}, nearest {rounding['drop_nearest']:+.2g})")
    lines += [f"  kept FP32: {k}" for k in parts.kept]
    lines += [f"  note: {n}" for n in parts.notes]
    return "\n".join(lines)


def _optimize_summary(info) -> str:
    """One line for --optimize accuracy: each step's output cosine, gain and whether it was kept."""
    def step(s) -> str:
        if s["gain"] is None:
            return f"{s['step']} {s['cosine']:.5f}"
        return f"{s['step']} {s['cosine']:.5f} ({s['gain']:+.5f}, {'kept' if s['kept'] else 'undone'})"

    steps = "; ".join(step(s) for s in info["steps"])
    return (f"optimize accuracy: output cosine {info['cosine_before']:.5f} -> {info['cosine_after']:.5f} on "
            f"{info['eval_samples']} eval samples | {steps}")


def _mixed_summary(info) -> str:
    """One line for --min-cosine: the sites left float and the output cosine before and after."""
    names = [site["name"] for site in info["float_sites"]]
    shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    return (f"mixed precision: {len(names)} of {_count(info['sites'], 'site')} left float"
            + (f" ({shown})" if names else "")
            + f" | output cosine {info['cosine_before']:.5f} -> {info['cosine_after']:.5f} "
            f"(min {info['min_cosine']:g}, {info['eval_samples']} eval samples) | "
            f"{info.get('quantized_weighted_ops', info.get('int8_weighted_ops'))}/{info['weighted_ops']} "
            f"weighted ops {info.get('precision', 'int8').upper()}" + _ranges_summary(info.get("ranges"))
            + _judged_summary(info.get("judged")))


def _judged_summary(judged) -> str:
    """The range search's judged figure: the bound over the evaluation and calibration samples."""
    if not judged:
        return ""
    return (f" | judged on {judged['evaluation_samples']} eval + {judged['calibration_samples']} calibration "
            f"samples: cosine {judged['cosine']:.5f}, bound {judged['bound']:.5f}")


def _ranges_summary(ranges) -> str:
    """The range search's part of the --min-cosine line: the whole table it started from and the
    tensors whose range it changed."""
    from collections import Counter

    if not ranges:
        return ""
    kept = ranges.get("changes", []) + ranges.get("returned", [])
    changed = {t: c["to"] for c in kept for t in c["tensors"]}
    counts = Counter(changed.values())
    detail = f" ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))})" if counts else ""
    return f" | ranges: {ranges['start']} table, {_count(len(changed), 'tensor')} changed{detail}"


def cmd_check(args) -> int:
    """``onnx-qat check``: [`onnx_qat.check`][onnx_qat.check.check]; exit 1 when it finds an error."""
    _check_inputs(("model", args.model, "ModelError"))
    _check_outputs([("--precision-map", args.precision_map)], [args.model])
    from .check import check
    report = check(args.model, target=args.target)
    if args.json:
        _print_json(report.to_dict())
    elif not args.quiet:
        print(report)
    if args.precision_map is not None:
        report.precision_map.save(args.precision_map)
        if not args.json:
            _say(args, report.precision_map.summary())
            _say(args, f"wrote {args.precision_map}")
    return EXIT_OK if report else EXIT_PROBLEMS


def cmd_compare(args) -> int:
    """``onnx-qat compare``: [`onnx_qat.compare`][onnx_qat.runtime.compare.compare]; exit 1 when an output
    misses a threshold."""
    kw = {"max_abs": args.max_abs, "min_cosine": args.min_cosine, "min_sqnr_db": args.min_sqnr,
          "min_top1": args.min_top1, "batch_size": args.batch_size, "num_samples": args.num_samples,
          "exact_qdq": args.exact_qdq, "min_decisions": args.min_decisions}
    kw = {k: v for k, v in kw.items() if v is not None}
    layout = _layout_keywords(args)
    if args.min_decisions is not None and "state" not in layout:
        raise UsageError("--min-decisions applies only with --state (a stateful model's sequence)")
    _check_inputs(("reference model", args.reference, "ModelError"),
                  ("candidate model", args.candidate, "ModelError"))
    data = _data_source("--data", args.data)
    from .runtime.compare import compare
    result = compare(args.reference, args.candidate, data, progress=_progress(args), **kw, **layout)
    if args.json:
        _print_json(result.to_dict())
    elif not args.quiet:
        print(result)
        shown = data if isinstance(data, str) else ", ".join(map(str, data))
        print(f"compared on {_count(result.num_samples, 'sample')} of {shown} (reference "
              f"{args.reference}, candidate {args.candidate})")
    return EXIT_OK if result else EXIT_PROBLEMS


def _placement_dict(placement) -> dict:
    import dataclasses
    return {
        "activations": [dataclasses.asdict(m) for m in placement.activations],
        "weights": [dataclasses.asdict(m) for m in placement.weights],
        "decisions": [dataclasses.asdict(d) for d in placement.decisions],
        "notes": list(placement.notes),
        "subgraphs": placement.to_dict()["subgraphs"],
    }


def format_decisions(placement) -> str:
    """The ``inspect`` table: one row per decision (node, op, action, rule, reason; the nodes of quantized
    If branches and Loop/Scan bodies after the main graph's) and a summary line."""
    header = ("NODE", "OP", "ACTION", "RULE", "REASON")
    decisions = placement.all_decisions()
    rows = [(d.node, d.op_type, d.action, d.rule, d.reason) for d in decisions]
    widths = [min(max([len(header[i])] + [len(r[i]) for r in rows]), 48) for i in range(4)]
    lines = ["  ".join(col.ljust(w) for col, w in zip(header[:4], widths)) + "  " + header[4]]
    for row in rows:
        lines.append("  ".join(col.ljust(w) for col, w in zip(row[:4], widths)) + "  " + row[4])
    counts = {}
    for d in decisions:
        counts[d.action] = counts.get(d.action, 0) + 1
    lines.extend(f"note: {note}" for p in placement.nested() for note in p.notes)
    weights = sum(len(p.weight_tensors()) for p in placement.nested())
    lines.append(f"{_count(len(rows), 'node')}: " + ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
                 + f" | {_count(len(placement.activation_tensors()), 'activation tensor')}, "
                 f"{_count(weights, 'weight')} to quantize")
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    """``onnx-qat inspect``: [`onnx_qat.place`][onnx_qat.placement.policy.place], printed as a table (nothing
    is written)."""
    _check_inputs(("model", args.model, "ModelError"))
    from .placement import place
    placement = place(args.model, **_placement_keywords(args))
    if args.json:
        _print_json(_placement_dict(placement))
    else:
        print(format_decisions(placement))
    return EXIT_OK


def cmd_sensitivity(args) -> int:
    """``onnx-qat sensitivity``: [`onnx_qat.sensitivity`][onnx_qat.accuracy.sensitivity.sensitivity], printed
    as a ranked table."""
    calib = _calibration_keywords(args)
    layout = _layout_keywords(args)
    _check_inputs(("model", args.model, "ModelError"))
    data, eval_data = _data_source("--data", args.data), _data_source("--eval-data", args.eval_data)
    _check_outputs([("--output", args.output), ("--plot", args.plot)],
                   [args.model, *_data_paths(data, eval_data)])
    if args.output is not None and args.plot is not None and _same_path(args.output, args.plot):
        raise UsageError("--output and --plot name the same file")
    from .accuracy import sensitivity
    extra = {"percentile": calib.pop("percentile")} if "percentile" in calib else {}
    result = sensitivity(args.model, data, eval_data=eval_data, metric=args.metric,
                         progress=_progress(args), calibration_options=extra, **calib,
                         **_placement_keywords(args), **layout, workers=args.workers, ray=args.ray)
    _say(args, result.table(top=args.top))
    if args.output is not None:
        result.save(args.output)
        _say(args, f"wrote {args.output}")
    if args.plot is not None:
        result.plot(args.plot, top=args.top)
        _say(args, f"wrote {args.plot}")
    return EXIT_OK


def cmd_deploy(args) -> int:
    """``onnx-qat deploy``: `onnx_qat.deploy.command.run` (gate, onnxruntime validation, precision
    map, TensorRT build, timing, verification); exit 1 when the engine differs from onnxruntime, 2 when
    refused or TensorRT/GPU is missing (after writing the report of what was done)."""
    from .deploy.options import UsageError as DeployUsageError
    from .deploy.options import options_from_args
    try:
        opts = options_from_args(args, prog=PROG)
    except DeployUsageError as exc:
        raise UsageError(str(exc)) from None
    from .deploy.command import run_reported
    if args.quiet:  # only errors: the steps' lines go nowhere
        import io
        with contextlib.redirect_stdout(io.StringIO()):
            return run_reported(opts)
    return run_reported(opts)


# -- main -------------------------------------------------------------------------------------------
class _LogSetup:
    """Route the ``onnx_qat`` loggers to stderr for one run; undo it afterwards."""

    def __init__(self, verbose: int, quiet: bool):
        levels = {0: logging.WARNING, 1: logging.INFO}
        self.level = logging.ERROR if quiet else levels.get(verbose, logging.DEBUG)
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
        self.logger = logging.getLogger("onnx_qat")
        self.saved = (self.logger.level, self.logger.propagate)

    def __enter__(self):
        self.logger.addHandler(self.handler)
        self.logger.setLevel(self.level)
        self.logger.propagate = False
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.saved[0])
        self.logger.propagate = self.saved[1]
        return False


def _fail(message: str, code: int, verbose: int) -> int:
    if verbose:
        traceback.print_exc(file=sys.stderr)
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _stopped(what: str, code: int, verbose: int) -> int:
    """A signal stopped the run: one line (after any progress bar), the traceback with --verbose.

    Outputs were cleaned up while the exception unwound. When an onnxruntime call was interrupted,
    the process ends here with ``os._exit``: tearing the interpreter down after it would abort the
    process (`onnx_qat.runtime.interrupts.interrupted`).
    """
    from .runtime.interrupts import interrupted

    if verbose:
        traceback.print_exc(file=sys.stderr)
    print(f"\n{PROG}: {what}", file=sys.stderr)
    if interrupted():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _parse(argv: Optional[Sequence[str]]):
    """Parse ``argv``; returns (args, None) or (None, exit code) for --help/--version/usage errors."""
    parser = get_parser()
    try:
        return parser.parse_args(argv), None
    except SystemExit as exc:  # --help and --version exit 0 after printing
        return None, int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    except UsageError as exc:
        print(f"{PROG}: error: {exc}{_data_hint(str(exc), argv)}", file=sys.stderr)
        return None, EXIT_USAGE


def _data_hint(message: str, argv: Optional[Sequence[str]]) -> str:
    """A missing model after ``--data PATH MODEL``: say that --data took it (it takes several paths)."""
    words = [str(w) for w in (sys.argv[1:] if argv is None else argv)]
    after_ray = words[words.index("--ray") + 1] if "--ray" in words[:-1] else ""
    if "arguments are required" in message and after_ray.lower().endswith(".onnx"):
        return "; --ray takes an optional ADDRESS, so give the model before it (or write --ray=ADDRESS)"
    if "arguments are required" in message and ("--data" in words or "--eval-data" in words) and \
            any(w.lower().endswith(".onnx") for w in words):
        return "; --data and --eval-data take one or more paths, so give the model(s) before them"
    return ""


def main(argv: Optional[List[str]] = None) -> int:
    """Run ``onnx-qat`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args, code = _parse(argv)
    if args is None:
        return code
    verbose = args.verbose
    try:
        with _sigterm_unwinds(), _LogSetup(verbose, args.quiet):
            return args.handler(args)
    except KeyboardInterrupt:
        return _stopped("interrupted", EXIT_INTERRUPTED, verbose)
    except Terminated:
        return _stopped("terminated", EXIT_TERMINATED, verbose)
    except UsageError as exc:  # a rule between options: point at the command's help like argparse does
        text = str(exc) if "(see '" in str(exc) else f"{exc} (see '{PROG} {args.command} --help')"
        return _fail(text, EXIT_USAGE, verbose)
    except QatError as exc:
        return _fail(str(exc), EXIT_USAGE, verbose)
    except OSError as exc:  # the file system said no: name the file
        where = f"{exc.filename}: " if getattr(exc, "filename", None) else ""
        return _fail(f"{where}{exc.strerror or exc}", EXIT_USAGE, verbose)
    except Exception as exc:  # a bug: one line, the traceback only on request
        first = (str(exc).strip().splitlines() or [""])[0]
        return _fail(f"internal error: {type(exc).__name__}: {first[:300]} (re-run with --verbose for the "
                     "traceback)", EXIT_INTERNAL, verbose)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def console_main() -> None:
    """The ``onnx-qat`` command (and ``python -m onnx_qat``): `main`, then the process ends with its
    exit code. A run a signal stopped ends with ``os._exit`` once its outputs are cleaned up: the
    interpreter's teardown could otherwise abort the process inside onnxruntime (a session still
    building or a run just terminated on another thread), turning exit 130/143 into a crash."""
    code = main()
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)

