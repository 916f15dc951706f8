"""The ``tlm`` command group: ``convert`` (the ``tlm-convert`` command), ``train``, ``tokenize``, ``export``,
``eval``, ``analyze`` and ``compare``. Only the CLI modules print."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist

from tlm_study.compare import format_tables, load_compare, run_comparison, select
from tlm_io.errors import ConversionError, TrainError, one_line
from tlm_io.export import FORMATS, export_checkpoint
from tlm_io.gguf_export import WEIGHT_TYPES
from tlm_io.load import check_positions, check_token_ids, load_model
from tlm_io.locate import resolve_builtin
from tlm_io.harness import (accuracy_rows, accuracy_table, check_limit, check_log_samples, evaluate_tasks, parse_tasks,
                            require_lm_eval)
from tlm_io.outputs import add_to_marker, check_files_owned, check_writable_parent
from tlm_io.perplexity import PROTOCOLS, strided_perplexity
from tlm_io.text import eval_sources, load_text, text_prefix, token_blocks
from tlm_study.analyze import residual_alignment, save_alignment, suggest_ratio
from tlm_train.budget import TRAIN_MAX_HOURS, Limits
from tlm_train.prepare import prepare_data
from tlm_train.recipe import load_recipe
from tlm_train.trainer import train

from .common import STOPPED_EXIT, OneLineCommand, check_device, check_positive, quiet_libraries, report_failure
from .convert import convert_main


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def tlm_main():
    """Tapered Language Models: convert, train, tokenize, export, eval, analyze and compare (tlm COMMAND --help)."""


tlm_main.add_command(convert_main, "convert")  # the very command of tlm-convert


@tlm_main.command("eval", cls=OneLineCommand)
@click.argument("model_path")
@click.option("--data", multiple=True,
              help="Perplexity on a text file/folder, a bundled set ('default-eval', 'eval-fiction', 'eval-code', "
                   "'eval-legal', 'eval-encyclopedic') or 'all-eval'; repeat the option for several sets (one JSON "
                   "line each).")
@click.option("--data-format", type=click.Choice(["auto", "text"]), default="auto", show_default=True,
              help="auto: .jsonl/.json/.parquet by suffix, any other UTF-8 file as text; text: read as plain text.")
@click.option("--protocol", type=click.Choice(list(PROTOCOLS)), default="strided", show_default=True,
              help="Perplexity protocol: strided (the start of text before every window, stride seq-len / 2) or "
                   "gptq (the papers' WikiText-2 protocol: documents joined by blank lines, non-overlapping windows "
                   "of 2048 tokens, the whole text).")
@click.option("--seq-len", type=int, default=None, help="Window length in tokens [512; gptq: 2048].")
@click.option("--stride", type=int, default=None, help="Window stride [seq-len / 2]; = seq-len: disjoint blocks.")
@click.option("--max-tokens", type=int, default=None, help="Tokens of each set scored at most [16384; gptq: all].")
@click.option("--tasks", default=None, metavar="TASK,...",
              help="Zero-shot accuracy through lm-evaluation-harness: task names (arc_easy, arc_challenge, "
                   "hellaswag_text, piqa, winogrande, boolq_notitle, openbookqa, lambada_openai: bundled samples; "
                   "'bundled': all eight), tasks of --include-path, or lm-eval's own.")
@click.option("--limit", type=float, default=None, help="Documents per task (or a fraction of each, below 1).")
@click.option("--num-fewshot", type=int, default=None, help="Examples in each prompt [the task's own, 0].")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N or mps.")
@click.option("--include-path", multiple=True, help="A folder of your own task YAMLs and their data (repeatable).")
@click.option("--task-data", default=None, metavar="DIR|hub",
              help="Where the standard tasks read their documents [the bundled samples]: a folder of full files "
                   "(arc_easy.jsonl, hellaswag.jsonl, ...), or 'hub': lm-eval's own tasks from the datasets cache.")
@click.option("--output-path", default=None, help="Folder for lm-eval's results JSON (OUTPUT_PATH/MODEL/results_*.json).")
@click.option("--log-samples", is_flag=True,
              help="Also write each document's record (lm-eval's samples_TASK_*.jsonl) under --output-path.")
@click.option("--trust-remote-code", is_flag=True, help="Let the tokenizer run the model folder's own code.")
def eval_command(model_path, data, data_format, protocol, seq_len, stride, max_tokens, tasks, limit, num_fewshot,
                 batch_size, device, include_path, task_data, output_path, log_samples, trust_remote_code):
    """Perplexity (--data: one JSON line per set) or zero-shot accuracy (--tasks: one table, through
    lm-evaluation-harness) of MODEL_PATH: a TLM, transformers folder, .gguf or built-in name."""
    try:
        quiet_libraries()
        if bool(data) == bool(tasks):
            raise ConversionError("give --data (perplexity) or --tasks (zero-shot accuracy), one of them")
        check_positive(batch_size=batch_size)
        check_device(device)
        if tasks:
            lines, results = None, _eval_tasks(model_path, tasks, limit, num_fewshot, batch_size, device,
                                               include_path, task_data, output_path, log_samples, trust_remote_code)
        else:
            lines = _eval_perplexity(model_path, data, data_format, protocol, seq_len, stride, max_tokens,
                                     batch_size, device, trust_remote_code)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        report_failure(err)
    if lines is not None:
        for line in lines:
            click.echo(json.dumps(line))
        return
    click.echo(accuracy_table(accuracy_rows(results)))
    if output_path:
        click.echo(f"wrote lm-eval's results JSON under {output_path}")


def _eval_tasks(model_path, tasks, limit, num_fewshot, batch_size, device, include_path, task_data, output_path,
                log_samples, trust_remote_code) -> dict:
    """lm-eval's results of MODEL_PATH on ``tasks`` (tlm_io.harness); the arguments are checked first, the model
    loaded last."""
    require_lm_eval()
    parse_tasks(tasks)
    check_limit(limit)
    check_log_samples(log_samples, output_path)
    if output_path is not None:
        check_writable_parent(Path(output_path).expanduser().absolute(), option="--output-path")
    model, tokenizer, _ = load_model(model_path, device=device, trust_remote_code=trust_remote_code)
    return evaluate_tasks(model, tokenizer, tasks, limit=limit, num_fewshot=num_fewshot, batch_size=batch_size,
                          include_path=include_path, task_data=task_data, output_path=output_path,
                          model_name=model_path, log_samples=log_samples)


def _eval_perplexity(model_path, data, data_format, protocol, seq_len, stride, max_tokens, batch_size, device,
                     trust_remote_code) -> list[dict]:
    """One JSON line per evaluation set of ``data``: perplexity under ``protocol`` (tlm_io.perplexity)."""
    policy = PROTOCOLS[protocol]
    seq_len = policy.seq_len if seq_len is None else seq_len
    if stride is not None and not policy.overlap:
        raise ConversionError(f"--stride: the {protocol} protocol's windows do not overlap (stride = --seq-len); "
                              "drop --stride")
    stride = (max(1, seq_len // 2) if stride is None else stride) if policy.overlap else seq_len
    max_tokens = policy.max_tokens if max_tokens is None else max_tokens
    check_positive(seq_len=seq_len, stride=stride, **({} if max_tokens is None else {"max_tokens": max_tokens}))
    if seq_len < 2 or stride > seq_len:
        raise ConversionError(f"options --seq-len {seq_len} / --stride {stride}: need seq-len >= 2 and "
                              "stride <= seq-len")
    sets = eval_sources(data)
    texts = {name: load_text(name, data_format=data_format, keep_empty=policy.keep_empty)
             for name in sets}  # bad data fails before the load
    model, tokenizer, _ = load_model(model_path, device=device, trust_remote_code=trust_remote_code)
    check_positions(model.config, seq_len, model_path)
    lines = []
    for name, text in texts.items():
        ids = torch.tensor(tokenizer(text, add_special_tokens=not policy.window_prefix)["input_ids"][:max_tokens],
                           dtype=torch.long)
        need = seq_len if policy.full_windows else 2
        if len(ids) < need:
            raise ConversionError(f"evaluation data {name!r} has {len(ids)} tokens, fewer than one window of "
                                  f"{need}; pass more text" + (" or a smaller --seq-len" if need > 2 else ""))
        check_token_ids(ids, model.config.vocab_size, f"evaluation data {name!r} (tokenized)")
        prefix = text_prefix(tokenizer) if policy.window_prefix else ()  # before every window
        if seq_len < 2 + len(prefix):
            raise ConversionError(f"option --seq-len {seq_len} is too short for the tokenizer's "
                                  f"{len(prefix)}-token start of text; use at least {2 + len(prefix)}")
        result = strided_perplexity(model, ids, seq_len, stride, batch_size, prefix, full=policy.full_windows)
        lines.append({"model": model_path, "data": name, "protocol": protocol, "tokens": int(len(ids)),
                      "seq_len": seq_len, "stride": min(stride, seq_len - len(prefix)), "window_prefix": list(prefix),
                      "scored_tokens": result.tokens, "windows": result.windows,
                      "nll": result.nll, "perplexity": result.perplexity})
    return lines


ALIGNMENT_FILES = ("alignment.json", "alignment.png")  # what tlm analyze -o writes


@tlm_main.command("analyze", cls=OneLineCommand)
@click.argument("model_path")
@click.option("--data", required=True, help="Text file/folder or 'default-eval' (bundled held-out English).")
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--max-tokens", type=int, default=16384, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("-o", "--output", default=None,
              help="Folder for alignment.json and alignment.png (default: print the JSON only).")
@click.option("--trust-remote-code", is_flag=True, help="Let the tokenizer run the model folder's own code.")
def analyze_command(model_path, data, seq_len, max_tokens, batch_size, output, trust_remote_code):
    """Residual alignment rho_MLP per layer of MODEL_PATH (cosine of each MLP's output with the residual stream,
    against the block input h_l and the post-mixer stream z_l) and its Pearson r with depth, as JSON."""
    try:
        quiet_libraries()
        check_positive(seq_len=seq_len, max_tokens=max_tokens, batch_size=batch_size)
        if output is not None and Path(output).exists() and not Path(output).is_dir():
            raise ConversionError(f"option -o {output}: exists and is not a folder")
        if output is not None:  # before the model is loaded: a parent that is a file or read-only, a user's file
            check_writable_parent(Path(output).expanduser().absolute(), option="-o")
            check_files_owned(output, ALIGNMENT_FILES, "-o", legacy=("alignment.json", ("h", "z", "num_layers")))
        t0 = time.perf_counter()
        model, tokenizer, _ = load_model(model_path, trust_remote_code=trust_remote_code)
        check_positions(model.config, seq_len, model_path)
        blocks = token_blocks(tokenizer, load_text(data), seq_len, max_tokens, what="analysis")
        check_token_ids(blocks, model.config.vocab_size, f"analysis data {data!r} (tokenized)")
        load_s = time.perf_counter() - t0
        result = residual_alignment(model, blocks, batch_size=batch_size, data=data)
        suggestion = suggest_ratio(result)
        extra = {"model": model_path, "data": data, "tokens": int(blocks.numel()), "load_seconds": round(load_s, 2),
                 "heuristic_ratio_suggestion": {"ratio": suggestion.ratio, "reason": suggestion.reason,
                                                "note": suggestion.heuristic}}
        report = {**extra, **result.to_dict()}
        if output is not None:
            json_path, png_path = save_alignment(result, output, extra=extra, title=Path(model_path).name)
            add_to_marker(output, "tlm analyze", ALIGNMENT_FILES)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        report_failure(err)
    if output is None:
        click.echo(json.dumps(report))
        return
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    click.echo(f"wrote {json_path} and {png_path}")
    click.echo(f"rho_h by layer: {' '.join(f'{v:.3f}' for v in result.h.mean)}")
    click.echo(f"rho_z by layer: {' '.join(f'{v:.3f}' for v in result.z.mean)}")
    click.echo(f"pearson r(depth, rho): h {fmt(result.h.pearson_r)}, z {fmt(result.z.pearson_r)} "
               f"({result.n_tokens} tokens per layer, {result.seconds:.1f}s)")



def _train_limits(max_hours: float) -> Limits:
    """``tlm train``'s time budget: notes on stderr from the main process, a refusal above ``max_hours``."""
    if not (math.isfinite(max_hours) and max_hours >= 0):
        raise ConversionError(f"--max-hours {max_hours}: must be 0 (no limit) or a positive number of hours")

    def note(text: str) -> None:
        if not (dist.is_initialized() and dist.get_rank() != 0):
            click.echo(f"note: {one_line(text)}", err=True)

    return Limits(max_hours or None, note, error=TrainError)


