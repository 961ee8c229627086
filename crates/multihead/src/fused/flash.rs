//! The flash-attention kernels of `multihead-kernels` entered into candle as a `CustomOp3`
//! (packed projections: [`flash_packed`](super::flash_packed)) with a backward, so that
//! candle's autograd runs them.
//!
//! The op reads q, k and v through their strides (for MultiheadAttention, straight from the
//! in-projection output, with no transposing copy), writes the attention output, keeps the row
//! log-sum-exp for the backward, and never materialises an `L × S` matrix. The composed candle
//! path in [`functional`](crate::functional) stays as the reference and for f64.
//!
//! Every buffer is allocated fallibly: a size that cannot be allocated is an error.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use multihead_kernels::attention::{
    attention_weights, flash_backward, flash_backward_dscores, flash_forward_bf16_uninit,
    flash_forward_uninit, AttnDims, AttnParams, KernelError, Layout4, MaskView,
};
use multihead_kernels::dropout::DropoutKey;

use crate::error::Result;

/// How the op's 3-D or 4-D inputs map to the kernel's `[batch, head, seq, dim]`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Convention {
    /// `(T, N, H·D)`: MultiheadAttention's projections; `(N, T, H·D)` with `batch_first`.
    /// `heads` counts the query (and output) heads; head `i` of any input starts at feature
    /// `i·head_dim`, so grouped-query keys and values `(T, N, Hkv·D)` read the same way.
    SeqFirst { heads: usize, head_dim: usize, batch_first: bool },
    /// `(B, H, T, D)`.
    Bhtd,
}

impl Convention {
    /// The kernel layout of a tensor with this layout, and its start offset.
    pub(crate) fn layout4(&self, l: &Layout) -> candle_core::Result<(usize, Layout4)> {
        let dims = l.dims();
        let st = l.stride();
        match (self, dims.len()) {
            (Convention::SeqFirst { head_dim: hd, batch_first, .. }, 3) => {
                if st[2] != 1 && dims[2] > 1 {
                    candle_core::bail!("flash attention: the feature dimension must be contiguous");
                }
                let (batch, seq) = if *batch_first { (st[0], st[1]) } else { (st[1], st[0]) };
                Ok((l.start_offset(), Layout4 { batch, head: *hd, seq }))
            }
            (Convention::Bhtd, 4) => {
                if st[3] != 1 && dims[3] > 1 {
                    candle_core::bail!("flash attention: the last dimension must be contiguous");
                }
                Ok((l.start_offset(), Layout4 { batch: st[0], head: st[1], seq: st[2] }))
            }
            _ => candle_core::bail!("flash attention: unexpected rank {}", dims.len()),
        }
    }

    /// The output shape for query dims and the value head size.
    fn out_shape(&self, q: &[usize], dv: usize) -> Vec<usize> {
        match self {
            Convention::SeqFirst { heads, .. } => vec![q[0], q[1], heads * dv],
            Convention::Bhtd => vec![q[0], q[1], q[2], dv],
        }
    }
}

/// An additive f32 mask in the kernel's `[batch, head, l, s]` view.
///
/// Read in place where no backward can read it (inference: inside `no_grad`, on inputs that
/// carry no graph) and the tensor is f32 on the CPU and dense behind its broadcast dimensions
/// (the caller's mask as it is, or the conversion the call already made: a dense
/// `(N, H, L, S)` mask is not copied again for each call); copied otherwise. A backward
/// recomputes the scores with the mask, so it keeps a copy: a mask buffer refilled in place
/// before the backward (micro-batches whose losses are summed) must not change the gradient,
/// as it does not on the composed path, which keeps the probabilities.
#[derive(Clone, Debug)]
pub(crate) struct FlashMask {
    data: MaskData,
    pub strides: [usize; 4],
}

