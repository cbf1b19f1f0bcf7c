"""tf_bridge.export_onnx when tf2onnx cannot convert a model: one ExportError line, nothing written.

The models are real Keras layers whose TensorFlow ops tf2onnx 1.17 has no ONNX form for
(``Lgamma``, ``Erfinv``) or whose handler fails (``FFT`` feeding anything but ``ComplexAbs``);
tf2onnx logs them and returns a graph that still holds the TensorFlow ops, which the
export must refuse. The ONNX models of the ``check_converted`` tests are built with onnx.helper.
"""
import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import pytest  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import tf_bridge  # noqa: E402
from tests.reliability import support  # noqa: E402
from onnx_qat.errors import ExportError  # noqa: E402
from tf_bridge.export import check_converted  # noqa: E402

pytestmark = pytest.mark.tf


class LogGamma(keras.layers.Layer):
    """log|Γ(x)|: TensorFlow's Lgamma op, which tf2onnx has no handler for."""

    def call(self, x):
        return tf.math.lgamma(x)


class Spectrum(keras.layers.Layer):
    """Real part of the FFT: tf2onnx converts an FFT only when ComplexAbs consumes it."""

    def call(self, x):
        return tf.math.real(tf.signal.fft(tf.cast(x, tf.complex64)))


@keras.saving.register_keras_serializable(package="tests_reliability")
def erfinv_of_tanh(x):
    """A registered function for a Lambda layer (quantize_model copies layers through their config,
    where an unregistered function cannot be found and a Python lambda is refused by safe mode)."""
    return tf.math.erfinv(tf.tanh(x))


# name -> (layer factory, ONNX op types left unconverted, fragment of tf2onnx's reason)
LAYERS = {
    "lgamma": (lambda: LogGamma(name="special"), ("Lgamma",), None),
    "fft": (lambda: Spectrum(name="special"), ("FFT",), "only allows ComplexAbs as consumer"),
    "lambda_erfinv": (lambda: keras.layers.Lambda(erfinv_of_tanh, name="special"), ("Erfinv",), None),
}


def _qat_model(kind):
    keras.utils.set_random_seed(7)
    inp = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, name="fc")(inp)
    out = LAYERS[kind][0]()(keras.layers.ReLU(name="relu")(h) + 1.0)
    q_model = tf_bridge.quantize_model(keras.Model(inp, out, name=f"{kind}_net"))
    x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
    tf_bridge.calibrate(q_model, x, progress=False)
    return q_model, x


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _assert_one_line(message):
    assert "\n" not in message and len(message) < 700, message
    assert "Traceback" not in message


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_unconverted_tensorflow_op_is_one_export_error_and_nothing_is_written(kind, tmp_path, capsys):
    q_model, x = _qat_model(kind)
    before = _weights(q_model)
    existing = tmp_path / "model.onnx"
    existing.write_bytes(b"the previous good model")  # must survive a failed export
    tf2onnx_logger = logging.getLogger("tf2onnx")
    handlers, propagate = list(tf2onnx_logger.handlers), tf2onnx_logger.propagate
    capsys.readouterr()

    with support.raises_input_error(ExportError) as info:
        tf_bridge.export_onnx(q_model, existing, sample_data=x, save_float=True, progress=False)

    message = str(info.value)
    assert type(info.value) is ExportError
    _assert_one_line(message)
    assert message.startswith("export_onnx: tf2onnx 1.17")
    assert f"'{kind}_net' unconverted at opset 17" in message
    for op in LAYERS[kind][1]:
        assert f"{op} in layer 'special'" in message
    if LAYERS[kind][2]:
        assert LAYERS[kind][2] in message
    assert "nothing was written" in message and "try another opset (13..18)" in message
    assert "replace that layer" in message and "onnx-qat quantize" in message
    # nothing at the output paths (model, ScaleTable, float twin); the old model untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    assert existing.read_bytes() == b"the previous good model"
    # the caller's model untouched, tf2onnx's log held back (not on stderr) and its logger restored
    after = _weights(q_model)
    assert len(after) == len(before) and all(np.array_equal(a, b) for a, b in zip(before, after))
    err = capsys.readouterr().err
    assert "is not supported" not in err and "Unsupported ops" not in err and "Traceback" not in err
    assert tf2onnx_logger.handlers == handlers and tf2onnx_logger.propagate == propagate


