"""The tokenizer tlm reads from a GGUF against llama.cpp's own tokenization of the same file, on every bundled text.

transformers rebuilds a fast tokenizer from the GGUF's vocabulary (for SentencePiece models: merges derived from
the scores), which can cut rare strings differently from the model's own tokenizer. This counts where: for each
bundled set (calibration and evaluation), the first ``--chars`` characters tokenized both ways (no BOS, no special
tokens), the token counts and the first position where they differ.

    pip install '.[llama]'     # llama-cpp-python
    python bench/gguf_tokenizer_check.py gemma3-270m --out bench/results/gguf_tokenizer_gemma3.json

MODEL: a .gguf file or a named source (``smollm2-135m``, ``gemma3-270m``). Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="gemma3-270m")
    p.add_argument("--chars", type=int, default=200_000)
    p.add_argument("--out", default=str(HERE / "results" / "gguf_tokenizer_check.json"))
    args = p.parse_args()
    from llama_cpp import Llama

    from tlm_io.locate import resolve_builtin
    from tlm_io.load import load_tokenizer
    from tlm_io.text import BUNDLED, load_text

    gguf = Path(resolve_builtin(args.model))
    tokenizer = load_tokenizer(str(gguf))  # the file's tokenizer alone: no weights are read
    cpp = Llama(str(gguf), vocab_only=True, verbose=False)
    sets = {}
    for name in BUNDLED:
        text = load_text(name)[: args.chars]
        ours = tokenizer(text, add_special_tokens=False)["input_ids"]
        theirs = cpp.tokenize(text.encode(), add_bos=False, special=False)
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None and len(ours) != len(theirs):
            first = min(len(ours), len(theirs))
        entry = {"chars": len(text), "tokens_transformers": len(ours), "tokens_llama_cpp": len(theirs),
                 "identical": ours == theirs}
        if first is not None:
            entry["first_difference"] = {"position": first,
                                         "transformers": tokenizer.convert_ids_to_tokens(ours[first : first + 4]),
                                         "llama_cpp": [cpp.detokenize([t]).decode("utf-8", "replace")
                                                       for t in theirs[first : first + 4]]}
        sets[name] = entry
    result = {"model": args.model, "gguf": gguf.name, "sets": sets}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(result, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
