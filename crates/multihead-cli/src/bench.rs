//! `multihead bench`: times `MultiheadAttention`, `TransformerEncoderLayer`,
//! `TransformerDecoderLayer` or `Linear` (forward, or forward plus backward) on one shape, the way
//! `tools/bench_torch.py` times PyTorch.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use multihead::transformer::{
    DecoderMasks, LayerConfig, TransformerDecoderLayer, TransformerEncoderLayer,
};
use multihead::{Activation, Mask, MhaConfig, MhaOptions, MultiheadAttention};

/// What `multihead bench` times.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Module {
    /// `nn.MultiheadAttention` (query of length L over keys of length S).
    Mha,
    /// `nn.TransformerEncoderLayer` on `(N, L, E)`.
    EncoderLayer,
    /// `nn.TransformerDecoderLayer`: target `(N, L, E)` over memory `(N, S, E)`.
    DecoderLayer,
    /// One incremental decoding step of `MultiheadAttention` over a KV cache preloaded with S
    /// tokens per row: q/k/v projections of the new tokens (`--new-tokens`, default one),
    /// cache append, attention over the cached keys (each new token causal over the cache and
    /// the tokens before it), output projection.
    Decode,
    /// `nn.Linear(E, F)` on `(N, L, E)`: `--embed-dim` in, `--dim-feedforward` out, with a
    /// bias; `--backward` adds the gradients of the input, weight and bias.
    Linear,
    /// `F.scaled_dot_product_attention` on `(N, H, L, E/H)` over `(N, H, S, E/H)`, with
    /// `--causal`, `--window`, `--softcap`, `--alibi` and `--sinks`; `--backward` adds the
    /// gradients of q, k and v (and the sinks).
    Sdpa,
}

/// The benchmark's settings. Layers use dropout 0 and `batch_first`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The module to time.
    #[arg(long, value_enum, default_value_t = Module::Mha)]
    pub module: Module,
    /// `dim_feedforward` of the layers.
    #[arg(long, default_value_t = 2048)]
    pub dim_feedforward: usize,
    /// The layers' activation: relu or gelu (exact erf).
    #[arg(long, default_value = "relu")]
    pub activation: String,
    /// Pre-norm layers (`norm_first=True`, as ViT's blocks), with LayerNorm eps 1e-6.
    #[arg(long)]
    pub norm_first: bool,
    /// Evaluation: the module in eval mode, under `multihead::no_grad` (PyTorch's
    /// `module.eval()` and `torch.no_grad()`). Forward-only MHA runs are always this; forward-only
    /// layer runs without it run in training mode with gradients recorded.
    #[arg(long)]
    pub eval: bool,
    /// Pad keys: row b of N pads its last floor(b·S/(2N)) keys (up to half), with a bool key
    /// padding mask (the memory's for the decoder layer).
    #[arg(long)]
    pub key_padding: bool,
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
    /// Key/value heads for grouped-query attention (decode only; default H).
    #[arg(long)]
    pub num_kv_heads: Option<usize>,
    /// New tokens per step (decode only): 1 decodes one token per sequence, more is a prefill
    /// chunk (a prompt into the cache when `--src-len` is 0).
    #[arg(long, default_value_t = 1)]
    pub new_tokens: usize,
    /// Decode only: time the step of a decoder-only (GPT-style) stack of this many encoder
    /// layers (`TransformerEncoder::forward_cached`; `--dim-feedforward`, `--activation`,
    /// `--norm-first`) instead of `MultiheadAttention` alone.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Causal attention (a causal mask with the is_causal hint).
    #[arg(long)]
    pub causal: bool,
    /// Return the (head-averaged) attention weights.
    #[arg(long)]
    pub need_weights: bool,
    /// A sliding window (sdpa, decode): each query sees this many keys before its own (with
    /// `--causal`, Mistral's sliding window; decode: `CachedOptions::window` over the full cache).
    #[arg(long)]
    pub window: Option<usize>,
    /// A tanh soft cap on the scores (sdpa only), as Gemma 2's.
    #[arg(long)]
    pub softcap: Option<f64>,
    /// ALiBi with the paper's slopes for the heads (sdpa only).
    #[arg(long)]
    pub alibi: bool,
    /// Attention sinks, one learned logit per head (sdpa only; with `--backward`, their
    /// gradient too).
    #[arg(long)]
    pub sinks: bool,
    /// A learned additive mask (mha only): an `(L, S)` float `attn_mask` that is a `Var` (a
    /// relative-position bias, as T5's); with `--backward`, its gradient too.
    #[arg(long)]
    pub learned_mask: bool,
    /// Variable-length sequences (sdpa only): `--batch` sequences of lengths drawn
    /// log-uniformly from 16 to `--tgt-len` (seeded; mean about 143 for 512), packed and run
    /// through `varlen_attention`.
    #[arg(long)]
    pub varlen: bool,
    /// With `--varlen`: the same sequences padded to the longest, through SDPA with key
    /// lengths (what a padded batch costs).
    #[arg(long)]
    pub padded: bool,
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
    /// The parameter and input dtype: f32 or bf16 (bf16 computes each operation in f32 and
    /// rounds once; its products, forward and backward, take bf16 operands where the CPU's
    /// bf16 dot product outruns f32 FMA, or as `MULTIHEAD_BF16_PRODUCTS=direct|widened` says;
    /// the decode module keeps its cache in this dtype).
    #[arg(long, value_enum, default_value_t = DTypeArg::F32)]
    pub dtype: DTypeArg,
}

