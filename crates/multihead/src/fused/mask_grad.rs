//! The gradient of a learned additive mask (a relative-position bias, as in T5 or Swin) on the
//! fused path.
//!
//! The flash op takes its differentiable inputs (q, k and v, or the packed projections that
//! hold them); the mask is one more. It enters the op's forward as data and joins candle's
//! graph through [`MaskGrad`], an identity on the attention output. Its backward runs before
//! the flash op's (it is nearer the loss): it runs the whole fused backward once, with the
//! scores' gradient, keeps the inputs' gradients (in the form the op's own backward returns
//! them, packed or not) for the flash op's backward to hand out, passes the output's gradient
//! through, and gives the mask the scores' gradient summed over the dimensions it broadcasts.
//!
//! The stash belongs to the forward call: two backward passes through one graph run one after
//! the other (as candle runs them on one thread); running them at once from two threads could
//! hand one pass the other's input gradients.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::flash::FlashAttention;
use crate::error::Result;

/// The input gradients computed by [`MaskGrad`]'s backward, for the flash op's: `[dq, dk, dv]`,
/// `[dqkv]` or `[dq, dkv]` as [`Inputs`] says.
pub(crate) type Stash = Arc<Mutex<Option<Vec<Tensor>>>>;

/// The differentiable inputs the flash op was applied to.
pub(crate) enum Inputs {
    /// `apply(q, k, v)`.
    Unpacked([Tensor; 3]),
    /// `apply_packed(qkv)`: one `(L, N, 3E)` self-attention projection.
    Qkv(Tensor),
    /// `apply_packed_kv(q, kv)`: a query and one `(S, N, 2E)` key/value projection.
    Kv(Tensor, Tensor),
}

impl Inputs {
    /// Whether an input is in candle's graph (so the flash op's backward will run).
    fn any_tracked(&self) -> bool {
        match self {
            Inputs::Unpacked(ts) => ts.iter().any(Tensor::track_op),
            Inputs::Qkv(t) => t.track_op(),
            Inputs::Kv(q, kv) => q.track_op() || kv.track_op(),
        }
    }
}

/// Identity on `(out, mask) -> out`; its backward computes every gradient of the attention.
struct MaskGrad {
    op: FlashAttention,
    inputs: Inputs,
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
        let d = self.op.dims;
        let full = [d.batch, d.heads_q, d.l, d.s];
        let n = crate::alloc::elements("flash attention backward", "mask gradient", &full)?;
        let mut ds = crate::alloc::try_zeros::<f32>(n, "attention mask gradient")?;
        let (op, g, ds_out) = (&self.op, grad_res, Some(&mut ds[..]));
        let grads = match &self.inputs {
            Inputs::Unpacked([q, k, v]) => {
                super::flash::backward_unpacked(op, [q, k, v], out, g, ds_out)?.to_vec()
            }
            Inputs::Qkv(qkv) => {
                super::flash_packed::backward_qkv(op, qkv, out, g, ds_out)?.to_vec()
            }
            Inputs::Kv(q, kv) => {
                super::flash_packed::backward_kv(op, q, kv, out, g, ds_out)?.to_vec()
            }
        };
        // The flash op's backward takes them, if candle recorded it (an input in the graph);
        // otherwise nothing would, and they are dropped here.
        if self.inputs.any_tracked() {
            *self.op.grads.lock().unwrap_or_else(|e| e.into_inner()) = Some(grads);
        }
        let dmask = reduce_to(&ds, full, mask.dims())?;
        let dmask = Tensor::from_vec(dmask, mask.dims(), mask.device())?;
        Ok((Some(grad_res.clone()), Some(dmask)))
    }
}

/// `g` `(N, H, L, S)` summed over the dimensions a mask of shape `dims` (rank at most 4,
/// broadcastable) repeats, in that shape.
fn reduce_to(g: &[f32], full: [usize; 4], dims: &[usize]) -> candle_core::Result<Vec<f32>> {
    let Some(lead) = 4usize.checked_sub(dims.len()) else {
        candle_core::bail!(
            "attention mask gradient: a mask of shape {dims:?} (rank at most 4) for scores of \
             shape {full:?}"
        )
    };
    let to: [usize; 4] = std::array::from_fn(|i| if i < lead { 1 } else { dims[i - lead] });
    let n = to.iter().product();
    let mut out = crate::alloc::try_zeros::<f32>(n, "attention mask gradient")?;
    multihead_kernels::reduce::sum_to_broadcast(g, full, to, &mut out).map_err(|e| {
        let msg = format!("attention mask gradient of shape {dims:?} from {full:?}: {e}");
        candle_core::Error::Msg(msg)
    })?;
    Ok(out)
}

/// `out` (the result of `op` on `inputs`, which ran with `mask` among its masks) joined to the
/// graph of `mask`.
pub(crate) fn attach(
    op: &FlashAttention,
    out: &Tensor,
    mask: &Tensor,
    inputs: Inputs,
) -> Result<Tensor> {
    let g = MaskGrad { op: op.clone(), inputs };
    Ok(out.apply_op2_arc(mask, Arc::new(Box::new(g)))?)
}
