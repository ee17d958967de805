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
an unknown ``model_type``, a remote-code model class, a block whose forward was replaced (hub
kernels, ``Mxfp4GptOssExperts``' ``mlp_forward``), a router or experts module that is not called
exactly once per block call, weights that the family formula does not reproduce on the model's
own routes (checked once per block class, config and dtype in a process), the patch not applied, a
block not run in a forward, a checkpointed layer recomputed after its context closed (run
``backward`` inside it).

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

from .. import states
from ..core.errors import ReplayDataError, ReplayTypeError
from ..patcher import patch_marker
from .hf_moe import FAMILIES, Family, family_of, load_balancing_loss

__all__ = [
    "ReplayStateError",
    "RouteRecording",
    "RouteReplay",
    "UnsupportedModelError",
    "record_routes",
    "replay_routes",
]


class UnsupportedModelError(ReplayDataError):
    """A model, family or kernel path under which routed-expert replay would not reach the experts."""


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
    """One MoE block of a model bound to the open contexts."""

    def __init__(
        self,
        block: Any,
        index: int,
        path: str,
        family: Family,
        router: Any,
        experts: Any,
        config: Any,
        logits_index: int | None,
    ) -> None:
        self.block, self.index, self.path, self.family = block, index, path, family
        self.router, self.experts, self.config, self.logits_index = router, experts, config, logits_index
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
# finding the MoE layers of a model


class _Model:
    """The MoE layers of a model and what replay needs to know about them."""

    def __init__(self, model: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ReplayTypeError(
                "model", f"got {type(model).__name__}", expected="a torch.nn.Module (a Hugging Face model)"
            )
        root = _pretrained_root(model)
        config = root.config
        model_type = getattr(config, "model_type", None)
        family = family_of(model_type)
        if family is None:
            raise UnsupportedModelError(
                "model",
                f"model type {model_type!r} ({type(root).__name__}) is not a supported MoE family",
                expected=f"one of {', '.join(sorted(FAMILIES))}",
            )
        self.family, self.config, self.root = family, config, root
        self.num_layers = int(config.num_hidden_layers)
        self.num_experts = family.num_experts(config)
        self.top_k = family.top_k(config)
        _ensure_patch(family)
        import sys

        block_cls = getattr(sys.modules.get(family.module), family.block, None)
        recorder = (getattr(type(root), "_can_record_outputs", None) or {}).get("router_logits")
        logits_index = getattr(recorder, "index", None)
        layers: list[_Layer] = []
        for name, module in model.named_modules():
            if block_cls is None or not isinstance(module, block_cls):
                if isinstance(getattr(module, family.experts, None), torch.nn.Module):
                    _refuse_foreign_block(module, name, family)
                continue
            index = _layer_index(model, name, self.num_layers)
            router = getattr(module, family.router, None)
            experts = getattr(module, family.experts, None)
            if not isinstance(router, torch.nn.Module) or not isinstance(experts, torch.nn.Module):
                import transformers

                raise UnsupportedModelError(
                    "model",
                    f"{name} ({type(module).__name__}) on transformers {transformers.__version__} has no "
                    f"{family.router!r} router and {family.experts!r} experts modules taking expert ids (granitemoe "
                    "before 5.16 dispatches through GraniteMoeTopKGating)",
                    expected="a transformers version where the block calls experts(hidden, top_k_index, top_k_weights)",
                )
            _check_forward(module, name, family)
            layers.append(_Layer(module, index, name, family, router, experts, config, logits_index))
        if not layers:
            raise UnsupportedModelError(
                "model",
                f"{type(root).__name__} ({model_type}) has no {family.block} from {family.module} (a remote-code "
                "model class, or no MoE layer at all)",
                expected=f"transformers' own {family.block} blocks",
            )
        seen: dict[int, str] = {}
        for layer in layers:
            if layer.index in seen:
                raise UnsupportedModelError(
                    "model",
                    f"{seen[layer.index]} and {layer.path} share decoder layer {layer.index}",
                    expected="one MoE block per decoder layer",
                )
            seen[layer.index] = layer.path
        self.layers = tuple(sorted(layers, key=lambda x: x.index))
        self.moe_layers = tuple(x.index for x in self.layers)


def _pretrained_root(model: Any) -> Any:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "model_type") and hasattr(config, "num_hidden_layers"):
            return module
    raise UnsupportedModelError(
        "model",
        f"{type(model).__name__} holds no Hugging Face model (no submodule with a config)",
        expected="a transformers PreTrainedModel, possibly wrapped (FSDP, PEFT)",
    )


def _layer_index(model: Any, name: str, num_layers: int) -> int:
    """The decoder-layer index in ``name``: the last number whose parent is a ModuleList of
    ``num_hidden_layers`` entries (``model.layers.3.mlp``, ``transformer.blocks.3.ffn``; FSDP1
    and PEFT wrappers insert path components, not list levels)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            parent = model.get_submodule(".".join(parts[:i]))
            if isinstance(parent, torch.nn.ModuleList) and len(parent) == num_layers:
                return int(parts[i])
    raise UnsupportedModelError(
        "model",
        f"MoE block {name} is not inside a list of {num_layers} decoder layers",
        expected="<...>.layers.<i>.<...> with config.num_hidden_layers layers",
    )


def _ensure_patch(family: Family) -> None:
    st = states.get(family.patch)
    if st is None or st.state != "applied":
        import replay_plugin

        replay_plugin.activate()  # where no .pth ran (python -S): applies the patches of imported modules
        st = states.get(family.patch)
    if st is None or st.state != "applied":
        state, reason = (st.state, st.reason) if st is not None else ("not registered", "")
        raise UnsupportedModelError(
            "model",
            f"patch {family.patch} is {state}{': ' + reason if reason else ''}; without it the "
            f"{family.model_type} blocks route themselves",
            expected=f"the patch applied (replay-plugin status --import {family.module})",
        )


def _refuse_foreign_block(module: Any, name: str, family: Family) -> None:
    """A module holding experts that is not the family's block routes on its own (transformers
    5.24 swaps ``GptOssMLP`` for ``Mxfp4GptOssMLP`` with mxfp4 weights)."""
    raise UnsupportedModelError(
        "model",
        f"{name} is a {type(module).__module__}.{type(module).__qualname__} holding experts, not the "
        f"{family.block} the plugin wraps: it routes on its own (quantized or kernel MoE layers) and replay would not "
        "reach its experts",
        expected=f"transformers' {family.block} in every MoE layer (mxfp4 dequantized)",
    )


def _check_forward(block: Any, name: str, family: Family) -> None:
    forward = inspect.getattr_static(block, "forward")
    if patch_marker(forward) == family.patch:
        return
    target = getattr(forward, "__func__", forward)
    where = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    own = "an instance attribute" if "forward" in vars(block) else f"class {type(block).__qualname__}"
    raise UnsupportedModelError(
        "model",
        f"{name} runs {where} ({own}), not the {family.block} forward the plugin wraps: its routing happens "
        "elsewhere (hub kernels such as MegaBlocks, Mxfp4GptOssExperts) and replay would not reach the experts",
        expected=f"transformers' {family.block}.forward (load without use_kernels / mxfp4 dequantized)",
    )


# =======================================================================================
# the context managers


class _Context:
    def __init__(self, model: Any) -> None:
        self._model = model
        self._scan = _Model(model)
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
                for layer in self._scan.layers:
                    current = _BOUND.get(layer.block)
                    if current is None:
                        _BOUND[layer.block] = current = layer
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
        missing = [layer.index for layer in self._scan.layers if layer.index not in self._ran]
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
        r, mask = _check_routes(routes, router_padding_mask, scan)
        r, mask = _to_model_layout(r, mask, indices=indices, layout=layout, sp_group=sp_group, topk=scan.top_k)
        device = _device_of(model)
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
# routes: checks and layouts


def _as_tensor(x: Any, field: str) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise ReplayTypeError(field, f"got {type(x).__name__}", expected="a numpy array or torch tensor")
    return x


def _check_routes(routes: Any, mask: Any, scan: _Model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validated routes (compact dtype kept) and bool mask, in the caller's coordinates."""
    r = _as_tensor(routes, "routes")
    if r.dtype == torch.bool or r.is_floating_point() or r.is_complex():
        raise ReplayTypeError("routes", f"dtype {r.dtype}", expected="integer expert ids (uint8, int16, int32, int64)")
    if r.dim() < 3 or r.shape[-2] != scan.num_layers or r.shape[-1] != scan.top_k:
        raise ReplayDataError(
            "routes",
            f"shape {tuple(r.shape)}",
            expected=f"[*tokens, {scan.num_layers}, {scan.top_k}]: config.num_hidden_layers decoder layers "
            f"(dense ones included, as vLLM returns them) and top-k {scan.top_k}",
        )
    m = None
    if mask is not None:
        m = _as_tensor(mask, "router_padding_mask")
        if m.is_floating_point() or m.is_complex() or tuple(m.shape) != tuple(r.shape[:-2]):
            raise ReplayDataError(
                "router_padding_mask",
                f"{m.dtype} of shape {tuple(m.shape)}",
                expected=f"bool {list(r.shape[:-2])} (True = no recorded route: the model routes the token itself)",
            )
        m = m.to(device=r.device) != 0
    # in the compact dtype (no int64 copy); one reduction on the fast path
    moe = r
    if len(scan.moe_layers) != r.shape[-2]:
        moe = r.index_select(r.dim() - 2, torch.tensor(scan.moe_layers, device=r.device))  # [*tokens, L_moe, K]
    bad = (moe >= scan.num_experts).any(-1)
    if moe.dtype.is_signed:
        bad |= (moe < 0).any(-1)
    srt = moe.sort(dim=-1).values
    dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
    if m is not None:
        keep = ~m.unsqueeze(-1)
        bad, dup = bad & keep, dup & keep
    if not bool((bad | dup).any()):
        return r, m
    for problem, flags, expected in (
        ("expert id out of range", bad, f"ids in [0, {scan.num_experts})"),
        ("the same expert twice", dup, f"{scan.top_k} distinct experts per token and layer"),
    ):
        if bool(flags.any()):
            *where, j = (int(v) for v in flags.nonzero()[0])
            row = moe[tuple(where)][j].tolist()
            trajectory, token = (where[0], where[1]) if len(where) == 2 else (None, where[-1])
            raise ReplayDataError(
                "routes",
                f"{problem} in layer {scan.moe_layers[j]}: {row}",
                trajectory=trajectory,
                token=token,
                expected=expected,
            )
    return r, m


