#!/usr/bin/env python3
"""Small models and ViT shapes side by side: PyTorch against multihead.

    python3 tools/bench_small.py            # the BENCHMARKS.md rows (a few minutes)
    python3 tools/bench_small.py --quick    # fewer iterations

Cases (2 threads unless ``--threads``):

* the small ViT of ``tools/port_vit.py`` (torchvision ``VisionTransformer(image_size=32,
  patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128)``), eval forward at
  batch 64 under ``torch.no_grad()``, against the Rust port ``examples/port_vit.rs`` (its
  ``TransformerEncoderLayer`` variant and its hand-written block; ``PORT_VIT_ITERS`` forwards,
  fastest); and its training step at batch 64 (forward, ``F.cross_entropy``, backward and a
  ``torch.optim.AdamW`` step, default settings but lr 1e-3) against the port's
  (``multihead::optim::AdamW``, the step inside ``multihead::on_pool``);
* ``nn.MultiheadAttention(64, 4, batch_first=True)`` eval forward and
  ``nn.TransformerEncoderLayer(64, 4, 128, gelu, norm_first=True, eps=1e-6)`` eval forward at
  (B, L) = (64, 17) and (1, 17), and that layer's training step (forward and backward) at
  (64, 17), against ``multihead bench --module mha|encoder-layer --norm-first``;
* a ViT-B/16 encoder layer, ``nn.TransformerEncoderLayer(768, 12, 3072, gelu, norm_first=True,
  eps=1e-6)`` at B=8, L=197: eval forward and train forward+backward (``out.sum().backward()``);
* small bf16 training steps (bf16 modules and inputs, the loss the output's sum in f32):
  ``nn.MultiheadAttention`` at (B, L, E) = (2, 32, 32) and (4, 128, 128), and the pre-norm
  encoder layer at (2, 32, 32), against ``multihead bench --dtype bf16 --backward``.

PyTorch runs in this process with ``torch.set_num_threads(T)`` (its fast path allowed in eval);
multihead runs ``target/release/multihead bench ... --json`` and
``target/release/examples/port_vit``. Fastest time after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import bench_proc

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "target/release/multihead"
PORT = REPO / "target/release/examples/port_vit"
# The port's two variants: (name in its output, label).
PORTS = (("encoder_layer", "ViT port (TransformerEncoderLayer + KeyMap)"),
         ("hand_written", "ViT port (hand-written EncoderBlock)"))
# (label, module, B, L, E, H, F, backward, dtype, speed-up target)
CASES = [
    ("MHA eval, B=64 L=17 E=64 H=4", "mha", 64, 17, 64, 4, 128, False, "f32", 1.2),
    ("MHA eval, B=1 L=17 E=64 H=4", "mha", 1, 17, 64, 4, 128, False, "f32", 1.2),
    ("encoder layer eval (pre-norm, gelu), B=64 L=17 E=64 H=4 F=128",
     "encoder-layer", 64, 17, 64, 4, 128, False, "f32", 1.2),
    ("encoder layer eval (pre-norm, gelu), B=1 L=17 E=64 H=4 F=128",
     "encoder-layer", 1, 17, 64, 4, 128, False, "f32", 1.2),
    ("encoder layer train fwd+bwd (pre-norm, gelu), B=64 L=17 E=64 H=4 F=128",
     "encoder-layer", 64, 17, 64, 4, 128, True, "f32", 1.2),
    ("ViT-B/16 encoder layer eval, B=8 L=197 E=768 H=12 F=3072",
     "encoder-layer", 8, 197, 768, 12, 3072, False, "f32", 1.2),
    ("ViT-B/16 encoder layer train fwd+bwd, B=8 L=197 E=768 H=12 F=3072",
     "encoder-layer", 8, 197, 768, 12, 3072, True, "f32", 1.2),
    # Small bf16 training steps (a bf16 module and input; the loss is the output's sum in f32).
    ("MHA bf16 train fwd+bwd, B=2 L=32 E=32 H=4", "mha", 2, 32, 32, 4, 64, True, "bf16", 1.2),
    ("MHA bf16 train fwd+bwd, B=4 L=128 E=128 H=8", "mha", 4, 128, 128, 8, 512, True, "bf16",
     1.2),
    ("encoder layer bf16 train fwd+bwd (pre-norm, gelu), B=2 L=32 E=32 H=4 F=64",
     "encoder-layer", 2, 32, 32, 4, 64, True, "bf16", 1.2),
]


def iters_for(b, l, e, quick):
    small = b * l * e < 200_000
    if quick:
        return (5, 20) if small else (1, 3)
    return (20, 300) if small else (2, 8)


def torch_case(torch, module, b, l, e, h, f, backward, dtype, warmup, iters):
    torch.manual_seed(0)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    x = torch.randn(b, l, e, dtype=dt)
    if module == "mha":
        m = torch.nn.MultiheadAttention(e, h, batch_first=True, dtype=dt, dropout=0.0)
        if backward:
            return train_step(torch, m, lambda xg: m(xg, xg, xg, need_weights=False)[0], x,
                              warmup, iters)
        m.eval()
        with torch.no_grad():
            return bench_proc.timed(lambda: m(x, x, x, need_weights=False), warmup, iters)[0]
    layer = torch.nn.TransformerEncoderLayer(e, h, f, dropout=0.0, activation="gelu",
                                             layer_norm_eps=1e-6, batch_first=True,
                                             norm_first=True, dtype=dt)
    if backward:
        return train_step(torch, layer, layer, x, warmup, iters)
    layer.eval()
    with torch.no_grad():
        return bench_proc.timed(lambda: layer(x), warmup, iters)[0]


def train_step(torch, module, forward, x, warmup, iters):
    """Forward and backward from the output's sum accumulated in f32 (as `multihead bench
    --backward` starts it), the input's and every parameter's gradient."""
    xg = x.clone().requires_grad_(True)

    def step():
        module.zero_grad(set_to_none=True)
        xg.grad = None
        forward(xg).sum(dtype=torch.float32).backward()

    return bench_proc.timed(step, warmup, iters)[0]


def rust_case(module, b, l, e, h, f, backward, dtype, threads, warmup, iters):
    cmd = [str(BIN), "bench", "--module", module, "--batch", str(b), "--tgt-len", str(l),
           "--src-len", str(l), "--embed-dim", str(e), "--num-heads", str(h),
           "--dim-feedforward", str(f), "--activation", "gelu", "--threads", str(threads),
           "--warmup", str(warmup), "--iters", str(iters), "--dtype", dtype, "--json"]
    if module == "encoder-layer":
        cmd.append("--norm-first")
        cmd.append("--backward" if backward else "--eval")
    elif backward:
        cmd.append("--backward")
    bench_proc.settle()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])["min_ms"]


def vit_rows(torch, threads, quick):
    sys.path.insert(0, str(REPO / "tools"))
    from port_vit import build_model

    warmup, iters = (5, 20) if quick else (20, 300)
    m = build_model().eval()
    x = torch.randn(64, 3, 32, 32)
    with torch.no_grad():
        ours_torch = bench_proc.timed(lambda: m(x), warmup, iters)[0]
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    labels = torch.arange(64) % 10

    def train_step():
        loss = torch.nn.functional.cross_entropy(m(x), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()

    train_torch = bench_proc.timed(train_step, warmup, iters)[0]
    env = dict(os.environ, PORT_VIT_ITERS=str(iters), RAYON_NUM_THREADS=str(threads))
    res = subprocess.run([str(PORT)], capture_output=True, text=True, cwd=REPO, check=True,
                         env=env)
    found = dict(re.findall(r"^(\w+): eval forward, batch 64: ([0-9.]+) ms", res.stdout, re.M))
    trained = dict(re.findall(r"^(\w+): train step \([^)]*\), batch 64: ([0-9.]+) ms",
                              res.stdout, re.M))
    rows = []
    for what, torch_ms, ours in (("eval", ours_torch, found),
                                 ("train step with AdamW", train_torch, trained)):
        for name, label in PORTS:
            rows.append({"label": f"{label}, {what}, batch 64", "torch": torch_ms,
                         "ours": float(ours[name]), "target": 1.2})
    return rows


def report_lines(doc):
    lines = [
        f"## Small models and ViT shapes, {doc['threads']} threads\n",
        "Command: `python3 tools/bench_small.py` (run by `tools/bench_torch.py --sections "
        "small`). The ViT port is `crates/multihead/examples/port_vit.rs` against torchvision's "
        "`VisionTransformer` of `tools/port_vit.py` (eval, batch 64, sequence 17, width 64); the "
        "layer rows are `nn.MultiheadAttention` / `nn.TransformerEncoderLayer(norm_first=True, "
        "gelu, eps=1e-6)` against `multihead bench --module mha|encoder-layer --norm-first`. "
        "PyTorch eval rows run under `torch.no_grad()` with its fast path allowed.\n",
        "| case | PyTorch | multihead | speed-up | target |",
        "|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(f"| {r['label']} | {r['torch']:.3f} ms | {r['ours']:.3f} ms | "
                     f"{r['torch'] / r['ours']:.2f}x | ≥{r['target']:.1f}x |")
    lines.append("")
    return lines


