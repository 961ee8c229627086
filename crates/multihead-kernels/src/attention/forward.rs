//! The flash-attention forward: one task per `(batch, head, query block)`.
//!
//! Per key block: `Sᵀ = K_j · (scale·Q_i)ᵀ` (keys as rows, queries as lanes), masks, the
//! online-softmax update (vertical max, one exp pass that also sums), dropout, then
//! `O += P · V_j` with `O` rescaled only for rows whose running max grew. `O` is divided by the
//! row sum once at the end.

use super::bf16::{self as bf, Scores, Values};
use super::exec::{round16, Carver, ConstPtr, SyncPtr, Task};
use super::gemm::{GemmArgs, Tri};
use super::mask::{build_mask_keys, build_mask_tile, causal_add, causal_fill, TilePos};
use super::simd::Simd;
use super::tile::{pack_transposed, scale_row, score_tile, zero_row, BlockDropout, MAX_BR};
use super::{AttnParams, Layout4};

pub(crate) struct FwdTask<'a> {
    p: &'a AttnParams<'a>,
    q: ConstPtr<f32>,
    ql: Layout4,
    k: ConstPtr<f32>,
    kl: Layout4,
    v: ConstPtr<f32>,
    vl: Layout4,
    out: SyncPtr<f32>,
    ol: Layout4,
    lse: SyncPtr<f32>,
    br: usize,
    bc: usize,
    nq: usize,
    /// Per `(batch, query head)`: whether its queries, keys and values are all finite (empty:
    /// all are).
    pub(crate) finite: &'a [bool],
    /// The bf16 micro-kernel of `AttnParams::bf16_products`, chosen on the calling thread (a
    /// worker does not see the caller's forced SIMD level).
    pub(crate) kern: crate::bf16gemm::micro::Kernel,
}

impl<'a> FwdTask<'a> {
    /// The arguments were validated by `flash_forward`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        p: &'a AttnParams<'a>,
        q: &'a [f32],
        ql: Layout4,
        k: &'a [f32],
        kl: Layout4,
        v: &'a [f32],
        vl: Layout4,
        out: &'a mut [f32],
        ol: Layout4,
        lse: &'a mut [f32],
        br: usize,
        bc: usize,
    ) -> Self {
        assert!(br <= MAX_BR && br > 0 && bc > 0);
        FwdTask {
            p,
            q: ConstPtr(q.as_ptr()),
            ql,
            k: ConstPtr(k.as_ptr()),
            kl,
            v: ConstPtr(v.as_ptr()),
            vl,
            out: SyncPtr(out.as_mut_ptr()),
            ol,
            lse: SyncPtr(lse.as_mut_ptr()),
            br,
            bc,
            nq: p.dims.l.div_ceil(br),
            finite: &[],
            kern: crate::bf16gemm::micro::kernel(),
        }
    }
}

