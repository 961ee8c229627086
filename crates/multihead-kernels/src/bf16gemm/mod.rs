//! A packed bf16 GEMM on AVX512-BF16 (`vdpbf16ps`): `C (+)= bf16(A) · bf16(B)`, products of
//! bf16 operands accumulated in f32, for the projections and feed-forward layers of
//! `multihead` when they compute in bf16 without a gradient (inference).
//!
//! Operands are f32 (rounded to the nearest bf16, ties to even, as they are packed) or bf16
//! bits, read through two strides each, so `x·Wᵀ` is one call on views. The structure is the
//! classic packed one (Goto and van de Geijn; BLIS), with pairs of `k` in place of single
//! elements, because `vdpbf16ps` multiplies pairs of bf16 and adds both products to an f32 lane:
//!
//! - `k` is cut into blocks of [`KC`] and `n` into blocks of at most [`NC`] columns;
//! - for each block, `B` is packed once into [`NR`]-wide panels of `k` pairs (32-bit words),
//!   shared by every thread;
//! - the rows of `A` are cut into blocks that the threads take; each rounds its block into a
//!   bf16 row-major buffer and walks the `B` panels with a register micro-kernel of
//!   `6 × 64` f32 accumulators (24 `zmm` registers).
//!
//! Each element of `C` is summed over `k` in the same order whatever the thread count, so the
//! results are reproducible across thread counts. Within a pair the instruction adds the odd
//! product first, then the even one; both are exact in f32, so each addition is one f32
//! rounding. The instruction treats subnormal inputs and results as zero (as PyTorch's bf16
//! CPU products on the same instruction do).
//!
//! The micro-kernel is swappable ([`Bf16Kernel`]): besides `vdpbf16ps`, an AMX kernel runs
//! `32 × 64` tiles of `C` on the tile registers (`tdpbf16ps`, with `A` packed row-major and
//! `k` padded to whole 16-pair tile steps), and its exact emulation runs the same layout on any
//! CPU. `Auto` takes the AMX kernel where the tiles are granted ([`AMX_BY_DEFAULT`]: it has run
//! on an AMX CPU, bit for bit its emulation).
//!
//! Where the CPU lacks AVX512-BF16 (or a lower SIMD level is forced), a portable kernel
//! computes the same sums in the same order in f32 (subnormals kept), so the two agree on
//! normal numbers bit for bit. Whether the instruction is worth using is a property of the
//! CPU: [`bf16_dot_speedup`] measures its rate against f32 FMA once (AVX512-BF16 runs at
//! twice the f32 rate on AMD Zen 4 and Zen 5, and at half of it on some Intel Xeons).
//!
//! ```
//! use multihead_kernels::bf16gemm::{matmul_bf16, BfMat};
//!
//! // y (2×2) = x (2×3) · Wᵀ, W (2×3); these values are exact in bf16.
//! let x = [1.0, 2.0, 3.0, -1.0, -2.0, -3.0];
//! let w = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0];
//! let mut y = [0f32; 4];
//! matmul_bf16(BfMat::f32(&x, 2, 3), BfMat::f32(&w, 2, 3).t(), &mut y, 2, false)?;
//! assert_eq!(y, [1.0, 5.0, -1.0, -5.0]);
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

pub(crate) mod amx;
#[cfg(test)]
mod amx_tests;
mod driver;
pub(crate) mod micro;
pub(crate) mod pack;
mod rate;
mod select;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod transpose;

pub use amx::amx_available;
pub use rate::{bf16_dot_available, bf16_dot_speedup};
pub use select::{active_bf16_kernel, with_bf16_kernel, Bf16Kernel, AMX_BY_DEFAULT};

use crate::attention::exec::{ConstPtr, SyncPtr};
use crate::attention::KernelError;
use crate::convert::{bf16_bits_to_f32, f32_to_bf16_bits};
use crate::epilogue::{bias_act_in_place, bias_act_reference, Act};

/// Depth of one `k` block (even). Deep blocks: each block is one pass over `C`, whose tiles
/// are loaded and stored again per block, and those loads miss the caches once `C` outgrows
/// them. On an AMD Zen 4, a 4096 × 1536 × 512 product went 272-291 -> 368-376 GFLOP/s (of a
/// 467 bf16 peak) from 192 to 1024, and the 4096-deep weight-gradient products of training
/// as much; the `B` panel (`KC/2 × NR` words, 128 KiB) streams from L2 instead of sitting in L1,
/// which the prefetchers hide (`cargo run --release -p multihead-kernels --example bf16gemm`).
pub const KC: usize = 1024;
/// Most columns of `B` packed at once (`KC × NC` bf16, 2 MiB, shared by the threads).
pub const NC: usize = 1024;
/// Columns of one micro-tile (four 16-lane vectors).
pub const NR: usize = 64;
/// Rows of one micro-tile.
pub const MR: usize = 6;

