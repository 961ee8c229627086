use candle_core::Tensor;
use candle_nn::VarBuilder;

use super::{
    build_stack, detect_is_causal, final_norm, layer_key, seq_len, stack_parameters, DecoderMasks,
    LayerConfig, NormConfig, TransformerDecoderLayer,
};
use crate::error::Result;
use crate::layer_norm::LayerNorm;
use crate::{MhaOptions, NamedParameters};

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

    /// The layers.
    pub fn layers(&self) -> &[TransformerDecoderLayer] {
        &self.layers
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
            ("TransformerDecoder.forward", "tgt_mask"),
        )?;
        let (self_opts, cross_opts) = masks.options(causal);
        self.forward_with(tgt, memory, &self_opts, &cross_opts)
    }

    /// Runs the stack with the options of every layer's self- and cross-attention calls, as
    /// [`TransformerDecoderLayer::forward_with`] runs one layer (`self_opts.is_causal` taken as
    /// given: no causal-mask detection). With a dropout key `(seed, offset)` in either
    /// options, layer `i` takes `(seed, offset + i·2^48)` there, so the layers do not share a
    /// mask (nor meet keys a caller advances by one per step). `static_k`/`static_v` are
    /// refused in both options (every layer would take the same keys).
    ///
    /// # Shapes
    /// * As in [`TransformerDecoderLayer::forward_with`].
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::transformer::{LayerConfig, TransformerDecoder};
    /// use multihead::{MhaOptions, Variants};
    ///
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    /// let dec = TransformerDecoder::new(LayerConfig::new(8, 2).with_dim_feedforward(16), 2, None, vb)?;
    /// // Causal self-attention with ALiBi, without a mask tensor.
    /// let v = Variants::default().window(None, Some(0)).alibi(Variants::alibi_slopes_for(2));
    /// let self_opts = MhaOptions::default().variants(v);
    /// let (tgt, memory) = (Tensor::randn(0f32, 1.0, (6, 2, 8), &Device::Cpu)?, Tensor::randn(0f32, 1.0, (9, 2, 8), &Device::Cpu)?);
    /// let y = dec.forward_with(&tgt, &memory, &self_opts, &MhaOptions::default())?;
    /// assert_eq!(y.dims(), &[6, 2, 8]);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.TransformerDecoder.forward, with the attention variants.
    pub fn forward_with(
        &self,
        tgt: &Tensor,
        memory: &Tensor,
        self_opts: &MhaOptions,
        cross_opts: &MhaOptions,
    ) -> Result<Tensor> {
        const OP: &str = "TransformerDecoder.forward_with";
        super::refuse_static_kv(OP, "self_opts", self_opts)?;
        super::refuse_static_kv(OP, "cross_opts", cross_opts)?;
        let elements = tgt.elem_count().max(memory.elem_count());
        let macs = self.layers.first().map_or(0, |l| l.config().layer_macs(elements));
        crate::pool::on_pool_for(macs, || {
            let mut x = tgt.clone();
            for (i, layer) in self.layers.iter().enumerate() {
                let (so, co) = (layer_key(self_opts, i), layer_key(cross_opts, i));
                x = layer.forward_with(&x, memory, &so, &co)?;
            }
            final_norm(self.norm.as_ref(), x)
        })
    }
}

impl NamedParameters for TransformerDecoder {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        stack_parameters(&self.layers, self.norm.as_ref())
    }
}
