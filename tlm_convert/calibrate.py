"""The conversion's layer loop: sequential, layer-by-layer calibration and resizing of a TLM.

The calibration tokens flow through the model one layer at a time, and every layer is converted before the
next one sees its input ("sequential" calibration, as SparseGPT processes layers): layer l's statistics are
taken on the output of the already-converted layers 0..l-1, so each refit absorbs the error upstream of it.

Every conversion runs :func:`convert_layers`. What differs between "the whole model in memory" and "one layer at a
time from disk" is where the layers come from and where they go (a :class:`Layers`: the model's own layers,
converted in place, or a checkpoint streamed layer by layer into shards, tlm_convert.stream) and a
:class:`MemoryPolicy` (which temporaries may be formed whole) -- not the algorithm.

Per layer l, after z = mix(h) for every batch:

* a growing layer (``noise`` / ``zero`` growth, whose plan needs no statistics) is resized first and run once,
  its activation hook recording the source neurons' statistics (the importance profile);
* a shrinking layer runs its MLP only up to the down projection (the hook sums the activations' statistics, their
  Gram matrix AᵀA and, for the residual target, AᵀY, and stops the forward), keeps its top-scored neurons (or
  those OBS keeps), refits the down projection by least squares from G_KK, and runs the resized MLP again. Where
  the activations take less memory than AᵀA (:meth:`MemoryPolicy.keeps`), it keeps them instead: the refit's
  system from the kept neurons' activations alone, and the output z + D′ a_K from them (no second MLP pass);
* with ``shrink="fold"`` a shrinking layer merges all its neurons into clusters instead (tlm_convert.fold), and
  refits the folded MLP's down projection on the folded neurons' own activations (a pass of the folded MLP);
* a layer that keeps its width (or grows by ``split``, which copies the top-scored neurons) runs its MLP with
  the hook, then is resized and run again.

Two knobs change the refit (tlm_convert.reconstruct): per-token weights (``token_weighting``) and epochs of Adam on
each pruned MLP after it (``reconstruct_epochs``).

The cost is one forward pass over the calibration tokens, the refit's products, the resized MLPs of the summing
shrinking (and split) layers once more, and with ``refit_target="residual"`` the source model's layers from the second
shrinking layer on (at the first, the source stream is the converted one). Resident beyond the weights: the carried
hidden states (one stream, two with the residual target) and the per-layer statistics, or the activations where
they are the smaller.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from tlm_io.errors import ConversionError

from .compensate import obs_prune, refit_down_proj, refit_kept
from .fisher import fisher_scores
from .fold import fold_merge
from .importance import OBS_METRICS, WHOLE_MODEL, StopForward, activation_stats, add_gram, neuron_scores, sensitivity
from .options import Method
from .reconstruct import reconstruct_mlp, token_weights
from .surgery import LayerPlan, plan_from_scores, resize_layer

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class MemoryPolicy:
    """Which temporaries the layer loop may form whole. The arithmetic is the same under every policy up to the
    order of fp32 summation, and exactly the same while a layer fits the limits.

    keep_activations_bytes: a shrinking layer keeps its pass's activations (N × I fp32) up to this size; else it
        sums AᵀA and runs the resized MLP again. None: whichever takes less memory (activations smaller than the
        I × I fp64 Gram matrix: few tokens, a wide MLP).
    block_bytes: the largest temporary of the Gram matrix's updates and of the refit's right-hand side (row blocks),
        and of the refit's solve: a K × K system larger than this is factored in its own storage. None: no limit.
    obs_budget_bytes: ``importance="obs"`` holds about five dense I × I fp64 matrices per layer (the Gram matrix,
        its damped inverse and its temporaries, the removal vectors); refused above this. None: no limit.
    """

    name: str
    keep_activations_bytes: int | None = None
    block_bytes: int | None = None
    obs_budget_bytes: int | None = None

    def keeps(self, tokens: int, width: int) -> bool:
        limit = 8 * width * width - 1 if self.keep_activations_bytes is None else self.keep_activations_bytes
        return 4 * tokens * width <= limit

    def solve_in_place(self, kept: int) -> bool:
        """Whether the refit factors its (kept x kept) fp64 system in place (compensate.refit_kept)."""
        return self.block_bytes is not None and 8 * kept * kept > self.block_bytes

    def rows(self, bytes_per_row: int) -> int | None:
        """Rows per block of a product whose rows take ``bytes_per_row``; None: one block."""
        return None if self.block_bytes is None else max(1, self.block_bytes // max(1, bytes_per_row))

    @staticmethod
    def obs_bytes(width: int) -> int:
        return 5 * 8 * width * width

    def obs_fits(self, width: int) -> bool:
        return self.obs_budget_bytes is None or self.obs_bytes(width) <= self.obs_budget_bytes

    def check_obs(self, width: int) -> None:
        """ConversionError when OBS's I × I matrices for an MLP of ``width`` neurons exceed the budget."""
        need = self.obs_bytes(width)
        if not self.obs_fits(width):
            raise ConversionError(f"--set importance=obs needs about {need / 2**30:.1f} GiB for its {width} x "
                                  f"{width} matrices, above the {self.name.replace('_', '-')} budget of "
                                  f"{self.obs_budget_bytes / 2**30:.1f} GiB; use --set importance=activation, or drop "
                                  "--low-memory")


