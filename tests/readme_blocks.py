"""The README's Python code blocks, by name, for the tests that run them as written.

Every ```python block of README.md is preceded by a marker line naming it:

    <!-- readme-test: NAME -->

and a test somewhere under tests/ runs it through :func:`run` (or :func:`source`).
tests/unit/test_readme_blocks.py fails on an unmarked block, a duplicate name, a block that
does not compile, or a name no test runs; the integration tests that run the blocks fail when
the README and the code drift apart. A block reads the names it does not define (a trainer's
``model``, its batch) from the namespace the test binds, and ``model=...`` in an engine call is
filled with the path of the embedded tiny model.
"""

from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
MARKER = re.compile(r"^\s*<!-- readme-test: ([a-z0-9][a-z0-9-]*) -->\s*$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    name: str | None  # None: the block has no marker
    language: str
    code: str
    line: int  # 1-based line of the opening fence


def blocks(path: str = README) -> list[Block]:
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
            Block(marker.group(1) if marker else None, language, textwrap.dedent("\n".join(body)) + "\n", start + 1)
        )
        i += 1
    return out


def python_blocks(path: str = README) -> list[Block]:
    return [b for b in blocks(path) if b.language == "python"]


def source(name: str, *, model: str | None = None) -> tuple[str, str]:
    """``(code, filename)`` of the block ``name``; ``model=...`` replaced by ``model=<path>``."""
    found = [b for b in python_blocks() if b.name == name]
    if len(found) != 1:
        raise LookupError(f"README.md has {len(found)} python blocks named {name!r}")
    code = found[0].code
    if model is not None:
        if code.count("model=...") != 1:
            raise LookupError(f"README block {name!r} must contain model=... exactly once to be filled")
        code = code.replace("model=...", f"model={model!r}")
    return code, f"README.md:{found[0].line}:{name}"


def run(name: str, namespace: dict | None = None, *, model: str | None = None) -> dict:
    """Execute the block as written in ``namespace`` (the names it reads but does not define);
    returns the namespace with what the block defined."""
    code, filename = source(name, model=model)
    ns = {"__name__": f"readme_{name.replace('-', '_')}"} | dict(namespace or {})
    exec(compile(code, filename, "exec"), ns)
    return ns
