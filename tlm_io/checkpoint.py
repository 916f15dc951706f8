"""Reading a source checkpoint into TLM tensors: :func:`load_source` and the :class:`Source` it returns.

``load_source(source)`` accepts

* a transformers model folder: ``config.json`` plus ``model.safetensors``, a sharded safetensors set
  (``model.safetensors.index.json``), ``pytorch_model.bin`` or a sharded ``.bin`` set (read with
  ``torch.load(weights_only=True)``: no pickled code runs);
* a ``.gguf`` file (or a folder holding exactly one), dequantised to fp32: a llama GGUF tensor by tensor from
  the memory-mapped file (the values of transformers' loader, without its whole-model copy), other
  architectures through transformers' GGUF loader;
* a TLM checkpoint folder (``config.json`` with ``model_type: "tlm"``);
* a hub id ``org/name`` that is not a local path: downloaded with ``huggingface_hub.snapshot_download`` unless
  ``HF_HUB_OFFLINE`` is set.

and returns a :class:`Source`: the source config, the TLMConfig that mirrors it exactly and the state dict under
TLM names. Every problem is a :class:`~tlm_io.errors.ConversionError` with a one-line message: missing path,
folder without ``config.json``, config without weights, corrupt or truncated files, unsupported architectures,
settings TLM cannot reproduce, NaN/Inf weights (the first bad tensor is named).

The steps live beside it, one concern each: :mod:`tlm_io.locate` (which file or folder; hub downloads, built-in
names), :mod:`tlm_io.readers` (safetensors and .bin tensors, one at a time), :mod:`tlm_io.gguf_reader` (GGUF
tensors), :mod:`tlm_io.config_import` (the source config and the TLMConfig mirroring it),
:mod:`tlm_io.tokenizer_source` (where the tokenizer is) and :mod:`tlm_io.shapes` (state dict against config).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tlm import TLMConfig

from .archs import SUPPORTED_ARCHITECTURES, family_of, tlm_state_dict_from_hf
from .bounded import read_json
from .config_import import (
    generation_config_of,
    import_hf_config,
    read_gguf_config,
    read_hf_config,
    read_tlm_config,
    tie_missing_head,
    unsupported_error,
)
from .errors import ConversionError, one_line
from .gguf_reader import check_gguf_header, read_gguf_model, read_gguf_tensors
from .locate import locate
from .readers import read_state_dict, weight_files
from .shapes import check_tlm_state_dict, count_params
from .sizes import check_model_size
from .tokenizer_source import tokenizer_folder, tokenizer_kwargs


@dataclass
class Source:
    """A loaded source model.

    kind: "hf" (transformers folder), "gguf" or "tlm". path: the folder or .gguf file read (a hub id resolves
    to its downloaded folder). hf_config: the source transformers config (None for a TLM checkpoint). family:
    the archs family ("llama", "qwen2", "qwen3", "gemma3", "gpt2") or "tlm". tlm_config: the TLMConfig that
    reproduces the source exactly. state_dict: TLM tensor names; with tied embeddings ``lm_head.weight`` is the
    very tensor of ``model.embed_tokens.weight``. tokenizer_source: what AutoTokenizer.from_pretrained takes
    (a folder, or (folder, gguf_file) to be passed as ``gguf_file=``), None when the source has no tokenizer.
    num_params: parameters of the model (tied tensors counted once). generation_config: the source's
    GenerationConfig when it has one. notes: what was adjusted while loading (for the CLI to print).
    trust_remote_code: whether the tokenizer may run the folder's own code (the user's --trust-remote-code).
    """

    kind: str
    path: str
    hf_config: object | None
    family: str
    tlm_config: TLMConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer_source: str | tuple[str, str] | None
    num_params: int
    generation_config: object | None = None
    notes: list[str] = field(default_factory=list)
    trust_remote_code: bool = False

    @property
    def model_type(self) -> str:
        """The source's transformers model_type ("tlm" for a TLM checkpoint)."""
        return "tlm" if self.hf_config is None else self.hf_config.model_type

    def tokenizer_kwargs(self) -> tuple[str, dict] | None:
        """(path, kwargs) for ``AutoTokenizer.from_pretrained``; None when the source has no tokenizer."""
        return tokenizer_kwargs(self.tokenizer_source, self.trust_remote_code)


