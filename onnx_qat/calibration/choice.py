"""``auto``'s choice: the candidate table whose quantized model's output is closest to the float model's.

A tensor's own quantization error does not say what its range does to the output (clipping a few
large values can cost more downstream than their share of the error shows, and the errors of many
tensors add up). So `collect` gives ``auto``'s two candidate tables
from its one pass -- ``max`` everywhere and each tensor's least-error candidate -- with the float
model's outputs on the calibration batches holding the first
`CHECK_SAMPLES` samples. `choose` judges them with the
model and placement its caller already holds (the rewrite behind
[`onnx_qat.quantize`][onnx_qat.quantize.quantize], or
[`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate]):

* one Q/DQ model: the placement's main-graph marks inserted by the one inserter
  (`onnx_qat.insertion.inserter.insert_qdq_pairs`) into a copy of the model, each activation pair's
  scale a graph input instead of a constant and its zero point one initializer per value (the pairs
  made so by the inserter, ``scale_inputs``, all at once from its templates as wire bytes), and each
  constant int8/uint8 weight's DequantizeLinear computed once into a float32 initializer (the same for
  every table; the small INT8 weights quantized and dequantized in batches, without a
  DequantizeLinear made for each, `judge_model`);
* one set of sessions for it, piece by piece (`onnx_qat.runtime.chunked.ChunkedSession`: their cost
  grows linearly with the graph), graph optimisations off: exact Q/DQ arithmetic, as TensorRT
  computes it;
* one run per table on the check batches, the table's scales bound as inputs once per table
  (`ChunkedSession.bind`).

Tables that hold the same ranges everywhere are not judged: their runs would be the same, and the
first (``max``) is kept.

Large graphs are judged on fewer samples (`judge_samples`): each judged sample costs one run of the
whole Q/DQ model per table, so the samples are bounded by `JUDGE_NODE_SAMPLES` (nodes x samples),
never fewer than `MIN_JUDGE_SAMPLES` (8, the paired rule's minimum); every model up to 625 nodes
keeps all 64. Above 5,000 nodes they are judged in two rounds: every table on the first
`first_judge_samples` (at least `FIRST_JUDGE_SAMPLES`, 4), the rest only when a later table leads
``max``'s output cosine there (else ``max`` is kept with a note, at the cost of 4 judged samples;
where a table leads, all 8 are run and the paired rule decides as in one round).

The tables are taken in order -- ``max``, then the per-tensor table -- and a later
table replaces the one kept only when its worst-output cosine is higher **and** the samples agree
(`beats`): the per-sample output errors of the two tables (each sample's squared error over the
outputs, as a share of each output's energy: the terms the cosine sums) must differ by more than
`EVIDENCE` standard errors of their mean. On few samples one or two of them decide a cosine: on the
PP-OCR angle classifier (16 calibration lines) ``entropy`` everywhere, a third table until
2026-11-27, led the per-tensor table 0.9846 to 0.9806 by two lines alone (each table closer on about
half of the lines) and trailed both it and ``max`` on the evaluation lines; such a lead is noise, and
the table kept before it stays.

The paired rule needs at least `MIN_PAIRED_SAMPLES` (8) per-sample errors (samples, or check batches
when the outputs do not lead with the batch axis): its standard error, estimated from fewer, is
itself noise, and a lead of two standard errors happens by chance 15% of the time on 2 samples, 7% on
4 and 4% on 8 (Student's t with n - 1 degrees of freedom, against 2.3% for a normal mean). On 2-4
samples the choice between ``max`` and the per-tensor table flipped with input perturbations of
0.1-0.3% in 16 of 72 conditions tried (three small models, four seeds, inputs standardized and scaled
to [0, 255]; three of them are tests/onnx_qat/test_calibration_auto.py's). With fewer errors than that
the first table, ``max`` everywhere, is kept whatever the cosines, and the result says why
(`TableChoice.note`, recorded as the table's ``auto_note``); the cosines are still measured and
recorded.

If branches and Loop/Scan bodies are judged float (their marks are inserted in the final model
only): a model whose quantized activations all sit in them (silero-vad's) keeps each tensor's
least-error candidate, since no table changes what the check runs. The placement given is the one
after calibration, so a branch no batch took is already left out and named in the placement's
notes. A table that cannot be inserted raises: nothing is bypassed silently.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Dict, List, Mapping, NamedTuple, Optional

import numpy as np
import onnx

from ..io.models import cyclic_gc_paused, tensor_array

logger = logging.getLogger(__name__)

#: Samples of the calibration data ``auto``'s candidate tables are judged on (the calibration batches
#: holding them): bounds the cost of the judgement to one quantized run per table on these. Large
#: graphs are judged on fewer (`judge_samples`).
CHECK_SAMPLES = 64
#: Nodes x samples the judgement runs at most per table: 64 samples up to 625 nodes, then fewer, so
#: that the judgement's cost stops growing with the graph's size times the samples (at 10,000 nodes
#: the runs of 64 samples cost more than the calibration pass itself).
JUDGE_NODE_SAMPLES = 40_000
#: Standard errors by which a table's mean per-sample output error must undercut the kept table's
#: (a paired comparison; about 95% confidence for a normal mean).
EVIDENCE = 2.0
#: Per-sample errors the paired rule needs before a later table may replace ``max``: with fewer, the
#: standard error is too uncertain for `EVIDENCE` to mean what it says (a chance lead of two standard
#: errors has probability 0.148 on 2 samples, 0.070 on 4, 0.043 on 8: Student's t), and ``max``
#: everywhere is kept.
MIN_PAIRED_SAMPLES = 8
#: Samples the tables are always judged on (when the calibration data has them): the paired rule's
#: minimum, so that a large graph calibrated on enough samples is still judged.
MIN_JUDGE_SAMPLES = MIN_PAIRED_SAMPLES
#: Samples a graph over 5,000 nodes is judged on first (`first_judge_samples`): only when a later
#: table leads ``max``'s output cosine there are the tables run on the rest of the `judge_samples`, which
#: the paired rule needs; where none leads, ``max`` is kept at the cost of the first samples alone.
FIRST_JUDGE_SAMPLES = 4


class TableChoice(NamedTuple):
    """What `choose` decided: ``best`` (the name of the candidate table kept), ``cosines``
    (``{table name: worst-output cosine}``, empty when no table was run) and ``note`` (why the
    paired rule was set aside, e.g. ``"3 samples judged, fewer than the 8 the paired rule needs"``;
    empty when it decided)."""

    best: str
    cosines: Dict[str, float]
    note: str = ""


def few_samples_note(samples: int) -> str:
    """Why the paired rule cannot decide on ``samples`` per-sample errors, or "" when it can (at least
    `MIN_PAIRED_SAMPLES`): the note of `choose` (``auto``) and of
    `onnx_qat.accuracy.ranges.choose_table` (``--optimize accuracy``'s whole-table step)."""
    if samples >= MIN_PAIRED_SAMPLES:
        return ""
    return (f"{samples} sample{'' if samples == 1 else 's'} judged, fewer than the {MIN_PAIRED_SAMPLES} "
            "the paired rule needs")


def judge_samples(nodes: int) -> int:
    """How many of the first calibration samples the tables of a ``nodes``-node model are judged on:
    `CHECK_SAMPLES` (64), or ``JUDGE_NODE_SAMPLES // nodes`` when fewer, but at least
    `MIN_JUDGE_SAMPLES` (8 from 5,000 nodes on)."""
    return max(MIN_JUDGE_SAMPLES, _bounded_samples(nodes))


def first_judge_samples(nodes: int) -> int:
    """How many of those the tables are run on first: `judge_samples` up to 5,000 nodes (one round),
    ``JUDGE_NODE_SAMPLES // nodes`` but at least `FIRST_JUDGE_SAMPLES` (4) above (at 10,000 nodes and
    over, 4 of the 8)."""
    return min(judge_samples(nodes), max(FIRST_JUDGE_SAMPLES, _bounded_samples(nodes)))


def _bounded_samples(nodes: int) -> int:
    """`CHECK_SAMPLES`, or fewer so that nodes x samples stays within `JUDGE_NODE_SAMPLES`."""
    return min(CHECK_SAMPLES, JUDGE_NODE_SAMPLES // max(int(nodes), 1))


def _batch_rows(values) -> int:
    """How many per-sample errors one check batch's outputs ``values`` count as (`sample_errors`): the
    rows of their leading axis when every output leads with the same one, else 1."""
    leading = {v.shape[0] if v.ndim else None for v in values}
    return (leading.pop() or 1) if len(leading) == 1 else 1


def worst_cosine(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]) -> float:
    """The smallest cosine over the outputs (flattened arrays; two all-zero outputs count as 1), as
    `onnx_qat.runtime.compare.output_figures` measures it (the figure
    `onnx_qat.accuracy.prepared.output_error` reports too): over the values whose reference is finite
    (where the float model overflowed there is nothing to be close to, as in `sample_errors`), a
    non-finite value where the reference is finite a full error (cosine 0)."""
    from ..runtime.compare import output_figures

    return min([1.0] + [output_figures(np.asarray(ref).ravel(), np.asarray(candidate[name]).ravel())["cosine"]
                        for name, ref in reference.items()])


@cyclic_gc_paused()
def choose(model: onnx.ModelProto, placement, calibration, *, target="tensorrt", precision="int8",
           block_size: int = 128) -> TableChoice:
    """The candidate table to keep: a `TableChoice` ``(best, cosines, note)``, ``best`` the name
    of the table, ``cosines`` each table's worst-output cosine, ``note`` why the paired rule did not
    decide (fewer than `MIN_PAIRED_SAMPLES` per-sample errors: ``max`` is kept).

    Args:
        model: the float model (not changed), the one ``placement`` was decided on.
        placement: the placement the tables are inserted with (its main graph).
        calibration: a `Calibration` of ``method="auto"``.
        target, precision, block_size: as for the rewrite (the target's activation dtype and zero
            point, the format's scale rule).

    Raises:
        ScalesError: a table lacks a range for an activation the placement quantizes.

    Python's cyclic garbage collector is paused meanwhile (`onnx_qat.io.models.cyclic_gc_paused`): the
    judge model's edit holds a record of every pair and weight inserted, none of them cyclic garbage.
    """
    from ..runtime.chunked import ChunkedSession

    tables = calibration.candidates
    if not tables:
        raise ValueError("choose() needs the candidate tables of an 'auto' calibration")
    if not calibration.check_feeds or not calibration.reference:
        logger.warning("auto calibration: the model has no float output to judge the tables by; "
                       "keeping each tensor's least-error candidate")
        return TableChoice("tensor", {})
    if not placement.activations:  # every quantized activation sits in an If branch or a Loop/Scan body
        logger.warning("auto calibration: every quantized activation sits in an If branch or a Loop/Scan "
                       "body, which the output check runs float; keeping each tensor's least-error "
                       "candidate")
        return TableChoice("tensor", {})
    first = next(iter(tables))
    if all(table == tables[first] for table in tables.values()):  # the same runs: nothing to judge
        logger.info("auto calibration: every candidate table holds the same ranges; keeping %s", first)
        return TableChoice(first, {})
    judge, scale_inputs = judge_model(model, placement, tables["max"], target=target, precision=precision,
                                      block_size=block_size)
    outputs = list(calibration.reference)
    session = ChunkedSession(judge, outputs, batch_axis=calibration.batch_axis)
    del judge
    energy = output_energy(calibration.reference)
    feeds = tuple(calibration.check_feeds)
    got: Dict[str, Dict[str, List[np.ndarray]]] = {name: {o: [] for o in outputs} for name in tables}
    scale_feeds: Dict[str, Dict[str, np.ndarray]] = {}  # each table's, computed once for both rounds

    def run(name: str, part, until: Optional[int] = None) -> int:
        """Run table ``name`` on the batches of ``part`` (its scales bound once), or only until they
        hold ``until`` per-sample errors (each batch counted by `_batch_rows`); returns
        how many batches were run."""
        if name not in scale_feeds:
            scale_feeds[name] = _scale_feeds(placement, tables[name], scale_inputs, precision)
        session.bind(scale_feeds[name])
        rows = 0
        for count, feed in enumerate(part):
            if until is not None and rows >= until:
                return count
            values = [np.asarray(v) for v in session.run(outputs, feed)]
            for o, value in zip(outputs, values):
                got[name][o].append(value)
            rows += _batch_rows(values)
        return len(part)

    def cosine(name: str) -> float:  # over the batches run so far, against the same part of the reference
        joined = {o: np.concatenate([v.ravel() for v in got[name][o]]) for o in outputs}
        part = {o: np.asarray(calibration.reference[o]).ravel()[:joined[o].size] for o in outputs}
        return worst_cosine(part, joined)

    best = next(iter(tables))
    first = run(best, feeds, until=first_judge_samples(len(model.graph.node)))
    if first < len(feeds):  # a large graph: every table on the first samples, the rest only if one leads
        for name in tables:
            if name != best:
                run(name, feeds[:first])
        cosines = {name: cosine(name) for name in tables}
        if not any(cosines[name] > cosines[best] for name in tables):
            judged = len(sample_errors(calibration.reference, got[best], energy))
            note = (f"no other table led {best} on the first {judged} judged samples (the paired rule, which "
                    f"needs {MIN_PAIRED_SAMPLES}, was not run)")
            logger.info("auto calibration: %s; keeping %s", note, best)
            return TableChoice(best, cosines, note)
        for name in tables:
            run(name, feeds[first:])
    else:  # one round: every batch (``best`` ran them all already)
        for name in tables:
            if name != best:
                run(name, feeds)
    cosines = {name: cosine(name) for name in tables}
    errors = {name: sample_errors(calibration.reference, got[name], energy) for name in tables}
    samples = min(len(e) for e in errors.values())
    note = few_samples_note(samples)
    if note:  # the paired rule cannot decide: max, whatever the cosines
        logger.info("auto calibration: %s; keeping %s", note, best)
        return TableChoice(best, cosines, note)
    for name in tables:
        if cosines[name] > cosines[best] and beats(errors[name], errors[best]):
            best = name
        elif cosines[name] > cosines[best]:
            logger.info("auto calibration: table %s's output cosine %.5f leads %s's %.5f, but not on most "
                        "samples (paired errors within %g standard errors): keeping %s", name, cosines[name],
                        best, cosines[best], EVIDENCE, best)
    return TableChoice(best, cosines)


def output_energy(reference: Mapping[str, np.ndarray]) -> Dict[str, float]:
    """``{output: its energy}``: what `sample_errors` divides each output's squared errors by.

    An output's energy is the sum of squares (float64) of its finite float values (a NaN or infinite
    reference value, where the float model itself overflowed, says nothing of a table and is left
    out). An output whose energy is zero (a constant-zero output, or one with no finite value) has no
    scale of its own: its squared errors count against the largest energy of the other outputs, so a
    table that makes it non-zero pays for that at the scale of the model's outputs instead of
    swamping every other output (or of 1.0 when every output has zero energy)."""
    own = {}
    for o, ref in reference.items():
        ref = np.asarray(ref, np.float64).ravel()
        finite = ref[np.isfinite(ref)]
        own[o] = float(np.dot(finite, finite))
    fallback = max(own.values(), default=0.0) or 1.0
    return {o: e if e > 0.0 else fallback for o, e in own.items()}


def sample_errors(reference: Mapping[str, np.ndarray], got: Mapping[str, List[np.ndarray]],
                  energy: Mapping[str, float]) -> np.ndarray:
    """Per-sample output errors of one table: ``got[output]`` holds its values per check batch and
    ``reference[output]`` the float values of all batches, flattened and joined. A batch whose
    outputs all lead with the same axis counts one error per row of it (a sample), else one; each
    error is the sum over the outputs of the squared difference divided by that output's energy
    (``energy[output]``, `output_energy`: its reference's sum of squares over all batches, or the
    largest other output's when it is zero). A value whose reference is NaN or infinite adds nothing
    (the float model has no number there to be close to); a non-finite value where the reference is
    finite makes the error infinite."""
    offsets = dict.fromkeys(reference, 0)
    errors: List[np.ndarray] = []
    batches = len(next(iter(got.values()))) if got else 0
    for b in range(batches):
        values = {o: got[o][b] for o in reference}
        rows = _batch_rows(values.values())
        total = np.zeros(rows)
        for o, value in values.items():
            start = offsets[o]
            offsets[o] = start + value.size
            ref = np.asarray(reference[o][start:start + value.size], np.float64)
            usable = np.isfinite(ref)
            diff = np.where(usable, value.astype(np.float64).ravel(), 0.0) - np.where(usable, ref, 0.0)
            total += np.square(diff).reshape(rows, -1).sum(axis=1) / energy[o]
        errors.append(total)
    return np.concatenate(errors) if errors else np.zeros(0)


def beats(errors: np.ndarray, kept: np.ndarray) -> bool:
    """Whether per-sample errors ``errors`` undercut ``kept`` (the same samples) by more than `EVIDENCE`
    standard errors of the mean paired difference; with fewer than two samples, whether their sums do."""
    gain = np.asarray(kept, np.float64) - np.asarray(errors, np.float64)
    if gain.size < 2:
        return bool(gain.sum() > 0)
    spread = float(np.std(gain, ddof=1)) / np.sqrt(gain.size)
    return bool(gain.mean() > EVIDENCE * spread)


def judge_model(model: onnx.ModelProto, placement, table: Mapping[str, float], *, target="tensorrt",
                precision="int8", block_size: int = 128):
    """A copy of ``model`` with ``placement``'s main-graph marks inserted from ``table``, each
    activation pair's scale a float32 scalar graph input, and each constant int8/uint8 weight's
    DequantizeLinear computed once into a float32 initializer: ``(model, {activation tensor: input
    name})``.

    The activation pairs are made in that form by the one inserter (``scale_inputs``: each pair reads
    its scale from ``<tensor>_scale_input`` and one zero-point initializer per value), all at once from
    its per-form templates into an edit holding new nodes as bytes (``GraphEdit(..., encoded=True)``),
    instead of each pair made with its own scale and zero point and then pointed at an input and a
    shared zero point.

    The small INT8 weights whose range comes from their values (all of them on most CNNs) are
    quantized together and dequantized together (`_dequantized_weights`), their marked inputs then
    reading the result: what inserting each weight's DequantizeLinear and computing it
    (`_fold_dequantize_edits`) gives, bit for bit, without a stored weight, scale, zero point and node
    made for each and then dropped. The other weights are inserted and folded so.

    All are edits of the one insertion, made before its commit: the commit then leaves out the
    integer weights nothing reads any more, with no further pass over the model's nodes or
    initializers."""
    from ..graph.edit import GraphEdit
    from ..insertion.inserter import insert_qdq_pairs
    from ..scales import ScaleTable

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    edit = GraphEdit(copy, encoded=True)
    judged = _dequantized_weights(edit, placement, target, precision)
    kept = tuple(m for m in placement.weights if (m.tensor, m.axis) not in judged)
    inserted = insert_qdq_pairs(edit, replace(placement, subgraphs=(), weights=kept),
                                ScaleTable(dict(table)), target, precision=precision, block_size=block_size,
                                scale_inputs=True)
    _use_weights(edit, placement, judged)
    if inserted.weights or any(n.op_type == "DequantizeLinear" for n in edit.nodes):
        _fold_dequantize_edits(edit, edit.live_nodes())
    judge = edit.commit()
    records = inserted.activations
    _add_scalar_inputs(judge.graph, sorted({r["scale_input"] for r in records}))
    return judge, {r["tensor"]: r["scale_input"] for r in records}


def _add_scalar_inputs(graph: onnx.GraphProto, names) -> None:
    """Append a float32 scalar graph input named each of ``names`` to ``graph``: the ValueInfoProtos of
    ``onnx.helper.make_tensor_value_info(name, FLOAT, [])``, parsed in at once from their bytes (its type's
    bytes and each name's) instead of made one message each."""
    from ..graph.wire import field, framed, string

    kind = field(b"\x12", onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, []).type
                 .SerializeToString())
    graph.MergeFromString(framed(b"\x5a", [string(b"\x0a", name) + kind for name in names]))  # field 11


