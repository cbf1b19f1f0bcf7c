"""TensorRT calibration caches: read them into a ScaleTable, write them from one.

TensorRT's implicit INT8 calibrators (``IInt8EntropyCalibrator2``, ``IInt8EntropyCalibrator``,
``IInt8MinMaxCalibrator``, ``IInt8LegacyCalibrator``) save their result as a text cache::

    TRT-8601-EntropyCalibration2
    input: 3c010204
    conv1_out: 3d8f5c29

* The header is ``TRT-<version>-<algorithm>``: ``<version>`` is TensorRT's ``NV_TENSORRT_VERSION``
  number (``8601`` for 8.6.1, ``100100`` for 10.1.0: major x 1000 + minor x 100 + patch up to
  TensorRT 9, major x 10000 + minor x 100 + patch from TensorRT 10), ``<algorithm>`` one of
  `ALGORITHMS`.
* Each further line is ``tensor_name: XXXXXXXX``: the hex digits of the IEEE-754 float32 bit pattern
  of the tensor's **scale**, most significant digit first (the 32-bit integer printed in hex, i.e.
  big-endian bytes). The range is ``amax = scale x 127``.
* Tensor names are the ONNX tensor names TensorRT's ONNX parser gives the network's tensors; a
  cache also holds names of tensors TensorRT made itself (e.g. ``(Unnamed Layer* 3) [Constant]_output``).

Sources: onnxruntime's TensorRT execution provider, ``ReadDynamicRange`` in
``onnxruntime/core/providers/tensorrt/tensorrt_execution_provider_utils.h`` (reads a native
TensorRT cache: the ``TRT-`` header, then ``name: hex``, the hex parsed with ``strtoul(..., 16)``
as the float32 bits of the scale, dynamic range = scale x 127); TensorRT C++ API reference,
``IInt8Calibrator::readCalibrationCache``/``writeCalibrationCache`` and ``CalibrationAlgoType``
(the four calibrators); NVIDIA TAO Toolkit's QAT export, which writes the same format from
per-tensor ranges (``scale = amax / 127``, header ``TRT-<version>-EntropyCalibration2``).

Per-channel and block weight ranges have no place in a cache: TensorRT's implicit INT8 measures
weight scales itself from the weights.
[`ScaleTable.to_tensorrt_cache`][onnx_qat.scales.ScaleTable.to_tensorrt_cache] writes a table's activation
ranges only and logs (info level) how many weight ranges it left out.

Exactness: a cache stores float32 scales. Reading gives ``amax = float64(scale) x 127`` (exact in
float64), and writing ``scale = float32(amax / 127)``, which is what the Q/DQ inserter computes
too (`onnx_qat.insertion.inserter.activation_scale`). So cache -> ScaleTable -> cache is byte for
byte the same cache, ScaleTable -> cache -> ScaleTable is bit for bit the same table whenever the
table's ranges came from a cache, and within float32 rounding (relative 6e-8) otherwise; either
way the Q/DQ model quantized from the round-tripped table has bit-identical scales.
"""
from __future__ import annotations

import logging
import math
import re
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Tuple

from ..errors import ScalesError

logger = logging.getLogger(__name__)

#: Calibration algorithms named in cache headers (TensorRT's ``CalibrationAlgoType``):
#: IInt8EntropyCalibrator2, IInt8EntropyCalibrator, IInt8MinMaxCalibrator, IInt8LegacyCalibrator.
ALGORITHMS = ("EntropyCalibration2", "EntropyCalibration", "MinMaxCalibration", "LegacyCalibration")
DEFAULT_ALGORITHM = "EntropyCalibration2"
#: Largest cache read (a cache line is ~50 bytes: 10^6 tensors is 50 MB).
MAX_CACHE_BYTES = 64 * 1024 * 1024
#: The int8 limit a cache's scale multiplies to give amax.
INT8_MAX = 127.0

_HEADER = re.compile(r"TRT-(\d+)-([A-Za-z0-9]+)")
_HEX = re.compile(r"[0-9A-Fa-f]{1,8}")


