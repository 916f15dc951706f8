"""Safe outputs: path checks before any work, a lock per output, atomic replacement, clear save errors.

Every folder a run writes (``tlm-convert``'s OUTPUT, ``tlm train``'s checkpoints and final model) goes through
here:

* :func:`check_output_path` refuses, before anything is loaded, an OUTPUT that is the input, contains it (an
  ``--overwrite`` would delete it) or lies inside it (the input is never modified), and an OUTPUT whose parent cannot
  be created or written.
* :class:`OutputLock` holds ``.NAME.lock`` beside OUTPUT with ``flock`` for the life of the run: a second run into
  the same OUTPUT refuses with one line naming the holder (pid, host, start time). The kernel drops the lock when
  its process dies, however it dies, so a stale lock file never blocks.
* :func:`output_run` holds the lock of one run, cleans up after dead runs first and, when the run fails,
  removes the parents of OUTPUT it created.
* :func:`clean_stale` runs under the lock: any ``.NAME.tmp-*`` / ``.NAME.old-*`` folder then belongs to a dead run
  (a live one would hold the lock), so it is removed -- or, when a kill left no OUTPUT but an ``.old-*`` folder,
  that complete previous output is put back.
* :func:`publish` replaces OUTPUT by a finished temporary folder so that the path shows the complete old or the
  complete new output at every instant (one ``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere old aside, new in,
  with :func:`clean_stale` restoring the old one if a kill falls between the two renames), then deletes the old.
* :func:`save_errors` turns a full disk or any other OSError of the save phase into one line: what, where, how
  much was needed.
* :data:`MARKER` (``.tapered-lm``, a few bytes of JSON: tool, version, kind and the entries written) is in every
  folder a command writes; :func:`replace_problem` says why a folder may not be replaced or pruned (no marker, or
  entries the marker does not list), so ``--overwrite``, a publish and a checkpoint prune touch only our own output.

Library code raises :class:`~tlm_io.errors.ConversionError`; the command line prints it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from .errors import ConversionError, first_few

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SPACE_MARGIN = 64 << 20  # config, tokenizer, reports, plot and file-system slack on top of the weights
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_TEXTS = ("no space left", f"os error {errno.ENOSPC})", "disk quota exceeded", f"os error {errno.EDQUOT})")


# ============================================================================================== path checks


def check_output_path(source: str | os.PathLike | None, output: str | os.PathLike, overwrite: bool,
                      option: str = "-o", overwrite_flag: str | None = "--overwrite") -> None:
    """Refuse an OUTPUT that would touch the input or cannot be written, before any work is done.

    ``source`` is compared only when it is a local path (a hub id is not); symlinks are resolved on both sides.
    ``overwrite_flag``: the option that allows replacing an existing OUTPUT, named in the refusal (None: the command
    has none and never replaces one).
    """
    out = Path(output).expanduser().absolute()
    target = resolved(out, f"output {output}", option)
    if source is not None and Path(source).expanduser().exists():
        src = Path(source).expanduser().resolve()
        if target == src:
            raise ConversionError("output must differ from the input; the input is never modified")
        if target in src.parents:
            raise ConversionError(f"output {output} contains the input {source} (replacing it would delete the "
                                  f"input); choose an {option} outside the input's folders")
        if src in target.parents:
            raise ConversionError(f"output {output} lies inside the input {source}, which is never modified; choose "
                                  f"an {option} outside it")
    if os.path.lexists(out):
        if out.is_symlink():
            raise ConversionError(_link_problem(out, output, option))
        if not overwrite:
            hint = f"pass {overwrite_flag} or " if overwrite_flag else ""
            raise ConversionError(f"output {output} already exists; {hint}choose another {option}"
                                  + ("" if overwrite_flag else " (this command never replaces an existing folder)"))
        if not target.is_dir():
            raise ConversionError(f"output {output} exists and is not a folder; remove it or choose another {option}")
        problem = replace_problem(out)
        if problem is not None:
            raise ConversionError(f"output {output} {problem}, and {overwrite_flag} replaces only a folder tapered-lm "
                                  f"wrote: move it away or choose another {option}")
    check_writable_parent(out, option)


def broken_link(path: str | os.PathLike) -> str | None:
    """For a symbolic link that leads nowhere: "a symbolic link to 'T', which does not exist" (or "..., which loops
    back to itself"); None for anything else."""
    path = Path(path)
    if not path.is_symlink() or path.exists():
        return None
    why = "which loops back to itself" if _loops(path) else "which does not exist"
    return f"a symbolic link to '{os.readlink(path)}', {why}"


def _link_problem(out: Path, output, option: str) -> str:
    """Why an OUTPUT that is a symbolic link is refused: it is dangling, loops, or would replace the link (never
    the folder it names)."""
    target = os.readlink(out)
    if (broken := broken_link(out)) is not None:
        return f"output {output} is {broken}; remove the link or choose another {option}"
    return (f"output {output} is a symbolic link to '{target}'; an output is written in place of the link, never "
            f"through it: pass {option} '{out.resolve()}' itself or choose another {option}")


def resolved(path: Path, what: str, option: str = "-o") -> Path:
    """``path`` with every symbolic link resolved; a link on it that loops is a ConversionError naming the link."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # ELOOP (Python < 3.13 raises RuntimeError)
        link = next((p for p in reversed([path, *path.parents]) if p.is_symlink() and _loops(p)), path)
        raise ConversionError(f"{what}: the symbolic link '{link}' on its path loops (it leads back to itself); fix "
                              f"or remove the link, or choose another {option}") from None


def _loops(link: Path) -> bool:
    try:
        link.resolve(strict=True)
    except FileNotFoundError:
        return False
    except (OSError, RuntimeError):
        return True
    return False


def check_output_given(output, option: str = "-o") -> None:
    """An empty OUTPUT (``-o ""``, which would mean the current folder) is refused."""
    if not str(output).strip():
        raise ConversionError(f"option {option} is empty; give the output folder")


def check_writable_parent(out: Path, option: str = "-o") -> Path:
    """The nearest existing ancestor of ``out``'s parent, checked to be a writable folder; returned."""
    ancestor = existing_ancestor(out.parent)
    resolved(ancestor, f"cannot create {out}", option)
    if (broken := broken_link(ancestor)) is not None:
        raise ConversionError(f"cannot create {out}: '{ancestor}' is {broken}; fix the link or choose another {option}")
    if not ancestor.is_dir():
        raise ConversionError(f"cannot create {out}: '{ancestor}' is a file, not a folder; choose another {option}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConversionError(f"cannot create {out}: '{ancestor}' is not writable (permission denied); choose "
                              f"another {option}")
    return ancestor


def existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


# ============================================================================================== disk space


def output_bytes(num_params: int, dtype: str) -> int:
    """Estimated size of a saved model: its weights in ``dtype`` plus a fixed margin for the other files."""
    return num_params * DTYPE_BYTES[dtype] + SPACE_MARGIN


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - unreachable


def free_bytes(folder: Path) -> int:
    return shutil.disk_usage(existing_ancestor(folder)).free


def check_free_space(folder: Path, need: int, option: str = "-o") -> None:
    """Refuse when the file system of ``folder`` has less than ``need`` bytes free."""
    free = free_bytes(folder)
    if need > free:
        raise ConversionError(f"not enough disk space in '{existing_ancestor(folder)}': the output needs about "
                              f"{human_bytes(need)}, {human_bytes(free)} are free; free some space or choose another "
                              f"{option}")


def is_disk_full(err: BaseException) -> bool:
    """True for a full disk or quota, also when a library (safetensors, torch) re-raised it as its own error."""
    if isinstance(err, OSError) and err.errno in _FULL_ERRNOS:
        return True
    return any(text in str(err).lower() for text in _FULL_TEXTS)


@contextmanager
def save_errors(out: Path, need: int | None = None, option: str = "-o"):
    """Turn a full disk, or an OSError while writing next to ``out``, into one ConversionError line."""
    try:
        yield
    except ConversionError:
        raise
    except Exception as err:
        problem = save_error(err, Path(out), need, option)
        if problem is None:
            raise
        raise problem from None


def save_error(err: BaseException, out: Path, need: int | None, option: str = "-o") -> ConversionError | None:
    """The one-line error for ``err`` raised while writing ``out``; None when it is not a write problem."""
    where = existing_ancestor(out.parent)
    if is_disk_full(err):
        try:
            free = f"{human_bytes(free_bytes(where))} free"
        except OSError:
            free = "free space unknown"
        needed = f"about {human_bytes(need)} needed" if need else "space needed unknown"
        return ConversionError(f"disk full while writing {out} ({needed}, {free} in '{where}'); nothing was "
                               f"published: free some space or choose another {option}")
    if isinstance(err, OSError) and (err.filename is None or _is_under(err.filename, out.parent)):
        name, reason = err.filename or out, err.strerror or str(err)
    elif (code := _wrapped_errno(err)) is not None:  # safetensors: "I/O error: File too large (os error 27)"
        name, reason = out, os.strerror(code)
    else:
        return None
    return ConversionError(f"cannot write {name}: {reason}; nothing was published: check '{where}' "
                           f"(permissions, space) or choose another {option}")


def _wrapped_errno(err: BaseException) -> int | None:
    """The errno inside a library's error text ("... (os error 28)"), None when there is none."""
    match = re.search(r"\(os error (\d+)\)", str(err))
    return int(match[1]) if match else None


def _is_under(path, folder: Path) -> bool:
    try:
        return Path(os.fsdecode(path)).absolute().is_relative_to(Path(folder).absolute())
    except (TypeError, ValueError):
        return False


# ============================================================================================== lock


class OutputLock:
    """An exclusive lock on an output path, held by this process until :meth:`release` (or its death).

    The lock is ``flock`` on ``.NAME.lock`` beside the output; the file says who holds it (pid, host, start time,
    command) for the refusal message. ``with OutputLock(path):`` acquires and releases.
    """

    def __init__(self, target: str | os.PathLike, option: str = "-o"):
        # resolved: two names of one folder (a symlink, "..") share one lock
        self.target = resolved(Path(target).expanduser(), str(target), option)
        self.path = self.target.parent / f".{self.target.name}.lock"
        self.option = option
        self.fd: int | None = None

    def acquire(self) -> "OutputLock":
        import fcntl

        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _holder(fd)
                os.close(fd)
                raise ConversionError(f"{self.target} is being written by another run ({holder}; lock "
                                      f"{self.path}); wait for it to finish or choose another {self.option}") from None
            try:  # a holder that was releasing may have unlinked the file we opened: lock the current one
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                 "command": " ".join(sys.argv)[:300]}).encode())
        self.fd = fd
        return self

    def _open(self) -> int:
        """The lock file, opened without following a symlink and refused unless it is a plain file of its own (no
        other name links to it): a lock never truncates a file it did not create."""
        import stat

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as err:
            if err.errno == errno.ELOOP or os.path.islink(self.path):
                raise ConversionError(f"lock file {self.path} is a symbolic link, which is never followed; remove the "
                                      f"link or choose another {self.option}") from None
            raise ConversionError(f"cannot write {self.target}: its folder '{self.target.parent}' does not take new "
                                  f"files (creating the lock file {self.path.name} there failed: "
                                  f"{err.strerror or err}); choose another {self.option}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink > 1:
            os.close(fd)
            what = "has other hard links" if stat.S_ISREG(info.st_mode) else "is not a plain file"
            raise ConversionError(f"lock file {self.path} {what}, so it was not written; remove it or choose another "
                                  f"{self.option}")
        return fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(info["since"])))
        return f"pid {info['pid']} on {info['host']} since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


