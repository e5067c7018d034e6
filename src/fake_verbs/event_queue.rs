//! A queue of events behind a real, pollable file descriptor: one byte per event in a pipe,
//! so applications can `poll()`/`select()`/`epoll` the fd, make it non-blocking, or block in a
//! read, exactly as with the kernel's completion-channel, async-event and rdma_cm fds. A pipe's
//! read end, as those files, is readable while an event waits and never writable (a socket
//! always is: an event loop that also watches the fd for writing, as SPDK's NVMe-oF target
//! does in interrupt mode, would never sleep).

use super::VerbsError;
use nix::errno::Errno;
use nix::fcntl::{FcntlArg, OFlag, fcntl};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Mutex;

pub struct EventQueue<T> {
    /// The read end the application sees: blocking unless the application changes that.
    reader: OwnedFd,
    /// The same pipe opened again (its own file description, always non-blocking whatever
    /// the application does to `reader`): taking without waiting, and discarding.
    reader_nowait: OwnedFd,
    writer: OwnedFd,
    events: Mutex<VecDeque<T>>,
}

impl<T> EventQueue<T> {
    pub fn new() -> Result<EventQueue<T>, VerbsError> {
        let (reader, writer) = nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(errno)?;
        fcntl(writer.as_raw_fd(), FcntlArg::F_SETFL(OFlag::O_NONBLOCK)).map_err(errno)?;
        // Opening a pipe through /proc gives a new open file description of it, with flags
        // of its own (a dup would share the application's O_NONBLOCK).
        let reader_nowait: OwnedFd = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(format!("/proc/self/fd/{}", reader.as_raw_fd()))
            .map_err(|e| {
                tracing::warn!("event fd: cannot reopen a pipe through /proc/self/fd: {e}");
                e
            })?
            .into();
        Ok(EventQueue {
            reader,
            reader_nowait,
            writer,
            events: Mutex::new(VecDeque::new()),
        })
    }

    /// The fd the application polls and reads.
    pub fn fd(&self) -> RawFd {
        self.reader.as_raw_fd()
    }

    /// Queues an event and makes the fd readable.
    pub fn push(&self, event: T) {
        let mut q = self.events.lock().unwrap_or_else(|p| p.into_inner());
        q.push_back(event);
        // One byte per event; the pipe holds 64 Ki of them, far more than the bounded sources
        // (armed CQs, QP errors, connection events) can produce between two reads.
        if let Err(e) = nix::unistd::write(&self.writer, &[1u8]) {
            tracing::warn!("event fd {}: cannot signal event: {e}", self.fd());
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
            let mut byte = [0u8; 1];
            match nix::unistd::read(self.reader.as_raw_fd(), &mut byte) {
                Ok(1) => {}
                Ok(_) => return Err(VerbsError::Os(libc::EIO)),
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(errno(e)),
            }
            let mut q = self.events.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(ev) = q.pop_front() {
                on_take(&ev);
                return Ok(ev);
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
        loop {
            let mut byte = [0u8; 1];
            match nix::unistd::read(self.reader_nowait.as_raw_fd(), &mut byte) {
                Ok(1) => {}
                Ok(_) => return Err(VerbsError::Os(libc::EIO)),
                Err(Errno::EINTR) => continue,
                Err(Errno::EAGAIN) => return Ok(None),
                Err(e) => return Err(VerbsError::Os(e as i32)),
            }
            let mut q = self.events.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(ev) = q.pop_front() {
                on_take(&ev);
                return Ok(Some(ev));
            }
        }
    }

    /// Whether the application made the fd non-blocking (then waiting is EAGAIN instead).
    pub fn is_nonblocking(&self) -> bool {
        fcntl(self.reader.as_raw_fd(), FcntlArg::F_GETFL)
            .map(|f| OFlag::from_bits_truncate(f).contains(OFlag::O_NONBLOCK))
            .unwrap_or(true)
    }

    /// Drops every queued event matching `pred`, and as many of the fd's bytes, so that the fd
    /// is not left readable with no event behind it. A byte a waiter already read (it has not
    /// taken its event yet) cannot be taken back: that waiter finds one event fewer and waits
    /// for the next byte.
    pub fn discard(&self, pred: impl Fn(&T) -> bool) {
        drop(self.take(pred));
    }

    /// Takes the queued events `pred` selects out of the queue, in their order, with as many of
    /// the fd's bytes (as `discard`).
    pub fn take(&self, pred: impl Fn(&T) -> bool) -> Vec<T> {
        let mut q = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let (taken, kept): (VecDeque<T>, VecDeque<T>) = q.drain(..).partition(|e| pred(e));
        *q = kept;
        let mut dropped = taken.len();
        let mut bytes = [0u8; 64];
        while dropped > 0 {
            let want = dropped.min(bytes.len());
            match nix::unistd::read(self.reader_nowait.as_raw_fd(), &mut bytes[..want]) {
                Ok(0) => break,
                Ok(n) => dropped -= n,
                Err(Errno::EINTR) => {}
                Err(_) => break,
            }
        }
        taken.into()
    }
}

fn errno(e: Errno) -> VerbsError {
    VerbsError::Os(e as i32)
}
