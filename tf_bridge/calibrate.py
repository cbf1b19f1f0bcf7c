"""calibrate: set every activation quantizer's range from data.

The model runs eagerly in inference mode with activation quantization switched
off (weights stay quantized, as they will be deployed); each
[`ActivationQuantizer`][tf_bridge.ActivationQuantizer] collects ``|x|`` statistics of the tensor it sits
on, then its ``amax`` is set:

* ``method="max"``: the largest ``|x|`` seen;
* ``method="percentile"``: the ``percentile``-th percentile of ``|x|`` over all
  values seen, from a 2048-bin histogram whose range doubles as needed (the
  upper edge of the bin holding the percentile, capped at the max).
"""
from __future__ import annotations

import logging
import sys
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterator, List, Mapping, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf
from tqdm import tqdm

from onnx_qat.errors import ConfigError, DataError, ModelError

from .describe import iter_quantizer_layers
from .quantizers import ActivationQuantizer
from .spec import iter_layers

logger = logging.getLogger(__name__)

METHODS = ("max", "percentile")
_BINS = 2048


class MaxCollector:
    """Running max of ``|x|``."""

    def __init__(self):
        self.amax = 0.0
        self.count = 0

    def update(self, x) -> None:
        """Add one batch of values."""
        a = np.abs(np.asarray(x, dtype=np.float32))
        if a.size:
            self.amax = max(self.amax, float(np.max(a)))
            self.count += a.size

    def result(self) -> float:
        """The collected amax."""
        return self.amax


