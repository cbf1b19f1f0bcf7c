"""Models placement refuses to quantize, refused before anything is calibrated or inserted.

A model that already holds Q/DQ or integer-quantized ops (`refuse_quantized`), and a weight placement
quantizes that holds NaN or infinite values (`refuse_non_finite_weights`: no scale represents them).
`onnx_qat.rewrite` (``quantize``) and `onnx_qat.calibration` (``calibrate``) refuse the same models
with the same words.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import onnx

from ..errors import ModelError, PlacementError
from ..graph.index import GraphIndex, subgraphs_of
from .marks import Placement

#: Op types that mean a model is already quantized.
QUANTIZED_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "ConvInteger",
                 "MatMulInteger")


def model_words(model) -> str:
    """How the refusals' (and the rewrite's) messages name ``model``: ``model PATH`` for a path, else
    ``the model``."""
    return f"model {model}" if isinstance(model, (str, os.PathLike)) else "the model"


def refuse_non_finite_weights(index: GraphIndex, placement: Placement, what: str = "the model") -> None:
    """Raise ModelError when a weight placement quantizes holds NaN or infinite values.

    No int8 scale can represent them; the float model itself is broken there. The weights that are
    initializers are decoded at once (`GraphIndex.decode_initializers`: float ones joined into a few
    buffers per element type, of which the arrays the inserter reads are views) and checked a buffer at a
    time; only when a check fails are the weights searched one by one (in name order) for the message.
    """
    graphs = [(index, placement.weight_tensors())]
    graphs += [(sub_index, sub.weight_tensors()) for sub_index, sub in nested_indexes(index, placement)]
    for graph_index, tensors in graphs:
        stored = [t for t in tensors if t in graph_index.initializers]
        others = []  # Constant outputs, folded constants, outer-scope constants
        for tensor in tensors:
            if tensor not in graph_index.initializers:
                proto = graph_index.constant_proto(tensor)
                if proto is not None:
                    from ..io.models import tensor_array  # the I/O edge, only where needed

                    others.append((tensor, tensor_array(proto)))
        if all(map(_finite, graph_index.decode_initializers(stored))) and \
                all(_finite(values) for _, values in others):
            continue
        found = dict(others)
        for tensor in tensors:
            values = graph_index.initializer_array(tensor) if tensor in graph_index.initializers \
                else found.get(tensor)
            if values is not None and not _finite(values):
                bad = int(values.size) - int(np.count_nonzero(np.isfinite(values)))
                raise ModelError(f"{what}: weight {tensor!r} holds {bad} NaN or infinite value(s); fix the "
                                 "float model before quantizing it")


#: Values `_finite` checks at once (bounds its temporary array).
_FINITE_STEP = 1 << 20


def _finite(values: np.ndarray) -> bool:
    """True unless ``values`` (any shape; not float: always True) holds NaN or an infinity."""
    if values.dtype.kind != "f":
        return True
    flat = values.reshape(-1)
    step = _FINITE_STEP
    return all(np.isfinite(flat[start:start + step]).all() for start in range(0, flat.size, step))


def nested_indexes(index: GraphIndex, placement: Placement):
    """``(GraphIndex, Placement)`` of every subgraph ``placement`` quantizes (depth first), each index
    resolving outer-scope names through its parent's."""
    for sub in placement.subgraphs:
        node = index.by_name[sub.node]
        graph = next(g for name, position, g in subgraphs_of(node.proto)
                     if name == sub.attribute and position == sub.position)
        sub_index = GraphIndex(graph, outer=index)
        yield sub_index, sub.placement
        yield from nested_indexes(sub_index, sub.placement)


def refuse_quantized(model: onnx.ModelProto, what: str = "the model",
                     index: Optional[GraphIndex] = None) -> None:
    """Raise PlacementError when ``model`` already holds Q/DQ or integer-quantized ops (in any graph,
    If/Loop/Scan bodies included). ``index``: a `GraphIndex` of ``model``'s main graph, whose op types
    and nodes holding subgraphs are then read instead of the main graph's nodes."""
    graphs, ops = [model.graph], set()
    if index is not None:
        ops.update(n.op_type for n in index.nodes)
        graphs = [g for name in index.subgraph_nodes for _, _, g in subgraphs_of(index.by_name[name].proto)]
    while graphs:
        graph = graphs.pop()
        for n in graph.node:
            ops.add(n.op_type)
            if n.attribute:
                graphs.extend(g for _, _, g in subgraphs_of(n))
    found = sorted(op for op in ops if op in QUANTIZED_OPS or op.startswith("QLinear"))
    if found:
        raise PlacementError(f"{what} is already quantized (it has {', '.join(found)} nodes); "
                             "give the float model instead")


__all__ = ["QUANTIZED_OPS", "model_words", "nested_indexes", "refuse_non_finite_weights",
           "refuse_quantized"]
