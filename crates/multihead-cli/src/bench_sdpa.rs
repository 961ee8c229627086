//! `multihead bench --module sdpa`: `F.scaled_dot_product_attention` on `(N, H, L, E/H)`
//! queries over `(N, H, S, E/H)` keys and values, with the variants (`--causal`, a sliding
//! `--window`, `--softcap`, `--alibi`, `--sinks`), forward under `no_grad`, or forward and backward (the gradients of
//! q, k and v).

use anyhow::Result;
use candle_core::{Device, Tensor, Var};
use multihead::functional::{
    explain_sdpa, scaled_dot_product_attention, varlen_attention, CuSeqlens, SdpaOptions,
};
use multihead::{CausalAlign, Variants};

use crate::bench::{randn, BenchArgs, Step};

/// The options the flags ask for: causal (top-left), a left window, a soft cap, ALiBi with the
/// paper's slopes, and `sinks` (a learned tensor, made by the caller).
fn options(a: &BenchArgs, sinks: Option<&Var>) -> SdpaOptions {
    let mut o = SdpaOptions::default().is_causal(a.causal).causal_align(CausalAlign::TopLeft);
    if let Some(w) = a.window {
        o = o.window(Some(w), None);
    }
    if let Some(c) = a.softcap {
        o = o.softcap(c);
    }
    if a.alibi {
        o = o.alibi(Variants::alibi_slopes_for(a.num_heads));
    }
    if let Some(s) = sinks {
        o = o.sinks(s.as_tensor().clone());
    }
    o
}

/// The sequence lengths of `--varlen`: `--batch` of them, log-uniform from 16 (or
/// `--tgt-len` when shorter) to `--tgt-len`, from a fixed hash of the index.
pub fn varlen_lengths(a: &BenchArgs) -> Vec<usize> {
    let (lo, hi) = (16f64.min(a.tgt_len as f64), a.tgt_len as f64);
    (0..a.batch as u64)
        .map(|b| {
            let mut x = b.wrapping_add(0x9e37_79b9_7f4a_7c15);
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let u = (x ^ (x >> 31)) as f64 / u64::MAX as f64;
            (lo * (hi / lo).powf(u)).round() as usize
        })
        .collect()
}

/// The (query, key) pairs attention visits per batch entry (the model flops are
/// `4·N·H·pairs·(E/H)`): all `L·S`, or those the causal diagonal and the window leave; with
/// `--varlen`, the sequences' own pairs averaged over the batch (padding counts nothing).
pub fn visible_pairs(a: &BenchArgs) -> f64 {
    if a.varlen {
        let lens = varlen_lengths(a);
        let one = |n: usize| {
            let b = BenchArgs { varlen: false, tgt_len: n, src_len: n, ..a.clone() };
            visible_pairs(&b)
        };
        return lens.iter().map(|&n| one(n)).sum::<f64>() / lens.len().max(1) as f64;
    }
    let (l, s) = (a.tgt_len as i64, a.src_len as i64);
    let right = if a.causal { 0 } else { s };
    let left = a.window.map_or(s, |w| w as i64);
    (0..l).map(|i| ((i + right).min(s - 1) - (i - left).max(0) + 1).max(0) as f64).sum()
}

/// The timed step, and what the report adds: the path and the variants.
pub fn sdpa_workload(a: &BenchArgs) -> Result<(Step<'_>, serde_json::Value)> {
    if a.varlen {
        return varlen_workload(a);
    }
    let dev = Device::Cpu;
    let dt = a.candle_dtype();
    let d = a.embed_dim / a.num_heads.max(1);
    let q = Var::from_tensor(&randn(&[a.batch, a.num_heads, a.tgt_len, d], dt, &dev)?)?;
    let k = Var::from_tensor(&randn(&[a.batch, a.num_heads, a.src_len, d], dt, &dev)?)?;
    let v = Var::from_tensor(&randn(&[a.batch, a.num_heads, a.src_len, d], dt, &dev)?)?;
    let sinks = match a.sinks {
        true => Some(Var::from_tensor(&randn(&[a.num_heads], dt, &dev)?)?),
        false => None,
    };
    let opts = options(a, sinks.as_ref());
    let plan = explain_sdpa(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)?;
    let extra = serde_json::json!({
        "window": a.window, "softcap": a.softcap,
        "path": format!("{:?}", plan.path),
        "visible_pairs": visible_pairs(a),
    });
    Ok((
        Box::new(move || -> Result<()> {
            let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
            if a.backward {
                let y = scaled_dot_product_attention(qt, kt, vt, &opts)?;
                std::hint::black_box(crate::bench::loss(&y)?.backward()?);
            } else {
                // Inference: inputs without a graph under no_grad, as PyTorch's forward-only
                // rows (tensors not requiring grad, `torch.no_grad()`).
                let (qt, kt, vt) = (qt.detach(), kt.detach(), vt.detach());
                let y = multihead::no_grad(|| scaled_dot_product_attention(&qt, &kt, &vt, &opts))?;
                std::hint::black_box(y);
            }
            Ok(())
        }),
        extra,
    ))
}

/// `--varlen`: the sequences packed through `varlen_attention`, or (`--padded`) padded to the
/// longest through SDPA with key lengths.
fn varlen_workload(a: &BenchArgs) -> Result<(Step<'_>, serde_json::Value)> {
    let (dev, dt) = (Device::Cpu, a.candle_dtype());
    let (h, d) = (a.num_heads, a.embed_dim / a.num_heads.max(1));
    let lens = varlen_lengths(a);
    let (total, max) = (lens.iter().sum::<usize>(), lens.iter().copied().max().unwrap_or(0));
    let cu = CuSeqlens::from_lengths(&lens);
    let sinks = match a.sinks {
        true => Some(Var::from_tensor(&randn(&[h], dt, &dev)?)?),
        false => None,
    };
    let mut opts = options(a, sinks.as_ref());
    let shape: Vec<usize> = if a.padded {
        opts = opts.kv_lengths(lens.clone());
        vec![a.batch, h, max, d]
    } else {
        vec![total, h, d]
    };
    let [q, k, v] =
        [0, 1, 2].map(|_| randn(&shape, dt, &dev).and_then(|t| Ok(Var::from_tensor(&t)?)));
    let (q, k, v) = (q?, k?, v?);
    let extra = serde_json::json!({
        "lengths": lens, "tokens": total, "padded_tokens": a.batch * max,
        "visible_pairs": visible_pairs(a), "sinks": a.sinks,
    });
    let padded = a.padded;
    let call = move |q: &Tensor, k: &Tensor, v: &Tensor| -> multihead::Result<Tensor> {
        match padded {
            true => scaled_dot_product_attention(q, k, v, &opts),
            false => varlen_attention(q, k, v, &cu, &cu, &opts),
        }
    };
    Ok((
        Box::new(move || -> Result<()> {
            let (qt, kt, vt) = (q.as_tensor(), k.as_tensor(), v.as_tensor());
            if a.backward {
                let y = call(qt, kt, vt)?;
                std::hint::black_box(crate::bench::loss(&y)?.backward()?);
            } else {
                // Inference, as above.
                let (qt, kt, vt) = (qt.detach(), kt.detach(), vt.detach());
                std::hint::black_box(multihead::no_grad(|| call(&qt, &kt, &vt))?);
            }
            Ok(())
        }),
        extra,
    ))
}
