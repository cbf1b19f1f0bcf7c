"""The rewrite from given scales, byte for byte: write what ``onnx_qat.quantize(model, scales=...)`` makes of
several graphs, so that two versions of the rewriter can be compared file by file.

``python tools/rewrite_identity.py OUT_DIR [--compare OTHER_DIR]`` writes, for each case, the Q/DQ model
(``<case>.onnx``) and a ``digests.json`` of their SHA-256; with ``--compare`` it also compares them with
another directory written the same way (e.g. by the previous version: ``git stash; python
tools/rewrite_identity.py /tmp/before; git stash pop; python tools/rewrite_identity.py /tmp/after --compare
/tmp/before``) and exits 1 when any file differs. The cases: a ResNet-style block, MobileNetV2 and a
transformer block built in code (``tests/builders.py``), each for the ``tensorrt`` and ``ort-cpu`` targets
and INT8, FP8 and INT4; the benchmark's residual net of 10,000 nodes; and the real PP-OCRv4 detector when
``make real-models`` has cached it (``~/.cache/onnx-qat-real-models``). Each model's ScaleTable comes from
``max`` calibration on fixed random inputs, computed once per run (the calibration is not what is compared),
and is written beside the models as ``<case>.scales.json``. ``--tables DIR`` reads the tables from such a
directory instead of calibrating: the rewrite from the very same given scales, whatever the calibration of
the version at hand gives. Compare across a change of the calibration that way: since 2026-11-27 calibrated
ranges are raised so that their scales are FP16 values (``onnx_qat.formats.scale_grid``), so every case
calibrated by an older version differs, while the rewrite from given scales stays byte for byte the same
(``python tools/rewrite_identity.py /tmp/after --tables /tmp/before --compare /tmp/before``, with
``/tmp/before`` written by a version that writes the tables).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REAL_DETECTOR = Path.home() / ".cache" / "onnx-qat-real-models" / "models" / "ocr-det.onnx"


def _models(tables=None):
    """``{name: (ModelProto, ScaleTable)}`` of every case's float model and its table (read from
    ``tables/<name>.scales.json`` when ``tables`` is a directory, else calibrated)."""
    import numpy as np
    import onnx

    import onnx_qat
    from tests import builders
    from tools.bench import models as bench_models

    built = {"resblock": builders.residual_block_model(projection=True),
             "mobilenet": builders.mobilenet_v2_model(size=32, width=0.5),
             "transformer": builders.transformer_block_model()}
    if REAL_DETECTOR.exists():
        built["ocr_det"] = onnx.load(str(REAL_DETECTOR))
    cases = {}
    for name, model in built.items():
        feeds = builders.random_inputs(model, num=4, seed=1)
        if name == "ocr_det":
            feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 64, 64)).astype(np.float32)}
        # the INT8 and FP8 placements' tensors, every Conv output (the ort-cpu form's requantization points)
        tensors = onnx_qat.place(model).activation_tensors() + \
            onnx_qat.place(model, precision="fp8").activation_tensors() + tuple(
            n.output[0] for n in model.graph.node if n.op_type == "Conv")
        if tables is not None:
            cases[name] = (model, onnx_qat.ScaleTable.load(Path(tables) / f"{name}.scales.json"))
            continue
        cases[name] = (model, onnx_qat.calibrate(model, feeds, method="max", progress=False,
                                                 tensors=tuple(dict.fromkeys(tensors))))
    residual, table = bench_models.residual_net(10_000)
    cases["residual_10k"] = (residual, table)
    return cases


def write(out: Path, tables=None) -> dict:
    """Write every case's Q/DQ model and ScaleTable under ``out`` (the tables read from ``tables``
    when given); ``{model file name: sha256}``."""
    import onnx_qat

    out.mkdir(parents=True, exist_ok=True)
    digests = {}
    for name, (model, table) in _models(tables).items():
        if name != "residual_10k":  # the benchmark's table is built, not calibrated
            table.save(out / f"{name}.scales.json")
        variants = [("tensorrt", "int8"), ("ort-cpu", "int8")]
        if name in ("resblock", "transformer"):
            variants.append(("tensorrt", "fp8"))
        if name == "transformer":
            variants.append(("tensorrt", "int4"))
        for target, precision in variants:
            path = out / f"{name}.{target}.{precision}.onnx"
            scales = table if precision != "int4" else None
            onnx_qat.quantize(model, str(path), scales=scales, target=target, precision=precision,
                              progress=False)
            digests[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (out / "digests.json").write_text(json.dumps(digests, indent=1, sort_keys=True))
    return digests


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory to write the Q/DQ models and digests.json to")
    parser.add_argument("--compare", type=Path, help="a directory written the same way to compare with")
    parser.add_argument("--tables", type=Path,
                        help="read each case's ScaleTable from DIR/<case>.scales.json instead of calibrating")
    args = parser.parse_args(argv)
    logging.getLogger("onnx_qat").setLevel(logging.ERROR)  # the cases' notes are not what is compared
    digests = write(args.out, args.tables)
    print(f"wrote {len(digests)} models to {args.out}")
    if args.compare is None:
        return 0
    other = json.loads((args.compare / "digests.json").read_text())
    differ = sorted(n for n in set(digests) | set(other) if digests.get(n) != other.get(n))
    for name in differ:
        print(f"DIFFERS: {name}")
    print(f"{len(digests) - len(differ)} of {len(set(digests) | set(other))} identical")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
