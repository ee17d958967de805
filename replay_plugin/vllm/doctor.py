"""Doctor checks for a vLLM rollout: the plugin's knobs, the engine arguments a job will use
(``replay-plugin doctor --vllm-args "..."``), and what vLLM's Ray executor will not forward."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from . import options

#: (problem, fix)
Finding = tuple[str, str]

PROCESSED = "processed_logprobs"


def check(args: Sequence[str] | str | None, *, top_k: int | None, environ: Mapping[str, str]) -> list[Finding]:
    out = _check_plugins(environ)
    knobs, knob_findings = _read_knobs(environ)
    out += knob_findings
    if args is None or knobs is None:
        return out
    engine = parse_engine_args(args)
    out += _check_engine(engine, knobs, top_k)
    out += _check_ray_executor(engine, environ)
    return out


def _check_plugins(environ: Mapping[str, str]) -> list[Finding]:
    value = environ.get("VLLM_PLUGINS")
    if value is None or "replay_plugin" in [p.strip() for p in value.split(",")]:
        return []
    return [
        (
            f"VLLM_PLUGINS={value!r} excludes 'replay_plugin': vLLM processes that do not process .pth files "
            "will not activate the plugin",
            "add replay_plugin to VLLM_PLUGINS",
        )
    ]


def _read_knobs(environ: Mapping[str, str]) -> tuple[dict | None, list[Finding]]:
    try:
        mode = options.job_mode(environ)
        knobs = {
            "mode": mode,
            "slack": options.job_slack(environ),
            "max_width": options.job_max_width(environ),
            "routes": options.routes_mode(environ),
        }
    except options.OptionError as exc:
        return None, [(str(exc), f"set {exc.key} to a valid value or unset it (docs/reference/environment.md)")]
    return knobs, []


def parse_engine_args(args: Sequence[str] | str) -> Any:
    """vLLM's own ``EngineArgs`` from ``vllm serve``-style arguments (a leading model path is
    taken as ``--model``). Builds no engine and no configuration."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = shlex.split(args) if isinstance(args, str) else list(args)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    if argv and not argv[0].startswith("-"):
        argv = ["--model", *argv]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    namespace, _ = parser.parse_known_args(argv)
    return EngineArgs.from_cli_args(namespace)


def _mode_of(engine: Any) -> str:
    mode = getattr(engine, "logprobs_mode", None)
    return str(getattr(mode, "value", mode))


def _check_engine(engine: Any, knobs: dict, top_k: int | None) -> list[Finding]:
    out = []
    mode, max_logprobs = _mode_of(engine), getattr(engine, "max_logprobs", None)
    requests = options.REQUESTS_ENV
    if not knobs["mode"] and mode != PROCESSED:
        out.append(
            (
                f"{requests} is unset and the engine runs logprobs_mode={mode}: every request that opts into "
                "sample-support capture will be refused",
                f"set {requests}=opt-in before the engine starts (the plugin then fits the engine), or start "
                f"vLLM with --logprobs-mode {PROCESSED}",
            )
        )
    if knobs["mode"]:
        limit = max(knobs["max_width"], max_logprobs) if isinstance(max_logprobs, int) and max_logprobs != -1 else -1
    else:
        limit = max_logprobs if isinstance(max_logprobs, int) else -1
    if top_k is not None and limit != -1 and top_k + knobs["slack"] > limit:
        width = top_k + knobs["slack"]
        fix = (
            f"raise {options.MAX_WIDTH_ENV} to >= {width}"
            if knobs["mode"]
            else f"start vLLM with --max-logprobs >= {width} (or set {requests}=opt-in)"
        )
        out.append(
            (
                f"requests with top_k={top_k} need support rows of width {width} (top_k + slack "
                f"{knobs['slack']}) but the engine admits logprobs up to {limit}: they will be refused",
                f"{fix}, or lower {options.SLACK_ENV}",
            )
        )
    if getattr(engine, "speculative_config", None):
        out.append(
            (
                "the engine runs speculative decoding: sample-support capture refuses every request",
                "drop --speculative-config for replayed rollouts",
            )
        )
    return out


def _check_ray_executor(engine: Any, environ: Mapping[str, str]) -> list[Finding]:
    """vLLM's Ray executor copies only some variables to its workers (``vllm/ray/ray_env.py``:
    prefixes ``VLLM_``, ``HF_``..., plus ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY`` and
    ``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY``)."""
    if str(getattr(engine, "distributed_executor_backend", None) or "") != "ray":
        return []
    ours = sorted(k for k in environ if k.startswith("REPLAY_PLUGIN_"))
    prefixes = _csv(environ.get("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", ""))
    names = _csv(environ.get("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", ""))
    lost = [k for k in ours if k not in names and not any(k.startswith(p) for p in prefixes)]
    if not lost:
        return []
    return [
        (
            f"the engine uses the Ray executor, which does not copy {', '.join(lost)} to its workers",
            "export VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY=REPLAY_PLUGIN_",
        )
    ]


def _csv(value: str) -> set[str]:
    return {v.strip() for v in value.split(",") if v.strip()}
