//! `F.multi_head_attention_forward` in three steps: [`validate`] every argument, plan the path
//! ([`crate::fused::dispatch`]), run it: [`project`] the inputs, then the [`composed`] candle
//! path or the fused kernels ([`fused`]), then the output projection.

mod composed;
mod fused;
mod project;
mod validate;

/// Validates a call of multi-head attention as [`mha_forward_impl`] would, and nothing more (no
/// plan, no widening): for callers that must refuse a bad call before they change state.
pub(crate) use validate::validate as mha_validate;

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::fused::dispatch::{decide, dtype_device_blocker, Path, Plan};
use crate::linear::linear;
use crate::mask::Mask;
use crate::mode::{grad_enabled, Backend};
use crate::random::{next_dropout_key, DropoutKey};
use validate::MhaCall;

pub(crate) const MHA: &str = "multi_head_attention_forward";

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
    /// Key/value heads for grouped-query attention; `None` means `num_heads` (PyTorch). With
    /// `K` kv heads of `D = E/H`, `k_proj_weight`/`v_proj_weight` are `(K·D, ·)`, `in_proj_bias`
    /// `(E + 2·K·D,)` and `bias_k`/`bias_v` `(1, 1, K·D)`; the packed `in_proj_weight` needs
    /// `K = H`. An extension of PyTorch's signature.
    pub num_kv_heads: Option<usize>,
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
    /// The causal hint, PyTorch's rules (`docs/pytorch-behaviour.md` §4): it requires an `attn_mask`; when
    /// `need_weights` is false and there is no `key_padding_mask`, the mask is replaced by an
    /// upper-left causal mask; otherwise the mask is used as given. Default `false`.
    pub is_causal: bool,
    /// The dropout key; `None` draws the next one from the global generator when dropout is
    /// active. Default `None`.
    pub dropout_key: Option<DropoutKey>,
    /// Which implementation runs; `Auto` follows [`default_backend`](crate::default_backend).
    /// Default `Auto`.
    pub backend: Backend,
    /// PyTorch's `static_k`: keys already projected and split into heads, `(N·Hkv, S, D)`,
    /// used instead of projecting `key` (which must still have a valid shape). Given with
    /// `static_v`; not with `bias_k`. Default `None`.
    pub static_k: Option<Tensor>,
    /// PyTorch's `static_v`: values already projected, `(N·Hkv, S, D)`. Default `None`.
    pub static_v: Option<Tensor>,
    /// Soft cap, window, alignment of the causal diagonal, key lengths and ALiBi (not in
    /// PyTorch's MultiheadAttention; see [`Variants`](crate::Variants) and
    /// `docs/variants.md`). They apply around the causal hint and the masks as in SDPA; not
    /// with `bias_k`/`bias_v` or `add_zero_attn`. Default none.
    pub variants: crate::Variants,
    /// Attention sinks (gpt-oss): a learned logit per head, `(H,)` in the parameters' dtype,
    /// joining every row's softmax denominator with no value; differentiable. Default none.
    pub sinks: Option<Tensor>,
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
            backend: Backend::Auto,
            static_k: None,
            static_v: None,
            variants: crate::Variants::default(),
            sinks: None,
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
    /// Sets the backend.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
    /// Sets every variant at once (see [`Variants`](crate::Variants)).
    pub fn variants(mut self, variants: crate::Variants) -> Self {
        self.variants = variants;
        self
    }
    /// Sets the soft cap `c`: scores become `c·tanh(q·kᵀ/√D / c)` before the masks.
    pub fn softcap(mut self, c: f64) -> Self {
        self.variants.softcap = Some(c);
        self
    }
    /// Sets a local window: `left` keys before each query's own key, `right` after.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.variants.window = crate::Window { left, right };
        self
    }
    /// Aligns the causal hint and the window top-left (the default) or bottom-right.
    pub fn causal_align(mut self, align: crate::CausalAlign) -> Self {
        self.variants.align = align;
        self
    }
    /// Sets the ALiBi slopes, one per head.
    pub fn alibi(mut self, slopes: Vec<f64>) -> Self {
        self.variants.alibi_slopes = Some(slopes);
        self
    }
    /// Sets the attention sinks, `(H,)`.
    pub fn sinks(mut self, sinks: Tensor) -> Self {
        self.sinks = Some(sinks);
        self
    }
    /// Sets `static_k` and `static_v`, `(N·Hkv, S, D)` each (see
    /// [`MultiheadAttention::static_kv`](crate::MultiheadAttention::static_kv)).
    pub fn static_kv(mut self, k: Tensor, v: Tensor) -> Self {
        self.static_k = Some(k);
        self.static_v = Some(v);
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

/// Multi-head attention on sequence-first input, as `torch.nn.functional.multi_head_attention_forward`.
///
/// Follows PyTorch's slow path step by step (`docs/pytorch-behaviour.md` §3): input projection (grouped by which
/// inputs are the same tensor), `bias_k`/`bias_v`, head split, zero attention, mask merge,
/// scaled dot-product attention with dropout on the weights when `training`, output projection.
/// Fully masked query rows give a zero attention row (so the output row is `out_proj_bias`) and
/// zero weights on every path; PyTorch gives NaN on its `need_weights=True` path there.
///
/// Every argument is checked once, before a path is chosen; then the fused kernels or the
/// composed candle path run (see [`explain_mha`] for which, and why). Both accept the same
/// arguments and give the same numbers.
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
///     embed_dim_to_check: e, num_heads: h, num_kv_heads: None, in_proj: InProj::Packed(&w_in), in_proj_bias: None,
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
    if let Some(dt) = crate::precision::autocast_for(query.dtype(), params.out_proj_weight.dtype())
    {
        return autocast_forward(query, key, value, alias, params, opts, training, dt);
    }
    let again = |[q, k, v]: [&Tensor; 3], p: &MhaParams, o: &MhaOptions| {
        multi_head_attention_forward(q, k, v, p, o, training)
    };
    if let Some(r) = cast_under_autocast((query, key, value), alias, params, opts, again) {
        return r;
    }
    mha_forward_impl(query, key, value, alias, params, opts, training, false)
}