IN_MEMORY = MemoryPolicy("in_memory")
LOW_MEMORY = MemoryPolicy("low_memory", block_bytes=64 << 20, obs_budget_bytes=2 << 30)


class Layers(Protocol):
    """Where the loop's layers come from and where they go."""

    def embedded(self) -> None:
        """The calibration tokens are embedded (a streamed source lets go of the embeddings)."""

    def layer(self, i: int):
        """Decoder layer i with its source weights, resident, fp32."""

    def done(self, i: int, layer, plan: LayerPlan, score: torch.Tensor) -> None:
        """Layer i converted (its MLP resized in place); the loop no longer uses it."""


class ModelLayers:
    """The in-memory source and sink: the model's own layers, converted in place."""

    def __init__(self, model):
        self.layers = model.model.layers

    def embedded(self) -> None:
        pass

    def layer(self, i: int):
        return self.layers[i]

    def done(self, i, layer, plan, score) -> None:
        pass


@dataclass
class LayerSettings:
    """What the layer loop :func:`convert_layers` takes: the method knobs (``method``, its ``importance`` a metric,
    not auto: convert.resolve_importance), the run's batch size and seed, and what the conversion fills in.

    ``method.refit_target``: "local" fits each pruned MLP to its own full-width output on the converted stream;
    "residual" fits it to the MLP output that restores the residual stream the *source* layers would produce,
    h_src(l+1) − z_conv(l), so every pruned layer also cancels the error accumulated upstream. The source stream
    starts from the converted one at the first shrinking layer (the layers before it only grow, which changes
    their output by the growth noise alone) and costs one more forward pass through the shrinking layers; it
    does not apply to sandwich-norm (Gemma 3) blocks.
    """

    method: Method
    batch_size: int
    seed: int
    scores_needed: bool = True  # the caller uses the neuron scores even where nothing is resized (hope_attention)
    model_scores: list[torch.Tensor] | None = None  # per layer, a WHOLE_MODEL metric's scores (score_whole_model)
    reconstruct_budget: object | None = None  # a tlm_train.budget.Budget over every reconstruction epoch, or None

    def fisher_torch_dtype(self) -> torch.dtype | None:
        """The Fisher pre-pass's matmul dtype (fisher_scores' ``dtype``; None: the model's own)."""
        dtype = self.method.fisher_dtype
        return None if dtype == "auto" else getattr(torch, dtype)


def score_whole_model(model, blocks: torch.Tensor, settings: LayerSettings, widths: list[int],
                      progress: bool = False) -> None:
    """Fill ``settings.model_scores`` when the importance metric scores neurons on the whole source ``model`` (a
    TLMForCausalLM in memory) before the layer loop resizes it to ``widths``; a no-op for the per-layer metrics.
    Only the layers from :func:`first_ranked_layer` on are scored."""
    m = settings.method
    if m.importance in WHOLE_MODEL and settings.model_scores is None:  # None: not measured already
        first = first_ranked_layer(model.config.intermediate_sizes, widths, settings)
        settings.model_scores = fisher_scores(model, blocks, seed=settings.seed, batch_size=settings.batch_size,
                                              progress=progress, max_blocks=m.fisher_blocks,
                                              seq_len=m.fisher_seq_len, first_layer=first,
                                              draws=m.fisher_draws, mask=m.fisher_mask,
                                              dtype=settings.fisher_torch_dtype())


