"""The lock file is the one source of what gets installed.

``make run``, ``make test`` and ``.ci/run`` install from ``uv.lock`` (``uv sync
--frozen``); the image installs ``requirements/all.txt``, which ``make lock`` exports
from it with hashes. These tests hold the three together without the network:

* ``uv.lock`` records the requirements of the ``pyproject.toml`` it was made from: a
  dependency added to pyproject.toml without ``make lock`` fails here, not on a user's
  machine;
* ``requirements/all.txt`` is exactly what ``uv export`` makes of ``uv.lock`` today;
* every package the image installs is pinned to one version with a hash.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def uv() -> str:
    found = ROOT / ".tools" / "bin" / "uv"
    if found.exists():
        return str(found)
    on_path = shutil.which("uv")
    assert on_path, "uv not found: `make install` puts it in .tools/bin"
    return on_path


def _normalize(requirement: str) -> tuple[str, str]:
    """``(name, specifier)`` of a PEP 508 string, names normalized as PEP 503 says."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)", requirement)
    assert match, requirement
    name = re.sub(r"[-_.]+", "-", match.group(1)).lower()
    extras = (match.group(2) or "").replace(" ", "")
    spec = match.group(3).replace(" ", "")
    return name + extras, spec


def test_the_lock_was_made_from_this_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    gpulet = next(p for p in lock["package"] if p["name"] == "gpulet")
    recorded: dict[str, Any] = gpulet["metadata"]
    want: set[tuple[str, str, str]] = {(*_normalize(r), "") for r in project["dependencies"]} | {
        (*_normalize(r), extra)
        for extra, reqs in project["optional-dependencies"].items()
        for r in reqs
    }
    got: set[tuple[str, str, str]] = set()
    for entry in recorded["requires-dist"]:
        extras = entry.get("extras") or []
        name = entry["name"] + ("[" + ",".join(sorted(extras)) + "]" if extras else "")
        marker = entry.get("marker", "")
        extra = re.search(r"extra == '([^']+)'", marker)
        got.add((_normalize(name)[0], entry.get("specifier", ""), extra.group(1) if extra else ""))
    want = {(n if not n.startswith("gpulet[") else _sorted_extras(n), s, e) for n, s, e in want}
    assert got == want, {"in pyproject only": want - got, "in uv.lock only": got - want}


def _sorted_extras(name: str) -> str:
    inner = name[len("gpulet[") : -1]
    return "gpulet[" + ",".join(sorted(inner.split(","))) + "]"


def test_the_image_requirements_are_the_lock_exported() -> None:
    exported = subprocess.run(
        [
            uv(),
            "export",
            "--frozen",
            "--extra",
            "all",
            "--no-emit-project",
            "--no-header",
            "--format",
            "requirements-txt",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert (ROOT / "requirements" / "all.txt").read_text() == exported, (
        "requirements/all.txt is stale: run `make lock`"
    )


def test_every_image_package_is_pinned_with_a_hash() -> None:
    text = (ROOT / "requirements" / "all.txt").read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text.strip())
    names = set()
    for block in blocks:
        head = block.splitlines()[0]
        assert re.match(r"^[A-Za-z0-9._-]+==[^ ;]+( ;.*)? \\$", head), head
        assert "--hash=sha256:" in block, head
        names.add(head.split("==")[0].lower())
    # What the agent runs with is there; what only the tests use is not.
    assert {"anyio", "nats-py", "msgspec", "kubernetes-asyncio", "grpcio"} <= names
    assert not {"pytest", "mypy", "ruff"} & names
