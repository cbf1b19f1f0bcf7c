"""Model I/O edges: the only place ONNX protobufs are read and written.

* [`load_model`][onnx_qat.io.models.load_model] reads a model (path or ``ModelProto``, never mutated), loads
  external data from the model's own directory only, validates it, upgrades
  default-domain opsets below 13 and sets an IR version onnxruntime and TensorRT load.
* [`save_model`][onnx_qat.io.models.save_model] writes atomically, with one ``<file name>.data`` external-data
  file beside the model when the protobuf would exceed the 2 GB protobuf limit.
* `to_graph` / `from_graph` are the onnx-graphsurgeon edge: a caller's ``gs.Graph`` is
  accepted wherever a model is (exported, never changed), and a result is given back as one.
* `model_input_specs` describes the graph inputs a data file must feed.

Every problem a user can cause is a [`ModelError`][onnx_qat.errors.ModelError] (or
[`OutputError`][onnx_qat.errors.OutputError] for output paths) with one line.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import sys
from itertools import compress, repeat
from operator import is_, itemgetter, not_
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import Iterable, NamedTuple, Optional, Tuple, Union

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import ModelError, OutputError, brief
from .files import atomic_output, check_output_path, make_temp_beside, signals_held

logger = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
#: A model as the API accepts it: a path, an ``onnx.ModelProto`` or an ``onnx_graphsurgeon.Graph``.
ModelSource = Union[PathLike, onnx.ModelProto, "onnx_graphsurgeon.Graph"]  # noqa: F821

#: Default-domain opset every output needs (QuantizeLinear/DequantizeLinear with ``axis``).
MIN_OPSET = 13
#: Highest IR version written: onnxruntime 1.31 loads <= 13 and TensorRT 10 loads <= 10.
MAX_IR_VERSION = 10
#: Serialized size above which [`save_model`][onnx_qat.io.models.save_model] moves tensor data to an external
#: file.
EXTERNAL_DATA_THRESHOLD = 2_000_000_000
#: Tensors at least this large go to the external-data file (smaller ones stay inline).
EXTERNAL_TENSOR_MIN_BYTES = 1024
_ALIGN = 4096

# Element types that need a newer IR version than the opsets alone say.
_IR_FOR_DTYPE = {
    onnx.TensorProto.FLOAT8E4M3FN: 9, onnx.TensorProto.FLOAT8E4M3FNUZ: 9,
    onnx.TensorProto.FLOAT8E5M2: 9, onnx.TensorProto.FLOAT8E5M2FNUZ: 9,
    onnx.TensorProto.INT4: 10, onnx.TensorProto.UINT4: 10,
}


@dataclass(frozen=True)
class InputSpec:
    """One graph input a feed must provide.

    Attributes:
        name: the graph input name.
        dtype: its NumPy element type.
        shape: its dimensions; ``None`` for a symbolic or unknown dimension.
            ``None`` for the whole shape when the rank is unknown.
        dim_names: the symbolic names of the dimensions (``"batch"``, ``"height"``; None where a
            dimension is fixed or unnamed), for messages only; ``()`` when not known.
    """

    name: str
    dtype: np.dtype
    shape: Optional[Tuple[Optional[int], ...]]
    dim_names: Tuple[Optional[str], ...] = dataclass_field(default=(), compare=False)

    def dim_label(self, axis: int) -> str:
        """How messages name dimension ``axis``: its size, its symbolic name, or ``N``."""
        if self.shape is not None and self.shape[axis] is not None:
            return str(self.shape[axis])
        name = self.dim_names[axis] if axis < len(self.dim_names) else None
        return name if name and len(name) <= 24 else "N"

    def dynamic_names(self, start: int = 0) -> Tuple[str, ...]:
        """The labels of the dynamic dimensions from ``start`` on (``("height", "width")``)."""
        if self.shape is None:
            return ()
        return tuple(self.dim_label(axis) if self.dim_label(axis) != "N" else f"dimension {axis}"
                     for axis in range(start, len(self.shape)) if self.shape[axis] is None)

    def describe(self) -> str:
        """``name float32[batch,3,height,width]``-style text for messages (``N`` for an unnamed
        dynamic dimension)."""
        dims = "?" if self.shape is None else ",".join(self.dim_label(a) for a in range(len(self.shape)))
        return f"{self.name} {np.dtype(self.dtype).name}[{dims}]"


# --------------------------------------------------------------------------- loading
class CheckedForm(NamedTuple):
    """The header under which ``onnx.checker`` passed a whole model at load (`load_checked_model`): its
    IR version and its opset imports (``(domain, version)`` pairs, sorted). A model written later with the
    same header may be validated by what an edit changed (`onnx_qat.graph.delta`)."""

    ir_version: int
    opset_import: Tuple[Tuple[str, int], ...]

    #: Whether no tensor of the model (attribute tensors, sparse initializers and functions included) keeps
    #: its data in an external file: true of a model `load_checked_model` read with its external data, which
    #: reads that data in or refuses the model (`LoadedForm`); not part of the header (equality).
    external_free = False

    def admits(self, header: "CheckedForm") -> bool:
        """True when a graph ``onnx.checker`` passed under this header passes under ``header`` too: the
        same opset imports, and the same IR version or both at least 8 (``onnx.checker``'s graph, node,
        attribute and tensor checks take other branches only for IR versions 2, 3 and 8)."""
        return self.opset_import == header.opset_import and (
            self.ir_version == header.ir_version or min(self.ir_version, header.ir_version) >= 8)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> "CheckedForm":
        """The header of ``model`` as it is now."""
        opsets = tuple(sorted((o.domain, int(o.version)) for o in model.opset_import))
        return cls(int(model.ir_version), opsets)


class LoadedForm(CheckedForm):
    """The `CheckedForm` of a model `load_checked_model` read with its external data (``load_external_data``):
    its external data was read in or the model refused, so `external_free` holds (equal to the
    `CheckedForm` of the same header)."""

    __slots__ = ()
    external_free = True


def load_model(source: ModelSource, *, upgrade_opset: bool = True, min_opset: int = MIN_OPSET,
               load_external_data: bool = True, check: bool = True) -> onnx.ModelProto:
    """Read and validate an ONNX model; return a new ``ModelProto`` the caller owns.

    Args:
        source: a path to an ``.onnx`` file, a ``ModelProto`` (copied, never mutated), or an
            ``onnx_graphsurgeon.Graph`` (exported with `from_graph`, never mutated).
        upgrade_opset: convert a default-domain opset below ``min_opset`` with
            onnx's version converter (initializers listed as graph inputs are removed
            from the inputs first, as the converter needs).
        min_opset: the lowest default-domain opset accepted without upgrade.
        load_external_data: read external tensor data from the model's directory.
            Locations that are absolute, contain ``..`` or resolve outside that
            directory are refused. A ``ModelProto`` has no directory: one whose external
            data was not loaded (``onnx.load(path, load_external_data=False)``) is refused,
            unless this is False.
        check: run ``onnx.checker`` (``full_check=False``).

    Raises:
        ModelError: ``source`` is none of the three kinds, the path is missing, a directory, empty,
            not an ONNX protobuf,
            the model is invalid, refers to unsafe or missing external data (or, given as a
            ``ModelProto``, to external data not loaded), or cannot be upgraded.
    """
    return load_checked_model(source, upgrade_opset=upgrade_opset, min_opset=min_opset,
                              load_external_data=load_external_data, check=check)[0]


def load_checked_model(source: ModelSource, *, upgrade_opset: bool = True, min_opset: int = MIN_OPSET,
                       load_external_data: bool = True,
                       check: bool = True) -> Tuple[onnx.ModelProto, Optional[CheckedForm]]:
    """`load_model` (the same arguments and errors), and the `CheckedForm` under which ``onnx.checker``
    passed the whole model (None with ``check=False``): the file's or model's header, or the upgraded
    model's when the opset was upgraded (the converter's result is checked in full too), a `LoadedForm`
    with ``load_external_data``. The IR version `load_model` then sets may differ from it."""
    data = None
    if is_graph(source):
        model = from_graph(source)  # a new ModelProto: no copy needed
        if load_external_data:
            _refuse_unloaded_external(model)
        label, base_dir = "model", None
    elif isinstance(source, onnx.ModelProto):
        if load_external_data:
            _refuse_unloaded_external(source)
        model = onnx.ModelProto()
        model.CopyFrom(source)
        label, base_dir = "model", None
    elif not isinstance(source, (str, os.PathLike)):
        raise ModelError(f"a model must be a path, an onnx.ModelProto or an onnx_graphsurgeon.Graph, "
                         f"got {type(source).__name__}")
    else:
        data, label, base_dir = _read_model_bytes(source)
        model = _parse(data, label)
    if base_dir is not None and load_external_data and _load_external(model, base_dir, label):
        data = None  # the file's bytes lack the external tensors: check the model instead
    checked = None
    if check:
        if data is not None and load_external_data:
            _check_serialized(data, label)  # the bytes just parsed: no second serialization
        else:
            validate_model(model, label)
        checked = CheckedForm.of(model)
    del data
    if upgrade_opset:
        upgraded = _upgrade(model, min_opset, label)
        if upgraded is not model:
            checked = CheckedForm.of(upgraded)  # _upgrade checks the converter's result in full
            model = upgraded
    if checked is not None and load_external_data:  # every external tensor read in above, or refused
        checked = LoadedForm(*checked)
    model.ir_version = target_ir_version(model)
    return model, checked


def _read_model_bytes(source: PathLike) -> Tuple[bytes, str, Path]:
    """The bytes of the model file ``source``, its label for messages and its directory."""
    path = Path(source)
    label = f"model {path}"
    if str(source) == "":
        raise ModelError("model path is empty")
    if not path.exists():
        raise ModelError(f"{label} does not exist")
    if path.is_dir():
        raise ModelError(f"{label} is a directory; give the .onnx file")
    try:
        if path.stat().st_size >= 2 ** 31:
            raise ModelError(f"{label} is over 2 GB in one file, which protobuf cannot read; "
                             f"save the weights as external data")
        data = path.read_bytes()
    except OSError as exc:
        raise ModelError(f"{label} cannot be read: {exc.strerror or exc}") from None
    if not data:
        raise ModelError(f"{label} is empty (0 bytes); it is not an ONNX model")
    return data, label, path.resolve().parent


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    head = data[:64].lstrip()
    if head[:1] in (b"{", b"["):
        raise ModelError(f"{label} is JSON text, not an ONNX protobuf; give the .onnx model file")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except Exception:  # protobuf raises DecodeError/RuntimeError depending on backend
        raise ModelError(f"{label} is not an ONNX protobuf (unreadable or truncated bytes)") from None
    if not model.HasField("graph") or model.ir_version <= 0 or not model.opset_import:
        raise ModelError(f"{label} is not an ONNX model (no graph, IR version or opset); the file may be "
                         f"truncated or of another format")
    return model


def validate_model(model: onnx.ModelProto, label: str = "model") -> None:
    """Run ``onnx.checker`` (``full_check=False``) on ``model``; over 2 GB, or with external data not
    loaded, the graph is checked without its weights.

    Raises:
        ModelError: ``<label> is not a valid ONNX model: <the checker's first line>``.
    """
    facts = _initializer_facts(model)
    if not facts.external and model_byte_size(model, facts) < EXTERNAL_DATA_THRESHOLD:
        _check_serialized(_serialize(model), label)
    else:  # over 2 GB, or data not loaded: check the graph without its weights
        _check_serialized(_serialize(_without_initializer_data(model)), label)


def _check_serialized(payload: bytes, label: str) -> None:
    """``onnx.checker`` (``full_check=False``) on a serialized model (a file's bytes, or the bytes
    about to be written), so the checker does not serialize the model once more.

    Raises:
        ModelError: ``<label> is not a valid ONNX model: <the checker's first line>``.
    """
    try:
        onnx.checker.check_model(payload, full_check=False)
    except Exception as exc:  # onnx raises ValidationError, or C++ errors as other types
        raise ModelError(f"{label} is not a valid ONNX model: {brief(exc, 300, first_line=True)}") from None


def model_byte_size(model: onnx.ModelProto, facts: Optional["_InitializerFacts"] = None) -> int:
    """Serialized size in bytes; a value over 2**31 when the model is over 2 GB.

    Initializer sizes are estimated from their shapes first: asking protobuf to size
    a message over 2 GB would serialize (and fail) at the cost of gigabytes of memory.
    ``facts``: the model's `_initializer_facts` when the caller has them already.
    """
    estimate = (facts or _initializer_facts(model)).bytes
    if estimate >= 2 ** 31:
        return 2 ** 31 + estimate
    try:
        return int(model.ByteSize())
    except Exception:  # upb refuses to size messages over 2 GB
        return 2 ** 31 + estimate


def _itemsize(data_type: int) -> int:
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(data_type)).itemsize
    except Exception:
        return 1


#: Bytes per element of each ONNX element type (0 for strings and undefined: not counted).
_ITEMSIZES = {t: (0 if t in (0, onnx.TensorProto.STRING) else _itemsize(t))
              for t in onnx.TensorProto.DataType.values()}


def element_size(data_type: int) -> int:
    """Bytes per element of ONNX element type ``data_type`` in raw data; 0 for strings, undefined and
    unknown types (and 1 for the packed 4-bit and 2-bit types, whose raw data holds several per byte)."""
    return _ITEMSIZES.get(data_type, 0)


class _InitializerFacts(NamedTuple):
    """What the save path needs to know of the main graph's initializers (one pass over them)."""

    bytes: int              # data size estimated from shapes and element types
    data_types: frozenset   # element types present
    external: bool          # some initializer keeps its data in an external file


