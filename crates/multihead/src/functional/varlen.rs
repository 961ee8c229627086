//! Attention over a packed batch of variable-length sequences: FlashAttention's
//! `flash_attn_varlen_func` on the CPU, forward and backward, with SDPA's options.

use candle_core::{DType, Tensor};

use super::core::cat_nonempty;
use super::sdpa::{scaled_dot_product_attention, SdpaOptions};
use crate::error::{fmt_shape, Error, Result};
use crate::fused::dispatch::{decide, dtype_device_blocker, Path, Plan};
use crate::fused::varlen::{sequence_key, VarlenAttention};
use crate::random::next_dropout_key;

const VARLEN: &str = "varlen_attention";

/// Where each sequence of a packed batch starts: `cu[b]..cu[b + 1]` are the rows of sequence
/// `b` (FlashAttention's `cu_seqlens`: `B + 1` non-decreasing offsets from 0 to the row count).
///
/// # Example
/// ```
/// let cu = multihead::functional::CuSeqlens::from_lengths(&[3, 0, 5]);
/// assert_eq!(cu.offsets(), &[0, 3, 3, 8]);
/// assert_eq!(cu.max_len(), 5);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CuSeqlens(Vec<usize>);

impl CuSeqlens {
    /// The offsets of sequences of these lengths.
    pub fn from_lengths(lengths: &[usize]) -> Self {
        let mut cu = Vec::with_capacity(lengths.len() + 1);
        cu.push(0usize);
        for &n in lengths {
            cu.push(cu[cu.len() - 1].saturating_add(n));
        }
        CuSeqlens(cu)
    }

    /// Offsets as given (checked when used: `B + 1` values from 0, non-decreasing).
    pub fn from_offsets(offsets: Vec<usize>) -> Self {
        CuSeqlens(offsets)
    }

    /// The offsets, `B + 1` of them.
    pub fn offsets(&self) -> &[usize] {
        &self.0
    }

    /// The number of sequences `B`.
    pub fn len(&self) -> usize {
        self.0.len().saturating_sub(1)
    }

    /// Whether there is no sequence.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The longest sequence.
    pub fn max_len(&self) -> usize {
        self.0.windows(2).map(|w| w[1].saturating_sub(w[0])).max().unwrap_or(0)
    }

    /// The length of each sequence.
    pub fn lengths(&self) -> Vec<usize> {
        self.0.windows(2).map(|w| w[1].saturating_sub(w[0])).collect()
    }

    /// Checks the offsets against `rows` packed rows.
    fn check(&self, arg: &'static str, rows: usize) -> Result<()> {
        let cu = &self.0;
        let bad = |msg: String| Err(Error::Config { op: VARLEN, arg, msg });
        if cu.is_empty() || cu[0] != 0 {
            return bad(format!("offsets must start at 0 (B + 1 values), got {cu:?}"));
        }
        if let Some(w) = cu.windows(2).find(|w| w[1] < w[0]) {
            return bad(format!("offsets must not decrease, got {} after {}", w[1], w[0]));
        }
        if cu[cu.len() - 1] != rows {
            return bad(format!(
                "the last offset ({}) must be the number of packed rows ({rows})",
                cu[cu.len() - 1]
            ));
        }
        Ok(())
    }
}

