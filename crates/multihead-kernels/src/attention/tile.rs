//! Small helpers shared by the forward, backward and weights tasks.

use super::gemm::{GemmArgs, Tri};
use super::simd::Simd;
use crate::dropout::{column_term, keep_threshold, DropoutKey};

/// Largest query block the tasks use (bounds the per-row dropout state array).
pub(crate) const MAX_BR: usize = 128;

/// Packs rows `src + i*ld` (`i < rows`, `n` floats each) transposed and multiplied by `f`
/// into `dst[c*ldd + i]`, zero-filling columns `rows..ldd`.
///
/// # Safety
/// `S` is available; `src + i*ld + c` readable for `i < rows`, `c < n`; `dst` has `n*ldd`
/// floats and `rows <= ldd`.
#[inline(always)]
pub(crate) unsafe fn pack_transposed<S: Simd>(
    dst: &mut [f32],
    ldd: usize,
    src: *const f32,
    ld: usize,
    rows: usize,
    n: usize,
    f: f32,
) {
    assert!(dst.len() >= n * ldd && rows <= ldd);
    // SAFETY: ranges checked above and by the caller.
    unsafe { S::transpose(dst.as_mut_ptr(), ldd, src, ld, rows, n, f, false) };
    if rows < ldd {
        for c in 0..n {
            dst[c * ldd + rows..(c + 1) * ldd].fill(0.0);
        }
    }
}

/// Copies `rows` rows of `n` floats from `src + i*ld` to the contiguous `dst + i*n`.
///
/// The backward copies a query block's strided `q` and `dO` rows (see `gather`) once and then
/// reads them once per key block from contiguous memory.
///
/// # Safety
/// `src + i*ld + c` readable and `dst + i*n + c` writable for `i < rows`, `c < n`, not
/// overlapping.
#[inline(always)]
pub(crate) unsafe fn copy_rows(dst: *mut f32, src: *const f32, ld: usize, rows: usize, n: usize) {
    for i in 0..rows {
        // SAFETY: within the rows the caller guarantees.
        unsafe { std::ptr::copy_nonoverlapping(src.add(i * ld), dst.add(i * n), n) };
    }
}

/// `dst[0..n] += src[0..n]`, vectorised.
///
/// # Safety
/// `S` is available; `dst` and `src` valid for `n` floats.
#[inline(always)]
pub(crate) unsafe fn add_row<S: Simd>(dst: *mut f32, src: *const f32, n: usize) {
    let l = S::LANES;
    // SAFETY: every access stays below `n` (the tail is masked).
    unsafe {
        let mut c = 0;
        while c + l <= n {
            S::store(dst.add(c), S::add(S::load(dst.add(c)), S::load(src.add(c))));
            c += l;
        }
        if c < n {
            let m = S::tail_mask(n - c);
            let x = S::add(S::load_m(dst.add(c), m), S::load_m(src.add(c), m));
            S::store_m(dst.add(c), x, m);
        }
    }
}

/// `dst[0..n] = src[0..n] * f`, vectorised.
///
/// # Safety
/// `S` is available; `dst` and `src` valid for `n` floats.
#[inline(always)]
pub(crate) unsafe fn scale_row<S: Simd>(dst: *mut f32, src: *const f32, n: usize, f: f32) {
    let l = S::LANES;
    // SAFETY: every access stays below `n` (the tail is masked).
    unsafe {
        let fv = S::splat(f);
        let mut c = 0;
        while c + l <= n {
            S::store(dst.add(c), S::mul(S::load(src.add(c)), fv));
            c += l;
        }
        if c < n {
            let m = S::tail_mask(n - c);
            S::store_m(dst.add(c), S::mul(S::load_m(src.add(c), m), fv), m);
        }
    }
}

/// `dst[0..n] = bf16(f * src[0..n])`, each product rounded once as
/// [`f32_to_bf16_bits`](crate::convert::f32_to_bf16_bits) rounds.
///
/// # Safety
/// `S` is available; `src` is valid for `n` floats and `dst` for `n` words.
#[inline(always)]
pub(crate) unsafe fn scale_row_bf16<S: Simd>(dst: *mut u16, src: *const f32, n: usize, f: f32) {
    let l = S::LANES;
    // SAFETY: every access stays below `n`.
    unsafe {
        let fv = S::splat(f);
        let mut c = 0;
        while c + l <= n {
            S::store_bf16(dst.add(c), S::mul(S::load(src.add(c)), fv));
            c += l;
        }
        for c in c..n {
            *dst.add(c) = crate::convert::f32_to_bf16_bits(*src.add(c) * f);
        }
    }
}

