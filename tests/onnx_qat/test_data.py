"""Data loading: the .npz format, validation errors, batching and generated data."""
from __future__ import annotations

import hashlib
import pickle
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnx_qat.io.data import Dataset, generate_data, load_data
from onnx_qat.errors import DataError
from onnx_qat.io.models import InputSpec, model_input_specs


def _two_input_model() -> onnx.ModelProto:
    """x: float32[N,4], ids: int64[N,3], mask: bool[N,3] -> y = x + ReduceSum(ids * mask)."""
    nodes = [
        helper.make_node("Cast", ["mask"], ["mask_i"], to=TensorProto.INT64),
        helper.make_node("Mul", ["ids", "mask_i"], ["masked"]),
        helper.make_node("ReduceSum", ["masked"], ["s"], keepdims=1),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "sf"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 3]),
        helper.make_tensor_value_info("mask", TensorProto.BOOL, ["N", 3]),
    ], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _single_input_model(shape=("N", 3, 4)) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["inp"], ["y"])], "g",
                              [helper.make_tensor_value_info("inp", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def _good(n=5):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, 4)).astype(np.float32),
            "ids": rng.integers(0, 9, (n, 3)).astype(np.int64),
            "mask": rng.random((n, 3)) < 0.5}


def _save(tmp_path: Path, arrays, name="d.npz") -> Path:
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def test_load_npz_and_batches(tmp_path):
    path = _save(tmp_path, _good(5))
    data = load_data(path, _two_input_model())
    assert isinstance(data, Dataset)
    assert data.num_samples == 5 and data.input_names == ("x", "ids", "mask")
    batches = list(data.batches(2))
    assert [b["x"].shape[0] for b in batches] == [2, 2, 1]
    assert batches[0]["ids"].dtype == np.int64 and batches[0]["mask"].dtype == np.bool_
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), _good(5)["x"])
    assert data.take(3).num_samples == 3 and data.num_batches(2) == 3


def test_float64_and_int32_cast_safely_without_mutating_caller():
    arrays = _good(3)
    arrays["x"] = arrays["x"].astype(np.float64)
    arrays["ids"] = arrays["ids"].astype(np.int32)
    before = arrays["x"].copy()
    data = load_data(arrays, _two_input_model())
    assert data.arrays["x"].dtype == np.float32 and data.arrays["ids"].dtype == np.int64
    assert arrays["x"].dtype == np.float64
    np.testing.assert_array_equal(arrays["x"], before)
    with pytest.raises(ValueError):
        data.arrays["x"][0, 0] = 1.0  # read-only


def test_single_input_any_key_and_bare_array(tmp_path):
    arr = np.ones((2, 3, 4), np.float32)
    path = _save(tmp_path, {"whatever": arr})
    assert load_data(path, _single_input_model()).input_names == ("inp",)
    assert load_data(arr, _single_input_model()).num_samples == 2


def test_fixed_batch_and_unbatched_inputs():
    fixed = load_data(np.ones((3, 3, 4), np.float32), _single_input_model(shape=(1, 3, 4)))
    assert [b["inp"].shape for b in fixed.batches(16)] == [(1, 3, 4)] * 3
    unbatched = load_data(np.ones((2, 3, 4), np.float32), _single_input_model(shape=(3, 4)))
    assert [b["inp"].shape for b in unbatched.batches(16)] == [(3, 4)] * 2


def _bad_cases():
    good = _good(4)
    cases = {
        "missing key": ({k: v for k, v in good.items() if k != "mask"}, "'mask' is missing"),
        "extra key": ({**good, "extra": good["x"]}, "'extra' is not a model input"),
        "wrong shape": ({**good, "x": np.ones((4, 5), np.float32)}, "needs [N,4]"),
        "wrong rank": ({**good, "x": np.ones((4,), np.float32)}, "has shape [4]"),
        "float for int64": ({**good, "ids": good["ids"].astype(np.float32)}, "does not convert safely"),
        "int for bool": ({**good, "mask": good["mask"].astype(np.int64)}, "does not convert safely"),
        "string array": ({**good, "x": np.array([["a"] * 4] * 4)}, "dtype <U1"),
        "nan": ({**good, "x": np.where(good["x"] > 0, np.nan, good["x"]).astype(np.float32)}, "NaN"),
        "inf": ({**good, "x": np.full((4, 4), np.inf, np.float32)}, "Inf"),
        "zero samples": ({k: v[:0] for k, v in good.items()}, "zero samples"),
        "sample counts differ": ({**good, "x": good["x"][:3]}, "different sample counts"),
        "float64 overflow": ({**good, "x": np.full((4, 4), 1e300)}, "Inf"),
    }
    return cases


@pytest.mark.parametrize("case", sorted(_bad_cases()))
def test_bad_npz_one_line_data_error(tmp_path, case):
    arrays, expected = _bad_cases()[case]
    path = _save(tmp_path, arrays)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(DataError) as info:
        load_data(path, _two_input_model(), what="calibration data")
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and expected in msg, msg
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


