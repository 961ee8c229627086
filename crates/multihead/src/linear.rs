//! `torch.nn.Linear` with PyTorch's weight layout `[out_features, in_features]`.

use candle_core::Tensor;
use candle_nn::{Init, VarBuilder};

use crate::error::{fmt_shape, Error, Result};
use crate::fused::bf16_linear::{Bf16Linear, OutDtype};
use crate::fused::dispatch::{dtype_device_blocker, Path, Plan};
use crate::fused::linear::{rows, Act, FusedLinear, RowsLinear};
use crate::mode::Backend;
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
        // PyTorch's parameters are float ("only Tensors of floating point dtype can require
        // gradients"); an integer builder would truncate loaded weights.
        crate::alloc::expect_float("Linear", "dtype", vb.dtype())?;
        // PyTorch's bound is 0 without inputs (`Linear(0, d)`: a zero bias); an empty uniform
        // range is an error in candle, so that case is a constant.
        let init = match in_features {
            0 => Init::Const(0.0),
            n => {
                let bound = 1.0 / (n as f64).sqrt();
                Init::Uniform { lo: -bound, up: bound }
            }
        };
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
        crate::pool::on_pool_for(self.macs(x), || self.forward_here(x))
    }

    /// The multiply-adds of the product on `x`: a larger call hops onto the pool once.
    fn macs(&self, x: &Tensor) -> usize {
        let (out, k) = (self.weight.dims().first().copied().unwrap_or(0), x.dims().last());
        crate::pool::product_macs(
            x.elem_count() / k.copied().unwrap_or(1).max(1),
            k.copied().unwrap_or(0),
            out,
        )
    }

    fn forward_here(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(x) = self.cast_under_autocast(x)? {
            return crate::mode::autocast_off(|| self.forward_here(&x));
        }
        let dtypes = (x.dtype(), self.weight.dtype());
        let run = |m: &Self, r: &dyn Fn(&Tensor) -> Result<Tensor>| m.forward(&r(x)?);
        if let Some(y) = crate::precision::autocast_run(self, dtypes, self.macs(x) as u64, run) {
            return y;
        }
        linear(x, &self.weight, self.bias.as_ref(), "linear", "input", Backend::Auto)
    }

    /// `activation(self.forward(x))`, as one op where the fused product runs (a feed-forward
    /// block's first half, `F.relu(self.linear1(x))` or `F.gelu(...)`): the numbers of the
    /// separate activation op, with one pass and one graph node fewer (its backward too).
    /// Other activations run after the product as their own op.
    ///
    /// # Shapes
    /// * input `(*, in_features)`
    /// * output `(*, out_features)`
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::{Activation, Linear};
    ///
    /// let vm = VarMap::new();
    /// let lin = Linear::new(4, 3, true, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
    /// let x = Tensor::randn(0f32, 1.0, (2, 5, 4), &Device::Cpu)?;
    /// let fused = lin.forward_act(&x, Activation::Gelu)?;
    /// let apart = Activation::Gelu.forward(&lin.forward(&x)?)?;
    /// let diff = (fused - apart)?.abs()?.max_all()?.to_scalar::<f32>()?;
    /// assert_eq!(diff, 0.0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    // Mirrors activation(torch.nn.Linear.forward(x)).
    pub fn forward_act(&self, x: &Tensor, activation: crate::Activation) -> Result<Tensor> {
        crate::pool::on_pool_for(self.macs(x), || self.forward_act_here(x, activation))
    }

    fn forward_act_here(&self, x: &Tensor, activation: crate::Activation) -> Result<Tensor> {
        if let Some(x) = self.cast_under_autocast(x)? {
            return crate::mode::autocast_off(|| self.forward_act_here(&x, activation));
        }
        let autocast =
            |m: &Self, r: &dyn Fn(&Tensor) -> Result<Tensor>| m.forward_act(&r(x)?, activation);
        let dtypes = (x.dtype(), self.weight.dtype());
        if let Some(y) = crate::precision::autocast_run(self, dtypes, self.macs(x) as u64, autocast)
        {
            return y;
        }
        let act = match activation {
            crate::Activation::Relu => Act::Relu,
            crate::Activation::Gelu => Act::Gelu,
            other => return other.forward(&self.forward_here(x)?),
        };
        linear_then(x, &self.weight, self.bias.as_ref(), act, "linear", "input", Backend::Auto)
    }
}

