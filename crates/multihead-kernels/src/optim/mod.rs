//! Adam's and AdamW's update of one parameter in one pass over its arrays (parameter,
//! gradient, first and second moment, and with `amsgrad` the second moment's running maximum),
//! with the operations and roundings of PyTorch's `torch.optim.Adam` / `torch.optim.AdamW`
//! (their single-tensor path, the one they take for CPU tensors), over f32 slices with the
//! run-time AVX-512 / AVX2 / scalar dispatch of [`attention`](crate::attention) and rayon over
//! blocks; f64 slices in plain loops; and the passes PyTorch makes as the reference twin
//! ([`reference`](mod@reference)).
//!
//! Per element, for step `t` (PyTorch's order, each line one of its in-place operations; the
//! bracketed lines only where their option is set):
//!
//! ```text
//! [g = −g]                                          maximize
//! [g = g + weight_decay·p]  (fused multiply-add)    Adam: grad.add(param, alpha=weight_decay)
//! [p = p · (1 − lr·weight_decay)]                   AdamW: param.mul_
//! m = m + (1 − β₁)·(g − m)                          exp_avg.lerp_ (fused multiply-add)
//! v = v·β₂ + ((1 − β₂)·g)·g                         exp_avg_sq.mul_(β₂).addcmul_ (fused)
//! [w = max(w, v), NaN if either is]                 amsgrad: torch.maximum(max_exp_avg_sq, ..)
//! d = √v / √(1 − β₂ᵗ) + eps                         denom (of w with amsgrad)
//! p = p + ((−lr / (1 − β₁ᵗ))·m) / d                 param.addcdiv_
//! ```
//!
//! The scalars are computed in f64 (Python's floats) and rounded to the parameter's dtype, as
//! PyTorch rounds a Python scalar for a float tensor's kernel. Every operation is an IEEE one
//! (the multiply-adds fused at every SIMD level), so the bits do not depend on the level or the
//! thread count. PyTorch's CPU build takes its tensors' square roots from MKL, which is not
//! always correctly rounded (one ulp off for about one f32 element in six and one f64 element
//! in seventy), so the two agree to an ulp or so per step, not always bit for bit.
//!
//! ```
//! use multihead_kernels::optim::{adamw, AdamWStep};
//! let (mut p, g, mut m, mut v) = (vec![1.0f32; 3], vec![0.5f32; 3], vec![0.0f32; 3], vec![0.0f32; 3]);
//! let step = AdamWStep::new(1e-3, (0.9, 0.999), 1e-8, 0.01, 1)?;
//! adamw(&mut p, &g, &mut m, &mut v, None, &step)?;
//! // The first step moves each weight by about lr against its gradient's sign.
//! assert!((p[0] - (1.0 - 1e-5 - 1e-3)).abs() < 1e-6);
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

mod bf16;
mod task;

pub use bf16::adamw_bf16;

use crate::attention::KernelError;

/// Elements per task.
const BLOCK: usize = 1 << 14;

/// One step's scalars, as PyTorch's `_single_tensor_adam` computes them from Python floats.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// `1 − lr·weight_decay`, the decoupled weight decay's factor.
    pub decay: f64,
    /// `1 − β₁`, the first moment's interpolation weight.
    pub one_minus_beta1: f64,
    /// `β₂`.
    pub beta2: f64,
    /// `1 − β₂`.
    pub one_minus_beta2: f64,
    /// `√(1 − β₂ᵗ)`.
    pub bias_correction2_sqrt: f64,
    /// `eps`.
    pub eps: f64,
    /// `−lr / (1 − β₁ᵗ)`.
    pub neg_step_size: f64,
    /// The weight decay added to the gradient (`torch.optim.Adam`'s L2 penalty), or 0 (AdamW,
    /// whose decay is [`decay`](Self::decay)).
    pub l2: f64,
    /// Whether the gradient is negated first (`maximize=True`).
    pub maximize: bool,
}

