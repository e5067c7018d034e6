//! The InfiniBand QP state machine as a table: which `ibv_modify_qp` transitions exist for each
//! QP type, and which attributes each one requires or accepts.
//!
//! Source: IBA vol. 1 §11.2.5 and the Linux kernel's `qp_state_table` / `ib_modify_qp_is_ok()`
//! (`drivers/infiniband/core/verbs.c`), which rxe, mlx5 and the other kernel drivers call before
//! touching a QP. We follow the kernel's current table, with one difference: SQE→RTS is a
//! transition of UC and UD only (see [`transition_masks`]). Raw-packet, SMI and GSI QPs, and the
//! RATE_LIMIT attribute that only raw-packet QPs accept, are not modelled.
//!
//! Everything here is pure: the caller holds the QP's lock, asks [`check_transition`], and only
//! then changes anything ("If any of the modify attributes or the modify mask are invalid, none of
//! the attributes will be modified", `ibv_modify_qp.3`).

use std::fmt;
use std::ops::{BitAnd, BitOr, BitOrAssign, Not};

/// QP states, numbered as `enum ibv_qp_state` (RESET=0 … ERR=6).
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
    /// Every state, in `enum ibv_qp_state` order.
    pub const ALL: [QpState; 7] = [
        QpState::Reset,
        QpState::Init,
        QpState::Rtr,
        QpState::Rts,
        QpState::Sqd,
        QpState::Sqe,
        QpState::Err,
    ];

    /// The state numbered `v` in `enum ibv_qp_state`; None for anything else (IBV_QPS_UNKNOWN).
    pub fn from_raw(v: u32) -> Option<Self> {
        Self::ALL.get(usize::try_from(v).ok()?).copied()
    }

    /// The `enum ibv_qp_state` value.
    pub fn to_raw(self) -> u32 {
        self as u32
    }
}

/// QP transport types, numbered as `enum ibv_qp_type` (RC=2, UC=3, UD=4, XRC_SEND=9,
/// XRC_RECV=10; the kernel calls the XRC pair XRC_INI and XRC_TGT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpType {
    Rc,
    Uc,
    Ud,
    XrcSend,
    XrcRecv,
}

impl QpType {
    /// Every type this table knows.
    pub const ALL: [QpType; 5] = [
        QpType::Rc,
        QpType::Uc,
        QpType::Ud,
        QpType::XrcSend,
        QpType::XrcRecv,
    ];

    /// The type numbered `v` in `enum ibv_qp_type`; None for types we do not emulate.
    pub fn from_raw(v: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.to_raw() == v)
    }

    /// Acknowledged, connected transports: RC and XRC (its send and receive halves).
    pub fn reliable(self) -> bool {
        matches!(self, Self::Rc | Self::XrcSend | Self::XrcRecv)
    }

    /// The `enum ibv_qp_type` value.
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

/// A set of `enum ibv_qp_attr_mask` bits: which fields of `ibv_qp_attr` a modify sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttrMask(pub u32);

// One constant per `IBV_QP_*` bit, named without the prefix.
impl AttrMask {
    /// No attributes.
    pub const EMPTY: AttrMask = AttrMask(0);
    pub const STATE: AttrMask = AttrMask(1 << 0);
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

