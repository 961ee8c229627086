//! The blocked driver: `k` and `n` blocks, `B` packed once per block by all threads, then the
//! rows of `A` in blocks spread over the threads, each rounding its block to bf16 and running
//! the micro-kernel over its tiles.

use std::cell::RefCell;

use rayon::prelude::*;

use super::amx::AMX_MR;
use super::micro::{Kernel, Tile};
use super::pack::{
    by_rows, pack_a, pack_a_by_pairs, pack_b, pack_b_rows, packs_by_pairs, ABlock, BBlock,
};
use super::select::resolve;
use super::{BfMat, Elems, KC, MR, NC, NR};
use crate::aligned::{aligned_mut, AlignedTile, LINE};
use crate::attention::exec::{ConstPtr, SyncPtr};
use crate::attention::{KernelError, SimdLevel};
use crate::epilogue::{Act, TileEpilogue, TileOut};

mod chunks;
use chunks::{chunked, TALL_MC};

/// Row blocks of `A`: 96 rows of `KC` bf16, 192 KiB: an L2's share (sixteen tiles of the
/// `vdpbf16ps` kernel, three of the AMX kernel).
const MC: usize = 96;
/// `B` panels one packing task handles.
const PACK_PANELS: usize = 2;
/// Pairs of rows one packing task of a row-major `B` handles (of every panel).
const ROW_PAIRS: usize = 32;
/// Pairs of every row one task of the pair-by-pair packing of a transposed `A` handles
/// ([`pack_a_by_pairs`]).
const PAIR_TASK: usize = 32;
/// Most elements of an `A` rounded once for all column blocks (32 MiB; a layer's `A` over
/// 4096 tokens is 4 MiB, the transposed output gradient of a `Linear(512, 2048)`'s weight
/// gradient over 4096 tokens 16.1 MiB): larger ones are rounded per block, as the calling
/// thread keeps the buffer for its next product.
const PACKED_A_WORDS: usize = 16 << 20;
/// Words of a packed `B` block on the bf16-output path, whose one block spans the whole depth
/// (4 MiB: 1024 columns at a depth of 2048, 512 at 4096), or a quarter of it where many row
/// blocks read it ([`deep_b_words`]).
const DEEP_B_WORDS: usize = 1 << 20;
/// Row blocks from which a bf16 output's `B` block is kept to a quarter of `DEEP_B_WORDS`
/// ([`deep_b_words`]).
const L2_B_MIN_BLOCKS: usize = 16;
/// Depth (elements) above which the micro-kernels read a bf16 `A` in place even where its rows
/// are a multiple of 1 KiB apart ([`reads_a_in_place`]).
const IN_PLACE_DEPTH: usize = 512;

/// Multiply-adds below which a product runs on the calling thread, its tasks in order (the
/// attention kernels' threshold): sending a small product's tasks to rayon's pool from a thread
/// outside it and sleeping until they are done costs more than the product. Each task writes
/// its own part of the output, so the bits are the same either way.
const SERIAL_BELOW: usize = 1 << 19;

