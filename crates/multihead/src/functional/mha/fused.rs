//! Step 3b, fused: the flash-attention kernels from the projections to the concatenated heads
//! (`docs/pytorch-behaviour.md` §3, steps 8-13 in one op), reading q, k and v straight from the
//! projection output.

use candle_core::Tensor;

use super::project::{Packed, Projected};
use super::validate::MhaCall;
use super::MHA;
use crate::error::Result;
use crate::functional::core::cat_nonempty;
use crate::fused::flash::{Convention, FlashAttention, FlashMask};
use crate::fused::mask_grad::Inputs;
use crate::fused::weights_grad::{self, from_bhtd, to_bhtd};
use crate::mask::compact;
use crate::random::DropoutKey;

/// The weights [`attend`] returns when asked for, checked before they are made.
fn ensure_weights(call: &MhaCall) -> Result<()> {
    if !call.need_weights {
        return Ok(());
    }
    let hw = if call.average_attn_weights { 1 } else { call.h };
    // Averaging over heads only helps when the weights are per head.
    let hint = if call.average_attn_weights {
        "set need_weights=false (attention itself never builds an L×S matrix), or use a \
         smaller batch or shorter sequences"
    } else {
        "set need_weights=false (attention itself never builds an L×S matrix), or \
         average_attn_weights=true, or a smaller batch"
    };
    let dims = [call.n, hw, call.l, call.s_total()];
    crate::alloc::ensure(MHA, "attn_weights", &dims, call.dtype, 1, hint)
}

/// The copies of `static_k` and `static_v` `(N·hk, S, hd)` the kernels need: with the
/// zero-attention key appended, or where they are views (split into `(N, hk, S', hd)`),
/// checked before they are made (a broadcast view of 2^36 keys aborted the process before
/// 2026-12-07).
fn ensure_static(call: &MhaCall) -> Result<()> {
    let Some((k, v)) = &call.static_kv else {
        return Ok(());
    };
    let extra = call.s_total() > call.s;
    let hint = "static keys and values that are views are copied for the fused kernels; pass \
                contiguous or smaller ones";
    for (what, t) in [("static_k", k), ("static_v", v)] {
        if extra || !t.is_contiguous() {
            let dims = [t.dim(0)?, call.s_total(), t.dim(2)?];
            crate::alloc::ensure(MHA, what, &dims, t.dtype(), 1, hint)?;
        }
    }
    Ok(())
}

/// The sizes [`attend`] checks before it allocates them, in its order (for `explain`): the
/// static keys' copies, the masks padded for the extra keys, the weights, and the kernels'
/// copies of the masks.
pub(super) fn ensure(call: &MhaCall) -> Result<()> {
    ensure_static(call)?;
    let (s, extra) = (call.s_total(), call.s_total() - call.s);
    for m in [&call.attn_mask, &call.kpm].into_iter().flatten() {
        let mut dims = m.dims().to_vec();
        for _ in 0..extra {
            super::composed::ensure_pad(&dims, m.dtype())?;
            if let Some(last) = dims.last_mut() {
                *last += 1;
            }
        }
    }
    ensure_weights(call)?;
    if s == 0 {
        return Ok(());
    }
    // A mask is read where it lies (no backward can read it) or copied without its broadcast
    // dimensions; a padded one is a new dense tensor (checked by `ensure_pad`), read where it
    // lies when f32 and no backward can read it, copied otherwise.
    let backward = super::masks_for_backward(call);
    let padded_copy = |m: &Tensor| extra > 0 && (backward || m.dtype() != candle_core::DType::F32);
    if let Some(a) = &call.attn_mask {
        match extra {
            0 => FlashMask::ensure_for(&compact(a)?, backward)?,
            _ if padded_copy(a) => FlashMask::ensure(&[a.dim(0)?, call.l, s])?,
            _ => {}
        }
    }
    if let Some(p) = &call.kpm {
        match extra {
            0 => FlashMask::ensure_for(p, backward)?,
            _ if padded_copy(p) => FlashMask::ensure(&[call.n, s])?,
            _ => {}
        }
    }
    Ok(())
}

