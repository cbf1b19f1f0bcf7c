"""formats: INT8, FP8 and INT4 (RTN and AWQ) on a 4-layer BERT-style encoder and a ResNet-style CNN built
here (on the encoder also FP8 with the attention products kept float, ``include_attention=False``, INT4
with AWQ then GPTQ rounding at blocks of 128 and 64, and automatic mixed precision: FP8 with
``min_cosine=0.995`` and 0.996 and INT4 AWQ with ``min_cosine=0.99``, with the sites they leave float): cosine
to FP32 on unseen inputs, model file size against FP32, quantize time; NVIDIA ModelOpt's FP8 and INT4
modes on the same models and data when it is installed (in its own venv, see `MODELOPT_PYTHON`):
``modelopt.onnx.quantization.quantize(quantize_mode="fp8" | "int4")`` on CPU with FP32 kept for the
unquantized parts, INT4 with ``calibration_method="awq_clip"`` and block size 128 (its ``awq_lite`` fails
on these graphs: "cannot reshape array of size 256 into shape ()", ModelOpt 0.47.0).

The encoder is post-LayerNorm BERT (hidden 256, 4 heads, FFN 1024, sequence 64) with a few LayerNorm
output channels 6x larger than the others, as trained transformers have (Dettmers et al., "LLM.int8()",
2022: outlier features); the CNN is a stem and three residual stages (32/64/128 channels, Conv ->
BatchNormalization -> Relu) with a Gemm head on 3x32x32 inputs. Weights are seeded random (He scaled),
calibration uses 32 standard-normal samples and the cosine 64 other ones (16 for the encoder), over
all outputs flattened. FP8 runs in onnxruntime with graph optimisations off (see docs/formats.md).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from onnx_qat.errors import QatError

from .table import Goal, Row, skip

NAME = "formats"
#: The Python of a separate venv holding nvidia-modelopt (it pulls torch; never the project's venv):
#: ``make peers`` creates it inside the repository; ``ONNX_QAT_MODELOPT_PYTHON`` names another.
MODELOPT_PYTHON = Path(os.environ.get("ONNX_QAT_MODELOPT_PYTHON",
                                      Path(__file__).resolve().parents[2] / ".venv-peers" / "modelopt" / "bin"
                                      / "python"))


# --------------------------------------------------------------------------- models
class _Graph:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits = [], []

    def const(self, name: str, values) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.asarray(values), name))
        return name

    def node(self, op: str, inputs, name: str, **attrs) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op, list(inputs), [f"{name}_out"], name=name, **attrs))
        return f"{name}_out"

    def linear(self, x: str, din: int, dout: int, name: str, gain: float = 1.0) -> str:
        w = (self.rng.standard_normal((din, dout)) * gain / math.sqrt(din)).astype(np.float32)
        y = self.node("MatMul", [x, self.const(f"{name}.weight", w)], name)
        return self.node("Add", [y, self.const(f"{name}.bias", np.zeros(dout, np.float32))], f"{name}_bias")

    def model(self, name: str, inp: str, shape, out: str, out_shape):
        from onnx import TensorProto, helper

        graph = helper.make_graph(self.nodes, name,
                                  [helper.make_tensor_value_info(inp, TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info(out, TensorProto.FLOAT, out_shape)],
                                  self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="bench")
        model.ir_version = 8
        return model


def bert_encoder(layers: int = 4, dim: int = 256, heads: int = 4, seq: int = 64, ffn: int = 1024,
                 seed: int = 0):
    """Post-LN BERT encoder layers on hidden states ``input [N, seq, dim]`` -> ``output``."""
    g = _Graph(seed)
    dh = dim // heads
    split = g.const("split_shape", np.array([0, seq, heads, dh], np.int64))
    merge = g.const("merge_shape", np.array([0, seq, dim], np.int64))
    x = "input"
    for i in range(layers):
        p = f"l{i}"

        def heads_of(t, name, perm):
            r = g.node("Reshape", [t, split], f"{name}_split")
            return g.node("Transpose", [r], f"{name}_t", perm=perm)

        q = heads_of(g.linear(x, dim, dim, f"{p}.q"), f"{p}.q", [0, 2, 1, 3])
        k = heads_of(g.linear(x, dim, dim, f"{p}.k"), f"{p}.k", [0, 2, 3, 1])
        v = heads_of(g.linear(x, dim, dim, f"{p}.v"), f"{p}.v", [0, 2, 1, 3])
        s = g.node("MatMul", [q, k], f"{p}.scores")
        s = g.node("Mul", [s, g.const(f"{p}.scale", np.array(1 / math.sqrt(dh), np.float32))], f"{p}.scaled")
        a = g.node("Softmax", [s], f"{p}.softmax", axis=-1)
        c = g.node("MatMul", [a, v], f"{p}.context")
        c = g.node("Transpose", [c], f"{p}.merge_t", perm=[0, 2, 1, 3])
        c = g.node("Reshape", [c, merge], f"{p}.merge")
        h = g.node("Add", [x, g.linear(c, dim, dim, f"{p}.out")], f"{p}.res1")
        h = _layer_norm(g, h, dim, f"{p}.ln1")
        f = g.linear(h, dim, ffn, f"{p}.ffn1")
        d = g.node("Div", [f, g.const(f"{p}.sqrt2", np.array(math.sqrt(2), np.float32))], f"{p}.gelu_div")
        e = g.node("Add", [g.node("Erf", [d], f"{p}.gelu_erf"), g.const(f"{p}.one", np.array(1, np.float32))],
                   f"{p}.gelu_add")
        f = g.node("Mul", [f, e], f"{p}.gelu_mul")
        f = g.node("Mul", [f, g.const(f"{p}.half", np.array(.5, np.float32))], f"{p}.gelu")
        h = g.node("Add", [h, g.linear(f, ffn, dim, f"{p}.ffn2")], f"{p}.res2")
        x = _layer_norm(g, h, dim, f"{p}.ln2")
    g.nodes.append(__import__("onnx").helper.make_node("Identity", [x], ["output"], name="output"))
    return g.model("bert_encoder", "input", ["N", seq, dim], "output", ["N", seq, dim])


def _layer_norm(g: _Graph, x: str, dim: int, name: str) -> str:
    gamma = g.rng.uniform(0.8, 1.2, dim).astype(np.float32)
    gamma[g.rng.choice(dim, max(1, dim // 64), replace=False)] *= 6.0  # outlier features
    beta = (g.rng.standard_normal(dim) * 0.05).astype(np.float32)
    return g.node("LayerNormalization", [x, g.const(f"{name}.gamma", gamma), g.const(f"{name}.beta", beta)],
                  name, axis=-1, epsilon=1e-5)


def resnet_cnn(widths=(32, 64, 128), classes: int = 10, seed: int = 0):
    """A stem and one residual block per stage (Conv-BN-Relu, stride 2 between stages), then
    GlobalAveragePool -> Flatten -> Gemm, on ``input [N, 3, 32, 32]``."""
    g = _Graph(seed)

    def conv(x, cin, cout, name, stride=1, k=3, relu=True):
        w = (g.rng.standard_normal((cout, cin, k, k)) * math.sqrt(2 / (cin * k * k))).astype(np.float32)
        y = g.node("Conv", [x, g.const(f"{name}.w", w)], name, pads=[k // 2] * 4, strides=[stride, stride])
        bn = [g.const(f"{name}.bn.{p}", v) for p, v in (
            ("g", g.rng.uniform(0.5, 1.5, cout)), ("b", g.rng.normal(0, 0.1, cout)),
            ("m", g.rng.normal(0, 0.1, cout)), ("v", g.rng.uniform(0.5, 1.5, cout)))]
        y = g.node("BatchNormalization", [y] + [b for b in bn], f"{name}.bn")
        return g.node("Relu", [y], f"{name}.relu") if relu else y

    x = conv("input", 3, widths[0], "stem")
    cin = widths[0]
    for i, cout in enumerate(widths):
        stride = 1 if i == 0 else 2
        y = conv(conv(x, cin, cout, f"s{i}.a", stride), cout, cout, f"s{i}.b", relu=False)
        same = stride == 1 and cin == cout
        skip_ = x if same else conv(x, cin, cout, f"s{i}.proj", stride, k=1, relu=False)
        x = g.node("Relu", [g.node("Add", [skip_, y], f"s{i}.add")], f"s{i}.out")
        cin = cout
    x = g.node("Flatten", [g.node("GlobalAveragePool", [x], "gap")], "flatten")
    w = (g.rng.standard_normal((classes, cin)) / math.sqrt(cin)).astype(np.float32)
    g.nodes.append(__import__("onnx").helper.make_node(
        "Gemm", [x, g.const("fc.w", w), g.const("fc.b", np.zeros(classes, np.float32))], ["output"],
        name="fc", transB=1))
    model = g.model("resnet_cnn", "input", ["N", 3, 32, 32], "output", ["N", classes])
    for t in model.graph.initializer:  # BN parameters were made as float64
        if t.data_type == 11:
            from onnx import numpy_helper

            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))
    return model


# --------------------------------------------------------------------------- measuring
def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def _outputs(model, data) -> np.ndarray:
    from onnx_qat.runtime.sessions import run_model

    values = run_model(model, data, batch_size=8)
    return np.concatenate([v.ravel() for v in values.values()])


def _ours(path: Path, data: Path, precision: str, awq: bool, out: Path, **options):
    """``(seconds, QuantizeResult)`` to quantize ``path`` (calibration, AWQ and the mixed-precision
    search included) and write ``out``; ``options`` go to [`onnx_qat.quantize`][onnx_qat.quantize.quantize]
    (e.g. ``include_attention=False``, ``min_cosine=0.995``)."""
    import onnx_qat

    start = time.perf_counter()
    source = {} if precision == "int4" and not awq else {"data": str(data)}
    if precision != "int4":  # the figures in docs/formats.md are max calibration's (FP8: max is best)
        options = {"method": "max", **options}
    result = onnx_qat.quantize(str(path), output=str(out), precision=precision, progress=False, **source,
                               **options)
    return time.perf_counter() - start, result


#: ``(label, precision, calibration data used for AWQ, quantize options)`` of the onnx-qat rows; the
#: rows with options run on the encoder only.
FORMS = (("int8", "int8", False, {}), ("fp8", "fp8", False, {}),
         ("fp8 attention float", "fp8", False, {"include_attention": False}),
         ("fp8 GPTQ", "fp8", False, {"fp8_method": "gptq"}),
         ("fp8, min_cosine 0.995", "fp8", False, {"min_cosine": 0.995}),
         ("fp8, min_cosine 0.996", "fp8", False, {"min_cosine": 0.996}),
         ("int4 RTN", "int4", False, {}), ("int4 AWQ", "int4", True, {}),
         ("int4 AWQ+GPTQ", "int4", True, {"int4_method": "gptq"}),
         ("int4 AWQ+GPTQ block 64", "int4", True, {"int4_method": "gptq", "block_size": 64}),
         ("int4 AWQ, min_cosine 0.99", "int4", True, {"min_cosine": 0.99}))


def _float_sites_row(model: str, label: str, info) -> Row:
    """Sites the mixed-precision search left float, with the cosine it verified on its held-out data."""
    names = [s["name"] for s in info["float_sites"]]
    note = (f"of {info['sites']} sites: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}; cosine "
            f"{info['cosine_before']:.4f} -> {info['cosine_after']:.4f} on {info['eval_samples']} held-out "
            f"calibration samples")
    return Row(NAME, f"{model}: onnx-qat {label} sites left float", len(names), None, note, unit="")


def _modelopt(path: Path, data: Path, mode: str, out: Path) -> Optional[float]:
    """Seconds ModelOpt's ONNX PTQ took for ``mode`` (``fp8``/``int4``), in its own venv; None if absent."""
    if not MODELOPT_PYTHON.is_file():
        return None
    code = ("import sys, time, numpy as np\n"
            "from modelopt.onnx.quantization import quantize\n"
            "path, data, mode, out = sys.argv[1:5]\n"
            "calib = dict(np.load(data))\n"
            "start = time.perf_counter()\n"
            "kw = {'calibration_method': 'awq_clip', 'block_size': 128} if mode == 'int4' else {}\n"
            "quantize(path, quantize_mode=mode, calibration_data=calib, output_path=out,\n"
            "         calibration_eps=['cpu'], high_precision_dtype='fp32', log_level='ERROR', **kw)\n"
            "print('SECONDS', time.perf_counter() - start)\n")
    proc = subprocess.run([str(MODELOPT_PYTHON), "-c", code, str(path), str(data), mode, str(out)],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SECONDS")), None)
    if proc.returncode != 0 or line is None or not out.is_file():
        raise RuntimeError((proc.stderr.strip().splitlines() or ["no output"])[-1][:200])
    return float(line.split()[1])


def _inputs(shape, num: int, seed: int) -> Dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).standard_normal((num,) + tuple(shape)).astype(np.float32)}


