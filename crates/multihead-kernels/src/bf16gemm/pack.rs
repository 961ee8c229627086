//! Packing: a block of `A` rounded into a bf16 row-major buffer, and a block of `B` into
//! [`NR`]-wide panels of `k` pairs, zero-padded to whole pairs, rows and panels.

use super::micro::Kernel;
use super::{BfMat, Elems, MR, NR};
use crate::convert::f32_to_bf16_bits;

/// Elements that can be read as bf16 bits (f32 rounded to nearest even, or bf16 as it is).
pub(crate) trait Bits: Copy {
    /// Element `i` as bf16 bits.
    ///
    /// # Safety
    /// `p + i` is readable.
    unsafe fn at(p: *const Self, i: usize) -> u16;
}

impl Bits for f32 {
    #[inline(always)]
    unsafe fn at(p: *const f32, i: usize) -> u16 {
        // SAFETY: forwarded.
        f32_to_bf16_bits(unsafe { *p.add(i) })
    }
}

impl Bits for u16 {
    #[inline(always)]
    unsafe fn at(p: *const u16, i: usize) -> u16 {
        // SAFETY: forwarded.
        unsafe { *p.add(i) }
    }
}

/// A block of `A` to round: rows `i0..i0+rows` (zero rows up to `padded`), columns
/// `p0..p0+kc` (zero columns up to `lda`, which is even and at least `kc`).
#[derive(Clone, Copy)]
pub(super) struct ABlock {
    pub i0: usize,
    pub rows: usize,
    pub padded: usize,
    pub p0: usize,
    pub kc: usize,
    pub lda: usize,
}

/// The block `blk` of `a` rounded to bf16 in `dst`, compiled for AVX-512 when `kern` is the
/// AVX512-BF16 kernel (the rounding loop then vectorises: a tenth of the product's time
/// otherwise). Returns the strides `(rs, cs)` (in bf16 elements) the micro-kernel reads pair
/// `p` of row `r` of the tile at `ir · lda` with: rows of `lda` elements `(lda, 2)` for most
/// layouts, micro-panels `(2, 2·MR)` for a transposed `A` (see `pack_a_panels`).
///
/// # Safety
/// The block lies inside `a` (checked by `matmul_bf16`); `dst` holds `padded · lda` elements;
/// `kern` is available on this CPU.
pub(super) unsafe fn pack_a(kern: Kernel, a: &BfMat, blk: ABlock, dst: *mut u16) -> (usize, usize) {
    // SAFETY: forwarded; the AVX-512 packers are chosen only where the CPU has AVX-512F and
    // BW (`avx512_packing`).
    unsafe {
        match (kern.tiles(), kern.avx512_packing()) {
            #[cfg(target_arch = "x86_64")]
            (true, true) => pack_a_rows_avx512(a, blk, dst),
            (true, false) => pack_a_any(a, blk, dst, false),
            #[cfg(target_arch = "x86_64")]
            (false, true) => pack_a_avx512(a, blk, dst),
            _ => pack_a_any(a, blk, dst, true),
        }
    }
}

