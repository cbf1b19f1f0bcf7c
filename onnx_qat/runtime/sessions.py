"""onnxruntime sessions and batched runs, shared by calibration, compare and the tools.

* `make_session` — a deterministic CPU session for a model, optionally with
  intermediate tensors exposed as extra outputs (on a copy of the model).
* `run_batches` — yield each batch's outputs (calibration reduces them at once).
* `run_model` — all outputs for a whole dataset, joined over batches.
"""
from __future__ import annotations

import logging
import sys
from typing import Dict, Iterable, Iterator, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import numpy_helper

from ..io.data import Dataset, load_data
from ..errors import ConfigError, ModelError, brief
from ..io.models import InputSpec, copy_except_initializers, load_model, target_ir_version

logger = logging.getLogger(__name__)

_ORT_DTYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(int16)": np.int16,
    "tensor(uint16)": np.uint16,
    "tensor(int32)": np.int32, "tensor(uint32)": np.uint32, "tensor(int64)": np.int64,
    "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def make_session(model, *, threads: Optional[int] = None,
                 providers: Sequence[str] = ("CPUExecutionProvider",),
                 extra_outputs: Iterable[str] = (), copy: bool = True, optimize: Optional[bool] = None,
                 spin: bool = True):
    """Create an onnxruntime ``InferenceSession`` with deterministic options.

    Args:
        model: a ``ModelProto`` (not modified) or a path (read with
            [`load_model`][onnx_qat.io.models.load_model]).
        threads: intra-op threads (``None``: onnxruntime's default).
        providers: execution providers, in order of preference.
        extra_outputs: tensor names to expose as additional graph outputs (on the session's own
            copy of the graph, weights not copied), e.g. the activations calibration observes.
        copy: with ``False`` a ``ModelProto`` the caller owns and no longer needs is
            given the extra outputs in place.
        optimize: ``False`` turns onnxruntime's graph optimisations off, so
            QuantizeLinear/DequantizeLinear compute exactly their definition instead of
            being fused into onnxruntime's own integer kernels. ``None`` (the default): off for a
            TensorRT-form Q/DQ model and any FP8 model (`needs_exact_qdq`: TensorRT's
            arithmetic), on otherwise (float models, the ``ort-cpu`` form run as deployed).
        spin: ``False`` keeps the intra-op threads from spinning after their work
            (``session.intra_op.allow_spinning = 0``): less CPU time for many short runs
            with Python work in between, and on a loaded machine.

    Raises:
        ModelError: a name in ``extra_outputs`` is not a tensor of the model, or
            onnxruntime refuses the model (its message, shortened).
    """
    import onnxruntime as ort

    owned = not isinstance(model, onnx.ModelProto)
    proto = load_model(model) if owned else model
    extra = tuple(dict.fromkeys(extra_outputs))
    pending: Tuple[str, ...] = ()
    if copy and not owned:  # the outputs go on the session's own copy of the graph (weights not copied)
        _check_tensor_names(proto, extra)
        pending = extra
    elif extra or proto.ir_version != target_ir_version(proto):
        proto = with_outputs(proto, extra, copy=False)
    if optimize is None:
        optimize = not needs_exact_qdq(proto)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    options.use_deterministic_compute = True
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if tuple(providers) == ("CPUExecutionProvider",):
            # nor the one QDQ pass onnxruntime runs even then (EnsureUniqueDQForNodeUnit, run by
            # inference_session.cc's TransformGraph unless session.disable_quant_qdq: a copy of each
            # DequantizeLinear read by several nodes, for the QDQ node units that only the fusions and
            # other providers' partitioning use): the same values, and a session of Q/DQ nodes builds
            # about 15% faster
            options.add_session_config_entry("session.disable_quant_qdq", "1")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be a whole number >= 1, got {threads!r}")
        options.intra_op_num_threads = threads
    try:
        return _session_weights_in_memory(ort, proto, options, providers, pending)
    except (ModelError, ConfigError):
        raise
    except Exception as exc:
        raise ModelError(f"onnxruntime cannot load the model: {brief(exc, 300)}") from None


