"""quantize_model: a new Keras model with quantizers inserted; the original is untouched.

Functional models are rebuilt with ``keras.models.clone_model(model,
clone_function=..., call_function=...)``: ``clone_function`` copies each layer
(config + weights) and wraps weighted layers in [`QuantizeWrapper`][tf_bridge.quantizers.QuantizeWrapper];
``call_function`` puts an [`ActivationQuantizer`][tf_bridge.quantizers.ActivationQuantizer] in front of each
quantized input. One quantizer serves every quantized consumer of a tensor.

Nested models are handled by this module rather than by ``recursive=True``:
Keras does not pass ``call_function`` into nested Sequential models, so a
Sequential model (top level or nested) is rebuilt as a Sequential list with the
quantizers placed between its layers, and a nested Functional model is cloned
by the same routine as the top level. Subclassed models cannot be cloned and
are refused with [`onnx_qat.errors.ModelError`][].
"""
from __future__ import annotations

import contextlib
import logging
from typing import Dict, List, Optional, Sequence

import keras
from keras.src.models.functional import Functional

from onnx_qat.errors import ConfigError, ModelError

from .case_base import CustomQDQInsertionCase
from .guard import guarded, unguarded
from .quantizers import MODES as RANGE_MODES
from .quantizers import ActivationQuantizer, QuantizeWrapper
from .saved_model import attach_rebuild_record
from .spec import LayerDecision, QuantizationSpec, iter_layers, resolve_plan

logger = logging.getLogger(__name__)


def _check_model(model, where: str = "model") -> None:
    if not isinstance(model, keras.Model):
        raise ModelError(f"{where}: expected a keras.Model, got {type(model).__name__}")
    if isinstance(model, keras.Sequential):
        if not model.built or not model.inputs:
            raise ModelError(f"{where} '{model.name}': Sequential model is not built; "
                             "give it a keras.Input(...) first layer or call build()")
        return
    if not isinstance(model, Functional):
        raise ModelError(f"{where} '{model.name}' is a subclassed model ({type(model).__name__}), which "
                         "cannot be cloned; rebuild it as a Functional or Sequential model "
                         "(e.g. keras.Model(inputs, outputs)) and quantize that")


def copy_layer(layer, float32: bool = False):
    """A new layer of the same class and config with the same weights (original untouched); with
    ``float32``, a layer of a mixed-precision policy (``mixed_float16``, ``mixed_bfloat16``: float32
    variables, computing in the low type) computes in float32 too."""
    try:
        config = layer.get_config()
        if float32 and _computes_low(layer):
            config["dtype"] = "float32"
        new = layer.__class__.from_config(config)
        if layer.built and not new.built:
            build_config = layer.get_build_config()
            if build_config:
                new.build_from_config(build_config)
        if layer.weights:
            new.set_weights(layer.get_weights())
    except Exception as exc:  # Keras raises many types here
        raise ModelError(f"layer '{layer.name}' ({type(layer).__name__}) cannot be copied from its "
                         f"config: {exc}") from exc
    return new


def _computes_low(layer) -> bool:
    """Whether ``layer`` computes in a float type other than float32 while its variables are float32 (a
    Keras mixed-precision policy)."""
    policy = getattr(layer, "dtype_policy", None)
    compute = getattr(policy, "compute_dtype", "float32")
    return compute in ("float16", "bfloat16") and getattr(policy, "variable_dtype", "float32") == "float32"


@contextlib.contextmanager
def float32_compute(model):
    """Within the block, every layer of ``model`` (nested models and wrapped layers included) that
    computes in float16 or bfloat16 under a Keras mixed-precision policy computes in float32; each
    policy is restored when the block ends, however it ends. Its variables are float32 already, so the
    model then computes exactly what its float32 ONNX export computes. Yields the names of the layers
    changed, models themselves left out of the list (none for a float32 model, which is left as it is)."""
    layers = model._flatten_layers(include_self=True, recursive=True)
    changed = [(layer, layer.dtype_policy) for layer in layers if _computes_low(layer)]
    try:
        for layer, _ in changed:
            layer.dtype_policy = "float32"
        yield [layer.name for layer, _ in changed if not isinstance(layer, keras.Model)]
    finally:
        for layer, policy in changed:
            layer.dtype_policy = policy


