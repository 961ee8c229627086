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

/// The masks and causal hints of a decoder call, PyTorch's argument names, all off by default.
#[derive(Clone, Debug, Default)]
pub struct DecoderMasks {
    /// `tgt_mask` `(T, T)` or `(N·nhead, T, T)`.
    pub tgt_mask: Option<Mask>,
    /// `memory_mask` `(T, S)` or `(N·nhead, T, S)`.
    pub memory_mask: Option<Mask>,
    /// `tgt_key_padding_mask` `(N, T)` or `(T,)`.
    pub tgt_key_padding_mask: Option<Mask>,
    /// `memory_key_padding_mask` `(N, S)` or `(S,)`.
    pub memory_key_padding_mask: Option<Mask>,
    /// `tgt_is_causal`: for a layer, the hint (default false); for [`TransformerDecoder`](super::TransformerDecoder),
    /// `None` detects a causal `tgt_mask`.
    pub tgt_is_causal: Option<bool>,
    /// `memory_is_causal`. Default false.
    pub memory_is_causal: bool,
}

/// `torch.nn.TransformerDecoderLayer`: self-attention, cross-attention over the encoder's
/// memory, and a feed-forward block, each with a residual connection and LayerNorm.
///
/// Keys: `self_attn.*`, `multihead_attn.*`, `linear1.*`, `linear2.*`, `norm1.*`..`norm3.*`.
///
/// # Shapes
/// * tgt `(T, N, E)`, memory `(S, N, E)`; `(N, T, E)`/`(N, S, E)` with `batch_first`;
///   `(T, E)`/`(S, E)` unbatched. Output like tgt.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::transformer::{DecoderMasks, LayerConfig, TransformerDecoderLayer};
///
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let layer = TransformerDecoderLayer::new(LayerConfig::new(8, 2).with_dim_feedforward(16), vb)?;
/// let tgt = Tensor::randn(0f32, 1.0, (4, 2, 8), &Device::Cpu)?;
/// let memory = Tensor::randn(0f32, 1.0, (6, 2, 8), &Device::Cpu)?;
/// assert_eq!(layer.forward(&tgt, &memory, &DecoderMasks::default())?.dims(), &[4, 2, 8]);
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TransformerDecoderLayer {
    pub(super) cfg: LayerConfig,
    pub(super) self_attn: MultiheadAttention,
    pub(super) multihead_attn: MultiheadAttention,
    pub(super) linear1: Linear,
    pub(super) linear2: Linear,
    pub(super) norm1: LayerNorm,
    pub(super) norm2: LayerNorm,
    pub(super) norm3: LayerNorm,
    pub(super) training: bool,
}

impl TransformerDecoderLayer {
    /// Builds the layer from `vb` under PyTorch's keys.
    pub fn new(cfg: LayerConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        let self_attn = MultiheadAttention::new(cfg.mha_config(), vb.pp("self_attn"))?;
        let multihead_attn = MultiheadAttention::new(cfg.mha_config(), vb.pp("multihead_attn"))?;
        let linear1 = Linear::new(cfg.d_model, cfg.dim_feedforward, cfg.bias, vb.pp("linear1"))?;
        let linear2 = Linear::new(cfg.dim_feedforward, cfg.d_model, cfg.bias, vb.pp("linear2"))?;
        let eps = cfg.layer_norm_eps;
        let norm1 = LayerNorm::new(cfg.d_model, eps, cfg.bias, vb.pp("norm1"))?;
        let norm2 = LayerNorm::new(cfg.d_model, eps, cfg.bias, vb.pp("norm2"))?;
        let norm3 = LayerNorm::new(cfg.d_model, eps, cfg.bias, vb.pp("norm3"))?;
        Ok(Self {
            cfg,
            self_attn,
            multihead_attn,
            linear1,
            linear2,
            norm1,
            norm2,
            norm3,
            training: true,
        })
    }

