//! The flash-attention forward: one task per `(batch, head, query block)`.
//!
//! Per key block: `Sᵀ = K_j · (scale·Q_i)ᵀ` (keys as rows, queries as lanes), masks, the
//! online-softmax update (vertical max, one exp pass that also sums), dropout, then
//! `O += P · V_j` with `O` rescaled only for rows whose running max grew. `O` is divided by the
//! row sum once at the end.

use super::band::{BlockKeys, Hide};
use super::bf16::{self as bf, Scores, Values};
use super::exec::{round16, Carver, ConstPtr, QueryRows, SyncPtr, Task};
use super::gemm::{GemmArgs, Tri};
use super::mask::{build_mask_keys, build_mask_tile, TilePos};
use super::scoremod::{bias_before_cap, cap_tile, Alibi, AlibiColumn};
use super::simd::Simd;
use super::sinks::row_end;
use super::tile::{pack_transposed, scale_row, scale_row_bf16, score_tile, zero_row};
use super::tile::{BlockDropout, MAX_BR};
use super::{AttnParams, Layout4};
use crate::bf16gemm::pack::Operand;

///
/// `T` is the element of q, k and v: f32, or bf16 bits (a bf16 projection as it was written),
/// which only the bf16 products read ([`FwdTask::new`] refuses them otherwise).
pub(crate) struct FwdTask<'a, T: Operand = f32> {
    p: &'a AttnParams<'a>,
    q: ConstPtr<T>,
    ql: Layout4,
    k: ConstPtr<T>,
    kl: Layout4,
    v: ConstPtr<T>,
    vl: Layout4,
    out: OutRows,
    ol: Layout4,
    /// The row statistics, or `None` where the caller keeps none (no backward will run).
    lse: Option<SyncPtr<f32>>,
    br: usize,
    bc: usize,
    nq: usize,
    /// Per `(batch, query head)`: whether its queries, keys and values are all finite (empty:
    /// all are).
    pub(crate) finite: &'a [bool],
    /// The bf16 micro-kernel of `AttnParams::bf16_products`, chosen on the calling thread (a
    /// worker does not see the caller's forced SIMD level).
    pub(crate) kern: crate::bf16gemm::micro::Kernel,
    /// The bf16 products' key and value blocks packed once per head (where built).
    pub(crate) packed: Option<&'a super::prepack::Prepacked>,
}

impl<'a, T: Operand> FwdTask<'a, T> {
    /// The arguments were validated by `flash_forward`: `out` addresses the output through
    /// `ol`, `lse` (when given) holds `2·batch·heads_q·l` floats, both writable and alive for
    /// the task's lifetime. bf16 bits (`T = u16`) need `p.bf16_products` and `br` at most
    /// [`bf::MAX_LANES`], which their entry point checks: the f32 products cannot read them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        p: &'a AttnParams<'a>,
        q: &'a [T],
        ql: Layout4,
        k: &'a [T],
        kl: Layout4,
        v: &'a [T],
        vl: Layout4,
        out: OutRows,
        ol: Layout4,
        lse: Option<SyncPtr<f32>>,
        br: usize,
        bc: usize,
    ) -> Self {
        assert!(br <= MAX_BR && br > 0 && bc > 0);
        let f32_rows = T::as_f32(std::ptr::null()).is_some();
        debug_assert!(f32_rows || (p.bf16_products && br <= bf::MAX_LANES));
        FwdTask {
            p,
            q: ConstPtr(q.as_ptr()),
            ql,
            k: ConstPtr(k.as_ptr()),
            kl,
            v: ConstPtr(v.as_ptr()),
            vl,
            out,
            ol,
            lse,
            br,
            bc,
            nq: p.dims.l.div_ceil(br),
            finite: &[],
            kern: crate::bf16gemm::micro::kernel(),
            packed: None,
        }
    }
}

