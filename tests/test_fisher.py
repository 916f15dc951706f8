"""Importance ``fisher``: the hooks' mask-gradient Fisher equals the Fisher of an explicit mask parameter, and a
conversion ranked by it keeps the parameter count, reloads strictly and is refused under --low-memory;
``--schedule measured``: widths from the Fisher removal-cost profile at the same parameter count."""

import pytest
import torch
from tiny_sources import DATA, make_source, tiny_tokenizer

from conftest import make_model
from tlm_convert.calibrate import LayerSettings, first_ranked_layer
from tlm_convert.compensate import obs_prune
from tlm_convert.convert import convert
from tlm_convert import convert as convert_module
from tlm_convert import fisher
from tlm_convert.fisher import fisher_scores, top_share_profile
from tlm import measured_widths, taper_widths
from tlm_convert.importance import ActivationStats, neuron_scores, sensitivity
from tlm_convert.options import Method, method_from, options_from
from tlm_io.errors import ConversionError


class _Mask(torch.nn.Module):
    """down_proj(a * m): an explicit mask on the neurons (I,), or on the neurons at each position (S, I), whose
    gradient is the mask gradient."""

    def __init__(self, down, positions: int = 0):
        super().__init__()
        self.down = down
        shape = (positions, down.in_features) if positions else (down.in_features,)
        self.mask = torch.nn.Parameter(torch.ones(shape, dtype=torch.float64))

    def forward(self, a):
        return self.down(a * self.mask.to(a.dtype))


def _reference_fisher(model, blocks, seed, per_position=False):
    """Σ_s (∂ log p(y_s)/∂m)² with one backward pass per sequence, targets drawn as fisher_scores draws them; with
    ``per_position`` a mask per position, its squared gradients summed over the positions."""
    layers = model.model.layers
    masks = [_Mask(layer.mlp.down_proj, blocks.shape[1] if per_position else 0) for layer in layers]
    for layer, mask in zip(layers, masks):
        layer.mlp.down_proj = mask
    for p in model.parameters():
        p.requires_grad_(False)
    for mask in masks:
        mask.mask.requires_grad_(True)
    gen = torch.Generator().manual_seed(seed)
    scores = [torch.zeros(m.mask.shape[-1], dtype=torch.float64) for m in masks]
    for row in blocks:  # one sequence at a time: its own mask gradient
        with torch.enable_grad():
            logits = model(input_ids=row[None], use_cache=False).logits[0]  # (S, V)
            targets = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=gen)  # (S, 1)
            loglik = torch.log_softmax(logits, -1).gather(1, targets).sum()
            grads = torch.autograd.grad(loglik, [m.mask for m in masks])
        for score, grad in zip(scores, grads):
            score += grad.double().pow(2).reshape(-1, len(score)).sum(0)
    return scores


@pytest.mark.parametrize("head_positions", [None, 5])  # the head's gradient in one chunk, or 5 positions at a time
def test_fisher_scores_equal_the_explicit_mask_fisher(monkeypatch, head_positions):
    torch.manual_seed(0)
    model = make_model(seed=1).double().eval()
    if head_positions:
        monkeypatch.setattr(fisher, "HEAD_CHUNK_BYTES", 4 * model.config.vocab_size * head_positions)
    blocks = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    # batch_size 1: the reference draws its targets one sequence at a time from one generator, as this does
    ours = fisher_scores(model, blocks, seed=5, batch_size=1, mask="sequence")
    assert all(p.requires_grad for p in model.parameters())  # left as they were
    ref = _reference_fisher(model, blocks, seed=5)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        assert (a > 0).all()


def test_the_default_token_mask_equals_the_explicit_per_position_mask_fisher_not_the_sequence_mask():
    torch.manual_seed(0)
    model = make_model(seed=1).double().eval()
    blocks = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="mask must be one of token, sequence"):
        fisher_scores(model, blocks, mask="neuron")
    ours = fisher_scores(model, blocks, seed=5, batch_size=1)  # the default mask; the same draws as the reference's
    sequence = fisher_scores(model, blocks, seed=5, batch_size=1, mask="sequence")
    ref = _reference_fisher(model, blocks, seed=5, per_position=True)
    for a, b, seq in zip(ours, ref, sequence):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
        assert not torch.allclose(a, seq)


