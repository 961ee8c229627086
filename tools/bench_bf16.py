#!/usr/bin/env python3
"""bfloat16 side by side: PyTorch bf16 against ``multihead bench --dtype bf16``, and each against
its own f32.

    python3 tools/bench_bf16.py            # the BENCHMARKS.md rows (a few minutes)
    python3 tools/bench_bf16.py --quick    # fewer iterations

Cases (B=8, L=S=512, E=512, H=8; layers d_model 512, nhead 8, dim_feedforward 2048, gelu,
dropout 0, batch_first):

* MHA forward (``need_weights=False``, eval under ``torch.inference_mode()``; multihead
  ``no_grad``), MHA causal forward, MHA forward+backward (``out.sum().backward()`` with the input
  requiring grad);
* ``TransformerEncoderLayer`` train forward+backward and eval forward (``torch.no_grad()``);
* ``TransformerDecoderLayer`` train forward+backward over a memory of S = L tokens (the target
  and the memory require grad, as the Rust bench's ``Var`` inputs);
* ``F.scaled_dot_product_attention`` forward on ``(B, H, L, E/H)``, plain and causal, under
  ``torch.inference_mode()`` (multihead ``bench --module sdpa``, without a gradient).

PyTorch runs in this process with ``torch.set_num_threads(T)``; multihead runs
``target/release/multihead bench ... --dtype bf16 --json`` (and ``--dtype f32`` for its own
ratio). Fastest time of the runs after warm-up. GFLOP/s use the model flops of
``crates/multihead-cli/src/bench.rs`` and are given as a share of the machine's bf16 peak
(``--bf16-peak``, from ``peak.c``), as the issue asks.
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
B, L, E, H, F = 8, 512, 512, 8, 2048
CASES = [  # (label, module, flags)
    ("MHA forward", "mha", []),
    ("MHA causal forward", "mha", ["--causal"]),
    ("MHA forward+backward", "mha", ["--backward"]),
    ("encoder layer train fwd+bwd, gelu", "encoder-layer", ["--backward"]),
    ("encoder layer eval forward, gelu", "encoder-layer", ["--eval"]),
    ("decoder layer train fwd+bwd, gelu", "decoder-layer", ["--backward"]),
    ("SDPA forward", "sdpa", []),
    ("SDPA causal forward", "sdpa", ["--causal"]),
]


def flops(module, flags):
    if module == "sdpa":  # F.scaled_dot_product_attention on (B, H, L, E/H): two products
        return 4 * B * L * L * E * (0.5 if "--causal" in flags else 1)
    attn = 2 * E * E * (4 * B * L) + 4 * B * L * L * E * (0.5 if "--causal" in flags else 1)
    if module == "decoder-layer":  # self-attention plus cross-attention over S = L
        attn = 2 * attn
    fwd = attn + (4 * B * L * E * F if module.endswith("-layer") else 0)
    return fwd * (3 if "--backward" in flags else 1)


def torch_case(torch, dtype, module, flags, warmup, iters):
    torch.manual_seed(0)
    x = torch.randn(B, L, E, dtype=dtype)
    backward, causal = "--backward" in flags, "--causal" in flags
    if module == "sdpa":
        q, k, v = (torch.randn(B, H, L, E // H, dtype=dtype) for _ in range(3))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with torch.inference_mode():
            return bench_proc.timed(lambda: sdpa(q, k, v, is_causal=causal), warmup, iters)[0]
    if module == "mha":
        m = torch.nn.MultiheadAttention(E, H, batch_first=True).to(dtype)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype) if causal else None
        if backward:
            xg = x.clone().requires_grad_(True)
            return bench_proc.timed(lambda: m(xg, xg, xg, need_weights=False)[0].sum().backward(),
                                   warmup, iters)[0]
        m.eval()
        with torch.inference_mode():
            return bench_proc.timed(
                lambda: m(x, x, x, need_weights=False, attn_mask=mask, is_causal=causal),
                warmup, iters)[0]
    if module == "decoder-layer":
        layer = torch.nn.TransformerDecoderLayer(E, H, F, dropout=0.0, activation="gelu",
                                                 batch_first=True).to(dtype)
        # As the Rust bench, whose target and memory are Vars: both get gradients.
        xg = x.clone().requires_grad_(True)
        mem = torch.randn(B, L, E, dtype=dtype).requires_grad_(True)
        return bench_proc.timed(lambda: layer(xg, mem).sum().backward(), warmup, iters)[0]
    layer = torch.nn.TransformerEncoderLayer(E, H, F, dropout=0.0, activation="gelu",
                                             batch_first=True).to(dtype)
    if backward:
        xg = x.clone().requires_grad_(True)
        return bench_proc.timed(lambda: layer(xg).sum().backward(), warmup, iters)[0]
    layer.eval()
    with torch.no_grad():
        return bench_proc.timed(lambda: layer(x), warmup, iters)[0]


def rust_case(dtype, module, flags, threads, warmup, iters, products=None):
    """multihead's fastest time; ``products`` (``direct``/``widened``) sets
    ``MULTIHEAD_BF16_PRODUCTS`` (default: the binary's own choice)."""
    return rust_json(dtype, module, flags, threads, warmup, iters, products)["min_ms"]


def rust_json(dtype, module, flags, threads, warmup, iters, products=None):
    cmd = [str(BIN), "bench", "--module", module, "--dtype", dtype, "--batch", str(B),
           "--tgt-len", str(L), "--src-len", str(L), "--embed-dim", str(E), "--num-heads", str(H),
           "--dim-feedforward", str(F), "--activation", "gelu", "--threads", str(threads),
           "--warmup", str(warmup), "--iters", str(iters), "--json"] + flags
    env = dict(os.environ)
    if products:
        env["MULTIHEAD_BF16_PRODUCTS"] = products
    bench_proc.settle()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True, env=env)
    return json.loads(res.stdout.strip().splitlines()[-1])