/// `--dtype` (of `bench` and `embed`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DTypeArg {
    /// float32.
    F32,
    /// bfloat16.
    Bf16,
}

impl DTypeArg {
    /// The candle dtype.
    pub fn candle(self) -> DType {
        match self {
            DTypeArg::F32 => DType::F32,
            DTypeArg::Bf16 => DType::BF16,
        }
    }
}

impl BenchArgs {
    /// The candle dtype of `--dtype`.
    pub fn candle_dtype(&self) -> DType {
        self.dtype.candle()
    }
}

/// Standard normal values of `dtype`.
pub fn randn(dims: &[usize], dtype: DType, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1.0, dims, dev)?.to_dtype(dtype)?)
}

/// Model flops of one call, times 3 with the backward. Attention over `l` queries and `s`
/// keys: projections `2·E²·(2·B·l + 2·B·s)`, core `4·B·l·s·E` (halved when causal). The
/// encoder layer adds the feed-forward block `4·B·L·E·F`; the decoder layer is self-attention
/// (L over L, causal when asked), cross-attention (L over S) and the feed-forward block.
/// `Linear` is `2·B·L·E·F` (its backward: `dx` and `dW`, twice that again).
pub fn model_flops(a: &BenchArgs) -> f64 {
    let (b, l, s, e) = (a.batch as f64, a.tgt_len as f64, a.src_len as f64, a.embed_dim as f64);
    let f = a.dim_feedforward as f64;
    let attn = |l: f64, s: f64, causal: bool| {
        2.0 * e * e * (2.0 * b * l + 2.0 * b * s)
            + 4.0 * b * l * s * e * if causal { 0.5 } else { 1.0 }
    };
    let ff = 4.0 * b * l * e * f;
    let fwd = match a.module {
        Module::Mha => attn(l, s, a.causal),
        Module::EncoderLayer => attn(l, l, a.causal) + ff,
        Module::DecoderLayer => attn(l, l, a.causal) + attn(l, s, false) + ff,
        Module::Decode => {
            // New token t sees the S cached keys and the t + 1 new ones up to itself.
            let (kv, t) = (decode_kv_dim(a) as f64, a.new_tokens as f64);
            let attn = 2.0 * b * t * e * (2.0 * e + 2.0 * kv)
                + 4.0 * b * (t * s + t * (t + 1.0) / 2.0) * e;
            match a.layers {
                Some(n) => n as f64 * (attn + 4.0 * b * t * e * f),
                None => attn,
            }
        }
        Module::Linear => 2.0 * b * l * e * f,
        Module::Sdpa => 4.0 * b * crate::bench_sdpa::visible_pairs(a) * e,
    };
    fwd * if a.backward { 3.0 } else { 1.0 }
}

