"""tf_bridge.convert: the cheaper conversion makes the very graph tf2onnx's own steps make.

The reference below is tf2onnx's pipeline as ``tf2onnx.convert.from_function`` runs it (freezing
into a new concrete function, per-op constant folding in TensorFlow, ``optimize_graph`` writing
the node protos after every pass), with the same grappler passes and zero biases as the export.
"""
import collections
import os
import re

import numpy as np
import onnx
import pytest

keras = pytest.importorskip("keras")

import tf_bridge  # noqa: E402
from tests.tf_bridge.models import blobs, mixed_cnn, randomize_bn  # noqa: E402
from tf_bridge import convert as C  # noqa: E402

os.environ.setdefault("TF_BRIDGE_QUIET", "1")
L = keras.layers


def _reference(concrete, input_names, opset):
    """tf2onnx's own steps (what ``_tf2onnx_without_conv_folding`` did before it was made cheaper)."""
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    from tensorflow.python.grappler import tf_optimizer
    from tf2onnx import optimizer, tfonnx

    frozen = convert_variables_to_constants_v2(concrete, lower_control_flow=False, aggressive_inlining=True)
    tf_inputs = [t.name for t in frozen.inputs if t.dtype != tf.resource]
    tf_outputs = [t.name for t in frozen.outputs if t.dtype != tf.resource]
    config = config_pb2.ConfigProto()
    config.graph_options.infer_shapes = True
    config.graph_options.rewrite_options.optimizers[:] = list(C.GRAPPLER_PASSES)
    with tf.Graph().as_default():
        meta = tf.compat.v1.train.export_meta_graph(graph_def=frozen.graph.as_graph_def(add_shapes=True))
    fetch = meta_graph_pb2.CollectionDef()
    fetch.node_list.value.extend(tf_inputs + tf_outputs)
    meta.collection_def["train_op"].CopyFrom(fetch)
    graph_def = tf_optimizer.OptimizeGraph(config, meta)
    with tf.device("/cpu:0"), tf.Graph().as_default() as tf_graph:
        tf.import_graph_def(graph_def, name="")
        graph = tfonnx.process_tf_graph(tf_graph, continue_on_error=True, opset=opset,
                                        input_names=tf_inputs, output_names=tf_outputs,
                                        tensors_to_rename=dict(zip(tf_inputs, input_names)))
        C._pin_conv_bias(graph)
        graph = optimizer.optimize_graph(graph, catch_errors=False)
        return graph.make_model("reference")


def _canonical(model: onnx.ModelProto):
    """The graph with tensor names numbered in order of appearance and tf2onnx's generated name
    counters (``__123``, global to the process) removed from node names; initializers by value."""
    names = {}

    def n(x):
        return names.setdefault(x, f"t{len(names)}") if x else ""

    for i in model.graph.input:
        n(i.name)
    nodes = [(node.op_type, re.sub(r"__\d+", "", node.name), tuple(n(i) for i in node.input),
              tuple(n(o) for o in node.output), tuple(sorted(a.SerializeToString() for a in node.attribute)))
             for node in model.graph.node]
    inits = sorted((n(t.name), tuple(t.dims), onnx.numpy_helper.to_array(t).tobytes())
                   for t in model.graph.initializer)
    return nodes, inits, [n(o.name) for o in model.graph.output]


def _concrete(model):
    import tensorflow as tf

    spec = tf.TensorSpec((None, *model.inputs[0].shape[1:]), tf.float32, name="image")

    @tf.function(input_signature=[spec])
    def forward(x):
        return model(x, training=False)

    return forward.get_concrete_function(spec)


@pytest.fixture(scope="module")
def qat_model():
    keras.utils.set_random_seed(3)
    model = randomize_bn(mixed_cnn((16, 16, 3)))
    q = tf_bridge.quantize_model(model)
    tf_bridge.calibrate(q, blobs(8, (16, 16, 3))[0], progress=False)
    return q


