"""CustomQDQInsertionCase, the base class of pattern cases (the extension point), and the Keras-graph
helpers cases use.

A case looks at the (float) Keras model and returns a [`QuantizationSpec`][tf_bridge.spec.QuantizationSpec]
of extra entries; [`tf_bridge.quantize_model`][] applies it below the user's
own spec in precedence. The built-in cases live in
[`tf_bridge.custom_qdq_cases`][].
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import keras

from onnx_qat.placement.residual import skip_addends

from .quantizers import weight_rules_for
from .spec import QuantizationSpec, iter_layers

# Layers that TensorRT folds or removes between a Conv and its consumer, so the
# Conv still "produces" the tensor: BN folds into the Conv, dropout/noise vanish.
TRANSPARENT = (
    keras.layers.BatchNormalization, keras.layers.Dropout, keras.layers.SpatialDropout1D,
    keras.layers.SpatialDropout2D, keras.layers.SpatialDropout3D, keras.layers.GaussianNoise,
    keras.layers.GaussianDropout, keras.layers.AlphaDropout, keras.layers.Identity,
)
# Weighted layers TensorRT can fuse an elementwise Add into.
FUSABLE = (
    keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D, keras.layers.DepthwiseConv1D,
    keras.layers.DepthwiseConv2D, keras.layers.SeparableConv1D, keras.layers.SeparableConv2D,
    keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose,
)


class CustomQDQInsertionCase:
    """Base class of pattern-based quantization rules.

    Subclasses implement [`case`][tf_bridge.case_base.CustomQDQInsertionCase.case];
    [`info`][tf_bridge.case_base.CustomQDQInsertionCase.info] describes the case (by default the first
    line of the class docstring).
    """

    def info(self) -> str:
        """One line saying what the case does."""
        doc = (type(self).__doc__ or type(self).__name__).strip()
        return doc.splitlines()[0]

    def case(self, keras_model, qspec: QuantizationSpec) -> Optional[QuantizationSpec]:
        """Return a spec of extra entries for ``keras_model``.

        ``qspec`` is a copy of the user's spec, to read; returning None adds nothing.
        """
        raise NotImplementedError(f"{type(self).__name__}.case() is not implemented")


def producer(tensor) -> Tuple[keras.Operation, int]:
    """``(operation, node_index)`` that produced a KerasTensor."""
    op, node_index, _ = tensor._keras_history
    return op, node_index


def input_tensors(layer, node_index: int = 0) -> List:
    """The flat list of input KerasTensors of ``layer`` at one call (node)."""
    return list(layer._inbound_nodes[node_index].input_tensors)


def consumer_count(op) -> int:
    """How many calls consume outputs of ``op`` (its outbound nodes)."""
    return len(getattr(op, "_outbound_nodes", []))


def is_input(op) -> bool:
    """True for an InputLayer (a model input)."""
    return isinstance(op, keras.layers.InputLayer)


class GraphDepth:
    """Longest path (in layer calls) from a model input to each tensor; memoised."""

    def __init__(self):
        self._memo: Dict[int, int] = {}

    def __call__(self, tensor) -> int:
        stack = [tensor]
        while stack:
            t = stack[-1]
            if id(t) in self._memo:
                stack.pop()
                continue
            op, node_index = producer(t)
            if is_input(op) or not op._inbound_nodes:
                self._memo[id(t)] = 0
                stack.pop()
                continue
            parents = input_tensors(op, node_index)
            todo = [p for p in parents if id(p) not in self._memo]
            if todo:
                stack.extend(todo)
                continue
            self._memo[id(t)] = 1 + max((self._memo[id(p)] for p in parents), default=0)
            stack.pop()
        return self._memo[id(tensor)]


def fusable_source(tensor) -> Optional[keras.layers.Layer]:
    """The Conv whose output reaches ``tensor`` through transparent layers only, each
    tensor on the way having that single consumer; None if there is no such Conv."""
    op, node_index = producer(tensor)
    while isinstance(op, TRANSPARENT):
        if consumer_count(op) != 1:
            return None
        parents = input_tensors(op, node_index)
        if len(parents) != 1:
            return None
        op, node_index = producer(parents[0])
    if isinstance(op, FUSABLE) and weight_rules_for(op) and consumer_count(op) == 1:
        return op
    return None


def residual_skip_indices(add_layer, depth: GraphDepth) -> Tuple[int, ...]:
    """Inputs of an Add to quantize under TensorRT's residual rule
    (`onnx_qat.placement.residual.skip_addends`, the rule placement and check apply too).

    The input coming from a Conv branch is left float (TensorRT fuses the Add into
    that Conv); if several inputs come from Convs, the deepest branch is the fused
    one (on a tie, the first). All other inputs (the skip connections) are quantized. With no Conv
    branch every input is quantized: in QAT, as in NVIDIA's toolkit's residual case, such an Add
    runs with quantized inputs (where the ONNX placement of a float model, which has no trained
    ranges to keep, leaves it float).
    """
    tensors = input_tensors(add_layer)
    from_conv = [fusable_source(t) is not None for t in tensors]
    if not any(from_conv):
        return tuple(range(len(tensors)))
    return skip_addends(from_conv, [depth(t) if conv else 0 for t, conv in zip(tensors, from_conv)])


def layers_of_class(model, classes) -> Iterator[keras.layers.Layer]:
    """Layers of ``model`` (nested models included) that are instances of ``classes``, called once."""
    for layer in iter_layers(model):
        if isinstance(layer, classes) and len(layer._inbound_nodes) >= 1:
            yield layer
