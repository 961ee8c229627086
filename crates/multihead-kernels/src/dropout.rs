//! Counter-based dropout randomness.
//!
//! A dropout mask element is a pure function of `(seed, offset, bh, row, col)`: no generator
//! state is advanced while the mask is drawn. The forward and the backward of an attention kernel
//! (and a composed reference) therefore draw the same mask independently, in any order and on any
//! number of threads.
//!
//! The mixer is SplitMix64's finaliser applied once per coordinate. It is not a cryptographic
//! generator; it passes the statistical checks in this module's tests (mean and independence of
//! neighbouring elements), which is what dropout needs.

/// The golden-ratio increment of SplitMix64.
pub(crate) const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser: a bijective mixing of 64 bits.
#[inline(always)]
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Identifies one dropout draw: which seed, and which call (offset) under that seed.
///
/// `multihead` draws a fresh `offset` from its global generator for every dropout application,
/// like PyTorch's Philox `(seed, offset)` pairs on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DropoutKey {
    /// The user's seed.
    pub seed: u64,
    /// Which draw under that seed.
    pub offset: u64,
}

impl DropoutKey {
    /// The per-row state: everything but the column folded in. Hoist it out of column loops.
    #[inline]
    pub fn row_state(&self, bh: u64, row: u64) -> u64 {
        let s = mix(self.seed.wrapping_add(GOLDEN));
        let s = mix(s ^ self.offset.wrapping_mul(GOLDEN).wrapping_add(1));
        let s = mix(s ^ bh.wrapping_mul(GOLDEN).wrapping_add(2));
        mix(s ^ row.wrapping_mul(GOLDEN).wrapping_add(3))
    }

    /// A uniform number in `[0, 1)` with 24 bits of precision for element `(bh, row, col)`.
    #[inline]
    pub fn uniform(&self, bh: u64, row: u64, col: u64) -> f32 {
        uniform_from_row(self.row_state(bh, row), col)
    }

    /// Whether element `(bh, row, col)` survives dropout with drop probability `p`.
    #[inline]
    pub fn keep(&self, bh: u64, row: u64, col: u64, p: f64) -> bool {
        keep_from_row(self.row_state(bh, row), col, p)
    }
}

