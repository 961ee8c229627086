//! Flash attention on packed projections: self-attention's one `(L, N, 3E)` in-projection
//! output (q, k and v at feature offsets `0`, `E`, `2E`) and cross-attention's `(S, N, 2E)`
//! key/value projection of one memory (k and v at `0` and `E`); `(N, ·, ·)` with
//! `batch_first`. The kernels read the parts in place, and the backward writes one packed
//! gradient: candle would otherwise pad each part's gradient to the packed width (a copy) and
//! add the pads up.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Tensor};
use multihead_kernels::attention::{flash_backward_kv_packed, flash_backward_packed, Layout4};

use super::flash::{contiguous_layout4, cpu_f32, f32s, Convention, FlashAttention};
use crate::error::Result;

/// The kernel layouts (with start offsets) of the `N` parts of a packed `(T, N, N·E)` layout
/// (`(N, T, ·)` with `batch_first`) under `conv`.
fn parts<const N: usize>(
    conv: Convention,
    l: &Layout,
) -> candle_core::Result<[(usize, Layout4); N]> {
    let dims = l.dims();
    let st = l.stride();
    if dims.len() != 3 || !dims[2].is_multiple_of(N) || (st[2] != 1 && dims[2] > 1) {
        candle_core::bail!(
            "flash attention: expected a packed (T, N, {N}E) input with contiguous features"
        );
    }
    let e = dims[2] / N;
    let (heads, batch_first) = match conv {
        Convention::SeqFirst { heads, batch_first, .. } => (heads.max(1), batch_first),
        Convention::Bhtd => candle_core::bail!("flash attention: packed input is 3-D"),
    };
    let (batch, seq) = if batch_first { (st[0], st[1]) } else { (st[1], st[0]) };
    let l4 = Layout4 { batch, head: e / heads, seq };
    let o = l.start_offset();
    Ok(std::array::from_fn(|i| (o + i * e, l4)))
}

/// The op on one packed `(L, N, 3E)` self-attention projection.
pub(crate) struct PackedQkv(pub FlashAttention);

impl CustomOp1 for PackedQkv {
    fn name(&self) -> &'static str {
        "flash-attention-packed"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let [(qo, q4), (ko, k4), (vo, v4)] = parts::<3>(self.0.conv, l)?;
        let dims = l.dims();
        let q_dims = [dims[0], dims[1], dims[2] / 3];
        if let CpuStorage::BF16(x) = s {
            // A bf16 module's f32 twin keeping its projection in bf16 (no gradient: the
            // backward reads f32 inputs).
            let x = super::convert::bits(x);
            let (q, k, v) = ((&x[qo..], q4), (&x[ko..], k4), (&x[vo..], v4));
            return self.0.forward_bf16_into_new(&q_dims, q, k, v);
        }
        let x = cpu_f32(s)?;
        self.0.forward_into_new(&q_dims, (&x[qo..], q4), (&x[ko..], k4), (&x[vo..], v4))
    }

    fn bwd(
        &self,
        qkv: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let [dqkv] = match self.0.take_stashed::<1>() {
            Some(g) => g,
            None => self.0.on_pool(|| backward_qkv(&self.0, qkv, res, grad_res, None))?,
        };
        Ok(Some(dqkv))
    }
}

/// The packed gradient of `op` applied to a packed `(L, N, 3E)` projection, for the output
/// `res` and its gradient; with `dscores`, the scores' gradient too.
pub(super) fn backward_qkv(
    op: &FlashAttention,
    qkv: &Tensor,
    res: &Tensor,
    grad_res: &Tensor,
    dscores: Option<&mut [f32]>,
) -> candle_core::Result<[Tensor; 1]> {
    let (xs, xl) = qkv.storage_and_layout();
    let [(qo, q4), (ko, k4), (vo, v4)] = parts::<3>(op.conv, xl)?;
    // One (L, N, 3E) gradient written by the kernel: dq, dk and dv of a row are its three
    // thirds, which together are every element, so the buffer is not zeroed first.
    let [(_, d4), ..] = parts::<3>(op.conv, &Layout::contiguous(qkv.dims()))?;
    let x = f32s(&xs)?;
    let (q, k, v) = (&x[qo..], &x[ko..], &x[vo..]);
    let write = |dqkv: &mut [std::mem::MaybeUninit<f32>]| {
        op.with_saved(res, grad_res, |p, (o, o4), (g, g4), lse| {
            flash_backward_packed(p, q, q4, k, k4, v, v4, o, o4, g, g4, lse, dqkv, d4, dscores)
        })
    };
    // SAFETY: on `Ok`, the kernel wrote all three parts of the contiguous (L, N, 3E) buffer,
    // which are all of its elements (`flash_backward_packed`).
    let dqkv =
        unsafe { crate::alloc::try_written(qkv.elem_count(), "flash attention dqkv", write) }?;
    Ok([Tensor::from_vec(dqkv, qkv.shape(), qkv.device())?])
}

