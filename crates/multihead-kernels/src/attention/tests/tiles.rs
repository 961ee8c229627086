//! The attention's bf16 products in the AMX tile layout: each product on the tile kernels
//! (their exact emulation everywhere, the real tiles where granted) equals the sequential
//! emulation of `tdpbf16ps` over the same rounded operands bit for bit, at awkward sizes, with
//! the scratch sized exactly as the tasks size it (nothing written past it).

use crate::attention::backward::{BlockGrads, BwdBf16};
use crate::attention::bf16::{self as bf, Scores, Shape, Values};
use crate::bf16gemm::amx::{amx_available, tdp_element, AMX_KP};
use crate::bf16gemm::micro::Kernel;
use crate::bf16gemm::NR;
use crate::convert::f32_to_bf16_bits as round;
use crate::testutil::rand_vec;

/// The tile kernels this CPU runs: the emulation everywhere, AMX where granted.
fn tile_kernels() -> Vec<Kernel> {
    let mut v = vec![Kernel::AmxEmulated];
    #[cfg(target_arch = "x86_64")]
    if amx_available() {
        v.push(Kernel::Amx);
    } else {
        eprintln!("AMX tiles are not granted on this CPU: the attention tiles ran on their emulation only");
    }
    v
}

/// `acc` plus the pairs of two length-`n` rows (given as functions of the index) by
/// `tdp_element`, 16 pairs at a time, through the kernel's padded depth (zero pairs).
fn tdp_dot(
    sh: Shape,
    n: usize,
    a: impl Fn(usize) -> f32,
    b: impl Fn(usize) -> f32,
    acc: f32,
) -> f32 {
    let word = |f: &dyn Fn(usize) -> f32, p: usize| {
        let at = |i: usize| if i < n { round(f(i)) } else { 0 };
        u32::from(at(2 * p)) | (u32::from(at(2 * p + 1)) << 16)
    };
    (0..sh.kp(n.div_ceil(2)))
        .step_by(AMX_KP)
        .fold(acc, |acc, p0| tdp_element(acc, |p| (word(&a, p0 + p), word(&b, p0 + p))))
}

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.to_bits() == w.to_bits(), "{what}: element {i}: {g:e} vs {w:e}");
    }
}

/// NaN-filled buffers of the given sizes (f32 units) with 16 floats of slack each: an element
/// read before it is written shows as NaN, one written past the size as a changed slack.
fn buffers(sizes: &[usize]) -> Vec<Vec<f32>> {
    sizes.iter().map(|&n| vec![f32::NAN; n + 16]).collect()
}

fn slack_intact(bufs: &[Vec<f32>], sizes: &[usize], what: &str) {
    for (i, (b, &n)) in bufs.iter().zip(sizes).enumerate() {
        assert!(
            b[n..].iter().all(|x| x.is_nan()),
            "{what}: buffer {i} written past its {n} floats"
        );
    }
}

/// Awkward shapes: `(keys bc, d, dv, queries br)`.
const SHAPES: [(usize, usize, usize, usize); 6] = [
    (1, 1, 1, 1),
    (17, 5, 3, 16),
    (33, 32, 17, 33),
    (70, 33, 40, 64),
    (64, 64, 64, 48),
    (40, 16, 80, 31),
];

/// One case of the tile tests: a tile kernel (its tiles configured while the case runs),
/// its shape, the sizes (`brp`: `br` padded to whole 16-lane vectors) and a label.
struct Case<'a> {
    kern: Kernel,
    sh: Shape,
    bc: usize,
    d: usize,
    dv: usize,
    br: usize,
    brp: usize,
    what: &'a str,
}

