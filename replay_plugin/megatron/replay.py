"""Routed-expert replay (R3) for Megatron trainers: :func:`replay_routes`, once per microbatch.

Called in ``forward_step`` before the model's forward, it installs the batch's recorded routes
``[B, S, L, K]`` on the routers of the model chunk being run: each router keyed by its own
global layer number (upstream's ``RouterReplay.set_replay_data`` indexes a process-global list
and misroutes as soon as there are two models or virtual-pipeline chunks), only this stage's
layers, aligned to the model's input layout and sequence-parallel shard, switched to
``REPLAY_BACKWARD`` when the chunk's forward returns. Pass the returned ``padding_mask`` to the
model. Configurations where replay would silently do nothing, or misroute, are refused
(:class:`ReplayConfigError`), among them combined 1F1B (``overlap_moe_expert_parallel_comm``).

Memory: each router's backward-FIFO entry owns only its layer's rows, and an entry no recompute
will pop (the router's forward ran with grad enabled, i.e. outside activation checkpointing, or
in a forward-only schedule) is released when the chunk's forward returns, so route memory is
bounded by the microbatches in flight. The ``megatron.router_replay_scope`` patch drops what a
schedule installed and left unconsumed; after replaying outside a schedule call
:func:`clear_routes`. Process groups come from :func:`replay_plugin.megatron.groups.groups_of`
(the model's ``pg_collection``), as in :mod:`replay_plugin.megatron.support`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from replay_plugin.core.errors import ReplayDataError, ReplayTypeError
from replay_plugin.core.routes import as_signed_routes, check_route_sanity, select_layers, split_for_replay
from replay_plugin.megatron import router_replay_scope
from replay_plugin.megatron.groups import groups_of

if TYPE_CHECKING:
    import torch

    from replay_plugin.core.layout import TokenMetadataLayout

__all__ = ["MicrobatchReplay", "ReplayConfigError", "clear_routes", "replay_layers", "replay_routes"]

log = logging.getLogger("replay_plugin")

#: routing types whose router never consults RouterReplay
_NO_REPLAY_ROUTING = ("sinkhorn", "quantile_balancing")


class ReplayConfigError(ReplayDataError):
    """A model configuration under which replay would silently do nothing (or misroute)."""


@dataclasses.dataclass(frozen=True)
class _Router:
    module: Any  # TopKRouter
    replay: Any  # its RouterReplay
    layer: int  # 0-based global layer index = layer_number - 1
    name: str


class _ModelState:
    """What :func:`replay_routes` needs to know about one model chunk (computed once)."""

    def __init__(self, model: Any) -> None:
        routers, lm = _collect_routers(model)
        self.routers: tuple[_Router, ...] = tuple(routers)
        self.layer_numbers = tuple(r.layer + 1 for r in routers)
        config = routers[0].module.config if routers else getattr(lm, "config", None)
        self.num_layers: int | None = getattr(config, "num_layers", None)
        self.topk: int | None = routers[0].module.topk if routers else None
        self.num_experts: int | None = routers[0].module.config.num_moe_experts if routers else None
        self.config = config
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
        self.groups = groups_of(model)
        # GPTModel._preprocess scatters padding_mask for sequence parallelism on its first
        # pipeline stage only; later stages (and HybridModel) hand it to the layers as given.
        self.model_scatters_mask = (
            lm is not None
            and bool(getattr(lm, "pre_process", False))
            and any(c.__name__ == "GPTModel" for c in type(lm).__mro__)
        )
        self.pending: MicrobatchReplay | None = None
        self.hook = None
        # Per router: whether its last REPLAY_FORWARD call ran where no recompute follows (grad
        # enabled and no saved-tensor hooks, i.e. not inside activation checkpointing).
        self.not_recomputed = [False] * len(self.routers)
        self.router_hooks = [
            r.module.register_forward_pre_hook(functools.partial(_note_forward, self, j))
            for j, r in enumerate(self.routers)
        ]


def _collect_routers(model: Any) -> tuple[list[_Router], Any]:
    """The replayable decoder routers of a model chunk, in module order, each checked and keyed
    by its global layer number, and the chunk's language model (the first module with
    ``pre_process`` and ``decoder``; None when there is none)."""
    routers: list[_Router] = []
    disabled: list[str] = []
    lm = None
    for name, module in model.named_modules():
        if lm is None and hasattr(module, "pre_process") and hasattr(module, "decoder"):
            lm = module
        if not hasattr(module, "router_replay") or not hasattr(module, "routing"):
            continue
        if getattr(module, "is_mtp_layer", False) or "mtp" in name.split("."):
            # MTP routers: routes carry no MTP rows; numbered num_layers + depth in 0.16.x and
            # depth (colliding with decoder layers, NeMo-RL #3903) from 0.17.0
            continue
        replay = module.router_replay
        if replay is None:
            disabled.append(name)
            continue
        _check_router(module, name)
        routers.append(_Router(module, replay, int(module.layer_number) - 1, name))
    if disabled:
        raise ReplayConfigError(
            "moe_enable_routing_replay",
            f"routers {disabled[:3]} were built without a RouterReplay",
            expected="TransformerConfig(moe_enable_routing_replay=True) when the model is built",
        )
    seen: dict[int, str] = {}
    for r in routers:
        if r.layer in seen:
            raise ReplayConfigError(
                "layer_number",
                f"routers {seen[r.layer]} and {r.name} share layer number {r.layer + 1}",
                expected="one router per global layer number",
            )
        seen[r.layer] = r.name
    return routers, lm


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are installed (non-reentrant checkpointing, activation
    offloading): a forward with grad enabled may then still be recomputed. torch's query is
    private (2.x); where it is missing, assume they are."""
    import torch

    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(False) is not None
    except Exception:  # noqa: BLE001 - a changed private signature: be conservative
        return True


