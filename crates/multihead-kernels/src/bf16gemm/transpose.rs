//! A 16 × 16 transpose of 32-bit words in sixteen AVX-512 registers: the packers' way of
//! turning sixteen runs along one axis into sixteen runs along the other without scatters.
//!
//! The transposing packers (`dyᵀ` into the AMX rows, `Wᵀ` into pair panels) used to scatter
//! each run of sixteen pair words to sixteen rows: one `vpscatterdd` per run, about a word per
//! cycle. Here four rounds of shuffles (64 instructions for 256 words) put the words in place
//! and each row leaves in one 64-byte store.

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
    // Round 1: pairs of rows interleaved by words, within each 128-bit lane L: t[2k] holds
    // columns 4L, 4L+1 of rows 2k, 2k+1; t[2k+1] columns 4L+2, 4L+3.
    let mut t = [_mm512_setzero_si512(); 16];
    for k in 0..8 {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    // Round 2: u[4m + c], lane L, holds column 4L + c of rows 4m..4m+4.
    let mut u = [_mm512_setzero_si512(); 16];
    for m in 0..4 {
        let (a, b, c, d) = (t[4 * m], t[4 * m + 1], t[4 * m + 2], t[4 * m + 3]);
        u[4 * m] = _mm512_unpacklo_epi64(a, c);
        u[4 * m + 1] = _mm512_unpackhi_epi64(a, c);
        u[4 * m + 2] = _mm512_unpacklo_epi64(b, d);
        u[4 * m + 3] = _mm512_unpackhi_epi64(b, d);
    }
    // Rounds 3 and 4: row 4L + c gathers lane L of u[c], u[4 + c], u[8 + c], u[12 + c].
    for c in 0..4 {
        let x0 = _mm512_shuffle_i32x4::<0x44>(u[c], u[4 + c]);
        let x1 = _mm512_shuffle_i32x4::<0xEE>(u[c], u[4 + c]);
        let y0 = _mm512_shuffle_i32x4::<0x44>(u[8 + c], u[12 + c]);
        let y1 = _mm512_shuffle_i32x4::<0xEE>(u[8 + c], u[12 + c]);
        r[c] = _mm512_shuffle_i32x4::<0x88>(x0, y0);
        r[4 + c] = _mm512_shuffle_i32x4::<0xDD>(x0, y0);
        r[8 + c] = _mm512_shuffle_i32x4::<0x88>(x1, y1);
        r[12 + c] = _mm512_shuffle_i32x4::<0xDD>(x1, y1);
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