impl<T: Operand> Task for FwdTask<'_, T> {
    const FLUSH_TO_ZERO: bool = true;

    fn count(&self) -> usize {
        self.p.dims.batch * self.p.dims.heads_q * self.nq
    }

    fn work(&self) -> usize {
        let d = &self.p.dims;
        [d.batch, d.heads_q, d.l, d.s, d.d + d.dv].iter().fold(1usize, |w, x| w.saturating_mul(*x))
    }

    fn scratch_len(&self, lanes: usize) -> usize {
        let d = &self.p.dims;
        let brp = self.br.div_ceil(lanes) * lanes;
        let bf16: usize = if self.p.bf16_products {
            bf::scratch(self.kern, self.bc, d.d, d.dv).iter().map(|&n| round16(n)).sum()
        } else {
            0
        };
        round16(d.d * brp)
            + 2 * round16(self.bc * brp)
            + round16(self.br * d.dv)
            + 3 * round16(brp)
            + bf16
    }

    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, buf: &mut [f32]) {
        let p = self.p;
        let dm = &p.dims;
        let l = S::LANES;
        let bh = t / self.nq;
        let qi = t % self.nq;
        // Causal (or bounded on the right): longest query blocks first, for load balance.
        let qb = if p.causal || p.window.right.is_some() { self.nq - 1 - qi } else { qi };
        let (b, h) = (bh / dm.heads_q, bh % dm.heads_q);
        let hk = h / (dm.heads_q / dm.heads_kv);
        let rows = QueryRows::new(qb, self.br, dm.l, l);
        let QueryRows { i0, br, brp, .. } = rows;
        let (d, dv) = (dm.d, dm.dv);
        let (has_mask, per_key) = (p.has_mask(), p.masks_per_key());
        let dropout = p.active_dropout().map(|(pr, key)| BlockDropout::new(pr, key, bh, i0, br));

        let mut cv = Carver::new(buf);
        let qt = cv.take(d * brp);
        let st = cv.take(self.bc * brp);
        let mt = cv.take(if has_mask { self.bc * brp } else { 0 });
        let o = cv.take(br * dv);
        let mrun = cv.take(brp);
        let lrun = cv.take(brp);
        let alpha = cv.take(brp);
        // The bf16 products' buffers (empty without them); the query block fits one panel
        // (`FWD_BR` lanes).
        let bf = p.bf16_products && brp <= bf::MAX_LANES;
        let kern = self.kern;
        let [qp, kb, vw, pw, ot] = match bf {
            true => bf::scratch(kern, self.bc, d, dv).map(|n| cv.take(n).as_mut_ptr()),
            false => [std::ptr::null_mut(); 5],
        };
        let (qp, kb, vw, pw) = (qp as *mut u32, kb as *mut u16, vw as *mut u32, pw as *mut u32);
        let bfb = BfBlock { kern, qp, kb, vw, pw, ot };

        // SAFETY: all row pointers below address rows validated by `flash_forward` (b < batch,
        // h < heads_q, hk < heads_kv, rows < l or s, `d`/`dv` contiguous floats each); scratch
        // pieces are sized by `scratch_len`; this task alone writes rows `i0..i0+br` of
        // `out[b, h]` and the statistics of `[b, h]` (the output layout was checked to be non-overlapping).
        unsafe {
            let qrow = self.q.0.add(self.ql.offset(b, h, i0));
            // The tiles configured on this thread for the AMX kernel (released at the end).
            let _tiles = bf.then(|| kern.begin());
            if bf {
                let kp = bf::Shape::of(kern).kp(d.div_ceil(2));
                bf::pack_q(qrow, self.ql.seq, br, d, (qp, kp));
            } else if let Some(qrow) = T::as_f32(qrow) {
                // (Never bf16 bits: `new` takes those only with the bf16 products.)
                pack_transposed::<S>(qt, brp, qrow, self.ql.seq, br, d, p.scale);
            }
            mrun.fill(f32::MIN);
            lrun.fill(0.0);
            let mut running = Running { max: mrun, sum: lrun, alpha };

            // A head with a non-finite key or value reads every key (no tile is skipped, the
            // band's -inf is added), so NaN reaches the output exactly as on the composed path.
            let finite = self.finite.get(b * dm.heads_q + h).copied().unwrap_or(true);
            let keys = BlockKeys::of(p, b, (i0, br), finite);
            let mut blk = QueryBlock {
                b,
                h,
                hk,
                rows,
                keys,
                has_mask,
                per_key,
                dropout,
                bf,
                bfb,
                kbase: self.k.0.add(self.kl.offset(b, hk, 0)),
                vbase: self.v.0.add(self.vl.offset(b, hk, 0)),
                qt,
                st,
                mt,
                o,
            };
            let mut first = true;
            let mut j0 = keys.start;
            while j0 < keys.end {
                let step = self.bc.min(keys.end - j0);
                if self.key_block::<S>(&mut blk, &mut running, (j0, step), first) {
                    first = false;
                }
                j0 += step;
            }

            if bf && !first {
                // The output block back from channels × lanes to rows × channels.
                S::transpose(blk.o.as_mut_ptr(), dv, ot, bf::MAX_LANES, dv, br, 1.0, false);
            }
            let rows = RowsOut { b, h, i0, br, dv, finite, empty: first };
            self.write_rows::<S>(&rows, blk.o, running.max, running.sum);
        }
    }
}

/// The bf16 products of one query block's key blocks: the micro-kernel and the task's
/// scratch for them (the query panel, rounded key rows, value and probability pair words, the
/// transposed output).
struct BfBlock {
    kern: crate::bf16gemm::micro::Kernel,
    qp: *mut u32,
    kb: *mut u16,
    vw: *mut u32,
    pw: *mut u32,
    ot: *mut f32,
}

