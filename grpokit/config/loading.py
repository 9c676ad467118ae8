"""Reading a config: YAML files and bundled presets (`base:` chains), `key.sub=value` overrides,
validation into `Config` with one-line errors (the closest valid key for a typo), and dumping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from grpokit._names import closest
from grpokit.config.base import CHECK_FAILED
from grpokit.config.root import Config
from grpokit.errors import ConfigError

PRESET_DIR = Path(__file__).parent.parent / "presets"


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        full = f"{prefix}{field.alias or name}"
        keys.append(full)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _valid_keys(ann, full + ".")
    return keys


def _suggest(key: str) -> str:
    hit = closest(key, _valid_keys(Config))
    if hit is None:  # compare leaf names too: "algorithm.eps_hgh" -> "algorithm.eps_high"
        leafs = {k.rsplit(".", 1)[-1]: k for k in _valid_keys(Config)}
        leaf = closest(key.rsplit(".", 1)[-1], leafs, cutoff=0.7)
        hit = leafs[leaf] if leaf is not None else None
    return f" (did you mean '{hit}'?)" if hit is not None else ""


def _format_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        return f"unknown config key '{loc}'{_suggest(loc)}"
    msg = e["msg"].removeprefix("Value error, ")
    if not loc or e["type"] == CHECK_FAILED:     # a cross-field check names its keys itself
        return msg
    got = e.get("input")
    named = "(got " in msg or (isinstance(got, str) and repr(got) in msg)   # the value is named already
    got = "" if isinstance(got, (dict, list)) or named else f" (got {got!r})"
    return f"config key '{loc}': {msg}{got}"


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_preset(name_or_path: str) -> Path:
    """A YAML path, or the name of a bundled preset (`dapo` -> grpokit/presets/dapo.yaml)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    bundled = PRESET_DIR / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if bundled.is_file():
        return bundled
    names = sorted(f.stem for f in PRESET_DIR.glob("*.yaml"))
    close = closest(p.stem, names)
    hint = f" (did you mean preset '{close}'?)" if close else f"; bundled presets: {', '.join(names)}"
    raise ConfigError(f"config file not found: {name_or_path}{hint}")


def _read_yaml(path: Path, seen: tuple = ()) -> dict:
    if path.resolve() in seen:
        raise ConfigError(f"config 'base:' loop through {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a YAML mapping")
    base = data.pop("base", None)
    if base:
        bases = base if isinstance(base, list) else [base]
        merged: dict = {}
        for b in bases:
            b_path = resolve_preset(b) if not (path.parent / b).is_file() else path.parent / b
            merged = _deep_merge(merged, _read_yaml(b_path, seen + (path.resolve(),)))
        data = _deep_merge(merged, data)
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key.sub=value")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override '{item}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, (dict, list)) and raw.strip()[:1] not in "{[":
        value = raw              # "a: b" is a string here, not a mapping; only {..} / [..] are structures
    return key.strip().split("."), value


def load_config(paths: list[str] | str | None = None, overrides: list[str] | None = None) -> Config:
    """Merge YAML files (or preset names) left to right, apply `key=value` overrides, validate."""
    data = read_configs(paths)
    for item in overrides or []:
        keys, value = parse_override(item)
        set_key(data, keys, value, f"override '{item}'")
    return config_from_dict(data)


def read_configs(paths: list[str] | str | None) -> dict:
    """The YAML files (or preset names) merged left to right, as a plain mapping (not validated)."""
    data: dict = {}
    for p in [paths] if isinstance(paths, str) else (paths or []):
        data = _deep_merge(data, _read_yaml(resolve_preset(str(p))))
    return data


def set_key(data: dict, keys: list[str], value: Any, what: str) -> None:
    """Set `keys` (a dotted key split at the dots) in the nested dict `data`, creating sections on
    the way; `what` names the override in the error when a key on the way is not a section."""
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{what}: '{k}' is not a section")
    node[keys[-1]] = value


def config_from_dict(data: dict) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
