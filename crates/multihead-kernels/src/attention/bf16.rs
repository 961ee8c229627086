//! The forward's two products with bf16 operands ([`AttnParams::bf16_products`]), on the
//! micro-kernels of [`crate::bf16gemm`]: what PyTorch's CPU flash kernel does for bf16 inputs.
//!
//! - `Sᵀ = K_j · Q_iᵀ`: the key rows rounded to bf16 (pairs along the head dimension), the
//!   query block rounded once per task into a panel of pair words; the sums in f32, then the
//!   scale (after the product, as PyTorch applies it).
//! - `Oᵀ (+)= V_jᵀ · Pᵀ`: the probabilities rounded to bf16 (pairs of keys, interleaved from two
//!   rows of the score tile) and the value rows interleaved the same way; the output block is
//!   kept transposed (channels as rows, queries as lanes), so the online-softmax rescaling is
//!   one vector product per channel, and is transposed back once at the end.
//!
//! The row sums of the softmax stay f32 sums of the unrounded probabilities, as PyTorch's.
//!
//! The operands are laid out for the micro-kernel that runs ([`Shape`]): the `vdpbf16ps`
//! kernels read `A` as pairs through two strides, in blocks of 6 rows; the AMX tiles (and their
//! emulation) read row-major `A` pairs in blocks of 32 rows, and both operands' depth in whole
//! tile steps of 16 pairs (zero past the depth), so `Vᵀ` and `Kᵀ` are packed row-major
//! ([`pair_cols`]) for them.
//!
//! [`AttnParams::bf16_products`]: super::AttnParams::bf16_products

use super::simd::Simd;
use crate::bf16gemm::micro::{Kernel, Tile};
use crate::bf16gemm::pack::Operand;
use crate::bf16gemm::{MR, NR};

/// The widest query block the bf16 products take (one panel of pair words).
pub(crate) const MAX_LANES: usize = NR;

/// How a micro-kernel wants its operands: rows of `A` in blocks of `mr` (zero rows after the
/// last), the depth in pairs rounded up to a multiple of `kpa` (zero pairs after it), and
/// whether `A` must be row-major pairs (the tile kernels).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub mr: usize,
    pub kpa: usize,
    pub tiles: bool,
}

impl Shape {
    pub(crate) fn of(kern: Kernel) -> Self {
        Shape { mr: kern.mr(), kpa: kern.kp_align(), tiles: kern.tiles() }
    }
    /// `pairs` rounded up to the kernel's depth step.
    pub(crate) fn kp(self, pairs: usize) -> usize {
        pairs.div_ceil(self.kpa) * self.kpa
    }
    /// `rows` rounded up to the kernel's row block.
    pub(crate) fn rows(self, rows: usize) -> usize {
        rows.div_ceil(self.mr) * self.mr
    }
    /// Words of the `A` operand of a transposed product (`Vᵀ·Pᵀ`, `Kᵀ·dSᵀ`): `cols` channels
    /// over `rows` keys, as [`pair_rows`] (row-major by pair, `cols` rounded to `MR`) or, for
    /// the tiles, [`pair_cols`] (row-major by channel).
    pub(crate) fn transposed_words(self, rows: usize, cols: usize) -> usize {
        let kp = self.kp(rows.div_ceil(2));
        match self.tiles {
            true => self.rows(cols) * kp,
            false => kp * cols.div_ceil(MR) * MR,
        }
    }
}

/// Scratch sizes, in f32 units, of the bf16 products of one forward task on `kern`: the query
/// panel, the rounded key rows, the value and probability pair words and the transposed
/// output.
pub(crate) fn scratch(kern: Kernel, bc: usize, d: usize, dv: usize) -> [usize; 5] {
    let sh = Shape::of(kern);
    let (kpd, kpc, dvr) = (sh.kp(d.div_ceil(2)), sh.kp(bc.div_ceil(2)), dv.div_ceil(MR) * MR);
    [kpd * NR, sh.rows(bc) * kpd, sh.transposed_words(bc, dv), kpc * NR, dvr * NR]
}

