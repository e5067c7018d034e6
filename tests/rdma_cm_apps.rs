//! rdmacm-utils and perftest's `-R` mode, unmodified, connecting through ugdr's librdmacm
//! emulation: on 127.0.0.1, on ::1, and across two network namespaces.

mod harness;

use harness::*;
use std::time::Duration;

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Server and client of `program` on this host; both must exit 0.
fn pair(
    program: &str,
    server: &[&str],
    client: &[&str],
    port: u16,
    timeout_s: u64,
) -> (String, String) {
    programs((program, server), (program, client), port, timeout_s)
}

/// `server` and `client` (program, arguments) on this host; both must exit 0.
fn programs(
    server: (&str, &[&str]),
    client: (&str, &[&str]),
    port: u16,
    timeout_s: u64,
) -> (String, String) {
    let (s, c) = run_pingpong(
        preloaded(server.0, server.1),
        preloaded(client.0, client.1),
        port,
        Duration::from_secs(timeout_s),
    );
    assert_success(&s, &format!("{server:?}"));
    assert_success(&c, &format!("{client:?}"));
    (stdout(&s), stdout(&c))
}

/// `rping` with verification, verbose data lines, `count` pings of `size` bytes.
fn rping(addr: &str, extra: &[&str], count: usize) {
    let port = free_port();
    let p = port.to_string();
    let n = count.to_string();
    let mut common = vec!["-a", addr, "-p", &p, "-C", &n, "-S", "1000", "-V", "-v"];
    common.extend_from_slice(extra);
    let mut s = vec!["-s"];
    s.extend_from_slice(&common);
    let mut c = vec!["-c"];
    c.extend_from_slice(&common);
    let (sout, cout) = pair("rping", &s, &c, port, 120);
    // Each ping is a SEND, an RDMA READ by the server, a SEND, an RDMA WRITE by the server:
    // both sides print every ping's data, and -V checked the written copy.
    for (who, out) in [("server", &sout), ("client", &cout)] {
        let lines = out
            .lines()
            .filter(|l| l.contains("ping data: rdma-ping-"))
            .count();
        assert_eq!(lines, count, "{who} printed {lines} pings\n{out}");
    }
    assert!(
        cout.contains(&format!("rdma-ping-{}: ", count - 1)),
        "{cout}"
    );
}

#[test]
fn rping_200_verified_pings_of_1000_bytes() {
    rping("127.0.0.1", &[], 200);
}

#[test]
fn rping_with_queue_pairs_the_application_moves_itself() {
    rping("127.0.0.1", &["-q"], 50);
}

#[test]
fn rping_over_ipv6_loopback() {
    rping("::1", &[], 20);
}

#[test]
fn rping_across_two_hosts() {
    let ns = NetnsPair::new("r");
    let port = free_port();
    let p = port.to_string();
    let common = [
        "-a", ADDR_A, "-p", &p, "-C", "100", "-S", "1000", "-V", "-v",
    ];
    let mut s = vec!["-s"];
    s.extend_from_slice(&common);
    let mut c = vec!["-c"];
    c.extend_from_slice(&common);
    let (so, co) = ns.run_pingpong(
        ns.command(&ns.a, "rping", &s),
        ns.command(&ns.b, "rping", &c),
        port,
        Duration::from_secs(120),
    );
    assert_success(&so, "rping server in namespace A");
    assert_success(&co, "rping client in namespace B");
    let pings = stdout(&co)
        .lines()
        .filter(|l| l.contains("ping data: rdma-ping-"))
        .count();
    assert_eq!(pings, 100, "{}", text(&co));
}

/// The threads of process `pid` and its open descriptors.
fn threads_and_fds(pid: i32) -> (usize, usize) {
    (proc_status(pid, "Threads") as usize, open_fds(pid))
}

