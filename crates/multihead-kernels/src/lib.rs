//! Framework-free CPU kernels for multi-head attention.
//!
//! This crate holds the pieces of `multihead` that work on plain slices and know nothing about
//! tensors or autograd. Every kernel has a naive reference twin beside it, and the tests compare
//! the two.
//!
//! It holds the fused (flash) attention kernels ([`attention`]: forward, backward and the
//! attention-weights pass, with run-time AVX-512 / AVX2 / scalar dispatch), LayerNorm forward
//! and backward ([`norm`]), GELU and ReLU forward and backward ([`activation`]), the
//! bias-and-activation pass after a linear layer's product ([`epilogue`]), attention of a few
//! new rows over a KV cache ([`decode`]), products of a few rows with a weight ([`gemv`]), a
//! packed GEMM of bf16 operands on AVX512-BF16 ([`bf16gemm`]), bf16 conversions ([`convert`]), sums over broadcast dimensions ([`reduce`]), the sum of a vector in f32 ([`sum`]) and the counter-based dropout generator ([`dropout`]), which
//! the attention forward and backward share so that a backward pass can regenerate the
//! forward's mask without storing it.
//!
//! ```
//! use multihead_kernels::dropout::DropoutKey;
//!
//! let key = DropoutKey { seed: 42, offset: 0 };
//! // Whether element (batch*heads index 3, row 1, column 7) is kept at p = 0.1:
//! let kept = key.keep(3, 1, 7, 0.1);
//! assert_eq!(kept, key.keep(3, 1, 7, 0.1)); // the same key always gives the same answer
//! ```

pub mod activation;
pub(crate) mod aligned;
pub mod attention;
pub mod bf16gemm;
pub mod clip;
pub mod convert;
pub mod decode;
pub mod dropout;
pub(crate) mod elem;
pub mod epilogue;
pub(crate) mod fpenv;
pub mod gemv;
pub mod norm;
pub mod optim;
pub mod reduce;
pub mod sum;
pub mod vector_norm;

/// Helpers shared by the kernel tests.
#[cfg(test)]
pub(crate) mod testutil {
    use crate::attention::{detected_simd_level, SimdLevel};

    /// Every SIMD level this CPU runs, scalar first.
    pub(crate) fn levels() -> Vec<SimdLevel> {
        [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
            .into_iter()
            .filter(|&l| l <= detected_simd_level())
            .collect()
    }

    /// Deterministic pseudo-random floats in `[-1, 1)` (xorshift).
    pub(crate) fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The other operands of a GEMM test over an `m × k` `A`: a random `k × n` `B`, a bias of
    /// `n` and a starting `m × n` `C`.
    pub(crate) fn gemm_operands(m: usize, n: usize, k: usize) -> [Vec<f32>; 3] {
        [rand_vec(k * n, (k * n + 1) as u64), rand_vec(n, 5), rand_vec(m * n, 3)]
    }

    /// A rayon pool of `threads` threads.
    pub(crate) fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool")
    }

    /// `m` rows of `k` random bf16 values, `rs >= k` elements apart, each row's elements past
    /// `k` a NaN (a kernel reading past the view's depth shows in its output).
    pub(crate) fn bf16_rows_nan_past(m: usize, k: usize, rs: usize) -> Vec<u16> {
        rand_vec(m * rs, (m * k) as u64)
            .iter()
            .enumerate()
            .map(|(i, &x)| if i % rs >= k { 0x7fc0 } else { crate::convert::f32_to_bf16_bits(x) })
            .collect()
    }
}
