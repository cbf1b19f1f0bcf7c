"""The one inserter: placement marks + a ScaleTable -> QuantizeLinear/DequantizeLinear nodes.

Works on a `GraphEdit` of the model's protobuf. Every node it
creates has a readable name derived from the tensor it quantizes:

* activation ``t``: ``t_QuantizeLinear`` -> ``t_DequantizeLinear`` with initializers
  ``t_scale`` (float32 scalar) and ``t_zero_point`` (the target's type, scalar);
* weight ``w``: int8 initializer ``w_quantized`` -> ``w_DequantizeLinear`` with
  ``w_scale`` / ``w_zero_point`` (1-D per channel with the ``axis`` attribute, or scalars).

The numeric format (`onnx_qat.formats.numeric`) decides the stored types and the scale rule:
``int8`` (above), ``fp8`` (E4M3FN activations and per-channel weights, zero points of type
float8e4m3fn and value 0, scale ``amax / 448``) or ``int4`` (weights only: an INT4 initializer
and a DequantizeLinear with ``axis`` and ``block_size``, one scale per block, ``amax / 7``).

Only QuantizeLinear and DequantizeLinear are ever emitted (opset >= 13): never QLinear*,
ConvInteger, MatMulInteger or an int32 bias DequantizeLinear. Biases stay float.
New nodes are placed just before their first consumer, so the node order stays
topological and deterministic; graph inputs and outputs are not changed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from itertools import compress, repeat
from operator import attrgetter, setitem
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import onnx

from ..errors import ScalesError
from ..formats import encoding
from ..formats.encoding import (INT8_QRANGE, TINY, encode_int8, encode_weight, int8_dequantized,
                                quantize_weight, to_grid, usable_scales)
from ..formats.scale_grid import FP16_EPS, FP16_TINY, fp16_scale_candidates, fp16_weight_scales
from ..formats.numeric import INT8, Format, get_format
from ..graph.edit import GraphEdit, onnx_type
from ..graph.wire import (NODE_ATTRIBUTE, TENSOR_DATA_TYPE, TENSOR_DIMS, EncodedNode, EncodedTensor,
                          encode_node, field, int_attribute, node_template, varint)
from ..placement.marks import ActivationMark, Placement, WeightMark
from ..scales import ScaleTable
from .targets import Target, get_target

logger = logging.getLogger(__name__)

_FLOAT32 = np.dtype(np.float32)
_ONNX_FLOAT = onnx.TensorProto.FLOAT
_ONNX_INT8 = onnx.TensorProto.INT8
#: What a weight's names add to its base: the stored weight, scale, zero point, the DequantizeLinear node and
#: its output (the order in which their fresh names are taken).
_WEIGHT_SUFFIXES = ("_quantized", "_scale", "_zero_point", "_DequantizeLinear", "_DequantizeLinear_Output")
#: What an activation pair's names add to the tensor's name: scale, zero point, the QuantizeLinear and
#: DequantizeLinear outputs, the two nodes (the order in which their fresh names are taken).
_PAIR_SUFFIXES = ("_scale", "_zero_point", "_QuantizeLinear_Output", "_DequantizeLinear_Output",
                  "_QuantizeLinear", "_DequantizeLinear")
#: Weight range of ``narrow_weights`` (see `insert_qdq_pairs`): 2 x 255 x 63 = 32130 < 2**15.
NARROW_WEIGHT_RANGE = (-63, 63)
#: The forms (`onnx_qat.graph.edit.GraphEdit.insert`) of an activation pair's two nodes: op type,
#: domain, input and output counts, no attributes.
_PAIR_FORMS = (("QuantizeLinear", "", 3, 1), ("DequantizeLinear", "", 3, 1))
#: The wire bytes of an activation pair's QuantizeLinear and DequantizeLinear (`onnx_qat.graph.wire.node`
#: of three inputs and one output), for names of ASCII characters shorter than 128.
_Q_TEMPLATE = node_template(3, 1, "QuantizeLinear")
_DQ_TEMPLATE = node_template(3, 1, "DequantizeLinear")
_new_tuple = tuple.__new__
#: The keys of an activation pair's record, in order (`_Inserter.activation`).
_ACTIVATION_KEYS = ("kind", "tensor", "quantize_node", "dequantize_node", "amax", "scale", "scale_group",
                    "consumers", "rule", "reason")
#: The keys of a weight's record, in order (`_Inserter.weight`, INT8 from the weight's own values).
_WEIGHT_KEYS = ("kind", "tensor", "nodes", "dequantize_node", "initializer", "axis", "channels",
                "zero_channels", "amax_source", "rule", "reason")
_INPUT = attrgetter("input")

@dataclass(frozen=True)
class InsertionResult:
    """What was inserted: one JSON-ready record per Q/DQ pair or weight DequantizeLinear."""

    activations: Tuple[dict, ...]
    weights: Tuple[dict, ...]

    @property
    def num_quantize(self) -> int:
        return len(self.activations)

    @property
    def num_dequantize(self) -> int:
        return len(self.activations) + len(self.weights)


# --------------------------------------------------------------------------- numerics
def activation_scale(amax: float, qmax: float = 127.0) -> np.float32:
    """Rule 2: symmetric per-tensor scale ``amax / 127`` as float32 (finite, > 0); ``amax / qmax``
    for another format (FP8: 448)."""
    with np.errstate(over="ignore"):  # an amax beyond float32 is reported below, not warned about
        scale = np.float32(float(amax) / qmax)
    if not np.isfinite(scale) or scale < TINY:
        raise ScalesError(f"activation amax {amax} gives an unusable scale {scale}")
    return scale


def activation_scales(amaxes: Sequence[float], qmax: float = 127.0) -> np.ndarray:
    """`activation_scale` of every amax in one NumPy pass (the same float32 values); the
    first unusable one raises its ScalesError."""
    with np.errstate(over="ignore"):
        scales = (np.asarray(amaxes, dtype=np.float64) / qmax).astype(np.float32)
    bad = ~(np.isfinite(scales) & (scales >= TINY))
    if bad.any():
        first = int(np.argmax(bad))
        activation_scale(amaxes[first], qmax)  # raises with the one-value message
    return scales


#: Weights of at most this many values are quantized in batches of the same shape and axis
#: (`quantize_small_weights`); a batch holds at most `_BATCH_VALUES` values (2^18: its float32 values and
#: temporaries stay in the processor's caches; 30% faster than batches of 2^22 values on the 50,000-node
#: residual net's 25,000 weights).
SMALL_WEIGHT = 4096
_BATCH_VALUES = 1 << 18


def quantize_small_weights(edit: GraphEdit, keys, scales: ScaleTable, qrange: Tuple[int, int] = INT8_QRANGE,
                           fp16_grid: bool = False, constants: bool = False):
    """``(tensor, axis) -> (q, scale, amax)`` for the small float32 weights among ``keys`` whose range
    comes from their values (no ScaleTable entry), quantized with one NumPy call per batch of equal
    shapes: the same numbers as `quantize_weight` one by one (with its ``fp16_grid``), without its
    per-call cost, which dominates for the 10^4-10^5 tiny weights of a large graph. Other weights are
    left out. ``constants``: each value then ends with the weight's `GraphEdit.constant` ``(values,
    TensorProto, the nodes making it)`` as a fourth item (what a caller replacing the weight releases,
    without reading the weight again)."""
    ready = _quantize_small(edit, keys, scales, qrange, fp16_grid)
    if constants:
        return {key: _arrays(found) + (found[2],) for key, found in ready.items()}
    return {key: _arrays(found) for key, found in ready.items()}


class _Batch(NamedTuple):
    """Small weights of one shape quantized together (`_quantize_batch`), row ``i`` for weight ``i``."""

    q: np.ndarray  #: int8, ``[count, *shape]``
    scale: np.ndarray  #: float32, ``[count, channels]``
    amax: np.ndarray  #: float32, ``[count, channels]``
    usable: list  #: per weight, whether every channel's scale is usable
    q_raw: bytes  #: ``q``'s bytes (C order): a weight's stored bytes are a slice
    scale_raw: bytes  #: the scales' little-endian float32 bytes, likewise
    zeros: list  #: per weight, how many channels have amax 0 (as `_zero_count`)


def _arrays(entry) -> tuple:
    """``(q, scale, amax)`` of a `_quantize_small` entry."""
    batch, row, _ = entry
    return row if batch is None else (batch.q[row], batch.scale[row], batch.amax[row])


def _quantize_small(edit: GraphEdit, keys, scales: ScaleTable, qrange: Tuple[int, int],
                    fp16_grid: bool = False):
    """`quantize_small_weights` as ``(batch, row, constant)``: the weight's `_Batch` and its row there (or
    ``None`` and its ``(q, scale, amax)``, for a weight redone one by one) and its `GraphEdit.constant` (so
    the inserter does not read the weight again). `_Inserter._weight_run` writes a batch's weights from
    its buffers without a NumPy call each."""
    buckets: Dict[tuple, list] = {}
    given, constant_of = scales.weights, edit.constant
    float32 = _FLOAT32
    for key in keys:
        tensor, axis = key
        if tensor in given:
            continue
        try:
            constant = constant_of(tensor)
        except ValueError:
            continue  # weight() reports it
        values = constant[0]
        if values.dtype != float32 or not 0 < values.size <= SMALL_WEIGHT or values.ndim == 0 \
                or (axis is not None and not 0 <= axis < values.ndim):
            continue
        found = buckets.get((values.shape, axis))
        if found is None:
            buckets[(values.shape, axis)] = [(key, constant)]
        else:
            found.append((key, constant))
    ready = {}
    for (shape, axis), items in buckets.items():
        step = max(1, _BATCH_VALUES // int(np.prod(shape)))
        for start in range(0, len(items), step) if len(items) > 1 else ():
            chunk = items[start:start + step]
            batch = _quantize_batch(np.stack([c[0] for _, c in chunk]), axis, qrange, fp16_grid)
            ready.update(zip([key for key, _ in chunk], zip(repeat(batch), range(len(chunk)),
                                                            [constant for _, constant in chunk])))
            for row, usable in enumerate(batch.usable):
                if not usable:  # zero-range channels: one by one
                    (tensor, _), constant = chunk[row]
                    amax = batch.amax[row]
                    q, scale = quantize_weight(constant[0], axis, amax, qrange, name=tensor,
                                               fp16_grid=fp16_grid)
                    ready[(tensor, axis)] = (None, (q, scale, amax), constant)
    return ready


def _quantize_batch(stack: np.ndarray, axis: Optional[int], qrange, fp16_grid: bool = False) -> _Batch:
    """`quantize_weight` of each ``stack[i]`` (no ScaleTable range), as a `_Batch`; a weight is ``usable``
    unless a channel's scale is not (zero range: `quantize_weight` handles it)."""
    count = stack.shape[0]
    if axis is None:
        rows = stack.reshape(count, 1, -1)
        shape = (count,) + (1,) * (stack.ndim - 1)
    else:
        rows = np.moveaxis(stack, axis + 1, 1).reshape(count, stack.shape[axis + 1], -1)
        shape = [count] + [1] * (stack.ndim - 1)
        shape[axis + 1] = -1
    # max |w| per weight and channel: [count, channels]; the values of a channel laid along the first axis
    # first, so that the reductions run over whole rows (several times faster than over a short last axis)
    across = np.ascontiguousarray(np.moveaxis(rows, 2, 0))
    amax = np.maximum(np.maximum.reduce(across, axis=0),
                      -np.minimum.reduce(across, axis=0)).astype(np.float32)
    del across
    scale = (amax.astype(np.float64) / float(qrange[1])).astype(np.float32)
    usable = usable_scales(scale).all(axis=1).tolist()
    q = None
    if fp16_grid:  # each weight judged on its own (zero-range ones are redone one by one anyway)
        found = _fp16_grid_batch(stack, np.where(scale > 0, scale, np.float32(1.0)), shape, qrange)
        if found is not None:
            scale, q = found
        else:
            scale = fp16_weight_scales(stack, np.where(scale > 0, scale, np.float32(1.0)), shape,
                                       int8_dequantized(qrange), batched=True)
    if q is None:
        q = to_grid(stack, np.where(scale > 0, scale, 1).reshape(shape), qrange)
    scale = np.ascontiguousarray(scale, np.float32)
    zeros = (amax.shape[1] - np.count_nonzero(amax, axis=1)).tolist()  # as _zero_count, per weight
    return _Batch(q, scale, amax, usable, q.tobytes(), _le_bytes(scale), zeros)