/// [`multi_head_attention_forward`] inside [`autocast`](crate::autocast) to `dt` on an
/// f32, bf16 or f16 query, as `MultiheadAttention` runs there: the parameters, the inputs and
/// the float masks rounded to `dt` (differentiably), the call computed as its `dt` path
/// computes it, and the output and weights rounded once (f32 tensors holding `dt` values for an
/// f32 query, `dt` tensors otherwise, as PyTorch returns them).
#[allow(clippy::too_many_arguments)]
fn autocast_forward(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    alias: Aliasing,
    params: &MhaParams,
    opts: &MhaOptions,
    training: bool,
    dt: DType,
) -> Result<MhaOutput> {
    // The functional call is sequence-first.
    let out =
        in_autocast((query, key, value), alias, params, opts, (dt, false), |[q, k, v], p, o| {
            mha_forward_impl(q, k, v, alias, p, o, training, false)
        })?;
    let done = |t: &Tensor| crate::precision::autocast_output(t, query.dtype(), dt);
    Ok(MhaOutput {
        output: done(&out.output)?,
        attn_weights: out.attn_weights.map(|t| done(&t)).transpose()?,
    })
}

/// The path [`multi_head_attention_forward`] takes for these arguments, and why, without
/// running it. Bad arguments give the same error the call would.
///
/// # Shapes
/// * As for [`multi_head_attention_forward`]: query `(L, N, E)`, key and value `(S, N, E)`
///   (or unbatched `(L, E)`, `(S, E)`).
pub fn explain_mha(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    params: &MhaParams,
    opts: &MhaOptions,
    training: bool,
) -> Result<Plan> {
    let alias = Aliasing::of(query, key, value);
    if let Some(dt) = crate::precision::autocast_for(query.dtype(), params.out_proj_weight.dtype())
    {
        return autocast_plan(query, key, value, alias, params, opts, (training, false), dt);
    }
    let again = |[q, k, v]: [&Tensor; 3], p: &MhaParams, o: &MhaOptions| {
        explain_mha(q, k, v, p, o, training)
    };
    if let Some(r) = cast_under_autocast((query, key, value), alias, params, opts, again) {
        return r;
    }
    mha_plan_impl(query, key, value, alias, params, opts, training, false)
}

