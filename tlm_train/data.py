"""Training data: text -> token ids (a sharded cache) -> fixed-length blocks -> a deterministic, resumable batch
order -> a DataLoader per rank.

Text comes through :func:`tlm_io.text.load_text`'s sources (local .txt/.jsonl/.parquet files or folders, a hub
dataset name when online, ``default`` for the bundled English sample). :func:`token_shards` tokenizes it once, in
parallel and resumably, into memory-mapped shards under ``cache_dir/<key>/`` (tlm_train.shards), the key hashing
the data's identity (path, size and mtime of every file, or the dataset name), the tokenizer's vocabulary and the
shard layout, so a rerun does not re-tokenize.

Batches: the blocks are shuffled once per epoch with a generator seeded by (seed, epoch). Global sample g of the
run is block ``perm[epoch(g)][g mod n]``; step k takes samples [k*G, (k+1)*G) with G the global batch, and rank r's
micro-batch m takes the slice starting at (m*world + r)*B. So the data position is the step alone, a resumed run
sees exactly the batches an uninterrupted one would, and one process with batch 2B sees what two ranks with B see.
:func:`micro_batch_loader` serves rank r's micro-batches from a given step on through a torch DataLoader (worker
processes read the shards; the order does not depend on their number).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from tlm_io.text import BUNDLED, dataset_rows, is_plain_text, load_text

from .shards import GroupWriter, TokenBlocks, TokenShards, open_shards, token_dtype, write_shards

logger = logging.getLogger(__name__)


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


SHARD_CHARS = 1 << 25  # characters of text per cache shard (about 8M tokens of a BPE vocabulary)


def token_shards(tokenizer, source: str, max_tokens: int | None = None, cache_dir: str | Path | None = None,
                 num_proc: int = 1) -> TokenShards:
    """The token ids of ``source`` (at most ``max_tokens``) as memory-mapped cache shards (tlm_train.shards).

    Documents (the rows of a dataset, or a text file read in pieces at line breaks) are joined with the
    tokenizer's EOS token (two newlines when it has none); a hub dataset is streamed and read only as far as
    ``max_tokens`` needs. The cache lives in ``cache_dir/<key>/``, the key hashing the data's identity (path, size
    and mtime of every file, or the dataset name), the tokenizer's vocabulary and the shard layout: a rerun reads
    the cache, an interrupted tokenization goes on where it stopped, and ``num_proc`` processes tokenize in
    parallel (the same shards whatever their number).
    """
    dtype = token_dtype(len(tokenizer))
    key = hashlib.sha256(json.dumps({"data": _data_identity(source), "tokenizer": _tokenizer_identity(tokenizer),
                                     "shard_chars": SHARD_CHARS, "dtype": dtype.name, "format": 3}).encode())
    folder = (Path(cache_dir) if cache_dir else default_cache_dir()) / key.hexdigest()[:24]
    shards = open_shards(folder, dtype, max_tokens)
    if shards is None:
        writer = GroupWriter(tokenizer, _separator(tokenizer), dtype)
        write_shards(folder, _documents(source), writer, shard_chars=SHARD_CHARS, max_tokens=max_tokens,
                     num_proc=num_proc)
        shards = open_shards(folder, dtype, max_tokens)
        logger.info("tokenized %s: %d tokens (cached in %s)", source, len(shards), folder)
    return shards


def tokenize_cached(tokenizer, source: str, max_tokens: int | None = None, cache_dir: str | Path | None = None,
                    num_proc: int = 1) -> torch.Tensor:
    """All token ids of ``source`` (at most ``max_tokens``) in memory, as a 1-D int32 tensor: the cache of
    :func:`token_shards` read whole (for held-out text and small corpora; training reads the shards lazily)."""
    return torch.from_numpy(token_shards(tokenizer, source, max_tokens, cache_dir, num_proc).read())


def recipe_tokens(tokenizer, data) -> tuple[TokenShards, torch.Tensor | None]:
    """A recipe's ``data`` section (tlm_train.recipe.DataSpec) tokenized: the training tokens as cache shards, the
    held-out ones in memory (None without ``data.eval``)."""
    train = token_shards(tokenizer, data.train, data.max_train_tokens, data.cache_dir, data.num_proc)
    held = (tokenize_cached(tokenizer, data.eval, data.eval_tokens, data.cache_dir, data.num_proc)
            if data.eval else None)
    return train, held


_PIECE_CHARS = 1 << 20


def _separator(tokenizer) -> list[int]:
    return ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else
            tokenizer("\n\n", add_special_tokens=False)["input_ids"])


def _documents(source: str):
    """(text, joined) of every document of ``source`` in order; ``joined``: a separator goes before it (all but the
    first document; a text file is one document, read in pieces of about 1M characters at line breaks)."""

    path = BUNDLED.get(source, Path(source).expanduser())
    if is_plain_text(path):
        text = load_text(source)
        start = 0
        while start < len(text):
            end = text.find("\n", start + _PIECE_CHARS)
            end = len(text) if end < 0 else end + 1
            yield text[start:end], False
            start = end
        return
    for i, text in enumerate(dataset_rows(path, source)):
        yield text, i > 0


class BatchOrder:
    """Deterministic global order of training blocks (see the module doc). ``micro_batch(step, micro, rank)``."""

    def __init__(self, blocks: torch.Tensor | TokenBlocks, batch_size: int, grad_accum: int, world: int, seed: int,
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


class MicroBatches(torch.utils.data.Dataset):
    """Item j of rank ``rank``'s stream: micro-batch ``j % grad_accum`` of step ``j // grad_accum``, a (B, S) int64
    numpy array (arrays cross from worker processes through a pipe, several times faster than tensors in shared
    memory at these sizes)."""

    def __init__(self, order: BatchOrder, rank: int):
        self.order, self.rank = order, rank

    def __getitem__(self, j: int):
        accum = self.order.grad_accum
        return self.order.micro_batch(j // accum, j % accum, self.rank).numpy()


def _as_is(item):
    return item


def micro_batch_loader(order: BatchOrder, rank: int, first_step: int, last_step: int, num_workers: int = 0,
                       pin_memory: bool = False):
    """The micro-batches of steps [first_step, last_step) for ``rank``, in order, as (B, S) int64 tensors (pinned
    when ``pin_memory``), read by a DataLoader with ``num_workers`` processes (0: in the caller's process)."""
    accum = order.grad_accum
    loader = torch.utils.data.DataLoader(MicroBatches(order, rank), batch_size=None, collate_fn=_as_is,
                                         sampler=range(first_step * accum, last_step * accum),
                                         num_workers=num_workers, prefetch_factor=4 if num_workers else None)
    for ids in loader:
        ids = torch.from_numpy(ids)
        yield ids.pin_memory() if pin_memory else ids


__all__ = ["token_shards", "tokenize_cached", "recipe_tokens", "BatchOrder", "MicroBatches", "micro_batch_loader",
           "TokenBlocks"]