/// Under the kernel's CM a connection request costs the listening application nothing until
/// it arrives; under ugdr every TCP connection to the listener's port holds a thread and a
/// descriptor of the application's process until its REQ comes. 800 connections that send
/// part of a length, a length past any frame, or a frame of no known type, held open (400 of
/// them would wait for more): the rping server stays up with at most 129 more descriptors
/// (ugdr's bound, and about as many threads; without it, ~250 of each within 5 s here), and once they are gone a real
/// client connects and pings, verified.
#[test]
fn partial_and_garbage_requests_to_a_listener_take_a_bounded_share_of_the_process() {
    use std::io::Write;
    use std::net::TcpStream;
    let port = free_port();
    let p = port.to_string();
    let common = ["-a", "127.0.0.1", "-p", &p, "-C", "10", "-S", "100", "-V"];
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut server = Guarded::spawn(
        preloaded("rping", &[&["-s"][..], &common].concat()),
        "server",
    );
    while !listening_here(port) {
        server.assert_running();
        assert!(std::time::Instant::now() < deadline, "rping never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (threads, fds) = threads_and_fds(server.pid());
    // All at once (rping listens with a backlog of 3: one after another, most would wait
    // out SYN retransmissions while the first ones' REQ time ran out).
    let connections: Vec<_> = (0..800)
        .map(|i| {
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
                // Refused at once or not, writes may fail: the point is what the server does.
                // Each sends something: a connection that sends nothing may never leave the
                // kernel (SYN cookies), where it costs the process nothing.
                let _ = match i % 4 {
                    0 => s.write_all(&u32::MAX.to_be_bytes()),
                    1 => s.write_all(&[0, 0, 0, 5, 0x63, 1, 2, 3, 4]),
                    2 => s.write_all(&[0, 0]),
                    _ => s.write_all(&[0, 0, 0]),
                };
                Some(s)
            })
        })
        .collect();
    let held: Vec<TcpStream> = connections
        .into_iter()
        .filter_map(|t| t.join().expect("a connecting thread"))
        .collect();
    // The server accepts them as the kernel hands them over: the most it holds over 5 s.
    let (mut threads_now, mut fds_now) = (threads, fds);
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(100));
        server.assert_running();
        let (t, f) = threads_and_fds(server.pid());
        (threads_now, fds_now) = (threads_now.max(t), fds_now.max(f));
    }
    // 128 connections waiting, and one between its accept and its close; the threads of
    // those that gave their turn back may take a moment more to end on a loaded host.
    assert!(
        fds_now <= fds + 128 + 1 && threads_now <= threads + 128 + 64,
        "threads {threads} -> {threads_now}, descriptors {fds} -> {fds_now}"
    );
    drop(held);
    let client = Guarded::spawn(
        preloaded("rping", &[&["-c"][..], &common].concat()),
        "client",
    );
    let c = client.wait_until(deadline).unwrap_or_else(|o| o);
    assert_success(&c, "rping client after the flood");
    let s = server.wait_until(deadline).unwrap_or_else(|o| o);
    assert_success(&s, "rping server after the flood");
}

#[test]
fn an_address_nobody_answers_is_an_address_error_within_the_timeout() {
    // 10.199.0.3 is on namespace B's link, but no host has it: address resolution (rping
    // asks for 2 s) must give up with ADDR_ERROR, and rping exits with an error, not a hang.
    let ns = NetnsPair::new("x");
    let started = std::time::Instant::now();
    let out = run(
        ns.command(
            &ns.b,
            "rping",
            &["-c", "-a", "10.199.0.3", "-p", "7174", "-C", "1"],
        ),
        "rping towards a silent address",
        Duration::from_secs(60),
    );
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("RDMA_CM_EVENT_ADDR_ERROR"),
        "{}",
        text(&out)
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "the 2 s resolution timeout was not honoured"
    );
}

fn ucmatose(connections: &str) {
    let port = free_port();
    let p = port.to_string();
    let (s, c) = pair(
        "ucmatose",
        &["-p", &p, "-c", connections],
        &["-s", "127.0.0.1", "-p", &p, "-c", connections],
        port,
        120,
    );
    for (who, out) in [("server", &s), ("client", &c)] {
        assert!(out.contains("data transfers complete"), "{who}\n{out}");
        assert!(out.contains("test complete"), "{who}\n{out}");
        assert!(out.contains("return status 0"), "{who}\n{out}");
        assert!(!out.contains("failed"), "{who}\n{out}");
    }
}

