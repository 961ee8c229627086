//! The `multihead` binary keeps the parity-case contract: replay writes the named results or
//! nothing; check ends with `N passed, N failed`.

#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

use candle_core::Device;
use multihead::state_dict::load_safetensors;
use multihead_parity::Tolerance;

mod common;
use common::Scratch;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_multihead"))
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mha")
}

fn tmp(name: &str) -> Scratch {
    Scratch::new(&format!("cli-{name}"))
}

#[test]
fn replay_writes_every_result_the_contract_names() {
    let case = fixtures().join("weights_in_loss_unbatched_bias_kv_f64");
    let scratch = tmp("replay");
    let out = scratch.join("result.safetensors");
    let status = bin().arg("replay").arg(&case).arg("--out").arg(&out).status().expect("runs");
    assert!(status.success());
    let result = load_safetensors(&out, &Device::Cpu).expect("result");
    let expected = load_safetensors(case.join("case.safetensors"), &Device::Cpu).expect("case");
    let mut compared = 0;
    for (name, e) in expected.iter().filter(|(k, _)| k.starts_with("expect.")) {
        let key = &name["expect.".len()..];
        let a = result.get(key).unwrap_or_else(|| panic!("result lacks {key}"));
        assert_eq!(a.dtype(), e.dtype(), "{key} keeps the case dtype");
        assert!(Tolerance::F64.compare(a, e).expect("compare").passed(), "{key}");
        compared += 1;
    }
    assert_eq!(compared, result.len(), "no extra results");
    assert!(result.contains_key("grad.param.bias_k"));
}

#[test]
fn replay_of_a_bad_case_fails_with_one_line_and_writes_nothing() {
    let dir = tmp("bad");
    let case = dir.join("case");
    std::fs::create_dir_all(&case).expect("dir");
    std::fs::write(case.join("case.json"), r#"{"format_version": 1, "module": "torch.nn.Conv2d"}"#)
        .expect("write");
    std::fs::copy(
        fixtures().join("packed_self_nomask_f32/case.safetensors"),
        case.join("case.safetensors"),
    )
    .expect("copy");
    let out = dir.join("result.safetensors");
    let o = bin().arg("replay").arg(&case).arg("--out").arg(&out).output().expect("runs");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("torch.nn.Conv2d") && err.contains(&case.display().to_string()), "{err}");
    assert!(!out.exists());
}

/// A misspelt bf16 variable is refused before anything runs (the library alone ignores it).
#[test]
fn an_unknown_bf16_environment_value_is_refused() {
    let case = fixtures().join("weights_in_loss_unbatched_bias_kv_f64");
    for (var, value, expect) in [
        ("MULTIHEAD_BF16_PRODUCTS", "fast", "MULTIHEAD_BF16_PRODUCTS: unknown value \"fast\""),
        ("MULTIHEAD_BF16_KERNEL", "tiles", "MULTIHEAD_BF16_KERNEL: unknown bf16 kernel \"tiles\""),
    ] {
        let o = bin().env(var, value).arg("check").arg(&case).output().expect("runs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{var}={value}: {err}");
        assert!(err.contains(expect), "{var}={value}: {err}");
        assert!(o.stdout.is_empty(), "{var}={value}: ran anyway");
    }
    let o = bin().env("MULTIHEAD_BF16_PRODUCTS", "widened").arg("check").arg(&case).output();
    assert!(o.expect("runs").status.success(), "a valid value is accepted");
}

#[test]
fn check_ends_with_the_count_line() {
    let o = bin()
        .arg("check")
        .arg(fixtures().join("packed_self_nomask_f32"))
        .arg(fixtures().join("unbatched_self_f32"))
        .arg(tmp("missing").join("no-such-case"))
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(stdout.trim_end().lines().last(), Some("2 passed, 1 failed"), "{stdout}");
    assert!(!o.status.success());
}

#[test]
fn demo_is_reproducible_for_a_seed() {
    let dir = tmp("demo");
    let run = |name: &str, seed: &str| {
        let out = dir.join(name);
        let o = bin()
            .args(["demo", "--quiet", "--steps", "40", "--seed", seed, "--out"])
            .arg(&out)
            .output()
            .expect("runs");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        // Drop the wall-clock time, keep accuracy and predictions.
        let lines: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with("wrote"))
            .map(|l| l.split(" in ").next().unwrap_or(l).to_string())
            .collect();
        (lines, std::fs::read(out).expect("png"))
    };
    let (a, pa) = run("a.png", "7");
    let (b, pb) = run("b.png", "7");
    let (_, pc) = run("c.png", "8");
    assert_eq!(a, b);
    assert_eq!(pa, pb, "same seed, same attention.png");
    assert_ne!(pa, pc, "another seed, another run");
    assert!(pa.starts_with(b"\x89PNG"));
}

#[test]
fn the_seq2seq_demo_decodes_with_the_cache_as_it_would_by_recomputing() {
    let o = bin()
        .args(["demo", "--seq2seq", "--quiet", "--steps", "300", "--require-accuracy", "0.95"])
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("the tokens are identical"), "{stdout}");
    assert!(stdout.contains("greedy decoding of 1000 unseen sequences"), "{stdout}");
}
