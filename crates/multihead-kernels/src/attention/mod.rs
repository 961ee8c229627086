//! Fused (flash) attention on f32 slices: forward, backward and the attention-weights pass.
//!
//! Every tensor is a strided view of a 4-D array `[batch, heads, seq, dim]` whose last
//! dimension is contiguous ([`Layout4`] holds the other three element strides), so a caller
//! can hand in, for example, `q`, `k` and `v` straight out of a packed `[B, L, 3, H, D]`
//! projection without copying.
//!
//! # Semantics
//!
//! With `hk = h / (heads_q / heads_kv)` (grouped-query attention):
//!
//! * `score[b,h,i,j] = cap(scale · q[b,h,i,:]·k[b,hk,j,:]) + mask0[b,h,i,j] + mask1[b,h,i,j]`,
//!   where a bool mask contributes `0` or `-inf` and `cap(x) = c·tanh(x/c)` with a soft cap `c`
//!   (`x` without one). `-inf` is added where the key is hidden by its index: `causal` hides
//!   `j > i + offset` (`offset = 0`: upper-left aligned, row `i` sees columns `0..=i`), a
//!   [`Window`] hides `j < i + offset − left` and `j > i + offset + right`, and `kv_lengths`
//!   hides `j >= kv_lengths[b]`. None of these builds an `L × S` array; key tiles they hide
//!   entirely are skipped.
//! * `P = softmax_j(score)`. A row whose scores are all `-inf` gets `P = 0` (output row 0, not
//!   NaN) and `ln Σ = +inf`; a row containing `+inf` gives NaN, like PyTorch.
//! * Dropout multiplies `P[b,h,i,j]` by `1/(1-p)` if kept and `0` if dropped, where kept is
//!   [`keep_from_row`](crate::dropout::keep_from_row)`(key.row_state(b*heads_q + h, i), j, p)`.
//!   The backward regenerates the same mask; nothing is stored.
//! * `out = (P∘m) v`. The forward also returns the row statistics the backward and the weights
//!   pass recompute `P` from, in two halves of one `stats` buffer of `2·batch·heads_q·l`
//!   floats: `stats[r]` is the row max `M` and `stats[R + r]` is `ln Σ_j exp(score − M)`
//!   (`R = batch·heads_q·l`, `r = (b·heads_q + h)·l + i`), so `P = exp((score − M) − ln Σ)`.
//!   Kept apart, they stay exact when `M` is huge (a row masked by `-1e9` or `f32::MIN`
//!   everywhere gets uniform weights, as in PyTorch); their sum is the log-sum-exp. A fully
//!   masked row has `M = 0`, `ln Σ = +inf`.
//! * Non-finite values follow that arithmetic exactly, as PyTorch's does: masks are added
//!   (NaN + −inf is NaN) and every value is multiplied by its weight (0·NaN is NaN), so a NaN
//!   key of a `(batch, kv head)` makes all its rows NaN, a NaN query its row, and a NaN value
//!   its column, masked or not. The kernels skip key tiles the masks or the band (causal,
//!   window, lengths) hide only for heads whose queries, keys and values are all finite (one scan of Q, K and V
//!   per call) and whose float masks hold no NaN or `+inf` (added to a hidden key's `-inf` they
//!   make NaN), and in the backward only for query blocks whose output and upstream gradient
//!   rows are finite too (a NaN in `dO` reaches every key's gradient through `0·NaN`).
//! * Backward (FlashAttention-2): `D_i = rowsum(dO_i ∘ O_i)`,
//!   `dS = P ∘ (m ∘ (dO vᵀ) − D)` (times `1 − (cap/c)²` through a soft cap), `dq = scale · dS k`, `dk = scale · dSᵀ q`,
//!   `dv = (P∘m)ᵀ dO`; `dk`/`dv` of a kv head sum over its query heads.
//!
//! Results are bitwise identical for any rayon thread count: every output element is
//! produced by exactly one task, in a fixed order (forward: one task per
//! `(batch, head, query block)`; backward: one per `(batch, kv head)`; weights: one per
//! `(batch, head, query block)`, or `(batch, query block)` when averaging heads).
//! They differ (within rounding) between SIMD levels.
//!
//! The tasks run with subnormal results flushed to zero (x86's FTZ, set per task and cleared
//! after it; operands are read as they are): on Intel cores every subnormal result takes a
//! microcode assist, and tiny probabilities times values make many (an ALiBi bias: 13% of a
//! forward without it). A flushed result differs by less than 2^-126 from the exact one.
//!
//! # Example
//!
//! ```
//! use multihead_kernels::attention::{flash_forward, AttnDims, AttnParams, Layout4, MaskView};
//!
//! let (b, h, l, d) = (2, 4, 5, 8);
//! // Self-attention: q, k, v read straight out of a packed [B, L, 3, H, D] projection.
//! let dims = AttnDims { batch: b, heads_q: h, heads_kv: h, l, s: l, d, dv: d };
//! let qkv = vec![0.5f32; b * l * 3 * h * d];
//! let lay = Layout4 { batch: l * 3 * h * d, head: d, seq: 3 * h * d };
//! // A (B, S) key-padding mask, true = masked, viewed as [B, H, L, S].
//! let pad = vec![0u8; b * l];
//! let mut p = AttnParams::new(dims);
//! p.masks[0] = Some(MaskView::Bool { data: &pad, strides: [l, 0, 0, 1], true_means_masked: true });
//! // The output as [B, L, H, D] (batch-first), the log-sum-exp as [B, H, L].
//! let mut out = vec![0f32; b * l * h * d];
//! let ol = Layout4 { batch: l * h * d, head: d, seq: h * d };
//! let mut lse = vec![0f32; 2 * b * h * l]; // row maxima, then log-sums
//! flash_forward(&p, &qkv, lay, &qkv[h * d..], lay, &qkv[2 * h * d..], lay, &mut out, ol, &mut lse)?;
//! assert!(out.iter().all(|&x| (x - 0.5).abs() < 1e-6));
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```
//!
//! # Performance
//!
//! The kernels dispatch at run time to AVX-512F, AVX2+FMA or scalar code
//! ([`detected_simd_level`]); no `target-cpu` flag is needed. Scores are computed transposed
//! (`Sᵀ = K · (scale·Q)ᵀ`, keys as rows, queries as vector lanes), so the softmax's row
//! reductions are vertical vector operations and K, V, Q and dO rows are read in place by
//! register-tiled micro-kernels (see `gemm.rs`) without packing. Work runs on the current rayon
//! pool; per-thread scratch is reused across calls.

mod backward;
mod band;
mod bf16;
pub(crate) mod exec;
mod forward;
mod gather;
mod gemm;
mod mask;
mod prepack;
pub mod reference;
mod scoremod;
pub(crate) mod simd;
mod sinks;
mod softcap;
mod tile;
mod weights;

#[cfg(test)]
mod tests;

use std::fmt;

use crate::bf16gemm::pack::Operand;
use crate::dropout::DropoutKey;

pub use exec::{detected_simd_level, simd_level, with_simd_level, SimdLevel};
pub use sinks::sink_grad;

/// Element strides of a 4-D tensor `[batch, heads, seq, dim]`; the last dimension is
/// contiguous (stride 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Layout4 {
    /// Stride between batch entries.
    pub batch: usize,
    /// Stride between heads.
    pub head: usize,
    /// Stride between sequence positions.
    pub seq: usize,
}

impl Layout4 {
    /// The row-major layout of a contiguous `[batch, heads, seq, dim]` tensor.
    pub fn contiguous(heads: usize, seq: usize, dim: usize) -> Self {
        Layout4 { batch: heads * seq * dim, head: seq * dim, seq: dim }
    }

    /// Element offset of row `(b, h, i)`.
    #[inline(always)]
    pub fn offset(&self, b: usize, h: usize, i: usize) -> usize {
        b * self.batch + h * self.head + i * self.seq
    }
}

/// Problem sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnDims {
    /// Batch size.
    pub batch: usize,
    /// Query heads (also the heads of `out`, `lse`, `dq` and the masks).
    pub heads_q: usize,
    /// Key/value heads; must divide `heads_q` (query head `h` uses kv head
    /// `h / (heads_q / heads_kv)`).
    pub heads_kv: usize,
    /// Query length.
    pub l: usize,
    /// Key/value length.
    pub s: usize,
    /// Query/key head dimension.
    pub d: usize,
    /// Value head dimension.
    pub dv: usize,
}

/// A mask viewed as `[batch, heads_q, l, s]` with element strides (0 = broadcast).
#[derive(Clone, Copy, Debug)]
pub enum MaskView<'a> {
    /// Added to the scores.
    Additive {
        /// The mask values.
        data: &'a [f32],
        /// Element strides of `[batch, head, l, s]`.
        strides: [usize; 4],
    },
    /// A bool mask (`u8`, nonzero = true) that contributes `-inf` (masked) or `0`.
    Bool {
        /// The mask values.
        data: &'a [u8],
        /// Element strides of `[batch, head, l, s]`.
        strides: [usize; 4],
        /// PyTorch's `attn_mask`/`key_padding_mask` polarity is `true` = masked; SDPA's bool
        /// `attn_mask` is `true` = attend (`false` here).
        true_means_masked: bool,
    },
}

impl MaskView<'_> {
    /// The element strides.
    pub fn strides(&self) -> [usize; 4] {
        match self {
            MaskView::Additive { strides, .. } | MaskView::Bool { strides, .. } => *strides,
        }
    }

    fn len(&self) -> usize {
        match self {
            MaskView::Additive { data, .. } => data.len(),
            MaskView::Bool { data, .. } => data.len(),
        }
    }
}

/// Everything but the tensors: [`AttnParams::new`], then set the fields a call needs (the
/// struct grows with the kernels' options, hence `#[non_exhaustive]`).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct AttnParams<'a> {
    /// Sizes.
    pub dims: AttnDims,
    /// Multiplies `q·k` (usually `1/sqrt(d)`; any value, negative included).
    pub scale: f32,
    /// Causal masking: row `i` sees keys `0..=i + offset` (upper-left aligned with the default
    /// `offset` 0).
    pub causal: bool,
    /// Up to two masks, summed (e.g. `attn_mask` and `key_padding_mask`).
    pub masks: [Option<MaskView<'a>>; 2],
    /// Dropout on the attention probabilities: `(p, key)` with `p` in `[0, 1)`. `p` is f64 like
    /// [`keep_from_row`](crate::dropout::keep_from_row), so the mask matches the composed
    /// implementation bit for bit.
    pub dropout: Option<(f64, DropoutKey)>,
    /// The products take bf16 operands, as PyTorch's CPU kernels have them for bf16 inputs:
    /// in the forward, `q`, `k` and `v` rounded to bf16, `q·kᵀ` summed in f32 and then
    /// scaled, the probabilities rounded to bf16 before they meet `v` (their row sums stay
    /// f32); in the backward, the same scores recomputed, `dO`, `P` and `dS` rounded where
    /// they enter a product (and `D = rowsum(O∘dO)` from the rounded `O` and `dO`), with
    /// `dq`, `dk` and `dv` summed in f32. On AVX512-BF16 where the CPU has it (a portable
    /// kernel otherwise). The statistics, outputs and gradients stay f32. Give the backward
    /// the value the forward had. [`attention_weights`] ignores it (its weights come from f32
    /// products), so leave it off when the weights are wanted.
    pub bf16_products: bool,
    /// Where the causal diagonal and the [`window`](Self::window) sit: query `i`'s own key is
    /// `i + offset`. `0` aligns them top-left (PyTorch's `is_causal`); `s - l` bottom-right
    /// (PyTorch's `causal_lower_right`, a query block after a cache of `s - l` keys).
    pub offset: isize,
    /// Local attention: query `i` sees keys `i + offset - left ..= i + offset + right` only
    /// (`None`: unbounded on that side). With `causal`, `right` is 0. Key tiles wholly outside
    /// the band are skipped (for finite heads, see the module docs).
    pub window: Window,
    /// Per batch entry `b`, only keys `0..kv_lengths[b]` are seen (ONNX's
    /// `nonpad_kv_seqlen`: a padded batch of keys). Length `batch`, each at most `s`.
    pub kv_lengths: Option<&'a [usize]>,
    /// Tanh soft-capping of the scaled scores, `c·tanh(scale·q·k / c)`, applied before the
    /// masks are added (Gemma 2's and FlashAttention's placement). Finite and positive.
    pub softcap: Option<f32>,
    /// Cap `scale·q·k + masks` instead (ONNX `Attention`'s placement); a `-inf` mask entry
    /// stays `-inf` (ONNX's reference makes it `-c`). The band is hidden after the cap either
    /// way.
    pub softcap_after_masks: bool,
    /// ALiBi: one slope `m_h` per query head (`heads_q` values), adding
    /// `−m_h·|i + offset − j|` to the scores (FlashAttention's `alibi_slopes`; with `causal`
    /// it is BLOOM's and MPT's `m_h·(j − i)` up to a constant per row, which the softmax
    /// ignores). Added like a mask: after the soft cap, or inside it with
    /// `softcap_after_masks`. Finite values.
    pub alibi: Option<&'a [f32]>,
    /// Attention sinks: one logit per query head (`heads_q` values) that joins every row's
    /// softmax denominator with no value (gpt-oss): `P_ij = exp(s_ij) / (exp(sink_h) + Σ_j
    /// exp(s_ij))`. The row statistics include it, so the backward and the weights need
    /// nothing more; its own gradient is [`sink_grad`]. `-inf` is no sink; NaN or `+inf`
    /// makes the head's rows NaN.
    pub sinks: Option<&'a [f32]>,
}

