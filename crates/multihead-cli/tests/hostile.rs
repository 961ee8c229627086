//! Hostile and malformed inputs to the `multihead` binary: each gets a clear error and a
//! non-zero exit, never a hang, an abort or a silent default.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
use common::Scratch;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_multihead"))
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("hostile-{name}"))
}

/// Copies a fixture case and rewrites its case.json with `edit`.
fn edited_case(fixture: &str, name: &str, edit: impl FnOnce(&mut Value)) -> Scratch {
    let src = fixtures().join(fixture);
    let dir = tmp(name).sub("case");
    std::fs::copy(src.join("case.safetensors"), dir.join("case.safetensors")).unwrap();
    let mut v: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("case.json")).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(dir.join("case.json"), serde_json::to_string_pretty(&v).unwrap()).unwrap();
    dir
}

/// `multihead check DIR`, which must finish within a minute.
fn check(dir: &Path) -> Output {
    let start = Instant::now();
    let o = bin().arg("check").arg(dir).output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(60), "check took {:?}", start.elapsed());
    o
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

// Finding 7: missing parameters were created (and allocated) before the key check.
#[test]
fn replay_with_missing_parameters_and_a_huge_embed_dim_reports_the_keys() {
    // 3·E² = 1.2·10⁹ elements (4.8 GB) under the limit: the keys are reported, nothing is
    // allocated for them.
    let dir = edited_case("mha/packed_self_nomask_f32", "huge", |v| {
        v["constructor"]["embed_dim"] = 20000.into();
        v["constructor"]["num_heads"] = 8.into();
    });
    // Keep only the inputs: every param.* key is missing.
    let st = multihead::state_dict::load_safetensors(
        dir.join("case.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let inputs: Vec<(String, candle_core::Tensor)> =
        st.into_iter().filter(|(k, _)| !k.starts_with("param.")).collect();
    multihead::state_dict::save_safetensors(
        inputs.iter().map(|(k, t)| (k.as_str(), t)),
        dir.join("case.safetensors"),
    )
    .unwrap();
    let start = Instant::now();
    let o =
        bin().arg("replay").arg(&dir).arg("--out").arg(dir.join("r.safetensors")).output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(30));
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("missing keys") && t.contains("in_proj_weight"), "{t}");
    assert!(!dir.join("r.safetensors").exists());
    // Over the limit (E = 200000): rejected from case.json alone.
    let dir = edited_case("mha/packed_self_nomask_f32", "huger", |v| {
        v["constructor"]["embed_dim"] = 200000.into();
    });
    let t = text(&check(&dir));
    assert!(t.contains("in_proj_weight") && t.contains("limit"), "{t}");
}

#[test]
fn stack_sizes_over_the_limit_are_rejected_before_building() {
    let dir = edited_case("transformer/encoder_2l_nonorm_f32", "layers", |v| {
        v["constructor"]["num_layers"] = 1_000_000_000u64.into();
    });
    let t = text(&check(&dir));
    assert!(t.contains("constructor.num_layers") && t.contains("1024"), "{t}");
    let dir = edited_case("transformer/encoder_2l_nonorm_f32", "layers_float", |v| {
        v["constructor"]["num_layers"] = serde_json::json!(1e9);
    });
    let t = text(&check(&dir));
    assert!(t.contains("num_layers"), "{t}");
}

#[test]
fn check_survives_a_symlink_loop_and_says_when_it_finds_no_case() {
    let root = tmp("loop");
    std::os::unix::fs::symlink(&root, root.join("again")).unwrap();
    std::fs::create_dir_all(root.join("empty")).unwrap();
    let o = check(&root);
    assert!(!o.status.success(), "no case is a failure");
    let t = text(&o);
    assert!(t.contains("no case found"), "{t}");
    assert!(t.contains("already visited"), "{t}");
    // A loop next to a real case: the case runs once.
    let case = root.join("one");
    std::fs::create_dir_all(&case).unwrap();
    for f in ["case.json", "case.safetensors"] {
        std::fs::copy(fixtures().join("mha/packed_self_nomask_f32").join(f), case.join(f)).unwrap();
    }
    let o = check(&root);
    assert!(o.status.success(), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("1 passed, 0 failed"));
}

