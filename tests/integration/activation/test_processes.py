"""Every process is patched and writes its own status file: multiprocessing children started with
spawn, fork and forkserver, and two torchrun ranks (gloo)."""

import glob
import json
import os
import subprocess
import sys

import pytest
from support.upstream import need

pytestmark = pytest.mark.timeout(900)

CHILDREN = r"""
import inspect, json, multiprocessing as mp, os, sys

def child(q):
    import megatron.core.pipeline_parallel.schedules as s
    from replay_plugin.patcher import patch_marker
    q.put((os.getpid(), patch_marker(inspect.getattr_static(s, "forward_backward_no_pipelining"))))

if __name__ == "__main__":
    method = sys.argv[1]
    if method == "fork":
        import megatron.core  # the parent is patched before it forks
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    pid, marker = q.get(timeout=300)
    p.join(timeout=300)
    print("REPORT" + json.dumps({"parent": os.getpid(), "child": pid, "marker": marker, "exit": p.exitcode}))
"""


def _status_files(directory):
    docs = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as fh:
            doc = json.load(fh)
        docs[doc["process"]["pid"]] = doc
    return docs


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_multiprocessing_children(method, tmp_path):
    need("megatron-core")
    script = tmp_path / "children.py"
    script.write_text(CHILDREN)
    status_dir = tmp_path / "status"
    proc = subprocess.run(
        [sys.executable, str(script), method],
        env=_clean_env(REPLAY_PLUGIN_STATUS_DIR=str(status_dir)),
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1][6:])
    assert out["exit"] == 0 and out["marker"] == "megatron.router_replay_scope"
    docs = _status_files(status_dir)
    assert out["child"] in docs, f"child {out['child']} wrote no status file; files from {sorted(docs)}"
    states = {p["name"]: p["state"] for p in docs[out["child"]]["patches"]}
    assert states["megatron.router_replay_scope"] == "applied"


TORCHRUN = r"""
import inspect, os
import torch.distributed as dist
dist.init_process_group("gloo")
import megatron.core.pipeline_parallel.schedules as s
from replay_plugin.patcher import patch_marker
from replay_plugin import states
assert patch_marker(inspect.getattr_static(s, "forward_backward_no_pipelining")) == "megatron.router_replay_scope"
states.write_file()
dist.barrier()
dist.destroy_process_group()
"""


def test_torchrun_two_ranks(tmp_path):
    need("megatron-core")
    script = tmp_path / "ranks.py"
    script.write_text(TORCHRUN)
    status_dir = tmp_path / "status"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", str(script)],
        env=_clean_env(REPLAY_PLUGIN_STATUS_DIR=str(status_dir), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        cwd=str(tmp_path),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs = [d for d in _status_files(status_dir).values() if d["process"]["rank"] is not None]
    assert sorted(d["process"]["rank"] for d in docs) == [0, 1]
    for d in docs:
        assert {p["name"]: p["state"] for p in d["patches"]}["megatron.router_replay_scope"] == "applied"
