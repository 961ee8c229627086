//! The flash-attention backward: one task per `(batch, kv head)`, which owns `dk`/`dv` of that
//! head and `dq` of its query heads, so no reduction crosses tasks.
//!
//! For each query head of the group and each query block `i` (outer), each key block `j`
//! (inner): recompute `Sᵀ = K_j·(scale·Q_i)ᵀ`, `P = exp(S + mask − max − ln Σ)`, `dPᵀ = V_j·dO_iᵀ`,
//! then `dS = P∘(m∘dP − D)`, `dV_j += (P∘m)ᵀ dO_i`, `dK_j += dSᵀ Q_i`, `dQ_i += dS K_j`
//! (five GEMMs). `dk`/`dv` accumulate in the output rows, `dq` in scratch; `scale` is applied
//! to `dk` and `dq` once at the end.

use super::band::{BlockKeys, Hide};
use super::bf16::{self as bf, Scores};
use super::exec::{round16, Carver, ConstPtr, QueryRows, SyncPtr, Task};
use super::gemm::{GemmArgs, Tri};
use super::mask::{build_mask_keys, build_mask_tile, TilePos};
use super::scoremod::{bias_before_cap, cap_tile, Alibi};
use super::simd::Simd;
use super::softcap::softcap_slope;
use super::tile::{
    add_row, copy_rows, pack_transposed, scale_row, score_tile, zero_row, BlockDropout, MAX_BR,
};
use super::{AttnParams, Layout4};
use crate::bf16gemm::micro::Kernel;

pub(crate) struct BwdTask<'a> {
    p: &'a AttnParams<'a>,
    q: ConstPtr<f32>,
    ql: Layout4,
    k: ConstPtr<f32>,
    kl: Layout4,
    v: ConstPtr<f32>,
    vl: Layout4,
    o: ConstPtr<f32>,
    ol: Layout4,
    dout: ConstPtr<f32>,
    dol: Layout4,
    /// The output and its gradient as slices, for [`BwdTask::block_rows_finite`].
    rows: (&'a [f32], &'a [f32]),
    lse: ConstPtr<f32>,
    dq: SyncPtr<f32>,
    dql: Layout4,
    dk: SyncPtr<f32>,
    dkl: Layout4,
    dv: SyncPtr<f32>,
    dvl: Layout4,
    br: usize,
    bc: usize,
    nq: usize,
    /// Per `(batch, query head)`: whether its queries, keys and values are all finite (empty:
    /// all are).
    pub(crate) finite: &'a [bool],
    /// The bf16 micro-kernel of `AttnParams::bf16_products`, chosen on the calling thread (a
    /// worker does not see the caller's forced SIMD level).
    pub(crate) kern: crate::bf16gemm::micro::Kernel,
    /// Where the scores' gradient goes (`flash_backward_dscores`): contiguous `[batch,
    /// heads_q, l, s]`, validated by the caller; `None` when not wanted.
    pub(crate) dscores: Option<SyncPtr<f32>>,
    /// Whether the bf16 products' keys and values are packed once per chunk (the default;
    /// off, each key block packs its own: the same words, for the tests to compare).
    pub(crate) pack_chunks: bool,
}

/// Tests turn the once-per-chunk packing off (same bits, more packing) to compare the two.
#[cfg(test)]
pub(crate) static PACK_PER_BLOCK: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

