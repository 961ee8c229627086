//! The element types a kernel may read its large operands in (a KV cache, a weight): f32, or
//! bfloat16 as its bits (`u16`), widened exactly to f32 in registers. Arithmetic is f32 either
//! way, so a bf16 operand gives the bits of the f32 kernel run on its widened copy, while
//! reading half the bytes.

use crate::attention::simd::Simd;

/// An element read as f32.
///
/// # Safety
///
/// Implementations read exactly the elements their methods describe.
pub(crate) unsafe trait Elem: Copy + Send + Sync + 'static {
    /// `LANES` values at `p`, as f32.
    ///
    /// # Safety
    /// `S`'s instruction set is available and `LANES` elements at `p` are readable.
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;

    /// The first `n` (`1..=LANES`) values at `p`, zeros in the other lanes; `mask` is
    /// `S::tail_mask(n)` (or the full mask when `n == LANES`).
    ///
    /// # Safety
    /// `S`'s instruction set is available and `n` elements at `p` are readable.
    unsafe fn load_n<S: Simd>(p: *const Self, n: usize, mask: S::M) -> S::V;
}

// SAFETY: `S::load`/`S::load_m` read `LANES` / the masked lanes only.
unsafe impl Elem for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        // SAFETY: forwarded from the caller.
        unsafe { S::load(p) }
    }
    #[inline(always)]
    unsafe fn load_n<S: Simd>(p: *const f32, _n: usize, mask: S::M) -> S::V {
        // SAFETY: forwarded from the caller; masked lanes are not read.
        unsafe { S::load_m(p, mask) }
    }
}

// SAFETY: `S::load_bf16` reads `LANES` u16; the tail copies `n` of them into a local buffer.
unsafe impl Elem for u16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const u16) -> S::V {
        // SAFETY: forwarded from the caller.
        unsafe { S::load_bf16(p) }
    }
    #[inline(always)]
    unsafe fn load_n<S: Simd>(p: *const u16, n: usize, _mask: S::M) -> S::V {
        if n >= S::LANES {
            // SAFETY: forwarded from the caller.
            return unsafe { S::load_bf16(p) };
        }
        let mut tmp = [0u16; 16];
        // SAFETY: `n < LANES <= 16` elements are readable at `p` (caller) and fit `tmp`.
        unsafe {
            std::ptr::copy_nonoverlapping(p, tmp.as_mut_ptr(), n);
            S::load_bf16(tmp.as_ptr())
        }
    }
}

/// The `LANES` partial sums of `Σ_j a[j]·b[j]` over `n` values (masked at the tail), with `b`
/// read as `E`: one fused multiply-add chain per lane, in increasing `j`.
///
/// # Safety
/// `n` readable floats at `a` and elements at `b`, and the instruction set available.
#[inline(always)]
pub(crate) unsafe fn dot<S: Simd, E: Elem>(a: *const f32, b: *const E, n: usize) -> S::V {
    let l = S::LANES;
    // SAFETY: forwarded from the caller; masked loads stay inside `n` values.
    unsafe {
        let mut acc = S::splat(0.0);
        let mut j = 0;
        while j < n {
            let m = (n - j).min(l);
            let mask = if m == l { S::full_mask() } else { S::tail_mask(m) };
            acc = S::fma(S::load_m(a.add(j), mask), E::load_n::<S>(b.add(j), m, mask), acc);
            j += l;
        }
        acc
    }
}
