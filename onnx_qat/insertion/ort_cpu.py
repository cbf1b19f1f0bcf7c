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
2. activations known to be non-negative (produced by Relu or by a Clip with a constant lower bound
   >= 0 such as ReLU6, directly or through pooling and shape ops; with calibration ``data``, also
   graph inputs that are >= 0 on every calibration sample, as images are) use zero point 0 instead,
   and onnxruntime drops the Relu/Clip in front of such a QuantizeLinear. With a given ScaleTable
   (ranges learned in QAT) the scale stays ``amax / 127``: values 0..127 as before and the clamp
   moves from ``amax`` to ``255/127 * amax`` (only values above the tensor's amax differ: kept
   instead of clamped). With ranges calibrated in the same call (``data``), or a table from
   ``calibrate(..., target="ort-cpu")`` (graph inputs >= 0 then read from its ``bounds``,
   `OrtCpuAdapter.nonnegative_bounds`), nothing was learned at
   that scale, so these tensors use the whole grid: scale ``amax / 255``, twice as fine, clamped at
   ``amax`` (onnxruntime's own ``quantize_static`` also spends all 256 levels on a tensor that is
   never negative; measured on a random-weight MobileNetV2, the output error went from 1.25x to
   0.91-1.01x that form's). Concat inputs sharing one scale (rule 7) take it only when all of them
   have zero point 0. The report's notes count these tensors.

   Zero point 0 on ReLU6 outputs also avoids a fusion hazard: onnxruntime's ``ClipQuantFusion``
   removes a Clip in front of a QuantizeLinear whose representable range lies inside the Clip's
   up to an *absolute* float32 epsilon (1.19e-7), so with zero point 128 and a scale below ~9e-10
   (deep activations of an untrained network) ``Clip(0, 6)`` went and negative values flowed on
   (mean output error 0.2-0.6 of the output range on MobileNetV2);
   With calibrated extremes (the ScaleTable's ``bounds``), a tensor of unknown sign is stored over an
   asymmetric uint8 range instead: ``[min, max]`` clipped to ``[-amax, amax]`` and holding 0, scale
   ``(max - min) / 255``, the zero point that puts 0 on the grid, as onnxruntime's ``quantize_static``
   does (`asymmetric_range`);
3. weights of ops whose activation input keeps zero point 128 (a graph input such as an image,
   or any tensor whose sign is unknown) are stored as uint8 ``q + 128`` with zero point 128 (the
   same values): onnxruntime then uses its uint8 x uint8 kernel, slower but free of saturation;
4. *requantization points*: a Q/DQ pair on the output of each quantized Conv (rule CPU1),
   so onnxruntime forms ``QLinearConv``. Its scale is

   * the scale of the next quantized tensor when the Conv output reaches it through a
     single-consumer chain of ops that commute exactly with quantization (Relu, MaxPool,
     Reshape..., Pad with zeros, Clip with constant bounds): the quantized consumers then see the
     same values up to the tensor's amax and no learned scale changes (``scale_from`` in the
     report). When that tensor has zero point 0 (2.) the point takes zero point 0 and the same
     scale too: ``Conv -> Q -> DQ -> Relu -> Q`` then has one scale and one zero point,
     onnxruntime drops the Relu and the DQ -> Q pair and the ``QLinearConv`` writes the quantized
     tensor directly (measured on ResNet50: no Q/DQ node left between ``QLinearConv`` s, 6-7%
     faster than zero point 128 there, which kept a DQ -> Q pair per point);
   * otherwise the Conv output's own range from the ScaleTable (``onnx_qat.quantize`` with
     ``data`` calibrates these tensors too, and so does ``onnx_qat.calibrate(..., target="ort-cpu")``);
   * when the table has no range for it, no point is added: that Conv keeps a float output
     (correct, slower) and the report lists it under ``not requantized``.

5. *scale folds* (rule CPU2): a quantized Conv whose output only feeds a Mul by a constant
   per-channel (or scalar) vector ``k``, optionally followed by an Add of a constant per-channel
   vector ``b`` (a BatchNormalization kept unfolded, as ``tf_bridge.export_onnx`` writes it), gets
   them folded in after its weight is quantized: weight integers ``sign(k[c]) * q[c]`` (0 where
   ``k[c] == 0``), weight scale ``scale[c] * |k[c]|``, bias ``bias * k + b``. The dequantized
   weight is ``k[c]`` times the old one, exactly up to the float32 rounding of the scale product,
   and the Conv output is the old Add (or Mul) output, which then takes the requantization point
   of 4. Without the fold no QuantizeLinear sits on the Conv output and it runs in float.
6. *Sigmoid gates* (rule CPU5, `_quantize_gates`): ``Mul(x, Sigmoid(s))`` between quantized tensors gets
   a Q/DQ pair on the Sigmoid output, so it runs as ``QLinearSigmoid`` and ``QLinearMul`` instead of in
   float between a DequantizeLinear and a QuantizeLinear;
7. *float joins* (rule CPU6, `_float_joins`): a residual join with no other quantized input runs in
   float in onnxruntime, so its skip input loses the pair placement rule 6 gives it for TensorRT.
8. *bias correction* (rule CPU7, `onnx_qat.insertion.ort_cpu_bias`, with calibration data only; a
   ScaleTable does not carry it): each quantized Conv's bias absorbs the mean error of its rounded
   weight on the calibration data.
