"""Peer quantizers measured beside onnx-qat by ``tools/real_models.py`` (``make real-models``).

Each peer quantizes the float model on the same calibration inputs as onnx-qat; the model it writes
is then run by this project's onnxruntime, like ours, and judged by the same output cosine on the
same inputs. The peers and the recipes tried:

* ``ort``: onnxruntime's ``quantize_static`` (in this venv): QDQ, per-channel symmetric int8 weights,
  symmetric int8 activations (the form TensorRT runs), once per calibration method (``MinMax``,
  ``Entropy``, ``Percentile``) with only the inputs of Conv/ConvTranspose/Gemm/MatMul quantized (its
  most accurate placement on these models), and once with ``Entropy`` and its default op types.
* ``modelopt``: NVIDIA ModelOpt 0.47's ``modelopt.onnx.quantization.quantize(quantize_mode="int8")``
  on CPU with its default calibration (``entropy``) and with ``max``.
* ``quark``: AMD Quark 0.13's ONNX ``ModelQuantizer``: symmetric int8 (``S8S8``-style) with MinMax,
  Percentile, cross-layer equalization, and AdaRound (stopped after ``timeout`` seconds).
* ``aimet``: AIMET-ONNX 2.42's ``QuantizationSimModel`` (int8 weights per channel, int8 activations),
  plain and after its cross-layer equalization, exported as QDQ.

ModelOpt, Quark and AIMET pin versions of onnx/onnxruntime that conflict with this project's, so each
lives in a venv of its own under ``.venv-peers/`` (``make peers``) and runs as a subprocess of
``tools/peer_runner.py``; a peer whose venv is absent is reported as ``not installed (make peers)``,
one that fails or overruns its time bound as its one-line error or ``stopped after N s``.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = Path(os.environ.get("ONNX_QAT_PEERS_DIR", ROOT / ".venv-peers"))
RUNNER = Path(__file__).resolve().with_name("peer_runner.py")
#: peer -> (label in the tables, its venv under PEERS_DIR or None for this venv, recipes in order)
PEERS = {
    "ort": ("onnxruntime quantize_static", None, ("minmax", "entropy", "percentile", "entropy-all-ops")),
    "modelopt": ("ModelOpt 0.47", "modelopt", ("entropy", "max")),
    "quark": ("Quark 0.13", "quark", ("minmax", "percentile", "cle", "adaround")),
    "aimet": ("AIMET-ONNX 2.42", "aimet", ("tf-enhanced", "cle")),
}
NOT_INSTALLED = "not installed (make peers)"
RESULT_TAG = "PEER_RESULT "


@dataclass
class PeerRun:
    """One recipe of one peer on one model: the model it wrote (or why none), its time, and the
    output cosine against the float model on the calibration and the unseen inputs."""

    peer: str
    recipe: str
    seconds: float = 0.0
    model: Optional[str] = None
    error: str = ""
    cosine_calib: Optional[float] = None
    cosine_unseen: Optional[float] = None
    notes: Dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "", {})}


def venv_python(peer: str, peers_dir: Optional[Path] = None) -> Optional[Path]:
    """The Python of ``peer``'s venv (``sys.executable`` for the in-venv ``ort``), or None if absent."""
    venv = PEERS[peer][1]
    if venv is None:
        return Path(sys.executable)
    python = Path(peers_dir or PEERS_DIR) / venv / "bin" / "python"
    installed = python.parent.parent / ".installed"
    return python if python.is_file() and installed.is_file() else None


def one_line(text: str, limit: int = 160) -> str:
    """The last meaningful line of an error output (a traceback's exception line), cut to ``limit``."""
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    noise = ("warn", "[w:", "[i:", "info", "  ")
    useful = [ln for ln in lines if not ln.lower().startswith(noise)] or lines or ["no output"]
    line = useful[-1]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def parse_result(stdout: str) -> Optional[dict]:
    """The JSON that ``peer_runner.py`` prints after ``PEER_RESULT`` (its last such line), or None."""
    found = None
    for line in (stdout or "").splitlines():
        if line.startswith(RESULT_TAG):
            with contextlib.suppress(ValueError):
                found = json.loads(line[len(RESULT_TAG):])
    return found


def run_subprocess(peer: str, recipe: str, model: Path, calib: Path, out: Path, timeout: float,
                   peers_dir: Optional[Path] = None) -> PeerRun:
    """Run ``recipe`` of ``peer`` in its venv, bounded by ``timeout`` seconds (the whole process
    group is stopped then). The result says what happened in one line where no model came out."""
    python = venv_python(peer, peers_dir)
    run = PeerRun(peer, recipe)
    if python is None:
        run.error = NOT_INSTALLED
        return run
    start = time.perf_counter()
    # in the output's folder: Quark leaves quantized_info.csv and external-data files in its working one
    paths = [str(p.resolve()) for p in (model, calib, out)]
    proc = subprocess.Popen([str(python), str(RUNNER), peer, recipe, *paths], cwd=str(out.resolve().parent),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        run.seconds = time.perf_counter() - start
        run.error = f"stopped after {timeout:g} s"
        return run
    run.seconds = time.perf_counter() - start
    result = parse_result(stdout)
    if proc.returncode or result is None or not out.is_file():
        run.error = "failed: " + one_line(stderr if proc.returncode or result is None else "no model written")
        return run
    run.model, run.seconds = str(out), float(result.get("seconds", run.seconds))
    run.notes = {k: v for k, v in result.items() if k != "seconds"}
    return run


# --------------------------------------------------------------------------- onnxruntime (this venv)
WEIGHTED = ("Conv", "ConvTranspose", "Gemm", "MatMul")
ORT_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile",
               "entropy-all-ops": "Entropy"}