impl Linear {
    /// Under [`autocast`](crate::autocast) to this layer's own dtype (bf16 or f16), its input
    /// as PyTorch's autocast casts it (an f32 input rounded to the layer's dtype); `None` where
    /// the call runs on `x` as given.
    fn cast_under_autocast(&self, x: &Tensor) -> Result<Option<Tensor>> {
        match crate::precision::autocast_into(self.weight.dtype()) {
            Some(dt) => crate::precision::autocast_cast(x, dt).map(Some),
            None => Ok(None),
        }
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
    // Mirrors torch.nn.Linear.forward.
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Linear::forward(self, xs).map_err(candle_core::Error::wrap)
    }
}

/// `F.linear(x, weight, bias)` over any leading dimensions: validate, plan, run.
///
/// `weight` must be 2-D `(out, in)` and `bias` 1-D `(out,)`, both of `x`'s dtype; a strided or
/// broadcast bias is fine (it is made contiguous, differentiably, before the fused op reads it).
/// `backend` is the caller's (a per-call choice reaches the projections too).
pub(crate) fn linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    op: &'static str,
    arg: &'static str,
    backend: Backend,
) -> Result<Tensor> {
    linear_then(x, weight, bias, Act::Identity, op, arg, backend)
}

/// [`linear`] with its output in `dtype`, inside a reduced-precision module's f32 twin: the
/// last product of a bf16/f16 module (`dtype` its own, the output rounded next anyway), or a
/// product reading bf16 activations that the twin kept in bf16 (`x` bf16, `dtype` f32).
/// Inside [`rounded_products`](crate::mode::rounded_products), without a gradient, on the
/// fused path, the product reads `x` as it is and its epilogue writes `dtype` (no f32
/// output and no conversion pass); elsewhere `x` is widened, multiplied and the output
/// converted. The bits of `convert(linear(widen(x)), dtype)` either way.
pub(crate) fn linear_to(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    (op, arg): (&'static str, &'static str),
    backend: Backend,
    dtype: candle_core::DType,
) -> Result<Tensor> {
    use candle_core::DType::{BF16, F32};
    let out = match dtype {
        BF16 => Some(OutDtype::Bf16),
        F32 => Some(OutDtype::F32),
        _ => None,
    };
    // A bf16 weight with an f32 output stands for the f32 twin's widened weight: the bf16
    // routes of `TransformerEncoderLayer` (the output projection of a self-attention that ran
    // as it is, into the f32 residual sum; a packed batch's projections of f32 rows).
    let bf16_twin = weight.dtype() == BF16 && dtype == F32;
    let direct = matches!(x.dtype(), F32 | BF16)
        && (weight.dtype() == F32 || bf16_twin)
        && crate::mode::in_rounded_products()
        && !records_grad(x, weight, bias);
    if let (Some(out), true) = (out, direct) {
        let call = (x, weight, bias, Act::Identity);
        if let Some(y) = rounded_product(call, out, (op, arg), backend)? {
            return Ok(y);
        }
    }
    if bf16_twin && crate::mode::in_rounded_products() {
        // Off the fused path: the twin's f32 product on the widened values.
        use crate::precision::{widen, widen_opt};
        let (x, w, b) = (widen(x)?, widen(weight)?, widen_opt(bias)?);
        return linear(&x, &w, b.as_ref(), op, arg, backend);
    }
    let x = match x.dtype() == weight.dtype() {
        true => x.clone(),
        false => crate::precision::widen(x)?,
    };
    let y = linear(&x, weight, bias, op, arg, backend)?;
    match y.dtype() == dtype {
        true => Ok(y),
        false => crate::precision::narrow(&y, dtype),
    }
}

