//! # multihead-parity
//!
//! PyTorch parity cases for [`multihead`]: a case directory freezes one PyTorch module call
//! (weights, inputs, the upstream gradient and what PyTorch returned) so that the library can
//! be checked against PyTorch without PyTorch installed. The file contract is
//! `docs/case-format.md` in the repository.
//!
//! * [`Case::load`] reads a case strictly (typed `case.json`, bounded sizes, dtypes
//!   cross-checked with the stored tensors).
//! * [`replay`] rebuilds the module, loads its state_dict strictly, runs the call and
//!   back-propagates the case's loss.
//! * [`check`] compares the replay with every `expect.*` tensor at the case's tolerance
//!   ([`Tolerance`]); [`find_cases`] and [`check_dir`] are what `multihead check` runs.
//!
//! ```no_run
//! let report = multihead_parity::check_dir(std::path::Path::new("tests/fixtures/mha/unbatched_self_f32"));
//! assert!(report.passed());
//! ```

mod case;
mod check;
pub mod meta;
mod replay;
mod tolerance;

pub use case::{Case, REF64};
pub use check::{check, check_dir, find_cases, CaseReport, Found, TensorCheck, BF16_FACTOR};
pub use replay::{layer_config, mha_config, replay, ReplayResult};
pub use tolerance::{compare_to_reference, Comparison, Tolerance};
