//! The residual sum `x + y` of two f32 CPU tensors as one op on rayon: candle's own add runs on
//! candle's thread pool, whose worker then spins beside rayon's threads for a while after
//! each call (on two cores: half of a pre-norm ViT block's time at batch 64, sequence 17).

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rayon::prelude::*;

/// Elements below which the sum runs on the calling thread (waking the pool costs more).
const PARALLEL_FROM: usize = 1 << 18;
/// Elements per parallel task.
const CHUNK: usize = 1 << 15;

/// `x + y`, same shape, both f32 and contiguous.
struct Add;

/// A chunk of the output and the matching chunks of `x` and `y`.
type Chunks<'a> = (&'a mut [MaybeUninit<f32>], (&'a [f32], &'a [f32]));

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "residual-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("residual add: expected contiguous tensors");
        };
        let (a, b) = (super::cpu_f32(s1, "residual add")?, super::cpu_f32(s2, "residual add")?);
        let (Some(a), Some(b)) = (a.get(a0..a1), b.get(b0..b1)) else {
            candle_core::bail!("residual add: a layout does not fit its storage");
        };
        if a.len() != b.len() || l1.dims() != l2.dims() {
            candle_core::bail!("residual add: shapes {:?} and {:?} differ", l1.dims(), l2.dims());
        }
        let add = |(o, (x, y)): Chunks<'_>| {
            for ((o, x), y) in o.iter_mut().zip(x).zip(y) {
                o.write(x + y);
            }
        };
        // Every element is written (the chunks of `out`, `a` and `b` line up, and `a` and `b`
        // have `out`'s length), so the buffer is not zeroed first.
        let write = |out: &mut [MaybeUninit<f32>]| {
            if a.len() < PARALLEL_FROM {
                add((out, (a, b)));
            } else {
                out.par_chunks_mut(CHUNK)
                    .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
                    .for_each(add);
            }
            Ok(())
        };
        // SAFETY: `write` initialises all `a.len()` elements (above).
        let out = unsafe { crate::alloc::try_written(a.len(), "residual add", write) }?;
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone())))
    }
}

/// `x + y` on the op above where both are contiguous f32 CPU tensors of one shape, candle's add
/// otherwise. The same bits either way (one f32 addition per element).
pub(crate) fn add(x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
    let fits = |t: &Tensor| {
        t.dtype() == candle_core::DType::F32 && t.device().is_cpu() && t.is_contiguous()
    };
    if fits(x) && fits(y) && x.dims() == y.dims() {
        x.apply_op2(y, Add)
    } else {
        x + y
    }
}