def test_tf2onnx_exception_is_one_export_error(tmp_path):
    """tf2onnx itself raises (opset 19 is past what 1.17 supports): its message, shortened."""
    q_model, x = _qat_model("lgamma")
    before = _weights(q_model)
    with support.raises_input_error(ExportError) as info:
        tf_bridge.export_onnx(q_model, tmp_path / "m.onnx", sample_data=x, opset=19, save_float=True,
                              progress=False)
    message = str(info.value)
    _assert_one_line(message)
    assert "could not convert model 'lgamma_net' at opset 19: Opset 19 is not supported yet" in message
    assert "try another opset (13..18)" in message and "nothing was written" in message
    assert list(tmp_path.iterdir()) == []
    assert all(np.array_equal(a, b) for a, b in zip(before, _weights(q_model)))


def test_opset_below_13_is_refused_before_conversion(tmp_path):
    q_model, x = _qat_model("lgamma")
    with support.raises_input_error(ExportError,
                                    match=r"^export_onnx: opset 12 is below 13.*use opset=13\.\.18$"):
        tf_bridge.export_onnx(q_model, tmp_path / "m.onnx", sample_data=x, opset=12, progress=False)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- check_converted on ONNX models
def _twin():
    inp = keras.Input((4,), name="x")
    return keras.Model(inp, LogGamma(name="special")(keras.layers.Dense(4, name="fc")(inp)), name="twin")


def _model(nodes, opset=17, extra_opsets=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph(nodes, "g", [x], [y])
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    return helper.make_model(graph, opset_imports=opsets)


def test_check_converted_accepts_standard_onnx():
    model = _model([helper.make_node("Relu", ["x"], ["y"], name="twin_1/fc_1/Relu")])
    onnx.checker.check_model(model)
    assert check_converted(model, _twin(), 17) is None


def test_check_converted_names_tensorflow_ops_and_layers_with_tf2onnx_reasons():
    model = _model([helper.make_node("Relu", ["x"], ["a"], name="twin_1/fc_1/Relu"),
                    helper.make_node("Lgamma", ["a"], ["y"], name="twin_1/special_1/Lgamma")])
    with support.raises_input_error(ExportError) as info:
        check_converted(model, _twin(), 17, {"twin_1/special_1/Lgamma": "no handler (test reason)"})
    message = str(info.value)
    _assert_one_line(message)
    assert ("left TensorFlow op(s) of model 'twin' unconverted at opset 17: Lgamma in layer 'special' "
            "(no handler (test reason)); nothing was written") in message


def test_check_converted_refuses_custom_domains_ops_of_a_later_opset_and_subgraphs():
    custom = _model([helper.make_node("Lgamma", ["x"], ["y"], name="twin_1/special_1/Lgamma",
                                      domain="ai.onnx.contrib")], extra_opsets=[("ai.onnx.contrib", 1)])
    with support.raises_input_error(ExportError, match="Lgamma in layer 'special'"):
        check_converted(custom, _twin(), 17)
    # Gelu exists from opset 20 only: at opset 17 it is no ONNX op
    later = _model([helper.make_node("Gelu", ["x"], ["y"], name="twin_1/special_1/Gelu")])
    with support.raises_input_error(ExportError, match="Gelu in layer 'special'"):
        check_converted(later, _twin(), 17)
    # an unconverted op inside an If branch
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    branch = helper.make_graph([helper.make_node("Erfinv", ["x"], ["y"], name="twin_1/special_1/Erfinv")],
                               "then", [], [out])
    plain = helper.make_graph([helper.make_node("Identity", ["x"], ["y"], name="id")], "else", [], [out])
    model = _model([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=plain)])
    model.graph.input.append(cond)
    with support.raises_input_error(ExportError, match="Erfinv in layer 'special'"):
        check_converted(model, _twin(), 17)


def test_check_converted_refuses_what_onnx_checker_refuses():
    """Standard ops, but a node reads a tensor nothing produces."""
    model = _model([helper.make_node("Add", ["x", "ghost"], ["y"], name="twin_1/fc_1/Add")])
    with support.raises_input_error(ExportError) as info:
        check_converted(model, _twin(), 17)
    message = str(info.value)
    _assert_one_line(message)
    assert "made an invalid ONNX model of 'twin' at opset 17" in message and "ghost" in message
    assert "nothing was written" in message
