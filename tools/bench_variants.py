#!/usr/bin/env python3
"""Attention variants side by side: multihead's fused variants against its own dense call and
against PyTorch given the equivalent explicit mask.

    python3 tools/bench_variants.py            # the BENCHMARKS.md rows (a few minutes)
    python3 tools/bench_variants.py --quick    # fewer iterations

Rows (2 threads unless ``--threads``; fastest time after warm-up):

* sliding window of 512 keys, causal, at B=1 H=8 L=S=8192 D=64, forward and forward+backward:
  ``multihead bench --module sdpa --causal --window 512`` against the same call without the
  window (dense causal: the target is ≥ 6x) and against PyTorch's
  ``F.scaled_dot_product_attention`` given the band as a bool ``attn_mask`` (target ≥ 5x);
* soft cap 50 (Gemma 2's) at B=8 H=8 L=S=512 D=64, forward and forward+backward: multihead
  with ``--softcap 50`` against the plain call (target: at most 15% slower); PyTorch has no
  soft-cap argument, so its row is the soft cap written out (``q@kᵀ``, ``tanh``, softmax,
  ``@v``) for reference;
* ALiBi (the paper's slopes) and attention sinks at the same shape, the same target; PyTorch's
  ALiBi row is SDPA given the bias as a float mask, its sink row gpt-oss's eager attention;
* a packed batch of 64 sequences (``--varlen``: lengths log-uniform in 16..512, mean ~150),
  H=8 D=64, forward and forward+backward, against the same sequences padded to the longest
  through our SDPA with key lengths (target: forward+backward ≥ 1.5x) and PyTorch's SDPA
  with a key padding mask;
* a learned ``(L, S)`` attention bias (a float ``attn_mask`` that requires grad, T5-style)
  through ``nn.MultiheadAttention`` at B=8 L=S=256 E=512 H=8, forward+backward:
  ``multihead bench --module mha --learned-mask --backward`` against the same call without
  the mask, against ``multihead --backend composed`` (where such a call ran before the fused
  path took it) and against PyTorch's MHA given the bias (which takes its math path).

``--only window,softcap,alibi,sinks,varlen,learned`` runs some of the sections.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import bench_proc

REPO = Path(__file__).resolve().parent.parent
BIN = REPO / "target/release/multihead"


def ours(b, h, l, d, threads, warmup, iters, backward, causal=False, window=None, softcap=None,
         alibi=False, sinks=False, varlen=False, padded=False):
    cmd = [str(BIN), "bench", "--module", "sdpa", "--batch", str(b), "--num-heads", str(h),
           "--tgt-len", str(l), "--src-len", str(l), "--embed-dim", str(h * d),
           "--threads", str(threads), "--warmup", str(warmup), "--iters", str(iters), "--json"]
    cmd += ["--causal"] if causal else []
    cmd += ["--window", str(window)] if window is not None else []
    cmd += ["--softcap", str(softcap)] if softcap is not None else []
    cmd += ["--alibi"] if alibi else []
    cmd += ["--sinks"] if sinks else []
    cmd += ["--varlen"] if varlen else []
    cmd += ["--padded"] if padded else []
    cmd += ["--backward"] if backward else []
    bench_proc.settle()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    assert varlen or rec["path"] == "Fused", rec
    return (rec["min_ms"], rec) if varlen else rec["min_ms"]


def ours_mha(b, l, e, h, threads, warmup, iters, learned, backend=None):
    cmd = [str(BIN)] + (["--backend", backend] if backend else [])
    cmd += ["bench", "--module", "mha", "--batch", str(b), "--num-heads", str(h),
            "--tgt-len", str(l), "--src-len", str(l), "--embed-dim", str(e), "--backward",
            "--threads", str(threads), "--warmup", str(warmup), "--iters", str(iters), "--json"]
    cmd += ["--learned-mask"] if learned else []
    bench_proc.settle()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    assert rec["path"] == ("Composed" if backend == "composed" else "Fused"), rec
    return rec["min_ms"]


def torch_mha_learned(torch, b, l, e, h, warmup, iters):
    """PyTorch's nn.MultiheadAttention (batch_first) with an (L, S) float attn_mask that
    requires grad, forward+backward of the output's sum."""
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(e, h, batch_first=True)
    x = torch.randn(b, l, e, requires_grad=True)
    bias = (torch.randn(l, l) * 0.5).requires_grad_()

    def step():
        x.grad = bias.grad = None
        m.zero_grad(set_to_none=True)
        m(x, x, x, attn_mask=bias, need_weights=False)[0].sum().backward()
    return bench_proc.timed(step, warmup, iters)[0]


def torch_padded(torch, lengths, h, d, warmup, iters, backward):
    """PyTorch's SDPA on the sequences padded to the longest, with the key padding as a bool
    mask (PyTorch's packed variable-length attention is CUDA-only)."""
    F = torch.nn.functional
    torch.manual_seed(0)
    b, m = len(lengths), max(lengths)
    q, k, v = (torch.randn(b, h, m, d, requires_grad=backward) for _ in range(3))
    keep = torch.arange(m).view(1, m) < torch.tensor(lengths).view(b, 1)
    mask = keep.view(b, 1, 1, m)

    def call():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    if backward:
        def step():
            q.grad = k.grad = v.grad = None
            call().sum().backward()
        return bench_proc.timed(step, warmup, iters)[0]
    with torch.no_grad():
        return bench_proc.timed(call, warmup, iters)[0]


