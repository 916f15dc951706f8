"""The ``tlm`` group as the console runs it: ``tlm --help`` lists the commands without importing them (tlm_cli.main
imports torch and transformers: seconds), ``tlm convert`` is the light tlm_cli.convert, and any other command comes
from tlm_cli.main's group when it runs or shows its own help."""

from __future__ import annotations

import click

from .convert import convert_main

HELP = "Tapered Language Models: convert, train, tokenize, export, eval, analyze and compare (tlm COMMAND --help)."
# what tlm_cli.main's group lists: the start of each command's docstring (tests/test_cli.py keeps them equal)
COMMANDS = {
    "analyze": "Residual alignment rho_MLP per layer of MODEL_PATH (cosine of each MLP's output with the residual "
               "stream, against the block input h_l and the post-mixer stream z_l) and its Pearson r with depth, as "
               "JSON.",
    "compare": "Does converting pay off? For every mixer, seed and split N+M: (a) uniform and (b) tapered from "
               "scratch for N+M steps, (c) uniform for N steps -> tlm-convert -> M steps, (d) uniform continued for M "
               "steps, at equal parameters and tokens.",
    "convert": "Convert a uniform checkpoint INPUT_MODEL into a tapered TLM with exactly the same parameter count.",
    "eval": "Perplexity (--data: one JSON line per set) or zero-shot accuracy (--tasks: one table, through "
            "lm-evaluation-harness) of MODEL_PATH: a TLM, transformers folder, .gguf or built-in name.",
    "export": "Write MODEL_PATH (TLM or converted checkpoint, transformers folder, .gguf) in another format.",
    "tokenize": "Tokenize RECIPE.yaml's data into the token cache (data.num_proc processes), before a multi-GPU run.",
    "train": "Train a TLM from RECIPE.yaml: from scratch (model:) or continued from a checkpoint (init_from:).",
}


class LazyGroup(click.Group):
    """A click group whose commands are imported when one is used, not to list them."""

    def list_commands(self, ctx) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx, name: str):
        if name not in COMMANDS:
            return None
        if name == "convert":
            return convert_main
        from .main import tlm_main  # the commands' modules: torch and transformers

        return tlm_main.commands[name]

    def format_commands(self, ctx, formatter) -> None:
        listing = click.Group(commands=[click.Command(name, help=text) for name, text in COMMANDS.items()])
        listing.format_commands(ctx, formatter)


tlm_group = LazyGroup("tlm", help=HELP, context_settings={"help_option_names": ["-h", "--help"]})

__all__ = ["COMMANDS", "HELP", "LazyGroup", "tlm_group"]
