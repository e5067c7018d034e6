//! What a queue pair is created and modified with: the granted queue sizes (`ibv_qp_cap`),
//! address vectors, the attributes `ibv_modify_qp` sets and `ibv_query_qp` reports, and the
//! value checks a modify must pass before any of it applies.

use super::super::qp_state::{AttrMask, QpState};
use super::super::{VerbsError, device};

/// Queue sizes granted at creation (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

impl QpCaps {
    /// What ugdr grants for a request (`ibv_create_qp` may raise, never lower, the caps).
    pub fn grant(requested: QpCaps) -> Result<QpCaps, VerbsError> {
        let max_wr = device::MAX_QP_WR as u32;
        let max_sge = device::MAX_SGE as u32;
        if requested.max_send_wr > max_wr || requested.max_recv_wr > max_wr {
            return Err(VerbsError::Invalid("more work requests than max_qp_wr"));
        }
        if requested.max_send_sge > max_sge || requested.max_recv_sge > max_sge {
            return Err(VerbsError::Invalid("more SGEs than max_sge"));
        }
        if requested.max_inline_data > device::MAX_INLINE_DATA {
            return Err(VerbsError::Invalid(
                "max_inline_data above the device limit",
            ));
        }
        Ok(QpCaps {
            max_send_wr: requested.max_send_wr.max(1),
            max_recv_wr: requested.max_recv_wr.max(1),
            max_send_sge: requested.max_send_sge.max(1),
            max_recv_sge: requested.max_recv_sge.max(1),
            max_inline_data: requested.max_inline_data.max(64),
        })
    }
}

/// Global routing header fields of an address vector (`ibv_global_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GlobalRoute {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// An address vector (`ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AddressVector {
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: bool,
    pub port_num: u8,
    pub grh: GlobalRoute,
}

/// The attributes `ibv_modify_qp` sets and `ibv_query_qp` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttributes {
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub access_flags: u32,
    pub pkey_index: u16,
    pub port_num: u8,
    pub path_mtu: u32,
    pub ah: AddressVector,
    pub alt_ah: AddressVector,
    pub alt_pkey_index: u16,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub path_mig_state: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub en_sqd_async_notify: u8,
}

/// One `ibv_modify_qp` call, converted.
#[derive(Debug, Clone, Copy)]
pub struct ModifyRequest {
    pub mask: AttrMask,
    pub state: Option<QpState>,
    pub claimed_cur: Option<QpState>,
    pub attrs: QpAttributes,
}

/// The bits `enum ibv_access_flags` defines: LOCAL_WRITE up to FLUSH_PERSISTENT (1 << 9), and
/// the optional range.
const QP_ACCESS_DEFINED: u32 = 0x3ff | super::super::mr::ACCESS_OPTIONAL_RANGE;

pub(super) fn check_values(req: &ModifyRequest) -> Result<(), VerbsError> {
    let m = req.mask;
    let a = &req.attrs;
    if m.contains(AttrMask::PORT) && a.port_num != device::PORT_NUM {
        return Err(VerbsError::Invalid("port_num"));
    }
    if m.contains(AttrMask::PKEY_INDEX) && a.pkey_index >= device::PKEY_TABLE_LEN {
        return Err(VerbsError::Invalid("pkey_index"));
    }
    if m.contains(AttrMask::PATH_MTU) && !(1..=5).contains(&a.path_mtu) {
        return Err(VerbsError::Invalid("path_mtu"));
    }
    // Any flag of `enum ibv_access_flags` is accepted, only the remote ones mean anything for
    // a QP: the kernel passes qp_access_flags through unchecked and rxe and mlx5 ignore the
    // region-only ones (rdma-core's ODP tests give a QP the MR's flags, ON_DEMAND included).
    if m.contains(AttrMask::ACCESS_FLAGS) && a.access_flags & !QP_ACCESS_DEFINED != 0 {
        return Err(VerbsError::Invalid("qp_access_flags"));
    }
    if m.contains(AttrMask::MAX_QP_RD_ATOMIC) && i32::from(a.max_rd_atomic) > device::MAX_RD_ATOMIC
    {
        return Err(VerbsError::Invalid("max_rd_atomic"));
    }
    if m.contains(AttrMask::MAX_DEST_RD_ATOMIC)
        && i32::from(a.max_dest_rd_atomic) > device::MAX_RD_ATOMIC
    {
        return Err(VerbsError::Invalid("max_dest_rd_atomic"));
    }
    if m.contains(AttrMask::TIMEOUT) && a.timeout > 31 {
        return Err(VerbsError::Invalid("timeout"));
    }
    if m.contains(AttrMask::RETRY_CNT) && a.retry_cnt > 7 {
        return Err(VerbsError::Invalid("retry_cnt"));
    }
    if m.contains(AttrMask::RNR_RETRY) && a.rnr_retry > 7 {
        return Err(VerbsError::Invalid("rnr_retry"));
    }
    if m.contains(AttrMask::MIN_RNR_TIMER) && a.min_rnr_timer > 31 {
        return Err(VerbsError::Invalid("min_rnr_timer"));
    }
    if m.contains(AttrMask::DEST_QPN) && a.dest_qp_num >= 1 << 24 {
        return Err(VerbsError::Invalid("dest_qp_num"));
    }
    if m.contains(AttrMask::AV) {
        if a.ah.port_num != 0 && a.ah.port_num != device::PORT_NUM {
            return Err(VerbsError::Invalid("ah_attr.port_num"));
        }
        if a.ah.is_global && i32::from(a.ah.grh.sgid_index) >= device::GID_TABLE_LEN {
            return Err(VerbsError::Invalid("ah_attr.grh.sgid_index"));
        }
        if !a.ah.is_global && a.ah.dlid == 0 {
            return Err(VerbsError::Invalid("ah_attr.dlid is 0 and no GRH"));
        }
    }
    Ok(())
}

pub(super) fn apply_attrs(a: &mut QpAttributes, req: &ModifyRequest) {
    let m = req.mask;
    let r = &req.attrs;
    macro_rules! set {
        ($bit:ident, $($f:ident),+) => { if m.contains(AttrMask::$bit) { $(a.$f = r.$f;)+ } };
    }
    set!(QKEY, qkey);
    set!(RQ_PSN, rq_psn);
    set!(SQ_PSN, sq_psn);
    set!(DEST_QPN, dest_qp_num);
    set!(ACCESS_FLAGS, access_flags);
    set!(PKEY_INDEX, pkey_index);
    set!(PORT, port_num);
    set!(PATH_MTU, path_mtu);
    set!(AV, ah);
    set!(ALT_PATH, alt_ah, alt_pkey_index, alt_port_num, alt_timeout);
    set!(PATH_MIG_STATE, path_mig_state);
    set!(TIMEOUT, timeout);
    set!(RETRY_CNT, retry_cnt);
    set!(RNR_RETRY, rnr_retry);
    set!(MIN_RNR_TIMER, min_rnr_timer);
    set!(MAX_QP_RD_ATOMIC, max_rd_atomic);
    set!(MAX_DEST_RD_ATOMIC, max_dest_rd_atomic);
    set!(EN_SQD_ASYNC_NOTIFY, en_sqd_async_notify);
}
