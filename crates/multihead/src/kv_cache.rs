//! [`KvCache`]: the keys and values of the tokens decoded so far, for incremental decoding.

use candle_core::{DType, Device, Tensor};

use crate::error::{fmt_shape, Error, Result};
use crate::fused::decode::Append;

const OP: &str = "KvCache";

/// The projected keys and values of one attention layer's past tokens, preallocated once.
///
/// Storage is two tensors of shape `(N, Hkv, C, D)` (batch, key/value heads, capacity, head
/// size), allocated when the cache is made and written in place: appending a token copies its
/// key and value into the next slot and nothing else, so a decode step never copies the cache.
/// Each batch row has its own length, so sequences of different lengths share one batch.
///
/// Two policies:
/// * [`new`](Self::new): room for `capacity` tokens per row. Appending past it is an
///   [`Error::CacheFull`] and leaves the cache unchanged; grow explicitly with
///   [`with_capacity`](Self::with_capacity) (one copy) if you need to.
/// * [`sliding_window`](Self::sliding_window): a ring buffer of the last `window` tokens;
///   each new token overwrites the oldest, and attention sees exactly the last `window`
///   tokens (itself included), as a sliding-window causal mask would allow.
///
/// [`truncate`](Self::truncate) rolls rows back (speculative decoding), [`reorder`](Self::reorder)
/// selects rows (beam search), [`reset`](Self::reset) empties the cache for reuse.
///
/// # Shapes
/// * keys and values: `(N, Hkv, C, D)`; row `b` holds [`lens`](Self::lens)`()[b]` valid
///   tokens in slots `0..lens[b]`.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::{MhaConfig, MultiheadAttention};
///
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
/// let mut mha = MultiheadAttention::new(MhaConfig::new(16, 4).with_batch_first(true), vb)?;
/// mha.eval();
/// let mut cache = mha.new_cache(2, 64)?; // 2 sequences, up to 64 tokens each
/// let prompt = Tensor::randn(0f32, 1.0, (2, 5, 16), &Device::Cpu)?; // (N, T, E)
/// let y = mha.forward_cached(&prompt, &mut cache, None)?; // causal over the prompt
/// let next = Tensor::randn(0f32, 1.0, (2, 1, 16), &Device::Cpu)?;
/// let z = mha.forward_cached(&next, &mut cache, None)?; // one step: reads the cache once
/// assert_eq!((y.dims(), z.dims(), cache.lens()), (&[2, 5, 16][..], &[2, 1, 16][..], &[6, 6][..]));
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Debug)]
pub struct KvCache {
    k: Tensor,
    v: Tensor,
    lens: Vec<usize>,
    positions: Vec<usize>,
    window: Option<usize>,
}

impl KvCache {
    /// An empty cache for `batch` rows of up to `capacity` tokens each, `kv_heads` heads of
    /// `head_dim`, in `dtype` on `device`. The memory is allocated (and checked) now.
    pub fn new(
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::build(batch, kv_heads, head_dim, capacity, None, dtype, device)
    }

    /// An empty ring buffer holding the last `window` tokens of each of `batch` rows.
    pub fn sliding_window(
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
        window: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if window == 0 {
            return Err(Error::Config {
                op: OP,
                arg: "window",
                msg: "a sliding window must hold at least one token, got window=0".into(),
            });
        }
        Self::build(batch, kv_heads, head_dim, window, Some(window), dtype, device)
    }

    fn build(
        batch: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        window: Option<usize>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        crate::alloc::expect_float(OP, "dtype", dtype)?;
        if kv_heads == 0 || head_dim == 0 {
            return Err(Error::Config {
                op: OP,
                arg: "kv_heads",
                msg: format!(
                    "kv_heads and head_dim must be greater than 0, got {kv_heads} and {head_dim}"
                ),
            });
        }
        let dims = [batch, kv_heads, capacity, head_dim];
        crate::alloc::ensure(
            OP,
            "keys and values",
            &dims,
            dtype,
            2,
            "use a smaller capacity or batch",
        )?;
        Ok(Self {
            k: Tensor::zeros(&dims, dtype, device)?,
            v: Tensor::zeros(&dims, dtype, device)?,
            lens: vec![0; batch],
            positions: vec![0; batch],
            window,
        })
    }

