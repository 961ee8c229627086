//! Tolerances for comparing with PyTorch, as a type.

use candle_core::{DType, Tensor};

use multihead::Result;

/// An elementwise tolerance: `actual` is close to `expected` when
/// `|actual - expected| <= abs + rel * |expected|`, or both are NaN, or both are the same
/// infinity (`torch.isclose(actual, expected, rtol=rel, atol=abs, equal_nan=True)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Relative tolerance (`rtol`).
    pub rel: f64,
    /// Absolute tolerance (`atol`).
    pub abs: f64,
}

impl Tolerance {
    /// f32 forward values: rtol 1e-5, atol 1e-5.
    pub const F32_FORWARD: Tolerance = Tolerance { rel: 1e-5, abs: 1e-5 };
    /// f32 gradients: rtol 1e-4, atol 1e-4.
    pub const F32_GRAD: Tolerance = Tolerance { rel: 1e-4, abs: 1e-4 };
    /// f64 forward values and gradients: rtol 1e-10, atol 1e-10.
    pub const F64: Tolerance = Tolerance { rel: 1e-10, abs: 1e-10 };
    /// bf16 forward values without a float64 reference: rtol 2e-2, atol 2e-2.
    pub const BF16_FORWARD: Tolerance = Tolerance { rel: 2e-2, abs: 2e-2 };
    /// bf16 gradients without a float64 reference: rtol 5e-2, atol 5e-2.
    pub const BF16_GRAD: Tolerance = Tolerance { rel: 5e-2, abs: 5e-2 };

    /// The project's default for a dtype: forward or gradient.
    pub fn for_dtype(dtype: DType, grad: bool) -> Tolerance {
        match (dtype, grad) {
            (DType::F64, _) => Self::F64,
            (DType::BF16, false) => Self::BF16_FORWARD,
            (DType::BF16, true) => Self::BF16_GRAD,
            (_, false) => Self::F32_FORWARD,
            (_, true) => Self::F32_GRAD,
        }
    }

    /// Whether two scalars are close.
    pub fn close(&self, actual: f64, expected: f64) -> bool {
        if actual.is_nan() || expected.is_nan() {
            return actual.is_nan() && expected.is_nan();
        }
        if actual.is_infinite() || expected.is_infinite() {
            return actual == expected;
        }
        (actual - expected).abs() <= self.abs + self.rel * expected.abs()
    }

    /// Compares two tensors elementwise. Returns the worst excess ratio
    /// `|a - e| / (abs + rel |e|)` (at most 1 means close; infinity for a shape mismatch or a
    /// NaN/infinity mismatch) and the largest absolute difference.
    pub fn compare(&self, actual: &Tensor, expected: &Tensor) -> Result<Comparison> {
        if actual.dims() != expected.dims() {
            return Ok(Comparison {
                worst_ratio: f64::INFINITY,
                max_abs: f64::INFINITY,
                shape_mismatch: true,
                special: None,
            });
        }
        let a = actual.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let e = expected.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let mut worst = 0f64;
        let mut max_abs = 0f64;
        let mut special = None;
        for (i, (&x, &y)) in a.iter().zip(&e).enumerate() {
            let both_finite = x.is_finite() && y.is_finite();
            if !both_finite && !self.close(x, y) {
                worst = f64::INFINITY;
                max_abs = f64::INFINITY;
                special = special.or(Some((i, x, y)));
                continue;
            }
            if x.is_finite() && y.is_finite() {
                let d = (x - y).abs();
                max_abs = max_abs.max(d);
                worst = worst.max(d / (self.abs + self.rel * y.abs()));
            }
        }
        Ok(Comparison { worst_ratio: worst, max_abs, shape_mismatch: false, special })
    }
}

/// The result of [`Tolerance::compare`].
#[derive(Clone, Copy, Debug)]
pub struct Comparison {
    /// The worst `|a - e| / (abs + rel |e|)`; the tensors are close when it is at most 1.
    pub worst_ratio: f64,
    /// The largest absolute difference over finite pairs.
    pub max_abs: f64,
    /// The shapes differ.
    pub shape_mismatch: bool,
    /// The first element where NaN or an infinity stands on one side only (or where the
    /// reference has it, for the bfloat16 rule): its flat index, ours, the other side's.
    pub special: Option<(usize, f64, f64)>,
}

