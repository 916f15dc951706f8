"""Writing a TLM (tapered or not) in one of five checkpoint formats (:data:`FORMATS`).

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
* ``"gguf"``: one ``model.gguf`` for llama.cpp (tlm_io.gguf_export): its deci/llama architecture with the exact
  per-layer widths.

The Python files of the ``hf`` and ``deci`` views are modules of :mod:`tlm_io.templates`, rendered or copied.
A format that cannot represent the model exactly raises ConversionError saying why and what to use instead.
Files are written only inside ``out_dir`` (the caller makes it a temporary folder and renames it when done).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch

from tlm import TLMConfig, TLMForCausalLM

from .archs import SUPPORTED_ARCHITECTURES
from .checkpoint import Source, load_source
from .errors import ConversionError, one_line
from .gguf_export import GGUF_FILE, write_gguf
from .hf_layout import (
    STOCK_CLASSES,
    WIDTH_KEY,
    check_mixers,
    check_round_trip,
    hf_state_dict_from_tlm,
    pad_mlp_state_dict,
    target_model_type,
    uniform_hf_config,
    uses_sliding_window,
    with_widths,
)
from .load import load_tokenizer
from .outputs import check_output_given, check_output_path, output_run, staged
from .shapes import check_tlm_state_dict
from .templates import DECI_FILES, TAPERED_FILE, render_tapered, template_bytes
from .templates.configuration_decilm import ffn_mult_to_intermediate_size as deci_width
from .tokenizer_source import TOKENIZER_FILES

FORMATS = ("tlm", "hf", "deci", "padded", "gguf")
DECI_MULTIPLE = 256


# ============================================================================================== entry point


def export_model(model, out_dir, fmt: str = "tlm", source: Source | None = None, *,
                 max_shard_size: int | str = "5GB", gguf_type: str | None = None) -> Path:
    """Write ``model`` (a TLMForCausalLM, or a (TLMConfig, state_dict) pair with TLM names) to ``out_dir``.

    ``source`` (the loaded source model, optional) decides the architecture of the ``hf`` / ``padded`` / ``deci``
    views and supplies the tokenizer and generation config. Without it the architecture is inferred from the
    TLM block options. ``gguf_type``: the weight type of a ``gguf`` export (gguf_export.WEIGHT_TYPES; default the
    dtype of the weights). Returns ``Path(out_dir)``.
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
    elif fmt == "gguf":  # one file for llama.cpp: gguf_export.py
        tokenizer = None if source is None else load_tokenizer(source)
        write_gguf(config, state_dict, out / GGUF_FILE, tokenizer, gguf_type, name=_model_name(source))
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


def export_checkpoint(model_path, out_dir, fmt: str, weight_type: str | None = None) -> Path:
    """``tlm export``: an existing checkpoint (TLM, converted, transformers folder or .gguf) written as ``fmt``
    into ``out_dir`` (which must not exist; written through a temporary folder, so a failure leaves nothing).

    ``weight_type``: f32 / f16 / bf16 (every format) or q8_0 (gguf only); default f32.
    """
    dtypes = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    if weight_type is not None and weight_type not in dtypes and not (fmt == "gguf" and weight_type == "q8_0"):
        raise ConversionError(f"weight type {weight_type!r} is not available for --to {fmt}; use one of "
                              f"{', '.join(dtypes)}{', q8_0' if fmt == 'gguf' else ''}")
    check_output_given(out_dir)
    out = Path(out_dir)
    check_output_path(model_path, out, overwrite=False, overwrite_flag=None)  # not the input, nor around it
    src = load_source(model_path)
    state = src.state_dict
    if fmt != "gguf" and weight_type is not None:
        state = {k: v.to(dtypes[weight_type]) if v.is_floating_point() else v for k, v in state.items()}
    with output_run(out), staged(out, "tlm export") as tmp:
        export_model((src.tlm_config, state), tmp, fmt, src, gguf_type=weight_type)
    return out


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
    check_mixers(config, fmt, model_type)
    widths = list(config.intermediate_sizes)
    if fmt == "padded":
        width = max(widths)
        state_dict = pad_mlp_state_dict(config, state_dict, width)
        config = with_widths(config, [width] * config.num_hidden_layers)
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
        (out / TAPERED_FILE).write_text(tapered_modeling_source(model_type), encoding="utf-8")
    else:
        hf_config.architectures = [stock[2]]
    hf_config.save_pretrained(str(out))
    write_safetensors(tensors, out, max_shard_size)


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


