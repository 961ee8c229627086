//! Attention masks: PyTorch's two kinds (bool and additive float) and their polarity.

use candle_core::{DType, Device, Tensor};

use crate::error::{fmt_shape, Error, Result};

/// An attention or key-padding mask, as PyTorch accepts it.
///
/// PyTorch tells the two kinds apart by dtype; candle has no bool dtype, so the kind is explicit:
///
/// * [`Mask::Bool`] holds a `u8` tensor (any non-zero value is `True`). In
///   [`MultiheadAttention`](crate::MultiheadAttention) and
///   [`multi_head_attention_forward`](crate::functional::multi_head_attention_forward), `True`
///   means the position may **not** be attended (it becomes `-inf`). In
///   [`scaled_dot_product_attention`](crate::functional::scaled_dot_product_attention) the
///   polarity is SDPA's: `True` means the position **may** be attended.
/// * [`Mask::Float`] holds a float tensor of the query's dtype (or f32 with a bf16, f16 or f64
///   query, added unrounded, as PyTorch's SDPA takes it) that is **added** to the scaled scores;
///   `-inf` forbids a position.
///
/// Integer masks are rejected, as in PyTorch: a `Bool` mask must be `u8` and a `Float` mask must
/// have a float dtype.
///
/// # Shapes
/// See the function that takes the mask: `(L, S)` or `(N·H, L, S)` for an `attn_mask`, `(N, S)`
/// for a `key_padding_mask`.
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor};
/// use multihead::Mask;
///
/// // Batch of 2 sequences of 3 keys; the last key of the second sequence is padding.
/// let kpm = Mask::Bool(Tensor::new(&[[0u8, 0, 0], [0, 0, 1]], &Device::Cpu)?);
/// assert!(kpm.is_bool());
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub enum Mask {
    /// A boolean mask stored as `u8` (non-zero is `True`).
    Bool(Tensor),
    /// An additive float mask of the query's dtype (or f32 with a bf16, f16 or f64 query).
    Float(Tensor),
}

impl Mask {
    /// The tensor inside.
    pub fn tensor(&self) -> &Tensor {
        match self {
            Mask::Bool(t) | Mask::Float(t) => t,
        }
    }

    /// Whether this is a [`Mask::Bool`].
    pub fn is_bool(&self) -> bool {
        matches!(self, Mask::Bool(_))
    }

    /// The mask's dimensions.
    pub fn dims(&self) -> &[usize] {
        self.tensor().dims()
    }

    /// Checks the dtype rule: bool masks are `u8`, float masks have a float dtype.
    pub(crate) fn check_kind(&self, op: &'static str, arg: &'static str) -> Result<()> {
        let ok = match self {
            Mask::Bool(t) => t.dtype() == DType::U8,
            Mask::Float(t) => t.dtype().is_float(),
        };
        if ok {
            Ok(())
        } else {
            let got = self.tensor().dtype();
            // PyTorch says "only bool and floating types of masks are supported"; here the
            // wrapper says which dtype it must hold.
            let msg = match self {
                Mask::Bool(_) => format!(
                    "a Mask::Bool must hold a bool (u8) tensor, got {got:?}; convert it with \
                     `t.ne(0.0)?` (which gives u8), or pass Mask::Float for a mask added to the scores"
                ),
                Mask::Float(_) => format!(
                    "a Mask::Float must hold a floating tensor added to the scores, got {got:?}; \
                     pass Mask::Bool for a bool (u8) mask, or convert with `t.to_dtype(DType::F32)?`"
                ),
            };
            Err(Error::DType { op, arg, msg })
        }
    }

    /// Converts to an additive float mask of `dtype` with MultiheadAttention's polarity
    /// (`True` = masked = `-inf`). A float mask must already have `dtype` (or be f32: kept f32
    /// with a bf16 or f16 `dtype`, widened exactly with f64); it is never rounded.
    pub(crate) fn to_additive(
        &self,
        dtype: DType,
        op: &'static str,
        arg: &'static str,
    ) -> Result<Tensor> {
        self.check_kind(op, arg)?;
        match self {
            Mask::Bool(t) => bool_to_additive(t, dtype, true),
            Mask::Float(t) => float_in(t, dtype, op, arg),
        }
    }

    /// Converts to an additive float mask with SDPA's polarity (`True` = keep).
    pub(crate) fn to_additive_sdpa(
        &self,
        dtype: DType,
        op: &'static str,
        arg: &'static str,
    ) -> Result<Tensor> {
        self.check_kind(op, arg)?;
        match self {
            Mask::Bool(t) => bool_to_additive(t, dtype, false),
            Mask::Float(t) => float_in(t, dtype, op, arg),
        }
    }
}

/// A float mask has the query's dtype, or is f32 with a bf16, f16 or f64 query: PyTorch's SDPA
/// takes "bool, float32 or the query's dtype". Its kernels add an f32 mask in f32 to reduced
/// scores, as this crate's reduced-precision calls do (they compute in f32 and read every mask
/// widened), and promote it to f64 beside f64 scores.
fn check_float_dtype(t: &Tensor, dtype: DType, op: &'static str, arg: &'static str) -> Result<()> {
    if crate::precision::float_mask_takes(t.dtype(), dtype) {
        Ok(())
    } else {
        Err(Error::DType {
            op,
            arg,
            msg: format!(
                "a float mask must have the query's dtype {dtype:?} (or f32), got {:?}; convert \
                 it with .to_dtype(DType::{dtype:?})",
                t.dtype()
            ),
        })
    }
}

