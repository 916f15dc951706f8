"""Writing a TLM (tapered or not) in one of four checkpoint formats.

``export_model(model_or_(config, state_dict), out_dir, fmt, source)`` with ``fmt``:

* ``"tlm"``: ``TLMForCausalLM.save_pretrained``: model_type "tlm", the TLM modeling code beside the weights and
  ``auto_map`` (loads with ``trust_remote_code=True`` where the package is not installed).
* ``"hf"``: the source architecture's own config (llama, mistral, qwen2, qwen3, gemma3_text, gpt2) with every
  layer's MLP width in transformers' ``per_layer_config`` (written explicitly; the global attribute stays
  ambiguous, so stock classes refuse the config loudly instead of building wrong shapes), the SOURCE tensor names,
  and ``modeling_tapered.py``: subclasses of the stock classes that rebuild layer i's MLP from
  ``config.per_layer_config[i]`` (``auto_map`` for AutoModelForCausalLM and AutoModel).
* ``"deci"``: ``DeciLMForCausalLM`` / model_type ``nemotron-nas`` with ``block_configs`` (what vLLM, SGLang,
  TensorRT-LLM, llama.cpp and mlx-lm serve), plus minimal ``configuration_decilm.py`` / ``modeling_decilm.py``.
  Llama-family blocks only, every width a multiple of 256 (the engines derive widths from ``ffn_mult``).
* ``"padded"``: the stock source class, no remote code: every layer zero-padded to the widest one (zero
  gate/up rows and down columns; GPT-2 zero c_fc columns and bias entries, zero c_proj rows): the same function.

A format that cannot represent the model exactly raises ConversionError saying why and what to use instead.
Files are written only inside ``out_dir`` (the caller makes it a temporary folder and renames it when done).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import torch

from tlm import TLMConfig, TLMForCausalLM

from .archs import (
    CONV1D,
    COPY,
    QKV_BIAS,
    QKV_CONV1D,
    SUPPORTED_ARCHITECTURES,
    TENSOR_TABLES,
    tlm_config_from_hf,
)
from .checkpoint import TOKENIZER_FILES, Source, check_tlm_state_dict
from .errors import ConversionError, one_line

FORMATS = ("tlm", "hf", "deci", "padded")
DECI_MULTIPLE = 256

# model_type -> (transformers module, base model class, causal LM class, MLP class, layer list, base attribute)
STOCK_CLASSES: dict[str, tuple[str, str, str, str, str, str]] = {
    "llama": ("llama", "LlamaModel", "LlamaForCausalLM", "LlamaMLP", "layers", "model"),
    "mistral": ("mistral", "MistralModel", "MistralForCausalLM", "MistralMLP", "layers", "model"),
    "qwen2": ("qwen2", "Qwen2Model", "Qwen2ForCausalLM", "Qwen2MLP", "layers", "model"),
    "qwen3": ("qwen3", "Qwen3Model", "Qwen3ForCausalLM", "Qwen3MLP", "layers", "model"),
    "gemma3_text": ("gemma3", "Gemma3TextModel", "Gemma3ForCausalLM", "Gemma3MLP", "layers", "model"),
    "gpt2": ("gpt2", "GPT2Model", "GPT2LMHeadModel", "GPT2MLP", "h", "transformer"),
}
WIDTH_KEY = {model_type: ("n_inner" if model_type == "gpt2" else "intermediate_size") for model_type in STOCK_CLASSES}



# ============================================================================================== entry point


def export_model(model, out_dir, fmt: str = "tlm", source: Source | None = None, *,
                 max_shard_size: int | str = "5GB") -> Path:
    """Write ``model`` (a TLMForCausalLM, or a (TLMConfig, state_dict) pair with TLM names) to ``out_dir``.

    ``source`` (the loaded source model, optional) decides the architecture of the ``hf`` / ``padded`` / ``deci``
    views and supplies the tokenizer and generation config. Without it the architecture is inferred from the
    TLM block options. Returns ``Path(out_dir)``.
    """
    if fmt not in FORMATS:
        raise ConversionError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    config, state_dict, instance = _config_and_state(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "tlm":
        _export_tlm(config, state_dict, instance, out, max_shard_size)
    elif fmt == "deci":
        _export_deci(config, state_dict, out, source, max_shard_size)
    else:
        _export_hf(config, state_dict, out, fmt, source, max_shard_size)
    copy_tokenizer(source, out)
    write_generation_config(source, instance, fmt, out)
    return out


def _config_and_state(model) -> tuple[TLMConfig, dict[str, torch.Tensor], TLMForCausalLM | None]:
    if isinstance(model, TLMForCausalLM):
        return model.config, model.state_dict(), model
    if isinstance(model, (tuple, list)) and len(model) == 2 and isinstance(model[0], TLMConfig):
        config, state_dict = model
        state_dict = dict(state_dict)
        if config.tie_word_embeddings and "model.embed_tokens.weight" in state_dict:
            state_dict.setdefault("lm_head.weight", state_dict["model.embed_tokens.weight"])
        check_tlm_state_dict(config, state_dict)
        return config, state_dict, None
    raise ConversionError(f"export_model takes a TLMForCausalLM or a (TLMConfig, state_dict) pair, not "
                          f"{type(model).__name__}; build the TLM first")


def _state_dtype(state_dict) -> torch.dtype:
    for tensor in state_dict.values():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


# ============================================================================================== tlm


def _export_tlm(config: TLMConfig, state_dict, instance, out: Path, max_shard_size) -> None:
    model = instance
    if model is None:
        with torch.device("meta"):
            model = TLMForCausalLM(config)
        model.load_state_dict(state_dict, strict=True, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.eval()
    model.save_pretrained(str(out), max_shard_size=max_shard_size)


# ============================================================================================== hf / padded


def _export_hf(config: TLMConfig, state_dict, out: Path, fmt: str, source: Source | None, max_shard_size) -> None:
    model_type = target_model_type(config, source)
    _check_mixers(config, fmt, model_type)
    widths = list(config.intermediate_sizes)
    if fmt == "padded":
        width = max(widths)
        state_dict = pad_mlp_state_dict(config, state_dict, width)
        config = _with_widths(config, [width] * config.num_hidden_layers)
        base_width = width
    elif len(set(widths)) == 1:  # uniform: a plain stock config, which the stock classes load as well
        base_width = widths[0]
    else:  # the global value is the base width; per_layer_config makes it ambiguous on purpose
        base_width = config.intermediate_size if isinstance(config.intermediate_size, int) else max(widths)
    hf_config = uniform_hf_config(config, model_type, source, base_width, _state_dtype(state_dict))
    check_round_trip(hf_config, config, fmt)
    tensors = hf_state_dict_from_tlm(config, state_dict, model_type)
    stock = STOCK_CLASSES[model_type]
    if fmt == "hf":
        key = WIDTH_KEY[model_type]
        hf_config.per_layer_config = {i: {key: int(w)} for i, w in enumerate(widths)}
        hf_config.serialize_explicit_per_layer_config = True
        tapered_base, tapered_lm = "Tapered" + stock[1], "Tapered" + stock[2]
        hf_config.architectures = [tapered_lm]
        hf_config.auto_map = {"AutoModelForCausalLM": f"modeling_tapered.{tapered_lm}",
                              "AutoModel": f"modeling_tapered.{tapered_base}"}
        (out / "modeling_tapered.py").write_text(tapered_modeling_source(model_type), encoding="utf-8")
    else:
        hf_config.architectures = [stock[2]]
    hf_config.save_pretrained(str(out))
    write_safetensors(tensors, out, max_shard_size)


def _with_widths(config: TLMConfig, widths: list[int]) -> TLMConfig:
    fields = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "auto_map", "_name_or_path"):
        fields.pop(key, None)
    fields["intermediate_sizes"] = list(widths)
    return TLMConfig(**fields)


def _check_mixers(config: TLMConfig, fmt: str, target: str) -> None:
    others = sorted({m for m in config.mixer if m != "attention"})
    if others:
        layers = [i for i, m in enumerate(config.mixer) if m != "attention"]
        where = ", ".join(map(str, layers[:8])) + (" ..." if len(layers) > 8 else "")
        raise ConversionError(f"export '{fmt}' cannot represent {'/'.join(others)} layers (layers {where}): {target} "
                              "has softmax attention blocks only; use --export tlm")


def target_model_type(config: TLMConfig, source: Source | None) -> str:
    """The transformers model_type the hf / padded / deci views use: the source's, else inferred from the block."""
    if source is not None and source.hf_config is not None:
        model_type = source.hf_config.model_type
        return "gemma3_text" if model_type == "gemma3" else model_type  # the text model only: no vision tower
    if config.position_embedding == "learned" or config.norm_type == "layernorm":
        return "gpt2"
    if config.sandwich_norm or config.norm_offset:
        return "gemma3_text"
    if config.qk_norm:
        return "qwen3"
    if config.attention_bias and not config.attention_out_bias:
        return "qwen2"
    if set(config.layer_types) == {"sliding_attention"}:
        return "mistral"
    if "sliding_attention" in config.layer_types:
        return "qwen2"
    return "llama"


