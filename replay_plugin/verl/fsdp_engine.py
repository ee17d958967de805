"""Patches ``verl.fsdp_support_logprobs`` and ``verl.fsdp_routes``: verl's FSDP engine
(``FSDPEngineWithLMHead``, verl 0.9.1) scores with the rollout's sampler support and replays the
rollout's routed experts.

Gap (verl 0.9.1): verl has no sampler-support replay at all, and routed-expert replay (R3) only
on its Megatron and VeOmni engines: ``ActorRolloutRefWorker`` reads ``router_replay.mode`` for
those two strategies only, and the FSDP engine never reads the batch's ``routed_experts``.

Both patches are driven by the batch, as verl's own keys are:

- ``verl.fsdp_support_logprobs`` wraps ``FSDPEngineWithLMHead.prepare_model_outputs``. When the
  micro-batch carries :data:`BATCH_SUPPORT_KEY` (``rollout_sample_support``: int ``[B, R, W]``, the
  sampler's support of each response token, ``-1`` padding, response-aligned like
  ``rollout_log_probs`` / ``response_mask``; jagged ``[b, r_b, W]`` from the TransferQueue), the
  engine's ``log_probs`` are renormalised over each token's support
  (:func:`replay_plugin.fsdp.response_logprobs` on the model's raw logits, verl's temperature,
  its remove-padding and Ulysses layout). verl computes everything else as before (entropy over
  the full vocabulary, sum pi^2, distillation outputs): the patch runs verl's function with
  ``distillation_only`` set on a shallow copy of the micro-batch, which skips only verl's own
  log-prob pass. Every caller of the engine gets the replayed values: ``compute_log_prob``
  (old log-probs), ``update_actor`` (the PPO loss) and ``compute_ref_log_prob`` (the reference
  model over the same support, so that the KL penalty compares two distributions over one set).
- ``verl.fsdp_routes`` wraps ``FSDPEngine.forward_backward_batch`` and
  ``FSDPEngineWithLMHead.forward_step``. When the engine's own config says
  ``router_replay.mode: R3`` (the key verl reads on Megatron; on FSDP set it with
  ``+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3``) and the micro-batch carries
  verl's ``routed_experts`` (the rollout's, with
  ``actor_rollout_ref.rollout.enable_rollout_routing_replay=true``), each micro-batch's forward
  *and* backward run inside :func:`replay_plugin.fsdp.replay_routes`: verl calls
  ``loss.backward()`` in ``forward_backward_batch`` after ``forward_step`` returned, and
  gradient-checkpointed layers recompute there, so the scope stays open until the next
  micro-batch's forward or the end of the batch. The reference engine has a config of its own
  (``router_replay`` disabled by default): it does not replay, as verl forces for Megatron.

VeOmni's engine, which reuses these methods and has its own R3, passes through the route patch;
other engines reusing them (FSDP-Turbo: its own parallel state) are refused with either replay.

Rows without a route (padding, the last token of each sequence, which the engine never ran, and
all-zero rows of a top-k >= 2 model, which verl's agent loop leaves for tokens it did not
capture) are routed by the model itself. A sequence none of whose positions scoring a loss-bearing
token has a captured route is refused (R3 was asked for and would be a no-op there: the rollout
returned no routes), naming the row, its uid and the rollout flag; the replayed positions are
counted per micro-batch (debug log; a partial capture is logged once per process as a warning).
Both rules are ``engine_batch``'s (``check_captured``, ``response_support``), one with the Megatron
engine. A top-1 model's all-zero ``[0]`` row is a valid route to expert 0: it is replayed, and a
top-1 rollout that returned no routes cannot be told apart.
Refused with an error naming the setting: static
``pad_to_length`` and fused kernels with either replay (the layout / the logits are not the
plugin's), ``router_replay.mode: R2`` on FSDP, R3 without ``routed_experts`` in the batch, and
Ulysses sequence parallelism with an attention other than flash attention (verl 0.9.1 makes only
transformers' flash-attention path sequence-parallel: with sdpa each rank attends over its own
slice, and the log-probs are wrong whatever is replayed).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ..patcher import Patcher
from .engine_batch import (
    BATCH_ROUTES_KEY,
    REPLAY_OFF,
    batch_grid,
    check_captured,
    in_verl_terms,
    per_token_rows,
    replay_mode,
    response_support,
    uncaptured_rows,
    uniform_temperature,
)
from .engine_batch import non_tensor as _non_tensor
from .switch import BATCH_SUPPORT_KEY

#: modules of the engines the patches serve (VeOmni and others reuse the methods: refused)
FSDP_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
VEOMNI_PREFIX = "verl.workers.engine.veomni"
_HOLDER = "_replay_plugin_route_scope"


# --------------------------------------------------------------------------- shared layout


def _check_engine(engine: Any, what: str) -> None:
    from ..core.errors import NotReplayable

    module = type(engine).__module__
    if module != FSDP_ENGINE_MODULE:
        raise NotReplayable(
            "engine",
            f"{what} is implemented for verl's FSDP engine ({FSDP_ENGINE_MODULE}), not {type(engine).__name__} "
            f"of {module}: use strategy fsdp / fsdp2, or switch the plugin's verl patches off",
            value=type(engine).__name__,
        )
    if getattr(engine, "pad_to_length", False):
        raise NotReplayable(
            "pad_to_length",
            f"{what} cannot use the static packed padding of engine.pad_to_length (it shifts the Ulysses partition "
            "the plugin lays the data out by): set pad_to_length false",
            value=True,
        )
    if getattr(engine, "use_ulysses_sp", False):
        # verl 0.9.1 makes attention sequence-parallel by replacing transformers' flash-attention
        # forward only (models/transformers/monkey_patch.py); with sdpa or eager each Ulysses rank
        # attends over its own slice of the sequence, and the log-probs are wrong, silently (measured:
        # errors above 1 nat at SP=2). The replay cannot be exact on top of that.
        model = getattr(engine, "module", None)
        config = getattr(getattr(model, "module", model), "config", None)
        attn = str(getattr(config, "_attn_implementation", "") or "")
        if "flash" not in attn:
            raise NotReplayable(
                "attn_implementation",
                f"{what} with Ulysses sequence parallelism (ulysses_sequence_parallel_size > 1) needs a flash "
                f"attention implementation: verl splits attention over the sequence-parallel ranks only in "
                f"transformers' flash-attention path, and with attn_implementation={attn or None!r} every rank "
                "attends over its own slice (wrong log-probs). Set "
                "+actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2",
                value=attn or None,
            )


# --------------------------------------------------------------------------- verl.fsdp_support_logprobs


def _temperature(micro_batch: Any, output_args: Mapping, packed: bool) -> tuple[float, Any]:
    """``(T, per-position divisor or None)``: one temperature for the whole micro-batch, or (per
    sample, differing) the tensor the logits are divided by in verl's layout."""
    t = uniform_temperature(micro_batch)
    if t is not None:
        return t, None
    if packed:
        return 1.0, output_args["temperature_rmpad"].float().unsqueeze(-1)  # [n_local, 1] (verl squeezed its leading 1)
    return 1.0, output_args["temperature"].float()[:, None, None]  # [B, S, 1]


