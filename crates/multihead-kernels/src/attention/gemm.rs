//! Register-tiled f32 GEMM: `C[m x n] (+)= A[m x k] · B[k x n]`.
//!
//! `A` is read through two strides (so the same kernel serves a row-major tile, a transposed
//! tile or a strided input matrix) and broadcast one element at a time; `B` is read as rows of
//! `n` contiguous floats with a row stride, so input rows (K, V, Q, dO) are used in place
//! without packing. The micro-kernel keeps an `MR x (NV·LANES)` block of `C` in registers
//! (6 x 64 on AVX-512: 24 accumulators, 24 independent FMA chains) and walks `k` once.
//! Each `C` element is accumulated in increasing `k` order, so results do not depend on how
//! work is split across threads.

use super::simd::Simd;

/// One GEMM problem. All pointers must be valid for the elements the problem touches:
/// `A[i, p] = a[i*rs_a + p*cs_a]`, `B[p, j] = b[p*ldb + j]`, `C[i, j] = c[i*ldc + j]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmArgs {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub rs_a: usize,
    pub cs_a: usize,
    pub b: *const f32,
    pub ldb: usize,
    pub c: *mut f32,
    pub ldc: usize,
    /// Accumulate into `C` (true) or overwrite it (false).
    pub accumulate: bool,
    /// Triangular structure of `A` (causal tiles): which `k` each row needs.
    pub tri: Tri,
}

/// Which part of the `k` range a row of `A` needs; the rest of the row is zero, so skipping
/// it changes nothing. The driver clips per micro-tile row block (rows share the union of
/// their ranges).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tri {
    /// Every row needs all of `0..k`.
    Full,
    /// Row `r` needs `k' <= r + e` only.
    KEnd(isize),
    /// Row `r` needs `k' >= r + s` only.
    KStart(isize),
}

/// The micro-kernel: `MR` rows by `NV` vectors of `C`; with `TAIL`, the last vector is
/// masked by `mask` (the `n % LANES` remainder).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro<S: Simd, const MR: usize, const NV: usize, const TAIL: bool>(
    k: usize,
    a: *const f32,
    rs_a: usize,
    cs_a: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    mask: S::M,
) {
    let l = S::LANES;
    // SAFETY: the caller (`gemm_generic`) guarantees every pointer formed here lies inside the
    // problem described by `GemmArgs`, whose validity the kernels establish; masked lanes
    // are not touched.
    unsafe {
        let mut acc = [[S::splat(0.0); NV]; MR];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    let p = c.add(r * ldc + v * l);
                    *x = if TAIL && v + 1 == NV { S::load_m(p, mask) } else { S::load(p) };
                }
            }
        }
        let mut ap = a;
        let mut bp = b;
        for _ in 0..k {
            let mut bv = [S::splat(0.0); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = if TAIL && v + 1 == NV {
                    S::load_m(bp.add(v * l), mask)
                } else {
                    S::load(bp.add(v * l))
                };
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = S::splat(*ap.add(r * rs_a));
                for (x, bx) in row.iter_mut().zip(bv.iter()) {
                    *x = S::fma(av, *bx, *x);
                }
            }
            ap = ap.add(cs_a);
            bp = bp.add(ldb);
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                let p = c.add(r * ldc + v * l);
                if TAIL && v + 1 == NV {
                    S::store_m(p, *x, mask)
                } else {
                    S::store(p, *x)
                }
            }
        }
    }
}

/// Dispatches a row count (1..=12) to the matching micro-kernel instantiation.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn micro_rows<S: Simd, const NV: usize, const TAIL: bool>(
    rows: usize,
    k: usize,
    a: *const f32,
    rs_a: usize,
    cs_a: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    acc: bool,
    mask: S::M,
) {
    macro_rules! go {
        ($($mr:literal)*) => {
            match rows {
                $($mr => micro::<S, $mr, NV, TAIL>(k, a, rs_a, cs_a, b, ldb, c, ldc, acc, mask),)*
                _ => unreachable!("micro-tile rows out of range"),
            }
        };
    }
    // SAFETY: forwarded from the caller.
    unsafe { go!(1 2 3 4 5 6 7 8 9 10 11 12) }
}

/// The blocked driver: column chunks of up to `NV_MAX` vectors, rows in `S::mr(nv)` blocks.
#[inline(always)]
pub(crate) unsafe fn gemm_generic<S: Simd>(g: &GemmArgs) {
    let l = S::LANES;
    if g.m == 0 || g.n == 0 {
        return;
    }
    let nvec = g.n.div_ceil(l);
    let tail = g.n % l;
    let mut v0 = 0;
    // SAFETY: every sub-problem lies inside `g`, which the caller guarantees valid.
    unsafe {
        while v0 < nvec {
            let nv = S::NV_MAX.min(nvec - v0);
            let is_tail = tail != 0 && v0 + nv == nvec;
            let mask = if is_tail { S::tail_mask(tail) } else { S::full_mask() };
            let mr = S::mr(nv).min(12);
            let col = v0 * l;
            let bcol = g.b.add(col);
            let mut r0 = 0;
            while r0 < g.m {
                let rows = mr.min(g.m - r0);
                // The k range this row block needs.
                let (k0, k1) = match g.tri {
                    Tri::Full => (0, g.k),
                    Tri::KEnd(e) => {
                        (0, (r0 as isize + rows as isize + e).clamp(0, g.k as isize) as usize)
                    }
                    Tri::KStart(s) => ((r0 as isize + s).clamp(0, g.k as isize) as usize, g.k),
                };
                if k1 <= k0 && g.accumulate {
                    r0 += rows;
                    continue;
                }
                let kk = k1.saturating_sub(k0);
                let a = g.a.add(r0 * g.rs_a + k0 * g.cs_a);
                let bcol = bcol.add(k0 * g.ldb);
                let c = g.c.add(r0 * g.ldc + col);
                macro_rules! call {
                    ($nv:literal) => {
                        if is_tail {
                            micro_rows::<S, $nv, true>(
                                rows,
                                kk,
                                a,
                                g.rs_a,
                                g.cs_a,
                                bcol,
                                g.ldb,
                                c,
                                g.ldc,
                                g.accumulate,
                                mask,
                            )
                        } else {
                            micro_rows::<S, $nv, false>(
                                rows,
                                kk,
                                a,
                                g.rs_a,
                                g.cs_a,
                                bcol,
                                g.ldb,
                                c,
                                g.ldc,
                                g.accumulate,
                                mask,
                            )
                        }
                    };
                }
                match nv {
                    1 => call!(1),
                    2 => call!(2),
                    3 => call!(3),
                    _ => call!(4),
                }
                r0 += rows;
            }
            v0 += nv;
        }
    }
}

/// The scalar GEMM (no target features needed).
#[inline(never)]
pub(crate) unsafe fn gemm_scalar(g: &GemmArgs) {
    // SAFETY: forwarded contract.
    unsafe { gemm_generic::<super::simd::Scalar>(g) }
}

/// The AVX2+FMA GEMM. Caller: the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline(never)]
pub(crate) unsafe fn gemm_avx2(g: &GemmArgs) {
    // SAFETY: forwarded contract; the features are enabled for this function.
    unsafe { gemm_generic::<super::simd::Avx2>(g) }
}

/// The AVX-512F GEMM. Caller: the CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
pub(crate) unsafe fn gemm_avx512(g: &GemmArgs) {
    // SAFETY: forwarded contract; the feature is enabled for this function.
    unsafe { gemm_generic::<super::simd::Avx512>(g) }
}