9. *round trips* (rule CPU8, `_round_trips`, with calibrated ranges): a Q/DQ pair that no integer kernel
   reads or writes (a pooling input before a squeeze-excitation Conv kept float for speed, a
   ConvTranspose's input: that op has no integer kernel there, so its weight stays float too) would run as
   a float QuantizeLinear and DequantizeLinear; it is left out. With ranges learned in QAT every pair is
   kept: the model trained through those roundings.

Every learned scale is kept unchanged; each requantization point and each fold is listed in
`onnx_qat.quantize.QuantizeResult.to_report` under ``requantization`` (folds with rule
``CPU2``, status ``folded``, just before the point of the same Conv).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..graph.index import GraphIndex
from ..graph.scale_folds import channel_vector, single_consumer, usable_factors
from ..placement.marks import ActivationMark, Decision, Placement
from ..scales import ScaleTable

logger = logging.getLogger(__name__)

#: Ops onnxruntime fuses into an integer kernel only with a QuantizeLinear right on their output.
REQUANT_OPS = ("Conv",)
#: Ops that commute *exactly* with per-tensor symmetric quantization: quantizing before them with
#: the scale used after them gives bit-identical quantized values downstream.
EXACT_OPS = ("Relu", "MaxPool", "GlobalMaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze",
             "Identity")
#: How far a requantization point looks forward through `EXACT_OPS` for a quantized tensor.
_MAX_LOOKAHEAD = 8
RULE = "CPU1"
#: Rule name of a per-channel Mul/Add folded into the quantized Conv before it (see `ScaleFold`).
FOLD_RULE = "CPU2"
#: Rule name of a MatMul kept apart from its bias Add (see `BiasSplit`).
SPLIT_RULE = "CPU4"
#: Rule name of a Sigmoid gate (swish ``x * Sigmoid(x)``, a squeeze-excitation ``x * Sigmoid(s)``) run on
#: onnxruntime's integer kernels (see `_quantize_gates`).
GATE_RULE = "CPU5"
#: The range of a Sigmoid output.
SIGMOID_AMAX = 1.0
#: Rule name of a residual join left float in this form (see `_float_joins`).
JOIN_RULE = "CPU6"
#: The placement rules of residual joins' skip inputs (rule 6, and rule 6b for Sum).
_JOIN_RULES = ("R6", "R6b")
_FLOAT = 1  # onnx.TensorProto.FLOAT (onnx is not imported at module level)


#: Ops whose output is non-negative when their (first) input is.
SIGN_PRESERVING_OPS = ("MaxPool", "GlobalMaxPool", "AveragePool", "GlobalAveragePool", "Reshape", "Flatten",
                       "Transpose", "Squeeze", "Unsqueeze", "Identity")


@dataclass(frozen=True)
class ScaleFold:
    """A per-channel Mul (and Add) after a quantized Conv, folded into the Conv (rule CPU2).

    Attributes:
        node: the Conv's name; ``weight`` its weight tensor; ``bias`` its bias initializer or "".
        mul: the Mul's name; ``add`` the Add's name, or None when the Mul is folded alone.
        output: the tensor the Conv writes after the fold (the Add's output, else the Mul's).
        k: the Mul's factor per output channel (float32, length C); ``b`` the Add's term (zeros
            without an Add).
    """

    node: str
    weight: str
    bias: str
    mul: str
    add: Optional[str]
    output: str
    k: np.ndarray = field(compare=False, repr=False)
    b: np.ndarray = field(compare=False, repr=False)

    def record(self) -> dict:
        """The report record of this fold (listed under ``requantization``)."""
        ops = [self.mul] + ([self.add] if self.add else [])
        shown = " and ".join(repr(o) for o in ops)
        return {"tensor": self.output, "node": self.node, "op_type": "Conv", "rule": FOLD_RULE,
                "status": "folded", "folded": ops, "channels": int(self.k.size),
                "negative_k": int(np.count_nonzero(self.k < 0)), "zero_k": int(np.count_nonzero(self.k == 0)),
                "reason": f"per-channel {shown} after Conv {self.node!r} folded into its quantized weight "
                          "(integers x sign(k), scale x |k|) and bias, so its output can be requantized "
                          "for QLinearConv"}


@dataclass(frozen=True)
class BiasSplit:
    """A quantized MatMul whose output only feeds an Add of a constant bias (rule CPU4).

    onnxruntime's ``MatMulAddFusion`` (graph optimization level "extended", before its QDQ fusions)
    turns ``DQ(x), DQ(W) -> MatMul -> Add(b)`` into a float ``Gemm`` that dequantizes ``W`` at every
    run: the integer kernel is never used and the model runs slower than FP32 (measured on a
    ViT-B/16-size encoder block: the weight DequantizeLinear took as long as the Gemm). Kept apart:

    * a MatMul whose input is known to be 2-D (a Flatten or Gemm output, a Reshape to 2-D, or declared
      2-D in the graph's value_info) becomes a
      ``Gemm`` without bias (the same product): onnxruntime runs it as ``QGemm``, then the float Add;
    * otherwise the Add reads the bias reshaped to ``[1, N]`` (the same broadcast on inputs of rank >= 3):
      the fusion takes only a rank-1 bias there, so the MatMul becomes ``MatMulIntegerToFloat``.

    No value changes in either case.
    """

    node: str
    add: str
    bias: str
    as_gemm: bool

    def record(self) -> dict:
        """The report record (listed under ``requantization``)."""
        how = ("written as a Gemm without bias (QGemm)" if self.as_gemm else
               f"bias {self.bias!r} read as [1, N] (MatMulIntegerToFloat)")
        return {"tensor": self.bias, "node": self.node, "op_type": "MatMul", "rule": SPLIT_RULE,
                "status": "kept apart", "add": self.add,
                "reason": f"MatMul {self.node!r} and bias Add {self.add!r} kept apart from onnxruntime's "
                          f"MatMulAddFusion (a float Gemm dequantizing the weight at every run): {how}"}


@dataclass(frozen=True)
class Adapted:
    """The ort-cpu placement, ScaleTable, report records (requantization points and folds), per-tensor
    zero points, the weights stored as uint8 with zero point 128, the scale folds to apply to the
    graph after Q/DQ insertion (`finish`), and the scales of the tensors stored with an asymmetric
    range (``range_scales``, their zero points in ``zero_points``)."""

    placement: Placement
    table: ScaleTable
    requantization: Tuple[dict, ...]
    zero_points: Dict[str, int]
    unsigned_weights: Tuple[str, ...] = ()
    folds: Tuple[ScaleFold, ...] = ()
    full_range: Tuple[str, ...] = ()
    splits: Tuple[BiasSplit, ...] = ()
    narrow_weights: Tuple[str, ...] = ()
    range_scales: Dict[str, float] = field(default_factory=dict)

    def finish(self, edit) -> Tuple[str, ...]:
        """Apply `folds` and `splits` to ``edit`` (the
        `GraphEdit` after `insert_qdq_pairs`);
        the names of the Convs folded."""
        folded = fold_scale_ops(edit, self.folds)
        split_bias_adds(edit, self.splits)
        return folded


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


class OrtCpuAdapter:
    """The ort-cpu adjustments to a TensorRT placement: uint8 activations and requantization points."""

    def folds(self, index: GraphIndex, placement: Placement) -> Tuple[ScaleFold, ...]:
        """The per-channel Mul/Add chains to fold into quantized Convs (rule CPU2), in graph order."""
        marked = {m.tensor for m in placement.activations}
        weights = {(w.node, w.input_index): w for w in placement.weights}
        found = (_scale_fold(node, index, weights, marked) for node in index.nodes if node.op_type == "Conv")
        return tuple(f for f in found if f is not None)

    def points(self, index: GraphIndex, placement: Placement,
               folds: Optional[Tuple[ScaleFold, ...]] = None) -> Tuple[RequantPoint, ...]:
        """The requantization points for ``placement``, in graph order (see the module docstring); a
        Conv with a fold (``folds``, by default `folds`) has its point on the fold's output."""
        marked = {m.tensor for m in placement.activations}
        weighted = {w.node for w in placement.weights}
        folded = {f.node: f.output for f in (self.folds(index, placement) if folds is None else folds)}
        points = []
        for node in index.nodes:
            if node.name not in weighted or not node.outputs or not node.standard:
                continue
            if node.op_type not in REQUANT_OPS:
                continue
            out = folded.get(node.name, node.outputs[0])
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

    @staticmethod
    def nonnegative_inputs(model, data, placement: Placement) -> Tuple[str, ...]:
        """Quantized graph inputs of ``model`` whose every value in the calibration ``data`` is >= 0
        (images in 0..255 or 0..1): they take zero point 0 and the whole uint8 grid, as onnxruntime's
        own ``quantize_static`` does from their calibrated minimum. Read batch by batch."""
        from ..io.data import load_data

        marked = set(placement.activation_tensors())
        dataset = load_data(data, model, what="calibration data")
        names = [n for n in dataset.input_names if n in marked]
        if not names:
            return ()
        low = {n: np.inf for n in names}
        for batch in dataset.batches(64):
            for name in names:
                values = np.asarray(batch[name])
                # a NaN (min is NaN) or a non-float input counts as possibly negative
                lowest = float(values.min()) if values.size and values.dtype.kind == "f" else -1.0
                low[name] = lowest if np.isnan(lowest) else min(low[name], lowest)
        return tuple(n for n in names if low[n] >= 0.0)

    @staticmethod
    def nonnegative_bounds(index: GraphIndex, placement: Placement, table: ScaleTable) -> Tuple[str, ...]:
        """`nonnegative_inputs` read from a calibrated ScaleTable instead of the data: the quantized graph
        inputs whose recorded minimum (``table.bounds``, the smallest finite value calibration saw) is
        >= 0. A table from ``calibrate(..., target="ort-cpu")`` observes every quantized graph input, so
        this names the inputs `nonnegative_inputs` names on the same data (a NaN, which that counts as
        negative, is left out of the bounds as of the amax, with a warning)."""
        marked = set(placement.activation_tensors())
        bounds = table.bounds
        return tuple(n for n in index.graph_inputs if n in marked and n in bounds and bounds[n][0] >= 0.0)

    def adapt(self, index: GraphIndex, placement: Placement, table: ScaleTable,
              nonnegative: Tuple[str, ...] = (), fine: bool = False, vnni: bool = False) -> Adapted:
        """The placement with the requantization points added, the table with their ranges, the zero
        point of every quantized activation, the scale folds, and one report record per point
        (``status`` "added", "extended", "already quantized" or "not requantized") and per fold
        (rule CPU2, ``status`` "folded", just before its Conv's point). ``nonnegative``: graph inputs
        known to be >= 0 (`nonnegative_inputs` on the calibration data): zero point 0 for them.
        ``fine``: the ranges were calibrated for this model (not learned in QAT): tensors with zero point 0
        use the whole uint8 grid (scale ``amax / 255``, `Adapted.full_range`), and the weights of
        GEMM-kernel ops (all but depthwise Convs) are stored in 7 bits (`Adapted.narrow_weights`,
        `_narrow_weights`), or with ``vnni`` (CPUs whose int8 dot products sum in 32 bits) as plain
        8-bit int8; and the Q/DQ pairs no integer kernel of onnxruntime reads or writes are left out
        (rule CPU8, `_round_trips`: with learned ranges every rounding the QAT model trained through is
        kept)."""
        from .inserter import group_amax

        amaxes = group_amax(placement, table)
        marks: Dict[str, ActivationMark] = {m.tensor: m for m in placement.activations}
        added: Dict[str, float] = {}
        notes = list(placement.notes)
        folds = self.folds(index, placement)
        points = self.points(index, placement, folds)
        records = tuple(self._apply(point, index, marks, amaxes, table, added, notes) for point in points)
        records += tuple(_quantize_gates(index, marks, added, table))
        records += tuple(_float_joins(index, marks))
        if fine:  # calibrated ranges; a QAT model learned its weights through every rounding: all kept
            conv_points = {p.node: p.tensor for p in points}
            found, weights, decisions = _round_trips(index, marks, placement, conv_points)
            records += tuple(found)
            placement = replace(placement, weights=weights, decisions=decisions)
        order = index.production_order()
        activations = tuple(sorted(marks.values(), key=lambda m: (order.get(m.tensor, len(order)), m.tensor)))
        zero_points, note = _zero_points(index, activations, points, records, nonnegative, fine)
        notes += [note] if note else []
        own = {p.tensor: r["amax"] for p, r in zip(points, records) if r["status"] == "added"}
        range_scales, note = _asymmetric(activations, zero_points, {**amaxes, **own}, table, points, records)
        notes += [note] if note else []
        new_placement = Placement(activations, placement.weights, placement.decisions, tuple(notes))
        new_table = table if not added else table.merged(
            ScaleTable(added, producer=table.producer, metadata=dict(table.metadata),
                       bounds={k: b for k, b in table.bounds.items()  # a point with its own range
                               if k in added and table.activations.get(k) == added[k]}))
        full = _full_range(activations, zero_points) if fine else ()
        unsigned = _unsigned_weights(placement, activations, zero_points)
        narrow: Tuple[str, ...] = ()
        if fine:  # calibrated: uint8 x int8 kernels, 7-bit weights where pair sums are 16-bit (fast, exact)
            narrow = () if vnni else _narrow_weights(index, placement)
            unsigned = ()
        splits = bias_splits(index, placement)
        records = _with_folds(records, folds) + tuple(s.record() for s in splits)
        return Adapted(new_placement, new_table, records, zero_points, unsigned, folds, full, splits, narrow,
                       range_scales)

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
                             "keeps a float output in onnxruntime (give calibration data, or a ScaleTable "
                             "from 'onnx-qat calibrate --target ort-cpu', to requantize it)")
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


