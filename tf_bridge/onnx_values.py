"""Values of ONNX tensors and their comparison with Keras tensors across layouts.

tf2onnx turns NHWC Keras tensors into NCHW ONNX tensors (and back), squeezes
pooled outputs and unsqueezes 1-D convolutions. `value_error` compares a
Keras array with an ONNX array under each layout the exporter uses, so a tensor
can be found by what it holds rather than by its (changing) name.
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx

from onnx_qat.errors import ExportError, QatError
from onnx_qat.runtime.sessions import make_session

#: Relative error under which two tensors are taken to be the same tensor.
SAME_TENSOR_RTOL = 1e-2


def _layouts(onnx_value: np.ndarray) -> Iterator[np.ndarray]:
    yield onnx_value
    if onnx_value.ndim >= 3:  # channels first -> channels last
        yield np.moveaxis(onnx_value, 1, -1)


def value_error(keras_value: np.ndarray, onnx_value: np.ndarray) -> float:
    """Smallest ``max |onnx - keras| / (max |keras| + 1e-6)`` over the layouts tf2onnx uses
    (same layout, channels first, extra unit axes); ``inf`` when no layout fits the shape."""
    k = np.asarray(keras_value, np.float64)
    best = np.inf
    if k.size == 0 or np.asarray(onnx_value).size != k.size:
        return best
    scale = float(np.max(np.abs(k))) + 1e-6
    squeezed = tuple(d for d in k.shape if d != 1)
    for candidate in _layouts(np.asarray(onnx_value, np.float64)):
        if candidate.shape != k.shape and tuple(d for d in candidate.shape if d != 1) != squeezed:
            continue
        best = min(best, float(np.max(np.abs(candidate.reshape(k.shape) - k))) / scale)
    return best


def float_tensor_names(model: onnx.ModelProto) -> tuple:
    """Graph inputs and node outputs of ``model`` that shape inference types as float32."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in
             list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)}
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    names += [o for n in model.graph.node if n.op_type != "Constant" for o in n.output if o]
    return tuple(n for n in dict.fromkeys(names) if types.get(n) == onnx.TensorProto.FLOAT)


def run_with_tensors(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                     tensors: Iterable[str] = ()) -> Dict[str, np.ndarray]:
    """Run ``model`` in onnxruntime (graph optimisations off, so QuantizeLinear/DequantizeLinear
    compute exactly their definition) on ``feeds``; return graph outputs and ``tensors`` by name."""
    # No graph optimisation: onnxruntime would fuse Q/DQ into its own integer kernels, whose
    # x86 arithmetic (u8 x s8 pairs in int16) is not the Q/DQ arithmetic parity is about.
    try:
        session = make_session(model, extra_outputs=tuple(tensors), optimize=False)
    except QatError as exc:
        raise ExportError(f"export_onnx: the exported model: {exc}") from None
    names = [o.name for o in session.get_outputs()]
    values = session.run(names, dict(feeds))
    found = dict(zip(names, values))
    found.update({k: np.asarray(v) for k, v in feeds.items()})
    return found


def graph_output_values(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> Sequence[np.ndarray]:
    """The graph outputs of ``model`` in order, taken from ``values``."""
    return [values[o.name] for o in model.graph.output]
