//! ugdr: RDMA verbs over UCX, for machines without RDMA hardware.
//!
//! Layers (each a folder), each importing only those below it (`tests/layering.rs`):
//! [`ucp`] thin safe UCX wrappers; [`engine`] addressing, wire protocol and progress, which
//! dispatches to the [`engine::MessageReceiver`] each queue pair registers; [`fake_verbs`]
//! verbs objects and semantics; [`cm`] the connection manager; `capi` the exported C ABI
//! (`ibv_*`, `rdma_*`, and the `ugdr_*` API of `include/ugdr.h`), thin, calling into the
//! layers below; [`ugdr`] and [`topology`] hold what only the `ugdr_*` API needs.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod capi;
pub mod cm;
mod cuda;
pub mod engine;
pub mod fake_verbs;
mod log;
pub mod report;
pub mod rsocket;
pub mod shared_memory;
pub mod sys;
pub mod topology;
pub mod ucp;
pub mod ugdr;
