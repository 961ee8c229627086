//! Criterion benchmarks of the flash-attention kernels (f32, the global rayon pool).
//!
//! `cargo bench -p multihead-kernels --bench attention`. Throughput is reported in "elements"
//! = model flops (forward `4·B·H·L·S·D`, halved when causal; forward+backward 3x that), so
//! criterion's "elem/s" reads as flop/s.

use criterion::{criterion_main, Criterion, Throughput};
use multihead_kernels::attention::{flash_backward, flash_forward, AttnDims, AttnParams, Layout4};

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

fn bench_shape(c: &mut Criterion, b: usize, h: usize, l: usize, d: usize, causal: bool) {
    let dims = AttnDims { batch: b, heads_q: h, heads_kv: h, l, s: l, d, dv: d };
    let mut p = AttnParams::new(dims);
    p.causal = causal;
    let lay = Layout4::contiguous(h, l, d);
    let n = b * h * l * d;
    let (q, k, v, dout) = (rand_vec(n, 1), rand_vec(n, 2), rand_vec(n, 3), rand_vec(n, 4));
    let (mut o, mut lse) = (vec![0.0; n], vec![0.0; 2 * b * h * l]);
    let (mut dq, mut dk, mut dv) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let flops = 4 * (b * h * l * l * d) as u64 / if causal { 2 } else { 1 };
    let name = format!("B{b}_H{h}_L{l}_D{d}{}", if causal { "_causal" } else { "" });

    let mut g = c.benchmark_group("flash_forward");
    g.sample_size(10).throughput(Throughput::Elements(flops));
    g.bench_function(&name, |bench| {
        bench.iter(|| {
            flash_forward(&p, &q, lay, &k, lay, &v, lay, &mut o, lay, &mut lse)
                .expect("valid arguments")
        })
    });
    g.finish();

    let mut g = c.benchmark_group("flash_forward_backward");
    g.sample_size(10).throughput(Throughput::Elements(3 * flops));
    g.bench_function(&name, |bench| {
        bench.iter(|| {
            flash_forward(&p, &q, lay, &k, lay, &v, lay, &mut o, lay, &mut lse)
                .expect("valid arguments");
            flash_backward(
                &p, &q, lay, &k, lay, &v, lay, &o, lay, &dout, lay, &lse, &mut dq, lay, &mut dk,
                lay, &mut dv, lay,
            )
            .expect("valid arguments")
        })
    });
    g.finish();
}

fn attention(c: &mut Criterion) {
    bench_shape(c, 8, 8, 512, 64, false);
    bench_shape(c, 8, 8, 512, 64, true);
    bench_shape(c, 1, 8, 4096, 64, false);
    bench_shape(c, 1, 8, 4096, 64, true);
}

/// The criterion group (its generated function has no doc comment of its own).
#[allow(missing_docs)]
mod group {
    criterion::criterion_group!(benches, super::attention);
}
criterion_main!(group::benches);
