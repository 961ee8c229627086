#!/usr/bin/env python3
"""Reproduce PyTorch's own cos-initialised golden tests for the Transformer layers.

PyTorch's deterministic Transformer tests (test_transformerencoder, test_transformerdecoder and the C++ frontend's transformer tests) build a small model
(d_model=4, nhead=2, dim_feedforward=16, dropout=0.0), overwrite every parameter ``p`` of
the *layer* with ``cos(arange(p.numel()).float().view(p.shape))`` (computed in float32,
then copied into the model's dtype), and compare the output on fixed inputs with
hard-coded numbers. This script rebuilds those setups, runs them in PyTorch (eval mode,
slow path), checks the results against the numbers written in PyTorch's tests, and
writes them as a JSON list that the Rust tests can replay without PyTorch::

    python3 tools/cos_init_golden.py --out tests/fixtures/cos_init/golden.json

Each entry::

    name, module (class path), constructor (as in the parity-case contract),
    batch_first, training (false: eval), dtype ("float32" | "float64"),
    inputs      {"src"/"tgt"/"memory": nested lists,
                 "<mask name>": nested 0/1 lists, "<mask name>_kind": "bool"}
    output      what PyTorch returns (nested list, exact values of the dtype)
    param_order state_dict keys in model.parameters() order
    cos_params  the keys set by the cos rule (every layer parameter; each layer of a
                stack gets the same values because the stack deep-copies the layer)
    default_params {key: "ones" | "zeros"}: parameters left at their init (the final
                LayerNorm of TransformerEncoder/TransformerDecoder is not cos-initialised
                in PyTorch's tests)
    params      {key: nested list}: the exact parameter values (float32-rounded cos,
                stored in the entry's dtype), so a port need not reproduce float32 cos
                bit-for-bit
    test_reference, test_tolerance   the numbers and (rtol, atol) PyTorch's test asserts
    fast_path_max_abs_diff  |eval+no_grad result - output| (PyTorch's fused paths), info
    source      which PyTorch test it mirrors

The cos rule depends only on each parameter's own shape, so ``param_order`` is
informational: the value of a parameter is cos(0..numel-1) reshaped, whatever its rank.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.nn as nn

D_MODEL, NHEAD, FF = 4, 2, 16
DTYPES = {"float32": torch.float32, "float64": torch.float64}

# Inputs used by PyTorch's tests (seq-first layout; perm() gives batch_first).
SINGLE = [[[20.0, 30.0, 40.0, 50.0]]]
MEM_SINGLE = [[[60.0, 70.0, 80.0, 90.0]]]
TWO = [[[1.0, 2.0, 3.0, 4.0]], [[5.0, 6.0, 7.0, 8.0]]]
TWO_B = [[[9.0, 10.0, 11.0, 12.0]], [[11.0, 12.0, 13.0, 14.0]]]
MEM_ONE = [[[1.0, 2.0, 3.0, 4.0]]]
SRC_5x2 = [
    [[0.7462, 0.6653, 0.5679, 0.4891], [0.5387, 0.1655, 0.3565, 0.0471]],
    [[0.8335, 0.2799, 0.5031, 0.2947], [0.1402, 0.0318, 0.7636, 0.1346]],
    [[0.6333, 0.9344, 0.1376, 0.9938], [0.8924, 0.2872, 0.6692, 0.2944]],
    [[0.9897, 0.6915, 0.3154, 0.1733], [0.8645, 0.3513, 0.3064, 0.0767]],
    [[0.8117, 0.2366, 0.4838, 0.7881], [0.3718, 0.4945, 0.9511, 0.0864]],
]
TGT_3x2 = [
    [[0.4517, 0.6793, 0.5313, 0.0034], [0.2678, 0.3677, 0.4459, 0.7166]],
    [[0.8100, 0.3716, 0.4096, 0.1976], [0.6958, 0.8844, 0.6081, 0.8315]],
    [[0.0494, 0.9343, 0.5955, 0.3830], [0.5404, 0.3464, 0.9378, 0.6200]],
]
KPM_5 = [[0, 1, 0, 0, 0], [0, 0, 0, 1, 1]]  # mask[0,1] = mask[1,3] = mask[1,4] = True
TGT_KPM_3 = [[0, 0, 1], [0, 1, 1]]  # [0,2], [1,1], [1,2]
MEM_KPM_5 = [[0, 0, 0, 0, 1], [0, 0, 0, 1, 1]]  # [0,4], [1,3], [1,4]

# Reference numbers as written in PyTorch's tests (seq-first layout).
REF = {
    "enc_single": [[[2.258703, 0.127985, -0.697881, 0.170862]]],
    "enc_two": [[[2.272644, 0.119035, -0.691669, 0.153486]]] * 2,
    "enc_two_kpm": [[[2.301516, 0.092249, -0.679101, 0.103088]]] * 2,
    "enc_5x2": [
        [[2.428589, 0.020835, -0.602055, -0.085249], [2.427987, 0.021213, -0.602496, -0.084103]],
        [[2.424689, 0.019155, -0.604793, -0.085672], [2.413863, 0.022211, -0.612486, -0.072490]],
        [[2.433774, 0.021598, -0.598343, -0.087548], [2.425104, 0.019748, -0.604515, -0.084839]],
        [[2.436185, 0.022682, -0.596625, -0.087261], [2.433556, 0.021891, -0.598509, -0.086832]],
        [[2.416246, 0.017512, -0.610712, -0.082961], [2.422901, 0.024187, -0.606178, -0.074929]],
    ],
    "enc_5x2_kpm": [
        [[2.429026, 0.020793, -0.601741, -0.085642], [2.428811, 0.021445, -0.601912, -0.084252]],
        [[2.425009, 0.019155, -0.604566, -0.085899], [2.415408, 0.02249, -0.611415, -0.073]],
        [[2.434199, 0.021682, -0.598039, -0.087699], [2.42598, 0.019941, -0.603896, -0.085091]],
        [[2.436457, 0.022736, -0.59643, -0.08736], [2.434021, 0.022093, -0.598179, -0.08679]],
        [[2.416531, 0.017498, -0.610513, -0.083181], [2.4242, 0.024653, -0.605266, -0.074959]],
    ],
    "enc_gelu_single": [[[2.249815, 0.131006, -0.702199, 0.177868]]],
    "enc_gelu_two": [[[2.264103, 0.121417, -0.696012, 0.159724]]] * 2,
    "enc_gelu_5x2": [
        [[2.42163188, 0.03227153, -0.60714219, -0.05908082],
         [2.42151276, 0.03302179, -0.60722523, -0.05762651]],
        [[2.41926761, 0.02974034, -0.60879519, -0.0621269],
         [2.41626395, 0.03539356, -0.61087842, -0.04978623]],
        [[2.42382808, 0.03218872, -0.6055963, -0.06073591],
         [2.41983477, 0.03085259, -0.60840145, -0.06046414]],
        [[2.42500749, 0.03328855, -0.60476388, -0.0595334],
         [2.4237977, 0.03290575, -0.60561789, -0.05940082]],
        [[2.41383916, 0.02686345, -0.61256377, -0.06380707],
         [2.42000277, 0.03800944, -0.60824798, -0.04754947]],
    ],
    "encoder_2l_kpm": [
        [[2.419051, 0.017446, -0.608738, -0.085003], [2.419102, 0.017452, -0.608703, -0.085026]],
        [[2.419043, 0.017445, -0.608744, -0.084999], [2.419052, 0.017446, -0.608738, -0.085004]],
        [[2.419067, 0.017448, -0.608727, -0.085010], [2.419098, 0.017452, -0.608706, -0.085024]],
        [[2.419072, 0.017449, -0.608724, -0.085012], [2.419119, 0.017455, -0.608691, -0.085034]],
        [[2.419019, 0.017442, -0.608761, -0.084989], [2.419075, 0.017449, -0.608722, -0.085014]],
    ],
    "encoder_2l_norm_kpm": [
        [[1.695949, -0.357635, -0.893077, -0.445238], [1.695955, -0.357639, -0.893050, -0.445266]],
        [[1.695948, -0.357634, -0.893082, -0.445233], [1.695950, -0.357635, -0.893077, -0.445238]],
        [[1.695951, -0.357636, -0.893069, -0.445246], [1.695955, -0.357639, -0.893052, -0.445264]],
        [[1.695952, -0.357636, -0.893066, -0.445249], [1.695957, -0.357641, -0.893041, -0.445276]],
        [[1.695946, -0.357632, -0.893095, -0.445220], [1.695952, -0.357637, -0.893065, -0.445251]],
    ],
    "dec_single": [[[2.314351, 0.094805, -0.671322, 0.101977]]],
    "dec_bcast": [[[2.422245, 0.051716, -0.606338, -0.024756]]] * 2,
    "dec_two": [[[2.343536, 0.085561, -0.654954, 0.074991]]] * 2,
    "dec_3x2": [
        [[2.430065, 0.027862, -0.601136, -0.073096], [2.431935, 0.028907, -0.599809, -0.072488]],
        [[2.428457, 0.027053, -0.602275, -0.073462], [2.431970, 0.029387, -0.599789, -0.071621]],
        [[2.431934, 0.028196, -0.599802, -0.073809], [2.432306, 0.028858, -0.599542, -0.072846]],
    ],
    "dec_3x2_tgt_kpm": [
        [[2.430025, 0.027643, -0.601164, -0.073476], [2.4323, 0.029375, -0.599553, -0.071881]],
        [[2.428523, 0.026838, -0.602226, -0.07391], [2.432634, 0.029842, -0.599318, -0.071253]],
        [[2.432278, 0.028152, -0.599555, -0.074139], [2.432659, 0.029244, -0.599294, -0.072382]],
    ],
    "dec_3x2_mem_kpm": [
        [[2.429757, 0.027358, -0.601351, -0.073816], [2.432692, 0.028583, -0.599263, -0.073634]],
        [[2.428247, 0.02662, -0.602419, -0.074123], [2.432657, 0.029055, -0.599293, -0.072732]],
        [[2.431515, 0.027687, -0.600096, -0.074459], [2.433075, 0.028543, -0.598987, -0.073985]],
    ],
    "dec_gelu_single": [[[2.306435, 0.095946, -0.675796, 0.10687]]],
    "dec_gelu_bcast": [[[2.415448, 0.054389, -0.610932, -0.0156613]]] * 2,
    "dec_gelu_two": [[[2.338531, 0.087709, -0.65776, 0.080646]]] * 2,
    "dec_gelu_3x2": [
        [[2.42049104, 0.03443088, -0.60793706, -0.05436271],
         [2.42210631, 0.03546578, -0.60679895, -0.05357488]],
        [[2.41907674, 0.0336104, -0.60892977, -0.05490462],
         [2.42216881, 0.03586554, -0.6067524, -0.05289126]],
        [[2.42205716, 0.03488046, -0.60683681, -0.05460596],
         [2.42240309, 0.0354595, -0.60659063, -0.05378816]],
    ],
    "decoder_2l_single": [[[2.31316, 0.0950293, -0.671995, 0.102802]]],
    "decoder_2l_norm_single": [[[1.66166, -0.326986, -1.01466, -0.320017]]],
}

SRC_ENC_LAYER = ("test/test_nn.py TestNNDeviceType.test_transformerencoderlayer "
                 "(float32 and float64 on CPU)")
SRC_ENC_LAYER_CPP = (SRC_ENC_LAYER + "; test/cpp/api/transformer.cpp "
                     "TransformerTest.TransformerEncoderLayer (float32)")
SRC_ENC_GELU = "test/test_nn.py TestNNDeviceType.test_transformerencoderlayer_gelu (float32)"
SRC_DEC_LAYER = "test/test_nn.py TestNN.test_transformerdecoderlayer (float32)"
SRC_DEC_GELU = "test/test_nn.py TestNN.test_transformerdecoderlayer_gelu (default dtype float64)"
SRC_ENCODER = ("test/test_transformers.py TestTransformers.test_transformerencoder "
               "(default dtype float64)")
SRC_DECODER = "test/test_nn.py TestNN.test_transformerdecoder (float32)"


def layer_ctor(activation: str, batch_first: bool, dtype: str) -> dict:
    return {
        "d_model": D_MODEL, "nhead": NHEAD, "dim_feedforward": FF, "dropout": 0.0,
        "activation": activation, "layer_norm_eps": 1e-5, "batch_first": batch_first,
        "norm_first": False, "bias": True, "dtype": dtype,
    }


def cos_init_(module: nn.Module) -> None:
    """PyTorch's tests: p = cos(arange(numel)) in float32, copied into p's dtype."""
    with torch.no_grad():
        for p in module.parameters():
            sz = p.view(-1).size(0)
            p.copy_(torch.cos(torch.arange(0, sz).float().view(p.shape)))


def build(module: str, ctor: dict) -> tuple[nn.Module, list[str]]:
    """Build as PyTorch's test does; returns the model and the cos-initialised keys."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if module in ("torch.nn.TransformerEncoderLayer", "torch.nn.TransformerDecoderLayer"):
            cls = getattr(nn, module.split(".")[-1])
            kw = dict(ctor, dtype=DTYPES[ctor["dtype"]])
            model = cls(**kw)
            cos_init_(model)
            return model, [k for k, _ in model.named_parameters()]
        lk = dict(ctor["layer"], dtype=DTYPES[ctor["layer"]["dtype"]])
        if module == "torch.nn.TransformerEncoder":
            layer, stack = nn.TransformerEncoderLayer(**lk), nn.TransformerEncoder
        else:
            layer, stack = nn.TransformerDecoderLayer(**lk), nn.TransformerDecoder
        cos_init_(layer)  # the layer, before the stack deep-copies it
        norm = None
        if ctor["norm"] is not None:
            norm = nn.LayerNorm(D_MODEL, eps=ctor["norm"]["eps"], dtype=DTYPES[ctor["dtype"]])
        model = stack(layer, ctor["num_layers"], norm=norm)
        return model, [k for k, _ in model.named_parameters() if k.startswith("layers.")]