def first_ranked_layer(source_widths: list[int], widths: list[int], settings: LayerSettings) -> int:
    """The first layer whose neuron scores the conversion uses: the layers before it only grow, keep every neuron
    and are not ranked, unless growth copies the top-ranked ones (``split``) or the caller uses every layer's scores
    (``scores_needed``: a scored mixer)."""
    if settings.method.grow_init == "split" or settings.scores_needed:
        return 0
    return next((i for i, (w, s) in enumerate(zip(widths, source_widths)) if w <= s), len(widths))


@dataclass
class CalibrationResult:
    plans: list[LayerPlan]
    scores: list[torch.Tensor | None]  # per layer, source neurons (None: not calibrated)
    tokens: int
    hidden: list[torch.Tensor]  # the converted model's last-layer output per batch (before the final norm)

    def importance_profile(self) -> list[float | None] | None:
        """The mean neuron score per layer (None when no calibration ran; an entry None: a layer not ranked)."""
        return None if self.tokens == 0 else [None if s is None else float(s.mean()) for s in self.scores]


def calibration_needed(source_widths: list[int], widths: list[int], settings: LayerSettings) -> bool:
    """Whether the layer loop runs calibration tokens: some layer is resized, or the caller needs neuron scores.
    Otherwise the conversion is an exact import and every layer passes through unchanged."""
    return settings.scores_needed or list(widths) != list(source_widths)


@torch.no_grad()
def convert_layers(base, layers: Layers, blocks: torch.Tensor | None, widths: list[int], settings: LayerSettings,
                   policy: MemoryPolicy = IN_MEMORY, progress=None, timer=None) -> CalibrationResult:
    """The layer loop every conversion runs: ``base`` (a TLMModel whose embeddings, rotary tables and masks are
    usable; its layers are not touched) embeds the calibration blocks (n, S); then per layer i, ``layers.layer(i)``
    is calibrated, planned, refitted and resized to ``widths[i]``, handed to ``layers.done`` and its output carried
    on. When :func:`calibration_needed` says no, no token runs (``blocks`` may be None): every layer is handed on
    unchanged, with no scores. For a model in memory: ``convert_layers(model.model, ModelLayers(model), ...)``
    converts ``model`` in place.

    ``progress(done, total)`` is called with 0 before the first layer and after each; ``timer(phase)`` is a context manager that accounts
    seconds to "calibrate" (forward passes with hooks, the refit's Gram matrices), "rank" (scores, plan, the refit's
    solve) and "resize" (new weights and the MLP passes that use them)."""
    timer = timer or _no_timer
    if not calibration_needed(base.config.intermediate_sizes, widths, settings):
        return _pass_through(base, layers, progress)
    residual = settings.method.refit and settings.method.refit_target == "residual" and not base.config.sandwich_norm
    device = base.embed_tokens.weight.device
    bs = settings.batch_size
    batches = [blocks[i : i + bs].to(device) for i in range(0, len(blocks), bs)]
    positions = [torch.arange(b.shape[1], device=device).expand(b.shape[0], -1) for b in batches]
    hidden = [base.embed(base.embed_tokens(b), p) for b, p in zip(batches, positions)]
    layers.embedded()
    source_hidden = None  # the source layers' residual stream, from the first shrinking layer on
    step = _LayerStep(base, positions, settings, policy, timer)
    plans, scores = [], []
    total = base.config.num_hidden_layers
    if progress is not None:
        progress(0, total)
    for i in range(total):
        layer = layers.layer(i)
        width, source_width = widths[i], layer.mlp.down_proj.in_features
        with timer("calibrate"):
            first = residual and width < source_width and source_hidden is None
            mixed = step.mix(layer, hidden)
            if first:  # the source stream starts here: mix(h) is already there
                source_hidden = [layer.feed_forward(z) for z in mixed]
            elif source_hidden is not None:  # the source layer (not yet resized) on the source stream
                step.source_layer(layer, source_hidden)
        if width < source_width:
            plan, score, hidden = step.shrink(i, layer, mixed, width, source_hidden)
        elif width > source_width and settings.method.grow_init != "split":
            plan, score, hidden = step.grow(i, layer, mixed, width)
        else:
            plan, score, hidden = step.keep_or_split(i, layer, mixed, width)
        plans.append(plan)
        scores.append(None if score is None else score.float())
        layers.done(i, layer, plan, scores[-1])
        del layer
        if progress is not None:
            progress(i + 1, total)
    return CalibrationResult(plans=plans, scores=scores, tokens=int(blocks.numel()), hidden=hidden)


