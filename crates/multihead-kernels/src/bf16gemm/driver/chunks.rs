//! Deep products on AMX in chunks of the depth ([`chunked`]): each task's tiles run chunk by
//! chunk, their partial sums kept in a buffer of the task's own, and leave through the
//! epilogue after the last chunk.

use std::cell::RefCell;

use super::{a_stride, with_buffer, ASource, Dest, Pass, A_BLOCK};
use crate::attention::KernelError;
use crate::bf16gemm::micro::{Kernel, Tile};
use crate::bf16gemm::pack::{pack_a, ABlock};
use crate::bf16gemm::NR;

/// Depth (elements) of the chunks in which a deep product runs its tiles ([`chunked`]).
const CHUNK_DEPTH: usize = 256;
/// Depth (elements) above which a deep product on AMX runs its tiles in chunks: past the
/// depth up to which an f32 output runs deep in one block ([`super::DEEP_F32_DEPTH`]); deeper
/// f32 outputs not added to run deep in chunks too.
const CHUNKED_FROM: usize = 2048;
/// Row blocks of a chunked product (a weight gradient over the tokens): each chunk of the `B`
/// block, brought from L3 once per task, serves eight row tiles instead of three. Weight
/// gradients over 4096 tokens (`ONLY=dw` below), `Linear(512, 2048)`'s: 5.7-5.9 ms in blocks
/// of 128 rows, 4.8-4.9 in 256, 4.6-5.1 in 384, 4.8-5.1 in 512.
pub(super) const TALL_MC: usize = 256;

/// Whether a product runs its tiles in chunks of [`CHUNK_DEPTH`]: a deep one
/// ([`super::Out::deep`]) on AMX deeper than [`CHUNKED_FROM`], as a `Linear`'s weight
/// gradient (bf16 or f32) over more than 2048 tokens of bf16 operands. Over the whole depth,
/// a 32-row strip of `A` (256 KiB at 4096) and the `B` panel it meets both stream from L2 or
/// beyond for every tile; in chunks, the strip's chunk (16 KiB) stays in L1 while the task's
/// panels pass it, at the price of storing and loading the tiles' partial sums (f32, exact:
/// the same sums in the same order, so the same bits). A transposed `A` (the gradient's
/// `dyᵀ`) is then packed a chunk at a time into a buffer that stays in L2, instead of its
/// whole depth at once.
///
/// On an AMX CPU (family 6 model 167, 2 threads), `cargo run --release -p multihead-kernels
/// --example bf16gemm` with `ONLY=dw` (the weight gradient over 4096 tokens, bf16 out):
/// `Linear(512, 2048)`'s 6.1-6.3 -> 4.6-4.9 ms, `Linear(512, 1536)`'s 4.7 -> 3.8,
/// `Linear(512, 512)`'s 1.7-1.8 -> 1.5, `Linear(2048, 512)`'s 6.9-7.1 -> 5.9-6.6; chunks of
/// 512 were no better, of 1024 worse (5.7-6.1 ms for the first). At a depth of 2048 (the
/// input gradient of `Linear(512, 2048)`, the forward of `Linear(2048, 512)`) chunks were
/// 3-5% faster alone, within the noise, but a bf16 encoder layer's inference (whose second
/// feed-forward product is 2048 deep) went from a median of 22.5 to 23.1 ms: hence only
/// deeper products.
pub(super) fn chunked(deep: bool, kern: Kernel, k: usize) -> bool {
    deep && kern.tiles() && k > CHUNKED_FROM
}

