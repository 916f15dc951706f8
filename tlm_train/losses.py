"""Distillation and next-token losses formed from final hidden states and LM heads, a chunk of positions at a time.

A heal step's loss needs the student's and the teacher's logits: with a large vocabulary (Gemma 3's 262,144
entries) the (batch, seq, vocab) fp32 logit tensors of the two models, their softmaxes and the gradient of the
student's are several times the size of the model. :func:`head_loss` never forms them whole: it takes the final
(normed) hidden states and the LM head weights, forms the logits of ``chunk`` positions at a time, and computes the
loss *and its gradient* for that chunk in the same pass (the head's gradient is accumulated, the hidden states'
gradient written row by row), so the backward pass only scales the stored gradients. At most a few (chunk, vocab)
fp32 buffers exist at once; the gradient costs the same two head products per chunk as autograd's, and the logits
are not recomputed.

The loss is ``lm_weight * CE + kd_weight * T^2 * KL(softmax(z_t / T) || softmax(z_s / T))``, both terms the mean
over the N = B * (S - 1) predicted positions, exactly :func:`lm_loss` and :func:`distill_loss` on whole logits
(tests/test_losses.py pins the equality and the gradients). A term whose weight is 0 is not formed at all.

The teacher may also come as its top-k log-probabilities at temperature T (:func:`teacher_topk`, computed once and
reused when the same text is seen again): the KL is then taken between the two distributions collapsed onto the k
teacher entries plus one "rest" entry holding the remaining mass, ``sum_k p_k log(p_k / q_k) + r_t log(r_t / r_s)``.
It is exact when the k entries hold all the teacher's mass, and its gradient pulls the student's rest mass towards the
teacher's without reshaping it: ``(q_j - p_j) / T`` on the k entries, ``q_j (1 - r_t / r_s) / T`` elsewhere.

Precision follows autocast as an ``nn.Linear`` head would: inside a bf16 autocast region the head products run in
bf16 (the logits rounded to bf16, then upcast), the softmaxes, the loss and the head's gradient accumulation in
fp32; outside autocast everything runs in the hidden states' dtype.

:class:`Distillation` is a training step's loss against a teacher: the student's forward pass, the teacher's (or
its cached top k), :func:`head_loss` and the residual-stream term :func:`hidden_loss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tlm_io.errors import TrainError

# Positions whose logits are formed at a time (bench/STUDIES.md, "The heal step's loss and its chunk").
HEAD_CHUNK = 256
# On a GPU a chunk of 256 positions makes the head products too small to keep it busy and launches a dozen kernels
# per chunk; 4,096 positions at a 32k-262k vocabulary is 0.5-4 GB of fp32 buffers, a few percent of its memory.
GPU_HEAD_CHUNK = 4096


def default_chunk(device: torch.device | str) -> int:
    """The chunk :func:`head_loss` takes when none is given: :data:`GPU_HEAD_CHUNK` on CUDA, else :data:`HEAD_CHUNK`."""
    return GPU_HEAD_CHUNK if torch.device(device).type == "cuda" else HEAD_CHUNK


def head_loss(student_hidden: torch.Tensor, student_head: torch.Tensor, ids: torch.Tensor, *,
              teacher_hidden: torch.Tensor | None = None, teacher_head: torch.Tensor | None = None,
              teacher_top: tuple[torch.Tensor, torch.Tensor] | None = None,
              kd_weight: float = 0.0, lm_weight: float = 1.0, temperature: float = 1.0,
              chunk: int | None = None) -> torch.Tensor:
    """Scalar ``lm_weight * CE + kd_weight * T^2 * KL`` of next-token prediction, from hidden states.

    student_hidden (B, S, d) and teacher_hidden (B, S, d_t): final normed states of ``ids`` (B, S); student_head
    (V, d) and teacher_head (V, d_t): the LM head weights (no bias). Position t predicts ids[:, t + 1], so the last
    position is left out. The teacher side is needed only when kd_weight > 0 and never receives a gradient; instead
    of its hidden states and head it may be ``teacher_top`` = (indices, log-probabilities), each (B, S - 1, k), of
    :func:`teacher_topk` at the same temperature (the KL over the top k plus the rest, see the module's doc).
    ``chunk`` None: :func:`default_chunk` of the hidden states' device."""
    chunk = default_chunk(student_hidden.device) if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if teacher_top is not None:
        return _top_head_loss(student_hidden, student_head, ids, teacher_top, kd_weight, lm_weight, temperature, chunk)
    if kd_weight and (teacher_hidden is None or teacher_head is None):
        raise ValueError("kd_weight > 0 needs teacher_hidden and teacher_head")
    if teacher_head is not None and teacher_head.shape[0] != student_head.shape[0]:
        raise ValueError(f"the teacher's head has {teacher_head.shape[0]} vocabulary entries, the student's "
                         f"{student_head.shape[0]}")
    dtype = _product_dtype(student_hidden)
    hs = student_hidden[:, :-1].reshape(-1, student_hidden.shape[-1])  # (N, d)
    ht = None
    if kd_weight:
        ht = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1]).detach()  # (N, d_t)
        teacher_head = teacher_head.detach()
    else:
        teacher_head = None
    targets = ids[:, 1:].reshape(-1)  # (N,)
    grads = torch.is_grad_enabled()  # no gradient is formed under torch.no_grad()
    return _ChunkedHeadLoss.apply(hs, student_head, ht, teacher_head, targets, float(kd_weight), float(lm_weight),
                                  float(temperature), int(chunk), dtype, grads)