def _pass_through(base, layers: Layers, progress) -> CalibrationResult:
    """The loop of an exact import: each layer, unchanged (the identity plan), straight to ``layers.done``."""
    layers.embedded()
    plans, total = [], base.config.num_hidden_layers
    if progress is not None:
        progress(0, total)
    for i, width in enumerate(base.config.intermediate_sizes):
        layer = layers.layer(i)
        plans.append(LayerPlan(keep=list(range(width))))
        layers.done(i, layer, plans[-1], None)
        del layer
        if progress is not None:
            progress(i + 1, total)
    return CalibrationResult(plans=plans, scores=[None] * len(plans), tokens=0, hidden=[])


class _LayerStep:
    """The three ways a layer is calibrated and resized (see the module docstring); each returns
    (plan, scores of the source neurons, the layer's output per batch). Consumes ``mixed`` batch by batch."""

    def __init__(self, base, positions, settings: LayerSettings, policy: MemoryPolicy, timer):
        self.base, self.positions, self.policy, self.timer = base, positions, policy, timer
        m = settings.method
        self.importance, self.grow_init, self.refit = m.importance, m.grow_init, m.refit
        self.seed, self.noise_scale, self.damp = settings.seed, m.noise_scale, m.damp
        self.settings, self.method = settings, m

    def mix(self, layer, hidden: list) -> list:
        """z = mix(h) per batch; frees each input batch as soon as it is mixed."""
        out = []
        for b, p in enumerate(self.positions):
            out.append(_mix(self.base, layer, hidden[b], p))
            hidden[b] = None
        return out

    def source_layer(self, layer, source_hidden: list) -> None:
        """The source stream through the (not yet resized) layer, in place, batch by batch."""
        for b, p in enumerate(self.positions):
            source_hidden[b] = layer.feed_forward(_mix(self.base, layer, source_hidden[b], p))

    def scores(self, i, layer, stats, width=None) -> torch.Tensor | None:
        """Layer i's neuron scores; None for a growing layer a whole-model pass did not rank (first_ranked_layer)."""
        whole = None if self.settings.model_scores is None else self.settings.model_scores[i]
        if whole is None and self.settings.model_scores is not None and self.importance in WHOLE_MODEL:
            return None
        with self.timer("rank"):
            return neuron_scores(self.importance, stats, _weights(layer.mlp, width), seed=self.seed + i,
                                 whole_model=whole)

    def obs_weights(self, score, stats, down) -> torch.Tensor | None:
        """OBS's per-neuron cost weights: the Fisher sensitivity for ``fisher_obs``, else None (the local cost)."""
        return sensitivity(score, stats, down.weight) if self.importance == "fisher_obs" else None

    def resize(self, i, layer, plan) -> None:
        _resize_in_place(layer, i, plan, self.grow_init, self.noise_scale, self.seed)

    def grow(self, i, layer, mixed, width):
        source_width = layer.mlp.down_proj.in_features
        plan = LayerPlan(keep=list(range(source_width)), grow=width - source_width)
        with self.timer("resize"):
            self.resize(i, layer, plan)
            with activation_stats(layer.mlp.down_proj, columns=source_width) as stats:
                hidden = _consume(mixed, layer.feed_forward)
        return plan, self.scores(i, layer, stats, source_width), hidden

    def keep_or_split(self, i, layer, mixed, width):
        source_width = layer.mlp.down_proj.in_features
        with self.timer("calibrate"), activation_stats(layer.mlp.down_proj) as stats:
            hidden = [layer.feed_forward(z) for z in mixed]
        score = self.scores(i, layer, stats)
        plan = plan_from_scores([score], [width])[0]
        if width != source_width:  # split growth: the plan copies the top-scored neurons
            with self.timer("resize"):
                self.resize(i, layer, plan)
                hidden = _consume(mixed, layer.feed_forward)
        return plan, score, hidden

    def shrink_kept(self, i, layer, mixed, width, source_hidden):
        """``shrink`` keeping the pass's activations: the refit's system from them (the kept neurons' Gram matrix
        alone: K² instead of I²), and the layer's output z + D′ a_K from them (no second MLP pass)."""
        down = layer.mlp.down_proj
        obs = self.importance in OBS_METRICS
        rows = self.policy.rows(12 * down.in_features)
        weights = token_weights(self.method.token_weighting, mixed)
        with self.timer("calibrate"):
            with activation_stats(down, gram=obs and source_hidden is None and weights is None, keep=True, stop=True,
                                  block_rows=rows) as stats:
                _run_to_down_proj(layer, mixed)
        score = self.scores(i, layer, stats)
        if obs:  # OBS prunes from the least-squares optimum of the target: D itself (local), D* (residual)
            start = down.weight  # the local target's optimum under any token weights
            if source_hidden is not None or weights is not None:
                with self.timer("calibrate"):
                    stats.gram, rhs = _kept_system(down, stats.kept, mixed, None, source_hidden, rows, weights)
            if source_hidden is not None:
                with self.timer("rank"):
                    start = refit_kept(stats.gram, rhs, damp=self.damp)
            with self.timer("rank"):
                keep, new_down = obs_prune(stats.gram, start, width, damp=self.damp,
                                           weights=self.obs_weights(score, stats, down))
            plan = LayerPlan(keep=keep, down_override=new_down.to(down.weight.dtype))
        else:
            plan = plan_from_scores([score], [width])[0]
            if self.refit:
                with self.timer("calibrate"):
                    gram, rhs = _kept_system(down, stats.kept, mixed, plan.keep, source_hidden, rows, weights)
                in_place = self.policy.solve_in_place(width)
                if in_place:  # the right-hand side as LAPACK solves it in place: (K, d) column-major
                    rhs = rhs.T.contiguous().T
                with self.timer("rank"):
                    plan.down_override = refit_kept(gram, rhs, damp=self.damp, overwrite=True,
                                                    in_place=in_place).to(down.weight.dtype)
                del gram, rhs
        stats.gram = None
        if self.reconstructs(layer):
            targets = _mlp_targets(layer, mixed, source_hidden, stats.kept)
            stats.kept = None
            return plan, score, self.reconstruct(i, layer, plan, mixed, targets, weights)
        with self.timer("resize"):
            self.resize(i, layer, plan)
            hidden = []
            for b in range(len(mixed)):  # z + D′ a_K from the recorded activations; frees both per batch
                hidden.append(_feed_forward_reusing(layer, mixed[b], stats.kept[b], plan))
                mixed[b] = stats.kept[b] = None
        return plan, score, hidden

    def reconstructs(self, layer) -> bool:
        return self.method.reconstruct_epochs > 0 and not layer.sandwich

    def reconstruct(self, i, layer, plan, mixed, targets, weights, resized=False) -> list:
        """Resize (unless ``resized``), then train the pruned MLP towards the refit's ``targets``
        (reconstruct.reconstruct_mlp); returns the layer's output per batch."""
        with self.timer("resize"):
            if not resized:
                self.resize(i, layer, plan)
            budget = self.settings.reconstruct_budget
            history = reconstruct_mlp(layer, mixed, targets, weights, self.method.reconstruct_epochs,
                                      self.method.reconstruct_lr, seed=self.seed + i,
                                      on_epoch=None if budget is None else budget.tick)
            logger.info("layer %d reconstruction: relative error %s", i, " -> ".join(f"{e:.4f}" for e in history))
            del targets
            return _consume(mixed, layer.feed_forward)

    def shrink(self, i, layer, mixed, width, source_hidden):
        """AᵀA (and the residual target's AᵀY) summed batch by batch while the MLP runs up to its down projection,
        the plan and refit from them (G_KK taken out of AᵀA in place), then the resized MLP runs again; or, when
        the activations take less memory than that (few tokens, wide MLP) and the policy allows, ``shrink_kept``."""
        if self.method.shrink == "fold":
            return self.fold(i, layer, mixed, width, source_hidden)
        down = layer.mlp.down_proj
        tokens = sum(z.shape[0] * z.shape[1] for z in mixed)
        if self.policy.keeps(tokens, down.in_features):
            return self.shrink_kept(i, layer, mixed, width, source_hidden)
        obs = self.importance in OBS_METRICS
        solve = obs or self.refit
        weights = token_weights(self.method.token_weighting, mixed)
        rows = self.policy.rows(12 * down.in_features)
        residual = solve and source_hidden is not None
        cross = _Cross(down, mixed, source_hidden, self.policy, weights) if residual else None
        weighted = _WeightedGram(down.in_features, weights, rows) if solve and weights is not None else None
        sums = [f for f in (cross, weighted) if f is not None]
        with self.timer("calibrate"):
            targets = _mlp_targets(layer, mixed, source_hidden) if self.reconstructs(layer) else None
            with activation_stats(down, gram=solve and weights is None, stop=True, block_rows=rows,
                                  on_batch=(lambda a: [f(a) for f in sums]) if sums else None) as stats:
                _run_to_down_proj(layer, mixed)
        score = self.scores(i, layer, stats)
        gram, stats.gram = stats.gram if weighted is None else weighted.gram, None
        with self.timer("rank"):  # cross.take(): AᵀY (I, d), held by the solve alone (freed as soon as it is used)
            if obs:
                start = down.weight if cross is None else refit_kept(gram, cross.take(), damp=self.damp)
                keep, new_down = obs_prune(gram, start, width, damp=self.damp,
                                           weights=self.obs_weights(score, stats, down))
                plan = LayerPlan(keep=keep, down_override=new_down.to(down.weight.dtype))
            else:
                plan = plan_from_scores([score], [width])[0]
                if self.refit:
                    plan.down_override = refit_down_proj(gram, down.weight, plan.keep, damp=self.damp,
                                                         cross=None if cross is None else cross.take(), overwrite=True,
                                                         block_rows=self.policy.rows(8 * len(gram)),
                                                         in_place=self.policy.solve_in_place(width))
            del gram
        if targets is not None:
            return plan, score, self.reconstruct(i, layer, plan, mixed, targets, weights)
        with self.timer("resize"):
            self.resize(i, layer, plan)
            hidden = _consume(mixed, layer.feed_forward)
        return plan, score, hidden

    def fold(self, i, layer, mixed, width, source_hidden):
        """``shrink`` by a fold (tlm_convert.fold): the scores and the MLP input's second moment from a pass up to the
        down projection, every neuron merged into one of ``width`` clusters, the down projection refitted on the
        merged neurons' own activations (a pass of the folded MLP) to the refit's target, the folded MLP run again.
        Resident beyond the drop's: the refit's targets, (N, d) fp32."""
        mlp = layer.mlp
        weights = token_weights(self.method.token_weighting, mixed)
        with self.timer("calibrate"):
            with activation_stats(mlp.down_proj, stop=True) as stats, _input_moment(mlp) as moment:
                _run_to_down_proj(layer, mixed)
            targets = _mlp_targets(layer, mixed, source_hidden) if self.refit or self.reconstructs(layer) else None
        score = self.scores(i, layer, stats)
        with self.timer("rank"):
            keep = plan_from_scores([score], [width])[0].keep
            rows = {n: _with_bias(getattr(mlp, n)) for n in ("gate_proj", "up_proj") if hasattr(mlp, n)}
            merge = fold_merge(rows, moment.total, score, keep, self.method.fold_iters, self.seed + i)
            plan = LayerPlan(keep=keep, merge=merge)
        with self.timer("resize"):
            self.resize(i, layer, plan)
        down = layer.mlp.down_proj  # (d, width): the members' columns summed
        if self.refit:
            with self.timer("calibrate"):
                gram, rhs = _kept_system(down, _activations(layer, mixed), mixed, None, None,
                                         self.policy.rows(12 * width), weights, targets)
            with self.timer("rank"):
                plan.down_override = refit_kept(gram, rhs, damp=self.damp, overwrite=True).to(down.weight.dtype)
                down.weight.copy_(plan.down_override)
            del gram, rhs
        if self.reconstructs(layer):
            return plan, score, self.reconstruct(i, layer, plan, mixed, targets, weights, resized=True)
        with self.timer("resize"):
            hidden = _consume(mixed, layer.feed_forward)
        return plan, score, hidden


