//! # multihead
//!
//! PyTorch's `nn.MultiheadAttention` and `F.scaled_dot_product_attention` for Rust, on
//! [candle](https://docs.rs/candle-core), with PyTorch's numbers, state_dict keys and masks.
//!
//! * [`MultiheadAttention`] mirrors `torch.nn.MultiheadAttention`: packed or separate
//!   projections, `bias_k`/`bias_v`, zero attention, bool and float masks with PyTorch's polarity,
//!   `is_causal`, batched and unbatched input, `batch_first`, dropout on the attention weights,
//!   averaged or per-head weights.
//! * [`functional`] has `scaled_dot_product_attention` and `multi_head_attention_forward`.
//! * [`state_dict`] loads and saves PyTorch state_dicts as safetensors, strictly (or not), by
//!   PyTorch's keys; [`Embedding`], [`Linear`], [`LayerNorm`] and the [`transformer`] layers
//!   complete a model.
//! * [`no_grad`] is PyTorch's `torch.no_grad()`; [`Backend`] and `explain` choose and report the
//!   path a call takes (the fused CPU kernels or the composed candle reference), see [`mode`].
//! * [`optim::AdamW`] is `torch.optim.AdamW` as a candle optimiser, one pass per parameter.
//! * [`optim::clip_grad_norm`] and [`optim::clip_grad_value`] are `torch.nn.utils`'s
//!   `clip_grad_norm_` and `clip_grad_value_` over a candle `GradStore`.
//! * [`memory::ReuseLarge`] is a global-allocator wrapper that keeps large freed blocks for reuse.
//! * [`cast`] is `Tensor::to_dtype` with a fast bf16 <-> f32 path on the CPU (PyTorch's `t.to(dtype)`).
//! * Incremental decoding: [`KvCache`] with [`MultiheadAttention::forward_cached`], cross-attention
//!   keys projected once ([`StaticKv`], PyTorch's `static_k`/`static_v`), the decoder's
//!   [`forward_step`](transformer::TransformerDecoder::forward_step) and
//!   [`Transformer::generate`](transformer::Transformer::generate); grouped-query attention with
//!   [`MhaConfig::with_num_kv_heads`].
//!
//! Every argument is checked once, before a path is chosen, and bad input is a typed [`Error`],
//! never a panic. The PyTorch behaviours relied on, and the deliberate differences, are in the
//! repository's `docs/pytorch-behaviour.md`.
//!
//! Everything is differentiable through candle's autograd: inputs and every parameter get their
//! gradients. Cached decoding (`forward_cached`, the decoders' steps) is inference and records
//! no graph, as PyTorch's incremental decoding loops run under `no_grad`.
//!
//! ## A tour
//! ```
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use multihead::{Mask, MhaConfig, MhaOptions, MultiheadAttention};
//!
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
//! // nn.MultiheadAttention(embed_dim=32, num_heads=4, batch_first=True)
//! let mha = MultiheadAttention::new(MhaConfig::new(32, 4).with_batch_first(true), vb)?;
//!
//! let x = Tensor::randn(0f32, 1.0, (2, 6, 32), &dev)?; // (N, L, E)
//! let causal = multihead::generate_square_subsequent_mask(6, DType::F32, &dev)?;
//! let out = mha.forward(&x, &x, &x, &MhaOptions::default().attn_mask(Mask::Float(causal)))?;
//! assert_eq!(out.output.dims(), &[2, 6, 32]);
//! assert_eq!(out.attn_weights.unwrap().dims(), &[2, 6, 6]); // averaged over heads
//!
//! // Gradients reach every parameter.
//! let grads = out.output.sqr()?.sum_all()?.backward()?;
//! assert!(vars.all_vars().iter().all(|v| grads.get(v.as_tensor()).is_some()));
//! # Ok::<(), multihead::Error>(())
//! ```
//!
//! ## Where this library differs from PyTorch on purpose
//! * A fully masked query row gives a zero attention row and zero weights on every path.
//!   PyTorch gives NaN on its `need_weights=True` path and zeros on its SDPA path.
//! * `dropout` must lie in `[0, 1)`, checked at construction; PyTorch checks late or not at all.
//! * Dropout draws from this crate's seeded counter-based generator ([`manual_seed`]), so masks
//!   are reproducible but are not PyTorch's mt19937 masks.
//! * Masks are typed: [`Mask::Bool`] (a `u8` tensor) or [`Mask::Float`] (added to the scores).

#![warn(missing_docs)]

pub mod activation;
mod alloc;
pub mod embedding;
pub mod error;
mod fifo;
pub mod functional;
pub mod fused;
mod key_groups;
mod key_map;
pub mod kv_cache;
pub mod layer_norm;
pub mod linear;
pub mod mask;
pub mod memory;
pub mod mode;
pub mod multihead_attention;
pub mod optim;
mod pool;
mod precision;
mod products;
pub mod random;
mod st_read;
pub mod state_dict;
pub mod train;
pub mod transformer;
pub mod variants;

pub use activation::Activation;
pub use embedding::Embedding;
pub use error::{Error, Result};
pub use functional::{MhaOptions, MhaOutput, SdpaOptions};
pub use fused::dispatch::{Path, Plan, Reason};
pub use kv_cache::KvCache;
pub use layer_norm::LayerNorm;
pub use linear::Linear;
pub use mask::{generate_square_subsequent_mask, Mask};
pub use mode::{
    autocast, autocast_dtype, bf16_products, default_backend, grad_enabled, no_grad,
    with_auto_bf16_decision, with_backend, with_bf16_products, Backend, Bf16Products,
};
pub use multihead_attention::{MhaConfig, MultiheadAttention, StaticKv};
pub use pool::on_pool;
pub use precision::{cast, sum_f32};
pub use products::{check_bf16_environment, explain_bf16_products, ProductsPlan};
pub use random::manual_seed;
pub use state_dict::NamedParameters;
pub use train::Train;
pub use variants::{CausalAlign, Variants, Window};