# ============================================================================================== replace


def temp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-"


def old_prefix(out: Path) -> str:
    return f".{out.name}.old-"


def clean_stale(out: Path) -> list[Path]:
    """Remove the temporary and set-aside folders of dead runs into ``out``; call with ``out``'s lock held.

    Only the exact names this module writes count (``.NAME.tmp-<mkdtemp suffix>``, ``.NAME.old-<pid>``, folders
    only): a user's ``.NAME.tmp-notes`` file is left alone. A ``.NAME.old-<pid>`` folder with no ``out`` beside it is
    the complete previous output of a run killed between its two renames: it is put back. Returns what was removed
    or restored."""
    out = Path(out).absolute()
    name = re.escape(out.name)
    return _clean(out.parent, re.compile(rf"^\.(?P<target>{name})\.(?:(?P<tmp>tmp-[A-Za-z0-9_]+)|(?P<old>old-\d+))$"))


def clean_stale_in(folder: Path, targets: str) -> list[Path]:
    """:func:`clean_stale` inside ``folder`` (a training output_dir, whose lock is held) for the outputs whose names
    match the regular expression ``targets`` (e.g. ``checkpoint-\\d+|final``), with the fixed temporary name
    ``.NAME.tmp-train`` of the trainer. Nothing else in ``folder`` is touched."""
    return _clean(Path(folder).absolute(),
                  re.compile(rf"^\.(?P<target>{targets})\.(?:(?P<tmp>tmp-train)|(?P<old>old-\d+))$"))