def _dequantized_weights(edit, placement, target, precision) -> Dict[tuple, tuple]:
    """``{(tensor, axis): (dequantized float32 array, its marks, the Constant/Identity nodes making the
    weight)}`` of the weight marks of ``placement``
    (main graph) that the inserter quantizes from their own values in batches
    (`onnx_qat.insertion.inserter.quantize_small_weights`: INT8, small float32 weights; the
    target's ``weight_scale_grid`` as the inserter takes it): each weight's codes times its scale in
    float32, per channel along ``axis`` -- `_dequantized` of the DequantizeLinear the inserter would
    store (int8 codes, zero point 0, the float32 scales, `onnx_qat.formats.encoding.encode_int8`) --
    computed for all weights of one shape at once. Empty for other formats."""
    from ..formats.encoding import INT8_QRANGE
    from ..formats.numeric import INT8, get_format
    from ..insertion.inserter import quantize_small_weights
    from ..insertion.targets import get_target
    from ..scales import ScaleTable

    if get_format(precision) is not INT8 or not placement.weights:
        return {}
    marks: Dict[tuple, list] = {}
    for mark in placement.weights:
        marks.setdefault((mark.tensor, mark.axis), []).append(mark)
    grid = get_target(target).weight_scale_grid == "fp16"
    ready = quantize_small_weights(edit, list(marks), ScaleTable({}), INT8_QRANGE, grid, constants=True)
    shapes: Dict[tuple, list] = {}
    for key, (q, scale, _, constant) in ready.items():
        axis = key[1]
        if axis is None:
            if scale.size != 1:
                continue
            broadcast = ()
        else:
            broadcast = [1] * q.ndim
            broadcast[axis % q.ndim] = -1
            broadcast = tuple(broadcast)
        shapes.setdefault((q.shape, q.dtype, broadcast, scale.size), []).append((key, q, scale, constant[2]))
    judged = {}
    for (shape, _, broadcast, _), items in shapes.items():
        codes = np.stack([q for _, q, _, _ in items]).astype(np.float32)
        scales = np.stack([np.asarray(s, np.float32).reshape(broadcast) for _, _, s, _ in items])
        values = np.multiply(codes, scales, dtype=np.float32)
        for (key, _, _, chain), row in zip(items, values):
            judged[key] = (row, marks[key], chain)
    return judged


