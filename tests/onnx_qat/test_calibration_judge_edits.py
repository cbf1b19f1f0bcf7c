"""``auto``'s cheaper bookkeeping gives the numbers of the formulation it replaced, bit for bit:

* the judge model's weights folded, its activation scales made graph inputs and its activation zero
  points shared as edits before the insertion's one commit (`onnx_qat.calibration.choice.judge_model`):
  the same outputs, table by table, as the model committed first and folded and filtered after (the
  path before, rebuilt here);
* candidate tables holding the same ranges are not judged (`choice.choose`);
* every candidate range put on the FP16 grid at once (`onnx_qat.formats.scale_grid.fp16_grid_values`):
  the floats of `onnx_qat.formats.scale_grid.on_fp16_grid`, one by one;
* the percentiles read from the mse search's prefix sums, and those prefix sums written in place.
"""
from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.calibration import choice, collect
from onnx_qat.calibration.mse import moment_prefixes
from onnx_qat.calibration.percentile import percentile_rows
from onnx_qat.formats.scale_grid import fp16_grid_values, on_fp16_grid
from onnx_qat.runtime.chunked import ChunkedSession
from tests import builders
from tests.onnx_qat.test_calibration_judge_folding import fold_constant_dequantize


def _bits(values) -> list:
    return [struct.pack("<d", float(v)) for v in values]


# --------------------------------------------------------------------------- the FP16 grid
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # on_fp16_grid's
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("qmax", [127.0, 448.0])
def test_grid_of_many_ranges_is_on_fp16_grid_of_each(seed, qmax):
    rng = np.random.default_rng(seed)
    values = np.concatenate([
        10.0 ** rng.uniform(-45, 39, 20_000),  # float32's whole range and beyond it
        rng.uniform(0.0, 10.0, 2_000),
        (2.0 ** rng.integers(-30, 20, 500)) * qmax,  # scales that are FP16 values already
        np.nextafter((2.0 ** rng.integers(-30, 20, 500)) * qmax, np.inf),
        [1e-6, 65504.0 * qmax, 65504.0 * qmax * 1.001, 2.0 ** -24 * qmax, 2.0 ** -14 * qmax, 5e-324, 1e308],
    ]).tolist()
    got = fp16_grid_values(values, qmax)
    assert _bits(got) == _bits(on_fp16_grid(v, qmax) for v in values)
    assert sum(g != v for g, v in zip(got, values)) > 1000  # most ranges move onto the grid
    assert fp16_grid_values([], qmax) == []


@pytest.mark.parametrize("seed,scale", [(0, 1.0), (1, 1e-4), (2, 3e3)])
def test_collect_puts_every_candidate_on_the_grid_as_on_fp16_grid_does(seed, scale):
    """The ranges, both candidate tables and every tensor's options (with ``entropy``) of a grid
    calibration are ``on_fp16_grid`` of the same calibration's plain values (a zero range: of 1e-6)."""
    model = builders.residual_block_model(projection=True)
    data = {k: v * scale for k, v in builders.random_inputs(model, num=16, seed=seed).items()}
    dataset = onnx_qat.load_data(data, model)
    names = onnx_qat.place(model).activation_tensors()
    plain = collect(model, dataset, names, method="auto", progress=False, fp16_grid=False)
    grid = collect(model, dataset, names, method="auto", progress=False, fp16_grid=True)

    def on_grid(value):
        return on_fp16_grid(value if value > 0.0 else 1e-6, 127.0)

    assert list(grid.ranges) == list(plain.ranges)
    assert _bits(grid.ranges.values()) == _bits(on_grid(v) for v in plain.ranges.values())
    for table in ("max", "tensor"):
        expected = [on_grid(v) for v in plain.candidates[table].values()]
        assert _bits(grid.candidates[table].values()) == _bits(expected)
    for name, options in plain.options.items():
        assert list(grid.options[name]) == list(options) and "entropy" in options
        assert _bits(grid.options[name].values()) == _bits(on_grid(v) for v in options.values())
    assert grid.choices == plain.choices


