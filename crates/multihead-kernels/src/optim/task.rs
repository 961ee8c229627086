//! The one task both element types run: f32 arrays as they are, bf16 arrays (their bits)
//! widened to f32 and each operation's result rounded back to bf16, as PyTorch computes a bf16
//! tensor's in-place operations.

use super::{check_lengths, AdamWStep, Scalars32, BLOCK};
use crate::attention::exec::{par_run, ConstPtr, SyncPtr, Task};
use crate::attention::simd::Simd;
use crate::attention::{simd_level, KernelError};

/// One step over a parameter's arrays of element type `E`, after their lengths are checked
/// (what [`adamw`](super::adamw) and [`adamw_bf16`](super::adamw_bf16) run).
pub(super) fn step<E: Elem>(
    p: &mut [E],
    g: &[E],
    m: &mut [E],
    v: &mut [E],
    vmax: Option<&mut [E]>,
    step: &AdamWStep,
) -> Result<(), KernelError> {
    check_lengths(p.len(), g.len(), m.len(), v.len(), vmax.as_ref().map(|w| w.len()))?;
    let task = AdamWTask::<E> {
        p: SyncPtr(p.as_mut_ptr()),
        g: ConstPtr(g.as_ptr()),
        m: SyncPtr(m.as_mut_ptr()),
        v: SyncPtr(v.as_mut_ptr()),
        vmax: SyncPtr(vmax.map_or(std::ptr::null_mut(), |w| w.as_mut_ptr())),
        len: p.len(),
        s: Scalars32::new(step),
    };
    par_run(simd_level(), &task);
    Ok(())
}

/// How an element type is read, rounded after each operation, and written, and which scalars
/// it takes where PyTorch's `add` casts a Python number to the tensor's dtype.
pub(super) trait Elem: Copy + Default {
    /// `S::LANES` elements widened to f32.
    ///
    /// # Safety
    /// `S` is available; `p` is readable for `S::LANES` elements.
    unsafe fn load<S: Simd>(p: *const Self) -> S::V;
    /// `S::LANES` lanes written (rounded to the type).
    ///
    /// # Safety
    /// `S` is available; `p` is writable for `S::LANES` elements.
    unsafe fn store<S: Simd>(p: *mut Self, v: S::V);
    /// An operation's result as the type holds it.
    ///
    /// # Safety
    /// `S` is available.
    unsafe fn round<S: Simd>(v: S::V) -> S::V;
    /// Adam's L2 factor and `eps` as this type's `add` takes them.
    fn l2_eps(s: &Scalars32) -> (f32, f32);
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const f32) -> S::V {
        // SAFETY: the caller's contract.
        unsafe { S::load(p) }
    }
    #[inline(always)]
    unsafe fn store<S: Simd>(p: *mut f32, v: S::V) {
        // SAFETY: the caller's contract.
        unsafe { S::store(p, v) }
    }
    #[inline(always)]
    unsafe fn round<S: Simd>(v: S::V) -> S::V {
        v
    }
    fn l2_eps(s: &Scalars32) -> (f32, f32) {
        (s.l2, s.eps)
    }
}

/// bf16, as its bits.
impl Elem for u16 {
    #[inline(always)]
    unsafe fn load<S: Simd>(p: *const u16) -> S::V {
        // SAFETY: the caller's contract.
        unsafe { S::load_bf16(p) }
    }
    #[inline(always)]
    unsafe fn store<S: Simd>(p: *mut u16, v: S::V) {
        // SAFETY: the caller's contract.
        unsafe { S::store_bf16(p, v) }
    }
    #[inline(always)]
    unsafe fn round<S: Simd>(v: S::V) -> S::V {
        // SAFETY: the caller's contract.
        unsafe { S::round_bf16(v) }
    }
    fn l2_eps(s: &Scalars32) -> (f32, f32) {
        (s.l2_bf16, s.eps_bf16)
    }
}

/// One step over a parameter's arrays.
struct AdamWTask<E> {
    p: SyncPtr<E>,
    g: ConstPtr<E>,
    m: SyncPtr<E>,
    v: SyncPtr<E>,
    /// `amsgrad`'s running maximum of `v`, or null.
    vmax: SyncPtr<E>,
    len: usize,
    s: Scalars32,
}

