"""Writing a TLM as a GGUF file that llama.cpp runs as is (``--export gguf``).

``write_gguf(config, state_dict, path, tokenizer, weight_type)``:

* architecture ``deci`` (llama.cpp's Llama with one MLP width and head count per layer: ``deci.feed_forward_length``,
  ``deci.attention.head_count`` and ``deci.attention.head_count_kv`` are arrays), exact widths (no rounding to 256:
  the runtime reads any width); ``llama`` when every layer has the same width;
* Llama blocks only: RMSNorm, SiLU-gated MLP without biases, softmax attention with RoPE (default, linear, or llama3
  scaling written as ``rope_freqs``). Other mixers, biases, q/k norms, sliding windows, ... are refused with one
  line naming why;
* q/k projection rows permuted from transformers' rotate-half RoPE layout to llama.cpp's adjacent pairs;
* the tokenizer carried over from its ``tokenizer.json``: byte-level BPE (``tokenizer.ggml.model`` "gpt2", with
  the pre-tokenizer name llama.cpp uses for its split rule, and the merges) or SentencePiece BPE with byte
  fallback ("llama", scores from the merge order); special tokens typed CONTROL, bos / eos / unk / pad ids, whether
  bos / eos are added, the chat template;
* weights f32, f16, bf16 or q8_0 (the block quantisation the ``gguf`` package writes; norms stay f32, and q8_0 falls
  back to f16 for a tensor whose rows are not a multiple of 32). Other llama.cpp types (Q4_K_M, ...): run
  ``llama-quantize model.gguf out.gguf Q4_K_M`` on the f32/f16 file.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import torch

from tlm import TLMConfig
from tlm.modules import rope_inv_freq

from .archs import GGUF_LLAMA_NAMES, layer_template
from .errors import ConversionError, one_line
from .gguf_reader import gguf_file
from .hf_layout import check_mixers, check_round_trip, hf_state_dict_from_tlm, uniform_hf_config

log = logging.getLogger(__name__)

WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0")
# torch dtype of the weights -> the GGUF type written when none is asked for
_TYPE_OF_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
GGUF_FILE = "model.gguf"



# ============================================================================================== checks


def check_gguf(config: TLMConfig) -> None:
    """ConversionError (one line: why, and what to use instead) unless llama.cpp's deci/llama block is this model."""
    check_mixers(config, "gguf", "llama.cpp's deci/llama")
    hf_config = uniform_hf_config(config, "llama", None, max(config.intermediate_sizes))
    check_round_trip(hf_config, config, "gguf")  # llama's block: RMSNorm, no q/k norm, no sliding window, ...
    reasons = []
    if config.hidden_act != "silu":
        reasons.append(f"hidden_act {config.hidden_act!r} (llama.cpp's llama/deci MLP is SiLU-gated)")
    if config.attention_bias or config.attention_out_bias or config.mlp_bias:
        which = [n for n in ("attention_bias", "attention_out_bias", "mlp_bias") if getattr(config, n)]
        reasons.append(f"biases ({', '.join(which)}) that llama.cpp's deci blocks do not load")
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type not in ("default", "linear", "llama3"):
        reasons.append(f"rope_type {rope_type!r} (supported: default, linear, llama3)")
    if config.num_attention_heads % config.num_key_value_heads:
        reasons.append("num_attention_heads not divisible by num_key_value_heads")
    if reasons:
        raise ConversionError(f"export 'gguf' cannot represent {reasons[0]}; use --export tlm or hf")


# ============================================================================================== tensors


