"""The numbered TensorRT placement rules, one documented unit each.

Handlers look at one node (through a `GraphIndex`)
and return marks; they never touch a graph. The policy
(`onnx_qat.placement.policy`) maps op types to these handlers and merges the
marks (rule 10). Rule numbers follow the rules table of docs/placement.md.

Public sources:

* TensorRT Developer Guide, "Working with Quantized Types" -> "Explicit Quantization" and
  "Q/DQ Layer-Placement Recommendations" (quantize the inputs of weighted ops, not their
  outputs; let TensorRT fuse Add into the preceding convolution; commuting ops;
  per-channel weights along the output-channel axis; per-tensor activations).
* onnx-tensorrt operator support notes (QuantizeLinear/DequantizeLinear: constant scale,
  zero zero-point, int8).
* NVIDIA Model Optimizer (ONNX PTQ): residual-Add and Concat handling, skipped ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

from ..config import QuantizeConfig
from ..graph.index import GraphIndex, NodeInfo, subgraphs_of
from .residual import skip_addends
from .marks import ActivationMark, Decision, SubgraphPlacement, WeightMark, group_by_tensor

#: Ops that commute with per-tensor quantization (rule 8): Q/DQ moves across them for free.
COMMUTING_OPS = ("MaxPool", "Relu", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Pad",
                 "Resize", "Upsample", "Identity", "Split", "Gather", "SpaceToDepth", "DepthToSpace",
                 "Expand", "Tile", "GlobalMaxPool", "ReduceMax", "ReduceMin", "Clip", "LeakyRelu")
#: Ops that stay fused with the weighted op before them (rule 5): no Q/DQ inside these chains.
FUSED_EPILOGUE_OPS = ("BatchNormalization", "Sigmoid", "Mul", "HardSigmoid", "HardSwish", "Swish", "Elu",
                      "Selu", "Tanh", "Softplus", "PRelu", "Mish", "Sub", "Div")
#: Ops kept in float (rule 9): normalisation, GELU, softmax.
SKIPPED_OPS = ("LayerNormalization", "Gelu", "FastGelu", "Softmax", "LogSoftmax", "InstanceNormalization",
               "GroupNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization", "Erf")
#: How far back the residual-Add rule walks from an Add input (bounds the work per Add).
_MAX_BRANCH_WALK = 64
#: How far forward the Concat rule looks through commuting ops for a quantized consumer.
_MAX_CONCAT_LOOKAHEAD = 8


@dataclass(frozen=True)
class NodeResult:
    """What a handler decided for one node: marks plus its `Decision`.

    ``shares`` names tensors that join ``scale_group`` if some other rule quantizes them
    (the output of a quantized Concat shares its inputs' scale, rule 7).
    """

    decision: Decision
    activations: Tuple[ActivationMark, ...] = ()
    weights: Tuple[WeightMark, ...] = ()
    shares: Tuple[Tuple[str, str], ...] = ()
    subgraphs: Tuple[SubgraphPlacement, ...] = ()

    def __init__(self, decision: Decision, activations: Tuple[ActivationMark, ...] = (),
                 weights: Tuple[WeightMark, ...] = (), shares: Tuple[Tuple[str, str], ...] = (),
                 subgraphs: Tuple[SubgraphPlacement, ...] = ()):
        # fields stored straight into the instance dict, as for the marks (see onnx_qat.placement.marks)
        fields = self.__dict__
        fields["decision"] = decision
        fields["activations"] = activations
        fields["weights"] = weights
        fields["shares"] = shares
        fields["subgraphs"] = subgraphs


@dataclass
class PlacementContext:
    """Shared, read-mostly state of one placement run."""

    index: GraphIndex
    config: QuantizeConfig
    quantized_weighted: Set[str] = field(default_factory=set)
    #: ``place_subgraph(graph, outer_index) -> Placement``: the policy placing a subgraph (If branch)
    place_subgraph: Optional[Callable] = None
    _marked: Dict[str, List[ActivationMark]] = field(default_factory=dict, init=False, repr=False)
    _recorded: List[NodeResult] = field(default_factory=list, init=False, repr=False)  # not in _marked yet

    def record(self, result: NodeResult) -> None:
        """Note what a handler decided: the node as a quantized weighted op (rule 6 reads it), its
        activation marks for `marked`."""
        if result.activations:
            self._recorded.append(result)
        if result.weights:
            self.quantized_weighted.add(result.decision.node)

    @property
    def marked(self) -> Dict[str, List[ActivationMark]]:
        """Tensor -> the activation marks recorded on it so far, in the order recorded. Grouped when asked
        (rule 7's Concats ask, in the last phase), not at each record: rule 10 groups the marks of the
        whole graph itself, in graph order."""
        if self._recorded:
            for result in self._recorded:
                group_by_tensor(result.activations, self._marked)
            self._recorded.clear()
        return self._marked


def _result(node: NodeInfo, action: str, rule: str, reason: str, activations: Tuple[ActivationMark, ...] = (),
            weights: Tuple[WeightMark, ...] = (), shares: Tuple[Tuple[str, str], ...] = ()) -> NodeResult:
    """A NodeResult with its Decision (a short form for the handlers; marks and shares given as tuples)."""
    return NodeResult(Decision(node.name, node.op_type, action, rule, reason), activations, weights, shares)


# --------------------------------------------------------------------------- rule 3
def rule3_weight_axis(node: NodeInfo, weight_shape: Tuple[int, ...]) -> Tuple[Optional[int], str]:
    """Rule 3: activations per tensor, weights per output channel. Returns ``(axis, why)``.

    * Conv: weight ``[C_out, C_in/group, k...]`` -> axis 0.
    * Gemm: ``B`` is ``[N, K]`` with ``transB=1`` -> axis 0, else ``[K, N]`` -> axis 1.
    * MatMul with constant ``B`` ``[K, N]`` -> axis 1; for rank > 2 the last axis (N); a
      1-D ``B`` has no output-channel axis and is quantized per tensor.
    * ConvTranspose: weight ``[C_in, C_out/group, k...]``; the output channels are axis 1.
      TensorRT's explicit-quantization guide requires weight scales per *output* channel (K),
      so axis 1 is used when ``group == 1``. With ``group > 1`` axis 1 would index
      ``C_out/group`` positions shared by several output channels, which TensorRT does not
      treat as per-output-channel scales, so grouped ConvTranspose weights are quantized per
      tensor (``axis None``) instead.

    Source: TensorRT Developer Guide, "Explicit Quantization" (per-channel weight quantization
    along the output-channel dimension; per-tensor activations).
    """
    op = node.op_type
    if op == "Conv":
        return 0, "Conv weight [C_out, C_in/g, k...]: per output channel, axis 0"
    if op == "ConvTranspose":
        if int(node.attr("group", 1)) == 1:
            return 1, "ConvTranspose weight [C_in, C_out, k...]: per output channel, axis 1"
        return None, "grouped ConvTranspose: axis 1 is not one scale per output channel; per tensor"
    if op == "Gemm":
        if int(node.attr("transB", 0)):
            return 0, "Gemm with transB=1, B [N, K]: per output channel, axis 0"
        return 1, "Gemm with transB=0, B [K, N]: per output channel, axis 1"
    if op == "MatMul":
        if len(weight_shape) < 2:
            return None, "MatMul with a 1-D constant B: per tensor"
        axis = len(weight_shape) - 1
        return axis, f"MatMul constant B [..., K, N]: per output column, axis {axis}"
    raise ValueError(f"rule 3 does not apply to {op}")


def weight_channels(node: NodeInfo, weight_shape: Tuple[int, ...]) -> Tuple[int, int]:
    """``(input channels, output channels)`` of a weighted op, from its weight shape."""
    op = node.op_type
    group = int(node.attr("group", 1) or 1)
    if op == "Conv":
        return weight_shape[1] * group, weight_shape[0]
    if op == "ConvTranspose":
        return weight_shape[0], weight_shape[1] * group
    if op == "Gemm":
        n_k = weight_shape if int(node.attr("transB", 0)) else weight_shape[::-1]
        return n_k[1], n_k[0]
    if len(weight_shape) < 2:
        return weight_shape[0] if weight_shape else 1, 1
    return weight_shape[-2], weight_shape[-1]


# --------------------------------------------------------------------------- rule 8 (Pad)
def rule8_activation_source(node: NodeInfo, index: int,
                            ctx: PlacementContext) -> Tuple[str, Tuple[str, int], str]:
    """Rule 8: never put a Q/DQ between Pad and Conv.

    When a weighted op's activation comes from a Pad, the Q/DQ goes on the Pad's input
    (consumer: the Pad), so TensorRT can fuse the Pad into the convolution and the padding
    value (zero) is exactly representable. Returns ``(tensor, consumer, note)``.

    Source: TensorRT Developer Guide, Q/DQ layer-placement recommendations (commuting ops
    such as padding; Q/DQ must sit before the Pad for the Pad+Conv fusion).
    """
    tensor = node.inputs[index]
    pad = ctx.index.producer.get(tensor)
    if (pad is not None and pad.op_type == "Pad" and pad.standard and pad.inputs
            and not ctx.config.node_excluded(pad.name) and not ctx.config.op_type_excluded("Pad")):
        source = pad.inputs[0]
        if not ctx.index.is_constant(source):
            return source, (pad.name, 0), f" (placed before Pad {pad.name!r}, rule 8)"
    return tensor, (node.name, index), ""


# --------------------------------------------------------------------------- rule 4 (+3, 8, 9)
class WeightedOpHandler:
    """Rule 4: quantize the activation input and the weight of Conv, ConvTranspose, Gemm and MatMul;
    never their outputs.

    One Q/DQ on the activation (per tensor) and one DQ on the constant weight (per channel,
    axis from `rule3_weight_axis`). Rule 9 guards apply here: a weight that is not a
    constant, too few channels (``min_channels``) and attention-score MatMuls (both inputs
    activations, skipped unless ``include_attention``) leave the node in float.

    Source: TensorRT Developer Guide, "Q/DQ Layer-Placement Recommendations" (quantize all
    inputs of weighted operations; do not quantize their outputs).
    """

    phase = 1

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        idx = ctx.index
        inputs = node.inputs
        if len(inputs) < 2 or not inputs[0] or not inputs[1]:
            return _result(node, "skip", "R9", "missing activation or weight input")
        x, w = inputs[0], inputs[1]
        if not idx.is_constant(w):
            if node.op_type == "MatMul":
                return self._activation_matmul(node, ctx)
            return _result(node, "skip", "R9", f"weight {w!r} is not a constant")
        if idx.is_constant(x):
            return _result(node, "skip", "R9", f"input {x!r} is a constant, not an activation")
        if not idx.is_float_or_unknown(x) or not idx.is_float_or_unknown(w):
            return _result(node, "skip", "R9", "input or weight is not float32")
        shape = idx.constant_shape(w)
        conv_like = node.op_type in ("Conv", "ConvTranspose")
        if conv_like and len(shape) < 3 or node.op_type == "Gemm" and len(shape) != 2:
            return _result(node, "skip", "R9", f"unexpected weight shape {list(shape)}")
        cin, cout = weight_channels(node, shape)
        if min(cin, cout) < ctx.config.min_channels:
            limit = ctx.config.min_channels
            return _result(node, "skip", "R9", f"{cin} input / {cout} output channels < min_channels {limit}")
        axis, why = rule3_weight_axis(node, shape)
        tensor, consumer, note = rule8_activation_source(node, 0, ctx)
        act = ActivationMark(tensor, (consumer,), "R4",
                             f"activation input of {node.op_type} {node.name!r}{note}")
        weight = WeightMark(w, node.name, 1, axis, "R3", why)
        return _result(node, "quantize", "R4", f"activation + weight quantized; {why}", (act,), (weight,))

    def _activation_matmul(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        """Rule 9: a MatMul of two activations (attention scores Q·Kᵀ, probabilities·V)."""
        idx = ctx.index
        a, b = node.inputs[0], node.inputs[1]
        if idx.is_constant(a):
            return _result(node, "skip", "R9", "constant first input with an activation second input")
        if not ctx.config.include_attention:
            return _result(node, "skip", "R9",
                           "both inputs are activations (attention-score product); include_attention is off")
        if not (idx.is_float_or_unknown(a) and idx.is_float_or_unknown(b)):
            return _result(node, "skip", "R9", "inputs are not float32")
        marks = tuple(ActivationMark(t, ((node.name, i),), "R9",
                                     f"input {i} of attention MatMul {node.name!r} (include_attention)")
                      for i, t in enumerate((a, b)))
        return _result(node, "quantize", "R9", "attention MatMul: both inputs quantized per tensor",
                       marks)


# --------------------------------------------------------------------------- rule 5
class FusedEpilogueHandler:
    """Rule 5: leave Conv→BatchNormalization→Relu(→MaxPool) and Conv→Sigmoid→Mul chains unbroken.

    These ops get no Q/DQ of their own, so TensorRT fuses them into the preceding weighted
    op's INT8 kernel; the next quantized consumer quantizes the end of the chain.

    Source: TensorRT Developer Guide, Q/DQ layer-placement recommendations (do not insert Q/DQ
    between a convolution and the pointwise ops it fuses).
    """

    phase = 1
    #: the decision for every node (the policy takes it without a call)
    constant = ("none", "R5", "pointwise op kept fused with its producer; no Q/DQ inside")

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        return _result(node, *self.constant)


# --------------------------------------------------------------------------- rule 6
def _through_epilogue(tensor: str, ctx: PlacementContext,
                      path: Optional[List[str]] = None) -> Optional[NodeInfo]:
    """The quantized weighted op producing ``tensor``, directly or through BatchNormalization,
    a bias Add or a per-channel scale Mul (an Add/Mul with one constant input, as exporters
    leave unfolded batch norms); None otherwise. The tensors walked are appended to ``path``."""
    idx = ctx.index
    for _ in range(4):
        if path is not None:
            path.append(tensor)
        node = idx.producer.get(tensor)
        if node is None:
            return None
        if node.name in ctx.quantized_weighted:
            return node
        if node.op_type == "BatchNormalization":
            tensor = node.inputs[0]
        elif node.op_type in ("Add", "Mul") and len(node.inputs) == 2 and \
                idx.is_constant(node.inputs[0]) != idx.is_constant(node.inputs[1]):  # exactly one constant
            tensor = node.inputs[1] if idx.is_constant(node.inputs[0]) else node.inputs[0]
        else:
            return None
    return None


def _computed_from(tensor: str, sources: Set[str], ctx: PlacementContext) -> bool:
    """True when ``tensor`` is computed from one of ``sources`` within a bounded backward walk
    (the "skip" of an elementwise expression such as ``x + 0.044715 * x**3`` inside a GELU is
    computed from the weighted branch itself; a real shortcut is not).

    In a topologically sorted graph the walk only reaches ``tensor`` and tensors made by earlier
    nodes, so when every source is made by a later node than ``tensor`` the answer is False
    without walking (the usual case: a shortcut is made before its block's weighted branch).
    A tensor no node makes (a graph input) is computed from nothing but itself.
    """
    idx = ctx.index
    if tensor not in idx.producer:
        return tensor in sources
    if _made_after(sources, tensor, idx):
        return False
    return _computed_from_walk(tensor, sources, ctx)


def _made_after(sources: Set[str], tensor: str, idx: GraphIndex) -> bool:
    """True when the graph is topologically sorted, ``tensor`` has a producer and every source is
    made by a node placed after it, so no backward walk from ``tensor`` can reach a source."""
    start = idx.producer.get(tensor)
    if start is None or not sources or not idx.is_topologically_sorted():
        return False
    for source in sources:
        node = idx.producer.get(source)
        if node is None or node.position <= start.position:
            return False
    return True


def _computed_from_walk(tensor: str, sources: Set[str], ctx: PlacementContext) -> bool:
    """The bounded backward walk behind `_computed_from`: depth-first over non-constant
    inputs, stopping at quantized weighted ops, at most ``_MAX_BRANCH_WALK`` tensors."""
    idx = ctx.index
    frontier, seen = [tensor], {tensor}
    for _ in range(_MAX_BRANCH_WALK):
        if not frontier:
            return False
        t = frontier.pop()
        if t in sources:
            return True
        node = idx.producer.get(t)
        if node is None or node.name in ctx.quantized_weighted:
            continue
        for following in node.inputs:
            if following and following not in seen and not idx.is_constant(following):
                seen.add(following)
                frontier.append(following)
    return False


def _branch_length(tensor: str, ctx: PlacementContext) -> int:
    """Hops from ``tensor`` back to the nearest fork (a tensor with several consumers or a
    graph input), following each node's first non-constant input; bounded."""
    idx = ctx.index
    for hops in range(_MAX_BRANCH_WALK):
        node = idx.producer.get(tensor)
        if node is None or len(idx.consumers(tensor)) > 1:
            return hops
        following = [t for t in node.inputs if t and not idx.is_constant(t)]
        if not following:
            return hops
        tensor = following[0]
        if len(idx.consumers(tensor)) > 1:
            return hops + 1
    return _MAX_BRANCH_WALK


class ResidualAddHandler:
    """Rule 6: a residual Add quantizes only its skip (identity) input.

    When one input comes from a quantized weighted op (directly or through BatchNormalization,
    a bias Add or a constant scale Mul) and the other does not, only the other (the skip) gets
    a Q/DQ; the branch from the weighted op stays float so TensorRT fuses the Add into that op's INT8 kernel.
    When both inputs come from quantized weighted ops (a projection shortcut), exactly one
    is quantized: the *shorter* branch back to the fork where the two paths split (the
    shortcut, e.g. the 1x1 projection), leaving the longer main branch to take the fused Add;
    on a tie, input 1. Adds with a constant input (bias) and Adds of two activations that no
    quantized weighted op produces are left in float. The skip may come from any producer (a Relu,
    a hard-swish or squeeze-excitation Mul, another Add...). An Add whose other input is computed
    from the weighted op's own output (``y + f(y)``: a GELU's ``x + c*x**3``, a squeeze-excitation
    ``y + y*gate``) is left in float: no fusion is possible there, since the fused kernel would
    need its own result as its residual input (check rule C10 does not ask for it either).

    Sources: TensorRT Developer Guide, Q/DQ layer-placement recommendations (residual Add
    fusion with the convolution); NVIDIA Model Optimizer ONNX rules (quantize the residual,
    non-backbone Add input).
    """

    phase = 2

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        if len(node.inputs) != 2:
            return _result(node, "none", "R6", "Add with a constant input (bias): left in float")
        return self.join(node, node.inputs[0], node.inputs[1], ctx)

    def join(self, node: NodeInfo, a: str, b: str, ctx: PlacementContext) -> NodeResult:
        """Rule 6 on the two addends ``a`` (input 0) and ``b`` (input 1) of ``node``."""
        idx = ctx.index
        if not a or not b or idx.is_constant(a) or idx.is_constant(b):
            return _result(node, "none", "R6", f"{node.op_type} with a constant input (bias): left in float")
        if a == b:
            return _result(node, "none", "R6", f"{node.op_type} of a tensor with itself: left in float")
        paths: List[List[str]] = [[], []]
        producers = [_through_epilogue(a, ctx, paths[0]), _through_epilogue(b, ctx, paths[1])]
        if producers[0] is None and producers[1] is None:
            return _result(node, "none", "R6",
                           "no input comes from a quantized weighted op: not a fusable residual Add")
        if producers[0] is not None and producers[1] is not None:
            lengths = [_branch_length(t, ctx) for t in (a, b)]
            (skip,) = skip_addends((True, True), lengths)
            why = (f"both inputs come from weighted ops ({producers[0].name!r}, {producers[1].name!r}); "
                   f"quantizing the shorter branch (input {skip}, "
                   f"{lengths[skip]} vs {lengths[1 - skip]} hops)")
        else:
            (skip,) = skip_addends((producers[0] is not None, producers[1] is not None))
            why = f"input {1 - skip} comes from {producers[1 - skip].name!r} and stays float for Add fusion"
            if _computed_from(node.inputs[skip], set(paths[1 - skip]), ctx):
                return _result(node, "none", "R6",
                               "the other input is computed from the weighted branch itself (an elementwise "
                               "expression such as a GELU or a squeeze-excitation x*gate, not a shortcut; "
                               "TensorRT cannot fuse the Add into an op whose output the other addend "
                               "needs): "
                               "left in float")
        tensor = node.inputs[skip]
        if not idx.is_float_or_unknown(tensor):
            return _result(node, "none", "R6", "skip input is not float32")
        mark = ActivationMark(tensor, ((node.name, skip),), "R6",
                              f"skip input {skip} of residual {node.op_type} {node.name!r}")
        return _result(node, "quantize", "R6", f"skip input {skip} quantized; {why}", (mark,))


class ResidualSumHandler(ResidualAddHandler):
    """Rule 6 (Sum): a ``Sum`` is a residual join under the rule of Add, on its first two inputs.

    * Two inputs (as old exporters, e.g. Caffe2-converted models, write a residual join): exactly
      the rule of `ResidualAddHandler`.
    * More inputs (rule 6b): TensorRT's ONNX parser imports ``Sum`` as a left-to-right chain of
      element-wise sums, ``((x0 + x1) + x2) + ...``. Only the first link adds two tensors of the
      graph, so only it can fuse into the weighted op producing ``x0`` or ``x1`` (rule 6 applies to
      that pair). Every later link adds a graph tensor to an intermediate sum that no Q/DQ in the
      ONNX graph can reach, so no INT8 fusion is possible there: inputs 2 and up stay float. This
      is rule 7's choice for non-commuting ops that are not worth quantizing (a Q/DQ there would
      add rounding error and no INT8 kernel).
    * One input (an identity): nothing to do.

    Sources: onnx-tensorrt operator support (``Sum``: element-wise sum of all inputs, built as a
    chain of IElementWiseLayer); TensorRT Developer Guide, Q/DQ layer-placement recommendations
    (residual Add fusion with the convolution).
    """

    phase = 2

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        inputs = node.inputs
        if len(inputs) < 2:
            return _result(node, "none", "R6", "Sum of one input (an identity): nothing to quantize")
        result = self.join(node, inputs[0], inputs[1], ctx)
        if len(inputs) == 2 or result.decision.action != "quantize":
            return result
        d = result.decision
        rest = f"; inputs 2-{len(inputs) - 1} stay float (rule 6b: later links of TensorRT's sum chain)"
        return NodeResult(Decision(d.node, d.op_type, d.action, "R6b", d.reason + rest), result.activations)


# --------------------------------------------------------------------------- rule 7
class PoolingInputHandler:
    """Rule 7 (pooling): AveragePool and GlobalAveragePool quantize their input, so TensorRT
    runs them in INT8 (they do not commute with quantization: averaging creates new values).

    Source: TensorRT Developer Guide, Q/DQ layer-placement recommendations (non-commuting
    ops that have INT8 implementations).
    """

    phase = 1

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        x = node.inputs[0] if node.inputs else ""
        if not x or ctx.index.is_constant(x) or not ctx.index.is_float_or_unknown(x):
            return _result(node, "none", "R7", "input is not a float activation")
        mark = ActivationMark(x, ((node.name, 0),), "R7", f"input of {node.op_type} {node.name!r}")
        return _result(node, "quantize", "R7", "non-commuting pooling: input quantized", (mark,))


def _feeds_quantized(tensor: str, ctx: PlacementContext) -> bool:
    """True when ``tensor``, or a tensor reached from it through commuting ops (bounded),
    is already marked for quantization."""
    frontier = [tensor]
    for _ in range(_MAX_CONCAT_LOOKAHEAD):
        following = []
        for t in frontier:
            if t in ctx.marked:
                return True
            for consumer, i in ctx.index.consumers(t):
                if i == 0 and consumer.op_type in COMMUTING_OPS and consumer.outputs:
                    following.append(consumer.outputs[0])
        if not following:
            return False
        frontier = following
    return False


class ConcatHandler:
    """Rule 7 (Concat): quantize every input of a Concat with one shared scale, when useful.

    A Concat is quantized only when its output feeds a quantized input (directly or through
    commuting ops such as MaxPool or Relu): then TensorRT can run the concatenation in INT8
    without requantizing, because every input and the output share one scale (the scale
    group's largest amax). A Concat whose output stays float (e.g. shape arithmetic, or a
    head that is not quantized) is left alone: quantizing it would only add error.

    Sources: TensorRT Developer Guide, Q/DQ layer-placement recommendations (concatenation
    inputs and output with the same scale); NVIDIA Model Optimizer ONNX rules (Concat
    elimination with shared scales).
    """

    phase = 3

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        idx = ctx.index
        out = node.outputs[0] if node.outputs else ""
        inputs = [t for t in node.inputs if t]
        if not out or not inputs:
            return _result(node, "none", "R7", "empty Concat")
        if not _feeds_quantized(out, ctx):
            return _result(node, "none", "R7", "output does not feed a quantized op: left in float")
        if any(idx.is_constant(t) or not idx.is_float_or_unknown(t) for t in inputs):
            return _result(node, "none", "R7", "an input is a constant or not float32: left in float")
        group = f"concat:{node.name}"
        marks = tuple(ActivationMark(t, ((node.name, i),), "R7",
                                     f"input {i} of Concat {node.name!r} (shared scale)", scale_group=group)
                      for i, t in enumerate(node.inputs) if t)
        return _result(node, "quantize", "R7", f"all {len(marks)} inputs quantized with one shared scale",
                       marks, shares=((out, group),))


# --------------------------------------------------------------------------- rule 8
class CommutingOpHandler:
    """Rule 8: commuting ops (MaxPool, Relu, Reshape, Transpose, Flatten, Squeeze, Unsqueeze,
    Slice, Pad, Resize...) get no Q/DQ of their own; TensorRT moves quantization across them.

    Source: TensorRT Developer Guide, Q/DQ layer-placement recommendations (commuting
    layers and Q/DQ propagation).
    """

    phase = 1
    #: the decision for every node (the policy takes it without a call)
    constant = ("none", "R8", "commutes with quantization: no Q/DQ of its own")

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        return _result(node, *self.constant)


# --------------------------------------------------------------------------- rule 9
class SkippedOpHandler:
    """Rule 9: LayerNormalization, GELU, Softmax (and similar normalisations) stay in float.

    Their inputs are not quantized, so TensorRT keeps them in FP16/FP32 where INT8 would
    lose too much accuracy. (Graph outputs are never quantized either: only inputs of
    quantized consumers are rewired, so every graph output keeps its float producer.)

    Sources: NVIDIA Model Optimizer ONNX rules (default op types kept in float); TensorRT
    Developer Guide, Q/DQ placement (quantize only where an INT8 implementation helps).
    """

    phase = 1

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        return _result(node, "skip", "R9", f"{node.op_type} is kept in float")


# --------------------------------------------------------------------------- subgraph rule
class SubgraphHandler:
    """Subgraph rule: each branch of an If, and the body of a Loop or Scan, is placed by the same
    rules, as a graph of its own.

    A subgraph reads outer-scope names (activations, and weights that are outer initializers or
    Constant outputs) through the enclosing graph's index; rule 10 holds within each subgraph. The
    inputs of a Loop/Scan body (iteration number, condition, loop-carried values, scan-input slices)
    are activations of the body like graph inputs. The two branches of an If never run together, so a
    tensor of the If's scope read by both is quantized in each branch that quantizes it; a body's
    Q/DQ pair serves every iteration (one range for all of them, which calibration observes over
    every iteration: `onnx_qat.calibration.branches`). Subgraphs whose tensor names are not
    unique in the model (a name defined in both branches, or shadowing an outer one) are left
    untouched: ranges are kept per tensor name.

    Sources: ONNX IR specification, "Names Within a Graph" (outer-scope names visible in
    subgraphs); onnx-tensorrt operator support (If: both branches are built as conditional
    subgraphs, Q/DQ layers inside them included; Loop and Scan: the body is built as a TensorRT
    ILoop); TensorRT Developer Guide, "Working with Loops" (interior layers of a loop may use
    tensors defined inside or outside it; its rules restrict the boundary layers, and the layers
    allowed inside are listed in the Support Matrix, "Layers for Flow-Control Constructs") and
    TensorRT's builder, which asks for explicit Q/DQ (not implicit calibration) in networks with
    loops ("Int8 calibration in TensorRT won't be used on networks containing boolean operators or
    loops. Please use quantization-aware training to generate a network with Quantize/Dequantize
    nodes", quoted in onnxruntime-inference-examples issue 44). See docs/placement.md, "What
    happens to a Loop or Scan".
    """

    phase = 1
    #: what the decision's reason calls the subgraphs of each op type
    KINDS = {"If": "If branches", "Loop": "Loop body", "Scan": "Scan body"}

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        graphs = subgraphs_of(node.proto)
        defined = [_defined_names(g) for _, _, g in graphs]
        outer = _outer_defined(ctx.index)
        clash = set()
        for i, names in enumerate(defined):
            clash |= names & outer
            for other in defined[i + 1:]:
                clash |= names & other
        kind = self.KINDS.get(node.op_type, "subgraphs")
        if clash:
            return _result(node, "skip", "subgraph", f"{kind} tensor names are not unique in the model "
                           f"(e.g. {sorted(clash)[0]!r}): left untouched")
        found, counts = [], []
        for attribute, position, graph in graphs:
            placement = ctx.place_subgraph(graph, ctx.index)
            counts.append(f"{attribute} {len(placement.all_activations())} activation(s), "
                          f"{len(placement.all_weights())} weight(s)")
            if not placement.empty:
                found.append(SubgraphPlacement(node.name, attribute, position, placement))
        reason = f"{kind} placed as graphs of their own: " + "; ".join(counts)
        action = "quantize" if found else "none"
        return NodeResult(Decision(node.name, node.op_type, action, "subgraph", reason),
                          subgraphs=tuple(found))


#: the former name of `SubgraphHandler` (which placed If branches only)
IfBranchHandler = SubgraphHandler

#: op types whose subgraphs `SubgraphHandler` places
SUBGRAPH_OPS = ("If", "Loop", "Scan")


def _defined_names(graph) -> Set[str]:
    """Every name ``graph`` and its nested subgraphs define (inputs, initializers, node outputs)."""
    names = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(o for o in node.output if o)
        if node.attribute:
            for _, _, sub in subgraphs_of(node):
                names |= _defined_names(sub)
    return names


def _outer_defined(index: GraphIndex) -> Set[str]:
    """Names defined by the graph behind ``index`` and every graph enclosing it."""
    names: Set[str] = set()
    while index is not None:
        names.update(index.graph_inputs)
        names.update(index.initializers)
        names.update(index.producer)
        index = index.outer
    return names


class NotQuantizedHandler:
    """Ops no rule quantizes (the default): nothing to do."""

    phase = 1
    #: the decision for every node (the policy takes it without a call)
    constant = ("none", "-", "no rule quantizes this op type")

    def __call__(self, node: NodeInfo, ctx: PlacementContext) -> NodeResult:
        return _result(node, *self.constant)
