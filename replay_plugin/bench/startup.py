"""``replay-plugin bench startup``: what the .pth line costs every Python process, and what
activation adds to ``import transformers`` (a watched name: its import arms the patches).

Two throw-away venvs made from this interpreter differ only in the plugin's ``.pth`` file;
both see this environment's packages through a plain path line (a path line adds the directory
to ``sys.path`` without processing the ``.pth`` files inside it). Runs are interleaved
(without, with, with + ``REPLAY_PLUGIN_DISABLE=1``) and the medians compared.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Any

from . import Result


def _make_venv(root: str, name: str, base_paths: list[str], pth_line: str | None) -> str:
    path = os.path.join(root, name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", path], check=True)
    site_dir = subprocess.run(
        [os.path.join(path, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    with open(os.path.join(site_dir, "_base_env.pth"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(base_paths) + "\n")
    if pth_line is not None:
        with open(os.path.join(site_dir, "replay_plugin.pth"), "w", encoding="utf-8") as fh:
            fh.write(pth_line)
    return os.path.join(path, "bin", "python")


def _time(python: str, code: str, env: dict) -> float:
    start = time.perf_counter()
    pid = os.posix_spawn(python, [python, "-c", code], env)
    _, status = os.waitpid(pid, 0)
    elapsed = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"{python} -c {code!r} failed (wait status {status})")
    return elapsed


def _instructions(python: str, code: str, env: dict) -> int | None:
    """Instructions executed by ``python -c code`` under callgrind (deterministic), or None."""
    if shutil.which("valgrind") is None:
        return None
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", python, "-c", code],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    match = re.search(r"Collected : (\d+)", proc.stderr)
    return int(match.group(1)) if match else None


def measure(code: str, rounds: int) -> dict[str, Any]:
    """Median wall time in ms of ``python -c code`` per variant, interleaved."""
    from .._pth import pth_line

    base_paths = [p for p in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    env_disabled = dict(env, REPLAY_PLUGIN_DISABLE="1")
    with tempfile.TemporaryDirectory() as root:
        without = _make_venv(root, "without", base_paths, None)
        with_plugin = _make_venv(root, "with", base_paths, pth_line())
        variants = [("without", without, env), ("with", with_plugin, env), ("disabled", with_plugin, env_disabled)]
        for _, python, e in variants:  # warm the page cache
            _time(python, code, e)
        times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
        for i in range(rounds):
            order = variants if i % 2 == 0 else list(reversed(variants))
            for name, python, e in order:
                times[name].append(_time(python, code, e))
        result: dict[str, Any] = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        if code == "pass":
            for name, python, e in variants:
                result[f"{name}_instructions"] = _instructions(python, code, e)
    return result


def run(quick: bool = False) -> list[Result]:
    results: list[Result] = []
    for label, code, rounds in (
        ("python -c pass", "pass", 40 if quick else 300),
        ('python -c "import torch"', "import torch", 3 if quick else 15),
        ('python -c "import transformers"', "import transformers", 3 if quick else 11),
    ):
        if code != "pass":
            # torch is not watched (nothing activates); transformers is: its import activates the
            # plugin (packs, matrix, one post-import hook per MoE family) and applies nothing
            try:
                import importlib.util

                module = code.split()[-1]
                if importlib.util.find_spec(module) is None:
                    results.append(Result("startup", label, None, note=f"{module} not installed"))
                    continue
            except Exception:  # noqa: BLE001
                continue
        med = measure(code, rounds)
        added = med["with"] - med["without"]
        results.append(
            Result(
                "startup",
                f"{label}: added by the .pth line",
                added,
                "ms",
                "<= 0.3" if code == "pass" else None,
                note=f"median of {rounds}: {med['without']:.2f} ms without, {med['with']:.2f} ms with",
            )
        )
        results.append(Result("startup", f"{label}: with / without", med["with"] / med["without"], "x"))
        results.append(
            Result(
                "startup",
                f"{label}: added with REPLAY_PLUGIN_DISABLE=1",
                med["disabled"] - med["without"],
                "ms",
                None,
                note=f"{med['disabled']:.2f} ms",
            )
        )
        if med.get("without_instructions") and med.get("with_instructions"):
            base = med["without_instructions"]
            for name in ("with", "disabled"):
                results.append(
                    Result(
                        "startup",
                        f"{label}: instructions added ({name}, callgrind)",
                        (med[f"{name}_instructions"] - base) / 1e6,
                        "M",
                        None,
                        note=f"of {base / 1e6:.1f} M; deterministic, unlike wall time",
                    )
                )
    return results
