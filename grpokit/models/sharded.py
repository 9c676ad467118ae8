"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP): the weights and AdamW state of an
FSDP2 run are written by every rank, each its own shards, into `CKPT/dcp/`, with no gathering to
rank 0; DCP's metadata records each tensor's global shape and layout, so the same folder loads at
any world size (N ranks -> M ranks, or a single process) and into a plain, unsharded model
(`grpokit export`). docs/distributed.md, "Checkpoints and resharding".

State is addressed by the policy's own parameter names (the names a Hugging Face model gives them,
without the wrapper's prefix), through `torch.distributed.checkpoint.state_dict`'s
`get_state_dict` / `set_state_dict`, which also key the optimizer state by those names. Without a
process group (a single process) DCP reads and writes in this process alone.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

DCP_DIR = "dcp"
IN_DCP = "in-dcp"
"""The `optimizer` entry of `trainer_state.pt` when the optimizer state is in the DCP folder."""


def is_sharded(ckpt) -> bool:
    """A checkpoint whose weights are a DCP folder (written by an FSDP2 run)."""
    return (Path(ckpt) / DCP_DIR / ".metadata").is_file()


def _strip(state: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in state.items()}


def _strip_optim(osd: dict, prefix: str) -> dict:
    return {"state": _strip(osd.get("state", {}), prefix),
            "param_groups": [{**g, "params": [p.removeprefix(prefix) for p in g["params"]]}
                             for g in osd.get("param_groups", [])]}


def _add_optim(osd: dict, prefix: str) -> dict:
    return {"state": {prefix + k: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [prefix + p for p in g["params"]]} for g in osd["param_groups"]]}


def _states(module, optimizer, prefix: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = {"model": _strip(get_model_state_dict(module), prefix)}
    if optimizer is not None:
        out["optim"] = _strip_optim(get_optimizer_state_dict(module, optimizer), prefix)
    return out


def save(folder, module, optimizer, *, prefix: str = "") -> None:
    """Write `module`'s weights and `optimizer`'s state into `folder/dcp` (collective: every rank
    of the job calls it with its shards)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():                  # "no process group: a single process" is intended
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save(_states(module, optimizer, prefix), checkpoint_id=str(Path(folder) / DCP_DIR))


def load(folder, module, optimizer=None, *, prefix: str = "") -> None:
    """Load `folder/dcp` into `module` (sharded or not) and, when given, `optimizer`: each rank
    reads the parts of every tensor its shards cover."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    path = Path(folder) / DCP_DIR
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{folder}: no sharded checkpoint ({DCP_DIR}/.metadata)")
    state = _states(module, optimizer, prefix)
    if optimizer is not None:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
        if not any(k.startswith("optim.") for k in meta.state_dict_metadata):
            raise FileNotFoundError(f"{folder}: the sharded checkpoint holds no optimizer state")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(module, {prefix + k: v for k, v in state["model"].items()})
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, _add_optim(state["optim"], prefix))


def load_model_weights(folder, model) -> None:
    """Only the weights of a sharded checkpoint, into a plain model (export, evaluation)."""
    load(folder, model, None)


@torch.no_grad()
def plain_model(folder):
    """The policy of a sharded checkpoint as a plain transformers model: built from the config
    saved beside the shards, in the dtype the shards were written in, then filled from them."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    meta = dcp.FileSystemReader(str(Path(folder) / DCP_DIR)).read_metadata().state_dict_metadata
    dtypes = [m.properties.dtype for k, m in meta.items() if k.startswith("model.") and hasattr(m, "properties")]
    model = AutoModelForCausalLM.from_config(config, dtype=dtypes[0] if dtypes else torch.float32)
    load_model_weights(folder, model)
    return model
