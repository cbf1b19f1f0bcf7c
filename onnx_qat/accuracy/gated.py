"""One onnxruntime session in which every site can run in INT8 or in float, chosen per run.

The Q/DQ model comes from the one inserter ([`onnx_qat.quantize`][onnx_qat.quantize.quantize] with the given
placement and ranges). Each input a site reads through a DequantizeLinear is then put behind
``Where(gate, dequantized, float)``, where ``gate`` is a boolean scalar graph input of that site and
``float`` the tensor the float model's node read there (its float weight, or the activation before
its QuantizeLinear). One session therefore serves every setting: a run with only site *k*'s gate on
is the model with only site *k* quantized, a run with every gate but *k*'s on the one with every
site but *k* quantized. No second inserter and no graph index: the gates are one pass over nodes.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

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


SCALE_PREFIX = "onnx_qat_scale_"


def lift_scales(gated: onnx.ModelProto, tensors: Iterable[str]) -> Dict[str, Tuple[str, np.ndarray]]:
    """Make the scale of each activation tensor in ``tensors`` a graph input of ``gated`` (edited in
    place): ``{tensor: (input name, the scale the inserter wrote)}``.

    Every QuantizeLinear of the main graph that reads one of ``tensors``, and the DequantizeLinear
    nodes reading its output, then read the input ``onnx_qat_scale_<j>`` instead of their scale
    initializer; a setting can change a tensor's range by feeding another scale (the search over
    range candidates, `onnx_qat.accuracy.ranges`), with no new session.
    """
    from onnx import numpy_helper

    graph = gated.graph
    wanted = set(tensors)
    inits = {t.name: t for t in graph.initializer}
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input:
            readers.setdefault(node.input[0], []).append(node)
    lifted: Dict[str, Tuple[str, np.ndarray]] = {}
    replaced = set()
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] not in wanted or len(node.input) < 2 \
                or node.input[1] not in inits:
            continue
        tensor = node.input[0]
        if tensor not in lifted:
            value = numpy_helper.to_array(inits[node.input[1]])
            lifted[tensor] = (f"{SCALE_PREFIX}{len(lifted)}", value)
        name = lifted[tensor][0]
        for reader in [node] + readers.get(node.output[0], []):
            if len(reader.input) > 1 and reader.input[1] in inits:
                replaced.add(reader.input[1])
                reader.input[1] = name
    used = _read_anywhere(graph)  # a replaced scale still read elsewhere (a body, another pair) stays
    kept = [t for t in graph.initializer if t.name not in replaced or t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    for name, value in lifted.values():
        graph.input.append(helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)))
    return lifted


def _read_anywhere(graph: onnx.GraphProto) -> set:
    """Names read by any node of ``graph`` or of the subgraphs its nodes hold."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for body in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                names.update(_read_anywhere(body))
    return names