impl<'a> BwdTask<'a> {
    /// The arguments were validated by `flash_backward` (or `flash_backward_packed`): the
    /// inputs q, k, v, out, dout and the three gradient outputs, which do not overlap.
    pub(crate) fn new(
        p: &'a AttnParams<'a>,
        [(q, ql), (k, kl), (v, vl), (o, ol), (dout, dol)]: [(&'a [f32], Layout4); 5],
        lse: &'a [f32],
        [(dq, dql), (dk, dkl), (dv, dvl)]: [(SyncPtr<f32>, Layout4); 3],
        br: usize,
        bc: usize,
    ) -> Self {
        assert!(br <= MAX_BR && br > 0 && bc > 0);
        BwdTask {
            p,
            q: ConstPtr(q.as_ptr()),
            ql,
            k: ConstPtr(k.as_ptr()),
            kl,
            v: ConstPtr(v.as_ptr()),
            vl,
            o: ConstPtr(o.as_ptr()),
            ol,
            dout: ConstPtr(dout.as_ptr()),
            dol,
            rows: (o, dout),
            lse: ConstPtr(lse.as_ptr()),
            dq,
            dql,
            dk,
            dkl,
            dv,
            dvl,
            br,
            bc,
            nq: p.dims.l.div_ceil(br),
            finite: &[],
            kern: crate::bf16gemm::micro::kernel(),
            dscores: None,
            #[cfg(not(test))]
            pack_chunks: true,
            #[cfg(test)]
            pack_chunks: !PACK_PER_BLOCK.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Whether the scores' gradient is taken before the soft cap's slope, in its own tile
    /// (the cap applies before the masks and the masks' gradient is wanted).
    fn pre_slope(&self) -> bool {
        self.dscores.is_some() && self.p.softcap.is_some() && !bias_before_cap(self.p)
    }
}

impl BwdTask<'_> {
    /// Keys per chunk: a chunk's `dK` and `dV` rows accumulate in contiguous scratch (about
    /// 256 KiB of it), written to the outputs once the chunk is done. A multiple of the key
    /// block, or all keys when fewer.
    fn chunk(&self) -> usize {
        let d = &self.p.dims;
        let cap = ((1usize << 16) / (d.d + d.dv).max(1)).max(self.bc) / self.bc * self.bc;
        cap.min(d.s.max(1))
    }

    /// Which strided rows are copied to contiguous scratch first (1) or read in place (0):
    /// a query block's `q` and `dO` rows (the `B` of the `dK` and `dV` products, read once
    /// per key block), and a chunk's `K` and `V` rows (read once per query block). See
    /// `gather` for why.
    fn copies(&self) -> [usize; 4] {
        let d = &self.p.dims;
        [self.ql.seq != d.d, self.dol.seq != d.dv, self.kl.seq != d.d, self.vl.seq != d.dv]
            .map(usize::from)
    }
}

/// One task's scratch (see `BwdTask::scratch_len`).
struct BwdScratch<'a> {
    qt: &'a mut [f32],
    dot: &'a mut [f32],
    /// The query block's output rows, packed as `dO` is (for `D`).
    ot: &'a mut [f32],
    st: &'a mut [f32],
    dpt: &'a mut [f32],
    mt: &'a mut [f32],
    /// `dS` before the soft cap's slope (empty unless `pre_slope`).
    pre: &'a mut [f32],
    dqa: &'a mut [f32],
    dvec: &'a mut [f32],
    lsev: &'a mut [f32],
    maxv: &'a mut [f32],
    /// The chunk's `dK` and `dV` accumulators (contiguous rows).
    dka: &'a mut [f32],
    dva: &'a mut [f32],
    /// Contiguous copies of the query block's `q` and `dO` rows and of the chunk's `K` and
    /// `V` rows (each empty when not copied).
    qc: &'a mut [f32],
    doc: &'a mut [f32],
    kc: &'a mut [f32],
    vc: &'a mut [f32],
    bb: BwdBf16,
    /// The chunk whose keys and values `bb` holds packed (bf16 products only).
    packed: Option<PackedChunk>,
}

/// The keys `c0..c1` of one chunk and whether it is the only one.
#[derive(Clone, Copy)]
struct Chunk {
    c0: usize,
    c1: usize,
    index: usize,
    single: bool,
}

impl Task for BwdTask<'_> {
    const FLUSH_TO_ZERO: bool = true;

    fn count(&self) -> usize {
        self.p.dims.batch * self.p.dims.heads_kv
    }

    fn work(&self) -> usize {
        // Five products over every (query, key) pair of every head.
        let d = &self.p.dims;
        [d.batch, d.heads_q, d.l, d.s, 3 * d.d + 2 * d.dv]
            .iter()
            .fold(1usize, |w, x| w.saturating_mul(*x))
    }

    fn scratch_len(&self, lanes: usize) -> usize {
        let d = &self.p.dims;
        let brp = self.br.div_ceil(lanes) * lanes;
        let bf16: usize = if self.p.bf16_products {
            let blocks = (self.br, self.bc, self.chunk());
            BwdBf16::sizes(self.kern, blocks, d.d, d.dv).iter().map(|&n| round16(n)).sum()
        } else {
            0
        };
        let [cq, cd, ck, cv] = self.copies();
        round16(d.d * brp)
            + round16(d.dv * brp)
            + round16(d.dv * brp)
            + 3 * round16(self.bc * brp)
            + round16(usize::from(self.pre_slope()) * self.bc * brp)
            + round16(self.br * d.d)
            + 3 * round16(brp)
            + round16(self.chunk() * d.d)
            + round16(self.chunk() * d.dv)
            + round16(cq * self.br * d.d)
            + round16(cd * self.br * d.dv)
            + round16(ck * self.chunk() * d.d)
            + round16(cv * self.chunk() * d.dv)
            + bf16
    }

    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, buf: &mut [f32]) {
        let p = self.p;
        let dm = &p.dims;
        let (b, hk) = (t / dm.heads_kv, t % dm.heads_kv);
        let group = dm.heads_q / dm.heads_kv;
        let (d, dv, s) = (dm.d, dm.dv, dm.s);
        let brp_max = self.br.div_ceil(S::LANES) * S::LANES;
        let (chunk, [cq, cd, ck, cvv]) = (self.chunk(), self.copies());

        let mut cv = Carver::new(buf);
        let mut sc = BwdScratch {
            qt: cv.take(d * brp_max),
            dot: cv.take(dv * brp_max),
            ot: cv.take(dv * brp_max),
            st: cv.take(self.bc * brp_max),
            dpt: cv.take(self.bc * brp_max),
            mt: cv.take(if p.has_mask() { self.bc * brp_max } else { 0 }),
            pre: cv.take(if self.pre_slope() { self.bc * brp_max } else { 0 }),
            dqa: cv.take(self.br * d),
            dvec: cv.take(brp_max),
            lsev: cv.take(brp_max),
            maxv: cv.take(brp_max),
            dka: cv.take(chunk * d),
            dva: cv.take(chunk * dv),
            qc: cv.take(cq * self.br * d),
            doc: cv.take(cd * self.br * dv),
            kc: cv.take(ck * chunk * d),
            vc: cv.take(cvv * chunk * dv),
            // The bf16 products' buffers (null without them); a query block fits one panel.
            bb: match p.bf16_products && brp_max <= bf::MAX_LANES {
                true => {
                    let sizes = BwdBf16::sizes(self.kern, (self.br, self.bc, chunk), d, dv);
                    BwdBf16::carve(sizes.map(|n| cv.take(n).as_mut_ptr()))
                }
                false => BwdBf16::carve([std::ptr::null_mut(); 12]),
            },
            packed: None,
        };

        // The tiles configured on this thread for the AMX kernel (released at the end).
        let _tiles = (!sc.bb.qp.is_null()).then(|| self.kern.begin());
        // SAFETY: every row pointer addresses a row validated by `flash_backward`; scratch
        // pieces are sized by `scratch_len`; this task alone writes `dk[b, hk]`, `dv[b, hk]`
        // and `dq[b, h]` for the query heads `h` of kv head `hk` (output layouts were checked
        // to be non-overlapping).
        unsafe {
            if let Some(dsc) = self.dscores {
                // Entries no key tile reaches stay 0.
                let per_head = dm.l * s;
                let first = dsc.0.add((b * dm.heads_q + hk * group) * per_head);
                std::ptr::write_bytes(first, 0, group * per_head);
            }
            let dkbase = self.dk.0.add(self.dkl.offset(b, hk, 0));
            let dvbase = self.dv.0.add(self.dvl.offset(b, hk, 0));
            let nchunks = s.div_ceil(chunk).max(1);
            for index in 0..nchunks {
                let c0 = index * chunk;
                let c1 = s.min(c0 + chunk);
                let ck = Chunk { c0, c1, index, single: nchunks == 1 };
                sc.dka[..(c1 - c0) * d].fill(0.0);
                sc.dva[..(c1 - c0) * dv].fill(0.0);
                if !sc.kc.is_empty() {
                    let k = self.k.0.add(self.kl.offset(b, hk, c0));
                    copy_rows(sc.kc.as_mut_ptr(), k, self.kl.seq, c1 - c0, d);
                }
                if !sc.vc.is_empty() {
                    let v = self.v.0.add(self.vl.offset(b, hk, c0));
                    copy_rows(sc.vc.as_mut_ptr(), v, self.vl.seq, c1 - c0, dv);
                }
                if !sc.bb.qp.is_null() && self.pack_chunks {
                    // The chunk's keys and values packed once for all its query blocks, from
                    // where the blocks read them (the copies, or in place).
                    let (k, v) = self.chunk_rows(&sc, b, hk, c0);
                    sc.bb.pack_chunk(self.kern, k, v, c1 - c0, (d, dv));
                    sc.packed = Some(PackedChunk { c0, keys: c1 - c0 });
                }
                for h in hk * group..(hk + 1) * group {
                    for qb in 0..self.nq {
                        self.query_block::<S>(&mut sc, b, h, qb, ck);
                    }
                }
                for j in c0..c1 {
                    let dkj = sc.dka.as_ptr().add((j - c0) * d);
                    scale_row::<S>(dkbase.add(j * self.dkl.seq), dkj, d, p.scale);
                    let dvj = sc.dva.as_ptr().add((j - c0) * dv);
                    std::ptr::copy_nonoverlapping(dvj, dvbase.add(j * self.dvl.seq), dv);
                }
            }
            if nchunks > 1 {
                // dq was summed over the chunks unscaled.
                for h in hk * group..(hk + 1) * group {
                    for i in 0..dm.l {
                        let row = self.dq.0.add(self.dql.offset(b, h, i));
                        scale_row::<S>(row, row, d, p.scale);
                    }
                }
            }
        }
    }
}

