//! `F.scaled_dot_product_attention`: validate, plan, run.

use candle_core::Tensor;

use super::core::{
    attention_core, broadcast_shapes, check_dropout, expand_to, repeat_interleave, ScoreMasks,
};
use crate::error::{fmt_shape, Error, Result};
use crate::fused::dispatch::{decide, dtype_device_blocker, mask_records_grad, Path, Plan, Reason};
use crate::mask::Mask;
use crate::mode::Backend;
use crate::random::{next_dropout_key, DropoutKey};
use crate::variants::{CausalAlign, Variants, Window};

pub(super) const SDPA: &str = "scaled_dot_product_attention";

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
    /// Which implementation runs; `Auto` follows [`default_backend`](crate::default_backend).
    /// Default `Auto`.
    pub backend: Backend,
    /// Soft cap, window, causal alignment and key lengths (not in PyTorch's SDPA; see
    /// [`Variants`]). Default none.
    pub variants: Variants,
    /// Attention sinks (gpt-oss): a learned logit per query head, shape `(Hq,)` in the query's
    /// dtype, that joins every row's softmax denominator and carries no value. Differentiable
    /// on both paths. Default none.
    pub sinks: Option<Tensor>,
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
    /// Sets the dropout key.
    pub fn dropout_key(mut self, key: DropoutKey) -> Self {
        self.dropout_key = Some(key);
        self
    }
    /// Sets the backend.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
    /// Sets every variant at once.
    pub fn variants(mut self, variants: Variants) -> Self {
        self.variants = variants;
        self
    }
    /// Sets the soft cap `c`: scores become `c·tanh(scale·q·kᵀ / c)` before the masks.
    pub fn softcap(mut self, c: f64) -> Self {
        self.variants.softcap = Some(c);
        self
    }
    /// Sets a local window: `left` keys before each query's own key, `right` after.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.variants.window = Window { left, right };
        self
    }
    /// Aligns `is_causal` and the window top-left (PyTorch's `is_causal`, the default) or
    /// bottom-right (PyTorch's `causal_lower_right`).
    pub fn causal_align(mut self, align: CausalAlign) -> Self {
        self.variants.align = align;
        self
    }
    /// Sets the key length of each entry of the batch dimension `N`.
    pub fn kv_lengths(mut self, lengths: Vec<usize>) -> Self {
        self.variants.kv_lengths = Some(lengths);
        self
    }
    /// Sets the ALiBi slopes, one per query head (see [`Variants::alibi_slopes`]).
    pub fn alibi(mut self, slopes: Vec<f64>) -> Self {
        self.variants.alibi_slopes = Some(slopes);
        self
    }
    /// Sets the attention sinks, `(Hq,)`.
    pub fn sinks(mut self, sinks: Tensor) -> Self {
        self.sinks = Some(sinks);
        self
    }
}

/// A validated SDPA call.
struct SdpaCall {
    /// The broadcast batch dimensions (everything before `L`/`S`, heads included).
    batch: Vec<usize>,
    l: usize,
    s: usize,
    e: usize,
    ev: usize,
    /// The mask, additive, in the query's dtype (not yet broadcast).
    mask: Option<Tensor>,
    scale: f64,
}

impl SdpaCall {
    /// The multiply-adds of the call's larger product (`Bf16Products::Auto` widens a small
    /// call's).
    fn macs(&self) -> u64 {
        let rows = self.batch.iter().fold(self.l as u64, |a, &b| a.saturating_mul(b as u64));
        rows.saturating_mul(self.s as u64).saturating_mul(self.e.max(self.ev) as u64)
    }
}

fn shape_err(arg: &'static str, msg: String) -> Error {
    Error::Shape { op: SDPA, arg, msg }
}

/// `dims` with its last two entries replaced.
fn with(lead: &[usize], a: usize, b: usize) -> Vec<usize> {
    let mut v = lead.to_vec();
    v.extend([a, b]);
    v
}

