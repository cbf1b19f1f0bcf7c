"""Rule 6's choice (onnx_qat.placement.residual), shared by placement, check and the Keras cases."""
import pytest

from onnx_qat.placement.residual import fused_addend, skip_addends


@pytest.mark.parametrize("weighted, lengths, fused", [
    ((False, False), (), None),          # no weighted producer: nothing fuses
    ((True, False), (), 0),              # Conv branch + identity skip
    ((False, True), (), 1),
    ((True, True), (3, 1), 0),           # main branch (3 hops) + projection shortcut (1 hop)
    ((True, True), (1, 3), 1),
    ((True, True), (2, 2), 0),           # a tie: the first is fused, input 1 is the skip
    ((True, True, False), (5, 7, 0), 1),  # three addends: the longest weighted branch
    ((True, True, True), (4, 4, 4), 0),
])
def test_the_longest_weighted_branch_is_fused_and_the_others_are_quantized(weighted, lengths, fused):
    assert fused_addend(weighted, lengths) == fused
    expected = () if fused is None else tuple(i for i in range(len(weighted)) if i != fused)
    assert skip_addends(weighted, lengths) == expected


def test_lengths_default_to_equal():
    assert fused_addend((True, True)) == 0 and skip_addends((True, True)) == (1,)
    assert fused_addend(()) is None and skip_addends(()) == ()
