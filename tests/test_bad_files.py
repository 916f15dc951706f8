"""Files we did not write are data, and a bad one is one line naming what is wrong with it (issues 25 and 53).

A config, index, tokenizer, GGUF header, recipe or data file is read within the size a real one has (a pipe, a
device or a sparse giant is refused before a byte is read); malformed or absurdly nested JSON/YAML is one line naming
the file; NaN/Infinity names its key; an index never sends the reader outside the model folder; a GGUF header whose
counts or lengths cannot be true is named as such; a YAML tag is named as a tag; a path that is a dangling link, a
link loop, a pipe or a folder where a file belongs is named as what it is; code in a config's ``auto_map`` never runs.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import yaml
from hostile_helpers import copy_source, listing, refused, source, sparse  # noqa: F401 - fixture
from test_faults import FAST, _convert, _one_error_line, _tiny_recipe, _tlm, _write_recipe
from tiny_sources import DATA
# ============================================================================ model config and index files


def test_a_config_nested_absurdly_deep_is_one_line(source, tmp_path):
    src = copy_source(source, tmp_path / "src")
    (src / "config.json").write_text('{"a": ' + "[" * 5_000 + "]" * 5_000 + ', "model_type": "llama"}')
    assert "config.json" in (line := refused(src, tmp_path)) and "nested too deeply" in line, line


def test_a_config_with_nan_names_the_key(source, tmp_path):
    src = copy_source(source, tmp_path / "src")
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'))
    line = refused(src, tmp_path)
    assert "config.json" in line and "rms_norm_eps is nan" in line and "fix rms_norm_eps" in line, line


def test_a_config_that_is_a_pipe_is_never_opened(source, tmp_path):
    src = copy_source(source, tmp_path / "src")
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    line = refused(src, tmp_path)
    assert "config.json" in line and "not a regular file" in line, line


def test_a_giant_config_is_refused_before_it_is_read(source, tmp_path):
    src = copy_source(source, tmp_path / "src")
    sparse(src / "config.json", 100 << 20, b'{"model_type": "llama", "pad": "')
    line = refused(src, tmp_path)
    assert "config.json" in line and "100.0 MiB, more than the 64.0 MiB" in line, line


def _sharded(source: Path, folder: Path, shard_name: str) -> Path:
    from safetensors import safe_open

    src = copy_source(source, folder)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    index = {"metadata": {}, "weight_map": {name: shard_name for name in names}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src


@pytest.mark.parametrize("shard", ["../elsewhere/model.safetensors", "/etc/passwd"])
def test_an_index_never_sends_the_reader_outside_the_model_folder(source, tmp_path, shard):
    copy_source(source, tmp_path / "elsewhere")  # a readable checkpoint there: the index must still not reach it
    src = _sharded(source, tmp_path / "src", shard)
    (src / "model.safetensors").rename(src / "moved.safetensors")
    line = refused(src, tmp_path)
    assert "model.safetensors.index.json" in line and "outside the model folder" in line and repr(shard) in line, line


# ============================================================================ safetensors headers


def _edit_safetensors(source: Path, folder: Path, edit) -> Path:
    """A copy of ``source`` whose model.safetensors header went through ``edit(header)`` (data bytes unchanged)."""
    import shutil

    shutil.copytree(source, folder)
    file = folder / "model.safetensors"
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    text = edit(header)
    text = (text if isinstance(text, str) else json.dumps(header)).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    return folder


def _norms(header) -> list[str]:
    return sorted(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 1)


def _alias(header):
    a, b = _norms(header)[:2]
    header[b]["data_offsets"] = header[a]["data_offsets"]


def _int_weight(header):
    name = next(k for k, v in header.items() if k.endswith("proj.weight"))
    header[name]["dtype"] = "I32"


def _negative(header):
    name = _norms(header)[0]
    header[name]["shape"] = [-header[name]["shape"][0]]


def _f8(header):
    name = _norms(header)[0]
    header[name]["dtype"], header[name]["shape"] = "F8_E4M3", [header[name]["shape"][0] * 4]


def _deep_header(header):
    rest = json.dumps(header)[1:]
    return '{"__metadata__": ' + "[" * 200_000 + "]" * 200_000 + ", " + rest


@pytest.mark.parametrize("edit, expected", [(_alias, "overlaps"), (_int_weight, "dtype I32"),
                                            (_negative, "negative dimension"), (_f8, "dtype F8_E4M3"),
                                            (_deep_header, "nested too deeply")])
def test_a_hostile_safetensors_header_is_one_line(source, tmp_path, edit, expected):
    src = _edit_safetensors(source, tmp_path / "src", edit)
    before = listing(src)
    line = _one_error_line(_convert([src, "-o", tmp_path / "out"]))
    assert expected in line and "model.safetensors" in line and "internal error" not in line, line
    assert not (tmp_path / "out").exists() and listing(src) == before


def test_a_safetensors_header_above_the_format_limit_is_not_read(source, tmp_path):
    src = copy_source(source, tmp_path / "src")
    sparse(src / "model.safetensors", 150_000_000 + 8, struct.pack("<Q", 150_000_000))
    line = refused(src, tmp_path)
    assert "model.safetensors" in line and "above the 100000000 the format allows" in line, line


# ============================================================================ tokenizer files


def _tokenizer_json(folder: Path) -> Path:
    return folder / "tokenizer.json"


def _unknown_type(folder):
    data = json.loads(_tokenizer_json(folder).read_text())
    data["model"]["type"] = "Frobnicate"
    _tokenizer_json(folder).write_text(json.dumps(data))


def _malformed(folder):
    _tokenizer_json(folder).write_text('{"model": {')


def _link(target):
    def edit(folder):
        _tokenizer_json(folder).unlink()
        _tokenizer_json(folder).symlink_to(target)
    return edit


@pytest.mark.parametrize("edit, expected", [(_unknown_type, "model type 'Frobnicate'"), (_malformed, "is not valid JSON"),
                                            (_link("/etc/passwd"), "is not valid JSON"),
                                            (_link("/dev/zero"), "not a regular file")],
                         ids=["unknown-type", "malformed", "etc-passwd", "dev-zero"])
def test_a_hostile_tokenizer_json_is_one_line_naming_it(source, tmp_path, edit, expected):
    import shutil
    import time

    src = Path(shutil.copytree(source, tmp_path / "src"))
    edit(src)
    t0 = time.perf_counter()
    line = _one_error_line(_convert([src, "-o", tmp_path / "out", *FAST]))
    assert time.perf_counter() - t0 < 30  # /dev/zero is never read
    assert f"'{src / 'tokenizer.json'}'" in line and expected in line, line
    assert not (tmp_path / "out").exists()


def _fifo(folder):
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")


def _deep_tokenizer(folder):
    (folder / "tokenizer.json").write_text('{"model": ' + "[" * 5_000 + "]" * 5_000 + "}")


def _bad_config(folder):
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": ')


def _giant_config(folder):
    sparse(folder / "tokenizer_config.json", 200 << 20, b'{"x": "')


def _eos_object(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = {"weird": [1, 2]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, file, expected", [
    (_fifo, "tokenizer.json", "not a regular file"),
    (_deep_tokenizer, "tokenizer.json", "nested too deeply"),
    (_bad_config, "tokenizer_config.json", "is not valid JSON"),
    (_giant_config, "tokenizer_config.json", "200.0 MiB, more than the 128.0 MiB"),
    (_eos_object, "", "cannot be loaded (TypeError"),
], ids=["fifo", "deep", "malformed-config", "giant-config", "eos-object"])
def test_a_hostile_tokenizer_file_is_one_line_naming_it(source, tmp_path, edit, file, expected):
    src = copy_source(source, tmp_path / "src")
    edit(src)
    line = refused(src, tmp_path)
    assert f"'{src / file}'".replace("/'", "'") in line and expected in line, line


def test_a_gguf_without_a_tokenizer_is_named(tmp_path):
    pytest.importorskip("gguf")
    from test_checkpoint import write_tiny_gguf

    write_tiny_gguf(tmp_path / "bare.gguf")
    line = refused(tmp_path / "bare.gguf", tmp_path)
    assert "bare.gguf" in line and "tokenizer" in line, line


# ============================================================================ recipes


def test_a_duplicate_recipe_key_is_refused(tmp_path):
    path = tmp_path / "r.yaml"
    text = yaml.safe_dump(_tiny_recipe(tmp_path))
    path.write_text(text + "optim:\n  lr: 0.1\n")
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "'optim' appears twice" in line and "r.yaml" in line, line
    assert not (tmp_path / "run").exists()


def test_a_recipe_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"output_dir: \xff\xfe\n")
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "r.yaml" in line and "UTF-8" in line, line


def test_a_recipe_nested_absurdly_deep_is_one_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("a: " + "[" * 5_000 + "]" * 5_000)
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "r.yaml" in line and "nested too deeply" in line, line


def test_a_giant_recipe_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "r.yaml"
    sparse(path, 64 << 20, b"output_dir: x\n#")
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "r.yaml" in line and "64 MiB, not a recipe" in line, line


def test_a_model_config_nan_in_a_recipe_is_named(tmp_path):
    recipe = _tiny_recipe(tmp_path)
    recipe["model"]["config"]["norm_eps"] = float("nan")
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "norm_eps" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_recipe_number_that_is_not_finite_names_its_key(tmp_path, value):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_tiny_recipe(tmp_path)).replace("lr: 0.003", f"lr: {value}"))
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "optim.lr: expected a finite number" in line and "r.yaml" in line, line
    assert not (tmp_path / "run").exists()



# ============================================================================ GGUF headers


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    pytest.importorskip("gguf")
    from test_checkpoint import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


def _patched(raw: bytes, offset: int, value: int) -> bytes:
    return raw[:offset] + struct.pack("<Q", value) + raw[offset + 8:]


@pytest.mark.parametrize("edit, expected", [
    (lambda raw: _patched(raw, 8, 1 << 60), "declares 1,152,921,504,606,846,976 tensors in its header, more than its"),
    (lambda raw: _patched(raw, 16, 1 << 60), "declares 1,152,921,504,606,846,976 key-value pairs in its header"),
    (lambda raw: _patched(raw, 24, 1 << 60), "says its first key is 1,152,921,504,606,846,976 bytes long, longer than"),
    (lambda raw: _patched(raw, 8, 3), "bytes after the data of the 3 tensors its header declares: the tensor count "
                                      "is damaged (too small)"),
], ids=["tensor-count", "key-value-count", "first-string-length", "too-few-tensors"])
def test_a_gguf_header_that_cannot_be_true_is_named(gguf_bytes, tmp_path, edit, expected):
    """Issue cases: absurd counts and lengths said "the config file is not a valid JSON file"; a tensor count too
    small suggested upgrading transformers."""
    (tmp_path / "bad.gguf").write_bytes(edit(gguf_bytes))
    line = refused(tmp_path / "bad.gguf", tmp_path)
    assert f"'{tmp_path / 'bad.gguf'}'" in line and expected in line and "re-download it" in line, line
    assert "JSON" not in line and "transformers" not in line, line


def test_a_truncated_gguf_is_named(gguf_bytes, tmp_path):
    (tmp_path / "cut.gguf").write_bytes(gguf_bytes[: len(gguf_bytes) - 1000])
    line = refused(tmp_path / "cut.gguf", tmp_path)
    assert "runs past the end of its 67,000 bytes (the file is truncated" in line, line


def test_a_file_that_is_no_gguf_is_named(tmp_path):
    (tmp_path / "model.gguf").write_text("<html>404 Not Found</html>" * 10)
    line = refused(tmp_path / "model.gguf", tmp_path)
    assert "cannot be read as GGUF: it does not begin with the GGUF magic (not a GGUF file" in line, line


def test_a_damaged_gguf_given_as_a_recipes_tokenizer_is_named(gguf_bytes, tmp_path):
    (tmp_path / "tok.gguf").write_bytes(_patched(gguf_bytes, 16, 1 << 60))
    recipe = _tiny_recipe(tmp_path, tokenizer=str(tmp_path / "tok.gguf"))
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "tok.gguf' declares 1,152,921,504,606,846,976 key-value pairs" in line, line
    assert not (tmp_path / "run").exists()


# ============================================================================ recipes that are not recipe files


def _train(tmp_path, recipe):
    return _one_error_line(_tlm(["train", recipe, "--no-progress"]))


def test_a_python_tag_in_a_recipe_is_named_as_a_tag(tmp_path):
    """Issue case: a `!!python` tag was "not valid YAML, fix the syntax"; it never runs either way."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_tiny_recipe(tmp_path)) + 'x: !!python/object/apply:os.system ["touch pwned"]\n')
    line = _train(tmp_path, path)
    assert "the tag !!python/object/apply:os.system asks for a Python object, which a recipe never builds" in line
    assert "remove the tag" in line and not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def test_a_custom_tag_in_a_recipe_is_named(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_tiny_recipe(tmp_path)).replace("lr: 0.003", "lr: !decimal 0.003"))
    line = _train(tmp_path, path)
    assert "the tag !decimal is not plain data (a recipe is plain YAML data); remove the tag" in line, line


