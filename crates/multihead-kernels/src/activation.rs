//! GELU (the erf form, `torch.nn.functional.gelu`) and ReLU over f32 slices: forward and
//! backward, with the run-time AVX-512 / AVX2 / scalar dispatch of
//! [`attention`](crate::attention), rayon over blocks, and an f64 reference twin
//! ([`reference`](mod@reference)).
//!
//! `gelu(x) = x·Φ(x)` with `Φ(x) = (1 + erf(x/√2))/2`, and `gelu'(x) = Φ(x) + x·φ(x)` with
//! `φ(x) = exp(−x²/2)/√(2π)`. `erf` is the Abramowitz–Stegun 7.1.26 rational approximation
//! (absolute error below 1.5·10⁻⁷), the one PyTorch's vectorised CPU GELU uses.
//!
//! ```
//! use multihead_kernels::activation::gelu_forward;
//! let x = [-1.0f32, 0.0, 2.0];
//! let mut y = [0.0f32; 3];
//! gelu_forward(&x, &mut y)?;
//! assert!((y[2] - 1.9545).abs() < 1e-4);
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

use crate::attention::exec::{par_run, ConstPtr, SyncPtr, Task};
use crate::attention::simd::Simd;
use crate::attention::{simd_level, KernelError};

/// Elements per task.
const BLOCK: usize = 1 << 14;

const A1: f32 = 0.254_829_6;
const A2: f32 = -0.284_496_74;
const A3: f32 = 1.421_413_8;
const A4: f32 = -1.453_152_1;
const A5: f32 = 1.061_405_4;
const P: f32 = 0.327_591_1;
const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`.
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `(Φ(x), φ(x))` for one vector.
///
/// # Safety
/// `S` is available.
#[inline(always)]
pub(crate) unsafe fn cdf_pdf<S: Simd>(x: S::V) -> (S::V, S::V) {
    // SAFETY: arithmetic only (the trait contract covers the instruction set).
    unsafe {
        let z = S::mul(x, S::splat(FRAC_1_SQRT_2));
        let az = S::abs(z);
        // A refined reciprocal estimate, not a division: the division was the slowest
        // instruction of the pass on Intel cores. Its argument must be a finite normal number:
        // `|z|` is capped at 1e4 (beyond it `exp(−z²)` is 0 and `t` no longer matters; a NaN
        // is kept: `min` returns its second operand when unordered).
        let capped = S::min(S::splat(1e4), az);
        let t = S::recip(S::fma(S::splat(P), capped, S::splat(1.0)));
        let mut poly = S::splat(A5);
        for a in [A4, A3, A2, A1] {
            poly = S::fma(poly, t, S::splat(a));
        }
        let e = S::exp_low(S::sub(S::splat(0.0), S::mul(z, z))); // exp(−x²/2)
        let erf_abs = S::sub(S::splat(1.0), S::mul(S::mul(poly, t), e));
        // sign(z) = clamp(z·10³⁰, −1, 1): ±1 but for tiny z (whose erf is ≈ 0 anyway), also at
        // ±inf (a NaN z gives 1: `min` returns its second operand when unordered).
        let sign = S::min(S::max(S::mul(z, S::splat(1e30)), S::splat(-1.0)), S::splat(1.0));
        let cdf = S::mul(S::splat(0.5), S::fma(sign, erf_abs, S::splat(1.0)));
        (cdf, S::mul(e, S::splat(INV_SQRT_2PI)))
    }
}

struct GeluTask<'a> {
    /// The input (it may be `out` itself: each element is read before it is written).
    x: ConstPtr<f32>,
    len: usize,
    /// The upstream gradient for the backward; `None` for the forward.
    dy: Option<&'a [f32]>,
    out: SyncPtr<f32>,
}

impl Task for GeluTask<'_> {
    fn count(&self) -> usize {
        self.len.div_ceil(BLOCK)
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        0
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, _buf: &mut [f32]) {
        let l = S::LANES;
        let (start, end) = (t * BLOCK, ((t + 1) * BLOCK).min(self.len));
        let mut j = start;
        // SAFETY: indices stay in `start..end` (the tail is masked), inside `x`, `dy` and
        // `out` (the entry point checked their lengths); this task alone writes its block.
        unsafe {
            while j < end {
                let mask = if j + l <= end { S::full_mask() } else { S::tail_mask(end - j) };
                let x = S::load_m(self.x.0.add(j), mask);
                let (cdf, pdf) = cdf_pdf::<S>(x);
                let v = match self.dy {
                    None => S::mul(x, cdf),
                    Some(dy) => {
                        let g = S::fma(x, pdf, cdf);
                        S::mul(S::load_m(dy.as_ptr().add(j), mask), g)
                    }
                };
                S::store_m(self.out.0.add(j), v, mask);
                j += l;
            }
        }
    }
}

fn same_len(name: &'static str, want: usize, len: usize) -> Result<(), KernelError> {
    if len < want {
        Err(KernelError::SliceTooShort { name, needed: want, len })
    } else {
        Ok(())
    }
}

/// `y = gelu(x)`.
// Mirrors torch.nn.functional.gelu(x, approximate='none').
pub fn gelu_forward(x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    same_len("y", x.len(), y.len())?;
    let (len, x) = (x.len(), ConstPtr(x.as_ptr()));
    par_run(simd_level(), &GeluTask { x, len, dy: None, out: SyncPtr(y.as_mut_ptr()) });
    Ok(())
}

/// [`gelu_forward`] into memory that need not be initialised: on `Ok`, every element of `y`
/// has been written.
pub fn gelu_forward_uninit(
    x: &[f32],
    y: &mut [std::mem::MaybeUninit<f32>],
) -> Result<(), KernelError> {
    same_len("y", x.len(), y.len())?;
    let (len, x, out) = (x.len(), ConstPtr(x.as_ptr()), SyncPtr(y.as_mut_ptr().cast::<f32>()));
    // Every element of `0..len` is written once (whole blocks, the tail masked).
    par_run(simd_level(), &GeluTask { x, len, dy: None, out });
    Ok(())
}

/// `dx = dy · gelu'(x)`.
// Mirrors the backward of torch.nn.functional.gelu(x, approximate='none').
pub fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
    same_len("dx", x.len(), dx.len())?;
    gelu_backward_to(x, dy, SyncPtr(dx.as_mut_ptr()))
}

