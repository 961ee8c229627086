//! Reduced-precision floats (bf16, f16) compute in f32 inside each operation and are rounded
//! back at its output, as PyTorch's CPU kernels accumulate them in float. The f32 computation is
//! the f32 path itself (the fused kernels on the CPU), so a bf16 call runs what an f32 call runs,
//! plus the conversions; gradients flow back through them to the reduced-precision tensors.

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::mask::Mask;

/// Whether `dtype` is computed in f32 and rounded back (bf16 and f16).
pub(crate) fn is_reduced(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

/// `t` in f32 (differentiably).
pub(crate) fn widen(t: &Tensor) -> Result<Tensor> {
    convert(t, DType::F32)
}

/// An f32 result back in the reduced dtype `dtype` (differentiably).
pub(crate) fn narrow(t: &Tensor, dtype: DType) -> Result<Tensor> {
    convert(t, dtype)
}

/// `t` converted to `dtype` (PyTorch's `t.to(dtype)`), differentiably: candle's
/// `Tensor::to_dtype` with the same numbers, fast between bf16 and f32 on the CPU.
///
/// candle converts between bf16 and f32 one element at a time on one thread (about a fifth of a
/// bf16 `Linear`'s training step when its output is summed in f32, as a loss usually is); here
/// those two conversions run 16 lanes wide on every thread, rounding to nearest even as candle
/// and PyTorch do. f64 goes to bf16 through f32 (rounded twice), as PyTorch converts it; every
/// other pair of dtypes, and other devices, take candle's `to_dtype`. The gradient flows back
/// through the conversion (the backward is the opposite conversion).
///
/// A size that cannot be allocated (the result, or the copy of a strided or broadcast view
/// that is converted) is an [`Error`](crate::Error), not an abort.
///
/// # Shapes
/// Any shape; the result has `t`'s shape.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
///
/// let x = Tensor::new(&[1.0f32, 1.0 + 1.0 / 256.0, -2.5], &Device::Cpu)?;
/// let b = multihead::cast(&x, DType::BF16)?; // 1 + 2^-8 ties to the even 1.0
/// let back = multihead::cast(&b, DType::F32)?;
/// assert_eq!(back.to_vec1::<f32>()?, vec![1.0, 1.0, -2.5]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
// Mirrors torch.Tensor.to(dtype).
pub fn cast(t: &Tensor, dtype: DType) -> Result<Tensor> {
    convert_as(t, dtype, "cast")
}

/// The sum of every element of `t`, accumulated in f32, as a scalar f32 tensor, with a
/// gradient: PyTorch's `t.sum(dtype=torch.float32)` (for a bf16 `t`, what `t.sum()` adds up
/// before it rounds to bf16). A loss that ends a training step.
///
/// On the CPU, f32 and bf16 tensors are summed on every thread in a fixed order (the same bits
/// for any thread count: `multihead_kernels::sum`), and the backward writes the gradient
/// (every element the sum's gradient, in `t`'s dtype) as one contiguous tensor. candle's
/// `sum_all` sums on one thread, and its backward broadcasts the scalar gradient, which the
/// gradient store then adds into zeros. Other dtypes and devices take `cast` to f32 and
/// candle's `sum_all`. The order of the additions differs from candle's, so the sum may differ
/// from `sum_all`'s in its last bits.
///
/// A strided or broadcast view is copied first; a copy that cannot be allocated is an
/// [`Error`](crate::Error), not an abort.
///
/// # Shapes
/// `t`: any shape. Returns a scalar (shape `()`).
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor, Var};
///
/// let x = Var::from_tensor(&Tensor::new(&[[1.0f32, 2.0], [3.0, 4.0]], &Device::Cpu)?)?;
/// let loss = multihead::sum_f32(&(x.as_tensor() * 3.0)?)?;
/// assert_eq!(loss.to_scalar::<f32>()?, 30.0);
/// let grads = loss.backward()?;
/// let g = grads.get(x.as_tensor()).expect("x has a gradient");
/// assert_eq!(g.to_vec2::<f32>()?, vec![vec![3.0, 3.0], vec![3.0, 3.0]]);
/// let b = multihead::cast(&Tensor::ones((2, 3), DType::F32, &Device::Cpu)?, DType::BF16)?;
/// assert_eq!(multihead::sum_f32(&b)?.dtype(), DType::F32);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
// Mirrors torch.sum(input, dtype=torch.float32).
pub fn sum_f32(t: &Tensor) -> Result<Tensor> {
    const OP: &str = "sum_f32";
    if !t.device().is_cpu() || !matches!(t.dtype(), DType::F32 | DType::BF16) {
        return Ok(convert_as(t, DType::F32, OP)?.sum_all()?);
    }
    if !t.is_contiguous() {
        let hint =
            "use a smaller input (a strided or broadcast view is copied before it is summed)";
        crate::alloc::ensure(OP, "copy of the input", t.dims(), t.dtype(), 1, hint)?;
    }
    Ok(t.contiguous()?.apply_op1(crate::fused::sum::SumF32)?)
}

