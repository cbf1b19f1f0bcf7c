"""Model I/O: loading, validation, opset upgrade, IR version, atomic and external-data saving."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_qat.errors import ModelError, OutputError
from onnx_qat.model_io import (
    MAX_IR_VERSION, InputSpec, default_opset, from_graph, load_model, model_input_specs, save_model,
    to_graph,
)

ROOT = Path(__file__).resolve().parents[2]


def _conv_model(opset: int = 13, ir_version: int = 8, init_as_input: bool = False,
                channels: int = 4) -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv -> BatchNormalization -> Relu -> Reshape -> Gemm -> y[N,5]."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((channels, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "mean"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, channels).astype(np.float32), "var"),
        numpy_helper.from_array(np.array([0, -1], np.int64), "shape"),
        numpy_helper.from_array(rng.standard_normal((5, channels * 36)).astype(np.float32), "fc_w"),
        numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["flat"], name="reshape"),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["y"], name="fc", transB=1),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])]
    if init_as_input:
        inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
    graph = helper.make_graph(nodes, "tiny", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="tests")
    model.ir_version = ir_version
    return model


def _run(model_or_path, x: np.ndarray) -> np.ndarray:
    is_proto = isinstance(model_or_path, onnx.ModelProto)
    src = model_or_path.SerializeToString() if is_proto else str(model_or_path)
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


X = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)


# --------------------------------------------------------------------------- loading
def test_load_from_path_and_proto_returns_copy(tmp_path):
    model = _conv_model()
    before = model.SerializeToString()
    loaded = load_model(model)
    assert loaded is not model
    loaded.graph.node[0].name = "changed"
    assert model.SerializeToString() == before
    path = tmp_path / "m.onnx"
    path.write_bytes(before)
    from_path = load_model(path)
    np.testing.assert_allclose(_run(from_path, X), _run(model, X), rtol=1e-6, atol=1e-6)


def test_ir_version_lowered_so_onnxruntime_loads():
    model = _conv_model()  # onnx >= 1.23 writes a recent IR version by default
    model.ir_version = 14
    loaded = load_model(model)
    assert loaded.ir_version == helper.find_min_ir_version_for(list(loaded.opset_import), True) == 7
    assert _run(loaded, X).shape == (2, 5)


def test_opset9_model_with_initializer_inputs_upgraded_same_outputs(tmp_path):
    old = _conv_model(opset=9, ir_version=3, init_as_input=True)
    onnx.checker.check_model(old)
    expected = _run(old, X)
    path = tmp_path / "old.onnx"
    path.write_bytes(old.SerializeToString())
    model = load_model(path)
    assert default_opset(model) == 13
    assert 4 <= model.ir_version <= MAX_IR_VERSION
    assert [i.name for i in model.graph.input] == ["x"]
    np.testing.assert_allclose(_run(model, X), expected, rtol=1e-5, atol=1e-5)
    out = save_model(model, tmp_path / "new.onnx", inputs=[path])
    np.testing.assert_allclose(_run(out, X), expected, rtol=1e-5, atol=1e-5)


def test_opset_upgrade_can_be_disabled():
    model = load_model(_conv_model(opset=11), upgrade_opset=False)
    assert default_opset(model) == 11


def test_custom_domain_ops_and_functions_kept(tmp_path):
    fn = helper.make_function("com.example", "Twice", ["a"], ["b"],
                              [helper.make_node("Add", ["a", "a"], ["b"])],
                              [helper.make_opsetid("", 13)])
    nodes = [helper.make_node("Twice", ["x"], ["t"], domain="com.example", name="twice"),
             helper.make_node("Relu", ["t"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, functions=[fn], opset_imports=[helper.make_opsetid("", 13),
                                                                   helper.make_opsetid("com.example", 1)])
    model.ir_version = 14
    loaded = load_model(model)
    assert loaded.graph.node[0].domain == "com.example"
    assert [f.name for f in loaded.functions] == ["Twice"]
    assert loaded.ir_version >= 8  # model-local functions need IR 8
    sess = ort.InferenceSession(loaded.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": np.array([-1, 2], np.float32)})[0], [0, 4])
    again = from_graph(to_graph(loaded), loaded)
    assert {(o.domain, o.version) for o in again.opset_import} == {("", 13), ("com.example", 1)}
    assert [f.name for f in again.functions] == ["Twice"]


def test_graph_round_trip_keeps_model_fields():
    model = load_model(_conv_model())
    model.producer_version = "7.1"
    model.doc_string = "doc"
    helper.set_model_props(model, {"author": "someone", "license": "MIT"})
    graph = to_graph(model)
    out = from_graph(graph, model)
    assert out.producer_name == "tests" and out.producer_version == "7.1" and out.doc_string == "doc"
    assert {p.key: p.value for p in out.metadata_props} == {"author": "someone", "license": "MIT"}
    assert out.ir_version == model.ir_version
    assert [(o.domain, o.version) for o in out.opset_import] == [("", 13)]
    np.testing.assert_allclose(_run(out, X), _run(model, X), rtol=1e-6)


def test_model_input_specs_symbolic_dims_and_initializer_inputs():
    model = _conv_model(opset=13, ir_version=8, init_as_input=True)
    specs = model_input_specs(model)
    assert specs == (InputSpec("x", np.dtype(np.float32), (None, 3, 8, 8)),)
    assert specs[0].describe() == "x float32[N,3,8,8]"


# --------------------------------------------------------------------------- bad model files
BAD_FILES = {
    "empty": b"",
    "random": bytes(np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)),
    "json": b'{"format": "onnx-qat-scales", "version": 1}',
    "text": b"hello, this is not a model\n",
    "zeros": b"\0" * 100,
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_model_bytes_one_line_model_error(tmp_path, case):
    path = tmp_path / f"{case}.onnx"
    path.write_bytes(BAD_FILES[case])
    with pytest.raises(ModelError) as info:
        load_model(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg


def test_truncated_model_one_line_model_error(tmp_path):
    data = _conv_model().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError) as info:
        load_model(path)
    assert "\n" not in str(info.value) and "cut.onnx" in str(info.value)


def test_missing_path_and_directory(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_model(tmp_path / "nope.onnx")
    with pytest.raises(ModelError, match="is a directory"):
        load_model(tmp_path)


def test_invalid_graph_refused(tmp_path):
    model = _conv_model()
    model.graph.node[0].input[1] = "undefined_weight"
    path = tmp_path / "bad.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelError, match="not a valid ONNX model"):
        load_model(path)


# --------------------------------------------------------------------------- saving
def test_save_refuses_input_directory_and_missing_dir(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(_conv_model().SerializeToString())
    digest = _sha(path)
    model = load_model(path)
    with pytest.raises(OutputError, match="input"):
        save_model(model, path, inputs=[path])
    with pytest.raises(OutputError, match="directory"):
        save_model(model, tmp_path)
    with pytest.raises(OutputError, match="does not exist"):
        save_model(model, tmp_path / "missing" / "m.onnx")
    assert _sha(path) == digest


def test_save_does_not_mutate_and_writes_loadable_ir(tmp_path):
    model = _conv_model()
    model.ir_version = 14
    before = model.SerializeToString()
    out = save_model(model, tmp_path / "o.onnx")
    assert model.SerializeToString() == before
    written = onnx.load(str(out))
    assert written.ir_version <= MAX_IR_VERSION
    assert _run(out, X).shape == (2, 5)
    assert [p.name for p in tmp_path.iterdir()] == ["o.onnx"]


def test_failed_write_leaves_old_file_and_no_partial(tmp_path):
    """A write that fails half-way (file size limit) keeps the previous output and leaves no temp file."""
    target = tmp_path / "o.onnx"
    target.write_bytes(b"previous")
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        import onnx
        from onnx_qat.model_io import save_model
        from onnx_qat.errors import OutputError
        model = onnx.load({str(tmp_path / 'src.onnx')!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
        try:
            save_model(model, {str(target)!r})
        except OutputError as exc:
            print("OutputError", exc)
            sys.exit(3)
    """)
    (tmp_path / "src.onnx").write_bytes(_conv_model(channels=16).SerializeToString())
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "\n" not in proc.stdout.strip()
    assert target.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.onnx", "src.onnx"]


