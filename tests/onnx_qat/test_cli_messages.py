"""What a first-time user reads: every message is one exact line with its exit code, says what was
adapted or chosen, and nothing is written when a command refuses. One test per message."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnx_qat.cli import EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, get_parser, main
from tests.builders import GraphBuilder, outlier_channel_model


def conv_model(input_name: str = "images", dims=("batch", 3, "height", "width"), seed: int = 0):
    """images [batch, 3, height, width] -> Conv(16) -> Relu -> Conv(16) -> Relu -> Conv(4) -> out."""
    b = GraphBuilder("convs", seed)
    y = b.input(input_name, list(dims))
    y = b.relu(b.conv(y, 3, 16, "conv1"), "relu1")
    y = b.relu(b.conv(y, 16, 16, "conv2"), "relu2")
    b.node("Conv", [y, b.weight("conv3.weight", [4, 16, 1, 1])], "out", name="conv3", kernel_shape=[1, 1])
    b.output("out")
    return b.build()


def classifier_and_detector_model(seed: int = 0):
    """x [N, 8] -> Gemm -> Softmax -> ``scores`` [N, 10]; and MatMul -> Reshape -> ``boxes`` [N, 4, 6]
    (a detector-like output: its last axis is no class axis)."""
    b = GraphBuilder("heads", seed)
    x = b.input("x", ["N", 8])
    logits = b.node("Gemm", [x, b.weight("fc.weight", [8, 10])], name="fc")
    b.node("Softmax", [logits], "scores", name="softmax", axis=-1)
    flat = b.node("MatMul", [x, b.weight("box.weight", [8, 24])], name="box")
    b.node("Reshape", [flat, b.const("box.shape", np.array([-1, 4, 6], dtype=np.int64))], "boxes",
           name="reshape")
    b.output("scores")
    b.output("boxes")
    return b.build()


def images(n: int = 8, seed: int = 0, size: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 3, size, size), dtype=np.float32)


@pytest.fixture
def conv_files(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(conv_model(), model)
    data = tmp_path / "d.npz"
    np.savez(data, images=images())
    return model, data


def err_lines(capsys):
    captured = capsys.readouterr()
    return captured.out, [line for line in captured.err.splitlines() if line.strip()]


def listing(folder: Path):
    return sorted(p.name for p in folder.iterdir())


# -- usage and input paths -------------------------------------------------------------------------
def test_quantize_without_data_or_scales_points_at_help(conv_files, capsys):
    model, _ = conv_files
    before = listing(model.parent)
    assert main(["quantize", str(model), "-o", str(model.parent / "q.onnx")]) == EXIT_USAGE
    out, err = err_lines(capsys)
    assert err == ["onnx-qat: error: one of the arguments --data --scales is required "
                   "(see 'onnx-qat quantize --help')"]
    assert out == "" and listing(model.parent) == before


@pytest.mark.parametrize("argv, message", [
    (["check", "{dir}"], "model {dir} is a directory; give the .onnx file"),
    (["quantize", "{model}", "-o", "{out}", "--data", "{dir}"],
     "calibration data {dir} holds no .npz files; give one .npz file per feed"),
    (["quantize", "{model}", "-o", "{out}", "--scales", "{dir}"],
     "--scales {dir} is a directory; give the ScaleTable .json file"),
])
def test_a_directory_given_as_a_file_says_which_file_to_give(conv_files, capsys, argv, message):
    model, _ = conv_files
    folder = model.parent / "a_folder"
    folder.mkdir()
    names = {"dir": folder, "model": model, "out": model.parent / "q.onnx"}
    before = listing(model.parent)
    assert main([a.format(**names) for a in argv]) == EXIT_USAGE
    out, err = err_lines(capsys)
    assert err == ["onnx-qat: error: " + message.format(**names)] and out == ""
    assert listing(model.parent) == before


def test_usage_rules_between_options_point_at_the_command_help(conv_files, capsys):
    model, data = conv_files
    assert main(["quantize", str(model), "-o", str(model.parent / "q.onnx"), "--data", str(data),
                 "--max-float-sites", "2"]) == EXIT_USAGE
    _, err = err_lines(capsys)
    assert err == ["onnx-qat: error: --max-float-sites and --eval-data apply only with --min-cosine "
                   "(--eval-data also with --optimize) (see 'onnx-qat quantize --help')"]


def test_sensitivity_help_reads_as_sentences():
    sub = next(a for a in get_parser()._subparsers._group_actions[0].choices.items() if a[0] == "sensitivity")
    text = " ".join(sub[1].description.split())
    assert text.startswith("Calibrate MODEL once on --data (method max unless --method is given). Then, for "
                           "every site that placement quantizes, measure the output error against the float "
                           "model twice: with only that site quantized")
    assert "site placement quantizes the output error" not in text


# -- what was chosen and adapted -------------------------------------------------------------------
def test_quantize_summary_names_auto_choice_without_verbose(conv_files, capsys):
    model, data = conv_files
    out_path = model.parent / "q.onnx"
    argv = ["quantize", str(model), "-o", str(out_path), "--data", str(data), "--no-progress"]
    assert main(argv) == EXIT_OK
    out, err = err_lines(capsys)
    first = out.splitlines()[0]
    assert re.fullmatch(
        rf"wrote {re.escape(str(out_path))} \| target tensorrt \| 3 activations and 3 weights quantized, "
        r"0 nodes skipped \| 3 QuantizeLinear, 6 DequantizeLinear \| ranges: auto kept "
        r"(max everywhere|the least-error range per tensor \(.+\)) \| output cosine on "
        r"the calibration data: (per-tensor|max) 0\.\d{5}, (per-tensor|max) 0\.\d{5}", first), first
    assert err == []


def test_quantize_from_scales_does_not_import_calibration(conv_files, tmp_path):
    """The rewrite from given scales (the path `make bench`'s rewrite_speed times) names the table's
    method without importing the calibration package (about 40 ms of imports)."""
    import subprocess
    import sys

    model, data = conv_files
    table = tmp_path / "s.json"
    assert main(["calibrate", str(model), "--data", str(data), "--method", "max", "-o", str(table),
                 "--no-progress"]) == EXIT_OK
    out = tmp_path / "q.onnx"
    code = ("import sys; from onnx_qat.cli import main; "
            f"rc = main(['quantize', {str(model)!r}, '--scales', {str(table)!r}, '-o', {str(out)!r}]); "
            "print(rc, sorted(m for m in sys.modules if m.startswith('onnx_qat.calibration')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.splitlines()[-1] == "0 []", done.stdout + done.stderr
    assert "ranges: max" in done.stdout
    assert out.is_file()


def test_method_summary_from_table_metadata():
    from onnx_qat.scales import describe_method

    meta = {"calibration_method": "auto", "auto_table": "tensor",
            "auto_choices": json.dumps({"a": "mse", "b": "mse", "c": "max"}),
            "auto_output_cosine": json.dumps({"max": 0.99992, "tensor": 0.999941, "entropy": 0.99993})}
    assert describe_method(meta) == ("ranges: auto kept the least-error range per tensor (mse 2, max 1) | "
                                     "output cosine on the calibration data: per-tensor 0.99994, "
                                     "entropy 0.99993, max 0.99992")
    assert describe_method({"calibration_method": "percentile", "percentile": "99.9"}) == \
        "ranges: percentile 99.9"
    assert describe_method({"calibration_method": "max"}) == "ranges: max"
    assert describe_method({}) == ""


def test_calibrate_summary_singular_and_method(conv_files, capsys):
    model, data = conv_files
    scales = model.parent / "s.json"
    assert main(["calibrate", str(model), "--data", str(data), "-o", str(scales), "--method", "max",
                 "--no-progress"]) == EXIT_OK
    out, _ = err_lines(capsys)
    assert out.splitlines() == [f"wrote {scales}: 3 activation ranges, 0 weight ranges | ranges: max"]


def test_inspect_counts_in_the_singular():
    from onnx_qat.cli import _count

    assert [_count(1, "node"), _count(0, "node"), _count(2, "weight"), _count(None, "node")] == \
        ["1 node", "0 nodes", "2 weights", "? nodes"]


def test_a_single_array_under_another_key_is_named(conv_files, capsys):
    model, _ = conv_files
    data = model.parent / "x.npz"
    np.savez(data, pixels=images())
    assert main(["calibrate", str(model), "--data", str(data), "-o", str(model.parent / "s.json"),
                 "--method", "max", "--no-progress"]) == EXIT_OK
    _, err = err_lines(capsys)
    assert err == [f"onnx-qat: WARNING: calibration data {data}: key 'pixels' is read as the model's only "
                   "input 'images'"]


def test_uint8_data_is_named_and_its_range_compared_with_calibration(conv_files, capsys):
    from onnx_qat.runtime.compare import input_quantizer_ranges

    model, data = conv_files
    qdq = model.parent / "q.onnx"
    assert main(["quantize", str(model), "-o", str(qdq), "--data", str(data), "--method", "max",
                 "--no-progress", "-q"]) == EXIT_OK
    pixels = (images(seed=3) * 255).astype(np.uint8)
    u8 = model.parent / "u8.npz"
    np.savez(u8, images=pixels)
    capsys.readouterr()
    code = main(["compare", str(model), str(qdq), "--data", str(u8), "--no-progress"])
    assert code in (EXIT_OK, EXIT_PROBLEMS)
    _, err = err_lines(capsys)
    amax = input_quantizer_ranges(onnx.load(qdq))["images"]
    peak = float(pixels.max())
    assert 0.9 < amax <= 1.01  # calibrated on 0..1
    assert err == [
        f"onnx-qat: WARNING: data {u8}: key 'images' holds uint8, converted to the model's float32 (values "
        "keep their uint8 scale, e.g. 0..255; divide them first if the model expects 0..1)",
        f"onnx-qat: WARNING: data {u8}: input 'images' reaches |x| = {peak:.4g}, {peak / amax:.0f}x the "
        f"range its QuantizeLinear in the candidate holds (|x| <= {amax:.4g}): the data is likely on another "
        "scale than the calibration data (e.g. 0..255 where calibration saw 0..1)"]
    capsys.readouterr()
    assert main(["compare", str(model), str(qdq), "--data", str(data), "--no-progress"]) == EXIT_OK
    assert err_lines(capsys)[1] == []  # data on calibration's scale: no word


# -- figures that mean something for the model at hand --------------------------------------------
def test_top1_only_for_class_scores_or_when_asked(tmp_path):
    import onnx_qat

    model = classifier_and_detector_model()
    x = {"x": np.random.default_rng(0).standard_normal((32, 8)).astype(np.float32)}
    qdq = onnx_qat.quantize(model, data=x, method="max", progress=False).model
    result = {o.name: o for o in onnx_qat.compare(model, qdq, x).outputs}
    assert result["scores"].top1 is not None and "top-1" in str(result["scores"])
    assert result["boxes"].top1 is None and "top-1" not in str(result["boxes"])
    asked = {o.name: o for o in onnx_qat.compare(model, qdq, x, min_top1=0.5).outputs}
    assert asked["boxes"].top1 is not None and "top-1" in str(asked["boxes"])


def test_compare_text_names_the_samples_and_files(conv_files, capsys):
    model, data = conv_files
    assert main(["compare", str(model), str(model), "--data", str(data), "--no-progress"]) == EXIT_OK
    out, err = err_lines(capsys)
    assert out.splitlines() == [
        "PASSED | output 'out' | max abs 0.0e+00 | cosine 1.00000 ≥ 0.99 | SQNR inf dB",
        f"compared on 8 samples of {data} (reference {model}, candidate {model})"]
    assert err == []


def test_compare_json_names_the_model_files(conv_files, capsys):
    model, data = conv_files
    argv = ["compare", str(model), str(model), "--data", str(data), "--json", "--no-progress"]
    assert main(argv) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["reference"] == str(model) and report["candidate"] == str(model)
    assert report["outputs"][0]["top1"] is None  # out [N, 4, H, W]: no class axis


def test_int4_on_a_conv_only_model_names_the_cause(conv_files, capsys):
    model, _ = conv_files
    before = listing(model.parent)
    argv = ["quantize", str(model), "-o", str(model.parent / "q4.onnx"), "--precision", "int4"]
    assert main(argv) == EXIT_USAGE
    out, err = err_lines(capsys)
    assert err == [f"onnx-qat: error: nothing to quantize in model {model}: --precision int4 quantizes only "
                   "the weights of Gemm and MatMul nodes, and the model has none (found 3 Conv, 2 Relu); use "
                   "--precision int8 or fp8 for its Conv layers"]
    assert out == "" and listing(model.parent) == before


def test_nothing_to_quantize_hint_names_command_line_options(conv_files, capsys):
    model, data = conv_files
    before = listing(model.parent)
    assert main(["quantize", str(model), "-o", str(model.parent / "q.onnx"), "--data", str(data),
                 "--exclude-op-types", "Conv"]) == EXIT_USAGE
    _, err = err_lines(capsys)
    assert len(err) == 1 and err[0].startswith(f"onnx-qat: error: nothing to quantize in model {model}: "
                                               "found 3 Conv, 2 Relu; 3 nodes skipped (conv1: ")
    assert err[0].endswith("; see each node's decision with 'onnx-qat inspect' and check --exclude-nodes, "
                           "--exclude-op-types and --min-channels (QuantizeConfig fields exclude_nodes, "
                           "exclude_op_types, min_channels)")
    assert listing(model.parent) == before


def test_check_of_a_float_model_says_not_quantized(conv_files, capsys):
    model, _ = conv_files
    assert main(["check", str(model)]) == EXIT_OK
    out, err = err_lines(capsys)
    assert out.splitlines() == [
        "WARNING C13  (model): not quantized: the model has no QuantizeLinear/DequantizeLinear nodes, so "
        "TensorRT builds it in float; quantize it first ('onnx-qat quantize')",
        f"NOT QUANTIZED | {model} | 0 errors, 1 warning | 0 QuantizeLinear, 0 DequantizeLinear"]
    assert err == []
    assert main(["check", str(model), "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["quantized"] is False and report["passed"] is True


# -- the deployment script -------------------------------------------------------------------------
def _deploy(argv, capsys):
    from onnx_qat.deploy import command

    code = command.main([str(a) for a in argv + ["--no-progress"]])
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def test_deploy_stops_on_a_float_model_unless_allow_float(conv_files, capsys):
    model, data = conv_files
    engine = model.parent / "m.engine"
    code, _, err = _deploy([model, "--engine", engine, "--data", data], capsys)
    assert code == EXIT_USAGE and not engine.exists()
    assert err == [f"deploy_tensorrt.py: error: {model} has no Q/DQ nodes (check rule C13), so TensorRT "
                   "would build a float engine; quantize it first ('onnx-qat quantize') or pass "
                   "--allow-float"]
    code, out, err = _deploy([model, "--engine", engine, "--data", data, "--allow-float"], capsys)
    assert "has no Q/DQ nodes" not in "\n".join(err) and out.count("onnxruntime: ok") == 1


def test_deploy_takes_dynamic_dimensions_from_data_and_names_them(conv_files, capsys):
    import onnx_qat

    model, data = conv_files
    qdq = model.parent / "q.onnx"
    onnx_qat.quantize(str(model), output=str(qdq), data=str(data), method="max", progress=False)
    engine = model.parent / "m.engine"
    code, _, err = _deploy([qdq, "--engine", engine], capsys)
    assert code == EXIT_USAGE and not engine.exists()
    assert err == ["deploy_tensorrt.py: error: model input images float32[batch,3,height,width] has dynamic "
                   "dimensions other than the batch (height, width); give --data, whose arrays fix them, or "
                   "their sizes with --shapes images:MIN,OPT,MAX (dims joined by 'x')"]
    code, out, err = _deploy([qdq, "--engine", engine, "--data", data], capsys)
    assert "dynamic dimensions" not in "\n".join(err) and "onnxruntime: ok" in out


def test_deploy_profiles_from_data_shapes():
    from onnx_qat.deploy.command import resolve_profiles
    from onnx_qat.io.models import model_input_specs

    specs = model_input_specs(conv_model())
    profiles, batch = resolve_profiles(specs, (), 4, {"images": (3, 24, 32)})
    assert [(p.name, p.min, p.opt, p.max) for p in profiles] == \
        [("images", (1, 3, 24, 32), (4, 3, 24, 32), (4, 3, 24, 32))] and batch == 4


def test_tensorrt_install_hint_matches_readme():
    from onnx_qat.deploy.backend import INSTALL_HINT

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert 'pip install ".[tensorrt]"' in INSTALL_HINT and 'pip install ".[tensorrt]"' in readme
    assert "onnx-qat[tensorrt]" not in INSTALL_HINT


# -- sensitivity: group figures apart and explained -----------------------------------------------
def test_sensitivity_table_sets_group_figures_apart_and_names_the_method():
    import onnx_qat

    model = outlier_channel_model("conv5", convs=24, seed=0)
    data = {"input": np.random.default_rng(0).standard_normal((16, 16, 8, 8)).astype(np.float32)}
    result = onnx_qat.sensitivity(model, data, progress=False)
    lines = result.table(top=12).splitlines()
    assert " | ranges calibrated with max | evaluated on calibration data (last 4 samples, held out) | " \
        in lines[0]
    assert lines[1] == ("note: quantize's default method is auto and compare measures all the data it "
                        "is given, so compare's cosine for that model differs; --method auto ranks "
                        "auto's ranges")
    note = next(i for i, line in enumerate(lines) if line.startswith("---- measured in groups"))
    rows = [i for i, line in enumerate(lines) if line.split()[0].isdigit()]
    first_group = next(i for i in rows if lines[i].split()[4].startswith(">"))
    assert note == first_group - 1 and rows[0] == 4
    assert lines[note] == ("---- measured in groups from here on (a joint effect too small to split: "
                           "under 1% of the all-INT8 cosine loss or 1e-05): '>c' / '<c' are the group's "
                           "figures; the site alone costs about that much or less")
    assert all(not lines[i].split()[4].startswith(">") for i in rows if i < note)
    assert all(lines[i].split()[4].startswith(">") for i in rows if i > note)
    assert lines[-1] == "... 14 more sites (--top shows more; the JSON report holds every site)"
    assert result.to_dict()["eval_data"] == "calibration data (last 4 samples, held out)"


def test_sensitivity_chart_hatches_group_figures(tmp_path):
    import onnx_qat
    from onnx_qat.accuracy import chart

    model = outlier_channel_model("conv5", convs=24, seed=0)
    data = {"input": np.random.default_rng(0).standard_normal((16, 16, 8, 8)).astype(np.float32)}
    result = onnx_qat.sensitivity(model, data, progress=False)
    grouped = [s for s in result.sites if s.only_group > 1]
    alone = [s for s in result.sites if s.only_group == 1]
    assert grouped and alone
    assert chart._style(grouped[0], "only_group")["hatch"] == chart.GROUP_HATCH
    assert "hatch" not in chart._style(alone[0], "only_group")
    png = tmp_path / "c.png"
    result.plot(png, top=12)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sensitivity_with_auto_names_the_table_auto_kept():
    import onnx_qat

    model = outlier_channel_model("conv3", seed=1)
    data = {"input": np.random.default_rng(1).standard_normal((16, 16, 8, 8)).astype(np.float32)}
    result = onnx_qat.sensitivity(model, data, method="auto", progress=False)
    lines = result.table().splitlines()
    assert re.search(r" \| ranges: auto kept (max everywhere|entropy everywhere|the least-error range per "
                     r"tensor \(.+\)) \| output cosine on the calibration data: ", lines[0]), lines[0]
    assert not lines[1].startswith("note:")  # auto's ranges are the ones quantize chooses
    assert result.ranges.startswith("ranges: auto kept ")


@pytest.mark.parametrize("scale", [1.0, 255.0])
def test_a_low_output_cosine_is_followed_by_what_recovers_it(tmp_path, capsys, scale):
    """The summary gave auto's output cosine (0.52 on a real document-layout detector) and nothing more:
    below 0.99 a note now names --optimize accuracy, --min-cosine and sensitivity (that detector went to
    0.99275 with --optimize accuracy). Not for a model that keeps its output, nor for ranges auto did not
    judge (--method max), nor from calibrate without the quantize options."""
    rng = np.random.default_rng(8)
    data = {"input": (rng.standard_normal((16, 16, 8, 8)) * scale).astype(np.float32)}
    bad, good = tmp_path / "bad.onnx", tmp_path / "good.onnx"
    onnx.save(outlier_channel_model("conv2"), bad)
    onnx.save(outlier_channel_model("conv2", factor=1.0), good)  # the same net without its outlier
    np.savez(tmp_path / "d.npz", **data)

    def run(*argv):
        code = main([*argv, "--data", str(tmp_path / "d.npz"), "--no-progress"])
        return code, capsys.readouterr().out

    code, out = run("quantize", str(bad), "-o", str(tmp_path / "q.onnx"))
    notes = [line for line in out.splitlines() if line.startswith("note: the output keeps cosine")]
    assert code == EXIT_OK and len(notes) == 1, out
    cosine = float(re.search(r"cosine (\d\.\d+) of the float", notes[0]).group(1))
    assert cosine < 0.99 and "--optimize accuracy" in notes[0] and "--min-cosine 0.99" in notes[0]
    assert f"per-tensor {cosine:.5f}" in out or f"max {cosine:.5f}" in out  # the kept table's figure
    code, out = run("calibrate", str(bad), "-o", str(tmp_path / "s.json"))
    assert code == EXIT_OK and "note: the output keeps cosine" in out
    assert "onnx-qat quantize --optimize" in out
    code, out = run("quantize", str(bad), "-o", str(tmp_path / "m.onnx"), "--method", "max")
    assert code == EXIT_OK and "note: the output keeps cosine" not in out
    code, out = run("quantize", str(good), "-o", str(tmp_path / "g.onnx"))
    assert code == EXIT_OK and "note: the output keeps cosine" not in out, out