#: ONNX element types whose arrays onnxruntime takes as OrtValues (plain NumPy types).
_NUMPY_TYPES = frozenset({1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13})
#: Initializers of at least this many bytes reach onnxruntime as arrays instead of serialized bytes ...
IN_MEMORY_WEIGHT_BYTES = 1024
#: ... except those up to this size, while their bytes together stay within `SERIALIZED_WEIGHT_BUDGET`:
#: a weight of a few KB costs more as an array (``to_array`` and an OrtValue, ~20 us each) than
#: serialized (about 17 ms less per 2,000-node piece of the benchmark's residual nets, 500 weights
#: of 9 KB each).
SERIALIZED_WEIGHT_BYTES = 64 * 1024
#: The most bytes of weights one session receives serialized (far from protobuf's 2 GB limit).
SERIALIZED_WEIGHT_BUDGET = 64 * 1024 * 1024


def _session_weights_in_memory(ort, proto: onnx.ModelProto, options, providers, extra_outputs=()):
    """A session whose large weights reach onnxruntime as arrays (``add_external_initializers``),
    built and run so that a signal stops it (`InterruptibleSession`).

    Only the graph is serialized: the weights are neither copied into protobuf bytes nor parsed
    again by onnxruntime, and no 2 GB limit applies (no temporary file for large models). The
    session keeps the arrays alive (onnxruntime reads the weights from their buffers). Weights of at
    most `SERIALIZED_WEIGHT_BYTES` stay serialized up to `SERIALIZED_WEIGHT_BUDGET` bytes in all
    (cheaper for onnxruntime to parse than to receive one by one); the same values either way.
    """
    light = copy_except_initializers(proto)
    present = {o.name for o in light.graph.output}
    light.graph.output.extend(onnx.ValueInfoProto(name=n) for n in extra_outputs if n not in present)
    light.ir_version = target_ir_version(light)
    names, values = [], []
    # onnxruntime replaces only initializers main-graph nodes read (it drops unread ones, and hands
    # those read in subgraphs down to them): the others stay serialized
    inner = _read_in_subgraphs(proto.graph)
    read = {t for node in proto.graph.node for t in node.input}
    read.update(o.name for o in proto.graph.output)
    budget = SERIALIZED_WEIGHT_BUDGET
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.DEFAULT and tensor.HasField("raw_data") \
                and tensor.name in read and tensor.name not in inner \
                and tensor.data_type in _NUMPY_TYPES:  # not float8/int4: no OrtValue from their arrays
            size = len(tensor.raw_data)
            small = size < IN_MEMORY_WEIGHT_BYTES
            if not small and size <= SERIALIZED_WEIGHT_BYTES and size <= budget:
                budget -= size
                small = True
            if not small:
                array = numpy_helper.to_array(tensor)
                names.append(tensor.name)
                values.append(ort.OrtValue.ortvalue_from_numpy(array))
                stub = light.graph.initializer.add(name=tensor.name, dims=tensor.dims,
                                                   data_type=tensor.data_type,
                                                   data_location=onnx.TensorProto.EXTERNAL)
                stub.external_data.add(key="location", value="in-memory")
                continue
        light.graph.initializer.append(tensor)
    if names:
        options.add_external_initializers(names, values)
    from .interrupts import InterruptibleSession, call_interruptibly

    session = call_interruptibly(ort.InferenceSession, light.SerializeToString(), options,
                                 providers=list(providers))
    return InterruptibleSession(session, values)


#: ONNX element types of FP8 tensors (float8e4m3fn/fnuz, float8e5m2/fnuz).
_FLOAT8_TYPES = frozenset({17, 18, 19, 20})