/// One step of `S::LANES` elements at the pointers (`w` null without `amsgrad`), in PyTorch's
/// order of operations (the module's formulas), each result rounded to `E`.
///
/// # Safety
/// `S` is available; each pointer is valid for `S::LANES` elements (`w` where not null).
#[inline(always)]
unsafe fn lanes<S: Simd, E: Elem>(s: &Scalars32, [p, m, v, w]: [*mut E; 4], g: *const E) {
    // SAFETY: the caller's contract.
    unsafe {
        let c = |x: f32| S::splat(x);
        let r = |x: S::V| E::round::<S>(x);
        let (l2, eps) = E::l2_eps(s);
        let pv = E::load::<S>(p);
        let mut gv = S::mul(E::load::<S>(g), c(s.sign));
        if s.has_l2 {
            gv = r(S::fma_fused(pv, c(l2), gv));
        }
        let mv = E::load::<S>(m);
        let vv = E::load::<S>(v);
        let pv = r(S::mul(pv, c(s.decay)));
        let base = if s.lerp_small { mv } else { gv };
        let mv = r(S::fma_fused(c(s.lerp_coeff), S::sub(gv, mv), base));
        let vv = r(S::mul(vv, c(s.beta2)));
        let vv = r(S::fma_fused(S::mul(c(s.one_minus_beta2), gv), gv, vv));
        let wv = if w.is_null() {
            vv
        } else {
            let wv = S::max_nan(E::load::<S>(w), vv);
            E::store::<S>(w, wv);
            wv
        };
        let d = r(S::sqrt(wv));
        let d = r(S::div(d, c(s.bias_correction2_sqrt)));
        let d = r(S::add(d, c(eps)));
        let pv = S::add(pv, S::div(S::mul(c(s.neg_step_size), mv), d));
        E::store::<S>(p, pv);
        E::store::<S>(m, mv);
        E::store::<S>(v, vv);
    }
}

impl<E: Elem> Task for AdamWTask<E> {
    fn count(&self) -> usize {
        self.len.div_ceil(BLOCK)
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        0
    }
    fn work(&self) -> usize {
        // About ten operations an element (a divide and a square root among them), twice
        // that with bf16's roundings.
        self.len.saturating_mul(10 * std::mem::size_of::<f32>() / std::mem::size_of::<E>())
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, _buf: &mut [f32]) {
        let start = t * BLOCK;
        let end = self.len.min(start + BLOCK);
        let amsgrad = !self.vmax.0.is_null();
        // SAFETY: the arrays hold `len` elements (checked by the entry points; `vmax` is null
        // or holds as many); this task reads and writes `start..end` only, which no other task
        // touches; a tail shorter than `S::LANES` (at most 16) goes through stack buffers.
        unsafe {
            let at = |ptr: *mut E, i: usize| if ptr.is_null() { ptr } else { ptr.add(i) };
            let mut i = start;
            while i + S::LANES <= end {
                let outs = [self.p.0, self.m.0, self.v.0, self.vmax.0].map(|ptr| at(ptr, i));
                lanes::<S, E>(&self.s, outs, self.g.0.add(i));
                i += S::LANES;
            }
            let n = end - i;
            if n == 0 {
                return;
            }
            // p, m, v, vmax, g.
            let mut b = [[E::default(); 16]; 5];
            let src = [self.p.0 as *const E, self.m.0, self.v.0, self.vmax.0, self.g.0];
            for (buf, &ptr) in b.iter_mut().zip(&src).filter(|(_, p)| !p.is_null()) {
                std::ptr::copy_nonoverlapping(ptr.add(i), buf.as_mut_ptr(), n);
            }
            let [bp, bm, bv, bw, bg] = &mut b;
            let w = if amsgrad { bw.as_mut_ptr() } else { std::ptr::null_mut() };
            lanes::<S, E>(
                &self.s,
                [bp.as_mut_ptr(), bm.as_mut_ptr(), bv.as_mut_ptr(), w],
                bg.as_ptr(),
            );
            let dst = [self.p.0, self.m.0, self.v.0, self.vmax.0];
            for (buf, &ptr) in b.iter().zip(&dst).filter(|(_, p)| !p.is_null()) {
                std::ptr::copy_nonoverlapping(buf.as_ptr(), ptr.add(i), n);
            }
        }
    }
}
