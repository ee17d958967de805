#!/usr/bin/env python3
"""Build the test environments of envs/envs.toml and run the tests in them. Standard library only.

    python3 scripts/envs.py ensure NAME        # print the venv path, building it if needed
    python3 scripts/envs.py lock NAME          # re-resolve envs/NAME.in into envs/NAME.lock
    python3 scripts/envs.py wheel              # build the plugin wheel into dist/
    python3 scripts/envs.py test [NAME ...] [-- PYTEST ARGS]   # what scripts/test runs
                                               # (test paths in PYTEST ARGS replace NAME's own)
    python3 scripts/envs.py lint               # ruff check, ruff format --check, mypy, and the docs
                                               # site (mkdocs build --strict), in env lint
    python3 scripts/envs.py docs [DIR]         # the docs site alone (into a temporary dir, or DIR)
    python3 scripts/envs.py run NAME -- CMD... # run CMD with NAME's venv first on PATH

Test environments are the entries of envs/envs.toml with `tests`; `lint` has none (no pytest).
An environment fails when pytest fails, when it collects no tests (exit 5), and when a declared
upstream has no passed test: tests/conftest.py writes, per upstream passed to need(), how many
tests passed, failed and skipped ($REPLAY_TEST_REPORT). When extra pytest arguments select a
subset of the tests (paths, -k, -m, -x, ...) that upstream check is reported but not enforced.

Pytest runs go $REPLAY_TEST_JOBS at a time (default 2), in envs.toml order; an environment's
`parts` run as pytest processes of their own beside the rest of its tests (``test_parts``).

Venvs live in $REPLAY_VENVS (default ~/.cache/replay-plugin/venvs) under NAME-<hash of the lock
file and Python version>, so a venv is reused only while its pinned requirements are unchanged;
.venvs/NAME in the repo links to the current one and .venv links to .venvs/main.

Overlay environments (``base``, ``overlay`` and optionally ``remove`` in envs.toml, no lock file)
are the base venv cloned with hard links (nothing is copied: a file costs a directory entry),
the ``remove`` distributions uninstalled and the overlay's exact pins installed with --no-deps,
cached under NAME-<hash of the base's key and the pins> beside the others. pip never writes into
an existing file (it unlinks first), so the base is never changed. The build fails when the
overlay breaks a requirement that held in the base (``pip check`` of both, compared), unless
the entry's ``unmet`` names the required distribution: a requirement no release on PyPI meets
(transformers 5.25.0 requires kernels>=0.19.1, which was never published), accepted by name and
logged; a name in ``unmet`` that nothing lacks fails the build (remove it). ``build`` names
distributions PyPI has only as an sdist that must build against the venv's torch (flash-attn,
for skyrl's FSDP model wrapper): built with ``--no-build-isolation`` and ``build_env``. One venv per upstream
version would cost gigabytes and minutes each; an overlay of a pure-Python upstream costs seconds
and megabytes.

A ``tree`` overlay (vLLM 0.33/0.34, whose PyPI wheels are CUDA builds) lays the Python files of an
official release's wheel over the base's build of an older release, keeping the base's compiled
binaries (:func:`lay_tree`); the wheel is downloaded once into $REPLAY_VENVS/wheels. An
environment that ``runs_in`` another is a second set of tests (``env``, ``shims``) in that one's
venv. ``shims`` are test-harness files run first in every process of the environment's pytest
runs, through replay_test_shims.pth and $REPLAY_TEST_SHIMS (:func:`write_shims_pth`).
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Sequence

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENVS_DIR = os.path.join(ROOT, "envs")
INSTALL_SCHEME = "1"  # bump to force every cached venv to be rebuilt
TORCH_FAMILY = {"torch", "torchaudio", "torchvision", "torchcodec"}
LINT_ENV = "lint"
LINT_COMMANDS = (["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy"])
#: the docs site of mkdocs.yml: --strict fails on a broken link or anchor (its `validation`)
DOCS_COMMAND = ["mkdocs", "build", "--strict", "--quiet", "--config-file", "mkdocs.yml", "--site-dir"]
# pytest options that run a subset of an environment's tests (or stop early)
SUBSET_OPTIONS = (
    "-k",
    "-m",
    "-x",
    "--exitfirst",
    "--maxfail",
    "--deselect",
    "--ignore",
    "--lf",
    "--last-failed",
    "--sw",
    "--stepwise",
    "--co",
    "--collect-only",
)


def log(msg: str) -> None:
    print(f"[envs {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def config() -> dict:
    with open(os.path.join(ENVS_DIR, "envs.toml"), "rb") as fh:
        return tomllib.load(fh)


def test_envs(cfg: dict) -> list[str]:
    """The environments that run tests (those with ``tests``), in envs.toml order."""
    return [name for name, env in cfg.items() if env.get("tests")]


def _in_lines(path: str) -> list[str]:
    """Requirement lines of a .in file, following ``-r`` includes."""
    lines = []
    with open(path) as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if line.startswith("-r "):
                lines += _in_lines(os.path.join(os.path.dirname(path), line[3:].strip()))
            elif line:
                lines.append(line)
    return lines


def python_for(version: str) -> str:
    """A working interpreter of ``version`` ("3.11"): pyenv's versions first, then PATH
    (pyenv's shims on PATH fail for versions that are not selected, so each is tried)."""
    pyenv_root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = sorted(glob.glob(os.path.join(pyenv_root, "versions", f"{version}.*", "bin", f"python{version}")))
    exe = shutil.which(f"python{version}")
    if exe:
        candidates.append(exe)
    for c in candidates:
        if subprocess.run([c, "-c", "pass"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
            return c
    raise SystemExit(f"no working Python {version} found ({pyenv_root}/versions or PATH); install it with pyenv")


def venv_root() -> str:
    return os.environ.get("REPLAY_VENVS") or os.path.expanduser("~/.cache/replay-plugin/venvs")


def lock_path(name: str) -> str:
    return os.path.join(ENVS_DIR, f"{name}.lock")


def overlay_of(name: str, cfg: dict | None = None) -> tuple[str, list[str], list[str]] | None:
    """``(base, exact pins, distributions removed)`` of an overlay environment, None for a
    lock-file environment (and for one that ``runs_in`` another). Raises SystemExit on a
    malformed entry (base missing or itself an overlay, pins not exact, a ``python`` other than
    the base's). An overlay with a ``tree`` may have no pins of its own."""
    cfg = cfg or config()
    entry = cfg[name]
    if "base" not in entry and "overlay" not in entry and "tree" not in entry:
        return None
    base, remove = entry.get("base"), entry.get("remove", [])
    pins = entry.get("overlay", [] if "tree" in entry else None)
    if base not in cfg or "base" in cfg[base] or "runs_in" in cfg[base]:
        raise SystemExit(f"env {name}: base {base!r} must be an environment with a lock file")
    if (
        not isinstance(pins, list)
        or not (pins or "tree" in entry)
        or not all(isinstance(p, str) and re.fullmatch(r"[A-Za-z0-9_.\-]+==\S+", p) for p in pins)
    ):
        raise SystemExit(f"env {name}: overlay must be a non-empty list of exact pins (name==version), got {pins!r}")
    if not isinstance(remove, list) or not all(isinstance(r, str) for r in remove):
        raise SystemExit(f"env {name}: remove must be a list of distribution names, got {remove!r}")
    if entry.get("python", cfg[base]["python"]) != cfg[base]["python"]:
        raise SystemExit(f"env {name}: an overlay runs on its base's Python ({cfg[base]['python']})")
    return base, pins, remove


def unmet_of(name: str, cfg: dict | None = None) -> list[str]:
    """The distributions whose requirements the overlay ``name`` may leave unmet (``unmet`` in
    envs.toml; empty when absent). SystemExit when it is not a list of names or not an overlay's."""
    cfg = cfg or config()
    unmet = cfg[name].get("unmet", [])
    if not isinstance(unmet, list) or not all(isinstance(u, str) and u for u in unmet):
        raise SystemExit(f"env {name}: unmet must be a list of distribution names, got {unmet!r}")
    if unmet and overlay_of(name, cfg) is None:
        raise SystemExit(f"env {name}: unmet applies to overlay environments only")
    return unmet


def built_of(name: str, cfg: dict | None = None) -> tuple[list[str], dict[str, str]]:
    """``(exact pins, environment)`` of the distributions the overlay ``name`` builds from their
    source distributions (``build`` and ``build_env`` in envs.toml; empty when absent): PyPI holds
    no wheel of them (flash-attn: an sdist whose setup.py imports torch, so pip's isolated build
    fails). They are installed after the overlay pins with ``--no-build-isolation --no-deps``
    (built against the venv's own torch), with ``build_env`` set. SystemExit on a malformed
    entry."""
    cfg = cfg or config()
    entry = cfg[name]
    pins, env = entry.get("build", []), entry.get("build_env", {})
    if not isinstance(pins, list) or not all(
        isinstance(p, str) and re.fullmatch(r"[A-Za-z0-9_.\-]+==\S+", p) for p in pins
    ):
        raise SystemExit(f"env {name}: build must be a list of exact pins (name==version), got {pins!r}")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SystemExit(f"env {name}: build_env must be a table of strings, got {env!r}")
    if (pins or env) and overlay_of(name, cfg) is None:
        raise SystemExit(f"env {name}: build applies to overlay environments only")
    if env and not pins:
        raise SystemExit(f"env {name}: build_env without build")
    return pins, env


# A ``tree`` overlay takes every file of the release's wheel under its import packages except
# what a CUDA build compiled or compiles (kept from the base instead, or not needed on a CPU):
# shared objects, other executables (ELF), C/C++/CUDA sources and headers.
TREE_SCHEME = "1"  # bump when the rule changes: every tree overlay is rebuilt
TREE_SOURCE_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".inl")
_TREE_KEYS = {"pin", "over", "local"}
_EXACT_PIN = r"[A-Za-z0-9_.\-]+==\S+"


def tree_of(name: str, cfg: dict | None = None) -> dict[str, str] | None:
    """``{"pin", "over", "local"}`` of the overlay ``name``'s ``tree`` (None when it has none):
    the Python files of the PyPI release ``pin``'s wheel replace those of the base's
    distribution ``over`` (whose compiled ``*.so*`` stay), under a dist-info naming ``pin``'s
    version with the local label ``local`` ("" when absent). SystemExit on a malformed entry."""
    cfg = cfg or config()
    entry = cfg[name]
    tree = entry.get("tree")
    if tree is None:
        return None
    if "base" not in entry:
        raise SystemExit(f"env {name}: tree applies to overlay environments only (it needs a base)")
    if not isinstance(tree, dict) or not {"pin", "over"} <= set(tree) or set(tree) - _TREE_KEYS:
        raise SystemExit(f"env {name}: tree must be a table with pin, over and optionally local, got {tree!r}")
    pin, over, local = tree["pin"], tree["over"], tree.get("local", "")
    if not isinstance(pin, str) or not re.fullmatch(_EXACT_PIN, pin) or "+" in pin:
        raise SystemExit(f"env {name}: tree pin must be an exact pin of a release on PyPI (name==version), got {pin!r}")
    if not isinstance(over, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", over):
        raise SystemExit(f"env {name}: tree over must name a distribution of the base, got {over!r}")
    if not isinstance(local, str) or (local and not re.fullmatch(r"[a-z0-9]+(\.[a-z0-9]+)*", local)):
        raise SystemExit(f"env {name}: tree local must be a local version label such as 'cpu', got {local!r}")
    if _norm(over) in {_norm(r) for r in entry.get("remove", []) if isinstance(r, str)}:
        raise SystemExit(f"env {name}: tree over {over!r} is also in remove (the tree keeps its binaries)")
    return {"pin": pin, "over": over, "local": local}


def runs_in_of(name: str, cfg: dict | None = None) -> str | None:
    """The environment whose venv ``name`` runs in (``runs_in``; None when absent): a test
    environment of its own (``upstreams``, ``tests``, ``parts``, ``env``, ``shims``) without a
    venv of its own. SystemExit on a malformed entry."""
    cfg = cfg or config()
    entry = cfg[name]
    target = entry.get("runs_in")
    if target is None:
        return None
    if not isinstance(target, str) or target not in cfg or target == name or "runs_in" in cfg[target]:
        raise SystemExit(f"env {name}: runs_in {target!r} must name an environment with a venv of its own")
    extra = sorted(set(entry) - {"runs_in", "upstreams", "tests", "parts", "env", "shims"})
    if extra:
        raise SystemExit(f"env {name}: an environment that runs_in {target} has no venv of its own; drop {extra}")
    return target


# Variables scripts/envs.py sets for every pytest run (tests/conftest.py's contract) or from `shims`.
_RESERVED_VARIABLES = {
    "REPLAY_TEST_ENV",
    "REPLAY_TEST_UPSTREAMS",
    "REPLAY_TEST_WHEEL",
    "REPLAY_TEST_REPORT",
    "REPLAY_TEST_SHIMS",
    "PATH",
    "PYTHONPATH",
}
SHIMS_PTH = "replay_test_shims.pth"
# The .pth line (site runs lines starting with "import"; os is imported by then): each file named
# in $REPLAY_TEST_SHIMS is executed, in its own namespace, at every interpreter start in the venv;
# unset, the line reads one variable.
SHIMS_PTH_LINE = (
    "import os; [exec(compile(open(p).read(), p, 'exec'), {'__name__': 'replay_test_shim', '__file__': p})"
    " for p in os.environ.get('REPLAY_TEST_SHIMS', '').split(os.pathsep) if p]\n"
)


def test_env_of(name: str, cfg: dict | None = None) -> tuple[dict[str, str], list[str]]:
    """``(variables, shim paths)`` of the environment ``name``: ``env`` (set for its pytest runs)
    and ``shims`` (files of the checkout, absolute, that the venv's replay_test_shims.pth runs in
    every process of those runs, through $REPLAY_TEST_SHIMS). SystemExit on a malformed entry."""
    cfg = cfg or config()
    entry = cfg[name]
    env, shims = entry.get("env", {}), entry.get("shims", [])
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SystemExit(f"env {name}: env must be a table of strings, got {env!r}")
    reserved = sorted(k for k in env if k in _RESERVED_VARIABLES or k.startswith("REPLAY_PLUGIN_"))
    if reserved:
        raise SystemExit(
            f"env {name}: env sets {', '.join(reserved)}, which scripts/envs.py sets itself "
            "(REPLAY_PLUGIN_* are cleared for every run: the tests set their own)"
        )
    if not isinstance(shims, list) or not all(isinstance(s, str) and s.endswith(".py") for s in shims):
        raise SystemExit(f"env {name}: shims must be a list of .py files of the checkout, got {shims!r}")
    paths = []
    for shim in shims:
        path = os.path.normpath(os.path.join(ROOT, shim))
        if not os.path.isfile(path) or os.path.relpath(path, ROOT).startswith((os.pardir, "replay_plugin")):
            raise SystemExit(
                f"env {name}: shim {shim!r} is not a test-harness file of the checkout (never the package)"
            )
        paths.append(path)
    return dict(env), paths


def write_shims_pth(venv: str) -> None:
    """Put replay_test_shims.pth (:data:`SHIMS_PTH_LINE`) into ``venv``'s site-packages, as a new
    file (never written into: the venv's files may be hard links of another venv's)."""
    (site,) = glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))
    path = os.path.join(site, SHIMS_PTH)
    if os.path.isfile(path):
        with open(path) as fh:
            if fh.read() == SHIMS_PTH_LINE:
                return
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as fh:
        fh.write(SHIMS_PTH_LINE)
    os.replace(tmp, path)


def python_of(name: str) -> str:
    """The Python version of ``name`` (an overlay's is its base's)."""
    cfg = config()
    name = runs_in_of(name, cfg) or name
    overlay = overlay_of(name, cfg)
    return cfg[overlay[0] if overlay else name]["python"]


def env_key(name: str) -> str:
    overlay = overlay_of(name)
    if overlay:
        base, pins, remove = overlay
        built, build_env = built_of(name)
        tree = tree_of(name)
        text = "\n".join(
            [
                env_key(base),
                *sorted(pins),
                *(f"-{r}" for r in sorted(remove)),
                *(f"+{b}" for b in sorted(built)),
                *(f"{k}={v}" for k, v in sorted(build_env.items())),
                *([f"tree {tree['pin']} over {tree['over']} +{tree['local']} {TREE_SCHEME}"] if tree else []),
                INSTALL_SCHEME,
            ]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:12]
    cfg = config()[name]
    with open(lock_path(name), "rb") as fh:
        lock = fh.read()
    py = subprocess.run(
        [python_for(cfg["python"]), "-c", "import sys; print(sys.version)"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    return hashlib.sha256(lock + py.encode() + INSTALL_SCHEME.encode()).hexdigest()[:12]


def pip(venv: str, *args: str, env: dict[str, str] | None = None) -> None:
    """Run pip in ``venv`` (``env``: variables added to the environment); drops the machine's
    noise about absent local index folders."""
    cmd = [os.path.join(venv, "bin", "python"), "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **env} if env else None)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "is ignored: it is neither a file nor a directory" not in line:
            sys.stderr.write(line)
    if proc.wait() != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def _link(link: str, target: str) -> None:
    os.makedirs(os.path.dirname(link), exist_ok=True)
    if os.path.islink(link) or os.path.exists(link):
        if os.path.islink(link) and os.readlink(link) == target:
            return
        if os.path.isdir(link) and not os.path.islink(link):
            shutil.rmtree(link)
    # A new link renamed over the old one: atomic, so environments built at once cannot race.
    tmp = f"{link}.{os.getpid()}.{threading.get_ident()}"
    os.symlink(target, tmp)
    os.replace(tmp, link)


def ensure(name: str) -> str:
    """The venv of ``name``, built from its lock file (or as an overlay of its base) unless a
    complete one exists; for an environment that ``runs_in`` another, that one's. With ``shims``
    the venv gets replay_test_shims.pth (:func:`write_shims_pth`)."""
    target = runs_in_of(name)
    if target:
        path = ensure(target)
        if test_env_of(name)[1]:
            write_shims_pth(path)
        _link(os.path.join(ROOT, ".venvs", name), path)
        return path
    overlay = overlay_of(name)
    path = os.path.join(venv_root(), f"{name}-{env_key(name)}")
    if not os.path.exists(os.path.join(path, ".complete")):
        start = time.time()
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(venv_root(), exist_ok=True)
        if overlay:
            base, pins, remove = overlay
            base_path = ensure(base)
            log(
                f"building {name} in {path}: {base}"
                + "".join(f" + {p}" for p in pins)
                + "".join(f" - {r}" for r in remove)
            )
            built, build_env = built_of(name)
            tree = tree_of(name)
            if tree:
                log(f"{name}: the Python tree of {tree['pin']} over {base}'s {tree['over']}")
            build_overlay(base_path, path, pins, remove, unmet_of(name), built, build_env, tree)
        else:
            log(f"building {name} in {path} (Python {python_of(name)}, {lock_path(name)})")
            subprocess.run([python_for(python_of(name)), "-m", "venv", path], check=True)
            pip(path, "install", "-q", "--upgrade", "pip")
            pip(path, "install", "-q", "--no-deps", "-r", lock_path(name))
        with open(os.path.join(path, ".complete"), "w") as fh:
            fh.write(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        log(f"built {name} in {time.time() - start:.0f} s")
        for old in glob.glob(os.path.join(venv_root(), f"{name}-" + "[0-9a-f]" * 12)):
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    if test_env_of(name)[1]:
        write_shims_pth(path)
    _link(os.path.join(ROOT, ".venvs", name), path)
    if name == "main":
        _link(os.path.join(ROOT, ".venv"), path)
    return path


def _clone_file(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system: copy
        shutil.copy2(src, dst)


def clone_venv(src: str, dst: str) -> None:
    """``dst``: the venv ``src`` with every file hard-linked (symlinks kept, the completion mark
    left out), its scripts and pyvenv.cfg rewritten to name ``dst`` (as new files: the links to
    ``src``'s are broken, ``src`` is unchanged)."""
    # GNU cp links a 65,000-file venv in ~3 s, shutil.copytree in ~12 s.
    linked = sys.platform.startswith("linux") and subprocess.run(["cp", "-a", "--link", src, dst]).returncode == 0
    if not linked:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, symlinks=True, copy_function=_clone_file)
    os.unlink(os.path.join(dst, ".complete"))
    old, new = src.encode(), dst.encode()
    for path in [os.path.join(dst, "pyvenv.cfg"), *glob.glob(os.path.join(dst, "bin", "*"))]:
        if os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        if old not in data:
            continue
        tmp = path + ".rewrite"
        with open(tmp, "wb") as fh:
            fh.write(data.replace(old, new))
        shutil.copymode(path, tmp)
        os.replace(tmp, path)


def _pip_check(venv: str, names: set[str]) -> dict[str, str]:
    """``pip check`` complaints of ``venv``, keyed by the line with the versions of the
    distributions in ``names`` (normalised) left out, so that an overlay's and its base's compare."""
    out = subprocess.run(
        [os.path.join(venv, "bin", "python"), "-m", "pip", "--disable-pip-version-check", "check"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ).stdout
    lines = {}
    for line in out.splitlines():
        if line.strip() == "No broken requirements found.":
            continue
        key = line
        m = re.match(r"(\S+) (\S+) (.*)", key)
        if m and _norm(m.group(1)) in names:
            key = f"{m.group(1)} * {m.group(3)}"
        m = re.match(r"(.* but you have )(\S+) (\S+)\.$", key)
        if m and _norm(m.group(2)) in names:
            key = f"{m.group(1)}{m.group(2)} *."
        lines[key] = line
    return lines


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _required(line: str) -> str | None:
    """The distribution a ``pip check`` line says is missing or at the wrong version."""
    m = re.search(r" requires (\S+), which is not installed\.$", line) or re.search(
        r" has requirement ([A-Za-z0-9][A-Za-z0-9_.\-]*)", line
    )
    return _norm(m.group(1)) if m else None


def build_overlay(
    base: str,
    path: str,
    pins: list[str],
    remove: Sequence[str] = (),
    unmet: Sequence[str] = (),
    built: Sequence[str] = (),
    build_env: dict[str, str] | None = None,
    tree: dict[str, str] | None = None,
) -> None:
    """The overlay venv at ``path``: ``base`` cloned, the distributions in ``remove`` uninstalled,
    ``pins`` installed over it (--no-deps), then ``built`` built from source against it
    (--no-build-isolation, ``build_env`` set; see :func:`built_of`), then ``tree`` laid over it
    (:func:`lay_tree`). SystemExit when the overlay breaks a requirement ``pip check`` found met
    in ``base``, except requirements on a distribution in ``unmet`` (logged), and when a
    distribution in ``unmet`` is not lacking."""
    clone_venv(base, path)
    if remove:
        pip(path, "uninstall", "-q", "-y", *remove)
    if pins:
        pip(path, "install", "-q", "--no-deps", *pins)
    if built:
        pip(
            path,
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-binary",
            ",".join(_norm(b.partition("==")[0]) for b in built),
            *built,
            env=build_env,
        )
    if tree:
        try:
            lay_tree(path, release_wheel(base, tree["pin"]), tree["over"], tree["local"])
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
    trees = [tree["pin"], tree["over"]] if tree else []
    what = " ".join([*pins, *(f"(tree {tree['pin']})" for _ in [tree] if tree)])
    names = {_norm(p.partition("==")[0]) for p in [*pins, *built, *trees]} | {_norm(r) for r in remove}
    after, before = _pip_check(path, names), _pip_check(base, names)
    broken = sorted(line for key, line in after.items() if key not in before)
    accepted = [line for line in broken if _required(line) in {_norm(u) for u in unmet}]
    for line in accepted:
        log(f"accepted (unmet in envs.toml): {line}")
    stale = sorted({_norm(u) for u in unmet} - {_required(line) for line in accepted})
    broken = [line for line in broken if line not in accepted]
    if stale and not broken:
        shutil.rmtree(path, ignore_errors=True)
        raise SystemExit(
            f"overlay {what}: unmet lists {', '.join(stale)}, but no requirement on it is unmet: "
            "remove it from unmet in envs/envs.toml"
        )
    if broken:
        shutil.rmtree(path, ignore_errors=True)
        raise SystemExit(
            f"overlay {what} breaks requirements that held in {base}:\n  "
            + "\n  ".join(broken)
            + "\nadd the pins they need to the overlay"
        )


def wheel_cache() -> str:
    """Where release wheels downloaded for ``tree`` overlays are kept, beside the venvs."""
    return os.path.join(venv_root(), "wheels")


def release_wheel(venv: str, pin: str) -> str:
    """The wheel of the PyPI release ``pin`` for ``venv``'s interpreter and platform, downloaded
    with pip (--no-deps, binary only) into :func:`wheel_cache` unless a wheel of that release is
    there already (a cache hit downloads nothing)."""
    dist, _, version = pin.partition("==")
    stem = f"{re.sub(r'[-_.]+', '_', dist).lower()}-{version}-"
    cache = wheel_cache()
    found = sorted(w for w in glob.glob(os.path.join(cache, "*.whl")) if os.path.basename(w).lower().startswith(stem))
    if found:
        log(f"{pin}: cached {found[0]}")
        return found[0]
    os.makedirs(cache, exist_ok=True)
    start = time.time()
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        pip(venv, "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp, pin)
        (wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
        dest = os.path.join(cache, os.path.basename(wheel))
        os.replace(wheel, dest)  # whole or not at all: a killed download leaves no wheel behind
    log(
        f"{pin}: downloaded {os.path.basename(dest)} ({os.path.getsize(dest) >> 20} MiB) in {time.time() - start:.0f} s"
    )
    return dest


def _compiled(name: str) -> bool:
    """A shared object (``x.so``, ``x.abi3.so``, ``libx.so.1``)."""
    base = os.path.basename(name)
    return base.endswith(".so") or ".so." in base


def _tree_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> bool:
    """Whether a wheel file goes into a tree overlay (see TREE_SCHEME): not a shared object, an
    executable (ELF) or a C/C++/CUDA source or header."""
    if info.is_dir() or _compiled(info.filename) or info.filename.endswith(TREE_SOURCE_SUFFIXES):
        return False
    with zf.open(info) as fh:
        return fh.read(4) != b"\x7fELF"


def lay_tree(venv: str, wheel: str, over: str, local: str) -> None:
    """Replace the files of the installed distribution ``over`` in ``venv`` by the Python tree of
    ``wheel`` (an official release: its import packages minus shared objects, executables and
    C/C++/CUDA files), keeping ``over``'s own shared objects, and install a dist-info naming the
    wheel's distribution at its version with the local label ``local`` (vLLM finds its CPU build
    by "cpu" in ``version("vllm")``). ``over``'s files are unlinked, never written into (they are
    hard links of the base venv's); its dist-info is removed (the tree's replaces it). The new
    dist-info's METADATA has no requirements: the base's distributions are what the tree runs on,
    not the release's pins (vllm 0.34.0 pins a CUDA torch 2.14)."""
    (site,) = glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))
    infos = glob.glob(os.path.join(site, f"{re.sub(r'[-_.]+', '_', over).lower()}-*.dist-info")) + glob.glob(
        os.path.join(site, f"{re.sub(r'[-_.]+', '[-_.]', over)}-*.dist-info")
    )
    infos = sorted(set(infos))
    if len(infos) != 1:
        raise SystemExit(f"tree over {over}: expected one {over} dist-info in {site}, found {infos}")
    with zipfile.ZipFile(wheel) as zf:
        members = zf.infolist()
        meta_dir = next(i.filename.split("/")[0] for i in members if i.filename.endswith(".dist-info/METADATA"))
        dist, version = meta_dir[: -len(".dist-info")].split("-")
        tops = sorted(
            {
                i.filename.split("/")[0]
                for i in members
                if "/" in i.filename and not i.filename.split("/")[0].endswith((".dist-info", ".data"))
            }
        )
        missing = [t for t in tops if not os.path.isdir(os.path.join(site, t))]
        if missing:
            raise SystemExit(f"tree {os.path.basename(wheel)}: {over} in {site} has no {missing}")
        kept = 0
        for top in tops:
            for root, dirs, files in os.walk(os.path.join(site, top), topdown=False):
                for f in files:
                    if _compiled(f):
                        kept += 1
                    else:
                        os.unlink(os.path.join(root, f))
                for d in dirs:
                    full = os.path.join(root, d)
                    if not os.path.islink(full) and not os.listdir(full):
                        os.rmdir(full)
        shutil.rmtree(infos[0])
        written = []
        for info in members:
            top = info.filename.split("/")[0]
            if top not in tops or not _tree_member(zf, info):
                continue
            dest = os.path.join(site, *info.filename.split("/"))
            if os.path.lexists(dest):
                raise SystemExit(f"tree {os.path.basename(wheel)}: {info.filename} would overwrite a kept file")
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with zf.open(info) as src, open(dest, "xb") as out:
                shutil.copyfileobj(src, out)
            written.append(info.filename)
        entry_points = f"{meta_dir}/entry_points.txt"
        entry_text = zf.read(entry_points) if entry_points in zf.namelist() else b""
    full_version = f"{version}+{local}" if local else version
    info_dir = f"{dist}-{full_version}.dist-info"
    os.makedirs(os.path.join(site, info_dir))
    files = {
        "METADATA": (
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {full_version}\n"
            f"Summary: the Python files of {os.path.basename(wheel)} over {os.path.basename(infos[0])}'s "
            "compiled binaries (a scripts/envs.py tree overlay)\n"
        ).encode(),
        "INSTALLER": b"replay-plugin scripts/envs.py\n",
        "top_level.txt": "".join(f"{t}\n" for t in tops).encode(),
        **({"entry_points.txt": entry_text} if entry_text else {}),
    }
    for fname, data in files.items():
        with open(os.path.join(site, info_dir, fname), "xb") as out:
            out.write(data)
    # RECORD (no hashes): pip can uninstall it, and `pip show -f` lists the tree and the binaries.
    record = [
        os.path.relpath(os.path.join(r, f), site)
        for t in tops
        for r, _, fs in os.walk(os.path.join(site, t))
        for f in fs
    ]
    record += [f"{info_dir}/{fname}" for fname in [*files, "RECORD"]]
    with open(os.path.join(site, info_dir, "RECORD"), "x") as out:
        out.write("".join(f"{r},,\n" for r in sorted(record)))
    log(f"tree {dist} {full_version}: {len(written)} files from {os.path.basename(wheel)}, {kept} shared objects kept")
    subprocess.run(
        [
            os.path.join(venv, "bin", "python"),
            "-m",
            "compileall",
            "-q",
            "-j",
            "0",
            *(os.path.join(site, t) for t in tops),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def _requires(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = line.split(":", 1)[1].strip()
            if "extra ==" in req:
                continue
            pkg = req.replace(">", " ").replace("<", " ").replace("=", " ").replace(";", " ").replace("!", " ")
            pkg = pkg.replace("[", " ").split()[0].lower()
            if pkg not in TORCH_FAMILY:
                reqs.append(req)
    return reqs


def lock(name: str) -> None:
    """Resolve envs/NAME.in (plus the Requires-Dist of its no_deps packages, minus the torch
    family) in a scratch venv and write the exact versions to envs/NAME.lock."""
    if overlay_of(name):
        raise SystemExit(f"{name} is an overlay environment: its pins are `overlay` in envs/envs.toml")
    if runs_in_of(name):
        raise SystemExit(f"{name} runs in {runs_in_of(name)}'s venv: lock that one")
    cfg = config()[name]
    with tempfile.TemporaryDirectory() as tmp:
        venv = os.path.join(tmp, "venv")
        subprocess.run([python_for(cfg["python"]), "-m", "venv", venv], check=True)
        pip(venv, "install", "-q", "--upgrade", "pip")
        torch = [r for r in _in_lines(os.path.join(ENVS_DIR, f"{name}.in")) if r.startswith("torch==")]
        if torch:
            pip(venv, "install", *torch)  # first: the other packages then keep it
        extra: list[str] = []
        wheels = []
        for req in cfg.get("no_deps", []):
            d = os.path.join(tmp, "dl")
            pip(venv, "download", "-q", "--no-deps", "-d", d, req)
            wheels = glob.glob(os.path.join(d, "*.whl"))
        for w in wheels:
            extra += _requires(w)
        reqfile = os.path.join(tmp, "extra.txt")
        with open(reqfile, "w") as fh:
            fh.write("\n".join(extra) + "\n")
        pip(venv, "install", "-r", os.path.join(ENVS_DIR, f"{name}.in"), "-r", reqfile)
        if wheels:
            pip(venv, "install", "--no-deps", *wheels)
        frozen = subprocess.run(
            [os.path.join(venv, "bin", "python"), "-m", "pip", "list", "--format=freeze", "--exclude", "pip"],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        ).stdout
    lines = sorted(
        (ln for ln in frozen.splitlines() if ln and not ln.lower().startswith("replay-plugin")), key=str.lower
    )
    with open(lock_path(name), "w") as fh:
        fh.write(f"# Generated by `python3 scripts/envs.py lock {name}` from envs/{name}.in; do not edit.\n")
        fh.write("\n".join(lines) + "\n")
    log(f"wrote {lock_path(name)} ({len(lines)} packages)")


def build_wheel() -> str:
    """Build the plugin wheel with the main env's hatchling (no network) into dist/."""
    venv = ensure("main")
    dist = os.path.join(ROOT, "dist")
    shutil.rmtree(dist, ignore_errors=True)
    subprocess.run(
        [
            os.path.join(venv, "bin", "python"),
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            dist,
            ROOT,
        ],
        check=True,
    )
    (wheel,) = glob.glob(os.path.join(dist, "replay_plugin-*.whl"))
    return wheel


def install_wheel(venv: str, wheel: str) -> None:
    # pip moves an installed package aside as ``~<name minus its first letter>...`` before it
    # removes it; a run killed during the reinstall leaves that behind, and ``replay-plugin
    # doctor`` (rightly) reports it in every later run. Only the plugin's own leftovers: the
    # plugin is all this venv ever gets reinstalled.
    for leftover in glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "~eplay[_-]plugin*")):
        log(f"removing pip's leftover {leftover} (an earlier install was interrupted)")
        if os.path.isdir(leftover) and not os.path.islink(leftover):
            shutil.rmtree(leftover)
        else:
            os.unlink(leftover)
    pip(venv, "install", "-q", "--no-deps", "--force-reinstall", wheel)


def read_upstream_counts(report_paths: list[str]) -> tuple[dict, list[str]]:
    """Per upstream, the summed test counts of the pytest runs' reports (an environment's parts
    each write one), and why a report could not be read."""
    counts: dict[str, dict[str, int]] = {}
    problems = []
    for path in report_paths:
        try:
            with open(path) as fh:
                part = json.load(fh)["upstreams"]
        except (OSError, ValueError, KeyError) as exc:
            problems.append(f"no upstream report from pytest ({path}: {exc})")
            continue
        for up, c in part.items():
            total = counts.setdefault(up, {})
            for outcome, n in c.items():
                total[outcome] = total.get(outcome, 0) + n
    return counts, problems


def upstream_failures(name: str, report_paths: list[str], declared: list[str]) -> list[str]:
    """Why the upstream reports of an environment's pytest runs fail it (empty: they do not)."""
    counts, problems = read_upstream_counts(report_paths)
    if problems:
        return problems
    log(
        f"[{name}] tests per upstream: "
        + ", ".join(
            f"{up} {c.get('passed', 0)} passed/{c.get('skipped', 0)} skipped/{c.get('failed', 0)} failed"
            for up, c in sorted(counts.items())
        )
        if counts
        else f"[{name}] no test declared an upstream"
    )
    for up in declared:
        c = counts.get(up)
        if c is None:
            problems.append(f"upstream {up}: no test declared it with need()")
        elif c.get("passed", 0) == 0:
            problems.append(
                f"upstream {up}: no test passed ({c.get('skipped', 0)} skipped, {c.get('failed', 0)} failed)"
            )
    return problems


def runs_subset(pytest_args: list[str]) -> bool:
    """Whether extra pytest arguments select a subset of the tests: a path (or an option's
    value) or one of SUBSET_OPTIONS. Output options such as -q, -v, -s do not."""
    return any(not a.startswith("-") or a.startswith(SUBSET_OPTIONS) for a in pytest_args)


def _test_path(arg: str) -> str | None:
    """``arg`` as an absolute test path (``file.py::test`` too) when it names an existing path,
    relative to the working directory or to the checkout; else None."""
    if arg.startswith("-"):
        return None
    path, sep, node = arg.partition("::")
    for base in (os.getcwd(), ROOT):
        full = os.path.join(base, path)
        if os.path.exists(full):
            return os.path.abspath(full) + sep + node
    return None


def test_jobs() -> int:
    """How many pytest runs go at once: ``$REPLAY_TEST_JOBS``, else 2 (or 1 on a one-core
    machine). On the 2-core CI machine two took the warm run from 33 to 17-19 minutes (the
    suites are mostly single-threaded: interpreter start-ups, upstream imports, engine starts)."""
    value = os.environ.get("REPLAY_TEST_JOBS")
    if value:
        try:
            jobs = int(value)
        except ValueError:
            raise SystemExit(f"REPLAY_TEST_JOBS={value!r}: expected a positive integer") from None
        if jobs < 1:
            raise SystemExit(f"REPLAY_TEST_JOBS={value!r}: expected a positive integer")
        return jobs
    return min(2, os.cpu_count() or 1)


_ensure_locks: dict[str, threading.Lock] = {}
_ensure_locks_guard = threading.Lock()


def ensure_locked(name: str) -> str:
    """``ensure(name)`` safe to call from several threads: an overlay and another overlay of the
    same base build that base once (locks are taken overlay first, then base: no cycle)."""
    with _ensure_locks_guard:
        lock = _ensure_locks.setdefault(name, threading.Lock())
    with lock:
        target = runs_in_of(name)
        if target:
            ensure_locked(target)
        overlay = overlay_of(name)
        if overlay:
            ensure_locked(overlay[0])
        return ensure(name)


def test_parts(name: str, cfg: dict) -> list[list[str]]:
    """The pytest runs of an environment, as test paths relative to the checkout: each of its
    ``parts`` (lists of paths, under its ``tests``) runs alone, and its ``tests`` run with the
    parts' paths ignored. Parts let the 2-core CI machine test one large environment in two
    processes at once; the upstream check sums their reports."""
    entry = cfg[name]
    parts = entry.get("parts", [])
    if not isinstance(parts, list) or not all(isinstance(p, list) and p for p in parts):
        raise SystemExit(f"env {name}: parts must be a list of non-empty lists of test paths, got {parts!r}")
    carved = [path for part in parts for path in part]
    for path in carved:
        if not any(path == t or path.startswith(t.rstrip("/") + "/") for t in entry["tests"]):
            raise SystemExit(f"env {name}: part path {path!r} is not under its tests {entry['tests']}")
    # pytest does not --ignore a path given as an argument: a part equal to a test path is
    # dropped from the rest, a part under one is ignored there.
    rest = [t for t in entry["tests"] if t not in carved]
    return [[*rest, *(f"--ignore={path}" for path in carved if path not in entry["tests"])], *parts]


_installed: set[str] = set()


def _venv_with_wheel(name: str, wheel: str) -> str:
    """The venv of ``name`` with the plugin wheel installed (once per venv and run, however many
    parts, and however many environments run in it)."""
    venv = ensure_locked(name)
    with _ensure_locks_guard:
        lock = _ensure_locks.setdefault(f"install:{venv}", threading.Lock())
    with lock:
        if venv not in _installed:
            install_wheel(venv, wheel)
            _installed.add(venv)
    return venv


def _run_pytest(
    name: str,
    label: str,
    venv: str,
    wheel: str,
    cfg: dict,
    tests: list[str],
    pytest_args: list[str],
    output: str | None,
) -> tuple[list[str], str]:
    """One pytest run in ``venv``: its failures (other than the upstream check) and the path of
    its upstream report."""
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("REPLAY_PLUGIN_"):
            del env[k]
    report_dir = tempfile.mkdtemp(prefix=f"replay-test-{label.replace('/', '-')}-")
    report = os.path.join(report_dir, "upstreams.json")  # tests/conftest.py writes it
    variables, shims = test_env_of(name, cfg)
    env.pop("REPLAY_TEST_SHIMS", None)
    env.update(variables)
    if shims:
        env["REPLAY_TEST_SHIMS"] = os.pathsep.join(shims)
    env.update(
        REPLAY_TEST_ENV=name,
        REPLAY_TEST_UPSTREAMS=",".join(cfg[name]["upstreams"]),
        REPLAY_TEST_WHEEL=wheel,
        REPLAY_TEST_REPORT=report,
        PATH=os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""),
    )
    env.pop("PYTHONPATH", None)
    # Test paths among the extra arguments replace the environment's own.
    paths = [_test_path(a) for a in pytest_args]
    args = [p or a for p, a in zip(paths, pytest_args)]
    own = [] if any(paths) else [_rooted(t) for t in tests]
    cmd = [
        os.path.join(venv, "bin", "python"),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        ROOT,
        "--durations=12",  # where CI's minutes go (issue 15's budget), in every run's output
        *own,
        *args,
    ]
    log(f"[{label}] {' '.join(cmd[2:])}" + (f" > {output}" if output else ""))
    # Run from a directory outside the checkout so that `import replay_plugin` resolves to
    # the installed wheel, not to the source tree.
    cwd = os.path.join(ROOT, "tests")
    if output:
        with open(output, "w") as fh:
            rc = subprocess.run(cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT).returncode
    else:
        rc = subprocess.run(cmd, env=env, cwd=cwd).returncode
    problems = []
    if rc == 5:
        problems.append(f"{label}: pytest collected no tests (exit 5)")
    elif rc != 0:
        problems.append(f"{label}: pytest exit {rc}")
    return problems, report


def _rooted(test: str) -> str:
    """A test path (or ``--ignore=path``) of envs.toml made absolute."""
    if test.startswith("--ignore="):
        return "--ignore=" + os.path.join(ROOT, test[len("--ignore=") :])
    return os.path.join(ROOT, test)


def run_tests(names: list[str], pytest_args: list[str]) -> int:
    """Test ``names`` (default: every test environment): each environment's pytest runs (its
    ``parts``, see ``test_parts``) go to a pool of ``test_jobs()`` workers in envs.toml order
    (list the longest first). With more than one worker each run's output goes to a file,
    printed whole when the run ends (interleaved lines would be unreadable)."""
    cfg = config()
    for name in names:
        if name not in cfg:
            raise SystemExit(f"no environment {name!r} in envs/envs.toml")
        if not cfg[name].get("tests"):
            raise SystemExit(f"{name!r} is not a test environment (no `tests` in envs/envs.toml)")
    names = names or test_envs(cfg)
    wheel = build_wheel()
    log(f"wheel {wheel}")
    # Extra test paths replace an environment's own: then it is one run.
    explicit = any(_test_path(a) for a in pytest_args)
    runs = [(name, i, tests) for name in names for i, tests in enumerate([[]] if explicit else test_parts(name, cfg))]
    jobs = min(test_jobs(), len(runs))
    outputs = tempfile.mkdtemp(prefix="replay-test-output-")
    printing = threading.Lock()

    def one(run: tuple[str, int, list[str]]) -> tuple[list[str], str | None, float]:
        name, index, tests = run
        label = name if index == 0 else f"{name}/part{index}"
        output = os.path.join(outputs, f"{label.replace('/', '-')}.log") if jobs > 1 else None
        start = time.time()
        report = None
        try:
            venv = _venv_with_wheel(name, wheel)
            problems, report = _run_pytest(name, label, venv, wheel, cfg, tests, pytest_args, output)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a failed build fails this environment only
            problems = [f"{label}: {type(exc).__name__}: {exc}"]
        secs = time.time() - start
        if output and os.path.exists(output):
            with printing, open(output) as fh:
                print(f"\n======== {label}: pytest output ========", flush=True)
                shutil.copyfileobj(fh, sys.stdout)
                sys.stdout.flush()
        for p in problems:
            log(f"[{label}] FAILED: {p}")
        log(f"[{label}] pytest run {'passed' if not problems else 'FAILED'} in {secs:.0f} s")
        return problems, report, secs

    if jobs > 1:
        log(f"{len(runs)} pytest runs in {len(names)} environments, {jobs} at a time (REPLAY_TEST_JOBS)")
    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(one, runs))
    shutil.rmtree(outputs, ignore_errors=True)
    summary = []
    for name in names:
        mine = [r for (n, _, _), r in zip(runs, results) if n == name]
        problems = [p for r in mine for p in r[0]]
        empty = [p for p in problems if p.endswith("(exit 5)")]
        if empty and len(empty) < len(mine) and runs_subset(pytest_args):
            # -k / -m select within each part: a part left empty is fine if another ran tests
            problems = [p for p in problems if p not in empty]
        reports = [r[1] for r in mine if r[1] is not None]
        uncovered = upstream_failures(name, reports, list(cfg[name]["upstreams"])) if reports else []
        for r in reports:
            shutil.rmtree(os.path.dirname(r), ignore_errors=True)
        if uncovered and runs_subset(pytest_args):
            for p in uncovered:
                log(f"[{name}] not enforced (the pytest arguments select a subset): {p}")
        else:
            problems += uncovered
        summary.append((name, problems, sum(r[2] for r in mine)))
    for name, problems, secs in summary:
        verdict = "passed" if not problems else "FAILED (" + "; ".join(problems) + ")"
        log(f"{name}: {verdict} ({secs:.0f} s of pytest runs)")
    log(f"all environments: {time.time() - start:.0f} s wall clock")
    return 0 if all(not problems for _, problems, _ in summary) else 1


def _lint_env() -> tuple[str, dict[str, str]]:
    venv = ensure(LINT_ENV)
    env = dict(os.environ, PATH=os.path.join(venv, "bin") + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PYTHONPATH", None)
    env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's banner about MkDocs 2.0 on every build
    return venv, env


def run_docs(site_dir: str | None = None) -> int:
    """``mkdocs build --strict`` of mkdocs.yml in the lint environment, into ``site_dir`` or a
    temporary directory (removed afterwards: the site is never written into the checkout)."""
    venv, env = _lint_env()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*DOCS_COMMAND, site_dir or os.path.join(tmp, "site")]
        log(f"[lint] {' '.join(cmd)}")
        start = time.time()
        rc = subprocess.run([os.path.join(venv, "bin", cmd[0]), *cmd[1:]], env=env, cwd=ROOT).returncode
    log(f"docs site: {'built' if rc == 0 else f'FAILED (exit {rc})'} in {time.time() - start:.1f} s")
    return rc


def run_lint() -> int:
    """ruff check, ruff format --check and mypy (configured in pyproject.toml), then the docs
    site (:func:`run_docs`), in the lint environment, from the checkout; every command runs and
    any failure fails the step."""
    venv, env = _lint_env()
    failed = []
    for cmd in LINT_COMMANDS:
        log(f"[lint] {' '.join(cmd)}")
        rc = subprocess.run([os.path.join(venv, "bin", cmd[0]), *cmd[1:]], env=env, cwd=ROOT).returncode
        if rc != 0:
            failed.append(f"{' '.join(cmd)} (exit {rc})")
    rc = run_docs()
    if rc != 0:
        failed.append(f"{' '.join(DOCS_COMMAND[:3])} (exit {rc})")
    log("lint: passed" if not failed else f"lint: FAILED: {'; '.join(failed)}")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    extra: list[str] = []
    if "--" in rest:
        i = rest.index("--")
        rest, extra = rest[:i], rest[i + 1 :]
    if cmd == "ensure":
        for name in rest:
            print(ensure(name))
        return 0
    if cmd == "lock":
        cfg = config()
        for name in rest or [n for n in cfg if not overlay_of(n, cfg) and not runs_in_of(n, cfg)]:
            lock(name)
        return 0
    if cmd == "wheel":
        print(build_wheel())
        return 0
    if cmd == "install":
        wheel = build_wheel()
        for name in rest:
            install_wheel(ensure(name), wheel)
        return 0
    if cmd == "test":
        return run_tests(rest, extra)
    if cmd == "lint":
        return run_lint()
    if cmd == "docs":
        if len(rest) > 1:
            raise SystemExit("usage: envs.py docs [SITE_DIR]")
        return run_docs(os.path.abspath(rest[0]) if rest else None)
    if cmd == "run":
        (name,) = rest
        venv = ensure(name)
        variables, shims = test_env_of(name)
        env = dict(os.environ, **variables, PATH=os.path.join(venv, "bin") + os.pathsep + os.environ.get("PATH", ""))
        env.pop("REPLAY_TEST_SHIMS", None)
        if shims:  # as in the environment's pytest runs
            env["REPLAY_TEST_SHIMS"] = os.pathsep.join(shims)
        return subprocess.run(extra, env=env).returncode
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
