#!/usr/bin/env python3
"""Regenerate what is derived from compat_matrix.yaml and the patch registry.

    python scripts/sync.py            # rewrite replay_plugin.pth, pyproject extras, README tables
                                      # (and the demo tables, from the runs kept in docs/demo/)
    python scripts/sync.py --check    # exit 1 (with a diff) when any of them is out of date
    <env>/bin/python scripts/sync.py --fingerprints
                                      # record target fingerprints of the upstream versions
                                      # installed in <env> (tested versions only)

Runs from the source tree (it puts the checkout first on sys.path).
"""

from __future__ import annotations

import difflib
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ["REPLAY_PLUGIN_DISABLE"] = "1"  # inspect upstream code without activating patches

from replay_plugin import _pth, compat, registry, settings  # noqa: E402
from replay_plugin.spec import toggle_name  # noqa: E402

MATRIX = os.path.join(ROOT, "compat_matrix.yaml")
DEMO_RUNS = os.path.join(ROOT, "docs", "demo")  # `replay-plugin demo --json` output of real runs


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
    rows = ["| upstream | distributions (extra) | supported | tested in CI |", "| --- | --- | --- | --- |"]
    for up in matrix.upstreams.values():
        dists = ", ".join(f"`{d}` (`[{e}]`)" for d, e in up.distributions.items())
        rows.append(f"| {up.key} | {dists} | `{compat.format_spec(up.supported)}` | {', '.join(up.tested)} |")
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
        rows.append(
            f"| `{p.name}` | {p.upstream} | `{compat.format_spec(p.versions)}` | {'on' if p.default else 'off'} | "
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


def replace_between(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- BEGIN generated:{name} -->", f"<!-- END generated:{name} -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"README.md lacks the markers {begin} ... {end}")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


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

    path = os.path.join(ROOT, "README.md")
    with open(path) as fh:
        text = fh.read()
    text = replace_between(text, "versions", versions_table(matrix))
    text = replace_between(text, "patches", patches_table(matrix))
    text = replace_between(text, "env", env_table(own_specs()))
    for trainer in ("megatron", "hf"):
        text = replace_between(text, f"demo-{trainer}", demo_table(trainer))
        text = replace_between(text, f"demo-{trainer}-seeds", demo_spread(trainer))
    out[path] = text
    return out


def record_fingerprints() -> None:
    """Write fingerprints of the installed, tested upstream versions into compat_matrix.yaml,
    keeping the rest of the file (comments included) as it is."""
    compat._CACHE.clear()
    matrix = compat.load(MATRIX)
    with open(MATRIX) as fh:
        text = fh.read()
    for name, patch in matrix.patches.items():
        up = matrix.upstreams[patch.upstream]
        _, version = compat.installed_version(up)
        if version is None:
            continue
        public = compat.parse_version(version).public
        if public not in up.tested or not compat.version_in(version, patch.versions):
            print(f"skip {name}: {patch.upstream} {version} is not a tested version")
            continue
        check = compat.check_fingerprints(patch.targets, {}, version)
        if check.state == "missing":
            raise SystemExit(f"{name}: {check.detail}")
        prints = dict(patch.fingerprints)
        prints[public] = check.fingerprints
        text = _replace_fingerprints(text, name, prints, patch.targets)
        print(f"{name}: recorded {public}")
    with open(MATRIX, "w") as fh:
        fh.write(text)


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
    if "--fingerprints" in argv:
        record_fingerprints()
        return 0
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