impl BfBlock {
    /// `Sᵀ` of `bc` key rows (`k`, `ld` apart, `d` wide) against the query panel, times `scale`
    /// (1: the softmax pass scales), into `st` (`brp` lanes); from the prepacked rows `ready`
    /// where given.
    ///
    /// # Safety
    /// The rows, the scratch and the tile are valid as `FwdTask::run` carved and validated
    /// them; `ready` holds the rounded rows of these keys.
    #[inline(always)]
    unsafe fn scores<T: Operand>(
        &self,
        ready: Option<*const u16>,
        (k, ld, bc, d): (*const T, usize, usize, usize),
        scale: f32,
        (st, brp): (*mut f32, usize),
    ) {
        let qp = self.qp;
        // SAFETY: forwarded (the caller's guarantees).
        unsafe {
            match ready {
                Some(kb) => {
                    let kb = kb.cast_mut();
                    bf::scores_packed(self.kern, &Scores { k, ld, bc, d, qp, scale, st, brp, kb });
                }
                None => {
                    let kb = self.kb;
                    bf::scores(self.kern, &Scores { k, ld, bc, d, qp, scale, st, brp, kb });
                }
            }
        }
    }

    /// The pair words `P` goes into for `bc` keys and `brp` lanes, their padding zeroed.
    ///
    /// # Safety
    /// `pw` was carved for the task's key blocks (`bc` at most the block, `brp` at most
    /// [`bf::MAX_LANES`]).
    #[inline(always)]
    unsafe fn probabilities(&self, bc: usize, brp: usize) -> *mut u32 {
        let kpc = bf::Shape::of(self.kern).kp(bc.div_ceil(2));
        // SAFETY: forwarded.
        unsafe { bf::zero_pair_padding(self.pw, bc, brp, kpc) };
        self.pw
    }

    /// `Oᵀ (+)= V_jᵀ·Pᵀ` for `bc` value rows (`v`, `ld` apart, `dv` wide), `P` in the pair words
    /// already; the value pairs prepacked (`ready`: the words and the keys they were packed
    /// for) or packed here.
    ///
    /// # Safety
    /// As for [`Self::scores`]; `ready` holds the value pairs of these keys.
    #[inline(always)]
    unsafe fn values<T: Operand>(
        &self,
        ready: Option<(*const u32, usize)>,
        (v, ld, bc, dv): (*const T, usize, usize, usize),
        (st, brp): (*const f32, usize),
        accumulate: bool,
    ) {
        let (ot, pw, p_packed) = (self.ot, self.pw, true);
        // SAFETY: forwarded (the caller's guarantees).
        unsafe {
            match ready {
                Some((vp, v_keys)) => {
                    let vw = vp.cast_mut();
                    let x =
                        Values { st, brp, bc, v, ld, dv, ot, accumulate, vw, pw, v_keys, p_packed };
                    bf::values_packed(self.kern, &x)
                }
                None => {
                    let (vw, v_keys) = (self.vw, bc);
                    let x =
                        Values { st, brp, bc, v, ld, dv, ot, accumulate, vw, pw, v_keys, p_packed };
                    bf::values(self.kern, &x)
                }
            }
        }
    }
}

/// Where the output rows go: f32, or bf16 rounded once from the f32 values (a bf16 module's
/// f32 twin whose next product rounds them to these bits anyway).
#[derive(Clone, Copy)]
pub(crate) enum OutRows {
    F32(SyncPtr<f32>),
    Bf16(SyncPtr<u16>),
}

/// A task's query block as each of its key blocks reads it ([`FwdTask::key_block`]): where it
/// is, what hides its keys, its dropout, the bf16 products' buffers, the head's keys and values,
/// and the task's scratch tiles.
struct QueryBlock<'s, T> {
    b: usize,
    h: usize,
    /// The key and value head that `h` reads.
    hk: usize,
    rows: QueryRows,
    /// The keys read (every key where the head's queries, keys or values are not all
    /// finite).
    keys: BlockKeys,
    /// Whether a mask applies, and whether it holds one value per key.
    has_mask: bool,
    per_key: bool,
    dropout: Option<BlockDropout>,
    /// bf16 products (else f32), and their buffers.
    bf: bool,
    bfb: BfBlock,
    /// The head's first key and value rows.
    kbase: *const T,
    vbase: *const T,
    /// The scaled, transposed query block (f32 products), the score and mask tiles, and the
    /// output rows.
    qt: &'s [f32],
    st: &'s mut [f32],
    mt: &'s mut [f32],
    o: &'s mut [f32],
}

/// Where a finished query block goes: its rows `i0..i0 + br` of head `(b, h)`, whether the
/// head is finite, and whether no key block was read (every key masked or none).
struct RowsOut {
    b: usize,
    h: usize,
    i0: usize,
    br: usize,
    dv: usize,
    finite: bool,
    empty: bool,
}