// Finding 8: case.json keys were read by string with silent defaults.
#[test]
fn misspelt_missing_and_unknown_case_keys_are_errors_that_name_the_key() {
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "misspelt",
            Box::new(|v: &mut Value| {
                let c = v["constructor"].as_object_mut().unwrap();
                let b = c.remove("batch_first").unwrap();
                c.insert("batch_frist".into(), b);
            }),
            "batch_frist",
        ),
        (
            "missing",
            Box::new(|v: &mut Value| {
                v["constructor"].as_object_mut().unwrap().remove("embed_dim");
            }),
            "embed_dim",
        ),
        (
            "unknown_call",
            Box::new(|v: &mut Value| {
                v["call"]["need_weight"] = true.into();
            }),
            "call.need_weight",
        ),
        (
            "missing_top",
            Box::new(|v: &mut Value| {
                v.as_object_mut().unwrap().remove("grad_mode");
            }),
            "grad_mode",
        ),
        (
            "wrong_type",
            Box::new(|v: &mut Value| {
                v["constructor"]["num_heads"] = "two".into();
            }),
            "constructor.num_heads",
        ),
        (
            "device",
            Box::new(|v: &mut Value| {
                v["constructor"]["device"] = "cuda".into();
            }),
            "constructor.device",
        ),
        (
            "dtype_mismatch",
            Box::new(|v: &mut Value| {
                v["constructor"]["dtype"] = "float64".into();
            }),
            "is stored as F32",
        ),
    ];
    for (name, edit, expect) in cases {
        let dir = edited_case("mha/packed_self_nomask_f32", name, edit);
        let o = check(&dir);
        assert!(!o.status.success(), "{name}");
        let t = text(&o);
        assert!(t.contains(expect), "{name}: {t}");
    }
    // Informative top-level keys stay ignored.
    let dir = edited_case("mha/packed_self_nomask_f32", "informative", |v| {
        v["generated_by"] = "someone else's tool".into();
    });
    assert!(check(&dir).status.success());
}

#[test]
fn a_stack_whose_dtype_stands_only_in_the_layer_replays_in_that_dtype() {
    let dir = edited_case("transformer/encoder_3l_norm_f64", "layer_dtype", |v| {
        v["constructor"].as_object_mut().unwrap().remove("dtype");
        assert_eq!(v["constructor"]["layer"]["dtype"], "float64");
    });
    let o = check(&dir);
    assert!(o.status.success(), "{}", text(&o));
    let dir = edited_case("transformer/encoder_3l_norm_f64", "dtype_conflict", |v| {
        v["constructor"]["layer"]["dtype"] = "float32".into();
    });
    let t = text(&check(&dir));
    assert!(t.contains("disagree"), "{t}");
}

// Finding 9: an invalid model config gave NaN embeddings and exit 0.
#[test]
fn embed_rejects_an_invalid_config() {
    let dir = tmp("embed");
    let config = serde_json::json!({
        "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 16, "hidden_act": "gelu", "layer_norm_eps": -1.0
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let o = bin().arg("embed").arg("--model").arg(&dir).arg("hello").output().unwrap();
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("layer_norm_eps") && t.contains("-1"), "{t}");
}

/// SDPA cases: a dropout draw that cannot be replayed, aliasing, an unknown call key, a
/// constructor dtype that the stored tensors do not have and a mask of the wrong kind are
/// errors that name the key, never a pass.
#[test]
fn malformed_sdpa_cases_are_errors_that_name_the_key() {
    type Edit = fn(&mut Value);
    let cases: [(&str, &str, Edit); 5] = [
        ("dropout", "call.dropout_p", |v| v["call"]["dropout_p"] = 0.1.into()),
        ("alias", "aliasing", |v| v["aliasing"]["key_is_query"] = true.into()),
        ("unknown", "call.need_weights", |v| v["call"]["need_weights"] = true.into()),
        ("dtype", "constructor.dtype", |v| v["constructor"]["dtype"] = "float64".into()),
        ("kind", "attn_mask", |v| v["call"]["attn_mask"] = "float".into()),
    ];
    for (name, want, edit) in cases {
        let dir = edited_case("sdpa/sdpa_bool_mask_f32", &format!("sdpa-{name}"), edit);
        let o = check(&dir);
        assert!(!o.status.success(), "{name}: {}", text(&o));
        assert!(text(&o).contains(want), "{name}: {}", text(&o));
    }
}

// A reader that stops early (`multihead check ... | head -1`) closed the pipe: println!
// panicked with a backtrace.
#[test]
fn check_into_a_closed_pipe_ends_quietly() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    // `--verbose` over every fixture: more lines than a pipe buffers, so the command is still
    // writing when the reader goes.
    let mut child = bin()
        .args(["check", "--verbose"])
        .arg(fixtures())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    // The reader is dropped here: the pipe is closed with lines still to come.
    assert!(first.starts_with("ok "), "first line: {first}");
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "status {:?}, stderr: {err}", o.status);
    assert!(!err.contains("panicked"), "stderr: {err}");
}

