//! What `ugdr info` prints: the device, its port, and the UCX transports in use.

use crate::engine::{Engine, ProgressMode};
use crate::fake_verbs::device::{self, DeviceAttributes};
use std::fmt::Write;

fn hex(bytes: &[u8]) -> String {
    bytes
        .chunks(2)
        .map(|c| c.iter().map(|b| format!("{b:02x}")).collect::<String>())
        .collect::<Vec<_>>()
        .join(":")
}

pub fn describe(engine: &Engine) -> String {
    let attrs = DeviceAttributes::new(engine.network.node_guid());
    let mut out = String::new();
    let _ = writeln!(
        out,
        "device:        {} ({})",
        device::DEVICE_NAME,
        attrs.fw_ver
    );
    let _ = writeln!(out, "node_guid:     {}", hex(&attrs.node_guid));
    let _ = writeln!(
        out,
        "port 1:        PORT_ACTIVE, link_layer InfiniBand, MTU 4096"
    );
    let _ = writeln!(out, "  lid:         {:#06x}", engine.lid);
    let _ = writeln!(out, "  gid[0]:      {}", hex(&engine.gid));
    let _ = writeln!(out, "host address:  {}", engine.network.ipv4);
    match &engine.query_service {
        Ok(port) => {
            let _ = writeln!(out, "lid queries:   tcp port {port}");
        }
        Err(e) => {
            let _ = writeln!(out, "lid queries:   unavailable ({e})");
        }
    }
    let _ = writeln!(
        out,
        "peers:         must prove the secret in {} (the same on every host)",
        engine.secret_origin()
    );
    let direct = if !crate::engine::direct::enabled() {
        "off (UGDR_DIRECT=off): RDMA WRITE/READ/atomics and SENDs on this host go through \
         messages"
            .to_string()
    } else {
        match (&engine.memory, crate::engine::direct::self_check()) {
            (Some(_), Ok(())) => format!(
                "on: RDMA WRITE/READ and atomics to same-host peers of this user are \
                 done by the requester, and RC SENDs and WRITE_WITH_IMMs placed in the \
                 peer's posted receive WR (SENDs of up to {} bytes in its receive ring, \
                 larger ones written in place into a WR of one SGE) (peers must be dumpable \
                 or the requester must have CAP_SYS_PTRACE; otherwise messages); {}",
                crate::engine::direct::SEND_MAX,
                crate::engine::direct::part_pages_note()
            ),
            (None, _) => {
                "unavailable (no memfd): RDMA WRITE/READ/atomics and SENDs go through messages"
                    .into()
            }
            (Some(_), Err(e)) => format!(
                "not permitted ({e}): RDMA WRITE/READ/atomics and SENDs go through messages"
            ),
        }
    };
    let _ = writeln!(out, "direct path:   {direct}");
    let progress = match engine.progress.mode {
        ProgressMode::Event => {
            "event (UGDR_PROGRESS): the progress thread sleeps on UCX's event fd between messages"
        }
        ProgressMode::Adaptive => &format!(
            "adaptive (UGDR_PROGRESS): the progress thread keeps polling for {} µs after activity (UGDR_PROGRESS_SPIN_US), then sleeps on UCX's event fd",
            engine.progress.spin.as_micros()
        ),
        ProgressMode::Busy => {
            "busy (UGDR_PROGRESS): the progress thread polls without sleeping (one core per process)"
        }
    };
    let _ = writeln!(out, "progress:      {progress}");
    let fifos = engine.worker.watched_fifos();
    let _ = if fifos > 0 {
        writeln!(
            out,
            "shared memory: {fifos} receive FIFOs watched: a slot that a sender killed while \
             writing it left unwritten is completed as an empty message (else every later \
             shared-memory message waits behind it)"
        )
    } else {
        writeln!(
            out,
            "shared memory: receive FIFOs not watched (no shared-memory transport, FIFOs sized \
             by the user, or a UCX whose layout ugdr does not know): a peer killed while \
             writing into one can stop this process receiving from peers on this host"
        )
    };
    let _ = writeln!(
        out,
        "ucx:           {}",
        crate::ucp::ucx_version().unwrap_or_default()
    );
    if let Ok(ucx) = crate::ucp::Ucx::get() {
        out.push_str(&describe_ucx(ucx));
    }
    let _ = writeln!(
        out,
        "ucx transports offered to peers (UCX picks among them per peer; shared memory and cma on one host, tcp across hosts, RDMA devices where UCX found them):"
    );
    for line in engine
        .transports()
        .lines()
        .map(|l| l.trim_start_matches('#').trim())
    {
        if line.starts_with("resource")
            || line.starts_with("atomics")
            || line.starts_with("address")
        {
            let _ = writeln!(out, "  {line}");
        }
    }
    out
}

/// Where ugdr's UCX lives and whether its RDMA modules are loaded (with the devices the real
/// libibverbs they use lists).
fn describe_ucx(ucx: &crate::ucp::Ucx) -> String {
    use crate::ucp::{Namespace, Rdma};
    let mut out = String::new();
    let _ = match ucx.namespace() {
        Namespace::Own(lmid) => writeln!(
            out,
            "ucx namespace: own (link-map namespace {lmid}, dlmopen): UCX's modules use the real libibverbs and librdmacm loaded there"
        ),
        Namespace::Shared(reason) => writeln!(
            out,
            "ucx namespace: the application's (dlmopen failed: {reason}); UCX's modules reach the real libraries by caller"
        ),
    };
    let files: Vec<String> = ucx
        .namespace_objects()
        .iter()
        .map(|p| p.rsplit('/').next().unwrap_or(p).to_string())
        .filter(|f| {
            ["libuct_ib", "libuct_rdmacm", "libibverbs", "librdmacm"]
                .iter()
                .any(|m| f.starts_with(m))
        })
        .collect();
    let ib_loaded = files.iter().any(|f| f.starts_with("libuct_ib"));
    let _ = match ucx.rdma() {
        Rdma::Off if !ib_loaded => writeln!(
            out,
            "ucx rdma:      off (UGDR_UCX_RDMA=off): UCX's ib and rdmacm modules not loaded"
        ),
        Rdma::Off => writeln!(
            out,
            "ucx rdma:      off (UGDR_UCX_RDMA=off), yet loaded: {}",
            files.join(" ")
        ),
        Rdma::Auto if !ib_loaded => writeln!(
            out,
            "ucx rdma:      auto: UCX did not load its ib module (UCX_MODULES?)"
        ),
        Rdma::Auto => {
            let devices = match ucx.rdma_devices() {
                Some(d) if d.is_empty() => "none".to_string(),
                Some(d) => d.join(" "),
                None => "unknown (libibverbs not loaded)".to_string(),
            };
            writeln!(
                out,
                "ucx rdma:      auto: UCX's ib and rdmacm modules loaded ({}); RDMA devices the real libibverbs lists: {devices}",
                files.join(" ")
            )
        }
    };
    out
}
