#!/usr/bin/env python3
"""PyTorch's ``torch.optim.AdamW`` steps as a golden case for ``multihead::optim::AdamW``.

    python3 tools/adamw_golden.py      # writes tests/fixtures/optim/adamw.safetensors

Two configurations (PyTorch's defaults with lr 2e-3 and weight decay 1e-2; betas (0.3, 0.95),
eps 1e-6, no weight decay, whose first-moment lerp takes ATen's large-weight branch), each in
float32 and float64, over three parameters of awkward sizes. Four steps: the second gives the
second parameter no gradient (PyTorch skips it and does not count the step for it), the third
changes the learning rate. Keys: ``{cfg}.{dtype}.p{i}.init``, ``{cfg}.{dtype}.p{i}.grad{s}``
(absent where the step has none) and ``{cfg}.{dtype}.p{i}.after{s}``; the hyper-parameters are
in the file's metadata.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/optim/adamw.safetensors"
SHAPES = [(5,), (17, 3), (37, 11)]
CONFIGS = {
    "default": dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "large_lerp": dict(lr=1e-2, betas=(0.3, 0.95), eps=1e-6, weight_decay=0.0),
}
STEPS = 4
LR_AT_3 = 0.25  # the learning rate is multiplied by this from step 3 on


def run(name, cfg, dtype, out):
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]
    for i, p in enumerate(params):
        out[f"{name}.{dtype_name(dtype)}.p{i}.init"] = p.detach().clone()
    opt = torch.optim.AdamW(params, **cfg)
    for s in range(1, STEPS + 1):
        if s == 3:
            for group in opt.param_groups:
                group["lr"] = cfg["lr"] * LR_AT_3
        for i, p in enumerate(params):
            if s == 2 and i == 1:
                p.grad = None
                continue
            grad = torch.randn(p.shape, generator=g, dtype=dtype) * (10.0 ** (i - 1))
            p.grad = grad
            out[f"{name}.{dtype_name(dtype)}.p{i}.grad{s}"] = grad.clone()
        opt.step()
        for i, p in enumerate(params):
            out[f"{name}.{dtype_name(dtype)}.p{i}.after{s}"] = p.detach().clone()


def dtype_name(dtype):
    return {torch.float32: "f32", torch.float64: "f64"}[dtype]


def main():
    out = {}
    for name, cfg in CONFIGS.items():
        for dtype in (torch.float32, torch.float64):
            run(name, cfg, dtype, out)
    meta = {"configs": json.dumps(CONFIGS), "steps": str(STEPS), "lr_at_3": str(LR_AT_3),
            "torch": torch.__version__}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(OUT), metadata=meta)
    print(f"wrote {len(out)} tensors to {OUT}")


if __name__ == "__main__":
    main()
