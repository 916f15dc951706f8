"""The conversion pipeline behind ``tlm-convert``: uniform checkpoint -> tapered TLM at the same parameter count.

load -> (eval before) -> calibrate / rank / resize, layer by layer -> upcycle mixer -> strict reload and
parameter check -> (eval after) -> export into a temporary folder -> report and plot -> rename onto OUTPUT.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from tlm import TLMForCausalLM, parse_ratio, taper_widths
from tlm.modules import RotaryEmbedding, rope_inv_freq

from .calibrate import calibrate_and_plan
from .checkpoint import load_source
from .data import load_text, token_blocks
from .errors import ConversionError
from .export import FORMATS, export_model
from .importance import METRICS
from .surgery import GROW_INITS
from .upcycle import carry_scores, upcycle

logger = logging.getLogger(__name__)

PHASES = ("load", "calibrate", "rank", "resize", "save", "eval")
MIXER_CHOICES = ("attention", "gated_attention", "hope_attention", "titans")


@dataclass
class ConvertOptions:
    schedule: str = "cosine"
    ratio: str = "1.5/0.5"
    multiple_of: int | None = None  # default: 256 for --export deci, else 16 when it divides the width, else 1
    calibration_data: str = "default"
    calibration_tokens: int = 65536
    seq_len: int = 512
    importance: str | None = None  # default: "obs" (best measured), "activation" with low_memory (see validate)
    grow_init: str = "noise"
    refit: bool = True
    refit_target: str = "residual"
    mixer: str = "attention"
    export: str = "tlm"
    eval_data: str | None = None
    eval_tokens: int = 16384
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 8
    low_memory: bool = False
    overwrite: bool = False

    def validate(self) -> None:
        """Fail fast, before anything is loaded; one line per problem. Fills in the defaults that depend on other
        options: ``importance`` is "obs" (structured OBS, the best variant measured on SmolLM2, bench/RESULTS.md),
        or "activation" with ``low_memory`` (OBS holds dense I × I matrices, which the streaming path avoids)."""
        if self.importance is None:
            self.importance = "activation" if self.low_memory else "obs"
        choices = {"importance": (self.importance, METRICS), "grow_init": (self.grow_init, GROW_INITS),
                   "mixer": (self.mixer, MIXER_CHOICES), "export": (self.export, FORMATS),
                   "dtype": (self.dtype, ("float32", "bfloat16", "float16"))}
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConversionError(f"--{name.replace('_', '-')} {value!r}: expected one of {', '.join(allowed)}")
        parse_ratio(self.ratio)
        for name in ("calibration_tokens", "seq_len", "eval_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ConversionError(f"--{name.replace('_', '-')} must be a positive integer")
        if self.multiple_of is not None and self.multiple_of < 1:
            raise ConversionError(f"--multiple-of {self.multiple_of}: must be a positive integer")
        if self.export == "deci" and self.multiple_of is not None and self.multiple_of % 256:
            raise ConversionError(f"--export deci needs widths that are multiples of 256; --multiple-of "
                                  f"{self.multiple_of} is not (drop it, or use --export tlm)")
        if self.refit_target not in ("local", "residual"):
            raise ConversionError(f"--refit-target {self.refit_target!r}: expected local or residual")
        if self.calibration_tokens < self.seq_len:
            raise ConversionError(f"--calibration-tokens {self.calibration_tokens} is less than one block of "
                                  f"--seq-len {self.seq_len}; raise it or lower --seq-len")


class PhaseTimer:
    """Seconds per phase; ``with timer("calibrate"):`` adds to that phase."""

    def __init__(self, on_phase=None):
        self.seconds = {p: 0.0 for p in PHASES}
        self.on_phase = on_phase
        self._running: list[tuple[str, float]] = []  # phases entered and not yet left, with their start

    @contextmanager
    def __call__(self, phase: str):
        if self.on_phase:
            self.on_phase(phase)
        start = time.perf_counter()
        self._running.append((phase, start))
        try:
            yield
        finally:
            self._running.remove((phase, start))
            self.seconds[phase] += time.perf_counter() - start

    def snapshot(self) -> dict[str, float]:
        """Seconds per phase up to now, counting the time already spent in phases still running (the report is
        written from inside the "save" phase, which would otherwise read 0)."""
        now = time.perf_counter()
        seconds = dict(self.seconds)
        for phase, start in self._running:
            seconds[phase] += now - start
        return seconds


def convert(source: str, output: str, options: ConvertOptions | None = None, on_phase=None,
            on_layer=None) -> dict:
    """Convert ``source`` into ``output``; return the conversion report (also written as conversion_report.json)."""
    opts = options or ConvertOptions()
    opts.validate()
    out = Path(output)
    if out.exists() and not opts.overwrite:
        raise ConversionError(f"output {out} already exists; pass --overwrite or choose another -o")
    if Path(source).resolve() == out.resolve():
        raise ConversionError("output must differ from the input; the input is never modified")
    if opts.low_memory:
        from .streaming import convert_streaming

        return convert_streaming(source, out, opts, on_phase=on_phase, on_layer=on_layer)
    timer = PhaseTimer(on_phase)
    torch.manual_seed(opts.seed)
    with timer("load"):
        src = load_source(source, dtype=torch.float32)
        if "hope_attention" in src.tlm_config.mixer:
            raise ConversionError("this TLM has hope_attention layers, whose MLP is split into memory levels and "
                                  "cannot be resized; convert the attention checkpoint it came from instead")
        model, tokenizer = _build_model(src, opts)
        src.state_dict = {}  # the model holds these tensors now
        widths = plan_widths(src.tlm_config, opts)
        calib = token_blocks(tokenizer, load_text(opts.calibration_data), opts.seq_len, opts.calibration_tokens)
        evalb = _eval_blocks(tokenizer, opts)
    report = _report_head(src, opts, widths, calib)
    report["notes"] = list(src.notes)
    if evalb is not None:
        with timer("eval"):
            report["perplexity_before"] = perplexity(model, evalb, opts.batch_size)
    result = calibrate_and_plan(model, calib, widths, importance=opts.importance, grow_init=opts.grow_init,
                                refit=opts.refit, refit_target=opts.refit_target, batch_size=opts.batch_size,
                                seed=opts.seed,
                                timer=timer, progress=on_layer)
    with timer("resize"):
        config = model.config
        config.intermediate_sizes = list(widths)
        scores = [carry_scores(s, p.keep, p.grow) for s, p in zip(result.scores, result.plans)]
        config, state = upcycle(config, model.state_dict(), opts.mixer, scores, seed=opts.seed)
        final = _strict_reload(config, state, opts)
        report.update(_param_report(src, final, opts))
    if evalb is not None:
        with timer("eval"):
            report["perplexity_after"] = perplexity(final, evalb, opts.batch_size)
            report["perplexity_ratio"] = report["perplexity_after"] / report["perplexity_before"]
    report["importance_profile"] = [float(s.mean()) for s in result.scores]
    with timer("save"):
        _write_output(final, out, src, opts, report, timer)
    return report


def _build_model(src, opts):
    from transformers import AutoTokenizer

    if src.tokenizer_source is None:
        raise ConversionError(f"{src.path} has no tokenizer files; add the source tokenizer to the folder")
    path, kwargs = src.tokenizer_kwargs()
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = materialize(src.tlm_config, src.state_dict)
    return model.to(opts.device).eval(), tokenizer


def materialize(config, state_dict: dict) -> TLMForCausalLM:
    """A TLMForCausalLM that *uses* the given tensors (built on the meta device, loaded strictly with
    ``assign=True``): no random init and no second copy of the weights in memory."""
    tied = config.tie_word_embeddings
    with torch.device("meta"):
        model = TLMForCausalLM(config)
    state = {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ConversionError(f"internal error: weights do not match the config "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for module in model.modules():  # non-persistent buffers are not in the state dict
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = rope_inv_freq(module.params, module.head_dim)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def plan_widths(config, opts: ConvertOptions) -> list[int]:
    """Per-layer target widths; the source must be uniform (its width is the base width D)."""
    widths = config.intermediate_sizes
    if len(set(widths)) != 1:
        raise ConversionError(f"the source MLP widths are not uniform ({min(widths)}..{max(widths)}); "
                              "tlm-convert starts from uniform checkpoints")
    base = widths[0]
    q = opts.multiple_of or (256 if opts.export == "deci" else 16 if base % 16 == 0 else 1)
    try:
        return taper_widths(len(widths), base, opts.schedule, parse_ratio(opts.ratio), multiple_of=q)
    except ValueError as err:
        raise ConversionError(str(err).splitlines()[0]) from None


def _eval_blocks(tokenizer, opts):
    if not opts.eval_data:
        return None
    return token_blocks(tokenizer, load_text(opts.eval_data), opts.seq_len, opts.eval_tokens, what="evaluation")


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) over non-overlapping blocks (every block scores seq_len - 1 tokens).

    The logits are formed 128 positions at a time from the batch's last hidden states: a (batch, seq, vocab) fp32
    logit tensor, with its shifted copy and log-softmax, would be several times the size of a small model's
    weights."""
    device = next(model.parameters()).device
    chunked = isinstance(model, TLMForCausalLM)
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        batch = blocks[i : i + batch_size].to(device)
        if not chunked:
            loss = model(batch, labels=batch, use_cache=False).loss
            n = batch.shape[0] * (batch.shape[1] - 1)
            total, count = total + float(loss) * n, count + n
            continue
        hidden = model.model(input_ids=batch, use_cache=False).last_hidden_state
        for b in range(batch.shape[0]):
            for s in range(0, batch.shape[1] - 1, _LOGIT_CHUNK):
                e = min(s + _LOGIT_CHUNK, batch.shape[1] - 1)
                logits = model.lm_head(hidden[b, s:e])  # (positions, V)
                total += float(F.cross_entropy(logits.float(), batch[b, s + 1 : e + 1], reduction="sum"))
                del logits
            count += batch.shape[1] - 1
    return math.exp(total / count)


