"""The ``replay-plugin`` command: status, doctor, matrix, demo, bench."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import site
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from . import __version__

_STATUS_CHILD = r"""
import importlib, json, sys, traceback
out, mods = sys.argv[1], sys.argv[2:]
failed = []
for m in mods:
    try:
        importlib.import_module(m)
    except BaseException as exc:
        failed.append({"module": m, "error": repr(exc), "traceback": traceback.format_exc()})
import replay_plugin
from replay_plugin import states
doc = {"patches": replay_plugin.status(), "import_errors": failed, "events": states.events(),
       "process": states.process_info()}
with open(out, "w") as fh:
    json.dump(doc, fh)
"""


def _table(rows: list[dict], columns: Sequence[str]) -> str:
    cells = [list(columns)] + [[str(r.get(c, "") if r.get(c) is not None else "-") for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- status


def status_in_fresh_process(modules: Sequence[str], python: str | None = None) -> dict:
    """Import ``modules`` in a fresh interpreter (which activates the plugin the way a user's
    job would) and return its status document."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "status.json")
        proc = subprocess.run(
            [python or sys.executable, "-c", _STATUS_CHILD, out, *modules],
            capture_output=True,
            text=True,
        )
        if not os.path.exists(out):
            raise RuntimeError(f"status subprocess failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(out, encoding="utf-8") as fh:
            return json.load(fh)


def cmd_status(args: argparse.Namespace) -> int:
    doc = status_in_fresh_process(args.imports)
    if args.json:
        print(json.dumps({"patches": doc["patches"]}))
    else:
        print(_table(doc["patches"], ("name", "upstream", "version", "tier", "state", "reason")))
        for event in doc.get("events", []):
            print(f"note: {event}")
        for failure in doc["import_errors"]:
            print(f"import of {failure['module']} failed: {failure['error']}", file=sys.stderr)
    return 2 if doc["import_errors"] else 0


# --------------------------------------------------------------------------- matrix


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send file descriptor 1 to stderr: upstream imports (vLLM's logger) print on stdout, which
    must hold only our output (``--json``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def matrix_report(check_sources: bool = True, only: Sequence[str] = (), require_tested: bool = False) -> dict:
    """Installed upstream versions and patch fingerprints (targets and relied-on code) compared
    with the matrix (restricted to the upstream keys in ``only`` when given). Each installed
    upstream carries its tier; ``require_tested`` makes any tier but ``tested`` a problem."""
    from . import _bootstrap, compat

    _bootstrap._remove_lazy_finder()  # inspect upstream code without activating patches
    matrix = compat.load()
    upstreams = []
    problems = []
    installed: dict[str, str | None] = {}
    unknown = [k for k in only if k not in matrix.upstreams]
    if unknown:
        raise SystemExit(f"unknown upstream(s) {', '.join(unknown)}; the matrix has {', '.join(matrix.upstreams)}")
    for key, up in matrix.upstreams.items():
        if only and key not in only:
            continue
        dist, version = compat.installed_version(up)
        installed[key] = version
        tier = compat.version_tier(up, version)
        upstreams.append(
            {
                "upstream": key,
                "distribution": dist,
                "version": version,
                "supported": compat.format_spec(up.supported),
                "tested": list(up.tested),
                "source_verified": list(up.source_verified),
                "tier": tier,
                "state": "not-installed" if version is None else ("unsupported" if tier == "unsupported" else "ok"),
                "evidence": up.source_verified.get(compat.parse_version(version).public, "") if version else "",
            }
        )
        if require_tested and tier not in (None, "tested"):
            problems.append(f"{key} {version} is {tier}, not tested in CI (--require-tested)")
    patches = []
    for name, p in matrix.patches.items():
        if only and p.upstream not in only:
            continue
        version = installed.get(p.upstream)
        row: dict[str, Any] = {
            "patch": name,
            "upstream": p.upstream,
            "version": version,
            "versions": compat.format_spec(p.versions),
            "tier": None,
        }
        if version is None:
            row.update(state="not-installed", detail="")
        elif not compat.version_in(version, p.versions):
            row.update(state="unsupported", tier="unsupported", detail=f"{p.upstream} {version} outside {p.versions}")
            problems.append(f"{name}: {p.upstream} {version} is outside the supported range {p.versions}")
        elif check_sources:
            with _stdout_to_stderr():
                check = compat.check_fingerprints(p.targets, p.fingerprints, version, p.relies_on)
            row.update(
                state=check.state,
                tier=compat.version_tier(matrix.upstreams[p.upstream], version),
                detail=check.detail,
                fingerprints=check.fingerprints,
                changed_targets=check.changed_targets,
                changed_relied_on=check.changed_relied_on,
            )
            if not check.ok:
                problems.append(f"{name}: {check.detail}")
        else:
            row.update(
                state="ok",
                tier=compat.version_tier(matrix.upstreams[p.upstream], version),
                detail="sources not checked",
            )
        patches.append(row)
    return {"matrix": matrix.path, "upstreams": upstreams, "patches": patches, "problems": problems, "ok": not problems}


def cmd_matrix(args: argparse.Namespace) -> int:
    report = matrix_report(check_sources=True, only=args.upstreams, require_tested=args.require_tested)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"compat matrix: {report['matrix']}")
        print(_table(report["upstreams"], ("upstream", "distribution", "version", "supported", "tier")))
        for up in report["upstreams"]:
            if up["tier"] == "source-verified":
                print(f"note: {up['upstream']} {up['version']} is source-verified, never run in CI: {up['evidence']}")
            elif up["tier"] == "untested":
                print(f"note: {up['upstream']} {up['version']} is inside the supported range but untested")
        print()
        print(_table(report["patches"], ("patch", "upstream", "version", "versions", "state", "detail")))
        if args.check:
            print()
            for problem in report["problems"]:
                print(f"FAIL {problem}")
            print("matrix check: " + ("OK" if report["ok"] else f"{len(report['problems'])} problem(s)"))
    return 1 if args.check and not report["ok"] else 0


# --------------------------------------------------------------------------- doctor


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if user:
        dirs.append(user)
    return [d for d in dict.fromkeys(dirs)]


def _pth_files() -> list[str]:
    return [p for p in (os.path.join(d, "replay_plugin.pth") for d in _site_dirs()) if os.path.exists(p)]


def _check_pth() -> list[str]:
    """The .pth line is installed, current, processed, and arms the finder in a fresh process."""
    from . import _pth, settings

    problems = []
    expected = _pth.pth_line()
    found = _pth_files()
    if not found:
        problems.append(
            "replay_plugin.pth is not in this interpreter's site-packages "
            f"({', '.join(_site_dirs())}): activation on import will not happen. Install the wheel "
            "(not editable, not --target), or call replay_plugin.activate() in your code"
        )
    for path in found:
        with open(path, encoding="utf-8") as fh:
            if fh.read() != expected:
                problems.append(f"{path} differs from this version's .pth line (stale or second install)")
    if sys.flags.no_site or sys.flags.isolated:
        problems.append("this interpreter runs with -S or -I: .pth files are not processed")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; f = sys.__dict__.get({_pth.MARKER!r}); print(f is not None and f in sys.meta_path)",
        ],
        capture_output=True,
        text=True,
    )
    if not settings.disabled() and probe.stdout.strip() != "True":
        problems.append(f"a fresh `{sys.executable}` does not arm the import finder (the .pth line did not run)")
    return problems


