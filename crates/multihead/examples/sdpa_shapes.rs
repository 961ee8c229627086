//! `F.scaled_dot_product_attention` on inputs that are not plain `(N, H, L, E)` batches, on the
//! fused kernels (`Backend::Auto`) and on the composed path (`Backend::Composed`, where these
//! calls ran before the fused path took them), alternated; forward under `no_grad`, fastest of
//! three rounds of five calls. Then the fused path with a float mask given three ways: `(L, S)`,
//! that mask expanded to `(N, H, L, S)` (a stride-0 view, as PyTorch code writes `expand`), and
//! a dense `(N, H, L, S)` mask; and a bool mask `(L, S)` and expanded.
//!
//! `cargo run --release -p multihead --example sdpa_shapes`

use candle_core::{Device, Result, Tensor};
use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
use multihead::Backend;

fn time(q: &Tensor, k: &Tensor, v: &Tensor, backend: Backend) -> Result<f64> {
    time_with(q, k, v, &SdpaOptions::default().backend(backend))
}

fn time_with(q: &Tensor, k: &Tensor, v: &Tensor, opts: &SdpaOptions) -> Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for _ in 0..5 {
            multihead::no_grad(|| scaled_dot_product_attention(q, k, v, opts))
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        }
        best = best.min(t.elapsed().as_secs_f64() / 5.0);
    }
    Ok(best)
}

fn main() -> Result<()> {
    let r = |d: &[usize]| Tensor::randn(0f32, 1.0, d, &Device::Cpu);
    let cases = [
        ("2-D (L, E) = (1024, 64)", [1024, 64].to_vec(), [1024, 64].to_vec()),
        ("3-D (H, L, E) = (8, 512, 64)", [8, 512, 64].to_vec(), [8, 512, 64].to_vec()),
        ("5-D (2, 4, 8, 256, 64)", [2, 4, 8, 256, 64].to_vec(), [2, 4, 8, 256, 64].to_vec()),
        (
            "keys shared over the batch: q (8, 8, 512, 64), k/v (1, 8, 512, 64)",
            [8, 8, 512, 64].to_vec(),
            [1, 8, 512, 64].to_vec(),
        ),
    ];
    for (what, qd, kd) in cases {
        let (q, k, v) = (r(&qd)?, r(&kd)?, r(&kd)?);
        let fused = time(&q, &k, &v, Backend::Auto)?;
        let composed = time(&q, &k, &v, Backend::Composed)?;
        println!(
            "{what}: fused {:.2} ms, composed {:.2} ms, {:.1}x",
            fused * 1e3,
            composed * 1e3,
            composed / fused
        );
    }
    let (n, h, l, e) = (8, 8, 512, 64);
    let (q, k, v) = (r(&[n, h, l, e])?, r(&[n, h, l, e])?, r(&[n, h, l, e])?);
    let small = r(&[l, l])?;
    let masks = [
        ("(L, S)", small.clone()),
        ("(L, S) expanded to (N, H, L, S)", small.broadcast_as((n, h, l, l))?),
        ("dense (N, H, L, S)", small.broadcast_as((n, h, l, l))?.contiguous()?),
    ];
    for (what, m) in masks {
        let opts = SdpaOptions::default().attn_mask(multihead::Mask::Float(m));
        let t = time_with(&q, &k, &v, &opts)?;
        println!("float mask {what}, (8, 8, 512, 64): fused {:.2} ms", t * 1e3);
    }
    let causal = small.ge(0.0)?; // a bool mask: about half the keys of each row
    let masks = [
        ("(L, S)", causal.clone()),
        ("(L, S) expanded to (N, H, L, S)", causal.broadcast_as((n, h, l, l))?),
    ];
    for (what, m) in masks {
        let opts = SdpaOptions::default().attn_mask(multihead::Mask::Bool(m));
        let t = time_with(&q, &k, &v, &opts)?;
        println!("bool mask {what}, (8, 8, 512, 64): fused {:.2} ms", t * 1e3);
    }
    Ok(())
}
