//! bfloat16 ↔ f32 conversion over bit patterns (`u16` for bf16), in parallel blocks.
//!
//! bf16 → f32 is exact (the 16 bits become the high half of the f32). f32 → bf16 rounds to
//! nearest, ties to even, like `half::bf16::from_f32` (and PyTorch); a NaN stays a (quiet) NaN
//! with its sign. Both are plain integer arithmetic on each element, on 16 lanes where the
//! SIMD level is AVX-512 (the baseline build vectorised the rounding poorly: a tenth of a bf16
//! encoder layer's inference), element by element elsewhere, with the same bits.
//!
//! ```
//! use multihead_kernels::convert::{bf16_to_f32, f32_to_bf16};
//!
//! let x = [1.0f32, -2.5, 1.0 + 1.0 / 256.0, f32::INFINITY];
//! let mut b = [0u16; 4];
//! f32_to_bf16(&x, &mut b)?;
//! let mut y = [0f32; 4];
//! bf16_to_f32(&b, &mut y)?;
//! assert_eq!(y, [1.0, -2.5, 1.0, f32::INFINITY]); // 1 + 2^-8 is a tie: rounds to even
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::attention::KernelError;

/// Elements per parallel block.
const BLOCK: usize = 1 << 16;

fn check(src: usize, dst: usize) -> Result<(), KernelError> {
    if dst < src {
        Err(KernelError::SliceTooShort { name: "dst", needed: src, len: dst })
    } else {
        Ok(())
    }
}

/// One bf16 bit pattern as an f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// One f32 rounded to the nearest bf16 (ties to even), as a bit pattern.
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        // Keep the sign and the top payload bits; force a quiet NaN.
        return ((bits >> 16) as u16) | 0x0040;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// `dst[i] = src[i]` widened to f32, for `i < src.len()`.
pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) -> Result<(), KernelError> {
    check(src.len(), dst.len())?;
    // SAFETY: `f32` and `MaybeUninit<f32>` share a layout, and only floats are written.
    let dst = unsafe { &mut *(dst as *mut [f32] as *mut [MaybeUninit<f32>]) };
    bf16_to_f32_uninit(src, dst)
}

/// [`bf16_to_f32`] into memory that need not be initialised: on `Ok`, `dst[..src.len()]` is.
pub fn bf16_to_f32_uninit(src: &[u16], dst: &mut [MaybeUninit<f32>]) -> Result<(), KernelError> {
    check(src.len(), dst.len())?;
    let avx512 = avx512();
    src.par_chunks(BLOCK).zip(dst.par_chunks_mut(BLOCK)).for_each(|(s, d)| {
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: AVX-512F is available (checked once above); `d` holds `s.len()` slots.
            return unsafe { widen_avx512(s, d) };
        }
        let _ = avx512;
        for (x, &b) in d.iter_mut().zip(s) {
            x.write(bf16_bits_to_f32(b));
        }
    });
    Ok(())
}

/// `dst[i] = src[i]` rounded to bf16 (ties to even), for `i < src.len()`.
pub fn f32_to_bf16(src: &[f32], dst: &mut [u16]) -> Result<(), KernelError> {
    check(src.len(), dst.len())?;
    // SAFETY: `u16` and `MaybeUninit<u16>` share a layout, and only bits are written.
    let dst = unsafe { &mut *(dst as *mut [u16] as *mut [MaybeUninit<u16>]) };
    f32_to_bf16_uninit(src, dst)
}

/// [`f32_to_bf16`] into memory that need not be initialised: on `Ok`, `dst[..src.len()]` is.
pub fn f32_to_bf16_uninit(src: &[f32], dst: &mut [MaybeUninit<u16>]) -> Result<(), KernelError> {
    check(src.len(), dst.len())?;
    let avx512 = avx512();
    src.par_chunks(BLOCK).zip(dst.par_chunks_mut(BLOCK)).for_each(|(s, d)| {
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: AVX-512F is available (checked once above); `d` holds `s.len()` slots.
            return unsafe { narrow_avx512(s, d) };
        }
        let _ = avx512;
        for (b, &x) in d.iter_mut().zip(s) {
            b.write(f32_to_bf16_bits(x));
        }
    });
    Ok(())
}

/// Whether the AVX-512 loops may run (the SIMD level allows it).
fn avx512() -> bool {
    crate::attention::simd_level() == crate::attention::SimdLevel::Avx512
}

/// The widening loop on 16 lanes (the tail element by element).
///
/// # Safety
/// AVX-512F is available; `d` holds at least `s.len()` slots.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_avx512(s: &[u16], d: &mut [MaybeUninit<f32>]) {
    use std::arch::x86_64::*;
    let full = s.len() / 16 * 16;
    // SAFETY: vectors `i..i + 16 <= full` lie in both slices.
    unsafe {
        for i in (0..full).step_by(16) {
            let h = _mm256_loadu_si256(s.as_ptr().add(i) as *const __m256i);
            let w = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h));
            _mm512_storeu_si512(d.as_mut_ptr().add(i) as *mut __m512i, w);
        }
    }
    for (x, &b) in d[full..].iter_mut().zip(&s[full..]) {
        x.write(bf16_bits_to_f32(b));
    }
}

