//! The gradient of the attention weights that `MultiheadAttention` returns on the fused path
//! when gradients are recorded (PyTorch's default `need_weights=True` in training).
//!
//! The weights come from the weights kernel (`FlashAttention::weights`, from the forward's row
//! statistics) and join candle's graph through [`WeightsGrad`], an identity on them whose
//! backward recomputes the per-head probabilities `P` the same way and gives the projected
//! query and key the softmax's gradient: with `G` the weights' gradient per head (divided by
//! H when the weights are averaged), `dS = P ∘ (G − rowsum(G ∘ P))`, `dq = scale · dS · k` and
//! `dk = scale · dSᵀ · q` (summed over a group's query heads). The backward only runs when a
//! loss uses the weights; otherwise they cost the kernel's pass alone. Without dropout, a soft
//! cap or sinks (the caller's condition): the returned weights are then the probabilities
//! themselves, and `dS` is the softmax's own.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use super::flash::FlashAttention;
use crate::error::Result;

/// Identity on `(weights, q, k) -> weights`; its backward gives q and k the weights' gradient.
struct WeightsGrad {
    op: FlashAttention,
    average: bool,
    /// `(heads, head size, batch_first)` of the caller's `(T, N, heads·hd)` or `(N, T, ·)`
    /// projections.
    layout: (usize, usize, bool),
}

impl CustomOp3 for WeightsGrad {
    fn name(&self) -> &'static str {
        "attention-weights-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
        _s3: &CpuStorage,
        _l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        super::flash::identity_copy(s1, l1, "attention weights")
    }

    fn bwd(
        &self,
        _w: &Tensor,
        q: &Tensor,
        k: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
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
        Ok((None, Some(dq), Some(dk)))
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
    let w = op.weights(q, k, average)?;
    let w = if average { w.squeeze(1)? } else { w };
    let grad = WeightsGrad { op: op.clone(), average, layout };
    Ok(w.apply_op3(q, k, grad)?)
}