def load_source(source: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                trust_remote_code: bool = False) -> Source:
    """Load a transformers folder, a .gguf file, a TLM checkpoint or a hub id ``org/name`` (see the module doc).
    ``trust_remote_code`` lets the tokenizer run the source's own code (never the model: only known architectures
    are read)."""
    dtype = _as_dtype(dtype)
    path = locate(source)
    src = _load_gguf(path, dtype) if path.is_file() else _load_folder(path, dtype)
    src.trust_remote_code = trust_remote_code
    return src


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if str(dtype).replace("torch.", "") not in names:
        raise ConversionError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return names[str(dtype).replace("torch.", "")]


def _load_folder(path: Path, dtype: torch.dtype) -> Source:
    raw = read_json(path / "config.json", "model config", finite=True)
    check_model_size(raw, path / "config.json")  # before anything is built
    model_type = raw.get("model_type")
    if model_type == "tlm":
        return _load_tlm(path, dtype)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise unsupported_error(model_type, raw.get("architectures"), path)
    hf_config = read_hf_config(path, raw)
    weight_files(path)  # "config without weights" before anything is read
    tensors = read_state_dict(path, dtype, SUPPORTED_ARCHITECTURES[model_type])
    src = _from_hf("hf", path, hf_config, tensors, tokenizer_source=tokenizer_folder(path),
                   generation_config=generation_config_of(path))
    if isinstance(raw.get("auto_map"), dict) and raw["auto_map"]:  # never run: the model is read by its model_type
        src.notes.append(f"config.json's auto_map ({', '.join(map(str, raw['auto_map'].values()))}) was ignored: the "
                         f"model is read as {model_type} by tapered-lm's own code, and the folder's Python files are "
                         "not copied")
    return src


def _load_tlm(path: Path, dtype: torch.dtype) -> Source:
    config = read_tlm_config(path)
    weight_files(path)
    tensors = read_state_dict(path, dtype)
    notes = []
    tie_missing_head(config, tensors, notes)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    check_tlm_state_dict(config, tensors, where=str(path))
    return Source(kind="tlm", path=str(path), hf_config=None, family="tlm", tlm_config=config, state_dict=tensors,
                  tokenizer_source=tokenizer_folder(path), num_params=count_params(tensors),
                  generation_config=generation_config_of(path), notes=notes)


def _load_gguf(file: Path, dtype: torch.dtype) -> Source:
    check_gguf_header(file)  # a damaged header is named before transformers misreads it
    hf_config = read_gguf_config(file)
    tensors = read_gguf_tensors(file, hf_config, dtype)
    if tensors is not None:  # read tensor by tensor: no transformers model, no second copy of the weights
        from transformers import GenerationConfig

        hf_config.dtype = torch.float32  # as transformers' loader leaves it (it builds the model in float32)
        generation_config = GenerationConfig.from_model_config(hf_config)
    else:
        hf_config, tensors, generation_config = read_gguf_model(file, dtype)
    return _from_hf("gguf", file, hf_config, tensors, tokenizer_source=(str(file.parent), file.name),
                    generation_config=generation_config)


def _from_hf(kind: str, path: Path, hf_config, tensors: dict[str, torch.Tensor], tokenizer_source,
             generation_config) -> Source:
    family = family_of(hf_config)  # the model type was checked by the caller
    notes = []
    _, tlm_config = import_hf_config(path, hf_config, tensors, notes)
    try:
        state_dict = tlm_state_dict_from_hf(hf_config, tensors)
    except ValueError as err:
        detail = one_line(err).removeprefix("checkpoint does not match its config:").strip()
        fix = "re-download it" if kind == "gguf" else "re-download the checkpoint or fix config.json"
        raise ConversionError(f"the weights in '{path}' do not match its config: {detail}; {fix}") from None
    return Source(kind=kind, path=str(path), hf_config=hf_config, family=family, tlm_config=tlm_config,
                  state_dict=state_dict, tokenizer_source=tokenizer_source, num_params=count_params(state_dict),
                  generation_config=generation_config, notes=notes)


__all__ = ["Source", "load_source"]
