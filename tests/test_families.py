"""Exact import of every supported source family (tlm_io/archs.py): tiny random transformers models, fp32.

Each case builds a transformers model from a config (no download), perturbs EVERY parameter (norm weights and
biases included, so nothing sits at its trivial init), converts config + state dict, loads the TLM with
``strict=True`` and compares logits on random ids (batch 2, longer than every sliding window) for both of our
attention implementations.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

import tlm  # noqa: F401  (registers the Auto classes)
from tlm import TLMForCausalLM
from tlm_io.archs import SUPPORTED_ARCHITECTURES, family_of, tlm_config_from_hf, tlm_state_dict_from_hf

V, I, SEQ, WINDOW = 99, 37, 16, 5
TOL = 1e-5

CASES = {
    "llama": lambda: LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
    "llama3_untied_bias": lambda: LlamaConfig(
        vocab_size=V, hidden_size=48, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
        # original_max_position_embeddings=32: low-frequency, smoothed and untouched bands all occur at head_dim 16
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral_sliding": lambda: MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=WINDOW),
    "qwen2": lambda: Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=I, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
    "qwen3": lambda: Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attention_bias=True, tie_word_embeddings=False),
    "gemma3_text": lambda: Gemma3TextConfig(
        vocab_size=V, hidden_size=48, intermediate_size=I, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "gpt2": lambda: GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_inner=I, n_positions=64,
                                  bos_token_id=0, eos_token_id=0),
    "gpt2_unscaled_untied": lambda: GPT2Config(
        vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_inner=I, n_positions=64, scale_attn_weights=False,
        activation_function="gelu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
}


def _hf_model(case: str):
    torch.manual_seed(0)
    cfg = CASES[case]()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():  # nothing at its trivial init (Gemma norms at 0, LayerNorm biases at 0, ...)
            p.add_(torch.randn_like(p) * 0.1)
    return cfg, model


def _ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, SEQ), generator=g)


@pytest.mark.parametrize("case", list(CASES))
def test_exact_logits(case):
    cfg, hf = _hf_model(case)
    state = hf.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    config = tlm_config_from_hf(cfg)
    assert config.intermediate_sizes == [config.intermediate_size] * config.num_hidden_layers
    model = TLMForCausalLM(config).eval()
    model.load_state_dict(tlm_state_dict_from_hf(cfg, state), strict=True)
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in state)  # pure
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        for impl in ("eager", "sdpa"):
            model.config._attn_implementation = impl
            out = model(ids, use_cache=False).logits
            diff = (out - ref).abs().max().item()
            print(f"{case} [{impl}] max |diff| = {diff:.2e} (|logits| <= {ref.abs().max().item():.1f})")
            assert diff <= TOL, f"{case} {impl}: {diff}"


def test_sliding_windows_are_exercised():
    """The windowed cases really have windows shorter than the sequence on some layers (else parity is trivial)."""
    for case in ("mistral_sliding", "qwen2", "gemma3_text"):
        config = tlm_config_from_hf(CASES[case]())
        assert config.sliding_window == WINDOW < SEQ and "sliding_attention" in config.layer_types, case
    assert tlm_config_from_hf(CASES["qwen2"]()).layer_types == ["full_attention"] + ["sliding_attention"] * 2
    g = tlm_config_from_hf(CASES["gemma3_text"]())
    assert g.local_rope_parameters == {"rope_type": "default", "rope_theta": 1e4}
    assert g.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}


def test_gpt2_hub_spelling():
    """Hub GPT-2 files: no ``transformer.`` prefix, no lm_head, and the old attn.bias / masked_bias buffers."""
    cfg, hf = _hf_model("gpt2")
    hub = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(cfg.n_layer):
        hub[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
        hub[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    model = TLMForCausalLM(tlm_config_from_hf(cfg)).eval()
    model.load_state_dict(tlm_state_dict_from_hf(cfg, hub), strict=True)
    with torch.no_grad():
        assert (model(_ids(), use_cache=False).logits - hf(_ids()).logits).abs().max() <= TOL


def test_gemma3_multimodal_text_part():
    """model_type "gemma3" (4b+ checkpoints): the language model is imported, the vision side is dropped; both the
    transformers v5 spelling (model.language_model.*) and the hub spelling (language_model.model.*) are accepted."""
    torch.manual_seed(0)
    text = CASES["gemma3_text"]().to_dict()
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, boi_token_index=96,
                       eoi_token_index=97, image_token_index=98)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    v5 = hf.state_dict()
    hub = {("language_model.model." + k[len("model.language_model."):]) if k.startswith("model.language_model.")
           else k.removeprefix("model."): t for k, t in v5.items() if k != "lm_head.weight"}
    ids = _ids() % 96  # text tokens only
    model = TLMForCausalLM(tlm_config_from_hf(cfg)).eval()
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        for state in (v5, hub):
            model.load_state_dict(tlm_state_dict_from_hf(cfg, state), strict=True)
            assert (model(ids, use_cache=False).logits - ref).abs().max() <= TOL


def test_unsupported_model_type_lists_supported():
    with pytest.raises(ValueError) as err:
        family_of(AutoConfig.for_model("bert"))
    for model_type in SUPPORTED_ARCHITECTURES:
        assert model_type in str(err.value)
    with pytest.raises(ValueError, match="gpt2"):
        tlm_config_from_hf(GPT2Config.__mro__[1]())  # PretrainedConfig: no model_type at all


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
])
def test_unsupported_rope_is_refused(rope):
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                      rope_parameters=rope)
    with pytest.raises(ValueError, match=rf"rope_parameters\.rope_type='{rope['rope_type']}'"):
        tlm_config_from_hf(cfg)


def test_unreproducible_settings_are_refused():
    gemma = CASES["gemma3_text"]()
    gemma.final_logit_softcapping = 30.0
    gemma.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError) as err:
        tlm_config_from_hf(gemma)
    assert "final_logit_softcapping=30.0" in str(err.value) and "attn_logit_softcapping=50.0" in str(err.value)
    gpt2 = GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, scale_attn_by_inverse_layer_idx=True,
                      reorder_and_upcast_attn=True, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError) as err:
        tlm_config_from_hf(gpt2)
    assert "scale_attn_by_inverse_layer_idx=True" in str(err.value) and "reorder_and_upcast_attn=True" in str(err.value)


def test_mismatched_checkpoint_is_refused():
    cfg, hf = _hf_model("llama")
    state = dict(hf.state_dict())
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as err:
        tlm_state_dict_from_hf(cfg, state)
    assert "model.layers.1.mlp.up_proj.weight" in str(err.value) and "mlp.extra" in str(err.value)


def test_overrides():
    cfg = CASES["llama"]()
    assert tlm_config_from_hf(cfg, intermediate_sizes=[40, 30]).intermediate_sizes == [40, 30]
    with pytest.raises(ValueError, match="intermediate_sizez"):
        tlm_config_from_hf(cfg, intermediate_sizez=[40, 30])
