//! The gradient of attention sinks on the fused path.
//!
//! The flash op takes three differentiable inputs (q, k, v); the sinks are a fourth. They
//! enter its forward as data (folded into each row's statistics, so its backward is already
//! right for q, k and v) and join candle's graph through [`SinkGrad`], an identity on the
//! attention output whose backward passes the output's gradient through and gives the sinks
//! theirs: `dsink_h = −Σ P_sink · rowsum(dO ∘ O)` (the kernels' `sink_grad`).

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use multihead_kernels::attention::sink_grad;

use super::flash::FlashAttention;
use crate::error::Result;

/// Identity on `(out, sinks) -> out` whose backward computes the sinks' gradient from the
/// flash op's saved statistics.
struct SinkGrad {
    op: FlashAttention,
}

impl CustomOp2 for SinkGrad {
    fn name(&self) -> &'static str {
        "attention-sinks"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        super::flash::identity_copy(s1, l1, "attention sinks output")
    }

    fn bwd(
        &self,
        out: &Tensor,
        sinks: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let h = self.op.dims.heads_q;
        let mut ds = crate::alloc::try_zeros::<f32>(h, "attention sinks gradient")?;
        self.op.with_saved(out, grad_res, |p, (o, ol), (g, gl), lse| {
            sink_grad(p, o, ol, g, gl, lse, &mut ds)
        })?;
        let ds = Tensor::from_vec(ds, sinks.shape(), sinks.device())?;
        Ok((Some(grad_res.clone()), Some(ds)))
    }
}

/// `out` (the result of `op`, which ran with sinks) joined to the graph of `sinks`.
pub(crate) fn attach(op: &FlashAttention, out: &Tensor, sinks: &Tensor) -> Result<Tensor> {
    let g = SinkGrad { op: op.clone() };
    Ok(out.apply_op2_arc(sinks, std::sync::Arc::new(Box::new(g)))?)
}