def _quantize_gates(index: GraphIndex, marks: Dict[str, ActivationMark], added: Dict[str, float],
                    table: ScaleTable) -> List[dict]:
    """Rule CPU5: Sigmoid gates on onnxruntime's integer kernels, in ``marks``/``added``; one report record
    each.

    A ``Mul(x, Sigmoid(s))`` (swish when ``s`` is ``x``, as EfficientNet writes it; a squeeze-excitation
    scale otherwise) whose output is quantized for every consumer, and whose ``x`` and ``s`` are quantized
    (a placement mark or a requantization point), otherwise runs in float between a DequantizeLinear and a
    QuantizeLinear: measured on EfficientNetB0, that float work cost more than its integer Convs saved.
    Quantizing the Sigmoid output too (range 0..1, zero point 0) and letting ``x`` and ``s`` reach the
    Sigmoid and the Mul through their one Q/DQ pair gives onnxruntime's QDQ fusions ``DQ -> Sigmoid -> Q``
    (``QLinearSigmoid``, a lookup table) and ``DQ, DQ -> Mul -> Q`` (``QLinearMul``): the chain stays in
    uint8 from Conv to Conv (source: onnxruntime's QDQ selector-action transformer registers Sigmoid as a
    unary and Mul as a binary QDQ node unit, ``qdq_selector_action_transformer.cc``)."""
    records: List[dict] = []
    while True:  # a gate may make another one's output quantized for every consumer: until none is new
        found = _gates_once(index, marks, added, table)
        if not found:
            return records
        records += found


def _gates_once(index: GraphIndex, marks: Dict[str, ActivationMark], added: Dict[str, float],
                table: ScaleTable) -> List[dict]:
    """One pass of `_quantize_gates` over the graph: the gates quantized in it."""
    records = []
    for node in index.nodes:
        if node.op_type != "Mul" or not node.standard or len(node.inputs) != 2 or not node.outputs:
            continue
        out = node.outputs[0]
        mark = marks.get(out)
        readers = {(n.name, i) for n, i in index.consumers(out)}
        if mark is None or set(mark.consumers) != readers or out in index.graph_outputs:
            continue
        for position in (0, 1):
            gate, other = node.inputs[position], node.inputs[1 - position]
            sigmoid = index.producer.get(gate)
            if sigmoid is None or sigmoid.op_type != "Sigmoid" or not sigmoid.standard or gate in marks \
                    or gate in index.graph_outputs or len(index.consumers(gate)) != 1:
                continue
            source = sigmoid.inputs[0]
            if source not in marks or other not in marks:
                continue
            for tensor, reader in ((source, (sigmoid.name, 0)), (other, (node.name, 1 - position))):
                held = marks[tensor]
                if reader not in held.consumers:
                    marks[tensor] = ActivationMark(tensor, held.consumers + (reader,), held.rule, held.reason,
                                                   scale_group=held.scale_group)
            amax = table.activations.get(gate, SIGMOID_AMAX)
            why = (f"Sigmoid {sigmoid.name!r} and Mul {node.name!r} run as QLinearSigmoid and QLinearMul: "
                   "the gate's output quantized (0..1, zero point 0), both inputs read through one Q/DQ")
            marks[gate] = ActivationMark(gate, ((node.name, position),), GATE_RULE, why)
            added[gate] = amax
            records.append({"tensor": gate, "node": node.name, "op_type": "Mul", "rule": GATE_RULE,
                            "status": "quantized gate", "sigmoid": sigmoid.name, "amax": amax,
                            "swish": source == other, "reason": why})
            break
    return records


