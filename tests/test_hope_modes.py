"""Hope's level modes: parsing, slow(m) through the outer optimiser (with a mid-cycle resume), local-rule params."""

import copy

import pytest
import torch
from conftest import make_model, tiny_config

import tlm
from tlm.cms import ContinuumMemory, cms_num_params, parse_mode
from tlm.slow import SlowLevels




def test_parse_mode():
    assert parse_mode("static") == ("static", None)
    assert parse_mode("online") == ("online", None)
    assert parse_mode("slow(4)") == ("slow", 4)
    for bad in ("slow(0)", "slow", "fast", "slow(-1)"):
        with pytest.raises(ValueError, match="slow\\(m\\)"):
            parse_mode(bad)


def test_config_accepts_slow_and_names_bad_modes():
    cfg = tiny_config("hope_attention", hope_level_modes=["online", "slow(3)", "static"])
    assert tlm.TLMForCausalLM(cfg).model.layers[0].mlp.slow_every == {1: 3}
    with pytest.raises(ValueError, match="hope_level_modes has \\['slow\\(0\\)'\\]"):
        tiny_config("hope_attention", hope_level_modes=["online", "slow(0)", "static"])


def test_local_rule_projections_only_with_positive_inner_lr():
    for lr, n_proj in ((0.0, 0), (0.1, 2)):
        cms = ContinuumMemory(19, 37, modes=("online", "static", "online"), topology="chain", inner_lr=lr)
        assert sum(p.numel() for p in cms.parameters()) == cms_num_params(19, 37, 3, "chain", n_proj)


def _train(model, opt, slow, ids, steps, start=0, grads=None):
    for step in range(start, start + steps):
        model(ids, labels=ids, use_cache=False).loss.backward()
        if grads is not None:
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if ".levels.1." in n})
        slow.before_step(opt, step)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_slow_level_steps_every_m_on_the_mean_gradient(ids):
    model = make_model("hope_attention", hope_level_modes=["online", "slow(3)", "static"], hope_inner_lr=0.0).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    slow = SlowLevels(model)
    assert len(slow.params) == 3 * 3  # gate, up, down of level 1 in each of 3 layers
    history, grads = [], []
    snapshot = lambda: {n: p.detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    for step in range(7):
        history.append(snapshot())
        _train(model, opt, slow, ids, 1, start=step, grads=grads)
    history.append(snapshot())
    for name in grads[0]:
        moved = [not torch.equal(history[s][name], history[s + 1][name]) for s in range(7)]
        assert moved == [True, False, False, True, False, False, True], name
        expect = history[1][name] - 0.5 * sum(grads[s][name] for s in (1, 2, 3)) / 3  # step 3: mean of 1..3
        torch.testing.assert_close(history[4][name], expect, atol=1e-6, rtol=0)
    other = [n for n, _ in model.named_parameters() if ".levels.0." in n][0]
    assert not torch.equal(history[1][other], history[2][other])  # ordinary levels step every time


def test_slow_level_resume_mid_cycle_continues_the_sums(ids):
    torch.manual_seed(0)
    model = make_model("hope_attention", hope_level_modes=["online", "slow(3)", "static"], hope_inner_lr=0.0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    slow = SlowLevels(model)
    _train(model, opt, slow, ids, 5)  # steps 0..4: mid-cycle (sum of steps 4 held)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, slow, ids, 3, start=5)
    resumed = make_model("hope_attention", hope_level_modes=["online", "slow(3)", "static"], hope_inner_lr=0.0).train()
    resumed.load_state_dict(saved_model)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    opt2.load_state_dict(saved_opt)
    _train(resumed, opt2, SlowLevels(resumed), ids, 3, start=5)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(b, a, atol=0, rtol=0, msg=name)
