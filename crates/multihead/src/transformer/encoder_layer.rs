use crate::fused::zeros::residual;
use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::{
    attention_block, feed_forward, mask_options, prefixed, DropoutSlot, LayerConfig, LayerDropout,
};
use crate::error::Result;
use crate::layer_norm::LayerNorm;
use crate::linear::Linear;
use crate::mask::Mask;
use crate::{MhaOptions, MultiheadAttention, NamedParameters};

/// `torch.nn.TransformerEncoderLayer`: self-attention and a feed-forward block, each with a
/// residual connection and LayerNorm (after the block by default, before it with
/// `norm_first`).
///
/// Keys: `self_attn.*`, `linear1.*`, `linear2.*`, `norm1.*`, `norm2.*`. Starts in training mode,
/// as PyTorch modules do (dropout defaults to 0.1): call [`eval`](Self::eval) for inference.
///
/// # Shapes
/// * src `(S, N, E)`, `(N, S, E)` with `batch_first`, or `(S, E)` unbatched.
/// * src_mask `(S, S)` or `(N·nhead, S, S)`; src_key_padding_mask `(N, S)` or `(S,)`.
/// * output: like src.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
///
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let mut layer = TransformerEncoderLayer::new(LayerConfig::new(16, 4).with_dim_feedforward(32), vb)?;
/// layer.eval();
/// let x = Tensor::randn(0f32, 1.0, (7, 2, 16), &Device::Cpu)?;
/// assert_eq!(layer.forward(&x, None, None, false)?.dims(), &[7, 2, 16]);
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TransformerEncoderLayer {
    pub(super) cfg: LayerConfig,
    pub(super) self_attn: MultiheadAttention,
    pub(super) linear1: Linear,
    pub(super) linear2: Linear,
    pub(super) norm1: LayerNorm,
    pub(super) norm2: LayerNorm,
    pub(super) training: bool,
}

impl TransformerEncoderLayer {
    /// Builds the layer from `vb` under PyTorch's keys.
    pub fn new(cfg: LayerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let self_attn = MultiheadAttention::new(cfg.mha_config(), vb.pp("self_attn"))?;
        let linear1 = Linear::new(cfg.d_model, cfg.dim_feedforward, cfg.bias, vb.pp("linear1"))?;
        let linear2 = Linear::new(cfg.dim_feedforward, cfg.d_model, cfg.bias, vb.pp("linear2"))?;
        let norm1 = LayerNorm::new(cfg.d_model, cfg.layer_norm_eps, cfg.bias, vb.pp("norm1"))?;
        let norm2 = LayerNorm::new(cfg.d_model, cfg.layer_norm_eps, cfg.bias, vb.pp("norm2"))?;
        Ok(Self { cfg, self_attn, linear1, linear2, norm1, norm2, training: true })
    }

    /// The constructor arguments.
    pub fn config(&self) -> &LayerConfig {
        &self.cfg
    }

    /// The self-attention block (PyTorch's `layer.self_attn`).
    pub fn self_attn(&self) -> &MultiheadAttention {
        &self.self_attn
    }

    /// The feed-forward block's first and second products (PyTorch's `layer.linear1`,
    /// `layer.linear2`).
    pub fn linear1(&self) -> &Linear {
        &self.linear1
    }

    /// See [`linear1`](Self::linear1).
    pub fn linear2(&self) -> &Linear {
        &self.linear2
    }

    /// The norms (PyTorch's `layer.norm1`, before or after the self-attention block as
    /// `norm_first` says, and `layer.norm2`, around the feed-forward block).
    pub fn norm1(&self) -> &LayerNorm {
        &self.norm1
    }

    /// See [`norm1`](Self::norm1).
    pub fn norm2(&self) -> &LayerNorm {
        &self.norm2
    }

    /// Sets training mode.
    pub fn train(&mut self, mode: bool) {
        self.training = mode;
        self.self_attn.train(mode);
    }

    /// Sets evaluation mode.
    pub fn eval(&mut self) {
        self.train(false);
    }

    /// Whether the layer is in training mode.
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// The layer's own dropouts, keyed by `key` (the self-attention's) when given.
    fn dropouts(&self, key: Option<crate::random::DropoutKey>) -> LayerDropout {
        LayerDropout::new(self.cfg.dropout, self.training, key)
    }

    fn attend(&self, x: &Tensor, opts: &MhaOptions, drop: &LayerDropout) -> Result<Tensor> {
        let block = (drop, DropoutSlot::SelfBlock);
        attention_block(&self.self_attn, (x, x), opts, block, super::SRC_MASKS)
    }

