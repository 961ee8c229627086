//! Step 3b, composed: PyTorch's slow path from the projections to the concatenated heads
//! (`docs/pytorch-behaviour.md` §3, steps 7-13), in candle operations.

use candle_core::Tensor;

use super::project::Projected;
use super::validate::MhaCall;
use super::MHA;
use crate::error::Result;
use crate::functional::core::{attention_core, attention_probs, cat_nonempty, ScoreMasks};
use crate::mask::causal_upper_left;
use crate::random::DropoutKey;

/// Appends a zero column to an additive mask (for the `bias_k` and zero-attention keys, which
/// are never masked).
pub(super) fn pad_col(m: Option<Tensor>) -> Result<Option<Tensor>> {
    match m {
        Some(m) => {
            let mut dims = m.dims().to_vec();
            ensure_pad(&dims, m.dtype())?;
            if let Some(last) = dims.last_mut() {
                *last = 1;
            }
            let z = Tensor::zeros(dims, m.dtype(), m.device())?;
            Ok(Some(cat_nonempty(&[&m, &z], m.rank() - 1)?))
        }
        None => Ok(None),
    }
}

/// The copy [`pad_col`] makes of a mask of `dims`, checked before it is made (a broadcast
/// mask costs its full size there).
pub(super) fn ensure_pad(dims: &[usize], dtype: candle_core::DType) -> Result<()> {
    let mut padded = dims.to_vec();
    if let Some(last) = padded.last_mut() {
        *last += 1;
    }
    let hint = "bias_k and add_zero_attn pad the masks with a column (a copy at full size); \
                pass smaller masks";
    crate::alloc::ensure(MHA, "attn_mask", &padded, dtype, 1, hint)
}

/// The sizes [`attend`] checks before it allocates them (for `explain`): the score matrices.
pub(super) fn ensure(call: &MhaCall) -> Result<()> {
    ensure_scores(call)
}

/// The score matrices [`heads`] builds, checked first.
fn ensure_scores(call: &MhaCall) -> Result<()> {
    crate::alloc::ensure(
        MHA,
        "attention scores",
        &[call.n, call.h, call.l, call.s_total()],
        call.dtype,
        3,
        "the composed path builds (N·H, L, S) score matrices: use f32 on the CPU with \
         need_weights=false (the fused kernels never build them), or a smaller batch",
    )
}

/// The heads of one call as the attention core takes them: `q` `(N·H, L, hd)`, `k` and `v`
/// `(N·H, S', hd)` (the `bias_k` and zero-attention keys appended, grouped heads expanded), the
/// merged additive mask, and the sinks per `(N·H)` row.
struct Heads {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Option<Tensor>,
    /// Keys hidden by index after a soft cap that follows the masks (`core::attention_core`).
    hide: Option<Tensor>,
    /// Whether an attention or padding mask is in `mask` (`core::ScoreMasks::masked`).
    masked: bool,
    sinks: Option<Tensor>,
}

/// The attention output `(L, N, E)` (`(N, L, E)` with `batch_first`) and, when asked, the
/// weights `(N, L, S')` or `(N, H, L, S')`.
pub(crate) fn attend(
    call: &MhaCall,
    proj: Projected,
    dropout: Option<(f64, DropoutKey)>,
) -> Result<(Tensor, Option<Tensor>)> {
    let (l, n, e) = (call.l, call.n, call.e);
    let hs = heads(call, proj)?;
    let scale = 1.0 / (call.hd as f64).sqrt();
    let score = (scale, call.variants.cap(), hs.sinks.as_ref());
    let masks = hs.score_masks();
    let (attn, weights) =
        attention_core(&hs.q, &hs.k, &hs.v, masks, score, dropout, call.need_weights)?;
    let attn = attn.transpose(0, 1)?.contiguous()?.reshape((l, n, e))?;
    let attn = if call.batch_first { attn.transpose(0, 1)? } else { attn };
    let weights = weights.map(|w| head_weights(call, w)).transpose()?;
    Ok((attn, weights))
}

/// The (post-dropout) attention weights alone, `(N, L, S')` or `(N, H, L, S')`, through candle
/// operations, so that a gradient flows through them: what the fused path returns beside its
/// output when the weights are asked for while gradients are recorded. The dropout key is the
/// fused output's, so both see the same mask.
pub(crate) fn weights(
    call: &MhaCall,
    proj: &Projected,
    dropout: Option<(f64, DropoutKey)>,
) -> Result<Tensor> {
    let proj = Projected {
        q: proj.q.clone(),
        k: proj.k.clone(),
        v: proj.v.clone(),
        packed: super::project::Packed::None,
    };
    let hs = heads(call, proj)?;
    let scale = 1.0 / (call.hd as f64).sqrt();
    let score = (scale, call.variants.cap(), hs.sinks.as_ref());
    let w = attention_probs(&hs.q, &hs.k, hs.score_masks(), score, dropout)?;
    head_weights(call, w)
}

/// `(N·H, L, S')` weights as the caller gets them: per head, or averaged over the heads.
fn head_weights(call: &MhaCall, w: Tensor) -> Result<Tensor> {
    let w = w.reshape((call.n, call.h, call.l, call.s_total()))?;
    Ok(if call.average_attn_weights { w.mean(1)? } else { w })
}

