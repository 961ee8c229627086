//! `act(x Wᵀ + b)` with the operands' products in bf16, for inference on CPUs whose bf16 dot
//! product outruns f32 FMA (`multihead_kernels::bf16gemm`). No backward: `linear` takes it only
//! when no gradient is recorded.

use candle_core::{CpuStorage, Layout, Shape};
use multihead_kernels::bf16gemm::{matmul_bf16_new_with, matmul_bf16_to_bf16, BfMat, Elems};
use multihead_kernels::epilogue::Act;

const OP: &str = "linear (bf16 products)";

/// `y = act(bf16(x) · bf16(W)ᵀ + b)`, summed in f32: x `(m, k)` (rows evenly strided), W
/// `(n, k)`, b `(n,)`, each f32 or bf16. f32 operands are rounded to bf16 as they are packed
/// (a bf16 layer's widened weights are bf16 values already, so they stay exact). The bias
/// and activation are applied in f32 and the output is in the dtype `out` names: rounded
/// once when bf16.
pub(crate) struct Bf16Linear {
    pub(crate) act: Act,
    pub(crate) out: OutDtype,
}

/// The dtype of [`Bf16Linear`]'s output.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum OutDtype {
    /// x's dtype (a bf16 `Linear`, or the f32 product of a bf16 layer's f32 twin).
    AsInput,
    /// bf16 whatever x's dtype: a bf16 layer's f32 twin writing activations that only a
    /// product reads next (which rounds them to exactly these bits).
    Bf16,
    /// f32 whatever x's dtype: the product that reads such activations.
    F32,
}

/// `(offset, row stride)` of a matrix layout whose rows are evenly strided, or an error.
fn strided_rows(l: &Layout, what: &str) -> candle_core::Result<(usize, usize)> {
    super::linear::rows(l)
        .ok_or_else(|| candle_core::Error::Msg(format!("{OP}: {what} rows are not evenly strided")))
}

/// The elements of an f32 or bf16 storage.
fn elems<'a>(s: &'a CpuStorage, what: &str) -> candle_core::Result<Elems<'a>> {
    match s {
        CpuStorage::F32(v) => Ok(Elems::F32(v)),
        CpuStorage::BF16(v) => Ok(Elems::Bf16(super::convert::bits(v))),
        _ => candle_core::bail!("{OP}: {what} must be f32 or bf16"),
    }
}

/// `e` from element `offset` on.
fn skip(e: Elems<'_>, offset: usize) -> candle_core::Result<Elems<'_>> {
    let short = || candle_core::Error::Msg(format!("{OP}: a layout starts past its storage"));
    Ok(match e {
        Elems::F32(v) => Elems::F32(v.get(offset..).ok_or_else(short)?),
        Elems::Bf16(v) => Elems::Bf16(v.get(offset..).ok_or_else(short)?),
    })
}

impl Bf16Linear {
    fn run(
        &self,
        (xs, xl): (&CpuStorage, &Layout),
        (ws, wl): (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let &[n, k] = wl.dims() else { candle_core::bail!("{OP}: expected a 2-D weight") };
        let dims = xl.dims();
        let Some((&kx, lead)) = dims.split_last() else {
            candle_core::bail!("{OP}: expected x with a feature dimension")
        };
        if kx != k {
            candle_core::bail!("{OP}: x has {kx} features, the weight {k}");
        }
        let m: usize = lead.iter().product();
        let (xo, xrs) = strided_rows(xl, "x")?;
        let (wo, wrs) = strided_rows(wl, "weight")?;
        let x = BfMat {
            data: skip(elems(xs, "x")?, xo)?,
            rows: m,
            cols: k,
            row_stride: xrs,
            col_stride: 1,
        };
        let w = BfMat {
            data: skip(elems(ws, "weight")?, wo)?,
            rows: n,
            cols: k,
            row_stride: wrs,
            col_stride: 1,
        };
        let err = |e| candle_core::Error::Msg(format!("{OP}: {e}"));
        let mut widened = Vec::new();
        let b = match bias {
            Some((bs, bl)) => {
                let range = bl.contiguous_offsets().ok_or_else(|| {
                    candle_core::Error::Msg(format!("{OP}: the bias must be contiguous"))
                })?;
                Some(super::convert::f32_values(bs, range, &mut widened, OP)?)
            }
            None => None,
        };
        let mut out_dims = lead.to_vec();
        out_dims.push(n);
        let bf16_out = match self.out {
            OutDtype::AsInput => matches!(xs, CpuStorage::BF16(_)),
            OutDtype::Bf16 => true,
            OutDtype::F32 => false,
        };
        let out = match bf16_out {
            // The bias, activation and rounding on each tile as it leaves the kernel.
            true => CpuStorage::BF16(super::convert::from_bits(
                matmul_bf16_to_bf16(x, w.t(), b, self.act).map_err(err)?,
            )),
            false => CpuStorage::F32(matmul_bf16_new_with(x, w.t(), b, self.act).map_err(err)?),
        };
        Ok((out, Shape::from(out_dims)))
    }
}

super::forward_only_linear_ops!(Bf16Linear, OP);
