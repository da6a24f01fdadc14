//! The gRPC service `containerd.services.snapshots.v1.Snapshots`, written
//! against tonic's server traits without generated code: each method is a
//! route on the HTTP/2 path `/containerd.services.snapshots.v1.Snapshots/NAME`
//! decoded with prost, and its work runs on a blocking thread (the store
//! is synchronous) with the snapshotter locked.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tonic::codegen::{http, Body, StdError};
use tonic::server::{Grpc, NamedService, ServerStreamingService, UnaryService};
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use crate::proto;
use crate::snap::{SnapError, Snapshotter};

pub(crate) type Shared = Arc<Mutex<Snapshotter>>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

impl From<SnapError> for Status {
    fn from(e: SnapError) -> Status {
        let msg = e.to_string();
        match e {
            SnapError::NotFound(_) => Status::not_found(msg),
            SnapError::AlreadyExists(_) => Status::already_exists(msg),
            SnapError::FailedPrecondition(_) => Status::failed_precondition(msg),
            SnapError::InvalidArgument(_) => Status::invalid_argument(msg),
            SnapError::Internal(_) => Status::internal(msg),
        }
    }
}

/// Runs `f` on a blocking thread with the snapshotter locked. At debug
/// level (`CAIRN_LOG=cairn_snapshotter::server=debug`) each call logs how
/// long it waited for the lock and how long it ran (docs/snapshotter.md,
/// "Where the time goes").
async fn blocking<T: Send + 'static>(
    s: Shared,
    what: &'static str,
    key: String,
    f: impl FnOnce(&mut Snapshotter) -> Result<T, SnapError> + Send + 'static,
) -> Result<T, Status> {
    let r = tokio::task::spawn_blocking(move || {
        let t0 = Instant::now();
        let mut g = s.lock().unwrap_or_else(|p| p.into_inner());
        let t1 = Instant::now();
        let r = f(&mut g);
        drop(g);
        timing(what, &key, t1 - t0, t1.elapsed());
        r
    })
    .await
    .map_err(|e| Status::internal(format!("{what}: {e}")))?;
    if let Err(e) = &r {
        tracing::debug!("{what}: {e}");
    }
    Ok(r?)
}

/// Logs one call's lock wait and run time (debug level).
pub(crate) fn timing(what: &str, key: &str, wait: Duration, ran: Duration) {
    tracing::debug!(
        "call {what} {key:?}: lock wait {:.3} ms, ran {:.3} ms",
        wait.as_secs_f64() * 1e3,
        ran.as_secs_f64() * 1e3
    );
}

/// One unary method: a function from the request to the response.
struct Unary<Req, Resp> {
    s: Shared,
    f: fn(Shared, Req) -> BoxFuture<Result<Resp, Status>>,
}

impl<Req: Send + 'static, Resp: Send + 'static> UnaryService<Req> for Unary<Req, Resp> {
    type Response = Resp;
    type Future = BoxFuture<Result<Response<Resp>, Status>>;
    fn call(&mut self, req: Request<Req>) -> Self::Future {
        let fut = (self.f)(self.s.clone(), req.into_inner());
        Box::pin(async move { fut.await.map(Response::new) })
    }
}

type ListStream =
    tokio_stream::Iter<std::vec::IntoIter<Result<proto::ListSnapshotsResponse, Status>>>;

struct List(Shared);

impl ServerStreamingService<proto::ListSnapshotsRequest> for List {
    type Response = proto::ListSnapshotsResponse;
    type ResponseStream = ListStream;
    type Future = BoxFuture<Result<Response<ListStream>, Status>>;
    fn call(&mut self, req: Request<proto::ListSnapshotsRequest>) -> Self::Future {
        let s = self.0.clone();
        Box::pin(async move {
            let req = req.into_inner();
            let filters =
                crate::filter::Filters::parse(&req.filters).map_err(Status::invalid_argument)?;
            let mut all = blocking(s, "List", String::new(), |s| Ok(s.list())).await?;
            all.retain(|i| filters.matches(i));
            // Several messages, each of a bounded size.
            let msgs: Vec<_> = all
                .chunks(100)
                .map(|c| Ok(proto::ListSnapshotsResponse { info: c.to_vec() }))
                .collect();
            Ok(Response::new(tokio_stream::iter(msgs)))
        })
    }
}

/// The tonic service.
#[derive(Clone)]
pub struct SnapshotsServer {
    s: Shared,
}

impl SnapshotsServer {
    pub(crate) fn new(s: Shared) -> Self {
        SnapshotsServer { s }
    }
}

impl NamedService for SnapshotsServer {
    const NAME: &'static str = "containerd.services.snapshots.v1.Snapshots";
}

async fn unary<Req, Resp, B>(
    s: Shared,
    f: fn(Shared, Req) -> BoxFuture<Result<Resp, Status>>,
    req: http::Request<B>,
) -> http::Response<tonic::body::Body>
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let mut grpc = Grpc::new(ProstCodec::<Resp, Req>::default());
    grpc.unary(Unary { s, f }, req).await
}