/// `dst[0..n] = 0`.
///
/// # Safety
/// `dst` valid for `n` floats.
#[inline(always)]
pub(crate) unsafe fn zero_row(dst: *mut f32, n: usize) {
    // SAFETY: caller guarantees `n` writable floats.
    unsafe { std::ptr::write_bytes(dst, 0, n) }
}

/// The dropout mask of one query block: per-row generator states and the kept multiplier.
pub(crate) struct BlockDropout {
    /// Row states; entries past the block's rows are 0 (their lanes are padding).
    states: [u64; MAX_BR],
    thresh: u64,
    mult: f32,
}

impl BlockDropout {
    /// States for rows `i0..i0+br` of flattened head `bh`.
    pub(crate) fn new(p: f64, key: DropoutKey, bh: usize, i0: usize, br: usize) -> Self {
        let mut states = [0u64; MAX_BR];
        for (i, s) in states.iter_mut().take(br).enumerate() {
            *s = key.row_state(bh as u64, (i0 + i) as u64);
        }
        BlockDropout { states, thresh: keep_threshold(p), mult: (1.0 / (1.0 - p)) as f32 }
    }

    /// Multipliers for key `j` and the query lanes `lane0..lane0+LANES` (padding lanes get
    /// arbitrary finite values).
    ///
    /// # Safety
    /// `S` is available; `lane0 + LANES <= MAX_BR`.
    #[inline(always)]
    pub(crate) unsafe fn vector<S: Simd>(&self, lane0: usize, j: usize) -> S::V {
        debug_assert!(lane0 + S::LANES <= MAX_BR);
        // SAFETY: `lane0 + LANES <= MAX_BR` states are readable (caller).
        unsafe {
            S::dropout(
                self.states.as_ptr().add(lane0),
                column_term(j as u64),
                self.thresh,
                self.mult,
            )
        }
    }
}

/// `Sᵀ[j][i] = Σ_c A[j][c] · Bt[c][i]` for one tile: `bc` key rows of `A` (`a`, row stride
/// `rs`, `k` floats each) against the packed `[k][brp]` query panel `bt`, into `st` (`[bc][brp]`).
///
/// With `causal = Some(i0 - j0)` (query block start minus key block start), key rows on or past
/// the diagonal are computed in 16-row bands that skip the query columns the whole band may not
/// see; the skipped entries are left unwritten and must be overwritten by [`super::mask::causal_fill`].
///
/// # Safety
/// `S` is available; `a` valid for `bc` rows of `k`, `bt` for `k*brp`, `st` for `bc*brp` floats.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn score_tile<S: Simd>(
    a: *const f32,
    rs: usize,
    k: usize,
    bt: *const f32,
    brp: usize,
    st: *mut f32,
    bc: usize,
    causal: Option<isize>,
) {
    const BAND: usize = 16;
    let l = S::LANES;
    let full = |r0: usize, r1: usize, c0: usize| GemmArgs {
        m: r1 - r0,
        n: brp - c0,
        k,
        // Rows r0..r1 <= bc and columns c0 < brp: inside the tile.
        a: a.wrapping_add(r0 * rs),
        rs_a: rs,
        cs_a: 1,
        b: bt.wrapping_add(c0),
        ldb: brp,
        c: st.wrapping_add(r0 * brp + c0),
        ldc: brp,
        accumulate: false,
        tri: Tri::Full,
    };
    // SAFETY: every sub-problem lies inside the tile (caller's guarantees).
    unsafe {
        match causal {
            None => S::gemm(&full(0, bc, 0)),
            Some(diag) => {
                // Rows before `first` (keys before the query block) see every query.
                let first = diag.clamp(0, bc as isize) as usize;
                if first > 0 {
                    S::gemm(&full(0, first, 0));
                }
                let mut r = first;
                while r < bc {
                    let r1 = (r + BAND).min(bc);
                    // Key `r` (local) is visible to queries `i >= r - diag` only.
                    let c0 = ((r as isize - diag).max(0) as usize / l) * l;
                    if c0 < brp {
                        S::gemm(&full(r, r1, c0));
                    }
                    r = r1;
                }
            }
        }
    }
}
