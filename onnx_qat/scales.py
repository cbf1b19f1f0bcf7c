"""ScaleTable: the one interchange format for quantization ranges.

Whoever produces ranges (Keras QAT via ``tf_bridge``, ``onnx_qat.calibrate``,
a user's own JSON) writes a ScaleTable; the rewriter (``onnx_qat.quantize``) is
its one consumer. Ranges are stored as *amax* (the largest magnitude that maps
to the int8 limit); the scale is ``amax / 127`` (symmetric, zero point 0).

JSON form (version 1)::

    {
      "format": "onnx-qat-scales",
      "version": 1,
      "producer": "onnx_qat.calibrate(method=entropy)",
      "activations": {"input": 2.64, "conv1_out": 5.1},
      "weights": {"conv1.weight": {"axis": 0, "amax": [0.31, 0.27, ...]}},
      "metadata": {"any": "string values"}
    }

* ``activations`` maps an ONNX tensor name to one per-tensor amax.
* ``weights`` (optional) maps a weight initializer name to its amax: per channel
  along ``axis`` (one value per channel), or per tensor (``"axis": null`` and a
  one-element list). A weight not listed takes its ranges from its own values.
* Every amax must be finite and > 0. Unknown keys, versions and formats are refused.

The same amax serves every precision: INT8 divides it by 127, FP8 by 448, INT4 by 7.
Version 2 adds INT4 block ranges: a weight entry with ``"block_size": B`` holds one amax per
block of ``B`` values along ``axis``, in C order over the block grid (the weight's shape with
``shape[axis] / B`` on ``axis``)::

      "weights": {"ffn1.weight": {"axis": 0, "block_size": 128, "amax": [0.12, 0.09, ...]}}

Version 3 adds the calibrated extremes of activations: ``"bounds"`` maps a tensor that has an
amax to ``[min, max]``, the smallest and largest finite value calibration saw (either may have
any sign; ``min <= max``)::

      "bounds": {"conv1_out": [-0.31, 5.1], "gate": [0.02, 0.98]}

The amax stays the range every target uses; the ``ort-cpu`` target also reads the bounds to store
a tensor whose values are mostly on one side of zero with an asymmetric uint8 range (see
`onnx_qat.insertion.ort_cpu`); the TensorRT form ignores them (symmetric signed INT8).

A table is written with the lowest version that holds it: 3 with bounds, else 2 with a block
entry, else 1 (so older readers still read every table without the newer entries); all three are read.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType
from typing import Iterable, Mapping, Optional, Tuple

from .errors import ScalesError
from .io.files import PathLike, read_json, write_json

FORMAT = "onnx-qat-scales"
#: The newest version written (only for tables with bounds; see `ScaleTable.to_dict`).
VERSION = 3
#: Versions read.
VERSIONS = (1, 2, 3)
_TOP_KEYS = {"format", "version", "producer", "activations", "weights", "metadata", "bounds"}


def _check_amax(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ScalesError(f"{where}: amax must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ScalesError(f"{where}: amax {value} is not finite")
    if value <= 0.0:
        raise ScalesError(f"{where}: amax {value} must be > 0")
    return value


def _check_bounds(name: str, value) -> Tuple[float, float]:
    """``(min, max)`` of an activation's bounds entry: two finite numbers, ``min <= max``."""
    if isinstance(value, Mapping) or not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ScalesError(f"bounds of {name!r}: expected [min, max], got {value!r}")
    low, high = value
    for bound in (low, high):
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
            raise ScalesError(f"bounds of {name!r}: {bound!r} is not a finite number")
    if low > high:
        raise ScalesError(f"bounds of {name!r}: min {low} is above max {high}")
    return float(low), float(high)


