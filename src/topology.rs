//! The host's NUMA nodes and the NVIDIA GPUs attached to each, read from sysfs: what
//! `ugdr_get_device_list` reports (one device per NUMA node).
//!
//! * NUMA nodes are the `node<N>` directories of `<sysfs>/devices/system/node`; a kernel
//!   without NUMA support has none, and the host is then one node, 0.
//! * A GPU is a PCI function in `<sysfs>/bus/pci/devices` with vendor 0x10de (NVIDIA) and a
//!   display-controller class (0x03xxxx: VGA 0x0300, 3D 0x0302); NVIDIA's audio functions,
//!   NVSwitches (0x0680) and other vendors' display devices are not GPUs for this purpose.
//! * GPUs are numbered in PCI bus order (domain, bus, device, function), which is the order
//!   CUDA uses with `CUDA_DEVICE_ORDER=PCI_BUS_ID`. A GPU whose `numa_node` is -1 (the kernel
//!   does not know; common in VMs) is listed on the first node.
//!
//! `UGDR_SYSFS_ROOT` replaces `/sys` (tests feed fake trees through it).

#![forbid(unsafe_code)]

use std::io;
use std::path::{Path, PathBuf};

/// PCI vendor id of NVIDIA.
pub const NVIDIA_VENDOR: u32 = 0x10de;
/// PCI base class of display controllers (VGA, XGA, 3D, other).
pub const DISPLAY_CLASS: u32 = 0x03;

/// One NUMA node and the GPUs attached to it (CUDA device numbers in PCI bus order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    pub node: i32,
    pub gpus: Vec<i32>,
}

/// An NVIDIA GPU found on the PCI bus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The PCI address, e.g. `0000:3b:00.0`.
    pub pci_address: String,
    /// The NUMA node the kernel reports, or -1.
    pub numa_node: i32,
}

/// The sysfs root: `UGDR_SYSFS_ROOT`, else `/sys`.
pub fn sysfs_root() -> PathBuf {
    match std::env::var_os("UGDR_SYSFS_ROOT") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from("/sys"),
    }
}

/// The NUMA nodes of the host under `root` (ascending), each with its GPUs.
/// Fails only when `root` itself cannot be read.
pub fn discover(root: &Path) -> io::Result<Vec<NumaNode>> {
    std::fs::read_dir(root)?;
    let mut nodes: Vec<NumaNode> = numa_nodes(root)
        .into_iter()
        .map(|node| NumaNode {
            node,
            gpus: Vec::new(),
        })
        .collect();
    if nodes.is_empty() {
        nodes.push(NumaNode {
            node: 0,
            gpus: Vec::new(),
        });
    }
    for (index, gpu) in nvidia_gpus(root).iter().enumerate() {
        let at = nodes
            .iter()
            .position(|n| n.node == gpu.numa_node)
            .unwrap_or_else(|| {
                if gpu.numa_node >= 0 {
                    tracing::debug!(
                        "gpu {} reports numa node {}, which sysfs does not list; listed on node {}",
                        gpu.pci_address,
                        gpu.numa_node,
                        nodes[0].node
                    );
                }
                0
            });
        nodes[at].gpus.push(index as i32);
    }
    Ok(nodes)
}

/// The `node<N>` directories of `<root>/devices/system/node`, ascending.
fn numa_nodes(root: &Path) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir(root.join("devices/system/node")) else {
        return Vec::new();
    };
    let mut nodes: Vec<i32> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("node")?
                .parse::<i32>()
                .ok()
        })
        .filter(|n| *n >= 0)
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    nodes
}

