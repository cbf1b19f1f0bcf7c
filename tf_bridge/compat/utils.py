"""The toolkit's ``utils``: experiment folders, ONNX conversion and Keras-graph helpers.

The two converters never write a float model silently:

* a QAT model (made by [`tf_bridge.quantize_model`][]; in memory, a ``.keras`` file, or the
  SavedModel of ``q_model.export(dir)``) is exported through [`tf_bridge.export_onnx`][]: the
  TensorRT Q/DQ ONNX model with the learned ranges, its parity with the Keras QAT model proven
  in onnxruntime, and its [`onnx_qat.check`][onnx_qat.check.check] verdict in the returned report;
* a Q/DQ model that breaks a TensorRT rule of [`onnx_qat.check`][onnx_qat.check.check] (a spec that quantizes
  a Conv's input but not its weight, rule C9) is written with a `CheckFailedWarning`;
* a model without tf_bridge quantizers is converted to a float ONNX model by tf2onnx, with a
  [`FloatModelWarning`][tf_bridge.compat.utils.FloatModelWarning] saying so (the toolkit's workflow converts
  the FP32 baseline too);
* a SavedModel that holds quantizer variables but cannot be rebuilt is refused in one line
  saying what to do.

Plain ``python -m tf2onnx.convert --saved-model`` on a QAT SavedModel cannot be intercepted: it
writes a float graph of the fake quantization (Round/Clip arithmetic, no Q/DQ). Use these
converters or [`tf_bridge.export_onnx`][] for the Q/DQ model.
"""
from __future__ import annotations

import logging
import shutil
import warnings
from pathlib import Path
from typing import List, Optional

from onnx_qat.errors import ExportError, ModelError, brief

logger = logging.getLogger(__name__)

__all__ = [
    "CreateAssetsFolders", "Folder", "convert_saved_model_to_onnx", "convert_keras_model_to_onnx",
    "KerasModelTraveller", "find_my_predecessors", "find_my_successors", "FloatModelWarning",
    "UncalibratedExportWarning", "CheckFailedWarning",
]

_ARTIFACTS = (("fp32", "saved_model"), ("fp32", "original.onnx"), ("int8", "saved_model"),
              ("int8", "quantized.onnx"))


class FloatModelWarning(UserWarning):
    """The model given to a converter has no tf_bridge quantizers: the ONNX model written is float."""


# --------------------------------------------------------------------------- folders
class Folder:
    """One experiment's paths: ``fp32_saved_model``, ``fp32_onnx_model``, ``int8_saved_model``,
    ``int8_onnx_model`` under ``<base>/fp32`` and ``<base>/int8`` (created)."""

    def __init__(self, folder_name) -> None:
        self.base = str(folder_name)
        self.fp32 = str(Path(self.base, "fp32"))
        self.int8 = str(Path(self.base, "int8"))
        for sub in (self.fp32, self.int8):
            Path(sub).mkdir(parents=True, exist_ok=True)
        self.fp32_saved_model = str(Path(self.fp32, "saved_model"))
        self.fp32_onnx_model = str(Path(self.fp32, "original.onnx"))
        self.int8_saved_model = str(Path(self.int8, "saved_model"))
        self.int8_onnx_model = str(Path(self.int8, "quantized.onnx"))
        for sub, name in _ARTIFACTS:  # an earlier run's artifacts, never anything else
            old = Path(self.base, sub, name)
            if old.is_dir() and (old / "saved_model.pb").is_file():
                shutil.rmtree(old)
            elif old.is_file():
                old.unlink()


class CreateAssetsFolders:
    """Folders for the original and quantized models of each experiment:
    ``base/<experiment>/fp32/{saved_model, original.onnx}`` and ``.../int8/{saved_model, quantized.onnx}``.

    Args:
        base_experiment_directory: the base directory (created if missing).
    """

    def __init__(self, base_experiment_directory) -> None:
        self.base = str(base_experiment_directory)
        Path(self.base).mkdir(parents=True, exist_ok=True)

    def add_folder(self, folder_name: str) -> None:
        """Create ``<base>/<folder_name>`` and make it the attribute ``folder_name`` (a `Folder`).
        Artifacts an earlier run left at the four known paths are removed; other files are kept."""
        setattr(self, folder_name, Folder(Path(self.base, folder_name)))