/// `act(x·Wᵀ + b)` by the bf16 products inside a reduced-precision module's f32 twin, its
/// output in the dtype `out` names: validated as the f32 product (a bf16 `x` stands for its
/// f32 values), and `None` where the product is empty or the plan is not the fused one (the
/// caller takes the usual path). The caller checked that no gradient is recorded.
fn rounded_product(
    (x, weight, bias, act): (&Tensor, &Tensor, Option<&Tensor>, Act),
    out: OutDtype,
    (op, arg): (&'static str, &'static str),
    backend: Backend,
) -> Result<Option<Tensor>> {
    use candle_core::DType::{BF16, F32};
    // A bf16 weight (and bias) stands for the twin's widened one: the same values.
    let as_dtype = if weight.dtype() == BF16 { BF16 } else { F32 };
    let (_, in_f, out_dims) = validate_linear_of(x, weight, bias, op, arg, as_dtype)?;
    // Planned as the twin's f32 weight would be (the same device, a dtype the kernel reads).
    let blocker = crate::fused::dispatch::f32_or_bf16_blocker(weight);
    let plan = crate::fused::dispatch::decide(op, backend, blocker)?;
    if in_f == 0 || out_dims.contains(&0) || plan.path != Path::Fused {
        return Ok(None);
    }
    let dtype = if out == OutDtype::Bf16 { BF16 } else { F32 };
    crate::alloc::ensure(op, "output", &out_dims, dtype, 1, "use a smaller input")?;
    let x = if x.rank() == 1 { x.unsqueeze(0)? } else { x.detach() };
    let b = bias.map(Tensor::detach);
    bf16_product_to(&x, &weight.detach(), b.as_ref(), act, out, &out_dims).map(Some)
}

/// [`linear`], followed by `act` (fused into the product's op on the fused path).
fn linear_then(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    act: Act,
    op: &'static str,
    arg: &'static str,
    backend: Backend,
) -> Result<Tensor> {
    let (out_f, in_f, out_dims) = validate_linear(x, weight, bias, op, arg)?;
    if crate::precision::is_reduced(x.dtype()) {
        let call = Call { x, weight, bias, act, op, backend, out_dims: &out_dims };
        if let Some(y) = bf16_unwidened(call)? {
            return Ok(y);
        }
        if let Some(y) = bf16_graded(call)? {
            return Ok(y);
        }
        // bf16/f16: the f32 product (f32 accumulation, as PyTorch's), rounded once.
        use crate::precision::{widen, widen_opt};
        let (xw, ww, b) = (widen(x)?, widen(weight)?, widen_opt(bias)?);
        let rows = out_dims[..out_dims.len() - 1].iter().product::<usize>();
        let macs = crate::pool::product_macs(rows, in_f, out_f) as u64;
        let y = crate::mode::rounded_products(x.dtype(), macs, || {
            linear_then(&xw, &ww, b.as_ref(), act, op, arg, backend)
        })?;
        return crate::precision::narrow(&y, x.dtype());
    }
    let m = out_dims[..out_dims.len() - 1].iter().product::<usize>();
    let plan = plan_linear(x, op, backend)?;
    // Inside no_grad: no graph (its nodes would keep every input alive).
    let (x, weight) = (&crate::mode::graph_input(x), &crate::mode::graph_input(weight));
    let bias = bias.map(crate::mode::graph_input);
    let bias = bias.as_ref();
    crate::alloc::ensure(op, "output", &out_dims, x.dtype(), 1, "use a smaller input")?;
    if m == 0 || in_f == 0 {
        // gemm has nothing to multiply; the product is zero (plus the bias), kept in the
        // graph so that the input and the weight get (zero) gradients.
        let inputs: Vec<&Tensor> = [Some(x), Some(weight), bias].into_iter().flatten().collect();
        let zeros = crate::fused::zeros::zeros_of(&out_dims, x.dtype(), &inputs)?;
        return then_act(
            match bias {
                Some(b) if m > 0 => zeros.broadcast_add(b)?,
                _ => zeros,
            },
            act,
        );
    }
    match plan.path {
        Path::Fused => fused_linear(x, weight, bias, act, out_f, &out_dims),
        Path::Composed => {
            let x2 = x.reshape((m, in_f))?;
            let mut y = x2.matmul(&weight.t()?)?;
            if let Some(b) = bias {
                y = y.broadcast_add(b)?;
            }
            then_act(y.reshape(out_dims)?, act)
        }
    }
}

