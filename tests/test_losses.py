"""tlm_train.losses.head_loss: the chunked distillation / next-token loss equals the trainer's whole-logit losses in
value and gradient (fp32 and fp64, odd chunks, temperature, alpha), never forms a (positions x vocab) tensor, and a
heal step through it updates a tiny model as the whole-logit formula does."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tlm_train.trainer as trainer_module
from tlm import TLMConfig, TLMForCausalLM
from tlm_train.losses import GPU_HEAD_CHUNK, HEAD_CHUNK, default_chunk, head_loss, next_token_loss, teacher_topk
from tlm_train.recipe import RecipeError, recipe_from_dict
from tlm_train.trainer import distill_loss, hidden_loss, lm_loss, load_pretrained, train

from test_train import DATA, tiny_recipe

DATA_TEXT = DATA.read_text()

B, S, D, D_T, V = 3, 11, 8, 6, 37  # N = B * (S - 1) = 30 predicted positions


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(B, S, D, generator=g, dtype=dtype, requires_grad=True)
    ws = (torch.randn(V, D, generator=g, dtype=dtype) * 0.7).requires_grad_()
    ht = torch.randn(B, S, D_T, generator=g, dtype=dtype)
    wt = torch.randn(V, D_T, generator=g, dtype=dtype) * 0.7
    ids = torch.randint(0, V, (B, S), generator=g)
    return hs, ws, ht, wt, ids


def _chunked(hs, ws, ht, wt, ids, alpha, t, chunk):
    return head_loss(hs, ws, ids, teacher_hidden=ht, teacher_head=wt, kd_weight=alpha, lm_weight=1 - alpha,
                     temperature=t, chunk=chunk)


def _grads(loss, hs, ws):
    gh, gw = torch.autograd.grad(loss, (hs, ws))
    return loss.detach(), gh, gw


@pytest.mark.parametrize("chunk", [1, 7, 13, 29, 1000])
@pytest.mark.parametrize("alpha, t", [(1.0, 1.0), (1.0, 2.5), (0.5, 1.0), (0.5, 0.7)])
def test_chunked_loss_and_gradients_equal_the_trainer_losses_fp32(chunk, alpha, t):
    hs, ws, ht, wt, ids = _inputs(torch.float32)
    zs, zt = hs @ ws.T, ht @ wt.T  # the whole logits (B, S, V), as the trainer's losses take them
    ref = alpha * distill_loss(zs, zt, t) + (1 - alpha) * lm_loss(zs, ids) if alpha < 1 else distill_loss(zs, zt, t)
    want = _grads(ref, hs, ws)
    got = _grads(_chunked(hs, ws, ht, wt, ids, alpha, t, chunk), hs, ws)
    assert want[0] > 0.1
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def _reference_fp64(hs, ws, ht, wt, ids, alpha, t):
    """The same loss written out directly (no trainer code), in fp64."""
    zs, zt = (hs @ ws.T)[:, :-1].flatten(0, 1), (ht @ wt.T)[:, :-1].flatten(0, 1)
    p_t = F.softmax(zt / t, -1)
    kl = (p_t * (F.log_softmax(zt / t, -1) - F.log_softmax(zs / t, -1))).sum(-1).mean() * t * t
    ce = F.cross_entropy(zs, ids[:, 1:].flatten())
    return alpha * kl + (1 - alpha) * ce


@pytest.mark.parametrize("chunk", [1, 4, 11, 64])
@pytest.mark.parametrize("alpha, t", [(1.0, 2.0), (0.5, 0.5), (0.0, 1.0)])
def test_chunked_loss_and_gradients_are_exact_in_fp64(chunk, alpha, t):
    hs, ws, ht, wt, ids = _inputs(torch.float64, seed=1)
    want = _grads(_reference_fp64(hs, ws, ht, wt, ids, alpha, t), hs, ws)
    got = _grads(_chunked(hs, ws, ht, wt, ids, alpha, t, chunk), hs, ws)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_grad_output_scales_the_stored_gradients_and_the_teacher_gets_none():
    hs, ws, ht, wt, ids = _inputs(torch.float64, seed=2)
    ht.requires_grad_()
    (3.0 * _chunked(hs, ws, ht, wt, ids, 0.5, 2.0, 5)).backward()
    ref_h, ref_w = torch.autograd.grad(3.0 * _reference_fp64(hs, ws, ht.detach(), wt, ids, 0.5, 2.0), (hs, ws))
    torch.testing.assert_close(hs.grad, ref_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ws.grad, ref_w, rtol=1e-10, atol=1e-12)
    assert ht.grad is None


def test_a_frozen_head_gets_no_gradient_and_no_grad_mode_forms_none():
    hs, ws, ht, wt, ids = _inputs(torch.float64, seed=3)
    ws.requires_grad_(False)
    loss = _chunked(hs, ws, ht, wt, ids, 1.0, 1.0, 8)
    (gh,) = torch.autograd.grad(loss, (hs,))
    torch.testing.assert_close(gh, torch.autograd.grad(_reference_fp64(hs, ws, ht, wt, ids, 1.0, 1.0), hs)[0])
    with torch.no_grad():
        value = _chunked(hs, ws, ht, wt, ids, 1.0, 1.0, 8)
    assert not value.requires_grad and float(value) == pytest.approx(float(loss.detach()), rel=1e-12)


def test_bad_arguments_raise():
    hs, ws, ht, wt, ids = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        _chunked(hs, ws, ht, wt, ids, 1.0, 1.0, 0)
    with pytest.raises(ValueError, match="needs teacher_hidden and teacher_head"):
        head_loss(hs, ws, ids, kd_weight=1.0)
    with pytest.raises(ValueError, match="41 vocabulary entries, the student's 37"):
        head_loss(hs, ws, ids, teacher_hidden=ht, teacher_head=torch.zeros(41, D_T), kd_weight=1.0)


class _LargestTensor(TorchDispatchMode):
    """Records the largest element count of any tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("bf16", [False, True])
