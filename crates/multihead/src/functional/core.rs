//! The attention core both functional APIs share: a softmax that keeps fully masked rows at
//! zero, dropout on the weights, and `softmax(scale · q kᵀ + mask) v` composed from candle
//! operations (so candle's autograd differentiates it; candle's own `softmax_last_dim` drops
//! gradients on contiguous input).

use candle_core::{DType, Tensor, D};

use crate::error::{Error, Result};
use crate::random::DropoutKey;

/// Softmax over the last dimension that gives a zero row, not NaN, when every entry of the row
/// is `-inf` (PyTorch's `_safe_softmax`). A row holding `+inf` is NaN, as in PyTorch.
///
/// The row maximum is subtracted for stability and detached: softmax does not depend on it, so
/// its gradient is zero and need not be propagated.
///
/// # Shapes
/// * x: any shape with at least one dimension; softmax over the last; output alike.
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor};
///
/// let x = Tensor::new(&[[0.0f32, 0.0], [f32::NEG_INFINITY, f32::NEG_INFINITY]], &Device::Cpu)?;
/// let y = multihead::functional::safe_softmax_last_dim(&x)?.to_vec2::<f32>()?;
/// assert_eq!(y, [[0.5, 0.5], [0.0, 0.0]]); // a fully masked row is 0, not NaN
/// # Ok::<(), multihead::Error>(())
/// ```
// Mirrors torch._safe_softmax(x, -1).
pub fn safe_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    // A row of all -inf has max -inf; use 0 there so that exp(-inf - 0) = 0 instead of NaN.
    let m = m.eq(f64::NEG_INFINITY)?.where_cond(&m.zeros_like()?, &m)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    // Every row with a finite entry has s >= 1 (its maximum contributes exp(0)); s = 0 only for
    // fully masked rows, whose e is all zeros, so dividing by 1 there gives the zero row. The 1
    // is added rather than selected, so the sum's gradient still flows there: PyTorch's softmax
    // backward, (g - Σ g·y)·y, is NaN on such a row when g holds an infinity (an infinite
    // value, where 0·inf makes the output NaN too), and so is the fused kernels' (D = Σ dO·O).
    let s = (&s + s.eq(0f64)?.to_dtype(s.dtype())?)?;
    Ok(e.broadcast_div(&s)?)
}

/// Multiplies `w` `(B, L, S)` by a dropout mask drawn from `key`: dropped entries become 0 and
/// kept entries are scaled by `1 / (1 - p)`. Element `(b, i, j)` uses the counter `(b, i, j)`.
pub(crate) fn apply_dropout(w: &Tensor, p: f64, key: DropoutKey) -> Result<Tensor> {
    let (b, l, s) = w.dims3()?;
    let n = crate::alloc::elements("dropout", "attention weights", &[b, l, s])?;
    let mut data = crate::alloc::try_zeros::<f64>(n, "dropout mask")?;
    multihead_kernels::dropout::fill_scale_mask(key, p, b, l, s, &mut data)
        .map_err(|e| crate::Error::Config { op: "dropout", arg: "p", msg: e.to_string() })?;
    let mask = Tensor::from_vec(data, (b, l, s), w.device())?.to_dtype(w.dtype())?;
    Ok(w.mul(&mask)?)
}

/// A call's additive masks as the composed path applies them.
#[derive(Clone, Copy, Default)]
pub(crate) struct ScoreMasks<'a> {
    /// Added to the scores: the caller's masks, the ALiBi bias, and the keys hidden by index
    /// unless they are in `hide`.
    pub add: Option<&'a Tensor>,
    /// Whether the caller's masks (attention or padding masks) are among `add`: with a cap after
    /// the masks, a `-inf` sum is then kept `-inf`, as the kernels keep it (the ALiBi bias alone
    /// is not a mask there).
    pub masked: bool,
    /// Keys hidden by index, added after a cap that follows the masks (`0` or `-inf`).
    pub hide: Option<&'a Tensor>,
}