def _float_joins(index: GraphIndex, marks: Dict[str, ActivationMark]) -> List[dict]:
    """Rule CPU6: the skip inputs of residual joins that run in float in onnxruntime lose their Q/DQ (in
    ``marks``); one report record per join.

    Placement rule 6 quantizes a residual Add's skip input alone so that TensorRT fuses the Add into the
    Conv that computes the other input. onnxruntime's CPU provider has no such fusion: it runs an Add on
    integers only as ``QLinearAdd``, with every input dequantized and the output quantized. When no other
    input of the join is quantized (a transformer's residual stream: ``x + (MatMul -> bias Add)``), the
    join runs in float anyway, and the skip's Q/DQ pair only rounds the residual stream, which carries the
    model's largest values: measured on a ViT encoder built in code (random weights, images 0..255), the
    output error fell from 1.13x onnxruntime's own form's to 0.03x without those pairs. A skip input that
    also feeds a quantized op keeps its pair there."""
    records = []
    for tensor, mark in list(marks.items()):
        if mark.rule not in _JOIN_RULES:
            continue
        keep, dropped = [], []
        for name, position in mark.consumers:
            join = index.by_name.get(name)
            found = join.inputs if join is not None else ()
            inputs = [(i, t) for i, t in enumerate(found) if i != position and t]
            quantized = any(t in marks and (name, i) in marks[t].consumers for i, t in inputs)
            (keep if quantized or not inputs else dropped).append((name, position))
        if not dropped:
            continue
        if keep:
            marks[tensor] = ActivationMark(tensor, tuple(keep), mark.rule, mark.reason, mark.scale_group)
        else:
            del marks[tensor]
        for name, _ in dropped:
            why = (f"residual join {name!r} has no other quantized input, so onnxruntime runs it in float: "
                   f"the Q/DQ pair on its skip input {tensor!r} (placement rule {mark.rule}, a TensorRT "
                   "fusion) is left out")
            records.append({"tensor": tensor, "node": name, "op_type": index.by_name[name].op_type,
                            "rule": JOIN_RULE, "status": "left float", "reason": why})
    return records


#: Ops onnxruntime's CPU provider runs on integers, by the QDQ node unit each forms (source: onnxruntime
#: ``onnxruntime/core/optimizer/qdq_transformer/selectors_actions/qdq_selector_action_transformer.cc``):
#: ops that only move data, their DequantizeLinear/QuantizeLinear dropped ("drop" rules; Split has its own);
_MOVE_OPS = ("Expand", "Flatten", "Gather", "GatherElements", "Reshape", "Slice", "Squeeze", "Tile",
             "Transpose", "Unsqueeze", "MaxPool", "ReduceMax", "ReduceMin", "Resize", "Split")
#: one input, a QLinear* kernel ("1DQ"); two inputs ("2DQ", CPU only); any number of inputs ("*DQ").
_UNARY_OPS = ("AveragePool", "LeakyRelu", "GlobalAveragePool", "Sigmoid", "Softmax")
_BINARY_OPS = ("Add", "Mul")
#: Readers of a tensor's shape alone: onnxruntime folds them where the shape is static, so they do not keep
#: a node unit from forming (counting them as absent is the safe side: a pair is then kept).
_SHAPE_READERS = ("Shape", "Size")
#: The weighted ops with an integer kernel there (QLinearConv, MatMulIntegerToFloat/QLinearMatMul, QGemm):
#: ``WEIGHTED_OPS`` less ConvTranspose, which that provider runs in float on dequantized values.
INTEGER_WEIGHTED_OPS = ("Conv", "MatMul", "Gemm")
#: Rule name of a Q/DQ pair no integer kernel of onnxruntime's CPU provider reads (see `_round_trips`).
ROUND_TRIP_RULE = "CPU8"


def _integer_unit(node, index: GraphIndex, marks: Dict[str, ActivationMark], weighted, points) -> bool:
    """True when onnxruntime's CPU provider runs ``node`` as an integer kernel with the Q/DQ pairs of
    ``marks`` (and the quantized weights ``weighted``, ``(node, input index)`` pairs): every input its
    QDQ node unit needs comes from a DequantizeLinear and, for the ops that need it, every reader of its
    output reads a QuantizeLinear (a graph output, or a float reader beside the QuantizeLinear, leaves it
    in float; a Shape or Size reader does not count). onnxruntime also moves a QuantizeLinear up and a
    DequantizeLinear down through ops that only move data (its QDQ propagation), so a quantized tensor
    one such op away counts too. ``points``: the tensor each Conv with a requantization point writes
    (after a scale fold, rule CPU2, the fold's output). Ops that only move data count as integer whenever
    input and output are quantized (their selector also asks for equal scales). Each approximation
    errs on the side of an integer unit: a pair is then kept."""
    if not node.standard or not node.outputs:
        return False

    def reads(position: int) -> bool:
        if (node.name, position) in weighted:
            return True
        tensor = node.inputs[position] if position < len(node.inputs) else ""
        mark = marks.get(tensor) if tensor else None
        if mark is not None and (node.name, position) in mark.consumers:
            return True
        mover = index.producer.get(tensor) if tensor else None
        return mover is not None and mover.op_type in _MOVE_OPS and bool(mover.inputs) \
            and mover.inputs[0] in marks

    def written(outputs=node.outputs) -> bool:
        for tensor in outputs:
            if not tensor:
                continue
            mark = marks.get(tensor)
            held = set(mark.consumers) if mark is not None else set()
            if tensor in index.graph_outputs:
                return False
            for reader, position in index.consumers(tensor):
                if reader.op_type in _SHAPE_READERS or (reader.name, position) in held:
                    continue
                if reader.op_type in _MOVE_OPS and reader.outputs and reader.outputs[0] in marks:
                    continue
                return False
        return True

    op = node.op_type
    if op in ("MatMul", "Gemm"):
        return reads(0) and reads(1)
    if op == "Conv":
        return reads(0) and reads(1) and node.name in points and written((points[node.name],))
    if op in _MOVE_OPS or op in _UNARY_OPS:
        return reads(0) and written()
    if op == "ArgMax":
        return reads(0)
    if op in _BINARY_OPS:
        return len(node.inputs) == 2 and reads(0) and reads(1) and written()
    if op == "Concat":
        return all(reads(i) for i in range(len(node.inputs))) and written()
    if op == "Where":
        return len(node.inputs) == 3 and reads(1) and reads(2) and written()
    return False