#[cfg(test)]
thread_local! {
    /// Whether the tests send even a small product's tasks to the pool.
    pub(super) static FORCE_PARALLEL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether a small product goes to the pool anyway (the tests compare both ways).
fn parallel_forced() -> bool {
    #[cfg(test)]
    return FORCE_PARALLEL.with(|f| f.get());
    #[cfg(not(test))]
    false
}

/// Runs `f(t)` for every task `t < count`: on rayon's pool, or here, in order (`serial`).
fn for_each_task(serial: bool, count: usize, f: impl Fn(usize) + Send + Sync) {
    match serial {
        true => (0..count).for_each(f),
        false => (0..count).into_par_iter().for_each(f),
    }
}

/// [`for_each_task`] for tasks that may fail: the first error (on the pool, any one).
fn try_for_each_task<E: Send>(
    serial: bool,
    count: usize,
    f: impl Fn(usize) -> Result<(), E> + Send + Sync,
) -> Result<(), E> {
    match serial {
        true => (0..count).try_for_each(f),
        false => (0..count).into_par_iter().try_for_each(f),
    }
}

/// Depth (elements) up to which a task on AMX walks its row tiles outermost
/// ([`a_stationary`]).
const A_STATIONARY_DEPTH: usize = 512;

/// Whether a task walks its row tiles outermost, each 32-row strip of `A` kept in L1 while
/// every `B` panel of the block streams past it from L2 (`tileloaddt1`), rather than its
/// column panels outermost: on AMX, where the strip of a block of depth `kc` (`64·kc` bytes,
/// 32 KiB at 512) leaves L1 room for the streaming tiles. The other order reads a new strip
/// every second 32-column half, and the strip and the panel it meets no longer both fit in
/// L1. The same tile products, so the same bits. On an AMX CPU (family 6 model 167, 2
/// threads), `multihead bench --module linear --dtype bf16` `Linear(512, 2048)` forward on
/// `(8, 512, 512)`: minimum 3.27-3.58 -> 2.82-3.24 ms (four alternating runs); at a depth of
/// 2048 (`Linear(2048, 512)`), where a strip is 128 KiB either way, no change.
fn a_stationary(kern: Kernel, kc: usize) -> bool {
    kern.tiles() && kc <= A_STATIONARY_DEPTH
}

/// Depth (elements) up to which an f32 output on AMX runs as one deep block ([`Out::deep`]).
const DEEP_F32_DEPTH: usize = 2048;

/// Rows of the previous tile's epilogue per call between the tile steps ([`Pending::rows`]).
/// Each call has a cost of its own (the dispatch to the bias and activation's loop, the
/// registers it saves); on an AMX CPU (family 6 model 167, 2 threads) the bf16
/// `Linear(512, 2048)` forward on `(8, 512, 512)` took 4.33-4.91 ms with a call per row, 3.46-4.13
/// with 4 rows and 3.72-4.30 with 8 (eight alternating runs each).
const EPILOGUE_ROWS: usize = 4;

/// Where the product goes.
#[derive(Clone, Copy)]
pub(super) enum Out {
    /// f32 `C` with row stride `ldc`, overwritten or (`accumulate`) added to; with an
    /// epilogue, each tile becomes `act(C + bias)` after its last `k` block.
    F32 { c: SyncPtr<f32>, ldc: usize, accumulate: bool, epilogue: Option<Epilogue> },
    /// `bf16(act(A·B + bias))` with row stride `ldo`: the whole depth in one block, each tile
    /// computed into a local buffer and its epilogue applied as it leaves the kernel (no f32
    /// `C` in memory).
    Bf16 { out: SyncPtr<u16>, ldo: usize, epilogue: Epilogue },
}

impl Out {
    /// Whether the product runs the whole depth in one block, each tile computed into a local
    /// buffer and leaving it through its epilogue (no partial sums in memory, no second pass
    /// over the output): a bf16 output, and on AMX an f32 output that is not added to, up to a
    /// depth of [`DEEP_F32_DEPTH`] or in chunks past it. The f32 output of a bf16 encoder
    /// layer's second feed-forward product (depth 2048), which wrote and read back its partial
    /// sums between two blocks of 1024 deep, and its output projection (depth 512), whose
    /// epilogue read each tile back from the output, made `multihead bench --module
    /// encoder-layer --dtype bf16 --eval` (E 512, F 2048, 4096 tokens) 19.6-22.7 (median 21.1) -> 19.7-21.8 (20.8)
    /// ms, six alternating runs on AMX (family 6 model 167, 2 threads). At the training step's
    /// depth of 4096 (weight gradients over the tokens) it was 1-2% slower over the whole
    /// depth at once; in chunks (past `DEEP_F32_DEPTH`, [`chunked`]) those weight gradients
    /// (`ONLY=dw32` of the `bf16gemm` example) went 5.6-5.8 -> 5.2 ms (`Linear(512, 2048)`),
    /// 4.3-4.5 -> 3.7-3.8 (`Linear(512, 1536)`), 7.2 -> 6.4-6.5 (`Linear(2048, 512)`), and
    /// `bench --module decoder-layer --dtype bf16 --backward` 161.5-175.2 -> 157.8-161.0 ms
    /// (three alternating runs; the encoder layer's 100.5-103.7 -> 99.5-103.6, five).
    fn deep(&self, kern: Kernel, k: usize) -> bool {
        match self {
            Out::Bf16 { .. } => true,
            Out::F32 { accumulate, .. } => {
                kern.tiles() && !accumulate && (k <= DEEP_F32_DEPTH || chunked(true, kern, k))
            }
        }
    }

    /// Where a deep product's tiles go and the epilogue on their way (`act(C + bias)`, or
    /// nothing to apply for an f32 output without one).
    fn deep_parts(&self) -> (Dest, usize, Epilogue) {
        let none = || Epilogue { bias: None, act: Act::Identity, level: SimdLevel::Scalar };
        match *self {
            Out::Bf16 { out, ldo, epilogue } => (Dest::Bf16(out.0), ldo, epilogue),
            Out::F32 { c, ldc, epilogue, .. } => {
                (Dest::F32(c.0), ldc, epilogue.unwrap_or_else(none))
            }
        }
    }
}

/// A deep product's output (see [`Out::deep`]).
#[derive(Clone, Copy)]
enum Dest {
    Bf16(*mut u16),
    F32(*mut f32),
}

impl Dest {
    /// The output `off` elements further on.
    ///
    /// # Safety
    /// That element lies inside the output.
    unsafe fn add(self, off: usize) -> Dest {
        // SAFETY: forwarded.
        unsafe {
            match self {
                Dest::Bf16(p) => Dest::Bf16(p.add(off)),
                Dest::F32(p) => Dest::F32(p.add(off)),
            }
        }
    }

    /// The output from here, rows `ld` apart, as an epilogue writes it.
    fn tile_out(self, ld: usize) -> TileOut {
        match self {
            Dest::Bf16(out) => TileOut::Bf16 { out, ldo: ld },
            Dest::F32(out) => TileOut::F32 { out, ldo: ld },
        }
    }
}

/// A product's epilogue: `act(C + bias)` (bias of `n` values), at `level`.
#[derive(Clone, Copy)]
pub(super) struct Epilogue {
    pub(super) bias: Option<ConstPtr<f32>>,
    pub(super) act: Act,
    pub(super) level: SimdLevel,
}

thread_local! {
    /// The packed `B` block, reused across calls on the calling thread.
    static PACKED_B: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    /// Every row block of `A`, rounded once for all column blocks (on the calling thread).
    static PACKED_A: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
    /// Every row block of one depth block of `A`, packed pair by pair (on the calling thread).
    static PACKED_A_BLOCKS: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
    /// A worker's rounded block of `A`, reused across tasks.
    static A_BLOCK: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` elements of `key`'s buffer from a 64-byte boundary (a private one if the
/// thread's is in use by a re-entrant call, which is not expected), or errors naming what could
/// not be allocated.
fn with_buffer<T: Copy + Default + 'static, R>(
    key: &'static std::thread::LocalKey<RefCell<Vec<T>>>,
    len: usize,
    what: &str,
    f: impl FnOnce(&mut [T]) -> Result<R, KernelError>,
) -> Result<R, KernelError> {
    key.with(|cell| {
        let mut own = Vec::new();
        let mut guard = cell.try_borrow_mut();
        let v = match guard.as_mut() {
            Ok(v) => &mut **v,
            Err(_) => &mut own,
        };
        // From a line boundary: the tiles load these rows (see `aligned`).
        let buf = aligned_mut(v, len).ok_or_else(|| KernelError::InvalidArgument {
            name: "matmul_bf16",
            msg: format!("cannot allocate {len} elements to pack {what}"),
        })?;
        f(buf)
    })
}

/// The pointer inside (a function, so that closures capture the shareable wrapper whole).
fn raw<T>(p: SyncPtr<T>) -> *mut T {
    p.0
}

/// How the rows of `A` are cut: `(mc, row blocks)`, at least two blocks per thread when the
/// rows allow it. Blocks are `target` rows high (`MC`, or a chunked product's `TALL_MC`)
/// unless a lower height (in whole micro-kernel rows) leaves the busiest thread at least 2%
/// fewer tiles: 512 rows at 96 are six blocks,
/// the last of 32 rows, and one thread of two then runs 288 rows while the other waits at the
/// pass's end after 224 (a bf16 `Linear(512, 512)`'s weight gradient at a depth of 4096 took
/// 2.3 ms in blocks of 96 rows and 1.8 ms in blocks of 64, family 6 model 167 on AMX).
fn row_blocks(m: usize, threads: usize, mr: usize, target: usize) -> (usize, usize) {
    let (tiles, per) = (m.div_ceil(mr), (target / mr).max(1));
    // Tiles of the busiest thread with blocks of `c` tiles dealt out evenly.
    let load = |c: usize| tiles.div_ceil(c).div_ceil(threads.max(1)) * c;
    let mut c = per;
    for lower in (1..per).rev() {
        if load(lower) * 50 <= load(c) * 49 {
            c = lower;
        }
    }
    let mut mc = c * mr;
    if threads > 1 && m.div_ceil(mc) < 2 * threads {
        mc = m.div_ceil(2 * threads).div_ceil(mr).max(1) * mr;
    }
    (mc, m.div_ceil(mc))
}

/// Runs the product (arguments checked by `matmul_bf16`, `m, n, k > 0`). Without
/// `accumulate`, every element of the `m × n` view of `C` is written before it is read, so
/// `c` may point at memory not yet initialised; so may a bf16 output.
///
/// # Safety
/// An f32 `C` is valid for writes (and, with `accumulate`, reads) of row `i` at `c + i·ldc`,
/// columns `0..n`, for `i < m`; a bf16 output likewise at `out + i·ldo`, its bias (if any)
/// holds `n` values; no other reference reaches the output meanwhile.
pub(super) unsafe fn run(a: &BfMat, b: &BfMat, out: Out) -> Result<(), KernelError> {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let kern = resolve();
    let serial = m.saturating_mul(n).saturating_mul(k) < SERIAL_BELOW && !parallel_forced();
    let threads = if serial { 1 } else { rayon::current_num_threads().max(1) };
    let deep = out.deep(kern, k);
    let target = if chunked(deep, kern, k) { TALL_MC } else { MC };
    let (mc, blocks) = row_blocks(m, threads, kern.mr(), target);
    // Whether every row block of `A` fits the buffer that rounds it once for all column blocks.
    let lda = a_stride(kern, pairs(kern, k));
    let words = blocks.checked_mul(mc).and_then(|r| r.checked_mul(lda));
    let in_place = reads_a_in_place(kern, a);
    let a_once = words.filter(|&w| w <= PACKED_A_WORDS && !in_place);
    let (kc_max, nc_max) = match deep {
        false => (KC, NC),
        true => {
            let words = deep_b_words(blocks, a.col_stride == 1 || a_once.is_some());
            let widest = (words / pairs(kern, k) / NR * NR).clamp(NR, NC);
            // Column blocks of even width (384 columns as 192 + 192, not 320 + 64).
            (k, n.div_ceil(n.div_ceil(widest)).div_ceil(NR) * NR)
        }
    };
    let nc_max = nc_max.min(n.div_ceil(NR) * NR);
    let len = pairs(kern, kc_max.min(k)) * nc_max;
    // One depth block over several column blocks: `A` is rounded once for all of them (up to
    // `PACKED_A_WORDS`, a buffer the calling thread keeps).
    if let Some(words) = a_once.filter(|_| k <= kc_max && n > nc_max) {
        return with_buffer(&PACKED_A, words, "a", |abuf| {
            let dst = SyncPtr(abuf.as_mut_ptr());
            if packs_by_pairs(kern, a) {
                // Every row block at once, pair by pair along whole source rows (`mc` is a
                // multiple of the kernel's rows, so each block's tiles lie where the pair
                // packer puts them).
                // SAFETY: `packs_by_pairs` held; the buffer holds `blocks · mc · lda >=
                // m.div_ceil(MR) · MR · lda` elements; `lda = 2·k.div_ceil(2)`, the vector
                // layout's stride for the whole depth.
                unsafe { pack_pairs_in_parallel(a, lda, dst, serial) };
                let source = ASource::Rounded(ConstPtr(dst.0 as *const u16), (2, 2 * MR));
                let sizes = (kern, kc_max, nc_max, len);
                // SAFETY: forwarded; the rounded rows hold the whole depth of every row block.
                return unsafe { run_blocks(a, b, out, sizes, (mc, blocks, threads), source) };
            }
            let pack = |rb: usize| {
                let (i0, rows) = (rb * mc, mc.min(m - rb * mc));
                let padded = rows.div_ceil(kern.mr()) * kern.mr();
                let blk = ABlock { i0, rows, padded, p0: 0, kc: k, lda };
                // SAFETY: the block lies inside `a` (checked by `matmul_bf16`); row block
                // `rb` owns `mc · lda >= padded · lda` elements of the buffer from
                // `rb · mc · lda` (`mc` is a multiple of the kernel's rows).
                unsafe { pack_a(kern, a, blk, raw(dst).add(rb * mc * lda)) }
            };
            // Every block's strides are the same: they depend on the layout only.
            let strides = match serial {
                true => (0..blocks).map(pack).fold((0, 0), |x, y| x.max(y)),
                false => (0..blocks).into_par_iter().map(pack).reduce(|| (0, 0), |x, y| x.max(y)),
            };
            let source = ASource::Rounded(ConstPtr(dst.0 as *const u16), strides);
            let sizes = (kern, kc_max, nc_max, len);
            // SAFETY: forwarded; the rounded rows hold the whole depth of every row block.
            unsafe { run_blocks(a, b, out, sizes, (mc, blocks, threads), source) }
        });
    }
    let source = if in_place { ASource::InPlace } else { ASource::Pack };
    // SAFETY: forwarded.
    unsafe { run_blocks(a, b, out, (kern, kc_max, nc_max, len), (mc, blocks, threads), source) }
}