def _rope_out(params: dict | None) -> dict | None:
    return dict(params) if params is not None else None


def _token_fields(config: TLMConfig) -> dict:
    return {k: getattr(config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}


def _decoder_fields(config: TLMConfig, width: int) -> dict:
    return dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=int(width),
                num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_eps,
                initializer_range=config.initializer_range, use_cache=config.use_cache,
                tie_word_embeddings=config.tie_word_embeddings, attention_dropout=config.attention_dropout,
                rope_parameters=_rope_out(config.rope_parameters), **_token_fields(config))


def _sliding(config: TLMConfig) -> bool:
    return "sliding_attention" in config.layer_types


def _fields_for(model_type: str, config: TLMConfig, width: int) -> dict:
    """transformers config fields of ``model_type`` that describe ``config`` (the inverse of archs' mapping)."""
    if model_type == "gpt2":
        scalar = config.query_pre_attn_scalar
        return dict(vocab_size=config.vocab_size, n_embd=config.hidden_size, n_layer=config.num_hidden_layers,
                    n_head=config.num_attention_heads, n_inner=int(width), n_positions=config.max_position_embeddings,
                    activation_function=config.hidden_act, layer_norm_epsilon=config.norm_eps,
                    scale_attn_weights=scalar is None, attn_pdrop=config.attention_dropout,
                    initializer_range=config.initializer_range, use_cache=config.use_cache,
                    tie_word_embeddings=config.tie_word_embeddings, **_token_fields(config))
    fields = _decoder_fields(config, width)
    if model_type == "gemma3_text":
        fields.pop("rope_parameters")
        full = _rope_out(config.rope_parameters)
        local = _rope_out(config.local_rope_parameters) or full
        scalar = config.query_pre_attn_scalar
        if scalar is not None and float(scalar).is_integer():
            scalar = int(scalar)  # Gemma3TextConfig types it as int
        fields.update(hidden_activation=config.hidden_act, attention_bias=config.attention_bias,
                      query_pre_attn_scalar=scalar,
                      layer_types=list(config.layer_types), sliding_window=config.sliding_window,
                      rope_parameters={"full_attention": full, "sliding_attention": local},
                      final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False)
        return fields
    fields["hidden_act"] = config.hidden_act
    if model_type == "llama":
        fields.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    elif model_type == "mistral":
        fields["sliding_window"] = config.sliding_window if _sliding(config) else None
    elif model_type in ("qwen2", "qwen3"):
        sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
        fields.update(use_sliding_window=bool(sliding), sliding_window=config.sliding_window if sliding else None,
                      max_window_layers=sliding[0] if sliding else config.num_hidden_layers,
                      layer_types=list(config.layer_types))
        if model_type == "qwen3":
            fields["attention_bias"] = config.attention_bias
    return fields


