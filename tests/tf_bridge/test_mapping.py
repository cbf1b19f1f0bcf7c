"""The Keras -> ONNX mapping goes by structure: the same on any data, whatever the activations hold."""
import numpy as np
import onnx
import pytest

keras = pytest.importorskip("keras")

import tf_bridge  # noqa: E402
from tf_bridge.scopes import _eliminate, _names  # noqa: E402

L = keras.layers


def test_scope_components_stand_for_layer_names_with_tensorflow_suffixes():
    assert _names("conv", 1) == ["conv"]
    assert _names("conv_1", 1) == ["conv_1", "conv"]  # layer conv_1, or conv with a suffix
    assert _names("conv_1_2", 1) == ["conv_1_2", "conv_1"]
    assert _names("conv_1_2", 2) == ["conv_1_2", "conv_1", "conv"]


def test_ambiguous_scopes_are_settled_by_elimination():
    keys = {"m/conv_1": {"conv", "conv_1"}, "m/conv_1_2": {"conv_1"}, "m/add_1": {"add"}}
    settled = _eliminate(keys)
    assert settled["m/conv_1"] == {"conv"} and settled["m/conv_1_2"] == {"conv_1"}


def _hard_model():
    """Names that collide after TensorFlow's suffixes, a shared layer called twice, a nested model
    called twice, a Dropout between layers, twin branches with equal weights (equal activations),
    and a branch of zeros."""
    inner_in = keras.Input((8, 8, 8), name="inner_in")
    inner = keras.Model(inner_in, L.Conv2D(8, 1, name="conv")(inner_in), name="inner")
    inp = keras.Input((8, 8, 3), name="x")
    a = L.Conv2D(8, 3, padding="same", name="conv")(inp)
    b = L.Conv2D(8, 1, name="conv_1")(a)
    shared = L.Conv2D(8, 1, name="shared")
    c, d = shared(b), shared(a)
    twin_1 = L.Conv2D(8, 1, name="twin_a")
    twin_2 = L.Conv2D(8, 1, name="twin_b")
    e = L.Add(name="add")([twin_1(c), twin_2(c), d])
    zeros = L.Conv2D(8, 1, kernel_initializer="zeros", bias_initializer="zeros", name="zeros")(e)
    f = inner(L.Dropout(0.2, name="drop")(L.Add(name="add_1")([e, zeros])))
    g = inner(f)
    h = L.Concatenate(name="cat")([g, L.AveragePooling2D(1, name="pool")(e)])
    out = L.Dense(4, name="head")(L.GlobalAveragePooling2D(name="gap")(h))
    model = keras.Model(inp, out, name="outer")
    model.get_layer("twin_b").set_weights(model.get_layer("twin_a").get_weights())
    return model


@pytest.fixture(scope="module")
def hard_qat():
    keras.utils.set_random_seed(11)
    spec = tf_bridge.QuantizationSpec().add("add", quantize_input=True).add("add_1", quantize_input=True)
    q = tf_bridge.quantize_model(_hard_model(), quantization_spec=spec)
    x = np.random.default_rng(0).normal(size=(8, 8, 8, 3)).astype("float32")
    tf_bridge.calibrate(q, x, progress=False)
    return q, x


def test_every_quantizer_maps_by_structure_on_a_hard_graph(hard_qat, tmp_path):
    q, x = hard_qat
    report = tf_bridge.export_onnx(q, tmp_path / "hard.onnx", sample_data=x)
    assert report.passed, str(report)
    # the spec quantizes every Add input: the check's only advice is TensorRT's residual fusion (C11)
    assert not report.check.errors and {f.rule for f in report.check.warnings} <= {"C11"}
    assert {e.quantizer for e in report.mapping} == {r.path for r in tf_bridge.quantizer_records(q)}
    by_name = {e.quantizer: e for e in report.mapping}
    assert len(by_name["shared"].onnx_nodes) == 2  # one weight, two calls
    assert len(by_name["inner/conv"].onnx_nodes) == 2  # nested model called twice
    # equal weights on the same input: tf2onnx keeps one Conv for both; each maps to it
    assert by_name["twin_a"].onnx_nodes == by_name["twin_b"].onnx_nodes
    assert "/conv_1_2/" in by_name["conv_1"].onnx_nodes[0] and "/conv_1/" in by_name["conv"].onnx_nodes[0]
    # the add_1 inputs: the add output and the all-zero branch, each its own tensor
    add_1 = [e for e in report.mapping if e.kind == "activation" and "add_1[" in e.keras]
    assert len({t for e in add_1 for t in e.onnx_tensors}) == 2, add_1


def test_the_mapping_does_not_depend_on_the_data(hard_qat, tmp_path):
    """Zeros, huge values or normal data: the same quantizers on the same ONNX tensors (one
    conversion, mapped with each data set's values), and every export maps every quantizer."""
    from tf_bridge.export import convert_float_twin
    from tf_bridge.mapping import map_quantizers
    from tf_bridge.onnx_values import run_with_tensors
    from tf_bridge.trace import trace_layers
    from tf_bridge.wrap import float_model

    q, x = hard_qat
    twin = float_model(q)
    model = convert_float_twin(twin, 17)
    tables, counts = [], []
    for i, data in enumerate((x, np.zeros_like(x), x * 1e4)):
        calls, _ = trace_layers(twin, data)
        values = run_with_tensors(model, {model.graph.input[0].name: data},
                                  [o for n in model.graph.node for o in n.output])
        mapping = map_quantizers(q, model, calls, values)
        tables.append({e.quantizer: (e.onnx_tensors, e.onnx_nodes) for e in mapping.entries})
        report = tf_bridge.export_onnx(q, tmp_path / f"m{i}.onnx", sample_data=data, strict=False)
        assert {e.quantizer for e in report.mapping} == set(tables[-1])
        counts.append(sum(n.op_type == "QuantizeLinear" for n in onnx.load(report.path).graph.node))
    assert tables[0] == tables[1] == tables[2]
    assert counts[0] == counts[1] == counts[2] > 5