/// The scalar a backward run starts from: the sum of the output, accumulated in f32 as
/// PyTorch's `out.sum()` accumulates a bf16 tensor ([`multihead::sum_f32`]: on every thread,
/// with a backward that writes the gradient out whole, as PyTorch's `out.sum().backward()`
/// costs little next to the module). candle's `sum_all` sums on one thread and its broadcast
/// gradient is added into zeros: 10-13% of a bf16 `Linear` or SDPA training step here. f64
/// (and f16) outputs take candle's sums.
pub fn loss(out: &Tensor) -> Result<Tensor> {
    Ok(match out.dtype() {
        DType::F32 | DType::BF16 => multihead::sum_f32(out)?,
        DType::F64 => out.sum_all()?,
        _ => multihead::cast(out, DType::F32)?.sum_all()?,
    })
}

/// `(N, len)` bool key padding: row b pads its last floor(b·len/(2N)) keys.
fn key_padding(n: usize, len: usize, dev: &Device) -> Result<Mask> {
    let mut pad = vec![0u8; n * len];
    for b in 0..n {
        let k = b * len / (2 * n);
        pad[b * len + len - k..(b + 1) * len].iter_mut().for_each(|x| *x = 1);
    }
    Ok(Mask::Bool(Tensor::from_vec(pad, (n, len), dev)?))
}

/// A `/proc/self/status` memory line (`VmHWM`: peak resident, `VmRSS`: current) in MiB.
fn status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

