//! Logging: off by default; `UGDR_LOG=debug` (any tracing filter) turns it on, written to
//! stderr or to `UGDR_LOG_FILE`. Never writes to the application's stdout.

use std::sync::Once;

static INIT: Once = Once::new();

pub fn init() {
    INIT.call_once(|| {
        let Ok(filter) = std::env::var("UGDR_LOG") else {
            return;
        };
        let builder = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(format!("ugdr={filter}")))
            .with_thread_names(true)
            .with_ansi(false);
        let _ = match std::env::var_os("UGDR_LOG_FILE").and_then(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .ok()
        }) {
            Some(file) => builder.with_writer(std::sync::Mutex::new(file)).try_init(),
            None => builder.with_writer(std::io::stderr).try_init(),
        };
    });
}
