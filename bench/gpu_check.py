"""GPU readiness check (issues 12 and 26): what only a GPU shows, in one command that ends within its time budget.

    bash bench/gpu_check.sh                 # on a GPU machine: budget 450 s (under 8 minutes with start-up)
    bash bench/gpu_check.sh --dry           # on CPU: tiny shapes, a few steps, seconds (the default tests run it)
    bash bench/gpu_check.sh --dry --device cuda   # the same tiny shapes on the GPU: a smoke of the CUDA paths

1. Convert and heal (first; 290 s of the budget at most): ``tlm-convert smollm2-135m --device cuda --eval-data
   all-eval`` in-process (tlm_convert.convert.convert); its wall time less the evaluation phase against the CPU
   figure recorded in bench/results/convert_time.json (the default conversion without evaluation, in-process; not
   rerun here: it takes over 7 minutes), and its peak GPU memory. Then the ``--heal-tokens`` heal of the converted
   model (tlm_convert.heal.heal_recipe: HEAL_RECIPE, teacher = the source, the calibration sources as heal text,
   through tlm_train.trainer.train) in bf16 with a batch of 16 x 512 tokens (the recipe's 4 x 512 leaves a 135M
   model's steps launch-bound on a GPU; lr unchanged) for 180 s of wall time (``--heal-s``; trainer set-up, steps
   and checkpoint writes), in 3 parts: each is stopped through the trainer's STOP file, its checkpoint is
   evaluated on every bundled set as the conversion report evaluates (the first 16,384 tokens in 512-token
   blocks), and the next part resumes it. Per point (0 = right after the conversion): tokens, epochs of the heal
   text, tokens/s of the steps (metrics.jsonl windows: no set-up, no checkpoint write) and of the wall time, the
   part's peak GPU memory, and the perplexity ratio to the source of each set with the geometric mean over the
   out-of-domain sets (fiction, code, legal, encyclopedic).
2. Training throughput of the 435M recipes (recipes/scratch/gpu/<mixer>-<schedule>.yaml: their model config, micro
   batch and seq_len; vocabulary 32,000 = their Llama-2 tokenizer, not downloaded) for the four mixers, uniform and
   cosine-tapered, in the time section 1 left: one step = forward + ``lm_loss`` + backward + AdamW (fused on CUDA),
   bf16 autocast with fp32 master weights as ``tlm train`` does, on random token ids. Each config runs eager
   first, then under ``torch.compile`` (the whole model, as ``train.compile: true`` does); tokens/s = tokens per
   step / median step time (CUDA synchronized), at least ``--min-steps`` timed steps after the warm-up ones.
   MFU = tokens/s x model FLOPs per token / the GPU's dense bf16 peak, with the PaLM count
   6 N + 12 L d S (N: parameters doing matmuls, i.e. without the embedding table but with the LM head; L layers,
   d attention width, S seq_len), the same formula for every mixer (what a mixer computes beyond attention is not
   counted). Peak GPU memory = ``torch.cuda.max_memory_allocated`` of each phase (reset before each).

Each section runs in a worker process with a share of the budget; one that passes it (a compile that does not
finish, a hang) is stopped and reported as such, so the whole check ends on time and every figure it could take
is printed. ``--dry``: CPU; a tiny random Llama converted, evaluated and healed for 3 s; a tiny model per
throughput config, 2 steps, torch.compile with the ``eager`` backend for the cosine configs (dynamo traces each
mixer; no code generation).
Prints markdown tables and one JSON line; writes ``--out`` (bench/results/gpu_check.json; dry: a temp file).
"""


from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

MIXERS = ("attention", "gated_attention", "hope_attention", "titans")
SCHEDULES = ("uniform", "cosine")
RECIPES = ROOT / "recipes" / "scratch" / "gpu"
VOCAB = 32000  # the recipes' tokenizer (hf-internal-testing/llama-tokenizer)
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "GH200": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0}
DRY_CONFIG = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 64, "titans_num_heads": 2, "titans_head_dim": 8,
              "titans_chunk_size": 8, "hope_chunk_size": 8}
