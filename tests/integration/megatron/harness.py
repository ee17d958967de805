"""Harness for the Megatron integration tests: a tiny MoE ``GPTModel`` on CPU, a spy on the
routers, and the processes that run scenarios on real megatron-core.

Megatron needs CUDA shims and a process group, and importing it costs seconds, so the tests
run their scenarios in helper processes instead of the pytest process (which, in the ``main``
environment, goes on to run the vLLM and FSDP tests and must not inherit the shims):

* :class:`Worker`: one long-lived single-rank process (gloo, world size 1) per test session.
  A test calls ``worker.run(scenario, **kwargs)``: the worker imports the test file by path,
  resets Megatron's global state (RouterReplay registry, aux-loss scale, every plugin patch
  applied), runs the scenario and returns its JSON result, or its traceback.
* :func:`run_ranks`: one subprocess that spawns ``world`` gloo ranks on 127.0.0.1 (free port)
  and returns each rank's result, for pipeline / tensor-parallel scenarios.

Scenarios are plain functions in the test files; they return observations and the test
functions assert on them. ``TORCHDYNAMO_DISABLE=1`` in both: ``jit_fuser`` is
``torch.compile`` on torch >= 2.2 and compiling the tiny model costs ~20 s per process here
(measured); the one test that needs the compiled ``_apply_expert_bias`` re-enables dynamo for
that call.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(os.path.dirname(HERE))
RESULT = "@@RESULT "
MEGATRON_PATCHES = (
    "megatron.router_replay_scope",
    "megatron.expert_bias_padding_mask",
    "megatron.router_layer_number",
    "megatron.replay_padding_fallback",
)


# =======================================================================================
# inside a Megatron process


def setup_process(rank: int = 0, world: int = 1, port: int | None = None, **parallel: Any) -> None:
    import cpu_shims

    cpu_shims.apply()
    cpu_shims.init_distributed(rank, world, port, **parallel)


def reinit_parallel(**parallel: Any) -> None:
    """Re-create Megatron's model-parallel groups (same process group) with other sizes."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.get("tp", 1),
        pipeline_model_parallel_size=parallel.get("pp", 1),
        virtual_pipeline_model_parallel_size=parallel.get("vp"),
        context_parallel_size=parallel.get("cp", 1),
    )
    model_parallel_cuda_manual_seed(1234)


def reset_state() -> None:
    """Fresh global Megatron state and every plugin patch applied, before each scenario."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from replay_plugin import registry

    RouterReplay.global_router_replay_instances.clear()
    # A backward outside a schedule leaves a 0-d scale that breaks the schedule's [1]-shaped one.
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    for name in MEGATRON_PATCHES:
        state = registry.get().apply(name)
        assert state.state in ("applied", "not-needed"), (name, state)


@contextlib.contextmanager
def patch_off(name: str):
    """Revert one plugin patch in this process for the duration of the block."""
    from replay_plugin import registry

    reg = registry.get()
    state = reg.revert(name)
    assert state.state in ("reverted", "not-needed"), state  # not-needed: there is nothing to revert
    try:
        yield
    finally:
        reg.apply(name)


def patch_state(name: str) -> str:
    from replay_plugin import states

    st = states.get(name)
    return st.state if st else "unknown"


def config(**overrides: Any):
    """A tiny MoE TransformerConfig that runs on CPU (fp32, local layers, allgather dispatcher)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=4,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def dense_config(**overrides: Any):
    """A tiny dense (no MoE) TransformerConfig that runs on CPU: for tests of the output layer."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    base.update(overrides)
    return TransformerConfig(**base)


VOCAB = 32
MAX_SEQ = 64


def build_model(
    cfg=None,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    seed: int = 0,
    vp_stage: int | None = None,
    vocab_size: int = VOCAB,
    pg_collection: Any = None,
    **overrides: Any,
):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = cfg or config(**overrides)
    torch.manual_seed(seed)
    if cfg.num_moe_experts is None:
        spec = get_gpt_layer_local_spec()
    elif isinstance(cfg.moe_layer_freq, list):  # a dense/MoE layer pattern needs the block spec
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False)
    extra: dict = {} if vp_stage is None else {"vp_stage": vp_stage}
    if pg_collection is not None:
        extra["pg_collection"] = pg_collection
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=MAX_SEQ,
        pre_process=pre_process,
        post_process=post_process,
        **extra,
    )


def routers(model) -> list:
    """(layer_number, TopKRouter) of the decoder routers, module order."""
    return [
        (m.layer_number, m) for _, m in model.named_modules() if hasattr(m, "router_replay") and hasattr(m, "routing")
    ]


class RouteSpy:
    """Records, per router call (forward and recompute), the action and the routing map."""

    def __init__(self, model) -> None:
        self.calls: list[dict] = []
        self.handles = [r.register_forward_hook(self._hook(n)) for n, r in routers(model)]

    def _hook(self, layer: int):
        import torch

        def hook(module, args, output):
            rr = module.router_replay
            action = rr.router_replay_action.name if rr is not None and rr.router_replay_action is not None else None
            self.calls.append(
                {"layer": layer, "action": action, "map": output[1].detach().clone(), "grad": torch.is_grad_enabled()}
            )

        return hook

    def maps(self, layer: int, action: Any = "any") -> list:
        return [c["map"] for c in self.calls if c["layer"] == layer and (action == "any" or c["action"] == action)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def routing_map(indices, num_experts: int):
    """[N, K] expert ids -> [N, E] bool."""
    import torch

    idx = torch.as_tensor(indices, dtype=torch.int64)
    return torch.zeros(idx.shape[0], num_experts, dtype=torch.bool).scatter(1, idx, True)


def distinct_routes(batch: int, seq: int, layers: int, topk: int, experts: int, seed: int):
    """[B, S, L, K] uint8: random rows of K distinct experts."""
    import numpy as np

    rng = np.random.default_rng(seed)
    keys = rng.random((batch, seq, layers, experts))
    return np.argsort(keys, axis=-1)[..., :topk].astype(np.uint8)


def seq_major(routes_bsl, layer: int):
    """[B, S, L, K] -> [S * B, K] of one layer, in the routers' token order (unpacked, no padding)."""
    import torch

    r = torch.as_tensor(routes_bsl)[:, :, layer]
    return r.transpose(0, 1).reshape(-1, r.shape[-1])