/// Whether the micro-kernels read `A`'s bf16 rows where they lie instead of a packed copy: `A`
/// row-major bf16 whose rows are either not a multiple of 1 KiB apart or deeper than
/// [`IN_PLACE_DEPTH`], and
///
/// - for the tile kernels, every row on a cache line (the tiles load 64-byte rows at a third
///   of their rate across lines) and its depth whole tile steps (no zero columns to add);
/// - for the `vdpbf16ps` layout, whose kernels read one pair of a row per step wherever it
///   lies (`(row stride, 2)` are strides they take as they take a packed block's), its depth
///   whole pairs (no zero to add after an odd last element).
///
/// Rows 1 KiB apart (or a multiple) at a depth of 512 share L1 sets; a packed copy's extra line
/// keeps the 32-row strip that a tile's second half reads again in L1, and the copy cost what it
/// saved with the vector kernel too, so such rows are packed. Otherwise the packed copy of a
/// bf16 `A` was only that: a bf16 `Linear(2048, 512)` forward on AMX (4096 rows, rows 4 KiB
/// apart) went 3.97-4.50 -> 3.55-3.72 ms, with 16% of its samples in the copy before;
/// `Linear(512, 2048)` (rows 1 KiB apart, depth 512) was the same either way (family 6 model
/// 167, 2 threads, five alternating runs). On AVX512-BF16 (AMD family 26 model 2, Zen 5, 2
/// threads, `ONLY=fwd|dx` of the `bf16gemm` example, three alternating runs), the products 2048
/// deep went 10.15-10.41 -> 9.55-9.70 ms (`y = x·Wᵀ` of `Linear(2048, 512)`) and 10.22-10.60 ->
/// 9.54-9.71 ms (`dx = dy·W` of `Linear(512, 2048)`); those 512 deep moved within the noise
/// either way. A task whose rows end in a partial tile packs its block as before.
pub(super) fn reads_a_in_place(kern: Kernel, a: &BfMat) -> bool {
    const STEP: usize = 2 * super::amx::AMX_KP;
    let Elems::Bf16(x) = a.data else {
        return false;
    };
    let apart = a.cols > IN_PLACE_DEPTH || !a.row_stride.is_multiple_of(512);
    if a.col_stride != 1 || !apart {
        return false;
    }
    match kern.tiles() {
        true => {
            (x.as_ptr() as usize).is_multiple_of(LINE)
                && a.row_stride.is_multiple_of(STEP)
                && a.cols.is_multiple_of(STEP)
        }
        false => a.cols.is_multiple_of(2),
    }
}