/// The two sides of a local attention window, in keys from query `i`'s own key
/// `i + offset` (see [`AttnParams::window`]). `None` is unbounded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Window {
    /// Keys before the query's own that it sees.
    pub left: Option<usize>,
    /// Keys after the query's own that it sees (0: causal).
    pub right: Option<usize>,
}

impl<'a> AttnParams<'a> {
    /// Parameters with no mask, no dropout, not causal, `scale = 1/sqrt(d)`.
    pub fn new(dims: AttnDims) -> Self {
        AttnParams {
            dims,
            scale: 1.0 / (dims.d.max(1) as f32).sqrt(),
            causal: false,
            masks: [None, None],
            dropout: None,
            bf16_products: false,
            offset: 0,
            window: Window::default(),
            kv_lengths: None,
            softcap: None,
            softcap_after_masks: false,
            alibi: None,
            sinks: None,
        }
    }

    /// Whether the masks are folded into the score tile before a soft cap.
    fn cap_masks(&self) -> bool {
        self.softcap.is_some() && self.softcap_after_masks && self.has_mask()
    }

    /// Whether keys are hidden by their index (causal, a window or key lengths), so that
    /// whole key tiles can be skipped.
    fn banded(&self) -> bool {
        self.causal
            || self.window.left.is_some()
            || self.window.right.is_some()
            || self.kv_lengths.is_some()
    }

