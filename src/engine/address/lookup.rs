//! The LID lookup service (`UGDR_PORT`, default 18517) and its client: how a process asks
//! another host which UCX worker address stands behind a LID.
//!
//! Protocol version 3: one question and one answer per TCP connection, each one ASCII line
//! of fields separated by single spaces; LIDs (4 digits), addresses, nonces (16 bytes) and
//! MACs (32 bytes) in lowercase hex.
//!
//! | line | meaning |
//! |---|---|
//! | `UGDR/3 LOOKUP <lid> <nonce> <mac>` | the question (at most [`MAX_QUESTION`] bytes) |
//! | `UGDR/3 OK <lid> <address> <mac>` | the UCX worker address of the live port `lid` |
//! | `UGDR/3 NO <lid> <mac>` | no live port `lid` on this host |
//! | `UGDR/3 ERR <reason>` | a malformed, overlong, other-version or unauthenticated question |
//!
//! Both sides prove they know the user's secret (`engine::auth::Secret`): the question's MAC
//! covers its own text before the MAC (`UGDR/3 LOOKUP <lid> <nonce>`); an answer's MAC covers
//! its text before the MAC followed by ` <nonce>` of the question it answers, so an answer is
//! good for one question only and a question cannot pass for an answer. The service answers
//! a question whose MAC does not verify with `ERR unauthenticated` (counted, logged at
//! debug), and the client takes no address from an answer whose MAC does not verify: another
//! user who answers first, or a host with another secret, gets nowhere. A question of another
//! version is answered `ERR version`.
//!
//! The service is one thread polling non-blocking sockets. A connection holds at most
//! [`MAX_QUESTION`] bytes of question and is dropped when it has not been answered within
//! [`REQUEST_TIMEOUT`]; at most [`MAX_CONNECTIONS`] are open, and a new one pushes out the
//! oldest. A slow or endless client costs a slot and a few bytes, never other lookups.
//!
//! The client reads at most [`MAX_ANSWER`] bytes within [`QUERY_TIMEOUT`] and checks every
//! field (version, the LID it asked for, hex, the worker address's length and UCX format
//! version) before an address leaves this module: UCX trusts the address it is given.
//!
//! Several ugdr processes of one user on a host share the port with `SO_REUSEPORT` (each
//! answers from the same directory, so it does not matter which one the kernel picks). Linux
//! admits a socket to a port that a listening `SO_REUSEPORT` socket holds only when both
//! sockets belong to the same effective uid (`inet_bind_conflict` in
//! net/ipv4/inet_connection_sock.c; `SO_REUSEADDR` alone never shares a listening port), so
//! no other user can join ugdr's listeners or take the port over while one of them listens.
//! Another user who binds the port first keeps ugdr from listening (a warning naming
//! `UGDR_PORT`); peers asking this host then get that user's answers, which the client
//! checks like any other, and which the MAC tells from ugdr's.

use super::{Directory, MAX_WORKER_ADDRESS, check_worker_address, hex_decode, hex_encode};
use crate::engine::auth::{MAC_LEN, Secret};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use std::collections::VecDeque;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The protocol and its version, the first field of every line.
pub const VERSION: &str = "UGDR/3";
/// The longest question line the service reads (a well-formed one has 116 bytes).
pub const MAX_QUESTION: usize = 128;
/// The longest answer line the client reads: `UGDR/3 OK <lid> <address> <mac>` with the
/// longest worker address.
pub const MAX_ANSWER: usize =
    VERSION.len() + " OK 0000 ".len() + 2 * MAX_WORKER_ADDRESS + 1 + 2 * MAC_LEN;
