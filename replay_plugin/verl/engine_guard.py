"""Patch ``verl.engine_replay_guard``: a batch or an engine config asking for a replay reaches an
engine that would not do it, silently.

Gaps (verl 0.9.1 with the plugin):

- Sampler-support replay. The rows (``rollout_sample_support``) ride verl's batch to every engine,
  but only two of verl's engines score over them, through the plugin's patches:
  ``FSDPEngineWithLMHead`` (``verl.fsdp_support_logprobs``) and ``MegatronEngineWithLMHead``
  (``verl.megatron_support_logprobs``). verl's other language-model engines (VeOmni, TorchTitan,
  Automodel, MindSpeed, ...) ignore an unknown batch field, and so do the two supported engines
  when their patch is switched off, is outside its version range or failed to apply: the job would
  train on full-vocabulary log-probs while the user asked for the support's.
- Routed-expert replay on the FSDP engine. verl reads ``router_replay.mode`` for its Megatron and
  VeOmni engines only; on the FSDP engine (``+actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3``)
  the plugin's ``verl.fsdp_routes`` is what replays. With that patch switched off, outside its
  range or failed, verl accepts the key and the routers route for themselves.

The guard wraps ``BaseEngine.infer_batch`` and ``BaseEngine.train_batch``, the two entries every
verl engine inherits (``compute_log_prob``, ``compute_ref_log_prob``, ``update_actor`` and the
critic all go through them). A batch with rows is refused with an error naming the engine and the
fix unless the engine's scoring patch is applied; value-head engines (the critic) score no
log-probs and pass. An FSDP engine whose config asks for router replay is refused unless
``verl.fsdp_routes`` is applied. Everything else is untouched.

The rows of a batch an engine will score are also checked here, the one place before verl splits
the batch into micro-batches (``engine_batch.check_batch_rows``): verl 0.9.1's
``tu.chunk_tensordict`` crashes, untyped, on jagged rows whose lengths are not the responses' (a
strided nested tensor arrives so, re-nested over its row width by ``BatchData.chunk``).
"""

from __future__ import annotations

from typing import Any

from ..patcher import Patcher
from .engine_batch import REPLAY_OFF, check_batch_rows, replay_mode
from .fsdp_engine import FSDP_ENGINE_MODULE
from .switch import BATCH_SUPPORT_KEY, PREFIX, SWITCH

#: (engine module, class name) -> the patch that makes that engine score over the support rows
CONSUMERS = {
    (FSDP_ENGINE_MODULE, "FSDPEngineWithLMHead"): "verl.fsdp_support_logprobs",
    ("verl.workers.engine.megatron.transformer_impl", "MegatronEngineWithLMHead"): "verl.megatron_support_logprobs",
}


def consumer(engine: Any) -> str | None:
    """The patch that scores ``engine``'s batches over the support rows, or None (an engine of
    another module or class, including subclasses that reuse the method: their layout is theirs)."""
    cls = type(engine)
    return CONSUMERS.get((cls.__module__, cls.__name__))


def _value_head(engine: Any) -> bool:
    return "ValueHead" in type(engine).__name__ or bool(getattr(engine, "is_value_model", False))


def check_engine(engine: Any) -> None:
    """Refuse (``NotReplayable``) an engine that would not score a batch with rows over them."""
    from ..core.errors import NotReplayable
    from ..spec import toggle_name

    if _value_head(engine):
        return
    cls = type(engine)
    patch = consumer(engine)
    if patch is None:
        raise NotReplayable(
            "strategy",
            f"the batch carries {BATCH_SUPPORT_KEY} ({PREFIX}{SWITCH}=true) but {cls.__name__} ({cls.__module__}) "
            "scores "
            "over the full vocabulary: the plugin replays the support on verl's FSDP engine (strategy fsdp / fsdp2) "
            "and Megatron engine (strategy megatron); use one of them, or drop the switch",
            value=cls.__name__,
        )
    off = _unapplied(patch)
    if off is None:
        return
    raise NotReplayable(
        toggle_name(patch),
        f"the batch carries {BATCH_SUPPORT_KEY} ({PREFIX}{SWITCH}=true) but patch {patch}, which makes "
        f"{cls.__name__} score over it, is {off[1]}: the engine would score over the full vocabulary. "
        f"Enable the patch ({toggle_name(patch)}=1, a supported verl version), or drop the switch",
        value=off[0],
    )


def _unapplied(patch: str) -> tuple[str, str] | None:
    """None when ``patch`` is applied in this process, else ``(state, "state (reason)")``."""
    from .. import states

    st = states.get(patch)
    if st is not None and st.state == "applied":
        return None
    state, reason = (st.state, st.reason) if st is not None else ("not registered", "")
    return state, f"{state} ({reason})" if reason else state


#: the patch that replays routes on verl's FSDP engine (its module: ``FSDP_ENGINE_MODULE``)
ROUTES_PATCH = "verl.fsdp_routes"


def check_routes(engine: Any) -> None:
    """Refuse (``NotReplayable``) an FSDP engine configured for router replay that the route patch
    will not serve (stock verl ignores the key there)."""
    from ..core.errors import NotReplayable
    from ..spec import toggle_name

    if type(engine).__module__ != FSDP_ENGINE_MODULE:
        return
    mode = replay_mode(engine)
    if mode in REPLAY_OFF:
        return
    off = _unapplied(ROUTES_PATCH)
    if off is None:
        return
    raise NotReplayable(
        toggle_name(ROUTES_PATCH),
        f"router_replay.mode={mode} on verl's FSDP engine ({type(engine).__name__}), where verl does not replay "
        f"routes and patch {ROUTES_PATCH}, which does, is {off[1]}: the routers would route for themselves. "
        f"Enable the patch ({toggle_name(ROUTES_PATCH)}=1, a supported verl version), or set "
        "router_replay.mode=disabled",
        value=off[0],
    )


def _guarded(wrapped, instance, args, kwargs):
    data = args[0] if args else kwargs.get("data")
    if data is not None:
        if BATCH_SUPPORT_KEY in data.keys():
            check_engine(instance)
            if consumer(instance) is not None:
                check_batch_rows(data)  # before verl's chunking, which crashes on rows of the wrong length
        check_routes(instance)
    return wrapped(*args, **kwargs)


def install(patcher: Patcher) -> None:
    patcher.wrap("BaseEngine.infer_batch", _guarded)
    patcher.wrap("BaseEngine.train_batch", _guarded)
