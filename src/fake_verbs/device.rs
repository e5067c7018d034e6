//! ugdr's virtual device `ugdr0`: what `ibv_query_device` and `ibv_query_port` report.

/// Device-wide limits and identity (`ibv_device_attr`), in Rust form.
#[derive(Debug, Clone)]
pub struct DeviceAttributes {
    pub fw_ver: &'static str,
    pub node_guid: [u8; 8],
    pub sys_image_guid: [u8; 8],
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: i32,
    pub max_qp_wr: i32,
    pub max_sge: i32,
    pub max_sge_rd: i32,
    pub max_cq: i32,
    pub max_cqe: i32,
    pub max_mr: i32,
    pub max_pd: i32,
    pub max_qp_rd_atom: i32,
    pub max_qp_init_rd_atom: i32,
    pub max_srq: i32,
    pub max_ah: i32,
    pub max_srq_wr: i32,
    pub max_srq_sge: i32,
    pub max_pkeys: u16,
    pub phys_port_cnt: u8,
    pub max_inline_data: u32,
}

pub const DEVICE_NAME: &str = "ugdr0";
/// Never a node under /dev/infiniband, so UCX's own uct_ib never opens ugdr's device.
pub const DEVICE_DEV_NAME: &str = "ugdr_virtual0";
pub const PORT_NUM: u8 = 1;
pub const GID_TABLE_LEN: i32 = 1;
pub const PKEY_TABLE_LEN: u16 = 1;
pub const DEFAULT_PKEY: u16 = 0xffff;
pub const MAX_INLINE_DATA: u32 = 1024;
pub const MAX_SGE: i32 = 32;
pub const MAX_QP_WR: i32 = 16384;
pub const MAX_CQE: i32 = 1 << 22;
pub const MAX_RD_ATOMIC: i32 = 16;
/// The port's active MTU in bytes (`IBV_MTU_4096`): the largest UD message.
pub const ACTIVE_MTU_BYTES: u32 = 4096;
// Multicast receivers fetch nothing larger than the engine's bound.
const _: () =
    assert!(16 + ACTIVE_MTU_BYTES as usize <= crate::engine::multicast::MAX_FRAMED_DATAGRAM);
/// The area in front of every UD receive where the Global Routing Header lands.
pub const GRH_LEN: usize = 40;
/// Largest message (the port's max_msg_sz): 1 GiB.
pub const MAX_MSG_SIZE: u32 = 1 << 30;
/// Device memory (`max_dm_size`), host memory behind it: at most this much per process.
pub const MAX_DM_SIZE: u64 = 4 << 20;

/// On-demand paging (`ibv_odp_caps`): explicit and implicit (whole address space) ODP MRs,
/// for every operation of every transport ugdr carries. Software needs no pinning; each
/// access checks that its range is mapped at that moment.
pub mod odp {
    /// `IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT`.
    pub const GENERAL_CAPS: u64 = 1 | 1 << 1;
    const SEND: u32 = 1 << 0;
    const RECV: u32 = 1 << 1;
    const WRITE: u32 = 1 << 2;
    const READ: u32 = 1 << 3;
    const ATOMIC: u32 = 1 << 4;
    const SRQ_RECV: u32 = 1 << 5;
    const ATOMIC_WRITE: u32 = 1 << 7;
    pub const RC_CAPS: u32 = SEND | RECV | WRITE | READ | ATOMIC | SRQ_RECV | ATOMIC_WRITE;
    pub const UC_CAPS: u32 = SEND | RECV | WRITE | SRQ_RECV;
    pub const UD_CAPS: u32 = SEND | RECV | SRQ_RECV;
    /// XRC carries SENDs into XRC SRQs, RDMA and atomics.
    pub const XRC_CAPS: u32 = SEND | WRITE | READ | ATOMIC | SRQ_RECV;
}

impl DeviceAttributes {
    pub fn new(node_guid: [u8; 8]) -> DeviceAttributes {
        DeviceAttributes {
            fw_ver: concat!("ugdr ", env!("CARGO_PKG_VERSION")),
            node_guid,
            sys_image_guid: node_guid,
            max_mr_size: u64::MAX,
            page_size_cap: 0xffff_f000,
            // By default a software device of no registered vendor: applications that key
            // behaviour off the vendor (perftest) take their generic paths.
            // UGDR_DEVICE_PROFILE picks another identity.
            vendor_id: profile().vendor_id,
            vendor_part_id: profile().vendor_part_id,
            hw_ver: 1,
            max_qp: 1 << 16,
            max_qp_wr: MAX_QP_WR,
            max_sge: MAX_SGE,
            max_sge_rd: MAX_SGE,
            max_cq: 1 << 16,
            max_cqe: MAX_CQE,
            max_mr: 1 << 20,
            max_pd: 1 << 16,
            max_qp_rd_atom: MAX_RD_ATOMIC,
            max_qp_init_rd_atom: MAX_RD_ATOMIC,
            max_srq: 1 << 16,
            max_ah: 1 << 16,
            max_srq_wr: MAX_QP_WR,
            max_srq_sge: MAX_SGE,
            max_pkeys: PKEY_TABLE_LEN,
            phys_port_cnt: 1,
            max_inline_data: MAX_INLINE_DATA,
        }
    }
}

/// An identity ugdr's device can present (`UGDR_DEVICE_PROFILE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceProfile {
    pub name: &'static str,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
}

/// ugdr's own identity: vendor 0xFFFFFF, the id Linux's software RDMA device (rxe) reports,
/// which claims no company's IEEE OUI (0 is reported by no real device, and ugdr is not
/// Mellanox), and part 0x7567 ("ug") for ugdr under it. perftest knows neither (it keys off
/// vendors 5157 and 0x8086 and a table of part ids), so it takes its generic post-send path
/// without inline data; SPDK treats the vendor as rxe's: no SEND_WITH_INV, and no wait for
/// LAST_WQE_REACHED at SRQ teardown.
pub const PROFILE_UGDR: DeviceProfile = DeviceProfile {
    name: "ugdr",
    vendor_id: 0x00ff_ffff,
    vendor_part_id: 0x7567,
};
/// A ConnectX-6-like identity (Mellanox vendor 0x02c9, part 4123): perftest then takes the
/// `ibv_wr_*` path it takes on that hardware.
pub const PROFILE_CONNECTX6: DeviceProfile = DeviceProfile {
    name: "connectx6",
    vendor_id: 0x02c9,
    vendor_part_id: 4123,
};

/// The profile `UGDR_DEVICE_PROFILE` names (`ugdr`, the default, or `connectx6`); an unknown
/// name is logged and ignored.
pub fn profile() -> DeviceProfile {
    static PROFILE: std::sync::OnceLock<DeviceProfile> = std::sync::OnceLock::new();
    *PROFILE.get_or_init(|| match std::env::var("UGDR_DEVICE_PROFILE").as_deref() {
        Err(_) | Ok("") | Ok("ugdr") => PROFILE_UGDR,
        Ok("connectx6") => PROFILE_CONNECTX6,
        Ok(other) => {
            tracing::warn!(
                "UGDR_DEVICE_PROFILE={other:?} is not a known profile (ugdr, connectx6); using ugdr"
            );
            PROFILE_UGDR
        }
    })
}

/// Port 1's attributes (`ibv_port_attr`), in Rust form.
#[derive(Debug, Clone)]
pub struct PortAttributes {
    pub lid: u16,
    pub sm_lid: u16,
    pub gid: [u8; 16],
}
