//! Reduced-precision floats (bf16, f16) compute in f32 inside each operation and are rounded
//! back at its output, as PyTorch's CPU kernels accumulate them in float. The f32 computation is
//! the f32 path itself (the fused kernels on the CPU), so a bf16 call runs what an f32 call runs,
//! plus the conversions; gradients flow back through them to the reduced-precision tensors.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::mask::Mask;

/// Whether `dtype` is computed in f32 and rounded back (bf16 and f16).
pub(crate) fn is_reduced(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `t` in f32 (differentiably).
pub(crate) fn widen(t: &Tensor) -> Result<Tensor> {
    Ok(crate::fused::convert::to_dtype(t, DType::F32)?)
}

/// An f32 result back in the reduced dtype `dtype` (differentiably).
pub(crate) fn narrow(t: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(crate::fused::convert::to_dtype(t, dtype)?)
}

/// An optional tensor in f32.
pub(crate) fn widen_opt(t: Option<&Tensor>) -> Result<Option<Tensor>> {
    t.map(widen).transpose()
}

/// A float mask of a reduced dtype in f32; bool masks and f32 masks as they are.
pub(crate) fn widen_mask(m: Option<&Mask>) -> Result<Option<Mask>> {
    Ok(match m {
        Some(Mask::Float(t)) if is_reduced(t.dtype()) => Some(Mask::Float(widen(t)?)),
        other => other.cloned(),
    })
}

/// Whether every float mask given has `dtype` (PyTorch's rule: a float mask has the query's
/// dtype). A layer widens its call only then; otherwise the call goes the unwidened way, whose
/// checks report the mismatch.
pub(crate) fn masks_match(masks: &[Option<&Mask>], dtype: DType) -> bool {
    masks.iter().all(|m| match m {
        Some(Mask::Float(t)) => t.dtype() == dtype,
        _ => true,
    })
}

/// A module whose parameters can be widened to f32 (differentiably): a bf16/f16 layer runs as
/// its f32 twin between one widening of its inputs and one rounding of its output.
pub(crate) trait Widen: Sized {
    /// The same module with f32 parameters.
    fn widened(&self) -> Result<Self>;
}