/// The bytes of a question's nonce.
const NONCE_LEN: usize = 16;
/// How long the client waits for a whole answer (connecting included).
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the service keeps a connection that has not yet been answered.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// How many connections the service keeps open at once.
pub const MAX_CONNECTIONS: usize = 64;
/// How long the service stops accepting after `accept` failed (e.g. out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The TCP port of the LID lookup service (`UGDR_PORT`, default 18517).
pub fn query_port() -> u16 {
    std::env::var("UGDR_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(super::DEFAULT_QUERY_PORT)
}

/// Why a peer's answer gave no worker address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("cannot reach its lookup service: {0}")]
    Unreachable(ErrorKind),
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
    #[error("no such port")]
    NoSuchPort,
    #[error("it refused the question: {0}")]
    Refused(String),
    #[error("not a ugdr lookup service (it answered {0})")]
    NotUgdr(String),
    #[error("its lookup service speaks {0}, not {VERSION}")]
    Version(String),
    #[error("malformed answer: {0}")]
    Malformed(&'static str),
    #[error("answer longer than {MAX_ANSWER} bytes")]
    TooLong,
    #[error("it answered for lid {0:#06x}")]
    WrongLid(u16),
    #[error("unusable worker address: {0}")]
    BadAddress(&'static str),
    #[error(
        "it refused our question as unauthenticated: the two hosts' ugdr secrets differ (set \
         the same UGDR_SECRET on both, or copy ~/.config/ugdr/secret)"
    )]
    Unauthenticated,
    #[error(
        "its answer does not prove this user's secret (a different UGDR_SECRET or \
         ~/.config/ugdr/secret on that host, or not this user's ugdr)"
    )]
    Forged,
}

impl LookupError {
    /// Whether the peer answered something no ugdr peer of this version sends.
    pub fn is_bad_answer(&self) -> bool {
        matches!(
            self,
            Self::NotUgdr(_)
                | Self::Version(_)
                | Self::Malformed(_)
                | Self::TooLong
                | Self::WrongLid(_)
                | Self::BadAddress(_)
        )
    }

    /// Whether the two sides do not share a secret (or the answer is not ugdr's).
    pub fn is_auth_failure(&self) -> bool {
        matches!(self, Self::Unauthenticated | Self::Forged)
    }
}

/// Questions the service refused as unauthenticated, in this process.
static UNAUTHENTICATED: AtomicU64 = AtomicU64::new(0);

/// `UGDR/3 LOOKUP <lid> <nonce>`: the question up to its MAC, which the MAC covers.
fn question_text(lid: u16, nonce: &[u8]) -> String {
    format!("{VERSION} LOOKUP {lid:04x} {}", hex_encode(nonce))
}

/// The complete question for `lid` with `nonce`, newline included.
fn question(secret: &Secret, lid: u16, nonce: &[u8]) -> String {
    let text = question_text(lid, nonce);
    let mac = secret.mac(&[text.as_bytes()]);
    format!("{text} {}\n", hex_encode(&mac))
}

/// The MAC of an answer whose text before the MAC is `text`, to the question with `nonce`.
fn answer_mac(secret: &Secret, text: &str, nonce: &[u8]) -> [u8; MAC_LEN] {
    secret.mac(&[text.as_bytes(), hex_encode(nonce).as_bytes()])
}

/// Asks `host`'s lookup service for the worker address of port `lid`.
pub fn query(secret: &Secret, host: Ipv4Addr, lid: u16) -> Result<Vec<u8>, LookupError> {
    query_at(
        secret,
        SocketAddr::new(IpAddr::V4(host), query_port()),
        lid,
        QUERY_TIMEOUT,
    )
}

fn query_at(
    secret: &Secret,
    addr: SocketAddr,
    lid: u16,
    timeout: Duration,
) -> Result<Vec<u8>, LookupError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|_| LookupError::Unreachable(ErrorKind::Other))?;
    let deadline = Instant::now() + timeout;
    let failed = |e: io::Error| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => LookupError::TimedOut(timeout),
        kind => LookupError::Unreachable(kind),
    };
    let mut stream = crate::sys::socket::connect_tcp(&addr, timeout).map_err(failed)?;
    let left = time_left(deadline).ok_or(LookupError::TimedOut(timeout))?;
    stream.set_write_timeout(Some(left)).map_err(failed)?;
    stream
        .write_all(question(secret, lid, &nonce).as_bytes())
        .map_err(failed)?;
    let mut line = Vec::with_capacity(512);
    let mut chunk = [0u8; 4096];
    loop {
        let left = time_left(deadline).ok_or(LookupError::TimedOut(timeout))?;
        stream.set_read_timeout(Some(left)).map_err(failed)?;
        let n = match stream.read(&mut chunk) {
            Ok(0) if line.is_empty() => return Err(LookupError::Malformed("no answer")),
            Ok(0) => return Err(LookupError::Malformed("the answer ends without a newline")),
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(failed(e)),
        };
        let end = chunk[..n].iter().position(|b| *b == b'\n');
        line.extend_from_slice(&chunk[..end.unwrap_or(n)]);
        if line.len() > MAX_ANSWER {
            return Err(LookupError::TooLong);
        }
        if end.is_some() {
            return parse_answer(secret, &line, lid, &nonce);
        }
    }
}