# keys of a source config that the export recomputes or that must not travel to the new checkpoint
_DROP_SOURCE_KEYS = ("model_type", "transformers_version", "architectures", "auto_map", "per_layer_config",
                     "serialize_explicit_per_layer_config", "allow_global_per_layer_attribute_access",
                     "_name_or_path", "name_or_path", "_model_name_or_path", "quantization_config", "rope_scaling",
                     "rope_theta", "dtype",
                     "torch_dtype", "block_configs", "_attn_implementation_autoset")


def uniform_hf_config(config: TLMConfig, model_type: str, source: Source | None, width: int,
                      dtype: torch.dtype = torch.float32):
    """A stock transformers config of ``model_type`` describing ``config`` with every MLP ``width`` wide.

    Fields the TLM does not model (dropouts, token ids of the source, ...) are kept from the source config when
    it has the same model_type.
    """
    from transformers import AutoConfig

    fields: dict = {}
    src = source.hf_config if source is not None else None
    if src is not None:
        src = src.text_config if src.model_type == "gemma3" else src
        src_type = "gemma3_text" if src.model_type in ("gemma3", "gemma3_text") else src.model_type
        if src_type == model_type:
            try:
                fields = src.to_dict()
            except Exception:  # e.g. a heterogeneous source config: rebuild from the TLM only
                fields = {}
    for key in _DROP_SOURCE_KEYS:
        fields.pop(key, None)
    fields.update(_fields_for(model_type, config, width))
    try:
        hf_config = AutoConfig.for_model(model_type, **fields)
    except Exception as err:
        raise ConversionError(f"cannot describe this TLM as a {model_type} config ({one_line(err)}); use --export "
                              "tlm") from None
    hf_config.dtype = dtype
    return hf_config