CONFIG_WEIGHT = {"attention": 2.0}  # budget shares: the headline recipe gets twice the others'
HEAL_SOURCE = "smollm2-135m"
HEAL_S = 180.0  # the heal's wall time (set-up, steps, checkpoints; the evaluations come on top)
HEAL_POINTS = 3  # evaluated after 1/3, 2/3 and all of it (and right after the conversion)
HEAL_SECTION_S = 290.0  # conversion + evaluations + heal; the throughput configs get what is left of the budget
HEAL_BATCH = 16  # sequences of 512 tokens a GPU heal step: 4x the recipe's 4 (lr unchanged), 8,192 tokens a step
HEAL_MAX_TOKENS = 10**10  # the recipe's length: never reached, each part ends at its time
DRY_CONVERT = {"calibration_tokens": 256, "seq_len": 32, "batch_size": 4, "eval_tokens": 256}
DRY_HEAL_S, DRY_HEAL_SECTION_S = 3.0, 120.0
HEAL_SETTINGS = ("batch", "seq_len", "lr", "planned_s", "precision")  # the heal's, not a point's


# ============================================================================================== one config (worker)


def config_for(mixer: str, schedule: str, dry: bool) -> tuple[dict, int, int]:
    """(TLMConfig keyword arguments, micro batch, seq_len) of the recipe (dry: tiny dimensions, batch 2 x 32)."""
    from tlm_train.recipe import load_recipe

    recipe = load_recipe(RECIPES / f"{mixer}-{schedule}.yaml")
    kwargs = dict(recipe.model.config, schedule=recipe.model.schedule, taper_ratio=recipe.model.ratio,
                  multiple_of=recipe.model.multiple_of, vocab_size=VOCAB)
    if dry:
        kwargs.update({k: v for k, v in DRY_CONFIG.items() if k in kwargs or not k.startswith(("titans", "hope"))},
                      vocab_size=257, multiple_of=16)
        return kwargs, 2, 32
    return kwargs, recipe.train.batch_size, recipe.data.seq_len


def flops_per_token(model, seq_len: int) -> float:
    """6 N + 12 L d S (PaLM): N = matmul parameters (all but the embedding table, plus the LM head once)."""
    c = model.config
    embed = model.get_input_embeddings().weight.numel()
    n = sum(p.numel() for p in model.parameters()) - embed + c.vocab_size * c.hidden_size
    d_attn = c.num_attention_heads * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads)
    return 6 * n + 12 * c.num_hidden_layers * d_attn * seq_len