/// Where a [`FlashMask`]'s values lie.
#[derive(Clone, Debug)]
enum MaskData {
    /// A copy, in the dense order of the mask's dims.
    Owned(Vec<f32>),
    /// A contiguous f32 CPU tensor, read from its storage at its start offset.
    Shared(Tensor),
}

/// A [`FlashMask`]'s values while the kernels read them: a copy's, or the shared tensor's
/// storage held for reading.
enum MaskRead<'a> {
    Owned(&'a [f32]),
    Shared(candle_core::StorageRef<'a>, std::ops::Range<usize>),
}

impl MaskRead<'_> {
    fn values(&self) -> candle_core::Result<&[f32]> {
        match self {
            MaskRead::Owned(v) => Ok(v),
            MaskRead::Shared(s, range) => f32s(s)?.get(range.clone()).ok_or_else(|| {
                candle_core::Error::Msg("flash attention: the mask's storage is too short".into())
            }),
        }
    }
}

impl FlashMask {
    /// An additive mask tensor (any dtype; read as f32) viewed through `strides`, which
    /// address its elements in the dense order of its dims: read in place where no backward
    /// can read it (`backward` false) and it is a contiguous f32 CPU tensor, copied (in f32)
    /// otherwise.
    pub(crate) fn new(t: &Tensor, strides: [usize; 4], backward: bool) -> Result<Self> {
        if Self::reads_in_place(t, backward) {
            return Ok(Self { data: MaskData::Shared(t.clone()), strides });
        }
        Self::ensure(t.dims())?;
        let values = t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(Self { data: MaskData::Owned(values), strides })
    }

    /// Whether [`new`](Self::new) reads `t` where it lies: no backward can read it, and it is
    /// a contiguous f32 CPU tensor.
    pub(crate) fn reads_in_place(t: &Tensor, backward: bool) -> bool {
        !backward
            && t.dtype() == candle_core::DType::F32
            && t.device().is_cpu()
            && t.layout().is_contiguous()
    }

    /// Whether the copies [`new`](Self::new) makes of `t` (none where it reads `t` in place)
    /// can be allocated.
    pub(crate) fn ensure_for(t: &Tensor, backward: bool) -> Result<()> {
        match Self::reads_in_place(t, backward) {
            true => Ok(()),
            false => Self::ensure(t.dims()),
        }
    }

    /// Whether the copies [`new`](Self::new) may make of an f32 mask of `dims` can be
    /// allocated (a broadcast view costs its full size: the callers compact them first).
    pub(crate) fn ensure(dims: &[usize]) -> Result<()> {
        let hint = "pass a smaller mask";
        crate::alloc::ensure("flash attention", "mask", dims, candle_core::DType::F32, 2, hint)
    }

    /// Whether the mask is read where its tensor lies (not copied).
    #[cfg(test)]
    pub(crate) fn in_place(&self) -> bool {
        matches!(self.data, MaskData::Shared(_))
    }

    fn read(&self) -> MaskRead<'_> {
        match &self.data {
            MaskData::Owned(v) => MaskRead::Owned(v),
            MaskData::Shared(t) => {
                let (storage, layout) = t.storage_and_layout();
                let start = layout.start_offset();
                MaskRead::Shared(storage, start..start + layout.shape().elem_count())
            }
        }
    }
}

