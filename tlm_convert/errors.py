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


class ConversionError(ValueError):
    """A conversion cannot go ahead. ``str(err)`` is one line: what is wrong, then how to fix it."""

    def __init__(self, message: object):
        super().__init__(one_line(message))


__all__ = ["ConversionError", "one_line"]