impl<T: Operand> FwdTask<'_, T> {
    /// One key block `j0..j0 + step` of the query block `q`: its scores, masks and soft cap,
    /// the online-softmax update (dropout on the probabilities), then `O += P·V`. Returns
    /// whether any of its keys was read (a block whose keys the masks hide all is skipped in
    /// a finite head).
    ///
    /// # Safety
    /// `S` is available; `q` was carved and filled by [`Task::run`] for this task, whose
    /// rows and heads `flash_forward` validated; `first` says that no block was read before.
    #[inline(always)]
    unsafe fn key_block<S: Simd>(
        &self,
        q: &mut QueryBlock<'_, T>,
        running: &mut Running<'_>,
        (j0, step): (usize, usize),
        first: bool,
    ) -> bool {
        let p = self.p;
        let (d, dv) = (p.dims.d, p.dims.dv);
        let (b, h, QueryRows { i0, br, brp, nvec }) = (q.b, q.h, q.rows);
        let (bf, bfb, BlockKeys { finite, clip, banded, band, .. }) = (q.bf, &q.bfb, q.keys);
        let pos = TilePos { b, h, i0, br, brp, j0, bc: step };
        // SAFETY: the rows addressed lie in the validated key and value ranges; the tiles are
        // this task's scratch (the caller's contract).
        unsafe {
            // The keys up to the block's last visible one (all of them for a non-finite head,
            // which reads every key).
            let live = match (q.has_mask, q.per_key) {
                (false, _) => step,
                (true, true) => build_mask_keys(&p.masks, pos, q.mt),
                (true, false) => build_mask_tile::<S>(&p.masks, pos, q.mt),
            };
            let bc = if finite { live } else { step };
            if bc == 0 {
                return false;
            }
            let diag = if clip { band.diag(i0, j0) } else { None };
            let kj = q.kbase.add(j0 * self.kl.seq);
            let partial = banded && band.partial(i0, br, j0, bc);
            // The cap goes into the softmax pass where nothing comes between the two (the
            // masks and the bias after the cap, no band to hide); else a pass of its own.
            let fused_cap = p.softcap.filter(|_| !partial && !bias_before_cap(p));
            // The bf16 products' scale goes into the softmax pass too where no pass comes
            // between (the same bits: the pass multiplies first); the f32 products' is in the
            // query block already.
            let fold_scale = bf && !partial && !bias_before_cap(p);
            // This block's keys and values packed once per head, where they were.
            let ready =
                if bf { self.packed.and_then(|pk| pk.block(b, q.hk, j0, bc)) } else { None };
            if bf {
                let scale = if fold_scale { 1.0 } else { p.scale };
                let keys = (kj, self.kl.seq, bc, d);
                bfb.scores(ready.map(|r| r.0), keys, scale, (q.st.as_mut_ptr(), brp));
            } else if let Some(kj) = T::as_f32(kj) {
                let (stp, qtp) = (q.st.as_mut_ptr(), q.qt.as_ptr());
                score_tile::<S>(kj, self.kl.seq, d, qtp, brp, stp, bc, diag);
            }
            let alibi = Alibi::of(p, h, i0, j0);
            if fused_cap.is_none() {
                let tile = (q.st.as_mut_ptr(), brp, nvec, bc);
                cap_tile::<S>(p, tile, (q.mt.as_ptr(), q.per_key), alibi.as_ref());
            }
            if partial {
                let how = if clip { Hide::Fill(f32::NEG_INFINITY) } else { Hide::AddNegInf };
                band.hide(q.st, brp, (i0, j0, bc), how);
            }
            let mask = (q.has_mask && !p.cap_masks()).then_some((q.mt.as_ptr(), q.per_key));
            let alibi = alibi.filter(|_| !bias_before_cap(p));
            let drop = q.dropout.as_ref().map(|dr| (dr, j0));
            let tile = ScoreTile { st: q.st.as_mut_ptr(), brp, nvec, bc };
            let scale = if fold_scale { p.scale } else { 1.0 };
            let mods = ScoreMods { scale, cap: fused_cap, mask, alibi: alibi.as_ref() };
            // The bf16 products' probabilities go straight into their pair words.
            let pack = bf.then(|| bfb.probabilities(bc, brp));
            softmax_tile::<S>(&tile, &mods, running, drop, pack);
            // Rescale O where the max grew, then O += P V.
            let (vj, ld) = (q.vbase.add(j0 * self.vl.seq), self.vl.seq);
            if bf {
                if !first {
                    rescale_lanes::<S>(bfb.ot, dv, running.alpha.as_ptr(), nvec);
                }
                let ready = ready.map(|r| (r.1, r.2));
                bfb.values(ready, (vj, ld, bc, dv), (q.st.as_ptr(), brp), !first);
            } else if let Some(vj) = T::as_f32(vj) {
                let values = (vj, ld, dv);
                accumulate_values::<S>(q.o, &running.alpha[..br], &tile, values, first, diag);
            }
        }
        true
    }

    /// Writes the block's output rows `O / l` and row statistics (a sink joins the sum): the
    /// max and the log of the sum, kept apart so that a row whose max is huge (a -1e9 or finfo.min mask over the
    /// whole row) keeps its precision. A fully masked row is 0 (statistics `(0, inf)`), or, in
    /// a non-finite head, `Σ 0·V` (NaN where V is not finite, as on the composed path).
    ///
    /// # Safety
    /// `S` is available; `(b, h)` and the rows are in range (see `run`); `o` holds
    /// `br · dv` floats, `max` and `sum` `br`.
    #[inline(always)]
    unsafe fn write_rows<S: Simd>(&self, r: &RowsOut, o: &[f32], max: &[f32], sum: &[f32]) {
        let dm = &self.p.dims;
        let rows = dm.batch * dm.heads_q * dm.l;
        let r0 = (r.b * dm.heads_q + r.h) * dm.l + r.i0;
        let sink = self.p.sinks.map(|x| x[r.h]);
        // SAFETY: `run` validated these rows; this task alone writes them.
        unsafe {
            for i in 0..r.br {
                let at = self.ol.offset(r.b, r.h, r.i0 + i);
                let (src, l) = (o.as_ptr().add(i * r.dv), sum[i]);
                let dead = r.empty || (l == 0.0 && r.finite);
                let (scale, (m, denominator)) = row_end(dead, (max[i], l), sink);
                match (self.out, scale) {
                    (OutRows::F32(out), None) => zero_row(out.0.add(at), r.dv),
                    (OutRows::F32(out), Some(f)) => scale_row::<S>(out.0.add(at), src, r.dv, f),
                    (OutRows::Bf16(out), None) => std::ptr::write_bytes(out.0.add(at), 0, r.dv),
                    (OutRows::Bf16(out), Some(f)) => {
                        // The f32 row's values (the same product), rounded once.
                        scale_row_bf16::<S>(out.0.add(at), src, r.dv, f)
                    }
                }
                if let Some(lse) = self.lse {
                    *lse.0.add(r0 + i) = m;
                    *lse.0.add(rows + r0 + i) = denominator.ln();
                }
            }
        }
    }
}