impl BwdTask<'_> {
    /// The key and value rows of the chunk from key `c0` of kv head `(b, hk)`, with their row
    /// strides: the task's contiguous copies where it made them, else the rows in place.
    ///
    /// # Safety
    /// `(b, hk)` and `c0` are in range (as in `run`); the copies, where made, hold the chunk.
    #[inline(always)]
    unsafe fn chunk_rows(
        &self,
        sc: &BwdScratch<'_>,
        b: usize,
        hk: usize,
        c0: usize,
    ) -> ((*const f32, usize), (*const f32, usize)) {
        let dm = &self.p.dims;
        // SAFETY: rows from `c0` of head `(b, hk)` lie inside `k` and `v` (validated).
        unsafe {
            let k = match sc.kc.is_empty() {
                true => (self.k.0.add(self.kl.offset(b, hk, c0)), self.kl.seq),
                false => (sc.kc.as_ptr(), dm.d),
            };
            let v = match sc.vc.is_empty() {
                true => (self.v.0.add(self.vl.offset(b, hk, c0)), self.vl.seq),
                false => (sc.vc.as_ptr(), dm.dv),
            };
            (k, v)
        }
    }

    /// Whether rows `i0..i0 + br` of head `(b, h)` of the output and of its gradient are all
    /// finite (rows the block reads anyway, so they are in cache for its statistics).
    fn block_rows_finite(&self, b: usize, h: usize, i0: usize, br: usize) -> bool {
        let dv = self.p.dims.dv;
        let (o, dout) = self.rows;
        super::head_rows_finite(o, self.ol, (b, h), i0..i0 + br, dv)
            && super::head_rows_finite(dout, self.dol, (b, h), i0..i0 + br, dv)
    }

    /// Query block `qb` of query head `h` against the keys of chunk `ck`: `dK`/`dV` of the
    /// chunk accumulate in `sc`, and the block's `dQ` share is written (chunk 0) or added.
    ///
    /// # Safety
    /// As in `run`: `S` is available, `sc` is carved by `scratch_len`, `(b, h)` is in range.
    #[inline(always)]
    unsafe fn query_block<S: Simd>(
        &self,
        sc: &mut BwdScratch<'_>,
        b: usize,
        h: usize,
        qb: usize,
        ck: Chunk,
    ) {
        let p = self.p;
        let dm = &p.dims;
        let l = S::LANES;
        let (d, dv) = (dm.d, dm.dv);
        let hk = h / (dm.heads_q / dm.heads_kv);
        let bh = b * dm.heads_q + h;
        let rows = QueryRows::new(qb, self.br, dm.l, l);
        let QueryRows { i0, br, brp, .. } = rows;
        let bf = !sc.bb.qp.is_null();
        let kern = self.kern;
        // A non-finite output or upstream-gradient row reaches every key's gradient through
        // `dS = P ∘ (dP − D)` (0·NaN is NaN, as PyTorch computes): its block reads every key.
        let finite = !self.finite.is_empty()
            && self.finite.get(bh).copied().unwrap_or(true)
            && self.block_rows_finite(b, h, i0, br);
        let keys = BlockKeys::of(p, b, (i0, br), finite);
        let (jstart, jend) = (keys.start.max(ck.c0), keys.end.min(ck.c1));
        // SAFETY: see `run`; scratch slices are sized by `scratch_len`.
        unsafe {
            if jstart >= jend {
                // No key of this chunk reaches the block: its dQ is 0 unless a chunk adds.
                return self.write_dq::<S>(sc, (b, h, i0, br), ck, true, bf);
            }
            let (mut qrow, mut qld) = (self.q.0.add(self.ql.offset(b, h, i0)), self.ql.seq);
            let (mut dorow, mut dold) = (self.dout.0.add(self.dol.offset(b, h, i0)), self.dol.seq);
            if !sc.qc.is_empty() {
                copy_rows(sc.qc.as_mut_ptr(), qrow, qld, br, d);
                (qrow, qld) = (sc.qc.as_ptr(), d);
            }
            if !sc.doc.is_empty() {
                copy_rows(sc.doc.as_mut_ptr(), dorow, dold, br, dv);
                (dorow, dold) = (sc.doc.as_ptr(), dv);
            }
            if bf {
                sc.bb.start_block(kern, qrow, qld, dorow, dold, br, d, dv);
            } else {
                pack_transposed::<S>(sc.qt, brp, qrow, qld, br, d, p.scale);
                pack_transposed::<S>(sc.dot, brp, dorow, dold, br, dv, 1.0);
            }
            self.block_stats::<S>(sc, bh, i0, (br, brp), (dorow, dold), bf);
            let dropout =
                p.active_dropout().map(|(pr, key)| BlockDropout::new(pr, key, bh, i0, br));

            // Key row j of the chunk: in the copy, or in place.
            let (k, v) = self.chunk_rows(sc, b, hk, ck.c0);
            let blk = BwdBlock {
                b,
                h,
                bh,
                rows,
                keys,
                bf,
                dropout,
                q: (qrow, qld),
                dout: (dorow, dold),
                k,
                v,
                c0: ck.c0,
            };
            let mut first = true;
            let mut j0 = jstart;
            while j0 < jend {
                let step = self.bc.min(jend - j0);
                if self.key_block::<S>(sc, &blk, (j0, step), first) {
                    first = false;
                }
                j0 += step;
            }
            self.write_dq::<S>(sc, (b, h, i0, br), ck, first, bf);
        }
    }

    /// One key block `j0..j0 + step` of the query block `q` (a chunk's keys): the scores and
    /// `dP` recomputed, masks and soft cap, `P` and `dS` (its copy out where asked), then the
    /// block's shares of `dV`, `dK` and `dQ`. Returns whether any of its keys was read (a block
    /// whose keys the masks hide all is skipped in a finite head).
    ///
    /// # Safety
    /// As in [`Self::query_block`], which built `q` and filled `sc` for this block; `first`
    /// says that no key block of this chunk was read before.
    #[inline(always)]
    unsafe fn key_block<S: Simd>(
        &self,
        sc: &mut BwdScratch<'_>,
        q: &BwdBlock,
        (j0, step): (usize, usize),
        first: bool,
    ) -> bool {
        let p = self.p;
        let dm = &p.dims;
        let (d, dv) = (dm.d, dm.dv);
        let (b, h, QueryRows { i0, br, brp, nvec }) = (q.b, q.h, q.rows);
        let BlockKeys { finite, clip, banded, band, .. } = q.keys;
        let (has_mask, per_key) = (p.has_mask(), p.masks_per_key());
        let ((kbase, kld), (vbase, vld)) = (q.k, q.v);
        let pos = TilePos { b, h, i0, br, brp, j0, bc: step };
        // SAFETY: the caller's contract: the rows addressed are validated, the tiles carved.
        unsafe {
            // The keys up to the block's last visible one (all for a non-finite head).
            let live = match (has_mask, per_key) {
                (false, _) => step,
                (true, true) => build_mask_keys(&p.masks, pos, sc.mt),
                (true, false) => build_mask_tile::<S>(&p.masks, pos, sc.mt),
            };
            let bc = if finite { live } else { step };
            if bc == 0 {
                return false;
            }
            let kj = kbase.add((j0 - q.c0) * kld);
            let vj = vbase.add((j0 - q.c0) * vld);
            let dkj = sc.dka.as_mut_ptr().add((j0 - q.c0) * d);
            let dvj = sc.dva.as_mut_ptr().add((j0 - q.c0) * dv);
            let diag = if clip { band.diag(i0, j0) } else { None };
            let (stp, dpp) = (sc.st.as_mut_ptr(), sc.dpt.as_mut_ptr());
            if q.bf {
                let scores = (stp, dpp);
                let blocks = (j0, bc, sc.packed);
                let kern = self.kern;
                sc.bb.scores(kern, (kj, kld), (vj, vld), blocks, (d, dv), p.scale, scores, brp);
            } else {
                score_tile::<S>(kj, kld, d, sc.qt.as_ptr(), brp, stp, bc, diag);
                score_tile::<S>(vj, vld, dv, sc.dot.as_ptr(), brp, dpp, bc, diag);
            }
            let alibi = Alibi::of(p, h, i0, j0);
            cap_tile::<S>(p, (stp, brp, nvec, bc), (sc.mt.as_ptr(), per_key), alibi.as_ref());
            if banded && band.partial(i0, br, j0, bc) {
                if clip {
                    // Entries the banded products skipped: P = 0 there, and dP must be
                    // finite so that dS = P (dP - D) is exactly 0.
                    band.hide(sc.st, brp, (i0, j0, bc), Hide::Fill(f32::NEG_INFINITY));
                    band.hide(sc.dpt, brp, (i0, j0, bc), Hide::Fill(0.0));
                } else {
                    band.hide(sc.st, brp, (i0, j0, bc), Hide::AddNegInf);
                }
            }
            // The tiles' pointers taken again after `hide` wrote through the slices.
            let (stp, dpp) = (sc.st.as_mut_ptr(), sc.dpt.as_mut_ptr());
            let tile = GradTile { st: stp, dpt: dpp, brp, nvec, bc };
            let mask = (has_mask && !p.cap_masks()).then_some((sc.mt.as_ptr(), per_key));
            let alibi = alibi.filter(|_| !bias_before_cap(p));
            let stats = (sc.maxv.as_ptr(), sc.lsev.as_ptr(), sc.dvec.as_ptr());
            let drop = q.dropout.as_ref().map(|dr| (dr, j0));
            let pre = if sc.pre.is_empty() { std::ptr::null_mut() } else { sc.pre.as_mut_ptr() };
            probs_and_dscores::<S>(&tile, (mask, alibi.as_ref()), stats, drop, (p.softcap, pre));
            if let Some(dsc) = self.dscores {
                // The [key][query] tile into rows i0.. of [b, h]'s [query][key] block.
                let src = if pre.is_null() { dpp as *const f32 } else { pre };
                let dst = dsc.0.add(((q.bh * dm.l) + i0) * dm.s + j0);
                S::transpose(dst, dm.s, src, brp, bc, br, 1.0, false);
            }
            let (dvj, dkj, kj, chunk) = ((dvj, dv), (dkj, d), (kj, kld), sc.packed);
            let grads = BlockGrads { dvj, dkj, kj, first, j0, chunk };
            if q.bf {
                sc.bb.grads(self.kern, (stp, dpp), brp, (br, bc), (d, dv), grads);
            } else {
                let rows = [q.q, q.dout];
                f32_grads::<S>(&tile, br, rows, sc.dqa.as_mut_ptr(), grads, diag);
            }
        }
        true
    }

    /// Loads the block's row statistics into `sc`: the forward's max and log-sum of each row,
    /// and `D = rowsum(dO ∘ O)`; padding lanes get `P = exp(x - inf) = 0` and `D = 0`, so they
    /// contribute nothing.
    ///
    /// `D` is summed as `dP` is: with the bf16 products from the rounded `dO` and `O` in the
    /// bf16 kernel's order ([`bf::lane_dots`]); with the f32 products as the same chain of FMAs
    /// over the channels in increasing order that the score product runs, on `O` packed as
    /// `dO` is. A row whose softmax is one-hot (a
    /// saturated score: `O = V_j` exactly) then has `dP_j - D = 0` exactly and no gradient
    /// reaches its queries and keys, as in PyTorch's kernel, where a `D` summed in another
    /// order leaves rounding noise that the scale and the projections amplify.
    ///
    /// # Safety
    /// `S` is available; row `bh` and rows `i0..i0 + br` are in range; `dorow` has `br` rows
    /// of stride `dold`; without bf16 products `sc.dot` holds the block's packed `dO`.
    #[inline(always)]
    unsafe fn block_stats<S: Simd>(
        &self,
        sc: &mut BwdScratch<'_>,
        bh: usize,
        i0: usize,
        (br, brp): (usize, usize),
        (dorow, dold): (*const f32, usize),
        bf: bool,
    ) {
        let dm = &self.p.dims;
        let (l, dv) = (S::LANES, dm.dv);
        let rows = dm.batch * dm.heads_q * dm.l;
        let (b, h) = (bh / dm.heads_q, bh % dm.heads_q);
        // SAFETY: the rows validated by `flash_backward` (caller); the scratch is sized by
        // `scratch_len`.
        unsafe {
            let max_row = self.lse.0.add(bh * dm.l + i0);
            let lse_row = self.lse.0.add(rows + bh * dm.l + i0);
            for i in 0..brp {
                (sc.maxv[i], sc.lsev[i]) = match i < br {
                    true => (*max_row.add(i), *lse_row.add(i)),
                    false => (0.0, f32::INFINITY),
                };
            }
            let orow = self.o.0.add(self.ol.offset(b, h, i0));
            pack_transposed::<S>(sc.ot, brp, orow, self.ol.seq, br, dv, 1.0);
            if bf {
                // Each row's `D` summed as the bf16 kernel sums its `dP` (`bf::lane_dots`).
                pack_transposed::<S>(sc.dot, brp, dorow, dold, br, dv, 1.0);
                for vi in 0..brp / l {
                    let rows = (sc.ot.as_ptr().add(vi * l), sc.dot.as_ptr().add(vi * l));
                    let d = bf::lane_dots::<S>(self.kern, rows, brp, dv);
                    S::store(sc.dvec.as_mut_ptr().add(vi * l), d);
                }
                sc.dvec[br..brp].fill(0.0);
                return;
            }
            for vi in 0..brp / l {
                let mut acc = S::splat(0.0);
                for c in 0..dv {
                    let o = S::load(sc.ot.as_ptr().add(c * brp + vi * l));
                    acc = S::fma(o, S::load(sc.dot.as_ptr().add(c * brp + vi * l)), acc);
                }
                S::store(sc.dvec.as_mut_ptr().add(vi * l), acc);
            }
        }
    }

    /// Writes the block's `dQ` share from `sc.dqa` (from the bf16 products' `dQᵀ` first):
    /// written for chunk 0 (scaled when it is the only chunk), added for the others; 0 when no
    /// key of chunk 0 reached the block.
    ///
    /// # Safety
    /// `S` is available; `(b, h)` and rows `i0..i0 + br` are in range.
    #[inline(always)]
    unsafe fn write_dq<S: Simd>(
        &self,
        sc: &mut BwdScratch<'_>,
        (b, h, i0, br): (usize, usize, usize, usize),
        ck: Chunk,
        empty: bool,
        bf: bool,
    ) {
        let d = self.p.dims.d;
        // SAFETY: this task alone writes these rows of `dq` (see `run`).
        unsafe {
            if bf && !empty {
                // dQ back from channels × lanes to rows × channels.
                for i in 0..br {
                    for c in 0..d {
                        sc.dqa[i * d + c] = *sc.bb.dqt.add(c * bf::MAX_LANES + i);
                    }
                }
            }
            for i in 0..br {
                let dst = self.dq.0.add(self.dql.offset(b, h, i0 + i));
                let src = sc.dqa.as_ptr().add(i * d);
                match (ck.index, empty) {
                    (0, true) => zero_row(dst, d),
                    (0, false) => {
                        scale_row::<S>(dst, src, d, if ck.single { self.p.scale } else { 1.0 })
                    }
                    (_, true) => {}
                    (_, false) => add_row::<S>(dst, src, d),
                }
            }
        }
    }
}

