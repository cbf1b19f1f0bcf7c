"""Step 1 of :func:`tf_bridge.export_onnx`: the float twin through tf2onnx.

The float twin (same layers, trained weights, inference mode, no quantizers) is converted at a
pinned opset, each BatchNormalization kept as a Mul/Add beside its Conv (as Keras computes it:
:data:`GRAPPLER_PASSES`, :func:`_pin_conv_bias`); a conversion that fails, leaves TensorFlow ops
or makes a graph the ONNX checker refuses is one :class:`onnx_qat.errors.ExportError` line.
"""
from __future__ import annotations

import logging
from types import MappingProxyType
from typing import List, Mapping, Optional

import numpy as np
import onnx

from onnx_qat.errors import ExportError, brief

logger = logging.getLogger(__name__)


_FAKE_QUANT_OPS = ("QuantizeLinear", "DequantizeLinear", "QuantizeAndDequantizeV4", "FakeQuantWithMinMaxVars")


def convert_float_twin(twin, opset: int) -> onnx.ModelProto:
    """tf2onnx conversion of the float twin at ``opset`` (inference mode, dynamic batch).

    Raises:
        ExportError: ``opset`` below 13; tf2onnx fails, leaves TensorFlow ops unconverted or
            makes a graph the ONNX checker refuses (one line: tf2onnx's message shortened, the
            ops and their layers, what to try); or the graph holds fake-quantization ops.
    """
    import tensorflow as tf

    if int(opset) < 13:
        raise ExportError(f"export_onnx: opset {opset} is below 13, the first with per-channel "
                          f"QuantizeLinear; use opset=13..{_tf2onnx_max_opset()}")
    specs = [tf.TensorSpec((None, *t.shape[1:]), t.dtype, name=t.name.split(":")[0]) for t in twin.inputs]

    @tf.function(input_signature=specs)
    def forward(*xs):
        return twin(list(xs) if len(xs) > 1 else xs[0], training=False)

    with Tf2onnxLog() as log:
        try:
            concrete = forward.get_concrete_function(*specs)
            captured = _captured_constants(concrete)
            proto = _tf2onnx_without_conv_folding(concrete, [s.name for s in specs], int(opset))
        except Exception as exc:  # tf2onnx raises many types
            failed = f" (it could not convert {_describe_ops(log.failures, twin, log.ops)})" \
                if log.failures else ""
            raise ExportError(f"export_onnx: tf2onnx {_tf2onnx_version()} could not convert model "
                              f"'{twin.name}' at opset {opset}: "
                              f"{brief(exc).replace('make_sure failure: ', '')}{failed}; "
                              f"{_what_to_try(bool(failed))}") from None
        _inline_captured(proto, captured, {s.name for s in specs})
        found = sorted({n.op_type for n in proto.graph.node if n.op_type in _FAKE_QUANT_OPS})
        if found:
            raise ExportError(f"export_onnx: the float graph of '{twin.name}' holds {', '.join(found)}; "
                              "export the model returned by tf_bridge.quantize_model, "
                              "not a model with its own fake-quant")
        check_converted(proto, twin, int(opset), log.failures)
    return proto


class Tf2onnxLog(logging.Handler):
    """tf2onnx's warnings and errors during one conversion, held back (``with Tf2onnxLog() as log``).

    tf2onnx logs each op it cannot convert (with a traceback when an op handler fails) and
    goes on. The records are replayed unchanged when the block ends normally, and only logged
    at debug level when it raises (the conversion is refused in one line). ``failures`` maps
    each TensorFlow node tf2onnx could not convert to its reason ("" when it has no handler),
    ``ops`` the nodes it names with their op types.
    """

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: List[logging.LogRecord] = []
        self.failures: dict = {}
        self.ops: dict = {}
        self._logger = logging.getLogger("tf2onnx")
        self._propagate = True

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        message, args = (record.msg if isinstance(record.msg, str) else ""), record.args or ()
        if message.startswith("Failed to convert node") and args:
            reason = brief(record.exc_info[1], 160, first_line=True) if record.exc_info else ""
            self.failures[str(args[0])] = reason.replace("make_sure failure: ", "")
        elif message.startswith("Tensorflow op [") and len(args) == 2:
            self.failures.setdefault(str(args[0]), "")
            self.ops[str(args[0])] = str(args[1])

    def __enter__(self) -> "Tf2onnxLog":
        self._propagate = self._logger.propagate
        self._logger.addHandler(self)
        self._logger.propagate = False
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate
        for record in self.records:
            if exc_type is None:
                logging.getLogger(record.name).handle(record)
            else:
                logger.debug("tf2onnx: %s", record.getMessage())