fn time_left(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
}

/// At most 40 characters of what a peer sent, printable, for an error message.
fn preview(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(40)];
    format!("{:?}", String::from_utf8_lossy(cut))
}

fn parse_lid(field: Option<&str>) -> Option<u16> {
    let f = field?;
    let bytes = hex_decode(f).filter(|b| b.len() == 2)?;
    Some(u16::from_be_bytes([bytes[0], bytes[1]]))
}

/// The worker address in an answer line (without its newline) to the question for `lid`
/// with `nonce`.
fn parse_answer(
    secret: &Secret,
    line: &[u8],
    lid: u16,
    nonce: &[u8],
) -> Result<Vec<u8>, LookupError> {
    let text = std::str::from_utf8(line).map_err(|_| LookupError::NotUgdr(preview(line)))?;
    let mut fields = text.split(' ');
    let version = fields.next().unwrap_or_default();
    if !version.starts_with("UGDR/") {
        return Err(LookupError::NotUgdr(preview(line)));
    }
    if version != VERSION {
        return Err(LookupError::Version(preview(version.as_bytes())));
    }
    let kind = fields.next();
    if kind == Some("ERR") {
        let reason: Vec<&str> = fields.collect();
        if reason == ["unauthenticated"] {
            return Err(LookupError::Unauthenticated);
        }
        return Err(LookupError::Refused(preview(reason.join(" ").as_bytes())));
    }
    let answered = parse_lid(fields.next()).ok_or(LookupError::Malformed("no lid"))?;
    if answered != lid {
        return Err(LookupError::WrongLid(answered));
    }
    let rest: Vec<&str> = fields.collect();
    let (hex, mac) = match (kind, rest.as_slice()) {
        (Some("NO"), [mac]) => (None, *mac),
        (Some("OK"), [hex, mac]) => (Some(*hex), *mac),
        (Some("OK" | "NO"), _) => return Err(LookupError::Malformed("wrong number of fields")),
        _ => return Err(LookupError::Malformed("unknown answer")),
    };
    let mac = hex_decode(mac)
        .filter(|m| m.len() == MAC_LEN)
        .ok_or(LookupError::Malformed("the MAC is not 32 bytes of hex"))?;
    let covered = &text[..text.len() - 2 * MAC_LEN - 1];
    if !secret.verify(&[covered.as_bytes(), hex_encode(nonce).as_bytes()], &mac) {
        return Err(LookupError::Forged);
    }
    let Some(hex) = hex else {
        return Err(LookupError::NoSuchPort);
    };
    let address = hex_decode(hex).ok_or(LookupError::Malformed("the address is not hex"))?;
    check_worker_address(&address).map_err(LookupError::BadAddress)?;
    Ok(address)
}