/// The plan of a call inside [`autocast`](crate::autocast) to `dt`: that of the call its
/// autocast path runs (the inputs, parameters and options rounded to `dt` and held in f32,
/// planned with the products rounded), so that explaining accepts what the call accepts.
#[allow(clippy::too_many_arguments)]
pub(crate) fn autocast_plan(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    alias: Aliasing,
    params: &MhaParams,
    opts: &MhaOptions,
    (training, batch_first): (bool, bool),
    dt: DType,
) -> Result<Plan> {
    in_autocast((query, key, value), alias, params, opts, (dt, batch_first), |[q, k, v], p, o| {
        mha_plan_impl(q, k, v, alias, p, o, training, batch_first)
    })
}

/// `f` on the call an autocast to `dt` runs: the inputs, parameters and options through
/// [`autocast_operand`](crate::precision::autocast_operand) (rounded to `dt`, held in f32),
/// with autocast off and the products rounded to `dt`.
fn in_autocast<R>(
    (query, key, value): (&Tensor, &Tensor, &Tensor),
    alias: Aliasing,
    params: &MhaParams,
    opts: &MhaOptions,
    (dt, batch_first): (DType, bool),
    f: impl FnOnce([&Tensor; 3], &MhaParams, &MhaOptions) -> Result<R>,
) -> Result<R> {
    let r = |t: &Tensor| crate::precision::autocast_operand(t, dt);
    let w = Widened::mapped(query, key, value, alias, params, autocast_options(opts, &r)?, &r)?;
    let p = w.params(params);
    let macs = crate::products::call_macs(query, key, batch_first);
    crate::mode::autocast_off(|| {
        crate::mode::rounded_products(dt, macs, || f([&w.q, &w.k, &w.v], &p, &w.opts))
    })
}

/// Inside an autocast to the dtype `dt` of the parameters (`out_proj_weight`'s), `f` on the
/// call such a module makes: the inputs, parameters, float masks, static keys and values and
/// sinks converted to `dt` where they are f32, bf16 or f16 (PyTorch's autocast casts every
/// argument of the products it runs; f64 is left for the call to refuse), with autocast off,
/// so that the call runs as on `dt` arguments. `None` outside such an autocast.
fn cast_under_autocast<R>(
    (query, key, value): (&Tensor, &Tensor, &Tensor),
    alias: Aliasing,
    params: &MhaParams,
    opts: &MhaOptions,
    f: impl FnOnce([&Tensor; 3], &MhaParams, &MhaOptions) -> Result<R>,
) -> Option<Result<R>> {
    let dt = crate::precision::autocast_into(params.out_proj_weight.dtype())?;
    let cast = |t: &Tensor| crate::precision::autocast_cast(t, dt);
    let run = || {
        let opts = cast_options(opts, dt)?;
        let w = Widened::mapped(query, key, value, alias, params, opts, &cast)?;
        let p = w.params(params);
        crate::mode::autocast_off(|| f([&w.q, &w.k, &w.v], &p, &w.opts))
    };
    Some(run())
}

/// Whether a gradient will be recorded through the attention: grad mode is on and an input or
/// an in-projection parameter is tracked by candle.
pub(super) fn records_grad(call: &MhaCall) -> bool {
    grad_enabled() && inputs_tracked(call)
}

/// Whether the inputs, the in-projection's parameters or the static keys carry a graph.
fn inputs_tracked(call: &MhaCall) -> bool {
    let p = call.params;
    let mut tracked = [&call.query, &call.key, &call.value].iter().any(|t| t.track_op());
    tracked |= match p.in_proj {
        InProj::Packed(w) => w.track_op(),
        InProj::Separate { q, k, v } => q.track_op() || k.track_op() || v.track_op(),
    };
    tracked |= p.in_proj_bias.is_some_and(|b| b.track_op());
    tracked |= call.static_kv.as_ref().is_some_and(|(k, v)| k.track_op() || v.track_op());
    tracked
}

/// Whether a backward may read the fused op's masks, which it then copies
/// ([`FlashMask`](crate::fused::flash::FlashMask)): gradients enabled, or anything the
/// attention is computed from carries a graph (inputs, parameters, `bias_k`/`bias_v`, static
/// keys, the masks, the sinks). Decided from the call, so the call and its plan agree.
pub(super) fn masks_for_backward(call: &MhaCall) -> bool {
    let p = call.params;
    let extra = [p.bias_k, p.bias_v].into_iter().flatten();
    let tracked =
        extra.chain(&call.attn_mask).chain(&call.kpm).chain(&call.sinks).any(|t| t.track_op());
    grad_enabled() || tracked || inputs_tracked(call)
}

