//! LayerNorm over the last dimension of contiguous f32 rows: the forward (which saves each
//! row's mean and reciprocal standard deviation) and the backward, with the run-time AVX-512 /
//! AVX2 / scalar dispatch of [`attention`](crate::attention), rayon over blocks of rows, and an
//! f64 reference twin ([`reference`](mod@reference)).
//!
//! Forward, per row of `d` values (as `torch.nn.functional.layer_norm`, biased variance):
//! `mean = Σx/d`, `var = Σ(x − mean)²/d`, `rstd = 1/√(var + eps)`,
//! `y = (x − mean)·rstd·w + b`.
//!
//! Backward, with `x̂ = (x − mean)·rstd` and `g = dy∘w`:
//! `dx = rstd·(g − mean(g) − x̂·mean(g∘x̂))`, `dw = Σ_rows dy∘x̂`, `db = Σ_rows dy`.
//! The column sums are taken per block of [`BLOCK_ROWS`] rows and then added in block order,
//! so results are bitwise identical for any thread count.
//!
//! ```
//! use multihead_kernels::norm::{layer_norm_forward, NormStats};
//!
//! let (rows, d) = (2, 4);
//! let x = [1.0f32, 2.0, 3.0, 4.0, -1.0, 0.0, 1.0, 0.0];
//! let (w, b) = ([1.0f32; 4], [0.0f32; 4]);
//! let mut y = [0.0f32; 8];
//! let mut stats = NormStats::new(rows);
//! layer_norm_forward(&x, d, &w, Some(&b), 1e-5, &mut y, &mut stats)?;
//! assert!((y[0] + 1.3416).abs() < 1e-3); // (1 - 2.5) / √1.25
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

use std::mem::MaybeUninit;

use crate::attention::exec::{par_run, SyncPtr, Task};
use crate::attention::simd::Simd;
use crate::attention::{simd_level, KernelError};

/// Rows per task; also the granularity of the deterministic column sums of the backward.
pub const BLOCK_ROWS: usize = 32;

/// The per-row statistics the forward saves for the backward.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NormStats {
    /// Row means.
    pub mean: Vec<f32>,
    /// Row reciprocal standard deviations `1/√(var + eps)`.
    pub rstd: Vec<f32>,
}

impl NormStats {
    /// Zeroed statistics for `rows` rows.
    pub fn new(rows: usize) -> Self {
        NormStats { mean: vec![0.0; rows], rstd: vec![0.0; rows] }
    }
}

fn check(name: &'static str, needed: usize, len: usize) -> Result<(), KernelError> {
    if len < needed {
        Err(KernelError::SliceTooShort { name, needed, len })
    } else {
        Ok(())
    }
}

/// Checks the shared arguments; returns the row count.
fn rows_of(len: usize, d: usize, w: &[f32], b: Option<&[f32]>) -> Result<usize, KernelError> {
    check("weight", d, w.len())?;
    if let Some(b) = b {
        check("bias", d, b.len())?;
    }
    if d == 0 {
        return Ok(0);
    }
    if !len.is_multiple_of(d) {
        return Err(KernelError::SliceTooShort { name: "x", needed: len.div_ceil(d) * d, len });
    }
    Ok(len / d)
}

/// `Σ x` over `n` floats, and `Σ (x − m)²` when `m` is given, with vector accumulators.
///
/// # Safety
/// `S` is available; `p` points to `n` floats.
#[inline(always)]
unsafe fn row_sum<S: Simd>(p: *const f32, n: usize, m: Option<f32>) -> f32 {
    let l = S::LANES;
    // SAFETY: loads stay below `n` (the tail is masked).
    unsafe {
        let mv = S::splat(m.unwrap_or(0.0));
        let mut acc = S::splat(0.0);
        let mut j = 0;
        while j < n {
            let mask = if j + l <= n { S::full_mask() } else { S::tail_mask(n - j) };
            let x = S::load_m(p.add(j), mask);
            let v = match m {
                Some(_) => {
                    // Masked-off lanes load 0, and (0 − m)² must not count: the tail goes
                    // through a zeroed buffer.
                    let c = S::sub(x, mv);
                    let c2 = S::mul(c, c);
                    if j + l <= n {
                        c2
                    } else {
                        let mut tmp = [0f32; 16];
                        S::store_m(tmp.as_mut_ptr(), c2, mask);
                        S::load(tmp.as_ptr())
                    }
                }
                None => x,
            };
            acc = S::add(acc, v);
            j += l;
        }
        S::reduce_add(acc)
    }
}

struct FwdTask<'a> {
    x: NormInput<'a>,
    /// A residual added to `x` first (`z = x + residual`, then the norm of `z`).
    residual: Option<&'a [f32]>,
    /// Where `z` is kept (for the backward); a per-task row buffer when `None`.
    z: Option<SyncPtr<f32>>,
    d: usize,
    rows: usize,
    w: &'a [f32],
    b: Option<&'a [f32]>,
    eps: f32,
    y: Dst,
    mean: SyncPtr<f32>,
    rstd: SyncPtr<f32>,
}

/// Where the forward writes `y`.
#[derive(Clone, Copy)]
enum Dst {
    F32(SyncPtr<f32>),
    /// Rounded to bf16 as [`f32_to_bf16_bits`](crate::convert::f32_to_bf16_bits) rounds.
    Bf16(SyncPtr<u16>),
}