class GatedRunner:
    """Runs the gated model on fixed evaluation feeds for any set of quantized sites.

    The settings with every site float and every site INT8 are run once, at construction, and keep
    the tensors crossing a few cut positions (`onnx_qat.accuracy.cuts`); any other setting then
    runs only the graph suffix after the cut nearest before the first gate in which it differs from
    the closer of the two. ``cut_bytes`` bounds the memory those tensors take (0: no cuts, every
    setting runs the whole graph). With a ``state`` (``{output: input}``, a stateful model) the feeds
    run in order with the state fed back, every setting through the whole graph (a suffix would need
    the state of its own earlier runs).

    ``scales`` (``{scale input: value}``, from `lift_scales`): activation scales that are graph inputs
    of ``gated``, with the values fed unless a run gives others. A scale fed differently from a
    reference counts like a changed gate at the first node reading it (its QuantizeLinear).
    `set_reference` replaces the reference a setting is compared with (after a search accepted a
    change, later settings differ from it in one place again).
    """

    def __init__(self, gated: onnx.ModelProto, num_sites: int, feeds: Sequence[Mapping[str, np.ndarray]],
                 outputs: Sequence[str], threads=None, cut_bytes: Optional[int] = None,
                 state: Optional[Mapping[str, str]] = None,
                 scales: Optional[Mapping[str, np.ndarray]] = None):
        from ..runtime.sessions import make_session, needs_exact_qdq
        from ..runtime.stateful import carry_state
        from .cuts import CUT_CACHE_BYTES, CutPlan

        self.num_sites = num_sites
        self.feeds = list(feeds)
        self.outputs = list(outputs)
        self.runs = 0
        self.suffix_runs = 0  # settings run from a cut, not through the whole graph
        self.threads = threads
        self.scales: Dict[str, np.ndarray] = dict(scales or {})
        self._scale_names = list(self.scales)
        # every session alike, suffixes too: the whole model decides (FP8 Q/DQ runs unoptimized)
        self._optimize = not needs_exact_qdq(gated)
        self._true = np.array(True)
        self._false = np.array(False)
        budget = 0 if state else CUT_CACHE_BYTES if cut_bytes is None else cut_bytes
        gates = [f"{GATE_PREFIX}{k}" for k in range(num_sites)] + self._scale_names
        self.plan = CutPlan(gated, gates, self.outputs) if budget > 0 and CutPlan.usable(gated) else None
        self.cuts: Tuple[int, ...] = self._choose_cuts(gated, budget) if self.plan is not None else ()
        self._keep = tuple(dict.fromkeys(t for c in self.cuts for t in self.plan.crossing(c)))
        self._gated = gated if self.cuts else None
        session = make_session(gated, copy=bool(self.cuts), threads=threads, extra_outputs=self._keep,
                               spin=False, optimize=self._optimize)
        self.session = carry_state(session, state)
        self._suffixes: "OrderedDict[int, object]" = OrderedDict()
        self._references = {everything: self._reference(range(num_sites) if everything else (), self.scales)
                            for everything in (False, True)}

    def _reference(self, on, scales: Mapping[str, np.ndarray]):
        """``(outputs, kept tensors per feed, sites on, scales fed)`` of one whole-graph run."""
        outputs, kept = self._full(on, self._keep, scales)
        return outputs, kept, frozenset(on), dict(scales)

    def set_reference(self, quantized: Iterable[int], scales: Optional[Mapping[str, np.ndarray]] = None,
                      default: bool = False) -> None:
        """Run ``quantized`` with ``scales`` once, whole, and keep it as the reference of the INT8 side
        (the one every setting that differs from it in few places starts from). ``default``: these
        scales also become the ones fed when a run gives none, and the float reference is run again
        with them (so settings with few sites quantized keep starting late in the graph)."""
        given = {**self.scales, **dict(scales or {})}
        on = set(quantized) & set(range(self.num_sites))
        if default:
            self.scales = given
            self._references[False] = self._reference((), given)
        self._references[True] = self._reference(on, given)

    def _gates(self, on) -> Dict[str, np.ndarray]:
        return {f"{GATE_PREFIX}{k}": self._true if k in on else self._false for k in range(self.num_sites)}

    def _choose_cuts(self, gated: onnx.ModelProto, budget: int) -> Tuple[int, ...]:
        """Cuts within ``budget``. Tensor sizes come from one sample of the first feed, run in a
        probe session that outputs every candidate tensor; no cuts when the feed has no batch axis
        to take one sample from, or the model takes no other batch size."""
        from ..runtime.sessions import make_session
        from .cuts import first_sample

        probe = first_sample(self.feeds[0]) if self.feeds else None
        names = list(self.plan.candidate_tensors())
        if probe is None or not names:
            return ()
        try:
            session = make_session(gated, threads=self.threads, extra_outputs=names, spin=False,
                                   optimize=self._optimize)
            values = session.run(names, {**probe, **self._gates(()), **self.scales})
        except Exception:  # noqa: BLE001 - e.g. a fixed batch size: then no cuts, whole-graph runs
            return ()
        del session
        samples = sum(int(np.asarray(next(iter(f.values()))).shape[0]) for f in self.feeds)
        self._types = {n: helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype) for n, v in zip(names, values)}
        return self.plan.choose({n: np.asarray(v).nbytes * samples for n, v in zip(names, values)}, budget)

    def _full(self, on, keep: Sequence[str], scales: Mapping[str, np.ndarray]):
        """Outputs (flattened, joined) and the ``keep`` tensors per feed of one whole-graph run."""
        on = set(on)
        names = self.outputs + [t for t in keep if t not in self.outputs]
        parts: Dict[str, list] = {name: [] for name in self.outputs}
        kept = []
        for feed in self.feeds:
            values = dict(zip(names, self.session.run(names, {**feed, **self._gates(on), **scales})))
            for name in self.outputs:
                parts[name].append(values[name])
            kept.append({t: values[t] for t in keep})
        return {name: join_flat(v) for name, v in parts.items()}, kept

    def _suffix(self, cut: int):
        from ..runtime.sessions import make_session

        session = self._suffixes.pop(cut, None)
        if session is None:
            from .cuts import LIVE_SUFFIXES

            while len(self._suffixes) >= LIVE_SUFFIXES:
                self._suffixes.popitem(last=False)
            model = self.plan.suffix_model(self._gated, cut, self._types)
            session = make_session(model, copy=False, threads=self.threads, spin=False,
                                   optimize=self._optimize)
        self._suffixes[cut] = session
        return session

    def _first_change(self, reference, on, scales) -> Optional[int]:
        """The first node position at which a setting differs from ``reference`` (None: nowhere)."""
        _, _, ref_on, ref_scales = reference
        gates = on.symmetric_difference(ref_on)
        moved = [j for j, name in enumerate(self._scale_names)
                 if not np.array_equal(scales[name], ref_scales[name])]
        if not gates and not moved:
            return None
        starts = self.plan.start if self.plan is not None else None
        if starts is None:
            return 0
        positions = [starts[k] for k in gates] + [starts[self.num_sites + j] for j in moved]
        positions = [p for p in positions if p is not None]
        return min(positions) if positions else None

    def run(self, quantized: Iterable[int], scales: Optional[Mapping[str, np.ndarray]] = None
            ) -> Dict[str, np.ndarray]:
        """Every output over every feed, flattened and joined, with exactly ``quantized`` sites in INT8
        (and the activation scales ``scales`` where given, the default ones elsewhere)."""
        on = frozenset(set(quantized) & set(range(self.num_sites)))
        fed = {**self.scales, **dict(scales or {})}
        self.runs += 1
        best, first = None, -1
        for everything in (False, True):  # the reference whose first change comes later
            where = self._first_change(self._references[everything], on, fed)
            if where is None:  # nothing read differs: the reference itself
                return dict(self._references[everything][0])
            if where > first:
                best, first = everything, where
        cut = self.plan.nearest(self.cuts, first) if self.cuts else 0
        if cut == 0:
            return self._full(on, (), fed)[0]
        self.suffix_runs += 1
        session, kept = self._suffix(cut), self._references[best][1]
        reference = self._references[best][0]
        names = [o.name for o in session.get_outputs()]
        inputs = {i.name for i in session.get_inputs()}
        parts: Dict[str, list] = {name: [] for name in names}
        switches = {**self._gates(on), **fed}
        for feed, cached in zip(self.feeds, kept):
            given = {**{k: v for k, v in feed.items() if k in inputs},
                     **{k: v for k, v in cached.items() if k in inputs},
                     **{k: v for k, v in switches.items() if k in inputs}}
            for name, value in zip(names, session.run(names, given)):
                parts[name].append(value)
        out = {name: reference[name] for name in self.outputs}  # outputs made before the cut
        out.update({name: join_flat(v) for name, v in parts.items()})
        return out


def join_flat(values: Sequence[np.ndarray]) -> np.ndarray:
    """Arrays flattened and joined (the figures compare whole outputs, not their shapes)."""
    return np.concatenate([np.asarray(v).ravel() for v in values]) if len(values) > 1 else \
        np.asarray(values[0]).ravel()


def run_joined(session, names: Sequence[str], feeds) -> Dict[str, np.ndarray]:
    """``{name: output}`` of ``session`` run on each of ``feeds`` in turn, each output's values
    flattened and joined (`join_flat`)."""
    parts: Dict[str, list] = {name: [] for name in names}
    for feed in feeds:
        for name, value in zip(names, session.run(list(names), feed)):
            parts[name].append(value)
    return {name: join_flat(v) for name, v in parts.items()}


__all__ = ["gate_model", "lift_scales", "GatedRunner", "GATE_PREFIX", "SCALE_PREFIX", "join_flat",
           "run_joined"]