def tokens(batch: int, seq: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    pos = torch.arange(seq).expand(batch, seq).contiguous()
    return ids, pos


def causal_mask(seq: int):
    import torch

    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)


def batch(seed: int = 0, lengths=(5, 8), seq: int = 8):
    """Left-padded token ids ``[B, S]``, the attention mask and the unpacked layout (align 1)."""
    import torch

    from replay_plugin.core.layout import TokenMetadataLayout

    ids, _ = tokens(len(lengths), seq, seed)
    attention = torch.zeros(len(lengths), seq, dtype=torch.bool)
    for b, n in enumerate(lengths):
        attention[b, seq - n :] = True
    return ids, attention, TokenMetadataLayout.build(attention, packed=False, align=1)


def forward(model, ids, layout, padding_mask=None):
    """The model call a trainer makes on the layout's ``[B, A]`` grid."""
    import torch

    x = layout.align(ids, 0)
    a = x.shape[1]
    pos = torch.arange(a).expand_as(x).contiguous()
    return model(x, pos, causal_mask(a), padding_mask=padding_mask)


def valid_rows(layout):
    """``[N]`` bool: which router rows are real tokens (sequence-major over the unpacked grid)."""
    import torch

    rows, a = layout.output_shape
    real = torch.zeros(rows, a, dtype=torch.bool)
    for b, n in enumerate(layout.sequence_lengths):
        real[b, :n] = True
    return real.transpose(0, 1).reshape(-1)


def aligned_seq_major(routes, layout, layer: int):
    """Expected router indices ``[N, K]`` of global layer ``layer`` (1-based) on an unpacked layout."""
    import torch

    k = routes.shape[-1]
    aligned = layout.align(torch.as_tensor(routes[:, :, layer - 1]).long(), torch.arange(k))  # [B, A, K]
    return aligned.transpose(0, 1).reshape(-1, k)