# --------------------------------------------------------------------------- the searches' sums
def _histograms(seed: int, rows: int = 40, bins: int = 2048) -> np.ndarray:
    rng = np.random.default_rng(seed)
    decay = np.exp(-np.arange(bins) / rng.uniform(20, 900, (rows, 1)))
    counts = rng.poisson(rng.uniform(0, 50, (rows, 1)) * decay)
    counts[0] = 0
    counts[1, 7] = 123456789  # one spike
    return counts.astype(np.float64) * rng.uniform(0.3, 3.0, (rows, 1))  # re-binned counts are not integers


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefix_sums_and_percentiles_are_the_formulation_before(seed):
    counts = _histograms(seed)
    centers = np.arange(counts.shape[1], dtype=np.float64) + 0.5
    zero = np.zeros((counts.shape[0], 1))
    before = [np.concatenate([zero, np.cumsum(counts * centers ** p, axis=1)], axis=1) for p in (0, 1, 2)]
    now = moment_prefixes(counts)
    for old, new in zip(before, now):
        np.testing.assert_array_equal(new, old)
    widths = np.random.default_rng(seed).uniform(1e-6, 10.0, counts.shape[0])
    for percentile in (99.9, 99.99, 99.999, 50.0):
        np.testing.assert_array_equal(percentile_rows(counts, widths, percentile, cumulative=now[0][:, 1:]),
                                      percentile_rows(counts, widths, percentile))


# --------------------------------------------------------------------------- the judge model
def _judge_before(model, placement, table, **options):
    """The judge model as it was built before: committed first, then its constant weight
    DequantizeLinear folded, then the activation scales moved from the initializers to inputs."""
    from onnx_qat.graph.edit import GraphEdit
    from onnx_qat.insertion.inserter import insert_qdq_pairs
    from onnx_qat.scales import ScaleTable

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    edit = GraphEdit(copy)
    inserted = insert_qdq_pairs(edit, replace(placement, subgraphs=()), ScaleTable(dict(table)),
                                options.get("target", "tensorrt"), precision=options.get("precision", "int8"))
    judge = edit.commit()
    fold_constant_dequantize(judge)
    nodes = {n.name: n for n in judge.graph.node if n.op_type == "QuantizeLinear"}
    scale_inputs = {r["tensor"]: nodes[r["quantize_node"]].input[1] for r in inserted.activations}
    names = set(scale_inputs.values())
    kept = [t for t in judge.graph.initializer if t.name not in names]
    del judge.graph.initializer[:]
    judge.graph.initializer.extend(kept)
    judge.graph.input.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [])
                             for n in sorted(names))
    return judge, scale_inputs


def _captured(monkeypatch, model, data, **options):
    seen = []
    real = choice.choose

    def recording(model, *args, **kwargs):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)  # the rewrite edits its model after the choice
        seen.append(((copy, *args), kwargs))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(choice, "choose", recording)
    onnx_qat.quantize(model, data=data, method="auto", progress=False, **options)
    monkeypatch.undo()
    assert len(seen) == 1
    return seen[0]


CASES = [
    ("residual", lambda: builders.residual_block_model(projection=True), {}, 0, 1.0),
    ("residual-scaled", lambda: builders.residual_block_model(projection=True), {}, 1, 1e-3),
    ("mobilenet", lambda: builders.mobilenet_v2_model(size=16, batch=1), {}, 2, 1.0),
    ("mobilenet-cpu", lambda: builders.mobilenet_v2_model(size=16, batch=1), {"target": "ort-cpu"}, 3, 1.0),
    ("mlp", lambda: builders.mlp_model(), {}, 4, 50.0),
    ("transformer", lambda: builders.transformer_block_model(), {}, 5, 1.0),
    ("conv-fp8", lambda: builders.conv_bn_relu_model(), {"precision": "fp8"}, 6, 1.0),
    ("residual-chain", lambda: builders.residual_chain_model(40), {}, 7, 1.0),
]


