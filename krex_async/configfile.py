"""`krex serve` options from three layers: a TOML file, then KREX_* environment variables, then flags.

    load_config(path, os.environ, given_flags) -> ServeConfig

Layers, later ones win:

1. The file: `--config PATH`, else /etc/krex/krex.toml. A missing default file is fine (nothing is
   read); a missing explicit file is an error. Keys are ServeConfig's field names at the top level;
   `region-timeout` and `region_timeout` are the same key.
2. The environment: KREX_<FIELD> (KREX_POLICY, KREX_REGION_TIMEOUT; KREX_SOCKET is the socket). Values
   are strings converted to the field's type; an empty value counts as unset. Other KREX_* variables
   (KREX_COMMAND, KREX_TOKEN, KREX_DEVICE live inside commands) are not options and are ignored.
3. The command line: a dict of the options that were given explicitly (field name -> value).

Every layer is validated on its own, so an error names where the bad value came from:
`/etc/krex/krex.toml: region_timeout: Expected float >0, got -1`, `KREX_POLICY: ...`, `--max-frame: ...`.
Errors are raised as ConfigError; nothing here exits the process or prints.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from typing import Any

import msgspec

from .config import ServeConfig

DEFAULT_PATH = "/etc/krex/krex.toml"
ENV_PREFIX = "KREX_"

__all__ = ["ConfigError", "DEFAULT_PATH", "load_config", "load_config_with_sources", "print_config"]


class ConfigError(Exception):
    """An option could not be read or is invalid; the message starts with its source and key."""


def _fields() -> list[str]:
    return list(ServeConfig.__struct_fields__)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


_PATH = re.compile(r"`\$\.([A-Za-z0-9_]+)`|\$\.([A-Za-z0-9_]+)")


def _validate(layer: dict[str, Any], where: Any, *, strict: bool) -> None:
    """Convert one layer alone; on failure raise ConfigError naming `where(key)` (or the layer)."""
    try:
        msgspec.convert(layer, ServeConfig, strict=strict)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _PATH.search(text)
        key = (m.group(1) or m.group(2)) if m else None
        detail = text.rsplit(" - at ", 1)[0]
        raise ConfigError(f"{where(key)}: {detail}" if key else f"{where(None)}: {text}") from None


def read_file(path: str | None) -> tuple[str | None, dict[str, Any]]:
    """The file layer as (path read or None, {field: value}). Raises ConfigError for an unreadable or
    malformed file, a table where a value belongs, or an unknown key (with the known ones listed)."""
    explicit = path is not None
    path = path if explicit else DEFAULT_PATH
    assert path is not None
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"{path}: config file not found (given with --config)") from None
        return None, {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    known = set(_fields())
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if isinstance(value, dict):
            raise ConfigError(f"{path}:{key}: is a table; options are top-level `key = value` lines")
        if name not in known:
            raise ConfigError(f"{path}:{key}: unknown key (known keys: {', '.join(sorted(known))})")
        if name in out:
            raise ConfigError(f"{path}:{key}: given twice (as {name!r} and with dashes)")
        out[name] = value
    _validate(out, lambda k: f"{path}:{k}" if k else path, strict=True)
    return path, out


def read_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment layer: {field: string} for every non-empty KREX_<FIELD>."""
    out = {}
    for name in _fields():
        v = env.get(_env_name(name))
        if v is not None and v != "":
            out[name] = v
    for name, v in out.items():
        _validate({name: v}, lambda k, n=name, v=v: f"{_env_name(k or n)}={v!r}", strict=False)
    return out


def read_cli(cli: Mapping[str, Any]) -> dict[str, Any]:
    """The command-line layer: only options given explicitly (None values are dropped)."""
    known = set(_fields())
    out = {}
    for k, v in cli.items():
        name = k.replace("-", "_")
        if v is None:
            continue
        if name not in known:
            raise ConfigError(f"{_flag(name)}: not a serve option")
        out[name] = v
    _validate(out, lambda k: _flag(k) if k else "command line", strict=False)
    return out


def load_config_with_sources(path: str | None, env: Mapping[str, str], cli: Mapping[str, Any],
                             ) -> tuple[ServeConfig, dict[str, str]]:
    """Merge file, environment and command line into a ServeConfig (not yet `.resolved()`), and say
    where each non-default option came from ({field: "file /etc/krex/krex.toml" | "env KREX_X" |
    "flag --x"}). Raises ConfigError naming the source and key of the first bad option."""
    fpath, file_layer = read_file(path)
    env_layer = read_env(env)
    cli_layer = read_cli(cli)
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for layer, src in ((file_layer, lambda k: f"file {fpath}"),
                       (env_layer, lambda k: f"env {_env_name(k)}"),
                       (cli_layer, lambda k: f"flag {_flag(k)}")):
        for k, v in layer.items():
            merged[k] = v
            sources[k] = src(k)
    try:
        cfg = msgspec.convert(merged, ServeConfig, strict=False)
    except msgspec.ValidationError as e:  # each layer passed alone: only a cross-field rule is left
        raise ConfigError(f"merged options: {e}") from None
    return cfg, sources


def load_config(path: str | None, env: Mapping[str, str], cli: dict[str, Any]) -> ServeConfig:
    """The ServeConfig from the file at `path` (None: the default, optional), the KREX_* variables of
    `env`, and the explicitly given flags in `cli`. Raises ConfigError (message: source, key, why)."""
    return load_config_with_sources(path, env, cli)[0]


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # a JSON string is a valid TOML basic string


def print_config(cfg: ServeConfig, sources: Mapping[str, str] | None = None) -> str:
    """The options as TOML (loadable again with --config), one `key = value` per field, each with a
    comment naming where it came from when `sources` is given (default otherwise)."""
    lines = ["# krex serve: resolved options (TOML; later layers win: file < env < flags)"]
    data = msgspec.to_builtins(cfg)
    width = max(len(k) for k in data)
    for k, v in data.items():
        line = f"{k:<{width}} = {_toml_value(v)}"
        if sources is not None:
            line = f"{line:<{width + 30}}  # {sources.get(k, 'default')}"
        lines.append(line.rstrip())
    return "\n".join(lines) + "\n"


def environ() -> Mapping[str, str]:
    """os.environ, named here so the CLI wiring reads `load_config(args.config, environ(), given)`."""
    return os.environ
