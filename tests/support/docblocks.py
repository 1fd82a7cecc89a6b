"""Code blocks of the project's Markdown docs, and how tests/integration/test_docs.py runs them.

A fenced block whose info string is ``bash``/``sh``/``shell`` or ``python``/``py`` is
code a reader may run, so a test runs it. An HTML comment on the line before the fence
says otherwise (it is invisible on GitHub):

- ``<!-- docs-test: skip: REASON -->``: not run; the reason is required.
- ``<!-- docs-test: by TEST -->``: run by the named test in tests/integration/test_docs.py, which
  drives it (a long-running example, one that needs traffic or other processes).
- ``<!-- docs-test: stream NAME SUBJECT -->``: the test creates that stream first and
  drops the block's ``nats stream add NAME`` line (the NATS CLI is not installed).

Blocks with any other info string (``yaml``, ``text``, ``json``...) are not code to run;
a block without an info string is an error (say what it is).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python",
            "py": "python"}
#: Server addresses the docs use; the tests substitute their own server's.
DOC_SERVERS = ("nats://127.0.0.1:4222", "nats://localhost:4222")

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    info: str          # first word of the info string, lower case ("" if none)
    marker: str | None  # what the docs-test comment says, if any
    code: str

    @property
    def language(self) -> str | None:
        """``"bash"`` or ``"python"`` for runnable code, None for data and output."""
        return RUNNABLE.get(self.info)

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every Markdown file under docs/ (what a newcomer reads first)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file, dedented, with their markers."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(previous)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: code block never closed")
        out.append(Block(path, i + 1, opening["info"].lower(),
                         marker["what"] if marker else None, "\n".join(body) + "\n"))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def block_by_marker(marker: str) -> Block:
    """The one block whose docs-test comment is exactly ``marker``."""
    found = [b for b in all_blocks() if b.marker == marker]
    assert len(found) == 1, f"expected one block marked {marker!r}, found {len(found)}"
    return found[0]


def with_server(code: str, url: str) -> str:
    """The block with the docs' server addresses replaced by ``url``."""
    for address in DOC_SERVERS:
        code = code.replace(address, url)
    return code
