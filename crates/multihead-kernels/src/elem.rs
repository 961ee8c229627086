//! The element types a kernel may read its large operands in (a KV cache, a weight): f32, or
//! bfloat16 as its bits (`u16`), widened exactly to f32 in registers. Arithmetic is f32 either
//! way, so a bf16 operand gives the bits of the f32 kernel run on its widened copy, while
//! reading half the bytes.

use crate::attention::simd::Simd;

/// An element read as f32.
///
/// # Safety
///
/// Implementations read exactly the elements their methods describe.
pub(crate) unsafe trait Elem: Copy + Send + Sync + 'static {
    /// `LANES` values at `p`, as f32.
    ///
    /// # Safety
    /// `S`'s instruction set is available and `LANES` elements at `p` are readable.
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;

    /// The first `n` (`1..=LANES`) values at `p`, zeros in the other lanes; `mask` is
    /// `S::tail_mask(n)` (or the full mask when `n == LANES`).
    ///
    /// # Safety
    /// `S`'s instruction set is available and `n` elements at `p` are readable.
    unsafe fn load_n<S: Simd>(p: *const Self, n: usize, mask: S::M) -> S::V;
}

// SAFETY: `S::load`/`S::load_m` read `LANES` / the masked lanes only.
unsafe impl Elem for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        // SAFETY: forwarded from the caller.
        unsafe { S::load(p) }
    }
    #[inline(always)]
    unsafe fn load_n<S: Simd>(p: *const f32, _n: usize, mask: S::M) -> S::V {
        // SAFETY: forwarded from the caller; masked lanes are not read.
        unsafe { S::load_m(p, mask) }
    }
}

// SAFETY: `S::load_bf16` reads `LANES` u16; the tail copies `n` of them into a local buffer.
unsafe impl Elem for u16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const u16) -> S::V {
        // SAFETY: forwarded from the caller.
        unsafe { S::load_bf16(p) }
    }
    #[inline(always)]
    unsafe fn load_n<S: Simd>(p: *const u16, n: usize, _mask: S::M) -> S::V {
        if n >= S::LANES {
            // SAFETY: forwarded from the caller.
            return unsafe { S::load_bf16(p) };
        }
        let mut tmp = [0u16; 16];
        // SAFETY: `n < LANES <= 16` elements are readable at `p` (caller) and fit `tmp`.
        unsafe {
            std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n);
            S::load_bf16(tmp.as_ptr())
        }
    }
}

/// The `LANES` partial sums of `Σ_j a[j]·b[j]` over `n` values (masked at the tail), with `b`
/// read as `E`: one fused multiply-add chain per lane, in increasing `j`.
///
/// # Safety
/// `n` readable floats at `a` and elements at `b`, and the instruction set available.
#[inline(always)]
pub(crate) unsafe fn dot<S: Simd, E: Elem>(a: *const f32, b: *const E, n: usize) -> S::V {
    let l = S::LANES;
    // SAFETY: forwarded from the caller; masked loads stay inside `n` values.
    unsafe {
        let mut acc = S::splat(0.0);
        let mut j = 0;
        while j < n {
            let m = (n - j).min(l);
            let mask = if m == l { S::full_mask() } else { S::tail_mask(m) };
            acc = S::fma(S::load_m(a.add(j), mask), E::load_n::<S>(b.add(j), m, mask), acc);
            j += l;
        }
        acc
    }
}

/// [`dot`] of `a` with `R` rows of `b` (`stride` elements apart) at once: each row's partial
/// sums are [`dot`]'s, in the same order, but the rows' loads interleave, so a weight
/// streamed from memory has `R` lines in flight where one row had one.
///
/// # Safety
/// As [`dot`], for each of the rows `b + r·stride`, `r < R`.
#[inline(always)]
pub(crate) unsafe fn dot_rows<S: Simd, E: Elem, const R: usize>(
    a: *const f32,
    b: *const E,
    stride: usize,
    n: usize,
) -> [S::V; R] {
    let l = S::LANES;
    // SAFETY: forwarded from the caller; masked loads stay inside `n` values of each row.
    unsafe {
        let mut acc = [S::splat(0.0); R];
        let mut j = 0;
        while j < n {
            let m = (n - j).min(l);
            let mask = if m == l { S::full_mask() } else { S::tail_mask(m) };
            for r in 0..R {
                // `wrapping_add`: the address may lie past the row's end (never read).
                prefetch(b.wrapping_add(r * stride + j + PREFETCH_AHEAD));
            }
            let x = S::load_m(a.add(j), mask);
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = S::fma(x, E::load_n::<S>(b.add(r * stride + j), m, mask), *acc);
            }
            j += l;
        }
        acc
    }
}

