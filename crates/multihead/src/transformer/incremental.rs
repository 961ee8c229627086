//! Incremental decoding through the decoder layers: each layer keeps a [`KvCache`] of its
//! self-attention and the cross-attention keys/values of the memory projected once
//! ([`StaticKv`]), so a step costs the new tokens' projections and one read of the caches.

use candle_core::Tensor;

use super::{
    feed_forward, final_norm, LayerDropout, Transformer, TransformerDecoder,
    TransformerDecoderLayer,
};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::mask::Mask;
use crate::multihead_attention::CachedOptions;
use crate::{MhaOptions, StaticKv};

const STEP: &str = "TransformerDecoder::forward_step";

/// The attention variants of one incremental decoding step through the decoder layers
/// ([`TransformerDecoderLayer::forward_step_with`], [`TransformerDecoder::forward_step_with`],
/// [`Transformer::decode_step_with`]).
///
/// The step equals [`TransformerDecoder::forward_with`] over the whole prefix at the new
/// positions when that call's `self_opts` are causal (`is_causal` with the causal mask, or
/// `window(left, Some(0))`) with the same soft cap, sinks, ALiBi slopes and left window as
/// `self_attn`, and its `cross_opts` are `cross_attn` plus the memory's key padding mask given
/// to [`TransformerDecoder::start`].
///
/// # Example
/// ```
/// use multihead::multihead_attention::CachedOptions;
/// use multihead::transformer::StepOptions;
/// use multihead::{MhaOptions, Variants};
///
/// let opts = StepOptions::default()
///     .self_attn(CachedOptions::default().softcap(50.0).window(4095))
///     .cross_attn(MhaOptions::default().variants(Variants::default().softcap(50.0)));
/// assert_eq!(opts.self_attn.window, Some(4095));
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct StepOptions {
    /// The self-attention over each layer's cache: soft cap, sinks, ALiBi slopes and a left
    /// window ([`CachedOptions`]; the step is causal).
    pub self_attn: CachedOptions,
    /// The cross-attention over the memory: its soft cap (`variants.softcap`), `sinks` and key
    /// lengths (`variants.kv_lengths`), which do not depend on the target position. Masks,
    /// `is_causal`, windows, ALiBi and causal alignment depend on it and are refused (the
    /// memory's key padding mask is given to `start`).
    pub cross_attn: MhaOptions,
}

impl StepOptions {
    /// Sets the self-attention's options.
    pub fn self_attn(mut self, opts: CachedOptions) -> Self {
        self.self_attn = opts;
        self
    }
    /// Sets the cross-attention's options.
    pub fn cross_attn(mut self, opts: MhaOptions) -> Self {
        self.cross_attn = opts;
        self
    }

    /// The options of [`TransformerDecoder::forward_with`] over the whole prefix that steps
    /// with these options equal at the new positions: causal self-attention
    /// (`window(left, Some(0))`) with the same soft cap, ALiBi slopes and sinks, and the
    /// cross-attention's options with the memory's key padding mask.
    ///
    /// # Example
    /// ```
    /// use multihead::multihead_attention::CachedOptions;
    /// use multihead::transformer::StepOptions;
    ///
    /// let step = StepOptions::default().self_attn(CachedOptions::default().window(3).softcap(9.0));
    /// let (self_opts, _cross) = step.prefix_options(None);
    /// assert_eq!(self_opts.variants.window.left, Some(3));
    /// assert_eq!(self_opts.variants.window.right, Some(0));
    /// assert_eq!(self_opts.variants.softcap, Some(9.0));
    /// ```
    pub fn prefix_options(
        &self,
        memory_key_padding_mask: Option<&Mask>,
    ) -> (MhaOptions, MhaOptions) {
        let c = &self.self_attn;
        let mut v = crate::Variants::default().window(c.window, Some(0));
        v.softcap = c.softcap;
        v.alibi_slopes = c.alibi_slopes.clone();
        let mut self_opts = MhaOptions::default().variants(v);
        self_opts.sinks = c.sinks.clone();
        let mut cross = self.cross_attn.clone();
        cross.key_padding_mask = memory_key_padding_mask.cloned();
        (self_opts, cross)
    }
}

