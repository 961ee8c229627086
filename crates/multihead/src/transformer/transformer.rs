use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::{
    layer_key, prefixed, refuse_static_kv, DecoderMasks, LayerConfig, NormConfig,
    TransformerDecoder, TransformerEncoder,
};
use crate::error::{Error, Result};
use crate::mask::Mask;
use crate::{MhaOptions, NamedParameters};

/// The constructor arguments of [`Transformer`], with PyTorch's defaults
/// (`d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6`, layer defaults as
/// [`LayerConfig`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TransformerConfig {
    /// The layer arguments shared by every encoder and decoder layer.
    pub layer: LayerConfig,
    /// `num_encoder_layers`. Default 6.
    pub num_encoder_layers: usize,
    /// `num_decoder_layers`. Default 6.
    pub num_decoder_layers: usize,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        Self { layer: LayerConfig::new(512, 8), num_encoder_layers: 6, num_decoder_layers: 6 }
    }
}

/// Every mask and hint of [`Transformer::forward`], PyTorch's names; all off by default.
#[derive(Clone, Debug, Default)]
pub struct TransformerMasks {
    /// `src_mask` `(S, S)` or `(N·nhead, S, S)`.
    pub src_mask: Option<Mask>,
    /// `src_key_padding_mask` `(N, S)`.
    pub src_key_padding_mask: Option<Mask>,
    /// `src_is_causal`; `None` detects a causal `src_mask`.
    pub src_is_causal: Option<bool>,
    /// The decoder's masks (`tgt_mask`, `memory_mask`, both key padding masks, `tgt_is_causal`,
    /// `memory_is_causal`).
    pub decoder: DecoderMasks,
}

/// The attention options of [`Transformer::forward_with`]: the encoder layers'
/// self-attention, and the decoder layers' self- and cross-attention, each an [`MhaOptions`]
/// (masks, `is_causal`, the variants, sinks, a dropout key) given to every layer of its stack.
///
/// # Example
/// ```
/// use multihead::transformer::TransformerOptions;
/// use multihead::{MhaOptions, Variants};
///
/// let causal_alibi = Variants::default().window(None, Some(0)).alibi(Variants::alibi_slopes_for(2));
/// let opts = TransformerOptions::default()
///     .encoder(MhaOptions::default().variants(Variants::default().softcap(30.0)))
///     .decoder_self(MhaOptions::default().variants(causal_alibi));
/// assert!(opts.decoder_cross.variants.softcap.is_none());
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct TransformerOptions {
    /// Every encoder layer's self-attention: `src_mask`, `src_key_padding_mask`,
    /// `src_is_causal` and the variants.
    pub encoder: MhaOptions,
    /// Every decoder layer's self-attention: `tgt_mask`, `tgt_key_padding_mask`,
    /// `tgt_is_causal` and the variants.
    pub decoder_self: MhaOptions,
    /// Every decoder layer's cross-attention over the memory: `memory_mask`,
    /// `memory_key_padding_mask`, `memory_is_causal` and the variants.
    pub decoder_cross: MhaOptions,
}

impl TransformerOptions {
    /// Sets the encoder layers' options.
    pub fn encoder(mut self, opts: MhaOptions) -> Self {
        self.encoder = opts;
        self
    }
    /// Sets the decoder layers' self-attention options.
    pub fn decoder_self(mut self, opts: MhaOptions) -> Self {
        self.decoder_self = opts;
        self
    }
    /// Sets the decoder layers' cross-attention options.
    pub fn decoder_cross(mut self, opts: MhaOptions) -> Self {
        self.decoder_cross = opts;
        self
    }
}