pub fn run(a: BenchArgs) -> Result<()> {
    check_sizes(&a)?;
    if let Some(t) = a.threads {
        // candle's matmul and rayon both read this; set before any pool starts.
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
        rayon::ThreadPoolBuilder::new().num_threads(t).build_global().ok();
    }
    let (step, extra) = workload(&a)?;
    let baseline = status_mib("VmRSS:").context("reading memory")?;
    for _ in 0..a.warmup {
        step()?;
    }
    let mut times = Vec::with_capacity(a.iters);
    for _ in 0..a.iters {
        let t = Instant::now();
        step()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    report(&a, times, baseline, extra)
}

/// The size flags in range, and the inputs (and the feed-forward activations) within the
/// memory available, before anything is allocated.
fn check_sizes(a: &BenchArgs) -> Result<()> {
    use crate::limits::{fits, in_range};
    if let Some(t) = a.threads {
        in_range("--threads", t, 1, 1024)?;
    }
    in_range("--iters", a.iters, 1, 1_000_000)?;
    in_range("--warmup", a.warmup, 0, 1_000_000)?;
    in_range("--batch", a.batch, 1, usize::MAX)?;
    in_range("--tgt-len", a.tgt_len, 1, usize::MAX)?;
    // A decode run may start from an empty cache.
    let min_src = usize::from(a.module != Module::Decode);
    in_range("--src-len", a.src_len, min_src, usize::MAX)?;
    in_range("--new-tokens", a.new_tokens, 1, usize::MAX)?;
    if a.module != Module::Decode && a.new_tokens != 1 {
        anyhow::bail!("--new-tokens applies to --module decode only (the others take --tgt-len)");
    }
    let rows = a.tgt_len.max(a.new_tokens).saturating_add(a.src_len);
    let sizes = "--batch, --tgt-len (or --new-tokens), --src-len, --embed-dim";
    fits(sizes, &[a.batch, rows, a.embed_dim], 6)?;
    let variant = a.softcap.is_some() || a.alibi || a.sinks || a.varlen;
    if a.module != Module::Sdpa && (variant || a.window.is_some() && a.module != Module::Decode) {
        anyhow::bail!(
            "--softcap, --alibi, --sinks and --varlen apply to --module sdpa only, --window to sdpa and decode"
        );
    }
    // A decoding step is inference over a cache: it has no backward, weights, masks or causal
    // flag to take (they were accepted and ignored, and the report said "forward+backward").
    if a.module == Module::Decode && (a.backward || a.need_weights || a.causal || a.key_padding) {
        anyhow::bail!(
            "--backward, --need-weights, --causal and --key-padding do not apply to --module \
             decode (one inference step over a cache, causal by construction)"
        );
    }
    if a.learned_mask && (a.module != Module::Mha || a.causal) {
        anyhow::bail!(
            "--learned-mask is an (L, S) bias for --module mha, without --causal (fold a causal \
             band into the bias instead)"
        );
    }
    // Flags a module would take and ignore (the report would describe a run it did not make).
    if a.module != Module::Decode && a.num_kv_heads.is_some() {
        anyhow::bail!("--num-kv-heads applies to --module decode only");
    }
    if let Some(n) = a.layers {
        if a.module != Module::Decode {
            anyhow::bail!("--layers applies to --module decode only (a decoder-only stack's step)");
        }
        if a.num_kv_heads.is_some() {
            anyhow::bail!(
                "--layers takes no --num-kv-heads (the layers' attention has as many key/value \
                 heads as query heads, as PyTorch's)"
            );
        }
        in_range("--layers", n, 1, 1024)?;
        fits(
            "--batch, --new-tokens, --dim-feedforward",
            &[a.batch, a.new_tokens, a.dim_feedforward],
            3,
        )?;
    }
    if a.module == Module::Linear && (a.causal || a.key_padding || a.need_weights) {
        anyhow::bail!(
            "--causal, --key-padding and --need-weights do not apply to --module linear (a \
             product, with no attention)"
        );
    }
    // The (L, S) masks an MHA run builds: a learned bias (with its copies and gradient), or a
    // causal mask of L != S (its values and the tensor).
    if a.module == Module::Mha && (a.learned_mask || a.causal) {
        fits("--tgt-len, --src-len", &[a.tgt_len, a.src_len], if a.learned_mask { 4 } else { 3 })?;
    }
    if a.padded && !a.varlen {
        anyhow::bail!("--padded pads the sequences of --varlen; give both");
    }
    if a.varlen && a.tgt_len != a.src_len {
        anyhow::bail!("--varlen runs self-attention: give --src-len = --tgt-len");
    }
    if matches!(a.module, Module::EncoderLayer | Module::DecoderLayer | Module::Linear) {
        fits("--batch, --tgt-len, --dim-feedforward", &[a.batch, a.tgt_len, a.dim_feedforward], 3)?;
    }
    Ok(())
}

/// One timed call of the chosen module.
pub type Step<'a> = Box<dyn Fn() -> Result<()> + 'a>;

fn workload(a: &BenchArgs) -> Result<(Step<'_>, serde_json::Value)> {
    match a.module {
        Module::Mha => mha_workload(a),
        Module::EncoderLayer | Module::DecoderLayer => {
            Ok((layer_workload(a)?, serde_json::json!({})))
        }
        Module::Decode => crate::bench_decode::decode_workload(a),
        Module::Linear => crate::bench_linear::linear_workload(a),
        Module::Sdpa => crate::bench_sdpa::sdpa_workload(a),
    }
}

/// The projected key/value width `Hkv·E/H` of a decode run.
pub fn decode_kv_dim(a: &BenchArgs) -> usize {
    a.num_kv_heads.unwrap_or(a.num_heads) * (a.embed_dim / a.num_heads.max(1))
}

/// Runs `f` the way the flags ask: under `no_grad` when evaluating.
fn graded<T>(a: &BenchArgs, f: impl FnOnce() -> T) -> T {
    if a.eval && !a.backward {
        multihead::no_grad(f)
    } else {
        f()
    }
}

/// The layers' configuration the flags ask for: `batch_first`, dropout 0, `--dim-feedforward`,
/// `--activation`, and pre-norm with eps 1e-6 under `--norm-first`.
pub fn layer_config(a: &BenchArgs) -> Result<LayerConfig> {
    let cfg = LayerConfig::new(a.embed_dim, a.num_heads)
        .with_dim_feedforward(a.dim_feedforward)
        .with_dropout(0.0)
        .with_activation(Activation::from_name(&a.activation)?)
        .with_batch_first(true);
    Ok(if a.norm_first { cfg.with_norm_first(true).with_layer_norm_eps(1e-6) } else { cfg })
}

fn layer_workload(a: &BenchArgs) -> Result<Step<'_>> {
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let cfg = layer_config(a)?;
    let dt = a.candle_dtype();
    let vb = VarBuilder::from_varmap(&vm, dt, &dev);
    let x = Var::from_tensor(&randn(&[a.batch, a.tgt_len, a.embed_dim], dt, &dev)?)?;
    let memory = Var::from_tensor(&randn(&[a.batch, a.src_len, a.embed_dim], dt, &dev)?)?;
    let training = !a.eval || a.backward;
    let kpm =
        |len| if a.key_padding { key_padding(a.batch, len, &dev).map(Some) } else { Ok(None) };
    let causal = match a.causal {
        true => Some(Mask::Float(multihead::generate_square_subsequent_mask(a.tgt_len, dt, &dev)?)),
        false => None,
    };
    let run: Box<dyn Fn() -> Result<Tensor>> = if a.module == Module::EncoderLayer {
        let mut layer = TransformerEncoderLayer::new(cfg, vb)?;
        layer.train(training);
        let pad = kpm(a.tgt_len)?;
        let x = x.as_tensor().clone();
        Box::new(move || Ok(layer.forward(&x, causal.as_ref(), pad.as_ref(), causal.is_some())?))
    } else {
        let mut layer = TransformerDecoderLayer::new(cfg, vb)?;
        layer.train(training);
        let masks = DecoderMasks {
            tgt_is_causal: Some(causal.is_some()),
            tgt_mask: causal,
            memory_key_padding_mask: kpm(a.src_len)?,
            ..Default::default()
        };
        let (x, memory) = (x.as_tensor().clone(), memory.as_tensor().clone());
        Box::new(move || Ok(layer.forward(&x, &memory, &masks)?))
    };
    let _keep = vm;
    Ok(Box::new(move || {
        let out = graded(a, &run)?;
        if a.backward {
            std::hint::black_box(loss(&out)?.backward()?);
        } else {
            std::hint::black_box(out);
        }
        Ok(())
    }))
}

