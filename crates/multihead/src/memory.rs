//! A global-allocator wrapper that keeps freed large blocks for reuse.
//!
//! candle allocates a fresh buffer for every tensor. A Transformer layer makes dozens of
//! tensors of a few to a few hundred MiB per step; the allocator hands blocks that large back to
//! the kernel when they are freed, and the next step's identical allocation faults every page
//! in again (measured: 14-25% of all cycles of encoder-layer training went to clearing fresh
//! pages). [`ReuseLarge`] keeps up to a byte budget of freed blocks of at least 128 KiB and returns
//! one of the same size class (sizes rounded up by at most an eighth, so that batches padded to
//! different lengths share blocks) and alignment on the next request, so a training or
//! inference loop runs on warm memory after its first step.
//!
//! Install it in a binary (the `multihead` CLI does):
//!
//! ```
//! use multihead::memory::ReuseLarge;
//!
//! #[global_allocator]
//! static GLOBAL: ReuseLarge<std::alloc::System> = ReuseLarge::new(std::alloc::System, 4 << 30);
//!
//! let v = vec![0f32; 1 << 20]; // 4 MiB: from the system, returned to the cache when dropped
//! drop(v);
//! let w: Vec<f32> = Vec::with_capacity(1 << 20); // the same block, already mapped
//! assert!(GLOBAL.cached_bytes() <= 4 << 30);
//! # drop(w);
//! ```

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Blocks smaller than this go straight to the inner allocator. 128 KiB is glibc's default
/// threshold for serving a block from fresh pages (`M_MMAP_THRESHOLD`): from there on, every
/// reuse through the system allocator faults its pages in again (a small ViT at batch 64,
/// sequence 17, width 64: 278 KiB tensors, 3.9-4.5 -> 2.4-2.7 ms per forward on 2 cores).
const MIN_BLOCK: usize = 128 << 10;
/// How many freed blocks are kept at most.
const SLOTS: usize = 256;

/// One cached block: its address and layout (size 0 means empty).
#[derive(Clone, Copy)]
struct Slot {
    ptr: *mut u8,
    size: usize,
    align: usize,
}

/// A [`GlobalAlloc`] that caches freed blocks of at least 128 KiB (up to `budget` bytes, 256
/// blocks) and reuses them for requests of the same size class (sizes rounded up by at most
/// an eighth) and alignment. Everything else is the inner allocator's.
pub struct ReuseLarge<A> {
    inner: A,
    budget: AtomicUsize,
    cached: AtomicUsize,
    lock: AtomicBool,
    slots: std::cell::UnsafeCell<[Slot; SLOTS]>,
}

// SAFETY: `slots` is only read or written while `lock` is held (see `with_slots`), so the
// cache is shared between threads without data races; the raw pointers it holds are blocks
// no one else owns.
unsafe impl<A: Sync> Sync for ReuseLarge<A> {}

impl<A> ReuseLarge<A> {
    /// Wraps `inner`, caching at most `budget` bytes of freed large blocks.
    pub const fn new(inner: A, budget: usize) -> Self {
        const EMPTY: Slot = Slot { ptr: std::ptr::null_mut(), size: 0, align: 0 };
        Self {
            inner,
            budget: AtomicUsize::new(budget),
            cached: AtomicUsize::new(0),
            lock: AtomicBool::new(false),
            slots: std::cell::UnsafeCell::new([EMPTY; SLOTS]),
        }
    }

    /// Bytes currently held in the cache.
    pub fn cached_bytes(&self) -> usize {
        self.cached.load(Ordering::Relaxed)
    }

    /// Runs `f` on the slot table under the spin lock.
    ///
    /// (The table is a fixed array: `f` never allocates, so the allocator cannot re-enter.)
    fn with_slots<R>(&self, f: impl FnOnce(&mut [Slot; SLOTS]) -> R) -> R {
        while self
            .lock
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        // SAFETY: the lock is held, so this is the only reference to the table until it is
        // released below; `f` cannot re-enter (it does not allocate).
        let r = f(unsafe { &mut *self.slots.get() });
        self.lock.store(false, Ordering::Release);
        r
    }

    /// A cached block of exactly this layout, if there is one.
    fn take(&self, layout: Layout) -> Option<*mut u8> {
        let (size, align) = (layout.size(), layout.align());
        let ptr = self.with_slots(|slots| {
            let slot = slots.iter_mut().find(|s| s.size == size && s.align == align)?;
            let ptr = slot.ptr;
            *slot = Slot { ptr: std::ptr::null_mut(), size: 0, align: 0 };
            Some(ptr)
        })?;
        self.cached.fetch_sub(size, Ordering::Relaxed);
        Some(ptr)
    }