impl Comparison {
    /// Whether every element is within tolerance.
    pub fn passed(&self) -> bool {
        !self.shape_mismatch && self.worst_ratio <= 1.0
    }
}

/// The rule of a bfloat16 case (docs/case-format.md §6): our error against the float64
/// reference is at most `factor` times PyTorch bfloat16's own error against it, compared as the
/// largest absolute difference over the tensor. Non-finite values must sit where the reference
/// has the same ones. A PyTorch error of zero (an exactly representable result) allows an error
/// of at most one bfloat16 rounding of the reference's largest magnitude (2^-8 of it).
pub fn compare_to_reference(
    ours: &Tensor,
    pytorch: &Tensor,
    reference: &Tensor,
    factor: f64,
) -> Result<Comparison> {
    if ours.dims() != reference.dims() || pytorch.dims() != reference.dims() {
        return Ok(Comparison {
            worst_ratio: f64::INFINITY,
            max_abs: f64::INFINITY,
            shape_mismatch: true,
            special: None,
        });
    }
    let flat = |t: &Tensor| -> Result<Vec<f64>> {
        Ok(t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?)
    };
    let (a, p, r) = (flat(ours)?, flat(pytorch)?, flat(reference)?);
    let same_kind = |x: f64, y: f64| (x.is_nan() && y.is_nan()) || x == y;
    let (mut err_ours, mut err_torch, mut scale) = (0f64, 0f64, 0f64);
    let special = |i: usize, x: f64, z: f64| Comparison {
        worst_ratio: f64::INFINITY,
        max_abs: f64::INFINITY,
        shape_mismatch: false,
        special: Some((i, x, z)),
    };
    for (i, ((&x, &y), &z)) in a.iter().zip(&p).zip(&r).enumerate() {
        if !z.is_finite() {
            if !same_kind(x, z) {
                return Ok(special(i, x, z));
            }
            continue;
        }
        if !x.is_finite() {
            return Ok(special(i, x, z));
        }
        err_ours = err_ours.max((x - z).abs());
        if y.is_finite() {
            err_torch = err_torch.max((y - z).abs());
        }
        scale = scale.max(z.abs());
    }
    let allowed = (factor * err_torch).max(scale * 2f64.powi(-8));
    let worst_ratio = if allowed > 0.0 {
        err_ours / allowed
    } else if err_ours == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    Ok(Comparison { worst_ratio, max_abs: err_ours, shape_mismatch: false, special: None })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use candle_core::Device;

    fn t(v: &[f64]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    #[test]
    fn the_reference_rule_allows_twice_pytorchs_error_and_no_more() {
        let reference = t(&[1.0, -2.0, 0.5]);
        let pytorch = t(&[1.01, -2.0, 0.5]); // error 0.01
        let ok = compare_to_reference(&t(&[1.0, -1.98, 0.5]), &pytorch, &reference, 2.0).unwrap();
        assert!(ok.passed() && (ok.worst_ratio - 1.0).abs() < 1e-9, "{ok:?}");
        let bad = compare_to_reference(&t(&[1.0, -1.97, 0.5]), &pytorch, &reference, 2.0).unwrap();
        assert!(!bad.passed() && (bad.worst_ratio - 1.5).abs() < 1e-9, "{bad:?}");
        // PyTorch exact: one bf16 rounding of the largest magnitude (2 * 2^-8) is allowed.
        let exact =
            compare_to_reference(&t(&[1.0, -2.0078, 0.5]), &reference, &reference, 2.0).unwrap();
        assert!(exact.passed(), "{exact:?}");
        // A NaN where the reference is finite fails; a NaN matching the reference passes.
        let nan =
            compare_to_reference(&t(&[f64::NAN, -2.0, 0.5]), &pytorch, &reference, 2.0).unwrap();
        assert!(!nan.passed());
        assert!(matches!(nan.special, Some((0, x, z)) if x.is_nan() && z == 1.0), "{nan:?}");
        let inf = Tolerance::F64.compare(&t(&[1.0, f64::INFINITY]), &t(&[1.0, 2.0])).unwrap();
        assert_eq!(inf.special, Some((1, f64::INFINITY, 2.0)));
        let r_nan = t(&[f64::NAN, -2.0, 0.5]);
        let both = compare_to_reference(&r_nan, &r_nan, &r_nan, 2.0).unwrap();
        assert!(both.passed());
    }
}