def test_fisher_scores_are_deterministic_and_batching_only_changes_the_draw():
    model = make_model(seed=1).eval()
    blocks = torch.randint(0, model.config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(2))
    first, again = fisher_scores(model, blocks, seed=3), fisher_scores(model, blocks, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = fisher_scores(model, blocks, seed=4)
    assert any(not torch.equal(a, b) for a, b in zip(first, other))
    assert all(p.grad is None for p in model.parameters())  # no parameter gradients were formed


def test_max_blocks_scores_an_evenly_spread_subset():
    # the calibration sources are concatenated (bundled text, then self samples): the subset takes from each
    model = make_model(seed=1).eval()
    blocks = torch.randint(0, model.config.vocab_size, (7, 10), generator=torch.Generator().manual_seed(2))
    spread = fisher_scores(model, blocks, seed=3, max_blocks=3)
    assert all(torch.equal(a, b) for a, b in zip(spread, fisher_scores(model, blocks[[0, 3, 6]], seed=3)))
    every = fisher_scores(model, blocks, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(every, fisher_scores(model, blocks, seed=3, max_blocks=7)))
    assert any(not torch.equal(a, b) for a, b in zip(every, spread))


def test_seq_len_scores_the_blocks_cut_into_shorter_sequences():
    model = make_model(seed=1).eval()
    blocks = torch.randint(0, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(2))
    cut = fisher_scores(model, blocks, seed=3, seq_len=5)  # the 11th token of every block is dropped
    pieces = blocks[:, :10].reshape(6, 5)  # block 0's two halves, then block 1's, ...
    assert all(torch.equal(a, b) for a, b in zip(cut, fisher_scores(model, pieces, seed=3)))
    whole = fisher_scores(model, blocks, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(whole, fisher_scores(model, blocks, seed=3, seq_len=11)))
    assert any(not torch.equal(a, b) for a, b in zip(whole, cut))


def test_draws_average_backward_passes_of_fresh_targets_over_one_forward():
    model = make_model(seed=1).eval()
    block = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    two = fisher_scores(model, block, seed=3, draws=2)
    # the same block twice, one sequence a pass: the second pass draws where the first left the generator
    twice = fisher_scores(model, torch.cat([block, block]), seed=3, batch_size=1)
    assert all(torch.allclose(a, b / 2, rtol=1e-12, atol=0) for a, b in zip(two, twice))
    one = fisher_scores(model, block, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(one, fisher_scores(model, block, seed=3, draws=1)))
    assert any(not torch.allclose(a, b) for a, b in zip(one, two))
    assert all(p.requires_grad for p in model.parameters())


def test_first_layer_stops_the_backward_there_and_scores_as_a_full_pass():
    model = make_model(seed=1).eval()
    n = model.config.num_hidden_layers
    blocks = torch.randint(0, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(2))
    full = fisher_scores(model, blocks, seed=3)
    reached = []  # the layers whose input is in the graph (gets a gradient)
    hooks = [layer.register_forward_pre_hook(lambda m, args, i=i: reached.append(i) if args[0].requires_grad else None)
             for i, layer in enumerate(model.model.layers)]
    part = fisher_scores(model, blocks, seed=3, first_layer=n - 2)
    for h in hooks:
        h.remove()
    assert part[: n - 2] == [None] * (n - 2) and sorted(set(reached)) == [n - 2, n - 1]
    assert all(torch.equal(a, b) for a, b in zip(full[n - 2 :], part[n - 2 :]))  # a score needs only later layers
    assert all(p.requires_grad for p in model.parameters())


def test_first_ranked_layer_skips_the_leading_growing_layers_unless_their_scores_are_used():
    source = [8, 8, 8, 8]
    settings = LayerSettings(Method(importance="fisher"), 8, 0, scores_needed=False)
    assert first_ranked_layer(source, [12, 10, 6, 4], settings) == 2  # cosine: layers 0-1 grow, keep every neuron
    assert first_ranked_layer(source, [12, 8, 8, 4], settings) == 1  # a kept width is still ranked (its order)
    assert first_ranked_layer(source, [4, 12, 12, 4], settings) == 0  # shrinking first
    split = LayerSettings(Method(grow_init="split"), 8, 0, scores_needed=False)
    assert first_ranked_layer(source, [12, 10, 6, 4], split) == 0
    assert first_ranked_layer(source, [12, 10, 6, 4], LayerSettings(Method(), 8, 0, scores_needed=True)) == 0  # mixer


def test_the_backward_batch_follows_the_memory_budget(monkeypatch):
    model = make_model(seed=1).double().eval()
    blocks = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    per_row = fisher.backward_bytes_per_row(model, 12)
    config = model.config  # the layers' saved activations (the logits are formed a chunk at a time, not kept)
    assert per_row > 12 * 8 * config.num_hidden_layers * (config.hidden_size + max(config.intermediate_sizes))
    one_at_a_time = fisher_scores(model, blocks, seed=5, batch_size=1)
    monkeypatch.setattr(fisher, "BACKWARD_BUDGET", 2 * per_row - 1)  # room for one sequence, not two
    budgeted = fisher_scores(model, blocks, seed=5, batch_size=8)
    assert all(torch.equal(a, b) for a, b in zip(one_at_a_time, budgeted))
    monkeypatch.setattr(fisher, "BACKWARD_BUDGET", 8 * per_row)
    assert any(not torch.equal(a, b) for a, b in zip(one_at_a_time, fisher_scores(model, blocks, seed=5)))


def test_neuron_scores_take_the_whole_model_scores():
    weights = {"down_proj": torch.ones(3, 4)}
    given = torch.tensor([0.5, 2.0, 1.0, 0.0])
    assert torch.equal(neuron_scores("fisher", None, weights, whole_model=given), given.double())
    with pytest.raises(ValueError, match="before the layer loop"):
        neuron_scores("fisher", None, weights)


def test_obs_cost_weights_protect_a_neuron_and_unit_weights_change_nothing():
    gen = torch.Generator().manual_seed(0)
    acts = torch.randn(300, 12, generator=gen) * torch.rand(12, generator=gen)
    gram, down = (acts.T @ acts).double(), torch.randn(5, 12, generator=gen)
    keep, new_down = obs_prune(gram, down, 6)
    same_keep, same_down = obs_prune(gram, down, 6, weights=torch.ones(12, dtype=torch.float64))
    assert keep == same_keep and torch.equal(new_down, same_down)
    first_out = sorted(set(range(12)) - set(keep))[0]
    protected = torch.ones(12, dtype=torch.float64)
    protected[first_out] = 1e9
    assert first_out in obs_prune(gram, down, 6, weights=protected)[0]


def test_sensitivity_is_fisher_per_unit_of_output_energy():
    stats = ActivationStats(3)
    stats.update(torch.tensor([[[1.0, 2.0, 0.5]]]))
    down = torch.tensor([[1.0, 1.0, 2.0]])
    weights = sensitivity(torch.tensor([1.0, 4.0, 1.0]), stats, down)  # energies 1, 4, 1: ratios 1, 1, 1
    torch.testing.assert_close(weights, torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("importance", ["fisher", "fisher_obs"])
def test_fisher_conversion_keeps_the_parameter_count_and_is_refused_low_memory(importance, tmp_path):
    src = make_source(tmp_path / "src", "llama", tokenizer=tiny_tokenizer())
    opts = dict(calibration_data=str(DATA), calibration_tokens=1024, seq_len=64, batch_size=4, multiple_of=1,
                importance=importance)
    report = convert(str(src), str(tmp_path / "out"), options_from(**opts))
    assert report["importance"] == importance and report["params_after"] == report["params_before"]
    assert report["widths_after"] != report["widths_before"] and "rank" in report["seconds"]
    grows = [a > b for a, b in zip(report["widths_after"], report["widths_before"])]
    first = grows.index(False)  # the leading growing layers keep every neuron: not ranked, the backward stops
    assert first > 0 and all(p is None for p in report["importance_profile"][:first])
    assert all(p > 0 for p in report["importance_profile"][first:])
    with pytest.raises(ConversionError, match="drop --low-memory"):
        options_from(low_memory=True, **opts).validate()


def test_top_share_profile_counts_each_layers_neurons_in_the_global_top_half():
    scores = [torch.tensor([9.0, 1.0, 8.0, 0.5]), torch.tensor([0.1, 0.2]), torch.tensor([7.0, 6.0, 0.3, 0.4])]
    # 10 neurons, top 5: 9, 8, 7, 6 and 1 -> layer 0 has 3, layer 1 none, layer 2 has 2
    assert top_share_profile(scores) == [3.0, 0.0, 2.0]
    assert top_share_profile([torch.ones(4), torch.ones(4)]) == [4.0, 0.0]  # ties: the first neurons by position


@pytest.mark.parametrize("schedule", ["measured", "measured-taper"])
def test_measured_schedule_widths_keep_the_parameter_count_and_are_deterministic(schedule, tmp_path, monkeypatch):
    src = make_source(tmp_path / "src", "llama", tokenizer=tiny_tokenizer())
    opts = dict(calibration_data=str(DATA), calibration_tokens=1024, seq_len=64, batch_size=4, multiple_of=4,
                schedule=schedule, importance="fisher")
    calls = []
    real = convert_module.fisher_scores
    monkeypatch.setattr(convert_module, "fisher_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    import tlm_convert.calibrate as calibrate_module
    monkeypatch.setattr(calibrate_module, "fisher_scores", lambda *a, **k: calls.append(2) or real(*a, **k))
    report = convert(str(src), str(tmp_path / "out"), options_from(**opts))
    assert calls == [1]  # one Fisher pass: the measurement's scores rank the neurons too
    widths, profile = report["widths_after"], report["measured_profile"]
    base = report["widths_before"][0]
    assert sum(widths) == sum(report["widths_before"]) and report["params_after"] == report["params_before"]
    assert all(base // 2 <= w <= base * 3 // 2 and w % 4 == 0 for w in widths)
    assert widths == measured_widths(profile, base, 4, bounds=(0.5, 1.5), monotone=schedule == "measured-taper")
    assert sum(profile) == len(widths) * base // 2  # the top half of all neurons
    assert report["widths_cosine"] == taper_widths(len(widths), base, "cosine", "1.5/0.5", multiple_of=4)
    if schedule == "measured-taper":
        assert all(a >= b for a, b in zip(widths, widths[1:]))
    text = (tmp_path / "out" / "report.md").read_text()
    assert "cosine (reference)" in text and "Fisher removal cost" in text
    again = convert(str(src), str(tmp_path / "again"), options_from(**opts))
    assert again["widths_after"] == widths and again["measured_profile"] == profile  # deterministic
    with pytest.raises(ConversionError, match="drop --low-memory"):
        options_from(**{**opts, "importance": "obs", "low_memory": True}).validate()


def test_a_lower_dtype_runs_the_matmuls_in_it_and_ranks_as_the_fp32_pass_does():
    model = make_model(seed=1).eval()
    blocks = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))
    seen = []  # the dtype of every MLP activation the pass scores
    hooks = [layer.mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
             for layer in model.model.layers]
    full = fisher_scores(model, blocks, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(full, fisher_scores(model, blocks, seed=3, dtype=torch.float32)))
    del seen[:]
    low = fisher_scores(model, blocks, seed=3, dtype=torch.bfloat16)
    for h in hooks:
        h.remove()
    assert set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())  # left as they were
    for a, b in zip(full, low):
        assert b.dtype == torch.float64 and not torch.equal(a, b)
        ranks = torch.stack([a.argsort().argsort(), b.argsort().argsort()]).double()
        assert torch.corrcoef(ranks)[0, 1] > 0.99  # bf16 rounding moves a few neighbours, not the ranking


def test_fisher_dtype_is_validated_and_reaches_the_pre_pass():
    with pytest.raises(ConversionError, match="fisher_dtype: expected one of auto, float32, bfloat16, float16"):
        method_from(["fisher_dtype=float64"])
    assert LayerSettings(method_from(["fisher_dtype=bfloat16"]), 8, 0).fisher_torch_dtype() is torch.bfloat16
    assert LayerSettings(Method(), 8, 0).fisher_torch_dtype() is None  # the model's own dtype
