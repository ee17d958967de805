"""Patches ``trl.replay_guard`` and ``trl.unwired_trainers``: a TRL job whose switch asks for a
replay the plugin cannot make exact is refused when its trainer is built, naming the setting and
the fix.

Gap (trl 1.16.0): stock TRL ignores the switch (``GRPOConfig.generation_kwargs["extra_args"]``,
``switch.py``) without a word on every generation backend, so a job whose replay patches are off,
outside their version range or failed to apply, or one on a path the plugin does not serve, would
train on full-vocabulary log-probs (and its own routes) while its config says otherwise.

Wraps ``GRPOTrainer.__init__`` (after TRL's own checks). With the switch set, refused:

- sample support: ``temperature`` / ``top_k`` / ``repetition_penalty`` in ``generation_kwargs``
  other than GRPOConfig's (TRL's backends give the sampler the dict's value, its trainer scores at
  GRPOConfig's temperature), ``top_k <= 1`` (the rows hold ``top_k + slack`` ids: an unbounded support
  has nothing to replay, ``top_k=1`` is greedy), ``repetition_penalty != 1`` (it changes the
  sampler's values, which the trainer's logits do not carry), a model whose LM head the plugin's
  hidden-state path cannot reproduce (``final_logit_softcapping``, a logit scale, an LM-head
  bias), DeepSpeed ZeRO-3 (the LM head is partitioned; untested);
- routes on HF generate (``use_vllm=False``: ``generate`` returns no routed experts), or with a
  ``REPLAY_PLUGIN_TRL_ROUTER_AGREEMENT`` other than ``0`` / ``1`` (``trl.routes``' knob);
- either: tools / ``environment_factory`` (multi-turn concatenation with tool tokens),
  ``rollout_func`` (its completions bypass the backends the plugin reads), transformers'
  continuous batching, vision-language models (per-chunk pixel slicing: not wired);
- a patch the job needs that is not applied in this process (switched off, version outside the
  matrix, failed): named with its toggle.

Patch ``trl.unwired_trainers`` (same module) wraps ``RLOOTrainer.__init__``: RLOOConfig takes the
same ``generation_kwargs``, and the pack wires GRPOTrainer only, so an RLOO job with the switch set
is refused naming the trainer. (TRL's
experimental ``AsyncGRPOTrainer`` has no ``generation_kwargs``: the switch cannot be set there.)

Without the switch nothing is checked: stock TRL, byte for byte.
"""

from __future__ import annotations

from typing import Any

from ..patcher import Patcher
from . import switch

SUPPORT_PATCHES = ("trl.rollout_batch", "trl.support_logprobs")
HF_SUPPORT_PATCHES = ("trl.hf_sampler_rows", "trl.hf_warped_scores")
#: vLLM rollouts (helper pack rows: the colocate / server capture and the engine arguments)
VLLM_PATCHES = ("trl.vllm_engine_args", "trl.vllm_rows")
ROUTES_PATCHES = ("trl.rollout_batch", "trl.routes")


def _refuse(setting: str, message: str, value: Any = None) -> None:
    from ..core.errors import NotReplayable

    raise NotReplayable(setting, f"{message} ({switch.WHERE} asks for a replay)", value=value)


def _unapplied(patch: str) -> str | None:
    """None when ``patch`` is applied in this process, else its state (and reason)."""
    from .. import states

    st = states.get(patch)
    if st is not None and st.state == "applied":
        return None
    if st is None:
        return "not registered"
    return f"{st.state} ({st.reason})" if st.reason else st.state


def needed_patches(trainer: Any, ask: switch.Ask) -> list[str]:
    """The patches ``trainer``'s job needs for what it asks, in order, without duplicates."""
    needed: list[str] = []
    if ask.support:
        needed += SUPPORT_PATCHES
        needed += VLLM_PATCHES if getattr(trainer, "use_vllm", False) else HF_SUPPORT_PATCHES
    if ask.routes:
        needed += ROUTES_PATCHES
        if getattr(trainer, "use_vllm", False):
            needed += VLLM_PATCHES
    return list(dict.fromkeys(needed))


def _text_config(model: Any) -> Any:
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _check_head(model: Any) -> None:
    """The LM head must be what ``support_logprobs_from_hidden`` computes: ``hidden @ W.T / T``."""
    text = _text_config(model)
    softcap = getattr(text, "final_logit_softcapping", None)
    if softcap is not None:
        _refuse(
            "final_logit_softcapping",
            f"the model's logits are soft-capped ({softcap}): the plugin's support log-probs project the hidden "
            "states without the cap, so the trainer's values would not be the sampler's; use a model without it",
            softcap,
        )
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        scale = getattr(text, name, None)
        if scale is not None and float(scale) != 1.0:
            _refuse(
                name,
                f"the model scales its logits ({name}={scale}): the plugin's support log-probs project the hidden "
                "states without the scale; use a model without it",
                scale,
            )
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is not None and getattr(head, "bias", None) is not None:
        _refuse(
            "lm_head.bias",
            "the model's LM head has a bias, which the plugin's support log-probs (hidden states times the head's "
            "weight) do not add; use a model without it",
        )


#: sampler settings TRL's backends take from ``generation_kwargs`` over GRPOConfig's (every
#: backend applies the dict last), while the trainer and this guard read GRPOConfig's
_OVERRIDABLE = ("temperature", "top_k", "repetition_penalty")


