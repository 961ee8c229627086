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
    /// PyTorch's `padding_idx`, normalised to `[0, num_embeddings)`: that row gets no gradient.
    padding_idx: Option<usize>,
}

impl Embedding {
    /// `nn.Embedding(num_embeddings, embedding_dim)` under `vb`'s `weight` key.
    pub fn new(num_embeddings: usize, embedding_dim: usize, vb: VarBuilder) -> Result<Self> {
        crate::alloc::expect_float(OP, "dtype", vb.dtype())?;
        let init = Init::Randn { mean: 0.0, stdev: 1.0 };
        let shape = [num_embeddings, embedding_dim];
        let weight = crate::state_dict::get_param(&vb, &shape, "weight", init)?;
        Ok(Self { weight, padding_idx: None })
    }

    /// `nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)`: as
    /// [`new`](Self::new), with row `padding_idx` (negative counts from the end, as in PyTorch)
    /// zeroed when the builder creates the weight (a weight loaded from a state_dict keeps its
    /// values, as PyTorch's `load_state_dict` does), and given no gradient by
    /// [`forward`](Self::forward).
    ///
    /// # Errors
    /// [`Error::Config`] for an index outside `[-num_embeddings, num_embeddings)`.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use multihead::Embedding;
    ///
    /// let vm = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    /// let emb = Embedding::new_with_padding(10, 4, 0, vb)?;
    /// let row = emb.forward(&Tensor::new(&[0u32], &Device::Cpu)?)?;
    /// assert_eq!(row.sqr()?.sum_all()?.to_scalar::<f32>()?, 0.0);
    /// # Ok::<(), multihead::Error>(())
    /// ```
    pub fn new_with_padding(
        num_embeddings: usize,
        embedding_dim: usize,
        padding_idx: i64,
        vb: VarBuilder,
    ) -> Result<Self> {
        let pad = padding_row(num_embeddings, padding_idx)?;
        let fresh = !vb.contains_tensor("weight");
        let emb = Self::new(num_embeddings, embedding_dim, vb)?;
        if fresh {
            // In place, so that the builder's variable holds the zero row too.
            let zeros = Tensor::zeros((1, embedding_dim), emb.weight.dtype(), emb.weight.device())?;
            emb.weight.slice_set(&zeros, 0, pad)?;
        }
        Ok(Self { padding_idx: Some(pad), ..emb })
    }

    /// This table with PyTorch's `padding_idx` (`nn.Embedding.from_pretrained(weight,
    /// padding_idx=...)`): row `padding_idx` (negative counts from the end) keeps its values and
    /// gets no gradient.
    ///
    /// # Errors
    /// [`Error::Config`] for an index outside `[-num_embeddings, num_embeddings)`.
    pub fn with_padding_idx(self, padding_idx: i64) -> Result<Self> {
        let pad = padding_row(self.weight.dim(0)?, padding_idx)?;
        Ok(Self { padding_idx: Some(pad), ..self })
    }

    /// The row that gets no gradient, if any (`padding_idx`, counted from the start).
    pub fn padding_idx(&self) -> Option<usize> {
        self.padding_idx
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
        Ok(Self { weight, padding_idx: None })
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
        // With a padding row, a gradient's lookup reads the table twice (the second detached).
        let copies = if self.padding_idx.is_some() { 2 } else { 1 };
        let (dtype, hint) = (self.weight.dtype(), "use fewer indices");
        crate::alloc::ensure(OP, "output", &out_dims, dtype, copies, hint)?;
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
        let rows = weight.index_select(&flat, 0)?;
        let rows = match self.padding_idx {
            Some(pad) if rows.track_op() && values.contains(&(pad as i64)) => {
                // The padding row read from the detached table: no gradient reaches it.
                let at_pad: Vec<u8> = values.iter().map(|&i| u8::from(i == pad as i64)).collect();
                let at_pad = Tensor::from_vec(at_pad, (values.len(), 1), rows.device())?;
                let frozen = self.weight.detach().index_select(&flat, 0)?;
                at_pad.broadcast_as(rows.shape())?.where_cond(&frozen, &rows)?
            }
            _ => rows,
        };
        Ok(rows.reshape(out_dims)?)
    }
}

/// `padding_idx` of a table of `rows` rows as a row index (negative counts from the end, as
/// PyTorch's `nn.Embedding` takes it).
fn padding_row(rows: usize, padding_idx: i64) -> Result<usize> {
    let row = if padding_idx < 0 { rows as i64 + padding_idx } else { padding_idx };
    if row < 0 || row as u128 >= rows as u128 {
        return Err(Error::Config {
            op: OP,
            arg: "padding_idx",
            msg: format!(
                "padding_idx {padding_idx} is outside [-{rows}, {rows}) for an embedding of \
                 {rows} rows; pass an index of a row of the table"
            ),
        });
    }
    Ok(row as usize)
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
