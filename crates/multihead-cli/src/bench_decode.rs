//! `multihead bench --module decode`: one incremental decoding step of `MultiheadAttention`
//! (`--new-tokens` new tokens per row) over a KV cache preloaded with `--src-len` tokens per
//! row, and the decode kernel alone over the same cache (for its memory bandwidth). With
//! `--layers N`, the step of a decoder-only (GPT-style) stack of N encoder layers instead
//! (`TransformerEncoder::forward_cached`, one cache per layer).

use std::cell::RefCell;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::transformer::TransformerEncoder;
use multihead::{KvCache, MhaConfig, MultiheadAttention};
use multihead_kernels::attention::Layout4;
use multihead_kernels::decode::{
    decode_attention, decode_attention_bf16, DecodeDims, DecodeParams,
};

use crate::bench::{randn, BenchArgs, Step};

/// Tokens appended per call while preloading the cache.
const PRELOAD_CHUNK: usize = 1024;

/// The timed step, and what the report adds: the kernel's own time and bandwidth, and the
/// bytes one step reads.
pub fn decode_workload(a: &BenchArgs) -> Result<(Step<'_>, serde_json::Value)> {
    if let Some(layers) = a.layers {
        return stack_workload(a, layers);
    }
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let mut cfg = MhaConfig::new(a.embed_dim, a.num_heads).with_batch_first(true);
    if let Some(k) = a.num_kv_heads {
        cfg = cfg.with_num_kv_heads(k);
    }
    let (hk, hd, kv) = (cfg.kv_heads(), cfg.head_dim(), cfg.kv_dim());
    let dt = a.candle_dtype();
    let mut mha = MultiheadAttention::new(cfg, VarBuilder::from_varmap(&vm, dt, &dev))?;
    mha.eval();
    let (b, s, e) = (a.batch, a.src_len, a.embed_dim);
    let t_new = a.new_tokens;
    let mut cache = mha.new_cache(b, s.saturating_add(t_new))?;
    preload(&mut cache, s)?;
    // The decode kernel reads f32 and bf16 caches (other dtypes take the composed path).
    let kernel_ms = match dt {
        DType::F32 | DType::BF16 => time_kernel(a, &cache)?,
        _ => f64::NAN,
    };
    let size = dt.size_in_bytes();
    let cache_bytes = 2.0 * (b * hk * s * hd * size) as f64;
    let weight_bytes = ((e * (e + 2 * kv) + e * e) * size) as f64;
    let read_share =
        a.window.map_or(1.0, |w| (w.saturating_add(1)).min(s.max(1)) as f64 / s.max(1) as f64);
    let extra = serde_json::json!({
        "num_kv_heads": hk,
        "cache_bytes": cache_bytes,
        "weight_bytes": weight_bytes,
        "attn_kernel_ms": kernel_ms,
        // The bytes a step reads: the window's keys and values only (whole chunks before it
        // are skipped; the chunk that holds its start is read from there).
        "attn_kernel_gbps": cache_bytes * read_share / (kernel_ms * 1e-3) / 1e9,
    });
    let x = randn(&[b, t_new, e], dt, &dev)?;
    let mut opts = multihead::multihead_attention::CachedOptions::default();
    opts.window = a.window;
    let cache = RefCell::new(cache);
    let step = move || -> Result<()> {
        let _keep = &vm;
        let mut c = cache.borrow_mut();
        let y = mha.forward_cached_with(&x, &mut c, None, &opts)?;
        std::hint::black_box(y);
        c.truncate(s)?; // the next step decodes the same positions again
        Ok(())
    };
    Ok((Box::new(step), extra))
}

/// Appends `s` random keys and values to every row of `cache`.
fn preload(cache: &mut KvCache, s: usize) -> Result<()> {
    let (b, hk, hd, dt) = (cache.batch_size(), cache.kv_heads(), cache.head_dim(), cache.dtype());
    let mut done = 0;
    while done < s {
        let t = PRELOAD_CHUNK.min(s - done);
        let k = randn(&[b, hk, t, hd], dt, &Device::Cpu)?;
        let v = randn(&[b, hk, t, hd], dt, &Device::Cpu)?;
        cache.append_kv(&k, &v, None)?;
        done += t;
    }
    Ok(())
}