def test_external_data_round_trip(tmp_path):
    model = load_model(_conv_model(channels=16))
    out = save_model(model, tmp_path / "ext.onnx", external_data_threshold=0)
    data_file = tmp_path / "ext.onnx.data"
    assert data_file.is_file() and data_file.stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ext.onnx", "ext.onnx.data"]
    raw = onnx.load(str(out), load_external_data=False)
    external = [t.name for t in raw.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert "w" in external and "fc_w" in external
    back = load_model(out)
    for a, b in zip(model.graph.initializer, back.graph.initializer):
        np.testing.assert_array_equal(numpy_helper.to_array(a), numpy_helper.to_array(b))
    np.testing.assert_allclose(_run(out, X), _run(model, X), rtol=1e-6)


def _external_model(tmp_path: Path, location: str) -> Path:
    model = _conv_model(channels=16)
    for tensor in model.graph.initializer:
        if tensor.name == "fc_w":
            raw = tensor.raw_data
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", location), ("offset", "0"), ("length", str(len(raw)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
    (tmp_path / "secret.bin").write_bytes(b"\0" * 20000)
    sub = tmp_path / "models"
    sub.mkdir(exist_ok=True)
    path = sub / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "sub/../../secret.bin"])
def test_external_data_outside_model_dir_refused(tmp_path, location):
    path = _external_model(tmp_path, location)
    with pytest.raises(ModelError, match="refused|absolute"):
        load_model(path)


