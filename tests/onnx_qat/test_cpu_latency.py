"""Latency-aware placement for ``ort-cpu`` (rule CPU3, :mod:`onnx_qat.placement.cpu_latency`).

The decisions are tested with latency profiles written here (given times, so nothing depends on this
machine's speed); one test measures for real and checks only what the profile holds, never a time."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.cli import main
from onnx_qat.errors import ConfigError, PlacementError
from onnx_qat.graph.index import GraphIndex
from onnx_qat.placement import cpu_latency as L
from tests import builders as B


def _slower_ok(profile) -> L.LatencyOptions:
    """Latency options with ``profile`` that write the model even when it times slower than FP32 at the end
    (``allow_slower``): the tests using them check other things, on real timings of a small net, which
    a loaded machine can put either side of FP32's (the refusal has tests of its own, on given timings)."""
    return L.LatencyOptions(profile=str(profile), allow_slower=True)


def _net(seed: int = 0) -> onnx.ModelProto:
    """input [1,16,12,12] -> ``c1`` (3x3) -> ``r1`` -> ``dw`` (3x3 depthwise) -> ``r2`` -> ``c2`` (1x1)
    -> ``r3`` -> GlobalAveragePool -> Flatten -> ``fc`` (MatMul + ``fc_bias`` Add) -> output."""
    b = B.GraphBuilder("latency_net", seed)
    x = b.input("input", [1, 16, 12, 12])
    y = b.relu(b.conv(x, 16, 32, "c1"), "r1")
    y = b.relu(b.conv(y, 32, 32, "dw", group=32), "r2")
    y = b.relu(b.conv(y, 32, 32, "c2", k=1), "r3")
    y = b.node("Flatten", [b.node("GlobalAveragePool", [y], name="gap")], name="flat")
    y = b.linear(y, 32, 10, "fc")
    b.nodes[-1].output[0] = "output"
    b.output("output")
    return b.build()


def _data(seed: int = 1):
    return {"input": np.random.default_rng(seed).uniform(0, 4, (4, 16, 12, 12)).astype(np.float32)}


def _profile(model, path, slow=(), threads: int = 0, machine=None, factor: float = 2.0):
    """A profile file with every site kind of ``model``: the kinds of the nodes in ``slow`` take
    ``factor`` x longer in integer than in float, the others half as long."""
    index = GraphIndex(model)
    placement = onnx_qat.place(model, target="ort-cpu")
    sites = L.sites_of(index, placement, L.input_shapes(model, 1))
    entries = {}
    for site in sites:
        entries[site.kind] = ({"float_us": 100.0, "int_us": 100.0 * factor} if site.node in slow
                              else {"float_us": 100.0, "int_us": 50.0})
    path.write_text(json.dumps({"format": L.PROFILE_FORMAT, "version": L.PROFILE_VERSION,
                                "machine": machine or L.machine_key(threads), "sites": entries}))
    return {s.node for s in sites}


def test_sites_are_the_quantized_weighted_ops_with_their_shapes():
    model = _net()
    sites = L.sites_of(GraphIndex(model), onnx_qat.place(model, target="ort-cpu"), L.input_shapes(model, 1))
    assert [s.node for s in sites] == ["c1", "dw", "c2", "fc"]
    dw = next(s for s in sites if s.node == "dw")
    assert dw.spec["x"] == [1, 32, 12, 12] and dw.spec["w"] == [32, 1, 3, 3]
    assert dw.spec["attrs"]["group"] == 32
    assert L.input_shapes(model, 8)["input"] == (1, 16, 12, 12)  # a fixed batch stays as declared


def _symbolic_net() -> onnx.ModelProto:
    """`_net` with a symbolic batch, height and width (as detectors and text recognizers declare them)."""
    model = _net()
    dims = model.graph.input[0].type.tensor_type.shape.dim
    for position, name in ((0, "N"), (2, "H"), (3, "W")):
        dims[position].Clear()
        dims[position].dim_param = name
    return model


def test_symbolic_image_sizes_are_timed_at_the_data_size_not_one():
    """A model whose height and width are symbolic is timed at one sample's size (the calibration data's),
    not at 1 x 1: without the data's size a detector's sites were timed on 1 x 1 images (or not at all),
    and its placement said nothing of its speed at the size it runs at."""
    model = _symbolic_net()
    data = {"input": np.random.default_rng(0).uniform(0, 4, (3, 16, 20, 28)).astype(np.float32)}
    samples = L.sample_shapes(data, model)
    assert samples == {"input": (1, 16, 20, 28)}
    assert L.input_shapes(model, 8, samples)["input"] == (8, 16, 20, 28)
    assert L.input_shapes(model, 8)["input"] == (8, 16, 1, 1)  # no data: as before
    placement = onnx_qat.place(model, target="ort-cpu")
    sites = L.sites_of(GraphIndex(model), placement, L.input_shapes(model, 2, samples))
    dw = next(s for s in sites if s.node == "dw")
    assert dw.spec["x"] == [2, 32, 20, 28]
    feeds = L.timing_feeds(model, 4, samples)
    assert feeds["input"].shape == (4, 16, 20, 28)


def test_a_stream_of_feeds_is_not_read_ahead_for_its_shapes():
    """`sample_shapes` leaves a one-shot stream of feeds unread (calibration reads it later)."""
    model = _symbolic_net()
    rng = np.random.default_rng(1)
    taken = []

    def feeds():
        for _ in range(2):
            taken.append(1)
            yield {"input": rng.uniform(0, 4, (1, 16, 20, 28)).astype(np.float32)}

    assert L.sample_shapes(feeds(), model) == {}
    assert taken == []


def test_quantize_times_a_symbolic_model_at_its_data_size(tmp_path):
    """End to end: the sites of the symbolic-size model are looked up at the data's height and width (a
    profile holding exactly those kinds, every site faster in integer, is used without measuring
    anything: kinds at 1 x 1 would have been measured), and the whole model is timed."""
    model = _symbolic_net()
    data = {"input": np.random.default_rng(2).uniform(0, 4, (4, 16, 20, 28)).astype(np.float32)}
    profile = tmp_path / "profile.json"
    shapes = L.input_shapes(model, 1, L.sample_shapes(data, model))
    sites = L.sites_of(GraphIndex(model), onnx_qat.place(model, target="ort-cpu"), shapes)
    kinds = [s.kind for s in sites]
    assert all("20, 28" in s.kind or "20,28" in s.kind or s.node == "fc" for s in sites), kinds
    profile.write_text(json.dumps({"format": L.PROFILE_FORMAT, "version": L.PROFILE_VERSION,
                                   "machine": L.machine_key(0),
                                   "sites": {s.kind: {"float_us": 100.0, "int_us": 50.0} for s in sites}}))
    result = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False,
                               latency=L.LatencyOptions(profile=str(profile), rounds=1, allow_slower=True))
    assert result.latency["kinds_measured"] == 0
    assert {r["node"] for r in result.latency["sites"]} == {"c1", "dw", "c2", "fc"}
    assert result.latency["whole_model"]["timed"] is True
    assert onnx_qat.check(result.model, target="ort-cpu").passed


def _profile_at(model, path, shapes) -> list:
    """A profile holding exactly the site kinds of ``model`` at the input ``shapes`` (every site faster in
    integer), so that a run timing them at other sizes would have to measure; the sites' nodes."""
    placement = onnx_qat.place(model, target="ort-cpu")
    sites = L.sites_of(GraphIndex(model), placement, L.input_shapes(model, 1, shapes))
    path.write_text(json.dumps({"format": L.PROFILE_FORMAT, "version": L.PROFILE_VERSION,
                                "machine": L.machine_key(0),
                                "sites": {s.kind: {"float_us": 100.0, "int_us": 50.0} for s in sites}}))
    return [s.node for s in sites]


