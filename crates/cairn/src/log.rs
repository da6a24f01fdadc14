//! How log lines look. A command's lines go to whoever ran it: no time, and
//! colour only on a terminal. A daemon's lines go to a file or a journal and
//! are read later, next to other daemons' (containerd's): each carries the
//! time (UTC, RFC 3339 with microseconds), and never colour codes. The
//! snapshotter is a daemon from its start; a lazy layer's server becomes
//! one when it detaches from `cairn mount` (its stderr is then its log
//! file), so the choice is made per line, not once at start.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{Format, Full, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

static DAEMON: AtomicBool = AtomicBool::new(false);

/// A line for stderr whatever the log level (a lazy server's account of
/// its work, its failures): as a daemon, it starts with the time, as the
/// `tracing` lines around it do.
pub(crate) fn line(args: fmt::Arguments<'_>) {
    eprintln!("{}", line_text(args));
}

fn line_text(args: fmt::Arguments<'_>) -> String {
    let mut text = String::new();
    if DAEMON.load(Ordering::Relaxed) && SystemTime.format_time(&mut Writer::new(&mut text)).is_ok()
    {
        text.push(' ');
    }
    fmt::Write::write_fmt(&mut text, args).expect("formatting into a String");
    text
}

/// `eprintln!` for a process that may be a daemon ([`line`]).
macro_rules! logline {
    ($($arg:tt)*) => {
        $crate::log::line(format_args!($($arg)*))
    };
}
pub(crate) use logline;

/// From now on, this process logs as a daemon (time, no colour).
pub(crate) fn as_daemon() {
    DAEMON.store(true, Ordering::Relaxed);
}

/// The event format: a command's or a daemon's, by `DAEMON`.
pub(crate) struct Lines {
    command: Format<Full, ()>,
    daemon: Format<Full, SystemTime>,
}

impl Lines {
    pub(crate) fn new() -> Self {
        let base = Format::default().with_target(false);
        Lines {
            command: base.clone().without_time(),
            daemon: base.with_timer(SystemTime).with_ansi(false),
        }
    }
}

impl<S, N> FormatEvent<S, N> for Lines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        if !DAEMON.load(Ordering::Relaxed) {
            return self.command.format_event(ctx, writer, event);
        }
        // A writer of our own has no colour, whatever the layer was set
        // up with when stderr was still a terminal.
        let mut line = String::new();
        self.daemon
            .format_event(ctx, Writer::new(&mut line), event)?;
        let mut writer = writer;
        fmt::Write::write_str(&mut writer, &line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A command's line has no time; once the process is a daemon, each
    /// line starts with the UTC time, and has no colour codes even where
    /// the layer was set up for a terminal. The same for `logline!`.
    #[test]
    fn a_daemon_line_carries_the_time_and_no_colour() {
        let buf = Buf::default();
        let out = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || out.clone())
            .with_ansi(true)
            .event_format(Lines::new())
            .finish();
        let plain = line_text(format_args!("a line {}", 1));
        let mut timed = String::new();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!("as a command");
            as_daemon();
            timed = line_text(format_args!("a line {}", 2));
            tracing::warn!("as a daemon");
        });
        DAEMON.store(false, Ordering::Relaxed);
        assert_eq!(plain, "a line 1");
        let (time, rest) = timed.split_once(' ').unwrap();
        assert!(time.ends_with('Z') && time.contains('T'), "{timed}");
        assert_eq!(rest, "a line 2");
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].contains("as a command"));
        let command = lines[0].trim_start_matches([' ', '\x1b']);
        assert!(
            !command.starts_with(|c: char| c.is_ascii_digit()),
            "no time: {:?}",
            lines[0]
        );
        let daemon = lines[1];
        assert!(!daemon.contains('\x1b'), "{daemon:?}");
        let (time, rest) = daemon.split_once(' ').unwrap();
        assert!(time.ends_with('Z') && time.contains('T'), "{daemon}");
        assert!(
            rest.trim_start().starts_with("WARN as a daemon"),
            "{daemon}"
        );
    }
}
