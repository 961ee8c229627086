//! Packing: a block of `A` rounded into a bf16 row-major buffer, and a block of `B` into
//! [`NR`]-wide panels of `k` pairs, zero-padded to whole pairs, rows and panels.

use super::micro::Kernel;
use super::{BfMat, Elems, NR};
use crate::convert::f32_to_bf16_bits;

/// Elements that can be read as bf16 bits (f32 rounded to nearest even, or bf16 as it is).
trait Bits: Copy {
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

/// The block `blk` of `a` as bf16 rows of `lda` elements in `dst`, compiled for AVX-512 when
/// `kern` is the AVX512-BF16 kernel (the rounding loop then vectorises: a tenth of the
/// product's time otherwise).
///
/// # Safety
/// The block lies inside `a` (checked by `matmul_bf16`); `dst` holds `padded · lda` elements;
/// `kern` is available on this CPU.
pub(super) unsafe fn pack_a(kern: Kernel, a: &BfMat, blk: ABlock, dst: *mut u16) {
    // SAFETY: forwarded; the AVX-512 kernel is chosen only where the CPU has AVX-512F and BW.
    unsafe {
        match kern {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 => pack_a_avx512(a, blk, dst),
            Kernel::Portable => pack_a_any(a, blk, dst),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_a_avx512(a: &BfMat, blk: ABlock, dst: *mut u16) {
    // SAFETY: forwarded.
    unsafe { pack_a_any(a, blk, dst) }
}

#[inline(always)]
unsafe fn pack_a_any(a: &BfMat, blk: ABlock, dst: *mut u16) {
    // SAFETY: forwarded to the typed packer with the same block.
    unsafe {
        match a.data {
            Elems::F32(x) => pack_a_typed(x.as_ptr(), a, blk, dst),
            Elems::Bf16(x) => pack_a_typed(x.as_ptr(), a, blk, dst),
        }
    }
}

#[inline(always)]
unsafe fn pack_a_typed<T: Bits>(src: *const T, a: &BfMat, blk: ABlock, dst: *mut u16) {
    let ABlock { i0, rows, padded, p0, kc, lda } = blk;
    let (rs, cs) = (a.row_stride, a.col_stride);
    // SAFETY: offsets `(i0+i)·rs + (p0+p)·cs` with `i < rows`, `p < kc` are inside `a`; the
    // destination offsets are below `padded · lda`.
    unsafe {
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
}

/// Packs rows `p0..p0+kc` and column panels `panels` (of [`NR`] columns, counted from `j0`,
/// `cols` columns in all) of `b` into `dst`, which holds panel `q` at `q · kp · NR` words
/// (`kp = kc.div_ceil(2)`): word `(p, j)` holds rows `2p` (low half) and `2p + 1` (high half)
/// of column `j`. Columns past `cols` and the row after an odd `kc` are zero.
///
/// # Safety
/// The block lies inside `b` (checked by `matmul_bf16`); `dst` holds the panels addressed.
pub(super) unsafe fn pack_b(
    b: &BfMat,
    p0: usize,
    kc: usize,
    j0: usize,
    cols: usize,
    panels: std::ops::Range<usize>,
    dst: *mut u32,
) {
    // SAFETY: forwarded to the typed packer with the same block.
    unsafe {
        match b.data {
            Elems::F32(x) => pack_b_typed(x.as_ptr(), b, p0, kc, j0, cols, panels, dst),
            Elems::Bf16(x) => pack_b_typed(x.as_ptr(), b, p0, kc, j0, cols, panels, dst),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn pack_b_typed<T: Bits>(
    src: *const T,
    b: &BfMat,
    p0: usize,
    kc: usize,
    j0: usize,
    cols: usize,
    panels: std::ops::Range<usize>,
    dst: *mut u32,
) {
    let (rs, cs) = (b.row_stride, b.col_stride);
    let kp = kc.div_ceil(2);
    let pair = |lo: u16, hi: u16| u32::from(lo) | (u32::from(hi) << 16);
    // SAFETY: offsets `(p0+p)·rs + (j0+j)·cs` with `p < kc`, `j < cols` are inside `b`; the
    // destination offsets are inside the panels addressed.
    unsafe {
        for q in panels {
            let panel = dst.add(q * kp * NR);
            let live = NR.min(cols - q * NR);
            for j in 0..NR {
                if j >= live {
                    for p in 0..kp {
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
                    *panel.add((kp - 1) * NR + j) = pair(T::at(col, (kc - 1) * rs), 0);
                }
            }
        }
    }
}