@dataclass(frozen=True)
class WeightRange:
    """Per-channel (``axis`` set) or per-tensor (``axis`` None, one value) weight amax; with
    ``block_size``, one amax per block of that many values along ``axis`` (INT4), in C order over
    the block grid."""

    axis: Optional[int]
    amax: Tuple[float, ...]
    block_size: Optional[int] = None

    def __post_init__(self):
        if self.axis is not None and (isinstance(self.axis, bool) or not isinstance(self.axis, int)):
            raise ScalesError(f"weight axis must be an integer or null, got {self.axis!r}")
        if self.block_size is not None and (isinstance(self.block_size, bool) or
                                            not isinstance(self.block_size, int) or self.block_size < 1
                                            or self.axis is None):
            raise ScalesError(f"weight block_size must be a whole number >= 1 with an axis, "
                              f"got {self.block_size!r} (axis {self.axis!r})")
        values = tuple(_check_amax(v, f"weight amax[{i}]") for i, v in enumerate(self.amax))
        if not values:
            raise ScalesError("weight amax list is empty")
        if self.axis is None and len(values) != 1:
            raise ScalesError(f"per-tensor weight amax (axis null) needs one value, got {len(values)}")
        object.__setattr__(self, "amax", values)

    @property
    def per_channel(self) -> bool:
        """One amax per channel along ``axis`` (False: one amax for the whole tensor)."""
        return self.axis is not None


