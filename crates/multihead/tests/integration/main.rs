//! The integration tests, in one binary.

#![allow(clippy::unwrap_used)]

mod autocast;
mod autocast_inputs;
mod backward_store;
mod behaviour;
mod bf16_products;
mod cast;
mod clip;
mod common;
mod cos_init;
mod decode;
mod decode_encoder;
mod embedding_padding;
mod errors;
mod fused;
mod fuzz;
mod golden;
mod hardening;
mod mask_dtypes;
mod mha_learned_mask;
mod optim;
mod pool;
mod properties;
mod state_dict;
mod state_dict_buffers;
mod sum;
mod transformer;
mod variant_golden;
mod variants;
mod variants_bias;
mod variants_layers;
mod variants_mha;
mod variants_steps;
mod varlen;
