"""The ``replay-plugin`` command: status, doctor, matrix, demo, bench."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
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
        retired = compat.retired_reason(p.retired, version) if version is not None else None
        if version is None:
            row.update(state="not-installed", detail="")
        elif retired is not None and not compat.version_in(version, p.versions):
            # outside its range on purpose: the upstream no longer has what the patch fixes
            tier = compat.version_tier(matrix.upstreams[p.upstream], version)
            row.update(state="not-needed", tier=tier, detail=f"retired: {retired}")
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
        rows = [
            {
                **up,
                "tested": ", ".join(up["tested"]) or None,
                "source-verified": ", ".join(up["source_verified"]) or None,
            }
            for up in report["upstreams"]
        ]
        print(_table(rows, ("upstream", "distribution", "version", "supported", "tier", "tested", "source-verified")))
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


def cmd_doctor(args: argparse.Namespace) -> int:
    from . import doctor

    with _stdout_to_stderr():  # vLLM's logger prints on stdout while the arguments are parsed
        report = doctor.report(
            vllm_args=args.vllm_args,
            top_k=args.top_k,
            megatron_config=args.megatron_config,
            skyrl_config=args.skyrl_config,
            verl_config=args.verl_config,
            trl_config=args.trl_config,
        )
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"replay-plugin {report['version']} in {report['python']}")
        print("upstreams: " + (", ".join(report["upstreams"]) or "none installed"))
        for pairing in report["pairings"]:
            print(f"pairing: {pairing}")
        for note in report["notes"]:
            print(f"note: {note}")
        for finding in report["findings"]:
            print(f"PROBLEM [{finding['check']}]: {finding['problem']}\n  fix: {finding['fix']}")
        print("doctor: " + ("no problems found" if report["ok"] else f"{len(report['findings'])} problem(s)"))
    return 0 if report["ok"] else 1


# --------------------------------------------------------------------------- demo / bench


def cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    results = bench.run(args.names, quick=args.quick, runs=args.runs)
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

    p = sub.add_parser("doctor", help="find installation and configuration problems (exit 1 if any)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--vllm-args", metavar="ARGS", help='the engine arguments of the job, e.g. "MODEL --max-logprobs 20"'
    )
    p.add_argument("--top-k", type=int, metavar="K", help="the rollout's top_k (checks the support width fits)")
    p.add_argument("--megatron-config", metavar="FILE", help="YAML/JSON of the model's TransformerConfig fields")
    p.add_argument(
        "--skyrl-config",
        metavar="CONFIG",
        help='SkyRL\'s config: its overrides ("generator.inference_engine.enable_return_sample_support_set=true ...") '
        "or a YAML file",
    )
    p.add_argument(
        "--verl-config",
        metavar="CONFIG",
        help='verl\'s config: its Hydra overrides ("+actor_rollout_ref.rollout.custom.replay_sample_support=true ...") '
        "or a YAML file of its resolved config",
    )
    p.add_argument(
        "--trl-config",
        metavar="CONFIG",
        help='TRL\'s GRPO config: its command line ("--config cfg.yaml --top_k 20 --use_vllm true ..."), '
        'a YAML file of GRPOConfig fields, or a mapping (\'{"top_k": 20, "generation_kwargs": {...}}\')',
    )
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
    p.add_argument(
        "--runs", type=int, default=1, metavar="N", help="run each benchmark N times; report each figure's median"
    )
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
