//! `nn.MultiheadAttention` with a learned additive mask (a relative-position bias in the graph,
//! as in T5 or Swin), one training step (forward and backward of `sum(out)`), on the fused
//! kernels (`Backend::Auto`) and on the composed path (`Backend::Composed`, where these calls
//! ran before the fused path took them), alternated; fastest of three rounds of three steps.
//!
//! `cargo run --release -p multihead --example mha_learned_mask`

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use multihead::functional::MhaOptions;
use multihead::{Backend, Mask, MhaConfig, MultiheadAttention};

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn step(m: &MultiheadAttention, x: &Var, bias: &Var, backend: Backend) -> Res<()> {
    let opts = MhaOptions::default()
        .need_weights(false)
        .attn_mask(Mask::Float(bias.as_tensor().clone()))
        .backend(backend);
    let x = x.as_tensor();
    let out = m.forward(x, x, x, &opts)?.output;
    let grads = out.sum_all()?.backward()?;
    // The bias's gradient exists on both paths.
    grads.get(bias.as_tensor()).ok_or("no gradient for the learned mask")?;
    Ok(())
}

fn time(m: &MultiheadAttention, x: &Var, bias: &Var, backend: Backend) -> Res<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        for _ in 0..3 {
            step(m, x, bias, backend)?;
        }
        best = best.min(t.elapsed().as_secs_f64() / 3.0);
    }
    Ok(best)
}

fn main() -> Res<()> {
    let dev = Device::Cpu;
    // (what, N, L, E, H, mask dims)
    let cases = [
        ("T5-like: N=8, L=S=256, E=512, H=8, bias (L, S)", 8, 256, 512, 8, vec![256, 256]),
        (
            "Swin-like windows: N=64, L=S=49, E=96, H=3, bias (N*H, L, S)",
            64,
            49,
            96,
            3,
            vec![192, 49, 49],
        ),
    ];
    for (what, n, l, e, h, mdims) in cases {
        let vm = VarMap::new();
        let m = MultiheadAttention::new(
            MhaConfig::new(e, h).with_batch_first(true),
            VarBuilder::from_varmap(&vm, DType::F32, &dev),
        )?;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (n, l, e), &dev)?)?;
        let bias = Var::from_tensor(&Tensor::randn(0f32, 0.5, mdims.as_slice(), &dev)?)?;
        let fused = time(&m, &x, &bias, Backend::Auto)?;
        let composed = time(&m, &x, &bias, Backend::Composed)?;
        println!(
            "{what}: fused {:.2} ms, composed {:.2} ms, {:.2}x",
            fused * 1e3,
            composed * 1e3,
            composed / fused
        );
    }
    Ok(())
}
