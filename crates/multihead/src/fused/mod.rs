//! The fused CPU kernels inside candle, and the choice between them and the composed path.
//!
//! * [`dispatch`]: the one function that picks a path for a call, and the [`Plan`] that says
//!   why.
//! * `flash`: the flash-attention kernels as candle custom ops with a backward.
//! * `linear`: `F.linear` as one candle op on gemm's kernels, with a backward.
//! * `norm`: LayerNorm as one candle op over `multihead_kernels::norm`, with a backward.
//!
//! [`Plan`]: dispatch::Plan

pub mod dispatch;
pub(crate) mod flash;
pub(crate) mod linear;
pub(crate) mod norm;
