"""Step 1 of [`tf_bridge.export_onnx`][]: the float twin through tf2onnx.

The float twin (same layers, trained weights, inference mode, no quantizers) is converted at a
pinned opset, each BatchNormalization kept as a Mul/Add beside its Conv (as Keras computes it:
`GRAPPLER_PASSES`, `_pin_conv_bias`); a conversion that fails, leaves TensorFlow ops
or makes a graph the ONNX checker refuses is one [`onnx_qat.errors.ExportError`][] line.
"""
from __future__ import annotations

import gc
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
    gc.collect()  # tf2onnx's graph holds reference cycles: free its copies of the weights now
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
    ``failures``: tf2onnx's reasons by node name (`Tf2onnxLog`).

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
#: tf2onnx (with TensorFlow, op by op) and by its ONNX optimizers; `_pin_conv_bias` keeps those
#: from folding the Mul in their turn.
GRAPPLER_PASSES = ("function", "dependency")


def _tf2onnx_without_conv_folding(concrete, input_names: List[str], opset: int,
                                  optimizers=None) -> onnx.ModelProto:
    """``tf2onnx.convert.from_function`` for ``concrete``, except that the BatchNorm Mul/Add stay
    separate from the convolutions (`GRAPPLER_PASSES`); ``input_names`` name the ONNX inputs.

    The same steps as tf2onnx's, made cheaper where they only cost time and memory:

    * the frozen graph is taken as a GraphDef (`_frozen_graph_def`), without wrapping it in a
      new TensorFlow function first (most of the freezing time, and a copy of every weight);
    * tf2onnx's ONNX optimizers (``optimizers``: its own table when None) run in tf2onnx's order
      and loop (`_optimize_onnx`) without its per-pass recovery, which copies the whole graph,
      weights included, before every pass, and with the node protos written once at the end instead
      of after every pass (each write copies every weight once more). Where a pass fails, the graph
      is converted again and optimized with that recovery, as ``tf2onnx.convert`` does: the
      failing pass is skipped and logged.

    The ONNX model is the same, node for node and byte for byte, as tf2onnx's own loop makes."""
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer
    from tf2onnx import optimizer, tfonnx

    frozen, tf_inputs, tf_outputs = _frozen_graph_def(concrete)
    frozen = inlinable(frozen)  # grouped convolutions: their XLA-marked functions inlined
    config = config_pb2.ConfigProto()
    config.graph_options.infer_shapes = True
    config.graph_options.rewrite_options.optimizers[:] = list(GRAPPLER_PASSES)
    with tf.Graph().as_default():
        meta = tf.compat.v1.train.export_meta_graph(graph_def=frozen)
    del frozen
    fetch = meta_graph_pb2.CollectionDef()
    fetch.node_list.value.extend(tf_inputs + tf_outputs)
    meta.collection_def["train_op"].CopyFrom(fetch)
    graph_def = _fold_constants(tf_optimizer.OptimizeGraph(config, meta), tf_outputs)
    del meta
    with tf.device("/cpu:0"), tf.Graph().as_default() as tf_graph:
        tf.import_graph_def(graph_def, name="")
        del graph_def

        def convert():
            graph = tfonnx.process_tf_graph(tf_graph, continue_on_error=True, opset=opset,
                                            input_names=tf_inputs, output_names=tf_outputs,
                                            custom_op_handlers=dict(CUSTOM_OP_HANDLERS),
                                            tensors_to_rename=dict(zip(tf_inputs, input_names)))
            _pin_conv_bias(graph)
            return graph

        try:
            graph = _optimize_onnx(convert(), optimizers)
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
    ``function`` pass: the attributes of `_NO_INLINE_ATTRS` are dropped from the call nodes
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


def _frozen_graph_def(concrete):
    """The GraphDef of ``concrete`` with its variables turned into constants (inlined, control flow
    kept), and the names of its input and output tensors.

    What ``convert_variables_to_constants_v2`` freezes, taken before it wraps the GraphDef in a new
    concrete function (tf2onnx needs only the graph)."""
    import tensorflow as tf
    from tensorflow.python.framework import convert_to_constants as c2c

    data = c2c._FunctionConverterDataInEager(func=concrete, lower_control_flow=False,  # noqa: SLF001
                                            aggressive_inlining=True)
    graph_def, converted = c2c._replace_variables_by_constants(converter_data=data)  # noqa: SLF001
    del data
    captures = concrete.graph.internal_captures
    frozen = {id(captures[i]) for i in converted}
    tf_inputs = [t.name for t in concrete.inputs if id(t) not in frozen and t.dtype != tf.resource]
    tf_outputs = [t.name for t in concrete.outputs if t.dtype != tf.resource]
    return graph_def, tf_inputs, tf_outputs


