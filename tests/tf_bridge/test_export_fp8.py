"""export_onnx(precision="fp8"): a QAT-trained INT8 model's ranges written as FP8 Q/DQ, parity
measured against the same Keras model run with FP8 fake quantization."""
import os

import onnx
import pytest
from onnx import numpy_helper

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import tf_bridge  # noqa: E402
from onnx_qat.errors import ExportError  # noqa: E402
from tests.tf_bridge.models import blobs  # noqa: E402
from tests.tf_bridge.test_export import _resnet_style  # noqa: E402
from tf_bridge.fake_quant import fake_quant, numerics  # noqa: E402

os.environ.setdefault("TF_BRIDGE_QUIET", "1")


def test_fp8_numerics_cast_to_e4m3_with_the_same_amax():
    x = tf.constant([0.0, 1.0, 1.0625, 1.1875, 500.0, -1000.0, 0.001953125])
    with numerics("fp8"):
        got = fake_quant(x, 448.0).numpy()
    assert got.tolist() == [0.0, 1.0, 1.0, 1.25, 448.0, -448.0, 0.001953125]
    assert fake_quant(x, 127.0).numpy().tolist() == [0.0, 1.0, 1.0, 1.0, 127.0, -128.0, 0.0]  # int8 after
    with pytest.raises(ValueError):
        with numerics("int4"):
            pass


def _scales(model):
    inits = {t.name: t for t in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear":
            found[node.input[0]] = float(numpy_helper.to_array(inits[node.input[1]]))
    return found


def test_qat_trained_int8_model_exports_as_fp8_with_the_same_amax(tmp_path):
    keras.utils.set_random_seed(11)
    x, y = blobs(128, (16, 16, 3))
    model = _resnet_style(blocks=2)
    q = tf_bridge.quantize_model(model, custom_qdq_cases=[tf_bridge.custom_qdq_cases.ResNetV1QDQCase()])
    tf_bridge.calibrate(q, x[:64], progress=False)
    q.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    q.fit(x, y, epochs=1, batch_size=32, verbose=0)
    int8 = tf_bridge.export_onnx(q, tmp_path / "int8.onnx", sample_data=x[:32], progress=False)
    fp8 = tf_bridge.export_onnx(q, tmp_path / "fp8.onnx", sample_data=x[:32], progress=False,
                                precision="fp8")
    assert fp8.parity.passed and fp8.check.passed and not fp8.check.warnings, str(fp8)
    for out in fp8.parity.outputs:  # against the Keras model with FP8 fake quantization
        assert out.ratio <= 0.10 and out.top1 is None or out.top1 >= 0.99, str(fp8)
    m8, mf = onnx.load(str(int8.path)), onnx.load(str(fp8.path))
    s8, sf = _scales(m8), _scales(mf)
    assert len(s8) == len(sf) > 0  # tf2onnx numbers some tensor names per conversion: compare the values
    amax8 = sorted(v * 127 for v in s8.values())
    amaxf = sorted(v * 448 for v in sf.values())
    assert amax8 == pytest.approx(amaxf, rel=1e-6)  # the same learned amax
    assert any(t.data_type == onnx.TensorProto.FLOAT8E4M3FN for t in mf.graph.initializer)
    with pytest.raises(ExportError, match="weight-only"):
        tf_bridge.export_onnx(q, tmp_path / "int4.onnx", sample_data=x[:8], precision="int4")
