//! `F.linear` as one candle op on f32 CPU tensors, on gemm's kernels, with its backward (and on
//! bf16 tensors with bf16 products, on the bf16 GEMM); and, for a few rows without a gradient,
//! on the few-rows kernel.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, DType, Layout, Shape, Tensor};
use multihead_kernels::bf16gemm::{BfMat, Elems};
pub(crate) use multihead_kernels::epilogue::Act;
use multihead_kernels::epilogue::{bias_act_in_place, bias_act_into};

/// `F.linear` as one candle op on f32 CPU tensors: `y = x Wᵀ + b` and its backward
/// (`dx = dy W`, `dW = dyᵀ x`, `db = Σ dy`) straight on gemm's AVX-512 kernels. One graph node
/// instead of candle's reshape, matmul, broadcast add and reshape, each of which allocates and
/// accumulates a full-size gradient in the backward.
///
/// With an activation, the op is `act(x Wᵀ + b)` (a feed-forward block's first half), so the
/// pre-activation is never a graph node of its own (candle would allocate, zero and add a
/// full-size gradient for it). ReLU runs in place, and its backward selects the gradient by
/// the output (PyTorch's `threshold_backward`). GELU keeps the pre-activation inside the op
/// for its backward when a gradient is recorded, and runs in place otherwise.
///
/// With bf16 products on, the op also takes bf16 tensors as they are (a bf16 `Linear` in
/// training): the products read the bf16 operands, the bias and activation run in f32 and the
/// output is rounded once; the backward widens the output gradient, multiplies it with the
/// bf16 operands and rounds `dx`, `dW` and `db` once. These are the numbers of the widened
/// path (the op on the f32 copies, its output rounded), without its conversions and graph
/// nodes.
pub(crate) struct FusedLinear {
    act: Act,
    /// Keep the pre-activation for the backward (GELU with a gradient recorded).
    keep_pre: bool,
    /// The products (forward and backward) take bf16 operands (`multihead_kernels::bf16gemm`).
    bf16: bool,
    pre: Mutex<Option<Arc<Vec<f32>>>>,
}

impl FusedLinear {
    /// The op for `act(x Wᵀ + b)`; `graded` says whether a backward may run.
    pub(crate) fn new(act: Act, graded: bool) -> Self {
        FusedLinear {
            act,
            keep_pre: graded && act == Act::Gelu,
            bf16: false,
            pre: Mutex::new(None),
        }
    }

    /// The same op with its products' operands rounded to bf16 (forward: x and W; backward:
    /// the output gradient, W and x), summed in f32, when `on`: a bf16 module's computation
    /// under `Bf16Products::Direct` (see `crate::mode::rounded_products`).
    pub(crate) fn with_bf16_products(self, on: bool) -> Self {
        FusedLinear { bf16: on, ..self }
    }
}

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

/// Elements a `rows × cols` view with these strides spans (largest offset + 1; 0 if empty).
fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        // Saturating: an absurd layout then fails the length check instead of wrapping.
        (rows - 1)
            .saturating_mul(rs)
            .saturating_add((cols - 1).saturating_mul(cs))
            .saturating_add(1)
    }
}

/// Multiply-adds below which a product runs on one thread (about 10 µs of one core).
const SERIAL_BELOW: usize = 1 << 20;

/// One product `dst (m×n, row stride n) = lhs (m×k) · rhs (k×n)` through strides.
struct Product<'a> {
    m: usize,
    n: usize,
    k: usize,
    lhs: Elems<'a>,
    lhs_strides: (usize, usize),
    rhs: Elems<'a>,
    rhs_strides: (usize, usize),
    /// The operands rounded to bf16 and multiplied on the bf16 kernel (bf16 operands need it).
    bf16: bool,
}

/// Elements of an f32 or bf16 operand.
fn elems_len(e: &Elems) -> usize {
    match e {
        Elems::F32(v) => v.len(),
        Elems::Bf16(v) => v.len(),
    }
}

