//! Score modifications computed from indices: the ALiBi bias `−m_h·|i + offset − j|`, and the
//! order in which a fresh score tile takes the masks, the bias and the soft cap.
//!
//! A bias is added like a mask: after the cap (in the softmax pass, next to the masks, so that
//! the backward's cap slope is taken from the capped score alone), or before it when the cap
//! applies after the masks (ONNX's placement).

use super::simd::Simd;
use super::softcap::{add_mask, softcap_tile};
use super::AttnParams;

/// Lane indices as floats, for the bias of a vector of queries.
static IOTA: [f32; 16] = [0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.];

/// The ALiBi bias of one score tile: head slope and the tile's corner.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Alibi {
    neg_slope: f32,
    /// `i0 + offset − j0`: the signed distance of the tile's first query from its first key.
    base: f32,
}

impl Alibi {
    /// The bias of head `h` for the tile of queries `i0..` and keys `j0..` (`None`: no ALiBi).
    pub(crate) fn of(p: &AttnParams<'_>, h: usize, i0: usize, j0: usize) -> Option<Alibi> {
        let slope = *p.alibi?.get(h)?;
        // Distances beyond 2^24 round in f32, as the scores they are added to do.
        let base = i0 as f64 + p.offset as f64 - j0 as f64;
        Some(Alibi { neg_slope: -slope, base: base as f32 })
    }

    /// The bias of queries `lane0..lane0 + LANES` (tile-local) down the tile's key rows:
    /// [`AlibiColumn::next`] gives key row 0, then 1, and so on.
    ///
    /// # Safety
    /// `S` is available and has at most 16 lanes.
    #[inline(always)]
    pub(crate) unsafe fn column<S: Simd>(&self, lane0: usize) -> AlibiColumn<S> {
        // SAFETY: `IOTA` holds 16 floats, at least `S::LANES`.
        unsafe {
            let d0 = S::add(S::load(IOTA.as_ptr()), S::splat(self.base + lane0 as f32));
            let (j, one, neg_slope) = (S::splat(0.0), S::splat(1.0), S::splat(self.neg_slope));
            AlibiColumn { d0, j, one, neg_slope }
        }
    }

    /// Adds the bias to `bc` rows of `nvec` vectors (stride `brp`) of a score tile.
    ///
    /// # Safety
    /// `S` is available; `st` holds `bc · brp` floats and `nvec · S::LANES <= brp`.
    #[inline(always)]
    pub(crate) unsafe fn add_tile<S: Simd>(
        &self,
        st: *mut f32,
        brp: usize,
        nvec: usize,
        bc: usize,
    ) {
        let l = S::LANES;
        // SAFETY: within the tile (caller).
        unsafe {
            for vi in 0..nvec {
                let mut col = self.column::<S>(vi * l);
                for j in 0..bc {
                    let p = st.add(j * brp + vi * l);
                    S::store(p, S::add(S::load(p), col.next()));
                }
            }
        }
    }
}

/// The ALiBi bias of one vector of queries, key row after key row: the signed distances `d0`
/// of the tile's first key row, the current row `j` (counted exactly: a tile has far fewer
/// than 2^24 rows) and the negated slope. Each distance `d0 − j` is one rounding of the exact
/// one (exact below 2^24), however many rows came before.
#[derive(Clone, Copy)]
pub(crate) struct AlibiColumn<S: Simd> {
    d0: S::V,
    j: S::V,
    one: S::V,
    neg_slope: S::V,
}

impl<S: Simd> AlibiColumn<S> {
    /// The bias `−m·|d|` of the current key row; moves to the next one.
    ///
    /// # Safety
    /// `S` is available.
    #[inline(always)]
    pub(crate) unsafe fn next(&mut self) -> S::V {
        // SAFETY: vector arithmetic only.
        unsafe {
            let b = S::mul(S::abs(S::sub(self.d0, self.j)), self.neg_slope);
            self.j = S::add(self.j, self.one);
            b
        }
    }
}

/// Whether the masks and the bias go inside the soft cap (ONNX's placement).
pub(crate) fn bias_before_cap(p: &AttnParams<'_>) -> bool {
    p.softcap.is_some() && p.softcap_after_masks
}

/// A fresh tile of scaled scores (`bc` key rows of `brp` lanes, `nvec` vectors used), before
/// the band is hidden: with the cap after the masks, the mask tile `mt` (one value per key if
/// `per_key`) and the bias are added and the sum capped (a `-inf` entry kept); otherwise the
/// scores are capped and the masks and the bias are left to the softmax pass.
///
/// # Safety
/// `S` is available; `st` holds `bc · brp` floats, `mt` (when masks apply) `bc` or `bc · brp`;
/// `brp` is a multiple of `S::LANES` and at least `nvec · S::LANES`.
#[inline(always)]
pub(crate) unsafe fn cap_tile<S: Simd>(
    p: &AttnParams<'_>,
    (st, brp, nvec, bc): (*mut f32, usize, usize, usize),
    (mt, per_key): (*const f32, bool),
    alibi: Option<&Alibi>,
) {
    let Some(c) = p.softcap else { return };
    // SAFETY: within the tiles (caller).
    unsafe {
        if bias_before_cap(p) {
            if p.cap_masks() {
                add_mask::<S>(st, mt, per_key, brp, bc);
            }
            if let Some(a) = alibi {
                a.add_tile::<S>(st, brp, nvec, bc);
            }
        }
        softcap_tile::<S>(st, brp, bc, c, p.cap_masks());
    }
}