def _note_forward(state: _ModelState, j: int, module: Any, args: Any) -> None:
    """Forward pre-hook on router ``j``: note whether this REPLAY_FORWARD call can be recomputed.
    Megatron's activation checkpointing (``tensor_parallel.checkpoint``,
    ``CheckpointWithoutOutput``) runs the checkpointed forward under ``no_grad``; with grad
    enabled and no saved-tensor hooks the router is not recomputed and its FIFO entry is never
    popped."""
    import torch

    replay = module.router_replay
    if replay is not None and replay.router_replay_action == _action().REPLAY_FORWARD:
        state.not_recomputed[j] = torch.is_grad_enabled() and not _saved_tensor_hooks_active()


_actions: list = []


def _action() -> Any:
    if not _actions:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        _actions.append(RouterReplayAction)
    return _actions[0]


def _check_router(module: Any, name: str) -> None:
    config = module.config
    if getattr(config, "moe_router_fusion", False):
        raise ReplayConfigError(
            "moe_router_fusion",
            f"True on router {name}: the fused top-k (Transformer Engine) returns before RouterReplay is consulted, "
            "so replay would do nothing",
            expected="moe_router_fusion=False",
        )
    routing_type = getattr(module, "routing_type", None)
    if isinstance(routing_type, str) and routing_type in _NO_REPLAY_ROUTING:
        raise ReplayConfigError(
            "moe_router_load_balancing_type",
            f"{routing_type!r} on router {name}: this routing never consults RouterReplay, so replay would do nothing",
            expected="a top-k routing type (aux_loss, seq_aux_loss, global_aux_loss, none)",
        )
    if module.layer_number is None:
        raise ReplayConfigError(
            "layer_number",
            f"router {name} has no layer number",
            expected="routers inside a TransformerLayer (it calls set_layer_number at construction)",
        )


_states: weakref.WeakKeyDictionary[Any, _ModelState] = weakref.WeakKeyDictionary()


def _state_of(model: Any) -> _ModelState:
    if isinstance(model, (list, tuple)):
        raise ReplayTypeError(
            "model",
            f"got a {type(model).__name__} of model chunks",
            expected="the one model chunk forward_step was given",
        )
    if not hasattr(model, "named_modules"):
        raise ReplayTypeError("model", f"got {type(model).__name__}", expected="a torch.nn.Module (the model chunk)")
    state = _states.get(model)
    if state is None:
        state = _ModelState(model)

        def after_forward(module: Any, args: Any, output: Any, _state: _ModelState = state) -> None:
            if _state.pending is not None:
                _state.pending.switch_to_backward()

        state.hook = model.register_forward_hook(after_forward)
        _states[model] = state
    return state


def replay_layers(model: Any) -> tuple[int, ...]:
    """Validate ``model`` for replay and return the global 1-based layer numbers of the routers
    :func:`replay_routes` installs on, in module order (empty on a stage without MoE layers).

    Raises:
        ReplayConfigError: see the module docstring.
    """
    return _state_of(model).layer_numbers