class _Cross:
    """The residual target's AᵀY = Σ_batches aᵀ(h_src − z − b) (I, d) fp64, one batch at a time from the
    statistics hook (batches in order), in row blocks of the policy's size."""

    def __init__(self, down, mixed, source_hidden, policy: MemoryPolicy, weights=None):
        self.bias, self.mixed, self.source_hidden, self.weights = down.bias, mixed, source_hidden, weights
        self.total = torch.zeros(down.in_features, down.out_features, dtype=torch.float64, device=down.weight.device)
        self.rows, self.batch = policy.rows(12 * down.out_features), 0

    def __call__(self, a: torch.Tensor) -> None:
        target = self.source_hidden[self.batch] - self.mixed[self.batch]  # (B, S, d)
        if self.bias is not None:
            target = target - self.bias
        if self.weights is not None:  # Aᵀ W Y
            target = target * self.weights[self.batch][..., None]
        self.batch += 1
        acts, target = a.flatten(0, 1).T.float(), target.flatten(0, 1).float()  # (I, N), (N, d)
        rows = self.rows or len(acts)
        for r in range(0, len(acts), rows):
            self.total[r : r + rows] += (acts[r : r + rows] @ target).double()

    def take(self) -> torch.Tensor:
        """The sum, no longer held here."""
        total, self.total = self.total, None
        return total