/// The elements of a [`BfMat`]: f32 values (rounded to bf16 when packed) or bf16 bits.
#[derive(Clone, Copy, Debug)]
pub enum Elems<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
}

impl Elems<'_> {
    fn len(&self) -> usize {
        match self {
            Elems::F32(x) => x.len(),
            Elems::Bf16(x) => x.len(),
        }
    }

    /// Element `i` rounded to bf16 bits.
    #[inline(always)]
    fn bits(&self, i: usize) -> u16 {
        match self {
            Elems::F32(x) => f32_to_bf16_bits(x[i]),
            Elems::Bf16(x) => x[i],
        }
    }
}

/// A read-only matrix view: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct BfMat<'a> {
    /// The elements.
    pub data: Elems<'a>,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Distance between rows.
    pub row_stride: usize,
    /// Distance between columns.
    pub col_stride: usize,
}

impl<'a> BfMat<'a> {
    /// A contiguous row-major `rows × cols` matrix of f32 values.
    pub fn f32(data: &'a [f32], rows: usize, cols: usize) -> Self {
        BfMat { data: Elems::F32(data), rows, cols, row_stride: cols, col_stride: 1 }
    }

    /// A contiguous row-major `rows × cols` matrix of bf16 bits.
    pub fn bf16(data: &'a [u16], rows: usize, cols: usize) -> Self {
        BfMat { data: Elems::Bf16(data), rows, cols, row_stride: cols, col_stride: 1 }
    }

    /// The same matrix with its rows `row_stride` apart.
    pub fn with_row_stride(self, row_stride: usize) -> Self {
        BfMat { row_stride, ..self }
    }

    /// The transpose, as a view of the same elements.
    pub fn t(self) -> Self {
        BfMat {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Element `(i, j)` rounded to bf16 bits.
    #[inline(always)]
    fn bits(&self, i: usize, j: usize) -> u16 {
        self.data.bits(i * self.row_stride + j * self.col_stride)
    }
}

/// Largest offset + 1 that a `rows × cols` view with these strides addresses (0 when empty).
fn extent(
    name: &'static str,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
) -> Result<usize, KernelError> {
    if rows == 0 || cols == 0 {
        return Ok(0);
    }
    (rows - 1)
        .checked_mul(rs)
        .and_then(|r| (cols - 1).checked_mul(cs).and_then(|c| r.checked_add(c)))
        .and_then(|x| x.checked_add(1))
        .ok_or(KernelError::Overflow { name })
}

fn fits(name: &'static str, needed: usize, len: usize) -> Result<(), KernelError> {
    if needed > len {
        return Err(KernelError::SliceTooShort { name, needed, len });
    }
    Ok(())
}

/// Checks the operands of a product: `B`'s rows match `A`'s columns and both views lie in
/// their slices; returns `(m, n, k)`.
fn check_operands(a: &BfMat, b: &BfMat) -> Result<(usize, usize, usize), KernelError> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k {
        return Err(KernelError::InvalidArgument {
            name: "b",
            msg: format!("a is {m}x{k}, so b must have {k} rows, got {}x{n}", b.rows),
        });
    }
    fits("a", extent("a", m, k, a.row_stride, a.col_stride)?, a.data.len())?;
    fits("b", extent("b", k, n, b.row_stride, b.col_stride)?, b.data.len())?;
    Ok((m, n, k))
}

/// Checks the arguments of [`matmul_bf16`] and its twin; returns `(m, n, k)`.
fn check(
    a: &BfMat,
    b: &BfMat,
    c: &[f32],
    ldc: usize,
) -> Result<(usize, usize, usize), KernelError> {
    let (m, n, k) = check_operands(a, b)?;
    if m > 1 && ldc < n {
        return Err(KernelError::OverlappingOutput { name: "c" });
    }
    fits("c", extent("c", m, n, ldc, 1)?, c.len())?;
    Ok((m, n, k))
}

/// `C (m×n) = A (m×k) · B (k×n)`, or `C += A·B` with `accumulate`, with both operands rounded
/// to bf16 and the products summed in f32; `C` is row-major with row stride `ldc`.
///
/// Runs on the current rayon pool, on the micro-kernel [`active_bf16_kernel`] names: by default
/// AVX512-BF16 where the CPU has it and the SIMD level
/// ([`simd_level`](crate::attention::simd_level)) is AVX-512, the portable kernel otherwise. Errors: `B`'s rows differ from `A`'s columns, a slice is shorter than its view,
/// `ldc < n`, or a packing buffer cannot be allocated.
pub fn matmul_bf16(
    a: BfMat,
    b: BfMat,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> Result<(), KernelError> {
    let (m, n, k) = check(&a, &b, c, ldc)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                c[i * ldc..i * ldc + n].fill(0.0);
            }
        }
        return Ok(());
    }
    // SAFETY: `check` bounds the `m × n` view with row stride `ldc` inside `c`, which the
    // exclusive borrow reserves for the call.
    unsafe {
        driver::run(
            &a,
            &b,
            driver::Out::F32 { c: SyncPtr(c.as_mut_ptr()), ldc, accumulate, epilogue: None },
        )
    }
}