def _measure(name: str, model, shape, workdir: Path, test_num: int, quick: bool) -> List[Row]:
    import onnx

    path = workdir / f"{name}.onnx"
    onnx.save(model, str(path))
    calib = workdir / f"{name}_calib.npz"
    np.savez(calib, **_inputs(shape, 8 if quick else 32, 1))
    test = _inputs(shape, 4 if quick else test_num, 2)
    reference = _outputs(model, test)
    size = path.stat().st_size
    rows = []
    for label, precision, awq, options in FORMS:
        if options and name != "bert":  # the CNN has no attention; the other variants are the encoder's
            continue
        out = workdir / f"{name}_{label.replace(' ', '_').replace(',', '')}.onnx"
        try:
            seconds, result = _ours(path, calib, precision, awq, out, **options)
        except QatError as exc:  # e.g. int4 with no MatMul/Gemm weight its block size divides
            rows.append(skip(NAME, f"{name}: onnx-qat {label} cosine to FP32", str(exc)[:200]))
            continue
        rows += _rows(name, f"onnx-qat {label}", out, reference, test, size, seconds, precision, awq,
                      _included(options))
        if result.accuracy is not None:
            rows.append(_float_sites_row(name, label, result.accuracy))
    for mode in ("fp8", "int4"):
        out = workdir / f"{name}_modelopt_{mode}.onnx"
        if quick:
            rows.append(skip(NAME, f"{name}: ModelOpt {mode} cosine to FP32", "not run by --quick"))
            continue
        try:
            seconds = _modelopt(path, calib, mode, out)
        except Exception as exc:  # its failure is a figure we report, not ours to fix
            rows.append(skip(NAME, f"{name}: ModelOpt {mode} cosine to FP32", f"ModelOpt failed: {exc}"))
            continue
        if seconds is None:
            rows.append(skip(NAME, f"{name}: ModelOpt {mode} cosine to FP32",
                             f"nvidia-modelopt is not installed at {MODELOPT_PYTHON} (`make peers` makes its "
                             "venv: it pulls torch)"))
            continue
        try:
            rows += _rows(name, f"ModelOpt {mode}", out, reference, test, size, seconds, mode, mode == "int4")
        except QatError as exc:  # onnxruntime cannot run what it wrote
            rows.append(skip(NAME, f"{name}: ModelOpt {mode} cosine to FP32",
                             f"ModelOpt wrote a model onnxruntime cannot run: {str(exc)[-160:]}"))
    return rows


