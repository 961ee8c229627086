//! Incremental decoding with [`MultiheadAttention`]: cached causal self-attention over a
//! [`KvCache`], and cross-attention over a memory projected once ([`StaticKv`]).
//!
//! Validate, then plan, then run, like every other call: [`Step`] is the validated call,
//! `plan_step` the one decision between the fused decode kernel and the composed candle path.

use candle_core::{DType, Tensor};

use super::MultiheadAttention;
use crate::error::{fmt_shape, Error, Result};
use crate::functional::core::{attention_core, ScoreMasks};
use crate::functional::MhaOptions;
use crate::fused::decode::DecodeOp;
use crate::fused::dispatch::{decide, f32_or_bf16_blocker, Path, Plan};
use crate::kv_cache::KvCache;
use crate::linear::linear;
use crate::mask::Mask;
use crate::mode::Backend;

const CACHED: &str = "MultiheadAttention::forward_cached";
const STATIC: &str = "MultiheadAttention::static_kv";

/// The keys and values of a cross-attention memory, projected once: PyTorch's `static_k` and
/// `static_v`, `(N·Hkv, S, D)`, with the memory they came from.
///
/// Made by [`MultiheadAttention::static_kv`]; used by
/// [`MultiheadAttention::forward_static`] (or [`MhaOptions::static_kv`]) at every decoding
/// step, so the memory is not projected again.
#[derive(Clone, Debug)]
pub struct StaticKv {
    /// `static_k`, `(N·Hkv, S, D)`.
    pub k: Tensor,
    /// `static_v`, `(N·Hkv, S, D)`.
    pub v: Tensor,
    /// The memory, in the module's layout; passed as `key` and `value` for their shape checks.
    pub memory: Tensor,
}