/// Refuses the cross-attention options a step cannot honour: those that depend on the target
/// position (or replace the memory's keys), naming the first one set.
pub(super) fn check_step_cross(o: &MhaOptions) -> Result<()> {
    let v = &o.variants;
    let set = [
        (o.attn_mask.is_some(), "attn_mask"),
        (o.key_padding_mask.is_some(), "key_padding_mask (give it to start())"),
        (o.is_causal, "is_causal"),
        (v.window != Default::default(), "variants.window"),
        (v.alibi_slopes.is_some(), "variants.alibi_slopes"),
        (v.align != Default::default(), "variants.align"),
        (o.static_k.is_some() || o.static_v.is_some(), "static_k/static_v"),
    ];
    match set.iter().find(|(on, _)| *on) {
        None => Ok(()),
        Some((_, name)) => Err(Error::Config {
            op: STEP,
            arg: "cross_attn",
            msg: format!(
                "{name} cannot be used in a decoding step's cross-attention (it depends on the \
                 target position, or replaces the memory's keys); the soft cap, sinks and key \
                 lengths can, or run TransformerDecoder::forward_with over the prefix"
            ),
        }),
    }
}

/// What a decoder needs between steps: one self-attention [`KvCache`] per layer, the memory's
/// cross-attention keys and values per layer, and the memory's key padding mask.
///
/// Made by [`TransformerDecoder::start`] (or [`Transformer::start_decoding`]).
#[derive(Debug)]
pub struct DecoderState {
    caches: Vec<KvCache>,
    memory: Vec<StaticKv>,
    memory_key_padding_mask: Option<Mask>,
}

impl DecoderState {
    /// The self-attention caches, one per layer.
    pub fn caches(&self) -> &[KvCache] {
        &self.caches
    }
    /// Tokens decoded per row so far.
    pub fn positions(&self) -> &[usize] {
        self.caches.first().map_or(&[], |c| c.positions())
    }
    /// Rolls every row back to at most `len` tokens (see [`KvCache::truncate`]).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        self.caches.iter_mut().try_for_each(|c| c.truncate(len))
    }
    /// Forgets the decoded tokens, keeping the memory (to decode again from the start).
    pub fn reset(&mut self) {
        self.caches.iter_mut().for_each(KvCache::reset);
    }
}

/// A layer's incremental step is inference: refused in training mode with dropout.
pub(super) fn refuse_training_dropout(
    op: &'static str,
    training: bool,
    dropout: f64,
) -> Result<()> {
    if training && dropout > 0.0 {
        return Err(Error::Config {
            op,
            arg: "dropout",
            msg: format!(
                "incremental decoding is inference: the layer is in training mode with \
                 dropout={dropout}; call eval() first"
            ),
        });
    }
    Ok(())
}

/// An error of a step's attention, named as the step's (`op`).
pub(super) fn as_step(op: &'static str, e: Error) -> Error {
    match e {
        Error::Shape { arg, msg, .. } => Error::Shape { op, arg, msg },
        Error::DType { arg, msg, .. } => Error::DType { op, arg, msg },
        Error::Config { arg, msg, .. } => Error::Config { op, arg, msg },
        Error::CacheFull { msg, .. } => Error::CacheFull { op, msg },
        e => e,
    }
}