/// [`gelu_backward`] into memory that need not be initialised: on `Ok`, every element of
/// `dx[..x.len()]` has been written (so a buffer can be filled without being zeroed first).
pub fn gelu_backward_uninit(
    x: &[f32],
    dy: &[f32],
    dx: &mut [std::mem::MaybeUninit<f32>],
) -> Result<(), KernelError> {
    same_len("dx", x.len(), dx.len())?;
    gelu_backward_to(x, dy, SyncPtr(dx.as_mut_ptr().cast::<f32>()))
}

/// `out[..x.len()] = dy · gelu'(x)`; `out` holds at least `x.len()` writable floats.
fn gelu_backward_to(x: &[f32], dy: &[f32], out: SyncPtr<f32>) -> Result<(), KernelError> {
    same_len("dy", x.len(), dy.len())?;
    let (len, x) = (x.len(), ConstPtr(x.as_ptr()));
    // Every element of `0..len` is written once (whole blocks, the tail masked).
    par_run(simd_level(), &GeluTask { x, len, dy: Some(dy), out });
    Ok(())
}

/// ReLU over a block: `out = max(x, 0)` (NaN kept), or, with `dy`, the gradient through
/// the output `x = relu(pre)`: `dy` where `x > 0` or `x` is NaN, exactly 0 elsewhere (PyTorch's
/// `threshold_backward`, which selects instead of multiplying, so an infinite or NaN `dy`
/// at a masked element still gives 0). `x` and `out` may be the same buffer.
struct ReluTask {
    x: ConstPtr<f32>,
    len: usize,
    dy: Option<ConstPtr<f32>>,
    out: SyncPtr<f32>,
}

impl Task for ReluTask {
    fn count(&self) -> usize {
        self.len.div_ceil(BLOCK)
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        0
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, _buf: &mut [f32]) {
        let (start, end) = (t * BLOCK, ((t + 1) * BLOCK).min(self.len));
        // Plain loops: inlined into the dispatcher's `#[target_feature]` wrapper, they are
        // vectorised at its level.
        // SAFETY: `start..end` is inside `x`, `dy` and `out` (lengths checked by the entry
        // points); this task alone writes its block, and reads each element before writing it.
        unsafe {
            match self.dy {
                None => {
                    for j in start..end {
                        let v = *self.x.0.add(j);
                        // NaN is kept, and -0 gives +0.
                        *self.out.0.add(j) = if v <= 0.0 { 0.0 } else { v };
                    }
                }
                Some(dy) => {
                    for j in start..end {
                        let masked = *self.x.0.add(j) <= 0.0; // false for NaN
                        *self.out.0.add(j) = if masked { 0.0 } else { *dy.0.add(j) };
                    }
                }
            }
        }
    }
}

/// `y = relu(x)` (`max(x, 0)`; NaN stays NaN, `-inf` and `-0` give `+0`).
// Mirrors torch.nn.functional.relu.
pub fn relu_forward(x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    same_len("y", x.len(), y.len())?;
    let x = ConstPtr(x.as_ptr());
    par_run(simd_level(), &ReluTask { x, len: y.len(), dy: None, out: SyncPtr(y.as_mut_ptr()) });
    Ok(())
}

