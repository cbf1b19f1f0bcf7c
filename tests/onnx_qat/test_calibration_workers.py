"""Calibration split over worker processes: every method's ranges identical, bit for bit, to one
process; collectors merge exactly; a stateful model stays in one process with a note."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import onnx_qat
from onnx_qat.calibration.collector import AbsHistogram
from onnx_qat.calibration.runner import make_collector
from onnx_qat.cli import EXIT_OK, main
from tests.builders import mobilenet_v2_model, residual_block_model
from tests.onnx_qat.test_feeds import STATE, rnn_model, stream
from tests.reliability import support


def _images(n: int, seed: int, size: int, channels: int, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, channels, size, size)) * scale
    x[rng.random(x.shape) < 1e-3] *= 40.0  # a few outliers, so clipping methods clip
    return x.astype(np.float32)


@pytest.mark.parametrize("method", ["max", "percentile", "entropy", "mse", "auto"])
def test_every_method_gives_the_ranges_of_one_process(method):
    model = residual_block_model(projection=True)
    data = {"input": _images(40, 3, 8, 16)}
    kw = dict(method=method, batch_size=4, progress=False)  # 10 batches: 1 here, 9 in parts
    one = onnx_qat.calibrate(model, data, workers=1, **kw)
    two = onnx_qat.calibrate(model, data, workers=2, **kw)
    assert one.activations == two.activations  # float equality: bit for bit
    assert one.metadata == two.metadata  # auto: the same table kept, the same output cosines
    assert one.bounds == two.bounds and one.bounds  # the ort-cpu target's (min, max), whatever the method
    assert len(one.activations) >= 3


@pytest.mark.parametrize("seed,scale,batch", [(0, 1.0, 2), (5, 255.0, 3), (9, 1e-3, 7)])
def test_max_is_bit_for_bit_on_a_mobilenet_for_seeds_scales_and_batch_sizes(seed, scale, batch):
    model = mobilenet_v2_model(size=16, width=0.5, seed=seed)
    data = {"input": _images(23, seed, 16, 3, scale)}  # the last batch is a short one
    one = onnx_qat.calibrate(model, data, method="max", batch_size=batch, workers=1, progress=False)
    three = onnx_qat.calibrate(model, data, method="max", batch_size=batch, workers=3, progress=False)
    assert one.activations == three.activations


def test_histograms_of_parts_merge_into_the_one_of_the_whole():
    rng = np.random.default_rng(4)
    batches = [np.abs(rng.standard_normal(5000) * s).astype(np.float32) for s in (0.1, 3.0, 0.5, 40.0, 1.0)]
    whole = AbsHistogram(1024)
    for b in batches:
        whole.update(b)
    left, right = AbsHistogram(1024), AbsHistogram(1024)
    for b in batches[:2]:
        left.update(b)
    for b in batches[2:]:
        right.update(b)
    right.merge(left)  # the larger range merged into the smaller one's order does not matter
    assert right.top == whole.top and np.array_equal(right.counts, whole.counts)
    for method in ("max", "percentile", "entropy", "mse", "auto"):
        one, a, b = (make_collector(method, num_bins=256) for _ in range(3))
        for i, batch in enumerate(batches):
            one.update(batch)
            (a if i % 2 else b).update(batch)
        a.merge(b)
        assert a.amax() == one.amax(), method


@pytest.mark.parametrize("target", ["tensorrt", "ort-cpu"])
def test_quantize_writes_the_same_model_with_workers(target):
    """ort-cpu also reads each activation's calibrated (min, max): merged exactly too."""
    model = residual_block_model(projection=True)
    data = {"input": _images(32, 8, 8, 16)}
    one = onnx_qat.quantize(model, data=data, batch_size=4, workers=1, target=target, progress=False).model
    two = onnx_qat.quantize(model, data=data, batch_size=4, workers=2, target=target, progress=False).model
    assert one.SerializeToString() == two.SerializeToString()


def test_a_stateful_model_stays_in_one_process_with_a_note(caplog):
    model, feeds = rnn_model(), stream(steps=30)
    with caplog.at_level(logging.WARNING, logger="onnx_qat"):
        two = onnx_qat.calibrate(model, feeds, state=STATE, method="max", workers=2, progress=False)
    assert any("stateful model" in r.message and "one process" in r.message for r in caplog.records)
    one = onnx_qat.calibrate(model, feeds, state=STATE, method="max", workers=1, progress=False)
    assert one.activations == two.activations


