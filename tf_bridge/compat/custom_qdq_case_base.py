"""``CustomQDQInsertionCase`` where the toolkit keeps it
(``tensorflow_quantization.custom_qdq_case_base``)."""
from __future__ import annotations

from ..case_base import CustomQDQInsertionCase

__all__ = ["CustomQDQInsertionCase"]