/// [`relu_forward`] into memory that need not be initialised: on `Ok`, every element of `y`
/// has been written.
pub fn relu_forward_uninit(
    x: &[f32],
    y: &mut [std::mem::MaybeUninit<f32>],
) -> Result<(), KernelError> {
    same_len("y", x.len(), y.len())?;
    let (x, out) = (ConstPtr(x.as_ptr()), SyncPtr(y.as_mut_ptr().cast::<f32>()));
    // Every element of `0..len` is written once (whole blocks, the tail masked).
    par_run(simd_level(), &ReluTask { x, len: y.len(), dy: None, out });
    Ok(())
}

/// `dx = dy` where `y = relu(x)` is positive or NaN, 0 elsewhere (PyTorch's
/// `threshold_backward(dy, y, 0)`).
pub fn relu_backward(y: &[f32], dy: &[f32], dx: &mut [f32]) -> Result<(), KernelError> {
    same_len("dy", y.len(), dy.len())?;
    same_len("dx", y.len(), dx.len())?;
    let (x, dy) = (ConstPtr(y.as_ptr()), ConstPtr(dy.as_ptr()));
    par_run(
        simd_level(),
        &ReluTask { x, len: y.len(), dy: Some(dy), out: SyncPtr(dx.as_mut_ptr()) },
    );
    Ok(())
}

/// [`relu_backward`] into memory that need not be initialised: on `Ok`, every element of `dx`
/// has been written.
pub fn relu_backward_uninit(
    y: &[f32],
    dy: &[f32],
    dx: &mut [std::mem::MaybeUninit<f32>],
) -> Result<(), KernelError> {
    same_len("dy", y.len(), dy.len())?;
    same_len("dx", y.len(), dx.len())?;
    let (x, dy) = (ConstPtr(y.as_ptr()), ConstPtr(dy.as_ptr()));
    let out = SyncPtr(dx.as_mut_ptr().cast::<f32>());
    // Every element of `0..len` is written once (whole blocks, the tail masked).
    par_run(simd_level(), &ReluTask { x, len: y.len(), dy: Some(dy), out });
    Ok(())
}

