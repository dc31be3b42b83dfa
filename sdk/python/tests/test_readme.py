"""Docs that stay true (issue 19, point 7): every ```python block of
sdk/python/README.md and of the repository README runs against the
session's `roost up`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import Deployment

README = Path(__file__).resolve().parents[1] / "README.md"
REPO_README = Path(__file__).resolve().parents[3] / "README.md"


def _blocks(path: Path = README) -> List[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def test_the_readme_has_the_examples() -> None:
    assert len(_blocks()) >= 3


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_example_runs(index: int, deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: Dict[str, Any] = {"__name__": f"readme_example_{index}"}
    exec(compile(_blocks()[index], f"{README}:block{index}", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed, "the example printed its results"
    if index == 0:
        assert "exited 0 42" in printed and "stdout" in printed
    if index == 1:
        assert "tests pass" in printed and "replicated" in printed and "calc.py" in printed


@pytest.mark.parametrize("index", range(len(_blocks(REPO_README))))
def test_repository_readme_example_runs(
    index: int, deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    exec(compile(_blocks(REPO_README)[index], f"{REPO_README}:block{index}", "exec"), {"__name__": "readme"})
    assert "hello" in capsys.readouterr().out