/// Runs `f` on every tile kernel and every size of [`SHAPES`].
fn each_case(mut f: impl FnMut(Case<'_>)) {
    for kern in tile_kernels() {
        let _tiles = kern.begin();
        let sh = Shape::of(kern);
        for (bc, d, dv, br) in SHAPES {
            let what = format!("{kern:?} bc={bc} d={d} dv={dv} br={br}");
            let brp = br.div_ceil(16) * 16;
            f(Case { kern, sh, bc, d, dv, br, brp, what: &what });
        }
    }
}

/// `Sᵀ = scale · K Qᵀ` and `Oᵀ = Vᵀ Pᵀ` (then `+=` a second time), the forward's products.
#[test]
fn forward_products_on_tiles_equal_the_sequential_emulation() {
    each_case(|Case { kern, sh, bc, d, dv, br, brp, what }| {
        let (ld, ldv) = (d + 3, dv + 5);
        let (k, q, v) = (rand_vec(bc * ld, 1), rand_vec(br * d, 2), rand_vec(bc * ldv, 3));
        let sizes = bf::scratch(kern, bc, d, dv);
        let mut buf = buffers(&sizes);
        let [qp, kb, vw, pw, ot] = [0, 1, 2, 3, 4].map(|i| buf[i].as_mut_ptr());
        let (qp, kb, vw, pw) = (qp as *mut u32, kb as *mut u16, vw as *mut u32, pw as *mut u32);
        let mut st = vec![f32::NAN; bc * brp];
        let scale = 0.37f32;
        // SAFETY: the buffers are sized by `scratch` for these `bc`, `d`, `dv` and the
        // kernel; the rows and panels read below exist.
        unsafe {
            bf::pack_q(q.as_ptr(), d, br, d, (qp, sh.kp(d.div_ceil(2))));
            let sc = Scores { k: k.as_ptr(), ld, bc, d, qp, scale, st: st.as_mut_ptr(), brp, kb };
            bf::scores(kern, &sc);
        }
        let q = &q;
        let want: Vec<f32> = (0..bc * brp)
            .map(|x| {
                let (j, i) = (x / brp, x % brp);
                let qi = |c: usize| if i < br { q[i * d + c] } else { 0.0 };
                tdp_dot(sh, d, |c| k[j * ld + c], qi, 0.0) * scale
            })
            .collect();
        same_bits(&st, &want, &format!("{what}: scores"));

        let mut otv = vec![0f32; dv * NR];
        for accumulate in [false, true] {
            let x = Values {
                st: st.as_ptr(),
                brp,
                bc,
                v: v.as_ptr(),
                ld: ldv,
                dv,
                ot,
                accumulate,
                vw,
                pw,
                v_keys: bc,
                p_packed: false,
            };
            // SAFETY: as above; `ot` holds `dv` rounded to `MR` rows of `NR` floats.
            unsafe { bf::values(kern, &x) };
            for c in 0..dv {
                for i in 0..NR {
                    let pi = |j: usize| if i < brp { st[j * brp + i] } else { 0.0 };
                    let acc = if accumulate { otv[c * NR + i] } else { 0.0 };
                    otv[c * NR + i] = tdp_dot(sh, bc, |j| v[j * ldv + c], pi, acc);
                }
            }
            same_bits(
                &buf[4][..dv * NR],
                &otv,
                &format!("{what}: values, accumulate={accumulate}"),
            );
        }
        slack_intact(&buf, &sizes, what);
    });
}

/// The backward's gradient products of one tile: `dV_j += Pᵀ dO_i`, `dK_j += dSᵀ Q_i` and
/// `dQᵀ (+)= K_jᵀ dSᵀ`, through `BwdBf16` as the backward task packs and runs them.
#[test]
fn backward_products_on_tiles_equal_the_sequential_emulation() {
    each_case(|Case { kern, sh, bc, d, dv, br, brp, what }| {
        let (ldq, ldo, ldk) = (d + 1, dv + 2, d + 3);
        let q = rand_vec(br * ldq, 4);
        let dout = rand_vec(br * ldo, 5);
        let kj = rand_vec(bc * ldk, 6);
        // P and dS tiles (keys as rows, queries as lanes; lanes past `br` unused).
        let (st, dpt) = (rand_vec(bc * brp, 7), rand_vec(bc * brp, 8));
        let sizes = BwdBf16::sizes(kern, (br, bc, bc), d, dv);
        let mut buf = buffers(&sizes);
        let bb = BwdBf16::carve(std::array::from_fn(|i| buf[i].as_mut_ptr()));
        let (dv0, dk0) = (rand_vec(bc * dv, 9), rand_vec(bc * d, 10));
        let (mut dvj, mut dkj) = (dv0.clone(), dk0.clone());
        let mut dqt_want = vec![0f32; d * NR];
        for first in [true, false] {
            let g = BlockGrads {
                dvj: (dvj.as_mut_ptr(), dv),
                dkj: (dkj.as_mut_ptr(), d),
                kj: (kj.as_ptr(), ldk),
                first,
                j0: 0,
                chunk: None,
            };
            // SAFETY: the buffers are carved from `sizes` for these shapes and the kernel;
            // every row the products read or write exists.
            unsafe {
                bb.start_block(kern, q.as_ptr(), ldq, dout.as_ptr(), ldo, br, d, dv);
                let blocks = (st.as_ptr(), dpt.as_ptr());
                bb.grads(kern, blocks, brp, (br, bc), (d, dv), g);
            }
            for c in 0..d {
                for i in 0..NR {
                    let dsi = |j: usize| if i < brp { dpt[j * brp + i] } else { 0.0 };
                    let acc = if first { 0.0 } else { dqt_want[c * NR + i] };
                    dqt_want[c * NR + i] = tdp_dot(sh, bc, |j| kj[j * ldk + c], dsi, acc);
                }
            }
            // SAFETY: `dqt` holds `d` rounded up to `MR` rows of `NR` floats.
            let dqt = unsafe { std::slice::from_raw_parts(bb.dqt, d * NR) };
            same_bits(dqt, &dqt_want, &format!("{what}: dQᵀ, first={first}"));
        }
        // Two accumulations into dV (from P and dO) and dK (from dS and q), each over the
        // block's queries.
        let twice = |start: &[f32], tile: &[f32], (x, ldx): (&[f32], usize), n: usize| {
            let mut out = start.to_vec();
            for _ in 0..2 {
                for j in 0..bc {
                    for c in 0..n {
                        let p = |i: usize| tile[j * brp + i];
                        out[j * n + c] = tdp_dot(sh, br, p, |i| x[i * ldx + c], out[j * n + c]);
                    }
                }
            }
            out
        };
        same_bits(&dvj, &twice(&dv0, &st, (&dout, ldo), dv), &format!("{what}: dV"));
        same_bits(&dkj, &twice(&dk0, &dpt, (&q, ldq), d), &format!("{what}: dK"));
        slack_intact(&buf, &sizes, what);
    });
}