impl FwdTask<'_> {
    /// Row `r` of the input the norm reads: `x`'s f32 row, or `x` (widened) plus the residual
    /// written to `z` (or to `buf`).
    ///
    /// # Safety
    /// As for `run`; `buf` holds `d` floats when `x` is bf16 or there is a residual, and no
    /// `z`.
    #[inline(always)]
    unsafe fn input_row<S: Simd>(&self, r: usize, buf: &mut [f32]) -> *const f32 {
        let d = self.d;
        // SAFETY: row `r` of `d` values lies inside `x`, `residual` and `z` (checked by the
        // entry point), and this task alone writes it; `buf` holds `d` floats.
        unsafe {
            if let (NormInput::F32(x), None) = (self.x, self.residual) {
                return x.as_ptr().add(r * d);
            }
            let zr = match self.z {
                Some(z) => z.0.add(r * d),
                None => buf.as_mut_ptr(),
            };
            let mut j = 0;
            while j < d {
                let mask = if j + S::LANES <= d { S::full_mask() } else { S::tail_mask(d - j) };
                let mut v = self.load_x::<S>(r * d + j, (d - j).min(S::LANES), mask);
                if let Some(res) = self.residual {
                    v = S::add(v, S::load_m(res.as_ptr().add(r * d + j), mask));
                }
                S::store_m(zr.add(j), v, mask);
                j += S::LANES;
            }
            zr
        }
    }

    /// `live` values of `x` from element `at` (exactly widened where bf16), zero past them.
    ///
    /// # Safety
    /// `S` is available; elements `at..at + live` lie inside `x`, `mask` selects `live` lanes.
    #[inline(always)]
    unsafe fn load_x<S: Simd>(&self, at: usize, live: usize, mask: S::M) -> S::V {
        // SAFETY: only elements `at..at + live` are read (a bf16 tail through a zeroed
        // buffer of 16 >= LANES values).
        unsafe {
            match self.x {
                NormInput::F32(x) => S::load_m(x.as_ptr().add(at), mask),
                NormInput::Bf16(x) if live == S::LANES => S::load_bf16(x.as_ptr().add(at)),
                NormInput::Bf16(x) => {
                    let mut tail = [0u16; 16];
                    tail[..live].copy_from_slice(&x[at..at + live]);
                    S::load_bf16(tail.as_ptr())
                }
            }
        }
    }

    /// Stores `live` values of `y` from element `at` (rounded where the output is bf16).
    ///
    /// # Safety
    /// `S` is available; elements `at..at + live` lie inside `y` and belong to this task;
    /// `mask` selects `live` lanes.
    #[inline(always)]
    unsafe fn store_y<S: Simd>(&self, at: usize, live: usize, mask: S::M, y: S::V) {
        // SAFETY: only elements `at..at + live` are written (a bf16 tail through a buffer).
        unsafe {
            match self.y {
                Dst::F32(p) => S::store_m(p.0.add(at), y, mask),
                Dst::Bf16(p) if live == S::LANES => S::store_bf16(p.0.add(at), y),
                Dst::Bf16(p) => {
                    let mut tail = [0f32; 16];
                    S::store_m(tail.as_mut_ptr(), y, mask);
                    for (i, &v) in tail.iter().enumerate().take(live) {
                        *p.0.add(at + i) = crate::convert::f32_to_bf16_bits(v);
                    }
                }
            }
        }
    }
}

impl Task for FwdTask<'_> {
    fn count(&self) -> usize {
        self.rows.div_ceil(BLOCK_ROWS)
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        let widened = self.residual.is_some() || matches!(self.x, NormInput::Bf16(_));
        if widened && self.z.is_none() {
            crate::attention::exec::round16(self.d)
        } else {
            0
        }
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, buf: &mut [f32]) {
        let (d, l) = (self.d, S::LANES);
        let inv_d = 1.0 / d as f32;
        for r in t * BLOCK_ROWS..((t + 1) * BLOCK_ROWS).min(self.rows) {
            // SAFETY: rows `r < rows` of `d` floats lie inside `x` and `y` (checked by the
            // entry point); this task alone writes rows of its block and their statistics.
            unsafe {
                let xr = self.input_row::<S>(r, buf);
                let mean = row_sum::<S>(xr, d, None) * inv_d;
                let var = row_sum::<S>(xr, d, Some(mean)) * inv_d;
                let rstd = 1.0 / (var + self.eps).sqrt();
                *self.mean.0.add(r) = mean;
                *self.rstd.0.add(r) = rstd;
                let (mv, rv) = (S::splat(mean), S::splat(rstd));
                let mut j = 0;
                while j < d {
                    let mask = if j + l <= d { S::full_mask() } else { S::tail_mask(d - j) };
                    let x = S::load_m(xr.add(j), mask);
                    let w = S::load_m(self.w.as_ptr().add(j), mask);
                    // (x - mean)·rstd·w (+ b), in the composed path's order.
                    let mut y = S::mul(S::mul(S::sub(x, mv), rv), w);
                    if let Some(b) = self.b {
                        y = S::add(y, S::load_m(b.as_ptr().add(j), mask));
                    }
                    self.store_y::<S>(r * d + j, (d - j).min(l), mask, y);
                    j += l;
                }
            }
        }
    }
}

/// The LayerNorm forward over rows of `d` floats: writes `y` (like `x`) and the row
/// statistics.
#[allow(clippy::too_many_arguments)]
// Mirrors torch.nn.functional.layer_norm over the last dimension.
pub fn layer_norm_forward(
    x: &[f32],
    d: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    eps: f32,
    y: &mut [f32],
    stats: &mut NormStats,
) -> Result<(), KernelError> {
    forward(NormInput::F32(x), None, None, d, (weight, bias), eps, Out::of(y).f32(), stats)
}

