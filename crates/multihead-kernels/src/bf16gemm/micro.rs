//! The register micro-kernels: one `MR × NR` tile of `C` from `MR` rows of bf16 pairs of `A`
//! (pair `p` of row `r` at `a + r·rs_a + p·cs_a`, in bf16 elements) and a packed `B` panel
//! (`kp × NR` pair words).

use super::amx::{micro_amx_emulated, Tiles, AMX_KP, AMX_MR};
use super::{MR, NR};
use crate::convert::bf16_bits_to_f32;

/// `C[0..MR, 0..NR] (+)= Σ_p A[·, 2p..2p+2] · B[p]` on AVX512-BF16: per pair, four `B`
/// vectors, `MR` broadcast pairs of `A` and `4·MR` `vdpbf16ps` into 24 accumulators.
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16; `a + r·rs_a + p·cs_a` holds a pair of bf16 for
/// `r < MR`, `p < kp`; `b` holds `kp · NR` words; `c` a full `MR × NR` tile with row stride
/// `ldc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn micro_avx512bf16(
    kp: usize,
    a: *const u16,
    (rs_a, cs_a): (usize, usize),
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    use std::arch::x86_64::*;
    const NV: usize = NR / 16;
    // SAFETY: every offset stays inside the rows, panel and tile the caller describes;
    // `__m512i` and `__m512bh` are both 64 bytes of lanes, so the transmutes only retype.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        if load_c {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(c.add(r * ldc + v * 16));
                }
            }
        }
        for p in 0..kp {
            let mut bv = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                let ptr = b.add(p * NR + v * 16) as *const __m512i;
                *x = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(ptr));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let pair = (a.add(r * rs_a + p * cs_a) as *const u32).read_unaligned();
                let av = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair as i32));
                for (x, bx) in row.iter_mut().zip(bv.iter()) {
                    *x = _mm512_dpbf16_ps(*x, av, *bx);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                _mm512_storeu_ps(c.add(r * ldc + v * 16), *x);
            }
        }
    }
}

/// The portable micro-kernel: the same sums in the same order (per pair, the odd product,
/// then the even one, each exact in f32 and added with one rounding), subnormals kept.
///
/// # Safety
/// As for `micro_avx512bf16`, without the CPU requirement.
pub(super) unsafe fn micro_portable(
    kp: usize,
    a: *const u16,
    (rs_a, cs_a): (usize, usize),
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    let mut acc = [[0f32; NR]; MR];
    // SAFETY: every offset stays inside the rows, panel and tile the caller describes.
    unsafe {
        if load_c {
            for (r, row) in acc.iter_mut().enumerate() {
                for (j, x) in row.iter_mut().enumerate() {
                    *x = *c.add(r * ldc + j);
                }
            }
        }
        for p in 0..kp {
            let words = std::slice::from_raw_parts(b.add(p * NR), NR);
            for (r, row) in acc.iter_mut().enumerate() {
                let lo = bf16_bits_to_f32(*a.add(r * rs_a + p * cs_a));
                let hi = bf16_bits_to_f32(*a.add(r * rs_a + p * cs_a + 1));
                for (x, &w) in row.iter_mut().zip(words) {
                    let (blo, bhi) =
                        (bf16_bits_to_f32(w as u16), bf16_bits_to_f32((w >> 16) as u16));
                    *x = (*x + hi * bhi) + lo * blo;
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (j, x) in row.iter().enumerate() {
                *c.add(r * ldc + j) = *x;
            }
        }
    }
}

/// Which micro-kernel runs (resolved from a [`super::Bf16Kernel`] choice by
/// [`super::select::resolve`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// `vdpbf16ps` on 512-bit vectors.
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
    /// AMX tiles (`tdpbf16ps`).
    #[cfg(target_arch = "x86_64")]
    Amx,
    /// The AMX kernel's exact emulation, in the AMX layout, on any CPU.
    AmxEmulated,
    /// The portable kernel in the `vdpbf16ps` layout.
    Portable,
}

impl Kernel {
    /// Rows of one micro-tile.
    pub(crate) fn mr(self) -> usize {
        if self.tiles() {
            AMX_MR
        } else {
            MR
        }
    }

    /// What the pairs of a packed block are rounded up to a multiple of.
    pub(crate) fn kp_align(self) -> usize {
        if self.tiles() {
            AMX_KP
        } else {
            1
        }
    }

    /// Whether this kernel reads the AMX layout (row-major `A`, whole tile steps).
    pub(crate) fn tiles(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => true,
            Kernel::AmxEmulated => true,
            _ => false,
        }
    }

    /// Whether the kernel reads subnormal inputs as zero and flushes subnormal results (the
    /// bf16 product instructions do; the portable kernel keeps them).
    pub(crate) fn flushes(self) -> bool {
        !matches!(self, Kernel::Portable)
    }

    /// Whether the packers may use AVX-512 (the CPU has AVX-512F, BW and VL: every CPU with
    /// AVX512-BF16 or AMX has them; checked all the same).
    pub(crate) fn avx512_packing(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 | Kernel::Amx => {
                std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            _ => false,
        }
    }

    /// Prepares this thread to run the kernel (configures the tiles for AMX); the guard
    /// undoes it.
    pub(crate) fn begin(self) -> Option<Tiles> {
        match self {
            // SAFETY: `Amx` is resolved only where `amx_available()` is true.
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => Some(unsafe { Tiles::configure() }),
            _ => None,
        }
    }
}

