"""The sharded token cache: a corpus tokenized in parallel into many memory-mapped files, resumably.

One cache is one folder (``tlm_train.data.token_shards`` names it after the data, the tokenizer and the layout)::

    shard-00000.bin, ...  token ids of consecutive groups of documents, uint16 when the vocabulary fits, else int32
    manifest.json         the layout and, once the source is exhausted, ``complete: true`` and every shard's size

Groups: documents are taken in order and a group closes once it holds ``shard_chars`` characters, so the groups
depend on the text alone. A shard holds its group's token ids with the separator before every document except the
corpus' first and the continued pieces of one long document; the shards laid end to end are the corpus' token
stream, the same ids whatever the number of processes.

Writing: ``num_proc`` worker processes tokenize whole groups (each writes its shard to a temporary file and renames
it, so a shard file on disk is always complete); the reading process keeps at most ``2 * num_proc`` groups in
flight. A killed run loses only the groups in flight: a rerun skips the groups whose shard exists (their text is
read again, not tokenized). With a token cap, writing stops once the first shards hold enough tokens; a later run
with a larger cap goes on from there.

Reading: :class:`TokenShards` maps the shards lazily (each process, e.g. a DataLoader worker, opens its own maps)
and reads any token range across shard boundaries; :class:`TokenBlocks` cuts a range into fixed-length blocks.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import signal
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 3


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


# ============================================================================================== reading


class TokenShards:
    """The first ``limit`` token ids of the shards in ``folder``, as one virtual 1-D array (see the module doc)."""

    def __init__(self, folder: Path, counts: list[int], dtype: np.dtype, limit: int | None = None):
        self.folder, self.counts, self.dtype = Path(folder), list(counts), np.dtype(dtype)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]).tolist()  # shard k: [o_k, o_k+1)
        self.total = self.offsets[-1] if limit is None else min(limit, self.offsets[-1])
        self._maps: list | None = None

    def __len__(self) -> int:
        return self.total

    def __getstate__(self) -> dict:  # worker processes reopen the maps instead of receiving copies of the data
        return {**self.__dict__, "_maps": None}

    def _map(self, k: int) -> np.ndarray:
        if self._maps is None:
            self._maps = [None] * len(self.counts)
        if self._maps[k] is None:
            path = self.folder / shard_name(k)
            self._maps[k] = (np.zeros(0, self.dtype) if self.counts[k] == 0 else
                             np.memmap(path, dtype=self.dtype, mode="r", shape=(self.counts[k],)))
        return self._maps[k]

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Token ids [start, stop) as an int32 array (a copy)."""
        stop = self.total if stop is None else min(stop, self.total)
        out = np.empty(max(0, stop - start), dtype=np.int32)
        pos = start
        k = bisect.bisect_right(self.offsets, start) - 1
        while pos < stop:
            lo = pos - self.offsets[k]
            n = min(stop, self.offsets[k + 1]) - pos
            out[pos - start : pos - start + n] = self._map(k)[lo : lo + n]
            pos += n
            k += 1
        return out


class TokenBlocks:
    """Token ids [start, stop) of ``tokens`` cut into blocks of ``seq_len``, each ``prefix`` (the tokenizer's
    start-of-text tokens, tlm_io.text.text_prefix) then seq_len - len(prefix) tokens of the stream (the tail shorter
    than a block is dropped). ``blocks[rows]`` -> (len(rows), seq_len) int32 tensor; ``blocks.all()`` -> every
    block."""

    def __init__(self, tokens: TokenShards, seq_len: int, start: int = 0, stop: int | None = None,
                 prefix: tuple[int, ...] = ()):
        stop = len(tokens) if stop is None else stop
        self.tokens, self.seq_len, self.start, self.prefix = tokens, seq_len, start, tuple(prefix)
        self.body = seq_len - len(self.prefix)  # stream tokens per block
        if self.body < 1:
            raise ValueError(f"blocks of {seq_len} tokens cannot hold the {len(self.prefix)}-token prefix and text")
        self.n = max(0, stop - start) // self.body

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, rows) -> torch.Tensor:
        b, p = self.body, len(self.prefix)
        out = np.empty((len(rows), self.seq_len), dtype=np.int32)
        out[:, :p] = self.prefix
        for i, row in enumerate(rows):
            if not 0 <= row < self.n:
                raise IndexError(f"block {row} of {self.n}")
            out[i, p:] = self.tokens.read(self.start + row * b, self.start + (row + 1) * b)
        return torch.from_numpy(out)

    def all(self) -> torch.Tensor:
        """(n, seq_len) int32: every block, in memory."""
        ids = self.tokens.read(self.start, self.start + self.n * self.body)
        body = torch.from_numpy(ids).view(self.n, self.body)  # (n, body)
        if not self.prefix:
            return body
        return torch.cat([torch.tensor(self.prefix, dtype=body.dtype).expand(self.n, -1), body], dim=1)