    /// The dropout `(p, key)` if it does anything (`p > 0`).
    fn active_dropout(&self) -> Option<(f64, DropoutKey)> {
        self.dropout.filter(|(p, _)| *p > 0.0)
    }

    fn has_mask(&self) -> bool {
        self.masks.iter().any(|m| m.is_some())
    }

    /// Whether every mask is the same for all queries (a key padding mask, a `[.., 1, S]`
    /// mask): the kernels then build one value per key instead of a key × query tile.
    fn masks_per_key(&self) -> bool {
        self.masks.iter().flatten().all(|m| m.strides()[2] == 0)
    }
}

/// Why a kernel refused its arguments. Nothing is written when an error is returned.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum KernelError {
    /// `heads_kv` is zero (with `heads_q > 0`) or does not divide `heads_q`.
    InvalidHeads {
        /// Query heads.
        heads_q: usize,
        /// Key/value heads.
        heads_kv: usize,
    },
    /// A slice is shorter than its layout needs.
    SliceTooShort {
        /// Which argument.
        name: &'static str,
        /// Elements the layout addresses (largest offset + 1).
        needed: usize,
        /// The slice's length.
        len: usize,
    },
    /// A size or offset computation overflowed `usize`.
    Overflow {
        /// Which argument.
        name: &'static str,
    },
    /// An output layout maps two elements to the same address (it would be written twice).
    OverlappingOutput {
        /// Which argument.
        name: &'static str,
    },
    /// The dropout probability is not in `[0, 1)`.
    InvalidDropout {
        /// The probability given.
        p: f64,
    },
    /// A per-batch argument is inconsistent with the sizes (e.g. a cache length beyond the
    /// cache's capacity, or a list of the wrong length).
    InvalidArgument {
        /// Which argument.
        name: &'static str,
        /// What is wrong.
        msg: String,
    },
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::InvalidHeads { heads_q, heads_kv } => {
                write!(f, "heads_kv ({heads_kv}) must be positive and divide heads_q ({heads_q})")
            }
            KernelError::SliceTooShort { name, needed, len } => {
                write!(f, "`{name}` has {len} elements but its layout addresses {needed}")
            }
            KernelError::Overflow { name } => {
                write!(f, "the layout of `{name}` overflows the address space")
            }
            KernelError::OverlappingOutput { name } => write!(
                f,
                "the layout of output `{name}` maps different elements to the same address"
            ),
            KernelError::InvalidDropout { p } => {
                write!(f, "dropout probability has to be in [0, 1), got {p}")
            }
            KernelError::InvalidArgument { name, msg } => write!(f, "`{name}`: {msg}"),
        }
    }
}

impl std::error::Error for KernelError {}

// ---------------------------------------------------------------------------------------------
// Validation

/// Elements addressed by a strided view: largest offset + 1 (0 if any size is 0).
fn span(name: &'static str, sizes: [usize; 4], strides: [usize; 4]) -> Result<usize, KernelError> {
    if sizes.contains(&0) {
        return Ok(0);
    }
    let mut last = 0usize;
    for (&n, &st) in sizes.iter().zip(&strides) {
        last = (n - 1)
            .checked_mul(st)
            .and_then(|x| x.checked_add(last))
            .ok_or(KernelError::Overflow { name })?;
    }
    last.checked_add(1).ok_or(KernelError::Overflow { name })
}

fn check_len(name: &'static str, needed: usize, len: usize) -> Result<(), KernelError> {
    if needed > len {
        Err(KernelError::SliceTooShort { name, needed, len })
    } else {
        Ok(())
    }
}

/// Checks that a `[batch, heads, seq, dim]` view fits its slice; for outputs, also that no two
/// elements share an address.
pub(crate) fn check_tensor(
    name: &'static str,
    len: usize,
    sizes: [usize; 4],
    l: Layout4,
    output: bool,
) -> Result<(), KernelError> {
    let strides = [l.batch, l.head, l.seq, 1];
    check_len(name, span(name, sizes, strides)?, len)?;
    if output && !sizes.contains(&0) {
        let mut dims: Vec<(usize, usize)> =
            sizes.iter().zip(strides).filter(|(&n, _)| n > 1).map(|(&n, st)| (n, st)).collect();
        dims.sort_by_key(|&(_, st)| st);
        let mut extent = 0usize; // largest offset reachable through the smaller strides
        for (n, st) in dims {
            if st <= extent {
                return Err(KernelError::OverlappingOutput { name });
            }
            extent = extent
                .checked_add((n - 1).checked_mul(st).ok_or(KernelError::Overflow { name })?)
                .ok_or(KernelError::Overflow { name })?;
        }
    }
    Ok(())
}

fn check_params(p: &AttnParams<'_>) -> Result<(), KernelError> {
    let d = &p.dims;
    if d.heads_q > 0 && (d.heads_kv == 0 || !d.heads_q.is_multiple_of(d.heads_kv)) {
        return Err(KernelError::InvalidHeads { heads_q: d.heads_q, heads_kv: d.heads_kv });
    }
    if let Some((pr, _)) = p.dropout {
        if !(0.0..1.0).contains(&pr) {
            return Err(KernelError::InvalidDropout { p: pr });
        }
    }
    if let Some(c) = p.softcap {
        if !(c.is_finite() && c > 0.0) {
            let msg = format!("the soft cap must be finite and positive, got {c}");
            return Err(KernelError::InvalidArgument { name: "softcap", msg });
        }
    }
    for (name, per_head) in [("alibi", p.alibi), ("sinks", p.sinks)] {
        if let Some(x) = per_head.filter(|x| x.len() != d.heads_q) {
            let msg = format!("expected one value per query head ({}), got {}", d.heads_q, x.len());
            return Err(KernelError::InvalidArgument { name, msg });
        }
    }
    if let Some((h, m)) = p.alibi.and_then(|a| a.iter().enumerate().find(|(_, m)| !m.is_finite())) {
        let msg = format!("the slope of head {h} is {m}; slopes must be finite");
        return Err(KernelError::InvalidArgument { name: "alibi", msg });
    }
    if let Some(lens) = p.kv_lengths {
        if lens.len() != d.batch {
            let msg =
                format!("expected one length per batch entry ({}), got {}", d.batch, lens.len());
            return Err(KernelError::InvalidArgument { name: "kv_lengths", msg });
        }
        if let Some((b, &n)) = lens.iter().enumerate().find(|(_, &n)| n > d.s) {
            let msg = format!("length {n} of batch entry {b} exceeds the {} keys", d.s);
            return Err(KernelError::InvalidArgument { name: "kv_lengths", msg });
        }
    }
    for (m, name) in p.masks.iter().zip(["masks[0]", "masks[1]"]) {
        if let Some(m) = m {
            let needed = span(name, [d.batch, d.heads_q, d.l, d.s], m.strides())?;
            check_len(name, needed, m.len())?;
        }
    }
    Ok(())
}