impl TransformerDecoderLayer {
    /// An empty self-attention cache for `batch` rows of up to `capacity` tokens.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache> {
        self.self_attn.new_cache(batch, capacity)
    }

    /// The memory's cross-attention keys and values, projected once.
    ///
    /// # Shapes
    /// * memory: `(S, N, E)`, `(N, S, E)` with `batch_first`, or `(S, E)`.
    pub fn static_memory(&self, memory: &Tensor) -> Result<StaticKv> {
        self.multihead_attn.static_kv(memory)
    }

    /// One incremental step: the new tokens `x` through causal self-attention over `cache`,
    /// cross-attention over the projected memory, and the feed-forward block. At the new
    /// positions it equals `forward(prefix, memory, tgt_mask=causal, tgt_is_causal=True,
    /// memory_key_padding_mask)` within rounding. Inference only (eval mode when
    /// `dropout > 0`); runs without an autograd graph.
    ///
    /// # Shapes
    /// * x: `(T, N, E)`, `(N, T, E)` with `batch_first`, or `(T, E)`; output alike.
    // Mirrors torch.nn.TransformerDecoderLayer.forward at the new positions of the sequence.
    pub fn forward_step(
        &self,
        x: &Tensor,
        memory: &StaticKv,
        cache: &mut KvCache,
        memory_key_padding_mask: Option<&Mask>,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        let kpm = memory_key_padding_mask;
        self.forward_step_with(x, memory, cache, kpm, lengths, &StepOptions::default())
    }

    /// [`forward_step`](Self::forward_step) with attention variants ([`StepOptions`]): at the
    /// new positions it equals [`forward_with`](Self::forward_with) over the prefix with the
    /// matching options (see [`StepOptions`]). Bad options are an error before the cache
    /// changes.
    ///
    /// # Shapes
    /// * As in [`forward_step`](Self::forward_step); the cross-attention's sinks `(H,)`, key
    ///   lengths one per row.
    // Mirrors torch.nn.TransformerDecoderLayer.forward at the new positions of the sequence,
    // with the attention variants.
    pub fn forward_step_with(
        &self,
        x: &Tensor,
        memory: &StaticKv,
        cache: &mut KvCache,
        memory_key_padding_mask: Option<&Mask>,
        lengths: Option<&[usize]>,
        opts: &StepOptions,
    ) -> Result<Tensor> {
        let kpm = memory_key_padding_mask;
        let macs = self.step_macs(x, memory, cache);
        crate::pool::on_pool_for(macs, || self.step(x, (memory, kpm), cache, lengths, (opts, true)))
    }

    /// The multiply-adds of the largest operation of a step of `x` (the projections, the
    /// feed-forward block's products, the self-attention over `cache` or the cross-attention
    /// over `memory`), for [`crate::pool`]'s one hop per step.
    fn step_macs(&self, x: &Tensor, memory: &StaticKv, cache: &KvCache) -> usize {
        let t = x.elem_count() / self.cfg.d_model.max(1) / cache.batch_size().max(1);
        let mha = self.multihead_attn.config();
        let group = mha.num_heads / mha.kv_heads().max(1);
        let cross = memory.k.elem_count().saturating_mul(group).saturating_mul(t);
        let own = self.cfg.step_macs(&self.self_attn, x, cache);
        own.max(cross.saturating_mul(2))
    }

    /// [`forward_step_with`](Self::forward_step_with), planning the cross-attention first when
    /// `check` (a stack's later layers skip it: the first layer checked the same options on
    /// the same shapes, and a bf16 layer's plan widens its weights and the memory).
    fn step(
        &self,
        x: &Tensor,
        (memory, memory_key_padding_mask): (&StaticKv, Option<&Mask>),
        cache: &mut KvCache,
        lengths: Option<&[usize]>,
        (opts, check): (&StepOptions, bool),
    ) -> Result<Tensor> {
        refuse_training_dropout(STEP, self.training, self.cfg.dropout)?;
        check_step_cross(&opts.cross_attn)?;
        if check {
            // The step's own input first (its dtype, shape and batch against the cache), as
            // this step's error: the cross-attention below would report it as its query's
            // against the memory given to `start`.
            let check = self.self_attn.check_cached(x, cache, lengths, &opts.self_attn);
            check.map_err(|e| as_step(STEP, e))?;
        }
        let cross = {
            let mut o = opts.cross_attn.clone().need_weights(false);
            o.key_padding_mask = memory_key_padding_mask.cloned();
            o
        };
        // The cross-attention's arguments (the step's shape against the memory's, its mask,
        // its options) are checked before the self-attention appends to the cache (which checks
        // its own first): an error there left this layer's cache a token ahead of the others'.
        // With options, its plan too (its sizes); without, only the checks (no widening of a
        // bf16 layer's weights to plan a call whose sizes `start` checked).
        let plain = opts.cross_attn.sinks.is_none()
            && opts.cross_attn.variants.softcap.is_none()
            && opts.cross_attn.variants.kv_lengths.is_none();
        // (Errors name the masks as the layer's arguments: memory_key_padding_mask.)
        let named = |e: Error| e.renamed(&super::MEMORY_MASKS.0);
        if check && plain {
            self.multihead_attn.validate_static(x, memory, &cross).map_err(named)?;
        } else if check {
            self.multihead_attn.explain_static(x, memory, &cross).map_err(named)?;
        }
        crate::mode::no_grad(|| {
            let sa = |x: &Tensor, c: &mut KvCache| {
                self.self_attn.forward_cached_with(x, c, lengths, &opts.self_attn)
            };
            let ca = |x: &Tensor| {
                self.multihead_attn.forward_static_with(x, memory, &cross).map_err(named)
            };
            let ff = |x: &Tensor| {
                let (l1, l2) = (&self.linear1, &self.linear2);
                feed_forward(l1, l2, self.cfg.activation, &LayerDropout::off(), x)
            };
            if self.cfg.norm_first {
                let x = (x + sa(&self.norm1.forward(x)?, cache)?)?;
                let x = (&x + ca(&self.norm2.forward(&x)?)?)?;
                Ok((&x + ff(&self.norm3.forward(&x)?)?)?)
            } else {
                let x = self.norm1.forward_residual(x, &sa(x, cache)?)?;
                let x = self.norm2.forward_residual(&x, &ca(&x)?)?;
                self.norm3.forward_residual(&x, &ff(&x)?)
            }
        })
    }
}

