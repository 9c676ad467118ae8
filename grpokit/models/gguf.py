"""GGUF checkpoints (llama.cpp's single-file format) as plain Hugging Face directories.

transformers reads a `.gguf` file through the `gguf` package and dequantizes its weights, but
loading is slow (tens of seconds for a 135 M model) and the loaded model is marked quantized, so it
refuses `save_pretrained`. We convert once: build the same architecture from its config without
the quantization marker, load the dequantized state dict into it, and save model and tokenizer as
an ordinary directory. Conversions are cached under `$GRPOKIT_CACHE/gguf/<sha256[:16]>` (default
`~/.cache/grpokit/gguf/...`), keyed by the file's content, so a renamed or copied file is not
converted twice and a changed file never reuses a stale directory. A directory is written under a
temporary name and renamed into place: an interrupted conversion never leaves a half directory.

A leaf like grpokit.models.hf: it imports only ModelLoadError from there (and the cache directory
from grpokit.cache).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from grpokit.cache import CACHE_ENV, cache_dir  # noqa: F401  (CACHE_ENV: where the cache is set)
from grpokit.models.hf import ModelLoadError

log = logging.getLogger("grpokit.models")

GGUF_MAGIC = b"GGUF"
PROVENANCE = "grpokit_gguf.json"       # written into each converted directory: where it came from


def cache_root() -> Path:
    """Where converted GGUF models are kept: `$GRPOKIT_CACHE/gguf`, else `~/.cache/grpokit/gguf`."""
    return cache_dir("gguf")


def is_gguf(path: str | Path) -> bool:
    """True when `path` is a file starting with the GGUF magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def file_digest(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's content, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_source(path: str | Path, gguf_file: str = "") -> Path | None:
    """The GGUF file that `model.path` (+ `model.gguf_file`) names, or None for a directory.

    `path` may be the GGUF file itself, or a directory holding `gguf_file`. A named file that is
    missing or not a GGUF file is an error, never a silent fallback."""
    p = Path(path)
    if gguf_file:
        if Path(gguf_file).is_absolute() or len(Path(gguf_file).parts) != 1:
            raise ModelLoadError(f"model.gguf_file must be a file name inside model.path, got {gguf_file}")
        if not p.is_dir():
            raise ModelLoadError(f"model.gguf_file is set, but model.path is not a directory: {p}")
        p = p / gguf_file
    elif not (p.is_file() or p.suffix.lower() == ".gguf"):
        return None
    return _must_be_gguf(p)


def _must_be_gguf(p: Path) -> Path:
    if not p.is_file():
        raise ModelLoadError(f"GGUF file not found: {p} (grpokit never downloads models; give a local path)")
    if not is_gguf(p):
        raise ModelLoadError(f"{p}: not a GGUF file (it does not start with the GGUF magic bytes)")
    return p


def require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("reading a .gguf file needs the gguf package: pip install 'gguf>=0.10'")


def _write_converted(src: Path, out: Path) -> None:
    """Load `src` through transformers (dequantized to float32) and save a plain directory in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=src.name, local_files_only=True)
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, **kw)
        loaded = AutoModelForCausalLM.from_pretrained(src.parent, dtype=torch.float32, **kw)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        raise ModelLoadError(f"{src}: transformers cannot load this GGUF file ({str(exc).splitlines()[0]})") from None
    # The loaded model carries a quantization marker that blocks save_pretrained; its weights are
    # already plain float32, so the same architecture built without the marker takes them as is.
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    del loaded
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    (out / PROVENANCE).write_text(json.dumps({"source": str(src.resolve()), "sha256": file_digest(src)}, indent=2) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _convert_into(src: Path, out: Path) -> None:
    """Convert in a temporary sibling of `out` and rename it into place, so `out` is either absent
    (or as it was) or complete. When another process renamed its conversion into `out` first, that
    one is kept."""
    require_gguf_package()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_umask())        # mkdtemp's 0700 would make the result private
    try:
        _write_converted(src, tmp)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()                  # an empty target: rename needs it gone
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise ModelLoadError(f"{out} is in the way and holds no model: delete it and retry") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def convert(src: str | Path, out_dir: str | Path) -> Path:
    """Convert the GGUF file `src` into the plain Hugging Face directory `out_dir` (absent or empty)."""
    p = _must_be_gguf(Path(src))
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelLoadError(f"output directory exists and is not an empty directory: {out}")
    _convert_into(p, out)
    return out


def cached_conversion(src: str | Path) -> Path:
    """The converted directory of the GGUF file `src` in the cache, converting it on first use."""
    src = Path(src)
    out = cache_root() / file_digest(src)[:16]
    if not (out / "config.json").is_file():
        log.info("converting %s into %s (once; later runs load the cached directory)", src, out)
        _convert_into(src, out)
    return out


def resolve_model_dir(path: str | Path, gguf_file: str = "") -> str | Path:
    """`path` unchanged for a plain directory; the cached conversion for a GGUF file."""
    src = gguf_source(path, gguf_file) if str(path) else None
    return path if src is None else cached_conversion(src)
