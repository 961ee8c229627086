//! `torch.nn.Linear` with PyTorch's weight layout `[out_features, in_features]`.

use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};

use crate::error::{fmt_shape, Error, Result};
use crate::state_dict::NamedParameters;

/// A linear layer `y = x Wᵀ + b`, stored as PyTorch stores it (`weight` is `[out, in]`), so a
/// PyTorch state_dict loads unchanged.
///
/// # Shapes
/// * input `(*, in_features)`
/// * output `(*, out_features)`
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::Linear;
///
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let lin = Linear::new(4, 3, true, vb)?;
/// let y = lin.forward(&Tensor::zeros((2, 5, 4), DType::F32, &Device::Cpu)?)?;
/// assert_eq!(y.dims(), &[2, 5, 3]);
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// Builds a layer under the keys `weight` and `bias` of `vb`. Fresh parameters follow
    /// PyTorch's `nn.Linear` initialisation: weight and bias uniform in `±1/√in_features`.
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        let bound = if in_features > 0 { 1.0 / (in_features as f64).sqrt() } else { 0.0 };
        let init = Init::Uniform { lo: -bound, up: bound };
        let weight =
            crate::state_dict::get_param(&vb, &[out_features, in_features], "weight", init)?;
        let bias = if bias {
            Some(crate::state_dict::get_param(&vb, &[out_features], "bias", init)?)
        } else {
            None
        };
        Ok(Self { weight, bias })
    }

    /// Wraps existing tensors: `weight` is `[out, in]`, `bias` is `[out]`.
    pub fn from_weights(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self { weight, bias }
    }

    /// The weight, `[out_features, in_features]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The bias, `[out_features]`, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Applies the layer.
    // Mirrors torch.nn.Linear.forward.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.weight, self.bias.as_ref(), "linear", "input")
    }
}

impl NamedParameters for Linear {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("weight".to_string(), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push(("bias".to_string(), b.clone()));
        }
        v
    }
}

impl candle_core::Module for Linear {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Linear::forward(self, xs).map_err(candle_core::Error::wrap)
    }
}

/// `F.linear(x, weight, bias)` over any leading dimensions.
pub(crate) fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    op: &'static str,
    arg: &'static str,
) -> Result<Tensor> {
    let (out_f, in_f) = weight.dims2()?;
    let dims = x.dims();
    let Some((&last, lead)) = dims.split_last() else {
        return Err(Error::Shape {
            op,
            arg,
            msg: "expected at least a 1-D input, got a 0-D tensor".into(),
        });
    };
    if last != in_f {
        return Err(Error::Shape {
            op,
            arg,
            msg: format!(
                "input of shape {} cannot be multiplied by a weight of shape {} (expected {in_f} input features, got {last})",
                fmt_shape(dims),
                fmt_shape(weight.dims())
            ),
        });
    }
    if x.dtype() != weight.dtype() {
        return Err(Error::DType {
            op,
            arg,
            msg: format!(
                "input dtype {:?} does not match the weight dtype {:?}",
                x.dtype(),
                weight.dtype()
            ),
        });
    }
    let m: usize = lead.iter().product();
    let mut out_dims = lead.to_vec();
    out_dims.push(out_f);
    if m == 0 || in_f == 0 {
        // gemm has nothing to multiply; the product is zero (plus the bias).
        let zeros = Tensor::zeros(out_dims.as_slice(), x.dtype(), x.device())?;
        return Ok(match bias {
            Some(b) if m > 0 => zeros.broadcast_add(b)?,
            _ => zeros,
        });
    }
    if let Some(y) = fused_linear(x, weight, bias)? {
        return Ok(y);
    }
    let x2 = x.reshape((m, in_f))?;
    let mut y = x2.matmul(&weight.t()?)?;
    if let Some(b) = bias {
        y = y.broadcast_add(b)?;
    }
    Ok(y.reshape(out_dims)?)
}

/// `F.linear` as one candle op on f32 CPU tensors: `y = x Wᵀ + b` and its backward
/// (`dx = dy W`, `dW = dyᵀ x`, `db = Σ dy`) straight on gemm's AVX-512 kernels. One graph node
/// instead of candle's reshape, matmul, broadcast add and reshape, each of which allocates and
/// accumulates a full-size gradient in the backward.
struct FusedLinear;

/// Rows of a `(..., k)` layout as a uniformly strided `(m, k)` matrix: `(offset, row stride)`.
fn rows(l: &candle_core::Layout) -> Option<(usize, usize)> {
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
    match s {
        candle_core::CpuStorage::F32(v) => Ok(v),
        _ => candle_core::bail!("fused linear: expected f32"),
    }
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
        let mut y = vec![0f32; m * out_f];
        if let Some((b, bl)) = b {
            let bo = bl.start_offset();
            let bias = &b[bo..bo + out_f];
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
        let mut dx = vec![0f32; m * in_f];
        gemm_f32(m, in_f, out_f, &mut dx, in_f, gv, (out_f, 1), wv, (in_f, 1), false)?;
        // dW (out×in) = dyᵀ (out×m) · x (m×in)
        let mut dw = vec![0f32; out_f * in_f];
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
    match s {
        candle_core::Storage::Cpu(c) => f32_slice(c),
        _ => candle_core::bail!("fused linear: expected a CPU tensor"),
    }
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

/// The fused linear when it applies (f32 CPU, fused kernels enabled, contiguous weight).
fn fused_linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Option<Tensor>> {
    if !crate::fused::usable(x) || !weight.is_contiguous() || x.rank() < 2 {
        return Ok(None);
    }
    let x = if rows(x.layout()).is_some() { x.clone() } else { x.contiguous()? };
    let y = match bias {
        Some(b) => x.apply_op3(weight, b, FusedLinear)?,
        None => x.apply_op2(weight, FusedLinear)?,
    };
    Ok(Some(y))
}
