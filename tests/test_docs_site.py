"""The documentation site builds with ``mkdocs build --strict``: a broken link or anchor, a page left out
of the navigation, or an API object mkdocstrings cannot resolve fails the build, and so this test.
Every public name of ``onnx_qat`` and ``tf_bridge`` has its entry on the API pages."""
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -c constraints.txt '.[docs]')")
pytest.importorskip("mkdocstrings_handlers.python",
                    reason="mkdocstrings-python is not installed (pip install -c constraints.txt '.[docs]')")

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line for line in (done.stdout + done.stderr).splitlines() if "WARNING" in line] == []
    return out


def test_the_site_builds_strict_with_every_page(site):
    from tests.test_docs import nav_pages

    pages = nav_pages()
    assert len(pages) >= 17
    built = [site / p.removesuffix(".md").removesuffix("index") / "index.html" for p in pages]
    missing = [str(path) for path in built if not path.exists()]
    assert missing == []


def _api_path(obj) -> str:
    return obj.__name__ if inspect.ismodule(obj) else f"{obj.__module__}.{obj.__qualname__}"


def _public_paths(module):
    return [(name, _api_path(getattr(module, name))) for name in module.__all__]


@pytest.mark.parametrize("package", ["onnx_qat", "tf_bridge"])
def test_every_public_name_is_on_its_api_page(site, package):
    if package == "tf_bridge":
        pytest.importorskip("tensorflow")
    import importlib

    module = importlib.import_module(package)
    page = (ROOT / "docs" / "api" / f"{package}.md").read_text(encoding="utf-8")
    html = (site / "api" / package / "index.html").read_text(encoding="utf-8")
    paths = _public_paths(module)
    assert len(paths) == len(module.__all__) > 10
    assert [name for name, path in paths if f"\n::: {path}\n" not in page] == []
    # mkdocstrings resolved each one: its heading is in the built page
    assert [name for name, path in paths if f'id="{path}"' not in html] == []


def _copy(tmp_path: Path) -> Path:
    """A copy of the docs and the configuration whose API paths point at this repository."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").replace("paths: [.]", f"paths: [{ROOT}]")
    (tmp_path / "mkdocs.yml").write_text(config, encoding="utf-8")
    return tmp_path / "mkdocs.yml"


@pytest.mark.parametrize("addition, named", [
    ("[a page](no-such-page.md)", "no-such-page.md"),
    ("[a heading](cli.md#no-such-heading)", "no-such-heading"),
    ("::: onnx_qat.no_such_name", "onnx_qat.no_such_name"),
])
def test_a_broken_link_anchor_or_api_name_fails_the_build(tmp_path, addition, named):
    config = _copy(tmp_path)
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text(encoding="utf-8") + f"\n{addition}\n", encoding="utf-8")
    done = build(config, tmp_path / "site")
    assert done.returncode != 0
    assert named in done.stdout + done.stderr


def test_a_page_left_out_of_the_navigation_fails_the_build(tmp_path):
    config = _copy(tmp_path)
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n", encoding="utf-8")
    done = build(config, tmp_path / "site")
    assert done.returncode != 0
    assert "orphan.md" in done.stdout + done.stderr



#: Sphinx roles mkdocstrings does not render: a docstring must use Markdown cross-references
#: ([`name`][identifier]) or inline code instead.
SPHINX_ROLE = re.compile(r":(func|class|meth|mod|attr|data|exc|obj):`")


def literal_roles(site: Path) -> list:
    """``page: role`` for every literal Sphinx role in the built site's HTML (search index excluded)."""
    found = []
    for page in sorted(site.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        found += [f"{page.relative_to(site)}: {m.group(0)}" for m in SPHINX_ROLE.finditer(text)]
    return found


def test_no_literal_sphinx_role_in_the_built_site(site):
    assert literal_roles(site) == []


def test_a_literal_sphinx_role_is_found(tmp_path):
    page = tmp_path / "api" / "index.html"
    page.parent.mkdir()
    page.write_text("<p>What :func:`check` found.</p>", encoding="utf-8")
    assert literal_roles(tmp_path) == ["api/index.html: :func:`"]


def pages_missing_from_home(index: str, pages) -> list:
    """The navigation's pages (the home page itself excepted) that the home page's table does not link."""
    linked = set(re.findall(r"\]\(([\w/.-]+\.md)(?:#[\w-]*)?\)", index))
    return [page for page in pages if page != "index.md" and page not in linked]


def test_the_home_page_lists_every_page():
    from tests.test_docs import nav_pages

    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    table = index[index.index("## Pages"):]
    assert pages_missing_from_home(table, nav_pages()) == []


def test_a_page_missing_from_the_home_page_is_found():
    table = "| [Getting started](getting-started.md) | ... |\n| [CLI](cli.md#options) | ... |"
    assert pages_missing_from_home(table, ["index.md", "getting-started.md", "cli.md", "formats.md"]) == \
        ["formats.md"]
