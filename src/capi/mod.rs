//! The exported C ABI: the only place with `#[unsafe(no_mangle)]`. Each file is one family
//! of exports; each export checks pointers, converts, calls the safe core, and maps the
//! result to rdma-core's return convention (see `boundary`).

pub(crate) mod boundary;
pub(crate) mod caller;
mod ibv_ah;
mod ibv_cq;
mod ibv_device;
mod ibv_dm;
mod ibv_domain;
mod ibv_import;
mod ibv_mcast;
mod ibv_misc;
mod ibv_mw;
mod ibv_not_yet;
mod ibv_pd_mr;
mod ibv_qp;
mod ibv_srq;
pub(crate) mod ibv_xrc;
pub(crate) mod layout;
mod libc_hooks;
mod ops;
mod passthrough;
mod rdma_cm;
mod rsocket;
mod ugdr_api;
