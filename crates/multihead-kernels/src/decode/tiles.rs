//! The decode kernel's inner products, register-tiled over the query rows that see the same
//! keys: the query heads of one token under grouped-query attention, or the rows of a prefill
//! chunk (with a causal rule their keys start together and end a few keys apart). Each key
//! and value vector is loaded once for up to [`max_rows`] rows instead of once per row.
//!
//! Every lane of every row goes through exactly the operations of the one-row kernel, in the
//! same order (one fused multiply-add chain per key over `d`, the same lane-sum network per
//! group of `LANES` keys; even and odd keys in two chains per value column), so the result of
//! a row does not depend on how many rows share its tile: the bits are those of the row
//! alone.

use std::mem::MaybeUninit;

use crate::attention::simd::Simd;
use crate::elem::{dot as dot_e, Elem};

/// The most rows one tile takes at this SIMD level: four with 32 vector registers (16 score
/// accumulators), two with 16.
#[inline(always)]
pub(super) fn max_rows<S: Simd>() -> usize {
    if S::LANES >= 16 {
        4
    } else {
        2
    }
}

/// A strided run of `E` rows: row `j` starts at `base + j·stride`.
#[derive(Clone, Copy)]
pub(super) struct Rows<E> {
    pub base: *const E,
    pub stride: usize,
}

impl<E> Rows<E> {
    /// Row `j`.
    ///
    /// # Safety
    /// Row `j` lies inside the allocation `base` points into.
    #[inline(always)]
    pub unsafe fn at(self, j: usize) -> *const E {
        // SAFETY: forwarded from the caller.
        unsafe { self.base.add(j * self.stride) }
    }
}

/// `out[r][j] = q_r · key(j)` for `j < n[r]` and the `R` rows `r`: `LANES` keys at a time,
/// four keys per pass over `d`, all rows' products of a key vector from one load; each row's
/// `LANES` lane sums reduced together. The rows share keys `0..max(n)` (a causal prefill's
/// rows end at different keys): a row's keys past its own last whole group of `LANES` are
/// summed one at a time, as they are when the row runs alone. A row's slots from `n[r]` to
/// `max(n)` are written and hold nothing of use.
///
/// # Safety
/// `S`'s instruction set is available; `q[r]` has `d` readable floats and `out[r]` `max(n)`
/// writable ones; keys `0..max(n)` of `keys` have `d` readable elements each.
#[inline(always)]
pub(super) unsafe fn scores<S: Simd, E: Elem, const R: usize>(
    q: [*const f32; R],
    d: usize,
    keys: Rows<E>,
    n: [usize; R],
    out: [*mut f32; R],
) {
    let l = S::LANES;
    let most = n.iter().copied().max().unwrap_or(0);
    // SAFETY: every pointer formed below stays inside the rows the caller vouches for; `accs`
    // holds 16 >= LANES vectors per row.
    unsafe {
        // Not zeroed: each group of keys writes the first `LANES` vectors of every row before
        // they are read (zeroing 16·R vectors per call was 1.7% of a prefill step).
        let mut accs = [[MaybeUninit::<S::V>::uninit(); 16]; R];
        let mut j = 0;
        while j + l <= most {
            let mut i = 0;
            while i + 4 <= l {
                let ks =
                    [keys.at(j + i), keys.at(j + i + 1), keys.at(j + i + 2), keys.at(j + i + 3)];
                let acc = dot4_rows::<S, E, R>(q, ks, d);
                for r in 0..R {
                    for (slot, &a) in accs[r][i..i + 4].iter_mut().zip(&acc[r]) {
                        slot.write(a);
                    }
                }
                i += 4;
            }
            for r in 0..R {
                for (ii, acc) in accs[r].iter_mut().enumerate().take(l).skip(i) {
                    acc.write(dot_e::<S, E>(q[r], keys.at(j + ii), d));
                }
                // The first `LANES` vectors of row `r` were written just above.
                S::reduce_many(accs[r].as_ptr().cast::<S::V>(), out[r].add(j));
            }
            j += l;
        }
        for r in 0..R {
            // The keys a shorter row sums one at a time (past its last whole group).
            let from = if n[r] < most { n[r] - n[r] % l } else { j };
            for jj in from..n[r] {
                *out[r].add(jj) = S::reduce_add(dot_e::<S, E>(q[r], keys.at(jj), d));
            }
        }
    }
}