/// The attention output `(L, N, E)` (`(N, L, E)` with `batch_first`) and, when asked, the
/// weights: from the weights kernel, carrying the softmax's gradient while a graph is recorded
/// (`weights_grad`), or, with a graph and dropout, a soft cap or sinks (or static keys), through
/// candle operations (`composed::weights`).
pub(crate) fn attend(
    call: &MhaCall,
    proj: &Projected,
    dropout: Option<(f64, DropoutKey)>,
) -> Result<(Tensor, Option<Tensor>)> {
    let (l, n, h, hd) = (call.l, call.n, call.h, call.hd);
    ensure_static(call)?;
    // `S'`: with the `bias_k` and zero-attention keys, appended to copies of the projections.
    let s = call.s_total();
    // The caller's projections, for weights computed by candle operations (which append the
    // extra keys themselves).
    let original = proj;
    let extended;
    let (proj, attn_mask, kpm) = match extra_keys(call, proj)? {
        Some(x) => {
            extended = x;
            (&extended.proj, extended.attn_mask.clone(), extended.kpm.clone())
        }
        None => (proj, call.attn_mask.clone(), call.kpm.clone()),
    };
    ensure_weights(call)?;
    if s == 0 {
        return no_keys(call, proj, [attn_mask.as_ref(), kpm.as_ref()]);
    }
    let dims = multihead_kernels::attention::AttnDims {
        batch: n,
        heads_q: h,
        heads_kv: call.hk,
        l,
        s,
        d: hd,
        dv: hd,
    };
    let masks = flash_masks(call, attn_mask.as_ref(), kpm.as_ref(), s)?;
    let scale = (1.0 / (hd as f64).sqrt()) as f32;
    let conv = Convention::SeqFirst { heads: h, head_dim: hd, batch_first: call.batch_first };
    // Weights that carry a gradient: from the kernel with the softmax's gradient attached
    // (`weights_grad`), or, with dropout, a soft cap or sinks, from candle operations.
    // A learned float mask (a bias that requires grad) gets its gradient through an identity
    // on the output (`mask_grad`); its weights, when asked for, through candle operations.
    let [am_learned, kpm_learned] = call.learned_masks;
    let am = attn_mask.as_ref().filter(|_| am_learned);
    let learned = learned_mask(am, kpm.as_ref().filter(|_| kpm_learned), (n, h, l, s))?;
    let graded_weights = call.need_weights && (super::records_grad(call) || learned.is_some());
    let kernel_grad = graded_weights
        && learned.is_none()
        && dropout.is_none_or(|(p, _)| p == 0.0)
        && call.variants.softcap.is_none()
        && call.sinks.is_none();
    let op = FlashAttention::new(dims, scale, call.causal, masks, dropout, conv)
        .with_variants(&call.variants)
        // PyTorch's bf16 attention takes its math path (f32 products) for the weights and for
        // a mask that requires grad.
        .with_rounded_products(call.need_weights || learned.is_some())
        .with_weights_later(call.need_weights && (kernel_grad || !graded_weights));
    let op = match &call.sinks {
        Some(t) => op.with_sinks(t.to_vec1::<f32>()?),
        None => op,
    };
    if call.static_kv.is_some() {
        return static_attention(call, (original, proj), &op, dropout, learned.as_ref());
    }
    // The kernels read the projections' strided heads themselves (copying what they re-read).
    let (attn, inputs) = match &proj.packed {
        Packed::Qkv(qkv) => (op.apply_packed(qkv)?, Inputs::Qkv(qkv.clone())),
        Packed::Kv(kv) => {
            (op.apply_packed_kv(&proj.q, kv)?, Inputs::Kv(proj.q.clone(), kv.clone()))
        }
        Packed::None => {
            let qkv = [proj.q.clone(), proj.k.clone(), proj.v.clone()];
            (op.apply(&proj.q, &proj.k, &proj.v)?, Inputs::Unpacked(qkv))
        }
    };
    // A learned mask's backward computes the inputs' gradients for the op (`mask_grad`).
    let attn = match &learned {
        Some(m) => crate::fused::mask_grad::attach(&op, &attn, m, inputs)?,
        None => attn,
    };
    let attn = with_sinks(&op, attn, call)?;
    let weights = match (kernel_grad, graded_weights, call.need_weights) {
        (true, _, _) => {
            let (layout, avg) = ((h, hd, call.batch_first), call.average_attn_weights);
            Some(weights_grad::weights(&op, &proj.q, &proj.k, avg, layout)?)
        }
        (false, true, _) => Some(super::composed::weights(call, original, dropout)?),
        (false, false, true) => {
            let w = op.weights(&proj.q, &proj.k, call.average_attn_weights)?;
            Some(if call.average_attn_weights { w.squeeze(1)? } else { w })
        }
        (false, false, false) => None,
    };
    Ok((attn, weights))
}

