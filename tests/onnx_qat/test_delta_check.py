"""Validation of the rewrite's result by what the edit changed (`onnx_qat.graph.delta`): the same verdicts
as ``onnx.checker`` in full on correct results and on results corrupted in each way the checker looks for,
and ``onnx.checker`` in full wherever the evidence does not apply."""
import logging

import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.errors import ModelError
from onnx_qat.graph.delta import structure_problem
from onnx_qat.graph.edit import GraphEdit
from onnx_qat.graph.index import GraphIndex, assign_node_names
from onnx_qat.insertion.inserter import insert_qdq_pairs
from onnx_qat.io.models import FULL_CHECK_ENV, CheckedForm, load_checked_model, save_model
from onnx_qat.placement.policy import TensorRTPolicy
from onnx_qat.config import QuantizeConfig
from tests import builders as B

EVIDENCE_LOG = "validated by the edit's evidence"


def _edit(model, scales=None):
    """A rewrite's edit of ``model`` as `onnx_qat.rewrite` makes it from given scales: checked at load,
    indexed, placed, Q/DQ inserted as bytes (not yet committed)."""
    loaded, checked = load_checked_model(model)
    assign_node_names(loaded)
    index = GraphIndex(loaded)
    placement = TensorRTPolicy().place(index, QuantizeConfig())
    edit = GraphEdit(loaded, encoded=True, index=index, checked=checked)
    table = scales or B.amax_table(model, B.random_inputs(model))
    insert_qdq_pairs(edit, placement, table)
    return edit, checked


def _full_checker_refuses(model) -> bool:
    try:
        onnx.checker.check_model(model.SerializeToString(), full_check=False)
    except Exception:
        return True
    return False


@pytest.fixture
def evidence_only(monkeypatch):
    monkeypatch.setenv(FULL_CHECK_ENV, "")


@pytest.mark.parametrize("build", [B.residual_block_model, B.mobilenet_v2_model, B.transformer_block_model,
                                   B.concat_model])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_written_model_validated_by_evidence_same_bytes(build, precision, tmp_path, monkeypatch, caplog):
    model = build()
    table = B.amax_table(model, B.random_inputs(model, seed=3))
    monkeypatch.setenv(FULL_CHECK_ENV, "")
    with caplog.at_level(logging.DEBUG, logger="onnx_qat.io.models"):
        onnx_qat.quantize(model, tmp_path / "delta.onnx", scales=table, precision=precision, progress=False)
    assert EVIDENCE_LOG in caplog.text
    caplog.clear()
    monkeypatch.setenv(FULL_CHECK_ENV, "1")
    with caplog.at_level(logging.DEBUG, logger="onnx_qat.io.models"):
        onnx_qat.quantize(model, tmp_path / "full.onnx", scales=table, precision=precision, progress=False)
    assert EVIDENCE_LOG not in caplog.text
    written = (tmp_path / "delta.onnx").read_bytes()
    assert written == (tmp_path / "full.onnx").read_bytes()
    onnx.checker.check_model(written, full_check=True)


def test_committed_rewrite_passes_both_ways():
    edit, checked = _edit(B.residual_block_model())
    model = edit.commit()
    assert edit.evidence is not None and edit.evidence.problem is None
    assert edit.evidence.checked == checked == CheckedForm.of(model)
    assert {n.op_type for n in edit.evidence.forms} == {"QuantizeLinear", "DequantizeLinear"}
    edit.evidence.verify(model, "output model m")
    onnx.checker.check_model(model, full_check=False)


def _node_reading(model, tensor):
    return next(n for n in model.graph.node if tensor in n.input)


def _corrupt_dangling(edit):
    """A new node reads a tensor nothing makes."""
    node = onnx.NodeProto(op_type="Relu", name="dangling", input=["nowhere"], output=["dangling_out"])
    edit.insert([node], [], forms=[("Relu", "", 1, 1)])


def _corrupt_unsorted(edit):
    """An original node reads the output of a node queued at the end of the graph."""
    first = edit.nodes[0]
    node = onnx.NodeProto(op_type="Relu", name="late", input=[edit.nodes[-1].output[0]], output=["late_out"])
    edit.insert([node], [], forms=[("Relu", "", 1, 1)])
    first.input[0] = "late_out"


def _corrupt_ssa(edit):
    """A new node writes a tensor an original node writes too."""
    taken = edit.nodes[1].output[0]
    node = onnx.NodeProto(op_type="Relu", name="twice", input=[edit.nodes[0].output[0]], output=[taken])
    edit.insert([node], [edit.nodes[1]], forms=[("Relu", "", 1, 1)])