#[test]
fn ucmatose_one_connection() {
    ucmatose("1");
}

#[test]
fn ucmatose_eight_connections() {
    ucmatose("8");
}

#[test]
fn ucmatose_migrating_its_ids_to_another_channel() {
    let port = free_port();
    let p = port.to_string();
    let (s, c) = pair(
        "ucmatose",
        &["-p", &p, "-c", "4", "-m"],
        &["-s", "127.0.0.1", "-p", &p, "-c", "4", "-m"],
        port,
        120,
    );
    for (who, out) in [("server", &s), ("client", &c)] {
        assert!(
            out.contains("migrating to new event channel"),
            "{who}\n{out}"
        );
        assert!(out.contains("test complete"), "{who}\n{out}");
        assert!(out.contains("return status 0"), "{who}\n{out}");
    }
}

#[test]
fn ucmatose_sixty_four_connections_to_one_listener() {
    ucmatose("64");
}

#[test]
fn rdma_server_and_rdma_client() {
    let port = free_port();
    let p = port.to_string();
    let (s, c) = programs(
        ("rdma_server", &["-s", "127.0.0.1", "-p", &p]),
        ("rdma_client", &["-s", "127.0.0.1", "-p", &p]),
        port,
        60,
    );
    assert!(s.contains("rdma_server: end 0"), "{s}");
    assert!(c.contains("rdma_client: end 0"), "{c}");
}

/// `rdma_xserver -c x` / `rdma_xclient -c x`: XRC over rdma_cm (RDMA_PS_IB, an XRC_RECV id
/// whose XRC SRQ number travels in the accept's private data, an XRC_SEND id whose inline
/// SEND names it); both wait for their completion and exit 0 only if every call succeeded.
#[test]
fn rdma_xserver_and_rdma_xclient() {
    let port = free_port();
    let p = port.to_string();
    let (s, c) = programs(
        ("rdma_xserver", &["-c", "x", "-p", &p]),
        ("rdma_xclient", &["-c", "x", "-s", "127.0.0.1", "-p", &p]),
        port,
        60,
    );
    assert!(s.contains("rdma_xserver: end 0"), "{s}");
    assert!(c.contains("rdma_xclient: end 0"), "{c}");
}

#[test]
fn rdma_xserver_and_rdma_xclient_across_two_hosts() {
    let ns = NetnsPair::new("rx");
    let port = free_port();
    let p = port.to_string();
    let (so, co) = ns.run_pingpong(
        ns.command(&ns.a, "rdma_xserver", &["-c", "x", "-p", &p]),
        ns.command(&ns.b, "rdma_xclient", &["-c", "x", "-s", ADDR_A, "-p", &p]),
        port,
        Duration::from_secs(60),
    );
    assert_success(&so, "rdma_xserver in namespace A");
    assert_success(&co, "rdma_xclient in namespace B");
    assert!(stdout(&so).contains("rdma_xserver: end 0"), "{}", text(&so));
    assert!(stdout(&co).contains("rdma_xclient: end 0"), "{}", text(&co));
}

fn perftest_r(program: &str) {
    let port = free_port();
    let p = port.to_string();
    let (_, c) = pair(
        program,
        &["-R", "-p", &p, "-n", "1000"],
        &["-R", "-p", &p, "-n", "1000", "127.0.0.1"],
        port,
        120,
    );
    assert!(c.contains("#bytes"), "no result table\n{c}");
}

#[test]
fn ib_send_bw_over_rdma_cm() {
    perftest_r("ib_send_bw");
}

#[test]
fn ib_write_lat_over_rdma_cm() {
    perftest_r("ib_write_lat");
}

#[test]
fn ib_read_bw_over_rdma_cm() {
    perftest_r("ib_read_bw");
}

