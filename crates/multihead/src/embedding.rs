//! `torch.nn.Embedding`: a lookup table of `num_embeddings` vectors.

use candle_core::{DType, Tensor};
use candle_nn::{Init, VarBuilder};

use crate::error::{fmt_shape, Error, Result};
use crate::state_dict::NamedParameters;

const OP: &str = "Embedding";

/// A lookup table, stored as PyTorch stores it (`weight` is `(num_embeddings, embedding_dim)`),
/// so a PyTorch state_dict loads unchanged. Fresh weights are standard normal, as in PyTorch.
///
/// # Shapes
/// * input: indices of any shape `(*)`, dtype `u8`, `u32` or `i64`
/// * output: `(*, embedding_dim)`
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use multihead::Embedding;
///
/// let vm = VarMap::new();
/// let emb = Embedding::new(10, 4, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
/// let ids = Tensor::new(&[[1u32, 2, 3], [9, 0, 0]], &Device::Cpu)?; // (N, L)
/// assert_eq!(emb.forward(&ids)?.dims(), &[2, 3, 4]);
/// assert!(emb.forward(&Tensor::new(&[10u32], &Device::Cpu)?).is_err()); // out of range
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Embedding {
    weight: Tensor,
}

impl Embedding {
    /// `nn.Embedding(num_embeddings, embedding_dim)` under `vb`'s `weight` key.
    pub fn new(num_embeddings: usize, embedding_dim: usize, vb: VarBuilder) -> Result<Self> {
        crate::alloc::expect_float(OP, "dtype", vb.dtype())?;
        let init = Init::Randn { mean: 0.0, stdev: 1.0 };
        let shape = [num_embeddings, embedding_dim];
        let weight = crate::state_dict::get_param(&vb, &shape, "weight", init)?;
        Ok(Self { weight })
    }

    /// Wraps an existing `(num_embeddings, embedding_dim)` weight.
    pub fn from_weight(weight: Tensor) -> Result<Self> {
        crate::alloc::expect_float(OP, "weight", weight.dtype())?;
        if weight.rank() != 2 {
            return Err(Error::Shape {
                op: OP,
                arg: "weight",
                msg: format!(
                    "expected (num_embeddings, embedding_dim), got {}",
                    fmt_shape(weight.dims())
                ),
            });
        }
        Ok(Self { weight })
    }

    /// The table, `(num_embeddings, embedding_dim)`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// Looks up `ids`. Indices must lie in `[0, num_embeddings)`; one that does not is an error
    /// naming it (PyTorch: "index out of range in self").
    // Mirrors torch.nn.Embedding.forward.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let (rows, dim) = self.weight.dims2()?;
        let mut out_dims = ids.dims().to_vec();
        out_dims.push(dim);
        crate::alloc::ensure(OP, "output", &out_dims, self.weight.dtype(), 1, "use fewer indices")?;
        crate::alloc::ensure(OP, "input", ids.dims(), DType::I64, 2, "use fewer indices")?;
        let flat = match ids.dtype() {
            DType::U8 | DType::U32 | DType::I64 => ids.flatten_all()?.to_dtype(DType::I64)?,
            other => {
                return Err(Error::DType {
                    op: OP,
                    arg: "input",
                    msg: format!("indices must be u8, u32 or i64, got {other:?}; convert with .to_dtype(DType::U32)"),
                })
            }
        };
        let values = flat.to_vec1::<i64>()?;
        if let Some(bad) = values.iter().find(|&&i| i < 0 || i as u128 >= rows as u128) {
            return Err(Error::Shape {
                op: OP,
                arg: "input",
                msg: format!("index {bad} is out of range for an embedding of {rows} rows"),
            });
        }
        // i64 indices: a table of more than 2³² rows is indexed without truncation.
        let weight = crate::mode::graph_input(&self.weight);
        Ok(weight.index_select(&flat, 0)?.reshape(out_dims)?)
    }
}

impl NamedParameters for Embedding {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("weight".to_string(), self.weight.clone())]
    }
}

impl candle_core::Module for Embedding {
    // Mirrors torch.nn.Embedding.forward.
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        Ok(Embedding::forward(self, xs)?)
    }
}
