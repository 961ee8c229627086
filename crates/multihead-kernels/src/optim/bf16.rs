//! Adam's and AdamW's step for bfloat16 parameters (their bits as `u16`), as PyTorch's
//! single-tensor path runs it on bf16 tensors: each in-place operation computes in f32 from the
//! bf16 operands and f32 scalars, and rounds its result to bf16 (ties to even) before the next
//! one reads it; the moments are bf16 too.
//!
//! Two scalars are bf16 values, the two that reach an `add` (a ufunc that casts a Python number
//! to the tensor's dtype, f64 → f32 → bf16): `eps` in `denom.add_(eps)`, and Adam's
//! `alpha=weight_decay` in `grad.add(param, alpha=weight_decay)`; `mul`, `div`, `lerp`,
//! `addcmul` and `addcdiv` keep f32 scalars. PyTorch's vector loop computes the L2 sum
//! in f32 and rounds once, as here; the few elements its scalar remainder loop takes (up to 31
//! at the end of each thread's range, which depends on the vector width and the thread count)
//! round the product to bf16 before the sum, and can differ from this by a bf16 ulp.
//!
//! ```text
//! [g = −g]                                   maximize (exact)
//! [g = bf16(g + bf16(weight_decay)·p)]       Adam (a fused multiply-add, rounded)
//! [p = bf16(p · (1 − lr·weight_decay))]      AdamW
//! m = bf16(lerp(m, g, 1 − β₁))
//! v = bf16(v·β₂);  v = bf16(((1 − β₂)·g)·g + v)
//! [w = max(w, v)]                            amsgrad (exact)
//! d = bf16(√v);  d = bf16(d / √(1 − β₂ᵗ));  d = bf16(d + bf16(eps))
//! p = bf16(p + ((−lr / (1 − β₁ᵗ))·m) / d)
//! ```

use super::{task, AdamWStep};
use crate::attention::KernelError;

/// [`adamw`](super::adamw) for a bfloat16 parameter and bfloat16 moments (their bits), each
/// operation rounded to bf16 as PyTorch rounds it (see the module's formulas).
pub fn adamw_bf16(
    p: &mut [u16],
    g: &[u16],
    m: &mut [u16],
    v: &mut [u16],
    vmax: Option<&mut [u16]>,
    step: &AdamWStep,
) -> Result<(), KernelError> {
    task::step(p, g, m, v, vmax, step)
}

/// The reference twin: PyTorch's in-place operations on bf16 tensors as passes in plain
/// scalar code, each widening its operands, computing in f32 and rounding to bf16.
pub mod reference {
    use super::super::{check_lengths, Scalars32};
    use super::{AdamWStep, KernelError};
    use crate::convert::{bf16_bits_to_f32 as wide, f32_to_bf16_bits as bf};

    fn pass(x: &mut [u16], f: impl Fn(f32, usize) -> f32) {
        x.iter_mut().enumerate().for_each(|(i, x)| *x = bf(f(wide(*x), i)));
    }

