//! Exact-form GELU and ReLU as one candle op each on f32 CPU tensors, over
//! `multihead_kernels::activation` (vectorised, parallel), with their backward: one pass
//! instead of the composed forms' several.

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use multihead_kernels::activation::{gelu_backward, gelu_forward, relu_backward, relu_forward};

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
        let mut y = crate::alloc::try_zeros::<f32>(x.len(), "fused gelu output")?;
        gelu_forward(x, &mut y).map_err(|e| candle_core::Error::Msg(format!("fused gelu: {e}")))?;
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (x, grad) = (x.contiguous()?, grad.contiguous()?);
        let (xs, xl) = x.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let (xv, gv) = pair(&xs, xl, &gs, gl, "fused gelu")?;
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

struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "fused-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous(s, l, "fused relu")?;
        let mut y = crate::alloc::try_zeros::<f32>(x.len(), "fused relu output")?;
        relu_forward(x, &mut y).map_err(|e| candle_core::Error::Msg(format!("fused relu: {e}")))?;
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
    let mut dx = crate::alloc::try_zeros::<f32>(yv.len(), "fused relu dx")?;
    relu_backward(yv, gv, &mut dx)
        .map_err(|e| candle_core::Error::Msg(format!("fused relu backward: {e}")))?;
    Tensor::from_vec(dx, y.shape(), y.device())
}

/// `F.relu(x)` as one op; `x` is made contiguous first.
pub(crate) fn relu(x: &Tensor) -> Result<Tensor> {
    Ok(x.contiguous()?.apply_op1(Relu)?)
}