# --------------------------------------------------------------------------- conversion
def _quantized(model) -> bool:
    from ..describe import iter_quantizer_layers

    return any(True for _ in iter_quantizer_layers(model))


def _float_warning(what: str, onnx_model_path) -> None:
    warnings.warn(f"{what} has no tf_bridge quantizers: {onnx_model_path} is a float ONNX model (no Q/DQ); "
                  "quantize with tf_bridge.compat.quantize_model for an INT8 model", FloatModelWarning,
                  stacklevel=3)


class CheckFailedWarning(UserWarning):
    """The Q/DQ model written breaks a TensorRT rule of [`onnx_qat.check`][onnx_qat.check.check] (its report
    says which)."""


class UncalibratedExportWarning(UserWarning):
    """A QAT model was converted before calibration or training: its ranges come from the sample data."""


UNCALIBRATED = ("calibrate", "raise")


def _copy_model(q_model):
    """An independent copy of a QAT model (configuration and every weight, quantizer ranges included)."""
    import keras

    from ..quantizers import own_objects

    with keras.saving.custom_object_scope(dict(own_objects())):
        copy = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(q_model))
    copy.set_weights(q_model.get_weights())
    return copy


def _export(q_model, onnx_model_path, opset, sample_data, target, uncalibrated, owned: bool):
    """[`tf_bridge.export_onnx`][], after calibrating (a copy of) a model whose activation
    quantizers have no range yet when ``uncalibrated="calibrate"``."""
    from ..calibrate import calibrate
    from ..describe import quantizer_records
    from ..export import _input_arrays, export_onnx

    if uncalibrated not in UNCALIBRATED:
        raise ExportError(f"uncalibrated must be one of {', '.join(UNCALIBRATED)}, got {uncalibrated!r}")
    missing = [r.path for r in quantizer_records(q_model) if r.kind == "activation" and r.amax is None]
    if missing and uncalibrated == "calibrate":
        inputs, generated = _input_arrays(q_model, sample_data)
        source = "generated standard-normal inputs" if generated else "sample_data"
        warnings.warn(f"{len(missing)} activation quantizer(s) of '{q_model.name}' have no range (the model "
                      f"was neither calibrated nor trained); their ranges are taken from {source}: call "
                      "tf_bridge.calibrate(q_model, data) with real data first", UncalibratedExportWarning,
                      stacklevel=4)
        q_model = q_model if owned else _copy_model(q_model)
        calibrate(q_model, inputs if len(inputs) > 1 else inputs[0], progress=False)
    report = export_onnx(q_model, onnx_model_path, opset=opset, target=target, sample_data=sample_data)
    if report.check is not None and report.check.errors:
        errors = report.check.errors
        warnings.warn(f"{report.path}: written, but onnx-qat check found {len(errors)} error(s), e.g. "
                      f"{errors[0]}", CheckFailedWarning, stacklevel=4)
    return report


