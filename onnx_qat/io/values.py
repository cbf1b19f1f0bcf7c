"""Value checks shared by the data loaders: safe dtype conversion, integer range, finiteness.

* `check_dtype` ``(have, spec, label)`` — refuses a dtype that does not convert safely.
* `announce_cast` — the one warning line when a dtype is converted.
* `convert` ``(values, want, key, label, first)`` — values in the model's dtype, after the
  range and NaN/Inf checks (one [`DataError`][onnx_qat.errors.DataError] line naming the key and sample).
"""
from __future__ import annotations

import logging

import numpy as np

from ..errors import DataError

logger = logging.getLogger("onnx_qat.io.data")  # the data loader's warnings, one logger


def to_dtype(values: np.ndarray, want: np.dtype) -> np.ndarray:
    """``values`` in dtype ``want`` (already checked to convert safely)."""
    if values.dtype == want:
        return values
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(want)


def check_dtype(have: np.dtype, spec, label: str) -> None:
    """Refuse ``have`` unless it converts safely to the dtype of ``spec`` (a model input)."""
    key, want = spec.name, np.dtype(spec.dtype)
    if have == want:
        return
    if have.kind in "OUSVMm" or have.hasobject:
        raise DataError(f"{label}: key {key!r} has dtype {have}, the model input needs {want}")
    ok = np.can_cast(have, want, "same_kind") or (have.kind in "biu" and want.kind in "fc")
    if want.kind == "b" and have.kind != "b":
        ok = False
    if not ok:
        raise DataError(f"{label}: key {key!r} has dtype {have}, which does not convert safely to the "
                        f"model's {want}; save it as {want}")


def announce_cast(have: np.dtype, want: np.dtype, key: str, label: str) -> None:
    """One warning line: the values of ``key`` are converted to the model's dtype, as they are (uint8
    images stay 0..255: the line says so, since a model calibrated on 0..1 then sees another scale)."""
    scale = ""
    if have.kind in "iu" and want.kind == "f":
        info = np.iinfo(have)
        scale = (f" (values keep their {have} scale, e.g. 0..{info.max}; divide them first if the "
                 f"model expects 0..1)") if have.kind == "u" else " (values keep their integer scale)"
    logger.warning("%s: key %r holds %s, converted to the model's %s%s", label, key, have, want, scale)


def convert(values: np.ndarray, want: np.dtype, key: str, label: str, first: int) -> np.ndarray:
    """``values`` (samples ``first``...) in the model's dtype, after the range and finiteness checks."""
    if values.dtype.kind in "iu" and want.kind in "iu" and values.size and values.dtype != want:
        info = np.iinfo(want)
        if values.min() < info.min or values.max() > info.max:
            raise DataError(f"{label}: key {key!r} has values outside the range of the model's {want}")
    converted = to_dtype(values, want)
    check_finite(converted, key, label, first)
    return converted


def check_finite(arr: np.ndarray, key: str, label: str, first: int = 0) -> None:
    """One line naming the key and the first sample (counted from ``first``) holding NaN or Inf."""
    if arr.dtype.kind not in "fc" or arr.size == 0:
        return
    finite = np.isfinite(arr)
    if finite.all():
        return
    per_sample = finite.reshape(finite.shape[0], -1) if finite.ndim else finite.reshape(1, -1)
    index = int(np.argmin(per_sample.all(axis=1)))
    sample = np.asarray(arr[index] if arr.ndim else arr)
    bad = int(sample.size - np.count_nonzero(per_sample[index]))
    nan = int(np.count_nonzero(np.isnan(sample)))
    kinds = "NaN" if nan == bad else ("Inf" if nan == 0 else "NaN/Inf")
    raise DataError(f"{label}: key {key!r} has {bad} {kinds} value(s) in sample {first + index}; "
                    f"give finite numbers")


__all__ = ["check_dtype", "convert", "check_finite", "to_dtype", "announce_cast"]