/// The attention core on flattened batches: `softmax(cap(scale · q kᵀ) + mask) v`, with
/// `cap(x) = c·tanh(x/c)` for a soft cap `(c, false)` (the identity without one), or
/// `softmax(cap(scale · q kᵀ + mask)) v` with `-inf` kept for `(c, true)`; `sinks`
/// (broadcastable to `(B, L, 1)`) join each softmax row as a column with no value.
///
/// `q` `(B, L, D)`, `k` `(B, S, D)`, `v` `(B, S, Dv)`; `masks.add` broadcastable to
/// `(B, L, S)`, and `masks.hide` (broadcastable too, `0` or `-inf`) hiding keys by index after
/// the cap, as the fused kernels do for a cap after the masks (a capped `+inf` score stays
/// hidden, not NaN).
/// Returns the output `(B, L, Dv)` and, when asked, the (post-dropout) weights `(B, L, S)`.
pub(crate) fn attention_core(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    masks: ScoreMasks<'_>,
    (scale, softcap, sinks): (f64, Option<(f64, bool)>, Option<&Tensor>),
    dropout: Option<(f64, DropoutKey)>,
    want_weights: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (b, l, _) = q.dims3()?;
    let s = k.dim(1)?;
    let dv = v.dim(2)?;
    if b == 0 || l == 0 || s == 0 {
        // Nothing to attend: PyTorch's softmax over an empty row is empty and bmm gives zeros.
        let mut inputs = vec![q, k, v];
        inputs.extend(masks.add.into_iter().chain(sinks));
        let out = crate::fused::zeros::zeros_of(&[b, l, dv], q.dtype(), &inputs)?;
        let w = Tensor::zeros((b, l, s), q.dtype(), q.device())?;
        return Ok((out, want_weights.then_some(w)));
    }
    let w = attention_probs(q, k, masks, (scale, softcap, sinks), dropout)?;
    let out = w.matmul(v)?;
    Ok((out, want_weights.then_some(w)))
}

/// The (post-dropout) attention weights `(B, L, S)` of [`attention_core`], for non-empty `q`
/// `(B, L, D)` and `k` `(B, S, D)`.
pub(crate) fn attention_probs(
    q: &Tensor,
    k: &Tensor,
    ScoreMasks { add: mask, masked, hide }: ScoreMasks<'_>,
    (scale, softcap, sinks): (f64, Option<(f64, bool)>, Option<&Tensor>),
    dropout: Option<(f64, DropoutKey)>,
) -> Result<Tensor> {
    let (b, l, _) = q.dims3()?;
    let s = k.dim(1)?;
    // candle drops an `affine` by 0 from the graph (no gradient at all); PyTorch's query
    // gradient is then `0 · dS k` (zeros, NaN where `dS k` is).
    let scaled = match scale == 0.0 {
        true => q.broadcast_mul(&Tensor::zeros((), q.dtype(), q.device())?)?,
        false => q.affine(scale, 0.0)?,
    };
    let scores = scaled.matmul(&k.t()?)?;
    let cap = |x: &Tensor, c: f64| -> Result<Tensor> {
        Ok(x.affine(1.0 / c, 0.0)?.tanh()?.affine(c, 0.0)?)
    };
    let scores = match softcap {
        Some((c, false)) => cap(&scores, c)?,
        _ => scores,
    };
    let scores = match mask {
        Some(m) => scores.broadcast_add(m)?,
        None => scores,
    };
    let scores = match softcap {
        // ONNX's placement: the masks inside the cap, a -inf entry kept where masks are.
        Some((c, true)) if masked => {
            scores.eq(f64::NEG_INFINITY)?.where_cond(&scores, &cap(&scores, c)?)?
        }
        Some((c, true)) => cap(&scores, c)?,
        _ => scores,
    };
    let scores = match hide {
        Some(h) => scores.broadcast_add(h)?,
        None => scores,
    };
    let mut w = match sinks {
        // gpt-oss: the sink is a column of the softmax, cut off afterwards.
        Some(t) => {
            let col = t.broadcast_as((b, l, 1))?;
            safe_softmax_last_dim(&Tensor::cat(&[&scores, &col], 2)?)?.narrow(2, 0, s)?
        }
        None => safe_softmax_last_dim(&scores)?,
    };
    if let Some((p, key)) = dropout {
        if p > 0.0 {
            w = apply_dropout(&w, p, key)?;
        }
    }
    Ok(w)
}