def _fp16_grid_batch(stack: np.ndarray, scale: np.ndarray, shape, qrange) -> Optional[tuple]:
    """``(scales, q)``: `fp16_weight_scales` of a batch of INT8 weights (``batched``, ``scale`` > 0) and the
    weights on the grid of those scales (`to_grid`), the same numbers, with the codes of the candidate
    chosen for each channel kept from the comparison of the two FP16 neighbours instead of computed once
    more; None where that shortcut does not hold (a weight whose scales FP16 cannot hold, a candidate
    not finite, no scale to move), for the caller to take the long way."""
    with np.errstate(over="ignore"):  # a scale beyond FP16: not finite, so the long way
        nearest = np.maximum(scale.astype(np.float16).astype(np.float32), np.float32(FP16_TINY))
    with np.errstate(invalid="ignore"):
        fits = np.all(np.isfinite(nearest), axis=1) & (
            np.max(np.abs(nearest - scale), axis=1) <= FP16_EPS * np.max(scale, axis=1))
    if not fits.all():
        return None
    down, up = fp16_scale_candidates(scale)
    moved = down != up
    if not np.any(moved) or not (np.all(np.isfinite(down)) and np.all(np.isfinite(up))):
        return None
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and stack.shape[i] != 1)
    errors, codes = [], []
    for candidate in (down, up):
        broadcast = candidate.reshape(shape)
        grid = np.divide(stack, broadcast)  # to_grid's steps, its int8 codes kept
        np.rint(grid, out=grid)
        np.clip(grid, qrange[0], qrange[1], out=grid)
        codes.append(grid.astype(np.int8))
        np.multiply(grid, broadcast, out=grid)  # the codes (integers, exact in float32) times the scale
        np.subtract(grid, stack, out=grid)
        errors.append(np.sum(np.square(grid, dtype=np.float64), axis=axes).reshape(scale.shape))
    lower = moved & (errors[0] < errors[1])
    chosen = np.where(lower, down, up).astype(np.float32)
    return chosen, np.where(lower.reshape(shape), codes[0], codes[1])