/// Row-major packing (the AMX layout) on AVX-512: a row-major `A` (the input of `x·Wᵀ`, the
/// gradient of `dy·W`) rounded 16 elements at a time, a transposed one through
/// `panels_avx512::pack_rows`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a_rows_avx512(a: &BfMat, blk: ABlock, dst: *mut u16) -> (usize, usize) {
    // SAFETY: forwarded; a transposed `A` (the `dyᵀ` of a weight gradient) is read along its
    // contiguous runs and transposed into rows, as `panels_avx512::pack_rows` requires.
    unsafe {
        if a.col_stride != 1 && a.row_stride == 1 {
            match a.data {
                Elems::F32(x) => panels_avx512::pack_rows(x.as_ptr(), a.col_stride, blk, dst),
                Elems::Bf16(x) => panels_avx512::pack_rows(x.as_ptr(), a.col_stride, blk, dst),
            }
            return (blk.lda, 2);
        }
        if a.col_stride == 1 {
            match a.data {
                Elems::F32(x) => panels_avx512::round_rows(x.as_ptr(), a.row_stride, blk, dst),
                Elems::Bf16(x) => panels_avx512::round_rows(x.as_ptr(), a.row_stride, blk, dst),
            }
            return (blk.lda, 2);
        }
        pack_a_any(a, blk, dst, false)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a_avx512(a: &BfMat, blk: ABlock, dst: *mut u16) -> (usize, usize) {
    let cs = a.col_stride;
    // SAFETY: forwarded; the transposed layout is the one `pack_a_panels` takes.
    unsafe {
        if cs != 1 && a.row_stride == 1 && blk.padded <= panels_avx512::MAX_ROWS {
            match a.data {
                Elems::F32(x) => panels_avx512::pack(x.as_ptr(), cs, blk, dst),
                Elems::Bf16(x) => panels_avx512::pack(x.as_ptr(), cs, blk, dst),
            }
            return (2, 2 * MR);
        }
        pack_a_any(a, blk, dst, true)
    }
}

/// Whether every row block of `A` is packed at once pair by pair ([`pack_a_by_pairs`]) where
/// the driver rounds `A` once for all column blocks: a transposed `A` (the `dyᵀ` of a weight
/// gradient) for the `vdpbf16ps`-layout kernel on AVX-512.
pub(super) fn packs_by_pairs(kern: Kernel, a: &BfMat) -> bool {
    cfg!(target_arch = "x86_64")
        && !kern.tiles()
        && kern.avx512_packing()
        && a.row_stride == 1
        && a.col_stride != 1
}

/// Pairs `pairs` of every row of a transposed `A` (`packs_by_pairs`) in the micro-panels of
/// [`pack_a_panels`], the whole depth: tile `g` (rows `g·MR..`) at `g · MR · lda`, which is
/// where each row block of `mc` rows (a multiple of `MR`) puts its tiles at `rb · mc · lda`;
/// rows past `A`'s padded to the last tile with zeros, a missing last element of an odd depth
/// and pairs past the depth (an `lda` wider than it) zero. The words of packing each row block on its own, bit for bit; but a call reads its
/// source rows (rows of `dy`: every feature of one token) whole, each from its start to its
/// end 48 features at a time, and writes each tile's pairs `pairs` as one run, where a row
/// block reads a run of its `mc` features from every row of the depth, each run in its own
/// page and too short for the prefetchers to follow. On AVX512-BF16 (AMD family 26 model 2,
/// Zen 5, 2 threads; `ONLY=dw` of the `bf16gemm` example, six alternating runs in a slow
/// spell of the VM) the packing's share of the weight gradient went 19% -> 16% for
/// `Linear(512, 2048)` (a 16 MiB `dyᵀ`) and 9% -> 4% for `Linear(2048, 512)`; the minima
/// 16.07 -> 15.23 and 14.81 -> 13.64 ms, faster in 9 of 12 pairs.
///
/// # Safety
/// `packs_by_pairs(kern, a)` for the kernel packing; `lda` is even, at least `a.cols` and
/// `pairs.end <= lda / 2`; `dst` holds `a.rows.div_ceil(MR) · MR · lda` elements, of which this
/// call writes the pairs `pairs` of every tile.
pub(super) unsafe fn pack_a_by_pairs(
    a: &BfMat,
    lda: usize,
    pairs: std::ops::Range<usize>,
    dst: *mut u16,
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded; `packs_by_pairs` held, so the CPU has AVX-512F, BW and VL and `A`
    // is transposed (`row_stride == 1`).
    unsafe {
        let (m, k, cs) = (a.rows, a.cols, a.col_stride);
        match a.data {
            Elems::F32(x) => panels_avx512::by_pairs(x.as_ptr(), cs, (m, k, lda), pairs, dst),
            Elems::Bf16(x) => panels_avx512::by_pairs(x.as_ptr(), cs, (m, k, lda), pairs, dst),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (a, lda, pairs, dst);
}

/// `panels`: whether a transposed `A` may be packed as micro-panels (not for the AMX layout).
#[inline(always)]
unsafe fn pack_a_any(a: &BfMat, blk: ABlock, dst: *mut u16, panels: bool) -> (usize, usize) {
    // SAFETY: forwarded to the typed packer with the same block.
    unsafe {
        match a.data {
            Elems::F32(x) => pack_a_typed(x.as_ptr(), a, blk, dst, panels),
            Elems::Bf16(x) => pack_a_typed(x.as_ptr(), a, blk, dst, panels),
        }
    }
}

#[inline(always)]
unsafe fn pack_a_typed<T: Bits>(
    src: *const T,
    a: &BfMat,
    blk: ABlock,
    dst: *mut u16,
    panels: bool,
) -> (usize, usize) {
    let ABlock { i0, rows, padded, p0, kc, lda } = blk;
    let (rs, cs) = (a.row_stride, a.col_stride);
    // SAFETY: offsets `(i0+i)·rs + (p0+p)·cs` with `i < rows`, `p < kc` are inside `a`; the
    // destination offsets are below `padded · lda`.
    unsafe {
        if panels && cs != 1 && rs == 1 {
            pack_a_panels(src, cs, blk, dst);
            return (2, 2 * MR);
        }
        for i in 0..padded {
            let out = dst.add(i * lda);
            if i >= rows {
                std::ptr::write_bytes(out, 0, lda);
                continue;
            }
            let row = src.add((i0 + i) * rs + p0 * cs);
            if cs == 1 {
                for p in 0..kc {
                    *out.add(p) = T::at(row, p);
                }
            } else {
                for p in 0..kc {
                    *out.add(p) = T::at(row, p * cs);
                }
            }
            for p in kc..lda {
                *out.add(p) = 0;
            }
        }
    }
    (lda, 2)
}

/// A transposed block of `A` (rows contiguous along `i`, `cs` apart along `k`: the `dyᵀ` of a
/// weight gradient) packed as micro-panels: for each tile of [`MR`] rows (at `tile · MR · lda`
/// elements), pair `p` of its rows `0..MR` side by side, `2·MR` elements per pair. Each read
/// takes a run of the source's rows; packing it row by row instead touches a new cache line
/// per element (measured: a tenth of bf16 encoder-layer training on a Zen 4).
///
/// # Safety
/// As for `pack_a_typed`, with `a.row_stride == 1` and `cs == a.col_stride`.
#[inline(always)]
unsafe fn pack_a_panels<T: Bits>(src: *const T, cs: usize, blk: ABlock, dst: *mut u16) {
    let ABlock { i0, rows, padded, p0, kc, lda } = blk;
    let kp = lda / 2;
    // SAFETY: source offsets `i0 + i + (p0 + p)·cs` with `i < rows`, `p < kc` are inside `a`;
    // destination offsets `tile·MR·lda + q·2·MR + 2r + h` are below `padded · lda`.
    unsafe {
        let tiles = padded / MR;
        for q in 0..kp {
            for h in 0..2 {
                let p = 2 * q + h;
                let out = dst.add(q * 2 * MR + h);
                if p >= kc {
                    for i in 0..padded {
                        *out.add((i / MR) * MR * lda + 2 * (i % MR)) = 0;
                    }
                    continue;
                }
                let line = src.add(i0 + (p0 + p) * cs);
                // Prefetch the run 16 rows (eight pairs) ahead: the prefetchers do not follow
                // short runs `cs` apart.
                #[cfg(target_arch = "x86_64")]
                if p + 16 < kc {
                    let ahead = line.add(16 * cs) as *const i8;
                    for off in (0..rows * std::mem::size_of::<T>()).step_by(64) {
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                            ahead.add(off),
                        );
                    }
                }
                for tile in 0..tiles {
                    let o = out.add(tile * MR * lda);
                    let first = tile * MR;
                    if first + MR <= rows {
                        for r in 0..MR {
                            *o.add(2 * r) = T::at(line, first + r);
                        }
                    } else {
                        for r in 0..MR {
                            let i = first + r;
                            *o.add(2 * r) = if i < rows { T::at(line, i) } else { 0 };
                        }
                    }
                }
            }
        }
    }
}

/// `pack_a_panels` on AVX-512: the same bits, sixteen rows of a pair at a time.
///
/// The scalar packer rounds one element per step and stores it alone (about 1.4 ns per
/// element on an AMD Zen 4: a fifth of the weight-gradient products of bf16 training, whose
/// `dyᵀ` it packs). Here each pair `q` reads sixteen rows of source rows `2q` and `2q + 1` as
/// vectors, rounds them with the integer arithmetic of `f32_to_bf16_bits`, joins them into
/// 32-bit pair words and copies each tile's six words into place.
#[cfg(target_arch = "x86_64")]
mod panels_avx512 {
    use std::arch::x86_64::*;

    use super::{ABlock, BBlock, MR, NR};

    /// Most rows of a block (the driver's row blocks are at most this tall; taller ones take
    /// the scalar packer).
    pub(super) const MAX_ROWS: usize = 16 * MR;

    /// Sources whose sixteen consecutive elements load as bf16 bits in 32-bit lanes.
    pub(crate) trait Lanes: Copy {
        /// Elements `0..16` at `p` under `mask` (zero elsewhere), as bf16 bits in the low half
        /// of each 32-bit lane.
        ///
        /// # Safety
        /// AVX-512F, BW and VL are available; the masked elements are readable.
        unsafe fn bits16(p: *const Self, mask: __mmask16) -> __m512i;

        /// Elements `0..16` at `p` under `mask` (zero elsewhere) as 16 bf16 bits.
        ///
        /// # Safety
        /// As for [`Lanes::bits16`].
        #[inline(always)]
        unsafe fn halves16(p: *const Self, mask: __mmask16) -> __m256i {
            // SAFETY: forwarded.
            unsafe { _mm512_cvtepi32_epi16(Self::bits16(p, mask)) }
        }

        /// Up to 32 consecutive elements at `p` (the first `n`; zeros after) as 16 pair
        /// words: word `q` holds elements `2q` (low half) and `2q + 1`.
        ///
        /// # Safety
        /// As for [`Lanes::bits16`], for elements `0..n`.
        #[inline(always)]
        unsafe fn words16(p: *const Self, n: usize) -> __m512i {
            let mask = |m: usize| if m >= 16 { 0xFFFF } else { (1u16 << m) - 1 };
            // SAFETY: masked lanes are not read (the second pointer may lie past the data,
            // then with an empty mask).
            unsafe {
                let lo = Self::halves16(p, mask(n.min(16)));
                let hi = Self::halves16(p.wrapping_add(16), mask(n.saturating_sub(16)));
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
            }
        }
    }

    impl Lanes for f32 {
        #[inline(always)]
        unsafe fn bits16(p: *const f32, mask: __mmask16) -> __m512i {
            // SAFETY: forwarded; masked lanes are not read.
            unsafe { crate::convert::round16(_mm512_maskz_loadu_ps(mask, p)) }
        }
    }

    /// bf16 bits are loaded as they lie: a run of 32 is already 16 pair words, and 16 are
    /// already a row's bits (one masked load where widening and narrowing again took five
    /// instructions).
    impl Lanes for u16 {
        #[inline(always)]
        unsafe fn bits16(p: *const u16, mask: __mmask16) -> __m512i {
            // SAFETY: forwarded; masked lanes are not read.
            unsafe { _mm512_cvtepu16_epi32(Self::halves16(p, mask)) }
        }

        #[inline(always)]
        unsafe fn halves16(p: *const u16, mask: __mmask16) -> __m256i {
            // SAFETY: forwarded; masked lanes are not read.
            unsafe { _mm256_maskz_loadu_epi16(mask, p as *const i16) }
        }

        #[inline(always)]
        unsafe fn words16(p: *const u16, n: usize) -> __m512i {
            let mask: __mmask32 = if n >= 32 { u32::MAX } else { (1u32 << n) - 1 };
            // SAFETY: forwarded; masked lanes are not read.
            unsafe { _mm512_maskz_loadu_epi16(mask, p as *const i16) }
        }
    }

    /// Asks for the cache lines of elements `from..to` of the run at `p` (into L1); nothing
    /// where the range is empty. The lines' addresses are only named (wrapping arithmetic, and
    /// a prefetch reads nothing the program sees), so they may lie outside the run.
    #[inline(always)]
    fn prefetch_run<T>(p: *const T, from: usize, to: usize) {
        if from >= to {
            return;
        }
        let start = p.wrapping_add(from) as *const i8;
        let skew = start as usize % 64;
        for off in (0..(to - from) * std::mem::size_of::<T>() + skew).step_by(64) {
            // SAFETY: a prefetch has no effect the program can observe, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_sub(skew).wrapping_add(off)) };
        }
    }

    /// How many pairs of rows ahead [`pack_rows_b`] prefetches.
    const PREFETCH_PAIRS: usize = 4;

    /// `pack_rows_typed` (a row-major `B`, pairs `pairs`), bit for bit: each pair of rows read
    /// 16 columns at a time, in memory order, rounded and interleaved into pair words.
    ///
    /// # Safety
    /// As for `pack_b_rows`; the CPU has AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pack_rows_b<T: Lanes>(
        src: *const T,
        rs: usize,
        blk: &super::BBlock,
        pairs: std::ops::Range<usize>,
        dst: *mut u32,
    ) {
        let super::BBlock { p0, kc, kp, j0, cols, ref panels } = *blk;
        let live_pairs = kc.div_ceil(2);
        // The panels' columns of a row (the prefetch below).
        let first = panels.start * NR;
        let span = cols.min(panels.end * NR).saturating_sub(first);
        // SAFETY: the masks stop at the block's `cols` columns, and rows `p0 + 2p (+ 1)` are
        // below `p0 + kc` (both inside `b`); a masked-out lane is not read, and its address is
        // only formed (`wrapping_add`); word `(p, j)` of panel `q` is inside the panels. The
        // prefetched rows are below `p0 + kc`, their runs start inside the block's columns
        // (the cache lines around them are only named, with wrapping arithmetic: a prefetch
        // reads nothing the program sees).
        unsafe {
            let start = pairs.start;
            for p in pairs {
                let row = (p < live_pairs).then(|| src.add((p0 + 2 * p) * rs + j0));
                let hi_row = row.filter(|_| 2 * p + 1 < kc).map(|r| r.add(rs));
                // The rows PREFETCH_PAIRS pairs ahead (at a task's first pair, those up to
                // there too): the loads of a row's run wait on the cache otherwise (`perf`:
                // most of this packer's samples sat on them).
                let from = if p == start { 2 * p + 2 } else { 2 * (p + PREFETCH_PAIRS) };
                for r in from..(2 * (p + PREFETCH_PAIRS) + 2).min(kc) {
                    prefetch_run(src.add((p0 + r) * rs + j0), first, first + span);
                }
                for q in panels.clone() {
                    let out = dst.add(q * kp * NR + p * NR);
                    for c in (0..NR).step_by(16) {
                        let live = cols.saturating_sub(q * NR + c).min(16);
                        let mask = if live == 16 { 0xFFFF } else { (1u16 << live) - 1 };
                        let at = |r: *const T| r.wrapping_add(q * NR + c);
                        let l = match row {
                            Some(r) => T::bits16(at(r), mask),
                            None => _mm512_setzero_si512(),
                        };
                        let h = match hi_row {
                            Some(r) => T::bits16(at(r), mask),
                            None => _mm512_setzero_si512(),
                        };
                        let w = _mm512_or_si512(l, _mm512_slli_epi32::<16>(h));
                        _mm512_storeu_si512(out.add(c) as *mut __m512i, w);
                    }
                }
            }
        }
    }

    /// The pair words of elements `r..r + 16` of two source rows (`lo` in the low halves, `hi`
    /// in the high ones, zero where `hi` is `None`): the first `live` of them (at most 16), zero
    /// words after.
    ///
    /// # Safety
    /// AVX-512F, BW and VL are available; elements `r..r + min(live, 16)` of `lo` (and `hi`)
    /// are readable (no pointer past them is dereferenced: an empty mask reads nothing).
    #[inline(always)]
    unsafe fn pair_words16<T: Lanes>(
        lo: *const T,
        hi: Option<*const T>,
        r: usize,
        live: usize,
    ) -> __m512i {
        let mask = if live >= 16 { 0xFFFF } else { (1u16 << live) - 1 };
        // SAFETY: forwarded; masked lanes are not read.
        unsafe {
            let l = T::bits16(lo.wrapping_add(r), mask);
            let h = match hi {
                Some(hp) => T::bits16(hp.wrapping_add(r), mask),
                None => _mm512_setzero_si512(),
            };
            _mm512_or_si512(l, _mm512_slli_epi32::<16>(h))
        }
    }

    /// [`super::pack_a_by_pairs`]: for each group of 48 rows (eight tiles), each pair's two
    /// source rows read there, rounded and joined into pair words, and each tile's six words
    /// copied into place; the next group reads on along the same source rows.
    ///
    /// # Safety
    /// As for `pack_a_by_pairs`, with `src` the transposed `A` (element `i` of depth `p` at
    /// `src + i + p·cs`); the CPU has AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn by_pairs<T: Lanes>(
        src: *const T,
        cs: usize,
        (m, k, lda): (usize, usize, usize),
        pairs: std::ops::Range<usize>,
        dst: *mut u16,
    ) {
        const GROUP: usize = 48;
        const _: () = assert!(GROUP.is_multiple_of(MR) && GROUP.is_multiple_of(16));
        let tiles = m.div_ceil(MR);
        let mut words = [0u32; GROUP];
        // SAFETY: only source rows `2q, 2q + 1 < k` are read, each holding `m` elements (the
        // masks stop at `m`; a pointer past them is only formed with an empty mask, by
        // `wrapping_add`); destination
        // offsets `g·MR·lda + q·2·MR + j` with `g < tiles`, `q < lda / 2`, `j < 2·MR` are below
        // `tiles · MR · lda`.
        unsafe {
            for i in (0..tiles * MR).step_by(GROUP) {
                for q in pairs.clone() {
                    // Pairs past the depth (an `lda` wider than it) are zero words.
                    let lo = (2 * q < k).then(|| src.add(2 * q * cs));
                    let hi = (2 * q + 1 < k).then(|| src.add((2 * q + 1) * cs));
                    // The next group's elements of both rows: this task reads 64 rows a group
                    // at a time, more runs than the prefetchers follow (`perf`: this packer's
                    // samples sat on its loads).
                    for row in [lo, hi].into_iter().flatten() {
                        prefetch_run(row, i + GROUP, (i + 2 * GROUP).min(m));
                    }
                    for v in 0..GROUP / 16 {
                        let r = i + 16 * v;
                        let w = match lo {
                            Some(lo) => pair_words16(lo, hi, r, m.saturating_sub(r)),
                            None => _mm512_setzero_si512(),
                        };
                        _mm512_storeu_si512(words.as_mut_ptr().add(16 * v) as *mut __m512i, w);
                    }
                    for t in 0..(GROUP / MR).min(tiles - i / MR) {
                        let to = dst.add((i / MR + t) * MR * lda + q * 2 * MR) as *mut u8;
                        let from = words.as_ptr().add(t * MR) as *const u8;
                        std::ptr::copy_nonoverlapping(from, to, 4 * MR);
                    }
                }
            }
        }
    }

    /// The micro-panels of `pack_a_panels`, bit for bit.
    ///
    /// # Safety
    /// As for `pack_a_panels`; the CPU has AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pack<T: Lanes>(src: *const T, cs: usize, blk: ABlock, dst: *mut u16) {
        let ABlock { i0, rows, padded, p0, kc, lda } = blk;
        let kp = lda / 2;
        let tiles = padded / MR;
        // One pair's words for every row of the block (16-lane chunks).
        let mut words = [0u32; MAX_ROWS + 16];
        // SAFETY: only source rows `p0 + p` with `p < kc` are read, each holding `rows`
        // elements from `i0` (the masks stop at `rows`, the prefetched rows are below
        // `p0 + kc`); `words` holds `padded <= MAX_ROWS` (the caller's condition) rounded up
        // to 16 words; destination offsets `tile·MR·lda + q·2·MR + 2r + h` are below
        // `padded · lda`.
        unsafe {
            for q in 0..kp {
                // Pairs past the depth (an `lda` wider than it) are zero words, as the scalar
                // packer writes them.
                let Some(lo) = (2 * q < kc).then(|| src.add(i0 + (p0 + 2 * q) * cs)) else {
                    for tile in 0..tiles {
                        let to = dst.add(tile * MR * lda + q * 2 * MR);
                        std::ptr::write_bytes(to, 0, 2 * MR);
                    }
                    continue;
                };
                let hi = (2 * q + 1 < kc).then(|| src.add(i0 + (p0 + 2 * q + 1) * cs));
                // Prefetch the rows 16 ahead, as the scalar packer does.
                if 2 * q + 17 < kc {
                    for line in [lo.add(16 * cs), lo.add(17 * cs)] {
                        for off in (0..rows * std::mem::size_of::<T>()).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>((line as *const i8).add(off));
                        }
                    }
                }
                for i in (0..padded).step_by(16) {
                    let w = pair_words16(lo, hi, i, rows.saturating_sub(i));
                    _mm512_storeu_si512(words.as_mut_ptr().add(i) as *mut __m512i, w);
                }
                for tile in 0..tiles {
                    let to = dst.add(tile * MR * lda + q * 2 * MR) as *mut u8;
                    let from = words.as_ptr().add(tile * MR) as *const u8;
                    std::ptr::copy_nonoverlapping(from, to, 4 * MR);
                }
            }
        }
    }

    /// The panels of a `B` whose columns are contiguous along `k` (column `j` at
    /// `src + (j0 + j)·cs`, element `p0 + p` at `+ p0 + p`): bit for bit `pack_b_typed`'s.
    /// For each group of 16 pairs and 16 columns, each column's 32-element run is read as 16
    /// words, the 16 × 16 words are transposed in registers and each pair row of the panel is
    /// stored at once. Walking down every column a pair at a time instead cost a tenth of a
    /// bf16 `Linear` forward; scattering each column's words down the panel, a third of that.
    ///
    /// # Safety
    /// As for `pack_b_typed`, with `b.row_stride == 1` and `cs == b.col_stride`; the CPU has
    /// AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pack_cols<T: Lanes>(src: *const T, cs: usize, blk: BBlock, dst: *mut u32) {
        let BBlock { p0, kc, kp, j0, cols, panels } = blk;
        let live_pairs = kc.div_ceil(2);
        // SAFETY: column `j < cols` holds elements `p0..p0 + kc` inside `b` (the block lies
        // inside it); panel words `(p + r)·NR + j` with `p + r < live_pairs <= kp`, `j < NR`
        // lie inside the panels addressed, and the pairs from `live_pairs` to `kp` are zeroed.
        unsafe {
            for q in panels {
                let panel = dst.add(q * kp * NR);
                let live = NR.min(cols - q * NR);
                std::ptr::write_bytes(panel.add(live_pairs * NR), 0, (kp - live_pairs) * NR);
                for p in (0..live_pairs).step_by(16) {
                    let np = (live_pairs - p).min(16);
                    let elems = (kc - 2 * p).min(32);
                    for jg in (0..live).step_by(16) {
                        let mut w = [_mm512_setzero_si512(); 16];
                        for (jj, x) in w.iter_mut().enumerate().take(live - jg) {
                            let col = src.add(p0 + 2 * p + (j0 + q * NR + jg + jj) * cs);
                            *x = T::words16(col, elems);
                        }
                        super::super::transpose::transpose16(&mut w);
                        for (r, x) in w.iter().enumerate().take(np) {
                            let out = panel.add((p + r) * NR + jg) as *mut __m512i;
                            _mm512_storeu_si512(out, *x);
                        }
                    }
                    // Columns past the live ones are zero.
                    for r in 0..np {
                        let row = panel.add((p + r) * NR);
                        std::ptr::write_bytes(row.add(live), 0, NR - live);
                    }
                }
            }
        }
    }

    /// A row-major block (row `i` at `src + (i0 + i)·rs`, element `p` at `+ p0 + p`) rounded
    /// into the AMX layout's rows (`lda` apart, zeros past `kc` and in the rows past `rows`),
    /// 16 elements at a time: bit for bit `pack_a_typed`'s.
    ///
    /// # Safety
    /// As for `pack_a_typed`, with `a.col_stride == 1` and `rs == a.row_stride`; the CPU has
    /// AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn round_rows<T: Lanes>(
        src: *const T,
        rs: usize,
        blk: ABlock,
        dst: *mut u16,
    ) {
        let ABlock { i0, rows, padded, p0, kc, lda } = blk;
        // SAFETY: elements `p0..p0 + kc` of rows `i0..i0 + rows` are inside `a` (the masks stop
        // at `kc`); destination rows `i < padded` of `lda` elements lie inside the buffer.
        unsafe {
            for i in 0..padded {
                let out = dst.add(i * lda);
                if i >= rows {
                    std::ptr::write_bytes(out, 0, lda);
                    continue;
                }
                let row = src.add((i0 + i) * rs + p0);
                for c in (0..kc).step_by(16) {
                    let n = (kc - c).min(16);
                    let mask: __mmask16 = if n == 16 { 0xFFFF } else { (1 << n) - 1 };
                    let h = T::halves16(row.add(c), mask);
                    _mm256_mask_storeu_epi16(out.add(c) as *mut i16, mask, h);
                }
                std::ptr::write_bytes(out.add(kc), 0, lda - kc);
            }
        }
    }

    /// A transposed block (row `i`, pair element `p` at `src + i + p·cs`) in the row-major
    /// layout of the AMX kernel: row `i` at `dst + i·lda`, element `p` at `p`, zeros past `kc`
    /// and in the rows past `rows`; bit for bit `pack_a_typed`'s. Each step reads the runs of
    /// 16 rows of 16 pairs (32 source runs), joins each pair's two runs into words, transposes
    /// the 16 × 16 words in registers and stores each row's 16 words at once. Packing row by
    /// row instead reads a new cache line per element (a third of a bf16 `Linear`'s training
    /// step on AMX); scattering each pair's 16 words to the rows, one `vpscatterdd` per pair,
    /// took 12% of it (a tenth of it with the transpose).
    ///
    /// # Safety
    /// As for `pack_a_typed`, with `a.row_stride == 1` and `cs == a.col_stride`; `lda` is even
    /// and at least `kc`; the CPU has AVX-512F, BW and VL.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pack_rows<T: Lanes>(src: *const T, cs: usize, blk: ABlock, dst: *mut u16) {
        let ABlock { i0, rows, padded, p0, kc, lda } = blk;
        let kp = lda / 2;
        // SAFETY: source elements `i0 + i + (p0 + p)·cs` with `i < rows` (the masks) and
        // `p < kc` are inside `a`, and so are the prefetched runs (rows below `p0 + kc`);
        // destination words `(i + r)·kp + q` with `i + r < rows` (`take(live)`) and `q < kp`
        // (the store masks) and the zeroed rows below `padded` lie inside `padded · lda`
        // elements.
        unsafe {
            let run = |p: usize| src.add(i0 + (p0 + p) * cs);
            let bytes = rows * std::mem::size_of::<T>();
            // Pair blocks outside, row groups inside: the 32 source runs of a block (each the
            // block's rows) are read once for all its row groups.
            for q0 in (0..kp).step_by(16) {
                let nq = (kp - q0).min(16);
                let qmask: __mmask16 = if nq == 16 { 0xFFFF } else { (1 << nq) - 1 };
                // Prefetch the next block's runs.
                for p in (2 * q0 + 32..(2 * q0 + 64).min(kc)).map(run) {
                    for off in (0..bytes).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>((p as *const i8).add(off));
                    }
                }
                for i in (0..rows).step_by(16) {
                    let live = (rows - i).min(16);
                    let mask = if live == 16 { 0xFFFF } else { (1u16 << live) - 1 };
                    let mut w = [_mm512_setzero_si512(); 16];
                    for (j, x) in w.iter_mut().enumerate().take(nq) {
                        let p = 2 * (q0 + j);
                        // No closure here: a closure does not take this function's target
                        // features, and the masked load would become a call per run.
                        let lo = match p < kc {
                            true => T::bits16(run(p).add(i), mask),
                            false => _mm512_setzero_si512(),
                        };
                        let hi = match p + 1 < kc {
                            true => T::bits16(run(p + 1).add(i), mask),
                            false => _mm512_setzero_si512(),
                        };
                        *x = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
                    }
                    super::super::transpose::transpose16(&mut w);
                    for (r, x) in w.iter().enumerate().take(live) {
                        let out = dst.add((i + r) * lda + 2 * q0) as *mut i32;
                        _mm512_mask_storeu_epi32(out, qmask, *x);
                    }
                }
            }
            for i in rows..padded {
                std::ptr::write_bytes(dst.add(i * lda), 0, lda);
            }
        }
    }
}