def check_converted(proto: onnx.ModelProto, twin, opset: int, failures: Optional[Mapping[str, str]] = None
                    ) -> None:
    """Refuse a tf2onnx result that still holds TensorFlow ops or that ``onnx.checker`` refuses.

    tf2onnx keeps an op it cannot convert as a node of its TensorFlow type (``Lgamma``,
    ``FFT``...) and returns the graph. Every node, subgraphs included, must be a standard ONNX
    op (domain ``""``, ``ai.onnx`` or ``ai.onnx.ml``) with a schema at the model's opset.
    ``failures``: tf2onnx's reasons by node name (:class:`Tf2onnxLog`).

    Raises:
        ExportError: one line naming the ops, their Keras layers and tf2onnx's reasons.
    """
    versions = {("" if o.domain in ("", "ai.onnx") else o.domain): o.version for o in proto.opset_import}
    bad = {n.name: n.op_type for n in _all_nodes(proto.graph) if not _is_standard(n, versions)}
    if bad:
        reasons = {name: (failures or {}).get(name, "") for name in bad}
        raise ExportError(f"export_onnx: tf2onnx {_tf2onnx_version()} left TensorFlow op(s) of model "
                          f"'{twin.name}' unconverted at opset {opset}: {_describe_ops(reasons, twin, bad)}; "
                          f"{_what_to_try()}")
    if proto.ByteSize() < onnx.checker.MAXIMUM_PROTOBUF:
        try:
            onnx.checker.check_model(proto)
        except Exception as exc:  # onnx raises ValidationError and others
            raise ExportError(f"export_onnx: tf2onnx {_tf2onnx_version()} made an invalid ONNX model of "
                              f"'{twin.name}' at opset {opset}: {brief(exc, 160, first_line=True)}; "
                              f"{_what_to_try()}") from None


def _all_nodes(graph):
    """Every node of ``graph`` and of its subgraphs (If/Loop/Scan bodies), in order."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _all_nodes(sub)


def _is_standard(node, versions: Mapping[str, int]) -> bool:
    """A node of a standard ONNX domain with a schema at the model's opset for that domain."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    if domain not in ("", "ai.onnx.ml") or domain not in versions:
        return False
    try:
        onnx.defs.get_schema(node.op_type, versions[domain], domain)
    except onnx.defs.SchemaError:
        return False
    return True


def _describe_ops(reasons: Mapping[str, str], twin, op_types: Optional[Mapping[str, str]] = None) -> str:
    """``Lgamma in layer 'special'; FFT in layer 'spectrum' (reason)``: sorted, at most three."""
    import re

    layers = _layer_names(twin)
    parts = []
    for name in sorted(reasons):
        op = (op_types or {}).get(name) or name.rsplit("/", 1)[-1]
        scopes = [re.sub(r"_\d+$", "", c) if c not in layers else c for c in name.split("/")[:-1]]
        layer = next((c for c in reversed(scopes) if c in layers), None)
        text = op + (f" in layer '{layer}'" if layer else f" (node '{name}')")
        text += f" ({reasons[name]})" if reasons[name] else ""
        if text not in parts:
            parts.append(text)
    return "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more" if len(parts) > 3 else "")


def _layer_names(model) -> set:
    """The names of every layer of ``model`` and of its nested models."""
    names = set()
    for layer in getattr(model, "layers", ()):
        names.add(layer.name)
        names |= _layer_names(layer)
    return names


def _tf2onnx_version() -> str:
    import tf2onnx

    return tf2onnx.__version__


def _tf2onnx_max_opset() -> int:
    from tf2onnx import constants

    return max(constants.OPSET_TO_IR_VERSION)


def _what_to_try(layer: bool = True) -> str:
    replace = "replace that layer with built-in Keras layers, " if layer else ""
    return (f"nothing was written; try another opset (13..{_tf2onnx_max_opset()}), {replace}or export the "
            "float model to ONNX another way and quantize it with `onnx-qat quantize`")


