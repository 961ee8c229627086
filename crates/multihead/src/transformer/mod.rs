//! The Transformer layers of `torch.nn`, built on [`MultiheadAttention`](crate::MultiheadAttention).
//!
//! * [`TransformerEncoderLayer`] and [`TransformerDecoderLayer`]: one block each, post-norm or
//!   pre-norm (`norm_first`), ReLU or exact GELU.
//! * [`TransformerEncoder`] and [`TransformerDecoder`]: stacks of layers with an optional final
//!   norm and PyTorch's causal-mask detection.
//! * [`Transformer`]: the encoder-decoder model.
//!
//! State_dict keys are PyTorch's (`self_attn.in_proj_weight`, `linear1.weight`, `norm1.bias`,
//! `layers.0.…`, `encoder.norm.weight`, …).

mod decoder;
mod decoder_layer;
mod encoder;
mod encoder_cached;
mod encoder_layer;
mod generate;
mod incremental;
#[allow(clippy::module_inception)]
mod transformer;

pub use decoder::TransformerDecoder;
pub use decoder_layer::{DecoderMasks, TransformerDecoderLayer};
pub use encoder::TransformerEncoder;
pub use encoder_layer::TransformerEncoderLayer;
pub use generate::{GenerateOptions, Sampling};
pub use incremental::{DecoderState, StepOptions};
pub use transformer::{Transformer, TransformerConfig, TransformerMasks, TransformerOptions};

use crate::activation::Activation;

/// The constructor arguments shared by [`TransformerEncoderLayer`] and
/// [`TransformerDecoderLayer`], with PyTorch's defaults.
///
/// # Example
/// ```
/// use multihead::transformer::LayerConfig;
/// let cfg = LayerConfig::new(512, 8).with_dim_feedforward(1024).with_batch_first(true);
/// assert_eq!(cfg.dropout, 0.1);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    /// `d_model`: the feature size.
    pub d_model: usize,
    /// `nhead`: attention heads; must divide `d_model`.
    pub nhead: usize,
    /// `dim_feedforward`. Default 2048.
    pub dim_feedforward: usize,
    /// `dropout`, used by every dropout of the layer and inside its attention. Default 0.1.
    pub dropout: f64,
    /// `activation`. Default ReLU.
    pub activation: Activation,
    /// `layer_norm_eps`. Default 1e-5.
    pub layer_norm_eps: f64,
    /// `batch_first`. Default `false`.
    pub batch_first: bool,
    /// `norm_first` (pre-norm). Default `false`.
    pub norm_first: bool,
    /// `bias`: biases of the linear layers, the attention and the LayerNorms. Default `true`.
    pub bias: bool,
}

impl LayerConfig {
    /// PyTorch's defaults for `d_model` and `nhead`.
    pub fn new(d_model: usize, nhead: usize) -> Self {
        Self {
            d_model,
            nhead,
            dim_feedforward: 2048,
            dropout: 0.1,
            activation: Activation::Relu,
            layer_norm_eps: 1e-5,
            batch_first: false,
            norm_first: false,
            bias: true,
        }
    }
    /// Sets `dim_feedforward`.
    pub fn with_dim_feedforward(mut self, v: usize) -> Self {
        self.dim_feedforward = v;
        self
    }
    /// Sets `dropout`.
    pub fn with_dropout(mut self, v: f64) -> Self {
        self.dropout = v;
        self
    }
    /// Sets `activation`.
    pub fn with_activation(mut self, v: Activation) -> Self {
        self.activation = v;
        self
    }
    /// Sets `layer_norm_eps`.
    pub fn with_layer_norm_eps(mut self, v: f64) -> Self {
        self.layer_norm_eps = v;
        self
    }
    /// Sets `batch_first`.
    pub fn with_batch_first(mut self, v: bool) -> Self {
        self.batch_first = v;
        self
    }
    /// Sets `norm_first`.
    pub fn with_norm_first(mut self, v: bool) -> Self {
        self.norm_first = v;
        self
    }
    /// Sets `bias`.
    pub fn with_bias(mut self, v: bool) -> Self {
        self.bias = v;
        self
    }
    /// Checks the constructor's rules: the attention's ([`MhaConfig::validate`]), a
    /// `dim_feedforward` whose weights fit in memory (0 is accepted, as in PyTorch: the
    /// feed-forward block then gives `linear2.bias` alone), `layer_norm_eps` finite and `>= 0`.
    ///
    /// [`MhaConfig::validate`]: crate::MhaConfig::validate
    pub fn validate(&self) -> crate::Result<()> {
        // The attention's rules, reported as the layer's (by its arguments' names).
        self.mha_config().validate().map_err(|e| match e {
            crate::Error::Config { arg, msg, .. } => {
                let arg = match arg {
                    "embed_dim" => "d_model",
                    "num_heads" => "nhead",
                    other => other,
                };
                crate::Error::Config { op: "TransformerLayer", arg, msg }
            }
            e => e,
        })?;
        let err = |arg, msg| crate::Error::Config { op: "TransformerLayer", arg, msg };
        let ff = self.d_model.checked_mul(self.dim_feedforward).and_then(|n| n.checked_mul(8));
        if ff.is_none_or(|b| b > isize::MAX as usize) {
            return Err(err(
                "dim_feedforward",
                format!(
                    "d_model x dim_feedforward must be addressable, got d_model={} and dim_feedforward={}",
                    self.d_model, self.dim_feedforward
                ),
            ));
        }
        crate::layer_norm::check_eps(self.layer_norm_eps, "TransformerLayer", "layer_norm_eps")?;
        Ok(())
    }