# --------------------------------------------------------------------------- scales
def group_amax(placement: Placement, scales: ScaleTable) -> Dict[str, float]:
    """Activation tensor -> amax to use: its own, or its scale group's largest (rule 7)."""
    groups: Dict[str, float] = {}
    given = scales.activations
    for mark in placement.activations:
        if mark.scale_group:
            amax = given.get(mark.tensor)
            if amax is not None:
                groups[mark.scale_group] = max(groups.get(mark.scale_group, 0.0), amax)
    result = {}
    for mark in placement.activations:
        amax = groups.get(mark.scale_group) if mark.scale_group else given.get(mark.tensor)
        if amax is not None:
            result[mark.tensor] = amax
    return result


def missing_activations(placement: Placement, scales: ScaleTable) -> Tuple[str, ...]:
    """Activation tensors the placement quantizes that ``scales`` gives no range for
    (a scale-group member is covered when any member of its group has one)."""
    have = group_amax(placement, scales)
    return tuple(m.tensor for m in placement.activations if m.tensor not in have)


def without_unreached_branches(placement: Placement, table: ScaleTable, in_body: bool = False) -> Placement:
    """``placement`` less the subgraph placements whose activations ``table`` has no range for:
    calibration observes only the If branch each batch takes, so a branch no batch took stays float;
    a Loop/Scan body whose tensor shapes change across iterations (or an If inside a body) cannot be
    observed per iteration and stays float too. A note says which."""
    if not placement.subgraphs:
        return placement
    kept, notes = [], list(placement.notes)
    for sub in placement.subgraphs:
        missing = missing_activations(sub.placement, table)
        if missing and sub.attribute == "body":
            notes.append(f"Loop/Scan node {sub.node!r}: calibration could not observe its body per iteration "
                         f"(e.g. {missing[0]!r}: a shape that changes across iterations, or inside an If); "
                         "left float")
            logger.warning("%s", notes[-1])
        elif missing and in_body:
            notes.append(f"If node {sub.node!r} inside a Loop/Scan body: calibration cannot observe its "
                         f"{sub.attribute} per iteration; left float")
            logger.warning("%s", notes[-1])
        elif missing:
            notes.append(f"If node {sub.node!r}: no calibration batch took its {sub.attribute}; left float")
            logger.warning("%s", notes[-1])
        else:
            inner = without_unreached_branches(sub.placement, table, in_body or sub.attribute == "body")
            notes.extend(inner.notes[len(sub.placement.notes):])  # a nested drop is noted at the top
            kept.append(replace(sub, placement=replace(inner, notes=sub.placement.notes)))
    return replace(placement, subgraphs=tuple(kept), notes=tuple(notes))


# --------------------------------------------------------------------------- insertion
def insert_qdq_pairs(edit: GraphEdit, placement: Placement, scales: ScaleTable, target="tensorrt", *,
                     progress: bool = False, zero_points: Optional[Dict[str, int]] = None,
                     unsigned_weights=(), precision="int8", block_size: int = 128,
                     full_range=(), narrow_weights=(), range_scales=None,
                     scale_inputs: bool = False) -> InsertionResult:
    """Insert every Q/DQ the placement asks for, as edits of ``edit`` (apply them with
    `commit`).

    Args:
        edit: a `GraphEdit` of the model whose node names placement used.
        placement: the marks from [`onnx_qat.place`][onnx_qat.placement.policy.place].
        scales: activation amax per tensor; optional weight amax (otherwise from the weights).
        target: a `Target` or its name.
        progress: show a progress bar on stderr.
        zero_points: activation tensor -> zero point overriding the target's (the ``ort-cpu``
            form uses 0 for non-negative tensors); the records then carry ``zero_point``.
        unsigned_weights: weight tensors stored as uint8 ``q + 128`` with zero point 128 instead of
            int8 ``q`` with zero point 0 (the same dequantized values).
        precision: the numeric format (``"int8"``, ``"fp8"``, ``"int4"`` or a
            `Format`); the target's dtypes apply to ``int8`` only.
        block_size: values per INT4 weight scale along the mark's axis (``int4``).
        full_range: activation tensors stored as uint8 with zero point 0 over the whole grid 0..255:
            scale ``amax / 255`` instead of ``amax / 127`` (the ``ort-cpu`` form's non-negative
            tensors with calibrated ranges, see `onnx_qat.insertion.ort_cpu`).
        narrow_weights: int8 weight tensors stored in [-63, 63] (scale ``amax / 63``): read by
            onnxruntime's uint8 x int8 kernels with activations up to 255, their pair sums stay within
            16 bits on CPUs without VNNI (the ``ort-cpu`` form with calibrated ranges).
        range_scales: activation tensor -> its scale, for tensors stored with an asymmetric range (the
            ``ort-cpu`` form's tensors of unknown sign with calibrated extremes,
            `onnx_qat.insertion.ort_cpu.asymmetric_range`); their zero points come from
            ``zero_points``. Overrides the scale rule (and ``full_range``) for those tensors.
        scale_inputs: each activation pair reads its scale from a tensor of its own, named in its record
            (``scale_input``: ``<tensor>_scale_input``, fresh) and stored nowhere, instead of a scale
            initializer, and the pairs of one zero point (element type and bytes) share one initializer
            (the first such pair's): the form `onnx_qat.calibration.choice.judge_model` binds each table's
            scales to. The caller declares those tensors as graph inputs (float32 scalars) after `commit`.
            The records still carry each pair's ``scale`` under ``scales``.

    Raises:
        ScalesError: a quantized activation has no range in ``scales``, or a weight range
            does not fit its weight. The edit is then incomplete: do not commit it.
    """
    amaxes = group_amax(placement, scales)
    missing = tuple(m.tensor for m in placement.activations if m.tensor not in amaxes)  # missing_activations
    if missing:
        shown = ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise ScalesError(f"ScaleTable has no range for {len(missing)} quantized tensor(s): {shown}")
    return _Inserter(edit, get_target(target), zero_points, unsigned_weights, get_format(precision),
                     block_size, full_range, narrow_weights, range_scales,
                     scale_inputs).run(placement, scales, amaxes, progress)