/// The MHA call, and the path it takes (`{"path": "Fused"}`).
fn mha_workload(a: &BenchArgs) -> Result<(Step<'_>, serde_json::Value)> {
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let cfg = MhaConfig::new(a.embed_dim, a.num_heads).with_batch_first(true);
    let dt = a.candle_dtype();
    let mut mha = MultiheadAttention::new(cfg, VarBuilder::from_varmap(&vm, dt, &dev))?;
    mha.eval();
    let q = randn(&[a.batch, a.tgt_len, a.embed_dim], dt, &dev)?;
    let kv = if a.src_len == a.tgt_len {
        q.clone()
    } else {
        randn(&[a.batch, a.src_len, a.embed_dim], dt, &dev)?
    };
    let mut opts = MhaOptions::default().need_weights(a.need_weights).average_attn_weights(true);
    if a.causal {
        let m = if a.src_len == a.tgt_len {
            multihead::generate_square_subsequent_mask(a.tgt_len, dt, &dev)?
        } else {
            let keep: Vec<f32> = (0..a.tgt_len)
                .flat_map(|i| {
                    (0..a.src_len).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 })
                })
                .collect();
            Tensor::from_vec(keep, (a.tgt_len, a.src_len), &dev)?.to_dtype(dt)?
        };
        opts = opts.attn_mask(Mask::Float(m)).is_causal(!a.need_weights);
    }
    if a.key_padding {
        opts = opts.key_padding_mask(key_padding(a.batch, a.src_len, &dev)?);
    }
    // Kept alive by the closure: the bias's gradient is part of the backward.
    let bias = if a.learned_mask {
        let b = Var::from_tensor(&(randn(&[a.tgt_len, a.src_len], dt, &dev)? * 0.5)?)?;
        opts = opts.attn_mask(Mask::Float(b.as_tensor().clone()));
        Some(b)
    } else {
        None
    };
    let qv = Var::from_tensor(&q)?;
    let kvv = if a.src_len == a.tgt_len { qv.clone() } else { Var::from_tensor(&kv)? };
    let plan = if a.backward {
        mha.explain(qv.as_tensor(), kvv.as_tensor(), kvv.as_tensor(), &opts)?
    } else {
        multihead::no_grad(|| mha.explain(&q, &kv, &kv, &opts))?
    };
    let extra = serde_json::json!({ "path": format!("{:?}", plan.path) });
    let step: Step<'_> = Box::new(move || -> Result<()> {
        let _keep = (&vm, &bias);
        if a.backward {
            let out = mha.forward(qv.as_tensor(), kvv.as_tensor(), kvv.as_tensor(), &opts)?;
            let grads = loss(&out.output)?.backward()?;
            std::hint::black_box(grads);
        } else {
            // Inference, as PyTorch's forward under torch.no_grad().
            let out = multihead::no_grad(|| mha.forward(&q, &kv, &kv, &opts))?;
            std::hint::black_box(out);
        }
        Ok(())
    });
    Ok((step, extra))
}