/// One `F.linear` call's arguments, as the bf16 paths take them.
#[derive(Clone, Copy)]
struct Call<'a> {
    x: &'a Tensor,
    weight: &'a Tensor,
    bias: Option<&'a Tensor>,
    act: Act,
    op: &'static str,
    backend: Backend,
    out_dims: &'a [usize],
}

impl Call<'_> {
    /// `(m, in_features)`: the rows of the product and its depth.
    fn rows(&self) -> Result<(usize, usize)> {
        let m = self.out_dims[..self.out_dims.len().saturating_sub(1)].iter().product::<usize>();
        Ok((m, self.weight.dim(1)?))
    }

    /// The product's multiply-adds (`Bf16Products::Auto` widens small ones).
    fn macs(&self) -> Result<u64> {
        let (m, in_f) = self.rows()?;
        Ok(crate::pool::product_macs(m, in_f, self.weight.dim(0)?) as u64)
    }
}

/// bf16 without a gradient, multiplied without widening the weight first, where that pays:
///
/// * a few rows (a decode step): the few-rows kernel reads the bf16 weight as it is, where
///   widening it would convert all of it at every step. The numbers are the widened path's:
///   the f32 product of the widened operands, rounded once (then ReLU, which commutes with the
///   rounding; GELU would round twice, so it takes the widened path);
/// * more rows where [`crate::bf16_products`] says so: the bf16 operands multiplied as they
///   are (`vdpbf16ps`, f32 sums), then the bias and activation in f32 and one rounding. The
///   widened path computes the same products of the same operands; only the order of the f32
///   sums differs.
fn bf16_unwidened(c: Call) -> Result<Option<Tensor>> {
    let Call { x, weight, bias, act, op, backend, out_dims } = c;
    let (m, in_f) = c.rows()?;
    if x.dtype() != candle_core::DType::BF16 || records_grad(x, weight, bias) || m == 0 || in_f == 0
    {
        return Ok(None);
    }
    let few_rows = m <= multihead_kernels::gemv::MAX_ROWS && act != Act::Gelu;
    if !few_rows && !crate::mode::bf16_products_at(c.macs()?) {
        return Ok(None);
    }
    let blocker = crate::fused::dispatch::f32_or_bf16_blocker(x);
    if crate::fused::dispatch::decide(op, backend, blocker)?.path != Path::Fused {
        return Ok(None);
    }
    if !few_rows {
        crate::alloc::ensure(op, "output", out_dims, x.dtype(), 1, "use a smaller input")?;
        let x = if x.rank() == 1 { x.unsqueeze(0)? } else { x.detach() };
        let bias = bias.map(Tensor::detach);
        return bf16_product(&x, &weight.detach(), bias.as_ref(), act, out_dims).map(Some);
    }
    let x2 = x.reshape((m, in_f))?.contiguous()?;
    let w = weight.contiguous()?;
    let y = match bias {
        Some(b) => x2.apply_op3_no_bwd(&w, &b.contiguous()?, &RowsLinear)?,
        None => x2.apply_op2_no_bwd(&w, &RowsLinear)?,
    };
    then_act(y.reshape(out_dims)?, act).map(Some)
}