fn product(name: &'static str, xs: &[usize]) -> Result<usize, KernelError> {
    xs.iter().try_fold(1usize, |a, &x| a.checked_mul(x)).ok_or(KernelError::Overflow { name })
}

// Block sizes (tuned on Zen 5 at D = 64; 64/512 and 128/256 measure the same within noise).
/// Query block rows (forward and weights): 4 AVX-512 vectors of queries.
const FWD_BR: usize = 64;

/// Whether the forward copies strided keys and values into contiguous rows before its tasks
/// read them (see `gather`): when a head's keys are read more than once (several query blocks,
/// `l` above the forward's block of 64 rows, or query heads sharing a key/value head) and
/// they are more than one key block (`s` above 256 rows). A head's keys that fit one key
/// block are re-read from the cache whatever their stride; longer ones, strided, evict each
/// other and defeat the prefetchers, and the copy pays (measured in docs/performance.md).
pub fn forward_copies_keys(l: usize, s: usize, heads_q: usize, heads_kv: usize) -> bool {
    (l > FWD_BR || heads_q != heads_kv) && s > FWD_BC
}
/// Key block rows (forward and weights): the 256 x 64 score tile is 64 KiB (L2).
const FWD_BC: usize = 256;
/// Query block rows (backward).
const BWD_BR: usize = 64;
/// Key block rows (backward): two 128 x 64 tiles (P, dS) of 32 KiB each.
const BWD_BC: usize = 128;
// The bf16 products take a query block as one panel of pair words.
const _: () = assert!(FWD_BR <= bf16::MAX_LANES && BWD_BR <= bf16::MAX_LANES);

/// Per `(batch, query head)`: whether its queries and the keys (and values, when given) of
/// its kv head are all finite. Empty when nothing can be skipped anyway (no mask, not causal):
/// the kernels then read every key.
///
/// The kernels skip key tiles that the masks or the causal diagonal hide entirely; that is
/// exact only when the hidden scores and values are finite (PyTorch adds masks, so NaN + −inf
/// and 0·NaN are NaN). Heads with a non-finite query, key or value therefore read every key.
/// The scan reads Q, K and V once, next to the many times more work of attention itself.
fn finite_heads<T: Operand>(
    p: &AttnParams<'_>,
    (q, ql): (&[T], Layout4),
    (k, kl): (&[T], Layout4),
    v: Option<(&[T], Layout4)>,
) -> Vec<bool> {
    let dm = p.dims;
    if !p.banded() && !p.has_mask() {
        return Vec::new();
    }
    if masks_hold_nan_or_inf(p) {
        return vec![false; dm.batch * dm.heads_q];
    }
    if all_finite(p, (q, ql), (k, kl), v) {
        return vec![true; dm.batch * dm.heads_q];
    }
    use rayon::prelude::*;
    let kv: Vec<bool> = (0..dm.batch * dm.heads_kv)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dm.heads_kv, bh % dm.heads_kv);
            head_rows_finite(k, kl, (b, h), 0..dm.s, dm.d)
                && v.is_none_or(|(v, vl)| head_rows_finite(v, vl, (b, h), 0..dm.s, dm.dv))
        })
        .collect();
    let group = dm.heads_q / dm.heads_kv.max(1);
    (0..dm.batch * dm.heads_q)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dm.heads_q, bh % dm.heads_q);
            kv[b * dm.heads_kv + h / group.max(1)] && head_rows_finite(q, ql, (b, h), 0..dm.l, dm.d)
        })
        .collect()
}

/// Whether an additive mask holds NaN or `+inf` (anywhere in its storage): added to a `-inf`
/// that hides a key by index (the band), or to a key the tiles would skip, it makes NaN as the
/// composed path and a float64 reference compute, so no head may skip or overwrite those keys.
fn masks_hold_nan_or_inf(p: &AttnParams<'_>) -> bool {
    use rayon::prelude::*;
    let bad = |c: &[f32]| c.iter().fold(false, |acc, &x| acc | (x.is_nan() | (x == f32::INFINITY)));
    p.masks.iter().flatten().any(|m| match m {
        // One chunk's worth is scanned here, as `flat_finite` does: the pool costs more.
        MaskView::Additive { data, .. } if data.len() <= 1 << 14 => bad(data),
        MaskView::Additive { data, .. } => data.par_chunks(1 << 14).any(bad),
        MaskView::Bool { .. } => false,
    })
}

/// Where `inner` starts in `outer` (in elements) when `outer`'s memory holds all of `inner`'s.
fn within<T>(outer: &[T], inner: &[T]) -> Option<usize> {
    let (o, i) = (outer.as_ptr() as usize, inner.as_ptr() as usize);
    let size = std::mem::size_of::<T>();
    let shift = i.checked_sub(o)?;
    let fits = shift % size == 0 && shift / size + inner.len() <= outer.len();
    fits.then_some(shift / size)
}

/// Whether every element of the spans the views of `q`, `k` (and `v`) cover is finite: one flat
/// parallel pass (views into one buffer, as for packed projections, read it once). `false`
/// when the spans are much larger than the views (then only the per-head scan reads no more
/// than it needs) or when anything in them is not finite.
///
/// The per-head scan walks rows of `d` floats; for short heads its per-row overhead dominates
/// (measured: 3.8% of all-MiniLM-L6-v2 embedding, 32 floats per row), while in the common case
/// everything is finite and one streaming pass decides for all heads at once.
fn all_finite<T: Operand>(
    p: &AttnParams<'_>,
    (q, ql): (&[T], Layout4),
    (k, kl): (&[T], Layout4),
    v: Option<(&[T], Layout4)>,
) -> bool {
    let dm = p.dims;
    // `[start, end)` of the elements a view's rows reach, and how many elements it has.
    let span = |l: Layout4, heads: usize, rows: usize, width: usize| {
        let last = (dm.batch - 1) * l.batch + (heads - 1) * l.head + (rows - 1) * l.seq;
        let n = [heads, rows, width].iter().fold(dm.batch, |n, &x| n.saturating_mul(x));
        (0usize, last + width, n)
    };
    if [dm.batch, dm.heads_q, dm.heads_kv, dm.l, dm.s, dm.d].contains(&0) {
        return false;
    }
    let mut views =
        vec![(q, span(ql, dm.heads_q, dm.l, dm.d)), (k, span(kl, dm.heads_kv, dm.s, dm.d))];
    if let Some((v, vl)) = v {
        if dm.dv == 0 {
            return false;
        }
        views.push((v, span(vl, dm.heads_kv, dm.s, dm.dv)));
    }
    // Views into one buffer (slices of which one contains the other, as the query, key and
    // value views of packed projections are) merge into one span of the larger slice.
    let mut spans: Vec<(&[T], usize, usize)> = Vec::new();
    let (mut read, mut needed) = (0usize, 0usize);
    for (x, (a, b, n)) in views {
        needed = needed.saturating_add(n);
        let inside = spans.iter_mut().find_map(|(y, sa, sb)| {
            let shift = within(y, x)?;
            Some((sa, sb, shift))
        });
        match inside {
            Some((sa, sb, shift)) => {
                *sa = (*sa).min(a + shift);
                *sb = (*sb).max(b + shift);
            }
            None => spans.push((x, a, b)),
        }
    }
    for (x, a, b) in &spans {
        if *b > x.len() {
            return false;
        }
        read += b - a;
    }
    if read > needed.saturating_mul(2) {
        return false;
    }
    spans.iter().all(|(x, a, b)| flat_finite(&x[*a..*b]))
}