/// The partial sums of the dot products `q_r · k_i` (four keys, `R` rows) over `n` floats, in
/// one pass: each key vector is loaded once for all rows, each query vector once for all keys.
///
/// # Safety
/// `S`'s instruction set is available; `n` readable floats at each `q[r]` and elements at
/// each `k[i]`.
#[inline(always)]
unsafe fn dot4_rows<S: Simd, E: Elem, const R: usize>(
    q: [*const f32; R],
    k: [*const E; 4],
    n: usize,
) -> [[S::V; 4]; R] {
    let l = S::LANES;
    // SAFETY: the caller guarantees `n` readable floats at each `q[r]` and elements at each
    // `k[i]`; the tail is masked.
    unsafe {
        let mut acc = [[S::splat(0.0); 4]; R];
        let mut c = 0;
        while c + l <= n {
            // Loops, not `map`: closures do not inherit the caller's target features.
            let mut kv = [S::splat(0.0); 4];
            for (v, kp) in kv.iter_mut().zip(k) {
                *v = E::load::<S>(kp.add(c));
            }
            for r in 0..R {
                let qv = S::load(q[r].add(c));
                for (a, &kv) in acc[r].iter_mut().zip(&kv) {
                    *a = S::fma(qv, kv, *a);
                }
            }
            c += l;
        }
        if c < n {
            let mask = S::tail_mask(n - c);
            let mut kv = [S::splat(0.0); 4];
            for (v, kp) in kv.iter_mut().zip(k) {
                *v = E::load_n::<S>(kp.add(c), n - c, mask);
            }
            for r in 0..R {
                let qv = S::load_m(q[r].add(c), mask);
                for (a, &kv) in acc[r].iter_mut().zip(&kv) {
                    *a = S::fma(qv, kv, *a);
                }
            }
        }
        acc
    }
}

/// `acc_r[c] += Σ_j p_r[j]·value(j)[c]` for `j < n[r]` and the `R` rows: per value column,
/// even and odd `j` in two register chains per row, added to `acc_r` at the end. Columns go in
/// blocks of `NB` vectors (no masks) and then one masked block for the rest. A value row is
/// read only if some row of the tile sees it.
///
/// # Safety
/// `S`'s instruction set is available; `p[r]` has `n[r]` readable floats, `acc[r]` `dv`
/// writable ones, and values `0..max(n)` of `values` `dv` readable elements each.
#[inline(always)]
pub(super) unsafe fn weighted<S: Simd, E: Elem, const R: usize, const NB: usize>(
    p: [*const f32; R],
    n: [usize; R],
    values: Rows<E>,
    acc: [*mut f32; R],
    dv: usize,
) {
    let l = S::LANES;
    let mut c = 0;
    // SAFETY: forwarded from the caller; blocks stay inside `dv`.
    unsafe {
        while c + NB * l <= dv {
            weighted_block::<S, E, R, NB>(p, n, values, acc, c, [S::full_mask(); NB], [l; NB]);
            c += NB * l;
        }
        while c < dv {
            // Not a closure: closures do not inherit the caller's target features.
            let mut masks = [S::full_mask(); NB];
            let mut live = [0; NB];
            for (b, (m, w)) in masks.iter_mut().zip(&mut live).enumerate() {
                let at = (c + b * l).min(dv);
                *w = (dv - at).min(l);
                if *w > 0 && *w < l {
                    *m = S::tail_mask(*w);
                }
            }
            weighted_block::<S, E, R, NB>(p, n, values, acc, c, masks, live);
            c += NB * l;
        }
    }
}

