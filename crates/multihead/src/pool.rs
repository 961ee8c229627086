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
//!
//! # The other threads wait awake during a call
//!
//! Between two parallel operations of a call (a decoding step's products, with a norm and a
//! residual add between them) rayon's idle threads go to sleep after a few dozen yields, and
//! each next operation then waits for a wake-up (30 microseconds on a 2-vCPU VM under KVM). So
//! while a call runs on this pool its other threads take its tasks as they come and yield
//! their cores between looks, napping once they have found no task for a millisecond; they go
//! back to rayon's sleep when the call returns. A six-layer decoder-only step at E = 512 went
//! from 2.2-2.5 to 1.7-1.8 ms on an Intel Xeon (family 6 model 167, 2 threads), and the demo's
//! 600 training steps from 2.5-2.9 to 1.9-2.1 s (docs/performance.md, "The pool's threads wait
//! for a call's tasks awake").

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

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
    pool.install(move || warm(move || modes.enter(f)))
}

/// Runs `f` on this pool thread while the pool's other threads wait for its tasks awake.
///
/// Between two parallel operations of a call (a decoding step's products, with a norm and a
/// residual add between them) rayon's idle threads go to sleep after a few dozen yields, and
/// the next operation then waits for a wake-up. Here each other thread runs a job of its own
/// (a broadcast: no thread takes another's) that takes the call's tasks as they come
/// (`rayon::yield_now`) and otherwise yields its core, until `f` returns. The tasks are the
/// same, so the bits are the same.
///
/// A thread may only wait so at the bottom of its stack: run on top of one of the call's tasks
/// (a thread that took a task before its broadcast job, and then looks for work while that
/// task waits for its other half), it would keep that task from finishing until the call
/// ends, and the call would wait for the task forever. So the threads join before `f` starts,
/// when no task of the call exists yet; `f` waits up to [`JOIN_WITHIN`] for them, then closes
/// the door, and a thread that comes later goes back to rayon at once.
fn warm<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    warm_within(JOIN_WITHIN, f)
}

/// [`warm`], waiting up to `join_within` for the other threads to join.
fn warm_within<R: Send>(join_within: Duration, f: impl FnOnce() -> R + Send) -> R {
    let others = rayon::current_num_threads().saturating_sub(1);
    if others == 0 {
        return f();
    }
    let state = Arc::new(Warm { done: AtomicBool::new(false), joined: AtomicUsize::new(0) });
    let caller = rayon::current_thread_index();
    let shared = Arc::clone(&state);
    rayon::spawn_broadcast(move |ctx| keep_warm(&shared, Some(ctx.index()) == caller));
    let start = Instant::now();
    while state.joined.load(Ordering::Acquire) < others && start.elapsed() < join_within {
        std::thread::yield_now();
    }
    state.joined.fetch_or(CLOSED, Ordering::AcqRel);
    let _stop = Stop(&state.done);
    f()
}

/// What [`warm`] shares with the threads it keeps awake.
struct Warm {
    /// Set when the call returns (or panics).
    done: AtomicBool,
    /// Threads waiting for the call's tasks, with [`CLOSED`] once the call has started.
    joined: AtomicUsize,
}

/// The bit of [`Warm::joined`] that says the call has started and no thread may join.
const CLOSED: usize = 1 << (usize::BITS - 1);

/// How long a call waits for the pool's other threads to join it before it starts without
/// those that have not (a sleeping thread takes a wake-up to come).
const JOIN_WITHIN: Duration = Duration::from_micros(200);

/// How long a thread kept awake by [`warm`] looks for tasks without finding one before it naps
/// between looks ([`NAP`]): a decoding step's gaps between its products are tens of
/// microseconds, and a call that pauses for longer (reads a file, waits for another thread,
/// runs serial work) should not keep the other cores busy meanwhile.
const SPIN_FOR: Duration = Duration::from_millis(1);
/// A napping thread's sleep between two looks for tasks (Linux rounds it up by its timer
/// slack, 50 microseconds by default); a task that comes meanwhile starts on the calling
/// thread, as it would while a sleeping rayon thread wakes up.
const NAP: Duration = Duration::from_micros(50);

/// Joins the call unless it has started (see [`warm`]), then takes the pool's jobs as they
/// come until the call returns: yielding its core between looks, and napping once it has
/// found none for [`SPIN_FOR`]. Returns at once on the calling thread.
fn keep_warm(state: &Warm, on_caller: bool) {
    if on_caller {
        return;
    }
    let mut joined = state.joined.load(Ordering::Acquire);
    loop {
        if joined & CLOSED != 0 {
            return;
        }
        match state.joined.compare_exchange_weak(
            joined,
            joined + 1,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => break,
            Err(now) => joined = now,
        }
    }
    let mut last_task = Instant::now();
    while !state.done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            last_task = Instant::now();
        } else if last_task.elapsed() > SPIN_FOR {
            std::thread::sleep(NAP);
        } else {
            std::thread::yield_now();
        }
    }
}

/// Sets the flag when dropped (also when the call panics).
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    /// Calls whose tasks split again (a join inside a task), with threads that come after the
    /// call has started (no wait for them at all): each call finishes. A thread that came late
    /// and took one of the call's tasks before its broadcast job would, were it let in, wait
    /// for the call's end on top of that task, which the call waits for; the door keeps it
    /// out. A watchdog fails the test instead of hanging it.
    #[test]
    fn threads_that_come_after_the_call_started_do_not_hold_its_tasks() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let total: u64 = pool.install(|| {
                (0..2000u64)
                    .map(|call| {
                        warm_within(Duration::ZERO, || {
                            (0..64u64)
                                .into_par_iter()
                                .map(|i| {
                                    (0..256u64)
                                        .into_par_iter()
                                        .map(|j| (i ^ j ^ call) & 7)
                                        .sum::<u64>()
                                })
                                .sum::<u64>()
                        })
                    })
                    .sum()
            });
            tx.send(total).expect("the test waits for the total");
        });
        let total = rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the calls did not finish in two minutes: a call waits for a task forever");
        let expect: u64 = (0..2000u64)
            .map(|call| {
                (0..64u64)
                    .map(|i| (0..256u64).map(|j| (i ^ j ^ call) & 7).sum::<u64>())
                    .sum::<u64>()
            })
            .sum();
        assert_eq!(total, expect);
    }
}