/// The answer line to a question line (without its newline) from `peer`.
fn answer(question: &[u8], dir: &Directory, secret: &Secret, peer: &str) -> String {
    let text = std::str::from_utf8(question).unwrap_or_default();
    let mut fields = text.split(' ');
    let (lid, nonce, mac) = match (fields.next(), fields.next(), fields.next()) {
        (Some(VERSION), Some("LOOKUP"), lid) => match parse_lid(lid) {
            Some(lid) => (lid, fields.next(), fields.next()),
            None => return format!("{VERSION} ERR bad-lid\n"),
        },
        (Some(v), ..) if v.starts_with("UGDR/") && v != VERSION => {
            return format!("{VERSION} ERR version\n");
        }
        _ => return format!("{VERSION} ERR malformed\n"),
    };
    let nonce = nonce.and_then(hex_decode).filter(|n| n.len() == NONCE_LEN);
    let mac = mac.and_then(hex_decode).filter(|m| m.len() == MAC_LEN);
    let proven = match (&nonce, &mac, fields.next()) {
        (Some(nonce), Some(mac), None) => {
            secret.verify(&[question_text(lid, nonce).as_bytes()], mac)
        }
        _ => false,
    };
    let Some(nonce) = nonce.filter(|_| proven) else {
        let n = UNAUTHENTICATED.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::debug!(
            "lid query service: refused unauthenticated question #{n} from {peer} (lid \
             {lid:04x})"
        );
        return format!("{VERSION} ERR unauthenticated\n");
    };
    let text = match dir.lookup(lid) {
        Some(p) => format!("{VERSION} OK {lid:04x} {}", hex_encode(&p.worker_address)),
        None => format!("{VERSION} NO {lid:04x}"),
    };
    let mac = answer_mac(secret, &text, &nonce);
    format!("{text} {}\n", hex_encode(&mac))
}

/// Binds the host's lookup port (shared by every ugdr process of this user on the host).
pub fn bind_query_listener() -> io::Result<TcpListener> {
    use socket2::{Domain, Type};
    let port = query_port();
    let sock = crate::sys::socket::new_socket(Domain::IPV4, Type::STREAM)?;
    sock.set_reuse_address(true)?;
    sock.set_reuse_port(true)?;
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);
    let taken = |e: io::Error| {
        if e.kind() == ErrorKind::AddrInUse {
            io::Error::new(
                e.kind(),
                format!(
                    "UGDR_PORT {port} is held by a socket that this user's ugdr processes cannot \
                     share (another user's, or another program's): {e}"
                ),
            )
        } else {
            e
        }
    };
    sock.bind(&addr.into()).map_err(taken)?;
    sock.listen(64).map_err(taken)?;
    Ok(sock.into())
}

/// Answers peers' LID questions from this host's directory, forever (a daemon thread).
pub fn serve_queries(listener: TcpListener, dir: Directory, secret: Arc<Secret>) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::warn!("lid query service stops: {e}");
        return;
    }
    let mut service = Service {
        listener,
        dir,
        secret,
        conns: VecDeque::new(),
        accept_paused_until: None,
    };
    loop {
        service.turn();
    }
}

struct Service {
    listener: TcpListener,
    dir: Directory,
    secret: Arc<Secret>,
    /// Oldest first.
    conns: VecDeque<Conn>,
    accept_paused_until: Option<Instant>,
}

/// One question being read or one answer being sent.
struct Conn {
    stream: TcpStream,
    peer: String,
    question: Vec<u8>,
    answer: Vec<u8>,
    sent: usize,
    deadline: Instant,
}

impl Service {
    /// Waits for something to do (a connection, a question, room to send, a deadline) and
    /// does it.
    fn turn(&mut self) {
        let now = Instant::now();
        self.conns.retain(|c| c.deadline > now);
        if self.accept_paused_until.is_some_and(|t| t <= now) {
            self.accept_paused_until = None;
        }
        let wake = self
            .conns
            .iter()
            .map(|c| c.deadline)
            .chain(self.accept_paused_until)
            .min();
        let timeout = match wake {
            // Rounded up, so that the deadline has passed when poll returns.
            Some(t) => PollTimeout::try_from(t - now + Duration::from_millis(1))
                .unwrap_or(PollTimeout::MAX),
            None => PollTimeout::NONE,
        };
        let ready: Vec<bool> = {
            let listen = if self.accept_paused_until.is_none() {
                PollFlags::POLLIN
            } else {
                PollFlags::empty()
            };
            let mut fds = Vec::with_capacity(self.conns.len() + 1);
            fds.push(PollFd::new(self.listener.as_fd(), listen));
            fds.extend(self.conns.iter().map(|c| {
                let want = if c.answer.is_empty() {
                    PollFlags::POLLIN
                } else {
                    PollFlags::POLLOUT
                };
                PollFd::new(c.stream.as_fd(), want)
            }));
            match poll(&mut fds, timeout) {
                Ok(_) => {}
                Err(nix::errno::Errno::EINTR) => return,
                Err(e) => {
                    tracing::warn!("lid query service: poll: {e}");
                    std::thread::sleep(ACCEPT_BACKOFF);
                    return;
                }
            }
            fds.iter()
                .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
                .collect()
        };
        let mut flags = ready[1..].iter();
        let (dir, secret) = (&self.dir, &*self.secret);
        self.conns
            .retain_mut(|c| !flags.next().copied().unwrap_or(false) || c.advance(dir, secret));
        if ready[0] {
            self.accept();
        }
    }

