//! A queue of events behind a real, pollable file descriptor: one byte per event in a pipe,
//! so applications can `poll()`/`select()`/`epoll` the fd, make it non-blocking, or block in
//! `ibv_get_cq_event` & co., exactly as with the kernel's completion-channel, async-event and
//! rdma_cm fds. A pipe's read end, as those files, is readable while an event waits and never
//! writable (a socket always is: an event loop that also watches the fd for writing, as SPDK's
//! NVMe-oF target does in interrupt mode, would never sleep).
//!
//! ugdr reads the pipe only under the queue's lock and only a byte it knows is there (it counts
//! them), so a read never blocks, whatever the application made the fd; waiting is a `poll()`.

use super::VerbsError;
use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard};

pub struct EventQueue<T> {
    /// The read end the application sees: blocking unless the application changes that.
    reader: OwnedFd,
    writer: OwnedFd,
    queued: Mutex<Queued<T>>,
}

/// The events, and how many bytes the pipe holds for them (as many, unless the pipe was full
/// when one came).
struct Queued<T> {
    events: VecDeque<T>,
    bytes: usize,
}

impl<T> EventQueue<T> {
    pub fn new() -> Result<EventQueue<T>, VerbsError> {
        let (reader, writer) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(errno)?;
        fcntl(writer.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).map_err(errno)?;
        Ok(EventQueue {
            reader,
            writer,
            queued: Mutex::new(Queued {
                events: VecDeque::new(),
                bytes: 0,
            }),
        })
    }

    /// The fd the application polls.
    pub fn fd(&self) -> RawFd {
        self.reader.as_raw_fd()
    }

    fn locked(&self) -> MutexGuard<'_, Queued<T>> {
        self.queued.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues an event and makes the fd readable.
    pub fn push(&self, event: T) {
        let mut q = self.locked();
        q.events.push_back(event);
        // One byte per event; the pipe holds 64 Ki of them, far more than the bounded sources
        // (armed CQs, QP errors, connection events) can produce between two reads.
        match nix::unistd::write(&self.writer, &[1u8]) {
            Ok(_) => q.bytes += 1,
            Err(e) => tracing::warn!("event fd {}: cannot signal event: {e}", self.fd()),
        }
    }

    /// Reads `n` of the bytes the pipe holds (fewer if it holds fewer): never blocks, since
    /// only ugdr reads the pipe, under the lock `q` comes from.
    fn consume_bytes(&self, q: &mut Queued<T>, n: usize) {
        let mut want = n.min(q.bytes);
        let mut buf = [0u8; 64];
        while want > 0 {
            let chunk = want.min(buf.len());
            match nix::unistd::read(self.reader.as_raw_fd(), &mut buf[..chunk]) {
                Ok(0) => break,
                Ok(got) => {
                    want -= got;
                    q.bytes -= got;
                }
                Err(Errno::EINTR) => {}
                Err(_) => {
                    // Something else took them (EAGAIN on a non-blocking fd): none is left.
                    q.bytes = 0;
                    break;
                }
            }
        }
    }

    /// Takes the next event: blocks while none is queued, unless the application made the fd
    /// non-blocking (then `WouldBlock`, errno EAGAIN).
    pub fn wait(&self) -> Result<T, VerbsError> {
        self.wait_with(|_| {})
    }

