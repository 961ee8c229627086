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

/// One product of the projections: `x·wᵀ + b`, checked and named as `arg`.
struct Product<'a> {
    x: &'a Tensor,
    w: Tensor,
    b: Option<Tensor>,
    arg: &'static str,
}

/// Which products project `call`'s inputs, grouped by which inputs are the same tensor (as
/// PyTorch groups them), in the order they run.
enum Products<'a> {
    /// With `static_k`/`static_v` (which stand for the key and value projections): the query
    /// alone.
    Static(Product<'a>, &'a (Tensor, Tensor)),
    /// Self-attention through the packed weight: one `(·, ·, 3E)` product.
    Qkv(Product<'a>),
    /// Key and value of one memory: the query, then one `(·, ·, 2E)` product.
    QKv(Product<'a>, Product<'a>),
    /// Three products.
    Three([Product<'a>; 3]),
}

/// The products that project `call`'s inputs.
fn products<'a>(call: &'a MhaCall<'_>) -> Result<Products<'a>> {
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
    let alias = call.alias;
    let product = |x, w, b, arg| Product { x, w, b, arg };
    if let Some(kv) = &call.static_kv {
        let wq = match p.in_proj {
            InProj::Packed(w) => w.narrow(0, 0, e)?,
            InProj::Separate { q, .. } => q.clone(),
        };
        return Ok(Products::Static(product(query, wq, bias(0, e)?, "query"), kv));
    }
    Ok(match p.in_proj {
        InProj::Packed(w) if alias.key_is_query && alias.value_is_key => {
            Products::Qkv(product(query, w.clone(), p.in_proj_bias.cloned(), "query"))
        }
        InProj::Packed(w) if alias.value_is_key => Products::QKv(
            product(query, w.narrow(0, 0, e)?, bias(0, e)?, "query"),
            product(key, w.narrow(0, e, 2 * e)?, bias(e, 2 * e)?, "key"),
        ),
        InProj::Packed(w) => Products::Three([
            product(query, w.narrow(0, 0, e)?, bias(0, e)?, "query"),
            product(key, w.narrow(0, e, e)?, bias(e, e)?, "key"),
            product(value, w.narrow(0, 2 * e, e)?, bias(2 * e, e)?, "value"),
        ]),
        InProj::Separate { q, k, v } => Products::Three([
            product(query, q.clone(), bias(0, e)?, "query"),
            product(key, k.clone(), bias(e, kv)?, "key"),
            product(value, v.clone(), bias(e + kv, kv)?, "value"),
        ]),
    })
}

/// Projects `call`'s inputs. With `static_k`/`static_v` only the query is projected, and `k`
/// and `v` are the static tensors, `(N·hk, S, hd)`.
///
/// With `bf16_qkv` (a bf16 module's f32 twin without a gradient, whose attention reads the
/// projection as bf16: [`super::bf16_projection`]), self-attention's packed projection is
/// written as bf16, the bits the attention's products round it to.
pub(crate) fn project(call: &MhaCall, bf16_qkv: bool) -> Result<Projected> {
    let e = call.e;
    let be = call.backend;
    let run = |p: &Product| linear(p.x, &p.w, p.b.as_ref(), MHA, p.arg, be);
    Ok(match products(call)? {
        Products::Static(q, (k, v)) => {
            Projected { q: run(&q)?, k: k.clone(), v: v.clone(), packed: Packed::None }
        }
        Products::Qkv(p) => {
            let qkv = match bf16_qkv {
                true => {
                    let (op, bf16) = ((MHA, p.arg), candle_core::DType::BF16);
                    crate::linear::linear_to(p.x, &p.w, p.b.as_ref(), op, be, bf16)?
                }
                false => run(&p)?,
            };
            let (q, k, v) = (qkv.narrow(2, 0, e)?, qkv.narrow(2, e, e)?, qkv.narrow(2, 2 * e, e)?);
            Projected { q, k, v, packed: Packed::Qkv(qkv) }
        }
        Products::QKv(pq, pkv) => {
            let q = run(&pq)?;
            let kv = run(&pkv)?;
            let (k, v) = (kv.narrow(2, 0, e)?, kv.narrow(2, e, e)?);
            Projected { q, k, v, packed: Packed::Kv(kv) }
        }
        Products::Three([pq, pk, pv]) => {
            Projected { q: run(&pq)?, k: run(&pk)?, v: run(&pv)?, packed: Packed::None }
        }
    })
}

/// What [`project`] checks before it allocates, in its order (for `explain`): each
/// product's arguments, copies and output, through the same checks as the product.
pub(crate) fn ensure(call: &MhaCall, bf16_qkv: bool) -> Result<()> {
    let dt = call.query.dtype();
    let check =
        |p: &Product, out| crate::linear::ensure_linear(p.x, &p.w, p.b.as_ref(), (MHA, p.arg), out);
    match products(call)? {
        Products::Static(q, _) => check(&q, dt),
        Products::Qkv(p) => check(&p, if bf16_qkv { candle_core::DType::BF16 } else { dt }),
        Products::QKv(q, kv) => check(&q, dt).and_then(|_| check(&kv, dt)),
        Products::Three(ps) => ps.iter().try_for_each(|p| check(p, dt)),
    }
}