def _corrupt_initializer_name(edit):
    """A new initializer takes the name of an initializer the result keeps (a BatchNormalization scale)."""
    name = next(n for n in edit.nodes if n.op_type == "BatchNormalization").input[1]
    edit.add_initializers([name], [(np.dtype(np.float32), np.float32(1).tobytes(), ())])


def _corrupt_graph_output(edit):
    """The node making the graph output is removed."""
    out = next(iter(edit.graph_outputs))
    edit.remove(edit.producer[out])


def _corrupt_form_attribute(edit):
    """A new node of a form the schema refuses (an attribute DequantizeLinear does not have)."""
    node = onnx.NodeProto(op_type="DequantizeLinear", name="odd", input=[edit.nodes[0].output[0], "s"],
                          output=["odd_out"])
    node.attribute.append(onnx.helper.make_attribute("no_such_attribute", 1))
    edit.add_initializers(["s"], [(np.dtype(np.float32), np.float32(1).tobytes(), ())])
    edit.insert([node], [], forms=[("DequantizeLinear", "", 2, 1, "no_such_attribute")])


def _corrupt_op_type(edit):
    """A new node of an op type the imported opset does not have."""
    node = onnx.NodeProto(op_type="NoSuchOp", name="nosuch", input=[edit.nodes[0].output[0]], output=["ns"])
    edit.insert([node], [], forms=[("NoSuchOp", "", 1, 1)])


STRUCTURAL = {"dangling": (_corrupt_dangling, "topologically sorted"),
              "unsorted": (_corrupt_unsorted, "topologically sorted"),
              "ssa": (_corrupt_ssa, "single static assignment"),
              "initializer name": (_corrupt_initializer_name, "initializer name is not unique"),
              "graph output": (_corrupt_graph_output, "is not an output of any node")}
FORMS = {"attribute": (_corrupt_form_attribute, "no_such_attribute"),
         "op type": (_corrupt_op_type, "NoSuchOp")}


@pytest.mark.parametrize("case", sorted({**STRUCTURAL, **FORMS}))
def test_corrupted_result_refused_by_evidence_and_checker(case, tmp_path, evidence_only):
    corrupt, words = {**STRUCTURAL, **FORMS}[case]
    edit, _ = _edit(B.residual_block_model())
    corrupt(edit)
    model = edit.commit()
    assert edit.evidence is not None
    assert _full_checker_refuses(model)
    with pytest.raises(ModelError, match=words):
        edit.evidence.verify(model, "output model m")
    out = tmp_path / "m.onnx"
    with pytest.raises(ModelError, match="is not a valid ONNX model"):
        save_model(model, out, validate=True, evidence=edit.evidence)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_wrong_raw_size_leaves_the_result_to_the_checker(tmp_path, evidence_only, caplog):
    edit, _ = _edit(B.residual_block_model())
    edit.add_initializers(["short"], [(np.dtype(np.float32), b"\x00\x00", (1,))])  # 2 bytes for 4
    model = edit.commit()
    assert edit.evidence is None
    with pytest.raises(ModelError, match="is not a valid ONNX model"):
        save_model(model, tmp_path / "m.onnx", validate=True, evidence=edit.evidence)
    assert not (tmp_path / "m.onnx").exists()


def test_node_without_form_leaves_the_result_to_the_checker():
    edit, _ = _edit(B.residual_block_model())
    node = onnx.NodeProto(op_type="Relu", name="extra", input=[edit.nodes[0].output[0]], output=["extra_out"])
    edit.insert([node], [])
    edit.commit()
    assert edit.evidence is None


def test_other_header_or_full_check_setting_runs_the_checker(tmp_path, monkeypatch, caplog):
    edit, _ = _edit(B.residual_block_model())
    model = edit.commit()
    monkeypatch.setenv(FULL_CHECK_ENV, "")
    with caplog.at_level(logging.DEBUG, logger="onnx_qat.io.models"):
        save_model(model, tmp_path / "a.onnx", validate=True, evidence=edit.evidence)
    assert EVIDENCE_LOG in caplog.text
    caplog.clear()
    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.opset_import[0].version += 1  # not the header the checker passed at load
    with caplog.at_level(logging.DEBUG, logger="onnx_qat.io.models"):
        save_model(other, tmp_path / "b.onnx", validate=True, evidence=edit.evidence)
    assert EVIDENCE_LOG not in caplog.text
    monkeypatch.setenv(FULL_CHECK_ENV, "1")
    with caplog.at_level(logging.DEBUG, logger="onnx_qat.io.models"):
        save_model(model, tmp_path / "c.onnx", validate=True, evidence=edit.evidence)
    assert EVIDENCE_LOG not in caplog.text
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "c.onnx").read_bytes()


