"""The console entry points ``tlm-convert`` and ``tlm``: interrupts are one line from the first moment, and the sizes
the command line's inputs declare are checked before the commands' modules are imported.

Importing this module (the first thing the console scripts and ``python -m tlm_cli``/``tlm_convert``/``tlm_train``
do) makes SIGINT and SIGTERM end the process at once with one ``error: stopped by SIGINT while starting; nothing
was written`` line and status 130/143: while the commands' modules are imported (seconds of torch and transformers)
nothing is written yet, so nothing needs cleaning up, and no KeyboardInterrupt traceback of a half-imported library
is shown. Once a command runs, its own handlers take over (tlm_cli.common.stop_on_signals: its clean-up, then its
one line); when it has finished, a late signal is ignored while the process exits. A worker that multiprocessing's
spawn starts for a command (``tlm compare --jobs``) imports this module too: it ignores SIGINT, which a Ctrl-C sends
to every process of the terminal's group, and leaves the one line to the command.

Importing torch and transformers' model code takes 5-8 s on a small machine; a config with ``num_hidden_layers:
10000000`` should not wait for it. :func:`preflight` reads what every checkpoint folder, .gguf file and YAML recipe
named on the command line declares (tlm_io.sizes and tlm_train.recipe_file: JSON, the GGUF header, YAML; no torch) and refuses an absurd or
unaffordable size in one line. Everything else (a missing file, a corrupt one, a hub id, a built-in name, ``--set``
overrides) is left to the command itself, which checks the same sizes again when it reads its input for real.
"""

from __future__ import annotations

import os
import signal
import sys

from tlm_io.signals import default_in_forked_child  # os and signal only: as light as the handlers need

_OWNER = os.getpid()


def _stopped_while_starting(signum, frame) -> None:
    if default_in_forked_child(_OWNER, signum):
        return
    os.write(2, f"error: stopped by {signal.Signals(signum).name} while starting; nothing was written\n".encode())
    os._exit(128 + signum)


def stop_while_starting() -> None:
    """SIGINT and SIGTERM end the process at once with one line (nothing has been written yet)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stopped_while_starting)


def _started_as() -> str | None:
    """"command" when this process is a console command (``tlm``, ``tlm-convert``, ``python -m tlm_cli``,
    ``tlm_convert``, ``tlm_train``), "worker" in a process multiprocessing's spawn started for one (it imports the
    main module again), None in a program that imports this module."""
    script = os.path.basename(sys.argv[0] if sys.argv else "")
    name = os.path.splitext(script)[0]
    if name == "__main__":
        name = os.path.basename(os.path.dirname(sys.argv[0]))
    if name not in ("tlm", "tlm-convert", "tlm_cli", "tlm_convert", "tlm_train"):
        return None
    mp = sys.modules.get("multiprocessing")
    return "worker" if mp is not None and mp.current_process().name != "MainProcess" else "command"


_ROLE = _started_as()
if _ROLE == "command":  # before the imports below: a Ctrl-C a moment after start-up is one line too
    stop_while_starting()
elif _ROLE == "worker":  # a Ctrl-C reaches every process of the group: the command stops its pool and says so
    signal.signal(signal.SIGINT, signal.SIG_IGN)

from collections.abc import Mapping  # noqa: E402 - after the handlers
from pathlib import Path  # noqa: E402

from tlm_io.errors import ConversionError, RecipeError, TLMError  # noqa: E402
from tlm_io.locate import locate  # noqa: E402
from tlm_io.sizes import check_model_size, declared_sizes  # noqa: E402
from tlm_train.recipe_file import read_recipe_file  # noqa: E402

from .common import fail  # noqa: E402

OUTPUT_OPTIONS = ("-o", "--output")  # their value is written, never read as an input


def _inputs(args: list[str]):
    """The command-line words that could name an input: not an option, not the value of an output option."""
    skip = False
    for word in args:
        if skip or word.startswith("-"):
            skip = word in OUTPUT_OPTIONS
            continue
        yield word


def check_input(word: str) -> None:
    """Refuse (ConversionError) a local checkpoint or recipe ``word`` whose declared model sizes are absurd."""
    path = Path(word).expanduser()
    if path.suffix.lower() in (".yaml", ".yml") and path.is_file():
        _check_recipe(path)
        return
    if not path.exists():
        return  # a hub id or a built-in name: the command resolves (and checks) it
    try:
        source = locate(path, download=False)
    except ConversionError:
        return  # not a checkpoint: the command says what it is
    where = source / "config.json" if source.is_dir() else source
    check_model_size(declared_sizes(source), where)


def _check_recipe(path: Path) -> None:
    try:
        data = read_recipe_file(path)  # the reader tlm train uses: bounded, nesting and duplicate keys checked
    except (OSError, RecipeError):
        return  # the command names the problem
    model = data.get("model") if isinstance(data, Mapping) else None
    config = model.get("config") if isinstance(model, Mapping) else None
    if isinstance(config, Mapping):
        check_model_size(config, "recipe", prefix="model.config.")  # the words of tlm_train.build's own check


def preflight(args: list[str]) -> None:
    """Exit with one ``error:`` line when an input named in ``args`` declares an absurd model size."""
    try:
        for word in _inputs(args):
            check_input(word)
    except TLMError as err:
        fail(str(err))


def _run(command) -> None:
    """Run the click ``command``; once it is done, a signal no longer interrupts the exit (its output is written)."""
    try:
        command()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)


def convert_main() -> None:
    """``tlm-convert``."""
    stop_while_starting()
    preflight(sys.argv[1:])
    from .convert import convert_main as command  # once the sizes have passed

    _run(command)


def tlm_main() -> None:
    """``tlm``."""
    stop_while_starting()
    preflight(sys.argv[2:])  # after the subcommand's name
    from .group import tlm_group as group  # lists the commands without importing them

    _run(group)


__all__ = ["check_input", "convert_main", "preflight", "stop_while_starting", "tlm_main"]
