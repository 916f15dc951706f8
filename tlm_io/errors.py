"""The errors of the library: one root, :class:`TLMError`, and one class per kind of refusal under it.

Library code raises them with a message that says what is wrong and how to fix it; the command line prints the
message on one ``error:`` line (no traceback) and exits non-zero. Each class also derives from the built-in error
it has always been (``ValueError``, or ``RuntimeError`` for :class:`TrainError`), so code that catches those keeps
working; ``except TLMError`` catches every refusal of the library.
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


class TLMError(Exception):
    """Anything the library refuses to do; ``str(err)`` says what is wrong and how to fix it."""


class ConversionError(TLMError, ValueError):
    """A checkpoint, data source, option or output that cannot be used. ``str(err)`` is one line: what is wrong,
    then how to fix it."""

    def __init__(self, message: object):
        super().__init__(one_line(message))


class RecipeError(TLMError, ValueError):
    """A recipe that cannot be used; the message lists every problem, one per line."""


class TrainError(TLMError, RuntimeError):
    """A run that cannot start or continue (bad checkpoint, mismatched resume, ...): one line saying what to do."""


class StateError(TLMError, ValueError):
    """A training-state file that is missing, corrupt or not in the expected format; the message names the file."""


class AnalysisError(TLMError, ValueError):
    """The analysis cannot run on this model or data; the message says why, on one line."""


__all__ = ["AnalysisError", "ConversionError", "RecipeError", "StateError", "TLMError", "TrainError", "first_few",
           "one_line"]