def peak_flops(device) -> float | None:
    if device.type != "cuda":
        return None
    name = __import__("torch").cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def measure(spec: dict):
    """Yields one result dict per phase (eager, compiled) of one config."""
    import torch

    from tlm import TLMConfig, TLMForCausalLM
    from tlm_train.trainer import lm_loss

    device = torch.device(spec["device"])
    kwargs, batch, seq = config_for(spec["mixer"], spec["schedule"], spec["dry"])
    torch.manual_seed(0)
    model = TLMForCausalLM(TLMConfig(**kwargs)).to(device).train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if device.type == "cuda" else {}))
    ids = torch.randint(0, kwargs["vocab_size"], (batch, seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else
                __import__("contextlib").nullcontext())
    flops, peak = flops_per_token(model, seq), spec["peak_flops"]
    base = {"config": spec["name"], "params": params, "batch": batch, "seq_len": seq,
            "intermediate_sizes": list(model.config.intermediate_sizes), "flops_per_token": flops}

    def step(forward) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with autocast:
            loss = lm_loss(forward(input_ids=ids, use_cache=False).logits, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss {float(loss)}")
        return time.perf_counter() - start

    phases = [("eager", model)]
    if spec["compile"]:
        phases.append(("compiled", None))
    for mode, forward in phases:
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if forward is None:
                torch._dynamo.reset()
                forward = torch.compile(model, backend=spec["backend"])
            warm = [step(forward) for _ in range(spec["warmup"])]
            times = []
            while len(times) < spec["min_steps"] or (sum(times) < spec["step_seconds"] and len(times) < 50):
                times.append(step(forward))
            tps = batch * seq / statistics.median(times)
            yield {**base, "mode": mode, "status": "ok", "first_step_s": round(warm[0], 2) if warm else None,
                   "steps": len(times), "median_step_s": round(statistics.median(times), 4),
                   "tokens_per_s": round(tps), "mfu": round(tps * flops / peak, 4) if peak else None,
                   "peak_mem_gb": (round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
                                   if device.type == "cuda" else None)}
        except Exception as err:  # noqa: BLE001 - OOM, a compile error, NaN: reported, the check goes on
            if device.type == "cuda":
                torch.cuda.empty_cache()
            yield {**base, "mode": mode, "status": _failure(err)}


def worker(spec_path: str) -> None:
    """Runs the configs of a spec file, printing one JSON line per event (start, each phase's result). The
    libraries are imported first: start-up, not the first config's share."""
    import tlm_convert.convert  # noqa: F401 - torch, transformers, tlm
    import tlm_train.trainer  # noqa: F401

    specs = json.loads(Path(spec_path).read_text())
    for spec in specs:
        print(json.dumps({"event": "start", "config": spec["name"]}), flush=True)
        for result in (measure_heal if spec.get("kind") == "heal" else measure)(spec):
            print(json.dumps({"event": "result", **result}), flush=True)


# ============================================================================================== convert + heal (worker)


def heal_spec(dry: bool, device: str, deadline: float, heal_s: float, batch: int | None, work: str) -> dict:
    """The convert-and-heal section: SmolLM2-135M on the GPU (dry: a tiny random Llama on the CPU, seconds);
    ``deadline``: the time.monotonic() (system-wide) at which the parent stops the worker; ``batch`` None: the
    recipe's in the dry run, :data:`HEAL_BATCH` on the GPU."""
    return {"name": "convert+heal", "kind": "heal", "dry": dry, "device": device, "deadline": deadline,
            "heal_s": heal_s, "work": work, "points": HEAL_POINTS,
            "batch": batch or (None if dry else HEAL_BATCH),
            "reserve_s": 10.0 if dry else 30.0,  # the evaluations after each point and the clean-up
            "options": DRY_CONVERT if dry else {}}


def measure_heal(spec: dict):
    """Yields the conversion's result, then one result per heal point (0: right after the conversion).

    The conversion is tlm_convert.convert.convert with ``--eval-data all-eval`` on ``spec["device"]``; its wall time
    less the evaluation phase is the figure to compare with the recorded CPU one. The heal is the ``--heal-tokens``
    path's (tlm_convert.heal.heal_recipe, tlm_train.trainer.train, teacher = the source) with the batch of
    ``spec["batch"]`` sequences, run for ``heal_s`` seconds of wall time (set-up, steps and checkpoints) in
    ``points`` parts: each part is stopped through the trainer's STOP file, its checkpoint evaluated on every set,
    and the next part resumes it (tlm train's exact resume)."""
    import torch

    from tlm_convert.convert import SAMPLES_FILE, ConvertOptions, convert
    from tlm_convert.evalsets import eval_set_blocks
    from tlm_convert.heal import HEAL_RECIPE, heal_data, heal_recipe, healed_entries
    from tlm_io.load import load_model
    from tlm_io.perplexity import perplexity
    from tlm_train.trainer import STOP_FILE, list_checkpoints, train

    end = spec["deadline"]  # the parent stops this worker then (CLOCK_MONOTONIC: the same in every process)
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    work = Path(spec["work"])
    batch = spec["batch"] or HEAL_RECIPE["train"]["batch_size"] * HEAL_RECIPE["train"]["grad_accum"]
    base = {"section": "heal", "batch": batch}

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def peak_gb():
        return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None

    def reset_peak():
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    source = HEAL_SOURCE
    if spec["dry"]:
        source = str(work / "tiny-llama")
        _tiny_llama(source)
    opts = ConvertOptions(device=spec["device"], eval_data="all-eval", **spec["options"])
    out = work / "converted"
    try:
        reset_peak()
        sync()
        start = time.perf_counter()
        report = convert(source, str(out), opts)
        sync()
        wall = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - reported, the check goes on
        yield {"section": "convert", "status": _failure(err)}
        yield {**base, "point": 0, "status": "skipped: the conversion failed"}
        return
    seconds = report["seconds"]
    yield {"section": "convert", "status": "ok", "wall_s": round(wall - seconds["eval"], 1),
           "eval_s": round(seconds["eval"], 1), "phases_s": {k: round(v, 1) for k, v in seconds.items()},
           "peak_mem_gb": peak_gb()}
    yield {**base, "point": 0, "status": "ok", "tokens": 0, "steps": 0, "heal_wall_s": 0.0, "loop_s": 0.0,
           **ood(report["perplexity_sets"], "ratio")}
    if spec["heal_s"] <= 0:
        return
    _, tokenizer, _ = load_model(str(out), with_tokenizer=True)  # the blocks the conversion evaluated
    evalb = eval_set_blocks(tokenizer, opts.eval_data, opts.seq_len, opts.eval_tokens)
    heal_s = min(spec["heal_s"], end - time.monotonic() - spec["reserve_s"])
    if heal_s < spec["points"]:
        yield {**base, "point": 1, "status": f"skipped: {heal_s:.0f} s left of the section's budget"}
        return
    samples = out / SAMPLES_FILE
    data = heal_data(report["calibration_data"], samples if samples.is_file() else None, work / "heal-data.txt")
    overrides = [f"train.batch_size={batch}", "train.grad_accum=1"] + (["train.precision=bf16"] if cuda else [])
    run_dir = work / "train"
    recipe = heal_recipe(str(out), source, data, HEAL_MAX_TOKENS, str(run_dir), opts.seq_len, opts.seed,
                         spec["device"], overrides=tuple(overrides), cache_dir=str(work / "tokens"))
    base.update(seq_len=opts.seq_len, lr=recipe.optim.lr, planned_s=round(heal_s, 1))
    heal_wall = loop = 0.0
    step = tokens = 0
    for k in range(1, spec["points"] + 1):
        left = heal_s * k / spec["points"] - heal_wall  # this part's share: the heal's wall time at point k
        done = threading.Event()
        stop = threading.Thread(target=_stop_after, args=(run_dir, max(left, 0.0), step, done), daemon=True)
        reset_peak()
        start_mem = round(torch.cuda.memory_allocated(device) / 2**30, 2) if cuda else None  # left over: ~0
        sync()
        start = time.perf_counter()
        stop.start()
        try:
            result = train(recipe, resume=True if k > 1 else None)
        except Exception as err:  # noqa: BLE001 - OOM, a trainer error: reported with the points so far
            yield {**base, "point": k, "status": _failure(err)}
            return
        finally:
            done.set()
            stop.join()  # a STOP file it was writing is there before it is removed below
        sync()
        heal_wall += time.perf_counter() - start
        peak = peak_gb()
        (run_dir / STOP_FILE).unlink(missing_ok=True)
        base["lr"] = result.lr  # the rate it trained at (the recipe's is relative to the weights' RMS)
        seg_tokens, seg_s = window_seconds(run_dir / "metrics.jsonl", step, result.steps, tokens)
        loop += seg_s
        step, tokens = result.steps, result.tokens
        folder = result.final_dir if result.final_dir is not None else list_checkpoints(run_dir)[-1]
        train_tokens = json.loads((list_checkpoints(run_dir)[-1] / "trainer_state.json").read_text())["data"]
        eval_start = time.perf_counter()
        model, _, _ = load_model(str(folder), device=spec["device"], with_tokenizer=False)
        healed = {name: perplexity(model, blocks, opts.batch_size) for name, blocks in evalb.items()}
        del model
        precision = json.loads((run_dir / "run_summary.json").read_text()).get("precision")
        yield {**base, "point": k, "status": "ok", "tokens": tokens, "steps": step, "precision": precision,
               "epochs": round(tokens / train_tokens["train_tokens"], 3), "heal_wall_s": round(heal_wall, 1),
               "loop_s": round(loop, 1), "tokens_per_s": round(seg_tokens / seg_s) if seg_s else None,
               "tokens_per_s_wall": round(tokens / heal_wall), "peak_mem_gb": peak, "start_mem_gb": start_mem,
               "last_loss": result.losses[-1] if result.losses else None,
               "eval_s": round(time.perf_counter() - eval_start, 1),
               **ood(healed_entries(report, healed)["perplexity_sets"], "healed_ratio")}
        if result.final_dir is not None:  # the recipe's tokens all trained (HEAL_MAX_TOKENS: not on time)
            return


def ood(sets: list[dict], key: str) -> dict:
    """The out-of-domain geometric mean of the sets' ``key`` ratios, and every set's ratio."""
    from tlm_convert.evalsets import geomean

    return {"ood_ratio": round(geomean([s[key] for s in sets if not s["in_domain"]]), 4),
            "ratios": {s["data"]: round(s[key], 4) for s in sets}, "in_domain": [s["data"] for s in sets
                                                                              if s["in_domain"]]}


def window_seconds(metrics: Path, first_step: int, last_step: int, first_tokens: int) -> tuple[int, float]:
    """(tokens, seconds) of the training steps logged in metrics.jsonl after step ``first_step`` up to
    ``last_step`` (one resumed part of a run, which began at ``first_tokens``): each logged record's window is the
    tokens since the previous record (or the part's start) at its ``tokens_per_s``; steps after the last record
    of the part are not counted. Set-up and checkpoint writes are outside every window."""
    tokens = seconds = 0.0
    previous = first_tokens
    for line in (metrics.read_text().splitlines() if metrics.is_file() else []):  # none: stopped before a log
        record = json.loads(line) if line.strip() else {}
        if "tokens_per_s" not in record or not first_step < record["step"] <= last_step:
            continue
        window = record["tokens"] - previous
        tokens, seconds, previous = tokens + window, seconds + window / record["tokens_per_s"], record["tokens"]
    return int(tokens), seconds


def _stop_after(run_dir: Path, seconds: float, step: int, done: threading.Event) -> None:
    """Writes run_dir/STOP once ``seconds`` have passed *and* metrics.jsonl has logged a step beyond ``step`` (the
    part's start): every timed part trains at least a few steps, even when its share of the budget ends in its
    set-up (a loaded machine). Returns without writing when ``done`` is set first (the run ended)."""
    from tlm_train.trainer import STOP_FILE

    if done.wait(seconds):
        return
    metrics = run_dir / "metrics.jsonl"
    while not done.wait(0.05):
        if last_logged_step(metrics) > step:
            (run_dir / STOP_FILE).touch()
            return


def last_logged_step(metrics: Path) -> int:
    """The highest step of a training record (one with ``tokens_per_s``) in metrics.jsonl; 0 before the first."""
    steps = [0]
    for line in (metrics.read_text().splitlines() if metrics.is_file() else []):
        if line.strip():
            record = json.loads(line)
            if "tokens_per_s" in record:
                steps.append(record["step"])
    return max(steps)


def _failure(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


# ============================================================================================== the check (parent)


def run_configs(specs: list[dict], budgets: list[float], end: float, env: dict) -> list[dict]:
    """Every config's results, in one worker process; a config past its budget (or ``end``, a time.monotonic) is
    stopped: the worker is killed and a new one goes on with the next config."""
    results: list[dict] = []
    i = 0  # the first config not yet done
    while i < len(specs) and time.monotonic() < end:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(specs[i:], f)
        stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: compile warnings must not fill a buffer
        proc = subprocess.Popen([sys.executable, __file__, "--worker", f.name], stdout=subprocess.PIPE,
                                stderr=stderr, text=True, env=env, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)], daemon=True).start()
        running, deadline = None, min(end, time.monotonic() + 120)  # start-up: imports, CUDA context
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:  # the config (or the start-up) passed its budget
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                k = i if running is None else running
                results.append({"config": specs[k]["name"], "mode": "-",
                                "status": f"stopped: over its {budgets[k]:.0f} s budget"})
                i = k + 1
                break
            if line is None:  # the worker ended
                proc.wait()
                k = i if running is None else running
                if proc.returncode != 0:
                    stderr.seek(0)
                    err = stderr.read().strip().splitlines()
                    results.append({"config": specs[k]["name"], "mode": "-",
                                    "status": f"worker failed: {err[-1][:200] if err else proc.returncode}"})
                i = k + 1 if (running is not None or proc.returncode != 0) else len(specs)
                break
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a library's own output
                continue
            if not isinstance(event, dict) or "event" not in event:
                continue
            if event.pop("event") == "start":
                running = i if running is None else running + 1
                deadline = min(end, time.monotonic() + budgets[running])
            else:
                results.append(event)
        os.unlink(f.name)
        stderr.close()
    for spec in specs[i:]:
        results.append({"config": spec["name"], "mode": "-", "status": "skipped: the check's budget was spent"})
    return results


def convert_and_heal(dry: bool, device: str, budget_s: float, heal_s: float, batch: int | None,
                     env: dict) -> tuple[dict, dict]:
    """(the conversion's entry, the heal's entry) of the convert+heal section, run in a worker process stopped
    past ``budget_s`` (what it measured until then is kept); its work folder is removed in any case."""
    work = tempfile.mkdtemp(prefix="gpu_check_heal-")
    deadline = time.monotonic() + budget_s  # the worker's start-up included
    spec = heal_spec(dry, device, deadline, heal_s, batch, work)
    try:
        events = run_configs([spec], [budget_s], deadline, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stopped = [e["status"] for e in events if "section" not in e]  # the worker stopped or failed
    conv = next((e for e in events if e.get("section") == "convert"), {"status": (stopped or ["?"])[0]})
    conv.pop("section", None)
    source = "tiny random Llama" if dry else HEAL_SOURCE
    conv = {"command": f"convert {source} --device {device} --eval-data all-eval (in-process)", "wall_s": None,
            **conv, **recorded_cpu()}
    points = [{k: v for k, v in e.items() if k not in HEAL_SETTINGS + ("section",)} for e in events
              if e.get("section") == "heal"]
    settings = {k: v for e in events if e.get("section") == "heal" for k, v in e.items() if k in HEAL_SETTINGS}
    bad = [p["status"] for p in points if p["status"] != "ok"] + stopped
    heal = {"source": source, "teacher": source, "recipe": "tlm_convert.heal.HEAL_RECIPE",
            "requested_s": heal_s, **settings, "status": bad[-1] if bad else "ok", "points": points}
    return conv, heal


def recorded_cpu() -> dict:
    """The CPU conversion figure recorded in bench/results/convert_time.json (not rerun here)."""
    recorded = HERE / "results" / "convert_time.json"
    cpu = json.loads(recorded.read_text()) if recorded.is_file() else {}
    return {"cpu_wall_s_recorded": round(cpu.get("conversion_wall_seconds", 0), 1) or None,
            "cpu_recorded": "bench/results/convert_time.json: the default conversion without evaluation, "
                            f"in-process (no CLI start-up), {cpu.get('threads')} threads on {cpu.get('machine')} "
                            "(bench/RESULTS.md), not rerun"}


def _tiny_llama(folder: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlm_io.load import byte_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 eos_token_id=256)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def markdown(results: list[dict], conv: dict, heal: dict, info: dict) -> str:
    rows = ["| config | mode | params | batch x seq | tokens/s | MFU | peak GB | first step s | status |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        cells = [r["config"], r["mode"], f"{r['params'] / 1e6:.4g}M" if "params" in r else "-",
                 f"{r['batch']} x {r['seq_len']}" if "batch" in r else "-",
                 f"{r['tokens_per_s']:,}" if "tokens_per_s" in r else "-", mfu,
                 r.get("peak_mem_gb") or "-", r.get("first_step_s") or "-", r["status"]]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    rows.append("")
    rows.append(f"tlm-convert ({conv['command']}): {conv['wall_s']} s without its {conv.get('eval_s')} s of "
                f"evaluation, peak GPU {conv.get('peak_mem_gb') or '-'} GB, {conv['status']}; CPU (recorded): "
                f"{conv['cpu_wall_s_recorded']} s ({conv['cpu_recorded']})")
    rows.append("")
    sets = [name for name in next((p["ratios"] for p in heal["points"] if "ratios" in p), {})]
    rows.append(f"heal of the converted model from {heal['teacher']} ({heal['recipe']}, tlm_train.trainer.train; "
                f"batch {heal.get('batch', '-')} x {heal.get('seq_len', '-')}, lr {heal.get('lr', '-')}, "
                f"{heal.get('precision') or '-'}; {heal.get('planned_s', heal['requested_s'])} s of wall time; "
                f"OOD = geometric mean of the perplexity ratios to the source over the out-of-domain sets): "
                f"{heal['status']}")
    rows.append("| " + " | ".join(["point", "heal wall s", "step s", "tokens", "epochs", "tokens/s (steps)",
                                   "tokens/s (wall)", "peak GB", "OOD ratio", *sets, "status"]) + " |")
    rows.append("|---" * (10 + len(sets)) + "|")
    for p in heal["points"]:
        cells = [p["point"], p.get("heal_wall_s", "-"), p.get("loop_s", "-"), f"{p['tokens']:,}" if "tokens" in p
                 else "-", p.get("epochs", "-"), f"{p['tokens_per_s']:,}" if p.get("tokens_per_s") else "-",
                 f"{p['tokens_per_s_wall']:,}" if p.get("tokens_per_s_wall") else "-", p.get("peak_mem_gb") or "-",
                 f"x{p['ood_ratio']:.4f}" if "ood_ratio" in p else "-",
                 *[f"x{p['ratios'][name]:.3f}" if "ratios" in p else "-" for name in sets], p["status"]]
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    rows.append("")
    rows.append(f"device: {info['device']}; peak bf16: {info['peak_tflops']} TFLOPS; torch {info['torch']}; "
                f"wall {info['wall_s']} s of a {info['budget_s']} s budget")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU readiness check (see the module docstring)")
    ap.add_argument("--dry", action="store_true", help="tiny shapes, a few steps (seconds; on the CPU unless --device)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="where to run [cuda; dry cpu]: --dry --device cuda smokes the CUDA paths in seconds")
    ap.add_argument("--budget-s", type=float, default=None, help="whole check [450; dry 420]")
    ap.add_argument("--only", default=",".join(MIXERS), help="comma-separated mixers")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--skip-convert", action="store_true", help="no conversion and no heal: throughput only")
    ap.add_argument("--heal-s", type=float, default=None,
                    help=f"wall seconds of the heal (0: convert only) [{HEAL_S:.0f}; dry {DRY_HEAL_S:.0f}]")
    ap.add_argument("--heal-batch", type=int, default=None,
                    help=f"sequences a heal step [{HEAL_BATCH}; dry the recipe's]")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, when the GPU is not known")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    import torch

    start = time.perf_counter()
    dry = args.dry
    device = torch.device(args.device or ("cpu" if dry else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a GPU machine, or pass --dry for the CPU smoke run", file=sys.stderr)
        return 2
    if device.type == "cpu" and not dry:
        print("error: --device cpu runs only the tiny shapes; add --dry", file=sys.stderr)
        return 2
    budget = args.budget_s or (420.0 if dry else 450.0)  # dry: room for a loaded machine; about a minute when quiet
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device)
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    mixers = [m for m in args.only.split(",") if m]
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown:
        print(f"error: --only {','.join(unknown)}: unknown mixer; use {', '.join(MIXERS)}", file=sys.stderr)
        return 2
    heal_s = args.heal_s if args.heal_s is not None else (DRY_HEAL_S if dry else HEAL_S)
    if args.skip_convert:
        conv = {"command": "-", "status": "skipped", "wall_s": None, "cpu_wall_s_recorded": None, "cpu_recorded": "-"}
        heal = {"teacher": "-", "recipe": "-", "requested_s": 0, "status": "skipped", "points": []}
    else:  # first: the throughput configs then get whatever time it leaves
        section = min(DRY_HEAL_SECTION_S if dry else HEAL_SECTION_S, 0.65 * budget)
        conv, heal = convert_and_heal(dry, str(device), section, heal_s, args.heal_batch, env)
    specs = [{"name": f"{m}-{s}", "mixer": m, "schedule": s, "dry": dry, "device": str(device), "peak_flops": peak,
              "compile": not args.no_compile and (not dry or s == "cosine"), "backend": "eager" if dry else "inductor",
              "warmup": 1 if dry else 2, "min_steps": 2 if dry else 3, "step_seconds": 0.0 if dry else 5.0}
             for m in mixers for s in SCHEDULES]
    train_s = budget - (time.perf_counter() - start) - 10
    weights = [CONFIG_WEIGHT.get(s["mixer"], 1.0) for s in specs]
    budgets = [train_s * w / sum(weights) for w in weights]
    results = run_configs(specs, budgets, time.monotonic() + train_s, env)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
    info = {"device": name,
            "dry": dry, "peak_tflops": round(peak / 1e12, 1) if peak else None, "torch": torch.__version__,
            "budget_s": budget, "wall_s": round(time.perf_counter() - start, 1),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    summary = {"command": "bash bench/gpu_check.sh " + " ".join(argv if argv is not None else sys.argv[1:]),
               **info, "training": results, "convert": conv, "heal": heal}
    print(markdown(results, conv, heal, info))
    print(json.dumps(summary))
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "gpu_check_dry.json" if dry else
                                           HERE / "results" / "gpu_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