/// The ranks, dtypes and option checks of SDPA.
fn check_basics(query: &Tensor, key: &Tensor, value: &Tensor, opts: &SdpaOptions) -> Result<()> {
    let (qr, kr, vr) = (query.rank(), key.rank(), value.rank());
    if qr < 2 || kr < 2 || vr < 2 {
        return Err(shape_err(
            "query",
            format!(
                "expected query, key, and value to all be at least 2 dimensional, got {}-D, {}-D and {}-D",
                qr, kr, vr
            ),
        ));
    }
    if query.dtype() != key.dtype() || query.dtype() != value.dtype() || !query.dtype().is_float() {
        // The argument named is the odd one out: a non-float query, else the key or value
        // that differs from it.
        let arg = match (query.dtype().is_float(), key.dtype() == query.dtype()) {
            (false, _) => "query",
            (true, false) => "key",
            (true, true) => "value",
        };
        return Err(Error::DType {
            op: SDPA,
            arg,
            msg: format!(
                "expected query, key, and value to have the same dtype, and a float one, got {:?}, {:?} and {:?}",
                query.dtype(),
                key.dtype(),
                value.dtype()
            ),
        });
    }
    for (arg, t) in [("key", key), ("value", value)] {
        if !t.device().same_device(query.device()) {
            return Err(Error::Config {
                op: SDPA,
                arg,
                msg: format!("{arg} is on {:?} but query is on {:?}", t.device(), query.device()),
            });
        }
    }
    check_dropout(opts.dropout_p, SDPA)?;
    super::core::check_scale(SDPA, opts.scale, query.dtype())?;
    if opts.is_causal && opts.attn_mask.is_some() {
        return Err(Error::Config {
            op: SDPA,
            arg: "attn_mask",
            msg: "explicit attn_mask should not be set when is_causal=true; pass one or the other"
                .into(),
        });
    }
    Ok(())
}

/// The sinks of `op`: `(Hq,)`, the query's dtype and device.
pub(crate) fn check_sinks(
    op: &'static str,
    t: &Tensor,
    query: &Tensor,
    heads: Option<usize>,
) -> Result<()> {
    let Some(h) = heads else {
        let msg =
            "sinks need a head dimension: give query as (N, H, L, E) or (H, L, E)".to_string();
        return Err(Error::Config { op, arg: "sinks", msg });
    };
    if t.dims() != [h] {
        let msg = format!(
            "expected one sink per query head, shape [{h}], got {} for query {}",
            fmt_shape(t.dims()),
            fmt_shape(query.dims())
        );
        return Err(Error::Shape { op, arg: "sinks", msg });
    }
    if t.dtype() != query.dtype() {
        let msg =
            format!("sinks are {:?} but query is {:?}; convert them", t.dtype(), query.dtype());
        return Err(Error::DType { op, arg: "sinks", msg });
    }
    if !t.device().same_device(query.device()) {
        let msg = format!("sinks are on {:?} but query is on {:?}", t.device(), query.device());
        return Err(Error::Config { op, arg: "sinks", msg });
    }
    Ok(())
}

/// The batch dimensions of key and value as attention sees them: with `enable_gqa`, their head
/// dimension repeated to the query's.
fn gqa_batches(query: &Tensor, key: &Tensor, value: &Tensor, gqa: bool) -> Result<[Vec<usize>; 2]> {
    let (qr, kr, vr) = (query.rank(), key.rank(), value.rank());
    let mut kb = key.dims()[..kr - 2].to_vec();
    let mut vb = value.dims()[..vr - 2].to_vec();
    if gqa && qr >= 3 && kr >= 3 && vr >= 3 {
        let hq = query.dim(qr - 3)?;
        let (hk, hv) = (key.dim(kr - 3)?, value.dim(vr - 3)?);
        if hk == 0 || hv == 0 || hq % hk != 0 || hq % hv != 0 {
            return Err(shape_err(
                "key",
                format!(
                    "number of heads in key and value must divide the number of heads in query: query {} key {} value {}",
                    fmt_shape(query.dims()),
                    fmt_shape(key.dims()),
                    fmt_shape(value.dims())
                ),
            ));
        }
        kb[kr - 3] = hq;
        vb[vr - 3] = hq;
    }
    Ok([kb, vb])
}