def _round_trips(index: GraphIndex, marks: Dict[str, ActivationMark], placement: Placement,
                 points: Dict[str, str]) -> Tuple[List[dict], Tuple, Tuple]:
    """Rule CPU8: the Q/DQ pairs that no integer kernel of onnxruntime's CPU provider reads are left out
    (in ``marks``; ``points``: the tensor each Conv's requantization point quantizes, by Conv name);
    returns one report record per tensor or site left float, and the placement's weights
    and decisions without the sites left float.

    The TensorRT placement quantizes tensors for TensorRT's fusions: the input of a pooling, of a
    ConvTranspose, of an op whose neighbours a latency placement (rule CPU3) keeps float. onnxruntime
    runs an op on integers only as a QDQ node unit (`_integer_unit`); a QuantizeLinear that neither
    closes such a unit (its producer's) nor opens one (a reader's) stays a float QuantizeLinear followed
    by a float DequantizeLinear: two passes over the tensor and its rounding, for nothing (measured on
    the PP-OCRv4 detector with 59 of its 62 Convs kept float: 10 such pairs before its squeeze-excitation
    poolings cost 5% of its time at batch 8). So:

    * a ConvTranspose (no integer kernel on that provider) is left float, weight and input;
    * a quantized tensor is left float when its producer is no integer unit closed by its
      QuantizeLinear and none of its quantized readers is an integer unit. A requantization point
      (rule CPU1) is kept (a Relu after it whose output is left out then runs in float on its
      dequantized output, as it did beside such a pair), and so is the input of a quantized weighted op
      (check rule C9: a weight is never quantized alone; a Conv without a requantization point, e.g.
      one writing a graph output, runs in float there with both pairs, as before)."""
    records: List[dict] = []
    float_sites = tuple(dict.fromkeys(
        w.node for w in placement.weights
        if index.by_name.get(w.node) is not None
        and index.by_name[w.node].op_type not in INTEGER_WEIGHTED_OPS))
    for name in float_sites:
        node = index.by_name[name]
        for tensor in dict.fromkeys(t for t in node.inputs if t in marks):
            mark = marks[tensor]
            readers = tuple(c for c in mark.consumers if c[0] != name)
            if len(readers) == len(mark.consumers):
                continue
            if readers:
                marks[tensor] = ActivationMark(tensor, readers, mark.rule, mark.reason, mark.scale_group)
            else:
                del marks[tensor]
        why = (f"{node.op_type} {name!r} has no integer kernel in onnxruntime's CPU provider (it would run "
               "in float on dequantized values): its weight and input are left float")
        records.append({"tensor": node.inputs[0] if node.inputs else "", "node": name,
                        "op_type": node.op_type, "rule": ROUND_TRIP_RULE, "status": "left float",
                        "reason": why})
    weights = tuple(w for w in placement.weights if w.node not in float_sites)
    decisions = tuple(Decision(d.node, d.op_type, "skip", ROUND_TRIP_RULE, next(
        r["reason"] for r in records if r["node"] == d.node)) if d.node in float_sites else d
        for d in placement.decisions)
    weighted = {(w.node, w.input_index) for w in weights}
    written = set(points.values())
    sited = {w.node for w in weights}
    drop = []
    for tensor, mark in marks.items():
        if tensor in written or _closed_by(tensor, index, marks, weighted, points):
            continue
        if any(n in sited for n, _ in mark.consumers):  # a quantized weight is never read alone (rule C9)
            continue
        if any(_integer_unit(index.by_name[n], index, marks, weighted, points) for n, _ in mark.consumers
               if n in index.by_name):
            continue
        drop.append(tensor)
    for tensor in drop:  # each left out is read by float ops only and written by one: no unit changes
        mark = marks.pop(tensor)
        readers = ", ".join(sorted({n for n, _ in mark.consumers}))
        why = (f"no integer kernel of onnxruntime's CPU provider reads or writes {tensor!r} (read by "
               f"{readers}): its Q/DQ pair (placement rule {mark.rule}, for TensorRT) would run as a float "
               "QuantizeLinear and DequantizeLinear, so it is left out")
        producer = index.producer.get(tensor)
        records.append({"tensor": tensor, "node": producer.name if producer is not None else tensor,
                        "op_type": producer.op_type if producer is not None else "input",
                        "rule": ROUND_TRIP_RULE, "status": "left float", "reason": why})
    return records, weights, decisions


def _closed_by(tensor: str, index: GraphIndex, marks: Dict[str, ActivationMark], weighted, points) -> bool:
    """True when the QuantizeLinear on ``tensor`` closes an integer unit: its producer's (an op that only
    moves data counts when its input is quantized too, see `_integer_unit`)."""
    node = index.producer.get(tensor)
    return node is not None and _integer_unit(node, index, marks, weighted, points)


def _zero_points(index: GraphIndex, activations, points, records, nonnegative: Tuple[str, ...] = (),
                 fine: bool = False) -> Tuple[Dict[str, int], str]:
    """Zero point per quantized tensor, and a report note.

    0 for non-negative tensors (`_nonnegative`, and the graph inputs in ``nonnegative``) and for
    the requantization points that take the scale of such a tensor (their values reach it through Relu
    or Clip, so clamping at 0 is exact there and onnxruntime then joins the two Q/DQ pairs into one
    ``QLinearConv`` output); 128 otherwise.
    """
    known = set(nonnegative) & set(index.graph_inputs)
    zero_points = {m.tensor: (0 if m.tensor in known or _nonnegative(m.tensor, index) else 128)
                   for m in activations}
    count = sum(1 for zp in zero_points.values() if zp == 0)
    joined = 0
    for point, record in zip(points, records):
        source = point.scale_from
        if source is not None and source not in zero_points:  # its pair left out (rule CPU8)
            source_zero_point = 0 if source in known or _nonnegative(source, index) else 128
        else:
            source_zero_point = zero_points.get(source) if source is not None else None
        if record["status"] == "added" and source is not None and source_zero_point == 0:
            zero_points[point.tensor] = 0
            joined += 1
    note = ""
    if (count or joined) and fine:
        inputs = f" (graph inputs >= 0 on the calibration data: {', '.join(sorted(known))})" if known else ""
        note = (f"ort-cpu: {count} non-negative tensor(s){inputs} and {joined} requantization point(s) "
                "taking the scale of one use uint8 zero point 0 over the whole grid 0..255 (calibrated "
                "ranges: scale amax / 255, twice as fine as the tensorrt form's, the same clamp at amax; "
                "Concat groups mixing signs keep amax / 127)")
    elif count or joined:
        note = (f"ort-cpu: {count} non-negative tensor(s) and {joined} requantization point(s) taking "
                "the scale of one use uint8 zero point 0: the same values as the tensorrt form up to the "
                "tensor's amax; above it values are kept (up to 255/127 x amax) instead of clamped")
    return zero_points, note


def asymmetric_range(amax: float, low: float, high: float) -> Optional[Tuple[float, int]]:
    """``(scale, zero point)`` of the uint8 grid over a tensor's calibrated extremes ``low..high`` clipped
    to ``[-amax, amax]`` (what the symmetric range keeps) and widened to hold 0, as onnxruntime's
    ``quantize_static`` computes a uint8 activation's range (``compute_scale_zp`` in
    ``onnxruntime/python/tools/quantization/quant_utils.py``: ``rmin = min(rmin, 0)``, ``rmax = max(rmax,
    0)``, ``scale = (rmax - rmin) / 255``, ``zero_point = round(-rmin / scale)``); None when that range is
    empty or its scale too small for float32."""
    from ..formats.encoding import TINY

    lo = min(max(float(low), -float(amax)), 0.0)
    hi = max(min(float(high), float(amax)), 0.0)
    scale = np.float32((hi - lo) / 255.0)
    if not hi > lo or not np.isfinite(scale) or scale < TINY:
        return None
    zero = int(np.clip(np.round(-lo / float(scale)), 0, 255))
    return float(scale), zero