@pytest.mark.parametrize("name,build,options,seed,scale", CASES, ids=[c[0] for c in CASES])
def test_judge_model_runs_as_the_model_committed_then_folded(monkeypatch, name, build, options, seed, scale):
    """Every output of the judge model, for both tables on every check batch, is the output of the
    judge model built the way before, bit for bit; it holds no integer weight nor scale initializer,
    and one zero-point initializer per distinct value."""
    model = build()
    data = {k: v * scale for k, v in builders.random_inputs(model, num=12, seed=seed).items()}
    (proto, placement, calibration), kwargs = _captured(monkeypatch, model, data, **options)
    kw = {k: v for k, v in kwargs.items() if k in ("target", "precision", "block_size")}
    tables = calibration.candidates
    now, now_inputs = choice.judge_model(proto, placement, tables["max"], **kw)
    before, before_inputs = _judge_before(proto, placement, tables["max"], **kw)
    assert sorted(now_inputs) == sorted(before_inputs)
    assert [n.op_type for n in now.graph.node] == [n.op_type for n in before.graph.node]
    initializers = {t.name for t in now.graph.initializer}
    assert not initializers & set(before_inputs.values())  # the scales are inputs only
    assert not any(t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8) and len(t.dims) > 1
                   for t in now.graph.initializer)  # every integer weight was folded and left out
    zero_points = {n.input[2] for n in now.graph.node if n.op_type == "QuantizeLinear"}
    values = {(t.data_type, t.raw_data) for t in now.graph.initializer if t.name in zero_points}
    assert len(zero_points) == len(values) <= 2  # one initializer per distinct zero point
    outputs = list(calibration.reference)
    sessions = ChunkedSession(now, outputs), ChunkedSession(before, outputs)
    precision = kw.get("precision", "int8")
    for table in tables.values():
        feeds = (choice._scale_feeds(placement, table, now_inputs, precision),
                 choice._scale_feeds(placement, table, before_inputs, precision))
        for feed in calibration.check_feeds:
            got, want = (s.run(outputs, {**feed, **scales}) for s, scales in zip(sessions, feeds))
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)


def test_identical_tables_are_not_judged(monkeypatch):
    """When ``max`` and the per-tensor table hold the same ranges, no judge model is built and ``max``
    is kept (the runs would be the same); when they differ, both are judged."""
    model = builders.residual_block_model(projection=True)
    data = builders.random_inputs(model, num=12, seed=0)
    (proto, placement, calibration), kwargs = _captured(monkeypatch, model, data)
    same = replace(calibration, candidates={"max": dict(calibration.candidates["max"]),
                                            "tensor": dict(calibration.candidates["max"])})

    def refuse(*args, **kwargs):
        raise AssertionError("a judge model was built")

    monkeypatch.setattr(choice, "judge_model", refuse)
    assert choice.choose(proto, placement, same) == ("max", {}, "")
    monkeypatch.undo()
    halved = {k: v * 0.5 for k, v in calibration.candidates["max"].items()}
    differ = replace(calibration, candidates={"max": dict(calibration.candidates["max"]), "tensor": halved})
    best, cosines, note = choice.choose(proto, placement, differ)
    assert note == ""  # 12 samples: the paired rule decides
    assert set(cosines) == {"max", "tensor"} and cosines["max"] > cosines["tensor"] and best == "max"


@pytest.mark.parametrize("chunk", [3, 2000])
@pytest.mark.parametrize("name,build,options,seed,scale", CASES, ids=[c[0] for c in CASES])
def test_bound_scales_give_the_fed_outputs(monkeypatch, name, build, options, seed, scale, chunk):
    """`ChunkedSession.bind` (a table's scales bound once through onnxruntime's IOBinding, as `choose`
    runs them) gives the outputs of the same scales fed with every run, bit for bit, for each table
    in turn and again after the other table was bound; a feed of the other inputs suffices."""
    model = build()
    data = {k: v * scale for k, v in builders.random_inputs(model, num=12, seed=seed).items()}
    (proto, placement, calibration), kwargs = _captured(monkeypatch, model, data, **options)
    kw = {k: v for k, v in kwargs.items() if k in ("target", "precision", "block_size")}
    judge, inputs = choice.judge_model(proto, placement, calibration.candidates["max"], **kw)
    outputs = list(calibration.reference)
    bound, fed = (ChunkedSession(judge, outputs, chunk_nodes=chunk) for _ in range(2))
    precision = kw.get("precision", "int8")
    tables = [calibration.candidates[t] for t in ("max", "tensor", "max")]
    assert tables[0] != tables[1]
    for table in tables:
        scales = choice._scale_feeds(placement, table, inputs, precision)
        bound.bind(scales)
        for feed in calibration.check_feeds:
            got, want = bound.run(outputs, feed), fed.run(outputs, {**feed, **scales})
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
    assert any(piece.bindings for piece in bound.pieces) and not any(piece.bindings for piece in fed.pieces)