/// Step 1: every check, for both paths.
fn validate(query: &Tensor, key: &Tensor, value: &Tensor, opts: &SdpaOptions) -> Result<SdpaCall> {
    check_basics(query, key, value, opts)?;
    let (qr, kr, vr) = (query.rank(), key.rank(), value.rank());
    let (l, e) = (query.dim(qr - 2)?, query.dim(qr - 1)?);
    let (s, ek) = (key.dim(kr - 2)?, key.dim(kr - 1)?);
    let (sv, ev) = (value.dim(vr - 2)?, value.dim(vr - 1)?);
    if ek != e {
        return Err(shape_err(
            "key",
            format!(
                "the key's last dimension must equal the query's: key {} vs query {}",
                fmt_shape(key.dims()),
                fmt_shape(query.dims())
            ),
        ));
    }
    if sv != s {
        return Err(shape_err(
            "value",
            format!(
                "key and value must have the same sequence length: key {} vs value {}",
                fmt_shape(key.dims()),
                fmt_shape(value.dims())
            ),
        ));
    }
    let [kb, vb] = gqa_batches(query, key, value, opts.enable_gqa)?;
    let batch = broadcast_shapes(&query.dims()[..qr - 2], &kb)
        .and_then(|b| broadcast_shapes(&b, &vb))
        .ok_or_else(|| {
            shape_err(
                "key",
                format!(
                    "the batch dimensions of query {}, key {} and value {} do not broadcast",
                    fmt_shape(query.dims()),
                    fmt_shape(key.dims()),
                    fmt_shape(value.dims())
                ),
            )
        })?;
    crate::alloc::elements(SDPA, "output", &with(&batch, l, ev))?;
    let mask = match &opts.attn_mask {
        Some(m) => {
            let add = m.to_additive_sdpa(query.dtype(), SDPA, "attn_mask")?;
            let full = with(&batch, l, s);
            if broadcast_shapes(add.dims(), &full).is_none_or(|b| b != full) {
                return Err(shape_err(
                    "attn_mask",
                    format!(
                        "attn_mask of shape {} does not broadcast to the attention shape {}",
                        fmt_shape(add.dims()),
                        fmt_shape(&full)
                    ),
                ));
            }
            Some(add)
        }
        None => None,
    };
    let n = (batch.len() >= 2).then(|| batch[0]);
    let heads = batch.last().copied();
    opts.variants.check(SDPA, (n, heads), s)?;
    if let Some(t) = &opts.sinks {
        check_sinks(SDPA, t, query, heads)?;
    }
    let scale = opts.scale.unwrap_or_else(|| 1.0 / (e as f64).sqrt());
    Ok(SdpaCall { batch, l, s, e, ev, mask, scale })
}

/// A validated f32 CPU call on 2-D, 3-D or 5-D+ inputs as the 4-D call the fused kernels take
/// (`sdpa_rank`), unless the composed path is asked for; `None` where it stays as it is.
fn fused_four_d(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    opts: &SdpaOptions,
    call: &SdpaCall,
) -> Result<Option<super::sdpa_rank::FourD>> {
    if dtype_device_blocker(query).is_some() || opts.backend.resolve() == Backend::Composed {
        return Ok(None);
    }
    super::sdpa_rank::four_d(query, key, value, opts, &call.batch)
}

/// Step 2: the path, and why.
fn plan(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    call: &SdpaCall,
    opts: &SdpaOptions,
) -> Result<Plan> {
    let blocker = dtype_device_blocker(query).or_else(|| shape_blocker(query, key, value, call));
    decide(SDPA, opts.backend, blocker)
}

/// What in the shapes keeps a call off the fused kernels, if anything.
fn shape_blocker(query: &Tensor, key: &Tensor, value: &Tensor, call: &SdpaCall) -> Option<Reason> {
    if query.rank() != 4 || key.rank() != 4 || value.rank() != 4 {
        return Some(Reason::NotFourD);
    }
    // Batch and head dimensions that broadcast are read in place (`fused_views`); key and
    // value head counts that differ, neither being 1, are not.
    if kv_heads(key, value, call).is_none() {
        return Some(Reason::KvHeads);
    }
    if call.mask.as_ref().is_some_and(|m| m.rank() > 4) {
        return Some(Reason::MaskRank);
    }
    None
}

