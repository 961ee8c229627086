//! `torch.nn.MultiheadAttention`.

mod incremental;
mod packed;

pub use incremental::{CachedOptions, StaticKv};
pub use packed::PackedOptions;

use candle_core::{DType, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::error::{Error, Result};
use crate::functional::{
    mha_forward_impl, mha_plan_impl, Aliasing, InProj, MhaOptions, MhaOutput, MhaParams,
};
use crate::fused::dispatch::Plan;
use crate::linear::Linear;
use crate::mask::Mask;
use crate::state_dict::{get_param, NamedParameters};

const OP: &str = "MultiheadAttention";

/// The constructor arguments of [`MultiheadAttention`], with PyTorch's defaults.
///
/// `MhaConfig::new(embed_dim, num_heads)` then `with_*` for the rest. The parameter dtype
/// (PyTorch's `dtype=`) is the dtype of the [`VarBuilder`] the module is built from.
///
/// [`VarBuilder`]: https://docs.rs/candle-nn/0.11/candle_nn/var_builder/type.VarBuilder.html
///
/// # Example
/// ```
/// use multihead::MhaConfig;
/// let cfg = MhaConfig::new(512, 8).with_dropout(0.1).with_batch_first(true);
/// assert_eq!(cfg.head_dim(), 64);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct MhaConfig {
    /// `embed_dim` (E): the query's and the output's feature size. Must be > 0.
    pub embed_dim: usize,
    /// `num_heads` (H): must be > 0 and divide `embed_dim`.
    pub num_heads: usize,
    /// `dropout` on the attention weights in training mode, in `[0, 1)`. Default `0.0`.
    pub dropout: f64,
    /// `bias`: learn `in_proj_bias` and `out_proj.bias`. Default `true`.
    pub bias: bool,
    /// `add_bias_kv`: append learned `bias_k`/`bias_v` to the key and value sequences.
    /// Default `false`.
    pub add_bias_kv: bool,
    /// `add_zero_attn`: append a zero key and value per head. Default `false`.
    pub add_zero_attn: bool,
    /// `kdim`: the key's feature size; `None` means `embed_dim`. Default `None`.
    pub kdim: Option<usize>,
    /// `vdim`: the value's feature size; `None` means `embed_dim`. Default `None`.
    pub vdim: Option<usize>,
    /// `batch_first`: batched input is `(N, L, E)` instead of `(L, N, E)`. Default `false`.
    pub batch_first: bool,
    /// Key/value heads for grouped-query (or, with 1, multi-query) attention; `None` means
    /// `num_heads`, PyTorch's layer. Must be > 0 and divide `num_heads`; query head `h` reads
    /// key/value head `h / (num_heads / num_kv_heads)`, as `F.scaled_dot_product_attention(...,
    /// enable_gqa=True)` does. An extension: PyTorch's `MultiheadAttention` has no such argument.
    pub num_kv_heads: Option<usize>,
}

