"""The heal step near the limit: plain training, the heal with the whole-logit KL, with the chunked KL and with the
cached teacher top-k, side by side, with tokens/s, peak RSS and where each step's time goes (issue 26, item 3).

Variants, each one optimizer step of the heal recipe (tlm_convert.heal.HEAL_RECIPE: --batch blocks of --seq-len
tokens in micro-batches of --micro, the recipe's trainable parameters unless --all-trainable, AdamW at the
recipe's rate without weight decay, gradient clipping 1.0, KL at the recipe's temperature and alpha; bf16 autocast
where tlm_train.trainer.bf16_is_fast, else fp32) on random tokens:

    plain         the ``tlm train`` step without a teacher: whole logits, next-token cross entropy
    heal_full     the heal step before the chunked loss: student and teacher logits whole, trainer.distill_loss
    heal_chunked  the heal step ``tlm train`` now takes: final hidden states of both models, losses.head_loss
                  (logits a chunk of positions at a time, the gradient formed in the same pass)
    heal_topk     the step of a later epoch with ``distill.teacher_topk: --topk``: the teacher's top-k
                  log-probabilities of the batch read from the cache (computed once, untimed), no teacher forward;
                  head_loss's top-k + rest KL

A variant may add options to its base, ``BASE/OPTION/...`` (--variants; see Variant): ``micro=N`` blocks a
micro-batch, ``ckpt`` gradient checkpointing of the student's blocks, ``teacher=fp32`` the teacher's weights as
loaded (by default they are stored as the trainer stores them: projections in bf16 under bf16 autocast,
tlm_train.teacher), ``loss@REV`` tlm_train/losses.py as committed at git revision REV (before/after of the loss).

Time, in this process: after one untimed step of each, the variants alternate in rounds (A B C, C B A, ...) so a slow
phase of a shared machine hits all; per variant the median step wall time gives tokens/s, and the phases are timed
(wall and process CPU seconds): teacher forward (no grad) | student forward | loss | backward | optimizer (clip,
AdamW, zero_grad). In heal_chunked the head products of both models and the loss gradient happen in "loss"; its
backward only scales them. Student forward-backward = student forward + backward.

Peak RSS, one fresh subprocess per variant (a variant's peak is its own, not the high-water mark of another): the
models and the optimizer are built, the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``), --rss-steps
steps run, and VmHWM is read: the resident peak of the steps, the models and the optimizer state included, loading
not. The mark is reset as each phase starts and read as it ends, so the child also reports each phase's peak, and
the MB of the weights, gradients and AdamW moments (the rest of a peak: activations, the loss's buffers, the Python
and torch runtime, and memory the allocator holds). A parent watchdog kills a child whose RSS passes --rss-limit-gb. Gemma 3 270M (--gemma) runs only
its --gemma-variants children (default heal_chunked, heal_topk; the whole-logit heal is known to need far more than the machine has), and only when
MemAvailable is at least --gemma-min-free-gb.

    nice -n 19 python bench/heal_step.py --gemma                  # SmolLM2-135M side by side, Gemma's peak
    python bench/heal_step.py --quick --out /tmp/h.json           # tiny random models: checks that it runs
    nice -n 19 python bench/heal_step.py --sweep --out bench/results/studies/heal-step/heal_chunk_sweep.json   # the chunk default

--sweep times tlm_train.losses.head_loss alone (forward + backward, bf16 autocast as above) at SmolLM2's and
Gemma 3's head shapes for several chunks, each in its own subprocess for its peak RSS above the inputs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import types
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

import tlm_train.losses  # noqa: E402
from tlm_convert.heal import HEAL_RECIPE  # noqa: E402
from tlm_train.build import peak_lr  # noqa: E402
from tlm_train.losses import HEAD_CHUNK, head_loss, teacher_topk  # noqa: E402
from tlm_train.recipe import OptimSpec  # noqa: E402
from tlm_train.teacher import store_for_autocast  # noqa: E402
from tlm_train.trainer import bf16_is_fast, distill_loss, lm_loss, select_trainable  # noqa: E402

BASES = ("plain", "heal_full", "heal_chunked", "heal_topk")
VARIANTS = BASES  # the default --variants
PHASES = ("teacher_forward", "student_forward", "loss", "backward", "optimizer")
QUICK_SHAPES = {"batch": 2, "seq_len": 33}
SWEEP_SHAPES = {"smollm2-135m": (576, 49152), "gemma3-270m": (640, 262144)}  # (hidden, vocab) of the heads


# ============================================================================================== models and steps


def tiny_model(vocab: int, seed: int):
    from tlm import TLMConfig, TLMForCausalLM

    torch.manual_seed(seed)
    config = TLMConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                       tie_word_embeddings=True)
    return TLMForCausalLM(config)


@dataclass(frozen=True)
class Variant:
    """A base step (BASES) and how it runs: ``BASE[/OPTION...]``, the options ``micro=N`` (blocks a micro-batch,
    default --micro), ``ckpt`` (gradient checkpointing of the student's blocks, as train.gradient_checkpointing),
    ``teacher=fp32`` (the teacher's weights as loaded; default: as the trainer stores them, tlm_train.teacher) and
    ``loss@REV`` (tlm_train/losses.py as committed at git revision REV: a before/after of the loss's code)."""

    name: str
    base: str
    micro: int | None = None
    ckpt: bool = False
    teacher: str = "stored"
    loss_rev: str | None = None


def parse_variant(spec: str) -> Variant:
    base, *options = spec.split("/")
    if base not in BASES:
        raise SystemExit(f"variant {spec!r}: the base must be one of {', '.join(BASES)}")
    kw: dict = {}
    for option in options:
        if option.startswith("micro=") and option[6:].isdigit() and int(option[6:]) > 0:
            kw["micro"] = int(option[6:])
        elif option == "ckpt":
            kw["ckpt"] = True
        elif option == "teacher=fp32":
            kw["teacher"] = "fp32"
        elif option.startswith("loss@") and len(option) > 5:
            kw["loss_rev"] = option[5:]
        else:
            raise SystemExit(f"variant {spec!r}: unknown option {option!r} (micro=N, ckpt, teacher=fp32, loss@REV)")
    return Variant(spec, base, **kw)


_LOSSES: dict = {}


def losses_at(rev: str | None):
    """tlm_train.losses today (rev None), or the module's source at git revision ``rev`` run as a module."""
    if rev is None:
        return tlm_train.losses
    if rev not in _LOSSES:
        src = subprocess.run(["git", "-C", str(HERE.parent), "show", f"{rev}:tlm_train/losses.py"], check=True,
                             capture_output=True, text=True).stdout
        module = types.ModuleType(f"losses_at_{rev}")
        exec(compile(src, f"{rev}:tlm_train/losses.py", "exec"), module.__dict__)
        _LOSSES[rev] = module
    return _LOSSES[rev]


def teachers(teacher, variants, bf16: bool) -> dict:
    """The teacher in each storage the variants use: ``fp32`` as loaded, ``stored`` as the trainer stores it
    (its projections in bf16 under bf16 autocast: tlm_train.teacher.store_for_autocast)."""
    kinds = {v.teacher for v in variants if v.base != "plain"} or {"stored"}
    out = {}
    if "fp32" in kinds:
        out["fp32"] = teacher
    if "stored" in kinds:
        stored = copy.deepcopy(teacher) if "fp32" in kinds else teacher
        if bf16:
            store_for_autocast(stored, torch.bfloat16, "cpu")
        out["stored"] = stored
    return out


def build(model: str, quick: bool, all_trainable: bool = False):
    """(student in train mode, frozen teacher): the source model twice (the step's cost does not need a TLM
    conversion), or two tiny random models; the student's trainable parameters those of the heal recipe (or all)."""
    if quick:
        vocab = 4096 if model == "gemma3-270m" else 1024
        student, teacher = tiny_model(vocab, 0), tiny_model(vocab, 1)
    else:
        from tlm_io.load import load_model

        student, _, _ = load_model(model, with_tokenizer=False)
        teacher = copy.deepcopy(student)
    if HEAL_RECIPE["train"]["trainable"] and not all_trainable:
        select_trainable(student, HEAL_RECIPE["train"]["trainable"])
    return student.train(), teacher.eval().requires_grad_(False)


def optimizer(student) -> torch.optim.Optimizer:
    o = OptimSpec(**HEAL_RECIPE["optim"])
    return torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=peak_lr(student, o),
                             betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)


class Timer:
    """Wall and process-CPU seconds per phase of one step; with ``rss``, also each phase's peak RSS (MB): the kernel's
    mark is reset as the phase starts and read as it ends (so a step's peak is the largest of its phases')."""

    rss = False  # set in the peak-RSS children only: the mark's reset and read cost a few ms

    def __init__(self):
        self.wall = dict.fromkeys(PHASES, 0.0)
        self.cpu = dict.fromkeys(PHASES, 0.0)
        self.peak = dict.fromkeys(PHASES, 0)

    @contextmanager
    def __call__(self, phase: str):
        if self.rss:
            Path("/proc/self/clear_refs").write_text("5")
        wall, cpu = time.perf_counter(), time.process_time()
        yield
        self.wall[phase] += time.perf_counter() - wall
        self.cpu[phase] += time.process_time() - cpu
        if self.rss:
            self.peak[phase] = max(self.peak[phase], round(_status_kb("VmHWM") / 1024))


def cached_top(teacher, ids: torch.Tensor, bf16: bool, k: int):
    """The teacher's top-k (indices, log-probabilities) of ids, as the trainer's cache holds them."""
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext(), torch.no_grad():
        h_t = teacher.model(input_ids=ids, use_cache=False).last_hidden_state
        return teacher_topk(h_t, teacher.lm_head.weight, k, HEAL_RECIPE["distill"]["temperature"])


def step(variant: Variant, student, teachers: dict, opt, ids: torch.Tensor, bf16: bool, chunk: int, top=None,
         micro: int | None = None) -> dict:
    """One optimizer step of ``variant`` (see the module docstring) over the blocks of ids (B, S), in micro-batches
    of ``variant.micro`` or ``micro`` blocks (gradients accumulated, as the trainer's grad_accum); its mean loss
    and phase times. ``teachers``: by storage (:func:`teachers`); ``top``: the cached teacher top-k of ids."""
    timer = Timer()
    micro = variant.micro or micro or ids.shape[0]
    parts = range(0, ids.shape[0], micro)
    total = 0.0
    teacher = teachers.get(variant.teacher)
    student.model.gradient_checkpointing = variant.ckpt
    for i in parts:
        part_top = None if top is None else tuple(t[i:i + micro] for t in top)
        total += micro_step(variant, student, teacher, ids[i:i + micro], bf16, chunk, part_top, timer, len(parts))
    student.model.gradient_checkpointing = False
    with timer("optimizer"):
        torch.nn.utils.clip_grad_norm_(student.parameters(), HEAL_RECIPE["optim"]["grad_clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"loss": total, "wall": timer.wall, "cpu": timer.cpu, "peak": timer.peak}


def micro_step(variant: Variant, student, teacher, ids: torch.Tensor, bf16: bool, chunk: int, top, timer: Timer,
               accum: int) -> float:
    """Forward, loss and backward of one micro-batch (the loss scaled by 1 / accum); the unscaled loss."""
    d = HEAL_RECIPE["distill"]
    alpha, t = d["alpha"], d["temperature"]
    head = student.get_output_embeddings().weight
    head_loss = losses_at(variant.loss_rev).head_loss
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
        if variant.base == "heal_topk":  # a later epoch of a heal with distill.teacher_topk
            with timer("student_forward"):
                h = student(input_ids=ids, use_cache=False, output_hidden_states=True,
                            logits_to_keep=1).hidden_states[-1]
            with timer("loss"):
                loss = head_loss(h, head, ids, teacher_top=top, kd_weight=alpha, lm_weight=1 - alpha,
                                 temperature=t, chunk=chunk)
        elif variant.base == "heal_chunked":  # as tlm_train.trainer._Run takes it
            with timer("student_forward"):
                h = student(input_ids=ids, use_cache=False, output_hidden_states=True,
                            logits_to_keep=1).hidden_states[-1]
            with timer("teacher_forward"), torch.no_grad():
                h_t = teacher.model(input_ids=ids, use_cache=False).last_hidden_state
            with timer("loss"):
                loss = head_loss(h, head, ids, teacher_hidden=h_t, teacher_head=teacher.lm_head.weight,
                                 kd_weight=alpha, lm_weight=1 - alpha, temperature=t, chunk=chunk)
        else:
            with timer("student_forward"):
                logits = student(input_ids=ids, use_cache=False).logits  # (B, S, V)
            if variant.base == "plain":
                with timer("loss"):
                    loss = lm_loss(logits, ids)
            else:
                with timer("teacher_forward"), torch.no_grad():
                    target = teacher(input_ids=ids, use_cache=False).logits
                with timer("loss"):
                    kd = distill_loss(logits, target, t)
                    loss = kd if alpha == 1 else (1 - alpha) * lm_loss(logits, ids) + alpha * kd
                del target
            del logits
        with timer("backward"):
            (loss / accum).backward()
    return float(loss.detach()) / accum


def random_ids(vocab: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


# ============================================================================================== side by side


def summarize(steps: list[dict], tokens: int) -> dict:
    walls = [sum(s["wall"].values()) for s in steps]
    cpus = [sum(s["cpu"].values()) for s in steps]
    total = sum(walls)
    share = {p: round(sum(s["wall"][p] for s in steps) / total, 4) for p in PHASES}
    share["student_forward_backward"] = round(share["student_forward"] + share["backward"], 4)
    return {"median_wall_s": round(statistics.median(walls), 3), "median_cpu_s": round(statistics.median(cpus), 3),
            "tokens_per_s": round(tokens / statistics.median(walls), 1), "wall_share": share,
            "steps_wall_s": [round(w, 3) for w in walls], "steps_cpu_s": [round(c, 3) for c in cpus],
            "losses": [round(s["loss"], 6) for s in steps]}


def side_by_side(model: str, args, bf16: bool) -> dict:
    variants = [parse_variant(v) for v in args.variants]
    student, teacher = build(model, args.quick, args.all_trainable)
    opt = optimizer(student)
    ids = random_ids(student.config.vocab_size, args.batch, args.seq_len)
    top = cached_top(teacher, ids, bf16, args.topk)
    models = teachers(teacher, variants, bf16)
    runs = {v.name: [] for v in variants}
    for v in variants:  # untimed: allocator, AdamW state, oneDNN kernels
        step(v, student, models, opt, ids, bf16, args.chunk, top, args.micro)
    for i in range(args.steps):
        for v in (variants if i % 2 == 0 else variants[::-1]):
            runs[v.name].append(step(v, student, models, opt, ids, bf16, args.chunk, top, args.micro))
            print(f"{model} {v.name}: {sum(runs[v.name][-1]['wall'].values()):.2f} s", flush=True)
    tokens = args.batch * args.seq_len
    out = {v.name: summarize(runs[v.name], tokens) for v in variants}
    if "plain" in out:
        for v in variants:
            out[v.name]["vs_plain"] = round(out[v.name]["tokens_per_s"] / out["plain"]["tokens_per_s"], 3)
    return out


# ============================================================================================== peak RSS


def _status_kb(field: str, pid: int | str = "self") -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1))


def mem_available_gb() -> float:
    return int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) / 2**20


def child_rss(spec: str, model: str, args, bf16: bool) -> dict:
    """In a fresh process: the peak RSS of --rss-steps steps of variant ``spec``, models and optimizer state
    included."""
    variant = parse_variant(spec)
    student, teacher = build(model, args.quick, args.all_trainable)
    opt = optimizer(student)
    ids = random_ids(student.config.vocab_size, args.batch, args.seq_len)
    top = cached_top(teacher, ids, bf16, args.topk) if variant.base == "heal_topk" else None  # before the mark
    teacher = teachers(teacher, [variant], bf16)
    losses_at(variant.loss_rev)  # imported before the mark
    before, loading = _status_kb("VmRSS"), _status_kb("VmHWM")
    Timer.rss = True  # each phase resets the kernel's peak-RSS mark (to the current RSS) and reads it at its end
    steps = [step(variant, student, teacher, opt, ids, bf16, args.chunk, top, args.micro)
             for _ in range(args.rss_steps)]
    phase_peak = {p: max(s["peak"][p] for s in steps) for p in PHASES if any(s["peak"][p] for s in steps)}
    return {"peak_rss_mb": max(phase_peak.values()), "rss_before_steps_mb": round(before / 1024),
            "rss_after_steps_mb": round(_status_kb("VmRSS") / 1024), "phase_peak_rss_mb": phase_peak,
            "memory_mb": memory_parts(student, teacher, opt),
            "peak_rss_of_loading_mb": round(loading / 1024),
            "steps_wall_s": [round(sum(s["wall"].values()), 3) for s in steps],
            "steps_cpu_s": [round(sum(s["cpu"].values()), 3) for s in steps]}


def memory_parts(student, teachers: dict, opt) -> dict:
    """MB of what a step holds throughout: the two models' weights, the student's gradients and AdamW's moments."""
    def mb(tensors) -> int:
        return round(sum(t.numel() * t.element_size() for t in tensors) / 2**20)

    trainable = [p for p in student.parameters() if p.requires_grad]
    return {"student_weights": mb(student.parameters()),
            "teacher_weights": mb(p for t in teachers.values() for p in t.parameters()),
            "gradients": mb(trainable),
            "adamw_moments": mb(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())}


def run_child(argv: list[str], limit_gb: float) -> dict:
    """Run this script with ``argv``; its last stdout line is JSON. Killed (and said so) past ``limit_gb`` RSS."""
    proc = subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    killed = {}

    def watch():
        while proc.poll() is None:
            try:
                rss = _status_kb("VmRSS", proc.pid) / 2**20
            except (OSError, AttributeError):
                break
            if rss > limit_gb:
                killed["at_gb"] = round(rss, 2)
                proc.kill()
                break
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, err = proc.communicate()
    watcher.join()
    if killed:
        return {"status": f"killed: RSS passed --rss-limit-gb {limit_gb} ({killed['at_gb']} GB)"}
    if proc.returncode != 0:
        return {"status": f"failed (exit {proc.returncode}): {err.strip().splitlines()[-1] if err.strip() else ''}"}
    return {"status": "ok", **json.loads(out.strip().splitlines()[-1])}


def _child_argv(args, model: str, variant: str) -> list[str]:
    argv = ["--child", variant, "--model", model, "--batch", str(args.batch), "--micro", str(args.micro),
            "--seq-len", str(args.seq_len)] + (["--all-trainable"] if args.all_trainable else []) + [
            "--rss-steps", str(args.rss_steps), "--chunk", str(args.chunk), "--threads", str(args.threads),
            "--topk", str(args.topk)]
    return argv + (["--quick"] if args.quick else [])


# ============================================================================================== chunk sweep


def sweep_child(spec: str, args, bf16: bool) -> dict:
    """head_loss alone at one (hidden, vocab, chunk): median forward + backward seconds, peak RSS above the inputs."""
    d, v, chunk = (int(x) for x in spec.split(","))
    n_pos = args.batch * args.seq_len
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(args.batch, args.seq_len, d, generator=g, requires_grad=True)
    ws = (torch.randn(v, d, generator=g) * 0.05).requires_grad_()
    ht, wt = torch.randn(args.batch, args.seq_len, d, generator=g), torch.randn(v, d, generator=g) * 0.05
    ids = torch.randint(0, v, (args.batch, args.seq_len), generator=g)

    def once() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            head_loss(hs, ws, ids, teacher_hidden=ht, teacher_head=wt, kd_weight=1.0, lm_weight=0.0,
                      chunk=chunk).backward()
        hs.grad = ws.grad = None
        return time.perf_counter() - wall, time.process_time() - cpu

    once()
    hs.grad = ws.grad = None
    base = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    times = [once() for _ in range(args.rss_steps)]
    return {"hidden": d, "vocab": v, "chunk": chunk, "positions": n_pos,
            "median_wall_s": round(statistics.median(t[0] for t in times), 4),
            "median_cpu_s": round(statistics.median(t[1] for t in times), 4),
            "peak_above_inputs_mb": round((_status_kb("VmHWM") - base) / 1024)}


def sweep(args) -> list[dict]:
    rows = []
    chunks = [64, 128, 256] if args.quick else [64, 128, 256, 512, 1024]
    for name, (d, v) in SWEEP_SHAPES.items():
        if args.quick:
            d, v = 32, 1024
        for chunk in chunks:
            if v * chunk * 4 > 2**30:  # a (chunk, vocab) fp32 buffer over 1 GiB: not a candidate on this machine
                continue
            argv = ["--sweep-child", f"{d},{v},{chunk}", "--batch", str(args.batch), "--seq-len", str(args.seq_len),
                    "--rss-steps", str(args.rss_steps), "--threads", str(args.threads)]
            row = {"head": name, **run_child(argv + (["--quick"] if args.quick else []), args.rss_limit_gb)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


# ============================================================================================== main


def machine() -> dict:
    cpu = "unknown"
    try:
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1)
    except (OSError, AttributeError):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "logical_cpus": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "mem_total_gb": round(int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
                                  / 2**20, 1)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="student and teacher (a built-in name or checkpoint)")
    ap.add_argument("--gemma", action="store_true", help="also Gemma 3 270M's heal_chunked peak RSS")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=HEAL_RECIPE["train"]["batch_size"] * HEAL_RECIPE["train"]["grad_accum"],
                    help="blocks a step [the heal recipe's]")
    ap.add_argument("--micro", type=int, default=HEAL_RECIPE["train"]["batch_size"],
                    help="blocks a micro-batch [the heal recipe's]")
    ap.add_argument("--all-trainable", action="store_true",
                    help="train every parameter [the heal recipe's train.trainable]")
    ap.add_argument("--steps", type=int, default=3, help="timed rounds (one step of every variant each)")
    ap.add_argument("--rss-steps", type=int, default=2, help="steps of each peak-RSS subprocess")
    ap.add_argument("--chunk", type=int, default=HEAD_CHUNK, help="positions per chunk of the chunked loss")
    ap.add_argument("--topk", type=int, default=128, help="k of the heal_topk variant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rss-limit-gb", type=float, default=12.0, help="a child past this RSS is killed")
    ap.add_argument("--gemma-min-free-gb", type=float, default=14.0, help="Gemma runs only with this much free")
    ap.add_argument("--sweep", action="store_true", help="only the chunk sweep of head_loss")
    ap.add_argument("--quick", action="store_true", help="tiny random models, 2 x 33 tokens: checks that it runs")
    ap.add_argument("--out", default="bench/results/studies/heal-step/heal_step.json")
    ap.add_argument("--variants", type=lambda x: x.split(","), default=list(VARIANTS),
                    help="comma-separated, each BASE[/OPTION...] (see Variant) [%(default)s]")
    ap.add_argument("--gemma-variants", type=lambda x: x.split(","), default=["heal_chunked", "heal_topk"],
                    help="Gemma 3's peak-RSS children with --gemma [%(default)s]")
    ap.add_argument("--no-rss", action="store_true", help="the side-by-side timing only (no peak-RSS children)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--sweep-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for v in args.variants + args.gemma_variants:
        parse_variant(v)  # a bad name stops the run before anything is built
    if args.quick:
        args.batch, args.seq_len = QUICK_SHAPES["batch"], QUICK_SHAPES["seq_len"]
        args.micro = min(args.micro, args.batch)
        args.steps, args.rss_steps = min(args.steps, 2), 1
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    precision = HEAL_RECIPE["train"]["precision"]
    bf16 = precision == "bf16" or (precision == "auto" and bf16_is_fast("cpu"))
    if args.child:
        print(json.dumps(child_rss(args.child, args.model, args, bf16)))
        return
    if args.sweep_child:
        print(json.dumps(sweep_child(args.sweep_child, args, bf16)))
        return
    wall, cpu, cpu_children = time.perf_counter(), time.process_time(), os.times()
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "threads": args.threads, "precision": "bf16" if bf16 else "fp32", "bf16_is_fast": bf16_is_fast("cpu"),
              "batch": args.batch, "micro_batch": args.micro,
              "trainable": "all" if args.all_trainable else HEAL_RECIPE["train"]["trainable"], "seq_len": args.seq_len, "chunk": args.chunk, "topk": args.topk, "quick": args.quick,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average_start": os.getloadavg()}
    if args.sweep:
        result["sweep"] = sweep(args)
    else:
        result["models"] = {args.model: {"timing": side_by_side(args.model, args, bf16), "peak_rss": {}}}
        children = () if args.no_rss else ("heal_chunked",) if args.quick else args.variants
        for v in children:  # quick: one child, the path checked
            row = run_child(_child_argv(args, args.model, v), args.rss_limit_gb)
            result["models"][args.model]["peak_rss"][v] = row
            print(f"{args.model} {v} peak RSS: {row}", flush=True)
        if args.gemma:
            gemma = {"peak_rss": {}}
            free = mem_available_gb()
            if free < args.gemma_min_free_gb:
                gemma["skipped"] = f"MemAvailable {free:.1f} GB < --gemma-min-free-gb {args.gemma_min_free_gb}"
            else:
                for v in args.gemma_variants:
                    gemma["peak_rss"][v] = run_child(_child_argv(args, "gemma3-270m", v), args.rss_limit_gb)
            result["models"]["gemma3-270m"] = gemma
            print(f"gemma3-270m: {gemma}", flush=True)
    ends = os.times()
    result["wall_s"] = round(time.perf_counter() - wall, 1)
    result["cpu_s"] = round(time.process_time() - cpu, 1)
    result["cpu_s_children"] = round(ends.children_user + ends.children_system
                                     - cpu_children.children_user - cpu_children.children_system, 1)
    result["load_average_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("wall_s", "cpu_s", "cpu_s_children", "precision")}))


if __name__ == "__main__":
    main()
