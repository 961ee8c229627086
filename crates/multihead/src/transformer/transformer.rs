use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::{
    prefixed, DecoderMasks, LayerConfig, NormConfig, TransformerDecoder, TransformerEncoder,
};
use crate::error::{Error, Result};
use crate::mask::Mask;
use crate::NamedParameters;

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
        let memory = self.encoder.forward(
            src,
            masks.src_mask.as_ref(),
            masks.src_key_padding_mask.as_ref(),
            masks.src_is_causal,
        )?;
        self.decoder.forward(tgt, &memory, &masks.decoder)
    }
}

impl NamedParameters for Transformer {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("encoder", self.encoder.named_parameters());
        v.extend(prefixed("decoder", self.decoder.named_parameters()));
        v
    }
}
