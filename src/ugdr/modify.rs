//! `ugdr_modify_qp`: ugdr's QP state machine, and the verbs modify each allowed step implies.
//!
//! | from | to | mask (plus optional `UGDR_QP_CUR_STATE`) |
//! |---|---|---|
//! | RESET | INIT | `UGDR_QP_STATE` |
//! | INIT | RTR | `UGDR_QP_STATE \| UGDR_QP_DEST_QPN \| UGDR_QP_DEST_ADDR` |
//! | RTR | RTS | `UGDR_QP_STATE` |
//! | any | ERR | `UGDR_QP_STATE` |
//!
//! Anything else (another pair of states, a missing or an extra attribute, an unknown mask
//! bit or state value, a `cur_qp_state` that is not the QP's state, a `dest_addr` that is not
//! a ugdr address) is EINVAL, and the QP does not change.
//!
//! Each step becomes the verbs modify an RC QP needs for it (`qp_state.rs` checks that table
//! again), with the attributes ugdr's API has no field for set to what RC over UCX uses: port
//! 1, P_Key index 0, remote read and write allowed on the QP (each MR's access flags decide),
//! path MTU 4096, PSNs 0, 16 outstanding reads, and the largest timeouts and retry counts.

use super::address::{ADDR_LEN, PortAddress};
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::device;
use crate::fake_verbs::mr::{ACCESS_REMOTE_READ, ACCESS_REMOTE_WRITE};
use crate::fake_verbs::qp::{ModifyRequest, QpAttributes};
use crate::fake_verbs::qp_state::{AttrMask, QpState};

/// `enum ugdr_qp_attr_mask`.
pub const MASK_STATE: u32 = 1;
pub const MASK_CUR_STATE: u32 = 2;
pub const MASK_DEST_QPN: u32 = 4;
pub const MASK_DEST_ADDR: u32 = 8;
const MASK_KNOWN: u32 = MASK_STATE | MASK_CUR_STATE | MASK_DEST_QPN | MASK_DEST_ADDR;

/// `enum ugdr_qp_state` values → the verbs state.
pub fn state_from_raw(raw: u32) -> Option<QpState> {
    match raw {
        0 => Some(QpState::Reset),
        1 => Some(QpState::Init),
        2 => Some(QpState::Rtr),
        3 => Some(QpState::Rts),
        4 => Some(QpState::Err),
        _ => None,
    }
}

/// The `enum ugdr_qp_state` value of a verbs state (the states a ugdr QP can be in).
#[cfg(test)]
fn state_to_raw(s: QpState) -> u32 {
    match s {
        QpState::Reset => 0,
        QpState::Init => 1,
        QpState::Rtr => 2,
        QpState::Rts => 3,
        _ => 4,
    }
}

/// One `ugdr_modify_qp` call as the application wrote it (enums still raw).
#[derive(Debug, Clone, Copy)]
pub struct UgdrModify {
    pub mask: u32,
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub dest_qp_num: u32,
    pub dest_addr: [u8; ADDR_LEN],
}

/// What to do: the verbs modifies, in order, and for INIT→RTR the port to connect to.
#[derive(Debug, Clone)]
pub struct Plan {
    /// One step, or two for RESET→ERR: verbs has no RESET→ERR (the kernel's table), so the QP
    /// passes through INIT, which always succeeds with the attributes below. A QP in RESET
    /// has no work requests, so nothing is flushed either way.
    pub steps: Vec<ModifyRequest>,
    pub destination: Option<PortAddress>,
}

/// Checks `m` against the table above for a QP now in `cur`.
pub fn plan(cur: QpState, m: &UgdrModify) -> Result<Plan, VerbsError> {
    if m.mask & !MASK_KNOWN != 0 {
        return Err(VerbsError::Invalid("unknown attr_mask bits"));
    }
    if m.mask & MASK_STATE == 0 {
        return Err(VerbsError::Invalid("attr_mask lacks UGDR_QP_STATE"));
    }
    let next = state_from_raw(m.qp_state).ok_or(VerbsError::Invalid("qp_state"))?;
    if m.mask & MASK_CUR_STATE != 0 {
        let claimed = state_from_raw(m.cur_qp_state).ok_or(VerbsError::Invalid("cur_qp_state"))?;
        if claimed != cur {
            return Err(VerbsError::Invalid("cur_qp_state is not the QP's state"));
        }
    }
    let attrs_given = m.mask & (MASK_DEST_QPN | MASK_DEST_ADDR);
    let attrs_needed = match (cur, next) {
        (_, QpState::Err) => 0,
        (QpState::Reset, QpState::Init) | (QpState::Rtr, QpState::Rts) => 0,
        (QpState::Init, QpState::Rtr) => MASK_DEST_QPN | MASK_DEST_ADDR,
        _ => return Err(VerbsError::Invalid("qp state transition not allowed")),
    };
    if attrs_given != attrs_needed {
        return Err(VerbsError::Invalid(if attrs_given & !attrs_needed != 0 {
            "attribute not allowed in this transition"
        } else {
            "INIT to RTR needs UGDR_QP_DEST_QPN and UGDR_QP_DEST_ADDR"
        }));
    }
    if (cur, next) == (QpState::Reset, QpState::Err) {
        let (init, _) = verbs_step(QpState::Init, m)?;
        let (err, _) = verbs_step(QpState::Err, m)?;
        return Ok(Plan {
            steps: vec![init, err],
            destination: None,
        });
    }
    let (step, destination) = verbs_step(next, m)?;
    Ok(Plan {
        steps: vec![step],
        destination,
    })
}

