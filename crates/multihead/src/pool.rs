//! One hop onto a pool per call.
//!
//! The kernels split their work over rayon's pool. Called from a thread outside the pool (a
//! program's main thread), each parallel operation sends its tasks to the pool and puts the
//! caller to sleep until they are done: a wake-up and a sleep per operation, tens of
//! microseconds on a small VM, which a layer at batch 64 × 17 tokens pays a dozen times per
//! call. The modules therefore run a call that is large enough to go parallel on one of a
//! pool's threads ([`on_pool`]), where the operations inside it split their work without
//! leaving the pool: one hop per call instead of one per operation. The thread's modes
//! ([`no_grad`](crate::no_grad), [`autocast`](crate::autocast), the backend, the bf16
//! products and kernel, the kernels' SIMD level) go with the call; the numbers are the same
//! bits on any thread.
//!
//! # Why a pool of its own, one call at a time
//!
//! A rayon thread that waits inside a call (for the call's parallel tasks) runs other queued
//! jobs meanwhile. Were a second call queued on the same pool, it could run there on top of
//! the first call's frames, which hold candle's read locks on the tensors the first call
//! reads (a `CustomOp` runs under them); a write waiting for those locks (a `Var::set` of an
//! optimiser step, or a weight reload, on any thread) then blocks the second call, and with it
//! the first one beneath it, for good. The same holds for a call run on top of another
//! caller's parallel tasks. So the hops go to a pool of this crate's own, with as many threads
//! as rayon's global pool, which runs one call at a time and nothing else but that call's
//! parallel tasks (which take no locks). A call made while it is busy runs on its caller's
//! thread, its operations splitting their work over rayon's global pool, as candle's do; both
//! give the same bits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::mode::Modes;

/// Multiply-adds from which an operation goes parallel (the kernels' and the gemm crate's
/// thresholds are about `2^19`); a call whose largest product is smaller stays on the caller.
const PARALLEL_FROM: usize = 1 << 19;

/// Runs `f` on a thread of this crate's pool, with this thread's modes, and returns its
/// result; this thread waits. On a thread of a rayon pool already, or while another call
/// runs on this crate's pool, `f` just runs here. The result is the same either way. (The pool
/// runs one call at a time: a rayon thread waiting inside a call runs other queued jobs, and a
/// second call run there, on top of the first one's candle read locks, would deadlock with a
/// write to a parameter that waits for those locks.)
///
/// The modules hop by themselves for calls large enough to go parallel; wrap a whole step in
/// it (a training step with its `backward`, a loop of small calls) so that what runs between
/// the modules' calls, candle's backward included, does not leave the pool either. Calls from
/// several threads at once, and writes to parameters (`Var::set`) while other threads call the
/// modules, are safe: the second caller runs its call on its own thread. Calls made from
/// rayon's own threads (the items of a `par_iter`, also inside `on_pool`; a user pool's
/// `install`) run where they are, as candle's operations do, and there a write to a parameter
/// that they read, made while they run, can deadlock as it can with candle's operations: a
/// thread waiting inside one item runs another item on top of it. Write parameters between
/// such loops, not during them.
///
/// The modes reach `f`, not the tasks `f` hands to rayon itself: a `par_iter` inside `f`
/// runs its items on other threads with those threads' modes (grad mode on, no autocast),
/// so enter [`no_grad`](crate::no_grad) or [`autocast`](crate::autocast) inside each item.
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
    let Some(pool) = hop_pool() else {
        return f();
    };
    let Some(_claim) = Claim::take() else {
        return f();
    };
    let modes = Modes::current();
    pool.install(move || modes.enter(f))
}

/// The pool calls hop onto: as many threads as rayon's global pool (so `RAYON_NUM_THREADS`
/// and a `build_global` made before the first call hold for it too); `None` where the threads
/// cannot be started, and the calls then run on their callers' threads.
fn hop_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(rayon::current_num_threads())
            .thread_name(|i| format!("multihead-{i}"))
            .build()
            .ok()
    })
    .as_ref()
}

/// Whether a call runs on [`hop_pool`] now.
static BUSY: AtomicBool = AtomicBool::new(false);

/// The right to run one call on [`hop_pool`], given back when dropped (also when the call
/// panics).
struct Claim;

impl Claim {
    fn take() -> Option<Claim> {
        BUSY.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).ok().map(|_| Claim)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        BUSY.store(false, Ordering::Release);
    }
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