def _clean(folder: Path, stale: re.Pattern) -> list[Path]:
    if not folder.is_dir():
        return []
    found = []
    for entry in sorted(folder.iterdir()):
        match = stale.match(entry.name)
        if match is None or entry.is_symlink() or not entry.is_dir():  # this module only ever leaves folders
            continue
        out = folder / match["target"]
        if match["old"] and not os.path.lexists(out):
            os.rename(entry, out)
            logger.warning("restored %s from %s (a run was killed while replacing it)", out, entry.name)
        else:
            _remove(entry)
        found.append(entry)
    return found


# ============================================================================================== one run


@contextmanager
def output_run(out: str | os.PathLike, option: str = "-o"):
    """``with output_run(out):`` hold ``out`` for one run that publishes it through :func:`staged`: its lock for the
    whole run (a second run into ``out`` is refused), the folders of dead runs cleaned first (:func:`clean_stale`),
    and on any failure the missing parents of ``out`` that the run created removed again. With :func:`staged`
    removing its own temporary folder and ``out`` appearing only when published, a failed run leaves the file
    system as it found it."""
    out = Path(out).expanduser().absolute()
    created = [p for p in out.parents if not p.exists()]  # deepest first
    try:
        with OutputLock(out, option):
            clean_stale(out)
            yield out
    except BaseException:
        for folder in created:  # only folders this run created, and only while empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise


