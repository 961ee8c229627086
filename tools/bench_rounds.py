#!/usr/bin/env python3
"""The headline cases in alternating rounds: PyTorch, then multihead, case by case, N times.

    python3 tools/bench_rounds.py                 # 3 rounds, 2 threads (about 4 minutes)
    python3 tools/bench_rounds.py --rounds 5 --threads 1

`tools/bench_torch.py` runs each configuration once per library. On a shared VM whose second
core comes and goes, one such pair can read 20% off either way; alternating the two libraries
over several rounds and keeping each side's fastest call (and every round's ratio) shows which
differences survive. Cases (f32 unless said, PyTorch in this process with
``torch.set_num_threads(T)``, multihead through ``target/release/multihead bench --json``):

* ``nn.MultiheadAttention(512, 8, batch_first=True)`` at B=8, L=S=512: eval forward
  (``need_weights=False``) and training forward+backward of ``out.sum()``;
* ``nn.TransformerEncoderLayer(d, h, f, gelu, norm_first=True, eps=1e-6)``: (512, 8, 2048) at
  B=8 L=512 and the ViT-B/16 layer (768, 12, 3072) at B=8 L=197, eval and training;
* ``nn.Linear`` at B=8 L=512, 512->2048 and 2048->512, forward and forward+backward, and the
  bf16 512->2048 forward+backward.

Prints a Markdown table: each side's fastest time over all rounds, their ratio, and the ratio
of every round.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import bench_linear  # noqa: E402
import bench_proc  # noqa: E402
import bench_small  # noqa: E402

BIN = REPO / "target/release/multihead"
WARMUP, ITERS = 2, 6


def mha_train_torch(torch):
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(512, 8, batch_first=True)
    x = torch.randn(8, 512, 512, requires_grad=True)

    def step():
        m.zero_grad(set_to_none=True)
        x.grad = None
        m(x, x, x, need_weights=False)[0].sum().backward()

    return bench_proc.timed(step, WARMUP, ITERS)[0]


def ours(args, threads):
    cmd = [str(BIN), "bench", "--threads", str(threads), "--warmup", str(WARMUP),
           "--iters", str(ITERS), "--json"] + args
    bench_proc.settle()
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(res.stdout.strip().splitlines()[-1])["min_ms"]


def layer(b, l, e, h, f, backward):
    return ["--module", "encoder-layer", "--batch", str(b), "--tgt-len", str(l),
            "--src-len", str(l), "--embed-dim", str(e), "--num-heads", str(h),
            "--dim-feedforward", str(f), "--activation", "gelu", "--norm-first",
            "--backward" if backward else "--eval"]


def linear(e, f, dtype, backward):
    return (["--module", "linear", "--dtype", dtype, "--batch", "8", "--tgt-len", "512",
             "--embed-dim", str(e), "--dim-feedforward", str(f)]
            + (["--backward"] if backward else []))


def cases(torch):
    mha = ["--module", "mha", "--batch", "8", "--tgt-len", "512", "--src-len", "512",
           "--embed-dim", "512", "--num-heads", "8"]
    small = bench_small.torch_case
    lin = bench_linear.torch_case
    f32, bf16 = torch.float32, torch.bfloat16
    rows = [
        ("MHA eval forward, B=8 L=S=512 E=512 H=8",
         lambda: small(torch, "mha", 8, 512, 512, 8, 2048, False, WARMUP, ITERS), mha),
        ("MHA train forward+backward, B=8 L=S=512 E=512 H=8",
         lambda: mha_train_torch(torch), mha + ["--backward"]),
    ]
    for (name, b, l, e, h, f) in (("encoder layer (512, 8, 2048), B=8 L=512", 8, 512, 512, 8, 2048),
                                  ("ViT-B/16 encoder layer, B=8 L=197", 8, 197, 768, 12, 3072)):
        for backward in (False, True):
            mode = "train forward+backward" if backward else "eval forward"
            rows.append((f"{name}, {mode}",
                         (lambda b=b, l=l, e=e, h=h, f=f, bw=backward:
                          small(torch, "encoder-layer", b, l, e, h, f, bw, WARMUP, ITERS)),
                         layer(b, l, e, h, f, backward)))
    for (e, f) in ((512, 2048), (2048, 512)):
        for backward in (False, True):
            mode = "forward+backward" if backward else "forward"
            rows.append((f"nn.Linear f32 {e}->{f}, {mode}",
                         lambda e=e, f=f, bw=backward: lin(torch, f32, e, f, bw, WARMUP, ITERS),
                         linear(e, f, "f32", backward)))
    rows.append(("nn.Linear bf16 512->2048, forward+backward",
                 lambda: lin(torch, bf16, 512, 2048, True, WARMUP, ITERS),
                 linear(512, 2048, "bf16", True)))
    return rows


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    if not BIN.exists():
        sys.exit(f"{BIN} is missing: cargo build --release -p multihead-cli")
    import torch

    torch.set_num_threads(a.threads)
    rows = cases(torch)
    times = {name: ([], []) for name, _, _ in rows}
    for r in range(a.rounds):
        for name, torch_fn, args in rows:
            t, o = torch_fn(), ours(args, a.threads)
            times[name][0].append(t)
            times[name][1].append(o)
            print(f"round {r + 1}: {name}: PyTorch {t:.2f} ms, multihead {o:.2f} ms", flush=True)
    print(f"\n| case | PyTorch | multihead | speed-up | each round |")
    print("|---|---|---|---|---|")
    for name, _, _ in rows:
        t, o = times[name]
        each = ", ".join(f"{x / y:.2f}" for x, y in zip(t, o))
        print(f"| {name} | {min(t):.2f} ms | {min(o):.2f} ms | {min(t) / min(o):.2f}x | {each} |")


if __name__ == "__main__":
    main(sys.argv[1:])