impl TransformerDecoder {
    /// Starts incremental decoding against `memory` (in the layers' layout): one empty cache of
    /// `capacity` tokens per layer and row, and the memory projected once per layer.
    ///
    /// # Shapes
    /// * memory: `(S, N, E)`, `(N, S, E)` with `batch_first`, or `(S, E)`;
    ///   memory_key_padding_mask `(N, S)` or `(S,)`.
    pub fn start(
        &self,
        memory: &Tensor,
        memory_key_padding_mask: Option<&Mask>,
        capacity: usize,
    ) -> Result<DecoderState> {
        let batch = match (memory.rank(), self.layers.first()) {
            (3, Some(l)) => memory.dim(if l.config().batch_first { 0 } else { 1 })?,
            _ => 1,
        };
        if let Some(m) = memory_key_padding_mask {
            // PyTorch's shape: (N, S) for a batched memory, (S,) for an unbatched one; found
            // here rather than at the first step.
            let s = match (memory.rank(), self.layers.first()) {
                (3, Some(l)) => Some(memory.dim(if l.config().batch_first { 1 } else { 0 })?),
                (2, _) => Some(memory.dim(0)?),
                _ => None,
            };
            let want: Vec<usize> = match (memory.rank(), s) {
                (3, Some(s)) => vec![batch, s],
                (_, Some(s)) => vec![s],
                _ => vec![],
            };
            let got = m.tensor().dims();
            if !m.is_bool()
                && !crate::precision::float_mask_takes(m.tensor().dtype(), memory.dtype())
            {
                return Err(Error::DType {
                    op: "TransformerDecoder::start",
                    arg: "memory_key_padding_mask",
                    msg: format!(
                        "a float mask must have the memory's dtype {:?} (or f32), got {:?}; convert \
                         it with .to_dtype(DType::{:?})",
                        memory.dtype(),
                        m.tensor().dtype(),
                        memory.dtype()
                    ),
                });
            }
            if s.is_some() && got != want.as_slice() {
                return Err(Error::Shape {
                    op: "TransformerDecoder::start",
                    arg: "memory_key_padding_mask",
                    msg: format!(
                        "expected {want:?} (batch and memory length of memory {:?}), got {got:?}",
                        memory.dims()
                    ),
                });
            }
        }
        let caches =
            self.layers.iter().map(|l| l.new_cache(batch, capacity)).collect::<Result<_>>()?;
        let memory_kv = crate::mode::no_grad(|| {
            self.layers.iter().map(|l| l.static_memory(memory)).collect::<Result<Vec<_>>>()
        })?;
        Ok(DecoderState {
            caches,
            memory: memory_kv,
            memory_key_padding_mask: memory_key_padding_mask.cloned(),
        })
    }

    /// One incremental step through every layer and the final norm: at the new positions it
    /// equals [`forward`](Self::forward) over the whole prefix with a causal `tgt_mask`.
    /// `lengths[b]` new tokens of row `b` are real (default all `T`).
    ///
    /// # Shapes
    /// * x: `(T, N, E)`, `(N, T, E)` with `batch_first`, or `(T, E)`: the `T` new tokens of
    ///   each row; output alike.
    // Mirrors torch.nn.TransformerDecoder.forward at the new positions of the sequence.
    pub fn forward_step(
        &self,
        x: &Tensor,
        state: &mut DecoderState,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        self.forward_step_with(x, state, lengths, &StepOptions::default())
    }