/// `lo | hi << 16`.
#[inline(always)]
fn pair(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | (u32::from(hi) << 16)
}

/// Rounds query rows `i < br` (`d` floats each, `ld` apart) into the panel `qp` of `kp` pair
/// rows: word `(p, i)` holds elements `2p` (low half) and `2p + 1` (high half) of row `i`;
/// lanes `br..NR`, the element after an odd `d` and the pairs from `d.div_ceil(2)` to `kp` are
/// zero.
///
/// # Safety
/// `q + i·ld + c` is readable for `i < br`, `c < d`; `qp` holds `kp · NR` words, `kp` at
/// least `d.div_ceil(2)`; `br <= NR`.
pub(crate) unsafe fn pack_q<T: Operand>(
    q: *const T,
    ld: usize,
    br: usize,
    d: usize,
    (qp, kp): (*mut u32, usize),
) {
    #[cfg(target_arch = "x86_64")]
    if crate::bf16gemm::pack::vector_packing() {
        // SAFETY: the same words, by the AVX-512 column packer (row `i` is column `i` of the
        // panel, contiguous along the head dimension).
        return unsafe { T::column_panel(q, ld, br, d, (qp, kp)) };
    }
    // SAFETY: within the ranges the caller guarantees.
    unsafe {
        let pairs = d.div_ceil(2);
        std::ptr::write_bytes(qp.add(pairs * NR), 0, (kp - pairs) * NR);
        for p in 0..pairs {
            let out = qp.add(p * NR);
            for i in 0..NR {
                *out.add(i) = if i < br {
                    let row = q.add(i * ld);
                    let hi = if 2 * p + 1 < d { (*row.add(2 * p + 1)).bits() } else { 0 };
                    pair((*row.add(2 * p)).bits(), hi)
                } else {
                    0
                };
            }
        }
    }
}

/// The operands of one score tile.
pub(crate) struct Scores<T = f32> {
    /// `bc` key rows of `d` elements, `ld` apart.
    pub k: *const T,
    pub ld: usize,
    pub bc: usize,
    pub d: usize,
    /// The query panel of [`pack_q`].
    pub qp: *const u32,
    /// Multiplies the sums (1: left to the caller).
    pub scale: f32,
    /// Output `[bc][brp]` and its lanes (`brp <= NR`).
    pub st: *mut f32,
    pub brp: usize,
    /// Scratch for the rounded key rows ([`scratch`]).
    pub kb: *mut u16,
}

/// `Sᵀ[j][i] = scale · Σ_c bf16(K[j][c]) · bf16(Q[i][c])` for every `j < bc`, `i < brp`.
///
/// # Safety
/// The pointers in `s` are valid as its fields say; `kern` is available on this CPU.
pub(crate) unsafe fn scores<T: Operand>(kern: Kernel, s: &Scores<T>) {
    // SAFETY: forwarded.
    unsafe { scores_with(kern, s, true) }
}

/// [`scores`] with the key rows already rounded into `s.kb` (as `scores` rounds them:
/// [`prepack`](super::prepack)).
///
/// # Safety
/// As for [`scores`], and `s.kb` holds the rounded rows.
pub(crate) unsafe fn scores_packed<T: Operand>(kern: Kernel, s: &Scores<T>) {
    // SAFETY: forwarded.
    unsafe { scores_with(kern, s, false) }
}

