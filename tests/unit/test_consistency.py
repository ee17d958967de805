"""compat_matrix.yaml, the patch registry, pyproject extras, the .pth line, the README and the
generated docs pages agree."""

import glob
import importlib
import os
import re
import subprocess
import sys

import tomllib
from packaging.requirements import Requirement

from replay_plugin import _pth, compat, registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def _matrix():
    return compat.parse(__import__("yaml").safe_load(open(os.path.join(ROOT, "compat_matrix.yaml"))))


def _own_specs():
    packs = _pyproject()["project"]["entry-points"]["replay_plugin.patches"]
    specs = []
    for name, module in packs.items():
        specs.extend(registry.pack_specs(importlib.import_module(module).replay_plugin_patches(), name))
    return specs


def test_registry_equals_matrix():
    matrix = _matrix()
    specs = {s.name: s for s in _own_specs()}
    assert set(specs) == set(matrix.patches), "a patch is in the code but not the matrix, or vice versa"
    for name, spec in specs.items():
        entry = matrix.patches[name]
        assert spec.targets == entry.targets, name
        assert spec.upstream == entry.upstream and spec.default == entry.default
        assert spec.trigger.partition(".")[0] == matrix.upstreams[spec.upstream].import_name


def test_extras_equal_matrix_ranges():
    extras = _pyproject()["project"]["optional-dependencies"]
    expected = {}
    for up in _matrix().upstreams.values():
        for dist, extra in up.distributions.items():
            expected[extra] = (dist, up.supported)
    assert set(extras) == set(expected)
    for extra, reqs in extras.items():
        (req,) = [Requirement(r) for r in reqs]
        dist, supported = expected[extra]
        assert req.name == dist and req.specifier == supported, extra


def test_watched_names_equal_upstream_import_names():
    assert set(_pth.WATCHED) == {up.import_name for up in _matrix().upstreams.values()}


def test_entry_points_declared():
    eps = _pyproject()["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"replay_plugin": "replay_plugin.vllm.plugin:register"}
    assert eps["replay_plugin.patches"] == {
        "megatron": "replay_plugin.megatron.patches",
        "vllm": "replay_plugin.vllm.patches",
        "fsdp": "replay_plugin.fsdp.patches",
        "skyrl": "replay_plugin.skyrl.patches",
        "verl": "replay_plugin.verl.patches",
        "trl": "replay_plugin.trl.patches",
    }


def test_generated_files_are_current():
    """replay_plugin.pth, pyproject extras and the generated sections of README.md and docs/**/*.md
    equal what scripts/sync.py generates."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "sync.py"), "--check"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout


def _sync(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` with scripts/sync.py imported as ``sync`` (in a process of its own: importing it
    sets REPLAY_PLUGIN_DISABLE)."""
    prelude = f"import sys; sys.path.insert(0, {os.path.join(ROOT, 'scripts')!r}); import sync\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True)


_RENDER_CHECK = r"""
render, used = sync.renderers(sync.compat.load(sync.MATRIX)), set()
text = "x\n<!-- BEGIN generated:versions -->\nstale\n<!-- END generated:versions -->\ny\n"
out = sync.render_sections(text, "docs/page.md", render, used)
assert "stale" not in out and "| megatron-core |" in out and used == {"versions"}, out
unknown, unclosed, crossed = (
    "<!-- BEGIN generated:nope -->\n<!-- END generated:nope -->",
    "<!-- BEGIN generated:env -->",
    "<!-- BEGIN generated:versions -->\n<!-- END generated:env -->",
)
for bad in (unknown, unclosed, crossed):
    try:
        sync.render_sections(bad, "docs/page.md", render, set())
    except SystemExit as exc:
        assert "page.md" in str(exc), exc
    else:
        raise AssertionError(bad)
pages = {p[len(sync.ROOT) :] for p in sync.doc_pages()}
assert {"/README.md", "/docs/reference/patches.md", "/docs/reference/environment.md"} <= pages, pages
"""


def test_generated_sections_render_in_any_page():
    """A section is rendered wherever its markers sit; an unknown name or unbalanced markers fail,
    naming the file; the reference pages are among the pages read."""
    proc = _sync(_RENDER_CHECK)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_reference_pages_cover_every_patch_and_variable():
    """docs/reference/: a section per patch (targets, why, fix, remove-when) and a row per variable."""
    with open(os.path.join(ROOT, "docs", "reference", "patches.md"), encoding="utf-8") as fh:
        patches = fh.read()
    with open(os.path.join(ROOT, "docs", "reference", "environment.md"), encoding="utf-8") as fh:
        env = fh.read()
    for name, entry in _matrix().patches.items():
        section = patches.split(f"### `{name}`\n", 1)[1].split("\n### ", 1)[0]
        assert all(f"`{t}`" in section for t in entry.targets), name
        assert "**Why.**" in section and "**Upstream fix.**" in section and "**Remove when.**" in section, name
    for spec in _own_specs():
        assert f"| `{spec.env}` |" in env, spec.env
        for knob in spec.knobs:
            assert f"| `{knob.env}` |" in env, knob.env


def test_patch_ranges_inside_upstream_ranges():
    """Every patch covers every tested version of its upstream, or retires it on purpose (the
    upstream no longer has what it fixes: ``retired`` in the matrix, with the reason)."""
    m = _matrix()
    for p in m.patches.values():
        for v in m.upstreams[p.upstream].tested:
            covered, retired = compat.version_in(v, p.versions), compat.retired_reason(p.retired, v)
            assert covered or retired, f"{p.name} does not cover tested {p.upstream} {v}"
            assert not (covered and retired), f"{p.name} both covers and retires {p.upstream} {v}"


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading (its default slugify)."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _heading_slugs(page: str) -> set[str]:
    """The anchors of the Markdown headings of ``page`` (relative to the checkout)."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
        return {_slug(line.lstrip("#")) for line in fh if line.startswith("#")}


def test_readme_links_into_docs_resolve():
    """The README is not part of the docs site (whose strict build checks the pages' own links):
    every relative link it holds names a file that exists, and an anchor names a heading there."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        links = re.findall(r"\]\(([^)\s]+)\)", fh.read())
    relative = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in relative)
    for link in relative:
        path, _, anchor = link.partition("#")
        assert os.path.isfile(os.path.join(ROOT, path)), f"README links to {link}: no such file"
        if anchor:
            assert anchor in _heading_slugs(path), f"README links to {link}: {path} has no such heading"