@dataclasses.dataclass(eq=False)
class MicrobatchReplay:
    """What :func:`replay_routes` installed for one microbatch.

    Attributes:
        padding_mask: bool, True = no recorded route / padding; pass it to the model as
            ``padding_mask=``. ``[B, A]`` unpacked or ``[1, T / cp]`` packed, or its
            sequence-parallel shard ``[.., / tp]`` on stages where the model does not scatter it.
        layer_numbers: global 1-based layer numbers of the routers that got data.
        replay_data: per router, the int32 ``[N, K]`` indices installed (``N`` tokens in the
            router's order: sequence-major, ``N = A_local * B``).
        own_rows: ``[N]`` bool, rows the trainer's own router routes (router padding mask).
    """

    padding_mask: torch.Tensor
    layer_numbers: tuple[int, ...]
    replay_data: tuple[torch.Tensor, ...]
    own_rows: torch.Tensor
    _routers: tuple[_Router, ...] = dataclasses.field(repr=False)
    _state: _ModelState | None = dataclasses.field(repr=False, default=None)
    _switched: bool = dataclasses.field(repr=False, default=False)

    @property
    def int32_bytes(self) -> int:
        """Bytes of int32 replay data materialised for this microbatch (one tensor per layer)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.replay_data}
        return sum(storages.values())

    def switch_to_backward(self) -> None:
        """Set ``REPLAY_BACKWARD`` on the routers that got data (idempotent). Runs
        automatically when the model chunk's forward returns; call it yourself only when the
        forward does not go through the chunk's ``__call__``."""
        if self._switched:
            return
        backward = _action().REPLAY_BACKWARD
        for r in self._routers:
            r.replay.set_router_replay_action(backward)
        self._switched = True
        state = self._state
        if state is not None:
            if state.pending is self:
                state.pending = None
            self._release_unused(state)

    def _release_unused(self, state: _ModelState) -> None:
        """Drop the FIFO entries of this microbatch that no recompute will pop (forward-only
        schedule, or the router ran outside activation checkpointing), so that they do not hold
        memory until the schedule ends."""
        schedule = router_replay_scope.current_schedule()
        forward_only = schedule is not None and schedule.forward_only
        for j, (r, data) in enumerate(zip(self._routers, self.replay_data)):
            if forward_only or state.not_recomputed[j]:
                router_replay_scope.release_entry(r.replay, data)
            state.not_recomputed[j] = False


# ---------------------------------------------------------------------------------------
# input validation


def _as_tensor(x: Any, field: str) -> torch.Tensor:
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            x = np.array(x)  # torch cannot wrap read-only memory without a warning
        try:
            return torch.from_numpy(x)
        except TypeError as exc:
            raise ReplayTypeError(field, f"dtype {x.dtype}: {exc}", expected="a dtype torch supports") from None
    raise ReplayTypeError(field, f"got {type(x).__name__}", expected="a torch tensor or numpy array")


def _check_routes(routes: Any, batch_shape: tuple[int, int], state: _ModelState) -> torch.Tensor:
    import torch

    t = _as_tensor(routes, "routes")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ReplayTypeError(
            "routes", f"dtype {t.dtype}", expected="integer expert ids (compact: uint8, int16 or int32)"
        )
    if t.dim() != 4:
        raise ReplayDataError("routes", f"shape {tuple(t.shape)}", expected="[batch, seq, layers, topk]")
    if tuple(t.shape[:2]) != batch_shape:
        raise ReplayDataError(
            "routes",
            f"shape {tuple(t.shape)}",
            expected=f"[{batch_shape[0]}, {batch_shape[1]}, L, K] like the layout's attention_mask",
        )
    if state.num_layers is not None and t.shape[2] != state.num_layers:
        raise ReplayDataError(
            "routes",
            f"{t.shape[2]} layers",
            expected=(
                f"{state.num_layers}: one entry per decoder layer of the model (dense layers included, as vLLM "
                "records them), indexed by layer_number - 1"
            ),
        )
    if state.topk is not None and t.shape[3] != state.topk:
        raise ReplayDataError("routes", f"top-k {t.shape[3]}", expected=f"moe_router_topk = {state.topk}")
    return t


def _check_mask(mask: Any, batch_shape: tuple[int, int]) -> torch.Tensor:
    import torch

    m = _as_tensor(mask, "router_padding_mask")
    if m.dtype != torch.bool:
        # 0/1 attention masks mean the opposite (1 = valid); refuse rather than guess.
        raise ReplayTypeError("router_padding_mask", f"dtype {m.dtype}", expected="bool, True = no recorded route")
    if tuple(m.shape) != batch_shape:
        raise ReplayDataError(
            "router_padding_mask",
            f"shape {tuple(m.shape)}",
            expected=f"[{batch_shape[0]}, {batch_shape[1]}] like the layout's attention_mask",
        )
    return m


