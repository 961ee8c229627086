//! Contiguous copies of strided per-head rows, made before the attention tasks read them.
//!
//! Inside `MultiheadAttention` q, k and v are views of one projection output: the rows of one
//! head are `E` (or `3E` when packed) floats apart, a multiple of 2 KiB for common `E`. Such
//! rows use one set in eight of the L2 cache, so the keys and values of a head (re-read by
//! every query block) evict each other, and the short runs defeat the prefetchers. Measured
//! at B=8 H=8 L=S=512 D=64 (`LAYOUT=bhld|seq|seq+1024` with the `gflops` example): forward
//! 13.7 ms contiguous, 16.4 ms with rows 2 KiB apart and 17.4 ms 6 KiB apart; backward
//! 29.0 / 40.5 / 44.8 ms.
//!
//! The forward and the weights (one task per query block) copy every head's keys and values
//! here first: 13.9 ms for both strided layouts, the copy included. The backward's tasks own
//! a kv head each and copy a chunk of its keys, and each query block, into their scratch
//! themselves (`backward.rs`): 30.7 / 31.3 ms.

use rayon::prelude::*;

use super::Layout4;

/// `x`'s `[batch, heads, rows, width]` elements copied into a contiguous buffer, with its
/// layout; `None` when the rows are already contiguous (`seq == width`), when there is
/// nothing to copy, or when the copy cannot be allocated (the caller then reads `x` in place,
/// which gives the same result more slowly).
pub(crate) fn contiguous_heads<T: Copy + Send + Sync>(
    x: &[T],
    l: Layout4,
    [batch, heads, rows, width]: [usize; 4],
) -> Option<(Vec<T>, Layout4)> {
    if l.seq == width || width == 0 {
        return None;
    }
    let head = rows.checked_mul(width)?;
    let n = head.checked_mul(heads)?.checked_mul(batch)?;
    if n == 0 {
        return None;
    }
    let mut buf: Vec<T> = Vec::new();
    buf.try_reserve_exact(n).ok()?;
    // Written once, not zeroed first: every element of the first `n` is copied below.
    let copy = |(bh, dst): (usize, &mut [std::mem::MaybeUninit<T>])| {
        let (b, h) = (bh / heads, bh % heads);
        for (i, row) in dst.chunks_exact_mut(width).enumerate() {
            let src = &x[l.offset(b, h, i)..][..width];
            // SAFETY: `row` is `width` uninitialised elements of `buf`'s reserved capacity and
            // `src` is `width` elements of `x`; the two cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), row.as_mut_ptr().cast(), width) };
        }
    };
    let spare = &mut buf.spare_capacity_mut()[..n];
    if n < SERIAL_BELOW {
        // A small copy: cheaper here than sent to the pool.
        spare.chunks_mut(head).enumerate().for_each(copy);
    } else {
        spare.par_chunks_mut(head).enumerate().for_each(copy);
    }
    // SAFETY: the loop above initialised all `n` elements (`n` chunks of `head` floats).
    unsafe { buf.set_len(n) };
    Some((buf, Layout4::contiguous(heads, rows, width)))
}

/// Floats below which the copy runs on the calling thread.
const SERIAL_BELOW: usize = 1 << 16;
