#!/usr/bin/env python3
"""Golden cases for SDPA's variants (soft cap, windows, causal alignment, key lengths, ALiBi,
attention sinks).

Two sources, written to tests/fixtures/variants/ (cases.json + tensors.safetensors):

* PyTorch (f32, seeded): `causal_lower_right` through `F.scaled_dot_product_attention`,
  windows and key lengths as the equivalent explicit masks, and the soft cap written out by
  hand (PyTorch has no soft-cap argument); outputs and the gradients of q, k and v of
  `sum(out * g)`. ALiBi as BLOOM builds it (`slope * j`, causal) and as FlashAttention
  defines it (`-slope * |i + offset - j|`), and attention sinks as gpt-oss's eager attention
  in transformers writes them (a softmax column dropped afterwards), with the sinks' gradient;
  a learned bias (a float mask that requires grad) with its gradient.
* ONNX `Attention` (opset 23/24): every f32 node test case the installed `onnx` package ships
  (its inputs and the outputs of its numpy reference), brought into SDPA's form by the
  operator's own input rules: 3-D inputs split into heads, the past keys and values
  concatenated in front, a short mask padded with -inf (False), `is_causal` as a right window
  of 0 around the diagonal offset by the past length, `nonpad_kv_seqlen` as key lengths, the
  soft cap after the masks (ONNX's placement).

    pip install torch safetensors numpy onnx
    python3 tools/variant_cases.py            # writes the fixtures
    python3 tools/variant_cases.py --check    # regenerates in memory and compares

CI never runs this: the fixtures are committed.
"""
import argparse
import glob
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "variants")


def hidden(L, S, causal, offset, left, right, lens, N):
    """Bool (N or 1, 1, L, S): True where the key is hidden by index."""
    i = torch.arange(L).view(L, 1)
    j = torch.arange(S).view(1, S)
    rel = j - i - offset
    h = torch.zeros(L, S, dtype=torch.bool)
    if causal:
        right = 0
    if right is not None:
        h |= rel > right
    if left is not None:
        h |= rel < -left
    h = h.view(1, 1, L, S)
    if lens is not None:
        pad = torch.arange(S).view(1, 1, 1, S) >= torch.tensor(lens).view(N, 1, 1, 1)
        h = h | pad
    return h


