//! librdmacm's `rdma_*` exports called as a C program calls them: rejects with private data,
//! ports nobody listens on, addresses nobody answers, a peer that dies mid-connection, 64
//! simultaneous connections to one listener, and 1,000 connect/disconnect cycles that leak
//! nothing.

mod fixture;
mod harness;

use fixture::*;
use std::os::raw::{c_int, c_void};
use std::ptr::null_mut;
use std::time::{Duration, Instant};

unsafe extern "C" {
    fn rdma_create_event_channel() -> *mut rdma_event_channel;
    fn rdma_destroy_event_channel(ch: *mut rdma_event_channel);
    fn rdma_create_id(
        ch: *mut rdma_event_channel,
        id: *mut *mut rdma_cm_id,
        context: *mut c_void,
        ps: rdma_port_space,
    ) -> c_int;
    fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int;
    fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int;
    fn rdma_resolve_addr(
        id: *mut rdma_cm_id,
        src: *mut sockaddr,
        dst: *mut sockaddr,
        timeout_ms: c_int,
    ) -> c_int;
    fn rdma_resolve_route(id: *mut rdma_cm_id, timeout_ms: c_int) -> c_int;
    fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int;
    fn rdma_connect(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int;
    fn rdma_accept(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int;
    fn rdma_reject(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int;
    fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int;
    fn rdma_migrate_id(id: *mut rdma_cm_id, ch: *mut rdma_event_channel) -> c_int;
    fn rdma_establish(id: *mut rdma_cm_id) -> c_int;
    fn rdma_get_cm_event(ch: *mut rdma_event_channel, ev: *mut *mut rdma_cm_event) -> c_int;
    fn rdma_ack_cm_event(ev: *mut rdma_cm_event) -> c_int;
    fn rdma_create_qp(id: *mut rdma_cm_id, pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> c_int;
    fn rdma_destroy_qp(id: *mut rdma_cm_id);
    fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16;
    fn rdma_get_devices(n: *mut c_int) -> *mut *mut ibv_context;
    fn rdma_free_devices(list: *mut *mut ibv_context);
    fn rdma_set_option(
        id: *mut rdma_cm_id,
        level: c_int,
        optname: c_int,
        optval: *mut c_void,
        optlen: usize,
    ) -> c_int;
}

const PS_TCP: rdma_port_space = rdma_port_space(0x0106);
const PS_UDP: rdma_port_space = rdma_port_space(0x0111);
/// `RDMA_OPTION_ID` and its `RDMA_OPTION_ID_ACK_TIMEOUT` (rdma_cma.h).
const OPTION_ID: c_int = 0;
const OPTION_ID_ACK_TIMEOUT: c_int = 3;

/// What a test needs of one `rdma_cm_event` (copied, then acked).
#[derive(Debug)]
struct Event {
    kind: u32,
    status: i32,
    id: *mut rdma_cm_id,
    listen_id: *mut rdma_cm_id,
    private_data: Vec<u8>,
    qp_num: u32,
}

fn sockaddr_of(addr: std::net::SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: plain C data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr {
        std::net::SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as u16;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
        }
        std::net::SocketAddr::V6(_) => unreachable!("tests use IPv4"),
    }
    ss
}

/// The next event of `ch` within 10 s (the fd is polled, so a missing event fails, not hangs).
fn next_event(ch: *mut rdma_event_channel) -> Event {
    assert!(readable_within(ch, 10_000), "no CM event within 10 s");
    let mut ev = null_mut();
    assert_eq!(
        unsafe { rdma_get_cm_event(ch, &mut ev) },
        0,
        "errno {}",
        errno()
    );
    let e = unsafe { &*ev };
    let conn = unsafe { e.param.conn };
    let private_data = if conn.private_data.is_null() {
        Vec::new()
    } else {
        unsafe {
            std::slice::from_raw_parts(
                conn.private_data as *const u8,
                conn.private_data_len as usize,
            )
        }
        .to_vec()
    };
    let out = Event {
        kind: e.event.0,
        status: e.status,
        id: e.id,
        listen_id: e.listen_id,
        private_data,
        qp_num: conn.qp_num,
    };
    assert_eq!(unsafe { rdma_ack_cm_event(ev) }, 0);
    out
}

fn expect(ch: *mut rdma_event_channel, kind: rdma_cm_event_type) -> Event {
    let e = next_event(ch);
    assert_eq!(e.kind, kind.0, "expected event {} got {e:?}", kind.0);
    e
}

use rdma_cm_event_type as K;

struct Cm {
    ch: *mut rdma_event_channel,
}

impl Cm {
    fn new() -> Cm {
        let ch = unsafe { rdma_create_event_channel() };
        assert!(!ch.is_null(), "errno {}", errno());
        Cm { ch }
    }

    fn id(&self) -> *mut rdma_cm_id {
        let mut id = null_mut();
        assert_eq!(
            unsafe { rdma_create_id(self.ch, &mut id, null_mut(), PS_TCP) },
            0
        );
        id
    }

    /// A listener on 127.0.0.1 and an ephemeral port; returns it and the port.
    fn listener(&self, backlog: c_int) -> (*mut rdma_cm_id, u16) {
        let id = self.id();
        let mut ss = sockaddr_of("127.0.0.1:0".parse().unwrap());
        assert_eq!(
            unsafe { rdma_bind_addr(id, &mut ss as *mut _ as *mut sockaddr) },
            0
        );
        assert_eq!(unsafe { rdma_listen(id, backlog) }, 0);
        let port = u16::from_be(unsafe { rdma_get_src_port(id) });
        assert_ne!(port, 0);
        (id, port)
    }

    /// A client id with its address and route resolved towards 127.0.0.1:port.
    fn resolved(&self, port: u16) -> *mut rdma_cm_id {
        let id = self.id();
        let mut dst = sockaddr_of(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
        assert_eq!(
            unsafe { rdma_resolve_addr(id, null_mut(), &mut dst as *mut _ as *mut sockaddr, 2000) },
            0
        );
        expect(self.ch, K::RDMA_CM_EVENT_ADDR_RESOLVED);
        assert!(
            !unsafe { (*id).verbs }.is_null(),
            "ADDR_RESOLVED attaches the device"
        );
        assert_eq!(unsafe { rdma_resolve_route(id, 2000) }, 0);
        expect(self.ch, K::RDMA_CM_EVENT_ROUTE_RESOLVED);
        id
    }
}

impl Drop for Cm {
    fn drop(&mut self) {
        unsafe { rdma_destroy_event_channel(self.ch) };
    }
}

fn conn_param(private: &[u8]) -> rdma_conn_param {
    rdma_conn_param {
        private_data: if private.is_empty() {
            std::ptr::null()
        } else {
            private.as_ptr().cast()
        },
        private_data_len: private.len() as u8,
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        ..Default::default()
    }
}

/// An RC QP on `id` whose CQs the CM creates (so their cq_context is the id).
fn cm_qp(id: *mut rdma_cm_id) -> *mut ibv_qp {
    let mut attr = ibv_qp_init_attr {
        qp_type: ibv_qp_type::IBV_QPT_RC,
        cap: ibv_qp_cap {
            max_send_wr: 8,
            max_recv_wr: 8,
            max_send_sge: 1,
            max_recv_sge: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    assert_eq!(
        unsafe { rdma_create_qp(id, null_mut(), &mut attr) },
        0,
        "errno {}",
        errno()
    );
    let raw = unsafe { &*id };
    assert!(!raw.qp.is_null() && !raw.send_cq.is_null() && !raw.recv_cq.is_null());
    assert_eq!(
        unsafe { (*raw.recv_cq).cq_context },
        id.cast(),
        "cq_context == id"
    );
    assert_eq!(
        unsafe { (*raw.send_cq).cq_context },
        id.cast(),
        "cq_context == id"
    );
    assert!(!raw.recv_cq_channel.is_null() && !raw.send_cq_channel.is_null());
    assert_eq!(unsafe { (*raw.qp).state }, ibv_qp_state::IBV_QPS_INIT);
    raw.qp
}

#[test]
fn a_reject_carries_private_data_back_to_the_requester() {
    let server = Cm::new();
    let client = Cm::new();
    let (listener, port) = server.listener(4);
    let id = client.resolved(port);

    let too_long = [7u8; 57];
    let mut p = conn_param(&too_long);
    p.qp_num = 0x1234;
    assert_eq!(
        unsafe { rdma_connect(id, &mut p) },
        -1,
        "57 bytes exceed a REQ"
    );
    assert_eq!(errno(), libc::EINVAL);

    let mut p = conn_param(b"hello");
    p.qp_num = 0x1234;
    assert_eq!(unsafe { rdma_connect(id, &mut p) }, 0);
    let req = expect(server.ch, K::RDMA_CM_EVENT_CONNECT_REQUEST);
    assert_eq!(req.listen_id, listener);
    assert_ne!(req.id, listener);
    assert_eq!(req.private_data.len(), 56, "a REQ's private data field");
    assert_eq!(&req.private_data[..5], b"hello");
    assert!(req.private_data[5..].iter().all(|&b| b == 0));
    assert_eq!(req.qp_num, 0x1234);
    // The new id carries the device (the same context rdma_get_devices lists) and the route.
    let mut n = 0;
    let devices = unsafe { rdma_get_devices(&mut n) };
    assert_eq!(n, 1);
    assert_eq!(unsafe { (*req.id).verbs }, unsafe { *devices });
    assert_eq!(unsafe { (*id).verbs }, unsafe { *devices });
    unsafe { rdma_free_devices(devices) };
    assert_eq!(unsafe { (*req.id).route.num_paths }, 1);
    assert_eq!(
        u16::from_be(unsafe { rdma_get_src_port(req.id) }),
        port,
        "the passive id's source port is the listener's"
    );

    let long = [1u8; 149];
    assert_eq!(
        unsafe { rdma_reject(req.id, long.as_ptr().cast(), 149) },
        -1
    );
    assert_eq!(errno(), libc::EINVAL, "149 bytes exceed a REJ");
    assert_eq!(
        unsafe { rdma_reject(req.id, b"nope".as_ptr().cast(), 4) },
        0
    );
    let rej = expect(client.ch, K::RDMA_CM_EVENT_REJECTED);
    assert_eq!(rej.status, 28, "IB_CM_REJ_CONSUMER_DEFINED");
    assert_eq!(rej.private_data.len(), 148, "a REJ's private data field");
    assert_eq!(&rej.private_data[..4], b"nope");
    for i in [req.id, id, listener] {
        assert_eq!(unsafe { rdma_destroy_id(i) }, 0);
    }
}

/// Whether `ch` has an event queued within `ms` (not taken).
fn readable_within(ch: *mut rdma_event_channel, ms: c_int) -> bool {
    let mut pfd = libc::pollfd {
        fd: unsafe { (*ch).fd },
        events: libc::POLLIN,
        revents: 0,
    };
    unsafe { libc::poll(&mut pfd, 1, ms) == 1 }
}

/// `rdma_migrate_id` moves the events already queued for the id to the new channel (the man
/// page; the kernel's ucma does): a listener's pending connection request (with the id it
/// created), and a connected id's DISCONNECTED. cmatose -m migrates right after its last
/// sends, when the peer's disconnect may have arrived already: that event stayed on the old
/// channel, which cmatose then destroys, and it waited for it for good.
#[test]
fn rdma_migrate_id_moves_the_events_already_queued() {
    let server = Cm::new();
    let client = Cm::new();
    let (listener, port) = server.listener(4);
    let id = client.resolved(port);
    let mut p = conn_param(&[]);
    p.qp_num = 0x1234;
    assert_eq!(unsafe { rdma_connect(id, &mut p) }, 0);
    assert!(readable_within(server.ch, 10_000), "the request is queued");
    let second = Cm::new();
    assert_eq!(unsafe { rdma_migrate_id(listener, second.ch) }, 0);
    assert!(
        !readable_within(server.ch, 100),
        "the request left the old channel"
    );
    let req = expect(second.ch, K::RDMA_CM_EVENT_CONNECT_REQUEST);
    assert_eq!(req.listen_id, listener);
    assert_eq!(unsafe { (*listener).channel }, second.ch);
    assert_eq!(
        unsafe { (*req.id).channel },
        second.ch,
        "the requested id reports on the channel its request came on"
    );

    let mut p = conn_param(&[]);
    p.qp_num = 0x5678;
    assert_eq!(unsafe { rdma_accept(req.id, &mut p) }, 0);
    // Without a QP the active side finishes the handshake itself.
    expect(client.ch, K::RDMA_CM_EVENT_CONNECT_RESPONSE);
    assert_eq!(unsafe { rdma_establish(id) }, 0);
    expect(second.ch, K::RDMA_CM_EVENT_ESTABLISHED);
    assert_eq!(unsafe { rdma_disconnect(id) }, 0);
    expect(client.ch, K::RDMA_CM_EVENT_DISCONNECTED);
    assert!(readable_within(second.ch, 10_000), "DISCONNECTED is queued");
    let third = Cm::new();
    assert_eq!(unsafe { rdma_migrate_id(req.id, third.ch) }, 0);
    assert!(
        !readable_within(second.ch, 100),
        "DISCONNECTED left the old channel"
    );
    let gone = expect(third.ch, K::RDMA_CM_EVENT_DISCONNECTED);
    assert_eq!(gone.id, req.id);
    for i in [req.id, id, listener] {
        assert_eq!(unsafe { rdma_destroy_id(i) }, 0);
    }
}

/// nvme_rdma and nvmf tear a qpair down with rdma_disconnect whatever became of its
/// connection. As with librdmacm and the kernel CM: an id that never started a connection
/// cannot disconnect (EINVAL); one whose REQ is unanswered can (its QP goes to ERR; the IB CM
/// sends DREQ only once established, so no DISCONNECTED follows, and the answer then finds
/// the QP in ERR: CONNECT_ERROR); so can one that was rejected, or whose connection failed.
#[test]
fn rdma_disconnect_works_before_the_answer_after_a_reject_and_after_a_failure() {
    let server = Cm::new();
    let client = Cm::new();
    let (listener, port) = server.listener(4);
    let idle = client.id();
    assert_eq!(unsafe { rdma_disconnect(idle) }, -1);
    assert_eq!(errno(), libc::EINVAL);

    let id = client.resolved(port);
    let qp = cm_qp(id);
    let mut p = conn_param(b"spdk");
    assert_eq!(unsafe { rdma_connect(id, &mut p) }, 0);
    let req = expect(server.ch, K::RDMA_CM_EVENT_CONNECT_REQUEST);
    assert_eq!(unsafe { rdma_disconnect(id) }, 0, "errno {}", errno());
    assert_eq!(qp_state(qp), ibv_qp_state::IBV_QPS_ERR.0);
    let sqp = cm_qp(req.id);
    let mut p = conn_param(&[]);
    assert_eq!(unsafe { rdma_accept(req.id, &mut p) }, 0);
    let e = expect(client.ch, K::RDMA_CM_EVENT_CONNECT_ERROR);
    assert_eq!(e.id, id);
    assert_eq!(
        unsafe { rdma_disconnect(id) },
        0,
        "again, after CONNECT_ERROR"
    );
    // The passive side never sees the connection established: the requester gave it up.
    let gone = next_event(server.ch);
    assert_eq!(gone.id, req.id);
    assert!(
        [
            K::RDMA_CM_EVENT_UNREACHABLE.0,
            K::RDMA_CM_EVENT_REJECTED.0,
            K::RDMA_CM_EVENT_CONNECT_ERROR.0
        ]
        .contains(&gone.kind),
        "{gone:?}"
    );
    assert_eq!(unsafe { rdma_disconnect(req.id) }, 0, "after a failure");
    assert_eq!(qp_state(sqp), ibv_qp_state::IBV_QPS_ERR.0);

    let rejected = client.resolved(port);
    let rqp = cm_qp(rejected);
    let mut p = conn_param(&[]);
    assert_eq!(unsafe { rdma_connect(rejected, &mut p) }, 0);
    let req2 = expect(server.ch, K::RDMA_CM_EVENT_CONNECT_REQUEST);
    assert_eq!(unsafe { rdma_reject(req2.id, null_mut(), 0) }, 0);
    expect(client.ch, K::RDMA_CM_EVENT_REJECTED);
    assert_eq!(unsafe { rdma_disconnect(rejected) }, 0, "after a reject");
    assert_eq!(qp_state(rqp), ibv_qp_state::IBV_QPS_ERR.0);

    for i in [id, req.id, rejected] {
        unsafe { rdma_destroy_qp(i) };
    }
    for i in [idle, id, req.id, rejected, req2.id, listener] {
        assert_eq!(unsafe { rdma_destroy_id(i) }, 0);
    }
}

#[test]
fn a_non_blocking_channel_reports_eagain_and_polls_readable_only_with_an_event() {
    // Asked for reading and writing: the kernel's rdma_cm file is never writable (an event
    // loop that also watches it for writing must not spin), and readable only with an event.
    let cm = Cm::new();
    let fd = unsafe { (*cm.ch).fd };
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    assert_eq!(
        unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) },
        0
    );
    let mut ev = null_mut();
    assert_eq!(unsafe { rdma_get_cm_event(cm.ch, &mut ev) }, -1);
    assert_eq!(errno(), libc::EAGAIN);
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLOUT,
        revents: 0,
    };
    assert_eq!(
        unsafe { libc::poll(&mut pfd, 1, 0) },
        0,
        "ready without an event: {:#x}",
        pfd.revents
    );
    // A wildcard bind leaves the id without a device (SPDK checks this); a concrete one
    // attaches it.
    let any = cm.id();
    let mut ss = sockaddr_of("0.0.0.0:0".parse().unwrap());
    assert_eq!(
        unsafe { rdma_bind_addr(any, &mut ss as *mut _ as *mut sockaddr) },
        0
    );
    assert!(unsafe { (*any).verbs }.is_null());
    let (listener, port) = cm.listener(1);
    assert!(!unsafe { (*listener).verbs }.is_null());
    let mut again = sockaddr_of(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    let dup = cm.id();
    assert_eq!(
        unsafe { rdma_bind_addr(dup, &mut again as *mut _ as *mut sockaddr) },
        -1,
        "a second id on a listening port"
    );
    assert_eq!(errno(), libc::EADDRINUSE);
    let id = cm.id();
    let mut dst = sockaddr_of(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    assert_eq!(
        unsafe { rdma_resolve_addr(id, null_mut(), &mut dst as *mut _ as *mut sockaddr, 1000) },
        0
    );
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, 5000) }, 1);
    assert_eq!(pfd.revents, libc::POLLIN, "readable, not writable");
    assert_eq!(unsafe { rdma_get_cm_event(cm.ch, &mut ev) }, 0);
    assert_eq!(unsafe { (*ev).event }, K::RDMA_CM_EVENT_ADDR_RESOLVED);
    assert_eq!(unsafe { rdma_ack_cm_event(ev) }, 0);
    assert_eq!(
        unsafe { rdma_ack_cm_event(ev) },
        -1,
        "an event is acked once"
    );
    assert_eq!(errno(), libc::EINVAL);
    for i in [id, dup, listener, any] {
        assert_eq!(unsafe { rdma_destroy_id(i) }, 0);
    }
}

#[test]
fn a_port_nobody_listens_on_is_rejected() {
    let client = Cm::new();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let id = client.resolved(port);
    let mut p = conn_param(&[]);
    p.qp_num = 1;
    let started = Instant::now();
    assert_eq!(unsafe { rdma_connect(id, &mut p) }, 0);
    let rej = expect(client.ch, K::RDMA_CM_EVENT_REJECTED);
    assert_eq!(rej.status, 8, "IB_CM_REJ_INVALID_SERVICE_ID");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(unsafe { rdma_destroy_id(id) }, 0);
}

/// Something that is not a CM listens on the port, takes the connection and never answers
/// (a stopped peer process would do the same): the REQ's answer is awaited as long as the IB
/// CM retries a REQ (20 s), then the id is UNREACHABLE with ETIMEDOUT, as under the kernel's
/// CM, instead of waiting for good.
#[test]
fn a_listener_that_never_answers_the_req_is_unreachable_after_the_cm_timeout() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let holder = std::thread::spawn(move || {
        let held = silent.accept();
        std::thread::sleep(Duration::from_secs(35));
        drop(held);
    });
    let client = Cm::new();
    let id = client.resolved(port);
    let mut p = conn_param(&[]);
    p.qp_num = 1;
    let started = Instant::now();
    assert_eq!(unsafe { rdma_connect(id, &mut p) }, 0);
    assert!(
        !readable_within(client.ch, 15_000),
        "an event before the CM's timeout"
    );
    let ev = expect(client.ch, K::RDMA_CM_EVENT_UNREACHABLE);
    assert_eq!(ev.status, -libc::ETIMEDOUT);
    let waited = started.elapsed();
    assert!(
        (Duration::from_secs(19)..Duration::from_secs(30)).contains(&waited),
        "{waited:?}"
    );
    assert_eq!(unsafe { rdma_destroy_id(id) }, 0);
    drop(holder);
}

/// A client id connected to an `rping -s` process (which then waits for the client's first
/// SEND), with two receives (wr_id 11 and 12) posted on its QP.
struct RpingConnection {
    server: std::process::Child,
    client: Cm,
    id: *mut rdma_cm_id,
    qp: *mut ibv_qp,
    mr: *mut ibv_mr,
    buf: Vec<u8>,
}

impl RpingConnection {
    fn establish() -> RpingConnection {
        Self::establish_with(None)
    }

    /// With `ack_timeout`, the client id's `RDMA_OPTION_ID_ACK_TIMEOUT` is set before connecting.
    fn establish_with(ack_timeout: Option<u8>) -> RpingConnection {
        use harness::*;
        let port = free_port();
        let p = port.to_string();
        let server = preloaded("rping", &["-s", "-a", "127.0.0.1", "-p", &p, "-C", "1"])
            .spawn()
            .expect("rping");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !listening(
            port,
            &std::fs::read_to_string("/proc/net/tcp").unwrap_or_default(),
        ) {
            assert!(Instant::now() < deadline, "rping never listened");
            std::thread::sleep(Duration::from_millis(20));
        }
        let client = Cm::new();
        let id = client.resolved(port);
        let qp = cm_qp(id);
        let mut buf = vec![0u8; 256];
        let pd = unsafe { (*qp).pd };
        let mr = unsafe { ibv_reg_mr(pd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        assert!(!mr.is_null());
        for wr_id in [11u64, 12] {
            let mut sge = [ibv_sge {
                addr: buf.as_mut_ptr() as u64,
                length: buf.len() as u32,
                lkey: unsafe { (*mr).lkey },
            }];
            assert_eq!(post_one_recv(qp, wr_id, &mut sge), 0);
        }
        if let Some(mut code) = ack_timeout {
            let r = unsafe {
                rdma_set_option(
                    id,
                    OPTION_ID,
                    OPTION_ID_ACK_TIMEOUT,
                    (&raw mut code).cast(),
                    1,
                )
            };
            assert_eq!(r, 0);
        }
        let mut param = conn_param(&[]);
        assert_eq!(unsafe { rdma_connect(id, &mut param) }, 0);
        expect(client.ch, K::RDMA_CM_EVENT_ESTABLISHED);
        assert_eq!(unsafe { (*qp).state }, ibv_qp_state::IBV_QPS_RTS);
        RpingConnection {
            server,
            client,
            id,
            qp,
            mr,
            buf,
        }
    }

    /// After DISCONNECTED: both receives were flushed, in order.
    fn assert_receives_flushed(&self) {
        let wcs = poll_n(unsafe { (*self.id).recv_cq }, 2);
        for (wc, wr_id) in wcs.iter().zip([11u64, 12]) {
            assert_eq!(wc.wr_id, wr_id);
            assert_eq!(wc.status, ibv_wc_status::IBV_WC_WR_FLUSH_ERR);
            assert_eq!(wc.qp_num, unsafe { (*self.qp).qp_num });
        }
    }

    /// Disconnecting an id whose peer is gone is harmless; everything is destroyed.
    fn close(mut self) {
        assert_eq!(unsafe { rdma_disconnect(self.id) }, 0);
        assert_eq!(unsafe { ibv_dereg_mr(self.mr) }, 0);
        unsafe { rdma_destroy_qp(self.id) };
        assert_eq!(unsafe { rdma_destroy_id(self.id) }, 0);
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

/// The QP's local ACK timeout and retry count, as `ibv_query_qp` reports them.
fn qp_timeouts(qp: *mut ibv_qp) -> (u8, u8) {
    let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
    let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    let mask = (ibv_qp_attr_mask::IBV_QP_TIMEOUT | ibv_qp_attr_mask::IBV_QP_RETRY_CNT).0 as i32;
    assert_eq!(unsafe { ibv_query_qp(qp, &mut attr, mask, &mut init) }, 0);
    (attr.timeout, attr.retry_cnt)
}

/// Without RDMA_OPTION_ID_ACK_TIMEOUT a connected QP gets the ACK timeout the kernel's CM
/// computes for a RoCE path to a ConnectX (18: about 1.07 s; ugdr's ACKs come from the
/// peer's CPU, and 67 ms failed SPDK's connections on a loaded host); the option is an RC
/// id's only, one byte long.
#[test]
fn the_ack_timeout_is_the_kernel_cms_unless_the_application_sets_one() {
    let c = RpingConnection::establish();
    assert_eq!(qp_timeouts(c.qp), (18, 7));
    let mut code = 14u8;
    let set = |id: *mut rdma_cm_id, code: &mut u8, len: usize| unsafe {
        rdma_set_option(
            id,
            OPTION_ID,
            OPTION_ID_ACK_TIMEOUT,
            (code as *mut u8).cast(),
            len,
        )
    };
    assert_eq!(set(c.id, &mut code, 4), -1);
    assert_eq!(errno(), libc::EINVAL);
    let udp = Cm::new();
    let mut ud: *mut rdma_cm_id = null_mut();
    assert_eq!(
        unsafe { rdma_create_id(udp.ch, &mut ud, null_mut(), PS_UDP) },
        0
    );
    assert_eq!(set(ud, &mut code, 1), -1);
    assert_eq!(errno(), libc::EINVAL);
    assert_eq!(unsafe { rdma_destroy_id(ud) }, 0);
    c.close();
}

#[test]
fn a_peer_killed_mid_connection_disconnects_and_flushes_outstanding_receives() {
    let mut c = RpingConnection::establish();
    // rping's server now waits for our first SEND; it dies instead.
    c.server.kill().unwrap();
    c.server.wait().unwrap();
    let killed = Instant::now();
    expect(c.client.ch, K::RDMA_CM_EVENT_DISCONNECTED);
    assert!(killed.elapsed() < Duration::from_secs(5));
    c.assert_receives_flushed();
    c.close();
}

/// Stops process `pid` and waits until every thread of it is stopped (SIGSTOP takes effect
/// asynchronously: a thread running on another CPU carries on for a moment).
fn stop(pid: i32) {
    // SAFETY: signals a process this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("its threads");
        let stopped = tasks.flatten().all(|t| {
            std::fs::read_to_string(t.path().join("stat"))
                .ok()
                .and_then(|st| {
                    st.rsplit(')')
                        .next()
                        .map(|r| r.trim_start().starts_with('T'))
                })
                .unwrap_or(true)
        });
        if stopped {
            return;
        }
        assert!(Instant::now() < deadline, "pid {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A peer that stops answering (its process is stopped: alive, but nothing acknowledges) is
/// noticed by the QP's transport timer (the ACK timeout 14 set with RDMA_OPTION_ID_ACK_TIMEOUT,
/// about 67 ms, and retry_count 7): the SEND completes with RETRY_EXC_ERR, the QP flushes, and
/// the CM reports DISCONNECTED. Before, the SEND waited forever.
#[test]
fn a_peer_that_stops_answering_fails_the_send_and_disconnects() {
    let c = RpingConnection::establish_with(Some(14));
    assert_eq!(qp_timeouts(c.qp), (14, 7));
    stop(c.server.id() as i32);
    let mut sge = [ibv_sge {
        addr: c.buf.as_ptr() as u64,
        length: 16,
        lkey: unsafe { (*c.mr).lkey },
    }];
    let mut wr = send_wr(
        21,
        &mut sge,
        ibv_wr_opcode::IBV_WR_SEND,
        ibv_send_flags::IBV_SEND_SIGNALED.0,
    );
    let stopped = Instant::now();
    assert_eq!(post_one_send(c.qp, &mut wr), 0);
    let wcs = poll_n(unsafe { (*c.id).send_cq }, 1);
    let took = stopped.elapsed();
    assert_eq!(wcs[0].wr_id, 21);
    assert_eq!(wcs[0].status, ibv_wc_status::IBV_WC_RETRY_EXC_ERR);
    assert_eq!(wcs[0].qp_num, unsafe { (*c.qp).qp_num });
    assert!(
        took >= Duration::from_millis(7 * 67) && took < Duration::from_secs(3),
        "RETRY_EXC_ERR after {took:?}"
    );
    expect(c.client.ch, K::RDMA_CM_EVENT_DISCONNECTED);
    c.assert_receives_flushed();
    c.close(); // SIGKILL ends the stopped process too
}

/// Connects `n` clients to one listener (all requests in flight together), each with a QP,
/// sends each client's index over its connection, and checks every server QP got its own.
fn connect_many(
    server: &Cm,
    client: &Cm,
    listener_port: u16,
    n: usize,
) -> Vec<(*mut rdma_cm_id, *mut rdma_cm_id)> {
    let clients: Vec<_> = (0..n).map(|_| client.resolved(listener_port)).collect();
    let client_qps: Vec<_> = clients.iter().map(|&id| cm_qp(id)).collect();
    for &id in &clients {
        let mut p = conn_param(&[]);
        assert_eq!(unsafe { rdma_connect(id, &mut p) }, 0);
    }
    let mut servers = Vec::new();
    for _ in 0..n {
        let req = expect(server.ch, K::RDMA_CM_EVENT_CONNECT_REQUEST);
        cm_qp(req.id);
        let mut p = conn_param(&[]);
        assert_eq!(
            unsafe { rdma_accept(req.id, &mut p) },
            0,
            "errno {}",
            errno()
        );
        servers.push((req.id, req.qp_num));
    }
    // As with librdmacm, the active side finishes (RTR, RTS, RTU) while it reads its event,
    // and only then does the passive side see ESTABLISHED.
    for _ in 0..n {
        expect(client.ch, K::RDMA_CM_EVENT_ESTABLISHED);
    }
    for _ in 0..n {
        expect(server.ch, K::RDMA_CM_EVENT_ESTABLISHED);
    }
    // Pair each server id with its client by the QP number the REQ carried.
    let mut pairs = Vec::new();
    for (i, &cid) in clients.iter().enumerate() {
        let qpn = unsafe { (*client_qps[i]).qp_num };
        let &(sid, _) = servers
            .iter()
            .find(|(_, q)| *q == qpn)
            .expect("a REQ per client QP");
        pairs.push((cid, sid));
    }
    pairs
}

#[test]
fn sixty_four_connections_to_one_listener_each_carry_their_own_data() {
    let server = Cm::new();
    let client = Cm::new();
    let (listener, port) = server.listener(64);
    let pairs = connect_many(&server, &client, port, 64);
    let mut rbufs = vec![[0u8; 8]; pairs.len()];
    let mut sbufs: Vec<[u8; 8]> = (0..pairs.len() as u64)
        .map(|i| (i * 7 + 1).to_le_bytes())
        .collect();
    let mut mrs = Vec::new();
    for (i, &(cid, sid)) in pairs.iter().enumerate() {
        let (sqp, cqp) = unsafe { ((*sid).qp, (*cid).qp) };
        let rmr = unsafe {
            ibv_reg_mr(
                (*sqp).pd,
                rbufs[i].as_mut_ptr().cast(),
                8,
                ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as c_int,
            )
        };
        let smr = unsafe { ibv_reg_mr((*cqp).pd, sbufs[i].as_mut_ptr().cast(), 8, 0) };
        let mut rsge = [ibv_sge {
            addr: rbufs[i].as_mut_ptr() as u64,
            length: 8,
            lkey: unsafe { (*rmr).lkey },
        }];
        assert_eq!(post_one_recv(sqp, i as u64, &mut rsge), 0);
        let mut ssge = ibv_sge {
            addr: sbufs[i].as_mut_ptr() as u64,
            length: 8,
            lkey: unsafe { (*smr).lkey },
        };
        let mut wr = ibv_send_wr {
            wr_id: 1000 + i as u64,
            sg_list: &mut ssge,
            num_sge: 1,
            opcode: ibv_wr_opcode::IBV_WR_SEND,
            send_flags: ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        assert_eq!(post_one_send(cqp, &mut wr), 0);
        mrs.push((rmr, smr));
    }
    for (i, &(cid, sid)) in pairs.iter().enumerate() {
        let rwc = poll_n(unsafe { (*sid).recv_cq }, 1)[0];
        assert_eq!(rwc.status, ibv_wc_status::IBV_WC_SUCCESS);
        assert_eq!(rwc.wr_id, i as u64);
        assert_eq!(rwc.opcode, ibv_wc_opcode::IBV_WC_RECV);
        assert_eq!(rwc.byte_len, 8);
        assert_eq!(rwc.qp_num, unsafe { (*(*sid).qp).qp_num });
        assert_eq!(rbufs[i], sbufs[i], "connection {i} got another's data");
        let swc = poll_n(unsafe { (*cid).send_cq }, 1)[0];
        assert_eq!(swc.status, ibv_wc_status::IBV_WC_SUCCESS);
        assert_eq!(swc.wr_id, 1000 + i as u64);
        assert_eq!(swc.opcode, ibv_wc_opcode::IBV_WC_SEND);
    }
    for ((cid, sid), (rmr, smr)) in pairs.into_iter().zip(mrs) {
        assert_eq!(unsafe { rdma_disconnect(cid) }, 0);
        expect(client.ch, K::RDMA_CM_EVENT_DISCONNECTED);
        let d = expect(server.ch, K::RDMA_CM_EVENT_DISCONNECTED);
        assert_eq!(d.id, sid);
        unsafe {
            ibv_dereg_mr(rmr);
            ibv_dereg_mr(smr);
            rdma_destroy_qp(cid);
            rdma_destroy_qp(sid);
            assert_eq!(rdma_destroy_id(cid), 0);
            assert_eq!(rdma_destroy_id(sid), 0);
        }
    }
    assert_eq!(unsafe { rdma_destroy_id(listener) }, 0);
}

fn count_entries(dir: &str) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Threads of this process named by ugdr's CM (the test harness runs other tests' threads
/// beside this one, so the whole process's count would not do).
fn cm_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|c| c.starts_with("ugdr-cm"))
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn a_thousand_connect_disconnect_cycles_leak_no_fds_threads_or_memory() {
    let server = Cm::new();
    let client = Cm::new();
    let (listener, port) = server.listener(8);
    let cycle = || {
        let pairs = connect_many(&server, &client, port, 1);
        let (cid, sid) = pairs[0];
        assert_eq!(unsafe { rdma_disconnect(cid) }, 0);
        expect(client.ch, K::RDMA_CM_EVENT_DISCONNECTED);
        expect(server.ch, K::RDMA_CM_EVENT_DISCONNECTED);
        assert_eq!(
            unsafe { rdma_disconnect(sid) },
            0,
            "disconnecting twice is harmless"
        );
        unsafe {
            rdma_destroy_qp(cid);
            rdma_destroy_qp(sid);
            assert_eq!(rdma_destroy_id(cid), 0);
            assert_eq!(rdma_destroy_id(sid), 0);
        }
    };
    for _ in 0..20 {
        cycle();
    }
    let settle = || std::thread::sleep(Duration::from_millis(300));
    settle();
    let (fds, threads, rss) = (count_entries("/proc/self/fd"), cm_threads(), rss_kib());
    for _ in 0..1000 {
        cycle();
    }
    settle();
    let (fds_after, threads_after, rss_after) =
        (count_entries("/proc/self/fd"), cm_threads(), rss_kib());
    // Other tests of this binary may run beside this one and hold fds of their own: allow a
    // few, far fewer than one per cycle.
    assert!(
        fds_after <= fds + 16,
        "fds {fds} -> {fds_after} after 1000 cycles"
    );
    assert!(
        threads_after <= threads + 4,
        "cm threads {threads} -> {threads_after}"
    );
    assert!(
        rss_after < rss + 32 * 1024,
        "resident memory {rss} KiB -> {rss_after} KiB after 1000 cycles"
    );
    assert_eq!(unsafe { rdma_destroy_id(listener) }, 0);
}