    /// The multiply-adds of the largest product of a layer call on `elements` input elements
    /// (the packed projection or the feed-forward block's): a larger call hops onto rayon's
    /// pool once ([`crate::pool`]).
    pub(crate) fn layer_macs(&self, elements: usize) -> usize {
        let rows = elements / self.d_model.max(1);
        let widest = self.dim_feedforward.max(self.d_model.saturating_mul(3));
        crate::pool::product_macs(rows, self.d_model, widest)
    }

    /// The multiply-adds of the largest operation of a cached step of `x` through a layer of
    /// this configuration whose self-attention is `attn` over `cache`: the projections, the
    /// feed-forward block's products or the attention over the cache ([`crate::pool`]'s one
    /// hop per step).
    pub(crate) fn step_macs(
        &self,
        attn: &crate::MultiheadAttention,
        x: &candle_core::Tensor,
        cache: &crate::KvCache,
    ) -> usize {
        let rows = x.elem_count() / self.d_model.max(1);
        self.layer_macs(x.elem_count()).max(attn.step_macs(rows, cache))
    }

    pub(crate) fn mha_config(&self) -> crate::MhaConfig {
        crate::MhaConfig::new(self.d_model, self.nhead)
            .with_dropout(self.dropout)
            .with_bias(self.bias)
            .with_batch_first(self.batch_first)
    }
}

/// The final LayerNorm of an encoder or decoder stack (`norm=nn.LayerNorm(d_model, eps, bias=bias)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormConfig {
    /// `eps`. Default 1e-5.
    pub eps: f64,
    /// `bias`. Default true.
    pub bias: bool,
}

impl Default for NormConfig {
    fn default() -> Self {
        Self { eps: 1e-5, bias: true }
    }
}

/// The options of a layer's attention call built from PyTorch's layer arguments.
pub(crate) fn mask_options(
    mask: Option<&crate::Mask>,
    kpm: Option<&crate::Mask>,
    is_causal: bool,
) -> crate::MhaOptions {
    let mut opts = crate::MhaOptions::default().need_weights(false).is_causal(is_causal);
    opts.attn_mask = mask.cloned();
    opts.key_padding_mask = kpm.cloned();
    opts
}

/// The dtype a layer with parameters of dtype `params` casts its float masks (and a decoder's
/// memory) to under [`autocast`](crate::autocast): `Some(dt)` inside an autocast to the
/// layer's own bf16 or f16 with an `input` of that dtype, where PyTorch's autocast casts what
/// the layer's attention reads to `dt`. An input of another dtype is left to be refused, as
/// PyTorch's LayerNorm refuses an f32 input to a bf16 layer (outside its fused eval path).
pub(crate) fn autocast_into(
    params: candle_core::DType,
    input: candle_core::DType,
) -> Option<candle_core::DType> {
    crate::precision::autocast_into(params).filter(|dt| *dt == input)
}