/// Whether every float of `c` is finite (no exponent field all ones): an OR of comparisons,
/// which vectorises at any x86-64 level (no early exit); on 16 lanes where the caller is
/// compiled for AVX-512 (4 lanes took a tenth of a bf16 causal attention call).
#[inline(always)]
fn scan<T: Operand>(c: &[T]) -> bool {
    c.iter().fold(0u32, |acc, &f| acc | u32::from(f.nonfinite())) == 0
}

/// [`scan`] compiled for AVX-512F and BW (bf16 elements 32 to a vector).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn scan_avx512<T: Operand>(c: &[T]) -> bool {
    scan(c)
}

/// [`scan`] on 16 lanes (32 for bf16) where this thread's SIMD level is AVX-512.
fn scan_wide<T: Operand>(c: &[T]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 {
        // SAFETY: the SIMD level is AVX-512, so the CPU has AVX-512F and BW.
        return unsafe { scan_avx512(c) };
    }
    scan(c)
}

/// Whether every element of `span` is finite: one parallel streaming pass.
fn flat_finite<T: Operand>(span: &[T]) -> bool {
    use rayon::prelude::*;
    // One chunk's worth is scanned here: sending it to the pool costs more.
    if span.len() <= 1 << 14 {
        scan_wide(span)
    } else {
        span.par_chunks(1 << 14).all(scan_wide)
    }
}

/// Whether rows `rows` of head `(b, h)` of `x` (through `l`, `width` floats each, validated
/// by the entry points) are all finite: [`scan`] row by row, on 16 lanes where this thread's
/// SIMD level is AVX-512.
pub(super) fn head_rows_finite<T: Operand>(
    x: &[T],
    l: Layout4,
    (b, h): (usize, usize),
    rows: std::ops::Range<usize>,
    width: usize,
) -> bool {
    /// The rows of one head: the data, its layout, `(b, h)`, the rows and their width.
    type HeadRows<'a, T> = (&'a [T], Layout4, (usize, usize), std::ops::Range<usize>, usize);
    #[inline(always)]
    fn each<T: Operand>((x, l, (b, h), rows, w): HeadRows<'_, T>) -> bool {
        rows.into_iter().all(|j| {
            let o = l.offset(b, h, j);
            scan(&x[o..o + w])
        })
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn each_avx512<T: Operand>(args: HeadRows<'_, T>) -> bool {
        each(args)
    }
    #[cfg(target_arch = "x86_64")]
    if simd_level() == SimdLevel::Avx512 {
        // SAFETY: the SIMD level is AVX-512, so the CPU has AVX-512F and BW.
        return unsafe { each_avx512((x, l, (b, h), rows, width)) };
    }
    each((x, l, (b, h), rows, width))
}

/// [`finite_heads`] where the keys' and values' finiteness per `(batch, kv head)` is known
/// (`kv`, from the prepacking pass that read them anyway): only the queries are scanned, in
/// one pass over their span where it is dense, else head by head.
fn finite_heads_given_kv<T: Operand>(
    p: &AttnParams<'_>,
    (q, ql): (&[T], Layout4),
    kv: &[bool],
) -> Vec<bool> {
    use rayon::prelude::*;
    let dm = p.dims;
    if masks_hold_nan_or_inf(p) {
        return vec![false; dm.batch * dm.heads_q];
    }
    let group = (dm.heads_q / dm.heads_kv.max(1)).max(1);
    let (rows, width) = (dm.heads_q.saturating_mul(dm.l), dm.d);
    let needed = dm.batch.saturating_mul(rows).saturating_mul(width);
    let last = (dm.batch - 1) * ql.batch + (dm.heads_q - 1) * ql.head + (dm.l - 1) * ql.seq;
    let dense = last + width <= q.len() && last + width <= needed.saturating_mul(2);
    if width == 0 || (dense && flat_finite(&q[..last + width])) {
        return (0..dm.batch * dm.heads_q)
            .map(|bh| kv[(bh / dm.heads_q) * dm.heads_kv + (bh % dm.heads_q) / group])
            .collect();
    }
    (0..dm.batch * dm.heads_q)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / dm.heads_q, bh % dm.heads_q);
            kv[b * dm.heads_kv + h / group] && head_rows_finite(q, ql, (b, h), 0..dm.l, width)
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Entry points

/// The attention forward: writes `out` (`[batch, heads_q, l, dv]` through `ol`) and the row
/// statistics `lse` (`2·batch·heads_q·l` floats: the row maxima, then `ln Σ exp(score − max)`;
/// see the [module docs](self)).
///
/// `q`: `[batch, heads_q, l, d]`, `k`: `[batch, heads_kv, s, d]`, `v`: `[batch, heads_kv, s,
/// dv]`, each through its layout. See the [module docs](self) for the exact semantics.
#[allow(clippy::too_many_arguments)]
// Mirrors torch.nn.functional.scaled_dot_product_attention's CPU flash kernel (forward).
pub fn flash_forward(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    out: &mut [f32],
    ol: Layout4,
    lse: &mut [f32],
) -> Result<(), KernelError> {
    // SAFETY: `MaybeUninit<f32>` has the layout of `f32`, and the kernel writes only floats
    // through the view, so `out` stays initialised.
    let out = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast(), out.len()) };
    flash_forward_uninit(p, q, ql, k, kl, v, vl, out, ol, Some(lse))
}