/// A bf16 call that nothing can differentiate, which the f32 twin would run fused with bf16
/// products (4-D, one key head per query head, no dropout, no sinks, rounding on): the kernel
/// reads q, k and v as they are and writes the output in bf16. These are the twin's numbers:
/// its inputs widen exactly, its products round them back, and its output is rounded once.
/// What is skipped is widening q, k and v, narrowing the output and rounding the widened
/// operands again as they are packed: a quarter of a bf16 call at B8 H8 L=S=512 D64
/// (docs/performance.md). `None` where another route applies: the caller widens.
fn bf16_direct(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    opts: &SdpaOptions,
    call: &SdpaCall,
) -> Result<Option<Tensor>> {
    use crate::precision::widen;
    if !bf16_direct_applies(query, key, value, opts, call)? {
        return Ok(None);
    }
    ensure_output(query, call)?;
    ensure_fused(query, key, value, call, opts)?;
    // The additive mask in f32, as the kernels read it (the twin widens it the same way),
    // without its broadcast dimensions.
    let compact = |m: &Tensor| widen(&crate::mask::compact(m)?);
    let mask = call.mask.as_ref().map(compact).transpose()?;
    let call = SdpaCall { batch: call.batch.clone(), mask, ..*call };
    run_fused(query, key, value, &call, opts, None).map(Some)
}

/// Whether [`bf16_direct`]'s route applies (inside the caller's rounded-products mode).
fn bf16_direct_applies(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    opts: &SdpaOptions,
    call: &SdpaCall,
) -> Result<bool> {
    let mut inputs = vec![query, key, value];
    if let Some(Mask::Float(m)) = &opts.attn_mask {
        inputs.push(m);
    }
    let direct = query.dtype() == candle_core::DType::BF16
        && key.dtype() == query.dtype()
        && value.dtype() == query.dtype()
        && crate::mode::in_rounded_products()
        && opts.dropout_p == 0.0
        && opts.sinks.is_none()
        && matches!(query.device(), candle_core::Device::Cpu)
        && shape_blocker(query, key, value, call).is_none()
        && kv_heads(key, value, call) == call.batch.get(1).copied()
        && call.l > 0
        && call.s > 0
        && call.ev > 0
        && !call.batch.contains(&0)
        && !crate::fused::flash::gradient_possible(&inputs)
        && decide(SDPA, opts.backend, None)?.path == Path::Fused;
    Ok(direct)
}

/// The path [`scaled_dot_product_attention`] takes for these arguments, and why, without
/// running it. Bad arguments give the same error the call would, an output (or, on the
/// composed path, score matrices) that cannot be allocated included.
///
/// # Shapes
/// * As for [`scaled_dot_product_attention`]: query `(N, H, L, E)`, key `(N, Hkv, S, E)`,
///   value `(N, Hkv, S, Ev)` (or without the batch dimension).
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor};
/// use multihead::functional::{explain_sdpa, SdpaOptions};
/// use multihead::Path;
///
/// let q = Tensor::zeros((1, 2, 3, 4), candle_core::DType::F32, &Device::Cpu)?; // (N, H, L, E)
/// assert_eq!(explain_sdpa(&q, &q, &q, &SdpaOptions::default())?.path, Path::Fused);
/// # Ok::<(), multihead::Error>(())
/// ```
pub fn explain_sdpa(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    opts: &SdpaOptions,
) -> Result<Plan> {
    if let Some(c) = AutocastCall::of(query, key, value, opts)? {
        return crate::mode::autocast_off(|| explain_sdpa(&c.q, &c.k, &c.v, &c.opts));
    }
    let call = validate(query, key, value, opts)?;
    if crate::precision::is_reduced(query.dtype()) {
        // As the call: the bf16 route reads the inputs as they are (its output checked first);
        // any other is explained as its f32 twin.
        let like_flash = pytorch_bf16_flash(query, key, value, opts);
        let direct =
            crate::mode::rounded_products_if(query.dtype(), like_flash, call.macs(), || {
                bf16_direct_applies(query, key, value, opts, &call)
            })?;
        if direct {
            ensure_output(query, &call)?;
            ensure_fused(query, key, value, &call, opts)?;
            return decide(SDPA, opts.backend, None);
        }
        let (q, k, v, o) = widened(query, key, value, opts)?;
        return explain_sdpa(&q, &k, &v, &o);
    }
    if let Some(f) = fused_four_d(query, key, value, opts, &call)? {
        return explain_sdpa(&f.query, &f.key, &f.value, &f.opts);
    }
    let plan = plan(query, key, value, &call, opts)?;
    // The sizes the call checks before it runs: an output (or, composed, score matrices) that
    // cannot be allocated is the call's error here too.
    let out_dims = ensure_output(query, &call)?;
    if !out_dims.contains(&0) && call.s > 0 {
        match plan.path {
            Path::Composed => _ = ensure_composed(query, &call)?,
            Path::Fused => ensure_fused(query, key, value, &call, opts)?,
        }
    }
    Ok(plan)
}

