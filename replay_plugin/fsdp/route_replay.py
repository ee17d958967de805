"""Routed-expert replay (R3) for Hugging Face MoE models: :func:`record_routes`, :func:`replay_routes`.

An FSDP trainer scores rollout tokens with a Hugging Face MoE model. :func:`replay_routes` makes
every MoE layer send each token to the experts the rollout engine chose for it (vLLM's routed
experts, ``[P + T - 1, L, K]`` per trajectory, batched with
:func:`replay_plugin.core.routes.pad_batch`); :func:`record_routes` reads what the experts of the
last forward received.

How (the patch ``transformers.moe_router_replay.<family>``, :mod:`replay_plugin.fsdp.moe_router_replay`,
wraps each family's MoE block forward at import; the context managers only bind per-layer state):

* while a context is open, a call of a bound block watches its own router and experts modules for
  the duration of that call: the router's logits are kept, and the experts module receives the
  recorded expert ids of layer ``i`` with weights recomputed from those logits by the family's own
  formula (:mod:`replay_plugin.fsdp.hf_moe`), so gradients reach the router. Rows marked in the
  router padding mask keep the model's own ids and weights;
* layer ``i`` is the decoder-layer index in the block's module path (``model.layers.<i>.mlp``,
  under FSDP/PEFT wrappers too): vLLM's index, dense layers included. Never the firing order, so
  activation recompute in backward (gradient checkpointing runs each block again) replays the same
  rows, and dense layers cost nothing;
* outside a context the wrapper calls the stock forward and nothing else: the model computes
  exactly what it computes without the plugin.

Fail loud, never silently not replay (:class:`UnsupportedModelError`, :class:`ReplayStateError`):
before anything is bound, every refusal of :mod:`replay_plugin.fsdp.moe_layers` (unknown family,
remote-code classes, hub kernels, mxfp4, patch not applied) and every route check of
:mod:`replay_plugin.fsdp.route_layout`; while running, a router or experts module not called
exactly once per block call, weights that the family formula does not reproduce on the model's
own routes (checked once per block class, config and dtype in a process), an MoE block not run in
a forward, a checkpointed layer recomputed after its context closed (run ``backward`` inside it).

Load-balancing loss: by default the family's ``load_balancing_loss_func`` runs its own top-k on
the router logits (upstream behaviour: it counts the routes the model would have chosen);
``aux_loss="replayed"`` counts the experts the tokens were sent to
(:func:`replay_plugin.fsdp.hf_moe.load_balancing_loss`), like Megatron's router under replay.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Iterator
from typing import Any, TypeAlias

import numpy as np
import torch

from ..core.errors import ReplayDataError
from .hf_moe import load_balancing_loss
from .moe_layers import MoeBlock, MoeModel, UnsupportedModelError
from .route_layout import check_routes, device_of, to_model_layout

__all__ = [
    "ReplayStateError",
    "RouteRecording",
    "RouteReplay",
    "UnsupportedModelError",
    "record_routes",
    "replay_routes",
]


class ReplayStateError(RuntimeError):
    """Contexts used in a way that would replay the wrong routes (nesting, recompute after exit)."""


# Process-wide state. Global, not thread-local: the autograd engine may run a checkpointed layer's
# recompute on another thread (one per device).
_LOCK = threading.RLock()
_BOUND: dict[Any, _Layer] = {}  # MoE block module -> its binding while a context is open
_RECOMPUTE_GUARD: weakref.WeakSet[Any] = weakref.WeakSet()  # blocks last run under a replay that closed
_AUX: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}  # id(router logits) -> experts used
# (block class, id(config), logits dtype, hidden dtype, device) -> the config: formula verified
_FORMULA_CHECKED: dict[tuple, weakref.ref[Any]] = {}


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# =======================================================================================
# the patched block forward and load-balancing loss


def block_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``<Family block>.forward`` with the plugin installed (see the module docstring)."""
    if _BOUND:
        layer = _BOUND.get(instance)
        if layer is not None:
            return layer.call(wrapped, args, kwargs)
    if _RECOMPUTE_GUARD and instance in _RECOMPUTE_GUARD:
        if _in_backward():
            raise ReplayStateError(
                f"a checkpointed MoE layer ({type(instance).__name__}) is being recomputed in backward after the "
                "replay_routes context of its forward closed: the recompute would route with the model's own "
                "router, not the replayed experts; call backward() inside the context"
            )
        _RECOMPUTE_GUARD.discard(instance)  # a new forward: nothing of the replayed one is pending
    return wrapped(*args, **kwargs)


