#!/usr/bin/env python3
"""Write seeded PyTorch golden *cases* for the multihead parity tests.

A case is a directory holding ``case.json`` and ``case.safetensors``; the layout is
fixed by the project's parity-case file contract (``docs/case-format.md``,
format_version 1). PyTorch is the reference: every number in a case is what PyTorch
computed.

Commands::

    python3 tools/gen_cases.py fixtures --out tests/fixtures/mha
    python3 tools/gen_cases.py fixtures --kind transformers --out tests/fixtures/transformer
        the fixed, named, committed sets (deterministic: fixed seeds, one thread);
        --kind picks the set (default mha)
    python3 tools/gen_cases.py random --count N --seed S --out DIR [--kinds KINDS]
        N random valid configurations, for cases the Rust port has never seen;
        KINDS is e.g. mha (default), transformers, encoder_layer,decoder, all
    python3 tools/gen_cases.py verify DIR [DIR ...]
        re-run every case found under DIR in PyTorch from its stored tensors and
        check the file contract and that every ``expect.*`` tensor reproduces

Module kinds: torch.nn.MultiheadAttention (mha) and the transformer modules
TransformerEncoderLayer (encoder_layer), TransformerDecoderLayer (decoder_layer),
TransformerEncoder (encoder), TransformerDecoder (decoder), Transformer (transformer).
Adding a module kind: write a ``make_case(cfg, out_dir)`` that builds the module from a
config dict, runs it and writes the case with ``write_case``; a ``replay(meta, tensors)``
and ``check_contract(meta, tensors)`` for ``verify``; fixture and random config
generators; and register them in ``MODULE_KINDS`` (and ``KIND_NAMES``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import warnings
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
MHA = "torch.nn.MultiheadAttention"

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
# The dtypes of a case's optional "autocast" key (docs/case-format.md §2).
AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.uint8: "uint8",
    torch.bool: "bool",
}

# Always both dtypes, whatever the case's own dtype is.
SUGGESTED_TOLERANCE = {
    "float32": {
        "forward": {"rtol": 1e-5, "atol": 1e-5},
        "grad": {"rtol": 1e-4, "atol": 1e-4},
    },
    "float64": {
        "forward": {"rtol": 1e-10, "atol": 1e-10},
        "grad": {"rtol": 1e-10, "atol": 1e-10},
    },
}
# Added to bfloat16 cases only. They are graded against their ref64.* tensors
# (docs/case-format.md §5); this is the fallback without them.
BF16_TOLERANCE = {
    "forward": {"rtol": 2e-2, "atol": 2e-2},
    "grad": {"rtol": 5e-2, "atol": 5e-2},
}

# The rule of bfloat16 cases: our error against the float64 reference is at most this many
# times PyTorch bfloat16's own error against it.
BF16_ERROR_FACTOR = 2.0


class SkipCase(Exception):
    """The drawn configuration is not a usable case (PyTorch raised, or NaN, ...)."""


# --------------------------------------------------------------------------------------
# Generic case writing / reading
# --------------------------------------------------------------------------------------


def seed_for(name: str) -> int:
    """A stable seed derived from the case name (independent of list order)."""
    return zlib.crc32(name.encode("utf-8")) & 0x7FFFFFFF


def store(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Tensor as stored in safetensors (bool -> uint8), plus its logical dtype name."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.uint8).contiguous(), "bool"
    return t.clone().contiguous(), DTYPE_NAMES[t.dtype]


def format_json(meta: dict) -> str:
    """Compact, diff-friendly JSON: one line per top-level key and per tensor entry."""

    def one(v):
        return json.dumps(v, separators=(", ", ": "))

    lines = []
    for key, val in meta.items():
        if key == "tensors":
            rows = [f"    {one(n)}: {one(info)}" for n, info in val.items()]
            lines.append(f'  "tensors": {{\n' + ",\n".join(rows) + "\n  }")
        else:
            lines.append(f"  {one(key)}: {one(val)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_case(out_dir: Path, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``case.json`` (meta plus the ``tensors`` table) and ``case.safetensors``.

    ``tensors`` maps contract names to tensors in their *logical* dtype; bool masks are
    converted to uint8 here. The directory is deleted and recreated.
    """
    stored: dict[str, torch.Tensor] = {}
    table: dict[str, dict] = {}
    for name, t in tensors.items():
        s, logical = store(t)
        stored[name] = s
        table[name] = {
            "shape": list(s.shape),
            "dtype": DTYPE_NAMES[s.dtype],
            "logical_dtype": logical,
        }
    meta = dict(meta)
    meta["tensors"] = table
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / "case.json").write_text(format_json(meta))
    save_file(stored, str(out_dir / "case.safetensors"))


def add_f64_reference(case_dir: Path, replay) -> None:
    """Adds ``ref64.<name>`` for every ``expect.<name>`` of a bfloat16 case: the same call in
    float64, from the case's own (bfloat16-rounded) parameters, inputs and upstream gradients,
    through the kind's PyTorch replay."""
    meta, tensors = load_case(case_dir)
    meta64 = json.loads(json.dumps(meta))
    meta64.pop("autocast", None)
    meta64["constructor"]["dtype"] = "float64"
    if isinstance(meta64["constructor"].get("layer"), dict):
        meta64["constructor"]["layer"]["dtype"] = "float64"
    t64 = {n: (t.to(torch.float64) if t.is_floating_point() else t) for n, t in tensors.items()}
    res = replay(meta64, t64)
    extra = {}
    for name in tensors:
        if name.startswith("expect."):
            key = name[len("expect."):]
            # A copy of its own: two results may share storage (both mask gradients of an
            # unbatched call), which safetensors refuses to write.
            extra[f"ref64.{key}"] = res[key].detach().to(torch.float64).clone()
    meta["suggested_tolerance"] = dict(meta["suggested_tolerance"], bfloat16=BF16_TOLERANCE)
    table = meta.pop("tensors")
    for name, t in extra.items():
        table[name] = {"shape": list(t.shape), "dtype": "float64", "logical_dtype": "float64"}
        tensors[name] = t.contiguous()
    meta["tensors"] = table
    (case_dir / "case.json").write_text(format_json(meta))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(case_dir / "case.safetensors"))


