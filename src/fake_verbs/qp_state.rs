//! The InfiniBand QP state machine (IBA 11.2.5, the Linux kernel's `qp_state_table`).
#![allow(missing_docs)]

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