    fn accept(&mut self) {
        for _ in 0..MAX_CONNECTIONS {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    let mut conn = Conn {
                        stream,
                        peer: peer.to_string(),
                        question: Vec::new(),
                        answer: Vec::new(),
                        sent: 0,
                        deadline: Instant::now() + REQUEST_TIMEOUT,
                    };
                    // The question usually arrives with the connection: answer it now.
                    if !conn.advance(&self.dir, &self.secret) {
                        continue;
                    }
                    if self.conns.len() >= MAX_CONNECTIONS {
                        self.conns.pop_front();
                        tracing::debug!("lid query service: full, dropped the oldest connection");
                    }
                    self.conns.push_back(conn);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e)
                    if matches!(
                        e.kind(),
                        ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => {
                    tracing::warn!("lid query service: accept: {e}");
                    self.accept_paused_until = Some(Instant::now() + ACCEPT_BACKOFF);
                    return;
                }
            }
        }
    }
}

impl Conn {
    /// Reads what arrived, answers once the question is complete (or too long), sends what
    /// the socket takes. False: done with this connection (answered, closed, failed).
    fn advance(&mut self, dir: &Directory, secret: &Secret) -> bool {
        let mut chunk = [0u8; MAX_QUESTION + 1];
        while self.answer.is_empty() {
            let n = match self.stream.read(&mut chunk) {
                Ok(0) => return false,
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return false,
            };
            self.question.extend_from_slice(&chunk[..n]);
            if let Some(end) = self.question.iter().position(|b| *b == b'\n') {
                self.answer = answer(&self.question[..end], dir, secret, &self.peer).into_bytes();
            } else if self.question.len() > MAX_QUESTION {
                self.answer = format!("{VERSION} ERR too-long\n").into_bytes();
            }
        }
        while self.sent < self.answer.len() {
            match self.stream.write(&self.answer[self.sent..]) {
                Ok(0) => return false,
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LID: u16 = 0x0203;
    const NONCE: [u8; NONCE_LEN] = [7; NONCE_LEN];

    fn secret() -> Secret {
        Secret::new(b"lookup test secret", "test")
    }

    /// `text` with the MAC that answers the question with `nonce`.
    fn signed(secret: &Secret, text: &str, nonce: &[u8]) -> String {
        format!("{text} {}", hex_encode(&answer_mac(secret, text, nonce)))
    }

    fn parse(line: &str) -> Result<Vec<u8>, LookupError> {
        parse_answer(&secret(), line.as_bytes(), LID, &NONCE)
    }

    #[test]
    fn only_a_well_formed_answer_to_the_question_asked_gives_an_address() {
        let s = secret();
        let ok = |t: &str| signed(&s, t, &NONCE);
        assert_eq!(
            parse(&ok("UGDR/3 OK 0203 0120ff")),
            Ok(vec![0x01, 0x20, 0xff])
        );
        assert_eq!(parse(&ok("UGDR/3 NO 0203")), Err(LookupError::NoSuchPort));
        assert!(matches!(
            parse("UGDR/3 ERR version"),
            Err(LookupError::Refused(_))
        ));
        assert_eq!(
            parse("UGDR/3 ERR unauthenticated"),
            Err(LookupError::Unauthenticated)
        );
        let refused = [
            ("OK 0120".to_string(), "the protocol before version 2"),
            ("HTTP/1.1 400 Bad Request".into(), "another protocol"),
            ("UGDR/2 OK 0203 0120".into(), "version 2"),
            (ok("UGDR/4 OK 0203 0120"), "another version"),
            (ok("UGDR/3 OK 0204 0120"), "another lid"),
            (ok("UGDR/3 OK 0203 "), "an empty address"),
            (ok("UGDR/3 OK 0203"), "no address"),
            (ok("UGDR/3 OK 0203 012"), "odd hex"),
            (ok("UGDR/3 OK 0203 01G0"), "not hex"),
            (ok("UGDR/3 OK 0203 +120"), "a sign"),
            (ok("UGDR/3 OK 0203 0120 00"), "a trailing field"),
            (ok("UGDR/3 OK  0203 0120"), "two spaces"),
            (ok("UGDR/3 OK 203 0120"), "a short lid"),
            (ok("UGDR/3 NO 0203 x"), "a trailing field after NO"),
            (ok("UGDR/3 MAYBE 0203"), "an unknown answer"),
            (
                ok("UGDR/3 OK 0203 0f20"),
                "a UCX address format UCX aborts on",
            ),
            ("UGDR/3 OK 0203 0120".into(), "no MAC"),
            ("UGDR/3 OK 0203 0120 abcd".into(), "a short MAC"),
            ("".into(), "nothing"),
        ];
        for (line, what) in &refused {
            let e = parse(line).expect_err(what);
            assert!(e.is_bad_answer(), "{what}: {e}");
        }
        let long = ok(&format!(
            "UGDR/3 OK 0203 {}",
            "01".repeat(MAX_WORKER_ADDRESS + 1)
        ));
        assert_eq!(
            parse(&long),
            Err(LookupError::BadAddress("worker address too long"))
        );
        assert!(matches!(
            parse_answer(&s, b"\xff\xfe OK", LID, &NONCE),
            Err(LookupError::NotUgdr(_))
        ));
        // Authentic only for the question asked, with this secret, as sent.
        let forged = [
            (
                signed(&s, "UGDR/3 OK 0203 0120ff", &[8; NONCE_LEN]),
                "an answer to another question",
            ),
            (
                signed(
                    &Secret::new(b"other", "test"),
                    "UGDR/3 OK 0203 0120ff",
                    &NONCE,
                ),
                "another secret",
            ),
            (
                ok("UGDR/3 OK 0203 0120ff").replace("0120ff", "0120fe"),
                "another address under the MAC",
            ),
            (
                ok("UGDR/3 NO 0203")
                    .replace(" NO ", " OK ")
                    .replace("0203 ", "0203 0120ff "),
                "NO turned into OK",
            ),
            (
                question(&s, LID, &NONCE).trim_end().to_string(),
                "the question sent back",
            ),
        ];
        for (line, what) in &forged {
            let e = parse(line).expect_err(what);
            assert!(e == LookupError::Forged || e.is_bad_answer(), "{what}: {e}");
        }
        assert_eq!(parse(&forged[0].0), Err(LookupError::Forged));
        assert_eq!(parse(&forged[1].0), Err(LookupError::Forged));
        assert_eq!(parse(&forged[2].0), Err(LookupError::Forged));
    }

    /// A one-connection server on 127.0.0.1 that reads the question and answers what
    /// `answer` makes of it, then keeps the connection open for `hold`.
    fn fake_peer(
        answer: impl FnOnce(&str) -> Vec<u8> + Send + 'static,
        hold: Duration,
    ) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let mut q = [0u8; MAX_QUESTION];
            let n = s.read(&mut q).unwrap_or(0);
            let _ = s.write_all(&answer(&String::from_utf8_lossy(&q[..n])));
            std::thread::sleep(hold);
        });
        addr
    }