/// bf16 with a gradient recorded, where [`crate::bf16_products`] says so: the fused op on the
/// bf16 tensors as they are (`FusedLinear` with bf16 products: bf16 output and gradients, the
/// numbers of the widened path, which converts x and W to f32 and the output back, and the
/// gradients likewise, as graph nodes of their own).
fn bf16_graded(c: Call) -> Result<Option<Tensor>> {
    let Call { x, weight, bias, act, op, backend, out_dims } = c;
    let (m, in_f) = c.rows()?;
    let direct = crate::mode::bf16_products_at(c.macs()?);
    if x.dtype() != candle_core::DType::BF16 || m == 0 || in_f == 0 || !direct {
        return Ok(None);
    }
    let blocker = crate::fused::dispatch::f32_or_bf16_blocker(x);
    if crate::fused::dispatch::decide(op, backend, blocker)?.path != Path::Fused {
        return Ok(None);
    }
    crate::alloc::ensure(op, "output", out_dims, x.dtype(), 1, "use a smaller input")?;
    let (x, weight) = (crate::mode::graph_input(x), crate::mode::graph_input(weight));
    let bias = bias.map(crate::mode::graph_input);
    let x = if x.rank() == 1 { x.unsqueeze(0)? } else { x };
    let x = if rows(x.layout()).is_some() { x } else { x.contiguous()? };
    let weight = weight.contiguous()?;
    let graded = x.track_op() || weight.track_op() || bias.as_ref().is_some_and(Tensor::track_op);
    let op = FusedLinear::new(act, graded).with_bf16_products(true);
    let y = match bias {
        Some(b) => x.apply_op3(&weight, &b.contiguous()?, op)?,
        None => x.apply_op2(&weight, op)?,
    };
    Ok(Some(y.reshape(out_dims)?))
}

/// `act(bf16(x) · bf16(W)ᵀ + b)` as one op without a backward (`fused::bf16_linear`).
fn bf16_product(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    act: Act,
    out_dims: &[usize],
) -> Result<Tensor> {
    bf16_product_to(x, weight, bias, act, OutDtype::AsInput, out_dims)
}

/// [`bf16_product`] with its output in the dtype `out` names.
fn bf16_product_to(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    act: Act,
    out: OutDtype,
    out_dims: &[usize],
) -> Result<Tensor> {
    let x = if rows(x.layout()).is_some() { x.clone() } else { x.contiguous()? };
    let weight =
        if rows(weight.layout()).is_some() { weight.clone() } else { weight.contiguous()? };
    let op = Bf16Linear { act, out };
    let y = match bias {
        Some(b) => x.apply_op3_no_bwd(&weight, &b.contiguous()?, &op)?,
        None => x.apply_op2_no_bwd(&weight, &op)?,
    };
    Ok(y.reshape(out_dims)?)
}

/// `linear2(act(linear1(x)))` inside a bf16 layer's f32 twin (see
/// [`rounded_products`](crate::mode::rounded_products)) without a gradient: the hidden
/// activations are written as bf16 by the first product's epilogue and read as they are by the
/// second, whose packing would round their f32 values to exactly these bits. The numbers are
/// the f32 twin's; half the bytes of the widest activation are written and read, and the
/// second product packs its rows without rounding them (docs/performance.md, "bf16 inference:
/// activations in bf16 where only a product reads them"). `None` where this does not apply (a
/// gradient recorded, f32 layers, widened bf16 products, an activation other than ReLU or
/// GELU, an empty product, or a backend that is not the fused one): the caller composes the
/// two `Linear`s as usual.
pub(crate) fn rounded_feed_forward(
    linear1: &Linear,
    linear2: &Linear,
    activation: crate::Activation,
    x: &Tensor,
) -> Result<Option<Tensor>> {
    let act = match activation {
        crate::Activation::Relu => Act::Relu,
        crate::Activation::Gelu => Act::Gelu,
        _ => return Ok(None),
    };
    let (w1, b1, w2, b2) =
        (&linear1.weight, linear1.bias.as_ref(), &linear2.weight, linear2.bias.as_ref());
    if !crate::mode::in_rounded_products()
        || x.dtype() != candle_core::DType::F32
        || records_grad(x, w1, b1)
        || records_grad(x, w2, b2)
    {
        return Ok(None);
    }
    let (op, auto) = (("linear", "input"), Backend::Auto);
    let Some(h) = rounded_product((x, w1, b1, act), OutDtype::Bf16, op, auto)? else {
        return Ok(None);
    };
    // The second product reads the bf16 hidden units as they are (or, off the fused path,
    // widened: the same values); a mismatched `linear2` is the usual path's error.
    linear_to(&h, w2, b2, op, auto, candle_core::DType::F32).map(Some)
}