/// [`flash_forward`] into memory that need not be initialised, so that a caller can allocate
/// its output without zeroing it first: on `Ok`, every element of `out` that `ol` addresses
/// for `[batch, heads_q, l, dv]` has been written (all of it for a contiguous layout), and all
/// of `lse` when given (a few floats a row: it is given initialised). With `lse` `None` the row statistics are not computed (inference: no
/// backward will need them), which saves a logarithm per row.
///
/// # Shapes
/// As [`flash_forward`]: `q` (N, Hq, L, E), `k` (N, Hk, S, E), `v` (N, Hk, S, Ev), `out`
/// (N, Hq, L, Ev), each through its layout.
///
/// ```
/// use multihead_kernels::attention::{flash_forward_uninit, AttnDims, AttnParams, Layout4};
/// let dims = AttnDims { batch: 1, heads_q: 2, heads_kv: 2, l: 3, s: 4, d: 8, dv: 8 };
/// let (q, kv) = (vec![0.5f32; 2 * 3 * 8], vec![0.25f32; 2 * 4 * 8]);
/// let (ql, kl) = (Layout4::contiguous(2, 3, 8), Layout4::contiguous(2, 4, 8));
/// let mut out = Vec::with_capacity(2 * 3 * 8);
/// flash_forward_uninit(
///     &AttnParams::new(dims), &q, ql, &kv, kl, &kv, kl,
///     &mut out.spare_capacity_mut()[..48], ql, None,
/// )?;
/// // SAFETY: the kernel wrote all 48 elements of the contiguous output.
/// unsafe { out.set_len(48) };
/// assert!(out.iter().all(|&x| x == 0.25)); // every value row is 0.25
/// # Ok::<(), multihead_kernels::attention::KernelError>(())
/// ```
///
/// Errors: as [`flash_forward`].
#[allow(clippy::too_many_arguments)]
// Mirrors torch.nn.functional.scaled_dot_product_attention's CPU flash kernel (forward).
pub fn flash_forward_uninit(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    out: &mut [std::mem::MaybeUninit<f32>],
    ol: Layout4,
    lse: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    let rows = forward::OutRows::F32(exec::SyncPtr(out.as_mut_ptr().cast::<f32>()));
    forward_any(p, (q, ql), (k, kl), (v, vl), (rows, out.len(), ol), lse)
}

/// [`flash_forward_uninit`] on q, k and v given as bf16 bits (a bf16 projection as it was
/// written, read in place through the layouts), its output rounded once to bf16: the numbers
/// of `flash_forward_uninit` on their f32 values with `p.bf16_products` (which rounds q, k
/// and v to these very bits), then rounded to nearest even. So the f32 twin of a bf16 module
/// can keep its projection and the attention's output in bf16 where only products read them
/// next (half the bytes, no rounding passes). The row statistics stay f32.
///
/// # Shapes
/// As [`flash_forward`].
///
/// ```
/// use multihead_kernels::attention::{flash_forward_bf16_uninit, AttnDims, AttnParams, Layout4};
/// let dims = AttnDims { batch: 1, heads_q: 2, heads_kv: 2, l: 3, s: 4, d: 8, dv: 8 };
/// // 0.5 and 0.25 as bf16 bits.
/// let (q, kv) = (vec![0x3f00u16; 2 * 3 * 8], vec![0x3e80u16; 2 * 4 * 8]);
/// let (ql, kl) = (Layout4::contiguous(2, 3, 8), Layout4::contiguous(2, 4, 8));
/// let mut p = AttnParams::new(dims);
/// p.bf16_products = true;
/// let mut out: Vec<u16> = Vec::with_capacity(48);
/// flash_forward_bf16_uninit(&p, &q, ql, &kv, kl, &kv, kl, &mut out.spare_capacity_mut()[..48], ql, None)?;
/// // SAFETY: the kernel wrote all 48 elements of the contiguous output.
/// unsafe { out.set_len(48) };
/// assert!(out.iter().all(|&x| x == 0x3e80)); // every value row is 0.25
/// # Ok::<(), multihead_kernels::attention::KernelError>(())
/// ```
///
/// Errors: as [`flash_forward`], and `p.bf16_products` false (the f32 products would widen
/// them first: convert them instead).
#[allow(clippy::too_many_arguments)]
// Mirrors torch.nn.functional.scaled_dot_product_attention's CPU flash kernel (forward, bf16).
pub fn flash_forward_bf16_uninit(
    p: &AttnParams<'_>,
    q: &[u16],
    ql: Layout4,
    k: &[u16],
    kl: Layout4,
    v: &[u16],
    vl: Layout4,
    out: &mut [std::mem::MaybeUninit<u16>],
    ol: Layout4,
    lse: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    if !p.bf16_products {
        return Err(KernelError::InvalidArgument {
            name: "bf16_products",
            msg: "bf16 q, k and v are read by the bf16 products only; set \
                  AttnParams::bf16_products, or convert them to f32"
                .into(),
        });
    }
    let rows = forward::OutRows::Bf16(exec::SyncPtr(out.as_mut_ptr().cast::<u16>()));
    forward_any(p, (q, ql), (k, kl), (v, vl), (rows, out.len(), ol), lse)
}

/// The forward of [`flash_forward_uninit`] and [`flash_forward_bf16_uninit`], over q, k and v
/// of either element (bf16 bits only with the bf16 products, checked by the caller).
fn forward_any<T: Operand>(
    p: &AttnParams<'_>,
    (q, ql): (&[T], Layout4),
    (k, kl): (&[T], Layout4),
    (v, vl): (&[T], Layout4),
    (out, out_len, ol): (forward::OutRows, usize, Layout4),
    lse: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    check_params(p)?;
    let d = p.dims;
    check_tensor("q", q.len(), [d.batch, d.heads_q, d.l, d.d], ql, false)?;
    check_tensor("k", k.len(), [d.batch, d.heads_kv, d.s, d.d], kl, false)?;
    check_tensor("v", v.len(), [d.batch, d.heads_kv, d.s, d.dv], vl, false)?;
    check_tensor("out", out_len, [d.batch, d.heads_q, d.l, d.dv], ol, true)?;
    if let Some(lse) = &lse {
        check_len("lse", product("lse", &[2, d.batch, d.heads_q, d.l])?, lse.len())?;
    }
    if d.batch == 0 || d.heads_q == 0 || d.l == 0 {
        return Ok(());
    }
    // bf16 products on the tiles over several query blocks per head: the key and value blocks
    // are packed once (below), from the strided rows as they are.
    let kern = crate::bf16gemm::micro::kernel();
    let prepacks = p.bf16_products && d.l > FWD_BR && kern.tiles();
    // Otherwise query blocks that re-read more than a key block of strided keys and values
    // read contiguous copies (see `gather` and `forward_copies_keys`).
    let copies = !prepacks && forward_copies_keys(d.l, d.s, d.heads_q, d.heads_kv);
    let (kc, vc) = match copies {
        true => (
            gather::contiguous_heads(k, kl, [d.batch, d.heads_kv, d.s, d.d]),
            gather::contiguous_heads(v, vl, [d.batch, d.heads_kv, d.s, d.dv]),
        ),
        false => (None, None),
    };
    let (k, kl) = kc.as_ref().map_or((k, kl), |(c, l)| (c.as_slice(), *l));
    let (v, vl) = vc.as_ref().map_or((v, vl), |(c, l)| (c.as_slice(), *l));
    let lse = lse.map(|x| exec::SyncPtr(x.as_mut_ptr()));
    let mut task = forward::FwdTask::new(p, q, ql, k, kl, v, vl, out, ol, lse, FWD_BR, FWD_BC);
    // bf16 products over several query blocks per head: the key and value blocks packed once,
    // and, where tiles may be skipped, scanned for non-finite values as they are packed.
    let skips = p.banded() || p.has_mask();
    let packed = (p.bf16_products && d.l > FWD_BR)
        .then(|| prepack::Prepacked::new(task.kern, &d, (k, kl), (v, vl), FWD_BC, skips))
        .flatten();
    let finite = match packed.as_ref().and_then(|pk| pk.kv_finite()) {
        Some(kv) => finite_heads_given_kv(p, (q, ql), kv),
        None => finite_heads(p, (q, ql), (k, kl), Some((v, vl))),
    };
    task.finite = &finite;
    task.packed = packed.as_ref();
    exec::try_par_run(simd_level(), &task, "flash_forward")
}

