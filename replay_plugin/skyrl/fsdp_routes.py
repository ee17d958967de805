"""Patches ``skyrl.fsdp_routes``, ``skyrl.fsdp_worker_routes``, ``skyrl.fsdp_routes_config``:
routed-expert replay (R3) on SkyRL's FSDP path, through ``replay_plugin.fsdp.replay_routes``.

Gap (skyrl 0.4.0; SkyRL issue #815): R3 is Megatron-only. The trainer puts the rollout's routes
(``rollout_expert_indices``, a ``PackedTensor`` of per-trajectory ``[rows, L, K]``) and
``router_padding_mask`` into every training batch, but the FSDP workers never read them and
``HFModelWrapper.forward`` has no parameter for them; ``validate_inference_engine_cfg`` refuses
``enable_return_routed_experts`` unless ``trainer.strategy == "megatron"``.

With the patches, SkyRL's own R3 keys switch R3 on for FSDP too:
``generator.inference_engine.enable_return_routed_experts=true`` and
``trainer.policy.megatron_config.moe_enable_routing_replay=true`` (the key SkyRL already requires
with routes; the ref model replays when ``trainer.ref.megatron_config.moe_enable_routing_replay``
is set, as on SkyRL's Megatron path, where it is off by default).

- ``skyrl.fsdp_worker_routes`` wraps the FSDP policy and ref workers' microbatch methods
  (``PolicyWorkerBase._forward_backward_micro``, ``._forward_micro_with_loss``,
  ``._forward_micro_batch``, ``RefWorkerBase._forward_micro_batch``): when their model is an
  ``HFModelWrapper`` and replay is on, the whole method (forward and backward, so that
  gradient-checkpointed layers recompute with the same experts) runs inside ``replay_routes``,
  with SkyRL's layout: remove-padding indices when ``remove_microbatch_padding``, Ulysses
  partitioning when ``sequence_parallel_size > 1``. Megatron workers are not touched (their model
  is no ``HFModelWrapper``; SkyRL's native RouterReplay path, with the plugin's Megatron patches).
- ``skyrl.fsdp_routes`` gives ``HFModelWrapper.forward`` the keyword arguments
  ``rollout_expert_indices`` and ``router_padding_mask`` for callers outside SkyRL's workers (the
  forward then runs inside ``replay_routes``; a backward that recomputes checkpointed layers
  must run inside ``replay_routes`` itself). Without them the forward is SkyRL's.
- ``skyrl.fsdp_routes_config`` lets ``validate_inference_engine_cfg`` accept routes with
  ``trainer.strategy`` fsdp / fsdp2, with SkyRL's other R3 checks (the vLLM ``mp`` executor,
  ``moe_enable_routing_replay``) kept, in SkyRL's words, as ``NotReplayable`` naming the key
  (SkyRL's own are ``assert`` statements, which ``python -O`` strips: the job would then capture
  routes that nothing replays, or hang on the ray executor).

Routes are laid out as the plugin's batch grid ``[B, S, L, K]`` by ``core.routes.pad_batch`` (each
trajectory's rows on its first valid tokens, compact dtype kept); rows without a route (padding,
SkyRL's padding rows, the uncaptured tail) are marked in the router padding mask (SkyRL's, or'ed
with the grid's) and routed by the model itself. Remove when SkyRL's FSDP workers replay routes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..patcher import Patcher
from .patches import ROUTES_CONFIG_KEY

FSDP_STRATEGIES = ("fsdp", "fsdp2")
REPLAY_KEY = "trainer.policy.megatron_config.moe_enable_routing_replay"
MODEL_WRAPPER_MODULE = "skyrl.backends.skyrl_train.workers.model_wrapper"
WORKER_METHODS = (
    "PolicyWorkerBase._forward_backward_micro",
    "PolicyWorkerBase._forward_micro_with_loss",
    "PolicyWorkerBase._forward_micro_batch",
    "RefWorkerBase._forward_micro_batch",
)


# --------------------------------------------------------------------------- layout


def _field(batch: Any, name: str) -> Any:
    """A field of an ``Experience`` (attribute) or a ``TrainingInputBatch`` (mapping)."""
    if hasattr(batch, "get") and not hasattr(batch, name):
        return batch.get(name)
    return getattr(batch, name, None)


def batch_routes(routes: Any, attention_mask: Any, router_padding_mask: Any = None) -> tuple[Any, Any]:
    """``(routes [B, S, L, K] numpy, compact; mask [B, S] bool torch, True = no route)`` from
    SkyRL's fields: ``routes`` a ``PackedTensor`` (``values [sum rows, L, K]``, ``cu_seqlens``)
    or a ``[B, S, L, K]`` grid; ``router_padding_mask`` SkyRL's (or None)."""
    import torch

    from ..core.errors import ReplayDataError, ReplayTypeError
    from ..core.routes import pad_batch

    attention = attention_mask.detach().cpu() if isinstance(attention_mask, torch.Tensor) else attention_mask
    if hasattr(routes, "values") and hasattr(routes, "cu_seqlens"):
        values, cu = routes.values, routes.cu_seqlens.tolist()
        segments = [values[cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]
        grid, mask = pad_batch(segments, attention)
    else:
        grid = routes
        mask = torch.zeros(tuple(attention.shape), dtype=torch.bool)
    if router_padding_mask is not None:
        theirs = router_padding_mask
        if not isinstance(theirs, torch.Tensor) or theirs.dtype != torch.bool:
            raise ReplayTypeError(
                "router_padding_mask",
                f"got {getattr(theirs, 'dtype', type(theirs).__name__)}",
                expected="a bool tensor",
            )
        if tuple(theirs.shape) != tuple(mask.shape):
            raise ReplayDataError(
                "router_padding_mask",
                f"shape {tuple(theirs.shape)}",
                expected=f"{list(mask.shape)} like attention_mask",
            )
        mask = mask | theirs.detach().cpu()
    return grid, mask


@contextlib.contextmanager
def replaying(wrapper: Any, attention_mask: Any, routes: Any, router_padding_mask: Any = None) -> Iterator[None]:
    """``replay_routes`` on ``wrapper.model`` (an ``HFModelWrapper``'s HF model) with the layout
    ``HFModelWrapper.forward`` hands it: ``[1, nnz]`` under remove-padding (flash-attn's
    ``unpad_input`` indices: the attention mask's nonzero positions, row-major), then the Ulysses
    slice of SkyRL's SP group; the padded ``[B, S]`` batch otherwise."""
    import torch

    from ..fsdp import replay_routes

    grid, mask = batch_routes(routes, attention_mask, router_padding_mask)
    indices = None
    if getattr(wrapper, "remove_microbatch_padding", False):
        indices = torch.nonzero(attention_mask.detach().reshape(-1), as_tuple=False).flatten().cpu()
    sp_group = None
    if int(getattr(wrapper, "sequence_parallel_size", 1) or 1) > 1:
        from skyrl.backends.skyrl_train.distributed.ulysses.utils import get_ulysses_sequence_parallel_group

        sp_group = get_ulysses_sequence_parallel_group()
    with replay_routes(wrapper.model, grid, mask, indices=indices, sp_group=sp_group):
        yield


# --------------------------------------------------------------------------- skyrl.fsdp_routes


def _forward(wrapped, instance, args, kwargs):
    routes = kwargs.pop("rollout_expert_indices", None)
    mask = kwargs.pop("router_padding_mask", None)
    if routes is None:
        if mask is not None:
            from ..core.errors import ReplayDataError

            raise ReplayDataError(
                "router_padding_mask", "given without rollout_expert_indices", expected="both, or neither"
            )
        return wrapped(*args, **kwargs)
    attention = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
    if attention is None:
        from ..core.errors import ReplayDataError

        raise ReplayDataError("attention_mask", "missing", expected="the [B, S] attention mask routes are laid out by")
    with replaying(instance, attention, routes, mask):
        return wrapped(*args, **kwargs)


def install_model_wrapper(patcher: Patcher) -> None:
    patcher.wrap("HFModelWrapper.forward", _forward)


# --------------------------------------------------------------------------- skyrl.fsdp_worker_routes


def _replay_enabled(worker: Any, role: str) -> bool:
    cfg = getattr(worker, "cfg", None)
    section = getattr(cfg, role, None)
    megatron_config = getattr(section, "megatron_config", None)
    return bool(getattr(megatron_config, "moe_enable_routing_replay", False))


def _is_hf_model_wrapper(model: Any) -> bool:
    """Whether ``model`` is SkyRL's FSDP ``HFModelWrapper``, without importing its module (which
    needs flash-attn): a Megatron worker's model never is one."""
    import sys

    module = sys.modules.get(MODEL_WRAPPER_MODULE)
    cls = getattr(module, "HFModelWrapper", None)
    return cls is not None and isinstance(model, cls)


def _worker_wrapper(role: str):
    def wrapper(wrapped, instance, args, kwargs):
        batch = args[0] if args else next(iter(kwargs.values()), None)
        model = getattr(instance, "model", None)
        routes = _field(batch, "rollout_expert_indices") if batch is not None else None
        if routes is None or not _is_hf_model_wrapper(model) or not _replay_enabled(instance, role):
            return wrapped(*args, **kwargs)
        with replaying(model, _field(batch, "attention_mask"), routes, _field(batch, "router_padding_mask")):
            return wrapped(*args, **kwargs)

    return wrapper


def install_workers(patcher: Patcher) -> None:
    for target in WORKER_METHODS:
        patcher.wrap(target, _worker_wrapper("ref" if target.startswith("RefWorkerBase") else "policy"))


# --------------------------------------------------------------------------- skyrl.fsdp_routes_config


def _validate_inference_engine_cfg(wrapped, instance, args, kwargs):
    cfg = args[0] if args else kwargs["cfg"]
    ie = cfg.generator.inference_engine
    if not getattr(ie, "enable_return_routed_experts", False) or cfg.trainer.strategy not in FSDP_STRATEGIES:
        return wrapped(*args, **kwargs)
    # SkyRL's R3 block asserts the Megatron strategy; run its other checks with the routes flag
    # lowered for the call, then SkyRL's two R3 checks that hold for FSDP too, in its words.
    ie.enable_return_routed_experts = False
    try:
        result = wrapped(*args, **kwargs)
    finally:
        ie.enable_return_routed_experts = True
    from ..core.errors import NotReplayable

    backend = ie.distributed_executor_backend
    if backend != "mp":
        raise NotReplayable(
            "generator.inference_engine.distributed_executor_backend",
            f"rollout router replay (r3) can hang with the ray backend - use the vLLM mp backend instead "
            f"(generator.inference_engine.distributed_executor_backend={backend!r} with "
            f"{ROUTES_CONFIG_KEY}=true; set it to mp)",
            value=backend,
        )
    if not cfg.trainer.policy.megatron_config.moe_enable_routing_replay:
        raise NotReplayable(
            REPLAY_KEY,
            f"moe_enable_routing_replay must be True to consume rollout expert indices ({ROUTES_CONFIG_KEY}=true "
            f"with {REPLAY_KEY} off: the routes would be captured and never replayed; set {REPLAY_KEY}=true, "
            f"or {ROUTES_CONFIG_KEY}=false)",
            value=cfg.trainer.policy.megatron_config.moe_enable_routing_replay,
        )
    return result


def install_config(patcher: Patcher) -> None:
    patcher.wrap("validate_inference_engine_cfg", _validate_inference_engine_cfg)
