"""Importance ``fisher``: MLP neurons ranked by what removing them costs the model's own output distribution.

Every other metric is local to one layer: OBS ranks a neuron by the error its removal leaves in *that layer's*
output after compensation. This one asks the whole model. Put a mask m_j = 1 on neuron j's activation a_j; removing
the neuron sets m_j = 0, and the KL divergence from the source's next-token distribution to the pruned model's grows,
to second order, by ½ F_jj, where F is the Fisher information of the model's own predictive distribution with
respect to the masks (the Hessian of that KL at m = 1; its gradient there is zero, so first-order Taylor scores of
the KL vanish). The score of neuron j is a diagonal of that Fisher; by default (``mask="token"``) with a mask on
the neuron at each position, its squared gradients summed over the positions:

    F_jj = Σ_s Σ_t ( a_stj · ∂ log p(y_s | x_s) / ∂a_stj )²      log p(y_s | x_s) = Σ_t' log p(y_st' | x_s,<t'),
                                                                 y_st' ~ p(· | x_s,<t'), drawn from the model

over calibration sequences s and positions t (SDMPrune, arXiv 2506.11120, ranks neurons by gradients of the same
self-distillation objective). With targets drawn from the model, the score functions of different target positions
t' have zero mean and are independent given the inputs, so one backward pass of the sampled sequence's
log-likelihood estimates the sum over targets without one backward pass per target. ``mask="sequence"`` squares
the sum over t instead, Σ_s (Σ_t a_stj ∂ log p(y_s | x_s) / ∂a_stj)²: one mask a neuron per sequence, as Kwon et
al. 2022 use mask gradients. Its expectation also holds the cross-position terms (removing a neuron removes it at
every position at once), but it is one noisy square per sequence where the token mask sums a square per position;
the token mask ranks better for the same cost (bench/STUDIES.md, "The Fisher estimate").

The scores come from one forward and backward pass of the *source* model over the calibration blocks, before the
layer loop (no parameter gradients are formed: the embeddings' output, or the first ranked layer's input, is the
only leaf that requires grad). The
layer loop then keeps each shrinking layer's top-scored neurons and refits its down projection as for any score
(calibrate.convert_layers); growing layers keep every neuron, so the backward pass stops at the first layer that
does not grow (calibrate.first_ranked_layer). It needs the whole model in memory, and runs as many
sequences per backward pass as fit ``BACKWARD_BUDGET`` (one at a time for SmolLM2-135M and Gemma 3 270M at 512
tokens). The head's gradient is formed a few positions at a time, so the (B, S, V) logits are never held: Gemma 3's
262,144-token vocabulary made them 2 GB a sequence, four times over.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack

import torch
from torch.nn import functional as F
from tqdm import tqdm

from .options import FISHER_MASKS as MASKS

BACKWARD_BUDGET = 1 << 30  # bytes a backward batch may hold: the activations autograd keeps
HEAD_CHUNK_BYTES = 1 << 24  # fp32 logits formed at once by the head's gradient (a few positions' worth)


def fisher_scores(model, blocks: torch.Tensor, seed: int = 0, batch_size: int = 8, progress: bool = False,
                  max_blocks: int = 0, seq_len: int = 0, first_layer: int = 0,
                  draws: int = 1, mask: str = "token", dtype: torch.dtype | None = None) -> list[torch.Tensor | None]:
    """Per layer, the diagonal Fisher score (I_l,) fp64 of every MLP neuron of ``model`` (a TLMForCausalLM) over
    the calibration ``blocks`` (n, S), or ``max_blocks`` of them evenly spread (0: all), each cut into sequences of
    ``seq_len`` tokens (0: S; a shorter one gives the model less context, and the sequence mask more, shorter sums;
    the pieces after a block's first lack the tokenizer's start prefix, Gemma's <bos>). ``draws``: the
    targets drawn that many times a sequence, one backward pass each through the same forward graph, the squared sums
    averaged (the estimate's variance over draws / ``draws``; 1 is the one-draw score, bit for bit). ``mask``:
    "token", one mask a neuron and position, the squared mask gradients summed over positions (the module's F_jj),
    or "sequence", one mask a neuron over a sequence, the square of their sum (the same cost). ``dtype``: the
    matmuls run in it (torch.autocast; the head's weight cast once), the scores still summed in fp64; None: the
    model's own dtype. Deterministic for a seed; the model's parameters and the global random state are left as
    they were.

    ``first_layer``: the layers before it are not scored (None): the backward pass stops at its input, so they
    neither run backward nor keep activations for it. A layer's score depends only on the layers after it, so
    every scored layer's is the one a full pass gives (a cosine taper grows its first half: half the backward)."""
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {', '.join(MASKS)}, got {mask!r}")
    if 0 < max_blocks < len(blocks):  # the calibration sources are concatenated: take from each its share
        blocks = blocks[torch.linspace(0, len(blocks) - 1, max_blocks).round().long()]
    if 0 < seq_len < blocks.shape[1]:
        blocks = blocks[:, : blocks.shape[1] // seq_len * seq_len].reshape(-1, seq_len)  # (n * S // seq_len, seq_len)
    layers = model.model.layers
    # rows as for a full pass (the batching changes the draw): a scored layer's score does not depend on first_layer
    rows = max(1, min(batch_size, BACKWARD_BUDGET // backward_bytes_per_row(model, blocks.shape[1])))
    device = next(model.parameters()).device
    scores = [torch.zeros(layer.mlp.down_proj.in_features, dtype=torch.float64, device=device)
              for layer in layers[first_layer:]]
    leaf = model.model.embed_tokens if first_layer == 0 else layers[first_layer - 1]
    gen = torch.Generator(device=device).manual_seed(seed)
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    head = model.lm_head.weight if dtype is None else model.lm_head.weight.to(dtype)  # (V, H)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=head.dtype != model.lm_head.weight.dtype)
    bar = tqdm(total=len(blocks), desc="fisher", unit="seq", file=sys.stderr, disable=not progress)
    try:
        with bar, ExitStack() as hooks, torch.enable_grad(), autocast:
            hooks.callback(leaf.register_forward_hook(_needs_grad).remove)
            for layer, score in zip(layers[first_layer:], scores):
                hooks.callback(layer.mlp.down_proj.register_forward_pre_hook(_MaskGradient(score, mask)).remove)
            for first in range(0, len(blocks), rows):
                ids = blocks[first : first + rows].to(device)  # (B, S)
                _backward_sampled_loglik(model.model, head, ids, gen, draws)
                bar.update(ids.shape[0])
    finally:
        for p in frozen:
            p.requires_grad_(True)
    if draws > 1:
        scores = [s / draws for s in scores]
    return [None] * first_layer + scores


def backward_bytes_per_row(model, seq_len: int) -> int:
    """Estimated bytes one sequence of ``seq_len`` tokens holds at the peak of the pre-pass's backward through every
    layer (an upper bound when the first layers are not scored): per layer, the activations autograd saves (about
    8 hidden-size and 5 MLP-width vectors a token in the model's dtype; the logits are formed a chunk at a time and
    not kept): about 0.75 GB for one 512-token sequence of SmolLM2-135M, 0.57 GB of Gemma 3 270M."""
    config = model.config
    width = max(config.intermediate_sizes)
    item = next(model.parameters()).element_size()
    per_token = item * config.num_hidden_layers * (8 * config.hidden_size + 5 * width)
    return seq_len * per_token


def _needs_grad(_module, _args, output: torch.Tensor) -> torch.Tensor:
    return output.requires_grad_()  # the graph's one leaf (the embeddings' or a layer's output): activations get
    # gradients, parameters none, and nothing before the leaf runs backward


class _MaskGradient:
    """Pre-hook on ``down_proj``: a (B, S, I) is its input; once the backward pass reaches it, adds
    Σ_b Σ_t (a · ∂L/∂a)² to ``score`` (``mask`` "token"), or Σ_b (Σ_t a · ∂L/∂a)² ("sequence")."""

    def __init__(self, score: torch.Tensor, mask: str):
        self.score = score
        self.per_token = mask == "token"

    def __call__(self, _module, args):
        a = args[0]
        if a.requires_grad:
            kept = a.detach()

            def add(grad: torch.Tensor) -> None:  # (B, S, I); returns None: the gradient itself is unchanged
                masked = kept.double() * grad.double()  # (B, S, I): the mask gradients of each position
                self.score.add_((masked.pow(2).sum(1) if self.per_token else masked.sum(1).pow(2)).sum(0))

            a.register_hook(add)


def _backward_sampled_loglik(body, head: torch.Tensor, ids: torch.Tensor, gen: torch.Generator,
                             draws: int = 1) -> None:
    """Backpropagate log p(y | ids) summed over every position, y drawn from the model's own next-token
    distribution; ``draws`` times, each with its own y, through one forward graph. The head's share is formed a chunk
    of positions at a time (``HEAD_CHUNK_BYTES`` of logits), so the (B, S, V) logits are never held: with z = h W^T,
    d log p(y) / dz = onehot(y) - softmax(z), and the gradient reaching the last hidden state h is that times W; one
    backward pass of the ``body`` (a TLMModel) takes it from there; ``head``: the LM head's weight W (V, H)."""
    hidden = body(input_ids=ids, use_cache=False).last_hidden_state  # (B, S, H), after the final norm
    flat = hidden.detach().flatten(0, 1)  # (B*S, H)
    for draw in range(draws):
        grad = _sampled_head_gradient(head, flat, gen)
        hidden.backward(grad.view_as(hidden), retain_graph=draw < draws - 1)


def _sampled_head_gradient(weight: torch.Tensor, flat: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """d log p(y) / dh (N, H) for final hidden states ``flat`` (N, H) and the LM head's ``weight`` W (V, H), one y
    drawn per row from softmax(h W^T), a few rows at a time."""
    grad = torch.empty_like(flat)
    step = max(1, HEAD_CHUNK_BYTES // (4 * weight.shape[0]))
    for first in range(0, len(flat), step):
        rows = slice(first, first + step)
        logits = F.linear(flat[rows].to(weight.dtype), weight)  # (c, V)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
        targets = torch.multinomial(probs, 1, generator=gen)  # (c, 1)
        probs.scatter_add_(1, targets, torch.full_like(targets, -1, dtype=probs.dtype))  # p - onehot(y)
        grad[rows] = probs.neg().to(weight.dtype) @ weight  # (c, H): d log p(y) / dh
    return grad


def top_share_profile(scores: list[torch.Tensor], share: float = 0.5) -> list[float]:
    """Per layer, how many of its neurons rank among the model's top ``share`` of all neurons by score (a global
    rank: Fisher scores measure one quantity, the KL of the model's output, in every layer). The removal-cost profile
    ``--schedule measured`` allocates widths by; ties are broken by position (deterministic)."""
    flat = torch.cat([s.double().flatten() for s in scores])  # (sum I_l,)
    layer = torch.cat([torch.full((len(s),), i, device=flat.device) for i, s in enumerate(scores)])
    top = torch.sort(flat, descending=True, stable=True).indices[: int(round(share * len(flat)))]
    return [float(c) for c in torch.bincount(layer[top], minlength=len(scores))]


__all__ = ["BACKWARD_BUDGET", "MASKS", "backward_bytes_per_row", "fisher_scores", "top_share_profile"]