/// The op on a query and one packed `(S, N, 2E)` key/value projection.
pub(crate) struct PackedKv(pub FlashAttention);

impl CustomOp2 for PackedKv {
    fn name(&self) -> &'static str {
        "flash-attention-packed-kv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q_off, q4) = self.0.conv.layout4(l1)?;
        let [(ko, k4), (vo, v4)] = parts::<2>(self.0.conv, l2)?;
        let (q, kv) = (cpu_f32(s1)?, cpu_f32(s2)?);
        self.0.forward_into_new(l1.dims(), (&q[q_off..], q4), (&kv[ko..], k4), (&kv[vo..], v4))
    }

    fn bwd(
        &self,
        q: &Tensor,
        kv: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let [dq, dkv] = match self.0.take_stashed::<2>() {
            Some(g) => g,
            None => self.0.on_pool(|| backward_kv(&self.0, q, kv, res, grad_res, None))?,
        };
        Ok((Some(dq), Some(dkv)))
    }
}

/// dq and the packed key/value gradient of `op` applied to `q` and a packed `(S, N, 2E)`
/// projection, for the output `res` and its gradient; with `dscores`, the scores' gradient too.
pub(super) fn backward_kv(
    op: &FlashAttention,
    q: &Tensor,
    kv: &Tensor,
    res: &Tensor,
    grad_res: &Tensor,
    dscores: Option<&mut [f32]>,
) -> candle_core::Result<[Tensor; 2]> {
    let (qs, ql) = q.storage_and_layout();
    let (xs, xl) = kv.storage_and_layout();
    let (q_off, q4) = op.conv.layout4(ql)?;
    let [(ko, k4), (vo, v4)] = parts::<2>(op.conv, xl)?;
    let mut dq = crate::alloc::try_zeros::<f32>(q.elem_count(), "flash attention dq")?;
    let mut dkv = crate::alloc::try_zeros::<f32>(kv.elem_count(), "flash attention dkv")?;
    let dq4 = contiguous_layout4(op.conv, q.dims())?;
    let [(_, dkv4), _] = parts::<2>(op.conv, &Layout::contiguous(kv.dims()))?;
    let (x, qv) = (f32s(&xs)?, &f32s(&qs)?[q_off..]);
    let (k, v) = (&x[ko..], &x[vo..]);
    op.with_saved(res, grad_res, |p, (o, o4), (g, g4), lse| {
        flash_backward_kv_packed(
            p, qv, q4, k, k4, v, v4, o, o4, g, g4, lse, &mut dq, dq4, &mut dkv, dkv4, dscores,
        )
    })?;
    let dev = q.device();
    Ok([Tensor::from_vec(dq, q.shape(), dev)?, Tensor::from_vec(dkv, kv.shape(), dev)?])
}

impl FlashAttention {
    /// Applies the op to a packed `(L, N, 3E)` self-attention projection.
    pub(crate) fn apply_packed(&self, qkv: &Tensor) -> Result<Tensor> {
        Ok(qkv.apply_op1_arc(Arc::new(Box::new(PackedQkv(self.for_inputs(&[qkv])))))?)
    }

    /// Applies the op to a query and a packed `(S, N, 2E)` key/value projection.
    pub(crate) fn apply_packed_kv(&self, q: &Tensor, kv: &Tensor) -> Result<Tensor> {
        Ok(q.apply_op2_arc(kv, Arc::new(Box::new(PackedKv(self.for_inputs(&[q, kv])))))?)
    }
}