def _check_distribution() -> list[str]:
    """One installed copy, and the one being imported."""
    import replay_plugin

    names = ("replay-plugin", "replay_plugin")
    dists = [d for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").lower() in names]
    locations = sorted({str(d.locate_file("")) for d in dists})
    problems = []
    if len(dists) > 1:
        problems.append(f"replay-plugin is installed {len(dists)} times: {', '.join(locations)}")
    pkg_dir = os.path.dirname(os.path.abspath(replay_plugin.__file__))
    if dists and not any(pkg_dir.startswith(os.path.abspath(loc)) for loc in locations):
        problems.append(
            f"replay_plugin is imported from {pkg_dir}, not from the installed distribution at {locations[0]}"
        )
    return problems


def _check_vllm_plugins() -> list[str]:
    value = os.environ.get("VLLM_PLUGINS")
    if value is None or "replay_plugin" in [p.strip() for p in value.split(",")]:
        return []
    return [
        f"VLLM_PLUGINS={value!r} excludes 'replay_plugin': vLLM processes that do not process .pth "
        "files will not activate the plugin; add replay_plugin to the list"
    ]


def _check_upstreams() -> tuple[list[str], list[str]]:
    """(installed upstream versions, problems: versions outside the supported ranges)."""
    from . import compat

    versions, problems = [], []
    for up in compat.load().upstreams.values():
        dist, version = compat.installed_version(up)
        if version is None:
            continue
        versions.append(f"{dist} {version}")
        if not compat.version_in(version, up.supported):
            problems.append(f"{dist} {version} is outside the supported range {up.supported} (patches will be skipped)")
    return versions, problems


def _check_settings() -> list[str]:
    """Unknown or unreadable REPLAY_PLUGIN_* variables, and packs that failed to load."""
    from . import registry, settings, states

    reg = registry.get()
    reg.load_packs()
    return settings.problems(reg.known_env()) + states.events()


def doctor_report() -> dict:
    from . import settings

    versions, version_problems = _check_upstreams()
    problems = _check_pth() + _check_distribution() + _check_vllm_plugins() + version_problems + _check_settings()
    notes = []
    if settings.disabled():
        notes.append("REPLAY_PLUGIN_DISABLE is set: the plugin is off in every process of this environment")
    return {
        "version": __version__,
        "python": sys.executable,
        "pth": _pth_files(),
        "upstreams": versions,
        "problems": problems,
        "notes": notes,
        "ok": not problems,
    }


def cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"replay-plugin {report['version']} in {report['python']}")
        print("upstreams: " + (", ".join(report["upstreams"]) or "none installed"))
        for note in report["notes"]:
            print(f"note: {note}")
        for problem in report["problems"]:
            print(f"PROBLEM: {problem}")
        print("doctor: " + ("no problems found" if report["ok"] else f"{len(report['problems'])} problem(s)"))
    return 0 if report["ok"] else 1