/// One tile of scores, keys as rows (`bc` of them, stride `brp`) and the block's queries as
/// `nvec` vectors of lanes.
struct ScoreTile {
    st: *mut f32,
    brp: usize,
    nvec: usize,
    bc: usize,
}

/// The running softmax statistics of a query block, queries as lanes: the max, the sum, and
/// the last key block's rescaling factors `exp(m_old - m_new)`.
struct Running<'s> {
    max: &'s mut [f32],
    sum: &'s mut [f32],
    alpha: &'s mut [f32],
}

/// What the softmax pass applies to a fresh score before its max: the scale (1: none), the
/// soft cap `c` (when no pass of its own took it), then the masks (a pointer and whether it
/// holds one value per key, else one per entry) and the ALiBi bias.
struct ScoreMods<'a> {
    scale: f32,
    cap: Option<f32>,
    mask: Option<(*const f32, bool)>,
    alibi: Option<&'a Alibi>,
}

impl ScoreMods<'_> {
    /// The scale where it is all that modifies a score and a power of two below 1: then the
    /// max pass reads the scores as they are (no product, nothing stored back) and scales their
    /// max, and the exp pass takes `x·scale - m` in one FMA. `x·scale` is exact for such a
    /// scale (an exponent step, no overflow; an underflow only where `|x·scale - m|` is below
    /// 2⁻¹²⁰, whose exp is 1 either way) and rounding is monotonic, so the differences, `P`,
    /// the sums and the rescaling factors have the bits of the scaled scores, and so has the
    /// max but for the sign of a zero max: where a row's scaled scores all underflow to ±0,
    /// `maxps` may keep −0 where the scaled raw max is +0 (`x·scale - (±0)` is the same).
    fn folded_scale(&self) -> Option<f32> {
        let s = self.scale;
        let pow2 = s.is_normal() && s.to_bits() & 0x007f_ffff == 0;
        let alone = self.cap.is_none() && self.mask.is_none() && self.alibi.is_none();
        (alone && pow2 && s > 0.0 && s < 1.0).then_some(s)
    }
}

/// The online-softmax update of one score tile: the scores capped, the masks and the ALiBi
/// bias added (`mods`), the running max and its rescaling factors updated (pass 1, vertical
/// over keys), then `P = exp(S - m)` (times the dropout multipliers of `dropout`'s block at
/// key offset `j0`) while the running sums are rescaled and increased (pass 2). `P` replaces
/// the tile, or, with `pack`, goes into the bf16 products' pair words there (two key rows per
/// word row, as [`bf::pair_rows`] packs them; the caller zeroes the padding).
///
/// # Safety
/// `S` is available; the tile (and a per-entry mask) hold `bc · brp` floats, a per-key mask
/// `bc`; the running slices `nvec · S::LANES`; `pack` holds `bc.div_ceil(2)` rows of
/// [`bf::MAX_LANES`] words, with `brp <= MAX_LANES`.
#[inline(always)]
unsafe fn softmax_tile<S: Simd>(
    t: &ScoreTile,
    mods: &ScoreMods<'_>,
    run: &mut Running<'_>,
    dropout: Option<(&BlockDropout, usize)>,
    pack: Option<*mut u32>,
) {
    // Groups of four vectors of queries (a row of a 64-lane tile on AVX-512) walk the tile's
    // rows in order; each lane still sees the keys in order, so the bits are those of one
    // vector at a time.
    // SAFETY: forwarded (the groups cover vectors `0..nvec`).
    unsafe {
        let folded = mods.folded_scale();
        let Some(pw) = pack else {
            let mut v0 = 0;
            while v0 + 4 <= t.nvec {
                max_pass::<S, 4>(t, mods, folded, run, v0);
                exp_group::<S, 4>(t, run, (dropout, folded), v0);
                v0 += 4;
            }
            while v0 < t.nvec {
                max_pass::<S, 1>(t, mods, folded, run, v0);
                exp_group::<S, 1>(t, run, (dropout, folded), v0);
                v0 += 1;
            }
            return;
        };
        let mut v0 = 0;
        while v0 + 4 <= t.nvec {
            max_pass::<S, 4>(t, mods, folded, run, v0);
            v0 += 4;
        }
        while v0 < t.nvec {
            max_pass::<S, 1>(t, mods, folded, run, v0);
            v0 += 1;
        }
        #[cfg(target_arch = "x86_64")]
        if S::LANES == 16 && super::simd::native_bf16_pairs() {
            return exp_pairs_native::<S>(t, run, (dropout, folded), pw);
        }
        exp_pairs::<S, false>(t, run, (dropout, folded), pw);
    }
}