impl Product<'_> {
    /// Checks that the operands hold their views; returns `m · n`.
    fn check(&self) -> candle_core::Result<usize> {
        let (m, n, k) = (self.m, self.n, self.k);
        if elems_len(&self.lhs) < span(m, k, self.lhs_strides.0, self.lhs_strides.1)
            || elems_len(&self.rhs) < span(k, n, self.rhs_strides.0, self.rhs_strides.1)
        {
            candle_core::bail!("fused linear: a buffer is shorter than its layout");
        }
        m.checked_mul(n).ok_or_else(|| {
            candle_core::Error::Msg(format!("fused linear: {m} x {n} outputs overflow usize"))
        })
    }

    /// Runs gemm into `dst`, which holds `m · n` elements (`accumulate`: `dst +=`).
    ///
    /// # Safety
    ///
    /// `lhs` and `rhs` are the f32 data of `self.lhs` and `self.rhs`, `check` passed, `dst` is
    /// valid for writes of `m · n` floats (and reads, with `accumulate`) and does not overlap
    /// the operands.
    unsafe fn run(&self, lhs: &[f32], rhs: &[f32], dst: *mut f32, accumulate: bool) {
        // rayon's count of the pool this runs in (candle's `get_num_threads` parses
        // /proc/cpuinfo on every call unless RAYON_NUM_THREADS is set: ~5% of a small
        // model's training step).
        let threads = rayon::current_num_threads();
        // A small product runs on the calling thread: waking the pool for it costs more than
        // it saves (a sequence of 17 tokens at width 64: most of the time went to idle
        // threads yielding).
        let macs = self.m.saturating_mul(self.n).saturating_mul(self.k);
        let par = if threads > 1 && macs >= SERIAL_BELOW {
            gemm::Parallelism::Rayon(threads)
        } else {
            gemm::Parallelism::None
        };
        let ((lrs, lcs), (rrs, rcs)) = (self.lhs_strides, self.rhs_strides);
        // SAFETY: `check` bounds every element the strides address within the operands; the
        // caller guarantees `dst`.
        unsafe {
            gemm::gemm(
                self.m,
                self.n,
                self.k,
                dst,
                1,
                self.n as isize,
                accumulate,
                lhs.as_ptr(),
                lcs as isize,
                lrs as isize,
                rhs.as_ptr(),
                rcs as isize,
                rrs as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
    }

    /// The product in a new buffer. gemm writes every element, so the buffer is not zeroed
    /// first (a pass over memory saved).
    fn new_output(&self, what: &str) -> candle_core::Result<Vec<f32>> {
        let len = self.check()?;
        if self.bf16 {
            return self.bf16_output(len, what);
        }
        let (Elems::F32(lhs), Elems::F32(rhs)) = (self.lhs, self.rhs) else {
            candle_core::bail!("{what}: bf16 operands need bf16 products");
        };
        let mut y: Vec<f32> = Vec::new();
        y.try_reserve_exact(len).map_err(|_| {
            candle_core::Error::Msg(format!("{what}: {len} floats cannot be allocated"))
        })?;
        if len == 0 || self.k == 0 {
            y.resize(len, 0.0);
            return Ok(y);
        }
        // SAFETY: `y` has capacity for `len` floats and is a fresh allocation; gemm writes all
        // `len` of them (`k > 0`, `accumulate` false: the destination is not read), so every
        // element is initialised before `set_len`.
        unsafe {
            self.run(lhs, rhs, y.as_mut_ptr(), false);
            y.set_len(len);
        }
        Ok(y)
    }
}

impl Product<'_> {
    /// `bf16(act(product + bias))` of the bf16-rounded operands (f32 sums) in a new bf16
    /// buffer: the epilogue runs on each tile as it leaves the kernel (no f32 output in
    /// memory), with the bits of [`Self::new_output`] followed by the epilogue and rounding.
    fn bf16_output_with(
        &self,
        bias: Option<&[f32]>,
        act: Act,
        what: &str,
    ) -> candle_core::Result<Vec<half::bf16>> {
        use multihead_kernels::bf16gemm::matmul_bf16_to_bf16;
        self.check()?;
        let (a, b) = self.views();
        let y = matmul_bf16_to_bf16(a, b, bias, act)
            .map_err(|e| candle_core::Error::Msg(format!("{what}: {e}")))?;
        Ok(super::convert::from_bits(y))
    }

    /// `act(product + bias)` of the bf16-rounded operands (f32 sums) in a new f32 buffer, the
    /// epilogue applied to each tile as it leaves the kernel: the bits of
    /// [`Self::new_output`] followed by the epilogue pass.
    fn f32_output_with(
        &self,
        bias: Option<&[f32]>,
        act: Act,
        what: &str,
    ) -> candle_core::Result<Vec<f32>> {
        use multihead_kernels::bf16gemm::matmul_bf16_new_with;
        self.check()?;
        let (a, b) = self.views();
        matmul_bf16_new_with(a, b, bias, act)
            .map_err(|e| candle_core::Error::Msg(format!("{what}: {e}")))
    }

    /// The operands as the bf16 GEMM's views.
    fn views(&self) -> (BfMat<'_>, BfMat<'_>) {
        let view = |data, rows, cols, (row_stride, col_stride)| BfMat {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        };
        (
            view(self.lhs, self.m, self.k, self.lhs_strides),
            view(self.rhs, self.k, self.n, self.rhs_strides),
        )
    }

    /// The product of the bf16-rounded operands (f32 sums) in a new buffer of `len` floats.
    fn bf16_output(&self, len: usize, what: &str) -> candle_core::Result<Vec<f32>> {
        use multihead_kernels::bf16gemm::matmul_bf16_new;
        let (a, b) = self.views();
        let y =
            matmul_bf16_new(a, b).map_err(|e| candle_core::Error::Msg(format!("{what}: {e}")))?;
        debug_assert_eq!(y.len(), len);
        Ok(y)
    }
}