    /// Each named bit with its `IBV_QP_*` suffix, for [`fmt::Display`].
    const NAMES: [(AttrMask, &'static str); 22] = [
        (Self::STATE, "STATE"),
        (Self::CUR_STATE, "CUR_STATE"),
        (Self::EN_SQD_ASYNC_NOTIFY, "EN_SQD_ASYNC_NOTIFY"),
        (Self::ACCESS_FLAGS, "ACCESS_FLAGS"),
        (Self::PKEY_INDEX, "PKEY_INDEX"),
        (Self::PORT, "PORT"),
        (Self::QKEY, "QKEY"),
        (Self::AV, "AV"),
        (Self::PATH_MTU, "PATH_MTU"),
        (Self::TIMEOUT, "TIMEOUT"),
        (Self::RETRY_CNT, "RETRY_CNT"),
        (Self::RNR_RETRY, "RNR_RETRY"),
        (Self::RQ_PSN, "RQ_PSN"),
        (Self::MAX_QP_RD_ATOMIC, "MAX_QP_RD_ATOMIC"),
        (Self::ALT_PATH, "ALT_PATH"),
        (Self::MIN_RNR_TIMER, "MIN_RNR_TIMER"),
        (Self::SQ_PSN, "SQ_PSN"),
        (Self::MAX_DEST_RD_ATOMIC, "MAX_DEST_RD_ATOMIC"),
        (Self::PATH_MIG_STATE, "PATH_MIG_STATE"),
        (Self::CAP, "CAP"),
        (Self::DEST_QPN, "DEST_QPN"),
        (Self::RATE_LIMIT, "RATE_LIMIT"),
    ];

    /// True when every bit of `other` is set in `self` (so always for [`AttrMask::EMPTY`]).
    pub const fn contains(self, other: AttrMask) -> bool {
        self.0 & other.0 == other.0
    }

    /// True when no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The raw `ibv_qp_attr_mask` value.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// The bits of `self` that are not in `other`.
    pub const fn difference(self, other: AttrMask) -> AttrMask {
        AttrMask(self.0 & !other.0)
    }
}

impl QpType {
    /// The attributes the kernel's verbs command layer drops from a modify of a QP of this
    /// type before any check (uverbs' `modify_qp_mask`): an XRC send QP is a requester only,
    /// so its responder attributes are ignored, and an XRC receive QP a responder only. Programs
    /// rely on it: perftest's XRC mode sets both kinds on both QPs.
    pub const fn ignored_modify_attrs(self) -> AttrMask {
        match self {
            QpType::XrcSend => AttrMask(AttrMask::MAX_DEST_RD_ATOMIC.0 | AttrMask::MIN_RNR_TIMER.0),
            QpType::XrcRecv => AttrMask(
                AttrMask::MAX_QP_RD_ATOMIC.0 | AttrMask::RETRY_CNT.0 | AttrMask::RNR_RETRY.0,
            ),
            _ => AttrMask::EMPTY,
        }
    }
}

impl BitOr for AttrMask {
    type Output = AttrMask;
    fn bitor(self, other: AttrMask) -> AttrMask {
        AttrMask(self.0 | other.0)
    }
}

impl BitOrAssign for AttrMask {
    fn bitor_assign(&mut self, other: AttrMask) {
        self.0 |= other.0;
    }
}

impl BitAnd for AttrMask {
    type Output = AttrMask;
    fn bitand(self, other: AttrMask) -> AttrMask {
        AttrMask(self.0 & other.0)
    }
}

impl Not for AttrMask {
    type Output = AttrMask;
    fn not(self) -> AttrMask {
        AttrMask(!self.0)
    }
}

/// `AV|PATH_MTU`, with any unnamed bits as one hex number; `0` when empty.
impl fmt::Display for AttrMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("0");
        }
        let mut rest = *self;
        let mut sep = "";
        for (bit, name) in Self::NAMES {
            if self.contains(bit) {
                write!(f, "{sep}{name}")?;
                rest = rest.difference(bit);
                sep = "|";
            }
        }
        if !rest.is_empty() {
            write!(f, "{sep}{:#x}", rest.0)?;
        }
        Ok(())
    }
}

/// Why a modify was refused (for logs and tests; every case is EINVAL at the C edge).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransitionError {
    /// `cur → next` is not a transition of this QP type.
    Invalid {
        qp_type: QpType,
        cur: QpState,
        next: QpState,
    },
    /// Attributes the transition requires are not in the mask.
    Missing {
        cur: QpState,
        next: QpState,
        missing: AttrMask,
    },
    /// Attributes in the mask that this transition does not accept.
    Unexpected {
        cur: QpState,
        next: QpState,
        unexpected: AttrMask,
    },
    /// IBV_QP_CUR_STATE was given, and accepted by the transition, but `cur_qp_state` is not the
    /// state the QP is in.
    CurStateMismatch { actual: QpState, claimed: QpState },
}