/// `t` converted to `dtype`, after checking that what the conversion allocates can be
/// allocated (see [`convert_as`]).
fn convert(t: &Tensor, dtype: DType) -> Result<Tensor> {
    convert_as(t, dtype, "bf16/f16 conversion")
}

/// `t` converted to `dtype` for `op`, after checking that what a conversion on the CPU
/// allocates can be allocated: the result, and the copy of a strided or broadcast view that
/// the fast bf16 <-> f32 ops make first (a broadcast view of a few values can stand for more
/// elements than memory holds).
fn convert_as(t: &Tensor, dtype: DType, op: &'static str) -> Result<Tensor> {
    const HINT: &str = "use a smaller input (a broadcast view is copied before it is converted)";
    if t.dtype() != dtype && t.device().is_cpu() {
        let fast =
            matches!((t.dtype(), dtype), (DType::BF16, DType::F32) | (DType::F32, DType::BF16));
        if fast && !t.is_contiguous() {
            crate::alloc::ensure(op, "copy of the input", t.dims(), t.dtype(), 1, HINT)?;
        }
        if (t.dtype(), dtype) == (DType::F64, DType::BF16) {
            crate::alloc::ensure(op, "f32 intermediate", t.dims(), DType::F32, 1, HINT)?;
        }
        crate::alloc::ensure(op, "converted tensor", t.dims(), dtype, 1, HINT)?;
    }
    Ok(crate::fused::convert::to_dtype(t, dtype)?)
}

/// An optional tensor in f32.
pub(crate) fn widen_opt(t: Option<&Tensor>) -> Result<Option<Tensor>> {
    t.map(widen).transpose()
}

/// A float mask of a reduced dtype in f32; bool masks and f32 masks as they are.
pub(crate) fn widen_mask(m: Option<&Mask>) -> Result<Option<Mask>> {
    Ok(match m {
        Some(Mask::Float(t)) if is_reduced(t.dtype()) => Some(Mask::Float(widen(t)?)),
        other => other.cloned(),
    })
}

/// Whether every float mask given has `dtype` (PyTorch's rule: a float mask has the query's
/// dtype). A layer widens its call only then; otherwise the call goes the unwidened way, whose
/// checks report the mismatch.
pub(crate) fn masks_match(masks: &[Option<&Mask>], dtype: DType) -> bool {
    masks.iter().all(|m| match m {
        Some(Mask::Float(t)) => float_mask_takes(t.dtype(), dtype),
        _ => true,
    })
}

/// Whether a float mask of dtype `mask` goes with a query (or source, or memory) of dtype
/// `query`: the same dtype, or an f32 mask with a bf16, f16 or f64 query, as PyTorch's SDPA takes
/// "bool, float32 or the query's dtype" (this crate reads such a mask unrounded; an f64 call
/// widens it, exactly, as PyTorch's promotion does).
pub(crate) fn float_mask_takes(mask: DType, query: DType) -> bool {
    mask == query || (mask == DType::F32 && (is_reduced(query) || query == DType::F64))
}

