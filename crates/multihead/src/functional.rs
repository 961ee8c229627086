//! The `torch.nn.functional` equivalents: [`scaled_dot_product_attention`] and
//! [`multi_head_attention_forward`].
//!
//! Both are composed from candle operations, so candle's autograd differentiates them for every
//! input and parameter. Softmax is written here from primitives (candle's fused
//! `softmax_last_dim` drops gradients on contiguous input).

use candle_core::{Tensor, D};

use crate::error::{fmt_shape, Error, Result};
use crate::linear::linear;
use crate::mask::{causal_upper_left, expect_dims, Mask};
use crate::random::{next_dropout_key, DropoutKey};

const SDPA: &str = "scaled_dot_product_attention";
/// From this many keys on, the fused MHA path copies K and V into a per-head layout first.
const LONG_KEYS: usize = 2048;
/// ... except when gradients are recorded and there are at least this many keys.
const LONG_KEYS_TRAINING_MAX: usize = 8192;
const MHA: &str = "multi_head_attention_forward";

/// Softmax over the last dimension that gives a zero row, not NaN, when every entry of the row
/// is `-inf` (PyTorch's `_safe_softmax`). A row holding `+inf` is NaN, as in PyTorch.
///
/// The row maximum is subtracted for stability and detached: softmax does not depend on it, so
/// its gradient is zero and need not be propagated.
pub fn safe_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    // A row of all -inf has max -inf; use 0 there so that exp(-inf - 0) = 0 instead of NaN.
    let m = m.eq(f64::NEG_INFINITY)?.where_cond(&m.zeros_like()?, &m)?;
    let e = x.broadcast_sub(&m)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    // Every row with a finite entry has s >= 1 (its maximum contributes exp(0)); s = 0 only for
    // fully masked rows, whose e is all zeros, so dividing by 1 there gives the zero row.
    let s = s.eq(0f64)?.where_cond(&s.ones_like()?, &s)?;
    Ok(e.broadcast_div(&s)?)
}

/// Multiplies `w` `(B, L, S)` by a dropout mask drawn from `key`: dropped entries become 0 and
/// kept entries are scaled by `1 / (1 - p)`. Element `(b, i, j)` uses the counter `(b, i, j)`.
pub(crate) fn apply_dropout(w: &Tensor, p: f64, key: DropoutKey) -> Result<Tensor> {
    let (b, l, s) = w.dims3()?;
    let mut data = vec![0f64; b * l * s];
    multihead_kernels::dropout::fill_scale_mask(key, p, b, l, s, &mut data);
    let mask = Tensor::from_vec(data, (b, l, s), w.device())?.to_dtype(w.dtype())?;
    Ok(w.mul(&mask)?)
}

/// The attention core on flattened batches: `softmax(scale · q kᵀ + mask) v`.
///
/// `q` `(B, L, D)`, `k` `(B, S, D)`, `v` `(B, S, Dv)`, `mask` broadcastable to `(B, L, S)`.
/// Returns the output `(B, L, Dv)` and, when asked, the (post-dropout) weights `(B, L, S)`.
pub(crate) fn attention_core(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    dropout: Option<(f64, DropoutKey)>,
    want_weights: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let (b, l, _) = q.dims3()?;
    let s = k.dim(1)?;
    let dv = v.dim(2)?;
    if b == 0 || l == 0 || s == 0 {
        // Nothing to attend: PyTorch's softmax over an empty row is empty and bmm gives zeros.
        let out = Tensor::zeros((b, l, dv), q.dtype(), q.device())?;
        let w = Tensor::zeros((b, l, s), q.dtype(), q.device())?;
        return Ok((out, want_weights.then_some(w)));
    }
    let scores = q.affine(scale, 0.0)?.matmul(&k.t()?)?;
    let scores = match mask {
        Some(m) => scores.broadcast_add(m)?,
        None => scores,
    };
    let mut w = safe_softmax_last_dim(&scores)?;
    if let Some((p, key)) = dropout {
        if p > 0.0 {
            w = apply_dropout(&w, p, key)?;
        }
    }
    let out = w.matmul(v)?;
    Ok((out, want_weights.then_some(w)))
}

fn check_dropout(p: f64, op: &'static str) -> Result<()> {
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

/// Options of [`scaled_dot_product_attention`], with PyTorch's defaults.
#[derive(Clone, Debug, Default)]
pub struct SdpaOptions {
    /// A mask broadcastable to `(..., Hq, L, S)`. **SDPA polarity**: a bool `True` means the
    /// position may be attended. A float mask is added to the scaled scores. Default `None`.
    pub attn_mask: Option<Mask>,
    /// Dropout probability on the attention weights, always applied when `> 0` (SDPA has no
    /// training flag). Must lie in `[0, 1)`. Default `0.0`.
    pub dropout_p: f64,
    /// Apply an upper-left aligned causal mask (row `i` sees keys `0..=i`). Cannot be combined
    /// with `attn_mask`. Default `false`.
    pub is_causal: bool,
    /// The score scale; `None` means `1/√E` with E the query's last dimension. Default `None`.
    pub scale: Option<f64>,
    /// Repeat key and value heads to the query's head count (grouped-query attention).
    /// Default `false`.
    pub enable_gqa: bool,
    /// The dropout key; `None` draws the next one from the global generator
    /// ([`manual_seed`](crate::manual_seed)). Default `None`.
    pub dropout_key: Option<DropoutKey>,
}

impl SdpaOptions {
    /// Sets `attn_mask`.
    pub fn attn_mask(mut self, mask: Mask) -> Self {
        self.attn_mask = Some(mask);
        self
    }
    /// Sets `dropout_p`.
    pub fn dropout_p(mut self, p: f64) -> Self {
        self.dropout_p = p;
        self
    }
    /// Sets `is_causal`.
    pub fn is_causal(mut self, causal: bool) -> Self {
        self.is_causal = causal;
        self
    }
    /// Sets `scale`.
    pub fn scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }
    /// Sets `enable_gqa`.
    pub fn enable_gqa(mut self, gqa: bool) -> Self {
        self.enable_gqa = gqa;
        self
    }
}

