"""Calibration and evaluation text -> fixed-length token blocks.

Text comes through `datasets`: a local ``.txt``/``.md`` file, ``.jsonl``/``.json`` or ``.parquet`` (a ``text``
column), a folder of such files, or a dataset name on the hub when online. ``"default"`` is the general-English
sample bundled with the package (``data/README.md`` gives its sources and licenses); ``"default-eval"`` is the
disjoint held-out sample used for perplexity.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from .errors import ConversionError

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "data"
BUNDLED = {"default": DATA_DIR / "calibration_en.txt", "default-eval": DATA_DIR / "eval_en.txt"}
_BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def load_text(source: str | Path, max_chars: int | None = None) -> str:
    """All text of a calibration source joined by blank lines (documents stay in order)."""
    path = BUNDLED.get(str(source), Path(source))
    if path.is_file() and path.suffix in (".txt", ".md"):
        text = path.read_text(encoding="utf-8")  # plain text needs no dataset machinery
        return text[:max_chars] if max_chars else text
    rows = _dataset_rows(path, str(source))
    parts, total = [], 0
    for row in rows:
        parts.append(row)
        total += len(row)
        if max_chars and total >= max_chars:
            break
    return "\n\n".join(parts)


def _dataset_rows(path: Path, source: str):
    import datasets

    if path.exists():
        files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS) if path.is_dir() else [path]
        if not files:
            raise ConversionError(f"no .txt, .jsonl, .json or .parquet files in {path}; pass a text file or folder")
        builder = _BUILDERS.get(files[0].suffix)
        if builder is None:
            raise ConversionError(f"unsupported data file {path.name}; use .txt, .jsonl, .json or .parquet")
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
        return _text_column(ds, source)
    try:  # a hub dataset name, streamed
        ds = datasets.load_dataset(source, split="train", streaming=True)
    except Exception as err:  # noqa: BLE001 - any hub failure means the same thing to the user
        raise ConversionError(f"data {source!r} is not a local file and could not be loaded from the hub "
                              f"({type(err).__name__}); pass a local .txt/.jsonl/.parquet path") from None
    return _text_column(ds, source)


def _text_column(ds, source):
    columns = getattr(ds, "column_names", None) or []
    if columns and "text" not in columns:
        raise ConversionError(f"data {source!r} has no 'text' column (columns: {', '.join(columns)})")
    return (row["text"] for row in ds if row["text"])


def token_blocks(tokenizer, text: str, seq_len: int, max_tokens: int | None, what: str = "calibration") -> torch.Tensor:
    """Tokenize and cut into (n, seq_len) blocks, at most ``max_tokens`` tokens; at least one full block."""
    if seq_len < 2:
        raise ConversionError(f"--seq-len {seq_len} is too short; use at least 2 (e.g. 512)")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    n = len(ids) // seq_len
    if max_tokens is not None:
        n = min(n, max_tokens // seq_len)
    if n < 1:
        raise ConversionError(f"{what} data has {len(ids)} tokens, fewer than one block of --seq-len {seq_len}; "
                              "pass more text or a smaller --seq-len")
    return ids[: n * seq_len].view(n, seq_len)


__all__ = ["load_text", "token_blocks", "BUNDLED"]
