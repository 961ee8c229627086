//! Mask tiles: the summed additive/bool masks for one (query block, key block) pair, laid out
//! like the score tile (`[key][query]`, row stride `brp`).

use super::simd::Simd;
use super::MaskView;

/// Location of a tile: batch `b`, query head `h`, queries `i0..i0+br` (columns, padded to
/// `brp` with zeros), keys `j0..j0+bc` (rows).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TilePos {
    pub b: usize,
    pub h: usize,
    pub i0: usize,
    pub br: usize,
    pub brp: usize,
    pub j0: usize,
    pub bc: usize,
}

/// Writes (`ADD = false`) or adds (`ADD = true`) one mask's tile; `conv` turns an element into
/// its additive value.
#[inline(always)]
fn one_mask<T: Copy, const ADD: bool>(
    data: &[T],
    conv: impl Fn(T) -> f32,
    st: [usize; 4],
    t: TilePos,
    mt: &mut [f32],
) {
    let base = t.b * st[0] + t.h * st[1];
    if st[2] == 0 {
        // Broadcast over queries (e.g. a key-padding mask): one value per key row.
        for j in 0..t.bc {
            let val = conv(data[base + (t.j0 + j) * st[3]]);
            let row = &mut mt[j * t.brp..j * t.brp + t.br];
            if ADD {
                row.iter_mut().for_each(|x| *x += val);
            } else {
                row.fill(val);
            }
        }
        return;
    }
    // 16 query columns at a time: 16 sequential read streams (along keys when the mask is
    // row-major), one contiguous 64-byte write per key row.
    let mut ib = 0;
    while ib < t.br {
        let ie = (ib + 16).min(t.br);
        for j in 0..t.bc {
            let off = base + (t.j0 + j) * st[3] + (t.i0 + ib) * st[2];
            let row = &mut mt[j * t.brp + ib..j * t.brp + ie];
            for (ii, x) in row.iter_mut().enumerate() {
                let val = conv(data[off + ii * st[2]]);
                if ADD {
                    *x += val;
                } else {
                    *x = val;
                }
            }
        }
        ib = ie;
    }
}

#[inline(always)]
fn bool_value(masked_when: bool) -> impl Fn(u8) -> f32 {
    move |x: u8| if (x != 0) == masked_when { f32::NEG_INFINITY } else { 0.0 }
}

/// Writes `mask0 + mask1` for the tile into `mt` (`bc` rows of `brp`); returns how many of
/// the tile's keys lead up to its last key with a real entry other than `-inf` (0: every entry
/// is `-inf`). The keys after it have probabilities exactly 0 for every query of the block, so
/// when the head is finite the kernels skip them: a whole block, or the padded end of a
/// sequence under a key padding mask. The masks' bounds were validated by the entry point.
///
/// # Safety
/// `S` is available; `mt` holds `bc * brp` floats.
#[inline(always)]
pub(crate) unsafe fn build_mask_tile<S: Simd>(
    masks: &[Option<MaskView<'_>>; 2],
    t: TilePos,
    mt: &mut [f32],
) -> usize {
    assert!(mt.len() >= t.bc * t.brp);
    let mut first = true;
    for m in masks.iter().flatten() {
        match (*m, first) {
            (MaskView::Additive { data, strides }, _) if strides[3] == 1 && strides[2] != 0 => {
                // A row-major float mask: a (vectorised) transpose of its [query][key] block.
                let off = t.b * strides[0] + t.h * strides[1] + t.i0 * strides[2] + t.j0;
                // The block's last element is in bounds (validated by the entry point).
                let last = off + (t.br - 1) * strides[2] + t.bc - 1;
                assert!(last < data.len());
                // SAFETY: rows `i < br` of `bc` floats from `off` lie inside `data` (checked
                // above); `mt` has `bc` rows of `brp >= br` floats.
                unsafe {
                    S::transpose(
                        mt.as_mut_ptr(),
                        t.brp,
                        data.as_ptr().add(off),
                        strides[2],
                        t.br,
                        t.bc,
                        1.0,
                        !first,
                    )
                }
            }
            (MaskView::Additive { data, strides }, true) => {
                one_mask::<f32, false>(data, |x| x, strides, t, mt)
            }
            (MaskView::Additive { data, strides }, false) => {
                one_mask::<f32, true>(data, |x| x, strides, t, mt)
            }
            (MaskView::Bool { data, strides, true_means_masked }, true) => {
                one_mask::<u8, false>(data, bool_value(true_means_masked), strides, t, mt)
            }
            (MaskView::Bool { data, strides, true_means_masked }, false) => {
                one_mask::<u8, true>(data, bool_value(true_means_masked), strides, t, mt)
            }
        }
        if first && t.br < t.brp {
            for j in 0..t.bc {
                mt[j * t.brp + t.br..(j + 1) * t.brp].fill(0.0);
            }
        }
        first = false;
    }
    let live = |r: &[f32]| r[..t.br].iter().any(|&x| x != f32::NEG_INFINITY);
    mt.chunks_exact(t.brp).take(t.bc).rposition(live).map_or(0, |j| j + 1)
}

/// [`build_mask_tile`] for masks that are the same for every query (`strides[2] == 0` for
/// each): writes `mask0 + mask1` once per key into `mk[0..bc]` and returns the same count of
/// keys up to the last visible one.
#[inline(always)]
pub(crate) fn build_mask_keys(
    masks: &[Option<MaskView<'_>>; 2],
    t: TilePos,
    mk: &mut [f32],
) -> usize {
    let mk = &mut mk[..t.bc];
    let mut first = true;
    for m in masks.iter().flatten() {
        let (st, conv): ([usize; 4], &dyn Fn(usize) -> f32) = match m {
            MaskView::Additive { data, strides } => (*strides, &|i| data[i]),
            MaskView::Bool { data, strides, true_means_masked } => {
                (*strides, &|i| bool_value(*true_means_masked)(data[i]))
            }
        };
        let base = t.b * st[0] + t.h * st[1];
        for (j, x) in mk.iter_mut().enumerate() {
            let val = conv(base + (t.j0 + j) * st[3]);
            *x = if first { val } else { *x + val };
        }
        first = false;
    }
    mk.iter().rposition(|&x| x != f32::NEG_INFINITY).map_or(0, |j| j + 1)
}