/// A uniform number in `[0, 1)` from a row state ([`DropoutKey::row_state`]) and a column.
#[inline(always)]
pub fn uniform_from_row(row_state: u64, col: u64) -> f32 {
    let bits = mix(row_state ^ column_term(col));
    (bits >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// What [`uniform_from_row`] xors into the row state for column `col` (vectorised kernels
/// use it to draw many rows of one column at once).
#[inline(always)]
pub(crate) fn column_term(col: u64) -> u64 {
    col.wrapping_mul(GOLDEN).wrapping_add(4)
}

/// The integer threshold `t` such that, for the 24-bit draw `u = bits >> 40`,
/// `keep_from_row(..) == (u >= t)` exactly (`u / 2^24 >= p` with both sides exact).
#[inline]
pub(crate) fn keep_threshold(p: f64) -> u64 {
    (p * (1u64 << 24) as f64).ceil().max(0.0) as u64
}

/// Whether a column survives, given the row state and the drop probability `p`.
///
/// An element is dropped when its uniform draw is below `p`, so `p = 0` keeps everything.
#[inline(always)]
pub fn keep_from_row(row_state: u64, col: u64, p: f64) -> bool {
    (uniform_from_row(row_state, col) as f64) >= p
}

/// Fills `out` (shape `[bh, rows, cols]`, row-major) with the dropout multiplier: `0` for a
/// dropped element and `1 / (1 - p)` for a kept one.
///
/// Errors: `p` outside `[0, 1)`, or `out` not holding exactly `bh · rows · cols` elements.
pub fn fill_scale_mask(
    key: DropoutKey,
    p: f64,
    bh: usize,
    rows: usize,
    cols: usize,
    out: &mut [f64],
) -> Result<(), crate::attention::KernelError> {
    use crate::attention::KernelError;
    if !(0.0..1.0).contains(&p) {
        return Err(KernelError::InvalidDropout { p });
    }
    let len = bh
        .checked_mul(rows)
        .and_then(|n| n.checked_mul(cols))
        .ok_or(KernelError::Overflow { name: "out" })?;
    if out.len() != len {
        return Err(KernelError::InvalidArgument {
            name: "out",
            msg: format!(
                "expected bh·rows·cols = {bh}·{rows}·{cols} = {len} elements, got {}",
                out.len()
            ),
        });
    }
    let scale = 1.0 / (1.0 - p);
    for b in 0..bh {
        for r in 0..rows {
            let state = key.row_state(b as u64, r as u64);
            let base = (b * rows + r) * cols;
            for (c, o) in out[base..base + cols].iter_mut().enumerate() {
                *o = if keep_from_row(state, c as u64, p) { scale } else { 0.0 };
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn same_key_same_mask_and_keys_differ() {
        let a = DropoutKey { seed: 1, offset: 0 };
        let b = DropoutKey { seed: 1, offset: 1 };
        let mut ma = vec![0.0; 2 * 8 * 64];
        let mut mb = vec![0.0; 2 * 8 * 64];
        fill_scale_mask(a, 0.5, 2, 8, 64, &mut ma).unwrap();
        let mut ma2 = vec![0.0; 2 * 8 * 64];
        fill_scale_mask(a, 0.5, 2, 8, 64, &mut ma2).unwrap();
        fill_scale_mask(b, 0.5, 2, 8, 64, &mut mb).unwrap();
        assert_eq!(ma, ma2);
        assert_ne!(ma, mb);
    }

    #[test]
    fn a_mask_of_the_wrong_size_or_a_bad_p_is_an_error() {
        let key = DropoutKey { seed: 1, offset: 0 };
        let mut short = vec![7.0; 2 * 8 * 64 - 1];
        let err = fill_scale_mask(key, 0.5, 2, 8, 64, &mut short).unwrap_err();
        assert!(err.to_string().contains("1024 elements, got 1023"), "{err}");
        assert!(short.iter().all(|&x| x == 7.0), "nothing written");
        let mut out = vec![0.0; 4];
        for p in [1.0, -0.1, f64::NAN] {
            let err = fill_scale_mask(key, p, 1, 1, 4, &mut out).unwrap_err();
            assert!(matches!(err, crate::attention::KernelError::InvalidDropout { .. }), "{err}");
        }
    }

    #[test]
    fn drop_rate_matches_p() {
        let key = DropoutKey { seed: 7, offset: 3 };
        for &p in &[0.1, 0.3, 0.5, 0.9] {
            let n = 200_000u64;
            let dropped = (0..n).filter(|&i| !key.keep(i % 7, i / 7 % 13, i, p)).count() as f64;
            let rate = dropped / n as f64;
            // Binomial standard deviation is below 0.0012 here; allow five of them.
            assert!((rate - p).abs() < 0.006, "p={p} rate={rate}");
        }
    }

    #[test]
    fn neighbours_are_independent() {
        // P(both kept) for horizontal and vertical neighbours must be (1-p)^2.
        let key = DropoutKey { seed: 11, offset: 0 };
        let p = 0.5;
        let (rows, cols) = (256u64, 256u64);
        let (mut both_h, mut both_v) = (0u64, 0u64);
        for r in 0..rows - 1 {
            for c in 0..cols - 1 {
                let k = key.keep(0, r, c, p);
                both_h += (k && key.keep(0, r, c + 1, p)) as u64;
                both_v += (k && key.keep(0, r + 1, c, p)) as u64;
            }
        }
        let n = ((rows - 1) * (cols - 1)) as f64;
        for both in [both_h, both_v] {
            let rate = both as f64 / n;
            assert!((rate - 0.25).abs() < 0.01, "rate={rate}");
        }
    }

    #[test]
    fn integer_threshold_matches_keep() {
        let key = DropoutKey { seed: 3, offset: 4 };
        for &p in &[0.0, 1e-9, 0.1, 0.25, 0.3, 0.5, 0.9, 1.0 - 1e-9, 0.999_999_9] {
            let t = keep_threshold(p);
            for c in 0..20_000u64 {
                let state = key.row_state(c % 5, c / 5);
                let u = mix(state ^ column_term(c)) >> 40;
                assert_eq!(keep_from_row(state, c, p), u >= t, "p={p} c={c}");
            }
        }
        // Exactly at the boundary: u / 2^24 == p keeps.
        assert_eq!(keep_threshold(0.5), 1 << 23);
        assert_eq!(keep_threshold(0.5 + 1e-12), (1 << 23) + 1);
    }

    #[test]
    fn p_zero_keeps_everything() {
        let key = DropoutKey { seed: 0, offset: 0 };
        assert!((0..10_000).all(|c| key.keep(0, 0, c, 0.0)));
    }
}
