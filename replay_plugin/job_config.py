"""A framework job's config (SkyRL, verl) as the doctor reads it: flat ``{dotted key: value}``,
each value as the framework itself would read it.

Used by ``skyrl/doctor.py`` and ``verl/doctor.py``. The doctor is given either the job's overrides
as one string (split into words as a shell would split the launch line, ``shlex``) or a YAML file:

- verl 0.9.1 reads its command line with Hydra: each word through Hydra's override grammar
  (``hydra.core.override_parser``: ``1`` an int, ``inf``/``nan`` floats, ``0x14`` a string,
  ``{a:b}`` a dict, ``~key`` / ``~key=value`` deletions, ``+key`` / ``++key`` additions), merged
  into the config with OmegaConf's ``update`` (a later word replaces or merges into an earlier one,
  ``+`` refuses a key that already holds a value);
- SkyRL 0.4.0 reads its command line with ``OmegaConf.from_cli`` (``SkyRLTrainConfig.
  from_cli_overrides``: each value a YAML 1.1 scalar, so ``yes`` is true, ``0x14`` is 20 and
  ``inf`` a string) and refuses a ``+`` prefix;
- a YAML file (verl's resolved config, a SkyRL config dump) is read with ``OmegaConf.load``.

Interpolations (``${oc.env:VAR}``) are resolved as the frameworks resolve them. The values are
judged the way the frameworks consume them: a flag is on when Python finds it true (``if
config.enable_...:`` in both), so ``1`` is on and ``false`` is off.

Input the framework would refuse, and input no parser can read (a missing file, bad YAML, a
word Hydra's grammar rejects), raise :class:`ConfigError` naming the input and the fix; the
doctor reports it as a finding. The parsers are the frameworks' own dependencies (hydra-core for
verl, omegaconf for both); where one is not importable the doctor says so rather than guess.
Nothing of verl or SkyRL themselves is imported.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping
from typing import Any


class ConfigError(ValueError):
    """A job config the doctor cannot read, or that the framework's own parser would refuse.

    Attributes ``source`` (the override word or the file, as given), ``problem`` and ``fix``."""

    def __init__(self, source: str, problem: str, fix: str) -> None:
        super().__init__(f"{source!r}: {problem}")
        self.source = source
        self.problem = f"{source!r}: {problem}"
        self.fix = fix


def parse_config(config: str | Mapping[str, Any], framework: str) -> dict[str, Any]:
    """The config of a ``framework`` job ("verl" or "SkyRL") as a flat ``{dotted key: value}``:
    from its command-line overrides, a YAML file, or a mapping (taken as it is)."""
    if isinstance(config, Mapping):
        return _flatten(config)
    if framework not in _OVERRIDE_READERS:
        raise ValueError(f"framework {framework!r}: expected one of {', '.join(_OVERRIDE_READERS)}")
    if os.path.isfile(config):  # a path with a space or an '=' in it
        return _flatten(_load_file(config, framework))
    try:
        words = shlex.split(config)
    except ValueError as exc:  # an unclosed quote
        raise ConfigError(config, f"cannot be split into words as a shell would: {exc}", _QUOTE_FIX) from None
    if len(words) == 1 and _is_path(words[0]):
        return _flatten(_load_file(words[0], framework))
    return _flatten(_OVERRIDE_READERS[framework](words))


_QUOTE_FIX = (
    "close the quote; quote each override that holds a space as one shell word, as on the launch line: "
    "'trainer.experiment_name=\"my run\"' or 'KEY={a: b}'"
)


def _is_path(word: str) -> bool:
    """A lone word without ``=`` names a file; ``~key`` (Hydra's deletion) does not, ``~/x.yaml`` does."""
    return "=" not in word and not (word.startswith("~") and "/" not in word)


def _omegaconf(framework: str, what: str) -> Any:
    try:
        import omegaconf
    except ImportError:
        raise ConfigError(
            what,
            f"cannot be read here: omegaconf ({framework}'s config library) is not importable in {_python()}",
            f"run the doctor with the job's Python environment (where {framework} is installed)",
        ) from None
    return omegaconf


def _python() -> str:
    import sys

    return sys.executable


def _load_file(path: str, framework: str) -> Any:
    """A YAML file of the job's config: its mapping, read by OmegaConf (as Hydra saves and loads
    configs); every way it can fail is named."""
    omegaconf = _omegaconf(framework, path)
    import yaml

    fix = f"give the path of a YAML file of {framework}'s config, or its overrides (KEY=VALUE ...)"
    path = os.path.expanduser(path)  # '~/job.yaml' given in quotes, which the shell left as it is
    if not os.path.exists(path):
        problem = "no such file" + ("" if os.path.isabs(path) else f" (relative to {os.getcwd()})")
        raise ConfigError(path, problem + f"; a {framework} override has the form KEY=VALUE", fix)
    if os.path.isdir(path):
        raise ConfigError(path, "is a directory, not a YAML file", fix)
    try:
        doc = omegaconf.OmegaConf.load(path)
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"is not UTF-8 text ({exc.reason} at byte {exc.start})", fix) from None
    except OSError as exc:
        raise ConfigError(path, f"cannot be read: {exc.strerror or exc}", fix) from None
    except (yaml.YAMLError, omegaconf.errors.OmegaConfBaseException) as exc:
        raise ConfigError(path, f"is not valid YAML: {_one_line(exc)}", "correct the file's YAML syntax") from None
    if not isinstance(doc, omegaconf.DictConfig):
        raise ConfigError(
            path, f"holds a {type(doc).__name__} at its top level, not a mapping of {framework} config keys", fix
        )
    return _resolved(doc, path, framework)


