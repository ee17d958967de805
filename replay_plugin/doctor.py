"""``replay-plugin doctor``: what stops replay from working here, each finding with its fix.

Installation checks run in the current environment; the vLLM, Megatron, SkyRL, verl, TRL and Ray
checks look at the current environment and, when given, at the engine arguments, model
configuration and SkyRL, verl or TRL config the job will use (the framework knowledge lives in
``vllm/doctor.py``, ``megatron/doctor.py``, ``skyrl/doctor.py``, ``verl/doctor.py`` and
``trl/doctor.py``).
"""

from __future__ import annotations

import importlib.metadata
import os
import site
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Finding:
    """One problem: which ``check`` found it, what is wrong, and how to fix it."""

    check: str
    problem: str
    fix: str

    def text(self) -> str:
        return f"{self.problem}; fix: {self.fix}"


def _site_dirs() -> list[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if user:
        dirs.append(user)
    return list(dict.fromkeys(dirs))


def pth_files() -> list[str]:
    return [p for p in (os.path.join(d, "replay_plugin.pth") for d in _site_dirs()) if os.path.exists(p)]


def check_pth(environ: Mapping[str, str]) -> list[Finding]:
    """The .pth line is installed, current, processed, and arms the finder in a fresh process."""
    from . import _pth, settings

    out = []
    found = pth_files()
    if not found:
        out.append(
            Finding(
                "install",
                f"replay_plugin.pth is not in this interpreter's site-packages ({', '.join(_site_dirs())}): "
                "activation on import will not happen",
                "install the wheel (not editable, not --target), or call replay_plugin.activate() in your code",
            )
        )
    for path in found:
        with open(path, encoding="utf-8") as fh:
            if fh.read() != _pth.pth_line():
                out.append(Finding("install", f"{path} differs from this version's .pth line", "reinstall the wheel"))
    if sys.flags.no_site or sys.flags.isolated:
        out.append(
            Finding(
                "install",
                "this interpreter runs with -S or -I: .pth files are not processed",
                "call replay_plugin.activate()",
            )
        )
    code = f"import sys; f = sys.__dict__.get({_pth.MARKER!r}); print(f is not None and f in sys.meta_path)"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if not settings.disabled(environ) and probe.stdout.strip() != "True":
        out.append(
            Finding(
                "install",
                f"a fresh `{sys.executable}` does not arm the import finder (the .pth line did not run)",
                "reinstall the wheel into this interpreter's site-packages",
            )
        )
    return out


def check_distribution() -> list[Finding]:
    """One installed copy, and the one being imported."""
    import replay_plugin

    names = ("replay-plugin", "replay_plugin")
    dists = [d for d in importlib.metadata.distributions() if (d.metadata["Name"] or "").lower() in names]
    locations = sorted({str(d.locate_file("")) for d in dists})
    out = []
    if len(dists) > 1:
        out.append(
            Finding(
                "install",
                f"replay-plugin is installed {len(dists)} times: {', '.join(locations)}",
                "pip uninstall replay-plugin until none is left, then install it once",
            )
        )
    pkg_dir = os.path.dirname(os.path.abspath(replay_plugin.__file__))
    if dists and not any(pkg_dir.startswith(os.path.abspath(loc)) for loc in locations):
        out.append(
            Finding(
                "install",
                f"replay_plugin is imported from {pkg_dir}, not from the installed distribution at {locations[0]}",
                "remove the other copy from sys.path (PYTHONPATH, the working directory)",
            )
        )
    return out


def check_upstreams() -> tuple[list[str], list[Finding]]:
    """(installed upstream versions, findings for versions outside the supported ranges)."""
    from . import compat

    versions, out = [], []
    for up in compat.load().upstreams.values():
        dist, version = compat.installed_version(up)
        if version is None:
            continue
        versions.append(f"{dist} {version}")
        if not compat.version_in(version, up.supported):
            out.append(
                Finding(
                    "versions",
                    f"{dist} {version} is outside the supported range {compat.format_spec(up.supported)} "
                    "(its patches are skipped)",
                    f"install a supported {dist} (`replay-plugin matrix`)",
                )
            )
    return versions, out


def check_settings(environ: Mapping[str, str]) -> list[Finding]:
    """Unknown or unreadable REPLAY_PLUGIN_* variables, and packs that failed to load."""
    from . import registry, settings, states

    reg = registry.get()
    reg.load_packs()
    fix = "correct or unset the variable (docs/reference/environment.md)"
    out = [Finding("settings", p, fix) for p in settings.problems(reg.known_env(), environ)]
    out += [Finding("settings", e, "reinstall the pack or block it") for e in states.events()]
    return out


def check_ray(environ: Mapping[str, str]) -> list[Finding]:
    """REPLAY_PLUGIN_* variables a running Ray cluster's workers will not see."""
    ours = sorted(k for k in environ if k.startswith("REPLAY_PLUGIN_"))
    if not ours or not environ.get("RAY_ADDRESS"):
        return []
    return [
        Finding(
            "ray",
            f"RAY_ADDRESS is set and {', '.join(ours)} are set here: workers of a Ray cluster started "
            "elsewhere (`ray start`) do not inherit this process's environment",
            "pass them to the actors: runtime_env={'env_vars': {...}} "
            "(docs/install.md#ray-workers-verl-skyrl-vllms-ray-executor)",
        )
    ]


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_pairings(installed: Callable[[str], str | None] = _installed) -> list[str]:
    """For each RL framework of the matrix's ``pairings`` that is installed (``installed``: a
    distribution's version, None when absent): the vLLM its install extra brings, the installed
    vLLM beside that pin with the plugin's tier for it, and what the plugin does for that
    framework there. A framework release the matrix has no pairing for gets the recorded ones."""
    from . import compat

    matrix = compat.load()
    vllm = matrix.upstreams["vllm"]
    have = next(((d, v) for d in vllm.distributions if (v := installed(d)) is not None), None)
    out: list[str] = []
    for framework in dict.fromkeys(p.framework for p in matrix.pairings):
        version = installed(framework)
        if version is None:
            continue
        rows = [p for p in matrix.pairings if p.framework == framework]
        same = [p for p in rows if compat.parse_version(p.version).public == compat.parse_version(version).public]
        recorded = rows[0].version
        lead = "" if same else f"{framework} {version} is installed; the matrix records the pairing of {recorded}: "
        for p in same or rows:
            pin = f"vllm{compat.format_spec(p.vllm)}"
            if have is None:
                beside = "no vLLM is installed here"
            else:
                dist, ver = have
                fits = "meets that pin" if compat.version_in(ver, p.vllm) else "is not what that extra installs"
                beside = f"installed {dist} {ver} {fits} (the plugin: {compat.version_tier(vllm, ver)} there)"
            out.append(
                f"{lead}{p.label()} installs {pin} (the plugin: {compat.pairing_tiers(vllm, p.vllm)}); {beside}; "
                f"what the plugin does: {p.plugin}"
            )
    return out


def report(
    *,
    vllm_args: Sequence[str] | None = None,
    top_k: int | None = None,
    megatron_config: str | None = None,
    skyrl_config: str | None = None,
    verl_config: str | None = None,
    trl_config: object = None,
    environ: Mapping[str, str] | None = None,
) -> dict:
    """Every finding, the installed upstreams and notes; ``ok`` when nothing was found."""
    from . import __version__, settings

    env = dict(os.environ if environ is None else environ)
    versions, version_findings = check_upstreams()
    findings = check_pth(env) + check_distribution() + version_findings + check_settings(env) + check_ray(env)
    if vllm_args is not None or _importable("vllm"):
        from .vllm.doctor import check as check_vllm

        findings += [Finding("vllm", problem, fix) for problem, fix in check_vllm(vllm_args, top_k=top_k, environ=env)]
    if megatron_config is not None:
        from .megatron.doctor import check as check_megatron

        findings += [Finding("megatron", problem, fix) for problem, fix in check_megatron(megatron_config)]
    if skyrl_config is not None:
        from .skyrl.doctor import check as check_skyrl

        findings += check_job("skyrl", check_skyrl, skyrl_config, env)
    if verl_config is not None:
        from .verl.doctor import check as check_verl

        findings += check_job("verl", check_verl, verl_config, env)
    notes = []
    if trl_config is not None:
        found, trl_notes = check_trl(trl_config, env)
        findings += found
        notes += trl_notes
    if settings.disabled(env):
        notes.append("REPLAY_PLUGIN_DISABLE is set: the plugin is off in every process of this environment")
    return {
        "version": __version__,
        "python": sys.executable,
        "pth": pth_files(),
        "upstreams": versions,
        "findings": [asdict(f) for f in findings],
        "problems": [f.text() for f in findings],
        "notes": notes,
        "pairings": check_pairings(),
        "ok": not findings,
    }


def check_job(
    framework: str,
    check: Callable[[str, Mapping[str, str]], list[tuple[str, str]]],
    config: str,
    environ: Mapping[str, str],
) -> list[Finding]:
    """A framework doctor's findings (check ``framework``), or the one reason its config cannot be
    read (check ``framework-config``: a missing file, a word the framework's parser refuses)."""
    from .job_config import ConfigError

    try:
        return [Finding(framework, problem, fix) for problem, fix in check(config, environ)]
    except ConfigError as exc:
        return [Finding(f"{framework}-config", exc.problem, exc.fix)]


def check_trl(config: object, environ: Mapping[str, str]) -> tuple[list[Finding], list[str]]:
    """The TRL doctor's findings (check ``trl``) and notes, or the one reason its config cannot be
    read (check ``trl-config``)."""
    from .job_config import ConfigError
    from .trl.doctor import check

    try:
        report = check(config, environ)
    except ConfigError as exc:
        return [Finding("trl-config", exc.problem, exc.fix)], []
    return [Finding("trl", problem, fix) for problem, fix in report.findings], report.notes


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