def perm(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return x.transpose(1, 0) if batch_first else x


def tolist(t: torch.Tensor):
    """Nested lists of Python floats; exact (a float32 value is exactly a double)."""
    return t.detach().to(torch.float64).tolist()


def run_entry(spec: dict) -> dict:
    module, ctor, dtype_name = spec["module"], spec["constructor"], spec["dtype"]
    dtype = DTYPES[dtype_name]
    bf = spec["batch_first"]
    model, cos_keys = build(module, ctor)
    model.eval()
    tensors, inputs_json = {}, {}
    for name, val in spec["inputs"].items():
        if name.endswith("key_padding_mask") or name.endswith("_mask"):
            t = torch.tensor(val, dtype=torch.int64) == 1
            tensors[name] = t
            inputs_json[name] = val
            inputs_json[f"{name}_kind"] = "bool"
        else:
            t = perm(torch.tensor(val, dtype=dtype), bf)
            tensors[name] = t
            inputs_json[name] = tolist(t)
    order = ["src", "tgt", "memory"]
    args = [tensors[n] for n in order if n in tensors]
    kwargs = {n: t for n, t in tensors.items() if n not in order}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = model(*args, **kwargs)  # grad enabled: the slow (reference) path
        with torch.no_grad():
            fast = model(*args, **kwargs)  # PyTorch may take fused paths here
    out = out.detach()
    if not torch.isfinite(out).all():
        raise SystemExit(f"{spec['name']}: non-finite output")
    ref = perm(torch.tensor(REF[spec["ref"]], dtype=torch.float64), bf)
    rtol, atol = spec["tol"]
    if ref.shape != out.shape or not torch.allclose(out.double(), ref, rtol=rtol, atol=atol):
        raise SystemExit(f"{spec['name']}: output {out.tolist()} does not match "
                         f"PyTorch's test reference {ref.tolist()} (rtol={rtol}, atol={atol})")

    named = dict(model.named_parameters())
    param_order = list(named)
    defaults = {}
    for k in param_order:
        if k not in cos_keys:
            p = named[k]
            if torch.all(p == 1):
                defaults[k] = "ones"
            elif torch.all(p == 0):
                defaults[k] = "zeros"
            else:
                raise SystemExit(f"{spec['name']}: {k} is neither cos nor a default init")
    assert list(model.state_dict()) == param_order  # no buffers in these modules
    return {
        "name": spec["name"],
        "module": module,
        "constructor": ctor,
        "batch_first": bf,
        "training": False,
        "dtype": dtype_name,
        "inputs": inputs_json,
        "output": tolist(out),
        "param_order": param_order,
        "cos_params": cos_keys,
        "default_params": defaults,
        "params": {k: tolist(v) for k, v in named.items()},
        "test_reference": tolist(ref),
        "test_tolerance": {"rtol": rtol, "atol": atol},
        "fast_path_max_abs_diff": float((fast - out).abs().max()),
        "source": spec["source"],
    }


def entry_specs() -> list[dict]:
    S: list[dict] = []
    EL, DL = "torch.nn.TransformerEncoderLayer", "torch.nn.TransformerDecoderLayer"
    EN, DE = "torch.nn.TransformerEncoder", "torch.nn.TransformerDecoder"
    T5 = (1e-7, 1e-5)  # rtol, atol the encoder/decoder layer tests use

    def add(name, module, ctor, dtype, bf, inputs, ref, tol, source):
        S.append(dict(name=name, module=module, constructor=ctor, dtype=dtype,
                      batch_first=bf, inputs=inputs, ref=ref, tol=tol, source=source))

    # --- TransformerEncoderLayer, relu ---
    for dt, sfx in (("float32", "f32"), ("float64", "f64")):
        add(f"enc_layer_single_token_{sfx}", EL, layer_ctor("relu", False, dt), dt, False,
            {"src": SINGLE}, "enc_single", T5,
            SRC_ENC_LAYER_CPP if dt == "float32" else SRC_ENC_LAYER)
    add("enc_layer_two_tokens_f32", EL, layer_ctor("relu", False, "float32"), "float32", False,
        {"src": TWO}, "enc_two", T5, SRC_ENC_LAYER)
    add("enc_layer_two_tokens_batch_first_f32", EL, layer_ctor("relu", True, "float32"),
        "float32", True, {"src": TWO}, "enc_two", T5, SRC_ENC_LAYER)
    add("enc_layer_two_tokens_kpm_f32", EL, layer_ctor("relu", False, "float32"), "float32",
        False, {"src": TWO, "src_key_padding_mask": [[1, 0]]}, "enc_two_kpm", T5, SRC_ENC_LAYER)
    add("enc_layer_5x2_f64", EL, layer_ctor("relu", False, "float64"), "float64", False,
        {"src": SRC_5x2}, "enc_5x2", T5, SRC_ENC_LAYER)
    add("enc_layer_5x2_kpm_f32", EL, layer_ctor("relu", False, "float32"), "float32", False,
        {"src": SRC_5x2, "src_key_padding_mask": KPM_5}, "enc_5x2_kpm", T5, SRC_ENC_LAYER)
    add("enc_layer_5x2_kpm_batch_first_f64", EL, layer_ctor("relu", True, "float64"), "float64",
        True, {"src": SRC_5x2, "src_key_padding_mask": KPM_5}, "enc_5x2_kpm", T5, SRC_ENC_LAYER)

    # --- TransformerEncoderLayer, gelu (test tolerance rtol 1e-5, atol 0) ---
    G5 = (1e-5, 0.0)
    add("enc_layer_gelu_single_token_f32", EL, layer_ctor("gelu", False, "float32"), "float32",
        False, {"src": SINGLE}, "enc_gelu_single", G5, SRC_ENC_GELU)
    add("enc_layer_gelu_two_tokens_batch_first_f32", EL, layer_ctor("gelu", True, "float32"),
        "float32", True, {"src": TWO}, "enc_gelu_two", G5, SRC_ENC_GELU)
    add("enc_layer_gelu_5x2_f32", EL, layer_ctor("gelu", False, "float32"), "float32", False,
        {"src": SRC_5x2}, "enc_gelu_5x2", G5, SRC_ENC_GELU)

    # --- TransformerDecoderLayer, relu ---
    dl32 = layer_ctor("relu", False, "float32")
    add("dec_layer_single_token_f32", DL, dl32, "float32", False,
        {"tgt": SINGLE, "memory": MEM_SINGLE}, "dec_single", T5, SRC_DEC_LAYER)
    add("dec_layer_broadcast_memory_f32", DL, dl32, "float32", False,
        {"tgt": TWO_B, "memory": MEM_ONE}, "dec_bcast", T5, SRC_DEC_LAYER)
    add("dec_layer_two_tokens_f32", DL, dl32, "float32", False,
        {"tgt": TWO, "memory": TWO_B}, "dec_two", T5, SRC_DEC_LAYER)
    add("dec_layer_3x2_memory_5x2_f32", DL, dl32, "float32", False,
        {"tgt": TGT_3x2, "memory": SRC_5x2}, "dec_3x2", T5, SRC_DEC_LAYER)
    add("dec_layer_tgt_kpm_f32", DL, dl32, "float32", False,
        {"tgt": TGT_3x2, "memory": SRC_5x2, "tgt_key_padding_mask": TGT_KPM_3},
        "dec_3x2_tgt_kpm", T5, SRC_DEC_LAYER)
    add("dec_layer_memory_kpm_f32", DL, dl32, "float32", False,
        {"tgt": TGT_3x2, "memory": SRC_5x2, "memory_key_padding_mask": MEM_KPM_5},
        "dec_3x2_mem_kpm", T5, SRC_DEC_LAYER)
    add("dec_layer_memory_kpm_batch_first_f64", DL, layer_ctor("relu", True, "float64"),
        "float64", True,
        {"tgt": TGT_3x2, "memory": SRC_5x2, "memory_key_padding_mask": MEM_KPM_5},
        "dec_3x2_mem_kpm", T5, SRC_DEC_LAYER)

    # --- TransformerDecoderLayer, gelu (float64, rtol 1e-5, atol 0) ---
    dg64 = layer_ctor("gelu", False, "float64")
    add("dec_layer_gelu_single_token_f64", DL, dg64, "float64", False,
        {"tgt": SINGLE, "memory": MEM_SINGLE}, "dec_gelu_single", G5, SRC_DEC_GELU)
    add("dec_layer_gelu_broadcast_memory_f64", DL, dg64, "float64", False,
        {"tgt": TWO_B, "memory": MEM_ONE}, "dec_gelu_bcast", G5, SRC_DEC_GELU)
    add("dec_layer_gelu_two_tokens_batch_first_f64", DL, layer_ctor("gelu", True, "float64"),
        "float64", True, {"tgt": TWO, "memory": TWO_B}, "dec_gelu_two", G5, SRC_DEC_GELU)
    add("dec_layer_gelu_3x2_memory_5x2_f64", DL, dg64, "float64", False,
        {"tgt": TGT_3x2, "memory": SRC_5x2}, "dec_gelu_3x2", G5, SRC_DEC_GELU)

    # --- TransformerEncoder (float64, rtol 1e-7, atol 1e-5) ---
    def enc(n, norm, bf=False):
        return {"layer": layer_ctor("relu", bf, "float64"), "num_layers": n,
                "norm": {"eps": 1e-5} if norm else None, "dtype": "float64"}

    add("encoder_1l_5x2_f64", EN, enc(1, False), "float64", False, {"src": SRC_5x2},
        "enc_5x2", T5, SRC_ENCODER)
    add("encoder_1l_5x2_kpm_f64", EN, enc(1, False), "float64", False,
        {"src": SRC_5x2, "src_key_padding_mask": KPM_5}, "enc_5x2_kpm", T5, SRC_ENCODER)
    add("encoder_2l_kpm_f64", EN, enc(2, False), "float64", False,
        {"src": SRC_5x2, "src_key_padding_mask": KPM_5}, "encoder_2l_kpm", T5, SRC_ENCODER)
    add("encoder_2l_kpm_batch_first_f64", EN, enc(2, False, True), "float64", True,
        {"src": SRC_5x2, "src_key_padding_mask": KPM_5}, "encoder_2l_kpm", T5, SRC_ENCODER)
    add("encoder_2l_norm_kpm_f64", EN, enc(2, True), "float64", False,
        {"src": SRC_5x2, "src_key_padding_mask": KPM_5}, "encoder_2l_norm_kpm", T5,
        SRC_ENCODER)

    # --- TransformerDecoder (float32; the test uses atol 1e-3 for these) ---
    def dec(n, norm):
        return {"layer": layer_ctor("relu", False, "float32"), "num_layers": n,
                "norm": {"eps": 1e-5} if norm else None, "dtype": "float32"}

    add("decoder_2l_single_token_f32", DE, dec(2, False), "float32", False,
        {"tgt": SINGLE, "memory": MEM_SINGLE}, "decoder_2l_single", (1e-7, 1e-3), SRC_DECODER)
    add("decoder_2l_norm_single_token_f32", DE, dec(2, True), "float32", False,
        {"tgt": SINGLE, "memory": MEM_SINGLE}, "decoder_2l_norm_single", (1e-7, 1e-3),
        SRC_DECODER)
    return S


def format_entries(entries: list[dict]) -> str:
    """One line per key of each entry (params: one line per parameter)."""
    def one(v):
        return json.dumps(v, separators=(", ", ": "))

    blocks = []
    for e in entries:
        lines = []
        for k, v in e.items():
            if k == "params":
                rows = [f"      {one(n)}: {one(p)}" for n, p in v.items()]
                lines.append('    "params": {\n' + ",\n".join(rows) + "\n    }")
            else:
                lines.append(f"    {one(k)}: {one(v)}")
        blocks.append("  {\n" + ",\n".join(lines) + "\n  }")
    return "[\n" + ",\n".join(blocks) + "\n]\n"


def main(argv=None) -> int:
    torch.set_num_threads(1)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures/cos_init/golden.json")
    args = ap.parse_args(argv)
    entries = [run_entry(s) for s in entry_specs()]
    names = [e["name"] for e in entries]
    assert len(names) == len(set(names)), "duplicate entry names"
    cpp = entries[0]
    assert cpp["name"] == "enc_layer_single_token_f32"
    print("C++ TransformerEncoderLayer golden ([[20,30,40,50]]):",
          ", ".join(f"{v:.6f}" for v in cpp["output"][0][0]),
          "(test: 2.258703, 0.127985, -0.697881, 0.170862)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(format_entries(entries))
    worst = max(e["fast_path_max_abs_diff"] for e in entries)
    print(f"wrote {len(entries)} entries to {out} (all match PyTorch's test references; "
          f"eval+no_grad fast paths differ by at most {worst:.2g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