def report_lines(doc):
    amx = doc.get("bf16_kernel") == "Amx"
    peak = doc.get("amx_peak") if amx and doc.get("amx_peak") else doc.get("bf16_peak")
    loop = "`tdpbf16ps` (AMX) loop" if amx and doc.get("amx_peak") else "`vdpbf16ps` loop"
    share_text = (f"as a share of the measured bf16 peak ({peak:.0f} GFLOP/s, `peak.c`'s "
                  f"{loop})" if peak else "(no bf16 peak was measured)")
    direct = bool(doc.get("bf16_products"))
    kernels = "AMX tiles (`tdpbf16ps`)" if amx else "AVX512-BF16 kernels"
    how = (f"multiplies bf16 operands on its {kernels} (projections: "
           "`multihead_kernels::bf16gemm`; attention: `AttnParams::bf16_products`), with f32 "
           "sums, as PyTorch's bf16 kernels do" if direct else
           "computes every bf16 operation in f32 (its f32 kernels) and rounds once per "
           "operation, or once per layer for the Transformer layers")
    lines = [
        f"## bfloat16, B={B} L=S={L} E={E} H={H} (layers: dim_feedforward {F}, gelu), "
        f"{doc['threads']} threads\n",
        "Command: `python3 tools/bench_bf16.py` (run by `tools/bench_torch.py --sections bf16`). "
        "PyTorch bf16 modules against `multihead bench --dtype bf16` on the same shapes; each "
        f"library's own f32 time for reference. On this CPU multihead {how}. GFLOP/s are "
        f"model flops over the bf16 time, {share_text}. A share above 100% means multihead's "
        "f32 FMAs outrun the machine's `vdpbf16ps` rate (on some CPUs, such as Intel's family 6 "
        "model 207 Xeon, `vdpbf16ps` runs at half the f32 FMA rate).\n",
        "multihead chooses between the two ways (`multihead::Bf16Products`: bf16 operands, or "
        "widened to f32) by itself, taking bf16 operands on AMX tiles where Linux grants them, "
        "else where the `vdpbf16ps` instruction outruns f32 FMA. This CPU's measured "
        f"`vdpbf16ps`/FMA rate is {doc.get('bf16_dot_speedup') or 0:.2f}"
        f"{' and AMX tiles are granted' if amx else ''}, so the default here is "
        f"{'direct' if direct else 'widened'} (`explain_bf16_products()`: "
        f"\"{doc.get('bf16_products_plan') or 'not recorded'}\"); the column \"direct products\" forces bf16 "
        "operands (`MULTIHEAD_BF16_PRODUCTS=direct`; in training the backward products go "
        f"direct too){', the default here' if direct else ''}.\n",
        "| case | PyTorch bf16 | PyTorch f32 | multihead bf16 | multihead f32 | bf16 speed-up "
        "| multihead bf16 GFLOP/s (share of bf16 peak) | multihead bf16, direct products |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        g = r["flops"] / (r["ours_bf16"] * 1e-3) / 1e9
        share = f" ({100 * g / peak:.0f}%)" if peak else ""
        lines.append(f"| {r['label']} | {r['torch_bf16']:.1f} ms | {r['torch_f32']:.1f} ms | "
                     f"{r['ours_bf16']:.1f} ms | {r['ours_f32']:.1f} ms | "
                     f"{r['torch_bf16'] / r['ours_bf16']:.2f}x | {g:.0f}{share} | "
                     f"{direct_cell(r, peak)} |")
    lines.append("")
    return lines


def direct_cell(r, peak):
    """The forced-direct time, its GFLOP/s and share of the bf16 peak, or n/a."""
    ms = r.get("ours_bf16_direct")
    if ms is None:
        return "n/a"
    g = r["flops"] / (ms * 1e-3) / 1e9
    share = f", {100 * g / peak:.0f}% of bf16 peak" if peak else ""
    return f"{ms:.1f} ms ({g:.0f} GFLOP/s{share})"


def evaluate_targets(doc):
    # Issue 22's targets.
    want = {"MHA forward": 1.5, "MHA causal forward": 1.5, "MHA forward+backward": 1.3,
            "encoder layer train fwd+bwd, gelu": 1.2, "encoder layer eval forward, gelu": 1.3,
            "decoder layer train fwd+bwd, gelu": 1.2}
    out = []
    for r in doc["rows"]:
        need = want.get(r["label"])
        if need is None:
            continue
        got = r["torch_bf16"] / r["ours_bf16"]
        met = got >= need
        out.append({"target": "bf16 vs PyTorch bf16 (x)", "case": r["label"],
                    "measured": f"{got:.2f}", "required": f"{need:.2f}", "met": met,
                    "verdict": "met" if met else "not met"})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bf16-peak", type=float, default=None)
    ap.add_argument("--amx-peak", type=float, default=None,
                    help="peak.c's amx_bf16: the bf16 shares are of it where AMX tiles ran")
    ap.add_argument("--json-out", type=Path, default=REPO / "target/bench_bf16.json")
    ap.add_argument("--iters", type=int, default=None,
                    help="timed calls per case and side (default 6; 2 with --quick): the VM's "
                         "run-to-run spread shrinks with more")
    ap.add_argument("--only", default=None,
                    help="run only the cases whose label contains this text (e.g. 'encoder')")
    opts = ap.parse_args()
    import torch

    torch.set_num_threads(opts.threads)
    if not BIN.exists():
        sys.exit(f"build the binary first: cargo build --release -p multihead-cli ({BIN})")
    warmup, iters = (1, 2) if opts.quick else (2, 6)
    iters = opts.iters or iters
    rows, choice = [], {}
    for label, module, flags in CASES:
        if opts.only and opts.only not in label:
            continue
        row = {"label": label, "flops": flops(module, flags)}
        row["torch_bf16"] = torch_case(torch, torch.bfloat16, module, flags, warmup, iters)
        row["torch_f32"] = torch_case(torch, torch.float32, module, flags, warmup, iters)
        first = rust_json("bf16", module, flags, opts.threads, warmup, iters)
        row["ours_bf16"] = first["min_ms"]
        choice["bf16_products"] = first.get("bf16_products")
        choice["bf16_dot_speedup"] = first.get("bf16_dot_speedup")
        choice["bf16_kernel"] = first.get("bf16_kernel")
        choice["bf16_products_plan"] = first.get("bf16_products_plan")
        row["ours_bf16_direct"] = rust_case("bf16", module, flags, opts.threads, warmup, iters,
                                            "direct")
        row["ours_f32"] = rust_case("f32", module, flags, opts.threads, warmup, iters)
        rows.append(row)
        print(f"{label}: torch bf16 {row['torch_bf16']:.1f} ms, multihead bf16 "
              f"{row['ours_bf16']:.1f} ms", file=sys.stderr, flush=True)
    doc = {"threads": opts.threads, "torch_version": torch.__version__, "quick": opts.quick,
           "bf16_peak": opts.bf16_peak, "amx_peak": opts.amx_peak, "rows": rows, **choice}
    bench_proc.finish(doc, opts.json_out, report_lines, evaluate_targets)


if __name__ == "__main__":
    main()