/// The LayerNorm forward of `z = x + residual` (a Transformer layer's residual connection and
/// its post-norm in one pass): writes `y`, the row statistics, and `z` when given (the
/// backward's input; [`layer_norm_backward`] on `z` gives the gradient of both `x` and the
/// residual). The same bits as [`layer_norm_forward`] on `z` summed in f32 first.
///
/// ```
/// use multihead_kernels::norm::{add_layer_norm_forward, layer_norm_forward, NormStats};
///
/// let (x, r) = ([1.0f32, 2.0, 3.0, 4.0], [0.5f32, -1.0, 0.0, 2.0]);
/// let w = [1.0f32; 4];
/// let (mut y, mut z, mut st) = ([0f32; 4], [0f32; 4], NormStats::new(1));
/// add_layer_norm_forward(&x, &r, 4, &w, None, 1e-5, Some(&mut z), &mut y, &mut st)?;
/// assert_eq!(z, [1.5, 1.0, 3.0, 6.0]);
/// let (mut want, mut st2) = ([0f32; 4], NormStats::new(1));
/// layer_norm_forward(&z, 4, &w, None, 1e-5, &mut want, &mut st2)?;
/// assert_eq!(y, want);
/// # Ok::<(), multihead_kernels::attention::KernelError>(())
/// ```
#[allow(clippy::too_many_arguments)]
// Mirrors torch.nn.functional.layer_norm(x + residual) (post-norm residual blocks).
pub fn add_layer_norm_forward(
    x: &[f32],
    residual: &[f32],
    d: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    eps: f32,
    z: Option<&mut [f32]>,
    y: &mut [f32],
    stats: &mut NormStats,
) -> Result<(), KernelError> {
    let (x, z, y) = (NormInput::F32(x), z.map(Out::of), Out::of(y).f32());
    forward(x, Some(residual), z, d, (weight, bias), eps, y, stats)
}

/// [`layer_norm_forward`] into memory that need not be initialised: on `Ok`, every element
/// of `y[..x.len()]` has been written (so the output can be allocated without being zeroed).
// Mirrors torch.nn.functional.layer_norm over the last dimension.
pub fn layer_norm_forward_uninit(
    x: &[f32],
    d: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    eps: f32,
    y: &mut [MaybeUninit<f32>],
    stats: &mut NormStats,
) -> Result<(), KernelError> {
    covers_every_row(x.len(), d)?;
    let y = Out::of(y).f32();
    forward(NormInput::F32(x), None, None, d, (weight, bias), eps, y, stats)
}

/// [`add_layer_norm_forward`] into memory that need not be initialised: on `Ok`, every
/// element of `y[..x.len()]` and of `z[..x.len()]` (when given) has been written.
#[allow(clippy::too_many_arguments)]
// Mirrors torch.nn.functional.layer_norm(x + residual) (post-norm residual blocks).
pub fn add_layer_norm_forward_uninit(
    x: &[f32],
    residual: &[f32],
    d: usize,
    weight: &[f32],
    bias: Option<&[f32]>,
    eps: f32,
    z: Option<&mut [MaybeUninit<f32>]>,
    y: &mut [MaybeUninit<f32>],
    stats: &mut NormStats,
) -> Result<(), KernelError> {
    covers_every_row(x.len(), d)?;
    let (z, y) = (z.map(Out::of), Out::of(y).f32());
    forward(NormInput::F32(x), Some(residual), z, d, (weight, bias), eps, y, stats)
}

/// The rows a LayerNorm forward reads: f32, or bf16 bit patterns (widened exactly as they are
/// read, the values `bf16_to_f32` gives).
#[derive(Clone, Copy, Debug)]
pub enum NormInput<'a> {
    /// f32 rows.
    F32(&'a [f32]),
    /// bf16 rows, as bit patterns.
    Bf16(&'a [u16]),
}

impl NormInput<'_> {
    fn len(&self) -> usize {
        match self {
            NormInput::F32(x) => x.len(),
            NormInput::Bf16(x) => x.len(),
        }
    }
}

