//! Checking cases against PyTorch's numbers, and finding them on disk.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use multihead::Result;

use crate::case::Case;
use crate::replay::replay;

/// One compared tensor of a checked case.
#[derive(Clone, Debug)]
pub struct TensorCheck {
    /// The `expect.*` name.
    pub name: String,
    /// Whether it is within tolerance.
    pub passed: bool,
    /// The largest absolute difference.
    pub max_abs: f64,
    /// The worst error over the tolerance (at most 1 passes).
    pub worst_ratio: f64,
    /// Why it failed, when it failed for a reason other than values.
    pub note: Option<String>,
}

/// A bfloat16 result may be this many times further from the float64 reference than
/// PyTorch's bfloat16 result is (docs/case-format.md §6).
pub const BF16_FACTOR: f64 = 2.0;

/// Replays a case and compares every `expect.*` tensor with the tolerance of its kind; a
/// bfloat16 or autocast case with `ref64.*` tensors by the reference rule ([`BF16_FACTOR`]).
/// A case without `expect.output` fails (a check of that name, noted missing).
pub fn check(case: &Case) -> Result<Vec<TensorCheck>> {
    let result = replay(case)?;
    // An autocast case is graded by the reference rule too (its products are bf16).
    let reduced_products = case.autocast()?.is_some();
    let mut checks = Vec::new();
    let mut names: Vec<&String> =
        case.tensors.keys().filter(|k| k.starts_with("expect.")).collect();
    names.sort();
    // Every case stores what PyTorch returned first; one without it would pass on its
    // gradients alone.
    if !case.tensors.contains_key("expect.output") {
        checks.push(TensorCheck {
            name: "expect.output".into(),
            passed: false,
            max_abs: f64::INFINITY,
            worst_ratio: f64::INFINITY,
            note: Some(
                "missing: a case stores what PyTorch returned first as expect.output".into(),
            ),
        });
    }
    for name in names {
        let expected = &case.tensors[name];
        let key = &name["expect.".len()..];
        let grad = key.starts_with("grad.");
        let tol = case.tolerance(grad);
        let reference = case.tensors.get(&format!("{}{key}", crate::case::REF64));
        match result.get(key) {
            Some(actual) => {
                let c = match reference {
                    Some(r) if case.dtype() == candle_core::DType::BF16 || reduced_products => {
                        crate::tolerance::compare_to_reference(actual, expected, r, BF16_FACTOR)?
                    }
                    _ => tol.compare(actual, expected)?,
                };
                checks.push(TensorCheck {
                    name: name.clone(),
                    passed: c.passed(),
                    max_abs: c.max_abs,
                    worst_ratio: c.worst_ratio,
                    note: match (c.shape_mismatch, c.special) {
                        (true, _) => Some(match reference {
                            Some(r) if r.dims() != expected.dims() => format!(
                                "ref64.{key} has shape {:?} but expect.{key} {:?}",
                                r.dims(),
                                expected.dims()
                            ),
                            _ => format!(
                                "shape {:?} vs expected {:?}",
                                actual.dims(),
                                expected.dims()
                            ),
                        }),
                        (false, Some((i, ours, theirs))) => Some(format!(
                            "element {i} (flat): ours {ours}, expected {theirs}: NaN or an infinity on one side only"
                        )),
                        (false, None) => None,
                    },
                });
            }
            None => checks.push(TensorCheck {
                name: name.clone(),
                passed: false,
                max_abs: f64::INFINITY,
                worst_ratio: f64::INFINITY,
                note: Some("the replay produced no such tensor".into()),
            }),
        }
    }
    Ok(checks)
}

/// The outcome of checking one case.
#[derive(Clone, Debug)]
pub struct CaseReport {
    /// The case directory.
    pub dir: PathBuf,
    /// Every compared tensor, or why the case could not run.
    pub checks: std::result::Result<Vec<TensorCheck>, String>,
}

impl CaseReport {
    /// Whether the case ran and every compared tensor is within tolerance (a case without
    /// `expect.*` tensors fails: it checks nothing).
    pub fn passed(&self) -> bool {
        matches!(&self.checks, Ok(c) if !c.is_empty() && c.iter().all(|c| c.passed))
    }
}

/// Loads, replays and checks the case in `dir`.
pub fn check_dir(dir: &Path) -> CaseReport {
    let checks = Case::load(dir).and_then(|case| check(&case)).map_err(|e| e.to_string());
    CaseReport { dir: dir.to_path_buf(), checks }
}

/// What [`find_cases`] found.
#[derive(Clone, Debug, Default)]
pub struct Found {
    /// Case directories (holding a `case.json`), in sorted order.
    pub cases: Vec<PathBuf>,
    /// What was passed over and why (unreadable paths, symbolic-link loops).
    pub notes: Vec<String>,
}

/// Finds case directories under `roots`: a root holding a `case.json` is a case; otherwise
/// every case below it, in sorted order. A directory reached twice (a symbolic-link loop or
/// two links to one place) is visited once; unreadable paths below a root are noted, and a
/// root that cannot be read is returned as a case (checking it fails and says why).
pub fn find_cases(roots: &[PathBuf]) -> Found {
    let mut found = Found::default();
    let mut seen = BTreeSet::new();
    for root in roots {
        walk(root, true, &mut seen, &mut found);
    }
    found
}

fn walk(dir: &Path, root: bool, seen: &mut BTreeSet<DirId>, found: &mut Found) {
    let id = match dir_id(dir) {
        Ok(id) => id,
        // A root that cannot be read is kept as a case, so that checking it fails and says why.
        Err(_) if root => {
            found.cases.push(dir.to_path_buf());
            return;
        }
        Err(e) => {
            found.notes.push(format!("{}: cannot be read: {e}", dir.display()));
            return;
        }
    };
    if !seen.insert(id) {
        let real = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        found.notes.push(format!(
            "{}: already visited as {} (a symbolic-link loop or a second link); skipped",
            dir.display(),
            real.display()
        ));
        return;
    }
    // A case.json that is not a regular file (a FIFO, a directory) is a case too: its load
    // says what is wrong with it, where skipping it said only "no case found".
    if dir.join("case.json").exists() {
        found.cases.push(dir.to_path_buf());
        return;
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        // A root that is not a directory (a file given by mistake) fails as a case.
        Err(_) if root => {
            found.cases.push(dir.to_path_buf());
            return;
        }
        Err(e) => {
            found.notes.push(format!("{}: not a readable directory: {e}", dir.display()));
            return;
        }
    };
    let mut subdirs: Vec<PathBuf> =
        entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()).collect();
    subdirs.sort();
    for sub in subdirs {
        walk(&sub, false, seen, found);
    }
}

/// What identifies a directory however it is reached: its device and inode where there are
/// such (one `stat`, whatever the depth: canonicalising every directory of a deep tree cost
/// time cubic in its depth), its canonical path elsewhere.
#[cfg(unix)]
type DirId = (u64, u64);
#[cfg(not(unix))]
type DirId = PathBuf;

#[cfg(unix)]
fn dir_id(dir: &Path) -> std::io::Result<DirId> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(dir)?;
    Ok((m.dev(), m.ino()))
}

#[cfg(not(unix))]
fn dir_id(dir: &Path) -> std::io::Result<DirId> {
    dir.canonicalize()
}