/// `repeat_interleave(x, r, dim)`.
fn repeat_interleave(x: &Tensor, r: usize, dim: usize) -> Result<Tensor> {
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
fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
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

/// Scaled dot-product attention: `softmax(q kᵀ · scale + mask) v`, with optional dropout on the
/// weights.
///
/// Fully masked rows give zeros, as PyTorch's CPU backends do.
///
/// # Shapes
/// * `query` `(..., Hq, L, E)`, `key` `(..., H, S, E)`, `value` `(..., H, S, Ev)`, at least 2-D;
///   leading dimensions broadcast. With `enable_gqa`, `Hq` must be a multiple of `H`.
/// * `attn_mask` broadcastable to `(..., Hq, L, S)`.
/// * output `(..., Hq, L, Ev)`.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
///
/// let q = Tensor::randn(0f32, 1.0, (2, 4, 5, 8), &Device::Cpu)?; // (N, H, L, E)
/// let k = Tensor::randn(0f32, 1.0, (2, 4, 7, 8), &Device::Cpu)?; // (N, H, S, E)
/// let v = Tensor::randn(0f32, 1.0, (2, 4, 7, 8), &Device::Cpu)?;
/// let out = scaled_dot_product_attention(&q, &k, &v, &SdpaOptions::default().is_causal(true))?;
/// assert_eq!(out.dims(), &[2, 4, 5, 8]);
/// # Ok::<(), multihead::Error>(())
/// ```
// Mirrors torch.nn.functional.scaled_dot_product_attention.
pub fn scaled_dot_product_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    opts: &SdpaOptions,
) -> Result<Tensor> {
    let (qr, kr, vr) = (query.rank(), key.rank(), value.rank());
    if qr < 2 || kr < 2 || vr < 2 {
        return Err(Error::Shape {
            op: SDPA,
            arg: "query",
            msg: format!(
                "expected query, key, and value to all be at least 2 dimensional, got {}-D, {}-D and {}-D",
                qr, kr, vr
            ),
        });
    }
    if query.dtype() != key.dtype() || query.dtype() != value.dtype() {
        return Err(Error::DType {
            op: SDPA,
            arg: "query",
            msg: format!(
                "expected query, key, and value to have the same dtype, got {:?}, {:?} and {:?}",
                query.dtype(),
                key.dtype(),
                value.dtype()
            ),
        });
    }
    check_dropout(opts.dropout_p, SDPA)?;
    if opts.is_causal && opts.attn_mask.is_some() {
        return Err(Error::Config {
            op: SDPA,
            arg: "attn_mask",
            msg: "explicit attn_mask should not be set when is_causal=true".into(),
        });
    }
    let (l, e) = (query.dim(qr - 2)?, query.dim(qr - 1)?);
    let (s, ek) = (key.dim(kr - 2)?, key.dim(kr - 1)?);
    let (sv, ev) = (value.dim(vr - 2)?, value.dim(vr - 1)?);
    if ek != e {
        return Err(Error::Shape {
            op: SDPA,
            arg: "key",
            msg: format!(
                "the key's last dimension must equal the query's: key {} vs query {}",
                fmt_shape(key.dims()),
                fmt_shape(query.dims())
            ),
        });
    }
    if sv != s {
        return Err(Error::Shape {
            op: SDPA,
            arg: "value",
            msg: format!(
                "key and value must have the same sequence length: key {} vs value {}",
                fmt_shape(key.dims()),
                fmt_shape(value.dims())
            ),
        });
    }
    if let Some(out) = sdpa_fused(query, key, value, opts)? {
        return Ok(out);
    }
    let mut key = key.clone();
    let mut value = value.clone();
    if opts.enable_gqa && qr >= 3 && kr >= 3 && vr >= 3 {
        let hq = query.dim(qr - 3)?;
        let (hk, hv) = (key.dim(kr - 3)?, value.dim(vr - 3)?);
        if hk == 0 || hv == 0 || hq % hk != 0 || hq % hv != 0 {
            return Err(Error::Shape {
                op: SDPA,
                arg: "key",
                msg: format!(
                    "number of heads in key and value must divide the number of heads in query: query {} key {} value {}",
                    fmt_shape(query.dims()),
                    fmt_shape(key.dims()),
                    fmt_shape(value.dims())
                ),
            });
        }
        key = repeat_interleave(&key, hq / hk, kr - 3)?;
        value = repeat_interleave(&value, hq / hv, vr - 3)?;
    }
    let q_batch = &query.dims()[..qr - 2];
    let k_batch = &key.dims()[..kr - 2];
    let v_batch = &value.dims()[..vr - 2];
    let batch = broadcast_shapes(q_batch, k_batch)
        .and_then(|b| broadcast_shapes(&b, v_batch))
        .ok_or_else(|| Error::Shape {
            op: SDPA,
            arg: "key",
            msg: format!(
                "the batch dimensions of query {}, key {} and value {} do not broadcast",
                fmt_shape(query.dims()),
                fmt_shape(key.dims()),
                fmt_shape(value.dims())
            ),
        })?;
    let bsz: usize = batch.iter().product();
    let with = |lead: &[usize], a: usize, b: usize| {
        let mut v = lead.to_vec();
        v.push(a);
        v.push(b);
        v
    };
    let q = query.broadcast_as(with(&batch, l, e))?.contiguous()?.reshape((bsz, l, e))?;
    let k = key.broadcast_as(with(&batch, s, e))?.contiguous()?.reshape((bsz, s, e))?;
    let v = value.broadcast_as(with(&batch, s, ev))?.contiguous()?.reshape((bsz, s, ev))?;

    let mask = if let Some(m) = &opts.attn_mask {
        let add = m.to_additive_sdpa(query.dtype(), SDPA, "attn_mask")?;
        let full = with(&batch, l, s);
        let ok = broadcast_shapes(add.dims(), &full).is_some_and(|b| b == full);
        if !ok {
            return Err(Error::Shape {
                op: SDPA,
                arg: "attn_mask",
                msg: format!(
                    "attn_mask of shape {} does not broadcast to the attention shape {}",
                    fmt_shape(add.dims()),
                    fmt_shape(&full)
                ),
            });
        }
        Some(add.broadcast_as(full)?.contiguous()?.reshape((bsz, l, s))?)
    } else if opts.is_causal {
        Some(causal_upper_left(l, s, query.dtype(), query.device())?)
    } else {
        None
    };
    let scale = opts.scale.unwrap_or_else(|| 1.0 / (e as f64).sqrt());
    let dropout = (opts.dropout_p > 0.0)
        .then(|| (opts.dropout_p, opts.dropout_key.unwrap_or_else(next_dropout_key)));
    let (out, _) = attention_core(&q, &k, &v, mask.as_ref(), scale, dropout, false)?;
    Ok(out.reshape(with(&batch, l, ev))?)
}