def is_tensorrt_cache(path) -> bool:
    """True when the file at ``path`` is to be read as a TensorRT calibration cache: it begins with
    ``TRT-``, or it is not named ``*.json`` and does not begin with ``{`` (then the cache reader names
    what is wrong with it). False for a file that cannot be read (the JSON reader names the problem)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    if head.startswith(b"TRT-"):
        return True
    return Path(path).suffix.lower() != ".json" and not head.lstrip().startswith(b"{")


def tensorrt_version_number(version: str) -> int:
    """``"8.6.1"`` -> 8601, ``"10.1.0"`` -> 100100: TensorRT's ``NV_TENSORRT_VERSION`` for a header.

    Raises:
        ScalesError: ``version`` is not ``MAJOR.MINOR[.PATCH]`` with major 5 or more.
    """
    match = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?(?:\.\d+)*", str(version).strip())
    if not match:
        raise ScalesError(f"TensorRT version {version!r} is not MAJOR.MINOR.PATCH (e.g. 8.6.1 or 10.3.0)")
    major, minor, patch = (int(g or 0) for g in match.groups())
    if major < 5 or minor > 99 or patch > 99:
        raise ScalesError(f"TensorRT version {version!r} is not one that writes calibration caches")
    return major * (10000 if major >= 10 else 1000) + minor * 100 + patch


def scale_to_hex(scale: float) -> str:
    """The cache's text for a float32 scale: its bit pattern as 8 lower-case hex digits."""
    return struct.pack(">f", scale).hex()


def hex_to_scale(text: str) -> float:
    """The float32 a cache's hex digits stand for (1 to 8 digits, most significant first)."""
    return struct.unpack(">f", bytes.fromhex(text.zfill(8)))[0]


def parse_tensorrt_cache(text: str, *,
                         source: str = "TensorRT calibration cache") -> Tuple[str, Dict[str, float]]:
    """Read a calibration cache's text: ``(header, {tensor name: amax})`` with ``amax = scale x 127``
    ([`onnx_qat.scales.ScaleTable.from_tensorrt_cache`][] makes the ScaleTable of it).

    Raises:
        ScalesError: one line naming ``source`` and the first bad line: no ``TRT-<version>-<algorithm>``
            header, an unknown algorithm, a line that is not ``name: hex``, digits that are not 1 to 8
            hex digits, a scale that is NaN, infinite, zero or negative, a name given twice, or no
            entries at all.
    """
    lines = text.splitlines()
    header = lines[0].strip() if lines else ""
    match = _HEADER.fullmatch(header)
    if not match:
        shown = header[:60] + ("..." if len(header) > 60 else "")
        raise ScalesError(f"{source} is not a TensorRT calibration cache: its first line {shown!r} is not "
                          f"'TRT-<version>-<algorithm>' (e.g. TRT-8601-EntropyCalibration2)")
    if match.group(2) not in ALGORITHMS:
        raise ScalesError(f"{source}: unknown calibration algorithm {match.group(2)!r} in its header "
                          f"(TensorRT writes {', '.join(ALGORITHMS)})")
    ranges = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        name, sep, digits = line.rpartition(":")
        name, digits = name.strip(), digits.strip()
        if not sep or not name:
            raise ScalesError(f"{source} line {number}: {line.strip()[:80]!r} is not "
                              "'tensor_name: hex scale'")
        if not _HEX.fullmatch(digits):
            raise ScalesError(f"{source} line {number}: {digits[:40]!r} for {name!r} is not 1 to 8 hex "
                              f"digits (the float32 bits of the scale)")
        scale = hex_to_scale(digits)
        if not math.isfinite(scale) or scale <= 0.0:
            raise ScalesError(f"{source} line {number}: tensor {name!r} has scale {scale!r} ({digits}); "
                              f"a scale must be finite and > 0")
        if name in ranges:
            raise ScalesError(f"{source} line {number}: tensor {name!r} is given twice")
        ranges[name] = float(scale) * INT8_MAX
    if not ranges:
        raise ScalesError(f"{source} holds no tensor scales (only its header)")
    return header, ranges


def read_tensorrt_cache(path) -> Tuple[str, Dict[str, float]]:
    """Read the calibration cache file at ``path``: ``(header, {tensor name: amax})`` (see
    `parse_tensorrt_cache`).

    Raises:
        ScalesError: the file is missing, too large, not text, or not a valid cache (one line).
    """
    path = Path(path)
    source = f"TensorRT calibration cache {path}"
    try:
        size = path.stat().st_size
        if size > MAX_CACHE_BYTES:
            raise ScalesError(f"{source} is {size} bytes; calibration caches over {MAX_CACHE_BYTES} bytes "
                              "are refused")
        data = path.read_bytes()
    except FileNotFoundError:
        raise ScalesError(f"{source} does not exist") from None
    except IsADirectoryError:
        raise ScalesError(f"{source} is a directory") from None
    except OSError as exc:
        raise ScalesError(f"{source} cannot be read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScalesError(f"{source} is not text (byte {exc.start} is not UTF-8); a calibration cache is "
                          "TensorRT's text format") from None
    return parse_tensorrt_cache(text, source=source)


