"""Every Python block of the README and the docs pages is named and run by a test
(tests/readme_blocks.py)."""

from __future__ import annotations

import glob
import os
import re

import pytest
import readme_blocks  # tests/readme_blocks.py (tests/ is on sys.path: support/__init__.py)

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUN_CALL = re.compile(r"readme_blocks\.(?:run|source)\(\s*[\"']([a-z0-9-]+)[\"']")


def _names_run_by_tests() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(TESTS, "**", "test_*.py"), recursive=True):
        if os.path.basename(path) == os.path.basename(__file__):
            continue
        with open(path, encoding="utf-8") as fh:
            for name in RUN_CALL.findall(fh.read()):
                out.setdefault(name, []).append(os.path.relpath(path, TESTS))
    return out


def test_every_python_block_is_named_once_and_compiles():
    blocks = readme_blocks.python_blocks()
    assert blocks, "the README and docs/ have no python blocks?"
    unnamed = [readme_blocks.where(b) for b in blocks if b.name is None]
    assert not unnamed, f"python blocks without a '<!-- readme-test: NAME -->' line before them: {unnamed}"
    names = [b.name for b in blocks]
    dups = sorted({n for n in names if names.count(n) > 1})
    assert not dups, "block names used twice (names are unique across README.md and docs/): " + ", ".join(
        f"{n} at {[readme_blocks.where(b) for b in blocks if b.name == n]}" for n in dups
    )
    for b in blocks:
        compile(b.code, readme_blocks.where(b), "exec")


def test_docs_pages_are_read():
    """Blocks are looked up in docs/**/*.md as well as in README.md (the integration pages hold most)."""
    pages = readme_blocks.pages()
    assert pages[0] == readme_blocks.README
    assert any(p.startswith(readme_blocks.DOCS + os.sep) for p in pages)
    assert any(b.path != readme_blocks.README for b in readme_blocks.python_blocks())


def test_every_block_is_run_by_a_test_and_every_run_names_a_block():
    named = {b.name for b in readme_blocks.python_blocks()}
    run = _names_run_by_tests()
    assert not named - set(run), f"README blocks no test runs: {sorted(named - set(run))}"
    assert not set(run) - named, f"tests run blocks the README no longer has: { {n: run[n] for n in set(run) - named} }"


def test_markers_sit_on_python_blocks(tmp_path):
    markers = 0
    for page in readme_blocks.pages():
        with open(page, encoding="utf-8") as fh:
            markers += sum(1 for line in fh if readme_blocks.MARKER.match(line))
    assert markers == len([b for b in readme_blocks.python_blocks() if b.name])


def test_the_parser_sees_an_unmarked_block(tmp_path):
    """The inventory test can fail: an unmarked block is reported as such."""
    path = tmp_path / "README.md"
    path.write_text("text\n\n<!-- readme-test: a -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n")
    blocks = readme_blocks.python_blocks(str(path))
    assert [(b.name, b.code) for b in blocks] == [("a", "x = 1\n"), (None, "y = 2\n")]


def test_model_placeholder_is_filled_exactly_once():
    code, _ = readme_blocks.source("vllm-offline", model="/models/tiny")
    assert "model='/models/tiny'" in code and "model=..." not in code
    with pytest.raises(LookupError):
        readme_blocks.source("megatron-batch", model="/models/tiny")