/// Step 2: the one decision between the fused kernels and the composed path.
fn plan(call: &MhaCall, opts: &MhaOptions) -> Result<Plan> {
    decide(MHA, opts.backend, dtype_device_blocker(&call.query))
}

// Internal: validate and plan with the aliasing and layout the module knows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mha_plan_impl(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    alias: Aliasing,
    params: &MhaParams,
    opts: &MhaOptions,
    training: bool,
    batch_first: bool,
) -> Result<Plan> {
    let call = validate::validate(query, key, value, alias, params, opts, training, batch_first)?;
    if crate::precision::is_reduced(call.dtype) {
        if let Some(plan) = direct_bf16_plan(&call, opts)? {
            // Run as it is (the call's own route), its sizes checked as the call checks them.
            ensure_planned(&call, &plan)?;
            return Ok(plan);
        }
        let w = Widened::new(query, key, value, alias, params, opts)?;
        let p32 = w.params(params);
        return mha_plan_impl(&w.q, &w.k, &w.v, alias, &p32, &w.opts, training, batch_first);
    }
    let plan = plan(&call, opts)?;
    ensure_planned(&call, &plan)?;
    Ok(plan)
}

/// What [`forward_planned`] checks before it allocates, in its order, so that a plan that
/// says `Ok` is a call whose sizes can be allocated: the projections (their copies and
/// outputs), then the attention's weights, masks and (composed) score matrices. The output
/// projection's output has the query projection's size, checked first.
fn ensure_planned(call: &MhaCall, plan: &Plan) -> Result<()> {
    if call.n == 0 || call.l == 0 {
        return Ok(());
    }
    project::ensure(call, bf16_projection(call, plan))?;
    match plan.path {
        Path::Fused => fused::ensure(call),
        Path::Composed => composed::ensure(call),
    }
}

/// `opts` with its float masks, static keys and values and sinks widened to f32 (the f32 twin
/// of a bf16/f16 call).
pub(crate) fn widen_options(opts: &MhaOptions) -> Result<MhaOptions> {
    use crate::precision::{widen_mask, widen_opt};
    let mut o = opts.clone();
    o.attn_mask = widen_mask(opts.attn_mask.as_ref())?;
    o.key_padding_mask = widen_mask(opts.key_padding_mask.as_ref())?;
    o.static_k = widen_opt(opts.static_k.as_ref())?;
    o.static_v = widen_opt(opts.static_v.as_ref())?;
    o.sinks = widen_opt(opts.sinks.as_ref())?;
    Ok(o)
}

/// `opts` as an autocast call reads them: its float masks, static keys and values and sinks
/// passed through `round` (PyTorch's autocast casts SDPA's `attn_mask`, into which MHA merges
/// both masks, and the keys and values its products read, to the autocast dtype; sinks, this
/// crate's extension, are logits beside the scores and go the same way). Bool masks stay as
/// given.
pub(crate) fn autocast_options(
    opts: &MhaOptions,
    round: &dyn Fn(&Tensor) -> Result<Tensor>,
) -> Result<MhaOptions> {
    let r = |m: &Option<Mask>| -> Result<Option<Mask>> {
        Ok(match m {
            Some(Mask::Float(t)) => Some(Mask::Float(round(t)?)),
            other => other.clone(),
        })
    };
    let mut o = opts.clone();
    o.attn_mask = r(&opts.attn_mask)?;
    o.key_padding_mask = r(&opts.key_padding_mask)?;
    o.static_k = opts.static_k.as_ref().map(round).transpose()?;
    o.static_v = opts.static_v.as_ref().map(round).transpose()?;
    o.sinks = opts.sinks.as_ref().map(round).transpose()?;
    Ok(o)
}

/// `opts` with their float masks, static keys and values and sinks converted to `dt` as
/// PyTorch's autocast casts them for a module in `dt`
/// ([`autocast_cast`](crate::precision::autocast_cast)).
pub(crate) fn cast_options(opts: &MhaOptions, dt: DType) -> Result<MhaOptions> {
    autocast_options(opts, &|t| crate::precision::autocast_cast(t, dt))
}

