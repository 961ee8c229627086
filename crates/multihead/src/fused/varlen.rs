//! Flash attention over a packed batch of variable-length sequences (FlashAttention's
//! `cu_seqlens` convention) as one candle `CustomOp3` with a backward.
//!
//! q `(Tq, Hq·D)` or `(Tq, Hq, D)` and k, v `(Tk, Hkv·D)` or `(Tk, Hkv, D)` hold the sequences
//! one after another: sequence `b` is rows `cu_q[b]..cu_q[b + 1]` of q and `cu_k[b]..cu_k[b +
//! 1]` of k and v. Each sequence runs the kernels on its own rows (a batch of one, read in
//! place through its rows' strides), so no padding is computed; the sequences run in parallel
//! and each writes only its own rows of the output and the gradients (the same bits for any
//! thread count).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use multihead_kernels::attention::{
    flash_backward, flash_forward_uninit, AttnDims, KernelError, Layout4,
};
use multihead_kernels::dropout::DropoutKey;
use rayon::prelude::*;

use super::flash::{cpu_f32, f32s, Convention, FlashAttention};
use crate::error::Result;

/// The dropout key of sequence `b`: its rows and heads draw as a batch of one under a key of
/// their own (the composed path uses the same).
pub(crate) fn sequence_key(key: DropoutKey, b: usize) -> DropoutKey {
    DropoutKey { seed: key.seed, offset: key.offset.wrapping_add((b as u64 + 1) << 32) }
}

/// The op for one packed call. Clones share the saved statistics.
#[derive(Clone)]
pub(crate) struct VarlenAttention {
    pub cu_q: Arc<Vec<usize>>,
    pub cu_k: Arc<Vec<usize>>,
    /// Query heads, key/value heads, query/key and value head sizes.
    pub heads: (usize, usize, usize, usize),
    pub scale: f32,
    pub causal: bool,
    pub dropout: Option<(f64, DropoutKey)>,
    pub variants: Arc<crate::Variants>,
    /// Attention sinks, one per query head (their gradient: [`super::varlen_sinks`]).
    pub sinks: Option<Arc<Vec<f32>>>,
    /// Each sequence's row statistics (none where the forward kept none: see `keep_stats`).
    pub(super) lse: Arc<Mutex<Vec<Vec<f32>>>>,
    /// Whether the forward keeps the row statistics for a backward (as
    /// `FlashAttention::keep_stats`).
    keep_stats: bool,
    /// Whether the products take bf16 operands (a bf16 call under rounded products, decided
    /// on the calling thread as `FlashAttention::with_rounded_products` decides it: the
    /// sequences run on the pool's threads, which do not see the caller's mode).
    bf16_products: bool,
}

/// One input's rows: the data from the view's start, the stride between rows and between
/// heads.
pub(super) struct Rows<'a> {
    data: &'a [f32],
    row: usize,
    head: usize,
}

impl<'a> Rows<'a> {
    pub(super) fn of(s: &'a [f32], l: &Layout, head_dim: usize) -> candle_core::Result<Self> {
        let (dims, st) = (l.dims(), l.stride());
        let (row, head, last) = match dims.len() {
            2 => (st[0], head_dim, st[1]),
            3 => (st[0], st[1], st[2]),
            r => candle_core::bail!("varlen attention: expected 2-D or 3-D input, got {r}-D"),
        };
        if last != 1 && dims[dims.len() - 1] > 1 {
            candle_core::bail!("varlen attention: the feature dimension must be contiguous");
        }
        // An empty view may start at (or past) the end of an empty storage.
        Ok(Rows { data: s.get(l.start_offset()..).unwrap_or(&[]), row, head })
    }

    /// Rows `from..from + n` as a batch of one `[1, heads, n, d]`.
    pub(super) fn part(&self, from: usize, n: usize) -> (&'a [f32], Layout4) {
        let l4 = Layout4 { batch: 0, head: self.head, seq: self.row };
        if n == 0 {
            return (&self.data[..0], l4);
        }
        (&self.data[from * self.row..], l4)
    }
}

