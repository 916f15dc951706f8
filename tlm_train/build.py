"""What a run trains and how: the student and its tokenizer, the teacher, the trainable parameters, the precision,
the optimizer and its learning-rate schedule.

The student is built from the recipe (``model:`` from scratch, or ``init_from:`` any checkpoint tlm-convert reads)
or passed in memory by the caller (tlm_train.trainer.train's ``model``); :func:`prepare_student` makes it trainable
on the run's device and :func:`restore_student` gives it back as it came (flags only: the weights stay trained).
"""

from __future__ import annotations

import math
from fnmatch import fnmatchcase
from pathlib import Path

import torch

from tlm import TLMConfig, TLMForCausalLM
from tlm_io.errors import ConversionError, RecipeError, TrainError
from tlm_io.load import check_vocab, load_model, load_tokenizer
from tlm_io.sizes import check_model_size

from .prepare import recipe_tokenizer
from .recipe import DistillSpec, Recipe, TrainSpec


def build_model_and_tokenizer(recipe: Recipe):
    """(TLMForCausalLM, tokenizer): from scratch (``model``) or from ``init_from`` (any supported checkpoint)."""
    if recipe.model is not None:
        tokenizer = load_tokenizer(recipe.tokenizer, recipe.trust_remote_code)
        kwargs = dict(recipe.model.config)
        kwargs.setdefault("vocab_size", len(tokenizer))
        if kwargs["vocab_size"] < len(tokenizer):
            raise RecipeError(f"model.config.vocab_size {kwargs['vocab_size']} is below the tokenizer's "
                              f"{len(tokenizer)} tokens; raise it or leave it out")
        if tokenizer.eos_token_id is not None:
            kwargs.setdefault("eos_token_id", tokenizer.eos_token_id)
        try:
            check_model_size(kwargs, "recipe", prefix="model.config.")  # before a module is built
        except ConversionError as err:
            raise RecipeError(str(err)) from None
        try:
            config = TLMConfig(schedule=recipe.model.schedule, taper_ratio=recipe.model.ratio,
                               multiple_of=recipe.model.multiple_of, **kwargs)
        except (TypeError, ValueError) as err:
            raise RecipeError(f"model.config: {err}") from None
        torch.manual_seed(recipe.seed)
        return TLMForCausalLM(config), tokenizer
    return load_pretrained(recipe.init_from, recipe.tokenizer, trust_remote_code=recipe.trust_remote_code)


def load_pretrained(path: str, tokenizer_name: str | None = None, with_tokenizer: bool = True,
                    trust_remote_code: bool = False):
    """A TLMForCausalLM from any checkpoint tlm-convert reads (TLM, transformers folder, GGUF), and its tokenizer
    (``tokenizer_name`` when given, else the checkpoint's; None when ``with_tokenizer`` is false). The tokenizer
    runs the folder's own code only with ``trust_remote_code``."""
    try:
        model, _, src = load_model(path, with_tokenizer=False, trust_remote_code=trust_remote_code)
    except ConversionError as err:
        raise TrainError(str(err)) from None
    if not with_tokenizer:
        return model, None
    if tokenizer_name is not None:
        tokenizer = load_tokenizer(tokenizer_name, trust_remote_code)
        try:
            check_vocab(tokenizer, model.config.vocab_size, tokenizer_name, f"'{path}'")
        except ConversionError as err:
            raise TrainError(str(err).replace("use the model's own tokenizer", "set tokenizer: to the model's own "
                                              "tokenizer (or leave it out)")) from None
        return model, tokenizer
    if src.tokenizer_kwargs() is None:
        raise TrainError(f"'{path}' has no tokenizer files; set tokenizer: (a tokenizer folder, or 'byte')")
    return model, load_tokenizer(src)


def student_and_tokenizer(recipe: Recipe, model=None, tokenizer=None):
    """(student, tokenizer) of a run: the recipe's (:func:`build_model_and_tokenizer`), or ``model`` passed in
    memory with ``tokenizer`` (else the recipe's: ``tokenizer:``, or init_from's tokenizer files; the module carries
    none)."""
    if model is None:
        if tokenizer is not None:
            raise TypeError("train(): tokenizer= goes with model= (a recipe's model brings its own tokenizer)")
        return build_model_and_tokenizer(recipe)
    if not isinstance(model, TLMForCausalLM):
        raise TypeError(f"train(): model must be a TLMForCausalLM, got {type(model).__name__} (pass resume= and "
                        "progress= by keyword)")
    return model, recipe_tokenizer(recipe) if tokenizer is None else tokenizer