/// Where a LayerNorm forward writes `y`, which need not be initialised: f32, or bf16 bit
/// patterns rounded to nearest even as `f32_to_bf16` rounds the f32 result.
#[derive(Debug)]
pub enum NormOutput<'a> {
    /// f32 rows.
    F32(&'a mut [MaybeUninit<f32>]),
    /// bf16 rows, as bit patterns.
    Bf16(&'a mut [MaybeUninit<u16>]),
}

/// The LayerNorm forward of `x` (or of `x + residual`, summed in f32) with `x` and `y` in f32
/// or bf16: a bf16 `x` read as its exact f32 values, a bf16 `y` the f32 result rounded to
/// nearest even. The same bits as widening `x` (`convert::bf16_to_f32`), running
/// [`add_layer_norm_forward`] (or [`layer_norm_forward`]), and rounding `y`
/// (`convert::f32_to_bf16`), in one pass over the rows: a bf16 Transformer layer's residual
/// blocks without the widened input or the f32 output in memory. On `Ok`, every element of
/// `y[..x.len()]` has been written.
///
/// ```
/// use multihead_kernels::norm::{layer_norm_forward_mixed, NormInput, NormOutput, NormStats};
/// use std::mem::MaybeUninit;
///
/// let x = [0x3F80u16, 0x4000, 0x4040, 0x4080]; // 1, 2, 3, 4 in bf16
/// let r = [0.5f32, -1.0, 0.0, 2.0];
/// let mut y = [MaybeUninit::<u16>::uninit(); 4];
/// let mut st = NormStats::new(1);
/// let out = NormOutput::Bf16(&mut y);
/// layer_norm_forward_mixed(NormInput::Bf16(&x), Some(&r), 4, (&[1.0; 4], None), 1e-5, out, &mut st)?;
/// assert_eq!(st.mean[0], 2.875); // the mean of 1.5, 1, 3, 6
/// # Ok::<(), multihead_kernels::attention::KernelError>(())
/// ```
// Mirrors torch.nn.functional.layer_norm(x + residual) on bf16 tensors whose sum and norm
// are computed in f32 (PyTorch's CPU kernel for a bf16 input with f32 parameters).
pub fn layer_norm_forward_mixed(
    x: NormInput<'_>,
    residual: Option<&[f32]>,
    d: usize,
    params: (&[f32], Option<&[f32]>),
    eps: f32,
    y: NormOutput<'_>,
    stats: &mut NormStats,
) -> Result<(), KernelError> {
    covers_every_row(x.len(), d)?;
    let y = match y {
        NormOutput::F32(y) => Out::of(y).f32(),
        NormOutput::Bf16(y) => (Dst::Bf16(SyncPtr(y.as_mut_ptr().cast::<u16>())), y.len()),
    };
    forward(x, residual, None, d, params, eps, y, stats)
}

/// An output slice as the tasks write it: a pointer and the elements it holds.
#[derive(Clone, Copy)]
struct Out {
    ptr: SyncPtr<f32>,
    len: usize,
}

impl Out {
    fn of<T: OutElem>(s: &mut [T]) -> Self {
        Out { ptr: SyncPtr(s.as_mut_ptr().cast::<f32>()), len: s.len() }
    }

    /// As the forward's `y`.
    fn f32(self) -> (Dst, usize) {
        (Dst::F32(self.ptr), self.len)
    }
}

/// `f32` or `MaybeUninit<f32>`: the element types the entry points write (same layout).
trait OutElem {}
impl OutElem for f32 {}
impl OutElem for MaybeUninit<f32> {}

/// The `_uninit` entry points promise every element of their outputs written; the tasks
/// write whole rows, so `x` must be whole rows of `d > 0` floats (or empty).
fn covers_every_row(len: usize, d: usize) -> Result<(), KernelError> {
    if d == 0 && len != 0 {
        return Err(KernelError::InvalidArgument {
            name: "d",
            msg: format!("rows of 0 features cannot cover {len} input elements"),
        });
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn forward(
    x: NormInput<'_>,
    residual: Option<&[f32]>,
    z: Option<Out>,
    d: usize,
    (weight, bias): (&[f32], Option<&[f32]>),
    eps: f32,
    (y, y_len): (Dst, usize),
    stats: &mut NormStats,
) -> Result<(), KernelError> {
    let rows = rows_of(x.len(), d, weight, bias)?;
    check("y", x.len(), y_len)?;
    if let Some(r) = residual {
        check("residual", x.len(), r.len())?;
    }
    if let Some(z) = &z {
        check("z", x.len(), z.len)?;
    }
    check("stats.mean", rows, stats.mean.len())?;
    check("stats.rstd", rows, stats.rstd.len())?;
    if rows == 0 {
        return Ok(());
    }
    let task = FwdTask {
        x,
        residual,
        z: z.map(|z| z.ptr),
        d,
        rows,
        w: weight,
        b: bias,
        eps,
        y,
        mean: SyncPtr(stats.mean.as_mut_ptr()),
        rstd: SyncPtr(stats.rstd.as_mut_ptr()),
    };
    // Every row `0..rows` of `y` (and `z`) is written: whole blocks, each row in full (the
    // tail of a row masked).
    par_run(simd_level(), &task);
    Ok(())
}

struct BwdTask<'a> {
    x: &'a [f32],
    dy: &'a [f32],
    d: usize,
    rows: usize,
    w: &'a [f32],
    stats: &'a NormStats,
    dx: SyncPtr<f32>,
    /// Per block: `d` partial sums of `dy∘x̂`, then `d` of `dy`.
    partial: SyncPtr<f32>,
}

impl BwdTask<'_> {
    /// One row's `x̂ = (x − mean)·rstd` and `g = dy∘w` (into `xh` and `g`), its block's `dw +=
    /// dy∘x̂` and `db += dy`, and the row's `(Σ g, Σ g∘x̂)`, summed in vector lanes and then
    /// across them (as the forward's statistics are; the sums were a serial chain of scalar
    /// additions, 4% of a bf16 encoder layer's training step).
    ///
    /// # Safety
    /// `S` is available; `xr`, `dyr`, `dw` and `db` address `d` floats, `xh` and `g` hold `d`.
    #[inline(always)]
    unsafe fn row_sums<S: Simd>(
        &self,
        (xr, dyr): (*const f32, *const f32),
        (mean, rstd): (f32, f32),
        (xh, g): (&mut [f32], &mut [f32]),
        (dw, db): (*mut f32, *mut f32),
    ) -> (f32, f32) {
        let (d, l) = (self.d, S::LANES);
        // SAFETY: every access is below `d` (the tail is masked), inside the caller's rows.
        unsafe {
            let (mv, rv) = (S::splat(mean), S::splat(rstd));
            let (mut s1, mut s2) = (S::splat(0.0), S::splat(0.0));
            let mut j = 0;
            while j < d {
                let mask = if j + l <= d { S::full_mask() } else { S::tail_mask(d - j) };
                let dy = S::load_m(dyr.add(j), mask);
                let mut xhat = S::mul(S::sub(S::load_m(xr.add(j), mask), mv), rv);
                if j + l > d {
                    // Masked-off lanes load 0, and (0 − mean)·rstd must not count: the tail
                    // goes through a zeroed buffer.
                    let mut tmp = [0f32; 16];
                    S::store_m(tmp.as_mut_ptr(), xhat, mask);
                    xhat = S::load(tmp.as_ptr());
                }
                let gv = S::mul(dy, S::load_m(self.w.as_ptr().add(j), mask));
                S::store_m(xh.as_mut_ptr().add(j), xhat, mask);
                S::store_m(g.as_mut_ptr().add(j), gv, mask);
                s1 = S::add(s1, gv);
                s2 = S::add(s2, S::mul(gv, xhat));
                S::store_m(dw.add(j), S::add(S::load_m(dw.add(j), mask), S::mul(dy, xhat)), mask);
                S::store_m(db.add(j), S::add(S::load_m(db.add(j), mask), dy), mask);
                j += l;
            }
            (S::reduce_add(s1), S::reduce_add(s2))
        }
    }
}

impl Task for BwdTask<'_> {
    fn count(&self) -> usize {
        self.rows.div_ceil(BLOCK_ROWS)
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        2 * crate::attention::exec::round16(self.d)
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, buf: &mut [f32]) {
        let (d, l) = (self.d, S::LANES);
        let inv_d = 1.0 / d as f32;
        let (xh, g) = buf.split_at_mut(crate::attention::exec::round16(d));
        // SAFETY: this task alone writes block `t` of `partial` (2·d floats) and the dx rows
        // of its block; every row pointer addresses a checked row of `d` floats.
        unsafe {
            let dw = self.partial.0.add(t * 2 * d);
            let db = dw.add(d);
            for j in 0..2 * d {
                *dw.add(j) = 0.0;
            }
            for r in t * BLOCK_ROWS..((t + 1) * BLOCK_ROWS).min(self.rows) {
                let (mean, rstd) = (self.stats.mean[r], self.stats.rstd[r]);
                let xr = self.x.as_ptr().add(r * d);
                let dyr = self.dy.as_ptr().add(r * d);
                let (s1, s2) = self.row_sums::<S>((xr, dyr), (mean, rstd), (xh, g), (dw, db));
                let (c1, c2) = (S::splat(s1 * inv_d), S::splat(s2 * inv_d));
                let rv = S::splat(rstd);
                let dxr = self.dx.0.add(r * d);
                let mut j = 0;
                while j < d {
                    let mask = if j + l <= d { S::full_mask() } else { S::tail_mask(d - j) };
                    let gv = S::load_m(g.as_ptr().add(j), mask);
                    let xv = S::load_m(xh.as_ptr().add(j), mask);
                    let v = S::mul(rv, S::sub(S::sub(gv, c1), S::mul(xv, c2)));
                    S::store_m(dxr.add(j), v, mask);
                    j += l;
                }
            }
        }
    }
}

