//! Replaying a case: build the module, load `param.*` strictly, run the call, and when
//! `grad_mode` back-propagate `sum(output * g) [+ sum(attn_weights * g_w)]`.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor, Var};
use multihead::functional::{scaled_dot_product_attention, SdpaOptions};
use multihead::state_dict::{load_strict, NamedParameters};
use multihead::transformer::{
    DecoderMasks, LayerConfig, NormConfig, Transformer, TransformerConfig, TransformerDecoder,
    TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer, TransformerMasks,
};
use multihead::{Activation, Mask, MhaConfig, MhaOptions, MultiheadAttention, Result};

use crate::case::{case_err, Case};
use crate::meta::{LayerCallArgs, LayerCtor, MhaCtor, Module, SdpaCallArgs, StackCtor};

/// What a replay produced, by the contract's result names (`output`, `attn_weights`,
/// `grad.<arg>`, `grad.param.<key>`).
pub type ReplayResult = BTreeMap<String, Tensor>;

/// The MHA constructor of a case.
pub fn mha_config(c: &MhaCtor) -> MhaConfig {
    let mut cfg = MhaConfig::new(c.embed_dim, c.num_heads)
        .with_dropout(c.dropout)
        .with_bias(c.bias)
        .with_add_bias_kv(c.add_bias_kv)
        .with_add_zero_attn(c.add_zero_attn)
        .with_batch_first(c.batch_first);
    cfg.kdim = c.kdim;
    cfg.vdim = c.vdim;
    cfg
}

/// The Transformer layer arguments of a case.
pub fn layer_config(c: &LayerCtor) -> Result<LayerConfig> {
    Ok(LayerConfig::new(c.d_model, c.nhead)
        .with_dim_feedforward(c.dim_feedforward)
        .with_dropout(c.dropout)
        .with_activation(Activation::from_name(&c.activation)?)
        .with_layer_norm_eps(c.layer_norm_eps)
        .with_batch_first(c.batch_first)
        .with_norm_first(c.norm_first)
        .with_bias(c.bias))
}

/// Replays a case: builds the module, loads `param.*` strictly, runs the call (inside
/// [`multihead::no_grad`] when `grad_mode` is false, as PyTorch's case ran under
/// `torch.no_grad()`) and, when `grad_mode`, back-propagates the case's loss.
pub fn replay(case: &Case) -> Result<ReplayResult> {
    let run = || match case.autocast()? {
        Some(dtype) => multihead::autocast(dtype, || replay_graded(case)),
        None => replay_graded(case),
    };
    if case.meta.grad_mode {
        run()
    } else {
        multihead::no_grad(run)
    }
}

fn replay_graded(case: &Case) -> Result<ReplayResult> {
    match &case.module {
        Module::Sdpa(_, call) => replay_sdpa(case, call),
        Module::Mha(ctor, _) => replay_mha(case, ctor),
        _ => replay_transformer(case),
    }
}

/// The gradients of `loss` for each named tensor (zeros where none reached it).
fn gradients<'a>(
    loss: &Tensor,
    named: impl IntoIterator<Item = (String, &'a Tensor)>,
) -> Result<ReplayResult> {
    let grads = loss.backward()?;
    let mut out = ReplayResult::new();
    for (name, t) in named {
        let g = match grads.get(t) {
            Some(g) => g.contiguous()?,
            None => t.zeros_like()?,
        };
        out.insert(name, g);
    }
    Ok(out)
}

/// `grad.output`, which must have the output's shape.
fn upstream<'a>(case: &'a Case, output: &Tensor) -> Result<&'a Tensor> {
    let g = case
        .tensor("grad.output")
        .ok_or_else(|| case_err(&case.dir, "grad_mode is true but grad.output is missing"))?;
    same_shape(case, "grad.output", g, "the output", output)?;
    Ok(g)
}

/// An error naming `name` when `g` and `t` differ in shape (candle would only say "mul").
fn same_shape(case: &Case, name: &str, g: &Tensor, what: &str, t: &Tensor) -> Result<()> {
    if g.dims() == t.dims() {
        return Ok(());
    }
    Err(case_err(
        &case.dir,
        format!(
            "{name} has shape {:?} but {what} is {:?}; store the gradient with the shape of what it is the gradient of",
            g.dims(),
            t.dims()
        ),
    ))
}

