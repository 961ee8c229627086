//! The AMX micro-kernel (`tdpbf16ps` on tile registers) and its exact emulation.
//!
//! One call computes an [`AMX_MR`] × [`NR`] tile of `C` as two 32 × 32 halves, each held in
//! four 16 × 16 f32 accumulator tiles (`tmm0..tmm3`), fed per step by two `A` tiles (16 rows of
//! 16 bf16 pairs, `tmm4`, `tmm5`) and two `B` tiles (16 pair rows of 16 columns, `tmm6`,
//! `tmm7`): four tile products per step, 32 × 32 × 32 multiply-adds.
//!
//! The operands lie as the driver packs them for this kernel: `A` row-major bf16 with a row
//! stride `lda` that is a multiple of 32 elements (zero columns past the block's depth); the
//! `B` panel `kp × NR` pair words, `kp` a multiple of [`AMX_KP`] (zero rows past the depth),
//! which is the tile instruction's own "VNNI" layout: row `p` of a `B` tile holds pair `p` of
//! sixteen columns.
//!
//! [`micro_amx_emulated`] reads the same memory in the same order and computes each tile
//! product as the tiles do, which is not the order of Intel's pseudocode (each product added to
//! the accumulator in turn). Measured on an AMX CPU (family 6 model 167 under KVM) with one
//! `tdpbf16ps` at a time on chosen operands, one instruction computes, per output element:
//!
//! * two chains from `+0`, one over the 16 even products and one over the 16 odd products, in
//!   pair order, each step a fused multiply-add rounded to nearest even (the product of two
//!   bf16 values is exact in f32) with a subnormal result flushed to zero of its sign;
//! * then `even + odd`, rounded and flushed, and last the accumulator plus that sum, rounded
//!   and flushed;
//! * bf16 subnormal inputs read as zero, and so does a subnormal accumulator.
//!
//! NaN and infinity propagate as in f32 arithmetic. This model gave the hardware's bits for
//! every element of random tiles of normal numbers (one and three instructions deep), of
//! products near the subnormal range, of subnormal inputs, of products overflowing to
//! infinity, and of negative zeros; Intel's sequential order and a single rounding of all
//! 32 products did not. `amx_matches_its_emulation` in the tests checks it wherever AMX is
//! granted.

use super::NR;
use crate::convert::{bf16_bits_to_f32, flush_subnormal as ftz};

/// Rows of the AMX micro-tile (two 16-row tiles).
pub(crate) const AMX_MR: usize = 32;
/// Pairs of `k` per tile step (a tile row holds 16 pairs: 64 bytes).
pub(crate) const AMX_KP: usize = 16;

/// Whether this process may run AMX bf16 tile instructions: the CPU has AMX-TILE and
/// AMX-BF16, and the operating system granted the tile state (Linux's
/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, asked once).
pub fn amx_available() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *GRANTED.get_or_init(|| amx_cpuid() && request_tile_state())
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

/// Whether CPUID reports AMX-TILE (leaf 7, EDX bit 24) and AMX-BF16 (bit 22).
#[cfg(target_arch = "x86_64")]
pub(crate) fn amx_cpuid() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // CPUID exists on every x86_64 CPU; leaf 0 gives the highest leaf, checked first.
    let max = __cpuid_count(0, 0).eax;
    if max < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    edx & (1 << 24) != 0 && edx & (1 << 22) != 0
}

/// Asks Linux for permission to use the tile data state; true when granted.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_state() -> bool {
    const SYS_ARCH_PRCTL: usize = 158;
    const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
    const XFEATURE_XTILEDATA: usize = 18;
    let ret: isize;
    // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, 18)` only changes which extended states this
    // process may use; it reads no memory of ours. The syscall instruction clobbers rcx and
    // r11, declared below.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// The tile configuration (palette 1): eight tiles of 16 rows of 64 bytes.
#[cfg(target_arch = "x86_64")]
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