_COMPARED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "hidden_act", "mlp_gated", "mlp_bias", "norm_type", "norm_eps", "norm_offset",
                    "sandwich_norm", "attention_bias", "attention_out_bias", "qk_norm", "query_pre_attn_scalar",
                    "position_embedding", "max_position_embeddings", "rope_parameters", "local_rope_parameters",
                    "layer_types", "sliding_window", "scale_embeddings", "tie_word_embeddings")


def _norm(value):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        return {k: _norm(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value


def check_round_trip(hf_config, config: TLMConfig, fmt: str) -> None:
    """ConversionError unless importing ``hf_config`` gives back the block of ``config`` (the export is exact)."""
    try:
        back = tlm_config_from_hf(hf_config)
    except ValueError as err:
        raise ConversionError(f"export '{fmt}' cannot represent this TLM as {hf_config.model_type} "
                              f"({one_line(err)}); use --export tlm") from None
    diffs = []
    for name in _COMPARED_FIELDS:
        mine, theirs = getattr(config, name, None), getattr(back, name, None)
        if name == "local_rope_parameters" and not _sliding(config):
            continue  # unused without sliding layers
        if name == "sliding_window" and not _sliding(config):
            continue
        if name == "max_position_embeddings" and config.position_embedding != "learned" and \
                config.rope_parameters.get("rope_type") != "llama3":
            continue  # only the learned table and llama3 scaling depend on it
        if _norm(mine) != _norm(theirs):
            diffs.append(f"{name}={mine!r} ({hf_config.model_type} gives {theirs!r})")
    if diffs:
        raise ConversionError(f"export '{fmt}' cannot represent this TLM as {hf_config.model_type}: "
                              f"{'; '.join(diffs[:4])}; use --export tlm")


# ============================================================================================== tensors


def _template(name: str) -> tuple[str, int | None]:
    m = re.search(r"\.(\d+)\.", name)
    if m is None:
        return name, None
    return name[: m.start()] + ".{i}." + name[m.end():], int(m.group(1))


def hf_state_dict_from_tlm(config: TLMConfig, state_dict, model_type: str) -> dict[str, torch.Tensor]:
    """Source-architecture tensors for a TLM state dict: the inverse of ``archs.tlm_state_dict_from_hf``.

    GPT-2: q/k/v are fused back into ``c_attn`` and linear weights transposed to Conv1D layout; Gemma 3: the norm
    names go back to Gemma's. A tied ``lm_head.weight`` is dropped (transformers re-ties it).
    """
    family = SUPPORTED_ARCHITECTURES[model_type]
    inverse: dict[str, tuple[str, str, int, int]] = {}
    for src, (targets, kind) in TENSOR_TABLES[family].items():
        targets = (targets,) if isinstance(targets, str) else targets
        for j, target in enumerate(targets):
            inverse[target] = (src, kind, j, len(targets))
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, list] = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        template, layer = _template(name)
        if template not in inverse:
            raise ConversionError(f"TLM tensor '{name}' has no place in a {model_type} checkpoint; use --export tlm")
        src, kind, j, n = inverse[template]
        src_name = src.format(i=layer) if layer is not None else src
        if n == 1:
            out[src_name] = tensor.t().contiguous() if kind == CONV1D else tensor
            continue
        slot = parts.setdefault(src_name, [None] * n)
        slot[j] = tensor
        if all(p is not None for p in slot):
            if kind == QKV_CONV1D:
                out[src_name] = torch.cat([p.t() for p in slot], dim=1).contiguous()
            elif kind == QKV_BIAS:
                out[src_name] = torch.cat(slot, dim=0)
            else:
                raise AssertionError(kind)
            del parts[src_name]
    if parts:
        name = next(iter(parts))
        raise ConversionError(f"cannot rebuild {model_type} tensor '{name}': some of its q/k/v parts are missing "
                              "from the TLM state dict")
    assert all(kind in (COPY, CONV1D, QKV_CONV1D, QKV_BIAS) for _, kind in TENSOR_TABLES[family].values())
    return out


def pad_mlp_state_dict(config: TLMConfig, state_dict, width: int) -> dict[str, torch.Tensor]:
    """Every layer's MLP zero-padded to ``width`` neurons (TLM names): the model computes the same function.

    New neurons get zero gate/up rows (and bias entries) and zero down_proj columns; silu(0)·0 = 0, gelu(0) = 0.
    """
    out = dict(state_dict)
    for i, w in enumerate(config.intermediate_sizes):
        if w > width:
            raise ConversionError(f"layer {i} is {w} wide, more than the padded width {width}")
        if w == width:
            continue
        extra = width - w
        for name in ("gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias"):
            key = f"model.layers.{i}.mlp.{name}"
            if key in out:
                t = out[key]
                out[key] = torch.cat([t, t.new_zeros((extra, *t.shape[1:]))], dim=0)
        key = f"model.layers.{i}.mlp.down_proj.weight"
        t = out[key]
        out[key] = torch.cat([t, t.new_zeros((t.shape[0], extra))], dim=1)
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_size: int | str = "5GB") -> list[Path]:
    """Write ``tensors`` as model.safetensors (or shards + model.safetensors.index.json); returns the files."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    clean: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():  # safetensors refuses tensors that share memory: copy the second one
        tensor = tensor.detach().contiguous()
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key in seen or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
            tensor = tensor.clone()
        seen.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        clean[name] = tensor
    split = split_torch_state_dict_into_shards(clean, max_shard_size=max_shard_size)
    files = []
    for file_name, names in split.filename_to_tensors.items():
        save_file({n: clean[n] for n in names}, str(out / file_name), metadata={"format": "pt"})
        files.append(out / file_name)
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in clean.values())},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return files


# ============================================================================================== deci


def ffn_mult_for(width: int, hidden_size: int) -> float:
    """DeciLM ``ffn_mult`` for an MLP width (a multiple of 256): 1.5·w/h."""
    return 1.5 * width / hidden_size


def deci_width(ffn_mult: float, hidden_size: int) -> int:
    """The width vLLM / SGLang / llama.cpp / mlx-lm derive: find_multiple(int(2·ffn_mult·h/3), 256)."""
    n = int(2 * ffn_mult * hidden_size / 3)
    return n if n % DECI_MULTIPLE == 0 else n + DECI_MULTIPLE - n % DECI_MULTIPLE


_DECI_FAMILY_REASONS = {
    "qwen2": "q/k/v biases, which only vLLM loads",
    "qwen3": "per-head q/k norms",
    "gemma3": "Gemma 3 blocks: sandwich and (1+w) norms, q/k norms, scaled embeddings",
    "gpt2": "LayerNorm, learned positions and an ungated GELU MLP with biases",
}


def check_deci(config: TLMConfig, source: Source | None = None) -> list[float]:
    """The per-layer ``ffn_mult`` values, or ConversionError saying why ``deci`` cannot hold this model."""
    model_type = target_model_type(config, source)
    _check_mixers(config, "deci", "DeciLM")
    family = SUPPORTED_ARCHITECTURES.get(model_type, model_type)
    if family != "llama":
        raise ConversionError(f"export 'deci' cannot represent {model_type} ({_DECI_FAMILY_REASONS[family]}); use "
                              "--export tlm or hf")
    if _sliding(config):
        raise ConversionError(f"export 'deci' cannot represent sliding-window attention ({model_type}, "
                              f"sliding_window={config.sliding_window}); use --export tlm or hf")
    if config.attention_bias or config.attention_out_bias or config.mlp_bias:
        which = [n for n in ("attention_bias", "attention_out_bias", "mlp_bias") if getattr(config, n)]
        raise ConversionError(f"export 'deci' cannot represent biases ({', '.join(which)}): the serving engines do "
                              "not load them; use --export tlm or hf")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConversionError("export 'deci' needs num_attention_heads divisible by num_key_value_heads; use "
                              "--export tlm or hf")
    bad = [(i, w) for i, w in enumerate(config.intermediate_sizes) if w % DECI_MULTIPLE]
    if bad:
        i, w = bad[0]
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ConversionError(f"export 'deci' needs MLP widths that are multiples of {DECI_MULTIPLE} (layer {i} has "
                              f"{w}{more}); re-run with --multiple-of {DECI_MULTIPLE} or use --export tlm")
    mults = []
    for i, w in enumerate(config.intermediate_sizes):
        mult = ffn_mult_for(w, config.hidden_size)
        if deci_width(mult, config.hidden_size) != w or not math.isfinite(mult):
            raise ConversionError(f"export 'deci' cannot encode layer {i}'s width {w} as ffn_mult (it reads back as "
                                  f"{deci_width(mult, config.hidden_size)}); use --export tlm or hf")
        mults.append(mult)
    return mults


_DECI_KEEP = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
              "initializer_range", "tie_word_embeddings", "attention_bias", "attention_dropout", "mlp_bias",
              "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "dtype")


def _export_deci(config: TLMConfig, state_dict, out: Path, source: Source | None, max_shard_size) -> None:
    mults = check_deci(config, source)
    widths = list(config.intermediate_sizes)
    llama_source = source if source is not None and source.hf_config is not None and \
        source.hf_config.model_type == "llama" else None
    hf_config = uniform_hf_config(config, "llama", llama_source, max(widths), _state_dtype(state_dict))
    check_round_trip(hf_config, config, "deci")
    tensors = hf_state_dict_from_tlm(config, state_dict, "llama")
    group = config.num_attention_heads // config.num_key_value_heads
    full = hf_config.to_dict()
    fields = hf_config.to_diff_dict()  # without the generic PreTrainedConfig defaults (id2label, ...)
    fields.update({k: full[k] for k in _DECI_KEEP if k in full})  # engines read config.json raw: be explicit
    fields.update(
        model_type="nemotron-nas",
        architectures=["DeciLMForCausalLM"],
        auto_map={"AutoConfig": "configuration_decilm.DeciLMConfig",
                  "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"},
        block_configs=[{"attention": {"n_heads_in_group": group, "no_op": False, "replace_with_linear": False},
                        "ffn": {"ffn_mult": mult, "no_op": False, "replace_with_linear": False,
                                "intermediate_size": int(w)}}
                       for mult, w in zip(mults, widths)],
    )
    rope = hf_config.rope_parameters or {}
    fields["rope_theta"] = rope.get("rope_theta", 10000.0)  # the pre-v5 spelling older engines read
    if rope.get("rope_type", "default") != "default":
        fields["rope_scaling"] = dict(rope)
    for key in ("per_layer_config", "serialize_explicit_per_layer_config"):
        fields.pop(key, None)
    (out / "config.json").write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / "configuration_decilm.py").write_text(DECI_CONFIGURATION_SOURCE, encoding="utf-8")
    (out / "modeling_decilm.py").write_text(DECI_MODELING_SOURCE, encoding="utf-8")
    write_safetensors(tensors, out, max_shard_size)


# ============================================================================================== tokenizer etc.


def copy_tokenizer(source: Source | None, out: Path) -> None:
    if source is None or source.tokenizer_source is None:
        return
    path, kwargs = source.tokenizer_kwargs()
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(path, **kwargs).save_pretrained(str(out))
        return
    except Exception as err:
        problem = one_line(err)
    copied = []
    if not kwargs and Path(path).is_dir():
        for name in TOKENIZER_FILES:  # copied verbatim when the tokenizer cannot be re-saved
            file = Path(path) / name
            if file.is_file():
                (out / name).write_bytes(file.read_bytes())
                copied.append(name)
    if not copied:
        warnings.warn(f"the tokenizer of '{path}' could not be copied ({problem}); add the tokenizer files to "
                      f"'{out}' by hand", stacklevel=3)


def write_generation_config(source: Source | None, instance, fmt: str, out: Path) -> None:
    generation_config = getattr(source, "generation_config", None) if source is not None else None
    if generation_config is None and fmt != "tlm":  # save_pretrained already wrote the model's own
        generation_config = getattr(instance, "generation_config", None)
    if generation_config is None:
        return
    try:
        generation_config.save_pretrained(str(out))
    except Exception as err:  # an invalid source generation config must not sink the export
        warnings.warn(f"generation_config.json was not written ({one_line(err)})", stacklevel=3)


# ============================================================================================== remote code


_TAPERED_TEMPLATE = '''"""Tapered {arch}: transformers' stock {arch} with one MLP width per layer.