def _asymmetric(activations, zero_points: Dict[str, int], amaxes, table: ScaleTable, points,
                records) -> Tuple[Dict[str, float], str]:
    """``{tensor: scale}`` of the zero-point-128 tensors whose calibrated extremes are in ``table.bounds``,
    stored over `asymmetric_range` instead
    (their new zero points are written into ``zero_points``), and a report note. A scale group (Concat
    inputs, rule 7) takes the range of all its members' extremes together, only when every member has
    extremes and zero point 128; a requantization point that takes the scale of such a tensor
    (``scale_from``) takes its zero point too, so onnxruntime still joins the two Q/DQ pairs."""
    bounds = table.bounds
    if not bounds:
        return {}, ""
    follows = {p.tensor for p, r in zip(points, records)
               if r["status"] == "added" and p.scale_from is not None}
    groups: Dict[str, List[ActivationMark]] = {}
    for mark in activations:
        if mark.tensor in follows:
            continue  # takes the scale (and zero point) of the tensor it reaches, below
        groups.setdefault(mark.scale_group or f"\0{mark.tensor}", []).append(mark)
    chosen: Dict[str, Tuple[float, int]] = {}
    for members in groups.values():
        names = [m.tensor for m in members]
        if any(zero_points.get(n) != 128 or n not in bounds or n not in amaxes for n in names):
            continue
        amax = max(amaxes[n] for n in names)
        found = asymmetric_range(amax, min(bounds[n][0] for n in names), max(bounds[n][1] for n in names))
        if found is not None:
            chosen.update({n: found for n in names})
    for point, record in zip(points, records):
        if record["status"] == "added" and point.scale_from in chosen:
            chosen[point.tensor] = chosen[point.scale_from]
    for name, (_, zero) in chosen.items():
        zero_points[name] = zero
    if not chosen:
        return {}, ""
    note = (f"ort-cpu: {len(chosen)} tensor(s) of unknown sign use an asymmetric uint8 range from their "
            "calibrated extremes (the table's bounds) clipped to [-amax, amax] and holding 0: scale "
            "(max - min) / 255 and the zero point that puts 0 on the grid, as onnxruntime's own "
            "quantize_static does")
    return {name: scale for name, (scale, _) in chosen.items()}, note


def _full_range(activations, zero_points) -> Tuple[str, ...]:
    """Tensors with zero point 0 stored over the whole uint8 grid (scale ``amax / 255``); a tensor of a
    scale group (Concat inputs, rule 7) only when every tensor of its group has zero point 0, so the
    group keeps one scale."""
    mixed = {m.scale_group for m in activations if m.scale_group and zero_points.get(m.tensor) != 0}
    return tuple(m.tensor for m in activations
                 if zero_points.get(m.tensor) == 0 and (not m.scale_group or m.scale_group not in mixed))


def _narrow_weights(index: GraphIndex, placement: Placement) -> Tuple[str, ...]:
    """Weights of GEMM-kernel ops (every quantized Conv, Gemm, MatMul but depthwise Convs) stored in
    [-63, 63], for CPUs whose int8 dot products do not sum in 32 bits: onnxruntime's uint8 x int8 kernels
    there add pairs of products in 16 bits with saturation (``vpmaddubsw``, AVX2 and AVX-512 without
    VNNI), and 2 x 255 x 63 = 32130 < 2**15 cannot saturate, whatever the input's zero point; uint8
    ``q + 128`` for the uint8 x uint8 kernel would be exact too, but slower. Depthwise Convs (one input
    channel per group) keep [-127, 127]: onnxruntime's depthwise kernel sums in 32 bits.

    Inputs with zero point 0 (Relu outputs over the whole uint8 grid) need it as much as zero-point-128
    ones: measured on onnxruntime's AVX2 kernels (``cpu_models_avx2``, docs/performance.md), 8-bit
    weights behind them raised the mean output error of Keras ResNet50 from 0.00085 (the same integers
    in exact arithmetic) to 0.0040, of MobileNetV2 from 0.0015 to 0.0040, of EfficientNetB0 from 0.0031
    to 0.0097; with every weight in 7 bits the kernels' error equals the exact arithmetic's (0.0011,
    0.0018, 0.0033). onnxruntime's quantization guide gives its ``reduce_range`` (7-bit weights) for the
    same CPUs."""
    return tuple(sorted({w.tensor for w in placement.weights if not _depthwise(index, w.node, w.tensor)}))


def _depthwise(index: GraphIndex, node: str, weight: str) -> bool:
    """True for a Conv with one input channel per group and more than one group."""
    info = index.by_name.get(node)
    shape = index.constant_shape(weight)
    return (info is not None and info.op_type == "Conv" and shape is not None and len(shape) >= 3
            and shape[1] == 1 and int(info.attr("group", 1)) > 1)


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
    """True when ``tensor`` is a Relu output or the output of a Clip with a constant lower bound >= 0
    (ReLU6), directly or through `SIGN_PRESERVING_OPS` or Pads with constant zeros."""
    for _ in range(_MAX_LOOKAHEAD):
        node = index.producer.get(tensor)
        if node is None or not node.standard or not node.inputs:
            return False
        if node.op_type in ("Relu", "Sigmoid"):
            return True
        if node.op_type == "Clip":
            bounds = _clip_bounds(node, index)
            return bounds is not None and bounds[0] >= 0.0
        if node.op_type not in SIGN_PRESERVING_OPS and not _zero_pad(node, index):
            return False
        tensor = node.inputs[0]
    return False


def _clip_bounds(node, index: GraphIndex) -> Optional[Tuple[float, float]]:
    """``(min, max)`` of a Clip whose bounds are constants (inputs since opset 11, attributes before;
    an absent bound is -inf / +inf); None when a bound is computed at run time."""
    if node.op_type != "Clip":
        return None
    if len(node.inputs) == 1 and (node.attr("min") is not None or node.attr("max") is not None):
        return float(node.attr("min", -np.inf)), float(node.attr("max", np.inf))
    bounds = [-np.inf, np.inf]
    for position in (1, 2):
        name = node.inputs[position] if len(node.inputs) > position else ""
        if not name:
            continue
        proto = index.constant_proto(name)
        if proto is None:
            return None
        from onnx import numpy_helper

        value = numpy_helper.to_array(proto).reshape(-1)
        if value.size != 1 or not np.isfinite(value[0]):
            return None
        bounds[position - 1] = float(value[0])
    return bounds[0], bounds[1]


