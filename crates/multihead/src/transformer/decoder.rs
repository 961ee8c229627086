use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::{
    build_stack, detect_is_causal, final_norm, seq_len, stack_parameters, DecoderMasks,
    LayerConfig, NormConfig, TransformerDecoderLayer,
};
use crate::error::Result;
use crate::layer_norm::LayerNorm;
use crate::NamedParameters;

/// `torch.nn.TransformerDecoder`: `num_layers` decoder layers and an optional final LayerNorm.
///
/// Keys: `layers.{i}.*` and `norm.*`. `masks.tgt_is_causal = None` detects a causal `tgt_mask`
/// as PyTorch does.
///
/// # Shapes
/// * tgt `(T, N, E)`, memory `(S, N, E)` (`batch_first`: `(N, T, E)`, `(N, S, E)`; unbatched
///   `(T, E)`, `(S, E)`). Output like tgt.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::transformer::{DecoderMasks, LayerConfig, TransformerDecoder};
///
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let dec = TransformerDecoder::new(LayerConfig::new(8, 2).with_dim_feedforward(16), 2, None, vb)?;
/// let tgt = Tensor::randn(0f32, 1.0, (4, 8), &Device::Cpu)?; // unbatched
/// let memory = Tensor::randn(0f32, 1.0, (6, 8), &Device::Cpu)?;
/// assert_eq!(dec.forward(&tgt, &memory, &DecoderMasks::default())?.dims(), &[4, 8]);
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TransformerDecoder {
    pub(super) layers: Vec<TransformerDecoderLayer>,
    pub(super) norm: Option<LayerNorm>,
}

impl TransformerDecoder {
    /// Builds `num_layers` layers under `layers.{i}` and the optional final norm under `norm`.
    pub fn new(
        layer: LayerConfig,
        num_layers: usize,
        norm: Option<NormConfig>,
        vb: VarBuilder,
    ) -> Result<Self> {
        super::check_stack_size(&layer, num_layers, true, vb.dtype())?;
        let (layers, norm) = build_stack(num_layers, layer.d_model, norm, &vb, |vb| {
            TransformerDecoderLayer::new(layer.clone(), vb)
        })?;
        Ok(Self { layers, norm })
    }

    /// Sets training mode on every layer.
    pub fn train(&mut self, mode: bool) {
        self.layers.iter_mut().for_each(|l| l.train(mode));
    }

    /// Sets evaluation mode.
    pub fn eval(&mut self) {
        self.train(false);
    }

    /// Runs the stack.
    // Mirrors torch.nn.TransformerDecoder.forward.
    pub fn forward(&self, tgt: &Tensor, memory: &Tensor, masks: &DecoderMasks) -> Result<Tensor> {
        let batch_first = self.layers.first().map(|l| l.config().batch_first).unwrap_or(false);
        let causal = detect_is_causal(
            masks.tgt_mask.as_ref(),
            masks.tgt_is_causal,
            seq_len(tgt, batch_first)?,
        )?;
        let layer_masks = DecoderMasks { tgt_is_causal: Some(causal), ..masks.clone() };
        let mut x = tgt.clone();
        for layer in &self.layers {
            x = layer.forward(&x, memory, &layer_masks)?;
        }
        final_norm(self.norm.as_ref(), x)
    }
}

impl NamedParameters for TransformerDecoder {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        stack_parameters(&self.layers, self.norm.as_ref())
    }
}