# --------------------------------------------------------------------------- demo / bench


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    results = bench.run(args.names, quick=args.quick)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump([r.as_dict() for r in results], fh, indent=1)
    print(bench.format_table(results))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replay-plugin", description=__doc__)
    parser.add_argument("--version", action="version", version=f"replay-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("status", help="patch states in a fresh process after importing modules")
    p.add_argument("--json", action="store_true", help='print {"patches": [...]} on stdout and nothing else')
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MOD",
        help="module to import first (repeatable), e.g. --import megatron.core",
    )
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("doctor", help="find installation problems")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("matrix", help="compare installed upstreams with compat_matrix.yaml")
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 on versions outside a range or drift of a target's or relied-on function's source",
    )
    p.add_argument(
        "--require-tested",
        action="store_true",
        help="with --check: also exit 1 when an installed upstream is not a version CI tests",
    )
    p.add_argument(
        "--upstream",
        dest="upstreams",
        action="append",
        default=[],
        metavar="KEY",
        help="only this upstream (repeatable), e.g. --upstream megatron-core",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_matrix)

    p = sub.add_parser("bench", help="benchmarks (ratios against the baseline a user would run)")
    p.add_argument("names", nargs="*", help="startup, wire, logprobs, megatron, vllm, fsdp (default: all)")
    p.add_argument("--quick", action="store_true", help="small shapes, for a smoke run")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("demo", help="measure train-inference mismatch with and without replay")
    try:
        from .demo import add_arguments as add_demo_arguments
    except ImportError:  # the demo's own imports are missing: `demo` then reports it when run
        pass
    else:
        add_demo_arguments(p)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
