//! The attention-weights pass: recomputes `P = exp(scale·q·k + mask − max − ln Σ)` (times the dropout
//! multipliers) block by block and writes it out, optionally averaged over heads.
//!
//! One task per `(batch, head, query block)`, or per `(batch, query block)` when averaging, in
//! which case the task sums the heads in order `0..heads_q` (deterministic) and divides once.

use super::band::{BlockKeys, Hide};
use super::exec::{round16, Carver, ConstPtr, QueryRows, SyncPtr, Task};
use super::mask::{build_mask_tile, TilePos};
use super::scoremod::{bias_before_cap, cap_tile, Alibi};
use super::simd::Simd;
use super::tile::{pack_transposed, scale_row, score_tile, BlockDropout, MAX_BR};
use super::{AttnParams, Layout4};

pub(crate) struct WeightsTask<'a> {
    p: &'a AttnParams<'a>,
    q: ConstPtr<f32>,
    ql: Layout4,
    k: ConstPtr<f32>,
    kl: Layout4,
    lse: ConstPtr<f32>,
    w: SyncPtr<f32>,
    average: bool,
    br: usize,
    bc: usize,
    nq: usize,
    /// Per `(batch, query head)`: whether its queries and keys are all finite (empty: all are).
    pub(crate) finite: &'a [bool],
}

impl<'a> WeightsTask<'a> {
    /// The arguments were validated by `attention_weights`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        p: &'a AttnParams<'a>,
        q: &'a [f32],
        ql: Layout4,
        k: &'a [f32],
        kl: Layout4,
        lse: &'a [f32],
        average: bool,
        w: &'a mut [f32],
        br: usize,
        bc: usize,
    ) -> Self {
        assert!(br <= MAX_BR && br > 0 && bc > 0);
        WeightsTask {
            p,
            q: ConstPtr(q.as_ptr()),
            ql,
            k: ConstPtr(k.as_ptr()),
            kl,
            lse: ConstPtr(lse.as_ptr()),
            w: SyncPtr(w.as_mut_ptr()),
            average,
            br,
            bc,
            nq: p.dims.l.div_ceil(br),
            finite: &[],
        }
    }
}

impl Task for WeightsTask<'_> {
    const FLUSH_TO_ZERO: bool = true;

    fn count(&self) -> usize {
        let d = &self.p.dims;
        d.batch * if self.average { 1 } else { d.heads_q } * self.nq
    }

    fn work(&self) -> usize {
        let d = &self.p.dims;
        [d.batch, d.heads_q, d.l, d.s, d.d].iter().fold(1usize, |w, x| w.saturating_mul(*x))
    }

    fn scratch_len(&self, lanes: usize) -> usize {
        let d = &self.p.dims;
        let brp = self.br.div_ceil(lanes) * lanes;
        round16(d.d * brp) + 2 * round16(self.bc * brp) + 2 * round16(brp)
    }

    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, buf: &mut [f32]) {
        let p = self.p;
        let dm = &p.dims;
        let l = S::LANES;
        let (bh_out, qb) = (t / self.nq, t % self.nq);
        let (b, heads, hw, nh_out) = if self.average {
            (bh_out, 0..dm.heads_q, 0, 1)
        } else {
            let h = bh_out % dm.heads_q;
            (bh_out / dm.heads_q, h..h + 1, h, dm.heads_q)
        };
        let rows = QueryRows::new(qb, self.br, dm.l, l);
        let QueryRows { i0, br, brp, .. } = rows;
        let (d, s) = (dm.d, dm.s);
        let has_mask = p.has_mask();

        let mut cv = Carver::new(buf);
        let qt = cv.take(d * brp);
        let st = cv.take(self.bc * brp);
        let mt = cv.take(if has_mask { self.bc * brp } else { 0 });
        let lsev = cv.take(brp);
        let maxv = cv.take(brp);

        // SAFETY: rows addressed below were validated by `attention_weights`; this task alone
        // writes rows `i0..i0+br` of `weights[b, hw]` (a contiguous `[batch, hw, l, s]` array).
        unsafe {
            let wbase = self.w.0.add(((b * nh_out + hw) * dm.l + i0) * s);
            let mut sc = WeightsScratch { qt, st, mt, lsev, maxv };
            for (n, h) in heads.enumerate() {
                let blk = HeadBlock { b, h, rows, first: n == 0, wbase };
                self.head_weights::<S>(&blk, &mut sc);
            }
            if self.average && dm.heads_q > 1 {
                let f = 1.0 / dm.heads_q as f32;
                for i in 0..br {
                    let row = wbase.add(i * s);
                    scale_row::<S>(row, row, s, f);
                }
            }
        }
    }
}

/// One head's share of a task's weight rows ([`WeightsTask::head_weights`]): its rows
/// `i0..i0 + br` (`brp` lanes, `nvec` vectors), whether it is the first head written (the
/// others add to it), and the task's first output row.
struct HeadBlock {
    b: usize,
    h: usize,
    rows: QueryRows,
    first: bool,
    wbase: *mut f32,
}

/// A task's scratch: the scaled, transposed queries, the score and mask tiles, and the
/// forward's row statistics.
struct WeightsScratch<'s> {
    qt: &'s mut [f32],
    st: &'s mut [f32],
    mt: &'s mut [f32],
    lsev: &'s mut [f32],
    maxv: &'s mut [f32],
}

