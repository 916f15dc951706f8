"""``tlm train``, ``tlm tokenize`` and ``tlm compare``, added to the ``tlm`` command group of tlm_convert.cli (eval,
analyze)."""

from __future__ import annotations

import json
import shlex
import sys

import click

from tlm_convert.cli import _Command, _fail, _quiet_libraries, _report_failure, tlm_main


STOPPED_EXIT = {"SIGTERM": 143, "STOP": 143, "SIGINT": 130}  # 128 + signal number; the STOP file counts as SIGTERM


@tlm_main.command("train", cls=_Command)
@click.argument("recipe_path", metavar="RECIPE.yaml")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a recipe value, e.g. --set optim.lr=1e-3 (repeatable).")
@click.option("--resume", "resume", is_flag=False, flag_value="latest", default=None, metavar="[CHECKPOINT]",
              help="Continue from the latest checkpoint in output_dir (or from the given checkpoint folder).")
@click.option("--no-progress", is_flag=True, help="No progress bar (metrics.jsonl is written either way).")
@click.option("--trust-remote-code", is_flag=True,
              help="Let tokenizers run their folder's own Python code (auto_map); only for sources you trust.")
def train_command(recipe_path, overrides, resume, no_progress, trust_remote_code):
    """Train a TLM from RECIPE.yaml: from scratch (model:) or continued from a checkpoint (init_from:).

    Runs the same under torchrun (DDP, or FSDP with train.parallel=fsdp): torchrun --nproc_per_node N -m
    tlm_train train RECIPE.yaml

    Exit status: 0 finished; 1 error; 143 stopped by SIGTERM or the STOP file, 130 by SIGINT (a checkpoint was
    written: continue with the printed --resume command).
    """
    try:
        from .recipe import load_recipe
        from .trainer import TrainError, train

        _quiet_libraries()
        overrides = list(overrides) + (["trust_remote_code=true"] if trust_remote_code else [])
        recipe = load_recipe(recipe_path, overrides)
        result = train(recipe, resume=True if resume == "latest" else resume,
                       progress=False if no_progress else None)
    except TrainError as err:
        _fail(str(err))
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        _report_failure(err)
    import torch.distributed as dist

    main = not (dist.is_initialized() and dist.get_rank() != 0)
    if result.stopped:  # every rank exits with the same status
        again = ["tlm", "train", recipe_path, *[x for o in overrides for x in ("--set", o)], "--resume"]
        if main:
            click.echo(f"stopped ({result.stop_reason}) at step {result.steps}; checkpoint written to "
                       f"{result.output_dir} (continue with: {shlex.join(again)})")
        sys.exit(STOPPED_EXIT.get(result.stop_reason, 143))
    if not main:
        return
    summary = {"output_dir": str(result.output_dir), "final": str(result.final_dir), "steps": result.steps,
               "tokens": result.tokens, "eval_loss": result.eval_loss, "seconds": round(result.seconds, 2)}
    click.echo(json.dumps(summary))


@tlm_main.command("tokenize", cls=_Command)
@click.argument("recipe_path", metavar="RECIPE.yaml")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a recipe value, e.g. --set data.num_proc=32 (repeatable).")
def tokenize_command(recipe_path, overrides):
    """Tokenize RECIPE.yaml's data into the token cache (data.num_proc processes), before a multi-GPU run.

    Resumable: run it again after an interruption. Prints the cache's token count, shards and folder.
    """
    try:
        from .prepare import prepare_data
        from .recipe import load_recipe
        from .trainer import TrainError

        _quiet_libraries()
        summary = prepare_data(load_recipe(recipe_path, list(overrides)))
    except TrainError as err:
        _fail(str(err))
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        _report_failure(err)
    click.echo(json.dumps(summary))


@tlm_main.command("compare", cls=_Command)
@click.argument("compare_path", metavar="COMPARE.yaml")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a value of the compare file, e.g. --set continue_steps=50 (repeatable).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def compare_command(compare_path, overrides, no_progress):
    """Converted vs from scratch at equal parameters and tokens: (a) uniform and (b) tapered from scratch, (c) uniform
    for N steps -> tlm-convert -> M steps, (d) uniform continued for M steps. Prints the table; writes compare.json,
    compare.md and loss_curves.png into output_dir. Finished runs are collected, not rerun."""
    try:
        from .compare import format_table, load_compare, run_comparison
        from .trainer import TrainError

        _quiet_libraries()
        spec = load_compare(compare_path, list(overrides))
        rows = run_comparison(spec, progress=not no_progress)
    except TrainError as err:
        _fail(str(err))
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        _report_failure(err)
    click.echo(format_table(rows))
    click.echo(f"wrote {spec.output_dir}/compare.json, compare.md and loss_curves.png")


__all__ = ["tlm_main"]
