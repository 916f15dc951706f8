"""Where a checkpoint's tokenizer is, found without reading any weights: a folder holding tokenizer files
(:data:`TOKENIZER_FILES`), a .gguf file (its tokenizer is in its metadata) or a hub tokenizer name, given as the
arguments of ``AutoTokenizer.from_pretrained`` (:func:`tokenizer_kwargs`); tlm_io.load loads it."""

from __future__ import annotations

import os
from pathlib import Path

from .locate import locate, resolve_builtin

# the files of a tokenizer: a folder with any of them has one; all of them are copied when it cannot be re-saved
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "spiece.model")


def tokenizer_folder(path: Path) -> str | None:
    """``path`` as a tokenizer source when it holds tokenizer files, else None."""
    return str(path) if any((path / name).is_file() for name in TOKENIZER_FILES) else None


def tokenizer_kwargs(tokenizer_source, trust_remote_code: bool) -> tuple[str, dict] | None:
    """(path, kwargs) for ``AutoTokenizer.from_pretrained(path, **kwargs)`` of a source's ``tokenizer_source`` (a
    folder, or (folder, gguf_file)), None without a tokenizer."""
    if tokenizer_source is None:
        return None
    trust = {"trust_remote_code": trust_remote_code}
    if isinstance(tokenizer_source, tuple):
        return tokenizer_source[0], {"gguf_file": tokenizer_source[1], **trust}
    return tokenizer_source, trust


def tokenizer_files(source: str | os.PathLike, trust_remote_code: bool = False) -> tuple[str, dict] | None:
    """(path, AutoTokenizer keyword arguments) of the tokenizer named by ``source`` without reading any weights:
    a local folder with tokenizer files is used as it is, another local checkpoint (a .gguf file, a folder holding
    one) as tlm_io.load.load_model would find it; anything else (a hub name) goes to AutoTokenizer unchanged. None
    for a local checkpoint without a tokenizer."""
    text = resolve_builtin(os.fspath(source))
    path = Path(text).expanduser()
    if not path.exists():
        return tokenizer_kwargs(text, trust_remote_code)
    if path.is_dir() and tokenizer_folder(path) is not None:
        return tokenizer_kwargs(str(path), trust_remote_code)
    found = locate(path, download=False)  # a .gguf file or a checkpoint folder; one-line errors otherwise
    found_source = (str(found.parent), found.name) if found.is_file() else tokenizer_folder(found)
    return tokenizer_kwargs(found_source, trust_remote_code)


__all__ = ["TOKENIZER_FILES", "tokenizer_files", "tokenizer_folder", "tokenizer_kwargs"]
