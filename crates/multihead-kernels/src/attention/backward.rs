//! The flash-attention backward: one task per `(batch, kv head)`, which owns `dk`/`dv` of that
//! head and `dq` of its query heads, so no reduction crosses tasks.
//!
//! For each query head of the group and each query block `i` (outer), each key block `j`
//! (inner): recompute `Sᵀ = K_j·(scale·Q_i)ᵀ`, `P = exp(S + mask − max − ln Σ)`, `dPᵀ = V_j·dO_iᵀ`,
//! then `dS = P∘(m∘dP − D)`, `dV_j += (P∘m)ᵀ dO_i`, `dK_j += dSᵀ Q_i`, `dQ_i += dS K_j`
//! (five GEMMs). `dk`/`dv` accumulate in the output rows, `dq` in scratch; `scale` is applied
//! to `dk` and `dq` once at the end.

use super::exec::{round16, Carver, ConstPtr, SyncPtr, Task};
use super::gemm::{GemmArgs, Tri};
use super::mask::{build_mask_tile, causal_add, causal_fill, TilePos};
use super::simd::Simd;
use super::tile::{pack_transposed, scale_row, score_tile, zero_row, BlockDropout, MAX_BR};
use super::{AttnParams, Layout4};

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
}

impl<'a> BwdTask<'a> {
    /// The arguments were validated by `flash_backward`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        p: &'a AttnParams<'a>,
        q: &'a [f32],
        ql: Layout4,
        k: &'a [f32],
        kl: Layout4,
        v: &'a [f32],
        vl: Layout4,
        o: &'a [f32],
        ol: Layout4,
        dout: &'a [f32],
        dol: Layout4,
        lse: &'a [f32],
        dq: &'a mut [f32],
        dql: Layout4,
        dk: &'a mut [f32],
        dkl: Layout4,
        dv: &'a mut [f32],
        dvl: Layout4,
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
            lse: ConstPtr(lse.as_ptr()),
            dq: SyncPtr(dq.as_mut_ptr()),
            dql,
            dk: SyncPtr(dk.as_mut_ptr()),
            dkl,
            dv: SyncPtr(dv.as_mut_ptr()),
            dvl,
            br,
            bc,
            nq: p.dims.l.div_ceil(br),
            finite: &[],
        }
    }
}

