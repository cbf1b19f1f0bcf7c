"""tf_bridge.trace: layer values of a Keras model, all of them or only the layers asked for."""
import numpy as np
import pytest

keras = pytest.importorskip("keras")

import tf_bridge  # noqa: E402
from tests.tf_bridge.models import blobs, mixed_cnn  # noqa: E402
from tf_bridge.trace import trace_layers  # noqa: E402


def test_only_records_the_outputs_of_the_layers_asked_for():
    """``only`` keeps the named layers' outputs (the same values as a full trace) and nothing else,
    so parity's worst-layer search does not hold every tensor of the network."""
    keras.utils.set_random_seed(1)
    q = tf_bridge.quantize_model(mixed_cnn((16, 16, 3)))
    x = blobs(4, (16, 16, 3))[0]
    tf_bridge.calibrate(q, x, progress=False)
    full, out_full = trace_layers(q, x)
    wanted = sorted(p for p in full if p.endswith("_quant"))[:3]
    assert len(wanted) == 3
    some, out_some = trace_layers(q, x, only=wanted)
    assert sorted(some) == wanted
    for path in wanted:
        assert len(some[path]) == len(full[path])
        for a, b in zip(some[path], full[path]):
            assert a.inputs == () and len(b.inputs) > 0
            for u, v in zip(a.outputs, b.outputs):
                np.testing.assert_array_equal(u, v)
    np.testing.assert_array_equal(out_some[0], out_full[0])