def manual(q, k, v, scale, cap, after, attn_add, band):
    """softmax(cap(scale q k^T) + mask) v written out, with -inf for the band."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kk.transpose(-2, -1)) * scale
    if cap is not None and not after:
        s = cap * torch.tanh(s / cap)
    if attn_add is not None:
        s = s + attn_add
    if cap is not None and after:
        s = torch.where(s == -torch.inf, s, cap * torch.tanh(s / cap))
    s = s.masked_fill(band, -torch.inf)
    return torch.softmax(s, -1) @ vv


def pytorch_cases():
    gen = torch.Generator().manual_seed(20261203)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)
    specs = [
        # name, (N, Hq, Hk, L, S, D, Dv), options
        ("pt_lower_right", (2, 2, 2, 5, 9, 8, 8), dict(is_causal=True, align="bottom_right")),
        ("pt_lower_right_gqa", (1, 4, 2, 6, 11, 8, 4), dict(is_causal=True, align="bottom_right")),
        ("pt_sliding_window", (2, 2, 2, 12, 12, 8, 8), dict(is_causal=True, window_left=3)),
        ("pt_two_sided_window", (1, 3, 3, 8, 10, 4, 6), dict(window_left=2, window_right=1)),
        ("pt_kv_lengths", (3, 2, 2, 4, 10, 8, 8), dict(kv_lengths=[10, 4, 7])),
        ("pt_softcap", (2, 2, 2, 7, 9, 8, 8), dict(softcap=0.7, scale=1.3, mask="float")),
        ("pt_softcap_causal_gqa", (2, 4, 2, 9, 9, 8, 8), dict(softcap=2.0, is_causal=True)),
        ("pt_softcap_after_masks", (2, 2, 2, 6, 8, 8, 8), dict(softcap=0.5, after=True, mask="float")),
        ("pt_all", (2, 2, 2, 6, 13, 8, 8),
         dict(is_causal=True, align="bottom_right", window_left=4, kv_lengths=[12, 13], softcap=1.1)),
    ]
    cases, tensors = [], {}
    for name, (N, Hq, Hk, L, S, D, Dv), o in specs:
        q = rnd(N, Hq, L, D).requires_grad_()
        k = rnd(N, Hk, S, D).requires_grad_()
        v = rnd(N, Hk, S, Dv).requires_grad_()
        mask = rnd(L, S) if o.get("mask") == "float" else None
        offset = S - L if o.get("align") == "bottom_right" else 0
        band = hidden(L, S, o.get("is_causal", False), offset, o.get("window_left"),
                      o.get("window_right"), o.get("kv_lengths"), N)
        scale = o.get("scale", 1.0 / D ** 0.5)
        if "softcap" in o:
            out = manual(q, k, v, scale, o["softcap"], o.get("after", False), mask, band)
        elif name.startswith("pt_lower_right"):
            from torch.nn.attention.bias import causal_lower_right
            attend = causal_lower_right(L, S)._materialize(q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, enable_gqa=Hq != Hk)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~band, enable_gqa=Hq != Hk)
        g = rnd(*out.shape)
        dq, dk, dv = torch.autograd.grad((out * g).sum(), (q, k, v))
        t = dict(q=q, k=k, v=v, out=out, g=g, dq=dq, dk=dk, dv=dv)
        if mask is not None:
            t["mask"] = mask
        for key, x in t.items():
            tensors[f"{name}.{key}"] = x.detach().float().contiguous()
        case = dict(name=name, source="pytorch", grads=True, enable_gqa=Hq != Hk)
        case.update({key: val for key, val in o.items() if key not in ("mask", "after")})
        case["softcap_after_masks"] = o.get("after", False)
        case["mask"] = "float" if mask is not None else None
        cases.append(case)
    return cases, tensors


def gpt_oss_attention(q, k, v, scale, sinks, band):
    """transformers' gpt-oss `eager_attention_forward`: the sinks as a softmax column that is
    dropped afterwards."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    w = (q @ kk.transpose(-2, -1)) * scale
    w = w.masked_fill(band, -torch.inf)
    col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], -1)
    combined = torch.cat([w, col], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)
    return probs[..., :-1] @ vv


def bloom_alibi(slopes, S):
    """transformers' BLOOM `build_alibi_tensor` for one unpadded sequence: slope_h * j, (H, 1, S)."""
    return slopes.view(-1, 1, 1) * torch.arange(S).view(1, 1, S)


def distance_alibi(slopes, L, S, offset):
    """FlashAttention's `alibi_slopes`: -slope_h * |i + offset - j|, (H, L, S)."""
    i = torch.arange(L).view(L, 1)
    j = torch.arange(S).view(1, S)
    return -slopes.view(-1, 1, 1) * (i + offset - j).abs().view(1, L, S)


def alibi_slopes(h):
    """ALiBi's slopes for a power-of-two head count: 2^(-8 i / h)."""
    return torch.tensor([2.0 ** (-8.0 * i / h) for i in range(1, h + 1)])


