"""Training data: text -> token ids (cached) -> fixed-length blocks -> a deterministic, resumable batch order.

Text comes through :func:`tlm_convert.data.load_text` (local .txt/.jsonl/.parquet files or folders, a hub
dataset name when online, ``default`` for the bundled English sample). Token ids are cached under
``cache_dir/<key>.pt``, the key hashing the data's identity (path, size and mtime of every file, or the dataset
name), the tokenizer's vocabulary and the token cap, so a rerun does not re-tokenize.

Batches: the blocks are shuffled once per epoch with a generator seeded by (seed, epoch). Global sample g of the
run is block ``perm[epoch(g)][g mod n]``; step k takes samples [k*G, (k+1)*G) with G the global batch, and rank r's
micro-batch m takes the slice starting at (m*world + r)*B. So the data position is the step alone, a resumed run
sees exactly the batches an uninterrupted one would, and one process with batch 2B sees what two ranks with B see.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from tlm_convert.data import BUNDLED, load_text

logger = logging.getLogger(__name__)

BYTE_TOKENIZER = "byte"


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


def load_tokenizer(name: str):
    if name == BYTE_TOKENIZER:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _data_identity(source: str) -> dict:
    path = BUNDLED.get(source, Path(source).expanduser())
    if path.exists():
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        return {"files": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]}
    return {"dataset": source}


def _tokenizer_identity(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def default_cache_dir() -> Path:
    return Path(os.environ.get("TLM_CACHE", Path.home() / ".cache" / "tlm" / "tokens"))


def tokenize_cached(tokenizer, source: str, max_tokens: int | None = None, cache_dir: str | Path | None = None,
                    ) -> torch.Tensor:
    """All token ids of ``source`` (1-D int64; cached as int32), documents joined as load_text joins them."""
    key = hashlib.sha256(json.dumps({"data": _data_identity(source), "tokenizer": _tokenizer_identity(tokenizer),
                                     "max_tokens": max_tokens}).encode()).hexdigest()[:24]
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    path = folder / f"{key}.pt"
    if path.is_file():
        try:
            return torch.load(path).long()
        except Exception:  # noqa: BLE001 - a damaged cache entry is rebuilt
            logger.warning("token cache %s is unreadable; tokenizing again", path)
    max_chars = None if max_tokens is None else max_tokens * 16  # generous: a token is rarely 16 characters
    text = load_text(source, max_chars=max_chars)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int32)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(ids, tmp)
    os.replace(tmp, path)
    logger.info("tokenized %s: %d tokens (cached as %s)", source, len(ids), path)
    return ids.long()


def to_blocks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = len(ids) // seq_len
    return ids[: n * seq_len].view(n, seq_len)  # (n, seq_len)


class BatchOrder:
    """Deterministic global order of training blocks (see the module doc). ``micro_batch(step, micro, rank)``."""

    def __init__(self, blocks: torch.Tensor, batch_size: int, grad_accum: int, world: int, seed: int):
        self.blocks, self.batch_size, self.grad_accum, self.world, self.seed = blocks, batch_size, grad_accum, world, seed
        self.global_batch = batch_size * grad_accum * world
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.blocks), generator=gen)}  # keep one epoch's order
        return self._perms[epoch]

    def micro_batch(self, step: int, micro: int, rank: int) -> torch.Tensor:
        """(batch_size, seq_len) token ids."""
        start = step * self.global_batch + (micro * self.world + rank) * self.batch_size
        n = len(self.blocks)
        rows = [int(self._perm(g // n)[g % n]) for g in range(start, start + self.batch_size)]
        return self.blocks[rows]

    def epochs(self, steps: int) -> float:
        return steps * self.global_batch / len(self.blocks)


__all__ = ["byte_tokenizer", "load_tokenizer", "tokenize_cached", "to_blocks", "BatchOrder", "BYTE_TOKENIZER"]