def evaluate_targets(doc):
    out = []
    for r in doc["rows"]:
        got = r["torch"] / r["ours"]
        out.append({"target": "small models vs PyTorch (x)", "case": r["label"],
                    "measured": f"{got:.2f}", "required": f"{r['target']:.2f}",
                    "met": got >= r["target"],
                    "verdict": "met" if got >= r["target"] else "not met"})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json-out", type=Path, default=REPO / "target/bench_small.json")
    opts = ap.parse_args()
    import torch

    torch.set_num_threads(opts.threads)
    for exe, how in ((BIN, "cargo build --release -p multihead-cli"),
                     (PORT, "cargo build --release -p multihead --example port_vit")):
        if not exe.exists():
            sys.exit(f"build it first: {how} ({exe})")
    rows = vit_rows(torch, opts.threads, opts.quick)
    for label, module, b, l, e, h, f, backward, dtype, target in CASES:
        warmup, iters = iters_for(b, l, e, opts.quick)
        row = {"label": label, "target": target}
        row["torch"] = torch_case(torch, module, b, l, e, h, f, backward, dtype, warmup, iters)
        row["ours"] = rust_case(module, b, l, e, h, f, backward, dtype, opts.threads, warmup,
                                iters)
        rows.append(row)
        print(f"{label}: torch {row['torch']:.3f} ms, multihead {row['ours']:.3f} ms",
              file=sys.stderr, flush=True)
    doc = {"threads": opts.threads, "torch_version": torch.__version__, "quick": opts.quick,
           "rows": rows}
    bench_proc.finish(doc, opts.json_out, report_lines, evaluate_targets)


if __name__ == "__main__":
    main()