def test_short_calibration_stays_in_this_process_by_default(caplog):
    model = residual_block_model()
    with caplog.at_level(logging.INFO, logger="onnx_qat.calibration.parallel"):
        onnx_qat.calibrate(model, {"input": _images(16, 1, 8, 16)}, method="max", batch_size=2,
                           progress=False)
    assert not [r for r in caplog.records if "worker processes" in r.message]
    with pytest.raises(onnx_qat.ConfigError, match="workers must be a whole number >= 1"):
        onnx_qat.calibrate(model, {"input": _images(4, 1, 8, 16)}, workers=-1, progress=False)


@pytest.mark.parametrize("method,batches", [("max", 10), ("auto", 12), ("auto", 2)])
def test_the_estimated_worker_count_times_the_second_batch_and_keeps_the_ranges(monkeypatch, method, batches):
    """With the worker count estimated (the default), the first two batches run in this process and
    the second one's time decides; the rest go to workers from batch 2 on: the ranges (and ``auto``'s
    kept table and cosines, from the check batches in data order) are those of one process, bit for bit."""
    from onnx_qat.calibration import parallel
    from onnx_qat.runtime import workers

    model = residual_block_model(projection=True)
    data = {"input": _images(batches, 3, 8, 16)}  # one run per sample: the model's input has batch 1
    kw = dict(method=method, progress=False)
    one = onnx_qat.calibrate(model, data, workers=1, **kw)
    timed = []
    original = parallel._worker_count

    def recorded(spec, model_, first, observers, seconds, rest, build=0.0):
        timed.append(rest)
        return original(spec, model_, first, observers, seconds, rest, build)

    monkeypatch.setattr(parallel, "_worker_count", recorded)
    monkeypatch.setattr(workers, "pays_off", lambda serial, overhead, count: count > 1)
    monkeypatch.setattr(workers, "default_workers", lambda *a, **k: 2)
    split = onnx_qat.calibrate(model, data, **kw)
    assert timed == [batches - 2 if batches > 2 else batches - 1]  # two batches here before the estimate
    assert one.activations == split.activations  # float equality: bit for bit
    assert one.metadata == split.metadata and one.bounds == split.bounds


def test_cli_calibrate_workers(tmp_path):
    support.save(residual_block_model(projection=True), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", input=_images(24, 2, 8, 16))
    for n in (1, 2):
        assert main(["calibrate", str(tmp_path / "m.onnx"), "--data", str(tmp_path / "d.npz"), "-o",
                     str(tmp_path / f"s{n}.json"), "--method", "entropy", "--batch-size", "3", "--workers",
                     str(n), "--no-progress", "-q"]) == EXIT_OK
    one, two = (json.loads((tmp_path / f"s{n}.json").read_text()) for n in (1, 2))
    assert one == two


def test_workers_are_refused_where_there_is_nothing_to_spread(tmp_path):
    """A rewrite from given scales and --optimize accuracy run in this process: asking for workers
    there is one line (exit 2 on the command line), never silently ignored, and nothing is written."""
    model = residual_block_model(projection=True)
    data = {"input": _images(16, 3, 8, 16)}
    table = onnx_qat.calibrate(model, data, method="max", workers=1, progress=False)
    for kw in ({"scales": table, "workers": 2}, {"scales": table, "ray": True},
               {"data": data, "optimize": "accuracy", "workers": 2}):
        with pytest.raises(onnx_qat.ConfigError, match="do not apply to a rewrite from scales alone"):
            onnx_qat.quantize(model, progress=False, **kw)
    assert onnx_qat.quantize(model, scales=table, progress=False).model is not None
    support.save(model, tmp_path / "m.onnx")
    table.save(str(tmp_path / "s.json"))
    out = tmp_path / "q.onnx"
    code = main(["quantize", str(tmp_path / "m.onnx"), "--scales", str(tmp_path / "s.json"), "-o", str(out),
                 "--workers", "2", "--no-progress", "-q"])
    assert code == 2 and not out.exists()
