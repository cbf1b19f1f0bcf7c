"""rewrite_speed: ``onnx-qat quantize --scales`` on synthetic residual nets against two floors.

The graphsurgeon floor is what any onnx-graphsurgeon rewrite pays with no change at all: load the model,
import it, export it, save it. The protobuf floor is parsing and serializing the model alone (``onnx.load``
then ``onnx.save``): what no rewrite of the file can go below. All run as whole processes (interpreter
start and imports included) and each is measured alone (wall time, and its own peak RSS from
``os.wait4``), interleaved, the least disturbed of the repeats counting.

A third reference, the rewrite's native floor, runs only the native steps ``quantize`` itself cannot
drop while it keeps its guarantees: its imports, ``onnx.checker`` on the input's bytes and parsing them,
parsing the Q/DQ model ``quantize`` wrote (as its commit parses the result once) and serializing it (the
Python work of placement, insertion, the validation of the result by the edit's evidence and the check of
the result left out; ``onnx.checker`` on the written bytes is no longer one of its steps, see
docs/architecture.md, "Validation of the result"). Its ratio to the protobuf floor is the least any rewrite
of this design can reach (docs/performance.md, "The rewrite from given scales").
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Sequence

from . import models
from .measure import python_module, run_process
from .table import Goal, Row, ratio

NAME = "rewrite_speed"

FLOOR = ("import sys, onnx, onnx_graphsurgeon as gs\n"
         "graph = gs.import_onnx(onnx.load(sys.argv[1]))\n"
         "onnx.save(gs.export_onnx(graph), sys.argv[2])\n")
PROTOBUF_FLOOR = "import sys, onnx\nonnx.save(onnx.load(sys.argv[1]), sys.argv[2])\n"
NATIVE_FLOOR = ("import sys, onnx, onnx_qat.cli, onnx_qat.quantize, onnx_qat.check\n"
                "source = open(sys.argv[1], 'rb').read()\n"
                "onnx.checker.check_model(source)\n"
                "onnx.ModelProto.FromString(source)\n"
                "onnx.ModelProto.FromString(open(sys.argv[2], 'rb').read()).SerializeToString()\n")
#: Goal of the rewrite against the protobuf floor at the largest size (issue 30).
PROTOBUF_GOAL = 3.0


def _prepare(workdir: Path, nodes: int):
    import onnx

    model, table = models.residual_net(nodes)
    path, scales = workdir / f"residual_{nodes}.onnx", workdir / f"residual_{nodes}.scales.json"
    onnx.save(model, str(path))
    table.save(scales)
    return path, scales, len(model.graph.node)


def _measure(workdir: Path, nodes: int, repeats: int):
    path, scales, count = _prepare(workdir, nodes)
    floor_cmd = [sys.executable, "-c", FLOOR, str(path), str(workdir / f"floor_{nodes}.onnx")]
    proto_cmd = [sys.executable, "-c", PROTOBUF_FLOOR, str(path), str(workdir / f"protobuf_{nodes}.onnx")]
    ours_cmd = python_module("onnx_qat", "quantize", str(path), "--scales", str(scales), "-o",
                             str(workdir / f"qdq_{nodes}.onnx"), "--no-progress", "-q")
    native_cmd = [sys.executable, "-c", NATIVE_FLOOR, str(path), str(workdir / f"qdq_{nodes}.onnx")]
    floor, proto, ours, native = [], [], [], []
    for _ in range(repeats):  # interleaved
        floor.append(run_process(floor_cmd))
        proto.append(run_process(proto_cmd))
        ours.append(run_process(ours_cmd))
        native.append(run_process(native_cmd))  # reads what ours wrote
    best = lambda runs: min(runs, key=lambda r: r.seconds)  # noqa: E731  (least disturbed run)
    least_cpu = min(r.cpu_seconds for r in native)
    return count, best(floor), best(ours), best(proto), least_cpu


def run(workdir: Path, *, quick: bool = False, sizes: Sequence[int] = ()) -> List[Row]:
    """Measure and return the rewrite_speed rows."""
    sizes = tuple(sizes) or ((400, 2000) if quick else (10_000, 50_000))
    repeats = 1 if quick else 3
    results = {n: _measure(Path(workdir), n, repeats) for n in sizes}
    small, large = sizes[0], sizes[-1]
    rows = []
    for n in sizes:
        count, floor, ours, proto, native_cpu = results[n]
        rows.append(Row(NAME, f"quantize / protobuf floor (load + save), time, {count} nodes",
                        ratio(ours.seconds, proto.seconds), Goal("<=", PROTOBUF_GOAL) if n == large else None,
                        f"whole process, best of {repeats}: {ours.seconds:.1f} s vs {proto.seconds:.1f} s"))
        rows.append(Row(NAME, f"quantize / protobuf floor (load + save), CPU time, {count} nodes",
                        ratio(ours.cpu_seconds, proto.cpu_seconds), None,
                        f"user + system of the same runs: {ours.cpu_seconds:.1f} s vs "
                        f"{proto.cpu_seconds:.1f} s (less moved by other jobs than the wall time)"))
        rows.append(Row(NAME, f"native floor of quantize / protobuf floor, CPU time, {count} nodes",
                        ratio(native_cpu, proto.cpu_seconds), None,
                        f"imports, onnx.checker on the input bytes, parse and serialize, least CPU of "
                        f"{repeats}: {native_cpu:.1f} s vs {proto.cpu_seconds:.1f} s (what Python work is "
                        f"left of quantize's {ours.cpu_seconds:.1f} s: the rest)"))
        rows.append(Row(NAME, f"quantize / graphsurgeon floor, time, {count} nodes",
                        ratio(ours.seconds, floor.seconds), Goal("<=", 1.5, 2.0) if n == large else None,
                        f"whole process, best of {repeats}: {ours.seconds:.1f} s vs {floor.seconds:.1f} s"))
        rows.append(Row(NAME, f"quantize / graphsurgeon floor, peak RSS, {count} nodes",
                        ratio(ours.peak_rss_mib, floor.peak_rss_mib), None,
                        f"{ours.peak_rss_mib:.0f} MiB vs {floor.peak_rss_mib:.0f} MiB"))
    per_node = {n: results[n][2].seconds / results[n][0] for n in sizes}
    rows.append(Row(NAME, f"per-node cost growth, {results[large][0]} vs {results[small][0]} nodes",
                    ratio(per_node[large], per_node[small]), Goal("<=", 1.5),
                    f"{1e6 * per_node[small]:.0f} us/node at {results[small][0]}, "
                    f"{1e6 * per_node[large]:.0f} at {results[large][0]} (whole process)"))
    return rows