// `--batch 2^58` wrapped `batch * 64` to 0 and panicked in `chunks(0)`; `--threads 100000`
// ran for minutes. Both are refused before anything is loaded.
#[test]
fn embed_sizes_out_of_range_are_errors_naming_the_flag() {
    for (flag, value) in [
        ("--batch", "288230376151711744"),
        ("--batch", "0"),
        ("--threads", "0"),
        ("--threads", "100000"),
        ("--pack-tokens", "0"),
        ("--pack-tokens", "99999999999"),
    ] {
        let o = bin()
            .args(["embed", "--model", "/nonexistent", flag, value, "hello"])
            .output()
            .unwrap();
        let t = text(&o);
        assert_eq!(o.status.code(), Some(1), "{flag} {value}: {t}");
        assert!(t.contains(flag) && !t.contains("panicked"), "{flag} {value}: {t}");
    }
}

// The model was loaded only after stdin reached its end: a wrong --model waited for Ctrl-D.
#[test]
fn embed_reports_a_missing_model_without_waiting_for_stdin() {
    use std::process::Stdio;
    let mut child = bin()
        .args(["embed", "--model", "/nonexistent"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > Duration::from_secs(30) {
            child.kill().unwrap();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // stdin stays open (held by `child`) until here.
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(status.is_some_and(|s| s.code() == Some(1)), "still waiting on stdin: {err}");
    assert!(err.contains("/nonexistent"), "{err}");
}

// Size flags of bench and demo: capacity-overflow panics (`--batch 2^64-1`), an index panic
// (`bench --module decode --batch 0`), allocation aborts (`--tgt-len 1e8 --src-len 1e8`),
// a demo that grew to 14 GB (`--seq-len 100000`), flags silently changed (`--iters 0`) or
// found wrong only after training (`--out` in a missing directory). Each is an error naming
// the flag before anything runs.
#[test]
fn bench_and_demo_size_flags_are_checked_first() {
    let huge = "18446744073709551615";
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "--module", "decode", "--batch", "0"], "--batch"),
        (&["bench", "--batch", huge], "--batch"),
        (&["bench", "--tgt-len", "100000000", "--src-len", "100000000"], "--tgt-len"),
        (&["bench", "--iters", "0"], "--iters"),
        (&["bench", "--threads", "0"], "--threads"),
        (&["bench", "--module", "sdpa", "--padded"], "--padded"),
        (&["bench", "--module", "mha", "--varlen"], "--varlen"),
        (&["bench", "--module", "sdpa", "--varlen", "--src-len", "64"], "--varlen"),
        (&["bench", "--module", "mha", "--window", "4"], "--window"),
        (&["bench", "--module", "decode", "--new-tokens", "0"], "--new-tokens"),
        (&["bench", "--module", "decode", "--new-tokens", huge], "--new-tokens"),
        (&["bench", "--module", "mha", "--new-tokens", "4"], "--new-tokens"),
        // (A decode step has no backward: it was reported as "forward+backward" and run
        // forward only.)
        (&["bench", "--module", "decode", "--backward"], "--backward"),
        (&["bench", "--module", "decode", "--need-weights"], "--need-weights"),
        // The (L, S) masks of an MHA run were built unchecked (an allocation abort), and flags
        // that a module ignores were taken silently.
        (
            &[
                "bench",
                "--embed-dim",
                "16",
                "--num-heads",
                "2",
                "--tgt-len",
                "200000",
                "--src-len",
                "200000",
                "--learned-mask",
            ],
            "--tgt-len, --src-len",
        ),
        (
            &[
                "bench",
                "--batch",
                "1",
                "--embed-dim",
                "2",
                "--num-heads",
                "1",
                "--tgt-len",
                "100",
                "--src-len",
                "100000000",
                "--causal",
            ],
            "--tgt-len, --src-len",
        ),
        (&["bench", "--module", "mha", "--num-kv-heads", "2"], "--num-kv-heads"),
        (&["bench", "--module", "linear", "--causal"], "--causal"),
        (&["bench", "--module", "linear", "--key-padding"], "--key-padding"),
        (&["demo", "--batch", huge], "--batch"),
        (&["demo", "--seq-len", "100000"], "--seq-len"),
        (&["demo", "--seq2seq", "--seq-len", huge], "--seq-len"),
        (&["demo", "--require-accuracy", "NaN"], "--require-accuracy"),
        (&["demo", "--out", "/nonexistent/dir/x.png"], "--out"),
        (&["demo", "--seq2seq", "--out", "x.png"], "--out"),
    ];
    for (args, flag) in cases {
        let start = Instant::now();
        let o = bin().args(*args).output().unwrap();
        let t = text(&o);
        assert!(start.elapsed() < Duration::from_secs(10), "{args:?} took {:?}", start.elapsed());
        assert_eq!(o.status.code(), Some(1), "{args:?}: {t}");
        assert!(t.contains(flag) && !t.contains("panicked"), "{args:?}: {t}");
    }
}

