"""Numerics of the TLM model: cache, parity, round trips, generation, masks, checkpointing."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import MIXER_NAMES, MIXER_VARIANTS, make_model, randomize_, tiny_config
from transformers import AutoModelForCausalLM

import tlm

ATOL = 1e-5


def _logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, use_cache=False, **kw).logits


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_cache_equals_no_cache(mixer, ids):
    # 13 tokens: prefill 6, then decode one at a time, crossing chunk boundaries (chunk 4) mid-stream
    model = make_model(mixer)
    full = _logits(model, ids)
    with torch.no_grad():
        out = model(ids[:, :6], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(6, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_chunked_prefill_equals_one_pass(mixer, ids):
    model = make_model(mixer)
    full = _logits(model, ids)
    with torch.no_grad():
        a = model(ids[:, :5], use_cache=True)
        b = model(ids[:, 5:], cache=a.cache, use_cache=True)
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_tapered_and_uniform_have_identical_parameter_counts(mixer):
    uniform = tlm.TLMForCausalLM(tiny_config(mixer, schedule="uniform"))
    tapered = tlm.TLMForCausalLM(tiny_config(mixer, schedule="cosine"))
    assert tapered.config.intermediate_sizes != uniform.config.intermediate_sizes
    assert sum(tapered.config.intermediate_sizes) == 3 * 37
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(tapered) == count(uniform)
    mlp = lambda m: sum(p.numel() for n, p in m.named_parameters() if ".mlp.levels." in n or ".mlp.down" in n  # noqa: E731
                        or ".mlp.up" in n or ".mlp.gate" in n)  # the levels; not chain norms or local-rule projections
    assert mlp(tapered) == mlp(uniform) == 3 * 32 * 3 * 37


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_causality(mixer, ids):
    model = make_model(mixer)
    changed = ids.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 99
    a, b = _logits(model, ids), _logits(model, changed)
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=ATOL, rtol=0)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-4


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_batch_independence(mixer, ids):
    model = make_model(mixer)
    both = _logits(model, ids)
    torch.testing.assert_close(_logits(model, ids[1:]), both[1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_save_load_round_trip(mixer, ids, tmp_path):
    model = make_model(mixer, schedule="cosine")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is tlm.TLMForCausalLM
    assert loaded.config.intermediate_sizes == model.config.intermediate_sizes
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_remote_code_loads_without_the_package(tmp_path, ids):
    config = tiny_config(list(MIXER_NAMES), schedule="cosine", num_hidden_layers=4)
    model = randomize_(tlm.TLMForCausalLM(config).eval())
    model.save_pretrained(tmp_path / "ckpt")
    expected = _logits(model, ids)
    torch.save({"ids": ids, "logits": expected}, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        class Block:  # an editable install puts the package on a meta-path finder: refuse it outright
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("tlm", "tlm_io", "tlm_train", "tlm_convert", "tlm_cli"):
                    raise ImportError("hidden: " + name)
        sys.meta_path.insert(0, Block())
        sys.path = [p for p in sys.path if p not in ('', {os.getcwd()!r})]
        try:
            import tlm
        except ImportError:
            pass
        else:
            raise SystemExit("tlm is importable; the test must hide it")
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ckpt')!r}, trust_remote_code=True).eval()
        data = torch.load({str(tmp_path / 'expected.pt')!r})
        with torch.no_grad():
            logits = model(data["ids"], use_cache=False).logits
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        print("maxdiff", (logits - data["logits"]).abs().max().item())
        assert torch.allclose(logits, data["logits"], atol=1e-6)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "maxdiff" in result.stdout


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_generate_matches_greedy_full_forward(mixer, ids):
    model = make_model(mixer)
    prompt = ids[:, :5]
    out = model.generate(prompt, max_new_tokens=7, do_sample=False, pad_token_id=0)
    seq = prompt
    for _ in range(7):
        nxt = _logits(model, seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("mixer", ["attention", "gated_attention"])
def test_sdpa_equals_eager(mixer, ids):
    model = make_model(mixer, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    sdpa = _logits(model, ids)
    model.config._attn_implementation = "eager"
    torch.testing.assert_close(_logits(model, ids), sdpa, atol=ATOL, rtol=0)


def test_sliding_window_cache_equals_no_cache(ids):
    model = make_model(sliding_window=4, layer_types=["sliding_attention"] * 3,
                       local_rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    full = _logits(model, ids)
    with torch.no_grad():
        out = model(ids[:, :3], use_cache=True)
        steps = [out.logits]
        for t in range(3, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL, rtol=0)


def _left_padded(ids, pads=5):
    """A batch of the full row 0 and row 1's last N − pads tokens left-padded with `pads` pad tokens (id 0)."""
    short = ids[1:, pads:]
    batch = torch.cat([ids[:1], torch.cat([torch.zeros(1, pads, dtype=ids.dtype), short], 1)], 0)
    mask = torch.ones_like(batch)
    mask[1, :pads] = 0
    return batch, mask, short


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_left_padding_matches_unpadded(mixer, ids):
    # 5 pads: the short row's chunks (size 4) start at its first real token, not at an absolute multiple of 4
    model = make_model(mixer)
    batch, mask, short = _left_padded(ids)
    alone = _logits(model, short)[0]
    torch.testing.assert_close(_logits(model, batch, attention_mask=mask)[1, 5:], alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(_logits(model, batch, attention_mask=mask)[0], _logits(model, ids[:1])[0],
                               atol=ATOL, rtol=0)
    with torch.no_grad():  # with cache: padded prefill of 7, then token-by-token decode (mask grows by ones)
        out = model(batch[:, :7], attention_mask=mask[:, :7], use_cache=True)
        steps = [out.logits]
        for t in range(7, batch.shape[1]):
            out = model(batch[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1)[1, 5:], alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_batched_padded_generate_equals_per_row(mixer, ids):
    model = make_model(mixer)
    batch, mask, short = _left_padded(ids)
    gen = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    alone = [model.generate(row, max_new_tokens=6, do_sample=False, pad_token_id=0) for row in (ids[:1], short)]
    assert torch.equal(gen[0], alone[0][0])
    assert torch.equal(gen[1, 5:], alone[1][0])


@pytest.mark.parametrize("mixer", ["hope_attention", "titans"])
def test_padded_beam_search_equals_per_row(mixer, ids):
    model = make_model(mixer)
    batch, mask, short = _left_padded(ids)
    kw = dict(max_new_tokens=3, do_sample=False, num_beams=2, pad_token_id=0)
    gen = model.generate(batch, attention_mask=mask, **kw)
    assert torch.equal(gen[1, 5:], model.generate(short, **kw)[0])


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_gradient_checkpointing_gives_same_gradients(mixer, ids):
    grads = []
    for ckpt in (False, True):
        model = make_model(mixer).train()
        if ckpt:
            enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
            enable()
        short = ids[:, :9]  # crosses a chunk boundary of the memory mixers, stays cheap
        loss = model(short, labels=short, use_cache=False).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("mixer", MIXER_VARIANTS)
def test_every_parameter_gets_a_gradient(mixer, ids):
    model = make_model(mixer).train()
    model(ids, labels=ids, use_cache=False).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing


def test_loss_matches_manual_cross_entropy(ids):
    model = make_model()
    out = model(ids, labels=ids, use_cache=False)
    manual = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 99), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, manual)


def test_tied_and_untied_embeddings(tmp_path):
    tied = tlm.TLMForCausalLM(tiny_config(tie_word_embeddings=True))
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = tlm.TLMForCausalLM(tiny_config(tie_word_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    untied.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(again.lm_head.weight, untied.lm_head.weight)


def test_titans_memory_stays_finite_at_cpu_config_width():
    # regression: with titans_surprise_clip=None this (CPU-recipe-sized) config's memory diverges to NaN at 256 tokens
    torch.manual_seed(0)
    config = tlm.TLMConfig(vocab_size=512, hidden_size=384, num_hidden_layers=2, num_attention_heads=6,
                           num_key_value_heads=2, intermediate_size=1024, mixer=["attention", "titans"],
                           titans_num_heads=6, titans_head_dim=64)
    ids = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = tlm.TLMForCausalLM(config)(ids, labels=ids, use_cache=False).loss
    assert torch.isfinite(loss)