def needs_exact_qdq(model: onnx.ModelProto) -> bool:
    """True when onnxruntime must run ``model`` with graph optimisations off, so that every
    QuantizeLinear/DequantizeLinear computes its definition: a model holding Q/DQ nodes in TensorRT's
    form (signed or FP8 zero points, or none), whose numbers must be TensorRT's arithmetic, not those
    of onnxruntime's fused CPU kernels (on ``keras.applications.MobileNetV2(weights=None)``, whose
    activations shrink to ~1e-10, the optimized session's output has cosine 0.32 against the float
    model where the exact arithmetic gives 0.9994; turning off only the QDQ transformers,
    ``session.disable_quant_qdq``, does not restore it), and any FP8 model (onnxruntime 1.31's QDQ
    fusion makes an FP8 Q/DQ MatMul an invalid MatMulIntegerToFloat). False for float models and for
    the ``ort-cpu`` form (uint8 activation zero points), which is judged as deployed."""
    if any(t.data_type in _FLOAT8_TYPES for t in model.graph.initializer):
        return True
    if any(a.name == "value" and a.t.data_type in _FLOAT8_TYPES
           for n in model.graph.node if n.op_type == "Constant" for a in n.attribute):
        return True
    return is_tensorrt_form(model)


def is_tensorrt_form(model: onnx.ModelProto) -> bool:
    """``model``'s main graph holds QuantizeLinear/DequantizeLinear nodes and no QuantizeLinear with a
    uint8 zero point (the ``ort-cpu`` form's activations) nor an onnxruntime integer op
    (``QLinear*``, ``*Integer``): TensorRT's explicit-quantization form."""
    initializers = {t.name: t.data_type for t in model.graph.initializer}
    qdq = False
    for node in model.graph.node:
        if node.op_type.startswith("QLinear") or node.op_type in ("ConvInteger", "MatMulInteger"):
            return False
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            qdq = True
            if node.op_type == "QuantizeLinear" and len(node.input) > 2 and \
                    initializers.get(node.input[2]) == onnx.TensorProto.UINT8:
                return False
    return qdq


def _read_in_subgraphs(graph: onnx.GraphProto) -> set:
    """Names used inside the subgraphs (If/Loop/Scan bodies) of ``graph``; empty without any.

    Only control-flow ops and ops of other domains (onnxruntime's contrib ops) can hold graphs: the
    attributes of those alone are read (one pass over op types otherwise)."""
    ops = {n.op_type for n in graph.node}
    if not ops & {"If", "Loop", "Scan"} and all(n.domain in ("", "ai.onnx") for n in graph.node):
        return set()
    holders = [n for n in graph.node if n.attribute and any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)]
    if not holders:
        return set()
    from ..graph.edit import subgraph_names

    return subgraph_names(holders)


def with_outputs(model: onnx.ModelProto, names: Iterable[str], *, copy: bool = True) -> onnx.ModelProto:
    """``model`` whose graph also outputs ``names``, IR version set for onnxruntime.

    Works on a copy unless ``copy`` is False (then ``model`` itself is changed).
    """
    if copy:
        model, original = onnx.ModelProto(), model
        model.CopyFrom(original)
    names = tuple(names)
    _check_tensor_names(model, names)
    present = {o.name for o in model.graph.output}
    for name in names:
        if name not in present:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
            present.add(name)
    model.ir_version = target_ir_version(model)
    return model


def _check_tensor_names(model: onnx.ModelProto, names: Sequence[str]) -> None:
    if not names:
        return
    known = _tensor_names(model.graph)
    for name in names:
        if name not in known:
            raise ModelError(f"tensor {name!r} is not produced by any node or input of the model")


def _tensor_names(graph: onnx.GraphProto) -> set:
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(o for o in node.output if o)
    return names


def session_input_specs(session) -> Tuple[InputSpec, ...]:
    """The session's inputs as `InputSpec` (symbolic dims None)."""
    specs = []
    for arg in session.get_inputs():
        dtype = _ORT_DTYPES.get(arg.type)
        if dtype is None:
            raise ModelError(f"model input {arg.name!r} has type {arg.type}, which is not supported")
        shape = None if arg.shape is None else \
            tuple(d if isinstance(d, int) and d > 0 else None for d in arg.shape)
        specs.append(InputSpec(arg.name, np.dtype(dtype), shape))
    return tuple(specs)


def _session_and_data(model_or_session, data, threads=None):
    if hasattr(model_or_session, "run") and hasattr(model_or_session, "get_inputs"):
        session = model_or_session
    else:
        session = make_session(model_or_session, threads=threads)
    from ..io.feeds import FeedStream

    ready = isinstance(data, (Dataset, FeedStream))
    dataset = data if ready else load_data(data, session_input_specs(session))
    return session, dataset