_LOGIT_CHUNK = 128  # positions whose logits perplexity forms at a time (128 x 49,152 fp32 = 25 MB for SmolLM2)


def _strict_reload(config, state, opts):
    """The converted weights, reloaded strictly into a model built from the new config."""
    return materialize(config, state).to(dtype=getattr(torch, opts.dtype)).eval()


def _param_report(src, final, opts) -> dict:
    after = sum(p.numel() for p in final.parameters())
    if opts.mixer == "attention" and after != src.num_params:
        raise ConversionError(f"internal error: {after} parameters after conversion, {src.num_params} before")
    return {"params_before": src.num_params, "params_after": after,
            "params_added_by_mixer": after - src.num_params}


def _report_head(src, opts, widths, calib) -> dict:
    return {"source": str(src.path), "source_kind": src.kind, "family": src.family,
            "schedule": opts.schedule, "ratio": list(parse_ratio(opts.ratio)),
            "widths_before": list(src.tlm_config.intermediate_sizes), "widths_after": list(widths),
            "importance": opts.importance, "grow_init": opts.grow_init, "refit": opts.refit, "mixer": opts.mixer,
            "export": opts.export, "calibration_data": opts.calibration_data,
            "calibration_tokens": int(calib.numel()), "seq_len": opts.seq_len, "seed": opts.seed,
            "options": asdict(opts)}


def _write_output(model, out: Path, src, opts, report, timer) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        export_model(model, tmp, opts.export, src)
        from .report import write_markdown, write_plot

        write_plot(report, tmp / "widths.png")  # the plot does not show seconds: drawn first, so they count
        report["seconds"] = timer.snapshot()
        report["peak_rss_mb"] = peak_rss_mb()
        (tmp / "conversion_report.json").write_text(json.dumps(report, indent=2))
        write_markdown(report, tmp / "report.md")
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, out: Path) -> None:
    """Move a finished temporary output folder onto ``out`` (replacing it), with the usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp creates 0700
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


__all__ = ["ConvertOptions", "convert", "perplexity", "plan_widths", "PHASES"]

