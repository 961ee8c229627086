//! `module.train(mode)` and `module.eval()` for a whole model.

/// PyTorch's `module.train(mode)` / `module.eval()`, recursing through a model: a hand-written
/// block implements it by passing the mode to each of its sub-modules, so that one call sets
/// every dropout of a model, as `model.eval()` does in PyTorch.
///
/// Every module of this crate implements it (those without dropout ignore the mode), as do
/// candle_nn's layers, `Vec`, `Option` and `Box` of modules.
///
/// # Example
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::{LayerNorm, Linear, MhaConfig, MultiheadAttention, Train};
///
/// /// A hand-written block: attention, a norm and an MLP.
/// struct Block {
///     attn: MultiheadAttention,
///     norm: LayerNorm,
///     mlp: Vec<Linear>,
/// }
///
/// impl Train for Block {
///     fn train(&mut self, mode: bool) {
///         Train::train(&mut self.attn, mode);
///         Train::train(&mut self.norm, mode);
///         Train::train(&mut self.mlp, mode);
///     }
/// }
///
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let cfg = MhaConfig::new(8, 2).with_dropout(0.1);
/// let mut model = vec![Block {
///     attn: MultiheadAttention::new(cfg, vb.pp("attn"))?,
///     norm: LayerNorm::new(8, 1e-5, true, vb.pp("norm"))?,
///     mlp: vec![Linear::new(8, 16, true, vb.pp("mlp.0"))?],
/// }];
/// Train::eval(&mut model); // model.eval()
/// assert!(!model[0].attn.is_training());
/// # Ok::<(), multihead::Error>(())
/// ```
pub trait Train {
    /// Sets training mode (`mode = true`) or evaluation mode on this module and every
    /// sub-module.
    // Mirrors torch.nn.Module.train.
    fn train(&mut self, mode: bool);

    /// `self.train(false)`.
    // Mirrors torch.nn.Module.eval.
    fn eval(&mut self) {
        self.train(false);
    }
}

/// Modules that hold a training flag of their own (their inherent `train` sets it and their
/// sub-modules').
macro_rules! with_flag {
    ($($t:ty),* $(,)?) => {$(
        impl Train for $t {
            fn train(&mut self, mode: bool) {
                <$t>::train(self, mode);
            }
        }
    )*};
}

with_flag!(
    crate::MultiheadAttention,
    crate::transformer::TransformerEncoderLayer,
    crate::transformer::TransformerDecoderLayer,
    crate::transformer::TransformerEncoder,
    crate::transformer::TransformerDecoder,
    crate::transformer::Transformer,
);

/// Modules that behave the same in both modes.
macro_rules! without_mode {
    ($($t:ty),* $(,)?) => {$(
        impl Train for $t {
            fn train(&mut self, _mode: bool) {}
        }
    )*};
}

without_mode!(
    crate::Linear,
    crate::LayerNorm,
    crate::Embedding,
    crate::Activation,
    candle_nn::Linear,
    candle_nn::LayerNorm,
    candle_nn::RmsNorm,
    candle_nn::Embedding,
    candle_nn::Conv1d,
    candle_nn::Conv2d,
);

impl<T: Train> Train for Vec<T> {
    fn train(&mut self, mode: bool) {
        self.iter_mut().for_each(|m| m.train(mode));
    }
}

impl<T: Train> Train for Option<T> {
    fn train(&mut self, mode: bool) {
        if let Some(m) = self {
            m.train(mode);
        }
    }
}

impl<T: Train + ?Sized> Train for Box<T> {
    fn train(&mut self, mode: bool) {
        (**self).train(mode);
    }
}