def load_balancing_loss_func(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """The family's ``load_balancing_loss_func``: counted over the replayed experts when the router
    logits come from a forward under ``replay_routes(..., aux_loss="replayed")``."""
    if not _AUX:
        return wrapped(*args, **kwargs)
    bound = _signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    values = list(bound.arguments.values())
    gate_logits = values[0]
    if not isinstance(gate_logits, tuple) or not gate_logits:
        return wrapped(*args, **kwargs)
    used = []
    for logits in gate_logits:
        entry = _AUX.get(id(logits))
        used.append(entry[1] if entry is not None and entry[0]() is logits else None)
    if all(u is None for u in used):
        return wrapped(*args, **kwargs)  # another model's (or a forward without replayed aux loss)
    if any(u is None for u in used):
        missing = [i for i, u in enumerate(used) if u is None]
        raise ReplayStateError(
            f"load_balancing_loss_func got {len(used)} router logits, {len(missing)} of them (positions {missing[:5]}) "
            "not from the replayed forward: cannot count the replayed experts"
        )
    arguments = bound.arguments
    return load_balancing_loss(
        gate_logits,
        used,
        int(arguments.get("num_experts") or values[1]),
        int(arguments.get("top_k") or values[2]),
        arguments.get("attention_mask"),
    )


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _signature(fn: Any) -> inspect.Signature:
    sig = _SIGNATURES.get(fn)
    if sig is None:
        sig = _SIGNATURES[fn] = inspect.signature(fn)
    return sig


# =======================================================================================
# per-layer binding and per-call interception


class _Layer:
    """One MoE block bound to the open contexts (at most one replay and one recording)."""

    def __init__(self, found: MoeBlock, scan: MoeModel) -> None:
        self.block, self.index, self.path = found.block, found.index, found.path
        self.router, self.experts = found.router, found.experts
        self.family, self.config, self.logits_index = scan.family, scan.config, scan.logits_index
        self.replay: RouteReplay | None = None
        self.recording: RouteRecording | None = None
        self.forward_calls = 0  # calls outside backward while the current replay is bound

    def describe(self) -> str:
        return f"layer {self.index} ({self.path}, {type(self.block).__name__})"

    def call(self, wrapped: Any, args: tuple, kwargs: dict) -> Any:
        backward = _in_backward()
        if self.replay is not None:
            if backward and self.forward_calls == 0:
                raise ReplayStateError(
                    f"{self.describe()} is recomputed in backward inside a replay_routes context that did not run "
                    "its forward: it would replay this context's routes for another forward's tokens"
                )
            if not backward:
                self.forward_calls += 1
        hidden = args[0] if args else next(iter(kwargs.values()))
        frame = _Call(self, tuple(hidden.shape[:-1]), backward)
        on_router = self.router.register_forward_hook(frame.on_router)
        # prepend: hooks of others on the experts module (spies, profilers) see what the experts get
        on_experts = self.experts.register_forward_pre_hook(frame.on_experts, with_kwargs=True, prepend=True)
        try:
            out = wrapped(*args, **kwargs)
        finally:
            on_experts.remove()
            on_router.remove()
        frame.finish()
        return out


class _Call:
    """One call of a bound block: the router's logits, then the experts' inputs."""

    def __init__(self, layer: _Layer, token_shape: tuple[int, ...], backward: bool) -> None:
        self.layer, self.token_shape, self.backward = layer, token_shape, backward
        self.logits: torch.Tensor | None = None
        self.experts_called = False

    def on_router(self, module: Any, args: Any, output: Any) -> None:
        layer = self.layer
        if self.logits is not None:
            raise UnsupportedModelError(
                "model",
                f"{layer.describe()} called its router {layer.family.router!r} twice in one forward",
                expected="one router call per MoE block call, as transformers' families do",
            )
        experts = layer.family.num_experts(layer.config)
        if isinstance(output, torch.Tensor):
            logits = output
        elif isinstance(output, (tuple, list)) and layer.logits_index is not None:
            logits = output[layer.logits_index]
        elif isinstance(output, (tuple, list)):
            # No OutputRecorder index declared (deepseek_v3, glm4_moe, granitemoe in 5.16-5.19):
            # the logits are the one floating-point [N, E] element (weights are [N, K], K < E).
            found = [
                x
                for x in output
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() == 2 and x.shape[-1] == experts
            ]
            if len(found) != 1:
                raise UnsupportedModelError(
                    "model",
                    f"{layer.describe()}: router {type(module).__name__} returned {len(output)} values, "
                    f"{len(found)} of them [N, {experts}] floating-point",
                    expected="exactly one router logits tensor",
                )
            logits = found[0]
        else:
            raise UnsupportedModelError(
                "model",
                f"{layer.describe()}: router {type(module).__name__} returned {type(output).__name__}",
                expected="the router logits [N, E], alone or in a tuple",
            )
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[-1] != experts:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise UnsupportedModelError(
                "model",
                f"{layer.describe()}: router output {got} is not [tokens, {experts}] logits",
                expected=f"[N, {experts}] router logits",
            )
        self.logits = logits

    def on_experts(self, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        layer = self.layer
        if self.logits is None or self.experts_called:
            what = "before its router" if self.logits is None else "twice"
            raise UnsupportedModelError(
                "model",
                f"{layer.describe()} called its experts {what} in one forward",
                expected="router, then experts, once each per MoE block call",
            )
        self.experts_called = True
        hidden, index, weights, rebuild = _experts_inputs(module, args, kwargs)
        tokens = int(np.prod(self.token_shape)) if self.token_shape else 1
        if index.dim() != 2 or index.shape[0] != tokens or weights.shape != index.shape:
            raise UnsupportedModelError(
                "model",
                f"{layer.describe()}: experts got ids {tuple(index.shape)} and weights {tuple(weights.shape)} "
                f"for {tokens} tokens",
                expected=f"[{tokens}, K] expert ids and weights",
            )
        used = index
        result = None
        replay = layer.replay
        if replay is not None:
            routes, mask = replay.layer_rows(layer, self.token_shape, index.device)
            used = routes if mask is None else torch.where(mask.unsqueeze(1), index, routes)
            new_weights = layer.family.weights(self.logits, used, hidden.dtype, layer.config)
            key = (type(layer.block), id(layer.config), self.logits.dtype, hidden.dtype, self.logits.device)
            checked = _FORMULA_CHECKED.get(key)
            if checked is None or checked() is not layer.config:
                _check_formula(layer, self.logits, index, weights, hidden.dtype)
                _FORMULA_CHECKED[key] = weakref.ref(layer.config)
            if mask is not None:
                new_weights = torch.where(mask.unsqueeze(1), weights, new_weights)
            result = rebuild(used, new_weights)
            if replay.aux_loss == "replayed" and not self.backward:
                with _LOCK:
                    _AUX[id(self.logits)] = (weakref.ref(self.logits), used.detach())
                    replay._aux_ids.append(id(self.logits))
        if layer.recording is not None and not self.backward:
            layer.recording._store(layer.index, used.detach(), self.token_shape)
        return result

    def finish(self) -> None:
        if self.logits is None or not self.experts_called:
            missing = "router" if self.logits is None else "experts"
            raise UnsupportedModelError(
                "model",
                f"{self.layer.describe()} never called its {missing} module: its routing happens elsewhere, "
                "replay would not reach the experts",
                expected="the family's stock block forward",
            )


def _experts_inputs(module: Any, args: tuple, kwargs: dict) -> tuple:
    """``(hidden, index, weights, rebuild)`` of an experts call; ``rebuild(index, weights)`` gives
    the ``(args, kwargs)`` a forward pre-hook returns."""
    if len(args) >= 3 and not kwargs:
        return args[0], args[1], args[2], lambda i, w: ((args[0], i, w, *args[3:]), kwargs)
    sig = _signature(type(module).forward)
    bound = sig.bind(module, *args, **kwargs)
    names = list(sig.parameters)[1:4]
    values = [bound.arguments[n] for n in names]

    def rebuild(i: torch.Tensor, w: torch.Tensor) -> tuple[tuple, dict]:
        bound.arguments[names[1]], bound.arguments[names[2]] = i, w
        return tuple(bound.args[1:]), dict(bound.kwargs)

    return values[0], values[1], values[2], rebuild


def _check_formula(
    layer: _Layer, logits: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, hidden_dtype: torch.dtype
) -> None:
    """The family formula must give the model's own weights for the model's own experts."""
    with torch.no_grad():
        mine = layer.family.weights(logits.detach(), index, hidden_dtype, layer.config)
    if mine.dtype != weights.dtype or not torch.allclose(mine.float(), weights.detach().float(), rtol=1e-3, atol=1e-6):
        import transformers

        worst = float((mine.float() - weights.detach().float()).abs().max()) if mine.shape == weights.shape else None
        raise UnsupportedModelError(
            "model",
            f"{layer.describe()}: on transformers {transformers.__version__} the {layer.family.model_type} "
            f"router weights its own experts differently from the plugin's formula ({weights.dtype} vs {mine.dtype}, "
            f"max difference {worst}); replayed weights would be wrong",
            expected="a transformers version whose routing the plugin reproduces (compat_matrix.yaml)",
        )


# =======================================================================================
# the context managers


class _Context:
    def __init__(self, model: Any) -> None:
        self._model = model
        self._scan = MoeModel(model)
        self._bound: list[_Layer] = []
        self._hooks: list[Any] = []
        self._ran: set[int] = set()

    @property
    def layers(self) -> tuple[int, ...]:
        """Decoder-layer indices of the MoE layers (the rows of the other layers are not routes)."""
        return self._scan.moe_layers

    def _bind(self, slot: str) -> None:
        with _LOCK:
            try:
                for found in self._scan.blocks:
                    current = _BOUND.get(found.block)
                    if current is None:
                        _BOUND[found.block] = current = _Layer(found, self._scan)
                    if getattr(current, slot) is not None:
                        raise ReplayStateError(
                            f"{current.describe()} is already bound to an open "
                            f"{type(getattr(current, slot)).__name__}; contexts of one kind do not nest"
                        )
                    setattr(current, slot, self)
                    self._bound.append(current)
            except BaseException:
                self._unbind(slot)
                raise
        self._hooks = [
            self._model.register_forward_pre_hook(self._before_forward),
            self._model.register_forward_hook(self._after_forward),
        ]

    def _unbind(self, slot: str) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        with _LOCK:
            for layer in self._bound:
                if getattr(layer, slot) is self:
                    setattr(layer, slot, None)
                if layer.replay is None and layer.recording is None and _BOUND.get(layer.block) is layer:
                    del _BOUND[layer.block]
            self._bound = []

    def _before_forward(self, module: Any, args: Any) -> None:
        self._ran = set()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        missing = [index for index in self._scan.moe_layers if index not in self._ran]
        if missing:
            raise UnsupportedModelError(
                "model",
                f"MoE layers {missing[:8]} did not run through the plugin's {self._scan.family.block} wrapper "
                "in this forward: their routing happened elsewhere",
                expected="every MoE block called through its forward",
            )


class RouteRecording(_Context):
    """``with record_routes(model) as rec: model(...)``; afterwards ``rec.routes`` is an int64
    tensor ``[*tokens, L, K]`` (``tokens`` = the leading shape of the hidden states the MoE blocks
    got, ``[B, S]`` or ``[1, nnz]``; ``L = config.num_hidden_layers``) holding, for the last forward
    inside the context, the expert ids each token's experts module received per MoE layer (the
    replayed ids under :func:`replay_routes`). Rows of dense layers hold ``[0, 1, ..., K-1]``
    (``rec.layers`` lists the MoE layers). None if no forward ran."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.routes: torch.Tensor | None = None
        self._rows: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}

    def _store(self, index: int, used: torch.Tensor, token_shape: tuple[int, ...]) -> None:
        self._rows[index] = (token_shape, used)
        self._ran.add(index)

    def __enter__(self) -> RouteRecording:
        self.routes = None
        self._rows = {}
        self._bind("recording")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._unbind("recording")
        if self._rows and exc[0] is None:
            self.routes = self._assemble()

    def _assemble(self) -> torch.Tensor:
        shapes = {shape for shape, _ in self._rows.values()}
        if len(shapes) != 1:
            raise ReplayStateError(f"the MoE layers' last forwards saw different token shapes {sorted(shapes)}")
        (shape,) = shapes
        first = next(iter(self._rows.values()))[1]
        k = int(first.shape[-1])
        out = torch.arange(k, device=first.device).expand(*shape, self._scan.num_layers, k).clone()
        for index, (_, used) in self._rows.items():
            out[..., index, :] = used.reshape(*shape, k)
        return out


RoutesLike: TypeAlias = "np.ndarray | torch.Tensor"


class RouteReplay(_Context):
    """The context :func:`replay_routes` returns: every forward inside it (and the recompute of
    checkpointed layers in backward) routes each token to the given experts."""

    def __init__(
        self,
        model: Any,
        routes: RoutesLike,
        router_padding_mask: Any | None,
        *,
        indices: Any | None,
        layout: Any | None,
        sp_group: Any | None,
        aux_loss: str,
    ) -> None:
        super().__init__(model)
        if aux_loss not in ("model", "replayed"):
            raise ReplayDataError("aux_loss", f"got {aux_loss!r}", expected="'model' or 'replayed'")
        if aux_loss == "replayed" and not self._scan.family.aux_loss:
            raise ReplayDataError(
                "aux_loss",
                f"'replayed' for {self._scan.family.model_type}, whose Hugging Face model computes no "
                "load-balancing loss",
                expected="'model'",
            )
        self.aux_loss = aux_loss
        self._aux_ids: list[int] = []
        scan = self._scan
        r, mask = check_routes(routes, router_padding_mask, scan)
        r, mask = to_model_layout(r, mask, indices=indices, layout=layout, sp_group=sp_group, topk=scan.top_k)
        device = device_of(model)
        self.routes = r.to(device)  # compact dtype, [*tokens, L, K]
        self.router_padding_mask = None if mask is None else mask.to(device)
        self._token_shape = tuple(self.routes.shape[:-2])
        self._flat_mask = None if self.router_padding_mask is None else self.router_padding_mask.reshape(-1)
        if self._flat_mask is not None and not bool(self._flat_mask.any()):
            self._flat_mask = None  # nothing falls back: skip the per-layer where

    def layer_rows(
        self, layer: _Layer, token_shape: tuple[int, ...], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[N, K]`` int64 routes of ``layer`` for a call on ``token_shape`` and the ``[N]`` mask."""
        self._ran.add(layer.index)
        if token_shape != self._token_shape:
            raise ReplayDataError(
                "routes",
                f"{layer.describe()} got tokens of shape {list(token_shape)}, the routes cover "
                f"{list(self._token_shape)}",
                expected="routes in the layout the model sees (indices= for remove-padding, "
                "sp_group= for Ulysses, or routes already laid out like input_ids)",
            )
        rows = self.routes[..., layer.index, :].reshape(-1, self.routes.shape[-1]).to(device=device, dtype=torch.long)
        mask = None if self._flat_mask is None else self._flat_mask.to(device)
        return rows, mask

    def __enter__(self) -> RouteReplay:
        self._bind("replay")
        for layer in self._bound:
            layer.forward_calls = 0
            _RECOMPUTE_GUARD.discard(layer.block)
        return self

    def __exit__(self, *exc: Any) -> None:
        ran = [layer for layer in self._bound if layer.replay is self and layer.forward_calls]
        self._unbind("replay")
        for layer in ran:
            _RECOMPUTE_GUARD.add(layer.block)
        with _LOCK:
            for key in self._aux_ids:
                _AUX.pop(key, None)
            self._aux_ids = []


# =======================================================================================
# public API


def record_routes(model: Any) -> RouteRecording:
    """A context manager recording the experts each token's MoE layers used in the last forward
    inside it; see :class:`RouteRecording`.

    Raises:
        UnsupportedModelError: the model cannot be replayed (see :func:`replay_routes`).
    """
    return RouteRecording(model)


def replay_routes(
    model: Any,
    routes: RoutesLike,
    router_padding_mask: Any | None = None,
    *,
    indices: Any | None = None,
    layout: Any | None = None,
    sp_group: Any | None = None,
    aux_loss: str = "model",
) -> RouteReplay:
    """A context manager under which every forward of ``model`` (and the recompute of checkpointed
    layers in backward: run ``backward()`` inside it) sends each token to the recorded experts.

    Args:
        model: a Hugging Face MoE model of a supported family (``replay_plugin.fsdp.hf_moe.FAMILIES``),
            possibly wrapped by FSDP/FSDP2/PEFT.
        routes: expert ids ``[*tokens, L, K]``, any integer dtype (numpy or torch; kept compact, one
            layer at a time widened to int64 on the model's device), ``L = config.num_hidden_layers``
            (rows of dense layers are ignored), ``K`` the top-k. ``tokens`` is the batch grid
            ``[B, S]`` (``core.routes.pad_batch``) when ``indices``/``layout`` is given; otherwise
            the leading shape of the model's ``input_ids`` as called, after the caller's own
            remove-padding / packing / Ulysses slicing (e.g. routes partitioned with verl's
            ``ulysses_pad_and_slice_inputs``: the plugin's ``ulysses.nd_partition`` handles
            ``[1, nnz, L, K]``).
        router_padding_mask: bool, the leading shape of ``routes``; True where no route was
            recorded (padding, a synthetic EOS's source token): those tokens are routed by the
            model itself. None: every token is replayed.
        indices: ``[nnz]`` remove-padding indices into the flattened ``[B * S]`` batch
            (``unpad_input``'s): the model sees ``[1, nnz]``.
        layout: a :class:`replay_plugin.core.layout.TokenMetadataLayout` (packed sequences or
            aligned rows) instead of ``indices``.
        sp_group: the Ulysses sequence-parallel group: after the above, dim 1 is padded to a
            multiple of the SP size (padding routed by the model) and this rank keeps its part.
        aux_loss: ``"model"`` (default): the family's load-balancing loss counts the model's own
            top-k of the router logits, as upstream does; ``"replayed"``: it counts the experts the
            tokens were sent to.

    Returns:
        A :class:`RouteReplay` (use it in a ``with`` statement; nothing stays bound after exit).

    Raises:
        UnsupportedModelError: unknown family or remote-code classes, a replaced block forward
            (hub kernels, mxfp4), the family patch not applied.
        ReplayDataError / ReplayTypeError: routes of the wrong shape or dtype (naming the
            expected ``[L, K]``), an expert id out of range or repeated (naming layer, trajectory
            and token), a mask of the wrong shape; at call time, routes whose token shape differs
            from what a layer receives (naming the layer).
    """
    return RouteReplay(
        model, routes, router_padding_mask, indices=indices, layout=layout, sp_group=sp_group, aux_loss=aux_loss
    )


def bound_layers() -> Iterator[tuple[str, int]]:
    """``(path, layer)`` of every MoE block bound right now (diagnostics and tests)."""
    with _LOCK:
        return iter([(layer.path, layer.index) for layer in _BOUND.values()])
