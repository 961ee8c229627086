//! The gradient of the attention weights that `MultiheadAttention` returns on the fused path
//! when gradients are recorded (PyTorch's default `need_weights=True` in training).
//!
//! The weights come from the weights kernel (`FlashAttention::weights_of`, from the forward's
//! row statistics) run as the forward of [`WeightsGrad`], an op on the projected query and key
//! (so the weights are written once, into the tensor returned: no copy joins them to the
//! graph, and a call holds one `(N, ·, L, S)` buffer, not two), whose backward recomputes the
//! per-head probabilities `P` the same way and gives the projected query and key the
//! softmax's gradient: with `G` the weights' gradient per head (divided by
//! H when the weights are averaged), `dS = P ∘ (G − rowsum(G ∘ P))`, `dq = scale · dS · k` and
//! `dk = scale · dSᵀ · q` (summed over a group's query heads). The backward only runs when a
//! loss uses the weights; otherwise they cost the kernel's pass alone. Without dropout, a soft
//! cap or sinks (the caller's condition): the returned weights are then the probabilities
//! themselves, and `dS` is the softmax's own.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::flash::FlashAttention;
use crate::error::Result;

/// `(q, k) -> weights` (the kernel's, from the forward's statistics); its backward gives q and k
/// the weights' gradient.
struct WeightsGrad {
    op: FlashAttention,
    average: bool,
    /// `(heads, head size, batch_first)` of the caller's `(T, N, heads·hd)` or `(N, T, ·)`
    /// projections.
    layout: (usize, usize, bool),
}

impl CustomOp2 for WeightsGrad {
    fn name(&self) -> &'static str {
        "attention-weights-grad"
    }

    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q, k) = (super::flash::cpu_f32(qs)?, super::flash::cpu_f32(ks)?);
        let (w, shape) =
            self.op.weights_of((q, ql), (k, kl), self.average).map_err(candle_core::Error::wrap)?;
        // Averaged weights are `(N, L, S)` (their head axis of one dropped).
        let d = self.op.dims;
        let shape = if self.average { Shape::from((d.batch, d.l, d.s)) } else { shape };
        Ok((CpuStorage::F32(w), shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let d = self.op.dims;
        let (n, h, hk, l, s) = (d.batch, d.heads_q, d.heads_kv, d.l, d.s);
        let (_, hd, batch_first) = self.layout;
        // The per-head probabilities, their gradient and the scores' gradient.
        crate::alloc::ensure(
            "multi_head_attention_forward",
            "attention weights' gradient",
            &[n, h, l, s],
            candle_core::DType::F32,
            3,
            "keep the weights out of the loss, or set need_weights=false",
        )
        .map_err(candle_core::Error::wrap)?;
        let p = self.op.weights(q, k, false).map_err(candle_core::Error::wrap)?;
        let g = if self.average {
            grad_res
                .reshape((n, 1, l, s))?
                .broadcast_as((n, h, l, s))?
                .affine(1.0 / h as f64, 0.0)?
        } else {
            grad_res.reshape((n, h, l, s))?
        };
        let ds = p.mul(&g.broadcast_sub(&g.mul(&p)?.sum_keepdim(3)?)?)?;
        let scale = self.op.scale as f64;
        let wrap = candle_core::Error::wrap;
        let qh = to_bhtd(q, h, hd, batch_first).map_err(wrap)?;
        let kh = to_bhtd(k, hk, hd, batch_first).map_err(wrap)?;
        // Query head i reads key head i / (h / hk).
        let kx = kh.unsqueeze(2)?.broadcast_as((n, hk, h / hk, s, hd))?.reshape((n, h, s, hd))?;
        let dq = ds.matmul(&kx.contiguous()?)?.affine(scale, 0.0)?;
        let dk = ds.transpose(2, 3)?.contiguous()?.matmul(&qh)?.affine(scale, 0.0)?;
        let dk = dk.reshape((n, hk, h / hk, s, hd))?.sum(2)?;
        let dq = from_bhtd(&dq, batch_first).map_err(wrap)?;
        let dk = from_bhtd(&dk, batch_first).map_err(wrap)?;
        Ok((Some(dq), Some(dk)))
    }
}

/// `(T, N, heads·hd)` (or `(N, T, ·)` with `batch_first`) -> `(N, heads, T, hd)`, contiguous.
pub(crate) fn to_bhtd(t: &Tensor, heads: usize, hd: usize, batch_first: bool) -> Result<Tensor> {
    let t = if batch_first { t.clone() } else { t.transpose(0, 1)? };
    let (nb, len, _) = t.dims3()?;
    Ok(t.contiguous()?.reshape((nb, len, heads, hd))?.transpose(1, 2)?.contiguous()?)
}

/// `(N, H, T, hd)` -> the caller's `(T, N, H·hd)` or `(N, T, H·hd)`.
pub(crate) fn from_bhtd(o: &Tensor, batch_first: bool) -> Result<Tensor> {
    let (n, h, t, hd) = o.dims4()?;
    let o = o.transpose(1, 2)?.contiguous()?.reshape((n, t, h * hd))?;
    Ok(if batch_first { o } else { o.transpose(0, 1)? })
}

/// The weights `(N, L, S)` (averaged) or `(N, H, L, S)` of `op`'s forward over the projected
/// `q` and `k`, joined to their graph.
pub(crate) fn weights(
    op: &FlashAttention,
    q: &Tensor,
    k: &Tensor,
    average: bool,
    layout: (usize, usize, bool),
) -> Result<Tensor> {
    let grad = WeightsGrad { op: op.clone(), average, layout };
    Ok(q.apply_op2(k, grad)?)
}
