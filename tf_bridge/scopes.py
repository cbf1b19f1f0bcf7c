"""Which Keras layer each node of a tf2onnx graph belongs to, and where Keras tensors enter layers.

tf2onnx keeps TensorFlow's op names, and TensorFlow names every op of a Keras layer call under
the layer's name scope: ``<model>_1/<layer>_1/convolution``, ``<model>_1/<nested>_1/<layer>_1/
BiasAdd``. A scope component is the layer name, possibly with a ``_<n>`` suffix TensorFlow adds
to keep scopes unique (a second call of a shared layer, a clone of a name already used). Nodes
tf2onnx adds itself (``Transpose__188``, ``const_fold_opt__12``) carry no layer scope.

`LayerScopes` reads those names against the Keras model's layer tree. A component that
could name two layers (``conv_1`` is layer ``conv_1``, or layer ``conv`` with a suffix) is
settled by elimination: a layer another component names without doubt is taken off the
ambiguous one. The Keras side of the topology comes from `KerasGraph`: the producer of
every layer input, through layers that leave no node in the ONNX graph (Dropout, an InputLayer
of a nested model, a layer tf2onnx optimized away).
"""
from __future__ import annotations

import re
from typing import Dict, FrozenSet, Iterator, List, Mapping, Optional, Set, Tuple

import keras

from onnx_qat.graph.index import GraphIndex, NodeInfo

#: ONNX ops that only move data; a Keras tensor crossing into a layer may pass through them.
LAYOUT_OPS = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten", "Cast")
#: Keras layers whose own computation is a layout op (their nodes end a walk back, see
#: `LayerScopes.source`); the layout nodes of any other layer are tf2onnx's adapters.
LAYOUT_LAYERS = (keras.layers.Reshape, keras.layers.Flatten, keras.layers.Permute)
#: Graph inputs are scoped as ``INPUT_SCOPE + <graph input name>``.
INPUT_SCOPE = "input:"
#: The key of the nodes `scope_operations` gives to a Keras operation.
OPERATION_SCOPE = "operation:"


def _layers(model) -> list:
    return list(getattr(model, "layers", ()))


def _operations(model) -> list:
    """The Keras operations of a Functional model that are not layers (``x + y``, ``ops.add``)."""
    return [op for op in getattr(model, "operations", ()) if not isinstance(op, keras.layers.Layer)]


def _names(component: str, suffixes: int) -> List[str]:
    """The layer names a scope component can stand for: itself, and itself without one
    (``suffixes == 1``) or any number of trailing ``_<n>`` suffixes."""
    found = [component]
    while len(found) <= suffixes or suffixes > 1:
        stripped = re.sub(r"_\d+$", "", found[-1])
        if stripped == found[-1]:
            break
        found.append(stripped)
    return found[:suffixes + 1] if suffixes == 1 else found


def _matches(component: str, name: str, suffixes: int) -> bool:
    return name in _names(component, suffixes)