/// The `live` columns of `row` from column `c` (all `LANES` when `full`).
///
/// # Safety
/// As for [`weighted_block`].
#[inline(always)]
unsafe fn load<S: Simd, E: Elem>(
    row: *const E,
    c: usize,
    full: bool,
    live: usize,
    mask: S::M,
) -> S::V {
    // SAFETY: forwarded from the caller.
    unsafe {
        if full {
            E::load::<S>(row.add(c))
        } else {
            E::load_n::<S>(row.add(c), live, mask)
        }
    }
}

/// One block of `NB` value vectors at column `c` of [`weighted`]: vector `b` covers `live[b]`
/// columns (`masks[b]`); a vector with no live column loads and stores nothing.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn weighted_block<S: Simd, E: Elem, const R: usize, const NB: usize>(
    p: [*const f32; R],
    n: [usize; R],
    values: Rows<E>,
    acc: [*mut f32; R],
    c: usize,
    masks: [S::M; NB],
    live: [usize; NB],
) {
    let l = S::LANES;
    let full = live.iter().all(|&w| w == l);
    // SAFETY: the caller guarantees the value rows and accumulators cover `c + live[b]`
    // columns of vector `b`; masked accesses stay inside them.
    unsafe {
        let (mut even, mut odd) = ([[S::splat(0.0); NB]; R], [[S::splat(0.0); NB]; R]);
        let (fewest, most) =
            (n.iter().copied().min().unwrap_or(0), n.iter().copied().max().unwrap_or(0));
        let mut j = 0;
        // Pairs every row sees.
        while j + 2 <= fewest {
            let (re, ro) = (values.at(j), values.at(j + 1));
            let mut ve = [S::splat(0.0); NB];
            let mut vo = [S::splat(0.0); NB];
            for b in 0..NB {
                if live[b] > 0 {
                    ve[b] = load::<S, E>(re, c + b * l, full, live[b], masks[b]);
                    vo[b] = load::<S, E>(ro, c + b * l, full, live[b], masks[b]);
                }
            }
            for r in 0..R {
                let (pe, po) = (S::splat(*p[r].add(j)), S::splat(*p[r].add(j + 1)));
                for b in 0..NB {
                    even[r][b] = S::fma(pe, ve[b], even[r][b]);
                    odd[r][b] = S::fma(po, vo[b], odd[r][b]);
                }
            }
            j += 2;
        }
        // The rest, row by row: a pair, or a last even key, as far as each row sees. (The
        // loads are written out in both loops on purpose: a helper returning the `NB` vectors
        // as an array made a 512-token prefill 1.36x slower at one thread.)
        while j < most {
            let pair = j + 1 < most;
            let (re, ro) = (values.at(j), values.at(j + pair as usize));
            let mut ve = [S::splat(0.0); NB];
            let mut vo = [S::splat(0.0); NB];
            for b in 0..NB {
                if live[b] > 0 {
                    ve[b] = load::<S, E>(re, c + b * l, full, live[b], masks[b]);
                    if pair {
                        vo[b] = load::<S, E>(ro, c + b * l, full, live[b], masks[b]);
                    }
                }
            }
            for r in 0..R {
                if j + 2 <= n[r] {
                    let (pe, po) = (S::splat(*p[r].add(j)), S::splat(*p[r].add(j + 1)));
                    for b in 0..NB {
                        even[r][b] = S::fma(pe, ve[b], even[r][b]);
                        odd[r][b] = S::fma(po, vo[b], odd[r][b]);
                    }
                } else if j < n[r] {
                    let pe = S::splat(*p[r].add(j));
                    for b in 0..NB {
                        even[r][b] = S::fma(pe, ve[b], even[r][b]);
                    }
                }
            }
            j += 2;
        }
        for r in 0..R {
            for b in (0..NB).filter(|&b| live[b] > 0) {
                let at = acc[r].add(c + b * l);
                let sum = S::add(S::load_m(at, masks[b]), S::add(even[r][b], odd[r][b]));
                S::store_m(at, sum, masks[b]);
            }
        }
    }
}

