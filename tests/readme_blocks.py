"""The Python code blocks of README.md and the docs pages (docs/**/*.md), by name, for the tests
that run them as written.

Every ```python block of those files is preceded by a marker line naming it:

    <!-- readme-test: NAME -->

and a test somewhere under tests/ runs it through :func:`run` (or :func:`source`).
A name is looked up across all those files (names are unique across them), so a block can move
between the README and a page without touching the test that runs it.
tests/unit/test_readme_blocks.py fails on an unmarked block, a duplicate name, a block that
does not compile, or a name no test runs; the integration tests that run the blocks fail when
the documentation and the code drift apart. A block reads the names it does not define (a trainer's
``model``, its batch) from the namespace the test binds, and ``model=...`` in an engine call is
filled with the path of the embedded tiny model.
"""

from __future__ import annotations

import glob
import os
import re
import textwrap
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
MARKER = re.compile(r"^\s*<!-- readme-test: ([a-z0-9][a-z0-9-]*) -->\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    name: str | None  # None: the block has no marker
    language: str
    code: str
    line: int  # 1-based line of the opening fence
    path: str = README  # the file that holds it


def pages() -> list[str]:
    """README.md and every Markdown page under docs/: the files whose blocks are looked up."""
    return [README, *sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))]


def blocks(path: str | None = None) -> list[Block]:
    """The fenced blocks of ``path``, or of every file of :func:`pages` when it is None."""
    if path is None:
        return [b for page in pages() for b in blocks(page)]
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, language, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        marker = MARKER.match(lines[start - 1]) if start else None
        out.append(
            Block(
                marker.group(1) if marker else None,
                language,
                textwrap.dedent("\n".join(body)) + "\n",
                start + 1,
                path,
            )
        )
        i += 1
    return out


def where(block: Block) -> str:
    """``FILE:LINE`` of a block, FILE relative to the checkout (``docs/integrations/vllm.md:42``)."""
    return f"{os.path.relpath(block.path, ROOT)}:{block.line}"


def python_blocks(path: str | None = None) -> list[Block]:
    return [b for b in blocks(path) if b.language == "python"]


def source(name: str, *, model: str | None = None) -> tuple[str, str]:
    """``(code, filename)`` of the block ``name``; ``model=...`` replaced by ``model=<path>``."""
    found = [b for b in python_blocks() if b.name == name]
    if len(found) != 1:
        raise LookupError(
            f"README.md and docs/ have {len(found)} python blocks named {name!r}: {[where(b) for b in found]}"
        )
    code = found[0].code
    if model is not None:
        if code.count("model=...") != 1:
            raise LookupError(f"block {name!r} ({where(found[0])}) must contain model=... exactly once to be filled")
        code = code.replace("model=...", f"model={model!r}")
    return code, f"{where(found[0])}:{name}"


def run(name: str, namespace: dict | None = None, *, model: str | None = None) -> dict:
    """Execute the block as written in ``namespace`` (the names it reads but does not define);
    returns the namespace with what the block defined."""
    code, filename = source(name, model=model)
    ns = {"__name__": f"readme_{name.replace('-', '_')}"} | dict(namespace or {})
    exec(compile(code, filename, "exec"), ns)
    return ns