/// `torch.nn.Transformer`: an encoder with a final LayerNorm feeding a decoder with a final
/// LayerNorm.
///
/// Keys: `encoder.layers.{i}.*`, `encoder.norm.*`, `decoder.layers.{i}.*`, `decoder.norm.*`.
/// Fresh parameters keep each layer's own initialisation; PyTorch re-draws every parameter with
/// more than one dimension Xavier-uniform (`_reset_parameters`). Load a state_dict to match.
///
/// # Shapes
/// * src `(S, N, E)`, tgt `(T, N, E)` (`batch_first`: `(N, S, E)`, `(N, T, E)`; unbatched
///   `(S, E)`, `(T, E)`). Output like tgt.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::transformer::{LayerConfig, Transformer, TransformerConfig, TransformerMasks};
///
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let cfg = TransformerConfig { layer: LayerConfig::new(8, 2).with_dim_feedforward(16), num_encoder_layers: 1, num_decoder_layers: 1 };
/// let model = Transformer::new(cfg, vb)?;
/// let src = Tensor::randn(0f32, 1.0, (6, 2, 8), &Device::Cpu)?;
/// let tgt = Tensor::randn(0f32, 1.0, (4, 2, 8), &Device::Cpu)?;
/// assert_eq!(model.forward(&src, &tgt, &TransformerMasks::default())?.dims(), &[4, 2, 8]);
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Transformer {
    pub(super) cfg: TransformerConfig,
    pub(super) encoder: TransformerEncoder,
    pub(super) decoder: TransformerDecoder,
}

impl Transformer {
    /// Builds the model from `vb` under PyTorch's keys.
    pub fn new(cfg: TransformerConfig, vb: VarBuilder) -> Result<Self> {
        let norm = Some(NormConfig { eps: cfg.layer.layer_norm_eps, bias: cfg.layer.bias });
        let encoder = TransformerEncoder::new(
            cfg.layer.clone(),
            cfg.num_encoder_layers,
            norm,
            vb.pp("encoder"),
        )?;
        let decoder = TransformerDecoder::new(
            cfg.layer.clone(),
            cfg.num_decoder_layers,
            norm,
            vb.pp("decoder"),
        )?;
        Ok(Self { cfg, encoder, decoder })
    }

    /// The encoder.
    pub fn encoder(&self) -> &TransformerEncoder {
        &self.encoder
    }

    /// The decoder.
    pub fn decoder(&self) -> &TransformerDecoder {
        &self.decoder
    }

    /// Sets training mode everywhere.
    pub fn train(&mut self, mode: bool) {
        self.encoder.train(mode);
        self.decoder.train(mode);
    }

    /// Sets evaluation mode.
    pub fn eval(&mut self) {
        self.train(false);
    }

    /// Encodes `src` and decodes `tgt` against it.
    // Mirrors torch.nn.Transformer.forward.
    pub fn forward(&self, src: &Tensor, tgt: &Tensor, masks: &TransformerMasks) -> Result<Tensor> {
        self.check_inputs(src, tgt)?;
        let memory = self.encoder.forward(
            src,
            masks.src_mask.as_ref(),
            masks.src_key_padding_mask.as_ref(),
            masks.src_is_causal,
        )?;
        self.decoder.forward(tgt, &memory, &masks.decoder)
    }