    fn feed_forward(&self, x: &Tensor, drop: &LayerDropout) -> Result<Tensor> {
        feed_forward(&self.linear1, &self.linear2, self.cfg.activation, drop, x)
    }

    /// Runs the layer. `is_causal` is PyTorch's hint: it needs `src_mask` (see
    /// [`MhaOptions::is_causal`](crate::MhaOptions::is_causal)).
    // Mirrors torch.nn.TransformerEncoderLayer.forward.
    pub fn forward(
        &self,
        src: &Tensor,
        src_mask: Option<&Mask>,
        src_key_padding_mask: Option<&Mask>,
        is_causal: bool,
    ) -> Result<Tensor> {
        self.forward_with(src, &mask_options(src_mask, src_key_padding_mask, is_causal))
    }

    /// Runs the layer with the options of a [`MultiheadAttention`] call for its self-attention:
    /// PyTorch's `src_mask`, `src_key_padding_mask` and `is_causal` are `opts.attn_mask`,
    /// `opts.key_padding_mask` and `opts.is_causal`, and the variants PyTorch's layer lacks
    /// (`opts.variants`: soft cap, windows, causal alignment, key lengths, ALiBi; `opts.sinks`;
    /// see `docs/variants.md`) apply inside the block as in
    /// [`MultiheadAttention::forward`](crate::MultiheadAttention::forward), fused where the plan
    /// allows. `need_weights` and `average_attn_weights` are ignored: the layer returns no
    /// weights. `opts.dropout_key` keys the attention's dropout and, each at its own offset
    /// (`slot·2^40`), the layer's other dropouts, so a keyed call draws nothing from the global
    /// generator (without a key they draw from it, as PyTorch's do); `opts.backend` chooses the
    /// attention's path only.
    /// `static_k`/`static_v` are refused (an `Error::Config`): self-attention projects its own
    /// keys. As in PyTorch's layer, the attention runs with `need_weights=False`, so
    /// `is_causal` with an `attn_mask` and no padding mask uses the causal mask in its place.
    /// [`forward`](Self::forward) is this call with the masks alone.
    ///
    /// # Shapes
    /// * `src` as in [`forward`](Self::forward); the options' shapes as in
    ///   [`MhaOptions`](crate::MhaOptions) with `L = S`.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
    /// use multihead::{MhaOptions, Variants};
    ///
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    /// let cfg = LayerConfig::new(8, 2).with_dim_feedforward(16).with_batch_first(true);
    /// let mut layer = TransformerEncoderLayer::new(cfg, vb)?;
    /// layer.eval();
    /// // Mistral-style: each token sees itself and the 3 tokens before it (no later one);
    /// // Gemma-2-style capped scores.
    /// let variants = Variants::default().window(Some(3), Some(0)).softcap(30.0);
    /// let opts = MhaOptions { variants, ..Default::default() };
    /// let x = Tensor::randn(0f32, 1.0, (2, 6, 8), &Device::Cpu)?;
    /// assert_eq!(layer.forward_with(&x, &opts)?.dims(), &[2, 6, 8]);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.TransformerEncoderLayer.forward, with the attention variants.
    pub fn forward_with(&self, src: &Tensor, opts: &MhaOptions) -> Result<Tensor> {
        super::refuse_static_kv("TransformerEncoderLayer.forward_with", "opts", opts)?;
        let macs = self.cfg.layer_macs(src.elem_count());
        crate::pool::on_pool_for(macs, || self.forward_here(src, opts))
    }