/// The NVIDIA display-class PCI functions under `root`, in PCI bus order.
pub fn nvidia_gpus(root: &Path) -> Vec<Gpu> {
    let Ok(dir) = std::fs::read_dir(root.join("bus/pci/devices")) else {
        return Vec::new();
    };
    let mut found: Vec<((u32, u32, u32, u32), Gpu)> = Vec::new();
    for entry in dir.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(order) = parse_pci_address(&name) else {
            continue;
        };
        let path = entry.path();
        let vendor = read_hex(&path.join("vendor"));
        let class = read_hex(&path.join("class"));
        if vendor != Some(NVIDIA_VENDOR) || class.map(|c| c >> 16) != Some(DISPLAY_CLASS) {
            continue;
        }
        let numa_node = std::fs::read_to_string(path.join("numa_node"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .unwrap_or(-1);
        found.push((
            order,
            Gpu {
                pci_address: name,
                numa_node,
            },
        ));
    }
    found.sort_by_key(|a| a.0);
    found.into_iter().map(|(_, g)| g).collect()
}

/// `DDDD:BB:DD.F` (the domain may be wider than 4 digits) as a sortable tuple.
fn parse_pci_address(name: &str) -> Option<(u32, u32, u32, u32)> {
    let (domain, rest) = name.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    Some((
        u32::from_str_radix(domain, 16).ok()?,
        u32::from_str_radix(bus, 16).ok()?,
        u32::from_str_radix(device, 16).ok()?,
        u32::from_str_radix(function, 16).ok()?,
    ))
}

/// A sysfs attribute such as `0x10de` or `0x030200`.
fn read_hex(path: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(path).ok()?;
    let t = text.trim();
    u32::from_str_radix(t.strip_prefix("0x").unwrap_or(t), 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs tree in a fresh temporary directory.
    struct Tree(PathBuf);

    impl Tree {
        fn new(tag: &str) -> Tree {
            let dir = std::env::temp_dir().join(format!(
                "ugdr-topology-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Tree(dir)
        }

        fn node(&self, n: i32) -> &Self {
            std::fs::create_dir_all(self.0.join(format!("devices/system/node/node{n}"))).unwrap();
            self
        }

        fn pci(&self, addr: &str, vendor: &str, class: &str, numa: i32) -> &Self {
            let d = self.0.join("bus/pci/devices").join(addr);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("vendor"), format!("{vendor}\n")).unwrap();
            std::fs::write(d.join("class"), format!("{class}\n")).unwrap();
            std::fs::write(d.join("numa_node"), format!("{numa}\n")).unwrap();
            self
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn no_gpu_one_node() {
        let t = Tree::new("none");
        t.node(0).pci("0000:00:02.0", "0x8086", "0x030000", -1);
        assert_eq!(
            discover(&t.0).unwrap(),
            vec![NumaNode {
                node: 0,
                gpus: vec![]
            }]
        );
    }

    #[test]
    fn two_gpus_on_two_nodes_in_bus_order() {
        let t = Tree::new("two");
        t.node(1)
            .node(0)
            // Listed out of order on purpose: the higher bus is on node 0.
            .pci("0000:af:00.0", "0x10de", "0x030200", 0)
            .pci("0000:3b:00.0", "0x10de", "0x030200", 1)
            .pci("0000:3b:00.1", "0x10de", "0x040300", 1) // the GPU's audio function
            .pci("0000:05:00.0", "0x1a03", "0x030000", 0) // a BMC's VGA (ASPEED)
            .pci("0000:06:00.0", "0x10de", "0x068000", 0); // an NVSwitch
        assert_eq!(
            discover(&t.0).unwrap(),
            vec![
                NumaNode {
                    node: 0,
                    gpus: vec![1]
                },
                NumaNode {
                    node: 1,
                    gpus: vec![0]
                },
            ]
        );
    }

    #[test]
    fn unknown_numa_node_goes_to_the_first_node_and_no_numa_means_node_0() {
        let t = Tree::new("nonuma");
        t.pci("0000:01:00.0", "0x10de", "0x030000", -1).pci(
            "10000:00:00.0",
            "0x10de",
            "0x030200",
            -1,
        );
        assert_eq!(
            discover(&t.0).unwrap(),
            vec![NumaNode {
                node: 0,
                gpus: vec![0, 1]
            }]
        );
    }

    #[test]
    fn missing_root_is_an_error() {
        assert!(discover(Path::new("/nonexistent/ugdr-sysfs")).is_err());
    }

    #[test]
    fn pci_addresses_sort_numerically() {
        assert!(parse_pci_address("0000:0a:00.0") < parse_pci_address("0000:10:00.0"));
        assert!(parse_pci_address("0000:ff:1f.7") < parse_pci_address("10000:00:00.0"));
        assert_eq!(parse_pci_address("bogus"), None);
    }
}