class _Inserter:
    """One insertion run over one graph edit."""

    def __init__(self, edit: GraphEdit, target: Target, zero_points: Optional[Dict[str, int]] = None,
                 unsigned_weights=(), fmt: Format = INT8, block_size: int = 128, full_range=(),
                 narrow_weights=(), range_scales=None, scale_inputs: bool = False):
        self.edit = edit
        self.scale_inputs = scale_inputs
        self._shared: Dict[tuple, str] = {}  # scale_inputs: (element type, raw bytes) -> its zero point
        self.range_scales = dict(range_scales or {})
        self.full_range = frozenset(full_range)
        self.narrow_weights = frozenset(narrow_weights)
        self.target = target
        self.format = fmt
        self.block_size = block_size
        self.zero_points = zero_points
        self.unsigned_weights = frozenset(unsigned_weights)
        self._zero_points: Dict[tuple, tuple] = {}  # see _zero_point

    def run(self, placement: Placement, scales: ScaleTable, amaxes: Dict[str, float],
            progress: bool) -> InsertionResult:
        """Insert every mark of ``placement`` (``amaxes``: its `group_amax` in ``scales``)."""
        bar = _progress(len(placement.activations) + len(placement.weights), progress)
        records_a, records_w = [], []
        marks = placement.activations
        # every activation scale at once: float values for the records, raw float32 bytes for the
        # initializers (per-tensor NumPy scalars would cost more than the rest of a pair's insertion)
        act_scales = activation_scales([amaxes[m.tensor] for m in marks], self.format.qmax)
        if self.full_range:  # uint8 zero point 0 over 0..255 (ort-cpu): a grid twice as fine
            fine = np.array([m.tensor in self.full_range for m in marks], bool)
            halved = (np.asarray([amaxes[m.tensor] for m in marks], np.float64) / 255.0).astype(np.float32)
            act_scales = np.where(fine & (halved >= TINY), halved, act_scales).astype(np.float32)
        if self.range_scales:  # asymmetric uint8 ranges (ort-cpu): scale and zero point given
            given = [self.range_scales.get(m.tensor) for m in marks]
            act_scales = np.array([s if g is None else g for s, g in zip(act_scales.tolist(), given)],
                                  np.float32)
        raw = _le_bytes(act_scales)
        names = self.edit.fresh_names([f"{m.tensor}{suffix}" for m in marks for suffix in _PAIR_SUFFIXES])
        inputs = self.edit.fresh_names([f"{name}_input" for name in names[0::6]]) \
            if self.scale_inputs else None
        if self.edit.encoded and _template_names(names) and _template_names(inputs or ()):
            records_a = self._activations(marks, amaxes, act_scales, raw, names, bar, inputs)
        else:
            for i, (mark, scale) in enumerate(zip(marks, act_scales.tolist())):
                records_a.append(self.activation(mark, amaxes[mark.tensor], scale, raw[4 * i:4 * i + 4],
                                                 names[6 * i:6 * i + 6], inputs[i] if inputs else None))
                if i & 255 == 255:
                    bar.update(256)
        bar.update(len(marks) & 255)
        groups = _weight_groups(placement.weights)
        axes_per_tensor: Dict[str, int] = {}
        for tensor, _ in groups:
            axes_per_tensor[tensor] = axes_per_tensor.get(tensor, 0) + 1
        grid = self.target.weight_scale_grid == "fp16"
        ready = _quantize_small(self.edit, [k for k in groups if k[0] not in self.narrow_weights], scales,
                                INT8_QRANGE, grid) if self.format is INT8 else {}
        bases = [tensor if axes_per_tensor[tensor] == 1 else f"{tensor}_axis{axis}"
                 for tensor, axis in groups]
        names = self.edit.fresh_names([f"{base}{suffix}" for base in bases for suffix in _WEIGHT_SUFFIXES])
        if self.edit.encoded and _template_names(names):
            records_w = self._weights(groups, names, scales, ready, bar)
        else:
            for i, ((tensor, axis), marks) in enumerate(groups.items()):
                records_w.append(self.weight(tensor, names[5 * i:5 * i + 5], axis, marks, scales,
                                             ready.pop((tensor, axis), None)))
                bar.update(len(marks))
        bar.close()
        return InsertionResult(tuple(records_a), tuple(records_w))

    # -- many marks at once, from per-form templates (an edit holding new nodes as bytes)
    def _activations(self, marks, amaxes: Dict[str, float], act_scales: np.ndarray, raw: bytes,
                     names: Sequence[str], bar, inputs: Optional[Sequence[str]] = None) -> List[dict]:
        """`activation` of every one of ``marks``, for an edit holding new nodes as bytes (``edit.encoded``)
        and names that `_template_names` passes: the same initializers, nodes, queues and records, made a
        column at a time (each pair's two scalar initializers and two nodes formatted from the template of
        its form, `_SCALE_TEMPLATE`, `_scalar_template` of its zero point, `_Q_TEMPLATE` and `_DQ_TEMPLATE`,
        by C-level maps over the columns of names) and handed to the edit in one call each
        (`GraphEdit.add_encoded_initializers`, `GraphEdit.insert_many`). ``inputs``: with ``scale_inputs``,
        each pair's scale input (the pairs then read it, and one zero point per value, `_shared_zero_points`:
        no scale initializer, one zero-point initializer per value)."""
        if not marks:
            return []
        edit, target, fmt = self.edit, self.target, self.format
        new = tuple.__new__
        count = len(marks)
        tensors = [m.tensor for m in marks]
        scale_names, zp_names, q_outs, dq_outs, q_names, dq_names = (names[k::6] for k in range(6))
        # zero points: one form per value (the target's, or the form's per-tensor choice)
        default = target.activation_zero_point
        values = [default] * count if self.zero_points is None else \
            [self.zero_points.get(t, default) for t in tensors]
        zp_forms: Dict[int, tuple] = {}
        for value in dict.fromkeys(values):
            zp = self._zero_point((), value, target.activation_dtype) if fmt is INT8 else \
                encoding.zero_point(fmt, ())
            data_type = onnx_type(zp[0])
            zp_forms[value] = (data_type, _scalar_template(data_type, zp[1]), zp[1])
            edit.measure(data_type, len(zp[1]))
        # the initializers: scale then zero point of each pair, in mark order
        if inputs is not None:  # scale_inputs: the scales read from inputs, one zero point per value
            pair_names, pair_tensors, pair_raws, zp_names = self._shared_zero_points(values, zp_forms,
                                                                                     zp_names)
            scale_names = inputs
        else:
            pair_names, pair_tensors, pair_raws = self._pair_initializers(values, zp_forms, scale_names,
                                                                          zp_names, raw)
        # the nodes
        scale_lengths, zp_lengths = list(map(len, scale_names)), list(map(len, zp_names))
        q_data = map(str.encode, map(_Q_TEMPLATE.__mod__, zip(
            map(len, tensors), tensors, scale_lengths, scale_names, zp_lengths, zp_names,
            map(len, q_outs), q_outs, map(len, q_names), q_names)))
        dq_data = map(str.encode, map(_DQ_TEMPLATE.__mod__, zip(
            map(len, q_outs), q_outs, scale_lengths, scale_names, zp_lengths, zp_names,
            map(len, dq_outs), dq_outs, map(len, dq_names), dq_names)))
        node = repeat(EncodedNode)
        qs = list(map(new, node, zip(repeat("QuantizeLinear"), q_names,
                                     zip(tensors, scale_names, zp_names), zip(q_outs), q_data)))
        dqs = list(map(new, node, zip(repeat("DequantizeLinear"), dq_names,
                                      zip(q_outs, scale_names, zp_names), zip(dq_outs), dq_data)))
        # the consumers, pointed at the DequantizeLinear outputs
        by_name = edit.by_name
        readers = [[by_name[n] if n in by_name else edit.node(n) for n, _ in m.consumers] for m in marks]
        edges = [(k, out) for m, out in zip(marks, dq_outs) for _, k in m.consumers]
        rewired = [reader for group in readers for reader in group]
        for _ in map(setitem, map(_INPUT, rewired), [k for k, _ in edges], [out for _, out in edges]):
            pass
        edit.add_encoded_initializers(dict(zip(pair_names, pair_tensors)), pair_raws)
        edit.insert_many(zip(zip(qs, dqs), readers, zip(q_outs, dq_outs)),
                         dict(zip(_PAIR_FORMS, (qs[0], dqs[0]))))
        # the records
        columns = [repeat("activation"), tensors, q_names, dq_names, [float(amaxes[t]) for t in tensors],
                   act_scales.tolist(), [m.scale_group for m in marks],
                   [[f"{n}:{k}" for n, k in m.consumers] for m in marks], [m.rule for m in marks],
                   [m.reason for m in marks]]
        keys = _ACTIVATION_KEYS
        if self.zero_points is not None:
            columns.append(list(map(int, values)))
            keys += ("zero_point",)
        if inputs is not None:
            columns.append(inputs)
            keys += ("scale_input",)
        bar.update(count - (count & 255))  # the caller adds the rest
        return list(map(dict, map(zip, repeat(keys), zip(*columns))))

    def _pair_initializers(self, values: Sequence[int], zp_forms: Dict[int, tuple],
                           scale_names: Sequence[str], zp_names: Sequence[str], raw: bytes):
        """`_activations`' initializers, scale then zero point of each pair in mark order: ``(names,
        EncodedTensors, raw bytes)`` (``values``: each pair's zero point, of ``zp_forms``; ``raw``: the
        scales' float32 bytes)."""
        count, new = len(values), tuple.__new__
        self.edit.measure(_ONNX_FLOAT, 4)  # every scale: 4 bytes of act_scales' float32 buffer
        scale_bytes, zp_bytes = list(map(str.encode, scale_names)), list(map(str.encode, zp_names))
        scale_raws = [raw[k:k + 4] for k in range(0, 4 * count, 4)]
        scale_data = map(_SCALE_TEMPLATE.__mod__, zip(map(len, scale_bytes), scale_bytes, scale_raws))
        if len(zp_forms) == 1:
            zp_type, zp_template, _ = zp_forms[values[0]]
            zp_types = [zp_type] * count
            zp_data = map(zp_template.__mod__, zip(map(len, zp_bytes), zp_bytes))
        else:
            zp_types = [zp_forms[v][0] for v in values]
            zp_data = map(bytes.__mod__, [zp_forms[v][1] for v in values], zip(map(len, zp_bytes), zp_bytes))
        pair_tensors: List[object] = [None] * (2 * count)
        encoded = repeat(EncodedTensor)
        pair_tensors[0::2] = map(new, encoded, zip(scale_names, repeat(_ONNX_FLOAT), scale_data))
        pair_tensors[1::2] = map(new, encoded, zip(zp_names, zp_types, zp_data))
        pair_names: List[object] = [None] * (2 * count)
        pair_names[0::2], pair_names[1::2] = scale_names, zp_names
        pair_raws: List[bytes] = [b""] * (2 * count)  # the facts of each: scalars, no dims
        pair_raws[0::2] = scale_raws
        pair_raws[1::2] = [zp_forms[v][2] for v in values] if len(zp_forms) > 1 else \
            [zp_forms[values[0]][2]] * count
        return pair_names, pair_tensors, pair_raws

    def _shared_zero_points(self, values: Sequence[int], zp_forms: Dict[int, tuple], zp_names: Sequence[str]):
        """For ``scale_inputs`` (`_activations`, its pairs' zero points ``values`` with their ``zp_forms``
        and own names ``zp_names``): ``(names, EncodedTensors, raw bytes)`` of the zero-point initializers
        to add -- one per element type and bytes, named as the first pair of this run that has it -- and
        the zero point's name each pair reads."""
        shared, new = self._shared, tuple.__new__
        names: List[str] = []
        tensors: List[object] = []
        raws: List[bytes] = []
        name_of: Dict[int, str] = {}
        for value in dict.fromkeys(values):  # the distinct values, in the order first met
            data_type, template, raw = zp_forms[value]
            name = shared.get((data_type, raw))
            if name is None:
                name = shared[(data_type, raw)] = zp_names[values.index(value)]
                data = name.encode()
                names.append(name)
                tensors.append(new(EncodedTensor, (name, data_type, template % (len(data), data))))
                raws.append(raw)
            name_of[value] = name
        used = [name_of[values[0]]] * len(values) if len(name_of) == 1 else [name_of[v] for v in values]
        return names, tensors, raws, used

    def _weights(self, groups, names: Sequence[str], scales: ScaleTable, ready: dict, bar) -> List[dict]:
        """`weight` of each group of ``groups`` in turn, for an edit holding new nodes as bytes and names that
        `_template_names` passes: the INT8 weights `_quantize_small` quantized in their batches (neither
        unsigned nor narrow) are written a run at a time from their batches' bytes (`_weight_run`), the
        others by `weight`, in order; the same initializers, nodes, queues and records."""
        records: List[dict] = []
        run: list = []
        special = self.unsigned_weights | self.narrow_weights
        for i, ((tensor, axis), marks) in enumerate(groups.items()):
            found = ready.pop((tensor, axis), None)
            if found is None or found[0] is None or tensor in special:
                if run:  # what came before goes to the edit first, in order
                    records += self._weight_run(run, names)
                    run = []
                records.append(self.weight(tensor, names[5 * i:5 * i + 5], axis, marks, scales, found))
                bar.update(len(marks))
                continue
            run.append((i, tensor, axis, marks, found))
            bar.update(len(marks))
        if run:
            records += self._weight_run(run, names)
        return records

    def _weight_run(self, run: list, names: Sequence[str]) -> List[dict]:
        """`weight` of each ``(position, tensor, axis, marks, ready entry)`` of ``run`` (weights quantized in
        their batches), made a column at a time: each weight's stored initializer, scale, zero point and
        DequantizeLinear formatted from the templates of its shape and axis (`_weight_templates`) by C-level
        maps, and handed to the edit in one call each."""
        edit, new = self.edit, tuple.__new__
        made: Dict[tuple, tuple] = {}  # (shape, axis) -> _weight_templates
        templates, q_raws, scale_raws, channels, shapes = [], [], [], [], []
        for _, _, axis, _, (batch, row, _) in run:
            shape = batch.q.shape[1:]
            shapes.append(shape)
            key = (shape, axis)
            found = made.get(key)
            if found is None:
                size, width = batch.q[0].size, batch.scale.shape[1]
                found = made[key] = (_weight_templates(shape, axis, width), size, 4 * width, width)
                edit.measure(_ONNX_INT8, size, shape)  # each weight's bytes: a slice of this size
                edit.measure(_ONNX_FLOAT, 4 * width, found[0][4])
            template, size, step, width = found
            templates.append(template)
            q_raws.append(batch.q_raw[size * row:size * row + size])
            scale_raws.append(batch.scale_raw[step * row:step * row + step])
            channels.append(width)
        starts = [5 * entry[0] for entry in run]
        q_names, scale_names, zp_names, dq_names, dq_outs = ([names[j + k] for j in starts] for k in range(5))
        q_bytes, scale_bytes, zp_bytes = (list(map(str.encode, c)) for c in (q_names, scale_names, zp_names))
        tensors: List[object] = [None] * (3 * len(run))
        encoded = repeat(EncodedTensor)
        tensors[0::3] = map(new, encoded, zip(q_names, repeat(_ONNX_INT8), map(
            bytes.__mod__, [t[0] for t in templates], zip(map(len, q_bytes), q_bytes, q_raws))))
        tensors[1::3] = map(new, encoded, zip(scale_names, repeat(_ONNX_FLOAT), map(
            bytes.__mod__, [t[1] for t in templates], zip(map(len, scale_bytes), scale_bytes, scale_raws))))
        tensors[2::3] = map(new, encoded, zip(zp_names, repeat(_ONNX_INT8), map(
            bytes.__mod__, [t[2] for t in templates], zip(map(len, zp_bytes), zp_bytes))))
        all_names: List[object] = [None] * (3 * len(run))
        all_names[0::3], all_names[1::3], all_names[2::3] = q_names, scale_names, zp_names
        dq_data = map(bytes.__add__, map(str.encode, map(_DQ_TEMPLATE.__mod__, zip(
            map(len, q_names), q_names, map(len, scale_names), scale_names, map(len, zp_names), zp_names,
            map(len, dq_outs), dq_outs, map(len, dq_names), dq_names))), [t[3] for t in templates])
        dqs = list(map(new, repeat(EncodedNode), zip(repeat("DequantizeLinear"), dq_names,
                                                     zip(q_names, scale_names, zp_names), zip(dq_outs),
                                                     dq_data)))
        by_name = edit.by_name
        readers = [[by_name[m.node] if m.node in by_name else edit.node(m.node) for m in entry[3]]
                   for entry in run]
        rewired = [reader for group in readers for reader in group]
        for _ in map(setitem, map(_INPUT, rewired), [m.input_index for entry in run for m in entry[3]],
                     [out for entry, out in zip(run, dq_outs) for _ in entry[3]]):
            pass
        forms: Dict[tuple, object] = {}
        for template, dq in zip(templates, dqs):
            if template[5] not in forms:
                forms[template[5]] = dq
        raws: List[bytes] = [b""] * (3 * len(run))  # the facts of each, as formatted
        raws[0::3], raws[1::3] = q_raws, scale_raws
        zeros = {width: bytes(width) for width in set(channels)}
        raws[2::3] = map(zeros.__getitem__, channels)
        dims = dict(compress(zip(q_names, shapes), shapes))  # each not a scalar: its dims
        scale_dims = [t[4] for t in templates]
        dims.update(compress(zip(scale_names, scale_dims), scale_dims))
        dims.update(compress(zip(zp_names, scale_dims), scale_dims))
        edit.add_encoded_initializers(dict(zip(all_names, tensors)), raws, dims)
        edit.insert_many(zip(zip(dqs), readers, zip(dq_outs)), forms)
        # the float weights (and the Constant/Identity nodes making them) go once nothing else reads them
        edit.release_if_unread(initializers=[entry[1] for entry in run if not entry[4][2][2]])
        for entry in run:
            chain = entry[4][2][2]
            if chain:
                edit.release_if_unread(initializers=[t for n in chain for t in n.input
                                                     if edit.initializer(t) is not None], nodes=chain)
        columns = (repeat("weight"), [entry[1] for entry in run],
                   [[f"{m.node}:{m.input_index}" for m in entry[3]] for entry in run], dq_names, q_names,
                   [entry[2] for entry in run], channels,
                   [entry[4][0].zeros[entry[4][1]] for entry in run], repeat("weights"),
                   [entry[3][0].rule for entry in run],
                   [entry[3][0].reason for entry in run])
        return list(map(dict, map(zip, repeat(_WEIGHT_KEYS), zip(*columns))))

    def _zero_point(self, shape: Tuple[int, ...], value: int, dtype) -> tuple:
        """``(NumPy type, raw bytes, shape)`` of a zero point of ``dtype`` and ``shape`` filled with
        ``value``, for `add_raw_initializer` (made once per
        shape, value and type: every pair and weight of a kind shares them)."""
        key = (shape, value, dtype)
        found = self._zero_points.get(key)
        if found is None:
            zero = np.full(shape, value, dtype)
            found = self._zero_points[key] = (zero.dtype, _le_bytes(zero), shape)
        return found

    def rewire(self, new_nodes, consumers, tensor: str) -> None:
        """Point every consumer ``(node, input index)`` at ``tensor``; queue ``new_nodes`` before
        the first of them."""
        for node, index in consumers:
            node.input[index] = tensor
        self.edit.insert(new_nodes, [n for n, _ in consumers])

    # -- the two kinds of insertion
    def activation(self, mark: ActivationMark, amax: float, scale: float, scale_raw: bytes,
                   names: Sequence[str], scale_input: Optional[str] = None) -> dict:
        """One QuantizeLinear -> DequantizeLinear pair on ``mark.tensor`` for its listed consumers
        (``scale``: its float32 scale from `activation_scales` as a float, ``scale_raw``: as
        4 little-endian bytes; ``names``: the fresh names of the tensor plus each of `_PAIR_SUFFIXES`, in
        that order: scale, zero point, the two outputs, the two nodes; ``scale_input``: with
        ``scale_inputs``, the tensor the pair reads its scale from, its zero point then shared by the pairs
        of its value, `_shared_zero_points`)."""
        edit, target, tensor = self.edit, self.target, mark.tensor
        by_name = edit.by_name
        consumers = [(by_name[n] if n in by_name else edit.node(n), i) for n, i in mark.consumers]
        zero_point = target.activation_zero_point if self.zero_points is None else \
            self.zero_points.get(tensor, target.activation_zero_point)
        scale_name, zp_name, q_out, dq_out, q_name, dq_name = names
        zp = self._zero_point((), zero_point, target.activation_dtype) if self.format is INT8 else \
            encoding.zero_point(self.format, ())
        if scale_input is None:
            edit.add_scalar_initializers((scale_name, zp_name), (_ONNX_FLOAT, onnx_type(zp[0])),
                                         (scale_raw, zp[1]))
        else:  # the scale read from an input, the zero point the first pair's of its type and bytes
            key = (onnx_type(zp[0]), zp[1])
            shared = self._shared.get(key)
            if shared is None:
                shared = self._shared[key] = zp_name
                edit.add_scalar_initializers((zp_name,), (key[0],), (zp[1],))
            scale_name, zp_name = scale_input, shared
            names = (scale_name, zp_name, q_out, dq_out, q_name, dq_name)
        if edit.encoded:
            q, dq = _encoded_pair(tensor, names)
        else:
            q = onnx.NodeProto(op_type="QuantizeLinear", name=q_name, input=[tensor, scale_name, zp_name],
                               output=[q_out])
            dq = onnx.NodeProto(op_type="DequantizeLinear", name=dq_name, input=[q_out, scale_name, zp_name],
                                output=[dq_out])
        for node, index in consumers:
            node.input[index] = dq_out
        edit.insert((q, dq), [n for n, _ in consumers], (q_out, dq_out), _PAIR_FORMS)
        record = {"kind": "activation", "tensor": tensor, "quantize_node": q_name,
                  "dequantize_node": dq_name, "amax": float(amax), "scale": scale,
                  "scale_group": mark.scale_group, "consumers": [f"{n}:{i}" for n, i in mark.consumers],
                  "rule": mark.rule, "reason": mark.reason}
        if self.zero_points is not None:
            record["zero_point"] = int(zero_point)
        if scale_input is not None:
            record["scale_input"] = scale_input
        return record

    def weight(self, tensor: str, names: Sequence[str], axis: Optional[int], marks: List[WeightMark],
               scales: ScaleTable, ready=None) -> dict:
        """The stored weight (its format's encoding, `onnx_qat.formats.encoding.encode_weight`) +
        a DequantizeLinear for one constant weight, for the marked inputs (``names``: the fresh names of
        its base plus each of `_WEIGHT_SUFFIXES`, in that order; ``ready``: an INT8 weight's
        ``(batch, row, constant)`` from `_quantize_small`, or None)."""
        edit, fmt = self.edit, self.format
        by_name = edit.by_name
        consumers = [(by_name[m.node] if m.node in by_name else edit.node(m.node), m.input_index)
                     for m in marks]
        unsigned = tensor in self.unsigned_weights
        if ready is not None:
            (q, scale, own_amax), (values, proto, chain) = _arrays(ready), ready[2]
            encoded, source = encode_int8(q, scale, own_amax, axis, unsigned=unsigned), "weights"
        else:
            values, proto, chain = edit.constant(tensor)
            if fmt.blocked:
                values = np.asarray(values, np.float32)
                amax, use_axis = _block_range(scales, tensor, axis, values, self.block_size), axis
            else:
                amax, table_axis = _weight_range(scales, tensor, axis, values)
                use_axis = axis if amax is None else table_axis
            qrange = NARROW_WEIGHT_RANGE if tensor in self.narrow_weights else INT8_QRANGE
            encoded = encode_weight(fmt, values, use_axis, amax, block_size=self.block_size,
                                    unsigned=unsigned, name=tensor, qrange=qrange,
                                    fp16_grid=self.target.weight_scale_grid == "fp16" and amax is None)
            source = "weights" if amax is None else "scale table"
        q_name, scale_name, zp_name, dq_name, dq_out = names
        edit.add_initializers((q_name, scale_name, zp_name),
                              (encoded.data, _scale_data(encoded.scale), encoded.zero))
        if edit.encoded:
            attributes = () if encoded.axis is None else (_axis_bytes(int(encoded.axis)),)
            if encoded.block_size is not None:
                attributes += (int_attribute("block_size", int(encoded.block_size)),)
            dq = _encoded_weight_dq(names, attributes)
        else:
            dq = onnx.NodeProto(op_type="DequantizeLinear", name=dq_name, input=[q_name, scale_name, zp_name],
                                output=[dq_out])
            if encoded.axis is not None:
                dq.attribute.append(_axis_attribute(int(encoded.axis)))
            if encoded.block_size is not None:
                dq.attribute.append(onnx.helper.make_attribute("block_size", int(encoded.block_size)))
        for node, index in consumers:
            node.input[index] = dq_out
        form = ("DequantizeLinear", "", 3, 1, encoded.axis, encoded.block_size)  # what its bytes vary with
        edit.insert((dq,), [n for n, _ in consumers], (dq_out,), (form,))
        # the float weight (and the Constant/Identity nodes making it) go once nothing else reads them
        if chain:
            edit.release_if_unread(initializers=[t for n in chain for t in n.input
                                                 if edit.initializer(t) is not None], nodes=chain)
        else:  # the weight is the initializer of its own name
            edit.release_if_unread(initializers=(tensor,))
        record = {"kind": "weight", "tensor": tensor, "nodes": [f"{m.node}:{m.input_index}" for m in marks],
                  "dequantize_node": dq_name, "initializer": q_name, "axis": encoded.axis,
                  "channels": int(encoded.scale.size),
                  "zero_channels": _zero_count(encoded.amax),
                  "amax_source": source, "rule": marks[0].rule, "reason": marks[0].reason}
        if fmt is not INT8:
            record["precision"] = fmt.name
        if encoded.block_size is not None:
            record["block_size"] = int(encoded.block_size)
        if unsigned:
            record["zero_point"] = 128
        if tensor in self.narrow_weights:
            record["range"] = list(NARROW_WEIGHT_RANGE)
        return record