def test_no_tensor_of_all_positions_by_the_vocabulary_is_formed(bf16):
    """Forward and backward never form a (N, V) tensor: the largest is one chunk's (chunk, V) or the head (V, d)."""
    b, s, d, v, chunk = 4, 65, 16, 1000, 24  # N = 256 positions; N * V = 256,000 > chunk * V, V * d
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(b, s, d, generator=g, requires_grad=True)
    ws = torch.randn(v, d, generator=g, requires_grad=True)
    ht, wt = torch.randn(b, s, d, generator=g), torch.randn(v, d, generator=g)
    ids = torch.randint(0, v, (b, s), generator=g)
    mode = _LargestTensor()
    with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _chunked(hs, ws, ht, wt, ids, 0.5, 2.0, chunk).backward()
    assert mode.largest == chunk * v
    assert hs.grad is not None and ws.grad is not None
    whole = _LargestTensor()
    with whole:  # the whole-logit loss does form them: the check can fail
        distill_loss(hs @ ws.T, ht @ wt.T, 2.0).backward()
    assert whole.largest >= (b * (s - 1)) * v


def test_bf16_autocast_matches_the_whole_logit_loss_under_autocast():
    """Inside bf16 autocast the products run in bf16 as nn.Linear's would: the same loss as the trainer's path."""
    hs, ws, ht, wt, ids = _inputs(torch.float32, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _grads(_chunked(hs, ws, ht, wt, ids, 0.5, 2.0, 7), hs, ws)
        zs, zt = F.linear(hs, ws), F.linear(ht, wt)
        want = _grads(0.5 * distill_loss(zs, zt, 2.0) + 0.5 * lm_loss(zs, ids), hs, ws)
    assert zs.dtype == torch.bfloat16
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for w, g in zip(want[1:], got[1:]):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-3)


# ---------------------------------------------------------------------------------------------- the heal step


def _whole_logit_step(student, teacher, ids, alpha, t, hidden_weight, lr, eps):
    """One step as the trainer took it before the chunked loss: whole logits, AdamW (no weight decay)."""
    hidden = hidden_weight > 0
    out = student(input_ids=ids, use_cache=False, output_hidden_states=hidden or None)
    with torch.no_grad():
        t_out = teacher(input_ids=ids, use_cache=False, output_hidden_states=hidden or None)
    kd = distill_loss(out.logits, t_out.logits, t)
    if hidden:
        kd = kd + hidden_weight * hidden_loss(out.hidden_states, t_out.hidden_states)
    loss = kd if alpha == 1 else (1 - alpha) * lm_loss(out.logits, ids) + alpha * kd
    loss.backward()
    torch.optim.AdamW(student.parameters(), lr=lr, betas=(0.9, 0.95), eps=eps, weight_decay=0.0).step()
    return float(loss.detach())