/// The attention backward (FlashAttention-2 recomputation from `lse`). Overwrites `dq`
/// (`[batch, heads_q, l, d]`), `dk` (`[batch, heads_kv, s, d]`) and `dv`
/// (`[batch, heads_kv, s, dv]`), each through its layout.
///
/// `out` and `lse` are what [`flash_forward`] returned for the same arguments; `dout` is the
/// gradient of `out` (`[batch, heads_q, l, dv]`).
#[allow(clippy::too_many_arguments)]
// Mirrors the backward of torch.nn.functional.scaled_dot_product_attention (CPU flash).
pub fn flash_backward(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    out: &[f32],
    ol: Layout4,
    dout: &[f32],
    dol: Layout4,
    lse: &[f32],
    dq: &mut [f32],
    dql: Layout4,
    dk: &mut [f32],
    dkl: Layout4,
    dv: &mut [f32],
    dvl: Layout4,
) -> Result<(), KernelError> {
    let ins = [(q, ql), (k, kl), (v, vl), (out, ol), (dout, dol)];
    check_backward_inputs(p, ins, lse)?;
    let d = p.dims;
    check_tensor("dq", dq.len(), [d.batch, d.heads_q, d.l, d.d], dql, true)?;
    check_tensor("dk", dk.len(), [d.batch, d.heads_kv, d.s, d.d], dkl, true)?;
    check_tensor("dv", dv.len(), [d.batch, d.heads_kv, d.s, d.dv], dvl, true)?;
    let ptr = |x: &mut [f32]| exec::SyncPtr(x.as_mut_ptr());
    run_backward(p, ins, lse, [(ptr(dq), dql), (ptr(dk), dkl), (ptr(dv), dvl)], None)
}

/// [`flash_backward`] that also writes `dscores`, the gradient of the scores at the point
/// where the masks are added (`[batch, heads_q, l, s]`, contiguous): the gradient of an
/// additive mask given per `(batch, head)` (sum it over the dimensions a broadcast mask
/// repeats). With the soft cap before the masks it is `dS` before the cap's slope, after the
/// masks (ONNX's placement) `dS` through it; keys hidden by the band or a fully masked tile get
/// 0. Costs the `l·s` floats per head that the fused backward otherwise never stores.
#[allow(clippy::too_many_arguments)]
// Mirrors the gradient of a float attn_mask that requires grad in torch's SDPA (math path).
pub fn flash_backward_dscores(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    out: &[f32],
    ol: Layout4,
    dout: &[f32],
    dol: Layout4,
    lse: &[f32],
    dq: &mut [f32],
    dql: Layout4,
    dk: &mut [f32],
    dkl: Layout4,
    dv: &mut [f32],
    dvl: Layout4,
    dscores: &mut [f32],
) -> Result<(), KernelError> {
    let ins = [(q, ql), (k, kl), (v, vl), (out, ol), (dout, dol)];
    check_backward_inputs(p, ins, lse)?;
    let d = p.dims;
    check_tensor("dq", dq.len(), [d.batch, d.heads_q, d.l, d.d], dql, true)?;
    check_tensor("dk", dk.len(), [d.batch, d.heads_kv, d.s, d.d], dkl, true)?;
    check_tensor("dv", dv.len(), [d.batch, d.heads_kv, d.s, d.dv], dvl, true)?;
    let dscores = scores_output(p, Some(dscores))?;
    let ptr = |x: &mut [f32]| exec::SyncPtr(x.as_mut_ptr());
    let outs = [(ptr(dq), dql), (ptr(dk), dkl), (ptr(dv), dvl)];
    run_backward(p, ins, lse, outs, dscores)
}

/// [`flash_backward`] for self-attention whose q, k and v gradients share one buffer, as the
/// gradient of a packed in-projection output `[.., 3·E]` does: the gradient of q's row
/// `(b, h, i)` lands at `dl.offset(b, h, i)`, k's `heads·dl.head` floats later and v's
/// `2·heads·dl.head` later (`dqkv` is a `[batch, 3·heads, l, d]` tensor through `dl`).
///
/// Needs `heads_q == heads_kv`, `d == dv` and `l == s`; writes every element of those three
/// parts (stored, never added to), so no separate gradients need interleaving afterwards, and
/// `dqkv` may be uninitialised memory (`&mut [MaybeUninit<f32>]`) when the three parts are all
/// of it. With `dscores`, also writes the scores' gradient there, as [`flash_backward_dscores`]
/// does.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_packed(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    out: &[f32],
    ol: Layout4,
    dout: &[f32],
    dol: Layout4,
    lse: &[f32],
    dqkv: &mut [impl OutputF32],
    dl: Layout4,
    dscores: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    let d = p.dims;
    packed_shape_check(d)?;
    let ins = [(q, ql), (k, kl), (v, vl), (out, ol), (dout, dol)];
    check_backward_inputs(p, ins, lse)?;
    let [dq, dk, dv] = packed_outputs("dqkv", dqkv, dl, [d.batch, d.heads_q, d.l, d.d])?;
    let dscores = scores_output(p, dscores)?;
    run_backward(p, ins, lse, [(dq, dl), (dk, dl), (dv, dl)], dscores)
}

/// What a q/k/v gradient packed in one buffer needs: one head count, one head width, self-attention.
fn packed_shape_check(d: AttnDims) -> Result<(), KernelError> {
    if d.heads_q != d.heads_kv || d.d != d.dv || d.l != d.s {
        let msg = format!(
            "a packed gradient needs heads_q == heads_kv, d == dv and l == s, got heads {}/{}, \
             d {}/{} and l {}/{}; use flash_backward with three gradients instead",
            d.heads_q, d.heads_kv, d.d, d.dv, d.l, d.s
        );
        return Err(KernelError::InvalidArgument { name: "dqkv", msg });
    }
    Ok(())
}

/// The checked `[batch, heads_q, l, s]` buffer of the scores' gradient, when asked for.
fn scores_output(
    p: &AttnParams<'_>,
    dscores: Option<&mut [f32]>,
) -> Result<Option<exec::SyncPtr<f32>>, KernelError> {
    let Some(ds) = dscores else { return Ok(None) };
    let d = p.dims;
    let n = product("dscores", &[d.batch, d.heads_q, d.l, d.s])?;
    check_len("dscores", n, ds.len())?;
    Ok(Some(exec::SyncPtr(ds.as_mut_ptr())))
}