/// `F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p=0, is_causal, scale,
/// enable_gqa)`; a bool mask has SDPA's polarity (true takes part).
fn replay_sdpa(case: &Case, call: &SdpaCallArgs) -> Result<ReplayResult> {
    // A function has no parameters: a `param.*` tensor is unexpected, as for a module's
    // strict load.
    let mut params: Vec<String> = case.params().into_keys().collect();
    if !params.is_empty() {
        params.sort();
        return Err(case_err(
            &case.dir,
            format!(
                "scaled_dot_product_attention takes no parameters, but the case has param.{}",
                params.join(", param.")
            ),
        ));
    }
    let (q, k, v) = (case.input_var("query")?, case.input_var("key")?, case.input_var("value")?);
    let mut opts = SdpaOptions::default().is_causal(call.is_causal).enable_gqa(call.enable_gqa);
    opts.scale = call.scale;
    let (attn_mask, mask_var) =
        learned(case, "attn_mask", case.mask("attn_mask", call.attn_mask)?)?;
    opts.attn_mask = attn_mask;
    let out = scaled_dot_product_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)?;
    let mut result = ReplayResult::new();
    result.insert("output".into(), out.contiguous()?);
    if !case.meta.grad_mode {
        return Ok(result);
    }
    let loss = out.mul(upstream(case, &out)?)?.sum_all()?;
    let mut named: Vec<(String, &Tensor)> = [("query", &q), ("key", &k), ("value", &v)]
        .map(|(n, t)| (format!("grad.{n}"), t.as_tensor()))
        .into();
    if let Some(m) = &mask_var {
        named.push(("grad.attn_mask".into(), m.as_tensor()));
    }
    result.extend(gradients(&loss, named)?);
    Ok(result)
}

fn replay_mha(case: &Case, ctor: &MhaCtor) -> Result<ReplayResult> {
    let Module::Mha(_, call) = &case.module else {
        return Err(case_err(&case.dir, "not a MultiheadAttention case"));
    };
    let cfg = mha_config(ctor);
    let (mut mha, _vars) = load_strict(&case.params(), case.dtype, &Device::Cpu, |vb| {
        MultiheadAttention::new(cfg, vb)
    })?;
    mha.train(case.meta.training);
    let alias = case.meta.aliasing;
    check_aliasing(case)?;
    let q = case.input_var("query")?;
    let k = if alias.key_is_query { q.clone() } else { case.input_var("key")? };
    let v = if alias.value_is_key { k.clone() } else { case.input_var("value")? };
    let mut opts = MhaOptions::default()
        .need_weights(call.need_weights)
        .average_attn_weights(call.average_attn_weights)
        .is_causal(call.is_causal.unwrap_or(false));
    let (attn_mask, am_var) = learned(case, "attn_mask", case.mask("attn_mask", call.attn_mask)?)?;
    let kpm = case.mask("key_padding_mask", call.key_padding_mask)?;
    let (kpm, kpm_var) = learned(case, "key_padding_mask", kpm)?;
    (opts.attn_mask, opts.key_padding_mask) = (attn_mask, kpm);

    let out = mha.forward(q.as_tensor(), k.as_tensor(), v.as_tensor(), &opts)?;
    let mut result = ReplayResult::new();
    result.insert("output".into(), out.output.contiguous()?);
    if let Some(w) = &out.attn_weights {
        result.insert("attn_weights".into(), w.contiguous()?);
    }
    if !case.meta.grad_mode {
        return Ok(result);
    }
    let mut loss = out.output.mul(upstream(case, &out.output)?)?.sum_all()?;
    if let Some(gw) = case.tensor("grad.attn_weights") {
        let w = out.attn_weights.as_ref().ok_or_else(|| {
            case_err(&case.dir, "grad.attn_weights is given but the call returns no weights")
        })?;
        same_shape(case, "grad.attn_weights", gw, "the attention weights", w)?;
        loss = loss.add(&w.mul(gw)?.sum_all()?)?;
    }
    let params = mha.named_parameters();
    let mut named: Vec<(String, &Tensor)> = vec![("grad.query".into(), q.as_tensor())];
    if !alias.key_is_query {
        named.push(("grad.key".into(), k.as_tensor()));
    }
    if !alias.value_is_key {
        named.push(("grad.value".into(), v.as_tensor()));
    }
    named.extend(params.iter().map(|(n, t)| (format!("grad.param.{n}"), t)));
    for (n, m) in [("attn_mask", &am_var), ("key_padding_mask", &kpm_var)] {
        if let Some(m) = m {
            named.push((format!("grad.{n}"), m.as_tensor()));
        }
    }
    result.extend(gradients(&loss, named)?);
    Ok(result)
}