def bias_cases():
    """ALiBi (BLOOM's causal form and FlashAttention's distance form), attention sinks
    (gpt-oss) with the sinks' gradient, and a learned bias with its gradient."""
    gen = torch.Generator().manual_seed(20261204)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)
    specs = [
        # name, (N, Hq, Hk, L, S, D, Dv), options
        ("pt_alibi_bloom_causal", (2, 4, 4, 7, 7, 8, 8), dict(is_causal=True, alibi="bloom")),
        ("pt_alibi_distance", (2, 2, 2, 6, 9, 8, 8), dict(alibi="distance", align="bottom_right")),
        ("pt_alibi_softcap_window", (1, 4, 2, 9, 9, 8, 8),
         dict(alibi="distance", softcap=1.2, is_causal=True, window_left=3)),
        ("pt_sinks", (2, 2, 2, 5, 8, 8, 8), dict(sinks=True)),
        ("pt_sinks_gpt_oss_window", (2, 4, 2, 10, 10, 8, 8),
         dict(sinks=True, is_causal=True, window_left=4)),
    ]
    cases, tensors = [], {}
    for name, (N, Hq, Hk, L, S, D, Dv), o in specs:
        q = rnd(N, Hq, L, D).requires_grad_()
        k = rnd(N, Hk, S, D).requires_grad_()
        v = rnd(N, Hk, S, Dv).requires_grad_()
        offset = S - L if o.get("align") == "bottom_right" else 0
        band = hidden(L, S, o.get("is_causal", False), offset, o.get("window_left"), None, None, N)
        scale = 1.0 / D ** 0.5
        grads_of = [q, k, v]
        t = {}
        case = dict(name=name, source="pytorch", grads=True, enable_gqa=Hq != Hk, mask=None)
        if "sinks" in o:
            sinks = (rnd(Hq) * 2).requires_grad_()
            out = gpt_oss_attention(q, k, v, scale, sinks, band)
            grads_of.append(sinks)
            case["sinks"] = True
        else:
            slopes = alibi_slopes(Hq)
            bias = bloom_alibi(slopes, S) if o["alibi"] == "bloom" else distance_alibi(slopes, L, S, offset)
            cap = o.get("softcap")
            g = Hq // Hk
            kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            sc = (q @ kk.transpose(-2, -1)) * scale
            if cap is not None:
                sc = cap * torch.tanh(sc / cap)
            out = torch.softmax((sc + bias).masked_fill(band, -torch.inf), -1) @ vv
            case["alibi_slopes"] = [float(x) for x in slopes]
        g = rnd(*out.shape)
        grads = torch.autograd.grad((out * g).sum(), grads_of)
        t.update(q=q, k=k, v=v, out=out, g=g, dq=grads[0], dk=grads[1], dv=grads[2])
        if "sinks" in o:
            t.update(sinks=sinks, dsinks=grads[3])
        for key, x in t.items():
            tensors[f"{name}.{key}"] = x.detach().float().contiguous()
        case.update({key: val for key, val in o.items() if key not in ("alibi", "sinks")})
        case["softcap_after_masks"] = False
        cases.append(case)
    # A learned relative-position bias (T5/Swin), shared over the batch: SDPA given it as a
    # float mask that requires grad (PyTorch's math path), with its gradient.
    for name, (N, H, L, S, D), bias_shape, causal in [
        ("pt_learned_bias", (2, 4, 6, 9, 8), (1, 4, 6, 9), False),
        ("pt_learned_bias_shared", (2, 2, 7, 7, 8), (7, 7), False),
    ]:
        q, k, v = (rnd(N, H, n, D).requires_grad_() for n in (L, S, S))
        bias = rnd(*bias_shape).requires_grad_()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        g = rnd(*out.shape)
        dq, dk, dv, dmask = torch.autograd.grad((out * g).sum(), (q, k, v, bias))
        t = dict(q=q, k=k, v=v, out=out, g=g, dq=dq, dk=dk, dv=dv, mask=bias, dmask=dmask)
        for key, x in t.items():
            tensors[f"{name}.{key}"] = x.detach().float().contiguous()
        cases.append(dict(name=name, source="pytorch", grads=True, enable_gqa=False,
                          mask="float", mask_grad=True, softcap_after_masks=False))
    return cases, tensors