/// A call without keys (`S' = 0`): every row is fully masked, so the attention is zero (as on
/// the composed path), kept in the graph of the projections and masks; empty weights.
fn no_keys(
    call: &MhaCall,
    proj: &Projected,
    masks: [Option<&Tensor>; 2],
) -> Result<(Tensor, Option<Tensor>)> {
    let (l, n, e, h) = (call.l, call.n, call.e, call.h);
    let attn = if call.batch_first { [n, l, e] } else { [l, n, e] };
    let mut inputs = vec![&proj.q, &proj.k, &proj.v];
    inputs.extend(masks.into_iter().flatten());
    let attn = crate::fused::zeros::zeros_of(&attn, call.dtype, &inputs)?;
    let w = match (call.need_weights, call.average_attn_weights) {
        (false, _) => None,
        (true, true) => Some(Tensor::zeros((n, l, 0), call.dtype, attn.device())?),
        (true, false) => Some(Tensor::zeros((n, h, l, 0), call.dtype, attn.device())?),
    };
    Ok((attn, w))
}

/// The kernels' masks: the attention mask `(1 or N·H, L, S')`, without the dimensions a
/// broadcast view repeats (read with stride 0), and the key padding mask `(N, S')`, each read
/// where it lies or copied as SDPA's mask ([`FlashMask`]).
fn flash_masks(
    call: &MhaCall,
    attn_mask: Option<&Tensor>,
    kpm: Option<&Tensor>,
    s: usize,
) -> Result<Vec<FlashMask>> {
    let backward = super::masks_for_backward(call);
    let mut masks = Vec::new();
    if let Some(a) = attn_mask {
        let a = compact(a)?;
        let (d0, rows, cols) = a.dims3()?;
        let (rs, cs) = (if rows == 1 { 0 } else { cols }, if cols == 1 { 0 } else { 1 });
        let h = call.h;
        let strides = if d0 == 1 { [0, 0, rs, cs] } else { [h * rows * cols, rows * cols, rs, cs] };
        masks.push(FlashMask::new(&a, strides, backward)?);
    }
    if let Some(p) = kpm {
        masks.push(FlashMask::new(p, [s, 0, 0, 1], backward)?);
    }
    Ok(masks)
}

/// The learned masks (float masks in the graph while gradients are recorded) as one
/// `(N|1, H|1, L, S)` tensor whose gradient reaches each (`attn_mask` `(1 | N·H, L, S)`, `kpm`
/// `(N, S)`); their sum where both are (PyTorch's merged mask). `None` where neither is: the
/// kernels copy the masks and give them no gradient.
fn learned_mask(
    attn_mask: Option<&Tensor>,
    kpm: Option<&Tensor>,
    (n, h, l, s): (usize, usize, usize, usize),
) -> Result<Option<Tensor>> {
    let am = match attn_mask {
        Some(a) if a.dim(0)? == 1 => Some(a.reshape((1, 1, l, s))?),
        Some(a) => Some(a.reshape((n, h, l, s))?),
        None => None,
    };
    let kp = kpm.map(|p| p.reshape((n, 1, 1, s))).transpose()?;
    Ok(match (am, kp) {
        (Some(a), Some(p)) => Some(a.broadcast_add(&p)?),
        (a, p) => a.or(p),
    })
}

/// A call's projections and masks with the extra key columns appended.
struct ExtraKeys {
    proj: Projected,
    attn_mask: Option<Tensor>,
    kpm: Option<Tensor>,
}