Written by tlm-convert (tapered-lm). config.json is a stock `{model_type}` config whose `per_layer_config` gives
every layer's `{width_key}`; the stock classes refuse it (the global width is ambiguous), these subclasses build
the stock model and then replace layer i's MLP with the stock MLP at `config.per_layer_config[i].{width_key}`.
Everything else is inherited unchanged. Load with:

    AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
"""

import logging
from contextlib import contextmanager

from transformers.models.{module}.modeling_{module} import {base}, {causal_lm}, {mlp}

_HETEROGENEITY_LOGGER = logging.getLogger("transformers.integrations.heterogeneity.configuration_utils")


@contextmanager
def _global_width_access(config):
    """Let the stock constructor read the global width while it builds the layers that are replaced below."""
    had_flag = "allow_global_per_layer_attribute_access" in config.__dict__
    previous_flag = config.allow_global_per_layer_attribute_access
    previous_level = _HETEROGENEITY_LOGGER.level
    config.allow_global_per_layer_attribute_access = True
    _HETEROGENEITY_LOGGER.setLevel(logging.ERROR)
    try:
        yield
    finally:
        _HETEROGENEITY_LOGGER.setLevel(previous_level)
        if had_flag:
            config.allow_global_per_layer_attribute_access = previous_flag
        else:
            config.__dict__.pop("allow_global_per_layer_attribute_access", None)


def _layer_mlp(layer_config):
{make_mlp}


class Tapered{base}({base}):
    def __init__(self, config):
        with _global_width_access(config):
            super().__init__(config)
        for i, layer in enumerate(self.{layers}):
            layer.mlp = _layer_mlp(config.per_layer_config[i])
        self.post_init()


class Tapered{causal_lm}({causal_lm}):
    def __init__(self, config):
        with _global_width_access(config):
            super().__init__(config)
        self.{prefix} = Tapered{base}(config)
        self.post_init()


__all__ = ["Tapered{base}", "Tapered{causal_lm}"]
'''


def tapered_modeling_source(model_type: str) -> str:
    """The ``modeling_tapered.py`` written beside an ``hf`` export of ``model_type``."""
    module, base, causal_lm, mlp, layers, prefix = STOCK_CLASSES[model_type]
    if model_type == "gpt2":
        make_mlp = ("    width = layer_config.n_inner\n"
                    "    if width is None:\n"
                    "        width = 4 * layer_config.hidden_size\n"
                    f"    return {mlp}(width, layer_config)")
    else:
        make_mlp = f"    return {mlp}(layer_config)"
    arch = causal_lm.replace("ForCausalLM", "").replace("LMHeadModel", "")
    return _TAPERED_TEMPLATE.format(arch=arch, model_type=model_type, width_key=WIDTH_KEY[model_type], module=module,
                                    base=base, causal_lm=causal_lm, mlp=mlp, layers=layers, prefix=prefix,
                                    make_mlp=make_mlp)


DECI_CONFIGURATION_SOURCE = '''"""DeciLM (`nemotron-nas`) configuration: a Llama config plus one `block_configs` entry
per layer.

