"""The input patches of a 2-D Conv as matrix rows (`onnx_qat.accuracy.conv_patches`): at the picked
output positions, each group's rows times its weight matrix is the Conv's output as onnxruntime
computes it, for strides, dilations, asymmetric pads, groups and the 1x1 fast path."""
import numpy as np
import pytest
from onnx import numpy_helper

from onnx_qat.accuracy.conv_patches import conv_output_size, conv_rows
from onnx_qat.graph.index import GraphIndex
from tests.builders import GraphBuilder, run

CASES = {  # name: (channels in, channels out, kernel, group, attributes; omitted ones take ONNX's defaults)
    "3x3": (8, 12, (3, 3), 1, {"pads": [1, 1, 1, 1]}),
    "defaults": (6, 5, (3, 3), 1, {}),
    "1x1": (16, 8, (1, 1), 1, {}),
    "1x1 strided": (16, 8, (1, 1), 1, {"strides": [2, 2]}),
    "strided asymmetric pads": (8, 8, (3, 3), 1, {"strides": [2, 3], "pads": [0, 1, 2, 1]}),
    "dilated": (4, 6, (3, 2), 1, {"dilations": [2, 3], "pads": [2, 1, 2, 2]}),
    "grouped": (8, 12, (3, 3), 4, {"pads": [1, 1, 1, 1]}),
    "depthwise 5x5": (16, 16, (5, 5), 16, {"strides": [2, 2], "pads": [2, 2, 2, 2]}),
    "1x1 padded": (8, 4, (1, 1), 2, {"pads": [1, 0, 0, 1]}),
}


def _conv(cin, cout, kernel, group, attrs, seed):
    b = GraphBuilder("conv", seed)
    x = b.input("input", ["N", cin, "H", "W"])
    w = b.weight("c.weight", [cout, cin // group, *kernel])
    b.node("Conv", [x, w], "output", name="c", group=group, **attrs)
    b.output("output")
    model = b.build()
    return model, numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == w))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_conv_rows_times_the_weight_is_the_convs_output(case, seed):
    cin, cout, kernel, group, attrs = CASES[case]
    model, w = _conv(cin, cout, kernel, group, attrs, seed)
    node = GraphIndex(model).by_name["c"]
    rng = np.random.default_rng(seed)
    scale = (0.01, 100.0)[seed]
    x = (rng.standard_normal((3, cin, 11, 13)) * scale).astype(np.float32)
    y = run(model, {"input": x})[0]
    assert conv_output_size(x.shape, node, w.shape) == y.shape[2:]
    total = y.shape[0] * y.shape[2] * y.shape[3]
    flat = np.moveaxis(y, 1, -1).reshape(total, cout)  # [B * OH * OW, C_out]: the order of the picks
    for pick in (np.arange(total), np.sort(rng.choice(total, size=total // 3, replace=False))):
        rows = conv_rows(x, node, w.shape, group, pick)
        k = cin // group * kernel[0] * kernel[1]
        assert rows.shape == (group, len(pick), k) and rows.dtype == np.float64
        n = cout // group
        mats = w.astype(np.float64).reshape(group, n, -1).transpose(0, 2, 1)  # [group, K, N]
        got = np.concatenate([rows[g] @ mats[g] for g in range(group)], axis=1)
        np.testing.assert_allclose(got, flat[pick], rtol=1e-4, atol=1e-5 * scale * np.sqrt(k))
