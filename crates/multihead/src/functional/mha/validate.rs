//! Step 1 of multi-head attention: check every parameter and input once, before a path is
//! chosen (PyTorch's checks, `docs/pytorch-behaviour.md` §2, plus the parameter shapes that
//! PyTorch leaves to its kernels).
//!
//! What comes out, [`MhaCall`], is what both paths run on: batched inputs, the sizes, and the
//! masks already converted to additive float masks of the parameter dtype.

use candle_core::{DType, Tensor};

use super::{Aliasing, InProj, MhaOptions, MhaParams, MHA};
use crate::error::{fmt_shape, Error, Result};
use crate::mask::{expect_dims, Mask};

/// A validated call of multi-head attention.
pub(crate) struct MhaCall<'a> {
    /// The inputs with a batch dimension (unbatched input gets a batch of one at dim 1), in the
    /// caller's layout: `(L, N, E)`, or `(N, L, E)` when `batch_first`.
    pub query: Tensor,
    pub key: Tensor,
    pub value: Tensor,
    pub unbatched: bool,
    pub batch_first: bool,
    pub alias: Aliasing,
    pub params: &'a MhaParams<'a>,
    pub dtype: DType,
    /// Target length, batch, embedding, heads, head size, source length.
    pub l: usize,
    pub n: usize,
    pub e: usize,
    pub h: usize,
    pub hd: usize,
    pub s: usize,
    /// Key/value heads (grouped-query attention; `h` without grouping) and their width `hk·hd`.
    pub hk: usize,
    pub kv_e: usize,
    /// `static_k` and `static_v`, `(N·hk, S, hd)`, which replace the key/value projections.
    pub static_kv: Option<(Tensor, Tensor)>,
    /// The additive key padding mask `(N, S)`.
    pub kpm: Option<Tensor>,
    /// The additive attention mask, `(1, L, S)` or `(N·H, L, S)`.
    pub attn_mask: Option<Tensor>,
    /// Whether `attn_mask` and `kpm` are learned: float masks in the graph while gradients
    /// are recorded (`mask_records_grad`; a bool mask never is, whatever made it).
    pub learned_masks: [bool; 2],
    /// The `is_causal` hint replaced the attention mask (`docs/pytorch-behaviour.md` §4).
    pub causal: bool,
    /// Dropout probability in effect (0 unless training).
    pub dropout_p: f64,
    pub need_weights: bool,
    pub average_attn_weights: bool,
    /// The caller's backend (it governs the projections as well as attention).
    pub backend: crate::mode::Backend,
    /// Soft cap, window, alignment, key lengths, ALiBi (checked).
    pub variants: crate::Variants,
    /// Attention sinks `(H,)` (checked).
    pub sinks: Option<Tensor>,
}

impl MhaCall<'_> {
    /// The multiply-adds of the call's largest product (a projection or the attention's):
    /// what `Bf16Products::Auto` weighs ([`crate::products::WIDEN_BELOW_MACS`]).
    pub(crate) fn macs(&self) -> u64 {
        let kdim = self.key.dims().last().copied().unwrap_or(0) as u64;
        let (n, l, s, e) = (self.n as u64, self.l as u64, self.s as u64, self.e as u64);
        let m = |a: u64, b: u64, c: u64| n.saturating_mul(a).saturating_mul(b).saturating_mul(c);
        m(l, e, e).max(m(s, kdim, e)).max(m(l, s, e))
    }

    /// `S'`: the keys the softmax runs over, with the `bias_k` and zero-attention columns.
    pub fn s_total(&self) -> usize {
        self.s + self.params.bias_k.is_some() as usize + self.params.add_zero_attn as usize
    }
}

fn shape_err(arg: &'static str, msg: String) -> Error {
    Error::Shape { op: MHA, arg, msg }
}

fn dtype_err(arg: &'static str, got: DType, want: DType) -> Error {
    Error::DType {
        op: MHA,
        arg,
        msg: format!(
            "{arg} has dtype {got:?} but the parameters have dtype {want:?}; convert it with \
             .to_dtype(DType::{want:?})"
        ),
    }
}

/// A parameter must be exactly `dims` with the parameter dtype.
fn expect_param(arg: &'static str, t: &Tensor, dims: &[usize], dtype: DType) -> Result<()> {
    if t.dims() != dims {
        return Err(shape_err(
            arg,
            format!("expected shape {}, got {}", fmt_shape(dims), fmt_shape(t.dims())),
        ));
    }
    if t.dtype() != dtype {
        return Err(dtype_err(arg, t.dtype(), dtype));
    }
    Ok(())
}

