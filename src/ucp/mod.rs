//! Thin safe wrappers over UCX's UCP API.
//!
//! Object graph: [`Context`] (ucp_context) → [`Worker`] (ucp_worker, one per process) →
//! [`Endpoint`] (ucp_ep, one per remote worker). A worker is driven in
//! `UCS_THREAD_MODE_SERIALIZED`: every UCX call goes through a [`LockedWorker`], the proof
//! that the caller holds the worker's lock. Active-message handlers run inside
//! [`LockedWorker::progress`] and are handed that same proof, so they may send and receive.
//!
//! Application memory reaches UCX only as [`AppSpan`]s cut from an [`AppRegion`], whose
//! (unsafe) constructor is where the application's promise "this memory is valid while it is
//! registered" enters the Rust side (`ibv_reg_mr`); while UCX reads or writes a span, the
//! request holds its region (see `memory`), so unmapping it waits for the transfer.

mod endpoint;
pub mod fifo;
mod library;
pub mod mappings;
mod memory;
mod status;
mod worker;

pub use endpoint::{
    Endpoint, ErrorHandler, OwnedBytes, SPLICED_SPANS_MAX, SendDone, SendPayload, SendState,
    Spliced,
};
pub use library::{Namespace, Rdma, Ucx, ucx_version};
pub use memory::{
    AppRegion, AppSpan, Hold, HostBuffer, Invalidation, Loss, RegionExtent, SpanList,
    anything_registered, gather, gather_into, hold_all, invalidate_range, scatter, total_len,
};
pub use status::Error;
pub use worker::{
    AmData, AmHandler, AmPayload, Context, LockedWorker, Worker, wait_readable, wait_readable_for,
};
