//! 64-byte aligned views of growable buffers.
//!
//! The AMX tile loads and stores read and write 16 rows of 64 bytes; where those rows
//! straddle two cache lines each, they run at a third of their rate. Measured on an AMX CPU
//! (family 6 model 167 under KVM), one core, a 2 × 2 tile step (four `tileloadd`, four
//! `tdpbf16ps`) from L1: 0.93 TFLOP/s with its operands 16 bytes past a line (where glibc's
//! allocator puts a large `Vec`; mimalloc's large blocks happen to start on one), 2.66 aligned.
//! Every buffer that the tiles load goes through [`aligned_mut`] or is an [`AlignedTile`].

/// Bytes of a cache line.
pub(crate) const LINE: usize = 64;

/// `len` elements of `v` from its first 64-byte boundary, growing `v` (fallibly) to hold
/// them; `None` where that cannot be allocated. What the elements hold after growing is
/// unspecified (they are not moved with the boundary).
pub(crate) fn aligned_mut<T: Copy + Default>(v: &mut Vec<T>, len: usize) -> Option<&mut [T]> {
    let spare = LINE / std::mem::size_of::<T>().max(1);
    let need = len.checked_add(spare)?;
    if v.len() < need {
        v.try_reserve_exact(need - v.len()).ok()?;
        v.resize(need, T::default());
    }
    let off = line_offset(v);
    v.get_mut(off..off + len)
}

/// Where [`aligned_mut`]'s view of `v` starts (elements from its start).
pub(crate) fn line_offset<T>(v: &[T]) -> usize {
    v.as_ptr().align_offset(LINE).min(LINE / std::mem::size_of::<T>().max(1))
}

/// A tile of `N` f32 values on a 64-byte boundary.
#[repr(C, align(64))]
pub(crate) struct AlignedTile<const N: usize>(pub(crate) [f32; N]);

impl<const N: usize> AlignedTile<N> {
    /// A tile of zeros.
    pub(crate) fn zeros() -> Self {
        AlignedTile([0.0; N])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_start_on_a_line_and_hold_len() {
        let mut v: Vec<u16> = Vec::new();
        for len in [0, 1, 31, 32, 33, 1000, 4096] {
            let s = aligned_mut(&mut v, len).expect("small buffers allocate");
            assert_eq!(s.len(), len);
            assert_eq!(s.as_ptr() as usize % LINE, 0, "len {len}");
        }
        let mut w: Vec<u32> = Vec::with_capacity(3);
        let s = aligned_mut(&mut w, 100).expect("small buffers allocate");
        assert_eq!((s.len(), s.as_ptr() as usize % LINE), (100, 0));
        assert!(aligned_mut(&mut w, usize::MAX).is_none());
        let t = AlignedTile::<64>::zeros();
        assert_eq!(t.0.as_ptr() as usize % LINE, 0);
        assert!(t.0.iter().all(|&x| x == 0.0));
    }
}