/// The fused kernels for 4-D f32 `(B, H, L, E)` inputs without batch broadcasting; `None` when
/// the composed path must run.
fn sdpa_fused(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    opts: &SdpaOptions,
) -> Result<Option<Tensor>> {
    use crate::fused::{Convention, FlashAttention, OwnedMask};
    if !crate::fused::usable(query) || query.rank() != 4 || key.rank() != 4 || value.rank() != 4 {
        return Ok(None);
    }
    let (b, hq, l, e) = query.dims4()?;
    let (bk, hk, s, _) = key.dims4()?;
    let (bv, hv, _, ev) = value.dims4()?;
    let heads_ok = hk == hv && (hk == hq || (opts.enable_gqa && hk > 0 && hq % hk == 0));
    if bk != b || bv != b || !heads_ok || l == 0 || s == 0 || b == 0 || hq == 0 {
        return Ok(None);
    }
    let mut masks = Vec::new();
    if let Some(m) = &opts.attn_mask {
        let add = m.to_additive_sdpa(query.dtype(), SDPA, "attn_mask")?;
        if add.rank() > 4 {
            return Ok(None);
        }
        let mut dims = vec![1usize; 4 - add.rank()];
        dims.extend_from_slice(add.dims());
        let full = [b, hq, l, s];
        if dims.iter().zip(full).any(|(&d, f)| d != 1 && d != f) {
            return Ok(None); // the composed path reports the broadcast error
        }
        let mut strides = [0usize; 4];
        let mut acc = 1;
        for i in (0..4).rev() {
            strides[i] = if dims[i] == 1 { 0 } else { acc };
            acc *= dims[i];
        }
        masks.push(OwnedMask::new(&add.contiguous()?, strides)?);
    }
    let dims = multihead_kernels::attention::AttnDims {
        batch: b,
        heads_q: hq,
        heads_kv: hk,
        l,
        s,
        d: e,
        dv: ev,
    };
    let scale = opts.scale.unwrap_or_else(|| 1.0 / (e as f64).sqrt()) as f32;
    let dropout = (opts.dropout_p > 0.0)
        .then(|| (opts.dropout_p, opts.dropout_key.unwrap_or_else(next_dropout_key)));
    let op = FlashAttention::new(dims, scale, opts.is_causal, masks, dropout, Convention::Bhtd);
    Ok(Some(op.apply(query, key, value)?))
}

/// How the query, key and value projections are stored.
#[derive(Clone, Copy, Debug)]
pub enum InProj<'a> {
    /// One packed `(3E, E)` weight: rows `[0:E]` project q, `[E:2E]` k, `[2E:3E]` v
    /// (`in_proj_weight`).
    Packed(&'a Tensor),
    /// Separate weights `q_proj_weight (E, E)`, `k_proj_weight (E, kdim)`,
    /// `v_proj_weight (E, vdim)`.
    Separate {
        /// `q_proj_weight`, `(E, E)`.
        q: &'a Tensor,
        /// `k_proj_weight`, `(E, kdim)`.
        k: &'a Tensor,
        /// `v_proj_weight`, `(E, vdim)`.
        v: &'a Tensor,
    },
}

/// The parameters of [`multi_head_attention_forward`], by PyTorch's argument names.
#[derive(Clone, Copy, Debug)]
pub struct MhaParams<'a> {
    /// `embed_dim_to_check`: the query's feature size must equal it.
    pub embed_dim_to_check: usize,
    /// `num_heads`.
    pub num_heads: usize,
    /// `in_proj_weight` or `q/k/v_proj_weight`.
    pub in_proj: InProj<'a>,
    /// `in_proj_bias`, `(3E,)`.
    pub in_proj_bias: Option<&'a Tensor>,
    /// `bias_k`, `(1, 1, E)` or `(E,)`.
    pub bias_k: Option<&'a Tensor>,
    /// `bias_v`, `(1, 1, E)` or `(E,)`.
    pub bias_v: Option<&'a Tensor>,
    /// `add_zero_attn`.
    pub add_zero_attn: bool,
    /// `dropout_p`, applied to the attention weights when training. Must lie in `[0, 1)`.
    pub dropout_p: f64,
    /// `out_proj_weight`, `(E, E)`.
    pub out_proj_weight: &'a Tensor,
    /// `out_proj_bias`, `(E,)`.
    pub out_proj_bias: Option<&'a Tensor>,
}

