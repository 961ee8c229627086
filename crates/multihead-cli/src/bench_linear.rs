//! `multihead bench --module linear`: `nn.Linear(E, F)` on `(N, L, E)` (`--embed-dim` in,
//! `--dim-feedforward` out), forward under `no_grad`, or forward and backward (the gradients
//! of the input, the weight and the bias), the way `tools/bench_torch.py` times PyTorch's.

use anyhow::Result;
use candle_core::{Device, Var};
use candle_nn::{VarBuilder, VarMap};
use multihead::Linear;

use crate::bench::{randn, BenchArgs, Step};

/// The timed step, and what the report adds: the bf16 micro-kernel the products ran on.
pub fn linear_workload(a: &BenchArgs) -> Result<(Step<'_>, serde_json::Value)> {
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let dt = a.candle_dtype();
    let lin =
        Linear::new(a.embed_dim, a.dim_feedforward, true, VarBuilder::from_varmap(&vm, dt, &dev))?;
    let x = Var::from_tensor(&randn(&[a.batch, a.tgt_len, a.embed_dim], dt, &dev)?)?;
    let extra = serde_json::json!({
        "in_features": a.embed_dim,
        "out_features": a.dim_feedforward,
        "bf16_kernel": format!("{:?}", multihead_kernels::bf16gemm::active_bf16_kernel()),
    });
    Ok((
        Box::new(move || -> Result<()> {
            let _keep = &vm;
            if a.backward {
                let y = lin.forward(x.as_tensor())?;
                std::hint::black_box(crate::bench::loss(&y)?.backward()?);
            } else {
                // Inference, as PyTorch's forward under torch.no_grad().
                std::hint::black_box(multihead::no_grad(|| lin.forward(x.as_tensor()))?);
            }
            Ok(())
        }),
        extra,
    ))
}