impl MhaConfig {
    /// `MultiheadAttention(embed_dim, num_heads)` with every other argument at its default.
    pub fn new(embed_dim: usize, num_heads: usize) -> Self {
        Self {
            embed_dim,
            num_heads,
            dropout: 0.0,
            bias: true,
            add_bias_kv: false,
            add_zero_attn: false,
            kdim: None,
            vdim: None,
            batch_first: false,
            num_kv_heads: None,
        }
    }
    /// Sets `dropout`.
    pub fn with_dropout(mut self, p: f64) -> Self {
        self.dropout = p;
        self
    }
    /// Sets `bias`.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
    /// Sets `add_bias_kv`.
    pub fn with_add_bias_kv(mut self, v: bool) -> Self {
        self.add_bias_kv = v;
        self
    }
    /// Sets `add_zero_attn`.
    pub fn with_add_zero_attn(mut self, v: bool) -> Self {
        self.add_zero_attn = v;
        self
    }
    /// Sets `kdim`.
    pub fn with_kdim(mut self, kdim: usize) -> Self {
        self.kdim = Some(kdim);
        self
    }
    /// Sets `vdim`.
    pub fn with_vdim(mut self, vdim: usize) -> Self {
        self.vdim = Some(vdim);
        self
    }
    /// Sets `batch_first`.
    pub fn with_batch_first(mut self, v: bool) -> Self {
        self.batch_first = v;
        self
    }
    /// Sets `num_kv_heads` (grouped-query attention; see the field).
    ///
    /// ```
    /// use multihead::MhaConfig;
    /// let cfg = MhaConfig::new(512, 8).with_num_kv_heads(2);
    /// assert_eq!((cfg.kv_heads(), cfg.kv_dim()), (2, 128));
    /// ```
    pub fn with_num_kv_heads(mut self, k: usize) -> Self {
        self.num_kv_heads = Some(k);
        self
    }
    /// `num_kv_heads`, or `num_heads` when unset.
    pub fn kv_heads(&self) -> usize {
        self.num_kv_heads.unwrap_or(self.num_heads)
    }
    /// The projected key/value width, `kv_heads · head_dim` (`embed_dim` without grouping).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads().saturating_mul(self.head_dim())
    }
    /// `kdim`, or `embed_dim` when unset.
    pub fn kdim(&self) -> usize {
        self.kdim.unwrap_or(self.embed_dim)
    }
    /// `vdim`, or `embed_dim` when unset.
    pub fn vdim(&self) -> usize {
        self.vdim.unwrap_or(self.embed_dim)
    }
    /// `embed_dim / num_heads`.
    pub fn head_dim(&self) -> usize {
        self.embed_dim.checked_div(self.num_heads).unwrap_or(0)
    }
    /// PyTorch's `_qkv_same_embed_dim`: the in-projection is packed into `in_proj_weight`
    /// (never with grouped-query attention, whose key/value projections are narrower).
    pub fn packed(&self) -> bool {
        self.kdim() == self.embed_dim
            && self.vdim() == self.embed_dim
            && self.kv_heads() == self.num_heads
    }
    /// Checks the constructor's rules: positive sizes, divisibility, dropout in `[0, 1)`.
    pub fn validate(&self) -> Result<()> {
        let (e, h) = (self.embed_dim, self.num_heads);
        if e == 0 || h == 0 {
            return Err(Error::Config {
                op: OP,
                arg: if e == 0 { "embed_dim" } else { "num_heads" },
                msg: format!("embed_dim and num_heads must be greater than 0, got embed_dim={e} and num_heads={h} instead"),
            });
        }
        if e % h != 0 {
            return Err(Error::Config {
                op: OP,
                arg: "num_heads",
                msg: format!(
                    "embed_dim must be divisible by num_heads, got embed_dim={e} and num_heads={h}"
                ),
            });
        }
        if self.kdim() == 0 || self.vdim() == 0 {
            return Err(Error::Config {
                op: OP,
                arg: "kdim",
                msg: format!(
                    "kdim and vdim must be greater than 0, got kdim={} and vdim={}",
                    self.kdim(),
                    self.vdim()
                ),
            });
        }
        let k = self.kv_heads();
        if k == 0 || !h.is_multiple_of(k) {
            return Err(Error::Config {
                op: OP,
                arg: "num_kv_heads",
                msg: format!(
                    "num_kv_heads must be greater than 0 and divide num_heads, got num_kv_heads={k} \
                     and num_heads={h}; use a divisor of num_heads (1 is multi-query attention)"
                ),
            });
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::Config {
                op: OP,
                arg: "dropout",
                msg: format!("dropout probability has to be in [0, 1), got {}", self.dropout),
            });
        }
        // Every parameter's element count must fit in usize (and in isize bytes): a size that
        // overflows would otherwise wrap to a small or empty parameter.
        let shapes = [
            ("in_proj_weight", [e.checked_mul(3), Some(e)]),
            ("k_proj_weight", [Some(e), Some(self.kdim())]),
            ("v_proj_weight", [Some(e), Some(self.vdim())]),
        ];
        for (arg, [a, b]) in shapes {
            let bytes = a.zip(b).and_then(|(a, b)| a.checked_mul(b)).and_then(|n| n.checked_mul(8));
            if bytes.is_none_or(|b| b > isize::MAX as usize) {
                return Err(Error::Config {
                    op: OP,
                    arg,
                    msg: format!(
                        "embed_dim={e}, kdim={}, vdim={} give a parameter with more elements than \
                         can be addressed; use smaller sizes",
                        self.kdim(),
                        self.vdim()
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Multi-head attention, `torch.nn.MultiheadAttention`: project query, key and value, run
/// scaled dot-product attention per head, concatenate the heads, project the result.
///
/// Parameters carry PyTorch's state_dict keys and layouts (`in_proj_weight` `(3E, E)`, or
/// `q_proj_weight`/`k_proj_weight`/`v_proj_weight` when `kdim`/`vdim` differ from E;
/// `in_proj_bias`, `bias_k`, `bias_v`, `out_proj.weight`, `out_proj.bias`), so a PyTorch
/// state_dict saved as safetensors loads unchanged.
///
/// With grouped-query attention ([`MhaConfig::with_num_kv_heads`], `K` kv heads of
/// `D = E/H`), the keys stay PyTorch's separate ones with narrower key/value rows:
/// `q_proj_weight` `(E, E)`, `k_proj_weight` `(K·D, kdim)`, `v_proj_weight` `(K·D, vdim)`,
/// `in_proj_bias` `(E + 2·K·D,)` (q, then k, then v), `bias_k`/`bias_v` `(1, 1, K·D)`.
///
/// For generation, [`forward_cached`](Self::forward_cached) attends new tokens over a
/// [`KvCache`](crate::KvCache) and [`static_kv`](Self::static_kv) projects a cross-attention
/// memory once.
///
/// Like a PyTorch module, it starts in **training mode** (which only matters when `dropout > 0`);
/// call [`eval`](Self::eval) for inference.
///
/// Fully masked query rows give a zero attention row (the output row is `out_proj.bias`) and
/// zero weights, on every path. PyTorch returns NaN there when `need_weights=True`; this library
/// returns the same finite answer whatever is asked.
///
/// # Shapes
/// * query `(L, N, E)`, key `(S, N, kdim)`, value `(S, N, vdim)`; `(N, L, E)` etc. with
///   `batch_first`; `(L, E)`, `(S, kdim)`, `(S, vdim)` unbatched.
/// * key_padding_mask `(N, S)` or `(S,)`; attn_mask `(L, S)`, `(N·H, L, S)` or unbatched
///   `(H, L, S)`.
/// * output like the query; weights `(N, L, S')` averaged or `(N, H, L, S')` per head.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::{Mask, MhaConfig, MhaOptions, MultiheadAttention};
///
/// let dev = Device::Cpu;
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev);
/// let mha = MultiheadAttention::new(MhaConfig::new(16, 4).with_batch_first(true), vb)?;
///
/// let x = Tensor::randn(0f32, 1.0, (2, 5, 16), &dev)?; // (N, L, E)
/// let context = Tensor::randn(0f32, 1.0, (2, 7, 16), &dev)?; // (N, S, E)
/// let pad = Mask::Bool(Tensor::new(&[[0u8, 0, 0, 0, 0, 1, 1], [0; 7]], &dev)?);
///
/// let y = mha.self_attention(&x)?; // self-attention
/// let z = mha.cross_attention(&x, &context, Some(&pad))?; // cross-attention with a key mask
/// assert_eq!((y.dims(), z.dims()), (&[2, 5, 16][..], &[2, 5, 16][..]));
///
/// // The full PyTorch call, weights included:
/// let out = mha.forward(&x, &context, &context, &MhaOptions::default().key_padding_mask(pad))?;
/// assert_eq!(out.attn_weights.unwrap().dims(), &[2, 5, 7]);
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct MultiheadAttention {
    cfg: MhaConfig,
    in_proj_weight: Option<Tensor>,
    q_proj_weight: Option<Tensor>,
    k_proj_weight: Option<Tensor>,
    v_proj_weight: Option<Tensor>,
    in_proj_bias: Option<Tensor>,
    bias_k: Option<Tensor>,
    bias_v: Option<Tensor>,
    out_proj: Linear,
    training: bool,
}

impl MultiheadAttention {
    /// Builds the module from `vb` under PyTorch's keys, in `vb`'s dtype.
    ///
    /// Fresh parameters follow PyTorch's initialisation (`docs/pytorch-behaviour.md` §1): Xavier-uniform over the
    /// packed `(3E, E)` in-projection (or per separate weight), `out_proj.weight` uniform in
    /// `±1/√E`, biases zero, `bias_k`/`bias_v` normal with std `1/√E`. They are drawn from
    /// candle's generator, which cannot be seeded: load a state_dict for reproducible weights.
    pub fn new(cfg: MhaConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate()?;
        crate::alloc::expect_float(OP, "dtype", vb.dtype())?;
        let e = cfg.embed_dim;
        let xavier = |fan_out: usize, fan_in: usize| {
            let bound = (6.0 / (fan_in + fan_out) as f64).sqrt();
            Init::Uniform { lo: -bound, up: bound }
        };
        let zero = Init::Const(0.0);
        let kv = cfg.kv_dim();
        let (in_proj_weight, q, k, v) = if cfg.packed() {
            (
                Some(get_param(&vb, &[3 * e, e], "in_proj_weight", xavier(3 * e, e))?),
                None,
                None,
                None,
            )
        } else {
            let (kd, vd) = (cfg.kdim(), cfg.vdim());
            (
                None,
                Some(get_param(&vb, &[e, e], "q_proj_weight", xavier(e, e))?),
                Some(get_param(&vb, &[kv, kd], "k_proj_weight", xavier(kv, kd))?),
                Some(get_param(&vb, &[kv, vd], "v_proj_weight", xavier(kv, vd))?),
            )
        };
        let in_proj_bias = if cfg.bias {
            Some(get_param(&vb, &[e + 2 * kv], "in_proj_bias", zero)?)
        } else {
            None
        };
        let (bias_k, bias_v) = if cfg.add_bias_kv {
            let init = Init::Randn { mean: 0.0, stdev: 1.0 / (e as f64).sqrt() };
            (
                Some(get_param(&vb, &[1, 1, kv], "bias_k", init)?),
                Some(get_param(&vb, &[1, 1, kv], "bias_v", init)?),
            )
        } else {
            (None, None)
        };
        let out_vb = vb.pp("out_proj");
        let bound = 1.0 / (e as f64).sqrt();
        let out_w = get_param(&out_vb, &[e, e], "weight", Init::Uniform { lo: -bound, up: bound })?;
        let out_b = if cfg.bias { Some(get_param(&out_vb, &[e], "bias", zero)?) } else { None };
        Ok(Self {
            cfg,
            in_proj_weight,
            q_proj_weight: q,
            k_proj_weight: k,
            v_proj_weight: v,
            in_proj_bias,
            bias_k,
            bias_v,
            out_proj: Linear::from_weights(out_w, out_b),
            training: true,
        })
    }

    /// The constructor arguments.
    pub fn config(&self) -> &MhaConfig {
        &self.cfg
    }

    /// The parameter dtype.
    pub fn dtype(&self) -> DType {
        self.out_proj.weight().dtype()
    }

    /// Sets training mode (`module.train(mode)`): dropout is active only in training mode.
    pub fn train(&mut self, mode: bool) {
        self.training = mode;
    }

    /// Sets evaluation mode (`module.eval()`).
    pub fn eval(&mut self) {
        self.training = false;
    }

    /// Whether the module is in training mode.
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// The output projection.
    pub fn out_proj(&self) -> &Linear {
        &self.out_proj
    }

    fn params(&self) -> Result<MhaParams<'_>> {
        let in_proj = match (
            &self.in_proj_weight,
            &self.q_proj_weight,
            &self.k_proj_weight,
            &self.v_proj_weight,
        ) {
            (Some(w), _, _, _) => InProj::Packed(w),
            (None, Some(q), Some(k), Some(v)) => InProj::Separate { q, k, v },
            _ => {
                return Err(Error::Config {
                    op: OP,
                    arg: "in_proj_weight",
                    msg: "the module has neither packed nor separate projection weights".into(),
                })
            }
        };
        Ok(MhaParams {
            embed_dim_to_check: self.cfg.embed_dim,
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            in_proj,
            in_proj_bias: self.in_proj_bias.as_ref(),
            bias_k: self.bias_k.as_ref(),
            bias_v: self.bias_v.as_ref(),
            add_zero_attn: self.cfg.add_zero_attn,
            dropout_p: self.cfg.dropout,
            out_proj_weight: self.out_proj.weight(),
            out_proj_bias: self.out_proj.bias(),
        })
    }

    /// Attends `query` over `key`/`value` with PyTorch's options and returns the output and,
    /// when `need_weights` (the default), the attention weights.
    ///
    /// Passing the same tensor (the same candle tensor, by id) as query, key and value is
    /// self-attention; it selects PyTorch's packed projection, as `query is key is value` does.
    // Mirrors torch.nn.MultiheadAttention.forward.
    pub fn forward(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        opts: &MhaOptions,
    ) -> Result<MhaOutput> {
        // The packed projection's multiply-adds: a larger call hops onto the pool once.
        let rows = query.elem_count().max(key.elem_count()) / self.cfg.embed_dim.max(1);
        let e = self.cfg.embed_dim;
        let macs = crate::pool::product_macs(rows, e, e.saturating_mul(3));
        crate::pool::on_pool_for(macs, || self.forward_here(query, key, value, opts))
    }

    /// [`forward`](Self::forward) on this thread.
    fn forward_here(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        opts: &MhaOptions,
    ) -> Result<MhaOutput> {
        if let Some(dt) = crate::precision::autocast_for(query.dtype(), self.dtype()) {
            return self.forward_autocast(query, key, value, opts, dt);
        }
        if let Some(dt) = crate::precision::autocast_into(self.dtype()) {
            let ([q, k, v], opts) = cast_under_autocast([query, key, value], opts, dt)?;
            return crate::mode::autocast_off(|| self.forward_here(&q, &k, &v, &opts));
        }
        let alias = Aliasing::of(query, key, value);
        let params = self.params()?;
        mha_forward_impl(
            query,
            key,
            value,
            alias,
            &params,
            opts,
            self.training,
            self.cfg.batch_first,
        )
    }

    /// Self-attention of a bf16 module on `x`, run as it is with its output projection
    /// written as `out` (f32 for a Transformer layer's f32 residual sum): the bits of its f32
    /// twin's output; `None` where the call would run as that twin
    /// (`functional::mha::mha_direct_to`).
    pub(crate) fn forward_direct_to(
        &self,
        x: &Tensor,
        opts: &MhaOptions,
        out: candle_core::DType,
    ) -> Result<Option<MhaOutput>> {
        let params = self.params()?;
        let modes = (self.training, self.cfg.batch_first);
        crate::functional::mha_direct_to(x, &params, opts, modes, out)
    }

    /// The path [`forward`](Self::forward) takes for these arguments (the fused kernels or the
    /// composed candle path) and why, without running it. Bad arguments give the error
    /// `forward` would.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::{MhaConfig, MhaOptions, MultiheadAttention, Path};
    ///
    /// let vm = VarMap::new();
    /// let mha = MultiheadAttention::new(MhaConfig::new(8, 2), VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
    /// let x = Tensor::zeros((3, 1, 8), DType::F32, &Device::Cpu)?; // (L, N, E)
    /// // f32 on the CPU runs the fused kernels ...
    /// let plan = mha.explain(&x, &x, &x, &MhaOptions::default())?;
    /// assert_eq!(plan.path, Path::Fused);
    /// // ... f64 the composed path, and the plan says why.
    /// let x64 = x.to_dtype(DType::F64)?;
    /// let vm64 = VarMap::new();
    /// let mha64 = MultiheadAttention::new(MhaConfig::new(8, 2), VarBuilder::from_varmap(&vm64, DType::F64, &Device::Cpu))?;
    /// let plan = mha64.explain(&x64, &x64, &x64, &MhaOptions::default())?;
    /// assert_eq!(plan.path, Path::Composed);
    /// println!("{plan}");
    /// # Ok::<(), multihead::Error>(())
    /// ```
    pub fn explain(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        opts: &MhaOptions,
    ) -> Result<Plan> {
        let alias = Aliasing::of(query, key, value);
        let params = self.params()?;
        let layout = (self.training, self.cfg.batch_first);
        if let Some(dt) = crate::precision::autocast_for(query.dtype(), self.dtype()) {
            return crate::functional::autocast_plan(
                query, key, value, alias, &params, opts, layout, dt,
            );
        }
        if let Some(dt) = crate::precision::autocast_into(self.dtype()) {
            let ([q, k, v], opts) = cast_under_autocast([query, key, value], opts, dt)?;
            return crate::mode::autocast_off(|| self.explain(&q, &k, &v, &opts));
        }
        mha_plan_impl(query, key, value, alias, &params, opts, layout.0, layout.1)
    }

    /// Self-attention of `x` over itself, without weights: `mha(x, x, x, need_weights=False)[0]`.
    // Mirrors torch.nn.MultiheadAttention.forward(x, x, x, need_weights=False)[0].
    pub fn self_attention(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward(x, x, x, &MhaOptions::default().need_weights(false))?.output)
    }

    /// Cross-attention of `x` over `context` (used as key and value), with an optional key
    /// padding mask over the context: `mha(x, ctx, ctx, key_padding_mask=m, need_weights=False)[0]`.
    // Mirrors torch.nn.MultiheadAttention.forward(x, ctx, ctx, key_padding_mask=m,
    // need_weights=False)[0].
    pub fn cross_attention(
        &self,
        x: &Tensor,
        context: &Tensor,
        key_padding_mask: Option<&Mask>,
    ) -> Result<Tensor> {
        let mut opts = MhaOptions::default().need_weights(false);
        opts.key_padding_mask = key_padding_mask.cloned();
        Ok(self.forward(x, context, context, &opts)?.output)
    }
}

impl NamedParameters for MultiheadAttention {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        let mut push = |k: &str, t: &Option<Tensor>| {
            if let Some(t) = t {
                out.push((k.to_string(), t.clone()));
            }
        };
        push("in_proj_weight", &self.in_proj_weight);
        push("q_proj_weight", &self.q_proj_weight);
        push("k_proj_weight", &self.k_proj_weight);
        push("v_proj_weight", &self.v_proj_weight);
        push("in_proj_bias", &self.in_proj_bias);
        push("bias_k", &self.bias_k);
        push("bias_v", &self.bias_v);
        push("out_proj.weight", &Some(self.out_proj.weight().clone()));
        push("out_proj.bias", &self.out_proj.bias().cloned());
        out
    }
}

/// Self-attention without weights, so the layer composes with other candle modules.
impl candle_core::Module for MultiheadAttention {
    // Mirrors torch.nn.MultiheadAttention.forward(x, x, x, need_weights=False)[0].
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.self_attention(xs).map_err(candle_core::Error::wrap)
    }
}

