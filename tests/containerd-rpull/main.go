// Pulls an image into containerd the way its CRI plugin does for a remote
// snapshotter: client.Pull with unpacking into the named snapshotter and
// the CRI's label handler (pkg/snapshotters.AppendInfoHandlerWrapper),
// which labels each layer with the image ref, manifest and layer digests,
// so that the snapshotter may pull the layers itself.
//
// Built in GOPATH mode (GO111MODULE=off, GOPATH=/usr/share/gocode) by
// crates/cairn/tests/privileged_snapshotter.rs.
//
// Usage: rpull ADDRESS NAMESPACE SNAPSHOTTER REF (plain HTTP to the registry)
//
// With RPULL_USER and RPULL_PASSWORD in the environment the resolver
// authenticates with those credentials (basic, or a token they buy).
//
// With RPULL_NO_MANIFEST_DIGEST=1 in the environment the layers lose the
// containerd.io/snapshot/cri.manifest-digest label again (as from a client
// that does not set it).
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/containerd/containerd"
	"github.com/containerd/containerd/images"
	"github.com/containerd/containerd/namespaces"
	snpkg "github.com/containerd/containerd/pkg/snapshotters"
	"github.com/containerd/containerd/remotes/docker"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

func main() {
	if len(os.Args) != 5 {
		fmt.Fprintln(os.Stderr, "usage: rpull ADDRESS NAMESPACE SNAPSHOTTER REF")
		os.Exit(2)
	}
	address, ns, sn, ref := os.Args[1], os.Args[2], os.Args[3], os.Args[4]
	client, err := containerd.New(address)
	if err != nil {
		fmt.Fprintln(os.Stderr, "connecting:", err)
		os.Exit(1)
	}
	defer client.Close()
	ctx := namespaces.WithNamespace(context.Background(), ns)
	hostOpts := []docker.RegistryOpt{docker.WithPlainHTTP(docker.MatchAllHosts)}
	if user, pass := os.Getenv("RPULL_USER"), os.Getenv("RPULL_PASSWORD"); user != "" && pass != "" {
		hostOpts = append(hostOpts, docker.WithAuthorizer(docker.NewDockerAuthorizer(
			docker.WithAuthCreds(func(string) (string, string, error) { return user, pass, nil }),
		)))
	}
	resolver := docker.NewResolver(docker.ResolverOptions{
		Hosts: docker.ConfigureDefaultRegistries(hostOpts...),
	})
	wrap := snpkg.AppendInfoHandlerWrapper(ref)
	if os.Getenv("RPULL_NO_MANIFEST_DIGEST") == "1" {
		labelled := wrap
		wrap = func(f images.Handler) images.Handler {
			h := labelled(f)
			return images.HandlerFunc(func(ctx context.Context, desc ocispec.Descriptor) ([]ocispec.Descriptor, error) {
				children, err := h.Handle(ctx, desc)
				for i := range children {
					delete(children[i].Annotations, snpkg.TargetManifestDigestLabel)
				}
				return children, err
			})
		}
	}
	img, err := client.Pull(ctx, ref,
		containerd.WithResolver(resolver),
		containerd.WithPullUnpack,
		containerd.WithPullSnapshotter(sn),
		containerd.WithImageHandlerWrapper(wrap),
	)
	if err != nil {
		fmt.Fprintln(os.Stderr, "pulling:", err)
		os.Exit(1)
	}
	fmt.Println(img.Name(), img.Target().Digest)
}
