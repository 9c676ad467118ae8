"""Import references in config: `package.module:name`, the dotted `package.module.name`, or a file,
`path/to/file.py:name` (`name` may be dotted: `module:Class.method`). A module is looked up on
`sys.path` and in the current directory (a console script's `sys.path` lacks it); a file is imported
as a module of its own, once per resolved path. Every failure is a one-line ConfigError naming what
was being imported and the reference. A leaf: imports nothing of grpokit's but its errors and hints."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

from grpokit._names import did_you_mean
from grpokit.errors import ConfigError


def import_reference(ref: str, what: str, *, target: str = "NAME", not_found: Callable[[str], str] | None = None):
    """The object `ref` points at. `what` names it in errors ("reward", "rollout.env"), `target`
    the kind of object in the form shown for a malformed reference ("FUNCTION");
    `not_found(module)` adds a hint when the module itself does not exist."""
    where, sep, attr = str(ref).rpartition(":")
    if not sep:                                             # the dotted form: pkg.module.name
        where, _, attr = str(ref).rpartition(".")
    if not where or not attr:
        raise ConfigError(f"{what} {ref!r}: an import reference is MODULE:{target} or path/to/file.py:{target}")
    module = _load_file(ref, where, what) if where.endswith(".py") or os.sep in where or "/" in where \
        else _load_module(ref, where, what, not_found)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError(f"{what} {ref!r}: {getattr(obj, '__name__', where)} has no attribute {part!r}"
                              f"{did_you_mean(part, names)}")
        obj = getattr(obj, part)
    return obj


def _load_module(ref: str, module: str, what: str, not_found):
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):           # the module itself, not one it imports
            also = not_found(e.name) if not_found is not None else ""
            raise ConfigError(f"{what} {ref!r}: no module named {e.name!r} (looked in {cwd} and on sys.path)"
                              f"{also}") from None
        raise ConfigError(f"{what} {ref!r}: importing {module} failed: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - any error while importing user code is the user's to see
        raise ConfigError(f"{what} {ref!r}: importing {module} failed: {one_line(e)}") from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _load_file(ref: str, file: str, what: str):
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{what} {ref!r}: file not found: {file}")
    key = f"grpokit_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what} {ref!r}: {file} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - SystemExit in user code included: one line, not an exit
        del sys.modules[key]
        raise ConfigError(f"{what} {ref!r}: importing {file} failed: {one_line(e)}") from None
    return module


def one_line(e: BaseException) -> str:
    if isinstance(e, SyntaxError):                          # its str() carries the place already
        return f"{type(e).__name__}: {e.msg} ({e.filename}, line {e.lineno})"
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
