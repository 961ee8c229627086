//! The copies the fused SDPA path makes of its inputs, and the checks that say, before any of
//! them is made, whether the allocator can take them: by the call and by
//! [`explain_sdpa`](super::sdpa::explain_sdpa) alike, so that a plan that says `Ok` is one the
//! call can run, and a size that cannot be allocated is an [`Error::Alloc`](crate::Error::Alloc),
//! never an abort.
//!
//! Two copies:
//! * a query, key or value view whose last dimension is strided (a transpose, a broadcast of
//!   the feature dimension) is copied to full size, since the kernels read rows;
//! * the additive mask, in f32, as the kernels read it, **without its broadcast dimensions**:
//!   a mask built with `expand`/`broadcast_as` (stride 0) is read at the size of the data
//!   behind it, and the kernels read the repeated dimensions with stride 0. A `(L, S)` mask
//!   expanded to `(N, H, L, S)`, as PyTorch code often writes it, costs `L·S` floats, not
//!   `N·H·L·S`. Where no backward can read it and that data is a contiguous f32 tensor (a
//!   dense mask as given, or the call's conversion of a bf16 or bool one), it is read where
//!   it lies and nothing is copied ([`FlashMask`]).

use candle_core::{DType, Tensor};

use super::sdpa::SDPA;
use crate::error::Result;
use crate::fused::flash::FlashMask;
use crate::mask::compact;

/// Whether the kernels need a row-major copy of `t` (rank 4): its last dimension is strided.
pub(super) fn needs_row_copy(t: &Tensor) -> bool {
    let (d, st) = (t.dims(), t.stride());
    d[3] > 1 && st[3] != 1
}

/// The strides through which the kernels read a mask of `dims` (rank at most 4, left-padded
/// with 1s), stored densely: stride 0 for every dimension of size 1.
pub(super) fn mask_strides(dims: &[usize]) -> [usize; 4] {
    let mut padded = vec![1usize; 4usize.saturating_sub(dims.len())];
    padded.extend_from_slice(dims);
    let mut strides = [0usize; 4];
    let mut acc = 1;
    for i in (0..4).rev() {
        strides[i] = if padded[i] == 1 { 0 } else { acc };
        acc *= padded[i];
    }
    strides
}

/// Whether a backward may read the fused op's mask (see [`FlashMask`]): the condition under
/// which the op keeps its row statistics, over the op's inputs, the mask and the sinks. The
/// call and [`ensure_fused`] decide alike.
pub(super) fn mask_for_backward(
    [q, k, v]: [&Tensor; 3],
    mask: Option<&Tensor>,
    sinks: Option<&Tensor>,
) -> bool {
    let mut xs = vec![q, k, v];
    xs.extend(mask.into_iter().chain(sinks));
    crate::fused::flash::gradient_possible(&xs)
}

/// Checks the copies the fused path makes of these rank-4 views (as the kernels read them:
/// batch and head dimensions expanded) and of the additive `mask` (compacted, in f32, counted
/// twice: widened and copied for the kernels), which is read in place instead where no
/// `backward` can read it ([`mask_for_backward`]) and it is f32 and dense.
pub(super) fn ensure_fused(
    views: [&Tensor; 3],
    mask: Option<&Tensor>,
    backward: bool,
) -> Result<()> {
    let hint = "a view whose last dimension is strided (a transpose or a broadcast) is copied \
                to full size for the fused kernels; pass it contiguous in its last dimension";
    for (what, t) in ["query", "key", "value"].into_iter().zip(views) {
        if needs_row_copy(t) {
            crate::alloc::ensure(SDPA, what, t.dims(), t.dtype(), 1, hint)?;
        }
    }
    if let Some(m) = mask {
        // Read where it lies without a backward when f32 and dense behind its broadcast
        // dimensions.
        let m = compact(m)?;
        if !FlashMask::reads_in_place(&m, backward) {
            let hint = "the fused kernels copy the mask in f32 (without its broadcast \
                        dimensions); pass a smaller mask";
            crate::alloc::ensure(SDPA, "attn_mask", m.dims(), DType::F32, 2, hint)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_broadcast_view_compacts_to_the_data_behind_it_with_the_same_values() {
        let dev = Device::Cpu;
        let base = Tensor::arange(0f32, 6.0, &dev).unwrap().reshape((1, 2, 1, 3)).unwrap();
        let view = base.broadcast_as((4, 2, 5, 3)).unwrap();
        let c = compact(&view).unwrap();
        assert_eq!(c.dims(), &[1, 2, 1, 3]);
        let back = c.broadcast_as((4, 2, 5, 3)).unwrap();
        let (a, b) = (view.flatten_all().unwrap(), back.flatten_all().unwrap());
        assert_eq!(a.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        // A dense tensor and a transposed one keep their dimensions.
        let t = view.contiguous().unwrap().transpose(2, 3).unwrap();
        assert_eq!(compact(&t).unwrap().dims(), t.dims());
        assert_eq!(mask_strides(&[2, 1, 3]), [0, 3, 0, 1]);
        assert_eq!(mask_strides(&[4, 2, 5, 3]), [30, 15, 3, 1]);
    }

    #[test]
    fn copies_that_cannot_be_allocated_are_errors_before_they_are_made() {
        let dev = Device::Cpu;
        let one = Tensor::ones((1, 1, 1, 1), DType::F32, &dev).unwrap();
        // A feature dimension broadcast to 2^40 elements.
        let q = one.broadcast_as((1, 1, 1 << 20, 1 << 20)).unwrap();
        let err = ensure_fused([&q, &one, &one], None, false).unwrap_err();
        assert!(err.to_string().contains("cannot be allocated"), "{err}");
        assert!(err.to_string().contains("query"), "{err}");
        // A mask broadcast to 2^40 elements is a single value behind the view.
        let m = one.broadcast_as((1, 1, 1 << 20, 1 << 20)).unwrap();
        ensure_fused([&one, &one, &one], Some(&m), false).unwrap();
    }
}