/// Whether every float tensor of `opts` (float masks, static keys and values, sinks) is in
/// `dtype`: a reduced-precision call whose options may be widened with its inputs. Otherwise
/// the call runs as given and validation names the argument in the wrong dtype.
pub(crate) fn options_in(opts: &MhaOptions, dtype: DType) -> bool {
    let masks = [opts.attn_mask.as_ref(), opts.key_padding_mask.as_ref()];
    let tensors = [opts.static_k.as_ref(), opts.static_v.as_ref(), opts.sinks.as_ref()];
    crate::precision::masks_match(&masks, dtype)
        && tensors.iter().flatten().all(|t| t.dtype() == dtype)
}

/// A bf16/f16 call in f32: the inputs (aliasing kept), parameters, float masks and static
/// keys widened, so that the f32 path (the fused kernels on the CPU) runs it and accumulates
/// in f32, as PyTorch's CPU kernels do for reduced precision.
struct Widened {
    /// The query, key and value, mapped (the same tensor stays the same tensor).
    q: Tensor,
    k: Tensor,
    v: Tensor,
    in_proj: Vec<Tensor>,
    in_proj_bias: Option<Tensor>,
    bias_k: Option<Tensor>,
    bias_v: Option<Tensor>,
    out_proj_weight: Tensor,
    out_proj_bias: Option<Tensor>,
    opts: MhaOptions,
}

impl Widened {
    fn new(
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        alias: Aliasing,
        p: &MhaParams,
        opts: &MhaOptions,
    ) -> Result<Self> {
        Self::mapped(query, key, value, alias, p, widen_options(opts)?, &crate::precision::widen)
    }

    /// The inputs and parameters passed through `f`, with the options `opts`.
    fn mapped(
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        alias: Aliasing,
        p: &MhaParams,
        opts: MhaOptions,
        f: &dyn Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        let f_opt = |t: Option<&Tensor>| t.map(f).transpose();
        let q = f(query)?;
        let k = if alias.key_is_query { q.clone() } else { f(key)? };
        let v = if alias.value_is_key { k.clone() } else { f(value)? };
        let in_proj = match p.in_proj {
            InProj::Packed(w) => vec![f(w)?],
            InProj::Separate { q, k, v } => vec![f(q)?, f(k)?, f(v)?],
        };
        Ok(Self {
            q,
            k,
            v,
            in_proj,
            in_proj_bias: f_opt(p.in_proj_bias)?,
            bias_k: f_opt(p.bias_k)?,
            bias_v: f_opt(p.bias_v)?,
            out_proj_weight: f(p.out_proj_weight)?,
            out_proj_bias: f_opt(p.out_proj_bias)?,
            opts,
        })
    }

    /// `p` with the widened parameters.
    fn params<'a>(&'a self, p: &MhaParams) -> MhaParams<'a> {
        let in_proj = match self.in_proj.as_slice() {
            [q, k, v] => InProj::Separate { q, k, v },
            [w, ..] => InProj::Packed(w),
            [] => InProj::Packed(&self.out_proj_weight), // not reached: one or three weights
        };
        MhaParams {
            in_proj,
            in_proj_bias: self.in_proj_bias.as_ref(),
            bias_k: self.bias_k.as_ref(),
            bias_v: self.bias_v.as_ref(),
            out_proj_weight: &self.out_proj_weight,
            out_proj_bias: self.out_proj_bias.as_ref(),
            ..*p
        }
    }
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
    let mut call =
        validate::validate(query, key, value, alias, params, opts, training, batch_first)?;
    if crate::precision::is_reduced(call.dtype) {
        let dtype = call.dtype;
        if let Some(out) = run_direct_bf16(&mut call, opts, dtype)? {
            return Ok(out);
        }
        let w = Widened::new(query, key, value, alias, params, opts)?;
        let p32 = w.params(params);
        let o = crate::mode::rounded_products(call.dtype, call.macs(), || {
            let (q, k, v) = (&w.q, &w.k, &w.v);
            let c32 = validate::validate(q, k, v, alias, &p32, &w.opts, training, batch_first)?;
            let plan = plan(&c32, &w.opts)?;
            forward_planned(&c32, &w.opts, plan, Some(call.dtype))
        })?;
        return Ok(MhaOutput {
            output: crate::precision::narrow(&o.output, call.dtype)?,
            attn_weights: o
                .attn_weights
                .map(|t| crate::precision::narrow(&t, call.dtype))
                .transpose()?,
        });
    }
    let plan = plan(&call, opts)?;
    forward_planned(&call, opts, plan, None)
}