impl WeightsTask<'_> {
    /// Head `blk.h`'s probabilities for the block's rows, written (the first head) or added
    /// into the output rows key block by key block; a key block the masks hide all is zeros.
    ///
    /// # Safety
    /// `S` is available; the rows were validated by `attention_weights` and the scratch was
    /// carved by `run` for this task.
    #[inline(always)]
    unsafe fn head_weights<S: Simd>(&self, blk: &HeadBlock, sc: &mut WeightsScratch<'_>) {
        let p = self.p;
        let dm = &p.dims;
        let (d, s) = (dm.d, dm.s);
        let (b, h, QueryRows { i0, br, brp, nvec }) = (blk.b, blk.h, blk.rows);
        let has_mask = p.has_mask();
        let hk = h / (dm.heads_q / dm.heads_kv);
        let bh = b * dm.heads_q + h;
        // SAFETY: the caller's contract.
        unsafe {
            let wrow = |i: usize| blk.wbase.add(i * s);
            let qrow = self.q.0.add(self.ql.offset(b, h, i0));
            pack_transposed::<S>(sc.qt, brp, qrow, self.ql.seq, br, d, p.scale);
            // The forward's row statistics; padding lanes get P = exp(x - inf) = 0.
            let rows = dm.batch * dm.heads_q * dm.l;
            let (max_row, lse_row) = (bh * dm.l + i0, rows + bh * dm.l + i0);
            for i in 0..brp {
                (sc.maxv[i], sc.lsev[i]) = match i < br {
                    true => (*self.lse.0.add(max_row + i), *self.lse.0.add(lse_row + i)),
                    false => (0.0, f32::INFINITY),
                };
            }
            let dropout =
                p.active_dropout().map(|(pr, key)| BlockDropout::new(pr, key, bh, i0, br));
            let kbase = self.k.0.add(self.kl.offset(b, hk, 0));
            let finite = self.finite.get(b * dm.heads_q + h).copied().unwrap_or(true);
            let keys = BlockKeys::of(p, b, (i0, br), finite);
            let BlockKeys { clip, banded, band, start: jstart, end: jend, .. } = keys;
            let mut j0 = 0;
            while j0 < s {
                let bc = self.bc.min(s - j0);
                let pos = TilePos { b, h, i0, br, brp, j0, bc };
                // A non-finite head builds its mask tile and never skips it.
                let all_masked = (clip && (j0 + bc <= jstart || j0 >= jend))
                    || (has_mask && build_mask_tile::<S>(&p.masks, pos, sc.mt) == 0 && finite);
                if all_masked {
                    if blk.first {
                        for i in 0..br {
                            std::ptr::write_bytes(wrow(i).add(j0), 0, bc);
                        }
                    }
                    j0 += bc;
                    continue;
                }
                let (kj, diag) = (kbase.add(j0 * self.kl.seq), clip.then(|| band.diag(i0, j0)));
                let (qt, stp) = (sc.qt.as_ptr(), sc.st.as_mut_ptr());
                score_tile::<S>(kj, self.kl.seq, d, qt, brp, stp, bc, diag.flatten());
                let alibi = Alibi::of(p, h, i0, j0);
                let tile = (stp, brp, nvec, bc);
                cap_tile::<S>(p, tile, (sc.mt.as_ptr(), false), alibi.as_ref());
                if banded && band.partial(i0, br, j0, bc) {
                    let how = if clip { Hide::Fill(f32::NEG_INFINITY) } else { Hide::AddNegInf };
                    band.hide(sc.st, brp, (i0, j0, bc), how);
                }
                let mask = (has_mask && !p.cap_masks()).then_some(sc.mt.as_ptr());
                let alibi = alibi.filter(|_| !bias_before_cap(p));
                let stats = (sc.maxv.as_ptr(), sc.lsev.as_ptr());
                let drop = dropout.as_ref().map(|dr| (dr, j0));
                // The tile's pointer taken again after `hide` wrote through the slice.
                let tile = (sc.st.as_mut_ptr(), brp, nvec, bc);
                probs_tile::<S>(tile, (mask, alibi.as_ref()), stats, drop);
                // Transpose the [key][query] tile into the [query][key] output rows.
                // w[i][j0 + j] (+)= st[j][i]: a transpose with `bc` source rows of `br`.
                S::transpose(wrow(0).add(j0), s, sc.st.as_ptr(), brp, bc, br, 1.0, !blk.first);
                j0 += bc;
            }
        }
    }
}

/// Replaces a score tile `(st, brp, nvec, bc)` (keys as rows) by `P = exp(S + mask + bias −
/// max − lse)`, times the dropout multipliers of `dropout`'s block at key offset `j0`; `mask` is a
/// per-entry tile and `(max, lse)` the forward's statistics, one per lane.
///
/// # Safety
/// `S` is available; the tile (and the mask) hold `bc · brp` floats, the statistics
/// `nvec · S::LANES`.
#[inline(always)]
unsafe fn probs_tile<S: Simd>(
    (st, brp, nvec, bc): (*mut f32, usize, usize, usize),
    (mask, alibi): (Option<*const f32>, Option<&Alibi>),
    (maxv, lsev): (*const f32, *const f32),
    dropout: Option<(&BlockDropout, usize)>,
) {
    let l = S::LANES;
    // SAFETY: within the tile and the statistics (caller).
    unsafe {
        for vi in 0..nvec {
            let mut col = alibi.map(|a| a.column::<S>(vi * l));
            let lv = S::load(lsev.add(vi * l));
            let mv = S::load(maxv.add(vi * l));
            for j in 0..bc {
                let off = j * brp + vi * l;
                let mut x = S::load(st.add(off));
                if let Some(mtp) = mask {
                    x = S::add(x, S::load(mtp.add(off)));
                }
                if let Some(c) = col.as_mut() {
                    x = S::add(x, c.next());
                }
                let mut e = S::exp(S::sub(S::sub(x, mv), lv));
                if let Some((dr, j0)) = dropout {
                    e = S::mul(e, dr.vector::<S>(vi * l, j0 + j));
                }
                S::store(st.add(off), e);
            }
        }
    }
}
