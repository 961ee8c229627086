//! The integration tests, in one binary.

mod behaviour;
mod common;
mod cos_init;
mod errors;
mod golden;
mod properties;
mod state_dict;
mod transformer;