def _to_model_layout(
    routes: torch.Tensor, mask: torch.Tensor | None, *, indices: Any, layout: Any, sp_group: Any, topk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the batch grid ``[B, S, L, K]`` to the layout the model sees: remove-padding
    (``indices``) or a :class:`~replay_plugin.core.layout.TokenMetadataLayout`, then the Ulysses
    slice of dim 1 (padded to a multiple of the SP size, one contiguous part per rank)."""
    if indices is not None and layout is not None:
        raise ReplayDataError("indices", "given together with layout", expected="one of indices= and layout=")
    if indices is not None or layout is not None:
        if routes.dim() != 4:
            raise ReplayDataError(
                "routes", f"shape {tuple(routes.shape)}", expected="[B, S, L, K] with indices=/layout="
            )
        if mask is None:
            mask = torch.zeros(routes.shape[:2], dtype=torch.bool, device=routes.device)
    pad_row = torch.arange(topk, dtype=routes.dtype, device=routes.device)
    if indices is not None:
        idx = _as_tensor(indices, "indices").to(routes.device).long().reshape(-1)
        batch, seq = routes.shape[:2]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= batch * seq):
            raise ReplayDataError("indices", f"values outside [0, {batch * seq})", expected="unpad_input's indices")
        routes = routes.reshape(batch * seq, *routes.shape[2:]).index_select(0, idx).unsqueeze(0)
        assert mask is not None
        mask = mask.reshape(-1).index_select(0, idx).unsqueeze(0)
    elif layout is not None:
        routes = layout.align(routes, pad_row)
        mask = layout.align(mask, True)
    if sp_group is not None:
        sp_size = torch.distributed.get_world_size(sp_group)
        sp_rank = torch.distributed.get_rank(sp_group)
        if sp_size > 1:
            if mask is None:
                mask = torch.zeros(routes.shape[:-2], dtype=torch.bool, device=routes.device)
            routes = _ulysses_slice(routes, sp_size, sp_rank, pad_row)
            mask = _ulysses_slice(mask, sp_size, sp_rank, torch.tensor(True, device=mask.device))
    return routes, mask


def _ulysses_slice(x: torch.Tensor, sp_size: int, sp_rank: int, fill: torch.Tensor) -> torch.Tensor:
    """Pad dim 1 to a multiple of ``sp_size`` with ``fill`` and keep part ``sp_rank`` (verl's and
    skyrl's ``ulysses_pad_and_slice_inputs`` partition)."""
    n = x.shape[1]
    part = -(-n // sp_size)
    padded = torch.empty((x.shape[0], part * sp_size, *x.shape[2:]), dtype=x.dtype, device=x.device)
    padded[:, n:] = fill
    padded[:, :n] = x
    return padded[:, sp_rank * part : (sp_rank + 1) * part].contiguous()


def _device_of(model: Any) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


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
