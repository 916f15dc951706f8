"""Low-memory conversion (issue 3): peak RSS and time of ``tlm-convert --low-memory`` on a checkpoint larger than
the memory it may use.

1. Writes a random-weight Llama-style checkpoint (default: fp32, hidden 4096, MLP 11008, 32 query / 8 KV heads,
   12 layers, vocab 32000, untied head: 2.39 B parameters, 9.6 GB on disk) shard by shard, so that generating it
   holds one layer at a time, with a small tokenizer (tests/tiny_sources.tiny_tokenizer, vocab 320 <= 32000).
2. Runs ``tlm-convert SRC -o OUT --low-memory --calibration-tokens 1024 --seq-len 256 --calibration-data
   tests/data/shakespeare_slice.txt`` in a subprocess under ``/usr/bin/time -v`` (peak RSS of the child; without
   it, ``resource.getrusage(RUSAGE_CHILDREN)``) and times it.
3. Checks the output: parameters (from the safetensors headers) equal the source's, widths as planned, a copied
   tensor equal to the source's, index complete; reads the per-phase seconds from conversion_report.json.
4. Deletes the checkpoint and the output (``--keep`` keeps them) and prints a JSON record and a markdown section.

Usage:
    python bench/low_memory.py                          # full run (10-25 min on 2 busy cores), --workdir /tmp/...
    python bench/low_memory.py --layers 2 --hidden 1024 --intermediate 2816 --vocab 4096   # smoke run
    python bench/low_memory.py --in-memory --layers 4 --json bench/results/in_memory.json   # the default path

SRC and OUT go to --workdir (default: a new folder under the temp dir); the folder is deleted at the end.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402

DATA = ROOT / "tests" / "data" / "shakespeare_slice.txt"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=None,
                   help="where SRC and OUT are written (then deleted); default: a new folder under the temp dir, so "
                        "two runs never share one")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--calibration-tokens", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--extra", default="", help="more tlm-convert options, e.g. '--dtype bfloat16'")
    p.add_argument("--in-memory", action="store_true",
                   help="run the default in-memory path instead (no --low-memory): its peak RSS against the model size")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint and the output")
    p.add_argument("--json", default=None, help="also write the record to this file")
    return p.parse_args(argv)


# ============================================================================================== the checkpoint


def write_checkpoint(folder: Path, args) -> dict:
    """A random Llama checkpoint, one safetensors shard per layer (one layer in memory at a time)."""
    from safetensors.torch import save_file
    from tiny_sources import tiny_tokenizer
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    d, inter, head_dim = args.hidden, args.intermediate, args.hidden // args.heads
    kv = args.kv_heads * head_dim
    gen = torch.Generator().manual_seed(0)
    std = 0.02

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * std

    shards = [{"model.embed_tokens.weight": lambda: rand(args.vocab, d)}]
    for i in range(args.layers):
        p = f"model.layers.{i}."
        shards.append({
            p + "input_layernorm.weight": lambda: torch.ones(d),
            p + "self_attn.q_proj.weight": lambda: rand(d, d),
            p + "self_attn.k_proj.weight": lambda: rand(kv, d),
            p + "self_attn.v_proj.weight": lambda: rand(kv, d),
            p + "self_attn.o_proj.weight": lambda: rand(d, d),
            p + "post_attention_layernorm.weight": lambda: torch.ones(d),
            p + "mlp.gate_proj.weight": lambda: rand(inter, d),
            p + "mlp.up_proj.weight": lambda: rand(inter, d),
            p + "mlp.down_proj.weight": lambda: rand(d, inter),
        })
    shards.append({"model.norm.weight": lambda: torch.ones(d), "lm_head.weight": lambda: rand(args.vocab, d)})
    weight_map, total_bytes, params = {}, 0, 0
    for k, makers in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: make() for key, make in makers.items()}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        for key, t in tensors.items():
            weight_map[key] = name
            total_bytes += t.numel() * t.element_size()
            params += t.numel()
        del tensors
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=d, intermediate_size=inter, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, tie_word_embeddings=False,
                         max_position_embeddings=4096, bos_token_id=0, eos_token_id=0)
    config.dtype = "float32"
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(str(folder))
    tiny_tokenizer().save_pretrained(str(folder))
    return {"params": params, "bytes_on_disk": folder_bytes(folder), "tensor_bytes": total_bytes}


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def header_params(folder: Path) -> int:
    """Parameters of a safetensors folder from the file headers (no tensor data is read)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                n = 1
                for s in f.get_slice(key).get_shape():
                    n *= s
                total += n
    return total


# ============================================================================================== the run


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        kb = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal")))
        mem = f"{kb / 2**20:.1f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "memory": mem,
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}


