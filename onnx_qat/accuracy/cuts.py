"""Cuts of the gated model: run only the part of the graph a setting changes.

A setting of the gated model (`onnx_qat.accuracy.gated`) differs from one of two reference
settings, every site float or every site INT8, in the gates of some sites. Every node before the
first node that reads one of those gates computes exactly what it computes in the reference run:
its inputs do not depend on those gates. So the reference runs keep the tensors that cross a few
*cut* positions of the node list, and a later setting runs only the suffix of the graph after the
cut nearest before its first changed gate, fed with the reference's tensors at that cut. A
setting with one site changed (``only``: one site in INT8; ``all_but``: one site float) starts,
on average, halfway through the graph.

`CutPlan` reads the gated graph once: where each gate is first read, which tensors cross
each position, and builds the suffix models (the same nodes, the crossing tensors as inputs).
"""
from __future__ import annotations

import bisect as _bisect
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import helper

#: Bytes the tensors kept at the cuts may take, for both reference settings and every sample.
CUT_CACHE_BYTES = 640 << 20
#: Sessions of graph suffixes kept alive at once (each has its own memory arena).
LIVE_SUFFIXES = 3


class CutPlan:
    """Gate positions and crossing tensors of a gated model (see the module docstring).

    ``start[k]`` is the index of the first node reading site ``k``'s gate (None: no node does, the
    site changes nothing). ``candidates`` are the sorted distinct positions worth cutting at.
    """

    def __init__(self, gated: onnx.ModelProto, gates: Sequence[str], outputs: Sequence[str]):
        graph = gated.graph
        self.nodes = list(graph.node)
        self.outputs = tuple(outputs)
        self.graph_inputs = {i.name: i for i in graph.input}
        self.initializers = {t.name for t in graph.initializer}
        gate_index = {name: k for k, name in enumerate(gates)}
        self.start: List[Optional[int]] = [None] * len(gates)
        produced: Dict[str, int] = {}
        last: Dict[str, int] = {}
        for p, node in enumerate(self.nodes):
            for name in node.input:
                k = gate_index.get(name)
                if k is not None and self.start[k] is None:
                    self.start[k] = p
                if name:
                    last[name] = p
            for name in node.output:
                if name:
                    produced[name] = p
        end = len(self.nodes)
        for name in self.outputs:
            last[name] = end
        self.produced = produced
        self.candidates = tuple(sorted({p for p in self.start if p is not None and p > 0}))
        self._crossing: Dict[int, List[str]] = {c: [] for c in self.candidates}
        for name, p in produced.items():  # a tensor crosses every cut in (producer, last reader]
            lo = _bisect.bisect_right(self.candidates, p)
            hi = _bisect.bisect_right(self.candidates, last.get(name, -1))
            for c in self.candidates[lo:hi]:
                self._crossing[c].append(name)

    @staticmethod
    def usable(gated: onnx.ModelProto) -> bool:
        """True when the node list is in topological order and no node holds a subgraph (whose
        outer-scope reads a suffix would have to declare)."""
        seen = {i.name for i in gated.graph.input} | {t.name for t in gated.graph.initializer} | {""}
        for node in gated.graph.node:
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
                return False
            if any(name not in seen for name in node.input):
                return False
            seen.update(node.output)
        return True

    def crossing(self, cut: int) -> List[str]:
        """Tensors produced before node ``cut`` and read at or after it (or graph outputs)."""
        return self._crossing[cut]

    def candidate_tensors(self) -> Tuple[str, ...]:
        """Every tensor that crosses some candidate cut."""
        return tuple(dict.fromkeys(t for c in self.candidates for t in self._crossing[c]))

    def choose(self, nbytes: Mapping[str, int], budget: int) -> Tuple[int, ...]:
        """Cuts whose crossing tensors, kept for two reference settings, fit ``budget`` bytes
        (``nbytes``: bytes of each tensor over every sample): every candidate, else every second,
        third... counted from the last one, the densest spacing that fits. Evenly spread cuts
        serve every site about equally (on the 63-Conv benchmark detector every third candidate
        keeps 98% of the work every candidate saves, at half the memory)."""
        for stride in range(1, len(self.candidates) + 1):
            chosen = self.candidates[::-1][::stride]
            kept = {t for c in chosen for t in self._crossing[c]}
            if 2 * sum(nbytes.get(t, 0) for t in kept) <= budget:
                return tuple(sorted(chosen))
        return ()

    def suffix_model(self, gated: onnx.ModelProto, cut: int, types: Mapping[str, int]) -> onnx.ModelProto:
        """The nodes from ``cut`` on as a model whose inputs are the tensors crossing ``cut`` (element
        types ``types``), the graph inputs and gates they read, and whose outputs are the graph
        outputs they produce."""
        nodes = self.nodes[cut:]
        read = {name for node in nodes for name in node.input if name}
        crossing = [t for t in self._crossing[cut] if t in read]
        inputs = [helper.make_tensor_value_info(t, types[t], None) for t in crossing]
        inputs += [self.graph_inputs[name] for name in self.graph_inputs if name in read]
        outputs = [onnx.ValueInfoProto(name=name) for name in self.outputs
                   if self.produced.get(name, -1) >= cut]
        graph = helper.make_graph(nodes, f"{gated.graph.name}_from_{cut}", inputs, outputs,
                                  [t for t in gated.graph.initializer if t.name in read])
        model = helper.make_model(graph, opset_imports=list(gated.opset_import))
        model.ir_version = gated.ir_version
        return model

    def nearest(self, chosen: Sequence[int], first: int) -> int:
        """The latest chosen cut at or before node ``first`` (0: run the whole graph)."""
        i = _bisect.bisect_right(chosen, first)
        return chosen[i - 1] if i else 0


def first_sample(feed: Mapping[str, np.ndarray]) -> Optional[Dict[str, np.ndarray]]:
    """``feed`` cut to its first sample (None when an input has no batch axis to cut)."""
    arrays = {k: np.asarray(v) for k, v in feed.items()}
    if not arrays or any(v.ndim == 0 or v.shape[0] < 1 for v in arrays.values()):
        return None
    return {k: np.ascontiguousarray(v[:1]) for k, v in arrays.items()}


__all__ = ["CutPlan", "CUT_CACHE_BYTES", "LIVE_SUFFIXES", "first_sample"]
