"""``python -m tools.bench``: run the benchmarks, print one table, write bench/results.md and results.json.

Options: ``--quick`` (tiny models, seconds; what the smoke test runs), ``--only NAME`` (repeatable),
``--out DIR`` (default ``bench``), ``--workdir DIR`` (models and data; default a temporary directory).
"""
from __future__ import annotations

import argparse
import logging
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import (calibration, calibration_scale, cpu_latency, cpu_models, export_speed, float_parts,
               format_peers, qat_step, rewrite_speed, sensitivity, workers)
from .table import Row, format_table, write_results

BENCHMARKS = {"cpu_latency": cpu_latency.run, "cpu_models": cpu_models.run,
              "cpu_models_avx2": cpu_models.run_avx2,
              "rewrite_speed": rewrite_speed.run, "calibration": calibration.run,
              "calibration_scale": calibration_scale.run, "qat_step": qat_step.run,
              "formats": format_peers.run, "sensitivity": sensitivity.run, "export_speed": export_speed.run,
              "float_parts": float_parts.run, "workers": workers.run}


def get_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``python -m tools.bench``."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny models: checks the tables, not the goals")
    parser.add_argument("--only", action="append", choices=sorted(BENCHMARKS), default=None,
                        help="run only this benchmark (repeatable)")
    parser.add_argument("--out", default="bench",
                        help="where results.md and results.json go (default: bench)")
    parser.add_argument("--workdir", default=None, help="models and data (default: a temporary directory)")
    return parser


def run_all(names, workdir: Path, quick: bool):
    """Run the named benchmarks in ``workdir``; a benchmark that fails yields one SKIP row with its error."""
    rows = []
    for name in names:
        start = time.perf_counter()
        print(f"[bench] {name}{' (quick)' if quick else ''} ...", file=sys.stderr, flush=True)
        try:
            rows.extend(BENCHMARKS[name](workdir, quick=quick))
        except Exception as exc:  # one failing benchmark must not hide the others
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(name, "benchmark failed", None, None, f"{type(exc).__name__}: {exc}"[:300]))
        print(f"[bench] {name} done in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    """Entry point: returns 0 when every benchmark produced its rows, 1 when one failed."""
    args = get_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    names = args.only or list(BENCHMARKS)
    given = argv if argv is not None else sys.argv[1:]
    command = "python -m tools.bench " + " ".join(shlex.quote(a) for a in given)
    start = time.perf_counter()
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        rows = run_all(names, Path(args.workdir), args.quick)
    else:
        with tempfile.TemporaryDirectory(prefix="onnx-qat-bench-") as tmp:
            rows = run_all(names, Path(tmp), args.quick)
    seconds = time.perf_counter() - start
    print(format_table(rows))
    path = write_results(rows, args.out, command=command.strip(), quick=args.quick, seconds=seconds)
    print(f"wrote {path} and {path.with_name('results.json')} ({seconds:.0f} s)", file=sys.stderr)
    return 1 if any(r.figure == "benchmark failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