def test_external_data_symlink_escape_refused(tmp_path):
    path = _external_model(tmp_path, "link.bin")
    os.symlink(tmp_path / "secret.bin", path.parent / "link.bin")
    with pytest.raises(ModelError, match="outside"):
        load_model(path)


def test_external_data_missing_file(tmp_path):
    path = _external_model(tmp_path, "absent.bin")
    with pytest.raises(ModelError, match="missing"):
        load_model(path)


_BIG_SCRIPT = """
import resource, sys
sys.path.insert(0, {root!r})
import numpy as np, onnx
from onnx import helper
from onnx_qat.model_io import load_model, save_model
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
n = 280 * 1024 * 1024 // 4
if sys.argv[1] == "save":
    model = onnx.ModelProto()
    model.ir_version = 8
    model.opset_import.add().version = 13
    model.graph.name = "big"
    for i in range(8):
        t = model.graph.initializer.add()
        t.name, t.data_type = f"w{{i}}", onnx.TensorProto.FLOAT
        t.dims.append(n)
        t.raw_data = np.full(n, i, np.float32).tobytes()
    model.graph.node.append(helper.make_node("Sum", [f"w{{i}}" for i in range(8)], ["y"]))
    model.graph.output.append(helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [n]))
    before = rss()
    save_model(model, sys.argv[2])
    print(before, rss())
else:
    before = rss()
    model = load_model(sys.argv[2])
    print(before, rss())
"""


