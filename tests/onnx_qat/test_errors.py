"""Helpers of the error module."""


def test_brief_shortens_foreign_messages_to_one_line():
    from onnx_qat.errors import brief

    exc = ValueError("first line\n  second   line " + "x" * 300)
    assert brief(exc, first_line=True) == "first line"
    assert brief(ValueError("y" * 250), 200, first_line=True) == "y" * 200
    assert brief(ValueError("y" * 250), None, first_line=True) == "y" * 250
    folded = brief(exc, 30)
    assert folded == "first line second line xxxxxxx..." and "\n" not in folded
    assert brief(KeyError()) == "KeyError"


INPUT_ERRORS = ("ModelError", "DataError", "ScalesError", "ConfigError", "PlacementError", "OutputError",
                "ExportError")


def test_input_caused_errors_are_value_errors_under_one_base():
    import onnx_qat
    from onnx_qat import errors

    for name in INPUT_ERRORS:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.QatError) and issubclass(cls, ValueError), name
        assert getattr(onnx_qat, name) is cls
        err = cls("bad  input\n in two lines")
        assert str(err) == "bad input in two lines" and err.args == ("bad input in two lines",)
    # the base and the machine's own shortcoming are not about a value
    assert not issubclass(errors.QatError, ValueError)
    assert not issubclass(errors.TensorRTUnavailable, ValueError)
    assert issubclass(errors.TensorRTUnavailable, errors.QatError)


def test_except_value_error_catches_a_real_bad_input(tmp_path):
    import onnx_qat
    from onnx_qat.errors import ConfigError, ModelError

    missing = tmp_path / "missing.onnx"
    try:
        onnx_qat.load_model(missing)
    except ValueError as exc:
        caught = exc
    assert type(caught) is ModelError and str(missing) in str(caught)
    try:
        onnx_qat.ScaleTable({"x": 1.0}).save(tmp_path)  # a directory
    except ValueError as exc:
        caught = exc
    assert isinstance(caught, onnx_qat.OutputError)
    try:
        onnx_qat.quantize(missing)  # neither scales nor data
    except ValueError as exc:
        caught = exc
    assert type(caught) is ConfigError and "exactly one of scales" in str(caught)
