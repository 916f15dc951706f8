"""A recipe file read as data, with PyYAML and the standard library only (no torch: the console entry points read a
recipe's sizes through it before importing the commands): a regular UTF-8 file of at most :data:`MAX_RECIPE_BYTES`,
nested at most :data:`MAX_RECIPE_DEPTH` deep, with no key given twice in one mapping. Every problem is one
RecipeError naming the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from tlm_io.bounded import read_bounded
from tlm_io.errors import ConversionError, RecipeError, one_line
from tlm_io.outputs import broken_link

MAX_RECIPE_BYTES = 16 << 20  # a recipe is a few KB; a larger file is refused before it is read
MAX_RECIPE_DEPTH = 100  # [ / { nesting; recipes nest a few levels


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # the base class names an unhashable key
            if key in seen:
                raise _DuplicateKey(f"key {key!r} appears twice (lines {seen[key]} and {key_node.start_mark.line + 1})")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_recipe_file(path: Path) -> Any:
    """The parsed YAML of the recipe file ``path`` (a mapping, for a recipe; None for an empty file)."""
    path = Path(path)
    try:
        text = _read(path).decode("utf-8")
        if _flow_depth(text) > MAX_RECIPE_DEPTH:  # PyYAML would take seconds to find it too deep
            raise RecursionError
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as err:
        raise RecipeError(f"recipe '{path}' is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except RecursionError:
        raise RecipeError(f"recipe '{path}' is nested too deeply to be a recipe; fix it") from None
    except _DuplicateKey as err:
        raise RecipeError(f"recipe '{path}': {err}; keep one of them (a later one would silently replace the "
                          "first)") from None
    except yaml.constructor.ConstructorError as err:
        tag = getattr(err, "problem", "") or ""
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        if "tag" in tag:  # !!python/object and other tags a safe loader never builds
            name = tag.split("tag", 1)[1].strip(" '").replace("tag:yaml.org,2002:", "!!")
            what = "asks for a Python object, which a recipe never builds" if "python" in name else "is not plain data"
            raise RecipeError(f"recipe '{path}'{where}: the tag {name} {what} (a recipe is plain YAML data); remove "
                              "the tag") from None
        raise RecipeError(f"recipe '{path}'{where}: {one_line(err)}; fix it") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"recipe '{path}' is not valid YAML{where}; fix the syntax") from None
    return data


def _read(path: Path) -> bytes:
    """The bytes of the recipe file: a regular file of at most :data:`MAX_RECIPE_BYTES`, or a RecipeError saying
    what it is instead (missing, a dangling link, a folder, a pipe or device, too large)."""
    if not os.path.lexists(path):
        raise RecipeError(f"recipe '{path}' does not exist; pass a YAML recipe file (see recipes/)")
    if (broken := broken_link(path)) is not None:
        raise RecipeError(f"recipe '{path}' is {broken}; fix the link or pass the YAML recipe file")
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.y*ml"))[:3]
        hint = f" (it holds {', '.join(found)})" if found else ""
        raise RecipeError(f"recipe '{path}' is a folder{hint}; pass the YAML recipe file itself")
    if path.is_file() and path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe '{path}' is {path.stat().st_size >> 20} MiB, not a recipe (they are a few KB); "
                          "pass the YAML recipe file")
    try:
        return read_bounded(path, MAX_RECIPE_BYTES, "recipe", fix="pass the YAML recipe file")  # a pipe or device is never opened for reading
    except ConversionError as err:
        raise RecipeError(str(err)) from None


def _flow_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in ``text`` (brackets inside comments and quotes counted too: an upper
    bound, enough to refuse an absurd file before the parser recurses into it)."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    return deepest


__all__ = ["MAX_RECIPE_BYTES", "MAX_RECIPE_DEPTH", "read_recipe_file"]
