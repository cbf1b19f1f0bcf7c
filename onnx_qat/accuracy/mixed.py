"""Automatic mixed precision: the fewest sites left in float so the output cosine reaches a minimum.

The search runs in the gated session (`onnx_qat.accuracy.gated`), on ranges calibrated once:

1. every site quantized; done when that already reaches ``min_cosine``;
2. each site's harm: the output error with only it quantized (one run per site; for more than 16
   sites by group bisection, `onnx_qat.accuracy.bisect`, which measures alone only the sites
   whose group matters). Harm adds up across sites far better than the gain of leaving one site
   float does: with several broken sites, floating any single one gains little;
3. sites ordered by harm; a bisection over *k* finds the fewest leading sites whose float
   fallback reaches the minimum (within ``max_float_sites``);
4. pruning: each chosen site whose return to INT8 keeps the minimum goes back to INT8.

The chosen sites then become exclusions fed to the same placement (which resolves their
neighbours: a residual Add or Concat next to a float site is re-decided), the Q/DQ model is built
by the one inserter, and its cosine is measured again on the evaluation data. When the built model
misses the minimum, the next site in the order is added and the model is built again. The model is
built as the gated model was (`fold_scales=False`: rule TRT1's folds would round folded weights onto
the INT8 grid afresh, a model no trial measured).

With ``method="auto"`` (the default) the search also chooses each activation tensor's range among
``auto``'s candidates, and leaves a site float only where no range choice reaches the minimum
(`onnx_qat.accuracy.ranges`); the steps above are then the search with one fixed table, and the
minimum must also hold for the bound over the evaluation and calibration samples of
`onnx_qat.accuracy.judged`, the built model's included.

"Quantized" is in the format ``config.precision`` names (INT8, FP8, or INT4 weight-only, where a site
is one weight's blockwise DequantizeLinear); what differs per format is in
`onnx_qat.accuracy.format_settings`.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Optional, Sequence, Tuple

from ..errors import AccuracyError, ConfigError, PlacementError
from ..formats.numeric import get_format
from . import bisect
from .format_settings import precision_name
from .prepared import OutputError, Prepared, output_error, prepare
from .fewest import fewest_float, harm_order
from .judged import EVIDENCE
from .sites import site_exclusions, with_partners

logger = logging.getLogger(__name__)


def check_options(min_cosine, max_float_sites) -> None:
    """Refuse a ``min_cosine`` outside (0, 1] or a budget that is not a whole number >= 0."""
    if min_cosine is None:
        if max_float_sites is not None:
            raise ConfigError("max_float_sites is the budget of min_cosine; give min_cosine too")
        return
    if isinstance(min_cosine, bool) or not isinstance(min_cosine, (int, float)) or not 0 < min_cosine <= 1:
        raise ConfigError(f"min_cosine must be a number in (0, 1], got {min_cosine!r}")
    budget = max_float_sites
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise ConfigError(f"max_float_sites must be a whole number >= 0, got {max_float_sites!r}")


def search(prepared: Prepared, min_cosine: float, budget: int, progress: bool = True):
    """``(order, chosen, all_int8, estimate)``: the site indices by harm, the indices to leave float
    (None when the budget cannot reach ``min_cosine``), the all-INT8 error and the chosen setting's
    estimated error (the best one reached when none is chosen). A site always goes float with its
    partners (`with_partners`); the budget counts them all."""
    sites = prepared.sites
    n = len(sites)
    everything = frozenset(range(n))
    cache = {}

    def with_float(indices) -> OutputError:
        key = frozenset(with_partners(sites, indices))
        if key not in cache:
            cache[key] = prepared.error(everything - key)
        return cache[key]

    bar = _bar(n + 1 if n <= bisect.MIN_SITES else None, progress)
    try:
        all_int8 = with_float(())
        bar.update(1)
        if all_int8.cosine >= min_cosine:
            return tuple(range(n)), (), all_int8, all_int8
        if n <= bisect.MIN_SITES:
            found = bisect.exhaustive(prepared, "only", lambda: bar.update(1))
        else:
            found = bisect.screen(prepared, all_int8, "only", on_run=lambda: bar.update(1))
    finally:
        bar.close()
    losses = [found[k][0] for k in range(n)]  # output error with only this site in INT8
    order = harm_order(sites, found)
    chosen, best = fewest_float(sites, order, losses, with_float, min_cosine, budget, all_int8)
    return order, chosen, all_int8, best


def quantize_mixed(model, output, *, min_cosine: float, max_float_sites: Optional[int], eval_data, scales,
                   data, method: str, config, calib_kw: dict, report, progress: bool, workers=None):
    """[`onnx_qat.quantize`][onnx_qat.quantize.quantize] with automatic mixed precision (see the module
    docstring)."""
    import time

    from ..io.files import check_output_path
    from ..io.models import write_outputs
    start = time.perf_counter()
    inputs = tuple(p for p in (model, scales, data, eval_data) if isinstance(p, (str, os.PathLike)))
    out_path = None if output is None else check_output_path(output, inputs=inputs, what="output")
    if report is not None:
        check_output_path(report, inputs=inputs, what="report")
    if scales is not None and eval_data is None:
        raise ConfigError("min_cosine with scales needs eval_data to measure the output cosine on")
    kw = dict(calib_kw)
    batch_size = kw.pop("batch_size", 16)
    kw.pop("tensors", None)
    prepared, _ = prepare(model, data, scales=scales, method=method, eval_data=eval_data, config=config,
                          batch_size=batch_size, progress=progress, calibration_options=kw, workers=workers,
                          range_candidates=method == "auto")
    budget = len(prepared.sites) if max_float_sites is None else max_float_sites
    ranges = None
    with prepared:  # the settings on `workers` processes (onnx_qat.accuracy.parallel), stopped after
        if prepared.scale_inputs:  # auto's candidates: each tensor's range is searched too (in this process)
            from .ranges import search_ranges

            bar = _bar(None, progress)
            try:
                ranges, order, chosen, all_int8, estimate = search_ranges(prepared, min_cosine, budget,
                                                                          lambda: bar.update(1))
            finally:
                bar.close()
            prepared.table = _chosen_table(prepared.table, ranges)
        else:
            order, chosen, all_int8, estimate = search(prepared, min_cosine, budget, progress)
    if chosen is None:
        if budget >= len(prepared.sites):
            raise AccuracyError(f"output cosine {min_cosine:g} is reached only with every site in float "
                                f"(the float model itself): the best with one {precision_name(config)} "
                                f"site left is "
                                f"{estimate.cosine:.5f}; nothing was written")
        raise AccuracyError(_unreached(min_cosine, budget, estimate, prepared,
                                       None if ranges is None or ranges.judge is None else ranges.judge.last))
    chosen = list(chosen)
    judge = getattr(ranges, "judge", None)
    while True:
        result, verified, judged = _build(prepared, chosen, config, progress, judge)
        if verified.cosine >= min_cosine and (judged is None or judged.bound >= min_cosine):
            break
        more = [k for k in order if k not in chosen]
        grown = list(with_partners(prepared.sites, chosen + more[:1]))
        if not more or len(grown) > budget or len(grown) >= len(prepared.sites):
            raise AccuracyError(_unreached(min_cosine, budget, verified, prepared, judged))
        logger.info("built model reaches cosine %.5f (bound %s) < %g; leaving %s float too", verified.cosine,
                    "-" if judged is None else f"{judged.bound:.5f}", min_cosine,
                    prepared.sites[more[0]].name)
        chosen = grown
    info = _summary(prepared, chosen, all_int8, estimate, verified, min_cosine, max_float_sites, result,
                    time.perf_counter() - start)
    if ranges is not None:
        from .ranges import per_site

        info["ranges"] = {**ranges.records, "sites": per_site(ranges, chosen)}
    if judged is not None:
        info["judged"] = {**judged.to_dict(), "evaluation_samples": judge.eval_samples,
                          "calibration_samples": judge.calib_samples, "calibration_runs": judge.runs}
    if prepared.int4 is not None:
        result = dataclasses.replace(result, awq=prepared.int4.awq, gptq=prepared.int4.gptq)
    result = dataclasses.replace(result, output=out_path, accuracy=info)
    write_outputs(result.model, out_path, report, result.to_report, inputs=inputs)
    return result


def _chosen_table(table, ranges):
    """The ScaleTable of the range search's choice (its metadata naming each tensor's candidate)."""
    import json

    from ..scales import ScaleTable

    meta = {**table.metadata, "range_search": json.dumps(dict(sorted(ranges.choice.items())),
                                                         separators=(",", ":"))}
    return ScaleTable(dict(ranges.amax), producer=table.producer, metadata=meta, bounds=dict(table.bounds))


def _build(prepared: Prepared, chosen: Sequence[int], config, progress: bool, judge=None):
    """The Q/DQ model with ``chosen`` sites excluded from placement, its verified error and, with a
    usable ``judge`` (`onnx_qat.accuracy.judged.Judge`), its judged figure (else None)."""
    from ..rewrite import rewrite_model
    from ..runtime.sessions import make_session
    from ..runtime.stateful import carry_state
    from .gated import run_joined

    names = [prepared.sites[k].name for k in chosen]
    excluded = dataclasses.replace(config, exclude_nodes=tuple(config.exclude_nodes) + site_exclusions(names),
                                   int4_method=None)  # INT4: ranges and rounded weights come from prepare
    source = prepared.float_model if prepared.int4 is None else \
        prepared.int4.model(float_weights=[w for k in chosen for w in prepared.sites[k].weights])
    try:
        # the model every trial measured: the gated one keeps per-channel Mul/Add after its convolutions
        # (rule TRT1's folds would re-round those weights: a model no trial measured)
        result = rewrite_model(source, scales=prepared.table, data=None, method="max",
                                 config=excluded, calib_kw={}, progress=False, fold_scales=False)
    except PlacementError:  # the partners took every remaining site along
        raise AccuracyError("leaving these sites float leaves nothing quantized (the float model itself): "
                            + ", ".join(names[:8]) + "; nothing was written") from None
    session = carry_state(make_session(result.model, spin=False), prepared.evaluation)
    joined = run_joined(session, list(prepared.reference), prepared.feeds)
    judged = None
    if judge is not None and judge.usable:
        judged = judge.judged(joined, judge.model_outputs(session))
    return result, output_error(prepared.reference, joined), judged


def _weighted_share(result, float_model) -> Tuple[int, int]:
    """(weighted ops quantized, weighted ops) of a QuantizeResult's placement: the Conv,
    ConvTranspose, Gemm and MatMul nodes of ``float_model``'s main graph with a constant weight
    (an attention product of two activations has none, and is not counted)."""
    from ..graph.index import GraphIndex
    from ..graph.ops import WEIGHTED_OPS

    index = GraphIndex(float_model)
    weighted = {n.name for n in index.nodes if n.op_type in WEIGHTED_OPS
                and any(index.is_constant(t) for t in n.inputs[:2] if t)}
    decisions = [d for d in result.placement.decisions if d.node in weighted]
    return sum(d.action == "quantize" for d in decisions), len(decisions)


def _summary(prepared, chosen, all_int8, estimate, verified, min_cosine, max_float_sites, result,
             seconds) -> dict:
    int8, total = _weighted_share(result, prepared.float_model)
    info = {
        "min_cosine": min_cosine, "max_float_sites": max_float_sites,
        "float_sites": [prepared.sites[k].to_dict() for k in chosen],
        "sites": len(prepared.sites), "eval_samples": prepared.evaluation.num_samples,
        "cosine_before": all_int8.cosine, "cosine_estimate": estimate.cosine, "cosine_after": verified.cosine,
        "before": all_int8.to_dict(), "after": verified.to_dict(),
        "int8_weighted_ops": int8, "weighted_ops": total, "method": prepared.method,
        "runs": prepared.runs, "seconds": round(seconds, 3),
    }
    if result.precision != "int8":  # INT8 reports keep their fields as they were
        info.pop("int8_weighted_ops")
        info.update(precision=result.precision, quantized_weighted_ops=int8)
        if get_format(result.precision).weight_only:
            given = prepared.method == "given"
            rounding = prepared.table.producer if prepared.table.producer in ("awq", "gptq") else "rtn"
            info["weight_ranges"] = "given" if given else rounding
    return info


def _unreached(min_cosine, budget, best: OutputError, prepared, judged=None) -> str:
    samples = prepared.evaluation.num_samples
    bound = "" if judged is None or best.cosine < min_cosine else (
        f" (its bound over {judged.samples} evaluation and calibration samples, cosine less "
        f"{EVIDENCE:g} standard errors: {judged.bound:.5f})")
    return (f"output cosine {min_cosine:g} cannot be reached with at most {budget} of "
            f"{len(prepared.sites)} site{'' if len(prepared.sites) == 1 else 's'} left float: the best "
            f"reached is {best.cosine:.5f} on {samples} evaluation "
            f"sample{'' if samples == 1 else 's'}{bound}; nothing was written")


def _bar(total: int, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="mixed precision", unit="run", file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not progress)


__all__ = ["search", "quantize_mixed", "check_options"]
