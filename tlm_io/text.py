"""Calibration and evaluation text -> fixed-length token blocks.

Text comes through `datasets`: a local plain-text file (``.txt``, ``.md``, or any other suffix whose content is UTF-8
text, such as ``wiki.test.raw``), ``.jsonl``/``.json`` or ``.parquet`` (a ``text`` column), a folder of such files,
or a dataset name on the hub when online (``NAME:CONFIG`` for a configuration, e.g.
``HuggingFaceFW/fineweb-edu:sample-10BT``). ``"default"`` is the mixed-domain
sample bundled with the package (English prose, C and Perl source, a software manual; ``data/README.md`` gives
its sources and licenses); ``"default-eval"`` is the
disjoint held-out sample used for perplexity; ``eval-fiction``, ``eval-code``, ``eval-legal`` and ``eval-encyclopedic``
(knowledge-heavy reference prose) are held-out samples of other domains than the calibration sample (``EVAL_SETS``;
``"all-eval"`` names all five).
"""

from __future__ import annotations

import codecs
import os
from pathlib import Path

import torch

from .errors import ConversionError, one_line
from .hub import offline
from .outputs import broken_link

DATA_DIR = Path(__file__).parent / "data"
BUNDLED = {"default": DATA_DIR / "calibration_mix.txt", "default-eval": DATA_DIR / "eval_en.txt",
           "eval-fiction": DATA_DIR / "eval_fiction.txt", "eval-code": DATA_DIR / "eval_code.txt",
           "eval-legal": DATA_DIR / "eval_legal.txt", "eval-encyclopedic": DATA_DIR / "eval_encyclopedic.txt"}
