"""Hostile and careless users (issue 25): each case a tiny, fast, offline test.

A run owns only what it wrote (a training output_dir is refused unless new, empty or a previous run's; its clean-up
touches exact names only), locks follow no symlink and two names of one folder share one lock, sizes are checked
before memory is allocated, and every bad input file is refused in one line naming it.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import yaml
from test_faults import _convert, _one_error_line, _tiny_recipe, _tlm, _write_recipe
from tiny_sources import make_source, tiny_tokenizer

from tlm_io.errors import ConversionError
from tlm_io.outputs import OutputLock, clean_stale, clean_stale_in


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("hostile") / "llama", "llama", tokenizer=tiny_tokenizer())


def _listing(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


# ============================================================================ a training folder owns what it wrote


def _users_folder(folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".notes.tmp").write_text("my notes")
    (folder / ".cache.tmp-abc").mkdir()
    (folder / ".cache.tmp-abc" / "x").write_text("cached")
    (folder / ".build.old").mkdir()
    (folder / ".env.old").write_text("SECRET=1")
    return _listing(folder)


def test_train_refuses_a_users_folder_and_touches_nothing_in_it(tmp_path):
    before = _users_folder(tmp_path / "mine")
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path, "mine"))
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "holds files a run did not write" in line and "output_dir" in line, line
    assert _listing(tmp_path / "mine") == before


def test_train_refuses_the_recipes_own_folder(tmp_path):
    recipe = tmp_path / "proj"
    recipe.mkdir()
    path = _write_recipe(recipe, _tiny_recipe(tmp_path, "proj"), name="recipe.yaml")
    before = path.read_bytes()
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "folder of the recipe" in line, line
    assert path.read_bytes() == before and sorted(p.name for p in recipe.iterdir()) == ["recipe.yaml"]


@pytest.mark.parametrize("where", ["/", "~"])
def test_train_refuses_root_and_home(tmp_path, where, monkeypatch):
    if where == "~":
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        (tmp_path / "home").mkdir()
    recipe = _tiny_recipe(tmp_path)
    recipe["output_dir"] = os.path.expanduser(where)
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "never writes into" in line, line
    if where == "~":
        assert sorted(p.name for p in (tmp_path / "home").iterdir()) == []


def test_training_clean_up_removes_only_its_own_stale_entries(tmp_path):
    before = _users_folder(tmp_path)
    (tmp_path / ".checkpoint-3.tmp-train").mkdir()  # a run killed while saving checkpoint-3
    (tmp_path / ".final.old-77").mkdir()  # ... or between the two renames of final/
    (tmp_path / ".final.old-77" / "config.json").write_text("{}")
    (tmp_path / ".checkpoint-4.tmp-train").write_text("a file, not what a run leaves")
    found = clean_stale_in(tmp_path, r"checkpoint-\d+|final")
    assert sorted(p.name for p in found) == [".checkpoint-3.tmp-train", ".final.old-77"]
    assert (tmp_path / "final" / "config.json").is_file()
    after = _listing(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert (tmp_path / ".checkpoint-4.tmp-train").is_file()


def test_convert_clean_up_leaves_a_users_look_alike_file(tmp_path):
    (tmp_path / ".out.tmp-notes").write_text("mine")  # a file: a run only ever leaves folders
    (tmp_path / ".out.old-env").mkdir()  # not a pid
    clean_stale(tmp_path / "out")
    assert (tmp_path / ".out.tmp-notes").read_text() == "mine" and (tmp_path / ".out.old-env").is_dir()
    assert not (tmp_path / "out").exists()


def test_a_previous_run_is_still_resumable(tmp_path):
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path, train={"max_steps": 3}))
    assert _tlm(["train", path, "--no-progress"]).exit_code == 0
    (tmp_path / "run" / "my-notes.txt").write_text("the folder is ours now; a user file inside is left alone")
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path, train={"max_steps": 6}))
    res = _tlm(["train", path, "--no-progress", "--resume"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "run" / "my-notes.txt").is_file() and (tmp_path / "run" / ".tlm-run").is_file()


# ============================================================================ locks


def test_a_lock_file_symlink_is_never_followed(source, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("do not touch")
    (tmp_path / ".out.lock").symlink_to(precious)
    line = _one_error_line(_convert([source, "-o", tmp_path / "out"]))
    assert "symbolic link" in line and ".out.lock" in line, line
    assert precious.read_text() == "do not touch" and (tmp_path / ".out.lock").is_symlink()


def test_a_hard_linked_lock_file_is_not_truncated(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("do not touch")
    os.link(precious, tmp_path / ".out.lock")
    with pytest.raises(ConversionError, match="hard links"):
        OutputLock(tmp_path / "out").acquire()
    assert precious.read_text() == "do not touch"


def test_two_names_of_one_folder_share_one_lock(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    with OutputLock(tmp_path / "real" / "out"):
        with pytest.raises(ConversionError, match="being written by another run"):
            OutputLock(tmp_path / "alias" / "out").acquire()
        with pytest.raises(ConversionError, match="being written by another run"):
            OutputLock(tmp_path / "real" / "x" / ".." / "out").acquire()


def test_a_lock_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConversionError, match="does not take new files .*lock file .* choose another -o"):
        OutputLock(tmp_path / "file" / "sub" / "out").acquire()


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


# ============================================================================ sizes before memory


def _with_config(source: Path, folder: Path, **fields) -> Path:
    import shutil

    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return folder


@pytest.mark.parametrize("fields", [{"num_hidden_layers": 10_000_000}, {"num_hidden_layers": 100_000},
                                    {"hidden_size": 1 << 20}, {"vocab_size": 10**12},
                                    {"intermediate_size": 60_000, "hidden_size": 60_000, "num_hidden_layers": 3000}])
def test_an_absurd_source_config_is_refused_before_anything_is_built(source, tmp_path, fields):
    import time

    src = _with_config(source, tmp_path / "src", **fields)
    t0 = time.perf_counter()
    line = _one_error_line(_convert([src, "-o", tmp_path / "out"]))
    assert time.perf_counter() - t0 < 20
    assert "config.json" in line and any(f"{k}={v}" in line for k, v in fields.items()), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fields", [{"num_hidden_layers": 10_000_000}, {"hidden_size": 1048576}])
def test_an_absurd_recipe_model_is_refused_before_anything_is_built(tmp_path, fields):
    recipe = _tiny_recipe(tmp_path)
    recipe["model"]["config"].update(fields)
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    key, value = next(iter(fields.items()))
    assert f"model.config.{key}={value}" in line, line
    assert not (tmp_path / "run" / "recipe.yaml").exists()


def test_a_model_beyond_the_available_memory_is_refused(monkeypatch):
    from tlm_io import sizes

    monkeypatch.setattr(sizes, "available_memory", lambda: 1 << 30)
    cfg = {"num_hidden_layers": 64, "hidden_size": 8192, "intermediate_size": 28672, "vocab_size": 128256}
    with pytest.raises(ConversionError, match="more than the 1.0 GiB of available memory"):
        sizes.check_model_size(cfg, "config.json")
    assert sizes.check_model_size({**cfg, "num_hidden_layers": 1, "hidden_size": 64, "vocab_size": 100}, "x") > 0


def test_a_gguf_with_an_absurd_block_count_is_refused(tmp_path, monkeypatch):
    gguf = pytest.importorskip("gguf")
    from test_checkpoint import write_tiny_gguf

    real = gguf.GGUFWriter.add_block_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", lambda self, n: real(self, 10_000_000))
    write_tiny_gguf(tmp_path / "bomb.gguf")
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", real)
    line = _one_error_line(_convert([tmp_path / "bomb.gguf", "-o", tmp_path / "out"]))
    assert "bomb.gguf" in line and "num_hidden_layers=10000000" in line, line


LAUNCH = """import sys
sys.argv = sys.argv[1:]
from tlm_cli import launch
try:
    getattr(launch, sys.argv[0])()