def _template_names(names: Sequence[str]) -> bool:
    """True when every one of ``names`` is ASCII and shorter than 128 characters (one byte of length in
    the wire format): the per-form templates then write every node and initializer of the insertion."""
    return not names or (max(map(len, names)) < 128 and "".join(names).isascii())


#: A float32 scalar initializer's wire bytes (`onnx_qat.graph.wire.tensor`), given its name's length and
#: bytes and its 4 raw bytes.
_SCALE_TEMPLATE = b"\x10\x01\x42%c%s\x4a\x04%s"


def _scalar_template(data_type: int, raw: bytes) -> bytes:
    """A scalar initializer's wire bytes of element type ``data_type`` holding ``raw`` (< 128 bytes), as a
    ``%`` template of its name's length and bytes."""
    return b"\x10%c\x42%%c%%s\x4a%c" % (data_type, len(raw)) + raw.replace(b"%", b"%%")


def _weight_templates(shape: Tuple[int, ...], axis: Optional[int], channels: int) -> tuple:
    """What `_Inserter._weights` formats an INT8 weight of ``shape`` quantized along ``axis`` (None: per
    tensor; ``channels`` scales) from: the ``%`` templates of its stored initializer (name length, name,
    raw bytes), scale (likewise) and zero point (name length, name: its bytes are zeros), its
    DequantizeLinear's attribute bytes, the scale's dims and the node's form (`GraphEdit.insert`).
    The bytes are `onnx_qat.graph.wire.tensor`'s."""
    scale_dims = (channels,) if axis is not None else ()

    def template(dims, data_type: int, length: int, raw: bytes = b"%s") -> bytes:
        head = b"".join([TENSOR_DIMS + varint(int(d)) for d in dims]) + TENSOR_DATA_TYPE + varint(data_type)
        return head.replace(b"%", b"%%") + b"\x42%c%s\x4a" + varint(length).replace(b"%", b"%%") + raw

    count = 1
    for d in shape:
        count *= int(d)
    attributes = b"" if axis is None else field(NODE_ATTRIBUTE, _axis_bytes(int(axis)))
    return (template(shape, _ONNX_INT8, count), template(scale_dims, _ONNX_FLOAT, 4 * channels),
            template(scale_dims, _ONNX_INT8, channels, bytes(channels)), attributes, scale_dims,
            ("DequantizeLinear", "", 3, 1, axis, None))