/// udaddy: UD queue pairs found through RDMA_PS_UDP (service ID resolution: the reply carries
/// the peer's address vector, QPN and Q_Key). udaddy has no port option (7174), so both runs
/// share one test.
#[test]
fn udaddy_with_one_and_with_four_endpoints() {
    for count in ["1", "4"] {
        let (s, c) = pair(
            "udaddy",
            &["-c", count],
            &["-s", "127.0.0.1", "-c", count],
            7174,
            60,
        );
        for (who, out) in [("server", &s), ("client", &c)] {
            assert!(out.contains("data transfers complete"), "{who}\n{out}");
            assert!(out.contains("return status 0"), "{who}\n{out}");
        }
    }
}

/// Starts `server`, which serves until killed (cmtime's server never exits), waits until it
/// listens, runs `client` to its end, checks the server is still serving, then stops it;
/// (server output, client output).
fn client_of_endless_server(
    server: std::process::Command,
    client: std::process::Command,
    port: u16,
    listening: impl Fn(u16) -> bool,
) -> (std::process::Output, std::process::Output) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut srv = Guarded::spawn(server, "server");
    while !listening(port) {
        srv.assert_running();
        assert!(
            std::time::Instant::now() < deadline,
            "server never listened on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = Guarded::spawn(client, "client").wait(deadline);
    srv.assert_running();
    let s = srv
        .wait_until(std::time::Instant::now())
        .unwrap_or_else(|o| o);
    (s, c)
}

/// cmtime's table (rdma-core 44: `step  total ms  max ms  min us  us / conn`): a row for
/// every step, each timed for at least one connection (an untimed step keeps the 999999999
/// placeholder as its minimum), and no failed connection.
fn assert_cmtime_table(client: &std::process::Output, server: &std::process::Output, bind: bool) {
    assert_success(client, "cmtime client");
    let out = stdout(client);
    for bad in ["error", "failure", "failing"] {
        assert!(!out.contains(bad), "{out}");
        assert!(!stdout(server).contains(bad), "server\n{}", text(server));
    }
    assert!(
        out.contains("step              total ms     max ms     min us  us / conn"),
        "{out}"
    );
    let mut steps = vec!["create id"];
    if bind {
        steps.push("bind addr");
    }
    steps.extend([
        "resolve addr",
        "resolve route",
        "create qp",
        "connect",
        "disconnect",
        "destroy",
    ]);
    for step in steps {
        let row = out
            .lines()
            .find(|l| l.split(':').next().map(str::trim) == Some(step))
            .unwrap_or_else(|| panic!("no row for {step}\n{out}"));
        let numbers: Vec<f64> = row
            .split(':')
            .nth(1)
            .unwrap_or("")
            .split_whitespace()
            .map(|n| n.parse().unwrap_or_else(|_| panic!("{row}")))
            .collect();
        assert_eq!(numbers.len(), 4, "{row}");
        assert!(numbers.iter().all(|n| *n >= 0.0), "{row}");
        assert!(numbers[2] < 999_999.0, "{step}: no connection timed\n{out}");
    }
}

#[test]
fn cmtime_one_hundred_connections() {
    let port = free_port();
    let p = port.to_string();
    let (s, c) = client_of_endless_server(
        preloaded("cmtime", &["-b", "127.0.0.1", "-p", &p]),
        preloaded("cmtime", &["-s", "127.0.0.1", "-p", &p, "-c", "100"]),
        port,
        |p| {
            let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
            listening(p, &tcp)
        },
    );
    assert_cmtime_table(&c, &s, false);
}

#[test]
fn cmtime_across_two_hosts() {
    let ns = NetnsPair::new("t");
    let port = free_port();
    let p = port.to_string();
    let (s, c) = client_of_endless_server(
        ns.command(&ns.a, "cmtime", &["-b", ADDR_A, "-p", &p]),
        ns.command(
            &ns.b,
            "cmtime",
            &["-s", ADDR_A, "-b", ADDR_B, "-p", &p, "-c", "50"],
        ),
        port,
        |p| ns.listening(&ns.a, p),
    );
    assert_cmtime_table(&c, &s, true);
}