unsafe fn scores_with<T: Operand>(kern: Kernel, s: &Scores<T>, pack: bool) {
    // SAFETY: forwarded; the AVX-512 entry is taken only where the packers may use AVX-512
    // (the AVX512-BF16 and AMX kernels, on a CPU with AVX-512F, BW and VL).
    unsafe {
        match kern {
            #[cfg(target_arch = "x86_64")]
            _ if kern.avx512_packing() => scores_avx512(kern, s, pack),
            _ => scores_impl(kern, s, pack),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn scores_avx512<T: Operand>(kern: Kernel, s: &Scores<T>, pack: bool) {
    // SAFETY: forwarded (compiled for AVX-512 so that the conversions vectorise).
    unsafe { scores_impl(kern, s, pack) }
}

#[inline(always)]
unsafe fn scores_impl<T: Operand>(kern: Kernel, s: &Scores<T>, pack: bool) {
    let sh = Shape::of(kern);
    let kpd = sh.kp(s.d.div_ceil(2));
    let dp = 2 * kpd;
    // SAFETY: rows `j < bc` of `k` are readable; `kb` holds `bc` rounded up to the kernel's
    // rows of `dp` elements; the query panel has `kpd` pair rows (`pack_q` with the same
    // shape); the product writes rows `< bc` and lanes `< brp` of `st`.
    unsafe {
        if pack {
            round_rows(s.k, s.ld, (s.bc, sh.mr), s.d, s.kb, dp);
        }
        product(kern, (s.kb, (dp, 2)), kpd, s.bc, s.qp, s.brp, (s.st, s.brp), false);
        // A scale of 1 changes no bits: the forward passes it where its softmax pass scales.
        if s.scale != 1.0 {
            for x in std::slice::from_raw_parts_mut(s.st, s.bc * s.brp) {
                *x *= s.scale;
            }
        }
    }
}

/// The operands of one `P·V` step.
pub(crate) struct Values<T = f32> {
    /// The probabilities `[bc][brp]` (keys as rows, queries as lanes).
    pub st: *const f32,
    pub brp: usize,
    pub bc: usize,
    /// `bc` value rows of `dv` elements, `ld` apart.
    pub v: *const T,
    pub ld: usize,
    pub dv: usize,
    /// The transposed output `[dv rounded up to MR][NR]`, added to when `accumulate`.
    pub ot: *mut f32,
    pub accumulate: bool,
    /// Scratch for the value and probability pair words ([`scratch`]).
    pub vw: *mut u32,
    pub pw: *mut u32,
    /// The keys `vw`'s value pairs were packed for (`bc`, or more where they are the first
    /// keys of a larger block: [`Prepacked::block`](super::prepack::Prepacked::block)).
    pub v_keys: usize,
    /// Whether `pw` holds the probabilities' pair words already ([`zero_pair_padding`] and
    /// the softmax pass wrote them), so that `st` is not read.
    pub p_packed: bool,
}

/// Zeroes what the probabilities' pair words `pw` (`kp` pair rows of [`NR`] words, as
/// [`pair_rows`] writes them for `bc` key rows and `brp` lanes) hold besides the pairs
/// themselves: the lanes from `brp` in the live pair rows, and the pair rows from
/// `bc.div_ceil(2)` to `kp`.
///
/// # Safety
/// `pw` holds `kp · NR` words; `brp <= NR`, `bc.div_ceil(2) <= kp`.
#[inline(always)]
pub(crate) unsafe fn zero_pair_padding(pw: *mut u32, bc: usize, brp: usize, kp: usize) {
    let live = bc.div_ceil(2);
    // SAFETY: within the `kp · NR` words the caller guarantees.
    unsafe {
        if brp < NR {
            for p in 0..live {
                std::ptr::write_bytes(pw.add(p * NR + brp), 0, NR - brp);
            }
        }
        std::ptr::write_bytes(pw.add(live * NR), 0, (kp - live) * NR);
    }
}

/// `Oᵀ[c][i] (+)= Σ_j bf16(V[j][c]) · bf16(P[i][j])` for `c < dv`, `i < NR` (lanes past `brp`
/// get 0).
///
/// # Safety
/// The pointers in `x` are valid as its fields say; `kern` is available on this CPU.
pub(crate) unsafe fn values<T: Operand>(kern: Kernel, x: &Values<T>) {
    // SAFETY: forwarded.
    unsafe { values_with(kern, x, true) }
}

/// [`values`] with the value pairs already in `x.vw` (as `values` packs them:
/// [`prepack`](super::prepack)).
///
/// # Safety
/// As for [`values`], and `x.vw` holds the packed pairs.
pub(crate) unsafe fn values_packed<T: Operand>(kern: Kernel, x: &Values<T>) {
    // SAFETY: forwarded.
    unsafe { values_with(kern, x, false) }
}

unsafe fn values_with<T: Operand>(kern: Kernel, x: &Values<T>, pack: bool) {
    // SAFETY: as for `scores`.
    unsafe {
        match kern {
            #[cfg(target_arch = "x86_64")]
            _ if kern.avx512_packing() => values_avx512(kern, x, pack),
            _ => values_impl(kern, x, pack),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn values_avx512<T: Operand>(kern: Kernel, x: &Values<T>, pack: bool) {
    // SAFETY: forwarded (compiled for AVX-512 so that the interleaving vectorises).
    unsafe { values_impl(kern, x, pack) }
}

#[inline(always)]
unsafe fn values_impl<T: Operand>(kern: Kernel, x: &Values<T>, pack: bool) {
    let sh = Shape::of(kern);
    let kpc = sh.kp(x.bc.div_ceil(2));
    // SAFETY: rows `< bc` of `st` and `v` are readable; `pw` holds `kpc · NR` words, `vw`
    // `sh.transposed_words(bc, dv)`, `ot` `dv` rounded up to `MR` rows of `NR` floats.
    unsafe {
        if !x.p_packed {
            pair_rows((x.st, x.brp), x.bc, x.brp, (x.pw, kpc), NR, true);
        }
        let a = match pack {
            true => transposed_a(sh, (x.v, x.ld), x.bc, x.dv, x.vw),
            false => (x.vw as *const u16, transposed_strides(sh, x.v_keys, x.dv)),
        };
        product(kern, a, kpc, x.dv, x.pw, NR, (x.ot, NR), x.accumulate);
    }
}

/// The strides of [`transposed_a`]'s operand for `rows` keys and `cols` channels.
fn transposed_strides(sh: Shape, rows: usize, cols: usize) -> (usize, usize) {
    match sh.tiles {
        true => (2 * sh.kp(rows.div_ceil(2)), 2),
        false => (2, 2 * cols.div_ceil(MR) * MR),
    }
}

/// Packs the `A` of a transposed product, `cols` channels over `rows` key rows (`ld` apart),
/// into `out` for `sh`'s kernel; returns it with its strides. The `vdpbf16ps` kernels take
/// [`pair_rows`]' words (row `r` of `A`, channel `r`, pair `p` at word `p · cols_r + r`), the
/// tiles [`pair_cols`]' (at word `r · kp + p`).
///
/// # Safety
/// `src + r·ld + c` is readable for `r < rows`, `c < cols`; `out` holds
/// `sh.transposed_words(rows, cols)` words.
#[inline(always)]
pub(crate) unsafe fn transposed_a<T: Operand>(
    sh: Shape,
    src: (*const T, usize),
    rows: usize,
    cols: usize,
    out: *mut u32,
) -> (*const u16, (usize, usize)) {
    let kp = sh.kp(rows.div_ceil(2));
    // SAFETY: forwarded; `out` is sized by `transposed_words` for either layout.
    unsafe {
        if sh.tiles {
            pair_cols(src, rows, cols, out, (kp, sh.rows(cols)));
        } else {
            pair_rows(src, rows, cols, (out, kp), cols.div_ceil(MR) * MR, false);
        }
    }
    (out as *const u16, transposed_strides(sh, rows, cols))
}

/// The `A` of a transposed product over the keys from pair `pair0` of words that
/// [`transposed_a`] packed for `rows` keys and `cols` channels (`out`): the pointer and strides
/// of that block of keys inside them.
///
/// # Safety
/// `out` holds [`transposed_a`]'s words for `(rows, cols)`; `pair0 < rows.div_ceil(2)`.
#[inline(always)]
pub(crate) unsafe fn transposed_at(
    sh: Shape,
    out: *const u32,
    (rows, cols): (usize, usize),
    pair0: usize,
) -> (*const u16, (usize, usize)) {
    let words = match sh.tiles {
        true => pair0,
        false => pair0 * cols.div_ceil(MR) * MR,
    };
    // SAFETY: inside the words the caller guarantees.
    (unsafe { out.add(words) } as *const u16, transposed_strides(sh, rows, cols))
}

/// The transposed pairs of `rows` rows of `cols` floats (`ld` apart), row-major by column:
/// word `(c, p)` at `out + c·kp + p` holds rows `2p` (low half) and `2p + 1` (high half) of
/// column `c` (zero past `rows`); columns `cols..nrows` are zero rows. The tile kernels' `A`.
///
/// # Safety
/// `src + r·ld + c` is readable for `r < rows`, `c < cols`; `out` holds `nrows · kp` words,
/// `kp >= rows.div_ceil(2)`, `nrows >= cols`.
#[inline(always)]
pub(crate) unsafe fn pair_cols<T: Operand>(
    (src, ld): (*const T, usize),
    rows: usize,
    cols: usize,
    out: *mut u32,
    (kp, nrows): (usize, usize),
) {
    #[cfg(target_arch = "x86_64")]
    if crate::bf16gemm::pack::vector_packing() {
        // SAFETY: the same words, by the AVX-512 transposing packer: column `c` is row `c` of
        // the output (bf16 rows of `2·kp`), its elements `ld` apart along the rows.
        return unsafe { T::transpose_rows(src, ld, (cols, nrows), rows, out as *mut u16, 2 * kp) };
    }
    let at = |r: usize, c: usize| {
        if r < rows {
            // SAFETY: `r < rows`, and `c < cols` at every call below.
            unsafe { *src.add(r * ld + c) }.bits()
        } else {
            0
        }
    };
    // SAFETY: within the ranges the caller guarantees.
    unsafe {
        for c in 0..nrows {
            let o = out.add(c * kp);
            if c >= cols {
                std::ptr::write_bytes(o, 0, kp);
                continue;
            }
            for p in 0..kp {
                *o.add(p) = pair(at(2 * p, c), at(2 * p + 1, c));
            }
        }
    }
}

/// Pair words of `rows` rows of `cols` floats (`ld` apart) as `kp` pair rows: word `(p, c)`
/// holds rows `2p` (low half) and `2p + 1` (high half, 0 past `rows`) of column `c`; columns
/// `cols..width` and pair rows from `rows.div_ceil(2)` to `kp` are zero. Row-major
/// (`out + p·width + c`, an `A` operand), or with `panels` as the `B` panels of [`product`]
/// (`NR` columns each: `out + (c / NR)·kp·NR + p·NR + c % NR`, `width` a multiple of `NR`).
///
/// # Safety
/// `src + r·ld + c` is readable for `r < rows`, `c < cols`; `out` holds `kp · width` words,
/// `kp >= rows.div_ceil(2)`; `cols <= width`.
#[inline(always)]
pub(crate) unsafe fn pair_rows<T: Operand>(
    (src, ld): (*const T, usize),
    rows: usize,
    cols: usize,
    (out, kp): (*mut u32, usize),
    width: usize,
    panels: bool,
) {
    let live = rows.div_ceil(2);
    // Runs of contiguous words: the whole row, or one run per panel.
    let run = if panels { NR } else { width };
    // SAFETY: within the ranges the caller guarantees.
    unsafe {
        for p in 0..kp {
            for c0 in (0..width).step_by(run) {
                let o = match panels {
                    true => out.add((c0 / NR) * kp * NR + p * NR),
                    false => out.add(p * width),
                };
                if p >= live {
                    std::ptr::write_bytes(o, 0, run);
                    continue;
                }
                let lo = src.add(2 * p * ld);
                let hi = (2 * p + 1 < rows).then(|| src.add((2 * p + 1) * ld));
                let n = cols.saturating_sub(c0).min(run);
                interleave(lo.add(c0), hi.map(|h| h.add(c0)), n, o);
                std::ptr::write_bytes(o.add(n), 0, run - n);
            }
        }
    }
}

/// `out[c] = bf16(lo[c]) | bf16(hi[c]) << 16` for `c < n` (the high half 0 without `hi`).
///
/// # Safety
/// `lo`, `hi` readable and `out` writable for `n` elements.
#[inline(always)]
unsafe fn interleave<T: Operand>(lo: *const T, hi: Option<*const T>, n: usize, out: *mut u32) {
    // SAFETY: within the `n` elements the caller guarantees.
    unsafe {
        match hi {
            Some(h) => {
                for c in 0..n {
                    *out.add(c) = pair((*lo.add(c)).bits(), (*h.add(c)).bits());
                }
            }
            None => {
                for c in 0..n {
                    *out.add(c) = u32::from((*lo.add(c)).bits());
                }
            }
        }
    }
}

/// `rows` rows of `cols` floats (`ld` apart) rounded to bf16 rows of `width` elements (`width`
/// even, at least `cols`, zero past `cols`), with zero rows up to a multiple of `mr`.
///
/// # Safety
/// `src + r·ld + c` is readable for `r < rows`, `c < cols`; `out` holds
/// `rows.div_ceil(mr) · mr · width` elements.
#[inline(always)]
pub(crate) unsafe fn round_rows<T: Operand>(
    src: *const T,
    ld: usize,
    (rows, mr): (usize, usize),
    cols: usize,
    out: *mut u16,
    width: usize,
) {
    // SAFETY: within the ranges the caller guarantees.
    unsafe {
        for r in 0..rows.div_ceil(mr) * mr {
            let o = out.add(r * width);
            if r < rows {
                let row = src.add(r * ld);
                for c in 0..cols {
                    *o.add(c) = (*row.add(c)).bits();
                }
                for c in cols..width {
                    *o.add(c) = 0;
                }
            } else {
                std::ptr::write_bytes(o, 0, width);
            }
        }
    }
}

/// `C[r][c] (+)= Σ_p A[r][p] · B[p][c]` for `r < rows`, `c < cols`: `A` pairs at
/// `a + r·rs + p·cs` (bf16 elements, `rows` rounded up to the kernel's rows readable, in its
/// layout: see [`Shape`]), `B` as `cols.div_ceil(NR)` panels of `kp · NR` pair words (`kp` a
/// multiple of the kernel's depth step), `C` f32 with row stride `ldc`.
///
/// # Safety
/// As the fields say; `kern` is available on this CPU.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn product(
    kern: Kernel,
    (a, strides): (*const u16, (usize, usize)),
    kp: usize,
    rows: usize,
    b: *const u32,
    cols: usize,
    (c, ldc): (*mut f32, usize),
    accumulate: bool,
) {
    // SAFETY: every tile lies inside the operands the caller describes; partial tiles go
    // through `edge`, which touches only their live part of `C`.
    unsafe {
        let mr = kern.mr();
        for q in 0..cols.div_ceil(NR) {
            let panel = b.add(q * kp * NR);
            let live_cols = NR.min(cols - q * NR);
            for r0 in (0..rows).step_by(mr) {
                let tile =
                    Tile { kp, a: a.add(r0 * strides.0), strides, b: panel, load_c: accumulate };
                let (live, cp) = (mr.min(rows - r0), c.add(r0 * ldc + q * NR));
                if live == mr && live_cols == NR {
                    tile.run(kern, cp, ldc);
                } else {
                    tile.edge(kern, cp, ldc, live, live_cols);
                }
            }
        }
    }
}

/// `Σ_c bf16(o_c) · bf16(g_c)` over `n` channels for `LANES` rows at once (channel `c` of the
/// rows at `o + c·ld` and `g + c·ld`), summed as the kernel `kern` sums one element of a
/// product of depth `n` (the backward's `dPᵀ = V_j · dO_iᵀ`): the same products in the same
/// order from the same start, with the kernel's treatment of subnormals. The backward's
/// `D = rowsum(O∘dO)` is this, so that a row whose softmax is one-hot (`O = V_j`) has
/// `dP_j - D = 0` exactly, as the f32 path has (see `block_stats`).
///
/// * The tiles (`tdpbf16ps`, and its emulation): per step of 16 pairs, the even channels'
///   products in one fused chain from `+0` and the odd ones' in another, each step flushed;
///   then `acc + (even + odd)`, each flushed; subnormal inputs read as zero
///   ([`crate::bf16gemm::amx`]'s model of the instruction).
/// * `vdpbf16ps`: per pair, `acc + odd` then `+ even`, each fused and flushed, subnormal
///   inputs read as zero.
/// * The portable kernel: per pair, `(acc + odd·odd) + even·even`, each product rounded, no
///   flushing.
///
/// Zero pairs pad the depth to the kernel's step, as its packed operands do.
///
/// # Safety
/// `S` is available; `o` and `g` are readable for `LANES` floats at each `c·ld`, `c < n`.
#[inline(always)]
pub(crate) unsafe fn lane_dots<S: Simd>(
    kern: Kernel,
    (o, g): (*const f32, *const f32),
    ld: usize,
    n: usize,
) -> S::V {
    let kp = Shape::of(kern).kp(n.div_ceil(2));
    // Channel `c` rounded to bf16 (zeros past `n`), and that with subnormals read as zero. Not
    // closures: those would not inherit the caller's target features.
    #[inline(always)]
    unsafe fn at<S: Simd>(x: *const f32, c: usize, (ld, n): (usize, usize)) -> S::V {
        // SAFETY: channels `c < n` are readable (the caller's contract); the others are zeros.
        unsafe {
            match c < n {
                true => S::round_bf16(S::load(x.add(c * ld))),
                false => S::splat(0.0),
            }
        }
    }
    #[inline(always)]
    unsafe fn flushed<S: Simd>(x: *const f32, c: usize, shape: (usize, usize)) -> S::V {
        // SAFETY: forwarded.
        unsafe { S::flush(at::<S>(x, c, shape)) }
    }
    let sh = (ld, n);
    // SAFETY: vector arithmetic on the caller's instruction set; reads as above.
    unsafe {
        let mut acc = S::splat(0.0);
        if kern.tiles() {
            use crate::bf16gemm::amx::AMX_KP;
            for s in 0..kp / AMX_KP {
                let (mut even, mut odd) = (S::splat(0.0), S::splat(0.0));
                for q in 0..AMX_KP {
                    let c = 2 * (s * AMX_KP + q);
                    let (oe, ge) = (flushed::<S>(o, c, sh), flushed::<S>(g, c, sh));
                    let (od, gd) = (flushed::<S>(o, c + 1, sh), flushed::<S>(g, c + 1, sh));
                    even = S::flush(S::fma_fused(oe, ge, even));
                    odd = S::flush(S::fma_fused(od, gd, odd));
                }
                acc = S::flush(S::add(S::flush(acc), S::flush(S::add(even, odd))));
            }
        } else if kern.flushes() {
            for p in 0..kp {
                let (e, d) = (2 * p, 2 * p + 1);
                let (od, gd) = (flushed::<S>(o, d, sh), flushed::<S>(g, d, sh));
                acc = S::flush(S::fma_fused(od, gd, S::flush(acc)));
                let (oe, ge) = (flushed::<S>(o, e, sh), flushed::<S>(g, e, sh));
                acc = S::flush(S::fma_fused(oe, ge, acc));
            }
        } else {
            for p in 0..kp {
                let (e, d) = (2 * p, 2 * p + 1);
                let odd = S::mul(at::<S>(o, d, sh), at::<S>(g, d, sh));
                acc = S::add(S::add(acc, odd), S::mul(at::<S>(o, e, sh), at::<S>(g, e, sh)));
            }
        }
        acc
    }
}