    /// [`forward_step`](Self::forward_step) with attention variants in every layer
    /// ([`StepOptions`]): at the new positions it equals [`forward_with`](Self::forward_with)
    /// over the prefix with the matching options. Bad options are an error before any cache
    /// changes (every layer takes the same options and shapes, and the first checks them
    /// before it appends).
    ///
    /// # Shapes
    /// * As in [`forward_step`](Self::forward_step).
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor, D};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::multihead_attention::CachedOptions;
    /// use multihead::transformer::{LayerConfig, StepOptions, TransformerDecoder};
    /// use multihead::{MhaOptions, Variants};
    ///
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    /// let mut dec = TransformerDecoder::new(LayerConfig::new(8, 2).with_dim_feedforward(16), 2, None, vb)?;
    /// dec.eval();
    /// let (tgt, memory) = (Tensor::randn(0f32, 1.0, (5, 1, 8), &Device::Cpu)?, Tensor::randn(0f32, 1.0, (7, 1, 8), &Device::Cpu)?);
    /// // Gemma-2-like: soft caps and a local window of 2 earlier tokens.
    /// let step = StepOptions::default()
    ///     .self_attn(CachedOptions::default().softcap(20.0).window(2))
    ///     .cross_attn(MhaOptions::default().softcap(20.0));
    /// let mut state = dec.start(&memory, None, 8)?;
    /// let mut rows = Vec::new();
    /// for t in 0..5 {
    ///     rows.push(dec.forward_step_with(&tgt.narrow(0, t, 1)?, &mut state, None, &step)?);
    /// }
    /// let full = dec.forward_with(
    ///     &tgt,
    ///     &memory,
    ///     &MhaOptions::default().softcap(20.0).window(Some(2), Some(0)),
    ///     &MhaOptions::default().softcap(20.0),
    /// )?;
    /// let diff = (Tensor::cat(&rows, 0)? - full)?.abs()?.flatten_all()?.max(D::Minus1)?;
    /// assert!(diff.to_scalar::<f32>()? < 1e-5);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.TransformerDecoder.forward at the new positions of the sequence, with
    // the attention variants.
    pub fn forward_step_with(
        &self,
        x: &Tensor,
        state: &mut DecoderState,
        lengths: Option<&[usize]>,
        opts: &StepOptions,
    ) -> Result<Tensor> {
        if state.caches.len() != self.layers.len() {
            return Err(Error::Config {
                op: STEP,
                arg: "state",
                msg: format!(
                    "the state has {} layer caches but the decoder {} layers; make it with this \
                     decoder's start()",
                    state.caches.len(),
                    self.layers.len()
                ),
            });
        }
        let macs = match (self.layers.first(), state.caches.first(), state.memory.first()) {
            (Some(layer), Some(cache), Some(mem)) => layer.step_macs(x, mem, cache),
            _ => 0,
        };
        // One hop for the whole step: its layers' operations then split their work without
        // a wake-up and a sleep each.
        crate::pool::on_pool_for(macs, || {
            let mut x = x.clone();
            let kpm = state.memory_key_padding_mask.clone();
            let layers = self.layers.iter().zip(&mut state.caches).zip(&state.memory);
            for (i, ((layer, cache), mem)) in layers.enumerate() {
                // The first layer plans the cross-attention's options; the others take its
                // word.
                x = layer.step(&x, (mem, kpm.as_ref()), cache, lengths, (opts, i == 0))?;
            }
            crate::mode::no_grad(|| final_norm(self.norm.as_ref(), x))
        })
    }
}