def _check_expert_ids(sel: torch.Tensor, rows: torch.Tensor, state: _ModelState) -> None:
    """Every id of the rows that carry a route (``rows`` ``[B, S]`` True) in ``[0, num_experts)``
    and distinct within a token's top-k (one reduction, so one host sync; located only on
    failure). Other rows are replaced by the dummy route before installation, whatever they hold.
    Megatron's replay gathers the scores at the given ids: the same expert twice would weigh it
    twice and drop a slot, silently."""
    import torch

    if sel.numel() == 0:
        return
    num_experts = state.num_experts
    srt = sel.sort(dim=-1).values
    wrong = torch.zeros_like(sel, dtype=torch.bool)
    wrong[..., 1:] = srt[..., 1:] == srt[..., :-1]
    if num_experts is not None and num_experts <= torch.iinfo(sel.dtype).max:
        wrong |= sel >= num_experts
    if sel.dtype != torch.uint8:
        wrong |= sel < 0
    wrong &= rows[:, :, None, None]
    if bool(wrong.any()):
        b, s, layer, k = (int(v) for v in wrong.nonzero()[0])
        row = sel[b, s, layer].tolist()
        if len(set(row)) < len(row):
            problem, expected = (
                f"the same expert twice in layer {state.layer_numbers[layer]}: {row}",
                (f"{len(row)} distinct experts per token and layer"),
            )
        else:
            problem, expected = (
                f"expert id {int(sel[b, s, layer, k])} in layer {state.layer_numbers[layer]}",
                f"ids in [0, {num_experts})",
            )
        raise ReplayDataError("routes", problem, trajectory=b, token=s, expected=expected)


_fallback_warned = False


def _fallback_active() -> bool:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from replay_plugin.patcher import patch_marker

    return patch_marker(inspect.getattr_static(RouterReplay, "get_replay_topk")) == "megatron.replay_padding_fallback"


# ---------------------------------------------------------------------------------------
# the driver


def replay_routes(
    model: Any,
    routes: np.ndarray | torch.Tensor,
    router_padding_mask: np.ndarray | torch.Tensor,
    layout: TokenMetadataLayout,
) -> MicrobatchReplay:
    """Install one microbatch's recorded routes on the routers of ``model``.

    Call inside ``forward_step``, before the model's forward, once per microbatch.

    Args:
        model: the model chunk ``forward_step`` was given (a ``GPTModel``, possibly wrapped
            by Megatron's DDP / ``Float16Module``).
        routes: ``[B, S, L, K]`` expert ids, any integer dtype (compact uint8/int16/int32
            expected; numpy or tensor, any device): ``L`` = ``config.num_layers`` (one entry
            per decoder layer, indexed by layer number - 1), ``K`` = ``moe_router_topk``.
        router_padding_mask: ``[B, S]`` bool, True = no recorded route (padding rows).
        layout: the microbatch's layout (its ``attention_mask`` is ``[B, S]``; its device is
            where the replay data goes; built with this rank's CP size and rank).

    Returns:
        :class:`MicrobatchReplay`; pass its ``padding_mask`` to the model.

    Raises:
        ReplayConfigError: the model cannot replay (see the module docstring).
        ReplayDataError / ReplayTypeError: wrong shapes, dtypes, layer counts, top-k, expert
            ids out of range (naming the trajectory and token), a layout that does not fit
            the model's parallelism, or the previous microbatch's forward never finished.
    """
    from replay_plugin.core.layout import TokenMetadataLayout

    if not isinstance(layout, TokenMetadataLayout):
        raise ReplayTypeError(
            "layout", f"got {type(layout).__name__}", expected="a replay_plugin.core.layout.TokenMetadataLayout"
        )
    state = _state_of(model)
    _refuse_combined_1f1b(state)
    batch_shape = tuple(layout.attention_mask.shape)
    routes_t = _check_routes(routes, batch_shape, state)
    mask = _check_mask(router_padding_mask, batch_shape)
    _retire_pending(state)
    shard = _sequence_shard(state, layout)
    mask = mask.to(layout.attention_mask.device)
    model_mask, mask_local = _padding_masks(mask, layout, state, shard)
    # Routers see hidden states [seq, batch]: token n = s * batch + b.
    own_rows = mask_local.transpose(0, 1).reshape(-1)
    if not state.routers:
        return MicrobatchReplay(model_mask, (), (), own_rows, (), None, True)
    data = _local_replay_data(routes_t, mask, mask_local, layout, state, shard)
    _install(state.routers, data, own_rows)
    replay = MicrobatchReplay(model_mask, state.layer_numbers, tuple(data), own_rows, state.routers, state)
    state.pending = replay
    return replay