thread_local! {
    /// A task's partial sums between the chunks of a deep product ([`Pass::run_chunked`]).
    static PARTIAL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Where a chunked task's tiles read `A` ([`Pass::task_chunked`]).
#[derive(Clone, Copy)]
enum ChunkA {
    /// The whole depth of the task's rows, already in the kernel's layout: the block's first
    /// element, the strides (see [`Tile`]), the elements between its row tiles.
    Ready(*const u16, (usize, usize), usize),
    /// Packed chunk by chunk into a buffer of the task's, rows `lda` apart.
    Packed(*mut u16, usize),
}

impl Pass<'_> {
    /// Whether the task runs its tiles in chunks of [`CHUNK_DEPTH`] (a deep product on AMX
    /// deeper than [`CHUNKED_FROM`]).
    pub(super) fn chunked(&self, kern: Kernel) -> bool {
        chunked(self.deep, kern, self.block.kc)
    }

    /// Task `t`'s rows `i0..i0 + rows` against panels `q0..q1`, in chunks of the depth
    /// ([`Pass::run_chunked`]), `A` read in place, from the rows rounded once, or packed a
    /// chunk at a time into a buffer that stays in L2.
    pub(super) fn task_chunked(
        &self,
        kern: Kernel,
        (i0, rows): (usize, usize),
        (q0, q1): (usize, usize),
    ) -> Result<(), KernelError> {
        let mr = kern.mr();
        let padded = rows.div_ceil(mr) * mr;
        let lda = a_stride(kern, CHUNK_DEPTH / 2);
        let own = self.own_rows(i0, rows, mr);
        let words = match (own, self.source) {
            (None, ASource::Pack | ASource::InPlace) => padded * lda,
            _ => 0,
        };
        with_buffer(&A_BLOCK, words, "a", |abuf| {
            let src = match (own, self.source) {
                (Some((p, at, strides)), _) => {
                    // SAFETY: `A`'s own rows from the block's first element (`own_rows`).
                    let first = unsafe { p.0.add(at) };
                    ChunkA::Ready(first, strides, strides.0)
                }
                (None, ASource::Rounded(p, strides)) => {
                    let lda = a_stride(kern, self.block.kp);
                    // SAFETY: the rounded rows of this row block start at `i0 · lda`.
                    let first = unsafe { p.0.add(i0 * lda) };
                    ChunkA::Ready(first, strides, lda)
                }
                (None, _) => ChunkA::Packed(abuf.as_mut_ptr(), lda),
            };
            let _tiles = kern.begin();
            // SAFETY: as for `task`'s tiles: the sources hold the task's rows (a packed chunk
            // `padded · lda` elements, sized above), this task alone writes its part of the
            // output, the tiles are configured on this thread.
            unsafe { self.run_chunked(kern, src, (i0, rows), (q0, q1)) }
        })
    }

    /// The task's tiles in chunks of the depth: per chunk, each 32-row strip of `A` stays in
    /// L1 while the task's `B` panels stream past it, and the tiles' partial sums wait in a
    /// buffer of the task's own (stored and loaded as f32, so the same sums in the same order
    /// as one run over the whole depth: the same bits); after the last chunk each tile leaves
    /// through its epilogue, one tile behind.
    ///
    /// # Safety
    /// As for [`Pass::task`]'s tiles, whose `A` (`src`), rows and panels these are; the tiles
    /// are configured on this thread.
    unsafe fn run_chunked(
        &self,
        kern: Kernel,
        src: ChunkA,
        (i0, rows): (usize, usize),
        (q0, q1): (usize, usize),
    ) -> Result<(), KernelError> {
        let x = &self.block;
        let mr = kern.mr();
        let (panels, tiles) = (q1 - q0, rows.div_ceil(mr));
        // Rows a line more than a multiple of 1 KiB apart (else a tile's rows share L1 sets).
        let ldp = panels * NR + 16;
        let (dest, ldo, epilogue) = self.out.deep_parts();
        let cp = CHUNK_DEPTH / 2;
        let len = tiles.checked_mul(mr * ldp).ok_or_else(|| KernelError::InvalidArgument {
            name: "matmul_bf16",
            msg: format!("{tiles} row tiles of {ldp} partial sums overflow"),
        })?;
        with_buffer(&PARTIAL, len, "partial sums", |acc| {
            let mut behind: Option<(*mut f32, usize, usize, usize, Dest)> = None;
            for p0 in (0..x.kp).step_by(cp) {
                let (kp, last) = (cp.min(x.kp - p0), p0 + cp >= x.kp);
                let (abase, strides, tile_step) = match src {
                    ChunkA::Ready(a, strides, step) => {
                        // SAFETY: pair `p0 < x.kp` of the task's first row lies inside `A`.
                        let first = unsafe { a.add(p0 * strides.1) };
                        (first, strides, step)
                    }
                    ChunkA::Packed(buf, lda) => {
                        let padded = tiles * mr;
                        let (at, kc) = (x.p0 + 2 * p0, (x.kc - 2 * p0).min(2 * cp));
                        let blk = ABlock { i0, rows, padded, p0: at, kc, lda };
                        // SAFETY: the chunk's `kc` elements from the block's depth `x.p0 +
                        // 2·p0` (inside the block, checked by `matmul_bf16`) into the task's
                        // buffer of `padded · lda` elements, `lda` the stride of `cp` pairs.
                        let strides = unsafe { pack_a(kern, self.a, blk, buf) };
                        (buf as *const u16, strides, lda)
                    }
                };
                for t in 0..panels * tiles {
                    let (qi, ri) = (t % panels, t / panels);
                    let (q, ir) = (q0 + qi, ri * mr);
                    // SAFETY: pairs `p0..p0 + kp` of the task's row tile and panel (the
                    // caller's contract; `kp` is a multiple of the tile step, as `x.kp` and
                    // `cp` are); the buffer holds `tiles · mr` rows of `ldp >= panels · NR`
                    // partial sums; the tile's output lies inside the output.
                    unsafe {
                        let a = abase.add(ir * tile_step);
                        let b = x.packed.0.add((q * x.kp + p0) * NR);
                        let c = acc.as_mut_ptr().add(ir * ldp + qi * NR);
                        Tile { kp, a, strides, b, load_c: p0 > 0 }.run(kern, c, ldp);
                        if last {
                            let j = x.j0 + q * NR;
                            let (live, cols) = (mr.min(rows - ir), NR.min(x.cols - q * NR));
                            let d = dest.add((i0 + ir) * ldo + j);
                            if let Some((pc, pl, pcols, pj, pd)) =
                                behind.replace((c, live, cols, j, d))
                            {
                                epilogue.apply((pc, ldp), pl, pcols, pj, pd.tile_out(ldo));
                            }
                        }
                    }
                }
            }
            if let Some((pc, pl, pcols, pj, pd)) = behind {
                // SAFETY: as above: the last tile, in the buffer and the output.
                unsafe { epilogue.apply((pc, ldp), pl, pcols, pj, pd.tile_out(ldo)) };
            }
            Ok(())
        })
    }
}
