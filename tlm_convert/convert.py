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
from dataclasses import replace
from pathlib import Path

import torch

from tlm import measured_widths, taper_widths
from tlm_io.checkpoint import load_source
from tlm_io.errors import ConversionError
from tlm_io.export import export_model
from tlm_io.load import check_positions, check_token_ids, load_model, load_tokenizer, materialize
from tlm_io.outputs import check_free_space, human_bytes, output_bytes, output_run, save_errors, staged, temp_prefix
from tlm_io.perplexity import perplexity
from tlm_io.sizes import available_memory
from tlm_io.text import text_prefix
from tlm_train.budget import Limits

from .accuracy import TaskAccuracy
from .calibrate import (IN_MEMORY, LOW_MEMORY, LayerSettings, ModelLayers, calibration_needed, convert_layers,
                        score_whole_model)
from .evalsets import eval_set_blocks, perplexity_entries
from .fisher import fisher_scores, top_share_profile
from .heal import heal
from .options import MEASURED, SELF, WHOLE_MODEL, ConvertOptions, Ratio, preflight, tokens_per_step
from .report import write_markdown, write_plot
from .samples import calibration_blocks, samples_text
from .stream import StreamedLayers, open_stream
from .upcycle import SCORED_MIXERS, carry_scores, upcycle, upcycled_config

PHASES = ("load", "sample", "calibrate", "rank", "resize", "save", "eval")
SAMPLES_FILE = "calibration_samples.txt"  # in OUTPUT: the text ``self`` sampled (what the conversion saw)


def layer_settings(opts: ConvertOptions) -> LayerSettings:
    """What the layer loop (calibrate.convert_layers) takes from the options."""
    return LayerSettings(method=opts.method, batch_size=opts.batch_size, seed=opts.seed,
                         scores_needed=opts.mixer in SCORED_MIXERS)


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
    source = preflight(source, output, opts)  # the options, the input and OUTPUT, before anything loads
    out = Path(output)
    with output_run(out):
        limits = Limits(opts.max_hours or None, on_note)
        if opts.method.taper_stages > 1:
            return convert_in_stages(source, out, opts, on_phase, on_layer, limits)
        return _convert(source, out, opts, on_phase, on_layer, limits)


def stage_ratio(ratio: Ratio, k: int, stages: int) -> Ratio:
    """Stage k of ``stages``'s ratio: every multiplier of ``ratio`` moved from 1 by k / stages of the way (stage
    ``stages``: ``ratio`` itself), at full precision (1.5/0.5 in 3 stages: 1.1666666666666667/0.8333333333333334)."""
    if k == stages:
        return ratio
    return Ratio(tuple(1 + (m - 1) * k / stages for m in ratio.values))


