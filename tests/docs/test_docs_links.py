"""The README and docs/*.md point at things that exist and show commands that parse.

* Every relative link resolves: the file or directory exists, and an anchor
  (``page.md#section`` or ``#section``) names a heading of that page, slugged as GitHub
  does.
* Every ``gpulet ...`` command they show (a ``$ gpulet`` or ``$ .venv/bin/gpulet`` line
  of a console block, or an inline code span that starts with ``gpulet``) parses with
  the real command line's parser: argument parsing only, nothing runs. A command
  written as a template (``<gpu>``, ``...``, ``a|b``) is skipped.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpulet.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
# A placeholder (<gpu>, N, NAME), an ellipsis or alternatives (a|b): not a command.
TEMPLATE = re.compile(r"<[^>]*>|\.\.\.|…|\||\b[A-Z]+\b")


def _prose(text: str) -> Iterator[tuple[int, str]]:
    """The lines outside fenced blocks, with their numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _blocks(text: str) -> Iterator[tuple[int, str]]:
    """The lines inside fenced blocks, with their numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation other than
    ``-`` and ``_`` removed, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose(page.read_text()):
        found = HEADING.match(line)
        if not found:
            continue
        base = slug(found.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def _without_spans(line: str) -> str:
    return SPAN.sub("", line)


def links() -> Iterator[tuple[str, Path, str]]:
    for page in PAGES:
        for number, line in _prose(page.read_text()):
            for target in LINK.findall(_without_spans(line)):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                yield f"{page.relative_to(ROOT)}:{number}", page, target


@pytest.mark.parametrize(("where", "page", "target"), list(links()))
def test_every_relative_link_resolves(where: str, page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists(), f"{where}: {target}: {resolved} does not exist"
    if anchor:
        assert resolved.suffix == ".md", f"{where}: {target}: an anchor into a non-page"
        assert anchor in anchors(resolved), (
            f"{where}: {target}: no heading of {resolved.name} has the anchor #{anchor}"
        )


def _command(text: str) -> list[str] | None:
    """The arguments of one ``gpulet ...`` command, or None for a template."""
    text = text.split(" #", 1)[0].strip()  # a console line's comment
    if TEMPLATE.search(text):
        return None
    try:
        words = shlex.split(text)
    except ValueError:
        return None
    if not words or Path(words[0]).name != "gpulet" or len(words) < 2:
        return None
    if words[1].endswith(":"):  # what gpulet printed ("gpulet run: error: ..."), quoted
        return None
    return words[1:]


def commands() -> Iterator[tuple[str, list[str]]]:
    for page in PAGES:
        text = page.read_text()
        pending = ""
        for number, line in _blocks(text):
            stripped = line.strip()
            if pending:
                stripped = pending + " " + stripped
                pending = ""
            elif not stripped.startswith("$ "):
                continue
            if stripped.endswith("\\"):
                pending = stripped[:-1]
                continue
            # Only the first command of a shell line (`a && b`) and no pipes into it.
            first = re.split(r"\s(?:&&|;|\|\|)\s", stripped.removeprefix("$ "), maxsplit=1)[0]
            argv = _command(first)
            if argv is not None:
                yield f"{page.relative_to(ROOT)}:{number}", argv
        for number, line in _prose(text):
            for _, span in SPAN.findall(line):
                argv = _command(span)
                if argv is not None:
                    yield f"{page.relative_to(ROOT)}:{number}", argv


COMMANDS = list(commands())


def test_the_pages_show_commands_at_all() -> None:
    """The extraction finds the README's tour, so a broken extractor cannot pass."""
    shown = [" ".join(argv) for _, argv in COMMANDS]
    assert "mock inject --gpu 2 --xid 79" in shown
    assert "health" in shown
    assert len(COMMANDS) > 50


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_gpulet_command_parses(where: str, argv: list[str]) -> None:
    error = _parse(argv)
    if error is not None and "arguments are required" in error and not _has_options(argv):
        # A command named in prose (`gpulet health clear`, `gpulet fleet`): it exists.
        error = _parse([*argv, "--help"])
    assert error is None, f"{where}: gpulet {shlex.join(argv)}: {error}"


def _has_options(argv: list[str]) -> bool:
    return any(a.startswith("-") for a in argv)


def _parse(argv: list[str]) -> str | None:
    """What the real parser says of ``argv``: None when it takes it."""
    parser = build_parser(argv[0])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            parser.parse_args(argv)
        except SystemExit as exited:  # --help exits 0; a mistake exits 2
            if exited.code != 0:
                return err.getvalue().strip() or f"exit {exited.code}"
    return None


def test_a_wrong_command_or_link_is_caught(tmp_path: Path) -> None:
    """The checks can fail: a made-up command and a made-up anchor."""
    parser = build_parser("health")
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exited:
        parser.parse_args(["health", "clear", "--no-such-flag"])
    assert exited.value.code == 2
    page = tmp_path / "page.md"
    page.write_text("# A `code` heading: with, punctuation\n\n## Twice\n\n## Twice\n")
    assert anchors(page) == {"a-code-heading-with-punctuation", "twice", "twice-1"}
