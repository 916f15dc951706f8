"""What every command shares: one-line errors and usage errors, quiet libraries, option checks. Only the CLI
modules print."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import warnings
from contextlib import contextmanager

import click

from tlm_io.errors import ConversionError, Stopped, TLMError, one_line
from tlm_io.signals import default_in_forked_child

DEBUG_ENV = "TLM_DEBUG"  # set to 1 to get the traceback of an unexpected error instead of the one-line message


def fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def say(line: str) -> None:
    """One line on stderr, above any progress bar on screen (tqdm.write) rather than glued to its end."""
    if "tqdm" in sys.modules:  # a bar may be on screen only when tqdm was imported
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)
        sys.stderr.flush()  # in order with what click.echo writes (and flushes)
    else:
        click.echo(line, err=True)


def _message(err: BaseException) -> str:
    """One line for any exception: its message (multi-line reports joined), else its type."""
    return one_line(err) or type(err).__name__


STOPPED_EXIT = {"SIGTERM": 143, "STOP": 143, "SIGINT": 130}  # 128 + signal number; the STOP file counts as SIGTERM


def report_failure(err: BaseException, stopped: str = "nothing was written") -> None:
    """Print ``err`` as one ``error:`` line and exit non-zero (never a traceback, unless TLM_DEBUG is set).

    Expected failures (the library's TLMErrors, bad values, file-system errors) print their message; anything else
    is a bug and says so, with the way to get the traceback. A run stopped by a signal (:class:`Stopped`) says so,
    with ``stopped`` (what became of its output), and exits 143 (SIGTERM) or 130 (SIGINT).
    """
    if isinstance(err, Stopped):
        during = f" during {err.during}" if err.during else ""
        fail(f"stopped by {err.reason}{during}; {stopped}", code=STOPPED_EXIT.get(err.reason, 143))
    if isinstance(err, KeyboardInterrupt):
        fail("interrupted", code=130)
    if isinstance(err, (TLMError, ValueError, OSError)):
        fail(_message(err))
    if os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
        raise err
    fail(f"internal error: {type(err).__name__}: {_message(err)} (set {DEBUG_ENV}=1 for the traceback and please "
          "report it)")


@contextmanager
def stop_on_signals():
    """While inside: SIGTERM and SIGINT raise :class:`Stopped` in the main thread (the command's clean-up runs and it
    prints one line, exit 143 or 130) instead of ending the process silently or with a traceback; a second signal
    while stopping is ignored. A training run installs its own handler (a checkpoint at the next step) and restores
    this one."""
    fired, owner = [], os.getpid()

    def handler(signum, frame):
        if default_in_forked_child(owner, signum):
            return
        if not fired:
            fired.append(signum)
            raise Stopped(signal.Signals(signum).name)

    signals = (signal.SIGTERM, signal.SIGINT)
    try:
        previous = {signum: signal.signal(signum, handler) for signum in signals}
    except ValueError:  # not the main thread: the defaults stay
        yield
        return
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one ``warning:`` line on stderr (no source line)."""
    say(f"warning: {one_line(message)}")


def quiet_libraries() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.showwarning = _show_warning


def check_positive(**values: int) -> None:
    """ConversionError naming the first option (``seq_len=...`` is --seq-len) that is not a positive integer."""
    for name, value in values.items():
        if value < 1:
            raise ConversionError(f"option --{name.replace('_', '-')} must be a positive integer, got {value}")


def check_device(device: str) -> None:
    """A clear error for a device string torch does not know or a device this machine does not have (torch is
    imported for any device but the CPU)."""
    if device == "cpu":
        return
    unknown = f"option --device {device!r} is not a torch device; use cpu, cuda or cuda:N"
    if not re.fullmatch(r"[a-z_]+(:\d+)?", device):
        raise ConversionError(unknown)
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConversionError(unknown) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConversionError(f"option --device {device}: CUDA is not available (this torch build or machine "
                                  "has no GPU); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConversionError(f"option --device {device}: this machine has {torch.cuda.device_count()} CUDA "
                                  f"device(s); use cuda:0..cuda:{torch.cuda.device_count() - 1}")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ConversionError(f"option --device {device}: MPS is not available on this machine; use --device cpu")


class _OneLineUsageError(click.ClickException):
    """A usage error (bad flag value, missing argument) as one ``error:`` line, like every other refusal."""

    exit_code = 2

    def __init__(self, message: str, command_path: str):
        super().__init__(message)
        self.command_path = command_path

    def show(self, file=None) -> None:
        message = one_line(self.format_message()).rstrip(".")
        click.echo(f"error: {message} (see '{self.command_path} --help')", err=True)


class OneLineCommand(click.Command):
    """click.Command whose usage errors are one line (click prints usage, a hint and the error otherwise), and which
    runs under :func:`stop_on_signals` (SIGTERM or SIGINT: the command's clean-up, one line, exit 143 or 130)."""

    def invoke(self, ctx):
        with stop_on_signals():
            return super().invoke(ctx)

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            path = err.ctx.command_path if err.ctx is not None else (info_name or self.name or "tlm-convert")
            raise _OneLineUsageError(err.format_message(), path) from None


__all__ = ["DEBUG_ENV", "OneLineCommand", "STOPPED_EXIT", "check_device", "check_positive", "fail", "quiet_libraries",
           "report_failure", "say", "stop_on_signals"]
