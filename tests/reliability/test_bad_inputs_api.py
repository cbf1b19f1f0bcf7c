"""The Python API answers every bad input with the right QatError subclass, one line naming
the file or option, inputs unchanged and nothing written; hard-but-valid models (If/Loop
subgraphs, custom-domain ops, dynamic and symbolic shapes, int64/bool inputs) are handled
(issue 8, items 1-4).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.errors import ConfigError, DataError, ModelError, OutputError, QatError, ScalesError
from tests.builders import assert_check_clean, cosine, run
from tests.reliability import cases, support


@pytest.mark.parametrize("case", cases.CASES, ids=[c.id for c in cases.CASES])
def test_bad_input_api(case, workspace_factory):
    ws = workspace_factory(case)
    before = support.snapshot(ws.dir)
    with support.raises_input_error(QatError) as info:
        ws.call_api()
    err = info.value
    assert isinstance(err, case.error), f"{type(err).__name__} instead of {case.error.__name__}: {err}"
    message = str(err)
    assert "\n" not in message and message.strip() == message
    for name in case.names(ws):
        assert name in message, f"message does not name {name!r}: {message!r}"
    assert support.snapshot(ws.dir) == before
    assert not support.partial_files(ws.dir)
    assert not ws.marker.exists(), "an object array was unpickled"


# ----------------------------------------------------------------------------------- in-memory inputs
def _proto_bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


@pytest.mark.parametrize("data,words", [
    ({"input": np.full((2, 16, 8, 8), np.nan, np.float32)}, ("NaN",)),
    ({"input": np.zeros((2, 3, 8, 8), np.float32)}, ("shape",)),
    ({"input": np.array([{"a": 1}, {"b": 2}], dtype=object)}, ("dtype",)),
    ({"input": np.zeros((0, 16, 8, 8), np.float32)}, ("zero samples",)),
    ([{"input": np.zeros((1, 16, 8, 8), np.float32)}, {"other": np.zeros((1, 16, 8, 8), np.float32)}],
     ("feed 1", "'other'")),
    ("not a file name.npz", ("does not exist",)),
    (42, ("int",)),
], ids=["nan", "shape", "object", "empty", "batch-keys", "missing-path", "wrong-type"])
def test_in_memory_bad_data_leaves_the_callers_objects_alone(data, words):
    model = support.cnn_model()
    model_before = _proto_bytes(model)
    arrays_before = [v.copy() for v in (data.values() if isinstance(data, dict) else [])]
    with support.raises_input_error(DataError) as info:
        onnx_qat.quantize(model, data=data, progress=False)
    for word in words:
        assert word in str(info.value)
    assert _proto_bytes(model) == model_before, "the caller's ModelProto was modified"
    if isinstance(data, dict):
        for kept, now in zip(arrays_before, data.values()):
            assert kept.dtype == now.dtype
            assert kept.dtype == object or np.array_equal(kept, now, equal_nan=True)


@pytest.mark.parametrize("kwargs,error,words", [
    ({"min_channels": -1}, ConfigError, ("min_channels",)),
    ({"target": "gpu"}, ConfigError, ("target", "gpu")),
    ({"exclude_nodes": ["conv[("]}, ConfigError, ("exclude_nodes",)),
    ({"method": "median"}, ConfigError, ("median",)),
    ({"batch_size": 0}, (ConfigError, DataError), ("batch",)),
    ({"percentile": 120.0, "method": "percentile"}, ConfigError, ("percentile",)),
], ids=["min-channels", "target", "regex", "method", "batch-size", "percentile"])
def test_bad_options_are_config_errors(kwargs, error, words):
    model = support.cnn_model()
    before = _proto_bytes(model)
    with support.raises_input_error(error) as info:
        onnx_qat.quantize(model, data=support.cnn_data(), progress=False, **kwargs)
    for word in words:
        assert word in str(info.value)
    assert _proto_bytes(model) == before


def test_scales_and_data_together_or_neither():
    model = support.cnn_model()
    table = onnx_qat.ScaleTable({"input": 1.0})
    with support.raises_input_error(ConfigError, match="exactly one"):
        onnx_qat.quantize(model, scales=table, data=support.cnn_data(), progress=False)
    with support.raises_input_error(ConfigError, match="exactly one"):
        onnx_qat.quantize(model, progress=False)


@pytest.mark.parametrize("raw", [b"", b"\x08\x07", cases.GARBAGE, cases.JSON_MODEL],
                         ids=["empty", "header-only", "random", "json"])
def test_load_model_refuses_non_models(tmp_path, raw):
    path = tmp_path / "m.onnx"
    path.write_bytes(raw)
    with support.raises_input_error(ModelError) as info:
        onnx_qat.load_model(path)
    assert "m.onnx" in str(info.value)
    assert path.read_bytes() == raw


@pytest.mark.parametrize("table,words", [
    ({"activations": {"x": float("nan")}}, ("x", "finite")),
    ({"activations": {"x": float("inf")}}, ("x", "finite")),
    ({"activations": {"x": -2.0}}, ("x", "> 0")),
    ({"activations": {"x": 0}}, ("x", "> 0")),
    ({"activations": {"x": True}}, ("x", "number")),
    ({"activations": {"": 1.0}}, ("name",)),
    ({"weights": {"w": {"axis": None, "amax": [1.0, 2.0]}}}, ("w", "one value")),
    ({"weights": {"w": {"axis": 0, "amax": []}}}, ("w", "empty")),
    ({"weights": {"w": {"axis": 0.5, "amax": [1.0]}}}, ("w", "axis")),
    ({"weights": {"w": {"axis": 0, "amax": [1.0], "scale": 2}}}, ("w",)),
], ids=["nan", "inf", "negative", "zero", "bool", "empty-name", "per-tensor-two", "empty-list", "float-axis",
        "unknown-field"])
def test_scale_table_validation(table, words):
    data = {"format": "onnx-qat-scales", "version": 1, **table}
    with support.raises_input_error(ScalesError) as info:
        onnx_qat.ScaleTable.from_dict(data, source="ScaleTable t.json")
    message = str(info.value)
    assert message.startswith("ScaleTable t.json") and "\n" not in message
    for word in words:
        assert word in message


def test_scale_table_file_with_nan_token_is_refused_before_use(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"format": "onnx-qat-scales", "version": 1, "activations": {"x": NaN}}')
    with support.raises_input_error(ScalesError, match="s.json"):
        onnx_qat.ScaleTable.load(path)


def _kernel_refuses_writes(directory: str) -> bool:
    """True when ``directory`` exists, ``access()`` calls it writable, yet creating a file fails."""
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        return False
    try:
        with open(os.path.join(directory, "onnx-qat-probe"), "wb"):
            pass
    except OSError:
        return True
    os.unlink(os.path.join(directory, "onnx-qat-probe"))
    return False


@pytest.mark.skipif(not _kernel_refuses_writes("/sys"),
                    reason="needs /sys: access() says writable, writes fail")
def test_write_failure_after_the_path_check_is_an_output_error():
    """A directory that passes the access() check but refuses the file (sysfs here; read-only
    mounts, root-squashed NFS or a full disk elsewhere) gives an OutputError naming the output."""
    table = onnx_qat.ScaleTable({"input": 1.0})
    with support.raises_input_error(OutputError, match="/sys/scales.json"):
        table.save("/sys/scales.json")
    with support.raises_input_error(OutputError, match="/sys/out.onnx"):
        onnx_qat.save_model(support.cnn_model(), "/sys/out.onnx")


# ----------------------------------------------------------------------------------- hard but valid models
def _assert_close(float_model, qdq_model, feeds, min_cos=0.98):
    ref = run(float_model, feeds)
    got = run(qdq_model, feeds)
    for r, g in zip(ref, got):
        if np.issubdtype(r.dtype, np.floating):
            assert cosine(r, g) >= min_cos, f"cosine {cosine(r, g):.4f}"
        else:
            np.testing.assert_array_equal(r, g)


def _subgraphs(model, op_type):
    node = next(n for n in model.graph.node if n.op_type == op_type)
    return [a.g.SerializeToString(deterministic=True) for a in node.attribute if a.g.node]


@pytest.mark.parametrize("op_type,builder", [("If", support.if_model), ("Loop", support.loop_model)])
def test_control_flow_if_branches_and_loop_bodies_placed_as_graphs_of_their_own(op_type, builder, caplog):
    model = builder()
    rng = np.random.default_rng(0)
    data = {"input": rng.standard_normal((4, 16, 8, 8)).astype(np.float32)}
    if op_type == "If":
        data["cond"] = np.array([True, False, True, False])
    with caplog.at_level(logging.WARNING, logger="onnx_qat"):
        result = onnx_qat.quantize(model, data=data, progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("untouched" in w for w in warnings), warnings
    if op_type == "Loop":  # a Relu-only body: placed like a graph of its own, nothing in it to quantize
        assert result.placement.decision_for("loop").action == "none", result.placement.decision_for("loop")
        assert _subgraphs(result.model, op_type) == _subgraphs(model, op_type), "a subgraph was changed"
    else:  # the then_branch's Conv is quantized inside the branch; the Relu-only else_branch is not changed
        if_node = next(n for n in result.model.graph.node if n.op_type == "If")
        branches = {a.name: sorted(n.op_type for n in a.g.node) for a in if_node.attribute}
        assert branches == {"then_branch": ["Conv", "DequantizeLinear", "DequantizeLinear", "QuantizeLinear"],
                            "else_branch": ["Relu"]}, branches
    assert result.summary["weights"] >= 1, "the Conv outside the subgraph should still be quantized"
    assert_check_clean(result.model)
    feeds = {k: v[:1] for k, v in data.items() if k != "cond"}
    for cond in ([True, False] if op_type == "If" else [None]):
        if cond is not None:
            feeds["cond"] = np.array(cond)
        _assert_close(model, result.model, feeds)


def test_custom_domain_ops_are_left_alone():
    model = support.custom_domain_model()
    original = next(n for n in model.graph.node if n.op_type == "MyOp").SerializeToString()
    table = onnx_qat.ScaleTable({"input": 4.0, "conv_out": 6.0, "myop_out": 6.0})
    result = onnx_qat.quantize(model, scales=table, progress=False)
    kept = [n for n in result.model.graph.node if n.op_type == "MyOp"]
    assert len(kept) == 1 and kept[0].SerializeToString() == original
    assert {o.domain: o.version for o in result.model.opset_import}.get("com.example") == 1
    producers = {o: n for n in result.model.graph.node for o in n.output}
    assert producers[kept[0].input[0]].op_type == "Conv", "no Q/DQ may be put in front of a custom op"
    assert onnx_qat.check(result.model)


def test_custom_domain_ops_cannot_be_calibrated_one_line():
    with support.raises_input_error(ModelError) as info:
        onnx_qat.quantize(support.custom_domain_model(), data=support.cnn_data(), progress=False)
    assert "MyOp" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("dims", [["batch", 16, "height", "width"], [None, 16, None, None]],
                         ids=["symbolic", "unknown"])
def test_dynamic_and_symbolic_shapes(dims):
    model = support.dynamic_model(dims)
    data = {"input": np.random.default_rng(1).standard_normal((6, 16, 6, 6)).astype(np.float32)}
    result = onnx_qat.quantize(model, data=data, progress=False)
    def dims(m):
        return [d.dim_param or d.dim_value or None for d in m.graph.input[0].type.tensor_type.shape.dim]

    assert dims(result.model) == dims(model)
    assert onnx_qat.check(result.model)
    for batch, size in ((1, 6), (3, 10)):  # other batch sizes and spatial sizes still run
        x = np.random.default_rng(batch).standard_normal((batch, 16, size, size)).astype(np.float32)
        feeds = {"input": x}
        _assert_close(model, result.model, feeds)


def test_int64_and_bool_inputs_pass_through():
    model = support.typed_inputs_model()
    data = support.typed_inputs_data()
    result = onnx_qat.quantize(model, data=data, progress=False)
    types = {i.name: i.type.tensor_type.elem_type for i in result.model.graph.input}
    assert types == {"input": onnx.TensorProto.FLOAT, "ids": onnx.TensorProto.INT64,
                     "mask": onnx.TensorProto.BOOL}
    quantized = {n.input[0] for n in result.model.graph.node if n.op_type == "QuantizeLinear"}
    assert not quantized & {"ids", "mask", "emb"}, "integer and boolean tensors must never be quantized"
    assert onnx_qat.check(result.model)
    _assert_close(model, result.model, {k: v[:1] for k, v in data.items()})


def test_hard_models_through_the_cli(tmp_path, capsys):
    from onnx_qat.cli import main
    for name, model, data in (("if", support.if_model(), {"input": support.cnn_data()["input"],
                                                           "cond": np.array([True, False, True, False])}),
                              ("typed", support.typed_inputs_model(), support.typed_inputs_data())):
        path = support.save(model, tmp_path / f"{name}.onnx")
        np.savez(tmp_path / f"{name}.npz", **data)
        out = tmp_path / f"{name}_q.onnx"
        assert main(["quantize", str(path), "-o", str(out), "--data", str(tmp_path / f"{name}.npz"),
                     "--no-progress"]) == 0, capsys.readouterr().err
        assert onnx_qat.check(str(out)) and out.stat().st_size > 0
    assert not support.partial_files(tmp_path)


# ----------------------------------------------------------------------------------- security, statically
def _calls(path: Path):
    import ast
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            attribute = isinstance(func, ast.Attribute)
            name = func.id if isinstance(func, ast.Name) else (func.attr if attribute else "")
            owner = func.value.id if attribute and isinstance(func.value, ast.Name) else ""
            yield node, owner, name


#: The only unpickling allowed: a worker reading the job its own main process pickled and sent over a
#: socket pair that process created (onnx_qat.runtime.workers), or put into the Ray object store of
#: the cluster the user chose (onnx_qat.runtime.ray_workers). No user file is ever unpickled.
WORKER_IPC_UNPICKLING = {"onnx_qat/runtime/workers.py", "onnx_qat/runtime/ray_workers.py"}


def test_no_eval_exec_or_unpickling_of_user_data_in_the_sources():
    """No ``eval``/``exec``, no pickle/marshal/shelve loads outside the workers' own messages, and
    every ``np.load`` passes ``allow_pickle=False``, in the library, the Keras bridge and the tools."""
    root = Path(__file__).resolve().parents[2]
    problems, np_loads, ipc = [], 0, set()
    for package in ("onnx_qat", "tf_bridge", "tools"):
        for path in sorted((root / package).rglob("*.py")):
            for node, owner, name in _calls(path):
                where = f"{path.relative_to(root)}:{node.lineno}"
                if name in ("eval", "exec") and owner == "":
                    problems.append(f"{where}: {name}()")
                unpicklers = ("pickle", "marshal", "shelve", "dill", "cloudpickle")
                if owner in unpicklers and name in ("load", "loads", "open"):
                    relative = path.relative_to(root).as_posix()
                    if owner == "pickle" and name == "loads" and relative in WORKER_IPC_UNPICKLING:
                        ipc.add(relative)
                    else:
                        problems.append(f"{where}: {owner}.{name}()")
                if owner == "np" and name == "load":
                    np_loads += 1
                    flags = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
                    if flags.get("allow_pickle") is not False:
                        problems.append(f"{where}: np.load without allow_pickle=False")
    assert not problems, "\n".join(problems)
    assert np_loads >= 2, "the scan should have seen the .npz readers"
    assert ipc == WORKER_IPC_UNPICKLING, "the allowance names files that no longer unpickle: drop them"
