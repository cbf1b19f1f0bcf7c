"""The numeric formats as data (``int8``, ``fp8``, ``int4``): dtypes, scale rules, weight
encoding, INT4 block scales and packing, and the weight roundings (activation-aware scales, GPTQ).

Owns: :mod:`.numeric`, :mod:`.encoding` (how each format stores a weight), :mod:`.blockwise`,
:mod:`.awq`, :mod:`.gptq`.
May import: ``onnx_qat.errors``, ``onnx_qat.io``, ``onnx_qat.graph``, ``onnx_qat.runtime`` (the
roundings run the model); never placement, insertion, calibration or the accuracy tools.
"""