/// [`run`]'s blocks of `B` and the passes over them, reading `A` from `source`, on `threads`
/// threads (one: on the calling thread, the tasks in order).
///
/// # Safety
/// As for [`run`]; a rounded `source` holds the whole depth of every row block in the layout
/// the kernel reads; an in-place one is chosen by [`reads_a_in_place`].
unsafe fn run_blocks(
    a: &BfMat,
    b: &BfMat,
    out: Out,
    (kern, kc_max, nc_max, len): (Kernel, usize, usize, usize),
    (mc, blocks, threads): (usize, usize, usize),
    source: ASource,
) -> Result<(), KernelError> {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let serial = threads == 1;
    // A transposed `A` on the vector kernel: each depth block of every row block is packed
    // before the block's tasks, pair by pair along whole source rows, as `run` packs the whole
    // depth once where it can (`by_pairs_words`).
    let pair_words = by_pairs_words(kern, a, source, (mc, blocks), kc_max.min(k));
    with_buffer(&PACKED_A_BLOCKS, pair_words.unwrap_or(0), "a", |abuf| {
        let ablocks = SyncPtr(abuf.as_mut_ptr());
        with_buffer(&PACKED_B, len, "b", |buf| {
            let packed = SyncPtr(buf.as_mut_ptr());
            for j0 in (0..n).step_by(nc_max) {
                let cols = (n - j0).min(nc_max);
                let panels = cols.div_ceil(NR);
                // Few row blocks: also cut the columns, so that every thread has work.
                let col_parts = if blocks >= 2 * threads {
                    1
                } else {
                    (2 * threads).div_ceil(blocks).min(panels)
                };
                for p0 in (0..k).step_by(kc_max) {
                    let kc = (k - p0).min(kc_max);
                    let kp = pairs(kern, kc);
                    if by_rows(b) {
                        // A row-major `B` is packed in memory order: each task a range of pairs
                        // of every panel.
                        let blk = BBlock { p0, kc, kp, j0, cols, panels: 0..panels };
                        for_each_task(serial, kp.div_ceil(ROW_PAIRS), |t| {
                            let pairs = t * ROW_PAIRS..((t + 1) * ROW_PAIRS).min(kp);
                            // SAFETY: as below; this task alone writes pairs `pairs` of every
                            // panel.
                            unsafe { pack_b_rows(kern, b, &blk, pairs, raw(packed)) }
                        });
                    } else {
                        for_each_task(serial, panels.div_ceil(PACK_PANELS), |t| {
                            let range = t * PACK_PANELS..((t + 1) * PACK_PANELS).min(panels);
                            // SAFETY: the block lies inside `b` (checked by `matmul_bf16`); the
                            // buffer holds `panels` panels of `kp · NR` words (sized above: `kp`
                            // grows with `kc`) and this task alone writes its panels.
                            unsafe {
                                let blk = BBlock { p0, kc, kp, j0, cols, panels: range };
                                pack_b(kern, b, blk, raw(packed))
                            }
                        });
                    }
                    let source = match pair_words {
                        Some(_) => {
                            let view = depth_view(a, p0, kc);
                            // SAFETY: `packs_by_pairs` held (`by_pairs_words`); the buffer
                            // holds `blocks · mc · a_stride(kern, pairs(kern, kc_max)) >=
                            // m.div_ceil(MR) · MR · lda` elements (`kc <= kc_max`); `lda =
                            // 2·kp >= kc`, the vector layout's stride for the block's depth.
                            unsafe {
                                pack_pairs_in_parallel(&view, a_stride(kern, kp), ablocks, serial)
                            };
                            ASource::Rounded(ConstPtr(ablocks.0 as *const u16), (2, 2 * MR))
                        }
                        None => source,
                    };
                    let block = Block { p0, kc, kp, j0, cols, panels, packed: ConstPtr(packed.0) };
                    let load_c = p0 > 0 || matches!(out, Out::F32 { accumulate: true, .. });
                    let last = p0 + kc == k;
                    let deep = out.deep(kern, k);
                    let pass = Pass { a, block, m, mc, col_parts, out, load_c, last, source, deep };
                    try_for_each_task(serial, blocks * col_parts, |t| pass.task(t, kern))?;
                }
            }
            Ok(())
        })
    })
}