/// `rows` (`t` rows of `heads` heads of `width` floats) copied head-major, `[heads, t, width]`,
/// with its view: every sequence's keys and values then read contiguous rows, and one copy of
/// one size per call replaces a copy per sequence (sizes that vary from call to call defeat
/// the allocator's cache of large blocks: measured, 16% of a packed forward went to faulting
/// in fresh pages). `None` when the rows are contiguous already (one head).
fn head_major(
    rows: &Rows<'_>,
    (t, heads, width): (usize, usize, usize),
) -> candle_core::Result<Option<Vec<f32>>> {
    if heads <= 1 || rows.row == width || t == 0 || width == 0 {
        return Ok(None);
    }
    let n = t * heads * width;
    let mut buf: Vec<f32> = Vec::new();
    buf.try_reserve_exact(n).map_err(|_| {
        candle_core::Error::Msg(format!("varlen attention: cannot allocate {n} floats of keys"))
    })?;
    buf.spare_capacity_mut()[..n].par_chunks_mut(t * width).enumerate().for_each(|(h, dst)| {
        for (i, row) in dst.chunks_exact_mut(width).enumerate() {
            let src = &rows.data[i * rows.row + h * rows.head..][..width];
            // SAFETY: `row` is `width` uninitialised floats of `buf`'s reserved capacity and
            // `src` is `width` floats of the input; they cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), row.as_mut_ptr().cast(), width) };
        }
    });
    // SAFETY: the loop above initialised all `n` elements (`heads` chunks of `t·width`).
    unsafe { buf.set_len(n) };
    Ok(Some(buf))
}

impl VarlenAttention {
    pub(crate) fn new(
        (cu_q, cu_k): (Vec<usize>, Vec<usize>),
        heads: (usize, usize, usize, usize),
        scale: f32,
        causal: bool,
        dropout: Option<(f64, DropoutKey)>,
        variants: &crate::Variants,
    ) -> Self {
        Self {
            cu_q: Arc::new(cu_q),
            cu_k: Arc::new(cu_k),
            heads,
            scale,
            causal,
            dropout,
            variants: Arc::new(variants.clone()),
            sinks: None,
            lse: Arc::default(),
            keep_stats: true,
            bf16_products: false,
        }
    }

    /// The same op with its products' operands rounded to bf16 where the calling thread
    /// asks for rounded products (PyTorch's bf16 flash kernel, per sequence; not with grouped
    /// heads or dropout, where PyTorch takes its math path: see
    /// `FlashAttention::with_rounded_products`).
    pub(crate) fn with_rounded_products(self) -> Self {
        let (hq, hk, _, _) = self.heads;
        let dropout = self.dropout.is_some_and(|(p, _)| p > 0.0);
        let on = crate::mode::in_rounded_products() && hq == hk && !dropout;
        Self { bf16_products: on, ..self }
    }

    /// The same op with attention sinks, one per query head (validated by the caller).
    pub(crate) fn with_sinks(self, sinks: Vec<f32>) -> Self {
        Self { sinks: Some(Arc::new(sinks)), ..self }
    }

    /// The sequences' `(query rows, key rows)`.
    pub(super) fn spans(&self) -> Vec<((usize, usize), (usize, usize))> {
        let q = self.cu_q.windows(2).map(|w| (w[0], w[1] - w[0]));
        let k = self.cu_k.windows(2).map(|w| (w[0], w[1] - w[0]));
        q.zip(k).collect()
    }

    /// The flash op of sequence `b` with `l` queries and `s` keys (a batch of one).
    pub(super) fn sequence_op(&self, b: usize, l: usize, s: usize) -> FlashAttention {
        let (hq, hk, d, dv) = self.heads;
        let dims = AttnDims { batch: 1, heads_q: hq, heads_kv: hk, l, s, d, dv };
        let dropout = self.dropout.map(|(p, key)| (p, sequence_key(key, b)));
        let op = FlashAttention::new(
            dims,
            self.scale,
            self.causal,
            Vec::new(),
            dropout,
            Convention::Bhtd,
        )
        .with_variants(&self.variants)
        .with_bf16_products(self.bf16_products);
        match &self.sinks {
            Some(x) => op.with_sinks(x.to_vec()),
            None => op,
        }
    }

