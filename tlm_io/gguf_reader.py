"""Reading the tensors of a .gguf file, dequantised to fp32: a llama GGUF tensor by tensor from the memory-mapped
file (:class:`GGUFTensors`: the values of transformers' loader, without its whole-model copy), other architectures
through transformers' GGUF loader (:func:`read_gguf_model`)."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import torch

from .archs import GGUF_LLAMA_NAMES
from .config_import import is_tied
from .errors import ConversionError, one_line
from .readers import TensorIndex, prepare_tensor

_FROM_GGUF = {gguf: name for name, gguf in GGUF_LLAMA_NAMES.items()}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_file(file):
    """A ``gguf.GGUFReader`` of ``file``, shared by every call on the same unchanged file (same path, size and
    modification time): parsing a header takes seconds (SmolLM2's holds 49,152 tokens and their merges), and loading
    a model reads it for its tensors and again for its tokenizer."""
    stat = os.stat(file)
    return _reader(str(Path(file).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _reader(path: str, size: int, mtime_ns: int):
    from gguf import GGUFReader

    return GGUFReader(path)


# the smallest a header entry can be: a tensor's info is a name (8-byte length, 1 byte), a dimension count (4), one
# dimension (8), a type (4) and an offset (8); a key-value pair is a key (8 + 1), a value type (4) and 1 value byte
_MIN_TENSOR_INFO, _MIN_KEY_VALUE = 33, 14


def check_gguf_header(file: Path) -> None:
    """Refuse (ConversionError naming the file and what is wrong) a .gguf whose header cannot be true: counts of
    tensors or key-value pairs that its size cannot hold, a length that runs past its end, tensor data beyond its
    end, or data that no tensor accounts for (a tensor count that is too small). Reads the 24-byte preamble, then
    the header through the gguf package; no tensor data."""
    import struct

    size = os.stat(file).st_size
    with open(file, "rb") as f:
        head = f.read(32)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise ConversionError(f"'{file}' cannot be read as GGUF: it does not begin with the GGUF magic (not a GGUF "
                              "file, or a damaged one); pass a .gguf model file or re-download it")
    order = "<" if struct.unpack("<I", head[4:8])[0] < 1 << 16 else ">"  # the version tells the byte order
    n_tensors, n_kv = struct.unpack(order + "QQ", head[8:24])
    for count, least, what in ((n_tensors, _MIN_TENSOR_INFO, "tensors"), (n_kv, _MIN_KEY_VALUE, "key-value pairs")):
        if count * least > size:
            raise ConversionError(f"'{file}' declares {count:,} {what} in its header, more than its {size:,} bytes can "
                                  "hold: the header is damaged; re-download it")
    if n_kv and len(head) == 32 and (length := struct.unpack(order + "Q", head[24:32])[0]) > size:
        raise ConversionError(f"'{file}' says its first key is {length:,} bytes long, longer than the whole file "
                              f"({size:,} bytes): the header is damaged; re-download it")
    try:
        reader = gguf_file(file)
    except ImportError:
        return  # no gguf package: the config reader says how to install it
    except Exception as err:  # the gguf package on a header whose lengths run past the end of the file
        raise ConversionError(f"'{file}' cannot be read as GGUF: its header or data runs past the end of its {size:,} "
                              f"bytes (the file is truncated, or a length or count in its header is damaged: "
                              f"{type(err).__name__}); re-download it") from None
    tensors = list(reader.tensors)
    end = max((int(t.data_offset) + int(t.n_bytes) for t in tensors), default=int(reader.data_offset))
    if end > size:
        raise ConversionError(f"'{file}' is truncated: its tensors' data ends at byte {end:,}, the file at {size:,}; "
                              "re-download it")
    if size - end > max(int(reader.alignment), 32):
        raise ConversionError(f"'{file}' holds {size - end:,} bytes after the data of the {len(tensors):,} tensors its "
                              "header declares: the tensor count is damaged (too small); re-download it")


def _gguf_llama_name(name: str) -> str | None:
    """The transformers name of a llama GGUF tensor (None for a tensor the Llama block has no place for)."""
    m = _GGUF_BLOCK.fullmatch(name)
    if m is None:
        return _FROM_GGUF.get(name)
    template = _FROM_GGUF.get("blk.{i}." + m.group(2))
    return None if template is None else template.format(i=m.group(1))


def _unpermute_gguf_rows(weights, n_head: int):
    """Undo llama.cpp's Q/K row permutation (as transformers' LlamaTensorProcessor does)."""
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


class GGUFTensors(TensorIndex):
    """transformers name -> fp32 tensor of a llama-architecture GGUF file, dequantised on access from the
    memory-mapped file (Q/K rows un-permuted): the values of transformers' GGUF loader, one tensor at a time.
    ``open`` returns None for files this reader does not map (other architectures, biases, extra tensors, a tied
    config with an output.weight)."""

    def __init__(self, file: Path, reader, names: dict[str, str], heads: dict[str, int]):
        super().__init__()
        self.path, self._reader, self._heads = file, reader, heads
        for t in reader.tensors:  # GGUF lists the fastest axis first
            self._where[names[t.name]] = (file, tuple(int(n) for n in reversed(t.shape)), t)

    @classmethod
    def open(cls, file: Path, hf_config) -> GGUFTensors | None:
        try:
            import gguf  # noqa: F401
        except ImportError:
            return None
        try:
            reader = gguf_file(file)
            field = reader.fields.get("general.architecture")
            arch = bytes(field.parts[field.data[0]]).decode() if field is not None else None
            if arch != "llama" or hf_config.model_type != "llama":
                return None
            heads = reader.fields.get("llama.attention.head_count")
            kv_heads = reader.fields.get("llama.attention.head_count_kv")
            names = {t.name: _gguf_llama_name(t.name) for t in reader.tensors}
        except Exception:  # unreadable here: transformers' loader reports it
            return None
        if heads is None or kv_heads is None or None in names.values():
            return None
        if is_tied(hf_config) and "output.weight" in names:
            return None
        return cls(file, reader, names, {".attn_q.": hf_config.num_attention_heads,
                                         ".attn_k.": hf_config.num_key_value_heads})

    def __getitem__(self, name: str) -> torch.Tensor:
        import numpy as np
        from gguf.quants import dequantize

        tensor = self._where[name][2]
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except Exception as err:  # the gguf package's dequantiser on a damaged file
            raise ConversionError(f"'{self.path}' cannot be read as GGUF ({one_line(err)}); it is corrupt or "
                                  "truncated, re-download it") from None
        for part, n_head in self._heads.items():
            if part in tensor.name:
                weights = _unpermute_gguf_rows(weights, n_head)
        value = torch.from_numpy(np.copy(weights)).to(torch.float32)
        del weights
        return value


def read_gguf_tensors(file: Path, hf_config, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Every tensor of a llama-architecture GGUF (:class:`GGUFTensors`), read one at a time; None for files that
    reader does not map (the caller then loads through transformers)."""
    lazy = GGUFTensors.open(file, hf_config)
    if lazy is None:
        return None
    tensors = {name: prepare_tensor(name, lazy[name], file, dtype, True) for name in lazy}
    if is_tied(hf_config) and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def read_gguf_model(file: Path, dtype: torch.dtype):
    """(transformers config, tensors under transformers names, generation config) of a GGUF that
    :class:`GGUFTensors` does not map, through transformers' GGUF loader (it builds the whole model in float32)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32,
                                                     trust_remote_code=False)
    except Exception as err:  # transformers' GGUF loader
        raise ConversionError(f"transformers cannot load the weights of '{file}' ({one_line(err)}); re-download "
                              "it or convert the original safetensors folder") from None
    tensors = {k: prepare_tensor(k, v.detach(), file, dtype, True) for k, v in model.state_dict().items()}
    return model.config, tensors, getattr(model, "generation_config", None)


__all__ = ["GGUFTensors", "check_gguf_header", "gguf_file", "read_gguf_model", "read_gguf_tensors"]
