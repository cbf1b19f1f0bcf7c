"""Op-type facts every stage shares (placement, check, the accuracy tools, the Keras bridge).

Source: TensorRT Developer Guide, "Explicit Quantization" / "Q/DQ Layer-Placement
Recommendations": TensorRT runs a convolution or matrix product in INT8 when both its data input
and its weight come through DequantizeLinear.
"""
from __future__ import annotations

#: Weighted ops: TensorRT runs them in INT8 when both the activation and the weight are quantized.
WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
