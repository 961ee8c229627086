//! The gradient of a learned additive mask (a relative-position bias, as in T5 or Swin) on the
//! fused path.
//!
//! The flash op takes three differentiable inputs (q, k, v); the mask is a fourth. It enters
//! the op's forward as data and joins candle's graph through [`MaskGrad`], an identity on the
//! attention output. Its backward runs before the flash op's (it is nearer the loss): it runs
//! the whole fused backward once, with the scores' gradient (`flash_backward_dscores`), keeps
//! dq, dk and dv for the flash op's backward to hand out, passes the output's gradient through,
//! and gives the mask the scores' gradient summed over the dimensions it broadcasts.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use multihead_kernels::attention::flash_backward_dscores;

use super::flash::{contiguous_layout4, f32s, FlashAttention};
use crate::error::Result;

/// The gradients of q, k and v computed by [`MaskGrad`]'s backward, for the flash op's.
pub(crate) type Stash = Arc<Mutex<Option<[Tensor; 3]>>>;

/// Identity on `(out, mask) -> out`; its backward computes every gradient of the attention.
struct MaskGrad {
    op: FlashAttention,
    qkv: [Tensor; 3],
}

impl CustomOp2 for MaskGrad {
    fn name(&self) -> &'static str {
        "attention-mask-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        super::flash::identity_copy(s1, l1, "attention output")
    }

    fn bwd(
        &self,
        out: &Tensor,
        mask: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let [q, k, v] = &self.qkv;
        let conv = self.op.conv;
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (q_off, q4) = conv.layout4(ql)?;
        let (k_off, k4) = conv.layout4(kl)?;
        let (v_off, v4) = conv.layout4(vl)?;
        let mut dq = crate::alloc::try_zeros::<f32>(q.elem_count(), "flash attention dq")?;
        let mut dk = crate::alloc::try_zeros::<f32>(k.elem_count(), "flash attention dk")?;
        let mut dv = crate::alloc::try_zeros::<f32>(v.elem_count(), "flash attention dv")?;
        let d = self.op.dims;
        let full = [d.batch, d.heads_q, d.l, d.s];
        let n = crate::alloc::elements("scaled_dot_product_attention", "mask gradient", &full)?;
        let mut ds = crate::alloc::try_zeros::<f32>(n, "attention mask gradient")?;
        let (dq4, dk4, dv4) = (
            contiguous_layout4(conv, q.dims())?,
            contiguous_layout4(conv, k.dims())?,
            contiguous_layout4(conv, v.dims())?,
        );
        let (qv, kv, vv) = (&f32s(&qs)?[q_off..], &f32s(&ks)?[k_off..], &f32s(&vs)?[v_off..]);
        self.op.with_saved(out, grad_res, |p, (o, o4), (g, g4), lse| {
            flash_backward_dscores(
                p, qv, q4, kv, k4, vv, v4, o, o4, g, g4, lse, &mut dq, dq4, &mut dk, dk4, &mut dv,
                dv4, &mut ds,
            )
        })?;
        let dev = q.device();
        let grads = [
            Tensor::from_vec(dq, q.shape(), dev)?,
            Tensor::from_vec(dk, k.shape(), dev)?,
            Tensor::from_vec(dv, v.shape(), dev)?,
        ];
        *self.op.grads.lock().unwrap_or_else(|e| e.into_inner()) = Some(grads);
        let dmask = reduce_to(Tensor::from_vec(ds, full.as_slice(), dev)?, mask.dims())?;
        Ok((Some(grad_res.clone()), Some(dmask)))
    }
}

/// `g` `(N, H, L, S)` summed over the dimensions a mask of shape `dims` (rank at most 4,
/// broadcastable) repeats, in that shape.
fn reduce_to(mut g: Tensor, dims: &[usize]) -> candle_core::Result<Tensor> {
    let lead = g.rank() - dims.len();
    for axis in 0..g.rank() {
        let want = if axis < lead { 1 } else { dims[axis - lead] };
        if want == 1 && g.dim(axis)? != 1 {
            g = g.sum_keepdim(axis)?;
        }
    }
    g.reshape(dims)
}

/// `out` (the result of `op` on `q`, `k`, `v`, which ran with `mask` as its only mask) joined
/// to the graph of `mask`.
pub(crate) fn attach(
    op: &FlashAttention,
    out: &Tensor,
    mask: &Tensor,
    qkv: [&Tensor; 3],
) -> Result<Tensor> {
    let g = MaskGrad { op: op.clone(), qkv: qkv.map(Tensor::clone) };
    Ok(out.apply_op2_arc(mask, Arc::new(Box::new(g)))?)
}