impl AdamWStep {
    /// The scalars of step `step` (counted from 1) for learning rate `lr`, `betas = (β₁, β₂)`,
    /// `eps` and `weight_decay`, checked as PyTorch's `AdamW` checks them (`0 <= lr`,
    /// `0 <= eps`, `0 <= β < 1`, `0 <= weight_decay`, all finite).
    pub fn new(
        lr: f64,
        (beta1, beta2): (f64, f64),
        eps: f64,
        weight_decay: f64,
        step: u64,
    ) -> Result<Self, KernelError> {
        let bad = |name: &'static str, msg: String| Err(KernelError::InvalidArgument { name, msg });
        for (name, x) in [("lr", lr), ("eps", eps), ("weight_decay", weight_decay)] {
            if !(x.is_finite() && x >= 0.0) {
                return bad(name, format!("must be finite and at least 0, got {x}"));
            }
        }
        for (name, b) in [("beta1", beta1), ("beta2", beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(name, format!("must be in [0, 1), got {b}"));
            }
        }
        if step == 0 {
            return bad("step", "steps count from 1".to_string());
        }
        // Python's `beta ** step` with an integral float step.
        let t = step as f64;
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        Ok(Self {
            decay: 1.0 - lr * weight_decay,
            one_minus_beta1: 1.0 - beta1,
            beta2,
            one_minus_beta2: 1.0 - beta2,
            // Python's `bias_correction2 ** 0.5`: libm's `pow`, which is not always the
            // correctly rounded square root (`1 - 0.995**69` differs by an ulp).
            // `black_box` keeps LLVM from rewriting `pow(x, 0.5)` as `sqrt(x)`.
            bias_correction2_sqrt: bias_correction2.powf(std::hint::black_box(0.5)),
            eps,
            neg_step_size: -(lr / bias_correction1),
            l2: 0.0,
            maximize: false,
        })
    }

    /// The same step as `torch.optim.Adam` takes it (`decoupled_weight_decay=False`): the
    /// weight decay `weight_decay` is added to the gradient (`g + weight_decay·p`) instead of
    /// shrinking the parameter.
    pub fn l2_weight_decay(mut self, weight_decay: f64) -> Self {
        self.decay = 1.0;
        self.l2 = weight_decay;
        self
    }

    /// The same step ascending (`maximize=True`): the gradient is negated first.
    pub fn maximize(mut self, on: bool) -> Self {
        self.maximize = on;
        self
    }
}

/// The scalars rounded to f32, as PyTorch hands them to an f32 tensor's kernels (and, as f32
/// "opmath" scalars, to a bf16 tensor's).
#[derive(Clone, Copy)]
struct Scalars32 {
    decay: f32,
    /// The lerp's coefficient: `w` when `|w| < 0.5`, else `w − 1` (computed in f32).
    lerp_coeff: f32,
    /// Whether the lerp starts from `m` (small weight) or from `g`.
    lerp_small: bool,
    beta2: f32,
    one_minus_beta2: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
    l2: f32,
    /// `l2` as a bf16 tensor's `add(param, alpha=weight_decay)` takes it: rounded to bf16 (through
    /// f32, as `c10::BFloat16` converts a double).
    l2_bf16: f32,
    /// `eps` as a bf16 tensor's `add_(eps)` takes it: rounded to bf16 through f32 (`add` casts
    /// a Python number to the tensor's dtype; `mul`, `div`, `lerp`, `addcmul` and `addcdiv`
    /// keep it in f32).
    eps_bf16: f32,
    /// Whether the L2 term is added: PyTorch tests the Python float (`weight_decay != 0`), so a
    /// decay that rounds to 0 in f32 still adds `0·p` (NaN where `p` is infinite).
    has_l2: bool,
    /// The gradient's factor: −1 with `maximize`, else 1 (exact either way).
    sign: f32,
}

