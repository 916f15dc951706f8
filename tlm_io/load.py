"""Loading a model and its tokenizer: the one loader of ``tlm-convert``, ``tlm train``, ``eval``, ``analyze`` and
``compare``."""

from __future__ import annotations

from pathlib import Path

import torch

from tlm import TLMForCausalLM
from tlm.modules import RotaryEmbedding, rope_inv_freq

from .checkpoint import load_source, resolve_builtin
from .errors import ConversionError
from .gguf_export import restore_digit_split
from .remote_code import auto_tokenizer


def load_model(source: str, device: str = "cpu", with_tokenizer: bool = True, trust_remote_code: bool = False):
    """(TLMForCausalLM in eval mode, tokenizer or None, the loaded Source) for any checkpoint tlm-convert reads: a
    TLM or transformers folder, a .gguf file, a hub id or a built-in name (``smollm2-135m``). The model uses the
    source's tensors (no second copy); ``source.state_dict`` is emptied. ``trust_remote_code``: the tokenizer may
    run the folder's own code (never without it, and never a prompt)."""
    src = load_source(resolve_builtin(source), dtype=torch.float32, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(src) if with_tokenizer else None
    model = materialize(src.tlm_config, src.state_dict)
    src.state_dict = {}  # the model holds these tensors now
    return model.to(device).eval(), tokenizer, src


def load_tokenizer(src):
    """The tokenizer of a loaded source (a Source or a StreamSource); ConversionError when it has none. Read from
    a GGUF, it gets back the digit split transformers' GGUF reader drops (gguf_export.restore_digit_split)."""
    found = src.tokenizer_kwargs()
    if found is None:
        raise ConversionError(f"{src.path} has no tokenizer files; add the source tokenizer to the folder")
    path, kwargs = found
    tokenizer = auto_tokenizer(path, **kwargs)
    if "gguf_file" in kwargs:
        restore_digit_split(tokenizer, Path(path) / kwargs["gguf_file"])
    return tokenizer


def materialize(config, state_dict: dict) -> TLMForCausalLM:
    """A TLMForCausalLM that *uses* the given tensors (built on the meta device, loaded strictly with
    ``assign=True``): no random init and no second copy of the weights in memory."""
    tied = config.tie_word_embeddings
    with torch.device("meta"):
        model = TLMForCausalLM(config)
    state = {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(f"internal error: weights do not match the config "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for module in model.modules():  # non-persistent buffers are not in the state dict
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = rope_inv_freq(module.params, module.head_dim)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


__all__ = ["load_model", "load_tokenizer", "materialize"]
