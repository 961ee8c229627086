//! The sum of every element in f32 as a candle op (`multihead_kernels::sum`), whose backward
//! writes the gradient out whole: candle's `sum_all` sums on one thread, and its backward
//! broadcasts the scalar gradient, which candle's gradient store then adds into zeros (a memset
//! and an add over the summed tensor).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use half::bf16;

use crate::alloc::try_filled;

/// What the gradient's allocation is called in its error.
const WHAT: &str = "sum_f32 gradient";

/// `sum(x)` accumulated in f32, for an f32 or bf16 `x`.
pub(crate) struct SumF32;

impl CustomOp1 for SumF32 {
    fn name(&self) -> &'static str {
        "sum_f32"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("sum_f32: expected a contiguous tensor")
        };
        let sum = match s {
            CpuStorage::F32(v) => multihead_kernels::sum::sum_f32(&v[a..b]),
            CpuStorage::BF16(v) => multihead_kernels::sum::sum_bf16(super::convert::bits(&v[a..b])),
            _ => candle_core::bail!("sum_f32: expected an f32 or bf16 tensor"),
        };
        Ok((CpuStorage::F32(vec![sum]), Shape::from(())))
    }

    /// Every element's gradient is the sum's, in the input's dtype (bf16 rounded to nearest
    /// even), written as one contiguous tensor.
    fn bwd(
        &self,
        arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let &[g] = g.as_slice() else {
            candle_core::bail!("sum_f32: the gradient of a sum must be one value")
        };
        let n = arg.elem_count();
        let out = match arg.dtype() {
            DType::F32 => Tensor::from_vec(try_filled(n, g, WHAT)?, arg.shape(), arg.device())?,
            DType::BF16 => {
                let v = try_filled(n, bf16::from_f32(g), WHAT)?;
                Tensor::from_vec(v, arg.shape(), arg.device())?
            }
            dt => candle_core::bail!("sum_f32: no gradient for a {dt:?} input"),
        };
        Ok(Some(out))
    }
}
