//! Sums over broadcast dimensions: the gradient of a tensor that was broadcast to a larger
//! shape (a learned attention bias `(N|1, H|1, L|1, S|1)` added to `(N, H, L, S)` scores) is
//! the larger gradient summed over the dimensions it repeated.
//!
//! Every output element adds its sources in their order in the input (row-major), so the
//! results are bitwise those of the reference twin ([`reference`](mod@reference)) for any
//! thread count.
//!
//! ```
//! use multihead_kernels::reduce::sum_to_broadcast;
//!
//! // (2, 1, 2, 3) summed to (1, 1, 2, 1): two rows, each the sum over batch and columns.
//! let src: Vec<f32> = (0..12).map(|i| i as f32).collect();
//! let mut dst = [0.0f32; 2];
//! sum_to_broadcast(&src, [2, 1, 2, 3], [1, 1, 2, 1], &mut dst)?;
//! assert_eq!(dst, [0.0 + 1.0 + 2.0 + 6.0 + 7.0 + 8.0, 3.0 + 4.0 + 5.0 + 9.0 + 10.0 + 11.0]);
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

use rayon::prelude::*;

use crate::attention::KernelError;

/// Output rows per rayon task at the least.
const MIN_ROWS: usize = 16;

/// The element counts of `full` and `dims`, after checking that each of `dims` is `full`'s
/// or 1 and that the slices are long enough.
fn check(
    src: &[f32],
    full: [usize; 4],
    dims: [usize; 4],
    dst: &[f32],
) -> Result<(usize, usize), KernelError> {
    if let Some(i) = (0..4).find(|&i| dims[i] != full[i] && dims[i] != 1) {
        return Err(KernelError::InvalidArgument {
            name: "dims",
            msg: format!(
                "dimension {i} is {} but must be {} or 1 to sum {full:?} to {dims:?}",
                dims[i], full[i]
            ),
        });
    }
    let count = |d: [usize; 4], name| {
        d.iter().try_fold(1usize, |a, &x| a.checked_mul(x)).ok_or(KernelError::Overflow { name })
    };
    let (n, m) = (count(full, "src")?, count(dims, "dst")?);
    for (name, needed, len) in [("src", n, src.len()), ("dst", m, dst.len())] {
        if len < needed {
            return Err(KernelError::SliceTooShort { name, needed, len });
        }
    }
    Ok((n, m))
}

/// Writes into `dst` (row-major `dims`) the sum of `src` (row-major `full`) over every
/// dimension where `dims` is 1 and `full` is not. Each of `dims` is `full`'s or 1.
pub fn sum_to_broadcast(
    src: &[f32],
    full: [usize; 4],
    dims: [usize; 4],
    dst: &mut [f32],
) -> Result<(), KernelError> {
    let (_, m) = check(src, full, dims, dst)?;
    let [_, h, l, s] = full;
    let [tb, th, tl, ts] = dims;
    if m == 0 {
        return Ok(());
    }
    // The source indices along one dimension that feed output index `i` there.
    let along = |i: usize, t: usize, f: usize| if t == 1 { 0..f } else { i..i + 1 };
    dst[..m].par_chunks_mut(ts).with_min_len(MIN_ROWS).enumerate().for_each(|(r, out)| {
        out.fill(0.0);
        let (rb, rh, rl) = (r / (th * tl), (r / tl) % th, r % tl);
        for b in along(rb, tb, full[0]) {
            for hh in along(rh, th, h) {
                for li in along(rl, tl, l) {
                    let start = ((b * h + hh) * l + li) * s;
                    let row = &src[start..start + s];
                    if ts == s {
                        out.iter_mut().zip(row).for_each(|(o, x)| *o += x);
                    } else {
                        out[0] = row.iter().fold(out[0], |acc, x| acc + x);
                    }
                }
            }
        }
    });
    Ok(())
}

/// The naive twins of this module's kernels.
pub mod reference {
    use super::*;