#[cfg(target_arch = "x86_64")]
const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1; // palette 1
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row (little-endian u16)
        c[48 + t] = 16; // rows
        t += 1;
    }
    TileConfig(c)
};

/// One tile step of the 2 × 2 kernel, as `asm!` template lines: rows 0..16 and 16..32 of `A`
/// (`{a0}`, `{a1}`, rows `{lda}` bytes apart) into `tmm4`, `tmm5`; two 16-column tiles of the
/// `B` panel (`{b}`, pair rows `{ldb}` bytes apart; loaded without keeping them in L1) into
/// `tmm6`, `tmm7`; four products into `tmm0..tmm3`.
#[cfg(target_arch = "x86_64")]
macro_rules! amx_step {
    () => {
        concat!(
            "tileloadd tmm4, [{a0} + {lda}*1]\n",
            "tileloadd tmm5, [{a1} + {lda}*1]\n",
            "tileloaddt1 tmm6, [{b} + {ldb}*1]\n",
            "tileloaddt1 tmm7, [{b} + {ldb}*1 + 64]\n",
            "tdpbf16ps tmm0, tmm4, tmm6\n",
            "tdpbf16ps tmm1, tmm4, tmm7\n",
            "tdpbf16ps tmm2, tmm5, tmm6\n",
            "tdpbf16ps tmm3, tmm5, tmm7",
        )
    };
}

/// The accumulators `tmm0..tmm3` stored as a 32 × 32 block of `C` (`{ct}`: its first row,
/// `{cb}`: its 17th, rows `{ldc}` bytes apart), as `asm!` template lines.
#[cfg(target_arch = "x86_64")]
macro_rules! amx_store {
    () => {
        concat!(
            "tilestored [{ct} + {ldc}*1], tmm0\n",
            "tilestored [{ct} + {ldc}*1 + 64], tmm1\n",
            "tilestored [{cb} + {ldc}*1], tmm2\n",
            "tilestored [{cb} + {ldc}*1 + 64], tmm3",
        )
    };
}

/// Tile registers configured on this thread for the AMX kernel; released when dropped.
pub(crate) struct Tiles(());

