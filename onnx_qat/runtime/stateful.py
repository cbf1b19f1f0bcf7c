"""Stateful runs: each run's state outputs become the next run's state inputs.

`carry_state` wraps anything with ``run(names, feed)`` (an onnxruntime session, calibration's
branch runner, the accuracy tools' gated session) for data whose layout declares a state
(`onnx_qat.io.feeds.DataLayout`, ``state={"stateN": "state"}``). The wrapper fetches the state
outputs along with what the caller asks for and fills each state input a feed omits with the
previous run's output; a feed that gives the state input (the first one, or a new sequence's) sets it.
Each model carries its own state: a quantized model is fed its own state, not the float model's.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..errors import ConfigError, DataError


class StateCarrier:
    """``session`` whose runs carry ``state`` (``{output: input}``) from one feed to the next.

    Other attributes (``get_inputs``, ``get_outputs``...) are the wrapped session's.
    """

    def __init__(self, session, state: Mapping[str, str]):
        self.session = session
        self.state = dict(state)
        self._carried: Optional[Dict[str, np.ndarray]] = None
        self.last_given: Dict[str, np.ndarray] = {}
        outputs = getattr(session, "get_outputs", None)
        if outputs is not None:
            names = [o.name for o in outputs()]
            for out, inp in self.state.items():
                if out not in names:
                    raise ConfigError(f"state {out}={inp}: {out!r} is not an output of the model "
                                      f"(outputs: {', '.join(names)})")

    def __getattr__(self, name):
        return getattr(self.session, name)

    def reset(self) -> None:
        """Forget the carried state (the next feed must give it)."""
        self._carried = None

    def run(self, names: Sequence[str], feed: Mapping[str, np.ndarray], *args) -> List:
        """``session.run(names, feed)`` with the state inputs the feed omits taken from the last run."""
        fetch = list(names) + [o for o in self.state if o not in names]
        given = dict(feed)
        for out, inp in self.state.items():
            if inp in given:
                continue
            if self._carried is None:
                raise DataError(f"state input {inp!r} is missing from the first feed: it gives the initial "
                                "state")
            given[inp] = self._carried[out]
        self.last_given = given  # the feed as run: observers of a state input read it here
        values = self.session.run(fetch, given, *args)
        got = dict(zip(fetch, values))
        self._carried = {out: np.asarray(got[out]) for out in self.state}
        return list(values[:len(names)])


def carry_state(session, dataset_or_state):
    """``session`` wrapped in a `StateCarrier` when the data (a Dataset, or a ``{output: input}``
    mapping) declares a state; ``session`` itself otherwise."""
    state = getattr(dataset_or_state, "state", dataset_or_state) or {}
    return StateCarrier(session, state) if state else session


def state_outputs(dataset) -> tuple:
    """The outputs a stateful dataset's runs must fetch (empty without a state)."""
    return tuple(getattr(dataset, "state", None) or ())


__all__ = ["StateCarrier", "carry_state", "state_outputs"]