/// Whether PyTorch 2.15's CPU attention takes its flash kernel for this reduced-precision call
/// (which rounds the probabilities and the backward's operands to bf16) rather than its math
/// path (which widens to f32): 4-D inputs, or 3-D ones (run as 4-D with a batch of one), with
/// the value's width equal to the query's, keys and values not broadcast over the batch, and a
/// mask of rank 2 or 4 for 4-D inputs (checked by the autograd node torch 2.15 records: a 3-D
/// mask, 2-D or 5-D inputs, `Ev ≠ E` or a broadcast batch give `ToCopyBackward0`). Dropout and
/// grouped heads are decided by the flash op itself (`FlashAttention::with_rounded_products`).
fn pytorch_bf16_flash(query: &Tensor, key: &Tensor, value: &Tensor, opts: &SdpaOptions) -> bool {
    let (r, qd, kd, vd) = (query.rank(), query.dims(), key.dims(), value.dims());
    let same_rank = key.rank() == r && value.rank() == r;
    let mask_ok = match (&opts.attn_mask, r) {
        (None, _) | (Some(_), 3) => true,
        (Some(m), _) => matches!(m.tensor().rank(), 2 | 4),
    };
    let batch_ok = r != 4 || (kd[0] == qd[0] && vd[0] == qd[0]);
    // A mask that requires grad sends PyTorch to its math path too.
    let learned = mask_records_grad(opts.attn_mask.as_ref());
    same_rank && matches!(r, 3 | 4) && qd[r - 1] == vd[r - 1] && batch_ok && mask_ok && !learned
}

/// A bf16/f16 call in f32 (the f32 path, fused on the CPU, accumulating in f32 as PyTorch's
/// CPU kernels do): inputs and a float mask widened.
fn widened(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    opts: &SdpaOptions,
) -> Result<(Tensor, Tensor, Tensor, SdpaOptions)> {
    use crate::precision::widen;
    let mut o = opts.clone();
    if let Some(Mask::Float(t)) = &opts.attn_mask {
        o.attn_mask = Some(Mask::Float(widen(t)?));
    }
    if let Some(t) = &opts.sinks {
        o.sinks = Some(widen(t)?);
    }
    Ok((widen(query)?, widen(key)?, widen(value)?, o))
}

/// [`scaled_dot_product_attention`] inside [`autocast`](crate::autocast) to bf16 or f16, as
/// `torch.autocast("cpu", dtype)` runs it: the query, key, value, a float mask and the sinks,
/// where they are f32, bf16 or f16, converted to the autocast dtype (differentiably) and
/// attended in it.
struct AutocastCall {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    opts: SdpaOptions,
    /// Whether the query, key and value were all f32: the output is then an f32 tensor holding
    /// the autocast dtype's values (as `Linear` and `MultiheadAttention` return under autocast,
    /// so that the f32 code around composes without casts); otherwise it has the autocast dtype.
    f32_out: bool,
}

impl AutocastCall {
    /// The converted call; `None` outside autocast, where every tensor has the autocast dtype
    /// already, or where one is f64 (which PyTorch's autocast leaves as it is: the call then
    /// runs as given, and validation names it).
    fn of(
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        opts: &SdpaOptions,
    ) -> Result<Option<Self>> {
        use candle_core::DType::{BF16, F16, F32};
        let Some(dt) = crate::mode::autocast_dtype().filter(|d| crate::precision::is_reduced(*d))
        else {
            return Ok(None);
        };
        let mask = match &opts.attn_mask {
            Some(Mask::Float(m)) => Some(m),
            _ => None,
        };
        let tensors: Vec<&Tensor> =
            [query, key, value].into_iter().chain(mask).chain(opts.sinks.as_ref()).collect();
        let eligible = |t: &&Tensor| matches!(t.dtype(), F32 | BF16 | F16);
        if !tensors.iter().all(eligible) || tensors.iter().all(|t| t.dtype() == dt) {
            return Ok(None);
        }
        let to = |t: &Tensor| crate::precision::narrow(t, dt);
        let mut o = opts.clone();
        if let Some(m) = mask {
            o.attn_mask = Some(Mask::Float(to(m)?));
        }
        o.sinks = opts.sinks.as_ref().map(to).transpose()?;
        let [q, k, v] = crate::precision::map_aliased([query, key, value], &to)?;
        let f32_out = [query, key, value].iter().all(|t| t.dtype() == F32);
        Ok(Some(AutocastCall { q, k, v, opts: o, f32_out }))
    }