fn prepare(
    s: Shared,
    r: proto::PrepareSnapshotRequest,
) -> BoxFuture<Result<proto::MountsResponse, Status>> {
    Box::pin(async move {
        // A remote Prepare may wait minutes for its pull: when the
        // snapshotter is told to stop, it is answered at once and the pull
        // abandoned (`finish_remote` records nothing once stopping).
        let mut stop = crate::stop_signal();
        let key = r.key.clone();
        let task = tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            let r2 = crate::snap::prepare(&s, &r.key, &r.parent, r.labels);
            timing("Prepare", &r.key, Duration::ZERO, t0.elapsed());
            r2
        });
        let r = tokio::select! {
            r = task => r.map_err(|e| Status::internal(format!("Prepare: {e}")))?,
            _ = stop.wait_for(|s| *s) => {
                tracing::warn!("Prepare {key:?}: the snapshotter is stopping; the call is abandoned");
                return Err(Status::unavailable(format!(
                    "Prepare {key:?}: cairn snapshotter is stopping (the remote pull was abandoned)"
                )));
            }
        };
        if let Err(e) = &r {
            tracing::debug!("Prepare: {e}");
        }
        Ok(proto::MountsResponse { mounts: r? })
    })
}

fn view(
    s: Shared,
    r: proto::ViewSnapshotRequest,
) -> BoxFuture<Result<proto::MountsResponse, Status>> {
    Box::pin(async move {
        let mounts = blocking(s, "View", r.key.clone(), move |s| {
            s.view(&r.key, &r.parent, r.labels)
        })
        .await?;
        Ok(proto::MountsResponse { mounts })
    })
}

fn mounts(s: Shared, r: proto::MountsRequest) -> BoxFuture<Result<proto::MountsResponse, Status>> {
    Box::pin(async move {
        let mounts = blocking(s, "Mounts", r.key.clone(), move |s| s.mounts(&r.key)).await?;
        Ok(proto::MountsResponse { mounts })
    })
}

fn commit(s: Shared, r: proto::CommitSnapshotRequest) -> BoxFuture<Result<(), Status>> {
    Box::pin(async move {
        let r = tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            let r2 = crate::snap::commit(&s, &r.name, &r.key, r.labels);
            timing("Commit", &r.key, Duration::ZERO, t0.elapsed());
            r2
        })
        .await
        .map_err(|e| Status::internal(format!("Commit: {e}")))?;
        if let Err(e) = &r {
            tracing::debug!("Commit: {e}");
        }
        Ok(r?)
    })
}

fn remove(s: Shared, r: proto::KeyRequest) -> BoxFuture<Result<(), Status>> {
    Box::pin(async move { blocking(s, "Remove", r.key.clone(), move |s| s.remove(&r.key)).await })
}

fn stat(s: Shared, r: proto::KeyRequest) -> BoxFuture<Result<proto::InfoResponse, Status>> {
    Box::pin(async move {
        let info = blocking(s, "Stat", r.key.clone(), move |s| s.info(&r.key)).await?;
        Ok(proto::InfoResponse { info: Some(info) })
    })
}

fn update(
    s: Shared,
    r: proto::UpdateSnapshotRequest,
) -> BoxFuture<Result<proto::InfoResponse, Status>> {
    Box::pin(async move {
        let info = r
            .info
            .ok_or_else(|| Status::invalid_argument("Update without info"))?;
        let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
        let key = info.name.clone();
        let info = blocking(s, "Update", key, move |s| s.update(info, &paths)).await?;
        Ok(proto::InfoResponse { info: Some(info) })
    })
}

fn usage(s: Shared, r: proto::KeyRequest) -> BoxFuture<Result<proto::UsageResponse, Status>> {
    Box::pin(async move {
        let u = blocking(s, "Usage", r.key.clone(), move |s| s.usage(&r.key)).await?;
        Ok(proto::UsageResponse {
            size: u.size,
            inodes: u.inodes,
        })
    })
}

fn cleanup(s: Shared, _r: proto::CleanupRequest) -> BoxFuture<Result<(), Status>> {
    Box::pin(async move { blocking(s, "Cleanup", String::new(), |s| s.cleanup()).await })
}

impl<B> tower_service::Service<http::Request<B>> for SnapshotsServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let s = self.s.clone();
        let method = req
            .uri()
            .path()
            .strip_prefix("/containerd.services.snapshots.v1.Snapshots/")
            .unwrap_or("")
            .to_owned();
        Box::pin(async move {
            let resp = match method.as_str() {
                "Prepare" => unary(s, prepare, req).await,
                "View" => unary(s, view, req).await,
                "Mounts" => unary(s, mounts, req).await,
                "Commit" => unary(s, commit, req).await,
                "Remove" => unary(s, remove, req).await,
                "Stat" => unary(s, stat, req).await,
                "Update" => unary(s, update, req).await,
                "Usage" => unary(s, usage, req).await,
                "Cleanup" => unary(s, cleanup, req).await,
                "List" => {
                    let mut grpc = Grpc::new(ProstCodec::<
                        proto::ListSnapshotsResponse,
                        proto::ListSnapshotsRequest,
                    >::default());
                    grpc.server_streaming(List(s), req).await
                }
                other => Status::unimplemented(format!("no method {other:?}")).into_http(),
            };
            Ok(resp)
        })
    }
}
