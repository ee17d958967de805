"""Patch ``vllm.request_guard``: a request that asks for replay data and cannot get it is refused
before compute, with the reason and the fix.

Gap (vLLM 0.30-0.34, and every version the capture patches do not support): vLLM ignores
``extra_args`` keys it does not know, so a request that sets ``replay_sample_support`` is served
without replay data whenever the capture patches are not in place (vLLM outside their range,
toggled off, failed to apply, reverted, or replaced by another library since), and the plugin's
internal key is settable by any client (a string there gave HTTP 500 on 0.30). This guard is
small and has a wide version range (no upper bound) so that it stays when the capture patches
are skipped: it checks the request's replay keys (bad values and internal keys are refused
naming the key) and refuses a request that wants replay data while a patch it needs is not
applied in this process (the capture patch; the compact-routes patch when routes are asked for
explicitly; the OpenAI serving patches when the OpenAI server is loaded; ``/inference/v1/generate``
refuses by itself without ``vllm.generate_fields``), and a request that asks for
routes explicitly from an engine started without ``enable_return_routed_experts`` (vLLM returns
``routed_experts=None`` then, silently). Remove with the last capture patch.

vLLM 0.34's ``InputProcessor.process_inputs`` (0.33's is 0.32's) checks ``prompt_logprob_start``
against the prompt length; its ``params`` argument, which the guard reads before vLLM runs, is
unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

from .. import registry, states
from ..patcher import Patcher
from . import options
from .refusal import refusal

#: Patch states that serve replay data.
_SERVING = ("applied", "not-needed")
#: Patches a served request needs when their trigger module is loaded in this process. Not
#: ``vllm.generate_fields``: only ``/inference/v1/generate`` needs it, and that endpoint refuses by
#: itself when it is not serving (``vllm.served_endpoints``); here its absence would refuse the
#: completions and chats of every ``vllm serve`` whose vLLM it does not cover.
_SERVED = {
    "vllm.openai_fields": "vllm.entrypoints.openai.completion.serving",
    "vllm.served_endpoints": "vllm.entrypoints.openai.chat_completion.serving",
}


def _fix(name: str, state: str, reason: str) -> str:
    env = "REPLAY_PLUGIN_" + name.upper().replace(".", "_")
    if state == "skipped-version":
        return (
            "install a replay-plugin release whose compat_matrix.yaml supports this vLLM, or run "
            "a supported vLLM (REPLAY_PLUGIN_ALLOW_UNSUPPORTED=1 applies the patch untested)"
        )
    if state == "disabled":
        return f"unset {env} (or set it to 1) in every vLLM process"
    if state == "reverted":
        return "call replay_plugin.activate() again"
    if state == "replaced":
        return (
            "another library replaced a function the patch wraps after the plugin patched it: let "
            "that library patch first and the plugin after (replay_plugin.deactivate() then "
            "replay_plugin.activate()), or turn that library's patch off"
        )
    return "see `replay-plugin status --import vllm` and `replay-plugin doctor`"


def missing_patches(wants_support: bool, wants_routes: bool) -> list[str]:
    """The patches this request needs that are not serving in this process, with reason and fix."""
    needed = []
    if wants_support:
        needed.append("vllm.sample_support")
    if wants_routes:
        needed.append("vllm.routed_experts")
    needed += [name for name, module in _SERVED.items() if module in sys.modules]
    return patch_problems(needed)


#: One patch on two vLLM lines whose target module moved: the matrix holds one target list per
#: patch, so vLLM 0.24's ``/inference/v1/generate`` (``vllm.entrypoints.serve.disagg.serving``;
#: 0.25 moved it to ``vllm.entrypoints.scale_out.token_in_token_out``) has patches of its own
#: running the same wrappers. Each of the pair is ``retired`` (``not-needed``) on the other's line;
#: a request needs the one of its line.
LINES = {
    "vllm.served_endpoints": ("vllm.served_endpoints", "vllm.served_endpoints_disagg"),
    "vllm.generate_fields": ("vllm.generate_fields", "vllm.generate_fields_disagg"),
}


def _line_of(name: str) -> str:
    """The patch of ``name``'s pair (:data:`LINES`) for this process's vLLM: the one not retired
    here (``name`` itself when neither or both are)."""
    pair = LINES.get(name)
    if not pair:
        return name
    live = [p for p in pair if not _retired_here(p)]
    return live[0] if len(live) == 1 else name


def _retired_here(name: str) -> bool:
    """Whether the installed vLLM lies in one of ``name``'s ``retired`` ranges (whatever its
    toggle says)."""
    reg = registry.get()
    spec = reg.specs.get(name)
    return spec is not None and reg.retired_state(spec) is not None


def patch_problems(names: list[str]) -> list[str]:
    """For each patch of ``names`` that is not serving replay data in this process: its state,
    why, and the fix (empty when all are). A patch of :data:`LINES` stands for its pair: the one
    of this vLLM line is checked."""
    problems = []
    for name in map(_line_of, names):
        st = states.get(name)
        if st is None:
            problems.append(f"patch {name} is not registered in this process (is replay-plugin installed here?)")
        elif st.state not in _SERVING:
            version = f" (vLLM {st.version})" if st.version else ""
            problems.append(f"patch {name} is {st.state}{version}: {st.reason}; fix: {_fix(name, st.state, st.reason)}")
        elif displaced := _displaced(name):
            problems.append(
                f"patch {name} is replaced: {'; '.join(displaced)}: the plugin's wrapper is no longer in "
                f"place; fix: {_fix(name, 'replaced', '')}"
            )
    return problems


def _displaced(name: str) -> list[str]:
    """The changes of an applied patch another library has since replaced (state ``replaced``
    in ``replay-plugin status``)."""
    patcher = registry.get().patchers.get(name)
    return patcher.displaced() if patcher is not None else []


def check_request(params: Any, vllm_config: Any = None) -> None:
    """Refuse (``SampleSupportRefused``, before compute) a request whose replay keys are invalid
    or set an internal key, that wants replay data a missing patch cannot provide, or that asks
    for routed experts explicitly (its ``replay_routed_experts`` key or the job's
    ``ROUTED_EXPERTS_REQUESTS=all``) from an engine that does not return them."""
    extra = getattr(params, "extra_args", None)
    try:
        options.check_request_keys(extra)
        support = options.wants_support(extra)
        routes = options.explicit_routes(extra)
    except options.KnobError:
        raise
    except options.OptionError as exc:
        raise refusal(f"replay_plugin: {exc}", exc.key) from None
    if not (support or routes):
        return
    problems = missing_patches(support, routes)
    if problems:
        key = options.REQUEST_SUPPORT_KEY if support else options.ROUTES_KEY
        raise refusal(
            f"replay_plugin: the request asks for replay data ({key!r} or the job's "
            f"{options.REQUESTS_ENV}) but this vLLM process cannot capture it: " + "; ".join(problems),
            key,
        )
    if routes and not _engine_returns_routes(vllm_config):
        # vLLM (0.30-0.34) serves such a request with routed_experts None, silently.
        raise refusal(
            f"replay_plugin: the request asks for routed experts ({options.ROUTES_KEY!r} or the job's "
            f"{options.ROUTES_REQUESTS_ENV}=all) but this engine does not return them "
            "(enable_return_routed_experts is off); fix: start it with "
            "enable_return_routed_experts=True (vllm serve --enable-return-routed-experts; on CPU only vLLM 0.30 "
            "returns routes, 0.31+ needs Model Runner V2, a GPU), or drop the routes request",
            options.ROUTES_KEY,
        )


def _engine_returns_routes(vllm_config: Any) -> bool:
    """Whether the engine returns routed experts: ``enable_return_routed_experts`` of its
    ``aux_output_config`` (vLLM 0.31+) or ``model_config`` (0.30). True when neither holds the
    flag (a vLLM that moved it again: the request is served as vLLM serves it)."""
    for holder in ("aux_output_config", "model_config"):
        flag = getattr(getattr(vllm_config, holder, None), "enable_return_routed_experts", None)
        if flag is not None:
            return bool(flag)
    return True


def _guard(wrapped, instance, args, kwargs):
    """``InputProcessor.process_inputs``: check the caller's params before anything runs."""
    params = kwargs["params"] if "params" in kwargs else (args[2] if len(args) > 2 else None)
    if params is not None and hasattr(params, "extra_args"):
        check_request(params, getattr(instance, "vllm_config", None))
    return wrapped(*args, **kwargs)


def install(patcher: Patcher) -> None:
    patcher.wrap("InputProcessor.process_inputs", _guard)
