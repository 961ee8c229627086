//! The forward's bf16 key and value operands packed once per head, for every query block.
//!
//! Each query block of the bf16 forward rounds its key block into rows for `Sᵀ = K_j·Q_iᵀ`
//! ([`round_rows`](super::bf16::round_rows)) and its value block into the transposed pairs of
//! `Oᵀ += V_jᵀ·Pᵀ` ([`transposed_a`](super::bf16::transposed_a)). With `L / FWD_BR` query
//! blocks per head, a head's keys and values were packed that many times; on AMX tiles the
//! packing took longer than the products (bf16 MHA at L = S = 512: eight packings per head).
//! Here every key block of every `(batch, kv head)` is packed once, in parallel, into the same
//! words the per-block packers write; a query block whose key block lies on the grid (starts at
//! a multiple of the block size) takes them as they are, whole or the first keys of them (a
//! causal query block's last keys: see [`Prepacked::block`]); any other (a band's first block,
//! keys trimmed to an odd count) packs its own as before. The bits are the same either way.

use std::cell::RefCell;

use rayon::prelude::*;

use super::bf16::{self as bf, Shape};
use super::{head_rows_finite, scan_wide, AttnDims, Layout4};
use crate::aligned::{aligned_mut, line_offset};
use crate::bf16gemm::micro::Kernel;
use crate::bf16gemm::pack::Operand;

/// Most bytes of each buffer a dropped [`Prepacked`] leaves to the thread's next one (a head
/// of 512 keys of 64 channels packs 64 KiB of keys and as many of values; B = 8, H = 8 is
/// 4 MiB each).
const KEEP_BYTES: usize = 16 << 20;