/// Whether a gradient would be recorded through `F.linear(x, weight, bias)`.
fn records_grad(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> bool {
    crate::mode::grad_enabled()
        && (x.track_op() || weight.track_op() || bias.is_some_and(Tensor::track_op))
}

/// `act(y)` as its own op.
fn then_act(y: Tensor, act: Act) -> Result<Tensor> {
    match act {
        Act::Identity => Ok(y),
        Act::Relu => crate::Activation::Relu.forward(&y),
        Act::Gelu => crate::Activation::Gelu.forward(&y),
    }
}

/// What [`linear`] checks before it allocates (for a caller's `explain`): its arguments, the
/// copies of strided views, and its output in `out_dtype`.
pub(crate) fn ensure_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    (op, arg): (&'static str, &'static str),
    out_dtype: candle_core::DType,
) -> Result<()> {
    let (_, _, out_dims) = validate_linear(x, weight, bias, op, arg)?;
    crate::alloc::ensure(op, "output", &out_dims, out_dtype, 1, "use a smaller input")
}

/// The path `F.linear` takes for `x` (f32 CPU: the fused op, unless the backend says
/// otherwise).
pub(crate) fn plan_linear(x: &Tensor, op: &'static str, backend: Backend) -> Result<Plan> {
    crate::fused::dispatch::decide(op, backend, dtype_device_blocker(x))
}

/// Checks `F.linear`'s arguments; returns `(out_features, in_features, output dims)`.
fn validate_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    op: &'static str,
    arg: &'static str,
) -> Result<(usize, usize, Vec<usize>)> {
    validate_linear_of(x, weight, bias, op, arg, x.dtype())
}

/// [`validate_linear`] for an `x` taken as `x_dtype` (a bf16 activation that a
/// reduced-precision module's f32 twin kept in bf16 stands for its f32 values).
fn validate_linear_of(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    op: &'static str,
    arg: &'static str,
    x_dtype: candle_core::DType,
) -> Result<(usize, usize, Vec<usize>)> {
    let (out_f, in_f) = match weight.dims() {
        &[o, i] => (o, i),
        other => {
            return Err(Error::Shape {
                op,
                arg: "weight",
                msg: format!(
                    "expected a 2-D weight of shape (out_features, in_features), got {}",
                    fmt_shape(other)
                ),
            })
        }
    };
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
    if x_dtype != weight.dtype() || !x_dtype.is_float() {
        return Err(Error::DType {
            op,
            arg,
            msg: format!(
                "input dtype {:?} and weight dtype {:?} must be the same float dtype",
                x_dtype,
                weight.dtype()
            ),
        });
    }
    if let Some(b) = bias {
        check_bias(b, weight, x_dtype, op)?;
    }
    for (name, t) in [("weight", Some(weight)), ("bias", bias)] {
        if let Some(t) = t {
            if !t.device().same_device(x.device()) {
                return Err(Error::Config {
                    op,
                    arg: name,
                    msg: format!(
                        "{name} is on {:?} but the input is on {:?}",
                        t.device(),
                        x.device()
                    ),
                });
            }
        }
    }
    let mut out_dims = lead.to_vec();
    out_dims.push(out_f);
    crate::alloc::elements(op, "output", &out_dims)?;
    // Every path reads rows: a view that is not (a transpose, a broadcast `expand`) is copied
    // to full size first. Checked here, before any path is chosen, so that a copy that cannot
    // be allocated is an error on every path (it aborted the process before 2026-12-07).
    let hint = "a strided or broadcast view is copied to full size before the product; pass \
                a smaller or contiguous tensor";
    for (name, t) in [(arg, x), ("weight", weight)] {
        if !t.is_contiguous() {
            crate::alloc::ensure(op, name, t.dims(), t.dtype(), 1, hint)?;
        }
    }
    Ok((out_f, in_f, out_dims))
}