/// The flash-attention op for one call. Clones share the saved log-sum-exp.
#[derive(Clone)]
pub(crate) struct FlashAttention {
    pub dims: AttnDims,
    pub scale: f32,
    pub causal: bool,
    pub masks: Arc<Vec<FlashMask>>,
    pub dropout: Option<(f64, DropoutKey)>,
    pub conv: Convention,
    /// The products (forward and backward) take bf16 operands (`AttnParams::bf16_products`);
    /// see [`Self::with_rounded_products`].
    pub bf16_products: bool,
    /// Soft cap, window, alignment, key lengths and ALiBi ([`crate::Variants`]).
    pub variants: Arc<crate::Variants>,
    /// The ALiBi slopes of `variants` in f32, as the kernels take them.
    alibi: Option<Arc<Vec<f32>>>,
    /// Attention sinks, one per query head (their gradient: [`super::sinks`]).
    pub(super) sinks: Option<Arc<Vec<f32>>>,
    pub(super) lse: Arc<Mutex<Vec<f32>>>,
    /// Whether the forward keeps the row statistics for a backward: not where no gradient can
    /// be asked for (inside `no_grad`, with inputs that carry no graph), which saves a
    /// logarithm per row.
    keep_stats: bool,
    /// Whether [`Self::weights`] will read the statistics after the forward (they are kept
    /// then whatever the gradients).
    weights_later: bool,
    /// dq, dk, dv already computed by a learned mask's backward ([`super::mask_grad`]).
    pub(super) grads: super::mask_grad::Stash,
}

/// Whether a backward may reach an op applied to `xs`: gradients enabled, or an input that
/// carries a graph (inside `no_grad`, inputs without one build none).
pub(crate) fn gradient_possible(xs: &[&Tensor]) -> bool {
    crate::mode::grad_enabled() || xs.iter().any(|x| x.track_op())
}

/// The backward's error where the forward kept no statistics.
pub(super) const NO_STATS: &str = "flash attention backward: the forward kept no row statistics \
    (it ran inside multihead::no_grad on inputs that carry no graph); run the forward with \
    gradients enabled to differentiate it";

impl FlashAttention {
    pub(crate) fn new(
        dims: AttnDims,
        scale: f32,
        causal: bool,
        masks: Vec<FlashMask>,
        dropout: Option<(f64, DropoutKey)>,
        conv: Convention,
    ) -> Self {
        Self {
            dims,
            scale,
            causal,
            masks: Arc::new(masks),
            dropout,
            conv,
            bf16_products: false,
            variants: Arc::default(),
            alibi: None,
            sinks: None,
            lse: Arc::new(Mutex::new(Vec::new())),
            keep_stats: true,
            weights_later: false,
            grads: Arc::default(),
        }
    }

