"""export_onnx(float_dtype="fp16"|"bf16"): the exported Q/DQ model with its float parts in FP16/BF16,
parity proven on the FP32 float parts, the conversion measured against the float model."""

import os

import onnx
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import tf_bridge  # noqa: E402
from onnx_qat.errors import ExportError  # noqa: E402
from onnx_qat.formats.float_parts import emulate_in_fp32  # noqa: E402
from tests.builders import cosine, run  # noqa: E402
from tests.tf_bridge.models import blobs  # noqa: E402
from tests.tf_bridge.test_export import _resnet_style  # noqa: E402

os.environ.setdefault("TF_BRIDGE_QUIET", "1")


def test_export_writes_fp16_float_parts_that_keep_the_cosine(tmp_path):
    keras.utils.set_random_seed(5)
    x, _ = blobs(64, (16, 16, 3))
    q = tf_bridge.quantize_model(
        _resnet_style(blocks=2), custom_qdq_cases=[tf_bridge.custom_qdq_cases.ResNetV1QDQCase()]
    )
    tf_bridge.calibrate(q, x[:32], progress=False)
    fp32 = tf_bridge.export_onnx(
        q, tmp_path / "fp32.onnx", sample_data=x[:16], progress=False, save_float=True
    )
    fp16 = tf_bridge.export_onnx(
        q, tmp_path / "fp16.onnx", sample_data=x[:16], progress=False, float_dtype="fp16"
    )
    assert fp16.parity.passed and not fp16.check.errors and not fp16.check.warnings, str(fp16)
    assert fp16.float_parts is not None and fp16.float_parts.float_dtype == "fp16"
    m32, m16, mf = (onnx.load(str(p)) for p in (fp32.path, fp16.path, fp32.float_path))
    # a QuantizeLinear of the graph input reads it in FP32, with an FP32 scale (rule boundary)
    assert {k.rule for k in fp16.float_parts.kept} <= {"boundary"}
    boundary = {n.input[1] for n in m16.graph.node
                if n.op_type == "QuantizeLinear" and n.name in {k.node for k in fp16.float_parts.kept}}
    floats = [t.data_type for t in m16.graph.initializer if t.data_type in (1, 10) and t.name not in boundary]
    assert floats and set(floats) == {onnx.TensorProto.FLOAT16}
    feeds = {mf.graph.input[0].name: x[32:48]}
    ref = run(mf, feeds)[0]
    assert cosine(ref, run(emulate_in_fp32(m16), feeds)[0]) >= cosine(ref, run(m32, feeds)[0]) - 0.002
    measured = next(iter(fp16.float_parts.measurement["outputs"].values()))
    assert measured["cosine"] >= measured["cosine_fp32"] - 0.002
    with pytest.raises(ExportError, match="float_dtype"):
        tf_bridge.export_onnx(q, tmp_path / "bad.onnx", sample_data=x[:8], float_dtype="half")
    with pytest.raises(ExportError, match="TensorRT form"):
        tf_bridge.export_onnx(
            q, tmp_path / "cpu.onnx", sample_data=x[:8], target="ort-cpu", float_dtype="fp16"
        )
    assert not (tmp_path / "bad.onnx").exists() and not (tmp_path / "cpu.onnx").exists()
