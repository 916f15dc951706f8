"""Loading a model and its tokenizer: the one loader of ``tlm-convert``, ``tlm train``, ``tokenize``, ``eval``,
``analyze`` and ``compare``.

:func:`load_model` reads any checkpoint tlm-convert reads into a TLMForCausalLM; :func:`load_tokenizer` gives the
tokenizer of a loaded source, of a checkpoint path without reading its weights, of a tokenizer folder or hub name,
or ``byte`` (UTF-8 bytes as tokens, for models trained from scratch).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tlm import TLMForCausalLM
from tlm.modules import RotaryEmbedding, rope_inv_freq

from .checkpoint import load_source
from .errors import ConversionError
from .gguf_export import restore_digit_split
from .gguf_reader import check_gguf_header
from .locate import resolve_builtin
from .remote_code import auto_tokenizer
from .tokenizer_source import tokenizer_files

BYTE_TOKENIZER = "byte"  # the name load_tokenizer reads as byte_tokenizer()


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


def load_tokenizer(source, trust_remote_code: bool = False):
    """The tokenizer of ``source``; ConversionError when a checkpoint has none.

    ``source``: a loaded Source or StreamSource (its own tokenizer files and trust setting), ``"byte"``
    (:func:`byte_tokenizer`), or a path or name: a checkpoint :func:`load_model` reads (a folder, a .gguf file, a
    built-in name; only its tokenizer files are read, never its weights), a tokenizer folder, or a hub tokenizer
    name. The tokenizer runs the folder's own code only with ``trust_remote_code``. Read from a GGUF, it gets back
    the digit split transformers' GGUF reader drops (gguf_export.restore_digit_split)."""
    if isinstance(source, (str, os.PathLike)):
        if os.fspath(source) == BYTE_TOKENIZER:
            return byte_tokenizer()
        where, found = os.fspath(source), tokenizer_files(source, trust_remote_code)
    else:
        where, found = source.path, source.tokenizer_kwargs()
    if found is None:
        raise ConversionError(f"{where} has no tokenizer files; add the source tokenizer to the folder")
    path, kwargs = found
    if "gguf_file" in kwargs:
        check_gguf_header(Path(path) / kwargs["gguf_file"])  # a damaged header named before transformers misreads it
    tokenizer = auto_tokenizer(path, **kwargs)
    if "gguf_file" in kwargs:
        restore_digit_split(tokenizer, Path(path) / kwargs["gguf_file"])
    config = getattr(source, "tlm_config", None)
    if config is not None:  # a loaded model: its embeddings must cover the tokenizer
        file = Path(path) / kwargs["gguf_file"] if "gguf_file" in kwargs else Path(path)
        if (file / "tokenizer.json").is_file():
            file = file / "tokenizer.json"
        check_vocab(tokenizer, config.vocab_size, file, f"'{source.path}'")
    return tokenizer


def check_vocab(tokenizer, vocab_size: int, where, model: str = "the model") -> None:
    """ConversionError when ``tokenizer`` (read from ``where``) has ordinary tokens whose ids the model's
    ``vocab_size`` embeddings do not cover (every such id would index past the embedding table). Special added tokens
    beyond it (e.g. a multimodal placeholder of a text-only model) are allowed: they only appear when a text spells
    them, and :func:`check_token_ids` catches that."""
    over = {token: i for token, i in tokenizer.get_vocab().items() if i >= vocab_size}
    if not over:
        return
    special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    plain = sorted((i, token) for token, i in over.items() if token not in special)
    if plain:
        raise ConversionError(f"the tokenizer '{where}' has {len(plain)} token(s) with ids from {plain[0][0]} up to "
                              f"{plain[-1][0]}, beyond the {vocab_size} embeddings of {model} (vocab_size in its "
                              "config); use the model's own tokenizer, or a model whose vocab_size covers this one")


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str, fix: str = "use the model's own tokenizer") -> None:
    """ConversionError when token ``ids`` (of ``what``: calibration data, a token cache, ...) hold an id the model's
    ``vocab_size`` embeddings do not cover, or a negative one."""
    if ids.numel() == 0:
        return
    top, low = int(ids.max()), int(ids.min())
    if top >= vocab_size or low < 0:
        bad = top if top >= vocab_size else low
        raise ConversionError(f"{what} holds token id {bad}, outside the model's vocabulary of {vocab_size} "
                              f"(ids 0..{vocab_size - 1}); {fix}")


def check_positions(config, seq_len: int, where, option: str = "--seq-len") -> None:
    """ConversionError when a model with learned positions (GPT-2: n_positions) gets sequences longer than its
    position table."""
    limit = getattr(config, "max_position_embeddings", None)
    if getattr(config, "position_embedding", None) == "learned" and limit is not None and seq_len > limit:
        raise ConversionError(f"{option} {seq_len} is longer than the {limit} positions of '{where}' (its learned "
                              f"position table: n_positions / max_position_embeddings); use {option} {limit} or less")


def byte_tokenizer():
    """UTF-8 bytes as tokens (ids 0..255) plus ``<|endoftext|>`` (256), as a transformers fast tokenizer that
    saves and loads like any other (ByteLevel BPE without merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def _byte_chars() -> dict[int, str]:
    """The printable character standing for each byte in byte-level BPE vocabularies (GPT-2's convention:
    printable Latin-1 bytes stand for themselves, the others map to code points from 256 up, in byte order)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


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
    device = next(iter(state.values())).device
    for module in model.modules():  # non-persistent buffers are not in the state dict
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = rope_inv_freq(module.params, module.head_dim).to(device)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


__all__ = ["BYTE_TOKENIZER", "byte_tokenizer", "check_positions", "check_token_ids", "check_vocab", "load_model",
           "load_tokenizer", "materialize"]