class _WeightedGram:
    """Σ_batches Σ_n w_n a_nᵀ a_n (I, I) fp64 from the statistics hook (batches in order): the token-weighted
    Gram matrix of the summed refit, in row blocks of ``rows``."""

    def __init__(self, width: int, weights: list, rows: int | None):
        self.gram = torch.zeros(width, width, dtype=torch.float64, device=weights[0].device)
        self.weights, self.rows, self.batch = weights, rows, 0

    def __call__(self, a: torch.Tensor) -> None:
        root = self.weights[self.batch].flatten().sqrt()[:, None]  # (N, 1)
        self.batch += 1
        add_gram(self.gram, a.flatten(0, 1).float() * root, self.rows)


def _mlp_targets(layer, mixed, source_hidden, acts=None) -> list:
    """What a pruned MLP is fitted to per batch (B, S, d): h_src − z (residual target), else the source MLP's own
    output, from its recorded activations ``acts`` when given (consumed) or by running it."""
    if source_hidden is not None:
        return [h - z for h, z in zip(source_hidden, mixed)]
    if acts is None:
        return [layer.mlp(layer.post_attention_layernorm(z)) for z in mixed]
    down = layer.mlp.down_proj
    out = []
    for b in range(len(acts)):
        out.append(F.linear(acts[b].float(), down.weight.float(), down.bias))
        acts[b] = None
    return out