def support_log_probs(engine: Any, output: Any, output_args: Mapping, micro_batch: Any) -> Any:
    """verl's ``log_probs`` (jagged ``[b, j]``: position ``p`` holds the logprob of token ``p + 1``,
    0 where verl's consumers never read) renormalised over the rollout's support."""
    import torch
    import torch.nn.functional as F

    from ..core.errors import NotReplayable, ReplayDataError
    from ..fsdp import response_logprobs

    packed = bool(_non_tensor(micro_batch, "use_remove_padding", True))
    input_ids = micro_batch["input_ids"]
    ids, mask, indices, lengths = batch_grid(input_ids)
    batch, seq = ids.shape
    if seq < 2:
        raise ReplayDataError("input_ids", f"longest sequence {seq} token(s)", expected="prompt and response tokens")
    response, support, loss_mask = response_support(micro_batch, lengths)
    width = support.shape[-1]

    # Response token t of sequence b sits at grid column lengths[b] - response[b] + t; the loss
    # column that scores it (num_actions = S - 1 columns: column c scores token c + 1) is one less.
    device = ids.device
    r_max = int(response.max())
    t = torch.arange(r_max, device=device)
    response, lengths = response.to(device), lengths.to(device)
    inside = t[None, :] < response[:, None]
    columns = ((lengths - response)[:, None] + t[None, :])[inside]
    rows_of = torch.arange(batch, device=device)[:, None].expand(batch, r_max)[inside]
    grid_support = torch.full((batch, seq, width), -1, dtype=support.dtype, device=device)
    grid_support[rows_of, columns] = support[:, :r_max].to(device)[inside]
    grid_loss = torch.zeros(batch, seq - 1, dtype=torch.bool, device=device)
    grid_loss[rows_of, columns - 1] = loss_mask[:, :r_max].to(device)[inside]

    logits = output.logits
    if logits is None:
        raise NotReplayable(
            "use_fused_kernels", "sample-support replay needs the model's logits: set use_fused_kernels false"
        )
    if hasattr(logits, "full_tensor"):  # a DTensor (tensor parallel over the vocabulary)
        logits = logits.full_tensor()
    temperature, divisor = _temperature(micro_batch, output_args, packed)
    if divisor is not None:
        logits = logits / divisor.to(logits.device)
    sp_group = engine.ulysses_parallel_group if packed and getattr(engine, "use_ulysses_sp", False) else None
    try:
        lp = response_logprobs(
            logits,
            ids,
            mask,
            seq - 1,
            support_ids=grid_support,
            loss_mask=grid_loss,
            temperature=temperature,
            indices=indices if packed else None,
            sp_group=sp_group,
        )
    except ReplayDataError as exc:
        raise _in_verl_terms(exc, micro_batch, lengths, response) from exc
    full = F.pad(lp, (0, 1))
    values = full.reshape(-1).index_select(0, indices.to(full.device))
    return torch.nested.nested_tensor_from_jagged(values, input_ids.offsets())


