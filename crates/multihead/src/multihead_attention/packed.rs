//! Self-attention over a packed batch of variable-length sequences (FlashAttention's
//! `cu_seqlens` convention): `(T, E)` rows, sequence `b` at rows `cu[b]..cu[b + 1]`.

use candle_core::{DType, Tensor};

use super::{MultiheadAttention, OP};
use crate::error::{fmt_shape, Error, Result};
use crate::functional::{CuSeqlens, InProj, SdpaOptions};
use crate::linear::linear;
use crate::mode::Backend;
use crate::random::DropoutKey;

/// Options of the packed forwards ([`MultiheadAttention::forward_packed`],
/// [`TransformerEncoderLayer::forward_packed`](crate::transformer::TransformerEncoderLayer::forward_packed)).
/// The default is plain bidirectional attention within each sequence.
///
/// # Example
/// ```
/// use multihead::multihead_attention::PackedOptions;
/// let o = PackedOptions::default().is_causal(true);
/// assert!(o.is_causal);
/// ```
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct PackedOptions {
    /// Causal attention within each sequence (top-left; `variants.align` moves it).
    pub is_causal: bool,
    /// Soft cap, window, alignment and ALiBi, per sequence (not `kv_lengths`: the offsets
    /// give each sequence's keys).
    pub variants: crate::Variants,
    /// The dropout key (training with dropout); `None` draws the next one.
    pub dropout_key: Option<DropoutKey>,
    /// Which implementation runs.
    pub backend: Backend,
    /// Attention sinks (gpt-oss), one learned logit per head, `(H,)` in the module's dtype;
    /// differentiable.
    pub sinks: Option<Tensor>,
}

impl PackedOptions {
    /// Sets `is_causal`.
    pub fn is_causal(mut self, causal: bool) -> Self {
        self.is_causal = causal;
        self
    }
    /// Sets the variants.
    pub fn variants(mut self, variants: crate::Variants) -> Self {
        self.variants = variants;
        self
    }
    /// Sets the dropout key.
    pub fn dropout_key(mut self, key: DropoutKey) -> Self {
        self.dropout_key = Some(key);
        self
    }
    /// Sets the backend.
    pub fn backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }
    /// Sets the attention sinks, `(H,)`.
    pub fn sinks(mut self, sinks: Tensor) -> Self {
        self.sinks = Some(sinks);
        self
    }
}

impl MultiheadAttention {
    /// Self-attention over a packed batch: `x` holds the sequences' tokens one after another
    /// (`cu`: where each starts), and each token attends to its own sequence only. The same
    /// numbers as [`forward`](Self::forward) on each sequence alone (or on a padded batch with
    /// its key padding mask), without computing padding. The module's dropout applies in
    /// training mode. Not with `bias_k`/`bias_v`, `add_zero_attn` or other `kdim`/`vdim`.
    ///
    /// # Shapes
    /// * `x` `(T, E)`: `T` tokens of all sequences; output `(T, E)`.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::functional::CuSeqlens;
    /// use multihead::multihead_attention::PackedOptions;
    /// use multihead::{MhaConfig, MultiheadAttention};
    ///
    /// let vm = VarMap::new();
    /// let mha = MultiheadAttention::new(MhaConfig::new(8, 2), VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
    /// let x = Tensor::randn(0f32, 1.0, (7, 8), &Device::Cpu)?; // sequences of 3 and 4 tokens
    /// let y = mha.forward_packed(&x, &CuSeqlens::from_lengths(&[3, 4]), &PackedOptions::default())?;
    /// assert_eq!(y.dims(), &[7, 8]);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    // Mirrors torch.nn.MultiheadAttention.forward on each sequence (flash_attn_varlen_func's packing).
    pub fn forward_packed(
        &self,
        x: &Tensor,
        cu: &CuSeqlens,
        opts: &PackedOptions,
    ) -> Result<Tensor> {
        self.packed_rows(x, cu, opts, false)
    }