/// Checks the ranks of the inputs and masks; returns whether the call is unbatched.
fn check_ranks(query: &Tensor, key: &Tensor, value: &Tensor, opts: &MhaOptions) -> Result<bool> {
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
    Ok(unbatched)
}

/// Checks the non-tensor configuration and every parameter's dtype and device.
fn check_config(params: &MhaParams, inputs: [(&'static str, &Tensor); 3]) -> Result<DType> {
    let (h, e) = (params.num_heads, params.embed_dim_to_check);
    if h == 0 || e == 0 {
        return Err(Error::Config {
            op: MHA,
            arg: if e == 0 { "embed_dim_to_check" } else { "num_heads" },
            msg: format!("embed_dim and num_heads must be greater than 0, got embed_dim={e} and num_heads={h}"),
        });
    }
    if !e.is_multiple_of(h) {
        return Err(Error::Config {
            op: MHA,
            arg: "num_heads",
            msg: format!("embed_dim {e} must be divisible by num_heads {h}"),
        });
    }
    let k = params.num_kv_heads.unwrap_or(h);
    if k == 0 || !h.is_multiple_of(k) {
        return Err(Error::Config {
            op: MHA,
            arg: "num_kv_heads",
            msg: format!(
                "num_kv_heads must be greater than 0 and divide num_heads, got num_kv_heads={k} and \
                 num_heads={h}; use a divisor of num_heads (1 is multi-query attention)"
            ),
        });
    }
    if k != h && matches!(params.in_proj, InProj::Packed(_)) {
        return Err(Error::Config {
            op: MHA,
            arg: "in_proj_weight",
            msg: format!(
                "grouped-query attention (num_kv_heads={k} < num_heads={h}) needs separate \
                 q/k/v projection weights, not the packed in_proj_weight"
            ),
        });
    }
    super::super::core::check_dropout(params.dropout_p, MHA)?;
    let dtype = params.out_proj_weight.dtype();
    if !dtype.is_float() {
        return Err(Error::DType {
            op: MHA,
            arg: "out_proj_weight",
            msg: format!("parameters must have a float dtype, got {dtype:?}"),
        });
    }
    let device = params.out_proj_weight.device();
    let mut all: Vec<(&'static str, &Tensor)> = inputs.to_vec();
    match params.in_proj {
        InProj::Packed(w) => all.push(("in_proj_weight", w)),
        InProj::Separate { q, k, v } => {
            all.extend([("q_proj_weight", q), ("k_proj_weight", k), ("v_proj_weight", v)])
        }
    }
    let optional = [
        ("in_proj_bias", params.in_proj_bias),
        ("bias_k", params.bias_k),
        ("bias_v", params.bias_v),
        ("out_proj_bias", params.out_proj_bias),
    ];
    all.extend(optional.into_iter().filter_map(|(a, t)| t.map(|t| (a, t))));
    for (arg, t) in all {
        if t.dtype() != dtype {
            return Err(dtype_err(arg, t.dtype(), dtype));
        }
        if !t.device().same_device(device) {
            return Err(Error::Config {
                op: MHA,
                arg,
                msg: format!(
                    "{arg} is on {:?} but the parameters are on {device:?}; move it with .to_device()",
                    t.device()
                ),
            });
        }
    }
    Ok(dtype)
}

/// The in-projection weights against the input feature sizes.
fn check_in_proj(
    params: &MhaParams,
    (e, kv, kf, vf): (usize, usize, usize, usize),
    key: &Tensor,
    value: &Tensor,
    kv_lead: ((usize, usize), (usize, usize)),
    dtype: DType,
) -> Result<()> {
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
            expect_param("in_proj_weight", w, &[3 * e, e], dtype)?;
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
            let ((s, nk), (sv, nv)) = kv_lead;
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
            // PyTorch's wording: the weights are checked against the inputs' feature sizes.
            for (arg, input, w, want) in [
                ("query", "query", q, [e, e]),
                ("key", "key", k, [kv, kf]),
                ("value", "value", v, [kv, vf]),
            ] {
                if w.dims() != want {
                    return Err(shape_err(
                        arg,
                        format!(
                            "expecting {input} weights shape of {}, but got {}",
                            fmt_shape(&want),
                            fmt_shape(w.dims())
                        ),
                    ));
                }
            }
        }
    }
    if let Some(b) = params.in_proj_bias {
        expect_param("in_proj_bias", b, &[e + 2 * kv], dtype)?;
    }
    expect_param("out_proj_weight", params.out_proj_weight, &[e, e], dtype)?;
    if let Some(b) = params.out_proj_bias {
        expect_param("out_proj_bias", b, &[e], dtype)?;
    }
    match (params.bias_k, params.bias_v) {
        (Some(bk), Some(bv)) => {
            for (arg, b) in [("bias_k", bk), ("bias_v", bv)] {
                if !(b.dims() == [1, 1, kv] || b.dims() == [kv]) {
                    return Err(shape_err(
                        arg,
                        format!(
                            "expected shape {} or {}, got {}",
                            fmt_shape(&[1, 1, kv]),
                            fmt_shape(&[kv]),
                            fmt_shape(b.dims())
                        ),
                    ));
                }
            }
        }
        (None, None) => {}
        (bk, _) => {
            let (given, missing) =
                if bk.is_some() { ("bias_k", "bias_v") } else { ("bias_v", "bias_k") };
            return Err(Error::Config {
                op: MHA,
                arg: given,
                msg: format!(
                    "bias_k and bias_v must both be given or both be None, got {given} without {missing}"
                ),
            });
        }
    }
    Ok(())
}

/// Checks `static_k`/`static_v`: both or neither, `(N·hk, S, hd)` each with the same `S`, the
/// The sinks: `(H,)` in the parameters' dtype.
fn check_sinks(sinks: Option<&Tensor>, h: usize, dtype: DType) -> Result<()> {
    let Some(t) = sinks else { return Ok(()) };
    if t.dims() != [h] {
        let msg = format!("expected one sink per head, shape [{h}], got {}", fmt_shape(t.dims()));
        return Err(shape_err("sinks", msg));
    }
    if t.dtype() != dtype {
        return Err(dtype_err("sinks", t.dtype(), dtype));
    }
    Ok(())
}

/// The variants: SDPA's checks (key lengths per batch entry, slopes per head), and none with
/// the extra key columns of `bias_k` or `add_zero_attn` (where their index would be unclear).
fn check_variants(
    opts: &MhaOptions,
    params: &MhaParams,
    (n, h, s): (usize, usize, usize),
) -> Result<()> {
    let v = &opts.variants;
    if *v == crate::Variants::default() {
        return Ok(());
    }
    if params.bias_k.is_some() || params.add_zero_attn {
        let msg = "the attention variants (soft cap, window, alignment, key lengths, ALiBi) do not combine with bias_k/bias_v or add_zero_attn, which append key columns; leave one of them out".to_string();
        return Err(Error::Config { op: MHA, arg: "variants", msg });
    }
    v.check(MHA, (Some(n), Some(h)), s)
}

/// parameter dtype and device, and no `bias_k` (PyTorch: "bias cannot be added to static key").
fn check_static(
    opts: &MhaOptions,
    params: &MhaParams,
    (n, hk, hd): (usize, usize, usize),
    dtype: DType,
) -> Result<Option<(Tensor, Tensor)>> {
    let (k, v) = match (&opts.static_k, &opts.static_v) {
        (None, None) => return Ok(None),
        (Some(k), Some(v)) => (k, v),
        (k, _) => {
            let (given, missing) =
                if k.is_some() { ("static_k", "static_v") } else { ("static_v", "static_k") };
            return Err(Error::Config {
                op: MHA,
                arg: given,
                msg: format!("static_k and static_v must both be given or both be None, got {given} without {missing}"),
            });
        }
    };
    if params.bias_k.is_some() {
        return Err(Error::Config {
            op: MHA,
            arg: "static_k",
            msg: "bias cannot be added to static key: use static_k/static_v without bias_k/bias_v"
                .into(),
        });
    }
    // S is the key's (the value must match it); a key of another rank has none to name.
    let s = (k.rank() == 3).then(|| k.dims()[1]);
    let device = params.out_proj_weight.device();
    for (arg, t) in [("static_k", k), ("static_v", v)] {
        let nh = n.saturating_mul(hk);
        if t.rank() != 3 || t.dims()[0] != nh || t.dims()[2] != hd || Some(t.dims()[1]) != s {
            let s = s.map_or("S".to_string(), |s| s.to_string());
            return Err(shape_err(
                arg,
                format!(
                    "expected shape ({nh}, {s}, {hd}) (N·num_kv_heads, S, head_dim), got {}",
                    fmt_shape(t.dims())
                ),
            ));
        }
        if t.dtype() != dtype {
            return Err(dtype_err(arg, t.dtype(), dtype));
        }
        if !t.device().same_device(device) {
            return Err(Error::Config {
                op: MHA,
                arg,
                msg: format!("{arg} is on {:?} but the parameters are on {device:?}; move it with .to_device()", t.device()),
            });
        }
    }
    Ok(Some((k.clone(), v.clone())))
}

/// Converts and checks the masks against `(N, L, S, H)`.
fn convert_masks(
    opts: &MhaOptions,
    unbatched: bool,
    (n, l, s, h): (usize, usize, usize, usize),
    dtype: DType,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
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
            if add.rank() == 2 {
                expect_dims(&add, &[l, s], MHA, "attn_mask", "a 2-D mask of shape (L, S) =")?;
                Some(add.unsqueeze(0)?)
            } else if unbatched {
                let what = "an unbatched 3-D mask of shape (H, L, S) =";
                expect_dims(&add, &[h, l, s], MHA, "attn_mask", what)?;
                Some(add)
            } else {
                let nh = n.saturating_mul(h);
                expect_dims(
                    &add,
                    &[nh, l, s],
                    MHA,
                    "attn_mask",
                    "a 3-D mask of shape (N*H, L, S) =",
                )?;
                Some(add)
            }
        }
        None => None,
    };
    Ok((kpm, attn_mask))
}

