//! Reduced-precision floats (bf16, f16) compute in f32 inside each operation and are rounded
//! back at its output, as PyTorch's CPU kernels accumulate them in float. The f32 computation is
//! the f32 path itself (the fused kernels on the CPU), so a bf16 call runs what an f32 call runs,
//! plus the conversions; gradients flow back through them to the reduced-precision tensors.

use candle_core::{DType, Tensor};

use crate::error::Result;

/// Whether `dtype` is computed in f32 and rounded back (bf16 and f16).
pub(crate) fn is_reduced(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `t` in f32 (differentiably).
pub(crate) fn widen(t: &Tensor) -> Result<Tensor> {
    Ok(t.to_dtype(DType::F32)?)
}

/// An optional tensor in f32.
pub(crate) fn widen_opt(t: Option<&Tensor>) -> Result<Option<Tensor>> {
    t.map(widen).transpose()
}
