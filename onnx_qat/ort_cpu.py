"""The ``ort-cpu`` deployment form: the TensorRT placement and scales, shaped for onnxruntime's CPU kernels.

onnxruntime's CPU execution provider turns a Q/DQ model into integer kernels by pattern
matching ("QDQ node units"). Measured on onnxruntime 1.31 (x86-64):

* ``DQ(x), DQ(w) -> Conv -> Q`` becomes ``QLinearConv``; without a QuantizeLinear directly
  on the Conv output (even ``Conv -> Relu -> Q``) the Conv runs in float on dequantized
  values. A float bias is accepted (onnxruntime quantizes it itself).
* ``DQ(x), DQ(w) -> Gemm`` becomes ``QGemm`` and ``DQ(x), DQ(w) -> MatMul`` becomes
  ``MatMulIntegerToFloat`` with or without an output QuantizeLinear: they need nothing more.
* Its x86 integer kernels are fast for uint8 activations x int8 weights; int8 x int8
  activations run slower than float.

* Without VNNI (AVX2 only) its uint8 x int8 kernels add pairs of products in saturating 16-bit
  arithmetic: ``a1*w1 + a2*w2`` overflows once activations sit high in the uint8 range, as every
  non-negative value does with zero point 128 (128 + q). Measured on a ResNet50: 17x the
  quantization error of the reference Q/DQ arithmetic.

So this form differs from ``tensorrt`` in these ways, and only these:

1. activations are stored as uint8 with the same scale (``amax / 127``) and zero point 128:
   ``clip(round(x / s) + 128, 0, 255) - 128 == clip(round(x / s), -128, 127)``, so every
   dequantized value is bit-identical to the int8, zero-point-0 form; weights stay int8
   symmetric per channel;
2. activations known to be non-negative (produced by Relu, directly or through pooling and
   shape ops) use zero point 0 instead: values 0..127 as before, no 16-bit saturation, and
   onnxruntime drops the Relu in front of such a QuantizeLinear. The clamp moves from ``amax`` to
   ``255/127 * amax``: only values above the tensor's amax differ (kept instead of clamped). The
   report's notes count these tensors;
3. weights of ops whose activation input keeps zero point 128 (a graph input such as an image,
   or any tensor whose sign is unknown) are stored as uint8 ``q + 128`` with zero point 128 (the
   same values): onnxruntime then uses its uint8 x uint8 kernel, slower but free of saturation;
4. *requantization points*: a Q/DQ pair on the output of each quantized Conv (rule CPU1),
   so onnxruntime forms ``QLinearConv``. Its scale is

   * the scale of the next quantized tensor when the Conv output reaches it through a
     single-consumer chain of ops that commute exactly with quantization (Relu, MaxPool,
     Reshape..., Pad with zeros): the quantized consumers then see the same values up to the
     tensor's amax and no learned scale changes (``scale_from`` in the report). When that tensor
     has zero point 0 (2.) the point takes zero point 0 too: ``Conv -> Q -> DQ -> Relu -> Q`` then
     has one scale and one zero point, onnxruntime drops the Relu and the DQ -> Q pair and the
     ``QLinearConv`` writes the quantized tensor directly (measured on ResNet50: no Q/DQ node left
     between ``QLinearConv`` s, 6-7% faster than zero point 128 there, which kept a DQ -> Q pair per
     point; the price is the clamp of 2.);
   * otherwise the Conv output's own range from the ScaleTable (``onnx_qat.quantize`` with
     ``data`` calibrates these tensors too);
   * when the table has no range for it, no point is added: that Conv keeps a float output
     (correct, slower) and the report lists it under ``not requantized``.

Every learned scale is kept unchanged; each requantization point is listed in
:meth:`onnx_qat.quantize.QuantizeResult.to_report` under ``requantization``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .placement.graph_index import GraphIndex
from .placement.marks import ActivationMark, Placement
from .scales import ScaleTable

logger = logging.getLogger(__name__)

#: Ops onnxruntime fuses into an integer kernel only with a QuantizeLinear right on their output.
REQUANT_OPS = ("Conv",)
#: Ops that commute *exactly* with per-tensor symmetric quantization: quantizing before them with
#: the scale used after them gives bit-identical quantized values downstream.
EXACT_OPS = ("Relu", "MaxPool", "GlobalMaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
             "Identity")
#: How far a requantization point looks forward through :data:`EXACT_OPS` for a quantized tensor.
_MAX_LOOKAHEAD = 8
RULE = "CPU1"


#: Ops whose output is non-negative when their (first) input is.
SIGN_PRESERVING_OPS = ("MaxPool", "GlobalMaxPool", "AveragePool", "GlobalAveragePool", "Reshape", "Flatten",
                       "Transpose", "Squeeze", "Unsqueeze", "Identity")


@dataclass(frozen=True)
class Adapted:
    """The ort-cpu placement, ScaleTable, requantization records, per-tensor zero points and the
    weights stored as uint8 with zero point 128."""

    placement: Placement
    table: ScaleTable
    requantization: Tuple[dict, ...]
    zero_points: Dict[str, int]
    unsigned_weights: Tuple[str, ...] = ()


@dataclass(frozen=True)
class RequantPoint:
    """A Q/DQ pair the ort-cpu form adds on the output of a quantized weighted op.

    Attributes:
        tensor: the weighted op's output tensor.
        node: the weighted op's name; ``op_type`` its type.
        scale_from: the quantized tensor downstream whose scale is reused (through exactly
            commuting ops), or None when the tensor needs a range of its own.
        reason: one sentence for the report.
    """

    tensor: str
    node: str
    op_type: str
    scale_from: Optional[str]
    reason: str


class OrtCpuForm:
    """The ort-cpu adjustments to a TensorRT placement: uint8 activations and requantization points."""

    def points(self, index: GraphIndex, placement: Placement) -> Tuple[RequantPoint, ...]:
        """The requantization points for ``placement``, in graph order (see the module docstring)."""
        marked = {m.tensor for m in placement.activations}
        weighted = {w.node for w in placement.weights}
        points = []
        for node in index.nodes:
            if node.op_type not in REQUANT_OPS or node.name not in weighted or not node.outputs:
                continue
            out = node.outputs[0]
            if not out or out in index.graph_outputs or not index.consumers(out):
                continue
            scale_from = _exact_downstream(out, index, marked)
            if scale_from is not None:
                why = (f"output of {node.op_type} {node.name!r} requantized for QLinearConv with the scale "
                       f"of {scale_from!r} (reached through exactly commuting ops)")
            else:
                why = f"output of {node.op_type} {node.name!r} requantized for QLinearConv with its own range"
            points.append(RequantPoint(out, node.name, node.op_type, scale_from, why))
        return tuple(points)

    def calibration_tensors(self, index: GraphIndex, placement: Placement) -> Tuple[str, ...]:
        """Tensors whose own range the requantization points need (to calibrate with the placement's)."""
        marked = {m.tensor for m in placement.activations}
        return tuple(p.tensor for p in self.points(index, placement)
                     if p.scale_from is None and p.tensor not in marked)

    def adapt(self, index: GraphIndex, placement: Placement, table: ScaleTable) -> Adapted:
        """The placement with the requantization points added, the table with their ranges, the zero
        point of every quantized activation, and one report record per point (``status`` "added",
        "extended", "already quantized" or "not requantized")."""
        from .insertion import group_amax

        amaxes = group_amax(placement, table)
        marks: Dict[str, ActivationMark] = {m.tensor: m for m in placement.activations}
        added: Dict[str, float] = {}
        notes = list(placement.notes)
        points = self.points(index, placement)
        records = tuple(self._apply(point, index, marks, amaxes, table, added, notes) for point in points)
        order = index.production_order()
        activations = tuple(sorted(marks.values(), key=lambda m: (order.get(m.tensor, len(order)), m.tensor)))
        zero_points, note = _zero_points(index, activations, points, records)
        notes += [note] if note else []
        new_placement = Placement(activations, placement.weights, placement.decisions, tuple(notes))
        new_table = table if not added else table.merged(
            ScaleTable(added, producer=table.producer, metadata=dict(table.metadata)))
        unsigned = _unsigned_weights(placement, activations, zero_points)
        return Adapted(new_placement, new_table, records, zero_points, unsigned)

    def _apply(self, point: RequantPoint, index: GraphIndex, marks: Dict[str, ActivationMark], amaxes,
               table: ScaleTable, added: Dict[str, float], notes: List[str]) -> dict:
        """Add or extend the mark of one point (in ``marks``/``added``/``notes``); its report record."""
        consumers = tuple((n.name, i) for n, i in index.consumers(point.tensor))
        existing = marks.get(point.tensor)
        record = {"tensor": point.tensor, "node": point.node, "op_type": point.op_type, "rule": RULE,
                  "consumers": [f"{n}:{i}" for n, i in consumers], "reason": point.reason}
        if existing is not None and set(existing.consumers) == set(consumers):
            record.update(status="already quantized", amax=amaxes[point.tensor], amax_source="its own scale")
        elif existing is not None:  # quantized for some consumers only (e.g. a residual Add skip)
            marks[point.tensor] = ActivationMark(
                point.tensor, consumers, f"{existing.rule},{RULE}",
                f"{existing.reason}; {RULE}: every consumer reads it for QLinearConv",
                scale_group=existing.scale_group)
            record.update(status="extended", amax=amaxes[point.tensor], amax_source="its own scale")
        else:
            amax, source = self._amax(point, amaxes, table)
            record.update(status="added" if amax is not None else "not requantized", amax=amax,
                          amax_source=source)
            if amax is not None:
                added[point.tensor] = amax
                marks[point.tensor] = ActivationMark(point.tensor, consumers, RULE, point.reason)
            else:
                notes.append(f"{point.op_type} {point.node!r}: output {point.tensor!r} has no range, so it "
                             "keeps a float output in onnxruntime (give calibration data to requantize it)")
                logger.warning("ort-cpu: no range for %r; %s %r keeps a float output",
                               point.tensor, point.op_type, point.node)
        logger.debug("ort-cpu requantization %s: %s", record["status"], point.reason)
        return record

    @staticmethod
    def _amax(point: RequantPoint, amaxes, table: ScaleTable) -> Tuple[Optional[float], str]:
        if point.scale_from is not None:
            return float(amaxes[point.scale_from]), f"scale of {point.scale_from!r}"
        own = table.activations.get(point.tensor)
        if own is not None:
            return float(own), "scale table (its own range)"
        return None, "missing from the scale table"


def _zero_points(index: GraphIndex, activations, points, records) -> Tuple[Dict[str, int], str]:
    """Zero point per quantized tensor, and a report note.

    0 for non-negative tensors (:func:`_nonnegative`) and for the requantization points that take the
    scale of such a tensor (their values reach it through Relu, so clamping at 0 is exact there and
    onnxruntime then joins the two Q/DQ pairs into one ``QLinearConv`` output); 128 otherwise.
    """
    zero_points = {m.tensor: (0 if _nonnegative(m.tensor, index) else 128) for m in activations}
    nonnegative = sum(1 for zp in zero_points.values() if zp == 0)
    joined = 0
    for point, record in zip(points, records):
        if record["status"] == "added" and point.scale_from is not None \
                and zero_points.get(point.scale_from) == 0:
            zero_points[point.tensor] = 0
            joined += 1
    note = ""
    if nonnegative or joined:
        note = (f"ort-cpu: {nonnegative} non-negative tensor(s) and {joined} requantization point(s) taking "
                "the scale of one use uint8 zero point 0: the same values as the tensorrt form up to the "
                "tensor's amax; above it values are kept (up to 255/127 x amax) instead of clamped")
    return zero_points, note


def _unsigned_weights(placement: Placement, activations, zero_points) -> Tuple[str, ...]:
    """Weights of ops whose activation input keeps zero point 128 (its sign is unknown): stored as
    uint8 + 128 so onnxruntime picks its uint8 x uint8 kernel, which does not saturate."""
    input_zp = {}
    for mark in activations:
        for node, position in mark.consumers:
            if position == 0:
                input_zp[node] = zero_points.get(mark.tensor, 128)
    return tuple(sorted({w.tensor for w in placement.weights if input_zp.get(w.node, 128) != 0}))


def _nonnegative(tensor: str, index: GraphIndex) -> bool:
    """True when ``tensor`` is a Relu output, directly or through :data:`SIGN_PRESERVING_OPS` or Pads
    with constant zeros."""
    for _ in range(_MAX_LOOKAHEAD):
        node = index.producer.get(tensor)
        if node is None or not node.standard or not node.inputs:
            return False
        if node.op_type == "Relu":
            return True
        if node.op_type not in SIGN_PRESERVING_OPS and not _zero_pad(node, index):
            return False
        tensor = node.inputs[0]
    return False


def _zero_pad(node, index: GraphIndex) -> bool:
    """True for a Pad that pads with constant zeros (it commutes exactly with symmetric quantization)."""
    if node.op_type != "Pad" or node.attr("mode", b"constant") not in (b"constant", "constant"):
        return False
    if len(node.inputs) < 3 or not node.inputs[2]:
        return True
    proto = index.constant_proto(node.inputs[2])
    if proto is None:
        return False
    from onnx import numpy_helper

    return not numpy_helper.to_array(proto).any()


def _exact_downstream(tensor: str, index: GraphIndex, marked) -> Optional[str]:
    """The first quantized tensor after ``tensor`` along a single-consumer chain of :data:`EXACT_OPS`
    (and Pads with constant zeros)."""
    for _ in range(_MAX_LOOKAHEAD):
        consumers = index.consumers(tensor)
        if tensor in index.graph_outputs or len(consumers) != 1:
            return None
        node, position = consumers[0]
        exact = node.op_type in EXACT_OPS or _zero_pad(node, index)
        if not exact or position != 0 or not node.outputs or not node.standard:
            return None
        tensor = node.outputs[0]
        if tensor in marked:
            return tensor
    return None


__all__ = ["OrtCpuForm", "Adapted", "RequantPoint", "REQUANT_OPS", "EXACT_OPS"]