@pytest.mark.parametrize("which", ["float twin", "QAT graph"])
def test_conversion_equals_tf2onnx_own_steps(qat_model, which):
    """Frozen without a new function, constants folded in one run, node protos written once: the
    graph (ops, edges, attributes) and every constant equal tf2onnx's own result, for the float
    twin (with its node names, which the mapping reads) and for the QAT graph with its
    fake-quantized weights (which parity runs; there tf2onnx merges identical nodes - the
    quantizers' shared range checks - and which duplicate survives, with its name and place in
    the order, may differ: the same ops and constants, and the same outputs bit for bit)."""
    from tf_bridge.onnx_values import run_with_tensors

    model = tf_bridge.wrap.float_model(qat_model) if which == "float twin" else qat_model
    concrete = _concrete(model)
    ours, reference = (C._tf2onnx_without_conv_folding(concrete, ["image"], 17),
                       _reference(concrete, ["image"], 17))
    if which == "float twin":
        assert _canonical(ours) == _canonical(reference)
        return
    ops = [sorted((n.op_type, tuple(sorted(a.SerializeToString() for a in n.attribute)))
                  for n in m.graph.node) for m in (ours, reference)]
    assert ops[0] == ops[1]
    constants = [sorted(x[1:] for x in _canonical(m)[1]) for m in (ours, reference)]
    assert constants[0] == constants[1]
    x = blobs(8, (16, 16, 3))[0] * 40.0
    got = [run_with_tensors(m, {"image": x})[m.graph.output[0].name] for m in (ours, reference)]
    np.testing.assert_array_equal(got[0], got[1])


def test_fold_constants_computes_what_each_op_computes_alone(qat_model):
    """The constant chains of the QAT graph (per-channel amax, fake-quantized weights) are folded
    into constants, no foldable op is left for tf2onnx's per-op sessions, and the folded graph
    computes the model's outputs bit for bit as the unfolded one does."""
    import tensorflow as tf
    from tensorflow.python.framework import convert_to_constants as c2c

    concrete = _concrete(qat_model)
    frozen = c2c.convert_variables_to_constants_v2(concrete, lower_control_flow=False,
                                                   aggressive_inlining=True)
    graph_def = frozen.graph.as_graph_def()
    outputs = [t.name for t in frozen.outputs]
    folded = C._fold_constants(graph_def, outputs)
    rounds = [sum(n.op == "Round" for n in g.node) for g in (graph_def, folded)]
    assert 0 < rounds[1] < rounds[0], "weights' Round folded, activations' Round kept"
    assert len(folded.node) < len(graph_def.node)
    again = C._fold_constants(folded, outputs)
    assert len(again.node) == len(folded.node), "nothing left that tf2onnx would fold op by op"
    x = blobs(4, (16, 16, 3))[0]
    results = []
    for g in (graph_def, folded):
        with tf.Graph().as_default() as graph:
            tf.import_graph_def(g, name="")
            with tf.compat.v1.Session(graph=graph) as session:
                results.append(session.run(outputs[0], {frozen.inputs[0].name: x}))
    np.testing.assert_array_equal(results[0], results[1])


def test_forward_only_qat_graph_computes_the_same_numbers(qat_model):
    """``forward_only`` (how export_onnx converts the Keras QAT graph for parity): no gradient
    wrappers and no run-time range select, so the weights' fake quantization folds into constants
    and each quantizer loses its select (tf2onnx writes ``tf.where`` as Mul/Add arithmetic);
    onnxruntime computes bit for bit the same outputs."""
    from onnx_qat.io.models import load_model
    from tf_bridge.fake_quant import forward_only
    from tf_bridge.onnx_values import run_with_tensors

    plain = load_model(C.convert_float_twin(qat_model, 17))
    with forward_only():
        lean = load_model(C.convert_float_twin(qat_model, 17))
    ops = [collections.Counter(n.op_type for n in m.graph.node) for m in (plain, lean)]
    assert ops[0] - ops[1] and not ops[1] - ops[0], ops  # only removed: tf2onnx's select arithmetic
    x = blobs(8, (16, 16, 3))[0] * 40.0
    outputs = [run_with_tensors(m, {m.graph.input[0].name: x})[m.graph.output[0].name] for m in (plain, lean)]
    np.testing.assert_array_equal(outputs[0], outputs[1])
    expected = qat_model(x, training=False).numpy()
    np.testing.assert_allclose(outputs[1], expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