impl Task for FwdTask<'_> {
    fn count(&self) -> usize {
        self.p.dims.batch * self.p.dims.heads_q * self.nq
    }

    fn scratch_len(&self, lanes: usize) -> usize {
        let d = &self.p.dims;
        let brp = self.br.div_ceil(lanes) * lanes;
        let bf16: usize = if self.p.bf16_products {
            bf::scratch(self.bc, d.d, d.dv).iter().map(|&n| round16(n)).sum()
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
        // Causal: longest query blocks first, for load balance.
        let qb = if p.causal { self.nq - 1 - qi } else { qi };
        let (b, h) = (bh / dm.heads_q, bh % dm.heads_q);
        let hk = h / (dm.heads_q / dm.heads_kv);
        let i0 = qb * self.br;
        let br = self.br.min(dm.l - i0);
        let brp = br.div_ceil(l) * l;
        let nvec = brp / l;
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
            true => bf::scratch(self.bc, d, dv).map(|n| cv.take(n).as_mut_ptr()),
            false => [std::ptr::null_mut(); 5],
        };
        let (qp, kb, vw, pw) = (qp as *mut u32, kb as *mut u16, vw as *mut u32, pw as *mut u32);

        // SAFETY: all row pointers below address rows validated by `flash_forward` (b < batch,
        // h < heads_q, hk < heads_kv, rows < l or s, `d`/`dv` contiguous floats each); scratch
        // pieces are sized by `scratch_len`; this task alone writes rows `i0..i0+br` of
        // `out[b, h]` and the statistics of `[b, h]` (the output layout was checked to be non-overlapping).
        unsafe {
            let qrow = self.q.0.add(self.ql.offset(b, h, i0));
            if bf {
                bf::pack_q(qrow, self.ql.seq, br, d, qp);
            } else {
                pack_transposed::<S>(qt, brp, qrow, self.ql.seq, br, d, p.scale);
            }
            mrun.fill(f32::MIN);
            lrun.fill(0.0);

            // A head with a non-finite key or value reads every key (no tile is skipped, causal
            // masking is added), so NaN reaches the output exactly as on the composed path.
            let finite = self.finite.get(b * dm.heads_q + h).copied().unwrap_or(true);
            let clip = p.causal && finite;
            let jend = if clip { dm.s.min(i0 + br) } else { dm.s };
            let kbase = self.k.0.add(self.kl.offset(b, hk, 0));
            let vbase = self.v.0.add(self.vl.offset(b, hk, 0));
            let mut first = true;
            let mut j0 = 0;
            while j0 < jend {
                let step = self.bc.min(jend - j0);
                let pos = TilePos { b, h, i0, br, brp, j0, bc: step };
                // The keys up to the block's last visible one (all of them for a non-finite
                // head, which reads every key).
                let live = match (has_mask, per_key) {
                    (false, _) => step,
                    (true, true) => build_mask_keys(&p.masks, pos, mt),
                    (true, false) => build_mask_tile::<S>(&p.masks, pos, mt),
                };
                let bc = if finite { live } else { step };
                if bc == 0 {
                    j0 += step;
                    continue;
                }
                let diag = clip.then_some(i0 as isize - j0 as isize);
                let kj = kbase.add(j0 * self.kl.seq);
                if bf {
                    let (ld, qp, scale, st, kb) = (self.kl.seq, qp, p.scale, st.as_mut_ptr(), kb);
                    bf::scores(kern, &Scores { k: kj, ld, bc, d, qp, scale, st, brp, kb });
                } else {
                    let (stp, qtp) = (st.as_mut_ptr(), qt.as_ptr());
                    score_tile::<S>(kj, self.kl.seq, d, qtp, brp, stp, bc, diag);
                }
                if clip && j0 + bc > i0 + 1 {
                    causal_fill(st, brp, i0, j0, bc, f32::NEG_INFINITY);
                } else if p.causal && j0 + bc > i0 + 1 {
                    causal_add(st, brp, i0, j0, bc);
                }
                let stp = st.as_mut_ptr();
                let mtp = mt.as_ptr();
                // Pass 1: masks and the new running max (vertical over keys).
                for vi in 0..nvec {
                    let mut mx = S::splat(f32::NEG_INFINITY);
                    for j in 0..bc {
                        let ptr = stp.add(j * brp + vi * l);
                        let mut x = S::load(ptr);
                        if has_mask {
                            let m = match per_key {
                                true => S::splat(*mtp.add(j)),
                                false => S::load(mtp.add(j * brp + vi * l)),
                            };
                            x = S::add(x, m);
                            S::store(ptr, x);
                        }
                        mx = S::max(mx, x);
                    }
                    let mo = S::load(mrun.as_ptr().add(vi * l));
                    // f32::MIN, not -inf, as the reference of an all -inf row: exp(-inf - MIN)
                    // is 0 where exp(-inf - -inf) would be NaN.
                    let mn = S::max(S::splat(f32::MIN), S::max(mo, mx));
                    S::store(mrun.as_mut_ptr().add(vi * l), mn);
                    S::store(alpha.as_mut_ptr().add(vi * l), S::exp(S::sub(mo, mn)));
                }
                // Pass 2: P = exp(S - m), row sums, dropout.
                for vi in 0..nvec {
                    let r = S::load(mrun.as_ptr().add(vi * l));
                    let mut sum = S::splat(0.0);
                    for j in 0..bc {
                        let ptr = stp.add(j * brp + vi * l);
                        let mut e = S::exp(S::sub(S::load(ptr), r));
                        sum = S::add(sum, e);
                        if let Some(dr) = &dropout {
                            e = S::mul(e, dr.vector::<S>(vi * l, j0 + j));
                        }
                        S::store(ptr, e);
                    }
                    let lp = lrun.as_mut_ptr().add(vi * l);
                    let a = S::load(alpha.as_ptr().add(vi * l));
                    S::store(lp, S::fma(a, S::load(lp), sum));
                }
                // Rescale O where the max grew, then O += P V.
                if bf {
                    if !first {
                        rescale_lanes::<S>(ot, dv, alpha.as_ptr(), nvec);
                    }
                    let (vj, ld) = (vbase.add(j0 * self.vl.seq), self.vl.seq);
                    let (st, accumulate) = (st.as_ptr(), !first);
                    bf::values(
                        kern,
                        &Values { st, brp, bc, v: vj, ld, dv, ot, accumulate, vw, pw },
                    );
                    first = false;
                    j0 += step;
                    continue;
                }
                if !first {
                    for (i, &a) in alpha[..br].iter().enumerate() {
                        if a != 1.0 {
                            let row = o.as_mut_ptr().add(i * dv);
                            scale_row::<S>(row, row, dv, a);
                        }
                    }
                }
                S::gemm(&GemmArgs {
                    m: br,
                    n: dv,
                    k: bc,
                    a: st.as_ptr(),
                    rs_a: 1,
                    cs_a: brp,
                    b: vbase.add(j0 * self.vl.seq),
                    ldb: self.vl.seq,
                    c: o.as_mut_ptr(),
                    ldc: dv,
                    accumulate: !first,
                    // Query row r sees keys j0 + k' <= i0 + r only.
                    tri: diag.map_or(Tri::Full, Tri::KEnd),
                });
                first = false;
                j0 += step;
            }

            if bf && !first {
                // The output block back from channels × lanes to rows × channels.
                for i in 0..br {
                    for c in 0..dv {
                        o[i * dv + c] = *ot.add(c * bf::MAX_LANES + i);
                    }
                }
            }
            // Row statistics: the max and the log of the sum, kept apart so that a row whose max
            // is huge (a -1e9 or finfo.min mask over the whole row) keeps its precision.
            let rows = dm.batch * dm.heads_q * dm.l;
            let r0 = (b * dm.heads_q + h) * dm.l + i0;
            let max_row = self.lse.0.add(r0);
            let lse_row = self.lse.0.add(rows + r0);
            for i in 0..br {
                let dst = self.out.0.add(self.ol.offset(b, h, i0 + i));
                let sum = lrun[i];
                if first || (sum == 0.0 && finite) {
                    zero_row(dst, dv);
                    (*max_row.add(i), *lse_row.add(i)) = (0.0, f32::INFINITY);
                } else if sum == 0.0 {
                    // Fully masked row of a non-finite head: Σ 0·V, NaN where V is not finite.
                    scale_row::<S>(dst, o.as_ptr().add(i * dv), dv, 1.0);
                    (*max_row.add(i), *lse_row.add(i)) = (0.0, f32::INFINITY);
                } else {
                    scale_row::<S>(dst, o.as_ptr().add(i * dv), dv, 1.0 / sum);
                    (*max_row.add(i), *lse_row.add(i)) = (mrun[i], sum.ln());
                }
            }
        }
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
