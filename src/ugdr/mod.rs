//! The `ugdr_*` C API's semantics in safe Rust (`include/ugdr.h`; the exports are in
//! `capi/ugdr_api.rs`). The API runs on the same engine and verbs objects as `ibv_*`: a
//! `ugdr_qp` is a [`crate::fake_verbs::qp::QueuePair`], and so on. What differs lives here:
//! * [`address`]: `struct ugdr_addr`, the 32 opaque bytes that name this process's port;
//! * [`modify`]: ugdr's smaller QP state machine, expanded to the verbs attributes it implies;
//! * [`host_memory`]: `ugdr_reg_mr` refuses memory that is not mapped host memory;
//! * the numeric values of ugdr's enums (below), converted with a checked `from_raw`.

#![forbid(unsafe_code)]

pub mod address;
pub mod host_memory;
pub mod modify;

use crate::fake_verbs::VerbsError;
use crate::fake_verbs::mr::{ACCESS_LOCAL_WRITE, ACCESS_REMOTE_READ, ACCESS_REMOTE_WRITE};
use crate::fake_verbs::work::{SendOpcode, WcOpcode, WcStatus};

/// `enum ugdr_access_flags`: the verbs values, limited to the three ugdr offers.
pub const ACCESS_SUPPORTED: u32 = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ;

/// Checks `int access` of `ugdr_reg_mr`: known bits only, and remote write needs local write
/// (as verbs).
pub fn check_access(access: i32) -> Result<u32, VerbsError> {
    let bits = u32::try_from(access).map_err(|_| VerbsError::Invalid("access flags"))?;
    if bits & !ACCESS_SUPPORTED != 0 {
        return Err(VerbsError::Invalid("unknown access flags"));
    }
    crate::fake_verbs::mr::check_access(bits)?;
    Ok(bits)
}

/// `enum ugdr_send_flags`.
pub const SEND_SIGNALED: u32 = 1;
pub const SEND_INLINE: u32 = 1 << 1;

/// `enum ugdr_wr_opcode` → the verbs opcode it is.
pub fn send_opcode(raw: u32) -> Result<SendOpcode, VerbsError> {
    match raw {
        0 => Ok(SendOpcode::Send),
        1 => Ok(SendOpcode::RdmaWrite),
        2 => Ok(SendOpcode::RdmaRead),
        _ => Err(VerbsError::Invalid("opcode")),
    }
}

/// `enum ugdr_wc_status`: the five statuses ugdr names; every other verbs status (retry
/// exceeded, remote operational or invalid request error, …) is `UGDR_WC_GENERAL_ERR`.
pub fn wc_status(s: WcStatus) -> u32 {
    match s {
        WcStatus::Success => 0,
        WcStatus::LocLenErr => 1,
        WcStatus::LocProtErr => 2,
        WcStatus::WrFlushErr => 3,
        WcStatus::RemAccessErr => 4,
        _ => 5,
    }
}

/// `enum ugdr_wc_opcode`. ugdr's requests produce only these (no immediates, no atomics).
pub fn wc_opcode(o: WcOpcode) -> u32 {
    match o {
        WcOpcode::Send => 0,
        WcOpcode::RdmaWrite => 1,
        WcOpcode::RdmaRead => 2,
        WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => 3,
        // Not produced by ugdr_* QPs (atomics, MW binds, local invalidation need verbs).
        _ => 5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_are_checked() {
        assert_eq!(check_access(0), Ok(0));
        assert_eq!(check_access(7), Ok(7));
        assert!(check_access(8).is_err(), "remote atomic is not offered");
        assert!(check_access(-1).is_err());
        assert!(
            check_access(2).is_err(),
            "remote write needs local write (as verbs)"
        );
    }

    #[test]
    fn enums_map_to_the_header_values() {
        assert_eq!(send_opcode(0), Ok(SendOpcode::Send));
        assert_eq!(send_opcode(1), Ok(SendOpcode::RdmaWrite));
        assert_eq!(send_opcode(2), Ok(SendOpcode::RdmaRead));
        assert!(send_opcode(3).is_err());
        assert_eq!(wc_status(WcStatus::WrFlushErr), 3);
        assert_eq!(wc_status(WcStatus::RetryExcErr), 5);
        assert_eq!(wc_opcode(WcOpcode::Recv), 3);
    }
}