def _combined_1f1b_error() -> ReplayConfigError:
    return ReplayConfigError(
        "overlap_moe_expert_parallel_comm",
        "True: training schedules then run combined 1F1B, which overlaps one microbatch's forward with "
        "another's backward layer by layer and hands forward_step the unwrapped model to build a schedule plan "
        "instead of running the chunk, so routes cannot be switched from forward to backward replay per microbatch",
        expected="overlap_moe_expert_parallel_comm=False for training steps that replay routes (forward-only "
        "schedules, which do not use combined 1F1B, are fine)",
    )


def _scope_applied() -> bool:
    from megatron.core.pipeline_parallel import schedules

    from replay_plugin.patcher import patch_marker

    fn = inspect.getattr_static(schedules, "forward_backward_no_pipelining", None)
    return patch_marker(fn) == "megatron.router_replay_scope"


def _refuse_combined_1f1b(state: _ModelState) -> None:
    """Refuse replay inside a training schedule of a model configured for combined 1F1B (inside
    a forward-only schedule, or outside schedules, the model runs its plain forward). Without
    the ``megatron.router_replay_scope`` patch the schedule is unknown: refused."""
    if not getattr(state.config, "overlap_moe_expert_parallel_comm", False):
        return
    schedule = router_replay_scope.current_schedule()
    if schedule is not None and schedule.forward_only:
        return
    if schedule is None and _scope_applied():
        return
    raise _combined_1f1b_error()


def _check_schedule(model: Any, forward_only: bool) -> None:
    """Run by the scope patch before each top-level schedule: a training schedule of a model
    chunk this driver has replayed on, configured for combined 1F1B, is refused before it starts."""
    if forward_only or not _states:
        return
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        try:
            state = _states.get(chunk)
        except TypeError:
            continue
        if state is not None and getattr(state.config, "overlap_moe_expert_parallel_comm", False):
            raise _combined_1f1b_error()


router_replay_scope.add_schedule_check(_check_schedule)


def _retire_pending(state: _ModelState) -> None:
    """Forget the previous microbatch, refusing when its forward never switched its routers to
    ``REPLAY_BACKWARD`` (the next install would then misalign the backward FIFOs)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    pending = state.pending
    if pending is None:
        return
    if any(r.replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD for r in pending._routers):
        raise ReplayDataError(
            "model",
            "the previous microbatch's forward never returned through the model chunk passed to replay_routes, so "
            "its routers were not switched to REPLAY_BACKWARD",
            expected=(
                "model(...) called on that chunk after each replay_routes(); else call "
                "MicrobatchReplay.switch_to_backward() or clear_routes(model)"
            ),
        )
    state.pending = None


@dataclasses.dataclass(frozen=True)
class _SequenceShard:
    """This rank's part of the aligned token axis (``length`` tokens per row): the whole axis,
    or under sequence parallelism (``active``) the ``tp_rank``-th of ``tp_size`` equal chunks."""

    active: bool
    tp_size: int
    tp_rank: int
    length: int

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, length, ...]`` -> ``[rows, length / tp, ...]`` (a view; unchanged when inactive)."""
        if not self.active:
            return x
        chunk = self.length // self.tp_size
        return x[:, self.tp_rank * chunk : (self.tp_rank + 1) * chunk]


def _sequence_shard(state: _ModelState, layout: TokenMetadataLayout) -> _SequenceShard:
    """Check that ``layout`` was built for this rank's context-parallel group and fits sequence
    parallelism; return this rank's sequence shard."""
    g = state.groups
    cp_size, cp_rank = g.cp_size, g.cp_rank
    if layout.cp_size != cp_size or layout.cp_rank != cp_rank:
        raise ReplayDataError(
            "layout",
            f"built for context-parallel rank {layout.cp_rank} of {layout.cp_size}",
            expected=f"rank {cp_rank} of {cp_size} (this process)",
        )
    tp_size, tp_rank = g.tp_size, g.tp_rank
    active = state.sequence_parallel and tp_size > 1
    _, length = layout.output_shape
    if active and length % tp_size:
        raise ReplayDataError(
            "layout",
            f"{length} tokens per row with alignment {layout.alignment}",
            expected=(
                f"a multiple of tensor_model_parallel_size {tp_size} under sequence parallelism (build the "
                "layout with align = tp [* 2 * cp when packed])"
            ),
        )
    return _SequenceShard(active, tp_size, tp_rank, length)