/// The two tiles of one key block, keys as rows (`bc` of them, stride `brp`) and the query
/// block as `nvec` lane vectors: the scores `Sᵀ` (then `P∘m`) and `dPᵀ` (then `dS`).
struct GradTile {
    st: *mut f32,
    dpt: *mut f32,
    brp: usize,
    nvec: usize,
    bc: usize,
}

/// Replaces the tiles by `P∘m` and `dS = P∘(m∘dP − D)`, with `P = exp(S + mask + bias − max − lse)`
/// from the forward's statistics `(max, lse, D)` (one per lane), `mask` a pointer and whether
/// it holds one value per key (else one per entry), and `m` the dropout multipliers of
/// `dropout`'s block at key offset `j0` (1 without dropout). Through a soft cap `dS` is
/// multiplied by its slope; `pre` (when not null, a tile like `dpt`) gets `dS` before that.
///
/// # Safety
/// `S` is available; the tiles (and a per-entry mask) hold `bc · brp` floats, a per-key mask
/// `bc`; the statistics `nvec · S::LANES`.
#[inline(always)]
unsafe fn probs_and_dscores<S: Simd>(
    t: &GradTile,
    (mask, alibi): (Option<(*const f32, bool)>, Option<&Alibi>),
    (maxv, lsev, dvec): (*const f32, *const f32, *const f32),
    dropout: Option<(&BlockDropout, usize)>,
    (softcap, pre): (Option<f32>, *mut f32),
) {
    let l = S::LANES;
    // SAFETY: within the tiles and statistics (caller).
    unsafe {
        let inv = S::splat(softcap.map_or(0.0, |c| 1.0 / c));
        for vi in 0..t.nvec {
            let mut col = alibi.map(|a| a.column::<S>(vi * l));
            let lv = S::load(lsev.add(vi * l));
            let mv = S::load(maxv.add(vi * l));
            let dd = S::load(dvec.add(vi * l));
            for j in 0..t.bc {
                let off = j * t.brp + vi * l;
                let mut x = S::load(t.st.add(off));
                let slope = softcap.map(|_| softcap_slope::<S>(x, inv));
                if let Some((mtp, per_key)) = mask {
                    let m = match per_key {
                        true => S::splat(*mtp.add(j)),
                        false => S::load(mtp.add(off)),
                    };
                    x = S::add(x, m);
                }
                if let Some(c) = col.as_mut() {
                    x = S::add(x, c.next());
                }
                let pe = S::exp(S::sub(S::sub(x, mv), lv));
                let dp = S::load(t.dpt.add(off));
                let (pm, mut ds) = match dropout {
                    Some((dr, j0)) => {
                        let m = dr.vector::<S>(vi * l, j0 + j);
                        (S::mul(pe, m), S::mul(pe, S::sub(S::mul(m, dp), dd)))
                    }
                    None => (pe, S::mul(pe, S::sub(dp, dd))),
                };
                if !pre.is_null() {
                    S::store(pre.add(off), ds);
                }
                if let Some(g) = slope {
                    ds = S::mul(ds, g);
                }
                S::store(t.st.add(off), pm);
                S::store(t.dpt.add(off), ds);
            }
        }
    }
}