def _exact_op(node, index: GraphIndex) -> bool:
    """True for ops that commute exactly with quantization at one scale: `EXACT_OPS`, Pads
    with constant zeros, and Clips with constant bounds (clamping the dequantized integers to
    ``[lo, hi]`` and quantizing again gives the integers of the clamped float value)."""
    return node.op_type in EXACT_OPS or _zero_pad(node, index) or _clip_bounds(node, index) is not None


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
    """The first quantized tensor after ``tensor`` along a single-consumer chain of ops that commute
    exactly with quantization (`_exact_op`)."""
    for _ in range(_MAX_LOOKAHEAD):
        consumers = index.consumers(tensor)
        if tensor in index.graph_outputs or len(consumers) != 1:
            return None
        node, position = consumers[0]
        exact = node.standard and _exact_op(node, index)
        if not exact or position != 0 or not node.outputs or not node.standard:
            return None
        tensor = node.outputs[0]
        if tensor in marked:
            return tensor
    return None


# --------------------------------------------------------------------------- scale folds (CPU2)
def _with_folds(records: Tuple[dict, ...], folds: Tuple[ScaleFold, ...]) -> Tuple[dict, ...]:
    """The point records with each fold's record just before the record of the same Conv."""
    by_node = {f.node: f for f in folds}
    merged = []
    for record in records:
        fold = by_node.pop(record["node"], None)
        merged += [fold.record(), record] if fold is not None else [record]
    merged += [f.record() for f in folds if f.node in by_node]  # a fold without a point (output unused)
    return tuple(merged)


def _scale_fold(node, index: GraphIndex, weights, marked) -> Optional[ScaleFold]:
    """The fold for Conv ``node`` (see `ScaleFold`), or None when something does not fit:
    the weight is not a float32 initializer quantized per output channel (or per tensor) read by this
    Conv only; the bias is not a float32 ``[C]`` initializer; the output does
    not feed exactly one Mul by a constant per-channel vector; a tensor in between is quantized."""
    mark = weights.get((node.name, 1))
    if not node.standard or mark is None or mark.axis not in (0, None) or len(node.inputs) < 2 \
            or not node.outputs:
        return None
    # The output feeding a single Mul is checked first: most Convs have none, and then no weight
    # or bias TensorProto is read.
    step = single_consumer(node.outputs[0], ("Mul",), index, marked)
    if step is None:
        return None
    weight = node.inputs[1]
    proto = index.constant_proto(weight) if index.is_stored_constant(weight) else None  # edited in place
    if proto is None or proto.data_type != _FLOAT or len(proto.dims) < 3 or len(index.consumers(weight)) != 1:
        return None
    channels, rank = int(proto.dims[0]), len(proto.dims)
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    if bias and not _own_bias(node, bias, index, weights, channels):
        return None
    k = channel_vector(step[0], step[1], index, channels, rank)
    if k is None or not usable_factors(k):
        return None
    mul = step[0]
    tail, add, b = mul, None, np.zeros(channels, np.float32)
    step = single_consumer(mul.outputs[0], ("Add",), index, marked)
    found = None if step is None else channel_vector(step[0], step[1], index, channels, rank)
    if found is not None:
        tail, add, b = step[0], step[0].name, found
    return ScaleFold(node.name, weight, bias, mul.name, add, tail.outputs[0], k, b)


def _own_bias(node, bias: str, index: GraphIndex, weights, channels: int) -> bool:
    """True when ``bias`` is a float32 ``[C]`` initializer or ``Constant`` output (as Paddle's exporter
    writes biases), not quantized. Other Convs may read it too (an exporter may share one zero bias
    between Convs of the same width): the fold gives its Conv a bias of its own and leaves the shared
    one as it is."""
    proto = index.initializers.get(bias)
    producer = index.producer.get(bias)
    if proto is None and producer is not None and producer.op_type == "Constant" and producer.standard:
        proto = index.constant_proto(bias)
    return (proto is not None and proto.data_type == _FLOAT and tuple(proto.dims) == (channels,)
            and (node.name, 2) not in weights)


def fold_scale_ops(edit, folds) -> Tuple[str, ...]:
    """Fold each `ScaleFold` into its Conv, as edits of ``edit`` (a
    `GraphEdit` after Q/DQ insertion): new weight integers, weight scales
    and bias; the Mul/Add (and Constant nodes only they read) removed; the Conv writes the fold's
    output tensor. A fold whose Conv does not have the expected ``DequantizeLinear`` weight is left
    out with a warning. Returns the Convs folded."""
    if not folds:
        return ()
    readers = edit.readers()
    return tuple(f.node for f in folds if _fold_one(f, edit, readers))


def _fold_one(fold: ScaleFold, edit, readers) -> bool:
    """Apply one fold (see `fold_scale_ops`); False (graph unchanged) when it does not fit."""
    conv, mul = edit.by_name.get(fold.node), edit.by_name.get(fold.mul)
    add = edit.by_name.get(fold.add) if fold.add else None
    parts = _fold_parts(conv, mul, add, fold, edit, readers)
    folded = None if parts is None else _folded_weight(*parts[1], fold.k)
    if folded is None:
        logger.warning("ort-cpu: Conv %r keeps its scale ops (its weight is not the expected "
                       "per-channel DequantizeLinear)", fold.node)
        return False
    dq, _, bias = parts
    (q, scale, zero), per_tensor = folded
    for name, values in zip(dq.input, (q, scale, zero)):
        edit.replace_initializer(name, values)
    if per_tensor:
        dq.attribute.append(_axis_zero())
    old = np.zeros(fold.k.size) if bias is None else bias.astype(np.float64)
    new_bias = (old * fold.k.astype(np.float64) + fold.b.astype(np.float64)).astype(np.float32)
    bias_name = edit.add_initializer(f"{fold.node}_folded_bias", new_bias)
    if len(conv.input) > 2:
        old = edit.producer.get(conv.input[2])
        edit.release_if_unread(initializers=[conv.input[2]],
                               nodes=[old] if old is not None and old.op_type == "Constant" else [])
        conv.input[2] = bias_name
    else:
        conv.input.append(bias_name)
    _unlink(conv, mul, add, edit)
    return True


def _axis_zero():
    import onnx

    return onnx.AttributeProto(name="axis", type=onnx.AttributeProto.INT, i=0)


def _fold_parts(conv, mul, add, fold: ScaleFold, edit, readers):
    """``(weight DequantizeLinear, (q, scale, zero point, axis or None), bias values or None)`` when
    the graph still has the fold's chain ``DQ(w) -> Conv -> Mul [-> Add]`` with initializer DQ inputs
    and single readers; else None."""
    if conv is None or mul is None or (fold.add and add is None) or len(conv.input) < 2:
        return None
    weight, out = conv.input[1], conv.output[0]
    dq = edit.producer.get(weight)
    tail = add if add is not None else mul

    def only_reader(tensor, node):
        found = readers.get(tensor, [])
        return len(found) == 1 and found[0][0] is node and tensor not in edit.graph_outputs

    chain = (len(readers.get(weight, [])) == 1 and only_reader(out, mul)
             and (add is None or only_reader(mul.output[0], add)) and tail.output[0] == fold.output)
    if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) != 3 or not chain:
        return None
    protos = [edit.initializer(t) for t in dq.input]
    bias = conv.input[2] if len(conv.input) > 2 and conv.input[2] else None
    bias_proto = None if bias is None else edit.initializer(bias)
    made_by = edit.producer.get(bias) if bias is not None else None
    if bias_proto is None and made_by is not None and made_by.op_type == "Constant":
        bias_proto = edit.constant(bias)[1]  # a Constant node's value
    if any(p is None for p in protos) or (bias is not None and bias_proto is None):
        return None
    from ..io.models import tensor_array

    axis = next((a.i for a in dq.attribute if a.name == "axis"), None)
    q, scale, zero = (tensor_array(p) for p in protos)
    return dq, (q, scale, zero, axis), None if bias_proto is None else tensor_array(bias_proto)


