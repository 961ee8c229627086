//! Replays every committed PyTorch golden case and compares with PyTorch's numbers at the
//! project's tolerances (f32 forward rtol/atol 1e-5, gradients 1e-4; f64 1e-10).

use std::path::PathBuf;

use candle_core::DType;
use multihead_parity::{self as parity, Case};

fn fixture_root(kind: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(kind)
}

fn case_dirs(kind: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(fixture_root(kind))
        .expect("fixtures directory exists")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join("case.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

#[test]
fn every_mha_golden_case_matches_pytorch() {
    replay_all("mha", 118, 500);
}

#[test]
fn every_transformer_golden_case_matches_pytorch() {
    replay_all("transformer", 40, 400);
}

#[test]
fn every_sdpa_golden_case_matches_pytorch() {
    replay_all("sdpa", 28, 80);
}

#[test]
fn every_golden_case_matches_pytorch_on_the_composed_path_too() {
    multihead::with_backend(multihead::Backend::Composed, || {
        replay_all("mha", 118, 500);
        replay_all("transformer", 40, 400);
        replay_all("sdpa", 28, 80);
    });
}

#[test]
fn every_bf16_golden_case_passes_with_bf16_products_too() {
    // Under `Bf16Products::Direct` the cases run without a gradient (the eval ones) multiply
    // bf16 operands; the cases with gradients keep the widened path. Either way, each case
    // must pass the bf16 rule (our error at most twice PyTorch bf16's own).
    let mut dirs: Vec<PathBuf> = ["mha", "transformer", "sdpa"]
        .iter()
        .flat_map(|k| case_dirs(k))
        .filter(|d| d.file_name().is_some_and(|n| n.to_string_lossy().contains("bf16")))
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 17, "expected the bf16 cases, found {}", dirs.len());
    // Each bf16 micro-kernel of the projections' GEMM: the default one, and the AMX tiles'
    // emulation (the sums real tiles give, in their layout).
    use multihead_kernels::bf16gemm::{with_bf16_kernel, Bf16Kernel};
    for kernel in [Bf16Kernel::Auto, Bf16Kernel::AmxEmulated] {
        let failures: Vec<String> = with_bf16_kernel(kernel, || {
            multihead::with_bf16_products(multihead::Bf16Products::Direct, || {
                dirs.iter()
                    .filter_map(|dir| match parity::check_dir(dir).checks {
                        Ok(checks) if checks.iter().all(|c| c.passed) && !checks.is_empty() => None,
                        Ok(checks) => Some(format!(
                            "{kernel:?} {}: {} checks, some failed",
                            dir.display(),
                            checks.len()
                        )),
                        Err(e) => Some(format!("{kernel:?} {}: {e}", dir.display())),
                    })
                    .collect()
            })
        });
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}

/// Runs `multihead check`'s own check on every case of a fixture folder.
fn replay_all(kind: &str, min_cases: usize, min_tensors: usize) {
    let found = parity::find_cases(&[fixture_root(kind)]);
    assert!(found.notes.is_empty(), "{:?}", found.notes);
    let dirs = found.cases;
    assert!(
        dirs.len() >= min_cases,
        "expected at least {min_cases} {kind} cases, found {}",
        dirs.len()
    );
    let mut failures = Vec::new();
    let mut compared = 0usize;
    for dir in &dirs {
        let report = parity::check_dir(dir);
        match &report.checks {
            Ok(checks) => {
                compared += checks.len();
                for c in checks.iter().filter(|c| !c.passed) {
                    failures.push(format!(
                        "{}: {}: max|diff| {:.3e} ({:.2}x tolerance){}",
                        dir.display(),
                        c.name,
                        c.max_abs,
                        c.worst_ratio,
                        c.note.as_deref().unwrap_or("")
                    ));
                }
            }
            Err(e) => failures.push(format!("{}: {e}", dir.display())),
        }
        if report.checks.as_ref().is_ok_and(|c| c.is_empty()) {
            failures.push(format!("{}: no expect.* tensors", dir.display()));
        }
    }
    assert!(compared > min_tensors, "compared only {compared} tensors");
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn golden_cases_cover_gradients_for_inputs_and_every_parameter() {
    // For every grad-mode case, the replay must produce a gradient for each distinct input and
    // each parameter, and PyTorch's expected set must be exactly what the replay produced.
    let mut grad_cases = 0;
    for dir in case_dirs("mha").into_iter().chain(case_dirs("transformer")) {
        let case = Case::load(&dir).expect("case loads");
        if !case.meta.grad_mode {
            continue;
        }
        grad_cases += 1;
        let result = parity::replay(&case).expect("replays");
        let produced: Vec<&str> =
            result.keys().filter(|k| k.starts_with("grad.")).map(|k| k.as_str()).collect();
        let mut expected: Vec<&str> = case
            .tensors
            .keys()
            .filter_map(|k| k.strip_prefix("expect.").filter(|k| k.starts_with("grad.")))
            .collect();
        expected.sort();
        assert_eq!(produced, expected, "{}", dir.display());
        let params = case.tensors.keys().filter(|k| k.starts_with("param.")).count();
        let param_grads = produced.iter().filter(|k| k.starts_with("grad.param.")).count();
        assert_eq!(params, param_grads, "{}", dir.display());
    }
    assert!(grad_cases >= 80, "only {grad_cases} gradient cases");
}

#[test]
fn golden_cases_cover_both_dtypes() {
    let dtypes: Vec<DType> =
        case_dirs("mha").iter().map(|d| Case::load(d).map(|c| c.dtype()).expect("dtype")).collect();
    assert!(dtypes.iter().filter(|d| **d == DType::F64).count() >= 20);
    assert!(dtypes.iter().filter(|d| **d == DType::F32).count() >= 20);
}

/// An autocast case is graded as a bfloat16 one: by its float64 references, and without them
/// by bfloat16's tolerances (f32's would fail it: its products are bf16); an unknown autocast
/// dtype is an error naming the key.
#[test]
fn autocast_cases_are_graded_as_bfloat16_with_or_without_references() {
    let dir = fixture_root("transformer").join("autocast_enc_layer_relu_kpm");
    let mut case = Case::load(&dir).unwrap();
    assert_eq!(case.autocast().unwrap(), Some(DType::BF16));
    let with_refs = parity::check(&case).unwrap();
    assert!(with_refs.iter().all(|c| c.passed), "{with_refs:?}");
    case.tensors.retain(|name, _| !name.starts_with("ref64."));
    let without = parity::check(&case).unwrap();
    assert!(!without.is_empty() && without.iter().all(|c| c.passed), "{without:?}");
    // The same results against f32's tolerances fail somewhere.
    case.meta.autocast = None;
    let tol = case.tolerance(true);
    assert!(tol.rel < 1e-3, "f32 tolerance {tol:?}");
    case.meta.autocast = Some("bf16".into());
    let err = case.autocast().unwrap_err().to_string();
    assert!(err.contains("autocast") && err.contains("bfloat16"), "{err}");
}

/// A case without `expect.output` fails its check, by name, rather than passing on its
/// gradients alone (it passed before: only the stored `expect.*` tensors were compared).
#[test]
fn a_case_without_its_output_fails_the_check() {
    let dir = fixture_root("mha").join("packed_self_nomask_f32");
    let mut case = Case::load(&dir).unwrap();
    assert!(parity::check(&case).unwrap().iter().all(|c| c.passed));
    assert!(case.tensors.remove("expect.output").is_some());
    assert!(case.tensors.keys().any(|k| k.starts_with("expect.grad.")));
    let checks = parity::check(&case).unwrap();
    let missing: Vec<_> = checks.iter().filter(|c| !c.passed).collect();
    assert_eq!(missing.len(), 1, "{checks:?}");
    assert_eq!(missing[0].name, "expect.output");
    assert!(missing[0].note.as_deref().is_some_and(|n| n.contains("missing")), "{checks:?}");
}

/// A NaN where PyTorch's value is finite fails the check with a note naming the element (the
/// line read "max|diff| inf" and no more).
#[test]
fn a_nan_on_one_side_is_named_by_its_element() {
    let dir = fixture_root("mha").join("packed_self_nomask_f32");
    let mut case = Case::load(&dir).unwrap();
    let out = &case.tensors["expect.output"];
    let mut v = out.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    v[3] = f32::NAN;
    let nan = candle_core::Tensor::from_vec(v, out.dims(), out.device()).unwrap();
    case.tensors.insert("expect.output".into(), nan);
    let checks = parity::check(&case).unwrap();
    let c = checks.iter().find(|c| c.name == "expect.output").unwrap();
    assert!(!c.passed);
    let note = c.note.as_deref().unwrap_or_default();
    assert!(note.contains("element 3") && note.contains("expected NaN"), "{note}");
}