/// A bias of `weight`'s output features, in the input's dtype `x_dtype`.
fn check_bias(
    b: &Tensor,
    weight: &Tensor,
    x_dtype: candle_core::DType,
    op: &'static str,
) -> Result<()> {
    let out_f = weight.dims().first().copied().unwrap_or(0);
    if b.dims() != [out_f] {
        return Err(Error::Shape {
            op,
            arg: "bias",
            msg: format!(
                "expected a 1-D bias of shape {} to match the weight {}, got {}",
                fmt_shape(&[out_f]),
                fmt_shape(weight.dims()),
                fmt_shape(b.dims())
            ),
        });
    }
    if b.dtype() != x_dtype {
        return Err(Error::DType {
            op,
            arg: "bias",
            msg: format!("bias dtype {:?} does not match the input dtype {x_dtype:?}", b.dtype()),
        });
    }
    Ok(())
}

/// Runs the fused linear op. A 1-D input is treated as one row; the weight and bias are made
/// contiguous (a copy only when they are views).
fn fused_linear(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    act: Act,
    out_f: usize,
    out_dims: &[usize],
) -> Result<Tensor> {
    let x = if x.rank() == 1 { x.unsqueeze(0)? } else { x.clone() };
    let x = if rows(x.layout()).is_some() { x } else { x.contiguous()? };
    let weight = weight.contiguous()?;
    let m = x.elem_count() / x.dim(x.rank() - 1)?.max(1);
    let graded = x.track_op() || weight.track_op() || bias.is_some_and(Tensor::track_op);
    if !graded && crate::mode::in_rounded_products() {
        // Inside a bf16 module computing in f32, on a CPU whose bf16 products are the faster:
        // the operands rounded to bf16 as PyTorch's bf16 layer has them, however few the rows
        // (so that the numbers do not depend on the number of tokens).
        return bf16_product(&x, &weight, bias, act, out_dims);
    }
    if m <= multihead_kernels::gemv::MAX_ROWS && !graded {
        // A few rows without a gradient (a decode step's tokens): the few-rows kernel reads the
        // weight once, where gemm packs all of it for every call (measured at E=512, B=1: a
        // third of a decode step).
        let x2 = x.reshape((m, x.dim(x.rank() - 1)?))?.contiguous()?;
        let y = match bias {
            Some(b) => x2.apply_op3_no_bwd(&weight, &b.contiguous()?, &RowsLinear)?,
            None => x2.apply_op2_no_bwd(&weight, &RowsLinear)?,
        };
        return then_act(y.reshape(out_dims)?, act);
    }
    let op = FusedLinear::new(act, graded).with_bf16_products(crate::mode::in_rounded_products());
    let y = match bias {
        Some(b) => x.apply_op3(&weight, &b.contiguous()?, op)?,
        None => x.apply_op2(&weight, op)?,
    };
    debug_assert_eq!(y.dim(y.rank() - 1)?, out_f);
    Ok(y.reshape(out_dims)?)
}

impl crate::precision::CastParams for Linear {
    fn map_params(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self { weight: f(&self.weight)?, bias: self.bias.as_ref().map(f).transpose()? })
    }
}