    /// [`sum_to_broadcast`](super::sum_to_broadcast) one source element at a time, in order.
    pub fn sum_to_broadcast(
        src: &[f32],
        full: [usize; 4],
        dims: [usize; 4],
        dst: &mut [f32],
    ) -> Result<(), KernelError> {
        let (n, m) = check(src, full, dims, dst)?;
        dst[..m].fill(0.0);
        for (flat, x) in src[..n].iter().enumerate() {
            let mut rest = flat;
            let mut idx = [0usize; 4];
            for i in (0..4).rev() {
                idx[i] = rest % full[i];
                rest /= full[i];
            }
            let to = (0..4).fold(0, |a, i| a * dims[i] + if dims[i] == 1 { 0 } else { idx[i] });
            dst[to] += x;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::testutil::rand_vec;

    #[test]
    fn matches_the_reference_bitwise_for_every_broadcast_and_thread_count() {
        let full = [3, 2, 5, 17];
        let src = rand_vec(full.iter().product(), 7);
        for mask in 0..16u32 {
            let dims: [usize; 4] =
                std::array::from_fn(|i| if mask >> i & 1 == 1 { 1 } else { full[i] });
            let m: usize = dims.iter().product();
            let mut want = vec![f32::NAN; m];
            reference::sum_to_broadcast(&src, full, dims, &mut want).unwrap();
            for threads in 1..=3 {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let mut got = vec![f32::NAN; m];
                pool.install(|| sum_to_broadcast(&src, full, dims, &mut got)).unwrap();
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "dims {dims:?}, {threads} threads");
            }
            // The reference against f64 sums.
            let mut f64s = vec![0.0f64; m];
            for (flat, &x) in src.iter().enumerate() {
                let (b, h, l, s) =
                    (flat / (2 * 5 * 17), flat / (5 * 17) % 2, flat / 17 % 5, flat % 17);
                let idx = [b, h, l, s];
                let to = (0..4).fold(0, |a, i| a * dims[i] + if dims[i] == 1 { 0 } else { idx[i] });
                f64s[to] += f64::from(x);
            }
            for (w, e) in want.iter().zip(&f64s) {
                assert!((f64::from(*w) - e).abs() <= 1e-5 * (1.0 + e.abs()), "{w} vs {e}");
            }
        }
    }

    #[test]
    fn empty_sizes_and_bad_arguments() {
        // A broadcast over an empty dimension sums nothing: zeros.
        let mut dst = [f32::NAN; 3];
        sum_to_broadcast(&[], [2, 1, 0, 3], [1, 1, 1, 3], &mut dst).unwrap();
        assert_eq!(dst, [0.0; 3]);
        let mut none: [f32; 0] = [];
        sum_to_broadcast(&[], [2, 1, 4, 0], [1, 1, 4, 0], &mut none).unwrap();
        let e = sum_to_broadcast(&[0.0; 8], [2, 1, 2, 2], [2, 1, 3, 2], &mut [0.0; 12]);
        assert!(matches!(e, Err(KernelError::InvalidArgument { name: "dims", .. })), "{e:?}");
        let e = sum_to_broadcast(&[0.0; 7], [2, 1, 2, 2], [1, 1, 2, 2], &mut [0.0; 4]);
        assert!(matches!(e, Err(KernelError::SliceTooShort { name: "src", .. })), "{e:?}");
        let e = sum_to_broadcast(&[0.0; 8], [2, 1, 2, 2], [1, 1, 2, 2], &mut [0.0; 3]);
        assert!(matches!(e, Err(KernelError::SliceTooShort { name: "dst", .. })), "{e:?}");
        let big = usize::MAX / 2;
        let e = sum_to_broadcast(&[], [big, 4, 1, 1], [1, 4, 1, 1], &mut [0.0; 4]);
        assert!(matches!(e, Err(KernelError::Overflow { name: "src" })), "{e:?}");
    }
}