def convert_in_stages(source: str, out: Path, opts: ConvertOptions, on_phase, on_layer, limits: Limits) -> dict:
    """``--set taper_stages=K``: the widths reached in K conversions at the ratios :func:`stage_ratio` gives, each
    calibrated and ranked on the current model (the source, then the previous stage's healed TLM, which converts as
    any TLM does: around its mean width) and healed ``heal_tokens / K`` tokens by distillation from the *source*.
    The last stage converts at ``opts.ratio`` itself, so its widths and parameter count are the one-shot
    conversion's. ``self`` samples are drawn once, from the source, and every stage calibrates and heals on them.
    The stages before the last are written into a temporary folder beside OUTPUT (removed at the end); the report
    is the last stage's, evaluated against the source, with ``taper_stages`` listing every stage."""
    stages_n = opts.method.taper_stages
    per_stage = math.ceil(opts.heal_tokens / stages_n / tokens_per_step(opts.seq_len))
    work = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))  # cleaned by a later run if killed
    stages, current, sources, first = [], source, tuple(opts.calibration_data), {}
    try:
        for k in range(1, stages_n + 1):
            last = k == stages_n
            stage_opts = replace(opts, ratio=stage_ratio(opts.ratio, k, stages_n),
                                 method=replace(opts.method, taper_stages=1),
                                 heal_tokens=per_stage * tokens_per_step(opts.seq_len), calibration_data=sources)
            if not last:  # an intermediate TLM: reloaded exactly by the next stage, not evaluated
                stage_opts = replace(stage_opts, export="tlm", dtype="float32", eval_data=None, eval_tasks=None,
                                     overwrite=True)
            stage = {"stage": k, "ratio": str(stage_opts.ratio), "heal_tokens": stage_opts.heal_tokens}
            if last:  # OUTPUT: the report names the source and the options given, and lists every stage
                origin = {**first, "calibration_data": list(opts.calibration_data), "options": opts.record(),
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
        settings = layer_settings(opts)
        shrinking = sum(w < s for w, s in zip(widths, src.tlm_config.intermediate_sizes))
        epochs = opts.method.reconstruct_epochs
        if epochs and shrinking:
            settings.reconstruct_budget = limits.budget("layer reconstruction", epochs * shrinking, "epochs",
                                                        "lower --set reconstruct_epochs")
        evalb = eval_set_blocks(tokenizer, opts.eval_data, opts.seq_len, opts.eval_tokens)  # None without sets
        vocab = src.tlm_config.vocab_size
        for name, blocks in (evalb or {}).items():
            check_token_ids(blocks, vocab, f"evaluation data {name!r} (tokenized)")
        tasks = TaskAccuracy(opts.eval_tasks, tokenizer, opts.batch_size, timer, opts.low_memory)  # checked now
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
    report = report_head(src, opts, widths, calib) | tasks.entries()
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
    tasks.score("source", None if teacher else model, lambda: _load_reference(teacher, opts))
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
    tasks.score("converted", final)

    def write_model(tmp: Path) -> None:
        nonlocal final
        if samples is not None:  # what the conversion calibrated on, kept beside the model
            (tmp / SAMPLES_FILE).write_text(samples_text(tokenizer, samples), encoding="utf-8")
            report["calibration_samples"] = {"file": SAMPLES_FILE, "blocks": len(samples)}
        if opts.heal_tokens:  # distilled from the source inside tmp (a failed heal leaves OUTPUT as it was)
            final = heal(final, teacher or source, src, tmp, opts, evalb, report, timer,
                         samples=None if samples is None else tmp / SAMPLES_FILE, limits=limits, tokenizer=tokenizer)
            tasks.score("healed", final)
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
    """Check importance obs against the memory policy for MLPs of ``width`` neurons; with importance auto (left
    so by ``low_memory``), choose obs when its matrices fit the budget, else activation. Returns notes for the
    report."""
    policy = LOW_MEMORY if opts.low_memory else IN_MEMORY
    if opts.method.importance == "auto":
        chosen = "obs" if policy.obs_fits(width) else "activation"
        opts.method = replace(opts.method, importance=chosen)
        if chosen == "activation":
            return [f"importance: activation (obs needs {policy.obs_bytes(width) / 2**30:.1f} GiB for its I x I "
                    f"matrices, above the {policy.name.replace('_', '-')} budget)"]
    if opts.method.importance == "obs":
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
    streams = 2 if opts.method.refit_target == "residual" else 1
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
        return taper_widths(len(config.intermediate_sizes), base, schedule, opts.ratio.values, multiple_of=q)
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
    return base, opts.method.multiple_of or (256 if opts.export == "deci" else 16 if base % 16 == 0 else 1)


def measure_widths(model, calib: torch.Tensor, config, opts: ConvertOptions, settings: LayerSettings,
                   progress: bool = False) -> dict:
    """``--schedule measured`` / ``measured-taper``: the Fisher pre-pass (tlm_convert.fisher) over the calibration
    blocks scores every MLP neuron of the source by what removing it costs the model's output; each layer's count of
    neurons among the model's top half is its removal-cost profile, and the widths follow it at the source's
    parameter count (tlm.schedule.measured_widths), between the ratio's two multipliers of D (1.5/0.5: 0.5 D to
    1.5 D), non-increasing with depth for measured-taper. The scores are kept for importance fisher."""
    m = settings.method
    scores = fisher_scores(model, calib, seed=opts.seed, batch_size=opts.batch_size, progress=progress,
                           max_blocks=m.fisher_blocks, seq_len=m.fisher_seq_len, draws=m.fisher_draws,
                           mask=m.fisher_mask, dtype=settings.fisher_torch_dtype())
    if m.importance in WHOLE_MODEL:
        settings.model_scores = scores  # the same pass score_whole_model would run
    profile = top_share_profile(scores)
    base, q = _base_and_multiple(config, opts)
    ratio = opts.ratio.values  # two multipliers (ConvertOptions.validate): the bounds of every width
    try:
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
            "schedule": opts.schedule, "ratio": list(opts.ratio.values),
            "widths_before": list(src.tlm_config.intermediate_sizes), "widths_after": list(widths),
            "importance": opts.method.importance, "grow_init": opts.method.grow_init, "refit": opts.method.refit,
            "mixer": opts.mixer,
            "export": opts.export, "calibration_data": list(opts.calibration_data),
            "calibration_tokens": 0 if calib is None else int(calib.numel()), "seq_len": opts.seq_len,
            "seed": opts.seed,
            "options": opts.record()}


def _write_output(out: Path, report: dict, timer, write_model) -> None:
    """``write_model(tmp)`` into a temporary folder next to ``out``, then the report files, then :func:`publish`;
    on any failure the temporary folder is removed and ``out`` is left as it was."""
    with staged(out, "tlm-convert") as tmp:
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


__all__ = ["convert", "layer_settings", "plan_widths", "measure_widths", "resolve_importance", "report_head",
           "check_calibration_memory", "stage_ratio", "PhaseTimer", "PHASES", "SAMPLES_FILE"]