def _in_verl_terms(exc: Any, micro_batch: Any, lengths: Any, response: Any) -> Any:
    """The error of the plugin's grid in verl's terms (grid column -> response token)."""
    if exc.trajectory is None or exc.token is None:
        return exc
    b = exc.trajectory
    return in_verl_terms(exc, micro_batch, b, exc.token - int(lengths[b] - response[b] - 1))


def _prepare_model_outputs(wrapped, instance, args, kwargs):
    from ..core.errors import NotReplayable

    names = ("output", "output_args", "micro_batch", "logits_processor_func")
    bound = dict(zip(names, args, strict=False)) | kwargs
    micro_batch = bound["micro_batch"]
    if BATCH_SUPPORT_KEY not in micro_batch.keys() or _non_tensor(micro_batch, "distillation_only", False):
        return wrapped(*args, **kwargs)
    _check_engine(instance, "sample-support replay")
    if _non_tensor(micro_batch, "use_fused_kernels", False):
        raise NotReplayable(
            "use_fused_kernels",
            "sample-support replay needs the model's logits, which verl's fused kernels never materialise: set "
            "actor_rollout_ref.model.use_fused_kernels=false",
            value=True,
        )
    from verl.utils import tensordict_utils as tu

    theirs = micro_batch.copy()  # shallow: verl's tensors, one non-tensor flag of our own
    tu.assign_non_tensor(theirs, distillation_only=True)
    bound["micro_batch"] = theirs
    model_output = wrapped(**bound)
    model_output["log_probs"] = support_log_probs(instance, bound["output"], bound["output_args"], micro_batch)
    return model_output


def install_support_logprobs(patcher: Patcher) -> None:
    patcher.wrap("FSDPEngineWithLMHead.prepare_model_outputs", _prepare_model_outputs)


# --------------------------------------------------------------------------- verl.fsdp_routes