/// Whether the CPU has what the AVX-512 packers need (AVX-512F, BW and VL).
pub(crate) fn vector_packing() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The AVX-512 packers' elements (`panels_avx512::Lanes`), which [`Operand`]'s default
/// packers take.
#[cfg(target_arch = "x86_64")]
pub(crate) use panels_avx512::Lanes as PackerLanes;
/// The AVX-512 packers' elements: nothing to ask where those packers do not exist.
#[cfg(not(target_arch = "x86_64"))]
pub(crate) trait PackerLanes {}
#[cfg(not(target_arch = "x86_64"))]
impl PackerLanes for f32 {}
#[cfg(not(target_arch = "x86_64"))]
impl PackerLanes for u16 {}

/// An element the attention's bf16 packers read: f32, rounded to bf16 on the way (the f32
/// twin of a bf16 module), or bf16 bits, taken as they are (a bf16 projection written as
/// such). The same words either way where the f32 values are the bf16 ones.
pub(crate) trait Operand: Bits + PackerLanes + Send + Sync + 'static {
    /// The element as bf16 bits (f32 rounded to nearest even, NaN quieted).
    fn bits(self) -> u16;
    /// Whether the element is NaN or infinite (its exponent field all ones).
    fn nonfinite(self) -> bool;
    /// The element as an f32 pointer, for the f32 products: `None` for bf16 bits, which only
    /// the bf16 products read.
    fn as_f32(p: *const Self) -> Option<*const f32>;

    /// Rows `0..rows` of a transposed matrix (element `(r, p)` at `src + r + p·cs`, `p < kc`)
    /// as bf16 rows `lda` apart (zeros past `kc` and in rows `rows..padded`): the attention's
    /// transposed value and key pairs, by the AVX-512 transposing packer.
    ///
    /// # Safety
    /// [`vector_packing`] is true; the elements are readable; `dst` holds `padded · lda`
    /// elements, `lda` even and at least `kc`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn transpose_rows(
        src: *const Self,
        cs: usize,
        (rows, padded): (usize, usize),
        kc: usize,
        dst: *mut u16,
        lda: usize,
    ) {
        let blk = ABlock { i0: 0, rows, padded, p0: 0, kc, lda };
        // SAFETY: forwarded.
        unsafe { panels_avx512::pack_rows(src, cs, blk, dst) }
    }

    /// One `NR`-wide panel of pair words from `cols` columns contiguous along `k` (column `j`
    /// at `src + j·cs`, `kc` elements): word `(p, j)` at `dst + p·NR + j`, zeros past the
    /// columns and from pair `kc.div_ceil(2)` to `kp`. The attention's query panels, by the
    /// AVX-512 column packer.
    ///
    /// # Safety
    /// [`vector_packing`] is true; the elements are readable; `dst` holds `kp · NR` words,
    /// `kp` at least `kc.div_ceil(2)`, `cols <= NR`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn column_panel(
        src: *const Self,
        cs: usize,
        cols: usize,
        kc: usize,
        (dst, kp): (*mut u32, usize),
    ) {
        let blk = BBlock { p0: 0, kc, kp, j0: 0, cols, panels: 0..1 };
        // SAFETY: forwarded.
        unsafe { panels_avx512::pack_cols(src, cs, blk, dst) }
    }
}

