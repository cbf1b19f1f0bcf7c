"""Run one recipe of one peer quantizer, inside that peer's own venv (see ``tools/peers.py``).

``python tools/peer_runner.py PEER RECIPE MODEL CALIB_NPZ OUT`` quantizes ``MODEL`` with the peer's
API on the samples of ``CALIB_NPZ`` (batches of 8), writes the Q/DQ model to ``OUT`` and prints
``PEER_RESULT {"seconds": ...}`` as its last line. It imports only the peer's own packages, numpy and
onnx: never onnx_qat, whose pins these venvs do not hold. Every recipe quantizes activations and
weights to int8 with QuantizeLinear/DequantizeLinear, weights per channel.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

BATCH = 8


def _batches(calib):
    count = len(next(iter(calib.values())))
    return [{k: v[i:i + BATCH] for k, v in calib.items()} for i in range(0, count, BATCH)]


def _reader(calib):
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter(_batches(calib))

        def get_next(self):
            return next(self.feeds, None)

        def rewind(self):  # Quark's AdaRound reads the data again
            self.feeds = iter(_batches(calib))

    return Reader()


def _opset_13(model: str, out: str) -> tuple:
    """``(path, note)``: ``model`` itself, or a copy converted to opset 13 by onnx's version converter
    where it is older (Quark's per-channel QDQ refuses opsets below 13; a user converts first)."""
    import onnx
    from onnx import version_converter

    proto = onnx.load(model)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    if opset >= 13:
        return model, {}
    upgraded = out + ".opset13.onnx"
    onnx.save(version_converter.convert_version(proto, 13), upgraded)
    return upgraded, {"opset": f"{opset} -> 13 (onnx version converter) first"}


def modelopt(recipe: str, model: str, calib, out: str) -> dict:
    """NVIDIA ModelOpt 0.47 INT8 on CPU: ``entropy`` (its default calibration) or ``max``; the parts
    it leaves unquantized stay FP32 (its default would cast them to FP16)."""
    import modelopt
    from modelopt.onnx.quantization import quantize

    quantize(model, quantize_mode="int8", calibration_data=calib, calibration_method=recipe, output_path=out,
             calibration_eps=["cpu"], high_precision_dtype="fp32", log_level="ERROR")
    return {"version": modelopt.__version__}


#: Quark recipes: (calibration method, cross-layer equalization, AdaRound)
QUARK = {"minmax": ("MinMax", False, False), "percentile": ("Percentile", False, False),
         "cle": ("Percentile", True, False), "adaround": ("Percentile", True, True)}


def quark(recipe: str, model: str, calib, out: str) -> dict:
    """AMD Quark 0.13's ONNX quantizer: symmetric int8 activations and per-channel int8 weights in
    standard QDQ (its S8S8 configuration with symmetric activations, the form TensorRT runs),
    MinMax or Percentile (99.9999, its default) calibration, with its CLE and AdaRound (its default
    AdaRound parameters, on the CPU) in the last two recipes."""
    import quark as quark_package
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType
    from quark.onnx import ModelQuantizer
    from quark.onnx.quantization.config.config import Config
    from quark.onnx.quantization.config.custom_config import DEFAULT_ADAROUND_PARAMS
    from quark.onnx.quantization.config.legacy import QuantizationConfig

    method, cle, adaround = QUARK[recipe]
    extra = {"ActivationSymmetric": True, "WeightSymmetric": True, "Percentile": 99.9999,
             "ForceQuantizeNoInputCheck": True}
    if adaround:
        extra["FastFinetune"] = dict(DEFAULT_ADAROUND_PARAMS)
    config = QuantizationConfig(calibrate_method=getattr(CalibrationMethod, method),
                                quant_format=QuantFormat.QDQ, activation_type=QuantType.QInt8,
                                weight_type=QuantType.QInt8, per_channel=True, include_cle=cle,
                                include_fast_ft=adaround, print_summary=False, extra_options=extra)
    source, note = _opset_13(model, out)
    ModelQuantizer(Config(global_quant_config=config)).quantize_model(source, out, _reader(calib))
    return {"version": quark_package.__version__, **note}


def _name_unknown_dims(proto, calib) -> None:
    """Give the graph inputs' unknown sizes (-1, as these exporters write them) the calibration data's
    sizes, the first axis a symbolic batch: AIMET builds a random input from the declared shapes and
    cannot size a negative dimension."""
    for value in proto.graph.input:
        if value.name not in calib:
            continue
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param or dim.dim_value > 0:
                continue
            if axis == 0:
                dim.dim_param = "batch"
            else:
                dim.dim_value = calib[value.name].shape[axis]


def aimet(recipe: str, model: str, calib, out: str) -> dict:
    """AIMET-ONNX 2.42: ``QuantizationSimModel`` with int8 weights (its default configuration: per
    channel) and int8 activations, ``tf_enhanced`` ranges (its recommended scheme), after its
    cross-layer equalization in recipe ``cle``; exported as standard QDQ with signed activations."""
    import aimet_onnx
    import onnx
    from aimet_onnx import QuantizationSimModel

    proto = onnx.load(model)
    _name_unknown_dims(proto, calib)
    if recipe == "cle":
        from aimet_onnx.cross_layer_equalization import equalize_model

        equalize_model(proto)
    sim = QuantizationSimModel(proto, param_type="int8", activation_type="int8", quant_scheme="tf_enhanced",
                               config_file="default")
    sim.compute_encodings(_batches(calib))
    onnx.save(sim.to_onnx_qdq(force_activation_as="signed"), out)
    return {"version": aimet_onnx.__version__}


def main(argv) -> int:
    peer, recipe, model, data, out = argv
    calib = dict(np.load(data, allow_pickle=False))
    start = time.perf_counter()
    info = {"modelopt": modelopt, "quark": quark, "aimet": aimet}[peer](recipe, model, calib, out)
    info["seconds"] = time.perf_counter() - start
    print("PEER_RESULT " + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
