//! One hop onto rayon's pool per call.
//!
//! The kernels split their work over rayon's pool. Called from a thread outside the pool (a
//! program's main thread), each parallel operation sends its tasks to the pool and puts the
//! caller to sleep until they are done: a wake-up and a sleep per operation, tens of
//! microseconds on a small VM, which a layer at batch 64 × 17 tokens pays a dozen times per
//! call. The modules therefore run a call that is large enough to go parallel on one of the
//! pool's threads ([`on_pool`]), where the operations inside it split their work without
//! leaving the pool: one hop per call instead of one per operation. The thread's modes
//! ([`no_grad`](crate::no_grad), [`autocast`](crate::autocast), the backend, the bf16
//! products and kernel) go with the call; the numbers are the same bits on any thread.

use crate::mode::Modes;

/// Multiply-adds from which an operation goes parallel (the kernels' and the gemm crate's
/// thresholds are about `2^19`); a call whose largest product is smaller stays on the caller.
const PARALLEL_FROM: usize = 1 << 19;

/// Runs `f` on a thread of rayon's current pool, with this thread's modes, and returns its
/// result; this thread waits. On a thread of a rayon pool already, `f` just runs.
///
/// The modules hop by themselves for calls large enough to go parallel; wrap a whole step in
/// it (a training step with its `backward`, a loop of small calls) so that what runs between
/// the modules' calls, candle's backward included, does not leave the pool either.
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor};
/// let lin = multihead::Linear::from_weights(Tensor::ones((4, 3), candle_core::DType::F32, &Device::Cpu)?, None);
/// let x = Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu)?;
/// let y = multihead::on_pool(|| multihead::no_grad(|| lin.forward(&x)))?;
/// assert_eq!(y.to_vec2::<f32>()?, vec![vec![3.0f32; 4]; 2]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let modes = Modes::current();
    rayon::scope(move |_| modes.enter(f))
}

/// [`on_pool`] when the call's largest product (`macs` multiply-adds) is large enough to go
/// parallel; otherwise `f` runs here (a hop would cost more than the call).
pub(crate) fn on_pool_for<R: Send>(macs: usize, f: impl FnOnce() -> R + Send) -> R {
    if macs < PARALLEL_FROM {
        return f();
    }
    on_pool(f)
}

/// The multiply-adds of a `rows × k` by `k × n` product, saturating.
pub(crate) fn product_macs(rows: usize, k: usize, n: usize) -> usize {
    rows.saturating_mul(k).saturating_mul(n)
}