def _run_to_down_proj(layer, mixed: list) -> None:
    """Every batch's MLP up to its down projection, whose ``stop=True`` statistics hook records the activations and
    stops the forward."""
    for z in mixed:
        try:
            layer.feed_forward(z)
        except StopForward:
            pass


def _consume(mixed: list, fn) -> list:
    """[fn(z) for z in mixed], freeing each z once used."""
    out = []
    for b in range(len(mixed)):
        out.append(fn(mixed[b]))
        mixed[b] = None
    return out


def _weights(mlp, width=None) -> dict:
    """The layer's gate/up/down weights, restricted to its first ``width`` neurons (the source ones)."""
    width = width or mlp.down_proj.in_features
    out = {n: getattr(mlp, n).weight[:width] for n in ("gate_proj", "up_proj") if hasattr(mlp, n)}
    out["down_proj"] = mlp.down_proj.weight[:, :width]
    return out


def _kept_system(down, acts, mixed, keep, source_hidden=None, rows=None,
                 weights=None, targets=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept neurons' least-squares system: G_KK = Σ a_Kᵀ a_K (K, K) and Σ a_Kᵀ Y (K, d), fp64 (``keep`` None:
    all neurons, no copy of the activations); with ``weights`` (per batch, (B, S)), every token's row of a_K and Y
    scaled by √w (the weighted system Σ w a_Kᵀ a_K, Σ w a_Kᵀ Y). ``acts``: per batch (B, S, I), any iterable.

    Y is the layer's own full-width MLP output a Dᵀ ("local"), or with ``source_hidden`` the output that restores
    the source stream, h_src − z − b ("residual"), or ``targets`` (per batch, (B, S, d)) less b. fp32 products per
    batch (the Gram matrix's in blocks of ``rows`` rows), accumulated in fp64."""
    idx = None if keep is None else torch.as_tensor(keep, dtype=torch.long, device=down.weight.device)
    gram = rhs = None
    for b, a in enumerate(acts):
        a = a.flatten(0, 1).float()  # (N_b, I)
        a_k = a if idx is None else a.index_select(1, idx)  # (N_b, K)
        if source_hidden is None and targets is None:
            target = F.linear(a, down.weight.float())  # (N_b, d)
        else:
            target = (source_hidden[b] - mixed[b] if targets is None else targets[b]).flatten(0, 1).float()
            if down.bias is not None:
                target = target - down.bias.float()
        if weights is not None:
            root = weights[b].flatten().sqrt()[:, None]  # (N_b, 1)
            a_k, target = a_k * root, target * root
        if gram is None:
            gram = torch.zeros(a_k.shape[1], a_k.shape[1], dtype=torch.float64, device=a.device)
            rhs = torch.zeros(a_k.shape[1], target.shape[1], dtype=torch.float64, device=a.device)
        add_gram(gram, a_k, rows)
        rhs += (a_k.T @ target).double()
    return gram, rhs


def _activations(layer, mixed: list):
    """Each batch's activations at the down projection's input (B, S, I), a batch at a time (a generator)."""
    for z in mixed:
        with activation_stats(layer.mlp.down_proj, keep=True, stop=True) as stats:
            _run_to_down_proj(layer, [z])
        yield stats.kept[0]


def _with_bias(linear: nn.Linear) -> torch.Tensor:
    """The rows of an input projection (I, h), with its bias as a last column when it has one (I, h + 1)."""
    if linear.bias is None:
        return linear.weight
    return torch.cat([linear.weight, linear.bias[:, None]], 1)


class _InputMoment:
    """Pre-hook on an MLP: Σ x̃ᵀx̃ (h', h') fp64 over its inputs x (B, S, h), x̃ = [x, 1] when its input
    projections have biases (h' = h + 1), in ``total``."""

    def __init__(self, mlp):
        self.bias = mlp.up_proj.bias is not None
        width = mlp.up_proj.in_features + self.bias
        self.total = torch.zeros(width, width, dtype=torch.float64, device=mlp.up_proj.weight.device)

    def __call__(self, _module, args):
        x = args[0].detach().flatten(0, -2).float()  # (N, h)
        if self.bias:
            x = torch.cat([x, x.new_ones(len(x), 1)], 1)
        add_gram(self.total, x)


@contextmanager
def _input_moment(mlp):
    """``with _input_moment(layer.mlp) as moment:`` run batches; ``moment.total`` sums their inputs' x̃ᵀx̃."""
    moment = _InputMoment(mlp)
    handle = mlp.register_forward_pre_hook(moment)
    try:
        yield moment
    finally:
        handle.remove()


def _feed_forward_reusing(layer, z, a, plan):
    """feed_forward(z) after shrinking, reusing the first pass's activations a (B, S, I_source): the kept neurons'
    are sliced from a. Equals ``layer.feed_forward(z)`` with the new weights."""
    y = layer.mlp.down_proj(a[..., plan.keep])
    if layer.sandwich:
        y = layer.post_feedforward_layernorm(y)
    return z + y


def _mix(base, layer, h, positions):
    rope, masks = base.block_context(h, positions)
    return layer.mix(h, rope.get(layer.layer_type), masks[layer.layer_type], None)


@contextmanager
def _no_timer(_phase):
    yield


def _resize_in_place(layer, idx, plan, grow_init, noise_scale, seed) -> None:
    """Give the layer's MLP projections their resized tensors (``surgery.resize_layer``) in place."""
    prefix = f"model.layers.{idx}.mlp."
    mlp = layer.mlp
    sd = {prefix + k: v for k, v in mlp.state_dict().items()}
    new = resize_layer(sd, idx, plan, grow_init, noise_scale, seed, gated=hasattr(mlp, "gate_proj"))
    del sd
    for name, module in mlp.named_children():
        if not isinstance(module, nn.Linear):
            continue
        weight = new.pop(prefix + name + ".weight")
        module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        if prefix + name + ".bias" in new:  # down_proj's bias is per output, never resized
            module.bias = nn.Parameter(new.pop(prefix + name + ".bias"), requires_grad=module.bias.requires_grad)
        module.out_features, module.in_features = weight.shape
    mlp.intermediate_size = plan.width


__all__ = ["convert_layers", "score_whole_model", "first_ranked_layer", "CalibrationResult", "MemoryPolicy",
           "IN_MEMORY", "LOW_MEMORY", "Layers", "ModelLayers", "LayerSettings"]