def _use_weights(edit, placement, judged: Mapping[tuple, tuple]) -> None:
    """Point each marked input of ``judged`` (`_dequantized_weights`) at a new float32 initializer of
    its dequantized weight, and leave out the float weight (and the Constant/Identity nodes making
    it) once nothing else reads it, as the inserter does for the weights it quantizes."""
    if not judged:
        return
    keys = list(judged)
    names = edit.fresh_names([f"{tensor}_judged" for tensor, _ in keys])
    edit.add_initializers(names, [(np.dtype(np.float32), judged[k][0].tobytes(), judged[k][0].shape)
                                  for k in keys])
    by_name = edit.by_name
    for key, name in zip(keys, names):
        tensor = key[0]
        for mark in judged[key][1]:
            node = by_name[mark.node] if mark.node in by_name else edit.node(mark.node)
            node.input[mark.input_index] = name
        chain = judged[key][2]
        if chain:
            edit.release_if_unread(initializers=[t for n in chain for t in n.input
                                                 if edit.initializer(t) is not None], nodes=chain)
        else:
            edit.release_if_unread(initializers=(tensor,))


#: Integer element types whose DequantizeLinear `_fold_dequantize_edits` computes (int8, uint8).
_FOLDED_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)


def _fold_dequantize_edits(edit, nodes) -> None:
    """Edits of ``edit`` (a `onnx_qat.graph.edit.GraphEdit`) that replace each DequantizeLinear of
    ``nodes`` (its main graph's, `GraphEdit.live_nodes`) whose inputs are constant int8/uint8 values
    (the weights), a float32 scale and a zero point by its float32 result: an initializer of the
    node's output name, the same for every table judged, so computed once instead of in every run,
    and a fifth fewer nodes for the pieces' sessions to build (on the benchmark's residual nets).
    ``(x - zero_point) * scale`` in float32 is the operator's definition, one rounding as onnxruntime
    computes it; blocked (``block_size``) and other element types stay as they are. The node is left
    out (`GraphEdit.remove`: an original node, or a new one the inserter queued, held as bytes or not),
    and the commit leaves out the integer weight, scale and zero point once nothing else reads them."""
    from ..graph.wire import EncodedNode

    folded = []
    for node in nodes:
        if node.op_type != "DequantizeLinear" or node.domain not in ("", "ai.onnx") or \
                edit.initializer(node.input[0]) is None:  # an activation pair's: its input is computed
            continue
        tensors = [edit.initializer(name) if name else None for name in node.input]
        if any(name and tensor is None for name, tensor in zip(node.input, tensors)):
            continue
        proto = node.proto() if type(node) is EncodedNode else node  # its attributes
        if tensors[0].data_type not in _FOLDED_TYPES or tensors[1].data_type != onnx.TensorProto.FLOAT or \
                any(a.name == "block_size" and a.i for a in proto.attribute):
            continue
        folded.append((node, _dequantized(proto, *tensors[:3], *([None] * (3 - len(tensors))))))
    if not folded:
        return
    for node, _ in folded:
        edit.remove(node)
    edit.add_initializers([node.output[0] for node, _ in folded],
                          [(np.dtype(np.float32), result.tobytes(), result.shape) for _, result in folded])
    edit.release_if_unread(initializers=[t for node, _ in folded for t in node.input if t])


