"""The one error type of the conversion library.

Library code raises :class:`ConversionError` with a one-line message that says what is wrong and how to fix it;
the command line prints the message (no traceback) and exits non-zero.
"""

from __future__ import annotations

import re


def one_line(message: object) -> str:
    """``message`` on one line: a multi-line report ("header:\\n  - a\\n  - b") becomes "header: a; b"."""
    lines = [re.sub(r"^[-*•]\s+", "", line.strip()) for line in str(message).splitlines()]  # list bullets only
    lines = [line for line in lines if line]
    if not lines:
        return ""
    out = lines[0]
    for line in lines[1:]:
        out += (" " if out.endswith(":") else "; ") + line
    return out


def first_few(items, n: int = 3, sep: str = ", ") -> str:
    """The first ``n`` of ``items`` joined by ``sep``, then "and k more" for the rest."""
    items = list(items)
    return sep.join(map(str, items[:n])) + (f" and {len(items) - n} more" if len(items) > n else "")


class ConversionError(ValueError):
    """A conversion cannot go ahead. ``str(err)`` is one line: what is wrong, then how to fix it."""

    def __init__(self, message: object):
        super().__init__(one_line(message))


class TrainError(RuntimeError):
    """A run that cannot start or continue (bad checkpoint, mismatched resume, ...): one line saying what to do."""


__all__ = ["ConversionError", "TrainError", "first_few", "one_line"]
