use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use super::{
    build_stack, detect_is_causal, final_norm, layer_key, mask_options, seq_len, stack_parameters,
    LayerConfig, NormConfig, TransformerEncoderLayer,
};
use crate::error::Result;
use crate::layer_norm::LayerNorm;
use crate::mask::Mask;
use crate::{MhaOptions, NamedParameters};

/// `torch.nn.TransformerEncoder`: `num_layers` encoder layers and an optional final LayerNorm.
///
/// Keys: `layers.{i}.*` and `norm.*`. Fresh layers are initialised independently (PyTorch
/// deep-copies one layer, so its layers start identical; load a state_dict to match exactly).
///
/// PyTorch behaviours mirrored:
/// * `is_causal = None` detects a causal `mask` of size `(S, S)` (float `-inf` above the
///   diagonal, or the bool equivalent) and passes `is_causal = true` to the layers.
/// * In inference ([`eval`](Self::eval) inside [`no_grad`](crate::no_grad), PyTorch's eval
///   under `torch.no_grad()`), with a left-aligned `src_key_padding_mask`, no `mask`,
///   batched input and an eligible layer (post-norm, `batch_first`, `bias`, even `nhead`),
///   PyTorch runs a nested-tensor path whose padded positions come out as 0 before the final
///   norm. This encoder returns the same. [`set_enable_nested_tensor`](Self::set_enable_nested_tensor)
///   turns the path off (PyTorch's `enable_nested_tensor=False`), and
///   [`set_mask_check`](Self::set_mask_check) mirrors `mask_check=False`: the mask is then not
///   checked for left alignment, and, as in PyTorch, row `b` keeps its first `n_b` positions,
///   `n_b` being its count of unpadded ones, wherever the mask puts them.
///
/// # Shapes
/// * src `(S, N, E)`, `(N, S, E)` with `batch_first`, or `(S, E)`; mask `(S, S)` or
///   `(N·nhead, S, S)`; src_key_padding_mask `(N, S)` or `(S,)`. Output like src.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::transformer::{LayerConfig, NormConfig, TransformerEncoder};
///
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let cfg = LayerConfig::new(8, 2).with_dim_feedforward(16);
/// let enc = TransformerEncoder::new(cfg, 2, Some(NormConfig::default()), vb)?;
/// let x = Tensor::randn(0f32, 1.0, (5, 3, 8), &Device::Cpu)?;
/// let causal = multihead::generate_square_subsequent_mask(5, DType::F32, &Device::Cpu)?;
/// let y = enc.forward(&x, Some(&multihead::Mask::Float(causal)), None, None)?;
/// assert_eq!(y.dims(), &[5, 3, 8]);
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct TransformerEncoder {
    pub(super) layers: Vec<TransformerEncoderLayer>,
    pub(super) norm: Option<LayerNorm>,
    training: bool,
    enable_nested_tensor: bool,
    mask_check: bool,
}

impl TransformerEncoder {
    /// Builds `num_layers` layers under `layers.{i}` and the optional final norm under `norm`.
    pub fn new(
        layer: LayerConfig,
        num_layers: usize,
        norm: Option<NormConfig>,
        vb: VarBuilder,
    ) -> Result<Self> {
        super::check_stack_size(&layer, num_layers, false, vb.dtype())?;
        let (layers, norm) = build_stack(num_layers, layer.d_model, norm, &vb, |vb| {
            TransformerEncoderLayer::new(layer.clone(), vb)
        })?;
        Ok(Self { layers, norm, training: true, enable_nested_tensor: true, mask_check: true })
    }

    /// The layers.
    pub fn layers(&self) -> &[TransformerEncoderLayer] {
        &self.layers
    }

    /// Sets training mode on every layer.
    pub fn train(&mut self, mode: bool) {
        self.training = mode;
        self.layers.iter_mut().for_each(|l| l.train(mode));
    }

    /// Sets evaluation mode.
    pub fn eval(&mut self) {
        self.train(false);
    }

    /// PyTorch's `enable_nested_tensor` (default `true`).
    pub fn set_enable_nested_tensor(&mut self, on: bool) {
        self.enable_nested_tensor = on;
    }

