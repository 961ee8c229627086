//! The epilogue of a linear layer's product: `y = act(y + bias)` over the rows of `y`, in
//! place, in one parallel pass (what would otherwise be a bias pass before the product and an
//! activation pass after it); the same pass keeping `y + bias` and writing the activation to
//! a second buffer ([`bias_act_into`], for a training step whose backward needs the
//! pre-activation); and its backward's bias gradient, the column sums of the output gradient
//! ([`bias_grad`]).
//!
//! The activations give the bits of their standalone kernels in
//! [`activation`](crate::activation): ReLU keeps NaN and gives `+0` for every input `<= 0`;
//! GELU is the same vectorised erf form.
//!
//! ```
//! use multihead_kernels::epilogue::{bias_act_in_place, Act};
//!
//! // Two rows of three outputs, bias then ReLU.
//! let mut y = [1.0, -2.0, 3.0, -4.0, 5.0, f32::NAN];
//! bias_act_in_place(&mut y, 3, Some(&[0.5, 0.5, -10.0]), Act::Relu)?;
//! assert_eq!(&y[..5], &[1.5, 0.0, 0.0, 0.0, 5.5]);
//! assert!(y[5].is_nan());
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

use crate::activation::cdf_pdf;
use crate::attention::exec::{par_run, ConstPtr, SyncPtr, Task};
use crate::attention::simd::Simd;
use crate::attention::{simd_level, KernelError};

/// Elements per task (whole rows, at least one).
const BLOCK: usize = 1 << 14;

/// The activation applied after the bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// None: the bias alone.
    Identity,
    /// `max(x, 0)`: NaN kept, `+0` for every `x <= 0`.
    Relu,
    /// `x·Φ(x)`, the erf form (as [`gelu_forward`](crate::activation::gelu_forward)).
    Gelu,
}

struct EpilogueTask {
    y: SyncPtr<f32>,
    rows: usize,
    n: usize,
    rows_per_task: usize,
    bias: Option<ConstPtr<f32>>,
    act: Act,
    /// Where the activation goes: `None` for `y` itself; else `y` keeps `y + bias` and this
    /// buffer (as long as `y`) takes `act(y + bias)`.
    out: Option<SyncPtr<f32>>,
}

impl Task for EpilogueTask {
    fn count(&self) -> usize {
        self.rows.div_ceil(self.rows_per_task)
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        0
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, t: usize, _buf: &mut [f32]) {
        let (l, n) = (S::LANES, self.n);
        let r0 = t * self.rows_per_task;
        let r1 = (r0 + self.rows_per_task).min(self.rows);
        // SAFETY: rows `r0..r1` of `n` elements are inside `y` (and `out`, as long as `y`)
        // and the bias holds `n` values (checked by the entry points); the tails are masked;
        // this task alone writes its rows.
        unsafe {
            for r in r0..r1 {
                let row = self.y.0.add(r * n);
                let mut j = 0;
                while j < n {
                    let mask = if j + l <= n { S::full_mask() } else { S::tail_mask(n - j) };
                    let mut v = S::load_m(row.add(j), mask);
                    if let Some(b) = self.bias {
                        v = S::add(v, S::load_m(b.0.add(j), mask));
                    }
                    let dst = match self.out {
                        Some(o) => {
                            S::store_m(row.add(j), v, mask);
                            o.0.add(r * n)
                        }
                        None => row,
                    };
                    v = act_vec::<S>(self.act, v);
                    S::store_m(dst.add(j), v, mask);
                    j += l;
                }
            }
        }
    }
}

/// The activation of one vector, as the standalone kernels compute it.
///
/// # Safety
/// `S`'s instruction set is available.
#[inline(always)]
unsafe fn act_vec<S: Simd>(act: Act, v: S::V) -> S::V {
    // SAFETY: arithmetic only (the caller's instruction set).
    unsafe {
        let zero = S::splat(0.0);
        match act {
            Act::Identity => v,
            // max returns its second operand when either is NaN (NaN kept); adding +0 turns the
            // -0 that max keeps for -0 into +0.
            Act::Relu => S::add(S::max(zero, v), zero),
            Act::Gelu => S::mul(v, cdf_pdf::<S>(v).0),
        }
    }
}

/// [`Act`] as a const generic parameter of the tile epilogue's line loops.
const ACT_IDENTITY: u8 = 0;
const ACT_RELU: u8 = 1;
const ACT_GELU: u8 = 2;

/// The [`Act`] of a code above.
#[inline(always)]
const fn act_of(code: u8) -> Act {
    match code {
        ACT_RELU => Act::Relu,
        ACT_GELU => Act::Gelu,
        _ => Act::Identity,
    }
}

/// How 32 f32 values (two vectors, columns in order) become 32 bf16 words for the tile
/// epilogue's bf16 output, with [`f32_to_bf16_bits`](crate::convert::f32_to_bf16_bits)'s bits.
#[cfg(target_arch = "x86_64")]
trait LineRounding {
    /// The 32 words, `lo`'s 16 first.
    ///
    /// # Safety
    /// AVX-512F and the implementation's own features are available.
    unsafe fn words(
        lo: std::arch::x86_64::__m512,
        hi: std::arch::x86_64::__m512,
    ) -> std::arch::x86_64::__m512i;
}

