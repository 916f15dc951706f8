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
import warnings
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
    """All token ids of ``source`` as a 1-D int32 tensor backed by a memory-mapped cache file.

    Documents (the rows of a dataset, or a text file read in pieces at line breaks) are tokenized one at a time
    and joined with the tokenizer's EOS token (two newlines when it has none); a hub dataset is streamed and read
    only up to ``max_tokens``. The ids go to ``cache_dir/<key>.bin`` (int32, written to a temporary file and
    renamed), so memory holds one document at a time and a rerun reads the cache instead of re-tokenizing.
    """
    import numpy as np

    key = hashlib.sha256(json.dumps({"data": _data_identity(source), "tokenizer": _tokenizer_identity(tokenizer),
                                     "max_tokens": max_tokens, "format": 2}).encode()).hexdigest()[:24]
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    path = folder / f"{key}.bin"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        count = 0
        try:
            with open(tmp, "wb") as f:
                for ids in _token_pieces(tokenizer, source):
                    if max_tokens is not None:
                        ids = ids[: max_tokens - count]
                    np.asarray(ids, dtype=np.int32).tofile(f)
                    count += len(ids)
                    if max_tokens is not None and count >= max_tokens:
                        break
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        logger.info("tokenized %s: %d tokens (cached as %s)", source, count, path)
    if path.stat().st_size == 0:
        return torch.zeros(0, dtype=torch.int32)
    with warnings.catch_warnings():  # read-only on purpose: blocks are copied out by indexing
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.memmap(path, dtype=np.int32, mode="r"))


_PIECE_CHARS = 1 << 20


def _token_pieces(tokenizer, source: str):
    """Token ids of ``source``, one document (or one ~1M-character piece of a text file) at a time."""
    separator = ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else
                 tokenizer("\n\n", add_special_tokens=False)["input_ids"])
    first = True
    for text in _documents(source):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if isinstance(text, _Continued) or first:
            yield ids
        else:
            yield separator + ids
        first = False


class _Continued(str):
    """A piece of a document that continues the previous piece (no separator before it)."""


def _documents(source: str):
    from tlm_convert.data import dataset_rows

    path = BUNDLED.get(source, Path(source).expanduser())
    if path.is_file() and path.suffix.lower() in (".txt", ".md"):
        text = load_text(source)
        start = 0
        while start < len(text):
            end = text.find("\n", start + _PIECE_CHARS)
            end = len(text) if end < 0 else end + 1
            yield text[start:end] if start == 0 else _Continued(text[start:end])
            start = end
        return
    yield from dataset_rows(path, source)


def to_blocks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = len(ids) // seq_len
    return ids[: n * seq_len].view(n, seq_len)  # (n, seq_len)


class BatchOrder:
    """Deterministic global order of training blocks (see the module doc). ``micro_batch(step, micro, rank)``."""

    def __init__(self, blocks: torch.Tensor, batch_size: int, grad_accum: int, world: int, seed: int,
                 skip_batches: int = 0):
        self.blocks, self.batch_size, self.grad_accum, self.world, self.seed = blocks, batch_size, grad_accum, world, seed
        self.skip_batches = skip_batches
        self.global_batch = batch_size * grad_accum * world
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.blocks), generator=gen)}  # keep one epoch's order
        return self._perms[epoch]

    def micro_batch(self, step: int, micro: int, rank: int) -> torch.Tensor:
        """(batch_size, seq_len) int64 token ids."""
        start = (self.skip_batches + step) * self.global_batch + (micro * self.world + rank) * self.batch_size
        n = len(self.blocks)
        rows = [int(self._perm(g // n)[g % n]) for g in range(start, start + self.batch_size)]
        return self.blocks[rows].long()

    def epochs(self, steps: int) -> float:
        return steps * self.global_batch / len(self.blocks)


__all__ = ["byte_tokenizer", "load_tokenizer", "tokenize_cached", "to_blocks", "BatchOrder", "BYTE_TOKENIZER"]
