//! Naive f64 twins of the attention entry points, for tests.
//!
//! Plain loops that materialise the full `[batch, heads_q, l, s]` score matrix and compute the
//! gradients by the textbook formulas (`dS = P∘(dP − rowsum(P∘dP))` with `dP = m∘(dO vᵀ)`).
//! Inputs use the same strided layouts as the kernels; outputs are contiguous f64 arrays.

use super::{AttnParams, Layout4, MaskView};
use crate::dropout::keep_from_row;

fn mask_at(m: &MaskView<'_>, b: usize, h: usize, i: usize, j: usize) -> f64 {
    let st = m.strides();
    let idx = b * st[0] + h * st[1] + i * st[2] + j * st[3];
    match m {
        MaskView::Additive { data, .. } => data[idx] as f64,
        MaskView::Bool { data, true_means_masked, .. } => {
            if (data[idx] != 0) == *true_means_masked {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        }
    }
}

/// Whether key `j` is hidden from query `i` of batch entry `b` by its index: causal, the
/// window (both around `i + offset`) or the batch entry's key length.
pub fn hidden(p: &AttnParams<'_>, b: usize, i: usize, j: usize) -> bool {
    let rel = j as i128 - i as i128 - p.offset as i128;
    let right = if p.causal { Some(0) } else { p.window.right };
    right.is_some_and(|r| rel > r as i128)
        || p.window.left.is_some_and(|w| rel < -(w as i128))
        || p.kv_lengths.is_some_and(|n| j >= n[b])
}

/// The ALiBi bias `−m_h·|i + offset − j|` (0 without slopes).
pub fn alibi(p: &AttnParams<'_>, h: usize, i: usize, j: usize) -> f64 {
    p.alibi.map_or(0.0, |m| -(m[h] as f64) * (i as f64 + p.offset as f64 - j as f64).abs())
}

/// The scores `scale·q·k` (soft-capped), plus the masks and the ALiBi bias, plus `-inf` where [`hidden`],
/// `[batch, heads_q, l, s]`.
pub fn scores(p: &AttnParams<'_>, q: &[f32], ql: Layout4, k: &[f32], kl: Layout4) -> Vec<f64> {
    let d = p.dims;
    let g = d.heads_q / d.heads_kv.max(1);
    let mut out = vec![0.0; d.batch * d.heads_q * d.l * d.s];
    for b in 0..d.batch {
        for h in 0..d.heads_q {
            let hk = h / g;
            for i in 0..d.l {
                for j in 0..d.s {
                    let qo = ql.offset(b, h, i);
                    let ko = kl.offset(b, hk, j);
                    let dot: f64 = (0..d.d).map(|c| q[qo + c] as f64 * k[ko + c] as f64).sum();
                    let mut x = p.scale as f64 * dot;
                    let mask: f64 = p.masks.iter().flatten().map(|m| mask_at(m, b, h, i, j)).sum();
                    let mask = mask + alibi(p, h, i, j);
                    x = match p.softcap {
                        Some(c) if p.softcap_after_masks => cap_keeping_neg_inf(x + mask, c as f64),
                        Some(c) => c as f64 * (x / c as f64).tanh() + mask,
                        None => x + mask,
                    };
                    if hidden(p, b, i, j) {
                        x += f64::NEG_INFINITY;
                    }
                    out[((b * d.heads_q + h) * d.l + i) * d.s + j] = x;
                }
            }
        }
    }
    out
}

/// The softmax probabilities (before dropout) `[batch, heads_q, l, s]` and the row log-sum-exp
/// `[batch, heads_q, l]` (`+inf` and `P = 0` for fully masked rows).
pub fn probabilities(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
) -> (Vec<f64>, Vec<f64>) {
    let d = p.dims;
    let mut s = scores(p, q, ql, k, kl);
    let mut lse = vec![f64::INFINITY; d.batch * d.heads_q * d.l];
    if d.s == 0 {
        return (s, lse);
    }
    for (r, row) in s.chunks_mut(d.s).enumerate() {
        // The sink joins the row (gpt-oss: a column cut off after the softmax).
        let sink = p.sinks.map_or(f64::NEG_INFINITY, |x| x[(r / d.l) % d.heads_q] as f64);
        // A NaN score (a NaN key, or +inf + -inf) makes the whole row NaN, as in PyTorch.
        if row.iter().any(|x| x.is_nan()) || sink.is_nan() || sink == f64::INFINITY {
            row.iter_mut().for_each(|x| *x = f64::NAN);
            lse[r] = f64::NAN;
            continue;
        }
        let mx = row.iter().cloned().fold(sink, f64::max);
        if mx == f64::NEG_INFINITY {
            row.iter_mut().for_each(|x| *x = 0.0);
            lse[r] = f64::INFINITY;
            continue;
        }
        let mut sum = (sink - mx).exp();
        for x in row.iter_mut() {
            *x = (*x - mx).exp();
            sum += *x;
        }
        row.iter_mut().for_each(|x| *x /= sum);
        lse[r] = mx + sum.ln();
    }
    (s, lse)
}

/// The dropout multipliers `[batch, heads_q, l, s]` (all 1 without dropout).
pub fn dropout_multipliers(p: &AttnParams<'_>) -> Vec<f64> {
    let d = p.dims;
    let mut m = vec![1.0; d.batch * d.heads_q * d.l * d.s];
    if let Some((pr, key)) = p.dropout.filter(|(pr, _)| *pr > 0.0) {
        let kept = 1.0 / (1.0 - pr);
        for bh in 0..d.batch * d.heads_q {
            for i in 0..d.l {
                let state = key.row_state(bh as u64, i as u64);
                for j in 0..d.s {
                    m[(bh * d.l + i) * d.s + j] =
                        if keep_from_row(state, j as u64, pr) { kept } else { 0.0 };
                }
            }
        }
    }
    m
}

/// The forward: `out` `[batch, heads_q, l, dv]` and `lse` `[batch, heads_q, l]`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
) -> (Vec<f64>, Vec<f64>) {
    let d = p.dims;
    let g = d.heads_q / d.heads_kv.max(1);
    let (pr, lse) = probabilities(p, q, ql, k, kl);
    let m = dropout_multipliers(p);
    let mut out = vec![0.0; d.batch * d.heads_q * d.l * d.dv];
    for b in 0..d.batch {
        for h in 0..d.heads_q {
            for i in 0..d.l {
                let r = (b * d.heads_q + h) * d.l + i;
                for j in 0..d.s {
                    let w = pr[r * d.s + j] * m[r * d.s + j];
                    let vo = vl.offset(b, h / g, j);
                    for c in 0..d.dv {
                        out[r * d.dv + c] += w * v[vo + c] as f64;
                    }
                }
            }
        }
    }
    (out, lse)
}