@pytest.mark.parametrize("name,build,options,seed,scale", [CASES[0], CASES[3], CASES[6]],
                         ids=["residual", "mobilenet-cpu", "conv-fp8"])
def test_judge_model_from_pairs_made_one_by_one_is_the_same_model(monkeypatch, name, build, options, seed,
                                                                   scale):
    """The inserter's ``scale_inputs`` pairs made one at a time (names its templates cannot write) give
    the judge model made from its templates at once, byte for byte, with the same scale inputs; each
    pair reads its own input and every QuantizeLinear one zero point per value."""
    from onnx_qat.insertion import inserter

    model = build()
    data = {k: v * scale for k, v in builders.random_inputs(model, num=12, seed=seed).items()}
    (proto, placement, calibration), kwargs = _captured(monkeypatch, model, data, **options)
    kw = {k: v for k, v in kwargs.items() if k in ("target", "precision", "block_size")}
    batched, batched_inputs = choice.judge_model(proto, placement, calibration.candidates["max"], **kw)
    monkeypatch.setattr(inserter, "_template_names", lambda names: False)
    one, one_inputs = choice.judge_model(proto, placement, calibration.candidates["max"], **kw)
    assert one_inputs == batched_inputs and len(set(one_inputs.values())) == len(one_inputs) >= 1
    assert one.SerializeToString() == batched.SerializeToString()
    quantize = [n for n in one.graph.node if n.op_type == "QuantizeLinear"]
    assert {n.input[1] for n in quantize} == set(one_inputs.values())
    assert len({n.input[2] for n in quantize}) == 1


@pytest.mark.parametrize("name,build,options,seed,scale", [CASES[0], CASES[2], CASES[4]],
                         ids=["residual", "mobilenet", "mlp"])
def test_judge_model_folds_the_weights_the_inserter_queued(monkeypatch, name, build, options, seed, scale):
    """Weights inserted by the inserter (as bytes, per channel) rather than dequantized in batches are
    folded from their queued DequantizeLinear: the judge model then holds no integer weight and no
    weight DequantizeLinear, and runs as the model committed then folded, bit for bit."""
    model = build()
    data = {k: v * scale for k, v in builders.random_inputs(model, num=12, seed=seed).items()}
    (proto, placement, calibration), kwargs = _captured(monkeypatch, model, data, **options)
    monkeypatch.setattr(choice, "_dequantized_weights", lambda *args: {})
    table = calibration.candidates["max"]
    now, now_inputs = choice.judge_model(proto, placement, table)
    before, before_inputs = _judge_before(proto, placement, table)
    assert placement.weights and sorted(now_inputs) == sorted(before_inputs)
    assert [n.op_type for n in now.graph.node] == [n.op_type for n in before.graph.node]
    assert sum(n.op_type == "DequantizeLinear" for n in now.graph.node) == len(placement.activations)
    assert not any(t.data_type == onnx.TensorProto.INT8 and len(t.dims) > 1 for t in now.graph.initializer)
    outputs = list(calibration.reference)
    sessions = ChunkedSession(now, outputs), ChunkedSession(before, outputs)
    for table in calibration.candidates.values():
        feeds = (choice._scale_feeds(placement, table, now_inputs, "int8"),
                 choice._scale_feeds(placement, table, before_inputs, "int8"))
        for feed in calibration.check_feeds:
            got, want = (s.run(outputs, {**feed, **scales}) for s, scales in zip(sessions, feeds))
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a, b)