#: TensorFlow ops tf2onnx's constant folding (``tf_utils.compute_const_folding_using_tf``) leaves alone.
_UNFOLDED_OPS = ("Enter", "Placeholder", "PlaceholderWithDefault", "Switch", "Merge", "NextIteration", "Exit",
                 "QuantizeAndDequantizeV2", "QuantizeAndDequantizeV3", "QuantizeAndDequantizeV4")


def _fold_constants(graph_def, tf_outputs: List[str]):
    """``graph_def`` with the values tf2onnx would fold with TensorFlow computed in one run.

    tf2onnx folds every op whose inputs are all constant (one output, not a graph output, no
    control input, not random, not a result of a million values or more made from inputs of at
    most a thousand), each in a TensorFlow session of its own: thousands of sessions for a QAT graph,
    whose fake-quantized weights are such ops. The same ops are computed here by the same kernels
    in one session, with TensorFlow's graph optimizations off (each op computes exactly its own
    definition, as it does alone), and the last ones of each constant chain are written as
    constants in their place; tf2onnx then finds the values it would have computed."""
    import tensorflow as tf
    from tensorflow.python.framework import tensor_util

    with tf.Graph().as_default() as graph:
        tf.import_graph_def(graph_def, name="")
    outputs, known, folded = set(tf_outputs), set(), {}
    for op in graph.get_operations():  # imported in topological order
        if op.type in ("Const", "ConstV2"):
            known.add(op.outputs[0].name)
            continue
        ins = [t.name for t in op.inputs]
        if (op.type in _UNFOLDED_OPS or op.type.startswith("Random") or op.op_def.is_stateful or not ins
                or op.control_inputs or len(op.outputs) != 1 or op.outputs[0].name in outputs
                or not all(t in known for t in ins) or _huge_from_small(op)):
            continue
        known.add(op.outputs[0].name)
        folded[op.name] = op
    controlled = {i[1:] for node in graph_def.node for i in node.input if i.startswith("^")}
    frontier = [op for op in folded.values() if op.name in controlled
                or any(c.name not in folded for t in op.outputs for c in t.consumers())]
    if not frontier:
        return graph_def
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    config.graph_options.optimizer_options.opt_level = tf.compat.v1.OptimizerOptions.L0
    try:
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            values = session.run([op.outputs[0] for op in frontier])
    except Exception as exc:  # TensorFlow raises many types; tf2onnx then folds op by op, skipping failures
        logger.debug("constant folding in one run failed (%s); tf2onnx folds op by op", brief(exc))
        return graph_def
    constants = {op.name: value for op, value in zip(frontier, values)}
    result = tf.compat.v1.GraphDef()
    result.versions.CopyFrom(graph_def.versions)
    result.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name in constants:
            const = result.node.add(name=node.name, op="Const", device=node.device)
            const.attr["dtype"].type = folded[node.name].outputs[0].dtype.as_datatype_enum
            const.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(constants[node.name]))
        elif node.name not in folded:
            result.node.add().CopyFrom(node)
    return result


def _huge_from_small(op) -> bool:
    """An op tf2onnx does not fold: a result of a million values or more from inputs of at most a
    thousand each (a Fill, a broadcast...)."""
    size = op.outputs[0].shape.num_elements()
    return size is not None and size >= 1_000_000 and all(
        (t.shape.num_elements() or 0) <= 1000 and t.shape.num_elements() is not None for t in op.inputs)


def _optimize_onnx(graph, optimizers=None):
    """tf2onnx's ONNX optimizers on a tf2onnx ``graph``, in its order and its loop (every pass
    again while one changes the graph), raising on the first failure. Each pass computes on the
    graph's nodes (``_optimize``) and drops unused nodes, as ``GraphOptimizerBase.optimize`` does;
    the node protos, which no pass reads, are written once by ``make_model``."""
    from tf2onnx import optimizer

    table = optimizer._get_optimizers() if optimizers is None else optimizers  # noqa: SLF001
    again, iteration = True, 0
    while again:
        again = False
        for factory in table.values():
            opt = factory()
            opt.opt_iteration = iteration
            graph = opt._optimize(graph)  # noqa: SLF001
            graph.delete_unused_nodes(graph.outputs)
            again = again or opt.graph_been_opt
        iteration += 1
    try:
        graph.topological_sort(graph.get_nodes())
    except Exception:  # as tf2onnx's loop: the graph stays in its order
        logger.warning("tf2onnx: failed topological_sort", exc_info=True)
    return graph


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