/// The f32 products of one key block: `dV_j += (P∘m)ᵀ dO_i`, `dK_j += dSᵀ Q_i` and
/// `dQ_i (+)= dS K_j` into `dqa` (written for the block's first key block), the last two
/// unscaled; `rows` are the block's `q` and `dO` rows with their strides, and `diag` clips a
/// causal block's triangles.
///
/// # Safety
/// `S` is available; the tiles hold the block's `P∘m` and `dS`; `rows` address `br` rows of
/// `d` and `dv` floats, `g` `bc` rows; `dqa` holds `br · d` floats.
#[inline(always)]
unsafe fn f32_grads<S: Simd>(
    t: &GradTile,
    br: usize,
    [(qrow, qld), (dorow, dold)]: [(*const f32, usize); 2],
    dqa: *mut f32,
    g: BlockGrads,
    diag: Option<isize>,
) {
    let ((dvj, dv), (dkj, d), (kj, kld)) = (g.dvj, g.dkj, g.kj);
    // Key row r is seen by queries i0 + k' >= j0 + r only.
    let tri = diag.map_or(Tri::Full, |e| Tri::KStart(-e));
    let (rs_a, cs_a, k) = (t.brp, 1, br);
    // SAFETY: within the tiles and rows the caller guarantees.
    unsafe {
        S::gemm(&GemmArgs {
            m: t.bc,
            n: dv,
            k,
            a: t.st,
            rs_a,
            cs_a,
            b: dorow,
            ldb: dold,
            c: dvj,
            ldc: dv,
            accumulate: true,
            tri,
        });
        S::gemm(&GemmArgs {
            m: t.bc,
            n: d,
            k,
            a: t.dpt,
            rs_a,
            cs_a,
            b: qrow,
            ldb: qld,
            c: dkj,
            ldc: d,
            accumulate: true,
            tri,
        });
        S::gemm(&GemmArgs {
            m: br,
            n: d,
            k: t.bc,
            a: t.dpt,
            rs_a: 1,
            cs_a: t.brp,
            b: kj,
            ldb: kld,
            c: dqa,
            ldc: d,
            accumulate: !g.first,
            // Query row r sees keys j0 + k' <= i0 + r only.
            tri: diag.map_or(Tri::Full, Tri::KEnd),
        });
    }
}

