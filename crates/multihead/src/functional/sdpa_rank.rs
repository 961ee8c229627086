//! SDPA on 3-D or 5-D and wider inputs as the 4-D call the fused kernels take.
//!
//! `F.scaled_dot_product_attention` takes `(..., H, L, E)`: any number of dimensions before the
//! heads. The fused kernels take `(N, H, L, E)`. Where the dimensions before the heads are the
//! same for the query, the key and the value, merging them into one batch (a batch of one for
//! 3-D inputs, whose first dimension is the heads', as `enable_gqa` reads it) changes nothing
//! but the shape: the flattened order of `(batch, head)` pairs is the one the composed path
//! uses too (its dropout counters included), and the output is reshaped back.

use candle_core::Tensor;

use super::sdpa::SdpaOptions;
use crate::mask::Mask;
use crate::Result;

/// A call reshaped to 4-D: the inputs, the options (with the mask reshaped), and the output's
/// dimensions before `L` in the original call (`lead` then the query's heads).
pub(crate) struct FourD {
    pub(crate) query: Tensor,
    pub(crate) key: Tensor,
    pub(crate) value: Tensor,
    pub(crate) opts: SdpaOptions,
    pub(crate) batch: Vec<usize>,
}

/// The 4-D form of a validated 3-D or 5-D+ call, or `None` where the call is 4-D already or
/// cannot be merged: inputs of different ranks or leading dimensions (broadcast over the
/// batch), per-batch key lengths (their batch is the first dimension), or a mask whose
/// leading dimensions are neither all 1 nor the inputs' own.
pub(crate) fn four_d(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    opts: &SdpaOptions,
) -> Result<Option<FourD>> {
    let r = query.rank();
    if r == 4 || r < 3 || key.rank() != r || value.rank() != r {
        return Ok(None);
    }
    if opts.variants.kv_lengths.is_some() {
        return Ok(None);
    }
    let lead = &query.dims()[..r - 3];
    if &key.dims()[..r - 3] != lead || &value.dims()[..r - 3] != lead {
        return Ok(None);
    }
    let n: usize = lead.iter().product();
    let merge = |t: &Tensor| -> Result<Tensor> {
        let d = t.dims();
        Ok(t.reshape((n, d[r - 3], d[r - 2], d[r - 1]))?)
    };
    let mut o = opts.clone();
    if let Some(m) = &opts.attn_mask {
        let Some(t) = merged_mask(m.tensor(), lead)? else {
            return Ok(None);
        };
        o.attn_mask = Some(match m {
            Mask::Bool(_) => Mask::Bool(t),
            Mask::Float(_) => Mask::Float(t),
        });
    }
    let mut batch = lead.to_vec();
    batch.push(query.dim(r - 3)?);
    Ok(Some(FourD { query: merge(query)?, key: merge(key)?, value: merge(value)?, opts: o, batch }))
}

/// The mask for the merged batch: a mask of at most 3 dimensions broadcasts as before; a wider
/// one loses its leading dimensions when they are all 1, or has them merged when they are the
/// inputs' `lead` (after the ones broadcasting adds on its left). `None` otherwise.
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
        return Ok(Some(t.reshape(tail)?));
    }
    let pad = lead.len() - own.len();
    if lead[..pad].iter().all(|&x| x == 1) && own == &lead[pad..] {
        let n: usize = own.iter().product();
        return Ok(Some(t.reshape((n, tail[0], tail[1], tail[2]))?));
    }
    Ok(None)
}