# ============================================================================================== ownership

MARKER = ".tapered-lm"  # in every folder a command writes: {"tool", "version", "kind", "files"}
LEGACY_RUN_MARKER = ".tlm-run"  # what a training output_dir held before MARKER (still recognised)
MAX_MARKER_BYTES = 1 << 16
RUN = "run"  # a training output_dir: its own names only are touched, it is never replaced as a whole
OUTPUT = "output"  # a folder written whole (a conversion, an export, a checkpoint): replaced whole

# what an output of an earlier version (no MARKER) always held, and nothing else: conversions (conversion_report.json
# beside the model), checkpoints (trainer_state.json + manifest.json) and a run's final/ (recipe.yaml + config.json)
_LEGACY_NAMES = re.compile(
    r"config\.json|generation_config\.json|conversion_report\.json|report\.md|widths\.png|calibration_samples\.txt"
    r"|model(?:-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|model\.gguf|[A-Za-z0-9_]+\.py"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|tokenizer\.model|vocab\.json|merges\.txt"
    r"|added_tokens\.json|chat_template\.jinja|chat_template\.json|spiece\.model"
    r"|trainer_state\.json|manifest\.json|recipe\.yaml|(?:optimizer|scheduler|rng_state_\d+)\.(?:json|safetensors|pt)")
_LEGACY_SIGNATURES = (("conversion_report.json", "config.json"), ("conversion_report.json", "model.gguf"),
                      ("trainer_state.json", "manifest.json"),
                      ("trainer_state.json", "optimizer.pt"), ("recipe.yaml", "config.json"))
_LEGACY_HEAL = ("heal", {"metrics.jsonl", "recipe.yaml", "run_summary.json"})  # a healed conversion's log folder


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tapered-lm")
    except PackageNotFoundError:
        return "unknown"


def write_marker(folder: str | os.PathLike, tool: str, kind: str = OUTPUT) -> None:
    """Write :data:`MARKER` into ``folder``: ``tool`` and this version; for an :data:`OUTPUT`, the entries ``folder``
    holds now (write it last), which is what a later ``--overwrite`` or prune may delete."""
    names = [name for name in os.listdir(folder) if name != MARKER] if kind == OUTPUT else None
    _write_marker(Path(folder), tool, kind, names)


def add_to_marker(folder: str | os.PathLike, tool: str, names) -> None:
    """Record ``names`` (files a command just wrote into ``folder``, which may hold other files) in its marker."""
    listed = set((read_marker(folder) or {}).get("files") or ()) | set(names)
    _write_marker(Path(folder), tool, OUTPUT, listed)


