//! `Simd::exp2_low`, the bf16 products' softmax exponential: accurate to 3e-7 at every SIMD
//! level over `[-126, 0]`, 0 below it and at `-inf`, NaN kept.

use super::super::simd::{Scalar, Simd};
use crate::attention::SimdLevel;
use crate::testutil::levels;

/// `exp2_low` of `xs` at level `S`.
fn run<S: Simd>(xs: &[f32]) -> Vec<f32> {
    let mut x = xs.to_vec();
    x.resize(xs.len().div_ceil(16) * 16, 0.0);
    let mut out = vec![0.0; x.len()];
    for (i, chunk) in x.chunks(S::LANES).enumerate() {
        // SAFETY: only called at a level the CPU runs; each chunk holds `LANES` floats and so
        // does `out` from `i · LANES`.
        unsafe {
            let y = S::exp2_low(S::load(chunk.as_ptr()));
            S::store(out.as_mut_ptr().add(i * S::LANES), y);
        }
    }
    out.truncate(xs.len());
    out
}

fn at_level(level: SimdLevel, xs: &[f32]) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run512(xs: &[f32]) -> Vec<f32> {
        run::<super::super::simd::Avx512>(xs)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run256(xs: &[f32]) -> Vec<f32> {
        run::<super::super::simd::Avx2>(xs)
    }
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `levels()` yields only the levels this CPU runs.
        SimdLevel::Avx512 => unsafe { run512(xs) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { run256(xs) },
        _ => run::<Scalar>(xs),
    }
}

#[test]
fn exp2_low_is_accurate_and_flushes_below_the_normal_range() {
    // A dense sweep of [-126, 0], the half-integers where the rounding of `x` ties, and the
    // ends of the reduced range.
    let mut xs: Vec<f32> = (0..=400_000).map(|i| -126.0 * i as f32 / 400_000.0).collect();
    xs.extend((0..252).map(|i| -0.5 * i as f32));
    xs.extend([-0.0, -1e-30, -1e-8, -0.499_999_97, -0.500_000_06, -125.999_99, -126.0]);
    for level in levels() {
        let ys = at_level(level, &xs);
        let mut worst = 0f64;
        for (&x, &y) in xs.iter().zip(&ys) {
            let e = (x as f64).exp2();
            worst = worst.max(((y as f64 - e) / e).abs());
            assert!(y.is_normal(), "{level:?}: 2^{x} gave {y}");
        }
        assert!(worst < 3e-7, "{level:?}: max relative error {worst:e}");
        // Below the normal range, -inf, NaN; and `2^0` is 1 exactly.
        let specials = [-126.01f32, -130.0, -1e30, f32::NEG_INFINITY, f32::NAN, 0.0, -0.0];
        let ys = at_level(level, &specials);
        assert_eq!(&ys[..4], &[0.0; 4], "{level:?}: {ys:?}");
        assert!(ys[4].is_nan(), "{level:?}: NaN gave {}", ys[4]);
        assert_eq!(&ys[5..], &[1.0, 1.0], "{level:?}");
    }
}