/// `A · B` as [`matmul_bf16`] computes it, in a new row-major `m × n` buffer that is not
/// zeroed first (the product writes every element: a pass over memory saved). Errors as
/// [`matmul_bf16`]'s, and when `m · n` floats cannot be allocated.
pub fn matmul_bf16_new(a: BfMat, b: BfMat) -> Result<Vec<f32>, KernelError> {
    matmul_bf16_new_with(a, b, None, Act::Identity)
}

/// `act(A·B + bias)` in f32: [`matmul_bf16_new`], then [`bias_act_in_place`], bit for bit, but
/// each tile's epilogue runs as its last `k` block leaves the micro-kernel (no second pass
/// over the output). Errors as [`matmul_bf16_to_bf16`]'s.
pub fn matmul_bf16_new_with(
    a: BfMat,
    b: BfMat,
    bias: Option<&[f32]>,
    act: Act,
) -> Result<Vec<f32>, KernelError> {
    let (m, n, k) = check_operands(&a, &b)?;
    check_bias(bias, n)?;
    let (len, mut c) = output::<f32>(m, n)?;
    if k == 0 || len == 0 {
        c.resize(len, 0.0);
        bias_act_in_place(&mut c, n, bias, act)?;
        return Ok(c);
    }
    let epilogue = (bias.is_some() || act != Act::Identity).then(|| driver::Epilogue {
        bias: bias.map(|b| ConstPtr(b.as_ptr())),
        act,
        level: crate::attention::simd_level(),
    });
    // SAFETY: the buffer holds `len = m · n` floats (reserved above), rows `n` apart, and the
    // bias `n` values (checked); without `accumulate` the driver writes all of them before any
    // is read, and only then does `set_len` expose them.
    unsafe {
        let target =
            driver::Out::F32 { c: SyncPtr(c.as_mut_ptr()), ldc: n, accumulate: false, epilogue };
        driver::run(&a, &b, target)?;
        c.set_len(len);
    }
    Ok(c)
}

/// `m · n` and an empty buffer with room for that many outputs, or the error that says why
/// not.
fn output<T>(m: usize, n: usize) -> Result<(usize, Vec<T>), KernelError> {
    let len = m.checked_mul(n).ok_or_else(|| KernelError::InvalidArgument {
        name: "c",
        msg: format!("{m} x {n} outputs overflow usize"),
    })?;
    let mut c: Vec<T> = Vec::new();
    c.try_reserve_exact(len).map_err(|_| KernelError::InvalidArgument {
        name: "c",
        msg: format!("cannot allocate {len} outputs"),
    })?;
    Ok((len, c))
}

/// A bias of `n` values, if any.
fn check_bias(bias: Option<&[f32]>, n: usize) -> Result<(), KernelError> {
    match bias {
        Some(b) if b.len() != n => Err(KernelError::InvalidArgument {
            name: "bias",
            msg: format!(
                "the product has {n} columns, so the bias needs {n} values, got {}",
                b.len()
            ),
        }),
        _ => Ok(()),
    }
}

/// Deepest product [`matmul_bf16_to_bf16`] runs with its epilogue fused (one block spans the
/// depth); deeper ones take the f32 product, then the epilogue and the rounding as passes.
const MAX_FUSED_DEPTH: usize = 1 << 13;

