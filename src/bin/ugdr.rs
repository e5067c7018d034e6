//! `ugdr`: run a verbs program over ugdr, and show what ugdr presents.
//!
//! * `ugdr run [--] CMD ARGS...` runs CMD with `LD_PRELOAD` set to the `libugdr.so` next to
//!   this binary (prepended to any existing preload), keeping the rest of the environment.
//! * `ugdr info` prints the device, its port (LID, GID), and the UCX transports a connection
//!   on this host would use.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

const USAGE: &str = "usage: ugdr run [--] CMD [ARGS...]\n       ugdr info";

fn library_path() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("UGDR_LIBRARY") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the ugdr binary: {e}"))?;
    let dir = exe.parent().ok_or("the ugdr binary has no directory")?;
    for candidate in [dir.join("libugdr.so"), dir.join("../lib/libugdr.so")] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(format!(
        "libugdr.so not found next to {} (set UGDR_LIBRARY)",
        exe.display()
    ))
}

fn run(args: &[String]) -> ExitCode {
    let args = match args.first().map(String::as_str) {
        Some("--") => &args[1..],
        _ => args,
    };
    let Some((program, rest)) = args.split_first() else {
        eprintln!("ugdr run: no command given\n{USAGE}");
        return ExitCode::from(2);
    };
    let lib = match library_path() {
        Ok(l) => l,
        Err(e) => {
            eprintln!("ugdr run: {e}");
            return ExitCode::from(2);
        }
    };
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(existing) if !existing.is_empty() => format!("{}:{existing}", lib.display()),
        _ => lib.display().to_string(),
    };
    let err = Command::new(program)
        .args(rest)
        .env("LD_PRELOAD", preload)
        .exec();
    eprintln!("ugdr run: cannot run {program}: {err}");
    ExitCode::from(127)
}

fn info() -> ExitCode {
    match ugdr::engine::Engine::get() {
        Ok(engine) => {
            print!("{}", ugdr::report::describe(engine));
            engine.shutdown();
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("ugdr info: cannot start the engine: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("run") => run(&args[1..]),
        Some("info") => info(),
        Some("-h") | Some("--help") | Some("help") => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