impl Scalars32 {
    fn new(s: &AdamWStep) -> Self {
        let w = s.one_minus_beta1 as f32;
        let lerp_small = w.abs() < 0.5;
        Self {
            decay: s.decay as f32,
            lerp_coeff: if lerp_small { w } else { w - 1.0 },
            lerp_small,
            beta2: s.beta2 as f32,
            one_minus_beta2: s.one_minus_beta2 as f32,
            bias_correction2_sqrt: s.bias_correction2_sqrt as f32,
            eps: s.eps as f32,
            neg_step_size: s.neg_step_size as f32,
            l2: s.l2 as f32,
            l2_bf16: crate::convert::bf16_bits_to_f32(crate::convert::f32_to_bf16_bits(
                s.l2 as f32,
            )),
            eps_bf16: crate::convert::bf16_bits_to_f32(crate::convert::f32_to_bf16_bits(
                s.eps as f32,
            )),
            has_l2: s.l2 != 0.0,
            sign: if s.maximize { -1.0 } else { 1.0 },
        }
    }
}

/// Checks that the arrays have one length.
pub(super) fn check_lengths(
    p: usize,
    g: usize,
    m: usize,
    v: usize,
    vmax: Option<usize>,
) -> Result<(), KernelError> {
    if g == p && m == p && v == p && vmax.is_none_or(|w| w == p) {
        return Ok(());
    }
    let w = vmax.map(|w| format!(", its running maximum {w}")).unwrap_or_default();
    Err(KernelError::InvalidArgument {
        name: "grad",
        msg: format!(
            "the parameter has {p} elements but its gradient {g}, first moment {m} and second \
             moment {v}{w}; pass arrays of one length"
        ),
    })
}

/// One Adam / AdamW step of an f32 parameter `p` with gradient `g`, updating `p`, its moments
/// `m` and `v` and, with `amsgrad`, the running maximum `vmax` of `v` in place (see the
/// module's formulas; [`AdamWStep`] says which variant).
pub fn adamw(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    vmax: Option<&mut [f32]>,
    step: &AdamWStep,
) -> Result<(), KernelError> {
    task::step(p, g, m, v, vmax, step)
}

/// `torch.maximum` on one pair: NaN where either is NaN.
fn max_nan_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() || a > b {
        a
    } else {
        b
    }
}

/// [`adamw`] for an f64 parameter: the same operations in f64 (PyTorch's double kernels).
pub fn adamw_f64(
    p: &mut [f64],
    g: &[f64],
    m: &mut [f64],
    v: &mut [f64],
    mut vmax: Option<&mut [f64]>,
    s: &AdamWStep,
) -> Result<(), KernelError> {
    check_lengths(p.len(), g.len(), m.len(), v.len(), vmax.as_ref().map(|w| w.len()))?;
    let w = s.one_minus_beta1;
    let (coeff, small) = if w.abs() < 0.5 { (w, true) } else { (w - 1.0, false) };
    let sign = if s.maximize { -1.0 } else { 1.0 };
    for i in 0..p.len() {
        let mut g = g[i] * sign;
        if s.l2 != 0.0 {
            g = p[i].mul_add(s.l2, g);
        }
        let (p, m, v) = (&mut p[i], &mut m[i], &mut v[i]);
        let base = if small { *m } else { g };
        *p *= s.decay;
        *m = coeff.mul_add(g - *m, base);
        *v = (s.one_minus_beta2 * g).mul_add(g, *v * s.beta2);
        let w = match vmax.as_deref_mut() {
            Some(w) => {
                w[i] = max_nan_f64(w[i], *v);
                w[i]
            }
            None => *v,
        };
        let d = w.sqrt() / s.bias_correction2_sqrt + s.eps;
        *p += (s.neg_step_size * *m) / d;
    }
    Ok(())
}

/// The reference twin: PyTorch's in-place operations as passes over f32 arrays, element by
/// element in plain scalar code.
pub mod reference {
    pub use super::bf16::reference::adamw_bf16;

    use super::{check_lengths, AdamWStep, KernelError, Scalars32};

