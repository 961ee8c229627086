//! The `torch.nn.functional` equivalents: [`scaled_dot_product_attention`] and
//! [`multi_head_attention_forward`]; and [`varlen_attention`], FlashAttention's packed
//! variable-length attention.
//!
//! Each call runs in three steps: every argument is validated once; one function plans the
//! path (the fused CPU kernels or the composed candle operations, see
//! [`Plan`](crate::Plan)); the path runs. Both paths accept the same arguments and give the
//! same numbers; [`explain_sdpa`] and [`explain_mha`] say which runs and why.
//!
//! The composed path is built from candle operations, so candle's autograd differentiates it
//! for every input and parameter; the fused kernels enter candle as custom ops with a
//! backward.

mod add;
pub(crate) mod core;
mod mha;
pub(crate) mod sdpa;
mod sdpa_copies;
mod sdpa_rank;
pub(crate) mod varlen;

pub use self::core::safe_softmax_last_dim;
pub use add::add;
pub(crate) use mha::{
    autocast_options, autocast_plan, cast_options, mha_direct_to, mha_forward_impl, mha_plan_impl,
    mha_validate, options_in, widen_options, Aliasing,
};
pub use mha::{
    explain_mha, multi_head_attention_forward, InProj, MhaOptions, MhaOutput, MhaParams,
};
pub use sdpa::{explain_sdpa, scaled_dot_product_attention, SdpaOptions};
pub use varlen::{explain_varlen, varlen_attention, CuSeqlens};