/// The integer arithmetic of `f32_to_bf16_bits` (AVX-512F).
#[cfg(target_arch = "x86_64")]
struct IntegerRounding;

#[cfg(target_arch = "x86_64")]
impl LineRounding for IntegerRounding {
    #[inline(always)]
    unsafe fn words(
        lo: std::arch::x86_64::__m512,
        hi: std::arch::x86_64::__m512,
    ) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        // SAFETY: register arithmetic only (AVX-512F, the caller's guarantee).
        unsafe {
            let lo = _mm512_castsi256_si512(_mm512_cvtepi32_epi16(crate::convert::round16(lo)));
            _mm512_inserti64x4::<1>(lo, _mm512_cvtepi32_epi16(crate::convert::round16(hi)))
        }
    }
}

/// `vcvtne2ps2bf16` (AVX512-BF16): one instruction for both vectors, ties to even and NaN
/// quieted as `f32_to_bf16_bits` does, but a subnormal input read as zero; a pair of vectors
/// holding a subnormal (found by `vfpclassps`, AVX512-DQ) takes the integer arithmetic
/// instead, so the bits are `f32_to_bf16_bits`'s for every input.
#[cfg(target_arch = "x86_64")]
struct NativeRounding;

#[cfg(target_arch = "x86_64")]
impl LineRounding for NativeRounding {
    #[inline(always)]
    unsafe fn words(
        lo: std::arch::x86_64::__m512,
        hi: std::arch::x86_64::__m512,
    ) -> std::arch::x86_64::__m512i {
        use std::arch::x86_64::*;
        /// `vfpclassps`' category of subnormal inputs.
        const SUBNORMAL: i32 = 0x20;
        // SAFETY: register arithmetic only; AVX-512F, DQ and BF16 are available (the caller's
        // guarantee: only `narrow_lines_avx512bf16`, compiled with them, instantiates this).
        unsafe {
            let odd =
                _mm512_fpclass_ps_mask::<SUBNORMAL>(lo) | _mm512_fpclass_ps_mask::<SUBNORMAL>(hi);
            if odd != 0 {
                return IntegerRounding::words(lo, hi);
            }
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
        }
    }
}

/// Where a tile's epilogue puts its result.
#[derive(Clone, Copy)]
pub(crate) enum TileOut {
    /// Back into the tile.
    InPlace,
    /// A bf16 output (rows `ldo` apart), rounded to nearest even
    /// ([`f32_to_bf16_bits`](crate::convert::f32_to_bf16_bits)).
    Bf16 { out: *mut u16, ldo: usize },
    /// An f32 output (rows `ldo` apart).
    F32 { out: *mut f32, ldo: usize },
}

/// One tile of a product's epilogue (the bf16 GEMM's fused epilogue):
/// `act(tile[r·ld + j] + bias[j])` for `r < rows`, `j < cols`, the bits of
/// [`bias_act_in_place`], written where [`TileOut`] says; with an output other than the tile,
/// the tile is scratch (left as it was or holding the activation).
#[derive(Clone, Copy)]
pub(crate) struct TileEpilogue {
    pub(crate) tile: *mut f32,
    pub(crate) ld: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) bias: Option<*const f32>,
    pub(crate) act: Act,
    pub(crate) dest: TileOut,
}

impl TileEpilogue {
    /// Runs the epilogue at `level` (at most the detected level).
    ///
    /// # Safety
    /// `tile` holds `rows` rows of `cols` floats `ld` apart, `bias` (if any) `cols` values,
    /// an output `rows` rows of `cols` elements `ldo` apart, none aliasing another; `level` is
    /// available on this CPU.
    pub(crate) unsafe fn run(&self, level: crate::attention::SimdLevel) {
        use crate::attention::SimdLevel;
        // SAFETY: forwarded; each level's features are the caller's guarantee.
        unsafe {
            match level {
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx512 => self.avx512(),
                #[cfg(target_arch = "x86_64")]
                SimdLevel::Avx2 => self.avx2(),
                _ => self.portable::<crate::attention::simd::Scalar>(),
            }
        }
    }