/// Naive f64 twins, for tests, with an erf accurate to f64 rounding.
pub mod reference {
    /// `erf(x)`: its Taylor series below 3, the continued fraction of `erfc` above.
    pub fn erf(x: f64) -> f64 {
        let a = x.abs();
        let v = if a < 3.0 {
            let (mut term, mut sum, mut n) = (a, a, 0.0);
            while term.abs() > 1e-17 * sum.abs() {
                n += 1.0;
                term *= -a * a / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc(a) = exp(−a²)/√π · 1/(a + 1/2/(a + 1/(a + 3/2/(a + ...)))), from the tail.
            let mut f = a;
            for k in (1..60).rev() {
                f = a + (k as f64 / 2.0) / f;
            }
            1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / f
        };
        v.copysign(x)
    }

    /// `gelu(x)`.
    pub fn gelu(x: f64) -> f64 {
        0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
    }

    /// `relu(x)`: NaN stays NaN; `-0` gives `+0`.
    pub fn relu(x: f64) -> f64 {
        if x <= 0.0 {
            0.0
        } else {
            x
        }
    }

    /// The gradient through `y = relu(x)` given the output: `dy` unless `y <= 0`.
    pub fn relu_grad(y: f64, dy: f64) -> f64 {
        if y <= 0.0 {
            0.0
        } else {
            dy
        }
    }

    /// `gelu'(x)`.
    pub fn gelu_grad(x: f64) -> f64 {
        let cdf = 0.5 * (1.0 + erf(x / std::f64::consts::SQRT_2));
        cdf + x * (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::attention::with_simd_level;

    #[test]
    fn reference_erf_is_accurate() {
        // erf(0.5), erf(1), erf(2), erf(3.5) to 15 digits.
        for (x, want) in [
            (0.5, 0.520_499_877_813_047),
            (1.0, 0.842_700_792_949_715),
            (2.0, 0.995_322_265_018_953),
            (3.5, 0.999_999_256_901_628),
        ] {
            assert!((reference::erf(x) - want).abs() < 1e-13, "erf({x})");
            assert!((reference::erf(-x) + want).abs() < 1e-13, "erf(-{x})");
        }
    }

    #[test]
    fn gelu_matches_the_reference_at_every_simd_level_and_awkward_lengths() {
        let levels = crate::testutil::levels();
        for n in [0usize, 1, 7, 16, 17, 1000, BLOCK + 3] {
            let x: Vec<f32> = crate::testutil::rand_vec(n, 11).iter().map(|v| v * 9.0).collect();
            let dy = crate::testutil::rand_vec(n, 12);
            for &level in &levels {
                with_simd_level(level, || {
                    let (mut y, mut dx) = (vec![0f32; n], vec![0f32; n]);
                    gelu_forward(&x, &mut y).unwrap();
                    gelu_backward(&x, &dy, &mut dx).unwrap();
                    // Into a buffer that held NaN: the same bits.
                    let mut dxu = vec![std::mem::MaybeUninit::new(f32::NAN); n];
                    gelu_backward_uninit(&x, &dy, &mut dxu).unwrap();
                    for (u, d) in dxu.iter().zip(&dx) {
                        // SAFETY: initialised to NaN, then written.
                        assert_eq!(unsafe { u.assume_init() }.to_bits(), d.to_bits());
                    }
                    for i in 0..n {
                        let (xi, e) = (x[i] as f64, reference::gelu(x[i] as f64));
                        assert!(
                            (y[i] as f64 - e).abs() <= 2e-7 * (1.0 + xi.abs()),
                            "{level:?} y({xi}) {} vs {e}",
                            y[i]
                        );
                        let g = dy[i] as f64 * reference::gelu_grad(xi);
                        assert!(
                            (dx[i] as f64 - g).abs() <= 1e-6,
                            "{level:?} dx({xi}) {} vs {g}",
                            dx[i]
                        );
                    }
                });
            }
        }
        // Special values: NaN stays NaN; ±inf give PyTorch's limits.
        let x = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -20.0, 1e30, -1e30];
        for &level in &levels {
            let (mut y, mut dx) = ([0f32; 6], [0f32; 6]);
            with_simd_level(level, || gelu_forward(&x, &mut y)).unwrap();
            with_simd_level(level, || gelu_backward(&x, &[1.0; 6], &mut dx)).unwrap();
            assert!(y[0].is_nan() && y[1] == f32::INFINITY && y[3] == 0.0, "{level:?} {y:?}");
            assert!(y[4] == 1e30 && y[5] == 0.0, "{level:?} {y:?}");
            assert!(dx[0].is_nan() && dx[3] == 0.0 && dx[4] == 1.0 && dx[5] == 0.0, "{dx:?}");
        }
    }

    #[test]
    fn relu_matches_the_reference_at_every_simd_level_with_special_values() {
        let n = BLOCK + 21;
        let mut x: Vec<f32> = crate::testutil::rand_vec(n, 5);
        let mut dy = crate::testutil::rand_vec(n, 6);
        let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, -1e-38];
        x[..special.len()].copy_from_slice(&special);
        x[n - special.len()..].copy_from_slice(&special);
        // An infinite or NaN upstream gradient at masked and kept elements.
        dy[1] = f32::NAN;
        dy[2] = f32::INFINITY;
        dy[3] = f32::NAN;
        for &level in &crate::testutil::levels() {
            with_simd_level(level, || {
                let (mut y, mut dx) = (vec![7f32; n], vec![7f32; n]);
                relu_forward(&x, &mut y).unwrap();
                relu_backward(&y, &dy, &mut dx).unwrap();
                for i in 0..n {
                    let want = reference::relu(x[i] as f64);
                    let same = |a: f32| {
                        a.to_bits() == (want as f32).to_bits() || (a.is_nan() && want.is_nan())
                    };
                    assert!(same(y[i]), "{level:?} relu({:e}) = {:e}, want {:e}", x[i], y[i], want);
                    let g = reference::relu_grad(y[i] as f64, dy[i] as f64);
                    assert!(
                        dx[i].to_bits() == (g as f32).to_bits() || (dx[i].is_nan() && g.is_nan()),
                        "{level:?} relu'({}) with dy {} = {} vs {g}",
                        x[i],
                        dy[i],
                        dx[i]
                    );
                }
                // -inf gives 0, and the NaN-gradient elements: masked 0, kept NaN.
                assert_eq!(y[2], 0.0);
                assert_eq!(dx[0].to_bits(), dy[0].to_bits(), "a NaN output passes its gradient");
                assert_eq!(dx[2], 0.0, "an infinite gradient at a masked element is dropped");
                assert_eq!(dx[3], 0.0, "a masked element's NaN gradient is dropped");
            });
        }
    }

    #[test]
    fn short_outputs_are_errors() {
        assert!(relu_forward(&[1.0; 4], &mut [0.0; 3]).is_err());
        assert!(relu_backward(&[1.0; 4], &[1.0; 3], &mut [0.0; 4]).is_err());
        assert!(gelu_forward(&[1.0; 4], &mut [0.0; 3]).is_err());
        assert!(gelu_backward(&[1.0; 4], &[1.0; 4], &mut [0.0; 3]).is_err());
        let mut short = [std::mem::MaybeUninit::new(0f32); 3];
        assert!(gelu_backward_uninit(&[1.0; 4], &[1.0; 4], &mut short).is_err());
        let mut out = [std::mem::MaybeUninit::new(0f32); 4];
        assert!(gelu_backward_uninit(&[1.0; 4], &[1.0; 3], &mut out).is_err());
    }
}