/// A backward query block as each of its key blocks reads it ([`BwdTask::key_block`]): where
/// it is, what hides its keys, its dropout, its query and upstream-gradient rows, and the
/// chunk's key and value rows (from key `c0`).
struct BwdBlock {
    b: usize,
    h: usize,
    /// `b · heads_q + h`.
    bh: usize,
    rows: QueryRows,
    /// The keys read (every key where a row the block reads is not finite).
    keys: BlockKeys,
    /// bf16 products (else f32).
    bf: bool,
    dropout: Option<BlockDropout>,
    /// Rows and their strides: the queries, the upstream gradient, the chunk's keys and values.
    q: (*const f32, usize),
    dout: (*const f32, usize),
    k: (*const f32, usize),
    v: (*const f32, usize),
    c0: usize,
}

/// The output-gradient rows of one key block and whether it is the query block's first.
pub(super) struct BlockGrads {
    /// `dV_j` and `dK_j` rows (accumulated into) and their row strides.
    pub(super) dvj: (*mut f32, usize),
    pub(super) dkj: (*mut f32, usize),
    /// `K_j` rows and their stride.
    pub(super) kj: (*const f32, usize),
    pub(super) first: bool,
    /// The block's first key, and the chunk whose keys are packed already (bf16 products).
    pub(super) j0: usize,
    pub(super) chunk: Option<PackedChunk>,
}

