"""load_model: a Keras model from a ``.keras`` archive, always with Keras's safe mode.

``keras.models.load_model`` rebuilds a model from the archive's ``config.json``; a
``Lambda`` layer stores its Python function there as marshalled bytecode, which runs as
soon as the model is rebuilt. [`load_model`][tf_bridge.loading.load_model] never lets that happen: it reads
only ``.keras`` archives, refuses any Python lambda it finds in the configuration before Keras
sees it, and passes ``safe_mode=True`` to Keras (which also refuses non-modeling functions,
external SavedModels and vocabulary files outside the archive), whatever
``keras.config.enable_unsafe_deserialization()`` was set to. Every failure is one
[`onnx_qat.errors.ModelError`][] line naming the file.
"""
from __future__ import annotations

import json
import logging
import re
import zipfile
from pathlib import Path
from typing import List, Mapping, Optional

from onnx_qat.errors import ModelError, brief
from onnx_qat.io.files import MAX_JSON_BYTES

logger = logging.getLogger(__name__)

_SAVE_HINT = "save the model with model.save('name.keras')"


def load_model(path, *, custom_objects: Optional[Mapping[str, object]] = None, compile: bool = True):
    """Load a Keras model (a float model, or a QAT model saved after training) from a ``.keras`` archive.

    The archive is deserialized with Keras's safe mode, always: Python lambdas (bytecode)
    and other unsafe content are refused without being run. tf_bridge's layers
    ([`ActivationQuantizer`][tf_bridge.ActivationQuantizer], [`QuantizeWrapper`][tf_bridge.QuantizeWrapper])
    are known without an import or a scope, so a saved QAT model reloads with identical outputs
    and quantizer ranges. The file is only read.

    Args:
        path: the ``.keras`` file (written by ``model.save("name.keras")``).
        custom_objects: your own layers, functions or losses by name, as for
            ``keras.models.load_model`` (classes registered with
            ``keras.saving.register_keras_serializable`` need not be listed).
        compile: restore the training configuration (optimizer, loss, metrics) too.

    Returns:
        The ``keras.Model``.

    Raises:
        ModelError: one line naming the file: it is missing, a directory, not a ``.keras``
            archive (``.h5`` files and SavedModel directories are not read), holds a Python
            lambda or other content refused by safe mode ("unsafe deserialization refused"),
            names a class Keras does not know, or Keras cannot rebuild it (its message, shortened).
    """
    import keras

    source = Path(path)
    lambdas = _lambda_layers(_read_config(source))
    if lambdas:
        raise ModelError(f"{source}: unsafe deserialization refused: layer '{lambdas[0]}' holds a Python "
                         "lambda (bytecode that would run on loading); rebuild it as a Keras layer "
                         "class registered with keras.saving.register_keras_serializable and save again")
    from .quantizers import own_objects

    objects = dict(own_objects())
    objects.update(custom_objects or {})
    try:
        model = keras.models.load_model(str(source), custom_objects=objects, compile=compile, safe_mode=True)
    except Exception as exc:  # Keras raises ValueError, TypeError, OSError, KeyError...
        raise ModelError(f"{source}: {_keras_reason(exc)}") from None
    logger.debug("loaded %s (%s, %d layers)", source, type(model).__name__, len(model.layers))
    from .saved_model import attach_rebuild_record

    attach_rebuild_record(model)  # a QAT model's SavedModel (model.export) stays rebuildable
    return model


def _read_config(source: Path):
    """The archive's ``config.json`` (size bounded), once ``source`` is known to be a ``.keras`` archive."""
    if not source.exists():
        raise ModelError(f"{source}: no such file; give the path of a .keras archive ({_SAVE_HINT})")
    if source.is_dir():
        raise ModelError(f"{source}: is a directory (a SavedModel?); tf_bridge.load_model reads .keras "
                         f"archives only: {_SAVE_HINT}")
    if source.suffix != ".keras":
        raise ModelError(f"{source}: not a .keras archive (suffix '{source.suffix}'); legacy .h5 files and "
                         f"SavedModels are not read: {_SAVE_HINT}")
    try:
        with zipfile.ZipFile(source) as archive:
            if "config.json" not in archive.namelist():
                raise ModelError(f"{source}: not a .keras archive (a zip file without config.json); "
                                 f"{_SAVE_HINT}")
            with archive.open("config.json") as handle:
                data = handle.read(MAX_JSON_BYTES + 1)
    except (zipfile.BadZipFile, OSError, RuntimeError) as exc:
        raise ModelError(f"{source}: not a .keras archive (not a readable zip file: {brief(exc, 80)}); "
                         f"{_SAVE_HINT}") from None
    if len(data) > MAX_JSON_BYTES:
        raise ModelError(f"{source}: config.json is over {MAX_JSON_BYTES // (1024 * 1024)} MiB; "
                         "not a model configuration")
    try:
        return json.loads(data)
    except ValueError as exc:
        raise ModelError(f"{source}: not a .keras archive (config.json is not JSON: {brief(exc, 80)}); "
                         f"{_SAVE_HINT}") from None


def _lambda_layers(config, layer: str = "?") -> List[str]:
    """Names of the layers whose configuration holds a serialized Python lambda (``__lambda__``)."""
    found: List[str] = []
    if isinstance(config, dict):
        inner = config.get("config")
        if "class_name" in config and isinstance(inner, dict) and isinstance(inner.get("name"), str):
            layer = inner["name"]
        if config.get("class_name") == "__lambda__":
            found.append(layer)
        for value in config.values():
            found += _lambda_layers(value, layer)
    elif isinstance(config, list):
        for value in config:
            found += _lambda_layers(value, layer)
    return found


def _keras_reason(exc: BaseException) -> str:
    """Keras's loading error as a short reason (its innermost message; unsafe content named so)."""
    text = str(exc).rsplit("Exception encountered:", 1)[-1].strip()
    unknown = re.search(r"Could not locate (class|function) '([^']+)'", text)
    if unknown:
        kind, name = unknown.groups()
        return (f"unknown Keras {kind} '{name}'; import the module that defines it (registered with "
                f"keras.saving.register_keras_serializable) before loading, or pass "
                f"custom_objects={{'{name}': ...}}")
    if "safe_mode=False" in text or "disallowed during deserialization for security" in text:
        first = re.split(r"(?<=\.)\s", text, maxsplit=1)[0]
        return (f"unsafe deserialization refused (Keras safe mode): {brief(first, 160).rstrip('.')}; "
                "it could run code or read files chosen by whoever wrote the archive")
    return f"Keras could not load it: {brief(text, 200, first_line=True)}"


__all__ = ["load_model"]