def _resolved(cfg: Any, source: str, framework: str) -> Any:
    """The plain container of an OmegaConf config with its interpolations resolved (both
    frameworks resolve the whole config before they read it)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(
            source,
            f"holds an interpolation the doctor cannot resolve: {_one_line(exc)}",
            f"give the value itself: the doctor reads the job's own overrides, not {framework}'s composed config",
        ) from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# --------------------------------------------------------------------------- verl: Hydra


def _hydra_overrides(words: list[str]) -> Any:
    """verl's overrides read by Hydra's override grammar, applied in order to an empty config the
    way Hydra applies them to verl's (without verl's defaults: a plain ``KEY=VALUE`` of a key verl
    lacks, which Hydra refuses, is read here as given)."""
    omegaconf = _omegaconf("verl", " ".join(words))
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.errors import HydraException
    except ImportError:
        raise ConfigError(
            " ".join(words),
            f"cannot be read here: hydra-core (verl's command-line parser) is not importable in {_python()}",
            "run the doctor with the job's Python environment (where verl is installed), or give it a YAML file "
            "of the job's resolved config",
        ) from None
    from omegaconf import OmegaConf, open_dict

    parser = OverridesParser.create()
    cfg = OmegaConf.create({})
    for word in words:
        try:
            (override,) = parser.parse_overrides([word])
        except HydraException as exc:
            unclosed = word.count("{") > word.count("}") or word.count("[") > word.count("]")
            raise ConfigError(
                word,
                f"is not an override Hydra (verl's command-line parser) can read: {_one_line(exc)}",
                "close its bracket (a value that holds a space is one shell word: 'KEY={a: b}')"
                if unclosed
                else "write it in Hydra's grammar, KEY=VALUE (quote a value with other characters: KEY='VALUE')",
            ) from None
        if override.is_sweep_override():
            raise ConfigError(word, "is a sweep (several values), which runs only under --multirun", "give one value")
        if override.package is not None:
            continue  # a config-group selection (``group@package=option``): it picks a file of verl's, no key here
        key, value = override.key_or_group, override.value()
        try:
            current = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
            if override.is_delete():
                if value is not None and current is not None and value != current:
                    raise ConfigError(
                        word,
                        f"Hydra refuses the deletion: an earlier override set {key} to {current!r}, not {value!r}",
                        f"write ~{key} or ~{key}={current}",
                    )
                parent, _, leaf = key.rpartition(".")
                node = OmegaConf.select(cfg, parent) if parent else cfg
                if isinstance(node, omegaconf.DictConfig) and leaf in node:
                    with open_dict(node):
                        del node[leaf]
            elif override.is_add() and current is not None and not isinstance(value, (dict, list)):
                raise ConfigError(
                    word,
                    f"Hydra refuses it: an earlier override already set {key}",
                    f"drop one of them, or write ++{word.lstrip('+')} to override it",
                )
            else:
                OmegaConf.update(cfg, key, value, merge=True, force_add=True)
        except ConfigError:
            raise
        except (omegaconf.errors.OmegaConfBaseException, ValueError) as exc:  # OmegaConf raises both
            raise ConfigError(word, f"Hydra cannot merge it: {_one_line(exc)}", _MERGE_FIX) from None
    return _resolved(cfg, " ".join(words), "verl")


# --------------------------------------------------------------------------- SkyRL: OmegaConf.from_cli


def _skyrl_overrides(words: list[str]) -> Any:
    """SkyRL's overrides read as ``SkyRLTrainConfig.from_cli_overrides`` reads them: a ``+``
    prefix refused, the rest through ``OmegaConf.from_cli``."""
    omegaconf = _omegaconf("SkyRL", " ".join(words))
    import yaml

    for word in words:
        if word.startswith("+"):
            raise ConfigError(
                word,
                "SkyRL refuses the '+' prefix (SkyRLTrainConfig.from_cli_overrides: its config is a fixed set of "
                "dataclass fields)",
                f"write {word.lstrip('+')}",
            )
        if word.startswith("~"):
            raise ConfigError(
                word,
                "SkyRL's parser (OmegaConf.from_cli) has no deletion: it reads a key named with the '~', which "
                "SkyRL refuses as an invalid field",
                "leave the key out to keep SkyRL's default",
            )
        try:  # one word at a time first, so that an error names its word
            omegaconf.OmegaConf.from_cli([word])
        except (yaml.YAMLError, omegaconf.errors.OmegaConfBaseException, ValueError) as exc:
            raise ConfigError(
                word,
                f"SkyRL's parser (OmegaConf.from_cli, a YAML value) cannot read it: {_one_line(exc)}",
                "quote the value as YAML ('KEY=\"VALUE\"') or correct it",
            ) from None
    try:  # the words together: a later one may not merge into an earlier one (a list, then its key)
        cfg = omegaconf.OmegaConf.from_cli(words)
    except (omegaconf.errors.OmegaConfBaseException, ValueError) as exc:  # OmegaConf raises both
        raise ConfigError(
            " ".join(words), f"SkyRL's parser (OmegaConf.from_cli) cannot merge them: {_one_line(exc)}", _MERGE_FIX
        ) from None
    return _resolved(cfg, " ".join(words), "SkyRL")


_MERGE_FIX = "give each key one value, a mapping or a scalar (not a list and then a key under it)"


_OVERRIDE_READERS: dict[str, Callable[[list[str]], Any]] = {"verl": _hydra_overrides, "SkyRL": _skyrl_overrides}


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def truthy(value: Any) -> bool:
    """Whether a config flag is on, as verl 0.9.1 and SkyRL 0.4.0 consume their flags (``if
    config.trainer.use_v1:``, ``if ie.enable_return_routed_experts:``): Python's truth of the value
    their parser produced (``1`` is on, ``false`` and ``null`` are off, the string ``"false"`` is on)."""
    return bool(value)


def would_apply(name: str, environ: Mapping[str, str]) -> tuple[bool, str]:
    """:func:`replay_plugin.registry.would_apply`, with a toggle that switched the patch off named
    by the value actually set (``REPLAY_PLUGIN_X=''``, not the ``=0`` the registry says for any
    value that reads as off)."""
    from . import registry

    ok, why = registry.would_apply(name, environ)
    spec = registry.get().specs.get(name)
    if not ok and spec is not None and why.startswith("disabled:") and spec.env in environ:
        why = f"disabled: {spec.env}={shlex.quote(environ[spec.env])}"
    return ok, why