/// An explicit `scale` must be finite, and in f32 too unless the inputs are f64: the kernels and
/// the f32 ops multiply in f32 (and bf16 inputs in f32), where a scale past 3.4e38 is infinite
/// and every score NaN or infinite (PyTorch returns those rows; refusing says why).
pub(crate) fn check_scale(op: &'static str, scale: Option<f64>, dtype: DType) -> Result<()> {
    let Some(s) = scale else { return Ok(()) };
    let wide = dtype == DType::F64;
    if !s.is_finite() || (!wide && !(s as f32).is_finite()) {
        let within = if wide { "" } else { " (within f32's range for non-f64 inputs)" };
        return Err(Error::Config {
            op,
            arg: "scale",
            msg: format!("scale must be finite{within}, got {s:e}; pass a smaller scale"),
        });
    }
    Ok(())
}

pub(crate) fn check_dropout(p: f64, op: &'static str) -> Result<()> {
    if (0.0..1.0).contains(&p) {
        Ok(())
    } else {
        Err(Error::Config {
            op,
            arg: "dropout_p",
            msg: format!("dropout probability has to be in [0, 1), got {p}"),
        })
    }
}

/// `t` broadcast to `dims`, or `t` itself where it has that shape: candle records a broadcast
/// to the same shape as an op too, and its backward then sums the gradient over no dimension
/// (a copy on one thread, the size of the input).
pub(crate) fn expand_to(t: &Tensor, dims: &[usize]) -> Result<Tensor> {
    Ok(if t.dims() == dims { t.clone() } else { t.broadcast_as(dims)? })
}

/// `repeat_interleave(x, r, dim)`.
pub(crate) fn repeat_interleave(x: &Tensor, r: usize, dim: usize) -> Result<Tensor> {
    if r == 1 {
        return Ok(x.clone());
    }
    let mut expanded: Vec<usize> = x.dims().to_vec();
    expanded.insert(dim + 1, r);
    let mut merged: Vec<usize> = x.dims().to_vec();
    merged[dim] *= r;
    Ok(x.unsqueeze(dim + 1)?.broadcast_as(expanded)?.contiguous()?.reshape(merged)?)
}

/// Broadcasts shapes by NumPy's rule (aligned on the right).
pub(crate) fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { 1 };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { 1 };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// `Tensor::cat` that leaves out empty pieces (candle's CPU copy mishandles zero-sized inputs).
pub(crate) fn cat_nonempty(parts: &[&Tensor], dim: usize) -> Result<Tensor> {
    let kept: Vec<&Tensor> = parts.iter().copied().filter(|t| t.elem_count() > 0).collect();
    match kept.as_slice() {
        [] => {
            let mut dims = parts[0].dims().to_vec();
            dims[dim] = parts.iter().map(|t| t.dim(dim).unwrap_or(0)).sum();
            Ok(Tensor::zeros(dims, parts[0].dtype(), parts[0].device())?)
        }
        [one] if one.dim(dim)? == parts.iter().map(|t| t.dim(dim).unwrap_or(0)).sum::<usize>() => {
            Ok((*one).clone())
        }
        _ => Ok(Tensor::cat(&kept, dim)?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn expand_to_its_own_shape_records_no_op_and_a_wider_one_broadcasts() {
        let v = Var::from_tensor(&Tensor::arange(0f32, 6.0, &Device::Cpu).expect("arange"))
            .expect("var");
        let t = v.as_tensor().reshape((1, 2, 3)).expect("reshape");
        // The same tensor (no broadcast node whose backward would copy the gradient).
        assert_eq!(expand_to(&t, &[1, 2, 3]).expect("same").id(), t.id());
        let wide = expand_to(&t, &[4, 2, 3]).expect("wide");
        assert_eq!(wide.dims(), &[4, 2, 3]);
        let back = wide.sum_all().expect("sum").backward().expect("backward");
        let g = back.get(v.as_tensor()).expect("gradient").to_vec1::<f32>().expect("vec");
        assert_eq!(g, vec![4.0; 6]);
    }
}