/// A module whose parameters can be mapped (differentiably): a bf16/f16 layer runs as its f32
/// twin between one widening of its inputs and one rounding of its output, and under
/// [`autocast`](crate::autocast) an f32 layer runs with its parameters rounded.
pub(crate) trait CastParams: Sized {
    /// The same module with `f` applied to every parameter.
    fn map_params(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self>;

    /// The same module with f32 parameters.
    fn widened(&self) -> Result<Self> {
        self.map_params(&widen)
    }

    /// The same module with its parameters rounded to `dtype` (and kept in their dtype).
    fn rounded(&self, dtype: DType) -> Result<Self> {
        self.map_params(&|p| round(p, dtype))
    }

    /// The same module with `f` applied to the parameters its products read (weights and
    /// biases of its projections); a layer keeps its LayerNorms' as they are, which
    /// `torch.autocast` runs in f32.
    fn map_product_params(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        self.map_params(f)
    }
}

/// `t` rounded to `dtype` and back to its own dtype, differentiably (the gradient is rounded
/// the same way on its way back).
pub(crate) fn round(t: &Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        return Ok(t.clone());
    }
    Ok(crate::fused::convert::to_dtype(&narrow(t, dtype)?, t.dtype())?)
}

/// The dtype an autocast-aware module with parameters of dtype `params` computes in for an
/// input of dtype `input`: `Some` inside [`autocast`](crate::autocast) to bf16 or f16 for an
/// f32 module given an f32, bf16 or f16 input (which PyTorch's autocast casts; f64 it leaves as
/// it is), `None` otherwise: a bf16 or f16 module runs its own path (its own-dtype input as
/// outside autocast).
pub(crate) fn autocast_for(input: DType, params: DType) -> Option<DType> {
    let eligible = matches!(input, DType::F32 | DType::BF16 | DType::F16);
    crate::mode::autocast_dtype().filter(|dt| is_reduced(*dt) && eligible && params == DType::F32)
}

/// The dtype a module whose parameters have dtype `params` casts its inputs to under
/// [`autocast`](crate::autocast): `Some(dt)` inside an autocast to bf16 or f16 when the
/// parameters already have `dt` (a `model.to(torch.bfloat16)` run under
/// `torch.autocast("cpu", torch.bfloat16)`). PyTorch's autocast then casts the f32 (or other
/// reduced) inputs and float masks to `dt` and the call runs as on `dt` arguments, returning
/// `dt`; [`autocast_cast`] does the casting.
pub(crate) fn autocast_into(params: DType) -> Option<DType> {
    crate::mode::autocast_dtype().filter(|dt| is_reduced(*dt) && params == *dt)
}

/// A tensor argument of a module in `dt` under an autocast to `dt`, as PyTorch's autocast
/// casts it: an f32, bf16 or f16 tensor converted to `dt` (differentiably: its gradient comes
/// back in its own dtype), an f64 one left as it is (the call then refuses the mixed dtypes,
/// as PyTorch does).
pub(crate) fn autocast_cast(t: &Tensor, dt: DType) -> Result<Tensor> {
    match t.dtype() {
        DType::F32 | DType::BF16 | DType::F16 => narrow(t, dt),
        _ => Ok(t.clone()),
    }
}

/// A tensor argument of an autocast op as the op's f32 computation reads it: an f32, bf16 or
/// f16 tensor rounded to `dt` and held in f32 (differentiably; PyTorch's autocast casts it to
/// `dt`); any other (f64) as given, which the call's validation then names, as PyTorch refuses
/// the mixed call.
pub(crate) fn autocast_operand(t: &Tensor, dt: DType) -> Result<Tensor> {
    match t.dtype() {
        DType::F32 => round(t, dt),
        DType::BF16 | DType::F16 => widen(&narrow(t, dt)?),
        _ => Ok(t.clone()),
    }
}