class ScaleTable:
    """An immutable, validated table of activation and weight ranges (amax).

    Args:
        activations: ONNX tensor name -> per-tensor amax (finite, > 0).
        weights: weight initializer name -> [`WeightRange`][onnx_qat.scales.WeightRange] (or a
            ``{"axis": int|None, "amax": [...]}`` dict).
        producer: who made the table (free text, kept in the JSON).
        metadata: extra string key/values kept in the JSON.
        bounds: activation tensor name -> ``(min, max)``, the calibrated extremes (finite,
            ``min <= max``); every name must also have an amax in ``activations``. Optional: read by
            the ``ort-cpu`` target only (asymmetric uint8 ranges).
    """

    __slots__ = ("_activations", "_weights", "producer", "metadata", "_bounds")

    def __init__(
        self,
        activations: Optional[Mapping[str, float]] = None,
        weights: Optional[Mapping[str, object]] = None,
        *,
        producer: str = "",
        metadata: Optional[Mapping[str, str]] = None,
        bounds: Optional[Mapping[str, Tuple[float, float]]] = None,
    ):
        acts = {}
        for name, value in dict(activations or {}).items():
            if not isinstance(name, str) or not name:
                raise ScalesError(f"activation tensor name must be a non-empty string, got {name!r}")
            acts[name] = _check_amax(value, f"activation {name!r}")
        wts = {}
        for name, value in dict(weights or {}).items():
            if not isinstance(name, str) or not name:
                raise ScalesError(f"weight name must be a non-empty string, got {name!r}")
            wts[name] = _as_weight_range(value, name)
        extremes = {}
        for name, value in dict(bounds or {}).items():
            if name not in acts:
                raise ScalesError(f"bounds name {name!r}, which has no activation amax in the table")
            extremes[name] = _check_bounds(name, value)
        object.__setattr__(self, "_bounds", MappingProxyType(dict(sorted(extremes.items()))))
        object.__setattr__(self, "_activations", MappingProxyType(dict(sorted(acts.items()))))
        object.__setattr__(self, "_weights", MappingProxyType(dict(sorted(wts.items()))))
        object.__setattr__(self, "producer", str(producer))
        object.__setattr__(self, "metadata",
                           MappingProxyType({str(k): str(v) for k, v in dict(metadata or {}).items()}))

    def __setattr__(self, key, value):
        raise AttributeError("ScaleTable is immutable; build a new one (see ScaleTable.merged)")

    # -- access -----------------------------------------------------------------
    @property
    def activations(self) -> Mapping[str, float]:
        """Tensor name -> activation amax (read-only)."""
        return self._activations

    @property
    def weights(self) -> Mapping[str, WeightRange]:
        """Weight initializer name -> [`WeightRange`][onnx_qat.scales.WeightRange] (read-only)."""
        return self._weights

    @property
    def bounds(self) -> Mapping[str, Tuple[float, float]]:
        """Tensor name -> ``(min, max)`` seen in calibration (read-only; only the tensors that have them)."""
        return self._bounds

    def activation_scale(self, name: str) -> Optional[float]:
        """``amax / 127`` for an activation tensor, or None when it is not in the table."""
        amax = self._activations.get(name)
        return None if amax is None else amax / 127.0

    def __len__(self) -> int:
        return len(self._activations) + len(self._weights)

    def __eq__(self, other) -> bool:
        return isinstance(other, ScaleTable) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return (f"ScaleTable({len(self._activations)} activations, {len(self._weights)} weights, "
                f"producer={self.producer!r})")

    def merged(self, other: "ScaleTable") -> "ScaleTable":
        """A new table with ``other``'s entries added (``other`` wins on conflicts; an activation
        ``other`` gives keeps ``other``'s bounds, or none)."""
        kept = {k: v for k, v in self._bounds.items() if k not in other.activations}
        return ScaleTable(
            {**self._activations, **other.activations},
            {**self._weights, **other.weights},
            producer=other.producer or self.producer,
            metadata={**self.metadata, **other.metadata},
            bounds={**kept, **other.bounds},
        )

    def subset(self, activations: Iterable[str]) -> "ScaleTable":
        """A new table holding only the named activations (and their bounds; weights kept)."""
        keep = set(activations)
        return ScaleTable({k: v for k, v in self._activations.items() if k in keep}, self._weights,
                          producer=self.producer, metadata=self.metadata,
                          bounds={k: v for k, v in self._bounds.items() if k in keep})

    # -- validation against a model ----------------------------------------------
    def check_names(self, tensor_names: Iterable[str], weight_shapes: Mapping[str, Tuple[int, ...]]) -> None:
        """Refuse names the model does not have and per-channel lists of the wrong length.

        Args:
            tensor_names: every tensor name of the model (activations may name any).
            weight_shapes: constant weight name -> shape.
        """
        names = set(tensor_names)
        unknown = [n for n in self._activations if n not in names]
        if unknown:
            raise ScalesError(
                f"ScaleTable names {len(unknown)} tensor(s) the model does not have, e.g. {unknown[:3]}")
        for name, rng in self._weights.items():
            if name not in weight_shapes:
                raise ScalesError(f"ScaleTable weight {name!r} is not a constant weight of the model")
            shape = tuple(weight_shapes[name])
            if rng.axis is None:
                continue
            axis = rng.axis + len(shape) if rng.axis < 0 else rng.axis
            if not 0 <= axis < len(shape):
                raise ScalesError(f"ScaleTable weight {name!r}: axis {rng.axis} is out of range "
                                  f"for shape {list(shape)}")
            if rng.block_size is not None:
                _check_blocks(name, rng, shape, axis)
            elif shape[axis] != len(rng.amax):
                raise ScalesError(
                    f"ScaleTable weight {name!r}: {len(rng.amax)} amax values for {shape[axis]} channels "
                    f"on axis {rng.axis}")

    # -- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON-ready form (see module docstring): version 3 with bounds, else 2 when a weight has
        block ranges, else 1 (``"bounds"`` only when there are some)."""
        blocks = any(w.block_size is not None for w in self._weights.values())
        extra = {"bounds": {k: list(v) for k, v in self._bounds.items()}} if self._bounds else {}
        return {
            "format": FORMAT,
            "version": 3 if self._bounds else 2 if blocks else 1,
            "producer": self.producer,
            "activations": dict(self._activations),
            "weights": {k: {"axis": w.axis, **({} if w.block_size is None else {"block_size": w.block_size}),
                            "amax": list(w.amax)} for k, w in self._weights.items()},
            "metadata": dict(self.metadata),
            **extra,
        }

    @classmethod
    def from_dict(cls, data: Mapping, *, source: str = "ScaleTable") -> "ScaleTable":
        """Build and validate a table from its JSON form; errors name ``source``."""
        if not isinstance(data, Mapping):
            raise ScalesError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ScalesError(f"{source}: 'format' must be {FORMAT!r}, got {data.get('format')!r}")
        version = data.get("version")
        if version not in VERSIONS or isinstance(version, bool):
            raise ScalesError(f"{source}: unknown version {version!r}; this onnx-qat reads versions "
                              f"{', '.join(map(str, VERSIONS))}")
        extra = set(data) - _TOP_KEYS
        if extra:
            raise ScalesError(f"{source}: unknown key(s) {sorted(extra)}")
        acts = data.get("activations", {})
        wts = data.get("weights", {})
        meta = data.get("metadata", {})
        bounds = data.get("bounds", {})
        for key, val in (("activations", acts), ("weights", wts), ("metadata", meta), ("bounds", bounds)):
            if not isinstance(val, Mapping):
                raise ScalesError(f"{source}: {key!r} must be an object")
        if version == 1 and any(isinstance(w, Mapping) and "block_size" in w for w in wts.values()):
            raise ScalesError(f"{source}: block_size needs version 2")
        if version < 3 and "bounds" in data:
            raise ScalesError(f"{source}: 'bounds' needs version 3")
        try:
            return cls(acts, wts, producer=str(data.get("producer", "")), metadata=meta, bounds=bounds)
        except ScalesError as exc:
            raise ScalesError(f"{source}: {exc}") from None

    def save(self, path: PathLike) -> None:
        """Write the table as JSON, atomically."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: PathLike) -> "ScaleTable":
        """Read and validate a ScaleTable JSON file (size-bounded)."""
        data = read_json(path, what="ScaleTable", error=ScalesError)
        return cls.from_dict(data, source=f"ScaleTable {path}")

    # -- TensorRT calibration caches (see onnx_qat.io.tensorrt_cache) ------------------------------------
    @classmethod
    def from_tensorrt_cache(cls, path: PathLike) -> "ScaleTable":
        """Read a TensorRT calibration cache (``TRT-<version>-<algorithm>`` header, then
        ``tensor_name: <hex float32 scale>`` lines) as activation ranges, ``amax = scale x 127``; the
        header is kept in ``metadata["tensorrt_cache_header"]``. See `onnx_qat.io.tensorrt_cache`.

        Raises:
            ScalesError: the file is not a valid cache (wrong format, non-hex digits, a NaN, infinite,
                zero or negative scale, no entries); one line naming the file and the line.
        """
        from .io.tensorrt_cache import read_tensorrt_cache

        header, ranges = read_tensorrt_cache(path)
        return cls(ranges, producer=f"tensorrt-cache({header})", metadata={"tensorrt_cache_header": header})

    def to_tensorrt_cache(self, *, tensorrt_version: str, algorithm: str = "EntropyCalibration2") -> str:
        """The activation ranges as TensorRT calibration cache text (``scale = float32(amax / 127)``).

        Weight ranges are left out (logged at info level): TensorRT's implicit INT8 measures weight
        scales from the weights. ``tensorrt_version`` (``MAJOR.MINOR.PATCH``, the TensorRT that will read
        the cache) and ``algorithm`` (the calibrator that hands it to TensorRT) go into the header; see
        `onnx_qat.io.tensorrt_cache.format_tensorrt_cache`.
        """
        from .io.tensorrt_cache import format_tensorrt_cache, logger

        if self._weights:
            logger.info("the calibration cache holds activation ranges only: %d weight range(s) left out "
                        "(TensorRT's implicit INT8 measures weight scales from the weights)",
                        len(self._weights))
        return format_tensorrt_cache(self._activations, tensorrt_version=tensorrt_version,
                                     algorithm=algorithm)

    def save_tensorrt_cache(self, path: PathLike, *, tensorrt_version: str,
                            algorithm: str = "EntropyCalibration2") -> None:
        """Write [`to_tensorrt_cache`][onnx_qat.scales.ScaleTable.to_tensorrt_cache] to ``path``, atomically
        (nothing written when it raises)."""
        from .io.files import atomic_write_text

        text = self.to_tensorrt_cache(tensorrt_version=tensorrt_version, algorithm=algorithm)
        atomic_write_text(path, text)


