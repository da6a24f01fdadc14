//! An HTTP proxy in front of a test registry that records range requests
//! of blobs and, on demand, corrupts their bodies (the chunked-read and
//! eStargz tests: wrong bytes from a registry must give EIO and store
//! nothing).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An HTTP proxy on 127.0.0.1, one request per connection (it asks the
/// registry to close, and so tells the client): it records each blob
/// request's `Range`, waits `delay` before answering one, and while
/// `corrupt` is set flips a byte in the middle of every ranged body. It
/// also records the path of each whole (unranged) blob request.
pub struct RangeProxy {
    pub addr: String,
    ranges: Arc<Mutex<Vec<(String, String)>>>,
    wholes: Arc<Mutex<Vec<String>>>,
    pub corrupt: Arc<AtomicBool>,
}

fn head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4)
}

impl RangeProxy {
    pub fn start(upstream: &str, delay: Duration) -> RangeProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let ranges = Arc::new(Mutex::new(Vec::new()));
        let wholes = Arc::new(Mutex::new(Vec::new()));
        let corrupt = Arc::new(AtomicBool::new(false));
        let (r, w, c, up) = (
            ranges.clone(),
            wholes.clone(),
            corrupt.clone(),
            upstream.to_string(),
        );
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(client) = conn else { continue };
                let (r, w, c, up) = (r.clone(), w.clone(), c.clone(), up.clone());
                std::thread::spawn(move || {
                    let _ = one_request(client, &up, &r, &w, &c, delay);
                });
            }
        });
        RangeProxy {
            addr,
            ranges,
            wholes,
            corrupt,
        }
    }

    /// The path of each whole (unranged) blob request so far.
    pub fn blob_gets(&self) -> Vec<String> {
        self.wholes.lock().unwrap().clone()
    }

    /// The (path, Range) of each ranged blob request so far.
    pub fn blob_ranges(&self) -> Vec<(String, String)> {
        self.ranges.lock().unwrap().clone()
    }
}

fn one_request(
    mut client: TcpStream,
    upstream: &str,
    ranges: &Mutex<Vec<(String, String)>>,
    wholes: &Mutex<Vec<String>>,
    corrupt: &AtomicBool,
    delay: Duration,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    let end = loop {
        if let Some(e) = head_end(&buf) {
            break e;
        }
        let n = client.read(&mut tmp)?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&tmp[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default().to_string();
    let path = request_line
        .split(' ')
        .nth(1)
        .unwrap_or_default()
        .to_string();
    let mut out_head = format!("{request_line}\r\n");
    let mut range = None;
    let mut body_len = 0usize;
    for l in lines.filter(|l| !l.is_empty()) {
        let lower = l.to_ascii_lowercase();
        if lower.starts_with("connection:") {
            continue;
        }
        if let Some(v) = lower.strip_prefix("range:") {
            range = Some(v.trim().to_string());
        }
        if let Some(v) = lower.strip_prefix("content-length:") {
            body_len = v.trim().parse().unwrap_or(0);
        }
        out_head.push_str(l);
        out_head.push_str("\r\n");
    }
    out_head.push_str("Connection: close\r\n\r\n");
    let mut body = buf[end..].to_vec();
    while body.len() < body_len {
        let n = client.read(&mut tmp)?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&tmp[..n]);
    }
    let ranged_blob = path.contains("/blobs/") && range.is_some();
    if path.contains("/blobs/") && range.is_none() && request_line.starts_with("GET ") {
        wholes.lock().unwrap().push(path.clone());
    }
    if ranged_blob {
        ranges
            .lock()
            .unwrap()
            .push((path.clone(), range.clone().unwrap_or_default()));
        std::thread::sleep(delay);
    }
    let mut server = TcpStream::connect(upstream)?;
    server.write_all(out_head.as_bytes())?;
    server.write_all(&body)?;
    let mut response = Vec::new();
    server.read_to_end(&mut response)?;
    if ranged_blob && corrupt.load(Ordering::SeqCst) {
        if let Some(e) = head_end(&response) {
            let mid = e + (response.len() - e) / 2;
            if mid < response.len() {
                response[mid] ^= 0x55;
            }
        }
    }
    client.write_all(&response)?;
    let _ = client.shutdown(Shutdown::Both);
    Ok(())
}