impl Operand for f32 {
    #[inline(always)]
    fn bits(self) -> u16 {
        f32_to_bf16_bits(self)
    }
    #[inline(always)]
    fn nonfinite(self) -> bool {
        self.to_bits() & 0x7f80_0000 == 0x7f80_0000
    }
    #[inline(always)]
    fn as_f32(p: *const f32) -> Option<*const f32> {
        Some(p)
    }
}

impl Operand for u16 {
    #[inline(always)]
    fn bits(self) -> u16 {
        self
    }
    #[inline(always)]
    fn nonfinite(self) -> bool {
        self & 0x7f80 == 0x7f80
    }
    #[inline(always)]
    fn as_f32(_: *const u16) -> Option<*const f32> {
        None
    }
}

/// Where a block of `B` is packed from and to: rows `p0..p0+kc` and column panels `panels`
/// (of [`NR`] columns, counted from `j0`, `cols` columns in all).
#[derive(Clone)]
pub(super) struct BBlock {
    pub p0: usize,
    pub kc: usize,
    /// Pairs per panel: at least `kc.div_ceil(2)`; the rows past the block are zero.
    pub kp: usize,
    pub j0: usize,
    pub cols: usize,
    pub panels: std::ops::Range<usize>,
}

/// Packs the block `blk` of `b` into `dst`, which holds panel `q` at `q · kp · NR` words
/// (`kp = blk.kp`): word `(p, j)` holds rows `2p` (low half) and `2p + 1` (high half) of
/// column `j`. Columns past `cols`, the row after an odd `kc` and the pairs past the block
/// are zero. Compiled for AVX-512 when the kernel allows it, as `pack_a` is.
///
/// # Safety
/// The block lies inside `b` (checked by `matmul_bf16`); `dst` holds the panels addressed;
/// `kern` is available on this CPU.
pub(super) unsafe fn pack_b(kern: Kernel, b: &BfMat, blk: BBlock, dst: *mut u32) {
    // SAFETY: forwarded; the AVX-512 kernel is chosen only where the CPU has AVX-512F, BW and VL.
    unsafe {
        if by_rows(b) {
            let kp = blk.kp;
            return pack_b_rows(kern, b, &blk, 0..kp, dst);
        }
        if kern.avx512_packing() {
            #[cfg(target_arch = "x86_64")]
            return pack_b_avx512(b, blk, dst);
        }
        pack_b_any(b, blk, dst)
    }
}