/// `bias_k`/`bias_v` (`docs/pytorch-behaviour.md` §3, step 7) and the zero-attention key and
/// value (step 9) appended to the projected keys and values, in that order, and a zero column
/// for each appended to the masks (those keys are never masked); `None` without either. The
/// projections are copied (the kernels then read them unpacked); gradients reach `bias_k`,
/// `bias_v` and the projections through the concatenation.
fn extra_keys(call: &MhaCall, proj: &Projected) -> Result<Option<ExtraKeys>> {
    let p = call.params;
    if p.bias_k.is_none() && !p.add_zero_attn {
        return Ok(None);
    }
    let (n, kv_e) = (call.n, call.kv_e);
    // Keys run along dimension 0, or 1 with `batch_first`; static keys `(N·hk, S, hd)` along 1
    // (they take no `bias_k`: validation refuses it).
    let (seq, one) = match (call.static_kv.is_some(), call.batch_first) {
        (true, _) => (1, (n * call.hk, 1, call.hd)),
        (false, true) => (1, (n, 1, kv_e)),
        (false, false) => (0, (1, n, kv_e)),
    };
    let (mut ks, mut vs) = (vec![proj.k.clone()], vec![proj.v.clone()]);
    if let (Some(bk), Some(bv)) = (p.bias_k, p.bias_v) {
        ks.push(bk.reshape((1, 1, kv_e))?.broadcast_as(one)?);
        vs.push(bv.reshape((1, 1, kv_e))?.broadcast_as(one)?);
    }
    if p.add_zero_attn {
        let z = Tensor::zeros(one, call.dtype, proj.k.device())?;
        ks.push(z.clone());
        vs.push(z);
    }
    // One zero column per appended key, as the composed path pads.
    let pad = |mut m: Option<Tensor>| -> Result<Option<Tensor>> {
        for _ in 1..ks.len() {
            m = super::composed::pad_col(m)?;
        }
        Ok(m)
    };
    let (attn_mask, kpm) = (pad(call.attn_mask.clone())?, pad(call.kpm.clone())?);
    let (ks, vs): (Vec<&Tensor>, Vec<&Tensor>) = (ks.iter().collect(), vs.iter().collect());
    let (k, v) = (cat_nonempty(&ks, seq)?, cat_nonempty(&vs, seq)?);
    Ok(Some(ExtraKeys {
        proj: Projected { q: proj.q.clone(), k, v, packed: Packed::None },
        attn_mask,
        kpm,
    }))
}

/// The output of `op` joined to the graph of the sinks (their gradient), when there are any.
fn with_sinks(op: &FlashAttention, attn: Tensor, call: &MhaCall) -> Result<Tensor> {
    match &call.sinks {
        Some(s) => crate::fused::sinks::attach(op, &attn, s),
        None => Ok(attn),
    }
}

/// `static_k`/`static_v` `(N·hk, S, hd)`: the query goes to `(N, H, L, hd)` and the kernels
/// read the static tensors as they are (in `proj`, with the zero-attention key appended;
/// `original` holds the caller's).
fn static_attention(
    call: &MhaCall,
    (original, proj): (&Projected, &Projected),
    op: &FlashAttention,
    dropout: Option<(f64, DropoutKey)>,
    learned: Option<&Tensor>,
) -> Result<(Tensor, Option<Tensor>)> {
    let (n, h, hd, hk) = (call.n, call.h, call.hd, call.hk);
    let s = call.s_total();
    let bhtd = op.with_convention(Convention::Bhtd);
    let qh = to_bhtd(&proj.q, h, hd, call.batch_first)?;
    let kh = proj.k.reshape((n, hk, s, hd))?;
    let vh = proj.v.reshape((n, hk, s, hd))?;
    let mut attn = bhtd.apply(&qh, &kh, &vh)?;
    if let Some(m) = learned {
        let inputs = Inputs::Unpacked([qh.clone(), kh.clone(), vh.clone()]);
        attn = crate::fused::mask_grad::attach(&bhtd, &attn, m, inputs)?;
    }
    let attn = with_sinks(&bhtd, attn, call)?;
    let attn = from_bhtd(&attn, call.batch_first)?;
    let weights = if call.need_weights && (super::records_grad(call) || learned.is_some()) {
        Some(super::composed::weights(call, original, dropout)?)
    } else if call.need_weights {
        let w = bhtd.weights(&qh, &kh, call.average_attn_weights)?;
        Some(if call.average_attn_weights { w.squeeze(1)? } else { w })
    } else {
        None
    };
    Ok((attn, weights))
}
