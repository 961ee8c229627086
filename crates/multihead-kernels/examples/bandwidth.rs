//! The machine's read bandwidth, measured the way attention over a KV cache reads: each thread
//! streams its share of one f32 buffer once, summing it. Run it with the sizes of the caches you
//! benchmark (a buffer that fits the last-level cache reads faster than one that does not):
//!
//! ```sh
//! cargo run --release -p multihead-kernels --example bandwidth -- 16 128 1024   # MiB
//! ```
//!
//! Prints one line per size: the best of at least 20 passes (and 8 GiB read), in GB/s, with the rayon pool's threads
//! (`RAYON_NUM_THREADS`).

use std::time::Instant;

use rayon::prelude::*;

/// Sums a slice with 64 independent partial sums, which the compiler vectorises.
#[inline(always)]
fn sum_generic(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 64];
    let mut chunks = xs.chunks_exact(64);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// [`sum_generic`] compiled for AVX-512, so that a core's loads, not its adds, are the limit.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(xs: &[f32]) -> f32 {
    sum_generic(xs)
}

/// The widest sum this CPU runs (chosen at run time).
fn sum(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F (checked just above).
        return unsafe { sum_avx512(xs) };
    }
    sum_generic(xs)
}

fn main() {
    let sizes: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let sizes = if sizes.is_empty() { vec![16, 128, 1024] } else { sizes };
    let threads = rayon::current_num_threads();
    for mib in sizes {
        let n = mib * (1 << 20) / 4;
        let buf = vec![1f32; n];
        let per = n.div_ceil(threads);
        let mut best = f64::INFINITY;
        let mut total = 0.0;
        // At least 20 passes and 8 GiB read, so that small buffers are timed often enough.
        let passes = (8usize << 30).div_ceil(n * 4).max(20);
        for _ in 0..passes {
            let t = Instant::now();
            total += buf.par_chunks(per).map(sum).sum::<f32>();
            best = best.min(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(total);
        println!(
            "{{\"mib\": {mib}, \"threads\": {threads}, \"gbps\": {:.2}}}",
            (n * 4) as f64 / best / 1e9
        );
    }
}