    /// A copy with its own storage (a cache is written in place, so copies never share).
    pub fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            k: self.k.copy()?,
            v: self.v.copy()?,
            lens: self.lens.clone(),
            positions: self.positions.clone(),
            window: self.window,
        })
    }

    /// Rows (`N`).
    pub fn batch_size(&self) -> usize {
        self.lens.len()
    }
    /// Key/value heads (`Hkv`).
    pub fn kv_heads(&self) -> usize {
        self.k.dims()[1]
    }
    /// Slots per row (`C`): the capacity, or the window of a sliding cache.
    pub fn capacity(&self) -> usize {
        self.k.dims()[2]
    }
    /// Head size (`D`).
    pub fn head_dim(&self) -> usize {
        self.k.dims()[3]
    }
    /// The window of a sliding cache.
    pub fn window(&self) -> Option<usize> {
        self.window
    }
    /// The dtype of the stored keys and values.
    pub fn dtype(&self) -> DType {
        self.k.dtype()
    }
    /// Valid slots per row (at most the window for a sliding cache).
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }
    /// Tokens appended per row since the last reset: the position the next token of the row
    /// takes. Equal to [`lens`](Self::lens) except in a sliding cache that has wrapped.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }
    /// The key storage `(N, Hkv, C, D)` (see the type docs for which slots are valid).
    pub fn keys(&self) -> &Tensor {
        &self.k
    }
    /// The value storage `(N, Hkv, C, D)`.
    pub fn values(&self) -> &Tensor {
        &self.v
    }

    /// Empties every row; the memory is kept for the next sequence.
    pub fn reset(&mut self) {
        self.lens.fill(0);
        self.positions.fill(0);
    }

    /// Rolls every row back to at most `len` tokens (e.g. rejecting speculated tokens).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        let lens: Vec<usize> = self.positions.iter().map(|&p| p.min(len)).collect();
        self.truncate_rows(&lens)
    }

    /// Rolls row `b` back to `lens[b]` tokens, which must not exceed its current length. A
    /// sliding cache can only roll back while it has not wrapped (older tokens are gone).
    pub fn truncate_rows(&mut self, lens: &[usize]) -> Result<()> {
        self.check_rows("lens", lens.len())?;
        for (b, (&want, &pos)) in lens.iter().zip(&self.positions).enumerate() {
            if want > pos {
                return Err(Error::Config {
                    op: OP,
                    arg: "lens",
                    msg: format!(
                        "row {b} holds {pos} tokens and cannot grow to {want} by truncation"
                    ),
                });
            }
            if want < pos && self.window.is_some_and(|w| pos > w) {
                return Err(Error::Config {
                    op: OP,
                    arg: "lens",
                    msg: format!(
                        "row {b} of the sliding cache has wrapped ({pos} tokens through a window of {}); \
                         its older tokens are gone, so it can only be reset",
                        self.capacity()
                    ),
                });
            }
        }
        self.positions.copy_from_slice(lens);
        self.lens.copy_from_slice(lens);
        Ok(())
    }

    /// Keeps rows `rows` in that order (beam search): new row `i` is old row `rows[i]`. This
    /// copies the cache once.
    pub fn reorder(&mut self, rows: &[usize]) -> Result<()> {
        self.check_rows("rows", rows.len())?;
        if let Some(&bad) = rows.iter().find(|&&r| r >= self.batch_size()) {
            return Err(Error::Config {
                op: OP,
                arg: "rows",
                msg: format!(
                    "row index {bad} is out of range for a cache of {} rows",
                    self.batch_size()
                ),
            });
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = Tensor::new(idx.as_slice(), self.k.device())?;
        self.k = self.k.index_select(&idx, 0)?.contiguous()?;
        self.v = self.v.index_select(&idx, 0)?.contiguous()?;
        self.lens = rows.iter().map(|&r| self.lens[r]).collect();
        self.positions = rows.iter().map(|&r| self.positions[r]).collect();
        Ok(())
    }

    /// A copy of this cache with room for `capacity` tokens per row (the explicit way to grow).
    pub fn with_capacity(&self, capacity: usize) -> Result<Self> {
        if self.window.is_some() {
            return Err(Error::Config {
                op: OP,
                arg: "capacity",
                msg: "a sliding cache has a fixed window; make a new one instead".into(),
            });
        }
        let longest = self.lens.iter().copied().max().unwrap_or(0);
        if capacity < longest {
            return Err(Error::Config {
                op: OP,
                arg: "capacity",
                msg: format!(
                    "capacity {capacity} is smaller than the longest row ({longest} tokens)"
                ),
            });
        }
        let mut out = Self::new(
            self.batch_size(),
            self.kv_heads(),
            self.head_dim(),
            capacity,
            self.dtype(),
            self.k.device(),
        )?;
        let keep = self.capacity().min(capacity);
        let (k, v) = (self.k.narrow(2, 0, keep)?, self.v.narrow(2, 0, keep)?);
        out.k = Tensor::cat(&[&k, &out.k.narrow(2, keep, capacity - keep)?], 2)?.contiguous()?;
        out.v = Tensor::cat(&[&v, &out.v.narrow(2, keep, capacity - keep)?], 2)?.contiguous()?;
        out.lens.copy_from_slice(&self.lens);
        out.positions.copy_from_slice(&self.positions);
        Ok(out)
    }

    fn check_rows(&self, arg: &'static str, got: usize) -> Result<()> {
        if got != self.batch_size() {
            return Err(Error::Config {
                op: OP,
                arg,
                msg: format!("expected one entry per cache row ({}), got {got}", self.batch_size()),
            });
        }
        Ok(())
    }

    /// Checks that `counts[b]` more tokens fit in row `b`; nothing changes on error.
    pub(crate) fn check_room(&self, op: &'static str, counts: &[usize]) -> Result<()> {
        if self.window.is_some() {
            return Ok(());
        }
        for (b, (&n, &len)) in counts.iter().zip(&self.lens).enumerate() {
            if len + n > self.capacity() {
                return Err(Error::CacheFull {
                    op,
                    msg: format!(
                        "row {b} holds {len} of {} tokens and cannot take {n} more; make the cache \
                         with a larger capacity, grow it with KvCache::with_capacity, or use \
                         KvCache::sliding_window",
                        self.capacity()
                    ),
                });
            }
        }
        Ok(())
    }

    /// Checks that the cache fits a module: heads, head size, dtype and device.
    pub(crate) fn check_fits(
        &self,
        op: &'static str,
        (n, kv_heads, head_dim): (usize, usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<()> {
        let want = [n, kv_heads, head_dim];
        let got = [self.batch_size(), self.kv_heads(), self.head_dim()];
        if want != got {
            return Err(Error::Shape {
                op,
                arg: "cache",
                msg: format!(
                    "the input and module need (N, Hkv, D) = {}, but the cache is {}; make it with \
                     MultiheadAttention::new_cache for this batch",
                    fmt_shape(&want),
                    fmt_shape(&got)
                ),
            });
        }
        if self.dtype() != dtype {
            return Err(Error::DType {
                op,
                arg: "cache",
                msg: format!(
                    "the cache holds {:?} but the module computes in {dtype:?}",
                    self.dtype()
                ),
            });
        }
        if !self.k.device().same_device(device) {
            return Err(Error::Config {
                op,
                arg: "cache",
                msg: format!(
                    "the cache is on {:?} but the module is on {device:?}",
                    self.k.device()
                ),
            });
        }
        Ok(())
    }

    /// Appends keys and values computed elsewhere (a saved prompt prefix, say):
    /// `k`, `v` `(N, Hkv, T, D)`, the first `counts[b]` tokens of row `b` (all `T` when
    /// `None`). They must already be projected and split into heads, as the module's
    /// projections would give them.
    pub fn append_kv(&mut self, k: &Tensor, v: &Tensor, counts: Option<&[usize]>) -> Result<()> {
        const APPEND: &str = "KvCache::append_kv";
        let t = if k.rank() == 4 { k.dims()[2] } else { 0 };
        let want = [self.batch_size(), self.kv_heads(), t, self.head_dim()];
        for (arg, x) in [("k", k), ("v", v)] {
            if x.dims() != want {
                return Err(Error::Shape {
                    op: APPEND,
                    arg,
                    msg: match k.rank() {
                        4 => format!(
                            "expected (N, Hkv, T, D) = {}, got {}",
                            fmt_shape(&want),
                            fmt_shape(x.dims())
                        ),
                        // (T is read from `k`: it has none to read.)
                        _ => format!(
                            "expected (N, Hkv, T, D) = ({}, {}, T, {}), got {}",
                            want[0],
                            want[1],
                            want[3],
                            fmt_shape(x.dims())
                        ),
                    },
                });
            }
            if x.dtype() != self.dtype() {
                return Err(Error::DType {
                    op: APPEND,
                    arg,
                    msg: format!("the cache holds {:?}, got {:?}", self.dtype(), x.dtype()),
                });
            }
        }
        let counts = match counts {
            Some(c) if c.len() != self.batch_size() || c.iter().any(|&n| n > t) => {
                return Err(Error::Shape {
                    op: APPEND,
                    arg: "counts",
                    msg: format!(
                        "expected {} counts of at most T={t}, got {c:?}",
                        self.batch_size()
                    ),
                })
            }
            Some(c) => c.to_vec(),
            None => vec![t; self.batch_size()],
        };
        self.check_room(APPEND, &counts)?;
        // Only the tokens written are read. Views are read in place, except where the last
        // dimension is strided: those tokens are copied, once the allocator has said it can
        // take them (a broadcast view of 2^38 tokens aborted the process before 2026-12-07).
        let used = counts.iter().copied().max().unwrap_or(0);
        let rows = |arg: &'static str, x: &Tensor| -> Result<Tensor> {
            let x = if used < t { x.narrow(2, 0, used)? } else { x.clone() };
            if x.dim(3)? > 1 && x.stride()[3] != 1 {
                let hint = "a view whose last dimension is strided is copied; pass it contiguous";
                crate::alloc::ensure(APPEND, arg, x.dims(), x.dtype(), 1, hint)?;
                return Ok(x.contiguous()?);
            }
            Ok(x)
        };
        self.append(&rows("k", k)?, &rows("v", v)?, &counts)
    }

    /// Writes `counts[b]` new tokens of `k`/`v` `(N, Hkv, T, D)` or `(N, T, Hkv·D)` (any
    /// strides, the last 1) after each row's last token. The caller checked room and shapes.
    pub(crate) fn append(&mut self, k: &Tensor, v: &Tensor, counts: &[usize]) -> Result<()> {
        let c = self.capacity();
        let slots = match self.window {
            Some(w) => self.positions.iter().map(|&p| p % w).collect(),
            None => self.lens.clone(),
        };
        // Nothing to write (no new token in any row, or an empty cache: no batch, no capacity
        // or no features): candle refuses in-place writes into an empty tensor, and there is
        // nothing to copy anyway.
        let empty = self.k.elem_count() == 0 || self.v.elem_count() == 0;
        if !empty && counts.iter().any(|&n| n > 0) {
            let op = Append { slots, counts: counts.to_vec(), ring: self.window.is_some() };
            self.k.inplace_op2(k, &op)?;
            self.v.inplace_op2(v, &op)?;
        }
        for (b, &n) in counts.iter().enumerate() {
            self.positions[b] += n;
            self.lens[b] =
                if self.window.is_some() { self.positions[b].min(c) } else { self.lens[b] + n };
        }
        Ok(())
    }
}