// A malformed suggested_tolerance fell back to the default tolerances silently, and an SDPA
// case with a `param.*` tensor replayed as if it had none.
#[test]
fn malformed_tolerances_and_sdpa_parameters_are_errors() {
    for (name, tol, expect) in [
        (
            "tol-neg",
            serde_json::json!({"float32": {"forward": {"rtol": -1.0, "atol": 1e-5}}}),
            "rtol must be a non-negative number",
        ),
        (
            "tol-str",
            serde_json::json!({"float32": {"forward": {"rtol": "1e-5"}}}),
            "rtol must be a non-negative number",
        ),
        ("tol-num", serde_json::json!(3), "must be an object"),
    ] {
        let dir = edited_case("sdpa/sdpa_plain_f32", name, |v| v["suggested_tolerance"] = tol);
        let t = text(&check(&dir));
        assert!(t.contains(expect) && t.contains("0 passed, 1 failed"), "{name}: {t}");
    }
    let dir = case_with_extra_tensor("sdpa/sdpa_plain_f32", "param.bogus");
    let t = text(&check(&dir));
    assert!(t.contains("takes no parameters, but the case has param.bogus"), "{t}");
    // A misspelled mask was left out of the call without a word.
    let dir = case_with_extra_tensor("mha/batch1_n1_f32", "input.key_paddin_mask");
    let t = text(&check(&dir));
    assert!(t.contains("unexpected input.key_paddin_mask"), "{t}");
}

/// A copy of a fixture case with one more stored tensor, `name` (a copy of its query).
fn case_with_extra_tensor(fixture: &str, name: &str) -> Scratch {
    let dir = edited_case(fixture, name, |_| {});
    let st = dir.join("case.safetensors");
    let mut w = multihead::state_dict::load_safetensors(&st, &candle_core::Device::Cpu).unwrap();
    let extra = w["input.query"].clone();
    w.insert(name.into(), extra);
    multihead::state_dict::save_safetensors(w.iter().map(|(k, t)| (k.as_str(), t)), &st).unwrap();
    dir
}