/// The LayerNorm backward: `dx` (like `x`), and `dw`, `db` (`d` floats each) from the forward's
/// statistics.
#[allow(clippy::too_many_arguments)]
// Mirrors the backward of torch.nn.functional.layer_norm.
pub fn layer_norm_backward(
    x: &[f32],
    dy: &[f32],
    d: usize,
    weight: &[f32],
    stats: &NormStats,
    dx: &mut [f32],
    dw: &mut [f32],
    db: &mut [f32],
) -> Result<(), KernelError> {
    backward(x, dy, d, weight, stats, Out::of(dx), dw, db)
}

/// [`layer_norm_backward`] into a `dx` that need not be initialised: on `Ok`, every element of
/// `dx[..x.len()]` has been written.
#[allow(clippy::too_many_arguments)]
// Mirrors the backward of torch.nn.functional.layer_norm.
pub fn layer_norm_backward_uninit(
    x: &[f32],
    dy: &[f32],
    d: usize,
    weight: &[f32],
    stats: &NormStats,
    dx: &mut [MaybeUninit<f32>],
    dw: &mut [f32],
    db: &mut [f32],
) -> Result<(), KernelError> {
    covers_every_row(x.len(), d)?;
    backward(x, dy, d, weight, stats, Out::of(dx), dw, db)
}

#[allow(clippy::too_many_arguments)]
fn backward(
    x: &[f32],
    dy: &[f32],
    d: usize,
    weight: &[f32],
    stats: &NormStats,
    dx: Out,
    dw: &mut [f32],
    db: &mut [f32],
) -> Result<(), KernelError> {
    let rows = rows_of(x.len(), d, weight, None)?;
    check("dy", x.len(), dy.len())?;
    check("dx", x.len(), dx.len)?;
    check("dw", d, dw.len())?;
    check("db", d, db.len())?;
    check("stats.mean", rows, stats.mean.len())?;
    check("stats.rstd", rows, stats.rstd.len())?;
    dw[..d].fill(0.0);
    db[..d].fill(0.0);
    if rows == 0 {
        return Ok(());
    }
    let blocks = rows.div_ceil(BLOCK_ROWS);
    let mut partial = vec![0f32; blocks * 2 * d];
    let task = BwdTask {
        x,
        dy,
        d,
        rows,
        w: weight,
        stats,
        dx: dx.ptr,
        partial: SyncPtr(partial.as_mut_ptr()),
    };
    // Every row `0..rows` of `dx` is written in full.
    par_run(simd_level(), &task);
    // Column sums in block order: the same bits for any thread count.
    for blk in partial.chunks_exact(2 * d) {
        let (pw, pb) = blk.split_at(d);
        dw[..d].iter_mut().zip(pw).for_each(|(a, b)| *a += b);
        db[..d].iter_mut().zip(pb).for_each(|(a, b)| *a += b);
    }
    Ok(())
}

