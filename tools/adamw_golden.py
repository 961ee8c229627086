#!/usr/bin/env python3
"""PyTorch's ``torch.optim.AdamW`` / ``Adam`` steps as a golden case for
``multihead::optim::AdamW``.

    python3 tools/adamw_golden.py      # writes tests/fixtures/optim/adamw.safetensors

Five configurations, each in float32, float64 and bfloat16 (PyTorch rounds each in-place
operation's result to bf16), over three parameters of awkward sizes:
PyTorch's defaults with lr 2e-3 and weight decay 1e-2; betas (0.3, 0.95), eps 1e-6, no weight
decay (the first-moment lerp takes ATen's large-weight branch); ``amsgrad`` with ``maximize``;
``torch.optim.Adam`` (weight decay added to the gradient) with ``amsgrad``; and gradients a
thousandth the size beside ``eps=1e-3`` (in bf16 the denominator's ``eps`` is a bf16 value).
Four steps with
gradients that shrink after the second (so that ``amsgrad``'s maximum matters): the second
gives the second parameter no gradient (PyTorch skips it and does not count the step for it),
the third changes the learning rate. Keys: ``{cfg}.{dtype}.p{i}.init``,
``{cfg}.{dtype}.p{i}.grad{s}`` (absent where the step has none),
``{cfg}.{dtype}.p{i}.after{s}``, and the optimiser's state after steps 2 and 4 as
``tools/optim_state.py`` writes it, under ``{cfg}.{dtype}.state{s}.`` (the ``adam_l2``
configuration's keyed by the names in ``NAMES``, the others' by position); the
hyper-parameters are in the file's metadata.
"""

import json
from pathlib import Path

import tempfile

import torch
from safetensors.torch import load_file, save_file

import optim_state

OUT = Path(__file__).resolve().parent.parent / "tests/fixtures/optim/adamw.safetensors"
SHAPES = [(5,), (17, 3), (37, 11)]
CONFIGS = {
    "default": dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),
    "large_lerp": dict(lr=1e-2, betas=(0.3, 0.95), eps=1e-6, weight_decay=0.0),
    "amsgrad_maximize": dict(lr=5e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=3e-2,
                             amsgrad=True, maximize=True),
    "adam_l2": dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.1, amsgrad=True,
                    decoupled_weight_decay=False),
    # Gradients small beside eps (which bf16 cannot hold): the denominator's eps matters.
    # Parameters the size of a step, so that a step's last bits show.
    "small_grads": dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-3, weight_decay=0.0, grad_scale=1e-3,
                        param_scale=1e-3),
}
NAMES = {"adam_l2": ["encoder.layers.0.linear1.weight", "norm.bias", "head.weight"]}
STEPS = 4
LR_AT_3 = 0.25  # the learning rate is multiplied by this from step 3 on
GRAD_SCALE = [1.0, 2.0, 0.3, 0.1]  # per step: the second moment falls after step 2


def run(name, cfg, dtype, out):
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype) * cfg.get("param_scale", 1.0))
              for s in SHAPES]
    for i, p in enumerate(params):
        out[f"{name}.{dtype_name(dtype)}.p{i}.init"] = p.detach().clone()
    extra = ("decoupled_weight_decay", "grad_scale", "param_scale")
    kwargs = {k: v for k, v in cfg.items() if k not in extra}
    adam = cfg.get("decoupled_weight_decay", True) is False
    opt = (torch.optim.Adam if adam else torch.optim.AdamW)(params, **kwargs)
    names = NAMES.get(name)
    names = {p: n for p, n in zip(params, names)} if names else None
    for s in range(1, STEPS + 1):
        if s == 3:
            for group in opt.param_groups:
                group["lr"] = cfg["lr"] * LR_AT_3
        for i, p in enumerate(params):
            if s == 2 and i == 1:
                p.grad = None
                continue
            scale = (10.0 ** (i - 1)) * GRAD_SCALE[s - 1] * cfg.get("grad_scale", 1.0)
            grad = torch.randn(p.shape, generator=g, dtype=dtype) * scale
            p.grad = grad
            out[f"{name}.{dtype_name(dtype)}.p{i}.grad{s}"] = grad.clone()
        opt.step()
        for i, p in enumerate(params):
            out[f"{name}.{dtype_name(dtype)}.p{i}.after{s}"] = p.detach().clone()
        if s in (2, 4):
            with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
                optim_state.export_state(opt, f.name, names=names)
                exported = load_file(f.name)
            if names is None:
                # The command's conversion of a saved state_dict gives the same tensors.
                converted = optim_state.convert(opt.state_dict())
                assert converted.keys() == exported.keys(), (converted.keys(), exported.keys())
                assert all(torch.equal(converted[k], v) for k, v in exported.items())
            for k, v in exported.items():
                out[f"{name}.{dtype_name(dtype)}.state{s}.{k}"] = v


def dtype_name(dtype):
    return {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}[dtype]


def main():
    out = {}
    for name, cfg in CONFIGS.items():
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            run(name, cfg, dtype, out)
    meta = {"configs": json.dumps(CONFIGS), "names": json.dumps(NAMES), "steps": str(STEPS),
            "lr_at_3": str(LR_AT_3), "torch": torch.__version__}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(OUT), metadata=meta)
    print(f"wrote {len(out)} tensors to {OUT}")


if __name__ == "__main__":
    main()