@tlm_main.command("train", cls=OneLineCommand)
@click.argument("recipe_path", metavar="RECIPE.yaml")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a recipe value, e.g. --set optim.lr=1e-3 (repeatable).")
@click.option("--resume", "resume", is_flag=False, flag_value="latest", default=None, metavar="[CHECKPOINT]",
              help="Continue from the latest checkpoint in output_dir (or from the given checkpoint folder).")
@click.option("--no-progress", is_flag=True, help="No progress bar (metrics.jsonl is written either way).")
@click.option("--max-hours", type=float, default=TRAIN_MAX_HOURS, show_default=True,
              help="Refuse a run whose time, estimated on its first steps, is above this many hours (0: no limit). "
                   "An estimate above a minute is said aloud.")
@click.option("--trust-remote-code", is_flag=True,
              help="Let tokenizers run their folder's own Python code (auto_map); only for sources you trust.")
def train_command(recipe_path, overrides, resume, no_progress, max_hours, trust_remote_code):
    """Train a TLM from RECIPE.yaml: from scratch (model:) or continued from a checkpoint (init_from:).

    Runs the same under torchrun (DDP, or FSDP with train.parallel=fsdp): torchrun --nproc_per_node N -m
    tlm_train train RECIPE.yaml

    Exit status: 0 finished; 1 error; 143 stopped by SIGTERM or the STOP file, 130 by SIGINT (a checkpoint was
    written: continue with the printed --resume command).
    """
    try:
        quiet_libraries()
        overrides = list(overrides) + (["trust_remote_code=true"] if trust_remote_code else [])
        limits = _train_limits(max_hours)
        recipe = load_recipe(recipe_path, overrides)
        result = train(recipe, resume=True if resume == "latest" else resume,
                       progress=False if no_progress else None, limits=limits)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        report_failure(err, stopped="nothing was trained; run the same command again")
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