    /// The constructor arguments.
    pub fn config(&self) -> &LayerConfig {
        &self.cfg
    }

    /// The self-attention and the cross-attention over the memory (PyTorch's
    /// `layer.self_attn`, `layer.multihead_attn`).
    pub fn self_attn(&self) -> &MultiheadAttention {
        &self.self_attn
    }

    /// See [`self_attn`](Self::self_attn).
    pub fn multihead_attn(&self) -> &MultiheadAttention {
        &self.multihead_attn
    }

    /// The feed-forward block's products (PyTorch's `layer.linear1`, `layer.linear2`).
    pub fn linear1(&self) -> &Linear {
        &self.linear1
    }

    /// See [`linear1`](Self::linear1).
    pub fn linear2(&self) -> &Linear {
        &self.linear2
    }

    /// The norms of the three blocks (PyTorch's `layer.norm1`, `norm2`, `norm3`).
    pub fn norm1(&self) -> &LayerNorm {
        &self.norm1
    }

    /// See [`norm1`](Self::norm1).
    pub fn norm2(&self) -> &LayerNorm {
        &self.norm2
    }

    /// See [`norm1`](Self::norm1).
    pub fn norm3(&self) -> &LayerNorm {
        &self.norm3
    }

    /// Sets training mode.
    pub fn train(&mut self, mode: bool) {
        self.training = mode;
        self.self_attn.train(mode);
        self.multihead_attn.train(mode);
    }

    /// Sets evaluation mode.
    pub fn eval(&mut self) {
        self.train(false);
    }

    /// An attention block and its dropout (`slot` of the layer's dropouts `drop`).
    fn block(
        &self,
        attn: &MultiheadAttention,
        (x, mem): (&Tensor, &Tensor),
        opts: &MhaOptions,
        (drop, slot): (&LayerDropout, DropoutSlot),
    ) -> Result<Tensor> {
        // The self-attention's masks are PyTorch's `tgt_*`, the cross-attention's `memory_*`.
        let names = match slot {
            DropoutSlot::CrossBlock => super::MEMORY_MASKS,
            _ => super::TGT_MASKS,
        };
        attention_block(attn, (x, mem), opts, (drop, slot), names)
    }

    fn feed_forward(&self, x: &Tensor, drop: &LayerDropout) -> Result<Tensor> {
        feed_forward(&self.linear1, &self.linear2, self.cfg.activation, drop, x)
    }

    /// Runs the layer; `masks.tgt_is_causal = None` means `false` here.
    // Mirrors torch.nn.TransformerDecoderLayer.forward.
    pub fn forward(&self, tgt: &Tensor, memory: &Tensor, masks: &DecoderMasks) -> Result<Tensor> {
        let (self_opts, cross_opts) = masks.options(masks.tgt_is_causal.unwrap_or(false));
        self.forward_with(tgt, memory, &self_opts, &cross_opts)
    }