/// The verbs modify that takes an RC QP into `next` (from the state before it in the table).
fn verbs_step(
    next: QpState,
    m: &UgdrModify,
) -> Result<(ModifyRequest, Option<PortAddress>), VerbsError> {
    let mut attrs = QpAttributes::default();
    let mut mask = AttrMask::STATE;
    let mut destination = None;
    match next {
        QpState::Init => {
            mask = mask | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS;
            attrs.port_num = device::PORT_NUM;
            attrs.pkey_index = 0;
            attrs.access_flags = ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ;
        }
        QpState::Rtr => {
            if m.dest_qp_num > 0x00ff_ffff || m.dest_qp_num < 2 {
                return Err(VerbsError::Invalid("dest_qp_num"));
            }
            let dest = PortAddress::decode(&m.dest_addr)?;
            mask = mask
                | AttrMask::AV
                | AttrMask::PATH_MTU
                | AttrMask::DEST_QPN
                | AttrMask::RQ_PSN
                | AttrMask::MAX_DEST_RD_ATOMIC
                | AttrMask::MIN_RNR_TIMER;
            attrs.dest_qp_num = m.dest_qp_num;
            attrs.ah.dlid = dest.lid;
            attrs.ah.is_global = true;
            attrs.ah.grh.dgid = dest.gid;
            attrs.ah.grh.hop_limit = 1;
            attrs.ah.port_num = device::PORT_NUM;
            attrs.path_mtu = 5; // IBV_MTU_4096
            attrs.max_dest_rd_atomic = device::MAX_RD_ATOMIC as u8;
            attrs.min_rnr_timer = 12;
            destination = Some(dest);
        }
        QpState::Rts => {
            mask = mask
                | AttrMask::SQ_PSN
                | AttrMask::TIMEOUT
                | AttrMask::RETRY_CNT
                | AttrMask::RNR_RETRY
                | AttrMask::MAX_QP_RD_ATOMIC;
            attrs.timeout = 14;
            attrs.retry_cnt = 7;
            attrs.rnr_retry = 7;
            attrs.max_rd_atomic = device::MAX_RD_ATOMIC as u8;
        }
        _ => {}
    }
    Ok((
        ModifyRequest {
            mask,
            state: Some(next),
            claimed_cur: None,
            attrs,
        },
        destination,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::address::port_gid;
    use crate::fake_verbs::qp_state::{QpType, check_transition};

    fn addr() -> [u8; ADDR_LEN] {
        PortAddress {
            lid: 0x0102,
            gid: port_gid(std::net::Ipv4Addr::new(192, 168, 1, 1), 0x0102),
        }
        .encode()
    }

    fn m(mask: u32, to: u32) -> UgdrModify {
        UgdrModify {
            mask,
            qp_state: to,
            cur_qp_state: 0,
            dest_qp_num: 0x1234,
            dest_addr: addr(),
        }
    }

    const ALL: [QpState; 5] = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Err,
    ];

    /// The mask each allowed (from, to) needs, None where the step is not allowed.
    fn allowed(from: QpState, to: QpState) -> Option<u32> {
        match (from, to) {
            (_, QpState::Err) => Some(MASK_STATE),
            (QpState::Reset, QpState::Init) | (QpState::Rtr, QpState::Rts) => Some(MASK_STATE),
            (QpState::Init, QpState::Rtr) => Some(MASK_STATE | MASK_DEST_QPN | MASK_DEST_ADDR),
            _ => None,
        }
    }

    #[test]
    fn every_cell_of_the_table() {
        for from in ALL {
            for to in ALL {
                for mask in 0..16u32 {
                    let got = plan(from, &m(mask, state_to_raw(to)));
                    let ok = allowed(from, to).is_some_and(|need| mask & !MASK_CUR_STATE == need)
                        // m() claims RESET as the current state.
                        && (mask & MASK_CUR_STATE == 0 || from == QpState::Reset);
                    assert_eq!(
                        got.is_ok(),
                        ok,
                        "{from:?} -> {to:?} mask {mask:#x}: {got:?}"
                    );
                    if let Ok(p) = got {
                        // The verbs table accepts what ugdr expands each step to, in order.
                        let mut at = from;
                        for step in &p.steps {
                            let next = step.state.expect("every step sets the state");
                            let verbs = check_transition(QpType::Rc, at, next, step.mask, None);
                            assert!(verbs.is_ok(), "{from:?} -> {to:?} via {at:?}: {verbs:?}");
                            at = next;
                        }
                        assert_eq!(at, to);
                        assert_eq!(p.destination.is_some(), to == QpState::Rtr);
                    }
                }
            }
        }
    }

    #[test]
    fn cur_state_must_match_and_values_are_checked() {
        let mut x = m(MASK_STATE | MASK_CUR_STATE, 1);
        x.cur_qp_state = 0;
        assert!(plan(QpState::Reset, &x).is_ok());
        x.cur_qp_state = 1;
        assert!(plan(QpState::Reset, &x).is_err());
        x.cur_qp_state = 9;
        assert!(plan(QpState::Reset, &x).is_err());
        assert!(plan(QpState::Reset, &m(MASK_STATE, 5)).is_err());
        assert!(plan(QpState::Reset, &m(MASK_STATE | 16, 1)).is_err());
        let rtr = MASK_STATE | MASK_DEST_QPN | MASK_DEST_ADDR;
        let mut y = m(rtr, 2);
        y.dest_addr[0] = 0;
        assert!(plan(QpState::Init, &y).is_err());
        let mut z = m(rtr, 2);
        z.dest_qp_num = 1 << 24;
        assert!(plan(QpState::Init, &z).is_err());
    }
}