def feeds_with_progress(dataset: Dataset, batch_size: int, progress: bool, desc: str):
    """``dataset.batches(batch_size)``, wrapped in a tqdm bar on stderr when ``progress`` is true."""
    feeds = dataset.batches(batch_size)
    if not progress:
        return feeds
    from tqdm import tqdm

    return tqdm(feeds, total=dataset.num_batches(batch_size), desc=desc, unit="batch", file=sys.stderr,
                leave=False, dynamic_ncols=True)


def run_batches(session, dataset: Dataset, *, batch_size: int = 16, outputs: Optional[Sequence[str]] = None,
                progress: bool = False, desc: str = "onnxruntime") -> Iterator[Dict[str, np.ndarray]]:
    """Run ``session`` on ``dataset`` batch by batch and yield ``{output name: array}`` per batch.

    A tqdm progress bar goes to stderr when ``progress`` is true. Data of a stateful model runs in
    order, each run's state outputs fed to the next (`onnx_qat.runtime.stateful.carry_state`).
    """
    from .stateful import carry_state

    session = carry_state(session, dataset)
    names = list(outputs) if outputs is not None else [o.name for o in session.get_outputs()]
    known = {o.name for o in session.get_outputs()}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ModelError(f"the model has no output {unknown[0]!r} (outputs: {', '.join(sorted(known))})")
    for index, feed in enumerate(feeds_with_progress(dataset, batch_size, progress, desc)):
        try:
            values = session.run(names, feed)
        except Exception as exc:
            raise ModelError(f"onnxruntime failed on batch {index} of {dataset.source}: "
                             f"{brief(exc, 300)}") from None
        yield dict(zip(names, values))


def run_model(model_or_session, data, *, batch_size: int = 16, outputs: Optional[Sequence[str]] = None,
              progress: bool = False, threads: Optional[int] = None) -> Dict[str, np.ndarray]:
    """Run a model on all of ``data`` and return ``{output name: array}`` joined over batches.

    Args:
        model_or_session: a ``ModelProto``, a path, or an onnxruntime ``InferenceSession``.
        data: anything [`onnx_qat.load_data`][onnx_qat.io.data.load_data] accepts, or a `Dataset`.
        batch_size: samples per onnxruntime run (a model with a fixed batch size uses its own).
        outputs: output names to fetch (default: all graph outputs).
        progress: show a tqdm progress bar on stderr.
        threads: intra-op threads when a session is created here.

    Outputs are concatenated on their first axis; for models without a sample axis
    (one sample per run) they are stacked on a new first axis.
    """
    session, dataset = _session_and_data(model_or_session, data, threads)
    parts: Dict[str, list] = {}
    for batch in run_batches(session, dataset, batch_size=batch_size, outputs=outputs, progress=progress):
        for name, value in batch.items():
            parts.setdefault(name, []).append(np.asarray(value))
    return {name: join_outputs(name, values, dataset) for name, values in parts.items()}


def join_outputs(name: str, values, dataset: Dataset) -> np.ndarray:
    """One output's per-run values joined: concatenated on the first axis (models without a sample
    axis: stacked); flattened when the runs' outputs differ after the first axis and the data is a
    stream of feeds or declares batch axes (the batch is then not the output's first axis either)."""
    from ..io.feeds import FeedStream

    loose = isinstance(dataset, FeedStream) or bool(getattr(dataset, "_axes", None))
    if loose and len({np.shape(v)[1:] for v in values}) > 1:
        return np.concatenate([np.ravel(v) for v in values])
    return _join(name, values, dataset.unbatched)


def _join(name: str, values, unbatched: bool) -> np.ndarray:
    if len(values) == 1 and not unbatched:
        return values[0]
    try:
        stack = unbatched or values[0].ndim == 0
        return np.stack(values) if stack else np.concatenate(values, axis=0)
    except ValueError:
        shapes = sorted({tuple(v.shape) for v in values})
        raise ModelError(f"output {name!r} has shapes {shapes[:3]} across batches that cannot be joined; "
                         f"use batch_size large enough for one batch") from None


__all__ = ["make_session", "run_model", "run_batches", "with_outputs", "session_input_specs"]
