//! `struct ugdr_addr`: 32 bytes that name a process's port, for applications to copy over
//! any out-of-band channel (a socket, a file, MPI). Together with a QP number it is all a peer
//! needs to connect (`UGDR_QP_DEST_ADDR | UGDR_QP_DEST_QPN`).
//!
//! Layout (version 1; the application treats it as opaque):
//! ```text
//! 0..4   "UGDR"
//! 4      version (1)
//! 5      reserved (0)
//! 6..8   LID, big endian
//! 8..24  GID (fe80::0255:LID:IPv4, docs/design.md), which carries the host's IPv4 address
//! 24..32 reserved (0)
//! ```
//! The engine resolves it exactly as it resolves a verbs address vector with a GRH.

use crate::engine::address::parse_gid;
use crate::fake_verbs::VerbsError;

pub const ADDR_LEN: usize = 32;
const MAGIC: [u8; 4] = *b"UGDR";
const VERSION: u8 = 1;

/// A port's address in Rust form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAddress {
    pub lid: u16,
    pub gid: [u8; 16],
}

impl PortAddress {
    pub fn encode(&self) -> [u8; ADDR_LEN] {
        let mut raw = [0u8; ADDR_LEN];
        raw[0..4].copy_from_slice(&MAGIC);
        raw[4] = VERSION;
        raw[6..8].copy_from_slice(&self.lid.to_be_bytes());
        raw[8..24].copy_from_slice(&self.gid);
        raw
    }

    /// Checks the bytes an application handed back: the marker, the version, zero reserved
    /// bytes, and a ugdr GID that carries the same LID.
    pub fn decode(raw: &[u8; ADDR_LEN]) -> Result<PortAddress, VerbsError> {
        if raw[0..4] != MAGIC {
            return Err(VerbsError::Invalid("dest_addr is not a ugdr_addr"));
        }
        if raw[4] != VERSION {
            return Err(VerbsError::Invalid("dest_addr has an unknown version"));
        }
        if raw[5] != 0 || raw[24..].iter().any(|b| *b != 0) {
            return Err(VerbsError::Invalid("dest_addr has reserved bytes set"));
        }
        let lid = u16::from_be_bytes([raw[6], raw[7]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&raw[8..24]);
        match parse_gid(&gid) {
            Some((_, gid_lid)) if gid_lid == lid && lid != 0 => Ok(PortAddress { lid, gid }),
            _ => Err(VerbsError::Invalid("dest_addr names no ugdr port")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::address::port_gid;

    fn sample() -> PortAddress {
        let lid = 0x0a07;
        PortAddress {
            lid,
            gid: port_gid(std::net::Ipv4Addr::new(10, 0, 0, 10), lid),
        }
    }

    #[test]
    fn round_trips() {
        let a = sample();
        let raw = a.encode();
        assert_eq!(&raw[0..5], b"UGDR\x01");
        assert_eq!(PortAddress::decode(&raw), Ok(a));
    }

    #[test]
    fn refuses_garbage_and_tampering() {
        assert!(PortAddress::decode(&[0u8; ADDR_LEN]).is_err());
        let good = sample().encode();
        for (at, value) in [(0, b'X'), (4, 2), (5, 1), (7, 0x08), (31, 1), (16, 0)] {
            let mut bad = good;
            bad[at] = value;
            assert!(
                PortAddress::decode(&bad).is_err(),
                "byte {at} = {value:#x} accepted"
            );
        }
    }
}
