"""Loading a model and its tokenizer: the one loader of ``tlm-convert``, ``tlm train``, ``eval``, ``analyze`` and
``compare``."""

from __future__ import annotations

import torch

from tlm import TLMForCausalLM
from tlm.modules import RotaryEmbedding, rope_inv_freq

from .checkpoint import load_source, resolve_builtin
from .errors import ConversionError


def load_model(source: str, device: str = "cpu", with_tokenizer: bool = True):
    """(TLMForCausalLM in eval mode, tokenizer or None, the loaded Source) for any checkpoint tlm-convert reads: a
    TLM or transformers folder, a .gguf file, a hub id or a built-in name (``smollm2-135m``). The model uses the
    source's tensors (no second copy); ``source.state_dict`` is emptied."""
    src = load_source(resolve_builtin(source), dtype=torch.float32)
    tokenizer = load_tokenizer(src) if with_tokenizer else None
    model = materialize(src.tlm_config, src.state_dict)
    src.state_dict = {}  # the model holds these tensors now
    return model.to(device).eval(), tokenizer, src


def load_tokenizer(src):
    """The tokenizer of a loaded source (a Source or a StreamSource); ConversionError when it has none."""
    kwargs = src.tokenizer_kwargs()
    if kwargs is None:
        raise ConversionError(f"{src.path} has no tokenizer files; add the source tokenizer to the folder")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(kwargs[0], **kwargs[1])


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