    /// [`adamw_bf16`](super::adamw_bf16), pass by pass.
    pub fn adamw_bf16(
        p: &mut [u16],
        g: &[u16],
        m: &mut [u16],
        v: &mut [u16],
        vmax: Option<&mut [u16]>,
        step: &AdamWStep,
    ) -> Result<(), KernelError> {
        check_lengths(p.len(), g.len(), m.len(), v.len(), vmax.as_ref().map(|w| w.len()))?;
        let s = Scalars32::new(step);
        // grad = -grad; grad = grad.add(param, alpha=weight_decay)
        let mut g: Vec<u16> = g.iter().map(|&g| bf(wide(g) * s.sign)).collect();
        if s.has_l2 {
            pass(&mut g, |g, i| wide(p[i]).mul_add(s.l2_bf16, g));
        }
        // param.mul_(1 - lr * weight_decay)
        pass(p, |p, _| p * s.decay);
        // exp_avg.lerp_(grad, 1 - beta1)
        pass(m, |m, i| {
            let gi = wide(g[i]);
            s.lerp_coeff.mul_add(gi - m, if s.lerp_small { m } else { gi })
        });
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        pass(v, |v, _| v * s.beta2);
        pass(v, |v, i| (s.one_minus_beta2 * wide(g[i])).mul_add(wide(g[i]), v));
        // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        let w: &[u16] = match vmax {
            Some(w) => {
                pass(w, |w, i| {
                    let vi = wide(v[i]);
                    if w.is_nan() || vi.is_nan() {
                        w + vi
                    } else {
                        w.max(vi)
                    }
                });
                w
            }
            None => v,
        };
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let mut d: Vec<u16> = w.iter().map(|&w| bf(wide(w).sqrt())).collect();
        pass(&mut d, |d, _| d / s.bias_correction2_sqrt);
        pass(&mut d, |d, _| d + s.eps_bf16);
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        pass(p, |p, i| p + (s.neg_step_size * wide(m[i])) / wide(d[i]));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{check_levels, Step};
    use super::*;
    use crate::convert::f32_to_bf16_bits as bf;

    fn arrays(n: usize, seed: u32) -> [Vec<u16>; 4] {
        let mut x = seed.wrapping_mul(2_654_435_761).max(1);
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        };
        let p: Vec<u16> = (0..n).map(|_| bf(next())).collect();
        let g: Vec<u16> = (0..n).map(|_| bf(next() * 3.0)).collect();
        let m: Vec<u16> = (0..n).map(|_| bf(next() * 0.1)).collect();
        let v: Vec<u16> = (0..n).map(|_| bf(next().abs() * 0.01)).collect();
        [p, g, m, v]
    }

    /// The bits, every NaN as one (signs and payloads are not part of the contract).
    fn canon(x: &[u16]) -> Vec<u32> {
        x.iter().map(|&b| u32::from(if (b & 0x7fff) > 0x7f80 { 0x7fc0 } else { b })).collect()
    }

    #[test]
    fn every_level_gives_the_bits_of_the_passes() {
        let pair: (Step<u16>, Step<u16>) = (adamw_bf16, reference::adamw_bf16);
        let special = [bf(f32::NAN), bf(f32::INFINITY)];
        check_levels(arrays, special, |v| bf(wide(v) * 1.5), pair, canon);
    }

    use crate::convert::bf16_bits_to_f32 as wide;

    /// Within a few bf16 ulps of the f32 kernel's step from the same (bf16) values: the
    /// roundings are the only difference.
    #[test]
    fn close_to_the_f32_step() {
        let s = AdamWStep::new(1e-2, (0.9, 0.999), 1e-8, 0.1, 3).expect("valid");
        let [p0, g, m0, v0] = arrays(300, 4);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adamw_bf16(&mut p, &g, &mut m, &mut v, None, &s).expect("lengths");
        let f = |x: &[u16]| x.iter().map(|&b| wide(b)).collect::<Vec<f32>>();
        let (mut pf, gf, mut mf, mut vf) = (f(&p0), f(&g), f(&m0), f(&v0));
        super::super::adamw(&mut pf, &gf, &mut mf, &mut vf, None, &s).expect("lengths");
        for i in 0..300 {
            let (a, b) = (wide(p[i]), pf[i]);
            assert!((a - b).abs() <= 2.0 * b.abs() * 2f32.powi(-8) + 1e-6, "{i}: {a} vs {b}");
        }
    }

    #[test]
    fn lengths_are_checked() {
        let s = AdamWStep::new(1e-3, (0.9, 0.999), 1e-8, 0.0, 1).expect("valid");
        let (mut p, mut m, mut v) = (vec![0u16; 3], vec![0u16; 3], vec![0u16; 2]);
        let err = adamw_bf16(&mut p, &[0; 3], &mut m, &mut v, None, &s).expect_err("short v");
        assert!(err.to_string().contains("second moment 2"), "{err}");
    }
}