def _encoded_pair(tensor: str, names: Sequence[str]) -> Tuple[EncodedNode, EncodedNode]:
    """An activation pair's QuantizeLinear and DequantizeLinear as `EncodedNode`s (``names``: as
    `_Inserter.activation` takes them): from `_Q_TEMPLATE` and `_DQ_TEMPLATE` when every name is ASCII
    and shorter than 128 characters, else by `encode_node`."""
    scale_name, zp_name, q_out, dq_out, q_name, dq_name = names
    q_in, dq_in = (tensor, scale_name, zp_name), (q_out, scale_name, zp_name)
    if tensor.isascii() and len(tensor) < 128 and max(map(len, names)) < 128:  # names = tensor + ASCII
        ls, lz = len(scale_name), len(zp_name)
        q_bytes = (_Q_TEMPLATE % (len(tensor), tensor, ls, scale_name, lz, zp_name, len(q_out), q_out,
                                  len(q_name), q_name)).encode()
        dq_bytes = (_DQ_TEMPLATE % (len(q_out), q_out, ls, scale_name, lz, zp_name, len(dq_out), dq_out,
                                    len(dq_name), dq_name)).encode()
        return (_new_tuple(EncodedNode, ("QuantizeLinear", q_name, q_in, (q_out,), q_bytes)),
                _new_tuple(EncodedNode, ("DequantizeLinear", dq_name, dq_in, (dq_out,), dq_bytes)))
    return (encode_node("QuantizeLinear", q_name, q_in, (q_out,)),
            encode_node("DequantizeLinear", dq_name, dq_in, (dq_out,)))