def _product_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype an nn.Linear head's product would run in here: autocast's, else the hidden states'."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _top_head_loss(student_hidden, student_head, ids, teacher_top, kd_weight, lm_weight, temperature, chunk):
    idx, logp = teacher_top
    n = ids.shape[0] * (ids.shape[1] - 1)
    if idx.shape != logp.shape or idx.dim() != 3 or idx.shape[0] * idx.shape[1] != n:
        raise ValueError(f"teacher_top must be two (B, S - 1, k) tensors for ids {tuple(ids.shape)}, got "
                         f"{tuple(idx.shape)} and {tuple(logp.shape)}")
    hs = student_hidden[:, :-1].reshape(-1, student_hidden.shape[-1])  # (N, d)
    top = (idx.reshape(n, -1), logp.reshape(n, -1).detach())  # (N, k) each
    targets = ids[:, 1:].reshape(-1)  # (N,)
    return _ChunkedHeadLoss.apply(hs, student_head, top, None, targets, float(kd_weight), float(lm_weight),
                                  float(temperature), int(chunk), _product_dtype(student_hidden),
                                  torch.is_grad_enabled())


@torch.no_grad()
def teacher_topk(hidden: torch.Tensor, head: torch.Tensor, k: int, temperature: float = 1.0,
                 chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices int32, log-probabilities fp32), each (B, S - 1, k): the k most likely next tokens of every predicted
    position under softmax(z / T), z = hidden (B, S, d) @ head (V, d).T formed ``chunk`` positions at a time
    (None: :func:`default_chunk`)."""
    chunk = default_chunk(hidden.device) if chunk is None else chunk
    if not 1 <= k <= head.shape[0]:
        raise ValueError(f"k must be in [1, {head.shape[0]}] (the vocabulary), got {k}")
    b, s = hidden.shape[0], hidden.shape[1] - 1
    dtype = _product_dtype(hidden)
    h = hidden[:, :-1].reshape(b * s, -1)  # (N, d)
    w = head.to(dtype)
    idx = torch.empty(b * s, k, dtype=torch.int32, device=h.device)
    logp = torch.empty(b * s, k, dtype=torch.float32, device=h.device)
    buf = _Buffers(min(chunk, b * s), head.shape[0], dtype, torch.float32, h.device, full_kd=False, lm_and_kd=False)
    with torch.autocast(h.device.type, enabled=False):
        for start in range(0, b * s, chunk):
            z = buf.product(h[start:start + chunk].to(dtype), w, "z")  # (C, V) in fp32
            vals, top = _log_softmax_(z.div_(temperature) if temperature != 1 else z).topk(k, dim=-1)
            idx[start:start + chunk], logp[start:start + chunk] = top, vals
    return idx.view(b, s, k), logp.view(b, s, k)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Loss and gradient in one chunked forward pass; backward scales the stored gradients by grad_output."""

    @staticmethod
    def forward(ctx, hs, ws, ht, wt, targets, kd_weight, lm_weight, temperature, chunk, dtype, grads):
        need_h, need_w = grads and ctx.needs_input_grad[0], grads and ctx.needs_input_grad[1]
        with torch.autocast(hs.device.type, enabled=False):
            loss, grad_h, grad_w = _loss_and_grads(hs, ws, ht, wt, targets, kd_weight, lm_weight, temperature,
                                                   chunk, dtype, need_h, need_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (hs.dtype, ws.dtype)
        ctx.has = (grad_h is not None, grad_w is not None)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        has_h, has_w = ctx.has
        # scaled in place: the head's gradient is as large as the head (a second backward through the same graph
        # is refused by autograd's saved-tensor version check)
        dh = grad_h.mul_(grad_out).to(ctx.dtypes[0]) if has_h else None
        dw = grad_w.mul_(grad_out).to(ctx.dtypes[1]) if has_w else None
        return dh, dw, None, None, None, None, None, None, None, None, None


def _loss_and_grads(hs, ws, ht, wt, targets, kd_weight, lm_weight, temperature, chunk, dtype, need_h, need_w):
    """(loss, d loss / d hs or None, d loss / d ws or None) over the N rows of hs (N, d), chunk by chunk; the loss,
    softmaxes and gradients in fp32 (fp64 when the products are).

    The (chunk, V) tensors of a chunk are written into buffers made once per call and reused by every chunk (a
    fresh buffer of that size costs its page faults each time); the values are those of the out-of-place formulas,
    bit for bit."""
    n = hs.shape[0]
    acc = torch.promote_types(dtype, torch.float32)
    ws_c = ws.to(dtype)  # (V, d): the head in the product dtype, cast once
    # the teacher: its head in the product dtype, or (idx, logp) of its top k (then ht is that pair, wt None)
    wt_c = wt.to(dtype) if wt is not None else None
    buf = _Buffers(min(chunk, n), ws.shape[0], dtype, acc, hs.device, full_kd=bool(kd_weight) and wt is not None,
                   lm_and_kd=bool(kd_weight) and bool(lm_weight))
    loss = torch.zeros((), dtype=acc, device=hs.device)
    grad_h = torch.empty(hs.shape, dtype=acc, device=hs.device) if need_h else None
    grad_w = torch.zeros(ws.shape, dtype=acc, device=ws.device) if need_w else None
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        h_c = hs[start:stop].to(dtype)  # (C, d)
        z_s = buf.product(h_c, ws_c, "z")  # (C, V) student logits in acc
        part, grad_z = _chunk_loss(z_s, ht, wt_c, targets[start:stop], start, stop, n, kd_weight, lm_weight,
                                   temperature, dtype, buf)
        loss += part
        if grad_h is None and grad_w is None:
            continue
        grad_z = buf.in_product_dtype(grad_z)  # the head's backward runs in the product dtype, as nn.Linear's would
        if grad_h is not None:
            grad_h[start:stop] = grad_z @ ws_c
        if grad_w is not None:
            grad_w += grad_z.T @ h_c
        del grad_z
    return loss, grad_h, grad_w


class _Buffers:
    """The (chunk, V) work tensors of :func:`_loss_and_grads`, each made once: ``z`` the student's logits (then their
    log-softmax, then the gradient, in place), ``t`` and ``p`` the teacher's log-probabilities and probabilities
    (the whole-vocabulary KL), ``lm`` the next-token log-probabilities when the KL is formed too, and ``low`` a
    product-dtype buffer for the products' output and the gradient's cast (when that dtype is not the loss's)."""

    def __init__(self, rows, vocab, dtype, acc, device, full_kd, lm_and_kd):
        def make(dt):
            return torch.empty(rows, vocab, dtype=dt, device=device)

        self.dtype = dtype
        self.bufs = {"z": make(acc)}
        if full_kd:
            self.bufs["t"], self.bufs["p"] = make(acc), make(acc)
        if lm_and_kd:
            self.bufs["lm"] = make(acc)
        self.low = make(dtype) if dtype != acc else None

    def get(self, name, rows):
        return self.bufs[name][:rows]

    def product(self, h, w, name):
        """h (C, d) @ w (V, d).T in the product dtype, upcast into buffer ``name`` (C, V)."""
        out = self.get(name, h.shape[0])
        if self.low is None:
            return torch.mm(h, w.T, out=out)
        return out.copy_(torch.mm(h, w.T, out=self.low[: h.shape[0]]))

    def in_product_dtype(self, x):
        return x if self.low is None else self.low[: x.shape[0]].copy_(x)


def _log_softmax_(x, out=None):
    """log_softmax over the last dim of x written into ``out`` (default: x itself): the kernel of F.log_softmax,
    whose CPU and CUDA implementations read a row whole before writing it, so the result is F.log_softmax(x)'s,
    bit for bit (tests/test_losses.py checks it), without a new (C, V) tensor."""
    return torch._log_softmax(x, -1, False, out=x if out is None else out)


def _chunk_loss(z_s, ht, wt_c, targets, start, stop, n, kd_weight, lm_weight, temperature, dtype, buf):
    """(this chunk's share of the loss, d loss / d z_s (C, V)) for student logits z_s (C, V) in fp32 or fp64 (a
    buffer of ``buf``, overwritten: the gradient is returned in it)."""
    rows_n = stop - start
    lm_part = g = None
    if lm_weight:  # first: the KL below overwrites z_s
        logp = _log_softmax_(z_s, buf.get("lm", rows_n) if kd_weight else None)  # (C, V)
        rows = torch.arange(rows_n, device=z_s.device)
        lm_part = lm_weight / n * -logp[rows, targets].sum()
        g = logp.exp_()  # softmax; d CE / d z = softmax - onehot(target)
        g[rows, targets] -= 1.0
        g.mul_(lm_weight / n)
    grad_z = None
    part = z_s.new_zeros(())
    if kd_weight and isinstance(ht, tuple):
        kd_part, grad_z = _top_kl(z_s, ht[0][start:stop].long(), ht[1][start:stop].to(z_s.dtype), n, kd_weight,
                                  temperature)
        part = part + kd_part
    elif kd_weight:
        t = temperature
        with torch.no_grad():
            t_logp = buf.product(ht[start:stop].to(dtype), wt_c, "t")  # (C, V) teacher logits
        if t != 1:
            t_logp.div_(t)
        _log_softmax_(t_logp)
        if t != 1:
            z_s.div_(t)
        s_logp = _log_softmax_(z_s)
        p_t = torch.exp(t_logp, out=buf.get("p", rows_n))
        # KL(p_t || p_s) summed over the chunk's rows; d/dz_s of T^2 * KL / N = T * (p_s - p_t) / N
        part = part + kd_weight * t * t / n * t_logp.sub_(s_logp).mul_(p_t).sum()
        grad_z = s_logp.exp_().sub_(p_t).mul_(kd_weight * t / n)
    if lm_part is not None:
        part = part + lm_part
        grad_z = g if grad_z is None else grad_z.add_(g)
    return part, grad_z


def _top_kl(z_s, idx, logp, n, kd_weight, t):
    """(kd_weight * T^2 / n * the chunk's summed top-k + rest KL, its gradient d/dz_s (C, V)); idx, logp (C, k)."""
    s_logp = _log_softmax_(z_s.div_(t) if t != 1 else z_s)  # (C, V), in z_s's buffer
    s_top = s_logp.gather(1, idx)  # (C, k)
    q = s_logp.exp_()  # (C, V) student probabilities, in place
    q_top = q.gather(1, idx)
    p_top = logp.exp()
    r_t = (1 - p_top.sum(-1)).clamp_min(0)  # (C,) the teacher's mass outside its top k
    rest = q.scatter_(1, idx, 0.0)  # (C, V): q off the top-k entries (summed directly: no 1 - sum cancellation)
    r_s = rest.sum(-1).clamp_min(torch.finfo(z_s.dtype).tiny)  # (C,)
    kl = (p_top * (logp - s_top)).sum(-1) + torch.xlogy(r_t, r_t) - torch.xlogy(r_t, r_s)  # (C,)
    scale = kd_weight * t / n
    grad = rest.mul_(((1 - r_t / r_s) * scale).unsqueeze(-1))  # off the top k: q_j (1 - r_t / r_s) T / n
    grad.scatter_(1, idx, (q_top - p_top) * scale)  # on the top k: (q_j - p_j) T / n
    return kd_weight * t * t / n * kl.sum(), grad


# ============================================================================================== a forward pass's loss


def final_hidden(forward, model, ids: torch.Tensor):
    """(the forward's output with every layer's hidden states, the final normed hidden states (B, S, d), the LM head
    weight (V, d)) of ids (B, S) through ``forward`` (``model``'s, possibly wrapped or compiled). The head runs on
    the last position only (logits_to_keep=1): the loss forms the logits from the hidden states a chunk at a time."""
    out = forward(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    # read after the forward: under FSDP the root module's weights are gathered from then on
    return out, out.hidden_states[-1], model.get_output_embeddings().weight


def next_token_loss(forward, model, ids: torch.Tensor) -> torch.Tensor:
    """A training step's mean next-token cross entropy of ids (B, S) through ``forward`` (``model``'s, possibly
    wrapped or compiled): :func:`lm_loss` of the model's logits in value and gradient, formed by :func:`head_loss`
    a chunk of positions at a time, so no (B, S, V) logit tensor exists."""
    _, h, head = final_hidden(forward, model, ids)
    return head_loss(h, head, ids)


# ============================================================================================== whole logits


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits (B, S, V), ids (B, S) -> scalar (fp32)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * mean over positions of KL(softmax(teacher/T) || softmax(student/T)); logits (B, S, V)."""
    t = temperature
    s_logp = F.log_softmax(student[:, :-1].float() / t, dim=-1).flatten(0, 1)
    t_logp = F.log_softmax(teacher[:, :-1].float() / t, dim=-1).flatten(0, 1)
    return F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * t * t


def hidden_loss(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean over layers and tokens of ||h_s - h_t||^2 / ||h_t||^2: the residual stream after every layer (the
    embeddings, index 0, are skipped), each (B, S, d); relative per token, so the few tokens with very large
    residual norms (the first position's) weigh as much as any other."""
    if len(student) != len(teacher):
        raise TrainError(f"distill.hidden_weight needs a teacher of the student's depth: {len(teacher) - 1} "
                         f"layers against {len(student) - 1}")
    losses = []
    for s, t in zip(student[1:], teacher[1:]):
        t = t.float()
        losses.append(((s.float() - t).square().sum(-1) / t.square().sum(-1).clamp_min(1e-12)).mean())
    return torch.stack(losses).mean()


# ============================================================================================== a training step


class Distillation:
    """The loss of a distillation step: ``(1 - alpha) * LM loss + alpha * (T^2 * KL + hidden_weight * residual-stream
    loss)`` of a student's forward pass against ``teacher`` (frozen, on the student's device), with the settings
    of ``spec`` (tlm_train.recipe.DistillSpec). ``cache`` (a tlm_train.teacher_cache.TeacherTopCache, with
    ``spec.teacher_topk``): the teacher's top k of each block, computed once."""

    def __init__(self, teacher, spec, cache=None):
        self.teacher, self.spec, self.cache = teacher, spec, cache
        self.hidden = spec.hidden_weight > 0  # the residual streams are matched too

    def loss(self, forward, student, ids: torch.Tensor) -> torch.Tensor:
        """The step's loss on ids (B, S) through ``forward`` (the student's, possibly wrapped or compiled; ``student``
        the module itself); the logit terms formed from the final hidden states and LM heads a chunk of positions
        at a time (:func:`head_loss`): neither model's (B, S, V) logits exist whole. alpha 1: pure distillation,
        the LM term is not formed."""
        d = self.spec
        out, h, head = final_hidden(forward, student, ids)
        if self.cache is not None:
            top = self.cache.top(ids, self._teacher_top)
            return head_loss(h, head, ids, teacher_top=top, kd_weight=d.alpha, lm_weight=1 - d.alpha,
                             temperature=d.temperature)
        with torch.no_grad():
            teacher_out = self.teacher.model(input_ids=ids, use_cache=False,
                                             output_hidden_states=self.hidden or None)
        loss = head_loss(h, head, ids,
                         teacher_hidden=teacher_out.last_hidden_state,
                         teacher_head=self.teacher.get_output_embeddings().weight,
                         kd_weight=d.alpha, lm_weight=1 - d.alpha, temperature=d.temperature)
        if self.hidden:
            loss = loss + d.alpha * d.hidden_weight * hidden_loss(out.hidden_states, teacher_out.hidden_states)
        return loss

    @torch.no_grad()
    def _teacher_top(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-k (indices, log-probabilities) of ids (M, S), each (M, S - 1, k)."""
        d = self.spec
        hidden = self.teacher.model(input_ids=ids, use_cache=False).last_hidden_state
        return teacher_topk(hidden, self.teacher.get_output_embeddings().weight, d.teacher_topk, d.temperature)


__all__ = ["head_loss", "teacher_topk", "HEAD_CHUNK", "GPU_HEAD_CHUNK", "default_chunk", "final_hidden",
           "next_token_loss", "lm_loss", "distill_loss", "hidden_loss", "Distillation"]
