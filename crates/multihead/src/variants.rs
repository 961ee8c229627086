//! Attention variants beyond PyTorch's SDPA arguments: tanh soft-capping, local windows, the
//! alignment of the causal diagonal, per-batch key lengths and ALiBi. The fused kernels compute them
//! from indices (no `L × S` mask); the composed path builds the equivalent additive mask, so
//! both paths accept the same arguments and give the same numbers.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

pub use multihead_kernels::attention::Window;

/// Where the causal diagonal (and a [`Window`]'s centre) sits when `L ≠ S`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CausalAlign {
    /// Query `i` sees keys `0..=i`: PyTorch's `is_causal=True` (`causal_upper_left`).
    #[default]
    TopLeft,
    /// Query `i` sees keys `0..=i + S − L`: PyTorch's `causal_lower_right`, and ONNX's causal
    /// attention after a cache of `S − L` past keys (the last query sees every key).
    BottomRight,
    /// Query `i` sees keys `0..=i + offset` (ONNX's causal attention after `offset` past keys
    /// when the new keys are not as many as the queries).
    Offset(isize),
}

/// The variants of one attention call (see the [module docs](self)). The default is plain
/// attention.
///
/// # Example
/// ```
/// use multihead::{CausalAlign, Variants};
///
/// // Mistral-style sliding window of 4096 keys after a cache, Gemma-2-style soft cap.
/// let v = Variants::default().window(Some(4096), None).align(CausalAlign::BottomRight).softcap(50.0);
/// assert_eq!(v.window.left, Some(4096));
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Variants {
    /// Alignment of `is_causal` and of the window. Default top-left.
    pub align: CausalAlign,
    /// Keys seen around each query's own (`left` before, `right` after; `None` unbounded).
    /// With `is_causal`, `right` is 0. Default unbounded.
    pub window: Window,
    /// Per entry of the batch dimension `N`, keys `0..kv_lengths[n]` are seen (ONNX's
    /// `nonpad_kv_seqlen`). Default all.
    pub kv_lengths: Option<Vec<usize>>,
    /// `c·tanh(scale·q·kᵀ / c)` before masks are added (Gemma 2, Grok, FlashAttention's
    /// `softcap`). Default none.
    pub softcap: Option<f64>,
    /// Cap `scale·q·kᵀ + attn_mask` instead (ONNX `Attention`'s placement). A `-inf` mask
    /// entry stays `-inf` (ONNX's numpy reference turns it into `-c`, giving masked keys
    /// weight). Keys hidden by `is_causal`, the window or the lengths stay hidden either way.
    /// Default `false`.
    pub softcap_after_masks: bool,
    /// ALiBi: one slope `m_h` per query head, adding `−m_h·|i + offset − j|` to the scores,
    /// `offset` from [`align`](Self::align) (FlashAttention's `alibi_slopes`; with
    /// `is_causal` it equals BLOOM's and MPT's `m_h·(j − i)` up to a constant per row, which
    /// the softmax ignores). Added like a mask: after a soft cap, or inside it with
    /// `softcap_after_masks`. The fused kernels compute it from indices (no `L × S` tensor).
    /// Fixed slopes (no gradient). Default none.
    pub alibi_slopes: Option<Vec<f64>>,
}