/// [`exp_pairs`] compiled for AVX512-BF16, its pair words rounded by the instruction.
///
/// # Safety
/// As for [`softmax_tile`]; `S` is [`Avx512`](super::simd::Avx512) on a CPU with AVX512-BF16
/// ([`native_bf16_pairs`](super::simd::native_bf16_pairs)).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl,avx512bf16")]
unsafe fn exp_pairs_native<S: Simd>(
    t: &ScoreTile,
    run: &mut Running<'_>,
    how: (Option<(&BlockDropout, usize)>, Option<f32>),
    pw: *mut u32,
) {
    // SAFETY: forwarded; the features `store_bf16_pairs_native` needs are enabled here.
    unsafe { exp_pairs::<S, true>(t, run, how, pw) }
}

/// Pass 1 of [`softmax_tile`] for the `G` vectors of queries from `v0`: the scores modified
/// (and stored back where anything modified them), the running max and its rescaling factors.
///
/// # Safety
/// As for [`softmax_tile`], with `v0 + G <= t.nvec`.
#[inline(always)]
unsafe fn max_pass<S: Simd, const G: usize>(
    t: &ScoreTile,
    mods: &ScoreMods<'_>,
    folded: Option<f32>,
    run: &mut Running<'_>,
    v0: usize,
) {
    let (l, stp, brp) = (S::LANES, t.st, t.brp);
    let (mask, alibi) = (mods.mask, mods.alibi);
    let (cap, inv) = (mods.cap.unwrap_or(1.0), mods.cap.map_or(1.0, |c| 1.0 / c));
    let scaled = mods.scale != 1.0 && folded.is_none();
    let modified = scaled || mods.cap.is_some() || mask.is_some() || alibi.is_some();
    // SAFETY: within the tile and the running slices (caller).
    unsafe {
        let scale = S::splat(mods.scale);
        let mut mx = [S::splat(f32::NEG_INFINITY); G];
        let mut cols: [Option<AlibiColumn<S>>; G] = [None; G];
        if let Some(a) = alibi {
            for (u, c) in cols.iter_mut().enumerate() {
                *c = Some(a.column::<S>((v0 + u) * l));
            }
        }
        for j in 0..t.bc {
            for u in 0..G {
                let at = j * brp + (v0 + u) * l;
                let ptr = stp.add(at);
                let mut x = S::load(ptr);
                if scaled {
                    x = S::mul(x, scale);
                }
                if mods.cap.is_some() {
                    x = S::softcap(x, cap, inv);
                }
                if let Some((mtp, per_key)) = mask {
                    let m = match per_key {
                        true => S::splat(*mtp.add(j)),
                        false => S::load(mtp.add(at)),
                    };
                    x = S::add(x, m);
                }
                if let Some(c) = cols[u].as_mut() {
                    x = S::add(x, c.next());
                }
                if modified {
                    S::store(ptr, x);
                }
                mx[u] = S::max(mx[u], x);
            }
        }
        for (u, &mx) in mx.iter().enumerate() {
            let vi = v0 + u;
            let mx = folded.map_or(mx, |f| S::mul(mx, S::splat(f)));
            let mo = S::load(run.max.as_ptr().add(vi * l));
            // f32::MIN, not -inf, as the reference of an all -inf row: exp(-inf - MIN)
            // is 0 where exp(-inf - -inf) would be NaN.
            let mn = S::max(S::splat(f32::MIN), S::max(mo, mx));
            S::store(run.max.as_mut_ptr().add(vi * l), mn);
            S::store(run.alpha.as_mut_ptr().add(vi * l), S::exp(S::sub(mo, mn)));
        }
    }
}

