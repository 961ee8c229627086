//! Prints GFLOP/s of the attention kernels.
//!
//! `cargo run -p multihead-kernels --release --example gflops [-- B H L S D [reps]]`
//!
//! Flops: forward `4·B·H·L·S·D` (halved when causal); forward+backward counted as 3x that.
//!
//! `LAYOUT=seq` reads q, k, v, dO and writes out, dq, dk, dv as `(B, L, H·D)` rows (what
//! `MultiheadAttention` passes), `LAYOUT=seq+P` with `P` floats of padding after each row
//! (`seq+1024` at H·D = 512 is the stride of a packed in-projection); the default is
//! `(B, H, L, D)`.

use std::time::Instant;

use multihead_kernels::attention::{
    detected_simd_level, flash_backward, flash_forward, with_simd_level, AttnDims, AttnParams,
    Layout4, MaskView, SimdLevel,
};
use multihead_kernels::dropout::DropoutKey;

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

struct Bufs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    lse: Vec<f32>,
    dout: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

fn min_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm up (scratch, page faults)
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
    }
    best
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let shapes: Vec<[usize; 5]> = if args.len() >= 5 {
        vec![[args[0], args[1], args[2], args[3], args[4]]]
    } else {
        vec![[8, 8, 512, 512, 64], [1, 8, 4096, 4096, 64], [32, 4, 128, 128, 64]]
    };
    let reps = args.get(5).copied().unwrap_or(5);
    let level = match std::env::var("LEVEL").as_deref() {
        Ok("scalar") => SimdLevel::Scalar,
        Ok("avx2") => SimdLevel::Avx2,
        _ => detected_simd_level(),
    };
    let threads: Vec<usize> = match std::env::var("THREADS") {
        Ok(t) => t.split(',').filter_map(|x| x.parse().ok()).collect(),
        Err(_) => vec![1, 2],
    };
    println!(
        "simd level: {level:?}, layout {:?}, mask {:?}, dropout {:?}",
        std::env::var("LAYOUT").ok(),
        std::env::var("MASK").ok(),
        std::env::var("DROPOUT").ok()
    );
    for [b, h, l, s, d] in shapes {
        let dims = AttnDims { batch: b, heads_q: h, heads_kv: h, l, s, d, dv: d };
        // LAYOUT: see the module docs.
        let pad = match std::env::var("LAYOUT").as_deref() {
            Ok("seq") => Some(0),
            Ok(x) => x.strip_prefix("seq+").and_then(|p| p.parse::<usize>().ok()),
            _ => None,
        };
        let (ql, kl) = if let Some(pad) = pad {
            let row = h * d + pad;
            (
                Layout4 { batch: l * row, head: d, seq: row },
                Layout4 { batch: s * row, head: d, seq: row },
            )
        } else {
            (Layout4::contiguous(h, l, d), Layout4::contiguous(h, s, d))
        };
        let mut x = Bufs {
            q: rand_vec(b * (h * d + pad.unwrap_or(0)) * l, 1),
            k: rand_vec(b * (h * d + pad.unwrap_or(0)) * s, 2),
            v: rand_vec(b * (h * d + pad.unwrap_or(0)) * s, 3),
            o: vec![0.0; b * (h * d + pad.unwrap_or(0)) * l],
            lse: vec![0.0; 2 * b * h * l],
            dout: rand_vec(b * (h * d + pad.unwrap_or(0)) * l, 4),
            dq: vec![0.0; b * (h * d + pad.unwrap_or(0)) * l],
            dk: vec![0.0; b * (h * d + pad.unwrap_or(0)) * s],
            dv: vec![0.0; b * (h * d + pad.unwrap_or(0)) * s],
        };
        // ONLY=fwd: skip the backward. MASK=keypad: a (B, S) bool key-padding mask (last eighth of keys masked);
        // MASK=add: an additive (L, S) float mask. DROPOUT=p: dropout with probability p.
        // BF16=1: bf16 products in the forward.
        let mask_kind = std::env::var("MASK").unwrap_or_default();
        let kp: Vec<u8> = (0..b * s).map(|x| (x % s >= s - s / 8) as u8).collect();
        let add: Vec<f32> = rand_vec(l * s, 9);
        let dropout: Option<f64> = std::env::var("DROPOUT").ok().and_then(|x| x.parse().ok());
        let causals: Vec<bool> = match std::env::var("CAUSAL").as_deref() {
            Ok("0") => vec![false],
            Ok("1") => vec![true],
            _ => vec![false, true],
        };
        for causal in causals {
            let mut p = AttnParams::new(dims);
            p.causal = causal;
            p.masks[0] = match mask_kind.as_str() {
                "keypad" => Some(MaskView::Bool {
                    data: &kp,
                    strides: [s, 0, 0, 1],
                    true_means_masked: true,
                }),
                "add" => Some(MaskView::Additive { data: &add, strides: [0, 0, s, 1] }),
                _ => None,
            };
            p.dropout = dropout.map(|pr| (pr, DropoutKey { seed: 1, offset: 2 }));
            // BF16=1: the forward's products with bf16 operands (use with ONLY=fwd).
            p.bf16_products = std::env::var("BF16").as_deref() == Ok("1");
            let flops = 4.0 * (b * h * l * s * d) as f64 * if causal { 0.5 } else { 1.0 };
            for &t in &threads {
                let pool =
                    rayon::ThreadPoolBuilder::new().num_threads(t).build().expect("thread pool");
                let (fwd, bwd) = pool.install(|| {
                    with_simd_level(level, || {
                        let fwd = min_ms(reps, || {
                            flash_forward(
                                &p, &x.q, ql, &x.k, kl, &x.v, kl, &mut x.o, ql, &mut x.lse,
                            )
                            .expect("valid arguments")
                        });
                        if std::env::var("ONLY").as_deref() == Ok("fwd") {
                            return (fwd, f64::NAN);
                        }
                        let bwd = min_ms(reps, || {
                            flash_backward(
                                &p, &x.q, ql, &x.k, kl, &x.v, kl, &x.o, ql, &x.dout, ql, &x.lse,
                                &mut x.dq, ql, &mut x.dk, kl, &mut x.dv, kl,
                            )
                            .expect("valid arguments")
                        });
                        (fwd, bwd)
                    })
                });
                let gf = |ms: f64, f: f64| f / ms / 1e6;
                println!(
                    "B={b} H={h} L={l} S={s} D={d} causal={causal:5} threads={t}: fwd {fwd:8.2} ms {:6.1} GFLOP/s | bwd {bwd:8.2} ms {:6.1} GFLOP/s (2.5x) | fwd+bwd {:8.2} ms {:6.1} GFLOP/s (3x)",
                    gf(fwd, flops),
                    gf(bwd, 2.0 * flops),
                    fwd + bwd,
                    gf(fwd + bwd, 3.0 * flops),
                );
            }
        }
    }
}