impl Variants {
    /// Sets the alignment of `is_causal` and of the window.
    pub fn align(mut self, align: CausalAlign) -> Self {
        self.align = align;
        self
    }
    /// Sets the window: `left` keys before each query's own, `right` after (`None` unbounded).
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window = Window { left, right };
        self
    }
    /// Sets the key length of each entry of the batch dimension.
    pub fn kv_lengths(mut self, lengths: Vec<usize>) -> Self {
        self.kv_lengths = Some(lengths);
        self
    }
    /// Sets the soft cap `c`.
    pub fn softcap(mut self, c: f64) -> Self {
        self.softcap = Some(c);
        self
    }
    /// Caps the scores after the masks are added (ONNX's placement) or before (the default).
    pub fn softcap_after_masks(mut self, after: bool) -> Self {
        self.softcap_after_masks = after;
        self
    }

    /// Sets the ALiBi slopes, one per query head (see [`alibi_slopes`](Self::alibi_slopes)).
    pub fn alibi(mut self, slopes: Vec<f64>) -> Self {
        self.alibi_slopes = Some(slopes);
        self
    }

    /// The slopes ALiBi's paper gives `heads` heads: `2^(−8i/heads)` for `i = 1..=heads` when
    /// `heads` is a power of two, else those of the power of two below followed by every other
    /// slope of the one above (BLOOM's and MPT's `get_alibi_slopes`).
    ///
    /// # Example
    /// ```
    /// let m = multihead::Variants::alibi_slopes_for(8);
    /// assert_eq!(m[0], 0.5);
    /// assert_eq!(m[7], 1.0 / 256.0);
    /// ```
    pub fn alibi_slopes_for(heads: usize) -> Vec<f64> {
        let geometric = |n: usize| -> Vec<f64> {
            (1..=n).map(|i| 2f64.powf(-8.0 * i as f64 / n as f64)).collect()
        };
        if heads == 0 {
            return Vec::new();
        }
        let pow2 = 1usize << (usize::BITS - 1 - heads.leading_zeros());
        let mut m = geometric(pow2);
        m.extend(geometric(2 * pow2).into_iter().step_by(2).take(heads - pow2));
        m
    }

    /// The slopes as the kernels take them.
    pub(crate) fn alibi_f32(&self) -> Option<Vec<f32>> {
        self.alibi_slopes.as_ref().map(|m| m.iter().map(|&x| x as f32).collect())
    }

    /// The composed path's soft cap: `(c, after the masks)`.
    pub(crate) fn cap(&self) -> Option<(f64, bool)> {
        self.softcap.map(|c| (c, self.softcap_after_masks))
    }

    /// Whether anything hides keys by index besides `is_causal` (a window or key lengths).
    pub(crate) fn banded(&self) -> bool {
        self.window != Window::default() || self.kv_lengths.is_some()
    }

    /// The kernels' diagonal offset for `l` queries and `s` keys.
    pub(crate) fn offset(&self, l: usize, s: usize) -> isize {
        match self.align {
            CausalAlign::TopLeft => 0,
            CausalAlign::BottomRight => s as isize - l as isize,
            CausalAlign::Offset(o) => o,
        }
    }

    /// Checks the options against the call: a finite positive soft cap; key lengths need a
    /// batch dimension `n` (`None`: the input has none), one per entry, at most `s` each; ALiBi
    /// needs a head dimension of `heads` (`None`: none), one finite slope per head.
    pub(crate) fn check(
        &self,
        op: &'static str,
        (n, heads): (Option<usize>, Option<usize>),
        s: usize,
    ) -> Result<()> {
        if let Some(m) = &self.alibi_slopes {
            let Some(h) = heads else {
                let msg =
                    "ALiBi slopes need a head dimension: give query as (N, H, L, E) or (H, L, E)"
                        .to_string();
                return Err(Error::Config { op, arg: "alibi_slopes", msg });
            };
            if m.len() != h {
                let msg = format!("expected one slope per query head (H = {h}), got {}", m.len());
                return Err(Error::Config { op, arg: "alibi_slopes", msg });
            }
            if let Some((i, x)) = m.iter().enumerate().find(|(_, x)| !(**x as f32).is_finite()) {
                let msg = format!("the slope of head {i} is {x}; slopes must be finite (in f32)");
                return Err(Error::Config { op, arg: "alibi_slopes", msg });
            }
        }
        if let Some(c) = self.softcap {
            if !(c.is_finite() && c > 0.0 && (c as f32).is_finite() && c as f32 > 0.0) {
                let msg = format!(
                    "the soft cap must be positive and finite, also in f32 (the kernels' \
                     precision, where it must not round to 0 or overflow), got {c:?}; pass None \
                     to turn it off"
                );
                return Err(Error::Config { op, arg: "softcap", msg });
            }
        }
        if let Some(lens) = &self.kv_lengths {
            let Some(n) = n else {
                let msg = "key lengths need a batch dimension: give query, key and value as (N, H, L, E), (N, H, S, E) and (N, H, S, Ev)".to_string();
                return Err(Error::Config { op, arg: "kv_lengths", msg });
            };
            if lens.len() != n {
                let msg =
                    format!("expected one length per batch entry (N = {n}), got {}", lens.len());
                return Err(Error::Config { op, arg: "kv_lengths", msg });
            }
            if let Some((b, &len)) = lens.iter().enumerate().find(|(_, &len)| len > s) {
                let msg = format!("length {len} of batch entry {b} exceeds the key length S = {s}; lengths must be at most S");
                return Err(Error::Config { op, arg: "kv_lengths", msg });
            }
        }
        Ok(())
    }

    /// The ALiBi bias for the composed path, `(H, L, S)`; `None` without slopes.
    pub(crate) fn alibi_bias(
        &self,
        op: &'static str,
        (l, s): (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        let Some(m) = &self.alibi_slopes else { return Ok(None) };
        let h = m.len();
        let count = crate::alloc::elements(op, "alibi bias", &[h, l, s])?;
        crate::alloc::ensure(op, "alibi bias", &[h, l, s], DType::F64, 2, "use shorter sequences")?;
        let mut data = crate::alloc::try_zeros::<f64>(count, "alibi bias")?;
        let offset = self.offset(l, s) as f64;
        for (x, v) in data.iter_mut().enumerate() {
            let (hh, i, j) = (x / (l * s), (x / s) % l, x % s);
            *v = -m[hh] * (i as f64 + offset - j as f64).abs();
        }
        Ok(Some(Tensor::from_vec(data, (h, l, s), device)?.to_dtype(dtype)?))
    }

    /// The additive mask of the keys hidden by index (causal, window, lengths) for the
    /// composed path: `(N, 1, .., L, S)` with `lead` ones after `N` when there are key lengths,
    /// else `(L, S)`; `None` when nothing is hidden.
    pub(crate) fn band_mask(
        &self,
        op: &'static str,
        (causal, lead): (bool, usize),
        (l, s): (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Tensor>> {
        if !causal && !self.banded() {
            return Ok(None);
        }
        let n = self.kv_lengths.as_ref().map_or(1, Vec::len);
        let count = crate::alloc::elements(op, "band mask", &[n, l, s])?;
        crate::alloc::ensure(op, "band mask", &[n, l, s], DType::F64, 2, "use shorter sequences")?;
        let mut data = crate::alloc::try_zeros::<f64>(count, "band mask")?;
        let offset = self.offset(l, s) as i128;
        let right = if causal { Some(0) } else { self.window.right };
        for (b, block) in data.chunks_mut(l * s.max(1)).enumerate().take(n) {
            let len = self.kv_lengths.as_ref().map_or(s, |k| k[b]);
            for i in 0..l {
                for j in 0..s {
                    let rel = j as i128 - i as i128 - offset;
                    let hidden = right.is_some_and(|r| rel > r as i128)
                        || self.window.left.is_some_and(|w| rel < -(w as i128))
                        || j >= len;
                    if hidden {
                        block[i * s + j] = f64::NEG_INFINITY;
                    }
                }
            }
        }
        let mask = Tensor::from_vec(data, (n, l, s), device)?.to_dtype(dtype)?;
        Ok(Some(match self.kv_lengths {
            Some(_) => {
                let mut dims = vec![n];
                dims.extend(std::iter::repeat_n(1, lead));
                dims.extend([l, s]);
                mask.reshape(dims)?
            }
            None => mask.reshape((l, s))?,
        }))
    }
}