def _write_marker(folder: Path, tool: str, kind: str, names) -> None:
    data = {"tool": tool, "version": tool_version(), "kind": kind}
    if names is not None:
        data["files"] = sorted(names)
    path = folder / MARKER
    if path.is_symlink():  # replaced, never written through
        path.unlink()
    path.write_text(json.dumps(data) + "\n")


def read_marker(folder: str | os.PathLike) -> dict | None:
    """The marker of ``folder`` (a JSON object), None when it has none: a link, a non-file or a malformed marker
    counts as none (a marker is trusted only as this package writes it)."""
    path = Path(folder) / MARKER
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MARKER_BYTES:
            return None
        data = json.loads(os.read(fd, MAX_MARKER_BYTES + 1))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or not isinstance(data.get("files", []), list):
        return None
    return data


def replace_problem(folder: str | os.PathLike) -> str | None:
    """None when ``folder`` is an output this package wrote, which may be replaced or pruned whole; else why not, as
    the end of a sentence that begins with the folder's name.

    Ours: its :data:`MARKER` lists every entry it holds (a file someone added is never deleted with it); or, written
    by an earlier version without the marker, it holds what such an output always held (:data:`_LEGACY_SIGNATURES`)
    and only regular files of the names such outputs have. A training output_dir is never replaced whole."""
    path = Path(folder)
    if path.is_symlink() or not path.is_dir():
        return "is a symbolic link" if path.is_symlink() else "is not a folder"
    try:
        names = set(os.listdir(path))
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    marker = read_marker(path)
    if marker is None and LEGACY_RUN_MARKER in names or marker is not None and marker.get("kind") == RUN:
        return "is a training run's output_dir (checkpoints, metrics), which is never replaced whole"
    if marker is not None and "files" in marker:
        foreign = sorted(names - set(marker["files"]) - {MARKER})
        if foreign:
            return f"holds files tapered-lm did not write there ({first_few(foreign)})"
        return None
    if not any(set(signature) <= names for signature in _LEGACY_SIGNATURES):
        return f"was not written by tapered-lm (it has no {MARKER} marker)"
    odd = sorted(name for name in names if not (_legacy_file(path / name) or _legacy_heal_log(path / name)))
    if odd:
        return (f"has no {MARKER} marker (an earlier version's output?) and holds what no tapered-lm output holds "
                f"({first_few(odd)})")
    return None


def _legacy_file(path: Path) -> bool:
    return bool(_LEGACY_NAMES.fullmatch(path.name)) and path.is_file() and not path.is_symlink()


def _legacy_heal_log(path: Path) -> bool:
    """``heal/`` of a healed conversion: a real folder of the run's log files, nothing else."""
    name, files = _LEGACY_HEAL
    if path.name != name or path.is_symlink() or not path.is_dir():
        return False
    entries = list(path.iterdir())
    return all(entry.name in files and entry.is_file() and not entry.is_symlink() for entry in entries)


def check_files_owned(folder: str | os.PathLike, names, option: str = "-o",
                      legacy: tuple[str, tuple[str, ...]] | None = None) -> None:
    """Before a command writes the files ``names`` into ``folder`` (which may hold other files): each one that exists
    must be a plain file its marker lists (a file of the user's of the same name is never replaced). ``legacy``:
    (a JSON report among ``names``, its keys): a folder without a marker whose report is such a JSON object is the
    output of an earlier version, and its ``names`` count as ours."""
    path = Path(folder)
    if not path.is_dir():
        return
    marker = read_marker(path)
    listed = set((marker or {}).get("files") or ())
    if marker is None and legacy is not None and _is_report(path / legacy[0], legacy[1]):
        listed = set(names)
    for name in names:
        file = path / name
        if not os.path.lexists(file) or name in listed and file.is_file() and not file.is_symlink():
            continue
        raise ConversionError(f"{file} exists and was not written by tapered-lm (the folder's {MARKER} marker does "
                              f"not list it); move it away or choose another {option}")


def _is_report(file: Path, keys: tuple[str, ...]) -> bool:
    """True when ``file`` is a plain JSON file (at most 64 MiB) holding an object with ``keys``."""
    try:
        if file.is_symlink() or not file.is_file() or file.stat().st_size > 64 << 20:
            return False
        data = json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and all(key in data for key in keys)


# ============================================================================================== run folders


