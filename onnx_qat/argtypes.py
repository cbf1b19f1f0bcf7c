"""Option value parsers shared by the ``onnx-qat`` CLI and the scripts in ``tools/``.

Each returns a function for argparse's ``type=``; a bad value raises
``argparse.ArgumentTypeError``, which argparse turns into one line naming the option.
Imports nothing heavy (the CLI's ``--help`` must stay fast).
"""
from __future__ import annotations

import argparse
import math
from typing import Callable


def whole_number(low: int) -> Callable[[str], int]:
    """Parse a whole number >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
        return value
    return parse


def number_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """Parse a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        too_low = value <= low if low_open else value < low
        if not math.isfinite(value) or too_low or value > high:
            bracket = "(" if low_open else "["
            raise argparse.ArgumentTypeError(
                f"expected a number in {bracket}{low:g}, {high:g}], got {text!r}")
        return value
    return parse


#: A finite number > 0.
positive_number = number_in(0.0, math.inf, low_open=True)
#: Any finite number.
any_number = number_in(-math.inf, math.inf)