/// The call options of multi-head attention, with PyTorch's defaults.
#[derive(Clone, Debug)]
pub struct MhaOptions {
    /// `key_padding_mask` `(N, S)` or `(S,)`: `True` (or `-inf`) marks padding keys. Default `None`.
    pub key_padding_mask: Option<Mask>,
    /// Return the attention weights. Default `true`, as in PyTorch.
    pub need_weights: bool,
    /// `attn_mask` `(L, S)` or `(N·H, L, S)` (`(H, L, S)` unbatched): `True` (or `-inf`) forbids
    /// a position; float values are added. Default `None`.
    pub attn_mask: Option<Mask>,
    /// Average the returned weights over heads. Default `true`.
    pub average_attn_weights: bool,
    /// The causal hint, PyTorch's rules (spec §2.6): it requires an `attn_mask`; when
    /// `need_weights` is false and there is no `key_padding_mask`, the mask is replaced by an
    /// upper-left causal mask; otherwise the mask is used as given. Default `false`.
    pub is_causal: bool,
    /// The dropout key; `None` draws the next one from the global generator when dropout is
    /// active. Default `None`.
    pub dropout_key: Option<DropoutKey>,
}

impl Default for MhaOptions {
    fn default() -> Self {
        Self {
            key_padding_mask: None,
            need_weights: true,
            attn_mask: None,
            average_attn_weights: true,
            is_causal: false,
            dropout_key: None,
        }
    }
}

impl MhaOptions {
    /// Sets `key_padding_mask`.
    pub fn key_padding_mask(mut self, mask: Mask) -> Self {
        self.key_padding_mask = Some(mask);
        self
    }
    /// Sets `need_weights`.
    pub fn need_weights(mut self, need: bool) -> Self {
        self.need_weights = need;
        self
    }
    /// Sets `attn_mask`.
    pub fn attn_mask(mut self, mask: Mask) -> Self {
        self.attn_mask = Some(mask);
        self
    }
    /// Sets `average_attn_weights`.
    pub fn average_attn_weights(mut self, average: bool) -> Self {
        self.average_attn_weights = average;
        self
    }
    /// Sets `is_causal`.
    pub fn is_causal(mut self, causal: bool) -> Self {
        self.is_causal = causal;
        self
    }
    /// Sets the dropout key.
    pub fn dropout_key(mut self, key: DropoutKey) -> Self {
        self.dropout_key = Some(key);
        self
    }
}

/// What multi-head attention returns.
#[derive(Clone, Debug)]
pub struct MhaOutput {
    /// `attn_output`: `(L, N, E)`, `(N, L, E)` with `batch_first`, or `(L, E)` unbatched.
    pub output: Tensor,
    /// `attn_weights`, when `need_weights`: `(N, L, S')` averaged or `(N, H, L, S')` per head
    /// (`(L, S')` / `(H, L, S')` unbatched), where `S'` counts the `bias_k` and zero-attention
    /// columns.
    pub attn_weights: Option<Tensor>,
}

/// Which inputs are the same tensor; this picks the projection grouping, as in PyTorch.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Aliasing {
    pub key_is_query: bool,
    pub value_is_key: bool,
}

impl Aliasing {
    pub(crate) fn of(query: &Tensor, key: &Tensor, value: &Tensor) -> Self {
        Self { key_is_query: query.id() == key.id(), value_is_key: key.id() == value.id() }
    }
}