def _computed_reshape_net() -> onnx.ModelProto:
    """input [N, 16, H, W] -> ``c1`` -> ``r1`` -> Reshape to [N, 32, H*W] -> Transpose -> ``fc`` (MatMul +
    bias): the sequence length H*W is computed from the Shape through a float product, as exporters of
    sequence models write such arithmetic; onnx shape inference does not follow it, so ``fc``'s input
    shape is unknown to it."""
    b = B.GraphBuilder("computed_reshape", 0)
    x = b.input("input", ["N", 16, "H", "W"])
    y = b.relu(b.conv(x, 16, 32, "c1"), "r1")
    shape = b.node("Shape", [y], name="shape")
    hw = b.node("Slice", [shape, b.const("two", np.array([2], np.int64)),
                          b.const("four", np.array([4], np.int64))], name="hw")
    product = b.node("ReduceProd", [b.node("Cast", [hw], name="hw_float", to=onnx.TensorProto.FLOAT)],
                     name="seq_float", keepdims=1)
    seq = b.node("Cast", [product], name="seq", to=onnx.TensorProto.INT64)
    n = b.node("Slice", [shape, b.const("zero", np.array([0], np.int64)),
                         b.const("one", np.array([1], np.int64))], name="n")
    target = b.node("Concat", [n, b.const("c32", np.array([32], np.int64)), seq], name="target", axis=0)
    tokens = b.node("Transpose", [b.node("Reshape", [y, target], name="flat")], name="tokens", perm=[0, 2, 1])
    b.linear(tokens, 32, 24, "fc")
    b.nodes[-1].output[0] = "output"
    b.output("output")
    return b.build()


def test_sites_shape_inference_leaves_unknown_are_timed_at_the_shapes_of_one_run(tmp_path):
    """A quantized MatMul behind a Reshape to a computed shape (PP-OCRv4's recognizer has 12 such sites)
    was quantized untimed, with a warning; its input shape is now taken from one run of the float model
    on the timing inputs, so it is timed (here: looked up in a profile holding exactly its kind at
    [1, 60, 32], the data's 6 x 10 image flattened) like the others."""
    model = _computed_reshape_net()
    data = {"input": np.random.default_rng(3).uniform(0, 4, (4, 16, 6, 10)).astype(np.float32)}
    samples = L.sample_shapes(data, model)
    shapes = L.input_shapes(model, 1, samples)
    assert "tokens_out" not in shapes  # the premise: onnx shape inference stops at the Reshape
    observed = L.observed_shapes(model, 1, samples, ["tokens_out"])
    assert observed == {"tokens_out": (1, 60, 32)}
    placement = onnx_qat.place(model, target="ort-cpu")
    sites = L.sites_of(GraphIndex(model), placement, {**shapes, **observed})
    assert [s.node for s in sites] == ["c1", "fc"]
    assert next(s for s in sites if s.node == "fc").spec["x"] == [1, 60, 32]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"format": L.PROFILE_FORMAT, "version": L.PROFILE_VERSION,
                                   "machine": L.machine_key(0),
                                   "sites": {s.kind: {"float_us": 100.0, "int_us": 50.0} for s in sites}}))
    result = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False,
                               latency=L.LatencyOptions(profile=str(profile), rounds=1, allow_slower=True))
    assert result.latency["kinds_measured"] == 0  # fc at [1, 60, 32] found in the profile: nothing measured
    assert {r["node"] for r in result.latency["sites"]} == {"c1", "fc"}
    assert not [n for n in result.placement.notes if "untimed" in n]
    B.assert_check_clean(result.model, target="ort-cpu")
    feeds = {"input": data["input"][:1]}
    assert B.cosine(B.run(model, feeds)[0], B.run_optimized(result.model, feeds)) > 0.99


def test_a_model_that_does_not_run_on_timing_inputs_leaves_its_sites_untimed():
    """`observed_shapes` gives nothing (the sites then stay untimed, with the note) where the timing
    inputs cannot be made or the model does not run on them."""
    model = _computed_reshape_net()
    assert L.observed_shapes(model, 1, {"input": (1, 16, 6, 10)}, []) == {}
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    next(n for n in broken.graph.node if n.name == "target").input[1] = "two"  # [N, 2, H*W]: no reshape
    assert L.observed_shapes(broken, 1, {"input": (1, 16, 6, 10)}, ["tokens_out"]) == {}
    ints = onnx.ModelProto()
    ints.CopyFrom(model)
    ints.graph.input[0].type.tensor_type.elem_type = onnx.TensorProto.INT64
    assert L.observed_shapes(ints, 1, {"input": (1, 16, 6, 10)}, ["tokens_out"]) == {}


def _token_net() -> onnx.ModelProto:
    """input_ids int64 [N, 8] -> Gather of a [50, 32] embedding -> ``fc1`` (MatMul + bias) -> Relu ->
    ``fc2`` -> output: a model whose input is not float32 (token ids; Magika reads bytes as int32)."""
    b = B.GraphBuilder("tokens", 0)
    ids = b.input("input_ids", ["N", 8], dtype=onnx.TensorProto.INT64)
    x = b.node("Gather", [b.weight("embedding", [50, 32], std=1.0), ids], name="embed", axis=0)
    y = b.relu(b.linear(x, 32, 16, "fc1"), "r1")
    b.linear(y, 16, 4, "fc2")
    b.nodes[-1].output[0] = "output"
    b.output("output")
    return b.build()


def test_inputs_other_than_float32_are_timed_on_a_sample_of_the_data(tmp_path):
    """The whole model was not timed when an input was not float32 ('input ... is not a float32 tensor
    of known shape': Magika, any model reading token ids), so the guard that the written model is faster
    than FP32 never ran there. Such an input now takes one sample's values from the data, repeated along
    its batch dimension (random ids would say nothing of what a Gather reads)."""
    model = _token_net()
    ids = np.random.default_rng(4).integers(0, 50, (6, 8)).astype(np.int64)
    feed = L.sample_feed({"input_ids": ids}, model)
    assert list(feed) == ["input_ids"] and np.array_equal(feed["input_ids"], ids[:1])
    feeds = L.timing_feeds(model, 3, {"input_ids": (1, 8)}, feed)
    assert feeds["input_ids"].shape == (3, 8) and (feeds["input_ids"] == ids[0]).all()
    assert "no sample" in L.timing_feeds(model, 3, {"input_ids": (1, 8)})
    assert "no sample" in L.timing_feeds(model, 3, {"input_ids": (1, 8)},
                                          {"input_ids": ids[:1].astype(np.int32)})  # another type
    profile = tmp_path / "profile.json"
    assert _profile_at(model, profile, {}) == ["fc1", "fc2"]
    result = onnx_qat.quantize(model, data={"input_ids": ids}, method="max", target="ort-cpu", progress=False,
                               latency=L.LatencyOptions(profile=str(profile), rounds=1, allow_slower=True))
    whole = result.latency["whole_model"]
    assert whole["timed"] is True and whole["fp32_ms"] > 0, whole
    B.assert_check_clean(result.model, target="ort-cpu")
    feeds = {"input_ids": ids[:2]}
    assert B.cosine(B.run(model, feeds)[0], B.run_optimized(result.model, feeds)) > 0.99


