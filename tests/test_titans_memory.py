"""Numerics of the Titans neural long-term memory (tlm/titans.py); design doc §4.3 and §5 (items 3, 4, 5).

Tiny odd sizes (hidden 24, H_m 3, d_m 5, N 23, b 4) so chunk edges, a final partial chunk and mid-chunk splits
are all exercised; fp32 unless a test says otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from tlm.titans import (
    NeuralMemory,
    join_weights,
    loss_grad_factors,
    memory_reference,
    memory_scan,
    memory_shapes,
    mlp_apply,
    segment_coefficients,
    split_weights,
)

HIDDEN, HEADS, HEAD_DIM, N_TOK, CHUNK = 24, 3, 5, 23, 4
ATOL = 1e-5




def make_memory(depth=2, chunk_size=CHUNK, seed=0, surprise_clip=None, dtype=torch.float32, **kw) -> NeuralMemory:
    """A memory with every gate active and non-trivial convs (the default init makes the convs identities)."""
    torch.manual_seed(seed)
    mem = NeuralMemory(HIDDEN, HEADS, HEAD_DIM, depth=depth, chunk_size=chunk_size, surprise_clip=surprise_clip, **kw)
    with torch.no_grad():
        for proj, bias in ((mem.lr_proj, 0.0), (mem.momentum_proj, 0.5), (mem.decay_proj, -1.5)):
            proj.weight.normal_(0.0, 0.3)  # gates vary per token and per head
            proj.bias.normal_(bias, 0.3)
        for conv in (mem.q_conv, mem.k_conv, mem.v_conv):
            conv.weight.normal_(0.0, 0.5)
            conv.bias.normal_(0.0, 0.1)
        mem.out_norm.weight.normal_(1.0, 0.1)
    return mem.to(dtype)


def make_x(batch=2, n=N_TOK, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, HIDDEN, generator=g).to(dtype)


def assert_state_close(a: dict, b: dict, atol=ATOL):
    assert a["chunk_pos"] == b["chunk_pos"]
    for key in ("memory_start", "memory", "momentum"):
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=1e-5, msg=key)
    for ta, tb in zip(a["conv"], b["conv"]):
        torch.testing.assert_close(ta, tb, atol=atol, rtol=0)


# 1. chunked == sequential reference ------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_chunked_matches_token_loop(depth, clip):
    mem = make_memory(depth=depth, surprise_clip=clip)
    x = make_x()
    out, state = mem(x, use_cache=True)
    ref, ref_state = mem.reference_forward(x)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-5)
    assert_state_close(state, ref_state)
    assert state["chunk_pos"] == N_TOK % CHUNK


def test_surprise_clip_is_active_and_changes_the_result():
    x = make_x()
    inp = make_memory(surprise_clip=0.5).memory_inputs(x)
    start = make_memory(surprise_clip=0.5).initial_state(2, x.device, torch.float32)["memory"]
    factors = loss_grad_factors(split_weights(start, memory_shapes(HEAD_DIM, 2, 2)), inp.k, inp.v)
    norms = sum((g * g).sum(-1) * (z * z).sum(-1) for g, z in factors).sqrt()
    assert (norms > 0.5).any() and (norms < 0.5).any()  # some tokens clipped, some not
    assert not torch.allclose(make_memory(surprise_clip=0.5)(x)[0], make_memory()(x)[0], atol=1e-4)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_closed_form_gradient_matches_autograd(depth):
    torch.manual_seed(0)
    shapes = memory_shapes(HEAD_DIM, depth, 2)
    mats = [torch.randn(2, HEADS, o, n) / math.sqrt(n) for o, n in shapes]
    k, v = torch.randn(2, HEADS, 6, HEAD_DIM), torch.randn(2, HEADS, 6, HEAD_DIM)
    factors = loss_grad_factors(mats, k, v)
    for t in range(6):
        leaves = [m.clone().requires_grad_() for m in mats]
        loss = ((mlp_apply(leaves, k[:, :, t]) - v[:, :, t]) ** 2).sum()  # ‖M(k) − v‖², no ½
        grads = torch.autograd.grad(loss, leaves)
        for (g, z), want in zip(factors, grads):
            torch.testing.assert_close(g[:, :, t, :, None] * z[:, :, t, None, :], want, atol=1e-5, rtol=1e-5)


def test_core_scan_matches_reference_mid_chunk_start():
    """Core functions directly, starting mid-chunk with distinct memory_start / memory / momentum."""
    torch.manual_seed(3)
    shapes = memory_shapes(HEAD_DIM, 2, 2)
    p = sum(o * n for o, n in shapes)
    q, k, v = (F.normalize(torch.randn(2, HEADS, 13, HEAD_DIM), dim=-1) for _ in range(3))
    theta = 0.1 * torch.rand(2, HEADS, 13)
    eta, alpha = torch.rand(2, HEADS, 13), 0.3 * torch.rand(2, HEADS, 13)
    m_start, m_cur, mom = 0.3 * torch.randn(2, HEADS, p), 0.3 * torch.randn(2, HEADS, p), 0.1 * torch.randn(2, HEADS, p)
    y, st = memory_scan(q, k, v, theta, eta.log(), torch.log1p(-alpha), m_start, m_cur, mom, 2, CHUNK, shapes)
    y_ref, st_ref = memory_reference(q, k, v, theta, eta, alpha, m_start, m_cur, mom, 2, CHUNK, shapes)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=1e-5)
    for key in ("memory_start", "memory", "momentum"):
        torch.testing.assert_close(st[key], st_ref[key], atol=ATOL, rtol=1e-5)
    assert st["chunk_pos"] == st_ref["chunk_pos"] == (2 + 13) % CHUNK


# 2. b = 1 is the exact per-token recurrence ----------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2])
def test_chunk_size_one_is_per_token_recurrence(depth):
    """Independent loop: gradient at the current weights M_{t−1} via autograd, then S, M, read after write."""
    mem = make_memory(depth=depth, chunk_size=1)
    x = make_x(batch=1, n=11)
    inp = mem.memory_inputs(x)
    mats = [w.detach().clone()[None] for w in mem.memory_init]  # (1,H,o,n)
    mom = [torch.zeros_like(w) for w in mats]
    eta, alpha = inp.log_eta.exp().detach(), -torch.expm1(inp.log_keep).detach()
    ys = []
    for t in range(x.shape[1]):
        leaves = [w.clone().requires_grad_() for w in mats]
        loss = ((mlp_apply(leaves, inp.k[:, :, t].detach()) - inp.v[:, :, t].detach()) ** 2).sum()
        grads = torch.autograd.grad(loss, leaves)
        th, e, a = (g[:, :, t, None, None] for g in (inp.theta.detach(), eta, alpha))
        mom = [e * s - th * u for s, u in zip(mom, grads)]
        mats = [(1 - a) * w + s for w, s in zip(mats, mom)]
        ys.append(mlp_apply(mats, inp.q[:, :, t].detach()))
    want = mem._readout(torch.stack(ys, dim=2), x.dtype)
    out, state = mem(x, use_cache=True)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(state["memory"], join_weights(mats), atol=ATOL, rtol=1e-5)
    # b = 1: every token starts a chunk, so the chunk-start weights are the current ones
    torch.testing.assert_close(state["memory_start"], state["memory"], atol=0, rtol=0)


def test_linear_memory_closed_form_single_chunk():
    """Design doc §4.3, linear memory, η = 0 (log η = −inf), one chunk:
    Y = diag(β) Q Wᵀ − 2 (T ⊙ Q Kᵀ) E with E = K Wᵀ − V."""
    torch.manual_seed(5)
    shapes = memory_shapes(HEAD_DIM, 1, 2)
    c = 6
    q, k, v = (F.normalize(torch.randn(1, 1, c, HEAD_DIM), dim=-1) for _ in range(3))
    theta, alpha = 0.1 * torch.rand(1, 1, c), 0.2 * torch.rand(1, 1, c)
    w = torch.randn(1, 1, HEAD_DIM, HEAD_DIM) * 0.5
    log_eta = torch.full((1, 1, c), -math.inf)  # η = 0
    y, _ = memory_scan(q, k, v, theta, log_eta, torch.log1p(-alpha), join_weights([w]), join_weights([w]),
                       torch.zeros(1, 1, HEAD_DIM**2), 0, c, shapes)
    beta = torch.cumprod(1 - alpha[0, 0], 0)
    tmat = torch.tril(theta[0, 0][None, :] * beta[:, None] / beta[None, :])  # T[t,i] = θ_i β_t/β_i, i <= t
    qq, kk, vv, ww = q[0, 0], k[0, 0], v[0, 0], w[0, 0]
    err = kk @ ww.T - vv
    want = beta[:, None] * (qq @ ww.T) - 2 * (tmat * (qq @ kk.T)) @ err
    torch.testing.assert_close(y[0, 0], want, atol=ATOL, rtol=1e-5)


# 3. state round trip ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2])
def test_split_calls_equal_one_call(depth):
    mem = make_memory(depth=depth)
    x = make_x()
    full, full_state = mem(x, use_cache=True)
    for split in (1, 3, 4, 5, 8, 13, 22):  # inside a chunk, on an edge, just after an edge
        a, st = mem(x[:, :split], use_cache=True)
        b, st = mem(x[:, split:], state=st, use_cache=True)
        torch.testing.assert_close(torch.cat([a, b], 1), full, atol=ATOL, rtol=1e-5, msg=f"split {split}")
        assert_state_close(st, full_state)
    outs, st = [], None  # three pieces
    for lo, hi in ((0, 6), (6, 7), (7, N_TOK)):
        o, st = mem(x[:, lo:hi], state=st, use_cache=True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=ATOL, rtol=1e-5)
    assert_state_close(st, full_state)


def test_prefill_then_token_by_token_decode():
    mem = make_memory()
    x = make_x()
    full, full_state = mem(x, use_cache=True)
    out, st = mem(x[:, :6], use_cache=True)  # prefill ends inside a chunk
    outs = [out]
    for t in range(6, N_TOK):
        o, st = mem(x[:, t : t + 1], state=st, use_cache=True)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=ATOL, rtol=1e-5)
    assert_state_close(st, full_state)
    assert mem(x)[1] is None  # no state without use_cache
    torch.testing.assert_close(mem(x)[0], full, atol=0, rtol=0)


def test_short_sequence_partial_chunk_is_applied():
    """N < b: the partial chunk must update the memory (and the read sees it)."""
    mem = make_memory(chunk_size=16)
    x = make_x(n=3)
    out, st = mem(x, use_cache=True)
    init = mem.initial_state(2, x.device, torch.float32)
    assert st["chunk_pos"] == 3
    assert not torch.allclose(st["memory"], init["memory"])
    torch.testing.assert_close(st["memory_start"], init["memory"])  # gradient point is still the chunk start
    ys = [mlp_apply(split_weights(init["memory"], mem.shapes), q) for q in mem.memory_inputs(x).q.unbind(2)]
    read_m0 = mem._readout(torch.stack(ys, 2), x.dtype)  # reads of the un-updated M_0
    assert (out[:, 0] - read_m0[:, 0]).abs().max() > 1e-4


def test_empty_input_keeps_state():
    mem = make_memory()
    x = make_x()
    _, st = mem(x[:, :5], use_cache=True)
    r, st2 = mem(x[:, :0], state=st, use_cache=True)
    assert r.shape == (2, 0, HEADS * HEAD_DIM) and st2 is st


# 4. causality and batch independence ------------------------------------------------------------------------


@pytest.mark.parametrize("t", [0, 2, 3, 4, 7, 11, 21])
def test_causality(t):
    mem = make_memory()
    x = make_x()
    y = mem(x)[0]
    x2 = x.clone()
    x2[:, t + 1] += 3.0 * torch.randn(2, HIDDEN)
    y2 = mem(x2)[0]
    torch.testing.assert_close(y2[:, : t + 1], y[:, : t + 1], atol=1e-6, rtol=0)
    assert (y2[:, t + 1] - y[:, t + 1]).abs().max() > 1e-4


def test_batch_independence():
    mem = make_memory()
    x = make_x(batch=3)
    y = mem(x)[0]
    x2 = x.clone()
    x2[1] = torch.randn(N_TOK, HIDDEN)
    y2 = mem(x2)[0]
    torch.testing.assert_close(y2[[0, 2]], y[[0, 2]], atol=1e-6, rtol=0)
    torch.testing.assert_close(mem(x[2:])[0], y[2:], atol=ATOL, rtol=1e-5)  # alone == in a batch


# 5. gradients ----------------------------------------------------------------------------------------------


def test_backward_through_two_chunks_reaches_everything():
    mem = make_memory()
    x = make_x(n=2 * CHUNK).requires_grad_()
    y = mem(x)[0]
    (y * torch.randn_like(y)).sum().backward()
    for name, p in mem.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_gradcheck_float64():
    """Finite differences in float64 (compute dtype follows float64) through a partial second chunk."""
    torch.manual_seed(0)
    mem = NeuralMemory(6, 2, 3, depth=2, chunk_size=3).double()
    with torch.no_grad():
        for proj in (mem.lr_proj, mem.momentum_proj, mem.decay_proj):
            proj.weight.normal_(0.0, 0.5)
    x = torch.randn(1, 5, 6, dtype=torch.float64, requires_grad=True)
    names = ["memory_init.0", "decay_proj.weight", "momentum_proj.bias"]
    params = [dict(mem.named_parameters())[n].detach().clone().requires_grad_() for n in names]

    def fn(x_, *ps):
        return torch.func.functional_call(mem, dict(zip(names, ps)), (x_,))[0]

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-6, rtol=1e-4, fast_mode=True)


def test_gradcheck_core_scan_float64():
    torch.manual_seed(1)
    shapes = memory_shapes(2, 2, 2)
    p = sum(o * n for o, n in shapes)
    d64 = dict(dtype=torch.float64)
    q, k, v = (F.normalize(torch.randn(1, 1, 5, 2, **d64), dim=-1) for _ in range(3))
    theta = (0.1 * torch.rand(1, 1, 5, **d64)).requires_grad_()
    log_eta = torch.rand(1, 1, 5, **d64).log().requires_grad_()
    log_keep = torch.log1p(-0.3 * torch.rand(1, 1, 5, **d64)).requires_grad_()
    memory = (0.5 * torch.randn(1, 1, p, **d64)).requires_grad_()
    mom = (0.1 * torch.randn(1, 1, p, **d64)).requires_grad_()

    def fn(th, le, lk, m, s):
        y, st = memory_scan(q, k, v, th, le, lk, m, m, s, 1, 3, shapes)
        return y, st["memory"], st["momentum"]

    assert torch.autograd.gradcheck(fn, (theta, log_eta, log_keep, memory, mom), eps=1e-6, atol=1e-6, rtol=1e-4)


# 6. log-space decay -----------------------------------------------------------------------------------------


def test_log_space_coefficients_equal_direct_products():
    torch.manual_seed(2)
    c = 7
    eta = torch.rand(2, 3, c, dtype=torch.float64)
    alpha = torch.rand(2, 3, c, dtype=torch.float64) * 0.5
    co = segment_coefficients(eta.log(), torch.log1p(-alpha))
    keep = 1 - alpha

    def prod(x, lo, hi):  # Π x[lo:hi], direct product
        return torch.prod(x[lo:hi]) if hi > lo else torch.tensor(1.0, dtype=x.dtype)

    for b in range(2):
        for h in range(3):
            e, kp = eta[b, h], keep[b, h]
            for i in range(c):
                assert torch.isclose(co.beta[b, h, i], prod(kp, 0, i + 1))
                assert torch.isclose(co.momentum_decay[b, h, i], prod(e, 0, i + 1))
                carry = sum(prod(kp, m + 1, i + 1) * prod(e, 0, m + 1) for m in range(i + 1))
                assert torch.isclose(co.carry[b, h, i], carry)
                for j in range(c):
                    terms = [prod(kp, m + 1, i + 1) * prod(e, j + 1, m + 1) for m in range(j, i + 1)]
                    mix = sum(terms) if j <= i else 0.0
                    mom_mix = prod(e, j + 1, i + 1) if j <= i else 0.0
                    assert torch.isclose(co.mix[b, h, i, j], torch.as_tensor(mix, dtype=torch.float64))
                    assert torch.isclose(co.mom_mix[b, h, i, j], torch.as_tensor(mom_mix, dtype=torch.float64))


def test_log_space_survives_where_cumprod_underflows():
    """fp32, 64 tokens of strong decay: β underflows as a cumprod (ratios 0/0), the log-space ratios do not."""
    c = 64
    log_keep = torch.full((1, 1, c), math.log(1e-3))
    log_eta = torch.full((1, 1, c), math.log(0.5))
    co = segment_coefficients(log_eta, log_keep)
    cum = torch.cumprod(log_keep.exp(), -1)
    assert cum[0, 0, -1] == 0 and torch.isnan(cum[0, 0, -1] / cum[0, 0, -2])  # the naive route fails
    assert torch.isfinite(co.mix).all() and torch.isfinite(co.carry).all()
    torch.testing.assert_close(co.mix[0, 0, -1, -1], torch.tensor(1.0))  # i = j: ratio 1
    torch.testing.assert_close(co.mix[0, 0, -1, -2], torch.tensor(1e-3 + 0.5), rtol=1e-5, atol=0)


# Misc: init, dtype, parameter count --------------------------------------------------------------------------


def test_init_conv_is_identity_and_gate_biases():
    torch.manual_seed(0)
    mem = NeuralMemory(HIDDEN, HEADS, HEAD_DIM)
    x = make_x()
    inp = mem.memory_inputs(x)
    want_q = F.normalize(F.silu(mem.q_proj(x)).view(2, N_TOK, HEADS, HEAD_DIM).transpose(1, 2), dim=-1)
    torch.testing.assert_close(inp.q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(inp.v, F.silu(mem.v_proj(x)).view(2, N_TOK, HEADS, HEAD_DIM).transpose(1, 2))
    assert torch.all(mem.decay_proj.bias == -4.0) and torch.all(mem.lr_proj.bias == 0.0)
    assert 0 < inp.theta.max() <= mem.theta_max


def test_parameter_count_formula():
    for depth, e in ((1, 2), (2, 2), (3, 4)):
        mem = NeuralMemory(HIDDEN, HEADS, HEAD_DIM, depth=depth, expansion=e, conv_kernel=4)
        w = HEADS * HEAD_DIM
        p_w = sum(o * n for o, n in memory_shapes(HEAD_DIM, depth, e))
        want = 3 * HIDDEN * w + 3 * w * (4 + 1) + 3 * (HIDDEN * HEADS + HEADS) + HEADS * p_w + w
        assert sum(p.numel() for p in mem.parameters()) == want
    assert memory_shapes(HEAD_DIM, 2, 2) == [(10, 5), (5, 10)]


def test_bfloat16_input_keeps_fp32_state():
    mem = make_memory()
    x = make_x()
    ref = mem(x)[0]
    mem_bf = make_memory().to(torch.bfloat16)
    out, st = mem_bf(x.to(torch.bfloat16), use_cache=True)
    assert out.dtype == torch.bfloat16 and st["memory"].dtype == torch.float32
    assert (out.float() - ref).abs().max() < 0.25  # bf16 projections only; loose


def test_kernel_one_and_deep_memory_round_trip():
    mem = make_memory(depth=3, conv_kernel=1)
    x = make_x(n=9)
    full, fs = mem(x, use_cache=True)
    a, st = mem(x[:, :5], use_cache=True)
    b, st = mem(x[:, 5:], state=st, use_cache=True)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=ATOL, rtol=1e-5)
    ref, _ = mem.reference_forward(x)
    torch.testing.assert_close(full, ref, atol=1e-4, rtol=1e-4)


def test_autocast_keeps_recurrence_in_fp32():
    mem = make_memory()
    x = make_x()
    ref = mem(x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, st = mem(x, use_cache=True)
    assert out.dtype == torch.float32 and st["memory"].dtype == torch.float32
    assert (out - ref).abs().max() < 0.25  # only the q/k/v projections ran in bf16


def test_titans_mag_trains_finite_at_long_sequences():
    """MAG (persistent tokens, sliding window, normalised branches) at seq 520: finite loss and gradients, and
    a few AdamW steps lower the loss."""
    from conftest import tiny_config

    import tlm

    torch.manual_seed(0)
    config = tiny_config("titans_mag", titans_chunk_size=16, sliding_window=64, max_position_embeddings=600)
    model = tlm.TLMForCausalLM(config).train()
    ids = torch.randint(0, 99, (2, 520), generator=torch.Generator().manual_seed(0))
    ids[:, 1::2] = ids[:, 0::2]  # learnable: every odd token repeats the previous one
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
