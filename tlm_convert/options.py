"""What a conversion is asked to do, checked before anything heavy loads.

:class:`ConvertOptions`: the user's choices (tlm-convert's options). :class:`Method`: the method knobs, one typed
default each, set with ``--set name=value`` (:func:`method_from`; docs/knobs.md is generated from the fields by
tools/knob_table.py). :class:`Ratio`: ``--ratio`` parsed once. :func:`preflight`: the options, the input path and
OUTPUT. Standard library and YAML only, so ``tlm-convert --help`` and every refusal come without torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from tlm_io.errors import ConversionError
from tlm_io.locate import HUB_ID, locate, resolve_builtin
from tlm_io.outputs import check_output_given, check_output_path
from tlm_train.budget import DEFAULT_MAX_HOURS
from tlm_train.recipe_file import apply_overrides, build_spec

# the library's own lists, which import torch with their packages (tests/test_cli.py keeps these equal to them)
SCHEDULES = ("cosine", "linear", "sigmoid", "uniform", "three-group", "x-shape", "middle-heavy")  # tlm.SCHEDULES
MIXER_CHOICES = ("attention", "gated_attention", "hope_attention", "titans")  # tlm.MIXERS
EXPORT_FORMATS = ("tlm", "hf", "deci", "padded", "gguf")  # tlm_io.export.FORMATS

MEASURED = ("measured", "measured-taper")  # widths from the calibration's removal-cost profile (convert.measure_widths)
SCHEDULE_CHOICES = SCHEDULES + MEASURED
CONTINUOUS = ("cosine", "linear", "sigmoid")  # a start and an end multiplier summing to 2 (tlm.schedule)
GROUPED = ("x-shape", "middle-heavy")  # wide and narrow proportions
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
SELF = "self"  # the calibration source sampled from the input model itself (tlm_convert.samples)
DEFAULT_CALIBRATION = ("default", SELF)  # the bundled mix and the model's own samples, equal shares
SEED_LIMIT = 1 << 32  # --seed 0 .. 2**32 - 1 (as a recipe's seed: the heal trains with it)
HEAL_STEP = {"batch_size": 2, "grad_accum": 2}  # the heal's sequences a step (tlm_convert.heal.HEAL_RECIPE's train)

METRICS = ("activation", "obs", "wanda_sp", "wifv", "magnitude", "random", "fisher", "fisher_obs")  # importance.py
WHOLE_MODEL = frozenset({"fisher", "fisher_obs"})  # scored on the whole source model before the layer loop
GROW_INITS = ("noise", "zero", "split")  # surgery.resize_layer
REFIT_TARGETS = ("residual", "local")  # calibrate.convert_layers
TOKEN_WEIGHTINGS = ("none", "sink", "inv_norm")  # reconstruct.token_weights
FISHER_MASKS = ("token", "sequence")  # fisher.fisher_scores
FISHER_DTYPES = ("auto", "float32", "bfloat16", "float16")  # the Fisher pass's matmuls; auto: the model's dtype
SHRINK_METHODS = ("drop", "fold")  # a shrinking layer: keep its top-scored neurons, or merge all into clusters (fold.py)
FOLD_ITERS = 10  # the fold's k-means (Lloyd) iterations from the kept neurons: bounds the clustering's cost
DAMP = 1e-3  # the refit's and OBS's ridge, relative to the mean diagonal of the Gram matrix (compensate.py)
NOISE_SCALE = 1e-2  # noise growth's output columns, relative to the RMS of the layer's columns (surgery.py)

Importance = Literal[("auto",) + METRICS]
GrowInit = Literal[GROW_INITS]
RefitTarget = Literal[REFIT_TARGETS]
TokenWeighting = Literal[TOKEN_WEIGHTINGS]
FisherMask = Literal[FISHER_MASKS]
Shrink = Literal[SHRINK_METHODS]
FisherDtype = Literal[FISHER_DTYPES]


def knob(default, meaning: str, minimum: float | None = None, above: bool = False):
    """A :class:`Method` field: its one default, the line docs/knobs.md shows for it and, for a number, its range
    (at least ``minimum``, or above it)."""
    return field(default=default, metadata={"meaning": meaning, "minimum": minimum, "above": above})


@dataclass(frozen=True)
class Method:
    """The method knobs of a conversion: how it ranks, grows, refits and reaches its widths (``--set name=value``).
    Each default here is what every conversion does unless a knob is set; docs/knobs.md lists them."""

    importance: Importance = knob("auto", "how shrinking layers rank their neurons; auto: fisher, with --low-memory "
                                          "obs while its I x I matrices fit the budget, else activation")
    fisher_draws: int = knob(1, "targets the Fisher pass draws per calibration sequence (a backward each), scores "
                                "averaged", minimum=1)
    fisher_mask: FisherMask = knob("token", "the Fisher pass's mask: one per neuron and position (token) or per "
                                            "sequence")
    fisher_blocks: int = knob(0, "calibration blocks the Fisher pass uses, evenly spread; 0: every block", minimum=0)
    fisher_seq_len: int = knob(0, "the Fisher pass's sequence length (blocks cut into pieces); 0: the blocks'",
                               minimum=0)
    fisher_dtype: FisherDtype = knob("auto", "the Fisher pass's matmuls in this dtype (torch.autocast; bfloat16 about "
                                             "halves its CPU where the CPU has bf16 instructions); auto: the model's")
    grow_init: GrowInit = knob("noise", "new neurons of growing layers: small random output columns (noise), zero, "
                                        "or Net2Net copies of the top-ranked (split)")
    noise_scale: float = knob(NOISE_SCALE, "noise growth's output columns, relative to the RMS of the layer's columns",
                              minimum=0)
    refit: bool = knob(True, "least-squares refit of pruned layers' down projections")
    refit_target: RefitTarget = knob("residual", "what the refit restores: the source's residual stream (residual) "
                                                 "or the layer's own output (local)")
    damp: float = knob(DAMP, "ridge of the refit and of OBS, relative to the mean diagonal of the Gram matrix",
                       minimum=0, above=True)
    token_weighting: TokenWeighting = knob("none", "per-token weights of the refit: sink drops position 0, inv_norm "
                                                   "also weighs by 1/|z|^2")
    reconstruct_epochs: int = knob(0, "epochs of Adam on each pruned MLP towards the refit target after the refit",
                                   minimum=0)
    reconstruct_lr: float = knob(1e-4, "the learning rate of those epochs", minimum=0, above=True)
    multiple_of: int | None = knob(None, "round widths to this multiple; null: 256 for --export deci, else 16 when "
                                         "it divides the width, else 1", minimum=1)
    taper_stages: int = knob(1, "reach the widths in this many conversions, each healed --heal-tokens / K; 1: one "
                                "shot", minimum=1)
    shrink: Shrink = knob("drop", "shrinking layers keep their top-ranked neurons (drop) or merge all of them into "
                                  "clusters by k-means (fold)")
    fold_iters: int = knob(FOLD_ITERS, "the fold's k-means iterations from the neurons the drop keeps; 0: those stay "
                                       "as they are", minimum=0)

    def check(self) -> None:
        """ConversionError for the first knob of the wrong type, not among its choices, or out of its range."""
        errors: list[str] = []
        build_spec(Method, asdict(self), "", errors)
        if errors:
            raise ConversionError(f"--set {errors[0]}")
        for f in fields(self):
            value, low, above = getattr(self, f.name), f.metadata["minimum"], f.metadata["above"]
            if value is not None and low is not None and (value <= low if above else value < low):
                raise ConversionError(f"--set {f.name}={value}: must be {_range(f)}")


KNOBS = tuple(f.name for f in fields(Method))


def method_from(settings: Sequence[str] | Mapping[str, object] = (), base: Method | None = None) -> Method:
    """``base`` (default: :class:`Method`'s defaults) with every ``name=value`` of ``settings`` set (strings: the
    values read as YAML scalars, as ``tlm train --set`` reads them; or a mapping of names to values); ConversionError
    names an unknown knob (with the knobs), a bad value (with the allowed ones) or a wrong type."""
    data = asdict(base or Method())
    if isinstance(settings, Mapping):
        names, data = list(settings), {**data, **settings}
    else:
        names = [_knob_name(item) for item in settings]
        data = apply_overrides(data, settings)
    for name in names:
        if name not in KNOBS:
            option = f"--{name.replace('_', '-')}"
            hint = (f"not a method knob but an option: use {option}" if name in USER_OPTIONS else
                    f"unknown method knob; the knobs: {', '.join(KNOBS)} (docs/knobs.md)")
            raise ConversionError(f"--set {name}: {hint}")
    errors: list[str] = []
    method = build_spec(Method, data, "", errors)
    if errors:
        raise ConversionError(f"--set {errors[0]}")
    method.check()
    return method


def _knob_name(item: str) -> str:
    name, sep, _ = item.partition("=")
    if not sep or not name.strip():
        raise ConversionError(f"--set {item!r}: expected name=value, e.g. --set importance=obs")
    return name.strip()


def options_from(**fields) -> ConvertOptions:
    """ConvertOptions from option and knob names alike (a tlm compare file's ``convert:`` section), the knobs checked
    as ``--set`` checks them."""
    knobs = {name: fields.pop(name) for name in list(fields) if name in KNOBS}
    return ConvertOptions(**fields, method=method_from(knobs))


def method_settings(method: Method) -> list[str]:
    """The ``name=value`` of every knob ``method`` sets away from its default (what a command line would say)."""
    default = Method()
    return [f"{f.name}={_yaml_scalar(getattr(method, f.name))}" for f in fields(Method)
            if getattr(method, f.name) != getattr(default, f.name)]


def _range(f) -> str:
    """A number knob's range in words: "an integer >= 1", "a number > 0"."""
    kind = "an integer" if _kind(get_type_hints(Method)[f.name])[0].startswith("integer") else "a number"
    return f"{kind} {'>' if f.metadata['above'] else '>='} {f.metadata['minimum']:g}"


def _yaml_scalar(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Ratio:
    """``--ratio A/B``: the width multipliers of the first and last layers (three-group: front/middle/back; the
    grouped schedules: wide/narrow proportions), parsed once; ``str()`` gives the A/B text back."""

    values: tuple[float, ...]

    @classmethod
    def parse(cls, text) -> Ratio:
        if isinstance(text, Ratio):
            return text
        parts = text.split("/") if isinstance(text, str) else []
        try:
            values = tuple(float(p) for p in parts)
        except ValueError:
            values = ()
        if len(values) < 2 or not all(math.isfinite(v) for v in values):
            raise ConversionError(f"--ratio {text!r} is malformed; expected the form A/B with numbers A, B (e.g. "
                                  "1.5/0.5), or A/B/C for three-group (e.g. 1.5/1/0.5)")
        return cls(values)

    @property
    def first(self) -> float:
        return self.values[0]

    @property
    def last(self) -> float:
        return self.values[-1]

    def __str__(self) -> str:
        return "/".join(repr(v).removesuffix(".0") for v in self.values)

    def check(self, schedule: str) -> None:
        """ConversionError when ``schedule`` cannot take this ratio whatever the model (what depends on the widths,
        such as a width below 1, is checked when they are planned: tlm.schedule.taper_widths)."""
        n = 3 if schedule == "three-group" else 2
        if schedule == "uniform":
            return
        if len(self.values) != n:
            raise ConversionError(f"--ratio {self}: --schedule {schedule} takes {n} multipliers, "
                                  + ("A/B/C (e.g. 1.5/1/0.5)" if n == 3 else "A/B (e.g. 1.5/0.5)"))
        if min(self.values) <= 0:
            raise ConversionError(f"--ratio {self}: every multiplier must be > 0 (e.g. 1.5/0.5)")
        if schedule in CONTINUOUS + MEASURED and abs(sum(self.values) - 2) > 1e-9:
            raise ConversionError(f"--ratio {self}: the first and last multipliers must sum to 2 to keep the "
                                  "parameter budget (e.g. 1.5/0.5 or 1.4/0.6)")


@dataclass
class ConvertOptions:
    """What a user chooses for one conversion (tlm-convert's options), and the method knobs (``method``)."""

    schedule: str = "cosine"
    ratio: Ratio | str = Ratio((1.5, 0.5))  # a string is parsed once, here
    calibration_data: str | tuple[str, ...] | None = None  # one source or several (equal token shares); None:
    # DEFAULT_CALIBRATION, or the bundled sample alone with low_memory (no model in memory to sample from)
    calibration_tokens: int = 65536
    seq_len: int = 512
    mixer: str = "attention"
    export: str = "tlm"
    eval_data: str | tuple[str, ...] | None = None  # one set or several (tlm_io.text.eval_sources)
    eval_tokens: int = 16384
    eval_tasks: str | None = None  # zero-shot accuracy through lm-eval (tlm_convert.accuracy); "bundled": the suite
    heal_tokens: int = 0  # logit distillation from the source after conversion (tlm_convert.heal); 0: none
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    batch_size: int = 8
    low_memory: bool = False
    max_hours: float = DEFAULT_MAX_HOURS  # a long phase estimated longer is refused (tlm_train.budget); 0: no limit
    overwrite: bool = False
    trust_remote_code: bool = False  # run Python code shipped with the source's tokenizer (auto_map)
    method: Method = field(default_factory=Method)

    def __post_init__(self):
        self.ratio = Ratio.parse(self.ratio)

    def validate(self) -> None:
        """Every check that needs no model, one line for the first problem. ``importance`` auto is fisher in memory;
        with ``low_memory`` it is chosen once the MLP width is known (convert.resolve_importance)."""
        if not isinstance(self.method, Method):
            raise ConversionError(f"method: expected a Method, got {type(self.method).__name__}")
        self.method.check()
        if self.method.importance == "auto" and not self.low_memory:
            self.method = replace(self.method, importance="fisher")
        self.calibration_data = calibration_sources(self.calibration_data, self.low_memory)
        choices = {"schedule": (self.schedule, SCHEDULE_CHOICES), "mixer": (self.mixer, MIXER_CHOICES),
                   "export": (self.export, EXPORT_FORMATS), "dtype": (self.dtype, DTYPE_CHOICES)}
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ConversionError(f"--{name} {value!r}: expected one of {', '.join(allowed)}")
        self.ratio.check(self.schedule)
        for name in ("calibration_tokens", "seq_len", "eval_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ConversionError(f"--{name.replace('_', '-')} must be a positive integer")
        if not (isinstance(self.max_hours, (int, float)) and math.isfinite(self.max_hours) and self.max_hours >= 0):
            raise ConversionError(f"--max-hours {self.max_hours}: must be 0 (no limit) or a positive number of hours")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ConversionError(f"--seed {self.seed}: must be in 0..{SEED_LIMIT - 1} (the range of NumPy's and "
                                  "torch's seeds); pick a smaller seed")
        if self.calibration_tokens < self.seq_len:
            raise ConversionError(f"--calibration-tokens {self.calibration_tokens} is less than one block of "
                                  f"--seq-len {self.seq_len}; raise it or lower --seq-len")
        check_heal(self.heal_tokens, self.seq_len, self.low_memory)
        self._check_method()
        if self.low_memory:
            self._check_streamable()

    def _check_method(self) -> None:
        """The knobs against the options."""
        m = self.method
        if m.fisher_draws > 1 and m.importance not in WHOLE_MODEL and self.schedule not in MEASURED:
            raise ConversionError(f"--set fisher_draws={m.fisher_draws} needs the Fisher pass: importance fisher "
                                  "(the default) or fisher_obs, or --schedule measured / measured-taper")
        if self.export == "deci" and m.multiple_of is not None and m.multiple_of % 256:
            raise ConversionError(f"--export deci needs widths that are multiples of 256; --set multiple_of="
                                  f"{m.multiple_of} is not (drop it, or use --export tlm)")
        if m.taper_stages > 1:
            if self.schedule in MEASURED:
                raise ConversionError(f"--set taper_stages moves the --ratio multipliers from 1 in steps; --schedule "
                                      f"{self.schedule} measures its widths instead: use one stage, or a named "
                                      "schedule")
            need = m.taper_stages * tokens_per_step(self.seq_len)
            if self.heal_tokens < need:
                raise ConversionError(f"--set taper_stages={m.taper_stages} heals --heal-tokens / "
                                      f"{m.taper_stages} after every stage; pass --heal-tokens {need:,} or more (a "
                                      f"step of {tokens_per_step(self.seq_len):,} a stage)")

    def _check_streamable(self) -> None:
        """What ``low_memory``, which never holds the whole model, cannot do."""
        if self.schedule in MEASURED:
            raise ConversionError(f"--schedule {self.schedule} measures neurons with backward passes through the "
                                  "whole model; drop --low-memory, or use a named schedule such as cosine")
        if self.method.importance in WHOLE_MODEL:
            raise ConversionError(f"--set importance={self.method.importance} scores neurons with backward passes "
                                  "through the whole model; drop --low-memory, or use importance obs or activation")
        if self.eval_tasks is not None:
            raise ConversionError("--eval-tasks evaluates the whole model in memory; drop --low-memory, or run "
                                  "tlm eval OUTPUT --tasks ... afterwards")
        if self.export != "tlm":
            raise ConversionError(f"the low-memory policy writes --export tlm only (--export {self.export} needs the "
                                  "whole model in memory); drop --low-memory, or use --export tlm")
        if self.mixer == "titans":
            raise ConversionError("the titans mixer draws its new memory weights from the whole model's seeded "
                                  "init, which the low-memory policy never builds; drop --low-memory, or use another "
                                  "--mixer")
        if str(self.device) != "cpu":
            raise ConversionError(f"the low-memory policy runs on the CPU; drop --device {self.device} or "
                                  "--low-memory")

    def record(self) -> dict:
        """The options as the report keeps them: JSON values, the ratio as its A/B text, the knobs under method."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("ratio", "method")}
        out.update(ratio=str(self.ratio), method=asdict(self.method))
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


USER_OPTIONS = tuple(f.name for f in fields(ConvertOptions) if f.name != "method")


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


def tokens_per_step(seq_len: int) -> int:
    """Tokens a heal step trains on."""
    return HEAL_STEP["batch_size"] * HEAL_STEP["grad_accum"] * seq_len


def check_heal(tokens: int, seq_len: int, low_memory: bool) -> None:
    """ConversionError for a --heal-tokens value or combination that cannot train."""
    if tokens < 0:
        raise ConversionError(f"--heal-tokens {tokens}: must be 0 (no heal) or a positive number of tokens")
    if tokens == 0:
        return
    if low_memory:
        raise ConversionError("--heal-tokens trains the whole model in memory; drop --low-memory, or heal "
                              "afterwards with tlm train recipes/cpt/smollm2-135m-heal.yaml")
    if tokens < tokens_per_step(seq_len):
        raise ConversionError(f"--heal-tokens {tokens} is less than one training step ({tokens_per_step(seq_len)} "
                              f"tokens at --seq-len {seq_len}); raise it or use 0 for no heal")


def preflight(source: str, output: str, opts: ConvertOptions) -> str:
    """Every check before the model loads: the options (:meth:`ConvertOptions.validate`), OUTPUT (given, not the
    input nor inside or around it, writable) and a local input (it exists and is a checkpoint: tlm_io.locate; a hub
    id is fetched by the load). Returns the source with a built-in name resolved (tlm_io.locate.resolve_builtin)."""
    opts.validate()
    check_output_given(output)
    source = resolve_builtin(source)
    remote = HUB_ID.fullmatch(source) and ".." not in source and not Path(source).expanduser().exists()
    if opts.low_memory or not remote:
        locate(source, download=False)
    check_output_path(source, output, opts.overwrite)
    return source


def knob_table() -> str:
    """The Markdown table of :class:`Method`'s knobs: name, type, default, allowed values, meaning."""
    hints = get_type_hints(Method)
    rows = ["| knob | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for f in fields(Method):
        kind, allowed = _kind(hints[f.name])
        if f.metadata["minimum"] is not None:
            allowed = f"{'> ' if f.metadata['above'] else '>= '}{f.metadata['minimum']:g}"
        meaning = f.metadata["meaning"].replace("|", "\\|")
        rows.append(f"| `{f.name}` | {kind} | `{_yaml_scalar(f.default)}` | {allowed} | {meaning} |")
    return "\n".join(rows) + "\n"


def _kind(tp) -> tuple[str, str]:
    """(type in words, allowed values) of a knob's annotation."""
    args = [a for a in get_args(tp) if a is not type(None)]
    if get_origin(tp) is Literal:
        return "choice", ", ".join(f"`{a}`" for a in args)
    if args:  # Optional[int]
        return _kind(args[0])[0] + " or null", ""
    return {bool: ("true/false", "`true`, `false`"), int: ("integer", ""), float: ("number", "")}[tp]


__all__ = ["ConvertOptions", "Method", "Ratio", "KNOBS", "USER_OPTIONS", "method_from", "method_settings", "options_from",
           "knob_table", "preflight", "calibration_sources", "check_heal", "tokens_per_step", "SCHEDULES",
           "SCHEDULE_CHOICES", "MEASURED", "CONTINUOUS", "GROUPED", "MIXER_CHOICES", "EXPORT_FORMATS", "DTYPE_CHOICES",
           "SELF", "DEFAULT_CALIBRATION", "SEED_LIMIT", "HEAL_STEP", "METRICS", "WHOLE_MODEL", "GROW_INITS",
           "REFIT_TARGETS", "TOKEN_WEIGHTINGS", "FISHER_MASKS", "DAMP", "NOISE_SCALE"]
