"""tf_bridge.load_model: safe mode always, one ModelError line per bad archive, QAT round trip.

The malicious archive is a real ``.keras`` file: a Lambda layer whose Python lambda (saved by
Keras as marshalled bytecode) creates a marker file in the working directory when it runs.
A control test loads it with Keras's ``safe_mode=False`` and sees the marker appear, so the
payload is live; tf_bridge.load_model must refuse it without the marker appearing.
"""
import hashlib
import json
import os
import warnings
import zipfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

import tf_bridge  # noqa: E402
from tests.reliability import support  # noqa: E402
from onnx_qat.errors import ModelError  # noqa: E402

pytestmark = pytest.mark.tf

MARKER = "tf_bridge_payload_ran"


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line(err, path):
    message = str(err)
    assert type(err) is ModelError
    assert "\n" not in message and len(message) < 600 and "Traceback" not in message, message
    assert message.startswith(f"{path}: "), message
    return message


@pytest.fixture
def payload(tmp_path, monkeypatch):
    """``evil.keras``: Input -> Lambda(payload); the working directory is ``tmp_path``."""
    monkeypatch.chdir(tmp_path)
    inp = keras.Input((3,), name="x")
    # the file name is a literal: the bytecode must not depend on this module's globals
    out = keras.layers.Lambda(lambda x: (open("tf_bridge_payload_ran", "w").close(), x)[1], name="evil")(inp)
    path = tmp_path / "evil.keras"
    keras.Model(inp, out).save(path)
    os.remove(MARKER)  # building the model ran the lambda once
    return path


def _rewrite_config(src, dst, change):
    """Copy a .keras archive with its config.json changed by ``change(config)``."""
    with zipfile.ZipFile(src) as archive:
        items = {name: archive.read(name) for name in archive.namelist()}
    config = json.loads(items["config.json"])
    change(config)
    items["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(dst, "w") as archive:
        for name, data in items.items():
            archive.writestr(name, data)
    return dst


def _dense_archive(tmp_path):
    inp = keras.Input((3,), name="x")
    path = tmp_path / "dense.keras"
    keras.Model(inp, keras.layers.Dense(2, activation="relu", name="fc")(inp), name="dense").save(path)
    return path


def test_the_payload_is_live_when_safe_mode_is_off(payload, tmp_path):
    """Control: Keras's unsafe mode runs the archive's bytecode (creates the marker)."""
    assert not (tmp_path / MARKER).exists()
    keras.models.load_model(payload, safe_mode=False)
    assert (tmp_path / MARKER).exists()


def test_lambda_bytecode_is_refused_without_running(payload, tmp_path):
    digest = _sha(payload)
    with support.raises_input_error(ModelError) as info:
        tf_bridge.load_model(payload)
    message = _one_line(info.value, payload)
    assert "unsafe deserialization refused: layer 'evil' holds a Python lambda" in message
    assert not (tmp_path / MARKER).exists()
    assert _sha(payload) == digest


def test_lambda_is_refused_even_with_unsafe_deserialization_enabled_globally(payload, tmp_path):
    from keras.src.backend.common import global_state

    previous = global_state.get_global_attribute("safe_mode_saving")
    keras.config.enable_unsafe_deserialization()
    try:
        with support.raises_input_error(ModelError, match="unsafe deserialization refused"):
            tf_bridge.load_model(payload)
    finally:
        global_state.set_global_attribute("safe_mode_saving", previous)
    assert not (tmp_path / MARKER).exists()


def test_non_modeling_function_in_the_config_is_refused_by_safe_mode(tmp_path):
    """An activation naming ``keras.utils.get_file`` (which would download a file): Keras's
    safe mode refuses it; the line says so and names the function."""
    def gadget(config):
        layer = next(entry for entry in config["config"]["layers"] if entry["class_name"] == "Dense")
        layer["config"]["activation"] = {"module": "keras.utils", "class_name": "function",
                                         "config": "get_file", "registered_name": "get_file"}

    path = _rewrite_config(_dense_archive(tmp_path), tmp_path / "gadget.keras", gadget)
    with support.raises_input_error(ModelError) as info:
        tf_bridge.load_model(path)
    message = _one_line(info.value, path)
    assert "unsafe deserialization refused (Keras safe mode)" in message
    assert "keras.utils.get_file" in message


def _bad_archive(tmp_path, kind):
    if kind == "missing":
        return tmp_path / "missing.keras", "no such file"
    if kind == "directory":
        path = tmp_path / "saved.keras"
        path.mkdir()
        return path, "is a directory"
    if kind == "h5":
        path = tmp_path / "model.h5"
        path.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(64))
        return path, "not a .keras archive (suffix '.h5')"
    if kind == "random":
        path = tmp_path / "random.keras"
        path.write_bytes(np.random.default_rng(0).bytes(256))
        return path, "not a .keras archive (not a readable zip file"
    if kind == "truncated":
        path = _dense_archive(tmp_path)
        path.write_bytes(path.read_bytes()[:200])
        return path, "not a .keras archive"
    if kind == "zip_without_config":
        path = tmp_path / "other.keras"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("readme.txt", "not a model")
        return path, "a zip file without config.json"
    if kind == "config_not_json":
        path = tmp_path / "badjson.keras"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("config.json", "{not json")
        return path, "config.json is not JSON"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "directory", "h5", "random", "truncated", "zip_without_config",
                                  "config_not_json"])
