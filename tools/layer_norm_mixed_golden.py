#!/usr/bin/env python3
"""PyTorch's CPU LayerNorm on a bfloat16 input with float32 parameters ("mixed type").

Writes one seeded case at a realistic width (32 rows of 256 features) so that the Rust test
``a_mixed_dtype_layer_norm_at_a_real_width_is_pytorchs_to_one_bf16_ulp`` can compare without
PyTorch::

    python3 tools/layer_norm_mixed_golden.py --out tests/fixtures/layer_norm_mixed/case.safetensors

Tensors: ``x`` (bf16 input), ``weight``/``bias`` (f32), ``g`` (bf16 upstream gradient of the
output), and PyTorch's results ``y`` (bf16), ``dx`` (bf16), ``dw``/``db`` (f32). The loss is
``sum(y * g)``, so the output's gradient is ``g``. PyTorch accumulates ``dw`` and ``db`` in
bfloat16 on this path; the test checks that against the float64 sums as well.
"""

from __future__ import annotations

import argparse
import os

import torch
from safetensors.torch import save_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seed", type=int, default=20261207)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    n, d = args.rows, args.width
    x = (torch.randn(n, d) * 2 + 0.3).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(d) * 0.5 + 1).requires_grad_()
    b = (torch.randn(d) * 0.1).requires_grad_()
    y = torch.nn.functional.layer_norm(x, (d,), w, b, 1e-5)
    assert y.dtype == torch.bfloat16
    g = torch.randn(n, d).to(torch.bfloat16)
    (y * g).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    tensors = {
        "x": x.detach(),
        "weight": w.detach(),
        "bias": b.detach(),
        "g": g,
        "y": y.detach(),
        "dx": x.grad,
        "dw": w.grad,
        "db": b.grad,
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, args.out,
              metadata={"torch": torch.__version__, "eps": "1e-5"})
    print(f"wrote {args.out} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