class _Cloner:
    """Clones one model tree, applying a plan of `LayerDecision` by original layer id."""

    def __init__(self, plan: Dict[int, LayerDecision], mode: str, momentum: float):
        self.plan = plan
        self.mode = mode
        self.momentum = momentum
        self.new_decisions: Dict[int, LayerDecision] = {}

    def clone(self, model):
        _check_model(model, "nested model" if self.new_decisions else "model")
        if isinstance(model, keras.Sequential):
            return self._clone_sequential(model)
        names = {layer.name for layer in model.layers}
        inputs = keras.tree.map_structure(
            lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t._keras_history[0].name),
            model.input)
        return keras.models.clone_model(model, input_tensors=inputs, clone_function=self._clone_layer,
                                        call_function=self._call_function(names), recursive=False)

    def _clone_layer(self, layer):
        if isinstance(layer, keras.Model):
            new = self.clone(layer)
            if id(layer) in self.plan:  # a spec entry naming the nested model: its inputs
                self.new_decisions[id(new)] = self.plan[id(layer)]
            return new
        if not isinstance(layer, keras.layers.Layer):
            return layer  # a stateless operation (e.g. ``x + y`` on KerasTensors): reuse it
        new = copy_layer(layer)
        decision = self.plan.get(id(layer))
        if decision is not None and decision.weights:
            new = QuantizeWrapper(new, mode=self.mode, momentum=self.momentum, name=layer.name)
        if decision is not None:
            self.new_decisions[id(new)] = decision
        return new

    def _make_quantizer(self, names: set, producer: str, index: int) -> ActivationQuantizer:
        base = f"{producer}_quant" if index == 0 else f"{producer}_{index}_quant"
        name, k = base, 1
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.add(name)
        return ActivationQuantizer(mode=self.mode, momentum=self.momentum, producer=producer,
                                   producer_index=index, name=name)

    def _call_function(self, names: set):
        quantized: Dict[int, tuple] = {}  # id(tensor) -> (quantizer, quantized tensor, tensor)

        def call_function(layer, *args, **kwargs):
            decision = self.new_decisions.get(id(layer))
            if decision is None or not decision.quantizes_inputs:
                return layer(*args, **kwargs)
            flat = keras.tree.flatten(args)
            positions = [i for i, v in enumerate(flat) if isinstance(v, keras.KerasTensor)]
            wanted = range(len(positions)) if decision.inputs is None else decision.inputs
            if isinstance(layer, keras.layers.Concatenate) and set(wanted) == set(range(len(positions))):
                return self._shared_scale_concat(layer, names, quantized, args, kwargs)
            for k in wanted:
                if k >= len(positions):
                    raise ConfigError(f"quantization_index {k} for layer '{layer.name}' is out of range: "
                                      f"it has {len(positions)} input tensor(s)")
                tensor = flat[positions[k]]
                if id(tensor) not in quantized:
                    op, _, t_index = tensor._keras_history
                    aq = self._make_quantizer(names, op.name, t_index)
                    quantized[id(tensor)] = (aq, aq(tensor), tensor)
                aq, q_tensor, _ = quantized[id(tensor)]
                aq.add_consumer(layer.name, k)
                flat[positions[k]] = q_tensor
            return layer(*keras.tree.pack_sequence_as(args, flat), **kwargs)

        return call_function

    def _shared_scale_concat(self, layer, names, quantized, args, kwargs):
        """All inputs of a Concatenate quantized share one scale (TensorRT rule 7). Quantizing
        every input with one amax equals quantizing the output with it (fake quantization is
        elementwise), so one quantizer goes on the output; ``covers_inputs_of`` records that its
        amax is the amax of every input too."""
        out = layer(*args, **kwargs)
        aq = self._make_quantizer(names, layer.name, 0)
        aq.covers_inputs_of = layer.name
        q_out = aq(out)
        quantized[id(out)] = quantized[id(q_out)] = (aq, q_out, out)
        return q_out

    def _clone_sequential(self, model):
        first = model.inputs[0]
        input_name = model._layers[0].name if isinstance(model._layers[0], keras.layers.InputLayer) else None
        new_layers: List = [keras.Input(batch_shape=first.shape, dtype=first.dtype, name=input_name)]
        names = {layer.name for layer in model.layers}
        producer = input_name or first.name
        for layer in model.layers:
            new = self._clone_layer(layer)
            decision = self.new_decisions.get(id(new))
            if decision is not None and decision.quantizes_inputs:
                if decision.inputs not in (None, (0,)):
                    raise ConfigError(f"quantization_index {list(decision.inputs)} for layer '{layer.name}'"
                                      " is out of range: in a Sequential model it has 1 input")
                aq = self._make_quantizer(names, producer, 0)
                aq.add_consumer(layer.name, 0)
                new_layers.append(aq)
            new_layers.append(new)
            producer = layer.name
        clone = keras.Sequential(new_layers, name=model.name, trainable=model.trainable)
        if model.compiled:
            clone.compile_from_config(model.get_compile_config())
        return clone


def _case_specs(model, spec: QuantizationSpec, cases) -> List[QuantizationSpec]:
    if cases is None:
        return []
    if isinstance(cases, CustomQDQInsertionCase) or not isinstance(cases, (list, tuple)):
        raise ConfigError("custom_qdq_cases must be a list of CustomQDQInsertionCase objects")
    specs = []
    for case in cases:
        if not isinstance(case, CustomQDQInsertionCase):
            raise ConfigError(f"custom_qdq_cases: {case!r} is not a CustomQDQInsertionCase")
        result = case.case(model, spec.copy())
        if result is None:
            continue
        if not isinstance(result, QuantizationSpec):
            raise ConfigError(f"custom_qdq_cases: {type(case).__name__}.case() must return a "
                              f"QuantizationSpec or None, got {type(result).__name__}")
        logger.info("tf_bridge: case %s: %d entries", type(case).__name__, len(result))
        specs.append(result)
    return specs


