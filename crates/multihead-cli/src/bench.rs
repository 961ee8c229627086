//! `multihead bench`: times `MultiheadAttention` (forward, or forward plus backward) on one
//! shape, the way `tools/bench_torch.py` times PyTorch.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use multihead::{Mask, MhaConfig, MhaOptions, MultiheadAttention};

/// The benchmark's settings.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Batch size N.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Target (query) length L.
    #[arg(long, default_value_t = 512)]
    pub tgt_len: usize,
    /// Source (key/value) length S; equal to L means self-attention.
    #[arg(long, default_value_t = 512)]
    pub src_len: usize,
    /// Embedding size E.
    #[arg(long, default_value_t = 512)]
    pub embed_dim: usize,
    /// Heads H.
    #[arg(long, default_value_t = 8)]
    pub num_heads: usize,
    /// Causal attention (a causal mask with the is_causal hint).
    #[arg(long)]
    pub causal: bool,
    /// Return the (head-averaged) attention weights.
    #[arg(long)]
    pub need_weights: bool,
    /// Time forward plus backward (gradients of inputs and parameters).
    #[arg(long)]
    pub backward: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Timed iterations.
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Untimed warm-up iterations.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Print one JSON line.
    #[arg(long)]
    pub json: bool,
}

/// Model flops of one call: projections `2·E²·(2·B·L + 2·B·S)`, attention core `4·B·L·S·E`
/// (halved when causal), times 3 with the backward.
pub fn model_flops(a: &BenchArgs) -> f64 {
    let (b, l, s, e) = (a.batch as f64, a.tgt_len as f64, a.src_len as f64, a.embed_dim as f64);
    let proj = 2.0 * e * e * (2.0 * b * l + 2.0 * b * s);
    let core = 4.0 * b * l * s * e * if a.causal { 0.5 } else { 1.0 };
    (proj + core) * if a.backward { 3.0 } else { 1.0 }
}

/// A `/proc/self/status` memory line (`VmHWM`: peak resident, `VmRSS`: current) in MiB.
fn status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

pub fn run(a: BenchArgs) -> Result<()> {
    if let Some(t) = a.threads {
        // candle's matmul and rayon both read this; set before any pool starts.
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
        rayon::ThreadPoolBuilder::new().num_threads(t).build_global().ok();
    }
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let cfg = MhaConfig::new(a.embed_dim, a.num_heads).with_batch_first(true);
    let mut mha = MultiheadAttention::new(cfg, VarBuilder::from_varmap(&vm, DType::F32, &dev))?;
    mha.eval();
    let q = Tensor::randn(0f32, 1.0, (a.batch, a.tgt_len, a.embed_dim), &dev)?;
    let kv = if a.src_len == a.tgt_len {
        q.clone()
    } else {
        Tensor::randn(0f32, 1.0, (a.batch, a.src_len, a.embed_dim), &dev)?
    };
    let mut opts = MhaOptions::default().need_weights(a.need_weights).average_attn_weights(true);
    if a.causal {
        let m = multihead::generate_square_subsequent_mask(a.tgt_len, DType::F32, &dev)?;
        let m = if a.src_len == a.tgt_len {
            m
        } else {
            let keep: Vec<f32> = (0..a.tgt_len)
                .flat_map(|i| {
                    (0..a.src_len).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 })
                })
                .collect();
            Tensor::from_vec(keep, (a.tgt_len, a.src_len), &dev)?
        };
        opts = opts.attn_mask(Mask::Float(m)).is_causal(!a.need_weights);
    }
    let qv = Var::from_tensor(&q)?;
    let kvv = if a.src_len == a.tgt_len { qv.clone() } else { Var::from_tensor(&kv)? };
    let step = || -> Result<()> {
        if a.backward {
            let out = mha.forward(qv.as_tensor(), kvv.as_tensor(), kvv.as_tensor(), &opts)?;
            let grads = out.output.sum_all()?.backward()?;
            std::hint::black_box(grads);
        } else {
            // Inference, as PyTorch's forward under torch.no_grad().
            let out = multihead::no_grad(|| mha.forward(&q, &kv, &kv, &opts))?;
            std::hint::black_box(out);
        }
        Ok(())
    };
    let baseline = status_mib("VmRSS:").context("reading memory")?;
    for _ in 0..a.warmup {
        step()?;
    }
    let mut times = Vec::with_capacity(a.iters);
    for _ in 0..a.iters.max(1) {
        let t = Instant::now();
        step()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let min = times[0];
    let median = times[times.len() / 2];
    let gflops = model_flops(&a) / (min * 1e-3) / 1e9;
    let rss = status_mib("VmHWM:").context("reading peak memory")?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "min_ms": min, "median_ms": median, "gflops": gflops, "peak_rss_mib": rss,
                "baseline_rss_mib": baseline,
                "threads": a.threads, "batch": a.batch, "tgt_len": a.tgt_len, "src_len": a.src_len,
                "embed_dim": a.embed_dim, "num_heads": a.num_heads, "causal": a.causal,
                "need_weights": a.need_weights, "backward": a.backward, "iters": times.len(),
            })
        );
    } else {
        println!(
            "MultiheadAttention {} B={} L={} S={} E={} H={}{}{}: min {min:.2} ms, median {median:.2} ms, {gflops:.1} GFLOP/s, peak RSS {rss:.0} MiB ({baseline:.0} MiB before the first call)",
            if a.backward { "forward+backward" } else { "forward" },
            a.batch,
            a.tgt_len,
            a.src_len,
            a.embed_dim,
            a.num_heads,
            if a.causal { " causal" } else { "" },
            if a.need_weights { " need_weights" } else { "" },
        );
    }
    Ok(())
}