    /// The output rows of each sequence: `buf` (rows of `width` floats) split at the query
    /// offsets.
    fn split_rows<'b, T>(
        &self,
        mut buf: &'b mut [T],
        cu: &[usize],
        width: usize,
    ) -> Vec<&'b mut [T]> {
        let mut parts = Vec::with_capacity(cu.len());
        for w in cu.windows(2) {
            let (head, rest) = buf.split_at_mut((w[1] - w[0]) * width);
            parts.push(head);
            buf = rest;
        }
        parts
    }
}

fn kernel_err(what: &str, e: KernelError) -> candle_core::Error {
    candle_core::Error::Msg(format!("varlen attention {what}: {e}"))
}

impl CustomOp3 for VarlenAttention {
    fn name(&self) -> &'static str {
        "flash-attention-varlen"
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
        let (hq, hk, d, dv) = self.heads;
        let (q, k, v) = (
            Rows::of(cpu_f32(s1)?, l1, d)?,
            Rows::of(cpu_f32(s2)?, l2, d)?,
            Rows::of(cpu_f32(s3)?, l3, dv)?,
        );
        let (tq, tk) = (l1.dims()[0], l2.dims()[0]);
        // Contiguous keys and values for the whole call when its longest query and key runs
        // (perhaps of different sequences: erring towards the copy) would re-read more than a
        // key block (`forward_copies_keys`); read in place otherwise.
        let longest = |cu: &[usize]| cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        let (lq, lk) = (longest(&self.cu_q), longest(&self.cu_k));
        let copy = multihead_kernels::attention::forward_copies_keys(lq, lk, hq, hk);
        let (kc, vc) = match copy {
            true => (head_major(&k, (tk, hk, d))?, head_major(&v, (tk, hk, dv))?),
            false => (None, None),
        };
        let k = match &kc {
            Some(buf) => Rows { data: buf, row: d, head: tk * d },
            None => k,
        };
        let v = match &vc {
            Some(buf) => Rows { data: buf, row: dv, head: tk * dv },
            None => v,
        };
        // The sequences' rows must tile the output exactly: none is left unwritten.
        if self.cu_q.last().copied().unwrap_or(0) != tq {
            candle_core::bail!("varlen attention: the query offsets do not end at {tq} rows");
        }
        let n = tq * hq * dv;
        let mut out = crate::alloc::try_empty::<f32>(n, "varlen attention output")?;
        let o4 = Layout4 { batch: 0, head: dv, seq: hq * dv };
        let spans = self.spans();
        let outs = self.split_rows(&mut out.spare_capacity_mut()[..n], &self.cu_q, hq * dv);
        let keep = self.keep_stats;
        let lse: Vec<Vec<f32>> = outs
            .into_par_iter()
            .zip(spans.par_iter().enumerate())
            .map(|(o, (b, &((q0, l), (k0, s))))| {
                let mut lse = if keep { vec![0f32; 2 * hq * l] } else { Vec::new() };
                if l == 0 || s == 0 {
                    // No keys: zero rows (as for fully masked rows), statistics (0, inf).
                    o.fill(std::mem::MaybeUninit::new(0.0));
                    if keep {
                        lse[hq * l..].fill(f32::INFINITY);
                    }
                    return Ok(lse);
                }
                let op = self.sequence_op(b, l, s);
                let ((qs, q4), (ks, k4), (vs, v4)) = (q.part(q0, l), k.part(k0, s), v.part(k0, s));
                let stats = keep.then_some(&mut lse[..]);
                op.with_params(|p| flash_forward_uninit(p, qs, q4, ks, k4, vs, v4, o, o4, stats))?
                    .map_err(|e| kernel_err("forward", e))?;
                Ok(lse)
            })
            .collect::<candle_core::Result<_>>()?;
        // SAFETY: every sequence's rows were written on success (zeros where it has no keys or
        // no queries, the kernel's output otherwise: `flash_forward_uninit` writes every
        // element of a contiguous output), and the sequences' rows tile all `tq` rows.
        unsafe { out.set_len(n) };
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = if keep { lse } else { Vec::new() };
        let shape = match l1.dims().len() {
            3 => Shape::from((tq, hq, dv)),
            _ => Shape::from((tq, hq * dv)),
        };
        Ok((CpuStorage::F32(out), shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (hq, hk, d, dv) = self.heads;
        let grad = grad_res.contiguous()?;
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (os, ol) = res.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let (qr, kr, vr) = (
            Rows::of(f32s(&qs)?, ql, d)?,
            Rows::of(f32s(&ks)?, kl, d)?,
            Rows::of(f32s(&vs)?, vl, dv)?,
        );
        let (or, gr) = (Rows::of(f32s(&os)?, ol, dv)?, Rows::of(f32s(&gs)?, gl, dv)?);
        let mut dq = crate::alloc::try_zeros::<f32>(q.elem_count(), "varlen attention dq")?;
        let mut dk = crate::alloc::try_zeros::<f32>(k.elem_count(), "varlen attention dk")?;
        let mut dvv = crate::alloc::try_zeros::<f32>(v.elem_count(), "varlen attention dv")?;
        let (dq4, dk4, dv4) = (
            Layout4 { batch: 0, head: d, seq: hq * d },
            Layout4 { batch: 0, head: d, seq: hk * d },
            Layout4 { batch: 0, head: dv, seq: hk * dv },
        );
        let spans = self.spans();
        let lse = self.lse.lock().unwrap_or_else(|e| e.into_inner());
        if lse.len() != spans.len() {
            candle_core::bail!("{}", super::flash::NO_STATS);
        }
        let dqs = self.split_rows(&mut dq, &self.cu_q, hq * d);
        let dks = self.split_rows(&mut dk, &self.cu_k, hk * d);
        let dvs = self.split_rows(&mut dvv, &self.cu_k, hk * dv);
        dqs.into_par_iter()
            .zip(dks.into_par_iter().zip(dvs.into_par_iter()))
            .zip(spans.par_iter().enumerate())
            .try_for_each(|((dqb, (dkb, dvb)), (b, &((q0, l), (k0, s))))| {
                if l == 0 || s == 0 {
                    return Ok(()); // zero gradients
                }
                let op = self.sequence_op(b, l, s);
                let ((qv, q4), (kv, k4), (vv, v4)) =
                    (qr.part(q0, l), kr.part(k0, s), vr.part(k0, s));
                let ((ov, o4), (gv, g4)) = (or.part(q0, l), gr.part(q0, l));
                let lse_b = lse.get(b).map(Vec::as_slice).unwrap_or(&[]);
                op.with_params(|p| {
                    flash_backward(
                        p, qv, q4, kv, k4, vv, v4, ov, o4, gv, g4, lse_b, dqb, dq4, dkb, dk4, dvb,
                        dv4,
                    )
                })?
                .map_err(|e| kernel_err("backward", e))
            })?;
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, q.shape(), dev)?),
            Some(Tensor::from_vec(dk, k.shape(), dev)?),
            Some(Tensor::from_vec(dvv, v.shape(), dev)?),
        ))
    }
}

impl VarlenAttention {
    /// Applies the op to `(q, k, v)`; the result is differentiable through [`CustomOp3::bwd`].
    /// The row statistics are kept for a backward only where one can be asked for
    /// (gradients enabled, or an input carrying a graph).
    pub(crate) fn apply(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let op = Self { keep_stats: super::flash::gradient_possible(&[q, k, v]), ..self.clone() };
        Ok(q.apply_op3_arc(k, v, Arc::new(Box::new(op)))?)
    }
}
