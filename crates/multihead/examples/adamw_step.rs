//! One `multihead::optim::AdamW` step over all-MiniLM-L6-v2's largest parameter shapes (31
//! parameters, 22.3M values: the word embeddings and six layers' projections), fastest of a
//! number of steps, printed as one JSON line. `tools/bench_optim.py` runs it beside
//! `torch.optim.AdamW` on the same shapes.
//!
//! `cargo run --release -p multihead --example adamw_step [-- --dtype f32|bf16 --amsgrad --steps N]`

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW};
use multihead::optim::AdamW;

/// The parameter shapes: MiniLM's word embeddings, then per layer the packed input
/// projection, the output projection, the two feed-forward matrices and a feed-forward bias.
fn shapes() -> Vec<Vec<usize>> {
    let mut s = vec![vec![30522, 384]];
    for _ in 0..6 {
        s.extend([vec![1152, 384], vec![384, 384], vec![1536, 384], vec![384, 1536], vec![1536]]);
    }
    s
}

fn main() -> candle_core::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
    let dtype = match value("--dtype").map(String::as_str) {
        Some("bf16") => DType::BF16,
        Some("f32") | None => DType::F32,
        Some(other) => {
            return Err(candle_core::Error::Msg(format!("--dtype {other}: f32 or bf16")))
        }
    };
    let steps: usize = value("--steps").and_then(|s| s.parse().ok()).unwrap_or(12);
    let amsgrad = args.iter().any(|a| a == "--amsgrad");
    let dev = Device::Cpu;
    let mut vars = Vec::new();
    let mut grads = Tensor::new(0f32, &dev)?.backward()?;
    for s in shapes() {
        let v = Var::from_tensor(&Tensor::randn(0f32, 1.0, s.as_slice(), &dev)?.to_dtype(dtype)?)?;
        grads.insert(v.as_tensor(), Tensor::randn(0f32, 1.0, s.as_slice(), &dev)?.to_dtype(dtype)?);
        vars.push(v);
    }
    let values: usize = vars.iter().map(|v| v.elem_count()).sum();
    let mut opt = AdamW::new(vars, ParamsAdamW::default())?.amsgrad(amsgrad);
    let mut best = f64::INFINITY;
    for _ in 0..steps {
        let t = Instant::now();
        multihead::on_pool(|| opt.step(&grads))?;
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
    }
    println!(
        "{{\"dtype\": \"{dtype:?}\", \"amsgrad\": {amsgrad}, \"values\": {values}, \"best_ms\": {best:.3}}}"
    );
    Ok(())
}