class LayerScopes:
    """The Keras layer path (``"nested/layer"``) of every node of a tf2onnx graph, or none.

    Args:
        model: the Keras model tf2onnx converted (the float twin).
        index: the ONNX graph's `GraphIndex`.
    """

    def __init__(self, model, index: GraphIndex):
        self.model = model
        self.index = index
        keys: Dict[str, Set[str]] = {}
        self._key_of: Dict[str, str] = {}
        self._by_name: Dict[int, dict] = {}
        for node in index.nodes:
            found = self._parse(node.name)
            if found is not None:
                key, paths = found
                keys.setdefault(key, set()).update(paths)
                self._key_of[node.name] = key
        self._paths = _eliminate(keys)
        self._layout: Dict[str, bool] = {}
        self._nodes: Dict[str, List[NodeInfo]] = {}
        for node in index.nodes:
            for path in self.paths(node.name):
                self._nodes.setdefault(path, []).append(node)

    def _parse(self, name: str) -> Optional[Tuple[str, FrozenSet[str]]]:
        parts = name.split("/")
        if len(parts) < 2:
            return None
        start = 1 if _matches(parts[0], self.model.name, 1) else 0
        for suffixes in (1, 2):
            found = self._descend(self.model, parts, start, "", suffixes)
            if found:
                depth = max(d for _, d in found)
                paths = frozenset(p for p, d in found if d == depth)
                return "/".join(parts[:depth + 1]), paths
        return None

    def _descend(self, model, parts, i, prefix, suffixes) -> List[Tuple[str, int]]:
        if i >= len(parts) - 1:  # the last component is the op's own name
            return []
        found = []
        by_name = self._by_name.get(id(model))
        if by_name is None:
            by_name = self._by_name[id(model)] = {x.name: x for x in _layers(model)}
        for name in _names(parts[i], suffixes):
            layer = by_name.get(name)
            if layer is None:
                continue
            path = prefix + layer.name
            deeper = self._descend(layer, parts, i + 1, path + "/", suffixes) \
                if isinstance(layer, keras.Model) else []
            found += deeper or [(path, i)]
        return found

    def _layout_layer(self, path: str) -> bool:
        if path not in self._layout:
            layer = self.model
            for part in path.split("/"):
                layer = next((x for x in _layers(layer) if x.name == part), None)
            self._layout[path] = isinstance(layer, LAYOUT_LAYERS)
        return self._layout[path]

    def paths(self, node_name: str) -> FrozenSet[str]:
        """The layer path(s) a node belongs to: one, none (tf2onnx's own nodes), or several
        where its name stays ambiguous."""
        key = self._key_of.get(node_name)
        return self._paths.get(key, frozenset()) if key is not None else frozenset()

    def nodes(self, path: str) -> List[NodeInfo]:
        """The ONNX nodes of a layer path (every call), in graph order."""
        return list(self._nodes.get(path, ()))

    def has_nodes(self, path: str) -> bool:
        """True when some ONNX node carries this layer's scope."""
        return path in self._nodes

    def assign(self, path: str, node: NodeInfo) -> None:
        """Give a node without a layer scope the scope ``path`` (a Keras operation, below)."""
        key = f"{OPERATION_SCOPE}{path}"
        self._key_of[node.name] = key
        self._paths[key] = frozenset([path])
        self._nodes.setdefault(path, []).append(node)

    def source(self, tensor: str, reader: str) -> Optional[str]:
        """The scope a tensor read by node ``reader`` comes from: walking back through layout ops
        (`LAYOUT_OPS`: tf2onnx's NHWC adapters, whichever layer's scope they carry, unless
        that layer is itself a layout layer, `LAYOUT_LAYERS`) and through a ``Pad`` of the
        same layer call, the path of the first node of another layer call, ``INPUT_SCOPE + name``
        for a graph input, ``""`` for a tf2onnx node without scope, None for a value made inside
        the same call (a layer called on its own output is two calls, two scopes)."""
        call = self._key_of.get(reader)
        seen = 0
        while True:
            node = self.index.producer.get(tensor)
            if node is None:
                return None if self.index.is_constant(tensor) else INPUT_SCOPE + tensor
            paths = self.paths(node.name)
            inside = call is not None and self._key_of.get(node.name) == call
            adapter = node.op_type in LAYOUT_OPS and not any(self._layout_layer(p) for p in paths)
            passable = adapter or (node.op_type in LAYOUT_OPS + ("Pad",) and inside)
            if passable and node.inputs and seen < 64:
                tensor, seen = node.inputs[0], seen + 1
                continue
            if inside:
                return None
            return sorted(paths)[0] if len(paths) == 1 else ("|".join(sorted(paths)) if paths else "")

    def entry_edges(self, path: str) -> Iterator[Tuple[NodeInfo, int, str]]:
        """``(node, input index, source)`` for every non-constant input of a node of layer ``path``
        that comes from outside the layer (`source`), layout nodes only where the layer has
        nothing else."""
        nodes = self.nodes(path)
        compute = [n for n in nodes if n.op_type not in LAYOUT_OPS] or nodes
        for node in compute:
            for j, tensor in enumerate(node.inputs):
                if not tensor or self.index.is_constant(tensor):
                    continue
                src = self.source(tensor, node.name)
                if src is not None:
                    yield node, j, src


def _eliminate(keys: Mapping[str, Set[str]]) -> Dict[str, FrozenSet[str]]:
    """Settle ambiguous scope keys: a layer named by an unambiguous key is removed from every
    ambiguous key that has another candidate; repeated until nothing changes."""
    paths = {k: set(v) for k, v in keys.items()}
    changed = True
    while changed:
        changed = False
        certain = {next(iter(v)) for v in paths.values() if len(v) == 1}
        for key, cands in paths.items():
            if len(cands) > 1 and cands - certain and cands & certain:
                paths[key] = cands - certain
                changed = True
    return {k: frozenset(v) for k, v in paths.items()}


