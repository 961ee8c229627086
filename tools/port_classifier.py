#!/usr/bin/env python3
"""A small PyTorch text classifier, and its reference output, for the Rust example
``crates/multihead/examples/port_classifier.rs``.

Default mode builds the model (seed 0), re-initialises every parameter from a generator seeded
1 so the encoder layers differ, and writes::

    tests/fixtures/classifier/model.safetensors      the state_dict (float32)
    tests/fixtures/classifier/reference.safetensors  ids (int64, 4x7), pad (uint8, 1 = padding),
                                                     logits (float32, eval mode, no_grad)

The logits are also computed in train mode (dropout is 0) with autograd on; the script fails
unless the two agree to 1e-6.

``--verify PATH`` loads a state_dict that the Rust example saved (strictly, by PyTorch's keys),
runs it on the reference ids/pad and prints the logits. If the example's logits lie next to it
(``PATH`` with ``.safetensors`` replaced by ``.logits.safetensors``), it fails unless they agree
to 1e-5.

Usage::

    python3 tools/port_classifier.py [--out tests/fixtures/classifier]
    python3 tools/port_classifier.py --verify target/classifier_trained.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

SEED = 0
INIT_SEED = 1
N, L, VOCAB = 4, 7, 40
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "classifier"


class Classifier(nn.Module):
    def __init__(self, vocab=VOCAB, d=32, heads=4, ff=64, layers=2, classes=3):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids, pad):  # ids (N, L) int64, pad (N, L) bool, True = padding
        x = self.encoder(self.embedding(ids), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(x.dtype)
        pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1)
        return self.head(pooled)


def build_model() -> Classifier:
    torch.manual_seed(SEED)
    model = Classifier()
    # nn.TransformerEncoder deep-copies its layer, so the layers start identical: give every
    # parameter its own values, in sorted name order, from a separate generator. LayerNorm
    # weights are centred on 1 so the signal is not shrunk to the head's bias.
    g = torch.Generator().manual_seed(INIT_SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.data = torch.randn(p.shape, generator=g) * 0.2
            if ".norm" in name and name.endswith(".weight"):
                p.data += 1.0
    return model


def reference_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, VOCAB, (N, L), generator=g, dtype=torch.int64)
    pad = torch.zeros(N, L, dtype=torch.bool)
    for b in range(N):  # row b is padded in its last b positions
        if b:
            pad[b, L - b:] = True
    ids[pad] = 0
    return ids, pad


def logits_eval(model: Classifier, ids, pad) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids, pad)


def logits_train(model: Classifier, ids, pad) -> torch.Tensor:
    model.train()
    with torch.enable_grad():
        out = model(ids, pad).detach()
    model.eval()
    return out


def write_fixtures(out: Path) -> None:
    model = build_model()
    ids, pad = reference_inputs()
    logits = logits_eval(model, ids, pad)
    train = logits_train(model, ids, pad)
    diff = (logits - train).abs().max().item()
    print(f"eval/no_grad vs train/enable_grad max |diff| = {diff:.3e}")
    if not diff <= 1e-6:
        sys.exit(f"error: eval and train logits differ by {diff:.3e} (> 1e-6)")
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"))
    save_file(
        {"ids": ids.contiguous(), "pad": pad.to(torch.uint8).contiguous(),
         "logits": logits.to(torch.float32).contiguous()},
        str(out / "reference.safetensors"),
    )
    print(f"wrote {out / 'model.safetensors'} ({len(state)} tensors) and "
          f"{out / 'reference.safetensors'}")
    print("logits:")
    print(logits)


def verify(path: Path, ref_dir: Path) -> None:
    model = build_model()
    model.load_state_dict(load_file(str(path)), strict=True)
    ref = load_file(str(ref_dir / "reference.safetensors"))
    ids, pad = ref["ids"], ref["pad"].to(torch.bool)
    logits = logits_eval(model, ids, pad)
    print(f"loaded {path} strictly into the PyTorch Classifier")
    print("logits on the reference ids/pad:")
    print(logits)
    print(f"max |logits - untrained reference logits| = "
          f"{(logits - ref['logits']).abs().max().item():.4f}")
    rust = path.with_name(path.name.removesuffix(".safetensors") + ".logits.safetensors")
    if rust.exists():
        diff = (logits - load_file(str(rust))["logits"]).abs().max().item()
        print(f"max |PyTorch logits - Rust logits ({rust.name})| = {diff:.3e}")
        if not diff <= 1e-5:
            sys.exit(f"error: PyTorch and Rust disagree by {diff:.3e} (> 1e-5)")
    else:
        print(f"note: no {rust.name} beside {path.name}: the state_dict loaded strictly, and no "
              f"Rust logits were compared (the example writes them beside what it saves)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture directory")
    ap.add_argument("--verify", type=Path, metavar="PATH",
                    help="load a safetensors state_dict and run it on the reference inputs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, seed {SEED}, init seed {INIT_SEED}")
    if args.verify is not None:
        verify(args.verify, args.out)
    else:
        write_fixtures(args.out)


if __name__ == "__main__":
    main()