def _encoded_weight_dq(names: Sequence[str], attributes: Tuple[bytes, ...]) -> EncodedNode:
    """A weight's DequantizeLinear as an `EncodedNode` (``names``: as `_Inserter.weight` takes them;
    ``attributes``: AttributeProto bytes): from `_DQ_TEMPLATE` when every name is ASCII and shorter than
    128 characters, else by `encode_node`."""
    q_name, scale_name, zp_name, dq_name, dq_out = names
    inputs = (q_name, scale_name, zp_name)
    if max(map(len, names)) < 128 and "".join(names).isascii():
        head = _DQ_TEMPLATE % (len(q_name), q_name, len(scale_name), scale_name, len(zp_name), zp_name,
                               len(dq_out), dq_out, len(dq_name), dq_name)
        encoded = head.encode() + b"".join([field(NODE_ATTRIBUTE, a) for a in attributes])
        return _new_tuple(EncodedNode, ("DequantizeLinear", dq_name, inputs, (dq_out,), encoded))
    return encode_node("DequantizeLinear", dq_name, inputs, (dq_out,), attributes)


_AXIS_BYTES: Dict[int, bytes] = {}


def _axis_bytes(axis: int) -> bytes:
    """The ``axis`` attribute of value ``axis`` as wire bytes (made once per value)."""
    found = _AXIS_BYTES.get(axis)
    if found is None:
        found = _AXIS_BYTES[axis] = int_attribute("axis", axis)
    return found


