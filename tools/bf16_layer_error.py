#!/usr/bin/env python3
"""PyTorch bf16's own error on the deterministic encoder layer of
``crates/multihead/tests/integration/bf16_products.rs`` (training under bf16 products).

    python3 tools/bf16_layer_error.py

Rebuilds the test's layer (d_model 32, 4 heads, dim_feedforward 64, batch_first, parameters
``0.2·det`` in ``named_parameters`` order, LayerNorm weights ``1 + 0.1·det``), its bf16 input
and float64 upstream gradient, runs it in bfloat16 and in float64 (from the same bf16 values),
and prints the largest error of the output and of the input gradient as a share of the float64
result's largest magnitude: the numbers the test allows twice of.
"""

import copy
import math

import torch


def det(shape, salt, scale=1.0):
    """The tests' ``det``: sin((i + 1)·0.7311 + salt·13.17), row-major."""
    i = torch.arange(math.prod(shape), dtype=torch.float64)
    return (torch.sin((i + 1.0) * 0.7311 + salt * 13.17) * scale).reshape(shape)


NAMES = ["self_attn.in_proj_weight", "self_attn.in_proj_bias", "self_attn.out_proj.weight",
         "self_attn.out_proj.bias", "linear1.weight", "linear1.bias", "linear2.weight",
         "linear2.bias", "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"]


def main():
    torch.set_num_threads(2)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    shapes = {k: v.shape for k, v in layer.state_dict().items()}
    state = {}
    for i, name in enumerate(NAMES):
        v = det(shapes[name], i + 0.25, 0.2)
        if name.startswith("norm") and name.endswith("weight"):
            v = 1.0 + 0.5 * v
        state[name] = v.float()
    layer.load_state_dict(state)
    l16 = copy.deepcopy(layer).to(torch.bfloat16)
    l64 = copy.deepcopy(l16).double()
    x = det([2, 9, 32], 3.0).float().to(torch.bfloat16)
    up = det([2, 9, 32], 4.0)
    x16, x64 = x.clone().requires_grad_(True), x.double().requires_grad_(True)
    y16, y64 = l16(x16), l64(x64)
    (y16.double() * up).sum().backward()
    (y64 * up).sum().backward()

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    print(f"output {100 * rel(y16.double(), y64):.2f}%, "
          f"input gradient {100 * rel(x16.grad.double(), x64.grad):.2f}%")


if __name__ == "__main__":
    main()