/// [`pack_b`] on AVX-512: a `B` whose columns are contiguous (the `Wᵀ` of `x·Wᵀ`) read 32
/// elements at a time and transposed into the panels' pair rows, the other layouts by the
/// scalar packer compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_b_avx512(b: &BfMat, blk: BBlock, dst: *mut u32) {
    // SAFETY: forwarded; `pack_cols` reads columns contiguous along `k` (`row_stride == 1`).
    unsafe {
        if b.row_stride == 1 && b.col_stride != 1 {
            match b.data {
                Elems::F32(x) => panels_avx512::pack_cols(x.as_ptr(), b.col_stride, blk, dst),
                Elems::Bf16(x) => panels_avx512::pack_cols(x.as_ptr(), b.col_stride, blk, dst),
            }
            return;
        }
        pack_b_any(b, blk, dst)
    }
}

#[inline(always)]
unsafe fn pack_b_any(b: &BfMat, blk: BBlock, dst: *mut u32) {
    // SAFETY: forwarded to the typed packer with the same block.
    unsafe {
        match b.data {
            Elems::F32(x) => pack_b_typed(x.as_ptr(), b, blk, dst),
            Elems::Bf16(x) => pack_b_typed(x.as_ptr(), b, blk, dst),
        }
    }
}

#[inline(always)]
unsafe fn pack_b_typed<T: Bits>(src: *const T, b: &BfMat, blk: BBlock, dst: *mut u32) {
    let BBlock { p0, kc, kp, j0, cols, panels } = blk;
    let (rs, cs) = (b.row_stride, b.col_stride);
    // Pairs that hold rows of the block; the rest of the panel's `kp` rows are zero.
    let live_pairs = kc.div_ceil(2);
    let pair = |lo: u16, hi: u16| u32::from(lo) | (u32::from(hi) << 16);
    // SAFETY: offsets `(p0+p)·rs + (j0+j)·cs` with `p < kc`, `j < cols` are inside `b`; the
    // destination offsets are inside the panels addressed.
    unsafe {
        for q in panels {
            let panel = dst.add(q * kp * NR);
            let live = NR.min(cols - q * NR);
            std::ptr::write_bytes(panel.add(live_pairs * NR), 0, (kp - live_pairs) * NR);
            for j in 0..NR {
                if j >= live {
                    for p in 0..live_pairs {
                        *panel.add(p * NR + j) = 0;
                    }
                    continue;
                }
                // Column `j` of the block: `kc` elements `rs` apart (contiguous for `x·Wᵀ`).
                let col = src.add(p0 * rs + (j0 + q * NR + j) * cs);
                for p in 0..kc / 2 {
                    let (lo, hi) = (T::at(col, 2 * p * rs), T::at(col, (2 * p + 1) * rs));
                    *panel.add(p * NR + j) = pair(lo, hi);
                }
                if kc % 2 == 1 {
                    *panel.add((live_pairs - 1) * NR + j) = pair(T::at(col, (kc - 1) * rs), 0);
                }
            }
        }
    }
}