    /// PyTorch's `mask_check` (default `true`): whether the nested-tensor path first checks
    /// that the padding mask is left-aligned (every row `False…False True…True`) and runs the
    /// layers on the full sequence otherwise. With `false` the path runs on any mask, and
    /// row `b` keeps its first `n_b` positions (`n_b` = its unpadded count), as PyTorch's
    /// `_nested_tensor_from_mask` does without the check.
    pub fn set_mask_check(&mut self, on: bool) {
        self.mask_check = on;
    }

    fn nested_path_eligible(&self) -> bool {
        let Some(first) = self.layers.first() else {
            return false;
        };
        let c = first.config();
        self.enable_nested_tensor && !c.norm_first && c.batch_first && c.bias && c.nhead % 2 == 0
    }

    /// Runs the stack. `is_causal = None` detects a causal mask, as PyTorch does.
    // Mirrors torch.nn.TransformerEncoder.forward.
    pub fn forward(
        &self,
        src: &Tensor,
        mask: Option<&Mask>,
        src_key_padding_mask: Option<&Mask>,
        is_causal: Option<bool>,
    ) -> Result<Tensor> {
        let batch_first = self.layers.first().map(|l| l.config().batch_first).unwrap_or(false);
        let who = ("TransformerEncoder.forward", "mask");
        let is_causal = detect_is_causal(mask, is_causal, seq_len(src, batch_first)?, who)?;
        self.forward_with(src, &mask_options(mask, src_key_padding_mask, is_causal))
    }

    /// Runs the stack with the options of a [`MultiheadAttention`](crate::MultiheadAttention)
    /// call for every layer's self-attention, as
    /// [`TransformerEncoderLayer::forward_with`] runs one layer: `opts.attn_mask`,
    /// `opts.key_padding_mask` and `opts.is_causal` are PyTorch's `mask`,
    /// `src_key_padding_mask` and `is_causal` (taken as given: no causal-mask detection), and
    /// the variants and sinks apply in every layer. The nested-tensor path of inference applies
    /// as in [`forward`](Self::forward). With `opts.dropout_key = Some((seed, offset))`, layer
    /// `i`'s attention dropout takes `(seed, offset + i·2^48)`, so the layers do not share a
    /// mask (nor meet keys a caller advances by one per step). `static_k`/`static_v` are
    /// refused (an `Error::Config`): they would replace every layer's own projections.
    ///
    /// # Shapes
    /// * `src` as in [`forward`](Self::forward); the options' shapes as in
    ///   [`MhaOptions`] with `L = S`.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::transformer::{LayerConfig, TransformerEncoder};
    /// use multihead::{MhaOptions, Variants};
    ///
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    /// let enc = TransformerEncoder::new(LayerConfig::new(8, 2).with_dim_feedforward(16), 2, None, vb)?;
    /// // ALiBi instead of position embeddings, two heads.
    /// let variants = Variants::default().alibi(Variants::alibi_slopes_for(2));
    /// let x = Tensor::randn(0f32, 1.0, (5, 3, 8), &Device::Cpu)?;
    /// let y = enc.forward_with(&x, &MhaOptions { variants, ..Default::default() })?;
    /// assert_eq!(y.dims(), &[5, 3, 8]);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.TransformerEncoder.forward, with the attention variants.
    pub fn forward_with(&self, src: &Tensor, opts: &MhaOptions) -> Result<Tensor> {
        super::refuse_static_kv("TransformerEncoder.forward_with", "opts", opts)?;
        let macs = self.layers.first().map_or(0, |l| l.config().layer_macs(src.elem_count()));
        crate::pool::on_pool_for(macs, || self.forward_here(src, opts))
    }