/// Pass 2 of [`softmax_tile`] for the `G` vectors of queries from `v0`, `P` into the tile,
/// and the running sums.
///
/// # Safety
/// As for [`softmax_tile`], with `v0 + G <= t.nvec`.
#[inline(always)]
unsafe fn exp_group<S: Simd, const G: usize>(
    t: &ScoreTile,
    run: &mut Running<'_>,
    (dropout, folded): (Option<(&BlockDropout, usize)>, Option<f32>),
    v0: usize,
) {
    let (l, stp, brp) = (S::LANES, t.st, t.brp);
    // SAFETY: within the tile and the running slices (caller).
    unsafe {
        let shift = Shift::<S>::new(folded);
        let mut r = [shift.of(S::splat(0.0)); G];
        for (u, r) in r.iter_mut().enumerate() {
            *r = shift.of(S::load(run.max.as_ptr().add((v0 + u) * l)));
        }
        let mut sum = [S::splat(0.0); G];
        for j in 0..t.bc {
            for u in 0..G {
                let (lane, sum) = ((v0 + u) * l, &mut sum[u]);
                let ptr = stp.add(j * brp + lane);
                let e = probability::<S, false>(ptr, r[u], sum, dropout, (lane, j));
                S::store(ptr, e);
            }
        }
        for (u, &sum) in sum.iter().enumerate() {
            add_sum::<S>(run, (v0 + u) * l, sum);
        }
    }
}

/// Pass 2 of [`softmax_tile`] for the bf16 products: `P` for every vector of queries into the
/// pair words at `pw` (rounded by AVX512-BF16's instruction where `NATIVE`), and the running
/// sums.
///
/// # Safety
/// As for [`softmax_tile`]; with `NATIVE`, as for [`exp_pairs_native`].
#[inline(always)]
unsafe fn exp_pairs<S: Simd, const NATIVE: bool>(
    t: &ScoreTile,
    run: &mut Running<'_>,
    (dropout, folded): (Option<(&BlockDropout, usize)>, Option<f32>),
    pw: *mut u32,
) {
    let (l, stp, brp) = (S::LANES, t.st, t.brp);
    #[inline(always)]
    unsafe fn store<S: Simd, const NATIVE: bool>(words: *mut u32, lo: S::V, hi: S::V) {
        // SAFETY: forwarded (`exp_pairs`' caller).
        unsafe {
            match NATIVE {
                true => S::store_bf16_pairs_native(words, lo, hi),
                false => S::store_bf16_pairs(words, lo, hi),
            }
        }
    }
    // Each vector of queries walks all the keys with its running sum in a register (a loop
    // over a group inside the key loop kept the sums on the stack here, a store and a reload
    // in every exp's dependency chain). Each lane still adds its keys in order.
    // SAFETY: within the tile, the pair words and the running slices (caller).
    unsafe {
        let shift = Shift::<S>::new(folded);
        for vi in 0..t.nvec {
            let lane = vi * l;
            let r = shift.of(S::load(run.max.as_ptr().add(lane)));
            let mut sum = S::splat(0.0);
            let mut j = 0;
            while j + 1 < t.bc {
                let ptr = stp.add(j * brp + lane);
                let lo = probability::<S, true>(ptr, r, &mut sum, dropout, (lane, j));
                let hi = probability::<S, true>(ptr.add(brp), r, &mut sum, dropout, (lane, j + 1));
                store::<S, NATIVE>(pw.add(j / 2 * bf::MAX_LANES + lane), lo, hi);
                j += 2;
            }
            if j < t.bc {
                let ptr = stp.add(j * brp + lane);
                let lo = probability::<S, true>(ptr, r, &mut sum, dropout, (lane, j));
                store::<S, NATIVE>(pw.add(j / 2 * bf::MAX_LANES + lane), lo, S::splat(0.0));
            }
            add_sum::<S>(run, lane, sum);
        }
    }
}

/// `l = alpha · l + sum` for the running sums of the vector of queries from `lane`.
///
/// # Safety
/// `S` is available; the running slices hold `lane + S::LANES` floats.
#[inline(always)]
unsafe fn add_sum<S: Simd>(run: &mut Running<'_>, lane: usize, sum: S::V) {
    // SAFETY: in range (caller).
    unsafe {
        let lp = run.sum.as_mut_ptr().add(lane);
        let a = S::load(run.alpha.as_ptr().add(lane));
        S::store(lp, S::fma(a, S::load(lp), sum));
    }
}

/// How the exp pass takes a score's distance from its row's max: `x - m`, or `x·scale - m`
/// where the max pass left the scores unscaled ([`ScoreMods::folded_scale`]: `x·scale` is
/// exact, so one rounding either way).
#[derive(Clone, Copy)]
enum Shifted<S: Simd> {
    Sub(S::V),
    Fma(S::V, S::V),
}

/// The folded scale (if any), splatted once per pass.
struct Shift<S: Simd>(Option<S::V>);

impl<S: Simd> Shift<S> {
    /// # Safety
    /// `S` is available.
    #[inline(always)]
    unsafe fn new(folded: Option<f32>) -> Self {
        // SAFETY: a splat (the caller's instruction set).
        Shift(folded.map(|f| unsafe { S::splat(f) }))
    }