    /// Runs `f`, a backward of this op, on one of rayon's threads where the kernels go
    /// parallel: one hop for the backward's parallel steps (the scans, the packing, the tasks)
    /// when candle's backward runs on a thread outside the pool ([`crate::pool`]).
    pub(super) fn on_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let d = &self.dims;
        let macs =
            [d.heads_q, d.l, d.s, d.d.max(d.dv)].into_iter().fold(d.batch, usize::saturating_mul);
        crate::pool::on_pool_for(macs, f)
    }

    /// The same op with these variants (validated by the caller).
    pub(crate) fn with_variants(self, variants: &crate::Variants) -> Self {
        let alibi = variants.alibi_f32().map(Arc::new);
        Self { variants: Arc::new(variants.clone()), alibi, ..self }
    }

    /// The same op with attention sinks, one per query head (validated by the caller).
    pub(crate) fn with_sinks(self, sinks: Vec<f32>) -> Self {
        Self { sinks: Some(Arc::new(sinks)), ..self }
    }

    /// The same op with its products' operands rounded to bf16 (`on`) or widened, as decided
    /// by a caller that ran on another thread (varlen attention's sequences).
    pub(crate) fn with_bf16_products(self, on: bool) -> Self {
        Self { bf16_products: on, ..self }
    }

    /// The same op with bf16 products where a bf16 module's computation rounds its products
    /// (`crate::mode::rounded_products`) and PyTorch's bf16 CPU attention would run its flash
    /// kernel, which rounds the probabilities: not with the weights or a mask that requires
    /// grad (`math_path`), grouped-query heads or dropout, where PyTorch takes its math path
    /// (products in f32) and so do we.
    pub(crate) fn with_rounded_products(self, math_path: bool) -> Self {
        let dropout = self.dropout.is_some_and(|(p, _)| p > 0.0);
        let grouped = self.dims.heads_q != self.dims.heads_kv;
        let on = crate::mode::in_rounded_products() && !math_path && !grouped && !dropout;
        Self { bf16_products: on, ..self }
    }

    /// The same op (sizes, masks, dropout) reading its inputs through another convention,
    /// with its own saved statistics.
    pub(crate) fn with_convention(&self, conv: Convention) -> Self {
        Self { conv, lse: Arc::new(Mutex::new(Vec::new())), grads: Arc::default(), ..self.clone() }
    }

    /// The `N` gradients a learned mask's backward computed for this op's inputs
    /// ([`super::mask_grad`]), taken (once).
    pub(super) fn take_stashed<const N: usize>(&self) -> Option<[Tensor; N]> {
        let g = self.grads.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        g.try_into().ok()
    }

    /// Runs the kernel forward into a new output for a query of dims `q_dims`, and keeps the
    /// row statistics for the backward.
    pub(super) fn forward_into_new(
        &self,
        q_dims: &[usize],
        (q, q4): (&[f32], Layout4),
        (k, k4): (&[f32], Layout4),
        (v, v4): (&[f32], Layout4),
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (out, shape) = self.forward_with(q_dims, |p, dst, o4, stats| {
            flash_forward_uninit(p, q, q4, k, k4, v, v4, dst, o4, stats)
        })?;
        Ok((CpuStorage::F32(out), shape))
    }

    /// [`Self::forward_into_new`] on q, k and v given as bf16 bits (a bf16 module's f32 twin
    /// keeping its projection in bf16), the output rounded once to bf16: the kernel's bf16
    /// entry, the numbers of the f32 one.
    pub(super) fn forward_bf16_into_new(
        &self,
        q_dims: &[usize],
        (q, q4): (&[u16], Layout4),
        (k, k4): (&[u16], Layout4),
        (v, v4): (&[u16], Layout4),
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (out, shape) = self.forward_with(q_dims, |p, dst, o4, stats| {
            flash_forward_bf16_uninit(p, q, q4, k, k4, v, v4, dst, o4, stats)
        })?;
        Ok((CpuStorage::BF16(super::convert::from_bits(out)), shape))
    }

    /// The forward's output (and the row statistics where kept) from `kernel`, given the
    /// parameters, the uninitialised output, its layout and the statistics.
    fn forward_with<E>(
        &self,
        q_dims: &[usize],
        kernel: impl FnOnce(
            &AttnParams<'_>,
            &mut [std::mem::MaybeUninit<E>],
            Layout4,
            Option<&mut [f32]>,
        ) -> std::result::Result<(), KernelError>,
    ) -> candle_core::Result<(Vec<E>, Shape)> {
        let out_dims = self.conv.out_shape(q_dims, self.dims.dv);
        let o4 = contiguous_layout4(self.conv, &out_dims)?;
        let d = self.dims;
        let n = out_dims.iter().product();
        let rows = if self.keep_stats { 2 * d.batch * d.heads_q * d.l } else { 0 };
        let mut lse = crate::alloc::try_zeros::<f32>(rows, "flash attention row statistics")?;
        let stats = self.keep_stats.then_some(&mut lse[..]);
        let out = self.with_params(|p| {
            let write = |dst: &mut [std::mem::MaybeUninit<E>]| {
                kernel(p, dst, o4, stats)
                    .map_err(|e| candle_core::Error::Msg(format!("flash attention forward: {e}")))
            };
            // SAFETY: on `Ok` the kernel wrote every element of the contiguous output
            // (`flash_forward_uninit`, `flash_forward_bf16_uninit`).
            unsafe { crate::alloc::try_written(n, "flash attention output", write) }
        })??;
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = lse;
        Ok((out, Shape::from(out_dims)))
    }

    /// The same op, whose forward keeps the statistics for [`Self::weights`] when
    /// `need_weights`.
    pub(crate) fn with_weights_later(self, need_weights: bool) -> Self {
        Self { weights_later: need_weights, ..self }
    }

    /// The op as applied to inputs `xs`: keeping the statistics only where the weights or a
    /// backward can ask for them (gradients enabled, or an input carrying a graph).
    pub(super) fn for_inputs(&self, xs: &[&Tensor]) -> Self {
        Self { keep_stats: self.weights_later || gradient_possible(xs), ..self.clone() }
    }

    /// Hands `f` what every backward of this op reads besides its inputs: the kernel
    /// parameters, the saved output and its gradient (made contiguous) as kernel views, and
    /// the saved row statistics. Kernel errors come back as candle errors naming the op.
    pub(super) fn with_saved<R>(
        &self,
        res: &Tensor,
        grad_res: &Tensor,
        f: impl FnOnce(
            &AttnParams<'_>,
            (&[f32], Layout4),
            (&[f32], Layout4),
            &[f32],
        ) -> std::result::Result<R, KernelError>,
    ) -> candle_core::Result<R> {
        let grad = grad_res.contiguous()?;
        let (os, ol) = res.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let (o_off, o4) = self.conv.layout4(ol)?;
        let (g_off, g4) = self.conv.layout4(gl)?;
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner());
        let d = self.dims;
        if lse.len() != 2 * d.batch * d.heads_q * d.l {
            return Err(candle_core::Error::Msg(NO_STATS.into()));
        }
        let (out, g) = ((&f32s(&os)?[o_off..], o4), (&f32s(&gs)?[g_off..], g4));
        self.with_params(|p| f(p, out, g, &lse))?
            .map_err(|e| candle_core::Error::Msg(format!("flash attention backward: {e}")))
    }

    /// Runs `f` with the kernel parameters of this op, its masks read where they lie (their
    /// tensors' storage held for reading while `f` runs).
    pub(crate) fn with_params<R>(
        &self,
        f: impl FnOnce(&AttnParams<'_>) -> R,
    ) -> candle_core::Result<R> {
        let reads: Vec<MaskRead<'_>> = self.masks.iter().map(FlashMask::read).collect();
        let mut p = self.params_without_masks();
        for ((slot, m), read) in p.masks.iter_mut().zip(self.masks.iter()).zip(&reads) {
            *slot = Some(MaskView::Additive { data: read.values()?, strides: m.strides });
        }
        Ok(f(&p))
    }

    /// The kernel parameters of this op but its masks ([`Self::with_params`] adds them).
    fn params_without_masks(&self) -> AttnParams<'_> {
        let mut p = AttnParams::new(self.dims);
        p.scale = self.scale;
        p.causal = self.causal;
        p.dropout = self.dropout;
        p.bf16_products = self.bf16_products;
        let v = &self.variants;
        p.offset = v.offset(self.dims.l, self.dims.s);
        p.window = v.window;
        p.kv_lengths = v.kv_lengths.as_deref();
        p.softcap = v.softcap.map(|c| c as f32);
        p.softcap_after_masks = v.softcap_after_masks;
        p.alibi = self.alibi.as_deref().map(Vec::as_slice);
        p.sinks = self.sinks.as_deref().map(Vec::as_slice);
        p
    }

    /// The head-averaged (`(N, 1, L, S)`) or per-head (`(N, H, L, S)`) attention weights of the
    /// forward that ran, from the saved log-sum-exp. No gradient flows through them.
    pub(crate) fn weights(&self, q: &Tensor, k: &Tensor, average: bool) -> Result<Tensor> {
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (w, shape) = self.weights_of((f32s(&qs)?, ql), (f32s(&ks)?, kl), average)?;
        Ok(Tensor::from_vec(w, shape, q.device())?)
    }

    /// [`weights`](Self::weights) over the projections' f32 elements and layouts: the weights
    /// and their shape.
    pub(crate) fn weights_of(
        &self,
        (qs, ql): (&[f32], &Layout),
        (ks, kl): (&[f32], &Layout),
        average: bool,
    ) -> Result<(Vec<f32>, Shape)> {
        let (q_off, q4) = self.conv.layout4(ql)?;
        let (k_off, k4) = self.conv.layout4(kl)?;
        let d = self.dims;
        let hw = if average { 1 } else { d.heads_q };
        let n =
            crate::alloc::elements("attention_weights", "attn_weights", &[d.batch, hw, d.l, d.s])?;
        let mut w = crate::alloc::try_zeros::<f32>(n, "flash attention weights")?;
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner());
        let (q, k) = (qs.get(q_off..).unwrap_or(&[]), ks.get(k_off..).unwrap_or(&[]));
        self.with_params(|p| attention_weights(p, q, q4, k, k4, &lse, average, &mut w))?
            .map_err(|e| candle_core::Error::Msg(format!("flash attention weights: {e}")))?;
        Ok((w, Shape::from((d.batch, hw, d.l, d.s))))
    }
}