    /// The attention in the autocast dtype (autocast off inside), its output widened back
    /// where the inputs were f32.
    fn run(&self) -> Result<Tensor> {
        let (q, k, v, o) = (&self.q, &self.k, &self.v, &self.opts);
        let y = crate::mode::autocast_off(|| scaled_dot_product_attention(q, k, v, o))?;
        match self.f32_out {
            true => crate::precision::widen(&y),
            false => Ok(y),
        }
    }
}

/// Scaled dot-product attention: `softmax(q kᵀ · scale + mask) v`, with optional dropout on the
/// weights.
///
/// Fully masked rows give zeros, as PyTorch's CPU backends do. The fused kernels run for f32
/// CPU input (see [`explain_sdpa`]): 4-D, with batch and head dimensions that broadcast read in
/// place, or 2-D, 3-D and wider with the dimensions before the heads merged into one batch (a
/// 3-D input's first dimension is its heads, as `enable_gqa` reads it; a 2-D one is one head);
/// every other call runs the composed candle path, with the same checks and the same numbers.
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
    if let Some(c) = AutocastCall::of(query, key, value, opts)? {
        return c.run();
    }
    let call = validate(query, key, value, opts)?;
    if crate::precision::is_reduced(query.dtype()) {
        let like_flash = pytorch_bf16_flash(query, key, value, opts);
        let macs = call.macs();
        let direct = crate::mode::rounded_products_if(query.dtype(), like_flash, macs, || {
            bf16_direct(query, key, value, opts, &call)
        })?;
        if let Some(y) = direct {
            return Ok(y);
        }
        let (q, k, v, o) = widened(query, key, value, opts)?;
        let y = crate::mode::rounded_products_if(query.dtype(), like_flash, macs, || {
            scaled_dot_product_attention(&q, &k, &v, &o)
        })?;
        return crate::precision::narrow(&y, query.dtype());
    }
    if let Some(f) = fused_four_d(query, key, value, opts, &call)? {
        let y = scaled_dot_product_attention(&f.query, &f.key, &f.value, &f.opts)?;
        return Ok(y.reshape(with(&f.batch, call.l, call.ev))?);
    }
    let plan = plan(query, key, value, &call, opts)?;
    let out_dims = ensure_output(query, &call)?;
    if out_dims.contains(&0) || call.s == 0 {
        // Nothing to attend: an empty softmax row gives a zero output row on both paths
        // (kept in the graph: the inputs, a float mask and the sinks get zero gradients).
        let mut inputs = vec![query, key, value];
        if let Some(Mask::Float(m)) = &opts.attn_mask {
            inputs.push(m);
        }
        inputs.extend(opts.sinks.as_ref());
        return crate::fused::zeros::zeros_of(&out_dims, query.dtype(), &inputs);
    }
    let dropout = (opts.dropout_p > 0.0)
        .then(|| (opts.dropout_p, opts.dropout_key.unwrap_or_else(next_dropout_key)));
    match plan.path {
        Path::Fused => run_fused(query, key, value, &call, opts, dropout),
        Path::Composed => run_composed(query, key, value, &call, opts, dropout),
    }
}

/// The output's dimensions, once the allocator has said it can take them (an
/// [`Error::Alloc`](crate::Error::Alloc) otherwise): checked by the call and by
/// [`explain_sdpa`] alike.
fn ensure_output(query: &Tensor, call: &SdpaCall) -> Result<Vec<usize>> {
    let out_dims = with(&call.batch, call.l, call.ev);
    crate::alloc::ensure(SDPA, "output", &out_dims, query.dtype(), 1, "use smaller inputs")?;
    Ok(out_dims)
}

