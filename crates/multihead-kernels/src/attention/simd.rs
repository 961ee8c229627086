//! A small SIMD abstraction over f32 vectors: a scalar fallback, AVX2+FMA and AVX-512F.
//!
//! The attention kernels are written once, generic over [`Simd`], and instantiated inside
//! `#[target_feature]` wrappers (see [`super::exec`]). Every method here is `#[inline(always)]`
//! so that, once inlined into such a wrapper, the intrinsics are compiled with the wrapper's
//! features.

#[cfg(target_arch = "x86_64")]
use core::arch::x86_64::*;

/// Where tanh rounds to ±1 in f32: the soft cap clamps `v/c` to ±this.
const SOFTCAP_CLAMP: f32 = 7.905_311;

/// Vector operations on f32 lanes.
///
/// # Safety
///
/// Implementations for an instruction set may only be used (any method called) on a CPU that
/// supports that instruction set; the dispatcher in [`super::exec`] checks this at run time.
/// Pointer arguments must be valid for the lanes they touch (masked lanes are not touched).
pub(crate) unsafe trait Simd: Copy + Send + Sync + 'static {
    /// Lanes per vector.
    const LANES: usize;
    /// Most vectors per micro-tile row.
    const NV_MAX: usize;
    /// A vector of `LANES` f32.
    type V: Copy;
    /// A lane mask selecting the first lanes of a vector (tail handling).
    type M: Copy;

    /// Micro-tile rows for a tile `nv` vectors wide (keeps the accumulators in registers).
    fn mr(nv: usize) -> usize;

    /// All lanes `x`.
    unsafe fn splat(x: f32) -> Self::V;
    /// Unaligned load of `LANES` values.
    unsafe fn load(p: *const f32) -> Self::V;
    /// Unaligned store of `LANES` values.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// The mask of the first `n` lanes, `0 < n < LANES`.
    unsafe fn tail_mask(n: usize) -> Self::M;
    /// The mask of all lanes.
    unsafe fn full_mask() -> Self::M;
    /// Load of the masked lanes (others 0); unmasked lanes are not read.
    unsafe fn load_m(p: *const f32, m: Self::M) -> Self::V;
    /// `LANES` bfloat16 values (their bits) widened exactly to f32.
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    /// Store of the masked lanes only.
    unsafe fn store_m(p: *mut f32, v: Self::V, m: Self::M);
    /// Each lane rounded to the nearest bf16 value, as
    /// [`f32_to_bf16_bits`](crate::convert::f32_to_bf16_bits) rounds (ties to even, NaN
    /// quieted), and widened back exactly.
    #[inline(always)]
    unsafe fn round_bf16(x: Self::V) -> Self::V {
        use crate::convert::{bf16_bits_to_f32 as wide, f32_to_bf16_bits as bf};
        // SAFETY: forwarded (the trait's contract).
        unsafe { Self::map_lanes(x, |v| wide(bf(v))) }
    }
    /// `f` on each lane, through memory: the portable form of the lane-wise operations that
    /// the vector levels override.
    #[inline(always)]
    unsafe fn map_lanes(x: Self::V, f: impl Fn(f32) -> f32) -> Self::V {
        let mut a = [0f32; 16];
        // SAFETY: `a` holds 16 >= LANES floats.
        unsafe {
            Self::store(a.as_mut_ptr(), x);
            for v in a.iter_mut().take(Self::LANES) {
                *v = f(*v);
            }
            Self::load(a.as_ptr())
        }
    }
    /// `out[i] = bf16(lo[i]) | bf16(hi[i]) << 16` for the `LANES` lanes: pair words of two
    /// vectors rounded as [`f32_to_bf16_bits`](crate::convert::f32_to_bf16_bits) rounds (the
    /// `B` operand of the bf16 products, two key rows interleaved).
    #[inline(always)]
    unsafe fn store_bf16_pairs(out: *mut u32, lo: Self::V, hi: Self::V) {
        use crate::convert::f32_to_bf16_bits as bf;
        let (mut a, mut b) = ([0f32; 16], [0f32; 16]);
        // SAFETY: `a` and `b` hold 16 >= LANES floats; the caller guarantees `LANES` writable
        // words at `out`.
        unsafe {
            Self::store(a.as_mut_ptr(), lo);
            Self::store(b.as_mut_ptr(), hi);
            for i in 0..Self::LANES {
                *out.add(i) = u32::from(bf(a[i])) | (u32::from(bf(b[i])) << 16);
            }
        }
    }
    /// `out[i] = bf16(x[i])` for the `LANES` lanes, rounded as
    /// [`f32_to_bf16_bits`](crate::convert::f32_to_bf16_bits) rounds.
    #[inline(always)]
    unsafe fn store_bf16(out: *mut u16, x: Self::V) {
        use crate::convert::f32_to_bf16_bits as bf;
        let mut a = [0f32; 16];
        // SAFETY: `a` holds 16 >= LANES floats; the caller guarantees `LANES` writable words.
        unsafe {
            Self::store(a.as_mut_ptr(), x);
            for (i, &v) in a.iter().enumerate().take(Self::LANES) {
                *out.add(i) = bf(v);
            }
        }
    }
    /// [`store_bf16_pairs`](Self::store_bf16_pairs) in AVX512-BF16's instructions where the
    /// instruction set has them: the same words for every input but subnormals (which the
    /// instruction reads as zero; the softmax's probabilities never are).
    ///
    /// # Safety
    /// As for `store_bf16_pairs`; on AVX-512 the CPU has AVX512-BF16 and the caller is
    /// compiled for it ([`native_bf16_pairs`]).
    #[inline(always)]
    unsafe fn store_bf16_pairs_native(out: *mut u32, lo: Self::V, hi: Self::V) {
        // SAFETY: forwarded.
        unsafe { Self::store_bf16_pairs(out, lo, hi) }
    }
    /// `a + b`.
    unsafe fn add(a: Self::V, b: Self::V) -> Self::V;
    /// `a - b`.
    unsafe fn sub(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b`.
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c` (fused where the hardware has FMA).
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// x86 `maxps` semantics: `if a > b { a } else { b }` (so a NaN in `b` propagates).
    unsafe fn max(a: Self::V, b: Self::V) -> Self::V;
    /// x86 `minps` semantics: `if a < b { a } else { b }` (so a NaN in `b` propagates).
    unsafe fn min(a: Self::V, b: Self::V) -> Self::V;
    /// `|a|` (the sign bit cleared; NaN stays NaN).
    unsafe fn abs(a: Self::V) -> Self::V;
    /// `torch.maximum(a, b)`: the larger, NaN where either is NaN.
    unsafe fn max_nan(a: Self::V, b: Self::V) -> Self::V;
    /// `a * b + c` rounded once, at every level (the scalar level through `f32::mul_add`, a
    /// libm call where the CPU lacks FMA: for the few sums that must match a fused kernel).
    #[inline(always)]
    unsafe fn fma_fused(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        // SAFETY: forwarded; the vector levels' `fma` is fused.
        unsafe { Self::fma(a, b, c) }
    }
    /// `x` with subnormal lanes replaced by a zero of their sign (what the bf16 product
    /// instructions do to their inputs and results); other values, NaN included, unchanged.
    #[inline(always)]
    unsafe fn flush(x: Self::V) -> Self::V {
        // SAFETY: forwarded (the trait's contract).
        unsafe { Self::map_lanes(x, crate::convert::flush_subnormal) }
    }
    /// `a / b`.
    unsafe fn div(a: Self::V, b: Self::V) -> Self::V;
    /// `√a`, correctly rounded at every level (IEEE's square root).
    unsafe fn sqrt(a: Self::V) -> Self::V;
    /// `e^x`, relative error below 2e-7; `exp(-inf) = 0`, NaN propagates.
    unsafe fn exp(x: Self::V) -> Self::V;
    /// [`exp`](Self::exp)'s bits for every `x <= 110` (a softmax's `s - max`, a Gaussian's
    /// `-z²`) and NaN, without the clamps `exp` needs beyond that.
    #[inline(always)]
    unsafe fn exp_low(x: Self::V) -> Self::V {
        // SAFETY: forwarded.
        unsafe { Self::exp(x) }
    }
    /// `2^x` for `x <= 0` and NaN (NaN propagates), relative error below 3e-7 (a degree-5
    /// polynomial on the vector levels, `f32::exp2` on the scalar one), and 0 below 2⁻¹²⁶
    /// (`-inf` included):
    /// the bf16 products' softmax probabilities, which are rounded to bf16 for their product
    /// and summed in f32 (PyTorch's CPU flash kernel takes a 20-ulp exp there).
    unsafe fn exp2_low(x: Self::V) -> Self::V;
    /// `1/x` for positive normal `x`, within 2 ulp (a reciprocal estimate refined by a Newton
    /// step where the instruction set has one; a division otherwise); NaN propagates.
    #[inline(always)]
    unsafe fn recip(x: Self::V) -> Self::V {
        // SAFETY: vector arithmetic only.
        unsafe { Self::div(Self::splat(1.0), x) }
    }
    /// The soft cap `c·tanh(v/c)` (`inv` is `1/c`): Eigen's rational approximation of tanh (a
    /// degree-13 odd numerator over a degree-6 even denominator) on `v` clamped to
    /// `±7.905·c`, where tanh is within 2 ulp of ±1, with the cap folded into the clamp and
    /// the numerator, and exactly `±c` past the clamp; within a few ulp of `c·tanh(v/c)`
    /// (tested against f64); NaN propagates.
    #[inline(always)]
    unsafe fn softcap(v: Self::V, c: f32, inv: f32) -> Self::V {
        /// 2^-32 and 2^32: exact scalings.
        const DOWN: f32 = 1.0 / 4_294_967_296.0;
        const UP: f32 = 4_294_967_296.0;
        // SAFETY: vector arithmetic only (the trait's contract covers the instruction set).
        unsafe {
            if SOFTCAP_CLAMP * c <= f32::MAX {
                Self::softcap_folded(v, c, inv)
            } else {
                // A cap above 4.3e37, whose bound would overflow (and whose inverse may be
                // subnormal, flushed to 0 inside the kernels): the same function on `v` and
                // `c` scaled by 2^-32, scaled back (exact, but for `|v|` below 5e-29).
                let cs = c * DOWN;
                let r = Self::softcap_folded(Self::mul(v, Self::splat(DOWN)), cs, 1.0 / cs);
                Self::mul(r, Self::splat(UP))
            }
        }
    }
    /// [`Simd::softcap`] for a cap whose bound `SOFTCAP_CLAMP·c` is finite and whose `inv`
    /// is normal.
    #[inline(always)]
    unsafe fn softcap_folded(v: Self::V, c: f32, inv: f32) -> Self::V {
        const A: [f32; 7] = [
            4.893_524_6e-3,
            6.372_619_3e-4,
            1.485_722_4e-5,
            5.122_297e-8,
            -8.604_672e-11,
            2.000_188e-13,
            -2.760_768_5e-16,
        ];
        const B: [f32; 4] = [4.893_525e-3, 2.268_434_6e-3, 1.185_347_1e-4, 1.198_258_4e-6];
        // SAFETY: vector arithmetic only (the trait's contract covers the instruction set).
        unsafe {
            // max(-b, min(b, v)): `min` and `max` keep a NaN second operand, so NaN passes
            // through both.
            let bound = SOFTCAP_CLAMP * c;
            let vc = Self::max(Self::splat(-bound), Self::min(Self::splat(bound), v));
            let x = Self::mul(vc, Self::splat(inv));
            let x2 = Self::mul(x, x);
            let mut p = Self::splat(A[6]);
            for &a in A[..6].iter().rev() {
                p = Self::fma(p, x2, Self::splat(a));
            }
            let mut q = Self::splat(B[3]);
            for &b in B[..3].iter().rev() {
                q = Self::fma(q, x2, Self::splat(b));
            }
            // c·(x·p/q) = vc·p/q.
            let y = Self::mul(Self::mul(vc, p), Self::recip(q));
            // Past the bound, exactly ±c (as tanh in f32 from 8.7 on): the approximation
            // stops at c·(1 - 2 ulp) there, whose slope `1 - (y/c)²` would stay at 2.4e-7
            // however large the score, where the exact slope vanishes. `v - vc` is 0 inside
            // the bound and at least one step of the bound (4.8e-7·c) past it, which takes the
            // sum past ±c before the clamp; NaN stays NaN through both.
            let past = Self::add(y, Self::sub(v, vc));
            Self::max(Self::splat(-c), Self::min(Self::splat(c), past))
        }
    }
    /// The sum of the lanes (in a fixed order).
    unsafe fn reduce_add(v: Self::V) -> f32;
    /// `out[i] = Σ lanes of v[i]` for `i < LANES`: the horizontal sums of `LANES` vectors,
    /// stored as one vector (a transpose-and-add network on x86, in a fixed order).
    ///
    /// # Safety
    /// `v` holds `LANES` vectors and `out` has `LANES` writable floats.
    #[inline(always)]
    unsafe fn reduce_many(v: *const Self::V, out: *mut f32) {
        for i in 0..Self::LANES {
            // SAFETY: forwarded from the caller.
            unsafe { *out.add(i) = Self::reduce_add(*v.add(i)) };
        }
    }
    /// `C (+)= A B` over the whole [`GemmArgs`] problem (see [`super::gemm`]).
    unsafe fn gemm(g: &super::gemm::GemmArgs);

    /// Dropout multipliers of one key column for `LANES` query rows: lane `i` is `mult` if
    /// `mix(states[i] ^ col_term) >> 40 >= thresh` (kept) and `0` otherwise — exactly
    /// [`keep_from_row`](crate::dropout::keep_from_row) (see `dropout::keep_threshold`).
    #[inline(always)]
    unsafe fn dropout(states: *const u64, col_term: u64, thresh: u64, mult: f32) -> Self::V {
        let mut tmp = [0f32; 16];
        for (i, x) in tmp.iter_mut().take(Self::LANES).enumerate() {
            // SAFETY: the caller guarantees `LANES` readable states.
            let state = unsafe { *states.add(i) };
            if crate::dropout::mix(state ^ col_term) >> 40 >= thresh {
                *x = mult;
            }
        }
        // SAFETY: `tmp` holds 16 >= LANES floats.
        unsafe { Self::load(tmp.as_ptr()) }
    }

    /// `dst[c*ldd + r] (+)= f * src[r*ld + c]` for `r < rows`, `c < n` (a scaled transpose;
    /// accumulates when `acc`). Nothing outside that range is touched.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn transpose(
        dst: *mut f32,
        ldd: usize,
        src: *const f32,
        ld: usize,
        rows: usize,
        n: usize,
        f: f32,
        acc: bool,
    ) {
        for r in 0..rows {
            for c in 0..n {
                // SAFETY: the caller guarantees both index ranges are valid.
                unsafe {
                    let x = f * *src.add(r * ld + c);
                    let d = dst.add(c * ldd + r);
                    *d = if acc { *d + x } else { x };
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar

/// The portable fallback: one lane, plain f32 arithmetic.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Scalar;

// SAFETY: plain scalar code runs on every CPU.
unsafe impl Simd for Scalar {
    const LANES: usize = 1;
    const NV_MAX: usize = 4;
    type V = f32;
    type M = ();

    #[inline(always)]
    fn mr(_nv: usize) -> usize {
        4
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        // SAFETY: the caller guarantees `p` is valid for one read.
        unsafe { *p }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        // SAFETY: the caller guarantees `p` is valid for one write.
        unsafe { *p = v }
    }
    #[inline(always)]
    unsafe fn tail_mask(_n: usize) {}
    #[inline(always)]
    unsafe fn full_mask() {}
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> f32 {
        // SAFETY: one readable u16 (trait contract).
        f32::from_bits(u32::from(unsafe { *p }) << 16)
    }
    #[inline(always)]
    unsafe fn load_m(p: *const f32, _m: ()) -> f32 {
        // SAFETY: with one lane, a tail never occurs; a "full" mask load is a plain load.
        unsafe { *p }
    }
    #[inline(always)]
    unsafe fn store_m(p: *mut f32, v: f32, _m: ()) {
        // SAFETY: as for `load_m`.
        unsafe { *p = v }
    }
    #[inline(always)]
    unsafe fn add(a: f32, b: f32) -> f32 {
        a + b
    }
    #[inline(always)]
    unsafe fn sub(a: f32, b: f32) -> f32 {
        a - b
    }
    #[inline(always)]
    unsafe fn mul(a: f32, b: f32) -> f32 {
        a * b
    }
    #[inline(always)]
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        // Not `mul_add`: without hardware FMA that is a slow libm call.
        a * b + c
    }
    #[inline(always)]
    unsafe fn div(a: f32, b: f32) -> f32 {
        a / b
    }
    #[inline(always)]
    unsafe fn sqrt(a: f32) -> f32 {
        a.sqrt()
    }
    #[inline(always)]
    unsafe fn max(a: f32, b: f32) -> f32 {
        if a > b {
            a
        } else {
            b
        }
    }
    #[inline(always)]
    unsafe fn min(a: f32, b: f32) -> f32 {
        if a < b {
            a
        } else {
            b
        }
    }
    #[inline(always)]
    unsafe fn abs(a: f32) -> f32 {
        a.abs()
    }
    #[inline(always)]
    unsafe fn max_nan(a: f32, b: f32) -> f32 {
        // `a > b` is false where `b` is NaN, so `b` (NaN) is returned.
        if a.is_nan() || a > b {
            a
        } else {
            b
        }
    }
    #[inline(always)]
    unsafe fn fma_fused(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn flush(x: f32) -> f32 {
        crate::convert::flush_subnormal(x)
    }
    #[inline(always)]
    unsafe fn exp(x: f32) -> f32 {
        x.exp()
    }
    #[inline(always)]
    unsafe fn exp2_low(x: f32) -> f32 {
        // NaN compares false and propagates through `exp2`.
        if x < -126.0 {
            0.0
        } else {
            x.exp2()
        }
    }
    #[inline(always)]
    unsafe fn reduce_add(v: f32) -> f32 {
        v
    }
    #[inline(always)]
    unsafe fn gemm(g: &super::gemm::GemmArgs) {
        // SAFETY: forwarded contract.
        unsafe { super::gemm::gemm_scalar(g) }
    }
}

// ---------------------------------------------------------------------------------------------
// Shared exp constants (Cephes expf: Cody-Waite reduction and a degree-5 polynomial for
// (e^r - 1 - r) / r^2 on |r| <= ln2/2; about 1 ulp).

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4; // 0.693359375, exact in few bits
const LN2_LO: f32 = -2.121_944_4e-4;
const P0: f32 = 1.987_569_1e-4;
const P1: f32 = 1.398_199_9e-3;
const P2: f32 = 8.333_452e-3;
const P3: f32 = 4.166_579_6e-2;
const P4: f32 = 1.666_666_5e-1;
const P5: f32 = 0.5;
/// `2^f ≈ 1 + f·(E2_1 + f·(E2_2 + f·(E2_3 + f·(E2_4 + f·E2_5))))` on `[-1/2, 1/2]`, fitted
/// for relative error (iteratively reweighted least squares on Chebyshev nodes).
// 0.693147 (three ulp below ln 2: the fit's, not the constant's).
const E2_1: f32 = f32::from_bits(0x3f31_7215);
const E2_2: f32 = 0.240_222_42;
const E2_3: f32 = 0.055_507_336;
const E2_4: f32 = 0.009_671_513;
const E2_5: f32 = 0.001_326_472_7;

/// `(n, 2^f)` for `x = n + f`, the vector levels' `exp2_low` before its scaling by `2^n`:
/// `n = round(x)` by the 1.5·2²³ shifter (ties to even, exact for `|x| < 2²²`), `f = x - n` in
/// `[-1/2, 1/2]` (exact), and the degree-5 polynomial for `2^f` (1.9e-7 at most in f32).
///
/// # Safety
/// `S` is available.
#[inline(always)]
unsafe fn exp2_split<S: Simd>(x: S::V) -> (S::V, S::V) {
    // SAFETY: register arithmetic only (the caller's instruction set).
    unsafe {
        let magic = S::splat(12_582_912.0);
        let n = S::sub(S::add(x, magic), magic);
        let f = S::sub(x, n);
        let mut p = S::splat(E2_5);
        for c in [E2_4, E2_3, E2_2, E2_1, 1.0] {
            p = S::fma(p, f, S::splat(c));
        }
        (n, p)
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA

/// AVX2 with FMA: 8 lanes, 16 registers.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
static AVX2_TAIL: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];

// SAFETY: only used behind `is_x86_feature_detected!("avx2") && ..("fma")` (see `exec`).
#[cfg(target_arch = "x86_64")]
unsafe impl Simd for Avx2 {
    const LANES: usize = 8;
    const NV_MAX: usize = 2;
    type V = __m256;
    type M = __m256i;

    #[inline(always)]
    fn mr(nv: usize) -> usize {
        if nv >= 2 {
            6
        } else {
            8
        }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m256 {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable floats at `p`.
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: the caller guarantees 8 writable floats at `p`.
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn tail_mask(n: usize) -> __m256i {
        debug_assert!(n < 8);
        // SAFETY: `8 - n` is in 1..=8, so 8 ints from there lie inside the 16-int table.
        unsafe { _mm256_loadu_si256(AVX2_TAIL.as_ptr().add(8 - n) as *const __m256i) }
    }
    #[inline(always)]
    unsafe fn full_mask() -> __m256i {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_set1_epi32(-1) }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        // SAFETY: AVX2 is available and 8 u16 are readable (trait contract); the bits move to
        // the high half of each f32 lane, which is exactly the bf16 value.
        unsafe {
            let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
        }
    }
    #[inline(always)]
    unsafe fn load_m(p: *const f32, m: __m256i) -> __m256 {
        // SAFETY: `vmaskmovps` does not touch masked-off lanes; the caller guarantees the
        // selected lanes are readable.
        unsafe { _mm256_maskload_ps(p, m) }
    }
    #[inline(always)]
    unsafe fn store_m(p: *mut f32, v: __m256, m: __m256i) {
        // SAFETY: as for `load_m`, for writes.
        unsafe { _mm256_maskstore_ps(p, m, v) }
    }
    #[inline(always)]
    unsafe fn add(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
        // SAFETY: FMA is available (trait contract).
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn div(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sqrt(a: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_sqrt_ps(a) }
    }
    #[inline(always)]
    unsafe fn recip(x: __m256) -> __m256 {
        // SAFETY: AVX and FMA are available (trait contract).
        unsafe {
            // A 12-bit estimate, then two Newton steps r·(2 − x·r) (each doubles the bits).
            let mut r = _mm256_rcp_ps(x);
            for _ in 0..2 {
                let e = _mm256_fnmadd_ps(x, r, _mm256_set1_ps(2.0));
                r = _mm256_mul_ps(r, e);
            }
            r
        }
    }
    #[inline(always)]
    unsafe fn max(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn abs(a: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract).
        unsafe { _mm256_andnot_ps(_mm256_set1_ps(-0.0), a) }
    }
    #[inline(always)]
    unsafe fn max_nan(a: __m256, b: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract). `maxps` returns `b` where either is
        // NaN; the lanes where `a` is NaN take `a`.
        unsafe { _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps::<_CMP_UNORD_Q>(a, a)) }
    }
    #[inline(always)]
    unsafe fn flush(x: __m256) -> __m256 {
        // SAFETY: AVX is available (trait contract). Lanes below the smallest normal in
        // magnitude (zeros too, unchanged by it; NaN compares false) keep their sign only.
        unsafe {
            let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(Self::abs(x), _mm256_set1_ps(f32::MIN_POSITIVE));
            _mm256_blendv_ps(x, _mm256_and_ps(x, _mm256_set1_ps(-0.0)), tiny)
        }
    }
    #[inline(always)]
    unsafe fn exp2_low(x: __m256) -> __m256 {
        // SAFETY: AVX2 and FMA are available (trait contract); no memory is touched.
        unsafe {
            // 2^n built in the exponent field (n + 127 in [1, 127] for x in [-126, 0]; a NaN n
            // converts to i32::MIN, whose field reads 1.0, and the NaN polynomial carries on).
            let (n, p) = exp2_split::<Self>(x);
            let ni = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
            let y = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(ni)));
            // Below -126 (and -inf): 0; NaN compares false and is kept.
            let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-126.0));
            _mm256_andnot_ps(tiny, y)
        }
    }
    #[inline(always)]
    unsafe fn exp(x: __m256) -> __m256 {
        // SAFETY: AVX2 and FMA are available (trait contract); no memory is touched.
        unsafe {
            // Clamp into the normal range; max/min take the NaN from their second operand.
            let xc = _mm256_min_ps(_mm256_set1_ps(88.72), _mm256_max_ps(_mm256_set1_ps(-87.33), x));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)),
            );
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
            let mut p = _mm256_set1_ps(P0);
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P1));
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P2));
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P3));
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P4));
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(P5));
            let r2 = _mm256_mul_ps(r, r);
            let e = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
            // 2^n for n in [-126, 128]: n = 128 only for x >= 88.72, patched to inf below.
            let ni = _mm256_cvtps_epi32(n);
            let pow = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                ni,
                _mm256_set1_epi32(127),
            )));
            let y = _mm256_mul_ps(e, pow);
            // Below the normal range: 0 (this also maps -inf to exactly 0).
            let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.33));
            let y = _mm256_andnot_ps(tiny, y);
            let huge = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(88.72));
            _mm256_blendv_ps(y, _mm256_set1_ps(f32::INFINITY), huge)
        }
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m256) -> f32 {
        // SAFETY: AVX is available (trait contract); register-only operations.
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s));
            _mm_cvtss_f32(s)
        }
    }
    #[inline(always)]
    unsafe fn reduce_many(v: *const __m256, out: *mut f32) {
        // Plain inline functions, not closures: closures would not inherit the caller's
        // target features, and their intrinsics would not inline.
        #[inline(always)]
        unsafe fn pair(a: __m256, b: __m256) -> __m256 {
            // SAFETY: AVX is available (trait contract).
            unsafe { _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)) }
        }
        #[inline(always)]
        unsafe fn quad(a: __m256, b: __m256) -> __m256 {
            // SAFETY: AVX is available (trait contract).
            unsafe {
                _mm256_add_ps(_mm256_shuffle_ps::<0x44>(a, b), _mm256_shuffle_ps::<0xEE>(a, b))
            }
        }
        // SAFETY: AVX is available (trait contract); `v` has 8 vectors and `out` 8 floats
        // (caller). Pairs, then quads, within 128-bit lanes; then the two lanes.
        unsafe {
            let u0 = quad(pair(*v, *v.add(1)), pair(*v.add(2), *v.add(3)));
            let u1 = quad(pair(*v.add(4), *v.add(5)), pair(*v.add(6), *v.add(7)));
            let w = _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(u0, u1),
                _mm256_permute2f128_ps::<0x31>(u0, u1),
            );
            _mm256_storeu_ps(out, w);
        }
    }
    #[inline(always)]
    unsafe fn gemm(g: &super::gemm::GemmArgs) {
        // SAFETY: forwarded contract (AVX2+FMA present).
        unsafe { super::gemm::gemm_avx2(g) }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX-512F

/// AVX-512F (+DQ for the vectorised dropout generator): 16 lanes, 32 registers.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512;

// SAFETY: only used behind `is_x86_feature_detected!` for avx512f and avx512dq (see `exec`).
#[cfg(target_arch = "x86_64")]
unsafe impl Simd for Avx512 {
    const LANES: usize = 16;
    const NV_MAX: usize = 4;
    type V = __m512;
    type M = __mmask16;

    #[inline(always)]
    fn mr(nv: usize) -> usize {
        match nv {
            4 => 6,
            3 => 8,
            _ => 12,
        }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_set1_ps(x) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: the caller guarantees 16 readable floats at `p`.
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: the caller guarantees 16 writable floats at `p`.
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn tail_mask(n: usize) -> __mmask16 {
        debug_assert!(n < 16);
        ((1u32 << n) - 1) as __mmask16
    }
    #[inline(always)]
    unsafe fn full_mask() -> __mmask16 {
        0xffff
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> __m512 {
        // SAFETY: AVX-512F is available and 16 u16 are readable (trait contract); the bits
        // move to the high half of each f32 lane, which is exactly the bf16 value.
        unsafe {
            let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
        }
    }
    #[inline(always)]
    unsafe fn round_bf16(x: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract); the rounded bits back in the high
        // half are the bf16 value exactly.
        unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(crate::convert::round16(x))) }
    }
    #[inline(always)]
    unsafe fn store_bf16_pairs(out: *mut u32, lo: __m512, hi: __m512) {
        // SAFETY: AVX-512F is available and 16 words are writable (trait contract); `round16`
        // leaves the high half of each lane zero, so the shifted high rounding fills it.
        unsafe {
            let (lo, hi) = (crate::convert::round16(lo), crate::convert::round16(hi));
            let w = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
            _mm512_storeu_si512(out as *mut __m512i, w);
        }
    }
    #[inline(always)]
    unsafe fn store_bf16(out: *mut u16, x: __m512) {
        // SAFETY: AVX-512F is available and 16 words are writable (trait contract).
        unsafe {
            let w = _mm512_cvtepi32_epi16(crate::convert::round16(x));
            _mm256_storeu_si256(out as *mut __m256i, w);
        }
    }
    #[inline(always)]
    unsafe fn store_bf16_pairs_native(out: *mut u32, lo: __m512, hi: __m512) {
        // SAFETY: the caller is compiled for AVX512-BF16 and BW on a CPU that has them (trait
        // contract); 16 words are writable.
        unsafe { store_pairs_avx512bf16(out, lo, hi) }
    }
    #[inline(always)]
    unsafe fn load_m(p: *const f32, m: __mmask16) -> __m512 {
        // SAFETY: masked-off lanes are not accessed (no fault); the caller guarantees the
        // selected lanes are readable.
        unsafe { _mm512_maskz_loadu_ps(m, p) }
    }
    #[inline(always)]
    unsafe fn store_m(p: *mut f32, v: __m512, m: __mmask16) {
        // SAFETY: as for `load_m`, for writes.
        unsafe { _mm512_mask_storeu_ps(p, m, v) }
    }
    #[inline(always)]
    unsafe fn add(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_add_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sub(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_sub_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn mul(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn div(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_div_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn sqrt(a: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_sqrt_ps(a) }
    }
    #[inline(always)]
    unsafe fn recip(x: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe {
            // A 14-bit estimate, then one Newton step r·(2 − x·r) (28 bits).
            let r = _mm512_rcp14_ps(x);
            _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.0)))
        }
    }
    #[inline(always)]
    unsafe fn max(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_max_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn min(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_min_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn abs(a: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_abs_ps(a) }
    }
    #[inline(always)]
    unsafe fn max_nan(a: __m512, b: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract). `maxps` returns `b` where either
        // is NaN; the lanes where `a` is NaN take `a`.
        unsafe {
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, a);
            _mm512_mask_blend_ps(nan, _mm512_max_ps(a, b), a)
        }
    }
    #[inline(always)]
    unsafe fn flush(x: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract). As the AVX2 form: lanes below the
        // smallest normal in magnitude keep their sign bit only.
        unsafe {
            let min = _mm512_set1_ps(f32::MIN_POSITIVE);
            let tiny = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(Self::abs(x), min);
            let sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(i32::MIN));
            _mm512_mask_mov_ps(x, tiny, _mm512_castsi512_ps(sign))
        }
    }
    #[inline(always)]
    unsafe fn exp(x: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract); no memory is touched.
        unsafe {
            // Clamp (NaN kept: max/min return their second operand when unordered). At -110
            // the scaled result rounds to exactly 0, at +110 to +inf.
            let xc = _mm512_min_ps(_mm512_set1_ps(110.0), _mm512_max_ps(_mm512_set1_ps(-110.0), x));
            exp_reduced(xc, x)
        }
    }
    /// [`exp2_split`]'s polynomial (1.9e-7 at most in f32, against 1.2e-7 for `exp`'s degree
    /// 7) scaled by `2^n` with `vscalefps`; 0 where `x` is below -126 (no subnormal results,
    /// `-inf` included), NaN where it is NaN. Four instructions fewer than `exp` (its `ln 2`
    /// split and `vrndscaleps`).
    #[inline(always)]
    unsafe fn exp2_low(x: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (trait contract); no memory is touched.
        unsafe {
            let (n, p) = exp2_split::<Self>(x);
            // NaN compares "not less than" and is kept.
            let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(-126.0));
            _mm512_maskz_scalef_ps(keep, p, n)
        }
    }
    #[inline(always)]
    unsafe fn exp_low(x: __m512) -> __m512 {
        // `exp` without its clamp: from -110 to 110 the clamp leaves `x` as it is, below
        // -87.33 the zero mask decides alone, and NaN propagates either way.
        // SAFETY: AVX-512F is available (trait contract); no memory is touched.
        unsafe { exp_reduced(x, x) }
    }
    #[inline(always)]
    unsafe fn reduce_add(v: __m512) -> f32 {
        // SAFETY: AVX-512F is available (trait contract).
        unsafe { _mm512_reduce_add_ps(v) }
    }
    #[inline(always)]
    unsafe fn reduce_many(v: *const __m512, out: *mut f32) {
        // Plain inline functions, not closures (see the AVX2 version).
        #[inline(always)]
        unsafe fn pair(a: __m512, b: __m512) -> __m512 {
            // SAFETY: AVX-512F is available (trait contract).
            unsafe { _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)) }
        }
        #[inline(always)]
        unsafe fn quad(a: __m512, b: __m512) -> __m512 {
            // SAFETY: AVX-512F is available (trait contract).
            unsafe {
                _mm512_add_ps(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xEE>(a, b))
            }
        }
        #[inline(always)]
        unsafe fn lanes(a: __m512, b: __m512) -> __m512 {
            // SAFETY: AVX-512F is available (trait contract).
            unsafe {
                _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0x88>(a, b),
                    _mm512_shuffle_f32x4::<0xDD>(a, b),
                )
            }
        }
        // SAFETY: AVX-512F is available (trait contract); `v` has 16 vectors and `out` 16
        // floats (caller). Pairs, then quads, within 128-bit lanes; then across the lanes.
        unsafe {
            let mut u = [_mm512_setzero_ps(); 4];
            for (i, x) in u.iter_mut().enumerate() {
                let a = pair(*v.add(4 * i), *v.add(4 * i + 1));
                let b = pair(*v.add(4 * i + 2), *v.add(4 * i + 3));
                *x = quad(a, b);
            }
            let (v0, v1) = (lanes(u[0], u[1]), lanes(u[2], u[3]));
            _mm512_storeu_ps(out, lanes(v0, v1));
        }
    }
    #[inline(always)]
    unsafe fn gemm(g: &super::gemm::GemmArgs) {
        // SAFETY: forwarded contract (AVX-512F present).
        unsafe { super::gemm::gemm_avx512(g) }
    }
    #[inline(always)]
    unsafe fn dropout(states: *const u64, col_term: u64, thresh: u64, mult: f32) -> __m512 {
        // SAFETY: AVX-512F and AVX-512DQ are available (trait contract: the AVX-512 level
        // requires both); the caller guarantees 16 readable states.
        unsafe {
            #[inline(always)]
            unsafe fn half(z: __m512i, ct: __m512i, t: __m512i) -> __mmask8 {
                // SAFETY: as in the enclosing function (SplitMix64's finaliser, lane-wise).
                unsafe {
                    let mut z = _mm512_xor_si512(z, ct);
                    z = _mm512_xor_si512(z, _mm512_srli_epi64::<30>(z));
                    z = _mm512_mullo_epi64(z, _mm512_set1_epi64(0xBF58_476D_1CE4_E5B9u64 as i64));
                    z = _mm512_xor_si512(z, _mm512_srli_epi64::<27>(z));
                    z = _mm512_mullo_epi64(z, _mm512_set1_epi64(0x94D0_49BB_1331_11EBu64 as i64));
                    z = _mm512_xor_si512(z, _mm512_srli_epi64::<31>(z));
                    _mm512_cmpge_epu64_mask(_mm512_srli_epi64::<40>(z), t)
                }
            }
            let ct = _mm512_set1_epi64(col_term as i64);
            let t = _mm512_set1_epi64(thresh as i64);
            let lo = half(_mm512_loadu_si512(states as *const __m512i), ct, t);
            let hi = half(_mm512_loadu_si512(states.add(8) as *const __m512i), ct, t);
            let k = (lo as u16) | ((hi as u16) << 8);
            _mm512_maskz_mov_ps(k, _mm512_set1_ps(mult))
        }
    }
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn transpose(
        dst: *mut f32,
        ldd: usize,
        src: *const f32,
        ld: usize,
        rows: usize,
        n: usize,
        f: f32,
        acc: bool,
    ) {
        // SAFETY: AVX-512F is available (trait contract); loads and stores are masked to
        // `r < rows`, `c < n`, which the caller guarantees valid.
        unsafe {
            let fv = _mm512_set1_ps(f);
            let mut rb = 0;
            while rb < rows {
                let nr = (rows - rb).min(16);
                let rmask: __mmask16 = if nr == 16 { 0xffff } else { ((1u32 << nr) - 1) as u16 };
                let mut cb = 0;
                while cb < n {
                    let nc = (n - cb).min(16);
                    let cmask: __mmask16 =
                        if nc == 16 { 0xffff } else { ((1u32 << nc) - 1) as u16 };
                    // Fixed-size, fully unrolled loops keep the 16 rows in registers.
                    let mut x = [_mm512_setzero_ps(); 16];
                    if nr == 16 && nc == 16 {
                        for (r, xr) in x.iter_mut().enumerate() {
                            *xr = _mm512_loadu_ps(src.add((rb + r) * ld + cb));
                        }
                        let y = transpose16(x);
                        for (c, yc) in y.iter().enumerate() {
                            let p = dst.add((cb + c) * ldd + rb);
                            let mut v = _mm512_mul_ps(*yc, fv);
                            if acc {
                                v = _mm512_add_ps(v, _mm512_loadu_ps(p));
                            }
                            _mm512_storeu_ps(p, v);
                        }
                        cb += 16;
                        continue;
                    }
                    // Edge blocks: rows past `nr` load nothing (mask 0) from a valid row.
                    for (r, xr) in x.iter_mut().enumerate() {
                        let m = if r < nr { cmask } else { 0 };
                        *xr = _mm512_maskz_loadu_ps(m, src.add((rb + r.min(nr - 1)) * ld + cb));
                    }
                    let y = transpose16(x);
                    for (c, yc) in y.iter().enumerate() {
                        if c < nc {
                            let p = dst.add((cb + c) * ldd + rb);
                            let mut v = _mm512_mul_ps(*yc, fv);
                            if acc {
                                v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(rmask, p));
                            }
                            _mm512_mask_storeu_ps(p, rmask, v);
                        }
                    }
                    cb += 16;
                }
                rb += 16;
            }
        }
    }
}

