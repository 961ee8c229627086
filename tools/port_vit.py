#!/usr/bin/env python3
"""A small torchvision VisionTransformer, and its reference outputs and gradients, for the Rust
example ``crates/multihead/examples/port_vit.rs``.

The model is ``torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2,
num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=10)``. torchvision initialises the head to
zeros (so every logit is the head's zero bias and a parity check would pass on any encoder);
every parameter is therefore re-drawn from a generator seeded 1 (LayerNorm weights around 1).
Default mode writes::

    tests/fixtures/vit/model.safetensors      the state_dict (float32, torchvision's keys)
    tests/fixtures/vit/reference.safetensors  images (3, 3, 32, 32), upstream (3, 10), logits
                                              (eval, no_grad), and the gradients of
                                              sum(logits * upstream) in train mode (dropout 0):
                                              grad.images and grad.<key> for every parameter

``--verify PATH`` loads a state_dict that the Rust example saved into a fresh torchvision model
with ``load_state_dict(strict=True)`` and fails unless its logits on the reference images match
the reference to 1e-5 (the example saves the weights it loaded, unchanged).

Usage::

    python3 tools/port_vit.py [--out tests/fixtures/vit]
    python3 tools/port_vit.py --verify target/vit_saved.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torchvision.models import VisionTransformer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "vit"
N = 3


def build_model() -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                              hidden_dim=64, mlp_dim=128, num_classes=10)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.data = torch.randn(p.shape, generator=g) * 0.2
            if (".ln" in name or name.startswith("encoder.ln")) and name.endswith(".weight"):
                p.data += 1.0
    return model


def reference_inputs():
    g = torch.Generator().manual_seed(2)
    images = torch.randn(N, 3, 32, 32, generator=g)
    upstream = torch.randn(N, 10, generator=g)
    return images, upstream


def write_fixtures(out: Path) -> None:
    model = build_model()
    images, upstream = reference_inputs()
    model.eval()
    with torch.no_grad():
        logits = model(images)
    if logits.abs().max().item() < 1e-2:
        sys.exit("error: the logits are nearly zero; a parity check on them would prove nothing")
    model.train()  # dropout is 0: the same numbers, with autograd
    x = images.clone().requires_grad_(True)
    (model(x) * upstream).sum().backward()
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    ref = {"images": images, "upstream": upstream, "logits": logits, "grad.images": x.grad}
    for name, p in model.named_parameters():
        ref[f"grad.{name}"] = p.grad
    save_file({k: v.detach().to(torch.float32).contiguous() for k, v in ref.items()},
              str(out / "reference.safetensors"))
    print(f"wrote {out / 'model.safetensors'} ({len(state)} tensors) and "
          f"{out / 'reference.safetensors'}; logits:\n{logits}")


def verify(path: Path, out: Path) -> None:
    model = build_model()
    state = load_file(str(path))
    model.load_state_dict(state, strict=True)
    ref = load_file(str(out / "reference.safetensors"))
    model.eval()
    with torch.no_grad():
        logits = model(ref["images"])
    diff = (logits - ref["logits"]).abs().max().item()
    print(f"{path}: {len(state)} tensors loaded strictly; logits vs reference max |diff| = "
          f"{diff:.3e}")
    if not diff <= 1e-5:
        sys.exit(f"error: logits differ by {diff:.3e} (> 1e-5)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--verify", type=Path, default=None)
    opts = ap.parse_args()
    if opts.verify:
        verify(opts.verify, opts.out)
    else:
        write_fixtures(opts.out)


if __name__ == "__main__":
    main()
