//! The writes of gradient clipping: `grad.mul_(coef)` of `torch.nn.utils.clip_grad_norm_` and
//! `grad.clamp_(-v, v)` of `clip_grad_value_`, over f32, f64 and bf16 (bits) slices, with rayon
//! over chunks; in place, or (the `_to` forms) from a source into a buffer that need not be
//! initialised.
//!
//! Each element is independent, so the bits do not depend on the thread count. A bf16 element
//! is widened, multiplied in f32 and rounded to nearest even, as PyTorch's `mul_` of a bf16
//! tensor by a 0-dim factor computes it. The clamps return their element when it is NaN (as
//! PyTorch's `clamp_min` / `clamp_max` do) and compare bf16 elements with bounds the caller has
//! rounded to bf16. The plain loops are compiled for AVX-512 where the CPU has it, chosen at run
//! time ([`reference`](mod@reference) is the same arithmetic on one thread, element by element).
//!
//! ```
//! use multihead_kernels::clip::{clamp_f32, scale_f32};
//!
//! let mut g = [1.0f32, -4.0, f32::NAN];
//! scale_f32(&mut g, 0.5);
//! assert_eq!(&g[..2], &[0.5, -2.0]);
//! clamp_f32(&mut g, -1.0, 1.0);
//! assert_eq!(&g[..2], &[0.5, -1.0]);
//! assert!(g[2].is_nan());
//! ```

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::attention::KernelError;
use crate::convert::{bf16_bits_to_f32, f32_to_bf16_bits};

/// Elements per task.
const CHUNK: usize = 1 << 15;

/// `f` over `x` chunk by chunk, in parallel where `x` is larger than a chunk, compiled for
/// AVX-512 where the kernels run at that level.
fn each<T: Send + Copy>(x: &mut [T], f: impl Fn(T) -> T + Sync + Send + Copy) {
    #[inline(always)]
    fn apply<T: Copy>(c: &mut [T], f: impl Fn(T) -> T) {
        for v in c {
            *v = f(*v);
        }
    }
    /// # Safety
    /// The CPU has AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn apply_avx512<T: Copy>(c: &mut [T], f: impl Fn(T) -> T) {
        apply(c, f)
    }
    let avx512 = crate::attention::simd_level() == crate::attention::SimdLevel::Avx512;
    let run = move |c: &mut [T]| {
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the SIMD level is AVX-512 only where the CPU has AVX-512F.
            return unsafe { apply_avx512(c, f) };
        }
        let _ = avx512;
        apply(c, f)
    };
    if x.len() <= CHUNK {
        run(x);
    } else {
        x.par_chunks_mut(CHUNK).for_each(run);
    }
}

/// `dst[i] = f(src[i])` chunk by chunk, as [`each`] does, into memory that need not be
/// initialised: every element of `dst` is written.
fn each_to<T: Send + Sync + Copy>(
    src: &[T],
    dst: &mut [MaybeUninit<T>],
    f: impl Fn(T) -> T + Sync + Send + Copy,
) -> Result<(), KernelError> {
    if src.len() != dst.len() {
        let msg =
            format!("has {} elements but the source {}; pass one length", dst.len(), src.len());
        return Err(KernelError::InvalidArgument { name: "dst", msg });
    }
    #[inline(always)]
    fn apply<T: Copy>(s: &[T], d: &mut [MaybeUninit<T>], f: impl Fn(T) -> T) {
        for (d, &v) in d.iter_mut().zip(s) {
            d.write(f(v));
        }
    }
    /// # Safety
    /// The CPU has AVX-512F.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn apply_avx512<T: Copy>(s: &[T], d: &mut [MaybeUninit<T>], f: impl Fn(T) -> T) {
        apply(s, d, f)
    }
    let avx512 = crate::attention::simd_level() == crate::attention::SimdLevel::Avx512;
    let run = move |(d, s): (&mut [MaybeUninit<T>], &[T])| {
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the SIMD level is AVX-512 only where the CPU has AVX-512F.
            return unsafe { apply_avx512(s, d, f) };
        }
        let _ = avx512;
        apply(s, d, f)
    };
    if src.len() <= CHUNK {
        run((dst, src));
    } else {
        dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(run);
    }
    Ok(())
}

/// [`scale_f32`] of `src` into `dst`, which need not be initialised (all of it is written).
pub fn scale_f32_to(src: &[f32], c: f32, dst: &mut [MaybeUninit<f32>]) -> Result<(), KernelError> {
    each_to(src, dst, move |v| v * c)
}

