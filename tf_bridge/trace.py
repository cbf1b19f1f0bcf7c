"""Run a Keras model eagerly and keep every layer call's input and output values.

The export uses these values twice: to find which ONNX tensor holds a Keras
tensor (by value, robust to the renaming and layout changes tf2onnx makes), and
to name the layers where a Q/DQ ONNX model departs from the Keras QAT model.
Nested Functional and Sequential models are entered; their layers are recorded
under ``"<nested model>/<layer>"``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

import keras
import numpy as np


@dataclass(frozen=True)
class LayerCall:
    """One call of a layer: its input tensors (flat, in order) and output tensors (flat)."""

    inputs: Tuple[np.ndarray, ...]
    outputs: Tuple[np.ndarray, ...]


def _functional(model):
    return model._functional if isinstance(model, keras.Sequential) else model


def _as_numpy(values) -> Tuple[np.ndarray, ...]:
    return tuple(np.asarray(keras.ops.convert_to_numpy(v)) for v in keras.tree.flatten(values)
                 if hasattr(v, "shape"))


def _run(model, inputs, prefix: str, record: Dict[str, List[LayerCall]], only: Optional[Set[str]] = None):
    def call_fn(op, *args, **kwargs):
        if isinstance(op, keras.Model):
            outputs = _run(op, args[0] if len(args) == 1 else list(args), f"{prefix}{op.name}/", record, only)
        else:
            if getattr(op, "_call_has_training_arg", False):
                kwargs["training"] = False
            outputs = op(*args, **kwargs)
        if isinstance(op, keras.layers.Layer) and (only is None or prefix + op.name in only):
            record.setdefault(prefix + op.name, []).append(
                LayerCall(_as_numpy((args, kwargs)) if only is None else (), _as_numpy(outputs)))
        return outputs

    return _functional(model)._run_through_graph(inputs, operation_fn=lambda op: op, call_fn=call_fn)


def trace_layers(model, inputs, only: Optional[Iterable[str]] = None
                 ) -> Tuple[Dict[str, List[LayerCall]], Tuple[np.ndarray, ...]]:
    """Run ``model`` in inference mode on ``inputs`` (one array or a list, one per model input).

    ``only``: record just these layer paths, and only their outputs (``LayerCall.inputs`` empty),
    instead of every layer's inputs and outputs: what a caller needs of a few layers without
    holding every tensor of the network at once.

    Returns:
        ``(calls, outputs)``: layer path -> its calls in execution order, and the model
        outputs as NumPy arrays.
    """
    record: Dict[str, List[LayerCall]] = {}
    flat = [keras.ops.convert_to_tensor(np.asarray(x)) for x in
            (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
    outputs = _run(model, flat, "", record, None if only is None else set(only))
    return record, _as_numpy(outputs)