@pytest.mark.slow
def test_over_2gb_model_saved_with_external_data_in_bounded_memory(tmp_path):
    weights = 8 * 280 * 1024 * 1024
    script = _BIG_SCRIPT.format(root=str(ROOT))
    out = tmp_path / "big.onnx"
    proc = subprocess.run([sys.executable, "-c", script, "save", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    before, after = map(int, proc.stdout.split())
    assert after - before < weights  # saving adds less than one more copy of the weights
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    assert out.stat().st_size < 10_000 and (tmp_path / "big.onnx.data").stat().st_size >= weights
    proc = subprocess.run([sys.executable, "-c", script, "load", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    before, after = map(int, proc.stdout.split())
    assert after - before < 2 * weights
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(sess.run(None, {})[0][:3], [28.0, 28.0, 28.0])


def test_external_data_left_unloaded_on_request(tmp_path):
    save_model(load_model(_conv_model(channels=16)), tmp_path / "e.onnx", external_data_threshold=0)
    model = load_model(tmp_path / "e.onnx", load_external_data=False)
    assert any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)
    with pytest.raises(ModelError, match="external data that was not loaded"):
        save_model(model, tmp_path / "copy.onnx")
    assert not (tmp_path / "copy.onnx").exists()


def test_in_memory_model_with_unloaded_external_data_refused_whatever_the_cwd(tmp_path, monkeypatch):
    """A ModelProto has no directory: its unloaded external data is never looked for relative to the
    current directory (here the directory that holds the data file). Loading it, quantizing it and
    reading one of its tensors give one-line ModelErrors; check() still reads its graph."""
    import onnx_qat
    from onnx_qat.model_io import tensor_array

    save_model(load_model(_conv_model(channels=16)), tmp_path / "e.onnx", external_data_threshold=0)
    model = onnx.load(str(tmp_path / "e.onnx"), load_external_data=False)
    before = model.SerializeToString()
    monkeypatch.chdir(tmp_path)
    message = (r"^model: the data of \d+ tensor\(s\) \(first: '\w+', in '[\w.]+'\) was not loaded; "
               r"give the model's path")
    with pytest.raises(ModelError, match=message) as info:
        load_model(model)
    assert "\n" not in str(info.value)
    scales = {t: 1.0 for t in onnx_qat.place(model).activation_tensors()}
    with pytest.raises(ModelError, match=message):
        onnx_qat.quantize(model, tmp_path / "q.onnx", scales=scales, progress=False)
    assert not (tmp_path / "q.onnx").exists()
    external = next(t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL)
    with pytest.raises(ModelError, match=rf"^tensor '{external.name}': its data is stored in '\S+' "
                                         r"and was not loaded$"):
        tensor_array(external)
    assert (load_model(model, load_external_data=False).graph.initializer[0].data_location
            == TensorProto.EXTERNAL)
    assert onnx_qat.check(model).num_q == 0
    assert model.SerializeToString() == before
    loaded = load_model(tmp_path / "e.onnx")  # from its path the data is read from the model's directory
    assert not any(t.data_location == TensorProto.EXTERNAL for t in loaded.graph.initializer)


def test_save_refuses_a_constant_node_with_unloaded_external_data(tmp_path):
    """External data outside the main graph's initializers (here a Constant node's value) is found too."""
    model = load_model(_conv_model())
    value = numpy_helper.from_array(np.ones(4, np.float32), "c")
    value.data_location = TensorProto.EXTERNAL
    entry = value.external_data.add()
    entry.key, entry.value = "location", "c.bin"
    value.ClearField("raw_data")
    model.graph.node.append(helper.make_node("Constant", [], ["unused_c"], name="const", value=value))
    with pytest.raises(ModelError, match="external data that was not loaded"):
        save_model(model, tmp_path / "c.onnx")
    assert not (tmp_path / "c.onnx").exists()


def test_save_with_validate_writes_nothing_for_an_invalid_model(tmp_path):
    """validate=True runs onnx.checker on the bytes to write: an invalid model leaves no file (and no
    temporary file) behind, a one-line ModelError names the output; a valid one is written unchanged."""
    model = load_model(_conv_model())
    good = save_model(model, tmp_path / "good.onnx", validate=True)
    assert onnx.load(str(good)).SerializeToString() == model.SerializeToString()
    model.graph.node[0].input[0] = "nowhere"
    target = tmp_path / "bad.onnx"
    message = rf"^output model {re.escape(str(target))} is not a valid ONNX model: "
    with pytest.raises(ModelError, match=message) as info:
        save_model(model, target, validate=True)
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.onnx"]
    save_model(model, target)  # without validate the same model is written as it is
    assert target.exists()


def test_load_checks_the_file_bytes_and_names_the_file(tmp_path):
    """An invalid model file is refused when loaded, the message naming the file, in one line."""
    model = _conv_model()
    model.graph.node[0].input[0] = "nowhere"
    path = tmp_path / "broken.onnx"
    path.write_bytes(model.SerializeToString())
    message = rf"^model {re.escape(str(path))} is not a valid ONNX model: "
    with pytest.raises(ModelError, match=message) as info:
        load_model(path)
    assert "\n" not in str(info.value)
    assert load_model(path, check=False).graph.node[0].input[0] == "nowhere"


def test_public_api_names():
    import onnx_qat
    from onnx_qat.calibration import calibrate
    from onnx_qat.compare import compare
    from onnx_qat.data import load_data

    assert onnx_qat.load_model is load_model and onnx_qat.save_model is save_model
    assert onnx_qat.load_data is load_data and onnx_qat.calibrate is calibrate and onnx_qat.compare is compare


def test_release_graph_frees_nodes_and_tensors_without_a_garbage_collection():
    import gc
    import weakref

    from onnx_qat.model_io import release_graph

    model = load_model(_conv_model())
    enabled = gc.isenabled()
    gc.disable()  # only reference counting may free them
    try:
        graph = to_graph(model)
        refs = [weakref.ref(obj) for obj in [graph, *graph.nodes, *graph.tensors().values()]]
        assert len(refs) > 10
        out = from_graph(graph, model)
        release_graph(graph)
        del graph
        assert [r for r in refs if r() is not None] == []
    finally:
        if enabled:
            gc.enable()
    np.testing.assert_allclose(_run(out, X), _run(model, X), rtol=1e-6)  # the export stands alone


def test_validate_model_names_the_model_in_one_line():
    from onnx_qat.model_io import validate_model

    model = load_model(_conv_model())
    validate_model(model, "output model q.onnx")
    model.graph.node[0].input[0] = "nowhere"
    with pytest.raises(ModelError, match=r"^output model q.onnx is not a valid ONNX model: ") as info:
        validate_model(model, "output model q.onnx")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64,
                                   np.float16, np.float64, np.uint32, np.uint64, bool])
def test_tensor_array_equals_numpy_helper_for_raw_and_typed_fields(dtype):
    from onnx_qat.model_io import tensor_array

    values = (np.random.default_rng(3).standard_normal((3, 4)) * 50).astype(dtype)
    raw = numpy_helper.from_array(values, "t")
    typed = helper.make_tensor("t", helper.np_dtype_to_tensor_dtype(values.dtype), values.shape,
                               values.reshape(-1).tolist())
    for tensor in (raw, typed):
        got = tensor_array(tensor)
        assert got.dtype == values.dtype and got.shape == values.shape
        np.testing.assert_array_equal(got, numpy_helper.to_array(tensor))
        np.testing.assert_array_equal(got, values)
    scalar = numpy_helper.from_array(np.array(0.25, np.float32), "s")
    assert tensor_array(scalar).shape == () and float(tensor_array(scalar)) == 0.25
