//! LayerNorm as one candle op on f32 CPU tensors, over `multihead_kernels::norm`: the forward
//! saves each row's mean and `1/σ`, the backward reuses them. One graph node instead of the
//! composed form's eight element-wise passes (each a fresh tensor).

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Shape, Tensor};
use multihead_kernels::norm::{
    add_layer_norm_forward_uninit, layer_norm_backward_uninit, layer_norm_forward_uninit, NormStats,
};

use crate::error::Result;

/// The op for one call; clones share the saved statistics.
#[derive(Clone)]
pub(crate) struct LayerNormOp {
    eps: f32,
    stats: Arc<Mutex<NormStats>>,
}

fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> candle_core::Result<&'a [f32]> {
    let v = super::cpu_f32(s, "fused layer_norm")?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("fused layer_norm: {what} must be contiguous"),
    }
}

fn storage_f32<'a>(
    t: &'a candle_core::Storage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<&'a [f32]> {
    match t {
        candle_core::Storage::Cpu(c) => contiguous_f32(c, l, what),
        _ => candle_core::bail!("fused layer_norm: {what} must be on the CPU"),
    }
}

impl LayerNormOp {
    fn forward(
        &self,
        x: (&[f32], &Layout),
        w: &[f32],
        b: Option<&[f32]>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = w.len();
        let rows = x.0.len().checked_div(d).unwrap_or(0);
        let mut stats = NormStats::new(rows);
        let write = |y: &mut [std::mem::MaybeUninit<f32>]| {
            layer_norm_forward_uninit(x.0, d, w, b, self.eps, y, &mut stats)
                .map_err(|e| candle_core::Error::Msg(format!("fused layer_norm: {e}")))
        };
        // SAFETY: on `Ok` the kernel has written every element of `y` (its `_uninit` contract).
        let y = unsafe { crate::alloc::try_written(x.0.len(), "fused layer_norm output", write) }?;
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
        Ok((CpuStorage::F32(y), x.1.shape().clone()))
    }

    fn backward(&self, x: &Tensor, w: &Tensor, grad: &Tensor) -> candle_core::Result<[Tensor; 3]> {
        let (x, w, grad) = (x.contiguous()?, w.contiguous()?, grad.contiguous()?);
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let (xv, wv) = (storage_f32(&xs, xl, "x")?, storage_f32(&ws, wl, "weight")?);
        let gv = storage_f32(&gs, gl, "grad")?;
        let d = wv.len();
        let (mut dw, mut db) = (vec![0f32; d], vec![0f32; d]);
        let stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let write = |dx: &mut [std::mem::MaybeUninit<f32>]| {
            layer_norm_backward_uninit(xv, gv, d, wv, &stats, dx, &mut dw, &mut db)
                .map_err(|e| candle_core::Error::Msg(format!("fused layer_norm backward: {e}")))
        };
        // SAFETY: on `Ok` the kernel has written every element of `dx` (its `_uninit` contract).
        let dx = unsafe { crate::alloc::try_written(xv.len(), "fused layer_norm dx", write) }?;
        let dev = x.device();
        Ok([
            Tensor::from_vec(dx, x.shape(), dev)?,
            Tensor::from_vec(dw, d, dev)?,
            Tensor::from_vec(db, d, dev)?,
        ])
    }
}

impl CustomOp2 for LayerNormOp {
    fn name(&self) -> &'static str {
        "fused-layer-norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = contiguous_f32(s1, l1, "x")?;
        self.forward((x, l1), contiguous_f32(s2, l2, "weight")?, None)
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, _] = self.backward(x, w, grad)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for LayerNormOp {
    fn name(&self) -> &'static str {
        "fused-layer-norm-bias"
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
        let x = contiguous_f32(s1, l1, "x")?;
        let b = contiguous_f32(s3, l3, "bias")?;
        self.forward((x, l1), contiguous_f32(s2, l2, "weight")?, Some(b))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, db] = self.backward(x, w, grad)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// `F.layer_norm(x, (d,), w, b, eps)` as one op; `x`, `w`, `b` are made contiguous first.
pub(crate) fn layer_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    let op = LayerNormOp { eps: eps as f32, stats: Arc::new(Mutex::new(NormStats::default())) };
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    Ok(match b {
        Some(b) => x.apply_op3_arc(&w, &b.contiguous()?, Arc::new(Box::new(op)))?,
        None => x.apply_op2_arc(&w, Arc::new(Box::new(op)))?,
    })
}