class KerasGraph:
    """The producers of Keras layer inputs, by layer path, through nested models.

    Args:
        model: the Keras model (the float twin, or the QAT model: same names).
        has_nodes: tells whether a layer path left nodes in the ONNX graph.
        input_names: the ONNX graph input names, in the order of ``model.inputs``.
    """

    def __init__(self, model, has_nodes, input_names):
        self.model = model
        self.has_nodes = has_nodes
        self.input_names = list(input_names)
        self._memo: Dict[str, FrozenSet[str]] = {}
        self._aliases: Dict[str, FrozenSet[str]] = {}

    def alias(self, path: str, scopes) -> None:
        """Say that the layer at ``path`` left no node of its own but is computed by the nodes of
        ``scopes`` (tf2onnx merged two layers with equal weights reading the same tensor)."""
        self._aliases[path] = frozenset(scopes)
        self._memo.clear()

    def layer(self, path: str):
        """The layer (or Keras operation) at ``path`` (None when there is none)."""
        model = self.model
        for part in path.split("/"):
            found = next((layer for layer in _layers(model) if layer.name == part), None)
            if found is None:
                found = next((op for op in _operations(model) if op.name == part), None)
            if found is None:
                found = next((t._keras_history[0] for t in getattr(model, "inputs", None) or ()
                              if t._keras_history[0].name == part), None)
            if found is None:
                return None
            model = found
        return model

    def _owner(self, path: str):
        return self.layer(path.rsplit("/", 1)[0]) if "/" in path else self.model

    def producers(self, path: str, input_index: Optional[int] = None) -> List[str]:
        """Paths of the layers whose outputs the layer at ``path`` reads (all calls), for one input
        index or all; an input of a nested model reads the producers of that model's input."""
        layer = self.layer(path)
        prefix = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
        found = []
        if isinstance(layer, keras.layers.InputLayer):
            return self._input_producers(path, layer)
        for node in getattr(layer, "_inbound_nodes", ()):
            tensors = list(node.input_tensors)
            for k, t in enumerate(tensors):
                if input_index is not None and k != input_index:
                    continue
                found.append(prefix + t._keras_history[0].name)
        return list(dict.fromkeys(found))

    def _input_producers(self, path: str, layer) -> List[str]:
        owner = self._owner(path)
        inputs = [t._keras_history[0] for t in getattr(owner, "inputs", None) or ()]
        position = next((i for i, op in enumerate(inputs) if op is layer), 0)
        if owner is self.model:
            return []
        owner_path = path.rsplit("/", 1)[0]
        if isinstance(owner, keras.Sequential):  # a Sequential is called on its one input
            return self.producers(owner_path)
        return self.producers(owner_path, position)

    def sources(self, path: str) -> FrozenSet[str]:
        """The ONNX-visible scopes that hold the output of the layer at ``path``: the path itself
        when it left nodes, the output layer of a nested model, the graph input of a top-level
        InputLayer, otherwise (Dropout, a nested model's InputLayer...) the sources of what it reads."""
        if path in self._memo:
            return self._memo[path]
        self._memo[path] = frozenset()  # cycles cannot occur; this guards recursion anyway
        layer = self.layer(path)
        found: Set[str] = set()
        if path in self._aliases:
            found |= self._aliases[path]
        elif layer is None:
            pass
        elif isinstance(layer, keras.Model):
            for t in layer.outputs:
                found |= self.sources(f"{path}/{t._keras_history[0].name}")
        elif self.has_nodes(path):
            found.add(path)
        elif isinstance(layer, keras.layers.InputLayer) and self._owner(path) is self.model:
            inputs = [t._keras_history[0] for t in self.model.inputs]
            if layer in inputs and inputs.index(layer) < len(self.input_names):
                found.add(INPUT_SCOPE + self.input_names[inputs.index(layer)])
        else:
            for producer in self.producers(path):
                found |= self.sources(producer)
        self._memo[path] = frozenset(found)
        return self._memo[path]

    def consumers(self, path: str) -> List[str]:
        """Paths of the layers (same model) that read the output of the layer at ``path``."""
        layer = self.layer(path)
        prefix = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
        found = []
        for node in getattr(layer, "_outbound_nodes", ()):
            op = getattr(node, "operation", None)
            if op is not None:
                found.append(prefix + op.name)
        return list(dict.fromkeys(found))


def scope_operations(scopes: LayerScopes, graph: KerasGraph, ops_of) -> List[str]:
    """Give each Keras operation that is not a layer (``x + y`` in a Functional model: ConvNeXt's
    residual joins) the ONNX node that computes it, by topology; returns their paths.

    TensorFlow names such an op without a layer scope (``convnext_tiny_1/Add_3``), so its node carries
    only the model's scope. It is the one node without a layer scope, of an op type ``ops_of`` gives
    for the operation (``Add`` for an ``Add``; any non-layout op when None), whose inputs all come
    from the scopes that hold the operation's inputs (`KerasGraph.sources`), read through
    layout ops. Operations are settled in topological order, so one reading another finds it; an
    operation with no such node, or more than one (an operation called twice in one model), is left
    without nodes (and stands for what it reads, as a layer without nodes does).
    """
    found = []
    taken = set()
    for prefix, model in _functional_models(graph.model):
        for op in _operations(model):
            path = prefix + op.name
            wanted = {s for p in graph.producers(path) for s in graph.sources(p)}
            if not wanted:
                continue
            expected = ops_of(op)
            nodes = [n for n in scopes.index.nodes if n.name not in taken and not scopes.paths(n.name)
                     and (n.op_type in expected if expected else n.op_type not in LAYOUT_OPS)
                     and _reads_only(scopes, n, wanted)]
            if len(nodes) != 1:
                continue
            scopes.assign(path, nodes[0])
            taken.add(nodes[0].name)
            graph._memo.clear()
            found.append(path)
    return found


def _functional_models(model, prefix: str = "") -> Iterator[Tuple[str, object]]:
    """``(path prefix, model)`` for ``model`` and every model nested in it."""
    yield prefix, model
    for layer in _layers(model):
        if isinstance(layer, keras.Model):
            yield from _functional_models(layer, f"{prefix}{layer.name}/")


def _reads_only(scopes: LayerScopes, node: NodeInfo, wanted) -> bool:
    """Every non-constant input of ``node`` comes from a scope in ``wanted``, and there is one."""
    sources = [scopes.source(t, node.name) for t in node.inputs if t and not scopes.index.is_constant(t)]
    return bool(sources) and all(s in wanted for s in sources)