def format_tensorrt_cache(activations: Mapping[str, float], *, tensorrt_version: str,
                          algorithm: str = DEFAULT_ALGORITHM) -> str:
    """The calibration cache text of activation ranges (``scale = float32(amax / 127)``), in the
    mapping's order.

    Args:
        activations: tensor name -> amax (a ScaleTable's ``activations``).
        tensorrt_version: the TensorRT that will read the cache, ``MAJOR.MINOR.PATCH``; it goes into
            the header (TensorRT may skip a cache whose header names another version or algorithm).
        algorithm: the calibrator the cache claims (one of `ALGORITHMS`); use the one whose
            ``read_calibration_cache`` will hand the cache to TensorRT.

    Raises:
        ScalesError: a bad version or algorithm, no activation ranges, a name with a line break, or a
            range whose float32 scale is not finite and > 0.
    """
    if algorithm not in ALGORITHMS:
        raise ScalesError(f"calibration algorithm {algorithm!r} is not one TensorRT writes "
                          f"({', '.join(ALGORITHMS)})")
    header = f"TRT-{tensorrt_version_number(tensorrt_version)}-{algorithm}"
    if not activations:
        raise ScalesError("the ScaleTable has no activation ranges to write into a calibration cache")
    lines = [header]
    for name, amax in activations.items():
        if "\n" in name or "\r" in name:
            raise ScalesError(f"tensor name {name!r} holds a line break; a calibration cache cannot hold it")
        scale = struct.unpack(">f", struct.pack(">f", amax / INT8_MAX))[0]  # float32, as the inserter rounds
        if not math.isfinite(scale) or scale <= 0.0:
            raise ScalesError(f"activation {name!r}: amax {amax!r} gives float32 scale {scale!r}; a cache "
                              "scale must be finite and > 0")
        lines.append(f"{name}: {scale_to_hex(scale)}")
    return "\n".join(lines) + "\n"


def write_tensorrt_cache(activations: Mapping[str, float], path, *, tensorrt_version: str,
                         algorithm: str = DEFAULT_ALGORITHM) -> None:
    """Write `format_tensorrt_cache` to ``path`` atomically (nothing is written when it raises)."""
    from .files import atomic_write_text

    text = format_tensorrt_cache(activations, tensorrt_version=tensorrt_version, algorithm=algorithm)
    atomic_write_text(path, text)


def names_in_model(cache_names: Iterable[str], tensor_names: Iterable[str], *,
                   source: str = "TensorRT calibration cache") -> List[str]:
    """The cache's names that are tensors of the model; one warning lists the others (first 20 named).

    A cache names every tensor of TensorRT's network, some of which TensorRT made itself; they are
    not an error. A cache of which no name is in the model is (another model's cache, or a model
    renamed since calibration).

    Raises:
        ScalesError: no name of the cache is a tensor of the model.
    """
    names, cache_names = set(tensor_names), list(cache_names)
    kept = [n for n in cache_names if n in names]
    unmatched = [n for n in cache_names if n not in names]
    if not kept:
        shown = ", ".join(repr(n) for n in cache_names[:3])
        raise ScalesError(f"{source} matches no tensor of the model: none of its {len(unmatched)} names "
                          f"(e.g. {shown}) is a tensor name of the model; was it made for another model?")
    if unmatched:
        more = f" ... (+{len(unmatched) - 20} more)" if len(unmatched) > 20 else ""
        shown = ", ".join(unmatched[:20]) + more
        logger.warning("%s: %d of %d tensor name(s) are not in the model and are ignored: %s", source,
                       len(unmatched), len(cache_names), shown)
    return kept


__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "is_tensorrt_cache", "read_tensorrt_cache",
           "parse_tensorrt_cache", "format_tensorrt_cache", "write_tensorrt_cache", "names_in_model",
           "tensorrt_version_number", "scale_to_hex", "hex_to_scale"]