impl fmt::Display for TransitionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid { qp_type, cur, next } => {
                write!(f, "{cur:?} -> {next:?} is not a {qp_type:?} transition")
            }
            Self::Missing { cur, next, missing } => {
                write!(f, "{cur:?} -> {next:?} requires {missing}")
            }
            Self::Unexpected {
                cur,
                next,
                unexpected,
            } => write!(f, "{cur:?} -> {next:?} does not accept {unexpected}"),
            Self::CurStateMismatch { actual, claimed } => {
                write!(f, "cur_qp_state is {claimed:?} but the qp is in {actual:?}")
            }
        }
    }
}

impl std::error::Error for TransitionError {}

/// An [`AttrMask`] from bit names, as the kernel writes them: `mask!(AV | PATH_MTU)`.
macro_rules! mask {
    ($($bit:ident)|+) => {
        AttrMask(0 $(| AttrMask::$bit.0)+)
    };
}

/// One attribute set per QP type: a `req_param` or `opt_param` column of the kernel's table.
#[derive(Clone, Copy)]
struct ByType {
    rc: AttrMask,
    uc: AttrMask,
    ud: AttrMask,
    xrc_send: AttrMask,
    xrc_recv: AttrMask,
}

impl ByType {
    const NONE: ByType = ByType::all(AttrMask::EMPTY);

    const fn all(m: AttrMask) -> ByType {
        ByType {
            rc: m,
            uc: m,
            ud: m,
            xrc_send: m,
            xrc_recv: m,
        }
    }

    fn of(self, qp_type: QpType) -> AttrMask {
        match qp_type {
            QpType::Rc => self.rc,
            QpType::Uc => self.uc,
            QpType::Ud => self.ud,
            QpType::XrcSend => self.xrc_send,
            QpType::XrcRecv => self.xrc_recv,
        }
    }
}

/// One valid `cur → next` cell of the table.
#[derive(Clone, Copy)]
struct Transition {
    required: ByType,
    optional: ByType,
}

impl Transition {
    /// Valid, and takes nothing but STATE (to RESET, to ERR, RESET→RESET).
    const BARE: Transition = Transition {
        required: ByType::NONE,
        optional: ByType::NONE,
    };

    const fn optional_only(optional: ByType) -> Transition {
        Transition {
            required: ByType::NONE,
            optional,
        }
    }
}

/// What RTR→RTS, RTS→RTS and SQD→RTS accept beyond their requirements. The kernel spells the
/// three out separately; they are the same sets. The receive side of an RC connection (RC and
/// XRC_RECV) may also retune its RNR NAK timer.
const INTO_RTS_OPTIONAL: ByType = ByType {
    rc: mask!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE),
    uc: mask!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE),
    ud: mask!(CUR_STATE | QKEY),
    xrc_send: mask!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE),
    xrc_recv: mask!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE),
};

