"""The ``onnx-qat`` command line: a thin layer over the public API.

Every option is a keyword of a documented function (:func:`onnx_qat.calibrate`,
:func:`onnx_qat.quantize`, :func:`onnx_qat.check`, :func:`onnx_qat.compare`,
:func:`onnx_qat.place`, fields of :class:`onnx_qat.config.QuantizeConfig`). Building
the parser imports nothing heavy (no numpy, onnx, onnxruntime): ``onnx-qat --help``
answers at once; each command imports the API it needs when it runs.

Exit codes:
    0   success
    1   ``check`` found an error, ``compare`` failed, or ``quantize`` wrote a model ``check`` refuses
    2   bad input or usage: one line ``onnx-qat: error: ...`` on stderr
    3   internal error (a bug): one line plus "re-run with --verbose for the traceback"
    130 interrupted (Ctrl-C, SIGINT); 143 terminated (SIGTERM). Either way atomic writers remove
        their temporary files, so no partial output is left.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import re
import signal
import sys
import traceback
from typing import List, Optional, Sequence

from . import __version__
from .config import TARGETS
from .formats.numeric import FP8_METHODS, INT4_METHODS, PRECISIONS
from .argtypes import any_number, number_in, positive_number, whole_number
from .errors import QatError

PROG = "onnx-qat"
METHODS = ("max", "percentile", "entropy", "mse", "auto")

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
    """While running a command, turn SIGTERM into :class:`Terminated` (main thread only)."""
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
                       help="how activation ranges are chosen from the data (default: auto; with "
                            "--min-cosine and for sensitivity: max; auto: of max everywhere, the "
                            "least-error range per tensor and entropy everywhere, the table whose output "
                            "is closest to the float model's on the calibration data)")
    group.add_argument("--percentile", metavar="P", type=number_in(0.0, 100.0, low_open=True), default=None,
                       help="percentile of |x| kept by --method percentile, in (0, 100] (default 99.99)")
    group.add_argument("--batch-size", metavar="N", type=whole_number(1), default=None,
                       help="samples per onnxruntime run (default: the library default)")


def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate",
                       help="run the float model on data; write activation ranges (ScaleTable JSON)",
                       description="Run MODEL in onnxruntime on the samples in --data and write the "
                                   "ranges of "
                                   "the tensors placement will quantize as a ScaleTable JSON file.")
    p.add_argument("model", metavar="MODEL", help="float ONNX model")
    p.add_argument("--data", metavar="NPZ", required=True,
                   help=".npz calibration data: keys are graph input names, first axis is samples")
    p.add_argument("-o", "--output", metavar="SCALES.json", required=True, help="ScaleTable JSON to write")
    _calibration_options(p)
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
    source.add_argument("--data", metavar="NPZ", help=".npz calibration data (see 'calibrate'); with "
                                                      "--precision int4, data for the activation-aware "
                                                      "weight scales (optional)")
    source.add_argument("--scales", metavar="JSON",
                        help="ScaleTable JSON (from 'calibrate' or your own tool)")
    p.add_argument("--target", choices=TARGETS, default=None,
                   help="deployment form: tensorrt (default) or ort-cpu (fast onnxruntime CPU kernels)")
    p.add_argument("--report", metavar="R.json", default=None,
                   help="also write a JSON report: placement decisions and the check result")
    _calibration_options(p)
    _placement_options(p)
    _mixed_precision_options(p)
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_quantize)


def _mixed_precision_options(parser: argparse.ArgumentParser) -> None:
    """Keywords of onnx_qat.quantize for automatic mixed precision: min_cosine, max_float_sites, eval_data."""
    group = parser.add_argument_group("automatic mixed precision (onnx_qat.quantize)")
    group.add_argument("--min-cosine", metavar="C", type=number_in(0.0, 1.0, low_open=True), default=None,
                       help="leave the fewest sites in float so the output cosine against the float model "
                            "reaches C on the evaluation data (in any --precision; an int4 site is one "
                            "weight); exit 2 and write nothing when it cannot")
    group.add_argument("--max-float-sites", metavar="N", type=whole_number(0), default=None,
                       help="with --min-cosine: at most N sites in float (default: no limit)")
    group.add_argument("--eval-data", metavar="NPZ", default=None,
                       help="with --min-cosine or --optimize: .npz data the cosine is measured on (default: "
                            "the last quarter of --data, which calibration then does not see)")
    group.add_argument("--optimize", choices=("accuracy",), default=None,
                       help="accuracy: also run cross-layer equalization, activation smoothing, "
                            "error-compensated INT8 weight rounding and bias correction, each kept only "
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
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_check)


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="numerics of two models on the same data (exit 1 when it fails)",
                       description="Run REFERENCE and CANDIDATE in onnxruntime on --data and compare every "
                                   "output. Exit 1 when an output misses a threshold.")
    p.add_argument("reference", metavar="REFERENCE", help="reference ONNX model (e.g. the float model)")
    p.add_argument("candidate", metavar="CANDIDATE", help="candidate ONNX model (e.g. the Q/DQ model)")
    p.add_argument("--data", metavar="NPZ", required=True, help=".npz data: keys are graph input names")
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
                       help="use only the first N samples")
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
                       description="Calibrate MODEL once on --data, then measure for every site placement "
                                   "quantizes the output error with only that site quantized (INT8, or "
                                   "--precision) and with every site but it, on --eval-data (default: a "
                                   "held-out quarter of --data). Prints the ranking; see "
                                   "docs/sensitivity.md.")
    p.add_argument("model", metavar="MODEL", help="float ONNX model")
    p.add_argument("--data", metavar="NPZ", required=True, help=".npz calibration data (see 'calibrate')")
    p.add_argument("--eval-data", metavar="NPZ", default=None,
                   help=".npz evaluation data (default: the last quarter of --data, not calibrated on)")
    p.add_argument("-o", "--output", metavar="REPORT.json", default=None, help="write the result as JSON")
    p.add_argument("--plot", metavar="CHART.png", default=None,
                   help="write a ranked bar chart of the most sensitive sites (needs matplotlib)")
    p.add_argument("--top", metavar="N", type=whole_number(1), default=20,
                   help="sites shown in the table and the chart (default 20)")
    p.add_argument("--metric", choices=("cosine", "sqnr", "max_abs"), default="cosine",
                   help="what ranks the sites (default cosine; all three are reported)")
    _calibration_options(p)
    _placement_options(p)
    _global_options(p, suppress=True)
    p.set_defaults(handler=cmd_sensitivity)


def get_parser() -> argparse.ArgumentParser:
    """The ``onnx-qat`` argument parser (cheap: imports nothing heavy)."""
    parser = _Parser(prog=PROG, description="Place INT8 QuantizeLinear/DequantizeLinear pairs in ONNX models "
                     "the way TensorRT wants them; check and compare Q/DQ models.",
                     epilog="exit codes: 0 success, 1 check/compare found problems, 2 bad input or usage, "
                            "3 internal error, 130 interrupted, 143 terminated")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    _global_options(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for add in (_add_calibrate, _add_quantize, _add_check, _add_compare, _add_inspect, _add_sensitivity):
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
        if not p.is_file():
            raise getattr(errors, error)(f"{what} {p} is not a file")


def _check_outputs(outputs, inputs) -> None:
    """Refuse bad output paths before any work (OutputError, exit 2)."""
    from .io.files import check_output_path
    for option, path in outputs:
        if path is not None:
            check_output_path(path, inputs=tuple(inputs), what=option)


# -- the commands -------------------------------------------------------------------------------------
def cmd_calibrate(args) -> int:
    """``onnx-qat calibrate``: :func:`onnx_qat.calibrate` with ``output`` (the ScaleTable JSON)."""
    kw = {**_calibration_keywords(args), **_placement_keywords(args)}
    _check_inputs(("model", args.model, "ModelError"), ("--data", args.data, "DataError"))
    _check_outputs([("--output", args.output)], [args.model, args.data])
    from .calibration import DEFAULT_METHOD, calibrate
    table = calibrate(args.model, args.data, output=args.output, progress=_progress(args), **kw)
    _say(args, f"wrote {args.output}: {len(table.activations)} activation ranges, "
               f"{len(table.weights)} weight "
               f"ranges (method {kw.get('method', DEFAULT_METHOD)})")
    return EXIT_OK


def cmd_quantize(args) -> int:
    """``onnx-qat quantize``: :func:`onnx_qat.quantize`, then :func:`onnx_qat.check` on the result."""
    if args.scales is not None:
        given = [opt for opt, val in (("--method", args.method), ("--percentile", args.percentile),
                                      ("--batch-size", args.batch_size)) if val is not None]
        if given:
            raise UsageError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} only with --data, "
                             "not with --scales")
    calib = _calibration_keywords(args) if args.data is not None else {}
    _check_inputs(("model", args.model, "ModelError"), ("--data", args.data, "DataError"),
                  ("--scales", args.scales, "ScalesError"))
    _check_outputs([("--output", args.output), ("--report", args.report)],
                   [args.model, args.data, args.scales])
    if args.report is not None and _same_path(args.report, args.output):
        raise UsageError("--report and --output name the same file")
    if args.data is None and args.scales is None and getattr(args, "precision", None) != "int4":
        raise UsageError("one of the arguments --data --scales is required")
    mixed = {k: v for k, v in (("min_cosine", args.min_cosine), ("max_float_sites", args.max_float_sites),
                               ("eval_data", args.eval_data)) if v is not None}
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
    _check_inputs(("--eval-data", args.eval_data, "DataError"))
    from .quantize import quantize
    result = quantize(args.model, output=args.output, scales=args.scales, data=args.data,
                      progress=_progress(args), **calib, **_placement_keywords(args), **mixed)
    _say(args, _quantize_summary(args, result))
    if result.accuracy is not None:
        _say(args, _optimize_summary(result.accuracy) if "steps" in result.accuracy
             else _mixed_summary(result.accuracy))
    report = _check_written(result.model, args.output, result.target)
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


def _check_written(model, output, target):
    """``check`` of the model ``quantize`` just wrote to ``output`` (after ``onnx.checker`` passed
    on the bytes written): the very ModelProto it serialized there, checked by the rules of its
    ``target``, without reading the file back (which would parse it and hold a second copy)."""
    from .check import check

    return check(model, target=target, path=output)


def _quantize_summary(args, result) -> str:
    """One line: what was written and how much was quantized."""
    s = dict(getattr(result, "summary", {}) or {})
    precision = getattr(result, "precision", "int8")
    return (f"wrote {args.output} | target {result.target}"
            f"{'' if precision == 'int8' else ' | precision ' + precision} | "
            f"{s.get('activations', '?')} activations and "
            f"{s.get('weights', '?')} weights quantized, {s.get('skipped_nodes', '?')} nodes skipped | "
            f"{s.get('quantize_linear', '?')} QuantizeLinear, "
            f"{s.get('dequantize_linear', '?')} DequantizeLinear")


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
    return (f"mixed precision: {len(names)} of {info['sites']} site(s) left float"
            + (f" ({shown})" if names else "")
            + f" | output cosine {info['cosine_before']:.5f} -> {info['cosine_after']:.5f} "
            f"(min {info['min_cosine']:g}, {info['eval_samples']} eval samples) | "
            f"{info.get('quantized_weighted_ops', info.get('int8_weighted_ops'))}/{info['weighted_ops']} "
            f"weighted ops {info.get('precision', 'int8').upper()}")


def cmd_check(args) -> int:
    """``onnx-qat check``: :func:`onnx_qat.check`; exit 1 when it finds an error."""
    _check_inputs(("model", args.model, "ModelError"))
    from .check import check
    report = check(args.model, target=args.target)
    if args.json:
        _print_json(report.to_dict())
    elif not args.quiet:
        print(report)
    return EXIT_OK if report else EXIT_PROBLEMS


def cmd_compare(args) -> int:
    """``onnx-qat compare``: :func:`onnx_qat.compare`; exit 1 when an output misses a threshold."""
    kw = {"max_abs": args.max_abs, "min_cosine": args.min_cosine, "min_sqnr_db": args.min_sqnr,
          "min_top1": args.min_top1, "batch_size": args.batch_size, "num_samples": args.num_samples}
    kw = {k: v for k, v in kw.items() if v is not None}
    _check_inputs(("reference model", args.reference, "ModelError"),
                  ("candidate model", args.candidate, "ModelError"), ("--data", args.data, "DataError"))
    from .runtime.compare import compare
    result = compare(args.reference, args.candidate, args.data, progress=_progress(args), **kw)
    if args.json:
        _print_json(result.to_dict())
    elif not args.quiet:
        print(result)
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
    lines.append(f"{len(rows)} nodes: " + ", ".join(f"{n} {a}" for a, n in sorted(counts.items()))
                 + f" | {len(placement.activation_tensors())} activation tensors, "
                 f"{weights} weights to quantize")
    return "\n".join(lines)


def cmd_inspect(args) -> int:
    """``onnx-qat inspect``: :func:`onnx_qat.place`, printed as a table (nothing is written)."""
    _check_inputs(("model", args.model, "ModelError"))
    from .placement import place
    placement = place(args.model, **_placement_keywords(args))
    if args.json:
        _print_json(_placement_dict(placement))
    else:
        print(format_decisions(placement))
    return EXIT_OK


def cmd_sensitivity(args) -> int:
    """``onnx-qat sensitivity``: :func:`onnx_qat.sensitivity`, printed as a ranked table."""
    calib = _calibration_keywords(args)
    _check_inputs(("model", args.model, "ModelError"), ("--data", args.data, "DataError"),
                  ("--eval-data", args.eval_data, "DataError"))
    _check_outputs([("--output", args.output), ("--plot", args.plot)],
                   [args.model, args.data, args.eval_data])
    if args.output is not None and args.plot is not None and _same_path(args.output, args.plot):
        raise UsageError("--output and --plot name the same file")
    from .accuracy import sensitivity
    extra = {"percentile": calib.pop("percentile")} if "percentile" in calib else {}
    result = sensitivity(args.model, args.data, eval_data=args.eval_data, metric=args.metric,
                         progress=_progress(args), calibration_options=extra, **calib,
                         **_placement_keywords(args))
    _say(args, result.table(top=args.top))
    if args.output is not None:
        result.save(args.output)
        _say(args, f"wrote {args.output}")
    if args.plot is not None:
        result.plot(args.plot, top=args.top)
        _say(args, f"wrote {args.plot}")
    return EXIT_OK


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
    """A signal stopped the run: one line (after any progress bar), the traceback with --verbose."""
    if verbose:
        traceback.print_exc(file=sys.stderr)
    print(f"\n{PROG}: {what}", file=sys.stderr)
    return code


def _parse(argv: Optional[Sequence[str]]):
    """Parse ``argv``; returns (args, None) or (None, exit code) for --help/--version/usage errors."""
    parser = get_parser()
    try:
        return parser.parse_args(argv), None
    except SystemExit as exc:  # --help and --version exit 0 after printing
        return None, int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return None, EXIT_USAGE


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
    except (QatError, UsageError) as exc:
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