    /// [`adamw`](super::adamw), pass by pass.
    pub fn adamw(
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        vmax: Option<&mut [f32]>,
        step: &AdamWStep,
    ) -> Result<(), KernelError> {
        check_lengths(p.len(), g.len(), m.len(), v.len(), vmax.as_ref().map(|w| w.len()))?;
        let s = Scalars32::new(step);
        // grad = -grad (maximize), as a product with −1: the same number (a NaN's sign may
        // differ; NaN signs and payloads are not part of the contract).
        let mut g: Vec<f32> = g.iter().map(|&g| g * s.sign).collect();
        // grad = grad.add(param, alpha=weight_decay) (Adam): ATen's vectorised add is a fused
        // multiply-add.
        if s.has_l2 {
            g.iter_mut().zip(p.iter()).for_each(|(g, &p)| *g = p.mul_add(s.l2, *g));
        }
        // param.mul_(1 - lr * weight_decay) (AdamW)
        p.iter_mut().for_each(|p| *p *= s.decay);
        // exp_avg.lerp_(grad, 1 - beta1): ATen's lerp, a fused multiply-add from `m` (small
        // weight) or from `g`.
        for (m, &g) in m.iter_mut().zip(&g) {
            let base = if s.lerp_small { *m } else { g };
            *m = s.lerp_coeff.mul_add(g - *m, base);
        }
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        v.iter_mut().for_each(|v| *v *= s.beta2);
        for (v, &g) in v.iter_mut().zip(&g) {
            *v = (s.one_minus_beta2 * g).mul_add(g, *v);
        }
        // torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq) (amsgrad)
        let w: &[f32] = match vmax {
            Some(w) => {
                for (w, &v) in w.iter_mut().zip(v.iter()) {
                    // The NaN that is there: `w`'s, else `v`'s.
                    *w = if w.is_nan() || v.is_nan() { *w + v } else { w.max(v) };
                }
                w
            }
            None => v,
        };
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let d: Vec<f32> = w.iter().map(|v| v.sqrt() / s.bias_correction2_sqrt + s.eps).collect();
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        for ((p, &m), d) in p.iter_mut().zip(m.iter()).zip(d) {
            *p += (s.neg_step_size * m) / d;
        }
        Ok(())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::attention::with_simd_level;
    use crate::testutil::levels;

    fn arrays(n: usize, seed: u32) -> [Vec<f32>; 4] {
        let mut x = seed.wrapping_mul(2_654_435_761).max(1);
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        };
        let p: Vec<f32> = (0..n).map(|_| next()).collect();
        let g: Vec<f32> = (0..n).map(|_| next() * 3.0).collect();
        let m: Vec<f32> = (0..n).map(|_| next() * 0.1).collect();
        let v: Vec<f32> = (0..n).map(|_| next().abs() * 0.01).collect();
        [p, g, m, v]
    }