def _folded_weight(q, scale, zero, axis, k: np.ndarray):
    """``((q', scale', zero_point'), was_per_tensor)`` for a weight DequantizeLinear with integers ``q``,
    ``scale``, ``zero`` and attribute ``axis`` (None when absent) folded with ``k``:
    ``q' - zp = sign(k) * (q - zp)``, ``scale' = scale * |k|`` (unchanged where k is 0); None when its
    layout is not per output channel (axis 0) or per tensor, or a value would not fit."""
    q, zero = np.asarray(q), np.asarray(zero)
    scale = np.asarray(scale, np.float32)
    channels = k.size
    per_tensor = scale.size == 1 and zero.size == 1 and (scale.ndim == 0 or axis is None)
    if per_tensor:
        scale = np.full(channels, scale.reshape(()), np.float32)
        zero = np.full(channels, zero.reshape(()), zero.dtype)
    elif (1 if axis is None else int(axis)) != 0 or scale.shape != (channels,) or zero.shape != (channels,):
        return None
    if q.ndim < 1 or q.shape[0] != channels or q.dtype.kind not in "iu":
        return None
    shape = (channels,) + (1,) * (q.ndim - 1)
    sign = np.sign(k).astype(np.int64).reshape(shape)
    zp = zero.astype(np.int64).reshape(shape)
    new_q = (q.astype(np.int64) - zp) * sign + zp
    wide = scale.astype(np.float64)
    new_scale = np.where(k == 0, wide, wide * np.abs(k.astype(np.float64))).astype(np.float32)
    info = np.iinfo(q.dtype)
    if new_q.min() < info.min or new_q.max() > info.max or not np.all(np.isfinite(new_scale)) \
            or not np.all(new_scale > 0):
        return None
    return (new_q.astype(q.dtype), new_scale, zero), per_tensor


def _unlink(conv, mul, add, edit) -> None:
    """Make ``conv`` write the chain's last output and remove the Mul/Add; their constant inputs (and
    the Constant nodes making them) go once nothing else reads them."""
    tail = add if add is not None else mul
    out = tail.output[0]
    for node in (mul, add):
        if node is None:
            continue
        edit.remove(node)
        constants = [t for t in node.input if t and t not in (conv.output[0], mul.output[0])]
        edit.release_if_unread(initializers=[t for t in constants if edit.initializer(t) is not None],
                               nodes=[edit.producer[t] for t in constants
                                      if t in edit.producer and edit.producer[t].op_type == "Constant"])
    conv.output[0] = out
    edit.producer[out] = conv


# --------------------------------------------------------------------------- MatMul + bias (CPU4)
#: Single-input ops that keep their input's rank (walked back to find a MatMul input's rank).
_SAME_RANK_OPS = ("Relu", "Clip", "Sigmoid", "Tanh", "Identity", "Cast", "LeakyRelu", "Elu", "HardSigmoid",
                  "HardSwish", "Softplus", "Neg", "Abs", "Erf", "Gelu")


def bias_splits(index: GraphIndex, placement: Placement) -> Tuple[BiasSplit, ...]:
    """The quantized MatMuls (constant 2-D weight) whose output feeds only an Add of a constant bias
    of ``N`` values, in graph order (see `BiasSplit`)."""
    weighted = {w.node for w in placement.weights if w.input_index == 1}
    marked = {m.tensor for m in placement.activations}
    found = []
    for node in index.nodes:
        if node.op_type != "MatMul" or node.name not in weighted or not node.standard \
                or len(node.inputs) != 2:
            continue
        w_shape = index.constant_shape(node.inputs[1])
        out = node.outputs[0] if node.outputs else ""
        consumers = index.consumers(out) if out else []
        if w_shape is None or len(w_shape) != 2 or out in index.graph_outputs or out in marked \
                or len(consumers) != 1:
            continue
        add, position = consumers[0]
        bias = add.inputs[1 - position] if add.op_type == "Add" and len(add.inputs) == 2 else ""
        b_shape = index.constant_shape(bias) if bias and add.standard else None
        if b_shape is None or not b_shape or any(d != 1 for d in b_shape[:-1]) \
                or b_shape[-1] not in (1, w_shape[1]):
            continue
        rank = _rank(node.inputs[0], index)
        if rank != 2 and len(b_shape) != 1:
            continue  # a bias of rank >= 2 already stays out of the fusion on inputs of rank >= 3
        found.append(BiasSplit(node.name, add.name, bias, rank == 2))
    return tuple(found)


def _rank(tensor: str, index: GraphIndex) -> Optional[int]:
    """The rank of ``tensor`` when the graph declares it (a value_info shape, as paddle2onnx writes them)
    or its producer says it (Flatten, Gemm: 2; Reshape to a constant shape), through ops that keep the
    rank; else None."""
    for _ in range(_MAX_LOOKAHEAD):
        declared = index.declared_rank(tensor)
        if declared is not None:
            return declared
        node = index.producer.get(tensor)
        if node is None or not node.standard or not node.inputs:
            return None
        if node.op_type in ("Flatten", "Gemm"):
            return 2
        if node.op_type == "Reshape" and len(node.inputs) > 1:
            shape = index.constant_shape(node.inputs[1])
            return None if shape is None or len(shape) != 1 else int(shape[0])
        if node.op_type not in _SAME_RANK_OPS:
            return None
        tensor = node.inputs[0]
    return None


def split_bias_adds(edit, splits) -> Tuple[str, ...]:
    """Apply each `BiasSplit` to ``edit`` (after Q/DQ insertion): the MatMul becomes a Gemm,
    or its Add reads a ``[1, N]`` copy of the bias. Returns the MatMuls changed."""
    done = []
    for split in splits:
        matmul, add = edit.by_name.get(split.node), edit.by_name.get(split.add)
        if matmul is None or add is None or matmul.op_type != "MatMul":
            continue
        if split.as_gemm:
            matmul.op_type = "Gemm"
        else:
            values, chain = None, ()
            if split.bias in add.input:
                try:  # an initializer, or a Constant node's output (as paddle2onnx writes biases)
                    values, _, chain = edit.constant(split.bias)
                except ValueError:
                    pass
            if values is None:
                logger.warning("ort-cpu: bias %r of %r is not a constant; MatMulAddFusion may fuse it",
                               split.bias, split.add)
                continue
            name = edit.add_initializer(f"{split.bias}_row", np.asarray(values).reshape(1, -1))
            position = list(add.input).index(split.bias)
            add.input[position] = name
            # the rank-1 bias (and the Constant/Identity nodes making it) go once nothing else reads it
            edit.release_if_unread(initializers=[t for t in (split.bias, *(i for n in chain for i in n.input))
                                                 if edit.initializer(t) is not None], nodes=chain)
        done.append(split.node)
    return tuple(done)


__all__ = ["OrtCpuAdapter", "Adapted", "asymmetric_range", "RequantPoint", "ScaleFold", "BiasSplit",
           "fold_scale_ops",
           "bias_splits", "split_bias_adds", "REQUANT_OPS", "EXACT_OPS"]
