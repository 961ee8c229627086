//! `y = x Wᵀ + b` for a few rows of `x` (a decode step's new tokens): the weight is read once,
//! in blocks of output features spread over the threads, and every row is multiplied against
//! each block while it sits in L1. A general GEMM packs the whole weight for a handful of rows,
//! which costs more than the product itself.
//!
//! Each output is the dot product of an input row with a weight row, summed in `LANES`
//! partial sums that are then added in a fixed tree, so results do not depend on the thread
//! count.
//!
//! ```
//! use multihead_kernels::gemv::{linear_rows, MAX_ROWS};
//!
//! let (m, k, n) = (2, 3, 2);
//! let x = [1.0, 2.0, 3.0, 0.5, 0.5, 0.5];
//! let w = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]; // (n, k)
//! let mut y = [0f32; 4];
//! linear_rows(&x, m, k, &w, n, Some(&[0.25, 0.0]), &mut y)?;
//! assert_eq!(y, [1.25, 5.0, 0.75, 1.0]);
//! assert!(m <= MAX_ROWS);
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

use crate::attention::exec::{par_run, ConstPtr, SyncPtr, Task};
use crate::attention::simd::Simd;
use crate::attention::{simd_level, KernelError};
use crate::elem::{dot as dot_e, dot_rows, Elem};

/// The most rows one call takes (more rows are better served by a GEMM).
pub const MAX_ROWS: usize = 8;
/// Output features per task.
const OUT_BLOCK: usize = 64;
/// Weight rows read at once ([`dot_rows`]): one row at a time kept a single line in flight
/// and read a weight larger than the caches at 10 GB/s on one Zen 5 core; four read it at
/// 29-31 GB/s (docs/performance.md, "Decoding steps: small ones on the caller, one hop for the
/// rest, four weight rows at once").
const RB: usize = 4;

fn check(name: &'static str, needed: Option<usize>, len: usize) -> Result<(), KernelError> {
    match needed {
        None => Err(KernelError::Overflow { name }),
        Some(n) if n > len => Err(KernelError::SliceTooShort { name, needed: n, len }),
        Some(_) => Ok(()),
    }
}

/// `y[r, o] = Σ_i x[r, i]·w[o, i] + bias[o]` for `r < rows <= MAX_ROWS`, `o < n`; `x` is
/// `rows × k`, `w` is `n × k`, `y` is `rows × n`, all row-major and contiguous.
pub fn linear_rows(
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    rows_impl(x, rows, k, w, n, bias, y)
}

/// [`linear_rows`] with a bfloat16 weight (its bits), widened exactly in registers: the bits
/// of [`linear_rows`] on the widened weight, reading half the bytes.
pub fn linear_rows_bf16(
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[u16],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    rows_impl(x, rows, k, w, n, bias, y)
}

fn rows_impl<E: Elem>(
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[E],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    if rows > MAX_ROWS {
        return Err(KernelError::InvalidArgument {
            name: "rows",
            msg: format!("at most {MAX_ROWS} rows, got {rows}"),
        });
    }
    check("x", rows.checked_mul(k), x.len())?;
    check("w", n.checked_mul(k), w.len())?;
    check("y", rows.checked_mul(n), y.len())?;
    if let Some(b) = bias {
        check("bias", Some(n), b.len())?;
    }
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let task = RowsTask {
        x: ConstPtr(x.as_ptr()),
        rows,
        k,
        w: ConstPtr(w.as_ptr()),
        n,
        bias: bias.map(|b| ConstPtr(b.as_ptr())),
        y: SyncPtr(y.as_mut_ptr()),
    };
    par_run(simd_level(), &task);
    Ok(())
}

struct RowsTask<E> {
    x: ConstPtr<f32>,
    rows: usize,
    k: usize,
    w: ConstPtr<E>,
    n: usize,
    bias: Option<ConstPtr<f32>>,
    y: SyncPtr<f32>,
}

