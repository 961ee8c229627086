//! `nn.Embedding(padding_idx=...)`: the padding row of a fresh table is zero, a loaded one keeps
//! its values, and the row gets no gradient (the plain table's gradient with that row zeroed),
//! while the output is the plain lookup's, bit for bit.

use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::Embedding;

use crate::common::{bits, det, dev};

#[test]
fn the_padding_row_is_zeroed_when_fresh_and_gets_no_gradient() {
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
    // -2 of 6 rows is row 4, as PyTorch counts it.
    let emb = Embedding::new_with_padding(6, 3, -2, vb.pp("fresh")).unwrap();
    assert_eq!(emb.padding_idx(), Some(4));
    let row = emb.weight().narrow(0, 4, 1).unwrap();
    assert!(bits(&row).iter().all(|&b| b == 0), "the fresh padding row is zero");
    // The builder's variable holds the zero row too (a second module on the same key reads it).
    let again = Embedding::new(6, 3, vb.pp("fresh")).unwrap();
    assert_eq!(bits(again.weight()), bits(emb.weight()));

    // A loaded table keeps its padding row; its gradient there is zero, elsewhere the plain one.
    let w = candle_core::Var::from_tensor(&det(&[6, 3], DType::F32, 1.0)).unwrap();
    let padded =
        Embedding::from_weight(w.as_tensor().clone()).unwrap().with_padding_idx(2).unwrap();
    let plain = Embedding::from_weight(w.as_tensor().clone()).unwrap();
    let ids = Tensor::new(&[[2u32, 0, 2], [5, 2, 1]], &dev()).unwrap();
    let g = det(&[2, 3, 3], DType::F32, 2.0);
    let grad = |e: &Embedding| {
        let y = e.forward(&ids).unwrap();
        let loss = (&y * &g).unwrap().sum_all().unwrap();
        (y, loss.backward().unwrap().get(w.as_tensor()).unwrap().clone())
    };
    let ((yp, gp), (y0, g0)) = (grad(&padded), grad(&plain));
    assert_eq!(bits(&yp), bits(&y0), "the output is the plain lookup's");
    let rows = |t: &Tensor, r: usize| bits(&t.narrow(0, r, 1).unwrap());
    for r in 0..6 {
        match r {
            2 => assert!(rows(&gp, r).iter().all(|&b| b == 0), "padding row gradient"),
            _ => assert_eq!(rows(&gp, r), rows(&g0, r), "row {r}"),
        }
    }
    assert!(rows(&g0, 2).iter().any(|&b| b != 0), "the plain gradient reaches row 2");

    // Indices outside [-rows, rows) are errors naming padding_idx.
    for bad in [6, -7] {
        let e = plain.clone().with_padding_idx(bad).map(|_| ()).expect_err("out of range");
        assert!(e.to_string().contains("padding_idx") && e.to_string().contains("[-6, 6)"), "{e}");
    }
}