/// `f` applied to a call's query, key and value, a tensor given twice converted once: the
/// aliasing that picks MultiheadAttention's projection grouping survives the conversion.
pub(crate) fn map_aliased(
    [query, key, value]: [&Tensor; 3],
    f: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Result<[Tensor; 3]> {
    let q = f(query)?;
    let k = if key.id() == query.id() { q.clone() } else { f(key)? };
    let v = match value.id() {
        id if id == key.id() => k.clone(),
        id if id == query.id() => q.clone(),
        _ => f(value)?,
    };
    Ok([q, k, v])
}

/// A bf16 or f16 input to a module's f32 computation under autocast, widened (exactly); any
/// other as given.
pub(crate) fn widen_reduced(t: &Tensor) -> Result<Tensor> {
    match is_reduced(t.dtype()) {
        true => widen(t),
        false => Ok(t.clone()),
    }
}

/// An autocast op's f32 result `y` for an input of dtype `input`: rounded to `dt` and kept an
/// f32 tensor for an f32 input (so that the f32 code around composes without casts), `dt` for a
/// bf16 or f16 input, as PyTorch returns it.
pub(crate) fn autocast_output(y: &Tensor, input: DType, dt: DType) -> Result<Tensor> {
    match input {
        DType::F32 => round(y, dt),
        _ => narrow(y, dt),
    }
}

/// Runs a Transformer layer's forward under [`autocast`](crate::autocast) as
/// `torch.autocast("cpu", dtype)` runs PyTorch's: the products (the projections, the attention,
/// the feed-forward block) read `dtype` operands (their weights and biases rounded,
/// differentiably, so the f32 master gradients are the rounded ones PyTorch gives; their
/// activations rounded as the products read them), while the LayerNorms, with their f32
/// parameters, and the residual sums compute in f32 on the f32 input, and the output stays
/// f32 (PyTorch's layer ends in a LayerNorm or a residual sum, both f32 under autocast).
/// `run` gets the module and a function that rounds float masks (which PyTorch's attention
/// casts to `dtype`). `macs` is the layer's largest product ([`crate::products::layer_macs`]).
/// Returns `None` when autocast does not apply to an input of `dtype`.
pub(crate) fn autocast_layer<M: CastParams>(
    module: &M,
    (dtype, params): (DType, DType),
    macs: u64,
    run: impl FnOnce(&M, &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor>,
) -> Option<Result<Tensor>> {
    let dt = autocast_for(dtype, params)?;
    let call = |m: M| autocast_call(&m, (dt, macs), run);
    let y = module.map_product_params(&|p| round(p, dt)).and_then(call);
    // PyTorch's layer on an input of `dt` ends in a LayerNorm of a `dt` sum, or in a `dt`
    // residual sum: `dt`. On f32 (or, under bf16 autocast, f16: its first residual sum promotes
    // to f32) it is f32.
    Some(y.and_then(|y| if dtype == dt { narrow(&y, dt) } else { Ok(y) }))
}

/// `run` on `module` with autocast off and the products' operands rounded to `dt` (where
/// the call's largest product, `macs`, takes them direct), given a function that rounds a
/// tensor to `dt`.
fn autocast_call<M>(
    module: &M,
    (dt, macs): (DType, u64),
    run: impl FnOnce(&M, &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor>,
) -> Result<Tensor> {
    crate::mode::autocast_off(|| {
        crate::mode::rounded_products(dt, macs, || run(module, &|t| autocast_operand(t, dt)))
    })
}

/// Runs an autocast-aware module's forward under [`autocast`](crate::autocast): `run` gets
/// the module with rounded parameters and a function that rounds its tensor inputs, runs with
/// autocast off (so that the modules inside compute in f32 on the rounded values, as the
/// reduced-dtype path does), and its output is rounded once. Returns `None` when autocast does
/// not apply to an input of `dtype`. `macs` is the call's largest product.
pub(crate) fn autocast_run<M: CastParams>(
    module: &M,
    (dtype, params): (DType, DType),
    macs: u64,
    run: impl FnOnce(&M, &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor>,
) -> Option<Result<Tensor>> {
    let dt = autocast_for(dtype, params)?;
    let y = module.rounded(dt).and_then(|m| autocast_call(&m, (dt, macs), run));
    Some(y.and_then(|y| autocast_output(&y, dtype, dt)))
}