    fn fixed(bytes: &'static [u8]) -> impl FnOnce(&str) -> Vec<u8> + Send + 'static {
        move |_| bytes.to_vec()
    }

    /// The nonce of a question line.
    fn nonce_of(question: &str) -> Vec<u8> {
        hex_decode(question.split(' ').nth(3).unwrap()).unwrap()
    }

    #[test]
    fn the_client_bounds_what_it_reads_and_how_long_it_waits() {
        let s = secret();
        let ok = fake_peer(
            |q| {
                let text = "UGDR/3 OK 0203 0120";
                format!("{}\n", signed(&secret(), text, &nonce_of(q))).into_bytes()
            },
            Duration::ZERO,
        );
        assert_eq!(query_at(&s, ok, LID, QUERY_TIMEOUT), Ok(vec![0x01, 0x20]));
        // Megabytes without a newline: refused after MAX_ANSWER bytes.
        let endless = fake_peer(|_| vec![b'a'; 1 << 20], Duration::from_secs(1));
        assert_eq!(
            query_at(&s, endless, LID, QUERY_TIMEOUT),
            Err(LookupError::TooLong)
        );
        // Half an answer, then silence: the deadline.
        let stalled = fake_peer(fixed(b"UGDR/3 OK 0203 01"), Duration::from_secs(2));
        let t = Instant::now();
        let timeout = Duration::from_millis(300);
        assert_eq!(
            query_at(&s, stalled, LID, timeout),
            Err(LookupError::TimedOut(timeout))
        );
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        // Half an answer, then closed.
        let cut = fake_peer(fixed(b"UGDR/3 OK 0203 01"), Duration::ZERO);
        assert_eq!(
            query_at(&s, cut, LID, QUERY_TIMEOUT),
            Err(LookupError::Malformed("the answer ends without a newline"))
        );
    }

    /// Sends `question` to `addr` and returns the whole answer.
    fn ask(addr: SocketAddr, question: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s.write_all(question).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    #[test]
    fn the_service_answers_from_the_directory_and_refuses_the_rest() {
        let path = std::env::temp_dir().join(format!("ugdr-lookup-svc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        let dir = Directory::open_at(path.clone()).unwrap();
        let claim = dir.claim(2, &[0x01, 0x20, 0x33], &[1]).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let served = Directory::open_at(path.clone()).unwrap();
        std::thread::spawn(move || serve_queries(listener, served, Arc::new(secret())));
        let (s, lid) = (secret(), claim.lid);
        assert_eq!(
            ask(addr, question(&s, lid, &NONCE).as_bytes()),
            format!(
                "{}\n",
                signed(&s, &format!("UGDR/3 OK {lid:04x} 012033"), &NONCE)
            )
        );
        assert_eq!(
            query_at(&s, addr, lid, QUERY_TIMEOUT),
            Ok(vec![0x01, 0x20, 0x33])
        );
        assert_eq!(
            query_at(&s, addr, lid + 1, QUERY_TIMEOUT),
            Err(LookupError::NoSuchPort)
        );
        let other = Secret::new(b"other", "test");
        assert_eq!(
            query_at(&other, addr, lid, QUERY_TIMEOUT),
            Err(LookupError::Unauthenticated)
        );
        let refused = "UGDR/3 ERR unauthenticated\n";
        let good = question(&s, lid, &NONCE);
        for bad in [
            format!("UGDR/3 LOOKUP {lid:04x}\n"),
            format!("UGDR/3 LOOKUP {lid:04x} {}\n", hex_encode(&NONCE)),
            question(&other, lid, &NONCE),
            good.replace(&hex_encode(&NONCE), &hex_encode(&[8; NONCE_LEN])),
            good.replace('\n', " x\n"),
        ] {
            assert_eq!(ask(addr, bad.as_bytes()), refused, "{bad:?}");
        }
        assert_eq!(ask(addr, b"UGDR/3 LOOKUP 1\n"), "UGDR/3 ERR bad-lid\n");
        assert_eq!(ask(addr, b"UGDR/2 LOOKUP 0201\n"), "UGDR/3 ERR version\n");
        assert_eq!(ask(addr, b"UGDR-Q1 0201\n"), "UGDR/3 ERR malformed\n");
        assert_eq!(
            ask(addr, &[b'x'; MAX_QUESTION + 1]),
            "UGDR/3 ERR too-long\n"
        );
        assert!(good.len() <= MAX_QUESTION, "{}", good.len());
        dir.release(&claim);
        let _ = std::fs::remove_dir_all(&path);
    }
}