/// A float mask that the case marks as learned (it stores `expect.grad.<name>`: a bias that
/// requires grad in PyTorch) as a `Var`, whose gradient the replay reports as `grad.<name>`.
fn learned(case: &Case, name: &str, mask: Option<Mask>) -> Result<(Option<Mask>, Option<Var>)> {
    if case.tensor(&format!("expect.grad.{name}")).is_none() {
        return Ok((mask, None));
    }
    match mask {
        Some(Mask::Float(t)) => {
            let v = Var::from_tensor(&t)?;
            Ok((Some(Mask::Float(v.as_tensor().clone())), Some(v)))
        }
        _ => Err(case_err(
            &case.dir,
            format!(
                "expect.grad.{name} is stored but {name} is not a float mask; only a float mask \
                 (a learned bias) has a gradient"
            ),
        )),
    }
}

/// Aliased inputs are stored in full and bit-identical (case-format.md): a stored key that
/// differs from the query it is said to be would otherwise be replaced by the query silently.
fn check_aliasing(case: &Case) -> Result<()> {
    let alias = case.meta.aliasing;
    let pairs = [
        (alias.key_is_query, "key", "query", "key_is_query"),
        (alias.value_is_key, "value", "key", "value_is_key"),
    ];
    for (said, name, of, flag) in pairs {
        let (Some(a), Some(b)) =
            (case.tensor(&format!("input.{name}")), case.tensor(&format!("input.{of}")))
        else {
            continue;
        };
        if said && !bit_identical(a, b)? {
            return Err(case_err(
                &case.dir,
                format!(
                    "aliasing.{flag} is true but input.{name} {:?} is not bit-identical to input.{of} {:?}; store the same tensor for both, or set {flag} to false",
                    a.dims(),
                    b.dims()
                ),
            ));
        }
    }
    Ok(())
}

/// Same shape and the same bits (NaN payloads included), compared through `u8` views.
fn bit_identical(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.dims() != b.dims() || a.dtype() != b.dtype() {
        return Ok(false);
    }
    let bytes = |t: &Tensor| -> Result<Vec<u64>> {
        Ok(match t.dtype() {
            candle_core::DType::F64 => {
                t.flatten_all()?.to_vec1::<f64>()?.into_iter().map(f64::to_bits).collect()
            }
            candle_core::DType::F32 => t
                .flatten_all()?
                .to_vec1::<f32>()?
                .into_iter()
                .map(|x| u64::from(x.to_bits()))
                .collect(),
            _ => t
                .flatten_all()?
                .to_dtype(candle_core::DType::F32)?
                .to_vec1::<f32>()?
                .into_iter()
                .map(|x| u64::from(x.to_bits()))
                .collect(),
        })
    };
    Ok(bytes(a)? == bytes(b)?)
}

/// A built Transformer-family module.
enum Built {
    EncoderLayer(TransformerEncoderLayer),
    DecoderLayer(TransformerDecoderLayer),
    Encoder(TransformerEncoder),
    Decoder(TransformerDecoder),
    Transformer(Transformer),
}

impl NamedParameters for Built {
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        match self {
            Built::EncoderLayer(m) => m.named_parameters(),
            Built::DecoderLayer(m) => m.named_parameters(),
            Built::Encoder(m) => m.named_parameters(),
            Built::Decoder(m) => m.named_parameters(),
            Built::Transformer(m) => m.named_parameters(),
        }
    }
}

impl Built {
    fn train(&mut self, mode: bool) {
        match self {
            Built::EncoderLayer(m) => m.train(mode),
            Built::DecoderLayer(m) => m.train(mode),
            Built::Encoder(m) => m.train(mode),
            Built::Decoder(m) => m.train(mode),
            Built::Transformer(m) => m.train(mode),
        }
    }

    /// The float inputs of the module's forward.
    fn float_inputs(&self) -> &'static [&'static str] {
        match self {
            Built::EncoderLayer(_) | Built::Encoder(_) => &["src"],
            Built::DecoderLayer(_) | Built::Decoder(_) => &["tgt", "memory"],
            Built::Transformer(_) => &["src", "tgt"],
        }
    }
}

fn stack_norm(case: &Case, s: &StackCtor) -> Option<NormConfig> {
    s.norm.as_ref().map(|n| NormConfig {
        eps: n.eps,
        bias: n.bias.unwrap_or_else(|| case.tensors.contains_key("param.norm.bias")),
    })
}