/// `e^xc` by range reduction and a degree-5 polynomial, scaled by `2^n` with `vscalefps`;
/// zero where `x` (the argument before any clamp) is below the normal range (no subnormal
/// results), NaN where it is NaN.
///
/// # Safety
/// AVX-512F is available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn exp_reduced(xc: __m512, x: __m512) -> __m512 {
    // SAFETY: register arithmetic only (the caller's AVX-512F).
    unsafe {
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(P0);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P1));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P2));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P4));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P5));
        let r2 = _mm512_mul_ps(r, r);
        let e = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0));
        // Flush results below the normal range to 0 (no denormal P values downstream);
        // NaN compares "not less than" and is kept.
        let keep = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(-87.33));
        _mm512_maskz_scalef_ps(keep, e, n)
    }
}

/// Tests turn the native pair words off to compare them with the portable ones (the same
/// bits, so other tests running meanwhile see no difference).
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) static PORTABLE_PAIRS: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether this CPU runs the AVX-512 kernels and has AVX512-BF16, so the softmax's bf16 pair
/// words can be rounded by `vcvtne2ps2bf16` (detected once).
#[cfg(target_arch = "x86_64")]
pub(crate) fn native_bf16_pairs() -> bool {
    #[cfg(test)]
    if PORTABLE_PAIRS.load(std::sync::atomic::Ordering::Relaxed) {
        return false;
    }
    static NATIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NATIVE.get_or_init(|| {
        super::exec::detected_simd_level() == super::exec::SimdLevel::Avx512
            && is_x86_feature_detected!("avx512bf16")
    })
}

