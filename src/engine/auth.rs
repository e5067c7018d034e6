//! Who may talk to this process: peers that know the user's secret ([`Secret`]:
//! `UGDR_SECRET` or `~/.config/ugdr/secret`). docs/design.md ("Authentication") says what is
//! and is not protected.
//!
//! * **Lookups** (`address::lookup`): the question carries a fresh nonce and a MAC, the
//!   answer a MAC over the nonce, the LID and the worker address; each side checks the other.
//! * **Directory entries** (`address::Directory`) carry a MAC over the owner's pid and worker
//!   address, so a same-host peer whose secret differs is told so at resolve time instead of
//!   being dropped later.
//! * **Endpoints**: the first message on every endpoint ugdr creates is a *hello*: the
//!   sender's GID, a fresh nonce and a MAC over them and the receiver's identity (the SHA-256
//!   of its UCX worker address, which holds the worker's random UUID), so a hello is good for
//!   one receiver only. Sender and receiver derive the endpoint's *token* from the same
//!   inputs under another label; the sender's endpoint appends it to the header of every
//!   message (the ucp layer's header trailer), and the receiver ([`Gate::admit`]) passes on a
//!   message only when its token came from a hello it verified. Everything else is dropped,
//!   counted, and logged at debug.
//!
//! Why a token and not UCX's `UCP_AM_SEND_FLAG_REPLY` (which hands the receiver a `reply_ep`
//! per sending endpoint): UCX takes the `reply_ep` from an endpoint id the *sender* writes
//! into each message, and it frees endpoints of failed peers that the application never
//! used, whose memory a stranger's next endpoint may get; a pointer is not an identity. A
//! token is 64 bits nobody off the path has seen, checked on every message, and costs
//! 8 header bytes and a hash lookup.

mod secret;

pub use secret::{MAC_LEN, Secret, SecretError};

use super::{EngineError, wire};
use crate::ucp::{self, Endpoint, LockedWorker, SendPayload};
use rustc_hash::FxHashMap;
use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The bytes every message on an authenticated endpoint carries after its header.
pub const TOKEN_LEN: usize = 8;
const HELLO_MAGIC: [u8; 4] = *b"UGA1";
const GID_LEN: usize = 16;
const NONCE_LEN: usize = 16;
/// A hello: magic, the sender's GID, a nonce, the MAC (then the token, as on every message).
pub const HELLO_LEN: usize = HELLO_MAGIC.len() + GID_LEN + NONCE_LEN + MAC_LEN;
const HELLO_LABEL: &[u8] = b"ugdr hello 1";
const TOKEN_LABEL: &[u8] = b"ugdr token 1";
const ENTRY_LABEL: &[u8] = b"ugdr entry 1";
/// How many recently seen tokens skip the lock.
const RECENT_SLOTS: usize = 16;

/// What opens a new endpoint: the hello to send first, and the token to append to every
/// message after it (and to the hello itself).
pub struct Introduction {
    pub hello: [u8; HELLO_LEN],
    pub token: [u8; TOKEN_LEN],
}

/// This process's side of endpoint authentication.
pub struct Gate {
    secret: Arc<Secret>,
    /// The SHA-256 of this worker's address: the receiver a hello must name.
    me: [u8; 32],
    gid: [u8; GID_LEN],
    /// Tokens of the hellos this process verified (one per authenticated sending endpoint),
    /// with the LID each hello's GID proved: every message behind the token must claim it.
    admitted: Mutex<FxHashMap<u64, u16>>,
    /// Tokens recently found in `admitted`, each in the slot its low bits pick (0: none): a
    /// message from a recently seen endpoint skips the lock.
    recent: [AtomicU64; RECENT_SLOTS],
    /// Per slot of `recent`: the LID of a token, tagged with that token's upper 48 bits (so
    /// a LID is only ever read with the token it belongs to, whatever the slots' races).
    recent_lid: [AtomicU64; RECENT_SLOTS],
    dropped: AtomicU64,
    refused_hellos: AtomicU64,
}

/// The identity a hello names its receiver by.
fn identity(worker_address: &[u8]) -> [u8; 32] {
    Sha256::digest(worker_address).into()
}

impl Gate {
    /// The gate of the worker at `worker_address` whose port has GID `gid`.
    pub fn new(secret: Arc<Secret>, worker_address: &[u8], gid: [u8; 16]) -> Gate {
        Gate {
            secret,
            me: identity(worker_address),
            gid,
            admitted: Mutex::new(FxHashMap::default()),
            recent: std::array::from_fn(|_| AtomicU64::new(0)),
            recent_lid: std::array::from_fn(|_| AtomicU64::new(0)),
            dropped: AtomicU64::new(0),
            refused_hellos: AtomicU64::new(0),
        }
    }

    pub fn secret(&self) -> &Secret {
        &self.secret
    }

