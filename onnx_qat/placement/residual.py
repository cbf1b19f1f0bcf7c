"""Rule 6's choice, in one place: which addend of a residual join TensorRT fuses into its weighted op.

TensorRT fuses an element-wise Add into the convolution (or GEMM) that produces one of its inputs when
the other input, the skip, arrives through Q/DQ; the fused branch itself must stay float. When more
than one addend comes from a weighted op, the *longest* branch back to where the paths fork (the main
branch, not the 1x1 projection shortcut) is the one to fuse; on a tie, the first of them.

Three places apply the rule to their own view of the graph and ask this module for the choice:
placement (`onnx_qat.placement.handlers.ResidualAddHandler`, on the ONNX graph), the Keras
cases (`tf_bridge.case_base.residual_skip_indices`, on the Keras layer graph, before export) and
the checker (rules C10/C11, `onnx_qat.check.rules_fusion`, on any tool's Q/DQ model).

Source: TensorRT Developer Guide, "Q/DQ Layer-Placement Recommendations" (residual element-wise
addition fusion: quantize the skip input, leave the convolution's output float).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple


def fused_addend(from_weighted: Sequence[bool], branch_lengths: Sequence[int] = ()) -> Optional[int]:
    """The index of the addend TensorRT fuses (it stays float), or None when no addend comes from a
    weighted op.

    Args:
        from_weighted: for each addend, whether it comes from a fusable weighted op (directly or
            through ops TensorRT folds into it: BatchNormalization, a bias Add, a constant scale).
        branch_lengths: for each addend, the length of its branch back to the fork (any monotone
            measure: hops, or depth from the graph input); missing: all equal.
    """
    candidates = [i for i, weighted in enumerate(from_weighted) if weighted]
    if not candidates:
        return None
    lengths = list(branch_lengths)
    if not lengths:  # all lengths equal: the first candidate
        return candidates[0]
    return max(candidates, key=lambda i: (lengths[i], -i))


def skip_addends(from_weighted: Sequence[bool], branch_lengths: Sequence[int] = ()) -> Tuple[int, ...]:
    """The addends to quantize when one is fused: every addend but `fused_addend`'s (empty when
    none is fused)."""
    fused = fused_addend(from_weighted, branch_lengths)
    if fused is None:
        return ()
    if len(from_weighted) == 2:  # a two-input join, the usual case
        return (1 - fused,)
    return tuple(i for i in range(len(from_weighted)) if i != fused)
