//! Sizes checked before memory is taken: a size that overflows or cannot be allocated is an
//! [`Error::Alloc`], never an abort.
//!
//! candle allocates its tensors infallibly (an allocation failure aborts the process), so a
//! call that is about to make a large tensor first asks the allocator for the same number of
//! bytes with [`Vec::try_reserve`] and gives them back. The kernels' own buffers are allocated
//! fallibly with [`try_zeros`].

use candle_core::DType;

use crate::error::{fmt_shape, Error, Result};

/// The product of `dims`, or an [`Error::Alloc`] naming `what` when it overflows.
pub(crate) fn elements(op: &'static str, what: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| Error::Alloc {
        op,
        what,
        msg: format!("a tensor of shape {} has more elements than fit in usize", fmt_shape(dims)),
    })
}

/// Human-readable bytes: `12.0 GiB`.
fn human(bytes: u128) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// Checks that `count` tensors of shape `dims` and `dtype` can be allocated now: the size must
/// fit in `usize` and the allocator must grant it. `hint` says what to do instead.
pub(crate) fn ensure(
    op: &'static str,
    what: &'static str,
    dims: &[usize],
    dtype: DType,
    count: usize,
    hint: &str,
) -> Result<()> {
    let n = elements(op, what, dims)?;
    let bytes = (n as u128) * (dtype.size_in_bytes() as u128) * (count as u128);
    let fail = || Error::Alloc {
        op,
        what,
        msg: format!(
            "{} of shape {} ({dtype:?}) {} {}, which cannot be allocated; {hint}",
            if count == 1 { "a tensor".to_string() } else { format!("{count} tensors") },
            fmt_shape(dims),
            if count == 1 { "needs" } else { "need" },
            human(bytes)
        ),
    };
    let bytes = usize::try_from(bytes).map_err(|_| fail())?;
    if bytes > memory_limit() {
        return Err(fail());
    }
    if bytes < (64 << 20) {
        return Ok(()); // small: not worth a probe
    }
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(bytes).map_err(|_| fail())?;
    Ok(())
}

/// The machine's RAM plus swap in bytes (Linux: `/proc/meminfo`), read once; `usize::MAX`
/// where unknown. No single buffer larger than this can ever be backed, whatever the kernel's
/// overcommit policy would promise.
pub(crate) fn memory_limit() -> usize {
    static LIMIT: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| meminfo_bytes("MemTotal:", "SwapTotal:").unwrap_or(usize::MAX))
}

/// Bytes this machine can give now: `MemAvailable` plus free swap from `/proc/meminfo`, read
/// at each call ([`memory_limit`] where it cannot be read). For allocations that are all kept
/// (a file's tensors): a size the allocator grants one block at a time may still exceed what
/// the blocks together can get, and the kernel then kills the process instead of an error.
pub(crate) fn memory_available() -> usize {
    let limit = memory_limit();
    meminfo_bytes("MemAvailable:", "SwapFree:").map_or(limit, |b| b.min(limit))
}

/// `/proc/meminfo`'s `memory` entry plus its `swap` entry (0 when absent), in bytes; `None`
/// where the file or the memory entry cannot be read.
fn meminfo_bytes(memory: &str, swap: &str) -> Option<usize> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse().ok()
    };
    let bytes = (kib(memory)? + kib(swap).unwrap_or(0)).saturating_mul(1024);
    Some(usize::try_from(bytes).unwrap_or(usize::MAX))
}

/// An empty `Vec` with room for exactly `n` elements, or a candle error naming `what` when
/// that cannot be allocated.
pub(crate) fn try_empty<T>(n: usize, what: &str) -> candle_core::Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        candle_core::Error::Msg(format!(
            "{what}: {n} elements of {} bytes cannot be allocated",
            std::mem::size_of::<T>()
        ))
    })?;
    Ok(v)
}

/// A zeroed `Vec` of `n` elements, or a candle error when it cannot be allocated.
pub(crate) fn try_zeros<T: Copy + Default + Send + Sync>(
    n: usize,
    what: &str,
) -> candle_core::Result<Vec<T>> {
    try_filled(n, T::default(), what)
}

/// A `Vec` of `n` copies of `value`, or a candle error when it cannot be allocated.
pub(crate) fn try_filled<T: Copy + Send + Sync>(
    n: usize,
    value: T,
    what: &str,
) -> candle_core::Result<Vec<T>> {
    let mut v = try_empty(n, what)?;
    if n < PAR_FILL_MIN {
        v.resize(n, value);
        return Ok(v);
    }
    // Large buffers are filled on every thread: one thread's memset (and the page faults of
    // fresh memory) would leave the other cores idle.
    use rayon::prelude::*;
    v.spare_capacity_mut()[..n]
        .par_chunks_mut(PAR_FILL_CHUNK)
        .for_each(|c| c.fill(std::mem::MaybeUninit::new(value)));
    // SAFETY: the loop above initialised all `n` elements of the reserved capacity.
    unsafe { v.set_len(n) };
    Ok(v)
}

/// A `Vec` of `n` elements that `write` fills, allocated without being zeroed first (for
/// kernels that write every element of their output), or a candle error when it cannot be
/// allocated or `write` fails.
///
/// # Safety
/// When `write` returns `Ok`, it has initialised all `n` elements of the slice it was given.
pub(crate) unsafe fn try_written<T>(
    n: usize,
    what: &str,
    write: impl FnOnce(&mut [std::mem::MaybeUninit<T>]) -> candle_core::Result<()>,
) -> candle_core::Result<Vec<T>> {
    let mut v = try_empty(n, what)?;
    write(&mut v.spare_capacity_mut()[..n])?;
    // SAFETY: `write` initialised the first `n` elements of the reserved capacity (caller).
    unsafe { v.set_len(n) };
    Ok(v)
}

/// Elements from which [`try_filled`] fills in parallel, and its chunk.
const PAR_FILL_MIN: usize = 1 << 20;
const PAR_FILL_CHUNK: usize = 1 << 16;

/// Checks that `dtype` is a float dtype, the rule of every layer here.
pub(crate) fn expect_float(op: &'static str, arg: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_float() {
        Ok(())
    } else {
        Err(Error::DType {
            op,
            arg,
            msg: format!(
                "expected a float tensor, got {dtype:?}; convert it with .to_dtype(DType::F32)"
            ),
        })
    }
}