def _as_weight_range(value, name: str) -> WeightRange:
    if isinstance(value, WeightRange):
        return value
    if not isinstance(value, Mapping) or set(value) - {"axis", "amax", "block_size"} or "amax" not in value:
        raise ScalesError(f"weight {name!r}: expected {{'axis': int|null, 'amax': [numbers]}} "
                          "(and 'block_size' for block ranges)")
    amax = value["amax"]
    if isinstance(amax, (int, float)) and not isinstance(amax, bool):
        amax = [amax]
    if not isinstance(amax, (list, tuple)):
        raise ScalesError(f"weight {name!r}: 'amax' must be a list of numbers")
    try:
        return WeightRange(value.get("axis"), tuple(amax), value.get("block_size"))
    except ScalesError as exc:
        raise ScalesError(f"weight {name!r}: {exc}") from None


def _check_blocks(name: str, rng: WeightRange, shape: Tuple[int, ...], axis: int) -> None:
    """Refuse block ranges whose block size does not divide the axis or whose count is not the grid's."""
    if shape[axis] % rng.block_size:
        raise ScalesError(f"ScaleTable weight {name!r}: block_size {rng.block_size} does not divide "
                          f"dimension {shape[axis]} (axis {rng.axis})")
    grid = list(shape)
    grid[axis] //= rng.block_size
    count = math.prod(grid)
    if count != len(rng.amax):
        raise ScalesError(f"ScaleTable weight {name!r}: {len(rng.amax)} block amax values for a {grid} "
                          "block grid")


