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
import re
import stat
from pathlib import Path, PurePosixPath

import torch

from tlm_io.bounded import read_bounded
from tlm_io.errors import ConversionError, StateError

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists a few dozen files
DAMAGED = "the checkpoint is damaged"
MAX_STATE_BYTES = 64 << 20  # trainer_state.json and the JSON halves of the optimizer, scheduler and RNG states
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
        tree = read_json_state(file)["state"]
    except (KeyError, TypeError) as err:
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


def sha256(file: Path, block: int = 1 << 22, limit: int | None = None) -> str:
    """The SHA-256 of ``file``; with ``limit``, of at most ``limit`` + 1 bytes (a file growing while read differs)."""
    digest = hashlib.sha256()
    left = float("inf") if limit is None else limit + 1
    fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        while left > 0 and (chunk := f.read(int(min(block, left)))):
            digest.update(chunk)
            left -= len(chunk)
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
    the ``required`` files must exist and be non-empty. Every name is confined to ``folder``
    (:func:`entry_problem`: relative, no ``..``, no symbolic link, a regular file) and read only up to its recorded
    size: a manifest naming ``../../x``, an absolute path or a FIFO marks the checkpoint damaged, and nothing
    outside it is opened."""
    folder = Path(folder)
    if folder.is_symlink():
        return "the checkpoint folder is a symbolic link, which a run never writes"
    if not os.path.lexists(folder / MANIFEST):
        for name in required:
            problem = entry_problem(folder, name)
            if problem is None and (folder / name).stat().st_size == 0:
                problem = f"{name} is empty"
            if problem is not None:
                return problem
        return None
    files = read_manifest(folder)
    if isinstance(files, str):
        return files
    for name, want in files.items():
        problem = entry_problem(folder, name) or _content_problem(folder / name, name, want)
        if problem is not None:
            return problem
    return None


def read_manifest(folder: Path) -> dict[str, dict] | str:
    """The ``files`` of ``folder``'s manifest ({name: {"size": int, "sha256": hex}}), or what is wrong with it."""
    problem = entry_problem(folder, MANIFEST)
    if problem is not None:
        return problem
    try:
        data = json.loads(read_bounded(folder / MANIFEST, MAX_MANIFEST_BYTES, "manifest", fix=DAMAGED))
        files = data["files"]
    except ConversionError as err:
        return str(err)
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        return f"{MANIFEST} cannot be read ({type(err).__name__})"
    if not isinstance(files, dict):
        return f"{MANIFEST} is malformed (its files are a {type(files).__name__}, not a mapping)"
    for name, want in files.items():
        if not (isinstance(want, dict) and type(want.get("size")) is int and want["size"] >= 0
                and isinstance(want.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", want["sha256"])):
            return f"{MANIFEST} is malformed (entry {name!r} is not a size and a SHA-256)"
    return files


def entry_problem(folder: Path, name) -> str | None:
    """None when ``name`` is a regular file inside ``folder`` reached without a symbolic link; else what it is."""
    if not isinstance(name, str) or not name or "\0" in name:
        return f"{MANIFEST} lists an entry that is not a file name ({name!r})"
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
        return f"{MANIFEST} names {name!r}, outside the checkpoint folder"
    path = Path(folder)
    for part in parts:
        path = path / part
        try:
            info = os.lstat(path)
        except OSError:
            return f"{name} is missing"
        if stat.S_ISLNK(info.st_mode):
            return f"{name} is a symbolic link, which a checkpoint never holds"
    if not stat.S_ISREG(info.st_mode):
        return f"{name} is not a regular file (a folder, pipe or device)"
    return None


def _content_problem(file: Path, name: str, want: dict) -> str | None:
    size = os.lstat(file).st_size
    if size != want["size"]:
        return f"{name} has {size} bytes, {want['size']} were written"
    try:
        if sha256(file, limit=size) != want["sha256"]:
            return f"{name} does not match the checksum written with it (changed or damaged)"
    except OSError as err:
        return f"{name} cannot be read ({os.strerror(err.errno) if err.errno else err})"
    return None


def listed(folder: Path) -> set[str] | None:
    """The names ``folder``'s manifest lists (None for a checkpoint of the first format, without one): what a
    resume reads, never a file added beside them."""
    if not os.path.lexists(Path(folder) / MANIFEST):
        return None
    files = read_manifest(Path(folder))
    if isinstance(files, str):
        raise StateError(f"{Path(folder) / MANIFEST}: {files}")
    return set(files)


def read_json_state(file: Path, limit: int = MAX_STATE_BYTES):
    """A JSON state file of a checkpoint (a regular file, never a FIFO, at most ``limit`` bytes; the manifest check
    has refused links before); StateError naming it otherwise."""
    try:
        return json.loads(read_bounded(file, limit, "checkpoint state", fix=DAMAGED))
    except ConversionError as err:
        raise StateError(str(err)) from None
    except (ValueError, RecursionError) as err:
        raise StateError(f"{file} cannot be read ({type(err).__name__}: {str(err)[:200]})") from None


__all__ = ["StateError", "save_state", "load_state", "load_legacy", "write_manifest", "check", "MANIFEST",
           "FORMAT", "entry_problem", "listed", "read_json_state", "read_manifest", "MAX_MANIFEST_BYTES",
           "MAX_STATE_BYTES"]
