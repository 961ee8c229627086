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

    /// The project's default for a dtype: forward or gradient.
    pub fn for_dtype(dtype: DType, grad: bool) -> Tolerance {
        match (dtype, grad) {
            (DType::F64, _) => Self::F64,
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
            });
        }
        let a = actual.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let e = expected.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
        let mut worst = 0f64;
        let mut max_abs = 0f64;
        for (&x, &y) in a.iter().zip(&e) {
            let both_finite = x.is_finite() && y.is_finite();
            if !both_finite && !self.close(x, y) {
                worst = f64::INFINITY;
                max_abs = f64::INFINITY;
                continue;
            }
            if x.is_finite() && y.is_finite() {
                let d = (x - y).abs();
                max_abs = max_abs.max(d);
                worst = worst.max(d / (self.abs + self.rel * y.abs()));
            }
        }
        Ok(Comparison { worst_ratio: worst, max_abs, shape_mismatch: false })
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
}

impl Comparison {
    /// Whether every element is within tolerance.
    pub fn passed(&self) -> bool {
        !self.shape_mismatch && self.worst_ratio <= 1.0
    }
}