def prepare_student(model, spec: TrainSpec, device: torch.device) -> dict:
    """Make ``model`` trainable on ``device`` (gradient checkpointing, each decoder layer compiled with
    ``train.compile``, no KV cache, training mode, the trainable parameters of ``train.trainable``); returns what :func:`restore_student` needs to give it back as it came."""
    came = {"use_cache": model.config.use_cache, "requires_grad": [p.requires_grad for p in model.parameters()],
            "checkpointing": spec.gradient_checkpointing, "compiled": spec.compile}
    model.to(device)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if spec.compile:
        compile_layers(model)
    model.config.use_cache = False
    model.train()
    if spec.trainable is not None:
        select_trainable(model, spec.trainable)
    return came


def restore_student(model, came: dict) -> None:
    """``model`` (trained) in eval mode with the flags :func:`prepare_student` changed set back: KV cache,
    gradient checkpointing, compiled layers, each parameter's requires_grad. It stays on the run's device."""
    if came["checkpointing"]:
        model.gradient_checkpointing_disable()
    if came["compiled"]:
        uncompile_layers(model)
    model.config.use_cache = came["use_cache"]
    for p, flag in zip(model.parameters(), came["requires_grad"]):
        p.requires_grad_(flag)
    model.eval()


def compile_layers(model, backend: str = "inductor") -> None:
    """torch.compile each decoder layer of ``model`` (a TLMForCausalLM) in place (``train.compile``): layers of one
    shape share one compilation, so compiling costs about one layer's time, not the whole model's (whose graph grows
    with its depth); a tapered model's second width recompiles once with the widths as dynamic sizes, which every
    other width reuses. The loss, the embedding and the head stay eager; state_dict keys are unchanged."""
    config = torch._dynamo.config
    # a weight's size may become dynamic (dynamo treats parameters' and modules' shapes as static by default: one
    # compilation per width)
    config.force_parameter_static_shapes = config.force_nn_module_property_static_shapes = False
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    # a layer's guards may still tell layers apart (their mixer, their window): one entry each at most
    setattr(config, limit, max(getattr(config, limit), 2 * len(model.model.layers)))
    for layer in model.model.layers:
        layer.compile(backend=backend)


def uncompile_layers(model) -> None:
    """Undo :func:`compile_layers`: every decoder layer runs eagerly again (evaluations at other shapes compile
    nothing)."""
    for layer in model.model.layers:
        layer._compiled_call_impl = None  # what nn.Module.compile sets


def select_trainable(model, patterns: list[str]) -> int:
    """Freeze every parameter whose name matches none of ``patterns`` (fnmatch, e.g. ``*.mlp.*``); returns the
    number of trainable parameters. RecipeError when no parameter matches."""
    count = 0
    for name, p in model.named_parameters():
        p.requires_grad_(any(fnmatchcase(name, pat) for pat in patterns))
        count += p.numel() if p.requires_grad else 0
    if count == 0:
        raise RecipeError(f"train.trainable {patterns}: no parameter name matches (names look like "
                          f"{next(iter(dict(model.named_parameters())))!r})")
    return count


def check_teacher(teacher, config, spec: DistillSpec) -> None:
    """TrainError when ``teacher`` cannot teach a student of ``config`` under ``spec`` (vocabulary; depth and width
    for hidden_weight; teacher_topk within the vocabulary)."""
    if teacher.config.vocab_size != config.vocab_size:
        raise TrainError(f"distill.teacher has {teacher.config.vocab_size} vocabulary entries, the student "
                         f"{config.vocab_size}; distillation needs the same tokenizer")
    shape = lambda c: (c.num_hidden_layers, c.hidden_size)  # noqa: E731
    if spec.hidden_weight > 0 and shape(teacher.config) != shape(config):
        raise TrainError(f"distill.hidden_weight needs a teacher of the student's depth and width: "
                         f"{shape(teacher.config)} layers x hidden against {shape(config)}; "
                         "set distill.hidden_weight: 0")
    if spec.teacher_topk > config.vocab_size:
        raise TrainError(f"distill.teacher_topk {spec.teacher_topk} is more than the vocabulary "
                         f"({config.vocab_size}); lower it")


