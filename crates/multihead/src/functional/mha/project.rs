//! Step 3a: the input projections (`docs/pytorch-behaviour.md` §3, step 5), grouped by which
//! inputs are the same tensor, as PyTorch groups them.

use candle_core::Tensor;

use super::validate::MhaCall;
use super::{InProj, MHA};
use crate::error::Result;
use crate::linear::linear;

/// The projected query, key and value, in the caller's layout (`(T, N, E)`, or `(N, T, E)`
/// with `batch_first`), and the packed projection they are views into, when there is one.
pub(crate) struct Projected {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub packed: Packed,
}

/// Which projection packs several of q, k and v.
pub(crate) enum Packed {
    /// Three projections.
    None,
    /// Self-attention: one `(·, ·, 3E)` projection holds q, k and v.
    Qkv(Tensor),
    /// Key and value of one memory: one `(·, ·, 2E)` projection holds k and v.
    Kv(Tensor),
}

/// Projects `call`'s inputs. With `static_k`/`static_v` only the query is projected, and `k`
/// and `v` are the static tensors, `(N·hk, S, hd)`.
///
/// With `bf16_qkv` (a bf16 module's f32 twin without a gradient, whose attention reads the
/// projection as bf16: [`super::bf16_projection`]), self-attention's packed projection is
/// written as bf16, the bits the attention's products round it to.
pub(crate) fn project(call: &MhaCall, bf16_qkv: bool) -> Result<Projected> {
    let (e, kv) = (call.e, call.kv_e);
    let p = call.params;
    // Validation checked the bias shape `(E + 2·kv,)`: q, then k, then v.
    let bias = |start: usize, len: usize| -> Result<Option<Tensor>> {
        Ok(match p.in_proj_bias {
            Some(b) => Some(b.narrow(0, start, len)?),
            None => None,
        })
    };
    let (query, key, value) = (&call.query, &call.key, &call.value);
    let (alias, be) = (call.alias, call.backend);
    if let Some((k, v)) = &call.static_kv {
        let wq = match p.in_proj {
            InProj::Packed(w) => w.narrow(0, 0, e)?,
            InProj::Separate { q, .. } => q.clone(),
        };
        let q = linear(query, &wq, bias(0, e)?.as_ref(), MHA, "query", be)?;
        return Ok(Projected { q, k: k.clone(), v: v.clone(), packed: Packed::None });
    }
    let proj = match p.in_proj {
        InProj::Packed(w) if alias.key_is_query && alias.value_is_key => {
            let qkv = match bf16_qkv {
                true => {
                    let (op, bf16) = ((MHA, "query"), candle_core::DType::BF16);
                    crate::linear::linear_to(query, w, p.in_proj_bias, op, be, bf16)?
                }
                false => linear(query, w, p.in_proj_bias, MHA, "query", be)?,
            };
            let (q, k, v) = (qkv.narrow(2, 0, e)?, qkv.narrow(2, e, e)?, qkv.narrow(2, 2 * e, e)?);
            Projected { q, k, v, packed: Packed::Qkv(qkv) }
        }
        InProj::Packed(w) if alias.value_is_key => {
            let q = linear(query, &w.narrow(0, 0, e)?, bias(0, e)?.as_ref(), MHA, "query", be)?;
            let wkv = w.narrow(0, e, 2 * e)?;
            let kv = linear(key, &wkv, bias(e, 2 * e)?.as_ref(), MHA, "key", be)?;
            let (k, v) = (kv.narrow(2, 0, e)?, kv.narrow(2, e, e)?);
            Projected { q, k, v, packed: Packed::Kv(kv) }
        }
        InProj::Packed(w) => Projected {
            q: linear(query, &w.narrow(0, 0, e)?, bias(0, e)?.as_ref(), MHA, "query", be)?,
            k: linear(key, &w.narrow(0, e, e)?, bias(e, e)?.as_ref(), MHA, "key", be)?,
            v: linear(value, &w.narrow(0, 2 * e, e)?, bias(2 * e, e)?.as_ref(), MHA, "value", be)?,
            packed: Packed::None,
        },
        InProj::Separate { q: wq, k: wk, v: wv } => Projected {
            q: linear(query, wq, bias(0, e)?.as_ref(), MHA, "query", be)?,
            k: linear(key, wk, bias(e, kv)?.as_ref(), MHA, "key", be)?,
            v: linear(value, wv, bias(e + kv, kv)?.as_ref(), MHA, "value", be)?,
            packed: Packed::None,
        },
    };
    Ok(proj)
}

/// What [`project`] checks before it allocates, in its order (for `explain`): each
/// projection's arguments, copies and output, through the same checks as its product.
pub(crate) fn ensure(call: &MhaCall, bf16_qkv: bool) -> Result<()> {
    use crate::linear::ensure_linear;
    let (e, kv) = (call.e, call.kv_e);
    let p = call.params;
    let bias = |start: usize, len: usize| -> Result<Option<Tensor>> {
        Ok(match p.in_proj_bias {
            Some(b) => Some(b.narrow(0, start, len)?),
            None => None,
        })
    };
    let (query, key, value) = (&call.query, &call.key, &call.value);
    let dt = call.query.dtype();
    let one = |x: &Tensor, w: &Tensor, b: Option<Tensor>, arg: &'static str| {
        ensure_linear(x, w, b.as_ref(), (MHA, arg), dt)
    };
    if call.static_kv.is_some() {
        let wq = match p.in_proj {
            InProj::Packed(w) => w.narrow(0, 0, e)?,
            InProj::Separate { q, .. } => q.clone(),
        };
        return one(query, &wq, bias(0, e)?, "query");
    }
    let alias = call.alias;
    match p.in_proj {
        InProj::Packed(w) if alias.key_is_query && alias.value_is_key => {
            let out = if bf16_qkv { candle_core::DType::BF16 } else { dt };
            ensure_linear(query, w, p.in_proj_bias, (MHA, "query"), out)
        }
        InProj::Packed(w) if alias.value_is_key => {
            one(query, &w.narrow(0, 0, e)?, bias(0, e)?, "query")?;
            one(key, &w.narrow(0, e, 2 * e)?, bias(e, 2 * e)?, "key")
        }
        InProj::Packed(w) => {
            one(query, &w.narrow(0, 0, e)?, bias(0, e)?, "query")?;
            one(key, &w.narrow(0, e, e)?, bias(e, e)?, "key")?;
            one(value, &w.narrow(0, 2 * e, e)?, bias(2 * e, e)?, "value")
        }
        InProj::Separate { q: wq, k: wk, v: wv } => {
            one(query, wq, bias(0, e)?, "query")?;
            one(key, wk, bias(e, kv)?, "key")?;
            one(value, wv, bias(e + kv, kv)?, "value")
        }
    }
}
