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

/// Runs when the library is loaded (before the application's `main` under `LD_PRELOAD`):
/// records the CPUs the process starts on, for ugdr's progress thread (`engine::progress`).
extern "C" fn on_load() {
    crate::engine::remember_launch_cpus();
}

// SAFETY: an `.init_array` entry is a plain `void (*)(void)` the dynamic loader calls once
// at load; `on_load` has that signature, takes no lock ugdr holds and cannot unwind (it only
// calls sched_getaffinity and sets a OnceLock).
#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;