impl Transformer {
    /// The encoder's output (`memory`) for `src`: `encoder(src, mask, src_key_padding_mask)`.
    ///
    /// # Shapes
    /// * src: `(S, N, E)`, `(N, S, E)` with `batch_first`, or `(S, E)`; src_mask `(S, S)`;
    ///   src_key_padding_mask `(N, S)` or `(S,)`. Output like src.
    ///
    /// # Example
    /// Encoding once, then decoding token by token with the KV cache: each step's output
    /// equals the full decoder's at that position (causal mask over the whole prefix).
    /// ```
    /// use candle_core::{DType, Device, Tensor, D};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::transformer::{
    ///     DecoderMasks, LayerConfig, Transformer, TransformerConfig, TransformerMasks,
    /// };
    ///
    /// let dev = Device::Cpu;
    /// let vm = VarMap::new();
    /// let layer = LayerConfig::new(8, 2).with_dim_feedforward(16).with_batch_first(true);
    /// let cfg = TransformerConfig { layer, num_encoder_layers: 1, num_decoder_layers: 2 };
    /// let mut model = Transformer::new(cfg, VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
    /// model.eval();
    /// let src = Tensor::randn(0f32, 1.0, (2, 5, 8), &dev)?; // (N, S, E)
    /// let tgt = Tensor::randn(0f32, 1.0, (2, 3, 8), &dev)?; // (N, T, E)
    ///
    /// let memory = model.encode(&src, None, None)?;
    /// let mut state = model.start_decoding(&memory, None, 16)?;
    /// let mut steps = Vec::new();
    /// for t in 0..3 {
    ///     steps.push(model.decode_step(&tgt.narrow(1, t, 1)?, &mut state, None)?); // (N, 1, E)
    /// }
    /// let stepped = Tensor::cat(&steps, 1)?;
    ///
    /// let causal = multihead::generate_square_subsequent_mask(3, DType::F32, &dev)?;
    /// let decoder = DecoderMasks { tgt_mask: Some(multihead::Mask::Float(causal)), ..Default::default() };
    /// let full = model.forward(&src, &tgt, &TransformerMasks { decoder, ..Default::default() })?;
    /// let diff = (stepped - full)?.abs()?.max(D::Minus1)?.max_all()?.to_scalar::<f32>()?;
    /// assert!(diff < 1e-5, "{diff}");
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.Transformer.encoder(src, mask=src_mask, src_key_padding_mask=...).
    pub fn encode(
        &self,
        src: &Tensor,
        src_mask: Option<&Mask>,
        src_key_padding_mask: Option<&Mask>,
    ) -> Result<Tensor> {
        self.encoder.forward(src, src_mask, src_key_padding_mask, None)
    }

    /// Starts incremental decoding against an encoded `memory` (see
    /// [`TransformerDecoder::start`]; example at [`encode`](Self::encode)).
    ///
    /// # Shapes
    /// * memory: `(S, N, E)`, `(N, S, E)` with `batch_first`, or `(S, E)`;
    ///   memory_key_padding_mask `(N, S)` or `(S,)`.
    pub fn start_decoding(
        &self,
        memory: &Tensor,
        memory_key_padding_mask: Option<&Mask>,
        capacity: usize,
    ) -> Result<DecoderState> {
        self.decoder.start(memory, memory_key_padding_mask, capacity)
    }

    /// One incremental decoder step (see [`TransformerDecoder::forward_step`]; example at
    /// [`encode`](Self::encode)).
    ///
    /// # Shapes
    /// * x: `(T, N, E)`, `(N, T, E)` with `batch_first`, or `(T, E)`: the new tokens; output
    ///   alike.
    // Mirrors torch.nn.Transformer.decoder(tgt, memory, ...) at the new positions of the
    // sequence (PyTorch recomputes the whole prefix; the cache gives the same rows).
    pub fn decode_step(
        &self,
        x: &Tensor,
        state: &mut DecoderState,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        self.decoder.forward_step(x, state, lengths)
    }

    /// [`decode_step`](Self::decode_step) with attention variants in every decoder layer (see
    /// [`TransformerDecoder::forward_step_with`]).
    ///
    /// # Shapes
    /// * As in [`decode_step`](Self::decode_step).
    // Mirrors torch.nn.Transformer.decoder(tgt, memory, ...) at the new positions, with the
    // attention variants.
    pub fn decode_step_with(
        &self,
        x: &Tensor,
        state: &mut DecoderState,
        lengths: Option<&[usize]>,
        opts: &StepOptions,
    ) -> Result<Tensor> {
        self.decoder.forward_step_with(x, state, lengths, opts)
    }
}