/// The fused path's copies of its inputs (see [`sdpa_copies`](super::sdpa_copies)), checked
/// before they are made (by the call and by [`explain_sdpa`]).
fn ensure_fused(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    call: &SdpaCall,
    opts: &SdpaOptions,
) -> Result<()> {
    let (q, k, v) = fused_views(query, key, value, call)?;
    let (mask, sinks) = (call.mask.as_ref(), opts.sinks.as_ref());
    let backward = super::sdpa_copies::mask_for_backward([&q, &k, &v], mask, sinks);
    super::sdpa_copies::ensure_fused([&q, &k, &v], mask, backward)
}

/// The composed path's score matrices and broadcast copies, checked before it builds them
/// (by the call and by [`explain_sdpa`]); the merged batch size.
fn ensure_composed(query: &Tensor, call: &SdpaCall) -> Result<usize> {
    let SdpaCall { batch, l, s, e, ev, .. } = call;
    let bsz: usize = batch.iter().product();
    crate::alloc::ensure(
        SDPA,
        "attention scores",
        &[bsz, *l, *s],
        query.dtype(),
        3,
        "the composed path builds (..., L, S) score matrices; use f32 on the CPU (the fused kernels never build them) or smaller inputs",
    )?;
    // The broadcast copies of q, k and v.
    let hint = "broadcast inputs are copied to full size on the composed path; use smaller inputs";
    crate::alloc::ensure(SDPA, "query", &[bsz, *l, *e], query.dtype(), 1, hint)?;
    crate::alloc::ensure(SDPA, "key", &[bsz, *s, e + ev], query.dtype(), 1, hint)?;
    Ok(bsz)
}

/// Step 3, composed: broadcast to `(B, L, ·)`, then the attention core.
fn run_composed(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    call: &SdpaCall,
    opts: &SdpaOptions,
    dropout: Option<(f64, DropoutKey)>,
) -> Result<Tensor> {
    let SdpaCall { batch, l, s, e, ev, .. } = call;
    let (l, s, e, ev) = (*l, *s, *e, *ev);
    let bsz = ensure_composed(query, call)?;
    let (qr, kr, vr) = (query.rank(), key.rank(), value.rank());
    let (mut key, mut value) = (key.clone(), value.clone());
    if opts.enable_gqa && qr >= 3 && kr >= 3 && vr >= 3 {
        let hq = query.dim(qr - 3)?;
        key = repeat_interleave(&key, hq / key.dim(kr - 3)?, kr - 3)?;
        value = repeat_interleave(&value, hq / value.dim(vr - 3)?, vr - 3)?;
    }
    let q = expand_to(query, &with(batch, l, e))?.contiguous()?.reshape((bsz, l, e))?;
    let k = expand_to(&key, &with(batch, s, e))?.contiguous()?.reshape((bsz, s, e))?;
    let v = expand_to(&value, &with(batch, s, ev))?.contiguous()?.reshape((bsz, s, ev))?;
    let lead = batch.len().saturating_sub(1);
    let band = opts.variants.band_mask(
        SDPA,
        (opts.is_causal, lead),
        (l, s),
        query.dtype(),
        query.device(),
    )?;
    let alibi = opts.variants.alibi_bias(SDPA, (l, s), query.dtype(), query.device())?;
    // A cap after the masks hides keys by index after the cap (as the kernels do), so the band
    // is kept apart there; elsewhere it is one more additive mask.
    let (band, hide) = match opts.variants.cap() {
        Some((_, true)) => (None, band),
        _ => (band, None),
    };
    let flat = |m: Tensor| -> Result<Tensor> {
        Ok(expand_to(&m, &with(batch, l, s))?.contiguous()?.reshape((bsz, l, s))?)
    };
    let hide = hide.map(flat).transpose()?;
    let mut mask = call.mask.clone();
    for extra in [band, alibi].into_iter().flatten() {
        mask = Some(match mask {
            Some(m) => m.broadcast_add(&extra)?,
            None => extra,
        });
    }
    let mask = mask.map(flat).transpose()?;
    // One sink per flattened batch entry (its head's).
    let sinks = match &opts.sinks {
        Some(t) => {
            let mut dims = vec![1usize; batch.len()];
            dims[batch.len() - 1] = t.dim(0)?;
            Some(t.reshape(dims)?.broadcast_as(batch.as_slice())?.reshape((bsz, 1, 1))?)
        }
        None => None,
    };
    let score = (call.scale, opts.variants.cap(), sinks.as_ref());
    let masked = call.mask.is_some();
    let masks = ScoreMasks { add: mask.as_ref(), masked, hide: hide.as_ref() };
    let (out, _) = attention_core(&q, &k, &v, masks, score, dropout, false)?;
    Ok(out.reshape(with(batch, l, ev))?)
}