def _initializer_facts(model: onnx.ModelProto, nodes=None) -> _InitializerFacts:
    """Size estimate, element types and external-data use of the main graph's initializers, read
    in one pass: a model of 10^5 initializers costs ~1 us of Python per tensor and per walk, and
    saving needed three walks (size, IR version, external data). ``nodes``: the
    `onnx_qat.graph.delta.ResultNodes` of the edit that wrote ``model``: the new initializers made as
    bytes (none of them external) are then taken from its element types and dims, not read back: where each
    of their element types has a size here, as the sum of their raw lengths (the edit measured each against
    its dims and element size, `onnx_qat.graph.edit.GraphEdit.measure`), in C-level passes."""
    total, sizes, prod, types, external = 0, _ITEMSIZES, math.prod, set(), False
    if nodes is not None:
        stored, shapes, protos = nodes.stored, nodes.dims, model.graph.initializer
        names = nodes.initializers
        unread = compress(range(len(names)), map(not_, map(stored.__contains__, names)))
        read = [protos[i] for i in unread]
        facts = stored.values()
        types.update(map(itemgetter(0), facts))
        if types.issubset(sizes):  # every raw length is its dims' count times the size here
            total += sum(map(len, map(itemgetter(1), facts)))
        else:
            for name, (data_type, _) in stored.items():
                dims = shapes.get(name)
                total += (prod(dims) if dims else 1) * sizes.get(data_type, 1)
    else:
        read = model.graph.initializer
    for tensor in read:
        data_type, dims = tensor.data_type, tensor.dims
        types.add(data_type)
        total += (prod(dims) if dims else 1) * sizes.get(data_type, 1)
        if tensor.data_location:  # EXTERNAL (DEFAULT is 0)
            external = True
    return _InitializerFacts(total, frozenset(types), external)