/// Every row of a transposed `A` packed pair by pair ([`pack_a_by_pairs`]) into `dst`, the
/// pairs in tasks of [`PAIR_TASK`] on every thread (in order on this one, `serial`).
///
/// # Safety
/// As for [`pack_a_by_pairs`] over all `lda / 2` pairs: `packs_by_pairs` holds for `a`, `lda` is
/// even and at least `a.cols`, `dst` holds `a.rows.div_ceil(MR) · MR · lda` elements and no one
/// else reads or writes them meanwhile.
unsafe fn pack_pairs_in_parallel(a: &BfMat, lda: usize, dst: SyncPtr<u16>, serial: bool) {
    let kp = lda / 2;
    for_each_task(serial, kp.div_ceil(PAIR_TASK), |t| {
        let range = t * PAIR_TASK..((t + 1) * PAIR_TASK).min(kp);
        // SAFETY: forwarded; `range.end <= lda / 2`, and this task alone writes pairs `range`
        // of every tile.
        unsafe { pack_a_by_pairs(a, lda, range, raw(dst)) }
    });
}

/// The words of [`run_blocks`]' buffer for every row block of a depth block of `A` packed pair
/// by pair (`kc` deep at most), where it packs them so: a transposed `A` on the vector kernel
/// ([`packs_by_pairs`]) that the tasks would pack themselves (`ASource::Pack`), and a buffer
/// within [`PACKED_A_WORDS`]; `None` otherwise. Each task packed a run of its rows' features
/// from every row of the depth (one run per page of `dy`): the blocked weight gradients of a
/// bf16 layer's training (f32 outputs, depth blocks of `KC`).
fn by_pairs_words(
    kern: Kernel,
    a: &BfMat,
    source: ASource,
    (mc, blocks): (usize, usize),
    kc: usize,
) -> Option<usize> {
    if !matches!(source, ASource::Pack) || !packs_by_pairs(kern, a) {
        return None;
    }
    let lda = a_stride(kern, pairs(kern, kc));
    blocks.checked_mul(mc)?.checked_mul(lda).filter(|&w| w <= PACKED_A_WORDS)
}

/// Columns `p0..p0 + kc` (the depth) of a transposed `A` as a matrix of its own.
fn depth_view<'a>(a: &BfMat<'a>, p0: usize, kc: usize) -> BfMat<'a> {
    let from = p0 * a.col_stride;
    let data = match a.data {
        Elems::F32(x) => Elems::F32(&x[from.min(x.len())..]),
        Elems::Bf16(x) => Elems::Bf16(&x[from.min(x.len())..]),
    };
    BfMat { data, cols: kc, ..*a }
}