def _shards_on_disk(folder: Path, dtype: np.dtype) -> list[int]:
    """Token counts of shard-00000, shard-00001, ... up to the first missing file."""
    counts = []
    while (path := folder / shard_name(len(counts))).is_file():
        counts.append(path.stat().st_size // dtype.itemsize)
    return counts


def open_shards(folder: Path, dtype: np.dtype, max_tokens: int | None) -> TokenShards | None:
    """The cache in ``folder`` when it holds what is asked for (the whole source, or at least ``max_tokens``), else
    None (more shards must be written)."""
    counts = _shards_on_disk(folder, dtype)
    state = read_manifest(folder)
    if state is not None and state.get("complete") and counts[: len(state["shards"])] == state["shards"]:
        return TokenShards(folder, state["shards"], dtype, max_tokens)
    if max_tokens is not None and sum(counts) >= max_tokens:
        return TokenShards(folder, counts, dtype, max_tokens)
    return None


def read_manifest(folder: Path) -> dict | None:
    """The cache's manifest, None when there is none or it is damaged (the cache is derived data: its shards are then
    checked by size and written again where needed, and a new manifest replaces the damaged one)."""
    path = Path(folder) / MANIFEST
    if not path.is_file() or path.stat().st_size > 64 << 20:
        return None
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        logger.warning("token cache manifest %s is damaged; the cache is checked and completed again", path)
        return None
    shards = state.get("shards") if isinstance(state, dict) else None
    if not isinstance(shards, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                               for n in shards):
        return None
    return state


# ============================================================================================== writing


class GroupWriter:
    """Tokenizes one group of documents and writes its shard (in a worker process or in the caller's)."""

    def __init__(self, tokenizer, separator: list[int], dtype: np.dtype):
        self.tokenizer, self.separator, self.dtype = tokenizer, list(separator), np.dtype(dtype)

    def __call__(self, path: Path, texts: list[str], joined: list[bool]) -> int:
        """Writes ``path`` (atomically); returns its token count."""
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        parts = []
        for ids, join in zip(encoded, joined):
            if join:
                parts.append(self.separator)
            parts.append(ids)
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id {int(ids.max())} does not fit the cache's {self.dtype}")
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:
            ids.astype(self.dtype).tofile(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return len(ids)


_WORKER: GroupWriter | None = None


def _init_worker(writer: GroupWriter) -> None:
    """A pool worker's set-up. SIGTERM goes back to its default: a worker inherits the command's handler (which
    raises, or ignores a second signal), and the pool's terminate() must end its workers, not leave one waiting on
    the task queue while the command joins it. SIGINT (a Ctrl-C reaches every process of the terminal's group) is
    ignored: the command stops the pool and prints its one line; a worker would print a traceback."""
    global _WORKER
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked by write_shards while it forked
    _WORKER = writer


def _write_in_worker(path: Path, texts: list[str], joined: list[bool]) -> int:
    return _WORKER(path, texts, joined)


def groups(documents: Iterable[tuple[str, bool]], shard_chars: int) -> Iterator[tuple[list[str], list[bool]]]:
    """(texts, joined) of consecutive documents holding at least ``shard_chars`` characters (the last: the rest)."""
    texts, joined, chars = [], [], 0
    for text, join in documents:
        texts.append(text)
        joined.append(join)
        chars += len(text)
        if chars >= shard_chars:
            yield texts, joined
            texts, joined, chars = [], [], 0
    if texts:
        yield texts, joined


def write_shards(folder: Path, documents: Iterable[tuple[str, bool]], writer: GroupWriter, *, shard_chars: int,
                 max_tokens: int | None = None, num_proc: int = 1) -> None:
    """Tokenize the groups of ``documents`` that have no shard yet into ``folder`` (see the module doc)."""
    folder.mkdir(parents=True, exist_ok=True)
    _remove_orphans(folder)
    recorded = (read_manifest(folder) or {}).get("shards", [])
    counts: dict[int, int] = {}
    pending: deque = deque()
    pool = None
    if num_proc > 1:
        import multiprocessing

        # SIGINT blocked while the workers fork: a Ctrl-C then waits for the command (delivered once unblocked)
        # and a new worker sees it only once its set-up ignores it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            pool = multiprocessing.get_context().Pool(num_proc, initializer=_init_worker, initargs=(writer,))
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    def enough() -> bool:  # the contiguous first shards hold max_tokens
        if max_tokens is None:
            return False
        total, k = 0, 0
        while k in counts:
            total, k = total + counts[k], k + 1
        return total >= max_tokens

    exhausted = True
    try:
        for index, (texts, joined) in enumerate(groups(documents, shard_chars)):
            if enough():
                exhausted = False
                break
            path = folder / shard_name(index)
            size = recorded[index] * writer.dtype.itemsize if index < len(recorded) else None
            if path.is_file() and size is not None and path.stat().st_size != size:
                path.unlink()  # not the size the manifest recorded (a damaged file): written again
            if path.is_file():
                counts[index] = path.stat().st_size // writer.dtype.itemsize
            elif pool is None:
                counts[index] = writer(path, texts, joined)
            else:
                pending.append((index, pool.apply_async(_write_in_worker, (path, texts, joined))))
                while len(pending) >= 2 * num_proc or (pending and pending[0][1].ready()):
                    done, result = pending.popleft()
                    counts[done] = result.get()
            if index % 100 == 99:
                logger.info("tokenized %d groups (%d tokens so far)", len(counts), sum(counts.values()))
        for done, result in pending:
            counts[done] = result.get()
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    n = len(counts)
    state = {"format": FORMAT, "dtype": writer.dtype.name, "shard_chars": shard_chars, "complete": exhausted,
             "shards": [counts[k] for k in range(n)], "tokens": sum(counts.values())}
    tmp = folder / f"{MANIFEST}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, folder / MANIFEST)
    logger.info("token cache %s: %d shards, %d tokens%s", folder, n, state["tokens"],
                "" if exhausted else " (source not read to its end)")


def _remove_orphans(folder: Path) -> None:
    """Temporary files of writers that no longer run (a killed tokenization)."""
    for tmp in folder.glob("*.tmp*"):
        pid = tmp.name.rpartition(".tmp")[2]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["TokenShards", "TokenBlocks", "GroupWriter", "groups", "open_shards", "write_shards", "shard_name",
           "token_dtype", "MANIFEST"]
