//! Keys hidden by their index: the causal diagonal (top-left or offset), local windows and
//! per-batch key lengths. Nothing of size `L × S` is built: the kernels read only the key
//! tiles a query block can see and hide the rest of a boundary tile here.

use super::AttnParams;

/// The keys the queries of one batch entry see: query `i` sees keys `j` with
/// `i + lo <= j <= i + hi` (a missing bound is unbounded) and `j < len`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Band {
    lo: Option<isize>,
    hi: Option<isize>,
    len: usize,
}

/// How [`Band::hide`] hides an entry.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Hide {
    /// Write this value (finite heads: entries the banded products skipped are overwritten).
    Fill(f32),
    /// Add `-inf` (heads with a non-finite value: NaN stays NaN, as on the composed path).
    AddNegInf,
}

/// `x` as an `isize`, saturating (window sizes beyond `isize::MAX` are unbounded anyway).
fn signed(x: usize) -> isize {
    isize::try_from(x).unwrap_or(isize::MAX)
}

/// The keys a query block reads: with a band (a causal rule, a window, key lengths), only the
/// band's keys where the block's rows are finite (`clip`); every key otherwise, the band then
/// hidden tile by tile with `-inf` added, so that NaN reaches the output as on the composed
/// path. Shared by the forward, the backward and the weights kernels.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockKeys {
    /// Whether the block's rows are finite.
    pub(crate) finite: bool,
    /// Whether a band applies, and the band.
    pub(crate) banded: bool,
    pub(crate) band: Band,
    /// Whether the keys read are bounded by the band (`banded && finite`).
    pub(crate) clip: bool,
    /// The keys read: `start..end`.
    pub(crate) start: usize,
    pub(crate) end: usize,
}

impl BlockKeys {
    /// The keys rows `i0..i0 + br` of batch entry `b` read (validated parameters).
    pub(crate) fn of(p: &AttnParams<'_>, b: usize, (i0, br): (usize, usize), finite: bool) -> Self {
        let (banded, band) = (p.banded(), Band::of(p, b));
        let clip = banded && finite;
        let (start, end) = if clip { band.keys(i0, br) } else { (0, p.dims.s) };
        BlockKeys { finite, banded, band, clip, start, end }
    }
}

impl Band {
    /// The band of batch entry `b` (validated parameters).
    pub(crate) fn of(p: &AttnParams<'_>, b: usize) -> Band {
        let right = if p.causal { Some(0) } else { p.window.right };
        // Exact in i128, then clamped to just past the ends: queries are `0..L` and keys
        // `0..S`, so any bound beyond `-(L + 1)..=S + 1` hides (or shows) the same entries,
        // and the tiles' arithmetic stays far from overflow for any window and offset.
        let (l, s) = (p.dims.l as i128, p.dims.s as i128);
        let near = |x: i128| x.clamp(-(l + 1), s + 1) as isize;
        Band {
            lo: p.window.left.map(|w| near(p.offset as i128 - w as i128)),
            hi: right.map(|w| near(p.offset as i128 + w as i128)),
            len: p.kv_lengths.and_then(|k| k.get(b).copied()).unwrap_or(p.dims.s).min(p.dims.s),
        }
    }

    /// The keys `start..end` that some query of rows `i0..i0 + br` sees (`start >= end`:
    /// none).
    pub(crate) fn keys(&self, i0: usize, br: usize) -> (usize, usize) {
        let (first, last) = (signed(i0), signed(i0 + br.max(1) - 1));
        let clamp = |x: isize| x.clamp(0, signed(self.len)) as usize;
        let start = self.lo.map_or(0, |lo| clamp(first.saturating_add(lo)));
        let end = self.hi.map_or(self.len, |hi| clamp(last.saturating_add(hi).saturating_add(1)));
        (start, end)
    }

    /// Whether some entry of the tile (queries `i0..i0 + br`, keys `j0..j0 + bc`) is hidden.
    pub(crate) fn partial(&self, i0: usize, br: usize, j0: usize, bc: usize) -> bool {
        let (first, last) = (signed(i0), signed(i0 + br.max(1) - 1));
        let (jfirst, jlast) = (signed(j0), signed(j0 + bc.max(1) - 1));
        self.hi.is_some_and(|hi| jlast > first.saturating_add(hi))
            || self.lo.is_some_and(|lo| jfirst < last.saturating_add(lo))
            || j0 + bc > self.len
    }

    /// The query offset from which the upper bound clips a tile, for the banded products
    /// (`Tri::KEnd`): key row `r` of the tile is seen by local queries `>= r - diag` only.
    pub(crate) fn diag(&self, i0: usize, j0: usize) -> Option<isize> {
        // Clamped far beyond any tile so that the products' index arithmetic cannot overflow.
        const FAR: isize = isize::MAX / 4;
        self.hi.map(|hi| signed(i0).saturating_add(hi).saturating_sub(signed(j0)).clamp(-FAR, FAR))
    }

    /// Hides the hidden entries of a score tile (`[key][query]`, `bc` rows of stride `brp`,
    /// queries `i0..`, keys `j0..`); padding lanes may be hidden too.
    pub(crate) fn hide(
        &self,
        st: &mut [f32],
        brp: usize,
        (i0, j0, bc): (usize, usize, usize),
        how: Hide,
    ) {
        for (j, row) in st.chunks_exact_mut(brp).take(bc).enumerate() {
            let jg = signed(j0 + j);
            // Local queries `from..to` see key `jg`.
            let (from, to) = if j0 + j >= self.len {
                (0, 0)
            } else {
                let local = |x: isize| x.saturating_sub(signed(i0)).clamp(0, signed(brp)) as usize;
                let from = self.hi.map_or(0, |hi| local(jg.saturating_sub(hi)));
                let to = self.lo.map_or(brp, |lo| local(jg.saturating_sub(lo).saturating_add(1)));
                (from, to.max(from))
            };
            let (head, rest) = row.split_at_mut(from);
            for part in [head, &mut rest[to - from..]] {
                match how {
                    Hide::Fill(v) => part.fill(v),
                    Hide::AddNegInf => part.iter_mut().for_each(|x| *x += f32::NEG_INFINITY),
                }
            }
        }
    }
}