/// `F.layer_norm(x + residual, (d,), w, b, eps)` as one op: the sum and the norm in one pass
/// (`multihead_kernels::norm::add_layer_norm_forward`), so the sum is never a tensor of its
/// own: no separate add pass in the forward, and in the backward no full-size gradient that
/// candle would zero and accumulate for it. The backward gives the sum's gradient to both
/// inputs. The third input holds the weight, then the bias when there is one.
pub(crate) struct AddLayerNormOp {
    eps: f32,
    bias: bool,
    /// Keep the sum for the backward (a gradient may be recorded).
    keep_sum: bool,
    stats: Mutex<NormStats>,
    sum: Mutex<Option<Arc<Vec<f32>>>>,
}

impl AddLayerNormOp {
    fn params<'a>(&self, wb: &'a [f32]) -> (&'a [f32], Option<&'a [f32]>) {
        if self.bias {
            let (w, b) = wb.split_at(wb.len() / 2);
            (w, Some(b))
        } else {
            (wb, None)
        }
    }

    fn backward(&self, x: &Tensor, grad: &Tensor, wb: &Tensor) -> candle_core::Result<[Tensor; 2]> {
        let sum = self.sum.lock().unwrap_or_else(|e| e.into_inner()).clone().ok_or_else(|| {
            candle_core::Error::Msg(
                "fused add+layer_norm: the sum was not kept (the forward recorded no gradient)"
                    .into(),
            )
        })?;
        let (grad, wb) = (grad.contiguous()?, wb.contiguous()?);
        let (gs, gl) = grad.storage_and_layout();
        let (ws, wl) = wb.storage_and_layout();
        let gv = storage_f32(&gs, gl, "grad")?;
        let (w, _) = self.params(storage_f32(&ws, wl, "weight")?);
        let d = w.len();
        let (mut dw, mut db) = (vec![0f32; d], vec![0f32; d]);
        let stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let write = |dz: &mut [std::mem::MaybeUninit<f32>]| {
            layer_norm_backward_uninit(&sum, gv, d, w, &stats, dz, &mut dw, &mut db)
                .map_err(|e| candle_core::Error::Msg(format!("fused add+layer_norm backward: {e}")))
        };
        // SAFETY: on `Ok` the kernel has written every element of `dz` (its `_uninit` contract).
        let dz = unsafe { crate::alloc::try_written(sum.len(), "fused add+layer_norm dx", write) }?;
        if self.bias {
            dw.extend_from_slice(&db);
        }
        let dev = x.device();
        Ok([Tensor::from_vec(dz, x.shape(), dev)?, Tensor::from_vec(dw, wb.shape(), dev)?])
    }
}

impl CustomOp3 for AddLayerNormOp {
    fn name(&self) -> &'static str {
        "fused-add-layer-norm"
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
        if l1.shape() != l2.shape() {
            candle_core::bail!(
                "fused add+layer_norm: x {:?} and residual {:?} differ in shape",
                l1.dims(),
                l2.dims()
            );
        }
        let (x, r) = (contiguous_f32(s1, l1, "x")?, contiguous_f32(s2, l2, "residual")?);
        let (w, b) = self.params(contiguous_f32(s3, l3, "weight")?);
        let rows = x.len().checked_div(w.len()).unwrap_or(0);
        let mut stats = NormStats::new(rows);
        let mut sum = None;
        let eps = self.eps;
        let err = |e| candle_core::Error::Msg(format!("fused add+layer_norm: {e}"));
        // Neither buffer is zeroed first: the kernel writes every element of both.
        let write_y = |y: &mut [std::mem::MaybeUninit<f32>]| {
            if !self.keep_sum {
                return add_layer_norm_forward_uninit(
                    x,
                    r,
                    w.len(),
                    w,
                    b,
                    eps,
                    None,
                    y,
                    &mut stats,
                )
                .map_err(err);
            }
            let write_z = |z: &mut [std::mem::MaybeUninit<f32>]| {
                add_layer_norm_forward_uninit(x, r, w.len(), w, b, eps, Some(z), y, &mut stats)
                    .map_err(err)
            };
            // SAFETY: on `Ok` the kernel has written every element of `z` and `y`.
            sum = Some(unsafe {
                crate::alloc::try_written(x.len(), "fused add+layer_norm sum", write_z)
            }?);
            Ok(())
        };
        // SAFETY: on `Ok` the kernel has written every element of `y` (in either branch).
        let y =
            unsafe { crate::alloc::try_written(x.len(), "fused add+layer_norm output", write_y) }?;
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
        *self.sum.lock().unwrap_or_else(|e| e.into_inner()) = sum.map(Arc::new);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        _r: &Tensor,
        wb: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dz, dwb] = self.backward(x, grad, wb)?;
        Ok((Some(dz.clone()), Some(dz), Some(dwb)))
    }
}