    /// Like [`EventQueue::wait`], running `on_take` on the event while it leaves the queue
    /// (under the queue's lock, so a concurrent [`EventQueue::discard`] sees it either queued
    /// or already accounted for by `on_take`).
    pub fn wait_with(&self, on_take: impl Fn(&T)) -> Result<T, VerbsError> {
        loop {
            if let Some(ev) = self.try_wait_with(&on_take)? {
                return Ok(ev);
            }
            if self.is_nonblocking() {
                return Err(VerbsError::Os(libc::EAGAIN));
            }
            let mut fds = [PollFd::new(self.reader.as_fd(), PollFlags::POLLIN)];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => return Err(errno(e)),
            }
        }
    }

    /// Takes the next event without blocking: `None` while none is queued. The exports that
    /// block (`ibv_get_cq_event`, …) wait for the fd themselves between such attempts, in a
    /// `poll()` outside their panic boundary where `pthread_cancel` may end the thread.
    pub fn try_wait(&self) -> Result<Option<T>, VerbsError> {
        self.try_wait_with(|_| {})
    }

    /// Like [`EventQueue::try_wait`], running `on_take` as [`EventQueue::wait_with`] does.
    pub fn try_wait_with(&self, on_take: impl Fn(&T)) -> Result<Option<T>, VerbsError> {
        let mut q = self.locked();
        let Some(ev) = q.events.pop_front() else {
            return Ok(None);
        };
        self.consume_bytes(&mut q, 1);
        on_take(&ev);
        Ok(Some(ev))
    }

    /// Whether the application made the fd non-blocking (then waiting is EAGAIN instead).
    pub fn is_nonblocking(&self) -> bool {
        fcntl(self.reader.as_raw_fd(), FcntlArg::F_GETFL)
            .map(|f| OFlag::from_bits_truncate(f).contains(OFlag::O_NONBLOCK))
            .unwrap_or(true)
    }

    /// Drops every queued event matching `pred`, and as many of the fd's bytes, so that the fd
    /// is not left readable with no event behind it.
    pub fn discard(&self, pred: impl Fn(&T) -> bool) {
        drop(self.take(pred));
    }

    /// Takes the queued events `pred` selects out of the queue, in their order, with as many of
    /// the fd's bytes (as `discard`).
    pub fn take(&self, pred: impl Fn(&T) -> bool) -> Vec<T> {
        let mut q = self.locked();
        let (taken, kept): (VecDeque<T>, VecDeque<T>) = q.events.drain(..).partition(|e| pred(e));
        q.events = kept;
        self.consume_bytes(&mut q, taken.len());
        taken.into()
    }
}

fn errno(e: Errno) -> VerbsError {
    VerbsError::Os(e as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `poll` says of the queue's fd now, asked for reading and writing.
    fn ready(q: &EventQueue<u32>) -> PollFlags {
        let mut fds = [PollFd::new(
            q.reader.as_fd(),
            PollFlags::POLLIN | PollFlags::POLLOUT,
        )];
        poll(&mut fds, PollTimeout::ZERO).unwrap();
        fds[0].revents().unwrap()
    }

    #[test]
    fn the_fd_is_readable_exactly_while_events_wait_and_never_writable() {
        let q = EventQueue::new().unwrap();
        assert!(ready(&q).is_empty());
        for e in 1..=3 {
            q.push(e);
        }
        assert_eq!(ready(&q), PollFlags::POLLIN);
        assert_eq!(q.take(|e| *e == 2), vec![2], "taken from the middle");
        assert_eq!(q.try_wait().unwrap(), Some(1));
        assert_eq!(ready(&q), PollFlags::POLLIN, "one left");
        assert_eq!(q.wait().unwrap(), 3, "in order");
        assert!(ready(&q).is_empty(), "no byte without an event");
        assert_eq!(q.try_wait().unwrap(), None);
    }

    #[test]
    fn waiting_on_an_empty_queue_is_eagain_once_the_application_made_the_fd_non_blocking() {
        let q: EventQueue<u32> = EventQueue::new().unwrap();
        assert!(!q.is_nonblocking(), "blocking, as the kernel's fds start");
        fcntl(q.fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).unwrap();
        assert!(q.is_nonblocking());
        assert!(matches!(q.wait(), Err(VerbsError::Os(libc::EAGAIN))));
        q.push(7);
        assert_eq!(q.wait().unwrap(), 7);
    }

    #[test]
    fn a_blocked_waiter_is_woken_by_the_next_event() {
        let q = std::sync::Arc::new(EventQueue::new().unwrap());
        let waiter = {
            let q = std::sync::Arc::clone(&q);
            std::thread::spawn(move || q.wait().unwrap())
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        q.push(42u32);
        assert_eq!(waiter.join().unwrap(), 42);
        assert!(ready(&q).is_empty());
    }
}