/// The backward's bf16 products (`AttnParams::bf16_products`): the scratch of one task and the
/// five products of a tile, each with bf16 operands and f32 sums.
pub(super) struct BwdBf16 {
    /// Panels of the query block's `q` rows, then of its `dO` rows (the two score tiles).
    qp: *mut u32,
    /// Rounded key (or value) rows of the score tiles.
    kb: *mut u16,
    /// `P∘m` and `dS` rows rounded, keys as rows (the `A` of `dV` and `dK`).
    pa: *mut u16,
    dsa: *mut u16,
    /// Pair words of `dO` and `q` rows (the `B` of `dV` and `dK`).
    dow: *mut u32,
    qw: *mut u32,
    /// Pair words of `K_j` rows and of `dS` (the `A` and `B` of `dQᵀ`).
    kw: *mut u32,
    dsw: *mut u32,
    /// `dQᵀ` of the query block, channels × lanes.
    pub(super) dqt: *mut f32,
    /// The chunk's key rows and value rows rounded (the score tiles' `A`), and its keys'
    /// transposed pairs (the `A` of `dQᵀ`), packed once per chunk for all its query blocks.
    ckr: *mut u16,
    cvr: *mut u16,
    ckt: *mut u32,
}

/// Where a chunk's packed keys and values are ([`BwdBf16::pack_chunk`]): its first key and
/// its key count.
#[derive(Clone, Copy)]
pub(super) struct PackedChunk {
    pub(super) c0: usize,
    pub(super) keys: usize,
}

impl BwdBf16 {
    /// Scratch sizes in f32 units on `kern` (its operand layout: [`bf::Shape`]): panels,
    /// rounded rows, words and `dQᵀ`.
    pub(super) fn sizes(
        kern: Kernel,
        (br, bc, chunk): (usize, usize, usize),
        d: usize,
        dv: usize,
    ) -> [usize; 12] {
        use crate::bf16gemm::{MR, NR};
        let sh = bf::Shape::of(kern);
        let (bcr, kpr, kpc) = (sh.rows(bc), sh.kp(br.div_ceil(2)), sh.kp(bc.div_ceil(2)));
        // A block's product reads rows up to a whole row block past its last key.
        let chunk_rows = sh.rows(chunk) + sh.mr;
        let (dpk, dpv) = (sh.kp(d.div_ceil(2)), sh.kp(dv.div_ceil(2)));
        [
            (sh.kp(d.div_ceil(2)) + sh.kp(dv.div_ceil(2))) * NR,
            bcr * sh.kp(d.max(dv).div_ceil(2)) + 1,
            bcr * NR.max(2 * kpr) / 2,
            bcr * NR.max(2 * kpr) / 2,
            kpr * dv.div_ceil(NR) * NR,
            kpr * d.div_ceil(NR) * NR,
            sh.transposed_words(bc, d),
            kpc * NR,
            d.div_ceil(MR) * MR * NR,
            chunk_rows * dpk,
            chunk_rows * dpv,
            sh.transposed_words(chunk, d),
        ]
    }

    /// The buffers from carved scratch pointers (in the order of `sizes`).
    pub(super) fn carve(p: [*mut f32; 12]) -> Self {
        BwdBf16 {
            qp: p[0] as *mut u32,
            kb: p[1] as *mut u16,
            pa: p[2] as *mut u16,
            dsa: p[3] as *mut u16,
            dow: p[4] as *mut u32,
            qw: p[5] as *mut u32,
            kw: p[6] as *mut u32,
            dsw: p[7] as *mut u32,
            dqt: p[8],
            ckr: p[9] as *mut u16,
            cvr: p[10] as *mut u16,
            ckt: p[11] as *mut u32,
        }
    }

    /// Packs the `keys` key and value rows of a chunk (`k`, `v` with their row strides) once
    /// for all its query blocks: rounded rows for the score tiles and the keys' transposed
    /// pairs for `dQᵀ`, the words [`Self::scores`] and [`Self::grads`] would pack block by
    /// block.
    ///
    /// # Safety
    /// `keys` rows of `k` (`d` floats) and `v` (`dv` floats) readable; at most the chunk the
    /// buffers were sized for.
    #[inline(always)]
    pub(super) unsafe fn pack_chunk(
        &self,
        kern: Kernel,
        (k, kl): (*const f32, usize),
        (v, vl): (*const f32, usize),
        keys: usize,
        (d, dv): (usize, usize),
    ) {
        let sh = bf::Shape::of(kern);
        let (dpk, dpv) = (2 * sh.kp(d.div_ceil(2)), 2 * sh.kp(dv.div_ceil(2)));
        // SAFETY: within the rows the caller guarantees and the buffers `sizes` made.
        unsafe {
            bf::round_rows(k, kl, (keys, sh.mr), d, self.ckr, dpk);
            bf::round_rows(v, vl, (keys, sh.mr), dv, self.cvr, dpv);
            bf::transposed_a(sh, (k, kl), keys, d, self.ckt);
        }
    }