def _padding_masks(
    mask: torch.Tensor, layout: TokenMetadataLayout, state: _ModelState, shard: _SequenceShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the router padding mask ``[B, S]`` (True = no route): the mask to hand the model
    (aligned ``[rows, length]``, or this rank's shard ``[rows, length / tp]`` where the model
    does not scatter it itself) and this rank's shard of the aligned mask."""
    mask_aligned = layout.align(mask, True)  # [rows, length], True = no route
    mask_local = shard.local(mask_aligned)
    model_mask = mask_aligned if (state.model_scatters_mask or not shard.active) else mask_local.contiguous()
    return model_mask, mask_local


def _local_replay_data(
    routes: torch.Tensor,
    mask: torch.Tensor,
    mask_local: torch.Tensor,
    layout: TokenMetadataLayout,
    state: _ModelState,
    shard: _SequenceShard,
) -> list[torch.Tensor]:
    """Per router of this stage, its int32 ``[N, K]`` replay data in the routers' token order
    (sequence-major, ``N = length_local * rows``), from the compact routes ``[B, S, L, K]``."""
    import torch

    device = layout.attention_mask.device
    local = [r.layer for r in state.routers]
    if max(local) >= routes.shape[2]:
        raise ReplayDataError(
            "routes", f"{routes.shape[2]} layers", expected=f"more than {max(local)} (router layer {max(local) + 1})"
        )
    selected: torch.Tensor = select_layers(routes, local)  # compact [B, S, L_local, K]
    selected = selected.to(device, non_blocking=True)
    recorded = layout.attention_mask & ~mask  # [B, S]: rows that carry a route
    selected = as_signed_routes(selected)  # uint16/32/64: torch has no comparisons for them on CPU
    check_route_sanity(selected, recorded, layer_names=state.layer_numbers, num_experts=state.num_experts)
    _check_expert_ids(selected, recorded, state)
    topk = selected.shape[-1]
    dummy = torch.arange(topk, dtype=selected.dtype, device=device)
    aligned = shard.local(layout.align(selected, dummy))  # [rows, length_local, L_local, K]
    # Rows without a route get the dummy route whatever the caller put there (e.g. -1): the
    # replay path gathers scores at every row's indices, and stock replay routes to them. The
    # result is laid out sequence-major, the routers' token order (hidden states are [seq, batch]).
    seq_major = torch.where(mask_local.transpose(0, 1)[:, :, None, None], dummy, aligned.transpose(0, 1))
    return split_for_replay(seq_major)  # L_local x [N, K] int32, the only int32 copy


def _install(routers: tuple[_Router, ...], data: list[torch.Tensor], own_rows: torch.Tensor) -> None:
    """Give each router its ``[N, K]`` data (forward target and backward FIFO entry) and the
    ``REPLAY_FORWARD`` action; mark ``own_rows`` ``[N]`` for the trainer's own routing when the
    ``megatron.replay_padding_fallback`` patch is applied (warn once when it is not)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    global _fallback_warned
    fallback = _fallback_active()
    if not fallback and not _fallback_warned:
        _fallback_warned = True
        log.warning(
            "replay_plugin: patch megatron.replay_padding_fallback is not applied: rows marked in "
            "router_padding_mask replay the dummy route [0..K-1] instead of the trainer's own routing"
        )
    from replay_plugin.megatron.replay_padding_fallback import mark_own_rows

    for r, t in zip(routers, data):
        if fallback:
            mark_own_rows(t, own_rows)
        r.replay.set_target_indices(t)
        r.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def clear_routes(model: Any) -> None:
    """Clear targets, backward FIFOs and actions of ``model``'s routers (recorded indices
    stay). A schedule drops what it installed itself (``megatron.router_replay_scope``); call
    this after replaying outside a schedule (routes left there are dropped, with a
    ``StaleRoutesWarning``, when a schedule installs on the same routers)."""
    state = _state_of(model)
    for r in state.routers:
        r.replay.target_topk_idx = None
        r.replay.replay_backward_list = []
        r.replay.router_replay_action = None
    state.pending = None
    state.not_recomputed = [False] * len(state.routers)
