//! A throttling TCP proxy on 127.0.0.1: relays every connection to an
//! upstream address byte for byte (so HTTP keep-alive, Range requests and
//! everything else work unchanged), and on the way back to the client
//! sleeps between chunks. It stretches a pull over a predictable time
//! without any hook in cairn itself; the delay can be changed (or set to
//! zero) while it runs.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::Duration;

pub struct SlowProxy {
    pub addr: String,
    shared: Arc<Shared>,
}

struct Shared {
    /// Microseconds to sleep after each chunk sent to a client.
    delay_us: AtomicU64,
    /// Bytes per chunk.
    chunk: usize,
    connections: AtomicU64,
    bytes_down: AtomicU64,
    stop: AtomicBool,
    /// While true, nothing more is sent to any client.
    paused: Mutex<bool>,
    resumed: Condvar,
}

impl SlowProxy {
    /// Starts relaying to `upstream` (`host:port`), `chunk` bytes at a time,
    /// with no delay until [`set_delay`](Self::set_delay).
    pub fn start(upstream: &str, chunk: usize) -> SlowProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let shared = Arc::new(Shared {
            delay_us: AtomicU64::new(0),
            chunk,
            connections: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            paused: Mutex::new(false),
            resumed: Condvar::new(),
        });
        let upstream = upstream.to_owned();
        let s = Arc::clone(&shared);
        thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(client) = conn else { continue };
                s.connections.fetch_add(1, Ordering::Relaxed);
                let Ok(server) = TcpStream::connect(&upstream) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                relay(client, server, Arc::clone(&s));
            }
        });
        SlowProxy { addr, shared }
    }

    /// Sleep this long after each chunk sent to a client (zero: full speed).
    pub fn set_delay(&self, d: Duration) {
        self.shared
            .delay_us
            .store(d.as_micros() as u64, Ordering::Relaxed);
    }

    /// Sends nothing more to any client (after the chunk in flight, if
    /// any) until [`resume`](Self::resume): a download stalls for as long
    /// as a test needs, however slow the machine.
    pub fn pause(&self) {
        *self.shared.paused.lock().unwrap() = true;
    }

    /// Undoes [`pause`](Self::pause).
    pub fn resume(&self) {
        *self.shared.paused.lock().unwrap() = false;
        self.shared.resumed.notify_all();
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::Relaxed)
    }

    /// Bytes relayed to clients so far.
    pub fn bytes_down(&self) -> u64 {
        self.shared.bytes_down.load(Ordering::Relaxed)
    }
}

impl Drop for SlowProxy {
    fn drop(&mut self) {
        self.resume();
        self.shared.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees `stop`.
        let _ = TcpStream::connect(&self.addr);
    }
}

/// Two threads per connection: client → server at full speed, server →
/// client throttled. When either side ends, both sockets are shut down so
/// the other thread ends too (a killed cairn closes its side; the registry
/// keeps idle connections open).
fn relay(client: TcpStream, server: TcpStream, s: Arc<Shared>) {
    let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
    thread::spawn(move || {
        let (mut from, mut to) = (c2, s2);
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    });
    thread::spawn(move || {
        let (mut from, mut to) = (server, client);
        let mut buf = vec![0u8; s.chunk];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let mut paused = s.paused.lock().unwrap();
                    while *paused {
                        paused = s.resumed.wait(paused).unwrap();
                    }
                    drop(paused);
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    s.bytes_down.fetch_add(n as u64, Ordering::Relaxed);
                    let d = s.delay_us.load(Ordering::Relaxed);
                    if d > 0 {
                        thread::sleep(Duration::from_micros(d));
                    }
                }
            }
        }
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    });
}