def torch_sdpa(torch, b, h, l, d, warmup, iters, backward, mask=None, softcap=None,
               sinks=False):
    """PyTorch's SDPA (with `mask`), or a soft cap or sinks written out (gpt-oss's eager
    attention); ALiBi is SDPA given the bias as a float `mask`."""
    F = torch.nn.functional
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, l, d, requires_grad=backward) for _ in range(3))
    sink = torch.randn(h, requires_grad=backward)

    def call():
        s = (q @ k.transpose(-2, -1)) * d ** -0.5
        if softcap is not None:
            return torch.softmax(softcap * torch.tanh(s / softcap), -1) @ v
        if sinks:
            col = sink.reshape(1, -1, 1, 1).expand(b, -1, l, -1)
            combined = torch.cat([s, col], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            return torch.softmax(combined, dim=-1)[..., :-1] @ v
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    if backward:
        def step():
            q.grad = k.grad = v.grad = sink.grad = None
            call().sum().backward()
        return bench_proc.timed(step, warmup, iters)[0]
    with torch.no_grad():
        return bench_proc.timed(call, warmup, iters)[0]


def band(torch, l, w):
    """(L, L) bool, True = attend: causal with `w` keys before each query's own."""
    i = torch.arange(l).view(l, 1)
    j = torch.arange(l).view(1, l)
    return (j <= i) & (j >= i - w)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json-out", type=Path, default=REPO / "target/bench_variants.json")
    sections = ["window", "softcap", "alibi", "sinks", "varlen", "learned"]
    ap.add_argument("--only", default=",".join(sections),
                    help="comma-separated sections: " + ", ".join(sections))
    opts = ap.parse_args()
    only = set(opts.only.split(","))
    if not only <= set(sections):
        sys.exit(f"--only takes {', '.join(sections)}; got {opts.only}")
    import torch

    torch.set_num_threads(opts.threads)
    if not BIN.exists():
        sys.exit(f"build it first: cargo build --release -p multihead-cli ({BIN})")
    t = opts.threads
    rows = []
    long_it = (1, 2) if opts.quick else (1, 4)
    short_it = (2, 5) if opts.quick else (3, 20)
    b, h, l, d, w = 1, 8, 8192, 64, 512
    mask = band(torch, l, w)
    for backward in (False, True) if "window" in only else ():
        kind = "forward+backward" if backward else "forward"
        dense = ours(b, h, l, d, t, *long_it, backward, causal=True)
        win = ours(b, h, l, d, t, *long_it, backward, causal=True, window=w)
        tw = torch_sdpa(torch, b, h, l, d, *long_it, backward, mask=mask)
        label = f"sliding window {w}, causal, B={b} H={h} L=S={l} D={d}, {kind}"
        rows.append({"label": label, "ours": win, "dense": dense, "torch": tw,
                     "kind": "window"})
        print(f"{label}: ours {win:.1f} ms, dense causal {dense:.1f} ms, torch {tw:.1f} ms",
              file=sys.stderr, flush=True)
    b, h, l, d, c = 8, 8, 512, 64, 50.0
    for backward in (False, True) if "softcap" in only else ():
        kind = "forward+backward" if backward else "forward"
        plain = ours(b, h, l, d, t, *short_it, backward)
        capped = ours(b, h, l, d, t, *short_it, backward, softcap=c)
        tc = torch_sdpa(torch, b, h, l, d, *short_it, backward, softcap=c)
        label = f"soft cap {c:g}, B={b} H={h} L=S={l} D={d}, {kind}"
        rows.append({"label": label, "ours": capped, "dense": plain, "torch": tc,
                     "kind": "softcap"})
        print(f"{label}: ours {capped:.1f} ms, plain {plain:.1f} ms, torch {tc:.1f} ms",
              file=sys.stderr, flush=True)
    slopes = torch.tensor([2.0 ** (-8.0 * i / h) for i in range(1, h + 1)])
    pos = torch.arange(l)
    alibi_bias = -slopes.view(h, 1, 1) * (pos.view(l, 1) - pos.view(1, l)).abs()
    for name, flag in ((n, f) for n, f in (("ALiBi", "alibi"), ("sinks", "sinks")) if f in only):
        for backward in (False, True):
            kind = "forward+backward" if backward else "forward"
            plain = ours(b, h, l, d, t, *short_it, backward)
            var = ours(b, h, l, d, t, *short_it, backward, **{flag: True})
            extra = {"mask": alibi_bias} if flag == "alibi" else {"sinks": True}
            tv = torch_sdpa(torch, b, h, l, d, *short_it, backward, **extra)
            label = f"{name}, B={b} H={h} L=S={l} D={d}, {kind}"
            rows.append({"label": label, "ours": var, "dense": plain, "torch": tv, "kind": flag})
            print(f"{label}: ours {var:.1f} ms, plain {plain:.1f} ms, torch {tv:.1f} ms",
                  file=sys.stderr, flush=True)
    b, h, l, d = 64, 8, 512, 64
    for backward in (False, True) if "varlen" in only else ():
        kind = "forward+backward" if backward else "forward"
        packed, rec = ours(b, h, l, d, t, *short_it, backward, varlen=True)
        pad, _ = ours(b, h, l, d, t, *short_it, backward, varlen=True, padded=True)
        lengths = rec["lengths"]
        tp = torch_padded(torch, lengths, h, d, *short_it, backward)
        mean = sum(lengths) / len(lengths)
        label = (f"packed batch of {b} sequences, lengths {min(lengths)}-{max(lengths)} "
                 f"(mean {mean:.0f}), H={h} D={d}, {kind}")
        rows.append({"label": label, "ours": packed, "dense": pad, "torch": tp, "kind": "varlen"})
        print(f"{label}: ours {packed:.1f} ms, padded {pad:.1f} ms, torch padded {tp:.1f} ms",
              file=sys.stderr, flush=True)
    if "learned" in only:
        rows.append(learned_row(torch, t, short_it))
    doc = {"threads": t, "torch_version": torch.__version__, "quick": opts.quick, "rows": rows}
    bench_proc.finish(doc, opts.json_out, report_lines, evaluate_targets)


def learned_row(torch, t, its):
    """The learned-bias row: fused, the same call without the mask, composed, PyTorch."""
    b, l, e, h = 8, 256, 512, 8
    learned = ours_mha(b, l, e, h, t, *its, True)
    plain = ours_mha(b, l, e, h, t, *its, False)
    composed = ours_mha(b, l, e, h, t, *its, True, backend="composed")
    tl = torch_mha_learned(torch, b, l, e, h, *its)
    label = (f"learned (L, S) bias through MultiheadAttention, B={b} L=S={l} E={e} H={h}, "
             f"forward+backward (composed: {composed:.1f} ms)")
    print(f"{label}: ours {learned:.1f} ms, no mask {plain:.1f} ms, torch {tl:.1f} ms",
          file=sys.stderr, flush=True)
    return {"label": label, "ours": learned, "dense": plain, "torch": tl, "kind": "learned",
            "composed": composed}


def report_lines(doc):
    lines = [
        f"## Attention variants, {doc['threads']} threads\n",
        "Command: `python3 tools/bench_variants.py` (run by `tools/bench_torch.py --sections "
        "variants`). multihead rows are `multihead bench --module sdpa` with `--causal "
        "--window 512`, `--softcap 50`, `--alibi` or `--sinks`; \"ours, plain\" is the same "
        "call without the variant (dense causal for the window rows; for the packed rows, "
        "`--varlen` against `--varlen --padded`: the same sequences padded to the longest "
        "through SDPA with key lengths). PyTorch's packed rows are SDPA on the padded batch "
        "with a key padding mask (its variable-length attention is CUDA-only). "
        "PyTorch's window rows are "
        "`F.scaled_dot_product_attention` given the band as a bool mask, its ALiBi rows SDPA "
        "given the bias as a float mask; its soft-cap and sink rows are written out (PyTorch "
        "has no argument for them; the sinks as gpt-oss's eager attention), for reference. "
        "The learned-bias row is `multihead bench --module mha --learned-mask --backward` "
        "(\"plain\": without the mask; the label gives `multihead --backend composed`, where "
        "the call ran before) against PyTorch's `nn.MultiheadAttention` given the bias as an "
        "`attn_mask` that requires grad.\n",
        "| case | PyTorch | multihead, plain | multihead | vs plain | vs PyTorch |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        vs_plain = r["dense"] / r["ours"]
        lines.append(f"| {r['label']} | {r['torch']:.1f} ms | {r['dense']:.1f} ms | "
                     f"{r['ours']:.1f} ms | {vs_plain:.2f}x | {r['torch'] / r['ours']:.2f}x |")
    lines.append("")
    return lines


def evaluate_targets(doc):
    out = []
    for r in doc["rows"]:
        if r["kind"] == "window":
            checks = [("window vs our dense causal (x)", r["dense"] / r["ours"], 6.0),
                      ("window vs PyTorch band mask (x)", r["torch"] / r["ours"], 5.0)]
        elif r["kind"] == "learned":
            checks = [("learned bias, fused vs composed (x)", r["composed"] / r["ours"], 1.0)]
        elif r["kind"] == "varlen":
            if "backward" not in r["label"]:
                continue
            checks = [("packed vs our padded batch (x)", r["dense"] / r["ours"], 1.5)]
        else:
            what = {"softcap": "soft cap", "alibi": "ALiBi", "sinks": "sinks"}[r["kind"]]
            checks = [(f"{what} vs plain (x, at least)", r["dense"] / r["ours"], 1 / 1.15)]
        for name, got, need in checks:
            out.append({"target": name, "case": r["label"], "measured": f"{got:.2f}",
                        "required": f"{need:.2f}", "met": got >= need,
                        "verdict": "met" if got >= need else "not met"})
    return out


if __name__ == "__main__":
    main()