def quantize_model(model, quantization_mode: str = "full",
                   quantization_spec: Optional[QuantizationSpec] = None,
                   custom_qdq_cases: Optional[Sequence[CustomQDQInsertionCase]] = None,
                   *, activation_range: str = "ema", ema_momentum: float = 0.99):
    """Return a new Keras model with INT8 quantizers inserted (TensorRT placement).

    Args:
        model: a built Functional or Sequential Keras model (nested models allowed).
            It is not modified; its weights are copied.
        quantization_mode: ``"full"`` (default policy for every supported layer,
            adjusted by the spec and cases) or ``"partial"`` (only layers named by
            the spec or the cases).
        quantization_spec: a [`QuantizationSpec`][tf_bridge.spec.QuantizationSpec]; copied, never modified.
        custom_qdq_cases: a list of
            [`CustomQDQInsertionCase`][tf_bridge.case_base.CustomQDQInsertionCase]; each case's returned
            spec is applied below the user's spec in precedence.
        activation_range: ``"ema"`` (default), ``"fixed"`` or ``"learnable"``: how
            activation ranges move during training (see `tf_bridge.quantizers`).
        ema_momentum: momentum of the ``"ema"`` update, in [0, 1).

    Returns:
        A new model of the same kind (a [`tf_bridge.QATFunctional`][] or
        [`tf_bridge.QATSequential`][]: ``fit`` adds a [`tf_bridge.NonFiniteGuard`][]),
        compiled like the original if it was compiled. Call
        [`tf_bridge.calibrate`][tf_bridge.calibrate.calibrate] before use.

    Raises:
        ModelError: subclassed or unbuilt model, or a layer that cannot be copied.
        ConfigError: bad mode, spec, case or ``quantization_index``.
    """
    if quantization_mode not in ("full", "partial"):
        raise ConfigError(f"quantization_mode must be 'full' or 'partial', got {quantization_mode!r}")
    if activation_range not in RANGE_MODES:
        raise ConfigError(f"activation_range must be one of {', '.join(RANGE_MODES)},"
                          f" got {activation_range!r}")
    if not 0.0 <= float(ema_momentum) < 1.0:
        raise ConfigError(f"ema_momentum must be in [0, 1), got {ema_momentum!r}")
    if quantization_spec is not None and not isinstance(quantization_spec, QuantizationSpec):
        raise ConfigError("quantization_spec must be a QuantizationSpec,"
                          f" got {type(quantization_spec).__name__}")
    _check_model(model)
    for layer in iter_layers(model):
        if isinstance(layer, keras.Model):
            _check_model(layer, "nested model")
        if isinstance(layer, (ActivationQuantizer, QuantizeWrapper)):
            raise ModelError(f"model '{model.name}' is already quantized (layer '{layer.name}'); "
                             "quantize the float model, or use tf_bridge.float_model(q_model)")
    spec = quantization_spec.copy() if quantization_spec is not None else QuantizationSpec()
    plan = resolve_plan(model, quantization_mode, spec, _case_specs(model, spec, custom_qdq_cases))
    if not plan:
        logger.warning("tf_bridge: nothing to quantize in model '%s' (mode %s)",
                       model.name, quantization_mode)
    q_model = guarded(_Cloner(plan, activation_range, float(ema_momentum)).clone(model))
    attach_rebuild_record(q_model)  # so that q_model.export(dir) can be rebuilt for the Q/DQ export
    return q_model


class _Stripper:
    """Builds the float twin of a QAT model: wrapped layers unwrapped, activation quantizers removed."""

    def clone(self, model):
        if isinstance(model, keras.Sequential):
            layers = [self._clone_layer(layer) for layer in model.layers
                      if not isinstance(layer, ActivationQuantizer)]
            first = model.inputs[0]
            name = model._layers[0].name if isinstance(model._layers[0], keras.layers.InputLayer) else None
            inp = keras.Input(batch_shape=first.shape, dtype=first.dtype, name=name)
            return keras.Sequential([inp, *layers], name=model.name, trainable=model.trainable)
        inputs = keras.tree.map_structure(
            lambda t: keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t._keras_history[0].name),
            model.input)
        return keras.models.clone_model(model, input_tensors=inputs, clone_function=self._clone_layer,
                                        call_function=self._call, recursive=False)

    def _clone_layer(self, layer):
        if isinstance(layer, keras.Model):
            return self.clone(layer)
        if isinstance(layer, ActivationQuantizer) or not isinstance(layer, keras.layers.Layer):
            return layer  # quantizers are skipped by _call; operations are stateless
        if isinstance(layer, QuantizeWrapper):
            return copy_layer(layer.layer, float32=True)
        return copy_layer(layer, float32=True)

    @staticmethod
    def _call(layer, *args, **kwargs):
        if isinstance(layer, ActivationQuantizer):
            return args[0]
        return layer(*args, **kwargs)


def float_model(q_model):
    """The float twin of a QAT model: the original layer classes with the current (trained)
    weights, no quantizers, same layer names. ``q_model`` is not modified."""
    _check_model(q_model)
    return unguarded(_Stripper().clone(q_model))
