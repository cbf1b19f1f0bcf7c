"""The exceptions users see.

Every problem a user can cause (a bad model, bad data, a bad ScaleTable, a bad
option or output path) is raised as a subclass of [`QatError`][onnx_qat.errors.QatError] whose
message is one line naming the file or option and what is wrong. The CLI prints
that line on stderr and exits with code 2; ``--verbose`` adds the traceback.

The errors an input causes ([`ModelError`][onnx_qat.errors.ModelError],
[`DataError`][onnx_qat.errors.DataError], [`ScalesError`][onnx_qat.errors.ScalesError],
[`PlacementError`][onnx_qat.errors.PlacementError], [`OutputError`][onnx_qat.errors.OutputError],
[`ConfigError`][onnx_qat.errors.ConfigError], [`ExportError`][onnx_qat.errors.ExportError]) are also
``ValueError`` instances, so ``except ValueError`` catches them as it catches bad input in NumPy, onnx or
Keras; [`TensorRTUnavailable`][onnx_qat.errors.TensorRTUnavailable] (the machine, not the input) is not.
"""
from __future__ import annotations


class QatError(Exception):
    """Base class of every error a user can cause. ``str(err)`` is one line."""

    def __init__(self, message: str):
        # Keep messages to one line: the CLI prints exactly this.
        super().__init__(" ".join(str(message).split()))


class ModelError(QatError, ValueError):
    """The model cannot be read, is not valid ONNX, or cannot be processed."""


class DataError(QatError, ValueError):
    """Calibration or evaluation data is missing, malformed, or does not fit the model."""


class ScalesError(QatError, ValueError):
    """A ScaleTable is malformed, of an unknown version, or does not fit the model."""


class PlacementError(QatError, ValueError):
    """Quantization cannot be placed: nothing to quantize, already quantized, bad options."""


class OutputError(QatError, ValueError):
    """An output path cannot be written (equals the input, is a directory, read-only...)."""


class ConfigError(QatError, ValueError):
    """An option has an invalid value."""


class ExportError(QatError, ValueError):
    """A Keras model cannot be exported (tf2onnx failure, an unmapped quantizer...)."""


class AccuracyError(QatError):
    """The requested accuracy (``min_cosine``) cannot be reached within the float-site budget."""


class TrainingError(QatError):
    """Quantization-aware training diverged: the loss or a weight became NaN or Inf."""


class WorkerError(QatError):
    """A worker process (``workers=`` > 1, or a Ray task) failed on a unit with an error that is not the
    project's own, or ended unexpectedly (out of memory, a crash); or ``ray=`` was asked for and Ray is
    missing or unreachable. The machine or a bug, not the input."""


class TensorRTUnavailable(QatError):
    """TensorRT or a CUDA GPU is not available on this machine."""


def brief(exc: BaseException, limit=200, *, first_line: bool = False) -> str:
    """Another library's exception as a short fragment for a one-line message.

    ``first_line``: the first line of the message, cut at ``limit`` characters (None: no cut);
    otherwise the whole message with white space folded, ``...`` after ``limit`` characters.
    The exception's type name stands in for an empty message.
    """
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    if first_line:
        line = text.splitlines()[0]
        return line if limit is None else line[:limit]
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


__all__ = [
    "brief",
    "QatError",
    "ModelError",
    "DataError",
    "ScalesError",
    "PlacementError",
    "OutputError",
    "ConfigError",
    "ExportError",
    "AccuracyError",
    "WorkerError",
    "TensorRTUnavailable",
]