def finish_case(out_dir: Path | None, meta: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """Writes the case (unless ``out_dir`` is None, a trial run) and returns its meta with
    the tensor shapes, the return value of every kind's ``make_case``."""
    if out_dir is not None:
        write_case(out_dir, meta, tensors)
    meta["tensors"] = {n: list(t.shape) for n, t in tensors.items()}
    return meta


def load_case(case_dir: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    meta = json.loads((case_dir / "case.json").read_text())
    tensors = load_file(str(case_dir / "case.safetensors"))
    return meta, tensors


def logical(tensors: dict[str, torch.Tensor], meta: dict, name: str) -> torch.Tensor:
    """A stored tensor back in its logical dtype (uint8 masks -> bool)."""
    t = tensors[name]
    if meta["tensors"][name]["logical_dtype"] == "bool":
        return t != 0
    return t


def has_nan(ts) -> bool:
    return any(torch.isnan(t).any().item() for t in ts if t.is_floating_point())


# --------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention
# --------------------------------------------------------------------------------------
#
# Config dict (keys with defaults in MHA_DEFAULTS):
#   name, description, seed (optional: derived from name)
#   E, H, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first, dtype
#   training, grad_mode
#   L, S, N            N=None means unbatched (2-D inputs)
#   alias              "none" | "self" (q is k is v) | "kv" (k is v) | "kq" (k is q, v distinct)
#   need_weights, average_attn_weights, is_causal, weights_in_loss
#   attn_mask          None or {"type": "bool"|"float", "dims": 2|3,
#                                "pattern": "random"|"causal", "full_row": bool}
#   kpm                None or {"type": "bool"|"float", "full_row": bool}
#   (full_row: one query row, or one batch element, gets every user key masked.)

MHA_DEFAULTS = dict(
    E=6,
    H=2,
    dropout=0.0,
    bias=True,
    add_bias_kv=False,
    add_zero_attn=False,
    kdim=None,
    vdim=None,
    batch_first=False,
    dtype="float32",
    training=True,
    grad_mode=True,
    L=3,
    S=4,
    N=2,
    alias="none",
    need_weights=True,
    average_attn_weights=True,
    is_causal=False,
    weights_in_loss=False,
    attn_mask=None,
    kpm=None,
    mask_grad=False,  # float masks require grad (a learned bias): expect.grad.<mask> stored
    # One NaN in grad.output at this flat index (its NaN reaches every key's gradient): None
    # for none; -1 is the last batch element's last row (seq-first and batch-first alike).
    nan_grad_output=None,
)


def mha_full_config(cfg: dict) -> dict:
    c = dict(MHA_DEFAULTS)
    c.update(cfg)
    if c["alias"] == "self":
        c["S"] = c["L"]
    if c["alias"] == "kq":
        c["S"] = c["L"]
    if c.get("seed") is None:
        c["seed"] = seed_for(c["name"])
    return c


def _mask_blocked(c: dict, gen_bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Boolean "blocked" patterns for attn_mask ((L,S) or (N*H,L,S)) and kpm ((N,S)).

    Rows are repaired so that no (batch, head, query) row is fully blocked, then the
    requested full rows are applied.
    """
    L, S, H = c["L"], c["S"], c["H"]
    N = c["N"] if c["N"] is not None else 1
    am, kp = c["attn_mask"], c["kpm"]
    a = k = None
    if am is not None:
        shape = (L, S) if am["dims"] == 2 else (N * H, L, S)
        if am.get("pattern", "random") == "causal":
            a = torch.ones(L, S, dtype=torch.bool).triu(1)
            if am["dims"] == 3:
                a = a.expand(N * H, L, S).clone()
        else:
            a = gen_bool(shape, 0.3)
    if kp is not None:
        k = gen_bool((N, S), 0.3)

    # Repair fully blocked rows of the combined mask.
    while True:
        comb = torch.zeros(N, H, L, S, dtype=torch.bool)
        if a is not None:
            comb |= a.view(1, 1, L, S) if a.dim() == 2 else a.view(N, H, L, S)
        if k is not None:
            comb |= k.view(N, 1, 1, S)
        full = comb.all(-1).nonzero()
        if len(full) == 0:
            break
        b, h, l = (int(x) for x in full[0])
        s = int(torch.randint(0, S, (1,)))
        if a is not None:
            if a.dim() == 2:
                a[l, s] = False
            else:
                a[b * H + h, l, s] = False
        if k is not None:
            k[b, s] = False

    if am is not None and am.get("full_row"):
        if a.dim() == 2:
            a[L - 1, :] = True
        else:
            a[(N - 1) * H + (H - 1), 0, :] = True  # last batch element, last head, row 0
    if kp is not None and kp.get("full_row"):
        k[N - 1, :] = True
    return a, k


def _to_mask(blocked: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "bool":
        return blocked.clone()
    vals = torch.randn(blocked.shape, dtype=dtype)
    return vals.masked_fill(blocked, float("-inf"))


def mha_fast_path_expected(c: dict) -> bool:
    """Spec §2.7: would PyTorch take the native fast path for this config?"""
    float_mask = (c["attn_mask"] or {}).get("type") == "float" or (c["kpm"] or {}).get(
        "type"
    ) == "float"
    packed = c["kdim"] in (None, c["E"]) and c["vdim"] in (None, c["E"])
    return (
        not float_mask
        and torch.backends.mha.get_fastpath_enabled()
        and c["N"] is not None
        and c["alias"] == "self"
        and packed
        and not c["training"]
        and c["H"] % 2 == 0
        and c["batch_first"]
        and not c["add_bias_kv"]
        and not c["add_zero_attn"]
        and not c["grad_mode"]
        and c["bias"]
    )


class _FastPathSpy:
    """Records whether torch._native_multi_head_attention ran during the call."""

    def __enter__(self):
        self.hit = False
        self._orig = torch._native_multi_head_attention

        def spy(*a, **kw):
            self.hit = True
            return self._orig(*a, **kw)

        torch._native_multi_head_attention = spy
        return self

    def __exit__(self, *exc):
        torch._native_multi_head_attention = self._orig
        return False


def mha_constructor(c: dict) -> dict:
    return {
        "embed_dim": c["E"],
        "num_heads": c["H"],
        "dropout": c["dropout"],
        "bias": c["bias"],
        "add_bias_kv": c["add_bias_kv"],
        "add_zero_attn": c["add_zero_attn"],
        "kdim": c["kdim"],
        "vdim": c["vdim"],
        "batch_first": c["batch_first"],
        "dtype": c["dtype"],
    }


def mha_build(ctor: dict) -> torch.nn.MultiheadAttention:
    kw = dict(ctor)
    kw["dtype"] = DTYPES[kw["dtype"]]
    return torch.nn.MultiheadAttention(**kw)


def mha_call(mha, q, k, v, call: dict, attn_mask, kpm, grad_mode: bool, g, g_w):
    """Run the forward (and backward when grad_mode). Returns (out, weights, fast_hit)."""
    kwargs = dict(
        key_padding_mask=kpm,
        need_weights=call["need_weights"],
        attn_mask=attn_mask,
        average_attn_weights=call["average_attn_weights"],
        is_causal=call["is_causal"],
    )
    with warnings.catch_warnings():
        # mixed bool/float masks warn (deprecated but supported); keep the output quiet
        warnings.simplefilter("ignore", UserWarning)
        with _FastPathSpy() as spy:
            if grad_mode:
                out, w = mha(q, k, v, **kwargs)
            else:
                with torch.no_grad():
                    out, w = mha(q, k, v, **kwargs)
    if grad_mode:
        loss = (out * g).sum()
        if g_w is not None:
            loss = loss + (w * g_w).sum()
        loss.backward()
    return out, w, spy.hit


def mha_inputs_order(alias: str) -> list[str]:
    """Distinct float inputs for an aliasing mode (these get expect.grad.<arg>)."""
    return {
        "none": ["query", "key", "value"],
        "self": ["query"],
        "kv": ["query", "key"],
        "kq": ["query", "value"],
    }[alias]


def mha_aliasing(alias: str) -> dict:
    return {
        "key_is_query": alias in ("self", "kq"),
        "value_is_key": alias in ("self", "kv"),
    }


def alias_from_meta(aliasing: dict) -> str:
    kq, vk = aliasing["key_is_query"], aliasing["value_is_key"]
    if kq and vk:
        return "self"
    if vk:
        return "kv"
    if kq:
        return "kq"
    return "none"


def mha_describe(c: dict) -> str:
    """A one-line description for generated (random) configs."""
    parts = []
    packed = c["kdim"] in (None, c["E"]) and c["vdim"] in (None, c["E"])
    parts.append("packed" if packed else f"separate kdim={c['kdim']} vdim={c['vdim']}")
    parts.append({"none": "distinct q/k/v", "self": "self-attention", "kv": "key is value",
                  "kq": "key is query"}[c["alias"]])
    parts.append(f"E={c['E']} H={c['H']} L={c['L']} S={c['S']}")
    parts.append("unbatched" if c["N"] is None else f"N={c['N']}")
    if c["batch_first"]:
        parts.append("batch_first")
    if not c["bias"]:
        parts.append("no bias")
    if c["add_bias_kv"]:
        parts.append("add_bias_kv")
    if c["add_zero_attn"]:
        parts.append("add_zero_attn")
    am, kp = c["attn_mask"], c["kpm"]
    if am:
        parts.append(f"{am['type']} {am['dims']}-D attn_mask"
                     + (" (causal)" if am.get("pattern") == "causal" else "")
                     + (" with a fully masked row" if am.get("full_row") else ""))
    if kp:
        parts.append(f"{kp['type']} kpm" + (" with a fully padded batch element"
                                            if kp.get("full_row") else ""))
    if c["is_causal"]:
        parts.append("is_causal")
    parts.append(f"need_weights={c['need_weights']}")
    if c["need_weights"]:
        parts.append("averaged weights" if c["average_attn_weights"] else "per-head weights")
        if c["weights_in_loss"]:
            parts.append("weights in loss")
    if c["grad_mode"]:
        parts.append("training" if c["training"] else "eval with grad")
    else:
        parts.append("eval+no_grad")
    if c["dropout"]:
        parts.append(f"dropout={c['dropout']}")
    parts.append(c["dtype"])
    return ", ".join(parts)


def mha_make_case(cfg: dict, out_dir: Path | None, allow_nan: bool = False) -> dict:
    """Build nn.MultiheadAttention from a config, run it, and write the case.

    Returns the meta dict. Raises SkipCase when PyTorch raises or the result has NaN
    (unless allow_nan). With out_dir None nothing is written (used for trial runs).
    """
    c = mha_full_config(cfg)
    dtype = DTYPES[c["dtype"]]
    E, H, L, S, N = c["E"], c["H"], c["L"], c["S"], c["N"]
    alias = c["alias"]
    kdim = c["kdim"] if c["kdim"] is not None else E
    vdim = c["vdim"] if c["vdim"] is not None else E
    if alias == "self" and not (kdim == vdim == E and L == S):
        raise SkipCase("self-attention needs kdim == vdim == E and L == S")
    if alias == "kv" and kdim != vdim:
        raise SkipCase("key-is-value needs kdim == vdim")
    if alias == "kq" and not (kdim == E and L == S):
        raise SkipCase("key-is-query needs kdim == E and L == S")
    if c["grad_mode"] and c["training"] and c["dropout"] != 0.0:
        raise SkipCase("graded training cases use dropout 0")
    if not c["grad_mode"] and c["training"]:
        raise SkipCase("grad_mode false means eval mode")

    torch.manual_seed(c["seed"])
    ctor = mha_constructor(c)
    try:
        mha = mha_build(ctor)
    except (AssertionError, ValueError, RuntimeError) as e:
        raise SkipCase(f"constructor raised: {e}") from e
    with torch.no_grad():
        for p in (mha.in_proj_bias, mha.out_proj.bias):
            if p is not None:
                p.add_(torch.randn_like(p) * 0.1)
    mha.train(c["training"])

    def shape(seq, feat):
        if N is None:
            return (seq, feat)
        return (N, seq, feat) if c["batch_first"] else (seq, N, feat)

    q = torch.randn(shape(L, E), dtype=dtype)
    if alias == "self":
        k = v = q
    elif alias == "kv":
        k = torch.randn(shape(S, kdim), dtype=dtype)
        v = k
    elif alias == "kq":
        k = q
        v = torch.randn(shape(S, vdim), dtype=dtype)
    else:
        k = torch.randn(shape(S, kdim), dtype=dtype)
        v = torch.randn(shape(S, vdim), dtype=dtype)

    def gen_bool(shp, p):
        return torch.rand(shp) < p

    a_blk, k_blk = _mask_blocked(c, gen_bool)
    attn_mask = kpm = None
    if a_blk is not None:
        attn_mask = _to_mask(a_blk, c["attn_mask"]["type"], dtype)
    if k_blk is not None:
        kpm = _to_mask(k_blk, c["kpm"]["type"], dtype)
        if N is None:
            kpm = kpm.view(S)
    # for unbatched, a 3-D mask is (H,L,S), which is (N*H,L,S) with N=1: nothing to do
    learned = {}
    if c["mask_grad"] and c["grad_mode"]:
        for name, m in (("attn_mask", attn_mask), ("key_padding_mask", kpm)):
            if m is not None and m.dtype != torch.bool:
                learned[name] = m.detach().clone().requires_grad_(True)
        attn_mask = learned.get("attn_mask", attn_mask)
        kpm = learned.get("key_padding_mask", kpm)

    distinct = mha_inputs_order(alias)
    leaves = {"query": q, "key": k, "value": v}
    if c["grad_mode"]:
        for n in distinct:
            leaves[n].requires_grad_(True)

    call = {
        "need_weights": c["need_weights"],
        "average_attn_weights": c["average_attn_weights"],
        "is_causal": c["is_causal"],
        "attn_mask": c["attn_mask"]["type"] if c["attn_mask"] else None,
        "key_padding_mask": c["kpm"]["type"] if c["kpm"] else None,
    }
    # Upstream gradients, drawn before the call: g has the output shape, g_w the weights shape.
    out_shape = shape(L, E)
    g = torch.randn(out_shape, dtype=dtype) if c["grad_mode"] else None
    if g is not None and c["nan_grad_output"] is not None:
        g.view(-1)[c["nan_grad_output"]] = float("nan")
        allow_nan = True
    weights_in_loss = c["grad_mode"] and c["need_weights"] and c["weights_in_loss"]
    g_w = None
    if weights_in_loss:
        s_prime = S + int(c["add_bias_kv"]) + int(c["add_zero_attn"])
        wshape = (L, s_prime) if c["average_attn_weights"] else (H, L, s_prime)
        if N is not None:
            wshape = (N,) + wshape
        g_w = torch.randn(wshape, dtype=dtype)

    try:
        out, w, fast_hit = mha_call(mha, q, k, v, call, attn_mask, kpm, c["grad_mode"], g, g_w)
    except (AssertionError, RuntimeError, ValueError) as e:
        raise SkipCase(f"PyTorch raised: {type(e).__name__}: {e}") from e

    if fast_hit != mha_fast_path_expected(c):
        raise RuntimeError(f"{c['name']}: fast-path prediction wrong (hit={fast_hit})")
    if fast_hit and c["is_causal"]:
        # The fast path drops the is_causal hint (docs/pytorch-behaviour.md §4); not what the slow path does.
        raise SkipCase("is_causal on the fast path")

    tensors: dict[str, torch.Tensor] = {}
    for key, val in mha.state_dict().items():
        tensors[f"param.{key}"] = val
    tensors["input.query"] = q
    tensors["input.key"] = k
    tensors["input.value"] = v
    if attn_mask is not None:
        tensors["input.attn_mask"] = attn_mask
    if kpm is not None:
        tensors["input.key_padding_mask"] = kpm
    if c["grad_mode"]:
        tensors["grad.output"] = g
        if g_w is not None:
            tensors["grad.attn_weights"] = g_w
    tensors["expect.output"] = out
    if w is not None:
        tensors["expect.attn_weights"] = w
    if c["grad_mode"]:
        for n in distinct:
            tensors[f"expect.grad.{n}"] = leaves[n].grad
        params = dict(mha.named_parameters())
        for key in mha.state_dict().keys():
            tensors[f"expect.grad.param.{key}"] = params[key].grad
        for name, m in learned.items():
            # No gradient (the is_causal hint drops the mask): zeros, as the replay reports.
            tensors[f"expect.grad.{name}"] = (
                m.grad if m.grad is not None else torch.zeros_like(m.detach()))

    expects = [t for n, t in tensors.items() if n.startswith("expect.")]
    nan = has_nan(expects)
    if nan and not allow_nan:
        raise SkipCase("result contains NaN")

    if fast_hit:
        path = "fast (torch._native_multi_head_attention)"
    elif c["need_weights"]:
        path = "slow, explicit softmax (need_weights=True)"
    else:
        path = "slow, scaled_dot_product_attention (need_weights=False)"
    causal_applied = (
        c["is_causal"] and attn_mask is not None and kpm is None
        and not c["need_weights"] and not fast_hit
    )

    meta = {
        "format_version": FORMAT_VERSION,
        "module": MHA,
        "constructor": ctor,
        "training": c["training"],
        "grad_mode": c["grad_mode"],
        "call": call,
        "aliasing": mha_aliasing(alias),
        "suggested_tolerance": SUGGESTED_TOLERANCE,
        "seed": c["seed"],
        "torch_version": torch.__version__,
        "description": c.get("description") or mha_describe(c),
        "nan": nan,
        "pytorch_path": path,
        "is_causal_applied": causal_applied,
    }
    return finish_case(out_dir, meta, tensors)


def mha_expected_names(meta: dict) -> set[str]:
    """The tensor names the contract requires for an MHA case (params excluded)."""
    call, alias = meta["call"], alias_from_meta(meta["aliasing"])
    names = {"input.query", "input.key", "input.value", "expect.output"}
    if call["attn_mask"]:
        names.add("input.attn_mask")
    if call["key_padding_mask"]:
        names.add("input.key_padding_mask")
    if call["need_weights"]:
        names.add("expect.attn_weights")
    if meta["grad_mode"]:
        names.add("grad.output")
        names.update(f"expect.grad.{n}" for n in mha_inputs_order(alias))
    return names


def mha_replay(meta: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Re-run a stored MHA case in PyTorch. Returns results named like expect.* (minus prefix)."""
    mha = mha_build(meta["constructor"])
    params = {n[len("param."):]: t for n, t in tensors.items() if n.startswith("param.")}
    mha.load_state_dict(params, strict=True)
    mha.train(meta["training"])
    alias = alias_from_meta(meta["aliasing"])
    grad_mode = meta["grad_mode"]

    q = tensors["input.query"].clone()
    k = q if meta["aliasing"]["key_is_query"] else tensors["input.key"].clone()
    if meta["aliasing"]["value_is_key"]:
        v = k
    else:
        v = tensors["input.value"].clone()
    # aliased copies in the file must be bit-identical to what they alias
    if meta["aliasing"]["key_is_query"]:
        assert torch.equal(tensors["input.key"], tensors["input.query"]), "key != query"
    if meta["aliasing"]["value_is_key"]:
        assert torch.equal(tensors["input.value"], tensors["input.key"]), "value != key"
    leaves = {"query": q, "key": k, "value": v}
    if grad_mode:
        for n in mha_inputs_order(alias):
            leaves[n].requires_grad_(True)
    attn_mask = logical(tensors, meta, "input.attn_mask") if "input.attn_mask" in tensors else None
    kpm = (logical(tensors, meta, "input.key_padding_mask")
           if "input.key_padding_mask" in tensors else None)
    # Learned masks: those whose gradient the case stores.
    learned = {}
    for name, m in (("attn_mask", attn_mask), ("key_padding_mask", kpm)):
        if grad_mode and f"expect.grad.{name}" in tensors:
            learned[name] = m.detach().clone().requires_grad_(True)
    attn_mask = learned.get("attn_mask", attn_mask)
    kpm = learned.get("key_padding_mask", kpm)
    g = tensors.get("grad.output")
    g_w = tensors.get("grad.attn_weights")
    out, w, _ = mha_call(mha, q, k, v, meta["call"], attn_mask, kpm, grad_mode, g, g_w)
    res = {"output": out.detach()}
    if w is not None:
        res["attn_weights"] = w.detach()
    if grad_mode:
        for n in mha_inputs_order(alias):
            res[f"grad.{n}"] = leaves[n].grad
        named = dict(mha.named_parameters())
        for key in mha.state_dict().keys():
            res[f"grad.param.{key}"] = named[key].grad
        for name, m in learned.items():
            res[f"grad.{name}"] = m.grad if m.grad is not None else torch.zeros_like(m.detach())
    return res


def mha_check_contract(meta: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    errs = []
    ctor_keys = {"embed_dim", "num_heads", "dropout", "bias", "add_bias_kv", "add_zero_attn",
                 "kdim", "vdim", "batch_first", "dtype"}
    if set(meta["constructor"]) != ctor_keys:
        errs.append(f"constructor keys {sorted(meta['constructor'])}")
    call_keys = {"need_weights", "average_attn_weights", "is_causal", "attn_mask",
                 "key_padding_mask"}
    if set(meta["call"]) != call_keys:
        errs.append(f"call keys {sorted(meta['call'])}")
    mha = mha_build(meta["constructor"])
    want = mha_expected_names(meta)
    want.update(f"param.{k}" for k in mha.state_dict())
    if meta["grad_mode"]:
        want.update(f"expect.grad.param.{k}" for k in mha.state_dict())
        if "grad.attn_weights" in tensors:
            if not meta["call"]["need_weights"]:
                errs.append("grad.attn_weights without need_weights")
            want.add("grad.attn_weights")
        # A learned (float, requires-grad) mask stores its gradient.
        for m in ("attn_mask", "key_padding_mask"):
            if f"expect.grad.{m}" in tensors:
                if meta["call"][m] != "float":
                    errs.append(f"expect.grad.{m} for a mask that is not float")
                want.add(f"expect.grad.{m}")
    have = {n for n in tensors if not n.startswith("ref64.")}
    if have != want:
        errs.append(f"missing {sorted(want - have)}, unexpected {sorted(have - want)}")
    return errs


# --------------------------------------------------------------------------------------
# MHA fixture set (committed) and random configs
# --------------------------------------------------------------------------------------

F64 = {"dtype": "float64"}
EVAL = {"training": False, "grad_mode": False}


def _bm(dims=2, pattern="random", full_row=False):
    return {"type": "bool", "dims": dims, "pattern": pattern, "full_row": full_row}


def _fm(dims=2, pattern="random", full_row=False):
    return {"type": "float", "dims": dims, "pattern": pattern, "full_row": full_row}


def _bk(full_row=False):
    return {"type": "bool", "full_row": full_row}


def _fk(full_row=False):
    return {"type": "float", "full_row": full_row}


def mha_fixture_configs() -> list[dict]:
    C = []

    def add(name, desc, **kw):
        C.append(dict(name=name, description=desc, **kw))

    # --- layouts and aliasing (§2.5 step 5) ---
    add("packed_self_nomask_f32", "packed weights, self-attention (one fused in-projection), no mask",
        alias="self", L=5)
    add("packed_self_nomask_f64", "packed weights, self-attention, no mask, float64",
        alias="self", L=5, **F64)
    add("packed_kv_nomask_f32", "packed weights, key is value (q projected alone, k/v fused), L != S",
        alias="kv", L=4, S=5)
    add("packed_distinct_nomask_f32", "packed weights, distinct q/k/v (three chunked linears), L != S",
        L=4, S=6)
    add("packed_distinct_nomask_f64", "packed weights, distinct q/k/v, L != S, float64",
        L=5, S=3, **F64)
    add("packed_kq_nomask_f32", "packed weights, key is query but value distinct (three linears)",
        alias="kq", L=5)
    add("packed_explicit_kdim_vdim_eq_e_f32",
        "kdim == vdim == E passed explicitly keeps the packed layout; self-attention",
        alias="self", L=4, kdim=6, vdim=6)
    add("separate_kdim_vdim_f32", "separate q/k/v weights with kdim=5 != vdim=7, distinct inputs",
        kdim=5, vdim=7, L=4, S=6)
    add("separate_kdim_vdim_f64", "separate weights, kdim=3 != vdim=6, distinct inputs, float64",
        kdim=3, vdim=6, L=3, S=5, **F64)
    add("separate_kv_f32", "separate weights with kdim == vdim = 4 != E, key is value",
        kdim=4, vdim=4, alias="kv", L=4, S=5)
    add("separate_kq_vdim_f64", "separate weights (vdim=5 only), key is query, value distinct",
        vdim=5, alias="kq", L=4, **F64)
    add("separate_kdim_only_f32", "separate weights with only kdim=4 set (vdim = E)",
        kdim=4, L=3, S=5)
    add("separate_vdim_only_e12_f32", "separate weights with only vdim=5 set (kdim = E), E=12 H=4",
        E=12, H=4, vdim=5, L=3, S=4)

    # --- bias flag ---
    add("packed_nobias_self_f32", "bias=False (no in_proj_bias, no out_proj.bias), self-attention",
        bias=False, alias="self", L=5)
    add("packed_nobias_distinct_f64", "bias=False, packed, distinct inputs, float64",
        bias=False, L=3, S=4, **F64)
    add("separate_nobias_f32", "bias=False with separate weights kdim=3 vdim=5",
        bias=False, kdim=3, vdim=5)

    # --- add_bias_kv / add_zero_attn (§2.5 steps 7, 9) ---
    add("packed_bias_kv_f32", "add_bias_kv: bias_k/bias_v appended as an extra key position",
        add_bias_kv=True)
    add("packed_bias_kv_self_f64", "add_bias_kv with self-attention, float64",
        add_bias_kv=True, alias="self", L=4, **F64)
    add("packed_zero_attn_f32", "add_zero_attn: an all-zero key/value appended per head",
        add_zero_attn=True)
    add("packed_zero_attn_kv_f64", "add_zero_attn with key is value, float64",
        add_zero_attn=True, alias="kv", L=3, S=5, **F64)
    add("packed_bias_kv_zero_attn_f32", "add_bias_kv and add_zero_attn together (S' = S+2)",
        add_bias_kv=True, add_zero_attn=True, L=4, S=3)
    add("separate_bias_kv_zero_attn_f64",
        "add_bias_kv and add_zero_attn with separate weights kdim=5 vdim=3, float64",
        add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=3, **F64)
    add("packed_bias_kv_nobias_f32", "add_bias_kv with bias=False (state_dict has bias_k/v only)",
        add_bias_kv=True, bias=False, alias="self", L=4)
    add("bias_kv_kpm_all_masked_f32",
        "add_bias_kv with one batch element's user keys all padded: weight goes to bias_k (finite)",
        add_bias_kv=True, kpm=_bk(full_row=True))
    add("zero_attn_kpm_all_masked_f64",
        "add_zero_attn with one batch element's keys all padded (float kpm): attends zero key",
        add_zero_attn=True, kpm=_fk(full_row=True), **F64)
    add("bias_kv_zero_attn_attn_row_masked_per_head_f32",
        "add_bias_kv+add_zero_attn, a bool attn_mask row all True, per-head weights (finite)",
        add_bias_kv=True, add_zero_attn=True, attn_mask=_bm(full_row=True),
        average_attn_weights=False)

    # --- batch_first ---
    add("batch_first_self_f32", "batch_first=True, self-attention", batch_first=True,
        alias="self", L=5)
    add("batch_first_distinct_f64", "batch_first=True, distinct inputs, L != S, float64",
        batch_first=True, L=3, S=6, **F64)
    add("batch_first_separate_bool_kpm_f32",
        "batch_first=True, separate weights kdim=4 vdim=6, bool key_padding_mask",
        batch_first=True, kdim=4, vdim=6, kpm=_bk())
    add("batch_first_bias_kv_zero_attn_f32", "batch_first=True with add_bias_kv and add_zero_attn",
        batch_first=True, add_bias_kv=True, add_zero_attn=True, alias="kv", L=4, S=3)
    add("batch_first_kv_both_masks_per_head_f64",
        "batch_first=True, key is value, 3-D float attn_mask + bool kpm, per-head weights",
        batch_first=True, alias="kv", attn_mask=_fm(dims=3), kpm=_bk(),
        average_attn_weights=False, **F64)

    # --- unbatched (2-D inputs, §2.5 step 1/14) ---
    add("unbatched_self_f32", "unbatched 2-D input, self-attention", N=None, alias="self", L=5)
    add("unbatched_distinct_f64", "unbatched 2-D input, distinct q/k/v, L != S, float64",
        N=None, L=3, S=6, **F64)
    add("unbatched_bool_mask2d_f32", "unbatched with a 2-D (L,S) bool attn_mask",
        N=None, attn_mask=_bm())
    add("unbatched_float_mask3d_f32", "unbatched with a 3-D (H,L,S) float attn_mask with -inf entries",
        N=None, E=8, H=4, attn_mask=_fm(dims=3))
    add("unbatched_bool_mask3d_per_head_f64",
        "unbatched with a 3-D (H,L,S) bool attn_mask, per-head weights (H,L,S)",
        N=None, attn_mask=_bm(dims=3), average_attn_weights=False, **F64)
    add("unbatched_bool_kpm_f64", "unbatched with a 1-D bool key_padding_mask, float64",
        N=None, kpm=_bk(), **F64)
    add("unbatched_float_kpm_f32", "unbatched with a 1-D float key_padding_mask",
        N=None, kpm=_fk(), alias="kv")
    add("unbatched_batch_first_self_f32", "unbatched input with batch_first=True (flag has no effect)",
        N=None, batch_first=True, alias="self", L=4)
    add("unbatched_separate_bias_kv_zero_attn_masks_f64",
        "unbatched, separate weights, add_bias_kv+add_zero_attn, bool 3-D mask and bool kpm",
        N=None, kdim=3, vdim=5, add_bias_kv=True, add_zero_attn=True,
        attn_mask=_bm(dims=3), kpm=_bk(), **F64)
    add("unbatched_need_weights_false_f32", "unbatched, need_weights=False (SDPA branch), float mask",
        N=None, need_weights=False, attn_mask=_fm())

    # --- attn_mask / key_padding_mask (§2.4, §2.5 steps 6, 11) ---
    add("self_bool_mask2d_f32", "self-attention with a 2-D (L,S) bool attn_mask",
        alias="self", L=5, attn_mask=_bm())
    add("distinct_bool_mask2d_f64", "distinct inputs, 2-D bool attn_mask, L != S, float64",
        attn_mask=_bm(), **F64)
    add("distinct_bool_mask3d_f32", "distinct inputs, 3-D (N*H,L,S) bool attn_mask (index b*H+h)",
        E=8, H=4, attn_mask=_bm(dims=3))
    add("distinct_float_mask2d_f32", "2-D float attn_mask: random finite values and some -inf",
        attn_mask=_fm())
    add("distinct_float_mask3d_f64", "3-D (N*H,L,S) float attn_mask with -inf entries, float64",
        attn_mask=_fm(dims=3), N=3, **F64)
    # Learned masks (float masks that require grad, as a relative-position bias): their
    # gradients are stored as expect.grad.attn_mask / expect.grad.key_padding_mask.
    add("learned_mask2d_self_f32", "self-attention, a learned 2-D float attn_mask (with -inf)",
        alias="self", L=5, E=8, H=2, attn_mask=_fm(), mask_grad=True, need_weights=False)
    add("learned_masks_both_f32",
        "distinct inputs, learned 3-D (N*H,L,S) float attn_mask and float kpm, weights in loss",
        E=8, H=4, attn_mask=_fm(dims=3), kpm=_fk(), mask_grad=True, weights_in_loss=True,
        average_attn_weights=False)
    add("learned_kpm_bias_kv_zero_attn_f32",
        "key is value, learned float kpm, add_bias_kv and add_zero_attn, batch_first",
        alias="kv", S=6, kpm=_fk(), mask_grad=True, need_weights=False, add_bias_kv=True,
        add_zero_attn=True, batch_first=True)
    add("self_bool_kpm_f32", "self-attention with a bool key_padding_mask",
        alias="self", L=5, kpm=_bk())
    add("kv_float_kpm_f32", "key is value with a float key_padding_mask (-inf and finite values)",
        alias="kv", kpm=_fk())
    add("distinct_float_kpm_f64", "distinct inputs with a float key_padding_mask, N=3, float64",
        N=3, kpm=_fk(), **F64)
    add("both_masks_bool_f32", "2-D bool attn_mask + bool kpm merged (-inf + -inf)",
        attn_mask=_bm(), kpm=_bk())
    add("both_masks_float_f64", "3-D float attn_mask + float kpm merged by addition, float64",
        attn_mask=_fm(dims=3), kpm=_fk(), **F64)
    add("both_masks_bool_attn_float_kpm_f32",
        "mixed types: bool attn_mask + float kpm (deprecated, warns, still merged)",
        attn_mask=_bm(), kpm=_fk())
    add("both_masks_float_attn_bool_kpm_f64",
        "mixed types: 3-D float attn_mask + bool kpm, float64",
        attn_mask=_fm(dims=3), kpm=_bk(), **F64)
    add("both_masks_bool3d_sdpa_f32",
        "3-D bool attn_mask + bool kpm on the SDPA branch (need_weights=False)",
        attn_mask=_bm(dims=3), kpm=_bk(), need_weights=False)

    # --- is_causal (§2.6) ---
    add("causal_sdpa_self_bool_f32",
        "is_causal with a causal bool mask, need_weights=False, no kpm: SDPA causal mask used",
        alias="self", L=5, attn_mask=_bm(pattern="causal"), is_causal=True, need_weights=False)
    add("causal_sdpa_float_mask_f64",
        "is_causal with a float mask (-inf above the diagonal, random finite below), SDPA causal, f64",
        alias="self", L=4, attn_mask=_fm(pattern="causal"), is_causal=True,
        need_weights=False, **F64)
    add("causal_sdpa_noncausal_mask_discarded_f32",
        "is_causal with a random (non-causal) mask, need_weights=False: the mask is discarded",
        attn_mask=_bm(), is_causal=True, need_weights=False, L=5, S=5)
    add("causal_sdpa_l_lt_s_f32",
        "is_causal with L < S (4 < 6): SDPA upper-left causal alignment, supplied mask dropped",
        attn_mask=_fm(), is_causal=True, need_weights=False, L=4, S=6)
    add("causal_sdpa_l_gt_s_f64",
        "is_causal with L > S (6 > 3): upper-left alignment, later rows see all keys, float64",
        attn_mask=_bm(), is_causal=True, need_weights=False, L=6, S=3, **F64)
    add("causal_with_kpm_hint_ignored_f32",
        "is_causal with a kpm, need_weights=False: hint ignored, random attn_mask + kpm used",
        attn_mask=_bm(), kpm=_bk(), is_causal=True, need_weights=False)
    add("causal_need_weights_hint_ignored_f32",
        "is_causal with need_weights=True: hint ignored, the random attn_mask is used",
        attn_mask=_fm(), is_causal=True, need_weights=True)
    add("causal_need_weights_per_head_kpm_f64",
        "is_causal with need_weights=True and a kpm, per-head weights: hint ignored, float64",
        attn_mask=_bm(dims=3), kpm=_fk(), is_causal=True, average_attn_weights=False, **F64)
    add("causal_sdpa_bias_kv_f32",
        "is_causal with add_bias_kv, L <= S: bias column never visible, bias_k/v grads are 0",
        add_bias_kv=True, attn_mask=_bm(pattern="causal"), is_causal=True,
        need_weights=False, alias="self", L=4)
    add("causal_sdpa_bias_kv_zero_attn_l_gt_s_f64",
        "is_causal with add_bias_kv+add_zero_attn and L > S: late rows see the extra columns",
        add_bias_kv=True, add_zero_attn=True, attn_mask=_bm(), is_causal=True,
        need_weights=False, L=6, S=3, **F64)
    add("causal_sdpa_unbatched_f32", "is_causal, unbatched, need_weights=False, 3-D (H,L,S) mask",
        N=None, alias="self", L=5, attn_mask=_bm(dims=3, pattern="causal"), is_causal=True,
        need_weights=False)
    add("causal_sdpa_batch_first_mask3d_f64",
        "is_causal, batch_first, 3-D float mask (discarded), need_weights=False, float64",
        batch_first=True, attn_mask=_fm(dims=3), is_causal=True, need_weights=False,
        L=5, S=5, alias="kv", **F64)

    # --- need_weights / average_attn_weights / weights in the loss ---
    add("per_head_weights_f32", "average_attn_weights=False: per-head weights (N,H,L,S)",
        average_attn_weights=False, E=8, H=4)
    add("per_head_weights_bias_kv_zero_attn_f64",
        "per-head weights with add_bias_kv+add_zero_attn (weights have S+2 columns), float64",
        average_attn_weights=False, add_bias_kv=True, add_zero_attn=True, **F64)
    add("weights_in_loss_avg_f32", "averaged weights are part of the loss (grad.attn_weights)",
        weights_in_loss=True, attn_mask=_bm())
    add("weights_in_loss_per_head_f64", "per-head weights in the loss, float64",
        weights_in_loss=True, average_attn_weights=False, alias="kv", **F64)
    add("weights_in_loss_both_masks_f32",
        "per-head weights in the loss with float 3-D attn_mask and bool kpm, batch_first",
        weights_in_loss=True, average_attn_weights=False, attn_mask=_fm(dims=3), kpm=_bk(),
        batch_first=True)
    add("weights_in_loss_unbatched_bias_kv_f64",
        "averaged weights in the loss, unbatched, add_bias_kv, float64",
        weights_in_loss=True, N=None, add_bias_kv=True, **F64)
    add("need_weights_false_self_f32", "need_weights=False (SDPA branch), self-attention, no mask",
        need_weights=False, alias="self", L=5)
    add("need_weights_false_float_mask_f64",
        "need_weights=False with a 2-D float attn_mask, distinct inputs, float64",
        need_weights=False, attn_mask=_fm(), **F64)
    add("need_weights_false_avg_false_f32",
        "need_weights=False with average_attn_weights=False (no effect; weights None)",
        need_weights=False, average_attn_weights=False, kpm=_bk())
    add("need_weights_false_separate_bias_kv_zero_attn_f32",
        "need_weights=False, separate weights, add_bias_kv+add_zero_attn, bool kpm",
        need_weights=False, kdim=5, vdim=4, add_bias_kv=True, add_zero_attn=True, kpm=_bk())

    # --- head counts and sizes ---
    add("heads3_e6_f64", "odd head count H=3 (E=6, hd=2), float64", E=6, H=3, attn_mask=_bm(),
        **F64)
    add("heads5_e10_f32", "odd head count H=5 (E=10, hd=2)", E=10, H=5, kpm=_bk())
    add("head_dim1_e3_h3_f32", "head_dim 1 (E=3, H=3)", E=3, H=3, alias="self", L=4)
    add("head_dim1_e3_h3_sdpa_f64", "head_dim 1 (E=3, H=3) on the SDPA branch, float64",
        E=3, H=3, need_weights=False, attn_mask=_fm(), **F64)
    add("heads1_e4_f32", "a single head (E=4, H=1)", E=4, H=1)
    add("heads8_e16_f32", "H=8 heads on E=16 (hd=2), 3-D bool mask, per-head weights",
        E=16, H=8, attn_mask=_bm(dims=3), average_attn_weights=False, L=2, S=3)
    add("single_query_l1_f32", "a single query (L=1)", L=1, S=5, attn_mask=_bm())
    add("single_query_l1_sdpa_f64", "a single query (L=1) on the SDPA branch, float64",
        L=1, S=6, need_weights=False, kpm=_bk(), **F64)
    add("single_key_s1_f64", "a single key (S=1), float64", L=4, S=1, **F64)
    add("single_key_s1_zero_attn_f32", "a single key (S=1) with add_zero_attn", L=3, S=1,
        add_zero_attn=True)
    add("batch1_n1_f32", "batch of one (N=1) with a 3-D mask", N=1, attn_mask=_fm(dims=3))
    add("l1_s1_n1_bias_kv_f32", "L=1, S=1, N=1 with add_bias_kv", L=1, S=1, N=1, add_bias_kv=True)
    add("largest_e12_l7_s7_n3_f32", "longest fixture: E=12 H=4 L=S=7 N=3, self-attn, bool kpm",
        E=12, H=4, L=7, N=3, alias="self", kpm=_bk())

    # --- fully masked rows (only with need_weights=False: PyTorch's finite SDPA answer) ---
    add("fully_masked_kpm_sdpa_f32",
        "one batch element fully padded (bool kpm), need_weights=False: rows = out_proj.bias",
        kpm=_bk(full_row=True), need_weights=False)
    add("fully_masked_attn_row_sdpa_f64",
        "a bool attn_mask row all True, need_weights=False: that output row = out_proj.bias",
        attn_mask=_bm(full_row=True), need_weights=False, **F64)
    add("fully_masked_float_attn_row_sdpa_f32",
        "a 3-D float attn_mask row all -inf, need_weights=False (finite SDPA answer)",
        attn_mask=_fm(dims=3, full_row=True), need_weights=False)
    add("fully_masked_both_masks_sdpa_f32",
        "bool attn_mask row all True plus a fully padded batch element, need_weights=False",
        attn_mask=_bm(full_row=True), kpm=_bk(full_row=True), need_weights=False, N=3)
    add("fully_masked_kpm_sdpa_unbatched_f64",
        "unbatched with every key padded (1-D kpm), need_weights=False, float64",
        N=None, kpm=_bk(full_row=True), need_weights=False, **F64)
    add("fully_masked_kpm_sdpa_eval_f32",
        "eval+no_grad, fully padded batch element, need_weights=False, slow path (seq-first)",
        kpm=_bk(full_row=True), need_weights=False, alias="self", L=5, **EVAL)

    # --- eval + no_grad ---
    add("eval_distinct_f32", "eval mode, no_grad, distinct inputs (forward only)", **EVAL)
    add("eval_self_f64", "eval mode, no_grad, self-attention seq-first (slow path), float64",
        alias="self", L=5, attn_mask=_bm(), **EVAL, **F64)
    add("eval_dropout03_f32", "dropout=0.3 in eval mode: inactive, forward only",
        dropout=0.3, attn_mask=_fm(), **EVAL)
    add("eval_dropout03_sdpa_f64", "dropout=0.3 in eval mode on the SDPA branch, float64",
        dropout=0.3, need_weights=False, kpm=_bk(), **EVAL, **F64)
    add("eval_fastpath_self_bool_kpm_f32",
        "eval+no_grad batch_first self-attn, even H, bool kpm, dropout=0.3: native fast path",
        batch_first=True, alias="self", L=5, kpm=_bk(), dropout=0.3, **EVAL)
    add("eval_fastpath_bool_mask_sdpa_f32",
        "native fast path with a 2-D bool attn_mask and need_weights=False",
        batch_first=True, alias="self", L=5, attn_mask=_bm(), need_weights=False, **EVAL)
    add("eval_fastpath_per_head_f64",
        "native fast path, both bool masks, per-head weights, float64",
        batch_first=True, alias="self", L=4, E=8, H=4, attn_mask=_bm(), kpm=_bk(),
        average_attn_weights=False, **EVAL, **F64)
    add("eval_odd_heads_batch_first_self_f32",
        "eval+no_grad batch_first self-attn with odd H=3 (fast path skipped)",
        E=6, H=3, batch_first=True, alias="self", L=4, kpm=_bk(), **EVAL)
    add("eval_float_mask_batch_first_self_f32",
        "eval+no_grad batch_first self-attn with a float mask (fast path skipped)",
        batch_first=True, alias="self", L=4, attn_mask=_fm(), **EVAL)
    add("eval_unbatched_bias_kv_f32", "eval+no_grad, unbatched, add_bias_kv", N=None,
        add_bias_kv=True, kpm=_bk(), **EVAL)
    add("eval_causal_sdpa_f64", "eval+no_grad, is_causal with need_weights=False (slow SDPA)",
        attn_mask=_bm(), is_causal=True, need_weights=False, L=5, S=5, **EVAL, **F64)
    add("nan_grad_output_full_row_kpm_f32",
        "eval mode with gradients, need_weights=False (fused backward), a bool kpm with a fully "
        "padded batch element, one NaN in grad.output: NaN reaches every key's gradient",
        training=False, need_weights=False, L=3, S=5, kpm=_bk(full_row=True),
        nan_grad_output=-1)
    add("nan_grad_output_causal_f32",
        "eval mode with gradients, is_causal with a causal bool mask, need_weights=False, L=130 "
        "(key blocks past the causal band), one NaN in the first query row of grad.output",
        training=False, need_weights=False, alias="self", L=130, attn_mask=_bm(pattern="causal"),
        is_causal=True, nan_grad_output=1)
    add("eval_grad_dropout03_f64",
        "eval mode with gradients recorded (training=false, grad_mode=true), dropout=0.3 inactive",
        training=False, grad_mode=True, dropout=0.3, attn_mask=_bm(), kpm=_bk(), **F64)
    # --- bfloat16 (graded against float64 references, docs/case-format.md §5) ---
    BF16 = {"dtype": "bfloat16", "E": 32, "H": 4, "N": 2}
    add("bf16_self_kpm_sdpa", "bfloat16 self-attention, bool kpm, need_weights=False",
        alias="self", L=9, S=9, kpm=_bk(), need_weights=False, **BF16)
    add("bf16_cross_float_mask_weights",
        "bfloat16 cross-attention, 2-D float attn_mask, weights in the loss",
        L=7, S=11, attn_mask=_fm(), need_weights=True, weights_in_loss=True, **BF16)
    add("bf16_causal_sdpa", "bfloat16 self-attention, is_causal with a causal bool mask",
        alias="self", L=10, S=10, attn_mask=_bm(pattern="causal"), is_causal=True,
        need_weights=False, **BF16)
    add("bf16_separate_kdim_batch_first_eval",
        "bfloat16, separate weights (kdim=16, vdim=24), batch_first, eval forward",
        kdim=16, vdim=24, L=6, S=8, batch_first=True, training=False, grad_mode=False,
        need_weights=False, **BF16)
    add("bf16_eval_grad_dropout03",
        "bfloat16, eval mode with gradients (dropout=0.3 configured, inactive), bool mask and kpm",
        training=False, grad_mode=True, dropout=0.3, attn_mask=_bm(), kpm=_bk(), L=8, S=10,
        need_weights=False, **BF16)
    add("bf16_self_kpm_eval",
        "bfloat16 self-attention, bool kpm, eval forward under no_grad (bf16 products)",
        alias="self", L=12, S=12, kpm=_bk(), training=False, grad_mode=False,
        need_weights=False, **BF16)
    return C


def mha_random_config(rng: random.Random, index: int) -> dict:
    E = rng.choice([3, 4, 6, 8, 12, 16])
    H = rng.choice([d for d in range(1, E + 1) if E % d == 0])
    L, S = rng.randint(1, 7), rng.randint(1, 7)
    N = None if rng.random() < 0.2 else rng.randint(1, 3)
    # aliasing first, then shapes it permits: self needs kdim == vdim == E and L == S,
    # key-is-value needs kdim == vdim, key-is-query needs kdim == E and L == S
    alias = rng.choices(["none", "self", "kv", "kq"], weights=[40, 30, 20, 10])[0]
    kdim = rng.choice([None, None, E, rng.randint(1, 9)])
    vdim = rng.choice([None, None, E, rng.randint(1, 9)])
    if alias == "self":
        S = L
        kdim = vdim = rng.choice([None, E])
    elif alias == "kv":
        vdim = kdim
    elif alias == "kq":
        S = L
        kdim = rng.choice([None, E])
    grad_mode = rng.random() < 0.7
    training = grad_mode and rng.random() < 0.8
    dropout = 0.0 if training else rng.choice([0.0, 0.0, 0.1, 0.3])
    am = None
    if rng.random() < 0.5:
        am = {"type": rng.choice(["bool", "float"]), "dims": rng.choice([2, 3]),
              "pattern": "causal" if rng.random() < 0.2 else "random",
              "full_row": rng.random() < 0.1}
    kp = None
    if rng.random() < 0.4:
        kp = {"type": rng.choice(["bool", "float"]), "full_row": rng.random() < 0.1}
    need_weights = rng.random() < 0.6
    is_causal = am is not None and rng.random() < 0.3
    return dict(
        name=f"random_{index:04d}",
        E=E, H=H, dropout=dropout, bias=rng.random() < 0.8,
        add_bias_kv=rng.random() < 0.25, add_zero_attn=rng.random() < 0.25,
        kdim=kdim, vdim=vdim, batch_first=rng.random() < 0.5,
        dtype=rng.choice(["float32", "float64"]),
        training=training, grad_mode=grad_mode, L=L, S=S, N=N, alias=alias,
        need_weights=need_weights, average_attn_weights=rng.random() < 0.6,
        is_causal=is_causal, weights_in_loss=need_weights and rng.random() < 0.5,
        attn_mask=am, kpm=kp, mask_grad=grad_mode and rng.random() < 0.4,
    )


# --------------------------------------------------------------------------------------
# Transformer layers: TransformerEncoderLayer, TransformerDecoderLayer, TransformerEncoder,
# TransformerDecoder, Transformer (docs/pytorch-behaviour.md §7)
# --------------------------------------------------------------------------------------
#
# Config dict (keys with defaults in TF_DEFAULTS):
#   name, description, seed (optional: derived from name), module (class path)
#   d_model, nhead, dim_feedforward, dropout, activation ("relu"|"gelu"), layer_norm_eps,
#   batch_first, norm_first, bias, dtype
#   num_layers, norm (bool), norm_eps      TransformerEncoder / TransformerDecoder
#   num_encoder_layers, num_decoder_layers Transformer
#   training, grad_mode
#   S (src / memory length), T (tgt length), N (None = unbatched 2-D inputs)
#   masks   {forward arg name: spec}. Attention masks: {"type": "bool"|"float",
#           "dims": 2|3, "pattern": "random"|"causal"|"none"} ("none": nothing blocked,
#           float values 0 / bool all False). Key-padding masks: {"type": "bool"|"float"}.
#   flags   {forward arg name: True|False}: the is_causal-style keyword arguments that
#           are passed. An absent flag is not passed (recorded as null in ``call``).
#
# Masks are drawn so that no (batch, head, query) row is ever fully blocked and no
# sequence is ever fully padded: the fused eval fast paths give NaN there (docs/pytorch-behaviour.md §5),
# and no transformer case may hold NaN.

ENC_LAYER = "torch.nn.TransformerEncoderLayer"
DEC_LAYER = "torch.nn.TransformerDecoderLayer"
ENCODER = "torch.nn.TransformerEncoder"
DECODER = "torch.nn.TransformerDecoder"
TRANSFORMER = "torch.nn.Transformer"
TF_MODULES = [ENC_LAYER, DEC_LAYER, ENCODER, DECODER, TRANSFORMER]

# Short names for the command line (--kind / --kinds).
KIND_NAMES = {
    "mha": MHA,
    "sdpa": "torch.nn.functional.scaled_dot_product_attention",
    "encoder_layer": ENC_LAYER,
    "decoder_layer": DEC_LAYER,
    "encoder": ENCODER,
    "decoder": DECODER,
    "transformer": TRANSFORMER,
}

# Per module: float inputs (get expect.grad.<arg>), attention blocks
# (attn-mask arg, key-padding-mask arg, query seq, key seq) and the is_causal-style flags.
TF_SIGNATURES = {
    ENC_LAYER: {
        "inputs": ["src"],
        "blocks": [("src_mask", "src_key_padding_mask", "S", "S")],
        "flags": ["is_causal"],
    },
    ENCODER: {
        "inputs": ["src"],
        "blocks": [("mask", "src_key_padding_mask", "S", "S")],
        "flags": ["is_causal"],
    },
    DEC_LAYER: {
        "inputs": ["tgt", "memory"],
        "blocks": [("tgt_mask", "tgt_key_padding_mask", "T", "T"),
                   ("memory_mask", "memory_key_padding_mask", "T", "S")],
        "flags": ["tgt_is_causal", "memory_is_causal"],
    },
    DECODER: {
        "inputs": ["tgt", "memory"],
        "blocks": [("tgt_mask", "tgt_key_padding_mask", "T", "T"),
                   ("memory_mask", "memory_key_padding_mask", "T", "S")],
        "flags": ["tgt_is_causal", "memory_is_causal"],
    },
    TRANSFORMER: {
        "inputs": ["src", "tgt"],
        "blocks": [("src_mask", "src_key_padding_mask", "S", "S"),
                   ("tgt_mask", "tgt_key_padding_mask", "T", "T"),
                   ("memory_mask", "memory_key_padding_mask", "T", "S")],
        "flags": ["src_is_causal", "tgt_is_causal", "memory_is_causal"],
    },
}

# Forward keyword order of the masks in each signature (call dict order).
def tf_mask_names(module: str) -> list[str]:
    sig = TF_SIGNATURES[module]
    return [b[0] for b in sig["blocks"]] + [b[1] for b in sig["blocks"]]


TF_DEFAULTS = dict(
    d_model=8,
    nhead=2,
    dim_feedforward=16,
    dropout=0.0,
    activation="relu",
    layer_norm_eps=1e-5,
    batch_first=False,
    norm_first=False,
    bias=True,
    dtype="float32",
    num_layers=2,
    norm=False,
    norm_eps=None,  # None: the layer's layer_norm_eps
    num_encoder_layers=1,
    num_decoder_layers=1,
    training=True,
    grad_mode=True,
    S=4,
    T=3,
    N=2,
    masks=None,
    flags=None,
    # TransformerEncoder's constructor flags (None: not passed, PyTorch's default True)
    enable_nested_tensor=None,
    mask_check=None,
    # keep a case whose TransformerEncoder took the nested-tensor path (its padded
    # positions come out as zeros); other cases skip it
    allow_nested=False,
    # NaN in src wherever src_key_padding_mask pads (with the nested path: a finite output)
    nan_in_padded_src=False,
    # "bfloat16": the forward runs inside torch.autocast("cpu", dtype=torch.bfloat16) with f32
    # parameters and inputs (the case's optional "autocast" key; graded against float64
    # references as the bfloat16 cases are)
    autocast=None,
)

LAYER_CTOR_KEYS = ["d_model", "nhead", "dim_feedforward", "dropout", "activation",
                   "layer_norm_eps", "batch_first", "norm_first", "bias", "dtype"]
TRANSFORMER_CTOR_KEYS = ["d_model", "nhead", "num_encoder_layers", "num_decoder_layers",
                         "dim_feedforward", "dropout", "activation", "layer_norm_eps",
                         "batch_first", "norm_first", "bias", "dtype"]


def tf_full_config(cfg: dict) -> dict:
    c = dict(TF_DEFAULTS)
    c.update(cfg)
    c["masks"] = dict(c["masks"] or {})
    c["flags"] = dict(c["flags"] or {})
    if c.get("seed") is None:
        c["seed"] = seed_for(c["name"])
    return c


def tf_constructor(c: dict) -> dict:
    layer = {k: c[k] for k in LAYER_CTOR_KEYS}
    m = c["module"]
    if m in (ENC_LAYER, DEC_LAYER):
        return layer
    if m in (ENCODER, DECODER):
        eps = c["norm_eps"] if c["norm_eps"] is not None else c["layer_norm_eps"]
        ctor = {
            "layer": layer,
            "num_layers": c["num_layers"],
            "norm": {"eps": eps} if c["norm"] else None,
            "dtype": c["dtype"],
        }
        for key in ("enable_nested_tensor", "mask_check"):
            if m == ENCODER and c[key] is not None:
                ctor[key] = c[key]
        return ctor
    return {k: c[k] for k in TRANSFORMER_CTOR_KEYS}


def _layer_kwargs(ctor: dict) -> dict:
    kw = dict(ctor)
    kw["dtype"] = DTYPES[kw["dtype"]]
    return kw


def tf_build(module: str, ctor: dict) -> torch.nn.Module:
    """Build the module from a contract ``constructor`` dict (PyTorch defaults elsewhere)."""
    nn = torch.nn
    with warnings.catch_warnings():
        # enable_nested_tensor / bias=False notices at construction
        warnings.simplefilter("ignore", UserWarning)
        if module == ENC_LAYER:
            return nn.TransformerEncoderLayer(**_layer_kwargs(ctor))
        if module == DEC_LAYER:
            return nn.TransformerDecoderLayer(**_layer_kwargs(ctor))
        if module in (ENCODER, DECODER):
            lk = _layer_kwargs(ctor["layer"])
            norm = None
            if ctor["norm"] is not None:
                norm = nn.LayerNorm(lk["d_model"], eps=ctor["norm"]["eps"],
                                    dtype=DTYPES[ctor["dtype"]])
            if module == ENCODER:
                flags = {k: ctor[k] for k in ("enable_nested_tensor", "mask_check") if k in ctor}
                return nn.TransformerEncoder(nn.TransformerEncoderLayer(**lk),
                                             ctor["num_layers"], norm=norm, **flags)
            return nn.TransformerDecoder(nn.TransformerDecoderLayer(**lk),
                                         ctor["num_layers"], norm=norm)
        if module == TRANSFORMER:
            return nn.Transformer(**_layer_kwargs(ctor))
    raise ValueError(f"unknown module {module}")


class _TfSpy:
    """Records which PyTorch paths ran: the fused encoder-layer kernel, MHA's native fast
    path, TransformerEncoder's nested-tensor path, and what causal-mask detection said."""

    _TORCH_FNS = {
        "fused_encoder_layer": "_transformer_encoder_layer_fwd",
        "native_mha": "_native_multi_head_attention",
        "nested": "_nested_tensor_from_mask",
    }

    def __enter__(self):
        self.hits = {k: 0 for k in self._TORCH_FNS}
        self.detected: list[bool] = []
        self._orig = {}
        for key, fn in self._TORCH_FNS.items():
            orig = getattr(torch, fn)
            self._orig[fn] = orig

            def spy(*a, _key=key, _orig=orig, **kw):
                self.hits[_key] += 1
                return _orig(*a, **kw)

            setattr(torch, fn, spy)
        tmod = torch.nn.modules.transformer
        self._orig_detect = tmod._detect_is_causal_mask

        def detect(*a, **kw):
            r = self._orig_detect(*a, **kw)
            self.detected.append(bool(r))
            return r

        tmod._detect_is_causal_mask = detect
        return self

    def __exit__(self, *exc):
        for fn, orig in self._orig.items():
            setattr(torch, fn, orig)
        torch.nn.modules.transformer._detect_is_causal_mask = self._orig_detect
        return False


def tf_call(model, module: str, inputs: dict, masks: dict, flags: dict, grad_mode: bool, g,
            autocast: str | None = None):
    """Run the forward (and the backward of sum(out * g) when grad_mode), the forward inside
    torch.autocast("cpu", dtype) when ``autocast`` names a dtype. Returns (out, spy)."""
    kwargs = {}
    for name in tf_mask_names(module):
        if masks.get(name) is not None:
            kwargs[name] = masks[name]
    for name in TF_SIGNATURES[module]["flags"]:
        if flags.get(name) is not None:
            kwargs[name] = flags[name]
    args = [inputs[n] for n in TF_SIGNATURES[module]["inputs"]]
    with warnings.catch_warnings():
        # mixed bool/float masks and nested-tensor notices warn; keep the output quiet
        warnings.simplefilter("ignore", UserWarning)
        cast = (torch.autocast("cpu", dtype=AUTOCAST_DTYPES[autocast]) if autocast
                else contextlib.nullcontext())
        with _TfSpy() as spy, cast:
            if grad_mode:
                out = model(*args, **kwargs)
            else:
                with torch.no_grad():
                    out = model(*args, **kwargs)
    if grad_mode:
        (out * g).sum().backward()
    return out, spy


def _tf_blocked(c: dict) -> dict[str, torch.Tensor]:
    """Boolean "blocked" patterns for every requested mask, repaired so that no
    (batch, head, query) row is fully blocked (hence no sequence fully padded)."""
    H = c["nhead"]
    N = c["N"] if c["N"] is not None else 1
    out: dict[str, torch.Tensor] = {}
    for am_name, kp_name, lq, sk in TF_SIGNATURES[c["module"]]["blocks"]:
        L, S = c[lq], c[sk]
        am, kp = c["masks"].get(am_name), c["masks"].get(kp_name)
        a = k = None
        if am is not None:
            shape = (L, S) if am.get("dims", 2) == 2 else (N * H, L, S)
            pattern = am.get("pattern", "random")
            if pattern == "causal":
                a = torch.ones(L, S, dtype=torch.bool).triu(1)
                if len(shape) == 3:
                    a = a.expand(shape).clone()
            elif pattern == "none":
                a = torch.zeros(shape, dtype=torch.bool)
            else:
                a = torch.rand(shape) < 0.3
        if kp is not None:
            if kp.get("pattern") == "tail":
                # left-aligned: row b pads its last b % S keys (row 0 none)
                k = torch.arange(S).view(1, S) >= (S - torch.arange(N) % S).view(N, 1)
            elif kp.get("pattern") == "holes":
                # not left-aligned: row b pads key j where (j + b) % 3 == 1
                k = (torch.arange(S).view(1, S) + torch.arange(N).view(N, 1)) % 3 == 1
            else:
                k = torch.rand(N, S) < 0.3
        while a is not None or k is not None:
            comb = torch.zeros(N, H, L, S, dtype=torch.bool)
            if a is not None:
                comb |= a.view(1, 1, L, S) if a.dim() == 2 else a.view(N, H, L, S)
            if k is not None:
                comb |= k.view(N, 1, 1, S)
            full = comb.all(-1).nonzero()
            if len(full) == 0:
                break
            b, h, l = (int(x) for x in full[0])
            arow = None
            if a is not None:
                arow = a[l] if a.dim() == 2 else a[b * H + h, l]
            free = (~arow).nonzero().flatten() if arow is not None else torch.arange(S)
            if k is not None and len(free) > 0:
                # keep the attention mask's pattern (causal stays causal): unpad a key
                k[b, int(free[int(torch.randint(0, len(free), (1,)))])] = False
            else:
                s = int(torch.randint(0, S, (1,)))
                if a.dim() == 2:
                    a[l, s] = False
                else:
                    a[b * H + h, l, s] = False
                if k is not None:
                    k[b, s] = False
        if a is not None:
            out[am_name] = a
        if k is not None:
            out[kp_name] = k
    return out


def _tf_mask_tensor(blocked: torch.Tensor, spec: dict, dtype: torch.dtype) -> torch.Tensor:
    if spec["type"] == "bool":
        return blocked.clone()
    if spec.get("pattern") in ("causal", "none") or spec.get("binary"):
        # exactly 0 / -inf, as Transformer.generate_square_subsequent_mask gives
        return torch.zeros(blocked.shape, dtype=dtype).masked_fill(blocked, float("-inf"))
    return torch.randn(blocked.shape, dtype=dtype).masked_fill(blocked, float("-inf"))


def tf_perturb(model: torch.nn.Module) -> None:
    """Move every parameter off its init: LayerNorm weights off 1, biases off 0, and the
    stacked layers (deep copies) apart from each other."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.add_(torch.randn_like(p) * 0.02)


def tf_describe(c: dict) -> str:
    m = c["module"]
    parts = [m.split(".")[-1]]
    parts.append(f"d={c['d_model']} H={c['nhead']} ff={c['dim_feedforward']}")
    if m in (ENCODER, DECODER):
        parts.append(f"{c['num_layers']} layers" + (" + final norm" if c["norm"] else ""))
    if m == TRANSFORMER:
        parts.append(f"{c['num_encoder_layers']} enc / {c['num_decoder_layers']} dec layers")
    parts.append(c["activation"])
    parts.append("pre-norm" if c["norm_first"] else "post-norm")
    if not c["bias"]:
        parts.append("bias=False")
    parts.append(f"eps={c['layer_norm_eps']:g}")
    if c["batch_first"]:
        parts.append("batch_first")
    lens = []
    if m in (ENC_LAYER, ENCODER, TRANSFORMER):
        lens.append(f"S={c['S']}")
    if m in (DEC_LAYER, DECODER, TRANSFORMER):
        lens.append(f"T={c['T']}")
    if m in (DEC_LAYER, DECODER):
        lens.append(f"S(memory)={c['S']}")
    parts.append(" ".join(lens))
    parts.append("unbatched" if c["N"] is None else f"N={c['N']}")
    for name, spec in c["masks"].items():
        if spec is None:
            continue
        if name.endswith("key_padding_mask"):
            zi = " (0/-inf)" if spec["type"] == "float" and spec.get("binary") else ""
            parts.append(f"{spec['type']} {name}{zi}")
        else:
            pat = spec.get("pattern", "random")
            if spec["type"] == "float" and spec.get("binary") and pat == "random":
                pat = "random 0/-inf"
            parts.append(f"{spec['type']} {spec.get('dims', 2)}-D {pat} {name}")
    for name, val in c["flags"].items():
        parts.append(f"{name}={val}")
    if c["grad_mode"]:
        parts.append("training" if c["training"] else "eval with grad")
    else:
        parts.append("eval+no_grad")
    if c["dropout"]:
        parts.append(f"dropout={c['dropout']}")
    parts.append(c["dtype"])
    return ", ".join(parts)


def tf_make_case(cfg: dict, out_dir: Path | None, allow_nan: bool = False) -> dict:
    """Build a transformer module from a config, run it, and write the case.

    Raises SkipCase when the config is not a usable case: PyTorch raised, a result is
    not finite, or TransformerEncoder's nested-tensor path ran (it pads the output with
    zeros, which is not the layer semantics the cases pin down). ``allow_nan`` is
    accepted for symmetry with MHA and ignored: transformer cases are always finite.
    """
    c = tf_full_config(cfg)
    m = c["module"]
    sig = TF_SIGNATURES[m]
    dtype = DTYPES[c["dtype"]]
    if c["grad_mode"] and c["training"] and c["dropout"] != 0.0:
        raise SkipCase("graded training cases use dropout 0")
    if not c["grad_mode"] and c["training"]:
        raise SkipCase("grad_mode false means eval mode")
    if c["d_model"] % c["nhead"]:
        raise SkipCase("nhead must divide d_model")
    unknown = set(c["masks"]) - set(tf_mask_names(m))
    unknown |= set(c["flags"]) - set(sig["flags"])
    if unknown:
        raise ValueError(f"{c['name']}: {m} has no argument {sorted(unknown)}")

    torch.manual_seed(c["seed"])
    ctor = tf_constructor(c)
    try:
        model = tf_build(m, ctor)
    except (AssertionError, ValueError, RuntimeError) as e:
        raise SkipCase(f"constructor raised: {e}") from e
    tf_perturb(model)
    model.train(c["training"])

    N, E = c["N"], c["d_model"]

    def shape(seq):
        if N is None:
            return (seq, E)
        return (N, seq, E) if c["batch_first"] else (seq, N, E)

    seq_of = {"src": c["S"], "memory": c["S"], "tgt": c["T"]}
    inputs = {n: torch.randn(shape(seq_of[n]), dtype=dtype) for n in sig["inputs"]}

    blocked = _tf_blocked(c)
    masks: dict[str, torch.Tensor] = {}
    for name, blk in blocked.items():
        t = _tf_mask_tensor(blk, c["masks"][name], dtype)
        if name.endswith("key_padding_mask") and N is None:
            t = t.view(-1)
        masks[name] = t
    # for unbatched input a 3-D mask is (H,L,S), which is (N*H,L,S) with N=1

    if c["nan_in_padded_src"]:
        # NaN in src at padded positions: the nested path drops those tokens (finite output)
        pad = masks["src_key_padding_mask"] != 0
        inputs["src"][pad if c["batch_first"] else pad.t()] = float("nan")
    if c["grad_mode"]:
        for t in inputs.values():
            t.requires_grad_(True)
    out_seq = c["S"] if m in (ENC_LAYER, ENCODER) else c["T"]
    g = torch.randn(shape(out_seq), dtype=dtype) if c["grad_mode"] else None

    try:
        out, spy = tf_call(model, m, inputs, masks, c["flags"], c["grad_mode"], g, c["autocast"])
    except (AssertionError, RuntimeError, ValueError) as e:
        raise SkipCase(f"PyTorch raised: {type(e).__name__}: {e}") from e
    if spy.hits["nested"] and not c["allow_nested"]:
        raise SkipCase("TransformerEncoder took the nested-tensor path (pads with zeros)")
    if c["allow_nested"] and c["masks"] and not spy.hits["nested"] and c["enable_nested_tensor"] is not False:
        raise SkipCase("the case asks for the nested-tensor path and PyTorch did not take it")
    if spy.hits["fused_encoder_layer"] and any(
            t.is_floating_point() and (torch.isfinite(t) & (t != 0)).any().item()
            for t in masks.values()):
        # The fused kernel reads a float mask as a bool one (nonzero = blocked), unlike
        # the slow path, which adds it: only 0/-inf float masks mean the same there.
        raise SkipCase("float mask with finite nonzero values on the fused encoder-layer path")

    call: dict = {}
    for name in sig["flags"]:
        call[name] = c["flags"].get(name)
    for name in tf_mask_names(m):
        call[name] = c["masks"][name]["type"] if name in masks else None

    tensors: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    for key, val in state.items():
        tensors[f"param.{key}"] = val
    for n in sig["inputs"]:
        tensors[f"input.{n}"] = inputs[n]
    for name in tf_mask_names(m):
        if name in masks:
            tensors[f"input.{name}"] = masks[name]
    if c["grad_mode"]:
        tensors["grad.output"] = g
    tensors["expect.output"] = out
    if c["grad_mode"]:
        for n in sig["inputs"]:
            tensors[f"expect.grad.{n}"] = inputs[n].grad
        params = dict(model.named_parameters())
        for key in state.keys():
            gp = params[key].grad
            tensors[f"expect.grad.param.{key}"] = gp if gp is not None else torch.zeros_like(
                params[key])

    expects = [t for n, t in tensors.items() if n.startswith("expect.")]
    if not all(torch.isfinite(t).all().item() for t in expects):
        raise SkipCase("result is not finite")

    paths = []
    if spy.hits["fused_encoder_layer"]:
        paths.append("fused encoder layer (torch._transformer_encoder_layer_fwd)")
    if spy.hits["native_mha"]:
        paths.append("MHA native fast path (torch._native_multi_head_attention)")
    path = " + ".join(paths) if paths else "slow (Python composition, MHA via SDPA)"

    meta = {
        "format_version": FORMAT_VERSION,
        "module": m,
        "constructor": ctor,
        "training": c["training"],
        "grad_mode": c["grad_mode"],
        "call": call,
        "aliasing": {},
        "suggested_tolerance": SUGGESTED_TOLERANCE,
        "seed": c["seed"],
        "torch_version": torch.__version__,
        "description": c.get("description") or tf_describe(c),
        "nan": False,
        "pytorch_path": path,
    }
    if c["autocast"]:
        meta["autocast"] = c["autocast"]
    if spy.detected:
        # TransformerEncoder / TransformerDecoder / Transformer: what
        # _detect_is_causal_mask returned (encoder first for Transformer)
        meta["is_causal_detected"] = spy.detected
    return finish_case(out_dir, meta, tensors)


def tf_replay(meta: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Re-run a stored transformer case in PyTorch. Results are named like expect.*."""
    m = meta["module"]
    sig = TF_SIGNATURES[m]
    model = tf_build(m, meta["constructor"])
    params = {n[len("param."):]: t for n, t in tensors.items() if n.startswith("param.")}
    model.load_state_dict(params, strict=True)
    model.train(meta["training"])
    grad_mode = meta["grad_mode"]
    inputs = {n: tensors[f"input.{n}"].clone() for n in sig["inputs"]}
    if grad_mode:
        for t in inputs.values():
            t.requires_grad_(True)
    masks = {}
    for name in tf_mask_names(m):
        if f"input.{name}" in tensors:
            masks[name] = logical(tensors, meta, f"input.{name}").clone()
    out, _ = tf_call(model, m, inputs, masks, meta["call"], grad_mode, tensors.get("grad.output"),
                     meta.get("autocast"))
    res = {"output": out.detach()}
    if grad_mode:
        for n in sig["inputs"]:
            res[f"grad.{n}"] = inputs[n].grad
        named = dict(model.named_parameters())
        for key in model.state_dict().keys():
            gp = named[key].grad
            res[f"grad.param.{key}"] = gp if gp is not None else torch.zeros_like(named[key])
    return res


def tf_check_contract(meta: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    errs = []
    m = meta["module"]
    sig = TF_SIGNATURES[m]
    ctor = meta["constructor"]
    if m in (ENC_LAYER, DEC_LAYER):
        if list(ctor) != LAYER_CTOR_KEYS:
            errs.append(f"constructor keys {list(ctor)}")
    elif m in (ENCODER, DECODER):
        optional = ["enable_nested_tensor", "mask_check"] if m == ENCODER else []
        if [k for k in ctor if k not in optional] != ["layer", "num_layers", "norm", "dtype"]:
            errs.append(f"constructor keys {list(ctor)}")
        elif list(ctor["layer"]) != LAYER_CTOR_KEYS:
            errs.append(f"layer constructor keys {list(ctor['layer'])}")
        elif ctor["layer"]["dtype"] != ctor["dtype"]:
            errs.append("layer dtype differs from the case dtype")
        elif ctor["norm"] is not None and list(ctor["norm"]) != ["eps"]:
            errs.append(f"norm keys {list(ctor['norm'])}")
    elif list(ctor) != TRANSFORMER_CTOR_KEYS:
        errs.append(f"constructor keys {list(ctor)}")
    want_call = sig["flags"] + tf_mask_names(m)
    if list(meta["call"]) != want_call:
        errs.append(f"call keys {list(meta['call'])}, want {want_call}")
    if meta["aliasing"] != {}:
        errs.append("aliasing must be {} for transformer cases")
    if errs:
        return errs
    for name in tf_mask_names(m):
        kind = meta["call"][name]
        info = meta["tensors"].get(f"input.{name}")
        if (kind is None) != (info is None):
            errs.append(f"call[{name}]={kind} but tensor {'absent' if info is None else 'present'}")
        elif info is not None:
            want = "bool" if kind == "bool" else ctor["dtype"]
            if info["logical_dtype"] != want:
                errs.append(f"input.{name}: logical_dtype {info['logical_dtype']} vs call {kind}")
    model = tf_build(m, ctor)
    want = {f"param.{k}" for k in model.state_dict()}
    want.update(f"input.{n}" for n in sig["inputs"])
    want.update(f"input.{n}" for n in tf_mask_names(m) if meta["call"][n] is not None)
    want.add("expect.output")
    if meta["grad_mode"]:
        want.add("grad.output")
        want.update(f"expect.grad.{n}" for n in sig["inputs"])
        want.update(f"expect.grad.param.{k}" for k in model.state_dict())
    have = {n for n in tensors if not n.startswith("ref64.")}
    if have != want:
        errs.append(f"missing {sorted(want - have)}, unexpected {sorted(have - want)}")
    if not all(torch.isfinite(t).all().item() for n, t in tensors.items()
               if n.startswith("expect.")):
        errs.append("transformer case holds a non-finite expect.* value")
    return errs


# --------------------------------------------------------------------------------------
# Transformer fixture set (committed) and random configs
# --------------------------------------------------------------------------------------


def _am(kind="bool", pattern="random", dims=2, binary=False):
    spec = {"type": kind, "pattern": pattern, "dims": dims}
    if binary:
        spec["binary"] = True  # float values exactly 0 / -inf
    return spec


def _kp(kind="bool", binary=False, pattern=None):
    spec = {"type": kind}
    if pattern is not None:
        spec["pattern"] = pattern
    if binary:
        spec["binary"] = True
    return spec


def tf_fixture_configs() -> list[dict]:
    C = []

    EL, DL, EN, DE, TR = ENC_LAYER, DEC_LAYER, ENCODER, DECODER, TRANSFORMER

    def add(module, name, desc, **kw):
        if module in (EN, DE, TR):
            # stacks stay small: d=6 ff=12 (float32) or d=4 ff=8 (float64) unless given
            small = kw.get("dtype") == "float64"
            kw.setdefault("d_model", 4 if small else 6)
            kw.setdefault("dim_feedforward", 8 if small else 12)
        C.append(dict(module=module, name=name, description=desc, **kw))

    GELU = {"activation": "gelu"}
    EVAL01 = {"training": False, "grad_mode": False, "dropout": 0.1}

    # --- TransformerEncoderLayer ---
    add(EL, "enc_layer_basic_f32", "encoder layer, post-norm, relu, no masks")
    add(EL, "enc_layer_basic_f64", "encoder layer, post-norm, relu, no masks, float64", **F64)
    add(EL, "enc_layer_norm_first_f32", "encoder layer, pre-norm (norm_first), bool kpm",
        norm_first=True, masks={"src_key_padding_mask": _kp()})
    add(EL, "enc_layer_norm_first_gelu_f64", "encoder layer, pre-norm, gelu, float64",
        norm_first=True, **GELU, **F64)
    add(EL, "enc_layer_eps1e2_f64", "encoder layer, large layer_norm_eps=1e-2, float64",
        layer_norm_eps=1e-2, **F64)
    add(EL, "enc_layer_nobias_f32",
        "encoder layer, bias=False (no MHA, linear or LayerNorm biases), float src_mask",
        bias=False, masks={"src_mask": _am("float")})
    add(EL, "enc_layer_batch_first_f32", "encoder layer, batch_first, bool src_mask + bool kpm",
        batch_first=True, masks={"src_mask": _am(), "src_key_padding_mask": _kp()})
    add(EL, "enc_layer_unbatched_f32", "encoder layer, unbatched 2-D src, bool src_mask",
        N=None, masks={"src_mask": _am()})
    add(EL, "enc_layer_unbatched_float_kpm_f64",
        "encoder layer, unbatched, 1-D float key padding mask, gelu, float64",
        N=None, masks={"src_key_padding_mask": _kp("float")}, **GELU, **F64)
    add(EL, "enc_layer_causal_float_f32",
        "encoder layer, float causal src_mask (generate_square_subsequent_mask), is_causal not passed",
        S=5, masks={"src_mask": _am("float", "causal")})
    add(EL, "enc_layer_causal_bool_is_causal_f32",
        "encoder layer, bool causal src_mask with is_causal=True (SDPA causal)",
        S=5, masks={"src_mask": _am("bool", "causal")}, flags={"is_causal": True})
    add(EL, "enc_layer_is_causal_with_kpm_f64",
        "encoder layer, float causal mask, is_causal=True plus a bool kpm (hint ignored), float64",
        S=5, masks={"src_mask": _am("float", "causal"), "src_key_padding_mask": _kp()},
        flags={"is_causal": True}, **F64)
    add(EL, "enc_layer_mixed_masks_f32",
        "encoder layer, bool src_mask + float kpm (mixed types are canonicalised to float)",
        masks={"src_mask": _am(), "src_key_padding_mask": _kp("float")})
    add(EL, "enc_layer_heads3_d6_mask3d_f32",
        "encoder layer, odd nhead=3 (d=6), 3-D (N*H,S,S) float src_mask",
        d_model=6, nhead=3, masks={"src_mask": _am("float", dims=3)})
    add(EL, "enc_layer_d16_h4_ff32_f32",
        "encoder layer, largest: d=16 nhead=4 ff=32 S=6 N=3, bool 3-D src_mask",
        d_model=16, nhead=4, dim_feedforward=32, S=6, N=3, masks={"src_mask": _am(dims=3)})
    add(EL, "enc_layer_eval_fused_f32",
        "encoder layer, eval+no_grad, batch_first, even nhead, dropout=0.1 (inactive): fused fast path, bool kpm",
        batch_first=True, masks={"src_key_padding_mask": _kp()}, **EVAL01)
    add(EL, "enc_layer_eval_fused_norm_first_gelu_f64",
        "encoder layer, eval+no_grad fused fast path, pre-norm, gelu, 0/-inf float src_mask, float64",
        batch_first=True, norm_first=True, masks={"src_mask": _am("float", binary=True)}, **GELU,
        **EVAL01, **F64)
    add(EL, "enc_layer_eval_grad_f64",
        "encoder layer, eval mode with gradients recorded, dropout=0.1 inactive, float64",
        training=False, grad_mode=True, dropout=0.1, masks={"src_key_padding_mask": _kp()}, **F64)

    # --- TransformerDecoderLayer ---
    add(DL, "dec_layer_basic_f32", "decoder layer, post-norm, relu, no masks (T=3, S=4)")
    add(DL, "dec_layer_basic_f64", "decoder layer, no masks, float64", T=4, S=3, **F64)
    add(DL, "dec_layer_norm_first_gelu_f32", "decoder layer, pre-norm, gelu, bool memory kpm",
        norm_first=True, masks={"memory_key_padding_mask": _kp()}, **GELU)
    add(DL, "dec_layer_nobias_f64", "decoder layer, bias=False, float64, float tgt kpm",
        bias=False, masks={"tgt_key_padding_mask": _kp("float")}, **F64)
    add(DL, "dec_layer_all_masks_f32",
        "decoder layer, float causal tgt_mask, bool memory_mask, bool tgt and memory kpm",
        T=4, S=5, masks={"tgt_mask": _am("float", "causal"), "memory_mask": _am(),
                         "tgt_key_padding_mask": _kp(), "memory_key_padding_mask": _kp()})
    add(DL, "dec_layer_tgt_is_causal_f64",
        "decoder layer, bool causal tgt_mask with tgt_is_causal=True, float64",
        T=5, masks={"tgt_mask": _am("bool", "causal")}, flags={"tgt_is_causal": True}, **F64)
    add(DL, "dec_layer_memory_is_causal_f32",
        "decoder layer, causal float memory_mask (T=S) with memory_is_causal=True, tgt_is_causal=False",
        T=4, S=4, masks={"memory_mask": _am("float", "causal")},
        flags={"tgt_is_causal": False, "memory_is_causal": True})
    add(DL, "dec_layer_batch_first_float_masks_f32",
        "decoder layer, batch_first, 3-D float memory_mask and float memory kpm",
        batch_first=True, masks={"memory_mask": _am("float", dims=3),
                                 "memory_key_padding_mask": _kp("float")})
    add(DL, "dec_layer_unbatched_f64",
        "decoder layer, unbatched, bool tgt_mask, 1-D bool memory kpm, float64",
        N=None, masks={"tgt_mask": _am(), "memory_key_padding_mask": _kp()}, **F64)
    add(DL, "dec_layer_heads3_d6_eps1e2_f32",
        "decoder layer, nhead=3 (d=6), layer_norm_eps=1e-2, 3-D bool tgt_mask",
        d_model=6, nhead=3, layer_norm_eps=1e-2, masks={"tgt_mask": _am(dims=3)})
    add(DL, "dec_layer_eps1e6_gelu_f64", "decoder layer, gelu, layer_norm_eps=1e-6, float64",
        layer_norm_eps=1e-6, masks={"memory_mask": _am("float")}, **GELU, **F64)
    add(DL, "dec_layer_eval_mha_fast_f32",
        "decoder layer, eval+no_grad, batch_first, bool tgt kpm, dropout=0.1: self-attention on MHA fast path",
        batch_first=True, masks={"tgt_key_padding_mask": _kp(), "memory_key_padding_mask": _kp()},
        **EVAL01)
    add(DL, "dec_layer_eval_seq_first_f64",
        "decoder layer, eval+no_grad, seq-first (slow path), float causal tgt_mask, float64",
        masks={"tgt_mask": _am("float", "causal")}, **EVAL01, **F64)

    # --- TransformerEncoder ---
    add(EN, "encoder_2l_nonorm_f32", "TransformerEncoder, 2 layers, no final norm, bool kpm",
        masks={"src_key_padding_mask": _kp()})
    add(EN, "encoder_3l_norm_f64",
        "TransformerEncoder, 3 layers + final LayerNorm, single head (d=4 nhead=1 ff=8), float64",
        d_model=4, nhead=1, dim_feedforward=8, num_layers=3, norm=True, **F64)
    add(EN, "encoder_2l_norm_first_gelu_norm_eps1e6_f32",
        "TransformerEncoder, 2 pre-norm gelu layers, eps=1e-6, final norm eps=1e-6",
        norm_first=True, layer_norm_eps=1e-6, norm=True, **GELU)
    add(EN, "encoder_causal_detect_float_f32",
        "TransformerEncoder, float causal mask, is_causal not passed: detected as causal",
        S=5, masks={"mask": _am("float", "causal")})
    add(EN, "encoder_causal_detect_bool_kpm_f64",
        "TransformerEncoder, bool causal mask + bool kpm, is_causal not passed: detected (MHA then ignores the hint), float64",
        S=5, norm=True, masks={"mask": _am("bool", "causal"), "src_key_padding_mask": _kp()},
        d_model=6, dim_feedforward=12, **F64)
    add(EN, "encoder_is_causal_explicit_f32",
        "TransformerEncoder, explicit is_causal=True with its bool causal mask, 3 layers",
        S=5, num_layers=3, masks={"mask": _am("bool", "causal")}, flags={"is_causal": True})
    add(EN, "encoder_random_mask_not_causal_f32",
        "TransformerEncoder, random float mask: detection says not causal",
        masks={"mask": _am("float")})
    add(EN, "encoder_unbatched_kpm_f64",
        "TransformerEncoder, unbatched, 1-D bool kpm, final norm eps=1e-2, float64",
        N=None, norm=True, norm_eps=1e-2, masks={"src_key_padding_mask": _kp()}, **F64)
    add(EN, "encoder_batch_first_nobias_f32",
        "TransformerEncoder, batch_first, bias=False layers, final norm, float kpm",
        batch_first=True, bias=False, norm=True, masks={"src_key_padding_mask": _kp("float")})
    add(EN, "encoder_heads3_eps1e2_f32",
        "TransformerEncoder, nhead=3 (d=6), layer_norm_eps=1e-2, 3-D bool causal mask (3-D: not detected as causal)",
        d_model=6, nhead=3, layer_norm_eps=1e-2, masks={"mask": _am("bool", "causal", dims=3)})
    add(EN, "encoder_eval_seq_first_kpm_f32",
        "TransformerEncoder, eval+no_grad, seq-first, bool kpm, dropout=0.1 inactive (slow path)",
        norm=True, masks={"src_key_padding_mask": _kp()}, **EVAL01)
    add(EN, "encoder_eval_fused_causal_f64",
        "TransformerEncoder, eval+no_grad, batch_first, float causal mask (detected): fused layer path, float64",
        batch_first=True, S=5, masks={"mask": _am("float", "causal")}, **EVAL01, **F64)

    # TransformerEncoder's nested-tensor ("sparsity") path: eval+no_grad, batch_first,
    # post-norm layers with bias and an even nhead, a key padding mask and no mask
    NESTED = {"batch_first": True, "N": 3, "S": 5, "allow_nested": True, **EVAL01}
    add(EN, "encoder_nested_tail_kpm_f32",
        "TransformerEncoder, eval+no_grad, left-aligned bool kpm: nested-tensor path, padded positions 0, final norm",
        norm=True, masks={"src_key_padding_mask": _kp(pattern="tail")}, **NESTED)
    add(EN, "encoder_nested_off_tail_kpm_f32",
        "TransformerEncoder(enable_nested_tensor=False), eval+no_grad, left-aligned bool kpm: the layers' own path",
        enable_nested_tensor=False, masks={"src_key_padding_mask": _kp(pattern="tail")},
        **NESTED)
    add(EN, "encoder_mask_check_holes_kpm_f64",
        "TransformerEncoder, eval+no_grad, bool kpm with holes (not left-aligned), mask_check=True: no nested path, float64",
        mask_check=True, masks={"src_key_padding_mask": _kp(pattern="holes")}, **{**NESTED, "allow_nested": False},
        **F64)
    add(EN, "encoder_mask_check_off_holes_kpm_f32",
        "TransformerEncoder(mask_check=False), eval+no_grad, bool kpm with holes: the nested path keeps each row's first n positions, n its unpadded count",
        mask_check=False, masks={"src_key_padding_mask": _kp(pattern="holes")}, **NESTED)
    add(EN, "encoder_nested_nan_in_padding_f32",
        "TransformerEncoder, eval+no_grad, left-aligned bool kpm, NaN in src at the padded positions: the nested path drops them (finite output)",
        nan_in_padded_src=True, norm=True, masks={"src_key_padding_mask": _kp(pattern="tail")},
        **NESTED)
    add(EN, "encoder_nested_float_kpm_f64",
        "TransformerEncoder, eval+no_grad, left-aligned float kpm (0/-inf): nested-tensor path, float64",
        norm=True, masks={"src_key_padding_mask": _kp("float", binary=True, pattern="tail")},
        **NESTED, **F64)

    # --- TransformerDecoder ---
    add(DE, "decoder_2l_nonorm_f32", "TransformerDecoder, 2 layers, no final norm")
    add(DE, "decoder_3l_norm_f64",
        "TransformerDecoder, 3 layers + final LayerNorm, d=4 nhead=2 ff=8, memory kpm, float64",
        d_model=4, dim_feedforward=8, num_layers=3, norm=True,
        masks={"memory_key_padding_mask": _kp()}, **F64)
    add(DE, "decoder_causal_detect_float_f32",
        "TransformerDecoder, float causal tgt_mask, tgt_is_causal not passed: detected",
        T=5, masks={"tgt_mask": _am("float", "causal")})
    add(DE, "decoder_causal_detect_bool_kpm_f32",
        "TransformerDecoder, bool causal tgt_mask + bool tgt and memory kpm: detected, hint ignored",
        T=4, norm=True, masks={"tgt_mask": _am("bool", "causal"),
                               "tgt_key_padding_mask": _kp(), "memory_key_padding_mask": _kp()})
    add(DE, "decoder_tgt_is_causal_explicit_f64",
        "TransformerDecoder, explicit tgt_is_causal=True with float causal tgt_mask, memory_is_causal=False, d=4 nhead=4 (head dim 1), float64",
        T=4, d_model=4, nhead=4, dim_feedforward=8, masks={"tgt_mask": _am("float", "causal")},
        flags={"tgt_is_causal": True, "memory_is_causal": False}, **F64)
    add(DE, "decoder_norm_first_gelu_batch_first_f32",
        "TransformerDecoder, pre-norm gelu, batch_first, final norm, float memory_mask",
        norm_first=True, batch_first=True, norm=True, masks={"memory_mask": _am("float")},
        **GELU)
    add(DE, "decoder_unbatched_nobias_f32",
        "TransformerDecoder, unbatched, bias=False, bool tgt kpm and memory_mask",
        N=None, bias=False, masks={"tgt_key_padding_mask": _kp(), "memory_mask": _am()})
    add(DE, "decoder_heads3_eps1e6_f64",
        "TransformerDecoder, nhead=3 (d=6), ff=12, eps=1e-6, final norm eps=1e-5, float64",
        d_model=6, nhead=3, dim_feedforward=12, layer_norm_eps=1e-6, norm=True, norm_eps=1e-5, **F64)
    add(DE, "decoder_eval_mha_fast_f32",
        "TransformerDecoder, eval+no_grad, batch_first, bool causal tgt_mask + bool tgt kpm, dropout=0.1",
        batch_first=True, T=4, masks={"tgt_mask": _am("bool", "causal"),
                                      "tgt_key_padding_mask": _kp()}, **EVAL01)

    # --- Transformer ---
    add(TR, "transformer_basic_f32", "Transformer, 1 encoder + 1 decoder layer, no masks",
        d_model=6, nhead=2, dim_feedforward=12)
    add(TR, "transformer_all_masks_f32",
        "Transformer, 2 encoder + 1 decoder layers, all six masks: bool src_mask, float causal tgt_mask, float memory_mask, bool kpms",
        num_encoder_layers=2, num_decoder_layers=1, S=5, T=4,
        masks={"src_mask": _am(), "tgt_mask": _am("float", "causal"),
               "memory_mask": _am("float"), "src_key_padding_mask": _kp(),
               "tgt_key_padding_mask": _kp(), "memory_key_padding_mask": _kp()})
    add(TR, "transformer_all_masks_batch_first_f64",
        "Transformer, batch_first, all six masks (3-D bool src_mask, bool causal tgt_mask, float kpms), d=4 ff=8, float64",
        batch_first=True, d_model=4, dim_feedforward=8, num_decoder_layers=2, S=4, T=4,
        masks={"src_mask": _am(dims=3), "tgt_mask": _am("bool", "causal"),
               "memory_mask": _am(), "src_key_padding_mask": _kp("float"),
               "tgt_key_padding_mask": _kp("float"), "memory_key_padding_mask": _kp("float")},
        **F64)
    add(TR, "transformer_norm_first_gelu_nobias_f32",
        "Transformer, pre-norm, gelu, bias=False, float causal tgt_mask",
        norm_first=True, bias=False, masks={"tgt_mask": _am("float", "causal")}, **GELU)
    add(TR, "transformer_unbatched_f64",
        "Transformer, unbatched, bool src_mask, float causal tgt_mask, 1-D bool memory kpm, d=4 ff=8, float64",
        N=None, d_model=4, dim_feedforward=8, masks={"src_mask": _am(), "tgt_mask": _am("float", "causal"),
                       "memory_key_padding_mask": _kp()}, **F64)
    add(TR, "transformer_causal_flags_f32",
        "Transformer, src_is_causal=True and tgt_is_causal=True with causal masks, memory_is_causal=False",
        S=4, T=4, masks={"src_mask": _am("bool", "causal"), "tgt_mask": _am("float", "causal")},
        flags={"src_is_causal": True, "tgt_is_causal": True, "memory_is_causal": False})
    add(TR, "transformer_heads3_eps1e2_f32",
        "Transformer, nhead=3 (d=6), layer_norm_eps=1e-2, batch_first, bool kpms",
        d_model=6, nhead=3, layer_norm_eps=1e-2, batch_first=True,
        masks={"src_key_padding_mask": _kp(), "tgt_key_padding_mask": _kp()})
    add(TR, "transformer_eval_f32",
        "Transformer, eval+no_grad, seq-first, dropout=0.1 inactive, float causal tgt_mask + bool src kpm",
        masks={"tgt_mask": _am("float", "causal"), "src_key_padding_mask": _kp()}, **EVAL01)
    # --- bfloat16 (graded against float64 references, docs/case-format.md §5) ---
    BF16T = {"dtype": "bfloat16", "d_model": 32, "nhead": 4, "dim_feedforward": 64}
    add(EL, "bf16_enc_layer_gelu_kpm", "bfloat16 encoder layer, gelu, bool kpm",
        S=9, masks={"src_key_padding_mask": _kp()}, **GELU, **BF16T)
    add(EL, "bf16_enc_layer_norm_first_causal", "bfloat16 encoder layer, pre-norm, is_causal",
        S=8, norm_first=True, masks={"src_mask": _am("bool", "causal")},
        flags={"is_causal": True}, **BF16T)
    add(DL, "bf16_dec_layer_causal_memory_kpm",
        "bfloat16 decoder layer, causal tgt_mask, bool memory kpm",
        T=6, S=8, masks={"tgt_mask": _am("float", "causal"), "memory_key_padding_mask": _kp()},
        **BF16T)
    add(EN, "bf16_encoder_stack_eval", "bfloat16 encoder stack of 2, final norm, eval forward",
        S=7, norm=True, training=False, grad_mode=False, **BF16T)
    BF16E = {"training": False, "grad_mode": False}
    add(EL, "bf16_enc_layer_gelu_kpm_eval",
        "bfloat16 encoder layer, gelu, bool kpm, eval forward under no_grad (bf16 products)",
        S=12, masks={"src_key_padding_mask": _kp()}, **GELU, **BF16T, **BF16E)
    add(EL, "bf16_enc_layer_wide_eval",
        "bfloat16 encoder layer d=64 ff=256 (two k blocks of the bf16 product), eval forward",
        S=12, **{**BF16T, "d_model": 64, "dim_feedforward": 256}, **BF16E)
    add(EL, "bf16_enc_layer_dropout01_eval_grad",
        "bfloat16 encoder layer, dropout=0.1 configured, eval mode with gradients, bool kpm",
        S=10, dropout=0.1, training=False, grad_mode=True,
        masks={"src_key_padding_mask": _kp()}, **BF16T)
    # --- torch.autocast to bfloat16 over f32 layers (graded against float64 references) ---
    AC = {"autocast": "bfloat16", "d_model": 16, "nhead": 4, "dim_feedforward": 32}
    add(EL, "autocast_enc_layer_relu_kpm", "encoder layer under torch.autocast(bfloat16), bool kpm",
        S=9, masks={"src_key_padding_mask": _kp()}, **AC)
    add(EL, "autocast_enc_layer_norm_first_gelu_causal",
        "encoder layer under torch.autocast(bfloat16), pre-norm, gelu, float causal src_mask",
        S=8, norm_first=True, masks={"src_mask": _am("float", "causal")}, **GELU, **AC)
    add(DL, "autocast_dec_layer_gelu_memory_kpm",
        "decoder layer under torch.autocast(bfloat16), gelu, causal tgt_mask, bool memory kpm",
        T=6, S=8, masks={"tgt_mask": _am("bool", "causal"), "memory_key_padding_mask": _kp()},
        **GELU, **AC)
    add(DL, "bf16_dec_layer_eval",
        "bfloat16 decoder layer, float causal tgt_mask, eval forward under no_grad",
        T=7, S=9, masks={"tgt_mask": _am("float", "causal")}, **BF16T, **BF16E)
    return C


def tf_random_config(rng: random.Random, index: int, module: str) -> dict:
    d_model = rng.choice([4, 6, 8, 12, 16])
    nhead = rng.choice([h for h in range(1, d_model + 1) if d_model % h == 0 and h <= 8])
    grad_mode = rng.random() < 0.7
    training = grad_mode and rng.random() < 0.8
    dropout = 0.0 if training else rng.choice([0.0, 0.1, 0.3])
    N = None if rng.random() < 0.2 else rng.randint(1, 3)
    S, T = rng.randint(1, 6), rng.randint(1, 6)
    masks, flags = {}, {}
    for am_name, kp_name, lq, sk in TF_SIGNATURES[module]["blocks"]:
        square = lq == sk or S == T
        if rng.random() < 0.5:
            pattern = "causal" if square and rng.random() < 0.4 else rng.choice(["random", "none"])
            masks[am_name] = _am(rng.choice(["bool", "float"]), pattern,
                                 2 if rng.random() < 0.75 else 3, binary=rng.random() < 0.3)
        if rng.random() < 0.4:
            masks[kp_name] = _kp(rng.choice(["bool", "float"]), binary=rng.random() < 0.3)
    for flag in TF_SIGNATURES[module]["flags"]:
        r = rng.random()
        if r < 0.6:
            continue  # not passed
        # is_causal=True only with a causal mask of the block it belongs to
        am_name = {"is_causal": TF_SIGNATURES[module]["blocks"][0][0],
                   "src_is_causal": "src_mask", "tgt_is_causal": "tgt_mask",
                   "memory_is_causal": "memory_mask"}[flag]
        causal = (masks.get(am_name) or {}).get("pattern") == "causal"
        flags[flag] = causal and r < 0.85
    return dict(
        name=f"random_{index:04d}",
        module=module,
        d_model=d_model, nhead=nhead, dim_feedforward=rng.choice([4, 8, 16, 32]),
        dropout=dropout, activation=rng.choice(["relu", "gelu"]),
        layer_norm_eps=rng.choice([1e-5, 1e-6, 1e-2]),
        batch_first=rng.random() < 0.5, norm_first=rng.random() < 0.4,
        bias=rng.random() < 0.8, dtype=rng.choice(["float32", "float64"]),
        num_layers=rng.randint(1, 3), norm=rng.random() < 0.5,
        norm_eps=rng.choice([None, 1e-5, 1e-6]),
        num_encoder_layers=rng.randint(1, 2), num_decoder_layers=rng.randint(1, 2),
        training=training, grad_mode=grad_mode, S=S, T=T, N=N, masks=masks, flags=flags,
    )


# --------------------------------------------------------------------------------------
# Module-kind registry
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# torch.nn.functional.scaled_dot_product_attention
# --------------------------------------------------------------------------------------
#
# Config dict: name, description, dtype, grad_mode, N (None: 3-D inputs without a batch),
# H (query heads), Hkv (key/value heads; < H needs enable_gqa), L, S, E, Ev,
# mask None or {"type": "bool"|"float", "full_row": bool, "broadcast": bool},
# is_causal, scale (None or a float), enable_gqa.
# A bool mask has SDPA's polarity: True means the position takes part.

SDPA = "torch.nn.functional.scaled_dot_product_attention"

SDPA_DEFAULTS = dict(dtype="float32", grad_mode=True, N=2, H=2, Hkv=None, L=4, S=5, E=8, Ev=None,
                     mask=None, is_causal=False, scale=None, enable_gqa=False, key_scale=None,
                     autocast=None)


def sdpa_full_config(cfg: dict) -> dict:
    c = dict(SDPA_DEFAULTS)
    c.update(cfg)
    c["Hkv"] = c["Hkv"] or c["H"]
    c["Ev"] = c["Ev"] or c["E"]
    c.setdefault("seed", seed_for(c["name"]))
    return c


def sdpa_call(q, k, v, mask, call: dict, autocast: str | None = None):
    """The call, inside torch.autocast("cpu", dtype) when ``autocast`` names a dtype; the
    autocast output (in that dtype) is widened to the case's float32, exactly."""
    cast = (torch.autocast("cpu", dtype=AUTOCAST_DTYPES[autocast]) if autocast
            else contextlib.nullcontext())
    with cast:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=call["is_causal"],
            scale=call["scale"], enable_gqa=call["enable_gqa"])
    return out.float() if autocast else out


def sdpa_make_case(cfg: dict, out_dir: Path | None, allow_nan: bool = False) -> dict:
    c = sdpa_full_config(cfg)
    dtype = DTYPES[c["dtype"]]
    torch.manual_seed(c["seed"])
    lead = () if c["N"] is None else (c["N"],)
    # H = 0: no head dimension (2-D inputs without N).
    hq, hk = ((c["H"],), (c["Hkv"],)) if c["H"] else ((), ())
    q = torch.randn(lead + hq + (c["L"], c["E"]), dtype=dtype)
    k = torch.randn(lead + hk + (c["S"], c["E"]), dtype=dtype)
    if c["key_scale"] is not None:
        # Keys far out: each row's softmax one-hot (saturated), where the exact query and key
        # gradients are 0.
        k = (k * c["key_scale"]).to(dtype)
    v = torch.randn(lead + hk + (c["S"], c["Ev"]), dtype=dtype)
    mask = None
    if c["mask"] is not None:
        shp = (c["L"], c["S"]) if c["mask"].get("broadcast") else lead + hq + (c["L"], c["S"])
        if c["mask"].get("shape"):  # an explicit broadcast shape, e.g. (1, L, S)
            shp = tuple(c["mask"]["shape"])
        take = torch.rand(shp) < 0.7
        if c["mask"].get("full_row"):
            take[..., 0, :] = False
        if c["mask"]["type"] == "bool":
            mask = take
        else:
            mask = torch.where(take, torch.zeros(shp), torch.randn(shp) - 3.0).to(dtype)
            if c["mask"].get("full_row"):
                mask[..., 0, :] = float("-inf")
    call = {"dropout_p": 0.0, "is_causal": c["is_causal"], "scale": c["scale"],
            "enable_gqa": c["enable_gqa"], "attn_mask": c["mask"]["type"] if c["mask"] else None}
    if c["grad_mode"]:
        for t in (q, k, v):
            t.requires_grad_(True)
    try:
        with torch.set_grad_enabled(c["grad_mode"]):
            out = sdpa_call(q, k, v, mask, call, c["autocast"])
    except (RuntimeError, ValueError) as e:
        raise SkipCase(f"PyTorch raised: {e}") from e
    tensors = {"input.query": q, "input.key": k, "input.value": v}
    if mask is not None:
        tensors["input.attn_mask"] = mask
    if c["grad_mode"]:
        g = torch.randn(out.shape, dtype=dtype)
        (out * g).sum().backward()
        tensors["grad.output"] = g
    tensors["expect.output"] = out
    if c["grad_mode"]:
        for n, t in (("query", q), ("key", k), ("value", v)):
            tensors[f"expect.grad.{n}"] = t.grad
    nan = has_nan([t for n, t in tensors.items() if n.startswith("expect.")])
    if nan and not allow_nan:
        raise SkipCase("result contains NaN")
    meta = {
        "format_version": FORMAT_VERSION,
        "module": SDPA,
        "constructor": {"dtype": c["dtype"]},
        "training": False,
        "grad_mode": c["grad_mode"],
        "call": call,
        "aliasing": {"key_is_query": False, "value_is_key": False},
        "suggested_tolerance": SUGGESTED_TOLERANCE,
        "seed": c["seed"],
        "torch_version": torch.__version__,
        "description": c.get("description", ""),
        "nan": nan,
    }
    if c["autocast"]:
        meta["autocast"] = c["autocast"]
    return finish_case(out_dir, meta, tensors)


def sdpa_replay(meta: dict, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    call = meta["call"]
    grad = meta["grad_mode"]
    q, k, v = (tensors[f"input.{n}"].clone().requires_grad_(grad) for n in ("query", "key", "value"))
    mask = logical(tensors, meta, "input.attn_mask") if "input.attn_mask" in tensors else None
    with torch.set_grad_enabled(grad):
        out = sdpa_call(q, k, v, mask, call, meta.get("autocast"))
    res = {"output": out.detach()}
    if grad:
        (out * tensors["grad.output"]).sum().backward()
        res.update({"grad.query": q.grad, "grad.key": k.grad, "grad.value": v.grad})
    return res


def sdpa_check_contract(meta: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    want = {"input.query", "input.key", "input.value", "expect.output"}
    if meta["call"]["attn_mask"]:
        want.add("input.attn_mask")
    if meta["grad_mode"]:
        want |= {"grad.output", "expect.grad.query", "expect.grad.key", "expect.grad.value"}
    missing = sorted(want - {n for n in tensors if not n.startswith("ref64.")})
    return [f"missing {m}" for m in missing]


def sdpa_fixture_configs() -> list[dict]:
    out = []

    def add(name, desc, **kw):
        out.append(dict(name=name, description=desc, **kw))

    for dt, tag in (("float32", "f32"), ("float64", "f64"), ("bfloat16", "bf16")):
        add(f"sdpa_plain_{tag}", "no mask, 4-D, default scale", dtype=dt)
        add(f"sdpa_causal_l_lt_s_{tag}", "is_causal with L < S (upper-left)", dtype=dt,
            is_causal=True, L=3, S=6)
        add(f"sdpa_bool_mask_{tag}", "bool mask (True takes part), one fully masked row",
            dtype=dt, mask={"type": "bool", "full_row": True})
        add(f"sdpa_float_mask_broadcast_{tag}", "float (L, S) mask broadcast over N and H",
            dtype=dt, mask={"type": "float", "broadcast": True})
        add(f"sdpa_gqa_scale_{tag}", "enable_gqa with 4 query heads over 2, explicit scale, Ev != E",
            dtype=dt, H=4, Hkv=2, enable_gqa=True, scale=0.3, Ev=6)
    # PyTorch's bf16 CPU attention takes its math path (f32 products, no bf16 rounding of the
    # probabilities) for Ev != E and for a 3-D mask on 4-D inputs; bf16 products must not
    # round there either.
    add("sdpa_ev_ne_e_math_bf16", "bfloat16, Ev != E with gradients (PyTorch's math path)",
        dtype="bfloat16", N=1, H=1, L=8, S=8, E=32, Ev=3, scale=2.0)
    add("sdpa_mask_3d_math_bf16", "bfloat16, a (1, L, S) float mask on 4-D inputs (math path)",
        dtype="bfloat16", N=1, H=2, L=8, S=8, E=16, scale=2.0,
        mask={"type": "float", "shape": [1, 8, 8]})
    add("sdpa_unbatched_eval_f32", "3-D inputs, forward only", N=None, grad_mode=False,
        L=7, S=7, is_causal=True)
    # A 1-D (S,) mask broadcasts on 3-D inputs (PyTorch 2.15 raises IndexError for it on 4-D
    # inputs, where multihead broadcasts it too).
    add("sdpa_mask_1d_unbatched_f32", "3-D inputs, a 1-D (S,) float mask, with gradients",
        N=None, L=5, S=7, mask={"type": "float", "shape": [7]})
    # 2-D (L, E) inputs: one head, no batch (the tutorials' single-head attention).
    add("sdpa_2d_causal_f32", "2-D inputs, is_causal with L > S, with gradients", N=None, H=0,
        L=7, S=5, is_causal=True)
    add("sdpa_2d_float_mask_f64", "2-D inputs, a float (L, S) mask, Ev != E, float64",
        dtype="float64", N=None, H=0, L=6, S=9, Ev=3, scale=0.7, mask={"type": "float"})
    add("sdpa_2d_bool_mask_bf16", "2-D inputs, bfloat16, a bool mask with a fully masked row",
        dtype="bfloat16", N=None, H=0, L=5, S=40, E=16, mask={"type": "bool", "full_row": True})
    add("sdpa_long_f32", "longer keys than one kernel tile (S = 300)", N=1, L=16, S=300, E=8,
        mask={"type": "bool"})
    # One-hot rows: dP_j - D must cancel exactly, or the huge keys amplify the rounding left
    # (`D = rowsum(O∘dO)` summed in the bf16 products' own order).
    add("sdpa_saturated_keys_bf16",
        "bfloat16, keys scaled by 1e20 (one-hot softmax rows), head dim 80, with gradients",
        dtype="bfloat16", N=1, H=2, L=3, S=2, E=80, key_scale=1e20)
    add("sdpa_eval_long_bf16",
        "bfloat16, forward only (bf16 products), S = 300, odd E and Ev, bool mask",
        dtype="bfloat16", grad_mode=False, N=2, L=20, S=300, E=9, Ev=7, mask={"type": "bool"})
    # torch.autocast over f32 inputs: PyTorch's autocast casts q, k, v and a float mask to
    # the autocast dtype; the case stores its output widened to float32.
    add("sdpa_autocast_bf16_float_mask", "torch.autocast(bfloat16), float (L, S) mask, gradients",
        N=2, H=2, L=9, S=20, E=16, mask={"type": "float", "broadcast": True}, autocast="bfloat16")
    add("sdpa_autocast_bf16_causal_gqa",
        "torch.autocast(bfloat16), is_causal, enable_gqa (4 query heads over 2), gradients",
        N=1, H=4, Hkv=2, enable_gqa=True, L=12, S=12, E=8, is_causal=True, autocast="bfloat16")
    add("sdpa_autocast_f16_bool_mask", "torch.autocast(float16), bool mask, gradients",
        N=2, H=2, L=6, S=33, E=16, mask={"type": "bool"}, autocast="float16")
    return out


def sdpa_random_config(rng: random.Random, index: int) -> dict:
    H = rng.choice([1, 2, 4])
    gqa = H > 1 and rng.random() < 0.3
    N = rng.choice([None, 1, 3])
    if N is None and rng.random() < 0.3:
        H, gqa = 0, False  # 2-D inputs
    return dict(
        name=f"random_{index:04d}_sdpa", dtype=rng.choice(["float32", "float64"]),
        grad_mode=rng.random() < 0.8, N=N, H=H,
        Hkv=(H // 2 if gqa else H), enable_gqa=gqa, L=rng.randint(1, 9), S=rng.randint(1, 9),
        E=rng.choice([1, 3, 8, 16]), Ev=rng.choice([None, 5]),
        mask=rng.choice([None, {"type": "bool"}, {"type": "float", "broadcast": True}]),
        is_causal=False, scale=rng.choice([None, 0.5]))

MODULE_KINDS = {
    MHA: {
        "make_case": mha_make_case,
        "replay": mha_replay,
        "check_contract": mha_check_contract,
        "fixtures": mha_fixture_configs,
        "random": mha_random_config,
    },
    SDPA: {
        "make_case": sdpa_make_case,
        "replay": sdpa_replay,
        "check_contract": sdpa_check_contract,
        "fixtures": sdpa_fixture_configs,
        "random": sdpa_random_config,
    },
}


def _tf_kind(module: str) -> dict:
    short = next(k for k, v in KIND_NAMES.items() if v == module)

    def fixtures():
        return [c for c in tf_fixture_configs() if c["module"] == module]

    def rand(rng, index):
        cfg = tf_random_config(rng, index, module)
        cfg["name"] = f"random_{index:04d}_{short}"
        return cfg

    return {
        "make_case": tf_make_case,
        "replay": tf_replay,
        "check_contract": tf_check_contract,
        "fixtures": fixtures,
        "random": rand,
    }


for _m in TF_MODULES:
    MODULE_KINDS[_m] = _tf_kind(_m)

# Groups usable wherever kinds are named on the command line.
KIND_GROUPS = {
    "transformers": TF_MODULES,
    "all": [MHA, "torch.nn.functional.scaled_dot_product_attention"] + TF_MODULES,
}


def resolve_kinds(spec: str) -> list[str]:
    """'mha', 'encoder_layer,decoder', 'transformers', 'all' -> module class paths."""
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if part in KIND_GROUPS:
            mods = KIND_GROUPS[part]
        elif part in KIND_NAMES:
            mods = [KIND_NAMES[part]]
        elif part in MODULE_KINDS:
            mods = [part]
        else:
            raise SystemExit(f"unknown kind {part!r}; use one of "
                             f"{sorted(KIND_NAMES) + sorted(KIND_GROUPS)}")
        out += [m for m in mods if m not in out]
    return out


# --------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------

REQUIRED_KEYS = ["format_version", "module", "constructor", "training", "grad_mode", "call",
                 "aliasing", "tensors", "suggested_tolerance"]


def verify_case(case_dir: Path) -> tuple[bool, str]:
    meta, tensors = load_case(case_dir)
    errs = [f"missing key {k}" for k in REQUIRED_KEYS if k not in meta]
    if errs:
        return False, "; ".join(errs)
    if meta["format_version"] != FORMAT_VERSION:
        errs.append(f"format_version {meta['format_version']}")
    kind = MODULE_KINDS.get(meta["module"])
    if kind is None:
        return False, f"unknown module {meta['module']}"
    # tensors table vs file
    if set(meta["tensors"]) != set(tensors):
        errs.append("tensors table does not match the file")
    for name, t in tensors.items():
        info = meta["tensors"].get(name)
        if info is None:
            continue
        if info["shape"] != list(t.shape) or info["dtype"] != DTYPE_NAMES.get(t.dtype):
            errs.append(f"{name}: table {info} vs file {list(t.shape)} {t.dtype}")
        want_logical = "bool" if t.dtype == torch.uint8 else DTYPE_NAMES.get(t.dtype)
        if info["logical_dtype"] != want_logical:
            errs.append(f"{name}: logical_dtype {info['logical_dtype']}")
        if (t.is_floating_point() and not name.startswith("ref64.")
                and t.dtype != DTYPES[meta["constructor"]["dtype"]]):
            errs.append(f"{name}: dtype {t.dtype} is not the case dtype")
    errs += kind["check_contract"](meta, tensors)
    if errs:
        return False, "; ".join(errs)

    res = kind["replay"](meta, tensors)
    tol = meta["suggested_tolerance"][meta["constructor"]["dtype"]]  # bf16 cases carry theirs
    worst = 0.0
    for name, exp in tensors.items():
        if not name.startswith("expect."):
            continue
        key = name[len("expect."):]
        got = res.get(key)
        if got is None:
            errs.append(f"{name}: not produced by the replay")
            continue
        t = tol["grad" if key.startswith("grad.") else "forward"]
        if got.shape != exp.shape:
            errs.append(f"{name}: shape {list(got.shape)} vs {list(exp.shape)}")
            continue
        if not torch.allclose(got, exp, rtol=t["rtol"], atol=t["atol"], equal_nan=True):
            errs.append(f"{name}: max abs err {(got - exp).abs().max().item():.3g}")
        finite = torch.isfinite(exp) & torch.isfinite(got)
        if finite.any():
            worst = max(worst, (got - exp)[finite].abs().max().item())
    if set(res) - {n[len("expect."):] for n in tensors if n.startswith("expect.")}:
        errs.append(f"replay produced unexpected {sorted(set(res))}")
    if meta.get("nan") is not None and meta["nan"] != has_nan(
            [t for n, t in tensors.items() if n.startswith("expect.")]):
        errs.append("nan flag is wrong")
    if errs:
        return False, "; ".join(errs)
    return True, f"worst abs err {worst:.3g}"


def find_cases(roots: list[Path]) -> list[Path]:
    out = []
    for r in roots:
        if (r / "case.json").exists():
            out.append(r)
        else:
            out += sorted(p.parent for p in r.rglob("case.json"))
    return out


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def cmd_fixtures(args) -> int:
    out = Path(args.out)
    names = set()
    n = 0
    for module in resolve_kinds(args.kind):
        kind = MODULE_KINDS[module]
        for cfg in kind["fixtures"]():
            if cfg["name"] in names:
                raise SystemExit(f"duplicate case name {cfg['name']}")
            names.add(cfg["name"])
            try:
                kind["make_case"](cfg, out / cfg["name"])
            except SkipCase as e:
                raise SystemExit(f"fixture {cfg['name']} is invalid: {e}")
            if cfg.get("dtype") == "bfloat16" or cfg.get("autocast"):
                add_f64_reference(out / cfg["name"], kind["replay"])
            n += 1
    stale = [p.parent.name for p in out.glob("*/case.json") if p.parent.name not in names]
    if stale:
        print(f"note: {len(stale)} case dirs not in the fixed set were left alone: {stale}",
              file=sys.stderr)
    print(f"wrote {n} cases to {out}")
    return 0


def cmd_random(args) -> int:
    out = Path(args.out)
    rng = random.Random(args.seed)
    modules = resolve_kinds(args.kinds)
    written, tries = 0, 0
    while written < args.count:
        tries += 1
        if tries > 100 * args.count + 100:
            raise SystemExit("too many rejected draws")
        # with one kind the draw sequence is the same as before kinds existed
        module = modules[0] if len(modules) == 1 else rng.choice(modules)
        kind = MODULE_KINDS[module]
        cfg = kind["random"](rng, written)
        cfg["seed"] = rng.randrange(2**31)
        if args.dtype:
            # after the draw, so that the shapes, masks and flags are those of the same seed
            # without --dtype
            cfg["dtype"] = args.dtype
        try:
            # writes only once the case is known to be usable
            kind["make_case"](cfg, out / cfg["name"])
        except SkipCase:
            continue
        if cfg["dtype"] == "bfloat16":
            add_f64_reference(out / cfg["name"], kind["replay"])
        written += 1
    print(f"wrote {written} random cases to {out} ({tries - written} draws rejected)")
    return 0


def cmd_verify(args) -> int:
    cases = find_cases([Path(d) for d in args.dirs])
    failed = 0
    for c in cases:
        try:
            ok, msg = verify_case(c)
        except Exception as e:  # noqa: BLE001 - report any failure per case
            ok, msg = False, f"{type(e).__name__}: {e}"
        failed += not ok
        if not ok or args.verbose:
            print(f"{'ok  ' if ok else 'FAIL'} {c}: {msg}")
    print(f"{len(cases) - failed} passed, {failed} failed")
    return 1 if failed or not cases else 0


def main(argv=None) -> int:
    torch.set_num_threads(1)  # bit-for-bit reproducible reruns
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    kinds_help = ("comma-separated: mha, encoder_layer, decoder_layer, encoder, decoder, "
                  "transformer, or the groups transformers (the five transformer modules), all")
    f = sub.add_parser("fixtures", help="write the fixed, committed set")
    f.add_argument("--out", required=True)
    f.add_argument("--kind", default="mha",
                   help=f"which fixed sets to write (default mha); {kinds_help}")
    r = sub.add_parser("random", help="write N random valid cases")
    r.add_argument("--count", type=int, required=True)
    r.add_argument("--seed", type=int, required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--kinds", default="mha",
                   help=f"module kinds to draw from, uniformly (default mha); {kinds_help}")
    r.add_argument("--dtype", choices=["float32", "float64", "bfloat16"],
                   help="every case in this dtype (default: float32 or float64, drawn); "
                        "bfloat16 cases carry their float64 references (ref64.*)")
    v = sub.add_parser("verify", help="re-run cases in PyTorch and check the contract")
    v.add_argument("dirs", nargs="+")
    v.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    return {"fixtures": cmd_fixtures, "random": cmd_random, "verify": cmd_verify}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