def _check_overrides(trainer: Any) -> None:
    """``generation_kwargs`` overriding ``temperature`` / ``top_k`` / ``repetition_penalty`` for the
    sampler only: TRL's trainer scores at ``GRPOConfig.temperature`` (the support log-probs would be
    taken at another temperature than the tokens were sampled at: silently wrong), and the checks
    below read GRPOConfig's values."""
    kwargs = getattr(trainer.args, "generation_kwargs", None) or {}
    for name in _OVERRIDABLE:
        if name in kwargs and kwargs[name] != getattr(trainer.args, name, None):
            _refuse(
                name,
                f"generation_kwargs[{name!r}]={kwargs[name]!r} overrides GRPOConfig.{name}="
                f"{getattr(trainer.args, name, None)!r} for the sampler only (TRL's trainer and the plugin read "
                f"GRPOConfig's): set {name} in GRPOConfig, not in generation_kwargs",
                kwargs[name],
            )


def check(trainer: Any) -> switch.Ask:
    """Refuse (``NotReplayable``) a ``GRPOTrainer`` whose switch asks for what cannot be exact."""
    ask = switch.asked(trainer.args)
    if not ask.any:
        return ask
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None) is not None:
        _refuse(
            "tools",
            "GRPOTrainer with tools or environment_factory interleaves tool output with the completion; the plugin "
            "replays single-turn completions only: drop the tools or the switch",
        )
    if getattr(trainer, "rollout_func", None) is not None:
        _refuse(
            "rollout_func",
            "a rollout_func generates outside the backends the plugin captures (its extra fields reach the reward "
            "functions, not the batch): drop rollout_func or the switch",
        )
    if getattr(trainer, "use_transformers_continuous_batching", False):
        _refuse(
            "use_transformers_continuous_batching",
            "transformers' continuous batching (generate_batch) has no logits-processor seam the plugin reads: set "
            "use_transformers_continuous_batching=False",
            True,
        )
    if getattr(trainer, "_is_vlm", False):
        _refuse(
            "processing_class",
            "vision-language models are not wired (multimodal inputs are sliced per chunk by TRL): use a text model "
            "or drop the switch",
        )
    if ask.routes:
        from .routes import router_agreement_on

        router_agreement_on()  # a bad REPLAY_PLUGIN_TRL_ROUTER_AGREEMENT now, not after the first generation
    if ask.routes and not getattr(trainer, "use_vllm", False):
        _refuse(
            "use_vllm",
            "replay_routed_experts with HF generate (use_vllm=False): transformers' generate returns no routed "
            "experts; use vLLM colocate (use_vllm=True) or drop replay_routed_experts",
            False,
        )
    if ask.support:
        _check_overrides(trainer)
        top_k = getattr(trainer, "top_k", None)
        if top_k is None or int(top_k) <= 1:
            _refuse(
                "top_k",
                f"sample-support replay needs a bounded support of at least two tokens: GRPOConfig.top_k is {top_k} "
                "(0: unbounded, the rows would have to hold the vocabulary; 1: greedy); set top_k >= 2",
                top_k,
            )
        penalty = getattr(trainer, "repetition_penalty", 1.0)
        if penalty is not None and float(penalty) != 1.0:
            _refuse(
                "repetition_penalty",
                f"repetition_penalty={penalty} changes the sampler's logits, which the trainer does not reproduce "
                "(its support log-probs would not be the sampler's); set repetition_penalty=1.0",
                penalty,
            )
        _check_head(getattr(trainer.accelerator, "unwrap_model", lambda m: m)(trainer.model))
        ds = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
        if ds is not None and getattr(ds, "zero_stage", 0) == 3:
            _refuse(
                "deepspeed",
                "DeepSpeed ZeRO-3 partitions the LM head the plugin's support log-probs read (untested): use ZeRO "
                "<= 2 or FSDP",
                3,
            )
    from ..spec import toggle_name

    for patch in needed_patches(trainer, ask):
        off = _unapplied(patch)
        if off is not None:
            _refuse(
                toggle_name(patch),
                f"patch {patch}, which this job needs, is {off}: the job would train without the replay it asks "
                f"for. Enable it ({toggle_name(patch)}=1, a supported trl version)",
                off,
            )
    return ask


def _guarded(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    check(instance)
    return result


def check_unwired(trainer: Any) -> None:
    """Refuse a trainer the pack does not wire (``RLOOTrainer``: its config takes the same
    ``generation_kwargs``, and stock TRL ignores the switch there too) whose switch is set."""
    if switch.asked(trainer.args).any:
        name = type(trainer).__name__
        _refuse(
            "trainer",
            f"{name} is not wired by the plugin (GRPOTrainer is): its log-probs would stay TRL's full-vocabulary "
            f"ones and its routes its own; use GRPOTrainer or drop the switch",
            name,
        )


def _unwired(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    check_unwired(instance)
    return result


def install(patcher: Patcher) -> None:
    patcher.wrap("GRPOTrainer.__init__", _guarded)


def install_unwired(patcher: Patcher) -> None:
    """Patch ``trl.unwired_trainers``."""
    patcher.wrap("RLOOTrainer.__init__", _unwired)
