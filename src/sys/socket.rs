//! The sockets ugdr makes for itself — CM connections, the LID lookup service, multicast
//! discovery, route probes — are created with the `socket` system call itself, not libc's
//! `socket()`. A library preloaded beside ugdr that interposes `socket()` must not get them:
//! librspreload.so turns every TCP socket into an rsocket, that is, back into ugdr's CM, which
//! would then need a socket again. Every other call on these descriptors still goes through
//! libc; such interposers pass descriptors they did not create through to the system.

use socket2::{Domain, Socket, Type};
use std::io;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::Duration;

/// A new close-on-exec socket of `domain` and `ty`.
pub fn new_socket(domain: Domain, ty: Type) -> io::Result<Socket> {
    // SAFETY: socket(2) takes three integers and returns a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_socket,
            libc::c_int::from(domain),
            libc::c_int::from(ty) | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the system call just returned this descriptor, owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
    Ok(Socket::from(owned))
}

/// A TCP connection to `addr`, given up after `timeout` (TcpStream::connect_timeout).
pub fn connect_tcp(addr: &SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let sock = new_socket(Domain::for_address(*addr), Type::STREAM)?;
    sock.connect_timeout(&(*addr).into(), timeout)?;
    Ok(TcpStream::from(sock))
}

/// A UDP socket bound to `addr` (UdpSocket::bind).
pub fn bind_udp(addr: SocketAddr) -> io::Result<UdpSocket> {
    let sock = new_socket(Domain::for_address(addr), Type::DGRAM)?;
    sock.bind(&addr.into())?;
    Ok(UdpSocket::from(sock))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockets_made_by_system_call_work_as_libcs() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stream = connect_tcp(&addr, Duration::from_secs(5)).unwrap();
        let (accepted, from) = listener.accept().unwrap();
        assert_eq!(stream.local_addr().unwrap(), from);
        assert_eq!(accepted.local_addr().unwrap(), addr);
        let udp = bind_udp("127.0.0.1:0".parse().unwrap()).unwrap();
        assert!(udp.local_addr().unwrap().port() != 0);
        // Close-on-exec, as every descriptor ugdr keeps.
        use std::os::fd::AsRawFd;
        // SAFETY: F_GETFD on a descriptor this test owns.
        let flags = unsafe { libc::fcntl(udp.as_raw_fd(), libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
    }
}