    /// Keeps a freed block if the budget and a slot allow; returns whether it was kept.
    fn keep(&self, ptr: *mut u8, layout: Layout) -> bool {
        let size = layout.size();
        if self.cached.load(Ordering::Relaxed).saturating_add(size)
            > self.budget.load(Ordering::Relaxed)
        {
            return false;
        }
        let kept = self.with_slots(|slots| match slots.iter_mut().find(|s| s.size == 0) {
            Some(slot) => {
                *slot = Slot { ptr, size, align: layout.align() };
                true
            }
            None => false,
        });
        if kept {
            self.cached.fetch_add(size, Ordering::Relaxed);
        }
        kept
    }
}

impl<A: GlobalAlloc> ReuseLarge<A> {
    /// Changes the byte budget; cached blocks beyond it are given back to the inner allocator
    /// at once. A workload whose tensor sizes vary from call to call (embedding texts of
    /// every length) gains little from the cache and should keep the budget small.
    pub fn set_budget(&self, budget: usize) {
        self.budget.store(budget, Ordering::Relaxed);
        while self.cached.load(Ordering::Relaxed) > budget {
            let evicted = self.with_slots(|slots| {
                let slot = slots.iter_mut().find(|s| s.size > 0)?;
                let taken = *slot;
                *slot = Slot { ptr: std::ptr::null_mut(), size: 0, align: 0 };
                Some(taken)
            });
            let Some(slot) = evicted else { break };
            self.cached.fetch_sub(slot.size, Ordering::Relaxed);
            // SAFETY: the slot held a block `inner` allocated with exactly this layout, and it
            // was removed from the table under the lock, so no one else can hand it out.
            unsafe {
                let layout = Layout::from_size_align_unchecked(slot.size, slot.align);
                self.inner.dealloc(slot.ptr, layout);
            }
        }
    }
}