def convert_keras_model_to_onnx(keras_model, onnx_model_path, opset: int = 13, *, sample_data=None,
                                target: str = "tensorrt", uncalibrated: str = "calibrate"):
    """Write the ONNX model of an in-memory Keras model.

    Args:
        keras_model: a QAT model (its Q/DQ ONNX through [`tf_bridge.export_onnx`][], which needs
            it calibrated or trained) or a float model (a float ONNX model, with a
            [`FloatModelWarning`][tf_bridge.compat.utils.FloatModelWarning]).
        onnx_model_path: the ``.onnx`` file to write.
        opset: the ONNX opset (>= 13; the toolkit's default 13).
        sample_data: inputs for the export's mapping and parity proof (None: generated).
        target: the deployment target of the Q/DQ model (``"tensorrt"``, ``"ort-cpu"``).
        uncalibrated: what to do with a QAT model whose activation quantizers have no range
            yet: ``"calibrate"`` (the toolkit converts such a model: a copy is calibrated on
            ``sample_data`` or generated inputs, with an
            [`UncalibratedExportWarning`][tf_bridge.compat.utils.UncalibratedExportWarning]; ``keras_model``
            is not modified) or ``"raise"`` (an ``ExportError``, as [`tf_bridge.export_onnx`][] does).

    Returns:
        The [`tf_bridge.ExportReport`][] of a QAT model; None for a float model.

    Raises:
        ExportError: see [`tf_bridge.export_onnx`][].
    """
    if _quantized(keras_model):
        return _export(keras_model, onnx_model_path, opset, sample_data, target, uncalibrated, owned=False)
    from onnx_qat.io.models import save_model

    from ..export import check_exportable, convert_float_twin

    _float_warning(f"model '{keras_model.name}'", onnx_model_path)
    check_exportable(keras_model)
    save_model(convert_float_twin(keras_model, opset), onnx_model_path)
    return None


def convert_saved_model_to_onnx(saved_model_dir, onnx_model_path, opset: int = 13, *, sample_data=None,
                                target: str = "tensorrt", uncalibrated: str = "calibrate"):
    """Write the ONNX model of a SavedModel directory (``model.export(dir)``) or a ``.keras`` file.

    A QAT model's SavedModel carries its Keras configuration (`tf_bridge.saved_model`): the
    Keras QAT model is rebuilt from it (checked against the SavedModel's ``serve`` function) and
    exported through [`tf_bridge.export_onnx`][].

    Args:
        saved_model_dir: the SavedModel directory, or a ``.keras`` file.
        onnx_model_path: the ``.onnx`` file to write.
        opset: the ONNX opset (>= 13).
        sample_data: inputs for the export's mapping and parity proof (None: generated).
        target: the deployment target of the Q/DQ model.
        uncalibrated: ``"calibrate"`` or ``"raise"``, as for
            [`convert_keras_model_to_onnx`][tf_bridge.compat.utils.convert_keras_model_to_onnx].

    Returns:
        The [`tf_bridge.ExportReport`][] of a QAT model; None for a float model (written with a
        [`FloatModelWarning`][tf_bridge.compat.utils.FloatModelWarning]).

    Raises:
        ExportError: a SavedModel with quantizer variables but no rebuild record (one line saying
            what to do), or an export failure.
        ModelError: the path is neither a SavedModel directory nor a ``.keras`` file.
    """
    source = Path(saved_model_dir)
    if source.suffix == ".keras" and source.is_file():
        from ..loading import load_model

        model = load_model(source, compile=False)
        if not _quantized(model):
            return convert_keras_model_to_onnx(model, onnx_model_path, opset, target=target)
        return _export(model, onnx_model_path, opset, sample_data, target, uncalibrated, owned=True)
    from ..saved_model import load_saved_model, rebuild_qat_model

    loaded = load_saved_model(source)
    q_model = rebuild_qat_model(source, loaded)
    if q_model is not None:
        return _export(q_model, onnx_model_path, opset, sample_data, target, uncalibrated, owned=True)
    _float_warning(f"SavedModel {source}", onnx_model_path)
    _float_saved_model(source, onnx_model_path, opset)
    return None


def _float_saved_model(source: Path, onnx_model_path, opset: int) -> None:
    from tf2onnx import convert, tf_loader

    from onnx_qat.io.models import save_model

    try:
        graph_def, inputs, outputs = tf_loader.from_saved_model(str(source), None, None, tag="serve",
                                                                signatures=["serving_default"])
        proto, _ = convert.from_graph_def(graph_def, input_names=inputs, output_names=outputs,
                                          opset=int(opset))
    except Exception as exc:  # tf2onnx raises many types
        raise ExportError(f"{source}: tf2onnx could not convert this SavedModel: {brief(exc)}") from None
    save_model(proto, onnx_model_path)


