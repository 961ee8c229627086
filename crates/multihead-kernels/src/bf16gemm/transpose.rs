//! A 16 × 16 transpose of 32-bit words in sixteen AVX-512 registers: the packers' way of
//! turning sixteen runs along one axis into sixteen runs along the other without scatters.
//!
//! The transposing packers (`dyᵀ` into the AMX rows, `Wᵀ` into pair panels) used to scatter
//! each run of sixteen pair words to sixteen rows: one `vpscatterdd` per run, about a word per
//! cycle. The attention's transpose of 16 × 16 floats (four rounds of shuffles, 64 instructions
//! for 256 words) puts the words in place instead, and each row leaves in one 64-byte store.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Transposes `r` in place: afterwards lane `j` of `r[i]` holds what lane `i` of `r[j]` held.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose16(r: &mut [__m512i; 16]) {
    // The shuffles move 32-bit lanes whatever they hold; the casts only retype. (Plain loops:
    // closures would not inherit this function's target features, and their intrinsics would
    // be calls through memory.)
    let mut floats = [_mm512_setzero_ps(); 16];
    for (f, x) in floats.iter_mut().zip(r.iter()) {
        *f = _mm512_castsi512_ps(*x);
    }
    // SAFETY: AVX-512F is available (the caller's guarantee).
    let t = unsafe { crate::attention::simd::transpose16(floats) };
    for (x, f) in r.iter_mut().zip(t) {
        *x = _mm512_castps_si512(f);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn transpose16_moves_every_word() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("transpose16_moves_every_word: no AVX-512F on this CPU; nothing to run");
            return;
        }
        let words: Vec<u32> = (0..256u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        // SAFETY: AVX-512F is present (checked above); every load and store covers 16 words of
        // a 256-word buffer.
        let got = unsafe {
            let mut r = [_mm512_setzero_si512(); 16];
            for (i, x) in r.iter_mut().enumerate() {
                *x = _mm512_loadu_si512(words.as_ptr().add(16 * i) as *const __m512i);
            }
            transpose16(&mut r);
            let mut out = vec![0u32; 256];
            for (i, x) in r.iter().enumerate() {
                _mm512_storeu_si512(out.as_mut_ptr().add(16 * i) as *mut __m512i, *x);
            }
            out
        };
        for i in 0..16 {
            for j in 0..16 {
                assert_eq!(got[16 * i + j], words[16 * j + i], "row {i}, lane {j}");
            }
        }
    }
}