def check_run_folder(folder: str | os.PathLike, ours: str, option: str = "output_dir",
                     not_inside: str | os.PathLike | None = None) -> None:
    """Refuse a folder a run would write into and clean up unless it is new, empty, or a previous run's.

    ``ours`` is a regular expression of the entry names such a run writes. A folder whose :data:`MARKER` is of kind
    :data:`RUN` (or with the :data:`LEGACY_RUN_MARKER`) is a previous run's, one with another command's marker is
    refused, one without is accepted only when every entry matches ``ours``. ``/``, the home folder and the folder of ``not_inside`` (the recipe file) are always refused."""
    path = Path(folder).expanduser().absolute()
    real = resolved(path, f"{option} {folder}", option)
    if real == Path(real.anchor) or real == Path.home().resolve():
        raise ConversionError(f"{option} {folder} is {'/' if real == Path(real.anchor) else 'the home folder'}, "
                              f"which a run never writes into; choose a new folder for {option}")
    if not_inside is not None and Path(not_inside).expanduser().resolve().parent == real:
        raise ConversionError(f"{option} {folder} is the folder of the recipe {not_inside}, whose files a run would "
                              f"overwrite; choose a new folder for {option}")
    if not os.path.lexists(path):
        return
    if not real.is_dir():
        raise ConversionError(f"{option} {folder} exists and is not a folder; remove it or choose another {option}")
    try:
        names = [entry.name for entry in real.iterdir()]
    except OSError as err:
        raise ConversionError(f"{option} {folder} cannot be read ({err.strerror or err}); choose another "
                              f"{option}") from None
    marker = read_marker(real)
    if marker is not None and marker.get("kind") != RUN:
        raise ConversionError(f"{option} {folder} is the output of {marker.get('tool', 'another command')}, not a "
                              f"training run's folder; choose a new folder for {option}")
    if marker is not None or LEGACY_RUN_MARKER in names:
        return
    pattern = re.compile(rf"^(?:{ours})$")
    foreign = sorted(name for name in names if not pattern.match(name))
    if foreign:
        raise ConversionError(f"{option} {folder} holds files a run did not write ({first_few(foreign)}), which it "
                              f"could overwrite or clean up; choose a new or empty folder for {option}")


def mark_run_folder(folder: str | os.PathLike) -> None:
    """Create ``folder`` if needed and write its :data:`MARKER` of kind :data:`RUN` (what :func:`check_run_folder`
    trusts)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    if (read_marker(path) or {}).get("kind") != RUN:
        write_marker(path, "tlm train", RUN)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def staged(out: Path, tool: str = "tapered-lm"):
    """``with staged(out) as tmp:`` write into ``tmp``, a new temporary folder beside ``out``; on success it gets its
    :data:`MARKER` (``tool``) and is published onto ``out`` (:func:`publish`), on any failure removed and ``out``
    left as it was."""
    import tempfile

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    try:
        yield tmp
        write_marker(tmp, tool)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, out: Path) -> None:
    """Move a finished temporary folder onto ``out``, replacing it atomically, with the usual permissions.

    ``tmp`` must be a sibling of ``out`` (same file system). The old output is deleted only after the new one is in
    place, and only when it is ours (:func:`replace_problem`; checked again here, as files may have been added to
    it since the run began): otherwise ConversionError, and ``out`` stays as it is."""
    tmp, out = Path(tmp), Path(out)
    if os.path.lexists(out) and (problem := replace_problem(out)) is not None:
        raise ConversionError(f"{out} {problem}, so it was not replaced; move it away and run again, or choose "
                              "another output")
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp creates 0700
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    if exchange(tmp, out):  # out is the new folder now, tmp the old one
        _remove(tmp)
        return
    old = out.parent / f"{old_prefix(out)}{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    _remove(old)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where that is unsupported."""
    if not sys.platform.startswith("linux") or os.environ.get("TLM_NO_RENAME_EXCHANGE"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(b))


__all__ = ["OutputLock", "MARKER", "LEGACY_RUN_MARKER", "RUN", "OUTPUT", "write_marker", "add_to_marker",
           "read_marker", "replace_problem", "check_files_owned", "resolved", "broken_link", "tool_version", "output_run", "check_output_given",
           "check_run_folder", "mark_run_folder", "check_output_path", "check_writable_parent", "check_free_space", "clean_stale", "clean_stale_in",
           "exchange", "output_bytes", "publish", "save_error", "save_errors", "is_disk_full", "human_bytes",
           "existing_ancestor", "temp_prefix", "old_prefix", "DTYPE_BYTES"]
