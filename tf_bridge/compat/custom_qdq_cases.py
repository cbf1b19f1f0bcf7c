"""The built-in pattern cases under the toolkit's module name (``tensorflow_quantization.custom_qdq_cases``).

They are tf_bridge's own cases ([`tf_bridge.custom_qdq_cases`][]); what each one places, and where it
differs from the toolkit's, is listed on the migration page.
"""
from __future__ import annotations

from ..custom_qdq_cases import (BNQDQCase, CustomQDQInsertionCase, EfficientNetQDQCase, InceptionQDQCase,
                                MaxPoolQDQCase, MobileNetQDQCase, ResidualConnectionQDQCase, ResNetV1QDQCase,
                                ResNetV2QDQCase)

__all__ = [
    "CustomQDQInsertionCase", "ResidualConnectionQDQCase", "ResNetV1QDQCase", "ResNetV2QDQCase",
    "EfficientNetQDQCase", "MobileNetQDQCase", "InceptionQDQCase", "BNQDQCase", "MaxPoolQDQCase",
]