def test_messages_pointing_into_docs_resolve():
    """Messages and docstrings of the package that name a page of docs/ (``docs/PAGE.md`` or
    ``docs/PAGE.md#anchor``, as doctor findings and refusals do) name a file that exists and, with an
    anchor, a heading there."""
    refs = set()
    for path in glob.glob(os.path.join(ROOT, "replay_plugin", "**", "*.py"), recursive=True):
        with open(path, encoding="utf-8") as fh:
            refs |= {
                (os.path.relpath(path, ROOT), ref) for ref in re.findall(r"docs/[\w./-]+\.md(?:#[\w-]+)?", fh.read())
            }
    assert any("#" in ref for _, ref in refs)
    for source, ref in sorted(refs):
        page, _, anchor = ref.partition("#")
        assert os.path.isfile(os.path.join(ROOT, page)), f"{source} names {ref}: no such file"
        if anchor:
            assert anchor in _heading_slugs(page), f"{source} names {ref}: {page} has no such heading"


def test_pairings_describe_supported_framework_releases():
    """Every RL framework's pairing (compat_matrix.yaml ``pairings``) is of a framework release the
    plugin supports where the plugin has patches for it, and what it says exists: the docs pages it
    cites and the REPLAY_PLUGIN_* variables it names."""
    matrix = _matrix()
    assert {p.framework for p in matrix.pairings} >= {"verl", "openrlhf", "trl", "skyrl"}
    known = set()
    for spec in _own_specs():
        known.add(spec.env)
        known.update(knob.env for knob in spec.knobs)
    for p in matrix.pairings:
        up = matrix.upstreams.get(p.framework)
        if up is not None:
            assert compat.version_in(p.version, up.supported), p.label()
        for doc in re.findall(r"docs/[\w/.-]+\.md", p.plugin):
            assert os.path.exists(os.path.join(ROOT, doc)), (p.label(), doc)
        for name in re.findall(r"REPLAY_PLUGIN_[A-Z0-9_]+", p.plugin):
            assert name in known, (p.label(), name)