/// Self-attention of a bf16 module on `x` run as it is, its output projection written in
/// `out` (the call's dtype, or f32 where a Transformer layer's f32 residual sum reads it, as
/// its f32 twin's output projection writes f32), or `None` where the call runs as its f32
/// twin ([`direct_bf16_plan`]). Validated as [`mha_forward_impl`] validates `(x, x, x)`.
pub(crate) fn mha_direct_to(
    x: &Tensor,
    params: &MhaParams,
    opts: &MhaOptions,
    (training, batch_first): (bool, bool),
    out: DType,
) -> Result<Option<MhaOutput>> {
    let alias = Aliasing::of(x, x, x);
    let mut call = validate::validate(x, x, x, alias, params, opts, training, batch_first)?;
    if !crate::precision::is_reduced(call.dtype) {
        return Ok(None);
    }
    run_direct_bf16(&mut call, opts, out)
}

/// [`forward_planned`] on a validated bf16 call where [`direct_bf16_plan`] takes it, the
/// output projection writing `out`; `None` (and `call` as it was) elsewhere.
fn run_direct_bf16(call: &mut MhaCall, opts: &MhaOptions, out: DType) -> Result<Option<MhaOutput>> {
    let Some(plan) = direct_bf16_plan(call, opts)? else {
        return Ok(None);
    };
    // The additive masks in f32, as the kernels read them: the values the widened call's
    // masks have.
    call.attn_mask = crate::precision::widen_opt(call.attn_mask.as_ref())?;
    call.kpm = crate::precision::widen_opt(call.kpm.as_ref())?;
    let dtype = call.dtype;
    let macs = call.macs();
    crate::mode::rounded_products(dtype, macs, || forward_planned(call, opts, plan, Some(out)))
        .map(Some)
}

/// The plan of a bf16 call that runs as it is, bf16 in and out, without widening its inputs
/// and parameters into an f32 twin: where the twin would read nothing but bf16 values anyway.
/// That is the twin's bf16 route ([`bf16_projection`]: self-attention without a gradient,
/// weights, dropout or grouped heads, on the fused path, with bf16 products), with more rows
/// than the few-rows kernel takes (whose f32 sums run in another order than the bf16 GEMM's).
/// Its projections then multiply the bf16 input and weights as they are, the attention reads
/// the bf16 projection as the twin's does, and the output projection writes bf16: the twin's
/// bits, without the conversions (a tenth of a causal bf16 call on an AMX CPU). `None`
/// elsewhere: the call runs as its f32 twin.
fn direct_bf16_plan(call: &MhaCall, opts: &MhaOptions) -> Result<Option<Plan>> {
    let rows = call.n.saturating_mul(call.l);
    let direct = call.dtype == DType::BF16
        && crate::mode::bf16_products_at(call.macs())
        && rows > multihead_kernels::gemv::MAX_ROWS
        && bf16_route(call);
    if !direct {
        return Ok(None);
    }
    let blocker = crate::fused::dispatch::f32_or_bf16_blocker(&call.query);
    let plan = decide(MHA, opts.backend, blocker)?;
    Ok((plan.path == Path::Fused).then_some(plan))
}

/// The computation of a validated call on `plan`'s path: in f32 (an f32 call, or a bf16/f16
/// call's f32 twin), or a bf16 call as it is ([`direct_bf16_plan`]). `narrow_to` is the dtype
/// of the bf16/f16 module: its output is rounded to that dtype next, so the output projection
/// may write it so directly (`crate::linear::linear_to`).
fn forward_planned(
    call: &MhaCall,
    opts: &MhaOptions,
    plan: Plan,
    narrow_to: Option<DType>,
) -> Result<MhaOutput> {
    if call.n == 0 || call.l == 0 {
        return empty_output(call);
    }
    let dropout = (call.dropout_p > 0.0)
        .then(|| (call.dropout_p, opts.dropout_key.unwrap_or_else(next_dropout_key)));
    let bf16_qkv = bf16_projection(call, &plan);
    let proj = project::project(call, bf16_qkv)?;
    let (attn, weights) = match plan.path {
        Path::Fused => fused::attend(call, &proj, dropout)?,
        Path::Composed => composed::attend(call, proj, dropout)?,
    }; // attn: (L, N, E), or (N, L, E) with batch_first
    let p = call.params;
    let (w, b) = (p.out_proj_weight, p.out_proj_bias);
    // The attention's output is bf16 where the projection was ([`bf16_projection`]).
    let out = match (narrow_to, attn.dtype() == call.dtype) {
        (None, true) => linear(&attn, w, b, MHA, "attn_output", call.backend)?,
        (to, _) => {
            let dtype = to.unwrap_or(call.dtype);
            crate::linear::linear_to(&attn, w, b, (MHA, "attn_output"), call.backend, dtype)?
        }
    };
    finish(call, out, weights)
}

