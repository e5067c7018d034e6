//! Work requests and work completions in validated Rust form (from `ibv_send_wr`,
//! `ibv_recv_wr`, to `ibv_wc`). Numeric values match rdma-core's enums.

use super::ah::AddressHandle;
use super::mw::BindRequest;
use smallvec::SmallVec;
use std::sync::Arc;

/// One scatter/gather element as the application gave it (not yet checked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

pub type SgeList = SmallVec<[Sge; 4]>;

/// The bytes of an IBV_SEND_INLINE request (small ones without a heap allocation).
pub type InlineData = crate::ucp::OwnedBytes;

/// `enum ibv_wr_opcode`, the ones ugdr carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOpcode {
    RdmaWrite,
    RdmaWriteWithImm,
    Send,
    SendWithImm,
    RdmaRead,
    AtomicCmpAndSwp,
    AtomicFetchAndAdd,
    /// Invalidates a type 2 memory window of this process (`rkey`: its key).
    LocalInv,
    /// Binds a memory window ([`SendRequest::bind`]).
    BindMw,
    /// A SEND that invalidates the peer's memory window `rkey` (remote invalidation).
    SendWithInv,
    /// RDMA ATOMIC WRITE (`ibv_wr_atomic_write` only, as rxe: `ibv_post_send` has no
    /// operand for it): the 8 bytes in [`SendRequest::compare_add`] (their bytes as given)
    /// are stored at the 8-byte aligned `remote_addr` in one indivisible write.
    AtomicWrite,
}

impl SendOpcode {
    /// From `enum ibv_wr_opcode`; None for values ugdr does not carry.
    pub fn from_raw(v: u32) -> Option<SendOpcode> {
        Some(match v {
            0 => SendOpcode::RdmaWrite,
            1 => SendOpcode::RdmaWriteWithImm,
            2 => SendOpcode::Send,
            3 => SendOpcode::SendWithImm,
            4 => SendOpcode::RdmaRead,
            5 => SendOpcode::AtomicCmpAndSwp,
            6 => SendOpcode::AtomicFetchAndAdd,
            7 => SendOpcode::LocalInv,
            8 => SendOpcode::BindMw,
            9 => SendOpcode::SendWithInv,
            _ => return None,
        })
    }

    /// The completion opcode a send-queue completion of this request carries.
    pub fn completion_opcode(self) -> WcOpcode {
        match self {
            SendOpcode::Send | SendOpcode::SendWithImm | SendOpcode::SendWithInv => WcOpcode::Send,
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            SendOpcode::RdmaRead => WcOpcode::RdmaRead,
            SendOpcode::AtomicCmpAndSwp => WcOpcode::CompSwap,
            SendOpcode::AtomicFetchAndAdd => WcOpcode::FetchAdd,
            SendOpcode::LocalInv => WcOpcode::LocalInv,
            SendOpcode::BindMw => WcOpcode::BindMw,
            SendOpcode::AtomicWrite => WcOpcode::AtomicWrite,
        }
    }
}

/// A send work request (`ibv_send_wr`), checked for shape but not yet for keys.
#[derive(Debug, Clone)]
pub struct SendRequest {
    pub wr_id: u64,
    pub opcode: SendOpcode,
    pub sges: SgeList,
    /// The bytes of an IBV_SEND_INLINE request, copied at post time.
    pub inline_data: Option<InlineData>,
    /// imm_data exactly as the application stored it (network byte order).
    pub imm_data: u32,
    pub signaled: bool,
    pub solicited: bool,
    pub fence: bool,
    pub remote_addr: u64,
    /// The remote key of RDMA and atomics; for LOCAL_INV and SEND_WITH_INV the key to
    /// invalidate (`invalidate_rkey`).
    pub rkey: u32,
    pub compare_add: u64,
    pub swap: u64,
    /// UD: where the datagram goes (`wr.ud`, or `ibv_wr_set_ud_addr`).
    pub ud: Option<UdDestination>,
    /// BIND_MW: the window, the region and the range it is bound to.
    pub bind: Option<Box<BindRequest>>,
    /// XRC_SEND: the SRQ at the target (`qp_type.xrc.remote_srqn`, `ibv_wr_set_xrc_srqn`).
    pub xrc_srqn: u32,
}

/// The destination of a UD send: an address handle, the remote QP and its Q_Key.
#[derive(Clone)]
pub struct UdDestination {
    pub ah: Arc<AddressHandle>,
    pub remote_qpn: u32,
    /// As posted: a value with the high bit set means "use the sending QP's own Q_Key".
    pub remote_qkey: u32,
}

impl std::fmt::Debug for UdDestination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UdDestination")
            .field("dlid", &self.ah.av.dlid)
            .field("remote_qpn", &self.remote_qpn)
            .field("remote_qkey", &self.remote_qkey)
            .finish()
    }
}

