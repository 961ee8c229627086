//! The p-norm of a vector, as `torch.linalg.vector_norm` computes it for one tensor on the CPU:
//! the per-gradient norms of `torch.nn.utils.clip_grad_norm_`, and the norm of those norms.
//!
//! Per order ([`NormOrd`]), with `a` the accumulator (f32 for f32, bf16 and f16 elements, each
//! widened exactly; f64 for f64), as PyTorch's reductions compute it:
//!
//! ```text
//! 2      √(Σ x·x)            (a multiply and an add, not fused, as PyTorch's vectorised loop)
//! 1      Σ |x|
//! 0      Σ (x ≠ 0 ? 1 : 0)   (NaN counts: it is not 0)
//! p      (Σ |x|^p)^(1/p)     (any other finite p, negative ones too; 1/p in the accumulator)
//! inf    max |x|             (NaN if any element is NaN)
//! −inf   min |x|             (NaN if any element is NaN)
//! ```
//!
//! As in ATen, a vector of one element has its magnitude as its norm (for order 0: 0 or 1),
//! without the power and the root that could overflow or underflow, and an empty vector has
//! norm 0, but none for `inf` or a negative order.
//!
//! The sums are taken in a fixed order: the elements are cut into chunks of [`CHUNK`] that the
//! threads take; each chunk keeps 16 running sums (element `i` into sum `i % 16`), added
//! pairwise (8 + 8, 4 + 4, 2 + 2, 1 + 1); the chunk sums are added in order. So the bits do not
//! depend on the thread count or the SIMD level, and [`reference`](mod@reference) computes
//! them on one thread. PyTorch's own order differs, so its f32 norms agree with these to
//! f32's rounding of a sum, not bit for bit. The loops are plain Rust that the compiler
//! vectorises (at AVX-512 where the CPU has it, chosen at run time); a norm reads each element
//! once, so memory, not arithmetic, bounds it.
//!
//! ```
//! use multihead_kernels::vector_norm::{vector_norm_f32, NormOrd};
//!
//! let x = [3.0f32, -4.0];
//! assert_eq!(vector_norm_f32(&x, NormOrd::new(2.0)?)?, 5.0);
//! assert_eq!(vector_norm_f32(&x, NormOrd::new(f64::INFINITY)?)?, 4.0);
//! assert_eq!(vector_norm_f32(&x, NormOrd::new(1.0)?)?, 7.0);
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

use rayon::prelude::*;

use crate::attention::KernelError;
use crate::convert::bf16_bits_to_f32;
pub use crate::sum::CHUNK;
use crate::sum::{sum_chunks, SumAcc};

/// The order of a vector norm: `ord` of `torch.linalg.vector_norm`, `norm_type` of
/// `clip_grad_norm_`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum NormOrd {
    /// The Euclidean norm, `ord = 2` (PyTorch's default).
    Two,
    /// The sum of magnitudes, `ord = 1`.
    One,
    /// The count of non-zero elements, `ord = 0`.
    Zero,
    /// The largest magnitude, `ord = inf`.
    Inf,
    /// The smallest magnitude, `ord = -inf`.
    NegInf,
    /// `(Σ |x|^p)^(1/p)` for any other finite `p`.
    P(f64),
}

impl NormOrd {
    /// The order `ord`: any finite number or ±infinity (NaN is refused).
    pub fn new(ord: f64) -> Result<Self, KernelError> {
        Ok(match ord {
            o if o.is_nan() => {
                let msg = "is NaN; pass a number or infinity (2.0 is the Euclidean norm)".into();
                return Err(KernelError::InvalidArgument { name: "norm_type", msg });
            }
            2.0 => Self::Two,
            1.0 => Self::One,
            0.0 => Self::Zero,
            f64::INFINITY => Self::Inf,
            f64::NEG_INFINITY => Self::NegInf,
            p => Self::P(p),
        })
    }

