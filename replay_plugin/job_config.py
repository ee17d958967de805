"""A framework job's config (SkyRL, verl) as the doctor reads it: flat ``{dotted key: value}``.

Used by ``skyrl/doctor.py`` and ``verl/doctor.py``; imports nothing of the frameworks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def parse_config(config: str | Mapping[str, Any], framework: str) -> dict[str, Any]:
    """A framework's config (SkyRL, verl) as a flat ``{dotted key: value}``: from its Hydra-style
    ``KEY=VALUE`` overrides (a leading ``+`` dropped; values read as YAML scalars), a YAML file's
    nested mapping, or a mapping."""
    import yaml

    if isinstance(config, Mapping):
        return _flatten(config)
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh) or {}
        if not isinstance(doc, Mapping):
            raise ValueError(f"{config}: expected a mapping of {framework} config keys")
        return _flatten(doc)
    out: dict[str, Any] = {}
    for token in config.split():
        key, sep, value = token.lstrip("+").partition("=")
        if not sep:
            raise ValueError(f"{token!r}: expected KEY=VALUE ({framework}'s override form) or a YAML file")
        out[key] = yaml.safe_load(value)
    return out


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
    """A config value that switches something on (YAML ``true`` or its string spellings)."""
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"))
