"""Per-channel means of activations over the calibration data, for rule CPU7 of the ``ort-cpu`` form
(`onnx_qat.insertion.ort_cpu_bias`)."""
from __future__ import annotations

from typing import Dict, Iterable

import numpy as np


def channel_means(model, data, tensors: Iterable[str], *, axis: int = 1, batch_size: int = 16,
                  threads=None) -> Dict[str, np.ndarray]:
    """``{tensor: mean of each channel}`` of ``tensors`` of the float ``model`` (a ModelProto, not
    modified) over every sample of ``data`` (anything `onnx_qat.io.data.load_data` reads), the
    channel on ``axis`` (1: NCHW Conv inputs), every other axis averaged. One onnxruntime session,
    graph optimizations on, the tensors added as outputs of its own copy of the graph."""
    from ..io.data import load_data
    from ..runtime.sessions import make_session

    names = list(dict.fromkeys(tensors))
    if not names:
        return {}
    dataset = load_data(data, model, what="calibration data")
    session = make_session(model, extra_outputs=names, spin=False, threads=threads)
    inputs = {i.name for i in session.get_inputs()}
    sums: Dict[str, np.ndarray] = {}
    counts: Dict[str, int] = {}
    for feed in dataset.batches(batch_size):
        given = {k: v for k, v in feed.items() if k in inputs}
        for name, value in zip(names, session.run(names, given)):
            value = np.asarray(value, np.float64)
            if value.ndim <= axis:
                continue
            rows = np.moveaxis(value, axis, -1).reshape(-1, value.shape[axis])
            sums[name] = sums.get(name, 0.0) + rows.sum(axis=0)
            counts[name] = counts.get(name, 0) + rows.shape[0]
    return {name: sums[name] / counts[name] for name in sums if counts[name]}


__all__ = ["channel_means"]