def _permute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(n_heads*Dh, in) rows from rotate-half order (i, i + Dh/2) to llama.cpp's adjacent pairs (2i, 2i + 1)."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def gguf_tensors(config: TLMConfig, state_dict) -> dict[str, torch.Tensor]:
    """llama.cpp-named fp32 tensors of a (checked) Llama-block TLM, q/k rows permuted, plus ``rope_freqs``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state_dict_from_tlm(config, state_dict, "llama").items():
        template, layer = layer_template(name)
        if template not in GGUF_LLAMA_NAMES:
            raise ConversionError(f"tensor '{name}' has no place in a llama.cpp deci model; use --export tlm")
        target = GGUF_LLAMA_NAMES[template].format(i=layer)
        tensor = tensor.detach().to(torch.float32)
        if template.endswith("q_proj.weight"):
            tensor = _permute_rope_rows(tensor, config.num_attention_heads)
        elif template.endswith("k_proj.weight"):
            tensor = _permute_rope_rows(tensor, config.num_key_value_heads)
        out[target] = tensor
    if config.rope_parameters.get("rope_type") == "llama3":  # llama.cpp divides the default frequencies by these
        default = rope_inv_freq({"rope_theta": config.rope_parameters["rope_theta"]}, config.head_dim)
        out["rope_freqs.weight"] = default / rope_inv_freq(config.rope_parameters, config.head_dim)
    return out


def _encode(gguf, name: str, tensor: torch.Tensor, weight_type: str):
    """(array, raw_dtype) for GGUFWriter.add_tensor: 1-D tensors stay f32 (llama.cpp's convention)."""
    array = tensor.detach().cpu().contiguous().numpy()
    kinds = gguf.GGMLQuantizationType
    if array.ndim == 1 or weight_type == "f32" or name == "rope_freqs.weight":
        return array, kinds.F32
    if weight_type == "f16":
        return array.astype(np.float16), kinds.F16
    if weight_type == "bf16":
        return gguf.quants.quantize(array, kinds.BF16), kinds.BF16
    if array.shape[-1] % gguf.GGML_QUANT_SIZES[kinds.Q8_0][0]:
        log.info("%s: rows of %d are not a multiple of 32; written as f16", name, array.shape[-1])
        return array.astype(np.float16), kinds.F16
    return gguf.quants.quantize(array, kinds.Q8_0), kinds.Q8_0


def _file_type(gguf, weight_type: str) -> int:
    ftype = gguf.LlamaFileType
    return {"f32": ftype.ALL_F32, "f16": ftype.MOSTLY_F16, "bf16": ftype.MOSTLY_BF16,
            "q8_0": ftype.MOSTLY_Q8_0}[weight_type]


# ============================================================================================== tokenizer


_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's name for a byte-level pre-tokenizer (its split rule), or ConversionError naming it."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    kinds = [s.get("type") for s in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"  # GPT-2's rule, built into ByteLevel
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"  # single digits, then GPT-2's rule (SmolLM, StarCoder)
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        pattern = steps[0].get("pattern", {}).get("Regex")
        if pattern == _LLAMA3_SPLIT:
            return "llama-bpe"
        if pattern == _QWEN2_SPLIT:
            return "qwen2"
    raise ConversionError(f"export 'gguf' does not know llama.cpp's name for the pre-tokenizer {'+'.join(kinds) or 'none'}"
                          f" (known: GPT-2 byte level, SmolLM digits + byte level, Llama 3 and Qwen2 splits); "
                          "use --export hf and llama.cpp's convert_hf_to_gguf.py")


# llama.cpp pre-tokenizers that split every digit before GPT-2's rule (transformers' GGUF reader drops that step)
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact", "codeshell", "command-r")


def restore_digit_split(tokenizer, gguf_path) -> bool:
    """Put back the single-digit split of a tokenizer transformers read from a GGUF whose ``tokenizer.ggml.pre``
    has one (SmolLM's "smollm", ...): transformers builds a plain ByteLevel pre-tokenizer, which cuts "  12" as
    " ", " 1", "2" where the model's own tokenizer (and llama.cpp) cut "  ", "1", "2". Returns whether it changed."""
    from tokenizers import pre_tokenizers

    field = gguf_file(gguf_path).fields.get("tokenizer.ggml.pre")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if field is None or backend is None or field.contents() not in _DIGIT_SPLIT_PRES:
        return False
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        return False
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(pre.get("add_prefix_space")), use_regex=True)])
    return True


def _is_sentencepiece(spec: dict) -> bool:
    model, pre, normalizer = spec["model"], spec.get("pre_tokenizer") or {}, spec.get("normalizer") or {}
    text = json.dumps([pre, normalizer], ensure_ascii=False)
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and "\u2581" in text


def _merges(model: dict) -> list[str]:
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _spm_scores(vocab: dict[str, int], merges: list[str]) -> dict[int, float]:
    """SentencePiece-BPE scores: a token made by merge r scores -r - 1 (llama.cpp merges the best score first)."""
    scores: dict[int, float] = {}
    for rank, merge in enumerate(merges):
        token = merge.replace(" ", "", 1)
        if token in vocab:
            scores.setdefault(vocab[token], -float(rank) - 1.0)
    return scores


def _adds(tokenizer) -> tuple[bool, bool]:
    """Whether encoding adds bos / eos (tested, whatever the post-processor is)."""
    ids = tokenizer("a")["input_ids"]
    return (tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id,
            tokenizer.eos_token_id is not None and bool(ids) and ids[-1] == tokenizer.eos_token_id)