except SystemExit as stop:
    print("exit", stop.code, "torch imported" if "torch" in sys.modules else "no torch")
"""


def _launch(command: str, *args) -> tuple[str, str]:
    """(stdout, stderr) of a console entry point of tlm_cli.launch run in a fresh interpreter."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LAUNCH, command, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TLM_DEBUG": ""})
    return done.stdout.strip(), done.stderr.strip()


def test_the_console_commands_refuse_a_bomb_before_importing_torch(source, tmp_path, monkeypatch):
    """A config, GGUF or recipe declaring 10^7 layers is refused by the entry point itself, in one line, before the
    commands' modules (and torch behind them: seconds of start-up) are imported."""
    gguf = pytest.importorskip("gguf")
    from test_checkpoint import write_tiny_gguf

    real = gguf.GGUFWriter.add_block_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", lambda self, n: real(self, 10_000_000))
    write_tiny_gguf(tmp_path / "bomb.gguf")
    monkeypatch.undo()
    folder = _with_config(source, tmp_path / "src", num_hidden_layers=10_000_000)
    recipe = _tiny_recipe(tmp_path)
    recipe["model"]["config"]["hidden_size"] = 1 << 20
    cases = [("convert_main", [folder, "-o", tmp_path / "out"],
              f"{folder / 'config.json'}: num_hidden_layers=10000000"),
             ("convert_main", [tmp_path / "bomb.gguf", "-o", tmp_path / "out", "--low-memory"],
              f"{tmp_path / 'bomb.gguf'}: num_hidden_layers=10000000"),
             ("tlm_main", ["train", _write_recipe(tmp_path, recipe), "--no-progress"],
              "recipe: model.config.hidden_size=1048576 is above the supported maximum")]
    for command, args, named in cases:
        out, err = _launch(command, *args)
        assert out == "exit 1 no torch", (command, args, out, err)
        assert err.startswith("error: ") and named in err and "\n" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