#: Grappler passes the frozen graph gets: ``tf2onnx.tf_loader.tf_optimize`` minus ``constfold``, whose
#: Mul/Conv push-down folds a BatchNorm's per-channel Mul into the convolution weights. Keras computes
#: ``conv(x, q(w)) * f``, the folded graph ``conv(x, q(w) * f)``: equal up to the last float bit, enough to
#: move values lying on a quantizer's rounding boundary by a whole step. Constants are still folded by
#: tf2onnx (with TensorFlow, op by op) and by its ONNX optimizers; :func:`_pin_conv_bias` keeps those
#: from folding the Mul in their turn.
GRAPPLER_PASSES = ("function", "dependency")


def _tf2onnx_without_conv_folding(concrete, input_names: List[str], opset: int,
                                  optimizers=None) -> onnx.ModelProto:
    """``tf2onnx.convert.from_function`` for ``concrete``, except that the BatchNorm Mul/Add stay
    separate from the convolutions (:data:`GRAPPLER_PASSES`); ``input_names`` name the ONNX inputs.

    tf2onnx's ONNX optimizers (``optimizers``: its own table when None) run first without its
    per-pass recovery, which copies the whole graph, weights included, before every pass (half the
    conversion time of a ResNet50). Where a pass fails, the graph is converted again and optimized
    with that recovery, as ``tf2onnx.convert`` does: the failing pass is skipped and logged."""
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    from tensorflow.python.grappler import tf_optimizer
    from tf2onnx import optimizer, tfonnx

    frozen = convert_variables_to_constants_v2(concrete, lower_control_flow=False, aggressive_inlining=True)
    graph_def = inlinable(frozen.graph.as_graph_def(add_shapes=True))
    tf_inputs = [t.name for t in frozen.inputs if t.dtype != tf.resource]
    tf_outputs = [t.name for t in frozen.outputs if t.dtype != tf.resource]
    config = config_pb2.ConfigProto()
    config.graph_options.infer_shapes = True
    config.graph_options.rewrite_options.optimizers[:] = list(GRAPPLER_PASSES)
    with tf.Graph().as_default():
        meta = tf.compat.v1.train.export_meta_graph(graph_def=graph_def)
    fetch = meta_graph_pb2.CollectionDef()
    fetch.node_list.value.extend(tf_inputs + tf_outputs)
    meta.collection_def["train_op"].CopyFrom(fetch)
    graph_def = tf_optimizer.OptimizeGraph(config, meta)
    with tf.device("/cpu:0"), tf.Graph().as_default() as tf_graph:
        tf.import_graph_def(graph_def, name="")

        def convert():
            graph = tfonnx.process_tf_graph(tf_graph, continue_on_error=True, opset=opset,
                                            input_names=tf_inputs, output_names=tf_outputs,
                                            custom_op_handlers=dict(CUSTOM_OP_HANDLERS),
                                            tensors_to_rename=dict(zip(tf_inputs, input_names)))
            _pin_conv_bias(graph)
            return graph

        try:
            graph = optimizer.optimize_graph(convert(), catch_errors=False, optimizers=optimizers)
        except Exception as exc:  # an optimizer pass failed: convert again, skip that pass
            logger.debug("tf2onnx optimizer pass failed (%s); converting again with per-pass recovery",
                         brief(exc))
            graph = optimizer.optimize_graph(convert(), catch_errors=True, optimizers=optimizers)
        return graph.make_model(f"converted from {concrete.name}")


#: Attributes that keep TensorFlow's function-inlining pass away from a function call:
#: Keras 3 runs a grouped convolution (``Conv2D(groups=...)``, ConvNeXt's depthwise convolutions) on
#: CPU inside ``tf.function(jit_compile=True)`` (TensorFlow's CPU kernel has no groups), which a
#: traced model holds as a ``StatefulPartitionedCall`` of a function marked for XLA; tf2onnx leaves
#: such a call unconverted. Its body is one plain ``Conv2D`` (grouped by its kernel's shape), which
#: tf2onnx converts to an ONNX ``Conv`` with ``group``.
_NO_INLINE_ATTRS = ("_XlaMustCompile", "_noinline", "_XlaCompile")


