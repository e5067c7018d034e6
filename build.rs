//! Generates `$OUT_DIR/sys.rs` with bindgen from the system headers:
//! the verbs and rdma_cm structs for their *layouts* (ugdr is the provider of these
//! functions, so it never links libibverbs), and UCX's types plus the UCX functions
//! ugdr calls. The UCX functions are emitted as a `libloading` table (`UcxLibrary`)
//! so that libucp is opened lazily, on the first verbs call, after ugdr has told UCX
//! not to load its own InfiniBand modules (see docs/design.md, "Loading UCX").

use std::env;
use std::path::PathBuf;

/// The UCX entry points ugdr calls. Everything else in ucp.h stays out of the table,
/// so that a UCX without one of the rarely used symbols still loads.
const UCX_FUNCTIONS: &[&str] = &[
    "ucp_init_version",
    "ucp_cleanup",
    "ucp_config_read",
    "ucp_config_release",
    "ucp_config_modify",
    "ucp_context_query",
    "ucp_get_version_string",
    "ucp_worker_create",
    "ucp_worker_destroy",
    "ucp_worker_query",
    "ucp_worker_get_address",
    "ucp_worker_release_address",
    "ucp_worker_progress",
    "ucp_worker_get_efd",
    "ucp_worker_arm",
    "ucp_worker_signal",
    "ucp_worker_set_am_recv_handler",
    "ucp_ep_create",
    "ucp_ep_close_nbx",
    "ucp_ep_print_info",
    "ucp_worker_print_info",
    "ucp_context_print_info",
    "ucp_am_send_nbx",
    "ucp_am_recv_data_nbx",
    "ucp_am_data_release",
    "ucp_request_free",
    "ucp_request_cancel",
    "ucs_status_string",
    "ucs_global_opts_set_value",
];

fn include_paths(lib: &str, env_override: &str) -> Vec<PathBuf> {
    println!("cargo::rerun-if-env-changed={env_override}");
    if let Ok(dir) = env::var(env_override) {
        return vec![PathBuf::from(dir)];
    }
    match pkg_config::Config::new().cargo_metadata(false).probe(lib) {
        Ok(l) => l.include_paths,
        Err(_) => vec![PathBuf::from("/usr/include")],
    }
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    let mut includes = include_paths("libibverbs", "UGDR_VERBS_INCLUDE_DIR");
    includes.extend(include_paths("librdmacm", "UGDR_RDMACM_INCLUDE_DIR"));
    includes.extend(include_paths("ucx", "UGDR_UCX_INCLUDE_DIR"));

    let mut builder = bindgen::Builder::default()
        .header_contents(
            "ugdr_sys.h",
            "#include <infiniband/verbs.h>\n#include <rdma/rdma_cma.h>\n#include <ucp/api/ucp.h>\n#include <ucs/config/global_opts.h>\n",
        )
        .clang_args(includes.iter().map(|p| format!("-I{}", p.display())))
        .allowlist_type("(ibv|verbs|rdma|ucp|ucs)_.*")
        .allowlist_var("(IBV|RDMA|UCP|UCS)_.*")
        .default_enum_style(bindgen::EnumVariation::NewType {
            is_bitfield: false,
            is_global: false,
        })
        .bitfield_enum(
            "ibv_access_flags|ibv_send_flags|ibv_qp_attr_mask|ibv_wc_flags|ibv_qp_init_attr_mask",
        )
        .derive_default(true)
        .derive_debug(true)
        .size_t_is_usize(true)
        .prepend_enum_name(false)
        .layout_tests(true)
        .dynamic_library_name("UcxLibrary")
        .dynamic_link_require_all(true);
    for f in UCX_FUNCTIONS {
        builder = builder.allowlist_function(f);
    }
    let bindings = builder
        .generate()
        .expect("bindgen failed on the verbs/ucx headers");
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR")).join("sys.rs");
    bindings.write_to_file(out).expect("cannot write sys.rs");
    write_pkg_config();
}

/// Writes `target/<profile>/pkgconfig/ugdr.pc` for the `ugdr_*` API: the header in this
/// tree's `include/`, the library cargo builds next to it. `PKG_CONFIG_PATH` pointed at that
/// directory makes `pkg-config --cflags --libs ugdr` work (README, "The ugdr_* C API").
fn write_pkg_config() {
    println!("cargo::rerun-if-changed=include/ugdr.h");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out.
    let Some(libdir) = out.ancestors().nth(3) else {
        println!(
            "cargo::warning=cannot place ugdr.pc: unexpected OUT_DIR {}",
            out.display()
        );
        return;
    };
    let pc = format!(
        "includedir={}\nlibdir={}\n\nName: ugdr\nDescription: {}\nVersion: {}\nCflags: -I${{includedir}}\nLibs: -L${{libdir}} -Wl,-rpath,${{libdir}} -lugdr\n",
        manifest.join("include").display(),
        libdir.display(),
        "the ugdr_* RDMA API over UCX (libugdr.so)",
        env::var("CARGO_PKG_VERSION").expect("CARGO_PKG_VERSION"),
    );
    let dir = libdir.join("pkgconfig");
    if let Err(e) =
        std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(dir.join("ugdr.pc"), pc))
    {
        println!("cargo::warning=cannot write {}/ugdr.pc: {e}", dir.display());
    }
}
