"""Side files read as data within a size bound, with the standard library only (no torch: the console entry points
read config.json through it before importing the commands): :func:`read_bounded` (a regular file, its size checked
before a byte is read), :func:`parse_json` and :func:`read_json` (one-line errors naming the file)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from .errors import ConversionError, one_line
from .outputs import human_bytes

MAX_JSON_BYTES = 64 << 20  # config.json, index and other JSON side files: real ones are kilobytes to a few MB
MAX_TOKENIZER_BYTES = 128 << 20  # a tokenizer file: the largest real tokenizer.json is about 35 MB


def read_bounded(file: str | os.PathLike, limit: int, what: str = "file", content: bool = True,
                 fix: str = "re-download it") -> bytes:
    """The bytes of ``file``, a regular file (a symlink is followed: its target is data too) of at most ``limit``
    bytes, its size checked before anything is read. A pipe, device or socket in its place (which would block or
    never end) and a larger file are ConversionErrors naming it (and ``fix`` for a file too large); nothing is read
    from them. ``content=False``: the checks only (b"" returned)."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise ConversionError(f"{what} '{file}' cannot be read ({err.strerror or one_line(err)}); check it or "
                              "re-download it") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConversionError(f"{what} '{file}' is not a regular file (a device, pipe or socket), which is never "
                                  "read; replace it with the real file")
        if info.st_size > limit:
            raise ConversionError(f"{what} '{file}' is {human_bytes(info.st_size)}, more than the "
                                  f"{human_bytes(limit)} such a file can take; it is not a real one: {fix}")
        chunks, left = [], limit + 1 if content else 0
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as err:
        raise ConversionError(f"{what} '{file}' cannot be read ({err.strerror or one_line(err)}); check it or "
                              "re-download it") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:  # it grew while being read
        raise ConversionError(f"{what} '{file}' is larger than the {limit >> 20} MiB such a file can take; {fix}")
    return data


def parse_json(data: bytes | str, file, what: str = "file", finite: bool = False):
    """JSON text of ``file`` parsed; ``finite``: NaN and Infinity (which Python reads, JSON has not) are refused with
    their key path. Malformed, non-UTF-8 or too deeply nested text is a ConversionError naming the file."""
    try:
        value = json.loads(data.decode("utf-8") if isinstance(data, bytes) else data)
    except RecursionError:
        raise ConversionError(f"{what} '{file}' is nested too deeply to be a real one; re-download or fix it") from None
    except UnicodeDecodeError as err:
        raise ConversionError(f"{what} '{file}' is not UTF-8 text (byte {err.start}); re-download or fix it") from None
    except ValueError as err:
        raise ConversionError(f"{what} '{file}' is not valid JSON ({one_line(err)}); re-download or fix it") from None
    if finite:
        bad = _non_finite(value)
        if bad is not None:
            raise ConversionError(f"{what} '{file}': {bad[0]} is {bad[1]}, not a number a model can use; fix {bad[0]}")
    return value


def _non_finite(value, path: str = "") -> tuple[str, float] | None:
    """(key path, value) of the first NaN or infinite number in a parsed JSON value, None when there is none."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return where or "the value", item
        if isinstance(item, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def read_json(file: Path, what: str = "file", finite: bool = False) -> dict:
    """A JSON object from ``file``, read within :data:`MAX_JSON_BYTES` (:func:`read_bounded`, :func:`parse_json`)."""
    data = parse_json(read_bounded(file, MAX_JSON_BYTES, what), file, what, finite)
    if not isinstance(data, dict):
        raise ConversionError(f"{what} '{file}' does not hold a JSON object; re-download or fix it")
    return data


__all__ = ["MAX_JSON_BYTES", "MAX_TOKENIZER_BYTES", "parse_json", "read_bounded", "read_json"]