/// Steps 7-11: the heads split, the extra keys appended and the masks merged.
fn heads(call: &MhaCall, proj: Projected) -> Result<Heads> {
    let (l, n, h, hd, hk, kv_e) = (call.l, call.n, call.h, call.hd, call.hk, call.kv_e);
    let s2 = call.s_total();
    ensure_scores(call)?;
    let Projected { q, k, v, .. } = proj;
    let statics = call.static_kv.is_some();
    let (q, mut k, mut v) = match (call.batch_first, statics) {
        (false, _) => (q, k, v),
        (true, false) => (q.transpose(0, 1)?, k.transpose(0, 1)?, v.transpose(0, 1)?),
        (true, true) => (q.transpose(0, 1)?, k, v),
    };
    let mut attn_mask = call.attn_mask.clone();
    let mut kpm = call.kpm.clone();
    // bias_k / bias_v (step 7); validation checked both are given with shape (1, 1, kv) or
    // (kv,), and never with static keys.
    if let (Some(bk), Some(bv)) = (call.params.bias_k, call.params.bias_v) {
        let bk = bk.reshape((1, 1, kv_e))?.broadcast_as((1, n, kv_e))?;
        let bv = bv.reshape((1, 1, kv_e))?.broadcast_as((1, n, kv_e))?;
        k = cat_nonempty(&[&k, &bk], 0)?;
        v = cat_nonempty(&[&v, &bv], 0)?;
        attn_mask = pad_col(attn_mask)?;
        kpm = pad_col(kpm)?;
    }
    // Split heads (step 8): (T, N, heads·hd) -> (N·heads, T, hd); static keys come split.
    let split = |t: &Tensor, heads: usize| -> Result<Tensor> {
        let len = t.dim(0)?;
        if t.elem_count() == 0 {
            return crate::fused::zeros::zeros_of(&[n * heads, len, hd], t.dtype(), &[t]);
        }
        Ok(t.contiguous()?.reshape((len, n * heads, hd))?.transpose(0, 1)?.contiguous()?)
    };
    let q = split(&q, h)?;
    if !statics {
        k = split(&k, hk)?;
        v = split(&v, hk)?;
    }
    // Zero attention (step 9).
    if call.params.add_zero_attn {
        let z = Tensor::zeros((n * hk, 1, hd), call.dtype, k.device())?;
        k = cat_nonempty(&[&k, &z], 1)?;
        v = cat_nonempty(&[&v, &z], 1)?;
        attn_mask = pad_col(attn_mask)?;
        kpm = pad_col(kpm)?;
    }
    // Grouped-query attention: query head i reads kv head i / (h / hk).
    if hk != h {
        let expand = |t: &Tensor| -> Result<Tensor> {
            let len = t.dim(1)?;
            let t = t.reshape((n, hk, 1, len, hd))?.broadcast_as((n, hk, h / hk, len, hd))?;
            Ok(t.contiguous()?.reshape((n * h, len, hd))?)
        };
        k = expand(&k)?;
        v = expand(&v)?;
    }
    // Merge the masks by addition (step 11).
    let masked = attn_mask.is_some() || kpm.is_some();
    let variants = &call.variants;
    let (mask, hide) = if *variants != crate::Variants::default() {
        variant_mask(call, attn_mask, kpm, k.device())?
    } else if call.causal {
        (Some(causal_upper_left(l, s2, call.dtype, k.device())?.unsqueeze(0)?), None)
    } else {
        let kpm = match kpm {
            Some(m) => Some(m.reshape((n, 1, 1, s2))?.broadcast_as((n, h, 1, s2))?.reshape((
                n * h,
                1,
                s2,
            ))?),
            None => None,
        };
        let mask = match (attn_mask, kpm) {
            (Some(a), Some(p)) => Some(crate::fused::zeros::broadcast_sum(&a, &p)?),
            (a, p) => a.or(p),
        };
        (mask, None)
    };
    let sinks = match &call.sinks {
        Some(t) => Some(t.reshape((1, h, 1))?.broadcast_as((n, h, 1))?.reshape((n * h, 1, 1))?),
        None => None,
    };
    Ok(Heads { q, k, v, mask, hide, masked, sinks })
}

impl Heads {
    /// The masks as the attention core applies them.
    fn score_masks(&self) -> ScoreMasks<'_> {
        ScoreMasks { add: self.mask.as_ref(), masked: self.masked, hide: self.hide.as_ref() }
    }
}

/// The merged additive mask with the variants (no `bias_k` or zero-attention columns: checked),
/// `(N·H, L, S)`: the attention mask, the key padding mask, the keys the causal hint, window and
/// key lengths hide, and the ALiBi bias; and, with a soft cap after the masks, the keys hidden
/// by index apart (hidden after the cap, as the kernels hide them).
fn variant_mask(
    call: &MhaCall,
    attn_mask: Option<Tensor>,
    kpm: Option<Tensor>,
    dev: &candle_core::Device,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let (n, h, l, s) = (call.n, call.h, call.l, call.s);
    let v = &call.variants;
    let band = v.band_mask(MHA, (call.causal, 1), (l, s), call.dtype, dev)?;
    let (band, hide) = match v.cap() {
        Some((_, true)) => (None, band),
        _ => (band, None),
    };
    let parts = [
        attn_mask
            .map(|a| match a.dim(0)? {
                1 => a.reshape((1, 1, l, s)),
                _ => a.reshape((n, h, l, s)),
            })
            .transpose()?,
        kpm.map(|p| p.reshape((n, 1, 1, s))).transpose()?,
        band,
        v.alibi_bias(MHA, (l, s), call.dtype, dev)?,
    ];
    let mut mask: Option<Tensor> = None;
    for part in parts.into_iter().flatten() {
        mask = Some(match mask {
            Some(m) => crate::fused::zeros::broadcast_sum(&m, &part)?,
            None => part,
        });
    }
    let flat = |m: Tensor| -> Result<Tensor> {
        let m = super::super::core::expand_to(&m, &[n, h, l, s])?;
        Ok(m.contiguous()?.reshape((n * h, l, s))?)
    };
    Ok((mask.map(flat).transpose()?, hide.map(flat).transpose()?))
}