/// The kernel's `qp_state_table[cur][next]`, or None where it has no valid entry.
fn table(cur: QpState, next: QpState) -> Option<Transition> {
    use QpState::{Err, Init, Reset, Rtr, Rts, Sqd, Sqe};
    let connected_init = mask!(PKEY_INDEX | PORT | ACCESS_FLAGS);
    let ud_init = mask!(PKEY_INDEX | PORT | QKEY);
    let uc_rtr = mask!(AV | PATH_MTU | DEST_QPN | RQ_PSN);
    let rc_rtr = uc_rtr | mask!(MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER);
    let rc_rts = mask!(TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC);
    let t = match (cur, next) {
        // Any state may be reset. Any state but RESET may be moved to ERR: the kernel's table
        // has no RESET→ERR cell, so ibv_modify_qp(RESET → ERR) is EINVAL there, and here.
        (_, Reset) | (Init | Rtr | Rts | Sqd | Sqe | Err, Err) => Transition::BARE,
        (Reset, Init) => Transition {
            required: ByType {
                ud: ud_init,
                ..ByType::all(connected_init)
            },
            optional: ByType::NONE,
        },
        // Without a state change, INIT may re-set what RESET→INIT set.
        (Init, Init) => Transition::optional_only(ByType {
            ud: ud_init,
            ..ByType::all(connected_init)
        }),
        // XRC_SEND only sends, so it needs no responder resources; XRC_RECV needs RC's.
        (Init, Rtr) => Transition {
            required: ByType {
                rc: rc_rtr,
                uc: uc_rtr,
                ud: AttrMask::EMPTY,
                xrc_send: uc_rtr,
                xrc_recv: rc_rtr,
            },
            optional: ByType {
                ud: mask!(PKEY_INDEX | QKEY),
                ..ByType::all(mask!(ALT_PATH | ACCESS_FLAGS | PKEY_INDEX))
            },
        },
        // XRC_RECV never sends requests, yet the kernel still requires TIMEOUT and SQ_PSN.
        (Rtr, Rts) => Transition {
            required: ByType {
                rc: rc_rts,
                uc: AttrMask::SQ_PSN,
                ud: AttrMask::SQ_PSN,
                xrc_send: rc_rts,
                xrc_recv: mask!(TIMEOUT | SQ_PSN),
            },
            optional: INTO_RTS_OPTIONAL,
        },
        (Rts | Sqd, Rts) => Transition::optional_only(INTO_RTS_OPTIONAL),
        (Rts, Sqd) => Transition::optional_only(ByType::all(AttrMask::EN_SQD_ASYNC_NOTIFY)),
        // While drained, the path and the retry/atomic parameters may change.
        (Sqd, Sqd) => Transition::optional_only(ByType {
            rc: mask!(
                PORT | AV
                    | TIMEOUT
                    | RETRY_CNT
                    | RNR_RETRY
                    | MAX_QP_RD_ATOMIC
                    | MAX_DEST_RD_ATOMIC
                    | ALT_PATH
                    | ACCESS_FLAGS
                    | PKEY_INDEX
                    | MIN_RNR_TIMER
                    | PATH_MIG_STATE
            ),
            uc: mask!(AV | ALT_PATH | ACCESS_FLAGS | PKEY_INDEX | PATH_MIG_STATE),
            ud: mask!(PKEY_INDEX | QKEY),
            xrc_send: mask!(
                PORT | AV
                    | TIMEOUT
                    | RETRY_CNT
                    | RNR_RETRY
                    | MAX_QP_RD_ATOMIC
                    | ALT_PATH
                    | ACCESS_FLAGS
                    | PKEY_INDEX
                    | PATH_MIG_STATE
            ),
            xrc_recv: mask!(
                PORT | AV
                    | TIMEOUT
                    | MAX_DEST_RD_ATOMIC
                    | ALT_PATH
                    | ACCESS_FLAGS
                    | PKEY_INDEX
                    | MIN_RNR_TIMER
                    | PATH_MIG_STATE
            ),
        }),
        // Only UC and UD have an SQE state; `transition_masks` refuses this for the others.
        (Sqe, Rts) => Transition::optional_only(ByType {
            uc: mask!(CUR_STATE | ACCESS_FLAGS),
            ud: mask!(CUR_STATE | QKEY),
            ..ByType::NONE
        }),
        _ => return None,
    };
    Some(t)
}

/// The (required, optional) attribute masks of `cur → next` for `qp_type`, or None when that is
/// not a transition of `qp_type`. STATE is in neither: it is always accepted.
///
/// Differs from the kernel in one cell: its SQE→RTS entry is valid for every type (with empty
/// masks for RC and XRC), but only UC and UD QPs ever enter SQE (IBA 10.3.1), so here SQE→RTS is
/// not a transition of RC, XRC_SEND or XRC_RECV.
pub fn transition_masks(
    qp_type: QpType,
    cur: QpState,
    next: QpState,
) -> Option<(AttrMask, AttrMask)> {
    if (cur, next) == (QpState::Sqe, QpState::Rts) && !matches!(qp_type, QpType::Uc | QpType::Ud) {
        return None;
    }
    let t = table(cur, next)?;
    Some((t.required.of(qp_type), t.optional.of(qp_type)))
}