class PercentileCollector(MaxCollector):
    """Histogram of ``|x|`` over [0, hi) in ``_BINS`` bins; ``hi`` doubles (bins merge pairwise)."""

    def __init__(self, percentile: float):
        super().__init__()
        self.percentile = percentile
        self.hi = 0.0
        self.counts = np.zeros(_BINS, dtype=np.int64)

    def update(self, x) -> None:
        """Add one batch of values."""
        a = np.abs(np.asarray(x, dtype=np.float32)).ravel()
        if not a.size:
            return
        if not np.all(np.isfinite(a)):
            self.amax = float("inf")
            return
        super().update(a)
        if self.hi == 0.0:
            self.hi = max(self.amax, 1e-12)
        while self.amax >= self.hi:
            self.counts = self.counts.reshape(-1, 2).sum(axis=1)
            self.counts = np.concatenate([self.counts, np.zeros(_BINS // 2, dtype=np.int64)])
            self.hi *= 2.0
        idx = np.minimum((a / self.hi * _BINS).astype(np.int64), _BINS - 1)
        self.counts += np.bincount(idx, minlength=_BINS)

    def result(self) -> float:
        """Upper edge of the bin holding the percentile, capped at the max seen."""
        if self.count == 0 or not np.isfinite(self.amax):
            return self.amax
        cdf = np.cumsum(self.counts) / self.counts.sum()
        b = int(np.searchsorted(cdf, self.percentile / 100.0))
        return min(self.amax, (b + 1) * self.hi / _BINS)


@dataclass(frozen=True)
class CalibrationResult:
    """Ranges set by [`calibrate`][tf_bridge.calibrate.calibrate]: quantizer path -> amax, and how many
    batches were used."""

    amax: Mapping[str, float]
    batches: int
    method: str

    def __str__(self):
        return (f"calibrated {len(self.amax)} activation quantizer(s) on {self.batches} batch(es),"
                f" method {self.method}")


def _take_x(element, n_inputs: int):
    """Drop labels/weights from a dataset element: ``(x, y)`` or ``(x, y, w)`` -> ``x``."""
    if isinstance(element, tuple) and len(element) in (2, 3) and n_inputs == 1:
        return element[0]
    if isinstance(element, tuple) and len(element) in (2, 3) and isinstance(element[0], (tuple, list, dict)):
        return element[0]
    return element


def _numpy_batches(data, batch_size: int) -> Iterator:
    if isinstance(data, dict):
        n = len(next(iter(data.values())))
        for s in range(0, n, batch_size):
            yield {k: v[s:s + batch_size] for k, v in data.items()}
    elif isinstance(data, (list, tuple)):
        n = len(data[0])
        for s in range(0, n, batch_size):
            yield [np.asarray(v[s:s + batch_size]) for v in data]
    else:
        for s in range(0, len(data), batch_size):
            yield data[s:s + batch_size]


def _batches(data, batch_size: int, n_inputs: int) -> Tuple[Iterator, Optional[int]]:
    if isinstance(data, tf.data.Dataset):
        card = int(data.cardinality())
        return (_take_x(e, n_inputs) for e in data), (card if card >= 0 else None)
    if isinstance(data, np.ndarray) or (isinstance(data, (list, tuple, dict)) and data):
        if isinstance(data, dict):
            first = next(iter(data.values()))
        else:
            first = data if isinstance(data, np.ndarray) else data[0]
        n = len(first)
        if n == 0:
            raise DataError("calibrate: data is empty")
        return _numpy_batches(data, batch_size), -(-n // batch_size)
    raise DataError(f"calibrate: data must be a NumPy array (or list/dict of arrays for several inputs) "
                    f"or a tf.data.Dataset, got {type(data).__name__}")


def _check_batch_shapes(q_model, batch) -> None:
    """Refuse data whose per-sample shape does not fit the model's inputs (one DataError line)."""
    if isinstance(batch, dict):
        items = [(t.name.split(":")[0], batch.get(t.name.split(":")[0])) for t in q_model.inputs]
    else:
        arrays = list(batch) if isinstance(batch, (list, tuple)) else [batch]
        if len(arrays) != len(q_model.inputs):
            raise DataError(f"calibrate: model '{q_model.name}' has {len(q_model.inputs)} input(s), "
                            f"the data gives {len(arrays)}")
        items = [(t.name.split(":")[0], a) for t, a in zip(q_model.inputs, arrays)]
    for (name, array), tensor in zip(items, q_model.inputs):
        if array is None:
            raise DataError(f"calibrate: the data has no entry for model input '{name}'")
        got, want = tuple(np.shape(array))[1:], tuple(tensor.shape)[1:]
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
            shown = ", ".join("None" if w is None else str(w) for w in want)
            raise DataError(f"calibrate: input '{name}' expects samples of shape ({shown}), "
                            f"the data has {got}")


class UntrainedBatchNormWarning(UserWarning):
    """Calibration ran through BatchNormalization layers that still have their initial statistics."""


def _warn_untrained_batchnorm(q_model) -> None:
    """Warn if BatchNormalization layers still hold their initial moving statistics (mean 0,
    variance 1): inference-mode ranges then do not describe training-mode activations."""
    fresh = []
    for layer in iter_layers(q_model):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.built:
            mean, var = layer.moving_mean.numpy(), layer.moving_variance.numpy()
            if np.all(mean == 0) and np.all(var == 1):
                fresh.append(layer.name)
    if fresh:
        msg = (f"tf_bridge.calibrate: {len(fresh)} BatchNormalization layer(s) (e.g. '{fresh[0]}') still "
               "have their initial moving statistics, so the measured ranges will not match training; "
               "train the float model first, or skip calibrate and let the first training batch set "
               "the ranges")
        logger.warning(msg)
        warnings.warn(msg, UntrainedBatchNormWarning, stacklevel=3)


def _check_args(method: str, batch_size: int, steps, percentile: float) -> None:
    if method not in METHODS:
        raise ConfigError(f"calibrate: method must be one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"calibrate: batch_size must be a positive int, got {batch_size!r}")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"calibrate: steps must be None or a positive int, got {steps!r}")
    if not 0.0 < percentile <= 100.0:
        raise ConfigError(f"calibrate: percentile must be in (0, 100], got {percentile!r}")


def calibrate(q_model, data, method: str = "max", batch_size: int = 32, steps: Optional[int] = None,
              *, percentile: float = 99.99, progress: bool = True) -> CalibrationResult:
    """Set the range of every activation quantizer of ``q_model`` from ``data``.

    Args:
        q_model: a model returned by [`tf_bridge.quantize_model`][].
        data: a NumPy array (a list or dict of arrays for several inputs), split
            into batches of ``batch_size``; or a ``tf.data.Dataset`` of batches
            (``(x, y)`` elements are fine; ``batch_size`` is then ignored).
        method: ``"max"`` or ``"percentile"``.
        batch_size: batch size for NumPy data.
        steps: use at most this many batches (None: all).
        percentile: the percentile for ``method="percentile"``.
        progress: show a progress bar on stderr.

    Returns:
        A [`CalibrationResult`][tf_bridge.calibrate.CalibrationResult] with the amax set on each quantizer.

    Raises:
        ModelError: ``q_model`` has no tf_bridge quantizers.
        DataError: bad or empty data, samples that do not fit the model's inputs, or a range that
            is not finite.
    """
    _check_args(method, batch_size, steps, percentile)
    found = list(iter_quantizer_layers(q_model))
    if not found:
        raise ModelError(f"calibrate: model '{q_model.name}' has no tf_bridge quantizers; quantize it with "
                         "tf_bridge.quantize_model first")
    _warn_untrained_batchnorm(q_model)
    quantizers: List[Tuple[str, ActivationQuantizer]] = [
        (p, q) for p, q in found if isinstance(q, ActivationQuantizer)]
    batches, total = _batches(data, batch_size, len(q_model.inputs))
    if steps is not None:
        total = min(total, steps) if total is not None else steps
    collectors = [MaxCollector() if method == "max" else PercentileCollector(percentile) for _ in quantizers]
    for (_, q), c in zip(quantizers, collectors):
        q._collector = c
    used = 0
    try:
        with tqdm(total=total, desc="calibrate", unit="batch", file=sys.stderr, disable=not progress) as bar:
            for batch in batches:
                if steps is not None and used >= steps:
                    break
                if used == 0:
                    _check_batch_shapes(q_model, batch)
                q_model(batch, training=False)
                used += 1
                bar.update(1)
    finally:
        for _, q in quantizers:
            q._collector = None
    if used == 0:
        raise DataError("calibrate: data yielded no batches")
    amax = MappingProxyType(_apply(quantizers, collectors))
    return CalibrationResult(amax=amax, batches=used, method=method)


def _apply(quantizers, collectors) -> dict:
    result = {}
    for (path, q), c in zip(quantizers, collectors):
        if c.count == 0:
            raise DataError(f"calibrate: quantizer '{path}' saw no data")
        amax = c.result()
        if not np.isfinite(amax):
            raise DataError(f"calibrate: range of '{path}' (tensor '{q.producer}') is not finite; "
                            "check the data or exclude that layer with a QuantizationSpec")
        if amax <= 0:
            logger.warning("tf_bridge: '%s' saw only zeros; its amax is set to 1.0", path)
            amax = 1.0
        q.set_amax(amax)
        result[path] = float(amax)
    logger.info("tf_bridge: calibrated %d activation quantizer(s)", len(result))
    return result
