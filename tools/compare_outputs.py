"""Compare the tensors of two conversion outputs: per tensor, equal bits or the largest |Δ| relative to the tensor's
largest entry; exits 1 when a tensor is missing or differs by more than ``--rel`` (default 1e-6).

    python tools/compare_outputs.py OUT_A OUT_B [--rel 1e-6]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from safetensors.torch import load_file


def tensors(folder: Path) -> dict:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(folder.glob("*.safetensors")):
        digest.update(file.read_bytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--rel", type=float, default=1e-6)
    args = parser.parse_args()
    a, b = tensors(args.a), tensors(args.b)
    if a.keys() != b.keys():
        sys.exit(f"different tensor names: {sorted(a.keys() ^ b.keys())[:5]}")
    worst, differ = 0.0, []
    for name in sorted(a):
        if a[name].shape != b[name].shape:
            sys.exit(f"{name}: shape {tuple(a[name].shape)} vs {tuple(b[name].shape)}")
        if not a[name].equal(b[name]):
            rel = float((a[name].double() - b[name].double()).abs().max() / a[name].double().abs().max())
            differ.append((name, rel))
            worst = max(worst, rel)
    print(f"sha256 of the safetensors: {sha256(args.a)} / {sha256(args.b)}")
    print(f"{len(a)} tensors, {len(differ)} differ; largest |Δ| relative to the tensor's largest entry: {worst:.3g}")
    for name, rel in differ[:10]:
        print(f"  {name}: {rel:.3g}")
    sys.exit(1 if worst > args.rel else 0)


if __name__ == "__main__":
    main()