fn build(case: &Case) -> Result<Built> {
    let (built, _vars) = load_strict(&case.params(), case.dtype, &Device::Cpu, |vb| {
        Ok(match &case.module {
            Module::EncoderLayer(c, _) => {
                Built::EncoderLayer(TransformerEncoderLayer::new(layer_config(c)?, vb)?)
            }
            Module::DecoderLayer(c, _) => {
                Built::DecoderLayer(TransformerDecoderLayer::new(layer_config(c)?, vb)?)
            }
            Module::Encoder(s, _) => {
                let mut enc = TransformerEncoder::new(
                    layer_config(&s.layer)?,
                    s.num_layers,
                    stack_norm(case, s),
                    vb,
                )?;
                enc.set_enable_nested_tensor(s.enable_nested_tensor);
                enc.set_mask_check(s.mask_check);
                Built::Encoder(enc)
            }
            Module::Decoder(s, _) => Built::Decoder(TransformerDecoder::new(
                layer_config(&s.layer)?,
                s.num_layers,
                stack_norm(case, s),
                vb,
            )?),
            Module::Transformer(c, _) => Built::Transformer(Transformer::new(
                TransformerConfig {
                    layer: layer_config(&c.layer())?,
                    num_encoder_layers: c.num_encoder_layers,
                    num_decoder_layers: c.num_decoder_layers,
                },
                vb,
            )?),
            Module::Mha(..) | Module::Sdpa(..) => {
                return Err(case_err(&case.dir, "not a Transformer case"))
            }
        })
    })?;
    Ok(built)
}

fn decoder_masks(
    case: &Case,
    c: &LayerCallArgs,
    tgt_causal_default: Option<bool>,
) -> Result<DecoderMasks> {
    Ok(DecoderMasks {
        tgt_mask: case.mask("tgt_mask", c.tgt_mask)?,
        memory_mask: case.mask("memory_mask", c.memory_mask)?,
        tgt_key_padding_mask: case.mask("tgt_key_padding_mask", c.tgt_key_padding_mask)?,
        memory_key_padding_mask: case.mask("memory_key_padding_mask", c.memory_key_padding_mask)?,
        tgt_is_causal: c.tgt_is_causal.or(tgt_causal_default),
        memory_is_causal: c.memory_is_causal.unwrap_or(false),
    })
}

fn forward(case: &Case, built: &Built, inputs: &BTreeMap<&str, Var>) -> Result<Tensor> {
    let inp = |name: &str| -> Result<Tensor> {
        inputs
            .get(name)
            .map(|v| v.as_tensor().clone())
            .ok_or_else(|| case_err(&case.dir, format!("missing input.{name}")))
    };
    let call = match &case.module {
        Module::Mha(..) | Module::Sdpa(..) => {
            return Err(case_err(&case.dir, "not a Transformer case"))
        }
        Module::EncoderLayer(_, c)
        | Module::DecoderLayer(_, c)
        | Module::Encoder(_, c)
        | Module::Decoder(_, c)
        | Module::Transformer(_, c) => c,
    };
    Ok(match built {
        Built::EncoderLayer(m) => m.forward(
            &inp("src")?,
            case.mask("src_mask", call.src_mask)?.as_ref(),
            case.mask("src_key_padding_mask", call.src_key_padding_mask)?.as_ref(),
            call.is_causal.unwrap_or(false),
        )?,
        Built::Encoder(m) => m.forward(
            &inp("src")?,
            case.mask("mask", call.mask)?.as_ref(),
            case.mask("src_key_padding_mask", call.src_key_padding_mask)?.as_ref(),
            call.is_causal,
        )?,
        Built::DecoderLayer(m) => {
            m.forward(&inp("tgt")?, &inp("memory")?, &decoder_masks(case, call, Some(false))?)?
        }
        Built::Decoder(m) => {
            m.forward(&inp("tgt")?, &inp("memory")?, &decoder_masks(case, call, None)?)?
        }
        Built::Transformer(m) => {
            let masks = TransformerMasks {
                src_mask: case.mask("src_mask", call.src_mask)?,
                src_key_padding_mask: case
                    .mask("src_key_padding_mask", call.src_key_padding_mask)?,
                src_is_causal: call.src_is_causal,
                decoder: decoder_masks(case, call, None)?,
            };
            m.forward(&inp("src")?, &inp("tgt")?, &masks)?
        }
    })
}

fn replay_transformer(case: &Case) -> Result<ReplayResult> {
    let mut built = build(case)?;
    built.train(case.meta.training);
    let mut inputs: BTreeMap<&str, Var> = BTreeMap::new();
    for name in built.float_inputs() {
        inputs.insert(name, case.input_var(name)?);
    }
    let output = forward(case, &built, &inputs)?;
    let mut result = ReplayResult::new();
    result.insert("output".into(), output.contiguous()?);
    if !case.meta.grad_mode {
        return Ok(result);
    }
    let loss = output.mul(upstream(case, &output)?)?.sum_all()?;
    let params = built.named_parameters();
    let mut named: Vec<(String, &Tensor)> =
        inputs.iter().map(|(n, v)| (format!("grad.{n}"), v.as_tensor())).collect();
    named.extend(params.iter().map(|(n, t)| (format!("grad.param.{n}"), t)));
    result.extend(gradients(&loss, named)?);
    Ok(result)
}
