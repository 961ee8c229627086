#!/usr/bin/env python3
"""PyTorch's ``clip_grad_norm_`` and ``clip_grad_value_`` as golden cases for
``multihead::optim::{ClipGradNorm, clip_grad_value}``.

    python3 tools/clip_golden.py      # writes tests/fixtures/optim/clip.safetensors

Each case is four parameters of awkward sizes (the fourth has no gradient and must be left
out), their gradients drawn at spread scales, and one call: ``clip_grad_norm_`` with a
``max_norm`` and ``norm_type``, or ``clip_grad_value_`` with a ``clip_value``. Keys:
``{case}.g{i}`` (the gradient before), ``{case}.out{i}`` (after) and, for the norm cases,
``{case}.total`` (the returned total norm, a 0-dim tensor in its dtype). The cases' arguments and
dtypes are in the file's metadata (``cases``, JSON).
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/optim/clip.safetensors"
SMALL = [(5,), (17, 3), (37, 11), (4,)]
LARGE = [(5,), (17, 3), (130, 130), (4,)]  # 16900 elements: more than one kernel chunk
DT = {"f32": torch.float32, "f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}

CASES = {
    # name: (kind, dtypes of the four parameters, arguments, shapes, special)
    "norm2_f32_clips": ("norm", ["f32"] * 4, dict(max_norm=1.0, norm_type=2.0), LARGE, None),
    "norm2_f64_clips": ("norm", ["f64"] * 4, dict(max_norm=1.0, norm_type=2.0), SMALL, None),
    "norm2_f32_under": ("norm", ["f32"] * 4, dict(max_norm=1e4, norm_type=2.0), SMALL, None),
    "norm2_f32_inf_max": ("norm", ["f32"] * 4,
                          dict(max_norm=float("inf"), norm_type=2.0), SMALL, None),
    "norm1_f32": ("norm", ["f32"] * 4, dict(max_norm=0.5, norm_type=1.0), SMALL, None),
    "norm0_f32": ("norm", ["f32"] * 4, dict(max_norm=2.0, norm_type=0.0), SMALL, "zeros"),
    "norm_inf_f32": ("norm", ["f32"] * 4,
                     dict(max_norm=0.25, norm_type=float("inf")), SMALL, None),
    "norm_neginf_f64": ("norm", ["f64"] * 4,
                        dict(max_norm=1e-3, norm_type=float("-inf")), SMALL, None),
    "norm3p5_f64": ("norm", ["f64"] * 4, dict(max_norm=0.1, norm_type=3.5), SMALL, None),
    "norm_m1p5_f32": ("norm", ["f32"] * 4, dict(max_norm=1e-3, norm_type=-1.5), SMALL, None),
    "norm2_bf16": ("norm", ["bf16"] * 4, dict(max_norm=0.7, norm_type=2.0), SMALL, None),
    "norm2_f16": ("norm", ["f16"] * 4, dict(max_norm=0.7, norm_type=2.0), SMALL, None),
    "norm2_mixed": ("norm", ["bf16", "f32", "bf16", "f32"],
                    dict(max_norm=0.3, norm_type=2.0), SMALL, None),
    "norm2_f32_nan": ("norm", ["f32"] * 4, dict(max_norm=1.0, norm_type=2.0), SMALL, "nan"),
    "value_f32": ("value", ["f32"] * 4, dict(clip_value=0.3), SMALL, "nan"),
    "value_bf16": ("value", ["bf16"] * 4, dict(clip_value=0.3), SMALL, None),
    "value_f64": ("value", ["f64"] * 4, dict(clip_value=2.5), SMALL, None),
}


def grads_for(name, dtypes, shapes, special):
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    params = []
    for i, (dt, shape) in enumerate(zip(dtypes, shapes)):
        p = torch.nn.Parameter(torch.zeros(shape, dtype=DT[dt]))
        if i < 3:
            grad = torch.randn(shape, generator=g, dtype=torch.float64) * (10.0 ** (i - 1))
            if special == "zeros":
                grad[grad.abs() < 0.3 * 10.0 ** (i - 1)] = 0.0
            if special == "nan" and i == 1:
                grad.view(-1)[4] = float("nan")
            p.grad = grad.to(DT[dt])
        params.append(p)
    return params


def main():
    out, meta = {}, {}
    for name, (kind, dtypes, args, shapes, special) in CASES.items():
        params = grads_for(name, dtypes, shapes, special)
        for i, p in enumerate(params):
            if p.grad is not None:
                out[f"{name}.g{i}"] = p.grad.clone()
        if kind == "norm":
            total = torch.nn.utils.clip_grad_norm_(params, **args)
            out[f"{name}.total"] = total.detach().clone()
        else:
            torch.nn.utils.clip_grad_value_(params, **args)
        for i, p in enumerate(params):
            if p.grad is not None:
                out[f"{name}.out{i}"] = p.grad.clone()
        # JSON has no infinities: arguments are written as numbers, or "inf" / "-inf".
        args = {k: (v if v not in (float("inf"), float("-inf")) else str(v)) for k, v in args.items()}
        meta[name] = dict(kind=kind, dtypes=dtypes, shapes=shapes, **args)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(OUT), metadata={"cases": json.dumps(meta), "torch": torch.__version__})
    print(f"wrote {len(out)} tensors to {OUT}")


if __name__ == "__main__":
    main()
