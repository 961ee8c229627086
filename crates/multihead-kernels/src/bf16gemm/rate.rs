//! Whether this CPU has `vdpbf16ps`, and how fast it is against f32 FMA.

use std::sync::OnceLock;
use std::time::Instant;

/// Whether the CPU has AVX-512F, AVX-512BW and AVX512-BF16 (the instruction [`super::matmul_bf16`]'s
/// fast kernel needs).
pub fn bf16_dot_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Multiply-adds per second of `vdpbf16ps` over those of f32 FMA on 512-bit vectors, measured
/// once on one core (about 2 ms); `None` without AVX512-BF16.
///
/// Above 1, a bf16 product on [`super::matmul_bf16`] beats widening to f32: about 2 on AMD
/// Zen 4 and Zen 5, where each instruction does twice the multiply-adds of an FMA at the same
/// rate; below 1 on Intel Xeons that run it at a fraction of the FMA rate.
pub fn bf16_dot_speedup() -> Option<f64> {
    static RATE: OnceLock<Option<f64>> = OnceLock::new();
    *RATE.get_or_init(|| {
        if !bf16_dot_available() {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let time = |f: &dyn Fn() -> f32| {
                let t = Instant::now();
                std::hint::black_box(f());
                t.elapsed().as_secs_f64()
            };
            // Best of five, the two loops alternating, so that a clock still ramping up (or a
            // neighbour's load) weighs on both alike.
            let (mut fma, mut dot) = (f64::INFINITY, f64::INFINITY);
            for _ in 0..5 {
                // SAFETY: both need AVX-512F, and the dot one AVX512-BF16: checked above.
                fma = fma.min(time(&|| unsafe { fma_loop(ITERS) }));
                // SAFETY: as above.
                dot = dot.min(time(&|| unsafe { dot_loop(ITERS) }));
            }
            // A dot instruction does two multiply-adds per lane, an FMA one.
            Some(2.0 * fma / dot.max(1e-9))
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    })
}

/// Iterations of the timing loops (each 12 independent instructions: about 0.2 ms at 3 GHz).
const ITERS: usize = 50_000;

/// `iters × 12` FMAs in 12 independent chains; returns a lane of the sum (so nothing is
/// optimised away).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let x = _mm512_set1_ps(std::hint::black_box(0.999));
    let y = _mm512_set1_ps(std::hint::black_box(1e-3));
    let mut acc = [_mm512_setzero_ps(); 12];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, x, y);
        }
    }
    let s = acc.iter().fold(_mm512_setzero_ps(), |s, a| _mm512_add_ps(s, *a));
    _mm512_reduce_add_ps(s)
}

/// `iters × 12` `vdpbf16ps` in 12 independent chains.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn dot_loop(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let x = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(std::hint::black_box(1e-3)));
    let mut acc = [_mm512_setzero_ps(); 12];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_dpbf16_ps(*a, x, x);
        }
    }
    let s = acc.iter().fold(_mm512_setzero_ps(), |s, a| _mm512_add_ps(s, *a));
    _mm512_reduce_add_ps(s)
}