EVAL_SETS = ("default-eval", "eval-fiction", "eval-code", "eval-legal", "eval-encyclopedic")  # what "all-eval" stands for
IN_DOMAIN = frozenset({"default-eval"})  # shares the calibration sample's domain (Factbook prose, other countries)
DATA_FORMATS = ("auto", "text")  # auto: by suffix, and UTF-8 text sniffed for other suffixes; text: always text
_SNIFF_BYTES = 1 << 16
_BUILDERS = {".txt": "text", ".md": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def eval_sources(data: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """The evaluation sets named by ``data`` (one source or several) in order, ``all-eval`` expanded, no repeats."""
    names = [data] if isinstance(data, str) else list(data or [])
    out: list[str] = []
    for name in names:
        for one in EVAL_SETS if name == "all-eval" else [name]:
            if one not in out:
                out.append(one)
    return out


def is_plain_text(path: Path, data_format: str = "auto") -> bool:
    """True when the file ``path`` is read as plain text: ``.txt``/``.md``, ``data_format`` "text", or a file of
    another suffix (not .jsonl/.json/.parquet) whose first 64 KiB decode as UTF-8 with no NUL byte."""
    if data_format not in DATA_FORMATS:
        raise ConversionError(f"data format {data_format!r} is unknown; use one of {', '.join(DATA_FORMATS)}")
    if not path.is_file():
        return False
    suffix = path.suffix.lower()
    if data_format == "text" or suffix in (".txt", ".md"):
        return True
    if suffix in _BUILDERS:
        return False
    try:
        with path.open("rb") as f:
            head = f.read(_SNIFF_BYTES)
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except (OSError, UnicodeDecodeError):
        return False
    return b"\0" not in head


def load_text(source: str | Path, max_chars: int | None = None, data_format: str = "auto",
              keep_empty: bool = False) -> str:
    """All text of a calibration source joined by blank lines (documents stay in order); ``keep_empty``: a data
    set's empty records are joined too (the GPTQ/Wanda WikiText-2 protocol joins every row)."""
    path = BUNDLED.get(str(source), Path(source).expanduser())
    if is_plain_text(path, data_format):
        try:  # plain text needs no dataset machinery
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConversionError(f"data file '{path}' is not UTF-8 text ({err.reason} at byte {err.start}); "
                                  "convert it to UTF-8") from None
        except OSError as err:
            raise ConversionError(f"data file '{path}' cannot be read ({err.strerror or one_line(err)})") from None
        return text[:max_chars] if max_chars else text
    rows = dataset_rows(path, str(source), keep_empty)
    parts, total = [], 0
    try:
        for row in rows:
            parts.append(row)
            total += len(row)
            if max_chars and total >= max_chars:
                break
    except ConversionError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged file or a dropped hub stream, told in one line
        raise ConversionError(f"data {str(source)!r} could not be read ({type(err).__name__}: {one_line(err)}); "
                              "check the file, or pass a local .txt/.jsonl/.parquet path") from None
    return "\n\n".join(parts)


def check_data_path(path: Path) -> None:
    """A data path that exists in some form must be a file or folder: a dangling symbolic link is named as one (not
    looked up on the hub), and a pipe, device or socket is refused before it is opened (it would block or never
    end)."""
    if not os.path.lexists(path):
        return
    if (broken := broken_link(path)) is not None:
        raise ConversionError(f"data '{path}' is {broken}; fix the link or pass the text file itself")
    if not (path.is_file() or path.is_dir()):
        raise ConversionError(f"data '{path}' is not a regular file (a pipe, device or socket), which is never read; "
                              "save the text to a file and pass that")


def _looks_like_path(path: Path, source: str) -> bool:
    """True when ``source`` cannot be a hub dataset name: a data-file suffix, or an absolute/relative path."""
    return (path.suffix.lower() in _BUILDERS or source.startswith(("/", "./", "../", "~", "\\"))
            or source.count("/") > 1 or "\\" in source)


def _root_cause(err: BaseException) -> BaseException:
    """The innermost explicit cause (datasets wraps the parser's error in DatasetGenerationError)."""
    seen = {id(err)}
    while err.__cause__ is not None and id(err.__cause__) not in seen:
        err = err.__cause__
        seen.add(id(err))
    return err


def dataset_rows(path: Path, source: str, keep_empty: bool = False):
    check_data_path(path)
    if path.exists():
        files = (sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _BUILDERS)
                 if path.is_dir() else [path])
        if not files:
            raise ConversionError(f"no .txt, .jsonl, .json or .parquet files in '{path}'; pass a text file or folder")
        if all(f.stat().st_size == 0 for f in files):
            what = f"data file '{path}' is" if files == [path] else f"every data file in '{path}' is"
            raise ConversionError(f"{what} empty ({', '.join(f.name for f in files[:3])}: 0 bytes); pass a file or "
                                  "folder with text")
        builders = {_BUILDERS.get(f.suffix.lower()) for f in files}
        if None in builders:
            raise ConversionError(f"unsupported data file '{path.name}': not UTF-8 text; use a text file (any suffix), "
                                  ".jsonl, .json or .parquet")
        if len(builders) > 1:
            raise ConversionError(f"'{path}' mixes data formats ({', '.join(sorted(builders))}); put one kind of "
                                  "file (.txt, .jsonl or .parquet) in the folder")
        (builder,) = builders
        import datasets

        try:
            ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
        except Exception as err:  # noqa: BLE001 - malformed JSON lines, a damaged parquet file, ...
            cause = _root_cause(err)
            raise ConversionError(f"data '{path}' cannot be read as {builder} ({type(cause).__name__}: "
                                  f"{one_line(cause)}); fix the file or pass a .txt file") from None
        return _text_column(ds, source, keep_empty)
    if _looks_like_path(path, source):
        raise ConversionError(f"data file '{source}' does not exist; pass an existing .txt/.jsonl/.parquet file or "
                              "folder, 'default', or a hub dataset name")
    if offline("datasets"):
        raise ConversionError(f"data {source!r} is not a local file and the hub is offline (HF_HUB_OFFLINE / "
                              "HF_DATASETS_OFFLINE); pass a local .txt/.jsonl/.parquet path")
    import datasets

    name, _, config = source.partition(":")  # NAME:CONFIG: a configuration of the dataset
    try:  # a hub dataset name, streamed
        ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
    except Exception as err:  # noqa: BLE001 - any hub failure means the same thing to the user
        raise ConversionError(f"data {source!r} is not a local file and could not be loaded from the hub "
                              f"({type(err).__name__}); pass a local .txt/.jsonl/.parquet path") from None
    return _text_column(ds, source, keep_empty)


def _text_column(ds, source, keep_empty: bool = False):
    columns = getattr(ds, "column_names", None) or []
    if columns and "text" not in columns:
        raise ConversionError(f"data {source!r} has no 'text' column (columns: {', '.join(columns)}); "
                              "use a 'text' field per record")
    return (row["text"] for row in ds if isinstance(row.get("text"), str) and (keep_empty or row["text"]))


def text_prefix(tokenizer) -> tuple[int, ...]:
    """The special token ids ``tokenizer`` puts before every text it encodes: Gemma's ``<bos>``; none for GPT-2,
    SmolLM2 or the byte tokenizer. Every block the library cuts from a text begins with them (:func:`to_blocks`), so
    a model is calibrated, scored and trained on text that begins as it did in pretraining: Gemma 3 270M scores 2.2-2.5x
    its own perplexity on blocks without its ``<bos>``. Read by encoding one word with and without special tokens;
    () when the tokenizer adds nothing before it (or is None)."""
    if tokenizer is None:
        return ()
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a")["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return tuple(int(t) for t in full[:i])
    return ()


def to_blocks(ids: torch.Tensor, seq_len: int, prefix: tuple[int, ...] = ()) -> torch.Tensor:
    """The 1-D token ids cut into (n, seq_len) consecutive blocks, the tail dropped: each block is ``prefix`` (see
    :func:`text_prefix`) then seq_len - len(prefix) tokens of ``ids`` (a view of ``ids`` when there is no prefix)."""
    body = seq_len - len(prefix)
    if body < 1:
        raise ValueError(f"blocks of {seq_len} tokens cannot hold the {len(prefix)}-token prefix and text")
    n = len(ids) // body
    blocks = ids[: n * body].view(n, body)  # (n, body)
    if not prefix:
        return blocks
    return torch.cat([torch.tensor(prefix, dtype=ids.dtype).expand(n, len(prefix)), blocks], dim=1)


def token_blocks(tokenizer, text: str, seq_len: int, max_tokens: int | None, what: str = "calibration",
                 spread: bool | None = None) -> torch.Tensor:
    """Tokenize and cut into (n, seq_len) blocks, at most ``max_tokens`` tokens; at least one full block. Each block
    begins with the tokenizer's start-of-text tokens (:func:`text_prefix`), as the model saw text in pretraining.

    ``spread`` (default: on for calibration, off otherwise): when the text holds more blocks than asked for, take
    them evenly spaced over the whole text (first and last block included, original order) instead of the first
    ``max_tokens`` tokens, so a calibration sample made of several sources (the bundled one: a handbook, then
    encyclopedic prose) is represented as a whole and not only by its beginning. Deterministic."""
    if seq_len < 2:
        raise ConversionError(f"option --seq-len {seq_len} is too short; use at least 2 (e.g. 512)")
    prefix = text_prefix(tokenizer)
    if seq_len < len(prefix) + 2:
        raise ConversionError(f"option --seq-len {seq_len} is too short for the tokenizer's {len(prefix)}-token "
                              "start of text; use at least 2 more (e.g. 512)")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    body = seq_len - len(prefix)  # text tokens a block holds after the prefix
    total = len(ids) // body
    n = total if max_tokens is None else min(total, max_tokens // seq_len)
    if n < 1:
        raise ConversionError(f"{what} data has {len(ids)} tokens, fewer than one block of --seq-len {seq_len}; "
                              "pass more text or a smaller --seq-len")
    blocks = to_blocks(ids, seq_len, prefix)  # (total, seq_len)
    if spread is None:
        spread = what == "calibration"
    if not spread or n == total:
        return blocks[:n]
    # n <= total, so the rounded positions are n distinct, increasing block indices
    return blocks[torch.linspace(0, total - 1, n, dtype=torch.float64).round().long()]


__all__ = ["load_text", "text_prefix", "to_blocks", "token_blocks", "dataset_rows", "is_plain_text", "eval_sources",
           "BUNDLED", "EVAL_SETS", "IN_DOMAIN", "DATA_FORMATS"]