def ort_quantize(model: Path, calib: Dict[str, np.ndarray], out: Path, recipe: str,
                 batch: int = 8) -> PeerRun:
    """onnxruntime's ``quantize_static`` with ``recipe`` (see the module docstring) into ``out``."""
    run = PeerRun("ort", recipe)
    try:
        from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat,
                                              QuantType, quantize_static)
    except ImportError as exc:
        run.error = f"onnxruntime.quantization unavailable: {exc}"
        return run

    class Reader(CalibrationDataReader):
        def __init__(self):
            count = len(next(iter(calib.values())))
            self.feeds = iter([{k: v[i:i + batch] for k, v in calib.items()} for i in range(0, count, batch)])

        def get_next(self):
            return next(self.feeds, None)

    options = {} if recipe == "entropy-all-ops" else {"op_types_to_quantize": list(WEIGHTED)}
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines are prints
            quantize_static(str(model), str(out), Reader(), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                            calibrate_method=getattr(CalibrationMethod, ORT_METHODS[recipe]),
                            extra_options={"ActivationSymmetric": True, "WeightSymmetric": True}, **options)
    except Exception as exc:  # the peer failing on a model is a result, not a crash
        run.error = "failed: " + one_line(f"{type(exc).__name__}: {exc}")
    run.seconds = time.perf_counter() - start
    if not run.error:
        run.model = str(out)
    return run


# --------------------------------------------------------------------------- all peers on one model
def prepare(model: Path, out: Path) -> Path:
    """``model`` as the peers get it, written to ``out`` (``model`` itself where nothing changes):
    each Constant node's tensor an initializer, and opset 13 where it is older (onnx's version
    converter). The function is unchanged. The peers treat a weight held by a Constant node as an
    activation (onnxruntime's ``quantize_static`` calibrates it per tensor: the recognizer's 38 Conv
    weights lost their per-channel scales and its output cosine fell to 0.52); onnxruntime's
    ``quant_pre_process``, which its quantizer asks for, folds them the same way. Per-channel
    DequantizeLinear needs opset 13 (its ``axis``): onnxruntime writes an invalid model below it and
    Quark refuses."""
    import onnx
    from onnx import numpy_helper, version_converter

    proto = onnx.load(str(model))
    graph_outputs = {o.name for o in proto.graph.output}
    constants = [n for n in proto.graph.node if n.op_type == "Constant" and len(n.attribute) == 1
                 and n.attribute[0].name == "value" and n.output[0] not in graph_outputs]
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    if not constants and opset >= 13:
        return model
    for node in constants:
        tensor = numpy_helper.to_array(node.attribute[0].t)
        proto.graph.initializer.append(numpy_helper.from_array(tensor, node.output[0]))
        proto.graph.node.remove(node)
    if opset < 13:
        proto = version_converter.convert_version(proto, 13)
    onnx.save(proto, str(out))
    return out


def run_peers(model: Path, calib: Dict[str, np.ndarray], workdir: Path, *,
              peers: Sequence[str] = tuple(PEERS), timeout: float = 300.0, peers_dir: Optional[Path] = None,
              log=None) -> List[PeerRun]:
    """Every recipe of every peer in ``peers`` on ``model`` (after `prepare`), one at a time; the models
    go to ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    float_model, model = model, prepare(model, workdir / f"{model.stem}.prepared.onnx")
    npz = workdir / f"{float_model.stem}.calib.npz"
    np.savez(npz, **calib)
    runs = []
    for peer in peers:
        for recipe in PEERS[peer][2]:
            out = workdir / f"{float_model.stem}.{peer}-{recipe}.onnx"
            out.unlink(missing_ok=True)
            if log:
                log(f"[peers] {float_model.stem}: {peer} {recipe} ...")
            if peer == "ort":
                runs.append(ort_quantize(model, calib, out, recipe))
            else:
                runs.append(run_subprocess(peer, recipe, model, npz, out, timeout, peers_dir))
            if runs[-1].error == NOT_INSTALLED:  # one line for the whole peer
                break
    return runs


def best(runs: Sequence[PeerRun], key: str = "cosine_unseen") -> Optional[PeerRun]:
    """The run with the highest ``key`` cosine among those measured, or None."""
    measured = [r for r in runs if getattr(r, key) is not None]
    return max(measured, key=lambda r: getattr(r, key)) if measured else None


def cell(runs: Sequence[PeerRun], peer: str) -> str:
    """One peer's table cell: each recipe's unseen cosine (or its error), the one best on the
    calibration inputs in bold."""
    mine = [r for r in runs if r.peer == peer]
    if not mine:
        return "not measured"
    if len(mine) == 1 and mine[0].error == NOT_INSTALLED:
        return NOT_INSTALLED
    chosen = best(mine, "cosine_calib")
    parts = []
    for r in mine:
        if r.cosine_unseen is None:
            parts.append(f"{r.recipe}: {r.error or 'not measured'}")
            continue
        figure = f"{r.cosine_unseen:.4f}"
        when = "rescored" if r.notes.get("rescored") else f"{r.seconds:.0f} s"
        parts.append(f"{r.recipe} {'**' + figure + '**' if r is chosen else figure} ({when})")
    return "; ".join(parts)


def from_dicts(rows: Sequence[dict]) -> List[PeerRun]:
    """PeerRun objects back from their ``to_dict`` forms (the JSON of ``make real-models``)."""
    return [PeerRun(**row) for row in rows]
