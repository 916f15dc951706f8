"""export_model (tlm_io/export.py): every format loads back in transformers with the TLM's logits.

Tiny random fp32 models with odd per-layer widths [48, 37, 26] for tlm / hf / padded in every source family,
[512, 256, 256] at hidden size 64 for deci. Each export is reloaded with ``AutoModelForCausalLM.from_pretrained``
(``trust_remote_code=True`` where the format ships code) and compared with the TLM (max |diff| <= 1e-5); one
subprocess check loads the ``hf`` view with the ``tlm`` packages hidden. Refusals are ConversionErrors that say why
and what to use instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from tlm import TLMForCausalLM
from tlm_io.archs import family_of, tlm_config_from_hf
from tlm_io.checkpoint import Source, load_source
from tlm_io.errors import ConversionError
from tlm_io.export import deci_width, export_model

V, TOL, WINDOW = 99, 1e-5, 5
WIDTHS = [48, 37, 26]
IDS = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))  # longer than the windows

SOURCES = {
    "llama": lambda: LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                 mlp_bias=True, bos_token_id=1, eos_token_id=2),
    "qwen2": lambda: Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                 use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": lambda: Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "gemma3_text": lambda: Gemma3TextConfig(
        vocab_size=V, hidden_size=48, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "gpt2": lambda: GPT2Config(vocab_size=V, n_embd=32, n_layer=3, n_head=4, n_inner=37, n_positions=64,
                               bos_token_id=0, eos_token_id=0),
}


def _source(hf_config) -> Source:
    """A Source for an in-memory config (export only reads hf_config, the tokenizer and the generation config)."""
    return Source(kind="hf", path="", hf_config=hf_config, family=family_of(hf_config),
                  tlm_config=tlm_config_from_hf(hf_config), state_dict={}, tokenizer_source=None, num_params=0)


def _tlm(config, seed=0) -> TLMForCausalLM:
    torch.manual_seed(seed)
    model = TLMForCausalLM(config).eval()
    with torch.no_grad():  # nothing at its trivial init: norms, biases and q/k norms all matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def tapered():
    """family -> (source config, tapered TLM, its logits), built once."""
    out = {}
    for name, make in SOURCES.items():
        cfg = make()
        model = _tlm(tlm_config_from_hf(cfg, intermediate_sizes=WIDTHS))
        out[name] = (cfg, model, _logits(model))
    return out


def _load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()


# ------------------------------------------------------------------------------------------------ formats


@pytest.mark.parametrize("family", list(SOURCES))
@pytest.mark.parametrize("fmt", ["tlm", "hf", "padded"])
def test_export_reloads_with_same_logits(tapered, tmp_path, family, fmt):
    cfg, model, ref = tapered[family]
    out = tmp_path / f"{fmt}_{family}"
    shard = "20KB" if family == "gemma3_text" else "5GB"  # one sharded write
    if fmt == "tlm":  # the (config, state_dict) form, with the tied head absent as in a file
        state = {k: v for k, v in model.state_dict().items() if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
        export_model((model.config, state), out, fmt, _source(cfg), max_shard_size=shard)
    else:
        export_model(model, out, fmt, _source(cfg), max_shard_size=shard)
    written = json.loads((out / "config.json").read_text())
    back = _load(out, trust_remote_code=fmt != "padded")
    diff = (_logits(back) - ref).abs().max().item()
    assert diff <= TOL, f"{family} {fmt}: {diff}"
    model_type = "gemma3_text" if family == "gemma3_text" else family
    if fmt == "hf":
        key = "n_inner" if family == "gpt2" else "intermediate_size"
        assert written["model_type"] == model_type
        assert written["per_layer_config"] == {str(i): {key: w} for i, w in enumerate(WIDTHS)}
        assert written["architectures"][0].startswith("Tapered") and type(back).__name__ == written["architectures"][0]
        assert set(written["auto_map"]) == {"AutoModelForCausalLM", "AutoModel"}
        assert (out / "modeling_tapered.py").is_file()
        mlp = back.transformer.h[2].mlp.c_fc if family == "gpt2" else back.model.layers[2].mlp.up_proj
        assert mlp.weight.shape[1 if family == "gpt2" else 0] == WIDTHS[2]
    elif fmt == "padded":
        assert written["model_type"] == model_type and "auto_map" not in written
        assert written["n_inner" if family == "gpt2" else "intermediate_size"] == max(WIDTHS)
        assert not list(out.glob("*.py"))
        if family == "gpt2":  # Conv1D: neuron j is column j of c_fc, row j of c_proj
            assert not back.transformer.h[2].mlp.c_fc.weight[:, 26:].any()
            assert not back.transformer.h[2].mlp.c_proj.weight[26:].any()
        else:
            layer = back.model.layers[2].mlp
            assert not layer.up_proj.weight[26:].any() and not layer.down_proj.weight[:, 26:].any()
    else:
        assert written["model_type"] == "tlm" and written["intermediate_sizes"] == WIDTHS
    if family == "gemma3_text" and fmt != "tlm":
        assert (out / "model.safetensors.index.json").is_file()
    if fmt == "hf" and family == "qwen2":  # cached greedy decoding agrees with the TLM's
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(back.generate(IDS[:1], **kwargs), model.generate(IDS[:1], **kwargs))


def test_hf_source_names_and_stock_refusal(tapered, tmp_path):
    """The hf view keeps the source's tensor names (GPT-2: fused c_attn, Conv1D layout); stock classes refuse it."""
    cfg, model, _ = tapered["gpt2"]
    export_model(model, tmp_path / "gpt2", "hf", _source(cfg))
    with safe_open(str(tmp_path / "gpt2" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert tuple(f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape()) == (32, 96)
        assert tuple(f.get_slice("transformer.h.0.mlp.c_fc.weight").get_shape()) == (32, 48)
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # tied
    cfg, model, _ = tapered["gemma3_text"]
    export_model(model, tmp_path / "gemma", "hf", _source(cfg))
    with safe_open(str(tmp_path / "gemma" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.pre_feedforward_layernorm.weight" in names
    assert not any("post_mixer_layernorm" in n for n in names)
    cfg, model, _ = tapered["llama"]
    export_model(model, tmp_path / "llama", "hf", _source(cfg))
    with pytest.raises(Exception, match="per-layer attribute"):
        LlamaForCausalLM.from_pretrained(str(tmp_path / "llama"))


def test_hf_view_without_source_infers_architecture(tapered, tmp_path):
    cfg, model, ref = tapered["qwen3"]
    export_model(model, tmp_path / "q", "hf", None)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["model_type"] == "qwen3"
    assert (_logits(_load(tmp_path / "q", trust_remote_code=True)) - ref).abs().max() <= TOL


def test_hf_view_loads_without_the_package(tapered, tmp_path):
    """Only transformers and the files of the export: no package of this project can be imported in the child."""
    cfg, model, ref = tapered["llama"]
    out = tmp_path / "hf_llama_alone"
    export_model(model, out, "hf", _source(cfg))
    torch.save({"ids": IDS, "ref": ref}, tmp_path / "expected.pt")
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("tlm", "tlm_io", "tlm_train", "tlm_convert", "tlm_cli"):
                    raise ImportError("hidden: " + name)
        sys.meta_path.insert(0, Block())
        sys.path = [p for p in sys.path if p not in ("", {os.getcwd()!r})]
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32).eval()
        ours = ("tlm", "tlm_io", "tlm_train", "tlm_convert", "tlm_cli")
        assert not any(m.split(".")[0] in ours for m in sys.modules), "tlm was imported"
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            diff = (model(expected["ids"]).logits - expected["ref"]).abs().max().item()
        print(type(model).__name__, diff)
        assert diff <= {TOL}, diff
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TaperedLlamaForCausalLM" in result.stdout


def test_deci(tmp_path):
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    model = _tlm(tlm_config_from_hf(cfg, intermediate_sizes=[512, 256, 256]), seed=3)
    export_model(model, tmp_path / "deci", "deci", _source(cfg))
    written = json.loads((tmp_path / "deci" / "config.json").read_text())
    assert (written["model_type"], written["architectures"]) == ("nemotron-nas", ["DeciLMForCausalLM"])
    assert written["auto_map"] == {"AutoConfig": "configuration_decilm.DeciLMConfig",
                                   "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"}
    blocks = written["block_configs"]
    assert [b["ffn"]["ffn_mult"] for b in blocks] == [12.0, 6.0, 6.0]
    assert [deci_width(b["ffn"]["ffn_mult"], 64) for b in blocks] == [512, 256, 256]  # the engines' rule
    assert all(b["attention"] == {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False} for b in blocks)
    assert all(not b["ffn"]["no_op"] and not b["ffn"]["replace_with_linear"] for b in blocks)
    back = _load(tmp_path / "deci", trust_remote_code=True)
    assert type(back).__name__ == "DeciLMForCausalLM" and back.config.block_configs[0].ffn.ffn_mult == 12.0
    assert (_logits(back) - _logits(model)).abs().max() <= TOL
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(back.generate(IDS[:1], **kwargs), model.generate(IDS[:1], **kwargs))


def test_deci_ffn_mult_round_trips_at_real_sizes():
    from tlm_io.export import ffn_mult_for

    for hidden in (576, 2048, 3072, 4096, 5120, 8192):
        for width in range(256, 8 * hidden + 1, 256):
            assert deci_width(ffn_mult_for(width, hidden), hidden) == width, (hidden, width)


# ------------------------------------------------------------------------------------------------ refusals


def _refused(model, fmt, source, match, tmp_path):
    with pytest.raises(ConversionError, match=match) as err:
        export_model(model, tmp_path / "refused", fmt, source)
    assert "\n" not in str(err.value) and "use --export" in str(err.value)
    return str(err.value)


def test_deci_refuses_widths_off_256(tmp_path):
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2)
    plain = _tlm(tlm_config_from_hf(cfg, intermediate_sizes=[512, 256, 300]))
    text = _refused(plain, "deci", _source(cfg), r"export 'deci' needs MLP widths that are multiples of 256 "
                    r"\(layer 2 has 300\); convert with --set multiple_of=256 or use --export tlm", tmp_path)
    assert text.endswith("use --export tlm")


@pytest.mark.parametrize("family, why", [
    ("qwen3", r"cannot represent qwen3 \(per-head q/k norms\); use --export tlm or hf"),
    ("qwen2", r"cannot represent qwen2 \(q/k/v biases"),
    ("gemma3_text", r"cannot represent gemma3_text \(Gemma 3 blocks"),
    ("gpt2", r"cannot represent gpt2 \(LayerNorm, learned positions"),
    ("llama", r"cannot represent biases \(mlp_bias\)"),
])
def test_deci_refuses_other_blocks(tapered, tmp_path, family, why):
    cfg, model, _ = tapered[family]
    _refused(model, "deci", _source(cfg), "export 'deci' " + why, tmp_path)


def test_deci_refuses_sliding_window(tmp_path):
    cfg = MistralConfig(vocab_size=V, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=WINDOW)
    model = _tlm(tlm_config_from_hf(cfg))
    _refused(model, "deci", _source(cfg), r"cannot represent sliding-window attention \(mistral", tmp_path)


@pytest.mark.parametrize("fmt", ["hf", "padded", "deci"])
def test_non_attention_mixers_are_refused(tmp_path, fmt):
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2)
    config = tlm_config_from_hf(cfg, mixer=["attention", "titans", "titans"], titans_chunk_size=4)
    model = TLMForCausalLM(config).eval()
    _refused(model, fmt, _source(cfg), rf"export '{fmt}' cannot represent titans layers \(layers 1, 2\)", tmp_path)


def test_unknown_format(tapered, tmp_path):
    with pytest.raises(ConversionError, match="unknown export format 'onnx'"):
        export_model(tapered["llama"][1], tmp_path, "onnx")


# ------------------------------------------------------------------------------------------------ end to end


def _tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.save_pretrained(folder)


def test_load_taper_export_with_tokenizer(tmp_path):
    """load_source -> cut widths -> export: tokenizer and generation config travel with every format."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf.generation_config.max_new_tokens = 7
    hf.save_pretrained(tmp_path / "src")
    _tokenizer(tmp_path / "src")
    source = load_source(tmp_path / "src")
    widths = [37, 30, 20]
    state = dict(source.state_dict)
    for i, w in enumerate(widths):  # keep the first w neurons of each layer
        p = f"model.layers.{i}.mlp."
        state[p + "gate_proj.weight"] = state[p + "gate_proj.weight"][:w]
        state[p + "up_proj.weight"] = state[p + "up_proj.weight"][:w]
        state[p + "down_proj.weight"] = state[p + "down_proj.weight"][:, :w].contiguous()
    config = tlm_config_from_hf(source.hf_config, intermediate_sizes=widths)
    tlm = TLMForCausalLM(config).eval()
    tlm.load_state_dict(state, strict=True)
    ref = _logits(tlm)
    for fmt in ("tlm", "hf", "padded"):
        out = export_model(tlm, tmp_path / fmt, fmt, source)
        assert AutoTokenizer.from_pretrained(str(out))("w5 w7")["input_ids"] == [5, 7]
        assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 7
        assert (_logits(_load(out, trust_remote_code=True)) - ref).abs().max() <= TOL
    again = load_source(tmp_path / "tlm")  # an export is a valid source again
    assert again.kind == "tlm" and again.tlm_config.intermediate_sizes == widths
    padded = load_source(tmp_path / "padded")
    assert padded.tlm_config.intermediate_sizes == [37] * 3 and padded.tokenizer_source == str(tmp_path / "padded")
    with pytest.raises(ConversionError, match="has per-layer widths"):
        load_source(tmp_path / "hf")