/// [`flash_backward`] whose k and v gradients share one buffer, as the gradient of a packed
/// key/value projection `[.., 2·E]` (cross-attention over one memory) does: the gradient of
/// k's row `(b, h, j)` lands at `dkvl.offset(b, h, j)` and v's `heads_kv·dkvl.head` floats
/// later (`dkv` is a `[batch, 2·heads_kv, s, d]` tensor through `dkvl`). Needs `d == dv`.
/// With `dscores`, also writes the scores' gradient there, as [`flash_backward_dscores`] does.
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_kv_packed(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    out: &[f32],
    ol: Layout4,
    dout: &[f32],
    dol: Layout4,
    lse: &[f32],
    dq: &mut [f32],
    dql: Layout4,
    dkv: &mut [f32],
    dkvl: Layout4,
    dscores: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    let d = p.dims;
    if d.d != d.dv {
        let msg = format!(
            "a packed key/value gradient needs d == dv, got d {} and dv {}; use flash_backward \
             with three gradients instead",
            d.d, d.dv
        );
        return Err(KernelError::InvalidArgument { name: "dkv", msg });
    }
    let ins = [(q, ql), (k, kl), (v, vl), (out, ol), (dout, dol)];
    check_backward_inputs(p, ins, lse)?;
    check_tensor("dq", dq.len(), [d.batch, d.heads_q, d.l, d.d], dql, true)?;
    let [dk, dv] = packed_outputs("dkv", dkv, dkvl, [d.batch, d.heads_kv, d.s, d.d])?;
    let dq = exec::SyncPtr(dq.as_mut_ptr());
    let dscores = scores_output(p, dscores)?;
    run_backward(p, ins, lse, [(dq, dql), (dk, dkvl), (dv, dkvl)], dscores)
}

/// The `N` parts of a packed gradient buffer: `buf` viewed through `l` as `[batch, N·heads,
/// rows, width]` (checked: in bounds, no element twice), part `i` starting at head
/// `i·heads`. When the view has no element, nothing is written through any part, and every
/// part is `buf`'s start (no pointer is offset past an empty buffer).
fn packed_outputs<const N: usize>(
    name: &'static str,
    buf: &mut [impl OutputF32],
    l: Layout4,
    [batch, heads, rows, width]: [usize; 4],
) -> Result<[exec::SyncPtr<f32>; N], KernelError> {
    let all = heads.checked_mul(N).ok_or(KernelError::Overflow { name })?;
    check_tensor(name, buf.len(), [batch, all, rows, width], l, true)?;
    let empty = batch == 0 || all == 0 || rows == 0 || width == 0;
    let base = buf.as_mut_ptr().cast::<f32>();
    Ok(std::array::from_fn(|i| {
        let off = if empty { 0 } else { i * heads * l.head };
        // SAFETY: for a non-empty view, head `i·heads` (< `N·heads`) of row 0 of batch 0 is
        // an element of the view checked above, so its offset lies inside `buf`.
        exec::SyncPtr(unsafe { base.add(off) })
    }))
}

/// An element of an output buffer the kernels write f32s into without reading it: `f32`, or
/// `MaybeUninit<f32>` for a buffer that was not initialised. Sealed: only these two.
pub trait OutputF32: sealed::Sealed {}
impl OutputF32 for f32 {}
impl OutputF32 for std::mem::MaybeUninit<f32> {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for std::mem::MaybeUninit<f32> {}
}

/// Checks the backward's parameters and inputs: q, k, v, out, dout (each with its layout)
/// and the row statistics.
fn check_backward_inputs(
    p: &AttnParams<'_>,
    [(q, ql), (k, kl), (v, vl), (out, ol), (dout, dol)]: [(&[f32], Layout4); 5],
    lse: &[f32],
) -> Result<(), KernelError> {
    check_params(p)?;
    let d = p.dims;
    check_tensor("q", q.len(), [d.batch, d.heads_q, d.l, d.d], ql, false)?;
    check_tensor("k", k.len(), [d.batch, d.heads_kv, d.s, d.d], kl, false)?;
    check_tensor("v", v.len(), [d.batch, d.heads_kv, d.s, d.dv], vl, false)?;
    check_tensor("out", out.len(), [d.batch, d.heads_q, d.l, d.dv], ol, false)?;
    check_tensor("dout", dout.len(), [d.batch, d.heads_q, d.l, d.dv], dol, false)?;
    check_len("lse", product("lse", &[2, d.batch, d.heads_q, d.l])?, lse.len())
}

/// Runs the backward tasks on validated inputs into the validated, non-overlapping gradient
/// outputs `dq`, `dk`, `dv` (and the scores' gradient, contiguous `[batch, heads_q, l, s]`).
fn run_backward(
    p: &AttnParams<'_>,
    ins: [(&[f32], Layout4); 5],
    lse: &[f32],
    outs: [(exec::SyncPtr<f32>, Layout4); 3],
    dscores: Option<exec::SyncPtr<f32>>,
) -> Result<(), KernelError> {
    let d = p.dims;
    if d.batch == 0 || d.heads_q == 0 {
        return Ok(());
    }
    let [(q, ql), (k, kl), (v, vl), ..] = ins;
    // (A query block whose output or upstream gradient is not finite reads every key as well:
    // `BwdTask::block_rows_finite`.)
    let finite = finite_heads(p, (q, ql), (k, kl), Some((v, vl)));
    // Each task owns a kv head: it copies strided rows into its scratch itself (see `gather`)
    // and accumulates dK and dV there.
    let mut task = backward::BwdTask::new(p, ins, lse, outs, BWD_BR, BWD_BC);
    task.finite = &finite;
    task.dscores = dscores;
    exec::try_par_run(simd_level(), &task, "flash_backward")
}

/// The attention probabilities `exp(scale·q·k + mask − lse)` times the dropout multipliers
/// (the same ones the forward used), written to `weights`: `[batch, heads_q, l, s]`
/// contiguous, or `[batch, 1, l, s]` averaged over the heads when `average_heads`.
///
/// `lse` is what [`flash_forward`] returned. Costs about half a forward pass and never needs
/// more than `batch·l·s` (or `batch·heads·l·s`) output memory.
#[allow(clippy::too_many_arguments)]
// Mirrors the attn_weights that torch.nn.MultiheadAttention returns (need_weights=True).
pub fn attention_weights(
    p: &AttnParams<'_>,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    lse: &[f32],
    average_heads: bool,
    weights: &mut [f32],
) -> Result<(), KernelError> {
    check_params(p)?;
    let d = p.dims;
    check_tensor("q", q.len(), [d.batch, d.heads_q, d.l, d.d], ql, false)?;
    check_tensor("k", k.len(), [d.batch, d.heads_kv, d.s, d.d], kl, false)?;
    check_len("lse", product("lse", &[2, d.batch, d.heads_q, d.l])?, lse.len())?;
    let hw = if average_heads { 1 } else { d.heads_q };
    check_len("weights", product("weights", &[d.batch, hw, d.l, d.s])?, weights.len())?;
    if d.batch == 0 || d.l == 0 || d.s == 0 {
        return Ok(());
    }
    if d.heads_q == 0 {
        // The mean over no heads: PyTorch gives NaN; there is nothing to average here.
        weights[..d.batch * d.l * d.s].fill(f32::NAN);
        return Ok(());
    }
    let finite = finite_heads(p, (q, ql), (k, kl), None);
    let kc = gather::contiguous_heads(k, kl, [d.batch, d.heads_kv, d.s, d.d]);
    let (k, kl) = kc.as_ref().map_or((k, kl), |(c, l)| (c.as_slice(), *l));
    let mut task =
        weights::WeightsTask::new(p, q, ql, k, kl, lse, average_heads, weights, FWD_BR, FWD_BC);
    task.finite = &finite;
    exec::try_par_run(simd_level(), &task, "attention_weights")
}
