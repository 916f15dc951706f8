"""Reading the tensors of a transformers or TLM checkpoint folder: which files hold them (:func:`weight_files`), and
readers that take one tensor at a time (:class:`SafetensorsFiles` with plain file reads, not memory maps;
:class:`BinTensors` over PyTorch .bin shards, loaded ``weights_only``: no pickled code runs), each tensor checked for
NaN/Inf and cast (:func:`prepare_tensor`). tlm_io.checkpoint reads a whole folder with them
(:func:`read_state_dict`), tlm_convert.stream one layer at a time. Every problem is a one-line ConversionError that
names the file."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from .archs import DROPPED_TENSORS
from .bounded import read_json
from .errors import ConversionError, one_line

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# safetensors files in a folder that are not (part of) the transformers checkpoint
_FOREIGN_SAFETENSORS = re.compile(r"(adapter_model|consolidated)(\.\d+)?\.safetensors")


def corrupt_error(file, err) -> ConversionError:
    """The one-line error for a damaged checkpoint file, with what was wrong (``err``)."""
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


MAX_SAFETENSORS_HEADER = 100_000_000  # the reference reader's limit on the JSON header

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
                if length > MAX_SAFETENSORS_HEADER:
                    raise ValueError(f"a header of {length} bytes, above the {MAX_SAFETENSORS_HEADER} the format allows")
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


def load_bin(file: Path, mapped_only: bool = False) -> dict[str, torch.Tensor]:
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
    except Exception as err:  # torch's unpickler on a damaged or hostile file
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
    (``load_bin``), copies the tensor out and lets go of the mapping. Legacy (non-zip) files are refused."""

    def __init__(self, files):
        super().__init__()
        for file in files:
            for name, tensor in load_bin(file, mapped_only=True).items():
                self._where[name] = (file, tuple(tensor.shape), None)

    def __getitem__(self, name: str) -> torch.Tensor:
        return load_bin(self._where[name][0], mapped_only=True)[name].clone()


def weight_files(folder: Path) -> tuple[str, list[Path]]:
    """("safetensors" | "bin", files) of a checkpoint folder, in transformers' order of preference."""
    folder = Path(folder)
    for index_name, single, kind in ((SAFETENSORS_INDEX, "model.safetensors", "safetensors"),
                                     (BIN_INDEX, "pytorch_model.bin", "bin")):
        index = folder / index_name
        if index.is_file():
            weight_map = read_json(index, "weights index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ConversionError(f"'{index}' has no weight_map; re-download the checkpoint")
            names = sorted({str(name) for name in weight_map.values()})
            outside = [n for n in names if Path(n).name != n or n in ("", ".", "..")]
            if outside:
                raise ConversionError(f"'{index}' names a shard outside the model folder ({outside[0]!r}); a shard is "
                                      "a file name in the folder: re-download the checkpoint")
            shards = [folder / name for name in names]
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


# tensors the import drops (archs.DROPPED_TENSORS, in every file spelling): their values do not matter
_UNUSED_TENSORS = {
    family: patterns + {"gpt2": (r"h\.\d+\.attn\.(bias|masked_bias)",),
                        "gemma3": (r"(model\.)?(vision_tower|multi_modal_projector)\..*",)}.get(family, ())
    for family, patterns in DROPPED_TENSORS.items()
}


def read_state_dict(folder: Path, dtype: torch.dtype, family: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers or TLM checkpoint folder (source names), read shard by shard, checked for
    NaN/Inf (except the buffers the import of ``family`` drops) and cast to ``dtype``."""
    kind, files = weight_files(folder)
    exempt = [re.compile(p) for p in _UNUSED_TENSORS.get(family, ())]
    out = {}
    for file in files:
        shard = SafetensorsFiles([file]) if kind == "safetensors" else load_bin(file)
        for name in shard:
            checked = not any(p.fullmatch(name) for p in exempt)
            out[name] = prepare_tensor(name, shard[name], file, dtype, checked)
    return out


__all__ = ["BIN_INDEX", "BinTensors", "SAFETENSORS_INDEX", "SafetensorsFiles", "TensorIndex", "all_finite",
           "corrupt_error", "load_bin", "prepare_tensor", "read_state_dict", "weight_files",
           "MAX_SAFETENSORS_HEADER"]
