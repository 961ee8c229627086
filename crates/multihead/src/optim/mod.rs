//! Training utilities as PyTorch has them: `torch.optim.AdamW` as a candle
//! [`Optimizer`](candle_nn::Optimizer) ([`AdamW`]: one pass over each parameter per step, in
//! place of candle's dozen tensor operations), and `torch.nn.utils.clip_grad_norm_` /
//! `clip_grad_value_` over a candle [`GradStore`](candle_core::backprop::GradStore)
//! ([`clip_grad_norm`], [`ClipGradNorm`], [`clip_grad_value`]).
//!
//! `candle_nn::AdamW` updates a parameter with about fifteen tensor operations, each a fresh
//! allocation and a pass over memory; on a small model, whose parameters are many and small,
//! that dispatch is a third of a training step (the small ViT of `examples/port_vit.rs` at batch
//! 64: 1.6 of 4.9 ms), and on a large one its passes are (a 22M-parameter step: 70 ms, against
//! 12 here). [`AdamW`] takes the same [`ParamsAdamW`](candle_nn::ParamsAdamW), updates each parameter and its two
//! moments in place in one pass (`multihead_kernels::optim::adamw`), and computes what
//! `torch.optim.AdamW` computes: PyTorch's order of operations and roundings, its per-parameter
//! step count, its parameter checks. (`candle_nn::AdamW` scales the moments before the square
//! root and counts steps once for all parameters, so its numbers differ from PyTorch's in the
//! last bits, and for a parameter that skipped a step by more.)

mod adamw;
mod adamw_state;
mod clip;

pub use adamw::AdamW;
pub use clip::{clip_grad_norm, clip_grad_value, ClipGradNorm};

/// Where a tensor's elements live: its storage's address, when it is a non-empty float tensor on
/// the CPU (two tensors share their elements exactly when they share a storage).
fn storage_addr(t: &candle_core::Tensor) -> Option<usize> {
    use candle_core::{CpuStorage, Storage};
    let (s, _) = t.storage_and_layout();
    let Storage::Cpu(s) = &*s else { return None };
    // An empty storage has no elements to share: every empty vector has the same dangling
    // address.
    let (addr, len) = match s {
        CpuStorage::F32(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::F64(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::BF16(v) => (v.as_ptr() as usize, v.len()),
        CpuStorage::F16(v) => (v.as_ptr() as usize, v.len()),
        _ => return None,
    };
    (len > 0).then_some(addr)
}

/// Why gradient `g` cannot be variable `t`'s, if its shape or dtype is not `t`'s.
fn grad_mismatch(g: &candle_core::Tensor, t: &candle_core::Tensor) -> Option<String> {
    use crate::error::fmt_shape;
    (g.dims() != t.dims() || g.dtype() != t.dtype()).then(|| {
        format!(
            "the gradient is {} {:?} but its parameter {} {:?}; pass the gradients of these variables",
            fmt_shape(g.dims()),
            g.dtype(),
            fmt_shape(t.dims()),
            t.dtype()
        )
    })
}