def test_not_a_keras_archive_is_one_line(tmp_path, kind):
    path, expected = _bad_archive(tmp_path, kind)
    before = {p.name: (_sha(p) if p.is_file() else None) for p in tmp_path.iterdir()}
    with support.raises_input_error(ModelError) as info:
        tf_bridge.load_model(path)
    assert expected in _one_line(info.value, path)
    assert {p.name: (_sha(p) if p.is_file() else None) for p in tmp_path.iterdir()} == before


class Unregistered(keras.layers.Layer):
    """A custom layer Keras cannot find by name (not registered)."""

    def call(self, x):
        return 2.0 * x


def test_unknown_custom_layer_is_named_and_custom_objects_load_it(tmp_path):
    inp = keras.Input((3,), name="x")
    path = tmp_path / "custom.keras"
    keras.Model(inp, Unregistered(name="double")(inp)).save(path)
    with support.raises_input_error(ModelError) as info:
        tf_bridge.load_model(path)
    message = _one_line(info.value, path)
    assert "unknown Keras class 'Unregistered'" in message and "custom_objects" in message
    loaded = tf_bridge.load_model(path, custom_objects={"Unregistered": Unregistered})
    x = np.arange(6, dtype="float32").reshape(2, 3)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0), 2.0 * x)


def _trained_qat_model():
    keras.utils.set_random_seed(3)
    L = keras.layers
    inp = keras.Input((8, 8, 3), name="image")
    x = L.Conv2D(4, 3, padding="same", use_bias=False, name="conv")(inp)
    x = L.BatchNormalization(name="bn")(x)
    x = L.ReLU(name="relu")(x)
    x = L.GlobalAveragePooling2D(name="gap")(x)
    model = keras.Model(inp, L.Dense(3, name="logits")(x), name="tiny")
    q_model = tf_bridge.quantize_model(model)
    rng = np.random.default_rng(0)
    data, labels = rng.normal(size=(32, 8, 8, 3)).astype("float32"), rng.integers(0, 3, 32)
    with warnings.catch_warnings():  # the float model's BatchNorm is untrained here, on purpose
        warnings.simplefilter("ignore", tf_bridge.UntrainedBatchNormWarning)
        tf_bridge.calibrate(q_model, data, progress=False)
    q_model.compile(keras.optimizers.Adam(1e-2),
                    keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    q_model.fit(data, labels, batch_size=16, epochs=1, verbose=0)
    return q_model, data


def test_saved_qat_model_reloads_with_identical_outputs_and_ranges(tmp_path):
    q_model, data = _trained_qat_model()
    path = tmp_path / "qat.keras"
    q_model.save(path)
    digest = _sha(path)
    loaded = tf_bridge.load_model(path)
    assert _sha(path) == digest
    assert {type(layer).__name__ for layer in loaded.layers} >= {"ActivationQuantizer", "QuantizeWrapper"}
    np.testing.assert_array_equal(loaded.predict(data, verbose=0), q_model.predict(data, verbose=0))
    original, reloaded = tf_bridge.quantizer_records(q_model), tf_bridge.quantizer_records(loaded)
    assert len(original) == len(reloaded) > 0
    for a, b in zip(original, reloaded):
        assert (a.path, a.tensor) == (b.path, b.tensor)
        np.testing.assert_array_equal(a.amax, b.amax)
