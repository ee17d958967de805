"""Per-process record store: the state of every patch and process-level events, and JSON status
files per process. A plain store: it imports nothing from this package and computes nothing.

States:

==================  ================================================================
``applied``         the patch is in place (its targets carry the plugin's marker)
``disabled``        switched off by its environment toggle, or off by default
``skipped-version`` the installed upstream is outside the patch's supported range
``not-imported``    the upstream target module has not been imported in this process
``not-needed``      a probe shows the installed upstream already behaves correctly
``not-implemented`` the spec is registered but its code is not written yet
``error``           applying failed (reason recorded); the user's import went on
``reverted``        ``replay_plugin.deactivate()`` removed it
``replaced``        it was applied, but another library has since replaced a patched
                    target: the plugin's wrapper is no longer in place (computed by the
                    status query, never recorded)
==================  ================================================================

With ``REPLAY_PLUGIN_STATUS_DIR`` set, every state change rewrites
``<dir>/<host>-<pid>.json`` atomically, so each process (torchrun rank, Ray worker, vLLM
engine core and worker) leaves its own record.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

STATES = (
    "applied",
    "disabled",
    "skipped-version",
    "not-imported",
    "not-needed",
    "not-implemented",
    "error",
    "reverted",
    "replaced",
)


@dataclass
class PatchStatus:
    name: str
    upstream: str
    version: str | None
    state: str
    reason: str = ""
    targets: list[str] = field(default_factory=list)
    #: the installed version's tier in the matrix (``compat.TIERS``: tested, source-verified,
    #: untested, unsupported); None when the upstream is not installed or not looked at yet
    tier: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


_lock = threading.RLock()
_records: dict[str, PatchStatus] = {}
_events: list[str] = []


def record(status: PatchStatus) -> PatchStatus:
    """Store ``status`` (replacing the previous one of that patch), write the status file, and
    return ``status``."""
    if status.state not in STATES:
        raise ValueError(f"unknown state {status.state!r}")
    with _lock:
        _records[status.name] = status
    write_file()
    return status


def note(message: str) -> None:
    """A process-level event (pack load failure, unknown variable) kept for status output."""
    with _lock:
        _events.append(message)
    write_file()


def get(name: str) -> PatchStatus | None:
    with _lock:
        return _records.get(name)


def records() -> list[PatchStatus]:
    with _lock:
        return [_records[k] for k in sorted(_records)]


def events() -> list[str]:
    with _lock:
        return list(_events)


def _rank() -> int | None:
    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - status must never fail the caller
        pass
    return None


def process_info() -> dict:
    """Who this process is: host, pid, rank, process name, command line."""
    try:
        import multiprocessing

        mp_name = multiprocessing.current_process().name
    except Exception:  # noqa: BLE001
        mp_name = None
    try:
        with open(f"/proc/{os.getpid()}/comm", encoding="utf-8") as fh:
            comm = fh.read().strip()
    except OSError:
        comm = None
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "rank": _rank(),
        "local_rank": os.environ.get("LOCAL_RANK"),
        "process_name": mp_name,
        "comm": comm,
        "argv": sys.argv[:4],
        "python": sys.executable,
    }


def snapshot() -> dict:
    """The whole status document of this process."""
    with _lock:
        patches = [r.as_dict() for r in records()]
        evs = list(_events)
    return {"process": process_info(), "time": time.time(), "patches": patches, "events": evs}


def write_file(directory: str | None = None) -> str | None:
    """Write this process's status JSON into ``directory`` (default: REPLAY_PLUGIN_STATUS_DIR).

    Never raises: a status file must not break training. Returns the path written, or None.
    """
    directory = directory or os.environ.get("REPLAY_PLUGIN_STATUS_DIR")
    if not directory:
        return None
    try:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{socket.gethostname()}-{os.getpid()}.json")
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(snapshot(), fh, indent=1)
        os.replace(tmp, path)
        return path
    except Exception:  # noqa: BLE001
        return None


def _reset_for_tests() -> None:
    with _lock:
        _records.clear()
        _events.clear()