def _without_initializer_data(model: onnx.ModelProto) -> onnx.ModelProto:
    light = copy_except_initializers(model)
    for init in model.graph.initializer:
        stub = _tensor_stub(init)
        stub.dims[:] = [0]  # an empty tensor of the same type: valid for the checker, no data copied
        light.graph.initializer.append(stub)
    return light


#: NumPy types (little-endian) of the element types `tensor_array` reads from raw bytes in place.
_RAW_DTYPES = {
    onnx.TensorProto.FLOAT: "<f4", onnx.TensorProto.UINT8: "u1", onnx.TensorProto.INT8: "i1",
    onnx.TensorProto.UINT16: "<u2", onnx.TensorProto.INT16: "<i2", onnx.TensorProto.INT32: "<i4",
    onnx.TensorProto.INT64: "<i8", onnx.TensorProto.FLOAT16: "<f2", onnx.TensorProto.DOUBLE: "<f8",
    onnx.TensorProto.UINT32: "<u4", onnx.TensorProto.UINT64: "<u8",
}


#: 8-bit integer types `tensor_array` reads from ``int32_data`` directly.
_SMALL_INTS = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """The value of a loaded TensorProto as a read-only NumPy array.

    Raw little-endian bytes of the common numeric types are read in place: one copy fewer than
    ``onnx.numpy_helper.to_array`` and without its per-call cost, which dominates on many small
    tensors (scales, zero points, the weights of a 10^5-node model); so are float32 values held in
    ``float_data`` and 8-bit integers held in ``int32_data`` (scales and zero points written that way).
    Other forms go through ``numpy_helper``.

    Raises:
        ModelError: the tensor's data is external and was not loaded (it is never looked for
            relative to the current directory).
    """
    dtype = _RAW_DTYPES.get(tensor.data_type)
    location = tensor.data_location
    if dtype is not None and location == onnx.TensorProto.DEFAULT:
        shape = tuple(tensor.dims)
        if tensor.HasField("raw_data"):
            return np.frombuffer(tensor.raw_data, dtype=dtype).reshape(shape)
        count = int(np.prod(shape))
        values = None
        if tensor.data_type == onnx.TensorProto.FLOAT and len(tensor.float_data) == count:
            values = np.array(tensor.float_data, dtype=np.float32)
        elif tensor.data_type in _SMALL_INTS and len(tensor.int32_data) == count:
            values = np.array(tensor.int32_data, dtype=np.int32).astype(dtype)
        if values is not None:
            values.flags.writeable = False
            return values.reshape(shape)
    if location == onnx.TensorProto.EXTERNAL:
        raise ModelError(f"tensor {tensor.name!r}: its data is stored in {_external_location(tensor)} "
                         "and was not loaded")
    return numpy_helper.to_array(tensor)