/// The elements of an f32 or bf16 storage from `offset` on, or an error naming the op.
fn cpu_elems<'a>(s: &'a CpuStorage, offset: usize, what: &str) -> candle_core::Result<Elems<'a>> {
    let short = || candle_core::Error::Msg(format!("fused linear: {what} starts past its data"));
    match s {
        CpuStorage::F32(v) => Ok(Elems::F32(v.get(offset..).ok_or_else(short)?)),
        CpuStorage::BF16(v) => {
            Ok(Elems::Bf16(super::convert::bits(v.get(offset..).ok_or_else(short)?)))
        }
        _ => candle_core::bail!("fused linear: {what} must be f32 or bf16"),
    }
}

/// [`cpu_elems`] of a tensor's storage.
fn elems<'a>(
    s: &'a candle_core::Storage,
    offset: usize,
    what: &str,
) -> candle_core::Result<Elems<'a>> {
    match s {
        candle_core::Storage::Cpu(c) => cpu_elems(c, offset, what),
        _ => candle_core::bail!("fused linear: {what} must be on the CPU"),
    }
}

/// `v` as a tensor of `dtype` (f32, or bf16 rounded once).
fn output(v: Vec<f32>, shape: impl Into<Shape>, dtype: DType) -> candle_core::Result<Tensor> {
    let dev = candle_core::Device::Cpu;
    match dtype {
        DType::BF16 => {
            Tensor::from_vec(super::convert::narrow_vec(&v, "fused linear")?, shape, &dev)
        }
        _ => Tensor::from_vec(v, shape, &dev),
    }
}