/// Elements ahead of the loads that [`dot_rows`] asks the caches for (2 KiB of f32: the
/// distance made no difference from 128 to 512 elements when measured).
const PREFETCH_AHEAD: usize = 512;

/// A hint to fetch the line holding `p` into the caches; never faults, whatever `p` is.
#[inline(always)]
fn prefetch<E>(p: *const E) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it reads nothing architecturally and never faults, even
    // for an address outside any allocation.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::attention::simd::Scalar;
    use crate::attention::{detected_simd_level, SimdLevel};
    use crate::testutil::rand_vec;

    /// Each row's lanes from [`dot_rows`] and from [`dot`], as bits, for f32 and bf16 rows.
    ///
    /// # Safety
    /// `S`'s instruction set is available.
    unsafe fn both<S: Simd>(x: &[f32], w: &[f32], bits: &[u16], n: usize) -> [Vec<u32>; 2] {
        let lanes = |v: S::V| {
            let mut out = [0f32; 16];
            // SAFETY: `out` has room for `LANES <= 16` floats.
            unsafe { S::store(out.as_mut_ptr(), v) };
            out[..S::LANES].iter().map(|f| f.to_bits()).collect::<Vec<u32>>()
        };
        let (mut rows, mut ones) = (Vec::new(), Vec::new());
        // SAFETY: four rows of `n` values at `w` and `bits`, `n` at `x` (the caller's sizes).
        unsafe {
            for v in dot_rows::<S, f32, 4>(x.as_ptr(), w.as_ptr(), n, n) {
                rows.extend(lanes(v));
            }
            for v in dot_rows::<S, u16, 4>(x.as_ptr(), bits.as_ptr(), n, n) {
                rows.extend(lanes(v));
            }
            for r in 0..4 {
                ones.extend(lanes(dot::<S, f32>(x.as_ptr(), w.as_ptr().add(r * n), n)));
            }
            for r in 0..4 {
                ones.extend(lanes(dot::<S, u16>(x.as_ptr(), bits.as_ptr().add(r * n), n)));
            }
        }
        [rows, ones]
    }

    /// Four rows read at once give each row's bits of the one-row product, at every SIMD
    /// level, with tails, NaN, infinities and signed zeros (fails if a row's order changes).
    #[test]
    fn four_rows_at_once_give_each_rows_bits_of_one_row() {
        for n in [1, 7, 15, 16, 17, 33, 64, 515] {
            let x = rand_vec(n, 1);
            let mut w = rand_vec(4 * n, 2);
            w[0] = f32::NAN;
            w[n + n / 2] = f32::INFINITY;
            w[2 * n] = -0.0;
            let bits: Vec<u16> = w.iter().map(|&v| crate::convert::f32_to_bf16_bits(v)).collect();
            // SAFETY: scalar code runs anywhere.
            let [rows, ones] = unsafe { both::<Scalar>(&x, &w, &bits, n) };
            assert_eq!(rows, ones, "scalar n {n}");
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512dq")]
                unsafe fn wide(x: &[f32], w: &[f32], b: &[u16], n: usize) -> [Vec<u32>; 2] {
                    // SAFETY: AVX-512 enabled (the caller checked the CPU).
                    unsafe { both::<crate::attention::simd::Avx512>(x, w, b, n) }
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn narrow(x: &[f32], w: &[f32], b: &[u16], n: usize) -> [Vec<u32>; 2] {
                    // SAFETY: AVX2 enabled (the caller checked the CPU).
                    unsafe { both::<crate::attention::simd::Avx2>(x, w, b, n) }
                }
                if detected_simd_level() >= SimdLevel::Avx512 {
                    // SAFETY: checked above.
                    let [rows, ones] = unsafe { wide(&x, &w, &bits, n) };
                    assert_eq!(rows, ones, "avx512 n {n}");
                }
                if detected_simd_level() >= SimdLevel::Avx2 {
                    // SAFETY: checked above.
                    let [rows, ones] = unsafe { narrow(&x, &w, &bits, n) };
                    assert_eq!(rows, ones, "avx2 n {n}");
                }
            }
        }
    }
}
