"""A tiny PEP 517/660 build backend with no dependencies, so that
``pip install ./sdk/python`` works offline: pip needs nothing from an index
to build this package (setuptools and wheel are not required).

It packs ``src/roost`` into a pure-Python wheel (``build_wheel``), writes a
source archive (``build_sdist``), and for ``pip install -e`` a wheel whose
``.pth`` file points at ``src`` (``build_editable``). The metadata comes
from ``pyproject.toml``'s ``[project]`` table.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile
import zipfile
from typing import Any, Dict, List, Optional, Tuple

try:
    import tomllib  # Python >= 3.11
except ImportError:  # pragma: no cover - Python 3.9/3.10
    tomllib = None  # type: ignore[assignment]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "roost"
TAG = "py3-none-any"


def _project() -> Dict[str, Any]:
    path = os.path.join(ROOT, "pyproject.toml")
    if tomllib is not None:
        with open(path, "rb") as file:
            return dict(tomllib.load(file)["project"])
    return _parse_project_table(path)


def _parse_project_table(path: str) -> Dict[str, Any]:
    """The few [project] keys this backend uses, for Pythons without tomllib
    (simple `key = "value"` and `key = ["a", "b"]` lines only)."""
    import ast

    project: Dict[str, Any] = {}
    section = None
    with open(path, encoding="utf-8") as file:
        for line in file:
            line = line.strip()
            if line.startswith("["):
                section = line.strip("[]")
                continue
            if section != "project" or "=" not in line:
                continue
            key, value = (part.strip() for part in line.split("=", 1))
            if value.startswith(('"', "[")) and value.endswith(('"', "]")):
                project[key] = ast.literal_eval(value)
    return project


def _metadata() -> str:
    project = _project()
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {project['name']}",
        f"Version: {project['version']}",
        f"Summary: {project.get('description', '')}",
        f"Requires-Python: {project.get('requires-python', '>=3.9')}",
        "License: Apache-2.0",
    ]
    lines += [f"Classifier: {c}" for c in project.get("classifiers", [])]
    lines += [f"Requires-Dist: {d}" for d in project.get("dependencies", [])]
    readme = os.path.join(ROOT, "README.md")
    body = ""
    if os.path.exists(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme, encoding="utf-8") as file:
            body = file.read()
    return "\n".join(lines) + "\n\n" + body


def _dist_name() -> Tuple[str, str]:
    project = _project()
    return project["name"].replace("-", "_"), project["version"]


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _write_wheel(directory: str, files: List[Tuple[str, bytes]]) -> str:
    name, version = _dist_name()
    dist_info = f"{name}-{version}.dist-info"
    files = files + [
        (f"{dist_info}/METADATA", _metadata().encode()),
        (f"{dist_info}/WHEEL", f"Wheel-Version: 1.0\nGenerator: roost_build\nRoot-Is-Purelib: true\nTag: {TAG}\n".encode()),
    ]
    record = [_record_line(path, data) for path, data in files] + [f"{dist_info}/RECORD,,"]
    files.append((f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode()))
    wheel_name = f"{name}-{version}-{TAG}.whl"
    with zipfile.ZipFile(os.path.join(directory, wheel_name), "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in files:
            wheel.writestr(zipfile.ZipInfo(path, date_time=(2024, 1, 1, 0, 0, 0)), data)
    return wheel_name


def _package_files() -> List[Tuple[str, bytes]]:
    files = []
    source = os.path.join(ROOT, "src")
    for directory, dirs, names in os.walk(os.path.join(source, PACKAGE)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for file_name in sorted(names):
            if file_name.endswith((".py", ".typed")):
                path = os.path.join(directory, file_name)
                with open(path, "rb") as file:
                    files.append((os.path.relpath(path, source).replace(os.sep, "/"), file.read()))
    return files


def get_requires_for_build_wheel(config_settings: Optional[Dict[str, Any]] = None) -> List[str]:
    return []


get_requires_for_build_sdist = get_requires_for_build_wheel
get_requires_for_build_editable = get_requires_for_build_wheel


def build_wheel(
    wheel_directory: str,
    config_settings: Optional[Dict[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    return _write_wheel(wheel_directory, _package_files())


def build_editable(
    wheel_directory: str,
    config_settings: Optional[Dict[str, Any]] = None,
    metadata_directory: Optional[str] = None,
) -> str:
    pth = (os.path.join(ROOT, "src") + "\n").encode()
    return _write_wheel(wheel_directory, [(f"_{PACKAGE}_editable.pth", pth)])


def build_sdist(sdist_directory: str, config_settings: Optional[Dict[str, Any]] = None) -> str:
    name, version = _dist_name()
    base = f"{name}-{version}"
    archive = f"{base}.tar.gz"
    with tarfile.open(os.path.join(sdist_directory, archive), "w:gz") as tar:
        for relative in ["pyproject.toml", "README.md", "_build/roost_build.py"]:
            path = os.path.join(ROOT, relative)
            if os.path.exists(path):
                tar.add(path, f"{base}/{relative}")
        for path, data in _package_files():
            info = tarfile.TarInfo(f"{base}/src/{path}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        pkg_info = _metadata().encode()
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        tar.addfile(info, io.BytesIO(pkg_info))
    return archive