    /// Runs the layer with the options of a [`MultiheadAttention`] call for its self-attention
    /// (`self_opts`: PyTorch's `tgt_mask`, `tgt_key_padding_mask`, `tgt_is_causal`) and for its
    /// cross-attention over `memory` (`cross_opts`: `memory_mask`,
    /// `memory_key_padding_mask`, `memory_is_causal`), each with the variants PyTorch's layer
    /// lacks (soft cap, windows, causal alignment, key lengths, ALiBi, sinks; see
    /// `docs/variants.md`), as in
    /// [`TransformerEncoderLayer::forward_with`](super::TransformerEncoderLayer::forward_with):
    /// the weights are never returned; a dropout key keys that attention's dropout, and the
    /// key of `self_opts` also the layer's other dropouts (each at its own offset) and, when
    /// `cross_opts` has no key, the cross-attention's, so a keyed call draws nothing from the
    /// global generator.
    /// `static_k`/`static_v` are refused in `self_opts` (an `Error::Config`) and taken in
    /// `cross_opts` (precomputed memory keys and values, as `MultiheadAttention` takes them).
    ///
    /// # Shapes
    /// * `tgt`, `memory` as in [`forward`](Self::forward); the options' shapes as in
    ///   [`MhaOptions`] with `L = S = T` for `self_opts`, `L = T` for `cross_opts`.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::transformer::{LayerConfig, TransformerDecoderLayer};
    /// use multihead::MhaOptions;
    ///
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    /// let mut layer = TransformerDecoderLayer::new(LayerConfig::new(8, 2).with_dim_feedforward(16), vb)?;
    /// layer.eval();
    /// // Causal self-attention over the last 4 tokens, soft-capped cross-attention.
    /// let self_opts = MhaOptions::default().window(Some(4), Some(0));
    /// let cross_opts = MhaOptions::default().softcap(20.0);
    /// let (tgt, memory) = (Tensor::randn(0f32, 1.0, (6, 2, 8), &Device::Cpu)?, Tensor::randn(0f32, 1.0, (9, 2, 8), &Device::Cpu)?);
    /// assert_eq!(layer.forward_with(&tgt, &memory, &self_opts, &cross_opts)?.dims(), &[6, 2, 8]);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.TransformerDecoderLayer.forward, with the attention variants.
    pub fn forward_with(
        &self,
        tgt: &Tensor,
        memory: &Tensor,
        self_opts: &MhaOptions,
        cross_opts: &MhaOptions,
    ) -> Result<Tensor> {
        super::refuse_static_kv("TransformerDecoderLayer.forward_with", "self_opts", self_opts)?;
        let macs = self.cfg.layer_macs(tgt.elem_count().max(memory.elem_count()));
        crate::pool::on_pool_for(macs, || self.forward_here(tgt, memory, self_opts, cross_opts))
    }

    /// [`forward_with`](Self::forward_with) on this thread.
    fn forward_here(
        &self,
        tgt: &Tensor,
        memory: &Tensor,
        self_opts: &MhaOptions,
        cross_opts: &MhaOptions,
    ) -> Result<Tensor> {
        const AT: (&str, &str) = ("TransformerDecoderLayer.forward", "tgt");
        super::refuse_uncast_input(AT, self.self_attn.dtype(), tgt.dtype())?;
        if let Some(dt) = super::autocast_into(self.self_attn.dtype(), tgt.dtype()) {
            let (so, co) = (
                crate::functional::cast_options(self_opts, dt)?,
                crate::functional::cast_options(cross_opts, dt)?,
            );
            let memory = crate::precision::autocast_cast(memory, dt)?;
            return crate::mode::autocast_off(|| self.forward_here(tgt, &memory, &so, &co));
        }
        let autocast = |m: &Self, r: &dyn Fn(&Tensor) -> Result<Tensor>| {
            use crate::{functional::autocast_options, precision::widen_reduced};
            let (so, co) = (autocast_options(self_opts, r)?, autocast_options(cross_opts, r)?);
            let (tgt, memory) = (widen_reduced(tgt)?, widen_reduced(memory)?);
            m.forward_with(&tgt, &memory, &so, &co)
        };
        let dtypes = (tgt.dtype(), self.self_attn.dtype());
        let (ff, bf) = (self.cfg.dim_feedforward, self.cfg.batch_first);
        let macs = crate::products::layer_macs(tgt, memory, ff, bf);
        if let Some(y) = crate::precision::autocast_layer(self, dtypes, macs, autocast) {
            return y;
        }
        let dtype = tgt.dtype();
        if crate::precision::is_reduced(dtype)
            && dtype == self.self_attn.dtype()
            && memory.dtype() == dtype
            && crate::functional::options_in(self_opts, dtype)
            && crate::functional::options_in(cross_opts, dtype)
        {
            // bf16/f16: the f32 layer between one widening and one rounding.
            use crate::functional::widen_options;
            use crate::precision::{narrow, widen, CastParams};
            let (so, co) = (widen_options(self_opts)?, widen_options(cross_opts)?);
            let widened = self.widened()?;
            let (t, mem) = (widen(tgt)?, widen(memory)?);
            let y = crate::mode::rounded_products(dtype, macs, || {
                widened.forward_with(&t, &mem, &so, &co)
            })?;
            return narrow(&y, dtype);
        }
        let (sa, ca) = (&self.self_attn, &self.multihead_attn);
        // The layer's own dropouts are keyed by the self-attention's key, when given.
        let drop = LayerDropout::new(self.cfg.dropout, self.training, self_opts.dropout_key);
        let keyed_cross;
        let cross_opts = match (cross_opts.dropout_key, drop.key(DropoutSlot::CrossAttention)) {
            (None, Some(k)) => {
                keyed_cross = cross_opts.clone().dropout_key(k);
                &keyed_cross
            }
            _ => cross_opts,
        };
        let (own, cross) = ((&drop, DropoutSlot::SelfBlock), (&drop, DropoutSlot::CrossBlock));
        let x = tgt;
        if self.cfg.norm_first {
            let h = self.norm1.forward(x)?;
            let x = residual(x, &self.block(sa, (&h, &h), self_opts, own)?)?;
            let h = self.norm2.forward(&x)?;
            let x = residual(&x, &self.block(ca, (&h, memory), cross_opts, cross)?)?;
            residual(&x, &self.feed_forward(&self.norm3.forward(&x)?, &drop)?)
        } else {
            // Each residual sum and its norm are one op (`LayerNorm::forward_residual`).
            let x = self.norm1.forward_residual(x, &self.block(sa, (x, x), self_opts, own)?)?;
            let c = self.block(ca, (&x, memory), cross_opts, cross)?;
            let x = self.norm2.forward_residual(&x, &c)?;
            self.norm3.forward_residual(&x, &self.feed_forward(&x, &drop)?)
        }
    }
}

