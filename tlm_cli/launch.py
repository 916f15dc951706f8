"""The console entry points ``tlm-convert`` and ``tlm``: the sizes the command line's inputs declare are checked
before the commands' modules are imported.

Importing torch and transformers' model code takes 5-8 s on a small machine; a config with ``num_hidden_layers:
10000000`` should not wait for it. :func:`preflight` reads what every checkpoint folder, .gguf file and YAML recipe
named on the command line declares (tlm_io.sizes and tlm_train.recipe_file: JSON, the GGUF header, YAML; no torch) and refuses an absurd or
unaffordable size in one line. Everything else (a missing file, a corrupt one, a hub id, a built-in name, ``--set``
overrides) is left to the command itself, which checks the same sizes again when it reads its input for real.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from tlm_io.errors import ConversionError, RecipeError, TLMError
from tlm_io.locate import locate
from tlm_io.sizes import check_model_size, declared_sizes
from tlm_train.recipe_file import read_recipe_file

from .common import fail

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


def convert_main() -> None:
    """``tlm-convert``."""
    preflight(sys.argv[1:])
    from .convert import convert_main as command  # once the sizes have passed

    command()


def tlm_main() -> None:
    """``tlm``."""
    preflight(sys.argv[2:])  # after the subcommand's name
    from .group import tlm_group as group  # lists the commands without importing them

    group()


__all__ = ["check_input", "convert_main", "preflight", "tlm_main"]
