//! bf16 ↔ f32 as candle ops with a backward (each one's backward is the other), over
//! `multihead_kernels::convert`. candle's own `to_dtype` converts element by element through
//! intrinsics that are not inlined in its build (measured: a third of a bf16 encoder layer's
//! training step).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use half::{bf16, slice::HalfFloatSliceExt};

/// bf16 → f32.
pub(crate) struct Widen;
/// f32 → bf16 (round to nearest even).
pub(crate) struct NarrowBf16;

/// bf16 bits as bf16 values, without a copy (what the kernels' bf16 outputs become).
pub(crate) fn from_bits(v: Vec<u16>) -> Vec<bf16> {
    use half::vec::HalfBitsVecExt;
    v.reinterpret_into()
}

/// The contiguous data of a storage under a layout, or an error naming the op.
fn contiguous<'a, T>(v: &'a [T], l: &Layout, op: &str) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: expected a contiguous tensor"),
    }
}

/// `src` widened into a new f32 vector (the allocation checked).
pub(crate) fn widen_vec(src: &[bf16], op: &str) -> candle_core::Result<Vec<f32>> {
    let write = |d: &mut [std::mem::MaybeUninit<f32>]| {
        multihead_kernels::convert::bf16_to_f32_uninit(src.reinterpret_cast(), d)
            .map_err(|e| candle_core::Error::Msg(format!("{op}: {e}")))
    };
    // SAFETY: `bf16_to_f32_uninit` writes all `src.len()` elements when it returns `Ok`.
    unsafe { crate::alloc::try_written(src.len(), op, write) }
}

/// `src` rounded (to nearest even) into a new bf16 vector (the allocation checked).
pub(crate) fn narrow_vec(src: &[f32], op: &str) -> candle_core::Result<Vec<bf16>> {
    let write = |d: &mut [std::mem::MaybeUninit<u16>]| {
        multihead_kernels::convert::f32_to_bf16_uninit(src, d)
            .map_err(|e| candle_core::Error::Msg(format!("{op}: {e}")))
    };
    // SAFETY: `f32_to_bf16_uninit` writes all `src.len()` elements when it returns `Ok`.
    let bits = unsafe { crate::alloc::try_written(src.len(), op, write) }?;
    Ok(from_bits(bits))
}

/// The f32 values of elements `a..b` of an f32 or bf16 storage: borrowed when f32, widened
/// into `buf` when bf16 (the kernels that read bf16 themselves take [`bits`] instead).
pub(crate) fn f32_values<'a>(
    s: &'a CpuStorage,
    (a, b): (usize, usize),
    buf: &'a mut Vec<f32>,
    op: &str,
) -> candle_core::Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => Ok(&v[a..b]),
        CpuStorage::BF16(v) => {
            *buf = widen_vec(&v[a..b], op)?;
            Ok(buf)
        }
        _ => candle_core::bail!("{op}: expected f32 or bf16 tensors"),
    }
}

/// bf16 values as their bits, what the kernels read.
pub(crate) fn bits(v: &[bf16]) -> &[u16] {
    v.reinterpret_cast()
}

impl CustomOp1 for Widen {
    fn name(&self) -> &'static str {
        "bf16 to f32"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::BF16(v) = s else { candle_core::bail!("{}: expected bf16", self.name()) };
        let out = widen_vec(contiguous(v, l, self.name())?, self.name())?;
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1(NarrowBf16)?))
    }
}

impl CustomOp1 for NarrowBf16 {
    fn name(&self) -> &'static str {
        "f32 to bf16"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(v) = s else { candle_core::bail!("{}: expected f32", self.name()) };
        let out = narrow_vec(contiguous(v, l, self.name())?, self.name())?;
        Ok((CpuStorage::BF16(out), l.shape().clone()))
    }
    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1(Widen)?))
    }
}

/// `t` converted to `dtype`: the fast ops between bf16 and f32 on the CPU, candle's `to_dtype`
/// otherwise; f64 to bf16 through f32, rounded twice, as PyTorch converts it (its bf16 is
/// built from a float: `-0.499023437498181` becomes -0.5 there, where one rounding of the
/// double gives -0.498046875).
pub(crate) fn to_dtype(t: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
    if (t.dtype(), dtype) == (DType::F64, DType::BF16) {
        return to_dtype(&to_dtype(t, DType::F32)?, DType::BF16);
    }
    if !t.device().is_cpu() || t.dtype() == dtype {
        return t.to_dtype(dtype);
    }
    match (t.dtype(), dtype) {
        (DType::BF16, DType::F32) => t.contiguous()?.apply_op1(Widen),
        (DType::F32, DType::BF16) => t.contiguous()?.apply_op1(NarrowBf16),
        _ => t.to_dtype(dtype),
    }
}
