//! Incremental causal decoding through encoder layers: a decoder-only model (GPT-style) built
//! from `TransformerEncoderLayer`s with a causal `src_mask`, as PyTorch users build one. Each
//! layer keeps a [`KvCache`] of its self-attention, so a step costs the new tokens' projections
//! and one read of the caches.

use candle_core::Tensor;

use super::incremental::{as_step, refuse_training_dropout};
use super::{feed_forward, final_norm, LayerDropout, TransformerEncoder, TransformerEncoderLayer};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::multihead_attention::CachedOptions;

const STEP: &str = "TransformerEncoder::forward_cached";
const LAYER_STEP: &str = "TransformerEncoderLayer::forward_cached";

impl TransformerEncoderLayer {
    /// An empty self-attention cache for `batch` rows of up to `capacity` tokens, for
    /// [`forward_cached`](Self::forward_cached).
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache> {
        self.self_attn.new_cache(batch, capacity)
    }

    /// One incremental causal step: the new tokens `x` through self-attention over `cache` and
    /// themselves (their keys and values appended), then the feed-forward block. At the new
    /// positions it equals `forward(prefix, src_mask=causal, is_causal=True)` over every token
    /// so far, within rounding. `lengths[b]` of row `b`'s `T` new tokens are real (default
    /// all; the rest are padding and are not cached). Inference only (eval mode when
    /// `dropout > 0`); runs without an autograd graph. A refused step leaves the cache as it
    /// was.
    ///
    /// # Shapes
    /// * x: `(T, N, E)`, `(N, T, E)` with `batch_first`, or `(T, E)`: the `T` new tokens of
    ///   each row; output alike.
    /// * cache: from [`new_cache`](Self::new_cache).
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor, D};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
    /// use multihead::{generate_square_subsequent_mask, Mask};
    ///
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    /// let cfg = LayerConfig::new(8, 2).with_dim_feedforward(16).with_batch_first(true);
    /// let mut layer = TransformerEncoderLayer::new(cfg.with_norm_first(true), vb)?;
    /// layer.eval();
    /// let x = Tensor::randn(0f32, 1.0, (2, 5, 8), &Device::Cpu)?; // (N, L, E)
    /// let mut cache = layer.new_cache(2, 5)?;
    /// let mut steps = Vec::new();
    /// for t in 0..5 {
    ///     steps.push(layer.forward_cached(&x.narrow(1, t, 1)?, &mut cache, None)?);
    /// }
    /// let causal = Mask::Float(generate_square_subsequent_mask(5, DType::F32, &Device::Cpu)?);
    /// let full = layer.forward(&x, Some(&causal), None, true)?;
    /// let diff = (Tensor::cat(&steps, 1)? - full)?.abs()?.flatten_all()?.max(D::Minus1)?;
    /// assert!(diff.to_scalar::<f32>()? < 1e-5);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.TransformerEncoderLayer.forward(prefix, src_mask=causal, is_causal=True)
    // at the new positions of the sequence.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        self.forward_cached_with(x, cache, lengths, &CachedOptions::default())
    }

    /// [`forward_cached`](Self::forward_cached) with attention variants (a soft cap, sinks,
    /// ALiBi, a left window: [`CachedOptions`]): at the new positions it equals
    /// [`forward_with`](Self::forward_with) over the prefix with the matching causal options.
    ///
    /// # Shapes
    /// * As in [`forward_cached`](Self::forward_cached).
    // Mirrors torch.nn.TransformerEncoderLayer.forward over the prefix, causal, with the
    // attention variants, at the new positions of the sequence.
    pub fn forward_cached_with(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        lengths: Option<&[usize]>,
        opts: &CachedOptions,
    ) -> Result<Tensor> {
        self.check_step(LAYER_STEP, x, cache, lengths, opts)?;
        let macs = self.cfg.step_macs(&self.self_attn, x, cache);
        crate::pool::on_pool_for(macs, || self.step(x, cache, lengths, opts))
    }

    /// Checks a step before anything is appended: the layer is in eval mode (or without
    /// dropout), the self-attention takes `x` over `cache` (its errors named as the step's),
    /// and the feed-forward block's rows can be allocated.
    fn check_step(
        &self,
        op: &'static str,
        x: &Tensor,
        cache: &KvCache,
        lengths: Option<&[usize]>,
        opts: &CachedOptions,
    ) -> Result<()> {
        refuse_training_dropout(op, self.training, self.cfg.dropout)?;
        let check = self.self_attn.check_cached(x, cache, lengths, opts);
        check.map_err(|e| as_step(op, e))?;
        // The feed-forward block's hidden rows (and the residual sums beside them), which
        // come after the cache's append.
        let e = self.cfg.d_model.max(1);
        let rows = [x.elem_count() / e, self.cfg.dim_feedforward.max(e)];
        crate::alloc::ensure(op, "x", &rows, x.dtype(), 3, "decode fewer tokens at a time")
    }

    /// The step, checked.
    fn step(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        lengths: Option<&[usize]>,
        opts: &CachedOptions,
    ) -> Result<Tensor> {
        crate::mode::no_grad(|| {
            let sa = |x: &Tensor, c: &mut KvCache| {
                self.self_attn.forward_cached_with(x, c, lengths, opts)
            };
            let ff = |x: &Tensor| {
                let (l1, l2) = (&self.linear1, &self.linear2);
                feed_forward(l1, l2, self.cfg.activation, &LayerDropout::off(), x)
            };
            if self.cfg.norm_first {
                let x = (x + sa(&self.norm1.forward(x)?, cache)?)?;
                Ok((&x + ff(&self.norm2.forward(&x)?)?)?)
            } else {
                let x = self.norm1.forward_residual(x, &sa(x, cache)?)?;
                self.norm2.forward_residual(&x, &ff(&x)?)
            }
        })
    }
}

