#!/usr/bin/env python3
"""GEMM side by side: PyTorch's ``nn.Linear`` against ``multihead bench --module linear``, f32
and bf16, forward and forward+backward.

    python3 tools/bench_linear.py            # the BENCHMARKS.md rows (a few minutes)
    python3 tools/bench_linear.py --quick    # fewer iterations

Cases: ``nn.Linear(E, F)`` (with a bias) on ``x = randn(B, L, E)``, B=8, L=512, at 512 -> 2048
and 2048 -> 512 (a feed-forward block's two products), in f32 and bf16:

* forward: ``torch.no_grad()`` (multihead: ``no_grad``);
* forward+backward: ``x`` requires grad, ``lin(x).sum().backward()`` (the gradients of x, the
  weight and the bias; reset to None outside the timed region). multihead's backward starts from
  the output's sum accumulated in f32, as PyTorch's ``sum`` of a bf16 tensor accumulates.

PyTorch runs in this process with ``torch.set_num_threads(T)``; multihead runs
``target/release/multihead bench --module linear ... --json``. Fastest of 10 calls after 3
warm-ups (40 after 12 for the cheaper bf16 rows; both libraries alike).
GFLOP/s are ``2·B·L·E·F`` (three times that with the backward) over the time, given as a share
of the machine's peak: f32 rows of the f32 FMA peak, bf16 rows of its best bf16 peak (AMX tiles
where ``peak.c`` measured them, else ``vdpbf16ps``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import bench_proc

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "target/release/multihead"
B, L = 8, 512
SHAPES = [(512, 2048), (2048, 512)]
# (dtype, mode, speed-up target over PyTorch, share-of-peak target (None: none)); the shares
# are of the f32 peak for f32 rows and of the AMX peak for bf16 rows (on AMX CPUs only).
TARGETS = {
    ("f32", "forward"): (1.1, 0.80),
    ("f32", "forward+backward"): (1.1, None),
    ("bf16", "forward"): (1.3, 0.40),
    ("bf16", "forward+backward"): (1.2, None),
}


def flops(e, f, backward):
    return 2.0 * B * L * e * f * (3 if backward else 1)


def torch_case(torch, dtype, e, f, backward, warmup, iters):
    torch.manual_seed(0)
    lin = torch.nn.Linear(e, f).to(dtype)
    x = torch.randn(B, L, e, dtype=dtype)
    if backward:
        xg = x.clone().requires_grad_(True)

        def step():
            lin.zero_grad(set_to_none=True)
            xg.grad = None
            lin(xg).sum().backward()

        return bench_proc.timed(step, warmup, iters)[0]
    with torch.no_grad():
        return bench_proc.timed(lambda: lin(x), warmup, iters)[0]


def rust_json(dtype, e, f, backward, threads, warmup, iters, env_extra=None):
    cmd = [str(BIN), "bench", "--module", "linear", "--dtype", dtype, "--batch", str(B),
           "--tgt-len", str(L), "--embed-dim", str(e), "--dim-feedforward", str(f),
           "--threads", str(threads), "--warmup", str(warmup), "--iters", str(iters), "--json"]
    if backward:
        cmd.append("--backward")
    env = dict(os.environ)
    env.update(env_extra or {})
    bench_proc.settle()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


def peak_for(doc, dtype):
    """(GFLOP/s, name) of the peak a row is measured against."""
    if dtype == "f32":
        return doc.get("f32_peak"), "f32 FMA"
    if doc.get("amx_peak"):
        return doc["amx_peak"], "AMX"
    return doc.get("bf16_peak"), "vdpbf16ps"


def report_lines(doc):
    f32p, bfp, amxp = doc.get("f32_peak"), doc.get("bf16_peak"), doc.get("amx_peak")
    peaks = ", ".join(f"{name} {v:.0f} GFLOP/s" for name, v in
                      (("f32 FMA", f32p), ("vdpbf16ps", bfp), ("AMX", amxp)) if v)
    kernels = sorted({r.get("bf16_kernel") for r in doc["rows"] if r["dtype"] == "bf16"} - {None})
    lines = [
        f"## GEMM: `nn.Linear` (B={B}, L={L}), {doc['threads']} threads\n",
        "Command: `python3 tools/bench_linear.py` (run by `tools/bench_torch.py --sections gemm`). "
        "PyTorch's `nn.Linear(E, F)` against `multihead bench --module linear --embed-dim E "
        "--dim-feedforward F --dtype D [--backward]`; forward under `no_grad`, forward+backward "
        "from the output's sum (dx, dW, db). GFLOP/s are the products' flops over multihead's "
        "time, as a share of the machine's peak for the dtype (`peak.c`: "
        f"{peaks or 'not measured'}; bf16 rows against AMX where measured). multihead's bf16 "
        f"products ran on: {', '.join(kernels) or 'n/a'}.\n",
        "| dtype | E -> F | mode | PyTorch | multihead | speed-up | multihead GFLOP/s (share of peak) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        g = r["flops"] / (r["ours"] * 1e-3) / 1e9
        peak, name = peak_for(doc, r["dtype"])
        share = f" ({100 * g / peak:.0f}% of {name})" if peak else ""
        lines.append(f"| {r['dtype']} | {r['e']} -> {r['f']} | {r['mode']} | {r['torch']:.1f} ms "
                     f"| {r['ours']:.1f} ms | {r['torch'] / r['ours']:.2f}x | {g:.0f}{share} |")
    lines.append("")
    return lines


def evaluate_targets(doc):
    out = []
    for r in doc["rows"]:
        speed, share = TARGETS[(r["dtype"], r["mode"])]
        case = f"{r['dtype']} {r['e']}->{r['f']} {r['mode']}"
        got = r["torch"] / r["ours"]
        out.append({"target": "nn.Linear vs PyTorch (x)", "case": case, "measured": f"{got:.2f}",
                    "required": f"{speed:.2f}", "met": got >= speed,
                    "verdict": "met" if got >= speed else "not met"})
        if share is None:
            continue
        peak, name = peak_for(doc, r["dtype"])
        if r["dtype"] == "bf16" and name != "AMX":
            continue  # the bf16 share target is of the AMX peak: only on AMX CPUs
        if not peak:
            continue
        s = r["flops"] / (r["ours"] * 1e-3) / 1e9 / peak
        out.append({"target": f"nn.Linear share of the {name} peak", "case": case,
                    "measured": f"{100 * s:.0f}%", "required": f"{100 * share:.0f}%",
                    "met": s >= share, "verdict": "met" if s >= share else "not met"})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--f32-peak", type=float, default=None)
    ap.add_argument("--bf16-peak", type=float, default=None)
    ap.add_argument("--amx-peak", type=float, default=None)
    ap.add_argument("--json-out", type=Path, default=REPO / "target/bench_linear.json")
    opts = ap.parse_args()
    import torch

    torch.set_num_threads(opts.threads)
    if not BIN.exists():
        sys.exit(f"build the binary first: cargo build --release -p multihead-cli ({BIN})")
    rows = []
    for dtype in ("f32", "bf16"):
        tdt = torch.float32 if dtype == "f32" else torch.bfloat16
        # bf16 calls take a tenth of f32's: four times the calls (still under a second each),
        # whose minimum moves less with this VM's swings than ten calls' did.
        scale = 4 if dtype == "bf16" and not opts.quick else 1
        warmup, iters = (1, 2) if opts.quick else (3 * scale, 10 * scale)
        for e, f in SHAPES:
            for backward in (False, True):
                mode = "forward+backward" if backward else "forward"
                row = {"dtype": dtype, "e": e, "f": f, "mode": mode,
                       "flops": flops(e, f, backward)}
                row["torch"] = torch_case(torch, tdt, e, f, backward, warmup, iters)
                res = rust_json(dtype, e, f, backward, opts.threads, warmup, iters)
                row["ours"] = res["min_ms"]
                row["bf16_kernel"] = res.get("bf16_kernel")
                rows.append(row)
                print(f"{dtype} {e}->{f} {mode}: torch {row['torch']:.1f} ms, multihead "
                      f"{row['ours']:.1f} ms", file=sys.stderr, flush=True)
    doc = {"threads": opts.threads, "torch_version": torch.__version__, "quick": opts.quick,
           "f32_peak": opts.f32_peak, "bf16_peak": opts.bf16_peak, "amx_peak": opts.amx_peak,
           "rows": rows}
    bench_proc.finish(doc, opts.json_out, report_lines, evaluate_targets)


if __name__ == "__main__":
    main()