/// Whether `b` is row-major (the activations of a weight gradient, `dW = dyᵀ·x`): then its
/// packing walks the rows in memory order, in ranges of pairs ([`pack_b_rows`]), rather than a
/// column panel at a time down every row (rows 2 KiB apart, at a page change every second row,
/// defeat the hardware prefetcher: the scalar packer of a `Linear(512, 2048)`'s `x` spent 4% of
/// a bf16 encoder layer's training step waiting for its loads).
pub(super) fn by_rows(b: &BfMat) -> bool {
    b.col_stride == 1 && b.row_stride != 1
}

/// Pairs `pairs` (of `0..blk.kp`) of every panel of a row-major `b` ([`by_rows`]) packed as
/// [`pack_b`] packs them: the words are the same, whoever packs which range. Pairs past the
/// block are zero.
///
/// # Safety
/// As for [`pack_b`], and `by_rows(b)`; `pairs` lies in `0..blk.kp`.
pub(super) unsafe fn pack_b_rows(
    kern: Kernel,
    b: &BfMat,
    blk: &BBlock,
    pairs: std::ops::Range<usize>,
    dst: *mut u32,
) {
    let rs = b.row_stride;
    // SAFETY: forwarded; the AVX-512 packer is chosen only where the CPU has AVX-512F, BW and VL.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        if kern.avx512_packing() {
            return match b.data {
                Elems::F32(x) => panels_avx512::pack_rows_b(x.as_ptr(), rs, blk, pairs, dst),
                Elems::Bf16(x) => panels_avx512::pack_rows_b(x.as_ptr(), rs, blk, pairs, dst),
            };
        }
        let _ = kern;
        match b.data {
            Elems::F32(x) => pack_rows_typed(x.as_ptr(), rs, blk, pairs, dst),
            Elems::Bf16(x) => pack_rows_typed(x.as_ptr(), rs, blk, pairs, dst),
        }
    }
}