    /// Packs a query block: the `q` and `dO` panels and pair words.
    ///
    /// # Safety
    /// `q`/`dout` rows `< br` readable (`d`/`dv` floats each); buffers sized by `sizes`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(super) unsafe fn start_block(
        &self,
        kern: Kernel,
        q: *const f32,
        ql: usize,
        dout: *const f32,
        dl: usize,
        br: usize,
        d: usize,
        dv: usize,
    ) {
        use crate::bf16gemm::NR;
        let sh = bf::Shape::of(kern);
        let (kpd, kpv, kpr) = (sh.kp(d.div_ceil(2)), sh.kp(dv.div_ceil(2)), sh.kp(br.div_ceil(2)));
        // SAFETY: within the buffers `sizes` describes and the rows the caller guarantees.
        unsafe {
            let dop = self.qp.add(kpd * NR);
            bf::pack_q(q, ql, br, d, (self.qp, kpd));
            bf::pack_q(dout, dl, br, dv, (dop, kpv));
            bf::pair_rows((dout, dl), br, dv, (self.dow, kpr), dv.div_ceil(NR) * NR, true);
            bf::pair_rows((q, ql), br, d, (self.qw, kpr), d.div_ceil(NR) * NR, true);
        }
    }

    /// `Sᵀ = scale · K_j Q_iᵀ` into `st` and `dPᵀ = V_j dO_iᵀ` into `dpt`.
    ///
    /// # Safety
    /// `bc` rows of `k` and `v` readable; `st`, `dpt` hold `bc · brp` floats.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn scores(
        &self,
        kern: crate::bf16gemm::micro::Kernel,
        (k, kl): (*const f32, usize),
        (v, vl): (*const f32, usize),
        (j0, bc, chunk): (usize, usize, Option<PackedChunk>),
        (d, dv): (usize, usize),
        scale: f32,
        (st, dpt): (*mut f32, *mut f32),
        brp: usize,
    ) {
        use crate::bf16gemm::NR;
        let sh = bf::Shape::of(kern);
        let (kpd, kpv) = (sh.kp(d.div_ceil(2)), sh.kp(dv.div_ceil(2)));
        // SAFETY: forwarded; the panels were packed by `start_block` for the same kernel, the
        // chunk's rows by `pack_chunk` (row `r` of a block is row `j0 - c0 + r` there; the
        // rows a product reads past the block only reach rows of the tile it does not write).
        unsafe {
            let dop = self.qp.add(kpd * NR) as *const u32;
            let qp = self.qp;
            match chunk {
                Some(c) => {
                    let r = j0 - c.c0;
                    let kb = self.ckr.add(r * 2 * kpd);
                    bf::scores_packed(kern, &Scores { k, ld: kl, bc, d, qp, scale, st, brp, kb });
                    let (kb, ld, qp, scale, st) = (self.cvr.add(r * 2 * kpv), vl, dop, 1.0, dpt);
                    bf::scores_packed(
                        kern,
                        &Scores { k: v, ld, bc, d: dv, qp, scale, st, brp, kb },
                    );
                }
                None => {
                    let kb = self.kb;
                    bf::scores(kern, &Scores { k, ld: kl, bc, d, qp, scale, st, brp, kb });
                    let (ld, qp, scale, st) = (vl, dop, 1.0, dpt);
                    bf::scores(kern, &Scores { k: v, ld, bc, d: dv, qp, scale, st, brp, kb });
                }
            }
        }
    }

    /// `dV_j += (P∘m)ᵀ dO_i`, `dK_j += dSᵀ Q_i` (scaled later), `dQᵀ (+)= K_jᵀ dSᵀ`.
    ///
    /// # Safety
    /// `st`/`dpt` hold the tile's `P∘m` and `dS` (`bc · brp`); the rows in `g` are valid.
    #[inline(always)]
    pub(super) unsafe fn grads(
        &self,
        kern: crate::bf16gemm::micro::Kernel,
        (st, dpt): (*const f32, *const f32),
        brp: usize,
        (br, bc): (usize, usize),
        (d, dv): (usize, usize),
        g: BlockGrads,
    ) {
        use crate::bf16gemm::NR;
        let sh = bf::Shape::of(kern);
        let (kpr, kpc) = (sh.kp(br.div_ceil(2)), sh.kp(bc.div_ceil(2)));
        // The rounded rows hold whole pairs of the block's lanes, and whole tile steps.
        let width = (brp.div_ceil(2) * 2).max(2 * kpr);
        // SAFETY: every buffer is sized by `sizes` for this kernel; the products stay inside
        // the rows the caller guarantees (`product` clips partial tiles).
        unsafe {
            bf::round_rows(st, brp, (bc, sh.mr), br, self.pa, width);
            bf::round_rows(dpt, brp, (bc, sh.mr), br, self.dsa, width);
            bf::product(kern, (self.pa, (width, 2)), kpr, bc, self.dow, dv, g.dvj, true);
            bf::product(kern, (self.dsa, (width, 2)), kpr, bc, self.qw, d, g.dkj, true);
            bf::pair_rows((dpt, brp), bc, brp, (self.dsw, kpc), NR, true);
            // The chunk's pairs where the block starts on a pair and the product reads no
            // pair past it (whole tile steps), or only the chunk's zero pairs after its last
            // keys (as a block of its own has them).
            let from_chunk = g.chunk.filter(|c| {
                let r = g.j0 - c.c0;
                let whole = bc.is_multiple_of(2 * sh.kpa);
                let last = r + bc == c.keys && r / 2 + kpc <= sh.kp(c.keys.div_ceil(2));
                r.is_multiple_of(2) && (whole || last)
            });
            let a = match from_chunk {
                Some(c) => bf::transposed_at(sh, self.ckt, (c.keys, d), (g.j0 - c.c0) / 2),
                None => bf::transposed_a(sh, g.kj, bc, d, self.kw),
            };
            bf::product(kern, a, kpc, d, self.dsw, NR, (self.dqt, NR), !g.first);
        }
    }
}