def test_a_folder_given_as_the_recipe_is_named(tmp_path):
    """Issue case: a folder given as the recipe "does not exist"."""
    (tmp_path / "recipes").mkdir()
    _write_recipe(tmp_path / "recipes", _tiny_recipe(tmp_path), name="tiny.yaml")
    line = _train(tmp_path, tmp_path / "recipes")
    assert "is a folder (it holds tiny.yaml); pass the YAML recipe file itself" in line, line


def test_a_recipe_that_is_a_pipe_is_never_read(tmp_path):
    os.mkfifo(tmp_path / "r.yaml")
    line = _train(tmp_path, tmp_path / "r.yaml")
    assert "r.yaml' is not a regular file (a device, pipe or socket), which is never read" in line, line


def test_a_recipe_that_is_a_dangling_link_is_named(tmp_path):
    (tmp_path / "r.yaml").symlink_to(tmp_path / "moved.yaml")
    line = _train(tmp_path, tmp_path / "r.yaml")
    assert f"is a symbolic link to '{tmp_path / 'moved.yaml'}', which does not exist" in line, line


# ============================================================================ data paths


@pytest.mark.parametrize("cmd", ["convert", "eval"])
def test_a_fifo_given_as_data_is_named_and_never_opened(source, tmp_path, cmd):
    """Issue case: a FIFO given as data was "not found" or "not UTF-8"; with a .txt name it would block."""
    os.mkfifo(tmp_path / "data.txt")
    args = ([source, "-o", tmp_path / "out", *FAST[2:], "--calibration-data", tmp_path / "data.txt"]
            if cmd == "convert" else [source, "--data", tmp_path / "data.txt", "--seq-len", "32"])
    line = _one_error_line(_tlm([cmd, *args]))
    assert f"data '{tmp_path / 'data.txt'}' is not a regular file (a pipe, device or socket)" in line, line
    assert not (tmp_path / "out").exists()