def route_scope(engine: Any, micro_batch: Any) -> Any:
    """The (unentered) ``replay_routes`` scope of one micro-batch, in the layout the engine feeds
    the model: ``[1, nnz]`` (remove-padding; verl's Ulysses slice of it with SP) or the
    left-justified ``[B, S]`` grid."""
    import torch

    from ..core.errors import ReplayDataError
    from ..fsdp import replay_routes

    _check_engine(engine, "routed-expert replay")
    ids, mask, indices, lengths = batch_grid(micro_batch["input_ids"])
    batch, seq = ids.shape
    values = per_token_rows(micro_batch, BATCH_ROUTES_KEY, indices, lengths)
    if values.dim() != 3:
        raise ReplayDataError(BATCH_ROUTES_KEY, f"rows of shape {tuple(values.shape[1:])}", expected="[L, K] per token")
    values = values.to(ids.device)
    grid = values.new_zeros((batch * seq, *values.shape[1:]))
    grid.index_copy_(0, indices, values)
    grid = grid.view(batch, seq, *values.shape[1:])
    no_route = ~mask
    no_route[torch.arange(batch, device=ids.device), lengths - 1] = True  # the engine never ran the last token
    no_route |= uncaptured_rows(grid)  # rows verl's agent loop left uncaptured (top-k >= 2 only)
    check_captured(micro_batch, no_route, mask, lengths, patch="verl.fsdp_routes", fate=UNCAPTURED_FATE)
    packed = bool(_non_tensor(micro_batch, "use_remove_padding", True))
    sp_group = engine.ulysses_parallel_group if packed and getattr(engine, "use_ulysses_sp", False) else None
    return replay_routes(engine.module, grid, no_route, indices=indices if packed else None, sp_group=sp_group)


#: what the FSDP route patch does with a row without a captured route
UNCAPTURED_FATE = "are routed by the model itself"


class _Scope:
    """One ``forward_backward_batch``: the open route scope of its current micro-batch."""

    def __init__(self) -> None:
        self.ctx: Any = None

    def close(self, *exc: Any) -> None:
        ctx, self.ctx = self.ctx, None
        if ctx is not None:
            ctx.__exit__(*(exc or (None, None, None)))


def _wants_routes(engine: Any, micro_batch: Any) -> bool:
    from ..core.errors import NotReplayable

    if type(engine).__module__.startswith(VEOMNI_PREFIX):
        return False  # VeOmni reuses forward_step and replays with its own R3
    mode = replay_mode(engine)
    if mode in REPLAY_OFF:
        return False
    if mode != "R3":
        raise NotReplayable(
            "router_replay.mode",
            f"router_replay.mode={mode} on verl's FSDP engine: the plugin replays the rollout's routes (R3) only",
            value=mode,
        )
    if _non_tensor(micro_batch, "enable_routing_replay", True) is False:
        return False
    if micro_batch.get(BATCH_ROUTES_KEY, None) is None:
        raise NotReplayable(
            "router_replay.mode",
            "router_replay.mode=R3 but the batch has no routed_experts: set "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
            value=mode,
        )
    return True


def _forward_step(wrapped, instance, args, kwargs):
    micro_batch = kwargs["micro_batch"] if "micro_batch" in kwargs else args[0]
    forward_only = kwargs["forward_only"] if "forward_only" in kwargs else (args[2] if len(args) > 2 else False)
    scope = instance.__dict__.get(_HOLDER)
    if scope is not None:
        scope.close()  # the previous micro-batch's backward has run: it follows its forward_step
    if not _wants_routes(instance, micro_batch):
        return wrapped(*args, **kwargs)
    ctx = route_scope(instance, micro_batch)
    ctx.__enter__()
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        ctx.__exit__(*sys.exc_info())
        raise
    if forward_only or scope is None:
        ctx.__exit__(None, None, None)
    else:
        scope.ctx = ctx  # open through forward_backward_batch's loss.backward()
    return result


def _forward_backward_batch(wrapped, instance, args, kwargs):
    previous = instance.__dict__.get(_HOLDER)
    scope = instance.__dict__[_HOLDER] = _Scope()
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        scope.close(*sys.exc_info())
        raise
    finally:
        scope.close()
        if previous is None:
            instance.__dict__.pop(_HOLDER, None)
        else:
            instance.__dict__[_HOLDER] = previous
    return result


def install_routes(patcher: Patcher) -> None:
    patcher.wrap("FSDPEngine.forward_backward_batch", _forward_backward_batch)
    patcher.wrap("FSDPEngineWithLMHead.forward_step", _forward_step)