    /// The bits of the values, every NaN as one: a NaN's sign and payload are not part of the
    /// contract (the compiler may fold the reference's product with ±1 into a negation, which
    /// flips a NaN's sign where the kernel's product keeps it).
    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|x| if x.is_nan() { f32::NAN.to_bits() } else { x.to_bits() }).collect()
    }

    /// A kernel or its twin over one element type.
    pub(super) type Step<T> = fn(
        &mut [T],
        &[T],
        &mut [T],
        &mut [T],
        Option<&mut [T]>,
        &AdamWStep,
    ) -> Result<(), KernelError>;

    /// Each variant (plain AdamW, Adam's L2 decay, maximize, amsgrad) of `kernel` at every
    /// level against `twin`, at sizes around the vector width and a block, with a NaN and an
    /// infinite gradient (`special`) among the elements; `grow` makes the running maximum from
    /// the second moment, `key` the bits compared.
    pub(super) fn check_levels<T: Copy>(
        arrays: impl Fn(usize, u32) -> [Vec<T>; 4],
        special: [T; 2],
        grow: impl Fn(T) -> T,
        (kernel, twin): (Step<T>, Step<T>),
        key: impl Fn(&[T]) -> Vec<u32>,
    ) {
        let variants = [(false, false, false), (true, true, true), (false, true, false)];
        for n in [0, 1, 7, 16, 17, 33, BLOCK + 5, 2 * BLOCK] {
            for (step, betas, wd) in [(1, (0.9, 0.999), 0.01), (7, (0.6, 0.95), 0.0)] {
                for (l2, maximize, amsgrad) in variants {
                    let mut s = AdamWStep::new(3e-3, betas, 1e-8, wd, step).expect("valid");
                    if l2 {
                        s = s.l2_weight_decay(wd);
                    }
                    let s = s.maximize(maximize);
                    let [p0, mut g, m0, v0] = arrays(n, n as u32 + step as u32);
                    if n > 20 {
                        (g[3], g[18]) = (special[0], special[1]);
                    }
                    let w0: Vec<T> = v0.iter().map(|&v| grow(v)).collect();
                    let (mut p, mut m, mut v, mut w) =
                        (p0.clone(), m0.clone(), v0.clone(), w0.clone());
                    twin(&mut p, &g, &mut m, &mut v, amsgrad.then_some(&mut w[..]), &s)
                        .expect("lengths");
                    for level in levels() {
                        let (mut q, mut mq, mut vq, mut wq) =
                            (p0.clone(), m0.clone(), v0.clone(), w0.clone());
                        let ws = amsgrad.then_some(&mut wq[..]);
                        with_simd_level(level, || kernel(&mut q, &g, &mut mq, &mut vq, ws, &s))
                            .expect("lengths");
                        let at =
                            format!("n {n}, step {step}, {:?}, {level:?}", (l2, maximize, amsgrad));
                        assert_eq!(key(&q), key(&p), "p, {at}");
                        assert_eq!(key(&mq), key(&m), "m, {at}");
                        assert_eq!(key(&vq), key(&v), "v, {at}");
                        assert_eq!(key(&wq), key(&w), "vmax, {at}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_level_gives_the_bits_of_the_passes() {
        let pair: (Step<f32>, Step<f32>) = (adamw, reference::adamw);
        check_levels(arrays, [f32::NAN, f32::INFINITY], |v| v * 1.5, pair, bits);
    }

    /// Adam's L2 decay, maximize and amsgrad in f32 and f64 against the textbook formulas in
    /// f64.
    #[test]
    fn variants_agree_with_the_formulas_in_f64() {
        let (wd, t) = (0.1, 4);
        let s = AdamWStep::new(1e-2, (0.9, 0.999), 1e-8, wd, t)
            .expect("valid")
            .l2_weight_decay(wd)
            .maximize(true);
        let [p0, g, m0, v0] = arrays(100, 5);
        let w0: Vec<f32> =
            v0.iter().enumerate().map(|(i, v)| if i % 2 == 0 { v * 3.0 } else { 0.0 }).collect();
        let (mut p, mut m, mut v, mut w) = (p0.clone(), m0.clone(), v0.clone(), w0.clone());
        adamw(&mut p, &g, &mut m, &mut v, Some(&mut w), &s).expect("lengths");
        let wide = |x: &[f32]| x.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
        let (mut pd, gd, mut md, mut vd, mut wd64) =
            (wide(&p0), wide(&g), wide(&m0), wide(&v0), wide(&w0));
        adamw_f64(&mut pd, &gd, &mut md, &mut vd, Some(&mut wd64), &s).expect("lengths");
        for i in 0..100 {
            let gi = -gd[i] + wd * f64::from(p0[i]);
            let mm = 0.9 * f64::from(m0[i]) + 0.1 * gi;
            let vv = 0.999 * f64::from(v0[i]) + 0.001 * gi * gi;
            let ww = vv.max(f64::from(w0[i]));
            let (mh, wh) =
                (mm / (1.0 - 0.9f64.powi(t as i32)), ww / (1.0 - 0.999f64.powi(t as i32)));
            let want = f64::from(p0[i]) - 1e-2 * mh / (wh.sqrt() + 1e-8);
            assert!((pd[i] - want).abs() < 1e-12, "f64 {i}: {} vs {want}", pd[i]);
            assert!((f64::from(p[i]) - want).abs() < 1e-6, "f32 {i}: {} vs {want}", p[i]);
            assert!((wd64[i] - ww).abs() <= 1e-15 * ww, "f64 vmax {i}");
        }
    }

    #[test]
    fn f32_and_f64_agree_with_the_formula_in_f64() {
        let s = AdamWStep::new(1e-2, (0.9, 0.999), 1e-8, 0.1, 3).expect("valid");
        let [p0, g, m0, v0] = arrays(100, 9);
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adamw(&mut p, &g, &mut m, &mut v, None, &s).expect("lengths");
        let wide = |x: &[f32]| x.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
        let (mut pd, gd, mut md, mut vd) = (wide(&p0), wide(&g), wide(&m0), wide(&v0));
        adamw_f64(&mut pd, &gd, &mut md, &mut vd, None, &s).expect("lengths");
        for i in 0..100 {
            // The textbook update, in f64.
            let mm = 0.9 * f64::from(m0[i]) + 0.1 * gd[i];
            let vv = 0.999 * f64::from(v0[i]) + 0.001 * gd[i] * gd[i];
            let (mh, vh) = (mm / (1.0 - 0.9f64.powi(3)), vv / (1.0 - 0.999f64.powi(3)));
            let want = f64::from(p0[i]) * (1.0 - 1e-3) - 1e-2 * mh / (vh.sqrt() + 1e-8);
            assert!((pd[i] - want).abs() < 1e-12, "f64 {i}: {} vs {want}", pd[i]);
            assert!((f64::from(p[i]) - want).abs() < 1e-6, "f32 {i}: {} vs {want}", p[i]);
        }
    }

    /// The scalars are Python's: `(1 - 0.995**69) ** 0.5` and `(1 - 0.999**1270) ** 0.5` as
    /// CPython 3 prints them (libm's `pow`), an ulp above the correctly rounded square roots
    /// (0.5407330813559809, 0.8481431297801915), where PyTorch's f64 steps part from `sqrt`.
    #[test]
    fn bias_correction_is_pythons_power() {
        let sqrt2 = |b2: f64, t: u64| {
            AdamWStep::new(1e-3, (0.9, b2), 1e-8, 0.0, t).expect("valid").bias_correction2_sqrt
        };
        assert_eq!(sqrt2(0.995, 69), 0.540733081355981);
        assert_eq!(sqrt2(0.999, 1270), 0.8481431297801916);
    }

    /// A weight decay that rounds to 0 in f32 still adds `0·p` to the gradient, as PyTorch
    /// (which tests the Python float) does: NaN where the parameter is infinite.
    #[test]
    fn a_tiny_l2_decay_still_adds_its_term() {
        let s = AdamWStep::new(1e-3, (0.9, 0.999), 1e-8, 1e-50, 1)
            .expect("valid")
            .l2_weight_decay(1e-50);
        let (mut p, g, mut m, mut v) =
            (vec![f32::INFINITY, 1.0], vec![0.5f32; 2], vec![0.0; 2], vec![0.0; 2]);
        let (mut q, mut mq, mut vq) = (p.clone(), m.clone(), v.clone());
        adamw(&mut p, &g, &mut m, &mut v, None, &s).expect("lengths");
        reference::adamw(&mut q, &g, &mut mq, &mut vq, None, &s).expect("lengths");
        assert!(p[0].is_nan() && q[0].is_nan() && m[0].is_nan(), "{p:?} {m:?}");
        assert!(p[1].is_finite() && p[1] == q[1]);
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(AdamWStep::new(-1.0, (0.9, 0.999), 1e-8, 0.0, 1).is_err());
        assert!(AdamWStep::new(1e-3, (1.0, 0.999), 1e-8, 0.0, 1).is_err());
        assert!(AdamWStep::new(1e-3, (0.9, f64::NAN), 1e-8, 0.0, 1).is_err());
        assert!(AdamWStep::new(1e-3, (0.9, 0.999), 1e-8, 0.0, 0).is_err());
        let s = AdamWStep::new(1e-3, (0.9, 0.999), 1e-8, 0.0, 1).expect("valid");
        let (mut p, mut m, mut v) = (vec![0.0f32; 3], vec![0.0f32; 3], vec![0.0f32; 2]);
        let err = adamw(&mut p, &[0.0; 3], &mut m, &mut v, None, &s).expect_err("short v");
        assert!(err.to_string().contains("second moment 2"), "{err}");
        let (mut v, mut w) = (vec![0.0f32; 3], vec![0.0f32; 4]);
        let err = adamw(&mut p, &[0.0; 3], &mut m, &mut v, Some(&mut w), &s).expect_err("long w");
        assert!(err.to_string().contains("running maximum 4"), "{err}");
    }
}