/// The attention weights (`P∘m`), `[batch, heads_q, l, s]`, or averaged over heads
/// `[batch, 1, l, s]`.
pub fn weights(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    average_heads: bool,
) -> Vec<f64> {
    let d = p.dims;
    let (pr, _) = probabilities(p, q, ql, k, kl);
    let m = dropout_multipliers(p);
    let w: Vec<f64> = pr.iter().zip(&m).map(|(a, b)| a * b).collect();
    if !average_heads {
        return w;
    }
    let n = d.l * d.s;
    let mut avg = vec![0.0; d.batch * n];
    for b in 0..d.batch {
        for h in 0..d.heads_q {
            for x in 0..n {
                avg[b * n + x] += w[(b * d.heads_q + h) * n + x];
            }
        }
        for x in 0..n {
            avg[b * n + x] /= d.heads_q as f64;
        }
    }
    avg
}

/// The backward: `(dq [batch, heads_q, l, d], dk [batch, heads_kv, s, d], dv [batch, heads_kv,
/// s, dv])`, contiguous, from the textbook formulas.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    dout: &[f32],
    dol: Layout4,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (dq, dk, dv, _) = backward_with_dscores(p, q, ql, k, kl, v, vl, dout, dol);
    (dq, dk, dv)
}

/// [`backward`] and the gradient of the scores where the masks are added, `[batch, heads_q, l,
/// s]` (the gradient of a per-`(batch, head)` additive mask).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn backward_with_dscores(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    dout: &[f32],
    dol: Layout4,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let d = p.dims;
    let g = d.heads_q / d.heads_kv.max(1);
    let (pr, _) = probabilities(p, q, ql, k, kl);
    let m = dropout_multipliers(p);
    let mut dq = vec![0.0; d.batch * d.heads_q * d.l * d.d];
    let mut dk = vec![0.0; d.batch * d.heads_kv * d.s * d.d];
    let mut dvv = vec![0.0; d.batch * d.heads_kv * d.s * d.dv];
    let mut dsc = vec![0.0; d.batch * d.heads_q * d.l * d.s];
    let scale = p.scale as f64;
    let mut dp = vec![0.0; d.s];
    for b in 0..d.batch {
        for h in 0..d.heads_q {
            let hk = h / g;
            for i in 0..d.l {
                let r = (b * d.heads_q + h) * d.l + i;
                let doo = dol.offset(b, h, i);
                // dP_ij = m_ij (dO_i · v_j)
                for (j, x) in dp.iter_mut().enumerate() {
                    let vo = vl.offset(b, hk, j);
                    let dot: f64 = (0..d.dv).map(|c| dout[doo + c] as f64 * v[vo + c] as f64).sum();
                    *x = m[r * d.s + j] * dot;
                }
                let rowsum: f64 = (0..d.s).map(|j| pr[r * d.s + j] * dp[j]).sum();
                for j in 0..d.s {
                    let pij = pr[r * d.s + j];
                    let mut ds = pij * (dp[j] - rowsum);
                    if let Some(c) = p.softcap {
                        // Through the cap: d(c·tanh(x/c))/dx = 1 − tanh²(x/c).
                        let mut x = p.scale as f64 * dot_qk(q, ql, k, kl, (b, h, hk, i, j), d.d);
                        if p.softcap_after_masks {
                            let masks = p.masks.iter().flatten();
                            x += masks.map(|m| mask_at(m, b, h, i, j)).sum::<f64>();
                            x += alibi(p, h, i, j);
                        }
                        if !p.softcap_after_masks {
                            dsc[r * d.s + j] = ds;
                        }
                        // Also at an infinite score (an infinite key), where the slope is 0 and
                        // the key's `0·inf` makes the query's gradient NaN, as autograd's
                        // through `tanh` does (a hidden `-inf` entry has `P = 0` and `dS = 0`
                        // either way).
                        ds *= 1.0 - (x / c as f64).tanh().powi(2);
                    }
                    if p.softcap.is_none() || p.softcap_after_masks {
                        dsc[r * d.s + j] = ds;
                    }
                    let ko = kl.offset(b, hk, j);
                    let qo = ql.offset(b, h, i);
                    let kr = ((b * d.heads_kv + hk) * d.s + j) * d.d;
                    for c in 0..d.d {
                        dq[r * d.d + c] += scale * ds * k[ko + c] as f64;
                        dk[kr + c] += scale * ds * q[qo + c] as f64;
                    }
                    let vr = ((b * d.heads_kv + hk) * d.s + j) * d.dv;
                    let w = pij * m[r * d.s + j];
                    for c in 0..d.dv {
                        dvv[vr + c] += w * dout[doo + c] as f64;
                    }
                }
            }
        }
    }
    (dq, dk, dvv, dsc)
}