_DECI_FAMILY_REASONS = {
    "qwen2": "q/k/v biases, which only vLLM loads",
    "qwen3": "per-head q/k norms",
    "gemma3": "Gemma 3 blocks: sandwich and (1+w) norms, q/k norms, scaled embeddings",
    "gpt2": "LayerNorm, learned positions and an ungated GELU MLP with biases",
}


def check_deci(config: TLMConfig, source: Source | None = None) -> list[float]:
    """The per-layer ``ffn_mult`` values, or ConversionError saying why ``deci`` cannot hold this model."""
    model_type = target_model_type(config, source)
    check_mixers(config, "deci", "DeciLM")
    family = SUPPORTED_ARCHITECTURES.get(model_type, model_type)
    if family != "llama":
        raise ConversionError(f"export 'deci' cannot represent {model_type} ({_DECI_FAMILY_REASONS[family]}); use "
                              "--export tlm or hf")
    if uses_sliding_window(config):
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
                              f"{w}{more}); convert with --set multiple_of={DECI_MULTIPLE} or use --export tlm")
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
    for name in DECI_FILES:
        (out / name).write_bytes(template_bytes(name))
    write_safetensors(tensors, out, max_shard_size)


# ============================================================================================== tokenizer etc.


def _model_name(source: Source | None) -> str:
    return Path(source.path).stem if source is not None and source.path else "tapered-lm"


def copy_tokenizer(source: Source | None, out: Path) -> None:
    if source is None or source.tokenizer_source is None:
        return
    path, kwargs = source.tokenizer_kwargs()
    try:
        load_tokenizer(source).save_pretrained(str(out))
        portable_tokenizer_config(out)
        return
    except Exception as err:  # transformers' tokenizer code (the folder's own with trust_remote_code)
        problem = one_line(err)
    copied = []
    if "gguf_file" not in kwargs and Path(path).is_dir():
        for name in TOKENIZER_FILES:  # copied verbatim when the tokenizer cannot be re-saved
            file = Path(path) / name
            if file.is_file():
                (out / name).write_bytes(file.read_bytes())
                copied.append(name)
    if not copied:
        warnings.warn(f"the tokenizer of '{path}' could not be copied ({problem}); add the tokenizer files to "
                      f"'{out}' by hand", stacklevel=3)


# what transformers 5 writes after reading a GGUF or a tokenizer.json alone; transformers 4.x has no such class
_V5_ONLY_TOKENIZER_CLASSES = ("TokenizersBackend",)


def portable_tokenizer_config(out: Path) -> None:
    """tokenizer_config.json that transformers 4.x and 5.x both load without remote code: a v5-only class name
    becomes PreTrainedTokenizerFast (the tokenizer.json beside it is the whole tokenizer); no tokenizer auto_map
    unless the class is the source's own code (copied beside it, loaded only with trust_remote_code)."""
    path = out / "tokenizer_config.json"
    if not path.is_file():
        return
    fields = json.loads(path.read_text(encoding="utf-8"))
    if fields.get("tokenizer_class") in _V5_ONLY_TOKENIZER_CLASSES and (out / "tokenizer.json").is_file():
        fields["tokenizer_class"] = "PreTrainedTokenizerFast"
    import transformers

    if hasattr(transformers, str(fields.get("tokenizer_class"))):
        fields.pop("auto_map", None)
    path.write_text(json.dumps(fields, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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


def tapered_modeling_source(model_type: str) -> str:
    """The ``modeling_tapered.py`` written beside an ``hf`` export of ``model_type``."""
    module, base, causal_lm, mlp, layers, prefix = STOCK_CLASSES[model_type]
    arch = causal_lm.replace("ForCausalLM", "").replace("LMHeadModel", "")
    return render_tapered(model_type, arch=arch, width_key=WIDTH_KEY[model_type], module=module, base=base,
                          causal_lm=causal_lm, mlp=mlp, layers=layers, prefix=prefix)


__all__ = ["FORMATS", "export_model", "export_checkpoint", "portable_tokenizer_config", "write_safetensors",
           "check_deci", "ffn_mult_for", "deci_width", "tapered_modeling_source"]
