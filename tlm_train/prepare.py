"""``tlm tokenize``: fill a recipe's token cache in one process before a run.

Under torchrun, rank 0 tokenizes while the other ranks wait in a collective barrier, which times out (NCCL's
default: 10 minutes) long before a corpus of billions of tokens is tokenized. Filling the cache first, with
``data.num_proc`` processes, makes the run's data set-up a read of the cache. Interrupted, it continues where it
stopped when run again.
"""

from __future__ import annotations

import time

from tlm_io.errors import TrainError
from tlm_io.load import load_tokenizer
from tlm_io.tokenizer_source import tokenizer_files

from .data import recipe_tokens
from .recipe import Recipe


def recipe_tokenizer(recipe: Recipe):
    """The tokenizer a run of ``recipe`` uses (``tokenizer:``, else init_from's), read from its tokenizer files
    alone: no weights are loaded."""
    if recipe.tokenizer is not None:
        return load_tokenizer(recipe.tokenizer, recipe.trust_remote_code)
    if tokenizer_files(recipe.init_from, recipe.trust_remote_code) is None:
        raise TrainError(f"'{recipe.init_from}' has no tokenizer files; set tokenizer: (a tokenizer folder, or "
                         "'byte')")
    return load_tokenizer(recipe.init_from, recipe.trust_remote_code)


def prepare_data(recipe: Recipe) -> dict:
    """Tokenizes ``recipe``'s training and held-out data into the cache; returns what it holds."""
    start = time.perf_counter()
    train, held = recipe_tokens(recipe_tokenizer(recipe), recipe.data)
    return {"train": recipe.data.train, "train_tokens": len(train), "shards": len(train.counts),
            "cache": str(train.folder), "eval_tokens": None if held is None else len(held),
            "seconds": round(time.perf_counter() - start, 2)}


__all__ = ["prepare_data", "recipe_tokenizer"]
