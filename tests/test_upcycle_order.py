"""Hope upcycling keeps the importance order through a taper; level widths honour multiple_of."""

import pytest
import torch
from conftest import tiny_config

import tlm
from tlm_convert.upcycle import carry_scores, upcycle


def test_carry_scores_follows_kept_neurons_and_puts_grown_last():
    score = torch.tensor([5.0, 1.0, 3.0, 4.0])
    out = carry_scores(score, keep=[0, 2, 3], grow=2)
    assert out[:3].tolist() == [5.0, 3.0, 4.0] and torch.isneginf(out[3:]).all()


def test_tapered_hope_upcycle_sends_top_neurons_to_the_slowest_level():
    torch.manual_seed(0)
    config = tiny_config("attention", intermediate_sizes=[40, 30, 20], intermediate_size=30)
    state = tlm.TLMForCausalLM(config).state_dict()
    widths = config.intermediate_sizes
    # layer 0 grew from 36 source neurons by 4, the others shrank: scores come at the source width
    source = [torch.rand(36), torch.rand(45), torch.rand(25)]
    keeps = [(list(range(36)), 4), (sorted(torch.randperm(45)[:30].tolist()), 0), (list(range(20)), 0)]
    scores = [carry_scores(s, k, g) for s, (k, g) in zip(source, keeps)]
    new_config, out = upcycle(config, state, "hope_attention", scores)
    for i, (w, (keep, grow)) in enumerate(zip(widths, keeps)):
        last = new_config.hope_level_shares[-1]
        down = state[f"model.layers.{i}.mlp.down_proj.weight"]  # (d, w): resized layout, kept then grown
        top = torch.sort(scores[i], descending=True, stable=True).indices[: w - 2 * int(w / 3)]
        got = out[f"model.layers.{i}.mlp.levels.2.down_proj.weight"]
        assert got.shape[1] == len(top) and last > 0
        torch.testing.assert_close(got, down[:, top.sort().values])
        if grow:  # grown neurons (scored -inf) land in the fastest level
            level0 = out[f"model.layers.{i}.mlp.levels.0.down_proj.weight"]
            assert any(torch.equal(level0[:, j], down[:, w - 1]) for j in range(level0.shape[1]))


def test_upcycle_refuses_scores_at_the_wrong_width():
    config = tiny_config("attention")
    state = tlm.TLMForCausalLM(config).state_dict()
    with pytest.raises(ValueError, match="carry_scores"):
        upcycle(config, state, "hope_attention", [torch.rand(99)] * 3)


def test_level_widths_honour_multiple_of():
    config = tlm.TLMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                           intermediate_size=1024, schedule="cosine", multiple_of=16, mixer="hope_attention")
    model = tlm.TLMForCausalLM(config)
    assert config.intermediate_sizes[2] == 1184
    assert model.model.layers[2].mlp.widths == [384, 384, 416]
    for layer, width in zip(model.model.layers, config.intermediate_sizes):
        assert sum(layer.mlp.widths) == width and all(w % 16 == 0 for w in layer.mlp.widths)


def test_a_layer_too_narrow_for_multiple_of_is_split_exactly():
    """cosine over 64 with multiple_of 16 gives a 32-wide last layer: three levels of 16 do not fit, so that layer
    is split without rounding (the wide layer keeps multiples of 16)."""
    config = tlm.TLMConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, schedule="cosine", multiple_of=16, mixer="hope_attention")
    model = tlm.TLMForCausalLM(config)
    wide, narrow = (layer.mlp.widths for layer in model.model.layers)
    assert config.intermediate_sizes == [96, 32]
    assert all(w % 16 == 0 for w in wide) and sum(wide) == 96
    assert narrow == [10, 10, 12]
