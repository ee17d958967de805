"""The refusal SkyRL's width patches share: a job asks for sample support and the plugin's capture
would not serve it, so SkyRL would train on its own rows without a word.

Gap (skyrl 0.4.0 with the plugin): ``/skyrl/v1/generate`` returns the plugin's exact rows only
where ``skyrl.sample_support_rows`` is applied in the server's process. Where it is not (its toggle
off, SkyRL outside its range, a fingerprint drift in a 0.4.x release) SkyRL builds its own top_k
rows, overwriting the weakest member with the sampled id where it is missing, while
``skyrl.engine_support_width`` and ``skyrl.generator_support_width`` still apply: SkyRL trains on
those rows as the sampler's support, with no error and no log line in the server.

With ``generator.inference_engine.enable_return_sample_support_set`` on, both width patches call
:func:`check` before SkyRL's code runs:

- ``build_vllm_cli_args`` (``skyrl.engine_support_width``), in the process that then starts
  SkyRL's server actors from the same install and environment: the server module is imported first
  if nothing did yet (SkyRL's ``ServerGroup`` imports it next anyway), so the capture patch has been
  applied or refused for real in this process, a fingerprint drift included. The job stops before
  a server starts.
- ``SkyRLGymGenerator.agent_loop`` (``skyrl.generator_support_width``), once per process: it covers
  a job whose engine-args patch did not run (switched off, or SkyRL's servers started elsewhere).
  There the capture's state is this process's, or, if the server module was never imported here,
  what ``registry.would_apply`` says of this environment (toggle and version, short of drift).

``check`` refuses with ``NotReplayable`` naming the patch, its state and reason, and the fix. It
also validates ``REPLAY_PLUGIN_SKYRL_SAMPLE_SUPPORT_ROWS_ON_INEXACT`` (:func:`on_inexact`): a bad
value refuses the job (and, in the server, each request asking for support) instead of
switching the capture off. Jobs that do not ask for sample support are never checked.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from .patches import ON_INEXACT_ENV, ON_INEXACT_POLICIES, SUPPORT_CONFIG_KEY

#: the patch that makes ``/skyrl/v1/generate`` return the plugin's rows
CAPTURE = "skyrl.sample_support_rows"
#: its trigger module (SkyRL's server actor)
SERVER_MODULE = "skyrl.backends.skyrl_train.inference_servers.vllm_server_actor"

_checked = False  # the generator's check passed in this process


def on_inexact(environ: Mapping[str, str] | None = None) -> str:
    """The policy for inexact rows in ``environ`` (default: this process's): ``error`` (unset or
    empty) or ``repair``.

    Raises:
        NotReplayable: any other value, naming the variable and its allowed values.
    """
    raw = (os.environ if environ is None else environ).get(ON_INEXACT_ENV, "")
    value = raw.strip().lower() or "error"
    if value in ON_INEXACT_POLICIES:
        return value
    from ..core.errors import NotReplayable

    raise NotReplayable(
        ON_INEXACT_ENV,
        f"{ON_INEXACT_ENV}={raw!r}: expected one of {', '.join(ON_INEXACT_POLICIES)} (unset: error). "
        "Sample-support requests are refused until it is fixed (read as off, the plugin's rows would be "
        "replaced by SkyRL's own top_k rows). Fix the value, or unset it",
        value=raw,
    )


def requested(generator_cfg: Any) -> bool:
    """Whether SkyRL's generator config asks for sample support (SkyRL reads the key by truth)."""
    engine = getattr(generator_cfg, "inference_engine", None)
    return bool(getattr(engine, "enable_return_sample_support_set", False))


def _unapplied() -> tuple[str, str] | None:
    """None when the capture is in place in this process (or would be, once its module is
    imported), else ``(state, "state: reason")``."""
    from .. import registry, states

    st = states.get(CAPTURE)
    if st is None or st.state == "not-imported":
        ok, why = registry.would_apply(CAPTURE)
        return None if ok else (why.partition(":")[0], why)
    if st.state != "applied":
        return st.state, f"{st.state}: {st.reason}"
    patcher = registry.get().patchers.get(CAPTURE)
    displaced = patcher.displaced() if patcher is not None else []
    if displaced:
        return "replaced", "replaced: " + "; ".join(displaced)
    return None


_FIX = {
    "disabled": "unset {toggle} (and REPLAY_PLUGIN_DISABLE) in the job's environment",
    "skipped-version": "run a SkyRL in the patch's range (`replay-plugin matrix`)",
    "error": "read the reason (`replay-plugin matrix --check` names a drift: a plugin release that "
    "records this SkyRL's sources fixes it)",
}


def check(import_server: bool) -> None:
    """Refuse (``NotReplayable``) a sample-support job the capture would not serve; see the module
    docstring. ``import_server``: import SkyRL's server module first if nothing did yet."""
    from ..core.errors import NotReplayable
    from ..spec import toggle_name

    on_inexact()
    if import_server:
        from .. import states

        st = states.get(CAPTURE)
        if st is None or st.state == "not-imported":
            try:
                importlib.import_module(SERVER_MODULE)  # applies the patch, or records why not
            except Exception:  # noqa: BLE001 - SkyRL's ServerGroup hits the same import error next
                pass
    off = _unapplied()
    if off is None:
        return
    state, why = off
    toggle = toggle_name(CAPTURE)
    fix = _FIX.get(state, "switch the patch on and run a SkyRL it supports").format(toggle=toggle)
    raise NotReplayable(
        toggle if state == "disabled" else "skyrl",
        f"SkyRL's config sets {SUPPORT_CONFIG_KEY}=true but the plugin's capture is not in place: patch {CAPTURE} "
        f"{why}. SkyRL's /skyrl/v1/generate would return its own top_k rows (the sampled id written over "
        f"the weakest member where it is missing) and SkyRL would train on them as the sampler's support. "
        f"Fix: {fix}; or drop {SUPPORT_CONFIG_KEY}",
        value=state,
    )


def check_once() -> None:
    """:func:`check` without the import, until it passes once in this process (the generator
    calls it per trajectory)."""
    global _checked
    if not _checked:
        check(import_server=False)
        _checked = True