/// The validated call: `(hq, hk, e, ev)`.
fn validate(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (cu_q, cu_k): (&CuSeqlens, &CuSeqlens),
    opts: &SdpaOptions,
) -> Result<(usize, usize, usize, usize)> {
    let shape_err = |arg, msg| Error::Shape { op: VARLEN, arg, msg };
    let config = |arg, msg: &str| Error::Config { op: VARLEN, arg, msg: msg.to_string() };
    if q.rank() != 3 || k.rank() != 3 || v.rank() != 3 {
        let msg = format!(
            "expected packed query (Tq, Hq, E), key (Tk, H, E) and value (Tk, H, Ev), got {}, {} and {}",
            fmt_shape(q.dims()),
            fmt_shape(k.dims()),
            fmt_shape(v.dims())
        );
        return Err(shape_err("query", msg));
    }
    let ((tq, hq, e), (tk, hk, ek), (tv, hv, ev)) = (q.dims3()?, k.dims3()?, v.dims3()?);
    if ek != e || tv != tk || hv != hk {
        let msg = format!(
            "key must be (Tk, H, E) with the query's E and value (Tk, H, Ev): query {}, key {}, value {}",
            fmt_shape(q.dims()),
            fmt_shape(k.dims()),
            fmt_shape(v.dims())
        );
        return Err(shape_err("key", msg));
    }
    if hk == 0 || hq % hk != 0 || (hq != hk && !opts.enable_gqa) {
        let msg = format!(
            "the query's {hq} heads must equal the key's {hk}, or be a multiple of them with enable_gqa"
        );
        return Err(shape_err("key", msg));
    }
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() || !q.dtype().is_float() {
        let msg = format!(
            "expected query, key and value of one float dtype, got {:?}, {:?} and {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
        return Err(Error::DType { op: VARLEN, arg: "query", msg });
    }
    if !k.device().same_device(q.device()) || !v.device().same_device(q.device()) {
        return Err(config("key", "query, key and value must be on one device"));
    }
    cu_q.check("cu_seqlens_q", tq)?;
    cu_k.check("cu_seqlens_k", tk)?;
    if cu_q.len() != cu_k.len() {
        let msg = format!(
            "cu_seqlens_q has {} sequences but cu_seqlens_k has {}; give one key range per query range",
            cu_q.len(),
            cu_k.len()
        );
        return Err(Error::Config { op: VARLEN, arg: "cu_seqlens_k", msg });
    }
    super::core::check_dropout(opts.dropout_p, VARLEN)?;
    super::core::check_scale(VARLEN, opts.scale, q.dtype())?;
    if opts.attn_mask.is_some() {
        return Err(config(
            "attn_mask",
            "a packed batch takes no attn_mask: its sequences' boundaries are the mask; use is_causal, a window or ALiBi",
        ));
    }
    if opts.variants.kv_lengths.is_some() {
        return Err(config(
            "kv_lengths",
            "a packed batch gives each sequence's keys by cu_seqlens_k; leave kv_lengths out",
        ));
    }
    if let Some(t) = &opts.sinks {
        super::sdpa::check_sinks(VARLEN, t, q, Some(hq))?;
    }
    opts.variants.check(VARLEN, (None, Some(hq)), cu_k.max_len())?;
    Ok((hq, hk, e, ev))
}

/// The path [`varlen_attention`] takes, and why. Bad arguments give the same error the call
/// would.
///
/// # Shapes
/// * As for [`varlen_attention`].
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use multihead::functional::{explain_varlen, CuSeqlens, SdpaOptions};
///
/// let q = Tensor::zeros((7, 2, 4), DType::F32, &Device::Cpu)?; // (Tq, H, E)
/// let cu = CuSeqlens::from_lengths(&[3, 4]);
/// let plan = explain_varlen(&q, &q, &q, &cu, &cu, &SdpaOptions::default())?;
/// assert_eq!(plan.path, multihead::Path::Fused);
/// # Ok::<(), multihead::Error>(())
/// ```
pub fn explain_varlen(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    cu_seqlens_q: &CuSeqlens,
    cu_seqlens_k: &CuSeqlens,
    opts: &SdpaOptions,
) -> Result<Plan> {
    let heads = validate(query, key, value, (cu_seqlens_q, cu_seqlens_k), opts)?;
    let plan = plan(query, opts)?;
    // The sizes the call checks before it runs, so that `Ok` here is a call that can run.
    ensure_run((query, key, value), heads, cu_seqlens_q, plan.path)?;
    Ok(plan)
}

/// The path of a validated call.
fn plan(query: &Tensor, opts: &SdpaOptions) -> Result<Plan> {
    let blocker = match crate::precision::is_reduced(query.dtype()) {
        true => None, // widened to f32, then on the planned path
        false => dtype_device_blocker(query),
    };
    decide(VARLEN, opts.backend, blocker)
}

/// What a validated call allocates before its kernels or ops check their own, checked by the
/// call and by [`explain_varlen`] alike: the output, a reduced dtype's f32 copies of the inputs
/// (views may hold more rows than memory), and on the fused path the copies of views whose
/// last dimension is strided (the kernels read rows).
fn ensure_run(
    (query, key, value): (&Tensor, &Tensor, &Tensor),
    (hq, _, _, ev): (usize, usize, usize, usize),
    cu_seqlens_q: &CuSeqlens,
    path: Path,
) -> Result<()> {
    let hint = "pack fewer or shorter sequences";
    let rows_q = cu_seqlens_q.0.last().copied().unwrap_or(0);
    let reduced = crate::precision::is_reduced(query.dtype());
    let wide = if reduced { DType::F32 } else { query.dtype() };
    crate::alloc::ensure(VARLEN, "output", &[rows_q, hq, ev], wide, 1, hint)?;
    for (what, t) in [("query", query), ("key", key), ("value", value)] {
        if reduced {
            crate::alloc::ensure(VARLEN, what, t.dims(), DType::F32, 1, hint)?;
        } else if path == Path::Fused && strided_rows(t) {
            let hint = "a view whose last dimension is strided is copied for the fused kernels; \
                        pass it contiguous in its last dimension";
            crate::alloc::ensure(VARLEN, what, t.dims(), t.dtype(), 1, hint)?;
        }
    }
    Ok(())
}

/// Whether `t`'s last dimension is strided (the fused kernels read rows: such a view is
/// copied first).
fn strided_rows(t: &Tensor) -> bool {
    let r = t.rank();
    r > 0 && t.dims()[r - 1] > 1 && t.stride()[r - 1] != 1
}

/// Scaled dot-product attention over a packed batch of variable-length sequences:
/// sequence `b` is rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of `query` and
/// `cu_seqlens_k[b]..cu_seqlens_k[b + 1]` of `key` and `value`, and attends to its own keys
/// only, with SDPA's options (`is_causal`, the scale, dropout, GQA, and the variants: windows,
/// causal alignment, soft cap, ALiBi, each applied per sequence). No padding is computed: the
/// fused kernels run each sequence on its own rows, forward and backward; the composed path
/// runs SDPA on each sequence. Attention sinks (`(Hq,)`, differentiable) join every row's
/// softmax as in SDPA. Not with `attn_mask` or `kv_lengths`.
///
/// Dropout draws each sequence's mask under its own key derived from the call's, so the two
/// paths agree but a padded batch's mask differs.
///
/// # Shapes
/// * `query` `(Tq, Hq, E)`, `key` `(Tk, H, E)`, `value` `(Tk, H, Ev)` (`Tq`, `Tk`: the packed
///   rows; with `enable_gqa`, `Hq` a multiple of `H`).
/// * output `(Tq, Hq, Ev)`.
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor};
/// use multihead::functional::{varlen_attention, CuSeqlens, SdpaOptions};
///
/// // Two sequences of 3 and 5 tokens, 2 heads of 8.
/// let cu = CuSeqlens::from_lengths(&[3, 5]);
/// let x = Tensor::randn(0f32, 1.0, (8, 2, 8), &Device::Cpu)?; // (T, H, E)
/// let out = varlen_attention(&x, &x, &x, &cu, &cu, &SdpaOptions::default().is_causal(true))?;
/// assert_eq!(out.dims(), &[8, 2, 8]);
/// # Ok::<(), multihead::Error>(())
/// ```
// Mirrors flash_attn.flash_attn_varlen_func (FlashAttention 2), on the CPU.
pub fn varlen_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    cu_seqlens_q: &CuSeqlens,
    cu_seqlens_k: &CuSeqlens,
    opts: &SdpaOptions,
) -> Result<Tensor> {
    // As `explain_varlen`: validated, planned, and `run` checks the sizes first.
    let heads = validate(query, key, value, (cu_seqlens_q, cu_seqlens_k), opts)?;
    let plan = plan(query, opts)?;
    run(query, key, value, heads, (cu_seqlens_q, cu_seqlens_k), opts, plan.path)
}

