"""The training token pipeline at scale: the sharded cache (parallel, resumable tokenization), the per-rank
DataLoader with workers, resume from a mid-shard checkpoint, and the FineWeb-Edu recipe on a local copy."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import tlm_train.data as data_module
import tlm_train.shards as shards_module
import tlm_train.trainer as trainer_module
from test_train import DATA, ROOT, tiny_recipe
from tlm_io.load import byte_tokenizer
from tlm_io.text import to_blocks
from tlm_train.data import BatchOrder, micro_batch_loader, token_shards, tokenize_cached
from tlm_train.recipe import load_recipe, recipe_from_dict
from tlm_train.shards import TokenBlocks
from tlm_train.trainer import TrainError, train


def write_docs(path: Path, n: int = 40) -> list[str]:
    """n documents of 40-300 characters cut from the Shakespeare slice, as JSON lines."""
    text = DATA.read_text()
    docs, pos = [], 0
    for i in range(n):
        size = 40 + (i * 97) % 260
        docs.append(text[pos : pos + size])
        pos += size
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def expected_ids(docs: list[str]) -> list[int]:
    ids = list(docs[0].encode())
    for d in docs[1:]:
        ids += [256] + list(d.encode())  # <|endoftext|> between documents
    return ids


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(data_module, "SHARD_CHARS", 700)  # a few documents per shard


def shard_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/shard-*.bin"))


# ---------------------------------------------------------------------------------------------- the cache


def test_sharded_cache_is_the_token_stream_and_the_same_for_any_number_of_processes(tmp_path, small_shards):
    docs = write_docs(tmp_path / "docs.jsonl")
    tok = byte_tokenizer()
    one = token_shards(tok, str(tmp_path / "docs.jsonl"), cache_dir=tmp_path / "one")
    assert len(one.counts) >= 5 and one.dtype == np.uint16  # several shards; 257 ids fit in 16 bits
    assert one.read().tolist() == expected_ids(docs)
    two = token_shards(tok, str(tmp_path / "docs.jsonl"), cache_dir=tmp_path / "two", num_proc=2)
    files = [[p.read_bytes() for p in shard_files(tmp_path / name)] for name in ("one", "two")]
    assert files[0] == files[1]
    manifest = json.loads(next((tmp_path / "two").glob("*/manifest.json")).read_text())
    assert manifest["complete"] and manifest["shards"] == one.counts and manifest["tokens"] == len(one)
    # reads across shard boundaries; blocks as from one array
    k = one.offsets[2]
    assert one.read(k - 3, k + 4).tolist() == expected_ids(docs)[k - 3 : k + 4]
    blocks = TokenBlocks(one, 33, start=5, stop=len(one) - 7)
    assert torch.equal(blocks.all(), to_blocks(torch.tensor(expected_ids(docs)[5 : len(one) - 7]), 33).int())
    assert torch.equal(blocks[[3, 0, 7]], blocks.all()[[3, 0, 7]])
    assert two.read().tolist() == one.read().tolist()


class Killed(Exception):
    pass


def test_killed_tokenization_continues_where_it_stopped(tmp_path, small_shards, monkeypatch):
    docs = write_docs(tmp_path / "docs.jsonl")
    tok = byte_tokenizer()
    calls, alive = [], [True]
    original = shards_module.GroupWriter.__call__

    def dies_at_the_fourth_group(self, path, texts, joined):
        calls.append(path.name)
        if alive[0] and len(calls) == 4:
            raise Killed  # killed while tokenizing
        return original(self, path, texts, joined)

    monkeypatch.setattr(shards_module.GroupWriter, "__call__", dies_at_the_fourth_group)
    with pytest.raises(Killed):
        token_shards(tok, str(tmp_path / "docs.jsonl"), cache_dir=tmp_path)
    assert len(shard_files(tmp_path)) == 3 and not list(tmp_path.glob("*/manifest.json"))
    folder = shard_files(tmp_path)[0].parent
    (folder / "shard-00003.bin.tmp999999999").write_bytes(b"\0\0")  # a dead writer's partial file
    calls.clear()
    alive[0] = False
    resumed = token_shards(tok, str(tmp_path / "docs.jsonl"), cache_dir=tmp_path)
    assert calls[0] == "shard-00003.bin" and len(calls) == len(resumed.counts) - 3  # only the missing groups
    assert resumed.read().tolist() == expected_ids(docs)
    assert not list(folder.glob("*.tmp*"))
    (folder / "shard-00001.bin").write_bytes(b"\0\0")  # damaged: not the size the manifest records
    calls.clear()
    assert token_shards(tok, str(tmp_path / "docs.jsonl"), cache_dir=tmp_path).read().tolist() == expected_ids(docs)
    assert calls == ["shard-00001.bin"]


def test_a_token_cap_reads_only_what_it_needs_and_a_larger_one_continues(tmp_path, small_shards, monkeypatch):
    docs = write_docs(tmp_path / "docs.jsonl")
    tok = byte_tokenizer()
    assert tokenize_cached(tok, str(tmp_path / "docs.jsonl"), max_tokens=1000, cache_dir=tmp_path).tolist() == \
        expected_ids(docs)[:1000]
    manifest = json.loads(next(tmp_path.glob("*/manifest.json")).read_text())
    assert not manifest["complete"] and 1000 <= manifest["tokens"] < len(expected_ids(docs))
    first = len(shard_files(tmp_path))
    written = []
    original = shards_module.GroupWriter.__call__
    monkeypatch.setattr(shards_module.GroupWriter, "__call__",
                        lambda self, path, *a: written.append(path.name) or original(self, path, *a))
    assert tokenize_cached(tok, str(tmp_path / "docs.jsonl"), cache_dir=tmp_path).tolist() == expected_ids(docs)
    assert written[0] == f"shard-{first:05d}.bin"  # the first shards were kept


def test_a_streamed_hub_corpus_is_read_only_as_far_as_the_cap_needs(tmp_path, small_shards, monkeypatch):
    """NAME:CONFIG streams that configuration; with max_tokens the stream is left once the shards hold enough."""
    import datasets

    docs = [DATA.read_text()[i : i + 150] for i in range(0, 30000, 150)]
    calls, served = [], []

    def fake_hub(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        return ({"text": d} for d in docs if served.append(d) is None)

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    ids = tokenize_cached(byte_tokenizer(), "HuggingFaceFW/fineweb-edu:sample-10BT", max_tokens=2000,
                          cache_dir=tmp_path)
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)]
    assert ids.tolist() == expected_ids(docs)[:2000]
    assert 2000 / 150 < len(served) < len(docs) / 4  # read a few groups past the cap, not the corpus


# ---------------------------------------------------------------------------------------------- the DataLoader


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_serves_each_rank_its_micro_batches_from_any_step(tmp_path, small_shards, workers):
    write_docs(tmp_path / "docs.jsonl", n=60)
    blocks = TokenBlocks(token_shards(byte_tokenizer(), str(tmp_path / "docs.jsonl"), cache_dir=tmp_path), 17)
    order = BatchOrder(blocks, batch_size=3, grad_accum=2, world=2, seed=5)
    for rank in range(2):
        got = list(micro_batch_loader(order, rank, first_step=7, last_step=12, num_workers=workers))
        want = [order.micro_batch(step, micro, rank) for step in range(7, 12) for micro in range(2)]
        assert len(got) == 10 and all(torch.equal(a, b) for a, b in zip(got, want))
        assert got[0].dtype == torch.int64 and got[0].shape == (3, 17)


# ---------------------------------------------------------------------------------------------- resume


def record_batches(monkeypatch) -> list:
    seen = []
    original = trainer_module.next_token_loss

    def recording(forward, model, ids):
        seen.append(ids.clone())
        return original(forward, model, ids)

    monkeypatch.setattr(trainer_module, "next_token_loss", recording)
    return seen


def test_resume_from_a_mid_shard_checkpoint_sees_the_identical_batches(tmp_path, small_shards, monkeypatch):
    """The order is a global shuffle of blocks over all shards; the checkpoint after step 3 stands mid-epoch (and
    so inside a shard's range); two DataLoader workers read the batches. The resumed run must see exactly the
    micro-batches and losses of the uninterrupted one (and those of a run without workers)."""
    write_docs(tmp_path / "docs.jsonl", n=120)
    data = {"train": str(tmp_path / "docs.jsonl"), "num_workers": 2}
    seen = record_batches(monkeypatch)
    full = train(recipe_from_dict(tiny_recipe(tmp_path, "full", data=data, train={"grad_accum": 2})))
    full_batches = list(seen)
    cache = next((tmp_path / "cache").glob("*/manifest.json")).parent
    assert len(list(cache.glob("shard-*.bin"))) >= 5
    half = recipe_from_dict(tiny_recipe(tmp_path, "half", data=data, train={"grad_accum": 2}))
    train(half)
    shutil.rmtree(Path(half.output_dir) / "checkpoint-6")
    shutil.rmtree(Path(half.output_dir) / "final")
    state = json.loads((Path(half.output_dir) / "checkpoint-3" / "trainer_state.json").read_text())
    position = state["data"]
    assert position["samples"] == 3 * 8 and 0 < position["block_in_epoch"] < position["train_blocks"]
    seen.clear()
    resumed = train(half, resume=True)
    assert resumed.losses == full.losses[3:] and resumed.eval_loss == full.eval_loss
    evaluation = (len(full_batches) - 6 * 2) // 2  # batches of one evaluation (the full run: two)
    assert len(seen) == 3 * 2 + evaluation  # steps 4-6 x 2 micro-batches, then the final evaluation
    assert all(torch.equal(a, b) for a, b in zip(seen, full_batches[-len(seen):]))
    seen.clear()
    plain = train(recipe_from_dict(tiny_recipe(tmp_path, "plain", data={"train": data["train"]},
                                               train={"grad_accum": 2})))
    assert plain.losses == full.losses and all(torch.equal(a, b) for a, b in zip(seen, full_batches))


def test_tlm_tokenize_fills_the_cache_a_run_then_reads(tmp_path, small_shards, monkeypatch):
    import yaml
    from click.testing import CliRunner

    from tlm_cli.main import tlm_main

    docs = write_docs(tmp_path / "docs.jsonl", n=120)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(tmp_path, data={"train": str(tmp_path / "docs.jsonl")},
                                               train={"max_steps": 2})))
    res = CliRunner().invoke(tlm_main, ["tokenize", str(path), "--set", "data.num_proc=2"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.rindex("{"):])  # after datasets' progress bar (stderr)
    assert summary["train_tokens"] == len(expected_ids(docs)) and summary["shards"] >= 5
    assert summary["eval_tokens"] is None  # no data.eval: held out from the training tokens

    def no_reading(*args):
        raise AssertionError("the run tokenized again")

    monkeypatch.setattr(data_module, "_documents", no_reading)
    assert CliRunner().invoke(tlm_main, ["train", str(path), "--no-progress"]).exit_code == 0
    bad = CliRunner().invoke(tlm_main, ["tokenize", str(tmp_path / "none.yaml")])
    lines = bad.output.strip().splitlines()
    assert bad.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error:") and "does not exist" in lines[0]


@pytest.mark.slow
def test_two_gloo_ranks_with_loader_workers_match_one_process(tmp_path, small_shards):
    """Each of 2 DDP ranks reads its half of every global batch through 2 DataLoader workers: the same losses as one
    process with the whole batch. (The torchrun processes use the default shard size, one shard for this corpus:
    reads across shard boundaries are covered in-process above.)"""
    from test_train import _torchrun, metrics

    write_docs(tmp_path / "docs.jsonl", n=120)
    data = {"train": str(tmp_path / "docs.jsonl")}
    single = train(recipe_from_dict(tiny_recipe(tmp_path, "single", data=data, train={"max_steps": 4})))
    ranks = tiny_recipe(tmp_path, "ddp", data={**data, "num_workers": 2}, train={"max_steps": 4, "batch_size": 2})
    proc = _torchrun(tmp_path, ranks)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [m["loss"] for m in metrics(tmp_path / "ddp") if "loss" in m] == pytest.approx(single.losses, abs=1e-5)


def test_resume_on_other_data_is_refused(tmp_path):
    r = tiny_recipe(tmp_path, "a", train={"max_steps": 3})
    train(recipe_from_dict(r))
    r["data"]["max_train_tokens"] = 30000
    # refused by the recipe check, which names the changed key, before the data fingerprint is compared
    with pytest.raises(TrainError, match=r"different recipe \(data\.max_train_tokens: None -> 30000\)"):
        train(recipe_from_dict(r), resume=True)


# ---------------------------------------------------------------------------------------------- the recipe


def test_fineweb_edu_recipe_runs_offline_on_a_local_copy(tmp_path):
    """recipes/cpt/smollm2-135m-tlm-fineweb-edu.yaml with data.train pointed at a local parquet file of the
    corpus' layout and columns (its own data settings: 16 tokenizing processes, 2 loader workers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    recipe_path = ROOT / "recipes" / "cpt" / "smollm2-135m-tlm-fineweb-edu.yaml"
    hub = load_recipe(recipe_path)
    assert hub.data.train == "HuggingFaceFW/fineweb-edu:sample-10BT" and hub.data.num_workers > 0
    text = DATA.read_text()
    docs = [text[i : i + 500] for i in range(0, 40000, 500)]
    local = tmp_path / "fineweb-edu" / "sample" / "10BT"
    local.mkdir(parents=True)
    pq.write_table(pa.table({"text": docs, "id": [f"<urn:{i}>" for i in range(len(docs))],
                             "dump": ["CC-MAIN-2024-10"] * len(docs), "url": ["https://example.org"] * len(docs),
                             "score": [3.1] * len(docs), "int_score": [3] * len(docs)}), local / "000_00000.parquet")
    base = train(recipe_from_dict(tiny_recipe(tmp_path, "base", train={"max_steps": 1})))
    overrides = [f"output_dir={tmp_path / 'cpt'}", f"init_from={base.final_dir}", f"distill.teacher={base.final_dir}",
                 f"data.train={local}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64",
                 "data.eval_tokens=1024", "train.batch_size=2", "train.grad_accum=2", "train.max_steps=2",
                 "train.num_threads=1", "log.progress=false", "log.tensorboard=false"]
    result = train(load_recipe(recipe_path, overrides))
    assert result.steps == 2 and result.tokens == 2 * 2 * 2 * 64 and np.isfinite(result.eval_loss)
    assert os.path.isdir(result.final_dir)


def test_tokenize_reads_only_the_tokenizer_files_of_init_from(tmp_path, monkeypatch):
    """A recipe without ``tokenizer:`` tokenizes with init_from's tokenizer, read from its tokenizer files alone (no
    weights loaded), the tokenizer the run's model loader gives; a checkpoint without tokenizer files is refused."""
    import tlm_io.load as load_module
    from tiny_sources import make_source
    from tlm_train.prepare import prepare_data, recipe_tokenizer

    source = make_source(tmp_path / "src", "llama")
    expected = load_module.load_model(str(source))[1]

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(load_module, "load_source", no_weights)
    spec = tiny_recipe(tmp_path, init_from=str(source), tokenizer=None)
    del spec["model"]
    recipe = recipe_from_dict(spec)
    assert recipe_tokenizer(recipe).get_vocab() == expected.get_vocab()
    assert prepare_data(recipe)["train_tokens"] > 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (source / name).unlink(missing_ok=True)
    with pytest.raises(TrainError, match="has no tokenizer files; set tokenizer:"):
        recipe_tokenizer(recipe)


def test_tokenize_never_reads_the_weights_of_init_from(tmp_path):
    """``tlm tokenize`` without ``tokenizer:`` on a checkpoint whose weights file is garbage: loading the model fails
    on that file, the tokenizer (all ``tlm tokenize`` needs) still comes back, equal to the intact checkpoint's."""
    from tiny_sources import make_source
    from tlm_io.errors import ConversionError
    from tlm_io.load import load_model
    from tlm_train.prepare import recipe_tokenizer

    source = make_source(tmp_path / "src", "llama")
    spec = tiny_recipe(tmp_path, init_from=str(source), tokenizer=None)
    del spec["model"]
    recipe = recipe_from_dict(spec)
    intact = recipe_tokenizer(recipe)
    (source / "model.safetensors").write_bytes(b"\xff" * 64)  # no safetensors header: any weight read fails
    with pytest.raises(ConversionError, match="model.safetensors' is corrupt or truncated"):
        load_model(str(source))
    tokenizer = recipe_tokenizer(recipe)
    assert tokenizer.get_vocab() == intact.get_vocab() and tokenizer("a b c").input_ids == intact("a b c").input_ids
