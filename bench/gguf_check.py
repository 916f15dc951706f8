"""GGUF export checked by llama.cpp itself (issue 12): the same model in torch and in llama.cpp, same tokens.

Exports MODEL (a TLM / converted folder, a transformers folder, a .gguf, or ``smollm2-135m``) with
``tlm export MODEL --to gguf`` (f32 weights unless ``--type``), loads ``model.gguf`` with llama-cpp-python (f32 KV
cache, every position's logits) and compares it with the TLM in torch (fp32) on the bundled held-out text
(``default-eval``) cut into disjoint windows of ``--ctx`` tokens:

* max |delta logit| over every position and vocabulary entry (target <= 1e-3 with f32 weights), top-1 agreement;
* perplexity of both over the same tokens (target: equal to 4 significant digits);
* a greedy continuation of ``--greedy`` tokens (30) from the first 16 tokens: identical ids and text;
* llama.cpp's tokenization of the text against the transformers tokenizer of the export.

    pip install '.[llama]'     # llama-cpp-python: builds llama.cpp (many minutes on 2 cores)
    python bench/gguf_check.py /work/baseline/smollm2-default --tokens 2048 --threads 2

Writes bench/results/gguf_check.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m")
    p.add_argument("--gguf", default=None, help="an already exported model.gguf (skips the export)")
    p.add_argument("--type", default=None, choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--tokens", type=int, default=2048, help="evaluation tokens (disjoint windows of --ctx)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--greedy", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(HERE / "results" / "gguf_check.json"))
    return p.parse_args()


def main() -> None:
    args = _args()
    import numpy as np
    import torch
    import torch.nn.functional as F
    from llama_cpp import Llama

    from tlm_io.checkpoint import load_source
    from tlm_io.locate import resolve_builtin
    from tlm_io.export import export_checkpoint
    from tlm_io.load import load_tokenizer, materialize
    from tlm_io.text import load_text

    torch.set_num_threads(args.threads)
    source = resolve_builtin(args.model)
    t0 = time.perf_counter()
    if args.gguf is None:
        folder = Path(tempfile.mkdtemp(prefix="gguf_check-")) / "out"
        export_checkpoint(source, folder, "gguf", args.type)
        gguf_path = folder / "model.gguf"
    else:
        gguf_path = Path(args.gguf)
    export_s = time.perf_counter() - t0
    src = load_source(source)
    model = materialize(src.tlm_config, src.state_dict).eval()
    tokenizer = load_tokenizer(src)
    text = load_text("default-eval")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
    llm = Llama(str(gguf_path), n_ctx=args.ctx, n_batch=args.ctx, n_ubatch=args.ctx, logits_all=True,
                n_threads=args.threads, type_k=0, type_v=0, verbose=False)  # GGML type 0: f32 KV cache
    cpp_ids = llm.tokenize(text[:20000].encode(), add_bos=False, special=False)
    hf_ids = tokenizer(text[:20000], add_special_tokens=False)["input_ids"]

    max_delta, agree, count, scored, nll_torch, nll_cpp = 0.0, 0, 0, 0, 0.0, 0.0
    for start in range(0, len(ids) - 1, args.ctx):
        block = ids[start : start + args.ctx]
        if len(block) < 2:
            break
        llm.reset()
        llm.eval(block)
        theirs = torch.from_numpy(np.array(llm.scores[: len(block)], dtype=np.float32))
        with torch.no_grad():
            mine = model(torch.tensor([block])).logits[0].float()
        max_delta = max(max_delta, float((theirs - mine).abs().max()))
        agree += int((theirs.argmax(-1) == mine.argmax(-1)).sum())
        count += len(block)
        scored += len(block) - 1
        target = torch.tensor(block[1:])
        nll_torch += float(F.cross_entropy(mine[:-1], target, reduction="sum"))
        nll_cpp += float(F.cross_entropy(theirs[:-1], target, reduction="sum"))

    prompt = ids[:16]
    with torch.no_grad():
        torch_greedy = model.generate(torch.tensor([prompt]), max_new_tokens=args.greedy, min_new_tokens=args.greedy,
                                      do_sample=False)[0, len(prompt):].tolist()
    cpp_greedy = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        cpp_greedy.append(int(token))
        if len(cpp_greedy) == args.greedy:
            break

    result = {
        "model": args.model, "gguf": str(gguf_path), "gguf_mb": round(gguf_path.stat().st_size / 2**20, 1),
        "weight_type": args.type or "f32", "kv_cache": "f32", "tokens": len(ids), "ctx": args.ctx,
        "export_seconds": round(export_s, 1),
        "max_abs_delta_logit": max_delta, "top1_agreement": agree / count,
        "perplexity_torch": math.exp(nll_torch / scored), "perplexity_llama_cpp": math.exp(nll_cpp / scored),
        "greedy_identical": torch_greedy == cpp_greedy, "greedy_tokens": args.greedy,
        "greedy_text_torch": tokenizer.decode(torch_greedy), "greedy_text_llama_cpp": tokenizer.decode(cpp_greedy),
        "tokenization_identical": cpp_ids == hf_ids, "tokenization_tokens": len(hf_ids),
        "machine": f"{platform.machine()} {platform.processor() or ''} threads={args.threads}".strip(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
