"""The check of a result an edit just wrote (`onnx_qat.check.check_written`): its index built from the edit's
`ResultNodes` is the one `check` reads from the protobuf, and its findings are `check`'s, on clean results,
on results with findings, INT8 and FP8; a model changed after the edit is read as `check` reads it."""
import numpy as np
import onnx
import pytest

import onnx_qat
from onnx_qat.check import _all_graphs, _default_opset, check, check_written
from onnx_qat.check.index import _index_written, same_index
from onnx_qat.io.models import FULL_CHECK_ENV
from tests import builders as B


def _quantized(build, precision="int8", **kwargs):
    model = build()
    table = B.amax_table(model, B.random_inputs(model, seed=5))
    return onnx_qat.quantize(model, scales=table, precision=precision, progress=False, **kwargs)


def _both(result):
    """(findings and notes of `check_written`, of `check`) of ``result.model``, as strings."""
    written = check_written(result.model, result.evidence)
    read = check(result.model)
    as_text = lambda report: ([str(f) for f in report.findings], [str(f) for f in report.notes],  # noqa: E731
                              report.num_q, report.num_dq, report.opset)
    return as_text(written), as_text(read)


def _assert_read_back_alike(result, nodes):
    """What the edit kept of ``result`` (``nodes``) gives the same index, the same initializer facts and
    the same findings as reading ``result.model`` back."""
    from onnx_qat.io.models import _initializer_facts

    opset = _default_opset(result.model)
    assert same_index(_index_written(result.model.graph, None, opset, nodes),
                      _all_graphs(result.model, opset, None)[0]) is None
    assert _initializer_facts(result.model, nodes) == _initializer_facts(result.model)
    first, second = _both(result)
    assert first == second


BUILDS = (B.residual_block_model, B.mobilenet_v2_model, B.transformer_block_model, B.concat_model,
          B.depthwise_model)
CASES = [(build, precision) for build in BUILDS for precision in ("int8", "fp8")]


@pytest.mark.parametrize("build, precision", CASES)
def test_index_from_the_edit_is_the_index_read_back(build, precision, monkeypatch):
    monkeypatch.setenv(FULL_CHECK_ENV, "")
    result = _quantized(build, precision)
    nodes = result.evidence.nodes_of(result.model)
    assert nodes is not None
    assert len(nodes.ops) == len(result.model.graph.node)
    opset = _default_opset(result.model)
    written = _index_written(result.model.graph, None, opset, nodes)
    read = _all_graphs(result.model, opset, None)[0]
    assert same_index(written, read) is None
    assert len(written.qdq) == sum(op in ("QuantizeLinear", "DequantizeLinear") for op in read.ops) > 0
    first, second = _both(result)
    assert first == second


@pytest.mark.parametrize("seed", [0, 1])
def test_same_findings_where_the_result_has_some(seed, monkeypatch):
    """Nodes left float by exclusions: rule C15's note names them; convolutions quantized on one side of a
    residual join only: rules C10/C11 may warn. Both ways give the same findings, in the same order."""
    monkeypatch.setenv(FULL_CHECK_ENV, "")
    model = B.residual_chain_model(4)
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    excluded = list(np.random.default_rng(seed).choice(convs, size=3, replace=False))
    table = B.amax_table(model, B.random_inputs(model, seed=seed))
    result = onnx_qat.quantize(model, scales=table, progress=False, exclude_nodes=excluded)
    assert result.evidence.nodes_of(result.model) is not None
    first, second = _both(result)
    assert first[0] or first[1]  # there is something to compare
    assert first == second


def test_evidence_of_another_model_or_a_changed_one_is_not_used(monkeypatch):
    monkeypatch.setenv(FULL_CHECK_ENV, "")
    result = _quantized(B.residual_block_model)
    evidence = result.evidence
    copy = onnx.ModelProto()
    copy.CopyFrom(result.model)
    assert evidence.nodes_of(copy) is None  # another ModelProto
    # a QuantizeLinear whose output nothing dequantizes, appended: read from the protobuf, so rule C7 sees it
    q = next(n for n in result.model.graph.node if n.op_type == "QuantizeLinear")
    result.model.graph.node.append(onnx.helper.make_node("QuantizeLinear", list(q.input), ["stray_q"],
                                                         name="stray"))
    assert evidence.nodes_of(result.model) is None
    report = check_written(result.model, evidence)
    assert [f.rule for f in report.findings] == [f.rule for f in check(result.model).findings]
    assert any(f.rule == "C7" and f.node == "stray" for f in report.findings)
    assert check_written(result.model, None).findings == report.findings