@tlm_main.command("tokenize", cls=OneLineCommand)
@click.argument("recipe_path", metavar="RECIPE.yaml")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a recipe value, e.g. --set data.num_proc=32 (repeatable).")
def tokenize_command(recipe_path, overrides):
    """Tokenize RECIPE.yaml's data into the token cache (data.num_proc processes), before a multi-GPU run.

    Resumable: run it again after an interruption. Prints the cache's token count, shards and folder.
    """
    try:
        quiet_libraries()
        summary = prepare_data(load_recipe(recipe_path, list(overrides)))
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        report_failure(err, stopped="the shards written so far are kept; run it again to continue")
    click.echo(json.dumps(summary))


@tlm_main.command("export", cls=OneLineCommand)
@click.argument("model_path")
@click.option("--to", "fmt", required=True, type=click.Choice(FORMATS),
              help="Checkpoint format (gguf: OUTPUT/model.gguf for llama.cpp).")
@click.option("-o", "--output", required=True, help="Output folder (refused if it exists; written atomically).")
@click.option("--type", "weight_type", default=None, type=click.Choice(WEIGHT_TYPES),
              help="Weight type [f32]; q8_0 for gguf only (other llama.cpp types: llama-quantize).")
def export_command(model_path, fmt, output, weight_type):
    """Write MODEL_PATH (TLM or converted checkpoint, transformers folder, .gguf) in another format."""
    try:
        quiet_libraries()
        export_checkpoint(resolve_builtin(model_path), output, fmt, weight_type)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        report_failure(err)
    click.echo(f"wrote {output} ({fmt} format)")