    /// The order as a number.
    pub fn value(self) -> f64 {
        match self {
            Self::Two => 2.0,
            Self::One => 1.0,
            Self::Zero => 0.0,
            Self::Inf => f64::INFINITY,
            Self::NegInf => f64::NEG_INFINITY,
            Self::P(p) => p,
        }
    }
}

/// An accumulator type: f32 or f64.
trait Acc: SumAcc + PartialOrd {
    const ONE: Self;
    fn abs(self) -> Self;
    fn sq(self) -> Self;
    fn is_nan(self) -> bool;
    fn powf(self, p: Self) -> Self;
    fn sqrt(self) -> Self;
    fn recip(self) -> Self;
    fn of(p: f64) -> Self;
}

macro_rules! acc {
    ($t:ty) => {
        impl Acc for $t {
            const ONE: Self = 1.0;
            #[inline(always)]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline(always)]
            fn sq(self) -> Self {
                self * self
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn powf(self, p: Self) -> Self {
                <$t>::powf(self, p)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn recip(self) -> Self {
                1.0 / self
            }
            fn of(p: f64) -> Self {
                p as $t
            }
        }
    };
}
acc!(f32);
acc!(f64);

/// One chunk's largest (`max`) or smallest magnitude; NaN as soon as an element is NaN.
#[inline(always)]
fn chunk_extreme<T: Copy, A: Acc>(c: &[T], w: impl Fn(T) -> A, max: bool) -> A {
    let mut best: Option<A> = None;
    for &x in c {
        let a = w(x).abs();
        if a.is_nan() {
            return a;
        }
        best = Some(match best {
            Some(b) if (max && b >= a) || (!max && b <= a) => b,
            _ => a,
        });
    }
    best.unwrap_or(A::ZERO)
}

/// The norm of the widened elements `w(x)`.
fn norm<T: Copy + Sync, A: Acc>(
    x: &[T],
    ord: NormOrd,
    w: impl Fn(T) -> A + Sync + Copy,
    parallel: bool,
) -> Result<A, KernelError> {
    let negative = matches!(ord, NormOrd::NegInf) || matches!(ord, NormOrd::P(p) if p < 0.0);
    if x.is_empty() && (negative || ord == NormOrd::Inf) {
        let msg = format!(
            "the {} norm of an empty tensor is undefined (PyTorch refuses it too); leave out the empty tensors or pass a norm_type of 0 or more that is finite",
            ord.value()
        );
        return Err(KernelError::InvalidArgument { name: "x", msg });
    }
    if let [v] = x {
        // One element: its magnitude (0 or 1 for order 0), as ATen returns it without the
        // power and root, which could overflow or underflow.
        let m = w(*v).abs();
        return Ok(if ord == NormOrd::Zero && !m.is_nan() {
            if m == A::ZERO {
                A::ZERO
            } else {
                A::ONE
            }
        } else if ord == NormOrd::Zero {
            A::ONE
        } else {
            m
        });
    }
    Ok(match ord {
        NormOrd::Two => sum_chunks(x, move |v| w(v).sq(), parallel).sqrt(),
        NormOrd::One => sum_chunks(x, move |v| w(v).abs(), parallel),
        NormOrd::Zero => {
            sum_chunks(x, move |v| if w(v) == A::ZERO { A::ZERO } else { A::ONE }, parallel)
        }
        NormOrd::P(p) => {
            let p = A::of(p);
            sum_chunks(x, move |v| w(v).abs().powf(p), parallel).powf(p.recip())
        }
        NormOrd::Inf | NormOrd::NegInf => {
            let max = ord == NormOrd::Inf;
            let one = |c: &[T]| chunk_extreme(c, w, max);
            let parts: Vec<A> = if parallel && x.len() > CHUNK {
                x.par_chunks(CHUNK).map(one).collect()
            } else {
                x.chunks(CHUNK).map(one).collect()
            };
            // `x` is not empty (refused above), so every chunk is non-empty and `one` never
            // returned its empty-chunk zero.
            let mut best = parts[0];
            for &a in &parts[1..] {
                if a.is_nan() || best.is_nan() {
                    best = if best.is_nan() { best } else { a };
                } else if (max && a > best) || (!max && a < best) {
                    best = a;
                }
            }
            best
        }
    })
}

/// The `ord`-norm of `x` in f32. An empty `x` has norm 0 (refused for inf and for negative
/// orders, as PyTorch refuses it); one element's norm is its magnitude, as in PyTorch.
pub fn vector_norm_f32(x: &[f32], ord: NormOrd) -> Result<f32, KernelError> {
    norm(x, ord, |v| v, true)
}

/// The `ord`-norm of `x` in f64.
pub fn vector_norm_f64(x: &[f64], ord: NormOrd) -> Result<f64, KernelError> {
    norm(x, ord, |v| v, true)
}

/// The `ord`-norm of the bf16 values `x` (their bits), accumulated in f32; the caller rounds
/// the result to bf16 where PyTorch returns a bf16 norm.
pub fn vector_norm_bf16(x: &[u16], ord: NormOrd) -> Result<f32, KernelError> {
    norm(x, ord, bf16_bits_to_f32, true)
}

/// The same norms on one thread, chunk after chunk: the twin the tests compare with.
pub mod reference {
    use super::{norm, KernelError, NormOrd};

    /// [`super::vector_norm_f32`] on one thread.
    pub fn vector_norm_f32(x: &[f32], ord: NormOrd) -> Result<f32, KernelError> {
        norm(x, ord, |v| v, false)
    }

    /// [`super::vector_norm_f64`] on one thread.
    pub fn vector_norm_f64(x: &[f64], ord: NormOrd) -> Result<f64, KernelError> {
        norm(x, ord, |v| v, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::f32_to_bf16_bits;
    use crate::testutil::{pool, rand_vec};

    /// The norm in f64 of the f64 values `x`, written out.
    fn exact(x: &[f64], ord: f64) -> f64 {
        let mags = x.iter().map(|v| v.abs());
        match ord {
            f64::INFINITY => mags.fold(0.0, f64::max),
            f64::NEG_INFINITY => mags.fold(f64::INFINITY, f64::min),
            0.0 => x.iter().filter(|&&v| v != 0.0).count() as f64,
            p => mags.map(|m| m.powf(p)).sum::<f64>().powf(1.0 / p),
        }
    }

    #[test]
    fn norms_match_the_twin_for_any_thread_count_and_f64_within_rounding() {
        let ords = [2.0, 1.0, 0.0, 3.0, 0.5, -1.5, f64::INFINITY, f64::NEG_INFINITY];
        for n in [1, 15, 16, 17, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 77] {
            let x = rand_vec(n, n as u64 + 11);
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let bits: Vec<u16> = x.iter().map(|&v| f32_to_bf16_bits(v)).collect();
            let xb: Vec<f64> = bits.iter().map(|&b| bf16_bits_to_f32(b) as f64).collect();
            for ord in ords {
                let o = NormOrd::new(ord).expect("an order");
                let want = exact(&x64, ord);
                let want_b = exact(&xb, ord);
                let twin = reference::vector_norm_f32(&x, o).expect("a norm");
                let twin64 = reference::vector_norm_f64(&x64, o).expect("a norm");
                for threads in [1, 2, 3] {
                    let (a, b, c) = pool(threads).install(|| {
                        let a = vector_norm_f32(&x, o).expect("a norm");
                        (a, vector_norm_f64(&x64, o).expect("a norm"), vector_norm_bf16(&bits, o))
                    });
                    assert_eq!(a.to_bits(), twin.to_bits(), "n {n} ord {ord} t {threads}");
                    assert_eq!(b.to_bits(), twin64.to_bits(), "n {n} ord {ord} t {threads}");
                    let c = c.expect("a norm");
                    // f32 sums of n terms: within n·2⁻²⁴ relative, plus pow's rounding.
                    let tol = 4e-7 * (n as f64 + 8.0) * want.abs().max(1e-30);
                    assert!((a as f64 - want).abs() <= tol, "n {n} ord {ord}: {a} vs {want}");
                    let tol_b = 4e-7 * (n as f64 + 8.0) * want_b.abs().max(1e-30);
                    assert!((c as f64 - want_b).abs() <= tol_b, "bf16 n {n} ord {ord}: {c}");
                    assert!((b - want).abs() <= 1e-15 * (n as f64 + 8.0) * want.abs(), "f64");
                }
            }
        }
    }

    #[test]
    fn special_values_follow_pytorch() {
        let o = |p: f64| NormOrd::new(p).expect("an order");
        let nan = [1.0f32, f32::NAN, 3.0];
        for p in [2.0, 1.0, 3.0, f64::INFINITY, f64::NEG_INFINITY] {
            assert!(vector_norm_f32(&nan, o(p)).expect("a norm").is_nan(), "ord {p}");
        }
        // A NaN is not zero: it counts.
        assert_eq!(vector_norm_f32(&nan, o(0.0)).expect("a norm"), 3.0);
        let inf = [1.0f32, f32::NEG_INFINITY];
        assert_eq!(vector_norm_f32(&inf, o(2.0)).expect("a norm"), f32::INFINITY);
        assert_eq!(vector_norm_f32(&inf, o(f64::NEG_INFINITY)).expect("a norm"), 1.0);
        // A zero element makes a negative order's sum infinite and its norm 0.
        assert_eq!(vector_norm_f32(&[0.0, 2.0], o(-1.0)).expect("a norm"), 0.0);
        // A NaN in a later chunk than the largest magnitude still wins.
        let mut big = vec![0.5f32; 3 * CHUNK];
        big[7] = 9.0;
        big[2 * CHUNK + 5] = f32::NAN;
        assert!(vector_norm_f32(&big, o(f64::INFINITY)).expect("a norm").is_nan());
        big[2 * CHUNK + 5] = 0.25;
        assert_eq!(vector_norm_f32(&big, o(f64::INFINITY)).expect("a norm"), 9.0);
        assert_eq!(vector_norm_f32(&big, o(f64::NEG_INFINITY)).expect("a norm"), 0.25);
        // Empty: 0 for the sums, refused for the extremes; NaN is not an order.
        assert_eq!(vector_norm_f32(&[], o(2.0)).expect("a norm"), 0.0);
        assert!(vector_norm_f32(&[], o(f64::INFINITY)).is_err());
        assert!(vector_norm_f32(&[], o(-1.0)).is_err());
        assert_eq!(vector_norm_f32(&[], o(0.5)).expect("a norm"), 0.0);
        // One element: its magnitude, where the power would overflow or underflow.
        assert_eq!(vector_norm_f32(&[-1e20], o(2.0)).expect("a norm"), 1e20);
        assert_eq!(vector_norm_f32(&[1e-20], o(3.0)).expect("a norm"), 1e-20);
        assert_eq!(vector_norm_f64(&[-1e300], o(-2.5)).expect("a norm"), 1e300);
        assert_eq!(vector_norm_f32(&[-3.0], o(0.0)).expect("a norm"), 1.0);
        assert!(vector_norm_f32(&[f32::NAN], o(2.0)).expect("a norm").is_nan());
        assert!(NormOrd::new(f64::NAN).is_err());
        assert_eq!(o(-3.5).value(), -3.5);
        // Squares are added unfused, as PyTorch's loop adds them: 16 lanes, then pairwise.
        let x: Vec<f32> =
            (0..40).map(|i| if i == 0 { 1e4 } else { 1.0 + i as f32 * 1e-3 }).collect();
        let mut lanes = [0f32; 16];
        for (i, &v) in x.iter().enumerate() {
            lanes[i % 16] += v * v;
        }
        for w in [8, 4, 2, 1] {
            for l in 0..w {
                lanes[l] += lanes[l + w];
            }
        }
        assert_eq!(vector_norm_f32(&x, o(2.0)).expect("a norm"), lanes[0].sqrt());
    }
}