/// `Tensor::cat` that leaves out empty pieces (candle's CPU copy mishandles zero-sized inputs).
fn cat_nonempty(parts: &[&Tensor], dim: usize) -> Result<Tensor> {
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

fn shape_err(arg: &'static str, msg: String) -> Error {
    Error::Shape { op: MHA, arg, msg }
}

/// Multi-head attention on sequence-first input, as `torch.nn.functional.multi_head_attention_forward`.
///
/// Follows PyTorch's slow path step by step (spec §2.5): input projection (grouped by which
/// inputs are the same tensor), `bias_k`/`bias_v`, head split, zero attention, mask merge,
/// scaled dot-product attention with dropout on the weights when `training`, output projection.
/// Fully masked query rows give a zero attention row (so the output row is `out_proj_bias`) and
/// zero weights on every path; PyTorch gives NaN on its `need_weights=True` path there.
///
/// # Shapes
/// * `query` `(L, N, E)` or `(L, E)`; `key` `(S, N, kdim)` or `(S, kdim)`; `value`
///   `(S, N, vdim)` or `(S, vdim)`.
/// * output `(L, N, E)` or `(L, E)`; weights `(N, L, S')` or `(N, H, L, S')`.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use multihead::functional::{multi_head_attention_forward, InProj, MhaOptions, MhaParams};
///
/// let dev = Device::Cpu;
/// let (e, h) = (8, 2);
/// let w_in = Tensor::randn(0f32, 0.3, (3 * e, e), &dev)?;
/// let w_out = Tensor::randn(0f32, 0.3, (e, e), &dev)?;
/// let params = MhaParams {
///     embed_dim_to_check: e, num_heads: h, in_proj: InProj::Packed(&w_in), in_proj_bias: None,
///     bias_k: None, bias_v: None, add_zero_attn: false, dropout_p: 0.0,
///     out_proj_weight: &w_out, out_proj_bias: None,
/// };
/// let x = Tensor::randn(0f32, 1.0, (5, 3, e), &dev)?; // (L, N, E)
/// let out = multi_head_attention_forward(&x, &x, &x, &params, &MhaOptions::default(), true)?;
/// assert_eq!(out.output.dims(), &[5, 3, 8]);
/// assert_eq!(out.attn_weights.unwrap().dims(), &[3, 5, 5]);
/// # Ok::<(), multihead::Error>(())
/// ```
// Mirrors torch.nn.functional.multi_head_attention_forward.
pub fn multi_head_attention_forward(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    params: &MhaParams,
    opts: &MhaOptions,
    training: bool,
) -> Result<MhaOutput> {
    let alias = Aliasing::of(query, key, value);
    mha_forward_impl(query, key, value, alias, params, opts, training, false)
}

// Internal: the functional signature plus the aliasing and layout the module knows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mha_forward_impl(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    alias: Aliasing,
    params: &MhaParams,
    opts: &MhaOptions,
    training: bool,
    batch_first: bool,
) -> Result<MhaOutput> {
    // --- ranks (spec §2.2) ---
    let unbatched = match query.rank() {
        3 => false,
        2 => true,
        r => {
            return Err(shape_err(
                "query",
                format!(
                    "query should be unbatched 2-D or batched 3-D tensor but received {r}-D query tensor of shape {}",
                    fmt_shape(query.dims())
                ),
            ))
        }
    };
    let want = if unbatched { 2 } else { 3 };
    let which = if unbatched { "unbatched (2-D)" } else { "batched (3-D)" };
    if key.rank() != want || value.rank() != want {
        return Err(shape_err(
            "key",
            format!(
                "for {which} query, expected key and value to be {want}-D but found {}-D and {}-D tensors respectively (key {}, value {})",
                key.rank(),
                value.rank(),
                fmt_shape(key.dims()),
                fmt_shape(value.dims())
            ),
        ));
    }
    if let Some(m) = &opts.key_padding_mask {
        m.check_kind(MHA, "key_padding_mask")?;
        if m.dims().len() != want - 1 {
            return Err(shape_err(
                "key_padding_mask",
                format!(
                    "for {which} query, expected key_padding_mask to be None or {}-D but found {}-D tensor of shape {} instead",
                    want - 1,
                    m.dims().len(),
                    fmt_shape(m.dims())
                ),
            ));
        }
    }
    if let Some(m) = &opts.attn_mask {
        m.check_kind(MHA, "attn_mask")?;
        if !matches!(m.dims().len(), 2 | 3) {
            return Err(shape_err(
                "attn_mask",
                format!(
                    "for {which} query, expected attn_mask to be None, 2-D or 3-D but found {}-D tensor of shape {} instead",
                    m.dims().len(),
                    fmt_shape(m.dims())
                ),
            ));
        }
    }
    if opts.is_causal && opts.attn_mask.is_none() {
        return Err(Error::Config {
            op: MHA,
            arg: "is_causal",
            msg: "need attn_mask if specifying the is_causal hint; you may use generate_square_subsequent_mask to create this mask".into(),
        });
    }
    // --- configuration ---
    let h = params.num_heads;
    let e_check = params.embed_dim_to_check;
    if h == 0 || e_check == 0 {
        return Err(Error::Config {
            op: MHA,
            arg: "num_heads",
            msg: format!("embed_dim and num_heads must be greater than 0, got embed_dim={e_check} and num_heads={h}"),
        });
    }
    if !e_check.is_multiple_of(h) {
        return Err(Error::Config {
            op: MHA,
            arg: "num_heads",
            msg: format!("embed_dim {e_check} must be divisible by num_heads {h}"),
        });
    }
    check_dropout(params.dropout_p, MHA)?;
    let dtype = params.out_proj_weight.dtype();
    for (arg, t) in [("query", query), ("key", key), ("value", value)] {
        if t.dtype() != dtype {
            return Err(Error::DType {
                op: MHA,
                arg,
                msg: format!(
                    "{arg} dtype {:?} does not match the parameter dtype {dtype:?}",
                    t.dtype()
                ),
            });
        }
    }
    // --- unbatched: add a batch of one ---
    let (query, key, value) = if unbatched {
        (query.unsqueeze(1)?, key.unsqueeze(1)?, value.unsqueeze(1)?)
    } else {
        (query.clone(), key.clone(), value.clone())
    };
    // Batched `batch_first` input stays `(N, L, E)` through the projections (they are
    // row-wise) and the fused kernels; the composed path transposes after projecting.
    let batch_first = batch_first && !unbatched;
    let seq_first_dims = |t: &Tensor| -> Result<(usize, usize, usize)> {
        let (a, b, c) = t.dims3()?;
        Ok(if batch_first { (b, a, c) } else { (a, b, c) })
    };
    let (l, n, e) = seq_first_dims(&query)?;
    let (s, nk, kf) = seq_first_dims(&key)?;
    let (sv, nv, vf) = seq_first_dims(&value)?;
    if e != e_check {
        return Err(shape_err(
            "query",
            format!(
                "was expecting embedding dimension of {e_check}, but got {e} (query shape {})",
                fmt_shape(query.dims())
            ),
        ));
    }
    let hd = e / h;
    match params.in_proj {
        InProj::Packed(w) => {
            if key.dims() != value.dims() {
                return Err(shape_err(
                    "value",
                    format!(
                        "key shape {} does not match value shape {}",
                        fmt_shape(key.dims()),
                        fmt_shape(value.dims())
                    ),
                ));
            }
            if w.dims() != [3 * e, e] {
                return Err(shape_err(
                    "in_proj_weight",
                    format!(
                        "expected shape {}, got {}",
                        fmt_shape(&[3 * e, e]),
                        fmt_shape(w.dims())
                    ),
                ));
            }
            if kf != e {
                return Err(shape_err(
                    "key",
                    format!(
                        "key has {kf} features but the packed in_proj_weight {} expects embed_dim {e} (key shape {})",
                        fmt_shape(w.dims()),
                        fmt_shape(key.dims())
                    ),
                ));
            }
        }
        InProj::Separate { q, k, v } => {
            if (s, nk) != (sv, nv) {
                return Err(shape_err(
                    "value",
                    format!(
                        "key's sequence and batch dims {} do not match value's {}",
                        fmt_shape(&[s, nk]),
                        fmt_shape(&[sv, nv])
                    ),
                ));
            }
            if q.dims() != [e, e] {
                return Err(shape_err(
                    "q_proj_weight",
                    format!(
                        "expecting query weights shape of {}, but got {}",
                        fmt_shape(&[e, e]),
                        fmt_shape(q.dims())
                    ),
                ));
            }
            if k.dims() != [e, kf] {
                return Err(shape_err(
                    "key",
                    format!(
                        "expecting key weights shape of {}, but got {}",
                        fmt_shape(&[e, kf]),
                        fmt_shape(k.dims())
                    ),
                ));
            }
            if v.dims() != [e, vf] {
                return Err(shape_err(
                    "value",
                    format!(
                        "expecting value weights shape of {}, but got {}",
                        fmt_shape(&[e, vf]),
                        fmt_shape(v.dims())
                    ),
                ));
            }
        }
    }
    if nk != n {
        return Err(shape_err(
            "key",
            format!(
                "key batch size {nk} does not match query batch size {n} (query {}, key {})",
                fmt_shape(query.dims()),
                fmt_shape(key.dims())
            ),
        ));
    }
    // --- masks: shapes ---
    let kpm = match &opts.key_padding_mask {
        Some(m) => {
            let t = if unbatched { m.tensor().unsqueeze(0)? } else { m.tensor().clone() };
            if t.dims() != [n, s] {
                let (exp, got) = if unbatched {
                    (vec![s], m.dims().to_vec())
                } else {
                    (vec![n, s], t.dims().to_vec())
                };
                return Err(shape_err(
                    "key_padding_mask",
                    format!("expected shape {} (N, S), got {}", fmt_shape(&exp), fmt_shape(&got)),
                ));
            }
            let t = match m {
                Mask::Bool(_) => Mask::Bool(t),
                Mask::Float(_) => Mask::Float(t),
            };
            Some(t.to_additive(dtype, MHA, "key_padding_mask")?)
        }
        None => None,
    };
    let attn_mask = match &opts.attn_mask {
        Some(m) => {
            let add = m.to_additive(dtype, MHA, "attn_mask")?;
            match add.rank() {
                2 => {
                    expect_dims(&add, &[l, s], MHA, "attn_mask", "a 2-D mask of shape (L, S) =")?;
                    Some(add.unsqueeze(0)?)
                }
                _ => {
                    if unbatched {
                        expect_dims(
                            &add,
                            &[h, l, s],
                            MHA,
                            "attn_mask",
                            "an unbatched 3-D mask of shape (H, L, S) =",
                        )?;
                    } else {
                        expect_dims(
                            &add,
                            &[n * h, l, s],
                            MHA,
                            "attn_mask",
                            "a 3-D mask of shape (N*H, L, S) =",
                        )?;
                    }
                    Some(add)
                }
            }
        }
        None => None,
    };
    // --- the is_causal hint (spec §2.6) ---
    let (attn_mask, causal) = if opts.is_causal && kpm.is_none() && !opts.need_weights {
        (None, true)
    } else {
        (attn_mask, false)
    };

    // --- empty batch or query: nothing to compute (PyTorch returns empty tensors) ---
    if n == 0 || l == 0 {
        let s2 = s + params.bias_k.is_some() as usize + params.add_zero_attn as usize;
        let output = if batch_first {
            Tensor::zeros((n, l, e), dtype, query.device())?
        } else {
            Tensor::zeros((l, n, e), dtype, query.device())?
        };
        let weights = if !opts.need_weights {
            None
        } else if opts.average_attn_weights {
            Some(Tensor::zeros((n, l, s2), dtype, query.device())?)
        } else {
            Some(Tensor::zeros((n, h, l, s2), dtype, query.device())?)
        };
        return Ok(if unbatched {
            MhaOutput {
                output: output.squeeze(1)?,
                attn_weights: match weights {
                    Some(w) => Some(w.squeeze(0)?),
                    None => None,
                },
            }
        } else {
            MhaOutput { output, attn_weights: weights }
        });
    }

    // --- input projection (spec §2.5 step 5) ---
    let bias_chunk = |i: usize| -> Result<Option<Tensor>> {
        match params.in_proj_bias {
            Some(b) => {
                if b.dims() != [3 * e] {
                    return Err(shape_err(
                        "in_proj_bias",
                        format!(
                            "expected shape {}, got {}",
                            fmt_shape(&[3 * e]),
                            fmt_shape(b.dims())
                        ),
                    ));
                }
                Ok(Some(b.narrow(0, i * e, e)?))
            }
            None => Ok(None),
        }
    };
    let mut packed: Option<Tensor> = None;
    let (q, k, v) = match params.in_proj {
        InProj::Packed(w) => {
            if alias.key_is_query && alias.value_is_key {
                bias_chunk(0)?; // validates the bias shape
                let qkv = linear(&query, w, params.in_proj_bias, MHA, "query")?;
                packed = Some(qkv.clone());
                (qkv.narrow(2, 0, e)?, qkv.narrow(2, e, e)?, qkv.narrow(2, 2 * e, e)?)
            } else if alias.value_is_key {
                let q = linear(&query, &w.narrow(0, 0, e)?, bias_chunk(0)?.as_ref(), MHA, "query")?;
                let bkv = match (bias_chunk(1)?, bias_chunk(2)?) {
                    (Some(bk), Some(bv)) => Some(Tensor::cat(&[bk, bv], 0)?),
                    _ => None,
                };
                let kv = linear(&key, &w.narrow(0, e, 2 * e)?, bkv.as_ref(), MHA, "key")?;
                (q, kv.narrow(2, 0, e)?, kv.narrow(2, e, e)?)
            } else {
                (
                    linear(&query, &w.narrow(0, 0, e)?, bias_chunk(0)?.as_ref(), MHA, "query")?,
                    linear(&key, &w.narrow(0, e, e)?, bias_chunk(1)?.as_ref(), MHA, "key")?,
                    linear(&value, &w.narrow(0, 2 * e, e)?, bias_chunk(2)?.as_ref(), MHA, "value")?,
                )
            }
        }
        InProj::Separate { q: wq, k: wk, v: wv } => (
            linear(&query, wq, bias_chunk(0)?.as_ref(), MHA, "query")?,
            linear(&key, wk, bias_chunk(1)?.as_ref(), MHA, "key")?,
            linear(&value, wv, bias_chunk(2)?.as_ref(), MHA, "value")?,
        ),
    };
    // --- the fused flash-attention kernels (f32, CPU; spec §2.5 steps 8-13 in one op) ---
    let p_drop = if training { params.dropout_p } else { 0.0 };
    let weights_ok = !opts.need_weights
        || !crate::fused::grad_enabled()
        || !(q.track_op() || k.track_op() || v.track_op());
    if crate::fused::usable(&q)
        && params.bias_k.is_none()
        && !params.add_zero_attn
        && s > 0
        && weights_ok
    {
        use crate::fused::{Convention, FlashAttention, OwnedMask};
        let dims = multihead_kernels::attention::AttnDims {
            batch: n,
            heads_q: h,
            heads_kv: h,
            l,
            s,
            d: hd,
            dv: hd,
        };
        let mut masks = Vec::new();
        if let Some(a) = &attn_mask {
            let strides = if a.dim(0)? == 1 { [0, 0, s, 1] } else { [h * l * s, l * s, s, 1] };
            masks.push(OwnedMask::new(a, strides)?);
        }
        if let Some(p) = &kpm {
            masks.push(OwnedMask::new(p, [s, 0, 0, 1])?);
        }
        let dropout =
            (p_drop > 0.0).then(|| (p_drop, opts.dropout_key.unwrap_or_else(next_dropout_key)));
        let scale = (1.0 / (hd as f64).sqrt()) as f32;
        let op = FlashAttention::new(
            dims,
            scale,
            causal,
            masks,
            dropout,
            Convention::SeqFirst { heads: h, batch_first },
        );
        let training_graph =
            crate::fused::grad_enabled() && (q.track_op() || k.track_op() || v.track_op());
        let attn = if s >= LONG_KEYS
            && !opts.need_weights
            && !(training_graph && s >= LONG_KEYS_TRAINING_MAX)
        {
            // Long key sequences: read K and V per head contiguously. Streaming them straight out
            // of the strided projection costs more than copying them (measured: S=16384 forward
            // 1134 -> 740 ms; S=4096 forward+backward 455 -> 374 ms). When training on very long
            // sequences the copies' memory (kept for the backward) outweighs that, so the strided
            // path stays.
            let to_bhtd = |t: &Tensor| -> Result<Tensor> {
                let t = if batch_first { t.clone() } else { t.transpose(0, 1)? };
                let (nb, len, _) = t.dims3()?;
                Ok(t.contiguous()?.reshape((nb, len, h, hd))?.transpose(1, 2)?.contiguous()?)
            };
            let bhtd = FlashAttention::new(
                dims,
                scale,
                causal,
                op.masks.as_ref().clone(),
                op.dropout,
                Convention::Bhtd,
            );
            let (qh, kh, vh) = match &packed {
                // One copy of the packed projection: (N, L, 3, H, hd) -> (3, N, H, L, hd).
                Some(qkv) => {
                    let t = if batch_first { qkv.clone() } else { qkv.transpose(0, 1)? };
                    let t = t.contiguous()?.reshape((n, l, 3, h, hd))?.permute((2, 0, 3, 1, 4))?;
                    let t = t.contiguous()?;
                    (t.get(0)?, t.get(1)?, t.get(2)?)
                }
                None => (to_bhtd(&q)?, to_bhtd(&k)?, to_bhtd(&v)?),
            };
            let o = bhtd.apply(&qh, &kh, &vh)?; // (N, H, L, hd)
            let o = o.transpose(1, 2)?.contiguous()?.reshape((n, l, e))?;
            if batch_first {
                o
            } else {
                o.transpose(0, 1)?
            }
        } else {
            match &packed {
                Some(qkv) => op.apply_packed(qkv)?,
                None => op.apply(&q, &k, &v)?,
            }
        }; // (L, N, E), or (N, L, E) with batch_first
        let out = linear(&attn, params.out_proj_weight, params.out_proj_bias, MHA, "attn_output")?;
        let weights = if opts.need_weights {
            let w = op.weights(&q, &k, opts.average_attn_weights)?;
            Some(if opts.average_attn_weights { w.squeeze(1)? } else { w })
        } else {
            None
        };
        return Ok(if unbatched {
            MhaOutput {
                output: out.squeeze(1)?,
                attn_weights: match weights {
                    Some(w) => Some(w.squeeze(0)?),
                    None => None,
                },
            }
        } else {
            MhaOutput { output: out, attn_weights: weights }
        });
    }

    let (q, k, v) = if batch_first {
        (q.transpose(0, 1)?, k.transpose(0, 1)?, v.transpose(0, 1)?)
    } else {
        (q, k, v)
    };
    let mut k = k;
    let mut v = v;
    let mut attn_mask = attn_mask;
    let mut kpm = kpm;
    let pad_col = |m: Option<Tensor>| -> Result<Option<Tensor>> {
        match m {
            Some(m) => {
                let mut dims = m.dims().to_vec();
                if let Some(last) = dims.last_mut() {
                    *last = 1;
                }
                let z = Tensor::zeros(dims, m.dtype(), m.device())?;
                Ok(Some(cat_nonempty(&[&m, &z], m.rank() - 1)?))
            }
            None => Ok(None),
        }
    };
    // --- bias_k / bias_v (step 7) ---
    match (params.bias_k, params.bias_v) {
        (Some(bk), Some(bv)) => {
            for (arg, b) in [("bias_k", bk), ("bias_v", bv)] {
                if b.elem_count() != e || !(b.dims() == [1, 1, e] || b.dims() == [e]) {
                    return Err(shape_err(
                        arg,
                        format!(
                            "expected shape {} or {}, got {}",
                            fmt_shape(&[1, 1, e]),
                            fmt_shape(&[e]),
                            fmt_shape(b.dims())
                        ),
                    ));
                }
                if b.dtype() != dtype {
                    return Err(Error::DType {
                        op: MHA,
                        arg,
                        msg: format!(
                            "{arg} dtype {:?} does not match the parameter dtype {dtype:?}",
                            b.dtype()
                        ),
                    });
                }
            }
            let bk = bk.reshape((1, 1, e))?.broadcast_as((1, n, e))?;
            let bv = bv.reshape((1, 1, e))?.broadcast_as((1, n, e))?;
            k = cat_nonempty(&[&k, &bk], 0)?;
            v = cat_nonempty(&[&v, &bv], 0)?;
            attn_mask = pad_col(attn_mask)?;
            kpm = pad_col(kpm)?;
        }
        (None, None) => {}
        _ => {
            return Err(Error::Config {
                op: MHA,
                arg: "bias_k",
                msg: "bias_k and bias_v must both be given or both be None".into(),
            })
        }
    }
    // --- split heads (step 8): (L, N, E) -> (N*H, L, hd) ---
    let split = |t: &Tensor| -> Result<Tensor> {
        let len = t.dim(0)?;
        if t.elem_count() == 0 {
            return Ok(Tensor::zeros((n * h, len, hd), t.dtype(), t.device())?);
        }
        Ok(t.contiguous()?.reshape((len, n * h, hd))?.transpose(0, 1)?.contiguous()?)
    };
    let q = split(&q)?;
    let mut k = split(&k)?;
    let mut v = split(&v)?;
    // --- zero attention (step 9) ---
    if params.add_zero_attn {
        let z = Tensor::zeros((n * h, 1, hd), dtype, k.device())?;
        k = cat_nonempty(&[&k, &z], 1)?;
        v = cat_nonempty(&[&v, &z], 1)?;
        attn_mask = pad_col(attn_mask)?;
        kpm = pad_col(kpm)?;
    }
    let s2 = k.dim(1)?;
    // --- merge masks (step 11) ---
    let mask = if causal {
        Some(causal_upper_left(l, s2, dtype, k.device())?.unsqueeze(0)?)
    } else {
        let kpm = match kpm {
            Some(m) => Some(m.reshape((n, 1, 1, s2))?.broadcast_as((n, h, 1, s2))?.reshape((
                n * h,
                1,
                s2,
            ))?),
            None => None,
        };
        match (attn_mask, kpm) {
            (Some(a), Some(p)) => Some(a.broadcast_add(&p)?),
            (Some(a), None) => Some(a),
            (None, Some(p)) => Some(p),
            (None, None) => None,
        }
    };
    // --- attention (steps 12-13) ---
    let p = if training { params.dropout_p } else { 0.0 };
    let dropout = (p > 0.0).then(|| (p, opts.dropout_key.unwrap_or_else(next_dropout_key)));
    let scale = 1.0 / (hd as f64).sqrt();
    let (attn, weights) =
        attention_core(&q, &k, &v, mask.as_ref(), scale, dropout, opts.need_weights)?;
    let attn = attn.transpose(0, 1)?.contiguous()?.reshape((l * n, e))?;
    let out = linear(&attn, params.out_proj_weight, params.out_proj_bias, MHA, "attn_output")?;
    let out = out.reshape((l, n, e))?;
    let out = if batch_first { out.transpose(0, 1)? } else { out };
    let weights = match weights {
        Some(w) => {
            let w = w.reshape((n, h, l, s2))?;
            Some(if opts.average_attn_weights { w.mean(1)? } else { w })
        }
        None => None,
    };
    // --- unbatched: drop the batch of one (step 14) ---
    if unbatched {
        Ok(MhaOutput {
            output: out.squeeze(1)?,
            attn_weights: match weights {
                Some(w) => Some(w.squeeze(0)?),
                None => None,
            },
        })
    } else {
        Ok(MhaOutput { output: out, attn_weights: weights })
    }
}
