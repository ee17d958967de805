"""``vllm.served_endpoints`` / ``vllm.generate_fields`` and their vLLM 0.24 twins
(``vllm.served_endpoints_disagg`` / ``vllm.generate_fields_disagg``) in a real vLLM process.

vLLM 0.24 serves ``/inference/v1/generate`` from ``vllm.entrypoints.serve.disagg.serving``; 0.25
moved it to ``vllm.entrypoints.scale_out.token_in_token_out``. The matrix holds one target list
per patch, so each line has its own pair, running the same wrappers. On the installed line one of
each pair applies and the other is ``not-needed`` (retired, with the reason), and
``vllm.request_guard`` asks the one of this line: with it switched off every served replay request
is refused naming it (the guard's refusal of a chat server whose endpoint patch is not serving); a
guard that asked the retired twin would have served them without the endpoint refusals.

No engine is started: the serving modules are imported (which applies the patches) and the
guard's own check is called, in a fresh interpreter per toggle."""

from __future__ import annotations

import json

import pytest
from support.procs import run_python
from support.upstream import need
from support.vllm_engines import disagg_generate

CODE = """
import json
import vllm.entrypoints.openai.chat_completion.serving  # the served patches' trigger
try:
    import vllm.entrypoints.scale_out.token_in_token_out.serving  # 0.25+
except ImportError:
    import vllm.entrypoints.serve.disagg.serving  # 0.24
import replay_plugin
from replay_plugin.vllm.request_guard import missing_patches

rows = {r["name"]: {"state": r["state"], "reason": r["reason"]} for r in replay_plugin.status()}
print("RESULT " + json.dumps({"rows": rows, "missing": missing_patches(True, False)}))
"""


def _run(env: dict | None = None) -> dict:
    proc = run_python(CODE, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def pair():
    """(the patch pair of this vLLM line, the retired pair)."""
    need("vllm")
    live = ("vllm.served_endpoints", "vllm.generate_fields")
    twins = tuple(f"{name}_disagg" for name in live)
    return (twins, live) if disagg_generate() else (live, twins)


def test_one_of_each_pair_applies_the_other_is_retired(pair):
    live, retired = pair
    out = _run()
    for name in live:
        assert out["rows"][name]["state"] == "applied", out["rows"][name]
    for name in retired:
        row = out["rows"][name]
        assert row["state"] == "not-needed" and "/inference/v1/generate" in row["reason"], row
        assert "0.25 moved it" in row["reason"] or "0.25 moved /inference/v1/generate" in row["reason"], row
    assert out["missing"] == []


def test_the_guard_asks_the_patch_of_this_line(pair):
    (endpoints, _), (retired_endpoints, _) = pair
    toggle = "REPLAY_PLUGIN_" + endpoints.upper().replace(".", "_")
    out = _run({toggle: "0"})
    assert out["rows"][endpoints]["state"] == "disabled"
    assert out["rows"][retired_endpoints]["state"] == "not-needed"
    [problem] = out["missing"]
    assert problem.startswith(f"patch {endpoints} is disabled") and f"unset {toggle}" in problem, problem
    # switching the retired twin off changes nothing on this line
    toggle = "REPLAY_PLUGIN_" + retired_endpoints.upper().replace(".", "_")
    assert _run({toggle: "0"})["missing"] == []