// SAFETY: every block handed out is either fresh from `inner` with the request's block layout
// (`block_layout`: the size rounded up, never down) or a block `inner` allocated earlier with
// exactly that block layout that was freed to us and not handed out since (a slot is emptied
// under the lock before its block is returned). A freed pointer's layout maps to the same
// block layout it was allocated with, so blocks go back to `inner` with their own layout.
unsafe impl<A: GlobalAlloc> GlobalAlloc for ReuseLarge<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let block = block_layout(layout);
        if layout.size() >= MIN_BLOCK {
            if let Some(p) = self.take(block) {
                return p;
            }
        }
        // SAFETY: `block` is the caller's valid layout, its size rounded up within isize.
        unsafe { self.inner.alloc(block) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let block = block_layout(layout);
        if layout.size() >= MIN_BLOCK && self.keep(ptr, block) {
            return;
        }
        // SAFETY: `ptr` came from `inner` with the block layout of this layout (see the impl's
        // safety comment).
        unsafe { self.inner.dealloc(ptr, block) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let block = block_layout(layout);
        if layout.size() >= MIN_BLOCK {
            if let Some(p) = self.take(block) {
                // SAFETY: `p` is a live block of at least `layout.size()` bytes owned by the
                // caller now.
                unsafe { zero(p, layout.size()) };
                return p;
            }
        }
        // SAFETY: as in `alloc`.
        unsafe { self.inner.alloc_zeroed(block) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() < MIN_BLOCK && new_size < MIN_BLOCK {
            // SAFETY: both sizes are below the cached range, so `ptr` is `inner`'s own block.
            return unsafe { self.inner.realloc(ptr, layout, new_size) };
        }
        // SAFETY: `new_size` with the old alignment is a valid layout (the caller guarantees
        // it does not overflow isize); the copy covers the smaller of the two blocks, and the
        // old block is released with its own layout.
        unsafe {
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            let new = self.alloc(new_layout);
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

/// The layout a request is served with: from [`MIN_BLOCK`] on, the size rounded up to the
/// next multiple of an eighth of its highest power of two (at most 12.5% more), so that
/// tensors whose sizes differ a little (a batch of sentences padded to its own longest one)
/// share cached blocks; smaller requests, and sizes that rounding would push past
/// `isize::MAX`, unchanged. The same request always maps to the same block layout.
fn block_layout(layout: Layout) -> Layout {
    let size = layout.size();
    if size < MIN_BLOCK {
        return layout;
    }
    let step = (1usize << size.ilog2()) / 8;
    size.div_ceil(step)
        .checked_mul(step)
        .and_then(|rounded| Layout::from_size_align(rounded, layout.align()).ok())
        .unwrap_or(layout)
}

/// Bytes from which a reused block is zeroed on every rayon thread, and the chunk.
const PAR_ZERO_MIN: usize = 4 << 20;
const PAR_ZERO_CHUNK: usize = 1 << 20;

/// Zeroes `n` bytes at `p`. candle asks for zeroed memory once per gradient it accumulates
/// (`zeros_like`), and one thread zeroing reused blocks left the other cores idle (about 6% of
/// encoder-layer training on 2 cores), so large blocks are zeroed on every rayon thread.
/// rayon's own allocations are far below [`MIN_BLOCK`], so this cannot re-enter itself.
///
/// # Safety
/// `p` is valid for writes of `n` bytes and not accessed by anyone else meanwhile.
unsafe fn zero(p: *mut u8, n: usize) {
    if n < PAR_ZERO_MIN || rayon::current_num_threads() < 2 {
        // SAFETY: forwarded.
        unsafe { std::ptr::write_bytes(p, 0, n) };
        return;
    }
    use rayon::prelude::*;
    // SAFETY: forwarded; the slice lives only for this call.
    let block = unsafe { std::slice::from_raw_parts_mut(p, n) };
    block.par_chunks_mut(PAR_ZERO_CHUNK).for_each(|c| c.fill(0));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A freed block comes back for the same layout, and zeroed when asked: below and above
    /// the size from which it is zeroed in parallel.
    #[test]
    fn reused_blocks_come_back_zeroed() {
        let cache = ReuseLarge::new(std::alloc::System, 64 << 20);
        for size in [MIN_BLOCK, PAR_ZERO_MIN + 12_345] {
            let layout = Layout::from_size_align(size, 64).expect("a valid layout");
            cache.set_budget(64 << 20);
            // SAFETY: every block is used within its layout and freed with it.
            unsafe {
                let p = cache.alloc(layout);
                assert!(!p.is_null());
                std::ptr::write_bytes(p, 0xAB, size);
                cache.dealloc(p, layout);
                assert_eq!(cache.cached_bytes(), block_layout(layout).size());
                let q = cache.alloc_zeroed(layout);
                assert_eq!(q, p, "the kept block is reused");
                assert_eq!(cache.cached_bytes(), 0);
                let bytes = std::slice::from_raw_parts(q, size);
                assert!(bytes.iter().all(|&b| b == 0), "size {size}: not zeroed");
                cache.set_budget(0); // the next free goes back to the system
                cache.dealloc(q, layout);
            }
        }
    }

    /// Sizes within an eighth share a block; the block's size is the class's, and freeing
    /// with either request's layout gives it back whole.
    #[test]
    fn similar_sizes_share_a_block() {
        let mib = 1 << 20;
        let class = |n: usize| block_layout(Layout::from_size_align(n, 8).expect("layout")).size();
        assert_eq!(class(MIN_BLOCK - 1), MIN_BLOCK - 1, "below MIN_BLOCK: unchanged");
        assert_eq!(class(5 * mib), 5 * mib);
        assert_eq!(class(5 * mib - 1000), 5 * mib);
        assert_eq!(class(5 * mib + 1), 5 * mib + mib / 2);
        let huge = isize::MAX as usize - 7;
        assert_eq!(class(huge), huge, "past isize::MAX: unchanged");
        for n in [mib, 3 * mib + 7, 100 * mib + 12_345] {
            assert!(class(n) >= n && class(n) - n <= n / 8, "{n} -> {}", class(n));
        }
        let cache = ReuseLarge::new(std::alloc::System, 64 << 20);
        let big = Layout::from_size_align(5 * mib, 64).expect("layout");
        let small = Layout::from_size_align(5 * mib - 4096, 64).expect("layout");
        // SAFETY: each block is written within the request that holds it and freed with that
        // request's layout.
        unsafe {
            let p = cache.alloc(big);
            cache.dealloc(p, big);
            let q = cache.alloc(small);
            assert_eq!(q, p, "the 5 MiB block serves a slightly smaller request");
            std::ptr::write_bytes(q, 1, small.size());
            cache.dealloc(q, small);
            assert_eq!(cache.cached_bytes(), 5 * mib);
            let r = cache.alloc_zeroed(big);
            assert_eq!(r, p);
            assert!(std::slice::from_raw_parts(r, big.size()).iter().all(|&b| b == 0));
            cache.set_budget(0);
            cache.dealloc(r, big);
        }
    }
}
