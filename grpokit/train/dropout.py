"""Reference dropout (practitioner's rule "Dr. GRPO as practised", docs/training.md): dropout
active in the reference model's forward when computing the KL term, at a configurable rate,
whatever the architecture's own dropout settings.

Implemented as forward hooks on the decoder layers that apply `F.dropout(p, training=True)` to each
layer's output hidden states; removed on exit, so the model is untouched afterwards.
"""

from __future__ import annotations

import contextlib

import torch.nn.functional as F


def _decoder_layers(model):
    m = model.get_base_model() if hasattr(model, "get_base_model") else model
    backbone = m.get_decoder() if hasattr(m, "get_decoder") else getattr(m, m.base_model_prefix)
    layers = getattr(backbone, "layers", None) or getattr(backbone, "h", None)
    if layers is None:
        raise ValueError(f"{type(m).__name__}: cannot find decoder layers for reference dropout")
    return layers


@contextlib.contextmanager
def hidden_dropout(model, p: float):
    if p <= 0:
        yield
        return

    def hook(_module, _inp, out):
        if isinstance(out, tuple):
            return (F.dropout(out[0], p=p, training=True),) + tuple(out[1:])
        return F.dropout(out, p=p, training=True)

    handles = [layer.register_forward_hook(hook) for layer in _decoder_layers(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