    /// [`forward_with`](Self::forward_with) on this thread.
    fn forward_here(&self, src: &Tensor, opts: &MhaOptions) -> Result<Tensor> {
        const AT: (&str, &str) = ("TransformerEncoderLayer.forward", "src");
        super::refuse_uncast_input(AT, self.self_attn.dtype(), src.dtype())?;
        if let Some(dt) = super::autocast_into(self.self_attn.dtype(), src.dtype()) {
            let o = crate::functional::cast_options(opts, dt)?;
            return crate::mode::autocast_off(|| self.forward_here(src, &o));
        }
        let autocast = |m: &Self, r: &dyn Fn(&Tensor) -> Result<Tensor>| {
            let src = crate::precision::widen_reduced(src)?;
            m.forward_with(&src, &crate::functional::autocast_options(opts, r)?)
        };
        let dtypes = (src.dtype(), self.self_attn.dtype());
        let macs = self.product_macs(src);
        if let Some(y) = crate::precision::autocast_layer(self, dtypes, macs, autocast) {
            return y;
        }
        let dtype = src.dtype();
        if crate::precision::is_reduced(dtype)
            && dtype == self.self_attn.dtype()
            && crate::functional::options_in(opts, dtype)
        {
            if let Some(y) = self.forward_bf16_direct(src, opts)? {
                return Ok(y);
            }
            // bf16/f16: the f32 layer between one widening and one rounding.
            use crate::precision::{narrow, widen, CastParams};
            let o = crate::functional::widen_options(opts)?;
            let (widened, x) = (self.widened()?, widen(src)?);
            let y = crate::mode::rounded_products(dtype, macs, || widened.forward_with(&x, &o))?;
            return narrow(&y, dtype);
        }
        let x = src;
        let drop = self.dropouts(opts.dropout_key);
        if self.cfg.norm_first {
            let sa = self.attend(&self.norm1.forward(x)?, opts, &drop)?;
            let x = residual(x, &sa)?;
            residual(&x, &self.feed_forward(&self.norm2.forward(&x)?, &drop)?)
        } else {
            // Each residual sum and its norm are one op (`LayerNorm::forward_residual`).
            let sa = self.attend(x, opts, &drop)?;
            let x = self.norm1.forward_residual(x, &sa)?;
            self.norm2.forward_residual(&x, &self.feed_forward(&x, &drop)?)
        }
    }
}

impl TransformerEncoderLayer {
    /// A bf16 layer in inference without its f32 twin's widened weights: where its
    /// self-attention runs as it is (a bf16 `MultiheadAttention`'s direct route on the bf16
    /// input, or on a pre-norm layer's first norm rounded to bf16, its output projection
    /// written in f32 for the residual sum), the feed-forward products read the bf16 weights as
    /// they are and only the norms' parameters, the biases and the input are widened; the norms
    /// read the bf16 input and write the bf16 output in their own pass
    /// ([`LayerNorm::forward_as`]). The twin's operations on the twin's values in the twin's
    /// order, so its bits; the twin widened all 4·E² + 2·E·F weights each call (about 3% of a
    /// bf16 encoder layer's inference on an AMX CPU; docs/performance.md). `None` where any
    /// part would not take that route (a gradient, dropout, autocast, few rows, widened
    /// products): the caller runs the twin.
    fn forward_bf16_direct(&self, src: &Tensor, opts: &MhaOptions) -> Result<Option<Tensor>> {
        use crate::precision::{narrow, widen, CastParams};
        use candle_core::DType::F32;
        let dtype = src.dtype();
        let macs = self.product_macs(src);
        if !self.bf16_route_applies(src, opts.dropout_key, macs)? {
            return Ok(None);
        }
        let (norm1, norm2) = (self.norm1.map_params(&widen)?, self.norm2.map_params(&widen)?);
        // Pre-norm: the twin's in-projection reads the norm's f32 output rounded to bf16 (its
        // products' operands), which is the norm rounded once here.
        let attn_in = match self.cfg.norm_first {
            true => norm1.forward_as(src, None, dtype)?,
            false => src.clone(),
        };
        // As `attention_block`: the layer returns no weights.
        let attn_opts = MhaOptions { need_weights: false, ..opts.clone() };
        let sa = self.self_attn.forward_direct_to(&attn_in, &attn_opts, F32);
        let Some(sa) = sa.map_err(|e| e.renamed(&super::SRC_MASKS.0))? else {
            return Ok(None);
        };
        crate::mode::rounded_products(dtype, macs, || {
            if self.cfg.norm_first {
                let x = residual(&widen(src)?, &sa.output)?;
                let ff = self.twin_feed_forward(&norm2.forward(&x)?, opts.dropout_key)?;
                return narrow(&residual(&x, &ff)?, dtype);
            }
            let x = norm1.forward_as(src, Some(&sa.output), F32)?;
            let ff = self.twin_feed_forward(&x, opts.dropout_key)?;
            norm2.forward_as(&x, Some(&ff), dtype)
        })
        .map(Some)
    }