def run_convert(src: Path, out: Path, args) -> dict:
    exe = shutil.which("tlm-convert")
    convert = [exe] if exe else [sys.executable, "-m", "tlm_convert"]
    mode = [] if args.in_memory else ["--low-memory"]
    cmd = convert + [str(src), "-o", str(out), *mode, "--calibration-tokens", str(args.calibration_tokens),
                     "--seq-len", str(args.seq_len), "--calibration-data", str(DATA)] + args.extra.split()
    timer = "/usr/bin/time" if Path("/usr/bin/time").exists() else None
    full = ([timer, "-v"] if timer else []) + cmd
    # this checkout's code, whatever an editable install of the package points to
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = subprocess.run([sys.executable, "-c", "import tlm_convert; print(tlm_convert.__file__)"], env=env,
                          capture_output=True, text=True, cwd=str(ROOT)).stdout.strip()
    load_before = os.getloadavg()
    start = time.perf_counter()
    proc = subprocess.run(full, capture_output=True, text=True, cwd=str(ROOT), env=env)
    wall = time.perf_counter() - start
    shown = ["tlm-convert" if exe else "python -m tlm_convert"] + cmd[len(convert):]
    record = {"command": " ".join(shown), "code": code, "returncode": proc.returncode, "wall_s": wall,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    if timer:
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
        record["peak_rss_mb"] = int(m.group(1)) / 1024 if m else None
        record["rss_source"] = "/usr/bin/time -v"
    else:
        record["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        record["rss_source"] = "getrusage(RUSAGE_CHILDREN)"
    record["stdout"] = proc.stdout[-3000:]
    record["stderr_tail"] = "\n".join(line for line in proc.stderr.splitlines()[-40:] if "\r" not in line)
    return record


def check_output(src: Path, out: Path, source: dict) -> dict:
    from safetensors import safe_open

    report = json.loads((out / "conversion_report.json").read_text())
    config = json.loads((out / "config.json").read_text())
    files = sorted(out.glob("*.safetensors"))
    if (out / "model.safetensors.index.json").exists():
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    else:  # one unsharded file (the in-memory path below 2 GB)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    params = header_params(out)
    assert set(weight_map.values()) == {f.name for f in files}, "index and shard files differ"
    assert params == source["params"] == report["params_before"] == report["params_after"], \
        f"parameters: written {params}, source {source['params']}, report {report['params_after']}"
    assert config["intermediate_sizes"] == report["widths_after"]
    key = "model.layers.0.self_attn.q_proj.weight"  # copied unchanged: must equal the source bit for bit
    src_index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(src / src_index[key]), "pt") as a, safe_open(str(out / weight_map[key]), "pt") as b:
        assert torch.equal(a.get_tensor(key), b.get_tensor(key)), f"{key} differs from the source"
    return {"params_out": params, "output_bytes_on_disk": folder_bytes(out), "shards": len(files),
            "widths_after": report["widths_after"], "seconds": report["seconds"],
            "self_reported_peak_rss_mb": report["peak_rss_mb"]}


def markdown(record: dict) -> str:
    m, r, s = record["machine"], record["run"], record["source"]
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in record["output"]["seconds"].items())
    size = record["args"]
    return "\n".join([
        "## In-memory conversion, peak RSS (issue 3)" if size.get("in_memory") else "## Low-memory conversion (issue 3)",
        "",
        f"`python bench/low_memory.py` ({record['date']}, commit `{record['commit']}`): a random-weight Llama "
        f"checkpoint (fp32, hidden "
        f"{size['hidden']}, MLP {size['intermediate']}, {size['heads']}/{size['kv_heads']} heads, {size['layers']} "
        f"layers, vocab {size['vocab']}, untied head) converted in a subprocess with",
        "",
        f"    {r['command'].replace(str(ROOT) + '/', '')}",
        "",
        "| | |",
        "|---|---|",
        f"| machine | {m['cpus']} CPUs ({m['cpu']}), {m['memory']} RAM, torch {m['torch']}, shared with other jobs "
        f"(load average {r['loadavg_before'][0]:.1f} before, {r['loadavg_after'][0]:.1f} after) |",
        f"| checkpoint | {s['params']:,} parameters, {s['bytes_on_disk'] / 1e9:.2f} GB on disk "
        f"({s['bytes_on_disk'] / 2**30:.2f} GiB), {size['layers'] + 2} shards; written in {s['write_s']:.0f} s |",
        f"| peak RSS | **{r['peak_rss_mb']:.0f} MB** ({r['rss_source']}; the process's own ru_maxrss: "
        f"{record['output']['self_reported_peak_rss_mb']:.0f} MB); target <= "
        + (f"2x the fp32 model = {2 * 4 * s['params'] / 2**20:.0f} MB |" if size.get("in_memory") else "3072 MB |"),
        f"| wall time | {r['wall_s']:.0f} s ({r['wall_s'] / 60:.1f} min) |",
        f"| phases | {phases} |",
        f"| output | {record['output']['params_out']:,} parameters (= source), "
        f"{record['output']['output_bytes_on_disk'] / 1e9:.2f} GB, {record['output']['shards']} shards; widths "
        f"{record['output']['widths_after']} |",
        "",
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="tlm-lowmem-bench-"))
    if work.exists():
        shutil.rmtree(work)
    src, out = work / "src", work / "out"
    record = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "commit": commit(), "args": vars(args),
              "machine": machine()}
    try:
        start = time.perf_counter()
        record["source"] = write_checkpoint(src, args)
        record["source"]["write_s"] = time.perf_counter() - start
        print(f"checkpoint: {record['source']['params']:,} params, {record['source']['bytes_on_disk'] / 1e9:.2f} GB "
              f"in {record['source']['write_s']:.0f} s", flush=True)
        record["run"] = run_convert(src, out, args)
        if record["run"]["returncode"] != 0:
            print(record["run"]["stderr_tail"], file=sys.stderr)
            raise SystemExit(f"tlm-convert failed with exit code {record['run']['returncode']}")
        record["output"] = check_output(src, out, record["source"])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: v for k, v in record.items() if k != "run"} | {"run": {k: v for k, v in record["run"].items()
                                                                             if k not in ("stdout", "stderr_tail")}},
                     indent=2))
    print()
    print(markdown(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
