"""Which marks a numeric format keeps: the one placement, asked about the format.

``int8`` and ``fp8`` keep the TensorRT policy's placement as it is (``fp8`` differs only in
``include_attention``'s default, which the policy reads from the config). ``int4`` is weight-only:
`weight_only_marks` keeps the weight marks of MatMul/Gemm whose reduction dimension the
block size divides, moves them to the block axis, and drops every activation mark.

Rule W4 (int4): a blockwise DequantizeLinear on each constant 2-D MatMul/Gemm weight, blocks
along the reduction axis K (MatMul ``B [K, N]``: axis 0; Gemm ``transB=1``, ``B [N, K]``: axis
1; ``transB=0``: axis 0); activations are not quantized; Conv weights stay float.

Sources: TensorRT Developer Guide, "Quantization Schemes" (INT4 is weight-only, per-block
scales, block sizes 64/128 along one of the last two dimensions) and "Working with Quantized
Types" (weight-only quantization of GEMM weights; convolution weights are not listed for INT4
block quantization, so Conv stays float here).
"""
from __future__ import annotations

import logging
from typing import List, Optional, Tuple

from ..config import QuantizeConfig
from ..formats.numeric import TENSORRT_BLOCK_SIZES, get_format
from ..graph.index import GraphIndex
from .marks import Decision, Placement, WeightMark

logger = logging.getLogger(__name__)


def block_axis(op_type: str, trans_b: int, shape: Tuple[int, ...]) -> Optional[int]:
    """The reduction axis of a 2-D MatMul/Gemm weight (None when the weight is not 2-D)."""
    if len(shape) != 2:
        return None
    if op_type == "Gemm" and trans_b:
        return 1
    return 0


def adapt_placement(placement: Placement, index: GraphIndex, config: QuantizeConfig) -> Placement:
    """The marks ``config.precision`` keeps of the policy's ``placement`` (see the module docstring)."""
    if not get_format(config.precision).weight_only:
        return placement
    return weight_only_marks(placement, index, config)


def weight_only_marks(placement: Placement, index: GraphIndex, config: QuantizeConfig) -> Placement:
    """Rule W4: the int4 form of ``placement`` (weight marks on block axes, no activation marks)."""
    fmt = get_format(config.precision)
    kept: dict = {}
    for mark in placement.weights:
        node = index.by_name.get(mark.node)
        if node is None or node.op_type not in fmt.weight_ops:
            continue
        shape = index.constant_shape(mark.tensor) or ()
        axis = block_axis(node.op_type, int(node.attr("transB", 0) or 0), tuple(shape))
        if axis is None:
            kept[mark.node] = (None, f"weight shape {list(shape)} is not 2-D: left float")
        elif shape[axis] % config.block_size:
            fits = [b for b in TENSORRT_BLOCK_SIZES if b != config.block_size and shape[axis] % b == 0]
            hint = f" (--block-size {fits[0]} divides it)" if fits else ""
            kept[mark.node] = (None, f"reduction dimension {shape[axis]} is not a multiple of block_size "
                                     f"{config.block_size}: left float{hint}")
        else:
            why = (f"int4 weight-only: blocks of {config.block_size} along axis {axis} "
                   f"(reduction dimension {shape[axis]})")
            kept[mark.node] = (WeightMark(mark.tensor, mark.node, mark.input_index, axis, "W4", why), why)
    weights = tuple(w for w, _ in kept.values() if w is not None)
    decisions: List[Decision] = []
    for d in placement.decisions:
        if d.node in kept:
            mark, why = kept[d.node]
            decisions.append(Decision(d.node, d.op_type, "quantize" if mark else "skip", "W4", why))
        elif d.action == "quantize" and d.rule != "subgraph":  # an If's branches: placed (and adapted) apart
            decisions.append(Decision(d.node, d.op_type, "none", "W4",
                                      "int4 is weight-only: activations stay float"))
        else:
            decisions.append(d)
    for d in decisions:
        logger.debug("placement (int4) %s %r: %s", d.action, d.node, d.reason)
    return Placement((), weights, tuple(decisions), placement.notes, placement.subgraphs)
