//! IP addressing for the CM: which addresses are this host's, and which source address the
//! kernel's routing table picks for a destination.

use crate::sys::socket::bind_udp;
use std::io;
use std::net::{IpAddr, SocketAddr};

/// Whether `ip` is an address of this host (loopback included): the kernel lets a socket bind
/// to it.
pub fn is_local(ip: IpAddr) -> bool {
    ip.is_unspecified() || bind_udp(SocketAddr::new(ip, 0)).is_ok()
}

/// The source address the routing table picks to reach `dst` (a connected UDP socket sends
/// nothing). Fails with ENETUNREACH when there is no route.
pub fn route_source(dst: IpAddr) -> io::Result<IpAddr> {
    let any: IpAddr = match dst {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    };
    let sock = bind_udp(SocketAddr::new(any, 0))?;
    // Port 9 (discard): any port will do, nothing is sent.
    sock.connect(SocketAddr::new(dst, 9))?;
    Ok(sock.local_addr()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_local_and_routes_from_itself() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert!(is_local(lo));
        assert_eq!(route_source(lo).unwrap(), lo);
        // TEST-NET-3 is never assigned to a host.
        assert!(!is_local("203.0.113.7".parse().unwrap()));
    }
}