impl Tiles {
    /// Configures the tiles.
    ///
    /// # Safety
    /// [`amx_available`] is true.
    #[cfg(target_arch = "x86_64")]
    pub(crate) unsafe fn configure() -> Tiles {
        // SAFETY: AMX is granted (the caller's contract); `CONFIG` is a valid 64-byte palette-1
        // configuration, aligned as `ldtilecfg` wants.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig, options(nostack));
        }
        Tiles(())
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: a `Tiles` exists only after `configure`, so AMX is granted; `tilerelease`
        // returns the tile state to its initial one.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// `C[0..AMX_MR, 0..NR] (+)= A · B` on AMX tiles, as two 32-column halves.
///
/// The `B` tiles load with `tileloaddt1` (a hint not to keep them in L1): each half streams
/// its 32 columns of the panel once, while the 32-row strip of `A` is read again by the second
/// half and stays in L1 better without them. On an AMX CPU (family 6 model 167) the bf16
/// `Linear(512, 2048)` forward went 3.75-4.02 -> 3.48-3.72 ms (minimum of 300, four alternating
/// runs); at depth 2048, where the strip outgrows L1 anyway, nothing changed.
///
/// # Safety
/// The tiles are configured on this thread ([`Tiles::configure`]); `a` holds [`AMX_MR`] rows
/// of `lda` bf16 (`lda` even, at least `2·kp`); `b` holds `kp · NR` words with `kp` a multiple
/// of [`AMX_KP`]; `c` a full `AMX_MR × NR` tile with row stride `ldc`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn micro_amx(
    kp: usize,
    a: *const u16,
    lda: usize,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    let steps = kp / AMX_KP;
    if steps == 0 {
        if !load_c {
            for r in 0..AMX_MR {
                // SAFETY: row `r < AMX_MR` of the tile lies in `c` (the caller's contract).
                unsafe { std::ptr::write_bytes(c.add(r * ldc), 0, NR) };
            }
        }
        return;
    }
    for half in 0..2 {
        // SAFETY: the offsets below stay inside the rows, panel and tile the caller
        // describes: rows 0..16 and 16..32 of `a`, 64 bytes per step; 16 pair rows of `b`
        // (NR words = 256 bytes apart), columns `32·half .. 32·half + 32`; the 32 × 32 block
        // of `c` at column `32·half`.
        unsafe {
            let ct = c.add(32 * half);
            let cb = ct.add(16 * ldc);
            let a1 = a.add(16 * lda);
            let bh = b.add(32 * half);
            std::arch::asm!(
                "test {load:e}, {load:e}",
                "jz 2f",
                "tileloadd tmm0, [{ct} + {ldc}*1]",
                "tileloadd tmm1, [{ct} + {ldc}*1 + 64]",
                "tileloadd tmm2, [{cb} + {ldc}*1]",
                "tileloadd tmm3, [{cb} + {ldc}*1 + 64]",
                "jmp 3f",
                "2:",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "3:",
                amx_step!(),
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b}, {bstep}",
                "dec {n}",
                "jnz 3b",
                amx_store!(),
                load = in(reg) u32::from(load_c),
                ct = in(reg) ct,
                cb = in(reg) cb,
                ldc = in(reg) 4 * ldc,
                a0 = inout(reg) a => _,
                a1 = inout(reg) a1 => _,
                lda = in(reg) 2 * lda,
                b = inout(reg) bh => _,
                ldb = in(reg) 4 * NR,
                bstep = in(reg) 4 * NR * AMX_KP,
                n = inout(reg) steps => _,
                options(nostack),
            );
        }
    }
}

/// [`micro_amx`] into a `C` it does not read (`load_c` false), calling `between(i, n)` after
/// each of its `n` tile steps (`i` from 0): the caller's vector work (the previous tile's
/// epilogue) runs while the tile products of the step before it are still in flight, instead
/// of after all of them. The same tile products in the same order as [`micro_amx`], so the
/// same bits.
///
/// # Safety
/// As for [`micro_amx`]; `between` touches neither `a`, `b` nor this tile of `c`.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn micro_amx_between(
    kp: usize,
    (a, lda): (*const u16, usize),
    b: *const u32,
    (c, ldc): (*mut f32, usize),
    between: &mut dyn FnMut(usize, usize),
) {
    let steps = kp / AMX_KP;
    let n = 2 * steps;
    for half in 0..2 {
        // SAFETY: the offsets stay inside the rows, panel and tile the caller describes (as in
        // `micro_amx`): rows 0..16 and 16..32 of `a`, 64 bytes a step; 16 pair rows of `b` a
        // step, columns `32·half .. 32·half + 32`; the 32 × 32 block of `c` at column
        // `32·half`. The tile registers are this thread's and no code between the blocks
        // uses them (Rust never emits tile instructions).
        unsafe {
            std::arch::asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            let (mut a0, mut a1, mut bh) = (a, a.add(16 * lda), b.add(32 * half));
            for s in 0..steps {
                std::arch::asm!(
                    amx_step!(),
                    a0 = in(reg) a0,
                    a1 = in(reg) a1,
                    lda = in(reg) 2 * lda,
                    b = in(reg) bh,
                    ldb = in(reg) 4 * NR,
                    options(nostack, readonly),
                );
                a0 = a0.add(2 * AMX_KP);
                a1 = a1.add(2 * AMX_KP);
                bh = bh.add(NR * AMX_KP);
                between(half * steps + s, n);
            }
            let ct = c.add(32 * half);
            let cb = ct.add(16 * ldc);
            std::arch::asm!(
                amx_store!(),
                ct = in(reg) ct,
                cb = in(reg) cb,
                ldc = in(reg) 4 * ldc,
                options(nostack),
            );
        }
    }
}