def write_tokenizer(gguf, writer, tokenizer, n_vocab: int) -> None:
    """The ``tokenizer.ggml.*`` metadata of a fast (tokenizers-backed) ``tokenizer`` for an ``n_vocab`` model."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConversionError(f"export 'gguf' needs a fast tokenizer (tokenizer.json); {type(tokenizer).__name__} "
                              "has none")
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ConversionError(f"export 'gguf' carries BPE tokenizers only (byte-level or SentencePiece BPE), not "
                              f"{model.get('type')}; use --export hf and llama.cpp's convert_hf_to_gguf.py")
    vocab = dict(model["vocab"])
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    for content, token in added.items():
        vocab[content] = token["id"]
    if max(vocab.values()) >= n_vocab:
        raise ConversionError(f"the tokenizer has token id {max(vocab.values())} but the model only {n_vocab} "
                              "embedding rows")
    types, kinds = [gguf.TokenType.UNUSED] * n_vocab, gguf.TokenType
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]  # rows no token uses (padded embeddings)
    spm = _is_sentencepiece(spec)
    for text, i in vocab.items():
        tokens[i] = text
        if text in added:
            types[i] = kinds.CONTROL if added[text].get("special") else kinds.USER_DEFINED
        elif spm and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            types[i] = kinds.BYTE
        else:
            types[i] = kinds.NORMAL
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id < n_vocab and spm:
        types[tokenizer.unk_token_id] = kinds.UNKNOWN
    merges = _merges(model)
    if spm:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        scores = _spm_scores(vocab, merges)
        writer.add_token_scores([scores.get(i, 0.0 if types[i] == kinds.NORMAL else -1000.0)
                                 for i in range(n_vocab)])
        pre = json.dumps(spec.get("pre_tokenizer"))
        writer.add_add_space_prefix('"prepend_scheme": "always"' in pre or '"prepend_scheme": "first"' in pre
                                    or '"Prepend"' in json.dumps(spec.get("normalizer")))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_tokenizer_name(spec.get("pre_tokenizer")))
        writer.add_token_merges(merges)
        writer.add_add_space_prefix(False)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    for key, token_id in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                          ("unk", tokenizer.unk_token_id), ("pad", tokenizer.pad_token_id)):
        if token_id is not None and token_id < n_vocab:
            getattr(writer, f"add_{key}_token_id")(int(token_id))
    add_bos, add_eos = _adds(tokenizer)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        writer.add_chat_template(template)


# ============================================================================================== file


def write_gguf(config: TLMConfig, state_dict, path, tokenizer=None, weight_type: str | None = None,
               name: str | None = None) -> Path:
    """Write the TLM ``(config, state_dict)`` (TLM tensor names) as one GGUF file at ``path``; returns it.

    ``tokenizer``: a fast transformers tokenizer (its tokenizer.json is carried over); None writes no vocabulary
    (llama.cpp then refuses to load the file, so the CLI always passes one). ``weight_type``: one of WEIGHT_TYPES,
    default the dtype of the weights.
    """
    import gguf

    check_gguf(config)
    if weight_type is None:
        weight_type = _TYPE_OF_DTYPE.get(next(iter(state_dict.values())).dtype, "f32")
    if weight_type not in WEIGHT_TYPES:
        raise ConversionError(f"GGUF weight type {weight_type!r} is not one this exporter writes "
                              f"({', '.join(WEIGHT_TYPES)}); for others run llama-quantize on the f32/f16 file")
    widths = [int(w) for w in config.intermediate_sizes]
    arch = "llama" if len(set(widths)) == 1 else "deci"
    n = config.num_hidden_layers
    writer = gguf.GGUFWriter(str(path), arch)
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or "tapered-lm")
        writer.add_file_type(_file_type(gguf, weight_type))
        writer.add_block_count(n)
        writer.add_context_length(int(config.max_position_embeddings))
        writer.add_embedding_length(int(config.hidden_size))
        if arch == "llama":
            writer.add_feed_forward_length(widths[0])
            writer.add_head_count(int(config.num_attention_heads))
            writer.add_head_count_kv(int(config.num_key_value_heads))
        else:
            writer.add_feed_forward_length(widths)
            writer.add_head_count([int(config.num_attention_heads)] * n)
            writer.add_head_count_kv([int(config.num_key_value_heads)] * n)
        writer.add_key_length(int(config.head_dim))
        writer.add_value_length(int(config.head_dim))
        writer.add_layer_norm_rms_eps(float(config.norm_eps))
        writer.add_rope_dimension_count(int(config.head_dim))
        writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
        if config.rope_parameters.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(config.rope_parameters["factor"]))
        writer.add_vocab_size(int(config.vocab_size))
        if tokenizer is not None:
            write_tokenizer(gguf, writer, tokenizer, int(config.vocab_size))
        for tensor_name, tensor in gguf_tensors(config, state_dict).items():
            array, raw_dtype = _encode(gguf, tensor_name, tensor, weight_type)
            writer.add_tensor(tensor_name, array, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except ConversionError:
        raise
    except (KeyError, ValueError, TypeError) as err:
        raise ConversionError(f"cannot write the GGUF file ({one_line(err)})") from None
    finally:
        writer.close()
    return Path(path)


__all__ = ["WEIGHT_TYPES", "GGUF_FILE", "check_gguf", "gguf_tensors", "restore_digit_split", "write_tokenizer",
           "write_gguf"]