    /// A new endpoint to the worker at `worker_address` (as `Endpoint::connect`), which
    /// authenticates before anything else is sent on it: its first message is a hello and
    /// every message carries the token.
    pub fn connect(
        &self,
        locked: &LockedWorker<'_>,
        worker_address: &[u8],
        peer_failure_mode: bool,
        on_error: ucp::ErrorHandler,
    ) -> Result<Arc<Endpoint>, EngineError> {
        let intro = self.introduce(worker_address)?;
        let ep = Endpoint::connect(
            locked,
            worker_address,
            peer_failure_mode,
            on_error,
            &intro.token,
        )?;
        ep.am_send(
            locked,
            wire::AM_ID,
            &intro.hello,
            SendPayload::None,
            |_, result| {
                if let Err(e) = result {
                    tracing::debug!("auth: hello not sent: {e}");
                }
            },
        )?;
        Ok(ep)
    }

    /// A hello for the worker at `worker_address`, with a fresh nonce.
    pub fn introduce(&self, worker_address: &[u8]) -> std::io::Result<Introduction> {
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| std::io::Error::other(e.to_string()))?;
        let receiver = identity(worker_address);
        let mut hello = [0u8; HELLO_LEN];
        let (magic, rest) = hello.split_at_mut(HELLO_MAGIC.len());
        let (gid, rest) = rest.split_at_mut(GID_LEN);
        let (n, mac) = rest.split_at_mut(NONCE_LEN);
        magic.copy_from_slice(&HELLO_MAGIC);
        gid.copy_from_slice(&self.gid);
        n.copy_from_slice(&nonce);
        mac.copy_from_slice(
            &self
                .secret
                .mac(&[HELLO_LABEL, &receiver, &self.gid, &nonce]),
        );
        Ok(Introduction {
            hello,
            token: self.token(&receiver, &self.gid, &nonce),
        })
    }

    fn token(&self, receiver: &[u8; 32], gid: &[u8], nonce: &[u8]) -> [u8; TOKEN_LEN] {
        let full = self.secret.mac(&[TOKEN_LABEL, receiver, gid, nonce]);
        let mut t = [0u8; TOKEN_LEN];
        t.copy_from_slice(&full[..TOKEN_LEN]);
        t
    }

    /// The ugdr header of a message that arrived with `header` (the AM header UCX gave), and
    /// the LID its endpoint's hello proved, if its endpoint authenticated; None for everything
    /// else, hellos included (a good hello authenticates its endpoint).
    pub fn admit<'h>(&self, header: &'h [u8]) -> Option<(&'h [u8], u16)> {
        let Some(split) = header.len().checked_sub(TOKEN_LEN) else {
            self.drop_message(header.len(), "no token");
            return None;
        };
        let (body, token) = header.split_at(split);
        let token: [u8; TOKEN_LEN] = token.try_into().ok()?;
        if body.len() == HELLO_LEN && body.starts_with(&HELLO_MAGIC) {
            self.hello(body, token);
            return None;
        }
        if body.len() == wire::HEADER_LEN
            && let Some(lid) = self.known(u64::from_le_bytes(token))
        {
            return Some((body, lid));
        }
        self.drop_message(header.len(), "its endpoint has not authenticated");
        None
    }

    /// The LID proven by the verified hello that established `token`, if one did.
    fn known(&self, token: u64) -> Option<u16> {
        const TAG: u64 = !0xffff;
        let i = token as usize % RECENT_SLOTS;
        if token != 0 && self.recent[i].load(Ordering::Relaxed) == token {
            let tagged = self.recent_lid[i].load(Ordering::Relaxed);
            if tagged & TAG == token & TAG {
                return Some(tagged as u16);
            }
        }
        let admitted = self.admitted.lock().unwrap_or_else(|p| p.into_inner());
        let lid = *admitted.get(&token)?;
        self.recent_lid[i].store(token & TAG | u64::from(lid), Ordering::Relaxed);
        self.recent[i].store(token, Ordering::Relaxed);
        Some(lid)
    }

    /// Checks a hello; a good one admits its token.
    fn hello(&self, body: &[u8], token: [u8; TOKEN_LEN]) {
        let (gid, rest) = body[HELLO_MAGIC.len()..].split_at(GID_LEN);
        let (nonce, mac) = rest.split_at(NONCE_LEN);
        let lid = u16::from_be_bytes([gid[10], gid[11]]);
        let proven = self
            .secret
            .verify(&[HELLO_LABEL, &self.me, gid, nonce], mac);
        if !proven || self.token(&self.me, gid, nonce) != token {
            let n = self.refused_hellos.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::debug!(
                "auth: refused hello #{n} (claims lid {lid:#06x}): it does not prove this \
                 user's secret ({}) for this process",
                self.secret.origin()
            );
            return;
        }
        let fresh = {
            let mut admitted = self.admitted.lock().unwrap_or_else(|p| p.into_inner());
            match admitted.entry(u64::from_le_bytes(token)) {
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(lid);
                    true
                }
                std::collections::hash_map::Entry::Occupied(_) => false,
            }
        };
        if fresh {
            tracing::debug!("auth: an endpoint of lid {lid:#06x} authenticated");
        } else {
            // A copy of a hello already taken: whoever sent it again gains nothing new.
            let n = self.refused_hellos.fetch_add(1, Ordering::Relaxed) + 1;
            tracing::debug!("auth: refused hello #{n} (claims lid {lid:#06x}): a replay");
        }
    }

    fn drop_message(&self, len: usize, why: &str) {
        let n = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
        if n <= 16 || n.is_power_of_two() {
            tracing::debug!("auth: dropped message #{n} ({len}-byte header): {why}");
        }
    }

    /// How many messages and hellos were refused so far.
    pub fn refused(&self) -> (u64, u64) {
        (
            self.dropped.load(Ordering::Relaxed),
            self.refused_hellos.load(Ordering::Relaxed),
        )
    }
}