/// `bf16(act(A·B + bias))`: the product as [`matmul_bf16`] computes it (bf16 operands, f32
/// sums), the bias added and the activation applied in f32, and the result rounded once to
/// bf16 (nearest even), in a new row-major `m × n` buffer of bf16 bits. The bits of
/// [`matmul_bf16_new`], then [`bias_act_in_place`], then
/// [`f32_to_bf16_bits`]; but each tile's epilogue runs as
/// the tile leaves the micro-kernel, so no f32 `m × n` buffer exists (a bf16 layer's outputs
/// and gradients are written once, half the bytes).
///
/// Errors: as [`matmul_bf16_new`]'s, and a bias that does not hold `n` values.
///
/// ```
/// use multihead_kernels::bf16gemm::{matmul_bf16_to_bf16, BfMat};
/// use multihead_kernels::convert::bf16_bits_to_f32;
/// use multihead_kernels::epilogue::Act;
///
/// // relu(x · Wᵀ + b): x (2×3), W (2×3), b (2,); these values are exact in bf16.
/// let x = [1.0, 2.0, 3.0, -1.0, -2.0, -3.0];
/// let w = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0];
/// let y = matmul_bf16_to_bf16(BfMat::f32(&x, 2, 3), BfMat::f32(&w, 2, 3).t(), Some(&[0.5, -1.0]), Act::Relu)?;
/// let y: Vec<f32> = y.into_iter().map(bf16_bits_to_f32).collect();
/// assert_eq!(y, [1.5, 4.0, 0.0, 0.0]);
/// # Ok::<(), multihead_kernels::attention::KernelError>(())
/// ```
pub fn matmul_bf16_to_bf16(
    a: BfMat,
    b: BfMat,
    bias: Option<&[f32]>,
    act: Act,
) -> Result<Vec<u16>, KernelError> {
    let (m, n, k) = check_operands(&a, &b)?;
    check_bias(bias, n)?;
    let (len, mut out) = output::<u16>(m, n)?;
    if k == 0 || k > MAX_FUSED_DEPTH || len == 0 {
        let y = matmul_bf16_new_with(a, b, bias, act)?;
        crate::convert::f32_to_bf16_uninit(&y, &mut out.spare_capacity_mut()[..len])?;
        // SAFETY: the conversion wrote all `len` elements of the reserved capacity.
        unsafe { out.set_len(len) };
        return Ok(out);
    }
    let epilogue = driver::Epilogue {
        bias: bias.map(|b| ConstPtr(b.as_ptr())),
        act,
        level: crate::attention::simd_level(),
    };
    let target = driver::Out::Bf16 { out: SyncPtr(out.as_mut_ptr()), ldo: n, epilogue };
    // SAFETY: the buffer holds `len = m · n` bf16 (reserved above), rows `n` apart, and the
    // bias `n` values (checked); the driver writes every element of the view before
    // `set_len` exposes them.
    unsafe {
        driver::run(&a, &b, target)?;
        out.set_len(len);
    }
    Ok(out)
}

/// The reference twin of [`matmul_bf16_to_bf16`]: [`matmul_bf16_reference`], the epilogue's
/// reference and the reference rounding.
pub fn matmul_bf16_to_bf16_reference(
    a: BfMat,
    b: BfMat,
    bias: Option<&[f32]>,
    act: Act,
) -> Result<Vec<u16>, KernelError> {
    let (m, n, _) = check_operands(&a, &b)?;
    let mut y = vec![0f32; m * n];
    matmul_bf16_reference(a, b, &mut y, n, false)?;
    bias_act_reference(&mut y, n, bias, act)?;
    Ok(y.into_iter().map(crate::convert::f32_to_bf16_reference).collect())
}

/// The reference twin of [`matmul_bf16`]: a triple loop over the bf16-rounded operands,
/// accumulating in f64.
pub fn matmul_bf16_reference(
    a: BfMat,
    b: BfMat,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> Result<(), KernelError> {
    let (m, n, k) = check(&a, &b, c, ldc)?;
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k)
                .map(|p| {
                    bf16_bits_to_f32(a.bits(i, p)) as f64 * bf16_bits_to_f32(b.bits(p, j)) as f64
                })
                .sum();
            let prev = if accumulate { c[i * ldc + j] as f64 } else { 0.0 };
            c[i * ldc + j] = (prev + s) as f32;
        }
    }
    Ok(())
}