    /// [`forward_with`](Self::forward_with) on this thread.
    fn forward_here(&self, src: &Tensor, opts: &MhaOptions) -> Result<Tensor> {
        let layer_opts = |i: usize, kpm: Option<Mask>| {
            let mut o = layer_key(opts, i);
            if let Some(k) = kpm {
                o.key_padding_mask = Some(k);
            }
            o
        };
        let mut x = src.clone();
        if let Some(p) = self.nested_padding(src, opts)? {
            // The nested path drops padded tokens (nonzero kpm entries) entirely: their values,
            // NaN or infinite ones included, never reach the other tokens, and their outputs
            // are +0. Here they are zeroed on the way in, masked out of attention, and replaced
            // by +0 on the way out.
            let pad = p.unsqueeze(2)?.broadcast_as(x.shape())?;
            let zeros = x.zeros_like()?;
            x = pad.where_cond(&zeros, &x)?;
            for (i, layer) in self.layers.iter().enumerate() {
                let o = layer_opts(i, Some(Mask::Bool(p.clone())));
                x = layer.forward_with(&x, &MhaOptions { is_causal: false, ..o })?;
            }
            x = pad.where_cond(&zeros, &x)?;
        } else {
            for (i, layer) in self.layers.iter().enumerate() {
                x = layer.forward_with(&x, &layer_opts(i, None))?;
            }
        }
        final_norm(self.norm.as_ref(), x)
    }

    /// The padding of PyTorch's nested-tensor ("sparsity") fast path, in inference only: the
    /// positions it drops, `(N, S)`, or `None` where the path does not apply.
    fn nested_padding(&self, src: &Tensor, opts: &MhaOptions) -> Result<Option<Tensor>> {
        let Some(kpm) = &opts.key_padding_mask else {
            return Ok(None);
        };
        let eligible = !self.training
            && !crate::mode::grad_enabled()
            && opts.attn_mask.is_none()
            && src.rank() == 3
            && kpm.dims() == [src.dim(0)?, src.dim(1)?]
            && match kpm.is_bool() {
                true => kpm.tensor().dtype() == DType::U8,
                false => crate::precision::float_mask_takes(kpm.tensor().dtype(), src.dtype()),
            }
            && self.nested_path_eligible();
        if !eligible {
            return Ok(None);
        }
        // The path's copies, checked before they are made (a broadcast view's full size: a
        // 256 GiB mask aborted the process before 2026-12-07): the padding as bytes (and its
        // left-aligned form), and the zeroed input and output beside the input.
        let op = "TransformerEncoder.forward";
        let hint =
            "the nested-tensor path copies the padding mask and the input; pass smaller ones";
        crate::alloc::ensure(op, "src_key_padding_mask", kpm.dims(), DType::U8, 3, hint)?;
        crate::alloc::ensure(op, "src", src.dims(), src.dtype(), 3, hint)?;
        let p = kpm.tensor().ne(0f64)?;
        if self.mask_check {
            Ok(left_aligned(&p)?.then_some(p))
        } else {
            Ok(Some(first_unpadded(&p)?))
        }
    }
}

/// The left-aligned mask with each row's count of unpadded positions: row `b` of the result
/// is `False` at its first `n_b` positions and `True` after them.
fn first_unpadded(p: &Tensor) -> Result<Tensor> {
    let (n, s) = p.dims2()?;
    let v = p.to_dtype(DType::U8)?.flatten_all()?.to_vec1::<u8>()?;
    let mut out = crate::alloc::try_zeros::<u8>(n * s, "TransformerEncoder mask_check=false")?;
    for (row, src) in out.chunks_exact_mut(s.max(1)).zip(v.chunks_exact(s.max(1))) {
        let kept = src.iter().filter(|&&x| x == 0).count();
        row[kept..].fill(1);
    }
    Ok(Tensor::from_vec(out, (n, s), p.device())?)
}

/// Whether every row of a `(N, S)` padding mask is `False…False True…True`.
fn left_aligned(p: &Tensor) -> Result<bool> {
    let (n, s) = p.dims2()?;
    let v = p.to_dtype(DType::U8)?.flatten_all()?.to_vec1::<u8>()?;
    Ok((0..n).all(|i| v[i * s..(i + 1) * s].windows(2).all(|w| w[0] <= w[1])))
}

impl NamedParameters for TransformerEncoder {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        stack_parameters(&self.layers, self.norm.as_ref())
    }
}
