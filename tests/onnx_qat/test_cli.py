"""The onnx-qat command line: exit codes, one-line errors, fast --help, and end-to-end runs."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat import cli
from onnx_qat.cli import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, get_parser, main
from tests.builders import conv_bn_relu_model, random_inputs, residual_block_model
from tests.onnx_qat.test_check import good_block

HEAVY = ("numpy", "onnx", "onnxruntime", "onnx_graphsurgeon", "tensorflow")
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def run_cli(*args):
    """``onnx-qat`` in a subprocess (``python -m onnx_qat``)."""
    return subprocess.run([sys.executable, "-m", "onnx_qat", *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=300)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("onnx-qat: error: ") and "Traceback" not in err
    return lines[0]


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def good_qdq(tmp_path):
    path = tmp_path / "good_qdq.onnx"
    onnx.save(good_block().model(), str(path))
    return path


@pytest.fixture
def bad_qdq(tmp_path):
    b = good_block()
    b.inits[[i.name for i in b.inits].index("x_q_zp")].data_type = onnx.TensorProto.UINT8
    path = tmp_path / "bad_qdq.onnx"
    onnx.save(b.model(), str(path))
    return path


@pytest.fixture
def float_cnn(tmp_path):
    """A ResNet basic block (Conv/BN/Relu, identity shortcut) and 8 calibration samples."""
    model = residual_block_model()
    path, data = tmp_path / "cnn.onnx", tmp_path / "calib.npz"
    onnx.save(model, str(path))
    feeds = random_inputs(model, num=8, seed=1)
    np.savez(data, **feeds)
    return path, data


# -- parser and --help ----------------------------------------------------------------------------
def test_help_does_not_import_heavy_modules():
    code = ("import sys, onnx_qat.cli as c; c.get_parser().format_help(); "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    assert out.stdout.strip() == "[]"


def test_help_lists_every_command_and_exits_0():
    out = run_cli("--help")
    assert out.returncode == 0 and out.stderr == ""
    for command in ("calibrate", "quantize", "check", "compare", "inspect"):
        assert command in out.stdout
    for command in ("calibrate", "quantize", "check", "compare", "inspect"):
        assert main([command, "--help"]) == EXIT_OK


def test_console_script_and_module_agree():
    from pathlib import Path
    script = Path(sys.executable).parent / "onnx-qat"
    if not script.exists():
        pytest.skip("the onnx-qat console script is not installed in this environment")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, env=ENV, timeout=60)
    expected = f"onnx-qat {onnx_qat.__version__}\n"
    assert done.returncode == 0 and done.stdout == run_cli("--version").stdout == expected


def test_version(capsys):
    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == f"onnx-qat {onnx_qat.__version__}"


def test_parser_options_are_api_keywords():
    args = get_parser().parse_args(["quantize", "m.onnx", "-o", "o.onnx", "--data", "d.npz",
                                    "--method", "entropy", "--exclude-nodes", "conv1", "stem.*",
                                    "--exclude-op-types", "Gemm",
                                    "--min-channels", "8", "--include-attention", "--target", "ort-cpu"])
    assert cli._placement_keywords(args) == {
        "exclude_nodes": ("conv1", "stem.*"), "exclude_op_types": ("Gemm",), "min_channels": 8,
        "include_attention": True, "target": "ort-cpu"}
    assert cli._calibration_keywords(args) == {"method": "entropy"}
    from onnx_qat.config import QuantizeConfig
    QuantizeConfig(**cli._placement_keywords(args))  # every placement option is a QuantizeConfig field


def test_global_options_before_or_after_the_command():
    args = get_parser().parse_args(["--no-progress", "check", "m.onnx", "-q"])
    assert args.no_progress and args.quiet and args.verbose == 0
    args = get_parser().parse_args(["check", "m.onnx", "-vv"])
    assert args.verbose == 2 and not args.quiet


# -- check ------------------------------------------------------------------------------------------
def test_check_exit_0_on_a_good_model(good_qdq, capsys):
    assert main(["check", str(good_qdq)]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("PASSED") and "4 QuantizeLinear" in out


def test_check_exit_1_names_rule_and_node(bad_qdq, capsys):
    assert main(["check", str(bad_qdq)]) == EXIT_PROBLEMS
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ERROR") and "C4" in out[0] and "x_q:" in out[0]
    assert out[-1].startswith("FAILED")


def test_check_json_and_quiet(bad_qdq, capsys):
    assert main(["check", str(bad_qdq), "--json"]) == EXIT_PROBLEMS
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is False and data["findings"][0]["rule"] == "C4"
    assert main(["check", str(bad_qdq), "--quiet"]) == EXIT_PROBLEMS
    assert capsys.readouterr().out == ""


def test_check_subprocess_exit_codes(good_qdq, bad_qdq):
    assert run_cli("check", good_qdq).returncode == 0
    out = run_cli("check", bad_qdq, "--json")
    assert out.returncode == 1 and json.loads(out.stdout)["num_errors"] == 1


# -- one-line errors, exit 2 ------------------------------------------------------------------------
def test_missing_model_path(tmp_path, capsys):
    missing = tmp_path / "nope.onnx"
    for argv in (["check", missing], ["inspect", missing],
                 ["quantize", missing, "-o", tmp_path / "o.onnx", "--scales", tmp_path / "s.json"],
                 ["compare", missing, missing, "--data", tmp_path / "d.npz"],
                 ["calibrate", missing, "--data", tmp_path / "d.npz", "-o", tmp_path / "s.json"]):
        assert main([str(a) for a in argv]) == EXIT_USAGE, argv
        line = one_error_line(capsys.readouterr().err)
        assert "nope.onnx" in line or "d.npz" in line or "s.json" in line
    assert not (tmp_path / "o.onnx").exists() and not (tmp_path / "s.json").exists()


@pytest.mark.parametrize("content", [b"", b"\x08\x96\x01garbage\xff" * 20, b'{"format": "onnx"}'])
def test_garbage_model_is_one_line_exit_2(tmp_path, content):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(content)
    out = run_cli("check", path)
    assert out.returncode == 2
    assert "garbage.onnx" in one_error_line(out.stderr)


def test_unknown_subcommand_and_option():
    out = run_cli("frobnicate", "x.onnx")
    assert out.returncode == 2 and "frobnicate" in one_error_line(out.stderr)
    out = run_cli("check", "x.onnx", "--no-such-option")
    assert out.returncode == 2 and "--no-such-option" in one_error_line(out.stderr)
    out = run_cli()
    assert out.returncode == 2 and "COMMAND" in one_error_line(out.stderr)


@pytest.mark.parametrize("argv,words", [
    (["calibrate", "m.onnx", "--data", "d.npz", "-o", "s.json", "--batch-size", "0"], "--batch-size"),
    (["calibrate", "m.onnx", "--data", "d.npz", "-o", "s.json", "--method", "median"], "--method"),
    (["calibrate", "m.onnx", "--data", "d.npz", "-o", "s.json", "--percentile", "120"], "--percentile"),
    (["inspect", "m.onnx", "--min-channels", "-3"], "--min-channels"),
    (["compare", "a.onnx", "b.onnx", "--data", "d.npz", "--min-cosine", "abc"], "--min-cosine"),
    (["quantize", "m.onnx", "-o", "o.onnx", "--data", "d.npz", "--target", "gpu"], "--target"),
    (["inspect", "m.onnx", "--exclude-nodes", "conv[1"], "regular expression"),
])
def test_bad_option_values_are_usage_errors(argv, words, capsys):
    assert main(argv) == EXIT_USAGE
    assert words in one_error_line(capsys.readouterr().err)


def test_bad_regex_in_subprocess():
    out = run_cli("quantize", "m.onnx", "-o", "o.onnx", "--data", "d.npz", "--exclude-nodes", "(")
    assert out.returncode == 2 and "invalid regular expression" in one_error_line(out.stderr)


@pytest.mark.parametrize("extra,words", [
    ([], "one of the arguments --data --scales is required"),
    (["--data", "d.npz", "--scales", "s.json"], "not allowed with"),
    (["--scales", "s.json", "--method", "entropy"], "--method applies only with --data"),
    (["--data", "d.npz", "--method", "max", "--percentile", "99"], "--percentile applies only"),
])
def test_quantize_data_and_scales_rules(tmp_path, capsys, extra, words):
    model = tmp_path / "m.onnx"
    onnx.save(conv_bn_relu_model(), str(model))
    assert main(["quantize", str(model), "-o", str(tmp_path / "o.onnx"), *extra]) == EXIT_USAGE
    assert words in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o.onnx").exists()


def test_quantize_refuses_to_overwrite_its_input(tmp_path, capsys):
    from onnx_qat.scales import ScaleTable
    model, scales = tmp_path / "m.onnx", tmp_path / "s.json"
    onnx.save(conv_bn_relu_model(), str(model))
    ScaleTable({"input": 1.0}).save(scales)
    before = sha(model)
    assert main(["quantize", str(model), "-o", str(model), "--scales", str(scales)]) == EXIT_USAGE
    assert "is the input file" in one_error_line(capsys.readouterr().err)
    assert sha(model) == before
    assert main(["quantize", str(model), "-o", str(tmp_path), "--scales", str(scales)]) == EXIT_USAGE
    assert "directory" in one_error_line(capsys.readouterr().err)
    assert main(["quantize", str(model), "-o", str(tmp_path / "no" / "o.onnx"), "--scales", str(scales)]) == 2
    assert "does not exist" in one_error_line(capsys.readouterr().err)
    assert main(["quantize", str(model), "-o", str(tmp_path / "o.onnx"), "--scales", str(scales),
                 "--report", str(tmp_path / "o.onnx")]) == EXIT_USAGE
    assert "same file" in one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "s.json"]


# -- unexpected errors and interrupts -----------------------------------------------------------------
def _raise(exc):
    def handler(args):
        raise exc
    return handler


def test_unexpected_exception_is_one_line_then_traceback_with_verbose(monkeypatch, good_qdq, capsys):
    monkeypatch.setattr(cli, "cmd_check", _raise(RuntimeError("boom\nsecond line")))
    assert main(["check", str(good_qdq)]) == EXIT_INTERNAL
    line = one_error_line(capsys.readouterr().err)
    assert "RuntimeError: boom" in line and "re-run with --verbose" in line
    assert main(["check", str(good_qdq), "--verbose"]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("onnx-qat: error: internal error")


def test_user_error_traceback_only_with_verbose(tmp_path, capsys):
    assert main(["check", str(tmp_path / "x.onnx"), "-v"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" in err and "ModelError" in err


def test_keyboard_interrupt_exits_130(monkeypatch, good_qdq, capsys):
    monkeypatch.setattr(cli, "cmd_check", _raise(KeyboardInterrupt()))
    assert main(["check", str(good_qdq)]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "onnx-qat: interrupted"


def test_sigterm_unwinds_and_exits_143(monkeypatch, good_qdq, capsys):
    import signal

    def handler(args):
        signal.raise_signal(signal.SIGTERM)  # a real signal, turned into an exception by main()
        raise AssertionError("not reached")

    monkeypatch.setattr(cli, "cmd_check", handler)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["check", str(good_qdq)]) == cli.EXIT_TERMINATED == 143
    assert capsys.readouterr().err.strip() == "onnx-qat: terminated"
    assert signal.getsignal(signal.SIGTERM) == before


def test_logging_is_routed_and_restored(monkeypatch, good_qdq, capsys):
    import logging

    def handler(args):
        logging.getLogger("onnx_qat.something").info("an info line")
        logging.getLogger("onnx_qat.something").debug("a debug line")
        return 0

    monkeypatch.setattr(cli, "cmd_check", handler)
    logger = logging.getLogger("onnx_qat")
    before = (list(logger.handlers), logger.level, logger.propagate)
    assert main(["check", str(good_qdq), "-v"]) == 0
    err = capsys.readouterr().err
    assert "onnx-qat: INFO: an info line" in err and "debug line" not in err
    assert main(["check", str(good_qdq)]) == 0
    assert capsys.readouterr().err == ""
    assert (list(logger.handlers), logger.level, logger.propagate) == before


# -- end to end (needs the rewriter, calibration, placement and compare) ------------------------------
def _save_scales(model, path, seed: int) -> None:
    """A ScaleTable JSON at ``path`` with the amax of every tensor of ``model`` on one random input."""
    from tests.builders import amax_table
    proto = onnx.load(str(model))
    amax_table(proto, random_inputs(proto, num=1, seed=seed)).save(path)


def test_quantize_from_scales_then_check(float_cnn, tmp_path, capsys):
    model, _ = float_cnn
    scales, out, report = tmp_path / "s.json", tmp_path / "q.onnx", tmp_path / "r.json"
    _save_scales(model, scales, seed=2)
    before = (sha(model), sha(scales))
    code = main(["quantize", str(model), "-o", str(out), "--scales", str(scales), "--report", str(report),
                 "--no-progress"])
    text = capsys.readouterr().out.splitlines()
    assert code == EXIT_OK, text
    assert text[0].startswith(f"wrote {out} | target tensorrt | 3 activations and 3 weights quantized")
    assert text[1].startswith("check: PASSED")
    assert (sha(model), sha(scales)) == before
    rep = json.loads(report.read_text())
    assert rep["check"]["passed"] is True and rep["check"]["num_q"] == 3 and rep["summary"]["weights"] == 3
    checked = run_cli("check", out, "--json")
    assert checked.returncode == 0 and json.loads(checked.stdout)["findings"] == []
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["calib.npz", "cnn.onnx", "q.onnx", "r.json", "s.json"]


def test_quantize_post_write_check_equals_check_of_the_written_file(float_cnn, tmp_path, capsys):
    from onnx_qat.check import check
    model, _ = float_cnn
    scales, out, report = tmp_path / "s.json", tmp_path / "q.onnx", tmp_path / "r.json"
    _save_scales(model, scales, seed=2)
    assert main(["quantize", str(model), "-o", str(out), "--scales", str(scales), "--report", str(report),
                 "--no-progress"]) == EXIT_OK
    printed = capsys.readouterr().out.splitlines()
    from_file = check(str(out))
    assert json.loads(report.read_text())["check"] == from_file.to_dict()
    assert f"check: {from_file.summary()}" in printed and str(out) in from_file.summary()


def test_quantize_is_byte_identical_across_processes(float_cnn, tmp_path):
    model, _ = float_cnn
    scales = tmp_path / "s.json"
    _save_scales(model, scales, seed=3)
    hashes = []
    for run, seed in enumerate(("1", "2")):
        out, rep = tmp_path / f"q{run}.onnx", tmp_path / f"r{run}.json"
        env = {**ENV, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-m", "onnx_qat", "quantize", str(model), "-o", str(out),
                               "--scales", str(scales), "--report", str(rep), "-q"], capture_output=True,
                              text=True, env=env, timeout=300)
        assert done.returncode == 0 and done.stdout == "", done.stderr
        hashes.append((sha(out), json.loads(rep.read_text())["inserted"]))
    assert hashes[0][0] == hashes[1][0] and hashes[0][1] == hashes[1][1]


def _target_ready(name: str) -> bool:
    try:
        from onnx_qat.insertion.targets import get_target
        get_target(name)
        return True
    except Exception:
        return False


@pytest.mark.skipif(not _target_ready("ort-cpu"), reason="the ort-cpu target is not available yet")
def test_quantize_for_ort_cpu_runs_the_ort_cpu_check(float_cnn, tmp_path, capsys):
    model, _ = float_cnn
    scales, out = tmp_path / "s.json", tmp_path / "q.onnx"
    _save_scales(model, scales, seed=2)
    assert main(["quantize", str(model), "-o", str(out), "--scales", str(scales), "--target", "ort-cpu",
                 "--no-progress"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "target ort-cpu" in text and "check (ort-cpu rules): PASSED" in text
    # The CPU form uses uint8 activations on purpose: TensorRT's check refuses it (rule C4) ...
    assert main(["check", str(out), "--json"]) == EXIT_PROBLEMS
    assert "C4" in {f["rule"] for f in json.loads(capsys.readouterr().out)["findings"]}
    # ... and the rules that apply to the CPU form find no error.
    assert main(["check", str(out), "--target", "ort-cpu", "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and not [f for f in report["findings"] if f["severity"] == "error"]


def test_quantize_already_quantized_model_is_refused(good_qdq, tmp_path, capsys):
    scales = tmp_path / "s.json"
    from onnx_qat.scales import ScaleTable
    ScaleTable({"x": 1.0}).save(scales)
    assert main(["quantize", str(good_qdq), "-o", str(tmp_path / "q.onnx"), "--scales", str(scales)]) == 2
    assert "already quantized" in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "q.onnx").exists()


def test_quantize_then_check_then_compare(float_cnn, tmp_path, capsys):
    model, data = float_cnn
    out, report = tmp_path / "q.onnx", tmp_path / "report.json"
    before = (sha(model), sha(data))
    code = main(["quantize", str(model), "-o", str(out), "--data", str(data), "--report", str(report),
                 "--no-progress"])
    text = capsys.readouterr().out
    assert code == EXIT_OK, text
    assert f"wrote {out}" in text and "PASSED" in text
    assert (sha(model), sha(data)) == before
    rep = json.loads(report.read_text())
    assert rep["check"]["passed"] is True and rep["check"]["num_q"] > 0
    assert run_cli("check", out).returncode == 0
    assert main(["compare", str(model), str(out), "--data", str(data), "--min-cosine", "0.98"]) == EXIT_OK
    assert "PASSED" in capsys.readouterr().out
    assert main(["compare", str(model), str(out), "--data", str(data), "--max-abs", "1e-9", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)


def test_calibrate_then_quantize_from_scales(float_cnn, tmp_path, capsys):
    model, data = float_cnn
    scales, out = tmp_path / "s.json", tmp_path / "q.onnx"
    assert main(["calibrate", str(model), "--data", str(data), "-o", str(scales), "--method", "percentile",
                 "--percentile", "99.9", "--no-progress"]) == EXIT_OK
    table = json.loads(scales.read_text())
    assert table["format"] == "onnx-qat-scales" and table["activations"]
    assert all(v > 0 for v in table["activations"].values())
    assert table["producer"].endswith("percentile)") or "percentile" in table["producer"]
    assert capsys.readouterr().out.startswith(f"wrote {scales}: 3 activation ranges")
    assert main(["quantize", str(model), "-o", str(out), "--scales", str(scales), "-q"]) == EXIT_OK
    assert capsys.readouterr().out == ""
    assert onnx.load(str(out)).graph.node


def test_quantize_excluding_every_conv_is_reported(float_cnn, tmp_path, capsys):
    model, data = float_cnn
    code = main(["quantize", str(model), "-o", str(tmp_path / "q.onnx"), "--data", str(data),
                 "--exclude-op-types", "Conv", "--no-progress"])
    err = capsys.readouterr().err
    # Nothing left to quantize: either a clear one-line refusal (2) or a written model that check accepts (0).
    assert code in (EXIT_OK, EXIT_USAGE)
    if code == EXIT_USAGE:
        one_error_line(err)


@pytest.mark.parametrize("make,words", [
    (lambda x: {"input": x, "extra": x}, "extra"),
    (lambda x: {"input": np.where(x > 1, np.nan, x).astype(np.float32)}, "NaN"),
    (lambda x: {"input": x[:, :3]}, "input"),
    (lambda x: {"input": np.array([["a"]], dtype=object)}, "never loaded"),
])
def test_bad_calibration_data_is_one_line_and_writes_nothing(float_cnn, tmp_path, make, words):
    model, _ = float_cnn
    data = tmp_path / "bad.npz"
    feeds = random_inputs(onnx.load(str(model)), num=2, seed=0)
    np.savez(data, **make(feeds["input"]))
    before = sha(data)
    out = run_cli("calibrate", model, "--data", data, "-o", tmp_path / "s.json", "--no-progress")
    assert out.returncode == 2, out.stderr
    assert words in one_error_line(out.stderr)
    assert sha(data) == before and not (tmp_path / "s.json").exists()


def test_inspect_prints_every_decision(float_cnn, capsys):
    model, _ = float_cnn
    assert main(["inspect", str(model)]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:5] == ["NODE", "OP", "ACTION", "RULE", "REASON"]
    body = "\n".join(out)
    for node in ("stem_conv", "conv1", "conv2", "add"):
        assert node in body
    assert main(["inspect", str(model), "--json", "--exclude-nodes", "conv2"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    conv2 = [d for d in data["decisions"] if d["node"] == "conv2"]
    assert conv2 and conv2[0]["action"] == "skip"