thread_local! {
    /// The key and value buffers of the last [`Prepacked`] dropped on this thread, for the
    /// next one: growing a buffer zeroes its new elements on one thread (8 MiB at B = 8,
    /// L = S = 512, H = 8: 5% of a bf16 MHA forward on AMX), reusing it does not. Every word a
    /// task reads is written by the packers (zero padding included), so what a reused buffer
    /// held before does not matter.
    static KEPT: RefCell<(Vec<u16>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// The packed key and value blocks of every `(batch, kv head)`.
pub(crate) struct Prepacked {
    /// Rounded key rows, `k_len` elements per block, from element `k_off`.
    k: Vec<u16>,
    /// Transposed value pairs, `v_len` words per block, from word `v_off`.
    v: Vec<u32>,
    k_off: usize,
    v_off: usize,
    k_len: usize,
    v_len: usize,
    /// Key blocks per head.
    blocks: usize,
    heads_kv: usize,
    /// Keys per block.
    bc: usize,
    s: usize,
    /// Keys per tile step of the value pairs (twice the kernel's pair alignment).
    step_keys: usize,
    /// Per `(batch, kv head)`, whether its keys and values are all finite (empty where not
    /// asked for).
    finite: Vec<bool>,
}

impl Prepacked {
    /// Packs `k` and `v` (validated by `flash_forward`, `[batch, heads_kv, s, d|dv]` through
    /// their layouts) in blocks of `bc` keys for `kern`; `None` where the buffers cannot be
    /// allocated (the tasks then pack their own blocks). With `check`, each block's keys and
    /// values are also scanned for non-finite values while they are in cache
    /// ([`Prepacked::kv_finite`]).
    pub(crate) fn new<T: Operand>(
        kern: Kernel,
        dims: &AttnDims,
        (k, kl): (&[T], Layout4),
        (v, vl): (&[T], Layout4),
        bc: usize,
        check: bool,
    ) -> Option<Prepacked> {
        let sh = Shape::of(kern);
        let dp = 2 * sh.kp(dims.d.div_ceil(2));
        let k_len = sh.rows(bc) * dp;
        let v_len = sh.transposed_words(bc, dims.dv);
        let blocks = dims.s.div_ceil(bc);
        let count = dims.batch.checked_mul(dims.heads_kv)?.checked_mul(blocks)?;
        let (mut k_own, mut v_own): (Vec<u16>, Vec<u32>) = KEPT
            .with(|c| c.try_borrow_mut().map(|mut kept| std::mem::take(&mut *kept)))
            .unwrap_or_default();
        // From line boundaries: the tiles load these rows (see `aligned`).
        let kbuf = aligned_mut(&mut k_own, count.checked_mul(k_len)?)?;
        let vbuf = aligned_mut(&mut v_own, count.checked_mul(v_len)?)?;
        let mut block_finite: Vec<bool> = Vec::new();
        block_finite.try_reserve_exact(count).ok()?;
        block_finite.resize(count, true);
        let checks = block_finite.par_iter_mut();
        // bf16 sources (bits in, no rounding): the packed words are the source's.
        let bits_in = T::as_f32(k.as_ptr()).is_none();
        kbuf.par_chunks_mut(k_len)
            .zip(vbuf.par_chunks_mut(v_len))
            .zip(checks)
            .enumerate()
            .for_each(|(t, ((kb, vw), fin))| {
                let (bh, jb) = (t / blocks, t % blocks);
                let (b, h) = (bh / dims.heads_kv, bh % dims.heads_kv);
                let j0 = jb * bc;
                let step = bc.min(dims.s - j0);
                // SAFETY: rows `j0..j0 + step < s` of head `(b, h)` lie inside `k` and `v`
                // (validated by `flash_forward`), `d` and `dv` floats each; `kb` and `vw`
                // hold one block's packed words (sized above for `bc >= step` keys).
                unsafe {
                    let kr = k.as_ptr().add(kl.offset(b, h, j0));
                    let vr = v.as_ptr().add(vl.offset(b, h, j0));
                    pack_block(kern, (kr, kl.seq), (vr, vl.seq), step, dims, kb, vw);
                }
                if check && bits_in {
                    // bf16 sources are packed as they are, with zero padding: one scan over
                    // the words the packers just wrote, in cache, instead of one per row.
                    let (kw, vn) = (sh.rows(step) * dp, sh.transposed_words(step, dims.dv));
                    // SAFETY: `vn <= v_len` words, two initialised bf16 halves each.
                    let vh =
                        unsafe { std::slice::from_raw_parts(vw.as_ptr() as *const u16, 2 * vn) };
                    *fin = scan_wide(&kb[..kw]) && scan_wide(vh);
                } else if check {
                    let rows = j0..j0 + step;
                    *fin = head_rows_finite(k, kl, (b, h), rows.clone(), dims.d)
                        && head_rows_finite(v, vl, (b, h), rows, dims.dv);
                }
            });
        let finite = match check {
            true => block_finite.chunks(blocks.max(1)).map(|c| c.iter().all(|&f| f)).collect(),
            false => Vec::new(),
        };
        let (k_off, v_off) = (line_offset(&k_own), line_offset(&v_own));
        Some(Prepacked {
            k: k_own,
            v: v_own,
            k_off,
            v_off,
            k_len,
            v_len,
            blocks,
            heads_kv: dims.heads_kv,
            bc,
            s: dims.s,
            step_keys: 2 * sh.kpa,
            finite,
        })
    }

    /// Per `(batch, kv head)`, whether its keys and values are all finite, where `new` was
    /// asked to check.
    pub(crate) fn kv_finite(&self) -> Option<&[bool]> {
        (!self.finite.is_empty()).then_some(self.finite.as_slice())
    }

    /// The packed key rows and value pairs of the `bc` keys from `j0` of `(b, kv head h)`, and
    /// the keys the value pairs were packed for (their row stride follows from it), where those
    /// keys are a block of the grid or its first keys in whole tile steps of pairs.
    ///
    /// The first keys of a block are the same words as a block of those keys alone: key row
    /// `r` is rounded into row `r` either way, and the rows the product reads past `bc` only
    /// reach output rows that are not written; the value pair `(c, p)` is the same word for
    /// `p < bc / 2`, and with `bc` a multiple of the tile step the product reads no pair past
    /// them (a block of its own would have no zero pairs to read either).
    pub(crate) fn block(
        &self,
        b: usize,
        h: usize,
        j0: usize,
        bc: usize,
    ) -> Option<(*const u16, *const u32, usize)> {
        let keys = self.bc.min(self.s.checked_sub(j0)?);
        let prefix = bc < keys && bc.is_multiple_of(self.step_keys);
        if !j0.is_multiple_of(self.bc) || !(bc == keys || prefix) {
            return None;
        }
        let t = (b * self.heads_kv + h) * self.blocks + j0 / self.bc;
        let k = self.k.get(self.k_off + t * self.k_len..self.k_off + (t + 1) * self.k_len)?;
        let v = self.v.get(self.v_off + t * self.v_len..self.v_off + (t + 1) * self.v_len)?;
        Some((k.as_ptr(), v.as_ptr(), keys))
    }
}

impl Drop for Prepacked {
    /// Leaves the buffers to the thread's next `Prepacked` where they are not too large.
    fn drop(&mut self) {
        let small = |bytes: usize| bytes <= KEEP_BYTES;
        if small(self.k.capacity() * 2) && small(self.v.capacity() * 4) {
            let bufs = (std::mem::take(&mut self.k), std::mem::take(&mut self.v));
            KEPT.with(|c| {
                if let Ok(mut kept) = c.try_borrow_mut() {
                    *kept = bufs;
                }
            });
        }
    }
}

/// One block packed as the forward's tasks pack it.
///
/// # Safety
/// `k + r·kld + c` (`c < d`) and `v + r·vld + c` (`c < dv`) are readable for `r < step`; `kb`
/// and `vw` hold one block's words for `step` keys.
unsafe fn pack_block<T: Operand>(
    kern: Kernel,
    k: (*const T, usize),
    v: (*const T, usize),
    step: usize,
    dims: &AttnDims,
    kb: &mut [u16],
    vw: &mut [u32],
) {
    // SAFETY: forwarded; the AVX-512 build is taken where the kernel's packers may use it.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        if kern.avx512_packing() {
            return pack_block_avx512(kern, k, v, step, dims, kb, vw);
        }
        pack_block_impl(kern, k, v, step, dims, kb, vw)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn pack_block_avx512<T: Operand>(
    kern: Kernel,
    k: (*const T, usize),
    v: (*const T, usize),
    step: usize,
    dims: &AttnDims,
    kb: &mut [u16],
    vw: &mut [u32],
) {
    // SAFETY: forwarded (compiled for AVX-512 so that the conversions vectorise).
    unsafe { pack_block_impl(kern, k, v, step, dims, kb, vw) }
}

#[inline(always)]
unsafe fn pack_block_impl<T: Operand>(
    kern: Kernel,
    (k, kld): (*const T, usize),
    (v, vld): (*const T, usize),
    step: usize,
    dims: &AttnDims,
    kb: &mut [u16],
    vw: &mut [u32],
) {
    let sh = Shape::of(kern);
    let dp = 2 * sh.kp(dims.d.div_ceil(2));
    // SAFETY: the caller's ranges; the same calls `bf::scores` and `bf::values` make.
    unsafe {
        bf::round_rows(k, kld, (step, sh.mr), dims.d, kb.as_mut_ptr(), dp);
        bf::transposed_a(sh, (v, vld), step, dims.dv, vw.as_mut_ptr());
    }
}
