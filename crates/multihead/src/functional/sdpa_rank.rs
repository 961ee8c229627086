//! SDPA on 2-D, 3-D or 5-D and wider inputs as the 4-D call the fused kernels take.
//!
//! `F.scaled_dot_product_attention` takes `(..., H, L, E)`: any number of dimensions before the
//! heads. The fused kernels take `(N, H, L, E)`. Merging the dimensions before the heads into
//! one batch (a batch of one for 3-D inputs, whose first dimension is the heads', as
//! `enable_gqa` reads it) changes nothing but the shape: the flattened order of `(batch, head)`
//! pairs is the one the composed path uses too (its dropout counters included), and the output
//! is reshaped back. An input whose leading dimensions broadcast is expanded to the others'
//! first (a copy, as on the composed path). A 2-D `(L, E)` input is one head of a batch of one.

use candle_core::Tensor;

use super::sdpa::SdpaOptions;
use crate::mask::Mask;
use crate::Result;

/// A call reshaped to 4-D: the inputs, the options (with the mask reshaped), and the output's
/// dimensions before `L` in the original call (the broadcast leading dimensions, then heads).
pub(crate) struct FourD {
    pub(crate) query: Tensor,
    pub(crate) key: Tensor,
    pub(crate) value: Tensor,
    pub(crate) opts: SdpaOptions,
    pub(crate) batch: Vec<usize>,
}

/// The 4-D form of a validated 2-D, 3-D or 5-D+ call whose dimensions before `L` broadcast to
/// `batch`, or `None` where the call is 4-D already or cannot be merged (inputs of different
/// ranks). An input or a mask whose leading dimensions broadcast is expanded to them (a copy,
/// as the composed path makes). Per-batch key lengths (one per entry of the first dimension)
/// are repeated over the dimensions merged into it.
pub(crate) fn four_d(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    opts: &SdpaOptions,
    batch: &[usize],
) -> Result<Option<FourD>> {
    let r = query.rank();
    if r == 4 || r < 2 || key.rank() != r || value.rank() != r || batch.len() != r - 2 {
        return Ok(None);
    }
    if r == 2 {
        // One head: `(L, E)` as `(1, 1, L, E)` (validation refused the options that need a
        // batch or head dimension; a mask broadcasts to `(L, S)` as before).
        let one = |t: &Tensor| -> Result<Tensor> {
            let d = t.dims();
            Ok(t.reshape((1, 1, d[0], d[1]))?)
        };
        let (query, key, value) = (one(query)?, one(key)?, one(value)?);
        return Ok(Some(FourD { query, key, value, opts: opts.clone(), batch: Vec::new() }));
    }
    let lead = &batch[..r - 3];
    let n: usize = lead.iter().product();
    let merge = |t: &Tensor| -> Result<Tensor> {
        let d = t.dims();
        let t = super::core::expand_to(t, &[lead, &d[r - 3..]].concat())?;
        ensure_merge(&t, "input")?;
        Ok(t.reshape((n, d[r - 3], d[r - 2], d[r - 1]))?)
    };
    let mut o = opts.clone();
    if let Some(lens) = &opts.variants.kv_lengths {
        // Entry `b` of the first dimension covers `n / lens.len()` merged entries (validation
        // gave one length per entry of it).
        let per = n.checked_div(lens.len()).unwrap_or(0);
        o.variants.kv_lengths =
            Some(lens.iter().flat_map(|&k| std::iter::repeat_n(k, per)).collect());
    }
    if let Some(m) = &opts.attn_mask {
        let Some(t) = merged_mask(m.tensor(), lead)? else {
            return Ok(None);
        };
        o.attn_mask = Some(match m {
            Mask::Bool(_) => Mask::Bool(t),
            Mask::Float(_) => Mask::Float(t),
        });
    }
    let (query, key, value) = (merge(query)?, merge(key)?, merge(value)?);
    Ok(Some(FourD { query, key, value, opts: o, batch: batch.to_vec() }))
}

/// The mask for the merged batch: a mask of at most 3 dimensions broadcasts as before; a wider
/// one loses its leading dimensions when they are all 1, has them merged when they are the
/// inputs' `lead` (after the ones broadcasting adds on its left), and is expanded to `lead`
/// first otherwise (a copy). `None` for a mask wider than the inputs.
fn merged_mask(t: &Tensor, lead: &[usize]) -> Result<Option<Tensor>> {
    let m = t.rank();
    if m <= 3 {
        return Ok(Some(t.clone()));
    }
    if m - 3 > lead.len() {
        return Ok(None);
    }
    let d = t.dims();
    let (own, tail) = (&d[..m - 3], &d[m - 3..]);
    if own.iter().all(|&x| x == 1) {
        ensure_merge(t, "attn_mask")?;
        return Ok(Some(t.reshape(tail)?));
    }
    let n: usize = lead.iter().product();
    let pad = lead.len() - own.len();
    let t = match lead[..pad].iter().all(|&x| x == 1) && own == &lead[pad..] {
        true => t.clone(),
        false => t.broadcast_as([lead, tail].concat())?,
    };
    ensure_merge(&t, "attn_mask")?;
    Ok(Some(t.reshape((n, tail[0], tail[1], tail[2]))?))
}

/// The copy a reshape makes of a view that is not contiguous (a broadcast batch, say),
/// checked before it is made (by the call and by `explain_sdpa`, which merge alike).
fn ensure_merge(t: &Tensor, what: &'static str) -> Result<()> {
    if t.is_contiguous() {
        return Ok(());
    }
    let hint = "the dimensions before the heads are merged into one batch, a broadcast one by a \
                copy at full size; pass smaller inputs";
    crate::alloc::ensure(super::sdpa::SDPA, what, t.dims(), t.dtype(), 1, hint)
}