/// The weight and bias of each product that projects a cached step's tokens.
enum StepProducts<'a> {
    /// One packed `(3E, E)` product.
    Packed((&'a Tensor, Option<Tensor>)),
    /// The q, k and v products.
    Three([(&'a Tensor, Option<Tensor>); 3]),
}

/// Options of [`MultiheadAttention::forward_cached_with`]: the variants the decode kernel
/// runs. The default is plain causal attention (what [`forward_cached`](MultiheadAttention::forward_cached) does).
///
/// # Example
/// ```
/// use multihead::multihead_attention::CachedOptions;
/// let o = CachedOptions::default().softcap(50.0).alibi(multihead::Variants::alibi_slopes_for(4));
/// assert_eq!(o.softcap, Some(50.0));
/// assert_eq!(o.alibi_slopes.as_ref().map(Vec::len), Some(4));
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct CachedOptions {
    /// Tanh soft cap of the scaled scores, `c·tanh(q·kᵀ/√D / c)` (Gemma 2); finite, positive.
    pub softcap: Option<f64>,
    /// Attention sinks (gpt-oss), one logit per query head, `(H,)`: they join every row's
    /// softmax denominator. Values only (the cached path is inference).
    pub sinks: Option<Tensor>,
    /// ALiBi slopes, one per query head (BLOOM, MPT; [`Variants::alibi_slopes_for`](crate::Variants::alibi_slopes_for)
    /// gives the paper's): the token at position `p` adds `−m_h·(p − j)` to its score of the
    /// cached token at position `j`, as `Variants::alibi` does in the full causal forward.
    /// Full caches only (a sliding cache's slots do not keep positions).
    pub alibi_slopes: Option<Vec<f64>>,
    /// A left window over a full cache, as `MhaOptions::window(Some(left), None)`: the token at
    /// position `p` sees the cached tokens `p − left ..= p` (`left + 1` tokens, what a sliding
    /// cache of `left + 1` holds, but decoded in chunks and over a cache that keeps every
    /// token, Gemma 2's local layers beside its global ones). Keys before the window are
    /// never read.
    pub window: Option<usize>,
}

impl CachedOptions {
    /// Sets the soft cap.
    pub fn softcap(mut self, c: f64) -> Self {
        self.softcap = Some(c);
        self
    }
    /// Sets the sinks, `(H,)`.
    pub fn sinks(mut self, sinks: Tensor) -> Self {
        self.sinks = Some(sinks);
        self
    }
    /// Sets the ALiBi slopes, one per query head.
    pub fn alibi(mut self, slopes: Vec<f64>) -> Self {
        self.alibi_slopes = Some(slopes);
        self
    }
    /// Sets the left window.
    pub fn window(mut self, left: usize) -> Self {
        self.window = Some(left);
        self
    }
}

/// A validated cached call.
struct Step {
    /// The input with a batch dimension, in the module's layout.
    x: Tensor,
    unbatched: bool,
    batch_first: bool,
    n: usize,
    t: usize,
    /// New tokens per row.
    counts: Vec<usize>,
    /// The soft cap and the sinks' values (`CachedOptions`, checked; the kernel takes them in
    /// f32, an f64 module's composed path in f64).
    softcap: Option<f64>,
    sinks: Option<Vec<f64>>,
    /// ALiBi slopes (checked; the kernel takes them in f32, an f64 module's composed path in
    /// f64).
    alibi: Option<Vec<f64>>,
    /// The left window (a full cache).
    window: Option<usize>,
}

/// Which keys each new row sees (the decode kernel's rule, for the composed path).
struct Rows {
    kv_len: Vec<usize>,
    q_pos: Vec<usize>,
    q_len: Vec<usize>,
    causal: bool,
    window: Option<usize>,
}

impl Rows {
    /// The decode kernel's rule, shared: row `t` of entry `b` sees keys
    /// `first(b, t)..visible(b, t)`.
    fn visible(&self, b: usize, t: usize) -> usize {
        let (kv, pos, len) = (self.kv_len[b], self.q_pos[b], self.q_len[b]);
        multihead_kernels::decode::visible_keys(self.causal, kv, pos, len, t)
    }

    fn first(&self, b: usize, t: usize) -> usize {
        multihead_kernels::decode::first_key(self.window, self.q_pos[b], t)
    }
}

fn config_err(arg: &'static str, msg: String) -> Error {
    Error::Config { op: CACHED, arg, msg }
}

impl MultiheadAttention {
    /// An empty [`KvCache`] for this module: `batch` rows of up to `capacity` tokens, with the
    /// module's key/value heads, head size, dtype and device.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache> {
        let w = self.out_proj.weight();
        let (hk, hd) = (self.cfg.kv_heads(), self.cfg.head_dim());
        KvCache::new(batch, hk, hd, capacity, w.dtype(), w.device())
    }

    /// An empty sliding-window [`KvCache`]: each token attends to the last `window` tokens
    /// (itself included).
    pub fn new_sliding_cache(&self, batch: usize, window: usize) -> Result<KvCache> {
        let w = self.out_proj.weight();
        let (hk, hd) = (self.cfg.kv_heads(), self.cfg.head_dim());
        KvCache::sliding_window(batch, hk, hd, window, w.dtype(), w.device())
    }

    /// The module settings a cached call cannot run with.
    fn check_cached_config(&self) -> Result<()> {
        let cfg = &self.cfg;
        if !cfg.packed() && (cfg.kdim() != cfg.embed_dim || cfg.vdim() != cfg.embed_dim) {
            return Err(config_err(
                "kdim",
                format!(
                    "cached self-attention projects the new tokens as keys and values, so kdim and \
                     vdim must equal embed_dim ({}), got kdim={} and vdim={}",
                    cfg.embed_dim,
                    cfg.kdim(),
                    cfg.vdim()
                ),
            ));
        }
        if cfg.add_bias_kv || cfg.add_zero_attn {
            return Err(config_err(
                if cfg.add_bias_kv { "add_bias_kv" } else { "add_zero_attn" },
                "cached decoding does not support add_bias_kv or add_zero_attn (they append keys \
                 after the sequence, which a growing cache cannot keep last); use forward"
                    .into(),
            ));
        }
        if self.training && cfg.dropout > 0.0 {
            return Err(config_err(
                "dropout",
                format!(
                    "cached decoding is inference: the module is in training mode with dropout={}; \
                     call eval() first",
                    cfg.dropout
                ),
            ));
        }
        Ok(())
    }

    /// The checks of a cached call on `x` (its dtype, shape and batch against the module and
    /// the cache, `lengths`, the options), without running it: a decoder layer makes them
    /// before its cross-attention reads the step, so that an error names the step's input.
    pub(crate) fn check_cached(
        &self,
        x: &Tensor,
        cache: &KvCache,
        lengths: Option<&[usize]>,
        opts: &CachedOptions,
    ) -> Result<()> {
        let step = self.validate_step(x, cache, lengths, opts)?;
        // The plan's size checks too (the composed path's copies), as the call makes them.
        self.plan_step(&step, cache).map(|_| ())
    }

    /// Checks a cached call once, before anything is written.
    fn validate_step(
        &self,
        x: &Tensor,
        cache: &KvCache,
        lengths: Option<&[usize]>,
        opts: &CachedOptions,
    ) -> Result<Step> {
        self.check_cached_config()?;
        let cfg = &self.cfg;
        let dtype = self.dtype();
        if x.dtype() != dtype {
            return Err(Error::DType {
                op: CACHED,
                arg: "x",
                msg: format!("x has dtype {:?} but the module has {dtype:?}; convert it with .to_dtype(DType::{dtype:?})", x.dtype()),
            });
        }
        let (x3, unbatched) = match x.rank() {
            2 => (x.unsqueeze(1)?, true),
            3 => (x.clone(), false),
            r => {
                return Err(Error::Shape {
                    op: CACHED,
                    arg: "x",
                    msg: format!(
                        "expected a 2-D (T, E) or 3-D input, got {r}-D {}",
                        fmt_shape(x.dims())
                    ),
                })
            }
        };
        let batch_first = cfg.batch_first && !unbatched;
        let (a, b, e) = x3.dims3()?;
        let (t, n) = if batch_first { (b, a) } else { (a, b) };
        if e != cfg.embed_dim {
            return Err(Error::Shape {
                op: CACHED,
                arg: "x",
                msg: format!(
                    "expected {} features (embed_dim), got x of shape {}",
                    cfg.embed_dim,
                    fmt_shape(x.dims())
                ),
            });
        }
        let device = self.out_proj.weight().device();
        cache.check_fits(CACHED, (n, cfg.kv_heads(), cfg.head_dim()), dtype, device)?;
        let counts = match lengths {
            None => vec![t; n],
            Some(l) => {
                if l.len() != n || l.iter().any(|&c| c > t) {
                    return Err(Error::Shape {
                        op: CACHED,
                        arg: "lengths",
                        msg: format!("expected {n} lengths of at most T={t} new tokens, got {l:?}"),
                    });
                }
                l.to_vec()
            }
        };
        cache.check_room(CACHED, &counts)?;
        let (softcap, sinks) = self.check_cached_options(opts)?;
        let alibi = self.check_cached_alibi(opts, cache)?;
        if let (Some(left), Some(w)) = (opts.window, cache.window()) {
            let msg = format!(
                "a sliding cache (window {w}) has its window already; pass window {left} with a full cache (new_cache), or leave it out"
            );
            return Err(config_err("window", msg));
        }
        let window = opts.window;
        Ok(Step { x: x3, unbatched, batch_first, n, t, counts, softcap, sinks, alibi, window })
    }

    /// The soft cap (finite, positive) and the sinks (`(H,)`) of a cached call.
    fn check_cached_options(
        &self,
        opts: &CachedOptions,
    ) -> Result<(Option<f64>, Option<Vec<f64>>)> {
        if let Some(c) = opts.softcap {
            if !(c.is_finite() && c > 0.0 && (c as f32).is_finite() && c as f32 > 0.0) {
                let msg = format!(
                    "the soft cap must be positive and finite, also in f32 (the kernels' \
                     precision, where it must not round to 0 or overflow), got {c:?}; pass None \
                     to turn it off"
                );
                return Err(config_err("softcap", msg));
            }
        }
        let h = self.cfg.num_heads;
        let sinks = match &opts.sinks {
            Some(t) if t.dims() != [h] => {
                let msg =
                    format!("expected one sink per head, shape [{h}], got {}", fmt_shape(t.dims()));
                return Err(Error::Shape { op: CACHED, arg: "sinks", msg });
            }
            Some(t) => {
                // Learned logits: an integer tensor is a mistake, not something to convert.
                crate::alloc::expect_float(CACHED, "sinks", t.dtype())?;
                Some(t.to_dtype(DType::F64)?.to_vec1::<f64>()?)
            }
            None => None,
        };
        Ok((opts.softcap, sinks))
    }

    /// The ALiBi slopes of a cached call: one finite (in f32) slope per query head, over a
    /// full cache.
    fn check_cached_alibi(
        &self,
        opts: &CachedOptions,
        cache: &KvCache,
    ) -> Result<Option<Vec<f64>>> {
        let Some(m) = &opts.alibi_slopes else { return Ok(None) };
        let h = self.cfg.num_heads;
        if m.len() != h {
            let msg = format!("expected one slope per query head (H = {h}), got {}", m.len());
            return Err(config_err("alibi_slopes", msg));
        }
        if let Some((i, x)) = m.iter().enumerate().find(|(_, x)| !(**x as f32).is_finite()) {
            let msg = format!("the slope of head {i} is {x}; slopes must be finite (in f32)");
            return Err(config_err("alibi_slopes", msg));
        }
        if let Some(w) = cache.window() {
            let msg = format!(
                "ALiBi needs each cached token's position, which a sliding cache (window {w}) does not keep; use a full cache (new_cache)"
            );
            return Err(config_err("alibi_slopes", msg));
        }
        Ok(Some(m.clone()))
    }

    /// The one decision of a cached call: the fused decode kernel (f32 or bf16 on the CPU; a
    /// bf16 cache is read as bf16 and widened in registers) or the composed candle path.
    fn plan_step(&self, step: &Step, cache: &KvCache) -> Result<Plan> {
        let plan = decide(CACHED, Backend::Auto, f32_or_bf16_blocker(&step.x))?;
        if plan.path == Path::Composed {
            self.ensure_composed_step(step, cache)?;
        }
        Ok(plan)
    }

    /// The composed path's largest per-row tensors (the additive mask, one per head with
    /// ALiBi, built in f64 and converted; the scores and probabilities), checked before the
    /// cache changes: by the call and by [`explain_cached`](Self::explain_cached) alike. (They
    /// were checked after the append, which left the tokens in the cache of a call that
    /// failed; and the scores not at all.)
    fn ensure_composed_step(&self, step: &Step, cache: &KvCache) -> Result<()> {
        let (h, dtype) = (self.cfg.num_heads, step.x.dtype());
        let cd = if crate::precision::is_reduced(dtype) { DType::F32 } else { dtype };
        let mh = step.alibi.as_ref().map_or(1, Vec::len);
        // The largest row: the most new tokens, over the most keys after the append (a sliding
        // cache attends one token at a time over at most its window).
        let rows = step.counts.iter().zip(cache.lens());
        let (tl, kv_len) = match cache.window() {
            None => rows.fold((0, 0), |(t, s), (&c, &l)| (t.max(c), s.max(l.saturating_add(c)))),
            Some(_) => (usize::from(step.counts.iter().any(|&c| c > 0)), cache.capacity()),
        };
        let hint = "decode in shorter chunks, or use the fused f32 path";
        crate::alloc::ensure(CACHED, "attention mask", &[mh, tl, kv_len], DType::F64, 2, hint)?;
        crate::alloc::ensure(CACHED, "attention scores", &[h, tl, kv_len], cd, 2, hint)
    }

    /// The path [`forward_cached`](Self::forward_cached) takes, and why, without running it or
    /// touching the cache. Bad arguments give the error the call would.
    ///
    /// # Shapes
    /// * x: as for [`forward_cached`](Self::forward_cached): `(T, N, E)`, `(N, T, E)` with
    ///   `batch_first`, or `(T, E)`.
    pub fn explain_cached(
        &self,
        x: &Tensor,
        cache: &KvCache,
        lengths: Option<&[usize]>,
    ) -> Result<Plan> {
        let step = self.validate_step(x, cache, lengths, &CachedOptions::default())?;
        let plan = self.plan_step(&step, cache)?;
        // The sizes the call checks before it allocates: its projections' copies and outputs.
        self.ensure_projection(&step.x)?;
        Ok(plan)
    }

    /// Incremental causal self-attention: attends the new tokens `x` over the cached tokens and
    /// themselves, appends their keys and values to `cache`, and returns their outputs.
    ///
    /// At every step the output equals `forward(p, p, p)` with a causal mask over the whole
    /// prefix `p` (every token so far), at the new positions, within rounding (the tests check
    /// 1e-6 in f32 over hundreds of steps). `lengths[b]` (default `T`) says how many of row
    /// `b`'s `T` new tokens are real: the rest are padding, are not cached, and their output
    /// rows are `out_proj.bias`. With a sliding cache, each token sees the last `window` tokens.
    ///
    /// This is inference: it runs without an autograd graph (as inside [`no_grad`](crate::no_grad)),
    /// needs eval mode when `dropout > 0`, and does not support `add_bias_kv`/`add_zero_attn`.
    /// A cache that is full is an [`Error::CacheFull`] and is left unchanged.
    ///
    /// # Shapes
    /// * x: `(T, N, E)`, `(N, T, E)` with `batch_first`, or `(T, E)` unbatched; output alike.
    /// * cache: `(N, Hkv, C, D)` from [`new_cache`](Self::new_cache).
    ///
    /// See [`KvCache`] for an example.
    // Mirrors torch.nn.MultiheadAttention.forward(x, x, x, attn_mask=causal, need_weights=False)
    // at the new positions of the sequence.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        self.forward_cached_with(x, cache, lengths, &CachedOptions::default())
    }

    /// [`forward_cached`](Self::forward_cached) with a soft cap, attention sinks, ALiBi
    /// slopes and a left window ([`CachedOptions`]; a sliding cache,
    /// [`new_sliding_cache`](Self::new_sliding_cache), has a window of its own). The decode
    /// kernel applies them, the composed path too; at every step the output equals a full
    /// forward with the same variants (`softcap`, `sinks`, `alibi`, `window` of
    /// [`MhaOptions`]) over the prefix. ALiBi and `window` need a
    /// full cache ([`new_cache`](Self::new_cache)).
    ///
    /// # Shapes
    /// * As for [`forward_cached`](Self::forward_cached); sinks `(H,)`.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::multihead_attention::CachedOptions;
    /// use multihead::{MhaConfig, MultiheadAttention};
    ///
    /// let vm = VarMap::new();
    /// let mut m = MultiheadAttention::new(MhaConfig::new(8, 2), VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
    /// m.eval();
    /// let mut cache = m.new_cache(1, 16)?;
    /// let sinks = Tensor::new(&[0.5f32, -1.0], &Device::Cpu)?;
    /// let opts = CachedOptions::default().softcap(30.0).sinks(sinks);
    /// let x = Tensor::randn(0f32, 1.0, (3, 1, 8), &Device::Cpu)?; // (T, N, E)
    /// let y = m.forward_cached_with(&x, &mut cache, None, &opts)?;
    /// assert_eq!(y.dims(), &[3, 1, 8]);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.MultiheadAttention.forward over the prefix with a soft cap, sinks, ALiBi
    // or a sliding window (Gemma 2, gpt-oss, BLOOM, Mistral) at the new positions.
    pub fn forward_cached_with(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        lengths: Option<&[usize]>,
        opts: &CachedOptions,
    ) -> Result<Tensor> {
        let step = self.validate_step(x, cache, lengths, opts)?;
        let plan = self.plan_step(&step, cache)?;
        let macs = self.step_macs(step.n.saturating_mul(step.t), cache);
        // One hop for the step's products and its cache read (the pool's parallel tasks
        // then run without a wake-up and a sleep each); a short step stays on the caller.
        crate::pool::on_pool_for(macs, || {
            crate::mode::no_grad(|| self.run_step(&step, &plan, cache))
        })
    }

    /// The multiply-adds of the largest operation of a cached step of `rows` new tokens over
    /// `cache` (as many per sequence): the q/k/v projection, or the scores and weighted
    /// values over the keys the cache holds after the step (for [`crate::pool`]'s hop).
    pub(crate) fn step_macs(&self, rows: usize, cache: &KvCache) -> usize {
        let t = rows / cache.batch_size().max(1);
        let (e, kv) = (self.cfg.embed_dim, self.cfg.kv_dim());
        let project = crate::pool::product_macs(rows, e, e.saturating_add(kv.saturating_mul(2)));
        let held = cache.lens().iter().copied().max().unwrap_or(0).saturating_add(t);
        let keys = cache.window().map_or(held, |w| held.min(w.saturating_add(t)));
        let per_key = self.cfg.head_dim().saturating_mul(2);
        let attend = rows.saturating_mul(self.cfg.num_heads).saturating_mul(keys);
        project.max(attend.saturating_mul(per_key))
    }

    fn run_step(&self, step: &Step, plan: &Plan, cache: &mut KvCache) -> Result<Tensor> {
        let (q, k, v) = self.project_step(&step.x)?;
        // `(N, T, Hk·D)` views of the projections: the append reads them in place.
        let (k, v) = match step.batch_first {
            true => (k, v),
            false => (k.transpose(0, 1)?, v.transpose(0, 1)?),
        };
        let attn = if cache.window().is_none() {
            let q_pos = cache.lens().to_vec();
            cache.append(&k, &v, &step.counts)?;
            let rows = Rows {
                kv_len: cache.lens().to_vec(),
                q_pos,
                q_len: step.counts.clone(),
                causal: true,
                window: step.window,
            };
            self.attend_cache(&q, cache, &rows, step, plan)?
        } else {
            // A ring buffer: one token at a time, each over the window that ends at it.
            let seq_dim = if step.batch_first { 1 } else { 0 };
            let mut outs = Vec::with_capacity(step.t);
            for i in 0..step.t {
                let counts: Vec<usize> = step.counts.iter().map(|&c| usize::from(i < c)).collect();
                cache.append(&k.narrow(1, i, 1)?, &v.narrow(1, i, 1)?, &counts)?;
                let rows = Rows {
                    kv_len: cache.lens().to_vec(),
                    q_pos: vec![0; step.n],
                    q_len: counts,
                    causal: false,
                    window: None,
                };
                outs.push(self.attend_cache(
                    &q.narrow(seq_dim, i, 1)?,
                    cache,
                    &rows,
                    step,
                    plan,
                )?);
            }
            match outs.is_empty() {
                // No new tokens: the empty output a full cache gives (candle cannot cat
                // nothing).
                true => q.narrow(seq_dim, 0, 0)?.zeros_like()?,
                false => Tensor::cat(&outs, seq_dim)?,
            }
        };
        let p = self.params()?;
        let out = linear(
            &attn,
            p.out_proj_weight,
            p.out_proj_bias,
            CACHED,
            "attn_output",
            Backend::Auto,
        )?;
        Ok(if step.unbatched { out.squeeze(1)? } else { out })
    }

    /// The weights and biases of the step's projections: one packed product, or the q, k and
    /// v products.
    fn step_products(&self) -> Result<StepProducts<'_>> {
        let (e, kv) = (self.cfg.embed_dim, self.cfg.kv_dim());
        let b = self.in_proj_bias.as_ref();
        let bias = |s: usize, l: usize| -> Result<Option<Tensor>> {
            Ok(match b {
                Some(b) => Some(b.narrow(0, s, l)?),
                None => None,
            })
        };
        if let Some(w) = &self.in_proj_weight {
            return Ok(StepProducts::Packed((w, b.cloned())));
        }
        let (Some(wq), Some(wk), Some(wv)) =
            (&self.q_proj_weight, &self.k_proj_weight, &self.v_proj_weight)
        else {
            return Err(config_err(
                "in_proj_weight",
                "the module has no projection weights".into(),
            ));
        };
        Ok(StepProducts::Three([(wq, bias(0, e)?), (wk, bias(e, kv)?), (wv, bias(e + kv, kv)?)]))
    }

    /// The q, k and v projections of the new tokens, in the module's layout (as `forward`
    /// projects self-attention: one packed product when the weight is packed).
    fn project_step(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let e = self.cfg.embed_dim;
        let run = |(w, b): &(&Tensor, Option<Tensor>)| {
            linear(x, w, b.as_ref(), CACHED, "x", Backend::Auto)
        };
        match self.step_products()? {
            StepProducts::Packed(packed) => {
                let qkv = run(&packed)?;
                Ok((qkv.narrow(2, 0, e)?, qkv.narrow(2, e, e)?, qkv.narrow(2, 2 * e, e)?))
            }
            StepProducts::Three([q, k, v]) => Ok((run(&q)?, run(&k)?, run(&v)?)),
        }
    }

    /// What [`project_step`](Self::project_step) checks before it allocates, in its order
    /// (for [`explain_cached`](Self::explain_cached)).
    fn ensure_projection(&self, x: &Tensor) -> Result<()> {
        let check = |(w, b): &(&Tensor, Option<Tensor>)| {
            crate::linear::ensure_linear(x, w, b.as_ref(), (CACHED, "x"), x.dtype())
        };
        match self.step_products()? {
            StepProducts::Packed(p) => check(&p),
            StepProducts::Three(ps) => ps.iter().try_for_each(check),
        }
    }

    /// Attention of `q` (module layout) over the cache, by the planned path.
    fn attend_cache(
        &self,
        q: &Tensor,
        cache: &KvCache,
        rows: &Rows,
        step: &Step,
        plan: &Plan,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        if plan.path == Path::Fused {
            let op = DecodeOp {
                heads: cfg.num_heads,
                heads_kv: cfg.kv_heads(),
                head_dim: cfg.head_dim(),
                batch_first: step.batch_first,
                causal: rows.causal,
                kv_len: rows.kv_len.clone(),
                q_pos: rows.q_pos.clone(),
                q_len: rows.q_len.clone(),
                softcap: step.softcap.map(|c| c as f32),
                sinks: step.sinks.as_ref().map(|s| s.iter().map(|&x| x as f32).collect()),
                alibi: step.alibi.as_ref().map(|m| m.iter().map(|&x| x as f32).collect()),
                window: rows.window,
            };
            return Ok(q.apply_op3_no_bwd(cache.keys(), cache.values(), &op)?);
        }
        self.attend_cache_composed(q, cache, rows, step)
    }

    /// The composed path: per row, softmax attention over its valid cache slots in candle
    /// operations, with the causal rule as an additive mask.
    fn attend_cache_composed(
        &self,
        q: &Tensor,
        cache: &KvCache,
        rows: &Rows,
        step: &Step,
    ) -> Result<Tensor> {
        let (batch_first, cap) = (step.batch_first, step.softcap.map(|c| (c, false)));
        let cfg = &self.cfg;
        let (h, hk, hd, e) = (cfg.num_heads, cfg.kv_heads(), cfg.head_dim(), cfg.embed_dim);
        let q = if batch_first { q.clone() } else { q.transpose(0, 1)? }; // (N, T, E)
        let (n, t, _) = q.dims3()?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut outs = Vec::with_capacity(n);
        for b in 0..n {
            // Only the entry's new tokens attend; its padding rows stay zero (not attended: a
            // NaN there must not reach them, as in the fused kernel, which skips them).
            let (kv_len, tl) = (rows.kv_len[b], rows.q_len[b].min(t));
            let qb = q.get(b)?.narrow(0, 0, tl)?;
            let qb = qb.reshape((tl, h, hd))?.transpose(0, 1)?.contiguous()?; // (H, Tb, D)
            let expand = |c: &Tensor| -> Result<Tensor> {
                let c = c.get(b)?.narrow(1, 0, kv_len)?; // (Hk, S, D)
                let c = c.reshape((hk, 1, kv_len, hd))?.broadcast_as((hk, h / hk, kv_len, hd))?;
                Ok(c.contiguous()?.reshape((h, kv_len, hd))?)
            };
            let (kb, vb) = (expand(cache.keys())?, expand(cache.values())?);
            // (1 | H, T, S): hidden keys -inf, visible ones 0 or their ALiBi bias (in f64, as
            // the full forward's composed path forms it; rounded to the attention's dtype).
            let slopes = step.alibi.clone().unwrap_or_else(|| vec![0.0]);
            let mh = slopes.len();
            // (A mask per head with ALiBi: checked with the scores before the cache changed,
            // `ensure_composed_step`.)
            let mask: Vec<f64> = slopes
                .iter()
                .flat_map(|&m| (0..tl).map(move |i| (m, i)))
                .flat_map(|(m, i)| {
                    let (seen, pos) = (rows.first(b, i)..rows.visible(b, i), rows.q_pos[b] + i);
                    (0..kv_len).map(move |j| match seen.contains(&j) {
                        true => -m * (pos as f64 - j as f64).abs(),
                        false => f64::NEG_INFINITY,
                    })
                })
                .collect();
            // bf16/f16 attend in f32 and round once, as every operation here does.
            let cd = if crate::precision::is_reduced(q.dtype()) { DType::F32 } else { q.dtype() };
            let (qb, kb, vb) = (qb.to_dtype(cd)?, kb.to_dtype(cd)?, vb.to_dtype(cd)?);
            let mask = Tensor::from_vec(mask, (mh, tl, kv_len), q.device())?.to_dtype(cd)?;
            let sinks = match &step.sinks {
                Some(s) => Some(Tensor::from_vec(s.clone(), (h, 1, 1), q.device())?.to_dtype(cd)?),
                None => None,
            };
            let score = (scale, cap, sinks.as_ref());
            let masks = ScoreMasks { add: Some(&mask), masked: true, hide: None };
            let (o, _) = attention_core(&qb, &kb, &vb, masks, score, None, false)?;
            let o = o.to_dtype(q.dtype())?.transpose(0, 1)?.reshape((tl, e))?;
            outs.push(match tl < t {
                true => Tensor::cat(&[o, Tensor::zeros((t - tl, e), q.dtype(), q.device())?], 0)?,
                false => o,
            });
        }
        // No rows: an empty batch of the right shape (candle cannot stack nothing).
        let out = match outs.is_empty() {
            true => Tensor::zeros((0, t, e), q.dtype(), q.device())?,
            false => Tensor::stack(&outs, 0)?,
        };
        Ok(if batch_first { out } else { out.transpose(0, 1)? })
    }

    /// Projects a cross-attention memory once into PyTorch's `static_k`/`static_v`
    /// `(N·Hkv, S, D)`, for [`forward_static`](Self::forward_static) at every decoding step.
    ///
    /// # Shapes
    /// * memory: `(S, N, kdim)` (`kdim = vdim`), `(N, S, kdim)` with `batch_first`, or
    ///   `(S, kdim)` unbatched.
    pub fn static_kv(&self, memory: &Tensor) -> Result<StaticKv> {
        let cfg = &self.cfg;
        if cfg.kdim() != cfg.vdim() {
            return Err(Error::Config {
                op: STATIC,
                arg: "memory",
                msg: format!(
                    "one memory serves as key and value, so kdim ({}) must equal vdim ({})",
                    cfg.kdim(),
                    cfg.vdim()
                ),
            });
        }
        if cfg.add_bias_kv {
            return Err(Error::Config {
                op: STATIC,
                arg: "add_bias_kv",
                msg: "bias cannot be added to static key: a module with add_bias_kv cannot use static keys".into(),
            });
        }
        let unbatched = memory.rank() == 2;
        let m3 = if unbatched { memory.unsqueeze(1)? } else { memory.clone() };
        let bf = cfg.batch_first && !unbatched;
        if m3.rank() != 3 || m3.dim(2)? != cfg.kdim() || m3.dtype() != self.dtype() {
            return Err(Error::Shape {
                op: STATIC,
                arg: "memory",
                msg: format!(
                    "expected a 2-D or 3-D {:?} memory with {} features (kdim), got {:?} {}",
                    self.dtype(),
                    cfg.kdim(),
                    memory.dtype(),
                    fmt_shape(memory.dims())
                ),
            });
        }
        let (e, kv, hk, hd) = (cfg.embed_dim, cfg.kv_dim(), cfg.kv_heads(), cfg.head_dim());
        let b = self.in_proj_bias.as_ref();
        let bias = |s: usize| -> Result<Option<Tensor>> {
            Ok(match b {
                Some(b) => Some(b.narrow(0, s, kv)?),
                None => None,
            })
        };
        let (wk, wv) = match (&self.in_proj_weight, &self.k_proj_weight, &self.v_proj_weight) {
            (Some(w), _, _) => (w.narrow(0, e, e)?, w.narrow(0, 2 * e, e)?),
            (None, Some(k), Some(v)) => (k.clone(), v.clone()),
            _ => {
                return Err(Error::Config {
                    op: STATIC,
                    arg: "in_proj_weight",
                    msg: "the module has no projection weights".into(),
                })
            }
        };
        let split = |w: &Tensor, bias: Option<Tensor>| -> Result<Tensor> {
            let p = linear(&m3, w, bias.as_ref(), STATIC, "memory", Backend::Auto)?;
            let p = if bf { p } else { p.transpose(0, 1)? }; // (N, S, kv)
            let (n, s, _) = p.dims3()?;
            Ok(p.contiguous()?
                .reshape((n, s, hk, hd))?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((n * hk, s, hd))?)
        };
        Ok(StaticKv {
            k: split(&wk, bias(e)?)?,
            v: split(&wv, bias(e + kv)?)?,
            memory: memory.clone(),
        })
    }

    /// Cross-attention of `x` over a memory projected once by [`static_kv`](Self::static_kv):
    /// `forward(x, memory, memory, key_padding_mask, need_weights=False, static_k, static_v)`.
    /// Gives the numbers `cross_attention(x, memory, key_padding_mask)` gives.
    ///
    /// # Shapes
    /// * x: `(L, N, E)`, `(N, L, E)` with `batch_first`, or `(L, E)`; key_padding_mask
    ///   `(N, S)` or `(S,)` over the memory's `S` positions; output like x.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor, D};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::{MhaConfig, MultiheadAttention};
    ///
    /// let dev = Device::Cpu;
    /// let vm = VarMap::new();
    /// let cfg = MhaConfig::new(8, 2).with_batch_first(true);
    /// let mha = MultiheadAttention::new(cfg, VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
    /// let memory = Tensor::randn(0f32, 1.0, (2, 6, 8), &dev)?; // (N, S, E)
    /// let x = Tensor::randn(0f32, 1.0, (2, 1, 8), &dev)?; // (N, L, E): one decoding step
    /// let projected = mha.static_kv(&memory)?; // once, reused at every step
    /// let y = mha.forward_static(&x, &projected, None)?;
    /// let z = mha.cross_attention(&x, &memory, None)?;
    /// let diff = (y - z)?.abs()?.max(D::Minus1)?.max_all()?.to_scalar::<f32>()?;
    /// assert!(diff < 1e-6, "{diff}");
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.functional.multi_head_attention_forward(..., static_k=, static_v=).
    pub fn forward_static(
        &self,
        x: &Tensor,
        memory: &StaticKv,
        key_padding_mask: Option<&Mask>,
    ) -> Result<Tensor> {
        let mut opts = MhaOptions::default().need_weights(false);
        opts.key_padding_mask = key_padding_mask.cloned();
        self.forward_static_with(x, memory, &opts)
    }

    /// [`forward_static`](Self::forward_static) with every option of [`MhaOptions`] (masks,
    /// variants, sinks) over the projected memory; `opts.static_k`/`static_v` are replaced by
    /// the memory's. Returns the output only.
    ///
    /// # Shapes
    /// * x: as in [`forward_static`](Self::forward_static); the options' as in
    ///   [`MhaOptions`], `S` the memory's length.
    // Mirrors torch.nn.functional.multi_head_attention_forward(..., static_k=, static_v=),
    // with the attention variants.
    pub fn forward_static_with(
        &self,
        x: &Tensor,
        memory: &StaticKv,
        opts: &MhaOptions,
    ) -> Result<Tensor> {
        let opts = opts.clone().static_kv(memory.k.clone(), memory.v.clone());
        Ok(self.forward(x, &memory.memory, &memory.memory, &opts)?.output)
    }

    /// The path [`forward_static_with`](Self::forward_static_with) takes, and why, without
    /// running it; bad arguments give the error the call would.
    ///
    /// # Shapes
    /// * As in [`forward_static_with`](Self::forward_static_with).
    pub fn explain_static(&self, x: &Tensor, memory: &StaticKv, opts: &MhaOptions) -> Result<Plan> {
        let opts = opts.clone().static_kv(memory.k.clone(), memory.v.clone());
        self.explain(x, &memory.memory, &memory.memory, &opts)
    }

    /// The argument checks of [`forward_static_with`](Self::forward_static_with) alone (no
    /// plan, no widening of a bf16 module's weights): a decoder step runs them before its
    /// self-attention appends to a cache.
    pub(crate) fn validate_static(
        &self,
        x: &Tensor,
        memory: &StaticKv,
        opts: &MhaOptions,
    ) -> Result<()> {
        let opts = opts.clone().static_kv(memory.k.clone(), memory.v.clone());
        let (m, p) = (&memory.memory, self.params()?);
        let alias = crate::functional::Aliasing::of(x, m, m);
        let bf = self.cfg.batch_first;
        crate::functional::mha_validate(x, m, m, alias, &p, &opts, self.training, bf).map(|_| ())
    }
}