/// Splits a block's rows into runs of consecutive rows whose keys of a chunk start at the same
/// key (`lo[i]`) and are not empty (`lo[i] < len[i]`; the ends may differ, as a causal
/// prefill's rows do, by less than `SPREAD`), each at most `max` rows: `(first row, rows)` and
/// the number of runs.
pub(super) fn runs_of<const N: usize>(
    lo: &[usize; N],
    len: &[usize; N],
    max: usize,
) -> ([(usize, usize); N], usize) {
    /// Rows whose ends differ by more go in separate runs (the shorter would compute
    /// scores it does not use).
    const SPREAD: usize = 16;
    let (mut runs, mut n) = ([(0, 0); N], 0);
    let mut i = 0;
    while i < N {
        if len[i] == 0 {
            i += 1;
            continue;
        }
        let (mut e, mut lowest, mut highest) = (i + 1, len[i], len[i]);
        while e < N && e - i < max && len[e] > 0 && lo[e] == lo[i] {
            let (lw, hg) = (lowest.min(len[e]), highest.max(len[e]));
            if hg - lw >= SPREAD {
                break;
            }
            (lowest, highest) = (lw, hg);
            e += 1;
        }
        runs[n] = (i, e - i);
        n += 1;
        i = e;
    }
    (runs, n)
}

/// [`scores`] for `rows` (1 to 4) rows: row `r`'s query at `q(r)`, its `n(r)` scores to
/// `out(r)`.
///
/// # Safety
/// As for [`scores`], for every `r < rows`.
#[inline(always)]
pub(super) unsafe fn run_scores<S: Simd, E: Elem>(
    rows: usize,
    q: impl Fn(usize) -> *const f32,
    d: usize,
    keys: Rows<E>,
    n: impl Fn(usize) -> usize,
    out: impl Fn(usize) -> *mut f32,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match rows {
            1 => scores::<S, E, 1>([q(0)], d, keys, [n(0)], [out(0)]),
            2 => scores::<S, E, 2>([q(0), q(1)], d, keys, [n(0), n(1)], [out(0), out(1)]),
            3 => scores::<S, E, 3>(
                [q(0), q(1), q(2)],
                d,
                keys,
                [n(0), n(1), n(2)],
                [out(0), out(1), out(2)],
            ),
            _ => scores::<S, E, 4>(
                [q(0), q(1), q(2), q(3)],
                d,
                keys,
                [n(0), n(1), n(2), n(3)],
                [out(0), out(1), out(2), out(3)],
            ),
        }
    }
}

/// [`weighted`] for `rows` (1 to 4) rows: row `r`'s `n(r)` probabilities at `p(r)`, its
/// accumulators at `acc(r)`. Four value vectors per block for up to two rows, two for more
/// (and for any row count on 16 registers).
///
/// # Safety
/// As for [`weighted`], for every `r < rows`.
#[inline(always)]
pub(super) unsafe fn run_weighted<S: Simd, E: Elem>(
    rows: usize,
    p: impl Fn(usize) -> *const f32,
    n: impl Fn(usize) -> usize,
    values: Rows<E>,
    acc: impl Fn(usize) -> *mut f32,
    dv: usize,
) {
    let wide = S::LANES >= 16;
    // SAFETY: forwarded from the caller.
    unsafe {
        match rows {
            1 if wide => weighted::<S, E, 1, 4>([p(0)], [n(0)], values, [acc(0)], dv),
            1 => weighted::<S, E, 1, 2>([p(0)], [n(0)], values, [acc(0)], dv),
            2 if wide => {
                weighted::<S, E, 2, 4>([p(0), p(1)], [n(0), n(1)], values, [acc(0), acc(1)], dv)
            }
            2 => weighted::<S, E, 2, 2>([p(0), p(1)], [n(0), n(1)], values, [acc(0), acc(1)], dv),
            3 => weighted::<S, E, 3, 2>(
                [p(0), p(1), p(2)],
                [n(0), n(1), n(2)],
                values,
                [acc(0), acc(1), acc(2)],
                dv,
            ),
            _ => weighted::<S, E, 4, 2>(
                [p(0), p(1), p(2), p(3)],
                [n(0), n(1), n(2), n(3)],
                values,
                [acc(0), acc(1), acc(2), acc(3)],
                dv,
            ),
        }
    }
}
