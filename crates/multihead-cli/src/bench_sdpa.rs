//! `multihead bench --module sdpa`: `F.scaled_dot_product_attention` on `(N, H, L, E/H)`
//! queries over `(N, H, S, E/H)` keys and values, with the variants (`--causal`, a sliding
//! `--window`, `--softcap`, `--alibi`, `--sinks`), forward under `no_grad`, or forward and backward (the gradients of
//! q, k and v).

use anyhow::Result;
use candle_core::{Device, Var};
use multihead::functional::{explain_sdpa, scaled_dot_product_attention, SdpaOptions};
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

/// The (query, key) pairs attention visits: all `L·S`, or those the causal diagonal and the
/// window leave (the model flops are `4·N·H·pairs·(E/H)`).
pub fn visible_pairs(a: &BenchArgs) -> f64 {
    let (l, s) = (a.tgt_len as i64, a.src_len as i64);
    let right = if a.causal { 0 } else { s };
    let left = a.window.map_or(s, |w| w as i64);
    (0..l).map(|i| ((i + right).min(s - 1) - (i - left).max(0) + 1).max(0) as f64).sum()
}

/// The timed step, and what the report adds: the path and the variants.
pub fn sdpa_workload(a: &BenchArgs) -> Result<(Step<'_>, serde_json::Value)> {
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
                let y = multihead::no_grad(|| scaled_dot_product_attention(qt, kt, vt, &opts))?;
                std::hint::black_box(y);
            }
            Ok(())
        }),
        extra,
    ))
}