/// Words of the packed `B` block of a bf16 output (the whole depth in one block) over `blocks`
/// row blocks of `A` (`a_cheap`: `A` row-major, or rounded once for all column blocks):
/// [`DEEP_B_WORDS`], or a quarter of it (1 MiB, which stays in L2) where many row blocks
/// stream the block again each and `A` costs little to read again per column block. A bf16
/// `Linear(2048, 512)` forward (4096 rows, 64 blocks) went 4.72-4.89 -> 3.96-4.38 ms (family
/// 6 model 167, AMX). A transposed `A` (a weight gradient's `dyᵀ`) rounded again per narrower
/// block made `Linear(512, 2048)`'s forward+backward 18.4-19.6 -> 21.6-22.6 ms; rounded once
/// ([`PACKED_A_WORDS`]), its weight gradient (2048 × 512 at a depth of 4096) went 7.43-7.49
/// -> 6.13-6.35 ms (`cargo run --release -p multihead-kernels --example bf16gemm`).
fn deep_b_words(blocks: usize, a_cheap: bool) -> usize {
    if blocks >= L2_B_MIN_BLOCKS && a_cheap {
        DEEP_B_WORDS / 4
    } else {
        DEEP_B_WORDS
    }
}

/// The row stride of a packed block of `A` with `kp` pairs (in bf16 elements): `2·kp`, and for
/// the AMX layout one cache line more where `2·kp` is a multiple of 512 elements. Rows 1 KiB
/// (or a multiple) apart fall into the same L1 sets: the tiles' 16-row loads then evict each
/// other, and so did the transposing packer's 16-row scatters (a bf16 `Linear`'s weight gradient
/// on AMX, at a depth of 4096, packed 2x faster with the extra line; the packer now stores 16
/// rows of 64 bytes per step, which the line keeps in different sets too).
fn a_stride(kern: Kernel, kp: usize) -> usize {
    if kern.tiles() && (2 * kp).is_multiple_of(512) {
        2 * kp + 32
    } else {
        2 * kp
    }
}

/// Pairs of a packed block of depth `kc`: `kc/2` rounded up to whole pairs and to the
/// kernel's tile steps.
fn pairs(kern: Kernel, kc: usize) -> usize {
    kc.div_ceil(2).div_ceil(kern.kp_align()) * kern.kp_align()
}

/// One `(k block, n block)` of the product and where its packed `B` lives.
#[derive(Clone, Copy)]
struct Block {
    p0: usize,
    kc: usize,
    /// Pairs of the packed block (`kc/2` rounded up to the kernel's alignment).
    kp: usize,
    j0: usize,
    cols: usize,
    panels: usize,
    packed: ConstPtr<u32>,
}

/// The compute pass over one block: row blocks of `A` times parts of the `B` panels.
struct Pass<'a> {
    a: &'a BfMat<'a>,
    block: Block,
    m: usize,
    mc: usize,
    col_parts: usize,
    out: Out,
    load_c: bool,
    /// Whether this is the last `k` block (the epilogue's turn).
    last: bool,
    source: ASource,
    /// The whole depth in one block, each tile through a local buffer ([`Out::deep`]).
    deep: bool,
}

/// A block of `A` read in place: `A`'s elements, the block's first one, the strides.
type OwnRows = (ConstPtr<u16>, usize, (usize, usize));

/// Where the tiles read `A` from.
#[derive(Clone, Copy)]
enum ASource {
    /// Each task rounds its row block into its own buffer.
    Pack,
    /// Every row block rounded once for all column blocks (row block `rb` at `rb · mc · lda`),
    /// and the strides the kernel reads it with (see [`run`]).
    Rounded(ConstPtr<u16>, (usize, usize)),
    /// `A`'s own bf16 rows ([`reads_a_in_place`]), where a task's rows are whole tiles.
    InPlace,
}

impl Pass<'_> {
    /// `A`'s own rows `i0..i0 + rows` where the tiles read them in place (`reads_a_in_place`,
    /// and whole tiles of `mr` rows): `A`'s elements, the offset of the block's first one (at
    /// the block's depth `p0`), and the strides; `None` where the block is packed.
    fn own_rows(&self, i0: usize, rows: usize, mr: usize) -> Option<OwnRows> {
        match (self.source, self.a.data) {
            (ASource::InPlace, Elems::Bf16(src)) if rows.is_multiple_of(mr) => {
                let rs = self.a.row_stride;
                Some((ConstPtr(src.as_ptr()), i0 * rs + self.block.p0, (rs, 2)))
            }
            _ => None,
        }
    }

    /// Task `t`: one row block of `A` against one part of the `B` panels.
    fn task(&self, t: usize, kern: Kernel) -> Result<(), KernelError> {
        let x = &self.block;
        let (rb, part) = (t / self.col_parts, t % self.col_parts);
        let i0 = rb * self.mc;
        let rows = self.mc.min(self.m - i0);
        let mr = kern.mr();
        let padded = rows.div_ceil(mr) * mr;
        let kp = x.kp;
        let lda = a_stride(kern, kp);
        let (q0, q1) = (part * x.panels / self.col_parts, (part + 1) * x.panels / self.col_parts);
        if self.chunked(kern) {
            return self.task_chunked(kern, (i0, rows), (q0, q1));
        }
        let mut out = TileFlow::new();
        let own = self.own_rows(i0, rows, mr);
        let words = match (own, self.source) {
            (None, ASource::Pack | ASource::InPlace) => padded * lda,
            _ => 0,
        };
        with_buffer(&A_BLOCK, words, "a", |abuf| {
            // SAFETY: `abuf` holds `padded · lda` elements; or the block was rounded already
            // at `i0 · lda` of the rounded source; or `A`'s own rows are read, whole tiles of
            // them, at most the depth `p0 + kc <= k` of each (`k` and the block depths whole
            // tile steps for the tiles, whole pairs for the vector kernels, so no step reads
            // past a row: `reads_a_in_place`, `KC`); the block lies inside `a`
            // (checked by `matmul_bf16`); tiles are inside the output (checked too) and this
            // task alone writes rows `i0..i0+rows` of panels `q0..q1`; the packed `B` was
            // written before this pass began; `local` holds a whole tile of either kernel.
            unsafe {
                // The block's first element, its strides, and the elements between its row
                // tiles (micro-panels are `lda` apart too).
                let (abase, strides, tile_step) = match (own, self.source) {
                    (Some((p, at, strides)), _) => (p.0.add(at), strides, strides.0),
                    (None, ASource::Rounded(p, strides)) => (p.0.add(i0 * lda), strides, lda),
                    (None, _) => {
                        let blk = ABlock { i0, rows, padded, p0: x.p0, kc: x.kc, lda };
                        let strides = pack_a(kern, self.a, blk, abuf.as_mut_ptr());
                        (abuf.as_ptr(), strides, lda)
                    }
                };
                let _tiles = kern.begin();
                // Column panels outermost, or row tiles outermost (`a_stationary`).
                let (panels, tiles) = (q1 - q0, rows.div_ceil(mr));
                let by_row = a_stationary(kern, x.kc);
                for t in 0..panels * tiles {
                    let (qi, ri) = match by_row {
                        true => (t % panels, t / panels),
                        false => (t / tiles, t % tiles),
                    };
                    let (q, ir) = (q0 + qi, ri * mr);
                    let bpanel = x.packed.0.add(q * kp * NR);
                    let j = x.j0 + q * NR;
                    let cols = NR.min(x.cols - q * NR);
                    let ap = abase.add(ir * tile_step);
                    let live = mr.min(rows - ir);
                    let tile = Tile { kp, a: ap, strides, b: bpanel, load_c: self.load_c };
                    out.tile(self, kern, tile, (i0 + ir, j), (live, cols));
                }
                out.finish(self);
            }
            Ok(())
        })
    }
}

