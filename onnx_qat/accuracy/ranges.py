"""Automatic mixed precision that also chooses ranges: each tensor's range method and the float sites.

`auto`'s one calibration pass gives every activation tensor several candidate ranges (``max``,
``percentile(99.9 / 99.99 / 99.999)``, ``mse``, ``entropy``: `Calibration.options`). In the gated
session (`onnx_qat.accuracy.gated`) the activation scales are graph inputs, so a setting is a set
of quantized sites *and* a range per tensor; every trial is one call of
[`Prepared.error`][onnx_qat.accuracy.prepared.Prepared.error]. The search:

1. **whole tables**: every site in INT8 under each whole table (`WHOLE_TABLES`: ``auto``'s per-tensor
   table, then ``max``, ``entropy``, ``mse`` and ``percentile(99.99)`` everywhere); the one with the
   highest evaluation cosine is the start (keeping the per-tensor table unless another is `better` was
   measured worse on real models: docs/changelog.md). Done when it reaches ``min_cosine``;
2. **harm**: each site's output error with only it quantized (group bisection for more than 16
   sites, as the plain search);
3. **ranges**: for the sites measured alone, most harmful first, each activation tensor's other
   candidates are tried with every site in INT8 (a scale group changes as one); the best is kept when
   it raises the output cosine by more than `min_gain`, on at least `MIN_SAMPLE_SHARE` of the
   evaluation samples taken alone (`better`; samples whose reference output is empty,
   `EMPTY_SHARE`, do not vote), and when it also raises the output cosine on the first
   calibration samples, which no trial was chosen by (`Confirmation`; changes that fail this are
   recorded as ``unconfirmed``). Stops as soon as ``min_cosine`` is reached;
4. **float sites**: the sites whose harm changed are measured again, then the fewest leading sites in
   harm order whose fallback reaches the minimum, pruned (`onnx_qat.accuracy.fewest.fewest_float`);
5. **ranges before float**: each float site, least harmful first, goes back to INT8 when some
   candidate range of its tensors keeps the minimum.

"Reaches ``min_cosine``", in every step, is `RangeSearch.reaches`: the evaluation cosine reaches it
and so does the bound over the evaluation and calibration samples of `onnx_qat.accuracy.judged`
(the calibration samples run only for settings whose evaluation cosine reaches it).

Each accepted change becomes the gated runner's reference (`GatedRunner.set_reference`), so every
later trial differs from it in one tensor or site and runs only the graph after it.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from . import bisect
from .fewest import fewest_float, harm_order
from .judged import Judge
from .prepared import OutputError, Prepared, output_error
from .sites import with_partners

logger = logging.getLogger(__name__)

#: The whole tables tried first, in this order (ties keep the earlier one): ``tensor`` is ``auto``'s
#: per-tensor table (each tensor's least-error candidate), the others one candidate everywhere.
WHOLE_TABLES = ("tensor", "max", "entropy", "mse", "percentile(99.99)")
#: The whole tables `choose_table` judges on the calibration samples, in this order, after the table
#: ``auto`` chose: ``auto``'s per-tensor table, then each candidate of `CANDIDATES` everywhere.
START_TABLES = ("tensor", "max", "percentile(99.999)", "percentile(99.99)", "percentile(99.9)", "mse",
                "entropy")
#: Candidate ranges per tensor, in the order they are tried.
CANDIDATES = ("max", "percentile(99.999)", "percentile(99.99)", "percentile(99.9)", "mse", "entropy")
#: A candidate within this relative distance of one already listed for the tensor is the same range.
SAME_RANGE = 0.01
#: A range change is kept only when it raises the output cosine by more than this share of the loss
#: left (1 - cosine), and never by less than `MIN_GAIN_FLOOR`: gains below that are noise of the
#: evaluation data more often than they carry over to other inputs.
MIN_GAIN_SHARE = 0.005
MIN_GAIN_FLOOR = 1e-6


#: ... and only when it raises the cosine of at least this share of the evaluation samples, each
#: taken alone (a sign test against a gain that a few samples make: with 4 samples, 3 of them).
MIN_SAMPLE_SHARE = 2 / 3

#: A sample is *empty* in an output when its reference energy there (the sum of squares of the float
#: model's output for that sample) is at most this share of the median over the samples (or zero):
#: its cosine there is fixed at 1.0 (zero output) or set by the quantization noise alone (an output
#: whose every element is about 3% of a typical sample's), so it says nothing about a range change.
#: A sample empty in every output does not vote in the sign test (`sample_cosines`, `better`).
EMPTY_SHARE = 1e-3


#: Calibration samples a range change is confirmed on (`Confirmation`), at most.
CONFIRM_SAMPLES = 64


def min_gain(error: OutputError) -> float:
    """The least cosine gain that keeps a range change (see `MIN_GAIN_SHARE`)."""
    return max(MIN_GAIN_FLOOR, MIN_GAIN_SHARE * (1.0 - error.cosine))


def sample_cosines(prepared: Prepared, outputs: Mapping[str, np.ndarray]) -> Optional[np.ndarray]:
    """The worst output cosine of each evaluation sample alone over the outputs it is not empty in
    (`EMPTY_SHARE`); NaN for a sample empty in every output (it does not vote in `better`). None where
    the outputs cannot be split by sample: a stateful or unbatched dataset, or outputs whose size the
    sample count does not divide."""
    data = prepared.evaluation
    samples = getattr(data, "num_samples", 0)
    if not samples or getattr(data, "state", None) or getattr(data, "unbatched", True):
        return None
    worst = np.full(samples, np.inf)
    for name, ref in prepared.reference.items():
        if ref.size % samples:
            return None
        r = ref.reshape(samples, -1)
        c = np.asarray(outputs[name], dtype=np.float64).reshape(samples, -1)
        energy, got = np.einsum("ij,ij->i", r, r), np.einsum("ij,ij->i", c, c)
        norms = np.sqrt(energy * got)
        cosine = np.einsum("ij,ij->i", r, c) / np.where(norms > 0, norms, 1.0)  # 0 for a zero output
        worst = np.minimum(worst, np.where(empty_samples(energy), np.inf, cosine))
    return np.where(np.isfinite(worst), worst, np.nan)


def empty_samples(energy: np.ndarray) -> np.ndarray:
    """Which samples of one output, of reference energies ``energy`` (each sample's sum of squares),
    are empty (`EMPTY_SHARE`)."""
    energy = np.asarray(energy, np.float64)
    return (energy <= EMPTY_SHARE * float(np.median(energy))) | (energy <= 0)


def better(trial: OutputError, trial_samples, current: OutputError, current_samples) -> bool:
    """Whether a trial beats the current setting: a cosine gain above `min_gain`, on at least
    `MIN_SAMPLE_SHARE` of the samples when they can be told apart. Samples whose cosine is NaN in
    either setting (empty samples, `sample_cosines`) do not vote; with none left, the gain decides."""
    if trial.cosine <= current.cosine + min_gain(current):
        return False
    if trial_samples is None or current_samples is None:
        return True
    trial_samples, current_samples = np.asarray(trial_samples), np.asarray(current_samples)
    voting = ~(np.isnan(trial_samples) | np.isnan(current_samples))
    voters = int(np.count_nonzero(voting))
    if not voters:
        return True
    return int(np.count_nonzero(trial_samples[voting] > current_samples[voting])) >= \
        math.ceil(MIN_SAMPLE_SHARE * voters - 1e-9)


class Confirmation:
    """The output cosine on samples the search does not judge on: the first `CONFIRM_SAMPLES` of the
    calibration data (the candidate ranges come from their statistics, but no trial is chosen by their
    outputs). A range change the evaluation samples choose is kept only when it raises this cosine
    too (`tune`). One whole run of the gated session per check, on the session the search already
    has; ``usable`` is False (nothing confirmed) without calibration data, with a stateful model or
    with settings on workers."""

    def __init__(self, prepared: Prepared, batch_size: int = 16):
        runner = getattr(prepared.runner, "runner", None)
        data = prepared.calibration
        self.usable = runner is not None and data is not None and not getattr(data, "state", None) \
            and bool(prepared.scale_inputs)
        self.runs = 0
        self._energy = None  # of the reference outputs, once `judged` needs it
        if not self.usable:
            return
        self.prepared, self.runner = prepared, runner
        self.data = data.take(CONFIRM_SAMPLES)
        self.feeds = tuple(self.data.batches(batch_size))
        self.reference = {k: v.astype(np.float64) for k, v in self._outputs((), None).items()}

    def _outputs(self, on, scales) -> Dict[str, np.ndarray]:
        from .gated import join_flat

        return {name: join_flat(v) for name, v in self._batches(on, scales).items()}

    def _batches(self, on, scales) -> Dict[str, list]:
        runner = self.runner
        switches = {**runner._gates(set(on)), **runner.scales, **dict(scales or {})}
        parts: Dict[str, list] = {name: [] for name in runner.outputs}
        for feed in self.feeds:
            for name, value in zip(runner.outputs, runner.session.run(runner.outputs, {**feed, **switches})):
                parts[name].append(np.asarray(value))
        return parts

    def cosine(self, float_sites: Sequence[int], amax: Mapping[str, float]) -> float:
        """Output cosine with ``float_sites`` float and every other site quantized under ``amax``."""
        from .gated import join_flat

        batches = self.batch_outputs(float_sites, amax)
        return output_error(self.reference, {name: join_flat(v) for name, v in batches.items()}).cosine

    def judged(self, float_sites: Sequence[int], amax: Mapping[str, float]) -> Tuple[float, np.ndarray]:
        """`cosine`, and each calibration sample's output error (`onnx_qat.calibration.choice.sample_errors`:
        its squared error as a share of each output's energy, the terms the cosine sums)."""
        from ..calibration.choice import output_energy, sample_errors
        from .gated import join_flat

        batches = self.batch_outputs(float_sites, amax)
        if self._energy is None:
            self._energy = output_energy(self.reference)
        errors = sample_errors(self.reference, {o: batches[o] for o in self.reference}, self._energy)
        joined = {name: join_flat(v) for name, v in batches.items()}
        return output_error(self.reference, joined).cosine, errors

    def batch_outputs(self, float_sites: Sequence[int], amax: Mapping[str, float]) -> Dict[str, list]:
        """The outputs, batch by batch, with ``float_sites`` float and the other sites under ``amax`` (one
        whole run of the gated session on the confirmation samples; `Judge.judged` uses it too)."""
        sites = self.prepared.sites
        on = set(range(len(sites))) - set(with_partners(sites, float_sites))
        self.runs += 1
        return self._batches(on, self.prepared.scale_feeds(amax))


@dataclass
class RangeSearch:
    """The state of one search (see the module docstring): the table, each tensor's candidate, the
    float sites, and what each step did (``records``)."""

    prepared: Prepared
    amax: Dict[str, float]
    choice: Dict[str, str]
    float_sites: Tuple[int, ...] = ()
    records: Dict[str, object] = field(default_factory=dict)
    on_run: Optional[Callable[[], None]] = None
    samples: Optional[np.ndarray] = None  # each evaluation sample's cosine in the current setting
    confirm: Optional[Confirmation] = None  # the samples a kept range change must also gain on
    confirmed: Optional[float] = None  # their cosine in the current setting
    judge: Optional[Judge] = None  # what the target is judged on (onnx_qat.accuracy.judged)
    reached: bool = False  # whether `tune` left the current setting at the target

    def evaluate(self, float_sites: Sequence[int] = (), amax: Optional[Mapping[str, float]] = None
                 ) -> OutputError:
        """The one evaluation every trial is: output error with ``float_sites`` (and their partners)
        float, every other site quantized, under ``amax`` (default: the current table)."""
        return self.evaluate_samples(float_sites, amax)[0]

    def evaluate_samples(self, float_sites: Sequence[int] = (), amax: Optional[Mapping[str, float]] = None):
        """`evaluate`, and each evaluation sample's cosine (`sample_cosines`)."""
        error, outputs = self.evaluate_outputs(float_sites, amax)
        return error, sample_cosines(self.prepared, outputs)

    def evaluate_outputs(self, float_sites: Sequence[int] = (), amax: Optional[Mapping[str, float]] = None):
        """`evaluate`, and the outputs (flattened and joined over the evaluation data)."""
        sites = self.prepared.sites
        on = set(range(len(sites))) - set(with_partners(sites, float_sites))
        if self.on_run is not None:
            self.on_run()
        prepared = self.prepared
        outputs = prepared.runner.run(on, prepared.scale_feeds(self.amax if amax is None else amax))
        return output_error(prepared.reference, outputs), outputs

    def reaches(self, min_cosine: float, float_sites: Sequence[int] = (),
                amax: Optional[Mapping[str, float]] = None, error: Optional[OutputError] = None,
                outputs: Optional[Mapping[str, np.ndarray]] = None) -> bool:
        """Whether a setting reaches ``min_cosine``: its evaluation cosine and, with a usable `judge`,
        the bound over the evaluation and calibration samples (`onnx_qat.accuracy.judged`).
        ``error`` and ``outputs``: the setting's evaluation figures when already run."""
        if error is not None and error.cosine < min_cosine:
            return False
        if self.judge is None or not self.judge.usable:
            return (error if error is not None else self.evaluate(float_sites, amax)).cosine >= min_cosine
        if error is None or outputs is None:
            error, outputs = self.evaluate_outputs(float_sites, amax)
        return self.judge.reaches(min_cosine, error, outputs, with_partners(self.prepared.sites, float_sites),
                                  self.amax if amax is None else amax)

    def accept(self, amax: Mapping[str, float], float_sites: Sequence[int], default: bool = False) -> None:
        """Make ``amax`` and ``float_sites`` current, and the runner's reference."""
        self.amax = dict(amax)
        self.float_sites = with_partners(self.prepared.sites, float_sites)
        on = set(range(len(self.prepared.sites))) - set(self.float_sites)
        self.prepared.runner.set_reference(on, self.prepared.scale_feeds(self.amax), default=default)


def candidates(options: Mapping[str, float]) -> List[Tuple[str, float]]:
    """``[(candidate, amax)]`` of one tensor in `CANDIDATES` order, a range within `SAME_RANGE` of an
    earlier one left out."""
    out: List[Tuple[str, float]] = []
    for name in CANDIDATES:
        amax = options.get(name)
        if amax is None or any(abs(amax - a) <= SAME_RANGE * max(a, amax) for _, a in out):
            continue
        out.append((name, float(amax)))
    return out


def candidate_name(options: Mapping[str, float], amax: float) -> str:
    """The candidate of ``options`` whose range is ``amax`` (``auto``'s per-tensor table names one)."""
    for name in CANDIDATES:
        if name in options and abs(options[name] - amax) <= 1e-6 * max(amax, 1e-30):
            return name
    return "auto"


def whole_table(prepared: Prepared, name: str) -> Tuple[Dict[str, float], Dict[str, str]]:
    """``(amax, choice)`` of whole table ``name`` (`WHOLE_TABLES`) over every calibrated tensor."""
    base = dict(prepared.table.activations)
    if name == "tensor":
        return base, {t: candidate_name(prepared.options.get(t, {}), a) for t, a in base.items()}
    amax = {t: float(prepared.options.get(t, {}).get(name, a)) for t, a in base.items()}
    return amax, {t: name if name in prepared.options.get(t, {}) else "max" for t in base}


def groups_of(prepared: Prepared) -> Dict[str, Tuple[str, ...]]:
    """Tensor -> the tensors sharing its scale (rule 7's Concat groups; a tensor alone otherwise)."""
    members: Dict[str, List[str]] = {}
    for mark in prepared.placement.activations:
        if mark.scale_group:
            members.setdefault(mark.scale_group, []).append(mark.tensor)
    out = {}
    for mark in prepared.placement.activations:
        out[mark.tensor] = tuple(members[mark.scale_group]) if mark.scale_group else (mark.tensor,)
    return out


def start(state: RangeSearch) -> OutputError:
    """Step 1: the best whole table, made current (every site INT8)."""
    cosines, best, best_error = {}, None, None
    for name in WHOLE_TABLES:
        amax, choice = whole_table(state.prepared, name)
        error, samples = state.evaluate_samples((), amax)
        cosines[name] = error.cosine
        if best_error is None or error.cosine > best_error.cosine:
            best, best_error, best_choice, best_amax = name, error, choice, amax
            state.samples = samples
    state.choice = best_choice
    state.accept(best_amax, (), default=True)
    state.records.update(start=best, whole_tables=cosines)
    logger.info("range search: whole tables %s; starting from %s",
                ", ".join(f"{k} {v:.5f}" for k, v in cosines.items()), best)
    return best_error


def tune(state: RangeSearch, site_order: Sequence[int], current: OutputError, min_cosine: float,
         float_sites: Sequence[int] = ()) -> OutputError:
    """Step 3: for each site of ``site_order`` (not float), each of its activation tensors' other
    candidates in the current setting; the best kept when it gains more than `min_gain`. Stops at
    ``min_cosine``. Returns the current error."""
    prepared = state.prepared
    groups = groups_of(prepared)
    tried = set()
    changes = state.records.setdefault("changes", [])
    reached = state.reached = state.reaches(min_cosine, float_sites, None, current)
    for k in site_order:
        if reached:
            break
        if k in state.float_sites:
            continue
        for tensor in prepared.sites[k].activations:
            group = groups.get(tensor, (tensor,))
            if group in tried or tensor not in prepared.options or tensor not in prepared.scale_inputs:
                continue
            tried.add(group)
            best, best_error, best_samples = None, current, state.samples
            for name, amax in candidates(prepared.options[tensor]):
                if name == state.choice.get(tensor):
                    continue
                trial = dict(state.amax)
                trial.update({t: prepared.options.get(t, {}).get(name, amax) for t in group})
                error, samples = state.evaluate_samples(float_sites, trial)
                if better(error, samples, best_error, best_samples) and \
                        better(error, samples, current, state.samples):
                    best, best_error, best_samples = (name, trial), error, samples
            if best is None:
                continue
            name, trial = best
            if state.confirm is not None and state.confirm.usable:
                if state.confirmed is None:
                    state.confirmed = state.confirm.cosine(float_sites, state.amax)
                confirmed = state.confirm.cosine(float_sites, trial)
                if confirmed <= state.confirmed:
                    state.records.setdefault("unconfirmed", []).append(
                        {"site": prepared.sites[k].name, "tensors": list(group), "to": name,
                         "cosine_after": best_error.cosine, "confirm_before": state.confirmed,
                         "confirm_after": confirmed})
                    logger.info("range search: %s on %s not confirmed on the calibration samples "
                                "(%.5f -> %.5f)", name, ", ".join(group), state.confirmed, confirmed)
                    continue
                state.confirmed = confirmed
            changes.append({"site": prepared.sites[k].name, "tensors": list(group),
                            "from": state.choice.get(tensor, "auto"), "to": name,
                            "cosine_before": current.cosine, "cosine_after": best_error.cosine})
            logger.info("range search: %s -> %s on %s: cosine %.5f -> %.5f", state.choice.get(tensor),
                        name, ", ".join(group), current.cosine, best_error.cosine)
            for t in group:
                state.choice[t] = name
            state.accept(trial, float_sites)
            current, state.samples = best_error, best_samples
            reached = state.reached = state.reaches(min_cosine, float_sites, None, current)
            if reached:
                break
    if state.confirm is not None and state.confirm.runs:
        state.records["confirm_runs"] = state.confirm.runs
    return current


def search_ranges(prepared: Prepared, min_cosine: float, budget: int, on_run=None):
    """The whole search (module docstring): ``(state, order, chosen, all_int8, estimate)`` as
    `onnx_qat.accuracy.mixed.search` gives them (``all_int8``: every site INT8 under the start table),
    with ``state`` the chosen table and what each step did; ``chosen`` is None when the budget
    cannot reach ``min_cosine``."""
    sites = prepared.sites
    n = len(sites)
    confirm = Confirmation(prepared)
    state = RangeSearch(prepared, dict(prepared.table.activations), {}, on_run=on_run, confirm=confirm,
                        judge=Judge(prepared, confirm))
    runs = state.records.setdefault("runs", {})
    counted = prepared.runner.runs

    def step_done(name: str) -> None:
        nonlocal counted
        runs[name] = prepared.runner.runs - counted
        counted = prepared.runner.runs

    all_int8 = current = start(state)
    step_done("whole_tables")
    if state.reaches(min_cosine, (), None, current):
        return state, tuple(range(n)), (), all_int8, current
    run = (lambda: on_run()) if on_run is not None else None
    if n <= bisect.MIN_SITES:
        found = bisect.exhaustive(prepared, "only", run)
    else:
        found = bisect.screen(prepared, current, "only", on_run=run)
    step_done("harm")
    order = harm_order(sites, found)
    alone = [k for k in order if found[k][1] == 1 and 1.0 - found[k][0].cosine >= bisect.threshold(current)]
    before = dict(state.amax)
    current = tune(state, alone, current, min_cosine)
    state.records["tuned"] = current.cosine
    step_done("ranges")
    if state.reached:
        return state, order, (), all_int8, current
    prepared.runner.set_reference(range(n), prepared.scale_feeds(state.amax), default=True)
    changed = {t for t in state.amax if state.amax[t] != before.get(t)}
    found = dict(found)
    for k in alone:  # the harm of a site whose ranges changed, measured again
        if changed & set(sites[k].activations):
            found[k] = (prepared.error((k,), state.amax), 1)
            if on_run is not None:
                on_run()
    order = harm_order(sites, found)
    losses = [found[k][0] for k in range(n)]
    cache: Dict[frozenset, Tuple[OutputError, bool]] = {}

    def measured(indices) -> Tuple[OutputError, bool]:
        key = frozenset(with_partners(sites, indices))
        if key not in cache:
            error, outputs = state.evaluate_outputs(tuple(key))
            cache[key] = error, state.reaches(min_cosine, tuple(key), None, error, outputs)
        return cache[key]

    chosen, estimate = fewest_float(sites, order, losses, lambda k: measured(k)[0], min_cosine, budget,
                                    current, reaches=lambda k: measured(k)[1])
    step_done("float_sites")
    if chosen is None:
        return state, order, None, all_int8, estimate
    chosen, estimate = back_to_int8(state, order, list(chosen), estimate, min_cosine)
    step_done("back_to_int8")
    return state, order, tuple(chosen), all_int8, estimate


def back_to_int8(state: RangeSearch, order: Sequence[int], chosen: List[int], estimate: OutputError,
                 min_cosine: float):
    """Step 5: each float site, least harmful first, back in INT8 with the first of its tensors'
    candidate ranges that keeps ``min_cosine``. ``(chosen, error)``."""
    prepared = state.prepared
    sites = prepared.sites
    groups = groups_of(prepared)
    returned = state.records.setdefault("returned", [])
    for k in [k for k in reversed(order) if k in chosen]:
        rest = [i for i in chosen if i != k]
        if not rest or len(with_partners(sites, rest)) != len(rest):
            continue  # a site that goes float with a residual partner stays with it
        for tensor in sites[k].activations:
            if tensor not in prepared.options or tensor not in prepared.scale_inputs:
                continue
            group = groups.get(tensor, (tensor,))
            for name, amax in candidates(prepared.options[tensor]):
                if name == state.choice.get(tensor):
                    continue
                trial = dict(state.amax)
                trial.update({t: prepared.options.get(t, {}).get(name, amax) for t in group})
                error, outputs = state.evaluate_outputs(rest, trial)
                if state.reaches(min_cosine, rest, trial, error, outputs):
                    returned.append({"site": sites[k].name, "tensors": list(group),
                                     "from": state.choice.get(tensor, "auto"), "to": name,
                                     "cosine": error.cosine})
                    for t in group:
                        state.choice[t] = name
                    state.amax = trial
                    chosen, estimate = rest, error
                    break
            if k not in chosen:
                break
    return chosen, estimate


def tune_table(float_model, data, eval_data, *, config, weights=None, batch_size: int = 16,
               progress: bool = False):
    """``optimize="accuracy"``'s ``ranges`` step: every site in INT8, the best whole table and then each
    harmful site's activation ranges chosen among ``auto``'s candidates (steps 1-3 of the search, never
    stopping early). Returns ``(ScaleTable, records)``: the chosen activation ranges (with the weight
    ranges of ``weights``, a ScaleTable or None, kept) and what each step did. When ``weights`` has
    activation ranges and the chosen ones do not raise the output cosine on the first calibration
    samples over them (`Confirmation`), ``weights``' own activation ranges are returned instead
    (``records["confirmed"]`` False, with both cosines)."""
    from ..scales import ScaleTable

    prepared, _ = prepare_candidates(float_model, data, eval_data, config, batch_size, progress, weights)
    state = RangeSearch(prepared, dict(prepared.table.activations), {}, confirm=Confirmation(prepared))
    current = start(state)
    n = len(prepared.sites)
    found = bisect.exhaustive(prepared, "only") if n <= bisect.MIN_SITES else \
        bisect.screen(prepared, current, "only")
    order = harm_order(prepared.sites, found)
    alone = [k for k in order if found[k][1] == 1 and 1.0 - found[k][0].cosine >= bisect.threshold(current)]
    current = tune(state, alone, current, 1.1)
    state.records.update(tuned=current.cosine, runs=prepared.runner.runs,
                         sites=per_site(state, ()))
    given = dict(weights.activations) if weights is not None else {}
    if given and state.confirm.usable:
        before, after = state.confirm.cosine((), given), state.confirm.cosine((), state.amax)
        state.records.update(confirmed=after > before, confirm_before=before, confirm_after=after,
                             confirm_runs=state.confirm.runs)
        if after <= before:
            logger.info("ranges: the chosen ranges are not confirmed on the calibration samples "
                        "(%.5f -> %.5f); the given ranges kept", before, after)
            return ScaleTable(given, dict(prepared.table.weights), producer=weights.producer,
                              metadata=dict(weights.metadata), bounds=dict(weights.bounds)), state.records
    table = ScaleTable(dict(state.amax), dict(prepared.table.weights), producer=prepared.table.producer,
                       metadata={**prepared.table.metadata, "range_search": _choice_json(state)},
                       bounds=dict(prepared.table.bounds))
    return table, state.records


def choose_table(float_model, data, eval_data, *, config, weights, batch_size: int = 16,
                 progress: bool = False):
    """``optimize="accuracy"``'s ``ranges`` step when the evaluation data is too small to choose ranges on
    (`onnx_qat.accuracy.optimize.RANGES_MIN_SAMPLES`): one whole table (`START_TABLES`) chosen on the
    first calibration samples (`Confirmation`), as ``auto`` chooses between its tables: starting from
    ``weights``' activation ranges (the table ``auto`` chose), a table replaces the one kept only when
    its output cosine there is higher **and** its per-sample output errors are lower by more than
    `onnx_qat.calibration.choice.EVIDENCE` standard errors of the paired difference
    (`onnx_qat.calibration.choice.beats`). The paired rule needs as many per-sample errors as
    ``auto``'s (`onnx_qat.calibration.choice.MIN_PAIRED_SAMPLES`, 8): with fewer calibration samples
    every table's cosine is still measured and recorded, ``weights`` is kept whatever the cosines, and
    ``records["paired_note"]`` says why (`onnx_qat.calibration.choice.few_samples_note`). No
    evaluation sample decides the choice (its caller judges the result on them, as every step).
    Returns ``(ScaleTable, records)``; the table is ``weights``' own when no candidate beats it
    (``records["start"]`` ``"given"``), or None when the calibration samples cannot judge
    (`Confirmation.usable`)."""
    from ..calibration import choice as paired
    from ..scales import ScaleTable

    prepared, _ = prepare_candidates(float_model, data, eval_data, config, batch_size, progress, weights)
    confirm = Confirmation(prepared, batch_size)
    if not confirm.usable:
        return None, {"start": None}
    given = {t: float(weights.activations.get(t, a)) for t, a in prepared.table.activations.items()}
    best, (cosine, errors) = "given", confirm.judged((), given)
    cosines, amax_of = {"given": cosine}, {"given": given}
    # auto's minimum (one rule): on fewer errors a lead of EVIDENCE standard errors is often chance
    note = paired.few_samples_note(len(errors))
    for name in START_TABLES:
        amax, _ = whole_table(prepared, name)
        same = next((k for k, a in amax_of.items() if a == amax), None)
        if same is not None:  # the same ranges (auto's choice is one of these tables): judged already
            cosines[name] = cosines[same]
            continue
        trial, trial_errors = confirm.judged((), amax)
        cosines[name], amax_of[name] = trial, amax
        if not note and trial > cosines[best] and paired.beats(trial_errors, errors):
            best, errors = name, trial_errors
    records = {"start": best, "calibration_cosines": cosines, "calibration_samples": len(errors),
               "evidence": paired.EVIDENCE, "runs": confirm.runs}
    if note:
        records["paired_note"] = note
    logger.info("ranges: whole tables on the calibration samples %s; %s kept%s",
                ", ".join(f"{k} {v:.5f}" for k, v in cosines.items()), best, f" ({note})" if note else "")
    if best == "given":
        return weights, records
    table = ScaleTable(amax_of[best], dict(prepared.table.weights), producer=prepared.table.producer,
                       metadata={**prepared.table.metadata, "range_table": best},
                       bounds={t: b for t, b in prepared.table.bounds.items() if t in amax_of[best]})
    return table, records


def prepare_candidates(float_model, data, eval_data, config, batch_size: int, progress: bool, weights=None):
    """`onnx_qat.accuracy.prepared.prepare` with ``auto``'s candidates kept and the scales as inputs."""
    from .prepared import prepare

    return prepare(float_model, data, method="auto", eval_data=eval_data, config=config,
                   batch_size=batch_size, progress=progress, range_candidates=True,
                   weight_scales=weights if weights is not None and weights.weights else None)


def _choice_json(state: RangeSearch) -> str:
    import json

    return json.dumps(dict(sorted(state.choice.items())), separators=(",", ":"))


def per_site(state: RangeSearch, float_sites: Sequence[int]) -> Dict[str, Dict[str, str]]:
    """``{site: {activation tensor: candidate}}`` of the sites left quantized."""
    sites = state.prepared.sites
    return {s.name: {t: state.choice.get(t, "auto") for t in s.activations}
            for k, s in enumerate(sites) if k not in set(float_sites) and s.activations}


__all__ = ["search_ranges", "tune_table", "choose_table", "START_TABLES", "RangeSearch", "candidates",
           "whole_table", "min_gain", "better", "sample_cosines", "per_site", "WHOLE_TABLES", "CANDIDATES",
           "SAME_RANGE", "MIN_GAIN_SHARE", "MIN_SAMPLE_SHARE", "EMPTY_SHARE", "empty_samples"]
