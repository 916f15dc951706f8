"""Files we did not write are data, never code: every transformers load passes ``trust_remote_code`` explicitly.

Left unset, transformers asks "Do you wish to run the custom code? [y/N]" on stdin when a tokenizer or config
carries an ``auto_map`` to Python files of the model folder; piped input (``echo y |``) answers it. Passing
``False`` refuses instead, and :func:`auto_tokenizer` turns that refusal into one line naming the flag that allows
the code (``--trust-remote-code``), for sources the user trusts.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConversionError, one_line
from .bounded import MAX_TOKENIZER_BYTES, parse_json, read_bounded
from .tokenizer_source import TOKENIZER_FILES

FLAG = "--trust-remote-code"


def remote_code_refused(path, err: BaseException | None = None) -> ConversionError:
    return ConversionError(f"'{path}' ships its own Python code (an auto_map in its tokenizer or model config) that "
                           f"would have to run to load it; it is not run unless you pass {FLAG} (only for sources "
                           "you trust)")


def is_remote_code_refusal(err: BaseException) -> bool:
    return isinstance(err, ValueError) and "trust_remote_code" in one_line(err)


TOKENIZER_MODELS = ("BPE", "WordPiece", "WordLevel", "Unigram")  # the model types the tokenizers library reads


def check_tokenizer_files(path) -> None:
    """The tokenizer files of folder ``path`` checked as data before any library reads them: each a regular file
    (not a pipe or device, which would block or never end) within the size a real one has, every JSON file valid
    and not nested absurdly deep, ``tokenizer.json`` of a known model type. ConversionErrors name the file and the
    fix."""
    folder = Path(path)
    if not folder.is_dir():
        return  # a hub id, resolved by transformers
    for name in TOKENIZER_FILES:
        file = folder / name
        if not os.path.lexists(file):
            continue
        data = read_bounded(file, MAX_TOKENIZER_BYTES, "tokenizer file", content=name.endswith(".json"))
        if not name.endswith(".json"):
            continue
        value = parse_json(data, file, "tokenizer file")
        if not isinstance(value, dict):
            raise ConversionError(f"tokenizer file '{file}' does not hold a JSON object; re-download or fix it")
        if name == "tokenizer.json":
            model = value.get("model")
            kind = model.get("type") if isinstance(model, dict) else None
            if kind not in TOKENIZER_MODELS:
                raise ConversionError(f"tokenizer file '{file}' has model type {kind!r}, which the tokenizers library "
                                      f"does not read (known: {', '.join(TOKENIZER_MODELS)}); re-download it or use "
                                      "the model's own tokenizer")


def auto_tokenizer(path, trust_remote_code: bool = False, **kwargs):
    """``AutoTokenizer.from_pretrained(path, **kwargs)`` that never prompts and never runs the folder's code unless
    ``trust_remote_code``. The files are checked first (:func:`check_tokenizer_files`); any failure of the load is
    one ConversionError naming the folder (or GGUF file)."""
    from transformers import AutoTokenizer

    where = f"{path}/{kwargs['gguf_file']}" if kwargs.get("gguf_file") else path
    if not kwargs.get("gguf_file"):
        check_tokenizer_files(path)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    except ValueError as err:
        if is_remote_code_refusal(err) and not trust_remote_code:
            raise remote_code_refused(path, err) from None
        raise _unreadable(where, err) from None
    except RecursionError:
        raise ConversionError(f"the tokenizer of '{where}' is nested too deeply to be a real one; re-download it or "
                              "use the model's own tokenizer") from None
    except Exception as err:  # noqa: BLE001 - the tokenizer files are data: any failure to read them is theirs
        raise _unreadable(where, err) from None


def _unreadable(where, err: BaseException) -> ConversionError:
    return ConversionError(f"the tokenizer of '{where}' cannot be loaded ({type(err).__name__}: {one_line(err)[:300]}); "
                           "fix or re-download its tokenizer files (tokenizer.json, tokenizer_config.json)")


__all__ = ["FLAG", "TOKENIZER_MODELS", "auto_tokenizer", "check_tokenizer_files", "remote_code_refused", "is_remote_code_refusal"]