/// Prints the timing (one line, or one JSON object).
fn report(
    a: &BenchArgs,
    mut times: Vec<f64>,
    baseline: f64,
    extra: serde_json::Value,
) -> Result<()> {
    times.sort_by(f64::total_cmp);
    let min = times[0];
    let median = times[times.len() / 2];
    let gflops = model_flops(a) / (min * 1e-3) / 1e9;
    let rss = status_mib("VmHWM:").context("reading peak memory")?;
    if a.json {
        let mut obj = serde_json::json!({
                "min_ms": min, "median_ms": median, "gflops": gflops, "peak_rss_mib": rss,
                "baseline_rss_mib": baseline,
                "threads": a.threads, "batch": a.batch, "tgt_len": a.tgt_len, "src_len": a.src_len, "new_tokens": a.new_tokens,
                "embed_dim": a.embed_dim, "num_heads": a.num_heads, "causal": a.causal,
                "need_weights": a.need_weights, "backward": a.backward, "iters": times.len(),
                "module": format!("{:?}", a.module), "dim_feedforward": a.dim_feedforward,
                "activation": a.activation, "eval": a.eval, "key_padding": a.key_padding,
                "norm_first": a.norm_first,
                "num_kv_heads": a.num_kv_heads, "window": a.window, "softcap": a.softcap,
                "alibi": a.alibi, "sinks": a.sinks, "varlen": a.varlen, "padded": a.padded,
                "learned_mask": a.learned_mask,
                "dtype": format!("{:?}", a.candle_dtype()),
                "bf16_products": multihead::bf16_products(),
                "bf16_kernel": format!("{:?}", multihead_kernels::bf16gemm::active_bf16_kernel()),
                "bf16_dot_speedup": multihead_kernels::bf16gemm::bf16_dot_speedup(),
                "bf16_products_plan": multihead::explain_bf16_products().to_string(),
        });
        if let (Some(o), Some(x)) = (obj.as_object_mut(), extra.as_object()) {
            o.extend(x.clone());
        }
        say!("{obj}");
    } else if a.module == Module::Linear {
        say!(
            "Linear({}, {}) {} on ({}, {}, {}) {:?}: min {min:.2} ms, median {median:.2} ms, {gflops:.1} GFLOP/s, peak RSS {rss:.0} MiB ({baseline:.0} MiB before the first call)",
            a.embed_dim,
            a.dim_feedforward,
            if a.backward { "forward+backward" } else { "forward" },
            a.batch,
            a.tgt_len,
            a.embed_dim,
            a.candle_dtype(),
        );
        say!("  {extra}");
    } else {
        say!(
            "{:?} {} B={} L={} S={} E={} H={}{}{}: min {min:.2} ms, median {median:.2} ms, {gflops:.1} GFLOP/s, peak RSS {rss:.0} MiB ({baseline:.0} MiB before the first call)",
            a.module,
            if a.backward { "forward+backward" } else { "forward" },
            a.batch,
            if a.module == Module::Decode { a.new_tokens } else { a.tgt_len },
            // The encoder layer's attention is over its own sequence: --src-len plays no part.
            if a.module == Module::EncoderLayer { a.tgt_len } else { a.src_len },
            a.embed_dim,
            a.num_heads,
            if a.causal { " causal" } else { "" },
            if a.need_weights { " need_weights" } else { "" },
        );
        let variant = |name: &str, x: Option<String>| x.map(|x| format!(" {name} {x}"));
        let variants = [
            variant("layers", a.layers.map(|n| format!("{n} F={}", a.dim_feedforward))),
            variant("window", a.window.map(|w| w.to_string())),
            variant("softcap", a.softcap.map(|c| c.to_string())),
            a.alibi.then(|| " alibi".to_string()),
            a.sinks.then(|| " sinks".to_string()),
            a.varlen.then(|| format!(" varlen {:?}", crate::bench_sdpa::varlen_lengths(a))),
            a.padded.then(|| " padded".to_string()),
            a.learned_mask.then(|| " learned-mask".to_string()),
        ];
        let variants: String = variants.into_iter().flatten().collect();
        if !variants.is_empty() {
            say!("  variants:{variants}");
        }
        if extra.as_object().is_some_and(|o| !o.is_empty()) {
            say!("  {extra}");
        }
    }
    if a.candle_dtype() == DType::BF16 && !a.json {
        say!("  {}", multihead::explain_bf16_products());
    }
    Ok(())
}
