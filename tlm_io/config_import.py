"""The config of a source checkpoint: its transformers config read and checked (:func:`read_hf_config`,
:func:`read_gguf_config`; quantized, per-layer and unsupported configs are refused), the TLMConfig that mirrors it
exactly (:func:`import_hf_config`), a TLM checkpoint's own config (:func:`read_tlm_config`), a missing head tied
(:data:`TIED_NOTE`), the generation config beside it. Problems are one-line ConversionErrors that name the file."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

from tlm import TLMConfig

from .archs import SUPPORTED_ARCHITECTURES, canonical_source_state_dict, tlm_config_from_hf
from .errors import ConversionError, one_line
from .sizes import check_model_size

TIED_NOTE = "the checkpoint has no lm_head.weight: the output layer is tied to the input embeddings"


def is_tied(hf_config) -> bool:
    """Whether a transformers config ties the output layer to the input embeddings."""
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def unsupported_error(model_type, architectures, where) -> ConversionError:
    """The one-line error for a model type tlm-convert does not import, naming what it does."""
    arch = f" ({', '.join(map(str, architectures))})" if architectures else ""
    return ConversionError(f"unsupported architecture: model_type {model_type!r}{arch} in '{where}'; tlm-convert "
                           f"imports the model types {', '.join(SUPPORTED_ARCHITECTURES)} and TLM checkpoints")


def read_hf_config(path: Path, raw: dict):
    """The transformers config of a source folder, refusing quantized and per-layer (tapered hf view) configs."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ConversionError(f"'{path}' is a quantized checkpoint (quant_method {method!r}); convert the "
                              "unquantized (bf16/fp16/fp32) model instead")
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as err:  # transformers' reader
        raise ConversionError(f"config.json in '{path}' cannot be read by transformers ({one_line(err)}); fix or "
                              "re-download it") from None
    if getattr(hf_config, "is_heterogeneous", False):
        raise ConversionError(f"'{path}' has per-layer widths (per_layer_config, a tapered --export hf view); "
                              "convert its --export tlm or --export padded view instead")
    return hf_config


def read_gguf_config(file: Path):
    """The transformers config of a .gguf file (its model type checked); ConversionError when it cannot be read."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name, trust_remote_code=False)
    except ImportError:
        raise ConversionError("reading .gguf files needs the gguf package; pip install 'gguf>=0.10' "
                              "(or tapered-lm[gguf])") from None
    except Exception as err:  # transformers' GGUF reader
        text = one_line(err)
        if "not supported" in text:
            raise ConversionError(f"'{file}': {text} by transformers; convert a GGUF of one of the model types "
                                  f"{', '.join(SUPPORTED_ARCHITECTURES)}, or the original safetensors folder") from None
        raise ConversionError(f"'{file}' cannot be read as GGUF ({text}); it is corrupt or truncated, "
                              "re-download it") from None
    if hf_config.model_type not in SUPPORTED_ARCHITECTURES:
        raise unsupported_error(hf_config.model_type, None, file)
    check_model_size(hf_config.to_dict(), file)  # GGUF block_count, embedding_length, ... before anything is built
    return hf_config


def import_hf_config(path, hf_config, tensors: Mapping, notes: list) -> tuple[dict, TLMConfig]:
    """(the source's tensors under canonical names, the TLMConfig that mirrors ``hf_config``) for a transformers
    source whose ``tensors`` (name -> tensor, or anything) are known; a missing head is tied (noted), as
    transformers would otherwise initialise a random one. Problems are one-line ConversionErrors."""
    try:
        canonical = canonical_source_state_dict(hf_config, tensors)
    except ValueError as err:
        raise ConversionError(f"'{path}': {one_line(err)}; re-download the checkpoint") from None
    if "lm_head.weight" not in canonical and not is_tied(hf_config):
        hf_config.tie_word_embeddings = True
        notes.append(TIED_NOTE)
    try:
        return canonical, tlm_config_from_hf(hf_config)
    except ValueError as err:
        raise ConversionError(f"{one_line(err)} (tlm-convert only imports models it reproduces exactly; use a "
                              "checkpoint without these settings)") from None


def read_tlm_config(path: Path) -> TLMConfig:
    """The TLMConfig of a TLM checkpoint folder."""
    try:
        return TLMConfig.from_pretrained(str(path))
    except Exception as err:  # transformers' config reader, then TLMConfig's own checks
        raise ConversionError(f"the TLM config '{path / 'config.json'}' is invalid ({one_line(err)}); fix "
                              "config.json") from None


def tie_missing_head(config: TLMConfig, names, notes: list) -> None:
    """A TLM checkpoint with embeddings and no head gets a tied head (noted)."""
    if "lm_head.weight" not in names and "model.embed_tokens.weight" in names and not config.tie_word_embeddings:
        config.tie_word_embeddings = True
        notes.append(TIED_NOTE)


def generation_config_of(path: Path):
    """The GenerationConfig in a checkpoint folder; None without one, or (with a warning) when it cannot be read."""
    if not (path / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(path))
    except Exception as err:  # transformers' reader; a broken generation config must not block a conversion
        warnings.warn(f"{path / 'generation_config.json'} was not read ({one_line(err)}); the output gets none",
                      stacklevel=2)
        return None


__all__ = ["TIED_NOTE", "generation_config_of", "import_hf_config", "is_tied", "read_gguf_config", "read_hf_config",
           "read_tlm_config", "tie_missing_head", "unsupported_error"]