/// May a `qp_type` QP in `cur` go to `next` with attribute mask `mask`? Returns the first reason
/// it may not, checked in the kernel's order: the transition, then required attributes, then
/// unaccepted ones, then the claimed current state.
///
/// `next` is the requested state when `mask` has STATE, else `cur` (so attribute-only modifies
/// are the INIT→INIT, RTS→RTS and SQD→SQD cells; RTR→RTR does not exist). `claimed_cur` is the
/// decoded `cur_qp_state` and is looked at only when `mask` has CUR_STATE. The table accepts
/// CUR_STATE only on transitions out of RTR, RTS, SQD and SQE into RTS, which covers the kernel's
/// separate "CUR_STATE only from RTR/RTS/SQD/SQE" rule; elsewhere it is
/// [`TransitionError::Unexpected`]. Where it is accepted, the kernel's drivers use the claim as
/// the current state; we have the real one, so a claim that differs is
/// [`TransitionError::CurStateMismatch`].
pub fn check_transition(
    qp_type: QpType,
    cur: QpState,
    next: QpState,
    mask: AttrMask,
    claimed_cur: Option<QpState>,
) -> Result<(), TransitionError> {
    debug_assert!(
        mask.contains(AttrMask::STATE) || next == cur,
        "next differs from cur but the mask has no STATE"
    );
    let (required, optional) = transition_masks(qp_type, cur, next)
        .ok_or(TransitionError::Invalid { qp_type, cur, next })?;
    let missing = required.difference(mask);
    if !missing.is_empty() {
        return Err(TransitionError::Missing { cur, next, missing });
    }
    let unexpected = mask.difference(required | optional | AttrMask::STATE);
    if !unexpected.is_empty() {
        return Err(TransitionError::Unexpected {
            cur,
            next,
            unexpected,
        });
    }
    if let Some(claimed) = claimed_cur
        && mask.contains(AttrMask::CUR_STATE)
        && claimed != cur
    {
        return Err(TransitionError::CurStateMismatch {
            actual: cur,
            claimed,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::QpState::{Err as Error, Init, Reset, Rtr, Rts, Sqd, Sqe};
    use super::*;

    const S: AttrMask = AttrMask::STATE;

    /// Every bit of `m`, one mask each.
    fn each_bit(m: AttrMask) -> impl Iterator<Item = AttrMask> {
        (0..32)
            .map(|i| AttrMask(1 << i))
            .filter(move |b| m.contains(*b))
    }

    /// The table says `cur → next` for `qp_type` requires exactly `required` and accepts exactly
    /// `optional`; check_transition agrees: the required set passes, dropping any one required
    /// bit is Missing that bit, and any bit outside both sets is Unexpected that bit.
    fn assert_cell(
        qp_type: QpType,
        cur: QpState,
        next: QpState,
        required: AttrMask,
        optional: AttrMask,
    ) {
        let what = format!("{qp_type:?} {cur:?}->{next:?}");
        assert_eq!(
            transition_masks(qp_type, cur, next),
            Some((required, optional)),
            "{what}"
        );
        let state = if next == cur { AttrMask::EMPTY } else { S };
        let check = |m| check_transition(qp_type, cur, next, m, Some(cur));
        assert_eq!(
            check(required | state),
            Ok(()),
            "{what} with exactly the required set"
        );
        assert_eq!(
            check(required | optional | S),
            Ok(()),
            "{what} with everything it accepts"
        );
        for bit in each_bit(required) {
            assert_eq!(
                check(required.difference(bit) | state),
                Err(TransitionError::Missing {
                    cur,
                    next,
                    missing: bit
                }),
                "{what} without {bit}"
            );
        }
        for bit in each_bit(!(required | optional | S)) {
            assert_eq!(
                check(required | state | bit),
                Err(TransitionError::Unexpected {
                    cur,
                    next,
                    unexpected: bit
                }),
                "{what} with {bit}"
            );
        }
    }

    fn assert_invalid(qp_type: QpType, cur: QpState, next: QpState) {
        assert_eq!(transition_masks(qp_type, cur, next), None);
        assert_eq!(
            check_transition(qp_type, cur, next, S, None),
            Err(TransitionError::Invalid { qp_type, cur, next }),
            "{qp_type:?} {cur:?}->{next:?} must be invalid"
        );
    }

    #[test]
    fn rc_reset_to_init() {
        assert_cell(
            QpType::Rc,
            Reset,
            Init,
            mask!(PKEY_INDEX | PORT | ACCESS_FLAGS),
            AttrMask::EMPTY,
        );
    }

    #[test]
    fn rc_init_to_init() {
        assert_cell(
            QpType::Rc,
            Init,
            Init,
            AttrMask::EMPTY,
            mask!(PKEY_INDEX | PORT | ACCESS_FLAGS),
        );
    }

    #[test]
    fn rc_init_to_rtr() {
        assert_cell(
            QpType::Rc,
            Init,
            Rtr,
            mask!(AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER),
            mask!(ALT_PATH | ACCESS_FLAGS | PKEY_INDEX),
        );
    }

    #[test]
    fn rc_rtr_to_rts() {
        assert_cell(
            QpType::Rc,
            Rtr,
            Rts,
            mask!(TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC),
            mask!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE),
        );
    }

    #[test]
    fn rc_rts_to_rts() {
        assert_cell(
            QpType::Rc,
            Rts,
            Rts,
            AttrMask::EMPTY,
            mask!(CUR_STATE | ACCESS_FLAGS | ALT_PATH | PATH_MIG_STATE | MIN_RNR_TIMER),
        );
    }

    #[test]
    fn rc_rts_to_sqd() {
        assert_cell(
            QpType::Rc,
            Rts,
            Sqd,
            AttrMask::EMPTY,
            AttrMask::EN_SQD_ASYNC_NOTIFY,
        );
    }

    #[test]
    fn rc_sqd_to_rts() {
        assert_cell(
            QpType::Rc,
            Sqd,
            Rts,
            AttrMask::EMPTY,
            mask!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE),
        );
    }

    #[test]
    fn rc_sqd_to_sqd() {
        assert_cell(
            QpType::Rc,
            Sqd,
            Sqd,
            AttrMask::EMPTY,
            mask!(
                PORT | AV
                    | TIMEOUT
                    | RETRY_CNT
                    | RNR_RETRY
                    | MAX_QP_RD_ATOMIC
                    | MAX_DEST_RD_ATOMIC
                    | ALT_PATH
                    | ACCESS_FLAGS
                    | PKEY_INDEX
                    | MIN_RNR_TIMER
                    | PATH_MIG_STATE
            ),
        );
    }

    #[test]
    fn every_type_can_be_reset_from_every_state_and_failed_from_every_state_but_reset() {
        for qp_type in QpType::ALL {
            for cur in QpState::ALL {
                assert_cell(qp_type, cur, Reset, AttrMask::EMPTY, AttrMask::EMPTY);
                if cur == Reset {
                    // The kernel's table has no RESET→ERR cell.
                    assert_invalid(qp_type, Reset, Error);
                } else {
                    assert_cell(qp_type, cur, Error, AttrMask::EMPTY, AttrMask::EMPTY);
                }
            }
        }
    }

    #[test]
    fn ud_connect_path() {
        let ud = QpType::Ud;
        assert_cell(
            ud,
            Reset,
            Init,
            mask!(PKEY_INDEX | PORT | QKEY),
            AttrMask::EMPTY,
        );
        assert_cell(
            ud,
            Init,
            Init,
            AttrMask::EMPTY,
            mask!(PKEY_INDEX | PORT | QKEY),
        );
        assert_cell(ud, Init, Rtr, AttrMask::EMPTY, mask!(PKEY_INDEX | QKEY));
        assert_cell(ud, Rtr, Rts, AttrMask::SQ_PSN, mask!(CUR_STATE | QKEY));
        // What an RC application passes is wrong for UD: no Q_Key, and access flags.
        assert_eq!(
            check_transition(
                ud,
                Reset,
                Init,
                mask!(STATE | PKEY_INDEX | PORT | ACCESS_FLAGS),
                None
            ),
            Err(TransitionError::Missing {
                cur: Reset,
                next: Init,
                missing: AttrMask::QKEY
            })
        );
    }

    #[test]
    fn uc_connect_path() {
        let uc = QpType::Uc;
        assert_cell(
            uc,
            Reset,
            Init,
            mask!(PKEY_INDEX | PORT | ACCESS_FLAGS),
            AttrMask::EMPTY,
        );
        assert_cell(
            uc,
            Init,
            Rtr,
            mask!(AV | PATH_MTU | DEST_QPN | RQ_PSN),
            mask!(ALT_PATH | ACCESS_FLAGS | PKEY_INDEX),
        );
        assert_cell(
            uc,
            Rtr,
            Rts,
            AttrMask::SQ_PSN,
            mask!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE),
        );
    }

    #[test]
    fn uc_and_ud_recover_from_sqe_but_rc_and_xrc_never_enter_it() {
        assert_cell(
            QpType::Uc,
            Sqe,
            Rts,
            AttrMask::EMPTY,
            mask!(CUR_STATE | ACCESS_FLAGS),
        );
        assert_cell(
            QpType::Ud,
            Sqe,
            Rts,
            AttrMask::EMPTY,
            mask!(CUR_STATE | QKEY),
        );
        for qp_type in [QpType::Rc, QpType::XrcSend, QpType::XrcRecv] {
            assert_invalid(qp_type, Sqe, Rts);
        }
    }

    #[test]
    fn xrc_send_is_a_requester_and_xrc_recv_a_responder() {
        let rtr_base = mask!(AV | PATH_MTU | DEST_QPN | RQ_PSN);
        let rtr_opt = mask!(ALT_PATH | ACCESS_FLAGS | PKEY_INDEX);
        assert_cell(QpType::XrcSend, Init, Rtr, rtr_base, rtr_opt);
        assert_cell(
            QpType::XrcRecv,
            Init,
            Rtr,
            rtr_base | mask!(MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER),
            rtr_opt,
        );
        assert_cell(
            QpType::XrcSend,
            Rtr,
            Rts,
            mask!(TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC),
            mask!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | PATH_MIG_STATE),
        );
        assert_cell(
            QpType::XrcRecv,
            Rtr,
            Rts,
            mask!(TIMEOUT | SQ_PSN),
            mask!(CUR_STATE | ALT_PATH | ACCESS_FLAGS | MIN_RNR_TIMER | PATH_MIG_STATE),
        );
        for qp_type in [QpType::XrcSend, QpType::XrcRecv] {
            assert_cell(
                qp_type,
                Reset,
                Init,
                mask!(PKEY_INDEX | PORT | ACCESS_FLAGS),
                AttrMask::EMPTY,
            );
        }
    }

    #[test]
    fn skipping_a_state_or_going_back_is_invalid() {
        for qp_type in QpType::ALL {
            for (cur, next) in [
                (Reset, Rtr),
                (Reset, Rts),
                (Reset, Sqd),
                (Init, Rts),
                (Init, Sqd),
                (Rtr, Init),
                (Rtr, Rtr),
                (Rtr, Sqd),
                (Rts, Init),
                (Rts, Rtr),
                (Sqd, Init),
                (Sqd, Rtr),
                (Sqe, Init),
                (Sqe, Sqe),
                (Error, Init),
                (Error, Rts),
            ] {
                assert_invalid(qp_type, cur, next);
            }
            // SQE is entered by the QP itself, never by a modify.
            for cur in QpState::ALL {
                assert_invalid(qp_type, cur, Sqe);
            }
        }
    }

    #[test]
    fn cur_state_is_accepted_only_into_rts_and_must_be_true() {
        let rc_rts = mask!(STATE | TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC);
        let claim = rc_rts | AttrMask::CUR_STATE;
        assert_eq!(
            check_transition(QpType::Rc, Rtr, Rts, claim, Some(Rtr)),
            Ok(())
        );
        assert_eq!(
            check_transition(QpType::Rc, Rtr, Rts, claim, Some(Init)),
            Err(TransitionError::CurStateMismatch {
                actual: Rtr,
                claimed: Init
            })
        );
        // The claim is only read when the mask says so.
        assert_eq!(
            check_transition(QpType::Rc, Rtr, Rts, rc_rts, Some(Init)),
            Ok(())
        );
        // A UD QP the app believes is in SQE, but that is back in RTS already.
        let ud = mask!(STATE | CUR_STATE);
        assert_eq!(
            check_transition(QpType::Ud, Sqe, Rts, ud, Some(Sqe)),
            Ok(())
        );
        assert_eq!(
            check_transition(QpType::Ud, Rts, Rts, ud, Some(Sqe)),
            Err(TransitionError::CurStateMismatch {
                actual: Rts,
                claimed: Sqe
            })
        );
        // Not accepted out of RESET or INIT, nor into SQD or ERR, even when true.
        let init = mask!(STATE | CUR_STATE | PKEY_INDEX | PORT | ACCESS_FLAGS);
        for (cur, next, m) in [
            (Reset, Init, init),
            (Init, Init, init.difference(S)),
            (Rts, Sqd, mask!(STATE | CUR_STATE)),
            (Rts, Error, mask!(STATE | CUR_STATE)),
        ] {
            assert_eq!(
                check_transition(QpType::Rc, cur, next, m, Some(cur)),
                Err(TransitionError::Unexpected {
                    cur,
                    next,
                    unexpected: AttrMask::CUR_STATE
                }),
                "{cur:?}->{next:?}"
            );
        }
    }

    #[test]
    fn rate_limit_and_unnamed_bits_are_never_accepted() {
        for qp_type in QpType::ALL {
            for m in [AttrMask::RATE_LIMIT, AttrMask(1 << 21), AttrMask(1 << 31)] {
                assert_eq!(
                    check_transition(qp_type, Rts, Rts, m, None),
                    Err(TransitionError::Unexpected {
                        cur: Rts,
                        next: Rts,
                        unexpected: m
                    })
                );
            }
        }
    }

    #[test]
    fn table_is_consistent() {
        let named = AttrMask::NAMES
            .iter()
            .fold(AttrMask::EMPTY, |all, (bit, _)| all | *bit);
        let mut cells = 0;
        for qp_type in QpType::ALL {
            for cur in QpState::ALL {
                for next in QpState::ALL {
                    let Some((req, opt)) = transition_masks(qp_type, cur, next) else {
                        continue;
                    };
                    cells += 1;
                    let what = format!("{qp_type:?} {cur:?}->{next:?}");
                    assert!((req & opt).is_empty(), "{what}: {req} overlaps {opt}");
                    assert!(!(req | opt).contains(S), "{what}: STATE is implicit");
                    assert!(named.contains(req | opt), "{what}: unnamed bits");
                    assert!(!(req | opt).contains(AttrMask::RATE_LIMIT), "{what}");
                    assert!(!req.contains(AttrMask::CUR_STATE), "{what}");
                    if (req | opt).contains(AttrMask::CUR_STATE) {
                        assert!(
                            matches!(cur, Rtr | Rts | Sqd | Sqe) && next == Rts,
                            "{what}"
                        );
                    }
                }
            }
        }
        // Per type: 7 to RESET, 6 to ERR, RESET→INIT, INIT→INIT, INIT→RTR, RTR→RTS, RTS→RTS,
        // RTS→SQD, SQD→RTS, SQD→SQD; plus SQE→RTS for UC and UD.
        assert_eq!(cells, 5 * (7 + 6 + 8) + 2);
    }

    #[test]
    fn raw_values_are_the_verbs_enums() {
        for (i, s) in QpState::ALL.into_iter().enumerate() {
            assert_eq!(s.to_raw() as usize, i);
            assert_eq!(QpState::from_raw(s.to_raw()), Some(s));
        }
        assert_eq!(QpState::from_raw(7), None); // IBV_QPS_UNKNOWN
        assert_eq!(QpState::from_raw(u32::MAX), None);
        for (t, raw) in QpType::ALL.into_iter().zip([2, 3, 4, 9, 10]) {
            assert_eq!(t.to_raw(), raw);
            assert_eq!(QpType::from_raw(raw), Some(t));
        }
        for raw in [0, 1, 5, 8, 11, 0x1000] {
            assert_eq!(QpType::from_raw(raw), None, "{raw}");
        }
    }

    #[test]
    fn masks_print_their_names() {
        assert_eq!(AttrMask::EMPTY.to_string(), "0");
        assert_eq!(mask!(AV | PATH_MTU).to_string(), "AV|PATH_MTU");
        assert_eq!(
            (AttrMask::STATE | AttrMask(1 << 30)).to_string(),
            "STATE|0x40000000"
        );
        let e = check_transition(QpType::Rc, Init, Rtr, S, None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Init -> Rtr requires AV|PATH_MTU|RQ_PSN|MIN_RNR_TIMER|MAX_DEST_RD_ATOMIC|DEST_QPN"
        );
    }
}
