//! Exact-form GELU as one candle op on f32 CPU tensors, over `multihead_kernels::activation`
//! (vectorised, parallel), with its backward: one pass instead of the composed form's five.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use multihead_kernels::activation::{gelu_backward, gelu_forward};

use crate::error::Result;

struct Gelu;

fn contiguous<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let v = super::cpu_f32(s, "fused gelu")?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("fused gelu: the input must be contiguous"),
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s, l)?;
        let mut y = crate::alloc::try_zeros::<f32>(x.len(), "fused gelu output")?;
        gelu_forward(x, &mut y).map_err(|e| candle_core::Error::Msg(format!("fused gelu: {e}")))?;
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (x, grad) = (x.contiguous()?, grad.contiguous()?);
        let (xs, xl) = x.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let (xv, gv) = match (&*xs, &*gs) {
            (candle_core::Storage::Cpu(a), candle_core::Storage::Cpu(b)) => {
                (contiguous(a, xl)?, contiguous(b, gl)?)
            }
            _ => candle_core::bail!("fused gelu: expected CPU tensors"),
        };
        let mut dx = crate::alloc::try_zeros::<f32>(xv.len(), "fused gelu dx")?;
        gelu_backward(xv, gv, &mut dx)
            .map_err(|e| candle_core::Error::Msg(format!("fused gelu backward: {e}")))?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// `F.gelu(x)` (erf form) as one op; `x` is made contiguous first.
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(Gelu)?)
}
