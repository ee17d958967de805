"""Patch ``skyrl.engine_support_width``: the vLLM engine SkyRL starts allows the rows' width.

Gap (skyrl 0.4.0, ``inference_servers/utils.py:build_vllm_cli_args``): with
``generator.inference_engine.enable_return_sample_support_set`` SkyRL sets the engine's
``max_logprobs = top_k``, the width of its own rows. The plugin's rows are ``W = top_k + slack``
wide (``REPLAY_PLUGIN_VLLM_SAMPLE_SUPPORT_SLACK``, default 16: room for ties at the k-th logit),
and the plugin refuses a request whose width the engine does not allow. The wrapper raises
``max_logprobs`` to ``W`` (never lowers it, ``-1``, no limit, included:
``vllm.engine_proxy.fitted_max_logprobs``); ``logprobs_mode="processed_logprobs"`` stays SkyRL's.
A request's own logprobs are unchanged: ``max_logprobs`` is a cap.

Before SkyRL builds the arguments of a job that asks for sample support, the wrapper refuses it
(``capture_guard.check``) where ``skyrl.sample_support_rows`` is not in place: SkyRL's servers
would return SkyRL's own top_k rows and the job would train on them, silently. The server module
is imported for that check (SkyRL's ``ServerGroup`` imports it right after). Remove with
``skyrl.sample_support_rows``.
"""

from __future__ import annotations

import logging
from typing import Any

from ..patcher import Patcher
from ..vllm.engine_proxy import fitted_max_logprobs

log = logging.getLogger("replay_plugin")


def support_width(cfg: Any) -> int | None:
    """``top_k + slack`` when SkyRL's config asks for sample support, else None."""
    from ..vllm import options

    ie = cfg.generator.inference_engine
    if not getattr(ie, "enable_return_sample_support_set", False):
        return None
    return int(cfg.generator.sampling_params.top_k) + options.job_slack()


def _build_vllm_cli_args(wrapped, instance, args, kwargs):
    from . import capture_guard

    cfg = args[0] if args else kwargs["cfg"]
    if capture_guard.requested(cfg.generator):
        capture_guard.check(import_server=True)
    namespace = wrapped(*args, **kwargs)
    width = support_width(cfg)
    if width is not None:
        current = getattr(namespace, "max_logprobs", None)
        if fitted_max_logprobs(current, width) is not None:
            log.info(
                "replay_plugin: skyrl.engine_support_width: max_logprobs %s -> %d (top_k %d + slack)",
                current,
                width,
                int(cfg.generator.sampling_params.top_k),
            )
            namespace.max_logprobs = width
    return namespace


def install(patcher: Patcher) -> None:
    patcher.wrap("build_vllm_cli_args", _build_vllm_cli_args)
