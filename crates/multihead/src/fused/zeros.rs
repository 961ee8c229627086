//! Zeros that stay in the autograd graph: the result of a call with nothing to compute (an
//! empty batch, query or key set) is zeros, and its inputs and parameters must still get
//! (zero) gradients, as in PyTorch, where the empty computation is part of the graph. A fresh
//! `Tensor::zeros` has no graph, so `backward` gave those inputs no gradient at all.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

use crate::error::Result;

/// Zeros of `shape` and `dtype` whose backward gives each of its three inputs a zero gradient.
struct ZerosOf {
    shape: Shape,
    dtype: DType,
}

impl CustomOp3 for ZerosOf {
    fn name(&self) -> &'static str {
        "zeros-of"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let n = self.shape.elem_count();
        let s = match self.dtype {
            DType::F32 => CpuStorage::F32(crate::alloc::try_zeros(n, "zeros")?),
            DType::F64 => CpuStorage::F64(crate::alloc::try_zeros(n, "zeros")?),
            DType::BF16 => CpuStorage::BF16(crate::alloc::try_zeros(n, "zeros")?),
            DType::F16 => CpuStorage::F16(crate::alloc::try_zeros(n, "zeros")?),
            other => candle_core::bail!("zeros: unsupported dtype {other:?}"),
        };
        Ok((s, self.shape.clone()))
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        _grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(a.zeros_like()?), Some(b.zeros_like()?), Some(c.zeros_like()?)))
    }
}

/// Zeros of `dims` in `dtype`, connected to every tensor of `inputs` (each gets a zero
/// gradient); plain zeros without a graph (`no_grad`, or no inputs).
pub(crate) fn zeros_of(dims: &[usize], dtype: DType, inputs: &[&Tensor]) -> Result<Tensor> {
    if !crate::mode::grad_enabled() || inputs.is_empty() {
        let dev = inputs.first().map_or(candle_core::Device::Cpu, |t| t.device().clone());
        return Ok(Tensor::zeros(dims, dtype, &dev)?);
    }
    let op = || ZerosOf { shape: Shape::from_dims(dims), dtype };
    // Three inputs per op; each next op takes the zeros so far as its first input rather than
    // being added to them (candle's add of two empty tensors passes no gradient to its
    // right-hand side). A missing third input repeats the second: a second zero gradient
    // changes nothing.
    let (first, rest) = inputs.split_at(inputs.len().min(3));
    let pick = |i: usize| first[i.min(first.len() - 1)];
    let mut out = pick(0).apply_op3(pick(1), pick(2), op())?;
    for pair in rest.chunks(2) {
        out = out.apply_op3(pair[0], pair[pair.len() - 1], op())?;
    }
    Ok(out)
}

/// A broadcast sum `x + y` (masks merged by addition); when the sum is empty, its zeros
/// connected to both (candle's add of empty tensors gives its right-hand side no gradient).
pub(crate) fn broadcast_sum(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let sum = x.broadcast_add(y)?;
    if sum.elem_count() == 0 {
        return zeros_of(sum.dims(), sum.dtype(), &[x, y]);
    }
    Ok(sum)
}

/// A residual sum `x + y`; for empty tensors the sum's zeros connected to both (candle's add
/// of two empty tensors gives its right-hand side no gradient).
pub(crate) fn residual(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    if x.elem_count() == 0 {
        return zeros_of(x.dims(), x.dtype(), &[x, y]);
    }
    Ok(super::add::add(x, y)?)
}