def test_a_dangling_data_link_is_named_not_looked_up_on_the_hub(source, tmp_path, monkeypatch):
    """`corpus` (a name that could be a hub dataset) is a dangling link here: named as one, never looked up."""
    (tmp_path / "corpus").symlink_to(tmp_path / "unmounted" / "corpus")
    monkeypatch.chdir(tmp_path)
    line = _one_error_line(_tlm(["eval", source, "--data", "corpus", "--seq-len", "32"]))
    assert "data 'corpus' is a symbolic link to" in line and "which does not exist" in line, line
    assert "hub" not in line, line


def test_a_data_link_that_loops_is_named(source, tmp_path):
    (tmp_path / "corpus.txt").symlink_to(tmp_path / "corpus.txt")
    line = _one_error_line(_tlm(["eval", source, "--data", tmp_path / "corpus.txt", "--seq-len", "32"]))
    assert "is a symbolic link to" in line and "which loops back to itself" in line, line


@pytest.mark.parametrize("files", [["a.txt"], ["sub/b.txt", "c.txt"], ["d.jsonl"]])
def test_a_data_folder_of_empty_files_says_so(source, tmp_path, files):
    """Issue case: an empty folder (of empty files) as `tlm eval --data` surfaced a datasets schema error."""
    for name in files:
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).write_text("")
    line = _one_error_line(_tlm(["eval", source, "--data", tmp_path / "data", "--seq-len", "32"]))
    assert f"every data file in '{tmp_path / 'data'}' is empty" in line and "Schema" not in line, line