/// `out[i] = bf16(lo[i]) | bf16(hi[i]) << 16` for 16 lanes: `vcvtne2ps2bf16` rounds both
/// vectors (ties to even, NaN quieted, subnormal inputs read as zero) into 32 words, low
/// vector first, and `vpermw` interleaves them.
///
/// # Safety
/// The CPU has AVX512-BF16 and AVX512-BW; 16 words are writable at `out`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn store_pairs_avx512bf16(out: *mut u32, lo: __m512, hi: __m512) {
    // Word 2i takes word i (lo's lane i), word 2i + 1 word 16 + i (hi's).
    const IDX: [i16; 32] = {
        let mut idx = [0i16; 32];
        let mut i = 0;
        while i < 16 {
            idx[2 * i] = i as i16;
            idx[2 * i + 1] = 16 + i as i16;
            i += 1;
        }
        idx
    };
    // SAFETY: the caller's CPU features; `IDX` is 64 readable bytes; 16 words at `out`.
    unsafe {
        let words = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
        let idx = _mm512_loadu_si512(IDX.as_ptr() as *const __m512i);
        _mm512_storeu_si512(out as *mut __m512i, _mm512_permutexvar_epi16(idx, words));
    }
}

/// Transposes a 16 x 16 block held as 16 row vectors: `out[c]` lane `r` is `rows[r]` lane `c`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // SAFETY: AVX-512F is available (caller); register-only shuffles.
    unsafe {
        // Stage 1: interleave rows pairwise (32-bit, within 128-bit lanes).
        let mut t = [_mm512_setzero_ps(); 16];
        for p in 0..8 {
            t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
            t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
        }
        // Stage 2: 64-bit interleave. u[4g + m] lane k = column 4k + m of rows 4g..4g+4.
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let (a0, a1) = (_mm512_castps_pd(t[4 * g]), _mm512_castps_pd(t[4 * g + 2]));
            let (b0, b1) = (_mm512_castps_pd(t[4 * g + 1]), _mm512_castps_pd(t[4 * g + 3]));
            u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a1));
            u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a1));
            u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b0, b1));
            u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b0, b1));
        }
        // Stages 3-4: gather the 128-bit lanes. Column 4k + m = lane k of u[m], u[4+m],
        // u[8+m], u[12+m].
        let mut out = [_mm512_setzero_ps(); 16];
        for m in 0..4 {
            let v0 = _mm512_shuffle_f32x4::<0x88>(u[m], u[4 + m]);
            let v1 = _mm512_shuffle_f32x4::<0x88>(u[8 + m], u[12 + m]);
            let v2 = _mm512_shuffle_f32x4::<0xDD>(u[m], u[4 + m]);
            let v3 = _mm512_shuffle_f32x4::<0xDD>(u[8 + m], u[12 + m]);
            out[m] = _mm512_shuffle_f32x4::<0x88>(v0, v1);
            out[8 + m] = _mm512_shuffle_f32x4::<0xDD>(v0, v1);
            out[4 + m] = _mm512_shuffle_f32x4::<0x88>(v2, v3);
            out[12 + m] = _mm512_shuffle_f32x4::<0xDD>(v2, v3);
        }
        out
    }
}
