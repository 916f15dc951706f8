"""Tiny transformers checkpoints on disk, with a real (tiny) byte-level BPE tokenizer, for converter tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

DATA = Path(__file__).parent / "data" / "shakespeare_slice.txt"
VOCAB = 320
WIDTH = 48  # uniform source width; cosine 1.5/0.5 over 4 layers with multiple_of 1 -> [72, 60, 36, 24]


def tiny_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """``bos``: a second special token, ``<bos>``, that encoding puts before every text (as Gemma's tokenizer does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>", "<bos>"] if bos else ["<eos>"], show_progress=False)
    tok.train([str(DATA)], trainer)
    if not bos:
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", bos_token="<bos>")


FAMILIES = {
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=WIDTH, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=WIDTH, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=WIDTH, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
    "gemma3_text": lambda: Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=WIDTH, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_inner=WIDTH, n_positions=128,
                               bos_token_id=0, eos_token_id=0),
}


def make_source(folder: Path, family: str = "llama", seed: int = 0, tokenizer=None, **config) -> Path:
    """Write a tiny random source model (every parameter perturbed) and tokenizer to ``folder``; ``config``: changes
    of the family's config (e.g. ``vocab_size=100``)."""
    torch.manual_seed(seed)
    cfg = FAMILIES[family]()
    for key, value in config.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    (tokenizer or tiny_tokenizer()).save_pretrained(folder)
    return folder


def source_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits
