"""Reading and rewriting float32 constants (initializers or ``Constant`` nodes) of a private model copy,
for the passes that rescale or refit weights (`onnx_qat.accuracy.equalize`,
`onnx_qat.accuracy.smooth`, `onnx_qat.accuracy.reconstruct`)."""
from __future__ import annotations

from typing import Optional

import numpy as np
from onnx import TensorProto, numpy_helper


def read_constant(index, tensor: str) -> Optional[np.ndarray]:
    """``tensor``'s value as a float32 array (a copy), or None when it is not a float32 constant."""
    from ..io.models import tensor_array

    proto = index.constant_proto(tensor) if tensor else None
    if proto is None or proto.data_type != TensorProto.FLOAT:
        return None
    return np.array(tensor_array(proto), np.float32)


def write_constant(index, tensor: str, values: np.ndarray) -> None:
    """Replace ``tensor``'s stored value (same name, float32) in place."""
    proto = index.constant_proto(tensor)
    proto.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(values, np.float32), proto.name))


def private(index, tensor: str, node_name: str) -> bool:
    """``tensor`` is a float32 constant read by ``node_name`` only (so rewriting it changes nothing else)."""
    proto = index.constant_proto(tensor) if tensor else None
    return proto is not None and proto.data_type == TensorProto.FLOAT and \
        {n.name for n, _ in index.consumers(tensor)} == {node_name}


def sole_consumer(index, tensor: str):
    """The one node reading ``tensor`` (None when it has several readers or is a graph output)."""
    readers = index.consumers(tensor)
    if len(readers) != 1 or tensor in index.graph_outputs:
        return None
    return readers[0][0]


__all__ = ["read_constant", "write_constant", "private", "sole_consumer"]
