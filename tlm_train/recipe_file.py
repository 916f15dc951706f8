"""Recipe data with PyYAML and the standard library only (no torch: the console entry points and tlm-convert's
options use it before anything heavy is imported).

:func:`read_recipe_file`: a regular UTF-8 file of at most :data:`MAX_RECIPE_BYTES`, nested at most
:data:`MAX_RECIPE_DEPTH` deep, with no key given twice in one mapping; every problem is one RecipeError naming the
file. :func:`apply_overrides` and :func:`build_spec`: ``key.path=value`` overrides and the typed dataclass they fill,
every problem named by its key path (``tlm train --set``, ``tlm compare --set``, ``tlm-convert --set``)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

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


def apply_overrides(data: dict, overrides) -> dict:
    """A copy of ``data`` with every ``key.path=value`` of ``overrides`` set (values read as YAML scalars)."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"override {item!r} is not of the form key.path=value (e.g. optim.lr=1e-3)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node, parts = data, key.strip().split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return data


def _type_name(tp) -> str:
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def build_spec(cls, data: Any, path: str, errors: list[str]):
    """Instantiate dataclass ``cls`` from ``data``, appending every problem (with its key path) to ``errors``."""
    if not isinstance(data, dict):
        errors.append(f"{path or 'recipe'}: expected a mapping, got {data!r}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = [k for k in fields if k.startswith(str(key)[:3])]
            hint = f" (did you mean {close[0]}?)" if close else f" (known: {', '.join(fields)})"
            errors.append(f"{_join(path, key)}: unknown key{hint}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], _join(path, name), errors)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.append(f"{_join(path, name)}: missing (required)")
    try:
        return cls(**kwargs)
    except TypeError:  # a required key is missing: already reported
        return None


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _coerce(value: Any, tp, path: str, errors: list[str]):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(value, inner[0], path, errors)
    if dataclasses.is_dataclass(tp):
        return build_spec(tp, value, path, errors)
    if origin is Literal:
        if value not in args:
            errors.append(f"{path}: expected one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {value!r}")
            return value
        return [_coerce(v, args[0], f"{path}[{i}]", errors) for i, v in enumerate(value)] if args else value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
                try:
                    value = float(value)
                except ValueError:
                    pass
            if isinstance(value, str) or not isinstance(value, float):
                errors.append(f"{path}: expected {_type_name(tp)}, got {value!r}")
                return value
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            value = math.inf
        if not math.isfinite(value):  # .nan, .inf: no run can use them
            errors.append(f"{path}: expected a finite number, got {value!r}")
        return value
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        errors.append(f"{path}: expected {_type_name(tp)}, got {value!r}")
    elif tp in (str, bool, dict) and not isinstance(value, tp):
        errors.append(f"{path}: expected {_type_name(tp)}, got {value!r}")
    return value


__all__ = ["MAX_RECIPE_BYTES", "MAX_RECIPE_DEPTH", "apply_overrides", "build_spec", "read_recipe_file"]
