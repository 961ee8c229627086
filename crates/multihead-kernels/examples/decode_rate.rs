//! The decode kernel's rate over an f32 cache: one new token per sequence (or `rows` of
//! them), `B` sequences, `H` query heads over `K` key/value heads, a cache of `S` keys,
//! `d = 64`. Prints the fastest call of each case, the cache bytes read per second and the
//! model flops per second (`4·B·H·rows·S·d`):
//!
//! ```sh
//! cargo run --release -p multihead-kernels --example decode_rate -- [B H K S rows]
//! ```
//!
//! Without arguments it runs the shapes of BENCHMARKS.md's decode table (B=1 S=4096 and
//! S=32768, H=8 over K = 8, 2 and 1). Threads: `RAYON_NUM_THREADS`; `VARIANT=softcap|alibi|sinks`
//! adds a soft cap of 30, ALiBi or sinks (slopes and sinks `2^-(h+1)` per head).

use std::time::Instant;

use multihead_kernels::attention::Layout4;
use multihead_kernels::decode::{decode_attention, DecodeDims, DecodeParams};

fn case(b: usize, h: usize, k: usize, s: usize, rows: usize) {
    let d = 64;
    let dims = DecodeDims { batch: b, heads_q: h, heads_kv: k, rows, capacity: s, d, dv: d };
    let q: Vec<f32> = (0..b * h * rows * d).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.05).collect();
    let kv: Vec<f32> = (0..b * k * s * d).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.1).collect();
    let (kv_len, q_pos, q_len) = (vec![s; b], vec![s - rows; b], vec![rows; b]);
    let mut p = DecodeParams::new(dims, &kv_len, &q_pos, &q_len);
    p.causal = true;
    let per_head: Vec<f32> = (0..h).map(|i| 0.5f32.powi(i as i32 + 1)).collect();
    match std::env::var("VARIANT").as_deref() {
        Ok("softcap") => p.softcap = Some(30.0),
        Ok("alibi") => p.alibi = Some(&per_head),
        Ok("sinks") => p.sinks = Some(&per_head),
        _ => {}
    }
    let mut out = vec![0f32; b * h * rows * d];
    let (ql, cl) = (Layout4::contiguous(h, rows, d), Layout4::contiguous(k, s, d));
    let iters = (2_000_000_000 / (b * h * rows * s * d * 4).max(1)).clamp(20, 5000);
    let mut best = f64::INFINITY;
    for _ in 0..iters {
        let t = Instant::now();
        if let Err(e) = decode_attention(&p, &q, ql, &kv, cl, &kv, cl, &mut out, ql) {
            eprintln!("decode_rate: {e}");
            return;
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let bytes = (2 * b * k * s * d * 4) as f64;
    let flops = (4 * b * h * rows * s * d) as f64;
    println!(
        "B={b} H={h} K={k} S={s} rows={rows}: {:.4} ms, {:.1} GB/s, {:.1} GFLOP/s (checksum {:.6})",
        best * 1e3,
        bytes / best / 1e9,
        flops / best / 1e9,
        out.iter().map(|&x| x as f64).sum::<f64>()
    );
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    if let [b, h, k, s, rows] = args[..] {
        case(b, h, k, s, rows);
        return;
    }
    for s in [4096, 32768] {
        for k in [8, 2, 1] {
            case(1, 8, k, s, 1);
        }
    }
    case(8, 8, 2, 4096, 1);
    case(1, 32, 8, 4096, 1);
}
