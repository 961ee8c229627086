//! The sum of all elements of a vector in f32, in a fixed order: a loss's `out.sum()`.
//!
//! The elements are cut into chunks of [`CHUNK`] that the threads take. Each chunk keeps 16
//! running sums (element `i` of the chunk goes into sum `i % 16`); the 16 are added pairwise
//! (8 + 8, 4 + 4, 2 + 2, 1 + 1), and the chunk sums are added in order. So the result is the
//! same bits for any thread count and any SIMD level, and [`reference`](mod@reference) computes them on one
//! thread. bf16 elements are widened exactly before they are added.
//!
//! ```
//! use multihead_kernels::sum::sum_f32;
//!
//! let x: Vec<f32> = (1..=100).map(|i| i as f32).collect();
//! assert_eq!(sum_f32(&x), 5050.0);
//! ```

use rayon::prelude::*;

use crate::convert::bf16_bits_to_f32;

/// Elements per chunk (the unit of work of one task).
pub const CHUNK: usize = 1 << 14;
/// Running sums per chunk.
const LANES: usize = 16;

/// An accumulator of the chunked sums: f32 or f64.
pub(crate) trait SumAcc: Copy + Send + Sync + std::ops::Add<Output = Self> {
    /// The sum of nothing.
    const ZERO: Self;
}

impl SumAcc for f32 {
    const ZERO: Self = 0.0;
}

impl SumAcc for f64 {
    const ZERO: Self = 0.0;
}

/// One chunk's sum of `f(x)`: 16 running sums, then added pairwise.
#[inline(always)]
pub(crate) fn chunk_sum<T: Copy, A: SumAcc>(c: &[T], f: impl Fn(T) -> A) -> A {
    let mut acc = [A::ZERO; LANES];
    let mut blocks = c.chunks_exact(LANES);
    for blk in &mut blocks {
        for (a, &x) in acc.iter_mut().zip(blk) {
            *a = *a + f(x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(blocks.remainder()) {
        *a = *a + f(x);
    }
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            acc[l] = acc[l] + acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// [`chunk_sum`] compiled for AVX-512: the 16 running sums are one vector, added to in the
/// same order, so the same bits. At the x86-64 baseline the loop ran on 4 lanes: the loss
/// `sum` of a bf16 `Linear(512, 2048)`'s output (8M elements) took 6% of its training step.
///
/// # Safety
/// The CPU has AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn chunk_sum_avx512<T: Copy, A: SumAcc>(c: &[T], f: impl Fn(T) -> A) -> A {
    chunk_sum(c, f)
}

/// [`chunk_sum`] at the SIMD level the kernels run at.
fn chunk_sum_at<T: Copy, A: SumAcc>(c: &[T], f: impl Fn(T) -> A, avx512: bool) -> A {
    #[cfg(target_arch = "x86_64")]
    if avx512 {
        // SAFETY: the SIMD level is AVX-512 only where the CPU has AVX-512F.
        return unsafe { chunk_sum_avx512(c, f) };
    }
    let _ = avx512;
    chunk_sum(c, f)
}

/// The chunk sums of `f(x)` added in order; `parallel` spreads the chunks over rayon's
/// threads (the same bits either way).
pub(crate) fn sum_chunks<T: Copy + Sync, A: SumAcc>(
    x: &[T],
    f: impl Fn(T) -> A + Sync + Copy,
    parallel: bool,
) -> A {
    let avx512 = crate::attention::simd_level() == crate::attention::SimdLevel::Avx512;
    if x.len() <= CHUNK {
        return chunk_sum_at(x, f, avx512);
    }
    let sums: Vec<A> = if parallel {
        x.par_chunks(CHUNK).map(|c| chunk_sum_at(c, f, avx512)).collect()
    } else {
        x.chunks(CHUNK).map(|c| chunk_sum_at(c, f, avx512)).collect()
    };
    sums.iter().fold(A::ZERO, |s, &c| s + c)
}

/// The sum of `x` in f32 (0 for an empty `x`; NaN and infinities propagate).
pub fn sum_f32(x: &[f32]) -> f32 {
    sum_chunks(x, |v| v, true)
}

/// The sum of the bf16 values `x` (their bits) in f32, each widened exactly.
pub fn sum_bf16(x: &[u16]) -> f32 {
    sum_chunks(x, bf16_bits_to_f32, true)
}

/// The same sums on one thread, chunk after chunk: the twin the tests compare with.
pub mod reference {
    use super::{chunk_sum, CHUNK};
    use crate::convert::bf16_bits_to_f32;

    /// [`super::sum_f32`] on one thread.
    pub fn sum_f32(x: &[f32]) -> f32 {
        if x.len() <= CHUNK {
            return chunk_sum(x, |v| v);
        }
        x.chunks(CHUNK).fold(0.0, |s, c| s + chunk_sum(c, |v| v))
    }

    /// [`super::sum_bf16`] on one thread.
    pub fn sum_bf16(x: &[u16]) -> f32 {
        if x.len() <= CHUNK {
            return chunk_sum(x, bf16_bits_to_f32);
        }
        x.chunks(CHUNK).fold(0.0, |s, c| s + chunk_sum(c, bf16_bits_to_f32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert::f32_to_bf16_bits;
    use crate::testutil::rand_vec;

    #[test]
    fn sums_match_the_twin_and_f64_for_any_thread_count() {
        for n in [0, 1, 15, 16, 17, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 77] {
            let x = rand_vec(n, n as u64 + 3);
            let bits: Vec<u16> = x.iter().map(|&v| f32_to_bf16_bits(v)).collect();
            let exact: f64 = x.iter().map(|&v| v as f64).sum();
            let exact_bf: f64 = bits.iter().map(|&b| bf16_bits_to_f32(b) as f64).sum();
            for threads in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                let pool = pool.expect("a thread pool");
                let (s, sb) = pool.install(|| (sum_f32(&x), sum_bf16(&bits)));
                assert_eq!(s.to_bits(), reference::sum_f32(&x).to_bits(), "n {n} t {threads}");
                assert_eq!(sb.to_bits(), reference::sum_bf16(&bits).to_bits(), "n {n}");
                // Within f32 rounding of the exact sum of |x| (each |x| < 1).
                let tol = 1e-6 * (n as f64 + 1.0);
                assert!((s as f64 - exact).abs() <= tol, "n {n}: {s} vs {exact}");
                assert!((sb as f64 - exact_bf).abs() <= tol, "n {n}: {sb} vs {exact_bf}");
            }
        }
        assert_eq!(sum_f32(&[]), 0.0);
        assert!(sum_f32(&[1.0, f32::NAN, 2.0]).is_nan());
        assert_eq!(sum_f32(&[1.0, f32::INFINITY]), f32::INFINITY);
        // The order is the documented one: 16 running sums, then pairwise.
        let x: Vec<f32> = (0..40).map(|i| if i == 0 { 1e8 } else { 1.0 }).collect();
        let mut lanes = [0f32; 16];
        for (i, &v) in x.iter().enumerate() {
            lanes[i % 16] += v;
        }
        for w in [8, 4, 2, 1] {
            for l in 0..w {
                lanes[l] += lanes[l + w];
            }
        }
        assert_eq!(sum_f32(&x), lanes[0]);
    }
}