def test_declared_sizes_never_read_a_pipe_or_a_huge_config(tmp_path):
    """What the entry point reads is bounded like every side file: a FIFO config.json is not waited on, and a 65 MiB
    one is not read (each gives no sizes; the command then names the problem)."""
    import threading

    from tlm_io.sizes import declared_sizes

    for name in ("fifo", "huge"):
        (tmp_path / name).mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.json")
    (tmp_path / "huge" / "config.json").write_text('{"num_hidden_layers": 10000000' + " " * (65 << 20) + "}")
    for name in ("fifo", "huge"):
        found = []
        reader = threading.Thread(target=lambda: found.append(declared_sizes(tmp_path / name)), daemon=True)
        reader.start()
        reader.join(timeout=20)
        assert found == [{}], name  # a plain read would block on the FIFO and parse the huge file's layers


def test_the_entry_points_pass_what_they_cannot_judge_to_the_command(source, tmp_path):
    """A good source, an output folder holding a bomb (never read), a file that is no checkpoint, a missing path and
    a built-in name pass the entry point's check: the command itself reads (and judges) them."""
    from tlm_cli.launch import preflight

    bomb = _with_config(source, tmp_path / "old_out", num_hidden_layers=10_000_000)
    (tmp_path / "notes.txt").write_text("text")
    preflight([str(source), "-o", str(bomb), "--calibration-data", str(tmp_path / "notes.txt"), "--overwrite"])
    (tmp_path / "deep.yaml").write_text("model: " + "[" * 200_000)  # refused by depth before PyYAML recurses
    (tmp_path / "huge.yaml").write_bytes(b"")
    os.truncate(tmp_path / "huge.yaml", 17 << 20)  # sparse, over the recipe bound: never read
    preflight(["train", str(tmp_path / "deep.yaml"), str(tmp_path / "huge.yaml")])
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / "config.json").symlink_to("/dev/zero")  # never read: it would never end
    preflight([str(tmp_path / "device"), "-o", str(tmp_path / "x")])  # the command names the problem
    preflight(["smollm2-135m", "-o", str(tmp_path / "x"), str(tmp_path / "missing")])
    with pytest.raises(SystemExit):
        preflight([str(source), "--teacher", str(bomb)])


# ============================================================================ readers: every bad file in one line


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


def _deep(header):
    rest = json.dumps(header)[1:]
    return '{"__metadata__": ' + "[" * 200_000 + "]" * 200_000 + ", " + rest


@pytest.mark.parametrize("edit, expected", [(_alias, "overlaps"), (_int_weight, "dtype I32"),
                                            (_negative, "negative dimension"), (_f8, "dtype F8_E4M3"),
                                            (_deep, "nested too deeply")])
def test_a_hostile_safetensors_header_is_one_line(source, tmp_path, edit, expected):
    src = _edit_safetensors(source, tmp_path / "src", edit)
    before = _listing(src)
    line = _one_error_line(_convert([src, "-o", tmp_path / "out"]))
    assert expected in line and "model.safetensors" in line and "internal error" not in line, line
    assert not (tmp_path / "out").exists() and _listing(src) == before


# ============================================================================ resume