def _scalar_input_net() -> onnx.ModelProto:
    """input float [N, 16] -> ``fc1`` -> Relu -> ``fc2``, scaled by a 0-d int64 input ``sr`` / 16000 (as
    silero-vad takes its sample rate) -> output."""
    b = B.GraphBuilder("scalar_input", 0)
    x = b.input("input", ["N", 16])
    sr = b.input("sr", [], dtype=onnx.TensorProto.INT64)
    y = b.linear(b.relu(b.linear(x, 16, 32, "fc1"), "r1"), 32, 8, "fc2")
    rate = b.node("Div", [b.node("Cast", [sr], name="sr_float", to=onnx.TensorProto.FLOAT),
                          b.const("rate", np.array(16000.0, np.float32))], name="rate_div")
    b.node("Mul", [y, rate], outputs="output", name="scaled")
    b.output("output")
    return b.build()


def test_a_scalar_input_and_a_directory_of_feeds_are_timed(tmp_path):
    """A 0-d input (silero-vad's sample rate) had no known shape for the timing (`input_shapes` kept only
    tensors of rank >= 1), and data given as a directory of feeds gave no sample at all: the whole model
    was not timed. A declared scalar now has the shape (), and the first feed of a directory or list of
    feeds (which can be read again) is the sample; an iterator is still not read ahead."""
    model = _scalar_input_net()
    assert L.input_shapes(model, 1)["sr"] == ()
    rng = np.random.default_rng(5)
    folder = tmp_path / "feeds"
    folder.mkdir()
    chunks = [rng.standard_normal((1, 16)).astype(np.float32) for _ in range(4)]
    for i, chunk in enumerate(chunks):
        np.savez(folder / f"{i:02d}.npz", input=chunk, sr=np.array(16000, np.int64))
    feed = L.sample_feed(str(folder), model)
    assert np.array_equal(feed["input"], chunks[0]) and feed["sr"].shape == () and int(feed["sr"]) == 16000
    listed = L.sample_feed([{"input": c, "sr": np.array(8000, np.int64)} for c in chunks], model)
    assert int(listed["sr"]) == 8000
    feeds = L.timing_feeds(model, 2, {k: v.shape for k, v in feed.items()}, feed)
    assert feeds["input"].shape == (2, 16) and feeds["sr"].shape == () and int(feeds["sr"]) == 16000
    profile = tmp_path / "profile.json"
    assert _profile_at(model, profile, {}) == ["fc1", "fc2"]
    result = onnx_qat.quantize(model, data=str(folder), method="max", target="ort-cpu", progress=False,
                               latency=L.LatencyOptions(profile=str(profile), rounds=1, allow_slower=True))
    whole = result.latency["whole_model"]
    assert whole["timed"] is True, whole
    B.assert_check_clean(result.model, target="ort-cpu")


def test_timing_sizes_come_from_the_options_the_data_or_the_table():
    model = _symbolic_net()
    given, data, recorded = {"input": (1, 16, 40, 56)}, {"input": (1, 16, 20, 28)}, {"input": (1, 16, 8, 8)}
    assert L.timing_sizes(model, given, data, recorded) == given
    assert L.timing_sizes(model, None, data, recorded) == data
    assert L.timing_sizes(model, None, {}, recorded) == recorded
    assert L.unsized_dimensions(model, {}) == ["input (H, W)"] and L.unsized_dimensions(model, data) == []
    for shapes, match in (({"image": (1, 16, 8, 8)}, "no such input"),
                          ({"input": (1, 16, 8)}, "does not fit"),
                          ({"input": (1, 3, 8, 8)}, r"does not fit the input's shape \[N, 16, H, W\]")):
        with pytest.raises(ConfigError, match=match):
            L.timing_sizes(model, shapes)
    with pytest.raises(ConfigError, match="whole numbers >= 1"):
        L.LatencyOptions.resolve(L.LatencyOptions(shapes={"input": (1, 16, 0, 8)}))


def test_a_table_calibrated_for_ort_cpu_records_the_size_quantize_times_at(tmp_path):
    """``calibrate --target ort-cpu`` then ``quantize --scales ... --latency`` (the flow calibrate's own
    summary suggests) timed a detector-like model whose image size is symbolic on 1 x 1 images (PP-OCRv4's
    detector: a "2.96x FP32" that was 1.08x at 320 x 320): the table now records one sample's input shapes
    and the rewrite from it times the sites there (a profile holding exactly those kinds: nothing measured).
    Without recorded sizes a note says the dimensions were timed at 1."""
    model = _symbolic_net()
    data = {"input": np.random.default_rng(6).uniform(0, 4, (4, 16, 20, 28)).astype(np.float32)}
    table = onnx_qat.calibrate(model, data, method="max", target="ort-cpu", progress=False)
    assert json.loads(table.metadata[L.INPUT_SHAPES_KEY]) == {"input": [1, 16, 20, 28]}
    assert L.INPUT_SHAPES_KEY not in onnx_qat.calibrate(model, data, method="max", progress=False).metadata
    profile = tmp_path / "profile.json"
    _profile_at(model, profile, {"input": (1, 16, 20, 28)})
    result = onnx_qat.quantize(model, scales=table, target="ort-cpu", progress=False,
                               latency=L.LatencyOptions(profile=str(profile), rounds=1, allow_slower=True))
    assert result.latency["kinds_measured"] == 0
    assert result.latency["whole_model"]["input_shapes"] == {"input": [1, 16, 20, 28]}
    assert not [n for n in result.placement.notes if "timed at 1" in n]
    bare = onnx_qat.ScaleTable(dict(table.activations), bounds=dict(table.bounds),
                               metadata={k: v for k, v in table.metadata.items() if k != L.INPUT_SHAPES_KEY})
    result = onnx_qat.quantize(model, scales=bare, target="ort-cpu", progress=False,
                               latency=L.LatencyOptions(profile=str(profile), rounds=1, allow_slower=True))
    assert [n for n in result.placement.notes if "input input (H, W)" in n and "timed at 1" in n]
    assert result.latency["whole_model"]["input_shapes"] == {"input": [1, 16, 1, 1]}
    result = onnx_qat.quantize(model, scales=bare, target="ort-cpu", progress=False,
                               latency=L.LatencyOptions(profile=str(profile), rounds=1, allow_slower=True,
                                                        shapes={"input": (1, 16, 20, 28)}))
    assert result.latency["whole_model"]["input_shapes"] == {"input": [1, 16, 20, 28]}


