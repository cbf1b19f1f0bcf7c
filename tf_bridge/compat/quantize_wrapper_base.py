"""``BaseQuantizeWrapper`` where the toolkit keeps it (``tensorflow_quantization.quantize_wrapper_base``).

Subclassing it declares how a layer class of your own is quantized; see
`tf_bridge.custom_layers`.
"""
from __future__ import annotations

from ..custom_layers import BaseQuantizeWrapper

__all__ = ["BaseQuantizeWrapper"]