impl<E: Elem> Task for RowsTask<E> {
    fn count(&self) -> usize {
        self.n.div_ceil(OUT_BLOCK)
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        0
    }
    fn work(&self) -> usize {
        self.rows.saturating_mul(self.k).saturating_mul(self.n)
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, _buf: &mut [f32]) {
        let (l, k) = (S::LANES, self.k);
        let (o0, o1) = (t * OUT_BLOCK, ((t + 1) * OUT_BLOCK).min(self.n));
        let mut sums = [0f32; 16];
        // SAFETY: rows `o < n` of `w`, rows `r < rows` of `x` and elements `(r, o)` of `y`
        // were checked by `linear_rows`; this task alone writes outputs `o0..o1`.
        unsafe {
            let mut o = o0;
            while o < o1 {
                let group = (o1 - o).min(l);
                for r in 0..self.rows {
                    let xr = self.x.0.add(r * k);
                    if group == l {
                        let mut accs = [S::splat(0.0); 16];
                        if l % RB == 0 {
                            for (i, part) in accs[..l].chunks_exact_mut(RB).enumerate() {
                                let w = self.w.0.add((o + RB * i) * k);
                                part.copy_from_slice(&dot_rows::<S, E, RB>(xr, w, k, k));
                            }
                        } else {
                            for (i, acc) in accs.iter_mut().take(l).enumerate() {
                                *acc = dot_e::<S, E>(xr, self.w.0.add((o + i) * k), k);
                            }
                        }
                        S::reduce_many(accs.as_ptr(), sums.as_mut_ptr());
                    } else {
                        for (i, s) in sums.iter_mut().take(group).enumerate() {
                            *s = S::reduce_add(dot_e::<S, E>(xr, self.w.0.add((o + i) * k), k));
                        }
                    }
                    for (i, &s) in sums.iter().take(group).enumerate() {
                        let b = self.bias.map_or(0.0, |b| *b.0.add(o + i));
                        *self.y.0.add(r * self.n + o + i) = s + b;
                    }
                }
                o += group;
            }
        }
    }
}

/// The reference twin of [`linear_rows`], accumulating in f64.
pub fn linear_rows_reference(
    x: &[f32],
    rows: usize,
    k: usize,
    w: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    y: &mut [f32],
) {
    for r in 0..rows {
        for o in 0..n {
            let s: f64 = (0..k).map(|i| x[r * k + i] as f64 * w[o * k + i] as f64).sum();
            y[r * n + o] = (s + bias.map_or(0.0, |b| b[o] as f64)) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::attention::{detected_simd_level, with_simd_level};
    use crate::testutil::rand_vec;

    #[test]
    fn matches_the_reference_at_every_simd_level_and_thread_count() {
        let levels = crate::testutil::levels();
        for (rows, k, n) in [(1, 512, 1536), (3, 7, 5), (8, 65, 130), (2, 16, 16), (4, 1, 33)] {
            let x = rand_vec(rows * k, 1);
            let w = rand_vec(n * k, 2);
            let b = rand_vec(n, 3);
            let mut want = vec![0f32; rows * n];
            linear_rows_reference(&x, rows, k, &w, n, Some(&b), &mut want);
            let mut first: Option<Vec<f32>> = None;
            for &level in &levels {
                for threads in [1, 3] {
                    let pool =
                        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    let mut y = vec![f32::NAN; rows * n];
                    pool.install(|| {
                        with_simd_level(level, || linear_rows(&x, rows, k, &w, n, Some(&b), &mut y))
                    })
                    .unwrap();
                    let err = y.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(err <= 1e-5 * (k as f32).sqrt(), "{rows}x{k}x{n} {level:?}: {err}");
                    if level == detected_simd_level() {
                        match &first {
                            None => first = Some(y),
                            Some(f) => {
                                assert!(f.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()))
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_bf16_weight_gives_the_bits_of_the_f32_kernel_on_its_widened_copy() {
        for (rows, k, n) in [(1, 512, 96), (3, 7, 5), (8, 65, 130)] {
            let x = rand_vec(rows * k, 4);
            let bits: Vec<u16> =
                rand_vec(n * k, 5).iter().map(|&v| crate::convert::f32_to_bf16_bits(v)).collect();
            let wide: Vec<f32> =
                bits.iter().map(|&b| crate::convert::bf16_bits_to_f32(b)).collect();
            let b = rand_vec(n, 6);
            for level in crate::testutil::levels() {
                let (mut want, mut got) = (vec![0f32; rows * n], vec![1f32; rows * n]);
                with_simd_level(level, || linear_rows(&x, rows, k, &wide, n, Some(&b), &mut want))
                    .unwrap();
                with_simd_level(level, || {
                    linear_rows_bf16(&x, rows, k, &bits, n, Some(&b), &mut got)
                })
                .unwrap();
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{level:?}"
                );
            }
        }
        let mut y = [0f32; 4];
        assert!(linear_rows_bf16(&[0.0; 4], 2, 2, &[0; 3], 2, None, &mut y).is_err());
    }

    #[test]
    fn bad_sizes_are_errors() {
        let mut y = [0f32; 4];
        assert!(linear_rows(&[0.0; 9 * 2], 9, 2, &[0.0; 4], 2, None, &mut y).is_err());
        assert!(linear_rows(&[0.0; 3], 2, 2, &[0.0; 4], 2, None, &mut y).is_err());
        assert!(linear_rows(&[0.0; 4], 2, 2, &[0.0; 4], 2, Some(&[0.0]), &mut y).is_err());
    }
}