@pytest.mark.parametrize("alpha, t, hidden_weight", [(1.0, 1.0, 0.0), (0.5, 2.0, 0.3)])
def test_heal_step_with_the_chunked_loss_matches_the_whole_logit_step(tmp_path, monkeypatch, alpha, t, hidden_weight):
    first = train(recipe_from_dict(tiny_recipe(tmp_path, "a", train={"max_steps": 2})))
    teacher = train(recipe_from_dict(tiny_recipe(tmp_path, "b", seed=5, train={"max_steps": 3})))
    batches = []
    loader = trainer_module.micro_batch_loader

    def recording_loader(*args, **kwargs):
        for batch in loader(*args, **kwargs):
            batches.append(batch.clone())
            yield batch

    monkeypatch.setattr(trainer_module, "micro_batch_loader", recording_loader)
    lr, eps = 0.05, 1e-2  # a large eps: the first AdamW step is smooth in the gradient (not ~ lr * sign(g))
    heal = tiny_recipe(tmp_path, "heal", train={"max_steps": 1, "precision": "fp32"},
                       optim={"lr": lr, "min_lr": lr, "warmup_steps": 0, "decay": "constant", "weight_decay": 0.0,
                              "eps": eps, "betas": [0.9, 0.95], "grad_clip": None},
                       distill={"teacher": str(teacher.final_dir), "alpha": alpha, "temperature": t,
                                "hidden_weight": hidden_weight})
    del heal["model"], heal["tokenizer"]
    heal["init_from"] = str(first.final_dir)
    healed = train(recipe_from_dict(heal))

    student, _ = load_pretrained(str(first.final_dir), with_tokenizer=False)
    source, _ = load_pretrained(str(teacher.final_dir), with_tokenizer=False)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    want = _whole_logit_step(student.train(), source.eval(), batches[0].long(), alpha, t, hidden_weight, lr, eps)
    got, _ = load_pretrained(str(healed.final_dir), with_tokenizer=False)
    assert healed.losses[0] == pytest.approx(want, rel=1e-5) and want > 0.01
    moved = 0.0
    for name, value in student.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
        moved = max(moved, float((value - before[name]).abs().max()))
    assert moved > 1e-3  # the step changed the weights
    assert math.isfinite(healed.eval_loss)


# ---------------------------------------------------------------------------------------------- the teacher's top k


def _top_reference(hs, ws, ht, wt, ids, alpha, t, k):
    """The top-k + rest KL written out directly (autograd, fp64): the distributions collapsed onto the teacher's
    k most likely entries and one entry for the rest."""
    zs, zt = (hs @ ws.T)[:, :-1], (ht @ wt.T)[:, :-1]
    t_logp, idx = F.log_softmax(zt / t, -1).topk(k, -1)
    s_logp = F.log_softmax(zs / t, -1).gather(-1, idx)
    p_top, r_t = t_logp.exp(), (1 - t_logp.exp().sum(-1)).clamp_min(0)
    r_s = (1 - s_logp.exp().sum(-1)).clamp_min(1e-300)  # k = V: r_t = 0 and xlogy(0, .) = 0
    kl = (p_top * (t_logp - s_logp)).sum(-1) + torch.xlogy(r_t, r_t) - torch.xlogy(r_t, r_s)
    ce = F.cross_entropy(zs.flatten(0, 1), ids[:, 1:].flatten())
    return alpha * kl.mean() * t * t + (1 - alpha) * ce, (idx.int(), t_logp)