/// [`scale_f64`] of `src` into `dst`, which need not be initialised (all of it is written).
pub fn scale_f64_to(src: &[f64], c: f64, dst: &mut [MaybeUninit<f64>]) -> Result<(), KernelError> {
    each_to(src, dst, move |v| v * c)
}

/// [`scale_bf16`] of `src` into `dst`, which need not be initialised (all of it is written).
pub fn scale_bf16_to(src: &[u16], c: f32, dst: &mut [MaybeUninit<u16>]) -> Result<(), KernelError> {
    each_to(src, dst, move |b| f32_to_bf16_bits(bf16_bits_to_f32(b) * c))
}

/// [`clamp_f32`] of `src` into `dst`, which need not be initialised (all of it is written).
pub fn clamp_f32_to(
    src: &[f32],
    lo: f32,
    hi: f32,
    dst: &mut [MaybeUninit<f32>],
) -> Result<(), KernelError> {
    each_to(src, dst, move |v| clamp(v, lo, hi))
}

/// [`clamp_f64`] of `src` into `dst`, which need not be initialised (all of it is written).
pub fn clamp_f64_to(
    src: &[f64],
    lo: f64,
    hi: f64,
    dst: &mut [MaybeUninit<f64>],
) -> Result<(), KernelError> {
    each_to(src, dst, move |v| clamp(v, lo, hi))
}

/// [`clamp_bf16`] of `src` into `dst`, which need not be initialised (all of it is written).
pub fn clamp_bf16_to(
    src: &[u16],
    lo: u16,
    hi: u16,
    dst: &mut [MaybeUninit<u16>],
) -> Result<(), KernelError> {
    each_to(src, dst, move |b| clamp_bf16_one(b, lo, hi))
}

/// `x[i] *= c`.
pub fn scale_f32(x: &mut [f32], c: f32) {
    each(x, move |v| v * c);
}

/// `x[i] *= c`.
pub fn scale_f64(x: &mut [f64], c: f64) {
    each(x, move |v| v * c);
}

/// `x[i] = bf16(f32(x[i]) · c)` on bf16 bits, rounded to nearest even.
pub fn scale_bf16(x: &mut [u16], c: f32) {
    each(x, move |b| f32_to_bf16_bits(bf16_bits_to_f32(b) * c));
}

/// PyTorch's `clamp_min(lo)` then `clamp_max(hi)`: a NaN element stays NaN.
#[inline(always)]
fn clamp<T: PartialOrd>(v: T, lo: T, hi: T) -> T {
    let v = if v < lo { lo } else { v };
    if v > hi {
        hi
    } else {
        v
    }
}

/// `x[i] = min(max(x[i], lo), hi)`, NaN kept.
pub fn clamp_f32(x: &mut [f32], lo: f32, hi: f32) {
    each(x, move |v| clamp(v, lo, hi));
}

/// `x[i] = min(max(x[i], lo), hi)`, NaN kept.
pub fn clamp_f64(x: &mut [f64], lo: f64, hi: f64) {
    each(x, move |v| clamp(v, lo, hi));
}

/// The same clamp on bf16 bits, with bounds given as bf16 bits: an element is compared as its
/// f32 value and replaced by a bound's bits.
pub fn clamp_bf16(x: &mut [u16], lo: u16, hi: u16) {
    each(x, move |b| clamp_bf16_one(b, lo, hi));
}

/// One bf16 element clamped to bounds given as bf16 bits.
#[inline(always)]
fn clamp_bf16_one(b: u16, lo: u16, hi: u16) -> u16 {
    let b = if bf16_bits_to_f32(b) < bf16_bits_to_f32(lo) { lo } else { b };
    if bf16_bits_to_f32(b) > bf16_bits_to_f32(hi) {
        hi
    } else {
        b
    }
}

/// The same writes on one thread, element by element: the twin the tests compare with.
pub mod reference {
    use crate::convert::{bf16_bits_to_f32, f32_to_bf16_bits};

    /// [`super::scale_f32`] on one thread.
    pub fn scale_f32(x: &mut [f32], c: f32) {
        x.iter_mut().for_each(|v| *v *= c);
    }

    /// [`super::scale_bf16`] on one thread.
    pub fn scale_bf16(x: &mut [u16], c: f32) {
        x.iter_mut().for_each(|b| *b = f32_to_bf16_bits(bf16_bits_to_f32(*b) * c));
    }