/// The proof a directory entry carries for `worker_address` published by `pid`.
pub fn entry_proof(secret: &Secret, pid: i32, worker_address: &[u8]) -> [u8; MAC_LEN] {
    secret.mac(&[ENTRY_LABEL, &pid.to_le_bytes(), worker_address])
}

/// Whether `proof` shows that a directory entry was written with `secret`.
pub fn entry_proven(secret: &Secret, pid: i32, worker_address: &[u8], proof: &[u8]) -> bool {
    secret.verify(&[ENTRY_LABEL, &pid.to_le_bytes(), worker_address], proof)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(key: &[u8], address: &[u8], lid: u16) -> Gate {
        let mut gid = [0u8; 16];
        gid[10..12].copy_from_slice(&lid.to_be_bytes());
        Gate::new(Arc::new(Secret::new(key, "test")), address, gid)
    }

    fn message(token: &[u8]) -> Vec<u8> {
        let mut m = wire::Header::new(wire::Op::Send, 5, 6, 0x0101, 0)
            .encode()
            .to_vec();
        m.extend_from_slice(token);
        m
    }

    fn hello(i: &Introduction) -> Vec<u8> {
        let mut h = i.hello.to_vec();
        h.extend_from_slice(&i.token);
        h
    }

    #[test]
    fn only_messages_behind_a_good_hello_to_this_receiver_pass() {
        let (a, b) = (b"worker a".as_slice(), b"worker b".as_slice());
        let receiver = gate(b"k", a, 0x0101);
        let sender = gate(b"k", b, 0x0102);
        let intro = sender.introduce(a).unwrap();
        let m = message(&intro.token);
        assert_eq!(receiver.admit(&m), None, "before the hello");
        assert_eq!(
            receiver.admit(&hello(&intro)),
            None,
            "a hello is not a message"
        );
        assert_eq!(
            receiver.admit(&m),
            Some((&m[..wire::HEADER_LEN], 0x0102)),
            "after it, with the LID the hello proved"
        );
        assert_eq!(
            receiver.admit(&m[..wire::HEADER_LEN]),
            None,
            "without a token"
        );
        assert_eq!(receiver.admit(&message(&[0; 8])), None, "another token");
        assert_eq!(receiver.refused(), (3, 0));

        // The same hello at another receiver (with the same secret) admits nothing there.
        let other = gate(b"k", b"worker c", 0x0103);
        assert_eq!(other.admit(&hello(&intro)), None);
        assert_eq!(other.admit(&m), None);
        assert_eq!(other.refused(), (1, 1));
        // Nor does a hello made with another secret, or one whose token was changed.
        let stranger = gate(b"other", b, 0x0102).introduce(a).unwrap();
        assert_eq!(receiver.admit(&hello(&stranger)), None);
        assert_eq!(receiver.admit(&message(&stranger.token)), None);
        let mut forged = hello(&sender.introduce(a).unwrap());
        let last = forged.len() - 1;
        forged[last] ^= 1;
        assert_eq!(receiver.admit(&forged), None);
        assert_eq!(receiver.admit(&hello(&intro)), None, "a replay");
        assert_eq!(receiver.refused().1, 3);
        assert_eq!(
            receiver.admit(&m),
            Some((&m[..wire::HEADER_LEN], 0x0102)),
            "still admitted"
        );
    }

    #[test]
    fn entry_proofs_tell_secrets_apart() {
        let (k, k2) = (Secret::new(b"k", "test"), Secret::new(b"k2", "test"));
        let proof = entry_proof(&k, 42, b"addr");
        assert!(entry_proven(&k, 42, b"addr", &proof));
        assert!(!entry_proven(&k, 43, b"addr", &proof));
        assert!(!entry_proven(&k, 42, b"addR", &proof));
        assert!(!entry_proven(&k2, 42, b"addr", &proof));
    }
}