/// Naive f64 twins, for tests.
pub mod reference {
    /// `(y, mean, rstd)` of the forward.
    pub fn forward(
        x: &[f32],
        d: usize,
        w: &[f32],
        b: Option<&[f32]>,
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let rows = x.len().checked_div(d).unwrap_or(0);
        let (mut y, mut mean, mut rstd) = (vec![0.0; x.len()], vec![0.0; rows], vec![0.0; rows]);
        for r in 0..rows {
            let row: Vec<f64> = x[r * d..(r + 1) * d].iter().map(|&v| v as f64).collect();
            let m = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / d as f64;
            let s = 1.0 / (var + eps).sqrt();
            for j in 0..d {
                y[r * d + j] = (row[j] - m) * s * w[j] as f64 + b.map_or(0.0, |b| b[j] as f64);
            }
            (mean[r], rstd[r]) = (m, s);
        }
        (y, mean, rstd)
    }

    /// `(y, mean, rstd)` of the forward of `x + residual` (summed in f32, as the kernel does).
    pub fn add_forward(
        x: &[f32],
        residual: &[f32],
        d: usize,
        w: &[f32],
        b: Option<&[f32]>,
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let z: Vec<f32> = x.iter().zip(residual).map(|(a, r)| a + r).collect();
        forward(&z, d, w, b, eps)
    }

