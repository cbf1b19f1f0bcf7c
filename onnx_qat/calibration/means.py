"""Per-sample statistics of activations over the calibration data, for rule CPU7 of the ``ort-cpu``
form (`onnx_qat.insertion.ort_cpu_bias`)."""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Tuple

import numpy as np


def per_sample(model, data, reducers: Mapping[str, Tuple[str, Callable[[np.ndarray], np.ndarray]]], *,
               batch_size: int = 16, threads=None) -> Dict[str, np.ndarray]:
    """``{key: reduce(sample) for every sample, stacked}`` for ``reducers`` ``{key: (tensor, reduce)}``:
    each tensor of the float ``model`` (a ModelProto, not modified) is computed on every sample of
    ``data`` (anything `onnx_qat.io.data.load_data` reads) and each of its samples (the first axis
    split off) goes through ``reduce``. One onnxruntime session, graph optimizations on, the tensors
    added as outputs of its own copy of the graph. A key whose ``reduce`` returns None is left out."""
    from ..io.data import load_data
    from ..runtime.sessions import make_session

    names = sorted({tensor for tensor, _ in reducers.values()})
    if not names:
        return {}
    dataset = load_data(data, model, what="calibration data")
    session = make_session(model, extra_outputs=names, spin=False, threads=threads)
    inputs = {i.name for i in session.get_inputs()}
    found: Dict[str, list] = {key: [] for key in reducers}
    for feed in dataset.batches(batch_size):
        given = {k: v for k, v in feed.items() if k in inputs}
        values = dict(zip(names, session.run(names, given)))
        for key, (tensor, reduce) in reducers.items():
            if found[key] is None:
                continue
            for sample in np.asarray(values[tensor]):
                reduced = reduce(np.asarray(sample, np.float64))
                if reduced is None:
                    found[key] = None
                    break
                found[key].append(reduced)
    return {key: np.stack(v) for key, v in found.items() if v}


__all__ = ["per_sample"]
