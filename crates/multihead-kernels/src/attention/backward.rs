//! The flash-attention backward: one task per `(batch, kv head)`, which owns `dk`/`dv` of that
//! head and `dq` of its query heads, so no reduction crosses tasks.
//!
//! For each query head of the group and each query block `i` (outer), each key block `j`
//! (inner): recompute `Sᵀ = K_j·(scale·Q_i)ᵀ`, `P = exp(S + mask − max − ln Σ)`, `dPᵀ = V_j·dO_iᵀ`,
//! then `dS = P∘(m∘dP − D)`, `dV_j += (P∘m)ᵀ dO_i`, `dK_j += dSᵀ Q_i`, `dQ_i += dS K_j`
//! (five GEMMs). `dk`/`dv` accumulate in the output rows, `dq` in scratch; `scale` is applied
//! to `dk` and `dq` once at the end.

use super::bf16::{self as bf, Scores};
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
    /// The bf16 micro-kernel of `AttnParams::bf16_products`, chosen on the calling thread (a
    /// worker does not see the caller's forced SIMD level).
    pub(crate) kern: crate::bf16gemm::micro::Kernel,
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
            kern: crate::bf16gemm::micro::kernel(),
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
        let bf16: usize = if self.p.bf16_products {
            BwdBf16::sizes(self.br, self.bc, d.d, d.dv).iter().map(|&n| round16(n)).sum()
        } else {
            0
        };
        round16(d.d * brp)
            + round16(d.dv * brp)
            + 3 * round16(self.bc * brp)
            + round16(self.br * d.d)
            + 3 * round16(brp)
            + bf16
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
        // The bf16 products' buffers (null without them); a query block fits one panel.
        let bf = p.bf16_products && brp_max <= bf::MAX_LANES;
        let kern = self.kern;
        let bb = match bf {
            true => {
                let sizes = BwdBf16::sizes(self.br, self.bc, d, dv);
                BwdBf16::carve(sizes.map(|n| cv.take(n).as_mut_ptr()))
            }
            false => BwdBf16::carve([std::ptr::null_mut(); 9]),
        };

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
                    if bf {
                        bb.start_block(qrow, self.ql.seq, dorow, self.dol.seq, br, d, dv);
                    } else {
                        pack_transposed::<S>(qt, brp, qrow, self.ql.seq, br, d, p.scale);
                        pack_transposed::<S>(dot, brp, dorow, self.dol.seq, br, dv, 1.0);
                    }
                    let rows = dm.batch * dm.heads_q * dm.l;
                    let max_row = self.lse.0.add(bh * dm.l + i0);
                    let lse_row = self.lse.0.add(rows + bh * dm.l + i0);
                    for i in 0..brp {
                        if i < br {
                            let orow = self.o.0.add(self.ol.offset(b, h, i0 + i));
                            let drow = dorow.add(i * self.dol.seq);
                            dvec[i] = if bf {
                                // D from the rounded dO (and O), as dP gets it: the sum
                                // Σ_j P_j (dP_j - D) then stays 0, as PyTorch's bf16 kernel has it.
                                bf::dot_rounded(orow, drow, dv)
                            } else {
                                super::tile::dot::<S>(orow, drow, dv)
                            };
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
                        if bf {
                            let (kl, vl) = (self.kl.seq, self.vl.seq);
                            bb.scores(
                                kern,
                                (kj, kl),
                                (vj, vl),
                                bc,
                                (d, dv),
                                p.scale,
                                (stp, dpp),
                                brp,
                            );
                        } else {
                            score_tile::<S>(kj, self.kl.seq, d, qt.as_ptr(), brp, stp, bc, diag);
                            score_tile::<S>(vj, self.vl.seq, dv, dot.as_ptr(), brp, dpp, bc, diag);
                        }
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
                        if bf {
                            let dvj = (dvbase.add(j0 * self.dvl.seq), self.dvl.seq);
                            let dkj = (dkbase.add(j0 * self.dkl.seq), self.dkl.seq);
                            let grads = BlockGrads { dvj, dkj, kj: (kj, self.kl.seq), first };
                            bb.grads(kern, (stp, dpp), brp, (br, bc), (d, dv), grads);
                            first = false;
                            j0 += bc;
                            continue;
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
                    if bf && !first {
                        // dQ back from channels × lanes to rows × channels.
                        for i in 0..br {
                            for c in 0..d {
                                dqa[i * d + c] = *bb.dqt.add(c * bf::MAX_LANES + i);
                            }
                        }
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

/// The output-gradient rows of one key block and whether it is the query block's first.
struct BlockGrads {
    /// `dV_j` and `dK_j` rows (accumulated into) and their row strides.
    dvj: (*mut f32, usize),
    dkj: (*mut f32, usize),
    /// `K_j` rows and their stride.
    kj: (*const f32, usize),
    first: bool,
}

/// The backward's bf16 products (`AttnParams::bf16_products`): the scratch of one task and the
/// five products of a tile, each with bf16 operands and f32 sums.
struct BwdBf16 {
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
    dqt: *mut f32,
}

impl BwdBf16 {
    /// Scratch sizes in f32 units: panels, rounded rows, words and `dQᵀ`.
    fn sizes(br: usize, bc: usize, d: usize, dv: usize) -> [usize; 9] {
        use crate::bf16gemm::{MR, NR};
        let (bcr, kpr, kpc) = (bc.div_ceil(MR) * MR, br.div_ceil(2), bc.div_ceil(2));
        let width = |n: usize| n.div_ceil(2) * 2;
        [
            (d.div_ceil(2) + dv.div_ceil(2)) * NR,
            bcr * width(d.max(dv)) / 2 + 1,
            bcr * width(NR) / 2,
            bcr * width(NR) / 2,
            kpr * dv.div_ceil(NR) * NR,
            kpr * d.div_ceil(NR) * NR,
            kpc * d.div_ceil(MR) * MR,
            kpc * NR,
            d.div_ceil(MR) * MR * NR,
        ]
    }

    /// The buffers from carved scratch pointers (in the order of `sizes`).
    fn carve(p: [*mut f32; 9]) -> Self {
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
        }
    }

    /// Packs a query block: the `q` and `dO` panels and pair words.
    ///
    /// # Safety
    /// `q`/`dout` rows `< br` readable (`d`/`dv` floats each); buffers sized by `sizes`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn start_block(
        &self,
        q: *const f32,
        ql: usize,
        dout: *const f32,
        dl: usize,
        br: usize,
        d: usize,
        dv: usize,
    ) {
        use crate::bf16gemm::NR;
        // SAFETY: within the buffers `sizes` describes and the rows the caller guarantees.
        unsafe {
            let dop = self.qp.add(d.div_ceil(2) * NR);
            bf::pack_q(q, ql, br, d, self.qp);
            bf::pack_q(dout, dl, br, dv, dop);
            bf::pair_rows((dout, dl), br, dv, self.dow, dv.div_ceil(NR) * NR, true);
            bf::pair_rows((q, ql), br, d, self.qw, d.div_ceil(NR) * NR, true);
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
        bc: usize,
        (d, dv): (usize, usize),
        scale: f32,
        (st, dpt): (*mut f32, *mut f32),
        brp: usize,
    ) {
        use crate::bf16gemm::NR;
        // SAFETY: forwarded; the panels were packed by `start_block`.
        unsafe {
            let dop = self.qp.add(d.div_ceil(2) * NR) as *const u32;
            let kb = self.kb;
            bf::scores(kern, &Scores { k, ld: kl, bc, d, qp: self.qp, scale, st, brp, kb });
            let (ld, qp, scale, st) = (vl, dop, 1.0, dpt);
            bf::scores(kern, &Scores { k: v, ld, bc, d: dv, qp, scale, st, brp, kb });
        }
    }

    /// `dV_j += (P∘m)ᵀ dO_i`, `dK_j += dSᵀ Q_i` (scaled later), `dQᵀ (+)= K_jᵀ dSᵀ`.
    ///
    /// # Safety
    /// `st`/`dpt` hold the tile's `P∘m` and `dS` (`bc · brp`); the rows in `g` are valid.
    #[inline(always)]
    unsafe fn grads(
        &self,
        kern: crate::bf16gemm::micro::Kernel,
        (st, dpt): (*const f32, *const f32),
        brp: usize,
        (br, bc): (usize, usize),
        (d, dv): (usize, usize),
        g: BlockGrads,
    ) {
        use crate::bf16gemm::{MR, NR};
        let (kpr, kpc) = (br.div_ceil(2), bc.div_ceil(2));
        let width = brp.div_ceil(2) * 2;
        let dr = d.div_ceil(MR) * MR;
        // SAFETY: every buffer is sized by `sizes`; the products stay inside the rows the
        // caller guarantees (`product` clips partial tiles).
        unsafe {
            bf::round_rows(st, brp, bc, br, self.pa, width);
            bf::round_rows(dpt, brp, bc, br, self.dsa, width);
            bf::product(kern, (self.pa, (width, 2)), kpr, bc, self.dow, dv, g.dvj, true);
            bf::product(kern, (self.dsa, (width, 2)), kpr, bc, self.qw, d, g.dkj, true);
            bf::pair_rows(g.kj, bc, d, self.kw, dr, false);
            bf::pair_rows((dpt, brp), bc, brp, self.dsw, NR, true);
            let a = (self.kw as *const u16, (2, 2 * dr));
            bf::product(kern, a, kpc, d, self.dsw, NR, (self.dqt, NR), !g.first);
        }
    }
}
