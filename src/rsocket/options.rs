//! The socket options rsocket(7) lists: SOL_SOCKET (SO_REUSEADDR, SO_RCVBUF, SO_SNDBUF,
//! SO_LINGER, SO_KEEPALIVE, SO_OOBINLINE; SO_ERROR is the socket's own), IPPROTO_TCP
//! (TCP_NODELAY, TCP_MAXSEG, TCP_KEEPIDLE), IPPROTO_IPV6 (IPV6_V6ONLY) and SOL_RDMA
//! (RDMA_SQSIZE, RDMA_RQSIZE, RDMA_INLINE, RDMA_IOMAPSIZE, RDMA_ROUTE). Values are kept and
//! reported; the buffer and queue sizes shape the next connection's rings, the others change
//! nothing on ugdr (it has no Nagle, keepalive or segment size to tune).

use super::RsError;
use super::transport::SEG;

/// `SOL_RDMA` and its options (`<rdma/rsocket.h>`).
pub const SOL_RDMA: i32 = 0x10000;
pub const RDMA_SQSIZE: i32 = 0;
pub const RDMA_RQSIZE: i32 = 1;
pub const RDMA_INLINE: i32 = 2;
pub const RDMA_IOMAPSIZE: i32 = 3;
pub const RDMA_ROUTE: i32 = 4;

/// The largest ring (in messages) a side posts.
const MAX_RING: u32 = 1024;

#[derive(Debug, Clone)]
pub struct Options {
    pub rcvbuf: u32,
    pub sndbuf: u32,
    pub reuseaddr: bool,
    pub keepalive: bool,
    pub keepidle: u32,
    pub oobinline: bool,
    /// SO_LINGER: (on, seconds).
    pub linger: (bool, u32),
    pub nodelay: bool,
    pub v6only: bool,
    pub sqsize: Option<u32>,
    pub rqsize: Option<u32>,
    pub inline: u32,
    pub iomapsize: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            rcvbuf: 1 << 20,
            sndbuf: 1 << 20,
            reuseaddr: false,
            keepalive: false,
            keepidle: 7200,
            oobinline: false,
            linger: (false, 0),
            nodelay: false,
            v6only: false,
            sqsize: None,
            rqsize: None,
            inline: 64,
            iomapsize: 0,
        }
    }
}

fn int(value: &[u8]) -> Result<u32, RsError> {
    let b: [u8; 4] = value
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .ok_or(RsError::Os(libc::EINVAL))?;
    let v = i32::from_ne_bytes(b);
    u32::try_from(v).map_err(|_| RsError::Os(libc::EINVAL))
}

fn bytes(v: u32) -> Vec<u8> {
    (v as i32).to_ne_bytes().to_vec()
}

impl Options {
    /// Receives a side posts (its ring): RDMA_RQSIZE, else SO_RCVBUF in segments.
    pub fn rq(&self) -> u32 {
        self.rqsize.unwrap_or(self.rcvbuf / SEG).clamp(2, MAX_RING)
    }

    /// Send slots: RDMA_SQSIZE, else SO_SNDBUF in segments.
    pub fn sq(&self) -> u32 {
        self.sqsize.unwrap_or(self.sndbuf / SEG).clamp(2, MAX_RING)
    }

    /// `rsetsockopt` of an option every rsocket has.
    pub fn set(&mut self, level: i32, name: i32, value: &[u8]) -> Result<(), RsError> {
        match (level, name) {
            (libc::SOL_SOCKET, libc::SO_REUSEADDR) => self.reuseaddr = int(value)? != 0,
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => self.rcvbuf = int(value)?,
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => self.sndbuf = int(value)?,
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE) => self.keepalive = int(value)? != 0,
            (libc::SOL_SOCKET, libc::SO_OOBINLINE) => self.oobinline = int(value)? != 0,
            (libc::SOL_SOCKET, libc::SO_LINGER) => {
                let on = int(value)? != 0;
                let secs = int(value.get(4..).unwrap_or(&[]))?;
                self.linger = (on, secs);
            }
            (libc::IPPROTO_TCP, libc::TCP_NODELAY) => self.nodelay = int(value)? != 0,
            (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => {
                int(value)?;
            }
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => {
                self.keepidle = int(value)?.max(1);
            }
            (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => self.v6only = int(value)? != 0,
            (SOL_RDMA, RDMA_SQSIZE) => self.sqsize = Some(int(value)?.max(1)),
            (SOL_RDMA, RDMA_RQSIZE) => self.rqsize = Some(int(value)?.max(1)),
            (SOL_RDMA, RDMA_INLINE) => self.inline = int(value)?.min(1024),
            (SOL_RDMA, RDMA_IOMAPSIZE) => self.iomapsize = int(value)?,
            // A path record: ugdr's routes are the addresses themselves, nothing to take.
            (SOL_RDMA, RDMA_ROUTE) => {}
            (libc::SOL_SOCKET | libc::IPPROTO_TCP | libc::IPPROTO_IPV6 | SOL_RDMA, _) => {
                return Err(RsError::Os(libc::ENOPROTOOPT));
            }
            _ => return Err(RsError::Os(libc::ENOPROTOOPT)),
        }
        Ok(())
    }

    /// `rgetsockopt` of an option every rsocket has (SO_ERROR is the socket's).
    pub fn get(&self, level: i32, name: i32) -> Result<Vec<u8>, RsError> {
        Ok(match (level, name) {
            (libc::SOL_SOCKET, libc::SO_REUSEADDR) => bytes(self.reuseaddr.into()),
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => bytes(self.rcvbuf),
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => bytes(self.sndbuf),
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE) => bytes(self.keepalive.into()),
            (libc::SOL_SOCKET, libc::SO_OOBINLINE) => bytes(self.oobinline.into()),
            (libc::SOL_SOCKET, libc::SO_LINGER) => {
                let mut v = bytes(self.linger.0.into());
                v.extend(bytes(self.linger.1));
                v
            }
            (libc::IPPROTO_TCP, libc::TCP_NODELAY) => bytes(self.nodelay.into()),
            (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => bytes(SEG),
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => bytes(self.keepidle),
            (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => bytes(self.v6only.into()),
            (SOL_RDMA, RDMA_SQSIZE) => bytes(self.sq()),
            (SOL_RDMA, RDMA_RQSIZE) => bytes(self.rq()),
            (SOL_RDMA, RDMA_INLINE) => bytes(self.inline),
            (SOL_RDMA, RDMA_IOMAPSIZE) => bytes(self.iomapsize),
            _ => return Err(RsError::Os(libc::ENOPROTOOPT)),
        })
    }
}