def test_cli_latency_shape(tmp_path, capsys):
    model = _symbolic_net()
    src, table = tmp_path / "m.onnx", tmp_path / "s.json"
    onnx.save(model, str(src))
    data = {"input": np.random.default_rng(7).uniform(0, 4, (4, 16, 20, 28)).astype(np.float32)}
    onnx_qat.calibrate(model, data, method="max", progress=False).save(str(table))  # no sizes recorded
    profile = tmp_path / "p.json"
    _profile_at(model, profile, {"input": (1, 16, 24, 32)})
    out = tmp_path / "q.onnx"
    code = main(["quantize", str(src), "--scales", str(table), "-o", str(out), "--target", "ort-cpu",
                 "--latency-profile", str(profile), "--latency-allow-slower",
                 "--latency-shape", "input=1x16x24x32"])
    shown = capsys.readouterr().out
    assert code == 0 and out.exists() and "0 kind(s) measured" in shown, shown
    assert "inputs input=1x16x24x32" in shown
    for bad, message in (("input=1x16x0x32", "expected INPUT=DIMS"), ("input", "expected INPUT=DIMS"),
                         ("image=1x16x24x32", "no such input"), ("input=1x3x24x32", "does not fit")):
        bad_out = tmp_path / "bad.onnx"
        assert main(["quantize", str(src), "--scales", str(table), "-o", str(bad_out), "--target", "ort-cpu",
                     "--latency-profile", str(profile), "--latency-allow-slower",
                     "--latency-shape", bad]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not bad_out.exists()
    assert main(["quantize", str(src), "--scales", str(table), "-o", str(tmp_path / "x.onnx"), "--target",
                 "ort-cpu", "--latency-shape", "input=1x16x24x32"]) == 2  # without --latency
    assert "only with --latency" in capsys.readouterr().err


def test_a_site_slower_in_integer_stays_float_with_both_times_in_the_report(tmp_path):
    model = _net()
    profile = tmp_path / "profile.json"
    _profile(model, profile, slow={"dw"})
    result = onnx_qat.quantize(model, data=_data(), method="max", target="ort-cpu", progress=False,
                               latency=_slower_ok(profile))
    latency = result.latency
    assert latency["kinds_measured"] == 0  # every kind came from the profile
    by_node = {r["node"]: r for r in latency["sites"]}
    assert by_node["dw"]["decision"] == "float" and by_node["dw"]["gain"] == 0.5
    assert {n for n, r in by_node.items() if r["decision"] == "integer"} == {"c1", "c2", "fc"}
    whole = latency["whole_model"]
    # real timings: on a loaded machine both quantized forms can time slower than FP32, and the guard
    # then writes a model with more sites float ("fallback")
    assert whole["timed"] and whole["chosen"] in ("latency placement", "every site integer", "fallback")
    assert whole["fp32_ms"] > 0 and whole["quantized_ms"] > 0
    # at least the options' 3 rounds; a model this small gets more within WHOLE_MODEL_SECONDS, up to 5x
    assert 3 < whole["rounds"] <= 3 * L.MAX_ROUNDS_FACTOR
    weights = {r["nodes"][0].split(":")[0] for r in result.inserted if r["kind"] == "weight"}
    if whole["chosen"] == "fallback":
        assert latency["fallback"]["chosen"] == "fallback" and weights < {"c1", "dw", "c2", "fc"}
        assert set(latency["kept_float"]) == {"c1", "dw", "c2", "fc"} - weights
        if "kept_float_per_site" not in latency:  # the guard started from the latency placement (dw float);
            assert "dw" not in weights  # from the every-site-integer model it drops the integer sites only
    elif whole["chosen"] == "latency placement":
        assert latency["kept_float"] == ["dw"] and weights == {"c1", "c2", "fc"}
        skip = next(d for d in result.placement.decisions if d.node == "dw")
        assert skip.rule == "CPU3" and "integer 200 us vs float 100 us" in skip.reason
        assert any("kept float for speed" in n for n in result.to_report()["notes"])
    else:  # the whole model ran faster with dw integer too: that model is written, and said so
        assert latency["kept_float"] == [] and latency["kept_float_per_site"] == ["dw"]
        assert weights == {"c1", "dw", "c2", "fc"}
    B.assert_check_clean(result.model, target="ort-cpu")
    report = json.loads(json.dumps(result.to_report()))
    assert report["latency"]["rule"] == "CPU3" and report["latency"]["profile"] == str(profile)


def test_time_models_runs_its_rounds_then_more_while_time_allows():
    model = _net()
    feeds = {"input": _data()["input"][:1]}
    medians, rounds, quartiles = L._interleaved({"a": model, "b": model}, feeds, 1, 2, 0.0)
    assert rounds == 2 and set(medians) == {"a", "b"} and all(v > 0 for v in medians.values())
    assert all(0 < low <= medians[k] <= high for k, (low, high) in quartiles.items())
    assert L._interleaved({"a": model}, feeds, 1, 2, 60.0)[1] == 2 * L.MAX_ROUNDS_FACTOR


def test_within_the_margin_a_site_stays_integer(tmp_path):
    model = _net()
    profile = tmp_path / "profile.json"
    _profile(model, profile, slow={"dw", "c2"}, factor=1.05)  # 5% slower: within noise (FLOAT_MARGIN 1.1)
    decision = L.decide(model, GraphIndex(model), onnx_qat.place(model, target="ort-cpu"), profile=profile)
    assert decision.kept_float == () and decision.measured_kinds == 0


def test_every_site_slower_is_refused_with_nothing_written(tmp_path):
    model = _net()
    profile = tmp_path / "profile.json"
    _profile(model, profile, slow={"c1", "dw", "c2", "fc"})
    out = tmp_path / "out.onnx"
    with pytest.raises(PlacementError, match="faster in float"):
        onnx_qat.quantize(model, out, data=_data(), method="max", target="ort-cpu", progress=False,
                          latency=_slower_ok(profile))
    assert not out.exists()


def test_profile_of_another_machine_is_used_with_a_note(tmp_path):
    model = _net()
    profile = tmp_path / "profile.json"
    other = {"cpu": "Some Server CPU", "flags": ["avx2", "avx512_vnni", "avx512f"], "onnxruntime": "9.9",
             "threads": 16}
    _profile(model, profile, slow={"dw"}, machine=other)
    decision = L.decide(model, GraphIndex(model), onnx_qat.place(model, target="ort-cpu"), profile=profile)
    assert decision.kept_float == ("dw",)
    assert any("another machine" in n and "avx512_vnni" in n for n in decision.notes)


@pytest.mark.parametrize("written", ["every site integer", "guard fallback"])
def test_the_decision_notes_stay_with_whichever_model_is_written(tmp_path, monkeypatch, written):
    """The latency decision's notes (here: a profile of another machine) were lost from the result when the
    whole-model timing wrote the every-site-integer model or a guard round's model instead of the latency
    placement's: both are placed anew. (Found by a note that a clean clone's timings dropped.)"""
    model, profile = _net(), tmp_path / "profile.json"
    other = {"cpu": "Some Server CPU", "flags": ["avx2"], "onnxruntime": "9.9", "threads": 16}
    if written == "every site integer":
        _profile(model, profile, slow={"dw"}, machine=other)
        timing = {"timed": True, "batch": 1, "threads": 0, "rounds": 3, "fp32_ms": 1.5, "quantized_ms": 1.0,
                  "speedup": 1.5, "verdict": "faster than FP32", "chosen": "every site integer",
                  "latency_placement_ms": 1.2, "every_site_integer_ms": 1.0}
        monkeypatch.setattr(L, "whole_model_timing", lambda *args, **kwargs: dict(timing))
    else:
        _guarded_profile(model, profile, monkeypatch)
        raw = json.loads(profile.read_text())
        profile.write_text(json.dumps({**raw, "machine": other}))
        given = {"rounds": 3, "fp32_ms": 1.2, "before_ms": 1.33, "fallback_ms": 1.0, "speedup": 1.2,
                 "chosen": "fallback"}
        monkeypatch.setattr(L, "fallback_timing", lambda *args, **kwargs: dict(given))
    result = onnx_qat.quantize(model, data=_data(), method="max", target="ort-cpu", progress=False,
                               latency=_slower_ok(profile))
    if written == "every site integer":
        assert {w.node for w in result.placement.weights} == {"c1", "dw", "c2", "fc"}
    else:
        assert result.latency["fallback"]["chosen"] == "fallback"
    assert sum("another machine" in n for n in result.placement.notes) == 1, result.placement.notes


def test_measuring_fills_the_profile_once(tmp_path, monkeypatch):
    """Real measurement on this machine: the profile gets one entry per kind (4 here) with positive
    times and this machine's key; a second run measures nothing. No time is asserted."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = _net()
    index, placement = GraphIndex(model), onnx_qat.place(model, target="ort-cpu")
    first = L.decide(model, index, placement)
    path = L.default_profile_path(0)
    assert first.profile_path == str(path)
    assert path.is_relative_to(tmp_path / "cache" / "onnx-qat" / "latency")
    saved = json.loads(path.read_text())
    assert saved["format"] == L.PROFILE_FORMAT and len(saved["sites"]) == first.measured_kinds == 4
    assert all(v["float_us"] > 0 and v["int_us"] > 0 for v in saved["sites"].values())
    assert saved["machine"] == L.machine_key(0)
    assert set(saved["machine"]["flags"]) <= set(L.KERNEL_FLAGS)
    second = L.decide(model, index, placement)
    assert second.measured_kinds == 0 and second.kept_float == first.kept_float


def test_machine_key_separates_threads_and_files(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    key = L.machine_key(4)
    assert key["threads"] == 4 and key["onnxruntime"] == __import__("onnxruntime").__version__
    assert L.default_profile_path(4) != L.default_profile_path(1)


def _proc_flags():
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith(("flags", "Features")) and ":" in line
            for f in line.split(":", 1)[1].split()}


def test_cpuid_flags_agree_with_proc_cpuinfo_here():
    """On x86-64 the CPUID instruction run in this process reports the kernel flags /proc/cpuinfo lists
    (no mask here); elsewhere it is not run (None) and /proc/cpuinfo alone decides."""
    import platform

    seen = L.cpuid_flags()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        assert seen is None
        return
    if seen is None:
        pytest.skip("executable memory refused here: /proc/cpuinfo alone decides")
    proc = _proc_flags()
    assert seen <= set(L.CPUID_BITS)
    if proc:  # the OS may hide a feature CPUID has (no kernel support), never the reverse here
        assert {f for f in L.CPUID_BITS if f in proc} <= seen


def test_machine_key_keeps_only_flags_cpuid_reports(monkeypatch):
    """A process whose CPUID hides a feature (the benchmark's CPUID mask, a hypervisor) gets the
    kernels without it: the key, and so the profile and the ``cpu_vnni`` choice, follow CPUID."""
    import platform

    proc = _proc_flags()
    if platform.machine().lower() not in ("x86_64", "amd64") or "avx2" not in proc:
        pytest.skip("needs an x86-64 CPU with AVX2 listed in /proc/cpuinfo")
    monkeypatch.setitem(L._cpuid_seen, "flags", frozenset({"avx2"}))
    key = L.machine_key(2)
    assert [f for f in key["flags"] if f in L.CPUID_BITS] == ["avx2"]
    wide, reason = L.wide_dot_products(key["flags"], platform.machine())
    assert wide is False and "vpmaddubsw" in reason
    assert L.resolve_cpu_vnni("auto")["weight_bits"] == 7
    monkeypatch.setitem(L._cpuid_seen, "flags", None)  # CPUID not run: /proc/cpuinfo alone
    assert set(L.machine_key(2)["flags"]) == {f for f in L.KERNEL_FLAGS if f in proc}


_HEAD = {"format": L.PROFILE_FORMAT, "version": 1}
_BAD_PROFILES = [
    ("{", "not readable JSON"), ('{"format": "x"}', "not an"), ("[1, 2]", "not an"),
    (b"\xff\xfe\x00garbage", "not readable JSON"),
    (json.dumps({**_HEAD, "sites": {"k": {"float_us": -1, "int_us": 2}}}), "positive"),
    (json.dumps({**_HEAD, "sites": {"k": [1, 2]}}), "positive"),
    (json.dumps({**_HEAD, "sites": {}, "machine": [1]}), "'machine' must be an object"),
    (json.dumps({**_HEAD, "sites": {}, "whole_models": []}), "'whole_models' must be an object"),
    (json.dumps({**_HEAD, "sites": {}, "whole_models": {"abc": {"medians_ms": {"fp32": "fast"},
                                                                 "rounds": 3}}}),
     "whole-model timing 'abc' needs positive"),
    (json.dumps({**_HEAD, "sites": {}, "whole_models": {"abc": {"medians_ms": {"fp32": 1.0}, "rounds": 0}}}),
     "whole-model timing 'abc'"),
]


@pytest.mark.parametrize("content,match", _BAD_PROFILES)
def test_a_bad_profile_is_a_config_error(tmp_path, content, match):
    profile = tmp_path / "bad.json"
    profile.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=match):
        L.LatencyProfile.load(profile, 0)


@pytest.mark.parametrize("content,match", _BAD_PROFILES[::3])
def test_cli_a_bad_profile_is_one_line_exit_2_nothing_written(tmp_path, capsys, content, match):
    model = _net()
    src, out, data, profile = (tmp_path / n for n in ("m.onnx", "q.onnx", "d.npz", "p.json"))
    onnx.save(model, str(src))
    np.savez(data, **_data())
    profile.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = profile.read_bytes()
    code = main(["quantize", str(src), "-o", str(out), "--data", str(data), "--method", "max",
                 "--target", "ort-cpu", "--latency-profile", str(profile), "--latency-allow-slower"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists() and profile.read_bytes() == before
    assert len(err.splitlines()) == 1 and str(profile) in err and re.search(match, err), err


def test_a_second_identical_run_reuses_the_whole_model_timing(tmp_path, capsys):
    """The whole-model timing (FP32 against the written model) is kept in the latency profile under a
    hash of the models' bytes, this machine, threads and batch: a second identical run reuses it (the
    report and the CLI say so; the figures are the first run's), a changed model is timed afresh, and
    ``retime`` times it again."""
    model = _net()
    profile = tmp_path / "profile.json"
    _profile(model, profile)  # every site faster in integer: FP32 and the quantized model are timed
    kw = dict(data=_data(), method="max", target="ort-cpu", progress=False)
    first = onnx_qat.quantize(model, **kw, latency=_slower_ok(profile))
    whole = first.latency["whole_model"]
    assert whole["source"] == "measured" and whole["profile"] == str(profile)
    assert whole["quartiles_ms"]["fp32"][0] <= whole["fp32_ms"] <= whole["quartiles_ms"]["fp32"][1]
    saved = json.loads(profile.read_text())["whole_models"]  # and the guard's timings if it ran
    guard_rounds = len(first.latency.get("fallback", {}).get("rounds_tried", []))
    assert len(saved) == 1 + guard_rounds
    assert sorted(sorted(v["medians_ms"]) for v in saved.values()) == sorted(
        [["fp32", "quantized"]] + [["before", "fallback", "fp32"]] * guard_rounds)
    second = onnx_qat.quantize(model, **kw, latency=_slower_ok(profile))
    again = second.latency["whole_model"]
    assert second.model.SerializeToString() == first.model.SerializeToString()
    assert again["source"] == "latency profile" and again["timed_at"] == whole["timed_at"]
    assert {k: again[k] for k in ("fp32_ms", "quantized_ms", "speedup", "rounds")} == \
        {k: whole[k] for k in ("fp32_ms", "quantized_ms", "speedup", "rounds")}
    report = json.loads(json.dumps(second.to_report()))
    assert report["latency"]["whole_model"]["source"] == "latency profile"
    changed = onnx_qat.quantize(_net(seed=5), **kw, latency=_slower_ok(profile))  # other weights, same shapes
    assert changed.latency["kinds_measured"] == 0  # the site times still come from the profile
    assert changed.latency["whole_model"]["source"] == "measured"
    other_data = onnx_qat.quantize(model, **{**kw, "data": _data(seed=7)}, latency=_slower_ok(profile))
    assert other_data.latency["whole_model"]["source"] == "measured"  # other scales: other bytes
    retimed = onnx_qat.quantize(model, **kw, latency=L.LatencyOptions(profile=str(profile), retime=True,
                                                                        allow_slower=True))
    assert retimed.latency["whole_model"]["source"] == "measured"
    key = next(k for k, v in saved.items() if set(v["medians_ms"]) == {"fp32", "quantized"})
    timings = json.loads(profile.read_text())["whole_models"]
    assert timings[key]["timed_at"] > saved[key]["timed_at"]  # the same key, timed again
    other_batch = onnx_qat.quantize(model, **kw, latency=L.LatencyOptions(profile=str(profile), batch=2,
                                                                            allow_slower=True))
    assert other_batch.latency["whole_model"]["source"] == "measured"  # fixed batch 1: same shapes, other key
    src, out, data = tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "d.npz"
    onnx.save(model, str(src))
    np.savez(data, **_data())
    args = ["quantize", str(src), "-o", str(out), "--data", str(data), "--method", "max",
            "--target", "ort-cpu", "--latency-profile", str(profile), "--latency-allow-slower"]
    assert main(args) == 0
    assert "(timing from the latency profile, measured " in capsys.readouterr().out
    assert main(args + ["--latency-retime"]) == 0
    assert "timing from the latency profile" not in capsys.readouterr().out


def test_whole_model_timings_of_another_machine_are_not_reused_or_kept(tmp_path):
    model = _net()
    profile = tmp_path / "profile.json"
    other = {"cpu": "Some Server CPU", "flags": ["avx2"], "onnxruntime": "9.9", "threads": 16}
    _profile(model, profile, machine=other)
    kw = dict(data=_data(), method="max", target="ort-cpu", progress=False, latency=_slower_ok(profile))
    for _ in range(2):
        whole = onnx_qat.quantize(model, **kw).latency["whole_model"]
        assert whole["source"] == "measured" and whole["profile"] is None
    assert "whole_models" not in json.loads(profile.read_text())


def test_a_profile_that_cannot_be_written_still_gives_a_timing(tmp_path, caplog):
    """The whole-model timing is measured and returned when its profile cannot be written (here its
    folder is a file), with a warning instead of an error."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    options = L.LatencyOptions(profile=str(blocker / "p.json"), threads=1, rounds=1)
    model = _net()
    medians, rounds, _, origin = L.timed_or_cached({"fp32": model}, {"input": _data()["input"][:1]}, options)
    assert medians["fp32"] > 0 and rounds >= 1
    assert origin["source"] == "measured" and origin["profile"] is None
    assert "not kept" in caplog.text and blocker.read_text() == "x"


def test_the_profile_keeps_at_most_its_newest_whole_model_timings(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "MAX_WHOLE_MODEL_TIMINGS", 2)
    model = _net()
    feeds = {"input": _data()["input"][:1]}
    options = L.LatencyOptions(profile=str(tmp_path / "p.json"), threads=1, rounds=1)
    keys = []
    for seed in range(3):
        variant = _net(seed)
        L.timed_or_cached({"fp32": model, "quantized": variant}, feeds, options)
        blobs = {"fp32": model.SerializeToString(), "quantized": variant.SerializeToString()}
        keys.append(L.timing_key(blobs, feeds, 1, 1, 1))
    assert set(json.loads((tmp_path / "p.json").read_text())["whole_models"]) == set(keys[1:])


def test_latency_needs_the_ort_cpu_target_and_int8():
    model = _net()
    with pytest.raises(ConfigError, match="ort-cpu"):
        onnx_qat.quantize(model, data=_data(), target="tensorrt", progress=False, latency="measure")
    with pytest.raises(ConfigError, match="latency must be"):
        onnx_qat.quantize(model, data=_data(), target="ort-cpu", progress=False, latency=3)


def test_cli_latency_profile(tmp_path, capsys):
    model = _net()
    src, out, data, profile = (tmp_path / n for n in ("m.onnx", "q.onnx", "d.npz", "p.json"))
    onnx.save(model, str(src))
    np.savez(data, **_data())
    _profile(model, profile, slow={"dw"})
    code = main(["quantize", str(src), "-o", str(out), "--data", str(data), "--method", "max",
                 "--target", "ort-cpu", "--latency-profile", str(profile), "--latency-allow-slower"])
    shown = capsys.readouterr().out
    assert code == 0 and out.exists()
    assert "latency placement (CPU3)" in shown and "whole model, batch 1" in shown
    assert "check (ort-cpu rules): PASSED" in shown
    assert main(["quantize", str(src), "-o", str(tmp_path / "x.onnx"), "--data", str(data),
                 "--latency-threads", "2"]) == 2
    assert not (tmp_path / "x.onnx").exists()


def _signed_net_and_data():
    """``expand_conv`` reads the signed graph input (zero point 128): its weight width follows cpu_vnni."""
    model = B.depthwise_model(channels=16, expand=2, size=8)
    return model, {"input": np.random.default_rng(0).standard_normal((4, 16, 8, 8)).astype(np.float32)}


def test_auto_weight_width_is_recorded_in_and_read_from_a_latency_profile(tmp_path, monkeypatch):
    """This machine's profile records the auto choice of ``cpu_vnni``; a profile from another machine
    that records one decides ``"auto"`` (it describes the deployment machine); forcing still wins.
    (The whole-model timing is given as faster than FP32: on a loaded machine the tiny net's real timing
    may start the whole-model guard, which would keep some of the weights this test reads float.)"""
    fast = {"timed": True, "batch": 1, "threads": 0, "rounds": 3, "fp32_ms": 2.0, "quantized_ms": 1.0,
            "speedup": 2.0, "verdict": "faster than FP32", "chosen": "latency placement"}
    monkeypatch.setattr(L, "whole_model_timing", lambda *args, **kwargs: dict(fast))
    model, data = _signed_net_and_data()
    profile = tmp_path / "here.json"
    _profile(model, profile)
    result = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False,
                               latency=_slower_ok(profile))
    assert result.ort_cpu["chosen_by"] == "auto" and result.latency["kinds_measured"] == 0
    saved = json.loads(profile.read_text())
    assert saved["cpu_vnni"] == {"cpu_vnni": result.ort_cpu["cpu_vnni"], "reason": result.ort_cpu["reason"]}
    for recorded in (True, False):
        other = tmp_path / f"other_{recorded}.json"
        other.write_text(json.dumps({**saved, "machine": {**saved["machine"], "cpu": "deployment CPU"},
                                     "cpu_vnni": {"cpu_vnni": recorded, "reason": "measured there"}}))
        choice = L.resolve_cpu_vnni("auto", profile=other)
        assert choice["cpu_vnni"] is recorded and choice["chosen_by"] == "latency profile"
        assert "deployment CPU" in choice["reason"] and "measured there" in choice["reason"]
        assert L.resolve_cpu_vnni(not recorded, profile=other)["cpu_vnni"] is (not recorded)
        out = onnx_qat.quantize(model, data=data, method="max", target="ort-cpu", progress=False,
                                latency=_slower_ok(other))
        weights = {r["tensor"]: r for r in out.inserted if r["kind"] == "weight"}
        assert weights["expand_conv.weight"].get("range") == (None if recorded else [-63, 63])
        assert out.ort_cpu["chosen_by"] == "latency profile"
        assert json.loads(other.read_text())["cpu_vnni"]["reason"] == "measured there"  # not overwritten


def test_a_bad_recorded_weight_width_is_a_config_error(tmp_path):
    model, _ = _signed_net_and_data()
    profile = tmp_path / "p.json"
    _profile(model, profile)
    profile.write_text(json.dumps({**json.loads(profile.read_text()), "cpu_vnni": {"cpu_vnni": "yes"}}))
    with pytest.raises(ConfigError, match="'cpu_vnni' needs a boolean"):
        L.LatencyProfile.load(profile, 0)


def test_cli_cpu_vnni_auto_on_off(tmp_path, capsys):
    """``--cpu-vnni``, ``--no-cpu-vnni``, and the default (neither: ``auto``): the summary
    and the report say which width and why; forcing 8 bits without --data is exit 2, nothing written."""
    import platform

    model, data = _signed_net_and_data()
    src, npz = tmp_path / "m.onnx", tmp_path / "d.npz"
    onnx.save(model, str(src))
    np.savez(npz, **data)
    wide, _ = L.wide_dot_products(L.machine_key(0)["flags"], platform.machine())
    for flags, bits, by in (([], 8 if wide else 7, "auto"), (["--cpu-vnni"], 8, "option"),
                            (["--no-cpu-vnni"], 7, "option")):
        out, rep = tmp_path / "q.onnx", tmp_path / "r.json"
        code = main(["quantize", str(src), "-o", str(out), "--data", str(npz), "--method", "max",
                     "--target", "ort-cpu", "--report", str(rep), *flags])
        shown = capsys.readouterr().out
        assert code == 0, shown
        assert f"ort-cpu Conv/Gemm/MatMul weights: {bits} bits" in shown and f", {by}: " in shown
        report = json.loads(rep.read_text())
        assert report["ort_cpu"]["weight_bits"] == bits and report["ort_cpu"]["chosen_by"] == by
        weights = {r["tensor"]: r for r in report["inserted"] if r["kind"] == "weight"}
        assert weights["expand_conv.weight"].get("range") == (None if bits == 8 else [-63, 63])
    scales = tmp_path / "s.json"
    onnx_qat.calibrate(model, data, method="max").save(scales)
    bad = tmp_path / "bad.onnx"
    assert main(["quantize", str(src), "-o", str(bad), "--scales", str(scales), "--target", "ort-cpu",
                 "--cpu-vnni"]) == 2
    assert not bad.exists() and "cpu_vnni" in capsys.readouterr().err


@pytest.mark.parametrize("second, kept", [((100.0, 80.0), ()), ((100.0, 300.0), ("dw",))])
def test_a_kind_measured_slower_in_integer_is_measured_again(tmp_path, monkeypatch, second, kept):
    """A first measurement saying integer is slower (here 300 us against 100 us for ``dw``) is taken
    again, and each form keeps the lower of its two medians: a second measurement of 80 us makes the
    site integer, one that confirms the loss keeps it float. Kinds measured faster are measured once.
    (The measurement is replaced by given times: which times come back is what this tests.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = _net()
    index, placement = GraphIndex(model), onnx_qat.place(model, target="ort-cpu")
    dw_kind = next(s.kind for s in L.sites_of(index, placement, L.input_shapes(model, 1)) if s.node == "dw")
    calls = []

    def measure(spec, threads):
        kind = json.dumps(spec, sort_keys=True)
        calls.append(kind)
        if spec == json.loads(dw_kind):
            first = calls.count(kind) == 1
            return dict(zip(("float_us", "int_us"), (100.0, 300.0) if first else second))
        return {"float_us": 100.0, "int_us": 50.0}

    monkeypatch.setattr(L, "measure_kind", measure)
    decision = L.decide(model, index, placement)
    assert decision.kept_float == kept
    assert len(calls) == 5 and decision.measured_kinds == 4  # 4 kinds, dw twice
    saved = json.loads(L.default_profile_path(0).read_text())["sites"]
    assert saved[dw_kind] == {"float_us": 100.0, "int_us": min(300.0, second[1])}


def test_fallback_sites_are_the_least_gaining_half():
    records = tuple({"node": n, "decision": d, "gain": g} for n, d, g in
                    (("a", "integer", 3.0), ("b", "integer", 1.2), ("c", "float", 0.5), ("d", "integer", 1.5),
                     ("e", "integer", 2.0)))
    decision = L.LatencyDecision(("c",), records, None, 0, 0.0)
    assert L.fallback_sites(decision, exclude={"c"}) == ("b", "d")
    assert L.fallback_sites(decision, exclude={"c", "a", "b"}) == ("d",)
    assert L.fallback_sites(decision, exclude={"a", "b", "c", "d"}) == ()  # never the last integer site


def _guarded_profile(model, profile, monkeypatch) -> None:
    """A profile where every site of `_net` gains in integer (c1 4x, fc 3x, c2 1.5x, dw 1.2x) and a
    final whole-model timing given as 0.5x FP32, so the whole-model guard runs."""
    _profile(model, profile)
    raw = json.loads(profile.read_text())
    index, placement = GraphIndex(model), onnx_qat.place(model, target="ort-cpu")
    gains = {"c1": 4.0, "dw": 1.2, "c2": 1.5, "fc": 3.0}
    for site in L.sites_of(index, placement, L.input_shapes(model, 1)):
        raw["sites"][site.kind] = {"float_us": 100.0, "int_us": 100.0 / gains[site.node]}
    profile.write_text(json.dumps(raw))
    slow = {"timed": True, "batch": 1, "threads": 0, "rounds": 3, "fp32_ms": 1.0, "quantized_ms": 2.0,
            "speedup": 0.5, "verdict": "NOT faster than FP32", "chosen": "latency placement"}
    monkeypatch.setattr(L, "whole_model_timing", lambda *args, **kwargs: dict(slow))


@pytest.mark.parametrize("second", [None, "fallback", "unchanged"])
def test_whole_model_guard_keeps_the_least_gaining_sites_float(tmp_path, monkeypatch, second):
    """When the final timing says the quantized model is not faster than FP32 (given here: that timing
    is replaced by a verdict of 0.5x), the least-gaining half of the integer sites by the profile is kept
    float too, FP32 and both quantized models are timed once more (for real with ``second`` None, else
    given: the fallback faster at 1.2x FP32, or the model unchanged at 0.9x), and the faster quantized
    model is written; the report's ``latency.fallback`` says what was tried and which was kept, and
    ``whole_model`` gives the second timing (the first under ``first``)."""
    model, profile = _net(), tmp_path / "profile.json"
    _guarded_profile(model, profile, monkeypatch)
    if second is not None:
        given = {"rounds": 3, "fp32_ms": 1.2, "before_ms": 1.33,
                 "fallback_ms": 1.0 if second == "fallback" else 1.5,
                 "speedup": 1.2 if second == "fallback" else 0.902, "chosen": second}
        monkeypatch.setattr(L, "fallback_timing", lambda *args, **kwargs: dict(given))
    out = tmp_path / "q.onnx"
    result = onnx_qat.quantize(model, out, data=_data(), method="max", target="ort-cpu", progress=False,
                               latency=_slower_ok(profile))
    fallback = result.latency["fallback"]
    assert fallback["rounds_tried"][0]["kept_float"] == ["dw", "c2"]  # real timings may go on to round 2
    assert fallback["kept_float"] in (["dw", "c2"], ["dw", "c2", "fc"])
    assert fallback["chosen"] in ("fallback", "unchanged")
    assert fallback["fp32_ms"] > 0 and fallback["before_ms"] > 0 and fallback["fallback_ms"] > 0
    weights = {w.node for w in result.placement.weights}
    decisions = {d.node: d for d in result.placement.all_decisions()}
    whole = result.latency["whole_model"]
    if second is not None:
        assert fallback["chosen"] == second
    assert whole["first"]["speedup"] == 0.5 and whole["speedup"] == fallback["speedup"]
    if fallback["chosen"] == "fallback":
        assert weights == {"c1", "dw", "c2", "fc"} - set(fallback["kept_float"])
        best = min(fallback["fallback_ms"], fallback["before_ms"])
        assert whole["quantized_ms"] == fallback["best_ms"] == best
        assert decisions["dw"].rule == "CPU3" and "whole-model guard" in decisions["dw"].reason
        assert set(result.latency["kept_float"]) == set(fallback["kept_float"])
        assert whole["chosen"] == "fallback"
    else:
        assert weights == {"c1", "dw", "c2", "fc"} and whole["quantized_ms"] == fallback["before_ms"]
        assert result.latency["kept_float"] == []
    assert (whole["speedup"] <= 1.0) == any("NOT faster than FP32" in n for n in result.placement.notes)
    B.assert_check_clean(onnx.load(str(out)), target="ort-cpu")


@pytest.mark.parametrize("fp32_high,refused", [(1.25, True), (1.4, False)])
def test_a_model_still_slower_after_the_guard_is_refused_unless_allowed(tmp_path, monkeypatch, capsys,
                                                                         fp32_high, refused):
    """After the guard the fastest quantized model took 1.33 ms against FP32's 1.2 ms. Above FP32's upper
    quartile (1.25: slower than 3 in 4 FP32 runs) nothing is written and `PlacementError` says why in one
    line (exit 2 from the CLI); within the spread (1.4) it is a tie and the model is written with the
    plain note. ``allow_slower`` (``--latency-allow-slower``) writes it in both cases."""
    model, profile = _net(), tmp_path / "profile.json"
    _guarded_profile(model, profile, monkeypatch)
    given = {"rounds": 5, "fp32_ms": 1.2, "before_ms": 1.33, "fallback_ms": 1.5, "speedup": 0.902,
             "chosen": "unchanged", "quartiles_ms": {"fp32": [1.1, fp32_high], "quantized": [1.3, 1.36]}}
    monkeypatch.setattr(L, "fallback_timing", lambda *args, **kwargs: dict(given))
    out = tmp_path / "q.onnx"
    kw = dict(data=_data(), method="max", target="ort-cpu", progress=False)
    if refused:
        with pytest.raises(PlacementError, match="no quantized form ran faster than FP32") as caught:
            onnx_qat.quantize(model, out, **kw, latency=str(profile))
        assert "1.33 ms against FP32's 1.2 ms" in str(caught.value) and "\n" not in str(caught.value)
        assert not out.exists()
        src, data = tmp_path / "net.onnx", tmp_path / "data.npz"
        onnx.save(model, src)
        np.savez(data, **_data())
        argv = ["quantize", str(src), "--data", str(data), "--method", "max", "-o", str(out), "--target",
                "ort-cpu", "--latency-profile", str(profile), "-q"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "--latency-allow-slower writes it anyway" in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
        assert main(argv + ["--latency-allow-slower"]) == 0 and out.exists()
    else:
        result = onnx_qat.quantize(model, out, **kw, latency=str(profile))
        assert out.exists() and any("NOT faster than FP32" in n for n in result.placement.notes)
    allowed = onnx_qat.quantize(model, **kw, latency=_slower_ok(profile))
    assert {w.node for w in allowed.placement.weights} == {"c1", "dw", "c2", "fc"}
    assert allowed.latency["whole_model"]["quantized_ms"] == 1.33
    assert any("NOT faster than FP32" in n for n in allowed.placement.notes)


def test_clearly_slower_reads_fp32_s_upper_quartile():
    whole = {"timed": True, "fp32_ms": 1.0, "quantized_ms": 1.05, "quartiles_ms": {"fp32": [0.9, 1.1]}}
    assert not L.clearly_slower(whole)
    assert L.clearly_slower({**whole, "quantized_ms": 1.11})
    assert L.clearly_slower({"timed": True, "fp32_ms": 1.0, "quantized_ms": 1.01})  # no quartiles: the median
    assert not L.clearly_slower({"timed": False, "reason": "input 'x' is not a tensor of known shape"})
    with pytest.raises(ConfigError, match="allow_slower must be True or False"):
        L.LatencyOptions.resolve(L.LatencyOptions(allow_slower="yes"))


def test_whole_model_guard_goes_on_halving_until_faster_than_fp32(tmp_path, monkeypatch, capsys):
    """When the first fallback is still not faster than FP32, the guard keeps float the least-gaining
    half of the sites its last candidate still has integer and times again (given timings: round 1 slower
    than the model as it was, round 2 faster than FP32), and writes the fastest model; the report lists
    every round, the CLI says how many."""
    model, profile = _net(), tmp_path / "profile.json"
    _guarded_profile(model, profile, monkeypatch)
    rounds = iter([{"rounds": 3, "fp32_ms": 1.2, "before_ms": 1.33, "fallback_ms": 1.5, "speedup": 0.902,
                    "chosen": "unchanged"},
                   {"rounds": 3, "fp32_ms": 1.2, "before_ms": 1.33, "fallback_ms": 1.09, "speedup": 1.101,
                    "chosen": "fallback"}])
    monkeypatch.setattr(L, "fallback_timing", lambda *args, **kwargs: dict(next(rounds)))
    src, out, data = tmp_path / "m.onnx", tmp_path / "q.onnx", tmp_path / "d.npz"
    onnx.save(model, str(src))
    np.savez(data, **_data())
    code = main(["quantize", str(src), "-o", str(out), "--data", str(data), "--method", "max",
                 "--target", "ort-cpu", "--latency-profile", str(profile), "--latency-allow-slower",
                 "--report", str(tmp_path / "r.json")])
    shown = capsys.readouterr().out
    assert code == 0
    latency = json.loads((tmp_path / "r.json").read_text())["latency"]
    fallback = latency["fallback"]
    assert [r["kept_float"] for r in fallback["rounds_tried"]] == [["dw", "c2"], ["fc"]]
    assert fallback["chosen"] == "fallback" and fallback["kept_float"] == ["dw", "c2", "fc"]
    assert latency["whole_model"]["quantized_ms"] == 1.09 and latency["whole_model"]["speedup"] == 1.101
    written = onnx.load(str(out))
    integer = sorted(i.name for i in written.graph.initializer if i.data_type in (2, 3) and len(i.dims) > 1)
    assert integer == ["c1.weight_quantized"]  # the fastest model: only the most-gaining site integer
    assert ("2 rounds (round 1: 2 more site(s) float, 1.50 ms against 1.33 ms; round 2: 1 more site(s) "
            "float, 1.09 ms against 1.33 ms): kept the fallback (3 site(s) float by the guard)") in shown
    assert "whole model, batch 1: 1.09 ms against FP32 1.20 ms (1.10x): faster than FP32" in shown
    B.assert_check_clean(written, target="ort-cpu")


def test_cli_prints_the_whole_model_guard(tmp_path, capsys, monkeypatch):
    model = _net()
    src, out, data, profile = (tmp_path / n for n in ("m.onnx", "q.onnx", "d.npz", "p.json"))
    onnx.save(model, str(src))
    np.savez(data, **_data())
    _profile(model, profile)
    slow = {"timed": True, "batch": 1, "threads": 0, "rounds": 3, "fp32_ms": 1.0, "quantized_ms": 2.0,
            "speedup": 0.5, "verdict": "NOT faster than FP32", "chosen": "latency placement"}
    monkeypatch.setattr(L, "whole_model_timing", lambda *args, **kwargs: dict(slow))
    monkeypatch.setattr(L, "fallback_timing", lambda *args, **kwargs: {
        "rounds": 3, "fp32_ms": 1.2, "before_ms": 1.33, "fallback_ms": 1.0, "speedup": 1.2,
        "chosen": "fallback"})
    code = main(["quantize", str(src), "-o", str(out), "--data", str(data), "--method", "max",
                 "--target", "ort-cpu", "--latency-profile", str(profile), "--latency-allow-slower"])
    shown = capsys.readouterr().out
    assert code == 0
    assert "whole-model guard: first timing 0.50x FP32, so 2 least-gaining site(s) kept float too" in shown
    assert "1.00 ms against 1.33 ms: kept the fallback" in shown
    assert "whole model, batch 1: 1.00 ms against FP32 1.20 ms (1.20x): faster than FP32" in shown
