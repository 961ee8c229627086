//! The gradient of attention sinks over a packed batch.
//!
//! As for one padded batch ([`super::sinks`]): the varlen op folds the sinks into each
//! sequence's row statistics, and [`VarlenSinkGrad`], an identity on its output, joins the
//! sinks to candle's graph. Its backward sums each sequence's `sink_grad` (from the statistics
//! that sequence's forward saved) in sequence order, so the result does not depend on the
//! thread count.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use multihead_kernels::attention::sink_grad;
use rayon::prelude::*;

use super::flash::f32s;
use super::varlen::{Rows, VarlenAttention};
use crate::error::Result;

/// Identity on `(out, sinks) -> out` whose backward computes the sinks' gradient from the
/// varlen op's saved statistics.
struct VarlenSinkGrad {
    op: VarlenAttention,
}

impl CustomOp2 for VarlenSinkGrad {
    fn name(&self) -> &'static str {
        "attention-sinks-varlen"
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
        let (hq, _, _, dv) = self.op.heads;
        let grad = grad_res.contiguous()?;
        let (os, ol) = out.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let (or, gr) = (Rows::of(f32s(&os)?, ol, dv)?, Rows::of(f32s(&gs)?, gl, dv)?);
        let lse = self.op.lse.lock().unwrap_or_else(|e| e.into_inner());
        let spans = self.op.spans();
        if lse.len() != spans.len() {
            candle_core::bail!("{}", super::flash::NO_STATS);
        }
        // Sequences without queries or keys have zero output rows: no gradient.
        let parts: Vec<Vec<f32>> = spans
            .par_iter()
            .enumerate()
            .map(|(b, &((q0, l), (_, s)))| {
                let mut ds = vec![0f32; hq];
                if l == 0 || s == 0 {
                    return Ok(ds);
                }
                let op = self.op.sequence_op(b, l, s);
                let ((ov, o4), (gv, g4)) = (or.part(q0, l), gr.part(q0, l));
                let lse_b = lse.get(b).map(Vec::as_slice).unwrap_or(&[]);
                op.with_params(|p| sink_grad(p, ov, o4, gv, g4, lse_b, &mut ds))?.map_err(|e| {
                    candle_core::Error::Msg(format!("varlen attention sinks backward: {e}"))
                })?;
                Ok(ds)
            })
            .collect::<candle_core::Result<_>>()?;
        let mut ds = crate::alloc::try_zeros::<f32>(hq, "attention sinks gradient")?;
        for part in &parts {
            ds.iter_mut().zip(part).for_each(|(a, b)| *a += b);
        }
        let ds = Tensor::from_vec(ds, sinks.shape(), sinks.device())?;
        Ok((Some(grad_res.clone()), Some(ds)))
    }
}

/// `out` (the result of `op`, which ran with sinks) joined to the graph of `sinks`.
pub(crate) fn attach(op: &VarlenAttention, out: &Tensor, sinks: &Tensor) -> Result<Tensor> {
    let g = VarlenSinkGrad { op: op.clone() };
    Ok(out.apply_op2_arc(sinks, std::sync::Arc::new(Box::new(g)))?)
}