    /// [`forward`](Self::forward) with every attention call's options: the encoder stack runs
    /// [`TransformerEncoder::forward_with`] with `opts.encoder`, the decoder stack
    /// [`TransformerDecoder::forward_with`] with `opts.decoder_self` and
    /// `opts.decoder_cross` (each `is_causal` taken as given: no causal-mask detection). A
    /// dropout key `(seed, offset)` keys encoder layer `i` with `(seed, offset + i·2^48)` and
    /// decoder layer `i` with `(seed, offset + (num_encoder_layers + i)·2^48)`, so no two
    /// layers share a dropout mask; a decoder layer's self- and cross-attention take the key
    /// of their own options, so give those two different keys (or offsets) for independent
    /// masks. `static_k`/`static_v` are refused (`Error::Config`).
    ///
    /// # Shapes
    /// * As in [`forward`](Self::forward); the options' shapes as in [`MhaOptions`] (`L = S`
    ///   for the encoder and the decoder's self-attention, `L = T` over the memory's `S` for
    ///   the cross-attention).
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::transformer::{LayerConfig, Transformer, TransformerConfig, TransformerOptions};
    /// use multihead::{MhaOptions, Variants};
    ///
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    /// let layer = LayerConfig::new(8, 2).with_dim_feedforward(16).with_batch_first(true);
    /// let cfg = TransformerConfig { layer, num_encoder_layers: 1, num_decoder_layers: 2 };
    /// let model = Transformer::new(cfg, vb)?;
    /// // A causal decoder with ALiBi and a soft cap, no mask tensors.
    /// let causal = Variants::default().window(None, Some(0)).alibi(Variants::alibi_slopes_for(2));
    /// let opts = TransformerOptions::default()
    ///     .decoder_self(MhaOptions::default().variants(causal.softcap(20.0)));
    /// let src = Tensor::randn(0f32, 1.0, (2, 6, 8), &Device::Cpu)?; // (N, S, E)
    /// let tgt = Tensor::randn(0f32, 1.0, (2, 4, 8), &Device::Cpu)?; // (N, T, E)
    /// assert_eq!(model.forward_with(&src, &tgt, &opts)?.dims(), &[2, 4, 8]);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.Transformer.forward, with the attention variants.
    pub fn forward_with(
        &self,
        src: &Tensor,
        tgt: &Tensor,
        opts: &TransformerOptions,
    ) -> Result<Tensor> {
        const OP: &str = "Transformer.forward_with";
        self.check_inputs(src, tgt)?;
        refuse_static_kv(OP, "opts.encoder", &opts.encoder)?;
        refuse_static_kv(OP, "opts.decoder_self", &opts.decoder_self)?;
        refuse_static_kv(OP, "opts.decoder_cross", &opts.decoder_cross)?;
        let elements = src.elem_count().max(tgt.elem_count());
        let macs = self.cfg.layer.layer_macs(elements);
        crate::pool::on_pool_for(macs, || {
            let memory = self.encoder.forward_with(src, &opts.encoder)?;
            // The decoder's layers take the keys after the encoder's.
            let n = self.cfg.num_encoder_layers;
            let (so, co) = (layer_key(&opts.decoder_self, n), layer_key(&opts.decoder_cross, n));
            self.decoder.forward_with(tgt, &memory, &so, &co)
        })
    }

    /// `src` and `tgt` agree in rank, batch and width (PyTorch's checks, its messages).
    fn check_inputs(&self, src: &Tensor, tgt: &Tensor) -> Result<()> {
        let d = self.cfg.layer.d_model;
        let bf = self.cfg.layer.batch_first;
        let is_batched = src.rank() == 3;
        if !matches!(src.rank(), 2 | 3) || tgt.rank() != src.rank() {
            return Err(Error::Shape {
                op: "Transformer",
                arg: "tgt",
                msg: format!(
                    "src and tgt must both be 2-D (unbatched) or both 3-D (batched), got src {:?} and tgt {:?}",
                    src.dims(),
                    tgt.dims()
                ),
            });
        }
        if is_batched {
            let (bs, bt) = if bf { (src.dim(0)?, tgt.dim(0)?) } else { (src.dim(1)?, tgt.dim(1)?) };
            if tgt.rank() != 3 || bs != bt {
                return Err(Error::Shape {
                    op: "Transformer",
                    arg: "tgt",
                    msg: format!(
                        "the batch number of src and tgt must be equal, got src {:?} and tgt {:?}",
                        src.dims(),
                        tgt.dims()
                    ),
                });
            }
        }
        if src.dims().last() != Some(&d) || tgt.dims().last() != Some(&d) {
            return Err(Error::Shape {
                op: "Transformer",
                arg: "src",
                msg: format!(
                    "the feature number of src and tgt must be equal to d_model {d}, got src {:?} and tgt {:?}",
                    src.dims(),
                    tgt.dims()
                ),
            });
        }
        Ok(())
    }
}

impl NamedParameters for Transformer {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("encoder", self.encoder.named_parameters());
        v.extend(prefixed("decoder", self.decoder.named_parameters()));
        v
    }
}