/// [`pack_b_rows`] element by element: for each pair of rows, every panel's words.
///
/// # Safety
/// As for [`pack_b_rows`]: row `p0 + p < p0 + kc` of `src` holds the block's `cols` columns
/// from `j0` (`rs` apart).
#[inline(always)]
unsafe fn pack_rows_typed<T: Bits>(
    src: *const T,
    rs: usize,
    blk: &BBlock,
    pairs: std::ops::Range<usize>,
    dst: *mut u32,
) {
    let BBlock { p0, kc, kp, j0, cols, ref panels } = *blk;
    let live_pairs = kc.div_ceil(2);
    let pair = |lo: u16, hi: u16| u32::from(lo) | (u32::from(hi) << 16);
    // SAFETY: rows `p0 + 2p (+ 1) < p0 + kc` and columns `j0 + q·NR + j < j0 + cols` are
    // inside `b`; word `(p, j)` of panel `q` is inside the panels addressed.
    unsafe {
        for p in pairs {
            for q in panels.clone() {
                let out = dst.add(q * kp * NR + p * NR);
                if p >= live_pairs {
                    std::ptr::write_bytes(out, 0, NR);
                    continue;
                }
                let live = NR.min(cols - q * NR);
                let lo = src.add((p0 + 2 * p) * rs + j0 + q * NR);
                let hi = (2 * p + 1 < kc).then(|| lo.add(rs));
                for j in 0..NR {
                    *out.add(j) = match (j < live, hi) {
                        (false, _) => 0,
                        (true, Some(hi)) => pair(T::at(lo, j), T::at(hi, j)),
                        (true, None) => pair(T::at(lo, j), 0),
                    };
                }
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A row-major `B` packed by the AVX-512 packer in ranges of pairs against the scalar
    /// packer in one call, bit for bit: specials, an odd depth, a partial last panel, a block
    /// that starts inside `b`, stale words in both destinations.
    #[test]
    fn row_major_b_packs_the_same_words_in_any_ranges_of_pairs() {
        if !std::arch::is_x86_feature_detected!("avx512bw") {
            eprintln!("no AVX-512BW on this CPU: the vector packer is never chosen here");
            return;
        }
        let specials = [f32::NAN, -f32::NAN, f32::INFINITY, 1e-40, -0.0, f32::MAX];
        for (kc, cols, kp) in [(7usize, 70usize, 16usize), (64, 128, 32), (1, 5, 1), (33, 150, 48)]
        {
            let (k, n) = (kc + 5, cols + 9);
            let src: Vec<f32> = (0..k * n)
                .map(|i| match i % 11 {
                    0 => specials[(i / 11) % specials.len()],
                    _ => ((i * 7919) % 1999) as f32 * 1e-3 - 1.0,
                })
                .collect();
            let bits: Vec<u16> = src.iter().map(|&x| f32_to_bf16_bits(x)).collect();
            let panels = cols.div_ceil(NR);
            let blk = BBlock { p0: 3, kc, kp, j0: 4, cols, panels: 0..panels };
            for data in [Elems::F32(&src), Elems::Bf16(&bits)] {
                let b = BfMat { data, rows: k, cols: n, row_stride: n, col_stride: 1 };
                assert!(by_rows(&b));
                let (mut want, mut got) =
                    (vec![7u32; panels * kp * NR], vec![9u32; panels * kp * NR]);
                // SAFETY: the block lies inside `b`; both buffers hold `panels` panels of
                // `kp · NR` words; the ranges cover `0..kp` once.
                unsafe {
                    match data {
                        Elems::F32(x) => {
                            pack_rows_typed(x.as_ptr(), n, &blk, 0..kp, want.as_mut_ptr())
                        }
                        Elems::Bf16(x) => {
                            pack_rows_typed(x.as_ptr(), n, &blk, 0..kp, want.as_mut_ptr())
                        }
                    }
                    for p in (0..kp).step_by(5) {
                        let pairs = p..(p + 5).min(kp);
                        pack_b_rows(Kernel::Avx512Bf16, &b, &blk, pairs, got.as_mut_ptr());
                    }
                }
                assert_eq!(got, want, "kc {kc} cols {cols}");
            }
        }
    }

    /// The AVX-512 panel packer against the scalar one, bit for bit: NaN payloads of both
    /// signs, infinities, subnormals, ties, odd depths, rows that fill no tile evenly.
    #[test]
    fn vector_panels_are_the_scalar_panels_bit_for_bit() {
        if !std::arch::is_x86_feature_detected!("avx512bw") {
            eprintln!("no AVX-512BW on this CPU: the vector packer is never chosen here");
            return;
        }
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFFC1_2345),
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-40,
            -1e-45,
            f32::from_bits(0x3F80_8000), // a tie: rounds to even
            f32::from_bits(0x3F81_8000), // a tie: rounds up
            f32::MAX,
            -0.0,
        ];
        for (m, kc, i0, rows) in
            [(40usize, 7usize, 0usize, 40usize), (200, 33, 96, 96), (17, 2, 5, 12), (96, 64, 0, 1)]
        {
            let k = kc + 3;
            let src: Vec<f32> = (0..m * k)
                .map(|i| match i % 7 {
                    0 => specials[(i / 7) % specials.len()],
                    _ => ((i * 7919) % 1999) as f32 * 1e-3 - 1.0,
                })
                .collect();
            let bits: Vec<u16> = src.iter().map(|&x| crate::convert::f32_to_bf16_bits(x)).collect();
            let padded = rows.div_ceil(MR) * MR;
            // The depth's pairs, and an `lda` two pairs wider (zero words past the depth).
            for (lda, data) in [2 * kc.div_ceil(2), 2 * kc.div_ceil(2) + 4]
                .into_iter()
                .flat_map(|lda| [(lda, Elems::F32(&src)), (lda, Elems::Bf16(&bits))])
            {
                let blk = ABlock { i0, rows, padded, p0: 2, kc, lda };
                // A (m × k) read transposed: rows contiguous along i, `m` apart along k.
                let a = BfMat { data, rows: m, cols: k, row_stride: 1, col_stride: m };
                let (mut want, mut got) = (vec![7u16; padded * lda], vec![9u16; padded * lda]);
                // SAFETY: the block lies inside `a` and both buffers hold `padded · lda`.
                let (ws, gs) = unsafe {
                    (
                        pack_a_any(&a, blk, want.as_mut_ptr(), true),
                        pack_a_avx512(&a, blk, got.as_mut_ptr()),
                    )
                };
                assert_eq!(ws, gs);
                assert_eq!(want, got, "m {m} kc {kc} i0 {i0} rows {rows} lda {lda}");
            }
        }
    }

    /// The row-major packers (the AMX layout's rounded rows of `A`, and the panels of a `B`
    /// with contiguous columns) against the scalar ones, bit for bit: NaN payloads, infinities,
    /// subnormals, ties, odd depths, partial pair groups and panels.
    #[test]
    fn the_vector_row_and_column_packers_match_the_scalar_ones_bit_for_bit() {
        if !(is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl")) {
            eprintln!("no AVX-512BW/VL here: the vector packers are never chosen here");
            return;
        }
        let specials = [f32::NAN, f32::from_bits(0xFFC1_2345), f32::INFINITY, 1e-40, -0.0];
        let (rows, cols) = (90, 150);
        let src: Vec<f32> = (0..rows * cols)
            .map(|i| match i % 9 {
                0 => specials[(i / 9) % specials.len()],
                _ => f32::from_bits(0x3F80_8000 + ((i as u32 * 7919) % 65536)) - 1.5,
            })
            .collect();
        let bits: Vec<u16> = src.iter().map(|&x| crate::convert::f32_to_bf16_bits(x)).collect();
        for data in [Elems::F32(&src), Elems::Bf16(&bits)] {
            // A: rows of `cols` elements; blocks with odd depths and zero rows.
            let a = BfMat { data, rows, cols, row_stride: cols, col_stride: 1 };
            for (i0, nrows, padded, p0, kc, lda) in
                [(0, 32, 32, 0, 150, 160), (5, 33, 64, 3, 17, 32), (89, 1, 32, 149, 1, 32)]
            {
                let blk = ABlock { i0, rows: nrows, padded, p0, kc, lda };
                let (mut want, mut got) = (vec![7u16; padded * lda], vec![9u16; padded * lda]);
                // SAFETY: the block lies inside `a`; both buffers hold `padded · lda`.
                let (ws, gs) = unsafe {
                    (
                        pack_a_any(&a, blk, want.as_mut_ptr(), false),
                        pack_a_rows_avx512(&a, blk, got.as_mut_ptr()),
                    )
                };
                assert_eq!((ws, &want), (gs, &got), "rows {i0} {nrows} {p0} {kc}");
            }
            // B = the transpose of the rows: column j contiguous along k (`x·Wᵀ`'s `Wᵀ`).
            let b = BfMat { data, rows: cols, cols: rows, row_stride: 1, col_stride: cols };
            for (p0, kc, j0, ncols, panels) in [
                (0usize, 150usize, 0, 90, 0..2),
                (1, 33, 10, 70, 0..2),
                (149, 1, 89, 1, 0..1),
                (7, 32, 0, 64, 0..1),
            ] {
                let kp = kc.div_ceil(2).div_ceil(16) * 16;
                let len = panels.end * kp * NR;
                let (mut want, mut got) = (vec![7u32; len], vec![9u32; len]);
                let blk = BBlock { p0, kc, kp, j0, cols: ncols, panels: panels.clone() };
                // SAFETY: the block lies inside `b`; both buffers hold the panels addressed.
                unsafe {
                    pack_b_any(&b, blk.clone(), want.as_mut_ptr());
                    pack_b_avx512(&b, blk, got.as_mut_ptr());
                }
                assert_eq!(want, got, "columns {p0} {kc} {j0} {ncols}");
            }
        }
    }

    /// A transposed `A` packed pair by pair over every row block at once (`pack_a_by_pairs`,
    /// in ranges of pairs) against each row block packed on its own by the scalar micro-panel
    /// packer, bit for bit: NaN, infinity, a subnormal and rounding ties, f32 and bf16 sources,
    /// odd depths (a missing last element), strides wider than the depth (zero pairs), rows that
    /// end inside a tile and inside a 48-row group, row blocks of several heights, stale words in
    /// both buffers.
    #[test]
    fn pair_by_pair_packing_of_a_transposed_a_gives_each_row_blocks_words() {
        let kern = Kernel::Avx512Bf16;
        if !kern.avx512_packing() {
            eprintln!("no AVX-512 BW/VL here: the pair-by-pair packer not run");
            return;
        }
        for (m, k, mc) in
            [(1, 1, 6), (5, 4, 6), (47, 33, 12), (48, 64, 48), (49, 7, 30), (301, 70, 96)]
        {
            let cs = m + 3;
            let mut a = crate::testutil::rand_vec(cs * k, (m * k) as u64);
            let last = a.len() - 1;
            a[0] = f32::NAN;
            a[cs.min(last)] = f32::NEG_INFINITY;
            a[(2 * cs + 1).min(last)] = 1e-39;
            a[(cs + 2).min(last)] = f32::from_bits(0x3f80_8000); // a tie
            let a16: Vec<u16> = a.iter().map(|&x| crate::convert::f32_to_bf16_bits(x)).collect();
            // The whole depth, and a stride wider than it (zero pairs after the depth).
            for (lda, data) in [2 * k.div_ceil(2), 2 * k.div_ceil(2) + 4]
                .into_iter()
                .flat_map(|lda| [(lda, Elems::F32(&a)), (lda, Elems::Bf16(&a16))])
            {
                let len = m.div_ceil(MR) * MR * lda;
                let view = BfMat { data, rows: m, cols: k, row_stride: 1, col_stride: cs };
                assert!(packs_by_pairs(kern, &view));
                let mut want = vec![0xDEADu16; len];
                for i0 in (0..m).step_by(mc) {
                    let rows = mc.min(m - i0);
                    let padded = rows.div_ceil(MR) * MR;
                    let blk = ABlock { i0, rows, padded, p0: 0, kc: k, lda };
                    // SAFETY: the block lies inside the view; it owns `padded · lda` elements of
                    // the buffer from `i0 · lda` (`mc` is a multiple of `MR`).
                    let strides =
                        unsafe { pack_a_any(&view, blk, want.as_mut_ptr().add(i0 * lda), true) };
                    assert_eq!(strides, (2, 2 * MR));
                }
                let mut got = vec![0xBEEFu16; len];
                let kp = lda / 2;
                for q0 in (0..kp).step_by(3) {
                    // SAFETY: `packs_by_pairs` held; the buffer holds every tile's `lda`.
                    unsafe { pack_a_by_pairs(&view, lda, q0..(q0 + 3).min(kp), got.as_mut_ptr()) };
                }
                assert_eq!(got, want, "{m}x{k}, row blocks of {mc}, lda {lda}");
            }
        }
    }

    /// The transposing row packer (the AMX layout) against the scalar one, bit for bit.
    #[test]
    fn the_transposing_row_packer_matches_the_scalar_one_bit_for_bit() {
        if !(is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl")) {
            eprintln!("no AVX-512 here: the transposing row packer (AMX CPUs only) not run");
            return;
        }
        let (m, k) = (70, 75);
        let mut a = crate::testutil::rand_vec(m * k, 5);
        a[3] = f32::NAN;
        a[m + 17] = f32::NEG_INFINITY;
        a[2 * m + 4] = 1e-39;
        let a16: Vec<u16> = a.iter().map(|&x| crate::convert::f32_to_bf16_bits(x)).collect();
        // (i0, rows, padded, p0, kc, lda): whole and partial 16-row groups, odd depths, padding
        // past the depth and past the rows, and rows whose pairs are not a multiple of 16 (the
        // attention's transposed pairs; the last 16-pair block is partial).
        let blocks = [
            (0, 16, 32, 0, 32, 32),
            (3, 1, 32, 1, 7, 32),
            (5, 33, 64, 10, 65, 96),
            (0, 70, 96, 0, 75, 96),
            (54, 16, 32, 74, 1, 32),
            (2, 19, 19, 3, 7, 8),
            (0, 35, 40, 4, 65, 66),
            (1, 17, 17, 0, 36, 38),
        ];
        for (i0, rows, padded, p0, kc, lda) in blocks {
            let blk = ABlock { i0, rows, padded, p0, kc, lda };
            for data in [Elems::F32(&a), Elems::Bf16(&a16)] {
                let view = BfMat { data, rows: m, cols: k, row_stride: 1, col_stride: m };
                let mut want = vec![0xDEADu16; padded * lda];
                let mut got = vec![0xBEEFu16; padded * lda];
                // SAFETY: the blocks lie inside the view; the buffers hold `padded · lda`; the
                // CPU has AVX-512F and BW (checked above).
                let (ws, gs) = unsafe {
                    (
                        pack_a_any(&view, blk, want.as_mut_ptr(), false),
                        pack_a_rows_avx512(&view, blk, got.as_mut_ptr()),
                    )
                };
                assert_eq!(ws, gs);
                assert_eq!(got, want, "block {i0} {rows} {padded} {p0} {kc} {lda}");
            }
        }
    }
}
