//! The InfiniBand QP state machine as a table: which `ibv_modify_qp` transitions exist for
//! each QP type, and which attributes each requires or accepts (IBA 11.2.5; the same table as
//! the Linux kernel's `qp_state_table`). RESET→ERR is not a transition there, and is not here.

/// QP states, numbered as `enum ibv_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Err,
}
impl QpState {
    pub fn from_raw(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::Reset,
            1 => Self::Init,
            2 => Self::Rtr,
            3 => Self::Rts,
            4 => Self::Sqd,
            5 => Self::Sqe,
            6 => Self::Err,
            _ => return None,
        })
    }
    pub fn to_raw(self) -> u32 {
        self as u32
    }
}
/// QP transport types, numbered as `enum ibv_qp_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    Rc,
    Uc,
    Ud,
    XrcSend,
    XrcRecv,
}
impl QpType {
    pub fn from_raw(v: u32) -> Option<Self> {
        Some(match v {
            2 => Self::Rc,
            3 => Self::Uc,
            4 => Self::Ud,
            9 => Self::XrcSend,
            10 => Self::XrcRecv,
            _ => return None,
        })
    }
    pub fn to_raw(self) -> u32 {
        match self {
            Self::Rc => 2,
            Self::Uc => 3,
            Self::Ud => 4,
            Self::XrcSend => 9,
            Self::XrcRecv => 10,
        }
    }
}
/// A set of `enum ibv_qp_attr_mask` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttrMask(pub u32);
impl AttrMask {
    pub const STATE: AttrMask = AttrMask(1);
    pub const CUR_STATE: AttrMask = AttrMask(1 << 1);
    pub const EN_SQD_ASYNC_NOTIFY: AttrMask = AttrMask(1 << 2);
    pub const ACCESS_FLAGS: AttrMask = AttrMask(1 << 3);
    pub const PKEY_INDEX: AttrMask = AttrMask(1 << 4);
    pub const PORT: AttrMask = AttrMask(1 << 5);
    pub const QKEY: AttrMask = AttrMask(1 << 6);
    pub const AV: AttrMask = AttrMask(1 << 7);
    pub const PATH_MTU: AttrMask = AttrMask(1 << 8);
    pub const TIMEOUT: AttrMask = AttrMask(1 << 9);
    pub const RETRY_CNT: AttrMask = AttrMask(1 << 10);
    pub const RNR_RETRY: AttrMask = AttrMask(1 << 11);
    pub const RQ_PSN: AttrMask = AttrMask(1 << 12);
    pub const MAX_QP_RD_ATOMIC: AttrMask = AttrMask(1 << 13);
    pub const ALT_PATH: AttrMask = AttrMask(1 << 14);
    pub const MIN_RNR_TIMER: AttrMask = AttrMask(1 << 15);
    pub const SQ_PSN: AttrMask = AttrMask(1 << 16);
    pub const MAX_DEST_RD_ATOMIC: AttrMask = AttrMask(1 << 17);
    pub const PATH_MIG_STATE: AttrMask = AttrMask(1 << 18);
    pub const CAP: AttrMask = AttrMask(1 << 19);
    pub const DEST_QPN: AttrMask = AttrMask(1 << 20);
    pub const RATE_LIMIT: AttrMask = AttrMask(1 << 25);
    pub fn contains(self, o: AttrMask) -> bool {
        self.0 & o.0 == o.0
    }
    pub fn bits(self) -> u32 {
        self.0
    }
}
impl std::ops::BitOr for AttrMask {
    type Output = AttrMask;
    fn bitor(self, o: AttrMask) -> AttrMask {
        AttrMask(self.0 | o.0)
    }
}
/// Why a modify was refused (logged; every case is EINVAL at the C edge).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransitionError {
    Invalid {
        qp_type: QpType,
        cur: QpState,
        next: QpState,
    },
    Missing {
        cur: QpState,
        next: QpState,
        missing: AttrMask,
    },
    Unexpected {
        cur: QpState,
        next: QpState,
        unexpected: AttrMask,
    },
    CurStateMismatch {
        actual: QpState,
        claimed: QpState,
    },
}
/// The (required, optional) attribute masks of `cur → next` for `t`; None if no such transition.
pub fn transition_masks(t: QpType, cur: QpState, next: QpState) -> Option<(AttrMask, AttrMask)> {
    use AttrMask as M;
    use QpState::*;
    let none = M(0);
    let rc_like = matches!(t, QpType::Rc | QpType::XrcSend | QpType::XrcRecv);
    Some(match (cur, next) {
        (_, Reset) | (_, Err) if cur != Reset || next == Reset => (none, none),
        (Reset, Init) | (Init, Init) => {
            let set = if t == QpType::Ud {
                M::PKEY_INDEX | M::PORT | M::QKEY
            } else {
                M::PKEY_INDEX | M::PORT | M::ACCESS_FLAGS
            };
            if cur == Reset {
                (set, none)
            } else {
                (none, set)
            }
        }
        (Init, Rtr) => match t {
            QpType::Ud => (none, M::PKEY_INDEX | M::QKEY),
            QpType::Uc => (
                M::AV | M::PATH_MTU | M::DEST_QPN | M::RQ_PSN,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            ),
            _ => (
                M::AV
                    | M::PATH_MTU
                    | M::DEST_QPN
                    | M::RQ_PSN
                    | M::MAX_DEST_RD_ATOMIC
                    | M::MIN_RNR_TIMER,
                M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX,
            ),
        },
        (Rtr, Rts) => match t {
            QpType::Ud => (M::SQ_PSN, M::CUR_STATE | M::QKEY),
            QpType::Uc => (
                M::SQ_PSN,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::PATH_MIG_STATE,
            ),
            _ => (
                M::TIMEOUT | M::RETRY_CNT | M::RNR_RETRY | M::SQ_PSN | M::MAX_QP_RD_ATOMIC,
                M::CUR_STATE | M::ALT_PATH | M::ACCESS_FLAGS | M::MIN_RNR_TIMER | M::PATH_MIG_STATE,
            ),
        },
        (Rts, Rts) | (Sqd, Rts) => match t {
            QpType::Ud => (none, M::CUR_STATE | M::QKEY),
            QpType::Uc => (
                none,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE,
            ),
            _ => (
                none,
                M::CUR_STATE | M::ACCESS_FLAGS | M::ALT_PATH | M::PATH_MIG_STATE | M::MIN_RNR_TIMER,
            ),
        },
        (Rts, Sqd) => (none, M::EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => match t {
            QpType::Ud => (none, M::PKEY_INDEX | M::QKEY),
            QpType::Uc => (
                none,
                M::AV | M::ALT_PATH | M::ACCESS_FLAGS | M::PKEY_INDEX | M::PATH_MIG_STATE,
            ),
            _ => (
                none,
                M::PORT
                    | M::AV
                    | M::TIMEOUT
                    | M::RETRY_CNT
                    | M::RNR_RETRY
                    | M::MAX_QP_RD_ATOMIC
                    | M::MAX_DEST_RD_ATOMIC
                    | M::ALT_PATH
                    | M::ACCESS_FLAGS
                    | M::PKEY_INDEX
                    | M::MIN_RNR_TIMER
                    | M::PATH_MIG_STATE,
            ),
        },
        (Sqe, Rts) if !rc_like => match t {
            QpType::Ud => (none, M::CUR_STATE | M::QKEY),
            _ => (none, M::CUR_STATE | M::ACCESS_FLAGS),
        },
        _ => return None,
    })
}
/// May a QP of type `t` in `cur` go to `next` with `mask`? STATE and CUR_STATE are always
/// allowed in the mask; a claimed current state must be the real one.
pub fn check_transition(
    t: QpType,
    cur: QpState,
    next: QpState,
    mask: AttrMask,
    claimed_cur: Option<QpState>,
) -> Result<(), TransitionError> {
    let (req, opt) = transition_masks(t, cur, next).ok_or(TransitionError::Invalid {
        qp_type: t,
        cur,
        next,
    })?;
    if let Some(c) = claimed_cur {
        if c != cur {
            return Err(TransitionError::CurStateMismatch {
                actual: cur,
                claimed: c,
            });
        }
    }
    let given = AttrMask(mask.0 & !(AttrMask::STATE.0 | AttrMask::CUR_STATE.0));
    let missing = AttrMask(req.0 & !given.0);
    if missing.0 != 0 {
        return Err(TransitionError::Missing { cur, next, missing });
    }
    let unexpected = AttrMask(given.0 & !(req.0 | opt.0));
    if unexpected.0 != 0 {
        return Err(TransitionError::Unexpected {
            cur,
            next,
            unexpected,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::QpState::{Init, Reset, Rtr, Rts, Sqd, Sqe};
    const ERR: QpState = QpState::Err;
    use super::*;

    const ALL: [QpState; 7] = [Reset, Init, Rtr, Rts, Sqd, Sqe, ERR];
    const RC_RTR: AttrMask = AttrMask(
        AttrMask::AV.0
            | AttrMask::PATH_MTU.0
            | AttrMask::DEST_QPN.0
            | AttrMask::RQ_PSN.0
            | AttrMask::MAX_DEST_RD_ATOMIC.0
            | AttrMask::MIN_RNR_TIMER.0,
    );
    const RC_RTS: AttrMask = AttrMask(
        AttrMask::TIMEOUT.0
            | AttrMask::RETRY_CNT.0
            | AttrMask::RNR_RETRY.0
            | AttrMask::SQ_PSN.0
            | AttrMask::MAX_QP_RD_ATOMIC.0,
    );
    const RC_INIT: AttrMask =
        AttrMask(AttrMask::PKEY_INDEX.0 | AttrMask::PORT.0 | AttrMask::ACCESS_FLAGS.0);

    fn bits(m: AttrMask) -> Vec<AttrMask> {
        (0..32)
            .map(|i| AttrMask(1 << i))
            .filter(|b| m.contains(*b))
            .collect()
    }

    #[test]
    fn rc_connect_path_needs_exactly_the_required_attributes() {
        for (cur, next, req) in [
            (Reset, Init, RC_INIT),
            (Init, Rtr, RC_RTR),
            (Rtr, Rts, RC_RTS),
        ] {
            let with_state = req | AttrMask::STATE;
            assert_eq!(
                check_transition(QpType::Rc, cur, next, with_state, None),
                Ok(()),
                "{cur:?}->{next:?}"
            );
            for b in bits(req) {
                let missing = AttrMask(with_state.0 & !b.0);
                assert!(
                    matches!(check_transition(QpType::Rc, cur, next, missing, None), Err(TransitionError::Missing { missing: m, .. }) if m == b),
                    "{cur:?}->{next:?} without {b:?}"
                );
            }
        }
    }

    #[test]
    fn attributes_a_transition_does_not_take_are_refused() {
        let extra = RC_INIT | AttrMask::STATE | AttrMask::SQ_PSN;
        assert!(
            matches!(check_transition(QpType::Rc, Reset, Init, extra, None), Err(TransitionError::Unexpected { unexpected, .. }) if unexpected == AttrMask::SQ_PSN)
        );
        let cap = RC_RTS | AttrMask::STATE | AttrMask::CAP;
        assert!(matches!(
            check_transition(QpType::Rc, Rtr, Rts, cap, None),
            Err(TransitionError::Unexpected { .. })
        ));
        // Optional ones are fine.
        let opt = RC_RTR | AttrMask::STATE | AttrMask::ACCESS_FLAGS | AttrMask::PKEY_INDEX;
        assert_eq!(check_transition(QpType::Rc, Init, Rtr, opt, None), Ok(()));
    }

    #[test]
    fn skipping_or_going_back_is_invalid() {
        for (cur, next) in [
            (Reset, Rtr),
            (Reset, Rts),
            (Init, Rts),
            (Rtr, Init),
            (Rts, Rtr),
            (Rts, Init),
            (ERR, Init),
            (ERR, Rts),
            (Reset, ERR),
            (Sqe, Rts),
        ] {
            assert!(
                matches!(
                    check_transition(QpType::Rc, cur, next, AttrMask::STATE, None),
                    Err(TransitionError::Invalid { .. })
                ),
                "{cur:?}->{next:?} must be invalid for RC"
            );
        }
    }

    #[test]
    fn reset_and_error_are_reachable_from_every_initialised_state() {
        for cur in ALL {
            assert_eq!(
                check_transition(QpType::Rc, cur, Reset, AttrMask::STATE, None),
                Ok(()),
                "{cur:?}->RESET"
            );
            if cur != Reset {
                assert_eq!(
                    check_transition(QpType::Rc, cur, ERR, AttrMask::STATE, None),
                    Ok(()),
                    "{cur:?}->ERR"
                );
            }
        }
    }

    #[test]
    fn ud_and_uc_have_their_own_requirements() {
        let ud_init = AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::QKEY;
        assert_eq!(
            check_transition(QpType::Ud, Reset, Init, ud_init, None),
            Ok(())
        );
        assert!(
            check_transition(QpType::Ud, Reset, Init, RC_INIT | AttrMask::STATE, None).is_err(),
            "UD needs a Q_Key, not access flags"
        );
        assert_eq!(
            check_transition(QpType::Ud, Init, Rtr, AttrMask::STATE, None),
            Ok(())
        );
        assert_eq!(
            check_transition(
                QpType::Ud,
                Rtr,
                Rts,
                AttrMask::STATE | AttrMask::SQ_PSN,
                None
            ),
            Ok(())
        );
        let uc_rtr = AttrMask::STATE
            | AttrMask::AV
            | AttrMask::PATH_MTU
            | AttrMask::DEST_QPN
            | AttrMask::RQ_PSN;
        assert_eq!(
            check_transition(QpType::Uc, Init, Rtr, uc_rtr, None),
            Ok(())
        );
        assert!(
            check_transition(
                QpType::Uc,
                Init,
                Rtr,
                uc_rtr | AttrMask::MAX_DEST_RD_ATOMIC,
                None
            )
            .is_err(),
            "UC has no RDMA reads"
        );
        assert_eq!(
            check_transition(QpType::Uc, Sqe, Rts, AttrMask::STATE, None),
            Ok(()),
            "UC recovers from SQE"
        );
    }

    #[test]
    fn claimed_current_state_must_match() {
        let m = RC_RTS | AttrMask::STATE | AttrMask::CUR_STATE;
        assert_eq!(check_transition(QpType::Rc, Rtr, Rts, m, Some(Rtr)), Ok(()));
        assert!(matches!(
            check_transition(QpType::Rc, Rtr, Rts, m, Some(Init)),
            Err(TransitionError::CurStateMismatch { .. })
        ));
    }

    #[test]
    fn required_and_optional_sets_never_overlap_and_values_round_trip() {
        for t in [
            QpType::Rc,
            QpType::Uc,
            QpType::Ud,
            QpType::XrcSend,
            QpType::XrcRecv,
        ] {
            for cur in ALL {
                for next in ALL {
                    if let Some((req, opt)) = transition_masks(t, cur, next) {
                        assert_eq!(req.0 & opt.0, 0, "{t:?} {cur:?}->{next:?}");
                    }
                }
            }
            assert_eq!(QpType::from_raw(t.to_raw()), Some(t));
        }
        for s in ALL {
            assert_eq!(QpState::from_raw(s.to_raw()), Some(s));
        }
        assert_eq!(QpState::from_raw(7), None);
        assert_eq!(QpType::from_raw(1), None);
    }
}