/// 16 floats rounded to bf16 as [`f32_to_bf16_bits`] rounds them, each in the low half of its
/// 32-bit lane: `bits + 0x7FFF + ((bits >> 16) & 1)`, the top half; a NaN keeps its sign and
/// top payload bits, made quiet.
///
/// # Safety
/// AVX-512F is available.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn round16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    // SAFETY: register arithmetic only (the caller's AVX-512F).
    unsafe {
        let bits = _mm512_castps_si512(x);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let sum = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
        let rounded = _mm512_srli_epi32::<16>(sum);
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x0040));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        _mm512_mask_mov_epi32(rounded, nan, quiet)
    }
}

/// The rounding loop on 16 lanes (the tail element by element): [`f32_to_bf16_bits`]'s bits.
///
/// # Safety
/// AVX-512F is available; `d` holds at least `s.len()` slots.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn narrow_avx512(s: &[f32], d: &mut [MaybeUninit<u16>]) {
    use std::arch::x86_64::*;
    let full = s.len() / 16 * 16;
    // SAFETY: vectors `i..i + 16 <= full` lie in both slices.
    unsafe {
        for i in (0..full).step_by(16) {
            let w = round16(_mm512_loadu_ps(s.as_ptr().add(i)));
            _mm256_storeu_si256(d.as_mut_ptr().add(i) as *mut __m256i, _mm512_cvtepi32_epi16(w));
        }
    }
    for (b, &x) in d[full..].iter_mut().zip(&s[full..]) {
        b.write(f32_to_bf16_bits(x));
    }
}

/// The reference twin of [`f32_to_bf16`]: rounds through f64 by comparing the two bf16
/// neighbours of `x` (ties to the even one).
pub fn f32_to_bf16_reference(x: f32) -> u16 {
    if x.is_nan() {
        return ((x.to_bits() >> 16) as u16) | 0x0040;
    }
    let down = (x.to_bits() >> 16) as u16; // truncation: toward zero in magnitude
    if x.is_infinite() {
        return down;
    }
    let up = down.wrapping_add(1);
    let lo = bf16_bits_to_f32(down) as f64;
    // Past the largest finite bf16, the next step up is infinity, which IEEE rounding places
    // at 2^128 (where the exponent range would continue).
    let hi = match bf16_bits_to_f32(up) {
        h if h.is_infinite() => 2f64.powi(128).copysign(h as f64),
        h => h as f64,
    };
    let d_lo = (x as f64 - lo).abs();
    let d_hi = (hi - x as f64).abs();
    if d_lo < d_hi || (d_lo == d_hi && down & 1 == 0) {
        down
    } else {
        up
    }
}

/// `x`, or a zero of its sign where it is subnormal.
#[inline(always)]
pub(crate) fn flush_subnormal(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn rounding_matches_the_reference_on_awkward_values() {
        let mut xs = vec![
            0.0f32,
            -0.0,
            1.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            f32::MIN_POSITIVE / 3.0,
            1e-45,
            f32::INFINITY,
            f32::NEG_INFINITY,
            65504.0,
            3.389_531_4e38,              // rounds up to infinity
            f32::from_bits(0x7F80_0001), // signalling NaN: comes back quiet
            f32::from_bits(0xFFC0_1234),
            f32::from_bits(0x7FFF_FFFF),
            f32::from_bits(0x007F_FFFF), // the largest subnormal rounds up to a normal
        ];
        let mut s = 0x1234_5678u32;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            xs.push(f32::from_bits(s));
        }
        // Every SIMD level (16 lanes and a tail of 2 at AVX-512, element by element below).
        for level in crate::testutil::levels() {
            let mut got = vec![0u16; xs.len()];
            crate::attention::with_simd_level(level, || f32_to_bf16(&xs, &mut got)).unwrap();
            for (x, g) in xs.iter().zip(&got) {
                // NaNs too: the same sign and top payload bits, made quiet.
                let what = format!("{level:?} {x:e} ({:#x})", x.to_bits());
                assert_eq!(*g, f32_to_bf16_reference(*x), "{what}");
                assert_eq!(*g, f32_to_bf16_bits(*x), "{what}");
                if x.is_nan() {
                    assert!(bf16_bits_to_f32(*g).is_nan());
                }
            }
            let mut back = vec![0f32; xs.len()];
            crate::attention::with_simd_level(level, || bf16_to_f32(&got, &mut back)).unwrap();
            for (b, g) in back.iter().zip(&got) {
                assert_eq!(b.to_bits() >> 16, u32::from(*g), "{level:?}");
            }
            assert!(f32_to_bf16(&xs, &mut got[..3]).is_err());
        }
    }
}
