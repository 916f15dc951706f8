"""Tests for tlm/cms.py (Continuum Memory System, design/model.md §4.4 and §5). fp32, CPU, tiny odd sizes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from tlm.cms import (
    ContinuumMemory,
    activation_derivative,
    cms_num_params,
    online_level_forward,
    split_level_widths,
)
from tlm.cms import _autograd_derivative  # noqa: PLC2701 (testing the generic fallback)
from tlm.mlp import ACTIVATIONS, GatedMLP

D, I, N, C = 19, 37, 21, 4  # hidden, intermediate, tokens (not a multiple of C), chunk
B = 3
LR = 0.05




@pytest.fixture(autouse=True)
def _fp32_seed():
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    yield
    torch.set_default_dtype(old)


def make(**kw) -> ContinuumMemory:
    args = dict(hidden_size=D, intermediate_size=I, chunk_size=C)
    args.update(kw)
    return ContinuumMemory(**args).eval()


def randomize_norms(cms: ContinuumMemory) -> None:
    with torch.no_grad():
        for n in cms.norms:
            n.weight.uniform_(0.5, 1.5)


def inputs(b: int = B, n: int = N) -> torch.Tensor:
    return torch.randn(b, n, D)


# ---------------------------------------------------------------------------------------------------------------
# 1. widths


@pytest.mark.parametrize("total", [3, 7, 37, 64, 1000, 1153, 4096])
@pytest.mark.parametrize("shares", [(1 / 3, 1 / 3, 1 / 3), (0.5, 0.5), (0.2, 0.3, 0.5), (1.0,), (0.25,) * 4])
@pytest.mark.parametrize("q", [1, 2, 16])
def test_split_level_widths_sum_exactly(total, shares, q):
    floors = [math.floor(s * total / q + 1e-9) * q for s in shares[:-1]]
    if min(floors, default=q) < 1 or total - sum(floors) < 1:  # some level would be empty
        with pytest.raises(ValueError, match=r"allowed: every level >= 1"):
            split_level_widths(total, shares, q)
        return
    widths = split_level_widths(total, shares, q)
    assert sum(widths) == total
    assert len(widths) == len(shares)
    assert all(w >= 1 for w in widths)
    assert all(w % q == 0 for w in widths[:-1])
    for s, w in zip(shares[:-1], widths[:-1]):
        assert s * total - q < w <= s * total + 1e-9


def test_split_level_widths_golden():
    assert split_level_widths(39, (1 / 3, 1 / 3, 1 / 3)) == [13, 13, 13]  # 1/3·39 is 12.999… in floats
    assert split_level_widths(37, (1 / 3, 1 / 3, 1 / 3)) == [12, 12, 13]
    assert split_level_widths(1024, (1 / 3, 1 / 3, 1 / 3), 16) == [336, 336, 352]
    assert split_level_widths(1536, (0.25, 0.25, 0.5), 64) == [384, 384, 768]


@pytest.mark.parametrize(
    "args, match",
    [
        ((37, (0.5, 0.6)), r"shares .* sum to"),
        ((37, (0.5, 0.5 + 1e-3)), r"sum to"),
        ((37, (1.2, -0.2)), r"shares\[1\] = -0.2 is invalid; allowed: finite values > 0"),
        ((37, (1.0, 0.0)), r"shares\[1\] = 0.0"),
        ((37, ()), r"shares = \[\] is invalid"),
        ((0, (1.0,)), r"total = 0 is invalid; allowed: an integer >= 1"),
        ((37, (1.0,), 0), r"multiple_of = 0 is invalid; allowed: an integer >= 1"),
        ((37, (0.01, 0.99)), r"level 0 .* gets width 0 .*allowed: every level >= 1"),
        ((40, (0.3, 0.7), 16), r"level 0 .* gets width 0 from total = 40, multiple_of = 16"),
        ((2, (1 / 3, 1 / 3, 1 / 3)), r"level 0 .* gets width 0"),
    ],
)
def test_split_level_widths_errors(args, match):
    with pytest.raises(ValueError, match=match):
        split_level_widths(*args)


def test_split_level_widths_within_tolerance_accepted():
    assert sum(split_level_widths(37, (0.5, 0.5 + 5e-7))) == 37


# ---------------------------------------------------------------------------------------------------------------
# argument validation


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(modes=("online", "slow", "static")), r"modes\[1\] = 'slow' is invalid; allowed: 'static', 'online'"),
        (dict(modes=("online", "static")), r"modes = .* has 2 entries but shares = .* has 3"),
        (dict(topology="nested"), r"topology = 'nested' is invalid; allowed: 'sum', 'chain'"),
        (dict(chunk_size=0), r"chunk_size = 0 is invalid; allowed: an integer >= 1"),
        (dict(inner_lr=-1e-3), r"inner_lr = -0.001 is invalid; allowed: a finite float >= 0"),
        (dict(update_clip=0.0), r"update_clip = 0.0 is invalid"),
        (dict(hidden_act="tanhh"), r"unknown hidden_act 'tanhh'"),
    ],
)
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_input_and_state_errors():
    cms = make(inner_lr=LR)
    with pytest.raises(ValueError, match=r"x shape = \(2, 5, 7\) is invalid; allowed: \(B, N, 19\)"):
        cms(torch.randn(2, 5, 7))
    _, st = cms(inputs(2, 5), use_cache=True)
    with pytest.raises(ValueError, match=r"batch size = 2; allowed: 3"):
        cms(inputs(3, 1), state=st)
    with pytest.raises(ValueError, match=r"state\['buffer'\]"):
        cms(inputs(2, 1), state={**st, "pos": 4})


# ---------------------------------------------------------------------------------------------------------------
# 2. parameter count


@pytest.mark.parametrize("inter", [3, 37, 64, 101, 1024])
@pytest.mark.parametrize("topology", ["sum", "chain"])
@pytest.mark.parametrize("shares", [(1 / 3, 1 / 3, 1 / 3), (0.5, 0.5), (1.0,)])
def test_param_count(inter, topology, shares):
    modes = ("online",) + ("static",) * (len(shares) - 1)
    cms = ContinuumMemory(D, inter, shares=shares, modes=modes, topology=topology)
    k = len(shares)
    n = sum(p.numel() for p in cms.parameters())
    assert n == 3 * D * inter + ((k - 1) * D if topology == "chain" else 0)
    assert n == cms_num_params(D, inter, k, topology)
    assert sum(cms.widths) == inter
    names = {name for name, _ in cms.named_parameters()}
    assert "levels.0.gate_proj.weight" in names and f"levels.{k - 1}.down_proj.weight" in names
    if topology == "chain":
        assert {f"norms.{i}.weight" for i in range(k - 1)} <= names


def test_widths_with_multiple_of():
    cms = ContinuumMemory(D, 100, shares=(0.25, 0.25, 0.5), multiple_of=8)
    assert cms.widths == [24, 24, 52]
    assert [lvl.gate_proj.out_features for lvl in cms.levels] == [24, 24, 52]


# ---------------------------------------------------------------------------------------------------------------
# 3. sum of static levels == one GatedMLP with the concatenated weights (and upcycling back)


def concat_mlp(cms: ContinuumMemory) -> GatedMLP:
    mlp = GatedMLP(D, I)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(torch.cat([l.gate_proj.weight for l in cms.levels], 0))
        mlp.up_proj.weight.copy_(torch.cat([l.up_proj.weight for l in cms.levels], 0))
        mlp.down_proj.weight.copy_(torch.cat([l.down_proj.weight for l in cms.levels], 1))
    return mlp


@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
def test_sum_of_static_levels_is_gated_mlp(hidden_act):
    cms = make(modes=("static",) * 3, hidden_act=hidden_act)
    mlp = concat_mlp(cms)
    mlp.act_fn = cms.act_fn
    x = inputs()
    y, st = cms(x)
    assert st is None
    torch.testing.assert_close(y, mlp(x), atol=1e-6, rtol=0)


def test_from_gated_mlp_sum_partition_exact():
    mlp = GatedMLP(D, I)
    x = inputs()
    perm = torch.randperm(I)
    for order in (None, perm):
        cms = ContinuumMemory.from_gated_mlp(mlp, unit_order=order, shares=(0.2, 0.3, 0.5),
                                             modes=("online", "static", "static"), chunk_size=C)
        assert cms.widths == split_level_widths(I, (0.2, 0.3, 0.5))
        torch.testing.assert_close(cms(x)[0], mlp(x), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="allowed: a permutation"):
        ContinuumMemory.from_gated_mlp(mlp, unit_order=torch.zeros(I, dtype=torch.long))
    with pytest.raises(ValueError, match="topology = 'chain' is invalid for from_gated_mlp"):
        ContinuumMemory.from_gated_mlp(mlp, topology="chain")


# ---------------------------------------------------------------------------------------------------------------
# 4. chain with zero down_proj on levels >= 2 == level 1 alone


def test_chain_zero_down_equals_level_one():
    cms = make(modes=("static",) * 3, topology="chain")
    randomize_norms(cms)
    with torch.no_grad():
        for lvl in cms.levels[1:]:
            lvl.down_proj.weight.zero_()
    x = inputs()
    assert torch.equal(cms(x)[0], cms.levels[0](x))


def test_chain_matches_formula():
    cms = make(modes=("static",) * 3, topology="chain")
    randomize_norms(cms)
    x = inputs()

    def rms(v, g):
        return g * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)

    u = x + cms.levels[0](x)  # the residual sub-stream starts at the input
    for i in (1, 2):
        u = u + cms.levels[i](rms(u, cms.norms[i - 1].weight))
    torch.testing.assert_close(cms(x)[0], u - x, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# 5. online vs static


@pytest.mark.parametrize("topology", ["sum", "chain"])
def test_online_lr0_equals_static(topology):
    static = make(modes=("static",) * 3, topology=topology)
    randomize_norms(static)
    online = make(modes=("online", "online", "static"), topology=topology, inner_lr=0.0)
    online.load_state_dict(static.state_dict())
    x = inputs()
    assert torch.equal(online(x)[0], static(x)[0])
    y, st = online(x, use_cache=True)
    assert torch.equal(y, static(x)[0])
    assert st["pos"] == N and st["buffer"][0].shape == (B, N % C, D)


def test_online_chunk_loop_at_lr0_equals_static_level():
    """The fast-weight chunk loop itself (not the lr == 0 short-cut) reproduces the static level."""
    cms = make(modes=("online", "static", "static"))
    x = inputs()
    fast = cms.initial_fast_weights(B)[0]
    y, new_fast, buf = online_level_forward(x, fast, None, C, 0.0, 1.0, cms.act_fn, cms.act_grad)
    torch.testing.assert_close(y, cms.levels[0](x), atol=1e-6, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(new_fast, fast))
    assert torch.equal(buf, x[:, N - N % C:])


@pytest.mark.parametrize("topology", ["sum", "chain"])
def test_online_lr_positive_differs_only_after_first_chunk(topology):
    static = make(modes=("static",) * 3, topology=topology)
    randomize_norms(static)
    online = make(modes=("online", "static", "online"), topology=topology, inner_lr=LR)
    assert set(online.load_state_dict(static.state_dict(), strict=False).missing_keys) == {
        f"local_proj.{j}.{n}_proj.weight" for j in (0, 1) for n in "kv"}
    x = inputs()
    ys, yo = static(x)[0], online(x)[0]
    torch.testing.assert_close(yo[:, :C], ys[:, :C], atol=1e-6, rtol=0)
    assert (yo[:, C:] - ys[:, C:]).abs().amax(-1).min() > 1e-4  # every later token of every sample moved


# ---------------------------------------------------------------------------------------------------------------
# 6. cache round trip


def run_split(cms, x, cuts):
    outs, st = [], None
    bounds = [0, *cuts, x.shape[1]]
    for a, b in zip(bounds[:-1], bounds[1:]):
        y, st = cms(x[:, a:b], state=st, use_cache=True)
        outs.append(y)
    return torch.cat(outs, 1), st


@pytest.mark.parametrize("topology", ["sum", "chain"])
@pytest.mark.parametrize("lr", [0.0, LR])
def test_cache_round_trip(topology, lr):
    cms = make(modes=("online", "static", "online"), topology=topology, inner_lr=lr)
    randomize_norms(cms)
    x = inputs()
    full, st_full = cms(x, use_cache=True)
    assert st_full["pos"] == N
    for cuts in ([1], [3], [4], [5], [13], [20], [2, 3, 9, 10, 17], [0, 8, 8], list(range(1, N))):
        got, st = run_split(cms, x, cuts)
        torch.testing.assert_close(got, full, atol=1e-5, rtol=0)
        assert st["pos"] == N
        for f_split, f_full in zip(st["fast"], st_full["fast"]):
            for a, b in zip(f_split, f_full):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        for b_split, b_full in zip(st["buffer"], st_full["buffer"]):
            torch.testing.assert_close(b_split, b_full, atol=1e-6, rtol=0)
    # continuing from a cached prefix == the longer sequence in one call (buffered partial chunk gets applied)
    x2 = torch.cat([x, inputs(B, 7)], 1)
    y_next, st_next = cms(x2[:, N:], state=st_full, use_cache=True)
    torch.testing.assert_close(torch.cat([full, y_next], 1), cms(x2)[0], atol=1e-5, rtol=0)
    assert st_next["buffer"] is None and st_next["pos"] == N + 7  # 28 is a multiple of C


def test_state_without_online_levels():
    cms = make(modes=("static",) * 3)
    x = inputs()
    y, st = cms(x[:, :5], use_cache=True)
    assert st == {"fast": (), "buffer": None, "pos": 5}
    y2, st = cms(x[:, 5:], state=st, use_cache=True)
    torch.testing.assert_close(torch.cat([y, y2], 1), cms(x)[0], atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# 7. chunk loop == a plain per-sample, per-chunk python reference with autograd gradients


def reference_online(level, proj, x, chunk, lr, clip, act):
    """Per sample, per complete chunk: read with pre-chunk weights, then θ -= clip(lr·∇ Σ ½‖MLP(k)−v‖²) with
    k = x W_kᵀ, v = x W_vᵀ (the local rule), by autograd."""
    outs = []
    with torch.enable_grad():
        return _reference_online(level, proj, x, chunk, lr, clip, act, outs)


def _reference_online(level, proj, x, chunk, lr, clip, act, outs):
    for b in range(x.shape[0]):
        theta = [level.gate_proj.weight.detach().clone(), level.up_proj.weight.detach().clone(),
                 level.down_proj.weight.detach().clone()]
        ys = []
        for start in range(0, x.shape[1], chunk):
            xc = x[b, start:start + chunk]  # (n, d)
            th = [t.clone().requires_grad_(True) for t in theta]
            y = F.linear(act(F.linear(xc, th[0])) * F.linear(xc, th[1]), th[2])
            ys.append(y.detach())
            if xc.shape[0] < chunk:
                break
            k, v = F.linear(xc, proj.k_proj.weight), F.linear(xc, proj.v_proj.weight)
            yk = F.linear(act(F.linear(k, th[0])) * F.linear(k, th[1]), th[2])
            loss = 0.5 * (yk - v).pow(2).sum()
            grads = torch.autograd.grad(loss, th)
            steps = [lr * g for g in grads]
            norm = math.sqrt(sum(float(s.pow(2).sum()) for s in steps))
            if clip is not None and norm > clip:
                steps = [s * (clip / norm) for s in steps]
            theta = [t - s for t, s in zip(theta, steps)]
        outs.append(torch.cat(ys, 0))
    return torch.stack(outs, 0)


@pytest.mark.parametrize("hidden_act", ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("clip", [None, 1.0, 1e-3])
def test_online_matches_reference_loop(hidden_act, clip):
    cms = make(modes=("online", "static", "static"), inner_lr=LR, update_clip=clip, hidden_act=hidden_act)
    x = inputs()
    with torch.no_grad():
        got = cms(x)[0]
        expect = reference_online(cms.levels[0], cms.local_proj[0], x, C, LR, clip, cms.act_fn) + cms.levels[1](x) + cms.levels[2](x)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    # the clip matters: tight clip, no clip and a static level all differ
    if clip == 1e-3:
        unclipped = make(modes=("online", "static", "static"), inner_lr=LR, update_clip=None, hidden_act=hidden_act)
        unclipped.load_state_dict(cms.state_dict())  # same levels and projections
        with torch.no_grad():
            assert (unclipped(x)[0] - got)[:, C:].abs().max() > 1e-3


def test_clip_bounds_update_norm():
    cms = make(modes=("online", "static", "static"), inner_lr=10.0, update_clip=0.5)
    x = inputs() * 100
    with torch.no_grad():
        _, st = cms(x[:, :C], use_cache=True)
    init = cms.initial_fast_weights(B)[0]
    sq = sum((a - b).pow(2).sum(dim=(1, 2)) for a, b in zip(st["fast"][0], init))
    torch.testing.assert_close(sq.sqrt(), torch.full((B,), 0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_derivatives(name):
    a = torch.linspace(-6, 6, 241, dtype=torch.float64) + 1e-3
    ref = _autograd_derivative(ACTIVATIONS[name])(a)
    torch.testing.assert_close(activation_derivative(name)(a), ref, atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------------------------------------------------------
# 8. causality and batch independence


@pytest.mark.parametrize("topology", ["sum", "chain"])
def test_causality(topology):
    cms = make(modes=("static", "online", "online"), topology=topology, inner_lr=LR)
    randomize_norms(cms)
    x = inputs()
    with torch.no_grad():
        y = cms(x)[0]
        for t in (0, 2, 3, 4, 7, 8, 11, 15, 19):
            xp = x.clone()
            xp[:, t + 1:] += torch.randn_like(xp[:, t + 1:]) * 3
            yp = cms(xp)[0]
            assert torch.equal(yp[:, :t + 1], y[:, :t + 1]), t
            assert (yp[:, t + 1:] - y[:, t + 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("topology", ["sum", "chain"])
def test_batch_independence(topology):
    cms = make(modes=("online", "static", "online"), topology=topology, inner_lr=LR)
    randomize_norms(cms)
    x = inputs()
    with torch.no_grad():
        y = cms(x)[0]
        xp = x.clone()
        xp[1] = torch.randn_like(xp[1]) * 3
        yp = cms(xp)[0]
        torch.testing.assert_close(yp[[0, 2]], y[[0, 2]], atol=1e-6, rtol=0)
        assert (yp[1] - y[1]).abs().max() > 1e-3
        # each sample alone == that sample in the batch
        for b in range(B):
            torch.testing.assert_close(cms(x[b:b + 1])[0], y[b:b + 1], atol=1e-5, rtol=0)


def test_low_precision_inputs_keep_fp32_fast_weights():
    cms = make(modes=("online", "static", "static"), inner_lr=LR)
    x = inputs()
    ref = cms(x)[0]
    y, st = cms.to(torch.bfloat16)(x.to(torch.bfloat16), use_cache=True)
    assert y.dtype == torch.bfloat16
    assert all(w.dtype == torch.float32 for w in st["fast"][0]) and st["buffer"][0].dtype == torch.float32
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=0.05)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, st = cms.float()(x, use_cache=True)
    assert all(w.dtype == torch.float32 for w in st["fast"][0])


# ---------------------------------------------------------------------------------------------------------------
# 9. backward


@pytest.mark.parametrize("topology", ["sum", "chain"])
def test_backward_reaches_every_parameter(topology):
    cms = make(modes=("online", "static", "online"), topology=topology, inner_lr=LR).train()
    x = inputs().requires_grad_(True)
    y = cms(x)[0]
    (y.pow(2).mean()).backward()
    for name, p in cms.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()


def test_backward_through_fast_weight_updates():
    """Outer gradients flow through the updates: the loss on tokens after the first chunk depends on the
    online level's initial weights through both the read and the update; check against finite differences."""
    cms = make(modes=("online", "static", "static"), inner_lr=LR, update_clip=None).double()
    x = torch.randn(2, 9, D, dtype=torch.float64)
    w = cms.levels[0].down_proj.weight

    def loss():
        return (cms(x)[0][:, C:] ** 2).sum()

    loss().backward()
    g = w.grad[0, 0].item()
    eps = 1e-6
    with torch.no_grad():
        w[0, 0] += eps
        lp = loss().item()
        w[0, 0] -= 2 * eps
        lm = loss().item()
        w[0, 0] += eps
    assert g == pytest.approx((lp - lm) / (2 * eps), rel=1e-5, abs=1e-7)