def onnx_cases():
    import onnx
    from onnx import numpy_helper

    root = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "node")
    cases, tensors, skipped = [], {}, []
    for d in sorted(glob.glob(os.path.join(root, "test_attention_*"))):
        name = os.path.basename(d)
        if name.endswith("_expanded"):
            continue
        node = onnx.load(os.path.join(d, "model.onnx")).graph.node[0]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        files = sorted(glob.glob(os.path.join(d, "test_data_set_0", "input_*.pb")),
                       key=lambda f: int(f.rsplit("_", 1)[1].split(".")[0]))
        arrays = [numpy_helper.to_array(onnx.load_tensor(f)) for f in files]
        given = [n for n in node.input if n]
        inputs = dict(zip(given, arrays))
        y = numpy_helper.to_array(onnx.load_tensor(os.path.join(d, "test_data_set_0", "output_0.pb")))
        if any(a.dtype == np.float16 for a in arrays):
            skipped.append(name)
            continue
        q, k, v = inputs["Q"], inputs["K"], inputs["V"]
        three_d = q.ndim == 3
        if three_d:
            hq, hk = attrs["q_num_heads"], attrs["kv_num_heads"]
            split = lambda x, h: x.reshape(x.shape[0], x.shape[1], h, -1).transpose(0, 2, 1, 3)
            q, k, v = split(q, hq), split(k, hk), split(v, hk)
        past = 0
        if "past_key" in inputs:
            past = inputs["past_key"].shape[2]
            k = np.concatenate([inputs["past_key"], k], axis=2)
            v = np.concatenate([inputs["past_value"], v], axis=2)
        S = k.shape[2]
        case = dict(name="onnx_" + name[len("test_attention_"):], source="onnx", grads=False,
                    enable_gqa=q.shape[1] != k.shape[1], mask=None)
        t = dict(q=q, k=k, v=v)
        if "attn_mask" in inputs:
            m = inputs["attn_mask"]
            pad = S - m.shape[-1]
            if pad > 0:
                fill = False if m.dtype == np.bool_ else -np.inf
                m = np.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, pad)], constant_values=fill)
            case["mask"] = "bool" if m.dtype == np.bool_ else "float"
            t["mask"] = m.astype(np.uint8) if m.dtype == np.bool_ else m
        if attrs.get("is_causal", 0):
            case["window_right"] = 0
            case["align"] = {"offset": past}
        if "nonpad_kv_seqlen" in inputs:
            case["kv_lengths"] = [int(x) for x in inputs["nonpad_kv_seqlen"]]
        if "scale" in attrs:
            case["scale"] = float(attrs["scale"])
        if "softcap" in attrs:
            case["softcap"] = float(attrs["softcap"])
            case["softcap_after_masks"] = True
        if three_d:
            y = y.reshape(y.shape[0], y.shape[1], q.shape[1], -1).transpose(0, 2, 1, 3)
        t["out"] = y
        for key, x in t.items():
            arr = np.array(x, copy=True, order="C")
            tensors[f"{case['name']}.{key}"] = torch.from_numpy(arr)
        cases.append(case)
    return cases, tensors, skipped


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed fixtures")
    args = ap.parse_args()
    from safetensors.torch import load_file, save_file

    cases, tensors = pytorch_cases()
    bc, bt = bias_cases()
    cases += bc
    tensors.update(bt)
    oc, ot, skipped = onnx_cases()
    cases += oc
    tensors.update(ot)
    print(f"{len(cases)} cases ({len(oc)} from ONNX; skipped f16: {', '.join(skipped)})")
    if args.check:
        old = load_file(os.path.join(OUT, "tensors.safetensors"))
        with open(os.path.join(OUT, "cases.json")) as f:
            assert json.load(f) == cases, "cases.json differs"
        bad = [k for k in tensors if k not in old or not torch.equal(old[k], tensors[k])]
        if bad:
            sys.exit(f"differs: {bad[:5]}")
        print("fixtures match")
        return
    os.makedirs(OUT, exist_ok=True)
    save_file(tensors, os.path.join(OUT, "tensors.safetensors"))
    os.chmod(os.path.join(OUT, "tensors.safetensors"), 0o644)
    with open(os.path.join(OUT, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