impl FusedLinear {
    fn forward(
        &self,
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let bf16_out = matches!(x.0, CpuStorage::BF16(_));
        if bf16_out != matches!(w.0, CpuStorage::BF16(_)) || (bf16_out && !self.bf16) {
            candle_core::bail!(
                "fused linear: x and the weight must both be f32, or both bf16 with bf16 products"
            );
        }
        let (x_off, x_rs) =
            rows(x.1).ok_or_else(|| candle_core::Error::Msg("fused linear: x rows".into()))?;
        let (out_f, in_f) = w.1.shape().dims2()?;
        if !w.1.is_contiguous() {
            candle_core::bail!("fused linear: the weight must be contiguous");
        }
        let m = x.1.shape().elem_count() / in_f.max(1);
        let mut widened = Vec::new();
        let bias = match b {
            // `linear` validated the bias and made it contiguous; a layout that still does not
            // fit is an error here, never an out-of-bounds slice.
            Some((b, bl)) => {
                let bo = bl.start_offset();
                let range = (bo, bo.saturating_add(out_f));
                let values = match b {
                    CpuStorage::F32(v) if range.1 <= v.len() => Some(&v[range.0..range.1]),
                    CpuStorage::BF16(v) if range.1 <= v.len() && bf16_out => Some(
                        super::convert::f32_values(b, range, &mut widened, "fused linear bias")?,
                    ),
                    _ => None,
                };
                match values {
                    Some(bias) if bl.dims() == [out_f] && bl.is_contiguous() => Some(bias),
                    _ => candle_core::bail!(
                        "fused linear: the bias must be a contiguous ({out_f},) tensor, got shape {:?} with strides {:?}",
                        bl.dims(),
                        bl.stride()
                    ),
                }
            }
            None => None,
        };
        let w0 = w.1.start_offset();
        // y (m×out) = x (m×in) · Wᵀ (in×out), Wᵀ[i][j] = W[j][i].
        let product = Product {
            m,
            n: out_f,
            k: in_f,
            lhs: cpu_elems(x.0, x_off, "x")?,
            lhs_strides: (x_rs, 1),
            rhs: cpu_elems(w.0, w0, "the weight")?,
            rhs_strides: (1, in_f),
            bf16: self.bf16,
        };
        let mut dims = x.1.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out_f;
        }
        if self.bf16 && !(self.act == Act::Gelu && self.keep_pre) {
            // The bias, activation (and rounding) on each tile as it leaves the kernel.
            let what = "fused linear output";
            let y = match bf16_out {
                true => CpuStorage::BF16(product.bf16_output_with(bias, self.act, what)?),
                false => CpuStorage::F32(product.f32_output_with(bias, self.act, what)?),
            };
            return Ok((y, Shape::from(dims)));
        }
        let mut y = product.new_output("fused linear output")?;
        // The bias and the activation in one parallel pass after the product.
        let epilogue = |y: &mut [f32], act| {
            bias_act_in_place(y, out_f, bias, act)
                .map_err(|e| candle_core::Error::Msg(format!("fused linear epilogue: {e}")))
        };
        match self.act {
            Act::Gelu if self.keep_pre => {
                // One pass: `y + bias` kept in `y` for the backward, GELU of it into `h`.
                let len = y.len();
                let write = |h: &mut [std::mem::MaybeUninit<f32>]| {
                    bias_act_into(&mut y, out_f, bias, Act::Gelu, h)
                        .map_err(|e| candle_core::Error::Msg(format!("fused linear gelu: {e}")))
                };
                // SAFETY: `bias_act_into` writes every element of `h` when it returns `Ok`.
                let h = unsafe { crate::alloc::try_written(len, "fused linear gelu", write) }?;
                let pre = std::mem::replace(&mut y, h);
                *self.pre.lock().map_err(|_| poisoned())? = Some(Arc::new(pre));
            }
            act => epilogue(&mut y, act)?,
        }
        let y = match bf16_out {
            true => CpuStorage::BF16(super::convert::narrow_vec(&y, "fused linear output")?),
            false => CpuStorage::F32(y),
        };
        Ok((y, Shape::from(dims)))
    }

    /// The gradient through GELU, from the pre-activation kept by the forward.
    fn gelu_grad(&self, grad: &Tensor) -> candle_core::Result<Tensor> {
        let pre = self.pre.lock().map_err(|_| poisoned())?.clone().ok_or_else(|| {
            candle_core::Error::Msg(
                "fused linear gelu: no pre-activation was kept (the forward recorded no gradient)"
                    .into(),
            )
        })?;
        let grad = grad.contiguous()?;
        let (gs, gl) = grad.storage_and_layout();
        let gv = f32s(&gs)?;
        let gv = gl.contiguous_offsets().and_then(|(a, b)| gv.get(a..b)).ok_or_else(|| {
            candle_core::Error::Msg(
                "fused linear gelu: the gradient does not fit its layout".into(),
            )
        })?;
        let write = |d: &mut [std::mem::MaybeUninit<f32>]| {
            multihead_kernels::activation::gelu_backward_uninit(&pre, gv, d)
                .map_err(|e| candle_core::Error::Msg(format!("fused linear gelu backward: {e}")))
        };
        // SAFETY: `gelu_backward_uninit` writes every element of `d` when it returns `Ok`.
        let dpre =
            unsafe { crate::alloc::try_written(pre.len(), "fused linear gelu grad", write) }?;
        Tensor::from_vec(dpre, grad.shape(), grad.device())
    }

    /// [`Self::backward`] on one of rayon's threads where its products go parallel (one hop
    /// for its two products and their packing, instead of one per parallel step, when candle's
    /// backward runs on a thread outside the pool; see [`crate::pool`]).
    fn backward_on_pool(
        &self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (out_f, in_f) = w.dims2()?;
        let rows = grad.elem_count() / out_f.max(1);
        let macs = crate::pool::product_macs(rows, in_f, out_f);
        crate::pool::on_pool_for(macs, || self.backward(x, w, y, grad))
    }

    /// `(dx, dW, db)` from the output gradient (and, with `relu`, the output `y`).
    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        y: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let dtype = x.dtype();
        if dtype == DType::BF16 && self.act == Act::Identity {
            return self.backward_bf16(x, w, grad);
        }
        // A bf16 op's gradient in f32 (exact), and its output for ReLU's selection.
        let widen = |t: &Tensor| match dtype {
            DType::BF16 => super::convert::to_dtype(t, DType::F32),
            _ => Ok(t.clone()),
        };
        let grad = widen(grad)?;
        // The output is read only by ReLU's selection: widened only then.
        let y = if self.act == Act::Relu { widen(y)? } else { y.clone() };
        let grad = match self.act {
            Act::Identity => grad.contiguous()?,
            Act::Relu => super::activation::relu_grad(&y, &grad)?,
            Act::Gelu => self.gelu_grad(&grad)?,
        };
        let (gs, gl) = grad.storage_and_layout();
        let out_f = w.dim(0)?;
        let len = grad.elem_count();
        let gv = f32s(&gs)?.get(gl.start_offset()..gl.start_offset() + len).ok_or_else(|| {
            candle_core::Error::Msg("fused linear: the gradient does not fit its layout".into())
        })?;
        let db = multihead_kernels::epilogue::bias_grad(gv, out_f)
            .map_err(|e| candle_core::Error::Msg(format!("fused linear db: {e}")))?;
        let (dx, dw) = self.input_and_weight_grads(x, w, Elems::F32(gv))?;
        Ok((dx, dw, output(db, out_f, dtype)?))
    }

    /// The backward of a bf16 op without an activation: the bf16 gradient multiplied as it
    /// is (its values are bf16 already, so the products are those of the widened gradient),
    /// and its column sums widened element by element.
    fn backward_bf16(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let grad = grad.contiguous()?;
        let (gs, gl) = grad.storage_and_layout();
        let gv = match &*gs {
            candle_core::Storage::Cpu(CpuStorage::BF16(v)) => {
                super::convert::bits(v.get(gl.start_offset()..).unwrap_or_default())
            }
            _ => candle_core::bail!("fused linear: a bf16 op's gradient must be bf16 on the CPU"),
        };
        let out_f = w.dim(0)?;
        let m = grad.elem_count() / out_f.max(1);
        let rows = gv.get(..m * out_f).ok_or_else(|| {
            candle_core::Error::Msg("fused linear: the gradient does not fit its layout".into())
        })?;
        let db = multihead_kernels::epilogue::bias_grad_bf16(rows, out_f)
            .map_err(|e| candle_core::Error::Msg(format!("fused linear db: {e}")))?;
        let (dx, dw) = self.input_and_weight_grads(x, w, Elems::Bf16(rows))?;
        Ok((dx, dw, output(db, out_f, DType::BF16)?))
    }

    /// `dx = dy·W` and `dW = dyᵀ·x` from the output gradient `gv` (rows of `out_f`), in x's
    /// dtype: a bf16 op's written as bf16 by the products' epilogue.
    fn input_and_weight_grads(
        &self,
        x: &Tensor,
        w: &Tensor,
        gv: Elems<'_>,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let dtype = x.dtype();
        let x = if rows(x.layout()).is_some() { x.clone() } else { x.contiguous()? };
        let w = w.contiguous()?;
        let (out_f, in_f) = w.dims2()?;
        let m = x.elem_count() / in_f.max(1);
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (x_off, x_rs) =
            rows(xl).ok_or_else(|| candle_core::Error::Msg("fused linear: x rows".into()))?;
        let xv = elems(&xs, x_off, "x")?;
        let wv = elems(&ws, wl.start_offset(), "the weight")?;
        // dx (m×in) = dy (m×out) · W (out×in)
        let dx = Product {
            m,
            n: in_f,
            k: out_f,
            lhs: gv,
            lhs_strides: (out_f, 1),
            rhs: wv,
            rhs_strides: (in_f, 1),
            bf16: self.bf16,
        };
        // dW (out×in) = dyᵀ (out×m) · x (m×in)
        let dw = Product {
            m: out_f,
            n: in_f,
            k: m,
            lhs: gv,
            lhs_strides: (1, out_f),
            rhs: xv,
            rhs_strides: (x_rs, 1),
            bf16: self.bf16,
        };
        let dev = candle_core::Device::Cpu;
        if dtype == DType::BF16 && self.bf16 {
            let dx = dx.bf16_output_with(None, Act::Identity, "fused linear dx")?;
            let dw = dw.bf16_output_with(None, Act::Identity, "fused linear dw")?;
            return Ok((
                Tensor::from_vec(dx, x.shape(), &dev)?,
                Tensor::from_vec(dw, (out_f, in_f), &dev)?,
            ));
        }
        let dx = dx.new_output("fused linear dx")?;
        let dw = dw.new_output("fused linear dw")?;
        Ok((output(dx, x.shape(), dtype)?, output(dw, (out_f, in_f), dtype)?))
    }
}

