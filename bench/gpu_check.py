"""GPU readiness check (issue 12): what only a GPU shows, in one command that ends within its time budget.

    bash bench/gpu_check.sh                 # on a GPU machine: budget 450 s (under 8 minutes with start-up)
    bash bench/gpu_check.sh --dry           # on CPU: tiny shapes, a few steps, seconds (the default tests run it)

1. Training throughput of the 435M recipes (recipes/scratch/gpu/<mixer>-<schedule>.yaml: their model config, micro
   batch and seq_len; vocabulary 32,000 = their Llama-2 tokenizer, not downloaded) for the four mixers, uniform and
   cosine-tapered: one step = forward + ``lm_loss`` + backward + AdamW (fused on CUDA), bf16 autocast with fp32
   master weights as ``tlm train`` does, on random token ids. Each config runs eager first, then under
   ``torch.compile`` (the whole model, as ``train.compile: true`` does); tokens/s = tokens per step / median
   step time (CUDA synchronized), at least ``--min-steps`` timed steps after the warm-up ones.
   MFU = tokens/s x model FLOPs per token / the GPU's dense bf16 peak, with the PaLM count
   6 N + 12 L d S (N: parameters doing matmuls, i.e. without the embedding table but with the LM head; L layers,
   d attention width, S seq_len), the same formula for every mixer (what a mixer computes beyond attention is not
   counted). Peak GPU memory = ``torch.cuda.max_memory_allocated`` of each phase.
2. ``tlm-convert smollm2-135m --device cuda`` wall time (the default conversion, no evaluation), against the CPU
   figure recorded in bench/results/convert_time.json (not rerun here: it takes over 7 minutes).

The configs run one after another in a worker process; each has a share of the budget, and a config that passes
it (a compile that does not finish, a hang) is stopped and reported as such, so the whole check ends on time and
every figure it could take is printed. ``--dry``: CPU, a tiny model per config, 2 steps, torch.compile with the
``eager`` backend for the cosine configs (dynamo traces each mixer; no code generation), a tiny random Llama
converted on CPU.
Prints a markdown table and one JSON line; writes ``--out`` (bench/results/gpu_check.json; dry: a temp file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
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
            yield {**base, "mode": mode, "status": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}


def worker(spec_path: str) -> None:
    """Runs the configs of a spec file, printing one JSON line per event (start, each phase's result)."""
    specs = json.loads(Path(spec_path).read_text())
    for spec in specs:
        print(json.dumps({"event": "start", "config": spec["name"]}), flush=True)
        for result in measure(spec):
            print(json.dumps({"event": "result", **result}), flush=True)


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


def convert_check(dry: bool, timeout: float, env: dict) -> dict:
    """Wall time of tlm-convert on CUDA (dry: a tiny random Llama on CPU) and the recorded CPU figure."""
    with tempfile.TemporaryDirectory() as tmp:
        if dry:
            source = str(Path(tmp) / "tiny-llama")
            _tiny_llama(source)
            args = [source, "--device", "cpu", "--calibration-tokens", "256", "--seq-len", "32", "--batch-size", "4"]
        else:
            args = ["smollm2-135m", "--device", "cuda"]
        cmd = [sys.executable, "-m", "tlm_convert", *args, "-o", str(Path(tmp) / "out")]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
            status = "ok" if proc.returncode == 0 else "failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
        except subprocess.TimeoutExpired:
            status = f"stopped: over its {timeout:.0f} s budget"
        seconds = time.perf_counter() - start
    recorded = HERE / "results" / "convert_time.json"
    cpu = json.loads(recorded.read_text()) if recorded.is_file() else {}
    return {"command": "tlm-convert " + " ".join(args[:1] + args[1:3]), "status": status,
            "wall_s": round(seconds, 1), "cpu_wall_s_recorded": round(cpu.get("conversion_wall_seconds", 0), 1) or None,
            "cpu_recorded": "bench/results/convert_time.json: the default conversion without evaluation, "
                            f"in-process (no CLI start-up), {cpu.get('threads')} threads on {cpu.get('machine')} "
                            "(bench/RESULTS.md), not rerun"}


def _tiny_llama(folder: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tlm_train.data import byte_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 eos_token_id=256)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


def markdown(results: list[dict], conv: dict, info: dict) -> str:
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
    rows.append(f"tlm-convert ({conv['command']}): {conv['wall_s']} s, {conv['status']}; CPU (recorded): "
                f"{conv['cpu_wall_s_recorded']} s ({conv['cpu_recorded']})")
    rows.append(f"device: {info['device']}; peak bf16: {info['peak_tflops']} TFLOPS; torch {info['torch']}; "
                f"wall {info['wall_s']} s of a {info['budget_s']} s budget")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU readiness check (see the module docstring)")
    ap.add_argument("--dry", action="store_true", help="CPU, tiny shapes, a few steps (seconds)")
    ap.add_argument("--budget-s", type=float, default=None, help="whole check [450; dry 300]")
    ap.add_argument("--only", default=",".join(MIXERS), help="comma-separated mixers")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--skip-convert", action="store_true")
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
    if not dry and not torch.cuda.is_available():
        print("error: no CUDA device here; run on a GPU machine, or pass --dry for the CPU smoke run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    budget = args.budget_s or (300.0 if dry else 450.0)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device)
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    mixers = [m for m in args.only.split(",") if m]
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown:
        print(f"error: --only {','.join(unknown)}: unknown mixer; use {', '.join(MIXERS)}", file=sys.stderr)
        return 2
    specs = [{"name": f"{m}-{s}", "mixer": m, "schedule": s, "dry": dry, "device": str(device), "peak_flops": peak,
              "compile": not args.no_compile and (not dry or s == "cosine"), "backend": "eager" if dry else "inductor",
              "warmup": 1 if dry else 2, "min_steps": 2 if dry else 3, "step_seconds": 0.0 if dry else 5.0}
             for m in mixers for s in SCHEDULES]
    convert_s = 0 if args.skip_convert else (120.0 if dry else 100.0)
    train_s = budget - convert_s - 10
    weights = [CONFIG_WEIGHT.get(s["mixer"], 1.0) for s in specs]
    budgets = [train_s * w / sum(weights) for w in weights]
    results = run_configs(specs, budgets, time.monotonic() + train_s, env)
    remaining = budget - (time.perf_counter() - start) - 5
    conv = ({"command": "-", "status": "skipped", "wall_s": None, "cpu_wall_s_recorded": None, "cpu_recorded": "-"}
            if args.skip_convert else convert_check(dry, max(30.0, remaining), env))
    name = (torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
    info = {"device": name,
            "dry": dry, "peak_tflops": round(peak / 1e12, 1) if peak else None, "torch": torch.__version__,
            "budget_s": budget, "wall_s": round(time.perf_counter() - start, 1),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    summary = {"command": "bash bench/gpu_check.sh " + " ".join(argv if argv is not None else sys.argv[1:]),
               **info, "training": results, "convert": conv}
    print(markdown(results, conv, info))
    print(json.dumps(summary))
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "gpu_check_dry.json" if dry else
                                           HERE / "results" / "gpu_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