Written by tlm-convert (tapered-lm), minimal: it reads and writes the schema of NVIDIA's Nemotron-NAS checkpoints
(`attention`: n_heads_in_group, no_op, replace_with_linear; `ffn`: ffn_mult, no_op, replace_with_linear,
intermediate_size) and exposes the entries as attribute objects (`config.block_configs[i].ffn.ffn_mult`), which is
how vLLM and SGLang read them.
"""

import dataclasses

from transformers import LlamaConfig


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


def ffn_mult_to_intermediate_size(ffn_mult: float, hidden_size: int) -> int:
    """The MLP width the serving engines derive from ffn_mult."""
    return find_multiple(int(2 * ffn_mult * hidden_size / 3), 256)


def _known(cls, values):
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in (values or {}).items() if k in names}


@dataclasses.dataclass
class AttentionConfig:
    n_heads_in_group: int = None
    no_op: bool = False
    replace_with_linear: bool = False


@dataclasses.dataclass
class FFNConfig:
    ffn_mult: float = None
    no_op: bool = False
    replace_with_linear: bool = False
    intermediate_size: int = None


@dataclasses.dataclass
class BlockConfig:
    attention: AttentionConfig
    ffn: FFNConfig

    @classmethod
    def from_dict(cls, values):
        attention, ffn = values.get("attention"), values.get("ffn")
        if not isinstance(attention, AttentionConfig):
            attention = AttentionConfig(**_known(AttentionConfig, attention))
        if not isinstance(ffn, FFNConfig):
            ffn = FFNConfig(**_known(FFNConfig, ffn))
        return cls(attention=attention, ffn=ffn)

    def to_dict(self):
        return dataclasses.asdict(self)


class DeciLMConfig(LlamaConfig):
    model_type = "nemotron-nas"

    def __init__(self, block_configs=None, **kwargs):
        super().__init__(**kwargs)
        self.block_configs = [b if isinstance(b, BlockConfig) else BlockConfig.from_dict(b)
                              for b in block_configs or []]

    def to_dict(self):
        output = super().to_dict()
        output["block_configs"] = [b.to_dict() for b in self.block_configs]
        return output


__all__ = ["DeciLMConfig", "BlockConfig", "AttentionConfig", "FFNConfig", "ffn_mult_to_intermediate_size"]
'''


DECI_MODELING_SOURCE = '''"""DeciLM (`nemotron-nas`) for transformers: Llama with a per-layer MLP width and key/value
head count.