def test_same_index_names_what_differs(monkeypatch):
    """The comparison the test suite runs on every such check (``ONNX_QAT_FULL_CHECK=both``) finds a table
    that does not match the model."""
    monkeypatch.setenv(FULL_CHECK_ENV, "")
    result = _quantized(B.residual_block_model, "fp8")  # its initializers made one by one: facts kept
    nodes = result.evidence.nodes_of(result.model)
    opset = _default_opset(result.model)
    read = _all_graphs(result.model, opset, None)[0]
    k = next(i for i, op in enumerate(nodes.ops) if op == "Conv")
    rewired = nodes._replace(inputs=[list(x) for x in nodes.inputs])
    rewired.inputs[k][0] = "elsewhere"
    assert same_index(_index_written(result.model.graph, None, opset, rewired), read) == "node inputs"
    name = next(iter(nodes.stored))
    data_type, raw = nodes.stored[name]
    changed = nodes._replace(stored={**nodes.stored, name: (data_type, b"\x01" * len(raw))})
    assert same_index(_index_written(result.model.graph, None, opset, changed), read) == \
        f"stored value of {name!r}"


def test_a_table_that_does_not_match_fails_loudly_under_both(monkeypatch):
    monkeypatch.setenv(FULL_CHECK_ENV, "both")
    result = _quantized(B.residual_block_model)
    nodes = result.evidence.nodes
    k = next(i for i, op in enumerate(nodes.ops) if op == "Relu")
    nodes.ops[k] = "Sigmoid"
    with pytest.raises(RuntimeError, match="op types"):
        check_written(result.model, result.evidence)


def test_the_command_line_checks_its_result_from_the_edit(tmp_path, capsys, monkeypatch):
    """``onnx-qat quantize --scales`` checks what it wrote by `check_written` (compared with the index read
    back, ``both``): the same summary as ``onnx-qat check`` of the written file."""
    monkeypatch.setenv(FULL_CHECK_ENV, "both")
    model = B.mobilenet_v2_model()
    table = B.amax_table(model, B.random_inputs(model, seed=2))
    onnx.save(model, tmp_path / "m.onnx")
    table.save(tmp_path / "m.json")
    from onnx_qat.cli import main

    assert main(["quantize", str(tmp_path / "m.onnx"), "--scales", str(tmp_path / "m.json"), "-o",
                 str(tmp_path / "q.onnx"), "--no-progress"]) == 0
    said = capsys.readouterr().out
    line = next(s for s in said.splitlines() if s.startswith("check: "))
    assert line == f"check: {check(str(tmp_path / 'q.onnx')).summary()}"


@pytest.mark.parametrize("build, precision", CASES)
def test_save_takes_the_same_initializer_facts_from_the_edit(build, precision, monkeypatch):
    """`save_model` with the edit's evidence reads the new initializers' types and sizes from it: the same
    facts (size estimate, element types, external data) as read from the protobuf."""
    from onnx_qat.io.models import _has_external_outside_initializers, _initializer_facts

    monkeypatch.setenv(FULL_CHECK_ENV, "")
    result = _quantized(build, precision)
    nodes = result.evidence.nodes_of(result.model)
    assert nodes is not None and nodes.stored  # INT8's made in batches too
    assert _initializer_facts(result.model, nodes) == _initializer_facts(result.model)
    assert _has_external_outside_initializers(result.model, nodes) is \
        _has_external_outside_initializers(result.model) is False


@pytest.mark.parametrize("most", [8, 64])
def test_new_initializers_over_the_kept_size_are_read_back(most, monkeypatch):
    """A new initializer with more raw bytes than `STORED_MOST` (a weight) is not held twice: the check and
    the save read it from the result, with the same index, findings and facts (scalars, at most 8 bytes,
    are always kept)."""
    from onnx_qat.graph import edit

    monkeypatch.setenv(FULL_CHECK_ENV, "")
    monkeypatch.setattr(edit, "STORED_MOST", most)
    result = _quantized(B.transformer_block_model, "fp8")  # initializers made one by one: facts kept
    nodes = result.evidence.nodes_of(result.model)
    sizes = {t.name: len(t.raw_data) for t in result.model.graph.initializer}
    assert all(sizes[name] <= most for name in nodes.stored)
    assert any(size > most for name, size in sizes.items() if name in nodes.dims)  # made, not kept
    _assert_read_back_alike(result, nodes)



@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("most", [8, 1024])
def test_the_batched_insertion_gives_its_initializers_facts(build, most, monkeypatch):
    """INT8's initializers made a column at a time from templates (scales, zero points, weights quantized in
    batches) come with their facts, as those made one by one: each new one of at most `STORED_MOST` raw bytes
    has its element type and bytes kept, each new one not a scalar its dims, equal to what the result holds;
    a larger one is left to be read back."""
    from onnx_qat.graph import edit

    monkeypatch.setenv(FULL_CHECK_ENV, "")
    monkeypatch.setattr(edit, "STORED_MOST", most)
    model = build()
    old = {t.name for t in model.graph.initializer}
    result = _quantized(lambda: model)
    nodes = result.evidence.nodes_of(result.model)
    assert nodes is not None
    new = [t for t in result.model.graph.initializer if t.name not in old]
    assert len(new) > 10
    assert any(t.dims for t in new) and any(len(t.raw_data) > 8 for t in new)
    for t in new:
        if len(t.raw_data) <= most:
            assert nodes.stored[t.name] == (t.data_type, t.raw_data), t.name
        else:
            assert t.name not in nodes.stored, t.name
        assert nodes.dims.get(t.name, ()) == tuple(t.dims), t.name
    _assert_read_back_alike(result, nodes)
