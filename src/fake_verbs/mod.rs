//! Verbs objects and their semantics, in safe Rust.
//!
//! Object graph (as rdma-core's): [`device`] → [`context::DeviceContext`] (async events) →
//! [`pd::ProtectionDomain`] (or a [`pd::ParentDomain`] on it) → [`mr::MemoryRegion`] (of host
//! memory, or of [`dm::DeviceMemory`]), [`mw::MemoryWindow`] (bound to a region); [`cq::CompletionQueue`] (optionally on a
//! [`cq::CompletionChannel`]); [`qp::QueuePair`] (PD + send/recv CQs), whose state machine is
//! [`qp_state`]; [`ah::AddressHandle`] (PD) names a UD destination; [`xrc::XrcDomain`] (`ibv_open_xrcd`) holds XRC SRQs and XRC target QPs. Children hold their parents (`Arc`) and count themselves in, so destroying a
//! parent that still has children fails with EBUSY as rdma-core's does.

#![forbid(unsafe_code)]

pub mod ah;
pub mod clock;
pub mod context;
pub mod cq;
pub mod device;
pub mod dm;
mod error;
pub mod event_queue;
pub mod mr;
pub mod mw;
pub mod pd;
pub mod qp;
pub mod qp_state;
pub mod srq;
pub mod work;
pub mod xrc;

pub use error::VerbsError;