fn poisoned() -> candle_core::Error {
    candle_core::Error::Msg("fused linear: a panic poisoned the kept pre-activation".into())
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
        self.forward((s1, l1), (s2, l2), None)
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.backward_on_pool(x, w, res, grad)?;
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
        self.forward((s1, l1), (s2, l2), Some((s3, l3)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = self.backward_on_pool(x, w, res, grad)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// `y = x Wᵀ (+ b)` for a few rows without a gradient (`multihead_kernels::gemv`): x `(m, k)`,
/// W `(n, k)`, b `(n,)`, all contiguous, all f32 or all bf16. A bf16 weight is read as bf16
/// (half the bytes) and widened in registers; x and b are widened first and the output is
/// rounded once, so the numbers are those of the f32 product of the widened operands. No
/// backward: `linear` takes it only when no gradient is recorded.
pub(crate) struct RowsLinear;

const ROWS: &str = "linear (decode rows)";

/// The contiguous part of `s` that `l` addresses, as f32 (bf16 widened).
fn rows_operand<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    widened: &'a mut Vec<f32>,
) -> candle_core::Result<&'a [f32]> {
    let range = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{ROWS}: inputs must be contiguous")))?;
    super::convert::f32_values(s, range, widened, ROWS)
}

impl RowsLinear {
    fn run(
        &self,
        (xs, xl): (&CpuStorage, &Layout),
        (ws, wl): (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (&[m, k], &[n, k2]) = (xl.dims(), wl.dims()) else {
            candle_core::bail!("{ROWS}: expected 2-D x and weight");
        };
        if k != k2 {
            candle_core::bail!("{ROWS}: x has {k} features, the weight {k2}");
        }
        let (mut xw, mut bw) = (Vec::new(), Vec::new());
        let x = rows_operand(xs, xl, &mut xw)?;
        let b = match bias {
            Some((bs, bl)) => Some(rows_operand(bs, bl, &mut bw)?),
            None => None,
        };
        let (w0, w1) = wl
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg(format!("{ROWS}: inputs must be contiguous")))?;
        let mut y = crate::alloc::try_zeros::<f32>(m * n, ROWS)?;
        let shape = Shape::from((m, n));
        let err = |e| candle_core::Error::Msg(format!("{ROWS}: {e}"));
        match (xs, ws) {
            (CpuStorage::F32(_), CpuStorage::F32(w)) => {
                multihead_kernels::gemv::linear_rows(x, m, k, &w[w0..w1], n, b, &mut y)
                    .map_err(err)?;
                Ok((CpuStorage::F32(y), shape))
            }
            (CpuStorage::BF16(_), CpuStorage::BF16(w)) => {
                let w = super::convert::bits(&w[w0..w1]);
                multihead_kernels::gemv::linear_rows_bf16(x, m, k, w, n, b, &mut y).map_err(err)?;
                Ok((CpuStorage::BF16(super::convert::narrow_vec(&y, ROWS)?), shape))
            }
            _ => candle_core::bail!("{ROWS}: x and the weight must both be f32 or both bf16"),
        }
    }
}

super::forward_only_linear_ops!(RowsLinear, ROWS);