def run_schedule(model, batches: list, *, forward_only: bool, step: Callable, seq: int, mbs: int):
    """Run the schedule ``get_forward_backward_func()`` returns over ``batches``.

    ``step(model, batch)`` returns the model output; the loss is its mean."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    it = iter(batches)

    def forward_step(data_iterator, m):
        out = step(m, next(data_iterator))

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    fb = get_forward_backward_func()
    return fb(
        forward_step_func=forward_step,
        data_iterator=it,
        model=[model],
        num_microbatches=len(batches),
        seq_length=seq,
        micro_batch_size=mbs,
        forward_only=forward_only,
    )


def expert_bias_counts(model) -> list:
    return [r.local_tokens_per_expert.tolist() for _, r in routers(model)]


def to_jsonable(obj: Any) -> Any:
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    try:
        import numpy as np

        if isinstance(obj, np.ndarray):
            return obj.tolist()
        if isinstance(obj, np.generic):
            return obj.item()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    return obj


def _load(path: str):
    name = "megatron_scenarios_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _call(path: str, func: str, kwargs: dict) -> dict:
    try:
        reset_state()
        value = getattr(_load(path), func)(**kwargs)
        return {"ok": True, "value": to_jsonable(value)}
    except BaseException:  # noqa: BLE001 - the traceback goes back to pytest
        return {"ok": False, "error": traceback.format_exc()}


def serve() -> None:
    """The single-rank worker loop: one JSON request per stdin line."""
    setup_process()
    out = sys.stdout
    sys.stdout = sys.stderr  # megatron's prints must not mix with results
    out.write(RESULT + json.dumps({"ok": True, "value": "ready"}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        result = _call(req["path"], req["func"], req.get("kwargs", {}))
        out.write(RESULT + json.dumps(result) + "\n")
        out.flush()


def _rank_main(rank: int, world: int, port: int, path: str, func: str, kwargs: dict, parallel: dict, queue) -> None:
    try:
        setup_process(rank, world, port, **parallel)
        reset_state()
        value = getattr(_load(path), func)(rank=rank, **kwargs)
        queue.put((rank, {"ok": True, "value": to_jsonable(value)}))
    except BaseException:  # noqa: BLE001
        queue.put((rank, {"ok": False, "error": traceback.format_exc()}))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def multirank_main(argv: list[str]) -> None:
    import cpu_shims
    import torch.multiprocessing as mp

    path, func, world, kwargs, parallel = argv[0], argv[1], int(argv[2]), json.loads(argv[3]), json.loads(argv[4])
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = cpu_shims.free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world, port, path, func, kwargs, parallel, queue)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    for _ in range(world):
        rank, res = queue.get()
        results[rank] = res
    for p in procs:
        p.join(60)
    print(RESULT + json.dumps([results[r] for r in range(world)]), flush=True)


# =======================================================================================
# in the pytest process


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPLAY_PLUGIN_")}
    env.pop("PYTHONPATH", None)
    env["TORCHDYNAMO_DISABLE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def _raise_remote(result: dict, what: str) -> Any:
    if not result["ok"]:
        raise AssertionError(f"{what} failed in the Megatron process:\n{result['error']}")
    return result["value"]


class Worker:
    """A long-lived single-rank Megatron process (see the module docstring)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self) -> None:
        code = f"import sys; sys.path[:0] = [{HERE!r}, {TESTS!r}]; import harness; harness.serve()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sys.stderr if os.environ.get("REPLAY_TEST_VERBOSE") else subprocess.DEVNULL,
            text=True,
            env=_env(),
            cwd="/",
        )
        _raise_remote(self._read(), "worker start-up")

    def _read(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT) :])
        raise AssertionError(
            f"the Megatron worker exited (code {self.proc.wait()}); run with REPLAY_TEST_VERBOSE=1 for its stderr"
        )

    def run(self, scenario: Callable, **kwargs: Any) -> Any:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            assert self.proc is not None and self.proc.stdin is not None
            path = os.path.abspath(sys.modules[scenario.__module__].__file__)
            self.proc.stdin.write(json.dumps({"path": path, "func": scenario.__name__, "kwargs": kwargs}) + "\n")
            self.proc.stdin.flush()
            return _raise_remote(self._read(), scenario.__name__)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_ranks(
    scenario: Callable,
    world: int,
    *,
    parallel: dict | None = None,
    timeout: float = 300,
    env: dict | None = None,
    **kwargs: Any,
) -> list:
    """Run ``scenario(rank=r, **kwargs)`` on ``world`` gloo ranks; returns the per-rank values."""
    path = os.path.abspath(sys.modules[scenario.__module__].__file__)
    code = f"import sys; sys.path[:0] = [{HERE!r}, {TESTS!r}]; import harness; harness.multirank_main(sys.argv[1:])"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            path,
            scenario.__name__,
            str(world),
            json.dumps(kwargs),
            json.dumps(parallel or {}),
        ],
        capture_output=True,
        text=True,
        env=_env(env),
        cwd="/",
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if not lines:
        raise AssertionError(f"multi-rank run failed (exit {proc.returncode}):\n{proc.stderr[-5000:]}")
    return [
        _raise_remote(r, f"{scenario.__name__} rank {i}") for i, r in enumerate(json.loads(lines[-1][len(RESULT) :]))
    ]


_shared: Worker | None = None


def shared_worker() -> Worker:
    """The session's worker, started on first use and closed at exit."""
    global _shared
    if _shared is None:
        import atexit

        _shared = Worker()
        atexit.register(_shared.close)
    return _shared