@pytest.mark.parametrize("k", [1, 5, V])
@pytest.mark.parametrize("alpha, t, chunk", [(1.0, 1.0, 7), (0.5, 2.0, 4), (0.3, 0.7, 1000)])
def test_top_k_loss_and_gradients_equal_the_written_out_formula_fp64(k, alpha, t, chunk):
    hs, ws, ht, wt, ids = _inputs(torch.float64, seed=6)
    ref, top = _top_reference(hs, ws, ht, wt, ids, alpha, t, k)
    want = _grads(ref, hs, ws)
    got = _grads(head_loss(hs, ws, ids, teacher_top=top, kd_weight=alpha, lm_weight=1 - alpha, temperature=t,
                           chunk=chunk), hs, ws)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_top_k_of_the_whole_vocabulary_is_the_whole_kl():
    hs, ws, ht, wt, ids = _inputs(torch.float64, seed=7)
    top = teacher_topk(ht, wt, V, temperature=1.5, chunk=6)
    full = _grads(_chunked(hs, ws, ht, wt, ids, 0.5, 1.5, 9), hs, ws)
    got = _grads(head_loss(hs, ws, ids, teacher_top=top, kd_weight=0.5, lm_weight=0.5, temperature=1.5, chunk=9),
                 hs, ws)
    for w, g in zip(full, got):  # the cached log-probabilities are fp32: their rounding, ~1e-7 relative per entry
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    k = 4
    idx, logp = teacher_topk(ht, wt, k, temperature=1.5, chunk=6)
    want_logp, want_idx = F.log_softmax((ht @ wt.T)[:, :-1] / 1.5, -1).topk(k, -1)
    assert idx.shape == (B, S - 1, k) and idx.dtype == torch.int32 and logp.dtype == torch.float32
    assert torch.equal(idx.long(), want_idx)
    torch.testing.assert_close(logp, want_logp.float())
    with pytest.raises(ValueError, match=r"k must be in \[1, 37\]"):
        teacher_topk(ht, wt, V + 1)


def _short_text(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(DATA_TEXT[:700])  # 21 blocks of 33 bytes: 5 steps of 4 blocks an epoch
    return str(path)


def _heal(tmp_path, name, student, teacher, text, **distill):
    heal = tiny_recipe(tmp_path, name, train={"max_steps": 12, "precision": "fp32"},
                       data={"train": text, "eval_tokens": 66},
                       optim={"lr": 1e-3, "min_lr": 1e-3, "warmup_steps": 0, "decay": "constant"},
                       distill={"teacher": str(teacher.final_dir), "alpha": 0.7, "temperature": 2.0, **distill})
    del heal["model"], heal["tokenizer"]
    heal["init_from"] = str(student.final_dir)
    return train(recipe_from_dict(heal))


def test_a_heal_with_the_cached_top_k_of_the_whole_vocabulary_takes_the_same_steps(tmp_path, monkeypatch):
    """teacher_topk = V is the whole KL: the same losses as the uncached heal; each block's teacher pass runs once
    (the second and third epochs read the cache)."""
    first = train(recipe_from_dict(tiny_recipe(tmp_path, "a", train={"max_steps": 2})))
    teacher = train(recipe_from_dict(tiny_recipe(tmp_path, "b", seed=5, train={"max_steps": 3})))
    text = _short_text(tmp_path)
    caches = []

    class Recording(trainer_module.TeacherTopCache):
        def __init__(self):
            super().__init__()
            caches.append(self)

    monkeypatch.setattr(trainer_module, "TeacherTopCache", Recording)
    full = _heal(tmp_path, "full", first, teacher, text)
    assert not caches
    vocab = load_pretrained(str(teacher.final_dir), with_tokenizer=False)[0].config.vocab_size
    cached = _heal(tmp_path, "cached", first, teacher, text, teacher_topk=vocab)
    # two fp32 formulas of one KL, 12 steps apart from the same start: equal up to rounding that steps compound
    assert cached.losses == pytest.approx(full.losses, rel=3e-5)
    (cache,) = caches
    assert cache.misses == len(cache) and cache.hits + cache.misses == 12 * 4 and cache.hits > cache.misses
    topk = _heal(tmp_path, "top8", first, teacher, text, teacher_topk=8)
    assert topk.losses[0] != pytest.approx(full.losses[0], rel=1e-6)  # k < V is an approximation: it can differ


def test_teacher_topk_is_checked():
    base = {"output_dir": "x", "init_from": "y", "data": {"train": "z"}}
    with pytest.raises(RecipeError, match="distill.teacher_topk: must be >= 0"):
        recipe_from_dict({**base, "distill": {"teacher": "t", "teacher_topk": -1}})
    with pytest.raises(RecipeError, match="set one of them to 0"):
        recipe_from_dict({**base, "distill": {"teacher": "t", "teacher_topk": 8, "hidden_weight": 0.1}})


def test_a_heal_step_in_micro_batches_of_one_block_is_the_step_of_whole_batches(tmp_path):
    """The heal recipe's 4 blocks a step in micro-batches of 1, 2 or 4 (the chunked loss is each micro-batch's mean;
    grad_accum averages equal micro-batches): the same steps, up to the order of the sums."""
    first = train(recipe_from_dict(tiny_recipe(tmp_path, "a", train={"max_steps": 2})))
    teacher = train(recipe_from_dict(tiny_recipe(tmp_path, "b", seed=5, train={"max_steps": 3})))
    text = _short_text(tmp_path)
    runs = {}
    for batch in (4, 2, 1):
        heal = tiny_recipe(tmp_path, f"heal{batch}", data={"train": text, "eval_tokens": 66},
                           train={"max_steps": 6, "precision": "fp32", "batch_size": batch, "grad_accum": 4 // batch,
                                  "trainable": ["model.layers.*", "model.norm.*"]},
                           optim={"lr": 1e-3, "min_lr": 1e-3, "warmup_steps": 0, "decay": "constant"},
                           distill={"teacher": str(teacher.final_dir), "alpha": 1.0, "temperature": 1.0})
        del heal["model"], heal["tokenizer"]
        heal["init_from"] = str(first.final_dir)
        runs[batch] = train(recipe_from_dict(heal)).losses
    assert runs[2] == pytest.approx(runs[4], rel=1e-5) and runs[1] == pytest.approx(runs[4], rel=1e-5)
    assert len(set(runs[4])) == 6  # the steps change the model


# ---------------------------------------------------------------------------------------------- the training LM loss


def _tiny_tlm(vocab: int, seed: int = 0) -> TLMForCausalLM:
    torch.manual_seed(seed)
    return TLMForCausalLM(TLMConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, intermediate_size=32, max_position_embeddings=160,
                                    tie_word_embeddings=False)).train()


