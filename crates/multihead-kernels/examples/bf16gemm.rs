//! Prints GFLOP/s of the bf16 GEMM (`x·Wᵀ` with bf16 operands) and the measured `vdpbf16ps`
//! rate against f32 FMA.
//!
//! `cargo run -p multihead-kernels --release --example bf16gemm [-- M N K [reps]]`

use std::time::Instant;

use multihead_kernels::bf16gemm::{bf16_dot_available, bf16_dot_speedup, matmul_bf16, BfMat};
use multihead_kernels::convert::f32_to_bf16_bits;

fn main() -> Result<(), multihead_kernels::attention::KernelError> {
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
        "avx512bf16: {}, vdpbf16ps rate / f32 FMA rate: {:?}",
        bf16_dot_available(),
        bf16_dot_speedup()
    );
    for [m, n, k] in shapes {
        let x: Vec<u16> =
            (0..m * k).map(|i| f32_to_bf16_bits(((i * 7919) % 1000) as f32 * 1e-3 - 0.5)).collect();
        let w: Vec<u16> = (0..n * k)
            .map(|i| f32_to_bf16_bits(((i * 104_729) % 997) as f32 * 1e-3 - 0.5))
            .collect();
        let mut y = vec![0f32; m * n];
        let mut best = f64::INFINITY;
        for _ in 0..reps + 1 {
            let t = Instant::now();
            matmul_bf16(BfMat::bf16(&x, m, k), BfMat::bf16(&w, n, k).t(), &mut y, n, false)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        let gf = 2.0 * (m * n * k) as f64 / best / 1e9;
        println!("m={m} n={n} k={k}: {:.3} ms, {gf:.1} GFLOP/s", best * 1e3);
    }
    Ok(())
}
