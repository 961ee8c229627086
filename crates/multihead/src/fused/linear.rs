//! `F.linear` as one candle op on f32 CPU tensors, on gemm's kernels, with its backward; and,
//! for a few rows without a gradient, on the few-rows kernel.

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use super::cpu_f32;

/// `F.linear` as one candle op on f32 CPU tensors: `y = x Wᵀ + b` and its backward
/// (`dx = dy W`, `dW = dyᵀ x`, `db = Σ dy`) straight on gemm's AVX-512 kernels. One graph node
/// instead of candle's reshape, matmul, broadcast add and reshape, each of which allocates and
/// accumulates a full-size gradient in the backward.
pub(crate) struct FusedLinear;

/// Rows of a `(..., k)` layout as a uniformly strided `(m, k)` matrix: `(offset, row stride)`.
pub(crate) fn rows(l: &candle_core::Layout) -> Option<(usize, usize)> {
    let dims = l.dims();
    let st = l.stride();
    let k = *dims.last()?;
    if k > 1 && st[st.len() - 1] != 1 {
        return None;
    }
    // The innermost leading dimension of size > 1 gives the row stride; every outer one must
    // continue it (so the leading dimensions collapse into m evenly strided rows).
    let mut row: Option<usize> = None;
    let mut expect = 0usize;
    for i in (0..dims.len() - 1).rev() {
        if dims[i] == 1 {
            continue;
        }
        match row {
            None => {
                row = Some(st[i]);
                expect = st[i].saturating_mul(dims[i]);
            }
            Some(_) => {
                if st[i] != expect {
                    return None;
                }
                expect = expect.saturating_mul(dims[i]);
            }
        }
    }
    let row = row.unwrap_or(k.max(1));
    Some((l.start_offset(), row))
}

fn f32_slice(s: &candle_core::CpuStorage) -> candle_core::Result<&[f32]> {
    super::cpu_f32(s, "fused linear")
}

/// `dst (m×n) = lhs (m×k) · rhs (k×n)` through strides; `accumulate` adds to `dst`.
#[allow(clippy::too_many_arguments)]
fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: &[f32],
    (lhs_rs, lhs_cs): (usize, usize),
    rhs: &[f32],
    (rhs_rs, rhs_cs): (usize, usize),
    accumulate: bool,
) -> candle_core::Result<()> {
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * rs + (cols - 1) * cs + 1
        }
    };
    if dst.len() < last(m, n, dst_rs, 1)
        || lhs.len() < last(m, k, lhs_rs, lhs_cs)
        || rhs.len() < last(k, n, rhs_rs, rhs_cs)
    {
        candle_core::bail!("fused linear: a buffer is shorter than its layout");
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            dst.iter_mut().for_each(|x| *x = 0.0);
        }
        return Ok(());
    }
    let threads = candle_core::utils::get_num_threads();
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the checks above bound every element the strides address within the three
    // slices; dst is borrowed mutably and does not alias lhs or rhs (distinct borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

impl FusedLinear {
    fn forward(
        &self,
        x: (&[f32], &candle_core::Layout),
        w: (&[f32], &candle_core::Layout),
        b: Option<(&[f32], &candle_core::Layout)>,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        let (x_off, x_rs) =
            rows(x.1).ok_or_else(|| candle_core::Error::Msg("fused linear: x rows".into()))?;
        let (out_f, in_f) = w.1.shape().dims2()?;
        if !w.1.is_contiguous() {
            candle_core::bail!("fused linear: the weight must be contiguous");
        }
        let m = x.1.shape().elem_count() / in_f.max(1);
        let len = m.checked_mul(out_f).ok_or_else(|| {
            candle_core::Error::Msg(format!("fused linear: {m} x {out_f} outputs overflow usize"))
        })?;
        let mut y = crate::alloc::try_zeros::<f32>(len, "fused linear output")?;
        if let Some((b, bl)) = b {
            // `linear` validated the bias and made it contiguous; a layout that still does not
            // fit is an error here, never an out-of-bounds slice.
            let bo = bl.start_offset();
            let bias = match b.get(bo..bo.saturating_add(out_f)) {
                Some(bias) if bl.dims() == [out_f] && bl.is_contiguous() => bias,
                _ => candle_core::bail!(
                    "fused linear: the bias must be a contiguous ({out_f},) tensor, got shape {:?} with strides {:?}",
                    bl.dims(),
                    bl.stride()
                ),
            };
            y.chunks_exact_mut(out_f.max(1)).for_each(|row| row.copy_from_slice(bias));
        }
        let w0 = w.1.start_offset();
        // y (m×out) = x (m×in) · Wᵀ (in×out), Wᵀ[i][j] = W[j][i].
        gemm_f32(
            m,
            out_f,
            in_f,
            &mut y,
            out_f,
            &x.0[x_off..],
            (x_rs, 1),
            &w.0[w0..],
            (1, in_f),
            b.is_some(),
        )?;
        let mut dims = x.1.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out_f;
        }
        Ok((candle_core::CpuStorage::F32(y), candle_core::Shape::from(dims)))
    }

    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let grad = grad.contiguous()?;
        let x = if rows(x.layout()).is_some() { x.clone() } else { x.contiguous()? };
        let w = w.contiguous()?;
        let (out_f, in_f) = w.dims2()?;
        let m = x.elem_count() / in_f.max(1);
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (gs, gl) = grad.storage_and_layout();
        let (x_off, x_rs) =
            rows(xl).ok_or_else(|| candle_core::Error::Msg("fused linear: x rows".into()))?;
        let xv = &f32s(&xs)?[x_off..];
        let wv = &f32s(&ws)?[wl.start_offset()..];
        let gv = &f32s(&gs)?[gl.start_offset()..];
        // dx (m×in) = dy (m×out) · W (out×in)
        let mut dx = crate::alloc::try_zeros::<f32>(m * in_f, "fused linear dx")?;
        gemm_f32(m, in_f, out_f, &mut dx, in_f, gv, (out_f, 1), wv, (in_f, 1), false)?;
        // dW (out×in) = dyᵀ (out×m) · x (m×in)
        let mut dw = crate::alloc::try_zeros::<f32>(out_f * in_f, "fused linear dw")?;
        gemm_f32(out_f, in_f, m, &mut dw, in_f, gv, (1, out_f), xv, (x_rs, 1), false)?;
        // db (out) = Σ_rows dy
        let mut db = vec![0f32; out_f];
        for row in gv[..m * out_f].chunks_exact(out_f.max(1)) {
            db.iter_mut().zip(row).for_each(|(a, b)| *a += b);
        }
        let dev = x.device();
        Ok((
            Tensor::from_vec(dx, x.shape(), dev)?,
            Tensor::from_vec(dw, (out_f, in_f), dev)?,
            Tensor::from_vec(db, out_f, dev)?,
        ))
    }
}