/// Whether the f32 twin of a bf16 module (an MHA or a layer, inside
/// [`rounded_products`](crate::mode::rounded_products)) writes self-attention's packed q/k/v
/// projection as bf16 for the fused kernel to read as it is
/// (`multihead_kernels::attention::flash_forward_bf16_uninit`): the same numbers as the f32
/// projection, which the kernel's bf16 products round to those bits, with half the bytes
/// written and read and no rounding in the packing. Only where that kernel takes the call as
/// a whole: without a gradient, weights, dropout, extra or static keys, a mask that requires
/// grad, sinks, or grouped heads (which keep f32 products, as PyTorch's math path has them).
/// The attention's output is then bf16 too (rounded once, as the output projection's packing
/// would round it), and the output projection reads it as it is.
fn bf16_projection(call: &MhaCall, plan: &Plan) -> bool {
    crate::mode::in_rounded_products()
        && call.dtype == DType::F32
        && plan.path == Path::Fused
        && bf16_route(call)
}

/// Whether the call's inputs and options admit the bf16 route of [`bf16_projection`]:
/// self-attention through one packed in-projection, without a gradient, weights, dropout,
/// extra or static keys, learned masks, sinks or grouped heads.
fn bf16_route(call: &MhaCall) -> bool {
    let p = call.params;
    !records_grad(call)
        && call.dropout_p == 0.0
        && !call.need_weights
        && call.static_kv.is_none()
        && p.bias_k.is_none()
        && !p.add_zero_attn
        && call.learned_masks == [false, false]
        && call.sinks.is_none()
        && call.hk == call.h
        && call.alias.key_is_query
        && call.alias.value_is_key
        && matches!(p.in_proj, InProj::Packed(_))
}

/// Drops the batch of one of unbatched input (step 14).
fn finish(call: &MhaCall, output: Tensor, weights: Option<Tensor>) -> Result<MhaOutput> {
    if !call.unbatched {
        return Ok(MhaOutput { output, attn_weights: weights });
    }
    Ok(MhaOutput {
        output: output.squeeze(1)?,
        attn_weights: match weights {
            Some(w) => Some(w.squeeze(0)?),
            None => None,
        },
    })
}

impl MhaParams<'_> {
    /// Every parameter tensor given.
    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        let mut v = match self.in_proj {
            InProj::Packed(w) => vec![w],
            InProj::Separate { q, k, v } => vec![q, k, v],
        };
        v.extend(
            [self.in_proj_bias, self.bias_k, self.bias_v, self.out_proj_bias].into_iter().flatten(),
        );
        v.push(self.out_proj_weight);
        v
    }
}

/// An empty batch or query: nothing to compute (PyTorch returns empty tensors). The output
/// stays in the graph, so that the inputs and every parameter get (zero) gradients.
fn empty_output(call: &MhaCall) -> Result<MhaOutput> {
    let (n, l, e, h, dtype, dev) =
        (call.n, call.l, call.e, call.h, call.dtype, call.query.device());
    let mut inputs = vec![&call.query, &call.key, &call.value];
    inputs.extend(call.params.tensors());
    if let Some((k, v)) = &call.static_kv {
        inputs.extend([k, v]);
    }
    inputs.extend(call.kpm.iter().chain(&call.attn_mask));
    let dims = if call.batch_first { [n, l, e] } else { [l, n, e] };
    let output = crate::fused::zeros::zeros_of(&dims, dtype, &inputs)?;
    let s2 = call.s_total();
    let weights = match (call.need_weights, call.average_attn_weights) {
        (false, _) => None,
        (true, true) => Some(Tensor::zeros((n, l, s2), dtype, dev)?),
        (true, false) => Some(Tensor::zeros((n, h, l, s2), dtype, dev)?),
    };
    finish(call, output, weights)
}
