"""How a model's inputs are laid out in the data: state feedback and batch axes.

* `DataLayout` ``(state={output: input}, batch_axis={input: axis})``, checked against a model
  by `DataLayout.check`.
* `with_layout` attaches a layout to any data source (`LaidOut`); the loaders
  ([`onnx_qat.load_data`][onnx_qat.io.data.load_data]) read it back with `split_layout`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import ConfigError


@dataclass(frozen=True)
class DataLayout:
    """How a model's inputs are laid out in the data (see the module docstring).

    Attributes:
        state: ``{output name: input name}``: each run's output becomes the next run's input.
        batch_axis: ``{input name: axis}`` for inputs whose batch axis is not the first.
    """

    state: Mapping[str, str] = field(default_factory=dict)
    batch_axis: Mapping[str, int] = field(default_factory=dict)

    @property
    def state_inputs(self) -> Tuple[str, ...]:
        """The inputs the state feeds, in the order given."""
        return tuple(self.state.values())

    def check(self, specs, outputs: Optional[Sequence[str]]) -> None:
        """Every name is one of the model's: state outputs (when ``outputs`` is known) and inputs,
        batch axes within the input's rank.

        Raises:
            ConfigError: one line naming the first name or axis that does not fit.
        """
        inputs = {s.name: s for s in specs}
        for out, inp in self.state.items():
            if outputs is not None and out not in outputs:
                raise ConfigError(f"state {out}={inp}: {out!r} is not an output of the model "
                                  f"(outputs: {', '.join(outputs)})")
            if inp not in inputs:
                raise ConfigError(f"state {out}={inp}: {inp!r} is not an input of the model "
                                  f"(inputs: {', '.join(inputs)})")
        if len(set(self.state.values())) != len(self.state):
            raise ConfigError("state: two outputs feed the same input")
        for name, axis in self.batch_axis.items():
            spec = inputs.get(name)
            if spec is None:
                raise ConfigError(f"batch axis {name}={axis}: {name!r} is not an input of the model "
                                  f"(inputs: {', '.join(inputs)})")
            if spec.shape is not None and not -len(spec.shape) <= axis < len(spec.shape):
                raise ConfigError(f"batch axis {name}={axis}: the input {spec.describe()} has no axis {axis}")

    def axis(self, spec) -> Optional[int]:
        """The batch axis of ``spec`` (the first unless declared; None for a 0-d or unknown-rank input)."""
        if not spec.shape:
            return None
        axis = self.batch_axis.get(spec.name, 0)
        return axis % len(spec.shape)


def make_layout(state=None, batch_axis=None) -> DataLayout:
    """A validated `DataLayout` from ``{output: input}`` and ``{input: axis}`` mappings."""
    state = dict(state or {})
    for out, inp in state.items():
        if not isinstance(out, str) or not isinstance(inp, str) or not out or not inp:
            raise ConfigError(f"state maps output names to input names (e.g. {{'stateN': 'state'}}), "
                              f"got {out!r}: {inp!r}")
    axes = dict(batch_axis or {})
    for name, axis in axes.items():
        if not isinstance(name, str) or isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise ConfigError(f"batch_axis maps input names to axes (e.g. {{'state': 1}}), "
                              f"got {name!r}: {axis!r}")
    return DataLayout(MappingProxyType(state), MappingProxyType({k: int(v) for k, v in axes.items()}))


class LaidOut:
    """A data source with its `DataLayout` (what `with_layout` returns)."""

    __slots__ = ("source", "layout")

    def __init__(self, source, layout: DataLayout):
        self.source, self.layout = source, layout


def with_layout(data, *, state=None, batch_axis=None):
    """``data`` as every loader reads it, with the given state feedback and batch axes.

    ``data`` unchanged when neither is given; ``None`` stays ``None``.
    """
    if data is None or (not state and not batch_axis):
        return data
    if isinstance(data, LaidOut):
        data = data.source
    return LaidOut(data, make_layout(state, batch_axis))


def split_layout(source) -> Tuple[object, DataLayout]:
    """``(source, layout)``: the layout `with_layout` attached (an empty one otherwise)."""
    if isinstance(source, LaidOut):
        return source.source, source.layout
    return source, DataLayout()



__all__ = ["DataLayout", "LaidOut", "make_layout", "split_layout", "with_layout"]