/// Refuses, under an autocast to a layer's own reduced dtype, an input of another float dtype
/// up front (PyTorch's LayerNorm refuses an f32 input to a bf16 layer), rather than after its
/// attention has cast it, where only the residual sum's dtypes would be named.
pub(crate) fn refuse_uncast_input(
    (op, arg): (&'static str, &'static str),
    params: candle_core::DType,
    input: candle_core::DType,
) -> crate::Result<()> {
    match crate::precision::autocast_into(params) {
        Some(dt) if input != dt && input.is_float() => Err(crate::Error::DType {
            op,
            arg,
            msg: format!(
                "the layer's parameters are {dt:?} and autocast is to {dt:?}, but the input is \
                 {input:?}, which the layer's LayerNorm cannot read (PyTorch refuses it too); \
                 convert it first (multihead::cast(&x, DType::{dt:?})), or keep the layer in \
                 f32, whose products autocast then rounds"
            ),
        }),
        _ => Ok(()),
    }
}

/// How far apart two layers' dropout keys are: layer `i` of a stack takes `offset + i·2^48`,
/// so keys a caller advances by one per step never meet another layer's.
pub(crate) const LAYER_KEY_STRIDE: u64 = 1 << 48;

/// `opts` for layer `i` of a stack: a dropout key `(seed, offset)` becomes
/// `(seed, offset + i·2^48)`, so that the layers do not share a dropout mask, nor meet the
/// keys of the caller's next steps.
pub(crate) fn layer_key(opts: &crate::MhaOptions, i: usize) -> crate::MhaOptions {
    let mut o = opts.clone();
    o.dropout_key = opts.dropout_key.map(|k| crate::random::DropoutKey {
        seed: k.seed,
        offset: k.offset.wrapping_add((i as u64).wrapping_mul(LAYER_KEY_STRIDE)),
    });
    o
}

/// Refuses `static_k`/`static_v` in a layer's options (`which`: the argument's name): the
/// layer's own projections would be skipped (in self-attention, or in every layer of a
/// stack), silently changing the model.
pub(crate) fn refuse_static_kv(
    op: &'static str,
    which: &'static str,
    opts: &crate::MhaOptions,
) -> crate::Result<()> {
    if opts.static_k.is_none() && opts.static_v.is_none() {
        return Ok(());
    }
    Err(crate::Error::Config {
        op,
        arg: which,
        msg: "static_k/static_v would replace the layer's own key and value projections (in \
              self-attention, or in every layer of a stack); give them to \
              MultiheadAttention::forward, or to one TransformerDecoderLayer's cross_opts"
            .into(),
    })
}

/// A layer's own dropouts (after each attention block, and twice in the feed-forward block)
/// and where their keys come from: the layer's key (its self-attention options'
/// `dropout_key`) when there is one, each dropout at its own offset from it (and a decoder's
/// cross-attention, when its options have no key of their own), so that a keyed call draws
/// nothing from the global generator and gives the same numbers whatever other threads draw;
/// the global generator otherwise, as PyTorch's layers do.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LayerDropout {
    p: f64,
    training: bool,
    key: Option<crate::random::DropoutKey>,
}

/// Which of a layer's dropouts: the offset of its key from the layer's key is `slot · 2^40`
/// (stacks keep layers `2^48` apart, so up to 255 slots never reach the next layer's key).
#[derive(Clone, Copy, Debug)]
pub(crate) enum DropoutSlot {
    SelfBlock = 1,
    CrossBlock = 2,
    FeedForwardInner = 3,
    FeedForwardOutput = 4,
    /// The cross-attention's own attention dropout, when its options carry no key.
    CrossAttention = 5,
}

impl LayerDropout {
    pub(crate) fn new(p: f64, training: bool, key: Option<crate::random::DropoutKey>) -> Self {
        Self { p, training, key }
    }

    /// No dropout (inference, incremental decoding).
    pub(crate) fn off() -> Self {
        Self { p: 0.0, training: false, key: None }
    }

    /// The key dropout `slot` of the layer uses, if the layer is keyed.
    pub(crate) fn key(&self, slot: DropoutSlot) -> Option<crate::random::DropoutKey> {
        self.key.map(|k| crate::random::DropoutKey {
            seed: k.seed,
            offset: k.offset.wrapping_add((slot as u64) << 40),
        })
    }

    /// Whether [`apply`](Self::apply) returns its input as it is (eval, or `p = 0`).
    pub(crate) fn is_identity(&self) -> bool {
        !self.training || self.p == 0.0
    }

    // Mirrors torch.nn.Dropout as a layer applies it.
    pub(crate) fn apply(
        &self,
        x: &candle_core::Tensor,
        slot: DropoutSlot,
    ) -> crate::Result<candle_core::Tensor> {
        match self.key(slot) {
            Some(k) if self.training && self.p > 0.0 => {
                crate::activation::dropout_with_key(x, self.p, k)
            }
            _ => crate::activation::dropout(x, self.p, self.training),
        }
    }
}

