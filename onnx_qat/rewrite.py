"""The rewrite behind [`onnx_qat.quantize`][onnx_qat.quantize.quantize]: float ONNX + ranges -> Q/DQ ONNX.

The pipeline is load -> place (marks only) -> ranges (given ScaleTable or calibration) ->
insert (edits of the protobuf, `onnx_qat.graph.edit`) -> optional save and report.
The caller's model object and input file are never changed.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional, Tuple

import numpy as np
import onnx

from .config import QuantizeConfig
from .errors import ConfigError, PlacementError, ScalesError
from .io.files import check_output_and_report
from .graph.index import GraphIndex, subgraphs_of
from .placement.marks import ActivationMark, Placement
from .placement.policy import policy_for
from .placement.refusals import (QUANTIZED_OPS, model_words, nested_indexes,  # noqa: F401  (re-exported)
                                 refuse_non_finite_weights, refuse_quantized)
from .scales import CALIBRATION_TARGET_KEY, ScaleTable
from .insertion.adapters import make_adapter
from .insertion.targets import Target, get_target
from .formats.numeric import get_format
from .insertion.inserter import without_unreached_branches  # noqa: F401  (re-exported for onnx_qat.quantize)

logger = logging.getLogger(__name__)

REPORT_FORMAT = "onnx-qat-quantize-report"
REPORT_VERSION = 1


@dataclass(frozen=True)
class QuantizeResult:
    """What [`quantize`][onnx_qat.quantize.quantize] produced.

    Attributes:
        model: the Q/DQ ``onnx.ModelProto``.
        scales: the ScaleTable actually used (given, or calibrated).
        placement: every placement decision ([`Placement`][onnx_qat.placement.marks.Placement]).
        target: the deployment target name.
        output: the path written, or None.
        summary: counts (nodes, quantized activations/weights, inserted Q and DQ nodes...).
        inserted: one record per inserted Q/DQ pair or weight DequantizeLinear (rule, reason, scale).
        requantization: one record per requantization point a target adds beyond the placement
            (the ``ort-cpu`` target's Conv outputs; empty for ``tensorrt``).
        precision: the numeric format (``int8``, ``fp8``, ``int4``).
        awq: per-weight-group records of the activation-aware scale search (``int4`` with data).
        gptq: per-weight records of the error-compensating rounding (``int4_method="gptq"``, or
            ``fp8_method="gptq"`` on the E4M3 grid): the
            relative output errors on the calibration data of round to nearest and of GPTQ.
        accuracy: with ``min_cosine``: the sites left float and the output cosine before and after
            (see `onnx_qat.accuracy.mixed`); with ``optimize="accuracy"``: each step's output
            cosine, gain and whether it was kept (see `onnx_qat.accuracy.optimize`); None otherwise.
        float_parts: with ``float_dtype`` ``fp16``/``bf16``: the
            [`FloatPartsResult`][onnx_qat.formats.float_parts.FloatPartsResult] (nodes kept FP32 with their
            reasons, cosines measured); None with FP32 float parts.
        latency: with ``latency`` (``ort-cpu``): every timed site (float and integer microseconds,
            gain, decision), the sites kept float for speed, the profile file, and the whole model
            timed against FP32 (``whole_model``: medians, quartiles, speed-up, verdict, and ``source``:
            ``"measured"`` now or reused from the ``"latency profile"``), and, when that found it
            not faster, what the whole-model guard tried (``fallback``); see
            `onnx_qat.placement.cpu_latency`. None otherwise.
        ort_cpu: ``target="ort-cpu"`` with calibration data: the weight width chosen for Conv/Gemm/MatMul
            weights, depthwise Convs excepted (``cpu_vnni``, ``weight_bits`` 8 or 7, ``chosen_by``
            ``"option"``/``"auto"``/``"latency profile"``, ``reason``; see
            `onnx_qat.placement.cpu_latency.resolve_cpu_vnni`) and, for INT8, rule CPU7's
            ``bias_correction`` (``convs``, ``nodes``, ``largest_shift``: the Convs whose bias absorbs
            the mean error of their rounded weight, `onnx_qat.insertion.ort_cpu_bias`). None otherwise.
        scale_folds: ``target="tensorrt"``: one record per quantized Conv/ConvTranspose whose following
            per-channel constant Mul/Add (an unfolded batch normalization) was folded into its weight and
            bias before quantization (rule TRT1, `onnx_qat.graph.scale_folds.ScaleOpsFold.record`:
            ``node``, ``folded`` node names, ``output``, ``channels``, ``reason``): why the result has
            fewer nodes than the float model. Empty otherwise.
        evidence: from given scales in the ``tensorrt`` form, the
            `onnx_qat.graph.delta.EditEvidence` of the edit that made `model` (how it was validated, and
            its nodes as the edit wrote them, which [`check_written`][onnx_qat.check.check_written] reads
            the unchanged `model`'s nodes from); None otherwise.
    """

    model: onnx.ModelProto = field(repr=False)
    scales: ScaleTable = field(repr=False)
    placement: Placement = field(repr=False)
    target: str
    output: Optional[Path]
    summary: Mapping[str, int]
    inserted: Tuple[dict, ...] = field(default=(), repr=False)
    requantization: Tuple[dict, ...] = field(default=(), repr=False)
    precision: str = "int8"
    awq: Tuple[dict, ...] = field(default=(), repr=False)
    accuracy: Optional[Mapping] = field(default=None, repr=False)
    gptq: Tuple[dict, ...] = field(default=(), repr=False)
    float_parts: Optional[object] = field(default=None, repr=False)
    latency: Optional[Mapping] = field(default=None, repr=False)
    ort_cpu: Optional[Mapping] = field(default=None, repr=False)
    scale_folds: Tuple[dict, ...] = field(default=(), repr=False)
    evidence: Optional[object] = field(default=None, repr=False, compare=False)

    def save(self, path) -> Path:
        """Write the Q/DQ model to ``path`` atomically (see [`onnx_qat.io.models.save_model`][])."""
        return _io().save_model(self.model, path)

    def to_graph(self):
        """The Q/DQ model as a new ``onnx_graphsurgeon.Graph``, ready for further graph surgery
        (``gs.export_onnx(graph)`` gives the ONNX model back). Each call imports a fresh Graph;
        editing it leaves `model` unchanged."""
        return _io().to_graph(self.model)

    def to_report(self) -> dict:
        """A JSON-ready report: summary, every inserted Q/DQ with its rule and reason, skipped nodes
        with their reasons, notes."""
        return {
            "format": REPORT_FORMAT,
            "version": REPORT_VERSION,
            "target": get_target(self.target).to_dict(),
            "output": None if self.output is None else str(self.output),
            "summary": dict(self.summary),
            "scales": {"producer": self.scales.producer, "activations": len(self.scales.activations),
                       "weights": len(self.scales.weights)},
            "inserted": [dict(r) for r in self.inserted],
            "skipped": [{"node": d.node, "op_type": d.op_type, "rule": d.rule, "reason": d.reason}
                        for d in self.placement.all_decisions() if d.action == "skip"],
            "notes": list(self.placement.notes),
            "requantization": [dict(r) for r in self.requantization],
            **({} if self.precision == "int8" else {"precision": self.precision,
                                                    "awq": [dict(r) for r in self.awq]}),
            **({"gptq": [dict(r) for r in self.gptq]} if self.gptq else {}),
            **({} if self.accuracy is None else {"mixed_precision": dict(self.accuracy)}),
            **({} if self.float_parts is None else {"float_parts": self.float_parts.to_dict()}),
            **({} if self.latency is None else {"latency": dict(self.latency)}),
            **({} if self.ort_cpu is None else {"ort_cpu": dict(self.ort_cpu)}),
            **({"scale_folds": [dict(r) for r in self.scale_folds]} if self.scale_folds else {}),
        }

    def to_dict(self) -> dict:
        """Same as [`to_report`][onnx_qat.rewrite.QuantizeResult.to_report]."""
        return self.to_report()

    def __str__(self) -> str:
        s = self.summary
        return (f"QuantizeResult(target={self.target}, precision={self.precision}, "
                f"{s['activations']} activation Q/DQ pairs, "
                f"{s['weights']} weights, {s['skipped_nodes']} node{'' if s['skipped_nodes'] == 1 else 's'} "
                f"skipped, "
                + ("" if self.float_parts is None else f"float parts {self.float_parts.float_dtype} "
                   f"({len(self.float_parts.kept)} nodes kept FP32), ")
                + (f"{len(self.scale_folds)} Conv scale fold{'' if len(self.scale_folds) == 1 else 's'}, "
                   if self.scale_folds else "")
                + f"output={self.output})")


def rewrite_model(model, output=None, *, scales, data, method: str, config: QuantizeConfig,
                    calib_kw: Mapping, report=None, progress: bool = True,
                    placement: Optional[Placement] = None, latency=None,
                    cpu_vnni=False, fold_scales: bool = True) -> QuantizeResult:
    """The rewrite behind [`onnx_qat.quantize`][onnx_qat.quantize.quantize]: quantize every site the placement
    marks.

    ``config`` is the resolved [`QuantizeConfig`][onnx_qat.config.QuantizeConfig] and ``calib_kw`` the merged
    calibration keywords, both already checked by [`onnx_qat.quantize`][onnx_qat.quantize.quantize] (see there
    for every argument and what is raised). The accuracy tools call this directly, one layer below the public
    entry point that dispatches to them. With ``data``, the ranges come from one calibration pass
    over the loaded model (`onnx_qat.calibration.runner.collect`); for ``auto`` the candidate
    tables it returns are judged with this model and placement
    (`onnx_qat.calibration.choice.choose`): the model is loaded and placed once. ``latency``: a
    `LatencyOptions` (``ort-cpu`` only): sites whose integer form is not faster on this CPU stay float,
    and the result is timed against FP32. ``cpu_vnni``: ``ort-cpu`` with calibrated ranges: True for
    8-bit GEMM weights, False for 7-bit, ``"auto"`` to follow this machine
    (`onnx_qat.placement.cpu_latency.resolve_cpu_vnni`); the choice and its reason are in
    ``QuantizeResult.ort_cpu`` and a note. ``fold_scales``: False keeps the graph's per-channel Mul/Add
    after quantized convolutions where the target folds them (rule TRT1, `_fold_scales`): for a caller that
    pairs the result node by node with its own float model (`onnx_qat.accuracy.prepared`'s gated model) or
    fits weights against that model's Conv outputs (`onnx_qat.accuracy.optimize`).
    """
    if data is None and latency is None:  # no onnxruntime, no workers: Python objects only
        with _io().cyclic_gc_paused():  # ~10^6 live objects, none of them cyclic garbage
            return _rewrite_model(model, output, scales=scales, data=data, method=method, config=config,
                                  calib_kw=calib_kw, report=report, progress=progress, placement=placement,
                                  latency=latency, cpu_vnni=cpu_vnni, fold_scales=fold_scales)
    return _rewrite_model(model, output, scales=scales, data=data, method=method, config=config,
                          calib_kw=calib_kw, report=report, progress=progress, placement=placement,
                          latency=latency, cpu_vnni=cpu_vnni, fold_scales=fold_scales)


def _rewrite_model(model, output=None, *, scales, data, method: str, config: QuantizeConfig,
                   calib_kw: Mapping, report=None, progress: bool = True,
                   placement: Optional[Placement] = None, latency=None,
                   cpu_vnni=False, fold_scales: bool = True) -> QuantizeResult:
    """`rewrite_model`'s work (see there)."""
    target_obj = get_target(config.target)
    fmt = get_format(config.precision)
    inputs = tuple(p for p in (model, scales, data) if isinstance(p, (str, os.PathLike)))
    out_path, _ = check_output_and_report(output, report, inputs=inputs)
    io = _io()
    float_model, index, placement, checked = _load_and_place(model, placement, target_obj, config)
    given = None if scales is None else _given_table(scales)  # before the folds: its weights are kept
    folds: tuple = ()
    if fold_scales and target_obj.fold_scale_ops:
        float_model, index, placement, folds = _fold_scales(float_model, index, placement, given, target_obj,
                                                            config)
    from_scales = data is None  # no step below edits the float model then (AWQ and GPTQ need data)
    width = None  # ort-cpu with calibrated ranges: GEMM weights (depthwise excepted) in 8 or 7 bits
    table_calibrated = _calibrated_for(given, target_obj, data, cpu_vnni)  # calibrate(target="ort-cpu")
    if (data is not None or table_calibrated) and not fmt.weight_only \
            and hasattr(make_adapter(target_obj), "nonnegative_inputs"):
        from .placement.cpu_latency import resolve_cpu_vnni

        width = resolve_cpu_vnni(cpu_vnni, profile=None if latency is None else latency.profile,
                                 threads=0 if latency is None else latency.threads)
    latency_decision, every_site = None, None
    if latency is not None:  # ort-cpu: keep float the sites whose integer kernel is not faster here
        from .placement.cpu_latency import place_by_latency, recorded_shapes, sample_feed, timing_sizes

        every_site = placement
        feed = sample_feed(data, float_model)  # its shapes: the sizes symbolic dims are timed at (image size)
        samples = timing_sizes(float_model, latency.shapes, {name: a.shape for name, a in feed.items()},
                               recorded_shapes(given[1] if given is not None else None))
        placement, latency_decision = place_by_latency(float_model, index, placement, policy_for(target_obj),
                                                       config, latency, cpu_vnni=width, samples=samples,
                                                       values=feed)
        if not latency_decision.kept_float:
            every_site = None
        if placement.empty or len(latency_decision.kept_float) == len(latency_decision.records):
            raise PlacementError("every quantizable site runs faster in float on this CPU (see the latency "
                                 "profile): the FP32 model is already the fast form; nothing written")
        from .placement.cpu_latency import timing_feeds

        timing_model = float_model.SerializeToString()  # the rewrite edits float_model's nodes
        timing_inputs = timing_feeds(float_model, latency.batch, samples, feed)
    awq_records: tuple = ()
    gptq_records: tuple = ()
    if fmt.weight_only:  # no activation ranges; data serves the activation-aware weight scales
        from .formats.awq import apply_awq

        clip_ranges: dict = {}
        rounding = config.rounding(data is not None)
        if rounding in ("awq", "gptq"):
            awq_records, clip_ranges = apply_awq(float_model, index, placement, data, config.block_size,
                                                 progress=progress, batch_size=calib_kw.get("batch_size"))
        if rounding == "gptq":  # the weights are replaced by their rounded values (see onnx_qat.formats.gptq)
            from .formats.gptq import apply_gptq

            gptq_records, clip_ranges = apply_gptq(float_model, placement, data, config.block_size,
                                                   progress=progress, batch_size=calib_kw.get("batch_size"))
            index = GraphIndex(float_model)
        if given is None:
            given = ("ScaleTable", ScaleTable(weights=clip_ranges,
                                              producer=rounding if clip_ranges else "weights"))
        data = None
    adapter = make_adapter(target_obj)
    if adapter is not None and data is not None and "tensors" not in calib_kw:
        wanted = placement.activation_tensors() + adapter.calibration_tensors(index, placement)
        if every_site is not None:  # the all-integer alternative is built and timed too
            wanted += every_site.activation_tensors() + adapter.calibration_tensors(index, every_site)
        calib_kw = {**calib_kw, "tensors": tuple(dict.fromkeys(wanted))}
    table, placement = _ranges(float_model, index, placement, given, data, method, config, calib_kw,
                               progress, removed=frozenset(t for f in folds for t in f.removed))
    if fmt.attention:
        if config.include_attention:  # a range the caller's own ScaleTable gives is kept
            keep = table.activations if given is not None else ()
            table = softmax_ranges(index, placement, table, keep=keep)
    if config.fp8_method == "gptq":  # after calibration: activation ranges are the float model's
        from .formats.gptq import apply_gptq_fp8

        gptq_records, weight_ranges = apply_gptq_fp8(float_model, placement, data, skip=set(table.weights),
                                                     progress=progress, batch_size=calib_kw.get("batch_size"))
        table = table.merged(ScaleTable(weights=weight_ranges))
        index = GraphIndex(float_model)
    requantization, storage, finish = (), {}, None
    nonnegative = None  # ort-cpu with calibrated ranges: the tensors (graph inputs) never negative
    if adapter is not None and data is not None and hasattr(adapter, "nonnegative_inputs"):  # calibrated here
        nonnegative = adapter.nonnegative_inputs(float_model, data, placement)
    elif table_calibrated and hasattr(adapter, "nonnegative_bounds"):  # calibrated for this form, earlier
        nonnegative = adapter.nonnegative_bounds(index, placement, table)
        note = (f"{target_obj.name}: ranges calibrated for this form (ScaleTable {CALIBRATION_TARGET_KEY} "
                f"{target_obj.name!r}): used as with calibration data, except rule CPU7 (Conv biases "
                "corrected for the mean weight-rounding error), which needs the data itself (--data); a "
                "ScaleTable does not carry it")
        logger.info("%s", note)
        placement = replace(placement, notes=placement.notes + (note,))
    calibrated = {} if nonnegative is None else {
        "nonnegative": nonnegative, "fine": True,
        **({"vnni": True} if width is not None and width["cpu_vnni"] else {})}
    means, corrected, pristine = None, {}, None  # ort-cpu with data: rule CPU7's input means, records
    if calibrated and data is not None and fmt.name == "int8":
        means = _conv_input_means(float_model, index, placement if every_site is None else every_site, data,
                                  calib_kw)
    if adapter is not None:  # e.g. ort-cpu: requantization points and zero points, after ranges are known
        adapted = adapter.adapt(index, placement, table, **calibrated)
        dropped = [s for s in placement.subgraphs if s not in adapted.placement.subgraphs]
        placement, table, requantization = adapted.placement, adapted.table, adapted.requantization
        if means:  # rule CPU7's guard builds the form without the correction too
            pristine = onnx.ModelProto()
            pristine.CopyFrom(float_model)
        _correct_biases(float_model, index, adapted, means, corrected)
        if dropped:  # the form rewrites the main graph only: If branches, Loop/Scan bodies stay float in it
            note = (f"the {target_obj.name} form quantizes the main graph only; "
                    f"{len(dropped)} subgraph(s) (If branches, Loop/Scan bodies) left float")
            logger.warning("%s", note)
            placement = replace(placement, notes=placement.notes + (note,))
        storage = _adapted_storage(adapted)
        finish = getattr(adapted, "finish", None)  # graph edits after insertion (ort-cpu: scale folds)
    # From given scales and without a target form's adapter nothing has changed the float model since it
    # was indexed: the edit takes its lookups from the index. Otherwise the index is freed here (placement
    # is decided), which lowers the rewrite's memory peak.
    current = index if from_scales and adapter is None else None
    del index
    if folds or current is None:  # the model as checked at load has changed (folds): checked in full
        checked = None
    storage = {**storage, "precision": fmt.name, "block_size": config.block_size}
    qdq_model, inserted, evidence = _rewrite(float_model, placement, table, target_obj, progress, storage,
                                             finish, index=current, checked=checked)
    del current
    # The float weights are not needed to save the Q/DQ model (a new ModelProto, which holds only
    # the integer copies). Freeing them first keeps peak memory within 2x the weights.
    del float_model
    if means and corrected:  # rule CPU7 is kept only where it lowers the error on the calibration data
        reference = _guard_reference(pristine, data)  # before the rewrite edits ``pristine``
        plain, plain_inserted, _ = _rewrite(pristine, placement, table, target_obj, False, storage, finish)
        guard = _bias_guard(reference, qdq_model, plain)
        if not guard["kept"]:
            qdq_model, inserted = plain, plain_inserted
            corrected.clear()
            means = None  # nor in the latency placement's other models
        guard_record = guard
    else:
        guard_record = None
    pristine = None
    summary = _summary(placement, inserted)
    latency_report = None
    if latency_decision is not None:
        from .placement.cpu_latency import clearly_slower, whole_model_timing

        alternative = None
        if every_site is not None:  # the per-site times miss what a float site costs its neighbours
            alternative = _all_integer(timing_model, every_site, table, target_obj, adapter, calibrated, fmt,
                                       config, means, corrected)
        whole = whole_model_timing(timing_model, qdq_model, latency, alternative, feeds=timing_inputs)
        if whole.get("chosen") == "every site integer":
            qdq_model, inserted, placement, requantization = alternative
            summary = _summary(placement, inserted)
            # the placement before the latency decision: its notes (sizes timed at 1, a profile of another
            # machine) still describe how this model was timed
            placement = _with_notes(placement, latency_decision.notes)
        latency_report = {**latency_decision.to_dict(), "whole_model": whole}
        if whole.get("chosen") == "every site integer":  # the per-site decision lost as a whole
            latency_report.update(kept_float=[], kept_float_per_site=list(latency_decision.kept_float))
        if whole.get("timed") and whole["speedup"] <= 1.0:  # the guard: fewer sites integer, timed once
            qdq_model, inserted, placement, requantization, fallback = _fall_back(
                timing_model, (qdq_model, inserted, placement, requantization), latency_decision,
                table, target_obj, adapter, calibrated, fmt, config, latency, timing_inputs, means, corrected)
            if fallback is not None:  # the second timing's figures replace the first's (kept under "first")
                latency_report["fallback"] = fallback
                summary = _summary(placement, inserted)
                first = {k: whole[k] for k in ("fp32_ms", "quantized_ms", "speedup", "rounds", "quartiles_ms")
                         if k in whole}
                chosen = fallback["chosen"] == "fallback"
                whole = {**whole, "fp32_ms": fallback["fp32_ms"], "speedup": fallback["speedup"],
                         **{k: fallback[k] for k in ("source", "timed_at", "profile", "quartiles_ms")
                            if k in fallback},
                         "quantized_ms": fallback["best_ms"],
                         "rounds": fallback["rounds"], "first": first,
                         "verdict": ("faster than FP32" if fallback["speedup"] > 1.0
                                     else "NOT faster than FP32"),
                         **({"chosen": "fallback"} if chosen else {})}
                latency_report["whole_model"] = whole
                if chosen:
                    latency_report["kept_float"] = list(latency_report["kept_float"]) + fallback["kept_float"]
        if clearly_slower(whole) and not latency.allow_slower:
            tried = latency_report.get("fallback", {})
            kept = len(tried.get("kept_float", ()))
            guard = f" after the whole-model guard kept {kept} more site(s) float" \
                if tried.get("chosen") == "fallback" else ""
            raise PlacementError(
                f"no quantized form ran faster than FP32 on this CPU: the fastest{guard} took "
                f"{whole['quantized_ms']} ms against FP32's {whole['fp32_ms']} ms (batch {whole['batch']}, "
                f"{whole['threads'] or 'default'} threads), slower than 3 in 4 FP32 runs; the FP32 model is "
                "the fast form here and nothing was written (--latency-allow-slower writes it anyway; "
                "without --latency every site is quantized)")
        if whole.get("timed") and whole["speedup"] <= 1.0:
            note = (f"ort-cpu: the quantized model is NOT faster than FP32 on this CPU "
                    f"({whole['quantized_ms']} ms against {whole['fp32_ms']} ms, batch {whole['batch']}): "
                    "deploy the FP32 model here")
            logger.warning("%s", note)
            placement = replace(placement, notes=placement.notes + (note,))
    if guard_record is not None and not guard_record["kept"]:
        note = ("ort-cpu: rule CPU7 (Conv biases corrected for the mean weight-rounding error) left out: "
                f"it did not lower the output error on {guard_record['samples']} calibration sample(s) "
                f"({guard_record['error_corrected']:.4g} against {guard_record['error_plain']:.4g})")
        logger.info("%s", note)
        placement = replace(placement, notes=placement.notes + (note,))
    if means:
        found = _bias_report(corrected, placement)
        note = (f"ort-cpu: {found['convs']} Conv bias(es) corrected for the mean error of the rounded weight "
                f"on the calibration data (rule CPU7)")
        logger.info("%s", note)
        placement = replace(placement, notes=placement.notes + (note,))
    if width is not None:
        note = (f"ort-cpu: Conv/Gemm/MatMul weights (depthwise Convs excepted) in "
                f"{width['weight_bits']} bits "
                f"(cpu_vnni={width['cpu_vnni']}, {width['chosen_by']}: {width['reason']})")
        logger.info("%s", note)
        placement = replace(placement, notes=placement.notes + (note,))
    if latency_decision is not None:
        del timing_model
    _record_fp32_float_parts(qdq_model)
    result = QuantizeResult(qdq_model, table, placement, target_obj.name, out_path, MappingProxyType(summary),
                            tuple(inserted.activations + inserted.weights), tuple(requantization),
                            fmt.name, tuple(awq_records), gptq=tuple(gptq_records), latency=latency_report,
                            scale_folds=tuple(f.record() for f in folds),
                            ort_cpu=None if width is None else MappingProxyType(
                                {**width, **({} if guard_record is None else {
                                    "bias_correction": _bias_report(corrected, placement, guard_record)})}),
                            evidence=evidence)
    io.write_outputs(qdq_model, out_path, report, result.to_report, inputs=inputs, evidence=evidence)
    return result


# --------------------------------------------------------------------------- steps
def _record_fp32_float_parts(model: onnx.ModelProto) -> None:
    """Say in ``model``'s metadata (`onnx_qat.formats.numeric.FLOAT_DTYPE_KEY` = ``fp32``) that its float
    parts are FP32 on purpose: check rule C15 then reports its FP32 Conv/Gemm/MatMul as a note (for
    weakly typed builds, which pick FP16 themselves) instead of warning as it does for a Q/DQ model
    that does not say (TensorRT 11's strongly typed build runs them in FP32). The float-parts
    conversion replaces the entry with its type."""
    from .formats.numeric import FLOAT_DTYPE_KEY

    if not any(p.key == FLOAT_DTYPE_KEY for p in model.metadata_props):
        model.metadata_props.add(key=FLOAT_DTYPE_KEY, value="fp32")


def _load_and_place(model, placement: Optional[Placement], target_obj: Target, config: QuantizeConfig):
    """Load the float model (a private copy with unique node names), index it once, and decide
    (or check the given) placement; refuse models with nothing to quantize or non-finite weights.
    ``(model, index, placement, checked)``, ``checked`` the `onnx_qat.io.models.CheckedForm` under which
    ``onnx.checker`` passed the model at load.

    Runs with the cyclic garbage collector paused: the index and the placement are ~10^5-10^6
    objects that live on, which its full collections would rescan as they grow (a quarter of
    the placement's time on a 50k-node model).
    """
    io = _io()
    with io.cyclic_gc_paused():
        float_model, checked = io.load_checked_model(model, min_opset=get_format(config.precision).min_opset)
        # unique node names given and the index built in one read of the nodes; built once: placement,
        # placement checks and name checks share it
        index = GraphIndex(float_model, assign_names=True)
        refuse_quantized(float_model, model_words(model), index)
        if placement is None:
            placement = policy_for(target_obj).place(index, config)
        else:
            _check_placement(placement, index)
        if placement.empty:
            raise PlacementError(nothing_to_quantize(placement, model_words(model), config.precision))
        refuse_non_finite_weights(index, placement, model_words(model))
    return float_model, index, placement, checked


def check_sources(scales, data, method, calib_kw, weight_only: bool = False) -> None:
    if weight_only and scales is not None and data is not None:
        raise ConfigError("give at most one of scales and data for a weight-only precision")
    if (scales is None) == (data is None) and not (weight_only and scales is None):
        raise ConfigError("give exactly one of scales (a ScaleTable or its JSON path) "
                          "and data (calibration data)")
    if scales is not None and not isinstance(scales, (ScaleTable, Mapping, str, os.PathLike)):
        raise ConfigError(f"scales must be a ScaleTable, the path of its JSON file or a mapping of "
                          f"activation tensor names to amax values, not {type(scales).__name__}")
    if scales is not None and (calib_kw or method not in (None, "max")):
        raise ConfigError("calibration options (method, calibration_options...) apply only with data, "
                          "not with scales")


def _check_placement(placement, index: GraphIndex) -> None:
    """Refuse a given placement that is not a Placement or names unknown tensors or nodes."""
    if not isinstance(placement, Placement):
        raise ConfigError(f"placement must be an onnx_qat Placement, got {type(placement).__name__}")
    tensors = set(index.all_tensor_names())
    for mark in placement.activations + placement.weights:
        nodes = [n for n, _ in mark.consumers] if isinstance(mark, ActivationMark) else [mark.node]
        unknown = [n for n in nodes if n not in index.by_name]
        if mark.tensor not in tensors or unknown:
            what = f"node {unknown[0]!r}" if unknown else f"tensor {mark.tensor!r}"
            raise PlacementError(f"the given placement names {what}, which the model does not have")
    for sub in placement.subgraphs:
        node = index.by_name.get(sub.node)
        held = {(a, p) for a, p, _ in subgraphs_of(node.proto)} if node is not None else set()
        if (sub.attribute, sub.position) not in held:
            raise PlacementError(f"the given placement names subgraph {sub.attribute!r} of node "
                                 f"{sub.node!r}, which the model does not have")
    for sub_index, sub_placement in nested_indexes(index, placement):
        _check_placement(replace(sub_placement, subgraphs=()), sub_index)


def nothing_to_quantize(placement: Placement, what: str = "the model", precision: str = "int8") -> str:
    """The one-line message for a placement with no marks: what was found and what was excluded,
    or, when the format quantizes op types the model lacks (``int4``: MatMul/Gemm weights only),
    that cause and the format to use instead. Options are named as on the command line, with
    the QuantizeConfig fields of the same names."""
    from .formats.numeric import get_format

    ops = {}
    for d in placement.all_decisions():
        ops[d.op_type] = ops.get(d.op_type, 0) + 1
    found = ", ".join(f"{n} {op}" for op, n in sorted(ops.items())) or "no nodes"
    fmt = get_format(precision)
    if fmt.weight_only and not set(fmt.weight_ops) & set(ops):
        return (f"nothing to quantize in {what}: --precision {fmt.name} quantizes only the weights of "
                f"{' and '.join(fmt.weight_ops)} nodes, and the model has none (found {found}); use "
                f"--precision int8 or fp8"
                + (" for its Conv layers" if {"Conv", "ConvTranspose"} & set(ops) else ""))
    skipped = [d for d in placement.all_decisions() if d.action == "skip"]
    why = "; ".join(f"{d.node}: {d.reason}" for d in skipped[:5]) + (" ..." if len(skipped) > 5 else "")
    typed = [d for d in skipped if "not float32" in d.reason]
    if typed and len(typed) * 2 >= len(skipped):  # most skipped for their type: the model is not FP32
        return (f"nothing to quantize in {what}: its weighted ops compute in another float type than "
                f"float32 ({len(typed)} of {len(skipped)} skipped for it, e.g. {typed[0].node}: "
                f"{typed[0].reason}); onnx-qat quantizes float32 models: give the model's FP32 form (for "
                "FP16 float parts, --float-dtype fp16 writes them so, QuantizeConfig field float_dtype)")
    return (f"nothing to quantize in {what}: found {found}; "
            f"{len(skipped)} node{'' if len(skipped) == 1 else 's'} skipped"
            + (f" ({why})" if why else "") + "; see each node's decision with 'onnx-qat inspect' and "
            "check --exclude-nodes, --exclude-op-types and --min-channels (QuantizeConfig fields "
            "exclude_nodes, exclude_op_types, min_channels)")


def _ranges(model, index, placement, given, data, method, config, calib_kw,
            progress, removed=frozenset()) -> Tuple[ScaleTable, Placement]:
    """``(ScaleTable, placement)``: the given table (``given``: `_given_table`'s ``(source, table)``)
    validated, or calibrated on ``data``; when calibrated, the If branches no batch took are dropped from
    the placement (left float, with a note).

    ``removed``: tensors of the loaded model that rule TRT1's folds removed (`_fold_scales`): a given
    range may name them (the model the user has holds them); such ranges are dropped, as the placement
    never quantizes those tensors. Problems with a ScaleTable given as a file name that file in the
    message.
    """
    if given is None:
        table, placement = _calibrated(model, placement, data, method, config, calib_kw, progress)
        return _check_complete(table, placement, "calibrated ScaleTable"), placement
    source, table = given
    with _io().cyclic_gc_paused():  # a table of 10^4-10^5 ranges; the index and placement stay alive
        weights = table.weights  # only their shapes are checked
        shapes = index.constant_shapes(weights)
        subs = [sub_index for sub_index, _ in nested_indexes(index, placement)]  # quantized If branches
        for sub_index in subs:
            shapes.update(sub_index.constant_shapes(weights))
        # the table's activations when the main graph makes, holds or lists each (one lookup each), else every
        # tensor name of the model and its quantized subgraphs
        has = index.has_tensor
        names = [t for t in table.activations if has(t)]
        if len(names) < len(table.activations):
            names = list(index.all_tensor_names())
            names.extend(removed)
            for sub_index in subs:
                names.extend(sub_index.all_tensor_names())
        if source.startswith("TensorRT"):  # a cache names TensorRT's own tensors too: dropped, one warning
            from .io.tensorrt_cache import names_in_model
            table = table.subset(names_in_model(table.activations, names, source=source))
        try:
            table.check_names(names, shapes)
        except ScalesError as exc:
            if source == "ScaleTable":
                raise
            raise ScalesError(f"{source}: {exc}") from None
        folded = [t for t in table.activations if t in removed]
        if folded:
            logger.info("%d given range(s) name tensors the Conv scale folds removed (rule TRT1), e.g. %r: "
                        "not used", len(folded), folded[0])
            table = table.subset([t for t in table.activations if t not in removed])
    return _check_complete(table, placement, source), placement


def _fp16_fit(folds, index: GraphIndex, placement: Placement, target_obj: Target, config: QuantizeConfig):
    """``(folds, unfit)``: for a target whose weight scales are FP16 values (``weight_scale_grid``), the
    folds whose folded weight would have scales FP16 cannot hold within its precision where the weight
    as it is has scales it can (`onnx_qat.formats.float_parts.scale_fits`, the FP16 conversion's own
    criterion) are left out (``unfit``): a tiny factor (a batch normalization over large activations,
    e.g. the first Conv of an untrained Keras ResNet50 fed 0..255) would push every scale of the
    weight below 2^-14, and the FP16 float parts would keep that convolution FP32."""
    if target_obj.weight_scale_grid != "fp16" or not folds:
        return folds, ()
    from .formats.float_parts import get_low_type, scale_fits
    from .graph.scale_folds import scaled_weight

    low, qmax = get_low_type("fp16"), get_format(config.precision).qmax
    axes = {w.node: w.axis for w in placement.weights if w.input_index == 1}

    def fits(values, axis) -> bool:
        values = np.abs(np.asarray(values, np.float32))
        amax = values.max() if axis is None else \
            np.moveaxis(values, axis, 0).reshape(values.shape[axis], -1).max(1)
        return scale_fits(np.atleast_1d(amax / np.float32(qmax)).astype(np.float32), low)

    kept, unfit = [], []
    for fold in folds:
        axis = axes.get(fold.node)
        before = _io().tensor_array(index.constant_proto(fold.weight))
        unfit_here = fits(before, axis) and not fits(scaled_weight(index, fold), axis)
        (unfit if unfit_here else kept).append(fold)
    return tuple(kept), tuple(unfit)


def _calibrated_for(given, target_obj: Target, data, cpu_vnni) -> bool:
    """True when ``given`` (`_given_table`'s ``(source, table)``, without ``data``) holds ranges
    calibrated for ``target_obj``'s form (metadata `onnx_qat.scales.CALIBRATION_TARGET_KEY`, written by
    ``calibrate(..., target="ort-cpu")``): the form then treats them as calibrated in this call. Refuses
    ``cpu_vnni=True`` with ranges that are not (learned in QAT, or calibrated for ``tensorrt``): the
    weight width applies to calibrated ranges only."""
    found = data is None and given is not None and target_obj.name != "tensorrt" \
        and given[1].metadata.get(CALIBRATION_TARGET_KEY) == target_obj.name
    if cpu_vnni is True and data is None and not found:
        raise ConfigError(f"cpu_vnni applies to calibrated ranges: calibration data (data), or a ScaleTable "
                          f"from calibrate(..., target={target_obj.name!r}) (onnx-qat calibrate --target "
                          f"{target_obj.name}); this table's ranges were not calibrated for that form")
    return found


def _given_table(scales) -> Tuple[str, ScaleTable]:
    """``(source label, table)`` of the ``scales`` argument: a ScaleTable, a mapping of activation ranges,
    a ScaleTable JSON file or a TensorRT calibration cache (loaded and validated here, once)."""
    if isinstance(scales, ScaleTable):
        return "ScaleTable", scales
    if isinstance(scales, Mapping):  # {activation tensor: amax}
        return "ScaleTable", ScaleTable(scales, producer="mapping")
    return _load_scales_file(scales)


def _fold_scales(model, index: GraphIndex, placement: Placement, given, target_obj: Target,
                 config: QuantizeConfig):
    """Rule TRT1 on the loaded model (a private copy): the per-channel constant Mul/Add after each
    convolution whose weight ``placement`` quantizes, folded into its weight and bias
    (`onnx_qat.graph.scale_folds`), except where ``given`` (`_given_table`) holds a range for the weight
    (trained ranges, e.g. a Keras QAT model's: they describe the weight as it is, and the Keras model
    computes ``conv(x, q(w)) * k``, which the graph then keeps). The placement stays valid: its marks never
    name a tensor a fold removes (no fold crosses a quantized tensor), and the removed nodes' decisions
    go, with a note. ``(model, index, placement, folds)``; the index is rebuilt when something folded."""
    from .graph.scale_folds import find_scale_folds, fold_scale_ops

    convs = [w.node for w in placement.weights if w.input_index == 1]
    if not convs:
        return model, index, placement, ()
    keep = () if given is None else frozenset(given[1].weights)
    folds = find_scale_folds(index, convs, marked={m.tensor for m in placement.activations},
                             keep_weights=keep)
    folds, unfit = _fp16_fit(folds, index, placement, target_obj, config)
    if unfit:
        note = (f"{len(unfit)} convolution(s) keep their per-channel Mul/Add (e.g. {unfit[0].node!r}): "
                "folded, their weight scales would lie below FP16's precision, which the FP16 float parts "
                "could not store (rule TRT1)")
        logger.info("%s", note)
        placement = replace(placement, notes=placement.notes + (note,))
    if not folds:
        return model, index, placement, ()
    with _io().cyclic_gc_paused():
        gone = set(fold_scale_ops(model, index, folds))
        index = GraphIndex(model)
    ops = sum(len(f.ops) for f in folds)
    note = (f"{ops} per-channel Mul/Add node(s) after {len(folds)} quantized convolution(s) folded into "
            "their weights and biases before quantization (rule TRT1: TensorRT fuses them into the "
            "convolution; see scale_folds in the report)")
    logger.info("%s", note)
    placement = replace(placement, decisions=tuple(d for d in placement.decisions if d.node not in gone),
                        notes=placement.notes + (note,))
    return model, index, placement, folds


def _load_scales_file(path) -> tuple:
    """``(source label, table)`` of a ScaleTable JSON file or a TensorRT calibration cache (a file
    beginning with ``TRT-``, see `onnx_qat.io.tensorrt_cache`)."""
    from .io.tensorrt_cache import is_tensorrt_cache

    if is_tensorrt_cache(path):
        return f"TensorRT calibration cache {path}", ScaleTable.from_tensorrt_cache(path)
    return f"ScaleTable {path}", ScaleTable.load(path)


def _calibrated(model, placement, data, method, config, calib_kw, progress) -> Tuple[ScaleTable, Placement]:
    """Calibrate ``model`` (the rewrite's own loaded copy, not changed) on ``data`` for ``placement``,
    and for ``auto`` choose among the candidate tables with this model and placement: the ScaleTable
    and the placement less the If branches / Loop bodies calibration could not observe (each named
    in a note and a warning, `onnx_qat.insertion.inserter.without_unreached_branches`)."""
    from .calibration.runner import auto_table, collect
    from .io.data import load_data

    options = dict(calib_kw)
    tensors = options.pop("tensors", None) or placement.activation_tensors()
    unknown = sorted(set(options) - {"percentile", "num_bins", "batch_size", "workers"})
    if unknown:
        raise ConfigError(f"unknown calibration option {unknown[0]!r}; the options are percentile, num_bins, "
                          "batch_size and tensors")
    dataset = load_data(data, model, what="calibration data")
    result = collect(model, dataset, tensors, method=method, progress=progress,
                     fp16_grid=config.target == "tensorrt", entropy=False, **options)
    reached = without_unreached_branches(placement, result.table())
    if reached.empty:
        raise PlacementError("nothing to quantize: the calibration data took no If branch (nor observed "
                             "a Loop/Scan body) that placement quantizes")
    if method != "auto":
        return result.table(), reached
    from .calibration.choice import choose

    chosen = choose(model, reached, result, target=config.target, precision=config.precision,
                    block_size=config.block_size)
    return auto_table(result, *chosen), reached


#: Softmax outputs lie in [0, 1]: with FP8 their range is fixed, not calibrated (data-independent, as
#: TensorRT's fused FP8 attention takes it; source: NVIDIA Model Optimizer's FP8 ONNX exporter, which
#: quantizes Softmax outputs with scale 1/448).
SOFTMAX_AMAX = 1.0


def softmax_ranges(index: GraphIndex, placement: Placement, table: ScaleTable, keep=()) -> ScaleTable:
    """``table`` with amax `SOFTMAX_AMAX` for every quantized tensor a Softmax produces, except
    those named in ``keep`` (the ranges of a ScaleTable the caller gave, which stay as given)."""
    fixed = {m.tensor: SOFTMAX_AMAX for m in placement.activations
             if getattr(index.producer.get(m.tensor), "op_type", None) == "Softmax" and m.tensor not in keep}
    if not fixed:
        return table
    return table.merged(ScaleTable(fixed, producer=table.producer, metadata=table.metadata))


def _check_complete(table: ScaleTable, placement: Placement, source: str) -> ScaleTable:
    """Refuse a table without a range for some tensor the placement quantizes (all are listed)."""
    from .insertion.inserter import missing_activations

    missing = tuple(t for nested in placement.nested() for t in missing_activations(nested, table))
    if missing:
        shown = ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise ScalesError(f"{source} has no range for {len(missing)} tensor(s) placement quantizes: {shown}")
    return table


def _rewrite(model, placement, table, target: Target, progress, storage=None, finish=None, index=None,
             checked=None):
    """Insert the Q/DQ nodes as edits of ``model`` (which this call owns) and commit them to a new
    ModelProto (``storage``: the target form's ``zero_points``/``unsigned_weights`` for
    `insert_qdq_pairs`; ``finish``: the form's edits after insertion, e.g.
    `onnx_qat.insertion.ort_cpu.Adapted.finish`; ``index``: a `GraphIndex` of ``model`` as it is now,
    for `GraphEdit`, which this call owns too: its tables are released before the commit, as are the edit's
    lookups (`GraphIndex.release`, `GraphEdit.release_lookups`); ``checked``: the
    `onnx_qat.io.models.CheckedForm` under which ``onnx.checker`` passed ``model`` as it is now, for
    `GraphEdit`'s evidence). ``(the new model, the insertion's records, the
    edit's `onnx_qat.graph.delta.EditEvidence` or None)``."""
    from .graph.edit import GraphEdit
    from .insertion.inserter import insert_qdq_pairs

    with _io().cyclic_gc_paused():  # ~10^5 new protobuf objects, none of them in reference cycles
        nested = ()
        if placement.subgraphs:  # If branches first: the main graph's edit then sees their new names
            from .graph.subgraphs import drop_unread, read_by_subgraphs
            from .insertion.subgraphs import insert_into_subgraphs

            fmt = {k: v for k, v in dict(storage or {}).items() if k in ("precision", "block_size")}
            shared = read_by_subgraphs(model.graph)
            nested = tuple(insert_into_subgraphs(model, placement, table, target, **fmt))
        # new nodes as bytes unless edited after insertion; the index only when the If branches' edits
        # have not changed what the main graph's nodes hold
        edit = GraphEdit(model, encoded=finish is None, index=None if nested else index,
                         checked=None if nested else checked)
        inserted = insert_qdq_pairs(edit, placement, table, target, progress=progress, **dict(storage or {}))
        if finish is not None:
            finish(edit)
        edit.release_lookups()  # only the commit follows: the result it makes reuses their memory
        if index is not None:  # given by the caller, which reads it no more (see above)
            index.release()
        committed = edit.commit()
        if nested:
            inserted = type(inserted)(
                inserted.activations + tuple(r for r in nested if r["kind"] == "activation"),
                inserted.weights + tuple(r for r in nested if r["kind"] == "weight"))
            drop_unread(committed.graph, shared)  # float weights only quantized branches read
        return committed, inserted, (edit.evidence if not nested else None)


def _conv_input_means(model, index: GraphIndex, placement: Placement, data, calib_kw: Mapping):
    """Rule CPU7's per-sample tap means of the quantized Convs' inputs on the calibration data
    (`onnx_qat.insertion.ort_cpu_bias.tap_reducers`, `onnx_qat.calibration.means.per_sample`)."""
    from .calibration.means import per_sample
    from .insertion.ort_cpu_bias import tap_reducers

    reducers = tap_reducers(index, placement)  # batches of 4: every Conv input of a batch is held at once
    return per_sample(model, data, reducers, batch_size=min(4, calib_kw.get("batch_size") or 4))


def _correct_biases(model, index: GraphIndex, adapted, means, found: dict) -> None:
    """Rule CPU7 on ``model`` for the adapted ort-cpu placement (`correct_conv_biases`); each Conv's
    record goes into ``found`` by node. Nothing without ``means``."""
    if not means:
        return
    from .insertion.ort_cpu_bias import correct_conv_biases

    for record in correct_conv_biases(model, index, adapted.placement, adapted.table, means,
                                      narrow=getattr(adapted, "narrow_weights", ())):
        found[record["node"]] = record


def _bias_report(found: Mapping, placement: Placement, guard=None) -> dict:
    """The report's ``ort_cpu["bias_correction"]``: rule CPU7's Convs among the written model's sites,
    and the guard's figures (`_bias_guard`)."""
    written = {w.node for w in placement.weights}
    nodes = sorted(n for n in found if n in written)
    return {"rule": "CPU7", "convs": len(nodes), "nodes": nodes,
            "largest_shift": max((found[n]["largest_shift"] for n in nodes), default=0.0),
            **({} if guard is None else {"guard": dict(guard)})}


#: Most calibration samples rule CPU7's guard compares the two forms on, spread evenly over the data
#: (`guard_indices`).
BIAS_GUARD_SAMPLES = 16


def guard_indices(count: int, most: int = BIAS_GUARD_SAMPLES) -> Tuple[int, ...]:
    """The positions of the calibration samples rule CPU7's guard judges on: all ``count`` of them up to
    ``most``, else ``most`` spread evenly from the first to the last. Calibration data are often ordered
    by kind (photos, then documents): the first samples alone judged the real PP-OCRv4 detector on
    photos only and kept a correction that made its error on the documents 1.4x larger."""
    if count <= most:
        return tuple(range(count))
    return tuple(sorted({int(i) for i in np.round(np.linspace(0, count - 1, most))}))


def _guard_reference(float_model, data):
    """The calibration samples at `guard_indices` (one feed each) and FP32's outputs on them."""
    from .io.data import load_data
    from .runtime.sessions import make_session

    dataset = load_data(data, float_model, what="calibration data")
    wanted = set(guard_indices(len(dataset)))
    feeds = []
    for position, feed in enumerate(dataset.batches(1)):
        if position in wanted:
            feeds.append(feed)
        if len(feeds) >= len(wanted):
            break
    session = make_session(float_model, spin=False)
    names = {i.name for i in session.get_inputs()}
    return [(feed, [np.asarray(o, np.float64) for o in session.run(None, {k: v for k, v in feed.items()
                                                                          if k in names})])
            for feed in feeds]


def _bias_guard(reference, corrected, plain) -> dict:
    """Whether rule CPU7's corrected form is kept: its mean |output - FP32| over the `_guard_reference`
    samples (up to `BIAS_GUARD_SAMPLES` spread over the calibration data, all outputs, onnxruntime with all
    optimizations, as deployed) is below the uncorrected form's. On the real PP-OCRv4 detector the
    weight-only correction doubled the error (one Conv's bias moved by 0.1 did it): there the mean error
    of the rounded activations dominates and the network reacts to small shifts; on the Keras CNNs it
    lowered the error by a fifth to a third. ``{"kept", "error_corrected", "error_plain", "samples"}``."""
    from .runtime.sessions import make_session

    errors = []
    for model in (corrected, plain):
        session = make_session(model, spin=False)
        names = {i.name for i in session.get_inputs()}
        total = 0.0
        for feed, ref in reference:
            outs = session.run(None, {k: v for k, v in feed.items() if k in names})
            total += sum(float(np.abs(np.asarray(o, np.float64) - r).mean()) for o, r in zip(outs, ref))
        errors.append(total / max(1, len(reference)))
    kept = errors[0] < errors[1]
    logger.info("ort-cpu rule CPU7 guard: error %.4g corrected, %.4g not: %s", errors[0], errors[1],
                "kept" if kept else "left out")
    return {"kept": kept, "error_corrected": errors[0], "error_plain": errors[1], "samples": len(reference)}


def _adapted_storage(adapted) -> dict:
    """The storage keywords of `insert_qdq_pairs` a target form's adaptation gives (zero points, unsigned
    and narrow weights, full-range activations, range scales; empty where the form has none)."""
    return {"zero_points": adapted.zero_points, "unsigned_weights": adapted.unsigned_weights,
            "full_range": getattr(adapted, "full_range", ()),
            "narrow_weights": getattr(adapted, "narrow_weights", ()),
            "range_scales": getattr(adapted, "range_scales", {})}


def _all_integer(float_bytes: bytes, placement: Placement, table: ScaleTable, target_obj: Target, adapter,
                 calibrated: Mapping, fmt, config: QuantizeConfig, means=None, corrected=None):
    """The ort-cpu model with every site of ``placement`` (the placement before latency placement)
    quantized, from a fresh copy of the float model: ``(model, inserted, placement, requantization)``,
    or None when ``table`` lacks a range it needs. ``means``, ``corrected``: rule CPU7's (see
    `_correct_biases`)."""
    model = onnx.load_from_string(float_bytes)
    index = GraphIndex(model)
    adapted = adapter.adapt(index, placement, table, **calibrated)
    _correct_biases(model, index, adapted, means, {} if corrected is None else corrected)
    note = ("ort-cpu latency placement: every site kept integer, which ran faster as a whole model than "
            "keeping the slower sites float")
    placed = replace(adapted.placement, notes=adapted.placement.notes + (note,))
    storage = {**_adapted_storage(adapted), "precision": fmt.name, "block_size": config.block_size}
    try:
        qdq, inserted, _ = _rewrite(model, placed, adapted.table, target_obj, False, storage, adapted.finish)
    except ScalesError as exc:
        logger.info("ort-cpu latency placement: no all-integer alternative (%s)", exc)
        return None
    return qdq, inserted, placed, tuple(adapted.requantization)


#: Rounds of the whole-model guard at most: each keeps float the least-gaining half of the sites its
#: candidate still has integer (so 4 rounds go down to a sixteenth), rebuilds and times it once.
GUARD_ROUNDS = 4


def _fall_back(float_bytes: bytes, current, decision, table: ScaleTable, target_obj: Target, adapter,
               calibrated: Mapping, fmt, config: QuantizeConfig, options, feeds=None, means=None,
               corrected=None):
    """The whole-model guard of latency placement: the quantized model ``current`` (``(model,
    inserted, placement, requantization)``) timed slower than FP32, so the least-gaining half of its
    integer sites (`onnx_qat.placement.cpu_latency.fallback_sites`) is kept float too, the model is
    rebuilt from the same ranges, and FP32, the fastest quantized model so far and the rebuilt model are
    timed once more, interleaved. While the fastest is still not faster than FP32, the next round keeps
    float the least-gaining half of the sites the last candidate still has integer (at most
    `GUARD_ROUNDS` rounds; one op-by-op timing misses what a float site costs its neighbours, and on a
    many-core CPU whole chains of small integer ops lose). Returns the fastest quantized model with the
    record of what was tried, or ``current`` and None when no fallback can be built. The record: the
    last round's medians (``fp32_ms``; ``before_ms`` and ``fallback_ms``, the models that round timed;
    ``speedup`` of the fastest), ``chosen`` (``"fallback"`` when a rebuilt model is written),
    ``kept_float`` (the sites the written fallback keeps float beyond the first placement, or the first
    round's when none is written), ``best_ms`` (the written model's median in the last round) and
    ``rounds_tried`` (each round's own record)."""
    from .placement.cpu_latency import fallback_sites, fallback_timing

    placement_now = current[2]
    float_now = {r["node"] for r in decision.records} - {w.node for w in placement_now.weights}
    best, best_drops, tried, dropped = current, None, [], []
    while len(tried) < GUARD_ROUNDS:
        drop = fallback_sites(decision, exclude=float_now | set(dropped))
        if not drop:
            break
        built = _guard_candidate(float_bytes, placement_now, float_now, dropped + list(drop), decision,
                                 table, target_obj, adapter, calibrated, fmt, config, means, corrected)
        if built is None:
            break
        dropped += list(drop)
        timing = fallback_timing(float_bytes, best[0], built[0], options, feeds=feeds)
        record = {"kept_float": list(drop), **timing}
        logger.info("ort-cpu whole-model guard, round %d: %s", len(tried) + 1, record)
        tried.append(record)
        if timing["chosen"] == "fallback":
            best, best_drops = built, list(dropped)
        if timing["speedup"] > 1.0:
            break
    if not tried:
        return (*current, None)
    last = tried[-1]
    chosen = best_drops is not None
    best_ms = min(last["before_ms"], last["fallback_ms"]) if chosen else last["before_ms"]
    record = {**last, "chosen": "fallback" if chosen else "unchanged",
              "kept_float": best_drops if chosen else tried[0]["kept_float"], "best_ms": best_ms,
              "rounds_tried": tried}
    return (*best, record)


def _guard_candidate(float_bytes: bytes, placement_now, float_now, drop, decision, table, target_obj,
                     adapter, calibrated, fmt, config, means, corrected):
    """The model of one guard round: ``placement_now`` with the sites ``drop`` kept float too (besides
    ``float_now``), rebuilt from the same ranges: ``(model, inserted, placement, requantization)``, or
    None when nothing is left to quantize or the ranges do not fit."""
    import re

    from .placement.marks import Decision

    model = onnx.load_from_string(float_bytes)
    index = GraphIndex(model)
    excluded = tuple(re.escape(n) for n in sorted(float_now | set(drop)))
    placed = policy_for(target_obj).place(index, replace(config, exclude_nodes=tuple(config.exclude_nodes)
                                                         + excluded))
    if placed.empty:
        return None
    ours = {d.node: d for d in placement_now.decisions if d.node in float_now}
    by_node = {r["node"]: r for r in decision.records}
    for name in drop:
        record = by_node[name]
        ours[name] = Decision(name, record["op_type"], "skip", "CPU3",
                              f"kept float by the whole-model guard (model slower than FP32; this site's "
                              f"measured gain {record['gain']:.2f}x, among the least)")
    placed = replace(placed, decisions=tuple(ours.get(d.node, d) for d in placed.decisions))
    try:
        adapted = adapter.adapt(index, placed, table, **calibrated)
        _correct_biases(model, index, adapted, means, {} if corrected is None else corrected)
        note = (f"ort-cpu whole-model guard: the quantized model timed slower than FP32, so {len(drop)} "
                f"least-gaining site(s) were kept float too (e.g. {drop[0]!r}) and the model timed again")
        placed = _with_notes(adapted.placement, decision.notes + (note,))  # placed again: notes added back
        storage = {**_adapted_storage(adapted), "precision": fmt.name, "block_size": config.block_size}
        qdq, inserted, _ = _rewrite(model, placed, adapted.table, target_obj, False, storage, adapted.finish)
    except ScalesError as exc:
        logger.info("ort-cpu whole-model guard: no fallback model (%s)", exc)
        return None
    return qdq, inserted, placed, tuple(adapted.requantization)


def _with_notes(placement: Placement, notes) -> Placement:
    """``placement`` with those of ``notes`` it does not hold yet added after its own, in order."""
    return replace(placement, notes=placement.notes + tuple(n for n in notes if n not in placement.notes))


def _summary(placement: Placement, inserted) -> dict:
    counts = placement.counts()
    return {
        "nodes": counts["nodes"],
        "activations": counts["activations"],
        "weights": len(inserted.weights),
        "quantized_nodes": counts.get("nodes_quantize", 0),
        "skipped_nodes": counts.get("nodes_skip", 0),
        "quantize_linear": inserted.num_quantize,
        "dequantize_linear": inserted.num_dequantize,
    }


# --------------------------------------------------------------------------- I/O edge
def _io():
    """The model I/O edge (imported lazily so ``import onnx_qat`` stays fast)."""
    from .io import models as model_io

    return model_io


__all__ = ["rewrite_model", "QuantizeResult", "refuse_quantized", "nothing_to_quantize"]

