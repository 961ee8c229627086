//! Prints GFLOP/s of the bf16 GEMM and the measured `vdpbf16ps` rate against f32 FMA: for each
//! shape, the three products of a `Linear`'s training step, bf16 out, as the layers call them:
//! `y = x·Wᵀ` (forward), `dx = dy·W` and `dW = dyᵀ·x` (backward).
//!
//! `cargo run -p multihead-kernels --release --example bf16gemm [-- M N K [reps]]`, where the
//! layer maps `K` features to `N` over `M` rows (and the forward into f32); `ONLY=fwd`, `dx`,
//! `dw`, `dwt` (the weight gradient transposed, `xᵀ·dy`) or `fwd32` runs one product (for
//! `perf record`).

use std::time::Instant;

use multihead_kernels::bf16gemm::{
    active_bf16_kernel, bf16_dot_available, bf16_dot_speedup, matmul_bf16_new_with,
    matmul_bf16_to_bf16, BfMat,
};
use multihead_kernels::convert::f32_to_bf16_bits;
use multihead_kernels::epilogue::Act;

/// `len` bf16 values spread over [-0.5, 0.5).
fn values(len: usize, mul: usize, modulus: usize) -> Vec<u16> {
    (0..len).map(|i| f32_to_bf16_bits(((i * mul) % modulus) as f32 * 1e-3 - 0.5)).collect()
}

/// The fastest of `reps + 1` runs of `f`, in seconds.
fn best(
    reps: usize,
    mut f: impl FnMut() -> Result<(), multihead_kernels::attention::KernelError>,
) -> Result<f64, multihead_kernels::attention::KernelError> {
    let mut best = f64::INFINITY;
    for _ in 0..reps + 1 {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Keeps freed large blocks in the heap, as `multihead`'s allocator (`memory::ReuseLarge`) does:
/// otherwise each product's new output is fresh pages from the kernel, faulted in by the
/// epilogue's stores, which the library does not pay.
#[cfg(target_os = "linux")]
fn reuse_large_blocks() {
    // SAFETY: `mallopt` only changes glibc's thresholds; called before any other thread runs.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() -> Result<(), multihead_kernels::attention::KernelError> {
    #[cfg(target_os = "linux")]
    reuse_large_blocks();
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let shapes: Vec<[usize; 3]> = if args.len() >= 3 {
        vec![[args[0], args[1], args[2]]]
    } else {
        // The projections and feed-forward products of a 512-wide layer over 4096 tokens, and
        // a MiniLM batch (32 texts of 40 tokens, 384 wide).
        vec![[4096, 1536, 512], [4096, 2048, 512], [4096, 512, 2048], [1280, 1536, 384]]
    };
    let reps = args.get(3).copied().unwrap_or(10);
    println!(
        "avx512bf16: {}, vdpbf16ps rate / f32 FMA rate: {:?}, kernel {:?}",
        bf16_dot_available(),
        bf16_dot_speedup(),
        active_bf16_kernel()
    );
    for [m, n, k] in shapes {
        let x = values(m * k, 7919, 1000);
        let w = values(n * k, 104_729, 997);
        let dy = values(m * n, 15_485_863, 991);
        let (x, w, dy) = (BfMat::bf16(&x, m, k), BfMat::bf16(&w, n, k), BfMat::bf16(&dy, m, n));
        let only = std::env::var("ONLY").unwrap_or_default();
        let flop = 2.0 * (m * n * k) as f64 / 1e9;
        let products: [(&str, &str, BfMat, BfMat); 4] = [
            ("fwd", "y = x·Wᵀ", x, w.t()),
            ("dx", "dx = dy·W", dy, w),
            ("dw", "dW = dyᵀ·x", dy.t(), x),
            ("dwt", "dWᵀ = xᵀ·dy", x.t(), dy),
        ];
        for (name, what, a, b) in products.into_iter().filter(|p| only.is_empty() || only == p.0) {
            let t = best(reps, || matmul_bf16_to_bf16(a, b, None, Act::Identity).map(drop))?;
            println!(
                "m={m} n={n} k={k} {what} ({name}): {:.3} ms, {:.1} GFLOP/s",
                t * 1e3,
                flop / t
            );
        }
        // The weight gradient into f32 (blocks of `KC` deep, partial sums in the output).
        if only.is_empty() || only == "dw32" {
            let t = best(reps, || matmul_bf16_new_with(dy.t(), x, None, Act::Identity).map(drop))?;
            let what = "dW = dyᵀ·x, f32 out (dw32)";
            println!("m={m} n={n} k={k} {what}: {:.3} ms, {:.1} GFLOP/s", t * 1e3, flop / t);
        }
        // The forward with GELU fused into its bf16 output (a feed-forward block's first).
        if only.is_empty() || only == "fwdgelu" {
            let t = best(reps, || matmul_bf16_to_bf16(x, w.t(), None, Act::Gelu).map(drop))?;
            let what = "y = gelu(x·Wᵀ) (fwdgelu)";
            println!("m={m} n={n} k={k} {what}: {:.3} ms, {:.1} GFLOP/s", t * 1e3, flop / t);
        }
        // The forward into f32 (a product whose output a residual sum reads).
        if only.is_empty() || only == "fwd32" {
            let t = best(reps, || matmul_bf16_new_with(x, w.t(), None, Act::Identity).map(drop))?;
            let what = "y = x·Wᵀ, f32 out (fwd32)";
            println!("m={m} n={n} k={k} {what}: {:.3} ms, {:.1} GFLOP/s", t * 1e3, flop / t);
        }
    }
    Ok(())
}