    /// [`super::clamp_f32`] on one thread, written with `f32::max` / `f32::min` and an
    /// explicit NaN test.
    pub fn clamp_f32(x: &mut [f32], lo: f32, hi: f32) {
        x.iter_mut().for_each(|v| {
            if !v.is_nan() {
                *v = v.max(lo).min(hi);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{pool, rand_vec};

    #[test]
    fn writes_match_the_twin_for_any_thread_count() {
        for n in [0, 1, 17, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 5] {
            let mut x = rand_vec(n, n as u64 + 5);
            if n > 3 {
                x[1] = f32::NAN;
                x[2] = -0.0;
                x[3] = f32::INFINITY;
            }
            let bits: Vec<u16> = x.iter().map(|&v| f32_to_bf16_bits(v)).collect();
            let (mut s_ref, mut c_ref, mut b_ref) = (x.clone(), x.clone(), bits.clone());
            reference::scale_f32(&mut s_ref, 0.37);
            reference::clamp_f32(&mut c_ref, -0.25, 0.5);
            reference::scale_bf16(&mut b_ref, 0.37);
            for threads in [1, 2, 3] {
                let (mut s, mut c, mut b) = (x.clone(), x.clone(), bits.clone());
                pool(threads).install(|| {
                    scale_f32(&mut s, 0.37);
                    clamp_f32(&mut c, -0.25, 0.5);
                    scale_bf16(&mut b, 0.37);
                });
                let same =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same(&s, &s_ref) && same(&c, &c_ref), "n {n} t {threads}");
                assert_eq!(b, b_ref, "n {n} t {threads}");
                // Into fresh memory (here: garbage bits): the same bits.
                let mut d = vec![MaybeUninit::new(f32::from_bits(0x7fc0_0bad)); n];
                let mut db = vec![MaybeUninit::new(0xdeadu16); n];
                let got = |d: &[MaybeUninit<f32>]| -> Vec<f32> {
                    // SAFETY: the `_to` kernel wrote every element (what is checked).
                    d.iter().map(|v| unsafe { v.assume_init() }).collect()
                };
                pool(threads).install(|| scale_f32_to(&x, 0.37, &mut d)).expect("lengths");
                assert!(same(&got(&d), &s_ref), "scale_to n {n} t {threads}");
                pool(threads).install(|| clamp_f32_to(&x, -0.25, 0.5, &mut d)).expect("lengths");
                assert!(same(&got(&d), &c_ref), "clamp_to n {n} t {threads}");
                pool(threads).install(|| scale_bf16_to(&bits, 0.37, &mut db)).expect("lengths");
                // SAFETY: as above.
                let gb: Vec<u16> = db.iter().map(|v| unsafe { v.assume_init() }).collect();
                assert_eq!(gb, b_ref, "scale_bf16_to n {n} t {threads}");
            }
        }
    }

    #[test]
    fn clamps_keep_nan_and_use_the_bounds_bits() {
        let mut x = [f64::NAN, -3.0, 0.1, 7.0];
        clamp_f64(&mut x, -1.0, 1.0);
        assert!(x[0].is_nan());
        assert_eq!(&x[1..], &[-1.0, 0.1, 1.0]);
        let mut y = [2.0f64, -2.0];
        scale_f64(&mut y, 0.5);
        assert_eq!(y, [1.0, -1.0]);
        let mut d = [MaybeUninit::new(0.0f64); 2];
        scale_f64_to(&y, 3.0, &mut d).expect("lengths");
        // SAFETY: both elements were written.
        assert_eq!(unsafe { d[1].assume_init() }, -3.0);
        clamp_f64_to(&[5.0, f64::NAN], -1.0, 1.0, &mut d).expect("lengths");
        // SAFETY: both elements were written.
        let d: Vec<f64> = d.iter().map(|v| unsafe { v.assume_init() }).collect();
        assert!(d[0] == 1.0 && d[1].is_nan());
        assert!(scale_f32_to(&[1.0], 2.0, &mut [MaybeUninit::new(0.0); 2]).is_err());
        let b = |v: f32| f32_to_bf16_bits(v);
        let mut z = [b(f32::NAN), b(-3.0), b(0.1), b(7.0)];
        let (lo, hi) = (b(-0.3), b(0.3));
        let src = z;
        clamp_bf16(&mut z, lo, hi);
        assert!(bf16_bits_to_f32(z[0]).is_nan());
        assert_eq!(&z[1..], &[lo, b(0.1), hi]);
        let mut d = [MaybeUninit::new(0u16); 4];
        clamp_bf16_to(&src, lo, hi, &mut d).expect("lengths");
        // SAFETY: every element was written.
        let d: Vec<u16> = d.iter().map(|v| unsafe { v.assume_init() }).collect();
        assert_eq!(d, z);
    }
}