def test_both_setting_catches_evidence_the_checker_refutes(tmp_path, monkeypatch):
    """With ONNX_QAT_FULL_CHECK=both (the suite's setting) a model the evidence passes but the checker
    refuses is a RuntimeError, not a quiet pass: here two new nodes claim one form, and only the first
    (a valid Relu) is checked; the second has two inputs, which Relu's schema refuses."""
    edit, _ = _edit(B.residual_block_model())
    x = edit.nodes[0].output[0]
    edit.insert([onnx.NodeProto(op_type="Relu", name="one", input=[x], output=["one_out"])], [],
                forms=[("Relu", "", 1, 1)])
    edit.insert([onnx.NodeProto(op_type="Relu", name="two", input=[x, x], output=["two_out"])], [],
                forms=[("Relu", "", 1, 1)])  # a wrong claim: the evidence checks "one" only
    model = edit.commit()
    edit.evidence.verify(model, "m")
    assert _full_checker_refuses(model)
    monkeypatch.setenv(FULL_CHECK_ENV, "both")
    with pytest.raises(RuntimeError, match="evidence passed a model onnx.checker refuses"):
        save_model(model, tmp_path / "m.onnx", validate=True, evidence=edit.evidence)
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("graph_inputs, initializers, nodes, outputs, words", [
    (["x", "x"], [], [], [], "graph input names multiple times"),
    (["x"], [""], [], [], "non-empty name"),
    (["x"], ["w", "w"], [], [], "initializer name is not unique"),
    (["x"], ["w"], [("n", "Add", ("x", "y"), ("z",))], ["z"], "input 'y'"),
    (["x"], ["w"], [("n", "Relu", ("x",), ("w",))], ["w"], "'w' has been used as output names"),
    (["x"], [], [("n", "Relu", ("x",), ("y",))], ["q"], "Graph output 'q'"),
])
def test_structure_problem_words(graph_inputs, initializers, nodes, outputs, words):
    protos = [onnx.NodeProto(name=n, op_type=op, input=i, output=o) for n, op, i, o in nodes]
    assert words in structure_problem(graph_inputs, initializers, protos, outputs)


def test_structure_problem_none_for_optional_inputs_and_outputs():
    nodes = [onnx.NodeProto(name="n", op_type="Resize", input=["x", "", "", "s"], output=["y"]),
             onnx.NodeProto(name="m", op_type="Dropout", input=["y"], output=["z", ""]),
             onnx.NodeProto(name="k", op_type="Split", input=["z"], output=["a", "", "b"])]
    assert structure_problem(["x"], ["s"], nodes, ["z", "x", "s", "b"]) is None


@pytest.mark.parametrize("outputs", [["a", "a"], ["a", "", "a"], ["x"], ["s"]])
def test_structure_problem_output_twice_or_over_an_input(outputs):
    nodes = [onnx.NodeProto(name="k", op_type="Split", input=["x"], output=outputs)]
    assert "single static assignment" in structure_problem(["x"], ["s"], nodes, [])


def test_loaded_form_says_external_data_was_read(tmp_path):
    """A model loaded with its external data gives a `LoadedForm` (save then skips the walk of the original
    nodes' attribute tensors for external data); one loaded without it, a plain `CheckedForm`. Both equal the
    header's `CheckedForm`."""
    model = B.residual_block_model()
    path = tmp_path / "m.onnx"
    save_model(model, path, external_data_threshold=0)  # the weights in m.onnx.data
    assert (tmp_path / "m.onnx.data").exists()
    loaded, checked = load_checked_model(path)
    assert checked.external_free and checked == CheckedForm.of(loaded)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in loaded.graph.initializer)
    _, unread = load_checked_model(path, load_external_data=False, upgrade_opset=False)
    assert not unread.external_free
    assert unread == CheckedForm.of(onnx.load(str(path), load_external_data=False))
    edit, checked = _edit(model)
    assert checked.external_free
    out = save_model(edit.commit(), tmp_path / "q.onnx", validate=True, evidence=edit.evidence)
    assert onnx.load(str(out)).graph.node  # written, and loadable