def block_ranges(weights: Mapping[str, "object"], axis: int, block_size: int) -> "ScaleTable":
    """A ScaleTable of INT4 block ranges measured on weight arrays: ``{name: array}`` -> max |w| of
    each block of ``block_size`` values along ``axis`` (e.g. to edit by hand or to keep with a model)."""
    from .formats.blockwise import block_amax

    ranges = {}
    for name, values in weights.items():
        try:
            amax = block_amax(values, axis, block_size)
        except ValueError as exc:
            raise ScalesError(f"weight {name!r}: {exc}") from None
        ranges[name] = WeightRange(axis, tuple(float(v) for v in amax.reshape(-1)), block_size)
    return ScaleTable(weights=ranges, producer="block_ranges")


#: Metadata key of a table calibrated for a deployment form other than ``tensorrt`` (``calibrate(...,
#: target="ort-cpu")`` writes ``"ort-cpu"``): ``quantize`` with such a table and that target treats its
#: ranges as calibrated for the model, as with ``data`` (the ``ort-cpu`` form's whole uint8 grid for
#: non-negative tensors, graph inputs >= 0 from their ``bounds``, the weight width of the CPU).
CALIBRATION_TARGET_KEY = "calibration_target"

# How a table's metadata says its ranges were chosen. ``calibrate`` records its method
# (``calibration_method``, ``percentile``) and, for ``auto``, the candidate table it kept
# (``auto_table``), each candidate's output cosine on the calibration data (``auto_output_cosine``),
# the per-tensor picks (``auto_choices``) and, when too few samples left the choice to the default,
# why (``auto_note``); the command line prints the line after ``calibrate`` and ``quantize``, so the
# choice ``auto`` made is visible without ``--verbose``.

#: How the summary names each of auto's candidate tables (``entropy``: a table of releases before
#: 2026-11-27, still named when a table file of theirs is read).
AUTO_TABLES = {"max": "max everywhere", "entropy": "entropy everywhere",
               "tensor": "the least-error range per tensor"}

_CANDIDATE = {"tensor": "per-tensor"}


def describe_method(metadata: Mapping[str, str]) -> str:
    """``ranges: max``, ``ranges: percentile 99.99`` or, for ``auto``, ``ranges: auto kept the
    least-error range per tensor (mse 84, max 1) | output cosine on the calibration data:
    per-tensor 0.99994, max 0.99992``, with the reason when the paired rule did not decide
    (``ranges: auto kept max everywhere (3 samples judged, fewer than the 8 the paired rule
    needs) | ...``). Empty when the metadata names no method (a table read from a file another
    tool wrote)."""
    method = metadata.get("calibration_method", "")
    if not method:
        return ""
    if method == "percentile" and metadata.get("percentile"):
        return f"ranges: percentile {metadata['percentile']}"
    if method != "auto" or "auto_table" not in metadata:
        return f"ranges: {method}"
    kept = metadata["auto_table"]
    text = f"ranges: auto kept {AUTO_TABLES.get(kept, kept)}"
    if kept == "tensor":
        picks = Counter(_json(metadata.get("auto_choices")).values())
        if picks:
            text += " (" + ", ".join(f"{name} {n}" for name, n in picks.most_common()) + ")"
    if metadata.get("auto_note"):
        text += f" ({metadata['auto_note']})"
    cosines = _json(metadata.get("auto_output_cosine"))
    if cosines:
        ranked = sorted(cosines.items(), key=lambda item: -float(item[1]))
        text += " | output cosine on the calibration data: " + ", ".join(
            f"{_CANDIDATE.get(name, name)} {float(value):.5f}" for name, value in ranked)
    return text


def kept_output_cosine(metadata: Mapping[str, str]) -> Optional[float]:
    """The output cosine, on the calibration data, of the table ``auto`` kept (its metadata
    ``auto_table`` and ``auto_output_cosine``); None for another method, or a table that does not say."""
    if metadata.get("calibration_method") != "auto":
        return None
    value = _json(metadata.get("auto_output_cosine")).get(metadata.get("auto_table", ""))
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None


def _json(text) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


__all__ = ["ScaleTable", "WeightRange", "FORMAT", "VERSION", "VERSIONS", "block_ranges", "describe_method",
           "kept_output_cosine", "AUTO_TABLES", "CALIBRATION_TARGET_KEY"]