pub(super) fn f32s(s: &candle_core::Storage) -> candle_core::Result<&[f32]> {
    super::storage_f32(s, "flash attention")
}

pub(super) fn cpu_f32(s: &CpuStorage) -> candle_core::Result<&[f32]> {
    super::cpu_f32(s, "flash attention")
}

/// A copy of the f32 view `(s, l)`: the forward of the identity ops that join extra inputs
/// (sinks, a learned mask) to the graph of an attention output. `what` names the buffer.
pub(super) fn identity_copy(
    s: &CpuStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<(CpuStorage, Shape)> {
    // The attention ops' outputs are contiguous (they made them).
    let x = cpu_f32(s)?;
    let n = l.shape().elem_count();
    let mut out = crate::alloc::try_zeros::<f32>(n, what)?;
    let start = l.start_offset();
    if let Some(src) = x.get(start..start + n) {
        out.copy_from_slice(src);
    }
    Ok((CpuStorage::F32(out), l.shape().clone()))
}

pub(super) fn contiguous_layout4(conv: Convention, dims: &[usize]) -> candle_core::Result<Layout4> {
    Ok(conv.layout4(&Layout::contiguous(dims))?.1)
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q_off, q4) = self.conv.layout4(l1)?;
        let (k_off, k4) = self.conv.layout4(l2)?;
        let (v_off, v4) = self.conv.layout4(l3)?;
        if let (CpuStorage::BF16(q), CpuStorage::BF16(k), CpuStorage::BF16(v)) = (s1, s2, s3) {
            // A bf16 call that nothing differentiates (`functional::sdpa`'s `bf16_direct`):
            // the kernel's bf16 entry, which errors unless the products are bf16.
            use super::convert::bits;
            return self.forward_bf16_into_new(
                l1.dims(),
                (&bits(q)[q_off..], q4),
                (&bits(k)[k_off..], k4),
                (&bits(v)[v_off..], v4),
            );
        }
        self.forward_into_new(
            l1.dims(),
            (&cpu_f32(s1)?[q_off..], q4),
            (&cpu_f32(s2)?[k_off..], k4),
            (&cpu_f32(s3)?[v_off..], v4),
        )
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dq, dk, dv] = match self.take_stashed::<3>() {
            Some(g) => g,
            None => self.on_pool(|| backward_unpacked(self, [q, k, v], res, grad_res, None))?,
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// dq, dk and dv of `op` applied to `q`, `k`, `v` (unpacked), for the output `res` and its
/// gradient; with `dscores`, the scores' gradient too (`flash_backward_dscores`).
pub(super) fn backward_unpacked(
    op: &FlashAttention,
    [q, k, v]: [&Tensor; 3],
    res: &Tensor,
    grad_res: &Tensor,
    dscores: Option<&mut [f32]>,
) -> candle_core::Result<[Tensor; 3]> {
    let conv = op.conv;
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (q_off, q4) = conv.layout4(ql)?;
    let (k_off, k4) = conv.layout4(kl)?;
    let (v_off, v4) = conv.layout4(vl)?;
    let mut dq = crate::alloc::try_zeros::<f32>(q.elem_count(), "flash attention dq")?;
    let mut dk = crate::alloc::try_zeros::<f32>(k.elem_count(), "flash attention dk")?;
    let mut dv = crate::alloc::try_zeros::<f32>(v.elem_count(), "flash attention dv")?;
    let dq4 = contiguous_layout4(conv, q.dims())?;
    let dk4 = contiguous_layout4(conv, k.dims())?;
    let dv4 = contiguous_layout4(conv, v.dims())?;
    let (qv, kv, vv) = (&f32s(&qs)?[q_off..], &f32s(&ks)?[k_off..], &f32s(&vs)?[v_off..]);
    op.with_saved(res, grad_res, |p, (o, o4), (g, g4), lse| {
        let (dq, dk, dv) = ((&mut dq[..], dq4), (&mut dk[..], dk4), (&mut dv[..], dv4));
        match dscores {
            Some(ds) => flash_backward_dscores(
                p, qv, q4, kv, k4, vv, v4, o, o4, g, g4, lse, dq.0, dq.1, dk.0, dk.1, dv.0, dv.1,
                ds,
            ),
            None => flash_backward(
                p, qv, q4, kv, k4, vv, v4, o, o4, g, g4, lse, dq.0, dq.1, dk.0, dk.1, dv.0, dv.1,
            ),
        }
    })?;
    let dev = q.device();
    Ok([
        Tensor::from_vec(dq, q.shape(), dev)?,
        Tensor::from_vec(dk, k.shape(), dev)?,
        Tensor::from_vec(dv, v.shape(), dev)?,
    ])
}

impl FlashAttention {
    /// Applies the op to `(q, k, v)`; the result is differentiable through [`CustomOp3::bwd`].
    pub(crate) fn apply(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        Ok(q.apply_op3_arc(k, v, Arc::new(Box::new(self.for_inputs(&[q, k, v]))))?)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn contiguous_f32_masks_are_read_in_place_without_a_backward_and_others_copied() {
        let dev = Device::Cpu;
        let t = Tensor::arange(0f32, 24.0, &dev).unwrap().reshape((2, 3, 4)).unwrap();
        let read = |m: &FlashMask| m.read().values().unwrap().to_vec();
        // In place: dense, and at an offset into a larger tensor (its own elements only).
        let dense = FlashMask::new(&t, [12, 0, 4, 1], false).unwrap();
        assert!(dense.in_place());
        assert_eq!(read(&dense), (0..24).map(|i| i as f32).collect::<Vec<_>>());
        let part = t.narrow(0, 1, 1).unwrap();
        let at = FlashMask::new(&part, [0, 0, 4, 1], false).unwrap();
        assert!(at.in_place());
        assert_eq!(read(&at), (12..24).map(|i| i as f32).collect::<Vec<_>>());
        // Copied: a transposed view (in its dense order) and another dtype.
        let tr = FlashMask::new(&t.transpose(1, 2).unwrap(), [12, 0, 3, 1], false).unwrap();
        assert!(!tr.in_place());
        assert_eq!(read(&tr)[..4], [0.0, 4.0, 8.0, 1.0]);
        let wide = FlashMask::new(&t.to_dtype(DType::F64).unwrap(), [12, 0, 4, 1], false).unwrap();
        assert!(!wide.in_place());
        assert_eq!(read(&wide), read(&dense));
        // Copied where a backward may read it.
        let kept = FlashMask::new(&t, [12, 0, 4, 1], true).unwrap();
        assert!(!kept.in_place());
        assert_eq!(read(&kept), read(&dense));
    }
}
