"""A TRL GRPO job's config as the doctor reads it: the ``GRPOConfig`` fields the plugin depends
on, each value as trl 1.16.0's ``TrlParser`` would produce it.

TRL scripts (``trl grpo``, a user's ``TrlParser(...).parse_args_and_config()``) take a YAML file
(``--config cfg.yaml``) and command-line flags (``--top_k 20 --use_vllm true``). ``TrlParser``
(``trl/scripts/utils.py``) reads them so:

- ``--config PATH`` (its first occurrence) is removed from the words; the file is read with
  ``yaml.safe_load`` and must hold a mapping. Its ``env:`` mapping is exported into
  ``os.environ`` there and then; every other key becomes the *default* of the argparse option of
  that name, so a flag given on the command line wins over the file. argparse converts a string
  default with the option's type (``top_k: "20"`` is 20), not any other value (``use_vllm: 1``
  stays 1). Keys no dataclass knows are refused by ``parse_args_and_config()`` and dropped
  without a word with ``fail_with_unknown_args=False``, which ``trl grpo`` passes.
- The flags go through ``HfArgumentParser`` (transformers' ``hf_argparser.py``): ``--top_k`` or
  ``--top-k``, ``--top_k=20``; booleans through ``string_to_bool`` (yes/no, true/false, t/f,
  y/n, 1/0) and alone they mean true; a boolean whose default is true also has ``--no_NAME``. A
  ``dict | str`` field (``generation_kwargs``) arrives as a string: ``TrainingArguments.
  __post_init__`` ``json.loads`` it when it starts with ``{`` (then ``_convert_str_dict`` turns
  the strings "true"/"false" and digit strings inside into bools and numbers) and leaves any
  other string as it is (which TRL's backends then fail to merge).
- ``use_transformers_paged`` (deprecated) sets ``use_transformers_continuous_batching``.

Given as a mapping (the YAML's keys, or ``GRPOConfig(**kwargs)``'s kwargs) the values are taken
as they are; given an object (a ``GRPOConfig``), its attributes. Flags the doctor does not read
are skipped with their values (GRPO's parsers have no positional arguments, so every word up to
the next ``-``-word belongs to the flag before it). Not mirrored: argparse's abbreviations
(``--use_vll`` for ``--use_vllm``), which the doctor reads as a flag it does not know.

Pure: imports neither trl nor transformers. Input TRL's parser would refuse, and input no parser
can read, raises ``replay_plugin.job_config.ConfigError`` naming the word or file and the fix.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..job_config import ConfigError

#: GRPOConfig fields the doctor reads -> (kind, trl 1.16.0's default). ``bool`` fields read with
#: ``string_to_bool``; ``dict`` fields are ``dict | str | None`` (JSON on the command line).
FIELDS: dict[str, tuple[str, Any]] = {
    "temperature": ("float", 1.0),
    "top_p": ("float", 1.0),
    "top_k": ("int", 0),
    "min_p": ("float", None),
    "repetition_penalty": ("float", 1.0),
    "generation_kwargs": ("dict", None),
    "use_vllm": ("bool", False),
    "vllm_mode": ("str", "colocate"),
    "vllm_importance_sampling_correction": ("bool", True),
    "vllm_importance_sampling_mode": ("str", "sequence_mask"),
    "vllm_tensor_parallel_size": ("int", 1),
    "use_transformers_continuous_batching": ("bool", False),
    "use_transformers_paged": ("bool", False),
    "use_cpu": ("bool", False),
    "model_init_kwargs": ("dict", None),
}

_FIX_FILE = "give the path of TRL's YAML config, its command line (--config cfg.yaml --top_k 20 ...) or a mapping"


@dataclass
class TrlJob:
    """The fields of :data:`FIELDS` (given, else TRL's default), the YAML's ``env:`` block, and the
    ``replay_*`` names given where TRL does not pass them to a generation backend."""

    fields: dict[str, Any]
    given: set[str] = field(default_factory=set)
    env: dict[str, str] = field(default_factory=dict)
    stray: list[str] = field(default_factory=list)  # "where: key" of each misplaced replay_* name

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]


def read(config: Any) -> TrlJob:
    """A TRL job's config: a YAML file's path, a YAML/JSON mapping as text (``{...}``), a command
    line (one string, split as a shell splits it, or a list of words), a mapping of GRPOConfig
    keyword arguments, or an object carrying them as attributes (a ``GRPOConfig``)."""
    return _stray_in_generation_kwargs(_read(config))


def _read(config: Any) -> TrlJob:
    if isinstance(config, Mapping):
        return _from_values(dict(config), "the mapping", {})
    if isinstance(config, str):
        text = config.strip()
        if text.startswith("{"):
            return _from_values(_mapping_text(text), "the mapping", {})
        if os.path.isfile(os.path.expanduser(text)):
            return _from_argv(["--config", text])
        try:
            config = shlex.split(text)
        except ValueError as exc:
            raise ConfigError(
                config, f"cannot be split into words as a shell would: {exc}", "close the quote"
            ) from None
    if isinstance(config, Sequence):
        words = [str(w) for w in config]
        if len(words) == 1 and not words[0].startswith("-"):  # a lone word names the YAML file
            return _from_argv(["--config", words[0]])
        return _from_argv(words)
    values = {name: getattr(config, name) for name in FIELDS if hasattr(config, name)}
    return _from_values(values, type(config).__name__, {}, post_init=False)


# --------------------------------------------------------------------------- mapping / YAML


def _mapping_text(text: str) -> dict[str, Any]:
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(text, f"is not a YAML/JSON mapping: {_one_line(exc)}", _FIX_FILE) from None
    if not isinstance(doc, dict):
        raise ConfigError(text, f"holds a {type(doc).__name__}, not a mapping of GRPOConfig fields", _FIX_FILE)
    return doc


def _load_yaml(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``TrlParser``'s reading of ``--config PATH``: (the keys, the ``env:`` block)."""
    import yaml

    full = os.path.expanduser(path)
    if not os.path.exists(full):
        where = "" if os.path.isabs(full) else f" (relative to {os.getcwd()})"
        raise ConfigError(path, f"no such file{where}", _FIX_FILE)
    if os.path.isdir(full):
        raise ConfigError(path, "is a directory, not a YAML file", _FIX_FILE)
    try:
        with open(full, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"is not UTF-8 text ({exc.reason} at byte {exc.start})", _FIX_FILE) from None
    except OSError as exc:
        raise ConfigError(path, f"cannot be read: {exc.strerror or exc}", _FIX_FILE) from None
    except yaml.YAMLError as exc:
        raise ConfigError(path, f"is not valid YAML: {_one_line(exc)}", "correct the file's YAML syntax") from None
    if not isinstance(doc, dict):
        raise ConfigError(path, "TrlParser refuses it: the file must contain a YAML mapping", _FIX_FILE)
    env = doc.pop("env", {})
    if not isinstance(env, dict):
        raise ConfigError(path, "TrlParser refuses it: `env` must be a mapping", "write env: as NAME: value lines")
    return doc, {str(k): str(v) for k, v in env.items()}


def _from_values(values: dict[str, Any], where: str, env: dict[str, str], *, post_init: bool = True) -> TrlJob:
    job = TrlJob(fields={name: default for name, (_, default) in FIELDS.items()}, env=env)
    for key, value in values.items():
        if key in FIELDS:
            job.fields[key] = value
            job.given.add(key)
        elif str(key).lower().startswith("replay"):
            job.stray.append(f"{where}: {key}")
    if post_init:
        _post_init(job, where)
    return job


# --------------------------------------------------------------------------- command line


def _strip_launcher(words: list[str]) -> list[str]:
    """The script's own arguments of a pasted launch line: after ``train.py`` (``python``,
    ``accelerate launch ... train.py``) or ``trl grpo``."""
    for i, word in enumerate(words):
        if word.endswith(".py"):
            return words[i + 1 :]
        if word == "grpo" and i > 0 and os.path.basename(words[i - 1]) == "trl":
            return words[i + 1 :]
    return words


def _from_argv(words: list[str]) -> TrlJob:
    words = _strip_launcher(list(words))
    job = TrlJob(fields={name: default for name, (_, default) in FIELDS.items()})
    if "--config" in words:
        at = words.index("--config")
        words.pop(at)
        if at >= len(words):
            raise ConfigError("--config", "TrlParser needs the file's path after it", "write --config cfg.yaml")
        path = words.pop(at)
        defaults, env = _load_yaml(path)
        job = _from_values(defaults, f"--config {path}", env, post_init=False)
    from_file = set(job.given)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("-") or _NEGATIVE.fullmatch(word):
            raise ConfigError(word, "TrlParser refuses it: GRPO's parser takes no positional argument", _FIX_FILE)
        flag, has_value, inline = word.lstrip("-").partition("=")
        values = [inline] if has_value else []
        while not has_value and i < len(words) and (not words[i].startswith("-") or _NEGATIVE.fullmatch(words[i])):
            values.append(words[i])
            i += 1
        if flag == "config":
            raise ConfigError(
                " ".join([word, *values]),
                "TrlParser reads the first `--config PATH` (two words) only; HfArgumentParser refuses this one "
                "as an argument no dataclass has",
                "give one --config PATH",
            )
        name, negated = _field_of(flag) if word.startswith("--") else (None, False)
        if name is None:
            if flag.lower().replace("-", "_").startswith("replay"):
                job.stray.append(f"the command line: {word}")
            continue
        kind = FIELDS[name][0]
        shown = " ".join([word, *([] if has_value else values)])
        if negated:
            if values:
                raise ConfigError(shown, "TrlParser refuses it: --no_* takes no value", f"write --no_{name}")
            job.fields[name] = False
        elif kind == "bool" and not values:
            job.fields[name] = True  # nargs="?", const=True
        elif len(values) != 1:
            raise ConfigError(shown, f"TrlParser refuses it: --{flag} expects one value", f"write --{name} VALUE")
        else:
            job.fields[name] = _convert(name, values[0], shown)
        job.given.add(name)
        from_file.discard(name)
    # argparse converts a string default (a value of the file's) with the option's type, once no
    # flag replaced it; other defaults stay as they are
    for name in from_file:
        if isinstance(job.fields[name], str):
            job.fields[name] = _convert(name, job.fields[name], f"--config: {name}: {job.fields[name]}")
    _post_init(job, "the command line")
    return job


#: argparse's ``_negative_number_matcher``: such a word is a value, not an option
_NEGATIVE = re.compile(r"-\d+|-\d*\.\d+")


def _field_of(flag: str) -> tuple[str | None, bool]:
    """The field a ``--`` flag sets (``top_k`` from ``top_k`` or ``top-k``: HfArgumentParser adds
    the dashed alias), and whether it is the ``--no_NAME`` of a boolean whose default is true."""
    name = flag.replace("-", "_")
    if name in FIELDS:
        return name, False
    if name.startswith("no_") and FIELDS.get(name[3:], ("", None)) == ("bool", True):
        return name[3:], True
    return None, False


def _convert(name: str, text: str, word: str) -> Any:
    kind = FIELDS[name][0]
    try:
        if kind == "float":
            return float(text)
        if kind == "int":
            return int(text)
        if kind == "bool":
            return _string_to_bool(text)
    except ValueError as exc:
        raise ConfigError(
            word, f"TrlParser refuses it: invalid {kind} value {text!r} ({exc})", f"give --{name} a {kind}"
        ) from None
    return text


def _string_to_bool(text: str) -> bool:
    """transformers' ``hf_argparser.string_to_bool``."""
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise ValueError("expected one of yes/no, true/false, t/f, y/n, 1/0")


# --------------------------------------------------------------------------- GRPOConfig.__post_init__


def _post_init(job: TrlJob, where: str) -> None:
    """What ``GRPOConfig.__post_init__`` (and ``TrainingArguments``') does to the fields read here."""
    for name, (kind, _) in FIELDS.items():
        value = job.fields[name]
        if kind == "dict" and isinstance(value, str) and value.startswith("{"):
            try:
                job.fields[name] = _convert_str_dict(json.loads(value))
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{name}: {value}",
                    f"TRL refuses it: TrainingArguments.__post_init__ reads it with json.loads: {exc}",
                    f'write {name} as JSON: \'{{"extra_args": {{"replay_sample_support": true}}}}\'',
                ) from None
    if job.fields["use_transformers_paged"]:
        job.fields["use_transformers_continuous_batching"] = True


def _stray_in_generation_kwargs(job: TrlJob) -> TrlJob:
    """``replay_*`` keys directly under ``generation_kwargs`` (not under its ``extra_args``)."""
    kwargs = job.fields["generation_kwargs"]
    if isinstance(kwargs, Mapping):
        job.stray += [f"generation_kwargs: {k}" for k in kwargs if str(k).lower().startswith("replay")]
    return job


def _convert_str_dict(value: Any) -> Any:
    """transformers' ``training_args._convert_str_dict`` (5.10): strings "true"/"false" -> bool,
    digit strings -> int, one-dot digit strings -> float, through nested mappings."""
    if not isinstance(value, dict):
        return value
    for key, item in value.items():
        if isinstance(item, dict):
            value[key] = _convert_str_dict(item)
        elif isinstance(item, str):
            if item.lower() in ("true", "false"):
                value[key] = item.lower() == "true"
            elif item.isdigit():
                value[key] = int(item)
            elif item.replace(".", "", 1).isdigit():
                value[key] = float(item)
    return value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