def test_the_training_lm_loss_is_the_cross_entropy_of_the_logits_in_value_and_gradient():
    """next_token_loss (chunked from the final hidden states) against lm_loss of the whole logits, tiny fp32 model:
    the loss and every parameter's gradient (head and blocks)."""
    model = _tiny_tlm(vocab=97)
    ids = torch.randint(0, 97, (3, 130), generator=torch.Generator().manual_seed(1))  # N = 387: two CPU chunks
    want = lm_loss(model(input_ids=ids, use_cache=False).logits, ids)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    got = next_token_loss(model, model, ids)
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for (name, _), g, w in zip(model.named_parameters(), got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=name)


def test_a_training_step_never_holds_the_whole_vocabulary_logits():
    """Forward and backward of the training loss form at most one chunk's (chunk, V) logits; the whole-logit loss
    forms (B, S, V) ones (so the check can fail)."""
    vocab, b, s = 3000, 4, 129  # N = 512 positions > the CPU chunk (256); N x V > every weight
    model = _tiny_tlm(vocab)
    ids = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(2))
    chunked = _LargestTensor()
    with chunked:
        next_token_loss(model, model, ids).backward()
    assert chunked.largest == default_chunk("cpu") * vocab == HEAD_CHUNK * vocab
    whole = _LargestTensor()
    with whole:
        lm_loss(model(input_ids=ids, use_cache=False).logits, ids).backward()
    assert whole.largest >= b * (s - 1) * vocab
    assert default_chunk("cuda") == GPU_HEAD_CHUNK > HEAD_CHUNK  # the device policy of the same code


def test_tlm_train_takes_the_steps_of_the_whole_logit_loss(tmp_path, monkeypatch):
    """A from-scratch run with the chunked LM loss and the same run with the whole-logit loss the trainer used
    before: the same losses and weights, up to the order of the sums."""
    chunked = train(recipe_from_dict(tiny_recipe(tmp_path, "chunked", train={"max_steps": 4})))

    def whole_logits(forward, model, ids):
        return lm_loss(forward(input_ids=ids, use_cache=False).logits, ids)

    monkeypatch.setattr(trainer_module, "next_token_loss", whole_logits)
    whole = train(recipe_from_dict(tiny_recipe(tmp_path, "whole", train={"max_steps": 4})))
    assert chunked.losses == pytest.approx(whole.losses, rel=1e-5) and len(set(whole.losses)) == 4
    for (name, a), b in zip(chunked.model.state_dict().items(), whole.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
