//! A tiny HTTP/1.1 server on 127.0.0.1 that speaks just enough of the
//! distribution API for tests to make it misbehave on purpose: every
//! request goes to a handler closure that decides the answer (status,
//! headers, body, a short body, a hang). One connection per request
//! (`Connection: close`). Stops on drop; a hang is bounded.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A request as the handler sees it.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// What to answer.
pub enum Reply {
    /// Status, headers, body (Content-Length is added).
    Full(u16, Vec<(String, String)>, Vec<u8>),
    /// Headers claiming `claimed` bytes, then only `body`, then close.
    Short(u16, Vec<(String, String)>, Vec<u8>, u64),
    /// Headers (with `claimed` Content-Length) and `body`, then silence
    /// for `hang` before closing.
    StallAfter(Vec<(String, String)>, Vec<u8>, u64, Duration),
    /// Status, headers, body without Content-Length: ends when the
    /// connection closes.
    Unsized(u16, Vec<(String, String)>, Vec<u8>),
    /// Accept, read the request, say nothing for this long, close.
    Hang(Duration),
}

impl Reply {
    pub fn ok(content_type: &str, body: Vec<u8>) -> Reply {
        Reply::Full(
            200,
            vec![("Content-Type".into(), content_type.into())],
            body,
        )
    }

    pub fn status(status: u16, body: &str) -> Reply {
        Reply::Full(
            status,
            vec![("Content-Type".into(), "application/json".into())],
            body.as_bytes().to_vec(),
        )
    }

    /// A distribution-spec error body.
    pub fn error(status: u16, code: &str, message: &str) -> Reply {
        Reply::status(
            status,
            &format!(r#"{{"errors":[{{"code":"{code}","message":"{message}","detail":null}}]}}"#),
        )
    }

    pub fn with_header(mut self, k: &str, v: &str) -> Reply {
        if let Reply::Full(_, h, _)
        | Reply::Short(_, h, _, _)
        | Reply::StallAfter(h, _, _, _)
        | Reply::Unsized(_, h, _) = &mut self
        {
            h.push((k.into(), v.into()));
        }
        self
    }
}

pub type Handler = Arc<dyn Fn(&Request) -> Reply + Send + Sync>;

pub struct FakeServer {
    pub addr: String,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    /// Every request seen, in order.
    pub log: Arc<Mutex<Vec<Request>>>,
}

impl FakeServer {
    pub fn start(handler: impl Fn(&Request) -> Reply + Send + Sync + 'static) -> FakeServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let handler: Handler = Arc::new(handler);
        let accept = {
            let stop = Arc::clone(&stop);
            let log = Arc::clone(&log);
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let handler = Arc::clone(&handler);
                    let log = Arc::clone(&log);
                    let stop = Arc::clone(&stop);
                    std::thread::spawn(move || serve(conn, &*handler, &log, &stop));
                }
            })
        };
        FakeServer {
            addr,
            stop,
            accept: Some(accept),
            log,
        }
    }

    pub fn requests(&self) -> Vec<Request> {
        self.log.lock().unwrap().clone()
    }

    pub fn count(&self, pred: impl Fn(&Request) -> bool) -> usize {
        self.log.lock().unwrap().iter().filter(|r| pred(r)).count()
    }
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop.
        let _ = TcpStream::connect(&self.addr);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn serve(
    conn: TcpStream,
    handler: &(dyn Fn(&Request) -> Reply + Send + Sync),
    log: &Mutex<Vec<Request>>,
    stop: &AtomicBool,
) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 {
            return;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let req = Request {
        method,
        path,
        headers,
    };
    log.lock().unwrap().push(req.clone());
    let reply = handler(&req);
    let mut out = conn;
    let head = |status: u16, headers: &[(String, String)], len: Option<u64>| {
        let mut s = format!("HTTP/1.1 {status} {}\r\n", reason(status));
        for (k, v) in headers {
            s.push_str(&format!("{k}: {v}\r\n"));
        }
        if let Some(len) = len {
            s.push_str(&format!("Content-Length: {len}\r\n"));
        }
        s.push_str("Connection: close\r\n\r\n");
        s
    };
    let sleep_unless_stopped = |d: Duration| {
        let end = std::time::Instant::now() + d.min(Duration::from_secs(20));
        while std::time::Instant::now() < end && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    match reply {
        Reply::Full(status, headers, body) => {
            let _ = out.write_all(head(status, &headers, Some(body.len() as u64)).as_bytes());
            if req.method != "HEAD" {
                let _ = out.write_all(&body);
            }
        }
        Reply::Short(status, headers, body, claimed) => {
            let _ = out.write_all(head(status, &headers, Some(claimed)).as_bytes());
            let _ = out.write_all(&body);
        }
        Reply::StallAfter(headers, body, claimed, d) => {
            let _ = out.write_all(head(200, &headers, Some(claimed)).as_bytes());
            let _ = out.write_all(&body);
            let _ = out.flush();
            sleep_unless_stopped(d);
        }
        Reply::Unsized(status, headers, body) => {
            let _ = out.write_all(head(status, &headers, None).as_bytes());
            let _ = out.write_all(&body);
        }
        Reply::Hang(d) => sleep_unless_stopped(d),
    }
    let _ = out.flush();
    let _ = out.shutdown(std::net::Shutdown::Both);
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        307 => "Temporary Redirect",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}