_AXIS_ATTRIBUTES: Dict[int, onnx.AttributeProto] = {}


def _axis_attribute(axis: int) -> onnx.AttributeProto:
    """The ``axis`` attribute of value ``axis`` (made once per value; appending it to a node copies it)."""
    found = _AXIS_ATTRIBUTES.get(axis)
    if found is None:
        found = _AXIS_ATTRIBUTES[axis] = onnx.AttributeProto(name="axis", type=onnx.AttributeProto.INT,
                                                             i=axis)
    return found


def _zero_count(amax: np.ndarray) -> int:
    """How many of ``amax`` are zero: its size less its nonzero values (NaN counts as nonzero, -0.0 as
    zero, as ``amax == 0`` has it), without the comparison's temporary array."""
    amax = np.asarray(amax)
    return int(amax.size) - int(np.count_nonzero(amax))


def _scale_data(scale: np.ndarray) -> tuple:
    """``(type, raw bytes, shape)`` of a weight's float32 scale, as `GraphEdit.add_initializers` takes
    (another type: the array itself, stored as `onnx_qat.graph.edit.make_tensor` stores it)."""
    scale = np.asarray(scale)
    if scale.dtype != _FLOAT32:  # the encodings give float32; anything else as make_tensor stores it
        return scale
    return _FLOAT32, _le_bytes(scale), scale.shape


def _block_range(scales: ScaleTable, tensor: str, axis: int, values: np.ndarray, block_size: int):
    """Block amax of an INT4 weight from the ScaleTable (an entry with ``block_size``), or None to take it
    from the weight values."""
    rng = scales.weights.get(tensor)
    if rng is None:
        return None
    if getattr(rng, "block_size", None) != block_size or rng.axis is None or \
            (rng.axis + values.ndim if rng.axis < 0 else rng.axis) != axis:
        raise ScalesError(f"ScaleTable weight {tensor!r}: int4 needs block amax along axis {axis} with "
                          f"block_size {block_size}")
    shape = list(values.shape)
    shape[axis] //= block_size
    amax = np.asarray(rng.amax, np.float32)
    if amax.size != int(np.prod(shape)):
        raise ScalesError(f"ScaleTable weight {tensor!r}: {amax.size} block amax values for a "
                          f"{shape} block grid")
    return amax.reshape(shape)


def _le_bytes(values: np.ndarray) -> bytes:
    """The little-endian bytes of an array (ONNX raw data)."""
    return values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes()


class _NoProgress:
    """What `_progress` gives when no bar is shown (tqdm and what it imports are then not loaded)."""

    def update(self, count: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled or total == 0:
        return _NoProgress()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="inserting Q/DQ", unit="node", disable=not enabled or total == 0,
                leave=False)


def _weight_groups(weights) -> Dict[Tuple[str, Optional[int]], List[WeightMark]]:
    groups: Dict[Tuple[str, Optional[int]], List[WeightMark]] = {}
    for mark in weights:
        groups.setdefault((mark.tensor, mark.axis), []).append(mark)
    return groups


def _weight_range(scales: ScaleTable, tensor: str, axis: Optional[int], values: np.ndarray):
    """amax values for a weight from the ScaleTable and their axis, or ``(None, None)`` to use
    the weight values themselves."""
    rng = scales.weights.get(tensor)
    if rng is None:
        return None, None
    if getattr(rng, "block_size", None) is not None:
        raise ScalesError(f"ScaleTable weight {tensor!r} holds block ranges (block_size {rng.block_size}), "
                          "which only precision int4 uses")
    if rng.axis is None:
        return rng.amax, None
    rng_axis = rng.axis + values.ndim if rng.axis < 0 else rng.axis
    if axis is None or rng_axis != axis:
        raise ScalesError(f"ScaleTable weight {tensor!r}: axis {rng.axis} does not match "
                          f"the quantization axis {axis}")
    if len(rng.amax) != values.shape[axis]:
        raise ScalesError(f"ScaleTable weight {tensor!r}: {len(rng.amax)} amax values "
                          f"for {values.shape[axis]} channels")
    return rng.amax, axis
