//! Run-time dispatch (scalar / AVX2+FMA / AVX-512F), per-thread scratch and the parallel
//! task loop shared by the three entry points.

use std::cell::{Cell, RefCell};
use std::sync::OnceLock;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512};
use super::simd::{Scalar, Simd};

/// Which instruction set the kernels use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable scalar code (what non-x86 machines run).
    Scalar,
    /// AVX2 with FMA, 8 lanes.
    Avx2,
    /// AVX-512 F, DQ, BW and VL (every AVX-512 CPU since Skylake-SP has the four), 16 lanes.
    Avx512,
}

impl SimdLevel {
    /// Lanes of one vector at this level.
    pub fn lanes(self) -> usize {
        match self {
            SimdLevel::Scalar => 1,
            SimdLevel::Avx2 => 8,
            SimdLevel::Avx512 => 16,
        }
    }
}

static DETECTED: OnceLock<SimdLevel> = OnceLock::new();

thread_local! {
    static FORCED: Cell<Option<SimdLevel>> = const { Cell::new(None) };
}

/// The best level this CPU supports (detected once, then cached).
pub fn detected_simd_level() -> SimdLevel {
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // BW and VL too: code at this level may use their 16-bit and 256-bit forms
            // (the column sums of bf16 gradients, the bf16 packers).
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                return SimdLevel::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Scalar
    })
}

/// The level the entry points use on this thread: the forced level (see [`with_simd_level`])
/// capped at what the CPU supports, or else the detected level.
pub fn simd_level() -> SimdLevel {
    let detected = detected_simd_level();
    match FORCED.with(|f| f.get()) {
        Some(forced) => forced.min(detected),
        None => detected,
    }
}

/// Runs `f` with the kernels forced to `level` (capped at what the CPU supports) for calls
/// made from this thread. Meant for tests and benchmarks; returns `f`'s result.
///
/// ```
/// use multihead_kernels::attention::{simd_level, with_simd_level, SimdLevel};
/// with_simd_level(SimdLevel::Scalar, || assert_eq!(simd_level(), SimdLevel::Scalar));
/// ```
pub fn with_simd_level<R>(level: SimdLevel, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<SimdLevel>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0;
            FORCED.with(|c| c.set(prev));
        }
    }
    let _restore = Restore(FORCED.with(|c| c.replace(Some(level))));
    f()
}

/// A 64-byte aligned, growable f32 buffer. Its contents are unspecified between uses.
struct Scratch {
    buf: Vec<f32>,
}

impl Scratch {
    fn get(&mut self, len: usize) -> &mut [f32] {
        const ALIGN: usize = 16; // floats per 64 bytes
        if self.buf.len() < len + ALIGN {
            // Grow geometrically so that shapes creeping upward do not reallocate each call;
            // where that much cannot be had, exactly `len` (which `try_par_run` probed).
            let new_len = (len + ALIGN).max(self.buf.len() * 3 / 2);
            self.buf = Vec::new();
            let new_len = match self.buf.try_reserve_exact(new_len) {
                Ok(()) => new_len,
                Err(_) => len + ALIGN,
            };
            self.buf.resize(new_len, 0.0);
        }
        let off = crate::aligned::line_offset(&self.buf);
        &mut self.buf[off..off + len]
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch { buf: Vec::new() }) };
}

/// Runs `f` on this thread's scratch buffer of `len` floats (64-byte aligned, contents
/// unspecified). Reused across calls, so steady-state calls do not allocate.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => f(s.get(len)),
        // Re-entered on the same thread (not expected): use a private buffer.
        Err(_) => f(Scratch { buf: Vec::new() }.get(len)),
    })
}

/// Carves 64-byte aligned pieces out of a scratch slice.
pub(crate) struct Carver<'a> {
    rest: &'a mut [f32],
}

impl<'a> Carver<'a> {
    pub(crate) fn new(buf: &'a mut [f32]) -> Self {
        Carver { rest: buf }
    }
    /// The next `n` floats (the cursor then moves to the next multiple of 16).
    pub(crate) fn take(&mut self, n: usize) -> &'a mut [f32] {
        let padded = round16(n);
        let rest = std::mem::take(&mut self.rest);
        let (head, tail) = rest.split_at_mut(padded);
        self.rest = tail;
        &mut head[..n]
    }
}

/// A query block of a task: rows `i0..i0 + br`, padded to `brp` lanes, `nvec` vectors.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QueryRows {
    pub(crate) i0: usize,
    pub(crate) br: usize,
    pub(crate) brp: usize,
    pub(crate) nvec: usize,
}

impl QueryRows {
    /// Block `qb` of `l` rows cut into blocks of `block`, for vectors of `lanes`.
    pub(crate) fn new(qb: usize, block: usize, l: usize, lanes: usize) -> Self {
        let i0 = qb * block;
        let br = block.min(l - i0);
        let brp = br.div_ceil(lanes) * lanes;
        QueryRows { i0, br, brp, nvec: brp / lanes }
    }
}

