//! The f32 rate of the products `Linear` runs on (the gemm crate), one thread, on the
//! projection and feed-forward shapes of a 512-wide layer over 4096 tokens and of a ViT-B/16
//! layer over 8 × 197 tokens: GFLOP/s of `C (m×n) = A (m×k) · B (k×n)`, fastest of 12 calls.
//! Compare with the machine's f32 FMA peak per core (`peak.c` over its thread count) and with
//! PyTorch's `torch.matmul` under `torch.set_num_threads(1)` on the same shapes.
//!
//! `cargo run --release -p multihead --example gemm_rate [-- M N K]`

use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let shapes: Vec<[usize; 3]> = match args[..] {
        [m, n, k, ..] => vec![[m, n, k]],
        _ => vec![
            [4096, 1536, 512],
            [4096, 2048, 512],
            [4096, 512, 2048],
            [1576, 2304, 768],
            [1576, 3072, 768],
            [1576, 768, 3072],
        ],
    };
    for [m, n, k] in shapes {
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 104_729) % 997) as f32 * 1e-3 - 0.5).collect();
        let mut c = vec![0f32; m * n];
        let mut best = f64::INFINITY;
        for _ in 0..12 {
            let t = Instant::now();
            // SAFETY: `a` is m×k, `b` k×n and `c` m×n, all row-major and as long as the
            // strides below address; `c` does not overlap the operands.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    a.as_ptr(),
                    1,
                    k as isize,
                    b.as_ptr(),
                    1,
                    n as isize,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        let gf = 2.0 * (m * n * k) as f64 / best / 1e9;
        println!("m={m} n={n} k={k}: {:.2} ms, {gf:.1} GFLOP/s", best * 1e3);
    }
}
