"""Peak resident-set memory of one step, for the benchmarks (torch tensors included, which
``tracemalloc`` cannot see).

Each measurement runs in a fresh subprocess (:func:`run_module_measure`) with glibc serving
blocks of 64 KiB or more by their own mappings, so freed memory leaves the resident set; the
figure is ``VmHWM - VmRSS`` over one step after resetting the high-water mark (:func:`peak_delta`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_high_water_mark() -> bool:
    """Reset ``VmHWM`` to the current RSS; False where ``clear_refs`` is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_delta(step: Callable[[], object]) -> dict:
    """Bytes the resident set grows to over one call of ``step`` (after the caller's warm-up)."""
    reset = reset_high_water_mark()
    before = status_kib("VmRSS")
    step()
    return {"peak_delta_bytes": (status_kib("VmHWM") - before) * 1024, "hwm_reset": reset}


def run_module_measure(module: str, spec: dict, timeout: float = 1800) -> dict:
    """``python -m MODULE --measure JSON`` in a fresh subprocess; its last stdout line is the
    JSON result, or ``{"error": ...}`` when it failed."""
    env = dict(os.environ, **MALLOC_ENV)
    proc = subprocess.run(
        [sys.executable, "-m", module, "--measure", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def module_main(argv: list[str], run: Callable[..., list], measure_here: Callable[[dict], dict]) -> int:
    """``python -m replay_plugin.bench.X``: ``--measure JSON`` (the subprocess side of
    :func:`run_module_measure`), else the benchmark's table (``--quick`` for smoke shapes)."""
    if len(argv) == 2 and argv[0] == "--measure":
        print(json.dumps(measure_here(json.loads(argv[1]))))
        return 0
    from . import format_table

    print(format_table(run(quick="--quick" in argv)))
    return 0