def bf16_is_fast(device: str | torch.device) -> bool:
    """Whether bf16 autocast speeds up training on ``device``: a CUDA device with bf16, or a CPU with bf16 matrix
    instructions (AVX512-BF16 or AMX in /proc/cpuinfo; False where that cannot be read). Elsewhere bf16 products
    are emulated and slower than fp32."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if dev.type != "cpu":
        return False
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def lr_factor(step: int, recipe: Recipe) -> float:
    """Multiplier of optim.lr at the run's ``step`` (0-based): the schedule's factor at step ``step_offset + step``
    of its ``schedule_steps`` (default: step_offset + max_steps), times the re-warm ramp over the first
    ``rewarm_steps``."""
    o = recipe.optim
    total = o.schedule_steps or o.step_offset + recipe.train.max_steps
    factor = schedule_factor(o.step_offset + step, total, o)
    return factor * (step + 1) / o.rewarm_steps if step < o.rewarm_steps else factor


def schedule_factor(step: int, total: int, o) -> float:
    """Multiplier of ``o.lr`` (an OptimSpec) at ``step`` of a schedule of ``total`` steps: linear warmup to 1, then
    decay to min_lr / lr at ``total`` (cosine, linear), 1 (constant), or 1 until :func:`wsd_decay_start` and a
    cosine-shaped decay from there (wsd)."""
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    floor = o.min_lr / o.lr if o.lr > 0 else 0.0
    if o.decay == "constant":
        return 1.0
    start = wsd_decay_start(total, o) if o.decay == "wsd" else o.warmup_steps
    if step < start:
        return 1.0
    t = min(1.0, (step - start) / max(1, total - start))
    shape = 0.5 * (1 + math.cos(math.pi * t)) if o.decay in ("cosine", "wsd") else 1 - t
    return floor + (1 - floor) * shape


def wsd_decay_start(total: int, o) -> int:
    """The first step of a wsd schedule's decay: ``total`` less ``decay_fraction`` of it (rounded half up), never
    inside the warmup."""
    return max(o.warmup_steps, total - math.floor(o.decay_fraction * total + 0.5))


def param_groups(model, weight_decay: float) -> list[dict]:
    """AdamW's groups: weight decay on the trainable matrices, none on vectors (norms, biases)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def grown_neurons(model, widths: list[int]) -> list[tuple[torch.nn.Parameter, int, int]]:
    """(parameter, dim, first index) of every slice holding the MLP neurons past ``widths[l]`` in layer l (growth
    appends them): gate/up rows and biases (dim 0), down_proj columns (dim 1); trainable parameters only."""
    slices = []
    for layer, width in zip(model.model.layers, widths):
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(layer.mlp, name, None)
            if linear is None:
                continue
            dim = 1 if name == "down_proj" else 0
            for p in (linear.weight, None if dim else linear.bias):
                if p is not None and p.requires_grad and p.shape[dim] > width:
                    slices.append((p, dim, width))
    return slices


def scale_updates(optimizer, slices: list[tuple[torch.nn.Parameter, int, int]], scale: float) -> None:
    """Multiply each optimizer step's change of the ``slices`` (:func:`grown_neurons`) by ``scale``. AdamW's step
    (weight decay included) is linear in its learning rate, so this is exactly a learning rate of scale x lr for
    those entries, with the same moments."""
    before: list[torch.Tensor] = []

    def views():
        return [p.detach().narrow(dim, start, p.shape[dim] - start) for p, dim, start in slices]

    def save(opt, args, kwargs):
        before[:] = [v.clone() for v in views()]

    def scale_change(opt, args, kwargs):
        for view, old in zip(views(), before):
            view.sub_(old).mul_(scale).add_(old)  # old + scale * (new - old)
        before.clear()

    optimizer.register_step_pre_hook(save)
    optimizer.register_step_post_hook(scale_change)


def weight_rms(model) -> float:
    """The RMS of every entry of ``model``'s trainable matrices (dim >= 2) together: the scale of its weights, which
    ``optim.lr_relative`` multiplies the rate by."""
    total, count = 0.0, 0
    for p in model.parameters():
        if p.requires_grad and p.dim() >= 2:
            total += torch.linalg.vector_norm(p.detach(), dtype=torch.float32).item() ** 2
            count += p.numel()
    if not count:
        raise RecipeError("optim.lr_relative: the model has no trainable matrix to take its weight scale from; "
                          "use an absolute lr")
    return math.sqrt(total / count)


def peak_lr(model, o) -> float:
    """The schedule's peak rate for ``model`` under the OptimSpec ``o``: o.lr, times :func:`weight_rms` with
    o.lr_relative."""
    return o.lr * (weight_rms(model) if o.lr_relative else 1.0)


def make_optimizer(model, recipe: Recipe, device: torch.device):
    """(AdamW over ``model``'s trainable parameters at :func:`peak_lr`, its LambdaLR schedule of :func:`lr_factor`)."""
    o = recipe.optim
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=peak_lr(model, o), betas=tuple(o.betas),
                                  eps=o.eps, **fused)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, recipe))
    return optimizer, scheduler


__all__ = ["build_model_and_tokenizer", "load_pretrained", "student_and_tokenizer", "prepare_student",
           "restore_student", "select_trainable", "check_teacher", "bf16_is_fast", "lr_factor", "schedule_factor",
           "wsd_decay_start", "param_groups", "weight_rms", "peak_lr", "make_optimizer", "grown_neurons", "scale_updates",
           "compile_layers", "uncompile_layers"]