// A file given where a case directory belongs only printed a note and "0 passed, 0 failed";
// case-format.md says a path that cannot be read counts as a failed case.
#[test]
fn check_counts_a_file_given_as_a_case_as_failed() {
    let dir = tmp("afile");
    let file = dir.join("not-a-case.txt");
    std::fs::write(&file, "hi").unwrap();
    let o = check(&file);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t.contains("FAIL") && t.contains("0 passed, 1 failed"), "{t}");
}

// An adversarial sweep (2026-12-04) found four malformed cases that ran, or failed with a
// message that did not say what was wrong.
#[test]
fn cases_that_contradict_themselves_are_errors_that_say_how() {
    let replay = |dir: &Path| {
        let out = dir.parent().unwrap().join("out.safetensors");
        let o = bin().arg("replay").arg(dir).arg("--out").arg(&out).output().unwrap();
        assert_ne!(o.status.code(), Some(0), "{}", text(&o));
        text(&o)
    };
    // A key said to be the query that is not: it was replaced by the query without a word.
    let dir = edited_case("mha/batch_first_distinct_f64", "alias", |v| {
        v["aliasing"]["key_is_query"] = true.into();
    });
    let t = replay(&dir);
    assert!(t.contains("aliasing.key_is_query is true but input.key"), "{t}");
    // A bool mask read as float, and the reverse with values that are not 0 or 1.
    let dir = edited_case("mha/batch_first_separate_bool_kpm_f32", "kind", |v| {
        v["call"]["key_padding_mask"] = "float".into();
    });
    let t = replay(&dir);
    assert!(t.contains(r#"call.key_padding_mask is "float" but input.key_padding_mask has logical_dtype "bool""#), "{t}");
    let dir = edited_case("mha/distinct_float_kpm_f64", "float-as-bool", |v| {
        v["call"]["key_padding_mask"] = "bool".into();
        if let Some(t) = v["tensors"].get_mut("input.key_padding_mask") {
            t.as_object_mut().unwrap().remove("logical_dtype");
        }
    });
    let t = replay(&dir);
    assert!(t.contains("is read as a bool mask but is stored as F64"), "{t}");
    // A top-level array: the message said "expected a string".
    let dir = edited_case("mha/batch1_n1_f32", "array", |v| *v = serde_json::json!([1, 2, 3]));
    let t = replay(&dir);
    assert!(t.contains("case.json must be a JSON object") && t.contains("got an array"), "{t}");
    assert_eq!(t.matches(&*dir.display().to_string()).count(), 1, "the directory named once: {t}");
    // An upstream gradient of the wrong shape: candle's "shape mismatch in mul" named neither.
    let dir = edited_case("mha/batch1_n1_f32", "grad", |v| {
        v["tensors"]["grad.output"]["shape"] = serde_json::json!([2, 2]);
    });
    let st = dir.join("case.safetensors");
    let mut w = multihead::state_dict::load_safetensors(&st, &candle_core::Device::Cpu).unwrap();
    let g = candle_core::Tensor::zeros((2, 2), w["grad.output"].dtype(), &candle_core::Device::Cpu);
    w.insert("grad.output".into(), g.unwrap());
    multihead::state_dict::save_safetensors(w.iter().map(|(k, t)| (k.as_str(), t)), &st).unwrap();
    let t = replay(&dir);
    assert!(t.contains("grad.output has shape [2, 2] but the output is"), "{t}");
    // A gradient stored for a bool mask: only a float mask (a learned bias) has one.
    let dir = edited_case("mha/batch_first_separate_bool_kpm_f32", "bool-grad", |v| {
        let shape = v["tensors"]["input.key_padding_mask"]["shape"].clone();
        v["tensors"]["expect.grad.key_padding_mask"] =
            serde_json::json!({"shape": shape, "dtype": "float32"});
    });
    let st = dir.join("case.safetensors");
    let mut w = multihead::state_dict::load_safetensors(&st, &candle_core::Device::Cpu).unwrap();
    let g = w["input.key_padding_mask"].to_dtype(candle_core::DType::F32).unwrap();
    w.insert("expect.grad.key_padding_mask".into(), g);
    multihead::state_dict::save_safetensors(w.iter().map(|(k, t)| (k.as_str(), t)), &st).unwrap();
    let t = replay(&dir);
    assert!(
        t.contains(
            "expect.grad.key_padding_mask is stored but key_padding_mask is not a float mask"
        ),
        "{t}"
    );
}

// A FIFO as case.json (nobody writes it) was waited on for ever.
#[test]
fn replay_refuses_a_fifo_as_case_json() {
    let dir = tmp("fifo");
    let src = fixtures().join("mha/packed_self_nomask_f32/case.safetensors");
    std::fs::copy(src, dir.join("case.safetensors")).unwrap();
    assert!(Command::new("mkfifo").arg(dir.join("case.json")).status().unwrap().success());
    let start = Instant::now();
    let o = bin().arg("replay").arg(&*dir).arg("--out").arg(dir.join("r.st")).output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(60), "replay took {:?}", start.elapsed());
    assert!(!o.status.success());
    let t = text(&o);
    assert!(t.contains("case.json is not a regular file"), "{t}");
    // `check` names it too (it said only "no case found").
    let t = text(&check(&dir));
    assert!(
        t.contains("case.json is not a regular file") && t.contains("0 passed, 1 failed"),
        "{t}"
    );
}

// An adversarial run (2026-12-07): case.json's tensor table was never compared with the file,
// a module case in training mode with dropout replayed (and failed its check without a
// reason), and `replay --out` could overwrite the case's own tensors.
#[test]
fn declared_shapes_training_dropout_and_the_cases_own_files_are_refused() {
    let dir = edited_case("mha/batch1_n1_f32", "declared_shape", |v| {
        v["tensors"]["input.query"]["shape"] = serde_json::json!([99, 99, 99]);
    });
    let t = text(&check(&dir));
    assert!(t.contains("declares input.query with shape [99, 99, 99]"), "{t}");
    let dir = edited_case("mha/batch1_n1_f32", "declared_dtype", |v| {
        v["tensors"]["input.query"]["dtype"] = "float64".into();
    });
    let t = text(&check(&dir));
    assert!(t.contains("declares input.query as F64"), "{t}");
    let dir = edited_case("mha/batch1_n1_f32", "training_dropout", |v| {
        v["training"] = true.into();
        v["constructor"]["dropout"] = 0.5.into();
    });
    let t = text(&check(&dir));
    assert!(t.contains("dropout = 0.5 with training = true"), "{t}");
    let dir = edited_case("mha/batch1_n1_f32", "own_files", |_| {});
    let before = std::fs::read(dir.join("case.safetensors")).unwrap();
    let o = bin().arg("replay").arg(&*dir).arg("--out").arg(dir.join("case.safetensors")).output();
    let o = o.unwrap();
    assert!(!o.status.success() && text(&o).contains("own case.safetensors"), "{}", text(&o));
    assert_eq!(before, std::fs::read(dir.join("case.safetensors")).unwrap());
    assert!(check(&dir).status.success());
}

// An independent case writer (2026-12-07): `str(torch.bool)` as a logical dtype or a mask kind,
// and `format_version` written as `1.0`, were refused while `"torch.float32"` as a stored dtype
// was taken. The same case in those spellings passes; other versions stay refused.
#[test]
fn torch_spellings_of_bool_and_an_integral_version_are_taken() {
    let dir = edited_case("mha/batch_first_separate_bool_kpm_f32", "torch_bool", |v| {
        v["format_version"] = serde_json::json!(1.0);
        v["call"]["key_padding_mask"] = "torch.bool".into();
        v["tensors"]["input.key_padding_mask"]["logical_dtype"] = "torch.bool".into();
        v["tensors"]["input.key_padding_mask"]["dtype"] = "torch.uint8".into();
    });
    let o = check(&dir);
    assert!(o.status.success() && text(&o).contains("1 passed, 0 failed"), "{}", text(&o));
    for bad in [serde_json::json!(1.5), serde_json::json!(2)] {
        let dir = edited_case("mha/batch1_n1_f32", "version", |v| v["format_version"] = bad);
        let t = text(&check(&dir));
        assert!(t.contains("format_version"), "{t}");
    }
}
