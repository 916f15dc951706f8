"""Training state on disk without pickle, and checkpoint validation.

A checkpoint's optimizer, scheduler and RNG states are nested Python values (dicts with int or str keys, lists,
tuples, numbers, strings, tensors, numpy arrays). :func:`save_state` writes one as ``NAME.json`` (the structure,
tensors replaced by references) plus ``NAME.safetensors`` (the tensors); :func:`load_state` reads them back. Neither
file can hold code, so a checkpoint folder someone hands you runs nothing when resumed.

Checkpoints written before this format (``optimizer.pt``, ``scheduler.pt``, ``rng_state_<rank>.pt``) are read with
``torch.load(weights_only=True)``: PyTorch's restricted unpickler, which refuses any type outside its allow-list
(tensors, containers, numbers; numpy's RNG arrays added explicitly) instead of calling it.

:func:`write_manifest` records every file's size and SHA-256 in ``manifest.json``, written last; :func:`check`
verifies a folder against it and says what is wrong (missing, truncated, changed, unreadable), so a resume can
skip a checkpoint that a kill or a full disk left incomplete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from tlm_io.errors import StateError

MANIFEST = "manifest.json"
FORMAT = 2  # 1: the pickled .pt files of the first versions; 2: JSON + safetensors with a manifest
_TENSOR, _ARRAY, _TUPLE, _DICT = "__tensor__", "__ndarray__", "__tuple__", "__dict__"


# ============================================================================================== encode / decode


def _encode(obj, tensors: dict[str, torch.Tensor]):
    """A JSON-able tree for ``obj``; tensors (and numpy arrays) go into ``tensors`` under generated names."""
    if isinstance(obj, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().cpu().contiguous()
        return {_TENSOR: name}
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        import numpy as np

        if isinstance(obj, np.ndarray):
            name = f"t{len(tensors)}"
            tensors[name] = torch.from_numpy(obj.astype(np.int64) if obj.dtype.kind in "ui" else obj.copy())
            return {_ARRAY: name, "dtype": str(obj.dtype)}
        return obj.item()  # a numpy scalar
    if isinstance(obj, dict):
        for k in obj:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"cannot store a dict key of type {type(k).__name__}")
        return {_DICT: [[k, _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a value of type {type(obj).__name__} in a checkpoint")


def _decode(tree, tensors: dict[str, torch.Tensor], where: str):
    if isinstance(tree, list):
        return [_decode(v, tensors, where) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if _TENSOR in tree:
        return _tensor(tensors, tree[_TENSOR], where)
    if _ARRAY in tree:
        import numpy as np

        return _tensor(tensors, tree[_ARRAY], where).numpy().astype(np.dtype(tree["dtype"]))
    if _TUPLE in tree:
        return tuple(_decode(v, tensors, where) for v in tree[_TUPLE])
    if _DICT in tree:
        return {k: _decode(v, tensors, where) for k, v in tree[_DICT]}
    raise StateError(f"{where}: unexpected entry {sorted(tree)[:3]}")


def _tensor(tensors, name, where):
    if name not in tensors:
        raise StateError(f"{where}: tensor {name!r} is missing from its .safetensors file")
    return tensors[name]


def save_state(folder: Path, name: str, obj) -> None:
    """Write ``obj`` as ``folder/NAME.json`` + ``folder/NAME.safetensors`` (no pickle)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(obj, tensors)
    save_file(tensors, str(Path(folder) / f"{name}.safetensors"))
    (Path(folder) / f"{name}.json").write_text(json.dumps({"format": FORMAT, "state": tree}))


def load_state(folder: Path, name: str, map_location: str | torch.device = "cpu"):
    """Read what :func:`save_state` wrote, or a legacy ``NAME.pt`` with the weights-only unpickler."""
    folder = Path(folder)
    if not (folder / f"{name}.json").exists() and (folder / f"{name}.pt").exists():
        return load_legacy(folder / f"{name}.pt", map_location)
    from safetensors.torch import load_file

    file = folder / f"{name}.json"
    try:
        tree = json.loads(file.read_text())["state"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise StateError(f"{file} cannot be read ({type(err).__name__}: {err})") from None
    file = folder / f"{name}.safetensors"
    try:
        tensors = load_file(str(file), device=str(map_location))
    except Exception as err:  # safetensors raises its own error type
        raise StateError(f"{file} cannot be read ({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    return _decode(tree, tensors, str(folder / f"{name}.json"))


def load_legacy(file: Path, map_location="cpu"):
    """A pickled state file of the first checkpoint format, through torch's restricted (weights-only) unpickler."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    allowed = [np.ndarray, np.dtype, type(np.dtype("uint32")), core.multiarray._reconstruct]
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(file, map_location=map_location, weights_only=True)
    except Exception as err:
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise StateError(f"{file} cannot be read as weights-only data ({text[:200]}); it is corrupt or holds "
                         "pickled code, which is never run") from None


# ============================================================================================== manifest


def sha256(file: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """``manifest.json``: size and SHA-256 of every file under ``folder`` (write it last)."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))


def check(folder: Path, required: tuple[str, ...] = ()) -> str | None:
    """None when ``folder`` is complete and intact; else what is wrong, naming the file.

    With a manifest every listed file must have its recorded size and checksum; without one (the first format)
    the ``required`` files must exist and be non-empty."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.exists():
        for name in required:
            file = folder / name
            if not file.is_file() or file.stat().st_size == 0:
                return f"{name} is missing or empty"
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST} cannot be read ({type(err).__name__})"
    for name, want in files.items():
        file = folder / name
        try:
            size = file.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written"
        try:
            if sha256(file) != want["sha256"]:
                return f"{name} does not match the checksum written with it (changed or damaged)"
        except OSError as err:
            return f"{name} cannot be read ({os.strerror(err.errno) if err.errno else err})"
    return None


__all__ = ["StateError", "save_state", "load_state", "load_legacy", "write_manifest", "check", "MANIFEST",
           "FORMAT"]
