"""The numeric formats as data (``int8``, ``fp8``, ``int4``): dtypes, scale rules, weight
encoding, INT4 block scales and packing, the weight roundings (activation-aware scales, GPTQ), and
the float parts in FP16/BF16.

Owns: `numeric`, `encoding` (how each format stores a weight), `blockwise`, `awq`, `gptq`,
`float_parts` and `float_cast` (FP16/BF16 float parts).
May import: ``onnx_qat.errors``, ``onnx_qat.io``, ``onnx_qat.graph``, ``onnx_qat.runtime`` (the
roundings and the float parts run the model), ``onnx_qat.scales`` and ``onnx_qat.config`` (the
float parts read ranges and the ``float_dtype`` values), ``onnx_qat.check.precision`` (the float
parts' emulation asks the precision map which tensors TensorRT fuses into an INT8/FP8 kernel);
never placement, insertion, calibration or the accuracy tools.
"""