impl DecoderMasks {
    /// The options of the self- and cross-attention calls these masks make, with `tgt_causal`
    /// as the self-attention's hint.
    pub(crate) fn options(&self, tgt_causal: bool) -> (MhaOptions, MhaOptions) {
        let (tm, tk) = (self.tgt_mask.as_ref(), self.tgt_key_padding_mask.as_ref());
        let (mm, mk) = (self.memory_mask.as_ref(), self.memory_key_padding_mask.as_ref());
        (mask_options(tm, tk, tgt_causal), mask_options(mm, mk, self.memory_is_causal))
    }
}

impl NamedParameters for TransformerDecoderLayer {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("self_attn", self.self_attn.named_parameters());
        v.extend(prefixed("multihead_attn", self.multihead_attn.named_parameters()));
        v.extend(prefixed("linear1", self.linear1.named_parameters()));
        v.extend(prefixed("linear2", self.linear2.named_parameters()));
        v.extend(prefixed("norm1", self.norm1.named_parameters()));
        v.extend(prefixed("norm2", self.norm2.named_parameters()));
        v.extend(prefixed("norm3", self.norm3.named_parameters()));
        v
    }
}

impl crate::precision::CastParams for TransformerDecoderLayer {
    fn map_params(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            norm1: self.norm1.map_params(f)?,
            norm2: self.norm2.map_params(f)?,
            norm3: self.norm3.map_params(f)?,
            ..self.map_product_params(f)?
        })
    }

    fn map_product_params(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            cfg: self.cfg.clone(),
            self_attn: self.self_attn.map_params(f)?,
            multihead_attn: self.multihead_attn.map_params(f)?,
            linear1: self.linear1.map_params(f)?,
            linear2: self.linear2.map_params(f)?,
            norm1: self.norm1.clone(),
            norm2: self.norm2.clone(),
            norm3: self.norm3.clone(),
            training: self.training,
        })
    }
}
