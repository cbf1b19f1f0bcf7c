"""Built-in CustomQDQInsertionCase rules following TensorRT's Q/DQ placement.

TensorRT Developer Guide, "Q/DQ layer-placement recommendations": quantize the
skip (identity) input of a residual Add and leave the Conv branch float, so the
Add fuses into the Conv; quantize all inputs of non-commuting ops such as
Concat; leave Conv -> Sigmoid -> Mul chains unbroken.

* [`ResidualConnectionQDQCase`][tf_bridge.custom_qdq_cases.ResidualConnectionQDQCase] — every ``Add``: skip
  input(s) quantized, the deepest Conv(+BN/Dropout) branch left float.
* [`ResNetV1QDQCase`][tf_bridge.custom_qdq_cases.ResNetV1QDQCase],
  [`MobileNetQDQCase`][tf_bridge.custom_qdq_cases.MobileNetQDQCase] — the residual rule, checked against the
  structure those families use.
* [`ResNetV2QDQCase`][tf_bridge.custom_qdq_cases.ResNetV2QDQCase] — the residual rule plus
  [`BNQDQCase`][tf_bridge.custom_qdq_cases.BNQDQCase] (the input of every
  BatchNormalization not fed by a Conv: the pre-activations) and
      [`MaxPoolQDQCase`][tf_bridge.custom_qdq_cases.MaxPoolQDQCase] (the
  input of every MaxPooling2D), as NVIDIA's toolkit places them for ResNet v2.
* [`EfficientNetQDQCase`][tf_bridge.custom_qdq_cases.EfficientNetQDQCase] — the residual rule plus, in
  squeeze-excite blocks, the feature input of the excite ``Multiply`` (the gate from the
  Conv -> Sigmoid chain stays float).
* [`InceptionQDQCase`][tf_bridge.custom_qdq_cases.InceptionQDQCase] — every input of every ``Concatenate``,
  with one shared scale (rule 7). Fake quantization is elementwise, so quantizing all
  inputs with one amax equals quantizing the output with it: one quantizer sits on
  the Concatenate output and its record lists the inputs sharing its scale.
"""
from __future__ import annotations

import logging

import keras

from .case_base import (FUSABLE, CustomQDQInsertionCase, GraphDepth, input_tensors, layers_of_class, producer,
                    residual_skip_indices)
from .spec import QuantizationSpec

logger = logging.getLogger(__name__)

__all__ = [
    "CustomQDQInsertionCase", "ResidualConnectionQDQCase", "ResNetV1QDQCase", "ResNetV2QDQCase",
    "EfficientNetQDQCase", "MobileNetQDQCase", "InceptionQDQCase", "BNQDQCase", "MaxPoolQDQCase",
]


def _residual_spec(model) -> QuantizationSpec:
    spec = QuantizationSpec()
    depth = GraphDepth()
    for add in layers_of_class(model, keras.layers.Add):
        if len(input_tensors(add)) < 2:
            continue
        indices = residual_skip_indices(add, depth)
        logger.debug("tf_bridge: residual Add '%s': quantize inputs %s", add.name, list(indices))
        spec.add(add.name, quantize_input=True, quantize_weight=False, quantization_index=list(indices))
    return spec


class ResidualConnectionQDQCase(CustomQDQInsertionCase):
    """Residual Adds: quantize the skip input, leave the Conv branch float (TensorRT fuses it)."""

    def case(self, keras_model, qspec):
        """Entries for every ``Add`` of the model (nested models included)."""
        return _residual_spec(keras_model)


class ResNetV1QDQCase(ResidualConnectionQDQCase):
    """ResNet v1 (post-activation): each block's Add quantizes its shortcut; Conv-BN branch float."""


class BNQDQCase(CustomQDQInsertionCase):
    """BatchNormalization layers not fed by a Conv: their input quantized (a BN after a Conv folds
    into it and gets nothing; one after an Add, as ResNet v2's pre-activations, runs in INT8)."""

    def case(self, keras_model, qspec):
        """One input-only entry per BatchNormalization whose producer is not a Conv layer."""
        spec = QuantizationSpec()
        for bn in layers_of_class(keras_model, keras.layers.BatchNormalization):
            tensors = input_tensors(bn)
            if len(tensors) == 1 and not isinstance(producer(tensors[0])[0], FUSABLE):
                spec.add(bn.name, quantize_input=True, quantize_weight=False)
        return spec


class MaxPoolQDQCase(CustomQDQInsertionCase):
    """MaxPooling2D layers: their input quantized (MaxPool commutes with Q/DQ, so TensorRT runs it in
    INT8 and a residual Add it feeds sees the same scale on its skip input)."""

    def case(self, keras_model, qspec):
        """One input-only entry per MaxPooling2D."""
        spec = QuantizationSpec()
        for pool in layers_of_class(keras_model, keras.layers.MaxPooling2D):
            spec.add(pool.name, quantize_input=True, quantize_weight=False)
        return spec


class ResNetV2QDQCase(CustomQDQInsertionCase):
    """ResNet v2 (pre-activation): each block's Add quantizes its shortcut (identity, MaxPool or
    projection Conv), the last Conv of the residual branch stays float; BatchNormalizations not fed
    by a Conv (the pre-activations, post_bn) and MaxPooling2D layers quantize their input."""

    def case(self, keras_model, qspec):
        """The residual, BatchNormalization and MaxPool entries."""
        spec = _residual_spec(keras_model)
        for case in (BNQDQCase(), MaxPoolQDQCase()):
            spec._entries.extend(case.case(keras_model, qspec).entries)
        return spec


class MobileNetQDQCase(ResidualConnectionQDQCase):
    """MobileNet v2 inverted residuals: each Add quantizes the block input; projection Conv-BN float."""


def _is_sigmoid_gate(tensor) -> bool:
    op, _ = producer(tensor)
    activation = getattr(op, "activation", None)
    name = getattr(activation, "__name__", "")
    return name in ("sigmoid", "hard_sigmoid")


class EfficientNetQDQCase(CustomQDQInsertionCase):
    """EfficientNet: residual Adds quantize the skip input; squeeze-excite Multiply quantizes its
    feature input only (the sigmoid gate stays float, rule: Conv -> Sigmoid -> Mul unbroken)."""

    def case(self, keras_model, qspec):
        """Residual entries plus one entry per squeeze-excite ``Multiply``."""
        spec = _residual_spec(keras_model)
        for mul in layers_of_class(keras_model, keras.layers.Multiply):
            tensors = input_tensors(mul)
            gates = [i for i, t in enumerate(tensors) if _is_sigmoid_gate(t)]
            if len(tensors) != 2 or len(gates) != 1:
                continue
            spec.add(mul.name, quantize_input=True, quantize_weight=False, quantization_index=[1 - gates[0]])
        return spec


class InceptionQDQCase(CustomQDQInsertionCase):
    """Inception: every Concatenate's inputs quantized with one shared scale (TensorRT concat in INT8)."""

    def case(self, keras_model, qspec):
        """One entry per ``Concatenate`` quantizing all its inputs."""
        spec = QuantizationSpec()
        for cat in layers_of_class(keras_model, keras.layers.Concatenate):
            spec.add(cat.name, quantize_input=True, quantize_weight=False)
        return spec