/// The kernel of the attention tiles' bf16 products: the one [`super::Bf16Kernel`] resolves
/// to on the calling thread, as for `matmul_bf16` (the tiles pack their operands in its layout:
/// `attention::bf16::Shape`).
pub(crate) fn kernel() -> Kernel {
    super::select::resolve()
}

/// One micro-tile's operands.
pub(crate) struct Tile {
    pub(crate) kp: usize,
    pub(crate) a: *const u16,
    /// `(rs_a, cs_a)`: pair `p` of row `r` is at `a + r·rs_a + p·cs_a` (bf16 elements).
    pub(crate) strides: (usize, usize),
    pub(crate) b: *const u32,
    pub(crate) load_c: bool,
}

impl Tile {
    /// The full tile into `c`.
    ///
    /// # Safety
    /// As for the micro-kernels: `MR` rows of `A`, a whole panel, a full tile of `C`.
    #[inline(always)]
    pub(crate) unsafe fn run(&self, kern: Kernel, c: *mut f32, ldc: usize) {
        let Tile { kp, a, strides, b, load_c } = *self;
        // SAFETY: forwarded; `Avx512Bf16` and `Amx` are chosen only where the CPU has the
        // features (and the tiles are configured: the driver's `Kernel::begin`); the AMX
        // kernels get row-major `A` (`strides.1 == 2`) from `pack_a`.
        unsafe {
            match kern {
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512Bf16 => micro_avx512bf16(kp, a, strides, b, c, ldc, load_c),
                #[cfg(target_arch = "x86_64")]
                Kernel::Amx => super::amx::micro_amx(kp, a, strides.0, b, c, ldc, load_c),
                Kernel::AmxEmulated => micro_amx_emulated(kp, a, strides.0, b, c, ldc, load_c),
                Kernel::Portable => micro_portable(kp, a, strides, b, c, ldc, load_c),
            }
        }
    }

    /// [`run`](Self::run), calling `between(i, n)` after each of the tile's `n` steps where
    /// the AMX kernel overlaps it with the tile products (a full tile into a `C` it does not
    /// read), else once after the tile (`(0, 1)`).
    ///
    /// # Safety
    /// As for `run`; `between` touches neither the operands nor this tile of `c`.
    #[inline(always)]
    pub(crate) unsafe fn run_between(
        &self,
        kern: Kernel,
        c: *mut f32,
        ldc: usize,
        between: &mut dyn FnMut(usize, usize),
    ) {
        // SAFETY: forwarded (as in `run`).
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if kern == Kernel::Amx && !self.load_c {
                let a = (self.a, self.strides.0);
                return super::amx::micro_amx_between(self.kp, a, self.b, (c, ldc), between);
            }
            self.run(kern, c, ldc);
        }
        between(0, 1);
    }

    /// A partial tile (`live` rows, `cols` columns): computed whole in a local buffer of the
    /// kernel's tile size, then the live part copied out.
    ///
    /// # Safety
    /// As for `run`, except that only `live × cols` of the `C` tile need exist (`live` at most
    /// the kernel's rows).
    pub(crate) unsafe fn edge(
        &self,
        kern: Kernel,
        c: *mut f32,
        ldc: usize,
        live: usize,
        cols: usize,
    ) {
        // The vector kernels' tile is a sixth of the size of the tiles' (1.5 KiB against
        // 8 KiB to clear for every partial tile of a short attention block).
        // SAFETY: forwarded; each buffer holds the kernel's `mr() × NR` tile.
        unsafe {
            match kern.mr() <= MR {
                true => self.edge_in::<{ MR * NR }>(kern, c, ldc, live, cols),
                false => self.edge_in::<{ AMX_MR * NR }>(kern, c, ldc, live, cols),
            }
        }
    }

    /// [`Self::edge`] through a local tile of `N >= kern.mr() · NR` elements.
    ///
    /// # Safety
    /// As for [`Self::edge`].
    unsafe fn edge_in<const N: usize>(
        &self,
        kern: Kernel,
        c: *mut f32,
        ldc: usize,
        live: usize,
        cols: usize,
    ) {
        debug_assert!(N >= kern.mr() * NR);
        let mut tile = crate::aligned::AlignedTile::<N>::zeros();
        let tile = &mut tile.0;
        // SAFETY: the local tile holds the kernel's whole tile; `c` is read and written in its
        // live part only.
        unsafe {
            if self.load_c {
                for r in 0..live {
                    std::ptr::copy_nonoverlapping(
                        c.add(r * ldc),
                        tile.as_mut_ptr().add(r * NR),
                        cols,
                    );
                }
            }
            self.run(kern, tile.as_mut_ptr(), NR);
            for r in 0..live {
                std::ptr::copy_nonoverlapping(tile.as_ptr().add(r * NR), c.add(r * ldc), cols);
            }
        }
    }
}

impl Clone for Tile {
    fn clone(&self) -> Self {
        *self
    }
}
impl Copy for Tile {}