    /// [`forward_packed`](Self::forward_packed) of a bf16 layer in inference without its f32
    /// twin's widened weights, as [`forward_bf16_direct`](Self::forward_bf16_direct) for a
    /// padded batch: the twin's operations on the twin's values (the attention's products and
    /// the feed-forward block's read the bf16 weights, the norms' parameters are widened), for
    /// post-norm and pre-norm layers; `None` where any part would not take that route (a
    /// gradient, dropout, autocast, another activation): the caller runs the twin. `opts`
    /// holds the widened sinks.
    fn forward_packed_bf16_direct(
        &self,
        src: &Tensor,
        cu: &crate::functional::CuSeqlens,
        opts: &crate::multihead_attention::PackedOptions,
    ) -> Result<Option<Tensor>> {
        use crate::precision::{narrow, widen, CastParams};
        let dtype = src.dtype();
        let macs = self.packed_macs(src, cu);
        if !self.bf16_route_applies(src, opts.dropout_key, macs)? {
            return Ok(None);
        }
        let (norm1, norm2) = (self.norm1.map_params(&widen)?, self.norm2.map_params(&widen)?);
        let x = widen(src)?;
        let attend = |x: &Tensor| self.self_attn.forward_packed_f32_of_bf16(x, cu, opts);
        let feed_forward = |x: &Tensor| self.twin_feed_forward(x, opts.dropout_key);
        crate::mode::rounded_products(dtype, macs, || {
            if self.cfg.norm_first {
                let x = residual(&x, &attend(&norm1.forward(&x)?)?)?;
                narrow(&residual(&x, &feed_forward(&norm2.forward(&x)?)?)?, dtype)
            } else {
                let x = norm1.forward_residual(&x, &attend(&x)?)?;
                norm2.forward_as(&x, Some(&feed_forward(&x)?), dtype)
            }
        })
        .map(Some)
    }

    /// The multiply-adds of the layer's largest product on `src` (`Bf16Products::Auto` widens
    /// a small layer's products).
    fn product_macs(&self, src: &Tensor) -> u64 {
        crate::products::layer_macs(src, src, self.cfg.dim_feedforward, self.cfg.batch_first)
    }

    /// [`product_macs`](Self::product_macs) of a packed batch `src` `(T, E)`: each sequence
    /// attends to itself only.
    fn packed_macs(&self, src: &Tensor, cu: &crate::functional::CuSeqlens) -> u64 {
        let (e, f) = (self.cfg.d_model, self.cfg.dim_feedforward);
        let rows = src.dims().first().copied().unwrap_or(0) as u64;
        // As `layer_macs` counts a padded batch's: the projections' width E, the feed-forward F.
        let widest = e.max(f) as u64;
        let products = rows.saturating_mul(e as u64).saturating_mul(widest);
        products.max(crate::products::packed_attention_macs(cu, cu, 1, e))
    }

    /// The conditions both bf16 routes share: a bf16 layer with bf16 products on, no dropout
    /// in effect, no autocast, ReLU or GELU, and no gradient recorded.
    fn bf16_route_applies(
        &self,
        src: &Tensor,
        key: Option<crate::random::DropoutKey>,
        macs: u64,
    ) -> Result<bool> {
        Ok(src.dtype() == candle_core::DType::BF16
            && crate::mode::bf16_products_at(macs)
            && self.dropouts(key).is_identity()
            && crate::precision::autocast_for(candle_core::DType::F32, candle_core::DType::F32)
                .is_none()
            && matches!(self.cfg.activation, crate::Activation::Relu | crate::Activation::Gelu)
            && !self.records_grad(src)?)
    }

    /// The twin's feed-forward block on the twin's f32 rows `x` (inside `rounded_products`):
    /// the bf16 weights read as they are, or, off the fused path, widened as the twin's.
    fn twin_feed_forward(
        &self,
        x: &Tensor,
        key: Option<crate::random::DropoutKey>,
    ) -> Result<Tensor> {
        use crate::precision::{widen, CastParams};
        let act = self.cfg.activation;
        match crate::linear::rounded_feed_forward(&self.linear1, &self.linear2, act, x)? {
            Some(ff) => Ok(ff),
            None => {
                let (l1, l2) = (self.linear1.map_params(&widen)?, self.linear2.map_params(&widen)?);
                feed_forward(&l1, &l2, act, &self.dropouts(key), x)
            }
        }
    }

    /// Whether a gradient would be recorded through the layer on `src`.
    fn records_grad(&self, src: &Tensor) -> Result<bool> {
        use crate::precision::CastParams;
        if !crate::mode::grad_enabled() {
            return Ok(false);
        }
        let tracked = std::cell::Cell::new(src.track_op());
        self.map_params(&|t| {
            tracked.set(tracked.get() || t.track_op());
            Ok(t.clone())
        })?;
        Ok(tracked.get())
    }