def test_resume_with_a_changed_non_shape_setting_is_refused(tmp_path):
    path = _write_recipe(tmp_path, _tiny_recipe(tmp_path, train={"max_steps": 3}))
    assert _tlm(["train", path, "--no-progress"]).exit_code == 0
    before = _listing(tmp_path / "run")
    changed = _tiny_recipe(tmp_path, train={"max_steps": 6}, optim={"lr": 1e-2})
    changed["model"]["config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, changed), "--no-progress", "--resume"]))
    assert "different recipe" in line and "optim.lr" in line and "model.config.rope_parameters" in line, line
    assert "train.max_steps" not in line  # what a resume may change
    after = _listing(tmp_path / "run")
    assert {k: v for k, v in after.items() if k != "recipe.yaml"} == {k: v for k, v in before.items()
                                                                       if k != "recipe.yaml"}


# ============================================================================ the rest of the cases

from test_faults import FAST  # noqa: E402
from tiny_sources import DATA  # noqa: E402


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory) -> Path:
    """A source whose model has 100 embeddings beside the 320-token tokenizer."""
    return make_source(tmp_path_factory.mktemp("vocab") / "small", "llama", tokenizer=tiny_tokenizer(), vocab_size=100)


@pytest.mark.parametrize("args", [["convert", "-o", "{tmp}/out", *FAST],
                                  ["convert", "-o", "{tmp}/out", *FAST[2:], "--calibration-data", "self"],
                                  ["eval", "--data", str(DATA), "--seq-len", "32", "--max-tokens", "64"]],
                         ids=["convert", "self-calibration", "eval"])
def test_a_model_vocabulary_smaller_than_its_tokenizer_is_one_line(small_vocab, tmp_path, args):
    cmd, *rest = args
    line = _one_error_line(_tlm([cmd, small_vocab, *(a.replace("{tmp}", str(tmp_path)) for a in rest)]))
    assert "tokenizer.json" in line and "beyond the 100 embeddings" in line and "model's own tokenizer" in line, line
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("gpt2") / "gpt2", "gpt2", tokenizer=tiny_tokenizer())  # n_positions 128


@pytest.mark.parametrize("cmd", ["convert", "eval"])
def test_a_sequence_longer_than_the_sources_positions_is_one_line(gpt2, tmp_path, cmd):
    args = (["-o", tmp_path / "out", *FAST[:4], "--seq-len", "256", "--calibration-tokens", "512"] if cmd == "convert"
            else ["--data", str(DATA), "--seq-len", "256"])
    line = _one_error_line(_tlm([cmd, gpt2, *args]))
    assert "--seq-len 256 is longer than the 128 positions" in line and "--seq-len 128 or less" in line, line
    assert not list(tmp_path.iterdir())


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


def test_a_token_cache_with_ids_beyond_the_vocabulary_is_refused_before_anything_is_written(tmp_path):
    import numpy as np

    recipe = _tiny_recipe(tmp_path)
    assert _tlm(["tokenize", _write_recipe(tmp_path, recipe)]).exit_code == 0
    (shard,) = (tmp_path / "cache").glob("*/shard-00000.bin")
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[len(ids) // 2] = 300  # the byte tokenizer has 257 tokens
    ids.tofile(shard)
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, recipe), "--no-progress"]))
    assert "token cache" in line and str(shard.parent) in line and "token id 300" in line, line
    assert "delete that cache folder" in line, line
    assert not (tmp_path / "run").exists()  # no recipe.yaml, no marker: a new output_dir is not even created


def test_a_heal_of_a_trillion_tokens_is_refused_after_its_first_steps(source, tmp_path):
    line = _one_error_line(_convert([source, "-o", tmp_path / "out", *FAST, "--heal-tokens", "1000000000000"]))
    assert line.startswith("error: heal: 3,906,250,000 steps of 256 tokens, about "), line
    steps = re.search(r" h at the rate of its first (\d+) steps", line)
    assert steps and 2 <= int(steps.group(1)) < 1000, line  # refused a few steps (about a second) in, not after
    assert "above the --max-hours 24 limit" in line and "lower --heal-tokens" in line, line
    assert not list(tmp_path.iterdir())


def test_self_calibration_of_a_trillion_tokens_is_refused_before_sampling(source, tmp_path):
    line = _one_error_line(_convert([source, "-o", tmp_path / "out", *FAST[2:], "--calibration-data", "self",
                                     "--calibration-tokens", "1000000000000"]))
    assert "--calibration-tokens 1000000000000 needs about" in line and "available memory" in line, line
    assert not list(tmp_path.iterdir())