/// A bf16 value as f32, with subnormals read as zero (the tile instruction's inputs).
#[inline(always)]
fn daz(bits: u16) -> f32 {
    if bits & 0x7f80 == 0 {
        bf16_bits_to_f32(bits & 0x8000)
    } else {
        bf16_bits_to_f32(bits)
    }
}

/// One `tdpbf16ps` for one output element: `acc` plus the [`AMX_KP`] pairs `pair(k)` (the
/// `A` word and the `B` word of pair `k`, bf16 even half low), as the tiles compute it (see
/// the module's documentation): the even and the odd products in two fused chains, their sum,
/// then the accumulator; subnormal inputs read as zero, subnormal results flushed.
#[inline(always)]
pub(crate) fn tdp_element(acc: f32, pair: impl Fn(usize) -> (u32, u32)) -> f32 {
    let (mut even, mut odd) = (0f32, 0f32);
    for k in 0..AMX_KP {
        let (a, b) = pair(k);
        even = ftz(daz(a as u16).mul_add(daz(b as u16), even));
        odd = ftz(daz((a >> 16) as u16).mul_add(daz((b >> 16) as u16), odd));
    }
    ftz(ftz(acc) + ftz(even + odd))
}

/// One emulated `tdpbf16ps` on 16 × 16 tiles: `c[m][n] (+)=` over the 16 pairs of row `m` of
/// the `A` tile (at `a + m·lda`, bf16) and pair row `k` of the `B` tile (at `b + k·ldb`,
/// words).
///
/// # Safety
/// `a` holds 16 rows of 32 bf16 `lda` apart; `b` 16 rows of 16 words `ldb` apart.
unsafe fn tdpbf16ps(c: &mut [[f32; 16]; 16], a: *const u16, lda: usize, b: *const u32, ldb: usize) {
    for (m, row) in c.iter_mut().enumerate() {
        for (n, x) in row.iter_mut().enumerate() {
            // SAFETY: `m, k, n < 16` stay inside the tiles the caller describes.
            *x = tdp_element(*x, |k| unsafe {
                ((a.add(m * lda + 2 * k) as *const u32).read_unaligned(), *b.add(k * ldb + n))
            });
        }
    }
}

/// The AMX kernel's twin: the same tiles from the same memory, each tile product emulated.
///
/// # Safety
/// As for [`micro_amx`], without the CPU requirement.
pub(crate) unsafe fn micro_amx_emulated(
    kp: usize,
    a: *const u16,
    lda: usize,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    load_c: bool,
) {
    for half in 0..2 {
        let mut acc = [[[0f32; 16]; 16]; 4];
        // SAFETY: the offsets stay inside the rows, panel and tile the caller describes (as
        // in `micro_amx`).
        unsafe {
            for (t, tile) in acc.iter_mut().enumerate() {
                let ct = c.add((t / 2) * 16 * ldc + 32 * half + (t % 2) * 16);
                for (m, row) in tile.iter_mut().enumerate() {
                    for (n, x) in row.iter_mut().enumerate() {
                        *x = if load_c { *ct.add(m * ldc + n) } else { 0.0 };
                    }
                }
            }
            for s in 0..kp / AMX_KP {
                for (t, tile) in acc.iter_mut().enumerate() {
                    let at = a.add((t / 2) * 16 * lda + 32 * s);
                    let bt = b.add(s * AMX_KP * NR + 32 * half + (t % 2) * 16);
                    tdpbf16ps(tile, at, lda, bt, NR);
                }
            }
            for (t, tile) in acc.iter().enumerate() {
                let ct = c.add((t / 2) * 16 * ldc + 32 * half + (t % 2) * 16);
                for (m, row) in tile.iter().enumerate() {
                    for (n, x) in row.iter().enumerate() {
                        *ct.add(m * ldc + n) = *x;
                    }
                }
            }
        }
    }
}