    /// The epilogue on `S`'s vectors, a bf16 output rounded element by element.
    ///
    /// # Safety
    /// As for `run`, with `S`'s instruction set available.
    #[inline(always)]
    unsafe fn portable<S: Simd>(&self) {
        // SAFETY: forwarded.
        unsafe {
            match self.dest {
                TileOut::InPlace => self.bias_act::<S>(),
                TileOut::Bf16 { out, ldo } => {
                    self.bias_act::<S>();
                    self.narrow_scalar(out, ldo);
                }
                TileOut::F32 { out, ldo } => {
                    self.bias_act::<S>();
                    for r in 0..self.rows {
                        let (src, dst) = (self.tile.add(r * self.ld), out.add(r * ldo));
                        std::ptr::copy_nonoverlapping(src, dst, self.cols);
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn avx512(&self) {
        use std::arch::x86_64::*;
        // SAFETY: AVX-512F is available (the caller's guarantee); rows `r < rows` of `cols`
        // elements lie in `tile` and `out`; the tails are masked.
        unsafe {
            let (out, ldo) = match self.dest {
                TileOut::Bf16 { out, ldo } => (out, ldo),
                TileOut::F32 { out, ldo } => return self.f32_lines_avx512(out, ldo),
                TileOut::InPlace if self.bias.is_none() && self.act == Act::Identity => return,
                TileOut::InPlace => return self.f32_lines_avx512(self.tile, self.ld),
            };
            if self.cols >= 32 {
                return if crate::attention::simd::native_bf16_pairs() {
                    self.narrow_lines_avx512bf16(out, ldo)
                } else {
                    self.narrow_lines_avx512(out, ldo)
                };
            }
            self.bias_act::<crate::attention::simd::Avx512>();
            for r in 0..self.rows {
                let (src, dst) = (self.tile.add(r * self.ld), out.add(r * ldo));
                for j in (0..self.cols).step_by(16) {
                    let live = (self.cols - j).min(16);
                    let mask: __mmask16 = if live == 16 { 0xFFFF } else { (1 << live) - 1 };
                    let w = crate::convert::round16(_mm512_maskz_loadu_ps(mask, src.add(j)));
                    // Full vectors stored whole, a tail through a local buffer (AVX-512F only:
                    // a masked 16-bit store would need BW and VL).
                    let halves = _mm512_cvtepi32_epi16(w);
                    if live == 16 {
                        _mm256_storeu_si256(dst.add(j) as *mut __m256i, halves);
                    } else {
                        let mut tail = [0u16; 16];
                        _mm256_storeu_si256(tail.as_mut_ptr() as *mut __m256i, halves);
                        std::ptr::copy_nonoverlapping(tail.as_ptr(), dst.add(j), live);
                    }
                }
            }
        }
    }

    /// An f32 output (or the tile itself: `out == tile`, `ldo == ld`) in one pass over the
    /// tile, 16 columns at a time, the tail masked: `act(tile + bias)` stored where it goes,
    /// the bits of `bias_act` (the same operations) without its store into the tile and the
    /// row copies after it. The bias's presence and the activation are decided once per call,
    /// as for the bf16 lines.
    ///
    /// # Safety
    /// As for `run`, with `out` rows `ldo` apart holding `cols` floats each (the tile's own
    /// rows, or rows no other argument aliases); AVX-512F and DQ are available.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn f32_lines_avx512(&self, out: *mut f32, ldo: usize) {
        // SAFETY: forwarded.
        unsafe {
            match (self.bias, self.act) {
                (None, Act::Identity) => self.f32_lines::<false, ACT_IDENTITY>(out, ldo),
                (None, Act::Relu) => self.f32_lines::<false, ACT_RELU>(out, ldo),
                (None, Act::Gelu) => self.f32_lines::<false, ACT_GELU>(out, ldo),
                (Some(_), Act::Identity) => self.f32_lines::<true, ACT_IDENTITY>(out, ldo),
                (Some(_), Act::Relu) => self.f32_lines::<true, ACT_RELU>(out, ldo),
                (Some(_), Act::Gelu) => self.f32_lines::<true, ACT_GELU>(out, ldo),
            }
        }
    }

    /// The rows of [`f32_lines_avx512`](Self::f32_lines_avx512): bias added where `BIAS`,
    /// activation `ACT`.
    ///
    /// # Safety
    /// As for [`f32_lines_avx512`](Self::f32_lines_avx512); `BIAS` is whether `self.bias` is
    /// set and `ACT` is `self.act`'s code.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn f32_lines<const BIAS: bool, const ACT: u8>(&self, out: *mut f32, ldo: usize) {
        use crate::attention::simd::{Avx512, Simd};
        use std::arch::x86_64::*;
        let bias = self.bias.unwrap_or(std::ptr::null());
        let act = act_of(ACT);
        // SAFETY: AVX-512F and DQ are available (the caller's guarantee); the masks keep every
        // access inside columns `0..cols` of rows `r < rows` of the tile and of `out`, and of
        // the bias (read only where `BIAS`, so set). With `out` the tile, each vector is read
        // before the same vector is written.
        unsafe {
            for r in 0..self.rows {
                let (src, dst) = (self.tile.add(r * self.ld), out.add(r * ldo));
                for j in (0..self.cols).step_by(16) {
                    let live = (self.cols - j).min(16);
                    let mask: __mmask16 = if live == 16 { 0xFFFF } else { (1 << live) - 1 };
                    let mut v = _mm512_maskz_loadu_ps(mask, src.add(j));
                    if BIAS {
                        v = Avx512::add(v, _mm512_maskz_loadu_ps(mask, bias.add(j)));
                    }
                    _mm512_mask_storeu_ps(dst.add(j), mask, act_vec::<Avx512>(act, v));
                }
            }
        }
    }

    /// The bf16 output in one pass over the tile, 32 columns at a time: `act(tile + bias)`
    /// rounded and stored as one 64-byte vector (a whole cache line where the output's row is
    /// aligned), the f32 tile read but not written (a bf16 output's tile is scratch). The
    /// columns past the last multiple of 32 go the two-pass way. The same bits as the two
    /// passes: the same operations in the same order, without the f32 store and load between.
    ///
    /// On an AMX CPU (family 6 model 167, 2 threads), the bf16 `Linear(512, 2048)` forward on
    /// `(8, 512, 512)` went from 4.93-5.00 to 3.74-3.77 ms (minimum of 200, three runs each);
    /// the two passes, with a 32-byte store per 16 columns into rows 4 KiB apart, held the
    /// tiles back.
    ///
    /// The bias's presence and the activation are decided once per call, each pair a loop of
    /// its own: the driver calls this between its tile steps for a row or two at a time, and
    /// a loop that tested both per line, after broadcasting GELU's constants whatever the
    /// activation, spent more in its entry than in its lines.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512dq")]
    unsafe fn narrow_lines_avx512(&self, out: *mut u16, ldo: usize) {
        // SAFETY: forwarded (the caller's contract); AVX-512F and DQ are available.
        unsafe { self.narrow_lines::<IntegerRounding>(out, ldo) }
    }

    /// [`narrow_lines_avx512`](Self::narrow_lines_avx512) with each line rounded by
    /// `vcvtne2ps2bf16` (see [`NativeRounding`]): the same bits.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512bf16")]
    unsafe fn narrow_lines_avx512bf16(&self, out: *mut u16, ldo: usize) {
        // SAFETY: forwarded (the caller's contract); the features `NativeRounding` needs are
        // available.
        unsafe { self.narrow_lines::<NativeRounding>(out, ldo) }
    }

    /// The lines of [`narrow_lines_avx512`](Self::narrow_lines_avx512), one loop per bias
    /// and activation, rounded by `R`.
    ///
    /// # Safety
    /// As for `run`, with a bf16 output at `out` (rows `ldo` apart), at least 32 columns, and
    /// AVX-512F, DQ and `R`'s features available.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn narrow_lines<R: LineRounding>(&self, out: *mut u16, ldo: usize) {
        // SAFETY: forwarded.
        unsafe {
            match (self.bias, self.act) {
                (None, Act::Identity) => self.lines::<R, false, ACT_IDENTITY>(out, ldo),
                (None, Act::Relu) => self.lines::<R, false, ACT_RELU>(out, ldo),
                (None, Act::Gelu) => self.lines::<R, false, ACT_GELU>(out, ldo),
                (Some(_), Act::Identity) => self.lines::<R, true, ACT_IDENTITY>(out, ldo),
                (Some(_), Act::Relu) => self.lines::<R, true, ACT_RELU>(out, ldo),
                (Some(_), Act::Gelu) => self.lines::<R, true, ACT_GELU>(out, ldo),
            }
            let whole = self.cols / 32 * 32;
            if whole < self.cols {
                let rest = TileEpilogue {
                    tile: self.tile.add(whole),
                    cols: self.cols - whole,
                    bias: self.bias.map(|b| b.add(whole)),
                    dest: TileOut::Bf16 { out: out.add(whole), ldo },
                    ..*self
                };
                rest.avx512();
            }
        }
    }

    /// The whole lines of every row: bias added where `BIAS`, activation `ACT`.
    ///
    /// # Safety
    /// As for [`narrow_lines`](Self::narrow_lines); `BIAS` is whether `self.bias` is set and
    /// `ACT` is `self.act`'s code.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn lines<R: LineRounding, const BIAS: bool, const ACT: u8>(
        &self,
        out: *mut u16,
        ldo: usize,
    ) {
        use crate::attention::simd::{Avx512, Simd};
        use std::arch::x86_64::*;
        let whole = self.cols / 32 * 32;
        let bias = self.bias.unwrap_or(std::ptr::null());
        let act = act_of(ACT);
        // SAFETY: AVX-512F and DQ are available (the caller's guarantee); columns `j + 32 <=
        // whole <= cols` of rows `r < rows` lie in `tile` and `out`, and the bias (read only
        // where `BIAS`, so set) holds `cols` values.
        unsafe {
            // No closure here: a closure would not take the features of the function this
            // one is inlined into, and each intrinsic would become a call.
            for r in 0..self.rows {
                let (src, dst) = (self.tile.add(r * self.ld), out.add(r * ldo));
                for j in (0..whole).step_by(32) {
                    let (mut lo, mut hi) =
                        (_mm512_loadu_ps(src.add(j)), _mm512_loadu_ps(src.add(j + 16)));
                    if BIAS {
                        lo = Avx512::add(lo, _mm512_loadu_ps(bias.add(j)));
                        hi = Avx512::add(hi, _mm512_loadu_ps(bias.add(j + 16)));
                    }
                    let (lo, hi) = (act_vec::<Avx512>(act, lo), act_vec::<Avx512>(act, hi));
                    _mm512_storeu_si512(dst.add(j) as *mut __m512i, R::words(lo, hi));
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(&self) {
        // SAFETY: AVX2 and FMA are available (the caller's guarantee); forwarded.
        unsafe { self.portable::<crate::attention::simd::Avx2>() }
    }

    /// The tile rounded to bf16 element by element into `out` (rows `ldo` apart).
    #[inline(always)]
    unsafe fn narrow_scalar(&self, out: *mut u16, ldo: usize) {
        for r in 0..self.rows {
            for j in 0..self.cols {
                // SAFETY: `r < rows`, `j < cols` lie in `tile` and `out` (`run`'s contract).
                unsafe {
                    *out.add(r * ldo + j) =
                        crate::convert::f32_to_bf16_bits(*self.tile.add(r * self.ld + j));
                }
            }
        }
    }

    /// `act(tile + bias)` in place, as [`EpilogueTask`] computes it.
    #[inline(always)]
    unsafe fn bias_act<S: Simd>(&self) {
        if self.bias.is_none() && self.act == Act::Identity {
            return;
        }
        let l = S::LANES;
        // SAFETY: rows `r < rows` of `cols` elements lie in `tile`, the bias holds `cols`
        // values; the tails are masked.
        unsafe {
            let whole = self.cols / l * l;
            for r in 0..self.rows {
                let row = self.tile.add(r * self.ld);
                // Whole vectors unmasked, the bias's presence decided once per row.
                match self.bias {
                    Some(b) => {
                        for j in (0..whole).step_by(l) {
                            let v = S::add(S::load(row.add(j)), S::load(b.add(j)));
                            S::store(row.add(j), act_vec::<S>(self.act, v));
                        }
                    }
                    None => {
                        for j in (0..whole).step_by(l) {
                            S::store(row.add(j), act_vec::<S>(self.act, S::load(row.add(j))));
                        }
                    }
                }
                if whole < self.cols {
                    let mask = S::tail_mask(self.cols - whole);
                    let mut v = S::load_m(row.add(whole), mask);
                    if let Some(b) = self.bias {
                        v = S::add(v, S::load_m(b.add(whole), mask));
                    }
                    S::store_m(row.add(whole), act_vec::<S>(self.act, v), mask);
                }
            }
        }
    }
}

/// `y[r, j] = act(y[r, j] + bias[j])` for the rows of `n` elements of `y`, in place.
///
/// Errors: `n` is 0 while `y` is not empty, `y`'s length is not a multiple of `n`, or the
/// bias does not hold `n` values.
pub fn bias_act_in_place(
    y: &mut [f32],
    n: usize,
    bias: Option<&[f32]>,
    act: Act,
) -> Result<(), KernelError> {
    if y.is_empty() {
        return Ok(());
    }
    check_rows(y, n, bias)?;
    if bias.is_none() && act == Act::Identity {
        return Ok(());
    }
    run(y, n, bias, act, None);
    Ok(())
}

/// `y[r, j] += bias[j]` and `out[r, j] = act(y[r, j])`, in one pass: the pre-activation kept
/// in `y` (a training step's backward needs it) and the activation written to `out`, which
/// need not be initialised: on `Ok`, every element of `out[..y.len()]` has been written. The
/// same bits as [`bias_act_in_place`] gives for `y + bias` and the activation.
///
/// Errors: as [`bias_act_in_place`], and `out` shorter than `y`.
pub fn bias_act_into(
    y: &mut [f32],
    n: usize,
    bias: Option<&[f32]>,
    act: Act,
    out: &mut [std::mem::MaybeUninit<f32>],
) -> Result<(), KernelError> {
    if out.len() < y.len() {
        return Err(KernelError::SliceTooShort { name: "out", needed: y.len(), len: out.len() });
    }
    if y.is_empty() {
        return Ok(());
    }
    check_rows(y, n, bias)?;
    run(y, n, bias, act, Some(SyncPtr(out.as_mut_ptr().cast::<f32>())));
    Ok(())
}

/// Runs the epilogue over the checked rows of `y` (non-empty, whole rows of `n > 0`, a bias of
/// `n` values; `out`, if any, as long as `y`): every row of `0..rows` is written once (whole
/// rows, the tails masked).
fn run(y: &mut [f32], n: usize, bias: Option<&[f32]>, act: Act, out: Option<SyncPtr<f32>>) {
    let task = EpilogueTask {
        y: SyncPtr(y.as_mut_ptr()),
        rows: y.len() / n,
        n,
        rows_per_task: (BLOCK / n).max(1),
        bias: bias.map(|b| ConstPtr(b.as_ptr())),
        act,
        out,
    };
    par_run(simd_level(), &task);
}

/// `y` is whole rows of `n` elements (`n > 0`) and the bias, if any, holds `n` values.
fn check_rows(y: &[f32], n: usize, bias: Option<&[f32]>) -> Result<(), KernelError> {
    if n == 0 || !y.len().is_multiple_of(n) {
        return Err(KernelError::InvalidArgument {
            name: "n",
            msg: format!("y has {} elements, not a whole number of rows of {n}", y.len()),
        });
    }
    if let Some(b) = bias {
        if b.len() != n {
            return Err(KernelError::InvalidArgument {
                name: "bias",
                msg: format!("expected {n} values, got {}", b.len()),
            });
        }
    }
    Ok(())
}

/// The reference twin of [`bias_act_in_place`], in f64 with an erf accurate to f64 rounding;
/// the same errors.
pub fn bias_act_reference(
    y: &mut [f32],
    n: usize,
    bias: Option<&[f32]>,
    act: Act,
) -> Result<(), KernelError> {
    use crate::activation::reference::{gelu, relu};
    if y.is_empty() {
        return Ok(());
    }
    check_rows(y, n, bias)?;
    for (i, v) in y.iter_mut().enumerate() {
        let x = *v as f64 + bias.map_or(0.0, |b| b[i % n] as f64);
        // The sum rounded to f32 first, as the kernel adds in f32.
        let x = x as f32 as f64;
        *v = match act {
            Act::Identity => x,
            Act::Relu => relu(x),
            Act::Gelu => gelu(x),
        } as f32;
    }
    Ok(())
}

/// Most row blocks [`bias_grad`] cuts `dy` into (bounds its partial sums to 64 rows of `n`).
const MAX_ROW_BLOCKS: usize = 64;

/// `db[j] = Σ_r dy[r, j]` over the rows of `n` elements of `dy`: the bias gradient of a linear
/// layer. The rows are cut into blocks that depend only on the shape (about 64 Ki elements,
/// at most 64 blocks); each block is summed in row order on its own thread, reading its rows
/// as they lie in memory, and the blocks' sums are added in block order, so the result is the
/// same for any thread count. (Summing column strips down all rows instead walks `dy` with a
/// stride and measured a tenth of that speed: 2.6% of an encoder-layer training step.)
///
/// Errors: `n` is 0 while `dy` is not empty, `dy`'s length is not a multiple of `n`, or the
/// partial sums cannot be allocated.
///
/// ```
/// use multihead_kernels::epilogue::bias_grad;
///
/// // Three rows of two outputs.
/// let db = bias_grad(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2)?;
/// assert_eq!(db, [9.0, 12.0]);
/// # Ok::<(), multihead_kernels::attention::KernelError>(())
/// ```
pub fn bias_grad(dy: &[f32], n: usize) -> Result<Vec<f32>, KernelError> {
    column_sums(dy, n, |v| v)
}

/// [`bias_grad`] of a bf16 gradient (bits), each value widened as it is added: the bits
/// `bias_grad` gives for the widened gradient, without widening it first.
pub fn bias_grad_bf16(dy: &[u16], n: usize) -> Result<Vec<f32>, KernelError> {
    column_sums(dy, n, crate::convert::bf16_bits_to_f32)
}

/// The column sums of `dy`'s rows of `n`, in f32, in blocks of rows summed in parallel and
/// then in block order (the same order whatever the thread count).
fn column_sums<T: Copy + Sync>(
    dy: &[T],
    n: usize,
    value: impl Fn(T) -> f32 + Sync,
) -> Result<Vec<f32>, KernelError> {
    use rayon::prelude::*;
    if dy.is_empty() {
        return zeroed(n);
    }
    if n == 0 || !dy.len().is_multiple_of(n) {
        return Err(KernelError::InvalidArgument {
            name: "n",
            msg: format!("dy has {} elements, not a whole number of rows of {n}", dy.len()),
        });
    }
    let rows = dy.len() / n;
    let per_block = (BLOCK * 4 / n).max(rows.div_ceil(MAX_ROW_BLOCKS)).max(1);
    let blocks = rows.div_ceil(per_block);
    let mut partial = zeroed(blocks.saturating_mul(n))?;
    let avx512 = simd_level() == crate::attention::SimdLevel::Avx512;
    partial.par_chunks_mut(n).zip(dy.par_chunks(per_block * n)).for_each(|(acc, rows)| {
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the SIMD level is AVX-512 only where the CPU has AVX-512F and BW.
            return unsafe { add_rows_avx512(acc, rows, &value) };
        }
        let _ = avx512;
        add_rows(acc, rows, &value)
    });
    let (first, rest) = partial.split_at_mut(n);
    for block in rest.chunks_exact(n) {
        for (a, v) in first.iter_mut().zip(block) {
            *a += *v;
        }
    }
    partial.truncate(n);
    Ok(partial)
}

/// `acc[j] += value(row[j])` for each row of `acc.len()` elements of `rows`, in row order.
#[inline(always)]
fn add_rows<T: Copy>(acc: &mut [f32], rows: &[T], value: &impl Fn(T) -> f32) {
    for row in rows.chunks_exact(acc.len()) {
        for (a, v) in acc.iter_mut().zip(row) {
            *a += value(*v);
        }
    }
}

/// [`add_rows`] compiled for AVX-512 (16 columns a vector; each column's sum in the same
/// order, so the same bits). At the x86-64 baseline the loop ran on 4 lanes: the bias
/// gradients of a bf16 encoder layer's training step took 2% of it.
///
/// # Safety
/// The CPU has AVX-512F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn add_rows_avx512<T: Copy>(acc: &mut [f32], rows: &[T], value: &impl Fn(T) -> f32) {
    add_rows(acc, rows, value)
}

/// `len` zeros, or an error when they cannot be allocated.
fn zeroed(len: usize) -> Result<Vec<f32>, KernelError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| KernelError::InvalidArgument {
        name: "db",
        msg: format!("cannot allocate {len} floats of partial sums"),
    })?;
    v.resize(len, 0.0);
    Ok(v)
}

/// The reference twin of [`bias_grad`]: each column summed in f64 (arguments as checked
/// there).
pub fn bias_grad_reference(dy: &[f32], n: usize) -> Vec<f32> {
    let mut db = vec![0f64; n];
    for (i, v) in dy.iter().enumerate() {
        db[i % n] += *v as f64;
    }
    db.into_iter().map(|v| v as f32).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::activation::{gelu_forward, relu_forward};
    use crate::attention::with_simd_level;
    use crate::testutil::{levels, rand_vec};
    use std::mem::MaybeUninit;

    #[test]
    fn a_bf16_tile_output_is_the_in_place_pass_rounded_subnormals_included() {
        // Tiles of 70 columns (two 32-column lines and a tail) whose values include
        // subnormals, ties both ways, NaN, infinities and values that round to infinity, at
        // every level this CPU runs: the one-pass bf16 output gives the two passes' bits.
        use crate::convert::f32_to_bf16_bits;
        let (rows, cols, ld) = (5, 70, 72);
        let mut tile0: Vec<f32> = rand_vec(rows * ld, 17).iter().map(|v| v * 4.0).collect();
        let specials = [
            f32::from_bits(0x0000_8001),
            f32::from_bits(0x807F_FFFF),
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x7F7F_FFFF),
            -0.0,
            1e-39,
        ];
        for (i, v) in specials.iter().enumerate() {
            tile0[i * 37 % (rows * ld)] = *v;
        }
        let bias: Vec<f32> = (0..cols).map(|j| if j % 5 == 0 { 0.0 } else { 0.25 }).collect();
        for act in [Act::Identity, Act::Relu, Act::Gelu] {
            for b in [None, Some(&bias[..])] {
                for &level in &levels() {
                    let mut want = tile0.clone();
                    let mut tile = tile0.clone();
                    let mut out = vec![0u16; rows * cols];
                    let bias = b.map(|b| b.as_ptr());
                    let epi = |tile: &mut [f32], dest| TileEpilogue {
                        tile: tile.as_mut_ptr(),
                        ld,
                        rows,
                        cols,
                        bias,
                        act,
                        dest,
                    };
                    // SAFETY: `rows` rows of `cols` floats `ld` apart, `cols` bias values and
                    // `rows · cols` output words; `level` is one this CPU runs.
                    unsafe {
                        epi(&mut want, TileOut::InPlace).run(level);
                        let dest = TileOut::Bf16 { out: out.as_mut_ptr(), ldo: cols };
                        epi(&mut tile, dest).run(level);
                    }
                    let check = |out: &[u16], how: &str| {
                        for r in 0..rows {
                            for j in 0..cols {
                                let w = f32_to_bf16_bits(want[r * ld + j]);
                                let got = out[r * cols + j];
                                assert_eq!(got, w, "{level:?} {how} {act:?} ({r}, {j})");
                            }
                        }
                    };
                    check(&out, "dispatched");
                    // The f32 forms (in place, and into an output) against the standalone
                    // pass over the same rows.
                    let mut compact: Vec<f32> =
                        (0..rows).flat_map(|r| tile0[r * ld..r * ld + cols].to_vec()).collect();
                    with_simd_level(level, || bias_act_in_place(&mut compact, cols, b, act))
                        .unwrap();
                    let mut into = vec![7.0f32; rows * cols];
                    let mut tile = tile0.clone();
                    let dest = TileOut::F32 { out: into.as_mut_ptr(), ldo: cols };
                    // SAFETY: as above, with `rows · cols` output floats.
                    unsafe { epi(&mut tile, dest).run(level) };
                    for r in 0..rows {
                        for j in 0..cols {
                            let w = compact[r * cols + j].to_bits();
                            let (a, o) = (want[r * ld + j].to_bits(), into[r * cols + j].to_bits());
                            assert_eq!(a, w, "{level:?} in place {act:?} ({r}, {j})");
                            assert_eq!(o, w, "{level:?} f32 out {act:?} ({r}, {j})");
                        }
                    }
                    // Both roundings of the 32-column lines, whichever the dispatch takes:
                    // the integer arithmetic, and `vcvtne2ps2bf16` where this CPU has it.
                    #[cfg(target_arch = "x86_64")]
                    if level == crate::attention::SimdLevel::Avx512 {
                        let native = is_x86_feature_detected!("avx512bf16");
                        for (how, run) in [("integer", true), ("native", native)] {
                            if !run {
                                continue;
                            }
                            let mut tile = tile0.clone();
                            let mut out = vec![0u16; rows * cols];
                            let dest = TileOut::Bf16 { out: out.as_mut_ptr(), ldo: cols };
                            // SAFETY: as above; the AVX-512 level runs here, and AVX512-BF16
                            // where `native` is set.
                            unsafe {
                                let e = epi(&mut tile, dest);
                                if how == "native" {
                                    e.narrow_lines_avx512bf16(out.as_mut_ptr(), cols);
                                } else {
                                    e.narrow_lines_avx512(out.as_mut_ptr(), cols);
                                }
                            }
                            check(&out, how);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn matches_the_reference_and_the_standalone_activations_at_every_simd_level() {
        for (rows, n) in [(1, 1), (3, 17), (5, 33), (2, 1000), (BLOCK / 7 + 3, 7)] {
            let mut y0: Vec<f32> = rand_vec(rows * n, 3).iter().map(|v| v * 6.0).collect();
            let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 0.0];
            for (d, s) in y0.iter_mut().zip(specials) {
                *d = s;
            }
            let bias: Vec<f32> =
                rand_vec(n, 4).iter().map(|v| if n == 1 { 0.0 } else { *v }).collect();
            for act in [Act::Identity, Act::Relu, Act::Gelu] {
                for b in [None, Some(&bias[..])] {
                    let mut want = y0.clone();
                    bias_act_reference(&mut want, n, b, act).unwrap();
                    // The standalone kernels on y + b.
                    let sum: Vec<f32> = match b {
                        Some(b) => y0.iter().enumerate().map(|(i, v)| v + b[i % n]).collect(),
                        None => y0.clone(),
                    };
                    for &level in &levels() {
                        let mut alone = sum.clone();
                        with_simd_level(level, || match act {
                            Act::Identity => Ok(()),
                            Act::Relu => relu_forward(&sum, &mut alone),
                            Act::Gelu => gelu_forward(&sum, &mut alone),
                        })
                        .unwrap();
                        let mut y = y0.clone();
                        with_simd_level(level, || bias_act_in_place(&mut y, n, b, act)).unwrap();
                        // Into a second buffer (stale NaNs in it): the same bits, `y + b` kept.
                        let (mut pre, mut out) =
                            (y0.clone(), vec![MaybeUninit::new(f32::NAN); y.len()]);
                        with_simd_level(level, || bias_act_into(&mut pre, n, b, act, &mut out))
                            .unwrap();
                        for i in 0..y.len() {
                            // SAFETY: every element was initialised (to NaN, then written).
                            let o = unsafe { out[i].assume_init() };
                            assert!(o.to_bits() == y[i].to_bits() || (o.is_nan() && y[i].is_nan()));
                            let s = sum[i];
                            assert!(
                                pre[i].to_bits() == s.to_bits() || (pre[i].is_nan() && s.is_nan())
                            );
                        }
                        for i in 0..y.len() {
                            let (got, w) = (y[i], want[i]);
                            let ok = (got.is_nan() && w.is_nan())
                                || (got - w).abs() <= 2e-7 * (1.0 + sum[i].abs())
                                || got == w;
                            assert!(ok, "{rows}x{n} {act:?} {level:?} [{i}]: {got} vs {w}");
                            assert!(
                                got.to_bits() == alone[i].to_bits()
                                    || (got.is_nan() && alone[i].is_nan()),
                                "{rows}x{n} {act:?} {level:?} [{i}]: {got} vs standalone {}",
                                alone[i]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors() {
        let mut y = [0f32; 6];
        assert!(bias_act_in_place(&mut y, 4, None, Act::Relu).is_err());
        assert!(bias_act_in_place(&mut y, 0, None, Act::Relu).is_err());
        assert!(bias_act_in_place(&mut y, 3, Some(&[1.0, 2.0]), Act::Identity).is_err());
        assert!(bias_act_in_place(&mut [], 0, None, Act::Gelu).is_ok());
        let mut out = [MaybeUninit::new(0f32); 5];
        let e = bias_act_into(&mut y, 3, None, Act::Gelu, &mut out);
        assert!(matches!(e, Err(KernelError::SliceTooShort { name: "out", .. })), "{e:?}");
        let mut out = [MaybeUninit::new(0f32); 6];
        assert!(bias_act_into(&mut y, 4, None, Act::Gelu, &mut out).is_err());
    }

    #[test]
    fn bias_grad_matches_the_reference_for_any_thread_count() {
        for (rows, n) in [(1, 1), (3, 17), (4096, 7), (513, 2048), (70, 1000), (BLOCK + 1, 3)] {
            let mut dy: Vec<f32> = rand_vec(rows * n, 5).iter().map(|v| v * 3.0).collect();
            dy[n / 2] = f32::INFINITY;
            let want = bias_grad_reference(&dy, n);
            let got = bias_grad(&dy, n).unwrap();
            let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
            let alone = one.install(|| bias_grad(&dy, n)).unwrap();
            assert_eq!(got.len(), n);
            for j in 0..n {
                // f32 sums against f64 ones: a few roundings of the column's magnitude.
                let mass: f32 = dy.iter().skip(j).step_by(n).map(|v| v.abs()).sum();
                let tol = 1e-6 * mass;
                assert!(
                    got[j] == want[j] || (got[j] - want[j]).abs() <= tol,
                    "{rows}x{n} [{j}]: {} vs {}",
                    got[j],
                    want[j]
                );
                assert_eq!(got[j].to_bits(), alone[j].to_bits(), "{rows}x{n} [{j}] one thread");
            }
            // A bf16 gradient: the bits of the widened gradient's column sums.
            let bits: Vec<u16> = dy.iter().map(|&v| crate::convert::f32_to_bf16_bits(v)).collect();
            let widened: Vec<f32> =
                bits.iter().map(|&b| crate::convert::bf16_bits_to_f32(b)).collect();
            let want = bias_grad(&widened, n).unwrap();
            let got = bias_grad_bf16(&bits, n).unwrap();
            assert!(
                got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()),
                "{rows}x{n} bf16"
            );
        }
        let nan = [1.0, f32::NAN, 2.0, 3.0];
        let db = bias_grad(&nan, 2).unwrap();
        assert_eq!(db[0], 3.0);
        assert!(db[1].is_nan());
    }

    #[test]
    fn bias_grad_bad_arguments_are_errors() {
        assert!(bias_grad(&[1.0; 6], 4).is_err());
        assert!(bias_grad(&[1.0; 6], 0).is_err());
        assert_eq!(bias_grad(&[], 3).unwrap(), vec![0.0; 3]);
    }
}