@tlm_main.command("compare", cls=OneLineCommand)
@click.argument("compare_path", metavar="COMPARE.yaml")
@click.option("--seeds", default=None, metavar="SEEDS",
              help="Seeds to run, e.g. 0-4 or 0,2,7 [the file's seeds, else the base recipe's seed].")
@click.option("--split", "splits", default=None, metavar="N+M,...",
              help="Splits of N shared steps + M continued steps, e.g. 90+60,90+270 [the file's splits].")
@click.option("--mixer", "mixers", default=None, metavar="NAME,...",
              help="Mixers to run, e.g. attention,titans; config overrides come from the file's mixers: [the "
                   "file's mixers, else the base recipe's].")
@click.option("--jobs", type=int, default=1, show_default=True,
              help="(mixer, seed) units run at a time, each in its own process (give each one CPU thread in the "
                   "base recipe: train.num_threads).")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Override a value of the compare file, e.g. --set rewarm_steps=10 (repeatable).")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
def compare_command(compare_path, seeds, splits, mixers, jobs, overrides, no_progress):
    """Does converting pay off? For every mixer, seed and split N+M: (a) uniform and (b) tapered from scratch for
    N+M steps, (c) uniform for N steps -> tlm-convert -> M steps, (d) uniform continued for M steps, at equal
    parameters and tokens, on one warmup-stable-decay learning-rate schedule (c and d: fresh AdamW at step N, a
    short re-warm, then the schedule of a and b). Prints the tables (mean ± std over seeds, paired differences per
    seed); writes compare.json, compare.md and one curves PNG per mixer and split into output_dir (named after
    the file's report: key). Finished runs are collected, not rerun."""
    try:
        quiet_libraries()
        check_positive(jobs=jobs)
        spec = select(load_compare(compare_path, list(overrides)), seeds, splits, mixers)
        check_files_owned(spec.output_dir, _report_files(spec), "output_dir", legacy=(f"{spec.report}.json",
                                                                                       ("plan", "spec", "studies")))
        studies = run_comparison(spec, progress=not no_progress and jobs == 1, jobs=jobs)
        add_to_marker(spec.output_dir, "tlm compare", _report_files(spec))
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        report_failure(err, stopped="finished runs are kept; run it again to continue")
    click.echo(format_tables(studies, spec))
    click.echo(f"wrote {spec.output_dir}/{spec.report}.json, {spec.report}.md and curves-{spec.report}-*.png")


def _report_files(spec) -> list[str]:
    """The files ``tlm compare`` writes into its output_dir (the curves: those there now)."""
    curves = sorted(p.name for p in Path(spec.output_dir).glob(f"curves-{spec.report}-*.png"))
    return [f"{spec.report}.json", f"{spec.report}.md", *curves]


__all__ = ["tlm_main"]