/// How a task's tiles leave the kernel and meet their epilogues, one tile behind: a deep
/// product's through two local buffers in turn (a tile's epilogue runs during the next tile's
/// products: [`Pending`]), an f32 output's through the output itself (the previous tile's
/// epilogue runs after this tile's stores, as reading a tile right after the stores that wrote
/// it waits for them).
struct TileFlow {
    locals: [AlignedTile<{ AMX_MR * NR }>; 2],
    pending: Option<Pending>,
    /// An f32 output's last tile whose epilogue has not run yet: (tile, rows, columns, first
    /// column).
    stored: Option<(*mut f32, usize, usize, usize)>,
}

impl TileFlow {
    fn new() -> Self {
        TileFlow {
            locals: [AlignedTile::zeros(), AlignedTile::zeros()],
            pending: None,
            stored: None,
        }
    }

    /// Runs `tile`, whose `live × cols` results go to row `i`, column `j` of the output.
    ///
    /// # Safety
    /// As for [`Pass::task`]'s tiles: the tile's operands lie inside the packed blocks, and its
    /// place inside the output, which this task alone writes there; the kernel's tiles are
    /// configured on this thread.
    unsafe fn tile(
        &mut self,
        pass: &Pass<'_>,
        kern: Kernel,
        tile: Tile,
        (i, j): (usize, usize),
        (live, cols): (usize, usize),
    ) {
        // SAFETY: forwarded (the caller's contract); the local buffers hold a whole tile.
        unsafe {
            match (pass.deep, pass.out) {
                (true, _) | (_, Out::Bf16 { .. }) => {
                    let (dest, ldo, epilogue) = pass.out.deep_parts();
                    // The buffer the previous tile is not in.
                    let slot = self.pending.map_or(0, |p| 1 - p.slot);
                    let buf = self.locals[slot].0.as_mut_ptr();
                    let prev = self.pending.take();
                    tile.run_between(kern, buf, NR, &mut |s, n| {
                        if let Some(p) = &prev {
                            p.rows(&epilogue, s, n);
                        }
                    });
                    let dest = dest.add(i * ldo + j);
                    self.pending = Some(Pending { tile: buf, live, cols, j, dest, ldo, slot });
                }
                (false, Out::F32 { c, ldc, epilogue, .. }) => {
                    let c = c.0.add(i * ldc + j);
                    if live == kern.mr() && cols == NR {
                        tile.run(kern, c, ldc);
                    } else {
                        tile.edge(kern, c, ldc, live, cols);
                    }
                    if let Some(e) = epilogue.filter(|_| pass.last) {
                        if let Some((pc, plive, pcols, pj)) =
                            self.stored.replace((c, live, cols, j))
                        {
                            e.apply((pc, ldc), plive, pcols, pj, TileOut::InPlace);
                        }
                    }
                }
            }
        }
    }

    /// The last tile's epilogue.
    ///
    /// # Safety
    /// As for [`tile`](Self::tile), after the task's last tile.
    unsafe fn finish(&mut self, pass: &Pass<'_>) {
        // SAFETY: forwarded.
        unsafe {
            if let Some(p) = self.pending.take() {
                p.rows(&pass.out.deep_parts().2, 0, 1);
            }
            if let (Some((c, live, cols, j)), Out::F32 { ldc, epilogue: Some(e), .. }) =
                (self.stored.take(), pass.out)
            {
                e.apply((c, ldc), live, cols, j, TileOut::InPlace);
            }
        }
    }
}

/// A deep product's tile whose epilogue has not run yet: computed into `tile` (the task's
/// local buffer `slot` of two), bound for `dest` (rows `ldo` apart).
#[derive(Clone, Copy)]
struct Pending {
    tile: *mut f32,
    live: usize,
    cols: usize,
    j: usize,
    dest: Dest,
    ldo: usize,
    slot: usize,
}