    /// [`forward_packed`](Self::forward_packed) of a bf16 module's f32 twin without the twin:
    /// `x` f32 (the twin's input), the bf16 projection weights read as they are, each product
    /// written in f32 as the twin's f32 product is (`crate::linear::linear_to`, inside
    /// [`rounded_products`](crate::mode::rounded_products)): the twin's values.
    pub(crate) fn forward_packed_f32_of_bf16(
        &self,
        x: &Tensor,
        cu: &CuSeqlens,
        opts: &PackedOptions,
    ) -> Result<Tensor> {
        self.packed_rows(x, cu, opts, true)
    }

    /// The packed call; `twin`: `x` is the f32 input of this bf16 module's twin.
    fn packed_rows(
        &self,
        x: &Tensor,
        cu: &CuSeqlens,
        opts: &PackedOptions,
        twin: bool,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (e, h, hk, hd) = (cfg.embed_dim, cfg.num_heads, cfg.kv_heads(), cfg.head_dim());
        if x.rank() != 2 || x.dim(1)? != e {
            let msg = format!("expected packed rows (T, E = {e}), got {}", fmt_shape(x.dims()));
            return Err(Error::Shape { op: OP, arg: "x", msg });
        }
        // The twin's rows are f32 for bf16 parameters; a call's rows, the parameters' dtype.
        let wrong_dtype = match twin {
            true => x.dtype() != DType::F32 || self.dtype() != DType::BF16,
            false => x.dtype() != self.dtype(),
        };
        if wrong_dtype {
            let msg = format!("x is {:?} but the parameters are {:?}", x.dtype(), self.dtype());
            return Err(Error::DType { op: OP, arg: "x", msg });
        }
        if self.bias_k.is_some() || cfg.add_zero_attn || cfg.kdim() != e || cfg.vdim() != e {
            let msg = "a packed batch is self-attention without bias_k/bias_v, add_zero_attn or other kdim/vdim; use forward on a padded batch".to_string();
            return Err(Error::Config { op: OP, arg: "forward_packed", msg });
        }
        if let Some(t) = &opts.sinks {
            // Checked before any work, naming this call.
            crate::functional::sdpa::check_sinks(OP, t, x, Some(h))?;
        }
        let p = self.params()?;
        let kv = hk * hd;
        let be = opts.backend;
        let linear = |x: &Tensor, w: &Tensor, b: Option<&Tensor>, arg: &'static str| match twin {
            true => crate::linear::linear_to(x, w, b, (OP, arg), be, DType::F32),
            false => linear(x, w, b, OP, arg, be),
        };
        let bias = |start: usize, len: usize| -> Result<Option<Tensor>> {
            Ok(match p.in_proj_bias {
                Some(b) => Some(b.narrow(0, start, len)?),
                None => None,
            })
        };
        let (q, k, v) = match p.in_proj {
            InProj::Packed(w) => {
                let qkv = linear(x, w, p.in_proj_bias, "x")?;
                (qkv.narrow(1, 0, e)?, qkv.narrow(1, e, kv)?, qkv.narrow(1, e + kv, kv)?)
            }
            InProj::Separate { q, k, v } => (
                linear(x, q, bias(0, e)?.as_ref(), "x")?,
                linear(x, k, bias(e, kv)?.as_ref(), "x")?,
                linear(x, v, bias(e + kv, kv)?.as_ref(), "x")?,
            ),
        };
        let mut sdpa = SdpaOptions::default()
            .is_causal(opts.is_causal)
            .enable_gqa(h != hk)
            .variants(opts.variants.clone())
            .backend(be);
        sdpa.sinks = opts.sinks.clone();
        if self.training && cfg.dropout > 0.0 {
            sdpa = sdpa.dropout_p(cfg.dropout);
            sdpa.dropout_key = opts.dropout_key;
        }
        let attn = crate::functional::varlen::varlen_rows((&q, &k, &v), (h, hk), cu, &sdpa)?;
        linear(&attn, p.out_proj_weight, p.out_proj_bias, "attn_output")
    }
}
