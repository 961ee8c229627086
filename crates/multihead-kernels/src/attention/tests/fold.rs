//! The softmax pass with its scale folded into the max and the exp ([`ScoreMods::folded_scale`])
//! against the same pass over scores scaled first: the same bits of `P` (f32 tiles and bf16
//! pair words), the running max, sum and rescaling factors, at every SIMD level.
//!
//! A child of `forward` (its pass is private there), kept beside the other attention tests.

use super::*;
use crate::attention::SimdLevel;
use crate::testutil::{levels, rand_vec};

/// Queries per tile (lanes), keys per tile.
const LANES: usize = 32;
const KEYS: usize = 13;

/// The pass's outputs: `P` (the tile, or the pair words), then max, sum and alpha.
type Outputs = (Vec<u32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// Two key blocks through `softmax_tile` at level `S`, each tile's scores `x` (keys as rows of
/// `LANES`), with `scale` as the only modification.
///
/// # Safety
/// The CPU runs `S`.
unsafe fn two_blocks<S: Simd>(tiles: [&[f32]; 2], scale: f32, pack: bool) -> Outputs {
    let (mut max, mut sum, mut alpha) = (vec![f32::MIN; LANES], vec![0.0; LANES], vec![0.0; LANES]);
    let mut out = Vec::new();
    for x in tiles {
        let mut st = x.to_vec();
        let mut pw = vec![0u32; KEYS.div_ceil(2) * bf::MAX_LANES];
        let tile = ScoreTile { st: st.as_mut_ptr(), brp: LANES, nvec: LANES / S::LANES, bc: KEYS };
        let mods = ScoreMods { scale, cap: None, mask: None, alibi: None };
        let mut run = Running { max: &mut max, sum: &mut sum, alpha: &mut alpha };
        let words = pack.then_some(pw.as_mut_ptr());
        // SAFETY: the tile holds `KEYS · LANES` floats, the running slices `LANES`, the pair
        // words `KEYS.div_ceil(2)` rows of `MAX_LANES >= LANES`; the CPU runs `S` (caller).
        unsafe { softmax_tile::<S>(&tile, &mods, &mut run, None, words) };
        match pack {
            true => out.extend(pw),
            false => out.extend(st.iter().map(|v| v.to_bits())),
        }
    }
    (out, max, sum, alpha)
}

/// [`two_blocks`] at `level`.
fn at_level(level: SimdLevel, tiles: [&[f32]; 2], scale: f32, pack: bool) -> Outputs {
    use super::super::simd::Scalar;
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512dq,avx512bw,avx512vl")]
    unsafe fn run512(tiles: [&[f32]; 2], scale: f32, pack: bool) -> Outputs {
        // SAFETY: the features are enabled here (the caller checked the level).
        unsafe { two_blocks::<super::super::simd::Avx512>(tiles, scale, pack) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run256(tiles: [&[f32]; 2], scale: f32, pack: bool) -> Outputs {
        // SAFETY: as above.
        unsafe { two_blocks::<super::super::simd::Avx2>(tiles, scale, pack) }
    }
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `levels()` yields only the levels this CPU runs.
        SimdLevel::Avx512 => unsafe { run512(tiles, scale, pack) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        SimdLevel::Avx2 => unsafe { run256(tiles, scale, pack) },
        // SAFETY: the scalar level runs everywhere.
        _ => unsafe { two_blocks::<Scalar>(tiles, scale, pack) },
    }
}

/// Scores in `±scale` with awkward values: −inf entries, a lane of −inf throughout, a NaN, a
/// +inf, subnormal and tiny scores, and a lane whose second block raises its max.
fn scores(seed: u64, spread: f32) -> Vec<f32> {
    let mut x: Vec<f32> = rand_vec(KEYS * LANES, seed).iter().map(|v| v * spread).collect();
    for j in 0..KEYS {
        x[j * LANES + 3] = f32::NEG_INFINITY; // a lane without a key
        x[j * LANES + 7] = 1e-39 * (j as f32 - 6.0); // subnormal scores
        x[j * LANES + 8] = 1e-37 * (j as f32 + 1.0); // tiny normal ones
    }
    x[2 * LANES + 5] = f32::NEG_INFINITY;
    x[4 * LANES + 11] = f32::NAN;
    x[6 * LANES + 12] = f32::INFINITY;
    x[9 * LANES + 20] = 1e30;
    x
}

/// Equal bits, any NaN equal to any NaN.
fn same(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || x.is_nan() && y.is_nan())
}

#[test]
fn a_folded_power_of_two_scale_gives_the_bits_of_the_scaled_scores() {
    for &scale in &[0.125f32, 0.5, 0.0625, 2f32.powi(-20)] {
        for (seed, spread) in [(1u64, 8.0f32), (2, 200.0), (3, 1e-3)] {
            let raw = [scores(seed, spread), scores(seed + 10, spread * 3.0)];
            let scaled: Vec<Vec<f32>> =
                raw.iter().map(|t| t.iter().map(|v| v * scale).collect()).collect();
            for level in levels() {
                for pack in [false, true] {
                    let folded = at_level(level, [&raw[0], &raw[1]], scale, pack);
                    let first = at_level(level, [&scaled[0], &scaled[1]], 1.0, pack);
                    let what = format!("scale {scale}, seed {seed}, {level:?}, pack {pack}");
                    let p_same = folded.0.iter().zip(&first.0).all(|(a, b)| {
                        let (a, b) = (f32::from_bits(*a), f32::from_bits(*b));
                        same(&[a], &[b])
                    });
                    assert!(p_same, "P differs: {what}");
                    assert!(same(&folded.1, &first.1), "max differs: {what}");
                    assert!(same(&folded.2, &first.2), "sum differs: {what}");
                    assert!(same(&folded.3, &first.3), "alpha differs: {what}");
                    // Not all 0 or 1: the pass did work.
                    let p = folded.0.iter().map(|w| f32::from_bits(*w));
                    let between = p.filter(|p| *p > 1e-6 && *p < 1.0).count();
                    assert!(
                        pack || scale * spread < 1e-4 || between >= 20,
                        "{between} probabilities in (0, 1): {what}"
                    );
                }
            }
        }
    }
}

#[test]
fn only_a_power_of_two_below_one_with_nothing_else_is_folded() {
    let mods = |scale: f32| ScoreMods { scale, cap: None, mask: None, alibi: None };
    for s in [0.5f32, 0.125, 2f32.powi(-126)] {
        assert_eq!(mods(s).folded_scale(), Some(s));
    }
    let not = [1.0f32, 2.0, 0.176_776_7, 0.0, -0.125, 2f32.powi(-130), f32::NAN, f32::INFINITY];
    for s in not {
        assert_eq!(mods(s).folded_scale(), None, "scale {s}");
    }
    let mask = [0.0f32; 4];
    let masked =
        ScoreMods { scale: 0.125, cap: None, mask: Some((mask.as_ptr(), true)), alibi: None };
    assert_eq!(masked.folded_scale(), None);
    let capped = ScoreMods { scale: 0.125, cap: Some(30.0), mask: None, alibi: None };
    assert_eq!(capped.folded_scale(), None);
}
