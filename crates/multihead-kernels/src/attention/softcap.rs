//! Tanh soft-capping of a score tile, its slope for the backward, and the masks folded into a
//! tile first when the cap applies after them (ONNX's placement).

use super::simd::Simd;

/// `score = c·tanh(score / c)` over the first `bc` rows of `brp` lanes of a score tile. With
/// `keep_neg_inf`, a `-inf` score (a masked entry, when the masks were added first) stays
/// `-inf` instead of becoming `-c`.
///
/// # Safety
/// `S` is available; `st` holds `bc · brp` floats and `brp` is a multiple of `S::LANES`.
#[inline(always)]
pub(crate) unsafe fn softcap_tile<S: Simd>(
    st: *mut f32,
    brp: usize,
    bc: usize,
    c: f32,
    keep_neg_inf: bool,
) {
    let l = S::LANES;
    // SAFETY: every access lies in the tile (caller).
    unsafe {
        let (inv, lowest) = (1.0 / c, S::splat(f32::MIN));
        for x in (0..bc * brp).step_by(l) {
            let p = st.add(x);
            let v = S::load(p);
            let mut y = S::softcap(v, c, inv);
            if keep_neg_inf {
                // `min(v, MIN) − MIN` is `-inf` for `v = -inf` and 0 for every other `v`, `+inf`
                // (capped to `c`) and NaN included (`v − max(v, MIN)` was `inf − inf`, NaN, at
                // `+inf`).
                y = S::add(y, S::sub(S::min(v, lowest), lowest));
            }
            S::store(p, y);
        }
    }
}

/// The soft cap's derivative `1 − (x/c)²` at a capped score `x`, as a factor on `dS`; `0`
/// where the score is hidden (`x = −inf`), NaN where it is NaN.
///
/// # Safety
/// `S` is available.
#[inline(always)]
pub(crate) unsafe fn softcap_slope<S: Simd>(x: S::V, inv: S::V) -> S::V {
    // SAFETY: vector arithmetic only.
    unsafe {
        let t = S::mul(x, inv);
        S::max(S::splat(0.0), S::sub(S::splat(1.0), S::mul(t, t)))
    }
}

/// Adds a mask tile to a score tile: `mt` holds one value per key (`per_key`) or one per
/// entry (`bc` rows of `brp`).
///
/// # Safety
/// `S` is available; `st` holds `bc · brp` floats, `mt` `bc` or `bc · brp`; `brp` is a
/// multiple of `S::LANES`.
#[inline(always)]
pub(crate) unsafe fn add_mask<S: Simd>(
    st: *mut f32,
    mt: *const f32,
    per_key: bool,
    brp: usize,
    bc: usize,
) {
    let l = S::LANES;
    // SAFETY: every access lies in the tiles (caller).
    unsafe {
        for j in 0..bc {
            for x in (0..brp).step_by(l) {
                let p = st.add(j * brp + x);
                let m = if per_key { S::splat(*mt.add(j)) } else { S::load(mt.add(j * brp + x)) };
                S::store(p, S::add(S::load(p), m));
            }
        }
    }
}
