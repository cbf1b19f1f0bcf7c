"""README.md and the docs pages match the code: every public function, class, CLI option and link is there.

These tests read README.md, the pages under docs/ (those mkdocs.yml lists) and the real objects
(signatures from :mod:`inspect`, options from the real argparse parsers), so a parameter added, renamed
or removed without its documentation fails here.
"""
import argparse
import inspect
import re
from pathlib import Path

import pytest

import onnx_qat
from onnx_qat.cli import get_parser as onnx_qat_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
README_LINES = README.splitlines()


def nav_pages() -> list:
    """The pages mkdocs.yml lists in its ``nav:``, in order, as paths relative to ``docs/``."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config[config.index("\nnav:"):]
    nav = nav[:re.search(r"\n\S", nav[1:]).start() + 1]
    return re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, re.M)


#: The prose: README, then every docs page of the navigation except the generated API pages.
PAGES = {"README.md": README}
PAGES.update({f"docs/{page}": (ROOT / "docs" / page).read_text(encoding="utf-8")
              for page in nav_pages() if not page.startswith("api/")})
#: All prose pages one after another; every page starts with a level-1 heading, so a section
#: never runs into the next page.
DOCS = "\n".join(PAGES.values())
LINES = DOCS.splitlines()


def _headings(lines=None):
    """(line number, level, text) of every Markdown heading outside fenced code blocks."""
    found, fenced = [], False
    for i, line in enumerate(LINES if lines is None else lines):
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"^(#{1,6}) ", line)
        if match:
            found.append((i, len(match.group(1)), line))
    return found


HEADINGS = _headings()


def section(title_part: str) -> str:
    """The text under the first heading (of README or a docs page) starting with ``title_part``, down
    to the next heading of the same or a higher level (its sub-sections included)."""
    return _section_from(next(i for i, _, line in HEADINGS if line.startswith(title_part)))


def _section_from(line_no: int) -> str:
    start, level = max(((i, lv) for i, lv, _ in HEADINGS if i <= line_no), default=(0, 1))
    end = next((i for i, lv, _ in HEADINGS if i > start and lv <= level), len(LINES))
    return "\n".join(LINES[start:end])


def _documenting_sections(full_name: str) -> str:
    """Sections whose heading names ``full_name`` or holding its signature in bold or code."""
    hits = [i for i, line in enumerate(LINES)
            if (line.startswith("#") and f"`{full_name}" in line) or f"`{full_name}(" in line]
    return "\n".join(_section_from(i) for i in hits)


def _public(module):
    return [(name, getattr(module, name)) for name in module.__all__]


def _tf_bridge():
    pytest.importorskip("tensorflow")
    import tf_bridge

    return tf_bridge


def _check_functions(module) -> list:
    problems = []
    for name, obj in _public(module):
        if not inspect.isfunction(obj):
            continue
        full = f"{module.__name__}.{name}"
        text = _documenting_sections(full)
        if not text:
            problems.append(f"{full}: no docs heading or signature")
            continue
        for param in inspect.signature(obj).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if not re.search(rf"\b{re.escape(param.name)}\b", text):
                problems.append(f"{full}: parameter {param.name!r} not in its docs section")
    return problems


def _check_docstrings(module) -> list:
    problems = []
    for name, obj in _public(module):
        if not (inspect.getdoc(obj) or "").strip():
            problems.append(f"{module.__name__}.{name}: no docstring")
        if f"`{name}" not in DOCS and f".{name}" not in DOCS:
            problems.append(f"{module.__name__}.{name}: not named in the docs")
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                    continue
                # getattr: a method overriding a documented base-class method (Keras' build, call...)
                # inherits its docstring
                doc = member.__doc__ if isinstance(member, property) else inspect.getdoc(getattr(obj, attr))
                if not (doc or "").strip():
                    problems.append(f"{module.__name__}.{name}.{attr}: no docstring")
    return problems


def test_every_public_onnx_qat_function_is_documented_with_every_parameter():
    assert _check_functions(onnx_qat) == []


def test_every_public_tf_bridge_function_is_documented_with_every_parameter():
    assert _check_functions(_tf_bridge()) == []


def test_every_public_name_has_a_docstring_and_is_named_in_the_docs():
    assert _check_docstrings(onnx_qat) + _check_docstrings(_tf_bridge()) == []


def _options(parser: argparse.ArgumentParser, path=()):
    """(subcommand path, option string) for every long option of ``parser`` and its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, path + (name,))
        else:
            yield from ((path, o) for o in action.option_strings if o.startswith("--") and o != "--help")