def _dequantized(node: onnx.NodeProto, values: onnx.TensorProto, scale: onnx.TensorProto,
                 zero: Optional[onnx.TensorProto]) -> np.ndarray:
    """The float32 output of DequantizeLinear ``node`` on constant ``values``, ``scale`` and ``zero``
    (None: no zero point)."""
    values = tensor_array(values)
    scale = tensor_array(scale)
    zero = tensor_array(zero) if zero is not None else None
    if scale.ndim:  # per axis: the scale and zero point run along ``axis`` (default 1)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1) % values.ndim
        shape = [1] * values.ndim
        shape[axis] = -1
        scale = scale.reshape(shape)
        zero = zero.reshape(shape) if zero is not None and zero.ndim else zero
    if zero is not None and np.any(zero):
        values = values.astype(np.int32) - zero.astype(np.int32)
    return np.multiply(values.astype(np.float32), scale, dtype=np.float32)


def _scale_feeds(placement, amax: Mapping[str, float], scale_inputs: Mapping[str, str],
                 precision) -> Dict[str, np.ndarray]:
    """The scale of every activation pair under table ``amax`` (scale groups share their largest
    range), as the inserter computes it: ``{scale input: float32 scalar}``."""
    from ..formats.numeric import get_format
    from ..insertion.inserter import activation_scales, group_amax
    from ..scales import ScaleTable

    amaxes = group_amax(placement, ScaleTable(dict(amax)))
    tensors = list(scale_inputs)
    scales = activation_scales([amaxes[t] for t in tensors], get_format(precision).qmax)
    return {scale_inputs[t]: np.array(s, dtype=np.float32) for t, s in zip(tensors, scales)}


__all__ = ["TableChoice", "beats", "choose", "few_samples_note", "judge_model", "judge_samples",
           "sample_errors", "worst_cosine"]