impl Pending {
    /// The epilogue's share after step `s` of the next tile's `n`: the rows are cut into
    /// groups of about [`EPILOGUE_ROWS`] (at most `n` groups), and the step that ends a
    /// group's share of the steps runs that group. Every row runs once, the last group after
    /// step `n - 1` (`(0, 1)` runs them all).
    ///
    /// # Safety
    /// The tile holds `live × cols` values (rows `NR` apart) that nothing writes meanwhile;
    /// `dest` is the output's tile (rows `ldo` apart); the bias (if any) holds the product's
    /// columns.
    unsafe fn rows(&self, epilogue: &Epilogue, s: usize, n: usize) {
        if let Some((r0, r1)) = epilogue_share(self.live, s, n) {
            // SAFETY: rows `r0..r1 <= live` of the tile and of the output tile (the caller's
            // contract).
            unsafe {
                let out = self.dest.add(r0 * self.ldo).tile_out(self.ldo);
                epilogue.apply((self.tile.add(r0 * NR), NR), r1 - r0, self.cols, self.j, out);
            }
        }
    }
}

/// The rows `r0..r1` of a `live`-row tile whose epilogue runs after step `s` of `n`
/// ([`Pending::rows`]), if any.
fn epilogue_share(live: usize, s: usize, n: usize) -> Option<(usize, usize)> {
    let groups = n.min(live.div_ceil(EPILOGUE_ROWS)).max(1);
    let (g, next) = (s * groups / n, (s + 1) * groups / n);
    let (r0, r1) = (live * g / groups, live * (g + 1) / groups);
    (next > g && r1 > r0).then_some((r0, r1))
}

impl Epilogue {
    /// Applies the epilogue to a `rows × cols` tile at column `j` of the product, into `dest`
    /// (the output's tile at that place, or the tile itself).
    ///
    /// # Safety
    /// The tile and the output tile hold `rows` rows of `cols` elements at their strides; the
    /// bias (if any) holds the product's columns.
    unsafe fn apply(
        &self,
        (tile, ld): (*mut f32, usize),
        rows: usize,
        cols: usize,
        j: usize,
        dest: TileOut,
    ) {
        // SAFETY: forwarded; the bias's columns `j..j + cols` exist.
        unsafe {
            let bias = self.bias.map(|b| b.0.add(j));
            let epi = TileEpilogue { tile, ld, rows, cols, bias, act: self.act, dest };
            epi.run(self.level);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{epilogue_share, row_blocks, EPILOGUE_ROWS};

    /// Over a tile's steps, the epilogue's shares cover every row once, in order, in groups
    /// of at most [`EPILOGUE_ROWS`] rows wherever there are steps enough.
    #[test]
    fn the_epilogue_shares_cover_every_row_once() {
        for live in 1..=32 {
            for n in 1..=130 {
                let mut next = 0;
                for s in 0..n {
                    if let Some((r0, r1)) = epilogue_share(live, s, n) {
                        assert_eq!(r0, next, "live {live} n {n} s {s}");
                        assert!(r1 > r0, "live {live} n {n} s {s}");
                        if n >= live.div_ceil(EPILOGUE_ROWS) {
                            assert!(r1 - r0 <= EPILOGUE_ROWS, "live {live} n {n} s {s}");
                        }
                        next = r1;
                    }
                }
                assert_eq!(next, live, "live {live} n {n}");
            }
        }
    }

    /// Blocks cover the rows in whole micro-kernel rows, and are lower than `MC` only where
    /// that evens out the threads' tiles.
    #[test]
    fn row_blocks_cover_the_rows_and_even_out_the_threads() {
        // (m, threads, mr, target) -> (mc, blocks)
        let mc = super::MC;
        // 96 would leave a 32-row sixth block.
        assert_eq!(row_blocks(512, 2, 32, mc), (64, 8));
        // 96 divides evenly already.
        assert_eq!(row_blocks(1536, 2, 32, mc), (96, 16));
        assert_eq!(row_blocks(2048, 2, 32, mc), (64, 32));
        // One thread: nothing to even out.
        assert_eq!(row_blocks(4096, 1, 32, mc), (96, 43));
        // Few rows: two blocks per thread at most.
        assert_eq!(row_blocks(40, 2, 32, mc), (32, 2));
        // A chunked product's taller blocks: a 2048-row weight gradient in eight of 256 rows;
        // 512 rows in four of 128 (two blocks per thread).
        let tall = super::TALL_MC;
        assert_eq!(row_blocks(2048, 2, 32, tall), (256, 8));
        assert_eq!(row_blocks(512, 2, 32, tall), (128, 4));
        // A bf16 output's `B` block: a quarter where many row blocks stream it again each and
        // `A` is cheap to read again (row-major, or rounded once for all column blocks).
        assert_eq!(super::deep_b_words(16, true), super::DEEP_B_WORDS / 4);
        assert_eq!(super::deep_b_words(15, true), super::DEEP_B_WORDS);
        assert_eq!(super::deep_b_words(64, false), super::DEEP_B_WORDS);
        for m in 1..700 {
            for threads in 1..4 {
                for (mr, target) in [(6, mc), (32, mc), (32, tall)] {
                    let (h, blocks) = row_blocks(m, threads, mr, target);
                    assert!(h % mr == 0 && h <= target.max(mr), "{m} {threads} {mr}: {h}");
                    assert_eq!(blocks, m.div_ceil(h), "{m} {threads} {mr} {target}");
                }
            }
        }
    }
}