/// PyTorch's names for the mask arguments an attention block receives, by which its errors
/// name them: `attn_mask`, `key_padding_mask` and `is_causal` of the `MultiheadAttention` call.
#[derive(Clone, Copy)]
pub(crate) struct MaskNames(pub [(&'static str, &'static str); 3]);

/// An encoder layer's self-attention: `src_mask`, `src_key_padding_mask`, `is_causal`.
pub(crate) const SRC_MASKS: MaskNames = MaskNames([
    ("attn_mask", "src_mask"),
    ("key_padding_mask", "src_key_padding_mask"),
    ("is_causal", "is_causal"),
]);
/// A decoder layer's self-attention.
pub(crate) const TGT_MASKS: MaskNames = MaskNames([
    ("attn_mask", "tgt_mask"),
    ("key_padding_mask", "tgt_key_padding_mask"),
    ("is_causal", "tgt_is_causal"),
]);
/// A decoder layer's cross-attention.
pub(crate) const MEMORY_MASKS: MaskNames = MaskNames([
    ("attn_mask", "memory_mask"),
    ("key_padding_mask", "memory_key_padding_mask"),
    ("is_causal", "memory_is_causal"),
]);

/// `dropout(attn(x, mem, mem, need_weights=False)[0])`: a layer's attention block (`opts` as
/// given, but without weights: a layer returns none); its errors name the masks by `names`.
pub(crate) fn attention_block(
    attn: &crate::MultiheadAttention,
    (x, mem): (&candle_core::Tensor, &candle_core::Tensor),
    opts: &crate::MhaOptions,
    (drop, slot): (&LayerDropout, DropoutSlot),
    names: MaskNames,
) -> crate::Result<candle_core::Tensor> {
    let out = if opts.need_weights {
        let opts = crate::MhaOptions { need_weights: false, ..opts.clone() };
        attn.forward(x, mem, mem, &opts)
    } else {
        attn.forward(x, mem, mem, opts)
    };
    let out = out.map_err(|e| e.renamed(&names.0))?;
    drop.apply(&out.output, slot)
}

/// `dropout(linear2(dropout(activation(linear1(x)))))`: a layer's feed-forward block.
pub(crate) fn feed_forward(
    linear1: &crate::Linear,
    linear2: &crate::Linear,
    activation: Activation,
    drop: &LayerDropout,
    x: &candle_core::Tensor,
) -> crate::Result<candle_core::Tensor> {
    if drop.is_identity() {
        if let Some(y) = crate::linear::rounded_feed_forward(linear1, linear2, activation, x)? {
            return drop.apply(&y, DropoutSlot::FeedForwardOutput);
        }
    }
    // The activation rides in the product's op (one pass and one graph node fewer).
    let h = linear1.forward_act(x, activation)?;
    let h = drop.apply(&h, DropoutSlot::FeedForwardInner)?;
    drop.apply(&linear2.forward(&h)?, DropoutSlot::FeedForwardOutput)
}

/// The parameters of one layer: attention blocks (`4E² + 4E` each), the feed-forward block
/// (`2·E·F + F + E`) and the norms (`2E` each).
fn layer_params(cfg: &LayerConfig, decoder: bool) -> Option<usize> {
    let (e, f) = (cfg.d_model, cfg.dim_feedforward);
    let attn = e.checked_mul(e)?.checked_mul(4)?.checked_add(e.checked_mul(4)?)?;
    let ff = e.checked_mul(f)?.checked_mul(2)?.checked_add(f)?.checked_add(e)?;
    let (blocks, norms) = if decoder { (2, 3) } else { (1, 2) };
    attn.checked_mul(blocks)?.checked_add(ff)?.checked_add(e.checked_mul(2 * norms)?)
}

/// Checks up front that a stack's parameters fit in memory, so that an absurd `num_layers`
/// is an error at once instead of a long allocation loop.
pub(crate) fn check_stack_size(
    cfg: &LayerConfig,
    num_layers: usize,
    decoder: bool,
    dtype: candle_core::DType,
) -> crate::Result<()> {
    cfg.validate()?;
    let total = layer_params(cfg, decoder).and_then(|p| p.checked_mul(num_layers));
    let total = total.ok_or_else(|| crate::Error::Alloc {
        op: "TransformerStack",
        what: "parameters",
        msg: format!("{num_layers} layers of d_model {} overflow usize", cfg.d_model),
    })?;
    crate::alloc::ensure(
        "TransformerStack",
        "parameters",
        &[total],
        dtype,
        1,
        "use fewer layers or smaller layers",
    )
}

