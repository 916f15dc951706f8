"""Training throughput of TLM models (issue 2): tokens/s of one full training step, side by side.

A training step is ``optimizer.zero_grad(set_to_none=True)``, a forward pass with ``labels`` (the model's own
next-token loss), ``loss.backward()`` and an ``AdamW.step()`` (lr 1e-3, weight decay 0.1; ``--no-optimizer``
leaves the AdamW step out). Throughput = batch * seq_len / step time.

Models (all share the CPU config of design/model.md §4: d 384, L 6, H 6, KVH 2, d_h 64, D 1024, vocab 8192,
tied embeddings, fp32 unless ``--dtype bfloat16``):

    hf_llama                transformers LlamaForCausalLM (sdpa), uniform D
    tlm_attention           TLM "attention", uniform, loaded from hf_llama's state dict (strict)
    tlm_attention_tapered   TLM "attention", cosine 1.5/0.5 taper, q = 16 (1536 ... 512)
    tlm_gated_attention     TLM "gated_attention" (elementwise gate), uniform
    tlm_hope_attention      TLM "hope_attention": CMS levels (online, static, static), chain, chunk 16, uniform,
                            inner lr 0 (the default: the online level computes as a static one)
    tlm_hope_local          as tlm_hope_attention with inner lr 1e-2: the online level updates in context
    tlm_titans              TLM "titans" (MAG) in layers 1, 3, 5 (model.md §4.3; --titans-layers all for 0..5),
                            H_m 6, d_m 64, memory depth 2, expansion 2, chunk 16, uniform
    tlm_titans_mag          as tlm_titans with titans_variant "mag" (4 persistent tokens, normalised branches)

Measurement: every model is built once; warmup steps and timed steps run in rounds, one step per model per
round, the order reversed every other round (A B C .. C B A ..) so slow drifts of a shared machine hit every
model alike. Per model: the median step time -> tokens/s. Ratios are ratios of those medians (tokens/s of the
model over tokens/s of its reference); the JSON also keeps the per-round paired ratios (median, min, max).

Usage:
    python bench/throughput.py                          # default CPU run, writes bench/results/throughput_cpu.json
    python bench/throughput.py --quick                  # smoke run (< 1 min on 2 idle cores), seq 128, batch 2
    python bench/throughput.py --threads 1              # one intra-op thread (robust when cores are shared)
    python bench/throughput.py --profile tlm_titans     # torch.profiler table of one step of one model
    python bench/throughput.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tlm import TLMConfig, TLMForCausalLM  # noqa: E402

# design/model.md §4 shared CPU config (vocab: an 8K BPE)
BASE = dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
            num_key_value_heads=2, head_dim=64)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
TITANS = dict(titans_num_heads=6, titans_head_dim=64, titans_memory_depth=2, titans_memory_expansion=2,
              titans_chunk_size=16)  # §4.3 CPU config; theta_max 0.1 and conv kernel 4 are the TLMConfig defaults
HOPE = dict(hope_level_shares=[1 / 3, 1 / 3, 1 / 3], hope_level_modes=["online", "static", "static"],
            hope_chunk_size=16)  # §4.4 default; topology chain and inner lr 0 are the TLMConfig defaults
HOPE_LOCAL = dict(HOPE, hope_inner_lr=1e-2)  # the online level updating in context (projected local rule)
MAG = dict(TITANS, titans_variant="mag", titans_persistent_tokens=4)  # the paper's MAG (window: full context here)
TAPER = dict(schedule="cosine", taper_ratio=(1.5, 0.5), multiple_of=16)

MODEL_NAMES = ("hf_llama", "tlm_attention", "tlm_attention_tapered", "tlm_gated_attention", "tlm_hope_attention",
               "tlm_hope_local", "tlm_titans", "tlm_titans_mag")
# (name, model, reference, target: minimum tokens/s ratio model/reference)
COMPARISONS = (
    ("tlm_vs_hf_llama", "tlm_attention", "hf_llama", 0.95),
    ("tapered_vs_uniform", "tlm_attention_tapered", "tlm_attention", 0.97),
    ("gated_attention_vs_attention", "tlm_gated_attention", "tlm_attention", None),
    ("hope_attention_vs_attention", "tlm_hope_attention", "tlm_attention", None),
    ("titans_vs_attention", "tlm_titans", "tlm_attention", 0.40),
    ("hope_local_vs_attention", "tlm_hope_local", "tlm_attention", None),
    ("titans_mag_vs_attention", "tlm_titans_mag", "tlm_attention", None),
)


# ------------------------------------------------------------------------------------------------- models


def llama_config() -> LlamaConfig:
    return LlamaConfig(**BASE, rms_norm_eps=1e-6, rope_parameters=dict(ROPE), tie_word_embeddings=True,
                       attn_implementation="sdpa", use_cache=False)


def tlm_config(name: str, titans_layers: str) -> TLMConfig:
    kwargs = dict(BASE, norm_eps=1e-6, tie_word_embeddings=True, rope_parameters=dict(ROPE), use_cache=False)
    if name == "tlm_attention":
        kwargs["mixer"] = "attention"
    elif name == "tlm_attention_tapered":
        kwargs.update(TAPER, mixer="attention")
    elif name == "tlm_gated_attention":
        kwargs["mixer"] = "gated_attention"
    elif name == "tlm_hope_attention":
        kwargs.update(HOPE, mixer="hope_attention")
    elif name == "tlm_hope_local":
        kwargs.update(HOPE_LOCAL, mixer="hope_attention")
    elif name in ("tlm_titans", "tlm_titans_mag"):
        n = BASE["num_hidden_layers"]
        kwargs.update(TITANS if name == "tlm_titans" else MAG,
                      mixer=["titans" if (titans_layers == "all" or i % 2 == 1) else "attention" for i in range(n)])
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")
    return TLMConfig(**kwargs)


def build_models(names, args, device) -> tuple[dict, dict]:
    """name -> model (train mode, on device, fp32 weights); plus the checks made on the way."""
    models, checks = {}, {}
    llama = None
    if "hf_llama" in names or "tlm_attention" in names:
        torch.manual_seed(args.seed)
        llama = LlamaForCausalLM(llama_config())
    for name in names:
        if name == "hf_llama":
            models[name] = llama
            continue
        torch.manual_seed(args.seed)
        model = TLMForCausalLM(tlm_config(name, args.titans_layers))
        if name == "tlm_attention":  # same weights as hf_llama, keys must match one to one
            try:
                result = model.load_state_dict(llama.state_dict(), strict=True)
                checks["llama_state_dict_strict_load"] = f"ok ({result})"
            except RuntimeError as err:  # report, keep measuring with TLM's own init
                checks["llama_state_dict_strict_load"] = f"FAILED: {err}"
                print(f"WARNING: strict load of LlamaForCausalLM weights failed:\n{err}", file=sys.stderr)
        models[name] = model
    for model in models.values():
        model.to(device).train()
    return models, checks


def describe(name: str, model) -> dict:
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    emb = model.get_input_embeddings().weight.numel()
    if name == "hf_llama":
        widths = [cfg.intermediate_size] * cfg.num_hidden_layers
        mixer = ["llama_sdpa"] * cfg.num_hidden_layers
        schedule = "uniform"
    else:
        widths, mixer, schedule = list(cfg.intermediate_sizes), list(cfg.mixer), cfg.schedule
    return {"params": n_params, "non_embedding_params": n_params - emb, "intermediate_sizes": widths,
            "mixer": mixer, "schedule": schedule}


# ------------------------------------------------------------------------------------------------- timing


class Stepper:
    """One model, its AdamW and a fixed batch; step() runs one timed training step and returns phase times."""

    def __init__(self, model, ids, device, autocast_dtype, use_optimizer: bool):
        self.model, self.ids, self.device = model, ids, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1) if use_optimizer else None
        self.autocast = (torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype is not None
                         else nullcontext())

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> dict:
        self._sync()
        c0, t0 = time.process_time(), time.perf_counter()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        with self.autocast:
            loss = self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss
        self._sync()
        t1 = time.perf_counter()
        loss.backward()
        self._sync()
        t2 = time.perf_counter()
        if self.optimizer is not None:
            self.optimizer.step()
        self._sync()
        t3, c3 = time.perf_counter(), time.process_time()
        return {"step": t3 - t0, "cpu": c3 - c0, "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
                "loss": float(loss.detach())}


def round_orders(names: list[str], rounds: int, start: int = 0):
    for r in range(start, start + rounds):
        yield r, (names if r % 2 == 0 else names[::-1])


def run_benchmark(steppers: dict, args) -> dict:
    names = list(steppers)
    timings = {n: [] for n in names}
    first_loss = {}
    t_start = time.perf_counter()
    for r, order in round_orders(names, args.warmup):
        for n in order:
            out = steppers[n].step()
            first_loss.setdefault(n, out["loss"])
        print(f"warmup round {r + 1}/{args.warmup} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    t_timed = time.perf_counter()
    stopped_by_budget = False
    done = 0
    for r, order in round_orders(names, args.steps, start=args.warmup):
        t_round = time.perf_counter()
        for n in order:
            out = steppers[n].step()
            first_loss.setdefault(n, out["loss"])
            timings[n].append(out)
        done += 1
        elapsed = time.perf_counter() - t_start
        per_round = (time.perf_counter() - t_timed) / done
        print(f"round {done}/{args.steps}: {time.perf_counter() - t_round:.1f} s  ("
              + ", ".join(f"{n} {timings[n][-1]['step']:.2f}" for n in names) + ")", flush=True)
        if (args.max_seconds and done >= args.min_steps and done < args.steps
                and elapsed + per_round > args.max_seconds):
            stopped_by_budget = True
            print(f"stopping after {done} rounds: --max-seconds {args.max_seconds} would be exceeded", flush=True)
            break
    return {"timings": timings, "first_loss": first_loss, "rounds": done, "stopped_by_budget": stopped_by_budget,
            "wall_s": time.perf_counter() - t_start}


def _finite_or_none(x: float, digits: int = 6):
    return round(x, digits) if math.isfinite(x) else None


def summarize(result: dict, tokens_per_step: int) -> tuple[dict, dict]:
    timings = result["timings"]
    per_model = {}
    for n, rows in timings.items():
        steps = [row["step"] for row in rows]
        cpu = [row["cpu"] for row in rows]
        med = statistics.median(steps)
        per_model[n] = {
            "step_s": [round(s, 4) for s in steps],
            "median_step_s": round(med, 4),
            "tokens_per_s": round(tokens_per_step / med, 1),
            "cpu_s": [round(c, 4) for c in cpu],  # process CPU time (all threads) of each step
            "median_cpu_s": round(statistics.median(cpu), 4),
            "phase_median_s": {k: round(statistics.median(row[k] for row in rows), 4)
                               for k in ("forward", "backward", "optimizer")},
            "rel_spread": round((max(steps) - min(steps)) / med, 3),  # (max − min)/median of the step times
            "first_loss": _finite_or_none(result["first_loss"][n]),  # null when NaN/inf (strict JSON)
        }
    ratios = {}
    for key, model, ref, target in COMPARISONS:
        if model not in timings or ref not in timings:
            continue
        paired = [r["step"] / m["step"] for m, r in zip(timings[model], timings[ref])]  # tokens/s model / ref
        value = per_model[ref]["median_step_s"] / per_model[model]["median_step_s"]
        cpu_value = per_model[ref]["median_cpu_s"] / per_model[model]["median_cpu_s"]
        ratios[key] = {
            "model": model, "reference": ref, "ratio": round(value, 3),
            "paired_median": round(statistics.median(paired), 3), "paired_min": round(min(paired), 3),
            "paired_max": round(max(paired), 3),
            "cpu_time_ratio": round(cpu_value, 3),  # same ratio from process CPU time (see README)
            "target": target,
            "meets_target": None if target is None else bool(value >= target),
        }
    return per_model, ratios


# ------------------------------------------------------------------------------------------------- metadata


def git_commit() -> dict:
    def git(*cmd):
        try:
            out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--", "tlm")
    return {"commit": commit, "tlm_dirty": None if status is None else bool(status)}


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ------------------------------------------------------------------------------------------------- output


def print_table(per_model: dict, ratios: dict, info: dict) -> None:
    ref_of = {c[1]: (c[2], c[3]) for c in COMPARISONS}
    print()
    print(f"training throughput: batch {info['batch']} x seq {info['seq_len']}, {info['dtype']}, "
          f"{info['device']}, {info['threads']} thread(s), {info['rounds']} timed rounds, "
          f"step = {info['step_what']}")
    header = (f"{'model':<24}{'step s':>8}{'tokens/s':>10}{'fwd s':>8}{'bwd s':>8}{'opt s':>8}{'cpu s':>8}"
              f"   ratio [cpu-time ratio] (vs)")
    print(header)
    print("-" * (len(header) + 30))
    for n, row in per_model.items():
        ph = row["phase_median_s"]
        text = ""
        if n in ref_of and ref_of[n][0] in per_model:
            ref, target = ref_of[n]
            key = next(k for k, v in ratios.items() if v["model"] == n)
            r = ratios[key]
            text = f"{r['ratio']:.3f}x [{r['cpu_time_ratio']:.3f}x] {ref}"
            if target is not None:
                text += f"  (target >= {target}: {'ok' if r['meets_target'] else 'BELOW'})"
        print(f"{n:<24}{row['median_step_s']:>8.3f}{row['tokens_per_s']:>10.0f}{ph['forward']:>8.2f}"
              f"{ph['backward']:>8.2f}{ph['optimizer']:>8.2f}{row['median_cpu_s']:>8.2f}   {text}")
    print()


def profile_one(steppers: dict, name: str, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    stepper = steppers[name]
    stepper.step()  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if stepper.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        out = stepper.step()
    sort = "self_cuda_time_total" if stepper.device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)
    return (f"profile of one training step of {name}: step {out['step']:.2f} s (forward {out['forward']:.2f}, "
            f"backward {out['backward']:.2f}, optimizer {out['optimizer']:.2f})\n{table}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16 = torch.autocast with fp32 master weights")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512; --quick 128)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 4 on CPU, 16 on CUDA; "
                                                           "--quick 2)")
    p.add_argument("--steps", type=int, default=None, help="timed rounds, one step per model each (default 6; "
                                                           "--quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1)")
    p.add_argument("--min-steps", type=int, default=None, help="timed rounds always run, whatever --max-seconds "
                                                               "says (default 3; --quick 2)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="no new round once the run would pass this wall time (default 360; --quick 60; 0 = off)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all CPUs)")
    p.add_argument("--models", default=",".join(MODEL_NAMES), help="comma-separated subset of " + ", ".join(MODEL_NAMES))
    p.add_argument("--titans-layers", choices=("odd", "all"), default="odd",
                   help="Titans memory in layers 1, 3, 5 (model.md §4.3, default) or in every layer")
    p.add_argument("--no-optimizer", action="store_true", help="time zero_grad + forward + backward only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/throughput_<device>.json; "
                                               "with --profile: none)")
    p.add_argument("--quick", action="store_true", help="smoke run: seq 128, batch 2, 3 rounds")
    p.add_argument("--profile", default=None, metavar="MODEL",
                   help="instead of the benchmark, print a torch.profiler table of one step of MODEL")
    p.add_argument("--profile-rows", type=int, default=25)
    args = p.parse_args(argv)
    quick = args.quick
    defaults = dict(seq_len=128 if quick else 512, batch=2 if quick else (16 if args.device == "cuda" else 4),
                    steps=3 if quick else 6, warmup=1, min_steps=2 if quick else 3,
                    max_seconds=60.0 if quick else 360.0)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODEL_NAMES]
    if unknown:
        p.error(f"unknown --models {unknown}; expected a subset of {', '.join(MODEL_NAMES)}")
    if args.profile is not None and args.profile not in MODEL_NAMES:
        p.error(f"--profile {args.profile!r}: expected one of {', '.join(MODEL_NAMES)}")
    if args.min_steps > args.steps:
        args.min_steps = args.steps
    if args.out is None and args.profile is None:
        args.out = str(ROOT / "bench" / "results" / f"throughput_{args.device}.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device available", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    autocast_dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
    names = [args.profile] if args.profile else args.models

    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    load_start, git_start = loadavg(), git_commit()  # the tree others edit may move during a long run
    models, checks = build_models(names, args, device)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, BASE["vocab_size"], (args.batch, args.seq_len), generator=gen).to(device)
    steppers = {n: Stepper(models[n], ids, device, autocast_dtype, not args.no_optimizer) for n in names}
    step_what = ("zero_grad + forward (labels loss) + backward" +
                 ("" if args.no_optimizer else " + AdamW step"))

    if args.profile:
        text = profile_one(steppers, args.profile, args.profile_rows)
        print(text)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"profile": args.profile, "table": text}, indent=1))
        return 0

    print(f"models: {', '.join(names)}; batch {args.batch} x seq {args.seq_len}; {args.threads} thread(s); "
          f"warmup {args.warmup} + {args.steps} rounds (budget {args.max_seconds:.0f} s)", flush=True)
    result = run_benchmark(steppers, args)
    tokens = args.batch * args.seq_len
    per_model, ratios = summarize(result, tokens)
    for n in per_model:
        per_model[n].update(describe(n, models[n]))
    nonfinite = [n for n, row in per_model.items() if row["first_loss"] is None]
    checks["nonfinite_first_loss"] = nonfinite  # timing is still valid; the model is not trainable as configured
    if nonfinite:
        print(f"WARNING: non-finite loss at the first step of {', '.join(nonfinite)}", file=sys.stderr)
    if "hf_llama" in per_model and "tlm_attention" in per_model:
        a, b = per_model["hf_llama"]["first_loss"], per_model["tlm_attention"]["first_loss"]
        checks["first_loss_hf_llama_vs_tlm_attention_abs_diff"] = None if None in (a, b) else abs(a - b)

    info = {"batch": args.batch, "seq_len": args.seq_len, "dtype": args.dtype, "device": args.device,
            "threads": args.threads, "rounds": result["rounds"], "step_what": step_what}
    print_table(per_model, ratios, info)

    report = {
        "bench": "throughput",
        "issue": 2,
        "timestamp": started,  # UTC, start of the run
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git": git_start,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "machine": {"platform": platform.platform(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
                    "cuda_device": torch.cuda.get_device_name(device) if args.device == "cuda" else None,
                    "loadavg_start": load_start, "loadavg_end": loadavg()},
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "shapes": {"batch": args.batch, "seq_len": args.seq_len, "tokens_per_step": tokens, **BASE},
        "config": {"shared": BASE, "titans": {**TITANS, "layers": args.titans_layers}, "hope": HOPE,
                   "taper": {**TAPER, "taper_ratio": list(TAPER["taper_ratio"])}},
        "measurement": {
            "step": step_what,
            "optimizer": None if args.no_optimizer else "torch.optim.AdamW(lr=1e-3, weight_decay=0.1), defaults",
            "use_cache": False,
            "warmup_rounds": args.warmup,
            "timed_rounds": result["rounds"],
            "requested_rounds": args.steps,
            "stopped_by_budget": result["stopped_by_budget"],
            "wall_s": round(result["wall_s"], 1),
            "order": "one step per model per round; order reversed on odd rounds",
            "statistic": "median step time per model; ratio = tokens/s(model) / tokens/s(reference)",
            "timer": "time.perf_counter" + (" after torch.cuda.synchronize" if args.device == "cuda" else ""),
            "quick": args.quick,
        },
        "checks": checks,
        "models": per_model,
        "ratios": ratios,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