Written by tlm-convert (tapered-lm), minimal: layer i's MLP width is
find_multiple(int(2 * ffn_mult * hidden_size / 3), 256) (the rule of vLLM, SGLang and llama.cpp), its key/value
heads num_attention_heads // n_heads_in_group. no_op and replace_with_linear blocks are not implemented.
"""

import copy

from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel

from .configuration_decilm import DeciLMConfig, ffn_mult_to_intermediate_size


def _layer_config(config, layer_idx):
    block = config.block_configs[layer_idx]
    for part in ("attention", "ffn"):
        sub = getattr(block, part)
        if sub.no_op or sub.replace_with_linear:
            raise NotImplementedError(f"layer {layer_idx}: {part} no_op / replace_with_linear blocks are not "
                                      "implemented by this minimal DeciLM code")
    layer_config = copy.copy(config)
    if block.ffn.ffn_mult is not None:
        layer_config.intermediate_size = ffn_mult_to_intermediate_size(block.ffn.ffn_mult, config.hidden_size)
    else:
        layer_config.intermediate_size = block.ffn.intermediate_size
    if block.attention.n_heads_in_group:
        layer_config.num_key_value_heads = config.num_attention_heads // block.attention.n_heads_in_group
    return layer_config


class DeciLMModel(LlamaModel):
    config_class = DeciLMConfig

    def __init__(self, config):
        super().__init__(config)
        for i, layer in enumerate(self.layers):
            layer_config = _layer_config(config, i)
            layer.mlp = LlamaMLP(layer_config)
            if layer_config.num_key_value_heads != config.num_key_value_heads:
                layer.self_attn = LlamaAttention(layer_config, i)
        self.post_init()


class DeciLMForCausalLM(LlamaForCausalLM):
    config_class = DeciLMConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = DeciLMModel(config)
        self.post_init()


__all__ = ["DeciLMModel", "DeciLMForCausalLM"]
'''


__all__ = [
    "FORMATS",
    "STOCK_CLASSES",
    "export_model",
    "target_model_type",
    "uniform_hf_config",
    "check_round_trip",
    "hf_state_dict_from_tlm",
    "pad_mlp_state_dict",
    "write_safetensors",
    "check_deci",
    "ffn_mult_for",
    "deci_width",
    "tapered_modeling_source",
]
