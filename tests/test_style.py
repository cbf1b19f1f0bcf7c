"""Source style the project declares and keeps: line length from pyproject.toml's ``[tool.ruff]``,
no trailing whitespace or tabs.

Pure file reading, so these run in well under a second.
"""
import re
from pathlib import Path
from typing import Iterable, List

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("onnx_qat", "tf_bridge", "tools", "tests")


def _max_line_length() -> int:
    """``line-length`` of ``[tool.ruff]`` in pyproject.toml (the one linter configuration)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("\n[tool.ruff]\n", 1)[1].split("\n[", 1)[0]
    return int(re.search(r"^line-length = (\d+)$", section, re.M).group(1))


def _sources() -> List[Path]:
    """Every ``*.py`` file under the source directories, sorted."""
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def _lines(path: Path) -> Iterable[tuple]:
    """``(line number, line without its newline)`` of a UTF-8 file."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            yield number, line.rstrip("\n")


def _long_lines(paths: Iterable[Path], limit: int) -> List[str]:
    """``file:line:length`` of each line longer than ``limit`` characters (not bytes)."""
    return [f"{_name(p)}:{n}:{len(line)}" for p in paths for n, line in _lines(p) if len(line) > limit]


def _whitespace_problems(paths: Iterable[Path]) -> List[str]:
    """``file:line: what`` for trailing whitespace and tabs in indentation."""
    problems = []
    for p in paths:
        for n, line in _lines(p):
            if line != line.rstrip():
                problems.append(f"{_name(p)}:{n}: trailing whitespace")
            if "\t" in line[:len(line) - len(line.lstrip())]:
                problems.append(f"{_name(p)}:{n}: tab in indentation")
    return problems


def _name(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def test_sources_are_found_and_the_limit_is_read():
    limit = _max_line_length()
    assert limit == 110
    names = {_name(p) for p in _sources()}
    assert {"onnx_qat/__init__.py", "tf_bridge/__init__.py", "tools/deploy_tensorrt.py",
            "tests/test_style.py"} <= names


def test_no_line_is_longer_than_max_line_length():
    limit = _max_line_length()
    offenders = _long_lines(_sources(), limit)
    assert offenders == [], (f"{len(offenders)} line(s) longer than {limit} characters: "
                             + ", ".join(offenders))


def test_no_trailing_whitespace_or_tab_indentation():
    problems = _whitespace_problems(_sources())
    assert problems == [], f"{len(problems)} whitespace problem(s): " + ", ".join(problems)


def test_the_checks_find_what_they_look_for(tmp_path):
    # Characters, not bytes: 110 non-ASCII characters (220 bytes) pass, 111 do not.
    sample = tmp_path / "sample.py"
    sample.write_text("x = 1\n" + "é" * 110 + "\n" + "é" * 111 + "\n"
                      "y = 2  \n" "if y:\n\tpass\n", encoding="utf-8")
    assert _long_lines([sample], 110) == [f"{sample}:3:111"]
    assert _whitespace_problems([sample]) == [f"{sample}:4: trailing whitespace",
                                              f"{sample}:6: tab in indentation"]
