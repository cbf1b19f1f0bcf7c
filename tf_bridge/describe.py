"""The quantizer state of a QAT model: records for export, a table for people.

[`quantizer_records`][tf_bridge.describe.quantizer_records] is what the ONNX export reads: one
[`QuantizerRecord`][tf_bridge.describe.QuantizerRecord] per activation quantizer and per quantized weight,
each saying which Keras layer output / input or weight it belongs to and its current
amax as NumPy. [`describe`][tf_bridge.describe.describe] prints them as a table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

import keras
import numpy as np

from .quantizers import ActivationQuantizer, QuantizeWrapper


@dataclass(frozen=True)
class QuantizerRecord:
    """One quantized tensor of a QAT model.

    Attributes:
        kind: ``"activation"`` (per tensor, clamp [-128, 127]) or ``"weight"``
            (per channel, clamp [-127, 127]).
        path: the quantizer's layer path, ``"nested_model/layer"`` for nested models
            (the [`ActivationQuantizer`][tf_bridge.ActivationQuantizer], or the
            [`QuantizeWrapper`][tf_bridge.QuantizeWrapper]).
        layer: activation: the layer (or model input) whose output is quantized;
            weight: the wrapped Keras layer.
        tensor: activation: ``"<producer>:<output index>"``; weight: the layer
            attribute of the kernel (``kernel``, ``depthwise_kernel``, ``pointwise_kernel``).
        consumers: activation: ``("<layer>[<input index>]", ...)`` reading it; weight: ``()``.
        channel_axes: weight: kernel axes indexing output channels (non-negative);
            activation: ``()``.
        amax: activation: float32 scalar array, or None before calibration;
            weight: float32 array, one value per output channel (row-major over
            ``channel_axes``), recomputed from the current weights.
        variable_path: weight: the Keras variable path (e.g. ``conv/kernel``); activation: ``""``.
        shared_with: activation on a Concatenate output whose inputs share its scale
            (TensorRT rule 7): the ``"<producer>:<output index>"`` of every Concatenate
            input, which take the same amax; otherwise ``()``.
        inside: activation inside a wrapped layer (a SeparableConv's depthwise output,
            ``tensor`` ``"<layer>:depthwise"``, read by its pointwise convolution): the layer's
            name; otherwise ``""``.
    """

    kind: str
    path: str
    layer: str
    tensor: str
    consumers: Tuple[str, ...]
    channel_axes: Tuple[int, ...]
    amax: Optional[np.ndarray]
    variable_path: str = ""
    shared_with: Tuple[str, ...] = ()
    inside: str = ""

    @property
    def narrow_range(self) -> bool:
        """True for weights (clamp to [-127, 127])."""
        return self.kind == "weight"


def _iter_with_model(model, prefix: str = ""):
    for layer in model.layers:
        if isinstance(layer, (ActivationQuantizer, QuantizeWrapper)):
            yield prefix + layer.name, layer, model
            inner = getattr(layer, "intermediate", None)
            if inner is not None:
                yield prefix + inner.name, inner, model
        elif isinstance(layer, keras.Model):
            yield from _iter_with_model(layer, prefix + layer.name + "/")


def iter_quantizer_layers(model, prefix: str = "") -> Iterator[Tuple[str, keras.layers.Layer]]:
    """``(path, layer)`` for every ActivationQuantizer and QuantizeWrapper, nested models included."""
    for path, layer, _ in _iter_with_model(model, prefix):
        yield path, layer


def _concat_inputs(model, name: str) -> Tuple[str, ...]:
    tensors = model.get_layer(name)._inbound_nodes[0].input_tensors
    return tuple(f"{t._keras_history[0].name}:{t._keras_history[2]}" for t in tensors)


def _records_of(path: str, layer, model) -> Iterator[QuantizerRecord]:
    if isinstance(layer, ActivationQuantizer) and layer.inside:
        yield QuantizerRecord(kind="activation", path=path, layer=layer.inside,
                              tensor=f"{layer.inside}:depthwise", consumers=(), channel_axes=(),
                              amax=layer.amax_value(), inside=layer.inside)
        return
    if isinstance(layer, ActivationQuantizer):
        shared = _concat_inputs(model, layer.covers_inputs_of) if layer.covers_inputs_of else ()
        yield QuantizerRecord(
            kind="activation", path=path, layer=layer.producer,
            tensor=f"{layer.producer}:{layer.producer_index}",
            consumers=tuple(f"{n}[{i}]" for n, i in layer.consumers), channel_axes=(),
            amax=layer.amax_value(), shared_with=shared)
        return
    amaxes = layer.weight_amax()
    for attr, var, axes in layer.quantized_weights():
        rank = len(var.shape)
        yield QuantizerRecord(
            kind="weight", path=path, layer=layer.layer.name, tensor=attr, consumers=(),
            channel_axes=tuple(sorted(a % rank for a in axes)), amax=amaxes[attr], variable_path=var.path)


def quantizer_records(q_model) -> Tuple[QuantizerRecord, ...]:
    """Every quantized tensor of ``q_model`` in layer order (activations, then weights per layer)."""
    records = []
    for path, layer, model in _iter_with_model(q_model):
        records.extend(_records_of(path, layer, model))
    return tuple(records)


def _amax_text(amax: Optional[np.ndarray]) -> str:
    if amax is None:
        return "not calibrated"
    if amax.ndim == 0:
        return f"{float(amax):.6g}"
    return f"[{amax.size}] {float(amax.min()):.4g}..{float(amax.max()):.4g}"


def describe(q_model, print_fn: Optional[Callable[[str], None]] = print) -> str:
    """Return (and print with ``print_fn`` unless None) a table of every quantized tensor:
    kind, quantizer path, what it quantizes, per-channel axes and the current amax."""
    header = ("kind", "quantizer", "quantizes", "axis", "amax")
    rows = []
    for r in quantizer_records(q_model):
        what = (f"{r.tensor} -> {', '.join(r.consumers) or '(output)'}" if r.kind == "activation"
                else f"{r.layer}.{r.tensor}")
        if r.inside:
            what = f"{r.tensor} -> {r.inside} (pointwise)"
        if r.shared_with:
            what += f" (scale shared by {len(r.shared_with)} inputs of {r.layer})"
        axis = "per-tensor" if not r.channel_axes else ",".join(str(a) for a in r.channel_axes)
        rows.append((r.kind, r.path, what, axis, _amax_text(r.amax)))
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = "\n".join(lines + [f"{len(rows)} quantized tensor(s) in model '{q_model.name}'"])
    if print_fn is not None:
        print_fn(text)
    return text