    /// `(dx, dw, db)` of the backward.
    pub fn backward(
        x: &[f32],
        dy: &[f32],
        d: usize,
        w: &[f32],
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (_, mean, rstd) = forward(x, d, w, None, eps);
        let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; d], vec![0.0; d]);
        for r in 0..mean.len() {
            let xh: Vec<f64> = (0..d).map(|j| (x[r * d + j] as f64 - mean[r]) * rstd[r]).collect();
            let g: Vec<f64> = (0..d).map(|j| dy[r * d + j] as f64 * w[j] as f64).collect();
            let c1 = g.iter().sum::<f64>() / d as f64;
            let c2 = g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / d as f64;
            for j in 0..d {
                dx[r * d + j] = rstd[r] * (g[j] - c1 - xh[j] * c2);
                dw[j] += dy[r * d + j] as f64 * xh[j];
                db[j] += dy[r * d + j] as f64;
            }
        }
        (dx, dw, db)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::attention::{with_simd_level, SimdLevel};

    /// `testutil::rand_vec` scaled to `[-1, 3)`, so rows have a mean away from 0.
    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        crate::testutil::rand_vec(n, seed).into_iter().map(|x| 2.0 * x + 1.0).collect()
    }

    fn close(name: &str, got: &[f32], want: &[f64], tol: f64) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() <= tol * (1.0 + w.abs()), "{name}[{i}]: {g} vs {w}");
        }
    }

    #[test]
    fn forward_and_backward_match_the_reference_at_every_simd_level() {
        let levels = crate::testutil::levels();
        for &(rows, d) in &[(1, 1), (3, 5), (33, 16), (65, 17), (7, 384), (40, 1000), (2, 31)] {
            let x = rand_vec(rows * d, 1);
            let w = rand_vec(d, 2);
            let b = rand_vec(d, 3);
            let dy = rand_vec(rows * d, 4);
            let (ey, em, es) = reference::forward(&x, d, &w, Some(&b), 1e-5);
            let (edx, edw, edb) = reference::backward(&x, &dy, d, &w, 1e-5);
            let mut firsts: Option<(Vec<f32>, Vec<f32>)> = None;
            for &level in &levels {
                with_simd_level(level, || {
                    let mut y = vec![0f32; rows * d];
                    let mut st = NormStats::new(rows);
                    layer_norm_forward(&x, d, &w, Some(&b), 1e-5, &mut y, &mut st).unwrap();
                    close("y", &y, &ey, 1e-5);
                    close("mean", &st.mean, &em, 1e-5);
                    close("rstd", &st.rstd, &es, 1e-4);
                    let (mut dx, mut dw, mut db) =
                        (vec![0f32; rows * d], vec![0f32; d], vec![0f32; d]);
                    layer_norm_backward(&x, &dy, d, &w, &st, &mut dx, &mut dw, &mut db).unwrap();
                    close("dx", &dx, &edx, 1e-4);
                    close("dw", &dw, &edw, 1e-4);
                    close("db", &db, &edb, 1e-4);
                    if level == SimdLevel::Scalar {
                        firsts = Some((y, dw));
                    }
                });
            }
            assert!(firsts.is_some());
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let (rows, d) = (300, 64);
        let x = rand_vec(rows * d, 5);
        let w = rand_vec(d, 6);
        let dy = rand_vec(rows * d, 7);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let mut y = vec![0f32; rows * d];
                let mut st = NormStats::new(rows);
                layer_norm_forward(&x, d, &w, None, 1e-5, &mut y, &mut st).unwrap();
                let (mut dx, mut dw, mut db) = (vec![0f32; rows * d], vec![0f32; d], vec![0f32; d]);
                layer_norm_backward(&x, &dy, d, &w, &st, &mut dx, &mut dw, &mut db).unwrap();
                (y, dx, dw, db)
            })
        };
        assert_eq!(run(1), run(3));
    }

    /// The `_uninit` forms write every element of buffers that start as NaN, with the bits of
    /// the forms that take initialised buffers, at every SIMD level.
    #[test]
    fn uninit_outputs_are_written_in_full_with_the_same_bits() {
        let nan = || MaybeUninit::new(f32::NAN);
        let bits = |v: &[MaybeUninit<f32>]| -> Vec<u32> {
            // SAFETY: the buffers were initialised (to NaN, then by the kernel).
            v.iter().map(|x| unsafe { x.assume_init() }.to_bits()).collect::<Vec<_>>()
        };
        let plain = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for &(rows, d) in &[(1, 1), (3, 5), (33, 16), (65, 17), (7, 384)] {
            let n = rows * d;
            let (x, res, dy) = (rand_vec(n, 21), rand_vec(n, 22), rand_vec(n, 23));
            let (w, b) = (rand_vec(d, 24), rand_vec(d, 25));
            for &level in &crate::testutil::levels() {
                with_simd_level(level, || {
                    let (mut y0, mut z0, mut st0) =
                        (vec![0f32; n], vec![0f32; n], NormStats::new(rows));
                    add_layer_norm_forward(
                        &x,
                        &res,
                        d,
                        &w,
                        Some(&b),
                        1e-5,
                        Some(&mut z0),
                        &mut y0,
                        &mut st0,
                    )
                    .unwrap();
                    let (mut y, mut z, mut st) =
                        (vec![nan(); n], vec![nan(); n], NormStats::new(rows));
                    add_layer_norm_forward_uninit(
                        &x,
                        &res,
                        d,
                        &w,
                        Some(&b),
                        1e-5,
                        Some(&mut z),
                        &mut y,
                        &mut st,
                    )
                    .unwrap();
                    assert_eq!((bits(&y), bits(&z), &st), (plain(&y0), plain(&z0), &st0));
                    let mut y = vec![nan(); n];
                    layer_norm_forward_uninit(&z0, d, &w, Some(&b), 1e-5, &mut y, &mut st).unwrap();
                    assert_eq!(bits(&y), plain(&y0));
                    let (mut dx0, mut dw0, mut db0) = (vec![0f32; n], vec![0f32; d], vec![0f32; d]);
                    layer_norm_backward(&z0, &dy, d, &w, &st0, &mut dx0, &mut dw0, &mut db0)
                        .unwrap();
                    let (mut dx, mut dw, mut db) = (vec![nan(); n], vec![0f32; d], vec![0f32; d]);
                    layer_norm_backward_uninit(&z0, &dy, d, &w, &st0, &mut dx, &mut dw, &mut db)
                        .unwrap();
                    assert_eq!(
                        (bits(&dx), plain(&dw), plain(&db)),
                        (plain(&dx0), plain(&dw0), plain(&db0))
                    );
                });
            }
        }
        // Rows of no features cannot cover a non-empty input: an error, not an unwritten buffer.
        let (mut y, mut st) = (vec![nan(); 2], NormStats::new(0));
        assert!(
            layer_norm_forward_uninit(&[1.0, 2.0], 0, &[], None, 1e-5, &mut y, &mut st).is_err()
        );
        let (mut dw, mut db) = (vec![0f32; 0], vec![0f32; 0]);
        let mut dx = vec![nan(); 2];
        assert!(layer_norm_backward_uninit(
            &[1.0, 2.0],
            &[1.0, 1.0],
            0,
            &[],
            &st,
            &mut dx,
            &mut dw,
            &mut db
        )
        .is_err());
    }

    /// The mixed forms give the bits of widening `x`, the f32 forward and rounding `y`, at every
    /// SIMD level and awkward widths, with NaN, infinities, subnormals and values that round
    /// up to infinity in bf16; and they match the f64 reference.
    #[test]
    fn mixed_precision_forms_are_the_f32_forward_between_conversions() {
        use crate::convert::{bf16_to_f32, f32_to_bf16};
        let uninit = |n: usize| vec![MaybeUninit::<u16>::new(0x7FC1); n];
        let init = |v: &[MaybeUninit<u16>]| -> Vec<u16> {
            // SAFETY: every element was initialised (to a NaN's bits, then by the kernel).
            v.iter().map(|x| unsafe { x.assume_init() }).collect()
        };
        let f32_bits = |v: &[MaybeUninit<f32>]| -> Vec<u32> {
            // SAFETY: every element was initialised (to NaN, then by the kernel).
            v.iter().map(|x| unsafe { x.assume_init() }.to_bits()).collect()
        };
        let stat_bits = |st: &NormStats| -> Vec<u32> {
            st.mean.iter().chain(&st.rstd).map(|v| v.to_bits()).collect()
        };
        for &(rows, d) in &[(1, 1), (3, 5), (33, 16), (65, 17), (7, 384), (2, 1000), (4, 31)] {
            let n = rows * d;
            let mut wide = rand_vec(n, 31);
            let mut res = rand_vec(n, 32);
            if rows > 2 {
                (wide[d], wide[2 * d + 1]) = (f32::INFINITY, 1e-40);
                res[2 * d] = f32::NAN;
                res[2 * d + 1] = 3.0e38; // 3e38 + x, normed: a row of extremes
            }
            let mut xb = vec![0u16; n];
            f32_to_bf16(&wide, &mut xb).unwrap();
            bf16_to_f32(&xb, &mut wide).unwrap();
            let (w, b) = (rand_vec(d, 33), rand_vec(d, 34));
            for &level in &crate::testutil::levels() {
                with_simd_level(level, || {
                    for (residual, bias) in [(None, None), (Some(&res[..]), Some(&b[..]))] {
                        let what = format!("{rows}x{d} {level:?} residual {}", residual.is_some());
                        let (mut want, mut st0) = (vec![0f32; n], NormStats::new(rows));
                        match residual {
                            Some(r) => add_layer_norm_forward(
                                &wide, r, d, &w, bias, 1e-5, None, &mut want, &mut st0,
                            ),
                            None => {
                                layer_norm_forward(&wide, d, &w, bias, 1e-5, &mut want, &mut st0)
                            }
                        }
                        .unwrap();
                        let mut want_b = vec![0u16; n];
                        f32_to_bf16(&want, &mut want_b).unwrap();
                        let params = (&w[..], bias);
                        for x in [NormInput::Bf16(&xb), NormInput::F32(&wide)] {
                            let (mut y, mut st) = (uninit(n), NormStats::new(rows));
                            let out = NormOutput::Bf16(&mut y);
                            layer_norm_forward_mixed(x, residual, d, params, 1e-5, out, &mut st)
                                .unwrap();
                            assert_eq!(init(&y), want_b, "{what} bf16 out");
                            assert_eq!(stat_bits(&st), stat_bits(&st0), "{what} stats");
                            let mut y = vec![MaybeUninit::new(f32::NAN); n];
                            let out = NormOutput::F32(&mut y);
                            layer_norm_forward_mixed(x, residual, d, params, 1e-5, out, &mut st)
                                .unwrap();
                            let plain: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                            assert_eq!(f32_bits(&y), plain, "{what} f32 out");
                        }
                        // Rows of finite values match the f64 reference.
                        let r0 = res.iter().map(|_| 0.0f32).collect::<Vec<_>>();
                        let (ey, _, _) = reference::add_forward(
                            &wide,
                            residual.unwrap_or(&r0),
                            d,
                            &w,
                            bias,
                            1e-5,
                        );
                        let skip = if rows > 2 { 3 * d } else { 0 };
                        close("y", &want[skip..], &ey[skip..], 1e-5);
                    }
                });
            }
        }
        // Bad lengths are errors, with nothing written out of bounds.
        let (x, r) = ([0u16; 8], [0f32; 8]);
        let mut st = NormStats::new(2);
        let mut run = |x: NormInput<'_>, r: Option<&[f32]>, n: usize| {
            let mut y = uninit(n);
            let out = NormOutput::Bf16(&mut y);
            layer_norm_forward_mixed(x, r, 4, (&[1.0; 4], None), 1e-5, out, &mut st)
        };
        assert!(run(NormInput::Bf16(&x), Some(&r), 8).is_ok());
        assert!(run(NormInput::Bf16(&x), Some(&r[..7]), 8).is_err());
        assert!(run(NormInput::Bf16(&x), None, 7).is_err());
        assert!(run(NormInput::Bf16(&x[..6]), None, 8).is_err());
        let mut y = uninit(2);
        let out = NormOutput::Bf16(&mut y);
        let zero_width = layer_norm_forward_mixed(
            NormInput::Bf16(&x[..2]),
            None,
            0,
            (&[], None),
            1e-5,
            out,
            &mut st,
        );
        assert!(zero_width.is_err());
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut st = NormStats::new(1);
        let mut y = [0f32; 4];
        assert!(layer_norm_forward(&[0.0; 4], 4, &[1.0; 3], None, 1e-5, &mut y, &mut st).is_err());
        assert!(layer_norm_forward(&[0.0; 5], 4, &[1.0; 4], None, 1e-5, &mut y, &mut st).is_err());
        assert!(layer_norm_forward(&[0.0; 8], 4, &[1.0; 4], None, 1e-5, &mut y, &mut st).is_err());
    }

    #[test]
    fn the_residual_form_is_the_norm_of_the_f32_sum_at_every_simd_level() {
        for &(rows, d) in &[(1, 1), (3, 5), (33, 16), (65, 17), (7, 384), (2, 1000)] {
            let x = rand_vec(rows * d, 11);
            let mut res = rand_vec(rows * d, 12);
            res[0] = f32::NAN;
            let (w, b) = (rand_vec(d, 13), rand_vec(d, 14));
            let sum: Vec<f32> = x.iter().zip(&res).map(|(a, r)| a + r).collect();
            let (ey, _, _) = reference::add_forward(&x, &res, d, &w, Some(&b), 1e-5);
            for &level in &crate::testutil::levels() {
                with_simd_level(level, || {
                    let mut want = vec![0f32; rows * d];
                    let mut st0 = NormStats::new(rows);
                    layer_norm_forward(&sum, d, &w, Some(&b), 1e-5, &mut want, &mut st0).unwrap();
                    for keep in [false, true] {
                        let (mut y, mut z) = (vec![0f32; rows * d], vec![0f32; rows * d]);
                        let mut st = NormStats::new(rows);
                        let zo = if keep { Some(&mut z[..]) } else { None };
                        add_layer_norm_forward(
                            &x,
                            &res,
                            d,
                            &w,
                            Some(&b),
                            1e-5,
                            zo,
                            &mut y,
                            &mut st,
                        )
                        .unwrap();
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&y), bits(&want), "{rows}x{d} {level:?} keep {keep}");
                        assert_eq!(bits(&st.mean), bits(&st0.mean), "{rows}x{d} {level:?}");
                        assert_eq!(bits(&st.rstd), bits(&st0.rstd), "{rows}x{d} {level:?}");
                        if keep {
                            assert_eq!(bits(&z), bits(&sum), "{rows}x{d} {level:?} z");
                        }
                        // The first row holds the NaN; the others match the reference.
                        close("y", &y[d..], &ey[d..], 1e-5);
                        assert!(y[..d].iter().all(|v| v.is_nan()));
                    }
                });
            }
        }
        let mut st = NormStats::new(1);
        let (x, mut y, mut z) = ([0f32; 4], [0f32; 4], [0f32; 3]);
        let add = |r: &[f32], z: Option<&mut [f32]>, y: &mut [f32], st: &mut NormStats| {
            add_layer_norm_forward(&x, r, 4, &[1.0; 4], None, 1e-5, z, y, st)
        };
        assert!(add(&[0.0; 3], None, &mut y, &mut st).is_err());
        assert!(add(&[0.0; 4], Some(&mut z), &mut y, &mut st).is_err());
        assert!(add(&[0.0; 4], None, &mut y, &mut st).is_ok());
    }
}