/// [`varlen_attention`] on 2-D `(T, H·E)` views (the heads side by side in each row, as a
/// projection writes them), for the modules' packed forward; the output is `(Tq, Hq·Ev)`.
pub(crate) fn varlen_rows(
    (query, key, value): (&Tensor, &Tensor, &Tensor),
    (hq, hk): (usize, usize),
    cu: &CuSeqlens,
    opts: &SdpaOptions,
) -> Result<Tensor> {
    let (e, ev) = (query.dim(1)? / hq.max(1), value.dim(1)? / hk.max(1));
    // The checks of the rank-3 shapes the rows stand for (zero-strided: nothing allocated).
    let shaped = |x: &Tensor, h: usize, w: usize| -> Result<Tensor> {
        Ok(Tensor::zeros((), x.dtype(), x.device())?.broadcast_as((x.dim(0)?, h, w))?)
    };
    let (qs, ks, vs) = (shaped(query, hq, e)?, shaped(key, hk, e)?, shaped(value, hk, ev)?);
    validate(&qs, &ks, &vs, (cu, cu), opts)?;
    let plan = plan(&qs, opts)?;
    run(query, key, value, (hq, hk, e, ev), (cu, cu), opts, plan.path)
}

/// Runs a validated call on the planned path; q, k, v rank 3, or rank 2 with the heads side
/// by side.
fn run(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    (hq, hk, e, ev): (usize, usize, usize, usize),
    (cu_seqlens_q, cu_seqlens_k): (&CuSeqlens, &CuSeqlens),
    opts: &SdpaOptions,
    path: Path,
) -> Result<Tensor> {
    let rows = query.rank() == 2;
    let hint = "pack fewer or shorter sequences";
    ensure_run((query, key, value), (hq, hk, e, ev), cu_seqlens_q, path)?;
    let tq = query.dim(0)?;
    let out_dims = if rows { vec![tq, hq * ev] } else { vec![tq, hq, ev] };
    if out_dims.contains(&0) {
        // No output element (no query rows, no heads, or value heads of size 0): zeros kept in
        // the graph on both paths, so that the inputs and the sinks get zero gradients, as in
        // PyTorch (the composed path's concatenation of empty pieces dropped them). A call
        // with dropout draws its key as any other, so the calls after it see the same masks.
        if opts.dropout_p > 0.0 && opts.dropout_key.is_none() {
            let _ = next_dropout_key();
        }
        let mut inputs = vec![query, key, value];
        inputs.extend(opts.sinks.as_ref());
        return crate::fused::zeros::zeros_of(&out_dims, query.dtype(), &inputs);
    }
    if crate::precision::is_reduced(query.dtype()) {
        use crate::precision::widen;
        let (q, k, v) = (widen(query)?, widen(key)?, widen(value)?);
        let (heads, cu) = ((hq, hk, e, ev), (cu_seqlens_q, cu_seqlens_k));
        let mut o = opts.clone();
        o.sinks = crate::precision::widen_opt(opts.sinks.as_ref())?;
        let macs =
            crate::products::packed_attention_macs(cu_seqlens_q, cu_seqlens_k, hq, e.max(ev));
        let y = crate::mode::rounded_products(query.dtype(), macs, || {
            run(&q, &k, &v, heads, cu, &o, path)
        })?;
        return crate::precision::narrow(&y, query.dtype());
    }
    let dropout = (opts.dropout_p > 0.0)
        .then(|| (opts.dropout_p, opts.dropout_key.unwrap_or_else(next_dropout_key)));
    match path {
        Path::Fused => {
            let scale = opts.scale.unwrap_or_else(|| 1.0 / (e as f64).sqrt());
            let cu = (cu_seqlens_q.0.clone(), cu_seqlens_k.0.clone());
            let op = VarlenAttention::new(
                cu,
                (hq, hk, e, ev),
                scale as f32,
                opts.is_causal,
                dropout,
                &opts.variants,
            )
            .with_rounded_products();
            // The kernels read rows: a view whose last dimension is strided is copied
            // (differentiably; its size checked by `ensure_run`).
            let rows_of = |t: &Tensor| -> Result<Tensor> {
                Ok(if strided_rows(t) { t.contiguous()? } else { t.clone() })
            };
            let (query, key, value) = (&rows_of(query)?, &rows_of(key)?, &rows_of(value)?);
            match &opts.sinks {
                None => op.apply(query, key, value),
                Some(t) => {
                    let op = op.with_sinks(t.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?);
                    crate::fused::varlen_sinks::attach(&op, &op.apply(query, key, value)?, t)
                }
            }
        }
        Path::Composed => {
            let seq = cu_seqlens_q.0.windows(2).zip(cu_seqlens_k.0.windows(2));
            let mut outs = Vec::with_capacity(cu_seqlens_q.len());
            for (b, (wq, wk)) in seq.enumerate() {
                let (l, s) = (wq[1] - wq[0], wk[1] - wk[0]);
                // (T, H, E) rows -> (H, T, E): SDPA with the heads as its batch.
                let part = |t: &Tensor, from, n, (h, w): (usize, usize)| -> Result<Tensor> {
                    // The sequence's rows are copied head-major (a view may hold more rows
                    // than memory).
                    crate::alloc::ensure(VARLEN, "sequence rows", &[h, n, w], t.dtype(), 1, hint)?;
                    let x = t.narrow(0, from, n)?;
                    let x = if rows { x.reshape((n, h, w))? } else { x };
                    Ok(x.transpose(0, 1)?.contiguous()?)
                };
                let q = part(query, wq[0], l, (hq, e))?;
                let (k, v) = (part(key, wk[0], s, (hk, e))?, part(value, wk[0], s, (hk, ev))?);
                // The user's scale as given: SDPA's default for it is this call's too (and
                // takes head size 0, where 1/√E is infinite, as PyTorch does).
                let mut o = opts.clone();
                o.dropout_key = dropout.map(|(_, key)| sequence_key(key, b));
                let out = scaled_dot_product_attention(&q, &k, &v, &o)?.transpose(0, 1)?;
                outs.push(if rows { out.reshape((l, hq * ev))? } else { out });
            }
            let refs: Vec<&Tensor> = outs.iter().collect();
            let empty: &[usize] = if rows { &[0, hq * ev] } else { &[0, hq, ev] };
            match refs.is_empty() {
                true => Ok(Tensor::zeros(empty, query.dtype(), query.device())?),
                false => cat_nonempty(&refs, 0),
            }
        }
    }
}
