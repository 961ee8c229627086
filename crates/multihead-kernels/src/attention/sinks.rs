//! Attention sinks (gpt-oss): a learned logit per head that joins every row's softmax
//! denominator and carries no value. The forward folds it into each row's statistics
//! ([`row_end`]), so the backward and the weights pass recompute the same probabilities with no
//! change; the sink's own gradient is [`sink_grad`].

use super::{check_params, check_tensor, product, AttnParams, KernelError, Layout4};

/// How a finished query row is written: the factor on its accumulated output (`None`: a zero
/// row) and its statistics `(max, Σ)` before the log (the caller stores `(max, ln Σ)`, and
/// takes the log only when it keeps the statistics), from its running `(max, sum)`; `dead`
/// when no key was seen (a zero row). A finite `sink` joins the sum; `-inf` (or none) changes
/// nothing; NaN or `+inf` makes the row NaN, as a softmax over a row holding it does.
pub(crate) fn row_end(
    dead: bool,
    (m, l): (f32, f32),
    sink: Option<f32>,
) -> (Option<f32>, (f32, f32)) {
    // `ln` of each second member gives the statistics: ln ∞ = ∞, ln 1 = 0, ln NaN = NaN.
    let plain = || match (dead, l == 0.0) {
        (true, _) => (None, (0.0, f32::INFINITY)),
        (false, true) => (Some(1.0), (0.0, f32::INFINITY)),
        (false, false) => (Some(1.0 / l), (m, l)),
    };
    match sink {
        None => plain(),
        Some(s) if s == f32::NEG_INFINITY => plain(),
        Some(s) if !s.is_finite() => (Some(f32::NAN), (f32::NAN, f32::NAN)),
        // Only the sink: every key weight is 0 and the sink's is 1.
        Some(s) if dead => (None, (s, 1.0)),
        Some(s) if l == 0.0 => (Some(1.0), (s, 1.0)),
        Some(s) => {
            let top = m.max(s);
            let a = (m - top).exp();
            let sum = l * a + (s - top).exp();
            (Some(a / sum), (top, sum))
        }
    }
}

/// The gradient of the attention sinks ([`AttnParams::sinks`]): `dsinks[h] = −Σ_{b,i}
/// P_sink[b,h,i] · D[b,h,i]`, with `P_sink = exp(sink_h − max − ln Σ)` from the forward's row
/// statistics `lse` and `D = rowsum(dO ∘ O)` (the sink's value is zero, so its `dP` is 0).
///
/// `out`, `lse` are what [`flash_forward`](super::flash_forward) returned with these
/// parameters and `dout` the gradient of `out` (`[batch, heads_q, l, dv]` each through its
/// layout). Writes `heads_q` values; sums in f64, in a fixed order (the same bits for any
/// thread count).
///
/// # Example
/// ```
/// use multihead_kernels::attention::{flash_forward, sink_grad, AttnDims, AttnParams, Layout4};
///
/// let dims = AttnDims { batch: 1, heads_q: 1, heads_kv: 1, l: 2, s: 2, d: 1, dv: 1 };
/// let lay = Layout4::contiguous(1, 2, 1);
/// let (q, k, v) = ([0.0f32; 2], [0.0f32; 2], [1.0f32, 3.0]);
/// let mut p = AttnParams::new(dims);
/// let sinks = [0.0f32];
/// p.sinks = Some(&sinks);
/// let (mut out, mut lse) = (vec![0f32; 2], vec![0f32; 4]);
/// flash_forward(&p, &q, lay, &k, lay, &v, lay, &mut out, lay, &mut lse)?;
/// // Two keys and the sink share each row equally: out = (1 + 3) / 3.
/// assert!((out[0] - 4.0 / 3.0).abs() < 1e-6);
/// let mut dsinks = [0f32];
/// sink_grad(&p, &out, lay, &[1.0, 1.0], lay, &lse, &mut dsinks)?;
/// // d out / d sink = -P_sink · out per row: -(1/3)(4/3), twice.
/// assert!((dsinks[0] + 8.0 / 9.0).abs() < 1e-6);
/// # Ok::<(), multihead_kernels::attention::KernelError>(())
/// ```
#[allow(clippy::too_many_arguments)]
// Mirrors the gradient of gpt-oss's `sinks` parameter (torch autograd through cat + softmax).
pub fn sink_grad(
    p: &AttnParams<'_>,
    out: &[f32],
    ol: Layout4,
    dout: &[f32],
    dol: Layout4,
    lse: &[f32],
    dsinks: &mut [f32],
) -> Result<(), KernelError> {
    check_params(p)?;
    let d = p.dims;
    let Some(sinks) = p.sinks else {
        let msg = "sink_grad needs the sinks the forward had (AttnParams::sinks)".to_string();
        return Err(KernelError::InvalidArgument { name: "sinks", msg });
    };
    check_tensor("out", out.len(), [d.batch, d.heads_q, d.l, d.dv], ol, false)?;
    check_tensor("dout", dout.len(), [d.batch, d.heads_q, d.l, d.dv], dol, false)?;
    let rows = product("lse", &[d.batch, d.heads_q, d.l])?;
    super::check_len("lse", product("lse", &[2, rows])?, lse.len())?;
    super::check_len("dsinks", d.heads_q, dsinks.len())?;
    // One f64 partial sum per (batch, head), in order.
    let partial = |bh: usize| -> f64 {
        let (b, h) = (bh / d.heads_q, bh % d.heads_q);
        (0..d.l)
            .map(|i| {
                let r = bh * d.l + i;
                let ps = (sinks[h] as f64 - lse[r] as f64 - lse[rows + r] as f64).exp();
                let (o, g) = (ol.offset(b, h, i), dol.offset(b, h, i));
                let dd: f64 = (0..d.dv).map(|c| out[o + c] as f64 * dout[g + c] as f64).sum();
                ps * dd
            })
            .sum()
    };
    let n = d.batch * d.heads_q;
    let sums: Vec<f64> = if rows.saturating_mul(d.dv) < 1 << 16 {
        (0..n).map(partial).collect()
    } else {
        use rayon::prelude::*;
        (0..n).into_par_iter().map(partial).collect()
    };
    for (h, g) in dsinks.iter_mut().take(d.heads_q).enumerate() {
        *g = -(0..d.batch).map(|b| sums[b * d.heads_q + h]).sum::<f64>() as f32;
    }
    Ok(())
}
