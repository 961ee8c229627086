//! The seeded global generator behind dropout (`torch.manual_seed` for this crate).

use std::sync::Mutex;

pub use multihead_kernels::dropout::DropoutKey;

/// PyTorch's default seed, `torch.initial_seed()` in a fresh process.
pub const DEFAULT_SEED: u64 = 67_280_421_310_721;

static GLOBAL: Mutex<DropoutKey> = Mutex::new(DropoutKey { seed: DEFAULT_SEED, offset: 0 });

/// Seeds the generator that dropout draws from, like `torch.manual_seed(seed)`.
///
/// Every dropout application takes the next [`DropoutKey`] `(seed, offset)` from this generator,
/// and its mask is a pure function of that key and the element's coordinates, so a program that
/// calls the same operations in the same order after `manual_seed(s)` drops the same elements,
/// whatever the number of threads a call is computed on.
///
/// The generator is one for the process, as PyTorch's default generator is: calls made from
/// several threads at once take its keys in whatever order they reach it (a Transformer
/// layer takes one per dropout, so two layers training at once may interleave their keys and
/// match no run made one call at a time, as in PyTorch). For results that do not depend on
/// other threads, give each call its own key: `MhaOptions::dropout_key` (which a layer's
/// `forward_with` also spreads over its own dropouts), `SdpaOptions::dropout_key`,
/// `PackedOptions::dropout_key`.
///
/// # Example
/// ```
/// multihead::manual_seed(42);
/// let a = multihead::random::next_dropout_key();
/// multihead::manual_seed(42);
/// assert_eq!(a, multihead::random::next_dropout_key());
/// ```
pub fn manual_seed(seed: u64) {
    let mut g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    *g = DropoutKey { seed, offset: 0 };
}

/// Takes the next dropout key from the global generator.
pub fn next_dropout_key() -> DropoutKey {
    let mut g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    let key = *g;
    g.offset = g.offset.wrapping_add(1);
    key
}