/// The key and value heads of the fused call: their common count, or the broadcast heads'
/// where one of them has a single head; `None` for two different counts.
fn kv_heads(key: &Tensor, value: &Tensor, call: &SdpaCall) -> Option<usize> {
    let (hk, hv) = (key.dims()[1], value.dims()[1]);
    match (hk == hv, hk == 1 || hv == 1) {
        (true, _) => Some(hk),
        (false, true) => call.batch.get(1).copied(),
        (false, false) => None,
    }
}

/// The 4-D inputs as the views the fused op reads: batch (and heads) broadcast to the call's
/// (stride 0, nothing copied), keys and values to `kv_heads`; an input of that shape as it is
/// (`expand_to`: a no-op broadcast took a third of a bf16 SDPA training step at B8 L512 E512).
fn fused_views(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    call: &SdpaCall,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, hq) = (call.batch[0], call.batch[1]);
    let hk = kv_heads(key, value, call).unwrap_or(hq);
    Ok((
        expand_to(query, &[b, hq, call.l, call.e])?,
        expand_to(key, &[b, hk, call.s, call.e])?,
        expand_to(value, &[b, hk, call.s, call.ev])?,
    ))
}

/// Step 3, fused: the flash-attention op on `(B, H, T, D)` input.
fn run_fused(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    call: &SdpaCall,
    opts: &SdpaOptions,
    dropout: Option<(f64, DropoutKey)>,
) -> Result<Tensor> {
    use crate::fused::flash::{Convention, FlashAttention, FlashMask};
    let (query, key, value) = fused_views(query, key, value, call)?;
    let (query, key, value) = (&query, &key, &value);
    let (b, hq, l, e) = query.dims4()?;
    let hk = key.dim(1)?;
    let (mask, sinks) = (call.mask.as_ref(), opts.sinks.as_ref());
    let backward = super::sdpa_copies::mask_for_backward([query, key, value], mask, sinks);
    super::sdpa_copies::ensure_fused([query, key, value], mask, backward)?;
    let mut masks = Vec::new();
    if let Some(add) = &call.mask {
        // Without its broadcast dimensions (read with stride 0): read where it lies when no
        // backward can read it and it is f32 and dense behind them, copied otherwise.
        let add = crate::mask::compact(add)?;
        masks.push(FlashMask::new(&add, super::sdpa_copies::mask_strides(add.dims()), backward)?);
    }
    let dims = multihead_kernels::attention::AttnDims {
        batch: b,
        heads_q: hq,
        heads_kv: hk,
        l,
        s: call.s,
        d: e,
        dv: call.ev,
    };
    let op = FlashAttention::new(
        dims,
        call.scale as f32,
        opts.is_causal,
        masks,
        dropout,
        Convention::Bhtd,
    )
    .with_variants(&opts.variants)
    .with_rounded_products(false);
    let op = match &opts.sinks {
        Some(t) => op.with_sinks(t.to_vec1::<f32>()?),
        None => op,
    };
    // The kernels read rows; a view whose last dimension is strided (a transpose, a broadcast)
    // is copied first (differentiably).
    let rows = |t: &Tensor| -> Result<Tensor> {
        Ok(if super::sdpa_copies::needs_row_copy(t) { t.contiguous()? } else { t.clone() })
    };
    let (q, k, v) = (rows(query)?, rows(key)?, rows(value)?);
    let mut out = op.apply(&q, &k, &v)?;
    if let (Some(mask), true) = (&call.mask, mask_records_grad(opts.attn_mask.as_ref())) {
        // A learned bias: its gradient joins the graph through an identity on the output.
        let inputs = crate::fused::mask_grad::Inputs::Unpacked([q.clone(), k.clone(), v.clone()]);
        out = crate::fused::mask_grad::attach(&op, &out, mask, inputs)?;
    }
    match &opts.sinks {
        // The sinks' gradient joins the graph through an identity on the output.
        Some(t) => crate::fused::sinks::attach(&op, &out, t),
        None => Ok(out),
    }
}