/// Validates a call of multi-head attention.
#[allow(clippy::too_many_arguments)]
pub(crate) fn validate<'a>(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    alias: Aliasing,
    params: &'a MhaParams<'a>,
    opts: &MhaOptions,
    training: bool,
    batch_first: bool,
) -> Result<MhaCall<'a>> {
    let unbatched = check_ranks(query, key, value, opts)?;
    let dtype = check_config(params, [("query", query), ("key", key), ("value", value)])?;
    // The shapes as given, for messages (an unbatched input gains a batch dimension below).
    let (query_dims, key_dims) = (fmt_shape(query.dims()), fmt_shape(key.dims()));
    let (query, key, value) = if unbatched {
        (query.unsqueeze(1)?, key.unsqueeze(1)?, value.unsqueeze(1)?)
    } else {
        (query.clone(), key.clone(), value.clone())
    };
    // Batched `batch_first` input stays `(N, L, E)`: the projections are row-wise.
    let batch_first = batch_first && !unbatched;
    let seq_first = |t: &Tensor| -> Result<(usize, usize, usize)> {
        let (a, b, c) = t.dims3()?;
        Ok(if batch_first { (b, a, c) } else { (a, b, c) })
    };
    let (l, n, e) = seq_first(&query)?;
    let (s, nk, kf) = seq_first(&key)?;
    let (sv, nv, vf) = seq_first(&value)?;
    let e_check = params.embed_dim_to_check;
    if e != e_check {
        return Err(shape_err(
            "query",
            format!(
                "was expecting embedding dimension of {e_check}, but got {e} (query shape \
                 {query_dims})"
            ),
        ));
    }
    let h = params.num_heads;
    let hd = e / h;
    let hk = params.num_kv_heads.unwrap_or(h);
    let kv_e = hk * hd;
    check_in_proj(params, (e, kv_e, kf, vf), &key, &value, ((s, nk), (sv, nv)), dtype)?;
    if nk != n {
        return Err(shape_err(
            "key",
            format!(
                "key batch size {nk} does not match query batch size {n} (query {query_dims}, \
                 key {key_dims})"
            ),
        ));
    }
    let static_kv = check_static(opts, params, (n, hk, hd), dtype)?;
    let s = static_kv.as_ref().map_or(Ok(s), |(k, _)| k.dim(1))?;
    check_variants(opts, params, (n, h, s))?;
    check_sinks(opts.sinks.as_ref(), h, dtype)?;
    let (kpm, attn_mask) = convert_masks(opts, unbatched, (n, l, s, h), dtype)?;
    // The is_causal hint (docs/pytorch-behaviour.md §4).
    let (attn_mask, causal) = if opts.is_causal && kpm.is_none() && !opts.need_weights {
        (None, true)
    } else {
        (attn_mask, false)
    };
    Ok(MhaCall {
        query,
        key,
        value,
        unbatched,
        batch_first,
        alias,
        params,
        dtype,
        l,
        n,
        e,
        h,
        hd,
        s,
        hk,
        kv_e,
        static_kv,
        kpm,
        attn_mask,
        learned_masks: [opts.attn_mask.as_ref(), opts.key_padding_mask.as_ref()]
            .map(crate::fused::dispatch::mask_records_grad),
        causal,
        dropout_p: if training { params.dropout_p } else { 0.0 },
        need_weights: opts.need_weights,
        average_attn_weights: opts.average_attn_weights,
        backend: opts.backend,
        variants: opts.variants.clone(),
        sinks: opts.sinks.clone(),
    })
}