# --------------------------------------------------------------------------- Keras graph helpers
def _info(layer) -> dict:
    return {"class": type(layer).__name__, "module": type(layer).__module__, "name": layer.name,
            "layer": layer}


def _check_graph_model(model, layer_name) -> None:
    import keras
    from keras.src.models.functional import Functional

    if not isinstance(layer_name, str):
        raise ModelError(f"layer name must be a string, got {layer_name!r}")
    if not isinstance(model, (Functional, keras.Sequential)):
        raise ModelError(f"model '{getattr(model, 'name', model)}' must be a Functional or Sequential model")


def _predecessors(layer) -> List[dict]:
    from ..case_base import input_tensors, producer

    if not layer._inbound_nodes:
        return []
    return [_info(producer(t)[0]) for t in input_tensors(layer)]


def find_my_predecessors(model, current_layer_name: str) -> Optional[List[dict]]:
    """The layers whose outputs ``current_layer_name`` reads, in input order.

    Args:
        model: a Functional or Sequential Keras model.
        current_layer_name: a layer name of ``model``.

    Returns:
        One dict per input: ``{"class", "module", "name", "layer"}``; None if no layer has that name.

    Raises:
        ModelError: ``model`` is subclassed, or the name is not a string.
    """
    _check_graph_model(model, current_layer_name)
    for layer in model.layers:
        if layer.name == current_layer_name:
            return _predecessors(layer)
    return None


def find_my_successors(model, current_layer_name: str) -> Optional[List[dict]]:
    """The layers that read the output of ``current_layer_name``, in model layer order.

    Args:
        model: a Functional or Sequential Keras model.
        current_layer_name: a layer name of ``model``.

    Returns:
        One dict per consuming layer: ``{"class", "module", "name", "layer"}``; None if no layer
        has that name.

    Raises:
        ModelError: ``model`` is subclassed, or the name is not a string.
    """
    _check_graph_model(model, current_layer_name)
    layers = list(model.layers)
    for i, layer in enumerate(layers):
        if layer.name == current_layer_name:
            return [_info(nxt) for nxt in layers[i + 1:]
                    if any(p["layer"] is layer for p in _predecessors(nxt))]
    return None


class KerasModelTraveller:
    """Walks a Keras model, nested models included, and lists or prints its layers.

    Args:
        print_layer_config: also print each layer's ``get_config()`` in
            [`get_layer_information`][tf_bridge.compat.utils.KerasModelTraveller.get_layer_information].
    """

    def __init__(self, print_layer_config: bool = False) -> None:
        self._print_config = print_layer_config

    def _walk(self, model, filter_by_class):
        import keras

        if not isinstance(model, keras.Model):
            raise ModelError(f"KerasModelTraveller: expected a keras.Model, got {type(model).__name__}")
        for layer in model.layers:
            if isinstance(layer, keras.Model):
                yield from self._walk(layer, filter_by_class)
            elif filter_by_class is None or type(layer) in tuple(filter_by_class):
                yield layer

    def get_layer_names(self, keras_model, filter_by_class=None) -> List[str]:
        """Names of every layer (nested models' layers in place of the nested model).

        Args:
            keras_model: the model.
            filter_by_class: None, or a list of layer classes to keep.
        """
        return [layer.name for layer in self._walk(keras_model, filter_by_class)]

    def get_layer_information(self, keras_model, filter_by_class=None) -> None:
        """Print name and class (and config with ``print_layer_config``) of every layer.

        Args:
            keras_model: the model.
            filter_by_class: None, or a list of layer classes to keep.
        """
        for layer in self._walk(keras_model, filter_by_class):
            print(f"layer name:{layer.name}, layer class:{type(layer)}")
            if self._print_config:
                print(layer.get_config())
            print("-----------------")