/// The step of a decoder-only stack of `layers` encoder layers (post-norm unless
/// `--norm-first`; `--dim-feedforward`, `--activation`), each over its own cache preloaded
/// with `--src-len` random keys and values, and the decode kernel alone over one layer's cache.
fn stack_workload(a: &BenchArgs, layers: usize) -> Result<(Step<'_>, serde_json::Value)> {
    let dev = Device::Cpu;
    let vm = VarMap::new();
    let cfg = crate::bench::layer_config(a)?;
    let dt = a.candle_dtype();
    let mut stack =
        TransformerEncoder::new(cfg, layers, None, VarBuilder::from_varmap(&vm, dt, &dev))?;
    stack.eval();
    let (b, s, e, t_new) = (a.batch, a.src_len, a.embed_dim, a.new_tokens);
    let mut caches = stack.new_caches(b, s.saturating_add(t_new))?;
    for cache in &mut caches {
        preload(cache, s)?;
    }
    let kernel_ms = match (dt, caches.first()) {
        (DType::F32 | DType::BF16, Some(cache)) => time_kernel(a, cache)?,
        _ => f64::NAN,
    };
    let hd = e / a.num_heads.max(1);
    let extra = serde_json::json!({
        "layers": layers,
        "cache_bytes": (2 * layers * b * a.num_heads * s * hd * dt.size_in_bytes()) as f64,
        "weight_bytes": (layers * (4 * e * e + 2 * e * a.dim_feedforward) * dt.size_in_bytes()) as f64,
        "attn_kernel_ms": kernel_ms,
    });
    let x = randn(&[b, t_new, e], dt, &dev)?;
    let mut opts = multihead::multihead_attention::CachedOptions::default();
    opts.window = a.window;
    let caches = RefCell::new(caches);
    let step = move || -> Result<()> {
        let _keep = &vm;
        let mut c = caches.borrow_mut();
        let y = stack.forward_cached_with(&x, &mut c, None, &opts)?;
        std::hint::black_box(y);
        // The next step decodes the same positions again.
        c.iter_mut().try_for_each(|c| c.truncate(s))?;
        Ok(())
    };
    Ok((Box::new(step), extra))
}

/// The minimum time of the decode kernel alone, in ms: the step's rows (`--new-tokens`) at
/// positions `S..S + T`, causal over the `S` cached keys and themselves (slots the cache holds
/// zeroed until the step writes them), as the step runs them.
fn time_kernel(a: &BenchArgs, cache: &multihead::KvCache) -> Result<f64> {
    let (b, h, s, t) = (a.batch, a.num_heads, a.src_len, a.new_tokens);
    let (hk, hd, cap) = (cache.kv_heads(), cache.head_dim(), cache.capacity());
    // The cache's own elements: f32, or bf16 bits.
    let bits = |t: &Tensor| -> Result<Vec<u16>> {
        // bf16 -> f32 is exact, so rounding back gives the stored bits.
        let wide = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        Ok(wide.iter().map(|&x| multihead_kernels::convert::f32_to_bf16_bits(x)).collect())
    };
    let bf16 = cache.keys().dtype() == DType::BF16;
    let (k32, v32, k16, v16) = if bf16 {
        (Vec::new(), Vec::new(), bits(cache.keys())?, bits(cache.values())?)
    } else {
        let f = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
        (f(cache.keys())?, f(cache.values())?, Vec::new(), Vec::new())
    };
    let q = Tensor::randn(0f32, 1.0, b * h * t * hd, &Device::Cpu)?.to_vec1::<f32>()?;
    let mut out = vec![0f32; b * h * t * hd];
    let (kv_len, q_pos, q_len) = (vec![s.saturating_add(t); b], vec![s; b], vec![t; b]);
    let dims =
        DecodeDims { batch: b, heads_q: h, heads_kv: hk, rows: t, capacity: cap, d: hd, dv: hd };
    let mut p = DecodeParams::new(dims, &kv_len, &q_pos, &q_len);
    (p.scale, p.causal) = (1.0 / (hd as f32).sqrt(), true);
    p.window = a.window;
    let (ql, cl) = (Layout4::contiguous(h, t, hd), Layout4::contiguous(hk, cap, hd));
    let mut best = f64::INFINITY;
    for i in 0..a.warmup + a.iters.max(1) {
        let t = Instant::now();
        if bf16 {
            decode_attention_bf16(&p, &q, ql, &k16, cl, &v16, cl, &mut out, ql)?;
        } else {
            decode_attention(&p, &q, ql, &k32, cl, &v32, cl, &mut out, ql)?;
        }
        if i >= a.warmup {
            best = best.min(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    std::hint::black_box(&out);
    Ok(best)
}
