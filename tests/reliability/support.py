"""Shared helpers of the reliability tests: hashing, stderr reading, subprocess runs, tiny models.

The models are real ONNX graphs built with :mod:`tests.builders`; nothing here mocks
onnx or onnxruntime.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.builders import GraphBuilder, residual_block_model


@contextlib.contextmanager
def raises_input_error(error: type, match: Optional[str] = None):
    """``pytest.raises(error, match=match)`` that also asserts the error is a ``ValueError``, as every
    error a bad input causes is (``except ValueError`` catches ours as it catches NumPy's or onnx's)."""
    with pytest.raises(error, match=match) as info:
        yield info
    err = info.value
    assert isinstance(err, ValueError), f"{type(err).__name__} is not a ValueError: {err}"

ROOT = Path(__file__).resolve().parents[2]
ERROR_PREFIX = "onnx-qat: error: "


# --------------------------------------------------------------------------- files
def sha256(path) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def snapshot(directory) -> Dict[str, str]:
    """Relative path -> SHA-256 of every regular file under ``directory`` (recursively)."""
    base = Path(directory)
    out = {}
    for path in sorted(base.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(base))] = sha256(path)
    return out


def partial_files(directory) -> List[str]:
    """Leftover temporary files of the atomic writers (``*.partial``) under ``directory``."""
    return sorted(str(p) for p in Path(directory).rglob("*.partial"))


# --------------------------------------------------------------------------- stderr
def visible_lines(text: str) -> List[str]:
    """The lines a terminal would show: progress bars redrawn with carriage returns keep their
    last state; blank lines and progress-bar remnants are dropped."""
    lines = []
    for raw in text.split("\n"):
        shown = raw.split("\r")[-1].strip()
        if shown:
            lines.append(shown)
    return lines


def is_progress_line(line: str) -> bool:
    """A tqdm bar (``desc: 40%|####  | 4/10 [...]``)."""
    return "|" in line and ("it/s" in line or "batch/s" in line or "node/s" in line or "s/it" in line
                            or "?" in line or "%|" in line)


def error_lines(text: str) -> List[str]:
    """Visible stderr lines that are not progress bars."""
    return [line for line in visible_lines(text) if not is_progress_line(line)]


def assert_one_error_line(stderr: str, names: Iterable[str] = ()) -> str:
    """Exactly one visible line, ``onnx-qat: error: ...``, no traceback; it contains every ``names``."""
    assert "Traceback" not in stderr, f"traceback on stderr:\n{stderr}"
    lines = error_lines(stderr)
    assert len(lines) == 1, f"expected exactly one line on stderr, got {len(lines)}:\n{stderr}"
    line = lines[0]
    assert line.startswith(ERROR_PREFIX), f"not an onnx-qat error line: {line!r}"
    for name in names:
        assert str(name) in line, f"error line does not name {name!r}: {line!r}"
    return line


# --------------------------------------------------------------------------- processes
def cli_env(**extra) -> Dict[str, str]:
    """Environment for a CLI subprocess: the project on the path, TensorFlow quiet."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def cli_command(*args) -> List[str]:
    """``python -m onnx_qat ARGS`` with this interpreter."""
    return [sys.executable, "-m", "onnx_qat", *map(str, args)]


def run_cli(*args, cwd=None, env: Optional[Dict[str, str]] = None, timeout: float = 300):
    """Run ``onnx-qat`` in a subprocess and return the CompletedProcess (text mode)."""
    return subprocess.run(cli_command(*args), capture_output=True, text=True, cwd=cwd,
                          env=env or cli_env(), timeout=timeout)


# --------------------------------------------------------------------------- models
def save(model: onnx.ModelProto, path) -> Path:
    """Write ``model`` to ``path`` (a test fixture file, not under test) and return the path."""
    onnx.save(model, str(path))
    return Path(path)


def cnn_model() -> onnx.ModelProto:
    """A ResNet basic block, input ``input`` [1,16,8,8] (see :func:`tests.builders.residual_block_model`)."""
    return residual_block_model()


def cnn_data(num: int = 4, seed: int = 0) -> Dict[str, np.ndarray]:
    """Calibration samples for :func:`cnn_model`."""
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((num, 16, 8, 8)).astype(np.float32)}


def two_input_model() -> onnx.ModelProto:
    """Inputs ``a`` and ``b`` [1,16,8,8], each through a Conv, summed, Relu -> ``output``."""
    b = GraphBuilder("two_inputs", seed=3)
    xa = b.input("a", [1, 16, 8, 8])
    xb = b.input("b", [1, 16, 8, 8])
    ya = b.conv(xa, 16, 16, "conv_a")
    yb = b.conv(xb, 16, 16, "conv_b")
    s = b.node("Add", [ya, yb], name="add")
    b.node("Relu", [s], "output", name="relu")
    b.output("output")
    return b.build()


def relu_only_model() -> onnx.ModelProto:
    """input [1,4] -> Relu -> Sigmoid -> output: nothing TensorRT would quantize."""
    b = GraphBuilder("nothing", seed=0)
    x = b.input("input", [1, 4])
    y = b.node("Relu", [x], name="relu")
    b.node("Sigmoid", [y], "output", name="sigmoid")
    b.output("output")
    return b.build()


def external_data_model(directory, location: str) -> Path:
    """Write :func:`cnn_model` with every initializer as external data at ``location``.

    The data bytes are written to ``directory/weights.bin`` (so a location that resolves
    there is valid); the location string itself is written verbatim into the model.
    """
    directory = Path(directory)
    model = cnn_model()
    blob = bytearray()
    for init in model.graph.initializer:
        raw = numpy_helper.to_array(init).tobytes()
        offset = len(blob)
        blob.extend(raw)
        init.ClearField("raw_data")
        init.ClearField("float_data")
        init.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
            entry = init.external_data.add()
            entry.key, entry.value = key, value
    (directory / "weights.bin").write_bytes(bytes(blob))
    path = directory / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def quantized_model() -> onnx.ModelProto:
    """A float model that already holds one Q/DQ pair before its Conv."""
    model = cnn_model()
    first = model.graph.node[0]
    src = first.input[0]
    model.graph.initializer.extend([numpy_helper.from_array(np.array(0.05, np.float32), "pre_scale"),
                                    numpy_helper.from_array(np.array(0, np.int8), "pre_zp")])
    q = helper.make_node("QuantizeLinear", [src, "pre_scale", "pre_zp"], ["pre_q"], name="pre_q")
    dq = helper.make_node("DequantizeLinear", ["pre_q", "pre_scale", "pre_zp"], ["pre_dq"], name="pre_dq")
    first.input[0] = "pre_dq"
    nodes = [q, dq] + list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.checker.check_model(model)
    return model


# --------------------------------------------------------------------------- hard but valid models
def _branch(nodes, name, outputs, initializers=()):
    return helper.make_graph(nodes, name, [], outputs, list(initializers))


def if_model() -> onnx.ModelProto:
    """``conv`` -> If ``if`` (bool input ``cond``): then-branch Conv ``then_conv`` on the outer tensor,
    else-branch Relu ``else_relu`` -> ``output``. Inputs ``input`` [1,16,8,8] and ``cond`` (scalar bool)."""
    b = GraphBuilder("if_model", seed=1)
    x = b.input("input", [1, 16, 8, 8])
    cond = b.input("cond", [], TensorProto.BOOL)
    y = b.conv(x, 16, 16, "conv")
    values = (np.random.default_rng(2).standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32)
    w = numpy_helper.from_array(values, "then_w")
    then_conv = helper.make_node("Conv", [y, "then_w"], ["then_out"], name="then_conv", pads=[1, 1, 1, 1],
                                 kernel_shape=[3, 3])
    then_g = _branch([then_conv], "then",
                     [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, [1, 16, 8, 8])], [w])
    else_g = _branch([helper.make_node("Relu", [y], ["else_out"], name="else_relu")], "else",
                     [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, [1, 16, 8, 8])])
    b.nodes.append(helper.make_node("If", [cond], ["output"], name="if", then_branch=then_g,
                                    else_branch=else_g))
    b.output("output", [1, 16, 8, 8])
    return b.build()


def loop_model() -> onnx.ModelProto:
    """``conv`` -> Loop ``loop`` (2 trips of a Relu body) -> ``conv2`` -> ``output``; input [1,16,8,8]."""
    b = GraphBuilder("loop_model", seed=1)
    x = b.input("input", [1, 16, 8, 8])
    y = b.conv(x, 16, 16, "conv")
    b.const("trip", np.array(2, np.int64))
    b.const("cond0", np.array(True))
    body = helper.make_graph(
        [helper.make_node("Relu", ["carry"], ["carry_out"], name="body_relu"),
         helper.make_node("Identity", ["cin"], ["cout"], name="body_id")], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cin", TensorProto.BOOL, []),
         helper.make_tensor_value_info("carry", TensorProto.FLOAT, [1, 16, 8, 8])],
        [helper.make_tensor_value_info("cout", TensorProto.BOOL, []),
         helper.make_tensor_value_info("carry_out", TensorProto.FLOAT, [1, 16, 8, 8])])
    b.nodes.append(helper.make_node("Loop", ["trip", "cond0", y], ["loop_out"], name="loop", body=body))
    b.conv("loop_out", 16, 16, "conv2")
    b.nodes[-1].output[0] = "output"
    b.output("output", [1, 16, 8, 8])
    return b.build()


def custom_domain_model() -> onnx.ModelProto:
    """``conv`` -> ``myop`` (op ``MyOp`` of domain ``com.example``) -> ``relu`` -> ``output``."""
    b = GraphBuilder("custom", seed=1)
    x = b.input("input", [1, 16, 8, 8])
    y = b.conv(x, 16, 16, "conv")
    z = b.node("MyOp", [y], name="myop", domain="com.example", alpha=0.5)
    b.node("Relu", [z], "output", name="relu")
    b.output("output", [1, 16, 8, 8])
    graph = helper.make_graph(b.nodes, "custom", b.inputs, b.outputs, b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.example", 1)])
    model.ir_version = 8
    return model


def dynamic_model(dims) -> onnx.ModelProto:
    """input ``dims`` [N,16,H,W] (names for symbolic, None for unknown) -> ``conv`` -> ``relu``
    -> ``output``."""
    b = GraphBuilder("dynamic", seed=1)
    x = b.input("input", dims)
    b.relu(b.conv(x, 16, 16, "conv"), "relu")
    b.nodes[-1].output[0] = "output"
    b.output("output", None)
    return b.build()


def typed_inputs_model() -> onnx.ModelProto:
    """Inputs ``input`` float [1,16,8,8], ``ids`` int64 [1,4], ``mask`` bool [1,16,8,8]:
    Where(mask, conv(input), 0) -> ``relu`` -> ``output``; Gather(emb, ids) -> ``emb_out``."""
    b = GraphBuilder("typed_inputs", seed=1)
    x = b.input("input", [1, 16, 8, 8])
    ids = b.input("ids", [1, 4], TensorProto.INT64)
    mask = b.input("mask", [1, 16, 8, 8], TensorProto.BOOL)
    y = b.conv(x, 16, 16, "conv")
    z = b.node("Where", [mask, y, b.const("zero", np.array(0, np.float32))], name="where")
    emb = b.const("emb", np.random.default_rng(0).standard_normal((10, 16)).astype(np.float32))
    g = b.node("Gather", [emb, ids], name="gather", axis=0)
    b.node("Relu", [z], "output", name="relu")
    b.node("Identity", [g], "emb_out", name="ident")
    b.output("output")
    b.output("emb_out")
    return b.build()


def typed_inputs_data(num: int = 4, seed: int = 0) -> Dict[str, np.ndarray]:
    """Samples for :func:`typed_inputs_model` (int64 ids, bool mask)."""
    r = np.random.default_rng(seed)
    return {"input": r.standard_normal((num, 16, 8, 8)).astype(np.float32),
            "ids": r.integers(0, 10, (num, 4)).astype(np.int64), "mask": r.random((num, 16, 8, 8)) > 0.3}


# ----------------------------------------------------------------------------------- processes and signals
def process_state(pid: int) -> str:
    """``pid``'s state letter from ``/proc`` (``Z`` for a zombie), or ``"gone"``."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as ended)."""
    return process_state(pid) not in ("Z", "gone")


def cmdline(pid: int) -> str:
    """``pid``'s command line (arguments joined by spaces), or ``""`` once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(pid: int) -> List[int]:
    """Every live process below ``pid`` (children, their children...), read from ``/proc``."""
    parents: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def signal_and_time(proc, sig: int, finish) -> Tuple[float, object]:
    """Send ``sig`` to ``proc``, then call ``finish()`` (which waits for it to end, e.g.
    ``StderrReader.finish``): ``(seconds from the signal to the end, finish()'s result)``."""
    proc.send_signal(sig)
    sent = time.monotonic()
    result = finish()
    return time.monotonic() - sent, result


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids`` still alive (a test's clean-up of what it found left behind)."""
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