/// The float mask `t` as a call in `dtype` reads it: as it is, or an f32 mask with an f64 query
/// widened to f64 (exact and differentiable: its gradient comes back in f32, as PyTorch's
/// promotion gives it). A broadcast view is widened at the size of the data behind it.
fn float_in(t: &Tensor, dtype: DType, op: &'static str, arg: &'static str) -> Result<Tensor> {
    check_float_dtype(t, dtype, op, arg)?;
    if t.dtype() == dtype || dtype != DType::F64 {
        return Ok(t.clone());
    }
    let c = compact(t)?;
    crate::alloc::ensure(op, arg, c.dims(), dtype, 1, "pass a smaller mask")?;
    let wide = c.to_dtype(dtype)?;
    Ok(match c.dims() == t.dims() {
        true => wide,
        false => wide.broadcast_as(t.shape())?,
    })
}

/// `t` without the copies of its broadcast dimensions: each dimension that a view repeats
/// (stride 0, size above 1) narrowed to size 1, which broadcasts back to the same shape with
/// the same values. A view: nothing is copied.
pub(crate) fn compact(t: &Tensor) -> Result<Tensor> {
    let mut t = t.clone();
    for d in 0..t.rank() {
        if t.dim(d)? > 1 && t.stride()[d] == 0 {
            t = t.narrow(d, 0, 1)?;
        }
    }
    Ok(t)
}

/// `True` (non-zero) becomes `-inf` when `true_masks`, otherwise `False` does; the rest is 0.
///
/// A broadcast view (`expand`, stride 0) is converted at the size of the data behind it and
/// broadcast back to its shape: the same values, without a copy of the dimensions it repeats
/// (an `(L, S)` mask expanded to `(N·H, L, S)` costs `L·S` floats, not `N·H·L·S`).
fn bool_to_additive(t: &Tensor, dtype: DType, true_masks: bool) -> Result<Tensor> {
    let c = compact(t)?;
    // Three mask-sized float tensors.
    crate::alloc::ensure("mask", "bool mask", c.dims(), dtype, 3, "pass a smaller mask")?;
    let neg_inf = Tensor::full(f64::NEG_INFINITY, c.shape(), c.device())?.to_dtype(dtype)?;
    let zeros = Tensor::zeros(c.shape(), dtype, c.device())?;
    let out =
        if true_masks { c.where_cond(&neg_inf, &zeros)? } else { c.where_cond(&zeros, &neg_inf)? };
    Ok(match c.dims() == t.dims() {
        true => out,
        false => out.broadcast_as(t.dims())?,
    })
}

/// A causal mask aligned to the upper left: row `i` may attend columns `0..=i`, the rest is
/// `-inf`. Shape `(l, s)`; this is the mask SDPA's `is_causal=True` uses, also when `l != s`.
pub(crate) fn causal_upper_left(
    l: usize,
    s: usize,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    crate::alloc::expect_float("causal mask", "dtype", dtype)?;
    let n = crate::alloc::elements("causal mask", "mask", &[l, s])?;
    crate::alloc::ensure("causal mask", "mask", &[l, s], DType::F64, 2, "use shorter sequences")?;
    let mut data = crate::alloc::try_zeros::<f64>(n, "causal mask")?;
    for i in 0..l {
        for j in (i + 1).min(s)..s {
            data[i * s + j] = f64::NEG_INFINITY;
        }
    }
    Ok(Tensor::from_vec(data, (l, s), device)?.to_dtype(dtype)?)
}

/// A square causal mask, as `torch.nn.Transformer.generate_square_subsequent_mask(sz)`:
/// `0.0` on and below the diagonal, `-inf` above it.
///
/// `dtype` must be a float dtype (an integer mask could not hold `-inf`).
///
/// # Shapes
/// Returns `(sz, sz)`; `sz = 0` gives `(0, 0)`.
///
/// # Example
/// ```
/// use candle_core::{DType, Device};
/// let m = multihead::generate_square_subsequent_mask(3, DType::F32, &Device::Cpu)?;
/// assert_eq!(m.to_vec2::<f32>()?[0], vec![0.0, f32::NEG_INFINITY, f32::NEG_INFINITY]);
/// # Ok::<(), multihead::Error>(())
/// ```
// Mirrors torch.nn.Transformer.generate_square_subsequent_mask.
pub fn generate_square_subsequent_mask(sz: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    causal_upper_left(sz, sz, dtype, device)
}

/// Checks that a mask has exactly `expected` dimensions.
pub(crate) fn expect_dims(
    t: &Tensor,
    expected: &[usize],
    op: &'static str,
    arg: &'static str,
    what: &str,
) -> Result<()> {
    if t.dims() == expected {
        Ok(())
    } else {
        Err(Error::Shape {
            op,
            arg,
            msg: format!("expected {what} {}, got {}", fmt_shape(expected), fmt_shape(t.dims())),
        })
    }
}