impl TransformerEncoder {
    /// One empty self-attention cache per layer, `batch` rows of up to `capacity` tokens each,
    /// for [`forward_cached`](Self::forward_cached).
    pub fn new_caches(&self, batch: usize, capacity: usize) -> Result<Vec<KvCache>> {
        self.layers.iter().map(|l| l.new_cache(batch, capacity)).collect()
    }

    /// One incremental causal step through every layer and the final norm (a decoder-only
    /// model's blocks): at the new positions it equals [`forward`](Self::forward) over the
    /// whole prefix with a causal mask (`is_causal=True`), within rounding. Every layer's
    /// step is checked before any cache changes.
    ///
    /// # Shapes
    /// * x: `(T, N, E)`, `(N, T, E)` with `batch_first`, or `(T, E)`; output alike.
    /// * caches: one per layer, from [`new_caches`](Self::new_caches).
    // Mirrors torch.nn.TransformerEncoder.forward(prefix, mask=causal, is_causal=True) at the
    // new positions of the sequence.
    pub fn forward_cached(
        &self,
        x: &Tensor,
        caches: &mut [KvCache],
        lengths: Option<&[usize]>,
    ) -> Result<Tensor> {
        self.forward_cached_with(x, caches, lengths, &CachedOptions::default())
    }

    /// [`forward_cached`](Self::forward_cached) with attention variants in every layer
    /// ([`CachedOptions`]).
    ///
    /// # Shapes
    /// * As in [`forward_cached`](Self::forward_cached).
    // Mirrors torch.nn.TransformerEncoder.forward over the prefix, causal, with the attention
    // variants, at the new positions of the sequence.
    pub fn forward_cached_with(
        &self,
        x: &Tensor,
        caches: &mut [KvCache],
        lengths: Option<&[usize]>,
        opts: &CachedOptions,
    ) -> Result<Tensor> {
        if caches.len() != self.layers.len() {
            return Err(Error::Config {
                op: STEP,
                arg: "caches",
                msg: format!(
                    "{} caches for an encoder of {} layers; make them with this encoder's \
                     new_caches()",
                    caches.len(),
                    self.layers.len()
                ),
            });
        }
        // Every layer reads the same shapes: check each against its own cache first, so that
        // a refused step leaves every cache as it was.
        for (layer, cache) in self.layers.iter().zip(caches.iter()) {
            layer.check_step(STEP, x, cache, lengths, opts)?;
        }
        let macs = match (self.layers.first(), caches.first()) {
            (Some(layer), Some(cache)) => layer.cfg.step_macs(&layer.self_attn, x, cache),
            _ => 0,
        };
        // One hop for the whole step: its layers' operations then split their work without
        // a wake-up and a sleep each.
        crate::pool::on_pool_for(macs, || {
            let mut x = x.clone();
            for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
                x = layer.step(&x, cache, lengths, opts)?;
            }
            crate::mode::no_grad(|| final_norm(self.norm.as_ref(), x))
        })
    }
}
