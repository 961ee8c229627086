//! The sum of every element in f32 as a candle op (`multihead_kernels::sum`), whose backward
//! writes the gradient out whole: candle's `sum_all` sums on one thread, and its backward
//! broadcasts the scalar gradient, which candle's gradient store then adds into zeros (a memset
//! and an add over the summed tensor).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use half::bf16;

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
            DType::F32 => Tensor::from_vec(filled(n, g)?, arg.shape(), arg.device())?,
            DType::BF16 => {
                Tensor::from_vec(filled(n, bf16::from_f32(g))?, arg.shape(), arg.device())?
            }
            dt => candle_core::bail!("sum_f32: no gradient for a {dt:?} input"),
        };
        Ok(Some(out))
    }
}

/// `n` copies of `v` in a new vector, filled in parallel (the allocation checked).
fn filled<T: Copy + Send + Sync>(n: usize, v: T) -> candle_core::Result<Vec<T>> {
    use rayon::prelude::*;
    let write = |d: &mut [std::mem::MaybeUninit<T>]| {
        d.par_chunks_mut(1 << 16)
            .for_each(|c| c.iter_mut().for_each(|x| *x = std::mem::MaybeUninit::new(v)));
        Ok(())
    };
    // SAFETY: `write` initialises every element of its slice.
    unsafe { crate::alloc::try_written(n, "sum_f32 gradient", write) }
}