    /// The distance form for the running max `m`.
    ///
    /// # Safety
    /// `S` is available.
    #[inline(always)]
    unsafe fn of(&self, m: S::V) -> Shifted<S> {
        match self.0 {
            // SAFETY: arithmetic (the caller's instruction set); `-m` is exact.
            Some(scale) => Shifted::Fma(scale, unsafe { S::sub(S::splat(0.0), m) }),
            None => Shifted::Sub(m),
        }
    }
}

/// `exp(x - r)` for the scores at `ptr`, added to `sum`, then times the dropout multipliers
/// of key row `j` (tile-local) for the lanes from `lane` (the running sum takes `P` before
/// dropout). With `BF16_P` (the bf16 products' probabilities, rounded to bf16 for their
/// product) as `2^((x - r)·log₂e)` ([`Simd::exp2_low`]: four instructions fewer than `exp`,
/// within 3e-7; bf16 SDPA B8 L=S=512 H8 D64 on an AMX CPU, four alternating runs: 5.37-5.55
/// -> 4.97-5.05 ms).
///
/// # Safety
/// `S` is available; `ptr` holds `S::LANES` floats.
#[inline(always)]
unsafe fn probability<S: Simd, const BF16_P: bool>(
    ptr: *const f32,
    r: Shifted<S>,
    sum: &mut S::V,
    dropout: Option<(&BlockDropout, usize)>,
    (lane, j): (usize, usize),
) -> S::V {
    // SAFETY: vector arithmetic on the lanes the caller guarantees.
    unsafe {
        // `x - max <= 0`, so `exp_low` gives `exp`'s bits. (A NaN score can hide part of a
        // row's max from `maxps`; that row's sum, and so its output, is NaN either way.)
        let x = S::load(ptr);
        let d = match r {
            Shifted::Sub(m) => S::sub(x, m),
            Shifted::Fma(scale, neg) => S::fma(x, scale, neg),
        };
        // The bf16 products' probabilities in base 2 (`d·log₂e` rounded once: a relative error
        // of at most 6e-8·|d·log₂e| in P on top of the polynomial's, least for the terms near
        // the max that the sums hang on).
        let e = match BF16_P {
            true => S::exp2_low(S::mul(d, S::splat(std::f32::consts::LOG2_E))),
            false => S::exp_low(d),
        };
        *sum = S::add(*sum, e);
        match dropout {
            Some((dr, j0)) => S::mul(e, dr.vector::<S>(lane, j0 + j)),
            None => e,
        }
    }
}

/// The f32 products' `O = alpha ∘ O + P · V_j` for the block's `alpha.len()` rows (`O = P · V_j`
/// for the first key block), with `P` the tile (transposed: keys as rows) and `values` the key
/// block's value rows `(pointer, stride, dv)`; `diag` clips a causal block's triangle.
///
/// # Safety
/// `S` is available; `o` holds `rows · dv` floats; `values` addresses `t.bc` rows of `dv`.
#[inline(always)]
unsafe fn accumulate_values<S: Simd>(
    o: &mut [f32],
    alpha: &[f32],
    t: &ScoreTile,
    values: (*const f32, usize, usize),
    first: bool,
    diag: Option<isize>,
) {
    let (v, ldb, dv) = values;
    // SAFETY: the rows of `o` and the tile are in range (caller).
    unsafe {
        if !first {
            for (i, &a) in alpha.iter().enumerate() {
                if a != 1.0 {
                    let row = o.as_mut_ptr().add(i * dv);
                    scale_row::<S>(row, row, dv, a);
                }
            }
        }
        S::gemm(&GemmArgs {
            m: alpha.len(),
            n: dv,
            k: t.bc,
            a: t.st,
            rs_a: 1,
            cs_a: t.brp,
            b: v,
            ldb,
            c: o.as_mut_ptr(),
            ldc: dv,
            accumulate: !first,
            // Query row r sees keys j0 + k' <= i0 + r only.
            tri: diag.map_or(Tri::Full, Tri::KEnd),
        });
    }
}

/// `ot[c][0..nvec·LANES] *= alpha` for each channel `c < dv` (the transposed output block of
/// the bf16 products, queries as lanes).
///
/// # Safety
/// `S` is available; `ot` holds `dv` rows of [`bf::MAX_LANES`] floats and `alpha`
/// `nvec · S::LANES` floats, with `nvec · S::LANES <= MAX_LANES`.
#[inline(always)]
unsafe fn rescale_lanes<S: Simd>(ot: *mut f32, dv: usize, alpha: *const f32, nvec: usize) {
    let l = S::LANES;
    // SAFETY: within the rows and lanes the caller guarantees.
    unsafe {
        for c in 0..dv {
            let row = ot.add(c * bf::MAX_LANES);
            for vi in 0..nvec {
                let x = row.add(vi * l);
                S::store(x, S::mul(S::load(x), S::load(alpha.add(vi * l))));
            }
        }
    }
}

#[cfg(test)]
#[path = "tests/fold.rs"]
mod fold_tests;