impl Task for BwdTask<'_> {
    fn count(&self) -> usize {
        self.p.dims.batch * self.p.dims.heads_kv
    }

    fn scratch_len(&self, lanes: usize) -> usize {
        let d = &self.p.dims;
        let brp = self.br.div_ceil(lanes) * lanes;
        round16(d.d * brp)
            + round16(d.dv * brp)
            + 3 * round16(self.bc * brp)
            + round16(self.br * d.d)
            + 3 * round16(brp)
    }

    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, buf: &mut [f32]) {
        let p = self.p;
        let dm = &p.dims;
        let l = S::LANES;
        let (b, hk) = (t / dm.heads_kv, t % dm.heads_kv);
        let group = dm.heads_q / dm.heads_kv;
        let (d, dv, s) = (dm.d, dm.dv, dm.s);
        let has_mask = p.has_mask();
        let brp_max = self.br.div_ceil(l) * l;

        let mut cv = Carver::new(buf);
        let qt = cv.take(d * brp_max);
        let dot = cv.take(dv * brp_max);
        let st = cv.take(self.bc * brp_max);
        let dpt = cv.take(self.bc * brp_max);
        let mt = cv.take(if has_mask { self.bc * brp_max } else { 0 });
        let dqa = cv.take(self.br * d);
        let dvec = cv.take(brp_max);
        let lsev = cv.take(brp_max);
        let maxv = cv.take(brp_max);

        // SAFETY: every row pointer addresses a row validated by `flash_backward`; scratch
        // pieces are sized by `scratch_len`; this task alone writes `dk[b, hk]`, `dv[b, hk]`
        // and `dq[b, h]` for the query heads `h` of kv head `hk` (output layouts were checked
        // to be non-overlapping).
        unsafe {
            let kbase = self.k.0.add(self.kl.offset(b, hk, 0));
            let vbase = self.v.0.add(self.vl.offset(b, hk, 0));
            let dkbase = self.dk.0.add(self.dkl.offset(b, hk, 0));
            let dvbase = self.dv.0.add(self.dvl.offset(b, hk, 0));
            for j in 0..s {
                zero_row(dkbase.add(j * self.dkl.seq), d);
                zero_row(dvbase.add(j * self.dvl.seq), dv);
            }

            for h in hk * group..(hk + 1) * group {
                let bh = b * dm.heads_q + h;
                for qb in 0..self.nq {
                    let i0 = qb * self.br;
                    let br = self.br.min(dm.l - i0);
                    let brp = br.div_ceil(l) * l;
                    let nvec = brp / l;
                    let qrow = self.q.0.add(self.ql.offset(b, h, i0));
                    let dorow = self.dout.0.add(self.dol.offset(b, h, i0));
                    pack_transposed::<S>(qt, brp, qrow, self.ql.seq, br, d, p.scale);
                    pack_transposed::<S>(dot, brp, dorow, self.dol.seq, br, dv, 1.0);
                    let rows = dm.batch * dm.heads_q * dm.l;
                    let max_row = self.lse.0.add(bh * dm.l + i0);
                    let lse_row = self.lse.0.add(rows + bh * dm.l + i0);
                    for i in 0..brp {
                        if i < br {
                            let orow = self.o.0.add(self.ol.offset(b, h, i0 + i));
                            let drow = dorow.add(i * self.dol.seq);
                            dvec[i] = super::tile::dot::<S>(orow, drow, dv);
                            (maxv[i], lsev[i]) = (*max_row.add(i), *lse_row.add(i));
                        } else {
                            // Padding lanes: P = exp(x - inf) = 0, so they contribute nothing.
                            dvec[i] = 0.0;
                            (maxv[i], lsev[i]) = (0.0, f32::INFINITY);
                        }
                    }
                    let dropout =
                        p.active_dropout().map(|(pr, key)| BlockDropout::new(pr, key, bh, i0, br));

                    let finite = self.finite.get(b * dm.heads_q + h).copied().unwrap_or(true);
                    let clip = p.causal && finite;
                    let jend = if clip { s.min(i0 + br) } else { s };
                    let mut first = true;
                    let mut j0 = 0;
                    while j0 < jend {
                        let bc = self.bc.min(jend - j0);
                        let pos = TilePos { b, h, i0, br, brp, j0, bc };
                        if has_mask && !build_mask_tile::<S>(&p.masks, pos, mt) && finite {
                            j0 += bc;
                            continue;
                        }
                        let kj = kbase.add(j0 * self.kl.seq);
                        let vj = vbase.add(j0 * self.vl.seq);
                        let diag = clip.then_some(i0 as isize - j0 as isize);
                        let (stp, dpp) = (st.as_mut_ptr(), dpt.as_mut_ptr());
                        score_tile::<S>(kj, self.kl.seq, d, qt.as_ptr(), brp, stp, bc, diag);
                        score_tile::<S>(vj, self.vl.seq, dv, dot.as_ptr(), brp, dpp, bc, diag);
                        if p.causal && !clip && j0 + bc > i0 + 1 {
                            causal_add(st, brp, i0, j0, bc);
                        } else if p.causal && j0 + bc > i0 + 1 {
                            // Entries the banded products skipped: P = 0 there, and dP must be
                            // finite so that dS = P (dP - D) is exactly 0.
                            causal_fill(st, brp, i0, j0, bc, f32::NEG_INFINITY);
                            causal_fill(dpt, brp, i0, j0, bc, 0.0);
                        }
                        let mtp = mt.as_ptr();
                        for vi in 0..nvec {
                            let lv = S::load(lsev.as_ptr().add(vi * l));
                            let mv = S::load(maxv.as_ptr().add(vi * l));
                            let dd = S::load(dvec.as_ptr().add(vi * l));
                            for j in 0..bc {
                                let off = j * brp + vi * l;
                                let mut x = S::load(stp.add(off));
                                if has_mask {
                                    x = S::add(x, S::load(mtp.add(off)));
                                }
                                let pe = S::exp(S::sub(S::sub(x, mv), lv));
                                let dp = S::load(dpp.add(off));
                                let (pm, ds) = match &dropout {
                                    Some(dr) => {
                                        let m = dr.vector::<S>(vi * l, j0 + j);
                                        (S::mul(pe, m), S::mul(pe, S::sub(S::mul(m, dp), dd)))
                                    }
                                    None => (pe, S::mul(pe, S::sub(dp, dd))),
                                };
                                S::store(stp.add(off), pm);
                                S::store(dpp.add(off), ds);
                            }
                        }
                        // dV_j += (P∘m)ᵀ dO_i ; dK_j += dSᵀ Q_i (scaled at the end).
                        S::gemm(&GemmArgs {
                            m: bc,
                            n: dv,
                            k: br,
                            a: st.as_ptr(),
                            rs_a: brp,
                            cs_a: 1,
                            b: dorow,
                            ldb: self.dol.seq,
                            c: dvbase.add(j0 * self.dvl.seq),
                            ldc: self.dvl.seq,
                            accumulate: true,
                            // Key row r is seen by queries i0 + k' >= j0 + r only.
                            tri: diag.map_or(Tri::Full, |e| Tri::KStart(-e)),
                        });
                        S::gemm(&GemmArgs {
                            m: bc,
                            n: d,
                            k: br,
                            a: dpt.as_ptr(),
                            rs_a: brp,
                            cs_a: 1,
                            b: qrow,
                            ldb: self.ql.seq,
                            c: dkbase.add(j0 * self.dkl.seq),
                            ldc: self.dkl.seq,
                            accumulate: true,
                            tri: diag.map_or(Tri::Full, |e| Tri::KStart(-e)),
                        });
                        // dQ_i += dS K_j (scaled at the end).
                        S::gemm(&GemmArgs {
                            m: br,
                            n: d,
                            k: bc,
                            a: dpt.as_ptr(),
                            rs_a: 1,
                            cs_a: brp,
                            b: kj,
                            ldb: self.kl.seq,
                            c: dqa.as_mut_ptr(),
                            ldc: d,
                            accumulate: !first,
                            // Query row r sees keys j0 + k' <= i0 + r only.
                            tri: diag.map_or(Tri::Full, Tri::KEnd),
                        });
                        first = false;
                        j0 += bc;
                    }
                    for i in 0..br {
                        let dst = self.dq.0.add(self.dql.offset(b, h, i0 + i));
                        if first {
                            zero_row(dst, d);
                        } else {
                            scale_row::<S>(dst, dqa.as_ptr().add(i * d), d, p.scale);
                        }
                    }
                }
            }
            for j in 0..s {
                let row = dkbase.add(j * self.dkl.seq);
                scale_row::<S>(row, row, d, p.scale);
            }
        }
    }
}
