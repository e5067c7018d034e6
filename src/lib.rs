//! ugdr: RDMA verbs over UCX, for machines without RDMA hardware.
//!
//! Layers (each a folder): [`ucp`] thin safe UCX wrappers; [`fake_verbs`] verbs objects and
//! semantics; [`engine`] addressing, wire protocol and progress between them; `capi` the
//! exported C ABI (`ibv_*`), thin, calling into the layers below.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod capi;
pub mod cm;
pub mod engine;
pub mod fake_verbs;
mod log;
pub mod report;
pub mod sys;
pub mod ucp;
