"""Harness for the FSDP/Ulysses integration tests: real gloo ranks on 127.0.0.1.

:func:`run_ranks` starts ``world`` fresh interpreters of this environment (one per rank, the
installed plugin wheel active as in a user's job), each joins a gloo process group, imports the
test file by path, runs ``scenario(rank=r, world=w, **kwargs)`` and prints its JSON result. A
failing rank's traceback comes back to the test; its peers are stopped when it fails (they
would otherwise wait in a collective until gloo's timeout).

Scenario functions live in the test files; they return observations (JSON) and the tests
assert on them. Module name ``fsdp_harness`` (not ``harness``): the Megatron tests' helper of
that name is imported in the same pytest session.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
RESULT = "@@RESULT "


# =======================================================================================
# inside a rank


def _rank_main(argv: list[str]) -> None:
    path, func, rank, world, port, kwargs = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4], json.loads(argv[5])
    try:
        import datetime

        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        spec = importlib.util.spec_from_file_location(f"fsdp_scenarios_{os.path.basename(path)[:-3]}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        value = getattr(module, func)(rank=rank, world=world, **kwargs)
        result = {"ok": True, "value": value}
    except BaseException:  # noqa: BLE001 - report everything to the test
        result = {"ok": False, "error": traceback.format_exc()}
    print(RESULT + json.dumps(result), flush=True)
    try:
        import torch.distributed as dist

        if result["ok"] and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)


# =======================================================================================
# in the pytest process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(extra: dict | None = None) -> dict:
    """This environment without REPLAY_PLUGIN_* settings or PYTHONPATH, one thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    env.pop("PYTHONPATH", None)
    env["TORCHDYNAMO_DISABLE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(extra or {})
    return env


def run_ranks(scenario: Callable, world: int, *, env: dict | None = None, timeout: float = 240, **kwargs: Any) -> list:
    """Run ``scenario(rank=r, world=world, **kwargs)`` on ``world`` gloo ranks; per-rank values."""
    path = os.path.abspath(sys.modules[scenario.__module__].__file__)
    port = str(free_port())
    code = (
        f"import sys; sys.path[:0] = [{HERE!r}, {TESTS!r}]; import fsdp_harness; fsdp_harness._rank_main(sys.argv[1:])"
    )
    with tempfile.TemporaryDirectory() as tmp:
        # Output goes to files, not pipes: a rank that fills a pipe nobody reads would block.
        files = [
            (open(os.path.join(tmp, f"{r}.out"), "w+"), open(os.path.join(tmp, f"{r}.err"), "w+")) for r in range(world)
        ]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", code, path, scenario.__name__, str(r), str(world), port, json.dumps(kwargs)],
                stdout=files[r][0],
                stderr=files[r][1],
                env=rank_env(env),
                cwd="/",
            )
            for r in range(world)
        ]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs):
                    break  # peers would wait in a collective until gloo's timeout
                if time.monotonic() > deadline:
                    raise AssertionError(f"{scenario.__name__}: ranks still running after {timeout} s")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        outputs = []
        for out, err in files:
            out.seek(0)
            err.seek(0)
            outputs.append((out.read(), err.read()))
            out.close()
            err.close()
    failures, values = [], []
    for r in range(world):
        out, err = outputs[r]
        lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
        if not lines:
            failures.append(f"rank {r} died (exit {procs[r].returncode}):\n{err[-4000:]}")
            continue
        res = json.loads(lines[-1][len(RESULT) :])
        if not res["ok"]:
            failures.insert(0, f"rank {r} failed:\n{res['error']}")
            continue
        values.append(res["value"])
    if failures:
        raise AssertionError(f"{scenario.__name__}: " + "\n".join(failures))
    return values