/// Builds `num_layers` layers under `layers.{i}` and the optional final norm under `norm`:
/// the shared constructor of [`TransformerEncoder`] and [`TransformerDecoder`].
pub(crate) fn build_stack<T>(
    num_layers: usize,
    d_model: usize,
    norm: Option<NormConfig>,
    vb: &candle_nn::VarBuilder,
    layer: impl Fn(candle_nn::VarBuilder) -> crate::Result<T>,
) -> crate::Result<(Vec<T>, Option<crate::LayerNorm>)> {
    let layers = (0..num_layers)
        .map(|i| layer(vb.pp(format!("layers.{i}"))))
        .collect::<crate::Result<Vec<_>>>()?;
    let norm = match norm {
        Some(n) => Some(crate::LayerNorm::new(d_model, n.eps, n.bias, vb.pp("norm"))?),
        None => None,
    };
    Ok((layers, norm))
}

/// The keys of a stack: `layers.{i}.*` then `norm.*`.
pub(crate) fn stack_parameters<T: crate::NamedParameters>(
    layers: &[T],
    norm: Option<&crate::LayerNorm>,
) -> Vec<(String, candle_core::Tensor)> {
    use crate::NamedParameters;
    let mut v = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        v.extend(prefixed(&format!("layers.{i}"), l.named_parameters()));
    }
    if let Some(n) = norm {
        v.extend(prefixed("norm", n.named_parameters()));
    }
    v
}

/// Applies the optional final norm of a stack.
pub(crate) fn final_norm(
    norm: Option<&crate::LayerNorm>,
    x: candle_core::Tensor,
) -> crate::Result<candle_core::Tensor> {
    match norm {
        Some(n) => n.forward(&x),
        None => Ok(x),
    }
}

/// Prefixes relative parameter names.
pub(crate) fn prefixed(
    prefix: &str,
    params: Vec<(String, candle_core::Tensor)>,
) -> Vec<(String, candle_core::Tensor)> {
    params.into_iter().map(|(k, t)| (format!("{prefix}.{k}"), t)).collect()
}

/// The sequence length of a Transformer input (`_get_seq_len`).
pub(crate) fn seq_len(x: &candle_core::Tensor, batch_first: bool) -> crate::Result<usize> {
    Ok(match x.rank() {
        2 => x.dim(0)?,
        _ => x.dim(if batch_first { 1 } else { 0 })?,
    })
}

/// PyTorch's `_detect_is_causal_mask`: an explicit hint wins; otherwise the mask is causal when
/// it is `(sz, sz)` and equals the `-inf`-above-the-diagonal mask (a bool mask after conversion).
/// Errors name `who`: the stack's forward and its argument (`mask`, `tgt_mask`).
pub(crate) fn detect_is_causal(
    mask: Option<&crate::Mask>,
    hint: Option<bool>,
    sz: usize,
    who: (&'static str, &'static str),
) -> crate::Result<bool> {
    if let Some(h) = hint {
        return Ok(h);
    }
    let Some(mask) = mask else { return Ok(false) };
    mask.check_kind(who.0, who.1)?;
    if mask.dims() != [sz, sz] {
        return Ok(false);
    }
    crate::alloc::ensure(
        who.0,
        who.1,
        &[sz, sz],
        candle_core::DType::F64,
        2,
        "pass is_causal explicitly to skip the detection, or use a smaller mask",
    )?;
    let t = mask.tensor();
    let vals: Vec<f64> = match mask {
        crate::Mask::Bool(t) => t
            .flatten_all()?
            .to_vec1::<u8>()?
            .into_iter()
            .map(|b| if b != 0 { f64::NEG_INFINITY } else { 0.0 })
            .collect(),
        crate::Mask::Float(_) => {
            t.flatten_all()?.to_dtype(candle_core::DType::F64)?.to_vec1::<f64>()?
        }
    };
    for i in 0..sz {
        for j in 0..sz {
            let want = if j > i { f64::NEG_INFINITY } else { 0.0 };
            if vals[i * sz + j] != want {
                return Ok(false);
            }
        }
    }
    Ok(true)
}