def _external_location(tensor: onnx.TensorProto) -> str:
    location = next((entry.value for entry in tensor.external_data if entry.key == "location"), "")
    return repr(location) if location else "an external file"


def _refuse_unloaded_external(model: onnx.ModelProto) -> None:
    """Raise ModelError when an in-memory model keeps tensor data in external files: a
    ``ModelProto`` has no directory to read them from."""
    external = onnx.TensorProto.EXTERNAL
    tensors = [t for t in _all_tensors(model) if t.data_location == external]
    if tensors:
        raise ModelError(f"model: the data of {len(tensors)} tensor(s) (first: {tensors[0].name!r}, in "
                         f"{_external_location(tensors[0])}) was not loaded; give the model's path, or load "
                         f"it with onnx.load(path), which reads external data")


# --------------------------------------------------------------------------- external data
def _load_external(model: onnx.ModelProto, base_dir: Path, label: str) -> int:
    """Read the external data of every tensor that has some; returns how many there were."""
    tensors = [t for t in _all_tensors(model) if t.data_location == onnx.TensorProto.EXTERNAL]
    if not tensors:
        return 0
    for tensor in tensors:
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        file = safe_external_path(base_dir, location, label, tensor.name)
        offset = int(info.get("offset", 0) or 0)
        length = info.get("length")
        try:
            with open(file, "rb") as handle:
                handle.seek(offset)
                raw = handle.read(int(length)) if length else handle.read()
        except (OSError, ValueError) as exc:
            raise ModelError(f"{label}: external data {location!r} of tensor {tensor.name!r} cannot be read: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
        if length and len(raw) != int(length):
            raise ModelError(f"{label}: external data {location!r} of tensor {tensor.name!r} is truncated")
        tensor.raw_data = raw
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return len(tensors)


def safe_external_path(base_dir: Path, location: str, label: str = "model", tensor: str = "?") -> Path:
    """Resolve an external-data ``location`` inside ``base_dir`` or raise ModelError.

    Refuses empty, absolute and ``..`` locations and any that resolve (through
    symbolic links) outside the model's directory.
    """
    if not location:
        raise ModelError(f"{label}: tensor {tensor!r} has external data without a location")
    parts = Path(location.replace("\\", "/")).parts
    if os.path.isabs(location) or location.startswith(("/", "\\")) or (parts and ":" in parts[0]):
        raise ModelError(f"{label}: external data location {location!r} of tensor {tensor!r} is an absolute "
                         f"path; only files in the model's directory are read")
    if ".." in parts:
        raise ModelError(f"{label}: external data location {location!r} of tensor {tensor!r} leaves the "
                         f"model's directory ('..'); refused")
    base = Path(base_dir).resolve()
    file = (base / Path(*parts)).resolve()
    if base != file and base not in file.parents:
        raise ModelError(f"{label}: external data location {location!r} of tensor {tensor!r} resolves "
                         f"outside the model's directory; refused")
    if not file.is_file():
        raise ModelError(f"{label}: external data file {location!r} of tensor {tensor!r} is missing")
    return file


#: Attribute types that can hold a TensorProto (directly, or inside a subgraph); UNDEFINED too,
#: so a malformed attribute is still searched.
_TENSOR_ATTRS = frozenset((onnx.AttributeProto.UNDEFINED,
                           onnx.AttributeProto.TENSOR, onnx.AttributeProto.TENSORS,
                           onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS,
                           onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS))


def _has_external_outside_initializers(model: onnx.ModelProto, nodes=None) -> bool:
    """Whether a tensor other than a main-graph initializer (a sparse initializer, a Constant's
    value, a subgraph's or a function's tensor) keeps its data in an external file (the main
    graph's initializers are tested in `_initializer_facts`' pass). ``nodes``: as for
    `_initializer_facts`: the edit's new nodes (QuantizeLinear/DequantizeLinear with integer attributes
    at most) are passed over."""
    external = onnx.TensorProto.EXTERNAL
    return any(t.data_location == external for t in _all_tensors(model, main_initializers=False, nodes=nodes))


def _attribute_tensors(attr):
    """Every TensorProto an attribute holds, subgraphs included."""
    if attr.HasField("t"):
        yield attr.t
    yield from attr.tensors
    if attr.HasField("g"):
        yield from _all_graph_tensors(attr.g)
    for sub in attr.graphs:
        yield from _all_graph_tensors(sub)


def _all_graph_tensors(graph, initializers: bool = True, nodes=None):
    """Every TensorProto of ``graph``: initializers (unless ``initializers`` is False), sparse
    initializers, attribute tensors. Nodes whose attributes cannot hold tensors (most of them:
    Q/DQ ``axis``, Conv ``pads``...) are passed over, and so are an edit's new nodes when its
    `onnx_qat.graph.delta.ResultNodes` are given as ``nodes`` (none of them holds a tensor)."""
    if initializers:
        yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    protos = graph.node
    if nodes is not None:
        protos = [protos[i] for i in compress(range(len(nodes.forms)), map(is_, nodes.forms, repeat(None)))]
    for node in protos:
        if node.attribute:  # most nodes have none, and most attributes hold no tensor
            for attr in node.attribute:
                if attr.type in _TENSOR_ATTRS:
                    yield from _attribute_tensors(attr)


def _all_tensors(model: onnx.ModelProto, main_initializers: bool = True, nodes=None):
    """Every TensorProto of the model: initializers and attribute tensors, subgraphs included
    (the main graph's initializers left out when ``main_initializers`` is False; ``nodes``: see
    `_all_graph_tensors`)."""
    yield from _all_graph_tensors(model.graph, main_initializers, nodes)
    for func in model.functions:
        for node in func.node:
            for attr in node.attribute:
                if attr.type in _TENSOR_ATTRS:
                    yield from _attribute_tensors(attr)


# --------------------------------------------------------------------------- opset and IR version
def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain (``ai.onnx``) opset version (0 when not imported)."""
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            return int(opset.version)
    return 0


def _upgrade(model: onnx.ModelProto, min_opset: int, label: str) -> onnx.ModelProto:
    current = default_opset(model)
    if current >= min_opset or current == 0:
        return model
    if model_byte_size(model) >= EXTERNAL_DATA_THRESHOLD:
        raise ModelError(f"{label}: opset {current} is below {min_opset} and the model is over 2 GB, "
                         f"too large for onnx's version converter; export it with opset >= {min_opset}")
    removed = _drop_initializer_inputs(model)
    if removed:
        logger.info("%s: %d initializer(s) listed as graph inputs were removed from the inputs before the "
                    "opset upgrade", label, removed)
    if model.ir_version < 4:
        model.ir_version = 4  # initializers outside the inputs need IR >= 4
    try:
        import onnx.version_converter

        upgraded = onnx.version_converter.convert_version(model, min_opset)
        onnx.checker.check_model(upgraded, full_check=False)
    except Exception as exc:
        raise ModelError(f"{label}: opset {current} could not be upgraded to {min_opset} with onnx's version "
                         f"converter: {brief(exc, 300, first_line=True)}") from None
    logger.info("%s: opset upgraded from %d to %d", label, current, min_opset)
    return upgraded


def _drop_initializer_inputs(model: onnx.ModelProto) -> int:
    init_names = {t.name for t in model.graph.initializer}
    keep = [inp for inp in model.graph.input if inp.name not in init_names]
    removed = len(model.graph.input) - len(keep)
    if removed:
        del model.graph.input[:]
        model.graph.input.extend(keep)
    return removed


def target_ir_version(model: onnx.ModelProto, data_types: Optional[Iterable[int]] = None) -> int:
    """The IR version to write.

    The lowest version the opsets, model-local functions and element types need is
    the floor. A model at or below `MAX_IR_VERSION` keeps its own version (when
    high enough); a higher one (onnx >= 1.23 writes 14, onnxruntime 1.31 loads <= 13,
    TensorRT 10 <= 10) is lowered to that floor. ``data_types``: the element types of the main
    graph's initializers when the caller knows them already (else they are read).
    """
    need = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    if model.functions:
        need = max(need, 8)
    if data_types is None:  # the types alone: a third of the cost of `_initializer_facts`
        data_types = {tensor.data_type for tensor in model.graph.initializer}
    for data_type in data_types:
        need = max(need, _IR_FOR_DTYPE.get(data_type, 0))
    current = model.ir_version
    if not current or current > MAX_IR_VERSION:
        return need
    return max(need, current)


# --------------------------------------------------------------------------- saving
def write_outputs(model: onnx.ModelProto, output: Optional[PathLike], report: Optional[PathLike],
                  report_of, *, inputs: Iterable = (), evidence=None) -> None:
    """The end of every quantize path: ``model`` saved to ``output`` (validated on the very bytes
    written, or by ``evidence`` of what an edit changed, see `save_model`) and ``report_of()`` (a
    JSON-ready dict) written to ``report``, each only when given. Both paths were checked before any work
    (`onnx_qat.io.files.check_output_and_report`)."""
    if output is not None:
        save_model(model, output, inputs=inputs, ir_version=model.ir_version, validate=True,
                   evidence=evidence)
        logger.info("wrote %s", output)
    if report is not None:
        from .files import write_json

        write_json(report, report_of())


def save_model(model: onnx.ModelProto, path: PathLike, *, inputs: Iterable = (),
               ir_version: Optional[int] = None,
               external_data_threshold: int = EXTERNAL_DATA_THRESHOLD, validate: bool = False,
               evidence=None) -> Path:
    """Write ``model`` to ``path`` atomically and return the path.

    Args:
        model: the model (not modified).
        path: the ``.onnx`` file to write.
        inputs: paths that must not be overwritten (the input model, data files...).
        ir_version: IR version to write; default `target_ir_version`.
        external_data_threshold: when the serialized model would be larger than this
            many bytes, tensor data goes to one ``<file name>.data`` file beside the
            model (also written atomically). Default: just under protobuf's 2 GB limit.
        validate: run ``onnx.checker`` (``full_check=False``) first and write nothing when it
            fails. A model saved in one file is checked on the very bytes written (serialized
            once); a larger one as `validate_model` does.
        evidence: with ``validate``, an `onnx_qat.graph.delta.EditEvidence` of the edit that made
            ``model`` from a model ``onnx.checker`` passed in full: when the header to write (IR
            version, opset imports) is the one checked then, ``model`` is validated by what the edit
            changed instead (``evidence.verify``: a structural pass over the whole graph and
            ``onnx.checker`` on one node and tensor of each new form; docs/architecture.md, "Validation
            of the result"), unless the environment variable ``ONNX_QAT_FULL_CHECK`` is ``1`` (then
            ``onnx.checker`` in full) or ``both`` (both, see `FULL_CHECK_ENV`). When it describes
            ``model`` (`EditEvidence.nodes_of`), the new initializers' types and sizes and the new nodes
            (no tensor attributes) are taken from it rather than read back, with or without ``validate``;
            and when the edited model was loaded with its external data (`LoadedForm`), the tensors
            outside the initializers (the original nodes' attributes) are not walked for external data.

    Raises:
        OutputError: the path is a directory, in a missing or read-only directory, or
            is one of ``inputs``.
        ModelError: the model cannot be serialized, or (``validate``) is not a valid ONNX model:
            ``output model <path> is not a valid ONNX model: <the checker's first line>``.
    """
    inputs = tuple(inputs)
    out = check_output_path(path, inputs=inputs, what="output model")
    nodes = evidence.nodes_of(model) if evidence is not None else None  # the edit's values, not read back
    facts = _initializer_facts(model, nodes)
    # An edit's result of a model loaded with its external data: its other tensors are the loaded model's
    # (the edit adds none outside the initializers), so they are not walked again.
    loaded = nodes is not None and getattr(evidence.checked, "external_free", False)
    if facts.external or not loaded and _has_external_outside_initializers(model, nodes):
        raise ModelError("model still refers to external data that was not loaded; load it with "
                         "load_external_data=True before saving")
    ir = int(ir_version) if ir_version is not None else target_ir_version(model, facts.data_types)
    try:
        return _save(model, out, ir, inputs, external_data_threshold, facts, validate, evidence)
    except OSError as exc:
        raise OutputError(f"output model {out} cannot be written: {exc.strerror or exc}") from None


def _save(model: onnx.ModelProto, out: Path, ir: int, inputs: tuple, external_data_threshold: int,
          facts: _InitializerFacts, validate: bool, evidence=None) -> Path:
    label = f"output model {out}"
    payload = _one_file_payload(model, ir, facts, external_data_threshold)
    if payload is not None:
        if validate:
            _validate_payload(model, ir, payload, label, evidence)
        _write_atomic(out, payload)
        return out
    if validate:
        validate_model(model, label)
    data_path = out.with_name(out.name + ".data")
    check_output_path(data_path, inputs=inputs, what="external data")
    _save_with_external_data(model, out, data_path, ir)
    logger.info("saved %s with external data %s", out, data_path.name)
    return out


#: The environment variable that chooses how a model written with an edit's evidence is validated:
#: ``1``: by ``onnx.checker`` in full, never by the evidence; ``both``: by the evidence and then by
#: ``onnx.checker`` in full, a model the evidence passes and the checker refuses raising RuntimeError
#: (the test suite's setting, tests/conftest.py); unset or anything else: by the evidence where it applies.
FULL_CHECK_ENV = "ONNX_QAT_FULL_CHECK"


def full_check_mode() -> str:
    """The value of `FULL_CHECK_ENV` (``"1"``, ``"both"``; anything else: the evidence where it applies)."""
    return os.environ.get(FULL_CHECK_ENV, "")


def _validate_payload(model: onnx.ModelProto, ir: int, payload: bytes, label: str, evidence) -> None:
    """`save_model`'s validation of a one-file ``payload`` (``model`` with IR version ``ir``): by
    ``evidence`` when it covers this header (see `save_model`), else ``onnx.checker`` on the bytes."""
    mode = full_check_mode()
    verified = False
    if evidence is not None and mode != "1":
        header = CheckedForm(int(ir), CheckedForm.of(model).opset_import)
        if evidence.checked.admits(header):
            evidence.verify(model, label)
            logger.debug("%s validated by the edit's evidence (%s)", label, evidence)
            if mode != "both":
                return
            verified = True
    try:
        _check_serialized(payload, label)
    except ModelError as exc:
        if verified:
            raise RuntimeError(f"the edit's evidence passed a model onnx.checker refuses: {exc}") from None
        raise


def _one_file_payload(model: onnx.ModelProto, ir: int, facts: _InitializerFacts,
                      threshold: int) -> Optional[bytes]:
    """The bytes of ``model`` with IR version ``ir`` when they are at most ``threshold`` bytes, else None
    (the model then goes to a file with external data). Serialized once: asking protobuf for the size
    first (`model_byte_size`) would serialize the whole model one more time. Over 2 GB by the
    initializers' estimate, nothing is serialized (see `model_byte_size`)."""
    if facts.bytes >= 2 ** 31:
        return None
    if model.ir_version != ir:
        model = _with_ir_version(model, ir)
    try:
        payload = model.SerializeToString()
    except Exception:  # upb refuses messages over 2 GB
        return None
    return payload if len(payload) <= threshold else None


def _with_ir_version(model: onnx.ModelProto, ir: int) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    copy.ir_version = ir
    return copy


def _serialize(model: onnx.ModelProto) -> bytes:
    try:
        return model.SerializeToString()
    except Exception as exc:
        raise ModelError(f"model cannot be serialized: {str(exc).strip() or type(exc).__name__}") from None


def copy_except_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose main graph has no initializers (no tensor data copied)."""
    copy = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name == "graph":
            continue
        if field.is_repeated:
            getattr(copy, field.name).extend(value)
        elif field.message_type is not None:
            getattr(copy, field.name).CopyFrom(value)
        else:
            setattr(copy, field.name, value)
    for field, value in model.graph.ListFields():
        if field.name == "initializer":
            continue
        if field.is_repeated:
            getattr(copy.graph, field.name).extend(value)
        else:
            setattr(copy.graph, field.name, value)
    copy.graph.SetInParent()
    return copy


def _tensor_stub(tensor: onnx.TensorProto) -> onnx.TensorProto:
    stub = onnx.TensorProto()
    stub.name = tensor.name
    stub.dims.extend(tensor.dims)
    stub.data_type = tensor.data_type
    if tensor.doc_string:
        stub.doc_string = tensor.doc_string
    return stub


def _split_external(model: onnx.ModelProto, location: str, handle) -> onnx.ModelProto:
    """Write large tensors' bytes to ``handle``; return a light copy referring to ``location``."""
    light = copy_except_initializers(model)
    offset = 0
    for tensor in model.graph.initializer:
        raw = _tensor_bytes(tensor)
        if raw is None or len(raw) < EXTERNAL_TENSOR_MIN_BYTES:
            light.graph.initializer.append(tensor)
            continue
        pad = (-offset) % _ALIGN
        handle.write(b"\0" * pad)
        offset += pad
        stub = _tensor_stub(tensor)
        stub.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", str(offset)), ("length", str(len(raw)))):
            entry = stub.external_data.add()
            entry.key, entry.value = key, value
        light.graph.initializer.append(stub)
        handle.write(raw)
        offset += len(raw)
    return light


def _tensor_bytes(tensor: onnx.TensorProto) -> Optional[bytes]:
    """The tensor's little-endian bytes (raw or typed fields), or None for string tensors."""
    if tensor.data_type == onnx.TensorProto.STRING:
        return None
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


def _write_atomic(path: Path, payload: bytes) -> None:
    with atomic_output(path, "wb") as handle:
        handle.write(payload)


def _save_with_external_data(model: onnx.ModelProto, out: Path, data_path: Path, ir: int) -> None:
    """Stream tensor data to a temporary data file, write the model to a temporary file,
    then rename both (data first) with SIGINT/SIGTERM held, so both change together."""
    tmp_files = []
    try:
        data_tmp = _mkstemp_beside(data_path, tmp_files)
        with open(data_tmp, "wb") as handle:
            light = _split_external(model, data_path.name, handle)
            handle.flush()
            os.fsync(handle.fileno())
        light.ir_version = ir
        payload = _serialize(light)
        model_tmp = _mkstemp_beside(out, tmp_files)
        with open(model_tmp, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        for tmp in tmp_files:
            os.chmod(tmp, 0o644)
        with signals_held():
            os.replace(data_tmp, data_path)
            os.replace(model_tmp, out)
        tmp_files.clear()
    finally:
        for tmp in tmp_files:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _mkstemp_beside(target: Path, registry: list) -> str:
    with signals_held():
        fd, tmp = make_temp_beside(target)
        registry.append(tmp)
    os.close(fd)
    return tmp


# --------------------------------------------------------------------------- graphsurgeon edge
def is_graph(obj) -> bool:
    """True when ``obj`` is an ``onnx_graphsurgeon.Graph``.

    Never imports onnx-graphsurgeon: a caller holding a Graph has imported it already, so a
    module not yet imported means ``obj`` cannot be one (``import onnx_qat`` stays light).
    """
    gs = sys.modules.get("onnx_graphsurgeon")
    return gs is not None and isinstance(obj, gs.Graph)


def to_graph(model: ModelSource):
    """The model as a new ``onnx_graphsurgeon.Graph``, ready for further graph surgery.

    ``model``: a ``ModelProto`` (imported as it is, not changed) or anything
    [`load_model`][onnx_qat.io.models.load_model] reads. Raises ModelError when onnx-graphsurgeon cannot
    import it.
    """
    import onnx_graphsurgeon as gs

    proto = model if isinstance(model, onnx.ModelProto) else load_model(model)
    try:
        return gs.import_onnx(proto)
    except Exception as exc:
        raise ModelError(
            f"model cannot be imported into onnx-graphsurgeon: {brief(exc, first_line=True)}") from None


def from_graph(graph) -> onnx.ModelProto:
    """A new ``ModelProto`` of an ``onnx_graphsurgeon.Graph`` (``gs.export_onnx``; the Graph is read,
    never changed). Tensors without a known type are allowed here:
    [`load_model`][onnx_qat.io.models.load_model] then runs ``onnx.checker`` on the result. Raises ModelError
    when graphsurgeon cannot export it."""
    import onnx_graphsurgeon as gs

    try:
        return gs.export_onnx(graph, do_type_check=False)
    except Exception as exc:
        raise ModelError(f"onnx_graphsurgeon.Graph cannot be exported to ONNX: "
                         f"{brief(exc, first_line=True)}") from None


@contextlib.contextmanager
def cyclic_gc_paused():
    """Pause Python's cyclic garbage collector for the block (its previous state restored after).

    Indexing, placing and rewriting a large model allocates millions of objects that all stay
    alive until the work is done; each burst of allocations makes the collector rescan every
    live object, which on a 50k-node model cost more than the rewrite itself. Nothing allocated
    there becomes cyclic garbage, so pausing the collector holds back no memory.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# --------------------------------------------------------------------------- inputs
def model_input_specs(model: ModelSource) -> Tuple[InputSpec, ...]:
    """The graph inputs a feed must provide (initializers listed as inputs excluded), in graph order."""
    proto = model if isinstance(model, onnx.ModelProto) else load_model(model)
    inits = {t.name for t in proto.graph.initializer}
    specs = []
    for inp in proto.graph.input:
        if inp.name in inits:
            continue
        specs.append(_input_spec(inp))
    return tuple(specs)


def _input_spec(value_info: onnx.ValueInfoProto) -> InputSpec:
    ttype = value_info.type.tensor_type
    if not value_info.type.HasField("tensor_type"):
        raise ModelError(f"graph input {value_info.name!r} is not a tensor (sequence and map inputs are "
                         f"not supported)")
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(ttype.elem_type))
    except Exception:
        raise ModelError(f"graph input {value_info.name!r} has an unsupported element type "
                         f"{ttype.elem_type}") from None
    if not ttype.HasField("shape"):
        return InputSpec(value_info.name, dtype, None)
    dims = tuple(int(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else None
                 for d in ttype.shape.dim)
    names = tuple(d.dim_param or None if size is None else None for d, size in zip(ttype.shape.dim, dims))
    return InputSpec(value_info.name, dtype, dims, names)


__all__ = [
    "InputSpec", "load_model", "save_model", "is_graph", "to_graph", "from_graph",
    "cyclic_gc_paused", "validate_model", "tensor_array",
    "model_input_specs",
    "target_ir_version", "default_opset", "safe_external_path", "MIN_OPSET", "MAX_IR_VERSION",
    "EXTERNAL_DATA_THRESHOLD",
]