def test_an_empty_data_folder_says_so(source, tmp_path):
    """Issue case, the folder with nothing in it at all."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    line = _one_error_line(_tlm(["eval", source, "--data", tmp_path / "data", "--seq-len", "32"]))
    assert f"no .txt, .jsonl, .json or .parquet files in '{tmp_path / 'data'}'" in line and "Schema" not in line, line


def test_an_empty_jsonl_file_says_so(source, tmp_path):
    (tmp_path / "d.jsonl").write_text("")
    line = _one_error_line(_tlm(["eval", source, "--data", tmp_path / "d.jsonl", "--seq-len", "32"]))
    assert f"data file '{tmp_path / 'd.jsonl'}' is empty" in line and "StopIteration" not in line, line


# ============================================================================ model paths


@pytest.mark.parametrize("kind", ["dangling", "loop", "fifo"])
def test_a_model_path_that_is_no_model_is_named_as_what_it_is(tmp_path, kind):
    path = tmp_path / "model"
    if kind == "dangling":
        path.symlink_to(tmp_path / "deleted-model")
        expected = "which does not exist"
    elif kind == "loop":
        path.symlink_to(path)
        expected = "which loops back to itself"
    else:
        os.mkfifo(path)
        expected = "is not a regular file or folder (a pipe, device or socket)"
    line = refused(path, tmp_path)
    assert f"'{path}'" in line and expected in line, line


# ============================================================================ code in a config


def test_a_config_auto_map_never_runs_and_is_said_aloud(source, tmp_path):
    """Issue case: a config.json auto_map was silently ignored where docs/robustness.md said it was refused. It is
    not refused (the model is read by its model_type with our own code, so nothing of it is needed): the page now
    says so, and the conversion says it was ignored. Without --trust-remote-code its code never runs."""
    src = copy_source(source, tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.Model"}
    (src / "config.json").write_text(json.dumps(config))
    (src / "evil.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').write('ran')\nclass Config: pass\n"
                                 "class Model: pass\n")
    res = _convert([src, "-o", tmp_path / "out", *FAST])
    assert res.exit_code == 0, res.output
    assert "note: config.json's auto_map (evil.Config, evil.Model) was ignored: the model is read as llama" in \
        res.output, res.output
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out" / "evil.py").exists()
    assert "evil" not in (tmp_path / "out" / "config.json").read_text()
    res = _tlm(["eval", src, "--data", str(DATA), "--seq-len", "32", "--max-tokens", "64"])
    assert res.exit_code == 0 and not (tmp_path / "pwned").exists(), res.output
    (src / "config.json").write_text(json.dumps({**config, "model_type": "evil"}))  # known only to its own code
    (tmp_path / "again").mkdir()
    line = refused(src, tmp_path / "again")
    assert "unsupported architecture: model_type 'evil'" in line and not (tmp_path / "pwned").exists(), line