impl SendRequest {
    /// A request for `wr_id` with no data, keys or flags.
    pub fn new(wr_id: u64, opcode: SendOpcode) -> SendRequest {
        SendRequest {
            wr_id,
            opcode,
            sges: SgeList::new(),
            inline_data: None,
            imm_data: 0,
            signaled: false,
            solicited: false,
            fence: false,
            remote_addr: 0,
            rkey: 0,
            compare_add: 0,
            swap: 0,
            ud: None,
            bind: None,
            xrc_srqn: 0,
        }
    }

    pub fn length(&self) -> u64 {
        if self.opcode == SendOpcode::AtomicWrite {
            return 8;
        }
        match &self.inline_data {
            Some(d) => d.len() as u64,
            None => sges_length(&self.sges),
        }
    }
}

/// The bytes of a gather or scatter list in all; one SGE (most WRs) read without a loop.
#[inline]
pub fn sges_length(sges: &[Sge]) -> u64 {
    match sges {
        [one] => u64::from(one.length),
        _ => sges.iter().map(|s| u64::from(s.length)).sum(),
    }
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Debug, Clone)]
pub struct RecvRequest {
    pub wr_id: u64,
    pub sges: SgeList,
}

impl RecvRequest {
    /// The bytes its buffers hold (its SGEs' lengths added up).
    pub fn room(&self) -> u64 {
        sges_length(&self.sges)
    }
}

/// `enum ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    LocRddViolErr = 14,
    RemInvRdReqErr = 15,
    RemAbortErr = 16,
    InvEecnErr = 17,
    InvEecStateErr = 18,
    FatalErr = 19,
    RespTimeoutErr = 20,
    GeneralErr = 21,
}

impl WcStatus {
    pub fn from_raw(v: u32) -> WcStatus {
        match v {
            0 => WcStatus::Success,
            1 => WcStatus::LocLenErr,
            2 => WcStatus::LocQpOpErr,
            4 => WcStatus::LocProtErr,
            5 => WcStatus::WrFlushErr,
            8 => WcStatus::LocAccessErr,
            9 => WcStatus::RemInvReqErr,
            10 => WcStatus::RemAccessErr,
            11 => WcStatus::RemOpErr,
            12 => WcStatus::RetryExcErr,
            13 => WcStatus::RnrRetryExcErr,
            6 => WcStatus::MwBindErr,
            _ => WcStatus::GeneralErr,
        }
    }
}

/// `enum ibv_wc_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    BindMw = 5,
    LocalInv = 6,
    AtomicWrite = 9,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

/// `IBV_WC_WITH_IMM`, `IBV_WC_GRH` and `IBV_WC_WITH_INV` (`enum ibv_wc_flags`).
pub const WC_WITH_IMM: u32 = 1 << 1;
pub const WC_GRH: u32 = 1 << 0;
pub const WC_WITH_INV: u32 = 1 << 3;

/// A completion (`ibv_wc`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Network byte order, as the sender posted it; valid when `wc_flags` has WC_WITH_IMM.
    /// With WC_WITH_INV: the rkey the sender invalidated (`invalidated_rkey`, host order).
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
    /// The device clock when the completion reached its CQ (`clock::raw_clock`), if the CQ
    /// asked for it (`IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`), else 0.
    pub completion_ts: u64,
    /// The wall clock then, in ns since the epoch (`..._TIMESTAMP_WALLCLOCK`), else 0.
    pub completion_wallclock_ns: u64,
    /// The XRC SRQ a receive of an XRC target QP came from (0: none), as a CQE names it: the
    /// completion goes to that SRQ's CQ.
    pub xrc_srqn: u32,
}

impl WorkCompletion {
    /// A completion for `wr_id` on `qp_num` with everything else zero.
    pub fn new(wr_id: u64, status: WcStatus, opcode: WcOpcode, qp_num: u32) -> WorkCompletion {
        WorkCompletion {
            wr_id,
            status,
            opcode,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num,
            src_qp: 0,
            wc_flags: 0,
            pkey_index: 0,
            slid: 0,
            sl: 0,
            dlid_path_bits: 0,
            completion_ts: 0,
            completion_wallclock_ns: 0,
            xrc_srqn: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gather_list_is_as_long_as_its_sges_added_up() {
        let sge = |length: u32| Sge {
            addr: 0,
            length,
            lkey: 1,
        };
        assert_eq!(sges_length(&[]), 0);
        assert_eq!(sges_length(&[sge(64)]), 64);
        assert_eq!(
            sges_length(&[sge(64), sge(0), sge(u32::MAX)]),
            64 + u64::from(u32::MAX)
        );
        let recv = RecvRequest {
            wr_id: 1,
            sges: [sge(8), sge(16)].into_iter().collect(),
        };
        assert_eq!(recv.room(), 24);
        let mut send = SendRequest::new(2, SendOpcode::Send);
        send.sges = [sge(5), sge(6), sge(7), sge(8), sge(9)]
            .into_iter()
            .collect();
        assert_eq!(send.length(), 35, "an SGE list spilled off the stack");
    }
}