def test_self_calibration_above_the_time_limit_is_refused_with_its_estimate(source, tmp_path):
    out = tmp_path / "out"
    res = _convert([source, "-o", out, *FAST[2:], "--calibration-data", "self", "--calibration-tokens", "200000",
                    "--max-hours", "0.0001"])
    line = _one_error_line(res)
    assert "self samples: 200,000 tokens, about" in line and "above the --max-hours 0.0001 limit" in line, line
    assert "lower --calibration-tokens" in line and "--max-hours 0 (no limit)" in line, line
    assert not list(tmp_path.iterdir())


def test_the_seed_is_checked_against_its_range(source, tmp_path):
    line = _one_error_line(_convert([source, "-o", tmp_path / "out", *FAST, "--seed", "10000000000000"]))
    assert "--seed 10000000000000: must be in 0..4294967295" in line, line
    line = _one_error_line(_tlm(["train", _write_recipe(tmp_path, _tiny_recipe(tmp_path, seed=10**13)),
                                 "--no-progress"]))
    assert "seed: must be in 0..4294967295" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_an_output_where_no_file_can_be_created_names_the_option(source):
    line = _one_error_line(_convert([source, "-o", "/proc/x", *FAST]))
    assert "cannot write /proc/x: its folder '/proc' does not take new files" in line and "another -o" in line, line


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_recipe_number_that_is_not_finite_names_its_key(tmp_path, value):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_tiny_recipe(tmp_path)).replace("lr: 0.003", f"lr: {value}"))
    line = _one_error_line(_tlm(["train", path, "--no-progress"]))
    assert "optim.lr: expected a finite number" in line and "r.yaml" in line, line
    assert not (tmp_path / "run").exists()


def test_export_onto_an_existing_folder_names_no_option_it_lacks(source, tmp_path):
    (tmp_path / "out").mkdir()
    line = _one_error_line(_tlm(["export", source, "--to", "tlm", "-o", tmp_path / "out"]))
    assert "already exists" in line and "--overwrite" not in line and "choose another -o" in line, line


def test_analyze_into_a_folder_under_a_file_fails_before_the_model_is_loaded(source, tmp_path, monkeypatch):
    import tlm_cli.main

    monkeypatch.setattr(tlm_cli.main, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "file").write_text("x")
    line = _one_error_line(_tlm(["analyze", source, "--data", str(DATA), "-o", tmp_path / "file" / "sub"]))
    assert "is a file, not a folder" in line and "choose another -o" in line, line


# ============================================================================ signals: 143 with its one line


def _sigterm_self_once(monkeypatch, owner, name):
    """Make ``owner.name`` send this process SIGTERM the first time it is called (a real signal, in process)."""
    import signal

    real, sent = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def test_sigterm_during_calibration_exits_143_with_its_line(source, tmp_path, monkeypatch):
    from tlm_convert import samples

    _sigterm_self_once(monkeypatch, samples._Advance, "__call__")
    res = _convert([source, "-o", tmp_path / "out", *FAST[2:], "--calibration-data", "self"])
    assert res.exit_code == 143, res.output
    line = _one_error_line(res)
    assert "stopped by SIGTERM during sample" in line and "nothing was written" in line, line
    assert not list(tmp_path.iterdir())


def test_sigterm_during_a_heal_exits_143_with_its_line(source, tmp_path, monkeypatch):
    from tlm_train import trainer

    _sigterm_self_once(monkeypatch, trainer._Run, "train_step")
    res = _convert([source, "-o", tmp_path / "out", *FAST, "--heal-tokens", "1024"])
    assert res.exit_code == 143, res.output
    line = _one_error_line(res)
    assert "stopped by SIGTERM during the heal" in line and "nothing was written" in line, line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("reason, code", [("SIGTERM", 143), ("STOP", 143), ("SIGINT", 130)])
def test_a_stopped_run_is_one_line_with_128_plus_the_signal(reason, code, capsys):
    from tlm_cli.common import report_failure
    from tlm_io.errors import Stopped

    with pytest.raises(SystemExit) as exit_:
        report_failure(Stopped(reason, "calibrate"), stopped="nothing was written")
    assert exit_.value.code == code
    assert capsys.readouterr().err == f"error: stopped by {reason} during calibrate; nothing was written\n"
