//! Exact-form GELU and ReLU as one candle op each on f32 CPU tensors, over
//! `multihead_kernels::activation` (vectorised, parallel), with their backward: one pass
//! instead of the composed forms' several.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use multihead_kernels::activation::{
    gelu_backward_uninit, gelu_forward_uninit, relu_backward_uninit, relu_forward_uninit,
};

use crate::error::Result;

struct Gelu;

fn contiguous<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    let v = super::cpu_f32(s, op)?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{op}: the input must be contiguous"),
    }
}

/// The data of two contiguous CPU tensors.
fn pair<'a>(
    a: &'a candle_core::Storage,
    al: &Layout,
    b: &'a candle_core::Storage,
    bl: &Layout,
    op: &str,
) -> candle_core::Result<(&'a [f32], &'a [f32])> {
    match (a, b) {
        (candle_core::Storage::Cpu(a), candle_core::Storage::Cpu(b)) => {
            Ok((contiguous(a, al, op)?, contiguous(b, bl, op)?))
        }
        _ => candle_core::bail!("{op}: expected CPU tensors"),
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s, l, "fused gelu")?;
        let write = |y: &mut [std::mem::MaybeUninit<f32>]| {
            gelu_forward_uninit(x, y)
                .map_err(|e| candle_core::Error::Msg(format!("fused gelu: {e}")))
        };
        // SAFETY: on `Ok`, `gelu_forward_uninit` wrote every element of `y`.
        let y = unsafe { crate::alloc::try_written(x.len(), "fused gelu output", write) }?;
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (x, grad) = (x.contiguous()?, grad.contiguous()?);
        let (xs, xl) = x.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let (xv, gv) = pair(&xs, xl, &gs, gl, "fused gelu")?;
        let write = |dx: &mut [std::mem::MaybeUninit<f32>]| {
            gelu_backward_uninit(xv, gv, dx)
                .map_err(|e| candle_core::Error::Msg(format!("fused gelu backward: {e}")))
        };
        // SAFETY: on `Ok`, `gelu_backward_uninit` wrote every element of `dx`.
        let dx = unsafe { crate::alloc::try_written(xv.len(), "fused gelu dx", write) }?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

/// `F.gelu(x)` (erf form) as one op; `x` is made contiguous first.
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(Gelu)?)
}

struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "fused-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s, l, "fused relu")?;
        let write = |y: &mut [std::mem::MaybeUninit<f32>]| {
            relu_forward_uninit(x, y)
                .map_err(|e| candle_core::Error::Msg(format!("fused relu: {e}")))
        };
        // SAFETY: on `Ok`, `relu_forward_uninit` wrote every element of `y`.
        let y = unsafe { crate::alloc::try_written(x.len(), "fused relu output", write) }?;
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    /// PyTorch's `threshold_backward(grad, result, 0)`: the gradient is selected by the
    /// output, so it reads `res`, not the input.
    fn bwd(&self, _x: &Tensor, res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(relu_grad(res, grad)?))
    }
}

/// The gradient through `y = relu(·)` given `y`: `grad` where `y > 0` or NaN, 0 elsewhere.
pub(crate) fn relu_grad(y: &Tensor, grad: &Tensor) -> candle_core::Result<Tensor> {
    let (y, grad) = (y.contiguous()?, grad.contiguous()?);
    let (ys, yl) = y.storage_and_layout();
    let (gs, gl) = grad.storage_and_layout();
    let (yv, gv) = pair(&ys, yl, &gs, gl, "fused relu")?;
    let write = |dx: &mut [std::mem::MaybeUninit<f32>]| {
        relu_backward_uninit(yv, gv, dx)
            .map_err(|e| candle_core::Error::Msg(format!("fused relu backward: {e}")))
    };
    // SAFETY: on `Ok`, `relu_backward_uninit` wrote every element of `dx`.
    let dx = unsafe { crate::alloc::try_written(yv.len(), "fused relu dx", write) }?;
    Tensor::from_vec(dx, y.shape(), y.device())
}

/// `F.relu(x)` as one op; `x` is made contiguous first.
pub(crate) fn relu(x: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(Relu)?)
}