/// `n` rounded up to a multiple of 16 (the carving granularity).
pub(crate) fn round16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// A unit of parallel work: one call of [`Task::run`] per task index.
pub(crate) trait Task: Sync {
    /// How many tasks.
    fn count(&self) -> usize;
    /// Scratch floats one task needs at `lanes` lanes (including carving padding).
    fn scratch_len(&self, lanes: usize) -> usize;
    /// About how many multiply-adds all the tasks do together (for choosing to run them on
    /// the calling thread); unknown (`usize::MAX`) unless a task says.
    fn work(&self) -> usize {
        usize::MAX
    }
    /// Whether the tasks run with subnormal results flushed to zero (attention's kernels:
    /// see [`crate::fpenv`]); the others compute every result exactly as rounded.
    const FLUSH_TO_ZERO: bool = false;
    /// Runs task `t`.
    ///
    /// # Safety
    ///
    /// `S`'s instruction set must be available; `buf` has `scratch_len(S::LANES)` floats; the
    /// task must only write memory that no other task index writes.
    unsafe fn run<S: Simd>(&self, t: usize, buf: &mut [f32]);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn run_avx512<T: Task>(task: &T, t: usize, buf: &mut [f32]) {
    // SAFETY: the caller checked AVX-512F; the rest is forwarded.
    unsafe { task.run::<Avx512>(t, buf) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<T: Task>(task: &T, t: usize, buf: &mut [f32]) {
    // SAFETY: the caller checked AVX2 and FMA; the rest is forwarded.
    unsafe { task.run::<Avx2>(t, buf) }
}

fn run_scalar<T: Task>(task: &T, t: usize, buf: &mut [f32]) {
    // SAFETY: scalar code needs no feature; `buf` is sized by the caller; tasks write
    // disjoint memory (the `Task` implementor's invariant).
    unsafe { task.run::<Scalar>(t, buf) }
}

/// [`par_run`] for tasks whose scratch grows with the caller's sizes (attention's head
/// dimension): a scratch that cannot be allocated is an error naming `name`, not an abort.
/// The check asks the allocator for that much once and gives it back; each thread then
/// allocates its own (kept for later calls).
pub(crate) fn try_par_run<T: Task>(
    level: SimdLevel,
    task: &T,
    name: &'static str,
) -> Result<(), super::KernelError> {
    let len = task.scratch_len(level.min(detected_simd_level()).lanes());
    if len >= 1 << 20 {
        let mut probe: Vec<f32> = Vec::new();
        probe.try_reserve_exact(len + 16).map_err(|_| super::KernelError::InvalidArgument {
            name,
            msg: format!(
                "cannot allocate {len} floats of scratch per thread (it grows with the head \
                 dimension); use smaller heads"
            ),
        })?;
    }
    par_run(level, task);
    Ok(())
}

/// Runs every task of `task` on the current rayon pool at `level` (which must not exceed
/// [`detected_simd_level`]).
pub(crate) fn par_run<T: Task>(level: SimdLevel, task: &T) {
    let level = level.min(detected_simd_level());
    let len = task.scratch_len(level.lanes());
    let one = |t: usize| {
        // Set per task: a rayon worker may run other work between two tasks.
        let _ftz = T::FLUSH_TO_ZERO.then(crate::fpenv::FlushToZero::on);
        with_scratch(len, |buf| match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `level <= detected_simd_level()`, so the CPU has AVX-512F and DQ.
            SimdLevel::Avx512 => unsafe { run_avx512(task, t, buf) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `level <= detected_simd_level()`, so the CPU has AVX2 and FMA.
            SimdLevel::Avx2 => unsafe { run_avx2(task, t, buf) },
            _ => run_scalar(task, t, buf),
        })
    };
    if task.work() < SERIAL_BELOW {
        // A tiny call (one short sequence): sending its tasks to the pool and waiting for them
        // costs more than running them here. Each task computes the same bits either way.
        (0..task.count()).for_each(one);
    } else {
        (0..task.count()).into_par_iter().for_each(one);
    }
}

/// Multiply-adds below which [`par_run`] runs the tasks on the calling thread (tens of
/// microseconds of one core).
const SERIAL_BELOW: usize = 1 << 19;

/// A raw pointer that may be shared across the pool's threads. Tasks write disjoint
/// elements through it (checked by the entry points' validation).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SyncPtr<T>(pub *mut T);
// SAFETY: only used for outputs whose tasks write disjoint elements (see `Task::run`).
unsafe impl<T> Send for SyncPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SyncPtr<T> {}

/// A raw read-only pointer shareable across threads (inputs outlive the parallel loop).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConstPtr<T>(pub *const T);
// SAFETY: the pointee is only read while the borrowed input slice is alive.
unsafe impl<T> Send for ConstPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for ConstPtr<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that asks for `len` floats of scratch and counts its runs.
    struct Greedy {
        len: usize,
        runs: std::sync::atomic::AtomicUsize,
    }

    impl Task for Greedy {
        fn count(&self) -> usize {
            3
        }
        fn scratch_len(&self, _lanes: usize) -> usize {
            self.len
        }
        unsafe fn run<S: Simd>(&self, _t: usize, buf: &mut [f32]) {
            assert_eq!(buf.len(), self.len);
            self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    #[test]
    fn scratch_that_cannot_be_allocated_is_an_error_before_any_task_runs() {
        let runs = std::sync::atomic::AtomicUsize::new(0);
        let huge = Greedy { len: usize::MAX / 8, runs };
        let e = try_par_run(SimdLevel::Scalar, &huge, "flash_forward");
        assert!(
            matches!(&e, Err(crate::attention::KernelError::InvalidArgument { name, msg })
                if *name == "flash_forward" && msg.contains("scratch")),
            "{e:?}"
        );
        assert_eq!(huge.runs.into_inner(), 0);
        let fine = Greedy { len: (1 << 20) + 5, runs: std::sync::atomic::AtomicUsize::new(0) };
        try_par_run(SimdLevel::Scalar, &fine, "flash_forward").expect("a 4 MiB scratch");
        assert_eq!(fine.runs.into_inner(), 3);
    }
}
