"""One onnxruntime session in which every site can run in INT8 or in float, chosen per run.

The Q/DQ model comes from the one inserter (:func:`onnx_qat.quantize` with the given placement and
ranges). Each input a site reads through a DequantizeLinear is then put behind
``Where(gate, dequantized, float)``, where ``gate`` is a boolean scalar graph input of that site and
``float`` the tensor the float model's node read there (its float weight, or the activation before
its QuantizeLinear). One session therefore serves every setting: a run with only site *k*'s gate on
is the model with only site *k* quantized, a run with every gate but *k*'s on the one with every
site but *k* quantized. No second inserter and no graph index: the gates are one pass over nodes.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

import numpy as np
import onnx
from onnx import TensorProto, helper

from .sites import Site

GATE_PREFIX = "onnx_qat_gate_"


def gate_model(qdq: onnx.ModelProto, float_model: onnx.ModelProto, sites: Sequence[Site]) -> onnx.ModelProto:
    """A copy of ``qdq`` whose site inputs are switched by boolean inputs ``onnx_qat_gate_<k>``.

    ``float_model`` is the model ``qdq`` was made from, with the same node names.
    """
    float_inputs = {n.name: list(n.input) for n in float_model.graph.node}
    float_inits = {t.name: t for t in float_model.graph.initializer}
    float_constants = {n.output[0]: n for n in float_model.graph.node if n.op_type == "Constant" and n.output}
    gated = onnx.ModelProto()
    gated.CopyFrom(qdq)
    graph = gated.graph
    have = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output} | \
        {i.name for i in graph.input}
    constants: List[onnx.NodeProto] = []  # float weights the inserter replaced that were Constant nodes
    edge_gate: Dict[Tuple[str, int], int] = {}
    for k, site in enumerate(sites):
        for edge in site.edges:
            edge_gate[edge] = k
    gates_before: Dict[str, List[onnx.NodeProto]] = {}
    used = set()
    for node in graph.node:
        for index, name in enumerate(node.input):
            k = edge_gate.get((node.name, index))
            if k is None:
                continue
            source = float_inputs.get(node.name, [])
            source = source[index] if index < len(source) else ""
            if not source or source == name:
                continue
            if source not in have and source in float_inits:
                graph.initializer.append(float_inits[source])
                have.add(source)
            elif source not in have and source in float_constants:
                constants.append(float_constants[source])
                have.add(source)
            out = f"{name}__{GATE_PREFIX}{k}_{node.name}_{index}"
            gates_before.setdefault(node.name, []).append(
                helper.make_node("Where", [f"{GATE_PREFIX}{k}", name, source], [out],
                                 name=f"{GATE_PREFIX}where_{k}_{node.name}_{index}"))
            node.input[index] = out
            used.add(k)
    nodes = list(constants)
    for node in graph.node:
        nodes.extend(gates_before.get(node.name, ()))
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    for k in range(len(sites)):
        graph.input.append(helper.make_tensor_value_info(f"{GATE_PREFIX}{k}", TensorProto.BOOL, []))
    return gated


class GatedRunner:
    """Runs the gated model on fixed evaluation feeds for any set of quantized sites."""

    def __init__(self, gated: onnx.ModelProto, num_sites: int, feeds: Sequence[Mapping[str, np.ndarray]],
                 outputs: Sequence[str], threads=None):
        from ..runtime import make_session

        self.session = make_session(gated, copy=False, threads=threads)
        self.num_sites = num_sites
        self.feeds = list(feeds)
        self.outputs = list(outputs)
        self.runs = 0
        self._true = np.array(True)
        self._false = np.array(False)

    def run(self, quantized: Iterable[int]) -> Dict[str, np.ndarray]:
        """Every output over every feed, flattened and joined, with exactly ``quantized`` sites in INT8."""
        on = set(quantized)
        gates = {f"{GATE_PREFIX}{k}": self._true if k in on else self._false for k in range(self.num_sites)}
        parts: Dict[str, list] = {name: [] for name in self.outputs}
        for feed in self.feeds:
            values = self.session.run(self.outputs, {**feed, **gates})
            for name, value in zip(self.outputs, values):
                parts[name].append(value)
        self.runs += 1
        return {name: join_flat(v) for name, v in parts.items()}


def join_flat(values: Sequence[np.ndarray]) -> np.ndarray:
    """Arrays flattened and joined (the figures compare whole outputs, not their shapes)."""
    return np.concatenate([np.asarray(v).ravel() for v in values]) if len(values) > 1 else \
        np.asarray(values[0]).ravel()


__all__ = ["gate_model", "GatedRunner", "GATE_PREFIX", "join_flat"]