    /// Runs the layer on a packed batch of variable-length sequences: `src` holds their
    /// tokens one after another (`cu`: where each starts) and each token attends to its own
    /// sequence only ([`MultiheadAttention::forward_packed`](crate::MultiheadAttention::forward_packed));
    /// the norms and the feed-forward block run on the rows as they are. The same numbers as
    /// [`forward`](Self::forward) on each sequence alone, without computing padding. f32 and
    /// f64 (reduced dtypes: widen first).
    ///
    /// # Shapes
    /// * `src` `(T, E)`; output `(T, E)`.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::functional::CuSeqlens;
    /// use multihead::multihead_attention::PackedOptions;
    /// use multihead::transformer::{LayerConfig, TransformerEncoderLayer};
    ///
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    /// let layer = TransformerEncoderLayer::new(LayerConfig::new(8, 2).with_dim_feedforward(16), vb)?;
    /// let x = Tensor::randn(0f32, 1.0, (9, 8), &Device::Cpu)?; // sequences of 2, 7 tokens
    /// let y = layer.forward_packed(&x, &CuSeqlens::from_lengths(&[2, 7]), &PackedOptions::default())?;
    /// assert_eq!(y.dims(), &[9, 8]);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.TransformerEncoderLayer.forward on each sequence of a packed batch.
    pub fn forward_packed(
        &self,
        src: &Tensor,
        cu: &crate::functional::CuSeqlens,
        opts: &crate::multihead_attention::PackedOptions,
    ) -> Result<Tensor> {
        let macs = self.cfg.layer_macs(src.elem_count());
        crate::pool::on_pool_for(macs, || self.forward_packed_here(src, cu, opts))
    }

    fn forward_packed_here(
        &self,
        src: &Tensor,
        cu: &crate::functional::CuSeqlens,
        opts: &crate::multihead_attention::PackedOptions,
    ) -> Result<Tensor> {
        let dtype = src.dtype();
        if crate::precision::is_reduced(dtype) && dtype == self.self_attn.dtype() {
            // bf16/f16: the f32 layer between one widening and one rounding, as `forward_with`
            // computes a padded batch (candle's own bf16 adds and norms were most of the time).
            use crate::precision::{narrow, widen, CastParams};
            let mut o = opts.clone();
            o.sinks = crate::precision::widen_opt(opts.sinks.as_ref())?;
            if let Some(y) = self.forward_packed_bf16_direct(src, cu, &o)? {
                return Ok(y);
            }
            let (widened, x) = (self.widened()?, widen(src)?);
            let macs = self.packed_macs(src, cu);
            let y = crate::mode::rounded_products(dtype, macs, || {
                widened.forward_packed_here(&x, cu, &o)
            })?;
            return narrow(&y, dtype);
        }
        let drop = self.dropouts(opts.dropout_key);
        let attend = |x: &Tensor| -> Result<Tensor> {
            drop.apply(&self.self_attn.forward_packed(x, cu, opts)?, DropoutSlot::SelfBlock)
        };
        let x = src;
        if self.cfg.norm_first {
            let x = residual(x, &attend(&self.norm1.forward(x)?)?)?;
            residual(&x, &self.feed_forward(&self.norm2.forward(&x)?, &drop)?)
        } else {
            let x = self.norm1.forward_residual(x, &attend(x)?)?;
            self.norm2.forward_residual(&x, &self.feed_forward(&x, &drop)?)
        }
    }
}

impl NamedParameters for TransformerEncoderLayer {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("self_attn", self.self_attn.named_parameters());
        v.extend(prefixed("linear1", self.linear1.named_parameters()));
        v.extend(prefixed("linear2", self.linear2.named_parameters()));
        v.extend(prefixed("norm1", self.norm1.named_parameters()));
        v.extend(prefixed("norm2", self.norm2.named_parameters()));
        v
    }
}

impl crate::precision::CastParams for TransformerEncoderLayer {
    fn map_params(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            norm1: self.norm1.map_params(f)?,
            norm2: self.norm2.map_params(f)?,
            ..self.map_product_params(f)?
        })
    }

    fn map_product_params(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            cfg: self.cfg.clone(),
            self_attn: self.self_attn.map_params(f)?,
            linear1: self.linear1.map_params(f)?,
            linear2: self.linear2.map_params(f)?,
            norm1: self.norm1.clone(),
            norm2: self.norm2.clone(),
            training: self.training,
        })
    }
}
