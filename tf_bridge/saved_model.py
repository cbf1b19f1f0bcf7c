"""A QAT model's SavedModel (``q_model.export(dir)``) carries what the Q/DQ export needs.

A TensorFlow SavedModel holds a traced graph and the variables, not the Keras model, and
tf2onnx converts that graph to a float ONNX model (the fake quantization becomes Round/Clip
arithmetic, no QuantizeLinear/DequantizeLinear). So every model made by
[`tf_bridge.quantize_model`][] (or read by [`tf_bridge.load_model`][]) carries a
*rebuild record*: its Keras configuration (JSON) in a one-entry ``tf.lookup.StaticHashTable``
attribute. Keras's ``model.export(dir)`` saves lookup tables it finds on the model, so the
SavedModel holds the configuration next to the variables (the trained weights and every
quantizer range), and [`rebuild_qat_model`][tf_bridge.saved_model.rebuild_qat_model] builds the same Keras QAT
model back from the directory, checked against the SavedModel's own ``serve`` function on sample inputs.

[`tf_bridge.compat.utils.convert_saved_model_to_onnx`][] uses it to export the Q/DQ model
through [`tf_bridge.export_onnx`][].
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import tensorflow as tf

from onnx_qat.errors import ExportError, ModelError, brief

logger = logging.getLogger(__name__)

RECORD_KEY = "tf_bridge.qat_model"
RECORD_FORMAT = 1
_ATTR = "_tf_bridge_rebuild_record"
_QUANTIZER_VARIABLES = ("amax", "initialized")
_SERVE_RTOL = 1e-4


def attach_rebuild_record(q_model) -> None:
    """Give ``q_model`` its rebuild record (its Keras configuration), so that the SavedModel of
    ``q_model.export(dir)`` can be rebuilt by [`rebuild_qat_model`][tf_bridge.saved_model.rebuild_qat_model].
    Models without tf_bridge quantizers are left alone."""
    import keras

    from .describe import iter_quantizer_layers

    if not any(True for _ in iter_quantizer_layers(q_model)):
        return
    config = keras.saving.serialize_keras_object(q_model)
    config.pop("compile_config", None)
    text = json.dumps({"format": RECORD_FORMAT, "model": config})
    with tf.init_scope():
        table = tf.lookup.StaticHashTable(_RecordInitializer(tf.constant([RECORD_KEY]), tf.constant([text])),
                                          default_value="")
    setattr(q_model, _ATTR, table)


class _RecordInitializer(tf.lookup.KeyValueTensorInitializer):
    """``KeyValueTensorInitializer`` that leaves the global graph's ``table_initializer`` collection
    alone (TensorFlow adds every eager initialization to it; each later tf.function graph inherits
    the collection and warns when it is serialized, as tf2onnx does)."""

    def initialize(self, table):
        return tf.raw_ops.LookupTableImportV2(table_handle=table.resource_handle, keys=self._keys,
                                              values=self._values)


def _find_record(loaded) -> Optional[dict]:
    for table in list(getattr(loaded, "_misc_assets", None) or ()):
        handle = getattr(table, "resource_handle", None)
        if handle is None:
            continue
        try:
            keys, values = tf.raw_ops.LookupTableExportV2(table_handle=handle, Tkeys=tf.string,
                                                          Tvalues=tf.string)
        except Exception:  # a table of other types: not ours
            continue
        for key, value in zip(keys.numpy(), values.numpy()):
            if key == RECORD_KEY.encode():
                return json.loads(value.decode("utf-8"))
    return None


def _variables(loaded) -> list:
    for attr in ("variables", "_all_variables"):
        found = list(getattr(loaded, attr, None) or ())
        if found:
            return found
    return []


def quantizer_variable_names(loaded) -> Tuple[str, ...]:
    """Names of the variables of a loaded SavedModel that look like tf_bridge quantizer state."""
    names = [v.name.split(":")[0] for v in _variables(loaded)]
    return tuple(n for n in names if n.rsplit("/", 1)[-1] in _QUANTIZER_VARIABLES)


def load_saved_model(directory):
    """``tf.saved_model.load(directory)``, failures as one [`ModelError`][onnx_qat.errors.ModelError] line."""
    source = Path(directory)
    if not source.is_dir() or not (source / "saved_model.pb").is_file():
        raise ModelError(f"{source}: not a SavedModel directory (no saved_model.pb)")
    try:
        return tf.saved_model.load(str(source))
    except Exception as exc:  # TensorFlow raises many types
        raise ModelError(f"{source}: TensorFlow cannot load this SavedModel: {brief(exc)}") from None


def rebuild_qat_model(directory, loaded=None):
    """The Keras QAT model a SavedModel was exported from, or None for a SavedModel without
    tf_bridge quantizers.

    Args:
        directory: the SavedModel directory (``q_model.export(directory)``).
        loaded: the directory already loaded with ``tf.saved_model.load`` (optional).

    Returns:
        A ``keras.Model`` with the SavedModel's weights and quantizer ranges, whose outputs
        equal the SavedModel's ``serve`` outputs; None when the SavedModel holds no quantizers.

    Raises:
        ExportError: the SavedModel holds quantizer variables but no rebuild record (one line
            saying what to do), or the rebuilt model differs from it.
        ModelError: not a SavedModel, or TensorFlow cannot load it.
    """
    import keras

    loaded = load_saved_model(directory) if loaded is None else loaded
    record = _find_record(loaded)
    if record is None:
        found = quantizer_variable_names(loaded)
        if found:
            raise ExportError(
                f"{directory}: this SavedModel holds quantizer variables ({found[0]}, ...) but not the Keras "
                "model they belong to, so its Q/DQ ONNX cannot be made from it; export from the Keras model "
                "with tf_bridge.export_onnx(q_model, path), or save it with q_model.save('name.keras') and "
                "convert that file")
        return None
    if record.get("format") != RECORD_FORMAT:
        raise ExportError(f"{directory}: rebuild record format {record.get('format')!r} is not "
                          f"{RECORD_FORMAT}; export it again with this tf_bridge version")
    from .quantizers import own_objects

    try:
        with keras.saving.custom_object_scope(dict(own_objects())):
            model = keras.saving.deserialize_keras_object(record["model"], safe_mode=True)
    except Exception as exc:  # Keras raises many types
        raise ExportError(f"{directory}: the Keras QAT model cannot be rebuilt from its record: {brief(exc)} "
                          "(declare or import its custom layers first)") from None
    _assign_variables(model, _variables(loaded), directory)
    _check_against_serve(model, loaded, directory)
    attach_rebuild_record(model)
    logger.info("%s: rebuilt Keras QAT model '%s' from the SavedModel", directory, model.name)
    return model


def _assign_variables(model, saved: list, directory) -> None:
    by_name = {v.name.split(":")[0]: v for v in saved}
    ordered = len(saved) == len(model.variables) and all(
        s.name.split(":")[0] == m.path and tuple(s.shape) == tuple(m.shape)
        for s, m in zip(saved, model.variables))
    for i, var in enumerate(model.variables):
        source = saved[i] if ordered else by_name.get(var.path)
        if source is None or tuple(source.shape) != tuple(var.shape):
            raise ExportError(f"{directory}: the SavedModel has no variable '{var.path}' shaped "
                              f"{tuple(var.shape)}; export the Keras model with tf_bridge.export_onnx "
                              "instead")
        var.assign(source.numpy())


def _check_against_serve(model, loaded, directory) -> None:
    serve = getattr(loaded, "serve", None)
    if serve is None:
        logger.warning("%s: the SavedModel has no 'serve' endpoint; the rebuilt model is not compared",
                       directory)
        return
    rng = np.random.default_rng(0)
    inputs = [rng.normal(0.0, 1.0, (2, *[d or 1 for d in t.shape[1:]])).astype(np.float32)
              for t in model.inputs]
    args = inputs if len(inputs) > 1 else inputs[0]
    want = [np.asarray(v) for v in tf.nest.flatten(serve(args))]
    got = [np.asarray(v) for v in tf.nest.flatten(model(args, training=False))]
    for w, g in zip(want, got):
        scale = max(float(np.max(np.abs(w))), 1e-6)
        if w.shape != g.shape or float(np.max(np.abs(w - g))) > _SERVE_RTOL * scale:
            raise ExportError(f"{directory}: the Keras model rebuilt from the SavedModel does not compute "
                              "what its 'serve' function computes; export from the Keras model with "
                              "tf_bridge.export_onnx instead")