/// The gradient of the sinks, `heads_q` values: `dsink_h = −Σ_{b,i} P_sink · Σ_j P_ij·dP_ij`,
/// the softmax gradient of the sink's column (its value is zero, so its `dP` is 0).
#[allow(clippy::too_many_arguments)]
pub fn sink_grad(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    dout: &[f32],
    dol: Layout4,
) -> Vec<f64> {
    let d = p.dims;
    let g = d.heads_q / d.heads_kv.max(1);
    let (pr, lse) = probabilities(p, q, ql, k, kl);
    let m = dropout_multipliers(p);
    let mut out = vec![0.0; d.heads_q];
    let Some(sinks) = p.sinks else { return out };
    for b in 0..d.batch {
        for (h, acc) in out.iter_mut().enumerate() {
            for i in 0..d.l {
                let r = (b * d.heads_q + h) * d.l + i;
                let doo = dol.offset(b, h, i);
                let rowsum: f64 = (0..d.s)
                    .map(|j| {
                        let vo = vl.offset(b, h / g, j);
                        let dot: f64 =
                            (0..d.dv).map(|c| dout[doo + c] as f64 * v[vo + c] as f64).sum();
                        pr[r * d.s + j] * m[r * d.s + j] * dot
                    })
                    .sum();
                let ps = (sinks[h] as f64 - lse[r]).exp();
                *acc -= ps * rowsum;
            }
        }
    }
    out
}

/// `q[b, h, i] · k[b, hk, j]` over `d` channels.
fn dot_qk(
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    (b, h, hk, i, j): (usize, usize, usize, usize, usize),
    d: usize,
) -> f64 {
    let (qo, ko) = (ql.offset(b, h, i), kl.offset(b, hk, j));
    (0..d).map(|c| q[qo + c] as f64 * k[ko + c] as f64).sum()
}

/// `c·tanh(x/c)`, with `-inf` kept (a masked entry stays masked).
fn cap_keeping_neg_inf(x: f64, c: f64) -> f64 {
    if x == f64::NEG_INFINITY {
        x
    } else {
        c * (x / c).tanh()
    }
}