def inlinable(graph_def):
    """A copy of a frozen ``graph_def`` whose function calls can all be inlined by Grappler's
    ``function`` pass: the attributes of :data:`_NO_INLINE_ATTRS` are dropped from the call nodes
    and from the library's functions. Only the XLA compilation request is dropped; the functions
    compute the same ops, which the conversion reads one by one anyway."""
    from tensorflow.core.framework import graph_pb2

    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    for node in list(copy.node) + [n for f in copy.library.function for n in f.node_def]:
        for attr in _NO_INLINE_ATTRS:
            if attr in node.attr:
                del node.attr[attr]
    for function in copy.library.function:
        for attr in _NO_INLINE_ATTRS:
            if attr in function.attr:
                del function.attr[attr]
    return copy


def _erfc(ctx, node, name, args) -> None:
    """tf2onnx handler of ``Erfc`` (Keras' exact GELU, ``0.5 x erfc(-x/sqrt 2)``, which tf2onnx 1.17
    has no handler for): ``1 - Erf(x)``. In float32 this is off erfc by at most about 6e-8 (erf's
    rounding below 1: an erfc below that becomes 0), i.e. at most about ``3e-8 * |x|`` in the GELU
    output, absolutely (below its last bit for x > 0, where it is about x)."""
    from tf2onnx import utils

    dtype = utils.map_onnx_to_numpy_type(ctx.get_dtype(node.output[0]))
    node.type = "Erf"
    one = ctx.make_const(node.name + "/one", np.array(1, dtype))
    sub = ctx.insert_new_node_on_output("Sub", node.output[0], name=node.name + "/one_minus")
    ctx.replace_inputs(sub, [one.output[0], node.output[0]])
    ctx.copy_shape(node.output[0], sub.output[0])
    ctx.set_dtype(sub.output[0], ctx.get_dtype(node.output[0]))


#: TensorFlow ops tf2onnx 1.17 has no handler for, converted by the export's own handlers
#: (tf2onnx's ``custom_op_handlers``: op type -> (function, args)).
CUSTOM_OP_HANDLERS = MappingProxyType({"Erfc": (_erfc, [])})


def _pin_conv_bias(graph) -> None:
    """Give every bias-less Conv of a tf2onnx ``graph`` an explicit zero bias: tf2onnx's transpose
    optimizer folds a following per-channel Mul into the weights of a Conv without bias (and an
    Add into its bias), a Conv with a bias keeps them as separate nodes. Adding zero is exact."""
    from tf2onnx import utils

    for node in graph.get_nodes():
        shape = graph.get_shape(node.output[0]) if node.type == "Conv" and len(node.input) == 2 else None
        if not shape or len(shape) < 2 or shape[1] is None or shape[1] <= 0:
            continue
        dtype = utils.map_onnx_to_numpy_type(graph.get_dtype(node.output[0]))
        bias = graph.make_const(node.name + "/zero_bias", np.zeros(shape[1], dtype))
        graph.replace_inputs(node, [*node.input, bias.output[0]])


def _captured_constants(concrete) -> dict:
    """Tensors (not variables) a traced function captured, by the name of their placeholder
    (e.g. the mean of a built ``Normalization`` layer): tf2onnx leaves them as graph inputs."""
    import tensorflow as tf

    found = {}
    for external, internal in zip(concrete.captured_inputs, concrete.graph.internal_captures):
        if external.dtype != tf.resource and hasattr(external, "numpy"):
            found[internal.name] = np.asarray(external.numpy())
    return found


def _inline_captured(proto: onnx.ModelProto, captured: dict, input_names: set) -> None:
    """Turn graph inputs that hold captured constants into initializers (in place)."""
    extra = [i for i in proto.graph.input if i.name not in input_names and i.name in captured]
    for inp in extra:
        proto.graph.input.remove(inp)
        proto.graph.initializer.append(onnx.numpy_helper.from_array(captured[inp.name], inp.name))
    unknown = [i.name for i in proto.graph.input if i.name not in input_names]
    if unknown:
        raise ExportError(f"export_onnx: the converted graph needs inputs the model does not have: "
                          f"{', '.join(unknown[:3])}; rebuild the layer that holds them with "
                          "constant weights")