fn f32s(s: &candle_core::Storage) -> candle_core::Result<&[f32]> {
    super::storage_f32(s, "fused linear")
}

impl candle_core::CustomOp2 for FusedLinear {
    fn name(&self) -> &'static str {
        "fused-linear"
    }
    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.forward((f32_slice(s1)?, l1), (f32_slice(s2)?, l2), None)
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.backward(x, w, grad)?;
        Ok((Some(dx), Some(dw)))
    }
}

impl candle_core::CustomOp3 for FusedLinear {
    fn name(&self) -> &'static str {
        "fused-linear-bias"
    }
    fn cpu_fwd(
        &self,
        s1: &candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
        s3: &candle_core::CpuStorage,
        l3: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        self.forward((f32_slice(s1)?, l1), (f32_slice(s2)?, l2), Some((f32_slice(s3)?, l3)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.backward(x, w, grad)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// `y = x Wᵀ (+ b)` for a few rows without a gradient (`multihead_kernels::gemv`): x `(m, k)`,
/// W `(n, k)`, b `(n,)`, all contiguous f32. No backward: `linear` takes it only when no
/// gradient is recorded.
pub(crate) struct RowsLinear;

impl RowsLinear {
    fn run(
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        const NAME: &str = "linear (decode rows)";
        let slice = |s: &'_ CpuStorage, l: &Layout| -> candle_core::Result<(usize, usize)> {
            let _ = cpu_f32(s, NAME)?;
            l.contiguous_offsets().ok_or_else(|| {
                candle_core::Error::Msg(format!("{NAME}: inputs must be contiguous"))
            })
        };
        let ((x0, x1), (w0, w1)) = (slice(xs, xl)?, slice(ws, wl)?);
        let (x, w) = (&cpu_f32(xs, NAME)?[x0..x1], &cpu_f32(ws, NAME)?[w0..w1]);
        let (&[m, k], &[n, k2]) = (xl.dims(), wl.dims()) else {
            candle_core::bail!("{NAME}: expected 2-D x and weight");
        };
        if k != k2 {
            candle_core::bail!("{NAME}: x has {k} features, the weight {k2}");
        }
        let b = match bias {
            Some((bs, bl)) => {
                let (b0, b1) = slice(bs, bl)?;
                Some(&cpu_f32(bs, NAME)?[b0..b1])
            }
            None => None,
        };
        let mut y = crate::alloc::try_zeros::<f32>(m * n, NAME)?;
        multihead_kernels::gemv::linear_rows(x, m, k, w, n, b, &mut y)
            .map_err(|e| candle_core::Error::Msg(format!("{NAME}: {e}")))?;
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

impl candle_core::CustomOp2 for RowsLinear {
    fn name(&self) -> &'static str {
        "linear (decode rows)"
    }
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Self::run(xs, xl, ws, wl, None)
    }
}

impl candle_core::CustomOp3 for RowsLinear {
    fn name(&self) -> &'static str {
        "linear (decode rows)"
    }
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Self::run(xs, xl, ws, wl, Some((bs, bl)))
    }
}