/// `F.layer_norm(x + residual, (d,), w, b, eps)` as one op (`x` and `residual` of one shape;
/// made contiguous first).
pub(crate) fn add_layer_norm(
    x: &Tensor,
    residual: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let keep_sum =
        x.track_op() || residual.track_op() || w.track_op() || b.is_some_and(Tensor::track_op);
    let op = AddLayerNormOp {
        eps: eps as f32,
        bias: b.is_some(),
        keep_sum,
        stats: Mutex::new(NormStats::default()),
        sum: Mutex::new(None),
    };
    let wb = match b {
        Some(b) => Tensor::cat(&[w, b], 0)?,
        None => w.clone(),
    };
    let (x, r, wb) = (x.contiguous()?, residual.contiguous()?, wb.contiguous()?);
    Ok(x.apply_op3_arc(&r, &wb, Arc::new(Box::new(op)))?)
}

/// `F.layer_norm(x, (d,), w, b, eps)`, or of `x + residual`, in inference with `x` in f32 or
/// bf16 and the result in `out` (f32 or bf16): the bits of widening `x`, [`layer_norm`] (or
/// [`add_layer_norm`]), and rounding the result, in one pass over the rows
/// (`multihead_kernels::norm::layer_norm_forward_mixed`), so that a bf16 layer's norms keep
/// neither the widened input nor the f32 output in memory. Records no gradient: the caller
/// runs it only where none is recorded. `x` and `residual` (f32) have one shape and are made
/// contiguous first; `w` and `b` are f32 of the last dimension.
pub(crate) fn layer_norm_mixed(
    x: &Tensor,
    residual: Option<&Tensor>,
    (w, b): (&Tensor, Option<&Tensor>),
    eps: f64,
    out: candle_core::DType,
) -> Result<Tensor> {
    use candle_core::{DType, Storage};
    use multihead_kernels::norm::{layer_norm_forward_mixed, NormInput, NormOutput};
    const OP: &str = "fused layer_norm";
    if let Some(r) = residual.filter(|r| r.dims() != x.dims()) {
        let (xd, rd) = (x.dims(), r.dims());
        let msg = format!("the residual must have the input's shape {xd:?}, got {rd:?}");
        return Err(crate::Error::Shape { op: "layer_norm", arg: "residual", msg });
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let r = residual.map(Tensor::contiguous).transpose()?;
    let b = b.map(Tensor::contiguous).transpose()?;
    let (xs, xl) = x.storage_and_layout();
    let res = r.as_ref().map(|r| r.storage_and_layout());
    let (ws, wl) = w.storage_and_layout();
    let input = match &*xs {
        Storage::Cpu(CpuStorage::BF16(v)) => {
            let (a, z) = xl
                .contiguous_offsets()
                .ok_or_else(|| candle_core::Error::Msg(format!("{OP}: x must be contiguous")))?;
            NormInput::Bf16(super::convert::bits(&v[a..z]))
        }
        s => NormInput::F32(storage_f32(s, xl, "x")?),
    };
    let rv = match &res {
        Some((rs, rl)) => Some(storage_f32(rs, rl, "residual")?),
        None => None,
    };
    let wv = storage_f32(&ws, wl, "weight")?;
    let bias = b.as_ref().map(|b| b.storage_and_layout());
    let bv = match &bias {
        Some((bs, bl)) => Some(storage_f32(bs, bl, "bias")?),
        None => None,
    };
    let n = x.elem_count();
    let rows = n.checked_div(wv.len()).unwrap_or(0);
    let mut stats = NormStats::new(rows);
    let err = |e| candle_core::Error::Msg(format!("{OP}: {e}"));
    let eps = eps as f32;
    let dev = x.device();
    Ok(match out {
        DType::BF16 => {
            let write = |y: &mut [std::mem::MaybeUninit<u16>]| {
                let y = NormOutput::Bf16(y);
                layer_norm_forward_mixed(input, rv, wv.len(), (wv, bv), eps, y, &mut stats)
                    .map_err(err)
            };
            // SAFETY: on `Ok` the kernel has written every element of `y`.
            let y = unsafe { crate::alloc::try_written(n, "fused layer_norm output", write) }?;
            Tensor::from_vec(super::convert::from_bits(y), x.shape(), dev)?
        }
        DType::F32 => {
            let write = |y: &mut [std::mem::MaybeUninit<f32>]| {
                let y = NormOutput::F32(y);
                layer_norm_forward_mixed(input, rv, wv.len(), (wv, bv), eps, y, &mut stats)
                    .map_err(err)
            };
            // SAFETY: on `Ok` the kernel has written every element of `y`.
            let y = unsafe { crate::alloc::try_written(n, "fused layer_norm output", write) }?;
            Tensor::from_vec(y, x.shape(), dev)?
        }
        other => {
            let msg = format!("the output dtype must be f32 or bf16, got {other:?}");
            return Err(crate::Error::DType { op: "layer_norm", arg: "out", msg });
        }
    })
}