impl MultiheadAttention {
    /// [`forward`](Self::forward) under [`autocast`](crate::autocast) to `dt`: the rounded
    /// module on rounded inputs (the same tensor stays the same tensor, so self-attention keeps
    /// its packed projection), both results rounded once.
    fn forward_autocast(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        opts: &MhaOptions,
        dt: candle_core::DType,
    ) -> Result<MhaOutput> {
        use crate::precision::{autocast_operand, autocast_output, CastParams};
        let m = self.rounded(dt)?;
        let r = |t: &Tensor| autocast_operand(t, dt);
        let [q, k, v] = crate::precision::map_aliased([query, key, value], &r)?;
        let opts = crate::functional::autocast_options(opts, &r)?;
        let macs = crate::products::call_macs(query, key, self.cfg.batch_first);
        let out = crate::mode::autocast_off(|| {
            crate::mode::rounded_products(dt, macs, || m.forward(&q, &k, &v, &opts))
        })?;
        let done = |t: &Tensor| autocast_output(t, query.dtype(), dt);
        Ok(MhaOutput {
            output: done(&out.output)?,
            attn_weights: out.attn_weights.map(|w| done(&w)).transpose()?,
        })
    }
}

/// The query, key, value (the same tensor stays the same tensor) and options of a module in
/// `dt` called under an autocast to `dt`, as PyTorch's autocast casts them: f32 (or other
/// reduced) tensors and float masks converted to `dt`, so that the call runs as on `dt`
/// arguments.
fn cast_under_autocast(
    qkv: [&Tensor; 3],
    opts: &MhaOptions,
    dt: candle_core::DType,
) -> Result<([Tensor; 3], MhaOptions)> {
    let cast = |t: &Tensor| crate::precision::autocast_cast(t, dt);
    let qkv = crate::precision::map_aliased(qkv, &cast)?;
    Ok((qkv, crate::functional::cast_options(opts, dt)?))
}

impl crate::precision::CastParams for MultiheadAttention {
    fn map_params(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let w = |t: &Option<Tensor>| t.as_ref().map(f).transpose();
        Ok(Self {
            cfg: self.cfg.clone(),
            in_proj_weight: w(&self.in_proj_weight)?,
            q_proj_weight: w(&self.q_proj_weight)?,
            k_proj_weight: w(&self.k_proj_weight)?,
            v_proj_weight: w(&self.v_proj_weight)?,
            in_proj_bias: w(&self.in_proj_bias)?,
            bias_k: w(&self.bias_k)?,
            bias_v: w(&self.bias_v)?,
            out_proj: self.out_proj.map_params(f)?,
            training: self.training,
        })
    }
}
