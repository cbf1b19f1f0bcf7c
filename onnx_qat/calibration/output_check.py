"""The output check of ``auto``: whole-model candidate tables judged by the model's output.

A tensor's own quantization error does not say what its range does to the output (clipping a few
large values can cost more downstream than their share of the error shows, and the errors of many
tensors add up). So ``auto`` builds a few complete tables from the one calibration pass -- ``max``
everywhere, each tensor's least-error candidate, the guarded ``entropy`` everywhere -- inserts each
with the one inserter, runs the quantized model on (the first `CHECK_SAMPLES` samples of) the
calibration data and keeps the table whose output is closest to the float model's (the worst output's
cosine; ties keep the earlier table, ``max`` first).
"""
from __future__ import annotations

import logging
from typing import Dict, Mapping, Optional, Tuple

import numpy as np

from ..errors import QatError

logger = logging.getLogger(__name__)

#: Samples of the calibration data the candidate tables are run on (bounds the cost: one float run
#: and one quantized run per table).
CHECK_SAMPLES = 64


def first_samples(dataset, count: int = CHECK_SAMPLES, batch_size: int = 16):
    """The first ``count`` samples of ``dataset`` as arrays; the dataset itself when it has no more
    (or its inputs have no sample axis); of a stream of feeds or a stateful model's data, the first
    ``count`` feeds (steps), as a dataset that runs them in order."""
    from ..io.feeds import FeedStream

    if isinstance(dataset, FeedStream) or dataset.state:  # feeds (or steps) run in order: the first ones
        return dataset.take(count)
    if len(dataset) <= count or dataset.unbatched:
        return dataset
    parts: Dict[str, list] = {}
    taken = 0
    for batch in dataset.batches(batch_size):
        for name, values in batch.items():
            parts.setdefault(name, []).append(np.asarray(values))
        taken += len(next(iter(batch.values())))
        if taken >= count:
            break
    return {name: np.concatenate(chunks)[:count] for name, chunks in parts.items()}


def worst_cosine(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]) -> float:
    """The smallest cosine over the outputs (flattened arrays; two all-zero outputs count as 1), as
    `onnx_qat.runtime.compare.output_figures` measures it (the figure
    `onnx_qat.accuracy.prepared.output_error` reports too; calibration does not import the
    accuracy tools, which plain ``quantize`` never loads)."""
    from ..runtime.compare import output_figures

    return min([1.0] + [output_figures(ref, candidate[name])["cosine"] for name, ref in reference.items()])


def choose_by_output(model, feeds, tables: Mapping[str, Mapping[str, float]], *,
                     config=None, batch_size: int = 16,
                     placement_options: Optional[Mapping] = None) -> Tuple[str, Dict[str, float]]:
    """``(name of the best table, {table name: output cosine})`` on ``feeds`` (arrays or a Dataset).

    ``tables`` maps a name to ``{activation tensor: amax}`` covering every activation placement
    quantizes; each is inserted by the rewrite behind
    [`onnx_qat.quantize`][onnx_qat.quantize.quantize] (`onnx_qat.rewrite.quantize_placed`) with ``config`` and
    ``placement_options``. A table that cannot be inserted (e.g. it lacks an activation placement
    quantizes) scores -inf (logged at debug level); when none can, the first table is returned.
    """
    from ..config import QuantizeConfig
    from ..rewrite import quantize_placed
    from ..runtime.sessions import run_model
    from ..scales import ScaleTable

    resolved = QuantizeConfig.from_options(config, **dict(placement_options or {}))

    def floats(outputs):
        return {k: v.ravel() for k, v in outputs.items() if v.dtype.kind == "f"}

    reference = None
    cosines: Dict[str, float] = {}
    for name, amax in tables.items():
        try:
            result = quantize_placed(model, scales=ScaleTable(dict(amax)), data=None, method="max",
                                     config=resolved, calib_kw={}, progress=False)
        except QatError as exc:
            logger.debug("auto: table %r cannot be inserted: %s", name, exc)
            cosines[name] = -np.inf
            continue
        if reference is None:  # the float run only once a table could be inserted
            reference = floats(run_model(model, feeds, batch_size=batch_size))
        got = floats(run_model(result.model, feeds, batch_size=batch_size))
        cosines[name] = worst_cosine(reference, got)
    best = next(iter(tables))
    for name in tables:
        if cosines[name] > cosines[best]:
            best = name
    return best, cosines