def test_every_onnx_qat_cli_option_is_documented_in_the_tool_section():
    text = section("# The `onnx-qat` tool")
    options = list(_options(onnx_qat_parser()))
    assert len(options) > 20  # the walk reached the subcommands
    assert [f"{' '.join(p)} {o}" for p, o in options if o not in text] == []


def test_every_subcommand_has_its_own_section():
    subcommands = {p[0] for p, _ in _options(onnx_qat_parser()) if p}
    assert subcommands >= {"calibrate", "quantize", "check", "compare", "inspect"}
    assert [s for s in sorted(subcommands) if f"\n## `onnx-qat {s}`" not in DOCS] == []


@pytest.mark.parametrize("module, title", [("onnx_qat.deploy.command", "# Deploy with TensorRT"),
                                           ("tools.demo", "# The demo"),
                                           ("tools.bench.__main__", "## Benchmarks")])
def test_every_tool_option_is_documented_in_its_section(module, title):
    import importlib

    parser = importlib.import_module(module).get_parser()
    text = section(title)
    options = [o for _, o in _options(parser)]
    assert options and [o for o in options if o not in text] == []


def _anchor(heading: str) -> str:
    """The anchor a Markdown renderer such as GitHub's gives a heading: lower case, punctuation other
    than hyphens and underscores dropped, each space a hyphen."""
    text = re.sub(r"^#+ ", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _page_anchors(text: str) -> set:
    return {_anchor(line) for _, _, line in _headings(text.splitlines())}


def _broken_links(page: str, text: str) -> list:
    """Links of ``page`` (a path relative to the repository) that do not resolve: an ``#anchor`` not a
    heading of the page, a file that does not exist, an anchor not a heading of the page linked, or,
    from a docs page, a link out of docs/ (the site could not serve it)."""
    here = (ROOT / page).parent
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = (here / path).resolve() if path else ROOT / page
        if not target.exists() or (page.startswith("docs/") and ROOT / "docs" not in target.parents):
            broken.append(link)
        elif anchor and target.suffix == ".md" and anchor not in _page_anchors(
                target.read_text(encoding="utf-8")):
            broken.append(link)
    return broken


def test_every_link_to_a_page_a_section_or_a_file_resolves():
    pages = dict(PAGES)
    pages.update({f"docs/{p}": (ROOT / "docs" / p).read_text(encoding="utf-8")
                  for p in nav_pages() if p.startswith("api/")})
    links = re.findall(r"\]\(([^)\s]+)\)", DOCS)
    assert len(links) > 40
    assert {page: _broken_links(page, text) for page, text in pages.items()
            if _broken_links(page, text)} == {}


def test_a_broken_link_or_anchor_is_caught():
    text = "[a](#no-such-heading), [b](docs/cli.md#no-such-option), [c](docs/missing.md), [d](docs/cli.md)"
    assert _broken_links("README.md", text) == ["#no-such-heading", "docs/cli.md#no-such-option",
                                                "docs/missing.md"]
    assert _broken_links("docs/index.md", "[e](../tools/demo.py), [f](cli.md#global-options)") == [
        "../tools/demo.py"]


def test_every_docs_page_is_in_the_navigation():
    on_disk = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav_pages()) == on_disk
    assert len(on_disk) >= 15


def test_the_make_targets_the_docs_name_exist():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    named = set(re.findall(r"(?:^|`)make ([\w-]+)", DOCS, re.M))
    assert {"demo", "test", "bench", "docs"} <= named
    assert [t for t in sorted(named) if not re.search(rf"^{t}:", makefile, re.M)] == []


def test_the_readme_fits_on_a_page_and_keeps_its_two_set_up_commands():
    assert len(README_LINES) <= 300
    setup = README[README.index("\n## Set-up\n"):]
    block = setup[setup.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    quickstart = section("## Quickstart")
    assert "onnx-qat quantize" in quickstart and "tf_bridge.quantize_model" in quickstart


def test_the_readme_links_every_docs_page():
    linked = {link.split("#")[0] for link in re.findall(r"\]\(([^)\s]+)\)", README)}
    assert [p for p in nav_pages() if f"docs/{p}" not in linked] == []