class _Boom:
    """Unpickling this object would write a marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "unpickled"))


def test_object_array_refused_never_unpickled(tmp_path):
    marker = tmp_path / "marker.txt"
    obj = np.empty((2,), dtype=object)
    obj[0] = _Boom(str(marker))
    obj[1] = 1
    path = tmp_path / "obj.npz"
    np.savez(path, x=obj, allow_pickle=True)
    with pytest.raises(DataError, match="pickled") as info:
        load_data(path, _single_input_model())
    assert "'x'" in str(info.value)
    assert not marker.exists()


def test_pickle_file_refused_never_unpickled(tmp_path):
    marker = tmp_path / "marker.txt"
    path = tmp_path / "p.npz"
    path.write_bytes(pickle.dumps({"inp": _Boom(str(marker))}))
    with pytest.raises(DataError, match="pickled"):
        load_data(path, _single_input_model())
    assert not marker.exists()


@pytest.mark.parametrize("content,expected", [(b"", "empty"), (b"PK\x03\x04garbage", "not a readable"),
                                              (b"random bytes here", "not an .npz archive")])
def test_unreadable_files(tmp_path, content, expected):
    path = tmp_path / "bad.npz"
    path.write_bytes(content)
    with pytest.raises(DataError, match=expected):
        load_data(path, _single_input_model())


def test_missing_file_directory_and_npy(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_data(tmp_path / "none.npz", _single_input_model())
    with pytest.raises(DataError, match="directory"):
        load_data(tmp_path, _single_input_model())
    npy = tmp_path / "a.npy"
    np.save(npy, np.ones((2, 3, 4), np.float32))
    with pytest.raises(DataError, match="single .npy"):
        load_data(npy, _single_input_model())


def test_generate_data_deterministic_and_valid():
    model = _two_input_model()
    a = generate_data(model, num_samples=6, seed=1)
    b = generate_data(model_input_specs(model), num_samples=6, seed=1)
    assert a.num_samples == 6
    for name in a.input_names:
        np.testing.assert_array_equal(a.arrays[name], b.arrays[name])
    assert a.arrays["ids"].dtype == np.int64 and a.arrays["mask"].dtype == np.bool_
    specs = (InputSpec("z", np.dtype(np.float32), (2, None, 5)),)
    c = generate_data(specs, num_samples=3)
    assert c.arrays["z"].shape == (4, 1, 5)  # rounded up to the fixed batch of 2


# --------------------------------------------------------------------------- streamed .npz files
def test_npz_is_streamed_and_batches_equal_the_arrays(tmp_path):
    arrays = _good(7)
    arrays["x"] = arrays["x"].astype(np.float64)  # cast to the model's float32 batch by batch
    path = _save(tmp_path, arrays)
    data = load_data(path, _two_input_model())
    assert data.streamed and data.num_samples == 7
    batches = list(data.batches(3))
    assert [b["x"].shape[0] for b in batches] == [3, 3, 1]
    assert all(b["x"].dtype == np.float32 and b["x"].flags.c_contiguous for b in batches)
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), arrays["x"].astype(np.float32))
    np.testing.assert_array_equal(np.concatenate([b["mask"] for b in batches]), arrays["mask"])
    assert data.arrays["ids"].dtype == np.int64 and not data.arrays["ids"].flags.writeable
    head = data.take(4)
    assert head.streamed and [b["ids"].shape[0] for b in head.batches(3)] == [3, 1]
    np.testing.assert_array_equal(np.concatenate([b["ids"] for b in head.batches(3)]), arrays["ids"][:4])
    again = load_data(data, _two_input_model())  # a Dataset re-validated stays in its file
    assert again.streamed and again.num_samples == 7


def test_compressed_and_column_major_members(tmp_path):
    arrays = _good(6)
    arrays["x"] = np.asfortranarray(arrays["x"])
    path = tmp_path / "c.npz"
    np.savez_compressed(path, **arrays)
    data = load_data(path, _two_input_model())
    got = {k: np.concatenate([b[k] for b in data.batches(4)]) for k in data.input_names}
    for key, value in arrays.items():
        np.testing.assert_array_equal(got[key], value)


def test_nonfinite_error_names_key_and_first_sample(tmp_path):
    x = np.random.default_rng(1).standard_normal((40, 3, 4)).astype(np.float32)
    x[23, 1, 2] = np.nan
    x[31] = np.inf
    path = _save(tmp_path, {"inp": x})
    with pytest.raises(DataError) as info:
        load_data(path, _single_input_model())
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg and "'inp'" in msg
    assert "1 NaN value(s) in sample 23" in msg, msg


def test_nonfinite_found_in_a_later_check_chunk(tmp_path, monkeypatch):
    import onnx_qat.io.data as data_module

    monkeypatch.setattr(data_module, "CHECK_CHUNK_BYTES", 3 * 4 * 4 * 2)  # two samples per check
    x = np.ones((9, 3, 4), np.float32)
    x[7, 0, 0] = -np.inf
    with pytest.raises(DataError, match=r"1 Inf value\(s\) in sample 7"):
        load_data(_save(tmp_path, {"inp": x}), _single_input_model())
    with pytest.raises(DataError, match=r"1 Inf value\(s\) in sample 7"):
        load_data(x, _single_input_model())  # the same line for arrays in memory


def test_truncated_member_and_foreign_member_are_data_errors(tmp_path):
    import zipfile

    x = np.ones((4, 3, 4), np.float32)
    npy = tmp_path / "x.npy"
    np.save(npy, x)
    short = tmp_path / "short.npz"
    with zipfile.ZipFile(short, "w") as archive:
        archive.writestr("inp.npy", npy.read_bytes()[:-20])
    with pytest.raises(DataError, match="'inp' is truncated") as info:
        load_data(short, _single_input_model())
    assert str(short) in str(info.value)
    foreign = tmp_path / "foreign.npz"
    with zipfile.ZipFile(foreign, "w") as archive:
        archive.writestr("notes.txt", "hello")
    with pytest.raises(DataError, match="'notes.txt' is not an .npy array"):
        load_data(foreign, _single_input_model())


def test_streamed_batches_hold_one_batch_in_memory(tmp_path):
    import tracemalloc

    x = np.random.default_rng(2).standard_normal((512, 3, 64, 64)).astype(np.float32)  # 24 MiB
    path = _save(tmp_path, {"inp": x})
    model = _single_input_model(shape=("N", 3, 64, 64))
    del x
    tracemalloc.start()
    try:
        data = load_data(path, model)
        _, load_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        total = 0.0
        for batch in data.batches(8):
            total += float(batch["inp"][:, 0, 0, 0].sum())
        _, run_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    batch_bytes = 8 * 3 * 64 * 64 * 4
    assert load_peak < 3 * 4 * 1024 ** 2, load_peak  # the check pass reads a few MiB at a time
    assert run_peak < 4 * batch_bytes, run_peak
    assert np.isfinite(total)


def test_header_claiming_more_than_the_file_holds_costs_no_memory(tmp_path):
    import io
    import tracemalloc
    import zipfile

    npy = io.BytesIO()
    np.lib.format.write_array_header_1_0(npy, {"descr": "<f4", "fortran_order": False,
                                               "shape": (4, 3, 4 * 10 ** 8)})
    npy.write(b"\0" * 64)
    path = tmp_path / "liar.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("inp.npy", npy.getvalue())
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="'inp' is truncated"):
            load_data(path, _single_input_model(shape=("N", 3, "M")))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 * 1024 ** 2, peak


def test_reads_larger_than_a_piece_are_joined_exactly(tmp_path, monkeypatch):
    import onnx_qat.io.npz as npz_module

    monkeypatch.setattr(npz_module, "_PIECE_BYTES", 100)  # every batch read in several pieces
    x = np.random.default_rng(3).standard_normal((10, 3, 4)).astype(np.float32)
    data = load_data(_save(tmp_path, {"inp": x}), _single_input_model())
    np.testing.assert_array_equal(np.concatenate([b["inp"] for b in data.batches(4)]), x)


def test_scalar_input_feeds_are_zero_dimensional(tmp_path):
    specs = (InputSpec("s", np.dtype(np.int64), ()),)
    for source in (np.arange(5, dtype=np.int32), _save(tmp_path, {"s": np.arange(5, dtype=np.int32)})):
        data = load_data(source, specs)
        feeds = [b["s"] for b in data.batches(3)]
        assert data.unbatched and [f.shape for f in feeds] == [()] * 5
        assert [int(f) for f in feeds] == [0, 1, 2, 3, 4] and feeds[0].dtype == np.int64
    np.savez(tmp_path / "zero_d.npz", s=np.int32(3))  # given once: one run with that value
    data = load_data(tmp_path / "zero_d.npz", specs)
    (feed,) = list(data.batches(4))
    assert data.num_samples == 1 and feed["s"].shape == () and feed["s"].dtype == np.int64 and feed["s"] == 3


@pytest.mark.parametrize("streamed", [False, True])
def test_spread_takes_samples_evenly_over_a_window(tmp_path, streamed):
    arrays = _good(40)
    data = load_data(_save(tmp_path, arrays) if streamed else arrays, _two_input_model())
    four = data.spread(4)  # over all 40 (fewer than 16 x 4)
    np.testing.assert_array_equal(four.arrays["x"], arrays["x"][[0, 13, 26, 39]])
    np.testing.assert_array_equal(four.arrays["mask"], arrays["mask"][[0, 13, 26, 39]])
    two = data.spread(2, window=4)  # over the first 8
    np.testing.assert_array_equal(two.arrays["ids"], arrays["ids"][[0, 7]])
    assert data.spread(50).num_samples == 40
    with pytest.raises(DataError):
        data.spread(0)
