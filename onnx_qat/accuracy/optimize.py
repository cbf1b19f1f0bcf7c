"""``optimize="accuracy"`` (``--optimize accuracy``): the post-training steps that measured best, each kept
only where it raises the output cosine on the evaluation data.

The steps, in order, on a private copy of the float model:

1. ``calibrate``: ranges with ``auto`` (or the ``method`` given) on the calibration data: the baseline,
   what plain `onnx_qat.quantize` gives;
2. ``equalize``: cross-layer equalization (`onnx_qat.accuracy.equalize`; float function unchanged), then the
   ranges calibrated again on the equalized model;
3. ``smooth``: activation smoothing (`onnx_qat.accuracy.smooth`, SmoothQuant-style; float function unchanged),
   then the ranges calibrated again;
4. ``ranges`` (with ``method="auto"``, the default): each activation's range chosen among ``auto``'s
   candidates by the output on the first half of the evaluation data
   (`onnx_qat.accuracy.ranges.tune_table`: the best whole table, then each harmful site's tensors),
   kept only when it also raises the cosine on the other half, which no range was chosen by (the
   choice fits the samples it is made on, so its gain there is not evidence). When either half has
   fewer than `RANGES_MIN_SAMPLES` samples, one whole table instead (``auto``'s candidates everywhere,
   `onnx_qat.accuracy.ranges.choose_table`), chosen on the first calibration samples with ``auto``'s
   paired rule (no evaluation sample decides it) and kept, as every step, only when it raises the
   cosine on the evaluation data;
5. ``reconstruct``: each INT8 weighted op's integers and bias fitted, in graph order, to the float
   model's output from the input it gets in the Q/DQ model, the least-squares weights put on the
   INT8 grid by GPTQ's error-compensated rounding (`onnx_qat.accuracy.reconstruct`);
6. ``bias``, when ``reconstruct`` was undone: the same pass with no weight fitted, each op's integers
   rounded to nearest and its bias corrected to the float model's mean output (empirical bias
   correction on the Q/DQ model's own inputs, ``reconstruct(..., weights=False)``): the weight fits
   can fit the calibration rows where the outputs are few (PP-OCR's angle classifier: 0.9926 against
   0.9958 for round to nearest on its judged lines), while the mean shift they leave in the logits is
   the same on every input.

After each step the Q/DQ model is built by the one inserter and its output cosine against the float
model measured on the evaluation data (``eval_data``, or the last quarter of ``data``, then not
calibrated on). A step that does not raise it is undone. The report (``QuantizeResult.accuracy``) lists
every step: its cosine, its gain over the step before, whether it was kept, its seconds and records.
Steps 5 and 6 apply to INT8; other precisions run steps 1 to 4.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import onnx

from ..errors import ConfigError, QatError

logger = logging.getLogger(__name__)

#: Values of ``optimize``.
OPTIMIZE = ("accuracy",)
#: Steps in the order they run.
STEPS = ("calibrate", "equalize", "smooth", "ranges", "reconstruct", "bias")
#: Evaluation samples the ranges step needs in each half (it chooses on one half and is kept only
#: when the other gains; with fewer, a choice fits its few samples: measured with 2 to 4 per half,
#: it was undone on each PP-OCRv4 model, after 110-320 s on the recognizer). Below it the step only
#: chooses one whole table, on the calibration samples (`onnx_qat.accuracy.ranges.choose_table`).
RANGES_MIN_SAMPLES = 8


def check_optimize(optimize) -> Optional[str]:
    """``optimize`` validated (None or one of `OPTIMIZE`)."""
    if optimize is None:
        return None
    if optimize not in OPTIMIZE:
        raise ConfigError(f"optimize must be one of {', '.join(OPTIMIZE)}, got {optimize!r}")
    return optimize


def quantize_optimized(model, output, *, data, eval_data, method: str, config, calib_kw: dict, report,
                       progress: bool):
    """`onnx_qat.quantize` with ``optimize="accuracy"`` (see the module docstring)."""
    import dataclasses
    import os

    from ..calibration import calibrate
    from ..io.files import check_output_path
    from ..formats.numeric import get_format
    from ..io.models import load_model, write_outputs
    from ..graph.index import assign_node_names
    from ..rewrite import refuse_quantized
    from .prepared import split_data

    start = time.perf_counter()
    inputs = tuple(p for p in (model, data, eval_data) if isinstance(p, (str, os.PathLike)))
    out_path = None if output is None else check_output_path(output, inputs=inputs, what="output")
    if report is not None:
        check_output_path(report, inputs=inputs, what="report")
    fmt = get_format(config.precision)
    if fmt.weight_only:
        raise ConfigError(f"optimize='accuracy' needs activation ranges; precision {fmt.name} is weight-only")
    float_model = load_model(model, min_opset=fmt.min_opset)
    refuse_quantized(float_model)
    assign_node_names(float_model)
    calib, evaluation = split_data(data, eval_data, float_model)
    kw = {k: v for k, v in calib_kw.items() if k != "tensors"}
    batch_size = kw.get("batch_size", 16)
    judge = _Judge(float_model, evaluation, config, batch_size)

    def calibrated(source):
        return calibrate(source, calib, method=method, config=config, progress=progress, **kw)

    steps = []
    clock = time.perf_counter()
    table = calibrated(float_model)
    best = judge(float_model, table)
    steps.append(_step("calibrate", best, None, True, clock, method=method))

    def attempt(name, clock, trial, found, table_of, note, **details):
        """Judge the edited copy ``trial`` (when its step ``found`` anything to do) with the table
        ``table_of()`` gives, record the step, and keep the edit only where the cosine rises."""
        nonlocal float_model, table, best
        if not found:
            steps.append(_step(name, best, best, False, clock, note=note, **details))
            return
        trial_table = table_of()
        cosine = judge(trial, trial_table)
        kept = cosine > best.cosine
        steps.append(_step(name, cosine, best, kept, clock, **details))
        if kept:
            float_model, table, best = trial, trial_table, cosine

    clock = time.perf_counter()
    trial = _copy(float_model)
    from .equalize import equalize

    pairs = equalize(trial)
    attempt("equalize", clock, trial, pairs, lambda: calibrated(trial), "no Conv pair to equalize",
            pairs=list(pairs))

    clock = time.perf_counter()
    trial = _copy(float_model)
    from .smooth import smooth

    tensors = smooth(trial, calib, batch_size=batch_size)
    attempt("smooth", clock, trial, tensors, lambda: calibrated(trial),
            "no activation with uneven channel ranges the graph can absorb", tensors=list(tensors))

    if method == "auto":
        clock = time.perf_counter()
        choose, held_out = _halves(evaluation)
        few = held_out is None or min(choose.num_samples, held_out.num_samples) < RANGES_MIN_SAMPLES
        if few:
            from .ranges import choose_table

            chosen, records = choose_table(float_model, calib, evaluation, config=config, weights=table,
                                           batch_size=batch_size, progress=progress)
            few_note = (f"{evaluation.num_samples} evaluation samples, fewer than {RANGES_MIN_SAMPLES} "
                        "in each half to choose ranges on: ")
            why = "the calibration samples cannot judge a table (stateful data)" if chosen is None else \
                records.get("paired_note") or "no whole table beat auto's on the calibration samples"
            attempt("ranges", clock, float_model, chosen is not None and chosen is not table, lambda: chosen,
                    few_note + why,
                    mode="whole table", **records)
        else:
            from .ranges import tune_table

            tuned, records = tune_table(float_model, calib, choose, config=config, weights=table,
                                        batch_size=batch_size, progress=progress)
            other = _Judge(float_model, held_out, config, batch_size)
            held = {"held_out_before": float(other(float_model, table)),
                    "held_out_after": float(other(float_model, tuned)),
                    "held_out_samples": held_out.num_samples}
            gains = held["held_out_after"] > held["held_out_before"]
            attempt("ranges", clock, float_model, gains, lambda: tuned,
                    "the chosen ranges did not raise the cosine on the held-out evaluation samples",
                    start=records.get("start"), changes=list(records.get("changes", [])),
                    unconfirmed=list(records.get("unconfirmed", [])), confirmed=records.get("confirmed"),
                    runs=records.get("runs"), **held)

    if fmt.name == "int8":
        from .reconstruct import changed, reconstruct

        clock = time.perf_counter()
        trial = _copy(float_model)
        qdq = _copy(best.result.model)
        records, ranges = reconstruct(trial, qdq, best.placement, calib, batch_size=batch_size)
        attempt("reconstruct", clock, trial, changed(records), lambda: table.merged(_weights(ranges)),
                "no weighted op could be reconstructed", layers=list(records))

        clock = time.perf_counter()
        if steps[-1]["kept"]:
            steps.append(_step("bias", best, best, False, clock,
                               note="reconstruct kept: its biases are corrected already"))
        else:
            trial = _copy(float_model)
            qdq = _copy(best.result.model)
            records, _ = reconstruct(trial, qdq, best.placement, calib, batch_size=batch_size, weights=False)
            attempt("bias", clock, trial, changed(records), lambda: table,
                    "no INT8 weighted op has a bias to correct", layers=list(records))

    result = best.result
    info = {"optimize": "accuracy", "steps": steps, "cosine_before": steps[0]["cosine"],
            "cosine_after": best.cosine, "eval_samples": evaluation.num_samples,
            "calibration_samples": calib.num_samples, "seconds": round(time.perf_counter() - start, 3)}
    result = dataclasses.replace(result, output=out_path, accuracy=info)
    write_outputs(result.model, out_path, report, result.to_report, inputs=inputs)
    return result


class _Measured(float):
    """An output cosine that remembers the Q/DQ model it was measured on."""

    def __new__(cls, cosine: float, result):
        value = super().__new__(cls, cosine)
        value.result = result
        value.placement = result.placement
        return value

    @property
    def cosine(self) -> float:
        return float(self)


class _Judge:
    """Builds the Q/DQ model of a float model and a table, and measures its output cosine against the
    original float model on the evaluation data."""

    def __init__(self, float_model, evaluation, config, batch_size: int):
        from ..runtime.sessions import run_model

        self.config, self.batch_size = config, batch_size
        self.feeds = evaluation
        reference = run_model(float_model, evaluation, batch_size=batch_size)
        self.reference = {k: v.ravel() for k, v in reference.items() if v.dtype.kind == "f"}

    def __call__(self, float_model, table) -> _Measured:
        from ..rewrite import rewrite_model
        from ..runtime.sessions import run_model
        from .prepared import output_error

        # the recipe's steps fit weights against the float model's own Conv outputs: its graph unfolded
        result = rewrite_model(float_model, scales=table, data=None, method="max", config=self.config,
                                 calib_kw={}, progress=False, fold_scales=False)
        got = run_model(result.model, self.feeds, batch_size=self.batch_size)
        cosine = output_error(self.reference, {k: got[k].ravel() for k in self.reference}).cosine
        return _Measured(cosine, result)


def _step(name: str, cosine, before, kept: bool, clock: float, **details) -> dict:
    record = {"step": name, "cosine": float(cosine),
              "gain": None if before is None else float(cosine) - float(before), "kept": kept,
              "seconds": round(time.perf_counter() - clock, 3), **details}
    logger.info("optimize accuracy: %s: cosine %.5f%s", name, float(cosine),
                "" if before is None else f" ({'kept' if kept else 'undone'})")
    return record


def _halves(evaluation):
    """``(first half, second half)`` of the evaluation samples: the ranges step chooses on the first and
    is kept only when it also gains on the second (``(evaluation, None)`` when it cannot be split)."""
    try:
        return evaluation.split(0.5)
    except QatError:
        return evaluation, None


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _weights(ranges):
    from ..scales import ScaleTable

    return ScaleTable(weights=ranges)


__all__ = ["quantize_optimized", "check_optimize", "OPTIMIZE", "STEPS"]
