#!/usr/bin/env python3
"""One optimiser step over all-MiniLM-L6-v2's largest parameter shapes (22.3M values),
``multihead::optim::AdamW`` beside ``torch.optim.AdamW`` (its default single-tensor path,
``foreach=True`` and ``fused=True``), in f32, f32 with ``amsgrad`` and bf16, rounds alternating;
prints a markdown table of each side's fastest step per round. Writes nothing.

    cargo build --release -p multihead --example adamw_step
    python3 tools/bench_optim.py --threads 2 [--rounds 3]
"""

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "target/release/examples/adamw_step"
SHAPES = [(30522, 384)] + [s for _ in range(6) for s in
                           [(1152, 384), (384, 384), (1536, 384), (384, 1536), (1536,)]]
CASES = [("f32", False), ("f32", True), ("bf16", False)]


def torch_step(dtype, amsgrad, steps, **kw):
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    params = [torch.nn.Parameter(torch.randn(s).to(dt)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape).to(dt)
    opt = torch.optim.AdamW(params, amsgrad=amsgrad, **kw)
    best = float("inf")
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def ours(dtype, amsgrad, steps, threads):
    cmd = [str(BIN), "--dtype", dtype, "--steps", str(steps)] + (["--amsgrad"] if amsgrad else [])
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["best_ms"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    if not BIN.exists():
        raise SystemExit(f"{BIN} is missing: cargo build --release -p multihead --example adamw_step")
    torch.set_num_threads(a.threads)
    rows = {c: {k: [] for k in ("ours", "default", "foreach", "fused")} for c in CASES}
    for _ in range(a.rounds):
        for dtype, ams in CASES:
            r = rows[(dtype, ams)]
            r["ours"].append(ours(dtype, ams, a.steps, a.threads))
            r["default"].append(torch_step(dtype, ams, a.steps))
            r["foreach"].append(torch_step(dtype, ams, a.steps, foreach=True))
            r["fused"].append(torch_step(dtype, ams, a.steps, fused=True))
    span = lambda v: f"{min(v):.1f}-{max(v):.1f} ms"
    print(f"torch {torch.__version__}, {a.threads} threads, fastest of {a.steps} steps, {a.rounds} rounds\n")
    print("| step, 22.3M values | multihead | PyTorch default | `foreach=True` | `fused=True` |")
    print("| --- | --- | --- | --- | --- |")
    for (dtype, ams), r in rows.items():
        name = dtype + (", `amsgrad`" if ams else "")
        print(f"| {name} | {span(r['ours'])} | {span(r['default'])} | {span(r['foreach'])} | {span(r['fused'])} |")


if __name__ == "__main__":
    main()