def _included(options) -> str:
    """What the quantize time of a variant also covers."""
    gptq = "gptq" in (options.get("int4_method"), options.get("fp8_method"))
    parts = (["GPTQ rounding"] if gptq else []) + \
        (["the mixed-precision search and verification"] if "min_cosine" in options else [])
    return ", ".join(parts)


def _rows(model: str, label: str, out: Path, reference, test, size: int, seconds: float, precision: str,
          awq: bool, included: str = "") -> List[Row]:
    import onnx

    import onnx_qat

    q = onnx.load(str(out))
    cos = _cosine(reference, _outputs(q, test))
    report = onnx_qat.check(q)
    goal = {"fp8": Goal(">=", 0.995)}.get(precision)
    if precision == "int4" and awq and model == "bert":
        goal = Goal(">=", 0.99)
    note = f"{len(test['input'])} unseen samples; check {report.summary().split('|')[1].strip()}"
    rows = [Row(NAME, f"{model}: {label} cosine to FP32", cos, goal, note, unit="")]
    size_goal = Goal("<=", 0.3) if precision == "int4" and model == "bert" else None
    rows.append(Row(NAME, f"{model}: {label} file size / FP32", out.stat().st_size / size, size_goal,
                    f"{out.stat().st_size / 2 ** 20:.2f} MiB vs {size / 2 ** 20:.2f} MiB"))
    how = "round to nearest, no data" if precision == "int4" and not awq else \
        "calibration" + (" and AWQ search" if awq else "") + (f", {included}" if included else "") \
        + " included"
    rows.append(Row(NAME, f"{model}: {label} quantize time", seconds, None, how, unit="s"))
    return rows


def run(workdir: Path, *, quick: bool = False) -> List[Row]:
    """Measure and return the formats rows."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if quick:
        bert = bert_encoder(layers=1, dim=128, heads=2, seq=16, ffn=256)
        bert_shape, cnn = (16, 128), resnet_cnn(widths=(16, 32, 128))
    else:
        bert, bert_shape, cnn = bert_encoder(), (64, 256), resnet_cnn()
    return (_measure("bert", bert, bert_shape, workdir, 16, quick)
            + _measure("cnn", cnn, (3, 32, 32), workdir, 64, quick))


if __name__ == "__main__":
    for row in run(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/onnx-qat-bench-formats"),
                   quick="--quick" in sys.argv):
        print(json.dumps(row.to_dict()))
